//! The pick: weighted lane choice, DRR over the lane's active tenants, bands with aging and the
//! bounded fit-scan, and a task's start with its whole provider stage held.

use super::*;

impl Shard {
    /// Picks the next task to run, if any: weighted lane choice, then DRR over the lane's active
    /// tenants, then bands with aging and a bounded fit-scan inside the tenant.
    pub fn poll_dispatch(&mut self, now: Time) -> Poll {
        self.promote_delayed(now);
        if let Some(task) = self.expire_due(now) {
            self.stats.expired += 1;
            return Poll::Expired(task);
        }
        let mut visits = 0usize;
        // Lanes tried in this poll, one bit each.
        let mut tried = 0u8;
        loop {
            let Some(lane) = self.next_lane(now, tried) else {
                return Poll::Idle;
            };
            tried |= 1 << lane.index();
            loop {
                if visits >= TENANT_VISITS_PER_POLL_MAX {
                    return Poll::Yield;
                }
                visits += 1;
                match self.serve_lane_once(lane, now) {
                    Some(TurnResult::Dispatched(entry)) => {
                        self.charge_lane_choice(lane);
                        self.stats.dispatched += 1;
                        let d = self.dispatch_of(entry);
                        if matches!(d.mode, CapacityMode::Borrowed(_)) {
                            self.stats.borrowed_dispatches += 1;
                        }
                        return Poll::Dispatch(d);
                    }
                    Some(TurnResult::Expired(task)) => {
                        self.stats.expired += 1;
                        return Poll::Expired(task);
                    }
                    Some(TurnResult::OutOfCredit | TurnResult::Blocked(_)) => continue,
                    None => break,
                }
            }
        }
    }

    /// Smooth weighted round robin among lanes with work that are not stalled (and not in
    /// `tried`, one bit per lane); ties go to the lane first in `Lane::ALL`.
    fn next_lane(&mut self, now: Time, tried: u8) -> Option<Lane> {
        let mut best: Option<(Lane, i64)> = None;
        let mut open = self.ringed & !tried;
        while open != 0 {
            let lane = Lane::ALL[open.trailing_zeros() as usize];
            open &= open - 1;
            let rt = &mut self.lanes[lane.index()];
            if let Some(until) = rt.stalled_until {
                if now < until {
                    continue;
                }
                rt.stalled_until = None;
                rt.blocked_streak = 0;
            }
            let current = rt.swrr_current;
            if best.is_none_or(|(_, c)| current > c) {
                best = Some((lane, current));
            }
        }
        best.map(|(lane, _)| lane)
    }

    fn charge_lane_choice(&mut self, chosen: Lane) {
        let mut total = 0i64;
        let mut charged = self.ringed | 1 << chosen.index();
        while charged != 0 {
            let lane = Lane::ALL[charged.trailing_zeros() as usize];
            charged &= charged - 1;
            let w = i64::from(self.policy.lane(lane).weight);
            self.lanes[lane.index()].swrr_current += w;
            total += w;
        }
        self.lanes[chosen.index()].swrr_current -= total;
    }

    /// One DRR visit to the tenant at the front of `lane`'s ring. `None` when the lane has no
    /// tenant or every tenant in it is blocked (the lane is then stalled).
    fn serve_lane_once(&mut self, lane: Lane, now: Time) -> Option<TurnResult> {
        let rt = &self.lanes[lane.index()];
        let &slot = rt.ring.front()?;
        if rt.blocked_streak >= rt.ring.len() {
            let rt = &mut self.lanes[lane.index()];
            rt.stalled_until = Some(now.plus_ns(STALL_RETRY_NS));
            return None;
        }
        let drr = self.policy.drr;
        let tenant = &mut self.tenants[slot as usize];
        let quantum = drr.base_quantum.milli() as i64 * i64::from(tenant.weight);
        let cap = quantum * i64::from(drr.burst_rounds);
        let q = tenant.queue_mut(lane);
        if q.needs_quantum {
            q.needs_quantum = false;
            // Fairness debt is paid out of the credit the quantum leaves (a refund adds to it), at
            // most one quantum a round. The cap applies to the quantum, not to the debt: a debt
            // paid out of credit the cap would have discarded anyway would be forgiven, and a
            // refund that does not fit under the cap stays owed instead of being lost (before,
            // tenants whose runs were shorter than estimated lost their refunds at the cap and
            // drifted from their share, 45 units per weight in 8 simulated hours).
            let credit = (q.deficit + quantum).min(cap);
            let pay = q.debt.clamp(-quantum, quantum).max(credit - cap);
            q.debt -= pay;
            q.deficit = credit - pay;
            let rt = &mut self.lanes[lane.index()];
            if q.round == rt.round {
                // Its second quantum of this round: the next round begins.
                rt.round = rt.round.wrapping_add(1);
                rt.vtime_milli = rt.vtime_milli.wrapping_add(drr.base_quantum.milli());
            }
            q.round = rt.round;
        }
        let result = self.tenant_turn(slot, lane, now, cap);
        let rt = &mut self.lanes[lane.index()];
        match &result {
            TurnResult::Dispatched(_) | TurnResult::Expired(_) => rt.blocked_streak = 0,
            TurnResult::OutOfCredit => {
                rt.blocked_streak = 0;
                rt.ring.rotate_left(1);
                self.tenants[slot as usize].queue_mut(lane).needs_quantum = true;
            }
            TurnResult::Blocked(Block::LanePool) => {
                rt.node_refusals = rt.node_refusals.wrapping_add(1);
                rt.stalled_until = Some(now.plus_ns(STALL_RETRY_NS));
                return None;
            }
            TurnResult::Blocked(block @ (Block::Tenant | Block::Resource)) => {
                if *block == Block::Resource {
                    rt.node_refusals = rt.node_refusals.wrapping_add(1);
                }
                rt.blocked_streak += 1;
                rt.ring.rotate_left(1);
            }
        }
        Some(result)
    }

    /// The tenant's turn: the head of its best band after aging, then up to `fit_scan_max` tasks
    /// behind it if the head does not fit, unless the head was skipped `skips_max` times already.
    fn tenant_turn(&mut self, slot: u32, lane: Lane, now: Time, cap: i64) -> TurnResult {
        let aging_ns = self.policy.aging.aging_step_ms * NANOS_PER_MS;
        let fit_scan = self.policy.aging.fit_scan_max.min(FIT_SCAN_MAX);
        let skips_max = self.policy.aging.skips_max;
        let q = self.tenants[slot as usize]
            .queue(lane)
            .expect("a ringed tenant has a queue");
        let bands = Bands {
            tasks: &self.tasks,
            estimates: &self.estimates,
        };
        let band = q
            .best_band(&bands, now, aging_ns)
            .expect("a ringed tenant has queued work");
        let head = q.head(band).expect("best band has a head");
        let deadline = self.tasks.at(head).deadline;
        if deadline != NO_DEADLINE && deadline <= now {
            let task = self.tasks.id_at(head);
            self.expire_head(slot, lane, band, head);
            return TurnResult::Expired(task);
        }
        if self.tenants[slot as usize].suspended {
            // Held until it is resumed (its tasks still expire at their deadlines).
            return TurnResult::Blocked(Block::Tenant);
        }
        let may_skip = !(q.skipped_head == head && q.skips >= skips_max);
        let scan = if may_skip { fit_scan + 1 } else { 1 };
        let deficit = q.deficit;
        let mut first_failure = TurnResult::Blocked(Block::Resource);
        // A candidate at least as large as one the lane pool refused cannot fit either.
        let mut lane_refused_milli = u64::MAX;
        let (mut prev, mut cand) = (NIL, head);
        for pos in 0..scan {
            if cand == NIL {
                break;
            }
            let next = self.tasks.link(cand);
            let cost_milli = self.fairness_milli(cand);
            let credit_ok = cost_milli as i64 <= deficit || deficit >= cap;
            if !credit_ok {
                if pos == 0 {
                    first_failure = TurnResult::OutOfCredit;
                }
            } else if cost_milli < lane_refused_milli {
                match self.try_start(cand, now) {
                    Ok(()) => {
                        let q = self.tenants[slot as usize].queue_mut(lane);
                        q.deficit -= cost_milli as i64;
                        if pos > 0 {
                            if q.skipped_head != head {
                                q.skipped_head = head;
                                q.skips = 0;
                            }
                            q.skips += 1;
                            self.stats.fit_scan_skips += 1;
                        }
                        self.dequeue(slot, lane, band, prev, cand);
                        self.lanes[lane.index()].started.record(now, cost_milli);
                        // The tenant's next visit reads the task behind this one.
                        self.tasks.prefetch(next);
                        return TurnResult::Dispatched(cand);
                    }
                    Err(block) => {
                        if pos == 0 {
                            first_failure = TurnResult::Blocked(block);
                        }
                        if block == Block::LanePool {
                            lane_refused_milli = lane_refused_milli.min(cost_milli);
                        }
                    }
                }
            }
            (prev, cand) = (cand, next);
        }
        first_failure
    }

    fn expire_head(&mut self, slot: u32, lane: Lane, band: Band, head: u32) {
        self.dequeue(slot, lane, band, NIL, head);
        let e = self.tasks.at_mut(head);
        e.state
            .transition(TaskState::Expired, Actor::System)
            .expect("QUEUED → EXPIRED");
        let e = e.clone();
        self.release_gates(&e);
        self.finish(self.tasks.id_at(head));
    }

    /// Tries every provider of the task's model with every lane option; on the first complete
    /// acquisition moves the task QUEUED → DISPATCHING. Changes nothing otherwise, and says why.
    fn try_start(&mut self, entry: u32, now: Time) -> Result<(), Block> {
        let e = self.tasks.at(entry);
        let units = self.estimates.get(e.estimate).slots.milli();
        let model = self.estimates.model(e.estimate).0 as usize;
        let (lane_opts, n_opts) = self.lane_options(e.lane, units);
        let n_providers = self.policy.models[model].providers.len();
        // The first refused limit in the fixed order classifies the block: node limits come
        // first, so a tenant block shows only once the shared ones would fit.
        let mut block = Block::LanePool;
        for &mode in &lane_opts[..n_opts] {
            for i in 0..n_providers {
                let provider = self.policy.models[model].providers[i];
                let Err(key) = self.try_provider_stage(entry, provider, mode, now) else {
                    self.started(entry, provider, mode, now);
                    return Ok(());
                };
                block = match (key, key.scope()) {
                    (_, Scope::Shard) => return Err(Block::Tenant),
                    (LimitKey::LaneUnits(_) | LimitKey::EnterpriseBorrowed, _) => block,
                    _ => Block::Resource,
                };
            }
        }
        Err(block)
    }

    /// QUEUED → DISPATCHING once the provider-stage demand is held.
    fn started(&mut self, entry: u32, provider: ProviderId, mode: CapacityMode, now: Time) {
        let e = self.tasks.at(entry).clone();
        self.release_gates(&e);
        debug_assert!(
            self.tasks.cold(entry).fencing.is_none(),
            "a queued task holds no fencing token"
        );
        let e = self.tasks.at_mut(entry);
        e.state
            .transition(TaskState::Dispatching, Actor::System)
            .expect("QUEUED → DISPATCHING");
        e.place = Place::Provider;
        e.provider = Some(provider);
        e.hold = Some(mode);
        e.attempt_no += 1;
        assert!(
            e.attempt_no <= ATTEMPTS_MAX,
            "attempts bounded by retry limits"
        );
        let lane = e.lane;
        self.lanes[lane.index()].running_tasks += 1;
        self.tasks.cold_mut(entry).mark = now.as_nanos().max(1);
    }

    /// What the shell is told of the task in `entry`, which has just started.
    fn dispatch_of(&self, entry: u32) -> Dispatch {
        let e = self.tasks.at(entry);
        Dispatch {
            task: self.tasks.id_at(entry),
            tenant: self.tenants[e.tenant_slot as usize].id,
            user: self.users[e.user_slot as usize].id,
            lane: e.lane,
            band: e.band,
            provider: e.provider.expect("a started task has its provider"),
            mode: e.hold.expect("a started task holds its provider stage"),
            attempt_no: e.attempt_no,
            estimate: *self.estimates.get(e.estimate),
            policy_version: self.policy.version,
        }
    }

    /// A canceled task's running step reported back: release what it held and forget it.
    pub(super) fn drop_canceled_attempt(&mut self, task: TaskId) {
        self.release_provider_hold(task);
        self.finish(task);
    }

    pub(super) fn release_provider_hold(&mut self, task: TaskId) {
        let slot = self.tasks.slot(task).expect("entry");
        let e = self.tasks.at(slot).clone();
        assert_eq!(
            e.place,
            Place::Provider,
            "task {task} holds no provider reservation"
        );
        let mode = e.hold.expect("provider hold has a capacity mode");
        let provider = e.provider.expect("provider hold has a provider");
        let demand = self.provider_demand(&e, provider, mode);
        self.ledger.release_semaphores(&demand.semaphores);
        let units = self.estimates.get(e.estimate).slots.milli();
        self.release_owned(e.tenant_slot, e.user_slot, Hold::Running, units);
        self.lanes[e.lane.index()].running_tasks -= 1;
        self.tasks.at_mut(slot).hold = None;
        let cold = self.tasks.cold_mut(slot);
        if std::mem::take(&mut cold.over_capacity) {
            self.over_capacity -= 1;
        }
        self.unstall_all();
    }
}
