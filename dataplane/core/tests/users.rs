//! User records are a tenant's own: keyed by tenant and user, bounded per tenant, and freed
//! when idle — so one tenant's user ids never reach another tenant's limits, and a tenant
//! cycling user ids holds a bounded number of records.

mod common;

use common::submit;

use spindle_core::limits::USERS_PER_TENANT_MAX;
use spindle_core::{presets, Decision, Shard, TenantId, Time};

/// Two tenants whose clients both say user 5: each has its own record and limits. (Keyed by
/// the user id alone, tenant 1's user 5 filled tenant 2's user 5's queue.)
#[test]
fn the_same_user_id_in_two_tenants_is_two_users() {
    let mut policy = presets::with_tenants(presets::small_node(), 2);
    for t in policy.tenants.values_mut() {
        t.user.queued_tasks_max = 2;
    }
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    assert!(submit(&mut shard, Time::ZERO, 1, 1, 5)
        .decision
        .is_accepted());
    assert!(submit(&mut shard, Time::ZERO, 2, 1, 5)
        .decision
        .is_accepted());
    let third = submit(&mut shard, Time::ZERO, 3, 1, 5);
    assert!(!third.decision.is_accepted(), "{third:?}");
    let other = submit(&mut shard, Time::ZERO, 4, 2, 5);
    assert!(other.decision.is_accepted(), "{other:?}");
    assert_eq!(shard.user_records_of(TenantId(1)), 1);
    assert_eq!(shard.user_records_of(TenantId(2)), 1);
    shard.check_invariants();
}

/// Tenant 1 cycles through a million user ids (each submit refused at its user's queue bound,
/// so its record holds nothing but a spent rate token): its records stay within
/// `USERS_PER_TENANT_MAX` — with no sweep, new users past it are refused by name; with the
/// shell's sweeps, idle records are freed and their slots reused — the shard's memory with
/// them, and tenant 2's user is admitted throughout. (Keyed by user id alone and never freed,
/// the records grew without bound and, at the shard's `USERS_MAX`, every tenant was refused.)
#[test]
fn a_tenant_cycling_a_million_user_ids_holds_a_bounded_number_of_records() {
    let mut policy = presets::with_tenants(presets::small_node(), 2);
    policy
        .tenants
        .get_mut(&TenantId(1))
        .unwrap()
        .user
        .queued_tasks_max = 0;
    let mut shard = Shard::new(policy, 1, Time::ZERO);
    let mut task = 0u64;
    let other = |shard: &mut Shard, now: Time, task: &mut u64| {
        *task += 1;
        let b = submit(shard, now, *task, 2, 7);
        assert!(b.decision.is_accepted(), "tenant 2: {b:?}");
    };
    // No sweep: the bound holds, and the users past it are refused by name.
    let mut too_many = 0;
    for i in 0..70_000u32 {
        task += 1;
        let a = submit(&mut shard, Time::ZERO, task, 1, i);
        assert!(!a.decision.is_accepted(), "{a:?}");
        if a.decision == Decision::RejectUserRateLimit
            && a.reason
                .is_some_and(|r| r.to_string().contains("users with work"))
        {
            too_many += 1;
        }
    }
    assert_eq!(too_many, 70_000 - USERS_PER_TENANT_MAX);
    assert_eq!(shard.user_records_of(TenantId(1)), USERS_PER_TENANT_MAX);
    other(&mut shard, Time::ZERO, &mut task);
    // With the shell's sweeps (a bounded number of records each), the rest of the million.
    for i in 70_000..1_000_000u32 {
        // A submit every 10 µs: ten seconds of a tenant sending 100,000 a second.
        let now = Time::ZERO.plus_ns(u64::from(i) * 10_000);
        task += 1;
        let a = submit(&mut shard, now, task, 1, i);
        assert!(!a.decision.is_accepted(), "{a:?}");
        if i % 10_000 == 0 {
            shard.sweep_users(now, 16_384);
            other(&mut shard, now, &mut task);
            assert!(shard.user_records_of(TenantId(1)) <= USERS_PER_TENANT_MAX);
            assert!(shard.user_record_slots() <= USERS_PER_TENANT_MAX + 1);
        }
    }
    // A minute later every idle record of tenant 1 is freed by the sweeps.
    let later = Time::ZERO.plus_ns(70_000_000_000);
    for _ in 0..(USERS_PER_TENANT_MAX / 16_384 + 1) {
        shard.sweep_users(later, 16_384);
    }
    assert_eq!(shard.user_records_of(TenantId(1)), 0);
    shard.check_invariants();
}

mod independence {
    use super::*;
    use proptest::prelude::*;
    use spindle_core::policy::RateSpec;

    /// One submit: by (tenant, user), `gap_ms` after the one before.
    #[derive(Debug, Clone, Copy)]
    struct Step {
        tenant: u32,
        user: u32,
        gap_ms: u64,
    }

    fn step() -> impl Strategy<Value = Step> {
        (1u32..=3, 1u32..=4, 0u64..400).prop_map(|(tenant, user, gap_ms)| Step {
            tenant,
            user,
            gap_ms,
        })
    }

    /// Tenant 1's decisions when the steps run as given, and when the other tenants' submits
    /// are left out (their time still passes).
    fn tenant_1_decisions(steps: &[Step], with_others: bool) -> Vec<Decision> {
        let mut policy = presets::with_tenants(presets::small_node(), 3);
        for t in policy.tenants.values_mut() {
            // Tight limits per user: a record shared across tenants would show at once.
            t.user.queued_tasks_max = 2;
            t.user.submit_rate = RateSpec {
                per_minute: 120,
                burst: 2,
            };
        }
        let mut shard = Shard::new(policy, 1, Time::ZERO);
        let mut now = Time::ZERO;
        let mut decisions = Vec::new();
        for (i, s) in steps.iter().enumerate() {
            now = now.plus_ns(s.gap_ms * 1_000_000);
            if s.tenant != 1 && !with_others {
                continue;
            }
            let a = submit(&mut shard, now, i as u64 + 1, s.tenant, s.user);
            if s.tenant == 1 {
                decisions.push(a.decision);
            }
        }
        shard.check_invariants();
        decisions
    }

    proptest! {
        /// For any sequence of submits of three tenants whose users share ids (each user held
        /// to two queued tasks and two submits at once), tenant 1's admission decisions are
        /// the same with the other tenants' submits as without them. Keyed by user id alone
        /// (as before issue 9), tenant 2's user 1 spent tenant 1's user 1's limits, and this
        /// fails.
        #[test]
        fn no_tenants_admission_depends_on_another_tenants_users(
            steps in proptest::collection::vec(step(), 1..160)
        ) {
            prop_assert_eq!(
                tenant_1_decisions(&steps, true),
                tenant_1_decisions(&steps, false)
            );
        }
    }
}
