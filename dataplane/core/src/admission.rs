//! Admission decisions (design.md §4): every outcome is a value with a reason.

use std::fmt;

use serde::Serialize;

use crate::cost::{CostError, CostEstimate, ResourceClass};
use crate::ids::{Band, Lane, ProviderId, TaskId, TenantId};
use crate::ledger::LimitKey;
use crate::state::TaskState;
use crate::time::Time;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Decision {
    Accepted,
    AcceptedBestEffort,
    RejectUserRateLimit,
    RejectTenantQueueFull,
    RejectExpectedWaitTooLong,
    RejectCostBudget,
    RejectResourceClassDisabled,
    RejectPlatformOverloaded,
    /// Not the core's: the store found the idempotency key already used by another request
    /// (retrying it changes nothing, unlike an overload).
    RejectIdempotencyConflict,
    /// A periodic quota of the tenant, of its user, or of its use of the model is spent for
    /// this period (`crate::quota`); the reason names it and when it resets.
    RejectQuotaExhausted,
}

impl Decision {
    pub const ALL: [Decision; 10] = [
        Decision::Accepted,
        Decision::AcceptedBestEffort,
        Decision::RejectUserRateLimit,
        Decision::RejectTenantQueueFull,
        Decision::RejectExpectedWaitTooLong,
        Decision::RejectCostBudget,
        Decision::RejectResourceClassDisabled,
        Decision::RejectPlatformOverloaded,
        Decision::RejectIdempotencyConflict,
        Decision::RejectQuotaExhausted,
    ];

    pub fn is_accepted(self) -> bool {
        matches!(self, Decision::Accepted | Decision::AcceptedBestEffort)
    }

    pub fn name(self) -> &'static str {
        match self {
            Decision::Accepted => "ACCEPTED",
            Decision::AcceptedBestEffort => "ACCEPTED_BEST_EFFORT",
            Decision::RejectUserRateLimit => "REJECT_USER_RATE_LIMIT",
            Decision::RejectTenantQueueFull => "REJECT_TENANT_QUEUE_FULL",
            Decision::RejectExpectedWaitTooLong => "REJECT_EXPECTED_WAIT_TOO_LONG",
            Decision::RejectCostBudget => "REJECT_COST_BUDGET",
            Decision::RejectResourceClassDisabled => "REJECT_RESOURCE_CLASS_DISABLED",
            Decision::RejectPlatformOverloaded => "REJECT_PLATFORM_OVERLOADED",
            Decision::RejectIdempotencyConflict => "REJECT_IDEMPOTENCY_CONFLICT",
            Decision::RejectQuotaExhausted => "REJECT_QUOTA_EXHAUSTED",
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a rejection happened, precise enough to act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum RejectReason {
    /// A limit was full (rate bucket empty, queue gate full).
    Limit(LimitKey),
    ExpectedWait {
        wait_ms: u64,
        max_ms: u64,
    },
    LaneClosed(Lane),
    ClassNotAllowed(ResourceClass),
    CostQuota {
        needed_milli: u64,
        remaining_milli: u64,
    },
    /// The task costs more than its cost budget (`limit`: its lane's own, or the platform's)
    /// can ever let start at once on this shard, so it could never start.
    CostBurst {
        limit: LimitKey,
        needed_milli: u64,
        burst_milli: u64,
    },
    /// The shard holds `TASKS_MAX` tasks.
    ShardFull,
    /// An operator suspended the tenant (`TenantPolicy::suspended`).
    TenantSuspended,
    /// The tenant holds `USERS_PER_TENANT_MAX` user records here (users with work or a rate
    /// still refilling); one more user waits until some go idle.
    TooManyUsers(usize),
    /// A periodic quota is spent for this period.
    Quota(crate::quota::Exhausted),
    /// The shard counts `QUOTA_USAGE_MAX` quota periods already: a new user's or model's
    /// count waits until past periods' are let go.
    QuotaBooksFull(usize),
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::Limit(key) => write!(f, "limit {key} is full"),
            RejectReason::ExpectedWait { wait_ms, max_ms } => {
                write!(
                    f,
                    "expected wait {wait_ms} ms exceeds the tenant's maximum {max_ms} ms"
                )
            }
            RejectReason::LaneClosed(lane) => write!(f, "lane {lane} is closed to new work"),
            RejectReason::ClassNotAllowed(class) => {
                write!(f, "resource class {class:?} is not enabled for this tenant")
            }
            RejectReason::CostQuota {
                needed_milli,
                remaining_milli,
            } => write!(
                f,
                "cost quota: task needs {needed_milli} milli-cost, {remaining_milli} remain"
            ),
            RejectReason::CostBurst {
                limit,
                needed_milli,
                burst_milli,
            } => write!(
                f,
                "the task's cost ({needed_milli} milli) is more than {limit} lets start at once \
                 ({burst_milli} milli): it could never start"
            ),
            RejectReason::ShardFull => write!(f, "the shard holds its maximum number of tasks"),
            RejectReason::TenantSuspended => {
                f.write_str("the tenant is suspended: it takes no new work until it is resumed")
            }
            RejectReason::TooManyUsers(max) => write!(
                f,
                "the tenant has {max} users with work or recent submits here; a new user's \
                 submits wait until some of them are idle"
            ),
            RejectReason::Quota(exhausted) => write!(f, "{exhausted}"),
            RejectReason::QuotaBooksFull(max) => write!(
                f,
                "the shard counts {max} quota periods already; a new user's or model's count \
                 waits until past periods are let go"
            ),
        }
    }
}

/// A coarse position: exact positions are unstable under fair scheduling (design.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum QueueLevel {
    Immediate,
    Short,
    Medium,
    Long,
}

impl QueueLevel {
    pub fn from_wait_ms(wait_ms: u64) -> QueueLevel {
        match wait_ms {
            0..=999 => QueueLevel::Immediate,
            1_000..=59_999 => QueueLevel::Short,
            60_000..=599_999 => QueueLevel::Medium,
            _ => QueueLevel::Long,
        }
    }
}

/// The answer to a submit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Admission {
    pub task: TaskId,
    pub decision: Decision,
    pub reason: Option<RejectReason>,
    pub lane: Lane,
    pub band: Band,
    /// The server's estimate of the task (its `fairness` is what DRR charges).
    pub estimate: CostEstimate,
    /// Set when accepted.
    pub estimated_start_at: Option<Time>,
    pub queue_level: Option<QueueLevel>,
}

/// A submit the core cannot even decide on: the request itself is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    UnknownTenant(TenantId),
    DuplicateTask(TaskId),
    InvalidSpec(CostError),
    /// A resumed attempt names a provider the policy does not have.
    UnknownProvider(ProviderId),
    /// Only attempts in SUBMIT_UNKNOWN or RUNNING can be resumed.
    NotResumable(TaskId, TaskState),
    /// A task put back with no attempt left under `limits::ATTEMPTS_MAX`.
    AttemptsExhausted(TaskId, u32),
}

impl fmt::Display for SubmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubmitError::UnknownTenant(t) => write!(f, "tenant {t} has no policy"),
            SubmitError::DuplicateTask(t) => write!(f, "task {t} is already known to this shard"),
            SubmitError::InvalidSpec(e) => write!(f, "invalid task spec: {e}"),
            SubmitError::UnknownProvider(p) => write!(f, "provider {} is not in the policy", p.0),
            SubmitError::NotResumable(t, s) => {
                write!(f, "task {t}: an attempt in {s} cannot be resumed")
            }
            SubmitError::AttemptsExhausted(t, n) => write!(
                f,
                "task {t} had {n} attempts, the most any task gets ({})",
                crate::limits::ATTEMPTS_MAX
            ),
        }
    }
}

impl std::error::Error for SubmitError {}
