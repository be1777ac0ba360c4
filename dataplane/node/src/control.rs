//! The control plane's thread: a tokio runtime owning the PostgreSQL connections. Each shard has
//! two pipelines (one connection and one task each): one for submits and task-id blocks, so
//! acknowledgements never queue behind claim and report batches, and one for the work — claims
//! and reports, which reach PostgreSQL in the order the shard sent them. A shard sends a task's
//! claim only after its submit committed, so the two never race. Consecutive messages of one
//! kind are merged into one batch (group commit across clients).

use std::collections::{HashSet, VecDeque};

use spindle_control::query::{StoredTask, TaskHead};
use spindle_control::{
    ClaimRequest, ClaimResult, Db, DbConfig, NewTask, PartitionId, Report, ReportResult, Retention,
    StoreError, SubmitOutcome,
};
use std::sync::Arc;

use spindle_core::{PolicyVersion, TaskId, TenantId};

use crate::metrics::Metrics;
use crate::ownership::Ownership;
use tokio::sync::{mpsc, oneshot};

/// Messages one shard's pipeline takes at once before it pushes back.
pub const PIPELINE_QUEUE_MAX: usize = 4096;

pub type Reply<T> = oneshot::Sender<Result<Vec<T>, StoreError>>;

pub enum CpMsg {
    Submit {
        tasks: Vec<NewTask>,
        /// The policy version the tasks were admitted under.
        version: PolicyVersion,
        reply: Reply<SubmitOutcome>,
    },
    Claim {
        claims: Vec<ClaimRequest>,
        reply: Reply<ClaimResult>,
    },
    Report {
        reports: Vec<Report>,
        reply: Reply<ReportResult>,
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
        }
    }

    fn same_kind(&self, other: &CpMsg) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
            && !matches!(self, CpMsg::TaskIds { .. })
    }

    fn tasks(&self) -> Vec<TaskId> {
        match self {
            CpMsg::Submit { tasks, .. } => tasks.iter().map(|t| t.task).collect(),
            CpMsg::Claim { claims, .. } => claims.iter().map(|c| c.task).collect(),
            CpMsg::Report { reports, .. } => reports.iter().map(|r| r.task).collect(),
            CpMsg::TaskIds { .. } => Vec::new(),
            CpMsg::Lookup { tasks, .. } => tasks.clone(),
            CpMsg::Renew { attempts } => attempts.iter().map(|(t, _)| *t).collect(),
        }
    }
}

/// What one pipeline runs with.
pub struct PipelineSetup {
    pub db: Db,
    /// For reconnecting after PostgreSQL went away.
    pub db_config: DbConfig,
    pub node: String,
    pub lease_ms: u32,
    pub batch_max: usize,
    pub metrics: Arc<Metrics>,
}

/// Runs one shard's pipeline until its sender is dropped.
pub async fn pipeline(setup: PipelineSetup, mut rx: mpsc::Receiver<CpMsg>) {
    let PipelineSetup {
        mut db,
        db_config,
        node,
        lease_ms,
        batch_max,
        metrics,
    } = setup;
    let mut backlog: VecDeque<CpMsg> = VecDeque::new();
    loop {
        if backlog.is_empty() {
            match rx.recv().await {
                Some(m) => backlog.push_back(m),
                None => return,
            }
        }
        while backlog.len() < BACKLOG_MAX {
            match rx.try_recv() {
                Ok(m) => backlog.push_back(m),
                Err(_) => break,
            }
        }
        let group = next_group(&mut backlog, batch_max);
        if db.is_closed() {
            // PostgreSQL went away. One attempt per batch: while it is down every batch is
            // answered Unavailable at once (the shards refuse paid work as overloaded and put
            // claims back) instead of waiting here; the first batch after it returns goes on.
            match Db::open(&db_config).await {
                Ok(fresh) => {
                    tracing::info!("reconnected to PostgreSQL");
                    db = fresh;
                }
                Err(e) => {
                    metrics
                        .postgres_ok
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                    fail_group(group, &e);
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                    continue;
                }
            }
        }
        let kind = match group[0] {
            CpMsg::Submit { .. } => Some(0),
            CpMsg::Claim { .. } => Some(1),
            CpMsg::Report { .. } => Some(2),
            CpMsg::TaskIds { .. } | CpMsg::Lookup { .. } | CpMsg::Renew { .. } => None,
        };
        let rows: usize = group.iter().map(CpMsg::rows).sum();
        let started = std::time::Instant::now();
        let ok = run_group(&db, &node, lease_ms, group).await;
        if let Some(k) = kind {
            metrics.batches[k].record(started.elapsed().as_micros() as u64, rows as u64);
        }
        metrics
            .postgres_ok
            .store(ok, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How long a pipeline waits after a failed reconnect before it tries with the next batch.
const RECONNECT_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Answers every message of a batch that could not run with `Unavailable`.
fn fail_group(group: Vec<CpMsg>, e: &StoreError) {
    let text = e.to_string();
    let unavailable = || StoreError::Unavailable(text.clone());
    for m in group {
        match m {
            CpMsg::Submit { reply, .. } => drop(reply.send(Err(unavailable()))),
            CpMsg::Claim { reply, .. } => drop(reply.send(Err(unavailable()))),
            CpMsg::Report { reply, .. } => drop(reply.send(Err(unavailable()))),
            CpMsg::TaskIds { reply } => drop(reply.send(Err(unavailable()))),
            CpMsg::Lookup { reply, .. } => drop(reply.send(Err(unavailable()))),
            CpMsg::Renew { .. } => {}
        }
    }
}

/// Opens a connection, with backoff, for as long as it takes. Readiness follows what it
/// finds: PostgreSQL is unavailable while attempts fail and available once one succeeds (an
/// idle node has no batches to prove it back after an outage).
pub(crate) async fn reconnect(config: &DbConfig, metrics: &Metrics) -> Db {
    loop {
        match Db::open_with_backoff(config).await {
            Ok(db) => {
                metrics
                    .postgres_ok
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::info!("connected to PostgreSQL");
                return db;
            }
            Err(e) => {
                metrics
                    .postgres_ok
                    .store(false, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!("PostgreSQL unavailable: {e}");
            }
        }
    }
}

/// Messages one pipeline looks at when it forms the next batch.
const BACKLOG_MAX: usize = 4 * PIPELINE_QUEUE_MAX;

/// The next batch to run. Submits go first and all together (those admitted under the first
/// one's policy version): nothing waits on a task that is not yet submitted, so moving them
/// ahead of claims and reports is safe, and it keeps acknowledgements fast and batches large. Everything else runs in the order it was sent,
/// consecutive messages of one kind merged while they fit and name no task twice.
fn next_group(backlog: &mut VecDeque<CpMsg>, batch_max: usize) -> Vec<CpMsg> {
    let first_version = backlog.iter().find_map(|m| match m {
        CpMsg::Submit { version, .. } => Some(*version),
        _ => None,
    });
    if let Some(first_version) = first_version {
        let mut group = Vec::new();
        let mut rows = 0;
        let mut rest = VecDeque::with_capacity(backlog.len());
        for m in backlog.drain(..) {
            let take = matches!(m, CpMsg::Submit { version, .. } if version == first_version)
                && (group.is_empty() || rows + m.rows() <= batch_max);
            if take {
                rows += m.rows();
                group.push(m);
            } else {
                rest.push_back(m);
            }
        }
        *backlog = rest;
        return group;
    }
    let first = backlog.pop_front().expect("a non-empty backlog");
    let mut group = vec![first];
    let mut rows = group[0].rows();
    let mut seen: HashSet<TaskId> = group[0].tasks().into_iter().collect();
    while let Some(next) = backlog.front() {
        let fits = next.same_kind(&group[0]) && rows + next.rows() <= batch_max;
        let fresh = next.tasks().iter().all(|t| !seen.contains(t));
        if !(fits && fresh) {
            break;
        }
        let next = backlog.pop_front().expect("peeked");
        rows += next.rows();
        seen.extend(next.tasks());
        group.push(next);
    }
    group
}

/// Runs one batch; false when PostgreSQL could not be reached.
async fn run_group(db: &Db, node: &str, lease_ms: u32, group: Vec<CpMsg>) -> bool {
    match &group[0] {
        CpMsg::TaskIds { .. } => {
            let mut ok = true;
            for m in group {
                if let CpMsg::TaskIds { reply } = m {
                    let block = db.reserve_task_ids().await;
                    ok &= !block.as_ref().is_err_and(StoreError::is_unavailable);
                    let _ = reply.send(block);
                }
            }
            ok
        }
        &CpMsg::Submit { version, .. } => {
            let (all, replies) = merge(group, |m| match m {
                CpMsg::Submit { tasks, reply, .. } => Some((tasks, reply)),
                _ => None,
            });
            answer(db.submit_batch_as(node, &all, version).await, replies)
        }
        CpMsg::Claim { .. } => {
            let (all, replies) = merge(group, |m| match m {
                CpMsg::Claim { claims, reply } => Some((claims, reply)),
                _ => None,
            });
            answer(db.claim_batch(node, lease_ms, &all).await, replies)
        }
        CpMsg::Report { .. } => {
            let (all, replies) = merge(group, |m| match m {
                CpMsg::Report { reports, reply } => Some((reports, reply)),
                _ => None,
            });
            answer(db.report_batch(&all).await, replies)
        }
        CpMsg::Lookup { .. } => {
            let (all, replies) = merge(group, |m| match m {
                CpMsg::Lookup { tasks, reply } => Some((tasks, reply)),
                _ => None,
            });
            let mut heads = Vec::with_capacity(all.len());
            let mut failed = None;
            for chunk in all.chunks(spindle_control::limits::BATCH_MAX) {
                match db.task_heads(chunk).await {
                    Ok(h) => heads.extend(h),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            answer(failed.map_or(Ok(heads), Err), replies)
        }
        CpMsg::Renew { .. } => {
            let all: Vec<_> = group
                .into_iter()
                .flat_map(|m| match m {
                    CpMsg::Renew { attempts } => attempts,
                    _ => Vec::new(),
                })
                .collect();
            let mut ok = true;
            for chunk in all.chunks(spindle_control::limits::BATCH_MAX) {
                if let Err(e) = db.renew_attempts(chunk, lease_ms).await {
                    tracing::warn!("renewing attempt leases: {e}");
                    ok &= !e.is_unavailable();
                }
            }
            ok
        }
    }
}

/// Concatenates the rows of a group of messages of one kind, keeping each message's reply
/// and row count so `answer` can split the results back.
fn merge<T, R>(
    group: Vec<CpMsg>,
    rows_of: impl Fn(CpMsg) -> Option<(Vec<T>, Reply<R>)>,
) -> (Vec<T>, Vec<(usize, Reply<R>)>) {
    let mut all = Vec::new();
    let mut replies = Vec::new();
    for (rows, reply) in group.into_iter().filter_map(rows_of) {
        replies.push((rows.len(), reply));
        all.extend(rows);
    }
    (all, replies)
}

/// Splits a merged batch's results back to the messages it came from. A failed batch fails
/// every message in it: in doubt when its connection broke under it, else with nothing of it
/// committed.
fn answer<T>(result: Result<Vec<T>, StoreError>, replies: Vec<(usize, Reply<T>)>) -> bool {
    let reachable = !result.as_ref().is_err_and(StoreError::is_unavailable);
    match result {
        Ok(rows) => {
            let mut rows = rows.into_iter();
            for (n, reply) in replies {
                // A shard that stopped waiting (shutdown) needs no answer.
                let _ = reply.send(Ok(rows.by_ref().take(n).collect()));
            }
        }
        Err(e) => {
            let each = || match &e {
                StoreError::InDoubt(text) => StoreError::InDoubt(text.clone()),
                StoreError::Unavailable(text) => StoreError::Unavailable(text.clone()),
                other => StoreError::Unavailable(other.to_string()),
            };
            for (_, reply) in replies {
                let _ = reply.send(Err(each()));
            }
        }
    }
    reachable
}

/// A read of a task's stored status, answered by the read connection (batched, unordered
/// with respect to the pipelines: a task's acknowledged submit is always visible).
pub struct ReadMsg {
    pub tenant: TenantId,
    pub task: TaskId,
    pub reply: oneshot::Sender<Result<Option<StoredTask>, StoreError>>,
}

/// Reads waiting before senders wait.
pub const READ_QUEUE_MAX: usize = 16_384;

async fn reader(
    mut db: Db,
    db_config: DbConfig,
    metrics: Arc<Metrics>,
    mut rx: mpsc::Receiver<ReadMsg>,
) {
    while let Some(first) = rx.recv().await {
        if db.is_closed() {
            match Db::open(&db_config).await {
                Ok(fresh) => db = fresh,
                Err(e) => {
                    metrics
                        .postgres_ok
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                    let _ = first.reply.send(Err(e));
                    continue;
                }
            }
        }
        let mut group = vec![first];
        while group.len() < spindle_control::limits::BATCH_MAX {
            match rx.try_recv() {
                Ok(m) => group.push(m),
                Err(_) => break,
            }
        }
        let ids: Vec<TaskId> = group.iter().map(|m| m.task).collect();
        match db.task_statuses(&ids).await {
            Ok(rows) => {
                let found: std::collections::HashMap<TaskId, (TenantId, StoredTask)> =
                    rows.into_iter().map(|(t, s)| (s.task, (t, s))).collect();
                for m in group {
                    // Another tenant's task is answered like a missing one.
                    let answer = found
                        .get(&m.task)
                        .filter(|(owner, _)| *owner == m.tenant)
                        .map(|(_, s)| s.clone());
                    let _ = m.reply.send(Ok(answer));
                }
            }
            Err(e) => {
                let text = e.to_string();
                for m in group {
                    let _ = m.reply.send(Err(StoreError::Unavailable(text.clone())));
                }
            }
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
}

/// One shard's two pipelines.
#[derive(Clone)]
pub struct Pipes {
    /// Submits and task-id blocks.
    pub submits: mpsc::Sender<CpMsg>,
    /// Claims and reports, in order.
    pub work: mpsc::Sender<CpMsg>,
}

/// A task from PostgreSQL for its shard: a QUEUED one, or one whose live attempt the shard
/// follows at the provider.
pub struct Restore {
    pub request: spindle_core::RestoreRequest,
    pub version: u32,
    /// Set for a live attempt (`request.attempts_before` is then its number).
    pub live: Option<LiveRestore>,
}

/// A stored task that cannot be put back as it is (its request unreadable, its live attempt's
/// provider gone from the policy, or refused by the shard's core: tenant or model no longer in
/// the policy, a spec the model no longer takes, attempts used up). Its shard fails it in
/// PostgreSQL with `reason` rather than leave it QUEUED and unserved, or stop the node.
#[derive(Debug)]
pub struct Unrestorable {
    pub task: spindle_core::TaskId,
    /// The live attempt's token, for one that had an attempt.
    pub token: Option<spindle_core::FencingToken>,
    pub reason: String,
}

/// What one shard takes back from PostgreSQL.
#[derive(Default)]
pub struct ShardRestores {
    pub tasks: Vec<Restore>,
    pub unrestorable: Vec<Unrestorable>,
}

impl ShardRestores {
    /// One empty set for each of `shards` shards.
    pub fn per_shard(shards: u32) -> Vec<ShardRestores> {
        (0..shards).map(|_| ShardRestores::default()).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty() && self.unrestorable.is_empty()
    }
}

/// A live attempt at the HTTP provider, resumed instead of submitted again.
pub struct LiveRestore {
    pub provider: spindle_core::ProviderId,
    pub token: spindle_core::FencingToken,
    /// As stored: DISPATCHING, SUBMIT_UNKNOWN, RUNNING, PROVIDER_SUCCEEDED or
    /// MEDIA_PROCESSING.
    pub stored: spindle_core::TaskState,
    pub request_key: String,
}

/// Which live attempts a (re)starting owner follows instead of ending them.
///
/// With an HTTP provider, those of the accounts the policy names: the provider still has their
/// jobs and can be asked by request key. In the provider stage that is every one; past it
/// (PROVIDER_SUCCEEDED, MEDIA_PROCESSING) only when the media stage is configured — the job's
/// video is found again through the provider and the media step runs again. With the local
/// provider, none: its work died with the process that ran it.
pub struct Followed {
    providers: Vec<String>,
    media: bool,
}

impl Followed {
    pub fn new(config: &crate::config::Config, policy: &spindle_core::Policy) -> Followed {
        Followed {
            providers: match config.provider {
                Some(_) => policy.providers.iter().map(|p| p.name.clone()).collect(),
                None => Vec::new(),
            },
            media: config.media.is_some(),
        }
    }

    fn follows(&self, a: &spindle_control::reconcile::LiveAttempt) -> bool {
        use spindle_core::TaskState as S;
        let past_provider = matches!(a.state, S::ProviderSucceeded | S::MediaProcessing);
        self.providers.contains(&a.provider) && (self.media || !past_provider)
    }
}

/// How many times in a row [`recover_attempts`] reads a page again because rows changed
/// under it before it gives up (the start, or the takeover round, is then retried).
const RECOVER_REREADS_MAX: u32 = 8;

/// Resolves the previous owner's live attempts in `mine` that are not followed (see
/// [`Followed`]): in the provider stage they are requeued (a new attempt runs them); past it
/// the provider had finished, and they are completed. Followed ones are left live, for
/// [`load_restores`]. Pages through the partitions once, in task id order.
///
/// A previous owner whose lease lapsed may still be writing its attempts (its reports are
/// fenced by their tokens, not by the partition lease): an attempt it advanced or ended after
/// the page was read is not recovered as read but read again, as it is now, up to
/// [`RECOVER_REREADS_MAX`] times in a row.
async fn recover_attempts(
    admin: &Db,
    mine: &[PartitionId],
    followed: &Followed,
) -> anyhow::Result<()> {
    let mut after = None;
    let mut rereads = 0;
    loop {
        let live = admin
            .live_attempts_in(mine, after, spindle_control::limits::SCAN_MAX)
            .await?;
        let Some(last) = live.last() else {
            return Ok(());
        };
        let changed = recover_page(admin, &live, followed).await?;
        let Some((task, seen)) = changed.first() else {
            after = Some(last.task);
            rereads = 0;
            continue;
        };
        rereads += 1;
        if rereads > RECOVER_REREADS_MAX {
            anyhow::bail!(
                "recovering live attempts: {} still changed after {RECOVER_REREADS_MAX} \
                 reads (task {task}: {seen:?})",
                changed.len()
            );
        }
        tracing::info!(
            changed = changed.len(),
            "live attempts changed while they were recovered (their previous owner is still \
             writing them); reading them again"
        );
    }
}

/// Ends the attempts of one page of [`recover_attempts`] that are not followed. Returns those
/// whose rows changed since `live` was read, with what their report found (it was not
/// applied: nothing of theirs was written).
async fn recover_page(
    admin: &Db,
    live: &[spindle_control::reconcile::LiveAttempt],
    followed: &Followed,
) -> anyhow::Result<Vec<(spindle_core::TaskId, spindle_control::ReportResult)>> {
    use spindle_control::{ReportAction as A, ReportResult};
    use spindle_core::TaskState as S;
    let reports: Vec<Report> = live
        .iter()
        .filter(|a| !followed.follows(a))
        .map(|a| {
            let succeeded = A::Finish {
                state: S::Succeeded,
                cost_actual_milli: None,
                reason: None,
            };
            let mut r = Report::new(a.task, Some(a.token), succeeded);
            match a.state {
                S::ProviderSucceeded => r.via = vec![S::MediaProcessing],
                S::MediaProcessing => {}
                _ => {
                    let reason = if followed.providers.is_empty() {
                        "node restarted: the local provider lost the attempt".to_string()
                    } else {
                        format!("provider {} is no longer configured", a.provider)
                    };
                    r.action = A::Requeue {
                        delay_ms: 0,
                        reason,
                    }
                }
            }
            r
        })
        .collect();
    let mut changed = Vec::new();
    for chunk in reports.chunks(spindle_control::limits::BATCH_MAX) {
        let results = admin.report_batch(chunk).await?;
        for (r, result) in chunk.iter().zip(results) {
            if !matches!(result, ReportResult::Applied { .. }) {
                changed.push((r.task, result));
            }
        }
    }
    Ok(changed)
}

/// A stored task as its shard's core takes it back.
pub(crate) fn restore_request(
    q: &spindle_control::reconcile::QueuedTask,
) -> anyhow::Result<spindle_core::RestoreRequest> {
    let stored: crate::shard::StoredRequest = serde_json::from_slice(&q.payload)
        .map_err(|e| anyhow::anyhow!("task {}: unreadable payload: {e}", q.task))?;
    let lane = *spindle_core::Lane::ALL
        .get(q.lane as usize)
        .ok_or_else(|| anyhow::anyhow!("task {}: lane {}", q.task, q.lane))?;
    let band = *spindle_core::Band::ALL
        .get(q.band as usize)
        .ok_or_else(|| anyhow::anyhow!("task {}: band {}", q.task, q.band))?;
    Ok(spindle_core::RestoreRequest {
        submit: spindle_core::SubmitRequest {
            task: q.task,
            tenant: q.tenant,
            user: spindle_core::UserId(q.user),
            spec: stored.spec,
            band_hint: stored.band_hint,
            // A deadline counts from the original submission, which a restart does not
            // reset: restored tasks keep none rather than a wrong one.
            deadline: None,
        },
        lane,
        band,
        attempts_before: q.attempt_no,
    })
}

/// Every task of `mine` to put back, as restores per shard: the QUEUED ones, and the live
/// attempts [`recover_attempts`] left live (the followed ones), in one walk. One that cannot
/// be read back goes to its shard as [`Unrestorable`].
async fn load_restores(
    admin: &Db,
    config: &crate::config::Config,
    policy: &spindle_core::Policy,
    mine: &[PartitionId],
) -> anyhow::Result<Vec<ShardRestores>> {
    let mut per_shard = ShardRestores::per_shard(config.shards);
    let mut after = None;
    loop {
        let page = admin
            .load_owned(mine, after, spindle_control::limits::SCAN_MAX)
            .await?;
        let Some(last) = page.last() else {
            return Ok(per_shard);
        };
        after = Some(last.task.task);
        for o in page {
            let to = &mut per_shard[config.shard_of(o.task.tenant.0)];
            match owned_restore(policy, o) {
                Ok(r) => to.tasks.push(r),
                Err(u) => to.unrestorable.push(u),
            }
        }
    }
}

/// One stored task as its shard takes it back, or why it cannot be.
fn owned_restore(
    policy: &spindle_core::Policy,
    o: spindle_control::reconcile::OwnedTask,
) -> Result<Restore, Unrestorable> {
    let token = o.live.as_ref().map(|l| l.token);
    let unrestorable = |reason: String| Unrestorable {
        task: o.task.task,
        token,
        reason,
    };
    let request = restore_request(&o.task).map_err(|e| unrestorable(format!("{e:#}")))?;
    let live = match o.live {
        None => None,
        Some(l) => {
            let Some(i) = policy.providers.iter().position(|p| p.name == l.provider) else {
                return Err(unrestorable(format!(
                    "task {}: its live attempt's provider {} left the policy",
                    o.task.task, l.provider
                )));
            };
            Some(LiveRestore {
                provider: spindle_core::ProviderId(i as u16),
                token: l.token,
                stored: l.state,
                request_key: l.request_key,
            })
        }
    };
    Ok(Restore {
        request,
        version: o.task.version,
        live,
    })
}

/// Opens one connection per shard (migrating on the first), registers the node, takes the
/// partitions and the pools, and starts the pipelines on `rt`.
pub async fn start(
    config: &crate::config::Config,
    db_config: &DbConfig,
    live: &Arc<crate::live_policy::LivePolicy>,
    metrics: &Arc<Metrics>,
    ownership: &Arc<Ownership>,
    shard_inboxes: Vec<mpsc::Sender<crate::shard::ShardMsg>>,
) -> anyhow::Result<Started> {
    let mut admin = Db::open_with_backoff(db_config).await?;
    let policy = live.load(&mut admin, metrics).await?;
    admin
        .register_node(&config.node_id, &config.listen.to_string())
        .await?;
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
    for p in &policy.providers {
        admin
            .set_pool(&provider_pool(&p.name), p.concurrency, 1)
            .await?;
    }
    recover_attempts(&admin, &held, &Followed::new(config, &policy)).await?;
    let restores = load_restores(&admin, config, &policy, &held).await?;
    for p in &held {
        ownership.set(*p, true);
    }
    ownership.set_owners(&admin.partition_owners().await?, &config.node_id);
    ownership.set_live_nodes(admin.live_nodes(config.lease_ms).await?);
    let mut pipes = Vec::new();
    let mut id_blocks = Vec::new();
    let open_pipeline = async || -> anyhow::Result<mpsc::Sender<CpMsg>> {
        let (tx, rx) = mpsc::channel(PIPELINE_QUEUE_MAX);
        let setup = PipelineSetup {
            db: Db::open_with_backoff(db_config).await?,
            db_config: db_config.clone(),
            node: config.node_id.clone(),
            lease_ms: config.lease_ms,
            batch_max: config.batch_max,
            metrics: metrics.clone(),
        };
        tokio::spawn(pipeline(setup, rx));
        Ok(tx)
    };
    for _ in 0..config.shards {
        id_blocks.push(admin.reserve_task_ids().await?);
        pipes.push(Pipes {
            submits: open_pipeline().await?,
            work: open_pipeline().await?,
        });
    }
    // The admin connection renews the partition leases for the life of the node and takes
    // over partitions whose owner went away.
    let lease = LeaseLoop {
        admin,
        config: config.clone(),
        db_config: db_config.clone(),
        metrics: metrics.clone(),
        ownership: ownership.clone(),
        live: live.clone(),
        preferred,
        prune_from: None,
    };
    tokio::spawn(crate::live_policy::watch(
        db_config.clone(),
        config.clone(),
        live.clone(),
        metrics.clone(),
        shard_inboxes.clone(),
    ));
    tokio::spawn(lease.run(shard_inboxes));
    if config.counter_check_s > 0 {
        tokio::spawn(crate::counter_check::run(
            db_config.clone(),
            std::time::Duration::from_secs(config.counter_check_s),
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
    })
}

/// The partitions a node takes at start: the configured ones, else all of them.
fn preferred_partitions(config: &crate::config::Config) -> Vec<PartitionId> {
    match &config.owned_partitions {
        Some(list) => list.iter().copied().map(PartitionId).collect(),
        None => (0..config.partitions).map(PartitionId).collect(),
    }
}

/// Renews this node's partition leases every third of a lease, and takes partitions over:
/// its preferred ones whenever they are free or expired, and after one lease of uptime (time
/// for every node of a starting cluster to take its own) any other free or expired one. A
/// partition taken over has its previous owner's live attempts resolved and its QUEUED tasks
/// sent to the shards before the node serves its tenants; a partition lost (another node took
/// it after this node's lease lapsed) stops being served.
struct LeaseLoop {
    admin: Db,
    config: crate::config::Config,
    db_config: DbConfig,
    metrics: Arc<Metrics>,
    ownership: Arc<Ownership>,
    /// The policy in force (which providers' attempts a takeover follows).
    live: Arc<crate::live_policy::LivePolicy>,
    preferred: Vec<PartitionId>,
    /// Where the next retention pass starts (`None`: at the oldest task).
    prune_from: Option<TaskId>,
}

impl LeaseLoop {
    async fn run(mut self, shards: Vec<mpsc::Sender<crate::shard::ShardMsg>>) {
        let started = std::time::Instant::now();
        let every = std::time::Duration::from_millis(u64::from(self.config.lease_ms / 3).max(1));
        let mut tick = tokio::time::interval(every);
        let everything: Vec<PartitionId> = (0..self.config.partitions).map(PartitionId).collect();
        loop {
            tick.tick().await;
            if self.metrics.stopping() {
                // Draining: the partitions are given back at the end, not renewed.
                return;
            }
            if self.admin.is_closed() {
                self.admin = reconnect(&self.db_config, &self.metrics).await;
            }
            let grace_over = started.elapsed().as_millis() > u128::from(self.config.lease_ms);
            let wanted = if grace_over {
                &everything
            } else {
                &self.preferred
            };
            let node = &self.config.node_id;
            let held = match self
                .admin
                .acquire_partitions(node, wanted, self.config.lease_ms)
                .await
            {
                Ok(h) => h.into_iter().map(|l| l.partition).collect::<Vec<_>>(),
                Err(e) => {
                    tracing::warn!("renewing partition leases failed: {e}");
                    continue;
                }
            };
            let before = self.ownership.owned();
            for lost in before.iter().filter(|p| !held.contains(p)) {
                tracing::warn!("partition {} is held by another node now", lost.0);
                self.ownership.set(*lost, false);
            }
            let gained: Vec<PartitionId> = held
                .iter()
                .filter(|p| !before.contains(p))
                .copied()
                .collect();
            if !gained.is_empty() {
                match self.take_over(&gained, &shards).await {
                    Ok(n) => tracing::info!(
                        "took over partitions {:?}: {n} queued tasks restored",
                        gained.iter().map(|p| p.0).collect::<Vec<_>>()
                    ),
                    Err(e) => {
                        // Not served until the next round succeeds; the lease is ours, so
                        // nobody else serves them either.
                        tracing::warn!("taking over partitions failed: {e:#}");
                        continue;
                    }
                }
            }
            match self.admin.partition_owners().await {
                Ok(owners) => self.ownership.set_owners(&owners, node),
                Err(e) => tracing::warn!("reading partition owners: {e}"),
            }
            if let Err(e) = self.admin.heartbeat(node).await {
                tracing::warn!("heartbeat failed: {e}");
            }
            match self.admin.live_nodes(self.config.lease_ms).await {
                Ok(n) => {
                    self.ownership.set_live_nodes(n);
                    self.metrics
                        .live_nodes
                        .store(u64::from(n), std::sync::atomic::Ordering::Relaxed);
                }
                Err(e) => tracing::warn!("counting live nodes: {e}"),
            }
            self.prune(&held, every).await;
        }
    }

    /// Retention over the partitions this node holds, after the renewal: bounded passes until
    /// they reach the newest task or a quarter of the renewal interval is spent (the next
    /// renewal is never delayed; a backlog is worked off over the following rounds).
    async fn prune(&mut self, held: &[PartitionId], every: std::time::Duration) {
        let window = |s: u64| (s > 0).then(|| std::time::Duration::from_secs(s));
        let keep = Retention {
            finished: window(self.config.retention_finished_s),
            failed: window(self.config.retention_failed_s),
        };
        let scan = self.config.retention_scan_rows;
        let started = std::time::Instant::now();
        if let Some(events) = window(self.config.retention_events_s) {
            // Without a relay nobody takes the events: they leave after the window too.
            let undelivered_too = self.config.events.is_none();
            loop {
                match self.admin.prune_events(events, undelivered_too, scan).await {
                    Ok(n) => {
                        self.metrics
                            .events_pruned
                            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                        if n < scan as u64 || started.elapsed() >= every / 8 {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!("event retention pass failed: {e}");
                        break;
                    }
                }
            }
        }
        if keep.finished.is_none() && keep.failed.is_none() {
            return;
        }
        loop {
            match self
                .admin
                .prune_finished(held, keep, self.prune_from, scan)
                .await
            {
                Ok(p) => {
                    self.prune_from = p.next;
                    self.metrics
                        .retention_pruned
                        .fetch_add(p.tasks, std::sync::atomic::Ordering::Relaxed);
                    if p.next.is_none() || started.elapsed() >= every / 4 {
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!("retention pass failed: {e}");
                    return;
                }
            }
        }
    }

    /// Resolves the live attempts of `gained`, sends their QUEUED tasks to the shards, then
    /// serves them. Returns how many tasks were restored.
    async fn take_over(
        &self,
        gained: &[PartitionId],
        shards: &[mpsc::Sender<crate::shard::ShardMsg>],
    ) -> anyhow::Result<usize> {
        let policy = self.live.current();
        let followed = Followed::new(&self.config, &policy);
        recover_attempts(&self.admin, gained, &followed).await?;
        let restores = load_restores(&self.admin, &self.config, &policy, gained).await?;
        let mut n = 0;
        for (shard, batch) in shards.iter().zip(restores) {
            n += batch.tasks.len();
            shard
                .send(crate::shard::ShardMsg::Restore(batch))
                .await
                .map_err(|_| anyhow::anyhow!("a shard stopped"))?;
        }
        // After the restores: a tenant's first new submit queues behind them.
        for p in gained {
            self.ownership.set(*p, true);
        }
        Ok(n)
    }
}

/// The pool row of a provider account.
pub fn provider_pool(name: &str) -> String {
    format!("provider:{name}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use spindle_control::testing::TestDb;
    use spindle_control::{ClaimRequest, ClaimResult, Demand, NewTask, PoolShard, ReportAction};
    use spindle_core::{Band, Lane, PolicyVersion, TaskId, TaskState, TenantId, UserId};

    const OLD: &str = "node-old";

    /// A previous owner that outlived its lease moves two of its attempts on between the new
    /// owner's read and its reports (one past the provider, which a requeue may not undo; one
    /// to its end): recovery reads them again and ends them as they are now (before, the
    /// start or takeover stopped on the first report not applied).
    #[tokio::test]
    async fn recovery_reads_again_the_attempts_their_previous_owner_changed_meanwhile() {
        let test = TestDb::new().await;
        let db = test.open().await;
        db.register_node(OLD, "127.0.0.1:0").await.unwrap();
        db.ensure_partitions(1).await.unwrap();
        let mine = [PartitionId(0)];
        db.acquire_partitions(OLD, &mine, 30_000).await.unwrap();
        db.set_pool("provider:local", 8, 1).await.unwrap();
        let tasks: Vec<NewTask> = (1..=3)
            .map(|i| NewTask {
                task: TaskId(i),
                tenant: TenantId(1),
                user: UserId(1),
                idempotency_key: format!("k{i}"),
                payload: b"{}".to_vec(),
                partition: PartitionId(0),
                lane: Lane::Standard,
                band: Band::P2,
                cost_estimate_milli: 1_000,
                fairness_milli: 500,
            })
            .collect();
        db.submit_batch(&tasks, PolicyVersion(1)).await.unwrap();
        let claims: Vec<ClaimRequest> = (1..=3)
            .map(|i| ClaimRequest {
                task: TaskId(i),
                expected_version: 0,
                provider: "local".into(),
                demands: vec![Demand {
                    shard: PoolShard::new("provider:local", 0),
                    amount: 1,
                }],
            })
            .collect();
        let tokens: Vec<_> = db
            .claim_batch(OLD, 30_000, &claims)
            .await
            .unwrap()
            .into_iter()
            .map(|g| match g {
                ClaimResult::Granted { token, .. } => token,
                refused => panic!("claim refused: {refused:?}"),
            })
            .collect();

        let read = db.live_attempts_in(&mine, None, 100).await.unwrap();
        assert_eq!(read.len(), 3);
        let mut provider_done = Report::new(
            TaskId(1),
            Some(tokens[0]),
            ReportAction::Advance(TaskState::ProviderSucceeded),
        );
        provider_done.via = vec![TaskState::Running];
        let mut finished = Report::new(
            TaskId(2),
            Some(tokens[1]),
            ReportAction::Finish {
                state: TaskState::Succeeded,
                cost_actual_milli: None,
                reason: None,
            },
        );
        finished.via = vec![
            TaskState::Running,
            TaskState::ProviderSucceeded,
            TaskState::MediaProcessing,
        ];
        let moved = db.report_batch(&[provider_done, finished]).await.unwrap();
        assert!(
            moved
                .iter()
                .all(|r| matches!(r, spindle_control::ReportResult::Applied { .. })),
            "{moved:?}"
        );

        let local = Followed {
            providers: Vec::new(),
            media: false,
        };
        let changed = recover_page(&db, &read, &local).await.unwrap();
        let changed: Vec<u64> = changed.iter().map(|(t, _)| t.0).collect();
        assert_eq!(changed, [1, 2], "the two rows changed after the read");

        recover_attempts(&db, &mine, &local).await.unwrap();
        assert!(db
            .live_attempts_in(&mine, None, 100)
            .await
            .unwrap()
            .is_empty());
        let states: Vec<TaskState> = db
            .task_heads(&[TaskId(1), TaskId(2), TaskId(3)])
            .await
            .unwrap()
            .into_iter()
            .map(|h| h.expect("task row").state)
            .collect();
        assert_eq!(
            states,
            [
                TaskState::Succeeded,
                TaskState::Succeeded,
                TaskState::Queued
            ]
        );
        assert_eq!(db.pool_usage("provider:local").await.unwrap()[0].used, 0);
    }
}
