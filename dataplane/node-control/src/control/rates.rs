//! The node's parts of the limits it shares with the cluster (design.md §3: a provider account's
//! RPM and concurrency, the platform's cost per minute): every second (or third of a lease, if
//! shorter), what its shards published on the board per limit — the backlogged weight that
//! wants it and what they use — goes to PostgreSQL and its parts come back
//! (`spindle_control::cluster_shares`), which the shards' splits then run at
//! ([`spindle_node_base::ownership::Ownership::share`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use spindle_control::cluster_shares::{Want, WHOLE};
use spindle_control::DbConfig;
use spindle_sync::ShareBoard;

use spindle_node_base::metrics::Metrics;
use spindle_node_base::ownership::{Ownership, SharedLimit};

/// Allots this node's parts until the node stops (the first one, and `Ownership::init_shares`,
/// were the start's, before this runs), with the weights and uses the shards published on the
/// board.
pub(super) async fn run(
    db_config: DbConfig,
    config: spindle_node_base::config::Config,
    metrics: Arc<Metrics>,
    ownership: Arc<Ownership>,
) {
    let mut db = super::pipeline::reconnect(&db_config, &metrics).await;
    let mut tick = tokio::time::interval(allot_every(config.lease_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // A new provider account's limits: their first parts now, not a round later.
            () = ownership.shared_added() => {}
        }
        if db.is_closed() {
            db = super::pipeline::reconnect(&db_config, &metrics).await;
        }
        let shared = ownership.shared_limits();
        let Some(split) = metrics.split.get() else {
            continue;
        };
        if shared.is_empty() {
            continue;
        }
        let wants: Vec<Want> = shared
            .iter()
            .map(|l| {
                // A shard that has not published yet counts as idle here: its load comes with
                // the next round.
                let loads = split.board.loads(l.place).unwrap_or_default();
                Want {
                    limit: l.name.clone(),
                    whole: whole(l, &split.board),
                    rate: l.rate,
                    weight: loads.iter().map(|s| s.weight).sum(),
                    used: if l.rate {
                        0
                    } else {
                        loads.iter().map(|s| s.used).sum()
                    },
                }
            })
            .collect();
        match db
            .allot_shares(&config.node_id, config.lease_ms, &wants)
            .await
        {
            Ok(parts) => {
                for (l, part) in shared.iter().zip(parts) {
                    ownership.set_share(l.place, part);
                }
                metrics.share_allotments.fetch_add(1, Ordering::Relaxed);
            }
            // The parts stay as they are: the rows in PostgreSQL still say so to every node.
            Err(e) => tracing::warn!("allotting the cluster's shared limits: {e}"),
        }
    }
}

/// A shared limit's whole: a rate's parts are millionths; slots are as many as the board holds
/// for the node (the account's concurrency).
pub(super) fn whole(limit: &SharedLimit, board: &ShareBoard) -> u64 {
    if limit.rate {
        WHOLE
    } else {
        board.capacity(limit.place)
    }
}

/// How often the parts are allotted: every second, or every third of a lease if that is
/// shorter. One small transaction per node each time; parts follow the backlog within a round
/// or two and a lowering's grace.
fn allot_every(lease_ms: u32) -> std::time::Duration {
    std::time::Duration::from_millis(u64::from(lease_ms / 3).clamp(1, 1_000))
}
