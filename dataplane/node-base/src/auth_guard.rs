//! Credential guessing, throttled. Failed Hellos are counted per source address and per tenant
//! (node-wide: a guesser's connections land on any shard):
//! - an address past [`ADDRESS_FAILURES`] (a burst, then a few a second) is refused without its
//!   credential being checked for a cooldown that doubles while it keeps failing, up to
//!   [`COOLDOWN_MAX`];
//! - a tenant past [`TENANT_FAILURES`] — guesses spread over many addresses — has every Hello
//!   answered no sooner than [`TENANT_DELAY`] after it arrives, right or wrong, for the same
//!   cooldown: guessing slows to what the greeting budget lets wait, while the tenant's own
//!   clients still get in, later.
//!
//! Failures are counted and a few a second logged (the address and tenant, never the
//! credential). The tables are bounded ([`TRACKED_MAX`]); past them the quietest entries go.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::limits::{COOLDOWN_MAX, TRACKED_MAX};
use spindle_core::ledger::TokenBucket;
use spindle_core::policy::RateSpec;
use spindle_core::Time;

/// Failed Hellos one address may make: a burst of ten, then five a second.
pub const ADDRESS_FAILURES: RateSpec = RateSpec {
    per_minute: 300,
    burst: 10,
};
/// Failed Hellos for one tenant, from anywhere: a burst of a hundred, then twenty a second.
pub const TENANT_FAILURES: RateSpec = RateSpec {
    per_minute: 1_200,
    burst: 100,
};
/// The first cooldown, and the longest.
pub const COOLDOWN: Duration = Duration::from_secs(10);
/// How long a throttled tenant's Hellos wait before they are answered.
pub const TENANT_DELAY: Duration = Duration::from_millis(500);
/// Failures logged a second (a second's worth at once).
const LOGGED_PER_S: u64 = 5;

/// One address's or tenant's failures.
struct Tally {
    bucket: TokenBucket,
    /// Refused (an address) or delayed (a tenant) until then.
    until: Option<Instant>,
    /// The next cooldown (doubling while it keeps failing).
    next: Duration,
    last: Instant,
}

impl Tally {
    fn new(rate: RateSpec, now: Time, at: Instant) -> Tally {
        Tally {
            bucket: TokenBucket::new(rate, now),
            until: None,
            next: COOLDOWN,
            last: at,
        }
    }

    /// A failure: true when it starts a cooldown.
    fn failed(&mut self, now: Time, at: Instant) -> bool {
        self.last = at;
        if self.bucket.take_one(now).is_ok() {
            return false;
        }
        if self.until.is_some_and(|u| u > at) {
            return false;
        }
        self.until = Some(at + self.next);
        self.next = (self.next * 2).min(COOLDOWN_MAX);
        true
    }

    fn cooling(&self, at: Instant) -> Option<Duration> {
        self.until
            .and_then(|u| u.checked_duration_since(at))
            .filter(|d| !d.is_zero())
    }
}

/// What to do with a Hello before its credential is looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Before {
    Check,
    /// Answer it no sooner than this from now (its tenant is being guessed at).
    Delay(Duration),
    /// Refuse it unchecked: its address failed too often; this long left.
    Refuse(Duration),
}

pub struct AuthGuard {
    epoch: Instant,
    addresses: HashMap<IpAddr, Tally>,
    tenants: HashMap<u32, Tally>,
    logged: TokenBucket,
    /// Failed Hellos, Hellos refused unchecked, and Hellos delayed (`/metrics`).
    counts: Arc<[AtomicU64; 3]>,
}

impl AuthGuard {
    pub fn new(counts: Arc<[AtomicU64; 3]>) -> AuthGuard {
        AuthGuard {
            epoch: Instant::now(),
            addresses: HashMap::new(),
            tenants: HashMap::new(),
            logged: TokenBucket::new(
                RateSpec {
                    per_minute: LOGGED_PER_S * 60,
                    burst: LOGGED_PER_S,
                },
                Time::ZERO,
            ),
            counts,
        }
    }

    fn time(&self, at: Instant) -> Time {
        Time::of(at, self.epoch)
    }

    /// A Hello from `from` for `tenant` arrived at `at`.
    pub fn before(&self, from: IpAddr, tenant: u32, at: Instant) -> Before {
        if let Some(left) = self.addresses.get(&from).and_then(|t| t.cooling(at)) {
            self.counts[1].fetch_add(1, Relaxed);
            return Before::Refuse(left);
        }
        if self
            .tenants
            .get(&tenant)
            .and_then(|t| t.cooling(at))
            .is_some()
        {
            self.counts[2].fetch_add(1, Relaxed);
            return Before::Delay(TENANT_DELAY);
        }
        Before::Check
    }

    /// The Hello from `from` for `tenant` failed its credential.
    pub fn failed(&mut self, from: IpAddr, tenant: u32, at: Instant) {
        self.counts[0].fetch_add(1, Relaxed);
        let now = self.time(at);
        let address_cools = track(&mut self.addresses, from, ADDRESS_FAILURES, now, at);
        let tenant_cools = track(&mut self.tenants, tenant, TENANT_FAILURES, now, at);
        if address_cools || tenant_cools || self.logged.take_one(now).is_ok() {
            tracing::warn!(
                %from,
                tenant,
                address_cools,
                tenant_cools,
                "a Hello failed its credential"
            );
        }
    }
}

/// Counts a failure of `key`, making room past [`TRACKED_MAX`]; whether a cooldown started.
fn track<K: std::hash::Hash + Eq + Copy>(
    table: &mut HashMap<K, Tally>,
    key: K,
    rate: RateSpec,
    now: Time,
    at: Instant,
) -> bool {
    if !table.contains_key(&key) && table.len() >= TRACKED_MAX {
        // The quietest go first: those not cooling, that failed longest ago.
        let idle = COOLDOWN_MAX;
        table.retain(|_, t| t.cooling(at).is_some() || at.duration_since(t.last) < idle);
        if table.len() >= TRACKED_MAX {
            if let Some(oldest) = table.iter().min_by_key(|(_, t)| t.last).map(|(k, _)| *k) {
                table.remove(&oldest);
            }
        }
    }
    table
        .entry(key)
        .or_insert_with(|| Tally::new(rate, now, at))
        .failed(now, at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    /// A thousand wrong Hellos a second from one address: after its burst it is refused
    /// unchecked, and what is checked over a minute stays at its few a second.
    #[test]
    fn one_address_guessing_fast_is_cut_to_a_few_checks_a_second() {
        let mut g = AuthGuard::new(Arc::default());
        let t0 = Instant::now();
        let mut checked = 0;
        for i in 0..60_000u64 {
            let at = t0 + Duration::from_millis(i);
            if g.before(ip(1), 7, at) == Before::Check {
                checked += 1;
                g.failed(ip(1), 7, at);
            }
        }
        // 10 at once, 5 a second until the first cooldown, then cooled most of the minute.
        assert!(checked <= 10 * 60, "{checked} checked in a minute");
        assert!(checked >= 10, "{checked}");
        // Another address is not held by it.
        assert_eq!(
            g.before(ip(2), 8, t0 + Duration::from_secs(60)),
            Before::Check
        );
    }

    /// Guesses for one tenant spread over many addresses: past the tenant's burst its Hellos
    /// wait before they are answered (its clients still get in); the cooldown ends.
    #[test]
    fn a_tenant_guessed_at_from_many_addresses_is_slowed_for_a_while() {
        let mut g = AuthGuard::new(Arc::default());
        let t0 = Instant::now();
        for i in 0..200u32 {
            let at = t0 + Duration::from_millis(u64::from(i));
            g.failed(IpAddr::from(i.to_be_bytes()), 9, at);
        }
        let at = t0 + Duration::from_millis(300);
        assert_eq!(g.before(ip(200), 9, at), Before::Delay(TENANT_DELAY));
        assert_eq!(g.before(ip(200), 10, at), Before::Check);
        assert_eq!(
            g.before(ip(200), 9, at + COOLDOWN + Duration::from_secs(1)),
            Before::Check
        );
    }

    #[test]
    fn the_tables_stay_bounded() {
        let mut g = AuthGuard::new(Arc::default());
        let t0 = Instant::now();
        for i in 0..(TRACKED_MAX as u32 + 100) {
            g.failed(IpAddr::from(i.to_be_bytes()), i, t0);
        }
        assert!(g.addresses.len() <= TRACKED_MAX);
        assert!(g.tenants.len() <= TRACKED_MAX);
    }
}
