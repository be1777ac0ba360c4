//! Admission: a submit priced, checked against every limit in order and queued, or rejected
//! with its reason; restored and resumed tasks; policy changes; first sight of a tenant or user.

use super::*;

impl Shard {
    /// The server's price of a spec, from the model's capability row, interned with one more
    /// holder: every path that does not keep the task releases it.
    fn intern(&mut self, spec: &TaskSpec) -> Result<EstimateRef, SubmitError> {
        let (policy, calibration) = (&self.policy, &self.calibration);
        self.estimates
            .acquire(spec, || calibration::price_in(policy, calibration, spec))
            .map_err(SubmitError::InvalidSpec)
    }

    /// Decides on a submit. `Ok` carries every decision, accept or reject; `Err` is a request the
    /// core cannot decide on.
    pub fn handle_submit(
        &mut self,
        now: Time,
        req: SubmitRequest,
    ) -> Result<Admission, SubmitError> {
        let slot = self.ensure_tenant(req.tenant)?;
        let estimate = self.intern(&req.spec)?;
        if self.tasks.contains_key(&req.task) {
            self.estimates.release(estimate);
            return Err(SubmitError::DuplicateTask(req.task));
        }
        match self.admit(now, &req, slot, estimate) {
            Ok(accepted) => {
                self.stats.admitted += 1;
                Ok(accepted)
            }
            Err(rejected) => {
                self.estimates.release(estimate);
                self.stats.rejected += 1;
                Ok(rejected)
            }
        }
    }

    /// Admission proper: every check in order, then the queue. `Err` is the rejection.
    ///
    /// Both sides are the same `Admission`, returned by value as the caller answers it:
    /// boxing the rejection would cost an allocation per refusal, which under overload is most
    /// submits.
    #[allow(clippy::result_large_err)]
    fn admit(
        &mut self,
        now: Time,
        req: &SubmitRequest,
        slot: u32,
        estimate: EstimateRef,
    ) -> Result<Admission, Admission> {
        let est = *self.estimates.get(estimate);
        let tenant = &self.tenants[slot as usize];
        let band = tenant.band_for(req.band_hint);
        let mut lane = tenant.lane_for(est.class);
        let reject = |decision, reason, lane| Admission {
            task: req.task,
            decision,
            reason: Some(reason),
            lane,
            band,
            estimate: est,
            estimated_start_at: None,
            queue_level: None,
        };
        if self.tasks.len() >= TASKS_MAX
            || (self.users.len() >= USERS_MAX && self.free_users.is_empty())
        {
            let reason = RejectReason::ShardFull;
            return Err(reject(Decision::RejectPlatformOverloaded, reason, lane));
        }
        if tenant.suspended {
            let reason = RejectReason::TenantSuspended;
            return Err(reject(Decision::RejectResourceClassDisabled, reason, lane));
        }
        if !tenant.classes.contains(est.class) {
            let reason = RejectReason::ClassNotAllowed(est.class);
            return Err(reject(Decision::RejectResourceClassDisabled, reason, lane));
        }
        if !self.policy.lane(lane).open {
            let reason = RejectReason::LaneClosed(lane);
            return Err(reject(Decision::RejectResourceClassDisabled, reason, lane));
        }
        let Some(user_slot) = self.ensure_user(req.user, slot, false) else {
            let reason = RejectReason::TooManyUsers(USERS_PER_TENANT_MAX);
            return Err(reject(Decision::RejectUserRateLimit, reason, lane));
        };
        // Rate buckets first: a flood of requests spends tokens even when rejected later.
        if let Err(key) = self.take_submit_tokens(slot, user_slot, now) {
            let reason = RejectReason::Limit(key);
            return Err(reject(Decision::RejectUserRateLimit, reason, lane));
        }
        let tenant = &self.tenants[slot as usize];
        let remaining = tenant.cost_room_milli.max(0) as u64;
        if est.cost_milli > remaining || est.cost_milli > tenant.cost_burst_milli {
            let reason = RejectReason::CostQuota {
                needed_milli: est.cost_milli,
                remaining_milli: remaining,
            };
            return Err(reject(Decision::RejectCostBudget, reason, lane));
        }
        let (max_wait_ms, overflow) = (tenant.max_wait_ms(), tenant.wait_overflow);
        let at_ms = self.wall_ms(now);
        if let Err(reason) =
            self.check_quotas(slot, req.user, req.spec.model, est.cost_milli, at_ms)
        {
            return Err(reject(Decision::RejectQuotaExhausted, reason, lane));
        }
        let mut wait_ms = self.expected_lane_wait_ms(lane, now);
        if wait_ms > max_wait_ms {
            let overflow_to_be = overflow == WaitOverflow::BestEffort
                && self.policy.lane(Lane::BestEffort).open
                && lane != Lane::BestEffort;
            if !overflow_to_be {
                let reason = RejectReason::ExpectedWait {
                    wait_ms,
                    max_ms: max_wait_ms,
                };
                return Err(reject(Decision::RejectExpectedWaitTooLong, reason, lane));
            }
            lane = Lane::BestEffort;
            wait_ms = self.expected_lane_wait_ms(lane, now);
        }
        let burst_milli = self.lane_cost_burst[lane.index()];
        if est.cost_milli > burst_milli {
            let reason = RejectReason::CostBurst {
                limit: self.ledger.key(self.node.cost_bucket[lane.index()]),
                needed_milli: est.cost_milli,
                burst_milli,
            };
            return Err(reject(Decision::RejectCostBudget, reason, lane));
        }
        let mut entry = TaskEntry {
            enqueued_at: now,
            deadline: req.deadline.unwrap_or(NO_DEADLINE),
            tenant_slot: slot,
            user_slot,
            estimate,
            state: Versioned::new(TaskState::Created),
            attempt_no: 0,
            provider: None,
            hold: None,
            lane,
            band,
            place: Place::Band,
        };
        if let Err(key) = self.take_gates(&entry) {
            let decision = match key.scope() {
                Scope::Shard => Decision::RejectTenantQueueFull,
                Scope::Node => Decision::RejectPlatformOverloaded,
            };
            return Err(reject(decision, RejectReason::Limit(key), lane));
        }
        entry
            .state
            .transition(TaskState::Queued, Actor::System)
            .expect("CREATED → QUEUED");
        self.tenants[slot as usize].reserve_cost(est.cost_milli);
        self.users[user_slot as usize].tasks += 1;
        let deadline = entry.deadline;
        let entry = self.tasks.insert(req.task, entry, TaskCold::default());
        if self.charge_task_quotas(entry, at_ms) {
            self.count_quota_move(true, 1, est.cost_milli);
        }
        self.enqueue(slot, lane, band, entry, End::Back);
        self.watch_deadline(deadline, req.task);
        let decision = if lane == Lane::BestEffort {
            Decision::AcceptedBestEffort
        } else {
            Decision::Accepted
        };
        Ok(Admission {
            task: req.task,
            decision,
            reason: None,
            lane,
            band,
            estimate: est,
            estimated_start_at: Some(now.plus_ns(wait_ms * NANOS_PER_MS)),
            queue_level: Some(QueueLevel::from_wait_ms(wait_ms)),
        })
    }

    /// One submit token from the tenant's and then the user's bucket, both or neither.
    fn take_submit_tokens(
        &mut self,
        tenant_slot: u32,
        user_slot: u32,
        now: Time,
    ) -> Result<(), LimitKey> {
        let tenant = &mut self.tenants[tenant_slot as usize];
        if !tenant.submit_rate.try_take_one(now) {
            return Err(LimitKey::TenantSubmitRate(tenant.id));
        }
        let user = &mut self.users[user_slot as usize];
        if !user.submit_rate.try_take_one(now) {
            let key = LimitKey::UserSubmitRate(user.id);
            tenant.submit_rate.refund_one();
            return Err(key);
        }
        Ok(())
    }

    /// What a task put back from PostgreSQL needs first: its tenant's and user's slots and its
    /// interned estimate; refused for a task the shard already has, or one whose `attempts`
    /// (those it had, and the one it may be about to have) pass `ATTEMPTS_MAX`.
    fn take_back(
        &mut self,
        req: &SubmitRequest,
        attempts: u32,
    ) -> Result<(u32, u32, EstimateRef), SubmitError> {
        if attempts > ATTEMPTS_MAX {
            return Err(SubmitError::AttemptsExhausted(req.task, attempts));
        }
        let slot = self.ensure_tenant(req.tenant)?;
        let estimate = self.intern(&req.spec)?;
        if self.tasks.contains_key(&req.task) {
            self.estimates.release(estimate);
            return Err(SubmitError::DuplicateTask(req.task));
        }
        // Admitted before: put back past the tenant's bound on users if need be.
        let user_slot = self
            .ensure_user(req.user, slot, true)
            .expect("a forced user record is always made");
        Ok((slot, user_slot, estimate))
    }

    /// Puts back a task that PostgreSQL holds as QUEUED (after a restart or a partition
    /// takeover). It was admitted before, so no admission check can refuse it now: its queue
    /// gates are taken by force, like a retry's. Its lane and band are the stored ones.
    pub fn handle_restore(
        &mut self,
        now: Time,
        restore: RestoreRequest,
    ) -> Result<(), SubmitError> {
        let req = restore.submit;
        let (slot, user_slot, estimate) =
            self.take_back(&req, restore.attempts_before.saturating_add(1))?;
        let mut state = Versioned::new(TaskState::Created);
        state
            .transition(TaskState::Queued, Actor::System)
            .expect("CREATED → QUEUED");
        let entry = TaskEntry {
            enqueued_at: now,
            deadline: req.deadline.unwrap_or(NO_DEADLINE),
            tenant_slot: slot,
            user_slot,
            estimate,
            state,
            attempt_no: restore.attempts_before,
            provider: None,
            hold: None,
            lane: restore.lane,
            band: restore.band,
            place: Place::Band,
        };
        self.force_gates(&entry);
        let cost = self.estimates.get(estimate).cost_milli;
        self.tenants[slot as usize].reserve_cost(cost);
        self.users[user_slot as usize].tasks += 1;
        let deadline = entry.deadline;
        let entry_slot = self.tasks.insert(req.task, entry, TaskCold::default());
        self.enqueue(slot, restore.lane, restore.band, entry_slot, End::Back);
        self.watch_deadline(deadline, req.task);
        self.stats.restored += 1;
        Ok(())
    }

    /// Puts back a live attempt (after a restart or a partition takeover): its provider stage
    /// is held again, as it was when the attempt was claimed, and its fencing token is the
    /// stored one, so the shell can follow the provider's job instead of submitting it anew.
    ///
    /// Its semaphores and running limits are taken like a dispatch's when they fit. They may
    /// not: the shard's part of a node limit can be smaller now than what the resumed work of
    /// its tenants holds (the parts are re-split as the shards publish their use), or the
    /// policy lowered a limit. The job runs at the provider regardless, and PostgreSQL counted
    /// it within the node-wide limit when it was claimed, so it is then held past the capacity:
    /// nothing new fits there until it ends. Rate and cost tokens were spent when the attempt
    /// was claimed and are not taken again. Returns the estimate the attempt holds.
    pub fn handle_resume(
        &mut self,
        now: Time,
        r: ResumeRequest,
    ) -> Result<CostEstimate, SubmitError> {
        let req = r.submit;
        if r.provider.0 as usize >= self.policy.providers.len() {
            return Err(SubmitError::UnknownProvider(r.provider));
        }
        if !matches!(r.state, TaskState::SubmitUnknown | TaskState::Running) {
            return Err(SubmitError::NotResumable(req.task, r.state));
        }
        let (slot, user_slot, estimate) = self.take_back(&req, r.attempt_no)?;
        let mut state = Versioned::new(TaskState::Created);
        for to in [TaskState::Queued, TaskState::Dispatching, r.state] {
            state
                .transition(to, Actor::System)
                .expect("CREATED → QUEUED → DISPATCHING → SUBMIT_UNKNOWN | RUNNING");
        }
        let entry = TaskEntry {
            enqueued_at: now,
            deadline: req.deadline.unwrap_or(NO_DEADLINE),
            tenant_slot: slot,
            user_slot,
            estimate,
            state,
            attempt_no: r.attempt_no,
            provider: Some(r.provider),
            hold: Some(CapacityMode::Normal),
            lane: r.lane,
            band: r.band,
            place: Place::Provider,
        };
        let demand = self.provider_demand(&entry, r.provider, CapacityMode::Normal);
        let units = self.estimates.get(estimate).slots.milli();
        let fits = self
            .take_running(slot, user_slot, &demand.semaphores, units)
            .is_ok();
        if !fits {
            self.ledger.force_acquire_running(&demand.semaphores);
            self.tenants[slot as usize].running.force(units);
            self.users[user_slot as usize].running.force(units);
            self.over_capacity += 1;
        }
        self.lanes[r.lane.index()].running_tasks += 1;
        let cost = self.estimates.get(estimate).cost_milli;
        self.tenants[slot as usize].reserve_cost(cost);
        let cold = TaskCold {
            fencing: Some(r.token),
            over_capacity: !fits,
            ..TaskCold::default()
        };
        self.users[user_slot as usize].tasks += 1;
        self.tasks.insert(req.task, entry, cold);
        self.stats.resumed += 1;
        Ok(*self.estimates.get(estimate))
    }

    /// Queued units ahead in the lane over its measured service rate (design.md §4).
    fn expected_lane_wait_ms(&self, lane: Lane, now: Time) -> u64 {
        let rt = &self.lanes[lane.index()];
        wait_ms(rt.queued_units_milli, rt.rate_milli_per_s(now))
    }

    /// One object of a newer policy version, checked first ([`Policy::check`]; on an error
    /// nothing changed). A new provider account or model gets its node limits after every
    /// existing one ([`Shard::node_limits`] grows; see `add_node_limit`). Queued and running
    /// tasks keep the lane, band and estimate they were admitted with; what reads the policy
    /// at each decision (a lane closed or reweighted, retry limits, a model's price for new
    /// tasks) follows at once. Node-wide capacities are the shell's to re-split: see
    /// [`Shard::node_limits`].
    pub fn apply_patch(&mut self, patch: PolicyPatch, now: Time) -> Result<(), PolicyError> {
        self.policy.check(&patch)?;
        match patch {
            PolicyPatch::Tenant(tenant, policy) => self.set_tenant_policy(tenant, policy, now),
            PolicyPatch::Model(m) => {
                let (id, new) = (m.id, usize::from(m.id.0) == self.policy.models.len());
                self.estimates.forget_model(id);
                // Its calibration was against the old row's price: it starts over.
                self.reset_calibration(id);
                self.policy.apply(PolicyPatch::Model(m))?;
                if new {
                    self.add_model_limits(id, now);
                }
            }
            patch @ (PolicyPatch::Lane(..) | PolicyPatch::Provider(_)) => {
                let new = match &patch {
                    PolicyPatch::Provider(p) if p.id.0 as usize == self.policy.providers.len() => {
                        Some(p.id)
                    }
                    _ => None,
                };
                self.policy.apply(patch)?;
                if let Some(id) = new {
                    self.add_provider_limits(id, now);
                }
                self.lane_cost_burst = lane_cost_bursts(&self.policy, self.shards);
                // A lane opened or reweighted may go on.
                self.unstall_all();
            }
        }
        Ok(())
    }

    /// The policy version new tasks are admitted under.
    pub fn set_policy_version(&mut self, version: PolicyVersion) {
        self.policy.version = version;
    }

    /// A tenant's policy changed (a newer policy version). Its limits and DRR weight apply from
    /// now on; its queued and running tasks keep the lane, band and estimate they were admitted
    /// with.
    pub fn set_tenant_policy(&mut self, tenant: TenantId, policy: TenantPolicy, now: Time) {
        let Some(&slot) = self.tenant_slots.get(&tenant) else {
            self.policy.tenants.insert(tenant, policy);
            return;
        };
        let t = &mut self.tenants[slot as usize];
        let (old_w, new_w) = (u64::from(t.weight), u64::from(policy.weight));
        for lane in Lane::ALL {
            if t.queue(lane).is_some_and(|q| q.in_ring) {
                let rt = &mut self.lanes[lane.index()];
                rt.backlog_weight = rt.backlog_weight - old_w + new_w;
            }
        }
        t.set_policy(&policy, now);
        self.commands[slot as usize].set_policy(&policy, now);
        // Its users' records take the tenant's user limits now, like the tenant its own (a
        // walk of the shard's user records: policy changes are rare).
        if self.policy.tenants.get(&tenant).map(|p| &p.user) != Some(&policy.user) {
            let p = &policy.user;
            for u in self
                .users
                .iter_mut()
                .filter(|u| u.live && u.tenant == tenant)
            {
                u.submit_rate.set_rate(p.submit_rate, now);
                u.gates.set_capacity(p.queued_tasks_max, p.queued_units_max);
                u.running
                    .set_capacity(p.running_tasks_max, p.running_units_max);
            }
        }
        self.policy.tenants.insert(tenant, policy);
        // More room may let a stalled lane go on.
        self.unstall_all();
    }

    pub(super) fn ensure_tenant(&mut self, tenant: TenantId) -> Result<u32, SubmitError> {
        if let Some(&slot) = self.tenant_slots.get(&tenant) {
            return Ok(slot);
        }
        let policy = self
            .policy
            .tenants
            .get(&tenant)
            .ok_or(SubmitError::UnknownTenant(tenant))?;
        // `Policy::validate` and `Policy::check` keep the policy, and so this table, within it.
        debug_assert!(
            self.tenants.len() < TENANTS_MAX,
            "more tenants than the policy"
        );
        let slot = self.tenants.len() as u32;
        self.tenants.push(TenantRt::new(tenant, policy));
        self.commands.push(commands::CommandRates::new(policy));
        self.tenant_slots.insert(tenant, slot);
        Ok(slot)
    }

    /// The record of `user` of the tenant in `tenant_slot` (made if need be: in a freed slot
    /// first); `None` when the tenant holds its most and `force` is not set.
    fn ensure_user(&mut self, user: UserId, tenant_slot: u32, force: bool) -> Option<u32> {
        let tenant = self.tenants[tenant_slot as usize].id;
        if let Some(&slot) = self.user_slots.get(&user_key(tenant, user)) {
            return Some(slot);
        }
        let held = self.users_per_tenant.get(&tenant).copied().unwrap_or(0);
        if held as usize >= USERS_PER_TENANT_MAX && !force {
            return None;
        }
        let p = &self.policy.tenants[&tenant].user;
        let record = UserRt {
            submit_rate: SubmitBucket::new(p.submit_rate, Time::ZERO),
            gates: OwnedPair::new((p.queued_tasks_max, p.queued_units_max)),
            running: OwnedPair::new((p.running_tasks_max, p.running_units_max)),
            id: user,
            tenant,
            tasks: 0,
            live: true,
        };
        let slot = match self.free_users.pop() {
            Some(slot) => {
                self.users[slot as usize] = record;
                slot
            }
            None => {
                let slot = u32::try_from(self.users.len()).expect("users bounded by USERS_MAX");
                self.users.push(record);
                slot
            }
        };
        self.user_slots.insert(user_key(tenant, user), slot);
        *self.users_per_tenant.entry(tenant).or_default() += 1;
        Some(slot)
    }

    /// Frees the idle user records among the next `budget` (from where the last sweep ended):
    /// those with no task here, holding nothing, whose submit rate is full again at `now` —
    /// forgetting one gives nothing back. How many were freed. The shell calls it on its
    /// timer, so that a tenant cycling user ids holds at most `USERS_PER_TENANT_MAX` records.
    pub fn sweep_users(&mut self, now: Time, budget: usize) -> usize {
        let n = self.users.len();
        let mut freed = 0;
        for _ in 0..budget.min(n) {
            let i = self.user_sweep % n;
            self.user_sweep = i + 1;
            let u = &mut self.users[i];
            let idle = u.live
                && u.tasks == 0
                && u.gates.tasks.used == 0
                && u.gates.units.used == 0
                && u.running.tasks.used == 0
                && u.running.units.used == 0
                && u.submit_rate.is_full(now);
            if !idle {
                continue;
            }
            u.live = false;
            let tenant = u.tenant;
            self.user_slots.remove(&user_key(tenant, u.id));
            if let Some(held) = self.users_per_tenant.get_mut(&tenant) {
                *held -= 1;
                if *held == 0 {
                    self.users_per_tenant.remove(&tenant);
                }
            }
            self.free_users.push(i as u32);
            freed += 1;
        }
        freed
    }

    /// User records held now (live ones), in all and of `tenant`.
    pub fn user_records(&self) -> usize {
        self.users.len() - self.free_users.len()
    }

    /// Slots of user records the shard has made, live or free (what its memory holds).
    pub fn user_record_slots(&self) -> usize {
        self.users.len()
    }

    pub fn user_records_of(&self, tenant: TenantId) -> usize {
        self.users_per_tenant.get(&tenant).copied().unwrap_or(0) as usize
    }
}
