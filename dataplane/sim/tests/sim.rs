//! Simulator tests: tiny scenarios with inline expectations, determinism, and the issue's targets
//! on the shipped scenarios (spindle meets them; each baseline fails where the seed says).

use std::path::{Path, PathBuf};

use expect_test::{expect, Expect};
use spindle_sim::{run, PolicyKind, PolicyReport, RunOptions, Scenario};

fn scenarios_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

fn shipped(name: &str) -> Scenario {
    Scenario::load(&scenarios_dir().join(format!("{name}.toml"))).unwrap()
}

fn summary(r: &PolicyReport) -> String {
    format!(
        "{:<15} accepted={} completed={} failed={} share_error={:.3} jain={:.3} starved={} overshoots={} gap={:.1}/{:.1} node_gap={:.1}/{:.1} 429s={} rejected={:?}",
        r.policy,
        r.tasks_accepted,
        r.tasks_completed,
        r.tasks_failed,
        r.share_error_max,
        r.jain_index,
        r.starved_tasks,
        r.limit_overshoots,
        r.service_gap_max_units,
        r.gap_bound_units(),
        r.node_service_gap_max_units,
        r.node_gap_bound_units(),
        r.rate_limited_answers,
        r.rejected,
    )
}

/// Runs `toml` through every policy, checking invariants every 50 events.
fn check(toml: &str, expected: Expect) {
    let scenario = Scenario::parse(Path::new("inline.toml"), toml).unwrap();
    let out: Vec<String> = PolicyKind::ALL
        .iter()
        .map(|&k| {
            summary(&run(
                &scenario,
                k,
                RunOptions {
                    check_every: 50,
                    ..RunOptions::default()
                },
            ))
        })
        .collect();
    expected.assert_eq(&(out.join("\n") + "\n"));
}

const PROVIDER: &str = r#"
[[providers]]
name = "p"
concurrency = 100
rpm = 10000
rpm_burst = 300
latency_sigma = 0.0
"#;

#[test]
fn tiny_noisy_neighbour() {
    check(
        &format!(
            r#"
name = "tiny_noisy"
duration_s = 900
warmup_s = 120
starvation_bound_s = 600
shards = 2
[lanes.STANDARD]
capacity = 6
[drr]
base_quantum = 2
initial_burst_credit = 2
[node]
global_queued_tasks_max = 400
{PROVIDER}
[[tenants]]
name = "small"
count = 3
lane = "STANDARD"
arrival = {{ kind = "poisson", rate_per_s = 0.1 }}
mix = [{{ res = "720p", duration_s = 5 }}]
queued_tasks_max = 200
[[tenants]]
name = "whale"
count = 1
lane = "STANDARD"
arrival = {{ kind = "poisson", rate_per_s = 5.0 }}
mix = [{{ res = "720p", duration_s = 5 }}]
queued_tasks_max = 200
"#
        ),
        expect![[r#"
            spindle         accepted=443 completed=443 failed=0 share_error=0.000 jain=1.000 starved=0 overshoots=0 gap=4.0/5.0 node_gap=4.0/12.7 429s=0 rejected={"REJECT_PLATFORM_OVERLOADED": 4336}
            fifo            accepted=580 completed=580 failed=0 share_error=2.795 jain=0.277 starved=3 overshoots=0 gap=147.0/5.0 node_gap=147.0/10.0 429s=0 rejected={"REJECT_PLATFORM_OVERLOADED": 4199}
            wrr_count       accepted=580 completed=580 failed=0 share_error=0.000 jain=1.000 starved=0 overshoots=0 gap=1.0/5.0 node_gap=1.0/10.0 429s=0 rejected={"REJECT_PLATFORM_OVERLOADED": 4199}
            global_priority accepted=580 completed=580 failed=0 share_error=2.795 jain=0.277 starved=3 overshoots=0 gap=147.0/5.0 node_gap=147.0/10.0 429s=0 rejected={"REJECT_PLATFORM_OVERLOADED": 4199}
        "#]],
    );
}

#[test]
fn tiny_priority_flood_starves_only_under_global_priority() {
    check(
        &format!(
            r#"
name = "tiny_flood"
duration_s = 900
warmup_s = 120
starvation_bound_s = 300
[lanes.STANDARD]
capacity = 4
[drr]
base_quantum = 2
initial_burst_credit = 2
{PROVIDER}
[[tenants]]
name = "urgent"
count = 1
lane = "STANDARD"
base_band = "P1"
arrival = {{ kind = "poisson", rate_per_s = 1.0 }}
mix = [{{ res = "720p", duration_s = 5 }}]
queued_tasks_max = 500
[[tenants]]
name = "normal"
count = 2
lane = "STANDARD"
arrival = {{ kind = "poisson", rate_per_s = 0.02 }}
mix = [{{ res = "720p", duration_s = 5 }}]
"#
        ),
        expect![[r#"
            spindle         accepted=623 completed=623 failed=0 share_error=0.000 jain=1.000 starved=0 overshoots=0 gap=3.0/5.0 node_gap=3.0/10.0 429s=0 rejected={"REJECT_TENANT_QUEUE_FULL": 294}
            fifo            accepted=917 completed=917 failed=0 share_error=0.942 jain=0.530 starved=14 overshoots=0 gap=98.0/5.0 node_gap=98.0/10.0 429s=0 rejected={}
            wrr_count       accepted=917 completed=917 failed=0 share_error=0.000 jain=1.000 starved=0 overshoots=0 gap=1.0/5.0 node_gap=1.0/10.0 429s=0 rejected={}
            global_priority accepted=917 completed=917 failed=0 share_error=1.000 jain=0.500 starved=2 overshoots=0 gap=104.0/5.0 node_gap=104.0/10.0 429s=0 rejected={}
        "#]],
    );
}

#[test]
fn tiny_rate_limit_storm_and_timeouts() {
    check(
        r#"
name = "tiny_storm"
duration_s = 600
warmup_s = 60
starvation_bound_s = 900
[lanes.STANDARD]
capacity = 10
rate_limit_retries_max = 100
[[providers]]
name = "p"
concurrency = 6
rpm = 30
rpm_burst = 5
timeout_prob = 0.1
lost_prob = 0.5
storms = [{ start_s = 100, end_s = 300, rate_limit_prob = 0.8 }]
[[tenants]]
name = "t"
count = 3
lane = "STANDARD"
arrival = { kind = "poisson", rate_per_s = 0.1 }
mix = [{ res = "720p", duration_s = 5 }]
"#,
        expect![[r#"
            spindle         accepted=181 completed=181 failed=0 share_error=0.000 jain=1.000 starved=0 overshoots=0 gap=30.7/160.5 node_gap=30.7/257.5 429s=49 rejected={}
            fifo            accepted=181 completed=181 failed=0 share_error=0.000 jain=1.000 starved=0 overshoots=0 gap=11.3/97.0 node_gap=11.3/194.0 429s=81 rejected={}
            wrr_count       accepted=181 completed=181 failed=0 share_error=0.000 jain=1.000 starved=0 overshoots=0 gap=6.8/97.0 node_gap=6.8/194.0 429s=81 rejected={}
            global_priority accepted=181 completed=181 failed=0 share_error=0.000 jain=1.000 starved=0 overshoots=0 gap=11.3/97.0 node_gap=11.3/194.0 429s=81 rejected={}
        "#]],
    );
}

/// Two shards, light load, no limit anywhere near binding: every task starts the moment it
/// arrives. Before idle shards kept a standby part of a split rate, the shard with nothing
/// waiting at a split got none of the provider's RPM until the next one, and the two shards took
/// it from each other in turn: p99 70 ms, max 100 ms of waiting for nothing.
#[test]
fn an_idle_shard_starts_its_next_task_without_waiting_for_a_split() {
    let scenario = Scenario::parse(
        Path::new("inline.toml"),
        r#"
name = "idle_shard"
duration_s = 300
warmup_s = 30
shards = 2
starvation_bound_s = 900
resplit_ms = 10

[lanes.STANDARD]
capacity = 100000

[drr]
base_quantum = 2
initial_burst_credit = 2

[[providers]]
name = "p"
concurrency = 100000
rpm = 600000
rpm_burst = 10000
latency_sigma = 0.0
submit_latency_ms = 0

[[tenants]]
name = "light"
count = 40
lane = "STANDARD"
arrival = { kind = "poisson", rate_per_s = 0.5 }
mix = [{ res = "720p", duration_s = 5 }]
"#,
    )
    .unwrap();
    let r = run(
        &scenario,
        PolicyKind::Spindle,
        RunOptions {
            check_every: 50,
            ..RunOptions::default()
        },
    );
    assert_eq!(r.tasks_completed, r.tasks_accepted);
    assert_eq!(r.limit_overshoots, 0);
    assert_eq!(
        (r.wait_ms.p99, r.wait_ms.max),
        (0.0, 0.0),
        "submit → dispatch waits"
    );
}

#[test]
fn same_seed_same_run_other_seed_other_run() {
    let mut scenario = shipped("provider_429_storm");
    let a = run(&scenario, PolicyKind::Spindle, RunOptions::default());
    let b = run(&scenario, PolicyKind::Spindle, RunOptions::default());
    assert_eq!(a, b, "a seed must reproduce its run bit for bit");
    scenario.seed += 1;
    let c = run(&scenario, PolicyKind::Spindle, RunOptions::default());
    assert_ne!(a, c, "another seed must give another trace");
}

/// Skipping the splits whose inputs did not change is only a saving: every report is the one
/// that splitting every limit every time gives (a scenario with 429 penalties on its rates, and
/// one whose shards' work differs). A skip that changed what a split would have set fails this.
#[test]
fn skipping_unchanged_splits_changes_no_result() {
    for name in ["provider_429_storm", "cost_skew", "priority_flood"] {
        let scenario = shipped(name);
        let every = RunOptions {
            split_unchanged: true,
            ..RunOptions::default()
        };
        let mut a = run(&scenario, PolicyKind::Spindle, RunOptions::default());
        let mut b = run(&scenario, PolicyKind::Spindle, every);
        (a.sim_wall_ms, b.sim_wall_ms) = (0, 0);
        assert_eq!(a, b, "{name}");
    }
}

#[test]
fn every_shipped_scenario_parses_into_a_valid_policy() {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(scenarios_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let s = Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
            s.policy().validate().unwrap();
            names.push(s.name);
        }
    }
    names.sort();
    expect![[r#"["big_head", "churn", "cost_skew", "enterprise_reserve", "noisy_neighbour", "priority_flood", "provider_429_storm", "tenants_10k", "weights_mixed", "whale_1000x"]"#]]
        .assert_eq(&format!("{names:?}"));
}

/// The issue's targets for spindle on one shipped scenario.
fn assert_spindle_targets(name: &str) -> PolicyReport {
    let scenario = shipped(name);
    let r = run(
        &scenario,
        PolicyKind::Spindle,
        RunOptions {
            check_every: 5_000,
            ..RunOptions::default()
        },
    );
    assert_eq!(
        r.limit_overshoots, 0,
        "{name}: overshoots on {:?}",
        r.overshoot_keys
    );
    assert_eq!(r.starved_tasks, 0, "{name}: starved tasks");
    assert!(
        r.service_gap_max_units <= r.gap_bound_units(),
        "{name}: gap {} > bound {} (DRR's {})",
        r.service_gap_max_units,
        r.gap_bound_units(),
        r.drr_bound_units
    );
    assert!(
        r.node_service_gap_max_units <= r.node_gap_bound_units(),
        "{name}: node-wide gap {} > bound {}",
        r.node_service_gap_max_units,
        r.node_gap_bound_units()
    );
    if scenario.fairness {
        assert!(
            r.backlogged_tenants >= 2,
            "{name}: fairness needs backlogged tenants"
        );
        assert!(
            r.share_error_max <= 0.02,
            "{name}: share error {}",
            r.share_error_max
        );
        assert!(r.jain_index >= 0.99, "{name}: jain {}", r.jain_index);
    }
    r
}

fn baseline(name: &str, kind: PolicyKind) -> PolicyReport {
    run(&shipped(name), kind, RunOptions::default())
}

#[test]
fn noisy_neighbour_spindle_fair_fifo_not() {
    assert_spindle_targets("noisy_neighbour");
    let fifo = baseline("noisy_neighbour", PolicyKind::Fifo);
    assert!(
        fifo.share_error_max > 1.0,
        "FIFO should let the whale take the lane: {}",
        fifo.share_error_max
    );
}

#[test]
fn cost_skew_spindle_fair_wrr_by_count_not() {
    assert_spindle_targets("cost_skew");
    let wrr = baseline("cost_skew", PolicyKind::WrrCount);
    assert!(
        wrr.share_error_max > 0.5,
        "WRR by count should overserve long tasks: {}",
        wrr.share_error_max
    );
}

#[test]
fn priority_flood_spindle_serves_everyone_global_priority_starves() {
    assert_spindle_targets("priority_flood");
    let gp = baseline("priority_flood", PolicyKind::GlobalPriority);
    assert!(
        gp.starved_tasks > 0,
        "a global priority queue should starve the normal band"
    );
}

#[test]
fn enterprise_reserve_borrowing_and_429_storm_and_big_head() {
    let reserve = assert_spindle_targets("enterprise_reserve");
    assert!(
        reserve.borrowed_dispatches > 0,
        "idle reserve should be borrowed"
    );
    let storm = assert_spindle_targets("provider_429_storm");
    assert!(storm.rate_limited_answers > 0);
    assert_eq!(
        storm.tasks_failed, 0,
        "no task fails that a retry could serve"
    );
    assert_eq!(
        storm.duplicate_provider_jobs, 0,
        "a timeout never double-submits"
    );
    assert_spindle_targets("big_head");
}

/// The three classes issue 53 found unfair across shards (own traces): a node with several
/// shards is as fair as the same trace on one — every tenant entitled to 50+ of its DRR bounds
/// within 0.02 of its share, the worst share error within 0.01 of one shard's, nobody further
/// from its share than twice DRR's bound per weight, service gaps within their bounds — and the
/// split without the lag correction (`uncorrected_split`) is not, where task sizes and run
/// times differ between shards.
#[test]
fn many_shards_are_as_fair_as_one() {
    for name in ["weights_mixed", "whale_1000x", "churn"] {
        let scenario = shipped(name);
        assert!(*scenario.shards.get_ref() > 1, "{name}");
        let options = RunOptions {
            check_every: 20_000,
            ..RunOptions::default()
        };
        let many = run(&scenario, PolicyKind::Spindle, options);
        let mut single = scenario.clone();
        single.shards = toml::Spanned::new(0..0, 1);
        let one = run(&single, PolicyKind::Spindle, options);
        let uncorrected = run(
            &scenario,
            PolicyKind::Spindle,
            RunOptions {
                uncorrected_split: true,
                ..options
            },
        );
        let summary = |r: &PolicyReport| {
            format!(
                "error {:.3} (large {:.3}), {:.1} units per weight off, bound {}",
                r.share_error_max,
                r.share_error_max_large,
                r.share_deviation_max_units,
                r.drr_bound_units
            )
        };
        let (m, o, u) = (summary(&many), summary(&one), summary(&uncorrected));
        assert_eq!(many.limit_overshoots, 0, "{name}");
        assert_eq!(many.starved_tasks, 0, "{name}");
        assert!(many.backlogged_tenants >= 2, "{name}");
        assert!(many.share_error_max_large <= 0.02, "{name}: {m}");
        assert!(
            many.share_error_max <= one.share_error_max + 0.01,
            "{name}: {m} against one shard's {o}"
        );
        assert!(
            many.share_deviation_max_units <= 2.0 * many.drr_bound_units,
            "{name}: {m}"
        );
        assert!(
            many.service_gap_max_units <= many.gap_bound_units()
                && many.node_service_gap_max_units <= many.node_gap_bound_units(),
            "{name}: gaps {} / {} against {} / {}",
            many.service_gap_max_units,
            many.node_service_gap_max_units,
            many.gap_bound_units(),
            many.node_gap_bound_units()
        );
        if name != "churn" {
            assert!(
                uncorrected.share_error_max > one.share_error_max + 0.02,
                "{name}: the uncorrected split {u} should be unfair against one shard's {o}"
            );
        }
    }
}

/// Fifty scenarios drawn from the random space (`spindle_sim::random`): spindle keeps every
/// promise the space checks on each — no limit exceeded, no job submitted twice, no task
/// starved past a doubled DRR ring turn, service gaps within their bounds per shard and
/// node-wide, shares of tenants entitled to 50+ of their DRR bounds within 0.02, nobody further
/// from its share than twice DRR's bound per weight, the worst share error within 0.01 of the
/// same trace's on one shard (`random::check`) — with the
/// core's invariants checked along the way. A run longer than the test command's is recorded
/// in docs/benchmarks/journal.md (`spindle-sim --random 1000 --seed 1`).
#[test]
fn fifty_random_scenarios_keep_spindles_promises() {
    let options = RunOptions {
        check_every: 10_000,
        ..RunOptions::default()
    };
    let mut broken = Vec::new();
    for index in 0..50 {
        let scenario = spindle_sim::random::scenario(1, index).unwrap();
        for b in spindle_sim::random::check(&scenario, options).1 {
            broken.push(format!("{}: {b}", scenario.name));
        }
    }
    assert!(broken.is_empty(), "{broken:#?}");
}
