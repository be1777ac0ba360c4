//! The control plane's thread: a tokio runtime owning the PostgreSQL connections. Pipelines come
//! in pairs (one connection and one task each), shared by the shards of the pair
//! (`control_pipelines`: shard i uses pair i % pairs): one for submits and task-id blocks, so
//! acknowledgements never queue behind claim and report batches, and one for the work — claims
//! and reports, which reach PostgreSQL in the order each shard sent them. A shard sends a task's
//! claim only after its submit committed, so the two never race. Consecutive messages of one
//! kind, from any of the pair's shards, are merged into one batch (group commit across clients
//! and shards).
//!
//! Here: the messages, and `start` (connections, registration, partitions, recovery, restores).
//! `pipeline` forms and runs the batches (and the reads), `restore` takes a previous owner's
//! tasks back, `leases` renews and takes over partitions and runs retention.

mod leases;
mod pipeline;
mod rates;
mod restore;
pub mod split;

use leases::LeaseLoop;
use pipeline::reader;
pub(crate) use pipeline::reconnect;
pub use pipeline::{pipeline, InputUnread, PipelineSetup, ReadMsg, StoredInput, READ_QUEUE_MAX};
pub(crate) use restore::owned_restore;
use restore::{load_restores, recover_attempts, Followed};
pub use restore::{queued as restore_queued, LiveRestore, Restore, ShardRestores, Unrestorable};
use spindle_control::cluster_shares::Want;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use spindle_control::query::TaskHead;
use spindle_control::submit::ClaimedSubmit;
use spindle_control::{
    ClaimRequest, ClaimResult, Db, DbConfig, NewTask, PartitionId, Report, ReportResult, StoreError,
};
use spindle_core::{PolicyVersion, TaskId};
use tokio::sync::{mpsc, oneshot};

pub use spindle_node_base::limits::PIPELINE_QUEUE_MAX;
use spindle_node_base::limits::{PROVIDER_POOL_SHARDS_MAX, STORE_WAIT_DELAY_MAX};
use spindle_node_base::metrics::Metrics;
use spindle_node_base::overload::{PathGauge, Queued};
use spindle_node_base::ownership::Ownership;

pub type Reply<T> = oneshot::Sender<Result<Vec<T>, StoreError>>;

pub enum CpMsg {
    /// New tasks, each with its first claim when the shard picked it already (taken in the
    /// submit's transaction when the whole batch can be: `spindle_submit_claim`).
    Submit {
        tasks: Vec<(NewTask, Option<ClaimRequest>)>,
        /// The policy version the tasks were admitted under.
        version: PolicyVersion,
        reply: Reply<ClaimedSubmit>,
        /// The rows counted as waiting in the pipeline's gauge until it takes them.
        queued: Queued,
    },
    Claim {
        claims: Vec<ClaimRequest>,
        reply: Reply<ClaimResult>,
        queued: Queued,
    },
    Report {
        reports: Vec<Report>,
        reply: Reply<ReportResult>,
        queued: Queued,
    },
    /// A new block of task ids.
    TaskIds {
        reply: oneshot::Sender<Result<std::ops::Range<u64>, StoreError>>,
    },
    /// The rows of tasks as they are now: what decides a submit or a claim in doubt.
    Lookup {
        tasks: Vec<TaskId>,
        reply: Reply<Option<TaskHead>>,
    },
    /// Extend the leases of the shard's live attempts (fenced: an attempt that moved on is
    /// not renewed). Nobody waits for it: a renewal lost to an outage is made by the next one.
    Renew {
        attempts: Vec<(TaskId, spindle_core::FencingToken)>,
    },
    /// Store that clients canceled these tasks, before the cancels are answered
    /// (`Db::request_cancel`): each answer says whether the task was marked.
    Cancel {
        tasks: Vec<TaskId>,
        reply: Reply<bool>,
    },
}

impl CpMsg {
    fn rows(&self) -> usize {
        match self {
            CpMsg::Submit { tasks, .. } => tasks.len(),
            CpMsg::Claim { claims, .. } => claims.len(),
            CpMsg::Report { reports, .. } => reports.len(),
            CpMsg::TaskIds { .. } => 0,
            CpMsg::Lookup { tasks, .. } => tasks.len(),
            CpMsg::Renew { attempts } => attempts.len(),
            CpMsg::Cancel { tasks, .. } => tasks.len(),
        }
    }

    fn same_kind(&self, other: &CpMsg) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
            && !matches!(self, CpMsg::TaskIds { .. })
    }

    fn tasks(&self) -> Vec<TaskId> {
        match self {
            CpMsg::Submit { tasks, .. } => tasks.iter().map(|(t, _)| t.task).collect(),
            CpMsg::Claim { claims, .. } => claims.iter().map(|c| c.task).collect(),
            CpMsg::Report { reports, .. } => reports.iter().map(|r| r.task).collect(),
            CpMsg::TaskIds { .. } => Vec::new(),
            CpMsg::Lookup { tasks, .. } => tasks.clone(),
            CpMsg::Renew { attempts } => attempts.iter().map(|(t, _)| *t).collect(),
            CpMsg::Cancel { tasks, .. } => tasks.clone(),
        }
    }
}

/// What the control plane prepared before the shards start.
pub struct Started {
    /// The effective policy (the configuration's with the store's objects over it).
    pub policy: spindle_core::Policy,
    pub reads: mpsc::Sender<ReadMsg>,
    pub pipes: Vec<Pipes>,
    pub id_blocks: Vec<std::ops::Range<u64>>,
    /// Per shard: QUEUED tasks of its partitions to put back before serving.
    pub restores: Vec<ShardRestores>,
    /// The node's limits split among its shards (taken once by the caller).
    pub split: Option<crate::control::split::SplitBoard>,
}

/// A pair of pipelines, as one shard sees it (the shards of a pair share it).
#[derive(Clone)]
pub struct Pipes {
    /// Submits and task-id blocks.
    pub submits: mpsc::Sender<CpMsg>,
    /// Claims and reports, in order.
    pub work: mpsc::Sender<CpMsg>,
    /// Submit calls the submit pipeline has started: the turn of the pool rows the pair's
    /// shards' next claims ask for ([`preferred_pool_shard`]).
    pub submit_calls: Arc<AtomicU64>,
    /// How loaded each pipeline is: what admission reads to refuse new work it could not make
    /// durable within its budget (`spindle_node_base::overload`).
    pub submit_gauge: Arc<PathGauge>,
    pub work_gauge: Arc<PathGauge>,
}

/// The first connection of a starting node: tried again with backoff while PostgreSQL does
/// not answer (down, starting up, recovering), for `wait_s` seconds (0: as long as it takes).
/// Meanwhile `/readyz` says what the node waits for, and the log does every
/// [`STORE_WAIT_LOG`].
async fn wait_for_store(
    db_config: &DbConfig,
    metrics: &Metrics,
    wait_s: u64,
) -> anyhow::Result<Db> {
    let began = std::time::Instant::now();
    let mut delay =
        std::time::Duration::from_millis(u64::from(db_config.backoff_initial_ms).max(10))
            .min(STORE_WAIT_DELAY_MAX);
    let delay_max = std::time::Duration::from_millis(u64::from(db_config.backoff_max_ms))
        .clamp(delay, STORE_WAIT_DELAY_MAX);
    let mut logged: Option<std::time::Instant> = None;
    let mut attempt = 0u64;
    loop {
        attempt += 1;
        match Db::open(db_config).await {
            Ok(db) => {
                if attempt > 1 {
                    tracing::info!(
                        "PostgreSQL answered after {attempt} attempts ({} s)",
                        began.elapsed().as_secs()
                    );
                }
                return Ok(db);
            }
            Err(e) if e.is_unavailable() => {
                let waited = began.elapsed();
                anyhow::ensure!(
                    wait_s == 0 || waited < std::time::Duration::from_secs(wait_s),
                    "PostgreSQL did not answer within postgres_wait_s ({wait_s} s): {e}"
                );
                let why = format!(
                    "waiting for PostgreSQL (attempt {attempt}, {} s): {e}",
                    waited.as_secs()
                );
                if logged.is_none_or(|at| at.elapsed() >= STORE_WAIT_LOG) {
                    tracing::warn!("{why}");
                    logged = Some(std::time::Instant::now());
                }
                if let Ok(mut w) = metrics.starting.lock() {
                    *w = why;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(delay_max);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// How often a node waiting for PostgreSQL at its start says so in the log.
const STORE_WAIT_LOG: std::time::Duration = std::time::Duration::from_secs(10);

/// Opens the pipelines' connections (migrating on the first), registers the node, takes the
/// partitions and the pools, and starts the pipelines on `rt`.
pub async fn start(
    config: &spindle_node_base::config::Config,
    db_config: &DbConfig,
    live: &Arc<crate::live_policy::LivePolicy>,
    metrics: &Arc<Metrics>,
    ownership: &Arc<Ownership>,
    shard_inboxes: Vec<mpsc::Sender<spindle_node_base::messages::ShardMsg>>,
) -> anyhow::Result<Started> {
    let mut admin = wait_for_store(db_config, metrics, config.postgres_wait_s).await?;
    let policy = live.load(&mut admin, metrics).await?;
    register(&admin, config).await?;
    let (preferred, held) = take_partitions(&admin, config).await?;
    for p in &policy.providers {
        set_provider_pool(&admin, &p.name, p.concurrency).await?;
    }
    recover_attempts(&admin, &held, &Followed::new(config, &policy)).await?;
    let restores = load_restores(&admin, config, &policy, &held).await?;
    for p in &held {
        ownership.set(*p, true);
    }
    ownership.set_owners(&admin.partition_owners().await?, &config.node_id);
    metrics.live_nodes.store(
        u64::from(admin.live_nodes(config.lease_ms).await?),
        std::sync::atomic::Ordering::Relaxed,
    );
    let split = first_shares(&mut admin, config, &policy, ownership).await?;
    let warm = warm_up(config, &policy, &held);
    let pipes = open_pipelines(config, db_config, metrics, warm).await?;
    let mut id_blocks = Vec::new();
    for _ in 0..config.shards {
        id_blocks.push(admin.reserve_task_ids().await?);
    }
    let lease = LeaseLoop {
        admin,
        config: config.clone(),
        db_config: db_config.clone(),
        metrics: metrics.clone(),
        ownership: ownership.clone(),
        live: live.clone(),
        preferred,
        prune_from: None,
        relays_seen: Vec::new(),
    };
    spawn_background(
        config,
        db_config,
        live,
        metrics,
        ownership,
        lease,
        shard_inboxes,
    )?;
    let (reads, read_rx) = mpsc::channel(READ_QUEUE_MAX);
    tokio::spawn(reader(
        Db::open_with_backoff(db_config).await?,
        db_config.clone(),
        metrics.clone(),
        read_rx,
    ));
    Ok(Started {
        policy,
        reads,
        pipes,
        id_blocks,
        restores,
        split: Some(split),
    })
}

/// Registers the node (its client address, whether it relays events), and warns when other
/// nodes relay the cluster's events and this one has no `[events]`.
async fn register(admin: &Db, config: &spindle_node_base::config::Config) -> anyhow::Result<()> {
    admin
        .register_node(&config.node_id, &config.client_address(config.listen))
        .await?;
    admin
        .set_relay(
            &config.node_id,
            config.events.as_ref().map(|e| e.pending_max),
        )
        .await?;
    let events_window = spindle_node_base::config::retention_window(config.retention_events_s);
    let relaying: Vec<String> = admin
        .relaying_nodes(&config.node_id, events_window)
        .await?
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    if config.events.is_none() && !relaying.is_empty() {
        tracing::warn!(
            "this node has no [events] but {relaying:?} relay the cluster's events: it keeps \
             what they have yet to send while one of them is heard from; give every node of a \
             cluster the same [events]"
        );
    }
    Ok(())
}

/// Takes this node's preferred partitions where they are free: returns them and those held.
async fn take_partitions(
    admin: &Db,
    config: &spindle_node_base::config::Config,
) -> anyhow::Result<(Vec<PartitionId>, Vec<PartitionId>)> {
    admin.ensure_partitions(config.partitions).await?;
    let preferred = preferred_partitions(config);
    let held: Vec<PartitionId> = admin
        .acquire_partitions(&config.node_id, &preferred, config.lease_ms)
        .await?
        .into_iter()
        .map(|l| l.partition)
        .collect();
    if held.len() < preferred.len() {
        tracing::warn!(
            "{} of the {} partitions this node prefers are held by other nodes; it takes them \
             over if their leases expire",
            preferred.len() - held.len(),
            preferred.len()
        );
    }
    Ok((preferred, held))
}

/// The node-wide limits' board, and the node's first parts of what it shares with the
/// cluster.
async fn first_shares(
    admin: &mut Db,
    config: &spindle_node_base::config::Config,
    policy: &spindle_core::Policy,
    ownership: &Arc<Ownership>,
) -> anyhow::Result<crate::control::split::SplitBoard> {
    // The node's parts of what it shares with the cluster before it serves: it holds none until
    // the first allotment (nothing of its own waits yet: it asks for its standby part, or an
    // even one; what its resumed attempts run comes with the next round).
    let split = crate::control::split::split_board(policy, config.shards);
    ownership.init_shares(split.board.limits(), split.shared.clone());
    let idle: Vec<Want> = split
        .shared
        .iter()
        .map(|l| Want {
            limit: l.name.clone(),
            whole: rates::whole(l, &split.board),
            rate: l.rate,
            weight: 0,
            used: 0,
        })
        .collect();
    let parts = admin
        .allot_shares(&config.node_id, config.lease_ms, &idle)
        .await?;
    for (l, part) in split.shared.iter().zip(parts) {
        ownership.set_share(l.place, part);
    }
    Ok(split)
}

/// What the pipelines' connections run before they serve: a partition this node holds and its
/// first provider account (without either there is no hot path to warm).
fn warm_up(
    config: &spindle_node_base::config::Config,
    policy: &spindle_core::Policy,
    held: &[PartitionId],
) -> Option<Arc<spindle_control::WarmUp>> {
    match (held.first(), policy.providers.first()) {
        (Some(&partition), Some(provider)) => Some(Arc::new(spindle_control::WarmUp {
            node: config.node_id.clone(),
            lease_ms: config.lease_ms,
            partition,
            provider: provider.name.clone(),
            pool: spindle_control::PoolShard::new(provider_pool(&provider.name), 0),
            policy_version: policy.version,
        })),
        _ => None,
    }
}

/// The pairs of pipelines (submits; claims and reports), each shard's the pair `i % pairs`.
async fn open_pipelines(
    config: &spindle_node_base::config::Config,
    db_config: &DbConfig,
    metrics: &Arc<Metrics>,
    warm: Option<Arc<spindle_control::WarmUp>>,
) -> anyhow::Result<Vec<Pipes>> {
    let mut pipes = Vec::new();
    let open_pipeline = async |submit_calls: Option<Arc<AtomicU64>>,
                               report_hold: Duration,
                               gauge: Arc<PathGauge>|
           -> anyhow::Result<mpsc::Sender<CpMsg>> {
        let (tx, rx) = mpsc::channel(PIPELINE_QUEUE_MAX);
        let db = Db::open_with_backoff(db_config).await?;
        let setup = PipelineSetup {
            db: pipeline::warmed(db, db_config, warm.as_deref()).await?,
            db_config: db_config.clone(),
            node: config.node_id.clone(),
            lease_ms: config.lease_ms,
            batch_max: config.batch_max,
            metrics: metrics.clone(),
            submit_calls,
            report_hold,
            warm: warm.clone(),
            gauge,
        };
        tokio::spawn(pipeline(setup, rx));
        Ok(tx)
    };
    for _ in 0..config.control_pipelines() {
        let submit_calls = Arc::new(AtomicU64::new(0));
        let submit_gauge = PathGauge::new(config.batch_max);
        let work_gauge = PathGauge::new(config.batch_max);
        let hold = Duration::from_micros(config.report_hold_us.into());
        pipes.push(Pipes {
            submits: open_pipeline(
                Some(submit_calls.clone()),
                Duration::ZERO,
                submit_gauge.clone(),
            )
            .await?,
            work: open_pipeline(None, hold, work_gauge.clone()).await?,
            submit_calls,
            submit_gauge,
            work_gauge,
        });
    }
    // Shard i uses pair i % pairs.
    let pipes: Vec<Pipes> = (0..config.shards as usize)
        .map(|i| pipes[i % pipes.len()].clone())
        .collect();
    Ok(pipes)
}

/// The control plane's background work: lease renewal and takeover (on the admin connection),
/// the policy watcher, the reconcilers, the cluster's shares, the counter check, the relay.
fn spawn_background(
    config: &spindle_node_base::config::Config,
    db_config: &DbConfig,
    live: &Arc<crate::live_policy::LivePolicy>,
    metrics: &Arc<Metrics>,
    ownership: &Arc<Ownership>,
    lease: LeaseLoop,
    shard_inboxes: Vec<mpsc::Sender<spindle_node_base::messages::ShardMsg>>,
) -> anyhow::Result<()> {
    tokio::spawn(crate::live_policy::watch(
        db_config.clone(),
        config.clone(),
        live.clone(),
        metrics.clone(),
        shard_inboxes.clone(),
    ));
    tokio::spawn(
        crate::reconciler::Reconcilers {
            db_config: db_config.clone(),
            config: config.clone(),
            metrics: metrics.clone(),
            ownership: ownership.clone(),
            live: live.clone(),
            shards: shard_inboxes.clone(),
            provider: crate::reconciler::Reconcilers::provider_client(config)?,
        }
        .run(),
    );
    tokio::spawn(lease.run(shard_inboxes));
    tokio::spawn(rates::run(
        db_config.clone(),
        config.clone(),
        metrics.clone(),
        ownership.clone(),
    ));
    if config.counter_check_s > 0 {
        tokio::spawn(crate::counter_check::run(
            db_config.clone(),
            crate::counter_check::Checks {
                every: std::time::Duration::from_secs(config.counter_check_s),
                repair: config.counter_repair,
                node: config.node_id.clone(),
            },
            metrics.clone(),
        ));
    }
    if let Some(events) = &config.events {
        tokio::spawn(crate::relay::run(
            db_config.clone(),
            events.clone(),
            metrics.clone(),
        ));
    }
    Ok(())
}

/// The partitions a node takes at start: the configured ones, else all of them.
fn preferred_partitions(config: &spindle_node_base::config::Config) -> Vec<PartitionId> {
    match &config.owned_partitions {
        Some(list) => list.iter().copied().map(PartitionId).collect(),
        None => (0..config.partitions).map(PartitionId).collect(),
    }
}

/// The pool row of a provider account.
pub fn provider_pool(name: &str) -> String {
    format!("provider:{name}")
}

/// Creates or resizes provider account `name`'s pool for `concurrency` slots, split into
/// [`provider_pool_shards`] rows.
pub async fn set_provider_pool(db: &Db, name: &str, concurrency: u64) -> Result<(), StoreError> {
    db.set_pool(
        &provider_pool(name),
        concurrency,
        provider_pool_shards(concurrency),
    )
    .await
}

/// Units a row of a provider's pool holds, at least (a smaller pool has fewer rows).
const PROVIDER_POOL_SHARD_UNITS_MIN: u64 = 16;

/// How many rows a provider account's pool of `concurrency` slots is split into. Every
/// transaction that charges or gives back a row locks it to its commit: one row made every
/// shard of every node queue behind each other's commit flush. Each node shard asks for rows of
/// its own first ([`preferred_pool_shard`]) and the database charges another only when that one
/// is full (`spindle_pick_shards`), so the pool refuses only when all of it is taken.
pub fn provider_pool_shards(concurrency: u64) -> u16 {
    (concurrency / PROVIDER_POOL_SHARD_UNITS_MIN).clamp(1, PROVIDER_POOL_SHARDS_MAX) as u16
}

/// The pool row, of `rows`, node `node`'s shard `index` (of `shards` on the node) asks for
/// first when its submit pipeline has started `turn` calls: one node's shards on interleaved
/// rows (every `shards`-th from the shard's own, so they do not meet while there are as many
/// rows), nodes spread by a hash of their id, and a shard's consecutive submit calls on
/// different rows. A claim locks its row to its commit and so does the report that gives it
/// back: with one row per shard, a shard's submits (which carry its claims) waited for its
/// reports of the tasks claimed by the call before, on the same row, to flush (0.8–1.1 ms a
/// call at 5,000 single-task frames a second: docs/benchmarks/journal.md, "Thirteenth round").
/// Taking turns, the report gives back the rows of the calls before while the submit charges the
/// next.
pub fn preferred_pool_shard(node: &str, index: usize, shards: usize, turn: u64, rows: u16) -> u16 {
    let salt = spindle_control::fnv1a(node.as_bytes());
    let step = (shards.max(1) as u64).wrapping_mul(turn);
    (salt.wrapping_add(index as u64).wrapping_add(step) % u64::from(rows.max(1))) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provider_pool_has_one_row_per_sixteen_slots_up_to_sixteen_rows() {
        assert_eq!(provider_pool_shards(0), 1);
        assert_eq!(provider_pool_shards(20), 1);
        assert_eq!(provider_pool_shards(100), 6);
        assert_eq!(provider_pool_shards(256), 16);
        assert_eq!(provider_pool_shards(100_000), 16);
    }

    #[test]
    fn one_nodes_shards_prefer_different_rows_of_a_pool() {
        for node in ["bench", "node-a", "gpu-7"] {
            let rows: Vec<u16> = (0..4)
                .map(|i| preferred_pool_shard(node, i, 4, 0, 16))
                .collect();
            let distinct: std::collections::HashSet<_> = rows.iter().collect();
            assert_eq!(distinct.len(), 4, "{node}: {rows:?}");
            assert!(rows.iter().all(|&r| r < 16), "{node}: {rows:?}");
            assert_eq!(preferred_pool_shard(node, 3, 4, 7, 1), 0);
        }
    }

    #[test]
    fn a_shard_takes_turns_over_its_own_rows_and_never_another_shards() {
        for node in ["bench", "node-a", "gpu-7"] {
            let turns = |index: usize| -> Vec<u16> {
                (0..16)
                    .map(|t| preferred_pool_shard(node, index, 2, t, 16))
                    .collect()
            };
            let (zero, one) = (turns(0), turns(1));
            // Consecutive calls on different rows, eight rows each, back to the first after.
            assert!(zero.windows(2).all(|w| w[0] != w[1]), "{node}: {zero:?}");
            let own: std::collections::HashSet<_> = zero.iter().collect();
            assert_eq!(own.len(), 8, "{node}: {zero:?}");
            assert_eq!(zero[0], zero[8]);
            assert!(
                one.iter().all(|r| !own.contains(r)),
                "{node}: {zero:?} / {one:?}"
            );
        }
    }
}
