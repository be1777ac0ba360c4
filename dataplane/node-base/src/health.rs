//! Provider health: a circuit breaker per provider account. The provider thread records each
//! submit's outcome; after `BREAKER_FAILURES` answers in a row that say nothing (no answer, a
//! 5xx, a connection that never opened) the account's circuit opens for `BREAKER_OPEN_MS`, and
//! the shards give it no new work (its concurrency share is held at what already runs there),
//! so new attempts go to a compatible provider. Only attempts that provably were not accepted
//! are ever requeued, so failover never doubles a job. When the time is up the circuit closes
//! and the next failure streak counts from zero.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::Instant;

/// Answers in a row without a definite outcome before the circuit opens.
pub const BREAKER_FAILURES: u32 = 3;
/// How long an open circuit keeps new work away.
pub const BREAKER_OPEN_MS: u64 = 5_000;

pub struct ProviderHealth {
    /// In the policy's order; accounts added while the node runs are appended
    /// ([`ProviderHealth::add`]), up to the room the breakers were made with.
    names: RwLock<Vec<String>>,
    failures: Vec<AtomicU32>,
    /// Milliseconds since `epoch` until which the circuit is open (0: closed).
    open_until: Vec<AtomicU64>,
    opened: Vec<AtomicU64>,
    epoch: Instant,
}

impl ProviderHealth {
    /// One breaker per provider account, in the policy's order, and room for `room` more.
    pub fn new(names: Vec<String>, room: usize) -> ProviderHealth {
        let n = names.len() + room;
        ProviderHealth {
            names: RwLock::new(names),
            failures: (0..n).map(|_| AtomicU32::new(0)).collect(),
            open_until: (0..n).map(|_| AtomicU64::new(0)).collect(),
            opened: (0..n).map(|_| AtomicU64::new(0)).collect(),
            epoch: Instant::now(),
        }
    }

    /// A breaker for an account added while the node runs (after every other one, as its id
    /// is); false when the room the breakers were made with is used up.
    pub fn add(&self, name: &str) -> bool {
        let mut names = self.names.write().unwrap_or_else(|p| p.into_inner());
        if names.iter().any(|n| n == name) {
            return true;
        }
        if names.len() == self.failures.len() {
            return false;
        }
        names.push(name.to_string());
        true
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// A submit to `account` got a definite answer (`true`: accepted, rate limited or refused)
    /// or none (`false`).
    pub fn record(&self, account: &str, definite: bool) {
        let Some(i) = self
            .names
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .position(|n| n == account)
        else {
            return;
        };
        if definite {
            self.failures[i].store(0, Ordering::Relaxed);
            return;
        }
        let streak = self.failures[i].fetch_add(1, Ordering::Relaxed) + 1;
        if streak >= BREAKER_FAILURES && !self.is_open(i) {
            self.open_until[i].store(self.now_ms() + BREAKER_OPEN_MS, Ordering::Relaxed);
            self.failures[i].store(0, Ordering::Relaxed);
            self.opened[i].fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "provider {account}: {streak} submits without an answer; circuit open for {BREAKER_OPEN_MS} ms"
            );
        }
    }

    /// Whether provider `i`'s circuit is open now.
    pub fn is_open(&self, i: usize) -> bool {
        self.open_until
            .get(i)
            .is_some_and(|u| u.load(Ordering::Relaxed) > self.now_ms())
    }

    /// (name, open now, times opened) per account, for `/metrics`.
    pub fn snapshot(&self) -> Vec<(String, bool, u64)> {
        self.names
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .enumerate()
            .map(|(i, n)| {
                (
                    n.clone(),
                    self.is_open(i),
                    self.opened[i].load(Ordering::Relaxed),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streak_of_unknown_answers_opens_the_circuit_and_a_definite_one_resets_it() {
        let h = ProviderHealth::new(vec!["a".into(), "b".into()], 1);
        h.record("a", false);
        h.record("a", false);
        h.record("a", true);
        h.record("a", false);
        h.record("a", false);
        assert!(!h.is_open(0), "the streak was broken");
        h.record("a", false);
        assert!(h.is_open(0));
        assert!(!h.is_open(1));
        assert_eq!(h.snapshot()[0], ("a".to_string(), true, 1));
        // An account added while running gets its own breaker, within the room.
        assert!(h.add("c"));
        assert!(h.add("c"), "added once");
        assert!(!h.add("d"), "no room left");
        for _ in 0..BREAKER_FAILURES {
            h.record("c", false);
        }
        assert!(h.is_open(2));
        assert_eq!(h.snapshot().len(), 3);
    }
}
