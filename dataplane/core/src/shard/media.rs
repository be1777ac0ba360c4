//! The media stage's waiting line: a FIFO per lane, so that a lane whose media workers are all
//! busy (its own, or the shared ones) holds up no other lane's jobs. Polls take the lanes in
//! turn, each with the bounded fit-scan of its own FIFO.

use super::*;

/// Tasks whose provider stage is done, waiting for media slots, per lane.
#[derive(Debug, Clone, Default)]
pub(super) struct MediaQueues {
    lanes: [VecDeque<TaskId>; Lane::COUNT],
    /// Per lane: jobs started from past its head since its head last started (the fit-scan's
    /// bound against starving a large head).
    head_skips: [u32; Lane::COUNT],
    /// The lane the next poll looks at first.
    next: usize,
    len: usize,
}

impl MediaQueues {
    /// The lane a poll looks at after `lane`'s turn.
    pub(super) fn turn_after(&mut self, lane: usize) {
        self.next = (lane + 1) % Lane::COUNT;
    }

    /// The lanes in the order the next poll takes them.
    pub(super) fn turns(&self) -> impl Iterator<Item = usize> {
        let next = self.next;
        (0..Lane::COUNT).map(move |k| (next + k) % Lane::COUNT)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn lane_len(&self, lane: Lane) -> usize {
        self.lanes[lane.index()].len()
    }

    pub(super) fn push(&mut self, lane: Lane, task: TaskId) {
        assert!(
            self.len < MEDIA_QUEUE_MAX,
            "media queue bounded by TASKS_MAX"
        );
        self.lanes[lane.index()].push_back(task);
        self.len += 1;
    }

    /// Takes `task` out of `lane`'s line (a cancel); whether it was there.
    pub(super) fn remove(&mut self, lane: Lane, task: TaskId) -> bool {
        let q = &mut self.lanes[lane.index()];
        let Some(pos) = q.iter().position(|&t| t == task) else {
            return false;
        };
        q.remove(pos);
        self.len -= 1;
        true
    }
}

impl Shard {
    /// The first job of lane `lane`'s line (within its fit-scan) whose media slots it acquired,
    /// taken out of the line.
    pub(super) fn take_fitting_media(&mut self, lane: usize, now: Time) -> Option<TaskId> {
        let skips = self.media.head_skips[lane];
        let scan = if skips >= self.policy.aging.skips_max {
            1
        } else {
            FIT_SCAN_MAX + 1
        };
        for pos in 0..scan.min(self.media.lanes[lane].len()) {
            let task = self.media.lanes[lane][pos];
            let demand = self.media_demand(&self.tasks[&task]);
            if self.ledger.try_acquire(&demand, now).is_err() {
                continue;
            }
            self.media.lanes[lane].remove(pos);
            self.media.len -= 1;
            self.media.head_skips[lane] = if pos == 0 { 0 } else { skips + 1 };
            return Some(task);
        }
        None
    }
}
