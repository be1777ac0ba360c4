//! Partition leases: renewal, takeover, retention passes.

use std::sync::Arc;

use spindle_control::{Db, DbConfig, PartitionId, Retention};
use spindle_core::TaskId;
use tokio::sync::mpsc;

use spindle_node_base::metrics::Metrics;
use spindle_node_base::ownership::Ownership;

use super::pipeline::reconnect;
use super::restore::{load_restores, recover_attempts, Followed};

/// Renews this node's partition leases every third of a lease, and takes partitions over:
/// its preferred ones whenever they are free or expired, and after `takeover_grace_ms` of uptime
/// (one lease by default: time for every node of a starting cluster to take its own) any other
/// free or expired one. A
/// partition taken over has its previous owner's live attempts resolved and its QUEUED tasks
/// sent to the shards before the node serves its tenants; a partition lost (another node took
/// it after this node's lease lapsed) stops being served.
pub(super) struct LeaseLoop {
    pub(super) admin: Db,
    pub(super) config: spindle_node_base::config::Config,
    pub(super) db_config: DbConfig,
    pub(super) metrics: Arc<Metrics>,
    pub(super) ownership: Arc<Ownership>,
    /// The policy in force (which providers' attempts a takeover follows).
    pub(super) live: Arc<crate::live_policy::LivePolicy>,
    pub(super) preferred: Vec<PartitionId>,
    /// Where the next retention pass starts (`None`: at the oldest task).
    pub(super) prune_from: Option<TaskId>,
    /// The other nodes relaying the cluster's events, as the last retention round found them
    /// (a change is logged).
    pub(super) relays_seen: Vec<String>,
}

impl LeaseLoop {
    pub(super) async fn run(
        mut self,
        shards: Vec<mpsc::Sender<spindle_node_base::messages::ShardMsg>>,
    ) {
        let started = std::time::Instant::now();
        let every = std::time::Duration::from_millis(u64::from(self.config.lease_ms / 3).max(1));
        let mut tick = tokio::time::interval(every);
        let everything: Vec<PartitionId> = (0..self.config.partitions).map(PartitionId).collect();
        loop {
            tick.tick().await;
            if self.metrics.stopping() {
                // Draining: the partitions are given back at the end, not renewed.
                return;
            }
            if self.admin.is_closed() {
                self.admin = reconnect(&self.db_config, &self.metrics).await;
            }
            let grace = self
                .config
                .takeover_grace_ms
                .unwrap_or(self.config.lease_ms);
            let grace_over = started.elapsed().as_millis() > u128::from(grace);
            let wanted = if grace_over {
                &everything
            } else {
                &self.preferred
            };
            let node = &self.config.node_id;
            let held = match self
                .admin
                .acquire_partitions(node, wanted, self.config.lease_ms)
                .await
            {
                Ok(h) => h.into_iter().map(|l| l.partition).collect::<Vec<_>>(),
                Err(e) => {
                    tracing::warn!("renewing partition leases failed: {e}");
                    continue;
                }
            };
            let before = self.ownership.owned();
            for lost in before.iter().filter(|p| !held.contains(p)) {
                tracing::warn!("partition {} is held by another node now", lost.0);
                self.ownership.set(*lost, false);
            }
            let gained: Vec<PartitionId> = held
                .iter()
                .filter(|p| !before.contains(p))
                .copied()
                .collect();
            if !gained.is_empty() {
                match self.take_over(&gained, &shards).await {
                    Ok(n) => tracing::info!(
                        "took over partitions {:?}: {n} queued tasks restored",
                        gained.iter().map(|p| p.0).collect::<Vec<_>>()
                    ),
                    Err(e) => {
                        // Not served until the next round succeeds; the lease is ours, so
                        // nobody else serves them either.
                        tracing::warn!("taking over partitions failed: {e:#}");
                        continue;
                    }
                }
            }
            match self.admin.partition_owners().await {
                Ok(owners) => self.ownership.set_owners(&owners, node),
                Err(e) => tracing::warn!("reading partition owners: {e}"),
            }
            if let Err(e) = self.admin.heartbeat(node).await {
                tracing::warn!("heartbeat failed: {e}");
            }
            match self.admin.live_nodes(self.config.lease_ms).await {
                Ok(n) => {
                    self.metrics
                        .live_nodes
                        .store(u64::from(n), std::sync::atomic::Ordering::Relaxed);
                }
                Err(e) => tracing::warn!("counting live nodes: {e}"),
            }
            self.prune(&held, every).await;
        }
    }

    /// Retention over the partitions this node holds, after the renewal: bounded passes until
    /// they reach the newest task or a quarter of the renewal interval is spent (the next
    /// renewal is never delayed; a backlog is worked off over the following rounds).
    async fn prune(&mut self, held: &[PartitionId], every: std::time::Duration) {
        let window = spindle_node_base::config::retention_window;
        self.metrics
            .retention_rounds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let relayed = self
            .cluster_relays(window(self.config.retention_events_s))
            .await;
        let keep = Retention {
            finished: window(self.config.retention_finished_s),
            failed: window(self.config.retention_failed_s),
            after_relay: relayed,
        };
        let scan = self.config.retention_scan_rows;
        let started = std::time::Instant::now();
        if let Some(events) = window(self.config.retention_events_s) {
            // Without a relay nobody takes the events: they leave after the window too.
            let undelivered_too = !relayed;
            loop {
                match self.admin.prune_events(events, undelivered_too, scan).await {
                    Ok(n) => {
                        self.metrics
                            .events_pruned
                            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                        if n < scan as u64 || started.elapsed() >= every / 8 {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!("event retention pass failed: {e}");
                        break;
                    }
                }
            }
        }
        if let Some(audit) = window(self.config.retention_audit_s) {
            match self.admin.prune_audit(audit, scan).await {
                Ok(n) => {
                    self.metrics
                        .audit_pruned
                        .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                }
                Err(e) => tracing::warn!("audit retention pass failed: {e}"),
            }
        }
        if keep.finished.is_none() && keep.failed.is_none() {
            return;
        }
        loop {
            match self
                .admin
                .prune_finished(held, keep, self.prune_from, scan)
                .await
            {
                Ok(p) => {
                    self.prune_from = p.next;
                    self.metrics
                        .retention_pruned
                        .fetch_add(p.tasks, std::sync::atomic::Ordering::Relaxed);
                    if p.next.is_none() || started.elapsed() >= every / 4 {
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!("retention pass failed: {e}");
                    return;
                }
            }
        }
    }

    /// Whether the cluster relays its events: this node does (its `[events]`), or another that
    /// relays was heard from within the events' window (`within`; `None`: kept forever, so
    /// ever) — configurations that differ between nodes, as during a rolling change, lose no
    /// event and no ended task that a relay has yet to send. When the nodes cannot be read,
    /// as if one relayed: waiting loses nothing. A node without a relay of its own, while
    /// another relays, also counts the events waiting and refuses new work past the smallest
    /// of the relays' bounds, as they do (its own relay counts them otherwise).
    async fn cluster_relays(&mut self, within: Option<std::time::Duration>) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let own = self.config.events.is_some();
        let others = match self
            .admin
            .relaying_nodes(&self.config.node_id, within)
            .await
        {
            Ok(nodes) => nodes,
            Err(e) => {
                tracing::warn!("reading which nodes relay events: {e}");
                return true;
            }
        };
        let names: Vec<String> = others.iter().map(|(n, _)| n.clone()).collect();
        if names != self.relays_seen {
            match (own, names.is_empty()) {
                (false, false) => tracing::info!(
                    "nodes {names:?} relay the cluster's events: this node, which has no \
                     [events], keeps what they have yet to send and refuses new work past their \
                     backlog bound"
                ),
                (false, true) => tracing::info!(
                    "no node relays the cluster's events: this node prunes them after \
                     retention_events_s"
                ),
                (true, _) => {}
            }
            self.relays_seen = names;
        }
        if !own {
            let bound = others.iter().map(|&(_, max)| max).min();
            let pending = match bound {
                Some(_) => match self.admin.pending_events().await {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!("counting pending events: {e}");
                        self.metrics.events_pending.load(Relaxed)
                    }
                },
                None => 0,
            };
            self.metrics.events_pending.store(pending, Relaxed);
            self.metrics
                .events_backlogged
                .store(bound.is_some_and(|max| pending > max), Relaxed);
        }
        let relaying = others.len() + usize::from(own);
        self.metrics.relaying_nodes.store(relaying as u64, Relaxed);
        relaying > 0
    }

    /// Resolves the live attempts of `gained`, sends their QUEUED tasks to the shards, then
    /// serves them. Returns how many tasks were restored.
    async fn take_over(
        &self,
        gained: &[PartitionId],
        shards: &[mpsc::Sender<spindle_node_base::messages::ShardMsg>],
    ) -> anyhow::Result<usize> {
        let policy = self.live.current();
        let followed = Followed::new(&self.config, &policy);
        recover_attempts(&self.admin, gained, &followed).await?;
        let restores = load_restores(&self.admin, &self.config, &policy, gained).await?;
        let mut n = 0;
        for (shard, batch) in shards.iter().zip(restores) {
            n += batch.tasks.len();
            shard
                .send(spindle_node_base::messages::ShardMsg::Restore(batch))
                .await
                .map_err(|_| anyhow::anyhow!("a shard stopped"))?;
        }
        // After the restores: a tenant's first new submit queues behind them.
        for p in gained {
            self.ownership.set(*p, true);
        }
        Ok(n)
    }
}
