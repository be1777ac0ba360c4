//! `spindle-sim`: run scenarios through spindle's policy and the baselines, print the comparison.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use spindle_sim::report::{human, Report, ScenarioReport};
use spindle_sim::{run, PolicyKind, RunOptions, Scenario};

/// Deterministic simulator: the same trace through spindle, FIFO, WRR-by-count and a global
/// priority queue.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// One scenario file.
    #[arg(long, conflicts_with = "all")]
    scenario: Option<PathBuf>,
    /// Every `*.toml` in the scenarios directory.
    #[arg(long)]
    all: bool,
    /// Where `--all` looks.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios"))]
    scenarios_dir: PathBuf,
    /// Overrides the scenario's seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Only these policies (default: all four).
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Check every scheduler invariant every N events (0: at the end only).
    #[arg(long, default_value_t = 0)]
    check_every: u64,
    /// Draw N scenarios at random (`spindle_sim::random`: its docs give the space) with
    /// `--seed` (default 1), run spindle's policy on each and check its promises: no limit
    /// exceeded, no job submitted twice, no task starved, service gaps within their bounds
    /// (per shard and node-wide), shares of tenants entitled to 50+ of their DRR bounds
    /// within 0.02.
    /// Exits 1 if one was broken, naming the scenario (`--print-random I` prints it).
    #[arg(long, conflicts_with_all = ["scenario", "all"])]
    random: Option<u64>,
    /// Print the TOML of random scenario I (of `--seed`) and exit.
    #[arg(long)]
    print_random: Option<u64>,
    /// Split node-wide limits by backlogged weight alone, without correcting for the shards'
    /// lags behind the node's virtual time (the split before issue 53, to compare with).
    #[arg(long)]
    uncorrected_split: bool,
}

/// Runs `n` random scenarios of `seed` through spindle's policy; whether every promise held.
fn run_random(n: u64, seed: u64, args: &Args) -> Result<bool> {
    let options = RunOptions {
        check_every: args.check_every,
        uncorrected_split: args.uncorrected_split,
        ..RunOptions::default()
    };
    let mut all_kept = true;
    let mut rows = Vec::new();
    for index in 0..n {
        let scenario = spindle_sim::random::scenario(seed, index)?;
        let started = Instant::now();
        let outcome = std::panic::catch_unwind(|| spindle_sim::random::check(&scenario, options));
        let (report, broken) = match outcome {
            Ok((mut report, broken)) => {
                report.sim_wall_ms = started.elapsed().as_millis() as u64;
                (Some(report), broken)
            }
            Err(_) => (
                None,
                vec!["the run panicked (an invariant broke)".to_string()],
            ),
        };
        all_kept &= broken.is_empty();
        let tenants: u64 = scenario.tenants.iter().map(|g| *g.count.get_ref()).sum();
        let shards = *scenario.shards.get_ref();
        if args.json {
            rows.push(serde_json::json!({
                "index": index, "shards": shards, "tenants": tenants,
                "report": report, "broken": broken,
            }));
        } else {
            let r = report.as_ref();
            println!(
                "{index:>5} shards={shards} tenants={tenants:>4} share_error={:.3} gap={:.1}/{:.1} \
                 completed={} wall_ms={} {}",
                r.map_or(f64::NAN, |r| r.share_error_max),
                r.map_or(f64::NAN, |r| r.service_gap_max_units),
                r.map_or(f64::NAN, |r| r.drr_bound_units),
                r.map_or(0, |r| r.tasks_completed),
                r.map_or(0, |r| r.sim_wall_ms),
                if broken.is_empty() {
                    "ok".to_string()
                } else {
                    format!("BROKEN: {} (--print-random {index} --seed {seed})", broken.join("; "))
                },
            );
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).expect("rows serialize")
        );
    }
    Ok(all_kept)
}

fn scenario_files(args: &Args) -> Result<Vec<PathBuf>> {
    if let Some(file) = &args.scenario {
        return Ok(vec![file.clone()]);
    }
    if !args.all {
        bail!("give --scenario FILE or --all");
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&args.scenarios_dir)
        .with_context(|| format!("reading {}", args.scenarios_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    Ok(files)
}

fn policies(args: &Args) -> Result<Vec<PolicyKind>> {
    if args.policies.is_empty() {
        return Ok(PolicyKind::ALL.to_vec());
    }
    args.policies
        .iter()
        .map(|name| {
            PolicyKind::ALL
                .into_iter()
                .find(|k| k.name() == name)
                .with_context(|| {
                    format!("unknown policy `{name}` (spindle, fifo, wrr_count, global_priority)")
                })
        })
        .collect()
}

fn run_file(path: &Path, args: &Args, kinds: &[PolicyKind]) -> Result<ScenarioReport> {
    let mut scenario = Scenario::load(path)?;
    if let Some(seed) = args.seed {
        scenario.seed = seed;
    }
    let options = RunOptions {
        check_every: args.check_every,
        uncorrected_split: args.uncorrected_split,
        ..RunOptions::default()
    };
    let mut policies = Vec::new();
    for &kind in kinds {
        let started = Instant::now();
        let seed = scenario.seed;
        let outcome = std::panic::catch_unwind(|| run(&scenario, kind, options));
        let mut report = match outcome {
            Ok(report) => report,
            Err(_) => bail!(
                "{} failed under policy {} with seed {seed} (rerun with --seed {seed})",
                scenario.name,
                kind.name()
            ),
        };
        report.sim_wall_ms = started.elapsed().as_millis() as u64;
        eprintln!(
            "{}: {} done in {} ms",
            scenario.name,
            kind.name(),
            report.sim_wall_ms
        );
        policies.push(report);
    }
    Ok(ScenarioReport {
        name: scenario.name.clone(),
        seed: scenario.seed,
        fairness_scenario: scenario.fairness,
        policies,
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or(1);
    if let Some(index) = args.print_random {
        print!("{}", spindle_sim::random::scenario_toml(seed, index));
        return ExitCode::SUCCESS;
    }
    if let Some(n) = args.random {
        return match run_random(n, seed, &args) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let result = (|| -> Result<Report> {
        let kinds = policies(&args)?;
        let mut scenarios = Vec::new();
        for file in scenario_files(&args)? {
            scenarios.push(run_file(&file, &args, &kinds)?);
        }
        Ok(Report { scenarios })
    })();
    match result {
        Ok(report) if args.json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).expect("report serializes")
            );
            ExitCode::SUCCESS
        }
        Ok(report) => {
            print!("{}", human(&report));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
