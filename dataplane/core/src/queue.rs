//! One tenant's queue inside one lane: five priority bands, FIFO within a band, lazy aging, and the
//! DRR state (deficit, fairness debt, head-skip count) that goes with it.
//!
//! Aging is computed from band head timestamps when a choice is made (seed 000 §18.6.6): no task
//! is ever rewritten as time passes.

use std::collections::VecDeque;

use crate::ids::{Band, TaskId};
use crate::time::Time;

/// A queued task as the band deque stores it: small on purpose (memory per queued task).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuedRef {
    pub task: TaskId,
    /// The task's slot in the shard's task table: the scheduling path never hashes.
    pub entry: u32,
    /// When it entered the band (aging starts here).
    pub enqueued_at: Time,
    /// Fairness cost in milli-units.
    pub cost_milli: u64,
}

#[derive(Debug, Clone, Default)]
pub struct TenantQueue {
    bands: [VecDeque<QueuedRef>; Band::COUNT],
    tasks: u64,
    units_milli: u64,
    /// DRR deficit in milli-units; negative after a task larger than the credit ran at the cap.
    pub deficit: i64,
    /// Fairness debt (actual − estimated, capped per task), paid out of later quanta.
    pub debt: i64,
    /// The tenant is due a quantum on its next visit (its last turn ended for lack of credit).
    pub needs_quantum: bool,
    /// Listed in its lane's DRR ring.
    pub in_ring: bool,
    /// The head that has been skipped by the fit-scan, and how often.
    pub skipped_head: Option<TaskId>,
    pub skips: u32,
}

impl TenantQueue {
    pub fn is_empty(&self) -> bool {
        self.tasks == 0
    }

    pub fn tasks(&self) -> u64 {
        self.tasks
    }

    pub fn units_milli(&self) -> u64 {
        self.units_milli
    }

    pub fn band(&self, band: Band) -> &VecDeque<QueuedRef> {
        &self.bands[band.index()]
    }

    pub fn push_back(&mut self, band: Band, item: QueuedRef) {
        self.bands[band.index()].push_back(item);
        self.count_in(item);
    }

    /// A task coming back (retry) keeps its place ahead of newer work in its band.
    pub fn push_front(&mut self, band: Band, item: QueuedRef) {
        self.bands[band.index()].push_front(item);
        self.count_in(item);
    }

    fn count_in(&mut self, item: QueuedRef) {
        self.tasks += 1;
        self.units_milli += item.cost_milli;
    }

    /// Removes the item at `pos` of `band`.
    pub fn remove_at(&mut self, band: Band, pos: usize) -> QueuedRef {
        let item = self.bands[band.index()]
            .remove(pos)
            .expect("position inside the band");
        self.tasks -= 1;
        self.units_milli -= item.cost_milli;
        item
    }

    /// Finds and removes `task` (a cancel): O(band length), cancels are rare.
    pub fn remove_task(&mut self, band: Band, task: TaskId) -> Option<QueuedRef> {
        let pos = self.bands[band.index()]
            .iter()
            .position(|q| q.task == task)?;
        Some(self.remove_at(band, pos))
    }

    /// The band whose head should go next: lowest effective band after aging, then the oldest
    /// head. Returns the band the head sits in (not its aged band).
    pub fn best_band(&self, now: Time, aging_step_ns: u64) -> Option<Band> {
        let mut best: Option<(Band, Time, Band)> = None;
        for band in Band::ALL {
            let Some(head) = self.bands[band.index()].front() else {
                continue;
            };
            let steps = now.since(head.enqueued_at) / aging_step_ns;
            let effective = band.aged(steps);
            let better = match best {
                None => true,
                Some((b, at, _)) => (effective, head.enqueued_at) < (b, at),
            };
            if better {
                best = Some((effective, head.enqueued_at, band));
            }
        }
        best.map(|(_, _, band)| band)
    }

    pub fn check_invariants(&self) {
        let tasks: u64 = self.bands.iter().map(|b| b.len() as u64).sum();
        let units: u64 = self.bands.iter().flatten().map(|q| q.cost_milli).sum();
        assert_eq!(tasks, self.tasks, "queued task count drifted");
        assert_eq!(units, self.units_milli, "queued units drifted");
        for band in &self.bands {
            // FIFO within a band: retries go to the front, so only check what is unambiguous.
            assert!(
                band.iter().all(|q| q.cost_milli > 0),
                "a queued task with zero cost"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(task: u64, at_ms: u64) -> QueuedRef {
        QueuedRef {
            task: TaskId(task),
            entry: 0,
            enqueued_at: Time::from_ms(at_ms),
            cost_milli: 1000,
        }
    }

    #[test]
    fn aging_promotes_lazily_and_stops_at_p1() {
        let mut q = TenantQueue::default();
        q.push_back(Band::P4, item(1, 0));
        q.push_back(Band::P2, item(2, 250_000));
        let step = 100_000 * 1_000_000; // 100 s
                                        // At 250 s the P4 head has aged 2 steps, to P2, and ties with the fresh P2 head on band.
                                        // At 260 s the P4 head has aged 2 steps (P2) and is older than the P2 head.
        assert_eq!(q.best_band(Time::from_ms(260_000), step), Some(Band::P4));
        // At 255 s, 2 steps: the P4 head is P2 now, older than the P2 head, so it wins the tie.
        assert_eq!(q.best_band(Time::from_ms(255_000), step), Some(Band::P4));
        q.push_back(Band::P1, item(3, 260_000));
        // A fresh P1 beats a P4 aged to P2.
        assert_eq!(q.best_band(Time::from_ms(260_000), step), Some(Band::P1));
        // After enough steps the P4 task reaches P1 and, being older, goes first.
        assert_eq!(q.best_band(Time::from_ms(1_000_000), step), Some(Band::P4));
        assert_eq!(Band::P4.aged(100), Band::P1);
        assert_eq!(Band::P0.aged(100), Band::P0);
        q.check_invariants();
    }
}
