//! `check_invariants`: every counter, queue, ring and limit of the shard recomputed from the
//! tasks it holds.

use super::*;

impl Shard {
    /// Recomputes every counter from the tasks and compares: the in-memory form of "counters are
    /// derived" (design.md §2.5). O(tasks + limits): for tests and the simulator.
    pub fn check_invariants(&self) {
        let within = self.over_capacity == 0;
        self.ledger.check_invariants(within);
        let mut expected = vec![0u64; self.ledger.semaphore_count()];
        let mut add = |needs: &[Need]| {
            for n in needs {
                if let Some(i) = n.id.semaphore_index() {
                    expected[i] += n.amount();
                }
            }
        };
        // Per owner: (queued tasks, queued units, running tasks, running units).
        let mut tenant_held = vec![[0u64; 4]; self.tenants.len()];
        let mut user_held = vec![[0u64; 4]; self.users.len()];
        let mut hold = |e: &TaskEntry, h: Hold, units: u64| {
            let at = if h == Hold::Queued { 0 } else { 2 };
            for held in [
                &mut tenant_held[e.tenant_slot as usize],
                &mut user_held[e.user_slot as usize],
            ] {
                held[at] += 1;
                held[at + 1] += units;
            }
        };
        let mut holders = vec![0u32; self.estimates.slots()];
        let mut lane_tasks = [0u64; Lane::COUNT];
        let mut lane_units = [0u64; Lane::COUNT];
        let mut lane_running = [0u64; Lane::COUNT];
        let mut reserved = vec![0u64; self.tenants.len()];
        for (task, _, e) in self.tasks.iter() {
            holders[e.estimate.index()] += 1;
            let est = self.estimates.get(e.estimate);
            reserved[e.tenant_slot as usize] += est.cost_milli;
            match e.place {
                Place::Band => {
                    assert_eq!(e.state.state, TaskState::Queued, "task {task} in a band");
                    let units = est.fairness.milli();
                    add(&self.node_gates(e.lane, units));
                    hold(e, Hold::Queued, units);
                    lane_tasks[e.lane.index()] += 1;
                    lane_units[e.lane.index()] += units;
                }
                Place::Delayed => {
                    assert_eq!(e.state.state, TaskState::Queued, "task {task} delayed")
                }
                Place::Provider => {
                    let mode = e.hold.expect("provider hold");
                    add(&self
                        .provider_demand(e, e.provider.expect("provider"), mode)
                        .semaphores);
                    hold(e, Hold::Running, est.slots.milli());
                    lane_running[e.lane.index()] += 1;
                    assert!(
                        matches!(
                            e.state.state,
                            TaskState::Dispatching
                                | TaskState::SubmitUnknown
                                | TaskState::Running
                                | TaskState::Canceled
                        ),
                        "task {task} holding a provider slot in {}",
                        e.state.state
                    );
                }
                Place::MediaQueue => {
                    assert_eq!(
                        e.state.state,
                        TaskState::ProviderSucceeded,
                        "task {task} in media queue"
                    )
                }
                Place::Media => add(self.media_demand(e).needs()),
            }
        }
        for (id, key, used) in self.ledger.semaphores() {
            let i = id.semaphore_index().expect("a semaphore");
            assert_eq!(
                used, expected[i],
                "{key} counter {used} differs from its reservations {}",
                expected[i]
            );
        }
        let owned = |pairs: [&OwnedPair; 2],
                     keys: &dyn Fn(Hold) -> [LimitKey; 2],
                     submit: &SubmitBucket,
                     held: [u64; 4]| {
            for (pair, at, h) in [(pairs[0], 0, Hold::Queued), (pairs[1], 2, Hold::Running)] {
                let used = pair.used();
                let [tasks, units] = keys(h);
                assert_eq!(used.0, held[at], "{tasks} differs from its reservations");
                assert_eq!(
                    used.1,
                    held[at + 1],
                    "{units} differs from its reservations"
                );
            }
            if within {
                pairs[1].check_within(keys(Hold::Running));
            }
            assert!(submit.within_burst(), "submit bucket above its burst");
        };
        for (slot, t) in self.tenants.iter().enumerate() {
            let pairs = [&t.gates, &t.running];
            owned(pairs, &|h| t.keys(h), &t.submit_rate, tenant_held[slot]);
            assert_eq!(
                t.cost_burst_milli,
                t.cost_per_minute.rate().burst,
                "tenant {} admission copy of its cost burst drifted",
                t.id
            );
            assert!(
                t.cost_per_minute.within_burst(),
                "tenant {} cost bucket above its burst",
                t.id
            );
            assert!(
                self.commands[slot].within_burst(),
                "tenant {} command bucket above its burst",
                t.id
            );
            assert_eq!(
                t.cost_reserved_milli(),
                reserved[slot],
                "tenant {} cost reservation drifted",
                t.id
            );
        }
        for (slot, u) in self.users.iter().enumerate() {
            let pairs = [&u.gates, &u.running];
            owned(pairs, &|h| u.keys(h), &u.submit_rate, user_held[slot]);
        }
        self.estimates.check_invariants(&holders);
        self.check_queues(&lane_tasks, &lane_units, &lane_running);
    }

    /// Lanes, rings and every tenant queue against the counts taken from the tasks.
    fn check_queues(
        &self,
        lane_tasks: &[u64; Lane::COUNT],
        lane_units: &[u64; Lane::COUNT],
        lane_running: &[u64; Lane::COUNT],
    ) {
        let bands = Bands {
            tasks: &self.tasks,
            estimates: &self.estimates,
        };
        let cap =
            self.policy.drr.base_quantum.milli() as i64 * i64::from(self.policy.drr.burst_rounds);
        let mut ringed = [0usize; Lane::COUNT];
        for (slot, t) in self.tenants.iter().enumerate() {
            for (lane, q) in t.queues() {
                q.check_invariants(&bands);
                for band in Band::ALL {
                    for s in q.band(&bands, band) {
                        let e = self.tasks.at(s);
                        assert_eq!(e.place, Place::Band, "a listed task out of its band");
                        assert_eq!(
                            (e.tenant_slot as usize, e.lane, e.band),
                            (slot, lane, band),
                            "task {} listed in another tenant's, lane's or band's queue",
                            self.tasks.id_at(s)
                        );
                    }
                }
                assert_eq!(q.in_ring, !q.is_empty(), "tenant {} ring flag", t.id);
                ringed[lane.index()] += usize::from(q.in_ring);
                assert!(
                    q.deficit <= cap * i64::from(t.weight),
                    "deficit above its cap"
                );
            }
        }
        for lane in Lane::ALL {
            let rt = &self.lanes[lane.index()];
            assert_eq!(
                rt.queued_tasks,
                lane_tasks[lane.index()],
                "{lane} queued tasks drifted"
            );
            assert_eq!(
                rt.queued_units_milli,
                lane_units[lane.index()],
                "{lane} queued units drifted"
            );
            assert_eq!(
                rt.running_tasks,
                lane_running[lane.index()],
                "{lane} running tasks drifted"
            );
            let mut weight = 0;
            for &slot in &rt.ring {
                let t = &self.tenants[slot as usize];
                let q = t.queue(lane).expect("ringed queue");
                assert!(q.in_ring && !q.is_empty(), "ring holds an idle tenant");
                weight += u64::from(t.weight);
            }
            assert_eq!(weight, rt.backlog_weight, "{lane} backlog weight drifted");
            assert_eq!(ringed[lane.index()], rt.ring.len(), "{lane} ring length");
            assert_eq!(
                self.ringed & (1 << lane.index()) != 0,
                !rt.ring.is_empty(),
                "{lane} ring bit drifted"
            );
        }
    }
}
