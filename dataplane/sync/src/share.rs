//! Node-wide limits sub-leased to shards (DESIGN §3, "Fairness across shards and nodes").
//!
//! Each limit's capacity is split into the shards' holdings and a free pool. A shard's holding
//! is the capacity its core may use; only that shard changes it, and only through the free pool:
//! it gives units back (down to what it uses) by adding them to the pool, and grows by taking
//! units from the pool in one compare-and-swap. So at every instant
//! `Σ holdings + free == capacity` and no shard ever holds units another one holds: the node
//! cannot exceed the capacity, whatever the interleaving, while shares move.
//!
//! Where the holdings should go is decided elsewhere (the core's split rule, by backlogged
//! weight): a coordinator reads the loads every shard publishes and writes a target per shard.
//! Targets may be stale or overcommitted; they only say which way each shard moves.

use crate::primitive::{AtomicBool, AtomicU64, Ordering};

/// What one shard published about one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    /// Units the shard's core uses now.
    pub used: u64,
    /// The summed weight of the shard's backlogged tenants that could use the limit.
    pub weight: u64,
    /// The shard's holding.
    pub held: u64,
}

#[derive(Debug)]
struct Slot {
    /// Written by the owning shard only.
    held: AtomicU64,
    used: AtomicU64,
    weight: AtomicU64,
    /// Set by the shard's first `publish`.
    published: AtomicBool,
    /// Written by the coordinator.
    target: AtomicU64,
}

#[derive(Debug)]
struct LimitBoard {
    capacity: u64,
    free: AtomicU64,
    shards: Vec<Slot>,
}

/// Every split limit of a node, each with one slot per shard.
#[derive(Debug)]
pub struct ShareBoard {
    limits: Vec<LimitBoard>,
}

/// Shard `i`'s part of `capacity` split evenly over `shards`: the remainder to the first.
pub fn even_part(capacity: u64, shards: usize, i: usize) -> u64 {
    let n = shards as u64;
    capacity / n + u64::from((i as u64) < capacity % n)
}

impl ShareBoard {
    /// A board for limits of the given capacities over `shards` shards, each shard starting
    /// with an even part (its core must start with the same).
    pub fn new(capacities: &[u64], shards: usize) -> ShareBoard {
        assert!(shards > 0, "a node has at least one shard");
        let limits = capacities
            .iter()
            .map(|&capacity| LimitBoard {
                capacity,
                free: AtomicU64::new(0),
                shards: (0..shards)
                    .map(|i| {
                        let part = even_part(capacity, shards, i);
                        Slot {
                            held: AtomicU64::new(part),
                            used: AtomicU64::new(0),
                            weight: AtomicU64::new(0),
                            published: AtomicBool::new(false),
                            target: AtomicU64::new(part),
                        }
                    })
                    .collect(),
            })
            .collect();
        ShareBoard { limits }
    }

    pub fn limits(&self) -> usize {
        self.limits.len()
    }

    pub fn shards(&self) -> usize {
        self.limits.first().map_or(0, |l| l.shards.len())
    }

    pub fn capacity(&self, limit: usize) -> u64 {
        self.limits[limit].capacity
    }

    /// Units no shard holds.
    pub fn free(&self, limit: usize) -> u64 {
        self.limits[limit].free.load(Ordering::Acquire)
    }

    /// `shard` says how much of `limit` it uses and how much weight wants it.
    pub fn publish(&self, limit: usize, shard: usize, used: u64, weight: u64) {
        let s = &self.limits[limit].shards[shard];
        s.used.store(used, Ordering::Release);
        s.weight.store(weight, Ordering::Release);
        s.published.store(true, Ordering::Release);
    }

    /// Every shard's last published load of `limit`, with its holding; `None` until every
    /// shard has published once (a shard that has not yet spoken is not idle, and must not lose
    /// its part to a split that takes it for one).
    pub fn loads(&self, limit: usize) -> Option<Vec<Load>> {
        let shards = &self.limits[limit].shards;
        if !shards.iter().all(|s| s.published.load(Ordering::Acquire)) {
            return None;
        }
        Some(
            shards
                .iter()
                .map(|s| Load {
                    used: s.used.load(Ordering::Acquire),
                    weight: s.weight.load(Ordering::Acquire),
                    held: s.held.load(Ordering::Acquire),
                })
                .collect(),
        )
    }

    /// The coordinator's decision: where each shard's holding of `limit` should go.
    pub fn set_targets(&self, limit: usize, targets: &[u64]) {
        let l = &self.limits[limit];
        assert_eq!(targets.len(), l.shards.len(), "one target per shard");
        for (s, &t) in l.shards.iter().zip(targets) {
            s.target.store(t, Ordering::Release);
        }
    }

    /// `shard` moves its holding of `limit` toward its target, never below `used` (what its core
    /// holds now), and returns the new holding. Only the owning shard may call this.
    pub fn rebalance(&self, limit: usize, shard: usize, used: u64) -> u64 {
        let l = &self.limits[limit];
        let s = &l.shards[shard];
        let held = s.held.load(Ordering::Acquire);
        let target = s.target.load(Ordering::Acquire);
        if held > target {
            let give = held - target.max(used).min(held);
            if give > 0 {
                // Lower the holding first, then make the units free: nobody can take them
                // while this shard still counts them.
                s.held.store(held - give, Ordering::Release);
                l.free.fetch_add(give, Ordering::AcqRel);
            }
            return held - give;
        }
        let want = target - held;
        if want == 0 {
            return held;
        }
        let mut free = l.free.load(Ordering::Acquire);
        loop {
            let take = want.min(free);
            if take == 0 {
                return held;
            }
            match l.free.compare_exchange_weak(
                free,
                free - take,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    s.held.store(held + take, Ordering::Release);
                    return held + take;
                }
                Err(actual) => free = actual,
            }
        }
    }

    /// `Σ holdings + free` of `limit`: the capacity whenever no shard is mid-move.
    pub fn accounted(&self, limit: usize) -> u64 {
        let l = &self.limits[limit];
        l.shards
            .iter()
            .map(|s| s.held.load(Ordering::Acquire))
            .sum::<u64>()
            + l.free.load(Ordering::Acquire)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn holdings_follow_targets_through_the_free_pool() {
        let board = ShareBoard::new(&[10], 2);
        board.publish(0, 0, 0, 1);
        assert_eq!(board.loads(0), None, "shard 1 has not published yet");
        board.publish(0, 1, 0, 1);
        let loads = board.loads(0).expect("both published");
        assert_eq!(loads.iter().map(|l| l.held).sum::<u64>(), 10);
        // Shard 1 should get 8, but shard 0 still uses 4 of its 5.
        board.set_targets(0, &[2, 8]);
        assert_eq!(board.rebalance(0, 1, 0), 5, "nothing is free yet");
        assert_eq!(board.rebalance(0, 0, 4), 4, "shard 0 keeps what it uses");
        assert_eq!(board.free(0), 1);
        assert_eq!(board.rebalance(0, 1, 0), 6);
        assert_eq!(board.rebalance(0, 0, 2), 2, "released work frees the rest");
        assert_eq!(board.rebalance(0, 1, 3), 8);
        assert_eq!(board.accounted(0), 10);
        assert_eq!(board.free(0), 0);
    }

    #[test]
    fn even_parts_sum_to_the_capacity() {
        for cap in [0, 1, 7, 100] {
            for n in 1..5 {
                assert_eq!((0..n).map(|i| even_part(cap, n, i)).sum::<u64>(), cap);
            }
        }
    }
}
