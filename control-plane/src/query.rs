//! Reads for clients: a task's status as PostgreSQL has it, scoped to its tenant; and the rows
//! that decide a call whose answer was lost ([`StoreError::InDoubt`]).

use spindle_core::{AttemptId, FencingToken, TaskId, TaskState, TenantId};

use crate::claim::{request_key, ClaimRefusal, ClaimResult};
use crate::db::{Call, Db};
use crate::error::StoreError;
use crate::types::parse_state;

/// A task's row as it is now, as far as a submit or a claim of it is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskHead {
    pub task: TaskId,
    pub state: TaskState,
    pub version: u32,
    pub attempt_no: u32,
    /// Its live attempt, if it has one.
    pub live: Option<LiveHead>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveHead {
    pub attempt: AttemptId,
    pub token: FencingToken,
    pub node: String,
}

/// What a claim by `node` of `task` at `expected_version` came to when its answer was lost,
/// from the task's row now (`head`; `None`: no such row). `None` when the claim did not commit:
/// the row is QUEUED at the version the claim expected. Otherwise the answer the claim would
/// have had: granted when the row shows its compare-and-set (DISPATCHING at the next version,
/// with an attempt of `node`), else refused as gone or moved — a row some other writer moved
/// since is not the claimant's to run, whether or not its claim had committed.
pub fn lost_claim(
    task: TaskId,
    head: Option<&TaskHead>,
    node: &str,
    expected_version: u32,
) -> Option<ClaimResult> {
    let Some(head) = head else {
        return Some(ClaimResult::Refused(ClaimRefusal::TaskGone));
    };
    if head.state == TaskState::Queued && head.version == expected_version {
        return None;
    }
    match &head.live {
        Some(live)
            if head.state == TaskState::Dispatching
                && head.version == expected_version.wrapping_add(1)
                && live.node == node =>
        {
            Some(ClaimResult::Granted {
                attempt: live.attempt,
                token: live.token,
                attempt_no: head.attempt_no,
                request_key: request_key(task, head.attempt_no),
            })
        }
        _ => Some(ClaimResult::Refused(ClaimRefusal::VersionMoved {
            state: head.state,
            version: head.version,
        })),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTask {
    pub task: TaskId,
    pub state: TaskState,
    pub version: u32,
    pub attempt_no: u32,
    pub cost_estimate_milli: u64,
    pub cost_actual_milli: Option<u64>,
    pub failure_reason: Option<String>,
    /// What it produced, once SUCCEEDED (`ReportAction::Finish::result`).
    pub result: Option<String>,
    /// Its client's (or an operator's) cancel is stored (`Db::request_cancel`).
    pub cancel_requested: bool,
}

impl StoredTask {
    /// As its client is told: a stored cancel not yet carried out in the row reads as
    /// CANCELED — the node holding the task canceled it when it stored the cancel (its end is
    /// on its way here), and a node putting it back cancels it. A client that was answered
    /// "canceled" never reads its task as still queued.
    pub fn as_seen_by_client(mut self) -> StoredTask {
        if self.cancel_requested && !self.state.is_terminal() {
            self.state = TaskState::Canceled;
        }
        self
    }
}

impl Db {
    /// Many tasks at once (a read batch), each with its owning tenant; missing ones are absent.
    pub async fn task_statuses(
        &self,
        tasks: &[TaskId],
    ) -> Result<Vec<(TenantId, StoredTask)>, StoreError> {
        crate::error::check_batch_len(tasks.len())?;
        let ids: Vec<i64> = tasks.iter().map(|t| t.0 as i64).collect();
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT task_id, tenant_id, state, version, attempt_no, cost_estimate_milli,
                        cost_actual_milli, failure_reason, result, cancel_requested
                   FROM task WHERE task_id = ANY ($1)",
                    &[&ids],
                ),
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    TenantId(r.get::<_, i32>(1) as u32),
                    StoredTask {
                        task: TaskId(r.get::<_, i64>(0) as u64),
                        state: parse_state(r.get(2))?,
                        version: r.get::<_, i32>(3) as u32,
                        attempt_no: r.get::<_, i32>(4) as u32,
                        cost_estimate_milli: r.get::<_, i64>(5) as u64,
                        cost_actual_milli: r.get::<_, Option<i64>>(6).map(|c| c as u64),
                        failure_reason: r.get(7),
                        result: r.get(8),
                        cancel_requested: r.get(9),
                    },
                ))
            })
            .collect()
    }

    /// The stored requests (`task.payload`, as the node wrote them at submit) of `tasks`, in
    /// their order; `None` for a task that is not stored (or was pruned).
    pub async fn task_payloads(
        &self,
        tasks: &[TaskId],
    ) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let rows = self
            .rows_in_order("task payloads", "t.payload", tasks)
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// `columns` of the rows of `tasks` (`t`), one row per task in their order, NULLs for a
    /// task that is not stored.
    pub(crate) async fn rows_in_order(
        &self,
        what: &str,
        columns: &str,
        tasks: &[TaskId],
    ) -> Result<Vec<tokio_postgres::Row>, StoreError> {
        crate::error::check_batch_len(tasks.len())?;
        let ids: Vec<i64> = tasks.iter().map(|t| t.0 as i64).collect();
        let sql = format!(
            "SELECT {columns}
               FROM unnest($1::bigint[]) WITH ORDINALITY AS c (task, ord)
               LEFT JOIN task t ON t.task_id = c.task
              ORDER BY c.ord"
        );
        let rows = self
            .answered(Call::Reads, self.client().query(&sql, &[&ids]))
            .await?;
        crate::error::check_answered(what, &rows, tasks.len())?;
        Ok(rows)
    }

    /// One page of the dead-letter queue: of the (at most `scan`) tasks after `after` in id
    /// order, the FAILED ones, each with its tenant; and where the next page starts (`None`:
    /// this one reached the last task). Bounded by `scan` rows read, however few are FAILED.
    pub async fn failed_tasks(
        &self,
        after: TaskId,
        scan: usize,
    ) -> Result<(Vec<(TenantId, StoredTask)>, Option<TaskId>), StoreError> {
        crate::error::check_scan(scan)?;
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT task_id, state = 'FAILED' FROM task WHERE task_id > $1
                      ORDER BY task_id LIMIT $2",
                    &[&(after.0 as i64), &(scan as i64)],
                ),
            )
            .await?;
        let next = (rows.len() == scan)
            .then(|| rows.last().map(|r| TaskId(r.get::<_, i64>(0) as u64)))
            .flatten();
        let failed: Vec<TaskId> = rows
            .iter()
            .filter(|r| r.get::<_, bool>(1))
            .map(|r| TaskId(r.get::<_, i64>(0) as u64))
            .collect();
        let mut found = Vec::with_capacity(failed.len());
        for chunk in failed.chunks(crate::limits::BATCH_MAX) {
            found.extend(self.task_statuses(chunk).await?);
        }
        // Changed since the walk (requeued): not a dead letter any more.
        found.retain(|(_, t)| t.state == TaskState::Failed);
        found.sort_by_key(|(_, t)| t.task);
        Ok((found, next))
    }

    /// Marks `tasks` as canceled by their client, before the cancel is answered: a node that
    /// puts them back (at start, or taking their partition over) cancels them. For each task,
    /// in order: whether it was marked (false: no such task, or it has ended). Idempotent, so
    /// a call in doubt is made again as it is.
    pub async fn request_cancel(&self, tasks: &[TaskId]) -> Result<Vec<bool>, StoreError> {
        crate::error::check_batch_len(tasks.len())?;
        let ids: Vec<i64> = tasks.iter().map(|t| t.0 as i64).collect();
        let rows = self
            .answered(
                Call::Writes,
                self.client().query(
                    "UPDATE task SET cancel_requested = true
                      WHERE task_id = ANY ($1)
                        AND state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED')
                  RETURNING task_id",
                    &[&ids],
                ),
            )
            .await?;
        let marked: std::collections::HashSet<i64> = rows.iter().map(|r| r.get(0)).collect();
        Ok(ids.iter().map(|id| marked.contains(id)).collect())
    }

    /// The rows of `tasks` as they are now, in order (`None`: no such row): what decides a
    /// submit or a claim whose answer was lost (see [`lost_claim`]).
    pub async fn task_heads(&self, tasks: &[TaskId]) -> Result<Vec<Option<TaskHead>>, StoreError> {
        let rows = self
            .rows_in_order(
                "task heads",
                "t.state, t.version, t.attempt_no, t.current_attempt, t.current_fencing, \
                 t.attempt_node",
                tasks,
            )
            .await?;
        rows.iter()
            .zip(tasks)
            .map(|(r, &task)| {
                let Some(state) = r.get::<_, Option<&str>>(0) else {
                    return Ok(None);
                };
                let live = match (
                    r.get::<_, Option<i64>>(3),
                    r.get::<_, Option<i64>>(4),
                    r.get::<_, Option<String>>(5),
                ) {
                    (Some(attempt), Some(token), Some(node)) => Some(LiveHead {
                        attempt: AttemptId(attempt as u64),
                        token: FencingToken(token as u64),
                        node,
                    }),
                    _ => None,
                };
                Ok(Some(TaskHead {
                    task,
                    state: parse_state(state)?,
                    version: r.get::<_, i32>(1) as u32,
                    attempt_no: r.get::<_, i32>(2) as u32,
                    live,
                }))
            })
            .collect()
    }

    /// `task` if it belongs to `tenant`; another tenant's task is `None`, like a missing one.
    pub async fn task_status(
        &self,
        tenant: TenantId,
        task: TaskId,
    ) -> Result<Option<StoredTask>, StoreError> {
        Ok(self
            .task_statuses(&[task])
            .await?
            .into_iter()
            .find(|(owner, _)| *owner == tenant)
            .map(|(_, t)| t.as_seen_by_client()))
    }
}
