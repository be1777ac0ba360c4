//! Store throughput at a given batch size: full submits (idempotency key, budget reservation),
//! full claims (CAS + three pool shards + reservations + attempt + fencing token + outbox event)
//! and fenced completions with release, each phase timed on its own.
//!
//!   cargo run --release -p spindle-control --example store_bench -- --batch 256 --json
//!
//! Starts a private PostgreSQL (default settings: fsync and synchronous_commit on) unless
//! `--conninfo` names a server.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use spindle_control::{
    ClaimRequest, ClaimResult, Db, DbConfig, Demand, EmbeddedOptions, EmbeddedPostgres, NewTask,
    PartitionId, PoolShard, Report, ReportAction, ReportResult, SubmitOutcome,
};
use spindle_core::{Band, FencingToken, Lane, PolicyVersion, TaskId, TaskState, TenantId, UserId};

#[derive(Parser)]
struct Args {
    /// Rows per transaction.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Tasks to push through each phase (default: 100 × batch, between 2,000 and 50,000).
    #[arg(long)]
    tasks: Option<usize>,
    /// A server to use instead of a private one (its database must be empty or spindle's).
    #[arg(long)]
    conninfo: Option<String>,
    #[arg(long)]
    json: bool,
}

const NODE: &str = "bench-node";
const PARTITIONS: u32 = 64;
const TENANTS: u32 = 1_000;
const POOL_SHARDS: u16 = 16;
const POOLS: [&str; 3] = [
    "provider:acme/veo",
    "model:veo-3",
    "platform:cost_per_minute",
];

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.batch >= 1, "--batch must be at least 1");
    let tasks = args
        .tasks
        .unwrap_or((args.batch * 100).clamp(2_000, 50_000));
    let _server;
    let conninfo = match &args.conninfo {
        Some(c) => c.clone(),
        None => {
            let pg = EmbeddedPostgres::start(EmbeddedOptions::default())
                .context("starting a private PostgreSQL")?;
            let c = pg.conninfo("postgres");
            _server = pg;
            c
        }
    };
    let db = Db::open(&DbConfig::new(conninfo)).await?;
    db.register_node(NODE, "bench").await?;
    db.ensure_partitions(PARTITIONS).await?;
    let parts: Vec<PartitionId> = (0..PARTITIONS).map(PartitionId).collect();
    db.acquire_partitions(NODE, &parts, 600_000).await?;
    for pool in POOLS {
        db.set_pool(pool, u64::MAX / 4, POOL_SHARDS).await?;
    }
    // Unique per run so a reused server does not turn submits into replays.
    let ids = db.reserve_task_ids().await?;
    let first = ids.start;
    let run = first;
    let mut round_trips = 0u64;

    let new_tasks: Vec<NewTask> = (0..tasks as u64)
        .map(|i| {
            let tenant = (i % u64::from(TENANTS)) as u32 + 1;
            NewTask {
                task: TaskId(first * 1_000_000 + i),
                tenant: TenantId(tenant),
                user: UserId(tenant),
                idempotency_key: format!("run{run}-req{i}"),
                payload: format!("{{\"model\":0,\"w\":1280,\"h\":720,\"ms\":5000,\"i\":{i}}}")
                    .into_bytes(),
                partition: PartitionId(tenant % PARTITIONS),
                lane: Lane::Standard,
                band: Band::P2,
                cost_estimate_milli: 1_000,
                fairness_milli: 1_000,
            }
        })
        .collect();

    let start = Instant::now();
    for chunk in new_tasks.chunks(args.batch) {
        let out = db.submit_batch(chunk, PolicyVersion(1)).await?;
        round_trips += 1;
        anyhow::ensure!(
            out.iter().all(|o| *o == SubmitOutcome::Created),
            "submit: {out:?}"
        );
    }
    let submits_per_s = tasks as f64 / start.elapsed().as_secs_f64();

    let claims: Vec<ClaimRequest> = new_tasks
        .iter()
        .enumerate()
        .map(|(i, t)| ClaimRequest {
            task: t.task,
            expected_version: 0,
            provider: "acme".into(),
            demands: POOLS
                .iter()
                .map(|p| Demand {
                    shard: PoolShard::new(*p, (i % usize::from(POOL_SHARDS)) as u16),
                    amount: 1,
                })
                .collect(),
        })
        .collect();
    let mut tokens: Vec<FencingToken> = Vec::with_capacity(tasks);
    let start = Instant::now();
    for chunk in claims.chunks(args.batch) {
        for r in db.claim_batch(NODE, 600_000, chunk).await? {
            match r {
                ClaimResult::Granted { token, .. } => tokens.push(token),
                refused => anyhow::bail!("claim refused: {refused:?}"),
            }
        }
        round_trips += 1;
    }
    let claims_per_s = tasks as f64 / start.elapsed().as_secs_f64();

    let reports: Vec<Report> = new_tasks
        .iter()
        .zip(&tokens)
        .map(|(t, token)| Report {
            task: t.task,
            token: Some(*token),
            action: ReportAction::Finish {
                state: TaskState::Failed,
                cost_actual_milli: None,
                reason: Some("bench".into()),
            },
        })
        .collect();
    let start = Instant::now();
    for chunk in reports.chunks(args.batch) {
        for r in db.report_batch(chunk).await? {
            anyhow::ensure!(
                matches!(r, ReportResult::Applied { released: 3, .. }),
                "report: {r:?}"
            );
        }
        round_trips += 1;
    }
    let completions_per_s = tasks as f64 / start.elapsed().as_secs_f64();
    let round_trips_per_task = round_trips as f64 / tasks as f64;

    if args.json {
        println!(
            "{{\"batch\":{},\"submits_per_s\":{submits_per_s:.0},\"claims_per_s\":{claims_per_s:.0},\"completions_per_s\":{completions_per_s:.0},\"round_trips_per_task\":{round_trips_per_task:.4}}}",
            args.batch
        );
    } else {
        println!(
            "batch {:>5}: {submits_per_s:>9.0} submits/s  {claims_per_s:>9.0} claims/s  {completions_per_s:>9.0} completions/s  {round_trips_per_task:.4} round trips/task ({tasks} tasks)",
            args.batch
        );
    }
    Ok(())
}
