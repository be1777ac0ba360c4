//! The policy the node runs with, kept in step with the policy store.
//!
//! The effective policy is the configuration's ([`spindle_node_base::policy`]) with every stored object over
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
//! A provider account or a model may also be added while the node runs — the next id under a
//! new name — up to [`ADDED_WHILE_RUNNING_MAX`] of each beyond those the node started with
//! (the shards' share board is made with room for their limits at start): the account's pool
//! rows are made in PostgreSQL and its circuit breaker added before the shards take it, and
//! every shard registers its limits after the existing ones. Renames, and additions past the
//! room, are left out, counted in `spindle_policy_objects_skipped` and logged (a restart takes
//! them); the admin API refuses them up front.

use std::sync::{Arc, Mutex, OnceLock};

use spindle_control::policy::{PolicyObject, PolicyRow};
use spindle_control::{Db, DbConfig};
use spindle_core::policy::PolicyPatch;
use spindle_core::{Policy, PolicyVersion};
use tokio::sync::mpsc;

pub use spindle_node_base::limits::ADDED_WHILE_RUNNING_MAX;
use spindle_node_base::messages::ShardMsg;
use spindle_node_base::metrics::Metrics;

/// How often a node looks for a newer policy version.
const POLICY_POLL: std::time::Duration = std::time::Duration::from_secs(1);

/// Node-wide limits the shards' share board holds room for, beyond the starting policy's: a
/// provider account's concurrency and RPM, a model's running tasks and units.
pub const ROOM_LIMITS: usize = 4 * ADDED_WHILE_RUNNING_MAX;

/// The most provider accounts and models the running node can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub providers: usize,
    pub models: usize,
}

impl Room {
    /// Room for [`ADDED_WHILE_RUNNING_MAX`] of each beyond what `policy` has.
    pub fn beyond(policy: &Policy) -> Room {
        Room {
            providers: policy.providers.len() + ADDED_WHILE_RUNNING_MAX,
            models: policy.models.len() + ADDED_WHILE_RUNNING_MAX,
        }
    }

    /// Whether `patch`, applied to `policy`, stays within this room.
    fn check(&self, policy: &Policy, patch: &PolicyPatch) -> Result<(), String> {
        let (what, count, most) = match patch {
            PolicyPatch::Provider(p) if usize::from(p.id.0) >= policy.providers.len() => {
                ("provider accounts", usize::from(p.id.0) + 1, self.providers)
            }
            PolicyPatch::Model(m) if usize::from(m.id.0) >= policy.models.len() => {
                ("models", usize::from(m.id.0) + 1, self.models)
            }
            _ => return Ok(()),
        };
        if count > most {
            return Err(format!(
                "this node holds at most {most} {what} until it restarts \
                 ({ADDED_WHILE_RUNNING_MAX} more than it started with)"
            ));
        }
        Ok(())
    }
}

/// The configured policy and the effective one, shared by the watcher (which writes it) and
/// the admin API (which reads it).
pub struct LivePolicy {
    base: Policy,
    current: Mutex<Arc<Policy>>,
    /// Set when the shards are built from the loaded policy.
    room: OnceLock<Room>,
}

/// The lanes as the policy in force has them: open or closed, and their weights.
impl spindle_node_base::exposition::Collect for LivePolicy {
    fn collect(&self, w: &mut String) {
        use std::fmt::Write;
        let policy = self.current();
        let _ = writeln!(w, "# HELP spindle_lane_open 1 while a lane admits new work.\n# TYPE spindle_lane_open gauge\n# HELP spindle_lane_weight A lane's weight among the lanes with work.\n# TYPE spindle_lane_weight gauge");
        for lane in spindle_core::Lane::ALL {
            let _ = writeln!(
                w,
                "spindle_lane_open{{lane=\"{lane}\"}} {}\nspindle_lane_weight{{lane=\"{lane}\"}} {}",
                u8::from(policy.lane(lane).open),
                policy.lane(lane).weight
            );
        }
    }
}

impl LivePolicy {
    pub fn new(base: Policy) -> Arc<LivePolicy> {
        let current = Mutex::new(Arc::new(base.clone()));
        Arc::new(LivePolicy {
            base,
            current,
            room: OnceLock::new(),
        })
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

    /// Whether the running node can take `patch` over the stored policy objects `rows` (what
    /// it will run once its watcher reads them, which may be ahead of [`LivePolicy::current`]:
    /// a model may name an account added a moment before): the policy's own checks, and room
    /// for a new provider account or model.
    pub fn check_over(
        &self,
        version: PolicyVersion,
        rows: &[PolicyRow],
        patch: &PolicyPatch,
    ) -> Result<(), String> {
        let (stored, _) = self.effective_over(&self.current(), version, rows);
        stored.check(patch).map_err(|e| e.to_string())?;
        self.room
            .get()
            .map_or(Ok(()), |room| room.check(&stored, patch))
    }

    /// The configuration with the stored objects `rows` over it, for a node that runs `current`
    /// (see [`Running`]; before the shards are built, as at a start).
    fn effective_over(
        &self,
        current: &Policy,
        version: PolicyVersion,
        rows: &[PolicyRow],
    ) -> (Policy, Vec<String>) {
        let running = self.room.get().map(|room| Running { room, current });
        effective(&self.base, version, rows, running)
    }

    /// Whether the row of `object` `key` may be deleted: not that of a provider account or
    /// model the configuration does not have (added through the store) — its id would be left
    /// unfilled at the next start, and every one added after it refused there. Such an account
    /// is stopped by its concurrency (0); such a model stays in the policy.
    pub fn check_delete(&self, object: PolicyObject, key: &str) -> Result<(), String> {
        let current = self.current();
        let added = match object {
            PolicyObject::ProviderAccount => {
                let named = |p: &spindle_core::policy::ProviderPolicy| p.name == key;
                !self.base.providers.iter().any(named) && current.providers.iter().any(named)
            }
            PolicyObject::ModelCapability => {
                let named = |m: &spindle_core::ModelCapability| m.name == key;
                !self.base.models.iter().any(named) && current.models.iter().any(named)
            }
            PolicyObject::Tenant | PolicyObject::Lane => false,
        };
        if !added {
            return Ok(());
        }
        Err(format!(
            "{key} was added through the store and cannot be deleted (its id would be left \
             unfilled); stop using it instead (a provider account: concurrency 0)"
        ))
    }

    fn set(&self, policy: Policy) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(policy);
    }

    /// Reads the store and makes `base` + its objects the effective policy; the caller builds
    /// the shards from what this returns.
    pub async fn load(&self, db: &mut Db, metrics: &Metrics) -> anyhow::Result<Policy> {
        let (version, rows) = db.policy_snapshot().await?;
        let (policy, skipped) = effective(&self.base, version, &rows, None);
        report_skipped(&skipped, metrics);
        let _ = self.room.set(Room::beyond(&policy));
        self.set(policy.clone());
        metrics
            .policy_version
            .store(version.0, std::sync::atomic::Ordering::Relaxed);
        Ok(policy)
    }
}

/// What a running node's effective policy is computed against.
#[derive(Clone, Copy)]
pub struct Running<'a> {
    /// Additions past it are left out.
    pub room: &'a Room,
    /// What the shards run: an account or model the node added (beyond `base`'s) stays, at its
    /// last value, when its row is deleted — the shards cannot drop its limits — until the node
    /// restarts, as a tenant only the store knew does.
    pub current: &'a Policy,
}

/// `base` with every stored object of `rows` over it, at `version`; the objects the node cannot
/// take (for a running node, within its room and over what it added), each with why, are left
/// out.
pub fn effective(
    base: &Policy,
    version: PolicyVersion,
    rows: &[PolicyRow],
    running: Option<Running<'_>>,
) -> (Policy, Vec<String>) {
    let mut policy = base.clone();
    policy.version = version;
    if let Some(r) = running {
        let added = r.current.providers.iter().skip(base.providers.len());
        policy.providers.extend(added.cloned());
        let added = r.current.models.iter().skip(base.models.len());
        policy.models.extend(added.cloned());
    }
    let room = running.map(|r| r.room);
    let mut skipped = Vec::new();
    // The store lists each kind's rows by name; accounts and models are taken in id order (a
    // new one must take the next id), every kind in the order of `PolicyObject::ALL` (accounts
    // before the models that name them).
    let mut ordered: Vec<(&PolicyRow, Result<PolicyPatch, String>)> =
        rows.iter().map(|row| (row, row.patch())).collect();
    ordered.sort_by_key(|(row, patch)| {
        let kind = PolicyObject::ALL.iter().position(|o| *o == row.object);
        let id = match patch {
            Ok(PolicyPatch::Provider(p)) => p.id.0,
            Ok(PolicyPatch::Model(m)) => m.id.0,
            _ => 0,
        };
        (kind, id)
    });
    for (row, patch) in ordered {
        let applied = patch.and_then(|patch| {
            if let Some(room) = room {
                room.check(&policy, &patch)?;
            }
            policy.apply(patch).map_err(|e| e.to_string())
        });
        if let Err(why) = applied {
            skipped.push(format!("{} {}: {why}", row.object.name(), row.key));
        }
    }
    (policy, skipped)
}

/// Makes every provider account `patches` add ready for the shards: its pool rows in
/// PostgreSQL (as a start makes them) and its circuit breaker. False when one could not be.
async fn add_providers(
    db: &Db,
    metrics: &Metrics,
    current: &Policy,
    patches: &[PolicyPatch],
) -> bool {
    for patch in patches {
        let PolicyPatch::Provider(p) = patch else {
            continue;
        };
        if usize::from(p.id.0) < current.providers.len() {
            continue;
        }
        if let Err(e) = crate::control::set_provider_pool(db, &p.name, p.concurrency).await {
            tracing::warn!("adding provider account {}: its pool: {e}", p.name);
            return false;
        }
        if metrics.health.get().is_some_and(|h| !h.add(&p.name)) {
            // Room was checked against the same bound.
            tracing::warn!(
                "adding provider account {}: no room for its breaker",
                p.name
            );
            return false;
        }
        tracing::info!("provider account {} ({}) added", p.name, p.id);
    }
    true
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
    config: spindle_node_base::config::Config,
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
        let current = live.current();
        let (next, skipped) = live.effective_over(&current, version, &rows);
        report_skipped(&skipped, &metrics);
        let patches = current.diff(&next);
        // A new provider account's pool rows and circuit breaker come first: the shards may
        // claim on it as soon as they take it. Until both are in place nothing of the version
        // is applied (the next poll tries again).
        if !add_providers(conn, &metrics, &current, &patches).await {
            continue;
        }
        for patch in patches {
            if let PolicyPatch::Provider(p) = &patch {
                // A new account's pool was made above.
                let old = current.providers.get(p.id.0 as usize);
                if old.is_some_and(|old| old.concurrency != p.concurrency) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use spindle_core::{ModelId, ProviderId};

    fn provider_row(base: &Policy, id: u16) -> PolicyRow {
        let mut p = base.providers[0].clone();
        p.id = ProviderId(id);
        p.name = format!("added-{id}");
        PolicyRow {
            object: PolicyObject::ProviderAccount,
            key: p.name.clone(),
            version: PolicyVersion(2),
            body: serde_json::to_value(&p).unwrap(),
        }
    }

    /// A running node takes accounts added within its room and leaves the rest out, with why;
    /// at start (no room yet) it takes every one the policy allows.
    #[test]
    fn accounts_added_past_the_room_are_left_out_with_the_reason() {
        let base = spindle_core::presets::small_node();
        let n = base.providers.len() as u16;
        let rows: Vec<_> = (n..n + 3).map(|id| provider_row(&base, id)).collect();
        let room = Room {
            providers: usize::from(n) + 2,
            models: base.models.len(),
        };
        let running = Running {
            room: &room,
            current: &base,
        };
        let (policy, skipped) = effective(&base, PolicyVersion(2), &rows, Some(running));
        assert_eq!(policy.providers.len(), usize::from(n) + 2);
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(
            skipped[0].contains(&format!("at most {} provider accounts", n + 2)),
            "{skipped:?}"
        );
        let (policy, skipped) = effective(&base, PolicyVersion(2), &rows, None);
        assert_eq!(
            (policy.providers.len(), skipped.len()),
            (usize::from(n) + 3, 0)
        );
        // A model past the room is left out the same way.
        let mut m = base.models[0].clone();
        m.id = ModelId(base.models.len() as u16);
        m.name = "added-model".into();
        let patch = PolicyPatch::Model(m);
        let full = Room {
            providers: room.providers,
            models: base.models.len(),
        };
        assert!(full.check(&base, &patch).unwrap_err().contains("at most"));
        assert_eq!(Room::beyond(&base).check(&base, &patch), Ok(()));
    }

    /// An account the running node added stays when its row is deleted (its shards hold its
    /// limits), at its last value, and the next one added after it still takes the next id.
    #[test]
    fn an_added_account_whose_row_is_deleted_stays_until_a_restart() {
        let base = spindle_core::presets::small_node();
        let n = base.providers.len() as u16;
        let first = provider_row(&base, n);
        let (current, _) = effective(&base, PolicyVersion(2), &[first], None);
        let room = Room::beyond(&base);
        let running = Running {
            room: &room,
            current: &current,
        };
        let second = provider_row(&base, n + 1);
        let (next, skipped) = effective(&base, PolicyVersion(3), &[second], Some(running));
        assert_eq!(skipped, Vec::<String>::new());
        let names: Vec<_> = next.providers[usize::from(n)..]
            .iter()
            .map(|p| p.name.clone())
            .collect();
        assert_eq!(names, [format!("added-{n}"), format!("added-{}", n + 1)]);
        assert!(current
            .diff(&next)
            .iter()
            .all(|p| matches!(p, PolicyPatch::Provider(p) if p.id == ProviderId(n + 1))));
        // After a restart (no running policy) the deleted row's account is gone, and so the
        // one after it has a gap before it.
        let second = provider_row(&base, n + 1);
        let (restarted, skipped) = effective(&base, PolicyVersion(3), &[second], None);
        assert_eq!(restarted.providers.len(), usize::from(n));
        assert_eq!(skipped.len(), 1, "{skipped:?}");
    }

    /// The store lists rows by name; accounts added in another order of names than of ids are
    /// all taken.
    #[test]
    fn added_accounts_are_taken_in_id_order_whatever_their_names() {
        let base = spindle_core::presets::small_node();
        let n = base.providers.len() as u16;
        let mut rows: Vec<_> = (n..n + 3).map(|id| provider_row(&base, id)).collect();
        for (row, name) in rows.iter_mut().zip(["zulu", "mike", "alpha"]) {
            row.key = name.into();
            row.body["name"] = name.into();
        }
        rows.sort_by(|a, b| a.key.cmp(&b.key));
        let (policy, skipped) = effective(&base, PolicyVersion(2), &rows, None);
        assert_eq!(skipped, Vec::<String>::new());
        let names: Vec<_> = policy.providers[usize::from(n)..]
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(names, ["zulu", "mike", "alpha"]);
    }
}
