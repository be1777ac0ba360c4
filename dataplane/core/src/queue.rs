//! One tenant's queue inside one lane: five priority bands, FIFO within a band, lazy aging, and the
//! DRR state (deficit, fairness debt, head-skip count) that goes with it.
//!
//! A band is an intrusive singly linked list through the shard's task table: each queued task's
//! entry holds the slot of the task behind it, and the queue holds only head and tail slots. A
//! queue is a few words, a queued task needs no allocation of its own, and a pick reads the task
//! it is about to start and nothing besides.
//!
//! Aging is computed from band head timestamps when a choice is made (design.md §4): no task
//! is ever rewritten as time passes.

use crate::ids::Band;
use crate::time::Time;

/// The end of a band list, or no slot.
pub(crate) const NIL: u32 = u32::MAX;

/// How a queue reads its tasks: their links, enqueue times and fairness costs, kept in the
/// shard's task table.
pub(crate) trait Links {
    fn next(&self, slot: u32) -> u32;
    fn enqueued_at(&self, slot: u32) -> Time;
    fn cost_milli(&self, slot: u32) -> u64;
}

/// How a queue relinks its tasks.
pub(crate) trait LinksMut: Links {
    fn set_next(&mut self, slot: u32, next: u32);
}

/// In field order (`repr(C)`): an append behind a queued task touches only the first 26 bytes
/// (the band's tail, the count, ring membership) — the heads only when its band was empty — so
/// a tenant's record can keep them on the line its admission reads anyway.
#[derive(Debug, Clone, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct TenantQueue {
    tails: [u32; Band::COUNT],
    tasks: u32,
    /// Listed in its lane's DRR ring.
    pub in_ring: bool,
    /// The tenant is due a quantum on its next visit (its last turn ended for lack of credit).
    pub needs_quantum: bool,
    /// The lane's DRR round (wrapping) in which it last got its quantum (see
    /// `shard::LaneRt::round`).
    pub round: u16,
    heads: [u32; Band::COUNT],
    /// The head (a task slot) the fit-scan has skipped, and how often; `NIL` when none. It is
    /// always a task of this queue: it is cleared when that task leaves.
    pub skipped_head: u32,
    pub skips: u32,
    /// DRR deficit in milli-units; negative after a task larger than the credit ran at the cap.
    pub deficit: i64,
    /// Fairness debt (actual − estimated, capped per task), paid out of later quanta.
    pub debt: i64,
}

impl TenantQueue {
    /// Bytes from the start that an append behind a queued task reads or writes (through
    /// `in_ring`, `push_back`).
    #[cfg(test)]
    pub(crate) const APPEND_BYTES: usize = std::mem::offset_of!(TenantQueue, needs_quantum) + 1;
}

impl Default for TenantQueue {
    fn default() -> Self {
        TenantQueue {
            heads: [NIL; Band::COUNT],
            tails: [NIL; Band::COUNT],
            tasks: 0,
            deficit: 0,
            debt: 0,
            needs_quantum: false,
            round: 0,
            in_ring: false,
            skipped_head: NIL,
            skips: 0,
        }
    }
}

impl TenantQueue {
    pub fn is_empty(&self) -> bool {
        self.tasks == 0
    }

    pub fn tasks(&self) -> u64 {
        u64::from(self.tasks)
    }

    /// The first task of `band`, if any.
    pub fn head(&self, band: Band) -> Option<u32> {
        let head = self.heads[band.index()];
        (head != NIL).then_some(head)
    }

    pub fn push_back(&mut self, links: &mut impl LinksMut, band: Band, slot: u32) {
        let b = band.index();
        links.set_next(slot, NIL);
        match self.tails[b] {
            NIL => self.heads[b] = slot,
            tail => links.set_next(tail, slot),
        }
        self.tails[b] = slot;
        self.count_in();
    }

    /// A task coming back (retry) keeps its place ahead of newer work in its band.
    pub fn push_front(&mut self, links: &mut impl LinksMut, band: Band, slot: u32) {
        let b = band.index();
        links.set_next(slot, self.heads[b]);
        self.heads[b] = slot;
        if self.tails[b] == NIL {
            self.tails[b] = slot;
        }
        self.count_in();
    }

    fn count_in(&mut self) {
        self.tasks += 1;
    }

    /// Removes `slot` from `band`, where it follows `prev` (`NIL` when it is the head).
    pub fn unlink(&mut self, links: &mut impl LinksMut, band: Band, prev: u32, slot: u32) {
        let b = band.index();
        let next = links.next(slot);
        match prev {
            NIL => {
                assert_eq!(self.heads[b], slot, "unlinking a head that is not the head");
                self.heads[b] = next;
            }
            prev => {
                assert_eq!(
                    links.next(prev),
                    slot,
                    "unlinking a slot after the wrong one"
                );
                links.set_next(prev, next);
            }
        }
        if self.tails[b] == slot {
            self.tails[b] = prev;
        }
        links.set_next(slot, NIL);
        self.tasks -= 1;
    }

    /// Finds and removes `slot` (a cancel): O(band length), cancels are rare. Whether it was there.
    pub fn remove_task(&mut self, links: &mut impl LinksMut, band: Band, slot: u32) -> bool {
        let mut prev = NIL;
        let mut cur = self.heads[band.index()];
        while cur != NIL {
            if cur == slot {
                self.unlink(links, band, prev, slot);
                return true;
            }
            prev = cur;
            cur = links.next(cur);
        }
        false
    }

    /// The slots of `band`, head first.
    pub fn band<'a>(&self, links: &'a impl Links, band: Band) -> impl Iterator<Item = u32> + 'a {
        let mut cur = self.heads[band.index()];
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let slot = cur;
                cur = links.next(slot);
                slot
            })
        })
    }

    /// The band whose head should go next: lowest effective band after aging, then the oldest
    /// head. Returns the band the head sits in (not its aged band). With one band holding work
    /// there is nothing to compare and no task is read.
    pub fn best_band(&self, links: &impl Links, now: Time, aging_step_ns: u64) -> Option<Band> {
        let mut held = Band::ALL
            .into_iter()
            .filter(|b| self.heads[b.index()] != NIL);
        let first = held.next()?;
        let Some(second) = held.next() else {
            return Some(first);
        };
        let key = |band: Band| {
            let at = links.enqueued_at(self.heads[band.index()]);
            (band.aged(now.since(at) / aging_step_ns), at)
        };
        let mut best = (key(first), first);
        for band in [second].into_iter().chain(held) {
            let k = key(band);
            if k < best.0 {
                best = (k, band);
            }
        }
        Some(best.1)
    }

    pub fn check_invariants(&self, links: &impl Links) {
        let mut tasks = 0u32;
        for band in Band::ALL {
            let mut last = NIL;
            for slot in self.band(links, band) {
                tasks += 1;
                assert!(links.cost_milli(slot) > 0, "a queued task with zero cost");
                last = slot;
            }
            assert_eq!(self.tails[band.index()], last, "band {band} tail drifted");
        }
        assert_eq!(tasks, self.tasks, "queued task count drifted");
        assert!(
            self.skips == 0 || self.skipped_head != NIL,
            "skips counted without a skipped head"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tasks as a vector of (next, enqueued_at): a stand-in for the task table.
    struct Table(Vec<(u32, Time)>);

    impl Links for Table {
        fn next(&self, slot: u32) -> u32 {
            self.0[slot as usize].0
        }
        fn enqueued_at(&self, slot: u32) -> Time {
            self.0[slot as usize].1
        }
        fn cost_milli(&self, _: u32) -> u64 {
            1000
        }
    }

    impl LinksMut for Table {
        fn set_next(&mut self, slot: u32, next: u32) {
            self.0[slot as usize].0 = next;
        }
    }

    fn table(at_ms: &[u64]) -> Table {
        Table(at_ms.iter().map(|&ms| (NIL, Time::from_ms(ms))).collect())
    }

    #[test]
    fn aging_promotes_lazily_and_stops_at_p1() {
        let mut t = table(&[0, 250_000, 260_000]);
        let mut q = TenantQueue::default();
        q.push_back(&mut t, Band::P4, 0);
        assert_eq!(
            q.best_band(&t, Time::ZERO, 1),
            Some(Band::P4),
            "one band: no compare"
        );
        q.push_back(&mut t, Band::P2, 1);
        let step = 100_000 * 1_000_000; // 100 s
                                        // At 255 s and 260 s the P4 head has aged 2 steps, to P2,
                                        // and is older than the P2 head.
        assert_eq!(
            q.best_band(&t, Time::from_ms(260_000), step),
            Some(Band::P4)
        );
        assert_eq!(
            q.best_band(&t, Time::from_ms(255_000), step),
            Some(Band::P4)
        );
        q.push_back(&mut t, Band::P1, 2);
        // A fresh P1 beats a P4 aged to P2.
        assert_eq!(
            q.best_band(&t, Time::from_ms(260_000), step),
            Some(Band::P1)
        );
        // After enough steps the P4 task reaches P1 and, being older, goes first.
        assert_eq!(
            q.best_band(&t, Time::from_ms(1_000_000), step),
            Some(Band::P4)
        );
        assert_eq!(Band::P4.aged(100), Band::P1);
        assert_eq!(Band::P0.aged(100), Band::P0);
        q.check_invariants(&t);
    }

    #[test]
    fn bands_are_fifo_with_retries_in_front_and_unlink_anywhere() {
        let mut t = table(&[0, 0, 0, 0, 0]);
        let mut q = TenantQueue::default();
        for slot in [0, 1, 2] {
            q.push_back(&mut t, Band::P3, slot);
        }
        q.push_front(&mut t, Band::P3, 3);
        let order = |q: &TenantQueue, t: &Table| q.band(t, Band::P3).collect::<Vec<_>>();
        assert_eq!(order(&q, &t), [3, 0, 1, 2]);
        q.unlink(&mut t, Band::P3, 1, 2); // the tail
        q.unlink(&mut t, Band::P3, NIL, 3); // the head
        assert_eq!(order(&q, &t), [0, 1]);
        q.push_back(&mut t, Band::P3, 4);
        assert!(q.remove_task(&mut t, Band::P3, 1), "a middle task");
        assert!(!q.remove_task(&mut t, Band::P3, 1), "already gone");
        assert_eq!(order(&q, &t), [0, 4]);
        assert_eq!(q.tasks(), 2);
        q.check_invariants(&t);
    }
}
