//! A tenant's policy changed while it has work: new limits apply to new submits at once, the
//! DRR weight moves with it, and the shard's bookkeeping stays consistent.

use spindle_core::presets;
use spindle_core::shard::SubmitRequest;
use spindle_core::{Decision, Lane, ModelId, Shard, TaskId, TaskSpec, TenantId, Time, UserId};

fn submit(shard: &mut Shard, task: u64, tenant: u32) -> Decision {
    shard
        .handle_submit(
            Time::ZERO,
            SubmitRequest {
                task: TaskId(task),
                tenant: TenantId(tenant),
                user: UserId(tenant),
                spec: TaskSpec::clip_720p(ModelId(0)),
                band_hint: None,
                deadline: None,
            },
        )
        .unwrap()
        .decision
}

#[test]
fn a_changed_tenant_policy_applies_to_new_work_and_keeps_the_books() {
    let mut policy = presets::with_tenants(presets::small_node(), 2);
    policy.lanes[Lane::Standard.index()].capacity = spindle_core::Units::whole(1);
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    for i in 0..6 {
        assert!(submit(&mut shard, i, 1).is_accepted());
    }
    assert!(submit(&mut shard, 100, 2).is_accepted());
    shard.check_invariants();
    let before = shard.backlog_weight(Lane::Standard);

    // Tenant 1: weight 1 → 5, and at most 6 queued tasks from now on.
    let mut changed = presets::tenant(Lane::Standard, 5);
    changed.queued_tasks_max = 6;
    shard.set_tenant_policy(TenantId(1), changed, Time::ZERO);
    shard.check_invariants();
    assert_eq!(shard.backlog_weight(Lane::Standard), before + 4);
    assert_eq!(
        submit(&mut shard, 7, 1),
        Decision::RejectTenantQueueFull,
        "the new queue cap holds for the next submit"
    );
    assert!(
        submit(&mut shard, 101, 2).is_accepted(),
        "other tenants are untouched"
    );

    // Back to a roomy policy: accepted again.
    shard.set_tenant_policy(TenantId(1), presets::tenant(Lane::Standard, 1), Time::ZERO);
    shard.check_invariants();
    assert_eq!(shard.backlog_weight(Lane::Standard), before);
    assert!(submit(&mut shard, 8, 1).is_accepted());
}

fn admit(shard: &mut Shard, task: u64, tenant: u32) -> spindle_core::Admission {
    shard
        .handle_submit(
            Time::ZERO,
            SubmitRequest {
                task: TaskId(task),
                tenant: TenantId(tenant),
                user: UserId(tenant),
                spec: TaskSpec::clip_720p(ModelId(0)),
                band_hint: None,
                deadline: None,
            },
        )
        .unwrap()
}

#[test]
fn a_closed_lane_refuses_new_work_and_keeps_what_it_queued() {
    use spindle_core::policy::PolicyPatch;
    let policy = presets::with_tenants(presets::small_node(), 2);
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    assert!(submit(&mut shard, 1, 1).is_accepted());
    let mut lane = shard.policy().lane(Lane::Standard).clone();
    lane.open = false;
    shard
        .apply_patch(PolicyPatch::Lane(Lane::Standard, lane.clone()), Time::ZERO)
        .unwrap();
    shard.check_invariants();
    let refused = admit(&mut shard, 2, 2);
    assert_eq!(refused.decision, Decision::RejectResourceClassDisabled);
    assert_eq!(
        refused.reason.map(|r| r.to_string()).as_deref(),
        Some("lane STANDARD is closed to new work")
    );
    assert_eq!(shard.queued_tasks(Lane::Standard), 1, "queued work stays");

    // A refused patch changes nothing; reopening admits again.
    lane.weight = 0;
    assert!(shard
        .apply_patch(PolicyPatch::Lane(Lane::Standard, lane.clone()), Time::ZERO)
        .is_err());
    assert!(!shard.policy().lane(Lane::Standard).open);
    lane.weight = 2;
    lane.open = true;
    shard
        .apply_patch(PolicyPatch::Lane(Lane::Standard, lane), Time::ZERO)
        .unwrap();
    assert!(submit(&mut shard, 3, 2).is_accepted());
    shard.check_invariants();
}

#[test]
fn a_repriced_model_prices_new_tasks_and_admitted_ones_keep_their_estimate() {
    use spindle_core::policy::PolicyPatch;
    let policy = presets::with_tenants(presets::small_node(), 1);
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    let old = admit(&mut shard, 1, 1).estimate;
    let mut model = shard.policy().models[0].clone();
    model.cost_milli_per_output_s *= 3;
    shard
        .apply_patch(PolicyPatch::Model(model), Time::ZERO)
        .unwrap();
    shard.check_invariants();
    let new = admit(&mut shard, 2, 1).estimate;
    assert_eq!(
        new.cost_milli,
        old.cost_milli * 3,
        "the same spec, repriced"
    );
    // The same spec again shares the new entry; the old task still holds the old one.
    assert_eq!(admit(&mut shard, 3, 1).estimate, new);
    shard.check_invariants();
    // Freeing the old entry leaves the new one indexed: a fourth task still gets the new price.
    shard.handle_cancel(TaskId(1)).unwrap();
    shard.check_invariants();
    assert_eq!(admit(&mut shard, 4, 1).estimate, new);
    shard.check_invariants();
}

#[test]
fn a_shard_whose_only_waiters_want_media_slots_asks_for_them() {
    use spindle_core::ledger::LimitKey;
    use spindle_core::shard::Poll;
    let policy = presets::with_tenants(presets::small_node(), 1);
    let mut shard = Shard::new(policy, 2, Time::ZERO);
    let cpu = shard
        .node_limits()
        .into_iter()
        .map(|(id, _)| id)
        .find(|&id| shard.ledger().key(id) == LimitKey::CpuUnits)
        .unwrap();
    assert!(submit(&mut shard, 1, 1).is_accepted());
    let Poll::Dispatch(d) = shard.poll_dispatch(Time::ZERO) else {
        panic!("nothing dispatched")
    };
    let token = spindle_core::FencingToken(1);
    shard.handle_claim_granted(d.task, token).unwrap();
    shard.handle_provider_accepted(d.task, token).unwrap();
    assert_eq!(shard.split_weight(cpu), 0, "nobody waits for media yet");
    // Its media stage needs more CPU than this shard's even half of the node's: it waits, and
    // the split must hear that (the lanes' backlog is empty now).
    shard
        .handle_provider_succeeded(Time::ZERO, d.task, token, spindle_core::Units::whole(1))
        .unwrap();
    shard.set_share(cpu, spindle_core::shard::NodeCapacity::Slots(0), Time::ZERO);
    assert!(shard.poll_media(Time::ZERO).is_none());
    assert_eq!(shard.backlog_weight(Lane::Standard), 0);
    assert_eq!(shard.split_weight(cpu), 1);
    shard.check_invariants();
}

/// A provider account and a model added to a running policy: tasks of the new model are
/// admitted and dispatched to the new account, never past its concurrency. On a shard of a
/// node with several shards the new limits start with no share (the shell's split hands parts
/// out): nothing is dispatched there until it gets one.
#[test]
fn a_provider_and_a_model_added_at_run_time_take_work_within_their_limits() {
    use spindle_core::policy::PolicyPatch;
    use spindle_core::shard::{NodeCapacity, Poll};
    use spindle_core::ProviderId;
    for shards in [1, 2] {
        let policy = presets::with_tenants(presets::small_node(), 1);
        let mut shard = Shard::new(policy, shards, Time::ZERO);
        let limits_before = shard.node_limits().len();
        let mut account = shard.policy().providers[0].clone();
        account.id = ProviderId(shard.policy().providers.len() as u16);
        account.name = "vendor-9:acct-1:us:video-model-9".into();
        account.concurrency = 2;
        let mut model = shard.policy().models[0].clone();
        model.id = ModelId(shard.policy().models.len() as u16);
        model.name = "video-model-9".into();
        model.providers = vec![account.id];
        shard
            .apply_patch(PolicyPatch::Provider(account.clone()), Time::ZERO)
            .unwrap();
        shard
            .apply_patch(PolicyPatch::Model(model.clone()), Time::ZERO)
            .unwrap();
        shard.check_invariants();
        let added = shard.node_limits();
        assert_eq!(
            added.len(),
            limits_before + 4,
            "concurrency, RPM, two model limits"
        );
        for t in 0..5 {
            let a = shard
                .handle_submit(
                    Time::ZERO,
                    SubmitRequest {
                        task: TaskId(t),
                        tenant: TenantId(1),
                        user: UserId(1),
                        spec: TaskSpec::clip_720p(model.id),
                        band_hint: None,
                        deadline: None,
                    },
                )
                .unwrap();
            assert!(a.decision.is_accepted(), "{a:?}");
        }
        let drain = |shard: &mut Shard, now: Time| {
            let mut to = Vec::new();
            loop {
                match shard.poll_dispatch(now) {
                    Poll::Dispatch(d) => to.push(d.provider),
                    Poll::Yield => {}
                    _ => return to,
                }
            }
        };
        let later = Time::ZERO.plus_ns(1_000_000_000);
        if shards > 1 {
            assert!(drain(&mut shard, later).is_empty(), "no share yet");
            // The split gives this shard the whole account and model, as one shard of an
            // otherwise idle node would get; the RPM bucket starts full, as at a start.
            for (id, capacity) in &added[limits_before..] {
                shard.set_share(*id, *capacity, later);
            }
            assert!(matches!(added[limits_before].1, NodeCapacity::Slots(2)));
        }
        assert_eq!(drain(&mut shard, later), [account.id; 2], "{shards} shards");
        shard.check_invariants();
    }
}
