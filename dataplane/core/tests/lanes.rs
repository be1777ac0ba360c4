//! The expensive lane isolated: a cost budget and media workers of its own, which no other lane
//! draws on and which it does not go past, both ways. Every step is followed by
//! `check_invariants`.

use spindle_core::policy::{PolicyPatch, RateSpec};
use spindle_core::shard::{Poll, SubmitRequest};
use spindle_core::{
    presets, FencingToken, Lane, ModelId, Policy, Shard, TaskId, TaskSpec, TenantId, Time, Units,
    UserId,
};

/// A standard clip (720p, 5 s) and an expensive one (the same with audio).
const STANDARD: TaskSpec = TaskSpec::clip_720p(ModelId(0));
const EXPENSIVE: TaskSpec = TaskSpec {
    audio: true,
    ..TaskSpec::clip_720p(ModelId(0))
};

fn cost_of(policy: &Policy, spec: &TaskSpec) -> u64 {
    spindle_core::cost::estimate(spec, &policy.models[0], &policy.cost_bases)
        .unwrap()
        .cost_milli
}

/// Submits `spec` as `task` of tenant 1.
fn try_submit(shard: &mut Shard, task: u64, spec: TaskSpec) -> spindle_core::Admission {
    let request = SubmitRequest {
        task: TaskId(task),
        tenant: TenantId(1),
        user: UserId(1),
        spec,
        band_hint: None,
        deadline: None,
    };
    shard.handle_submit(Time::ZERO, request).unwrap()
}

/// Submits `spec` as `task` of tenant 1; it must be accepted into `lane`.
fn submit(shard: &mut Shard, task: u64, spec: TaskSpec, lane: Lane) {
    let a = try_submit(shard, task, spec);
    assert!(a.decision.is_accepted(), "{a:?}");
    assert_eq!(a.lane, lane);
    shard.check_invariants();
}

/// Every task the shard starts now, claimed and accepted at the provider (token = task id),
/// with its lane.
fn start_all(shard: &mut Shard, now: Time) -> Vec<(TaskId, Lane)> {
    let mut started = Vec::new();
    loop {
        match shard.poll_dispatch(now) {
            Poll::Dispatch(d) => {
                let token = FencingToken(d.task.0);
                shard.handle_claim_granted(d.task, token).unwrap();
                shard.handle_provider_accepted(d.task, token).unwrap();
                started.push((d.task, d.lane));
            }
            Poll::Yield => continue,
            Poll::Idle => break,
            Poll::Expired(t) => panic!("{t} expired"),
        }
        shard.check_invariants();
    }
    started
}

fn count(started: &[(TaskId, Lane)], lane: Lane) -> usize {
    started.iter().filter(|(_, l)| *l == lane).count()
}

fn one_tenant() -> Policy {
    let mut policy = presets::with_tenants(presets::small_node(), 1);
    policy.reserve.borrow_limit = Units::ZERO;
    policy
}

/// The platform may start two expensive tasks' cost and one standard task's at once; the
/// expensive lane has the first as its own budget. Three standard tasks submitted before three
/// expensive ones: one standard starts (the shared rest holds the other two) and two expensive
/// ones (their budget is theirs whatever the standard lanes spent). With one platform budget
/// for every lane (no `cost_per_minute` of the lane's own), the standard tasks, picked first,
/// take the expensive lane's part and this fails.
#[test]
fn the_expensive_lanes_own_budget_holds_its_work_and_is_never_taken() {
    let mut policy = one_tenant();
    let (std_cost, exp_cost) = (cost_of(&policy, &STANDARD), cost_of(&policy, &EXPENSIVE));
    assert!(exp_cost > std_cost, "{exp_cost} vs {std_cost}");
    let own = RateSpec {
        per_minute: 20 * exp_cost,
        burst: 2 * exp_cost,
    };
    policy.lanes[Lane::Expensive.index()].cost_per_minute = Some(own);
    policy.node.platform_cost_per_minute = RateSpec {
        per_minute: own.per_minute + 10 * std_cost,
        burst: own.burst + std_cost,
    };
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    for t in 1..=3 {
        submit(&mut shard, t, STANDARD, Lane::Standard);
    }
    for t in 4..=6 {
        submit(&mut shard, t, EXPENSIVE, Lane::Expensive);
    }
    let started = start_all(&mut shard, Time::ZERO);
    assert_eq!(
        (
            count(&started, Lane::Standard),
            count(&started, Lane::Expensive)
        ),
        (1, 2),
        "{started:?}"
    );
    // Held, not dropped: a tenth of a minute later each budget gave back about one task's cost.
    let later = start_all(&mut shard, Time::from_ms(6_100));
    assert_eq!(
        (
            count(&later, Lane::Standard),
            count(&later, Lane::Expensive)
        ),
        (1, 1),
        "{later:?}"
    );
}

/// The node runs three media jobs at once, one of them on the expensive lane's own worker.
/// Two expensive and three standard tasks end their provider stage together: one expensive and
/// two standard media jobs start. The second expensive job waits for its lane's worker even
/// when the standard ones end, and the third standard one for the shared workers even while
/// the expensive worker is free. With the lane's workers shared (no `media_workers` of its
/// own), three jobs of any lanes start at once and this fails. Each line is strictly FIFO here
/// (no fit-scan past its head): with one line for every lane, the third standard job, waiting
/// at its head, would hold up the first expensive one, and this fails too.
#[test]
fn the_expensive_lanes_media_workers_are_its_own_both_ways() {
    let mut policy = one_tenant();
    policy.aging.skips_max = 0;
    policy.node.media_workers = 3;
    policy.lanes[Lane::Expensive.index()].media_workers = Some(1);
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    for t in 1..=3 {
        submit(&mut shard, t, STANDARD, Lane::Standard);
    }
    for t in 4..=5 {
        submit(&mut shard, t, EXPENSIVE, Lane::Expensive);
    }
    let started = start_all(&mut shard, Time::ZERO);
    assert_eq!(started.len(), 5, "{started:?}");
    let now = Time::from_ms(1_000);
    for &(task, _) in &started {
        shard
            .handle_provider_succeeded(now, task, FencingToken(task.0), Units::whole(1))
            .unwrap();
        shard.check_invariants();
    }
    let media = |shard: &mut Shard| {
        let mut tasks = Vec::new();
        while let Some(m) = shard.poll_media(now) {
            tasks.push(m.task.0);
            shard.check_invariants();
        }
        tasks.sort_unstable();
        tasks
    };
    let done = |shard: &mut Shard, task: u64| {
        shard
            .handle_media_done(TaskId(task), FencingToken(task), true)
            .unwrap();
        shard.check_invariants();
    };
    assert_eq!(media(&mut shard), [1, 2, 4]);
    // The standard jobs end: the third standard one starts, not the second expensive one.
    done(&mut shard, 1);
    done(&mut shard, 2);
    assert_eq!(media(&mut shard), [3]);
    // The expensive job ends: the lane's own worker takes the next expensive job.
    done(&mut shard, 4);
    assert_eq!(media(&mut shard), [5]);
}

/// Budgets and workers of a lane's own must fit in the node's and leave some for the lanes
/// that share the rest, and cannot appear or go live; each refusal names the field.
#[test]
fn a_lanes_own_budget_or_workers_past_the_nodes_or_switched_live_is_refused_by_name() {
    let mut policy = one_tenant();
    policy.node.platform_cost_per_minute = RateSpec {
        per_minute: 1_000,
        burst: 100,
    };
    policy.lanes[Lane::Expensive.index()].cost_per_minute = Some(RateSpec {
        per_minute: 1_000,
        burst: 100,
    });
    let err = policy.validate().unwrap_err().to_string();
    assert!(
        err.contains("lanes.*.cost_per_minute.per_minute") && err.contains("1000"),
        "{err}"
    );
    policy.lanes[Lane::Expensive.index()].cost_per_minute = Some(RateSpec {
        per_minute: 600,
        burst: 60,
    });
    policy.validate().unwrap();
    policy.node.media_workers = 2;
    policy.lanes[Lane::Expensive.index()].media_workers = Some(2);
    let err = policy.validate().unwrap_err().to_string();
    assert!(err.contains("lanes.*.media_workers"), "{err}");
    policy.lanes[Lane::Expensive.index()].media_workers = Some(1);
    policy.validate().unwrap();

    // Live: the budget's value may change; the budget may not go, nor another lane's appear.
    let mut lane = policy.lane(Lane::Expensive).clone();
    lane.cost_per_minute = Some(RateSpec {
        per_minute: 900,
        burst: 90,
    });
    policy
        .check(&PolicyPatch::Lane(Lane::Expensive, lane.clone()))
        .unwrap();
    lane.cost_per_minute = Some(RateSpec {
        per_minute: 1_000,
        burst: 90,
    });
    let err = policy
        .check(&PolicyPatch::Lane(Lane::Expensive, lane.clone()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("lanes.*.cost_per_minute.per_minute"), "{err}");
    lane.cost_per_minute = None;
    let err = policy
        .check(&PolicyPatch::Lane(Lane::Expensive, lane))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lane EXPENSIVE") && err.contains("not appear or go"),
        "{err}"
    );
    let mut standard = policy.lane(Lane::Standard).clone();
    standard.media_workers = Some(1);
    let err = policy
        .check(&PolicyPatch::Lane(Lane::Standard, standard))
        .unwrap_err()
        .to_string();
    assert!(err.contains("lane STANDARD"), "{err}");
}

/// A task that costs more than its lane's budget can ever let start at once is refused at
/// admission, naming the budget, instead of waiting forever; the standard lane, sharing the
/// platform's rest, takes its own tasks. Without the check the expensive task is accepted and
/// never starts, and this fails.
#[test]
fn a_task_costing_more_than_its_lanes_budget_lets_start_at_once_is_refused_by_name() {
    let mut policy = one_tenant();
    let exp_cost = cost_of(&policy, &EXPENSIVE);
    policy.lanes[Lane::Expensive.index()].cost_per_minute = Some(RateSpec {
        per_minute: 100 * exp_cost,
        burst: exp_cost - 1,
    });
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    submit(&mut shard, 1, STANDARD, Lane::Standard);
    let a = try_submit(&mut shard, 2, EXPENSIVE);
    assert_eq!(
        a.decision,
        spindle_core::Decision::RejectCostBudget,
        "{a:?}"
    );
    let reason = a.reason.unwrap().to_string();
    assert!(
        reason.contains("lane:EXPENSIVE:cost_per_minute") && reason.contains("never start"),
        "{reason}"
    );
    shard.check_invariants();
}
