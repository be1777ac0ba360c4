//! Periodic quotas in the shard: each scope and period binds, gives back what a task that never
//! billed held, settles at the billed cost, counts what a restart reads back, and names the
//! quota and its reset when it refuses.

mod common;

use common::submit;

use spindle_core::quota::{Quota, QuotaPeriod, QuotaScope};
use spindle_core::{presets, Decision, ModelId, Shard, TaskId, TaskSpec, TenantId, Time, UserId};

/// 2026-12-07T10:00:30Z, the shard's `Time::ZERO` on the wall.
const EPOCH_MS: u64 = 1_796_637_630_000;

fn shard(quotas: Vec<Quota>) -> Shard {
    let mut policy = presets::with_tenants(presets::small_node(), 2);
    policy.tenants.get_mut(&TenantId(1)).unwrap().quotas = quotas;
    let mut s = Shard::new(policy, 1, Time::ZERO);
    s.set_wall_epoch_ms(EPOCH_MS);
    s
}

fn cost_of_one() -> u64 {
    let p = presets::small_node();
    spindle_core::cost::estimate(
        &TaskSpec::clip_720p(ModelId(0)),
        &p.models[0],
        &p.cost_bases,
    )
    .unwrap()
    .cost_milli
}

fn quota(scope: QuotaScope, period: QuotaPeriod, cost: Option<u64>, tasks: Option<u64>) -> Quota {
    Quota {
        scope,
        period,
        cost_milli: cost,
        tasks,
    }
}

#[test]
fn a_tenants_tasks_per_minute_binds_names_its_reset_and_comes_back_next_minute() {
    let mut s = shard(vec![quota(
        QuotaScope::Tenant,
        QuotaPeriod::Minute,
        None,
        Some(2),
    )]);
    let t0 = Time::ZERO;
    assert!(submit(&mut s, t0, 1, 1, 1).decision.is_accepted());
    assert!(submit(&mut s, t0, 2, 1, 2).decision.is_accepted());
    let refused = submit(&mut s, t0, 3, 1, 3);
    assert_eq!(refused.decision, Decision::RejectQuotaExhausted);
    assert_eq!(
        refused.reason.unwrap().to_string(),
        "quota exhausted: tenant tasks per minute (2 used of 2); it resets at 2026-12-07T10:01:00Z"
    );
    // Another tenant is not counted.
    assert!(submit(&mut s, t0, 4, 2, 1).decision.is_accepted());
    // The next minute starts at 10:01:00, 30 s on.
    let next = Time::from_secs(30);
    assert!(submit(&mut s, next, 5, 1, 1).decision.is_accepted());
    s.check_invariants();
}

#[test]
fn a_users_daily_cost_binds_that_user_only() {
    let cost = cost_of_one();
    let mut s = shard(vec![quota(
        QuotaScope::User,
        QuotaPeriod::Day,
        Some(2 * cost),
        None,
    )]);
    let t0 = Time::ZERO;
    assert!(submit(&mut s, t0, 1, 1, 7).decision.is_accepted());
    assert!(submit(&mut s, t0, 2, 1, 7).decision.is_accepted());
    let refused = submit(&mut s, t0, 3, 1, 7);
    assert_eq!(refused.decision, Decision::RejectQuotaExhausted);
    assert!(
        refused
            .reason
            .unwrap()
            .to_string()
            .contains("user cost per day"),
        "{refused:?}"
    );
    assert!(submit(&mut s, t0, 4, 1, 8).decision.is_accepted());
}

#[test]
fn a_models_quota_counts_only_that_models_tasks() {
    let mut s = shard(vec![
        quota(
            QuotaScope::Model { model: ModelId(1) },
            QuotaPeriod::Month,
            None,
            Some(0),
        ),
        quota(
            QuotaScope::Model { model: ModelId(0) },
            QuotaPeriod::Month,
            None,
            Some(1),
        ),
    ]);
    assert!(submit(&mut s, Time::ZERO, 1, 1, 1).decision.is_accepted());
    let refused = submit(&mut s, Time::ZERO, 2, 1, 1);
    assert!(
        refused
            .reason
            .unwrap()
            .to_string()
            .contains("model 0 tasks per month"),
        "{refused:?}"
    );
}

#[test]
fn a_task_that_never_billed_gives_its_charge_back_and_a_billed_one_settles() {
    let cost = cost_of_one();
    let mut s = shard(vec![
        quota(QuotaScope::Tenant, QuotaPeriod::Day, None, Some(1)),
        quota(QuotaScope::Tenant, QuotaPeriod::Month, Some(3 * cost), None),
    ]);
    let t0 = Time::ZERO;
    assert!(submit(&mut s, t0, 1, 1, 1).decision.is_accepted());
    assert_eq!(
        submit(&mut s, t0, 2, 1, 1).decision,
        Decision::RejectQuotaExhausted
    );
    // Canceled while queued: nothing was billed, the day's task comes back.
    s.handle_cancel(TaskId(1)).unwrap();
    assert!(submit(&mut s, t0, 3, 1, 1).decision.is_accepted());
    // Billed at twice its estimate: the month's cost counts that (2 + the refused and
    // canceled ones nothing), and it is not given back when the task ends.
    s.settle_quota_cost(TaskId(3), 2 * cost);
    let used = s.quota_report(TenantId(1), t0);
    assert_eq!(used[0].tasks, 1, "one task today");
    assert_eq!(used[1].cost_milli, 2 * cost, "billed cost this month");
    s.handle_cancel(TaskId(3)).unwrap();
    let used = s.quota_report(TenantId(1), t0);
    assert_eq!(
        (used[0].tasks, used[1].cost_milli),
        (1, 2 * cost),
        "a billed task stays counted"
    );
}

/// A video the media stage found longer than declared is priced as probed: the quotas count
/// the difference on top of what was billed, or on top of the estimate when nothing was. Without
/// `charge_quota_extra` the month's cost stays at the bill, and this fails.
#[test]
fn a_task_priced_as_probed_counts_the_difference_in_its_quotas() {
    let cost = cost_of_one();
    let mut s = shard(vec![quota(
        QuotaScope::Tenant,
        QuotaPeriod::Month,
        Some(10 * cost),
        None,
    )]);
    let t0 = Time::ZERO;
    assert!(submit(&mut s, t0, 1, 1, 1).decision.is_accepted());
    assert!(submit(&mut s, t0, 2, 1, 1).decision.is_accepted());
    s.settle_quota_cost(TaskId(1), 2 * cost);
    s.charge_quota_extra(TaskId(1), 3 * cost);
    s.charge_quota_extra(TaskId(2), cost);
    let used = s.quota_report(TenantId(1), t0);
    assert_eq!(used[0].cost_milli, (2 + 3) * cost + (1 + 1) * cost);
}

#[test]
fn a_reset_starts_the_counts_again_and_nothing_before_it_counts() {
    let mut s = shard(vec![
        quota(QuotaScope::Tenant, QuotaPeriod::Day, None, Some(1)),
        quota(QuotaScope::User, QuotaPeriod::Day, None, Some(1)),
    ]);
    assert!(submit(&mut s, Time::ZERO, 1, 1, 1).decision.is_accepted());
    let report = s.quota_report(TenantId(1), Time::ZERO);
    assert_eq!(
        (report[0].tasks, report[1].tasks, report[1].users),
        (1, 1, 1)
    );
    assert_eq!(
        submit(&mut s, Time::ZERO, 2, 1, 1).decision,
        Decision::RejectQuotaExhausted
    );
    let later = Time::from_secs(5);
    s.set_quota_floor(TenantId(1), EPOCH_MS + 5_000);
    // What a restart would read back from before the floor is not counted again; neither is
    // task 1 ending unbilled (its charge was made before the floor).
    s.charge_ended_quotas(TenantId(1), UserId(1), ModelId(0), EPOCH_MS, 0, 4);
    s.handle_cancel(TaskId(1)).unwrap();
    assert_eq!(s.quota_report(TenantId(1), later)[0].tasks, 0);
    assert!(submit(&mut s, later, 3, 1, 1).decision.is_accepted());
    assert_eq!(s.quota_report(TenantId(1), later)[0].tasks, 1);
}

#[test]
fn what_a_restart_reads_back_is_counted() {
    let mut s = shard(vec![quota(
        QuotaScope::Tenant,
        QuotaPeriod::Day,
        None,
        Some(3),
    )]);
    // Two ended today (read back from the store), one yesterday (not counted).
    s.charge_ended_quotas(TenantId(1), UserId(1), ModelId(0), EPOCH_MS - 60_000, 0, 2);
    s.charge_ended_quotas(
        TenantId(1),
        UserId(1),
        ModelId(0),
        EPOCH_MS - 86_400_000,
        0,
        5,
    );
    assert!(submit(&mut s, Time::ZERO, 1, 1, 1).decision.is_accepted());
    assert_eq!(
        submit(&mut s, Time::ZERO, 2, 1, 1).decision,
        Decision::RejectQuotaExhausted
    );
}

#[test]
fn a_quota_without_a_bound_or_a_far_time_zone_is_refused_by_name() {
    let mut policy = presets::with_tenants(presets::small_node(), 1);
    let t = policy.tenants.get_mut(&TenantId(1)).unwrap();
    t.quotas = vec![quota(QuotaScope::Tenant, QuotaPeriod::Day, None, None)];
    assert!(policy
        .validate()
        .unwrap_err()
        .to_string()
        .contains("quotas[0]: neither cost_milli nor tasks"));
    let t = policy.tenants.get_mut(&TenantId(1)).unwrap();
    t.quotas.clear();
    t.utc_offset_min = 15 * 60;
    assert!(policy
        .validate()
        .unwrap_err()
        .to_string()
        .contains("utc_offset_min"));
}

/// The shard's quota books are bounded: with a per-user quota, each user of the minute is a
/// counter, and once `QUOTA_USAGE_MAX` of them are open a submit that needs another is refused
/// by name (a user already counted still fits); the next minute's first submit lets the ended
/// minute's counters go and is taken. Without the bound the books grow with every user id a
/// tenant sends, and the refusal here never comes.
#[test]
fn the_quota_books_are_bounded_and_a_new_period_frees_them() {
    use spindle_core::shard::QUOTA_USAGE_MAX;
    let mut s = shard(vec![quota(
        QuotaScope::User,
        QuotaPeriod::Minute,
        None,
        Some(1_000),
    )]);
    // 20 µs apart: all within the minute the shard's clock starts in (it has 29.5 s left).
    let at = |i: u64| Time(i * 20_000);
    for i in 0..QUOTA_USAGE_MAX as u64 {
        let a = submit(&mut s, at(i), i + 1, 1, i as u32);
        assert!(a.decision.is_accepted(), "{i}: {a:?}");
        s.handle_cancel(TaskId(i + 1)).unwrap();
        if i % 4_096 == 0 {
            // The users' records go (as the shell's timer sweeps them); their counts stay.
            s.sweep_users(at(i), 8_192);
        }
    }
    let next = QUOTA_USAGE_MAX as u64 + 1;
    let t0 = at(next);
    let full = submit(&mut s, t0, next, 1, u32::MAX);
    assert_eq!(full.decision, Decision::RejectQuotaExhausted, "{full:?}");
    let reason = full.reason.unwrap().to_string();
    assert!(reason.contains(&QUOTA_USAGE_MAX.to_string()), "{reason}");
    let counted = submit(&mut s, t0, next + 1, 1, 7);
    assert!(counted.decision.is_accepted(), "{counted:?}");
    let minute_later = Time::from_secs(60);
    let fresh = submit(&mut s, minute_later, next + 2, 1, u32::MAX);
    assert!(fresh.decision.is_accepted(), "{fresh:?}");
    s.check_invariants();
}
