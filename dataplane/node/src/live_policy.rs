//! The policy the node runs with, kept in step with the policy store.
//!
//! The effective policy is the configuration's ([`crate::policy`]) with every stored object over
//! it: a tenant policy, a lane, a provider account or a model capability row replaces the
//! configured one of the same key, and deleting the row returns to the configured one. The node
//! builds its shards from the effective policy at start; afterwards one cheap version read a
//! second notices a newer version, and the difference to what runs goes to the shards object
//! by object ([`Policy::diff`]): tenants to the shard that owns them, everything else to every
//! shard, then the new version, which the tasks admitted from then on carry. A shard's core
//! checks each object again before it takes it; node-wide capacities (a lane's pool, a provider
//! account's concurrency and RPM) move through the shards' share board, and a provider
//! account's concurrency also resizes its pool in PostgreSQL.
//!
//! Provider accounts and models are fixed in number and name at start (their ids index the
//! shards' limits): a stored row that adds or renames one is left out, counted in
//! `spindle_policy_objects_skipped` and logged; the admin API refuses such changes up front.

use std::sync::{Arc, Mutex};

use spindle_control::policy::PolicyRow;
use spindle_control::{Db, DbConfig};
use spindle_core::policy::PolicyPatch;
use spindle_core::{Policy, PolicyVersion};
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::shard::ShardMsg;

/// How often a node looks for a newer policy version.
const POLICY_POLL: std::time::Duration = std::time::Duration::from_secs(1);

/// The configured policy and the effective one, shared by the watcher (which writes it) and
/// the admin API (which reads it).
pub struct LivePolicy {
    base: Policy,
    current: Mutex<Arc<Policy>>,
}

impl LivePolicy {
    pub fn new(base: Policy) -> Arc<LivePolicy> {
        let current = Mutex::new(Arc::new(base.clone()));
        Arc::new(LivePolicy { base, current })
    }

    /// The configuration's policy.
    pub fn base(&self) -> &Policy {
        &self.base
    }

    /// The policy the shards run with now.
    pub fn current(&self) -> Arc<Policy> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set(&self, policy: Policy) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(policy);
    }

    /// Reads the store and makes `base` + its objects the effective policy; the caller builds
    /// the shards from what this returns.
    pub async fn load(&self, db: &mut Db, metrics: &Metrics) -> anyhow::Result<Policy> {
        let (version, rows) = db.policy_snapshot().await?;
        let (policy, skipped) = effective(&self.base, version, &rows);
        report_skipped(&skipped, metrics);
        self.set(policy.clone());
        metrics
            .policy_version
            .store(version.0, std::sync::atomic::Ordering::Relaxed);
        Ok(policy)
    }
}

/// `base` with every stored object of `rows` over it, at `version`; the objects the node cannot
/// take, each with why, are left out.
pub fn effective(
    base: &Policy,
    version: PolicyVersion,
    rows: &[PolicyRow],
) -> (Policy, Vec<String>) {
    let mut policy = base.clone();
    policy.version = version;
    let mut skipped = Vec::new();
    for row in rows {
        let applied = row
            .patch()
            .and_then(|patch| policy.apply(patch).map_err(|e| e.to_string()));
        if let Err(why) = applied {
            skipped.push(format!("{} {}: {why}", row.object.name(), row.key));
        }
    }
    (policy, skipped)
}

fn report_skipped(skipped: &[String], metrics: &Metrics) {
    for why in skipped {
        tracing::warn!("stored policy object not applied: {why}");
    }
    metrics
        .policy_skipped
        .store(skipped.len() as u64, std::sync::atomic::Ordering::Relaxed);
}

/// Watches the store for newer versions and brings the shards to them (see the module docs),
/// from `applied`, the version the shards were built with.
pub async fn watch(
    db_config: DbConfig,
    config: crate::config::Config,
    live: Arc<LivePolicy>,
    metrics: Arc<Metrics>,
    shards: Vec<mpsc::Sender<ShardMsg>>,
) {
    let mut db: Option<Db> = None;
    let mut tick = tokio::time::interval(POLICY_POLL);
    loop {
        tick.tick().await;
        if db.as_ref().is_none_or(Db::is_closed) {
            db = Db::open(&db_config).await.ok();
        }
        let Some(conn) = db.as_mut() else { continue };
        let applied = live.current().version;
        match conn.policy_version().await {
            Ok(v) if v <= applied => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!("reading the policy version: {e}");
                continue;
            }
        }
        let (version, rows) = match conn.policy_snapshot().await {
            Ok(snapshot) => snapshot,
            Err(e) => {
                tracing::warn!("reading the policy: {e}");
                continue;
            }
        };
        let (next, skipped) = effective(live.base(), version, &rows);
        report_skipped(&skipped, &metrics);
        let current = live.current();
        for patch in current.diff(&next) {
            if let PolicyPatch::Provider(p) = &patch {
                let old = &current.providers[p.id.0 as usize];
                if old.concurrency != p.concurrency {
                    let resized =
                        crate::control::set_provider_pool(conn, &p.name, p.concurrency).await;
                    if let Err(e) = resized {
                        // The next version (or restart) sets it; the node's own share board
                        // already bounds what this node starts.
                        tracing::warn!(
                            "resizing {} to {}: {e}",
                            crate::control::provider_pool(&p.name),
                            p.concurrency
                        );
                    }
                }
            }
            let to: Vec<&mpsc::Sender<ShardMsg>> = match &patch {
                PolicyPatch::Tenant(t, _) => vec![&shards[config.shard_of(t.0)]],
                _ => shards.iter().collect(),
            };
            for shard in to {
                if shard.send(ShardMsg::Policy(patch.clone())).await.is_err() {
                    return;
                }
            }
        }
        for shard in &shards {
            if shard.send(ShardMsg::PolicyVersion(version)).await.is_err() {
                return;
            }
        }
        live.set(next);
        metrics
            .policy_version
            .store(version.0, std::sync::atomic::Ordering::Relaxed);
        tracing::info!("policy version {version} applied");
    }
}
