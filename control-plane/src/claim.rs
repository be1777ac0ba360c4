//! Batched claims: N claims, one transaction, one round trip. Each claim is all-or-nothing: the
//! task's CAS QUEUED → DISPATCHING, every demanded pool shard charged, the attempt with a fresh
//! fencing token, its ACTIVE reservations and the outbox event — or nothing, with the reason.
//! Global limits hold across any number of nodes because this is the only path that grants.

use spindle_core::{AttemptId, FencingToken, TaskId, TaskState};

use crate::db::{Call, Db};
use crate::error::{
    check_answered, check_batch_len, check_text, to_i64, BatchTasks, InputError, StoreError,
};
use crate::limits::{DEMANDS_PER_CLAIM_MAX, NAME_BYTES_MAX, POOL_KEY_BYTES_MAX};
use crate::types::{parse_state, PartitionId, PoolShard};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand {
    pub shard: PoolShard,
    pub amount: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    pub task: TaskId,
    /// The task's version as the node last saw it (0 after submit).
    pub expected_version: u32,
    pub provider: String,
    pub demands: Vec<Demand>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimResult {
    Granted {
        attempt: AttemptId,
        token: FencingToken,
        attempt_no: u32,
        /// The provider request key of this attempt: unique, reused on retry of this attempt.
        request_key: String,
    },
    Refused(ClaimRefusal),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimRefusal {
    TaskGone,
    /// The task is no longer QUEUED at the expected version (canceled, claimed elsewhere…).
    VersionMoved {
        state: TaskState,
        version: u32,
    },
    /// The task's partition is not leased to this node (any more).
    PartitionNotOwned(PartitionId),
    /// This pool shard has no room for the demand.
    PoolFull(PoolShard),
    /// No such pool shard exists.
    UnknownPool(PoolShard),
}

/// Joins a claim's pool keys into one text for `spindle_claim` (`sql/functions/spindle_claim.sql`), which splits it
/// into the attempt's `res_pool` without aggregating the flat demand arrays per claim. Pool
/// keys never contain control characters (checked in `validate`).
const POOL_KEY_SEPARATOR: char = '\u{1f}';

/// The provider request key of an attempt (also built by `spindle_claim` in SQL).
pub fn request_key(task: TaskId, attempt_no: u32) -> String {
    format!("spindle-{}-{attempt_no}", task.0)
}

pub(crate) fn validate(node: &str, batch: &[ClaimRequest]) -> Result<(), InputError> {
    check_batch_len(batch.len())?;
    check_text(0, "node", node, NAME_BYTES_MAX)?;
    let mut tasks = BatchTasks::default();
    for (row, c) in batch.iter().enumerate() {
        tasks.check(row, c.task)?;
        validate_claim(row, c)?;
    }
    Ok(())
}

/// One claim's provider and demands (the batch's rows are checked by the caller).
pub(crate) fn validate_claim(row: usize, c: &ClaimRequest) -> Result<(), InputError> {
    check_text(row, "provider", &c.provider, NAME_BYTES_MAX)?;
    if c.demands.len() > DEMANDS_PER_CLAIM_MAX {
        return Err(InputError::TooManyDemands {
            row,
            count: c.demands.len(),
            max: DEMANDS_PER_CLAIM_MAX,
        });
    }
    for (i, d) in c.demands.iter().enumerate() {
        check_text(row, "pool", &d.shard.pool, POOL_KEY_BYTES_MAX)?;
        // The claim's pool keys travel joined by a control character (POOL_KEY_SEPARATOR).
        if d.shard.pool.chars().any(char::is_control) {
            return Err(InputError::Illegal {
                row,
                reason: format!("pool key {:?} contains a control character", d.shard.pool),
            });
        }
        if d.amount == 0 {
            return Err(InputError::OutOfRange {
                row,
                field: "amount",
                value: "0".into(),
            });
        }
        to_i64(row, "amount", d.amount)?;
        if c.demands[..i].iter().any(|e| e.shard == d.shard) {
            return Err(InputError::DuplicateDemand {
                row,
                pool: d.shard.pool.clone(),
                shard: d.shard.shard,
            });
        }
    }
    Ok(())
}

/// The claims of a batch as the batch functions take them: one provider per row (`None` for a
/// row without a claim, which holds no demand), and the demands flat, row `i`'s at
/// `dstart[i]` (1-based) for `dcount[i]`, its pool keys also joined by `POOL_KEY_SEPARATOR`.
#[derive(Debug, Default)]
pub(crate) struct ClaimArrays<'a> {
    pub provider: Vec<Option<&'a str>>,
    pub dstart: Vec<i32>,
    pub dcount: Vec<i32>,
    pub pool: Vec<&'a str>,
    pub shard: Vec<i16>,
    pub amount: Vec<i64>,
    pub pools_joined: Vec<Option<String>>,
}

impl<'a> ClaimArrays<'a> {
    /// The arrays as statement parameters, in the batch functions' order.
    pub fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 7] {
        [
            &self.provider,
            &self.dstart,
            &self.dcount,
            &self.pool,
            &self.shard,
            &self.amount,
            &self.pools_joined,
        ]
    }

    pub fn new(claims: impl ExactSizeIterator<Item = Option<&'a ClaimRequest>> + Clone) -> Self {
        let rows = claims.len();
        let demands: usize = claims.clone().flatten().map(|c| c.demands.len()).sum();
        let mut a = ClaimArrays {
            provider: Vec::with_capacity(rows),
            dstart: Vec::with_capacity(rows),
            dcount: Vec::with_capacity(rows),
            pool: Vec::with_capacity(demands),
            shard: Vec::with_capacity(demands),
            amount: Vec::with_capacity(demands),
            pools_joined: Vec::with_capacity(rows),
        };
        for c in claims {
            // PostgreSQL arrays are 1-based.
            a.dstart.push(a.pool.len() as i32 + 1);
            let Some(c) = c else {
                a.provider.push(None);
                a.dcount.push(0);
                a.pools_joined.push(None);
                continue;
            };
            a.provider.push(Some(c.provider.as_str()));
            a.dcount.push(c.demands.len() as i32);
            let mut joined = String::new();
            for (i, d) in c.demands.iter().enumerate() {
                a.pool.push(d.shard.pool.as_str());
                a.shard.push(d.shard.shard as i16);
                a.amount.push(d.amount as i64);
                if i > 0 {
                    joined.push(POOL_KEY_SEPARATOR);
                }
                joined.push_str(&d.shard.pool);
            }
            a.pools_joined.push(Some(joined));
        }
        a
    }
}

impl Db {
    /// Claims `batch` for `node`; attempts hold a lease of `lease_ms`. One result per row.
    pub async fn claim_batch(
        &self,
        node: &str,
        lease_ms: u32,
        batch: &[ClaimRequest],
    ) -> Result<Vec<ClaimResult>, StoreError> {
        validate(node, batch)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let task: Vec<i64> = batch.iter().map(|c| c.task.0 as i64).collect();
        let version: Vec<i32> = batch.iter().map(|c| c.expected_version as i32).collect();
        let a = ClaimArrays::new(batch.iter().map(Some));
        let lease_ms = i64::from(lease_ms);
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            vec![&node, &lease_ms, &task, &version];
        params.extend(a.params());
        let rows = self
            .answered(
                Call::Writes,
                self.client().query(&self.stmts.claim, &params),
            )
            .await?;
        check_answered("claim", &rows, batch.len())?;
        rows.iter()
            .zip(batch)
            .map(|(r, c)| claim_result(c, r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
            .collect()
    }
}

/// Claim `c`'s row: its outcome, and the attempt, token and attempt number of a grant (or the
/// detail of a refusal).
pub(crate) fn claim_result(
    c: &ClaimRequest,
    outcome: &str,
    attempt: Option<i64>,
    token: Option<i64>,
    attempt_no: Option<i32>,
    detail: Option<&str>,
) -> Result<ClaimResult, StoreError> {
    match outcome {
        "GRANTED" => match (attempt, token, attempt_no) {
            (Some(attempt), Some(token), Some(no)) => {
                Ok(granted(c.task, attempt, token, no as u32))
            }
            _ => Err(StoreError::Corrupt(format!(
                "claim of {} granted without its attempt",
                c.task
            ))),
        },
        refused => Ok(ClaimResult::Refused(refusal(refused, detail)?)),
    }
}

/// A claim taken as the task's attempt `attempt_no`.
pub(crate) fn granted(task: TaskId, attempt: i64, token: i64, attempt_no: u32) -> ClaimResult {
    ClaimResult::Granted {
        attempt: AttemptId(attempt as u64),
        token: FencingToken(token as u64),
        attempt_no,
        request_key: request_key(task, attempt_no),
    }
}

fn refusal(outcome: &str, detail: Option<&str>) -> Result<ClaimRefusal, StoreError> {
    let corrupt = || StoreError::Corrupt(format!("claim outcome {outcome} / {detail:?}"));
    let detail = detail.unwrap_or("");
    Ok(match outcome {
        "TASK_GONE" => ClaimRefusal::TaskGone,
        "VERSION_MOVED" => {
            let (state, version) = detail.split_once('@').ok_or_else(corrupt)?;
            ClaimRefusal::VersionMoved {
                state: parse_state(state)?,
                version: version.parse().map_err(|_| corrupt())?,
            }
        }
        "PARTITION_NOT_OWNED" => {
            ClaimRefusal::PartitionNotOwned(PartitionId(detail.parse().map_err(|_| corrupt())?))
        }
        "POOL_FULL" | "UNKNOWN_POOL" => {
            let (pool, shard) = detail.rsplit_once('/').ok_or_else(corrupt)?;
            let shard = PoolShard::new(pool, shard.parse().map_err(|_| corrupt())?);
            if outcome == "POOL_FULL" {
                ClaimRefusal::PoolFull(shard)
            } else {
                ClaimRefusal::UnknownPool(shard)
            }
        }
        _ => return Err(corrupt()),
    })
}
