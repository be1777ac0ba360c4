//! The protocol's messages as owned, validated Rust values. A value of these types has passed
//! the verifier and every semantic check; the node and the clients never touch raw buffers.

use spindle_core::{Band, Decision, TaskId, TaskSpec, TaskState, TenantId, UserId};

use crate::error::WireError;

/// What a client must speak. Hello carries it; a different one is `UnsupportedVersion`.
pub const PROTOCOL_VERSION: u16 = 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFrame {
    pub request_id: u64,
    pub body: Request,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Hello(Hello),
    Submit(SubmitTask),
    SubmitBatch(Vec<SubmitTask>),
    Cancel(TaskId),
    Get(TaskId),
    Subscribe(TaskId),
    Unsubscribe(TaskId),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub protocol_version: u16,
    pub tenant: TenantId,
    pub credential: String,
    pub client_name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmitTask {
    pub idempotency_key: String,
    pub user: UserId,
    pub spec: TaskSpec,
    /// Only ever lowers the tenant's base band (P1..P4; never P0).
    pub band_hint: Option<Band>,
    /// Expire unstarted this many ms after submission.
    pub deadline_ms: Option<u32>,
    /// What to generate, for the provider: one JSON value of at most
    /// [`crate::limits::INPUT_BYTES_MAX`] bytes, as the client sent it.
    pub input: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseFrame {
    /// The request answered; for an event, the Subscribe that asked for it; 0 for an error
    /// about a frame whose request id could not be read.
    pub request_id: u64,
    pub body: Response,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    HelloOk(HelloOk),
    Admission(Admission),
    SubmitBatch(Vec<Admission>),
    Status(TaskStatus),
    Canceled { task: TaskId, state: TaskState },
    Subscribed(TaskId),
    Unsubscribed(TaskId),
    Event(Event),
    Error(WireError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloOk {
    pub protocol_version: u16,
    pub node_id: String,
    pub frame_bytes_max: u32,
    pub batch_max: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    pub task: TaskId,
    pub decision: Decision,
    pub reason: Option<String>,
    /// The idempotency key was seen before: `task` is the original.
    pub replay: bool,
    pub queue_level: u8,
    pub expected_start_ms: u32,
    /// For a refusal about the node's load: send again no sooner than this (ms); 0: no hint.
    pub retry_after_ms: u32,
}

impl Admission {
    /// How long to wait before sending this task again, where the node refused it for its
    /// load and said (`retry_after_ms`); `None` otherwise.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        (self.retry_after_ms > 0)
            .then(|| std::time::Duration::from_millis(self.retry_after_ms.into()))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStatus {
    pub task: TaskId,
    pub state: TaskState,
    pub version: u32,
    pub attempt_no: u32,
    pub progress_pct: u8,
    pub cost_estimate_milli: u64,
    pub cost_actual_milli: u64,
    pub failure_reason: Option<String>,
    /// What a SUCCEEDED task produced (JSON, at most `RESULT_BYTES_MAX`).
    pub result: Option<String>,
    /// For a QUEUED task its node holds live: when it is expected to start, in ms from this
    /// answer; 0 otherwise.
    pub expected_start_ms: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub task: TaskId,
    pub state: TaskState,
    pub progress_pct: u8,
    pub at_ms: u64,
    /// With SUCCEEDED: what the task produced (JSON, as `TaskStatus::result`).
    pub result: Option<String>,
}
