//! Tenant queues and lane rings: enqueue, dequeue, the bookkeeping around them, and delayed
//! retries coming due.

use super::*;

impl Shard {
    #[inline]
    pub(super) fn fairness_milli(&self, entry: u32) -> u64 {
        self.estimates
            .get(self.tasks.at(entry).estimate)
            .fairness
            .milli()
    }

    pub(super) fn enqueue(&mut self, slot: u32, lane: Lane, band: Band, entry: u32, end: End) {
        let cost_milli = self.fairness_milli(entry);
        let initial_credit = self.policy.drr.initial_burst_credit.milli() as i64;
        let tenant = &mut self.tenants[slot as usize];
        let weight = u64::from(tenant.weight);
        let q = tenant.queue_mut(lane);
        let mut bands = Bands {
            tasks: &mut self.tasks,
            estimates: &self.estimates,
        };
        match end {
            End::Back => q.push_back(&mut bands, band, entry),
            End::Front => q.push_front(&mut bands, band, entry),
        }
        let rt = &mut self.lanes[lane.index()];
        // Units ahead of it, counted from what has left the lane's queues so far.
        let mark = match end {
            End::Back => rt.dequeued_milli + rt.queued_units_milli,
            End::Front => rt.dequeued_milli,
        };
        rt.queued_tasks += 1;
        rt.queued_units_milli += cost_milli;
        if !q.in_ring {
            // A tenant becoming active again starts from min(previous, initial burst credit).
            q.in_ring = true;
            q.deficit = q.deficit.min(initial_credit);
            q.needs_quantum = true;
            // Its first quantum joins the round under way; it does not start one.
            q.round = rt.round.wrapping_sub(1);
            rt.ring.push_back(slot);
            rt.backlog_weight += weight;
            self.ringed |= 1 << lane.index();
        }
        rt.stalled_until = None;
        rt.blocked_streak = 0;
        self.tasks.cold_mut(entry).mark = mark;
    }

    /// Takes `entry`, which follows `prev` (`NIL`: it is the head), out of tenant `slot`'s
    /// `band` in `lane`, with the bookkeeping that goes with it.
    pub(super) fn dequeue(&mut self, slot: u32, lane: Lane, band: Band, prev: u32, entry: u32) {
        let cost_milli = self.fairness_milli(entry);
        let tenant = &mut self.tenants[slot as usize];
        let weight = u64::from(tenant.weight);
        let q = tenant.queue_mut(lane);
        let mut bands = Bands {
            tasks: &mut self.tasks,
            estimates: &self.estimates,
        };
        q.unlink(&mut bands, band, prev, entry);
        self.dequeued(slot, lane, entry, cost_milli, weight);
    }

    /// Bookkeeping after `entry` left tenant `slot`'s queue in `lane`.
    pub(super) fn dequeued(
        &mut self,
        slot: u32,
        lane: Lane,
        entry: u32,
        cost_milli: u64,
        weight: u64,
    ) {
        let rt = &mut self.lanes[lane.index()];
        rt.queued_tasks -= 1;
        rt.queued_units_milli -= cost_milli;
        rt.dequeued_milli += cost_milli;
        let q = self.tenants[slot as usize].queue_mut(lane);
        if q.skipped_head == entry {
            q.skipped_head = NIL;
            q.skips = 0;
        }
        if q.is_empty() && q.in_ring {
            q.in_ring = false;
            let pos = rt
                .ring
                .iter()
                .position(|&s| s == slot)
                .expect("active tenant is in the ring");
            rt.ring.remove(pos);
            rt.backlog_weight -= weight;
            if rt.ring.is_empty() {
                self.ringed &= !(1 << lane.index());
            }
        }
    }

    pub(super) fn unstall_all(&mut self) {
        for rt in &mut self.lanes {
            rt.stalled_until = None;
            rt.blocked_streak = 0;
        }
    }

    pub(super) fn promote_delayed(&mut self, now: Time) {
        while let Some(&Reverse((at, task))) = self.delayed.peek() {
            if at > now {
                break;
            }
            self.delayed.pop();
            let Some(entry) = self.tasks.slot(task) else {
                continue;
            };
            let e = self.tasks.at_mut(entry);
            if e.place != Place::Delayed || e.state.state != TaskState::Queued {
                continue;
            }
            e.place = Place::Band;
            let e = e.clone();
            self.force_gates(&e);
            self.enqueue(e.tenant_slot, e.lane, e.band, entry, End::Front);
        }
    }

    /// Takes the queued task at `slot` (its entry `e`) out of its band wherever it stands, with
    /// the queue's bookkeeping, and releases its queue gates (a cancel, an expiry).
    pub(super) fn take_out_of_band(&mut self, slot: u32, e: &TaskEntry) {
        let cost_milli = self.fairness_milli(slot);
        let tenant = &mut self.tenants[e.tenant_slot as usize];
        let weight = u64::from(tenant.weight);
        let mut bands = Bands {
            tasks: &mut self.tasks,
            estimates: &self.estimates,
        };
        let found = tenant
            .queue_mut(e.lane)
            .remove_task(&mut bands, e.band, slot);
        assert!(found, "a queued task is in its band");
        self.dequeued(e.tenant_slot, e.lane, slot, cost_milli, weight);
        self.release_gates(e);
    }

    /// Remembers a queued task's deadline (none: nothing to remember), compacting the index
    /// once entries of tasks that left outnumber the shard's tasks.
    pub(super) fn watch_deadline(&mut self, deadline: Time, task: TaskId) {
        if deadline == NO_DEADLINE {
            return;
        }
        self.deadlines.push(Reverse((deadline, task)));
        if self.deadlines.len() > 2 * self.tasks.len() + DEADLINES_SLACK {
            let tasks = &self.tasks;
            self.deadlines.retain(|Reverse((_, t))| {
                tasks
                    .slot(*t)
                    .is_some_and(|e| tasks.at(e).state.state == TaskState::Queued)
            });
        }
    }

    /// The first queued task whose deadline has passed, expired: taken out of its queue (or
    /// its retry delay), its gates and cost released. `None` when no deadline is due.
    pub(super) fn expire_due(&mut self, now: Time) -> Option<TaskId> {
        while let Some(&Reverse((at, task))) = self.deadlines.peek() {
            if at > now {
                return None;
            }
            self.deadlines.pop();
            let Some(slot) = self.tasks.slot(task) else {
                continue;
            };
            let e = self.tasks.at(slot).clone();
            // Started meanwhile (its deadline was for the wait), or requeued with another.
            if e.state.state != TaskState::Queued || e.deadline != at {
                continue;
            }
            match e.place {
                Place::Band => self.take_out_of_band(slot, &e),
                // Its retry delay's heap entry is skipped when it comes due.
                Place::Delayed => {}
                _ => continue,
            }
            self.tasks
                .at_mut(slot)
                .state
                .transition(TaskState::Expired, Actor::System)
                .expect("QUEUED → EXPIRED");
            self.finish(task);
            return Some(task);
        }
        None
    }
}

/// Deadline index entries allowed past twice the shard's tasks before a compaction.
const DEADLINES_SLACK: usize = 4096;
