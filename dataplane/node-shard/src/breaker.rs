//! The tenant breaker (design.md §4: an abnormal tenant is cut off). A tenant whose
//! requests keep being refused — submitted tasks rejected at admission, cancels and reads past
//! their rate, frames that do not decode — faster than `[breaker] refusals_per_s` for longer
//! than its burst is suspended for a cooldown: the connection that tripped it and then each of
//! its others, at their next request, are answered `TenantSuspended` and closed, and its
//! Hellos are refused until the cooldown ends. A trip within `cooldown_max_ms` of the last one's
//! end doubles the cooldown, up to that. Its queued and running work goes on; what it sends
//! after the cooldown is served as before.
//!
//! Each rejection costs the node little, but a client that retries at once, in a loop, takes
//! its shard's core from the other tenants there (a shard answers ~100,000 rejections a second,
//! docs/benchmarks/journal.md): the breaker makes it reconnect, and refuses it, instead.
//!
//! Refusals are counted where the tenant's connections are served, on the shard owning it
//! (a connection that could not be handed over counts on the shard that accepted it); the
//! suspensions are node-wide, read by every shard at a Hello.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use spindle_core::hash::RunMap;
use spindle_core::ledger::TokenBucket;
use spindle_core::{TenantId, Time};
pub use spindle_node_base::config::BreakerConfig;
pub use spindle_node_base::suspensions::Suspensions;

/// A tenant's refusals as one shard counts them.
#[derive(Debug, Clone)]
struct Refusals {
    /// Refusals it may still make at once: `refusals_per_s`, a burst of `burst_s` of them.
    bucket: TokenBucket,
    /// The end of its last suspension, and that suspension's length.
    last: Option<(Instant, Duration)>,
}

/// What recording a refusal found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the tenant's rate.
    Served,
    /// Suspended (now, or still) for this long.
    Suspended(Duration),
}

/// One shard's breaker: its tenants' refusals; the suspensions it writes are the node's
/// (`Metrics::suspensions`).
pub struct Breaker {
    config: BreakerConfig,
    /// The buckets' clock's zero.
    epoch: Instant,
    /// Only authenticated tenants (ids of the policy): the core's fast hasher is safe here.
    tenants: RefCell<RunMap<TenantId, Refusals>>,
    metrics: std::sync::Arc<spindle_node_base::metrics::Metrics>,
}

impl Breaker {
    pub fn new(
        config: BreakerConfig,
        metrics: std::sync::Arc<spindle_node_base::metrics::Metrics>,
    ) -> Breaker {
        Breaker {
            config,
            epoch: Instant::now(),
            tenants: RefCell::new(RunMap::default()),
            metrics,
        }
    }

    /// Whether `tenant` is suspended now by this shard's count: its request is not served.
    /// (A suspension another shard wrote is checked at the Hello.)
    pub fn check(&self, tenant: TenantId, now: Instant) -> Verdict {
        let tenants = self.tenants.borrow();
        match tenants.get(&tenant).and_then(|r| r.last) {
            Some((until, _)) if until > now => Verdict::Suspended(until - now),
            _ => Verdict::Served,
        }
    }

    /// Counts `n` refusals of `tenant`'s requests; trips the breaker when they are past its
    /// rate and burst.
    pub fn refused(&self, tenant: TenantId, n: u64, now: Instant) -> Verdict {
        if n == 0 || self.config.refusals_per_s == 0 {
            return Verdict::Served;
        }
        let at = Time::of(now, self.epoch);
        let mut tenants = self.tenants.borrow_mut();
        let r = tenants.entry(tenant).or_insert_with(|| Refusals {
            bucket: TokenBucket::new(self.config.rate(), at),
            last: None,
        });
        if let Some((until, _)) = r.last.filter(|(until, _)| *until > now) {
            return Verdict::Suspended(until - now);
        }
        if r.bucket.try_take(n, at) {
            return Verdict::Served;
        }
        r.bucket.drain(at);
        let base = Duration::from_millis(self.config.cooldown_ms);
        let max = Duration::from_millis(self.config.cooldown_max_ms);
        let cooldown = match r.last {
            Some((end, length)) if now.saturating_duration_since(end) <= max => {
                (length * 2).min(max)
            }
            _ => base,
        };
        let until = now + cooldown;
        r.last = Some((until, cooldown));
        drop(tenants);
        self.metrics.suspensions.set(tenant, until, now);
        self.metrics
            .breaker_trips
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(
            "tenant {tenant} suspended for {cooldown:?}: its requests were refused faster than \
             {} a second for more than {} s (the tenant breaker)",
            self.config.refusals_per_s,
            self.config.burst_s
        );
        Verdict::Suspended(cooldown)
    }
}

/// The error a suspended tenant's request, or Hello, is answered with.
pub fn suspended_error(tenant: TenantId, left: Duration) -> spindle_wire::WireError {
    spindle_wire::WireError::new(
        spindle_wire::ErrorCode::TenantSuspended,
        format!(
            "tenant {tenant} is suspended for {} ms more: its requests were refused too fast \
             (the node's tenant breaker); connect again after that",
            left.as_millis().max(1)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(refusals_per_s: u64) -> Breaker {
        let config = BreakerConfig {
            refusals_per_s,
            burst_s: 2,
            cooldown_ms: 100,
            cooldown_max_ms: 1_000,
        };
        let metrics = spindle_node_base::metrics::Metrics::new(1);
        Breaker::new(config, metrics)
    }

    #[test]
    fn a_tenant_past_its_burst_and_rate_is_suspended_and_the_next_trip_lasts_longer() {
        let b = breaker(10);
        let (t, other) = (TenantId(1), TenantId(2));
        let t0 = Instant::now();
        // A burst of 2 s × 10: 20 refusals at once.
        assert_eq!(b.refused(t, 20, t0), Verdict::Served);
        assert_eq!(b.check(t, t0), Verdict::Served);
        // A tenth of a second later one more has come back.
        let t1 = t0 + Duration::from_millis(100);
        assert_eq!(b.refused(t, 1, t1), Verdict::Served);
        let tripped = b.refused(t, 1, t1);
        assert_eq!(tripped, Verdict::Suspended(Duration::from_millis(100)));
        assert_eq!(
            b.metrics
                .breaker_trips
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        let t2 = t1 + Duration::from_millis(40);
        assert_eq!(
            b.check(t, t2),
            Verdict::Suspended(Duration::from_millis(60))
        );
        assert_eq!(
            b.metrics.suspensions.left(t, t2),
            Some(Duration::from_millis(60))
        );
        assert_eq!(b.metrics.suspensions.count(t2), 1);
        // Refusals while suspended are not counted again.
        assert_eq!(
            b.refused(t, 1_000, t2),
            Verdict::Suspended(Duration::from_millis(60))
        );
        // Another tenant is not touched.
        assert_eq!(b.check(other, t2), Verdict::Served);
        assert_eq!(b.refused(other, 20, t2), Verdict::Served);
        // The cooldown ends; the bucket refilled while it ran (1 per 100 ms), so a flood that
        // goes on trips again at once, for twice as long.
        let t3 = t1 + Duration::from_millis(100);
        assert_eq!(b.check(t, t3), Verdict::Served);
        assert_eq!(b.refused(t, 1, t3), Verdict::Served);
        assert_eq!(
            b.refused(t, 1, t3),
            Verdict::Suspended(Duration::from_millis(200))
        );
        // Quiet for longer than the longest cooldown: back to the first.
        let t4 = t3 + Duration::from_millis(200 + 2_001);
        assert_eq!(b.refused(t, 20, t4), Verdict::Served);
        assert_eq!(
            b.refused(t, 1, t4),
            Verdict::Suspended(Duration::from_millis(100))
        );
    }

    #[test]
    fn cooldowns_double_up_to_the_longest() {
        let b = breaker(1);
        let t = TenantId(7);
        let mut now = Instant::now();
        let mut seen = Vec::new();
        for _ in 0..6 {
            let verdict = b.refused(t, 100, now);
            let Verdict::Suspended(cooldown) = verdict else {
                panic!("{verdict:?}");
            };
            seen.push(cooldown.as_millis());
            now += cooldown;
        }
        assert_eq!(seen, [100, 200, 400, 800, 1_000, 1_000]);
    }

    #[test]
    fn a_breaker_at_zero_is_off() {
        let b = breaker(0);
        let now = Instant::now();
        assert_eq!(b.refused(TenantId(1), u64::MAX, now), Verdict::Served);
        assert_eq!(b.check(TenantId(1), now), Verdict::Served);
    }
}
