//! The reconcilers' queries (the node schedules them: `spindle_node_control::reconciler`). Each is
//! bounded by `SCAN_MAX` rows per pass and safe to run on several nodes at once: they read, and
//! what a reconciler changes goes through the fenced batch functions or locks what it changes.
//!
//! A lapsed lease is not a release: the node hands the attempt to its shard, which asks the
//! provider by request key, and only a definite "not found" (or a failure) gives the capacity
//! back.

use spindle_core::{AttemptId, FencingToken, TaskId, TaskState, TenantId};

use crate::db::{Call, Db};
use crate::error::StoreError;
use crate::limits::SCAN_MAX;
use crate::types::{parse_state, PartitionId, PoolShard};

/// The columns [`queued_task`] reads, first in a row (a macro, so that longer column lists
/// can `concat!` it).
macro_rules! queued_columns {
    () => {
        "task_id, tenant_id, user_id, partition, lane, band, version,
         policy_version, cost_estimate_milli, fairness_milli, payload,
         created_at, next_eligible_at, attempt_no"
    };
}

/// A live attempt, as a node (re)starting to own its partition resolves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveAttempt {
    pub task: TaskId,
    pub state: TaskState,
    pub attempt: AttemptId,
    pub token: FencingToken,
    pub provider: String,
    pub request_key: String,
}

/// Each pool shard's stored `used` beside what its ACTIVE reservations add up to (the CTEs
/// `active` and `derived`, for the counter check and the rebuild).
const POOL_DERIVED: &str = "active AS (
         SELECT r.pool_key, r.shard, sum(r.amount)::bigint AS amount
           FROM task t,
                unnest(t.res_pool, t.res_shard, t.res_amount) AS r (pool_key, shard, amount)
          WHERE t.current_attempt IS NOT NULL AND t.res_released_at IS NULL
          GROUP BY r.pool_key, r.shard
     ), derived AS (
         SELECT p.pool_key, p.shard, p.used AS stored, coalesce(a.amount, 0)::bigint AS derived
           FROM resource_pool_shard p
           LEFT JOIN active a ON a.pool_key = p.pool_key AND a.shard = p.shard
     )";

/// Each budgeted tenant's stored `reserved_milli` beside the RESERVE rows of its open cycles
/// (no SETTLE or REFUND yet; a closed cycle's rows live in `quota_ledger_closed`).
const BUDGET_DERIVED: &str = "budget AS (
         SELECT q.tenant_id, q.reserved_milli AS stored, coalesce(o.amount, 0)::bigint AS derived
           FROM tenant_quota q
           LEFT JOIN (SELECT l.tenant_id, sum(l.amount_milli) AS amount
                        FROM quota_ledger l
                       WHERE l.kind = 'RESERVE'
                         AND NOT EXISTS (SELECT 1 FROM quota_ledger e
                                          WHERE e.task_id = l.task_id
                                            AND e.kind IN ('SETTLE', 'REFUND'))
                       GROUP BY l.tenant_id) o ON o.tenant_id = q.tenant_id
     )";

/// What a counter check found drifted (or a rebuild repaired).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub pools: Vec<Drift>,
    pub budgets: Vec<BudgetDrift>,
}

impl Counters {
    /// Nothing drifted.
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty() && self.budgets.is_empty()
    }

    fn from_rows(pools: &[tokio_postgres::Row], budgets: &[tokio_postgres::Row]) -> Counters {
        Counters {
            pools: pools
                .iter()
                .map(|r| Drift {
                    shard: PoolShard::new(r.get::<_, String>(0), r.get::<_, i16>(1) as u16),
                    stored: r.get(2),
                    derived: r.get(3),
                })
                .collect(),
            budgets: budgets
                .iter()
                .map(|r| BudgetDrift {
                    tenant: TenantId(r.get::<_, i32>(0) as u32),
                    stored: r.get(1),
                    derived: r.get(2),
                })
                .collect(),
        }
    }
}

/// A pool shard whose stored `used` is not what its ACTIVE reservations add up to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drift {
    pub shard: PoolShard,
    pub stored: i64,
    pub derived: i64,
}

/// A tenant whose stored reserved budget is not what its open ledger cycles add up to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetDrift {
    pub tenant: TenantId,
    pub stored: i64,
    pub derived: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedTask {
    pub task: TaskId,
    pub tenant: TenantId,
    pub user: u32,
    pub partition: PartitionId,
    pub lane: i16,
    pub band: i16,
    pub version: u32,
    /// Attempts the task already had.
    pub attempt_no: u32,
    pub policy_version: u64,
    pub cost_estimate_milli: u64,
    pub fairness_milli: u64,
    pub payload: Vec<u8>,
    pub created_at: std::time::SystemTime,
    pub next_eligible_at: Option<std::time::SystemTime>,
}

/// QUEUED tasks of one lane and band that may start now (`Db::queue_ages`).
#[derive(Debug, Clone, PartialEq)]
pub struct QueueAge {
    pub lane: i16,
    pub band: i16,
    pub queued: u64,
    /// Seconds the oldest of them has waited since its submission.
    pub oldest_s: f64,
}

/// A task a node that (re)starts owning its partition puts back, as [`Db::load_owned`] reads
/// it: QUEUED, or with a live attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedTask {
    /// Its stored fields; with a live attempt, `attempt_no` is that attempt's number.
    pub task: QueuedTask,
    pub live: Option<LiveOf>,
    /// Its client canceled it ([`Db::request_cancel`]); the task has not ended yet.
    pub cancel_requested: bool,
}

/// An owned task's live attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveOf {
    pub state: TaskState,
    pub token: FencingToken,
    /// The provider (account) the attempt went to.
    pub provider: String,
    pub request_key: String,
    /// How long ago the attempt started, by the server's clock (ms).
    pub running_ms: u64,
}

/// A succeeded task's settled cost and where to ask the provider about it
/// ([`Db::settled_costs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    pub task: TaskId,
    pub provider: String,
    pub request_key: String,
    pub cost_milli: u64,
}

/// What ended tasks of one tenant, user and model submitted in one minute consumed
/// ([`Db::quota_consumed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumed {
    pub tenant: TenantId,
    pub user: u32,
    pub model: u16,
    /// When the last of them was submitted (periods are whole minutes: all of them count in
    /// the periods it does).
    pub at_unix_ms: u64,
    pub cost_milli: u64,
    pub tasks: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Starved {
    pub task: TaskId,
    pub tenant: TenantId,
    pub waited_ms: u64,
}

/// A live attempt lives in its task's row (in the baseline schema); its request key is derived from
/// (task, attempt no). Nothing indexes live attempts (an index there would make every claim and
/// finish a non-HOT update): these queries walk the task table, and run at start, at takeover
/// and in the reconciler, never on the hot path.
const LIVE_ATTEMPT_COLUMNS: &str = "t.task_id, t.state, t.current_attempt, t.current_fencing,
                                    t.attempt_provider,
                                    'spindle-' || t.task_id || '-' || t.attempt_no";

fn live_attempt(r: &tokio_postgres::Row) -> Result<LiveAttempt, StoreError> {
    Ok(LiveAttempt {
        task: TaskId(r.get::<_, i64>(0) as u64),
        state: parse_state(r.get(1))?,
        attempt: AttemptId(r.get::<_, i64>(2) as u64),
        token: FencingToken(r.get::<_, i64>(3) as u64),
        provider: r.get(4),
        request_key: r.get(5),
    })
}

impl Db {
    /// One page of the live attempts of tasks in `partitions`, in task id order after `after`:
    /// what a node that (re)starts owning them must resolve before it schedules (its previous
    /// incarnation's work, or a dead node's).
    pub async fn live_attempts_in(
        &self,
        partitions: &[PartitionId],
        after: Option<TaskId>,
        limit: usize,
    ) -> Result<Vec<LiveAttempt>, StoreError> {
        let (parts, after_task) = page_args(partitions, after)?;
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    &format!(
                        "SELECT {LIVE_ATTEMPT_COLUMNS}
                             FROM task t
                            WHERE t.task_id > $2 AND t.current_attempt IS NOT NULL
                              AND t.partition = ANY ($1)
                            ORDER BY t.task_id LIMIT $3"
                    ),
                    &[&parts, &after_task, &(limit.min(SCAN_MAX) as i64)],
                ),
            )
            .await?;
        rows.iter().map(live_attempt).collect()
    }

    /// Recomputes every pool shard's `used` from its ACTIVE reservations (invariant 5) and
    /// every tenant's reserved budget from its open ledger cycles, under the rows' locks;
    /// returns what had drifted, now repaired.
    pub async fn rebuild_counters(&mut self) -> Result<Counters, StoreError> {
        let deadline = self.within(6);
        deadline
            .run(Call::Writes, async {
                let tx = self.client_mut().transaction().await?;
                tx.execute(
                    "SELECT 1 FROM resource_pool_shard ORDER BY pool_key, shard FOR UPDATE",
                    &[],
                )
                .await?;
                let sql = format!(
                    "WITH {POOL_DERIVED}, fixed AS (
                         UPDATE resource_pool_shard p SET used = d.derived, version = p.version + 1
                           FROM derived d
                          WHERE p.pool_key = d.pool_key AND p.shard = d.shard AND d.stored <> d.derived
                         RETURNING p.pool_key, p.shard, d.stored, d.derived
                     )
                     SELECT pool_key, shard, stored, derived FROM fixed ORDER BY pool_key, shard"
                );
                let pools = tx.query(&sql, &[]).await?;
                tx.execute(
                    "SELECT 1 FROM tenant_quota ORDER BY tenant_id FOR UPDATE",
                    &[],
                )
                .await?;
                let sql = format!(
                    "WITH {BUDGET_DERIVED}, fixed AS (
                         UPDATE tenant_quota q SET reserved_milli = d.derived
                           FROM budget d WHERE q.tenant_id = d.tenant_id AND d.stored <> d.derived
                         RETURNING q.tenant_id, d.stored, d.derived
                     )
                     SELECT tenant_id, stored, derived FROM fixed ORDER BY tenant_id"
                );
                let budgets = tx.query(&sql, &[]).await?;
                tx.commit().await?;
                Ok(Counters::from_rows(&pools, &budgets))
            })
            .await
    }

    /// The counters that differ from what they are derived from — pool shards' `used` from
    /// their ACTIVE reservations, tenants' reserved budgets from their open ledger cycles —
    /// changing nothing: one read-only snapshot, in which every claim, release, reservation and
    /// settlement is either wholly there (the counter and its rows move in one transaction) or
    /// not at all, so a difference is drift, never a race. Locks nothing; it walks the task
    /// table and the open ledger once (the nodes run it every `counter_check_s`;
    /// `rebuild_counters` repairs what it finds).
    pub async fn check_counters(&mut self) -> Result<Counters, StoreError> {
        let deadline = self.within(4);
        deadline
            .run(Call::Reads, async {
                let tx = self.read_snapshot().await?;
                let sql = format!(
                    "WITH {POOL_DERIVED}
                     SELECT pool_key, shard, stored, derived FROM derived
                      WHERE stored <> derived ORDER BY pool_key, shard"
                );
                let pools = tx.query(&sql, &[]).await?;
                let sql = format!(
                    "WITH {BUDGET_DERIVED}
                     SELECT tenant_id, stored, derived FROM budget
                      WHERE stored <> derived ORDER BY tenant_id"
                );
                let budgets = tx.query(&sql, &[]).await?;
                tx.commit().await?;
                Ok(Counters::from_rows(&pools, &budgets))
            })
            .await
    }

    /// Tasks in the dead-letter list (ended FAILED, kept until requeued or past retention):
    /// the nodes count them every `counter_check_s` (`spindle_dead_letters`). No index holds
    /// states, so it walks the task table once, like the counter check beside it.
    pub async fn dead_letter_count(&mut self) -> Result<u64, StoreError> {
        let deadline = self.within(1);
        deadline
            .run(Call::Reads, async {
                let row = self
                    .client()
                    .query_one("SELECT count(*) FROM task WHERE state = 'FAILED'", &[])
                    .await?;
                Ok(row.get::<_, i64>(0).max(0) as u64)
            })
            .await
    }

    /// The QUEUED tasks that may start now (not backing off), by lane and band: how many,
    /// and how long the oldest has waited since its submission — the cluster's queue ages,
    /// for the starvation signal (`spindle_queued_oldest_seconds`). Walks the task table once.
    pub async fn queue_ages(&mut self) -> Result<Vec<QueueAge>, StoreError> {
        let deadline = self.within(1);
        deadline
            .run(Call::Reads, async {
                let rows = self
                    .client()
                    .query(
                        "SELECT lane, band, count(*),
                                extract(epoch FROM now() - min(created_at))::float8
                           FROM task
                          WHERE state = 'QUEUED'
                            AND (next_eligible_at IS NULL OR next_eligible_at <= now())
                          GROUP BY lane, band ORDER BY lane, band",
                        &[],
                    )
                    .await?;
                Ok(rows
                    .iter()
                    .map(|r| QueueAge {
                        lane: r.get(0),
                        band: r.get(1),
                        queued: r.get::<_, i64>(2).max(0) as u64,
                        oldest_s: r.get::<_, f64>(3).max(0.0),
                    })
                    .collect())
            })
            .await
    }

    /// One page of the tasks of `partitions` a node puts back after a restart or a takeover,
    /// in task id order after `after`: the QUEUED ones (its in-memory queues are rebuilt from
    /// them) and those with a live attempt (resumed, asking the provider about each job instead
    /// of submitting it again). Ids grow with submission within a shard, so each tenant's tasks
    /// come back in the order they were accepted. No index holds QUEUED tasks or live attempts
    /// (the state changes on every claim, and an index on it would make those updates
    /// non-HOT): the pages walk the primary key once, from the first page to the last.
    pub async fn load_owned(
        &self,
        partitions: &[PartitionId],
        after: Option<TaskId>,
        limit: usize,
    ) -> Result<Vec<OwnedTask>, StoreError> {
        let (parts, after_task) = page_args(partitions, after)?;
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    &format!(
                        "SELECT {OWNED_COLUMNS}
                       FROM task
                      WHERE task_id > $2 AND partition = ANY ($1)
                        AND (state = 'QUEUED' OR current_attempt IS NOT NULL)
                      ORDER BY task_id
                      LIMIT $3"
                    ),
                    &[&parts, &after_task, &(limit.min(SCAN_MAX) as i64)],
                ),
            )
            .await?;
        rows.iter().map(owned_task).collect()
    }

    /// Live attempts of tasks in `partitions` that nobody follows any more as far as
    /// PostgreSQL can tell — their lease lapsed (their node stopped renewing it) — or that sat
    /// in DISPATCHING or SUBMIT_UNKNOWN for longer than `stuck_after_ms`, lapsed ones first,
    /// at most `limit`: what the owner's attempts reconciler hands its shards (a shard that
    /// holds one already is following it; one nobody holds is followed from here, asking the
    /// provider by request key). Read like [`Db::load_owned`]'s rows.
    pub async fn lapsed_owned(
        &self,
        partitions: &[PartitionId],
        stuck_after_ms: u32,
        limit: usize,
    ) -> Result<Vec<OwnedTask>, StoreError> {
        let (parts, _) = page_args(partitions, None)?;
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    &format!(
                        "SELECT {OWNED_COLUMNS}
                           FROM task
                          WHERE partition = ANY ($1) AND current_attempt IS NOT NULL
                            AND (attempt_lease_until < now()
                                 OR (state IN ('DISPATCHING', 'SUBMIT_UNKNOWN')
                                     AND updated_at < now() - $2::float8 * interval '1 millisecond'))
                          ORDER BY attempt_lease_until
                          LIMIT $3"
                    ),
                    &[
                        &parts,
                        &f64::from(stuck_after_ms),
                        &(limit.min(SCAN_MAX) as i64),
                    ],
                ),
            )
            .await?;
        rows.iter().map(owned_task).collect()
    }

    /// What the SUCCEEDED tasks of `tenants` in `partitions` submitted since `since`
    /// consumed, per tenant, user, model and minute of submission: what a node that starts
    /// owning them counts in the tenants' periodic quotas (their live tasks it counts as it puts
    /// them back). Cost is the settled one where there is one, else the estimate. Walks the
    /// task table once.
    pub async fn quota_consumed(
        &self,
        partitions: &[PartitionId],
        tenants: &[TenantId],
        since: std::time::SystemTime,
    ) -> Result<Vec<Consumed>, StoreError> {
        let (parts, _) = page_args(partitions, None)?;
        let tenants = tenant_args(tenants)?;
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT tenant_id, user_id,
                            (convert_from(payload, 'UTF8')::jsonb #>> '{spec,model}')::int,
                            date_trunc('minute', created_at) AS minute,
                            (extract(epoch FROM max(created_at)) * 1000)::bigint,
                            sum(coalesce(cost_actual_milli, cost_estimate_milli))::bigint,
                            count(*)
                       FROM task
                      WHERE partition = ANY ($1) AND tenant_id = ANY ($2)
                        AND state = 'SUCCEEDED' AND created_at >= $3
                        AND created_at >= coalesce((SELECT r.reset_at FROM quota_reset r
                                                     WHERE r.tenant_id = task.tenant_id),
                                                   '-infinity')
                      GROUP BY 1, 2, 3, 4",
                    &[&parts, &tenants, &since],
                ),
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| Consumed {
                tenant: TenantId(r.get::<_, i32>(0) as u32),
                user: r.get::<_, i32>(1) as u32,
                model: r.get::<_, Option<i32>>(2).unwrap_or(0).max(0) as u16,
                at_unix_ms: r.get::<_, i64>(4).max(0) as u64,
                cost_milli: r.get::<_, i64>(5).max(0) as u64,
                tasks: r.get::<_, i64>(6).max(0) as u64,
            })
            .collect())
    }

    /// When each of `tenants` last had its quota counts reset ([`Db::reset_quotas`]), for
    /// those that ever had.
    pub async fn quota_resets(
        &self,
        tenants: &[TenantId],
    ) -> Result<Vec<(TenantId, std::time::SystemTime)>, StoreError> {
        let tenants = tenant_args(tenants)?;
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT tenant_id, reset_at FROM quota_reset WHERE tenant_id = ANY ($1)",
                    &[&tenants],
                ),
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| (TenantId(r.get::<_, i32>(0) as u32), r.get(1)))
            .collect())
    }

    /// For each of `tasks` (in order), its partition and whether attempt `attempt_no` of it
    /// is its live attempt now; `None` for a task with no row (pruned, or never stored). The
    /// orphan reconciler's question about a job it found at the provider.
    pub async fn attempt_owners(
        &self,
        tasks: &[(TaskId, u32)],
    ) -> Result<Vec<Option<(PartitionId, bool)>>, StoreError> {
        let ids: Vec<TaskId> = tasks.iter().map(|&(t, _)| t).collect();
        let rows = self
            .rows_in_order(
                "attempt owners",
                "t.partition, t.attempt_no, t.current_attempt IS NOT NULL",
                &ids,
            )
            .await?;
        Ok(rows
            .iter()
            .zip(tasks)
            .map(|(r, &(_, attempt_no))| {
                let partition = r.get::<_, Option<i32>>(0)?;
                let live = r.get::<_, Option<bool>>(2) == Some(true)
                    && r.get::<_, Option<i32>>(1) == Some(attempt_no as i32);
                Some((PartitionId(partition as u32), live))
            })
            .collect())
    }

    /// One page of the SUCCEEDED tasks of `partitions` with a settled cost, in task id order
    /// after `after` (`None`: from the first), for the provider cost check: each with the
    /// provider account and request key of the attempt that succeeded.
    pub async fn settled_costs(
        &self,
        partitions: &[PartitionId],
        after: Option<TaskId>,
        limit: usize,
    ) -> Result<Vec<Settled>, StoreError> {
        let (parts, after_task) = page_args(partitions, after)?;
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT task_id, attempt_provider,
                            'spindle-' || task_id || '-' || attempt_no, cost_actual_milli
                       FROM task
                      WHERE task_id > $2 AND partition = ANY ($1) AND state = 'SUCCEEDED'
                        AND cost_actual_milli IS NOT NULL AND attempt_provider IS NOT NULL
                      ORDER BY task_id LIMIT $3",
                    &[&parts, &after_task, &(limit.min(SCAN_MAX) as i64)],
                ),
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| Settled {
                task: TaskId(r.get::<_, i64>(0) as u64),
                provider: r.get(1),
                request_key: r.get(2),
                cost_milli: r.get::<_, i64>(3).max(0) as u64,
            })
            .collect())
    }

    /// QUEUED tasks of `partitions` (eligible, not backing off) that have waited longer than
    /// `max_wait_ms`: the starvation detector's evidence, longest wait first.
    pub async fn starved_tasks(
        &self,
        partitions: &[PartitionId],
        max_wait_ms: u32,
        limit: usize,
    ) -> Result<Vec<Starved>, StoreError> {
        let (parts, _) = page_args(partitions, None)?;
        let rows = self
            .answered(
                Call::Reads,
                self.client().query(
                    "SELECT task_id, tenant_id,
                              (extract(epoch FROM now() - created_at) * 1000)::bigint
                         FROM task
                        WHERE state = 'QUEUED' AND partition = ANY ($3)
                          AND created_at < now() - $1::float8 * interval '1 millisecond'
                          AND (next_eligible_at IS NULL OR next_eligible_at <= now())
                        ORDER BY created_at LIMIT $2",
                    &[
                        &f64::from(max_wait_ms),
                        &(limit.min(SCAN_MAX) as i64),
                        &parts,
                    ],
                ),
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| Starved {
                task: TaskId(r.get::<_, i64>(0) as u64),
                tenant: TenantId(r.get::<_, i32>(1) as u32),
                waited_ms: r.get::<_, i64>(2).max(0) as u64,
            })
            .collect())
    }
}

/// A page's arguments over `partitions` after task `after`: the partitions as SQL integers and
/// the cursor (-1: from the first task).
fn page_args(
    partitions: &[PartitionId],
    after: Option<TaskId>,
) -> Result<(Vec<i32>, i64), StoreError> {
    crate::error::check_batch_len(partitions.len())?;
    let parts = partitions.iter().map(|p| p.0 as i32).collect();
    Ok((parts, after.map_or(-1, |t| t.0 as i64)))
}

/// `tenants` as SQL integers, within a batch's bound.
fn tenant_args(tenants: &[TenantId]) -> Result<Vec<i32>, StoreError> {
    crate::error::check_batch_len(tenants.len())?;
    Ok(tenants.iter().map(|t| t.0 as i32).collect())
}

/// The columns [`owned_task`] reads.
const OWNED_COLUMNS: &str = concat!(
    queued_columns!(),
    ", state, current_attempt IS NOT NULL, current_fencing,
     attempt_provider, 'spindle-' || task_id || '-' || attempt_no, cancel_requested,
     coalesce((extract(epoch FROM now() - attempt_started_at) * 1000)::bigint, 0)"
);

fn owned_task(r: &tokio_postgres::Row) -> Result<OwnedTask, StoreError> {
    let live = match r.get::<_, bool>(15) {
        false => None,
        true => Some(LiveOf {
            state: parse_state(r.get(14))?,
            token: FencingToken(r.get::<_, i64>(16) as u64),
            provider: r.get(17),
            request_key: r.get(18),
            running_ms: r.get::<_, i64>(20).max(0) as u64,
        }),
    };
    Ok(OwnedTask {
        task: queued_task(r),
        live,
        cancel_requested: r.get(19),
    })
}

/// The columns [`queued_task`] reads, first in a row.
pub(crate) const QUEUED_COLUMNS: &str = queued_columns!();

pub(crate) fn queued_task(r: &tokio_postgres::Row) -> QueuedTask {
    QueuedTask {
        task: TaskId(r.get::<_, i64>(0) as u64),
        tenant: TenantId(r.get::<_, i32>(1) as u32),
        user: r.get::<_, i32>(2) as u32,
        partition: PartitionId(r.get::<_, i32>(3) as u32),
        lane: r.get(4),
        band: r.get(5),
        version: r.get::<_, i32>(6) as u32,
        policy_version: r.get::<_, i64>(7) as u64,
        cost_estimate_milli: r.get::<_, i64>(8) as u64,
        fairness_milli: r.get::<_, i64>(9) as u64,
        payload: r.get(10),
        created_at: r.get(11),
        next_eligible_at: r.get(12),
        attempt_no: r.get::<_, i32>(13) as u32,
    }
}
