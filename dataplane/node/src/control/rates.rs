//! The node's parts of the cluster's rates (DESIGN §3): every second (or third of a lease, if
//! shorter), the summed
//! backlogged weight of its shards per rate goes to PostgreSQL and its parts come back
//! (`spindle_control::rate_parts`), which the shards' splits then run at
//! ([`crate::ownership::Ownership::rate_part`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use spindle_control::DbConfig;

use crate::metrics::Metrics;
use crate::ownership::Ownership;

/// Allots this node's parts until the node stops (the first one was the start's, before the
/// node served), with the weights the shards published on the board.
pub(super) async fn run(
    db_config: DbConfig,
    config: crate::config::Config,
    metrics: Arc<Metrics>,
    ownership: Arc<Ownership>,
) {
    ownership.rates_ready().await;
    let mut db = super::pipeline::reconnect(&db_config, &metrics).await;
    let mut tick = tokio::time::interval(allot_every(config.lease_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // A new provider account's RPM: its first part now, not a round later.
            () = ownership.rate_added() => {}
        }
        if db.is_closed() {
            db = super::pipeline::reconnect(&db_config, &metrics).await;
        }
        let rates = ownership.rate_names();
        if rates.is_empty() {
            continue;
        }
        let Some(split) = metrics.split.get() else {
            continue;
        };
        let wants: Vec<(String, u64)> = rates
            .iter()
            .map(|(k, name)| {
                // A shard that has not published yet counts as idle here: its weight comes
                // with the next round.
                let weight = split
                    .board
                    .loads(*k)
                    .map_or(0, |loads| loads.iter().map(|l| l.weight).sum());
                (name.clone(), weight)
            })
            .collect();
        match db
            .allot_rate_parts(&config.node_id, config.lease_ms, &wants)
            .await
        {
            Ok(parts) => {
                for ((k, _), part) in rates.iter().zip(parts) {
                    ownership.set_rate_part(*k, part);
                }
                metrics.rate_allotments.fetch_add(1, Ordering::Relaxed);
            }
            // The parts stay as they are: the rows in PostgreSQL still say so to every node.
            Err(e) => tracing::warn!("allotting the cluster's rates: {e}"),
        }
    }
}

/// How often the parts are allotted: every second, or every third of a lease if that is
/// shorter. One small transaction per node each time; parts follow the backlog within a round
/// or two and a lowering's grace.
fn allot_every(lease_ms: u32) -> std::time::Duration {
    std::time::Duration::from_millis(u64::from(lease_ms / 3).clamp(1, 1_000))
}
