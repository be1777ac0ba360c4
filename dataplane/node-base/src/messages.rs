//! The messages between the node's parts, in one neutral place: what a shard's inbox takes
//! (from connections, the control plane, the provider and media workers, the admin API) and
//! what those parts send it. Each part owns its own work; none needs another's module to talk
//! to a shard.

use std::path::PathBuf;

use spindle_core::{FencingToken, TaskId, TenantId};
use spindle_providers::{JobView, Lookup, SubmitError};
use spindle_wire::{Response, SubmitTask};
use tokio::sync::{mpsc, oneshot};

pub enum ShardMsg {
    Submit {
        tenant: TenantId,
        tasks: Vec<SubmitTask>,
        batch: bool,
        reply: oneshot::Sender<Response>,
    },
    Get {
        tenant: TenantId,
        task: TaskId,
        reply: oneshot::Sender<Response>,
    },
    Cancel {
        tenant: TenantId,
        task: TaskId,
        reply: oneshot::Sender<Response>,
    },
    /// An operator's cancel of `tasks`, whatever their tenant (`POST /admin/v1/tasks/cancel`):
    /// each one this shard holds live is canceled as its client's cancel is (stored first),
    /// outside the tenant's cancel rate; the answer has one entry per task, `None` for one not
    /// held here.
    AdminCancel {
        tasks: Vec<TaskId>,
        reply: oneshot::Sender<Vec<Option<Response>>>,
    },
    /// Events of `task` go to `out` (the connection's frame queue) tagged `request_id`.
    Subscribe {
        tenant: TenantId,
        task: TaskId,
        request_id: u64,
        out: mpsc::Sender<Vec<u8>>,
        reply: oneshot::Sender<Response>,
    },
    /// Stored tasks to put back (of partitions this node just took over, or requeued by an
    /// operator), and those to fail as not restorable.
    Restore(ShardRestores),
    /// Live attempts the attempts reconciler found lapsed or stuck in PostgreSQL: those this
    /// shard does not hold are followed again, or ended or requeued where they cannot be
    /// (`ShardState::reconcile`).
    Reconcile {
        found: ShardRestores,
        reply: oneshot::Sender<Reconciled>,
    },
    /// What `tenant` consumed of its quotas in the running periods (the admin API).
    Quotas {
        tenant: TenantId,
        reply: oneshot::Sender<(u64, Vec<spindle_core::shard::QuotaReport>)>,
    },
    /// An operator reset `tenant`'s quota counts as of `floor_unix_ms` (stored already).
    ResetQuotas {
        tenant: TenantId,
        floor_unix_ms: u64,
        reply: oneshot::Sender<()>,
    },
    /// An answer from the provider thread.
    Provider(ProviderEvent),
    /// A media job ended.
    Media(MediaEvent),
    /// A media job of `task`'s attempt `token` passed a progress milestone.
    MediaProgress {
        task: TaskId,
        token: FencingToken,
        pct: u8,
    },
    /// One object of a newer policy version (applies to new work; see `spindle_node_control::live_policy`).
    Policy(spindle_core::policy::PolicyPatch),
    /// Every object of this version has been sent: tasks admitted from now on carry it.
    PolicyVersion(spindle_core::PolicyVersion),
    /// Removes this connection's subscriptions of `task` (a connection is one tenant's, so
    /// nothing else can be touched).
    Unsubscribe {
        task: TaskId,
        out: mpsc::Sender<Vec<u8>>,
        reply: oneshot::Sender<Response>,
    },
    /// A connection closed: its subscriptions (of `tasks`, or — `None` — of any task) go at
    /// once, and with them its frame queue's last senders.
    Disconnected {
        tasks: Option<Vec<TaskId>>,
        out: mpsc::Sender<Vec<u8>>,
    },
}

/// What one shard did with the attempts the reconciler handed it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Held here already: nothing to do.
    pub in_hand: u32,
    /// Followed again: a query by request key decides (a job found is watched to its end,
    /// one the provider never got runs as a new attempt).
    pub resumed: u32,
    /// Not followable and still in the provider stage: requeued, in the RECOVERY lane.
    pub requeued: u32,
    /// Not followable and past the provider stage: completed.
    pub completed: u32,
    /// Could not be taken back (failed with the reason).
    pub failed: u32,
}

impl Reconciled {
    /// What was repaired (everything but what was in hand).
    pub fn repairs(&self) -> u32 {
        self.resumed + self.requeued + self.completed + self.failed
    }
}

/// What comes back to the shard.
#[derive(Debug)]
pub enum ProviderEvent {
    Submitted {
        task: TaskId,
        token: FencingToken,
        result: Result<JobView, SubmitError>,
    },
    Resolved {
        task: TaskId,
        token: FencingToken,
        /// `None`: every query of the round failed; the attempt stays SUBMIT_UNKNOWN and is
        /// asked about again later.
        lookup: Option<Lookup>,
    },
    /// The job reached a final state (by callback or by poll).
    Finished {
        task: TaskId,
        token: FencingToken,
        view: JobView,
    },
}

#[derive(Debug)]
pub enum MediaOutcome {
    Done {
        /// One file per rendition, in the ladder's order (none once uploaded, unless
        /// `keep_local`).
        outputs: Vec<PathBuf>,
        /// What the video really is.
        probed: spindle_transcode::MediaInfo,
        /// With `[media.upload]`: the uploaded objects, in the ladder's order.
        uploaded: Option<Vec<Uploaded>>,
    },
    Failed {
        reason: String,
        retryable: bool,
    },
}

/// A rendition put into the bucket: its key, and the URL a result names it by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uploaded {
    pub key: String,
    pub url: String,
}

#[derive(Debug)]
pub struct MediaEvent {
    pub task: TaskId,
    pub token: FencingToken,
    pub outcome: MediaOutcome,
}

/// A task from PostgreSQL for its shard: a QUEUED one, or one whose live attempt the shard
/// follows at the provider.
pub struct Restore {
    pub request: spindle_core::RestoreRequest,
    pub version: u32,
    /// Set for a live attempt (`request.attempts_before` is then its number).
    pub live: Option<LiveRestore>,
    /// Its client canceled it (stored, not yet ended): the shard cancels it once it is back.
    pub cancel: bool,
    /// What to generate, for the provider, if the client sent it (`SubmitTask.input`).
    pub input: Option<Box<str>>,
    /// When its deadline passes (its submission's time plus the deadline it was sent with):
    /// a queued task put back still expires then, and at once if that is past.
    pub deadline_at: Option<std::time::SystemTime>,
    /// When it was submitted: its tenant's quotas count it in that period.
    pub submitted_at: std::time::SystemTime,
}

/// A stored task that cannot be put back as it is (its request unreadable, its live attempt's
/// provider gone from the policy, or refused by the shard's core: tenant or model no longer in
/// the policy, a spec the model no longer takes, attempts used up). Its shard fails it in
/// PostgreSQL with `reason` rather than leave it QUEUED and unserved, or stop the node.
#[derive(Debug)]
pub struct Unrestorable {
    pub task: spindle_core::TaskId,
    /// The live attempt's token, for one that had an attempt.
    pub token: Option<spindle_core::FencingToken>,
    pub reason: String,
}

impl Unrestorable {
    /// `task` (with its live attempt's `token`, if it had one), refused by the shard's core.
    pub fn refused(
        task: spindle_core::TaskId,
        token: Option<spindle_core::FencingToken>,
        why: impl std::fmt::Display,
    ) -> Unrestorable {
        Unrestorable {
            task,
            token,
            reason: format!("task {task}: {why}"),
        }
    }
}

/// What one shard takes back from PostgreSQL.
#[derive(Default)]
pub struct ShardRestores {
    pub tasks: Vec<Restore>,
    pub unrestorable: Vec<Unrestorable>,
    /// Tenants with periodic quotas whose partitions come back: their counts start again from
    /// what PostgreSQL holds — the tasks put back, and `consumed`.
    pub quota_tenants: Vec<spindle_core::TenantId>,
    /// What their ended tasks consumed in the periods still running.
    pub consumed: Vec<spindle_control::reconcile::Consumed>,
    /// For those whose counts an operator reset: the floor (unix ms) before which nothing
    /// counts.
    pub quota_floors: Vec<(spindle_core::TenantId, u64)>,
}

impl ShardRestores {
    /// One empty set for each of `shards` shards.
    pub fn per_shard(shards: u32) -> Vec<ShardRestores> {
        (0..shards).map(|_| ShardRestores::default()).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty() && self.unrestorable.is_empty() && self.quota_tenants.is_empty()
    }
}

/// A live attempt at the HTTP provider, resumed instead of submitted again.
pub struct LiveRestore {
    pub provider: spindle_core::ProviderId,
    pub token: spindle_core::FencingToken,
    /// As stored: DISPATCHING, SUBMIT_UNKNOWN, RUNNING, PROVIDER_SUCCEEDED or
    /// MEDIA_PROCESSING.
    pub stored: spindle_core::TaskState,
    pub request_key: String,
    /// How long ago the attempt started (its lane's execution timeout counts from then).
    pub running_ms: u64,
}

/// What a task's payload holds: the client's request as the node read it. Its JSON is what a
/// replay is compared with, and what a restart rebuilds the task from.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct StoredRequest {
    pub user: u32,
    pub spec: spindle_core::TaskSpec,
    pub band_hint: Option<spindle_core::Band>,
    pub deadline_ms: Option<u32>,
    /// What to generate, for the provider: the client's JSON value, embedded as it came (not
    /// escaped into a string, so the payload is the input's size plus the rest's, within
    /// `STORED_REQUEST_BYTES_MAX`). Absent when the client sent none, so such a task's
    /// payload is what it was before inputs existed (and a replay of it still matches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<Box<serde_json::value::RawValue>>,
}
