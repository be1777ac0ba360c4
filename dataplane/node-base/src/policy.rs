//! The policy a node runs with, derived from its configuration: the small-node preset with
//! node-wide limits lifted and the configured tenants, lanes and providers. The policy store's
//! objects go on top of it at run time (`live_policy`).

use spindle_core::{presets, Policy, TenantId};

use crate::config::Config;

/// The configured policy: the small-node preset with node-wide limits lifted and the configured
/// tenants. The node runs with this and the policy store's objects over it
/// (`spindle_node_control::live_policy`).
pub fn policy(config: &Config) -> Policy {
    let mut policy = presets::small_node();
    presets::lift_node_limits(&mut policy);
    for p in &mut policy.providers {
        p.concurrency = config.provider_concurrency;
        // The node keeps 5 % below the contract's rate and half below its burst (a provider
        // allows about a second's worth): requests leave here paced (`dispatch`) but reach the
        // provider with network jitter, and a provider counting in its own clock must never
        // see more than the contract.
        let per_minute = (config.provider_rpm * 95 / 100).max(1);
        p.rpm = spindle_core::policy::RateSpec {
            per_minute,
            burst: (per_minute / 120).max(1),
        };
    }
    for lane in [
        spindle_core::Lane::PaidShared,
        spindle_core::Lane::Standard,
        spindle_core::Lane::Expensive,
    ] {
        policy.lanes[lane.index()].capacity =
            spindle_core::Units::whole(config.lane_capacity_units);
    }
    for (lane, section) in &config.lanes {
        section.apply(&mut policy.lanes[lane.index()]);
    }
    if let Some(media) = &config.media {
        policy.node.media_workers = media.workers as u64;
    }
    if let Some(per_minute) = config.platform_cost_per_minute_milli {
        policy.node.platform_cost_per_minute = spindle_core::policy::RateSpec {
            per_minute,
            burst: (per_minute / 10).max(1),
        };
    }
    policy.calibration.samples_min = config.cost_calibration_samples;
    policy.retry.backoff_base_ms = config.retry_backoff_base_ms;
    policy.retry.backoff_max_ms = config.retry_backoff_max_ms;
    for t in &config.tenants {
        let mut tenant = presets::tenant(t.lane, t.weight);
        if let Some(per_minute) = t.submit_per_minute {
            tenant.submit_rate = spindle_core::policy::RateSpec {
                per_minute,
                burst: (per_minute / 60).max(1),
            };
        }
        if let Some(max) = t.queued_tasks_max {
            tenant.queued_tasks_max = max;
        }
        let tenth = |per_minute: u64| spindle_core::policy::RateSpec {
            per_minute,
            burst: (per_minute / 10).max(1),
        };
        tenant.cancel_rate = tenth(t.cancel_per_minute);
        if let Some(per_minute) = t.cost_per_minute_milli {
            tenant.cost_per_minute = tenth(per_minute);
        }
        t.user.apply(&mut tenant.user);
        tenant.quotas = t.quotas.clone();
        tenant.utc_offset_min = t.utc_offset_min;
        if let Some(per_minute) = t.store_reads_per_minute {
            tenant.store_read_rate = tenth(per_minute);
        }
        policy.tenants.insert(TenantId(t.id), tenant);
    }
    policy
}
