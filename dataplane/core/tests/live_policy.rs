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
                spec: TaskSpec {
                    model: ModelId(0),
                    width: 1280,
                    height: 720,
                    duration_ms: 5_000,
                    fps: 24,
                    audio: false,
                    references: 0,
                },
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
