//! The node's suspended tenants (the shards' breakers trip them): shared by every shard, which
//! reads it at each Hello, and by `/metrics`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use spindle_core::TenantId;

/// The node's suspended tenants, until when: written by the shard that trips a tenant, read at
/// every Hello and by `/metrics`.
#[derive(Debug, Default)]
pub struct Suspensions(Mutex<HashMap<TenantId, Instant>>);

impl Suspensions {
    /// How long `tenant` stays suspended after `now`, if it is.
    pub fn left(&self, tenant: TenantId, now: Instant) -> Option<Duration> {
        let until = *self.lock().get(&tenant)?;
        (until > now).then(|| until - now)
    }

    /// Suspends `tenant` until `until` (its breaker tripped at `now`).
    pub fn set(&self, tenant: TenantId, until: Instant, now: Instant) {
        let mut map = self.lock();
        // Ended suspensions go as new ones come: the map holds only the tenants suspended now.
        map.retain(|_, u| *u > now);
        map.insert(tenant, until);
    }

    /// Tenants suspended now (for `/metrics`).
    pub fn count(&self, now: Instant) -> usize {
        self.lock().values().filter(|u| **u > now).count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TenantId, Instant>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
