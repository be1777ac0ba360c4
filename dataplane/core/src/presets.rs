//! Ready-made policies for tests, benches and the simulator's defaults. Values follow
//! design.md §4 scaled down; nothing here is used by the node in production.

use std::collections::HashMap;

use crate::cost::{example_model, CostBases, ResourceClass};
use crate::ids::{Band, Lane, ModelId, PolicyVersion, ProviderId, TenantId};
use crate::policy::{
    AgingPolicy, DrrPolicy, LanePolicy, NodePolicy, Policy, ProviderPolicy, RateSpec,
    ReservePolicy, RetryPolicy, TenantPolicy, UserPolicy, WaitOverflow,
};
use crate::units::Units;

/// A bucket that never binds in practice.
pub const UNLIMITED_RATE: RateSpec = RateSpec {
    per_minute: 1 << 40,
    burst: 1 << 40,
};

fn lane(capacity_units: u64, weight: u32) -> LanePolicy {
    LanePolicy {
        open: true,
        weight,
        capacity: Units::whole(capacity_units),
        queued_tasks_max: 1 << 30,
        queued_units_max: Units::whole(1 << 30),
        running_tasks_max: 1 << 30,
        retries_max: 3,
        rate_limit_retries_max: 20,
        initial_rate_milli_per_s: 1_000,
        cost_per_minute: None,
        execution_timeout_ms: 0,
        media_workers: None,
    }
}

/// A tenant with generous limits in `lane` with `weight`.
pub fn tenant(lane: Lane, weight: u32) -> TenantPolicy {
    TenantPolicy {
        lane,
        weight,
        base_band: match lane {
            Lane::EnterpriseReserved => Band::P1,
            Lane::PaidShared => Band::P2,
            Lane::BestEffort => Band::P4,
            _ => Band::P3,
        },
        submit_rate: UNLIMITED_RATE,
        queued_tasks_max: 1 << 30,
        queued_units_max: Units::whole(1 << 30),
        running_tasks_max: 1 << 30,
        running_units_max: Units::whole(1 << 30),
        cost_per_minute: UNLIMITED_RATE,
        cost_quota_milli: 1 << 50,
        max_wait_ms: u64::MAX / 2,
        wait_overflow: WaitOverflow::Reject,
        allowed_classes: vec![ResourceClass::Standard, ResourceClass::Expensive],
        user: UserPolicy {
            submit_rate: UNLIMITED_RATE,
            queued_tasks_max: 1 << 30,
            queued_units_max: Units::whole(1 << 30),
            running_tasks_max: 1 << 30,
            running_units_max: Units::whole(1 << 30),
        },
        cancel_rate: UNLIMITED_RATE,
        store_read_rate: UNLIMITED_RATE,
        suspended: false,
        quotas: Vec::new(),
        utc_offset_min: 0,
    }
}

/// Lane capacities in whole units: enterprise 20, paid 40, standard 40, best effort 0,
/// expensive 40, recovery 4; two providers of 100 concurrency; one model.
pub fn small_node() -> Policy {
    let lanes = vec![
        lane(20, 4),
        lane(40, 3),
        lane(40, 2),
        lane(0, 1),
        lane(40, 1),
        lane(4, 8),
    ];
    Policy {
        version: PolicyVersion(1),
        lanes,
        reserve: ReservePolicy {
            borrow_limit: Units::whole(10),
            minimum_reserved_headroom: Units::whole(5),
        },
        drr: DrrPolicy {
            base_quantum: Units::whole(40),
            burst_rounds: 2,
            initial_burst_credit: Units::whole(40),
            debt_cap_per_task: Units::whole(10),
        },
        aging: AgingPolicy {
            aging_step_ms: 300_000,
            fit_scan_max: 8,
            skips_max: 4,
        },
        retry: RetryPolicy {
            backoff_base_ms: 1_000,
            backoff_max_ms: 60_000,
        },
        node: NodePolicy {
            global_queued_tasks_max: 1 << 30,
            global_queued_units_max: Units::whole(1 << 30),
            high_cost_concurrency: 8,
            model_running_max: 1_000,
            model_running_units_max: Units::whole(1 << 30),
            global_running_tasks_max: 1 << 30,
            global_running_units_max: Units::whole(1 << 30),
            platform_cost_per_minute: UNLIMITED_RATE,
            gpu_units: 8,
            gpu_mem_mb: 32_768,
            cpu_units: 16,
            temp_disk_mb: 100_000,
            media_workers: UNBOUNDED,
        },
        cost_bases: CostBases::default(),
        calibration: Default::default(),
        providers: (0..2)
            .map(|i| ProviderPolicy {
                id: ProviderId(i),
                name: format!("vendor-{i}:acct-1:us:video-model-0"),
                concurrency: 100,
                rpm: RateSpec {
                    per_minute: 6_000,
                    burst: 100,
                },
            })
            .collect(),
        models: vec![example_model(
            ModelId(0),
            vec![ProviderId(0), ProviderId(1)],
        )],
        tenants: HashMap::new(),
    }
}

/// A node limit that never binds in practice (and that the simulator does not split).
pub const UNBOUNDED: u64 = 1 << 40;

/// Lifts every node-wide limit (queues, running, high-cost, cost, media) out of the way, for
/// benches and simulator defaults that then set only what they test.
pub fn lift_node_limits(policy: &mut Policy) {
    let n = &mut policy.node;
    n.global_queued_tasks_max = UNBOUNDED;
    n.global_queued_units_max = Units(UNBOUNDED);
    n.high_cost_concurrency = UNBOUNDED;
    n.model_running_max = UNBOUNDED;
    n.model_running_units_max = Units(UNBOUNDED);
    n.global_running_tasks_max = UNBOUNDED;
    n.global_running_units_max = Units(UNBOUNDED);
    n.platform_cost_per_minute = UNLIMITED_RATE;
    n.gpu_units = UNBOUNDED;
    n.gpu_mem_mb = UNBOUNDED;
    n.cpu_units = UNBOUNDED;
    n.temp_disk_mb = UNBOUNDED;
    n.media_workers = UNBOUNDED;
}

/// `small_node` with tenants `1..=n` in STANDARD at weight 1.
pub fn with_tenants(mut policy: Policy, n: u32) -> Policy {
    for t in 1..=n {
        policy
            .tenants
            .insert(TenantId(t), tenant(Lane::Standard, 1));
    }
    policy
}
