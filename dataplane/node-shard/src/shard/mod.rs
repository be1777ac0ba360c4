//! One shard: a glommio task owning a `spindle_core::Shard` and everything about its tenants'
//! tasks. Inputs arrive on one bounded channel (from any connection on any executor) and from
//! the control-plane pipeline's answers; after each input the shard drains the core's
//! `poll_dispatch` and sends the claims it produced, in one message, down its pipeline.
//!
//! A submit is answered only after its group commit; until then the task may already be picked,
//! but its claim is held in the shard and sent only once the submit committed (submits and
//! claims travel on different connections), so it never overtakes it.
//!
//! Here: the state, the loop, reads, cancels and subscriptions, policy changes and gauges.
//! `submit` admits and stores submits, `claims` pumps the core's dispatches into claims and
//! applies their answers, `provider` and `media` run those stages, `reports` sends what
//! happened.
//!
//! Long file: the shard's state, its records and its loop are the one unit every stage reads;
//! the stages live in files of their own (submit, claims, provider, media, reports, commands).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use spindle_control::submit::ClaimedSubmit;
use spindle_control::{
    ClaimRefusal, ClaimRequest, ClaimResult, Demand, NewTask, PartitionId, PoolShard, Report,
    ReportAction, ReportResult, StoreError, SubmitOutcome,
};
use spindle_core::hash::{RunMap, RunSet};
use spindle_core::ledger::LimitId;
use spindle_core::shard::{
    ClaimOutcome, Command, CompleteOutcome, NodeCapacity, Poll, SubmitRequest,
};
use spindle_core::share::ShardLoad;
use spindle_core::{
    CostEstimate, Decision, FencingToken, Policy, Shard, TaskId, TaskState, TenantId, Time, Units,
};
use spindle_sync::ShareBoard;
use spindle_wire::{Admission, ErrorCode, Response, SubmitTask, TaskStatus, WireError};
use tokio::sync::{mpsc, oneshot};

use spindle_control::query::{lost_claim, TaskHead};
use spindle_node_control::control::{
    preferred_pool_shard, provider_pool, provider_pool_shards, CpMsg, InputUnread, Pipes, ReadMsg,
    StoredInput,
};

/// Logs an event about a task with its tenant, task and attempt as fields (a JSON log carries
/// each as a key): `task_event!(warn, s, task, "{task}: …")`, `s` the shard's state.
macro_rules! task_event {
    ($level:ident, $s:expr, $task:expr, $($arg:tt)+) => {{
        let task: spindle_core::TaskId = $task;
        let (tenant, attempt) = $s.log_fields(task);
        tracing::$level!(tenant, task = %task, attempt, $($arg)+)
    }};
}

mod claims;
mod commands;
mod inputs;
mod media;
mod provider;
mod reconcile;
mod reports;
mod submit;
mod subscriptions;
use claims::*;
use commands::*;
use inputs::{Input, Inputs};
use media::*;
use provider::*;
use reports::*;
pub use spindle_node_base::messages::Reconciled;
pub use spindle_node_base::messages::StoredRequest;
use submit::*;
pub(crate) use submit::{commit, decide_now, Admitted, Decided};

/// How often the shard looks at its timers (retries, aging) without other input.
const TICK: Duration = Duration::from_millis(20);
/// Ticks between two publications of per-tenant running work (every 200 ms).
const TENANT_TICKS: u64 = 10;
/// User records the core looks at for idle ones each tick (200,000 a second).
const USER_SWEEP_PER_TICK: usize = 4_096;

use spindle_node_base::limits::CLAIMS_PER_PUMP_MAX;
pub use spindle_node_base::limits::SHARD_QUEUE_MAX;
pub use spindle_node_base::messages::ShardMsg;
use subscriptions::{Subscriber, Subscriptions};
pub use subscriptions::{
    SUBSCRIPTIONS_MAX, SUBSCRIPTIONS_PER_TASK_MAX, SUBSCRIPTIONS_PER_TENANT_MAX,
};

/// Progress milestone of a state (design.md §5: 10/30/60/90/100).
fn progress_of(state: TaskState) -> u8 {
    match state {
        TaskState::Created | TaskState::Queued => 0,
        TaskState::Dispatching | TaskState::SubmitUnknown => 10,
        TaskState::Running => 30,
        // The media stage is the last part of the way: it starts where the provider's ends and
        // reports its own 90 % milestone (`MediaProgress`).
        TaskState::ProviderSucceeded | TaskState::MediaProcessing => 60,
        TaskState::Succeeded | TaskState::Failed | TaskState::Canceled | TaskState::Expired => 100,
    }
}

/// Pushes an event to `task`'s subscribers at its state's milestone.
fn notify(s: &mut ShardState, task: TaskId, state: TaskState) {
    notify_at(s, task, state, progress_of(state), None);
}

/// Pushes an event to `task`'s subscribers. A subscriber whose connection is gone or whose
/// queue is full is dropped (a slow reader cannot hold the shard); the task's end drops all.
/// `result`: what a SUCCEEDED task produced.
fn notify_at(
    s: &mut ShardState,
    task: TaskId,
    state: TaskState,
    progress_pct: u8,
    result: Option<&str>,
) {
    if !s.subs.has(task) {
        return;
    }
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let event = spindle_wire::Event {
        task,
        state,
        progress_pct,
        at_ms,
        result: result.map(str::to_string),
    };
    let (tenant, attempt) = s.log_fields(task);
    s.subs.retain(task, state.is_terminal(), |sub| {
        let frame = crate::server::frame(sub.request_id, Response::Event(event.clone()));
        match sub.out.try_send(frame) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(tenant, task = %task, attempt, "dropping a subscriber of task {task}: {e}");
                false
            }
        }
    });
}

/// The shell's record of a live task, beside the core's.
struct Meta {
    tenant: TenantId,
    /// The task's version in PostgreSQL, for the claim's compare-and-set.
    db_version: u32,
    token: Option<FencingToken>,
    committed: bool,
    /// Set when the core dispatches the task. Boxed, as `attempt` is: most live tasks are
    /// queued and hold neither, and this record is most of a queued task's memory in the node
    /// (docs/benchmarks/journal.md, "Memory per queued task").
    estimate: Option<Box<CostEstimate>>,
    /// When it was admitted (or restored): its queue wait ends at dispatch.
    queued_at: Time,
    /// What the client declared (checked against the probed video).
    spec: Option<spindle_core::TaskSpec>,
    /// The current attempt at an HTTP provider: account and request key once claimed, the
    /// job id once accepted.
    attempt: Option<Box<ProviderAttempt>>,
    /// Report rows sent and not yet answered. A claim waits for them: its compare-and-set
    /// needs the version they leave behind (a requeue's, say).
    pending_reports: u32,
    /// For an attempt resumed past its provider stage: the stage PostgreSQL already holds
    /// (PROVIDER_SUCCEEDED or MEDIA_PROCESSING), which its media step does not report again.
    stored_stage: Option<TaskState>,
}

#[derive(Debug, Clone)]
struct ProviderAttempt {
    account: String,
    request_key: String,
    job_id: Option<String>,
    /// Set when the task is canceled before its submit went out: the provider thread then
    /// does not send it (`HttpProvider::submit_unless`).
    withdrawn: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The provider's video, once the job succeeded: the media stage's input.
    output_url: Option<String>,
    /// When the attempt started (its claim; for one put back, as long before as PostgreSQL
    /// says it has run): its lane's execution timeout counts from here.
    started: std::time::Instant,
}

/// The instant `ms` ago (now, where the clock does not reach that far back).
fn started_before(ms: u64) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_sub(std::time::Duration::from_millis(ms))
        .unwrap_or(now)
}

impl ProviderAttempt {
    /// The execution timeout of `lane` (`policy`), if it sets one, from the attempt's start.
    fn timeout(
        &self,
        policy: &spindle_core::Policy,
        lane: spindle_core::Lane,
    ) -> Option<(std::time::Instant, String)> {
        let ms = policy.lane(lane).execution_timeout_ms;
        (ms > 0).then(|| {
            (
                self.started + std::time::Duration::from_millis(ms),
                format!(
                    "ran past the {lane} lane's execution timeout ({ms} ms): canceled at the \
                     provider"
                ),
            )
        })
    }

    /// The query by request key that finds this attempt's job at the provider.
    fn resolve(
        &self,
        shard: usize,
        task: TaskId,
        token: FencingToken,
    ) -> spindle_node_workers::dispatch::Call {
        spindle_node_workers::dispatch::Call::Resolve {
            shard,
            task,
            token,
            account: self.account.clone(),
            request_key: self.request_key.clone(),
        }
    }
}

pub struct ShardState {
    core: Shard,
    /// This node's id (what PostgreSQL records as an attempt's node).
    node: Rc<str>,
    epoch: Instant,
    pipes: Pipes,
    reads: mpsc::Sender<ReadMsg>,
    ids: std::ops::Range<u64>,
    partitions: u32,
    meta: RunMap<TaskId, Meta>,
    /// The inputs of the live tasks submitted with one, for the provider.
    inputs: Inputs,
    /// Live tasks whose attempt holds provider-stage capacity (their `Meta::estimate` is set),
    /// in all and per tenant: kept as they change, so that publishing them never walks the tasks.
    running: Running,
    /// Claims of tasks dispatched before their submit committed, sent once it has (a claim
    /// must never reach PostgreSQL before its task). At most one per uncommitted task.
    held_claims: RunMap<TaskId, ClaimRequest>,
    /// Claims whose submit committed since the last pump.
    ready_claims: Vec<ClaimRequest>,
    /// Tasks that expired in the queue before their submit committed.
    expired_uncommitted: RunSet<TaskId>,
    /// Tasks ended here whose end is not yet stored (their finish report is unanswered), by
    /// tenant: a subscription to one is taken, and hears the end once it is stored.
    ending: RunMap<TaskId, TenantId>,
    time_scale: f64,
    /// Reports waiting for the next flush (every pump).
    outbox: Vec<Report>,
    /// Tasks with a report sent and not yet answered: their next report waits in the outbox
    /// until then, so that a task's reports are applied in the order they were made even
    /// when a batch fails and is sent again (`reports::take_reports`).
    reporting: RunSet<TaskId>,
    subs: Subscriptions,
    /// Where the local provider appends one "task attempt" line per execution.
    log: Option<std::fs::File>,
    metrics: std::sync::Arc<spindle_node_base::metrics::Metrics>,
    index: usize,
    /// Shards on this node: which pool rows this shard's claims ask for
    /// ([`preferred_pool_shard`]).
    shard_count: usize,
    /// Node-wide limits sub-leased among the shards, and which of the core's limits they are.
    board: std::sync::Arc<ShareBoard>,
    split_limits: Vec<(LimitId, NodeCapacity)>,
    /// Shard 0 (which sets every shard's targets): per split limit, the shards' lags behind
    /// the node's virtual time that correct the split (`spindle_core::share::Lags`).
    split_lags: Vec<spindle_core::share::Lags>,
    /// Each provider account's RPM bucket in the core, with the account's name.
    provider_rpm: Vec<(LimitId, String)>,
    ownership: std::sync::Arc<spindle_node_base::ownership::Ownership>,
    dispatch: Option<spindle_node_workers::dispatch::DispatchHandle>,
    health: std::sync::Arc<spindle_node_base::health::ProviderHealth>,
    media: Option<spindle_node_workers::media::MediaPool>,
    /// Ticks between renewals of the live attempts' leases (a third of a lease).
    renew_ticks: u64,
    /// Leases of partitions and attempts (`lease_ms`).
    lease_ms: u32,
    /// What new submits pass: refused where the durable path could not take them within the
    /// ack budget (`spindle_node_base::overload`).
    gate: spindle_node_base::overload::Gate,
}

pub type SharedShard = Rc<RefCell<ShardState>>;

/// What [`ShardState::restore`] did.
#[derive(Default)]
pub struct Restored {
    /// Queries by request key for the resumed attempts, for the provider thread.
    pub calls: Vec<spindle_node_workers::dispatch::Call>,
}

/// What a shard starts with.
pub struct ShardSetup {
    pub node: String,
    pub policy: Policy,
    /// Shards on this node (node-wide limits are split among them).
    pub shards: u32,
    /// This shard's control-plane pipelines and the node's read connection.
    pub pipes: Pipes,
    pub reads: mpsc::Sender<ReadMsg>,
    /// Task ids reserved for this shard.
    pub ids: std::ops::Range<u64>,
    pub partitions: u32,
    /// The local provider's time scale and execution log.
    pub time_scale: f64,
    pub log: Option<std::fs::File>,
    pub metrics: std::sync::Arc<spindle_node_base::metrics::Metrics>,
    /// This shard's index (its gauges in `metrics`).
    pub index: usize,
    /// The node's board of split limits (see [`spindle_node_control::control::split::split_board`]).
    pub board: std::sync::Arc<ShareBoard>,
    pub ownership: std::sync::Arc<spindle_node_base::ownership::Ownership>,
    /// The provider thread, when an HTTP provider is configured (else the local provider).
    pub dispatch: Option<spindle_node_workers::dispatch::DispatchHandle>,
    pub health: std::sync::Arc<spindle_node_base::health::ProviderHealth>,
    /// The media workers, when the media stage is configured (else media completes at once).
    pub media: Option<spindle_node_workers::media::MediaPool>,
    /// The lease of running attempts (renewed every third of it).
    pub lease_ms: u32,
    /// Bytes of task inputs this shard holds in memory at most (its part of `task_inputs_mb`).
    pub inputs_bytes_max: usize,
    /// How long a new submit may be expected to wait for its commit before it is refused
    /// (`ack_budget_ms`; zero: never refused for that), and the board where the shards
    /// publish what their tenants offer.
    pub ack_budget: Duration,
    pub offers: std::sync::Arc<spindle_node_base::overload::OfferBoard>,
}

impl ShardState {
    /// A task's tenant and attempt number, for its log lines (`None` once it left the shard).
    fn log_fields(&self, task: TaskId) -> (Option<u32>, Option<u32>) {
        (
            self.meta.get(&task).map(|m| m.tenant.0),
            self.core.task_attempt_no(task),
        )
    }

    pub fn new(setup: ShardSetup) -> ShardState {
        let epoch = Instant::now();
        let mut core = Shard::new(setup.policy.clone(), setup.shards, Time::ZERO);
        // The quotas count civil periods: the wall clock at the shard's zero.
        core.set_wall_epoch_ms(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        );
        let split_limits = core.node_limits();
        let provider_rpm = core
            .ledger()
            .ids()
            .filter_map(|(id, key)| provider_rpm_of(&setup.policy, id, key))
            .collect();
        assert_eq!(
            split_limits.len() + spindle_node_control::live_policy::ROOM_LIMITS,
            setup.board.limits(),
            "the board was made for this policy"
        );
        let gate = spindle_node_base::overload::Gate::new(
            setup.ack_budget,
            setup.pipes.submit_gauge.clone(),
            setup.pipes.work_gauge.clone(),
            setup.offers,
            setup.index,
            setup.metrics.overload_refused.clone(),
        );
        ShardState {
            gate,
            core,
            node: setup.node.into(),
            board: setup.board,
            split_limits,
            split_lags: Vec::new(),
            provider_rpm,
            ownership: setup.ownership,
            dispatch: setup.dispatch,
            health: setup.health,
            media: setup.media,
            renew_ticks: (u64::from(setup.lease_ms / 3) / TICK.as_millis() as u64).max(1),
            lease_ms: setup.lease_ms,
            epoch,
            pipes: setup.pipes,
            held_claims: RunMap::default(),
            ready_claims: Vec::new(),
            expired_uncommitted: Default::default(),
            ending: Default::default(),
            reads: setup.reads,
            ids: setup.ids,
            partitions: setup.partitions,
            meta: RunMap::default(),
            inputs: Inputs::new(setup.inputs_bytes_max),
            running: Running::default(),
            time_scale: setup.time_scale,
            outbox: Vec::new(),
            reporting: RunSet::default(),
            subs: Subscriptions::default(),
            log: setup.log,
            metrics: setup.metrics,
            index: setup.index,
            shard_count: setup.shards as usize,
        }
    }

    fn now(&self) -> Time {
        Time::of(Instant::now(), self.epoch)
    }

    /// Puts back the tasks PostgreSQL holds for this shard's partitions: QUEUED ones into
    /// their queues, live attempts into their provider stage. Returns the queries by request
    /// key that find each live attempt's job at the provider (to send to the provider thread):
    /// a job found is followed to its end, one the provider never got is run again as a new
    /// attempt, so no job is submitted twice. A task the core holds already is skipped. One
    /// that cannot come back — unreadable, or refused by the core (its tenant or model left
    /// the policy, its spec no longer fits the model, its attempts are used up) — is failed in
    /// PostgreSQL with the reason: left QUEUED it would wait unserved and unanswered, and
    /// stopping the node for it would stop every other tenant's work.
    pub fn restore(&mut self, restores: spindle_node_control::control::ShardRestores) -> Restored {
        let now = self.now();
        let mut done = Restored::default();
        // Their quotas count again from what PostgreSQL holds: the tasks put back (as each
        // comes back) and what the ended ones consumed.
        for &tenant in &restores.quota_tenants {
            self.core.clear_quota_usage(tenant);
        }
        for &(tenant, floor) in &restores.quota_floors {
            self.core.set_quota_floor(tenant, floor);
        }
        for c in &restores.consumed {
            self.core.charge_ended_quotas(
                c.tenant,
                spindle_core::UserId(c.user),
                spindle_core::ModelId(c.model),
                c.at_unix_ms,
                c.cost_milli,
                c.tasks,
            );
        }
        let mut unrestorable = restores.unrestorable;
        for r in restores.tasks {
            let task = r.request.submit.task;
            let token = r.live.as_ref().map(|l| l.token);
            let cancel = r.cancel;
            match self.restore_one(now, r) {
                Ok(call) => {
                    done.calls.extend(call);
                    if cancel {
                        self.cancel_put_back(task);
                    }
                }
                // Held here already (an operator's requeue asked again, a lease re-taken after
                // it lapsed): nothing to put back.
                Err(spindle_core::SubmitError::DuplicateTask(_)) => {
                    task_event!(debug, self, task, "{task} is here already");
                }
                Err(e) => unrestorable.push(spindle_node_control::control::Unrestorable::refused(
                    task, token, e,
                )),
            }
        }
        self.fail_unrestorable(unrestorable);
        done
    }

    /// A task put back whose client canceled it before this node had it (the cancel stored,
    /// not yet carried out): a queued task ends here; a live attempt's job is canceled once
    /// the query by request key finds it.
    fn cancel_put_back(&mut self, task: TaskId) {
        if let Err(e) = cancel_held(self, task) {
            task_event!(warn, self, task, "canceling {task} put back: {e}");
        }
    }

    /// Fails each task in `tasks` in PostgreSQL (QUEUED, or its live attempt, → FAILED), with
    /// "not restorable: " and the reason as its failure reason; an operator who fixed the
    /// cause takes it back with a requeue. The reports go with the shard's others, retried
    /// while PostgreSQL is away.
    fn fail_unrestorable(&mut self, tasks: Vec<spindle_node_control::control::Unrestorable>) {
        if tasks.is_empty() {
            return;
        }
        self.metrics
            .restore_failed
            .fetch_add(tasks.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let reports = tasks
            .into_iter()
            .map(|u| {
                task_event!(
                    error,
                    self,
                    u.task,
                    "cannot put back {}; failing it: {}",
                    u.task,
                    u.reason
                );
                let action = ReportAction::Finish {
                    state: TaskState::Failed,
                    cost_actual_milli: None,
                    reason: Some(stored_reason(&format!("not restorable: {}", u.reason))),
                    result: None,
                };
                Report::new(u.task, u.token, action)
            })
            .collect::<Vec<_>>();
        send_reports(self, reports);
    }

    fn restore_one(
        &mut self,
        now: Time,
        r: spindle_node_control::control::Restore,
    ) -> Result<Option<spindle_node_workers::dispatch::Call>, spindle_core::SubmitError> {
        let mut resolve = None;
        let task = r.request.submit.task;
        let tenant = r.request.submit.tenant;
        let spec = r.request.submit.spec;
        let mut meta = Meta {
            tenant,
            db_version: r.version,
            token: None,
            committed: true,
            estimate: None,
            queued_at: now,
            attempt: None,
            pending_reports: 0,
            spec: Some(spec),
            stored_stage: None,
        };
        match r.live {
            None => {
                // A deadline counts from the submission: what is left of it now, on this
                // shard's clock (none left: the core expires the task at its next poll).
                let mut request = r.request;
                if let Some(at) = r.deadline_at {
                    let left = at
                        .duration_since(std::time::SystemTime::now())
                        .unwrap_or_default();
                    request.submit.deadline = Some(now.plus_ns(left.as_nanos() as u64));
                }
                self.core.handle_restore(now, request)?
            }
            Some(live) => {
                // Past the provider stage the job is found again like a running one: its
                // end at the provider hands the media step its video once more.
                let state = match live.stored {
                    TaskState::Dispatching | TaskState::SubmitUnknown => TaskState::SubmitUnknown,
                    _ => TaskState::Running,
                };
                if matches!(
                    live.stored,
                    TaskState::ProviderSucceeded | TaskState::MediaProcessing
                ) {
                    meta.stored_stage = Some(live.stored);
                }
                let estimate = self.core.handle_resume(
                    now,
                    spindle_core::ResumeRequest {
                        submit: r.request.submit,
                        lane: r.request.lane,
                        band: r.request.band,
                        attempt_no: r.request.attempts_before,
                        provider: live.provider,
                        token: live.token,
                        state,
                    },
                )?;
                let account = self.core.policy().providers[live.provider.0 as usize]
                    .name
                    .clone();
                self.running.start(tenant, estimate.fairness.milli());
                meta.token = Some(live.token);
                meta.estimate = Some(Box::new(estimate));
                let attempt = ProviderAttempt {
                    account,
                    request_key: live.request_key,
                    job_id: None,
                    withdrawn: Default::default(),
                    output_url: None,
                    started: started_before(live.running_ms),
                };
                resolve = Some(attempt.resolve(self.index, task, live.token));
                meta.attempt = Some(Box::new(attempt));
                if live.stored == TaskState::Dispatching {
                    // Whether its submit reached the provider is not known.
                    let to = ReportAction::Advance(TaskState::SubmitUnknown);
                    send_reports(self, [Report::new(task, Some(live.token), to)]);
                }
            }
        }
        self.meta.insert(task, meta);
        if let Some(input) = r.input {
            self.inputs.keep(task, input);
        }
        let submitted_ms = r
            .submitted_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.core.charge_restored_quotas(task, submitted_ms);
        Ok(resolve)
    }

    /// Sends `calls` to the provider thread (without one, there are none to send).
    pub fn send_calls(&self, calls: Vec<spindle_node_workers::dispatch::Call>) {
        let Some(d) = self.dispatch.clone() else {
            return;
        };
        if calls.is_empty() {
            return;
        }
        glommio::spawn_local(async move {
            for call in calls {
                if d.calls.send(call).await.is_err() {
                    tracing::warn!("the provider thread stopped");
                    return;
                }
            }
        })
        .detach();
    }
}

/// Runs the shard until its inbox closes.
pub async fn run(state: SharedShard, mut inbox: mpsc::Receiver<ShardMsg>) {
    let ticker = glommio::spawn_local(tick(state.clone())).detach();
    while let Some(msg) = inbox.recv().await {
        handle(&state, msg).await;
        pump(&state).await;
    }
    drop(ticker);
}

/// The shard's clock: every [`TICK`] the node-wide limits are split again, the gate, user
/// records and gauges kept, the tenants published, attempts renewed and work pumped.
async fn tick(state: SharedShard) {
    for tick in 0u64.. {
        glommio::timer::sleep(TICK).await;
        resplit(&mut state.borrow_mut());
        {
            let mut s = state.borrow_mut();
            s.gate.tick(Instant::now());
            // Idle user records go (a tenant cycling user ids holds a bounded number).
            let now = s.now();
            s.core.sweep_users(now, USER_SWEEP_PER_TICK);
            s.metrics.beat(s.index);
            let g = &s.metrics.shards[s.index];
            let relaxed = std::sync::atomic::Ordering::Relaxed;
            g.gate_calibration_milli
                .store((s.gate.calibration() * 1e3) as u64, relaxed);
            g.gate_tenants
                .store(s.gate.active_tenants() as u64, relaxed);
            g.subscriptions.store(s.subs.total() as u64, relaxed);
        }
        if tick % TENANT_TICKS == 0 {
            publish_tenants(&state.borrow());
        }
        let renew_ticks = state.borrow().renew_ticks;
        if tick % renew_ticks == renew_ticks - 1 {
            renew_attempts(&state).await;
        }
        pump(&state).await;
    }
}

/// One message from the shard's inbox.
async fn handle(state: &SharedShard, msg: ShardMsg) {
    match msg {
        ShardMsg::Submit {
            tenant,
            tasks,
            batch,
            reply,
        } => {
            let state = state.clone();
            glommio::spawn_local(async move { submit(&state, tenant, tasks, batch, reply).await })
                .detach();
        }
        ShardMsg::Get {
            tenant,
            task,
            reply,
        } => {
            let state = state.clone();
            glommio::spawn_local(async move { get(&state, tenant, task, reply).await }).detach();
        }
        ShardMsg::Cancel {
            tenant,
            task,
            reply,
        } => cancel(state, tenant, task, reply),
        ShardMsg::AdminCancel { tasks, reply } => {
            let state = state.clone();
            glommio::spawn_local(async move { admin_cancel(&state, tasks, reply).await }).detach();
        }
        ShardMsg::Subscribe {
            tenant,
            task,
            request_id,
            out,
            reply,
        } => subscribe(state, tenant, task, request_id, out, reply),
        ShardMsg::Provider(event) => {
            let state = state.clone();
            glommio::spawn_local(async move { provider_event(&state, event).await }).detach();
        }
        ShardMsg::Policy(patch) => apply_policy(&mut state.borrow_mut(), patch),
        ShardMsg::PolicyVersion(version) => {
            state.borrow_mut().core.set_policy_version(version);
        }
        ShardMsg::Media(event) => {
            media_event(&mut state.borrow_mut(), event);
            pump(state).await;
        }
        ShardMsg::MediaProgress { task, token, pct } => {
            let mut s = state.borrow_mut();
            // Only the live attempt's job, while its media stage runs.
            let current = s.meta.get(&task).is_some_and(|m| m.token == Some(token));
            if current && s.core.task_state(task) == Some(TaskState::MediaProcessing) {
                notify_at(&mut s, task, TaskState::MediaProcessing, pct, None);
            }
        }
        ShardMsg::Restore(restores) => {
            let mut s = state.borrow_mut();
            let done = s.restore(restores);
            s.send_calls(done.calls);
        }
        ShardMsg::Reconcile { found, reply } => {
            let done = state.borrow_mut().reconcile(found);
            let _ = reply.send(done);
        }
        ShardMsg::Quotas { tenant, reply } => {
            let s = state.borrow();
            let now = s.now();
            let _ = reply.send((s.core.quota_clock_ms(now), s.core.quota_report(tenant, now)));
        }
        ShardMsg::ResetQuotas {
            tenant,
            floor_unix_ms,
            reply,
        } => {
            state
                .borrow_mut()
                .core
                .set_quota_floor(tenant, floor_unix_ms);
            let _ = reply.send(());
        }
        ShardMsg::Unsubscribe { task, out, reply } => {
            let mut s = state.borrow_mut();
            s.subs
                .retain(task, false, |sub| !sub.out.same_channel(&out));
            let _ = reply.send(Response::Unsubscribed(task));
        }
        ShardMsg::Disconnected { tasks, out } => {
            state
                .borrow_mut()
                .subs
                .drop_connection(tasks.as_deref(), &out);
        }
    }
}

/// Renews the leases of this shard's live attempts (every third of a lease), down the work
/// pipeline so that a renewal never overtakes the report that ended its attempt.
async fn renew_attempts(state: &SharedShard) {
    let (cp, attempts) = {
        let s = state.borrow();
        let live: Vec<(TaskId, FencingToken)> = s
            .meta
            .iter()
            .filter_map(|(task, m)| m.token.map(|t| (*task, t)))
            .collect();
        (s.pipes.work.clone(), live)
    };
    if !attempts.is_empty() && cp.send(CpMsg::Renew { attempts }).await.is_err() {
        tracing::warn!("control plane stopped; attempt leases are not renewed");
    }
}

/// Sends one message down this shard's pipeline and waits for its answer; a pipeline that is
/// gone answers `Unavailable`.
async fn ask<M, T>(
    cp: &mpsc::Sender<M>,
    message: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> M,
) -> Result<T, StoreError> {
    let stopped = || StoreError::Unavailable("control plane stopped".into());
    let (tx, rx) = oneshot::channel();
    cp.send(message(tx)).await.map_err(|_| stopped())?;
    rx.await.map_err(|_| stopped())?
}

/// Counts a submit or claim batch in doubt.
fn count_in_doubt(state: &SharedShard) {
    state
        .borrow()
        .metrics
        .calls_in_doubt
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Forgets a live task, keeping the count of running ones.
fn remove_meta(s: &mut ShardState, task: &TaskId) -> Option<Meta> {
    let meta = s.meta.remove(task);
    s.inputs.release(*task);
    if let Some(m) = meta.as_ref().filter(|m| m.committed) {
        // Its finish report follows (or it is forgotten, `forget`, which takes it out again).
        s.ending.insert(*task, m.tenant);
    }
    if let Some(m) = &meta {
        if let Some(e) = &m.estimate {
            s.running.stop(m.tenant, e.fairness.milli());
        }
    }
    meta
}

/// Drops a task that never became durable (or was a replay).
fn forget(s: &mut ShardState, task: TaskId) {
    remove_meta(s, &task);
    s.ending.remove(&task);
    // A cancel of a task the core already let go of is nothing to do.
    let _ = s.core.handle_cancel(task);
    s.expired_uncommitted.remove(&task);
    if s.held_claims.remove(&task).is_some() {
        // Dispatched already: its claim is never sent; the core gives its holdings back.
        let now = s.now();
        if let Err(e) = s.core.handle_claim_refused(now, task) {
            task_event!(warn, s, task, "dropping the claim of {task}: {e}");
        }
    }
}

fn answer_error(reply: oneshot::Sender<Response>, code: ErrorCode, message: String) {
    let _ = reply.send(Response::Error(WireError::new(code, message)));
}

/// `id` with its account's name when it is a provider account's RPM limit (`ShardState`'s
/// `provider_rpm`: which accounts a 429 has halved, for `/metrics`).
fn provider_rpm_of(
    policy: &Policy,
    id: LimitId,
    key: spindle_core::ledger::LimitKey,
) -> Option<(LimitId, String)> {
    match key {
        spindle_core::ledger::LimitKey::ProviderRpm(p) => policy
            .providers
            .get(usize::from(p.0))
            .map(|p| (id, p.name.clone())),
        _ => None,
    }
}

/// Takes one object of a newer policy version into the core, and the node-wide capacities it
/// changed into the split: the coordinator (shard 0) resizes them on the board, every shard
/// splits its own part of the new capacity from the next tick on.
fn apply_policy(s: &mut ShardState, patch: spindle_core::policy::PolicyPatch) {
    let now = s.now();
    if let Err(e) = s.core.apply_patch(patch, now) {
        tracing::warn!("shard {}: policy object refused: {e}", s.index);
        return;
    }
    for (k, (id, capacity)) in s.core.node_limits().into_iter().enumerate() {
        let Some(slot) = s.split_limits.get_mut(k) else {
            // A new provider account's or model's limit, after every other one: on the board's
            // room (`live_policy::Room` keeps additions within it), empty until now. The
            // coordinator gives it its capacity; every shard then takes parts by the split.
            assert!(k < s.board.limits(), "a limit added past the board's room");
            s.split_limits.push((id, capacity));
            let key = s.core.ledger().key(id);
            s.provider_rpm
                .extend(provider_rpm_of(s.core.policy(), id, key));
            if s.index == 0 {
                s.board.set_capacity(k, capacity.units());
                if let Some(shared) =
                    spindle_node_control::control::split::shared_limit(k, key, capacity)
                {
                    s.ownership.add_shared(shared);
                }
                if let Some(split) = s.metrics.split.get() {
                    if let Ok(mut names) = split.names.lock() {
                        names.push(key.to_string());
                    }
                }
            }
            continue;
        };
        debug_assert_eq!(slot.0, id, "node limits keep their order");
        if slot.1 != capacity {
            slot.1 = capacity;
            if s.index == 0 {
                s.board.set_capacity(k, capacity.units());
            }
        }
    }
}

/// Moves this shard's parts of the node-wide limits toward their split-rule targets (design.md
/// §3): publishes its load, lets shard 0 set every shard's target from the last loads, and takes
/// or gives back units through the board's free pool, never below what it uses.
fn resplit(s: &mut ShardState) {
    let now = s.now();
    for (k, &(id, full)) in s.split_limits.iter().enumerate() {
        // A shared limit is the node's part of the cluster's (the nodes share an account's RPM
        // and concurrency).
        let shared = s.ownership.share(k);
        let capacity = match (full, shared) {
            (NodeCapacity::Rate(r), Some(ppm)) => NodeCapacity::Rate(cluster_part(r, ppm)),
            (NodeCapacity::Slots(v), Some(slots)) => NodeCapacity::Slots(slots.min(v)),
            (own, None) => own,
        };
        let load = s.core.split_load(id);
        // Nobody holds a rate: a rate's part can shrink at once.
        let used = match capacity {
            NodeCapacity::Slots(_) => load.used,
            NodeCapacity::Rate(_) => 0,
        };
        s.board.publish(
            k,
            s.index,
            spindle_sync::Load {
                used,
                weight: load.weight,
                vtime: load.vtime,
                refused: load.refused,
                held: 0,
            },
        );
        if s.index == 0 {
            if let Some(loads) = s.board.loads(k) {
                let loads: Vec<ShardLoad> = loads
                    .iter()
                    .map(|l| ShardLoad {
                        used: l.used,
                        weight: l.weight,
                        share: l.held,
                        vtime: l.vtime,
                        refused: l.refused,
                    })
                    .collect();
                if s.split_lags.len() <= k {
                    s.split_lags.resize(k + 1, Default::default());
                }
                let gain = spindle_core::share::lag_gain_milli(s.core.policy());
                let weighed = s.split_lags[k].weigh(&loads, gain);
                s.board.set_targets(k, &capacity.split_targets(&weighed));
            }
        }
        let mut held = s.board.rebalance(k, s.index, used);
        if let (NodeCapacity::Slots(part), Some(_)) = (capacity, shared) {
            // Slots the node shares with the cluster: never more than this shard's fair part of
            // the node's part, even while it holds more. What it runs above that comes down as
            // its work ends, and the freed slot is not claimed again here: it is what another
            // node (or shard) below its share waits for. (The board's targets keep every
            // shard's holding at least what it uses, so they cannot say this.)
            if let Some(loads) = s.board.loads(k) {
                let weights: Vec<u64> = loads.iter().map(|l| l.weight).collect();
                let fair = spindle_control::cluster_shares::targets(part, &weights);
                held = held.min(fair.get(s.index).copied().unwrap_or(0));
            }
        }
        if let spindle_core::ledger::LimitKey::ProviderConcurrency(p) = s.core.ledger().key(id) {
            if s.health.is_open(p.0 as usize) {
                // An open circuit: what runs there finishes; nothing new goes there.
                held = held.min(load.used);
            }
        }
        let share = if load.weight > 0 {
            capacity.waiting_part(held)
        } else {
            capacity.part(held)
        };
        let share = match share {
            // Submits to the account wait at this shard's pacer (a stall bunched them): no
            // new picks for it, and no tokens saved up meanwhile, until they have left. At the
            // account's full rate they would otherwise queue behind that backlog for as long as
            // the account stays busy.
            NodeCapacity::Rate(r) if paced_backlog(s, id) > 0 => {
                NodeCapacity::Rate(spindle_core::policy::RateSpec { burst: 0, ..r })
            }
            share => share,
        };
        s.core.set_share(id, share, now);
    }
}

/// Submits of this shard waiting at its pacer for the account whose RPM is limit `id` (0 for
/// any other limit, or without a provider thread).
fn paced_backlog(s: &ShardState, id: spindle_core::LimitId) -> u64 {
    let Some(d) = &s.dispatch else {
        return 0;
    };
    s.provider_rpm
        .iter()
        .find(|(rpm, _)| *rpm == id)
        .map_or(0, |(_, account)| d.paced_backlog(account, s.index))
}

/// `ppm` millionths of the cluster's rate `r`, its burst rounded down (the nodes' bursts never
/// add up to more than the account's; a shard with work waiting on a sliver still gets one
/// request: [`NodeCapacity::waiting_part`]).
fn cluster_part(r: spindle_core::policy::RateSpec, ppm: u64) -> spindle_core::policy::RateSpec {
    let of = |v: u64| {
        (u128::from(v) * u128::from(ppm) / u128::from(spindle_control::cluster_shares::WHOLE))
            as u64
    };
    spindle_core::policy::RateSpec {
        per_minute: of(r.per_minute),
        burst: of(r.burst),
    }
}

/// Live tasks holding provider-stage capacity, in all and per tenant (tasks, fairness units).
#[derive(Debug, Default)]
struct Running {
    total: u64,
    by_tenant: HashMap<u32, (u64, u64)>,
}

impl Running {
    fn start(&mut self, tenant: TenantId, units_milli: u64) {
        self.total += 1;
        let t = self.by_tenant.entry(tenant.0).or_default();
        t.0 += 1;
        t.1 += units_milli;
    }

    fn stop(&mut self, tenant: TenantId, units_milli: u64) {
        self.total -= 1;
        let Some(t) = self.by_tenant.get_mut(&tenant.0) else {
            // A stop without its start is a bug; debug builds say so here, as the walk in
            // `publish_tenants` would a tick later.
            debug_assert!(false, "tenant {} stopped work it never started", tenant.0);
            return;
        };
        t.0 -= 1;
        t.1 -= units_milli;
        if t.0 == 0 {
            self.by_tenant.remove(&tenant.0);
        }
    }
}

/// Per-tenant running work for `/metrics` (every `TENANT_TICKS` ticks), from the tally kept as
/// tasks start and stop. Debug builds check the tally against a walk of the live tasks.
fn publish_tenants(s: &ShardState) {
    #[cfg(debug_assertions)]
    {
        let mut walked: HashMap<u32, (u64, u64)> = HashMap::new();
        for m in s.meta.values() {
            if let Some(e) = &m.estimate {
                let t = walked.entry(m.tenant.0).or_default();
                t.0 += 1;
                t.1 += e.fairness.milli();
            }
        }
        assert_eq!(
            walked, s.running.by_tenant,
            "the running tally drifted from the live tasks"
        );
    }
    let policy = s.core.policy();
    let mut tenants: Vec<_> = s
        .running
        .by_tenant
        .iter()
        .map(
            |(&tenant, &(tasks, units_milli))| spindle_node_base::metrics::TenantRunning {
                tenant,
                tasks,
                units_milli,
                weight: policy
                    .tenants
                    .get(&TenantId(tenant))
                    .map_or(1, |p| p.weight),
            },
        )
        .collect();
    tenants.sort_by_key(|t| t.tenant);
    if let Ok(mut slot) = s.metrics.shards[s.index].tenants.lock() {
        *slot = tenants;
    }
    let now = s.now();
    let penalized: Vec<String> = s
        .provider_rpm
        .iter()
        .filter(|(id, _)| s.core.ledger().is_penalized(*id, now))
        .map(|(_, name)| name.clone())
        .collect();
    if let Ok(mut slot) = s.metrics.shards[s.index].penalized.lock() {
        *slot = penalized;
    }
}

fn publish_gauges(s: &ShardState) {
    use std::sync::atomic::Ordering::Relaxed;
    let g = &s.metrics.shards[s.index];
    for lane in spindle_core::Lane::ALL {
        g.queued_tasks[lane.index()].store(s.core.queued_tasks(lane), Relaxed);
        g.queued_units_milli[lane.index()].store(s.core.queued_units(lane).milli(), Relaxed);
    }
    g.live_tasks.store(s.meta.len() as u64, Relaxed);
    g.input_bytes.store(s.inputs.bytes() as u64, Relaxed);
    g.inputs_stored.store(s.inputs.stored() as u64, Relaxed);
    g.running_tasks.store(s.running.total, Relaxed);
    let stats = s.core.stats();
    for (to, from) in [
        (&g.quota_charged, stats.quota_charged),
        (&g.quota_returned, stats.quota_returned),
    ] {
        to[0].store(from.tasks, Relaxed);
        to[1].store(from.cost_milli, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    /// A queued task's record here is, with the core's, what the node holds per queued task
    /// (`benches/node/memory`; docs/benchmarks/journal.md, "Memory per queued task"). What only a
    /// dispatched task needs is boxed: 80 bytes, 224 before.
    #[test]
    fn a_queued_tasks_record_stays_small() {
        let size = std::mem::size_of::<super::Meta>();
        assert!(size <= 80, "Meta is {size} bytes");
    }
}
