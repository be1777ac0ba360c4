//! Shared set-up for the benches and the memory measurement: a shard with many tenants and a
//! deep backlog, driven through the same calls the node makes.

use spindle_core::presets::{self, UNLIMITED_RATE};
use spindle_core::shard::{Poll, SubmitRequest};
use spindle_core::{
    ClaimOutcome, FencingToken, Lane, ModelId, Policy, Shard, TaskId, TaskSpec, TenantId, Time,
    Units, UserId,
};

/// A policy with `tenants` STANDARD tenants and limits that never bind, so benches measure the
/// scheduling path, not rejections.
pub fn policy(tenants: u32) -> Policy {
    let mut policy = presets::with_tenants(presets::small_node(), tenants);
    policy.lanes[Lane::Standard.index()].capacity = Units::whole(1 << 30);
    policy.reserve.borrow_limit = Units::ZERO;
    presets::lift_node_limits(&mut policy);
    for p in &mut policy.providers {
        p.concurrency = presets::UNBOUNDED;
        p.rpm = UNLIMITED_RATE;
    }
    policy
}

pub fn spec() -> TaskSpec {
    TaskSpec::clip_720p(ModelId(0))
}

/// How far the clock moves per admission or pick.
pub const CLOCK_STEP_NS: u64 = 500;

/// A shard and a task counter, with `queued` tasks spread round-robin over `tenants`.
pub struct Loaded {
    pub shard: Shard,
    pub tenants: u32,
    pub next_task: u64,
    pub next_tenant: u32,
    /// Every tenant submits as its user 1 (a platform whose tenants each have one user, or
    /// number their users from 1), not as a user id of its own.
    pub one_user_id: bool,
    /// The shard's clock: 500 ns on at every admission and pick, as a node's clock moves between
    /// calls, so that bucket refills and rate windows run as they do there (with a clock that
    /// stood still — the benches before 2026-12-02 — every refill returned at once).
    pub now: Time,
}

impl Loaded {
    pub fn new(tenants: u32, queued: u64) -> Loaded {
        Loaded::with(policy(tenants), tenants, queued)
    }

    /// `new` with another policy (of `tenants` tenants numbered from 1).
    pub fn with(policy: Policy, tenants: u32, queued: u64) -> Loaded {
        let mut loaded = Loaded {
            shard: Shard::new(policy, 1, Time::ZERO),
            tenants,
            next_task: 0,
            next_tenant: 0,
            one_user_id: false,
            now: Time::ZERO,
        };
        for _ in 0..queued {
            loaded.admit();
        }
        loaded
    }

    /// `new` with every tenant submitting as its user 1 ([`Loaded::one_user_id`]).
    pub fn one_user_id(tenants: u32, queued: u64) -> Loaded {
        let mut loaded = Loaded::new(tenants, 0);
        loaded.one_user_id = true;
        for _ in 0..queued {
            loaded.admit();
        }
        loaded
    }

    /// Submits one task for the next tenant in turn; panics if it is not accepted.
    pub fn admit(&mut self) -> TaskId {
        self.next_task += 1;
        self.next_tenant = self.next_tenant % self.tenants + 1;
        let task = TaskId(self.next_task);
        let req = SubmitRequest {
            task,
            tenant: TenantId(self.next_tenant),
            user: UserId(if self.one_user_id {
                1
            } else {
                self.next_tenant
            }),
            spec: spec(),
            band_hint: None,
            deadline: None,
        };
        self.now = self.now.plus_ns(CLOCK_STEP_NS);
        let admission = self.shard.handle_submit(self.now, req).expect("valid");
        assert!(admission.decision.is_accepted(), "{admission:?}");
        task
    }

    /// Picks the next task to run: the scheduling decision, up to DISPATCHING with every
    /// reservation held.
    pub fn pick(&mut self) -> TaskId {
        loop {
            self.now = self.now.plus_ns(CLOCK_STEP_NS);
            match self.shard.poll_dispatch(self.now) {
                Poll::Dispatch(d) => return d.task,
                Poll::Yield => continue,
                other => panic!("a loaded shard has work: {other:?}"),
            }
        }
    }

    /// Runs a picked task to the end: claim granted, provider accepted and succeeded, media done.
    pub fn complete(&mut self, task: TaskId) {
        let token = FencingToken(task.0);
        let outcome = self.shard.handle_claim_granted(task, token).expect("claim");
        assert_eq!(outcome, ClaimOutcome::Submit);
        self.shard
            .handle_provider_accepted(task, token)
            .expect("accept");
        self.shard
            .handle_provider_succeeded(self.now, task, token, Units::whole(1))
            .expect("succeeded");
        let media = self
            .shard
            .poll_media(self.now)
            .expect("media slots are unlimited");
        self.shard
            .handle_media_done(media.task, token, true)
            .expect("media done");
    }
}
