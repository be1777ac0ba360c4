//! Store throughput at a given batch size: full submits (idempotency key, budget reservation),
//! full claims (CAS + three pool shards + reservations + attempt + fencing token + outbox event)
//! and fenced completions (SUCCEEDED: release, attempt ended, budget settled with the actual
//! cost, outbox event), each phase timed on its own.
//!
//!   cargo run --release -p spindle-control --example store_bench -- --batch 256 --json
//!
//! Starts a private PostgreSQL (default settings: fsync and synchronous_commit on) unless
//! `--conninfo` names a server. The tasks are split over `--connections` connections working at
//! once, each like a batcher of its own with its own partitions and pool shards. The default, 2,
//! is one connection per core of this machine, as a node's control plane runs;
//! `--connections 1` shows what one PostgreSQL backend does alone.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use futures_util::future::try_join_all;
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
    /// Connections working at once, each with its own tasks, partitions and pool shards
    /// (default: one per core of this machine, as the control plane runs).
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// A server to use instead of a private one (its database must be empty or spindle's).
    #[arg(long)]
    conninfo: Option<String>,
    #[arg(long)]
    json: bool,
}

const PARTITIONS: u32 = 64;
const TENANTS: u32 = 1_000;
const POOL_SHARDS: u16 = 16;
const POOLS: [&str; 3] = [
    "provider:acme/veo",
    "model:veo-3",
    "platform:cost_per_minute",
];
const LEASE_MS: u32 = 600_000;

/// What one connection pushes through the three phases.
struct Worker {
    db: Db,
    node: String,
    tasks: Vec<NewTask>,
    shards: Vec<u16>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.batch >= 1, "--batch must be at least 1");
    anyhow::ensure!(
        (1..=16).contains(&args.connections),
        "--connections must be 1..=16"
    );
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
    let config = DbConfig::new(conninfo);
    let setup = Db::open(&config).await?;
    setup.ensure_partitions(PARTITIONS).await?;
    for pool in POOLS {
        setup.set_pool(pool, u64::MAX / 4, POOL_SHARDS).await?;
    }
    // Every tenant has a budget: submits reserve in it, completions settle it.
    setup
        .client()
        .execute(
            "INSERT INTO tenant_quota (tenant_id, budget_milli)
             SELECT generate_series(1, $1), 1000000000000000 ON CONFLICT DO NOTHING",
            &[&(TENANTS as i32)],
        )
        .await?;
    // Unique per run so a reused server does not turn submits into replays.
    let run = setup.reserve_task_ids().await?.start;

    let n = args.connections;
    let mut workers = Vec::with_capacity(n);
    for c in 0..n {
        let db = Db::open(&config).await?;
        let node = format!("bench-node-{c}");
        db.register_node(&node, "bench").await?;
        let mine: Vec<PartitionId> = (0..PARTITIONS)
            .filter(|p| *p as usize % n == c)
            .map(PartitionId)
            .collect();
        db.acquire_partitions(&node, &mine, LEASE_MS).await?;
        let tasks: Vec<NewTask> = (0..tasks as u64)
            .filter(|i| (*i % u64::from(TENANTS)) as usize % n == c)
            .map(|i| new_task(run, i))
            .collect();
        let shards = (0..POOL_SHARDS).filter(|s| *s as usize % n == c).collect();
        workers.push(Worker {
            db,
            node,
            tasks,
            shards,
        });
    }
    // Submit, claim and completion batches (the untimed advances are not counted).
    let round_trips: usize = workers
        .iter()
        .map(|w| 3 * w.tasks.len().div_ceil(args.batch))
        .sum();

    let start = Instant::now();
    try_join_all(workers.iter().map(|w| submit_all(w, args.batch))).await?;
    let submits_per_s = tasks as f64 / start.elapsed().as_secs_f64();

    let start = Instant::now();
    let tokens = try_join_all(workers.iter().map(|w| claim_all(w, args.batch))).await?;
    let claims_per_s = tasks as f64 / start.elapsed().as_secs_f64();

    // Untimed: the provider accepted and succeeded, the media stage ran.
    try_join_all(
        workers
            .iter()
            .zip(&tokens)
            .map(|(w, t)| advance_all(w, t, args.batch)),
    )
    .await?;

    let start = Instant::now();
    try_join_all(
        workers
            .iter()
            .zip(&tokens)
            .map(|(w, t)| complete_all(w, t, args.batch)),
    )
    .await?;
    let completions_per_s = tasks as f64 / start.elapsed().as_secs_f64();
    let round_trips_per_task = round_trips as f64 / tasks as f64;

    if args.json {
        println!(
            "{{\"batch\":{},\"connections\":{n},\"submits_per_s\":{submits_per_s:.0},\"claims_per_s\":{claims_per_s:.0},\"completions_per_s\":{completions_per_s:.0},\"round_trips_per_task\":{round_trips_per_task:.4}}}",
            args.batch
        );
    } else {
        println!(
            "batch {:>5} × {n} conn: {submits_per_s:>7.0} submits/s {claims_per_s:>7.0} claims/s {completions_per_s:>7.0} completions/s {round_trips_per_task:.4} round trips/task ({tasks} tasks)",
            args.batch
        );
    }
    Ok(())
}

fn new_task(run: u64, i: u64) -> NewTask {
    let tenant = (i % u64::from(TENANTS)) as u32 + 1;
    NewTask {
        task: TaskId(run * 1_000_000 + i),
        tenant: TenantId(tenant),
        user: UserId(tenant),
        idempotency_key: format!("run{run}-req{i}"),
        payload: format!("{{\"model\":0,\"w\":1280,\"h\":720,\"ms\":5000,\"i\":{i}}}").into_bytes(),
        // Partition by tenant - 1 so that connection c's tenants are in its partitions.
        partition: PartitionId((tenant - 1) % PARTITIONS),
        lane: Lane::Standard,
        band: Band::P2,
        cost_estimate_milli: 1_000,
        fairness_milli: 1_000,
    }
}

async fn submit_all(w: &Worker, batch: usize) -> Result<()> {
    for chunk in w.tasks.chunks(batch) {
        let out = w.db.submit_batch(chunk, PolicyVersion(1)).await?;
        anyhow::ensure!(
            out.iter().all(|o| *o == SubmitOutcome::Created),
            "submit: {out:?}"
        );
    }
    Ok(())
}

async fn claim_all(w: &Worker, batch: usize) -> Result<Vec<FencingToken>> {
    let claims: Vec<ClaimRequest> = w
        .tasks
        .iter()
        .enumerate()
        .map(|(i, t)| ClaimRequest {
            task: t.task,
            expected_version: 0,
            provider: "acme".into(),
            demands: POOLS
                .iter()
                .map(|p| Demand {
                    shard: PoolShard::new(*p, w.shards[i % w.shards.len()]),
                    amount: 1,
                })
                .collect(),
        })
        .collect();
    let mut tokens = Vec::with_capacity(claims.len());
    for chunk in claims.chunks(batch) {
        for r in w.db.claim_batch(&w.node, LEASE_MS, chunk).await? {
            match r {
                ClaimResult::Granted { token, .. } => tokens.push(token),
                refused => anyhow::bail!("claim refused: {refused:?}"),
            }
        }
    }
    Ok(tokens)
}

async fn advance_all(w: &Worker, tokens: &[FencingToken], batch: usize) -> Result<()> {
    for state in [
        TaskState::Running,
        TaskState::ProviderSucceeded,
        TaskState::MediaProcessing,
    ] {
        let reports: Vec<Report> = w
            .tasks
            .iter()
            .zip(tokens)
            .map(|(t, token)| Report {
                task: t.task,
                token: Some(*token),
                via: Vec::new(),
                action: ReportAction::Advance(state),
            })
            .collect();
        for chunk in reports.chunks(batch) {
            for r in w.db.report_batch(chunk).await? {
                anyhow::ensure!(matches!(r, ReportResult::Applied { .. }), "advance: {r:?}");
            }
        }
    }
    Ok(())
}

async fn complete_all(w: &Worker, tokens: &[FencingToken], batch: usize) -> Result<()> {
    let reports: Vec<Report> = w
        .tasks
        .iter()
        .zip(tokens)
        .map(|(t, token)| Report {
            task: t.task,
            token: Some(*token),
            via: Vec::new(),
            action: ReportAction::Finish {
                state: TaskState::Succeeded,
                cost_actual_milli: Some(1_100),
                reason: None,
                result: None,
            },
        })
        .collect();
    for chunk in reports.chunks(batch) {
        for r in w.db.report_batch(chunk).await? {
            anyhow::ensure!(
                matches!(r, ReportResult::Applied { released: 3, .. }),
                "report: {r:?}"
            );
        }
    }
    Ok(())
}
