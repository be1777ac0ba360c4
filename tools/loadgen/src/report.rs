//! The report: JSON for machines, a table for people, SVG plots (throughput and latency over
//! time, per-tenant served share) written by hand — no plotting stack to install.

use std::fmt::Write;
use std::path::Path;

use hdrhistogram::Histogram;
use serde_json::json;

use crate::plot::{panel, Mark, Series, Svg};
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
    // Goodput: what completed while the load was offered (whole seconds of the send window),
    // apart from what was refused for the node's load.
    let window = (send_s.floor() as usize).max(1);
    let completed_in_window: u64 = o.timeline.iter().take(window).map(|t| t.completed).sum();
    let refused: u64 = o.overload_us.len();
    json!({
        "offered_per_s": offered_per_s,
        "send_window_s": send_s,
        "accepted": accepted,
        "accepted_per_s": accepted as f64 / send_s,
        "completed": completed,
        "completed_per_s": completed as f64 / total_s,
        "unfinished_after_drain": o.unfinished,
        "goodput_per_s": completed_in_window as f64 / window as f64,
        "refused_overloaded": refused,
        "refused_per_s": refused as f64 / send_s,
        "ack_latency": percentiles(&o.ack_us),
        "reject_latency": percentiles(&o.reject_us),
        "refusal_latency": percentiles(&o.overload_us),
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
            "refused_overloaded": t.rejected.get("REJECT_PLATFORM_OVERLOADED").copied().unwrap_or(0),
            "retried": t.retried,
            "accepted_on_retry": t.accepted_on_retry,
            "gave_up": t.gave_up,
            "ack_latency": percentiles(&t.ack_us),
            "completed": t.completed,
            "served_share": if completed == 0 { 0.0 } else { t.completed as f64 / completed as f64 },
            "completion_ratio": if t.accepted == 0 { 0.0 } else { t.completed as f64 / t.accepted as f64 },
        })).collect::<Vec<_>>(),
        "timeline": o.timeline.iter().enumerate().map(|(s, t)| json!({
            "second": s,
            "acked": t.acked,
            "refused": t.refused,
            "completed": t.completed,
            "ack_p50_us": t.ack_p50_us,
            "ack_p99_us": t.ack_p99_us,
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
    writeln!(
        out,
        "goodput {:.0}/s completed within the send window; refused for the node's load {} ({:.0}/s)",
        r["goodput_per_s"].as_f64().unwrap_or(0.0),
        r["refused_overloaded"],
        r["refused_per_s"].as_f64().unwrap_or(0.0),
    )
    .expect("write to string");
    for (name, key) in [
        ("ack", "ack_latency"),
        ("reject", "reject_latency"),
        ("refuse", "refusal_latency"),
    ] {
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
        "tenant  offered  accepted  rejected  (overload)  retried  completed  served share  completion  ack p99"
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
            "{:>6}  {:>7}  {:>8}  {:>8}  {:>10}  {:>7}  {:>9}  {:>11.1} %  {:>9.1} %  {:>5.1} ms",
            n("tenant"),
            n("offered"),
            n("accepted"),
            rejected,
            n("refused_overloaded"),
            n("retried"),
            n("completed"),
            t["served_share"].as_f64().unwrap_or(0.0) * 100.0,
            t["completion_ratio"].as_f64().unwrap_or(0.0) * 100.0,
            t["ack_latency"]["p99_us"].as_f64().unwrap_or(0.0) / 1e3,
        )
        .expect("write to string");
    }
    for t in r["tenants"].as_array().into_iter().flatten() {
        let mut reasons: Vec<(String, u64)> = t["rejected"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
            .filter(|(_, n)| *n > 0)
            .collect();
        if !reasons.is_empty() {
            reasons.sort();
            let list: Vec<String> = reasons.iter().map(|(k, n)| format!("{k} {n}")).collect();
            writeln!(out, "tenant {} refused: {}", t["tenant"], list.join(", "))
                .expect("write to string");
        }
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

/// The tenants drawn one by one; past it the rest are folded into one group.
const TENANT_BARS_MAX: usize = 24;

/// Over the run's seconds: tasks acknowledged and completed per second, and the ack latency's
/// p50 and p99 of each second's frames; a dashed line where the sending stopped.
pub fn timeline_svg(report: &serde_json::Value) -> String {
    let rows = report["timeline"].as_array().cloned().unwrap_or_default();
    let column = |key: &str, scale: f64| -> Vec<f64> {
        rows.iter()
            .map(|r| r[key].as_f64().unwrap_or(0.0) * scale)
            .collect()
    };
    // A second with no answer has no latency: a gap in its lines.
    let latency = |key: &str| -> Vec<f64> {
        rows.iter()
            .map(|r| match r["acked"].as_u64() {
                Some(n) if n > 0 => r[key].as_f64().unwrap_or(0.0) / 1e3,
                _ => f64::NAN,
            })
            .collect()
    };
    let marks: Vec<Mark> = report["send_window_s"]
        .as_f64()
        .map(|s| Mark::At(s, "sending stops"))
        .into_iter()
        .collect();
    let mut svg = Svg::stacked(2);
    svg.lines(
        panel(0),
        "Throughput",
        "tasks/s",
        &[
            Series {
                name: "acknowledged",
                color: "#1f77b4",
                values: column("acked", 1.0),
            },
            Series {
                name: "completed",
                color: "#2ca02c",
                values: column("completed", 1.0),
            },
            Series {
                name: "refused",
                color: "#d62728",
                values: column("refused", 1.0),
            },
        ],
        &marks,
    );
    svg.lines(
        panel(1),
        "Acknowledgement latency from the intended send time, each second's frames",
        "ms",
        &[
            Series {
                name: "p50",
                color: "#ff7f0e",
                values: latency("ack_p50_us"),
            },
            Series {
                name: "p99",
                color: "#d62728",
                values: latency("ack_p99_us"),
            },
        ],
        &marks,
    );
    svg.finish()
}

/// One bar group of the tenants' chart: a tenant, or the ones folded together.
#[derive(Debug, Clone, PartialEq)]
struct TenantBar {
    name: String,
    accepted: f64,
    completed: f64,
}

/// The tenants as drawn: each of them while they fit, else the [`TENANT_BARS_MAX`] − 1 with the
/// most accepted work and the others summed into one group.
fn tenant_bars(report: &serde_json::Value) -> Vec<TenantBar> {
    let mut bars: Vec<TenantBar> = report["tenants"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| TenantBar {
            name: format!("t{}", t["tenant"]),
            accepted: t["accepted"].as_f64().unwrap_or(0.0),
            completed: t["completed"].as_f64().unwrap_or(0.0),
        })
        .collect();
    if bars.len() > TENANT_BARS_MAX {
        bars.sort_by(|a, b| b.accepted.total_cmp(&a.accepted));
        let rest = bars.split_off(TENANT_BARS_MAX - 1);
        bars.push(TenantBar {
            name: format!("{} others", rest.len()),
            accepted: rest.iter().map(|t| t.accepted).sum(),
            completed: rest.iter().map(|t| t.completed).sum(),
        });
    }
    bars
}

/// Per tenant: its share of the accepted and of the completed work (the served share), and
/// how much of what it had accepted completed — where a noisy neighbour shows.
pub fn tenants_svg(report: &serde_json::Value) -> String {
    let bars = tenant_bars(report);
    let names: Vec<String> = bars.iter().map(|b| b.name.clone()).collect();
    let share = |v: f64, total: f64| if total > 0.0 { 100.0 * v / total } else { 0.0 };
    let accepted: f64 = bars.iter().map(|b| b.accepted).sum();
    let completed: f64 = bars.iter().map(|b| b.completed).sum();
    let percent = |v: f64| format!("{v:.1}");
    let mut svg = Svg::stacked(2);
    svg.bars(
        panel(0),
        "Share of the work, per tenant",
        "%",
        &names,
        &[
            Series {
                name: "of accepted",
                color: "#bbbbbb",
                values: bars.iter().map(|b| share(b.accepted, accepted)).collect(),
            },
            Series {
                name: "of completed (served share)",
                color: "#1f77b4",
                values: bars.iter().map(|b| share(b.completed, completed)).collect(),
            },
        ],
        percent,
    );
    svg.bars(
        panel(1),
        "Completed of accepted, per tenant",
        "%",
        &names,
        &[Series {
            name: "completed",
            color: "#2ca02c",
            values: bars
                .iter()
                .map(|b| share(b.completed, b.accepted))
                .collect(),
        }],
        percent,
    );
    svg.finish()
}

/// The goodput curve `benches/node/overload` measures (its JSON line: `max_rate` and
/// `points`, each with `offered`, `completed_per_s`, `refused_per_s`, `ack_p99_ms` and
/// `quiet_tenant_ack_p99_ms`): offered load against what completed and what was refused, and
/// the acknowledgement p99s against offered load; the maximum marked.
pub fn overload_svg(curve: &serde_json::Value) -> String {
    let points = curve["points"].as_array().cloned().unwrap_or_default();
    let column = |key: &str| -> Vec<f64> {
        points
            .iter()
            .map(|p| p[key].as_f64().unwrap_or(f64::NAN))
            .collect()
    };
    let offered = column("offered");
    let marks: Vec<Mark> = curve["max_rate"]
        .as_f64()
        .map(|m| Mark::At(m, "the maximum"))
        .into_iter()
        .collect();
    let x = (offered.as_slice(), "offered tasks/s");
    let mut svg = Svg::stacked(2);
    svg.curves(
        panel(0),
        "Goodput: what completed, and what was refused at once, against what was offered",
        "tasks/s",
        x,
        &[
            Series {
                name: "offered",
                color: "#bbbbbb",
                values: offered.clone(),
            },
            Series {
                name: "completed",
                color: "#2ca02c",
                values: column("completed_per_s"),
            },
            Series {
                name: "refused",
                color: "#d62728",
                values: column("refused_per_s"),
            },
        ],
        &marks,
    );
    svg.curves(
        panel(1),
        "Acknowledgement p99 of accepted tasks, from the intended send time",
        "ms",
        x,
        &[
            Series {
                name: "all tenants",
                color: "#1f77b4",
                values: column("ack_p99_ms"),
            },
            Series {
                name: "the quiet tenant",
                color: "#ff7f0e",
                values: column("quiet_tenant_ack_p99_ms"),
            },
        ],
        &marks,
    );
    svg.finish()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::PANEL;

    fn tenants(accepted: &[u64]) -> serde_json::Value {
        let rows: Vec<_> = accepted
            .iter()
            .enumerate()
            .map(|(i, &a)| json!({"tenant": i + 1, "accepted": a, "completed": a / 2}))
            .collect();
        json!({ "tenants": rows })
    }

    /// The `y` of every point of the polylines, and the plotting areas' bottoms and tops.
    fn polyline_ys(svg: &str) -> Vec<f64> {
        let doc = roxmltree::Document::parse(svg).expect("well-formed SVG");
        doc.descendants()
            .filter(|n| n.has_tag_name("polyline"))
            .flat_map(|n| {
                n.attribute("points")
                    .unwrap()
                    .split(' ')
                    .map(|p| p.split(',').nth(1).unwrap().parse::<f64>().unwrap())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn the_timeline_plots_every_second_inside_its_panels_with_the_sending_marked() {
        let mut seconds: Vec<_> = (0..12)
            .map(|s| {
                json!({"second": s, "acked": 1000 * s, "completed": 900 * s,
                       "refused": 100 * s,
                       "ack_p50_us": 2_000, "ack_p99_us": 9_000 + 1_000 * s})
            })
            .collect();
        // The drain: completions, no answers, so no latency to draw.
        seconds.push(json!({"second": 12, "acked": 0, "completed": 50,
                            "ack_p50_us": 0, "ack_p99_us": 0}));
        let svg = timeline_svg(&json!({"send_window_s": 10.0, "timeline": seconds}));
        let ys = polyline_ys(&svg);
        // Three lines of thirteen points (acknowledged, completed and refused a second), and
        // two of eleven: the latencies of seconds 1 to 11, the first and the drain's having
        // had no answer.
        assert_eq!(ys.len(), 3 * 13 + 2 * 11);
        let (top0, bottom0) = (panel(0).top, panel(0).top + PANEL);
        let (top1, bottom1) = (panel(1).top, panel(1).top + PANEL);
        assert!(
            ys[..39].iter().all(|y| (top0..=bottom0).contains(y)),
            "{ys:?}"
        );
        assert!(
            ys[39..].iter().all(|y| (top1..=bottom1).contains(y)),
            "{ys:?}"
        );
        // The refused line is its own: 1,100 at second 11, under the acknowledged 11,000.
        assert!(ys[26 + 11] > ys[11], "{ys:?}");
        // The highest value (11,000 tasks/s; an axis to 12k) reaches near the top.
        assert!(ys[11] < top0 + PANEL * 0.1, "{}", ys[11]);
        // The axes say their units and round ticks; the sending's end is marked.
        for label in [
            "tasks/s",
            "ms",
            "12k",
            "20",
            "sending stops",
            "seconds since the start",
        ] {
            assert!(svg.contains(&format!(">{label}</text>")), "{label}: {svg}");
        }
    }

    #[test]
    fn tenants_past_the_bars_drawn_are_folded_into_one_group_after_the_largest() {
        let few = tenant_bars(&tenants(&[5, 1, 3]));
        assert_eq!(
            few.iter().map(|b| b.name.as_str()).collect::<Vec<_>>(),
            ["t1", "t2", "t3"],
            "in the report's order while they fit"
        );
        let many: Vec<u64> = (1..=30).collect();
        let bars = tenant_bars(&tenants(&many));
        assert_eq!(bars.len(), TENANT_BARS_MAX);
        assert_eq!(bars[0].name, "t30");
        assert_eq!(bars[22].name, "t8");
        let others = &bars[23];
        assert_eq!(others.name, "7 others");
        assert_eq!(others.accepted, (1..=7).sum::<u64>() as f64);
        assert_eq!(others.completed, (1..=7).map(|a| a / 2).sum::<u64>() as f64);
        let svg = tenants_svg(&tenants(&many));
        roxmltree::Document::parse(&svg).expect("well-formed SVG");
        assert!(svg.contains(">7 others</text>"), "{svg}");
    }

    #[test]
    fn an_empty_report_still_draws_both_plots() {
        for svg in [timeline_svg(&json!({})), tenants_svg(&json!({}))] {
            roxmltree::Document::parse(&svg).expect("well-formed SVG");
        }
    }
}
