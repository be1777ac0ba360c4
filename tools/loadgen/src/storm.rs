//! `storm`: a private PostgreSQL, spindle-mock-provider and an in-process spindled, with both
//! provider accounts in a 429 storm (their real limits are half of the contract the node is
//! configured with). One tenant offers more than the real limits for a while; every second the
//! mock's counters are sampled. The curve shows whether the accepted rate converges to the
//! provider's real limit (the node halves an account's rate for two minutes after a 429) or
//! oscillates, and the end shows whether any task failed that a later retry could have served.

use std::path::Path;
use std::time::{Duration, Instant};

use spindle_client::Client;
use spindle_core::TenantId;
use spindle_providers::api::Fault;

/// The contract per account; the storm's real limits are half of it.
const CONCURRENCY: u64 = 40;
const RPM: u64 = 1_200;

pub struct Options {
    pub seconds: u64,
    /// Tasks a second the tenant offers.
    pub rate: u64,
    pub out: std::path::PathBuf,
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Second {
    second: u64,
    accepted: u64,
    rate_limited: u64,
    violations: u64,
}

pub fn run(opts: Options) -> anyhow::Result<()> {
    crate::harness::with_private_postgres("storm", |conninfo, dir| async move {
        storm(&opts, &conninfo, &dir).await.map(|()| true)
    })
}

async fn storm(opts: &Options, conninfo: &str, dir: &Path) -> anyhow::Result<()> {
    let mock = crate::harness::mock(CONCURRENCY, RPM, 500, "storm").await?;
    let admin = mock.client(Duration::from_secs(5));
    for a in crate::harness::ACCOUNTS {
        admin.set_fault(a, Fault::RateLimit).await?;
    }
    let ready = dir.join("ready");
    let config_text = format!(
        r#"node_id = "storm"
listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
postgres = "{conninfo}"
provider_concurrency = {CONCURRENCY}
provider_rpm = {RPM}
lane_capacity_units = 100000

[provider]
url = "{}"
secret = "storm"
poll_ms = [500, 1000]

[[tenants]]
id = 1
credential = "storm-credential-1"
"#,
        mock.base_url()
    );
    let config = crate::toml_config(&config_text, &ready)?;
    let addr = crate::start_node("spindled", config, &ready)?.client;
    let client = Client::connect(addr, TenantId(1), "storm-credential-1").await?;
    let real = 2 * RPM / 2 / 60;
    println!(
        "storm: 2 accounts, contract {RPM}/min each, real limit {}/min each ({real}/s together); \
         offering {}/s for {} s",
        RPM / 2,
        opts.rate,
        opts.seconds
    );

    // Offer load in a task of its own; sample the mock every second meanwhile.
    let rate = opts.rate.max(1);
    let seconds = opts.seconds;
    let sender = tokio::spawn(async move {
        let gap = Duration::from_nanos(1_000_000_000 / rate);
        let start = tokio::time::Instant::now();
        let mut n = 0u64;
        let mut accepted = 0u64;
        while start.elapsed() < Duration::from_secs(seconds) {
            tokio::time::sleep_until(start + gap * n as u32).await;
            n += 1;
            let t = crate::harness::video_task(format!("storm-{n}"));
            if let Ok(a) = client.submit(t).await {
                accepted += u64::from(a.decision.is_accepted());
            }
        }
        accepted
    });
    let mut curve = Vec::new();
    let mut last = (0u64, 0u64);
    let start = Instant::now();
    for second in 1..=seconds {
        tokio::time::sleep_until(tokio::time::Instant::from_std(
            start + Duration::from_secs(second),
        ))
        .await;
        let stats = admin.mock_stats().await?;
        let (acc, rl, viol) = stats.accounts.values().fold((0, 0, 0), |(a, r, v), s| {
            (
                a + s.accepted,
                r + s.rate_limited,
                v + s.concurrency_violations + s.rpm_violations + s.duplicate_keys,
            )
        });
        curve.push(Second {
            second,
            accepted: acc - last.0,
            rate_limited: rl - last.1,
            violations: viol,
        });
        last = (acc, rl);
    }
    let submitted = sender.await?;
    println!("second  accepted/s  429/s  violations");
    for s in &curve {
        println!(
            "{:>6}  {:>10}  {:>5}  {:>10}",
            s.second, s.accepted, s.rate_limited, s.violations
        );
    }
    let tail: Vec<&Second> = curve.iter().skip(curve.len() / 2).collect();
    let mean = tail.iter().map(|s| s.accepted).sum::<u64>() as f64 / tail.len().max(1) as f64;
    let tail_429: u64 = tail.iter().map(|s| s.rate_limited).sum();
    println!(
        "second half: {mean:.1} accepted/s against a real limit of {real}/s ({:.0} %), {tail_429} answers 429",
        100.0 * mean / real as f64
    );
    let states = crate::final_states(conninfo).await?;
    println!("tasks: {submitted} accepted by the node; by state at the end: {states:?}");
    std::fs::create_dir_all(&opts.out)?;
    let report = serde_json::json!({
        "contract_rpm_per_account": RPM,
        "real_per_s": real,
        "offered_per_s": opts.rate,
        "curve": curve,
        "second_half_mean_accepted_per_s": mean,
        "second_half_429": tail_429,
        "states": states,
    });
    std::fs::write(
        opts.out.join("storm.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    std::fs::write(opts.out.join("storm.svg"), svg(&curve, real))?;
    println!(
        "report: {}/storm.json; plot: {}/storm.svg",
        opts.out.display(),
        opts.out.display()
    );
    Ok(())
}

/// Accepted and 429 answers per second through the storm, against the real limit.
fn svg(curve: &[Second], real: u64) -> String {
    use crate::plot::{panel, Mark, Series, Svg};
    // Each second holds what the provider saw in the second before it: nothing at the start.
    let column = |f: fn(&Second) -> u64| -> Vec<f64> {
        std::iter::once(0.0)
            .chain(curve.iter().map(|s| f(s) as f64))
            .collect()
    };
    let limit = format!("real limit {real}/s");
    let mut svg = Svg::stacked(1);
    svg.lines(
        panel(0),
        "The mock provider's answers during a 429 storm",
        "per s",
        &[
            Series {
                name: "accepted",
                color: "#1f77b4",
                values: column(|s| s.accepted),
            },
            Series {
                name: "429",
                color: "#d62728",
                values: column(|s| s.rate_limited),
            },
        ],
        &[Mark::Level(real as f64, &limit)],
    );
    svg.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_storm_plot_draws_both_answers_against_the_limit() {
        let curve: Vec<Second> = (1..=3)
            .map(|second| Second {
                second,
                accepted: 18 + second,
                rate_limited: 3 - second,
                violations: 0,
            })
            .collect();
        let svg = svg(&curve, 20);
        let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        let lines: Vec<usize> = doc
            .descendants()
            .filter(|n| n.has_tag_name("polyline"))
            .map(|n| n.attribute("points").unwrap().split(' ').count())
            .collect();
        // Both series, each from a zero at the start through the three seconds.
        assert_eq!(lines, [4, 4]);
        assert!(svg.contains(">real limit 20/s</text>"), "{svg}");
    }
}
