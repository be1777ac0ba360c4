//! The schedulers the simulator compares, behind one trait: spindle's sharded core and three
//! baselines (global FIFO, WRR by task count, a global priority queue).
//!
//! The baselines enforce the same node-wide limits through the core's [`Ledger`] (lane pools,
//! provider concurrency and RPM, model, high-cost, cost per minute, media slots) so that only the
//! *ordering* differs; they have no per-tenant queues, DRR, aging, borrowing or shards.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use spindle_core::admission::{Admission, Decision, RejectReason};
use spindle_core::cost::{estimate, CostEstimate, ResourceClass};
use spindle_core::ledger::{Demand, Ledger, LimitId, LimitKey};
use spindle_core::shard::{
    register_node_limit, CapacityMode, ClaimOutcome, Dispatch, FailOutcome, Failure, MediaStart,
    NodeCapacity, Poll, SubmitRequest,
};
use spindle_core::share::{Lags, ShardLoad};
use spindle_core::{Band, FencingToken, Lane, Policy, Shard, TaskId, TenantId, Time, Units};

/// Tasks a baseline looks at per pick before giving up (they are work-conserving within it).
pub const BASELINE_SCAN_MAX: usize = 64;

/// What the simulator needs from a scheduler.
pub trait Scheduler {
    fn name(&self) -> &'static str;
    fn submit(&mut self, now: Time, req: SubmitRequest) -> Admission;
    /// Every dispatch possible now; expired tasks are reported in `expired`.
    fn dispatch_all(&mut self, now: Time, out: &mut Vec<Dispatch>, expired: &mut Vec<TaskId>);
    fn media_all(&mut self, now: Time, out: &mut Vec<MediaStart>);
    fn claim_granted(&mut self, task: TaskId, token: FencingToken);
    fn accepted(&mut self, task: TaskId, token: FencingToken);
    fn submit_unknown(&mut self, task: TaskId, token: FencingToken);
    fn not_found(&mut self, now: Time, task: TaskId, token: FencingToken) -> FailOutcome;
    fn failed(
        &mut self,
        now: Time,
        task: TaskId,
        token: FencingToken,
        failure: Failure,
        jitter: u64,
    ) -> FailOutcome;
    fn succeeded(&mut self, now: Time, task: TaskId, token: FencingToken, actual: Units);
    fn media_done(&mut self, task: TaskId, token: FencingToken);
    /// Periodic upkeep (spindle re-splits node limits across shards).
    fn maintain(&mut self, now: Time);
    fn wake_at(&self) -> Option<Time>;
    /// The shard a tenant lives on (0 for single-queue baselines).
    fn shard_of(&self, tenant: TenantId) -> usize;
    /// The fairness debt the scheduler still has to settle with a tenant in a lane (milli
    /// units; the baselines keep none).
    fn fairness_debt(&self, _tenant: TenantId, _lane: Lane) -> i64 {
        0
    }
    /// The largest lag of a shard behind the node's virtual time its splits saw (milli units
    /// per weight; `share::Lags::peak`; 0 with one queue).
    fn lag_peak(&self) -> i64 {
        0
    }
    fn check_invariants(&self);
}

// ------------------------------------------------------------------------------------ spindle

/// spindle's policy as a node: tenants hashed over shards, node-wide limits split among shards by
/// backlogged weight every `resplit_ns`.
pub struct SpindleNode {
    shards: Vec<Shard>,
    resplit_ns: u64,
    last_resplit: Option<Time>,
    split_ids: Option<Vec<(LimitId, NodeCapacity)>>,
    /// Per split limit, the shards' loads its last split was computed from: a limit whose
    /// loads are the same again is skipped ([`SpindleNode::resplit`]).
    last_loads: Vec<Vec<ShardLoad>>,
    /// Per split limit, the shards' lags behind their weighted service (`share::Lags`).
    lags: Vec<Lags>,
    /// Split limits whose loads did not change too (`RunOptions::split_unchanged`).
    pub split_unchanged: bool,
    /// Split by backlogged weight alone, without correcting for the shards' lags
    /// (`RunOptions::uncorrected_split`: the split before issue 53, to compare with).
    pub uncorrected_split: bool,
}

/// Tenant → shard: a fixed mix so neighbouring ids spread.
pub fn shard_for(tenant: TenantId, shards: usize) -> usize {
    let h = u64::from(tenant.0).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    (h % shards as u64) as usize
}

impl SpindleNode {
    pub fn new(policy: Policy, shards: usize, resplit_ns: u64) -> SpindleNode {
        let n = shards as u32;
        SpindleNode {
            shards: (0..shards)
                .map(|_| Shard::new(policy.clone(), n, Time::ZERO))
                .collect(),
            resplit_ns,
            last_resplit: None,
            split_ids: None,
            last_loads: Vec::new(),
            lags: Vec::new(),
            split_unchanged: false,
            uncorrected_split: false,
        }
    }

    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    fn with_task<R>(&mut self, task: TaskId, f: impl FnOnce(&mut Shard) -> R) -> R {
        let i = self
            .shards
            .iter()
            .position(|s| s.task_state(task).is_some())
            .expect("task on a shard");
        f(&mut self.shards[i])
    }

    /// The split rule (`spindle_core::share`, corrected by the shards' lags) applied to every
    /// node-wide limit that can bind — except a limit whose shards bring the same loads (used,
    /// weight, share, virtual time, refusals) as its last split was computed from: the shares it
    /// gave are those loads' (theirs unchanged), and the lags would not move, so it would set
    /// every share to what it already is. Setting a share to its own value changes nothing (a
    /// bucket's refill does not depend on when it runs). One difference from the node, which
    /// updates the lags every tick: here a skipped split is no update, so a shard's refusal is
    /// remembered for `REFUSED_MEMORY` splits that were not skipped.
    fn resplit(&mut self, now: Time) {
        let limits = match self.split_ids.take() {
            Some(limits) => limits,
            None => self.shards[0].bounded_node_limits(),
        };
        self.last_loads.resize(limits.len(), Vec::new());
        self.lags.resize(limits.len(), Lags::default());
        let gain = if self.uncorrected_split {
            0
        } else {
            spindle_core::share::lag_gain_milli(self.shards[0].policy())
        };
        for (k, &(id, capacity)) in limits.iter().enumerate() {
            let last = &mut self.last_loads[k];
            let same = !self.split_unchanged
                && last.len() == self.shards.len()
                && self
                    .shards
                    .iter()
                    .zip(last.iter())
                    .all(|(s, l)| s.split_load(id) == *l);
            if same {
                continue;
            }
            last.clear();
            last.extend(self.shards.iter().map(|s| s.split_load(id)));
            let weighed = self.lags[k].weigh(last, gain);
            let targets = capacity.split_targets(&weighed);
            for (shard, units) in self.shards.iter_mut().zip(targets) {
                shard.set_share(id, capacity.part(units), now);
            }
        }
        self.split_ids = Some(limits);
    }
}

impl Scheduler for SpindleNode {
    fn name(&self) -> &'static str {
        "spindle"
    }

    fn submit(&mut self, now: Time, req: SubmitRequest) -> Admission {
        let i = shard_for(req.tenant, self.shards.len());
        self.shards[i]
            .handle_submit(now, req)
            .expect("the simulator submits valid requests")
    }

    fn dispatch_all(&mut self, now: Time, out: &mut Vec<Dispatch>, expired: &mut Vec<TaskId>) {
        for shard in &mut self.shards {
            loop {
                match shard.poll_dispatch(now) {
                    Poll::Dispatch(d) => out.push(d),
                    Poll::Expired(t) => expired.push(t),
                    Poll::Yield => continue,
                    Poll::Idle => break,
                }
            }
        }
    }

    fn media_all(&mut self, now: Time, out: &mut Vec<MediaStart>) {
        for shard in &mut self.shards {
            while let Some(m) = shard.poll_media(now) {
                out.push(m);
            }
        }
    }

    fn claim_granted(&mut self, task: TaskId, token: FencingToken) {
        let outcome = self
            .with_task(task, |s| s.handle_claim_granted(task, token))
            .expect("claim");
        assert_eq!(
            outcome,
            ClaimOutcome::Submit,
            "the simulator does not cancel"
        );
    }

    fn accepted(&mut self, task: TaskId, token: FencingToken) {
        self.with_task(task, |s| s.handle_provider_accepted(task, token))
            .expect("accept");
    }

    fn submit_unknown(&mut self, task: TaskId, token: FencingToken) {
        self.with_task(task, |s| s.handle_submit_unknown(task, token))
            .expect("unknown");
    }

    fn not_found(&mut self, now: Time, task: TaskId, token: FencingToken) -> FailOutcome {
        self.with_task(task, |s| s.handle_provider_not_found(now, task, token))
            .expect("not found")
    }

    fn failed(
        &mut self,
        now: Time,
        task: TaskId,
        token: FencingToken,
        failure: Failure,
        jitter: u64,
    ) -> FailOutcome {
        self.with_task(task, |s| {
            s.handle_provider_failed(now, task, token, failure, jitter)
        })
        .expect("failed")
    }

    fn succeeded(&mut self, now: Time, task: TaskId, token: FencingToken, actual: Units) {
        self.with_task(task, |s| {
            s.handle_provider_succeeded(now, task, token, actual)
        })
        .expect("succeeded");
    }

    fn media_done(&mut self, task: TaskId, token: FencingToken) {
        self.with_task(task, |s| s.handle_media_done(task, token, true))
            .expect("media done");
    }

    fn maintain(&mut self, now: Time) {
        let due = self
            .last_resplit
            .is_none_or(|t| now.since(t) >= self.resplit_ns);
        if due && self.shards.len() > 1 {
            self.resplit(now);
            self.last_resplit = Some(now);
        }
    }

    /// Stalled lanes and delayed retries wake the node; the re-split then runs lazily at that
    /// event (`maintain`), so a shard waiting for a share never waits longer than a stall retry.
    fn wake_at(&self) -> Option<Time> {
        self.shards.iter().filter_map(|s| s.poll_timeout()).min()
    }

    fn shard_of(&self, tenant: TenantId) -> usize {
        shard_for(tenant, self.shards.len())
    }

    fn fairness_debt(&self, tenant: TenantId, lane: Lane) -> i64 {
        self.shards[shard_for(tenant, self.shards.len())].fairness_debt(tenant, lane)
    }

    fn lag_peak(&self) -> i64 {
        self.lags.iter().map(Lags::peak).max().unwrap_or(0)
    }

    fn check_invariants(&self) {
        for s in &self.shards {
            s.check_invariants();
        }
    }
}

// ------------------------------------------------------------------------------------ baselines

/// How a baseline orders its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// One global FIFO.
    Fifo,
    /// Round robin over tenants, `weight` tasks per turn, whatever each task costs.
    WrrCount,
    /// One global queue by base band, FIFO within a band, no aging.
    GlobalPriority,
}

#[derive(Debug, Clone)]
struct BaseTask {
    tenant: TenantId,
    lane: Lane,
    band: Band,
    estimate: CostEstimate,
    held: Option<Demand>,
    media: Option<Demand>,
    token: Option<FencingToken>,
    retries: u32,
    rate_limit_retries: u32,
}

/// A naive single-queue scheduler with correct resource accounting.
pub struct Baseline {
    order: Order,
    policy: Policy,
    ledger: Ledger,
    lane_units: [LimitId; Lane::COUNT],
    provider_conc: Vec<LimitId>,
    provider_rpm: Vec<LimitId>,
    model_running: LimitId,
    /// Lane running tasks, model running units, global running tasks and units.
    running: ([LimitId; Lane::COUNT], LimitId, LimitId, LimitId),
    high_cost: LimitId,
    platform_cost: LimitId,
    media_keys: [LimitId; 4],
    tasks: HashMap<TaskId, BaseTask>,
    fifo: VecDeque<TaskId>,
    bands: [VecDeque<TaskId>; Band::COUNT],
    per_tenant: HashMap<TenantId, VecDeque<TaskId>>,
    ring: VecDeque<TenantId>,
    turn_left: u32,
    queued: u64,
    delayed: BinaryHeap<Reverse<(Time, TaskId)>>,
    media_queue: VecDeque<TaskId>,
    /// After a pick found nothing, no rescan until something is released, work arrives within
    /// the scan window, or this time passes (token buckets refill): the rule the core uses too.
    stalled_until: Option<Time>,
}

/// How long a stalled baseline waits before rescanning with nothing changed.
const BASELINE_STALL_NS: u64 = 50_000_000;

impl Baseline {
    pub fn new(order: Order, policy: Policy) -> Baseline {
        let mut ledger = Ledger::new();
        let slots = |ledger: &mut Ledger, key: LimitKey| {
            register_node_limit(ledger, &policy, key, 1, Time::ZERO)
        };
        let lane_units = Lane::ALL.map(|l| slots(&mut ledger, LimitKey::LaneUnits(l)));
        let provider_conc = policy
            .providers
            .iter()
            .map(|p| slots(&mut ledger, LimitKey::ProviderConcurrency(p.id)))
            .collect();
        let provider_rpm = policy
            .providers
            .iter()
            .map(|p| slots(&mut ledger, LimitKey::ProviderRpm(p.id)))
            .collect();
        let model_running = slots(&mut ledger, LimitKey::ModelRunning(policy.models[0].id));
        let running = (
            Lane::ALL.map(|l| slots(&mut ledger, LimitKey::LaneRunningTasks(l))),
            slots(
                &mut ledger,
                LimitKey::ModelRunningUnits(policy.models[0].id),
            ),
            slots(&mut ledger, LimitKey::GlobalRunningTasks),
            slots(&mut ledger, LimitKey::GlobalRunningUnits),
        );
        let high_cost = slots(&mut ledger, LimitKey::HighCostConcurrency);
        let platform_cost = slots(&mut ledger, LimitKey::PlatformCostPerMinute);
        let media_keys = [
            LimitKey::GpuUnits,
            LimitKey::GpuMemMb,
            LimitKey::CpuUnits,
            LimitKey::TempDiskMb,
        ]
        .map(|k| slots(&mut ledger, k));
        Baseline {
            order,
            policy,
            ledger,
            lane_units,
            provider_conc,
            provider_rpm,
            model_running,
            running,
            high_cost,
            platform_cost,
            media_keys,
            tasks: HashMap::new(),
            fifo: VecDeque::new(),
            bands: Default::default(),
            per_tenant: HashMap::new(),
            ring: VecDeque::new(),
            turn_left: 0,
            queued: 0,
            delayed: BinaryHeap::new(),
            media_queue: VecDeque::new(),
            stalled_until: None,
        }
    }

    fn enqueue(&mut self, task: TaskId) {
        let t = &self.tasks[&task];
        match self.order {
            Order::Fifo => self.fifo.push_back(task),
            Order::GlobalPriority => self.bands[t.band.index()].push_back(task),
            Order::WrrCount => {
                let q = self.per_tenant.entry(t.tenant).or_default();
                if q.is_empty() {
                    self.ring.push_back(t.tenant);
                }
                q.push_back(task);
            }
        }
        self.queued += 1;
    }

    fn demand(&self, t: &BaseTask, provider: usize) -> Demand {
        let mut d = Demand::default();
        d.add(self.lane_units[t.lane.index()], t.estimate.slots.milli());
        d.add(self.provider_conc[provider], 1);
        d.add(self.model_running, 1);
        let (lane_tasks, model_units, global_tasks, global_units) = self.running;
        d.add(lane_tasks[t.lane.index()], 1);
        d.add(model_units, t.estimate.slots.milli());
        d.add(global_tasks, 1);
        d.add(global_units, t.estimate.slots.milli());
        if t.estimate.class == ResourceClass::Expensive {
            d.add(self.high_cost, 1);
        }
        // Buckets after semaphores: ids order them so, and in-order adds are appends.
        d.add(self.provider_rpm[provider], 1);
        d.add(self.platform_cost, t.estimate.cost_milli);
        d
    }

    /// Acquires a provider for `task` or changes nothing.
    fn try_start(&mut self, task: TaskId, now: Time) -> Option<Dispatch> {
        let t = &self.tasks[&task];
        for provider in 0..self.provider_conc.len() {
            let demand = self.demand(t, provider);
            if self.ledger.try_acquire(&demand, now).is_ok() {
                let t = self.tasks.get_mut(&task).expect("task");
                t.held = Some(demand);
                t.token = None;
                return Some(Dispatch {
                    task,
                    tenant: t.tenant,
                    user: spindle_core::UserId(0),
                    lane: t.lane,
                    band: t.band,
                    provider: spindle_core::ProviderId(provider as u16),
                    mode: CapacityMode::Normal,
                    attempt_no: 1 + t.retries + t.rate_limit_retries,
                    estimate: t.estimate,
                    policy_version: self.policy.version,
                });
            }
        }
        None
    }

    fn pick(&mut self, now: Time) -> Option<Dispatch> {
        match self.order {
            Order::Fifo => {
                for pos in 0..self.fifo.len().min(BASELINE_SCAN_MAX) {
                    if let Some(d) = self.try_start(self.fifo[pos], now) {
                        self.fifo.remove(pos);
                        return Some(d);
                    }
                }
                None
            }
            Order::GlobalPriority => {
                let mut scanned = 0;
                for band in 0..Band::COUNT {
                    for pos in 0..self.bands[band].len() {
                        if scanned == BASELINE_SCAN_MAX {
                            return None;
                        }
                        scanned += 1;
                        if let Some(d) = self.try_start(self.bands[band][pos], now) {
                            self.bands[band].remove(pos);
                            return Some(d);
                        }
                    }
                }
                None
            }
            Order::WrrCount => {
                for _ in 0..self.ring.len().min(BASELINE_SCAN_MAX) {
                    let tenant = *self.ring.front().expect("ring");
                    if self.turn_left == 0 {
                        self.turn_left = self.policy.tenants[&tenant].weight;
                    }
                    let head = self.per_tenant[&tenant][0];
                    if let Some(d) = self.try_start(head, now) {
                        let q = self.per_tenant.get_mut(&tenant).expect("queue");
                        q.pop_front();
                        self.turn_left -= 1;
                        if q.is_empty() {
                            self.ring.pop_front();
                            self.turn_left = 0;
                        } else if self.turn_left == 0 {
                            self.ring.rotate_left(1);
                        }
                        return Some(d);
                    }
                    self.ring.rotate_left(1);
                    self.turn_left = 0;
                }
                None
            }
        }
    }

    fn release(&mut self, task: TaskId) {
        let t = self.tasks.get_mut(&task).expect("task");
        let held = t.held.take().expect("a provider hold");
        self.ledger.release(&held);
        self.stalled_until = None;
    }

    fn requeue_after(&mut self, task: TaskId, at: Time) {
        self.delayed.push(Reverse((at, task)));
    }
}

impl Scheduler for Baseline {
    fn name(&self) -> &'static str {
        match self.order {
            Order::Fifo => "fifo",
            Order::WrrCount => "wrr_count",
            Order::GlobalPriority => "global_priority",
        }
    }

    fn submit(&mut self, _now: Time, req: SubmitRequest) -> Admission {
        let tenant = &self.policy.tenants[&req.tenant];
        let model = &self.policy.models[req.spec.model.0 as usize];
        let est = estimate(&req.spec, model, &self.policy.cost_bases).expect("valid spec");
        let lane = tenant.lane_for(est.class);
        let band = tenant.band_for(req.band_hint);
        let mut admission = Admission {
            task: req.task,
            decision: Decision::Accepted,
            reason: None,
            lane,
            band,
            estimate: est,
            estimated_start_at: None,
            queue_level: None,
        };
        if self.queued >= self.policy.node.global_queued_tasks_max {
            admission.decision = Decision::RejectPlatformOverloaded;
            admission.reason = Some(RejectReason::Limit(LimitKey::GlobalQueuedTasks));
            return admission;
        }
        let task = BaseTask {
            tenant: req.tenant,
            lane,
            band,
            estimate: est,
            held: None,
            media: None,
            token: None,
            retries: 0,
            rate_limit_retries: 0,
        };
        self.tasks.insert(req.task, task);
        self.enqueue(req.task);
        if self.queued <= BASELINE_SCAN_MAX as u64 {
            self.stalled_until = None;
        }
        admission
    }

    fn dispatch_all(&mut self, now: Time, out: &mut Vec<Dispatch>, _expired: &mut Vec<TaskId>) {
        while let Some(&Reverse((at, task))) = self.delayed.peek() {
            if at > now {
                break;
            }
            self.delayed.pop();
            self.enqueue(task);
            self.stalled_until = None;
        }
        if self.stalled_until.is_some_and(|t| now < t) {
            return;
        }
        while let Some(d) = self.pick(now) {
            self.queued -= 1;
            out.push(d);
        }
        self.stalled_until = (self.queued > 0).then(|| now.plus_ns(BASELINE_STALL_NS));
    }

    fn media_all(&mut self, now: Time, out: &mut Vec<MediaStart>) {
        let mut pos = 0;
        while pos < self.media_queue.len().min(BASELINE_SCAN_MAX) {
            let task = self.media_queue[pos];
            let t = &self.tasks[&task];
            let m = t.estimate.media;
            let mut d = Demand::default();
            for (key, amount) in
                self.media_keys
                    .iter()
                    .zip([m.gpu_units, m.gpu_mem_mb, m.cpu_units, m.temp_disk_mb])
            {
                d.add(*key, amount.into());
            }
            if self.ledger.try_acquire(&d, now).is_ok() {
                self.media_queue.remove(pos);
                let t = self.tasks.get_mut(&task).expect("task");
                t.media = Some(d);
                out.push(MediaStart {
                    task,
                    tenant: t.tenant,
                    estimate: t.estimate,
                });
            } else {
                pos += 1;
            }
        }
    }

    fn claim_granted(&mut self, task: TaskId, token: FencingToken) {
        self.tasks.get_mut(&task).expect("task").token = Some(token);
    }

    fn accepted(&mut self, _task: TaskId, _token: FencingToken) {}

    fn submit_unknown(&mut self, _task: TaskId, _token: FencingToken) {}

    fn not_found(&mut self, now: Time, task: TaskId, _token: FencingToken) -> FailOutcome {
        self.release(task);
        self.requeue_after(task, now);
        FailOutcome::Requeued { eligible_at: now }
    }

    fn failed(
        &mut self,
        now: Time,
        task: TaskId,
        _token: FencingToken,
        failure: Failure,
        jitter: u64,
    ) -> FailOutcome {
        self.release(task);
        let t = self.tasks.get_mut(&task).expect("task");
        let lane = self.policy.lane(t.lane);
        let (n, max) = match failure {
            Failure::RateLimited => {
                t.rate_limit_retries += 1;
                (t.rate_limit_retries, lane.rate_limit_retries_max)
            }
            Failure::Retryable => {
                t.retries += 1;
                (t.retries, lane.retries_max)
            }
            Failure::NonRetryable => (1, 0),
        };
        if n > max {
            self.tasks.remove(&task);
            return FailOutcome::Failed;
        }
        let at = now.plus_ns(self.policy.retry.backoff_ns(n, jitter));
        self.requeue_after(task, at);
        FailOutcome::Requeued { eligible_at: at }
    }

    fn succeeded(&mut self, _now: Time, task: TaskId, _token: FencingToken, _actual: Units) {
        self.release(task);
        self.media_queue.push_back(task);
    }

    fn media_done(&mut self, task: TaskId, _token: FencingToken) {
        let t = self.tasks.remove(&task).expect("task");
        self.ledger.release(&t.media.expect("media hold"));
        self.stalled_until = None;
    }

    fn maintain(&mut self, _now: Time) {}

    fn wake_at(&self) -> Option<Time> {
        let delayed = self.delayed.peek().map(|Reverse((t, _))| *t);
        match (delayed, self.stalled_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn shard_of(&self, _tenant: TenantId) -> usize {
        0
    }

    fn check_invariants(&self) {
        self.ledger.check_invariants(true);
    }
}
