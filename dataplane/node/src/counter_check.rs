//! The periodic counter check: every `counter_check_s`, each pool shard's `used` against its
//! ACTIVE reservations and each tenant's reserved budget against its open ledger cycles, in one
//! read-only snapshot (`Db::check_counters`). Drift is logged per counter and counted
//! (`spindle_counter_drift_shards`, `spindle_counter_drift_budgets`), never repaired here: a
//! repair locks every pool row and is an operator's call (`spindlectl rebuild-counters`).
//!
//! It runs on a connection of its own, so that a check walking a large task table never
//! delays a lease renewal; the connection's statement timeout bounds each check.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use spindle_control::reconcile::Counters;
use spindle_control::DbConfig;

use crate::metrics::Metrics;

pub async fn run(db_config: DbConfig, every: Duration, metrics: Arc<Metrics>) {
    let mut db = crate::control::reconnect(&db_config, &metrics).await;
    let mut tick = tokio::time::interval(every);
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
            }
            Err(e) => tracing::warn!("checking the pool counters and budgets failed: {e}"),
        }
    }
}

fn log_drift(drift: &Counters) {
    for d in &drift.pools {
        tracing::warn!(
            "pool {} shard {}: counter {} but its active reservations add up to {} \
             (spindlectl rebuild-counters repairs it)",
            d.shard.pool,
            d.shard.shard,
            d.stored,
            d.derived
        );
    }
    for d in &drift.budgets {
        tracing::warn!(
            "tenant {}: reserved budget {} but its open reservations add up to {} \
             (spindlectl rebuild-counters repairs it)",
            d.tenant.0,
            d.stored,
            d.derived
        );
    }
}
