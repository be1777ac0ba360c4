//! What a run measures, kept independently of the scheduler under test: its own count of every
//! resource each task holds (the limit checker), served units per tenant, backlog samples, head
//! waits (starvation), and wait percentiles.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, VecDeque};

use serde::Serialize;
use spindle_core::admission::Decision;
use spindle_core::fairness::GapTracker;
use spindle_core::ledger::WINDOW_NS;
use spindle_core::shard::CapacityMode;
use spindle_core::time::{NANOS_PER_MS, NANOS_PER_S};
use spindle_core::{Lane, Policy, TaskId, TenantId, Time};

use crate::engine::{is_expensive, SimTask};
use crate::scenario::Scenario;
use crate::sched::Scheduler;

/// Tenants per (shard, lane) group whose pairwise service gap is tracked.
pub const GAP_TENANTS_MAX: usize = 32;
/// Keys named in a report's `overshoot_keys`.
const OVERSHOOT_KEYS_SHOWN: usize = 10;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WaitMs {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

/// One policy's results on one scenario (the JSON shape of issue 2, plus more fields).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PolicyReport {
    pub policy: String,
    pub tasks_submitted: u64,
    pub tasks_accepted: u64,
    pub tasks_completed: u64,
    pub tasks_failed: u64,
    pub jain_index: f64,
    pub share_error_max: f64,
    /// The share error over the tenants entitled to at least `LARGE_ENTITLEMENT_BOUNDS` of their
    /// DRR bounds in the window (DRR's bound times the tenant's weight; 0 when none is): where
    /// a share can be judged against the bound (one bound off is 1/50 = 0.02).
    pub share_error_max_large: f64,
    /// The largest |served − entitled| / weight of a backlogged tenant (units).
    pub share_deviation_max_units: f64,
    pub backlogged_tenants: u64,
    pub starved_tasks: u64,
    pub limit_overshoots: u64,
    pub overshoot_keys: Vec<String>,
    /// The largest service gap between two tenants of one shard and lane, over the intervals
    /// in which both were backlogged throughout (DRR's bound applies).
    pub service_gap_max_units: f64,
    /// The same across the node's shards (tenants of one lane, whichever their shards).
    pub node_service_gap_max_units: f64,
    /// What DRR's bound grows by where runs take other than their estimates: DRR charges a
    /// run's correction as fairness debt paid later, a quantum at a time, while the gap counts it
    /// when the run ends; two tenants drift apart by at most their debts' ranges (per weight),
    /// twice the largest (units).
    pub debt_allowance_units: f64,
    /// What the node-wide gap's bound adds to the per-shard one: two shards' virtual times
    /// drift apart by at most their two lags behind the node's (`share::Lags`), twice the
    /// largest the splits saw (units per weight; 0 with one shard).
    pub lag_allowance_units: f64,
    pub drr_bound_units: f64,
    pub wait_ms: WaitMs,
    pub rejected: BTreeMap<String, u64>,
    pub rate_limited_answers: u64,
    pub submit_timeouts: u64,
    pub duplicate_provider_jobs: u64,
    pub borrowed_dispatches: u64,
    /// Backlogged tenants' served vs entitled units (the first `TENANTS_SHOWN`).
    pub backlogged: Vec<TenantShare>,
    pub sim_end_s: f64,
    pub sim_wall_ms: u64,
}

impl PolicyReport {
    /// The bound the per-shard service gap is held to: DRR's, plus what the runs' corrections
    /// add while DRR still owes or is owed them (`debt_allowance_units`).
    pub fn gap_bound_units(&self) -> f64 {
        self.drr_bound_units + self.debt_allowance_units
    }

    /// The bound the node-wide service gap is held to: each of two tenants within DRR's bound of
    /// its shard's virtual time (twice DRR's bound, where one shard needs it once: the two
    /// tenants' rounds are not interleaved in one ring), plus the debts', plus the shards' drift
    /// apart (`lag_allowance_units`).
    pub fn node_gap_bound_units(&self) -> f64 {
        2.0 * self.drr_bound_units + self.debt_allowance_units + self.lag_allowance_units
    }
}

/// One backlogged tenant's service in the measurement window.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TenantShare {
    pub tenant: u32,
    pub lane: String,
    pub weight: u32,
    pub served_units: f64,
    pub entitled_units: f64,
}

/// A tenant's share is judged by `share_error_max_large` when it was entitled to at least this
/// many of its DRR bounds (DRR's bound per weight × its weight) in the window.
pub const LARGE_ENTITLEMENT_BOUNDS: f64 = 50.0;

/// Tenants listed in a report's `backlogged`.
const TENANTS_SHOWN: usize = 32;

#[derive(Debug, Clone)]
struct Counter {
    name: String,
    capacity: u64,
    used: u64,
}

/// Consumption in a sliding window must stay within a token bucket's `burst + per_minute`.
#[derive(Debug, Clone)]
struct RateWindow {
    name: String,
    bound: i128,
    entries: VecDeque<(Time, i128)>,
    sum: i128,
}

impl RateWindow {
    fn push(&mut self, now: Time, amount: i128) -> bool {
        while let Some(&(t, a)) = self.entries.front() {
            if now.since(t) < WINDOW_NS {
                break;
            }
            self.entries.pop_front();
            self.sum -= a;
        }
        self.entries.push_back((now, amount));
        self.sum += amount;
        self.sum > self.bound
    }
}

const LANE_POOLS: usize = 0;
const BORROWED: usize = Lane::COUNT;
const MODEL: usize = BORROWED + 1;
const HIGH_COST: usize = MODEL + 1;
const MEDIA: usize = HIGH_COST + 1; // gpu, gpu mem, cpu, disk
const LANE_TASKS: usize = MEDIA + 4;
const MODEL_UNITS: usize = LANE_TASKS + Lane::COUNT;
const GLOBAL_TASKS: usize = MODEL_UNITS + 1;
const GLOBAL_UNITS: usize = GLOBAL_TASKS + 1;
const PROVIDERS: usize = GLOBAL_UNITS + 1;

pub(crate) struct Collector {
    window: (Time, Time),
    bound_ns: u64,
    tenants: Vec<(TenantId, u32, Lane)>,
    shard_of: Vec<usize>,
    providers: usize,
    counters: Vec<Counter>,
    rpm: Vec<RateWindow>,
    cost: Option<RateWindow>,
    overshoots: u64,
    overshoot_keys: BTreeSet<String>,
    decisions: BTreeMap<Decision, u64>,
    waits_ms: Vec<u32>,
    completed: u64,
    pub failed: u64,
    pub rate_limited: u64,
    pub timeouts: u64,
    pub duplicate_jobs: u64,
    borrowed: u64,
    queued: Vec<u32>,
    backlogged: Vec<u8>,
    served: Vec<u64>,
    /// (when, tenant, lane, units): each start's estimate, each run's correction.
    service_events: Vec<(Time, u32, u8, i64)>,
    /// Per tenant-lane, the lowest and highest fairness debt the scheduler held (milli).
    debt_range: Vec<(i64, i64)>,
    /// (when, tenant, lane, backlogged): each time a tenant's queue in a lane became non-empty
    /// or empty (before the window's end), for the service gap over exact intervals.
    backlog_events: Vec<(Time, u32, u8, bool)>,
    /// Retries backing off: (eligible at, tenant-lane), queued from then.
    backing_off: BinaryHeap<Reverse<(Time, usize)>>,
    debt_cap_milli: i64,
    heads: HashMap<usize, (BTreeSet<(Time, TaskId)>, Time)>,
    queued_at: HashMap<TaskId, Time>,
    starved: u64,
    max_cost_milli: u64,
    drr_bound_base_milli: u64,
}

fn tl(tenant: u32, lane: Lane) -> usize {
    tenant as usize * Lane::COUNT + lane.index()
}

impl Collector {
    pub fn new(
        scenario: &Scenario,
        policy: &Policy,
        tenants: &[(TenantId, u32, Lane)],
        sched: &dyn Scheduler,
    ) -> Collector {
        let mut counters = Vec::new();
        let mut c = |name: String, capacity: u64| {
            counters.push(Counter {
                name,
                capacity,
                used: 0,
            })
        };
        for lane in Lane::ALL {
            c(
                format!("lane:{lane}:running_units"),
                policy.lane(lane).capacity.milli(),
            );
        }
        c(
            "lane:ENTERPRISE_RESERVED:borrowed_units".into(),
            policy.reserve.borrow_limit.milli(),
        );
        c("model:0:running".into(), policy.node.model_running_max);
        c(
            "high_cost:concurrency".into(),
            policy.node.high_cost_concurrency,
        );
        c("media:gpu_units".into(), policy.node.gpu_units);
        c("media:gpu_mem_mb".into(), policy.node.gpu_mem_mb);
        c("media:cpu_units".into(), policy.node.cpu_units);
        c("media:temp_disk_mb".into(), policy.node.temp_disk_mb);
        for lane in Lane::ALL {
            c(
                format!("lane:{lane}:running_tasks"),
                policy.lane(lane).running_tasks_max,
            );
        }
        c(
            "model:0:running_units".into(),
            policy.node.model_running_units_max.milli(),
        );
        c(
            "global:running_tasks".into(),
            policy.node.global_running_tasks_max,
        );
        c(
            "global:running_units".into(),
            policy.node.global_running_units_max.milli(),
        );
        for p in &policy.providers {
            c(format!("provider:{}:concurrency", p.name), p.concurrency);
        }
        for &(id, _, _) in tenants {
            let t = &policy.tenants[&id];
            c(format!("tenant:{id}:running_tasks"), t.running_tasks_max);
            c(
                format!("tenant:{id}:running_units"),
                t.running_units_max.milli(),
            );
        }
        let window = |name: String, rate: spindle_core::policy::RateSpec| RateWindow {
            name,
            bound: i128::from(rate.burst) + i128::from(rate.per_minute),
            entries: VecDeque::new(),
            sum: 0,
        };
        let rpm = policy
            .providers
            .iter()
            .map(|p| window(format!("provider:{}:rpm", p.name), p.rpm))
            .collect();
        let pc = policy.node.platform_cost_per_minute;
        let cost = (pc.per_minute < 1 << 39).then(|| window("platform:cost_per_minute".into(), pc));
        // Shreedhar & Varghese: two backlogged flows never drift apart by more than the largest
        // task plus two quanta (weight-normalized).
        let quantum = policy.drr.base_quantum.milli();
        Collector {
            window: (
                Time::from_secs(scenario.warmup_s),
                Time::from_secs(*scenario.duration_s.get_ref()),
            ),
            bound_ns: scenario.starvation_bound_s * NANOS_PER_S,
            shard_of: tenants
                .iter()
                .map(|&(id, _, _)| sched.shard_of(id))
                .collect(),
            tenants: tenants.to_vec(),
            providers: policy.providers.len(),
            counters,
            rpm,
            cost,
            overshoots: 0,
            overshoot_keys: BTreeSet::new(),
            decisions: BTreeMap::new(),
            waits_ms: Vec::new(),
            completed: 0,
            failed: 0,
            rate_limited: 0,
            timeouts: 0,
            duplicate_jobs: 0,
            borrowed: 0,
            queued: vec![0; tenants.len() * Lane::COUNT],
            backlogged: vec![0; tenants.len() * Lane::COUNT],
            served: vec![0; tenants.len() * Lane::COUNT],
            service_events: Vec::new(),
            backlog_events: Vec::new(),
            backing_off: BinaryHeap::new(),
            heads: HashMap::new(),
            queued_at: HashMap::new(),
            starved: 0,
            max_cost_milli: 0,
            drr_bound_base_milli: 2 * quantum,
            debt_cap_milli: policy.drr.debt_cap_per_task.milli() as i64,
            debt_range: vec![(0, 0); tenants.len() * Lane::COUNT],
        }
    }

    fn add(&mut self, key: usize, amount: i64) {
        let c = &mut self.counters[key];
        c.used = c
            .used
            .checked_add_signed(amount)
            .expect("checker counter below zero: a double release");
        if c.used > c.capacity {
            self.overshoots += 1;
            self.overshoot_keys.insert(c.name.clone());
        }
    }

    fn tenant_keys(&self, tenant: u32) -> (usize, usize) {
        let base = PROVIDERS + self.providers + tenant as usize * 2;
        (base, base + 1)
    }

    fn provider_keys(&self, t: &SimTask, sign: i64) -> Vec<(usize, i64)> {
        let units = t.estimate.slots.milli() as i64 * sign;
        let pool = match t.mode {
            CapacityMode::Normal => t.lane,
            CapacityMode::Borrowed(l) => l,
        };
        let mut keys = vec![
            (LANE_POOLS + pool.index(), units),
            (LANE_TASKS + t.lane.index(), sign),
            (MODEL, sign),
            (MODEL_UNITS, units),
            (GLOBAL_TASKS, sign),
            (GLOBAL_UNITS, units),
            (PROVIDERS + t.provider as usize, sign),
        ];
        if t.mode == CapacityMode::Borrowed(Lane::EnterpriseReserved) {
            keys.push((BORROWED, units));
        }
        if is_expensive(t) {
            keys.push((HIGH_COST, sign));
        }
        let (tasks, tunits) = self.tenant_keys(t.tenant);
        keys.push((tasks, sign));
        keys.push((tunits, units));
        keys
    }

    pub fn hold_provider(&mut self, t: &SimTask, now: Time) {
        for (key, amount) in self.provider_keys(t, 1) {
            self.add(key, amount);
        }
        if matches!(t.mode, CapacityMode::Borrowed(_)) {
            self.borrowed += 1;
        }
        let rpm = &mut self.rpm[t.provider as usize];
        if rpm.push(now, 1) {
            self.overshoots += 1;
            self.overshoot_keys.insert(rpm.name.clone());
        }
        if let Some(cost) = &mut self.cost {
            if cost.push(now, i128::from(t.estimate.cost_milli)) {
                self.overshoots += 1;
                self.overshoot_keys.insert(cost.name.clone());
            }
        }
        self.max_cost_milli = self.max_cost_milli.max(t.estimate.fairness.milli());
    }

    pub fn release_provider(&mut self, t: &SimTask) {
        for (key, amount) in self.provider_keys(t, -1) {
            self.add(key, amount);
        }
    }

    /// A rate-limited request was not billed: the bucket got its cost tokens back.
    pub fn refund_cost(&mut self, t: &SimTask, now: Time) {
        if let Some(cost) = &mut self.cost {
            cost.push(now, -i128::from(t.estimate.cost_milli));
        }
    }

    fn media_keys(t: &SimTask, sign: i64) -> [(usize, i64); 4] {
        let m = t.estimate.media;
        [
            (MEDIA, i64::from(m.gpu_units) * sign),
            (MEDIA + 1, i64::from(m.gpu_mem_mb) * sign),
            (MEDIA + 2, i64::from(m.cpu_units) * sign),
            (MEDIA + 3, i64::from(m.temp_disk_mb) * sign),
        ]
    }

    pub fn hold_media(&mut self, t: &SimTask) {
        for (key, amount) in Self::media_keys(t, 1) {
            self.add(key, amount);
        }
    }

    pub fn release_media(&mut self, t: &SimTask) {
        for (key, amount) in Self::media_keys(t, -1) {
            self.add(key, amount);
        }
    }

    pub fn on_decision(&mut self, decision: Decision) {
        *self.decisions.entry(decision).or_default() += 1;
    }

    /// The task is waiting for dispatch from `at` (its submit, or its retry's eligibility), told
    /// at `now`. A retry backing off until a later `at` is not in its tenant's queue before then
    /// (the scheduler cannot serve it): its tenant is not backlogged for it until `at`.
    pub fn on_queued(&mut self, t: &SimTask, task: TaskId, at: Time, now: Time) {
        self.settle(now);
        let key = tl(t.tenant, t.lane);
        if at > now {
            self.backing_off.push(Reverse((at, key)));
        } else {
            self.count_queued(key, at);
        }
        let (set, head_since) = self
            .heads
            .entry(key)
            .or_insert_with(|| (BTreeSet::new(), at));
        if set.is_empty() {
            *head_since = at;
        }
        set.insert((at, task));
        self.queued_at.insert(task, at);
    }

    /// Counts the retries whose backoff ended by `now` as queued.
    fn settle(&mut self, now: Time) {
        while let Some(&Reverse((at, key))) = self.backing_off.peek() {
            if at > now {
                break;
            }
            self.backing_off.pop();
            self.count_queued(key, at);
        }
    }

    fn count_queued(&mut self, key: usize, at: Time) {
        self.queued[key] += 1;
        if self.queued[key] == 1 && at < self.window.1 {
            let (tenant, lane) = ((key / Lane::COUNT) as u32, (key % Lane::COUNT) as u8);
            self.backlog_events.push((at, tenant, lane, true));
        }
    }

    /// The task left the queue (dispatched or expired).
    pub fn on_dequeued(&mut self, t: &SimTask, task: TaskId, now: Time) {
        self.settle(now);
        let key = tl(t.tenant, t.lane);
        self.queued[key] -= 1;
        if self.queued[key] == 0 && now < self.window.1 {
            self.backlog_events
                .push((now, t.tenant, t.lane.index() as u8, false));
        }
        let at = self
            .queued_at
            .remove(&task)
            .expect("a dequeued task was queued");
        let (set, head_since) = self.heads.get_mut(&key).expect("queue of the task");
        let was_head = set.first() == Some(&(at, task));
        set.remove(&(at, task));
        if was_head {
            if now.since((*head_since).max(at)) > self.bound_ns {
                self.starved += 1;
            }
            *head_since = now;
        }
        if t.first_dispatch == Some(now) && t.attempt_dispatched == now {
            let wait_ms = now.since(t.submitted) / NANOS_PER_MS;
            self.waits_ms
                .push(u32::try_from(wait_ms).unwrap_or(u32::MAX));
        }
    }

    pub fn on_accepted(&mut self, t: &SimTask) {
        let at = t.attempt_dispatched;
        if at >= self.window.0 && at < self.window.1 {
            let units = t.estimate.fairness.milli();
            self.served[tl(t.tenant, t.lane)] += units;
            self.service_events
                .push((at, t.tenant, t.lane.index() as u8, units as i64));
        }
    }

    /// The provider ran the task's accepted attempt for `actual` units: what it took over (or
    /// under) the estimate counts as service too, within the per-task cap DRR's fairness debt
    /// applies (the tenant is charged so): in its share if the attempt started in the window,
    /// and at `now` in the service gap.
    pub fn on_succeeded(&mut self, t: &SimTask, actual: spindle_core::Units, now: Time) {
        let est = t.estimate.fairness.milli() as i64;
        let delta = (actual.milli() as i64 - est).clamp(-self.debt_cap_milli, self.debt_cap_milli);
        let at = t.attempt_dispatched;
        if at >= self.window.0 && at < self.window.1 {
            let key = tl(t.tenant, t.lane);
            self.served[key] = self.served[key].saturating_add_signed(delta);
        }
        if delta != 0 && now < self.window.1 {
            self.service_events
                .push((now, t.tenant, t.lane.index() as u8, delta));
        }
    }

    /// The scheduler's fairness debt with the task's tenant in its lane is `debt` now (after a
    /// run's correction or a charge given back: a debt is furthest from zero then, and only
    /// paid down, toward zero, after).
    pub fn on_debt(&mut self, t: &SimTask, debt: i64) {
        let range = &mut self.debt_range[tl(t.tenant, t.lane)];
        *range = (range.0.min(debt), range.1.max(debt));
    }

    pub fn on_completed(&mut self) {
        self.completed += 1;
    }

    pub fn sample(&mut self, now: Time) {
        self.settle(now);
        if now < self.window.0 || now >= self.window.1 {
            return;
        }
        for (i, state) in self.backlogged.iter_mut().enumerate() {
            *state = match (*state, self.queued[i] > 0) {
                (0, true) => 1,
                (1, true) => 1,
                _ => 2,
            };
        }
    }

    /// The report; `lag_peak`: the scheduler's `Scheduler::lag_peak`.
    pub fn finish(mut self, policy: &str, end: Time, lag_peak: i64) -> PolicyReport {
        // Tasks still waiting at the end: each one whose head wait already passed the bound.
        for (set, head_since) in self.heads.values() {
            for &(at, _) in set {
                if end.since((*head_since).max(at)) > self.bound_ns {
                    self.starved += 1;
                }
            }
        }
        let drr_bound_units = (self.max_cost_milli + self.drr_bound_base_milli) as f64 / 1000.0;
        let (share_error_max, jain_index, backlogged) = self.fairness();
        // DRR's bound is per unit of weight: a weight-w tenant may drift w bounds from its
        // share in units, so its share is judged once it is entitled to 50 of *its* bounds.
        let large = |b: &&TenantShare| {
            b.entitled_units > 0.0
                && b.entitled_units
                    >= LARGE_ENTITLEMENT_BOUNDS * drr_bound_units * f64::from(b.weight)
        };
        let share_error_max_large = backlogged
            .iter()
            .filter(large)
            .map(|b| (b.served_units - b.entitled_units).abs() / b.entitled_units)
            .fold(0.0, f64::max);
        let share_deviation_max_units = backlogged
            .iter()
            .map(|b| (b.served_units - b.entitled_units).abs() / f64::from(b.weight))
            .fold(0.0, f64::max);
        let backlogged_tenants = backlogged.len() as u64;
        let (service_gap, node_service_gap) = self.service_gaps();
        self.waits_ms.sort_unstable();
        let pct = |p: f64| -> f64 {
            if self.waits_ms.is_empty() {
                return 0.0;
            }
            let i = ((self.waits_ms.len() as f64 * p).ceil() as usize)
                .clamp(1, self.waits_ms.len())
                - 1;
            f64::from(self.waits_ms[i])
        };
        let submitted: u64 = self.decisions.values().sum();
        let accepted: u64 = self
            .decisions
            .iter()
            .filter(|(d, _)| d.is_accepted())
            .map(|(_, n)| n)
            .sum();
        PolicyReport {
            policy: policy.to_string(),
            tasks_submitted: submitted,
            tasks_accepted: accepted,
            tasks_completed: self.completed,
            tasks_failed: self.failed,
            jain_index,
            share_error_max,
            share_error_max_large,
            share_deviation_max_units,
            backlogged_tenants,
            starved_tasks: self.starved,
            limit_overshoots: self.overshoots,
            overshoot_keys: self
                .overshoot_keys
                .iter()
                .take(OVERSHOOT_KEYS_SHOWN)
                .cloned()
                .collect(),
            service_gap_max_units: service_gap,
            node_service_gap_max_units: node_service_gap,
            debt_allowance_units: self.debt_allowance(),
            lag_allowance_units: 2.0 * lag_peak as f64 / 1000.0,
            drr_bound_units,
            wait_ms: WaitMs {
                p50: pct(0.5),
                p99: pct(0.99),
                max: pct(1.0),
            },
            rejected: self
                .decisions
                .iter()
                .filter(|(d, _)| !d.is_accepted())
                .map(|(d, n)| (d.name().to_string(), *n))
                .collect(),
            rate_limited_answers: self.rate_limited,
            submit_timeouts: self.timeouts,
            duplicate_provider_jobs: self.duplicate_jobs,
            borrowed_dispatches: self.borrowed,
            backlogged: backlogged.into_iter().take(TENANTS_SHOWN).collect(),
            sim_end_s: end.as_nanos() as f64 / 1e9,
            sim_wall_ms: 0,
        }
    }

    /// Over tenant-lanes backlogged at every sample of the window: entitled share by weight of
    /// what the backlogged tenants of that lane were served.
    fn fairness(&self) -> (f64, f64, Vec<TenantShare>) {
        let mut share_error_max: f64 = 0.0;
        let mut ratios = Vec::new();
        let mut shares = Vec::new();
        for lane in Lane::ALL {
            let members: Vec<(u64, u64, usize)> = (0..self.tenants.len())
                .filter(|&t| self.backlogged[tl(t as u32, lane)] == 1)
                .map(|t| {
                    (
                        u64::from(self.tenants[t].1),
                        self.served[tl(t as u32, lane)],
                        t,
                    )
                })
                .collect();
            if members.len() < 2 {
                continue;
            }
            let served: u64 = members.iter().map(|m| m.1).sum();
            let weight: u64 = members.iter().map(|m| m.0).sum();
            for &(w, s, t) in &members {
                let entitled = served as f64 * w as f64 / weight as f64;
                shares.push(TenantShare {
                    tenant: self.tenants[t].0 .0,
                    lane: lane.name().to_string(),
                    weight: w as u32,
                    served_units: s as f64 / 1000.0,
                    entitled_units: entitled / 1000.0,
                });
                if entitled <= 0.0 {
                    continue;
                }
                share_error_max = share_error_max.max((s as f64 - entitled).abs() / entitled);
                ratios.push(s as f64 / entitled);
            }
        }
        let n = ratios.len() as f64;
        let sum: f64 = ratios.iter().sum();
        let squares: f64 = ratios.iter().map(|x| x * x).sum();
        let jain = if ratios.is_empty() || squares == 0.0 {
            1.0
        } else {
            sum * sum / (n * squares)
        };
        (share_error_max, jain, shares)
    }

    /// Largest |ΔS_i − ΔS_j| over any interval of the window in which both tenants were
    /// backlogged throughout (event by event, not sampled), S = served units / weight: the
    /// quantity DRR bounds. Per (shard, lane) — DRR's promise — and, as the second value, per
    /// lane across the node's shards (the split's). Among up to `GAP_TENANTS_MAX` tenants per
    /// group, those backlogged at some time in the window, lowest ids first.
    fn service_gaps(&self) -> (f64, f64) {
        let (start, end) = self.window;
        let mut in_window = BTreeSet::new();
        for &(at, tenant, lane, backlogged) in &self.backlog_events {
            if backlogged && at < end {
                in_window.insert((tenant, lane));
            }
        }
        // A tenant backlogged since before the window is backlogged in it too.
        let mut state: HashMap<(u32, u8), bool> = HashMap::new();
        for &(at, tenant, lane, backlogged) in &self.backlog_events {
            if at <= start {
                state.insert((tenant, lane), backlogged);
            }
        }
        in_window.extend(state.iter().filter(|(_, &b)| b).map(|(&k, _)| k));
        let mut shard_groups: BTreeMap<(usize, u8), Vec<u32>> = BTreeMap::new();
        let mut lane_groups: BTreeMap<u8, Vec<u32>> = BTreeMap::new();
        for &(tenant, lane) in &in_window {
            let g = shard_groups
                .entry((self.shard_of[tenant as usize], lane))
                .or_default();
            if g.len() < GAP_TENANTS_MAX {
                g.push(tenant);
            }
            let g = lane_groups.entry(lane).or_default();
            if g.len() < GAP_TENANTS_MAX {
                g.push(tenant);
            }
        }
        let shard_gap = shard_groups
            .iter()
            .map(|(&(_, lane), members)| self.gap_of(lane, members))
            .fold(0.0, f64::max);
        let node_gap = lane_groups
            .iter()
            .map(|(&lane, members)| self.gap_of(lane, members))
            .fold(0.0, f64::max);
        (shard_gap, node_gap)
    }

    /// Twice the largest range of a tenant's fairness debt, per weight (units).
    fn debt_allowance(&self) -> f64 {
        let mut worst: f64 = 0.0;
        for (t, &(_, weight, _)) in self.tenants.iter().enumerate() {
            for lane in Lane::ALL {
                let (lo, hi) = self.debt_range[tl(t as u32, lane)];
                worst = worst.max((hi - lo) as f64 / 1000.0 / f64::from(weight));
            }
        }
        2.0 * worst
    }

    /// The largest joint-interval gap among `members` (tenants) in `lane`.
    fn gap_of(&self, lane: u8, members: &[u32]) -> f64 {
        if members.len() < 2 {
            return 0.0;
        }
        let pos: HashMap<u32, usize> = members.iter().enumerate().map(|(i, &t)| (t, i)).collect();
        // At one instant: queues that filled, then starts, then queues that emptied (a start
        // that empties its tenant's queue is served while it is backlogged). Before the window,
        // only where each queue stood when it began.
        let (start, end) = self.window;
        let mut at_start = vec![false; members.len()];
        let mut events: Vec<(Time, u8, usize, f64)> = Vec::new();
        for &(at, tenant, l, backlogged) in &self.backlog_events {
            if l == lane {
                if let Some(&i) = pos.get(&tenant) {
                    if at <= start {
                        at_start[i] = backlogged;
                    } else {
                        events.push((at, if backlogged { 0 } else { 2 }, i, 0.0));
                    }
                }
            }
        }
        let mut gaps = GapTracker::new(members.len());
        for (i, &backlogged) in at_start.iter().enumerate() {
            gaps.set_backlogged(i, backlogged);
        }
        for &(at, tenant, l, units) in &self.service_events {
            if l == lane && at >= start && at < end {
                if let Some(&i) = pos.get(&tenant) {
                    let w = f64::from(self.tenants[tenant as usize].1);
                    events.push((at, 1, i, units as f64 / 1000.0 / w));
                }
            }
        }
        events.sort_by_key(|e| (e.0, e.1, e.2));
        for (_, order, i, units) in events {
            match order {
                0 => gaps.set_backlogged(i, true),
                1 => gaps.serve(i, units),
                _ => gaps.set_backlogged(i, false),
            }
        }
        gaps.max_gap()
    }
}
