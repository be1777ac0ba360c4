//! The comparison report: JSON (the shape of issue 2) and a human table per scenario.

use std::fmt::Write;

use serde::Serialize;

use crate::metrics::PolicyReport;

#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    pub name: String,
    pub seed: u64,
    pub fairness_scenario: bool,
    pub policies: Vec<PolicyReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenarios: Vec<ScenarioReport>,
}

fn f(v: f64) -> String {
    if v.abs() >= 1e6 {
        format!("{v:.3e}")
    } else {
        format!("{v:.3}")
    }
}

/// Four policies side by side, one row per metric.
pub fn human(report: &Report) -> String {
    let mut out = String::new();
    for s in &report.scenarios {
        let _ = writeln!(
            out,
            "\n== {} (seed {}){}",
            s.name,
            s.seed,
            if s.fairness_scenario {
                " [fairness targets]"
            } else {
                ""
            }
        );
        let _ = write!(out, "{:<26}", "metric");
        for p in &s.policies {
            let _ = write!(out, "{:>18}", p.policy);
        }
        out.push('\n');
        type Row = (&'static str, fn(&PolicyReport) -> String);
        let rows: [Row; 21] = [
            ("tasks_submitted", |p| p.tasks_submitted.to_string()),
            ("tasks_completed", |p| p.tasks_completed.to_string()),
            ("tasks_failed", |p| p.tasks_failed.to_string()),
            ("jain_index", |p| f(p.jain_index)),
            ("share_error_max", |p| f(p.share_error_max)),
            ("share_error_max_large", |p| f(p.share_error_max_large)),
            ("share_deviation_max_units", |p| {
                f(p.share_deviation_max_units)
            }),
            ("backlogged_tenants", |p| p.backlogged_tenants.to_string()),
            ("starved_tasks", |p| p.starved_tasks.to_string()),
            ("limit_overshoots", |p| p.limit_overshoots.to_string()),
            ("service_gap_max_units", |p| f(p.service_gap_max_units)),
            ("node_service_gap_max_units", |p| {
                f(p.node_service_gap_max_units)
            }),
            ("drr_bound_units", |p| f(p.drr_bound_units)),
            ("debt_allowance_units", |p| f(p.debt_allowance_units)),
            ("lag_allowance_units", |p| f(p.lag_allowance_units)),
            ("wait_ms_p50", |p| f(p.wait_ms.p50)),
            ("wait_ms_p99", |p| f(p.wait_ms.p99)),
            ("wait_ms_max", |p| f(p.wait_ms.max)),
            ("rejected", |p| p.rejected.values().sum::<u64>().to_string()),
            ("rate_limited_answers", |p| {
                p.rate_limited_answers.to_string()
            }),
            ("sim_wall_ms", |p| p.sim_wall_ms.to_string()),
        ];
        for (name, get) in rows {
            let _ = write!(out, "{name:<26}");
            for p in &s.policies {
                let _ = write!(out, "{:>18}", get(p));
            }
            out.push('\n');
        }
        for p in &s.policies {
            if !p.rejected.is_empty() {
                let reasons: Vec<String> =
                    p.rejected.iter().map(|(k, v)| format!("{k}={v}")).collect();
                let _ = writeln!(out, "  {} rejections: {}", p.policy, reasons.join(" "));
            }
            if !p.overshoot_keys.is_empty() {
                let _ = writeln!(
                    out,
                    "  {} overshoots on: {}",
                    p.policy,
                    p.overshoot_keys.join(", ")
                );
            }
        }
    }
    out
}
