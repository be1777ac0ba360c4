//! Node-wide limits sub-leased to shards (design.md §3, "Fairness across shards and nodes").
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
//!
//! A limit's capacity may change (a policy change). More capacity goes to the free pool. Less
//! is taken from the free pool, and what the pool cannot cover becomes `owed`: units the shards
//! still hold that the next gives-back pay off before anything becomes free again. So at every
//! instant `Σ holdings + free == capacity + owed`: a shard never grows while units are owed,
//! and holdings above a lowered capacity are only those its running work already used.

use crate::primitive::{AtomicBool, AtomicU64, Ordering};

/// What one shard published about one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    /// Units the shard's core uses now.
    pub used: u64,
    /// The summed weight of the shard's backlogged tenants that could use the limit.
    pub weight: u64,
    /// The shard's DRR virtual time for the limit, and how many of its picks a node limit
    /// refused (wrapping counters; see `spindle_core::share::Lags`).
    pub vtime: u64,
    pub refused: u64,
    /// The shard's holding.
    pub held: u64,
}

#[derive(Debug)]
struct Slot {
    /// Written by the owning shard only.
    held: AtomicU64,
    used: AtomicU64,
    weight: AtomicU64,
    vtime: AtomicU64,
    refused: AtomicU64,
    /// Set by the shard's first `publish`.
    published: AtomicBool,
    /// Written by the coordinator.
    target: AtomicU64,
}

#[derive(Debug)]
struct LimitBoard {
    /// Written by the coordinator only.
    capacity: AtomicU64,
    free: AtomicU64,
    /// Held units above the capacity after it was lowered; paid off by gives-back.
    owed: AtomicU64,
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
                capacity: AtomicU64::new(capacity),
                free: AtomicU64::new(0),
                owed: AtomicU64::new(0),
                shards: (0..shards)
                    .map(|i| {
                        let part = even_part(capacity, shards, i);
                        Slot {
                            held: AtomicU64::new(part),
                            used: AtomicU64::new(0),
                            weight: AtomicU64::new(0),
                            vtime: AtomicU64::new(0),
                            refused: AtomicU64::new(0),
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
        self.limits[limit].capacity.load(Ordering::Acquire)
    }

    /// Units held above a lowered capacity, not yet given back.
    pub fn owed(&self, limit: usize) -> u64 {
        self.limits[limit].owed.load(Ordering::Acquire)
    }

    /// The coordinator changes `limit`'s capacity (a policy change). Only the coordinator may
    /// call this, and never concurrently with itself.
    pub fn set_capacity(&self, limit: usize, capacity: u64) {
        let l = &self.limits[limit];
        let before = l.capacity.load(Ordering::Acquire);
        if capacity >= before {
            // More: first pay off what is owed, then make the rest free.
            let mut more = capacity - before;
            let mut owed = l.owed.load(Ordering::Acquire);
            while more > 0 && owed > 0 {
                let pay = more.min(owed);
                match l.owed.compare_exchange_weak(
                    owed,
                    owed - pay,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        more -= pay;
                        break;
                    }
                    Err(actual) => owed = actual,
                }
            }
            l.capacity.store(capacity, Ordering::Release);
            if more > 0 {
                l.free.fetch_add(more, Ordering::AcqRel);
            }
            return;
        }
        // Less: the capacity first (nothing may be taken against the old one from here on),
        // then from the free pool what it has; the rest is owed by the holdings.
        l.capacity.store(capacity, Ordering::Release);
        let mut less = before - capacity;
        let mut free = l.free.load(Ordering::Acquire);
        loop {
            let take = less.min(free);
            if take == 0 {
                break;
            }
            match l.free.compare_exchange_weak(
                free,
                free - take,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    less -= take;
                    break;
                }
                Err(actual) => free = actual,
            }
        }
        if less > 0 {
            l.owed.fetch_add(less, Ordering::AcqRel);
            // A give-back that saw nothing owed yet may have freed units meanwhile.
            settle(l);
        }
    }

    /// Units no shard holds.
    pub fn free(&self, limit: usize) -> u64 {
        self.limits[limit].free.load(Ordering::Acquire)
    }

    /// `shard` says how much of `limit` it uses, how much weight wants it, its virtual time for
    /// it and how many of its picks were refused (`load.held` is not read: the board keeps it).
    pub fn publish(&self, limit: usize, shard: usize, load: Load) {
        let s = &self.limits[limit].shards[shard];
        s.used.store(load.used, Ordering::Release);
        s.weight.store(load.weight, Ordering::Release);
        s.vtime.store(load.vtime, Ordering::Release);
        s.refused.store(load.refused, Ordering::Release);
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
                    vtime: s.vtime.load(Ordering::Acquire),
                    refused: s.refused.load(Ordering::Acquire),
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
                // Lower the holding first, then pay what is owed and make the rest free:
                // nobody can take the units while this shard still counts them.
                s.held.store(held - give, Ordering::Release);
                let freed = pay_owed(&l.owed, give);
                if freed > 0 {
                    l.free.fetch_add(freed, Ordering::AcqRel);
                }
            }
            return held - give;
        }
        let want = target - held;
        if want == 0 || settle(l) > 0 {
            // While units are owed the holdings are above the capacity: nobody grows.
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

    /// `Σ holdings + free - owed` of `limit`: the capacity whenever no shard or coordinator is
    /// mid-move.
    pub fn accounted(&self, limit: usize) -> u64 {
        let l = &self.limits[limit];
        (l.shards
            .iter()
            .map(|s| s.held.load(Ordering::Acquire))
            .sum::<u64>()
            + l.free.load(Ordering::Acquire))
        .saturating_sub(l.owed.load(Ordering::Acquire))
    }
}

/// Pays what is owed out of the free pool where both are above zero (a give-back can free
/// units while a lowered capacity is being recorded as owed); returns what is still owed.
/// Free units go first and the debt after, so the accounting only ever undercounts mid-way.
fn settle(l: &LimitBoard) -> u64 {
    loop {
        let owed = l.owed.load(Ordering::Acquire);
        if owed == 0 {
            return 0;
        }
        let free = l.free.load(Ordering::Acquire);
        let pay = owed.min(free);
        if pay == 0 {
            return owed;
        }
        if l.free
            .compare_exchange_weak(free, free - pay, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let left = pay_owed(&l.owed, pay);
            if left > 0 {
                // Someone else paid meanwhile: the units go back to the pool.
                l.free.fetch_add(left, Ordering::AcqRel);
            }
        }
    }
}

/// Pays up to `give` of what is `owed`; returns the part left to free.
fn pay_owed(owed: &AtomicU64, give: u64) -> u64 {
    let mut current = owed.load(Ordering::Acquire);
    loop {
        let pay = give.min(current);
        if pay == 0 {
            return give;
        }
        match owed.compare_exchange_weak(
            current,
            current - pay,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return give - pay,
            Err(actual) => current = actual,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A load of nothing used and `weight` waiting.
    fn waiting(weight: u64) -> Load {
        Load {
            used: 0,
            weight,
            vtime: 0,
            refused: 0,
            held: 0,
        }
    }

    #[test]
    fn holdings_follow_targets_through_the_free_pool() {
        let board = ShareBoard::new(&[10], 2);
        board.publish(0, 0, waiting(1));
        assert_eq!(board.loads(0), None, "shard 1 has not published yet");
        board.publish(0, 1, waiting(1));
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
    fn a_lowered_capacity_is_owed_until_holdings_come_down_and_a_raised_one_frees_units() {
        let board = ShareBoard::new(&[10], 2);
        board.set_targets(0, &[5, 5]);
        // Both hold 5 and use 4: lowering to 4 leaves 6 owed (nothing is free).
        board.set_capacity(0, 4);
        assert_eq!((board.capacity(0), board.owed(0), board.free(0)), (4, 6, 0));
        assert_eq!(board.accounted(0), 4);
        board.set_targets(0, &[2, 2]);
        assert_eq!(
            board.rebalance(0, 0, 4),
            4,
            "in use is kept; 1 given back, to what is owed"
        );
        assert_eq!(
            board.rebalance(0, 1, 1),
            2,
            "gives back 3, all to what is owed"
        );
        assert_eq!((board.owed(0), board.free(0)), (2, 0));
        // Shard 1 may not grow while units are owed, whatever its target says.
        board.set_targets(0, &[2, 5]);
        assert_eq!(board.rebalance(0, 1, 1), 2);
        assert_eq!(board.rebalance(0, 0, 1), 2, "gives back 2, all owed");
        assert_eq!((board.owed(0), board.free(0)), (0, 0));
        assert_eq!(board.accounted(0), 4);
        // Raising frees units (after paying off anything still owed).
        board.set_capacity(0, 7);
        assert_eq!((board.owed(0), board.free(0)), (0, 3));
        assert_eq!(board.rebalance(0, 1, 1), 5);
        assert_eq!(board.accounted(0), 7);
        // Lowered and raised again before anything came back: the raise pays the debt.
        board.set_capacity(0, 2);
        assert_eq!((board.owed(0), board.free(0)), (5, 0));
        board.set_capacity(0, 5);
        assert_eq!((board.owed(0), board.free(0)), (2, 0));
        assert_eq!(board.accounted(0), 5);
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
