//! The periodic counter check: every `counter_check_s`, each pool shard's `used` against its
//! ACTIVE reservations and each tenant's reserved budget against its open ledger cycles, in one
//! read-only snapshot (`Db::check_counters`). Drift is logged per counter and counted
//! (`spindle_reservation_drift_shards`, `spindle_reservation_drift_budgets`) and, with
//! `counter_repair` (the default), repaired at once: `Db::rebuild_counters` recomputes every
//! counter under the pool rows' locks (design.md §8: counter drift → rebuild from ACTIVE
//! reservations), audited as the node's, counted in `spindle_reservation_repairs_total`. A snapshot
//! never shows a claim or release in flight as drift (each moves the counter and the task row
//! in one transaction), so a repair follows only real drift.
//!
//! It runs on a connection of its own, so that a check walking a large task table never
//! delays a lease renewal; the connection's statement timeout bounds each check.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use spindle_control::reconcile::Counters;
use spindle_control::DbConfig;

use spindle_node_base::metrics::Metrics;

/// How the checks run.
pub struct Checks {
    pub every: Duration,
    /// Repair what a check finds drifted (`Config::counter_repair`).
    pub repair: bool,
    /// This node's id: the repairs' actor in the audit log.
    pub node: String,
}

pub async fn run(db_config: DbConfig, checks: Checks, metrics: Arc<Metrics>) {
    let mut db = crate::control::reconnect(&db_config, &metrics).await;
    let mut tick = tokio::time::interval(checks.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if metrics.stopping() {
            return;
        }
        if db.is_closed() {
            db = crate::control::reconnect(&db_config, &metrics).await;
        }
        match db.check_counters().await {
            Ok(drift) => {
                log_drift(&drift);
                metrics
                    .counter_drift_shards
                    .store(drift.pools.len() as u64, Ordering::Relaxed);
                metrics
                    .counter_drift_budgets
                    .store(drift.budgets.len() as u64, Ordering::Relaxed);
                metrics.counter_checks.fetch_add(1, Ordering::Relaxed);
                let drifted = !drift.pools.is_empty() || !drift.budgets.is_empty();
                if drifted && checks.repair {
                    repair(&mut db, &checks.node, &metrics).await;
                }
            }
            Err(e) => {
                metrics
                    .counter_check_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!("checking the pool counters and budgets failed: {e}");
            }
        }
        match db.dead_letter_count().await {
            Ok(n) => metrics.dead_letters.store(n, Ordering::Relaxed),
            Err(e) => tracing::warn!("counting the dead letters failed: {e}"),
        }
        match db.queue_ages().await {
            Ok(ages) => {
                if let Ok(mut a) = metrics.queue_ages.lock() {
                    *a = ages;
                }
            }
            Err(e) => tracing::warn!("reading the queues' ages failed: {e}"),
        }
    }
}

/// Recomputes every counter from what live attempts hold and audits it as `node`'s.
async fn repair(db: &mut spindle_control::Db, node: &str, metrics: &Metrics) {
    let rebuilt = match db.rebuild_counters().await {
        Ok(rebuilt) => rebuilt,
        Err(e) => {
            tracing::warn!("repairing the drifted counters failed (the next check retries): {e}");
            return;
        }
    };
    let why = rebuild_reason("automatic, after the periodic check", &rebuilt);
    tracing::warn!("counters {why}");
    let actor = format!("node {node}");
    if let Err(e) = db.audit_action(&actor, "counters", "rebuild", &why).await {
        tracing::warn!("auditing the counter repair failed: {e}");
    }
    // Counted once its audit is written (or failed): a reader of the metric finds the row.
    metrics.counter_repairs.fetch_add(1, Ordering::Relaxed);
}

/// A counter rebuild's audit reason: `why`, and what it repaired.
pub fn rebuild_reason(why: &str, rebuilt: &Counters) -> String {
    format!(
        "rebuild: {why} ({} pool shards and {} budgets repaired)",
        rebuilt.pools.len(),
        rebuilt.budgets.len()
    )
}

fn log_drift(drift: &Counters) {
    for d in &drift.pools {
        tracing::warn!(
            "pool {} shard {}: counter {} but its active reservations add up to {}",
            d.shard.pool,
            d.shard.shard,
            d.stored,
            d.derived
        );
    }
    for d in &drift.budgets {
        tracing::warn!(
            "tenant {}: reserved budget {} but its open reservations add up to {}",
            d.tenant.0,
            d.stored,
            d.derived
        );
    }
}
