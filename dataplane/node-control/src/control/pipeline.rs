//! The pipelines: one task per connection, batches formed from what the shard sent.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use spindle_control::query::StoredTask;
use spindle_control::{ClaimResult, Db, DbConfig, ReportResult, StoreError, WarmUp};
use spindle_core::{TaskId, TenantId};
use tokio::sync::{mpsc, oneshot};

use spindle_node_base::metrics::Metrics;
use spindle_node_base::overload::{CallModel, PathGauge};

use super::{CpMsg, Reply};
use spindle_node_base::limits::BACKLOG_MAX;
pub use spindle_node_base::limits::READ_QUEUE_MAX;

/// What one pipeline runs with.
pub struct PipelineSetup {
    pub db: Db,
    /// For reconnecting after PostgreSQL went away.
    pub db_config: DbConfig,
    pub node: String,
    pub lease_ms: u32,
    pub batch_max: usize,
    pub metrics: Arc<Metrics>,
    /// Counted up at each submit call (the submit pipeline's; see [`super::Pipes`]).
    pub submit_calls: Option<Arc<std::sync::atomic::AtomicU64>>,
    /// How long reports wait for a fuller call once the pipeline is free (zero: not at all).
    pub report_hold: std::time::Duration,
    /// What a connection runs before it serves, here and after each reconnect (`warmed`).
    pub warm: Option<Arc<WarmUp>>,
    /// This pipeline's load, for admission: its calls as they start and end, and the model of
    /// a call's time fitted over them.
    pub gauge: Arc<PathGauge>,
}

/// Runs one pipeline (shared by the shards of its pair) until its senders are dropped.
pub async fn pipeline(setup: PipelineSetup, mut rx: mpsc::Receiver<CpMsg>) {
    let PipelineSetup {
        mut db,
        db_config,
        node,
        lease_ms,
        batch_max,
        metrics,
        submit_calls,
        report_hold,
        warm,
        gauge,
    } = setup;
    let mut model = CallModel::new(batch_max);
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
        if !report_hold.is_zero() {
            hold_reports(&mut backlog, &mut rx, batch_max, report_hold).await;
        }
        let group = next_group(&mut backlog, batch_max);
        if db.is_closed() {
            // PostgreSQL went away. One attempt per batch: while it is down every batch is
            // answered Unavailable at once (the shards refuse paid work as overloaded and put
            // claims back) instead of waiting here; the first batch after it returns goes on.
            let fresh = match Db::open(&db_config).await {
                Ok(fresh) => warmed(fresh, &db_config, warm.as_deref()).await,
                Err(e) => Err(e),
            };
            match fresh {
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
        let mixed = group.iter().any(|m| matches!(m, CpMsg::Claim { .. }))
            && group.iter().any(|m| matches!(m, CpMsg::Report { .. }));
        let kind = match group[0] {
            CpMsg::Submit { .. } => Some(0),
            CpMsg::Claim { .. } | CpMsg::Report { .. } if mixed => Some(4),
            CpMsg::Claim { .. } => Some(1),
            CpMsg::Report { .. } => Some(2),
            CpMsg::TaskIds { .. }
            | CpMsg::Lookup { .. }
            | CpMsg::Renew { .. }
            | CpMsg::Cancel { .. } => None,
        };
        if let (Some(0), Some(calls)) = (kind, &submit_calls) {
            // Claims picked from now on go into the next call: to the next turn's pool rows.
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let rows: usize = group.iter().map(CpMsg::rows).sum();
        let started = std::time::Instant::now();
        gauge.call_started(rows);
        let ok = run_group(&db, &node, lease_ms, group).await;
        let took = started.elapsed();
        if let Some(k) = kind {
            metrics.batches[k].record(took.as_micros() as u64, rows as u64);
        }
        // Calls of the pipeline's own kinds teach the model (a failed one says nothing of
        // what the next takes); the rest only end.
        gauge.call_ended(if kind.is_some() && ok && rows > 0 {
            model.observe(rows, took)
        } else {
            model.fit()
        });
        metrics
            .postgres_ok
            .store(ok, std::sync::atomic::Ordering::Relaxed);
    }
}

/// While everything waiting is reports of fewer than `batch_max` rows, waits for more, for at
/// most `hold`: a report call's fixed cost in PostgreSQL (its statements started and ended, a
/// commit) is shared by more rows. Anything else arriving ends the wait (it is not held).
async fn hold_reports(
    backlog: &mut VecDeque<CpMsg>,
    rx: &mut mpsc::Receiver<CpMsg>,
    batch_max: usize,
    hold: std::time::Duration,
) {
    let deadline = tokio::time::Instant::now() + hold;
    let mut rows = 0;
    for m in backlog.iter() {
        if !matches!(m, CpMsg::Report { .. }) {
            return;
        }
        rows += m.rows();
    }
    while rows < batch_max && backlog.len() < BACKLOG_MAX {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(m)) => {
                let report = matches!(m, CpMsg::Report { .. });
                rows += m.rows();
                backlog.push_back(m);
                if !report {
                    return;
                }
            }
            Ok(None) | Err(_) => return,
        }
    }
}

/// How long a pipeline waits after a failed reconnect before it tries with the next batch.
const RECONNECT_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// `db` once it has run the hot path (`Db::warm_up`: PostgreSQL compiles a function and plans
/// its statements at a session's first call, 10–14 ms for the claimed submit, so a cold
/// connection made its first frames wait that long). A warm-up that failed leaves the
/// connection's state unknown: another is opened and serves cold.
pub(crate) async fn warmed(
    db: Db,
    config: &DbConfig,
    warm: Option<&WarmUp>,
) -> Result<Db, StoreError> {
    let Some(w) = warm else {
        return Ok(db);
    };
    let started = std::time::Instant::now();
    match db.warm_up(w).await {
        Ok(done) => {
            tracing::debug!("connection warmed up in {:?}: {done:?}", started.elapsed());
            Ok(db)
        }
        Err(e) => {
            tracing::warn!("warming a connection up: {e}; another serves cold");
            drop(db);
            Db::open(config).await
        }
    }
}

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
            CpMsg::Cancel { reply, .. } => drop(reply.send(Err(unavailable()))),
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

/// The next batch to run. What a shard waits on to go on goes first: behind submits it could
/// wait as long as any shard of the pair kept submitting — a block of task ids, then the reads
/// of rows of calls in doubt (every one waiting, while they fit and name no task twice; each
/// reads rows whose call already ended, so nothing sent before it changes its answer). Then
/// submits, all together (those admitted under the first one's policy version): nothing waits
/// on a task that is not yet submitted, so moving them ahead of claims and reports is safe, and
/// it keeps acknowledgements fast and batches large. Everything else runs in the order it was
/// sent, consecutive messages of one kind merged while they fit and name no task twice.
fn next_group(backlog: &mut VecDeque<CpMsg>, batch_max: usize) -> Vec<CpMsg> {
    if let Some(at) = backlog
        .iter()
        .position(|m| matches!(m, CpMsg::TaskIds { .. }))
    {
        return vec![backlog.remove(at).expect("found")];
    }
    if backlog.iter().any(|m| matches!(m, CpMsg::Lookup { .. })) {
        let mut seen: HashSet<TaskId> = HashSet::new();
        return take_where(backlog, batch_max, |m| {
            let fresh =
                matches!(m, CpMsg::Lookup { .. }) && m.tasks().iter().all(|t| !seen.contains(t));
            if fresh {
                seen.extend(m.tasks());
            }
            fresh
        });
    }
    let first_version = backlog.iter().find_map(|m| match m {
        CpMsg::Submit { version, .. } => Some(*version),
        _ => None,
    });
    if let Some(first_version) = first_version {
        return take_where(
            backlog,
            batch_max,
            |m| matches!(m, CpMsg::Submit { version, .. } if *version == first_version),
        );
    }
    if matches!(
        backlog.front(),
        Some(CpMsg::Claim { .. } | CpMsg::Report { .. })
    ) {
        return work_group(backlog, batch_max);
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

/// The claims and reports waiting, from the first on, for one call (`Db::work_batch`: the
/// reports, then the claims, in one transaction), while they fit in `batch_max` rows and name
/// no task twice. A message is not taken past one left behind that names a task of its — a
/// task's messages keep their order — and nothing else is taken (renewals and cancels keep
/// their place). Reports running before claims sent ahead of them changes nothing a claim
/// could see but the slots they free.
fn work_group(backlog: &mut VecDeque<CpMsg>, batch_max: usize) -> Vec<CpMsg> {
    let mut group = Vec::new();
    let mut rows = 0;
    let mut taken: HashSet<TaskId> = HashSet::new();
    let mut left: HashSet<TaskId> = HashSet::new();
    let mut rest = VecDeque::with_capacity(backlog.len());
    for m in backlog.drain(..) {
        let tasks = m.tasks();
        let fits = group.is_empty() || rows + m.rows() <= batch_max;
        let kind = matches!(m, CpMsg::Claim { .. } | CpMsg::Report { .. });
        let free = tasks
            .iter()
            .all(|t| !taken.contains(t) && !left.contains(t));
        if kind && fits && free {
            rows += m.rows();
            taken.extend(tasks);
            group.push(m);
        } else {
            left.extend(tasks);
            rest.push_back(m);
        }
    }
    *backlog = rest;
    group
}

/// Takes from anywhere in the backlog, the rest kept in order, the messages `wanted` accepts
/// while they fit in `batch_max` rows (the first always fits). `wanted` is asked only about a
/// message that fits, and a message it accepts is taken.
fn take_where(
    backlog: &mut VecDeque<CpMsg>,
    batch_max: usize,
    mut wanted: impl FnMut(&CpMsg) -> bool,
) -> Vec<CpMsg> {
    let mut group = Vec::new();
    let mut rows = 0;
    let mut rest = VecDeque::with_capacity(backlog.len());
    for m in backlog.drain(..) {
        if (group.is_empty() || rows + m.rows() <= batch_max) && wanted(&m) {
            rows += m.rows();
            group.push(m);
        } else {
            rest.push_back(m);
        }
    }
    *backlog = rest;
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
            let (tasks, claims): (Vec<_>, Vec<_>) = all.into_iter().unzip();
            let result = db
                .submit_claim_batch_as(node, lease_ms, &tasks, &claims, version)
                .await;
            answer(result, replies)
        }
        CpMsg::Claim { .. } | CpMsg::Report { .. } => {
            let (claims, reports): (Vec<CpMsg>, Vec<CpMsg>) = group
                .into_iter()
                .partition(|m| matches!(m, CpMsg::Claim { .. }));
            let (claims, claim_replies) = merge(claims, |m| match m {
                CpMsg::Claim { claims, reply, .. } => Some((claims, reply)),
                _ => None,
            });
            let (reports, report_replies) = merge(reports, |m| match m {
                CpMsg::Report { reports, reply, .. } => Some((reports, reply)),
                _ => None,
            });
            match db.work_batch(node, lease_ms, &reports, &claims).await {
                Ok((reported, claimed)) => {
                    answer(Ok(reported), report_replies) & answer(Ok(claimed), claim_replies)
                }
                Err(e) => {
                    answer::<ReportResult>(Err(e.clone()), report_replies)
                        & answer::<ClaimResult>(Err(e), claim_replies)
                }
            }
        }
        CpMsg::Lookup { .. } => {
            let (all, replies) = merge(group, |m| match m {
                CpMsg::Lookup { tasks, reply } => Some((tasks, reply)),
                _ => None,
            });
            let heads = chunked(&all, |chunk| async move { db.task_heads(chunk).await }).await;
            answer(heads, replies)
        }
        CpMsg::Cancel { .. } => {
            let (all, replies) = merge(group, |m| match m {
                CpMsg::Cancel { tasks, reply } => Some((tasks, reply)),
                _ => None,
            });
            let marked = chunked(&all, |chunk| async move { db.request_cancel(chunk).await }).await;
            answer(marked, replies)
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

/// `call` over `all` in chunks of at most one batch's rows, the answers concatenated in order;
/// the first failure is the answer.
async fn chunked<'a, T, R, F>(
    all: &'a [T],
    mut call: impl FnMut(&'a [T]) -> F,
) -> Result<Vec<R>, StoreError>
where
    F: std::future::Future<Output = Result<Vec<R>, StoreError>>,
{
    let mut rows = Vec::with_capacity(all.len());
    for chunk in all.chunks(spindle_control::limits::BATCH_MAX) {
        rows.extend(call(chunk).await?);
    }
    Ok(rows)
}

/// Concatenates the rows of a group of messages of one kind, keeping each message's reply
/// and row count so `answer` can split the results back.
fn merge<M, T, R>(
    group: Vec<M>,
    rows_of: impl Fn(M) -> Option<(Vec<T>, Reply<R>)>,
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
            // Each message of the batch learns what failed it, as it was: a refusal is not an
            // outage (and is not retried as one).
            for (_, reply) in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
    reachable
}

/// A read on the read connection (batched, unordered with respect to the pipelines: a task's
/// acknowledged submit is always visible).
pub enum ReadMsg {
    /// A task's stored status, for its tenant (another tenant's task reads as missing).
    Status {
        tenant: TenantId,
        task: TaskId,
        reply: oneshot::Sender<Result<Option<StoredTask>, StoreError>>,
    },
    /// The inputs tasks were submitted with, read from their stored requests (for attempts
    /// whose shard did not hold them: `shard/inputs.rs`).
    Inputs {
        tasks: Vec<TaskId>,
        reply: Reply<StoredInput>,
    },
}

impl ReadMsg {
    fn rows(&self) -> usize {
        match self {
            ReadMsg::Status { .. } => 1,
            ReadMsg::Inputs { tasks, .. } => tasks.len(),
        }
    }
}

pub(super) async fn reader(
    mut db: Db,
    db_config: DbConfig,
    metrics: Arc<Metrics>,
    mut rx: mpsc::Receiver<ReadMsg>,
) {
    while let Some(first) = rx.recv().await {
        let mut rows = first.rows();
        let mut group = vec![first];
        while rows < spindle_control::limits::BATCH_MAX {
            match rx.try_recv() {
                Ok(m) => {
                    rows += m.rows();
                    group.push(m);
                }
                Err(_) => break,
            }
        }
        if db.is_closed() {
            match Db::open(&db_config).await {
                Ok(fresh) => db = fresh,
                Err(e) => {
                    metrics
                        .postgres_ok
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                    for m in group {
                        fail_read(m, &e);
                    }
                    continue;
                }
            }
        }
        let (statuses, inputs): (Vec<_>, Vec<_>) = group
            .into_iter()
            .partition(|m| matches!(m, ReadMsg::Status { .. }));
        if !statuses.is_empty() {
            read_statuses(&db, statuses).await;
        }
        if !inputs.is_empty() {
            let (all, replies) = merge(inputs, |m| match m {
                ReadMsg::Inputs { tasks, reply } => Some((tasks, reply)),
                ReadMsg::Status { .. } => None,
            });
            let db = &db;
            let read = chunked(&all, |chunk| async move {
                let payloads = db.task_payloads(chunk).await?;
                Ok(payloads
                    .iter()
                    .map(|p| stored_input(p.as_deref()))
                    .collect())
            })
            .await;
            answer(read, replies);
        }
    }
}

fn fail_read(m: ReadMsg, e: &StoreError) {
    match m {
        ReadMsg::Status { reply, .. } => drop(reply.send(Err(e.clone()))),
        ReadMsg::Inputs { reply, .. } => drop(reply.send(Err(e.clone()))),
    }
}

async fn read_statuses(db: &Db, group: Vec<ReadMsg>) {
    let ids: Vec<TaskId> = group
        .iter()
        .filter_map(|m| match m {
            ReadMsg::Status { task, .. } => Some(*task),
            ReadMsg::Inputs { .. } => None,
        })
        .collect();
    match db.task_statuses(&ids).await {
        Ok(rows) => {
            let found: std::collections::HashMap<TaskId, (TenantId, StoredTask)> =
                rows.into_iter().map(|(t, s)| (s.task, (t, s))).collect();
            for m in group {
                if let ReadMsg::Status {
                    tenant,
                    task,
                    reply,
                } = m
                {
                    let answer = found
                        .get(&task)
                        .filter(|(owner, _)| *owner == tenant)
                        .map(|(_, s)| s.clone().as_seen_by_client());
                    let _ = reply.send(Ok(answer));
                }
            }
        }
        Err(e) => {
            let e = StoreError::Unavailable(e.to_string());
            for m in group {
                fail_read(m, &e);
            }
        }
    }
}

/// A task's input as its stored request has it: `Ok(None)` when it was submitted without one.
pub type StoredInput = Result<Option<Box<str>>, InputUnread>;

/// Why a task's input, left in PostgreSQL, did not come back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InputUnread {
    /// The read failed (PostgreSQL unreachable, a timeout): a later attempt may read it.
    Read(String),
    /// What is stored cannot give it (the row is gone, the request does not parse): no attempt
    /// will.
    Stored(String),
}

impl InputUnread {
    /// Whether a later attempt could read it.
    pub fn retryable(&self) -> bool {
        matches!(self, InputUnread::Read(_))
    }
}

impl std::fmt::Display for InputUnread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InputUnread::Read(why) => write!(f, "reading it: {why}"),
            InputUnread::Stored(why) => f.write_str(why),
        }
    }
}

fn stored_input(payload: Option<&[u8]>) -> StoredInput {
    let payload = payload.ok_or_else(|| InputUnread::Stored("its row is gone".into()))?;
    let stored: spindle_node_base::messages::StoredRequest = serde_json::from_slice(payload)
        .map_err(|e| InputUnread::Stored(format!("its stored request is unreadable: {e}")))?;
    Ok(stored.input.map(|i| i.get().into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use spindle_control::{NewTask, PartitionId};
    use spindle_core::{Band, Lane, PolicyVersion, UserId};

    fn submit(tasks: std::ops::Range<u64>) -> CpMsg {
        let tasks = tasks
            .map(|t| {
                let task = NewTask {
                    task: TaskId(t),
                    tenant: TenantId(1),
                    user: UserId(1),
                    idempotency_key: format!("k{t}"),
                    payload: Vec::new(),
                    partition: PartitionId(1),
                    lane: Lane::Standard,
                    band: Band::P2,
                    cost_estimate_milli: 1,
                    fairness_milli: 1,
                };
                (task, None)
            })
            .collect();
        CpMsg::Submit {
            tasks,
            version: PolicyVersion(1),
            reply: oneshot::channel().0,
            queued: spindle_node_base::overload::Queued::none(),
        }
    }

    fn lookup(tasks: &[u64]) -> CpMsg {
        CpMsg::Lookup {
            tasks: tasks.iter().copied().map(TaskId).collect(),
            reply: oneshot::channel().0,
        }
    }

    fn claim(tasks: &[u64]) -> CpMsg {
        CpMsg::Claim {
            claims: tasks
                .iter()
                .map(|&t| spindle_control::ClaimRequest {
                    task: TaskId(t),
                    expected_version: 0,
                    provider: "p".into(),
                    demands: Vec::new(),
                })
                .collect(),
            reply: oneshot::channel().0,
            queued: spindle_node_base::overload::Queued::none(),
        }
    }

    fn report(tasks: &[u64]) -> CpMsg {
        CpMsg::Report {
            reports: tasks
                .iter()
                .map(|&t| {
                    spindle_control::Report::new(
                        TaskId(t),
                        None,
                        spindle_control::ReportAction::Release,
                    )
                })
                .collect(),
            reply: oneshot::channel().0,
            queued: spindle_node_base::overload::Queued::none(),
        }
    }

    fn kinds(group: &[CpMsg]) -> Vec<&'static str> {
        group
            .iter()
            .map(|m| match m {
                CpMsg::Submit { .. } => "submit",
                CpMsg::TaskIds { .. } => "ids",
                CpMsg::Lookup { .. } => "lookup",
                _ => "other",
            })
            .collect()
    }

    /// Two shards on one pipeline: the first's submits keep coming while the second waits for a
    /// block of task ids. The block runs first; then every waiting submit goes in one call.
    #[test]
    fn a_task_id_block_runs_before_the_submits_waiting_ahead_of_it() {
        let mut backlog: VecDeque<CpMsg> = [
            submit(0..3),
            submit(3..5),
            CpMsg::TaskIds {
                reply: oneshot::channel().0,
            },
            submit(5..6),
        ]
        .into_iter()
        .collect();
        assert_eq!(kinds(&next_group(&mut backlog, 256)), ["ids"]);
        let group = next_group(&mut backlog, 256);
        assert_eq!(kinds(&group), ["submit", "submit", "submit"]);
        assert_eq!(group.iter().map(CpMsg::rows).sum::<usize>(), 6);
        assert!(backlog.is_empty());
    }

    /// Reads of rows in doubt go before submits too, together while they fit and name no
    /// task twice.
    #[test]
    fn reads_of_rows_in_doubt_run_before_waiting_submits() {
        let mut backlog: VecDeque<CpMsg> = [
            submit(0..2),
            lookup(&[1]),
            submit(2..3),
            lookup(&[7, 8]),
            lookup(&[1, 9]),
        ]
        .into_iter()
        .collect();
        let first = next_group(&mut backlog, 256);
        assert_eq!(kinds(&first), ["lookup", "lookup"]);
        assert_eq!(first.iter().map(CpMsg::rows).sum::<usize>(), 3);
        let second = next_group(&mut backlog, 256);
        assert_eq!(second[0].tasks(), [TaskId(1), TaskId(9)]);
        assert_eq!(kinds(&next_group(&mut backlog, 256)), ["submit", "submit"]);
        assert!(backlog.is_empty());
    }

    /// Claims and reports go in one work call, each kind in the order it came, while they fit
    /// and name no task twice; a message is not taken past one left behind that names a task
    /// of its, nor is a renewal or cancel taken; a batch stops at batch_max rows (a message
    /// is never split).
    #[test]
    fn claims_and_reports_share_a_call_and_keep_each_tasks_order() {
        let mut backlog: VecDeque<CpMsg> = [
            claim(&[1, 2]),
            claim(&[3]),
            claim(&[2]),
            report(&[4]),
            CpMsg::Renew {
                attempts: vec![(TaskId(6), spindle_core::FencingToken(1))],
            },
            report(&[2, 7]),
            report(&[5]),
            report(&[6]),
        ]
        .into_iter()
        .collect();
        let tasks = |g: Vec<CpMsg>| g.iter().map(CpMsg::tasks).collect::<Vec<_>>();
        let ids = |t: &[u64]| t.iter().copied().map(TaskId).collect::<Vec<_>>();
        // Task 2's second claim waits for the call after its first; the report naming 2 and 7
        // waits behind it; task 6's report waits behind the renewal naming 6.
        assert_eq!(
            tasks(next_group(&mut backlog, 256)),
            [ids(&[1, 2]), ids(&[3]), ids(&[4]), ids(&[5])]
        );
        assert_eq!(tasks(next_group(&mut backlog, 256)), [ids(&[2])]);
        assert_eq!(tasks(next_group(&mut backlog, 256)), [ids(&[6])]);
        assert_eq!(
            tasks(next_group(&mut backlog, 256)),
            [ids(&[2, 7]), ids(&[6])]
        );
        assert!(backlog.is_empty());
        // A batch stops at batch_max rows (a message is never split).
        let mut backlog: VecDeque<CpMsg> = [claim(&[1, 2]), report(&[3, 4]), claim(&[5])]
            .into_iter()
            .collect();
        assert_eq!(next_group(&mut backlog, 4).len(), 2);
        assert_eq!(next_group(&mut backlog, 4).len(), 1);
        let mut backlog: VecDeque<CpMsg> = [submit(0..2), submit(2..4), submit(4..5)]
            .into_iter()
            .collect();
        assert_eq!(next_group(&mut backlog, 4).len(), 2);
        assert_eq!(next_group(&mut backlog, 4).len(), 1);
    }

    const HOLD: std::time::Duration = std::time::Duration::from_millis(5);

    /// Holds `backlog` with `hold_reports` (batch_max 4) while `later` arrives 1 ms in; the
    /// messages then waiting and how long the hold took on tokio's paused clock.
    async fn held(
        backlog: Vec<CpMsg>,
        later: Vec<CpMsg>,
    ) -> (Vec<&'static str>, std::time::Duration) {
        let (tx, mut rx) = mpsc::channel(16);
        let mut backlog: VecDeque<CpMsg> = backlog.into_iter().collect();
        let start = tokio::time::Instant::now();
        let sender = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            for m in later {
                tx.send(m).await.unwrap();
            }
            // Kept open past the hold: a closed channel would end it too.
            tokio::time::sleep(HOLD * 2).await;
        });
        hold_reports(&mut backlog, &mut rx, 4, HOLD).await;
        let took = start.elapsed();
        sender.abort();
        let kinds = backlog
            .iter()
            .map(|m| match m {
                CpMsg::Report { .. } => "report",
                CpMsg::Claim { .. } => "claim",
                _ => "other",
            })
            .collect();
        (kinds, took)
    }

    #[tokio::test(start_paused = true)]
    async fn reports_wait_for_a_full_batch_or_the_hold_and_nothing_else_waits() {
        let ms = std::time::Duration::from_millis;
        // A full batch ends the wait when it arrives.
        assert_eq!(
            held(vec![report(&[1, 2])], vec![report(&[3, 4])]).await,
            (vec!["report", "report"], ms(1))
        );
        // Fewer rows wait the whole hold, taking what came meanwhile.
        assert_eq!(
            held(vec![report(&[1])], vec![report(&[2])]).await,
            (vec!["report", "report"], HOLD)
        );
        // A claim arriving ends it (and is not held itself).
        assert_eq!(
            held(vec![report(&[1])], vec![claim(&[2])]).await,
            (vec!["report", "claim"], ms(1))
        );
        // Anything but reports waiting, or a full batch already: no wait.
        assert_eq!(
            held(vec![report(&[1]), claim(&[2])], vec![report(&[3])]).await,
            (vec!["report", "claim"], ms(0))
        );
        assert_eq!(
            held(vec![report(&[1, 2, 3, 4])], vec![report(&[5])]).await,
            (vec!["report"], ms(0))
        );
    }

    #[test]
    fn a_stored_input_is_read_from_the_request_or_refused_with_why() {
        let request = |input: Option<&str>| {
            let stored = spindle_node_base::messages::StoredRequest {
                user: 1,
                spec: spindle_core::TaskSpec::clip_720p(spindle_core::ModelId(0)),
                band_hint: None,
                deadline_ms: None,
                input: input.map(|i| serde_json::value::RawValue::from_string(i.into()).unwrap()),
            };
            serde_json::to_vec(&stored).unwrap()
        };
        let with = request(Some(r#"{"prompt":"a"}"#));
        assert_eq!(
            stored_input(Some(&with)),
            Ok(Some(r#"{"prompt":"a"}"#.into()))
        );
        assert_eq!(stored_input(Some(&request(None))), Ok(None));
        assert_eq!(
            stored_input(None),
            Err(InputUnread::Stored("its row is gone".into()))
        );
        let broken = stored_input(Some(&with[..10])).unwrap_err();
        assert!(!broken.retryable(), "no later attempt reads it either");
        assert!(
            broken
                .to_string()
                .starts_with("its stored request is unreadable"),
            "{broken}"
        );
        let down = InputUnread::Read("PostgreSQL is unavailable".into());
        assert!(down.retryable());
        assert_eq!(down.to_string(), "reading it: PostgreSQL is unavailable");
    }
}
