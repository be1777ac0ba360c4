//! Group-commit submit: many submits, one transaction, one round trip; each answered only after
//! the commit. Idempotent on (tenant, idempotency key).

use spindle_core::{Band, Lane, PolicyVersion, TaskId, TaskState, TenantId, UserId};

use crate::claim::{granted, validate_claim, ClaimArrays, ClaimRequest, ClaimResult};
use crate::db::{Call, Db};
use crate::error::{
    check_answered, check_batch_len, check_text, to_i64, BatchTasks, InputError, StoreError,
};
use crate::limits::{IDEMPOTENCY_KEY_BYTES_MAX, NAME_BYTES_MAX, PARTITIONS_MAX, PAYLOAD_BYTES_MAX};
use crate::types::{parse_state, PartitionId};

/// A task the node admitted and now makes durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewTask {
    /// From a block of `Db::reserve_task_ids`.
    pub task: TaskId,
    pub tenant: TenantId,
    pub user: UserId,
    pub idempotency_key: String,
    /// The canonical encoding of the request: a replay must match it byte for byte.
    pub payload: Vec<u8>,
    pub partition: PartitionId,
    pub lane: Lane,
    pub band: Band,
    pub cost_estimate_milli: u64,
    pub fairness_milli: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitOutcome {
    /// Committed as QUEUED, the cost estimate reserved in the tenant's budget.
    Created,
    /// The key was used before with the same payload: the original task.
    Replay { task: TaskId, state: TaskState },
    /// The key was used before with a different payload: nothing changed.
    Conflict { task: TaskId },
    /// The tenant's budget cannot cover the estimate: nothing changed.
    QuotaExceeded { remaining_milli: i64 },
    /// The submitting node does not hold this partition's lease (any more): nothing changed.
    PartitionNotOwned(PartitionId),
}

/// A row of a submit that carried claims ([`Db::submit_claim_batch_as`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedSubmit {
    pub outcome: SubmitOutcome,
    /// [`ClaimResult::Granted`] when the row's claim was taken in the submit's transaction:
    /// the task is DISPATCHING at version 1 with its first attempt. `None` when the row carried
    /// no claim or the batch went unclaimed (a pool without room for all of it, a key seen
    /// before, a partition not held): a created task is then QUEUED, to be claimed as before.
    pub claim: Option<ClaimResult>,
}

fn validate(batch: &[NewTask]) -> Result<(), InputError> {
    check_batch_len(batch.len())?;
    let mut tasks = BatchTasks::default();
    for (row, t) in batch.iter().enumerate() {
        tasks.check(row, t.task)?;
        check_text(
            row,
            "idempotency_key",
            &t.idempotency_key,
            IDEMPOTENCY_KEY_BYTES_MAX,
        )?;
        if t.payload.len() > PAYLOAD_BYTES_MAX {
            return Err(InputError::TooLong {
                row,
                field: "payload",
                len: t.payload.len(),
                max: PAYLOAD_BYTES_MAX,
            });
        }
        if t.partition.0 >= PARTITIONS_MAX {
            return Err(InputError::OutOfRange {
                row,
                field: "partition",
                value: t.partition.0.to_string(),
            });
        }
        to_i64(row, "cost_estimate_milli", t.cost_estimate_milli)?;
        to_i64(row, "fairness_milli", t.fairness_milli)?;
    }
    Ok(())
}

impl Db {
    /// A block of task ids no other node gets: `[start, start + 4096)`.
    pub async fn reserve_task_ids(&self) -> Result<std::ops::Range<u64>, StoreError> {
        // A block lost with its answer is a gap in the ids, nothing more: not in doubt.
        let start: i64 = self
            .answered(
                Call::Reads,
                self.client()
                    .query_one("SELECT nextval('task_id_block')", &[]),
            )
            .await?
            .get(0);
        let start = u64::try_from(start)
            .map_err(|_| StoreError::Corrupt(format!("task id block {start}")))?;
        Ok(start..start + crate::types::TASK_ID_BLOCK)
    }

    /// Commits `batch` in one transaction; one outcome per row, in order. Not fenced by any
    /// lease: what a node submits goes through [`Db::submit_batch_as`].
    pub async fn submit_batch(
        &self,
        batch: &[NewTask],
        policy_version: PolicyVersion,
    ) -> Result<Vec<SubmitOutcome>, StoreError> {
        self.submit(None, batch, policy_version).await
    }

    /// [`Db::submit_batch`] for `node`, fenced by its leases (`spindle_submit_leased`): a row whose
    /// partition `node` does not hold now is answered [`SubmitOutcome::PartitionNotOwned`] and
    /// not written.
    pub async fn submit_batch_as(
        &self,
        node: &str,
        batch: &[NewTask],
        policy_version: PolicyVersion,
    ) -> Result<Vec<SubmitOutcome>, StoreError> {
        check_text(0, "node", node, NAME_BYTES_MAX)?;
        self.submit(Some(node), batch, policy_version).await
    }

    /// [`Db::submit_batch_as`] where row `i` may carry its task's first claim (`claims[i]`,
    /// at expected version 0), taken in the same transaction when the whole batch can be
    /// (`spindle_submit_claim`): one transaction instead of a submit and then a claim, and the claimed
    /// rows written once. `lease_ms` is the attempts' lease, as for [`Db::claim_batch`].
    pub async fn submit_claim_batch_as(
        &self,
        node: &str,
        lease_ms: u32,
        batch: &[NewTask],
        claims: &[Option<ClaimRequest>],
        policy_version: PolicyVersion,
    ) -> Result<Vec<ClaimedSubmit>, StoreError> {
        check_text(0, "node", node, NAME_BYTES_MAX)?;
        validate(batch)?;
        validate_claims(batch, claims)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let columns = Columns::new(batch, policy_version);
        let a = ClaimArrays::new(claims.iter().map(Option::as_ref));
        let lease_ms = i64::from(lease_ms);
        let mut params = columns.params();
        params.insert(0, &lease_ms);
        params.insert(0, &node);
        params.extend(a.params());
        let rows = self
            .answered(
                Call::Writes,
                self.client().query(&self.stmts.submit_claim, &params),
            )
            .await?;
        check_answered("submit", &rows, batch.len())?;
        rows.iter()
            .zip(batch)
            .map(|(r, t)| {
                let outcome = outcome(r)?;
                let token: Option<i64> = r.get(5);
                let claim = match (&outcome, token) {
                    (SubmitOutcome::Created, Some(token)) => Some(granted(t.task, token, token, 1)),
                    (_, None) => None,
                    (other, Some(_)) => {
                        return Err(StoreError::Corrupt(format!("{other:?} with a claim")))
                    }
                };
                Ok(ClaimedSubmit { outcome, claim })
            })
            .collect()
    }

    async fn submit(
        &self,
        node: Option<&str>,
        batch: &[NewTask],
        policy_version: PolicyVersion,
    ) -> Result<Vec<SubmitOutcome>, StoreError> {
        validate(batch)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let columns = Columns::new(batch, policy_version);
        let mut params = columns.params();
        let statement = match &node {
            Some(node) => {
                params.insert(0, node);
                &self.stmts.submit_leased
            }
            None => &self.stmts.submit,
        };
        let rows = self
            .answered(Call::Writes, self.client().query(statement, &params))
            .await?;
        check_answered("submit", &rows, batch.len())?;
        rows.iter().map(outcome).collect()
    }
}

/// A submit batch as the submit functions take it, column by column.
struct Columns<'a> {
    task: Vec<i64>,
    tenant: Vec<i32>,
    user: Vec<i32>,
    key: Vec<&'a str>,
    payload: Vec<&'a [u8]>,
    partition: Vec<i32>,
    lane: Vec<i16>,
    band: Vec<i16>,
    cost: Vec<i64>,
    fairness: Vec<i64>,
    version: i64,
}

impl<'a> Columns<'a> {
    fn new(batch: &'a [NewTask], policy_version: PolicyVersion) -> Self {
        Columns {
            task: batch.iter().map(|t| t.task.0 as i64).collect(),
            tenant: batch.iter().map(|t| t.tenant.0 as i32).collect(),
            user: batch.iter().map(|t| t.user.0 as i32).collect(),
            key: batch.iter().map(|t| t.idempotency_key.as_str()).collect(),
            payload: batch.iter().map(|t| t.payload.as_slice()).collect(),
            partition: batch.iter().map(|t| t.partition.0 as i32).collect(),
            lane: batch.iter().map(|t| t.lane.index() as i16).collect(),
            band: batch.iter().map(|t| t.band.index() as i16).collect(),
            cost: batch.iter().map(|t| t.cost_estimate_milli as i64).collect(),
            fairness: batch.iter().map(|t| t.fairness_milli as i64).collect(),
            version: policy_version.0 as i64,
        }
    }

    fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        vec![
            &self.task,
            &self.tenant,
            &self.user,
            &self.key,
            &self.payload,
            &self.partition,
            &self.lane,
            &self.band,
            &self.cost,
            &self.fairness,
            &self.version,
        ]
    }
}

/// A row's claim is its own task's first (expected version 0), well formed.
fn validate_claims(batch: &[NewTask], claims: &[Option<ClaimRequest>]) -> Result<(), InputError> {
    if claims.len() != batch.len() {
        return Err(InputError::Illegal {
            row: claims.len().min(batch.len()),
            reason: format!("{} claims for {} submits", claims.len(), batch.len()),
        });
    }
    for (row, (t, c)) in batch.iter().zip(claims).enumerate() {
        let Some(c) = c else {
            continue;
        };
        if c.task != t.task || c.expected_version != 0 {
            return Err(InputError::Illegal {
                row,
                reason: format!(
                    "a submit carries its own task's first claim, not {}@{}",
                    c.task, c.expected_version
                ),
            });
        }
        validate_claim(row, c)?;
    }
    Ok(())
}

/// A submit function's answer for one row.
fn outcome(r: &tokio_postgres::Row) -> Result<SubmitOutcome, StoreError> {
    let outcome: &str = r.get(1);
    let task: Option<i64> = r.get(2);
    let state: Option<&str> = r.get(3);
    let detail: Option<&str> = r.get(4);
    let task = || {
        task.map(|t| TaskId(t as u64))
            .ok_or_else(|| StoreError::Corrupt(format!("{outcome} without a task")))
    };
    Ok(match outcome {
        "CREATED" => SubmitOutcome::Created,
        "REPLAY" => SubmitOutcome::Replay {
            task: task()?,
            state: parse_state(state.unwrap_or(""))?,
        },
        "CONFLICT" => SubmitOutcome::Conflict { task: task()? },
        "QUOTA_EXCEEDED" => SubmitOutcome::QuotaExceeded {
            remaining_milli: detail.and_then(|d| d.parse().ok()).unwrap_or(0),
        },
        "PARTITION_NOT_OWNED" => SubmitOutcome::PartitionNotOwned(PartitionId(
            detail
                .and_then(|d| d.parse().ok())
                .ok_or_else(|| StoreError::Corrupt(format!("{outcome} without a partition")))?,
        )),
        other => return Err(StoreError::Corrupt(format!("submit outcome {other}"))),
    })
}
