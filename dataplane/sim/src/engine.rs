//! The discrete-event loop: a virtual clock, seeded workloads, simulated providers and media
//! slots, and the checkers. One run = one scenario through one scheduler.
//!
//! Everything random comes from [`Rng`] streams derived from the scenario seed, and events with
//! equal times are ordered by a sequence number, so a seed reproduces a run bit for bit.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use spindle_core::cost::CostEstimate;
use spindle_core::shard::{
    CapacityMode, Dispatch, FailOutcome, Failure, MediaStart, SubmitRequest,
};
use spindle_core::time::{NANOS_PER_MS, NANOS_PER_S};
use spindle_core::{
    FencingToken, Lane, Policy, ResourceClass, TaskId, TenantId, Time, Units, UserId,
};

use crate::metrics::{Collector, PolicyReport};
use crate::rng::Rng;
use crate::scenario::{Arrival, MixEntry, Scenario};
use crate::sched::{Baseline, Order, Scheduler, SpindleNode};

/// How long the node waits for a provider's answer to a submit before it is SUBMIT_UNKNOWN.
pub const SUBMIT_TIMEOUT_NS: u64 = 10 * NANOS_PER_S;
/// After a timeout, when the node asks the provider by request key.
pub const QUERY_DELAY_NS: u64 = 5 * NANOS_PER_S;
/// Events one run may process: a scenario cannot make the simulator run forever.
pub const EVENTS_MAX: u64 = 2_000_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    Spindle,
    Fifo,
    WrrCount,
    GlobalPriority,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Spindle,
        PolicyKind::Fifo,
        PolicyKind::WrrCount,
        PolicyKind::GlobalPriority,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Spindle => "spindle",
            PolicyKind::Fifo => "fifo",
            PolicyKind::WrrCount => "wrr_count",
            PolicyKind::GlobalPriority => "global_priority",
        }
    }

    fn build(self, scenario: &Scenario, policy: Policy, options: RunOptions) -> Box<dyn Scheduler> {
        match self {
            PolicyKind::Spindle => {
                let mut node = SpindleNode::new(
                    policy,
                    *scenario.shards.get_ref() as usize,
                    scenario.resplit_ms * NANOS_PER_MS,
                );
                node.split_unchanged = options.split_unchanged;
                node.uncorrected_split = options.uncorrected_split;
                Box::new(node)
            }
            PolicyKind::Fifo => Box::new(Baseline::new(Order::Fifo, policy)),
            PolicyKind::WrrCount => Box::new(Baseline::new(Order::WrrCount, policy)),
            PolicyKind::GlobalPriority => Box::new(Baseline::new(Order::GlobalPriority, policy)),
        }
    }
}

/// Knobs of a run that are not part of the scenario.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Call every scheduler's `check_invariants` after this many events (0: only at the end).
    pub check_every: u64,
    /// Split every node-wide limit at every re-split, even one whose shards' loads have not
    /// changed since its last split (spindle's node; the result is the same, only slower).
    pub split_unchanged: bool,
    /// Split node-wide limits by backlogged weight alone, without the correction for the
    /// shards' lags behind the node's virtual time (`spindle_core::share::Lags`): the split
    /// before it, kept to show what the correction is for.
    pub uncorrected_split: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Accepted,
    RateLimited,
    /// The answer never comes; `accepted` says whether the provider did take the job.
    Timeout {
        accepted: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    Arrival {
        tenant: u32,
    },
    SubmitAnswer {
        task: TaskId,
        token: FencingToken,
        answer: Answer,
    },
    Query {
        task: TaskId,
        token: FencingToken,
        found: bool,
    },
    ProviderDone {
        task: TaskId,
        token: FencingToken,
    },
    MediaDone {
        task: TaskId,
        token: FencingToken,
    },
    Wake,
    Sample,
}

struct Queued(Time, u64, Ev);

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        (self.0, self.1) == (other.0, other.1)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Queued {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0, self.1).cmp(&(other.0, other.1))
    }
}

struct TenantSim {
    id: TenantId,
    group: usize,
    weight: u32,
    lane: Lane,
    users: u32,
    rng: Rng,
}

/// What the simulator knows of a task (independently of the scheduler).
#[derive(Debug, Clone)]
pub(crate) struct SimTask {
    pub tenant: u32,
    pub lane: Lane,
    pub estimate: CostEstimate,
    pub submitted: Time,
    pub first_dispatch: Option<Time>,
    pub attempt_dispatched: Time,
    pub token: FencingToken,
    pub provider: u16,
    pub mode: CapacityMode,
    pub run_multiplier: f64,
    pub live_provider_jobs: u8,
}

struct Provider {
    rng: Rng,
    spec: crate::scenario::ProviderSpec,
}

/// One run in progress.
struct Run<'a> {
    scenario: &'a Scenario,
    sched: Box<dyn Scheduler>,
    events: BinaryHeap<Reverse<Queued>>,
    seq: u64,
    now: Time,
    tenants: Vec<TenantSim>,
    tasks: Vec<SimTask>,
    providers: Vec<Provider>,
    next_token: u64,
    next_wake: Option<Time>,
    collector: Collector,
    arrivals_end: Time,
    in_flight: u64,
}

pub fn run(scenario: &Scenario, kind: PolicyKind, options: RunOptions) -> PolicyReport {
    let policy = scenario.policy();
    let sched = kind.build(scenario, policy.clone(), options);
    let seed = scenario.seed;
    let tenants: Vec<TenantSim> = scenario
        .tenant_ids()
        .map(|(id, g)| TenantSim {
            id,
            group: scenario
                .tenants
                .iter()
                .position(|x| std::ptr::eq(x, g))
                .expect("group"),
            weight: *g.weight.get_ref(),
            lane: g.lane,
            users: g.users.max(1),
            rng: Rng::fork(seed, u64::from(id.0)),
        })
        .collect();
    let providers = scenario
        .providers
        .iter()
        .enumerate()
        .map(|(i, spec)| Provider {
            rng: Rng::fork(seed, (1 << 40) + i as u64),
            spec: spec.clone(),
        })
        .collect();
    let collector = Collector::new(
        scenario,
        &policy,
        &tenants
            .iter()
            .map(|t| (t.id, t.weight, t.lane))
            .collect::<Vec<_>>(),
        sched.as_ref(),
    );
    let mut run = Run {
        scenario,
        sched,
        events: BinaryHeap::new(),
        seq: 0,
        now: Time::ZERO,
        tenants,
        tasks: Vec::new(),
        providers,
        next_token: 0,
        next_wake: None,
        collector,
        arrivals_end: Time::from_secs(*scenario.duration_s.get_ref()),
        in_flight: 0,
    };
    run.start();
    run.main_loop(options);
    run.sched.check_invariants();
    let name = run.sched.name();
    let lag_peak = run.sched.lag_peak();
    run.collector.finish(name, run.now, lag_peak)
}

impl Run<'_> {
    fn push(&mut self, at: Time, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse(Queued(at, self.seq, ev)));
    }

    fn start(&mut self) {
        for i in 0..self.tenants.len() {
            if let Some(at) = self.next_arrival(i, Time::ZERO) {
                self.push(at, Ev::Arrival { tenant: i as u32 });
            }
        }
        self.push(Time::from_secs(self.scenario.warmup_s), Ev::Sample);
    }

    /// The next arrival of tenant `i` after `now`, or `None` once arrivals have ended.
    fn next_arrival(&mut self, i: usize, now: Time) -> Option<Time> {
        let arrival = self.scenario.tenants[self.tenants[i].group]
            .arrival
            .get_ref()
            .clone();
        let rng = &mut self.tenants[i].rng;
        let gap = |rng: &mut Rng, rate: f64| (rng.exp(1.0 / rate) * 1e9) as u64;
        let at = match arrival {
            Arrival::Poisson { rate_per_s } => now.plus_ns(gap(rng, rate_per_s)),
            Arrival::Window {
                rate_per_s,
                start_s,
                end_s,
            } => {
                let from = now.max(Time::from_secs(start_s));
                let at = from.plus_ns(gap(rng, rate_per_s));
                if at >= Time::from_secs(end_s) {
                    return None;
                }
                at
            }
            Arrival::Bursty {
                rate_per_s,
                on_s,
                off_s,
            } => {
                let period = (on_s + off_s).max(1) * NANOS_PER_S;
                let mut at = now.plus_ns(gap(rng, rate_per_s));
                if at.as_nanos() % period >= on_s * NANOS_PER_S {
                    // Silent phase: continue from the start of the next on-phase.
                    let next_on = (at.as_nanos() / period + 1) * period;
                    at = Time(next_on).plus_ns(gap(rng, rate_per_s));
                }
                at
            }
        };
        (at < self.arrivals_end).then_some(at)
    }

    fn pick_mix(rng: &mut Rng, mix: &[MixEntry]) -> MixEntry {
        let total: u64 = mix.iter().map(|m| u64::from(m.weight)).sum();
        let mut r = rng.below(total);
        for m in mix {
            if r < u64::from(m.weight) {
                return m.clone();
            }
            r -= u64::from(m.weight);
        }
        unreachable!("weights sum to total")
    }

    fn main_loop(&mut self, options: RunOptions) {
        let end = self
            .arrivals_end
            .plus_ns(self.scenario.drain_s * NANOS_PER_S);
        let mut processed = 0u64;
        while let Some(Reverse(Queued(at, _, ev))) = self.events.pop() {
            if at > end {
                break;
            }
            let arrivals_over = at >= self.arrivals_end;
            if arrivals_over && self.in_flight == 0 && !matches!(ev, Ev::Arrival { .. }) {
                self.now = at;
                break;
            }
            self.now = at;
            self.handle(ev);
            self.sched.maintain(self.now);
            self.pump();
            processed += 1;
            assert!(
                processed < EVENTS_MAX,
                "scenario exceeded EVENTS_MAX events"
            );
            if options.check_every > 0 && processed % options.check_every == 0 {
                self.sched.check_invariants();
            }
        }
    }

    fn handle(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Arrival { tenant } => {
                self.arrive(tenant as usize);
                if let Some(at) = self.next_arrival(tenant as usize, now) {
                    self.push(at, Ev::Arrival { tenant });
                }
            }
            Ev::SubmitAnswer {
                task,
                token,
                answer,
            } => self.on_answer(task, token, answer),
            Ev::Query { task, token, found } => {
                if found {
                    self.sched.accepted(task, token);
                    self.collector.on_accepted(&self.tasks[idx(task)]);
                } else {
                    self.release_provider(task);
                    let outcome = self.sched.not_found(now, task, token);
                    self.on_requeue(task, outcome);
                }
            }
            Ev::ProviderDone { task, token } => self.on_provider_done(task, token),
            Ev::MediaDone { task, token } => {
                self.sched.media_done(task, token);
                let t = &self.tasks[idx(task)];
                self.collector.release_media(t);
                self.collector.on_completed();
                self.in_flight -= 1;
            }
            Ev::Wake => {
                if self.next_wake == Some(now) {
                    self.next_wake = None;
                }
            }
            Ev::Sample => {
                self.collector.sample(now);
                let next = now.plus_ns(self.scenario.sample_ms.max(1) * NANOS_PER_MS);
                if next <= self.arrivals_end {
                    self.push(next, Ev::Sample);
                }
            }
        }
    }

    fn arrive(&mut self, i: usize) {
        let now = self.now;
        let group = &self.scenario.tenants[self.tenants[i].group];
        let t = &mut self.tenants[i];
        let m = Self::pick_mix(&mut t.rng, group.mix.get_ref());
        let user = UserId(t.id.0 * 1000 + t.rng.below(u64::from(t.users)) as u32);
        let spec = m.spec();
        let run_multiplier = 1.0;
        let task = TaskId(self.tasks.len() as u64 + 1);
        let req = SubmitRequest {
            task,
            tenant: t.id,
            user,
            spec,
            band_hint: m.band,
            deadline: None,
        };
        let admission = self.sched.submit(now, req);
        self.collector.on_decision(admission.decision);
        if !admission.decision.is_accepted() {
            return;
        }
        let estimate = admission.estimate;
        self.tasks.push(SimTask {
            tenant: i as u32,
            lane: admission.lane,
            estimate,
            submitted: now,
            first_dispatch: None,
            attempt_dispatched: now,
            token: FencingToken(0),
            provider: 0,
            mode: CapacityMode::Normal,
            run_multiplier,
            live_provider_jobs: 0,
        });
        self.in_flight += 1;
        self.collector
            .on_queued(&self.tasks[idx(task)], task, now, now);
    }

    /// Drains every dispatch and media start the scheduler has now, and books the next wake.
    fn pump(&mut self) {
        let now = self.now;
        let mut dispatches: Vec<Dispatch> = Vec::new();
        let mut expired = Vec::new();
        self.sched.dispatch_all(now, &mut dispatches, &mut expired);
        for task in expired {
            self.collector
                .on_dequeued(&self.tasks[idx(task)], task, now);
            self.in_flight -= 1;
        }
        for d in dispatches {
            self.start_attempt(d);
        }
        let mut media: Vec<MediaStart> = Vec::new();
        self.sched.media_all(now, &mut media);
        for m in media {
            let t = &self.tasks[idx(m.task)];
            self.collector.hold_media(t);
            let ms = (m.estimate.media_gpu_ms).max(1000);
            let token = t.token;
            self.push(
                now.plus_ns(ms * NANOS_PER_MS),
                Ev::MediaDone {
                    task: m.task,
                    token,
                },
            );
        }
        if let Some(wake) = self.sched.wake_at() {
            let wake = wake.max(now.plus_ns(NANOS_PER_MS));
            if self.next_wake.is_none_or(|w| wake < w) {
                self.next_wake = Some(wake);
                self.push(wake, Ev::Wake);
            }
        }
    }

    fn start_attempt(&mut self, d: Dispatch) {
        let now = self.now;
        self.next_token += 1;
        let token = FencingToken(self.next_token);
        self.sched.claim_granted(d.task, token);
        let t = &mut self.tasks[idx(d.task)];
        if t.first_dispatch.is_none() {
            t.first_dispatch = Some(now);
        }
        t.attempt_dispatched = now;
        t.token = token;
        t.provider = d.provider.0;
        t.mode = d.mode;
        self.collector
            .on_dequeued(&self.tasks[idx(d.task)], d.task, now);
        self.collector.hold_provider(&self.tasks[idx(d.task)], now);
        let p = &mut self.providers[d.provider.0 as usize];
        let latency = p.spec.submit_latency_ms * NANOS_PER_MS;
        let answer_at = now.plus_ns(latency / 2 + p.rng.below(latency.max(1)));
        let secs = now.as_nanos() / NANOS_PER_S;
        let storm: f64 = p
            .spec
            .storms
            .iter()
            .filter(|s| (s.start_s..s.end_s).contains(&secs))
            .map(|s| s.rate_limit_prob)
            .sum();
        let answer = if p.rng.chance(*p.spec.rate_limit_prob.get_ref() + storm) {
            Answer::RateLimited
        } else if p.rng.chance(*p.spec.timeout_prob.get_ref()) {
            Answer::Timeout {
                accepted: !p.rng.chance(*p.spec.lost_prob.get_ref()),
            }
        } else {
            Answer::Accepted
        };
        let multiplier = p.rng.lognormal(p.spec.latency_sigma);
        self.tasks[idx(d.task)].run_multiplier = multiplier;
        match answer {
            Answer::Timeout { accepted } => {
                let at = now.plus_ns(SUBMIT_TIMEOUT_NS);
                self.push(
                    at,
                    Ev::SubmitAnswer {
                        task: d.task,
                        token,
                        answer,
                    },
                );
                if accepted {
                    self.tasks[idx(d.task)].live_provider_jobs += 1;
                    let query_at = at.plus_ns(QUERY_DELAY_NS);
                    let done = answer_at
                        .plus_ns(self.run_ns(d.task))
                        .max(query_at.plus_ns(NANOS_PER_MS));
                    self.push(
                        done,
                        Ev::ProviderDone {
                            task: d.task,
                            token,
                        },
                    );
                }
            }
            _ => self.push(
                answer_at,
                Ev::SubmitAnswer {
                    task: d.task,
                    token,
                    answer,
                },
            ),
        }
    }

    fn run_ns(&self, task: TaskId) -> u64 {
        let t = &self.tasks[idx(task)];
        (t.estimate.provider_ms as f64 * t.run_multiplier * 1e6) as u64
    }

    fn on_answer(&mut self, task: TaskId, token: FencingToken, answer: Answer) {
        let now = self.now;
        match answer {
            Answer::Accepted => {
                let t = &mut self.tasks[idx(task)];
                t.live_provider_jobs += 1;
                if t.live_provider_jobs > 1 {
                    self.collector.duplicate_jobs += 1;
                }
                self.sched.accepted(task, token);
                self.collector.on_accepted(&self.tasks[idx(task)]);
                let done = now.plus_ns(self.run_ns(task));
                self.push(done, Ev::ProviderDone { task, token });
            }
            Answer::RateLimited => {
                self.collector.rate_limited += 1;
                self.collector.refund_cost(&self.tasks[idx(task)], now);
                self.release_provider(task);
                let jitter = self.providers[self.tasks[idx(task)].provider as usize]
                    .rng
                    .jitter_milli();
                let outcome = self
                    .sched
                    .failed(now, task, token, Failure::RateLimited, jitter);
                self.on_requeue(task, outcome);
            }
            Answer::Timeout { accepted } => {
                self.collector.timeouts += 1;
                self.sched.submit_unknown(task, token);
                let t = &self.tasks[idx(task)];
                if accepted && t.live_provider_jobs > 1 {
                    self.collector.duplicate_jobs += 1;
                }
                self.push(
                    now.plus_ns(QUERY_DELAY_NS),
                    Ev::Query {
                        task,
                        token,
                        found: accepted,
                    },
                );
            }
        }
    }

    fn on_provider_done(&mut self, task: TaskId, token: FencingToken) {
        let now = self.now;
        let t = &mut self.tasks[idx(task)];
        t.live_provider_jobs -= 1;
        let provider = t.provider as usize;
        let failure_prob = *self.providers[provider].spec.failure_prob.get_ref();
        let failed = self.providers[provider].rng.chance(failure_prob);
        self.release_provider(task);
        if failed {
            let jitter = self.providers[provider].rng.jitter_milli();
            let outcome = self
                .sched
                .failed(now, task, token, Failure::Retryable, jitter);
            self.on_requeue(task, outcome);
            return;
        }
        let t = &self.tasks[idx(task)];
        let actual = Units((t.estimate.fairness.milli() as f64 * t.run_multiplier) as u64);
        self.collector.on_succeeded(t, actual, now);
        self.sched.succeeded(now, task, token, actual);
        self.observe_debt(task);
    }

    /// Shows the collector the scheduler's fairness debt with `task`'s tenant now: after a
    /// run's correction, or an attempt's charge given back, the two things that move it away
    /// from zero (paying it only brings it back).
    fn observe_debt(&mut self, task: TaskId) {
        let t = &self.tasks[idx(task)];
        let debt = self
            .sched
            .fairness_debt(self.tenants[t.tenant as usize].id, t.lane);
        self.collector.on_debt(t, debt);
    }

    fn release_provider(&mut self, task: TaskId) {
        self.collector.release_provider(&self.tasks[idx(task)]);
    }

    fn on_requeue(&mut self, task: TaskId, outcome: FailOutcome) {
        self.observe_debt(task);
        match outcome {
            FailOutcome::Requeued { eligible_at } => {
                self.collector.on_queued(
                    &self.tasks[idx(task)],
                    task,
                    eligible_at.max(self.now),
                    self.now,
                );
            }
            FailOutcome::Failed | FailOutcome::Canceled => {
                self.collector.failed += 1;
                self.in_flight -= 1;
            }
        }
    }
}

pub(crate) fn idx(task: TaskId) -> usize {
    (task.0 - 1) as usize
}

/// Lanes whose work counts as high-cost, for the checker.
pub(crate) fn is_expensive(t: &SimTask) -> bool {
    t.estimate.class == ResourceClass::Expensive
}
