//! The generic async-job provider API, as JSON over HTTP/1.1. The mock provider serves it and
//! the HTTP adapter speaks it; a real provider's adapter maps its own API onto these types.
//!
//! ```text
//! POST /v1/jobs                          SubmitBody → 202 JobView (200 + the original job for a
//!                                        repeated request key) | 429 Problem{retry_after_ms}
//!                                        | 400/401/402/422 Problem (never retry) | 5xx
//! GET  /v1/jobs/{job_id}                 → 200 JobView | 404
//! GET  /v1/jobs?account=A&request_key=K  → 200 JobView | 404 (a definite "never accepted")
//! GET  /v1/jobs?account=A&live=true&after=J&limit=N
//!                                        → 200 JobPage: the account's queued and running jobs
//!                                        in job order after J, at most N (1..=1000)
//! POST /v1/jobs/{job_id}/cancel          → 200 JobView | 404
//! callback: POST callback_url, body JobView, header
//!           x-signature: t=<unix ms>,sha256=<hex HMAC-SHA256(secret, "<t>." body)>
//! ```

use serde::{Deserialize, Serialize};

/// Bytes of a request key (spindle's is `spindle-{task}-{attempt}`).
pub const REQUEST_KEY_BYTES_MAX: usize = 128;
/// Bytes of any body either side accepts.
pub const BODY_BYTES_MAX: usize = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitBody {
    pub account: String,
    /// The caller's idempotency key for this attempt: a repeat returns the original job.
    pub request_key: String,
    pub model: String,
    /// What to generate; opaque to spindle.
    pub input: serde_json::Value,
    /// Where the provider posts the job's state changes; none: the caller polls.
    pub callback_url: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Queued,
    Running,
    Succeeded,
    Failed,
    Canceled,
}

impl JobState {
    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Canceled
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobView {
    pub job_id: String,
    pub account: String,
    pub request_key: String,
    pub state: JobState,
    /// 0–100.
    pub progress: u8,
    /// What the job cost, in milli cost units, once it succeeded.
    pub cost_milli: Option<u64>,
    /// Why it failed.
    pub error: Option<String>,
    /// Whether a failed job may succeed if tried again.
    #[serde(default)]
    pub retryable: bool,
    /// Where the generated video can be fetched, once the job succeeded.
    #[serde(default)]
    pub output_url: Option<String>,
}

impl JobView {
    /// A job just taken: queued, its ids and nothing more known yet.
    pub fn queued(job_id: impl Into<String>, account: &str, request_key: &str) -> JobView {
        JobView {
            job_id: job_id.into(),
            account: account.to_string(),
            request_key: request_key.to_string(),
            state: JobState::Queued,
            progress: 0,
            cost_milli: None,
            error: None,
            retryable: false,
            output_url: None,
        }
    }
}

/// Most jobs one page of a listing holds.
pub const JOB_PAGE_MAX: usize = 1_000;

/// One page of an account's live jobs (`GET /v1/jobs?account=A&live=true`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobPage {
    pub jobs: Vec<JobView>,
    /// Where the next page starts (`after=`); `None`: this was the last.
    pub next: Option<String>,
}

/// The error classes a provider answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProblemKind {
    RateLimited,
    Auth,
    Balance,
    InvalidParameters,
    Moderation,
    Unavailable,
    NotFound,
}

impl ProblemKind {
    /// The HTTP status that carries it.
    pub fn status(self) -> u16 {
        match self {
            ProblemKind::RateLimited => 429,
            ProblemKind::Auth => 401,
            ProblemKind::Balance => 402,
            ProblemKind::InvalidParameters => 400,
            ProblemKind::Moderation => 422,
            ProblemKind::Unavailable => 503,
            ProblemKind::NotFound => 404,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    pub error: ProblemKind,
    pub message: String,
    /// For `rate_limited`: when to try again.
    pub retry_after_ms: Option<u64>,
}

/// Per-account counters the mock provider keeps (GET /v1/stats).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountStats {
    pub accepted: u64,
    pub completed: u64,
    pub failed: u64,
    /// Submits answered 429 because the account's real limits said so (not violations).
    pub rate_limited: u64,
    /// Submits that arrived while the account already ran its contracted concurrency.
    pub concurrency_violations: u64,
    /// Submits beyond the contracted requests per minute.
    pub rpm_violations: u64,
    /// Submits whose request key had been accepted before (answered with the original job).
    pub duplicate_keys: u64,
    pub callbacks_sent: u64,
    pub in_flight: u64,
    pub max_in_flight: u64,
    /// Live jobs stopped by a cancel (a cancel of an ended job changes nothing, and is not
    /// counted).
    #[serde(default)]
    pub canceled: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    pub accounts: std::collections::BTreeMap<String, AccountStats>,
    /// The most job requests (submits, queries, cancels) the mock was answering at once.
    #[serde(default)]
    pub max_open_requests: u64,
}

/// Fault modes of a mock account (POST /v1/admin/faults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Healthy.
    None,
    /// A 429 storm: the account's real limits are half of the contract; beyond them every
    /// submit is answered 429 with a retry hint.
    RateLimit,
    /// Accepts the job, then answers only after the caller's timeout.
    TimeoutAfterAccept,
    /// 503 without accepting anything.
    ServerError,
    /// Jobs take ten times as long.
    Slow,
    /// Never calls back (the caller must poll).
    LostCallback,
    /// Calls back twice for every change.
    DuplicateCallback,
    /// Accepts and runs jobs, but every query (by job id or request key) answers 503.
    QueryOutage,
    /// Non-retryable classes: every submit is refused with it.
    Auth,
    Balance,
    InvalidParameters,
    Moderation,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultBody {
    pub account: String,
    pub fault: Fault,
}
