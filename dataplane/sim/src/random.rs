//! Scenarios drawn at random from a documented space (`spindle-sim --random N --seed S`), and
//! the promises spindle's policy must keep on every one of them.
//!
//! The space, each draw independent and uniform unless said:
//!
//! | what | range |
//! |---|---|
//! | shards | 1–8 |
//! | tenants | 2–2,000 (log-uniform), in 1–4 groups of equal tenants |
//! | a group's weight | 1–16 |
//! | a group's arrivals | Poisson, bursty (on 60–600 s, off 60–600 s) or a window of the run |
//! | a group's tasks | 1–2 kinds: 720p, 1080p or 4K, 5, 10, 20 or 60 s long (4K of 60 s, or with audio, is expensive: its own lane) |
//! | offered load | 0.3–3 × what the STANDARD lane's capacity runs |
//! | the STANDARD lane's capacity | 10–200 slot units |
//! | provider faults (half the scenarios) | rate limits 0–20 %, lost answers 0–5 % (half never received), retryable failures 0–5 %, one 429 storm |
//! | run | 600–1,800 s of arrivals, the first fifth a warm-up |
//!
//! Both lanes the tasks use (STANDARD; EXPENSIVE for the expensive ones) get the drawn capacity,
//! and expensive tasks may run as many at once. DRR's quantum is the largest task's units, as in
//! the shipped scenarios. Every scenario's starvation bound is what DRR promises a backlogged
//! tenant whatever the load: one turn of the whole ring — each tenant's turn at most its weight ×
//! the quantum × the burst rounds, plus a task, held for the most slot-seconds a unit of the
//! scenario's tasks takes, on the lane's capacity — doubled, and at least 900 s.

use crate::metrics::PolicyReport;
use crate::rng::Rng;
use crate::scenario::{Scenario, ScenarioError};
use crate::{run, PolicyKind, RunOptions};

/// A task kind of the space: resolution, output seconds, provider hold per output second
/// (the example model's 6 s at 720p, × its tier factor) and slot units.
const KINDS: [(&str, f64, u64); 3] = [("720p", 1.0, 1), ("1080p", 1.5, 1), ("4k", 3.0, 2)];
const DURATIONS_S: [u64; 4] = [5, 10, 20, 60];
/// Provider seconds per output second of a 720p task (the example model).
const PROVIDER_S_PER_OUTPUT_S: f64 = 6.0;

/// The `index`-th scenario drawn with `seed`, as the TOML a file would hold (so it is checked
/// like one). DRR's quantum is the largest task's units (as the shipped scenarios have it), and
/// the starvation bound follows from it (see the module's docs).
pub fn scenario_toml(seed: u64, index: u64) -> String {
    let drawn = draw(seed, index);
    let parsed = Scenario::parse(
        std::path::Path::new("drawn.toml"),
        &format!("starvation_bound_s = 1\n{drawn}"),
    )
    .expect("a drawn scenario parses");
    let policy = parsed.policy();
    let model = &policy.models[0];
    // Per group: its weight, its largest task's units, and slot-seconds per unit at most.
    let mut largest_milli = 1_000;
    let mut slot_s_per_unit: f64 = 0.0;
    for g in &parsed.tenants {
        for m in g.mix.get_ref() {
            let e = spindle_core::cost::estimate(&m.spec(), model, &policy.cost_bases)
                .expect("the space's tasks are priced");
            largest_milli = largest_milli.max(e.fairness.milli());
            let slot_s = e.provider_ms as f64 / 1000.0 * e.slots.milli() as f64 / 1000.0;
            slot_s_per_unit = slot_s_per_unit.max(slot_s / (e.fairness.milli() as f64 / 1000.0));
        }
    }
    let quantum = largest_milli.div_ceil(1_000);
    let burst_rounds = u64::from(policy.drr.burst_rounds);
    // One ring turn: each tenant's turn at most weight × quantum × burst rounds, plus a task.
    let turn_units: f64 = parsed
        .tenants
        .iter()
        .map(|g| {
            let per = (u64::from(*g.weight.get_ref()) * quantum * burst_rounds + quantum) as f64;
            per * *g.count.get_ref() as f64
        })
        .sum();
    let capacity = parsed.lanes[&spindle_core::Lane::Standard]
        .capacity
        .unwrap_or(1) as f64;
    let ring_turn_s = turn_units * slot_s_per_unit / capacity;
    let starvation_bound_s = (2.0 * ring_turn_s).max(900.0).ceil() as u64;
    format!(
        "starvation_bound_s = {starvation_bound_s}\n{drawn}\n[drr]\nbase_quantum = {quantum}\n\
         initial_burst_credit = {quantum}\n"
    )
}

/// The scenario's fields but its starvation bound and DRR settings.
fn draw(seed: u64, index: u64) -> String {
    let mut rng = Rng::fork(seed, index);
    let shards = 1 + rng.below(8);
    let tenants = (2.0 * 1000f64.powf(rng.unit())).round().clamp(2.0, 2000.0) as u64;
    let groups = (1 + rng.below(4)).min(tenants);
    let duration_s = 600 + rng.below(1201);
    let capacity = 10 + rng.below(191);
    let load = 0.3 + 2.7 * rng.unit();
    let mut out = format!(
        "name = \"random-{seed}-{index}\"\nseed = {}\nduration_s = {duration_s}\n\
         warmup_s = {}\nshards = {shards}\n",
        seed ^ index.wrapping_mul(0x9E37_79B9),
        duration_s / 5,
    );
    let mut body = String::new();
    // Each group's tenants offer an equal part of the load.
    for g in 0..groups {
        let count = tenants / groups + u64::from(g < tenants % groups);
        let weight = 1 + rng.below(16);
        let mut mix = Vec::new();
        let mut mean_hold_units_s = 0.0;
        let kinds = 1 + rng.below(2);
        for _ in 0..kinds {
            let (res, factor, slots) = KINDS[rng.below(3) as usize];
            let duration = DURATIONS_S[rng.below(4) as usize];
            let hold_s = duration as f64 * PROVIDER_S_PER_OUTPUT_S * factor;
            mean_hold_units_s += hold_s * slots as f64 / kinds as f64;
            mix.push(format!("{{ res = \"{res}\", duration_s = {duration} }}"));
        }
        // What this group's tenants offer, together, per second.
        let group_rate = load * capacity as f64 / mean_hold_units_s / groups as f64;
        let rate = (group_rate / count as f64).max(1e-4);
        let arrival = match rng.below(3) {
            0 => format!("{{ kind = \"poisson\", rate_per_s = {rate:.6} }}"),
            1 => {
                let (on, off) = (60 + rng.below(541), 60 + rng.below(541));
                // The same mean: bursts at (on + off) / on the rate.
                let burst = rate * (on + off) as f64 / on as f64;
                format!(
                    "{{ kind = \"bursty\", rate_per_s = {burst:.6}, on_s = {on}, off_s = {off} }}"
                )
            }
            _ => {
                let start = rng.below(duration_s / 2);
                let end = start + duration_s / 4 + rng.below(duration_s / 2);
                format!(
                    "{{ kind = \"window\", rate_per_s = {rate:.6}, start_s = {start}, end_s = {end} }}"
                )
            }
        };
        body.push_str(&format!(
            "\n[[tenants]]\nname = \"g{g}\"\ncount = {count}\nlane = \"STANDARD\"\n\
             weight = {weight}\narrival = {arrival}\nmix = [{}]\nqueued_tasks_max = 100000\n",
            mix.join(", ")
        ));
    }
    out.push_str(&format!(
        "\n[lanes.STANDARD]\ncapacity = {capacity}\n\n\
         [lanes.EXPENSIVE]\ncapacity = {capacity}\n\n[node]\nglobal_queued_tasks_max = 10000000\n\
         high_cost_concurrency = {capacity}\n"
    ));
    out.push_str(&format!(
        "\n[[providers]]\nname = \"vendor-a:acct-1:us:video-model-0\"\nconcurrency = {}\n\
         rpm = 100000\nrpm_burst = 2000\n",
        4 * capacity
    ));
    if rng.chance(0.5) {
        let storm_at = rng.below(duration_s);
        out.push_str(&format!(
            "rate_limit_prob = {:.3}\ntimeout_prob = {:.3}\nlost_prob = 0.5\nfailure_prob = {:.3}\n\
             storms = [{{ start_s = {storm_at}, end_s = {}, rate_limit_prob = 0.5 }}]\n",
            0.2 * rng.unit(),
            0.05 * rng.unit(),
            0.05 * rng.unit(),
            storm_at + 60 + rng.below(240),
        ));
    }
    out.push_str(&body);
    out
}

/// The `index`-th scenario drawn with `seed`, parsed.
pub fn scenario(seed: u64, index: u64) -> Result<Scenario, ScenarioError> {
    let name = format!("random-{seed}-{index}.toml");
    Scenario::parse(std::path::Path::new(&name), &scenario_toml(seed, index))
}

/// Runs `scenario` through spindle's policy and, when it has several shards, through one shard
/// too; returns the report and the promises it broke ([`broken_promises`], and a worst share
/// error of the tenants entitled to 50 of their DRR bounds more than 0.01 above the one-shard
/// run's: a node is as fair as one shard).
pub fn check(scenario: &Scenario, options: RunOptions) -> (PolicyReport, Vec<String>) {
    let report = run(scenario, PolicyKind::Spindle, options);
    let mut broken = broken_promises(&report);
    if *scenario.shards.get_ref() > 1 {
        let mut one = scenario.clone();
        one.shards = toml::Spanned::new(0..0, 1);
        let single = run(&one, PolicyKind::Spindle, options);
        if report.share_error_max_large > single.share_error_max_large + 0.01 {
            broken.push(format!(
                "share error {:.3} of tenants entitled to {}+ of their DRR bounds, against \
                 {:.3} on one shard (over 0.01 worse)",
                report.share_error_max_large,
                crate::metrics::LARGE_ENTITLEMENT_BOUNDS,
                single.share_error_max_large
            ));
        }
    }
    (report, broken)
}

/// What spindle's policy broke of its promises in `report` (empty: none): no limit exceeded,
/// no provider job submitted twice, no task starved past the scenario's bound, service gaps
/// within their bounds per shard and node-wide, the share of every tenant entitled to 50 of its
/// DRR bounds within 0.02, and nobody further from its share than twice DRR's bound per weight.
pub fn broken_promises(report: &PolicyReport) -> Vec<String> {
    let mut broken = Vec::new();
    if report.limit_overshoots > 0 {
        broken.push(format!(
            "{} limit overshoots ({:?})",
            report.limit_overshoots, report.overshoot_keys
        ));
    }
    if report.duplicate_provider_jobs > 0 {
        broken.push(format!(
            "{} provider jobs submitted twice",
            report.duplicate_provider_jobs
        ));
    }
    if report.starved_tasks > 0 {
        broken.push(format!("{} starved tasks", report.starved_tasks));
    }
    if report.share_error_max_large > 0.02 {
        broken.push(format!(
            "share error {:.3} of a tenant entitled to {}+ of its DRR bounds (over 0.02)",
            report.share_error_max_large,
            crate::metrics::LARGE_ENTITLEMENT_BOUNDS
        ));
    }
    if report.share_deviation_max_units > 2.0 * report.drr_bound_units {
        broken.push(format!(
            "a tenant {:.1} units per weight off its share (over twice DRR's bound {:.1})",
            report.share_deviation_max_units, report.drr_bound_units
        ));
    }
    if report.service_gap_max_units > report.gap_bound_units() {
        broken.push(format!(
            "service gap {:.1} units over its bound {:.1} (DRR's {:.1} + debts' {:.1})",
            report.service_gap_max_units,
            report.gap_bound_units(),
            report.drr_bound_units,
            report.debt_allowance_units
        ));
    }
    if report.node_service_gap_max_units > report.node_gap_bound_units() {
        broken.push(format!(
            "node-wide service gap {:.1} units over its bound {:.1} (+ lags' {:.1})",
            report.node_service_gap_max_units,
            report.node_gap_bound_units(),
            report.lag_allowance_units
        ));
    }
    broken
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_scenarios_and_every_one_parses() {
        for index in 0..200 {
            let a = scenario_toml(7, index);
            assert_eq!(a, scenario_toml(7, index));
            let s = scenario(7, index).unwrap_or_else(|e| panic!("{e}\n{a}"));
            s.policy().validate().unwrap();
            let tenants: u64 = s.tenants.iter().map(|g| *g.count.get_ref()).sum();
            assert!((2..=2000).contains(&tenants), "{tenants}");
            assert!((1..=8).contains(s.shards.get_ref()));
        }
        assert_ne!(scenario_toml(7, 0), scenario_toml(8, 0));
    }
}
