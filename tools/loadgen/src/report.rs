//! The report: JSON for machines, a table for people, SVG plots (throughput and latency over
//! time, per-tenant served share) written by hand — no plotting stack to install.

use std::fmt::Write;
use std::path::Path;

use hdrhistogram::Histogram;
use serde_json::json;

use crate::run::Outcome;

fn percentiles(h: &Histogram<u64>) -> serde_json::Value {
    json!({
        "count": h.len(),
        "p50_us": h.value_at_quantile(0.50),
        "p90_us": h.value_at_quantile(0.90),
        "p99_us": h.value_at_quantile(0.99),
        "p999_us": h.value_at_quantile(0.999),
        "max_us": h.max(),
    })
}

pub fn json(o: &Outcome, offered_per_s: f64) -> serde_json::Value {
    let send_s = o.elapsed_send.as_secs_f64();
    let accepted: u64 = o.per_tenant.iter().map(|t| t.accepted).sum();
    let completed: u64 = o.per_tenant.iter().map(|t| t.completed).sum();
    let total_s = send_s + o.completed_within.as_secs_f64();
    json!({
        "offered_per_s": offered_per_s,
        "send_window_s": send_s,
        "accepted": accepted,
        "accepted_per_s": accepted as f64 / send_s,
        "completed": completed,
        "completed_per_s": completed as f64 / total_s,
        "unfinished_after_drain": o.unfinished,
        "ack_latency": percentiles(&o.ack_us),
        "reject_latency": percentiles(&o.reject_us),
        "send_late": percentiles(&o.send_late_us),
        // From the node's bucketed histogram (interpolated inside a bucket; 5 ms is a bound,
        // so `within_5ms` is exact): a first attempt's admission to its claim committed.
        "submit_dispatch": o.dispatch.as_ref().map(|b| json!({
            "source": "node histogram spindle_submit_dispatch_seconds",
            "count": b.count(),
            "p50_us": b.quantile_us(0.50),
            "p90_us": b.quantile_us(0.90),
            "p99_us": b.quantile_us(0.99),
            // The quantiles past the histogram's last finite bound: their value is that
            // bound, a floor.
            "beyond_last_bound": ([0.50, 0.90, 0.99]
                .iter()
                .filter(|&&q| b.beyond_last_bound(q))
                .map(|q| format!("p{:.0}", q * 100.0))
                .collect::<Vec<_>>()),
            "within_5ms": b.share_within(0.005),
        })),
        "tenants": o.per_tenant.iter().map(|t| json!({
            "tenant": t.tenant,
            "offered": t.offered,
            "accepted": t.accepted,
            "rejected": t.rejected,
            "errors": t.errors,
            "first_error": t.first_error,
            "backlog_drops": t.backlog_drops,
            "completed": t.completed,
            "served_share": if completed == 0 { 0.0 } else { t.completed as f64 / completed as f64 },
            "completion_ratio": if t.accepted == 0 { 0.0 } else { t.completed as f64 / t.accepted as f64 },
        })).collect::<Vec<_>>(),
        "timeline": o.timeline.iter().enumerate().map(|(s, (acked, done, p99))| json!({
            "second": s, "acked": acked, "completed": done, "ack_p99_us": p99,
        })).collect::<Vec<_>>(),
    })
}

pub fn text(report: &serde_json::Value) -> String {
    let mut out = String::new();
    let r = report;
    writeln!(
        out,
        "offered {:.0}/s over {:.1} s: accepted {} ({:.0}/s), completed {} ({:.0}/s end to end), {} unfinished after the drain window",
        r["offered_per_s"].as_f64().unwrap_or(0.0),
        r["send_window_s"].as_f64().unwrap_or(0.0),
        r["accepted"], r["accepted_per_s"].as_f64().unwrap_or(0.0),
        r["completed"], r["completed_per_s"].as_f64().unwrap_or(0.0),
        r["unfinished_after_drain"],
    )
    .expect("write to string");
    for (name, key) in [("ack", "ack_latency"), ("reject", "reject_latency")] {
        let l = &r[key];
        writeln!(
            out,
            "{name:>6} latency from intended send: p50 {} µs  p90 {} µs  p99 {} µs  p99.9 {} µs  max {} µs  (n={})",
            l["p50_us"], l["p90_us"], l["p99_us"], l["p999_us"], l["max_us"], l["count"]
        )
        .expect("write to string");
    }
    let d = &r["submit_dispatch"];
    if d.is_object() {
        let beyond = |k: &str| {
            let p = k.trim_end_matches("_us");
            d["beyond_last_bound"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x.as_str() == Some(p)))
        };
        let us = |k: &str| match d[k].as_f64() {
            Some(v) if beyond(k) => format!("≥ {v:.0}"),
            Some(v) => format!("{v:.0}"),
            None => "-".to_string(),
        };
        writeln!(
            out,
            "submit → dispatch (node histogram): p50 {} µs  p90 {} µs  p99 {} µs  within 5 ms {:.2} %  (n={})",
            us("p50_us"),
            us("p90_us"),
            us("p99_us"),
            d["within_5ms"].as_f64().unwrap_or(0.0) * 100.0,
            d["count"]
        )
        .expect("write to string");
    }
    writeln!(
        out,
        "tenant  offered  accepted  rejected  completed  served share  completion"
    )
    .expect("write");
    for t in r["tenants"].as_array().into_iter().flatten() {
        let rejected: u64 = t["rejected"]
            .as_object()
            .map(|m| m.values().filter_map(|v| v.as_u64()).sum())
            .unwrap_or(0);
        let n = |k: &str| t[k].as_u64().unwrap_or(0);
        writeln!(
            out,
            "{:>6}  {:>7}  {:>8}  {:>8}  {:>9}  {:>11.1} %  {:>9.1} %",
            n("tenant"),
            n("offered"),
            n("accepted"),
            rejected,
            n("completed"),
            t["served_share"].as_f64().unwrap_or(0.0) * 100.0,
            t["completion_ratio"].as_f64().unwrap_or(0.0) * 100.0,
        )
        .expect("write to string");
    }
    for t in r["tenants"].as_array().into_iter().flatten() {
        if let Some(e) = t["first_error"].as_str() {
            writeln!(
                out,
                "tenant {}: {} tasks not answered; the first failure: {e}",
                t["tenant"], t["errors"]
            )
            .expect("write to string");
        }
    }
    out
}

const W: f64 = 720.0;
const H: f64 = 320.0;
const PAD: f64 = 48.0;

fn polyline(points: &[(f64, f64)], color: &str) -> String {
    let pts: Vec<String> = points
        .iter()
        .map(|(x, y)| format!("{x:.1},{y:.1}"))
        .collect();
    format!(
        r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
        pts.join(" ")
    )
}

/// Accepted and completed tasks per second (left axis) and the second's ack p99 (right axis).
pub fn timeline_svg(report: &serde_json::Value) -> String {
    let rows = report["timeline"].as_array().cloned().unwrap_or_default();
    let n = rows.len().max(2) as f64;
    let max_rate = rows
        .iter()
        .flat_map(|r| {
            [
                r["acked"].as_f64().unwrap_or(0.0),
                r["completed"].as_f64().unwrap_or(0.0),
            ]
        })
        .fold(1.0, f64::max);
    let max_p99 = rows
        .iter()
        .map(|r| r["ack_p99_us"].as_f64().unwrap_or(0.0))
        .fold(1.0, f64::max);
    let x = |i: usize| PAD + (W - 2.0 * PAD) * i as f64 / (n - 1.0);
    let y = |v: f64, max: f64| H - PAD - (H - 2.0 * PAD) * v / max;
    let series = |key: &str, max: f64| -> Vec<(f64, f64)> {
        rows.iter()
            .enumerate()
            .map(|(i, r)| (x(i), y(r[key].as_f64().unwrap_or(0.0), max)))
            .collect()
    };
    format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<line x1="{PAD}" y1="{b}" x2="{r}" y2="{b}" stroke="#888"/><line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{b}" stroke="#888"/>
<text x="{PAD}" y="20">tasks/s (max {max_rate:.0}): accepted (blue), completed (green); ack p99 (red, max {max_p99:.0} µs); x = seconds</text>
{}
{}
{}
</svg>
"##,
        polyline(&series("acked", max_rate), "#1f77b4"),
        polyline(&series("completed", max_rate), "#2ca02c"),
        polyline(&series("ack_p99_us", max_p99), "#d62728"),
        b = H - PAD,
        r = W - PAD,
    )
}

/// Each tenant's share of completed work, with its share of accepted work beside it.
pub fn tenants_svg(report: &serde_json::Value) -> String {
    let tenants = report["tenants"].as_array().cloned().unwrap_or_default();
    let accepted_total: f64 = tenants
        .iter()
        .map(|t| t["accepted"].as_f64().unwrap_or(0.0))
        .sum::<f64>()
        .max(1.0);
    let n = tenants.len().max(1) as f64;
    let bw = (W - 2.0 * PAD) / n;
    let mut bars = String::new();
    for (i, t) in tenants.iter().enumerate() {
        let served = t["served_share"].as_f64().unwrap_or(0.0);
        let demand = t["accepted"].as_f64().unwrap_or(0.0) / accepted_total;
        let x0 = PAD + bw * i as f64;
        for (j, (v, color)) in [(demand, "#bbbbbb"), (served, "#1f77b4")]
            .into_iter()
            .enumerate()
        {
            let h = (H - 2.0 * PAD) * v;
            write!(
                bars,
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{color}"/>"#,
                x0 + j as f64 * bw * 0.4 + bw * 0.1,
                H - PAD - h,
                bw * 0.35,
                h
            )
            .expect("write to string");
        }
        write!(
            bars,
            r#"<text x="{:.1}" y="{:.1}">t{}</text>"#,
            x0 + bw * 0.3,
            H - PAD + 16.0,
            t["tenant"]
        )
        .expect("write to string");
    }
    format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{PAD}" y="20">per tenant: share of accepted work (grey) and of completed work (blue)</text>
{bars}
</svg>
"##
    )
}

pub fn write_all(report: &serde_json::Value, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("report.json"),
        serde_json::to_string_pretty(report)?,
    )?;
    std::fs::write(dir.join("timeline.svg"), timeline_svg(report))?;
    std::fs::write(dir.join("tenants.svg"), tenants_svg(report))?;
    Ok(())
}
