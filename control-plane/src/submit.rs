//! Group-commit submit: many submits, one transaction, one round trip; each answered only after
//! the commit. Idempotent on (tenant, idempotency key).

use spindle_core::{Band, Lane, PolicyVersion, TaskId, TaskState, TenantId, UserId};

use crate::db::Db;
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
                false,
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

    /// [`Db::submit_batch`] for `node`, fenced by its leases (migration 11): a row whose
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
        let task: Vec<i64> = batch.iter().map(|t| t.task.0 as i64).collect();
        let tenant: Vec<i32> = batch.iter().map(|t| t.tenant.0 as i32).collect();
        let user: Vec<i32> = batch.iter().map(|t| t.user.0 as i32).collect();
        let key: Vec<&str> = batch.iter().map(|t| t.idempotency_key.as_str()).collect();
        let payload: Vec<&[u8]> = batch.iter().map(|t| t.payload.as_slice()).collect();
        let partition: Vec<i32> = batch.iter().map(|t| t.partition.0 as i32).collect();
        let lane: Vec<i16> = batch.iter().map(|t| t.lane.index() as i16).collect();
        let band: Vec<i16> = batch.iter().map(|t| t.band.index() as i16).collect();
        let cost: Vec<i64> = batch.iter().map(|t| t.cost_estimate_milli as i64).collect();
        let fairness: Vec<i64> = batch.iter().map(|t| t.fairness_milli as i64).collect();
        let version = policy_version.0 as i64;
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![
            &task, &tenant, &user, &key, &payload, &partition, &lane, &band, &cost, &fairness,
            &version,
        ];
        let statement = match &node {
            Some(node) => {
                params.insert(0, node);
                &self.stmts.submit_leased
            }
            None => &self.stmts.submit,
        };
        let rows = self
            .answered(true, self.client().query(statement, &params))
            .await?;
        check_answered("submit", &rows, batch.len())?;
        rows.iter()
            .map(|r| {
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
                        detail.and_then(|d| d.parse().ok()).ok_or_else(|| {
                            StoreError::Corrupt(format!("{outcome} without a partition"))
                        })?,
                    )),
                    other => return Err(StoreError::Corrupt(format!("submit outcome {other}"))),
                })
            })
            .collect()
    }
}
