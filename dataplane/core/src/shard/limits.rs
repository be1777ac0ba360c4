//! The shard's limits: the owners' pairs, the node-wide queue gates and the provider stage
//! taken and released all or nothing in one global order, and the lane capacity a task may use.

use super::*;

impl Shard {
    // Every acquisition keeps one global order: node semaphores (in ledger id order), then the
    // tenant's own semaphores, then its user's, then node buckets, then the tenant's cost
    // bucket. (It is the order of the limits' ids from when all of them lived in the ledger;
    // the first refused limit names the rejection and classifies a blocked task.) Demands are
    // built in registration order, so every `Demand::add` is an append.

    /// One task and `units` from the tenant's and then the user's `hold` pair, all or nothing.
    fn take_owned(
        &mut self,
        tenant_slot: u32,
        user_slot: u32,
        hold: Hold,
        units: u64,
    ) -> Result<(), LimitKey> {
        let tenant = &mut self.tenants[tenant_slot as usize];
        if let Err(i) = tenant.pair_mut(hold).try_take(units) {
            return Err(tenant.keys(hold)[i]);
        }
        let user = &mut self.users[user_slot as usize];
        if let Err(i) = user.pair_mut(hold).try_take(units) {
            let key = user.keys(hold)[i];
            let keys = tenant.keys(hold);
            tenant.pair_mut(hold).release(units, keys);
            return Err(key);
        }
        Ok(())
    }

    pub(super) fn release_owned(
        &mut self,
        tenant_slot: u32,
        user_slot: u32,
        hold: Hold,
        units: u64,
    ) {
        let tenant = &mut self.tenants[tenant_slot as usize];
        let keys = tenant.keys(hold);
        tenant.pair_mut(hold).release(units, keys);
        let user = &mut self.users[user_slot as usize];
        let keys = user.keys(hold);
        user.pair_mut(hold).release(units, keys);
    }

    /// The node-wide queue gates of a task of `lane` with fairness `units`, in id order.
    #[inline]
    pub(super) fn node_gates(&self, lane: Lane, units: u64) -> [Need; 4] {
        [
            Need::new(self.node.lane_queued_tasks[lane.index()], 1),
            Need::new(self.node.lane_queued_units[lane.index()], units),
            Need::new(self.node.global_queued_tasks, 1),
            Need::new(self.node.global_queued_units, units),
        ]
    }

    /// Takes every queue gate of `e`: the node's, its tenant's, its user's.
    pub(super) fn take_gates(&mut self, e: &TaskEntry) -> Result<(), LimitKey> {
        let units = self.estimates.get(e.estimate).fairness.milli();
        let node = self.node_gates(e.lane, units);
        if let Err(id) = self.ledger.try_acquire_semaphores(&node) {
            return Err(self.ledger.key(id));
        }
        if let Err(key) = self.take_owned(e.tenant_slot, e.user_slot, Hold::Queued, units) {
            self.ledger.give_back(&node);
            return Err(key);
        }
        Ok(())
    }

    /// Takes the gates of accepted work coming back (a retry, a restore), past capacity if need
    /// be (see [`crate::ledger::Role::AdmissionGate`]).
    pub(super) fn force_gates(&mut self, e: &TaskEntry) {
        let units = self.estimates.get(e.estimate).fairness.milli();
        self.ledger
            .force_acquire_gate_needs(&self.node_gates(e.lane, units));
        self.tenants[e.tenant_slot as usize].gates.force(units);
        self.users[e.user_slot as usize].gates.force(units);
    }

    pub(super) fn release_gates(&mut self, e: &TaskEntry) {
        let units = self.estimates.get(e.estimate).fairness.milli();
        self.ledger
            .release_semaphores(&self.node_gates(e.lane, units));
        self.release_owned(e.tenant_slot, e.user_slot, Hold::Queued, units);
    }

    /// The lane pool a provider stage held in `mode` draws on.
    #[inline]
    fn lane_key(&self, lane: Lane, mode: CapacityMode) -> LimitId {
        match mode {
            CapacityMode::Normal => self.node.lane_units[lane.index()],
            CapacityMode::Borrowed(donor) => self.node.lane_units[donor.index()],
        }
    }

    /// The node limits the provider stage holds, in id order: running counts and units per lane,
    /// model, provider and high-cost class (semaphores), then RPM and cost tokens — the lane's
    /// own budget's, or the platform's — (buckets). The tenant's and user's running limits and the
    /// tenant's cost bucket are its other part. A need that does not apply (no borrowing, not
    /// high-cost) is there with zero, which always fits and releases nothing, so the shape is fixed
    /// and built in place.
    #[inline]
    pub(super) fn provider_demand(
        &self,
        e: &TaskEntry,
        provider: ProviderId,
        mode: CapacityMode,
    ) -> StageNeeds {
        let est = self.estimates.get(e.estimate);
        let model = self.estimates.model(e.estimate).0 as usize;
        let p = provider.0 as usize;
        let units = est.slots.milli();
        let borrowed = mode == CapacityMode::Borrowed(Lane::EnterpriseReserved);
        let high_cost = est.class == ResourceClass::Expensive;
        let n = &self.node;
        StageNeeds {
            semaphores: [
                Need::new(self.lane_key(e.lane, mode), units),
                Need::new(n.enterprise_borrowed, if borrowed { units } else { 0 }),
                Need::new(n.lane_running_tasks[e.lane.index()], 1),
                Need::new(n.model_running[model], 1),
                Need::new(n.model_running_units[model], units),
                Need::new(n.provider_concurrency[p], 1),
                Need::new(n.high_cost, u64::from(high_cost)),
                Need::new(n.global_running_tasks, 1),
                Need::new(n.global_running_units, units),
            ],
            buckets: [
                Need::new(n.provider_rpm[p], 1),
                Need::new(n.cost_bucket[e.lane.index()], est.cost_milli),
            ],
        }
    }

    /// Acquires the whole provider stage of the task in `slot`, all or nothing, in the global
    /// order; on refusal names the first limit that did not fit.
    pub(super) fn try_provider_stage(
        &mut self,
        slot: u32,
        provider: ProviderId,
        mode: CapacityMode,
        now: Time,
    ) -> Result<(), LimitKey> {
        let e = self.tasks.at(slot);
        let (tenant_slot, user_slot) = (e.tenant_slot, e.user_slot);
        let est = self.estimates.get(e.estimate);
        let (units, cost) = (est.slots.milli(), est.cost_milli);
        let demand = self.provider_demand(e, provider, mode);
        let (sems, buckets) = (&demand.semaphores, &demand.buckets);
        self.take_running(tenant_slot, user_slot, sems, units)?;
        let refused = match self.ledger.try_acquire_needs(buckets, now) {
            Err(id) => Some(self.ledger.key(id)),
            Ok(()) => {
                let tenant = &mut self.tenants[tenant_slot as usize];
                let taken = tenant.cost_per_minute.try_take(cost, now);
                if !taken {
                    self.ledger.give_back(buckets);
                }
                (!taken).then_some(LimitKey::TenantCostPerMinute(tenant.id))
            }
        };
        if let Some(key) = refused {
            self.release_owned(tenant_slot, user_slot, Hold::Running, units);
            self.ledger.give_back(sems);
            return Err(key);
        }
        Ok(())
    }

    /// The semaphore part of a provider stage (`sems`) and the tenant's and user's running
    /// pair, all or nothing; on refusal names the first limit that did not fit.
    #[inline(always)]
    pub(super) fn take_running(
        &mut self,
        tenant_slot: u32,
        user_slot: u32,
        sems: &[Need],
        units: u64,
    ) -> Result<(), LimitKey> {
        if let Err(id) = self.ledger.try_acquire_semaphores(sems) {
            return Err(self.ledger.key(id));
        }
        if let Err(key) = self.take_owned(tenant_slot, user_slot, Hold::Running, units) {
            self.ledger.give_back(sems);
            return Err(key);
        }
        Ok(())
    }

    // Inlined: a demand returned from a call is copied out (136 bytes).
    #[inline(always)]
    pub(super) fn media_demand(&self, e: &TaskEntry) -> Demand {
        let m = self.estimates.get(e.estimate).media;
        let mut d = Demand::default();
        d.add(self.node.gpu_units, m.gpu_units.into());
        d.add(self.node.gpu_mem_mb, m.gpu_mem_mb.into());
        d.add(self.node.cpu_units, m.cpu_units.into());
        d.add(self.node.temp_disk_mb, m.temp_disk_mb.into());
        d.add(self.node.media_pool[e.lane.index()], 1);
        d
    }

    /// Lane capacity a task of `lane` may use, in preference order: its own pool, then what it
    /// may borrow (design.md §4: enterprise reserve with headroom; best effort on leftovers only).
    pub(super) fn lane_options(&self, lane: Lane, units: u64) -> ([CapacityMode; 3], usize) {
        let mut options = [CapacityMode::Normal; 3];
        let mut n = 1;
        let idle = |l: Lane| self.lanes[l.index()].queued_tasks == 0;
        match lane {
            Lane::PaidShared | Lane::Standard | Lane::Expensive => {
                let ent = Lane::EnterpriseReserved;
                let id = self.node.lane_units[ent.index()];
                if idle(ent) && self.ledger.free(id) >= units + self.headroom_share(id) {
                    options[n] = CapacityMode::Borrowed(ent);
                    n += 1;
                }
            }
            Lane::BestEffort => {
                for donor in [Lane::Standard, Lane::PaidShared] {
                    if idle(donor) {
                        options[n] = CapacityMode::Borrowed(donor);
                        n += 1;
                    }
                }
            }
            Lane::EnterpriseReserved | Lane::Recovery => {}
        }
        (options, n)
    }

    /// This shard's part of the enterprise headroom that must stay unborrowed, in proportion to
    /// its share of the enterprise pool.
    fn headroom_share(&self, ent_id: LimitId) -> u64 {
        let node_cap = self.policy.lane(Lane::EnterpriseReserved).capacity.milli();
        if node_cap == 0 {
            return 0;
        }
        let headroom = self.policy.reserve.minimum_reserved_headroom.milli();
        let share = self.ledger.capacity(ent_id);
        (u128::from(headroom) * u128::from(share)).div_ceil(u128::from(node_cap)) as u64
    }
}
