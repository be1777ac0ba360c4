//! Random event sequences (submits, dispatches, acceptances, completions, failures, 429s,
//! timeouts, cancels, stale writers, clock jumps) through one shard, with `check_invariants`
//! after every step. A failing case is shrunk and printed by proptest with its seed.

use std::collections::HashMap;

use proptest::prelude::*;
use spindle_core::presets;
use spindle_core::shard::{Failure, Poll, SubmitRequest};
use spindle_core::{
    Band, ClaimOutcome, FencingToken, Lane, ModelId, Shard, ShardError, TaskId, TaskSpec,
    TaskState, TenantId, Time, Units, UserId,
};

#[derive(Debug, Clone)]
enum Event {
    Submit {
        tenant: u32,
        user: u32,
        res: u8,
        /// Of the models the policy has now (more may be added).
        model: u8,
        dur_s: u32,
        band: Option<u8>,
        deadline_ms: Option<u64>,
    },
    Dispatch {
        max: u8,
        accept: bool,
    },
    Accept(usize),
    Timeout(usize),
    NotFound(usize),
    Fail(usize, u8),
    Succeed(usize, u32),
    Media,
    MediaDone(usize, bool),
    Cancel(usize),
    Stale(usize),
    Refuse(usize),
    Clock(u32),
    /// A newer policy version: reprice the model, change the STANDARD lane or a provider
    /// account, add an account or a model (served by the newest account), or suspend or
    /// resume a tenant.
    Policy(u8, u32),
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        4 => (1u32..6, 0u32..4, 0u8..3, any::<u8>(), 1u32..70, prop::option::of(0u8..5), prop::option::of(0u64..20_000))
            .prop_map(|(tenant, user, res, model, dur_s, band, deadline_ms)| Event::Submit {
                tenant, user: tenant * 10 + user, res, model, dur_s, band, deadline_ms
            }),
        3 => (1u8..8, any::<bool>()).prop_map(|(max, accept)| Event::Dispatch { max, accept }),
        1 => any::<usize>().prop_map(Event::Accept),
        1 => any::<usize>().prop_map(Event::Timeout),
        1 => any::<usize>().prop_map(Event::NotFound),
        2 => (any::<usize>(), 0u8..3).prop_map(|(i, k)| Event::Fail(i, k)),
        2 => (any::<usize>(), 0u32..40).prop_map(|(i, a)| Event::Succeed(i, a)),
        1 => Just(Event::Media),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(i, ok)| Event::MediaDone(i, ok)),
        1 => any::<usize>().prop_map(Event::Cancel),
        1 => any::<usize>().prop_map(Event::Stale),
        1 => any::<usize>().prop_map(Event::Refuse),
        2 => (0u32..120_000).prop_map(Event::Clock),
        1 => (0u8..7, 1u32..20).prop_map(|(k, v)| Event::Policy(k, v)),
    ]
}

struct World {
    shard: Shard,
    now: Time,
    next_task: u64,
    next_token: u64,
    /// Tasks with a live attempt and the token it was granted.
    tokens: HashMap<TaskId, FencingToken>,
    /// Tasks dispatched but whose claim the "control plane" has not answered yet.
    unclaimed: Vec<TaskId>,
    media: Vec<TaskId>,
    known: Vec<TaskId>,
}

fn pick<T: Copy>(items: &[T], i: usize) -> Option<T> {
    (!items.is_empty()).then(|| items[i % items.len()])
}

/// Errors the shard may legitimately answer to a random (possibly out-of-order) report.
fn expected_refusal(r: Result<impl std::fmt::Debug, ShardError>) {
    if let Err(e) = r {
        assert!(
            matches!(
                e,
                ShardError::UnknownTask(_)
                    | ShardError::StaleFencing { .. }
                    | ShardError::Transition { .. }
            ),
            "unexpected error {e:?}"
        );
    }
}

impl World {
    fn new() -> World {
        let mut policy = presets::with_tenants(presets::small_node(), 5);
        // Tight limits so every rejection and blocking path is reached.
        policy.lanes[Lane::Standard.index()].capacity = Units::whole(12);
        policy.lanes[Lane::BestEffort.index()].capacity = Units::whole(2);
        policy.node.high_cost_concurrency = 2;
        policy.lanes[Lane::Standard.index()].running_tasks_max = 4;
        policy.node.global_running_tasks_max = 7;
        policy.node.global_running_units_max = Units::whole(8);
        policy.node.model_running_units_max = Units::whole(9);
        policy.node.cpu_units = 6;
        policy.node.gpu_units = 1;
        // Estimates that move with what completions report (the estimate cache re-priced).
        policy.calibration.samples_min = 3;
        policy.providers[0].concurrency = 3;
        policy.providers[1].concurrency = 2;
        policy.providers[0].rpm = spindle_core::policy::RateSpec {
            per_minute: 20,
            burst: 4,
        };
        for (i, t) in policy.tenants.values_mut().enumerate() {
            t.queued_tasks_max = 6;
            t.running_tasks_max = 3;
            t.user.running_tasks_max = 2;
            t.cost_quota_milli = 3_000;
            t.lane = [
                Lane::Standard,
                Lane::PaidShared,
                Lane::EnterpriseReserved,
                Lane::BestEffort,
                Lane::Standard,
            ][i % 5];
            t.weight = 1 + i as u32;
        }
        World {
            shard: Shard::new(policy, 1, Time::ZERO),
            now: Time::ZERO,
            next_task: 0,
            next_token: 0,
            tokens: HashMap::new(),
            unclaimed: Vec::new(),
            media: Vec::new(),
            known: Vec::new(),
        }
    }

    /// Applies one policy change as the node does: the patch, then this (only) shard's share of
    /// every node limit set to the new capacity, never below what it uses (the share board's
    /// rule: a lowered capacity is paid back as work finishes).
    fn change_policy(&mut self, kind: u8, v: u32) {
        use spindle_core::policy::PolicyPatch;
        let policy = self.shard.policy();
        let mut lane = policy.lane(Lane::Standard).clone();
        let patch = match kind {
            0 => {
                let mut m = policy.models[0].clone();
                m.cost_milli_per_output_s = 100 * u64::from(v);
                m.provider_ms_per_output_s = 1_000 * u64::from(v);
                PolicyPatch::Model(m)
            }
            1 => {
                lane.open = v % 2 == 0;
                PolicyPatch::Lane(Lane::Standard, lane)
            }
            2 => {
                lane.capacity = Units::whole(u64::from(v));
                lane.running_tasks_max = u64::from(v / 4);
                lane.weight = v;
                PolicyPatch::Lane(Lane::Standard, lane)
            }
            4 if policy.providers.len() < 5 => {
                let mut p = policy.providers[0].clone();
                p.id = spindle_core::ProviderId(policy.providers.len() as u16);
                p.name = format!("added-account-{}", p.id.0);
                p.concurrency = u64::from(v / 3);
                PolicyPatch::Provider(p)
            }
            6 => {
                let tenant = TenantId(1 + v % 5);
                let mut t = policy.tenants[&tenant].clone();
                t.suspended = v % 2 == 0;
                PolicyPatch::Tenant(tenant, t)
            }
            5 if policy.models.len() < 4 => {
                let mut m = policy.models[0].clone();
                m.id = ModelId(policy.models.len() as u16);
                m.name = format!("added-model-{}", m.id.0);
                m.providers = vec![spindle_core::ProviderId(policy.providers.len() as u16 - 1)];
                PolicyPatch::Model(m)
            }
            _ => {
                let mut p = policy.providers[v as usize % policy.providers.len()].clone();
                p.concurrency = u64::from(v / 3);
                PolicyPatch::Provider(p)
            }
        };
        self.shard.apply_patch(patch, self.now).unwrap();
        for (id, capacity) in self.shard.node_limits() {
            let used = self.shard.ledger().used(id);
            let share = match capacity {
                spindle_core::shard::NodeCapacity::Slots(v) => {
                    spindle_core::shard::NodeCapacity::Slots(v.max(used))
                }
                rate => rate,
            };
            self.shard.set_share(id, share, self.now);
        }
    }

    fn token(&self, task: TaskId) -> FencingToken {
        self.tokens.get(&task).copied().unwrap_or(FencingToken(0))
    }

    fn apply(&mut self, event: &Event) {
        let now = self.now;
        match *event {
            Event::Submit {
                tenant,
                user,
                res,
                model,
                dur_s,
                band,
                deadline_ms,
            } => {
                self.next_task += 1;
                let task = TaskId(self.next_task);
                let (width, height) = [(1280, 720), (1920, 1080), (3840, 2160)][res as usize];
                let models = self.shard.policy().models.len();
                let spec = TaskSpec {
                    model: ModelId((usize::from(model) % models) as u16),
                    width,
                    height,
                    duration_ms: dur_s * 1000,
                    fps: 24,
                    audio: false,
                    references: 0,
                };
                let req = SubmitRequest {
                    task,
                    tenant: TenantId(tenant),
                    user: UserId(user),
                    spec,
                    band_hint: band.map(|b| Band::from_index(b as usize)),
                    deadline: deadline_ms.map(|ms| now.plus_ns(ms * 1_000_000)),
                };
                let admission = self
                    .shard
                    .handle_submit(now, req)
                    .expect("valid submits decide");
                if self.shard.policy().tenants[&TenantId(tenant)].suspended {
                    assert!(
                        !admission.decision.is_accepted(),
                        "a suspended tenant admitted"
                    );
                }
                if admission.decision.is_accepted() {
                    assert_eq!(self.shard.task_state(task), Some(TaskState::Queued));
                    assert!(admission.band >= Band::P1, "a client never reaches P0");
                    self.known.push(task);
                } else {
                    assert_eq!(
                        self.shard.task_state(task),
                        None,
                        "a rejected task leaves no trace"
                    );
                }
            }
            Event::Dispatch { max, accept } => {
                for _ in 0..max {
                    match self.shard.poll_dispatch(now) {
                        Poll::Dispatch(d) => {
                            assert_eq!(self.shard.task_state(d.task), Some(TaskState::Dispatching));
                            assert!(
                                !self.shard.policy().tenants[&d.tenant].suspended,
                                "a suspended tenant's task started"
                            );
                            if accept {
                                self.next_token += 1;
                                let token = FencingToken(self.next_token);
                                self.tokens.insert(d.task, token);
                                if self.shard.handle_claim_granted(d.task, token).unwrap()
                                    == ClaimOutcome::Submit
                                {
                                    self.shard.handle_provider_accepted(d.task, token).unwrap();
                                }
                            } else {
                                self.unclaimed.push(d.task);
                            }
                        }
                        Poll::Expired(t) => assert_eq!(self.shard.task_state(t), None),
                        Poll::Yield => {}
                        Poll::Idle => break,
                    }
                }
            }
            Event::Accept(i) => {
                if let Some(task) = pick(&self.unclaimed, i) {
                    self.unclaimed.retain(|&t| t != task);
                    self.next_token += 1;
                    let token = FencingToken(self.next_token);
                    self.tokens.insert(task, token);
                    expected_refusal(self.shard.handle_claim_granted(task, token));
                }
            }
            Event::Refuse(i) => {
                if let Some(task) = pick(&self.unclaimed, i) {
                    self.unclaimed.retain(|&t| t != task);
                    expected_refusal(self.shard.handle_claim_refused(now, task));
                }
            }
            Event::Timeout(i) => {
                if let Some(task) = pick(&self.known, i) {
                    expected_refusal(self.shard.handle_submit_unknown(task, self.token(task)));
                }
            }
            Event::NotFound(i) => {
                if let Some(task) = pick(&self.known, i) {
                    expected_refusal(self.shard.handle_provider_not_found(
                        now,
                        task,
                        self.token(task),
                    ));
                }
            }
            Event::Fail(i, kind) => {
                if let Some(task) = pick(&self.known, i) {
                    let failure = [
                        Failure::RateLimited,
                        Failure::Retryable,
                        Failure::NonRetryable,
                    ][kind as usize];
                    let jitter = 700 + (i % 601) as u64;
                    expected_refusal(self.shard.handle_provider_failed(
                        now,
                        task,
                        self.token(task),
                        failure,
                        jitter,
                    ));
                }
            }
            Event::Succeed(i, actual) => {
                if let Some(task) = pick(&self.known, i) {
                    let r = self.shard.handle_provider_succeeded(
                        now,
                        task,
                        self.token(task),
                        Units::whole(actual.into()),
                    );
                    expected_refusal(r);
                }
            }
            Event::Media => {
                if let Some(m) = self.shard.poll_media(now) {
                    assert_eq!(
                        self.shard.task_state(m.task),
                        Some(TaskState::MediaProcessing)
                    );
                    self.media.push(m.task);
                }
            }
            Event::MediaDone(i, ok) => {
                if let Some(task) = pick(&self.media, i) {
                    self.media.retain(|&t| t != task);
                    expected_refusal(self.shard.handle_media_done(task, self.token(task), ok));
                }
            }
            Event::Cancel(i) => {
                if let Some(task) = pick(&self.known, i) {
                    expected_refusal(self.shard.handle_cancel(task));
                }
            }
            Event::Stale(i) => {
                if let Some(task) = pick(&self.known, i) {
                    let before = self.shard.task_state(task);
                    let stale = FencingToken(0);
                    let r = self
                        .shard
                        .handle_provider_succeeded(now, task, stale, Units(1));
                    assert!(r.is_err(), "a stale token must be refused");
                    assert_eq!(
                        self.shard.task_state(task),
                        before,
                        "a stale writer changed the task"
                    );
                }
            }
            Event::Clock(ms) => self.now = self.now.plus_ns(u64::from(ms) * 1_000_000),
            Event::Policy(kind, v) => self.change_policy(kind, v),
        }
        self.known.retain(|&t| self.shard.task_state(t).is_some());
        self.shard.check_invariants();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_under_random_events(events in prop::collection::vec(event(), 1..300)) {
        let mut world = World::new();
        for event in &events {
            world.apply(event);
        }
    }
}
