//! An operator puts FAILED tasks back in their queues (design.md §5: FAILED → QUEUED is the
//! operator's move only), after the cause of the failures went away.
//!
//! In one transaction per call: the tasks are locked; each one FAILED in a partition the caller
//! serves is requeued with its next attempt still to come (a new attempt number, so a new
//! provider request key). A budgeted task's closed budget cycle (its RESERVE and REFUND) moves to
//! `quota_ledger_closed` and a new one opens: its estimate is reserved again, or the task is
//! refused when what is left of the tenant's budget does not cover it. Each requeue writes its
//! QUEUED event and the call one audit row naming the actor and the reason.
//! A task found QUEUED already in such a partition is answered with its row
//! (`AlreadyQueued`): when a requeue committed but its answer was lost, asking again hands the
//! node what it must take back.

use std::collections::HashMap;

use spindle_core::{TaskId, TaskState, TenantId};

use crate::db::{Call, Db};
use crate::error::{check_batch_len, check_text, BatchTasks, StoreError};
use crate::limits::{NAME_BYTES_MAX, REASON_BYTES_MAX};
use crate::reconcile::{queued_task, QueuedTask, QUEUED_COLUMNS};
use crate::types::{parse_state, PartitionId};

/// What became of one task of a requeue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequeueOutcome {
    /// QUEUED again, as stored now (what its shard takes back).
    Requeued(QueuedTask),
    NotFound,
    /// Only FAILED tasks are requeued.
    NotFailed(TaskState),
    /// QUEUED already, in a partition of this node's, as stored now: what the shard takes
    /// back if it does not hold it (a requeue that committed while its answer was lost, asked
    /// again).
    AlreadyQueued(QueuedTask),
    /// Its partition is served by another node: ask that one.
    NotOwned(PartitionId),
    /// What is left of its tenant's budget does not cover its estimate.
    BudgetExhausted {
        remaining_milli: i64,
    },
    /// It had the most attempts any task gets (`spindle_core::limits::ATTEMPTS_MAX`).
    AttemptsExhausted {
        attempts: u32,
    },
}

/// A task as the requeue locked it.
struct Locked {
    task: i64,
    state: TaskState,
    partition: i32,
    tenant: i32,
    estimate: i64,
    /// Its estimate was reserved from its tenant's budget.
    budgeted: bool,
    attempts: u32,
}

impl Db {
    /// Requeues the FAILED ones of `tasks` that lie in `partitions` (see the module docs);
    /// one outcome per task, in order.
    pub async fn requeue_failed(
        &mut self,
        tasks: &[TaskId],
        partitions: &[PartitionId],
        actor: &str,
        reason: &str,
    ) -> Result<Vec<RequeueOutcome>, StoreError> {
        check_batch_len(tasks.len())?;
        check_text(0, "actor", actor, NAME_BYTES_MAX)?;
        check_text(0, "reason", reason, REASON_BYTES_MAX)?;
        let mut distinct = BatchTasks::default();
        for (row, t) in tasks.iter().enumerate() {
            distinct.check(row, *t)?;
        }
        let ids: Vec<i64> = tasks.iter().map(|t| t.0 as i64).collect();
        let parts: Vec<i32> = partitions.iter().map(|p| p.0 as i32).collect();
        let deadline = self.within(12);
        deadline
            .run(Call::Writes, async {
                let tx = self.client_mut().transaction().await?;
                let rows = tx
                    .query(
                        "SELECT task_id, state, partition, tenant_id, cost_estimate_milli, budget_reserved,
                                attempt_no
                           FROM task WHERE task_id = ANY ($1) ORDER BY task_id FOR UPDATE",
                        &[&ids],
                    )
                    .await?;
                let found: HashMap<i64, Locked> = rows
                    .iter()
                    .map(|r| {
                        Ok((
                            r.get(0),
                            Locked {
                                task: r.get(0),
                                state: parse_state(r.get(1))?,
                                partition: r.get(2),
                                tenant: r.get(3),
                                estimate: r.get(4),
                                budgeted: r.get(5),
                                attempts: r.get::<_, i32>(6).max(0) as u32,
                            },
                        ))
                    })
                    .collect::<Result<_, StoreError>>()?;
                let mut budgeted: Vec<i32> = found
                    .values()
                    .filter(|l| l.state == TaskState::Failed && l.budgeted)
                    .map(|l| l.tenant)
                    .collect();
                budgeted.sort_unstable();
                budgeted.dedup();
                let mut remaining: HashMap<i32, i64> = tx
                    .query(
                        "SELECT tenant_id, budget_milli - reserved_milli - spent_milli FROM tenant_quota
                          WHERE tenant_id = ANY ($1) ORDER BY tenant_id FOR UPDATE",
                        &[&budgeted],
                    )
                    .await?
                    .iter()
                    .map(|r| (r.get(0), r.get(1)))
                    .collect();
                let mut outcomes: Vec<Option<RequeueOutcome>> = Vec::with_capacity(ids.len());
                // The tasks requeued, in the order asked.
                let mut chosen: Vec<&Locked> = Vec::new();
                for id in &ids {
                    let outcome = match found.get(id) {
                        None => Some(RequeueOutcome::NotFound),
                        // Decided after the writes: the row as stored then.
                        Some(l) if l.state == TaskState::Queued && parts.contains(&l.partition) => None,
                        Some(l) if l.state != TaskState::Failed => Some(RequeueOutcome::NotFailed(l.state)),
                        Some(l) if !parts.contains(&l.partition) => {
                            Some(RequeueOutcome::NotOwned(PartitionId(l.partition as u32)))
                        }
                        Some(l) if l.attempts >= spindle_core::limits::ATTEMPTS_MAX => {
                            Some(RequeueOutcome::AttemptsExhausted {
                                attempts: l.attempts,
                            })
                        }
                        Some(l) if l.budgeted => {
                            let left = remaining.get(&l.tenant).copied().unwrap_or(0);
                            if left < l.estimate {
                                Some(RequeueOutcome::BudgetExhausted {
                                    remaining_milli: left,
                                })
                            } else {
                                remaining.insert(l.tenant, left - l.estimate);
                                chosen.push(l);
                                None
                            }
                        }
                        Some(l) => {
                            chosen.push(l);
                            None
                        }
                    };
                    outcomes.push(outcome);
                }
                let budget: Vec<&&Locked> = chosen.iter().filter(|l| l.budgeted).collect();
                let budget_ids: Vec<i64> = budget.iter().map(|l| l.task).collect();
                let budget_tenants: Vec<i32> = budget.iter().map(|l| l.tenant).collect();
                let budget_amounts: Vec<i64> = budget.iter().map(|l| l.estimate).collect();
                if !budget_ids.is_empty() {
                    tx.execute(
                        "WITH closed AS (
                             DELETE FROM quota_ledger WHERE task_id = ANY ($1)
                             RETURNING entry_id, tenant_id, task_id, kind, amount_milli, at)
                         INSERT INTO quota_ledger_closed
                                (entry_id, tenant_id, task_id, kind, amount_milli, at, closed_by)
                         SELECT entry_id, tenant_id, task_id, kind, amount_milli, at, $2 FROM closed",
                        &[&budget_ids, &actor],
                    )
                    .await?;
                    tx.execute(
                        "INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli)
                         SELECT u.tenant, u.task, 'RESERVE', u.amount
                           FROM unnest($1::bigint[], $2::integer[], $3::bigint[]) AS u (task, tenant, amount)",
                        &[&budget_ids, &budget_tenants, &budget_amounts],
                    )
                    .await?;
                    tx.execute(
                        "UPDATE tenant_quota q SET reserved_milli = q.reserved_milli + n.amount
                           FROM (SELECT u.tenant, sum(u.amount)::bigint AS amount
                                   FROM unnest($1::integer[], $2::bigint[]) AS u (tenant, amount)
                                  GROUP BY u.tenant) n
                          WHERE q.tenant_id = n.tenant",
                        &[&budget_tenants, &budget_amounts],
                    )
                    .await?;
                }
                let chosen_ids: Vec<i64> = chosen.iter().map(|l| l.task).collect();
                let requeued: HashMap<i64, QueuedTask> = if chosen_ids.is_empty() {
                    HashMap::new()
                } else {
                    tx.query(
                        &format!(
                            // The attempt that ended the task leaves its row for the
                            // history first: the next claim overwrites the
                            // row's attempt columns.
                            "WITH kept AS (
                                 INSERT INTO attempt_history
                                        (task_id, attempt_no, attempt_id, fencing_token, node_id,
                                         provider, provider_request_key, lease_until, created_at,
                                         ended_at, outcome, res_pool, res_shard, res_amount,
                                         released_at)
                                 SELECT t.task_id, t.attempt_no, t.final_attempt, t.final_fencing,
                                        coalesce(t.attempt_node, ''), coalesce(t.attempt_provider, ''),
                                        'spindle-' || t.task_id || '-' || t.attempt_no,
                                        coalesce(t.attempt_lease_until, t.updated_at),
                                        coalesce(t.attempt_started_at, t.updated_at), t.updated_at,
                                        t.state, coalesce(t.res_pool, '{{}}'),
                                        coalesce(t.res_shard, '{{}}'), coalesce(t.res_amount, '{{}}'),
                                        t.res_released_at
                                   FROM task t
                                  WHERE t.task_id = ANY ($1) AND t.final_attempt IS NOT NULL
                                 RETURNING 1)
                             UPDATE task SET state = 'QUEUED', version = version + 1, failure_reason = NULL,
                                          next_eligible_at = NULL, updated_at = now(),
                                          final_attempt = NULL, final_fencing = NULL,
                                          cancel_requested = false
                                    WHERE task_id = ANY ($1)
                                RETURNING {QUEUED_COLUMNS}"
                        ),
                        &[&chosen_ids],
                    )
                    .await?
                    .iter()
                    .map(|r| (r.get::<_, i64>(0), queued_task(r)))
                    .collect()
                };
                let queued_ids: Vec<i64> = found
                    .values()
                    .filter(|l| l.state == TaskState::Queued && parts.contains(&l.partition))
                    .map(|l| l.task)
                    .collect();
                let queued: HashMap<i64, QueuedTask> = if queued_ids.is_empty() {
                    HashMap::new()
                } else {
                    tx.query(
                        &format!("SELECT {QUEUED_COLUMNS} FROM task WHERE task_id = ANY ($1)"),
                        &[&queued_ids],
                    )
                    .await?
                    .iter()
                    .map(|r| (r.get::<_, i64>(0), queued_task(r)))
                    .collect()
                };
                let why = format!("operator requeue by {actor}: {reason}");
                if !chosen_ids.is_empty() {
                    let tenants: Vec<i32> = chosen.iter().map(|l| l.tenant).collect();
                    tx.execute(
                        "INSERT INTO outbox_batch (kinds, tasks, tenants, details)
                         VALUES (array_fill('QUEUED'::text, ARRAY[cardinality($1::bigint[])]), $1, $2,
                                 jsonb_build_object('reason', $3::text, 'actor', $4::text))",
                        &[&chosen_ids, &tenants, &why, &actor],
                    )
                    .await?;
                }
                let version = crate::policy::current_version(&tx).await?;
                let key: String = format!("{chosen_ids:?}")
                    .chars()
                    .take(NAME_BYTES_MAX)
                    .collect();
                tx.execute(
                    "INSERT INTO audit_log (actor, object_kind, object_key, old_value, new_value, reason,
                                            policy_version)
                     VALUES ($1, 'task', $2, NULL, NULL, $3, $4)",
                    &[
                        &actor,
                        &key,
                        &why.chars().take(REASON_BYTES_MAX).collect::<String>(),
                        &(version.0 as i64),
                    ],
                )
                .await?;
                tx.commit().await?;
                Ok(ids
                    .iter()
                    .zip(outcomes)
                    .map(|(id, o)| {
                        o.unwrap_or_else(|| match (requeued.get(id), queued.get(id)) {
                            (Some(q), _) => RequeueOutcome::Requeued(q.clone()),
                            (None, Some(q)) => RequeueOutcome::AlreadyQueued(q.clone()),
                            (None, None) => RequeueOutcome::NotFound,
                        })
                    })
                    .collect())
            })
            .await
    }

    /// The tenant of each of `tasks` that exists (to route a request to the partition's node).
    pub async fn task_tenants(
        &self,
        tasks: &[TaskId],
    ) -> Result<HashMap<TaskId, TenantId>, StoreError> {
        check_batch_len(tasks.len())?;
        let ids: Vec<i64> = tasks.iter().map(|t| t.0 as i64).collect();
        Ok(self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT task_id, tenant_id FROM task WHERE task_id = ANY ($1)",
                    &[&ids],
                ),
            )
            .await?
            .iter()
            .map(|r| {
                (
                    TaskId(r.get::<_, i64>(0) as u64),
                    TenantId(r.get::<_, i32>(1) as u32),
                )
            })
            .collect())
    }
}
