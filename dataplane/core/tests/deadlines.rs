//! The deadline index stays bounded however many tasks with deadlines come and go: entries of
//! tasks that left before their deadline are compacted away, not kept until it passes.

use spindle_core::shard::SubmitRequest;
use spindle_core::{presets, ModelId, Shard, TaskId, TaskSpec, TenantId, Time, UserId};

#[test]
fn tasks_with_far_deadlines_that_leave_early_do_not_grow_the_index() {
    let policy = presets::with_tenants(presets::small_node(), 1);
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    let mut now = Time::ZERO;
    let mut accepted = 0;
    for i in 1..=100_000u64 {
        now = now.plus_ns(1_000_000);
        let a = shard
            .handle_submit(
                now,
                SubmitRequest {
                    task: TaskId(i),
                    tenant: TenantId(1),
                    user: UserId(1),
                    spec: TaskSpec::clip_720p(ModelId(0)),
                    band_hint: None,
                    // A day away: no entry comes due during the test.
                    deadline: Some(now.plus_ns(86_400 * 1_000_000_000)),
                },
            )
            .unwrap();
        if a.decision.is_accepted() {
            accepted += 1;
            shard.handle_cancel(TaskId(i)).unwrap();
        }
        assert!(
            // Compacted at a push past 2 × tasks + 4,096 (counting the task just admitted, which
            // may leave again before the next push).
            shard.deadline_entries() <= 2 * (shard.task_count() + 1) + 4096,
            "{} entries for {} tasks after {i} submits",
            shard.deadline_entries(),
            shard.task_count()
        );
    }
    assert!(accepted > 50_000, "{accepted} accepted");
    shard.check_invariants();
}
