//! A model whose tasks really cost twice the matrix's price: once the shard has seen enough of
//! them, new tasks are priced — and their budgets reserved — at what such tasks cost, tasks
//! admitted before keep their estimate, and a repriced model starts over.

use spindle_core::policy::PolicyPatch;
use spindle_core::presets;
use spindle_core::shard::{Poll, SubmitRequest};
use spindle_core::{
    Admission, ClaimOutcome, FencingToken, ModelId, Shard, TaskId, TaskSpec, TenantId, Time, Units,
    UserId,
};

fn submit(shard: &mut Shard, task: u64) -> Admission {
    let admission = shard
        .handle_submit(
            Time::ZERO,
            SubmitRequest {
                task: TaskId(task),
                tenant: TenantId(1),
                user: UserId(1),
                spec: TaskSpec::clip_720p(ModelId(0)),
                band_hint: None,
                deadline: None,
            },
        )
        .unwrap();
    assert!(admission.decision.is_accepted(), "{admission:?}");
    admission
}

/// Runs `task` to the provider's end, reporting `times` its estimated fairness cost (what the
/// node reports for a provider that charged `times` the estimated cost).
fn complete(shard: &mut Shard, task: u64, times: u64) {
    let Poll::Dispatch(d) = shard.poll_dispatch(Time::ZERO) else {
        panic!("task {task} not dispatched");
    };
    assert_eq!(d.task, TaskId(task));
    let token = FencingToken(task);
    assert_eq!(
        shard.handle_claim_granted(d.task, token).unwrap(),
        ClaimOutcome::Submit
    );
    shard.handle_provider_accepted(d.task, token).unwrap();
    let actual = Units(d.estimate.fairness.milli() * times);
    shard
        .handle_provider_succeeded(Time::ZERO, d.task, token, actual)
        .unwrap();
    shard.check_invariants();
}

#[test]
fn estimates_follow_what_a_models_tasks_really_cost() {
    let mut policy = presets::with_tenants(presets::small_node(), 1);
    policy.calibration.samples_min = 4;
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    let base = submit(&mut shard, 1).estimate;
    complete(&mut shard, 1, 2);
    // Admitted before enough were seen: the matrix's price.
    let early = submit(&mut shard, 2).estimate;
    assert_eq!(early.cost_milli, base.cost_milli);
    for task in 2..=4 {
        if task > 2 {
            submit(&mut shard, task);
        }
        complete(&mut shard, task, 2);
    }
    assert_eq!(shard.cost_factor(ModelId(0)), 2_000);
    let calibrated = submit(&mut shard, 5).estimate;
    assert_eq!(calibrated.cost_milli, 2 * base.cost_milli);
    assert_eq!(
        shard.price(&TaskSpec::clip_720p(ModelId(0))).unwrap(),
        calibrated
    );
    // Completions at the calibrated price that cost what it says keep it there.
    complete(&mut shard, 5, 1);
    assert_eq!(shard.cost_factor(ModelId(0)), 2_000);
    shard.check_invariants();

    // A repriced model starts over from its new row.
    let mut model = shard.policy().models[0].clone();
    model.cost_milli_per_output_s *= 3;
    shard
        .apply_patch(PolicyPatch::Model(model), Time::ZERO)
        .unwrap();
    assert_eq!(shard.cost_factor(ModelId(0)), 1_000);
    assert_eq!(
        submit(&mut shard, 6).estimate.cost_milli,
        3 * base.cost_milli
    );
}

#[test]
fn calibration_is_off_unless_the_policy_asks_for_it() {
    let mut shard = Shard::new(
        presets::with_tenants(presets::small_node(), 1),
        1,
        Time::ZERO,
    );
    let base = submit(&mut shard, 1).estimate;
    complete(&mut shard, 1, 3);
    for task in 2..=70 {
        submit(&mut shard, task);
        complete(&mut shard, task, 3);
    }
    assert_eq!(shard.cost_factor(ModelId(0)), 1_000);
    assert_eq!(submit(&mut shard, 71).estimate, base);
}
