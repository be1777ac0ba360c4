//! Retention: finished tasks leave the hot table after a while, so that it (and the walks of it
//! that restarts and takeovers make) stays the size of the recent work, not of all work ever.
//!
//! A pass walks at most `scan` rows of `task` in id order from a cursor (ids grow with time, so
//! the oldest rows come first) and deletes, among those of the given partitions, the ones that
//! ended long enough ago, with their attempt history. The cost of a pass is bounded by `scan`
//! whatever the table holds; the caller keeps the cursor and starts again from the beginning
//! once a pass reaches the end — or reaches tasks created within the window, since none after
//! them can have ended before it (so the recent part of the table is not walked over and over).
//!
//! Where the cluster relays its events, a task also stays until the relay has sent every event
//! written at or before its end ([`Retention::after_relay`]).
//!
//! What leaves with a task: its status (GetTask answers not found) and its idempotency key — a
//! submit with that key after the retention window is a new task. Budget ledger rows stay (they
//! are the record of what was reserved and spent).

use std::time::Duration;

use spindle_core::TaskId;

use crate::db::{Call, Db};
use crate::error::{check_scan, StoreError};
use crate::types::PartitionId;

/// How long ended tasks stay after they ended; `None` keeps them forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// SUCCEEDED, CANCELED and EXPIRED tasks.
    pub finished: Option<Duration>,
    /// FAILED tasks (the dead-letter queue, which an operator may still requeue).
    pub failed: Option<Duration>,
    /// The cluster relays its events (`Db::relay_events`): a task also stays while an event
    /// written at or before its end waits for the relay, which reads the task's result when it
    /// sends the end event (a relay that fell behind the window loses nothing).
    pub after_relay: bool,
}

/// What one pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    /// Rows of `task` the pass looked at.
    pub walked: u64,
    pub tasks: u64,
    pub attempts: u64,
    /// Where the next pass starts; `None` once this one reached the end of the table, or tasks
    /// too young to have ended before the window (then the next pass starts at the oldest).
    pub next: Option<TaskId>,
}

impl Db {
    /// One bounded retention pass over the tasks after `after` (see the module docs).
    pub async fn prune_finished(
        &self,
        partitions: &[PartitionId],
        keep: Retention,
        after: Option<TaskId>,
        scan: usize,
    ) -> Result<Pruned, StoreError> {
        check_scan(scan)?;
        // NULL (kept forever) compares as unknown: no row of that kind is deleted.
        let ms = |d: Option<Duration>| d.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let parts: Vec<i32> = partitions.iter().map(|p| p.0 as i32).collect();
        let after = after.map_or(-1, |t| t.0 as i64);
        // The conditions name the table's row, not the walk's copy: a task that changed since
        // the walk read it (an operator requeued a FAILED one) is checked again as it is now.
        let row = self
            .answered(
                Call::Writes,
                self.client().query_one(
                    "WITH walked AS MATERIALIZED (
                            SELECT task_id, created_at FROM task WHERE task_id > $1
                             ORDER BY task_id LIMIT $2),
                        -- The oldest event the relay has yet to send (bounded: past the relay's
                        -- backlog bound nodes take no new work). An end event is written in
                        -- its task's last change, both at that transaction's now().
                        relay AS MATERIALIZED (
                            SELECT CASE WHEN $6 THEN (SELECT min(o.created_at) FROM outbox_batch o
                                                       WHERE o.delivered_at IS NULL)
                                   END AS waiting_since),
                        gone AS (
                            DELETE FROM task t USING walked w, relay r
                             WHERE t.task_id = w.task_id AND t.partition = ANY ($3)
                               AND (r.waiting_since IS NULL OR t.updated_at < r.waiting_since)
                               AND ((t.state IN ('SUCCEEDED', 'CANCELED', 'EXPIRED')
                                     AND t.updated_at < now() - $4::bigint * interval '1 millisecond')
                                 OR (t.state = 'FAILED'
                                     AND t.updated_at < now() - $5::bigint * interval '1 millisecond'))
                            RETURNING t.task_id, t.final_attempt IS NOT NULL AS kept),
                        history AS (
                            DELETE FROM attempt_history h USING gone g WHERE h.task_id = g.task_id
                            RETURNING 1)
                        SELECT (SELECT count(*) FROM walked), (SELECT max(task_id) FROM walked),
                               (SELECT count(*) FROM gone),
                               -- Ended attempts: the history's, and those kept in their task's
                               -- row.
                               (SELECT count(*) FROM history)
                                 + (SELECT count(*) FROM gone WHERE gone.kept),
                               EXISTS (SELECT 1 FROM walked WHERE created_at >= now()
                                         - least($4::bigint, $5::bigint) * interval '1 millisecond')",
                    &[
                        &after,
                        &(scan as i64),
                        &parts,
                        &ms(keep.finished),
                        &ms(keep.failed),
                        &keep.after_relay,
                    ],
                ),
            )
            .await?;
        let walked: i64 = row.get(0);
        let last: Option<i64> = row.get(1);
        // Ids grow with creation: past a task created within the shorter window, no task can
        // have ended before it, so the walk starts over instead of reading the recent rows.
        let young: bool = row.get(4);
        Ok(Pruned {
            walked: walked as u64,
            tasks: row.get::<_, i64>(2) as u64,
            attempts: row.get::<_, i64>(3) as u64,
            next: (walked as usize == scan && !young)
                .then_some(last)
                .flatten()
                .map(|t| TaskId(t as u64)),
        })
    }
}
