//! One shard's scheduler: admission, lanes, per-lane DRR over active tenants, bands with aging,
//! the fit-scan, multi-dimensional try-acquire, retries and the media stage queue.
//!
//! The shard owns its tenants' queues and its share of node-wide limits. It never blocks: a task
//! that cannot acquire is skipped and the scan goes on (003 "tryTake must not block"), and every
//! `poll_dispatch` does a bounded amount of work.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt;

use crate::admission::{Admission, Decision, QueueLevel, RejectReason, SubmitError};
use crate::cost::{estimate, CostEstimate, ResourceClass, TaskSpec};
use crate::estimates::{EstimateRef, Estimates};
use crate::hash::RunMap;
use crate::ids::{Band, FencingToken, Lane, PolicyVersion, ProviderId, TaskId, TenantId, UserId};
use crate::ledger::{
    Demand, Ledger, LimitId, LimitKey, Need, Scope, Semaphore, SubmitBucket, TokenBucket,
};
use crate::limits::{
    ATTEMPTS_MAX, DELAYED_MAX, FIT_SCAN_MAX, MEDIA_QUEUE_MAX, TASKS_MAX, TENANTS_MAX,
    TENANT_VISITS_PER_POLL_MAX, USERS_MAX, USERS_PER_TENANT_MAX,
};
use crate::policy::{Policy, PolicyError, PolicyPatch, RateSpec, TenantPolicy, WaitOverflow};
use crate::queue::{Links, LinksMut, TenantQueue, NIL};
use crate::share::{split, ShardLoad};
use crate::state::{Actor, TaskState, TransitionError, Versioned};
use crate::table::TaskTable;
use crate::time::{Time, NANOS_PER_MS, NANOS_PER_S};
use crate::units::Units;

/// A lane whose every tenant was blocked is not rescanned until something is released, capacity
/// changes, work arrives, or this much time passes (token buckets refill on their own).
pub const STALL_RETRY_NS: u64 = 50 * NANOS_PER_MS;
/// Service-rate measurement: a lane's rate is how fast its last `RATE_WINDOW` starts drained
/// its queues, once it has seen `RATE_SAMPLES_MIN` of them (the policy's initial rate until
/// then).
const RATE_WINDOW: usize = 32;
const RATE_SAMPLES_MIN: usize = 4;

/// A lane's last starts (when, and the queued units each took out of its queues), for its
/// measured service rate: in the units its queue is counted in, so that units ahead over it
/// is a wait, whatever the work turned out to cost.
#[derive(Debug, Clone, Default)]
struct Starts {
    at: [Time; RATE_WINDOW],
    units_milli: [u64; RATE_WINDOW],
    /// Where the next one goes.
    next: usize,
    len: usize,
}

impl Starts {
    fn record(&mut self, now: Time, units_milli: u64) {
        self.at[self.next] = now;
        self.units_milli[self.next] = units_milli;
        self.next = (self.next + 1) % RATE_WINDOW;
        self.len = (self.len + 1).min(RATE_WINDOW);
    }

    /// The mean units of the window's starts; `None` before `RATE_SAMPLES_MIN` starts.
    fn mean_units_milli(&self) -> Option<u64> {
        (self.len >= RATE_SAMPLES_MIN)
            .then(|| self.units_milli.iter().take(self.len).sum::<u64>() / self.len as u64)
    }

    /// Milli-units a second: the units of the window's starts after its oldest over the time
    /// from the oldest to `until` (now while work waits — a lane that stopped starting work
    /// slows down as it waits — else the newest start: an idle lane keeps its rate). `None`
    /// before `RATE_SAMPLES_MIN` starts.
    fn rate_milli_per_s(&self, until: Option<Time>) -> Option<u64> {
        if self.len < RATE_SAMPLES_MIN {
            return None;
        }
        let oldest = (self.next + RATE_WINDOW - self.len) % RATE_WINDOW;
        let newest = (self.next + RATE_WINDOW - 1) % RATE_WINDOW;
        let units: u64 = (1..self.len)
            .map(|i| self.units_milli[(oldest + i) % RATE_WINDOW])
            .sum();
        let end = until.unwrap_or(self.at[newest]).max(self.at[newest]);
        let span = end.since(self.at[oldest]);
        (span > 0).then(|| {
            (u128::from(units) * u128::from(NANOS_PER_S) / u128::from(span))
                .min(u128::from(u64::MAX)) as u64
        })
    }
}

/// How a dispatched task holds lane capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum CapacityMode {
    Normal,
    /// Runs on another lane's idle capacity; never pre-empted, but no new borrowing once that
    /// lane's own work returns.
    Borrowed(Lane),
}

/// A task picked to run: reservations are held in the shard; the shell claims it in PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dispatch {
    pub task: TaskId,
    pub tenant: TenantId,
    pub user: UserId,
    pub lane: Lane,
    pub band: Band,
    pub provider: ProviderId,
    pub mode: CapacityMode,
    pub attempt_no: u32,
    pub estimate: CostEstimate,
    pub policy_version: PolicyVersion,
}

/// A task that may start its media stage: media slots are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaStart {
    pub task: TaskId,
    pub tenant: TenantId,
    pub estimate: CostEstimate,
}

/// The next output of `poll_dispatch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poll {
    Dispatch(Dispatch),
    /// A queued task passed its deadline and is now EXPIRED.
    Expired(TaskId),
    /// The per-call work bound was reached; call again.
    Yield,
    /// Nothing can be dispatched until an input arrives or `poll_timeout` passes.
    Idle,
}

/// How a provider attempt ended without success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A rate-limit answer: the request was provably not accepted.
    RateLimited,
    /// A transient failure that a later attempt may fix.
    Retryable,
    /// Auth, balance, invalid parameters, moderation: never retried.
    NonRetryable,
}

/// What happened to a task after a failure report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOutcome {
    Requeued {
        eligible_at: Time,
    },
    Failed,
    /// The task had been canceled; its reservations are now released.
    Canceled,
}

/// What the shell does after a granted claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// Submit the attempt to the provider.
    Submit,
    /// The task was canceled meanwhile; its reservation is released; submit nothing.
    Canceled,
}

/// What a cancel did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The task was waiting and is gone.
    Canceled,
    /// The task is CANCELED but holds reservations until its running step reports back.
    CanceledPendingRelease,
}

/// What a completion report did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompleteOutcome {
    /// Provider stage done; queued for a media slot.
    AwaitingMedia,
    Succeeded,
    Failed,
    Canceled,
}

/// An input the shard refuses: the caller is out of date or wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardError {
    UnknownTask(TaskId),
    /// The fencing token is not the task's current one: a stale writer; nothing changed.
    StaleFencing {
        task: TaskId,
        presented: FencingToken,
        current: Option<FencingToken>,
    },
    Transition {
        task: TaskId,
        error: TransitionError,
    },
}

impl fmt::Display for ShardError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardError::UnknownTask(t) => write!(f, "task {t} is not held by this shard"),
            ShardError::StaleFencing { task, presented, current } => write!(
                f,
                "task {task}: fencing token {presented} is stale (current {current:?}); nothing changed"
            ),
            ShardError::Transition { task, error } => write!(f, "task {task}: {error}"),
        }
    }
}

impl std::error::Error for ShardError {}

/// A submit as the shell hands it over (already authenticated and parsed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubmitRequest {
    pub task: TaskId,
    pub tenant: TenantId,
    pub user: UserId,
    pub spec: TaskSpec,
    /// A client may ask for a *lower* band than its tenant's base; never a higher one.
    pub band_hint: Option<Band>,
    pub deadline: Option<Time>,
}

/// A task PostgreSQL holds as QUEUED, put back into a shard after a restart or takeover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreRequest {
    pub submit: SubmitRequest,
    /// Lane and band as admitted (stored with the task).
    pub lane: Lane,
    pub band: Band,
    /// Attempts the task already had (a restored task's next claim is attempt + 1).
    pub attempts_before: u32,
}

/// A task PostgreSQL holds in its provider stage with a live attempt (DISPATCHING,
/// SUBMIT_UNKNOWN or RUNNING), put back after a restart or takeover so that the provider's job
/// is followed to its end instead of being submitted again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumeRequest {
    pub submit: SubmitRequest,
    pub lane: Lane,
    pub band: Band,
    /// The live attempt's number.
    pub attempt_no: u32,
    /// Where the attempt went (the stored provider account).
    pub provider: ProviderId,
    /// The live attempt's fencing token.
    pub token: FencingToken,
    /// SUBMIT_UNKNOWN (the provider may or may not have the job: DISPATCHING comes back as
    /// this) or RUNNING (the provider accepted it).
    pub state: TaskState,
}

/// Limit ids of node-wide keys; identical on every shard built from the same policy.
#[derive(Debug, Clone)]
struct NodeIds {
    lane_queued_tasks: [LimitId; Lane::COUNT],
    lane_queued_units: [LimitId; Lane::COUNT],
    global_queued_tasks: LimitId,
    global_queued_units: LimitId,
    lane_units: [LimitId; Lane::COUNT],
    enterprise_borrowed: LimitId,
    lane_running_tasks: [LimitId; Lane::COUNT],
    model_running: Vec<LimitId>,
    model_running_units: Vec<LimitId>,
    global_running_tasks: LimitId,
    global_running_units: LimitId,
    provider_concurrency: Vec<LimitId>,
    provider_rpm: Vec<LimitId>,
    high_cost: LimitId,
    gpu_units: LimitId,
    gpu_mem_mb: LimitId,
    cpu_units: LimitId,
    temp_disk_mb: LimitId,
    /// Per lane, the cost bucket its provider stage draws on: its own, or the platform's
    /// (what the lanes without their own share).
    cost_bucket: [LimitId; Lane::COUNT],
    /// Per lane, the media workers its media stage holds one of: its own, or the shared ones.
    media_pool: [LimitId; Lane::COUNT],
}

/// A task count and units an owner — a tenant or a user — holds for itself: its queue gates or
/// its running limits. Owners keep theirs inline in their records, where each pair sits in the
/// cache line of the step that uses it (admission reads the gates, the pick the running pair),
/// instead of among every other owner's limits in the ledger.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct OwnedPair {
    tasks: Semaphore,
    units: Semaphore,
}

/// Which of an owner's pairs a step holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Queue gates, while the task waits in a band.
    Queued,
    /// Running limits, while the provider stage holds it.
    Running,
}

impl OwnedPair {
    fn new((tasks, units): (u64, Units)) -> OwnedPair {
        OwnedPair {
            tasks: Semaphore::new(tasks),
            units: Semaphore::new(units.milli()),
        }
    }

    fn set_capacity(&mut self, tasks: u64, units: Units) {
        self.tasks.capacity = tasks;
        self.units.capacity = units.milli();
    }

    fn used(&self) -> (u64, u64) {
        (self.tasks.used, self.units.used)
    }

    /// Takes one task and `units`, both or neither; on refusal says which (0: tasks, 1: units).
    fn try_take(&mut self, units: u64) -> Result<(), usize> {
        if !self.tasks.try_take(1) {
            return Err(0);
        }
        if !self.units.try_take(units) {
            self.tasks.used -= 1;
            return Err(1);
        }
        Ok(())
    }

    fn release(&mut self, units: u64, keys: [LimitKey; 2]) {
        self.tasks.release(1, || keys[0]);
        self.units.release(units, || keys[1]);
    }

    fn force(&mut self, units: u64) {
        self.tasks.force(1);
        self.units.force(units);
    }

    /// Running pairs never exceed capacity (gates may, through forced re-entry).
    fn check_within(&self, keys: [LimitKey; 2]) {
        assert!(
            self.tasks.used <= self.tasks.capacity,
            "{} above capacity",
            keys[0]
        );
        assert!(
            self.units.used <= self.units.capacity,
            "{} above capacity",
            keys[1]
        );
    }
}

/// Resource classes a tenant may submit, as a bit set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ClassSet(u8);

impl ClassSet {
    fn of(classes: &[ResourceClass]) -> ClassSet {
        ClassSet(classes.iter().fold(0, |bits, &c| bits | ClassSet::bit(c)))
    }

    fn bit(class: ResourceClass) -> u8 {
        match class {
            ResourceClass::Standard => 1,
            ResourceClass::Expensive => 2,
        }
    }

    fn contains(self, class: ResourceClass) -> bool {
        self.0 & ClassSet::bit(class) != 0
    }
}

/// A tenant in this shard. What admission and the pick read sits here, inline — the policy
/// fields they need, the tenant's own limits, its queue in its home lane — so that serving a
/// tenant reads a few adjacent lines found from one address (the full policy stays in
/// `Policy::tenants`, read only when a user is first seen).
///
/// The fields are in cache-line order (`repr(C)`, five lines): an admission reads lines 0–1 and
/// nothing else of the record — line 0 its submit bucket and gates, line 1 the policy flags, the
/// room left in its budget, and the front of its home queue (the tails an append writes behind)
/// — unless it is rejected (the keys name its id, line 2) or opens a band (the heads, lines
/// 1–2). The pick reads lines 1–4 (weight, queue, cost bucket, running limits). A test pins
/// the offsets.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
struct TenantRt {
    // line 0
    submit_rate: SubmitBucket,
    gates: OwnedPair,
    // line 1
    weight: u32,
    /// `TenantPolicy::max_wait_ms`, at most `u32::MAX` (which stands for no bound): see
    /// [`TenantRt::max_wait_ms`].
    max_wait_ms: u32,
    /// Its budget less what its live tasks reserved (`cost_quota_milli` − reserved): negative
    /// when a lowered budget is below what is already reserved.
    cost_room_milli: i64,
    /// `cost_per_minute`'s burst, here for admission (a task costing more can never run).
    cost_burst_milli: u64,
    lane: Lane,
    base_band: Band,
    wait_overflow: WaitOverflow,
    classes: ClassSet,
    /// The lane its standard work went to when it was first seen: its queue there is inline.
    home_lane: Lane,
    /// `TenantPolicy::suspended`: nothing admitted, nothing started.
    suspended: bool,
    /// It has periodic quotas (`quotas.rs`): without, admission never looks them up.
    has_quotas: bool,
    // line 1 from byte 32, into line 2
    home: TenantQueue,
    // line 2
    /// Its queues in every other lane (expensive work, best-effort overflow, a changed lane),
    /// made when first needed.
    away: Option<Box<[TenantQueue; Lane::COUNT]>>,
    id: TenantId,
    /// Its budget (`TenantPolicy::cost_quota_milli`), at most `i64::MAX`.
    cost_quota_milli: i64,
    // line 3
    cost_per_minute: TokenBucket,
    // line 4
    running: OwnLine<OwnedPair>,
}

/// A value that starts a cache line of its own (a tenant's running pair, which only the pick
/// reads, after a cost bucket that leaves a line part empty).
#[derive(Debug, Clone)]
#[repr(align(64))]
struct OwnLine<T>(T);

impl<T> std::ops::Deref for OwnLine<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::DerefMut for OwnLine<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// A tenant's budget as the record keeps it: at most `i64::MAX` milli (more is no bound in
/// practice), so that the room left can go below zero when a budget is lowered.
fn quota_milli(policy: &TenantPolicy) -> i64 {
    i64::try_from(policy.cost_quota_milli).unwrap_or(i64::MAX)
}

impl TenantRt {
    fn new(id: TenantId, policy: &TenantPolicy) -> TenantRt {
        TenantRt {
            submit_rate: SubmitBucket::new(policy.submit_rate, Time::ZERO),
            gates: OwnedPair::new((policy.queued_tasks_max, policy.queued_units_max)),
            weight: policy.weight,
            max_wait_ms: u32::try_from(policy.max_wait_ms).unwrap_or(u32::MAX),
            cost_room_milli: quota_milli(policy),
            cost_burst_milli: policy.cost_per_minute.burst,
            lane: policy.lane,
            base_band: policy.base_band,
            wait_overflow: policy.wait_overflow,
            classes: ClassSet::of(&policy.allowed_classes),
            home_lane: policy.lane,
            suspended: policy.suspended,
            has_quotas: !policy.quotas.is_empty(),
            home: TenantQueue::default(),
            away: None,
            id,
            cost_quota_milli: quota_milli(policy),
            cost_per_minute: TokenBucket::new(policy.cost_per_minute, Time::ZERO),
            running: OwnLine(OwnedPair::new((
                policy.running_tasks_max,
                policy.running_units_max,
            ))),
        }
    }

    fn pair_mut(&mut self, hold: Hold) -> &mut OwnedPair {
        match hold {
            Hold::Queued => &mut self.gates,
            Hold::Running => &mut self.running,
        }
    }

    /// The lane a task of `class` goes to (`TenantPolicy::lane_for`).
    fn lane_for(&self, class: ResourceClass) -> Lane {
        match class {
            ResourceClass::Expensive => Lane::Expensive,
            ResourceClass::Standard => self.lane,
        }
    }

    /// The band a task starts in (`TenantPolicy::band_for`): a hint can only lower it.
    fn band_for(&self, hint: Option<Band>) -> Band {
        hint.map_or(self.base_band, |hint| hint.max(self.base_band))
    }

    /// Applies a changed policy to the hot fields and limits (queues keep their tasks).
    fn set_policy(&mut self, policy: &TenantPolicy, now: Time) {
        self.weight = policy.weight;
        self.lane = policy.lane;
        self.base_band = policy.base_band;
        self.wait_overflow = policy.wait_overflow;
        self.classes = ClassSet::of(&policy.allowed_classes);
        self.suspended = policy.suspended;
        self.has_quotas = !policy.quotas.is_empty();
        self.max_wait_ms = u32::try_from(policy.max_wait_ms).unwrap_or(u32::MAX);
        let reserved = self.cost_reserved_milli();
        self.cost_quota_milli = quota_milli(policy);
        self.cost_room_milli = self.cost_quota_milli - reserved as i64;
        self.submit_rate.set_rate(policy.submit_rate, now);
        self.gates
            .set_capacity(policy.queued_tasks_max, policy.queued_units_max);
        self.running
            .set_capacity(policy.running_tasks_max, policy.running_units_max);
        self.cost_per_minute.set_rate(policy.cost_per_minute, now);
        self.cost_burst_milli = policy.cost_per_minute.burst;
    }

    /// The longest expected wait it accepts; `u64::MAX` for none.
    fn max_wait_ms(&self) -> u64 {
        match self.max_wait_ms {
            u32::MAX => u64::MAX,
            ms => u64::from(ms),
        }
    }

    /// What its live tasks reserved of its budget.
    fn cost_reserved_milli(&self) -> u64 {
        (self.cost_quota_milli - self.cost_room_milli) as u64
    }

    /// `cost_milli` more reserved by its live tasks.
    fn reserve_cost(&mut self, cost_milli: u64) {
        self.cost_room_milli -= cost_milli as i64;
    }

    /// `cost_milli` of what its live tasks reserved given back (a task finished).
    fn release_cost(&mut self, cost_milli: u64) {
        self.cost_room_milli += cost_milli as i64;
    }

    fn queue(&self, lane: Lane) -> Option<&TenantQueue> {
        if lane == self.home_lane {
            return Some(&self.home);
        }
        self.away.as_ref().map(|away| &away[lane.index()])
    }

    fn queue_mut(&mut self, lane: Lane) -> &mut TenantQueue {
        if lane == self.home_lane {
            return &mut self.home;
        }
        &mut self.away.get_or_insert_with(Default::default)[lane.index()]
    }

    /// Every queue the tenant has, with its lane.
    fn queues(&self) -> impl Iterator<Item = (Lane, &TenantQueue)> {
        let away = self.away.iter().flat_map(|away| {
            Lane::ALL
                .into_iter()
                .filter(|&l| l != self.home_lane)
                .map(|l| (l, &away[l.index()]))
        });
        std::iter::once((self.home_lane, &self.home)).chain(away)
    }

    fn keys(&self, hold: Hold) -> [LimitKey; 2] {
        let t = self.id;
        match hold {
            Hold::Queued => [
                LimitKey::TenantQueuedTasks(t),
                LimitKey::TenantQueuedUnits(t),
            ],
            Hold::Running => [
                LimitKey::TenantRunningTasks(t),
                LimitKey::TenantRunningUnits(t),
            ],
        }
    }
}

/// A user in this shard, with its own limits inline, in cache-line order (`repr(C)`, two
/// lines): an admission reads line 0 (submit bucket and gates), the pick line 1 (running pair).
#[derive(Debug, Clone)]
#[repr(C, align(64))]
struct UserRt {
    submit_rate: SubmitBucket,
    gates: OwnedPair,
    running: OwnedPair,
    id: UserId,
    /// The tenant whose user it is: records are keyed by both, so two tenants' users with the
    /// same id never share one.
    tenant: TenantId,
    /// Tasks of this record in the shard's table: it is freed only with none.
    tasks: u32,
    /// False once freed (its slot on the free list, to be reused).
    live: bool,
}

impl UserRt {
    fn pair_mut(&mut self, hold: Hold) -> &mut OwnedPair {
        match hold {
            Hold::Queued => &mut self.gates,
            Hold::Running => &mut self.running,
        }
    }

    fn keys(&self, hold: Hold) -> [LimitKey; 2] {
        let u = self.id;
        match hold {
            Hold::Queued => [LimitKey::UserQueuedTasks(u), LimitKey::UserQueuedUnits(u)],
            Hold::Running => [LimitKey::UserRunningTasks(u), LimitKey::UserRunningUnits(u)],
        }
    }
}

/// Where a task is, besides its state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// In its band list; holds queue gates.
    Band,
    /// Waiting for `eligible_at` in the delay heap; holds nothing.
    Delayed,
    /// Holds the provider-stage reservation.
    Provider,
    /// Waiting in the media queue; holds nothing.
    MediaQueue,
    /// Holds media slots.
    Media,
}

/// No deadline: the largest time.
const NO_DEADLINE: Time = Time(u64::MAX);

/// A task's hot part: everything admission and the pick read or write, in 56 bytes, so that with
/// its id it fills one cache line of the task table.
#[derive(Debug, Clone)]
struct TaskEntry {
    enqueued_at: Time,
    /// `NO_DEADLINE` when it has none.
    deadline: Time,
    tenant_slot: u32,
    user_slot: u32,
    estimate: EstimateRef,
    state: Versioned,
    attempt_no: u32,
    provider: Option<ProviderId>,
    /// How the provider stage holds lane capacity, while it does (the lane key follows from it).
    hold: Option<CapacityMode>,
    lane: Lane,
    band: Band,
    place: Place,
}

/// A task's cold part: what only reports read and write.
#[derive(Debug, Clone, Default)]
struct TaskCold {
    fencing: Option<FencingToken>,
    retries: u32,
    rate_limit_retries: u32,
    /// A resumed attempt that did not fit the capacity it came back to (see
    /// [`Shard::handle_resume`]): its provider stage was taken past the capacity.
    over_capacity: bool,
    /// While it is queued: its lane's `dequeued_milli` plus the units queued ahead of it when
    /// it joined (`LaneRt::dequeued_milli`). Once it started its provider stage: when (ns; 0
    /// for an attempt resumed after a restart, whose start this shard did not see).
    mark: u64,
    /// When (unix seconds) its tenant's quotas were charged for it; 0: not charged.
    quota_at_s: u32,
    /// Its provider billed it: its quota charge is settled, and not given back.
    quota_settled: bool,
}

/// `ahead_milli` units at `rate` milli-units a second, in ms.
fn wait_ms(ahead_milli: u64, rate_milli_per_s: u64) -> u64 {
    (u128::from(ahead_milli) * 1_000 / u128::from(rate_milli_per_s.max(1)))
        .min(u128::from(u64::MAX)) as u64
}

type Tasks = TaskTable<TaskEntry, TaskCold>;

/// The node limits of a task's provider stage, semaphores and buckets apart: the tenant's and
/// user's own limits are taken between the two.
struct StageNeeds {
    semaphores: [Need; 9],
    buckets: [Need; 2],
}

/// The band lists as the queues see them: links and enqueue times in the task table, costs in
/// the interned estimates.
struct Bands<'a, T> {
    tasks: T,
    estimates: &'a Estimates,
}

impl<T: std::ops::Deref<Target = Tasks>> Links for Bands<'_, T> {
    #[inline]
    fn next(&self, slot: u32) -> u32 {
        self.tasks.link(slot)
    }

    fn enqueued_at(&self, slot: u32) -> Time {
        self.tasks.at(slot).enqueued_at
    }

    #[inline]
    fn cost_milli(&self, slot: u32) -> u64 {
        self.estimates
            .get(self.tasks.at(slot).estimate)
            .fairness
            .milli()
    }
}

impl<T: std::ops::DerefMut<Target = Tasks>> LinksMut for Bands<'_, T> {
    #[inline]
    fn set_next(&mut self, slot: u32, next: u32) {
        self.tasks.set_link(slot, next);
    }
}

#[derive(Debug, Clone, Default)]
struct LaneRt {
    ring: VecDeque<u32>,
    backlog_weight: u64,
    queued_tasks: u64,
    queued_units_milli: u64,
    running_tasks: u64,
    swrr_current: i64,
    blocked_streak: usize,
    stalled_until: Option<Time>,
    /// The policy's initial rate, until `started` measures one.
    initial_rate_milli_per_s: u64,
    started: Starts,
    /// How long its provider stages hold their capacity (those that succeed).
    service: ServiceTime,
    /// Units that ever left its queues: a queued task's units ahead of it are its
    /// `TaskCold::ahead_mark` less this (the lane's queues seen as one line).
    dequeued_milli: u64,
    /// DRR rounds begun (wrapping): a round begins when a tenant gets its second quantum since
    /// the last one began (a tenant joining the ring joins the round under way).
    round: u16,
    /// The lane's virtual time: the base quantum times the rounds begun, wrapping. A tenant
    /// backlogged throughout is served its weight times this (within DRR's bound) whatever else
    /// happens in the lane, and a tenant served on arrival out of its burst credit moves it not
    /// at all; so it is what the node-wide split compares shards by ([`crate::share::Lags`]).
    vtime_milli: u64,
    /// Picks refused for want of a node-wide limit's share (wrapping): a shard that was refused
    /// competes for the split's capacity ([`crate::share::ShardLoad::refused`]).
    node_refusals: u64,
}

impl LaneRt {
    /// Its measured service rate (the initial one until it has one), never zero. While work
    /// runs, by Little's law: the tasks running over how long one holds its capacity, times
    /// the units a start takes out of the queue — steady however bunched the starts are (slots
    /// that free together are refilled together). Idle, how fast its last starts drained it.
    fn rate_milli_per_s(&self, now: Time) -> u64 {
        let until = (self.queued_tasks > 0).then_some(now);
        let little = match (self.service.mean_ns(), self.started.mean_units_milli()) {
            (Some(service_ns), Some(units)) if self.running_tasks > 0 => {
                let rate =
                    u128::from(self.running_tasks) * u128::from(units) * u128::from(NANOS_PER_S)
                        / u128::from(service_ns.max(1));
                Some(rate.min(u128::from(u64::MAX)) as u64)
            }
            _ => None,
        };
        little
            .or_else(|| self.started.rate_milli_per_s(until))
            .unwrap_or(self.initial_rate_milli_per_s)
            .max(1)
    }
}

/// A lane's mean service time: how long a provider stage holds its capacity, an average
/// weighted 1/`SERVICE_EWMA_DIV` to the newest.
#[derive(Debug, Clone, Copy, Default)]
struct ServiceTime {
    mean_ns: u64,
    samples: u32,
}

const SERVICE_EWMA_DIV: u64 = 8;

impl ServiceTime {
    fn record(&mut self, ns: u64) {
        self.mean_ns = match self.samples {
            0 => ns,
            _ => self.mean_ns - self.mean_ns / SERVICE_EWMA_DIV + ns / SERVICE_EWMA_DIV,
        };
        self.samples = self.samples.saturating_add(1);
    }

    /// `None` before `RATE_SAMPLES_MIN` samples.
    fn mean_ns(&self) -> Option<u64> {
        (self.samples as usize >= RATE_SAMPLES_MIN).then_some(self.mean_ns)
    }
}

enum TurnResult {
    /// The task in this slot started (its `Dispatch` is built once, by `poll_dispatch`: a
    /// 100-byte answer moved through every level of the turn cost ~80 instructions a pick).
    Dispatched(u32),
    Expired(TaskId),
    OutOfCredit,
    Blocked(Block),
}

/// Why a task could not start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    /// Its tenant's or user's own running limits: the tenant cannot use its turn.
    Tenant,
    /// The lane pool is full: every task of the lane waits, so the tenant keeps its DRR turn and
    /// the lane stalls until capacity returns (the head is never overtaken by other tenants).
    LanePool,
    /// A resource of this task's kind (provider, model, high-cost, cost budget) is exhausted;
    /// other tenants' tasks may not need it.
    Resource,
}

/// Counters a shell exports as metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardStats {
    pub admitted: u64,
    pub rejected: u64,
    pub dispatched: u64,
    pub borrowed_dispatches: u64,
    pub fit_scan_skips: u64,
    pub requeued: u64,
    pub failed: u64,
    pub succeeded: u64,
    pub canceled: u64,
    pub expired: u64,
    /// Tasks put back from PostgreSQL by `handle_restore`.
    pub restored: u64,
    /// Live attempts put back by `handle_resume`.
    pub resumed: u64,
    /// What admitted tasks added to their tenants' periodic quotas (tasks, milli cost: the
    /// estimate, then what billing or the media stage's probe added), and what came back
    /// (refunds of tasks that ended unbilled, bills under the estimate). Counts read back by a
    /// start or a takeover are not in them.
    pub quota_charged: QuotaMoves,
    pub quota_returned: QuotaMoves,
}

/// Tasks and cost moved in periodic quotas ([`ShardStats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuotaMoves {
    pub tasks: u64,
    pub cost_milli: u64,
}

/// One shard of the scheduling core.
#[derive(Debug, Clone)]
pub struct Shard {
    policy: Policy,
    ledger: Ledger,
    node: NodeIds,
    node_limit_ids: Vec<LimitId>,
    /// Shards of the node this one belongs to (node limits are split among them).
    shards: u32,
    /// Rate limits added at run time that have had no rate yet: each starts full, as the
    /// node's buckets do, once its first share comes ([`Shard::set_share`]).
    unstarted_rates: Vec<LimitId>,
    /// Each model's cost calibration, by its id (made as models complete work).
    calibration: Vec<calibration::ModelCalibration>,
    tenants: Vec<TenantRt>,
    /// Each tenant's command rates, by its slot in `tenants`.
    commands: Vec<commands::CommandRates>,
    tenant_slots: RunMap<TenantId, u32>,
    users: Vec<UserRt>,
    user_slots: RunMap<UserKey, u32>,
    /// Slots of freed user records, reused first.
    free_users: Vec<u32>,
    /// User records each tenant holds (bounded by `USERS_PER_TENANT_MAX`).
    users_per_tenant: RunMap<TenantId, u32>,
    /// Where the next sweep for idle user records starts.
    user_sweep: usize,
    tasks: Tasks,
    estimates: Estimates,
    lanes: [LaneRt; Lane::COUNT],
    /// Bit `i` set while lane `i`'s ring holds a tenant: the lane choice walks these bits
    /// instead of every lane.
    ringed: u8,
    delayed: BinaryHeap<Reverse<(Time, TaskId)>>,
    /// Queued tasks' deadlines, soonest first: a task is expired at its deadline wherever it
    /// waits in its queue, and whether or not anything can be dispatched (`expire_due`).
    /// Entries of tasks that left the queue are dropped when they come due, or by a
    /// compaction once they outnumber the shard's tasks (`DEADLINES_SLACK`).
    deadlines: BinaryHeap<Reverse<(Time, TaskId)>>,
    /// Boxed: the media stage's lines are touched per finished provider job, not per pick.
    media: Box<media::MediaQueues>,
    /// Per lane, the most cost its budget can let start at once on this shard
    /// ([`lane_cost_bursts`]): a task costing more is refused, as it could never start.
    lane_cost_burst: [u64; Lane::COUNT],
    stats: ShardStats,
    /// Resumed attempts holding their provider stage past a capacity (until they release it,
    /// new work cannot take what they hold above it, and the capacity checks of
    /// `check_invariants` allow the excess).
    over_capacity: u32,
    /// The unix time (ms) of `Time::ZERO`: quotas count civil periods.
    wall_epoch_ms: u64,
    /// The quotas' counters, each of one tenant (or user, or model) and period (`quotas.rs`).
    /// Hashed with every part of the key mixed in: `RunHasher` keeps only the last integer
    /// written (here the period), and a million users' counters would share a bucket chain.
    quota_usage: crate::hash::IdMap<crate::quota::UsageKey, crate::quota::Usage>,
    /// Per tenant whose counts an operator reset: nothing submitted before this (unix ms)
    /// counts in its quotas.
    quota_floor_ms: RunMap<TenantId, u64>,
}

const _: () = assert!(
    std::mem::size_of::<TaskEntry>() <= 56,
    "a task's hot part and its id fill one cache line"
);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeCapacity {
    Slots(u64),
    Rate(RateSpec),
}

impl NodeCapacity {
    /// What a split moves between shards: slots, or requests per minute.
    pub fn units(self) -> u64 {
        match self {
            NodeCapacity::Slots(v) => v,
            NodeCapacity::Rate(r) => r.per_minute,
        }
    }

    /// The part of this capacity that holds `units` of its `units()` (a rate's burst in
    /// proportion, rounded down: the parts' bursts never add up to more than the whole's — a
    /// holder that needs a request from a part too small for one is given it by the caller,
    /// see [`NodeCapacity::waiting_part`]).
    pub fn part(self, units: u64) -> NodeCapacity {
        match self {
            NodeCapacity::Slots(_) => NodeCapacity::Slots(units),
            NodeCapacity::Rate(r) => NodeCapacity::Rate(RateSpec {
                per_minute: units,
                burst: (u128::from(r.burst) * u128::from(units))
                    .checked_div(u128::from(r.per_minute))
                    .map_or(0, |b| b as u64),
            }),
        }
    }

    /// [`NodeCapacity::part`] for a holder with work waiting: a rate's part whose burst rounds
    /// to nothing still holds one request (a bucket of no burst never holds a token, however
    /// fast it fills, and the holder would wait with its rate unused). Only waiting holders
    /// get it, so the bursts of a whole exceed it by at most one request per waiting holder of
    /// a sliver of it.
    pub fn waiting_part(self, units: u64) -> NodeCapacity {
        match self.part(units) {
            NodeCapacity::Rate(r) if r.per_minute > 0 => NodeCapacity::Rate(RateSpec {
                burst: r.burst.max(1),
                ..r
            }),
            other => other,
        }
    }

    /// Where each shard's part should go: slots by the split rule of [`crate::share`]; rates,
    /// which nobody holds, in proportion to backlogged weight, an idle shard's standby part
    /// first (evenly when nothing waits).
    pub fn split_targets(self, loads: &[ShardLoad]) -> Vec<u64> {
        match self {
            NodeCapacity::Slots(total) => split(total, loads),
            NodeCapacity::Rate(r) => {
                crate::share::targets(u128::from(r.per_minute), loads.iter().map(|l| l.weight))
                    .into_iter()
                    .map(|part| u64::try_from(part).expect("a part of a u64 rate"))
                    .collect()
            }
        }
    }
}

/// The lanes whose backlog a node limit is split by (its weight, and its DRR virtual time):
/// those whose work can use it. `None` for the limits split otherwise — queue gates evenly,
/// media slots and workers by the media jobs waiting.
fn split_lanes_of(key: LimitKey) -> Option<&'static [Lane]> {
    use Lane::*;
    Some(match key {
        LimitKey::LaneQueuedTasks(_)
        | LimitKey::LaneQueuedUnits(_)
        | LimitKey::GlobalQueuedTasks
        | LimitKey::GlobalQueuedUnits
        | LimitKey::GpuUnits
        | LimitKey::GpuMemMb
        | LimitKey::CpuUnits
        | LimitKey::TempDiskMb
        | LimitKey::LaneMediaWorkers(_)
        | LimitKey::SharedMediaWorkers => return None,
        // Best-effort work borrows these lanes' leftovers.
        LimitKey::LaneUnits(PaidShared) | LimitKey::LaneUnits(Standard) => {
            &[PaidShared, Standard, BestEffort]
        }
        LimitKey::LaneUnits(EnterpriseReserved) => &[
            EnterpriseReserved,
            PaidShared,
            Standard,
            BestEffort,
            Expensive,
        ],
        LimitKey::LaneUnits(l) | LimitKey::LaneRunningTasks(l) | LimitKey::LaneCostPerMinute(l) => {
            std::slice::from_ref(&Lane::ALL[l.index()])
        }
        LimitKey::EnterpriseBorrowed => &[PaidShared, Standard, Expensive],
        _ => &Lane::ALL,
    })
}

/// The node-wide capacity `policy` gives `key`; `None` for shard-scoped keys.
pub fn node_capacity(policy: &Policy, key: LimitKey) -> Option<NodeCapacity> {
    let n = &policy.node;
    let slots = |v: u64| Some(NodeCapacity::Slots(v));
    match key {
        LimitKey::LaneQueuedTasks(l) => slots(policy.lane(l).queued_tasks_max),
        LimitKey::LaneQueuedUnits(l) => slots(policy.lane(l).queued_units_max.milli()),
        LimitKey::GlobalQueuedTasks => slots(n.global_queued_tasks_max),
        LimitKey::GlobalQueuedUnits => slots(n.global_queued_units_max.milli()),
        LimitKey::LaneUnits(l) => slots(policy.lane(l).capacity.milli()),
        LimitKey::EnterpriseBorrowed => slots(policy.reserve.borrow_limit.milli()),
        LimitKey::ModelRunning(_) => slots(n.model_running_max),
        LimitKey::LaneRunningTasks(l) => slots(policy.lane(l).running_tasks_max),
        LimitKey::ModelRunningUnits(_) => slots(n.model_running_units_max.milli()),
        LimitKey::GlobalRunningTasks => slots(n.global_running_tasks_max),
        LimitKey::GlobalRunningUnits => slots(n.global_running_units_max.milli()),
        LimitKey::ProviderConcurrency(p) => slots(policy.providers[p.0 as usize].concurrency),
        LimitKey::ProviderRpm(p) => Some(NodeCapacity::Rate(policy.providers[p.0 as usize].rpm)),
        LimitKey::HighCostConcurrency => slots(n.high_cost_concurrency),
        LimitKey::PlatformCostPerMinute => {
            Some(NodeCapacity::Rate(policy.shared_cost_per_minute()))
        }
        LimitKey::GpuUnits => slots(n.gpu_units),
        LimitKey::GpuMemMb => slots(n.gpu_mem_mb),
        LimitKey::CpuUnits => slots(n.cpu_units),
        LimitKey::TempDiskMb => slots(n.temp_disk_mb),
        // Registered only for a lane with its own (a live change cannot take it away).
        LimitKey::LaneCostPerMinute(l) => policy.lane(l).cost_per_minute.map(NodeCapacity::Rate),
        LimitKey::LaneMediaWorkers(l) => policy.lane(l).media_workers.map(NodeCapacity::Slots),
        LimitKey::SharedMediaWorkers => slots(policy.shared_media_workers()),
        _ => None,
    }
}

impl Shard {
    /// Registers a node limit a policy change added at run time (a new provider account's or
    /// model's) after every existing one, so that the shell's split keeps its places. A shard of
    /// several starts it with no share (the split hands parts out of the node's capacity, which
    /// no shard holds yet); a lone shard with all of it.
    pub(super) fn add_node_limit(&mut self, key: LimitKey, now: Time) -> LimitId {
        let capacity = node_capacity(&self.policy, key).expect("a node-wide key");
        let share = if self.shards == 1 {
            capacity
        } else {
            capacity.part(0)
        };
        let id = add_share(&mut self.ledger, key, share, now);
        if matches!(share, NodeCapacity::Rate(r) if r.per_minute == 0) {
            self.unstarted_rates.push(id);
        }
        self.node_limit_ids.push(id);
        id
    }

    /// A provider account added at run time: its concurrency and RPM limits.
    pub(super) fn add_provider_limits(&mut self, provider: ProviderId, now: Time) {
        let c = self.add_node_limit(LimitKey::ProviderConcurrency(provider), now);
        let r = self.add_node_limit(LimitKey::ProviderRpm(provider), now);
        self.node.provider_concurrency.push(c);
        self.node.provider_rpm.push(r);
    }

    /// A model added at run time: its running task and unit limits.
    pub(super) fn add_model_limits(&mut self, model: crate::ModelId, now: Time) {
        let t = self.add_node_limit(LimitKey::ModelRunning(model), now);
        let u = self.add_node_limit(LimitKey::ModelRunningUnits(model), now);
        self.node.model_running.push(t);
        self.node.model_running_units.push(u);
    }
}

/// Per lane, the most cost its budget (its own, or the platform's rest) can let start at once
/// on one shard of `shards`: the burst less what the split keeps for the other shards while
/// they are idle (`share::STANDBY_DIV`).
fn lane_cost_bursts(policy: &Policy, shards: u32) -> [u64; Lane::COUNT] {
    let shared = policy.shared_cost_per_minute();
    let n = u64::from(shards.max(1));
    Lane::ALL.map(|l| {
        let burst = policy.lane(l).cost_per_minute.unwrap_or(shared).burst;
        let standby = burst.div_ceil(n * crate::share::STANDBY_DIV);
        burst.saturating_sub(standby * (n - 1))
    })
}

/// The key of a tenant's user in the shard's user index: both ids (8 bytes, so an entry stays
/// 12), hashed as one integer, one-to-one — the tenant's id in the low half, the user's xor the
/// tenant's in the high one. A pair hashed field by field by `RunHasher` would hash as its user
/// id alone, and every tenant's user 1 would share one bucket chain; this way one user id of
/// many tenants is scattered over the table, and a user numbered as its tenant (one-user
/// tenants) keys as the tenant, in the runs of tenants the hasher keeps together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct UserKey {
    tenant: TenantId,
    user: UserId,
}

impl std::hash::Hash for UserKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(u64::from(self.tenant.0) | (u64::from(self.user.0 ^ self.tenant.0) << 32));
    }
}

fn user_key(tenant: TenantId, user: UserId) -> UserKey {
    UserKey { tenant, user }
}

/// Registers node limit `key` in `ledger` with `1/shards` of its capacity (the share before the
/// first split; a single-queue scheduler passes 1).
pub fn register_node_limit(
    ledger: &mut Ledger,
    policy: &Policy,
    key: LimitKey,
    shards: u32,
    now: Time,
) -> LimitId {
    let capacity = node_capacity(policy, key).expect("a node-wide key");
    add_share(ledger, key, even_share(capacity, shards), now)
}

/// Registers node limit `key` in `ledger` holding `share`: a semaphore for slots, a bucket for
/// a rate.
fn add_share(ledger: &mut Ledger, key: LimitKey, share: NodeCapacity, now: Time) -> LimitId {
    match share {
        NodeCapacity::Slots(v) => ledger.add_semaphore(key, v),
        NodeCapacity::Rate(r) => ledger.add_bucket(key, r, now),
    }
}

/// `1/shards` of a node capacity: the starting share before the first split.
fn even_share(capacity: NodeCapacity, shards: u32) -> NodeCapacity {
    let shards = u64::from(shards.max(1));
    match capacity {
        NodeCapacity::Slots(v) => NodeCapacity::Slots(v / shards),
        NodeCapacity::Rate(r) => NodeCapacity::Rate(RateSpec {
            per_minute: r.per_minute / shards,
            burst: r.burst / shards,
        }),
    }
}

impl Shard {
    /// A shard of a node with `shards` shards, starting with an even share of node-wide limits.
    /// `policy` must have passed [`Policy::validate`].
    pub fn new(policy: Policy, shards: u32, now: Time) -> Shard {
        policy
            .validate()
            .expect("the shell validates the policy before building shards");
        let mut ledger = Ledger::new();
        let add = |ledger: &mut Ledger, key: LimitKey| {
            register_node_limit(ledger, &policy, key, shards, now)
        };
        let lanes =
            |ledger: &mut Ledger, f: fn(Lane) -> LimitKey| Lane::ALL.map(|l| add(ledger, f(l)));
        let lane_queued_tasks = lanes(&mut ledger, LimitKey::LaneQueuedTasks);
        let lane_queued_units = lanes(&mut ledger, LimitKey::LaneQueuedUnits);
        let global_queued_tasks = add(&mut ledger, LimitKey::GlobalQueuedTasks);
        let global_queued_units = add(&mut ledger, LimitKey::GlobalQueuedUnits);
        let lane_units = lanes(&mut ledger, LimitKey::LaneUnits);
        let enterprise_borrowed = add(&mut ledger, LimitKey::EnterpriseBorrowed);
        let lane_running_tasks = lanes(&mut ledger, LimitKey::LaneRunningTasks);
        let model_running = policy
            .models
            .iter()
            .map(|m| add(&mut ledger, LimitKey::ModelRunning(m.id)))
            .collect();
        let model_running_units = policy
            .models
            .iter()
            .map(|m| add(&mut ledger, LimitKey::ModelRunningUnits(m.id)))
            .collect();
        let provider_concurrency = policy
            .providers
            .iter()
            .map(|p| add(&mut ledger, LimitKey::ProviderConcurrency(p.id)))
            .collect();
        let provider_rpm = policy
            .providers
            .iter()
            .map(|p| add(&mut ledger, LimitKey::ProviderRpm(p.id)))
            .collect();
        let platform_cost = add(&mut ledger, LimitKey::PlatformCostPerMinute);
        let gpu_units = add(&mut ledger, LimitKey::GpuUnits);
        let gpu_mem_mb = add(&mut ledger, LimitKey::GpuMemMb);
        let cpu_units = add(&mut ledger, LimitKey::CpuUnits);
        let temp_disk_mb = add(&mut ledger, LimitKey::TempDiskMb);
        // A lane's own budget and media workers, after every other node limit: the media
        // demand adds its pool last, in id order.
        let cost_bucket = Lane::ALL.map(|l| match policy.lane(l).cost_per_minute {
            Some(_) => add(&mut ledger, LimitKey::LaneCostPerMinute(l)),
            None => platform_cost,
        });
        let shared_media = add(&mut ledger, LimitKey::SharedMediaWorkers);
        let media_pool = Lane::ALL.map(|l| match policy.lane(l).media_workers {
            Some(_) => add(&mut ledger, LimitKey::LaneMediaWorkers(l)),
            None => shared_media,
        });
        let node = NodeIds {
            lane_queued_tasks,
            lane_queued_units,
            global_queued_tasks,
            global_queued_units,
            lane_units,
            enterprise_borrowed,
            lane_running_tasks,
            model_running,
            model_running_units,
            provider_concurrency,
            provider_rpm,
            high_cost: add(&mut ledger, LimitKey::HighCostConcurrency),
            global_running_tasks: add(&mut ledger, LimitKey::GlobalRunningTasks),
            global_running_units: add(&mut ledger, LimitKey::GlobalRunningUnits),
            gpu_units,
            gpu_mem_mb,
            cpu_units,
            temp_disk_mb,
            cost_bucket,
            media_pool,
        };
        let node_limit_ids = ledger.ids().map(|(id, _)| id).collect();
        let lane_cost_burst = lane_cost_bursts(&policy, shards);
        let mut lanes: [LaneRt; Lane::COUNT] = Default::default();
        for lane in Lane::ALL {
            let rt = &mut lanes[lane.index()];
            rt.initial_rate_milli_per_s = policy.lane(lane).initial_rate_milli_per_s;
        }
        Shard {
            policy,
            ledger,
            node,
            node_limit_ids,
            shards,
            unstarted_rates: Vec::new(),
            calibration: Vec::new(),
            tenants: Vec::new(),
            commands: Vec::new(),
            tenant_slots: RunMap::default(),
            users: Vec::new(),
            user_slots: RunMap::default(),
            free_users: Vec::new(),
            users_per_tenant: RunMap::default(),
            user_sweep: 0,
            tasks: Tasks::default(),
            estimates: Estimates::default(),
            lanes,
            ringed: 0,
            delayed: BinaryHeap::new(),
            deadlines: BinaryHeap::new(),
            media: Default::default(),
            lane_cost_burst,
            stats: ShardStats::default(),
            over_capacity: 0,
            wall_epoch_ms: 0,
            quota_usage: Default::default(),
            quota_floor_ms: RunMap::default(),
        }
    }

    // ---------------------------------------------------------------- getters

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The node-wide limits this shard holds a share of (tenants' and users' own limits live in
    /// their records).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn stats(&self) -> &ShardStats {
        &self.stats
    }

    /// Entries of the deadline index, stale ones included (bounded: `watch_deadline`).
    pub fn deadline_entries(&self) -> usize {
        self.deadlines.len()
    }

    pub fn task_count(&self) -> usize {
        self.tasks.len()
    }

    pub fn task_state(&self, task: TaskId) -> Option<TaskState> {
        self.tasks.get(&task).map(|e| e.state.state)
    }

    /// Attempts a task has had so far, the current one included (0 while it waits for its
    /// first).
    pub fn task_attempt_no(&self, task: TaskId) -> Option<u32> {
        self.tasks.get(&task).map(|e| e.attempt_no)
    }

    /// The provider a dispatched task's attempt goes to.
    pub fn task_provider(&self, task: TaskId) -> Option<ProviderId> {
        self.tasks.get(&task).and_then(|e| e.provider)
    }

    /// The lane the task was admitted to (or put back in).
    pub fn task_lane(&self, task: TaskId) -> Option<Lane> {
        self.tasks.get(&task).map(|e| e.lane)
    }

    pub fn queued_tasks(&self, lane: Lane) -> u64 {
        self.lanes[lane.index()].queued_tasks
    }

    pub fn queued_units(&self, lane: Lane) -> Units {
        Units(self.lanes[lane.index()].queued_units_milli)
    }

    /// Summed weight of tenants with queued work in `lane`.
    pub fn backlog_weight(&self, lane: Lane) -> u64 {
        self.lanes[lane.index()].backlog_weight
    }

    /// Queued tasks of one tenant in one lane (0 for an unknown tenant).
    pub fn tenant_queued(&self, tenant: TenantId, lane: Lane) -> u64 {
        self.tenant_slots
            .get(&tenant)
            .and_then(|&s| self.tenants[s as usize].queue(lane))
            .map_or(0, |q| q.tasks())
    }

    /// The fairness debt DRR still has to settle with one tenant in one lane (milli-units;
    /// positive: its runs took more than their estimates; 0 for an unknown tenant). Each run's
    /// correction adds to it, and each quantum pays at most one quantum of it.
    pub fn fairness_debt(&self, tenant: TenantId, lane: Lane) -> i64 {
        self.tenant_slots
            .get(&tenant)
            .and_then(|&s| self.tenants[s as usize].queue(lane))
            .map_or(0, |q| q.debt)
    }

    /// Measured service rate of a lane at `now`, milli-units per second.
    pub fn service_rate_milli_per_s(&self, lane: Lane, now: Time) -> u64 {
        self.lanes[lane.index()].rate_milli_per_s(now)
    }

    /// How long queued `task` is expected to wait from `now` before it starts: the units
    /// queued ahead of it in its lane over the lane's measured service rate. `None` for a task
    /// not in a queue (unknown, backing off, or past its queue).
    pub fn expected_wait_ms(&self, task: TaskId, now: Time) -> Option<u64> {
        let slot = self.tasks.slot(task)?;
        let e = self.tasks.at(slot);
        if e.place != Place::Band {
            return None;
        }
        let rt = &self.lanes[e.lane.index()];
        let ahead = self.tasks.cold(slot).mark.saturating_sub(rt.dequeued_milli);
        Some(wait_ms(ahead, rt.rate_milli_per_s(now)))
    }

    /// The node-wide limits worth splitting, with their full capacity: those that can bind
    /// (a limit set beyond half of `presets::UNBOUNDED` keeps its first even split, since no
    /// share of it can run out).
    pub fn bounded_node_limits(&self) -> Vec<(LimitId, NodeCapacity)> {
        const UNBOUNDED: u64 = crate::presets::UNBOUNDED / 2;
        self.node_limits()
            .into_iter()
            .filter(|(_, capacity)| capacity.units() < UNBOUNDED)
            .collect()
    }

    /// Every node-wide limit with the capacity the current policy gives it (a node whose policy
    /// may change at run time splits them all: an unbounded one may become bounded).
    pub fn node_limits(&self) -> Vec<(LimitId, NodeCapacity)> {
        self.node_limit_ids
            .iter()
            .filter_map(|&id| Some((id, node_capacity(&self.policy, self.ledger.key(id))?)))
            .collect()
    }

    /// What this shard brings to the split of node limit `id`.
    pub fn split_load(&self, id: LimitId) -> ShardLoad {
        ShardLoad {
            used: self.ledger.used(id),
            weight: self.split_weight(id),
            share: self.ledger.capacity(id),
            vtime: self.split_lanes(id, |rt| rt.vtime_milli),
            // A pick is refused by the first node limit in a fixed order, which need not be the
            // one it would have waited longest for: any refusal counts for every split.
            refused: self.split_lanes(id, |rt| rt.node_refusals),
        }
    }

    /// `of` summed (wrapping) over the lanes node limit `id` is split by ([`split_lanes_of`]);
    /// zero for a limit split otherwise.
    fn split_lanes(&self, id: LimitId, of: impl Fn(&LaneRt) -> u64) -> u64 {
        split_lanes_of(self.ledger.key(id)).map_or(0, |lanes| {
            lanes
                .iter()
                .fold(0u64, |sum, l| sum.wrapping_add(of(&self.lanes[l.index()])))
        })
    }

    /// The weight this shard brings to the split of node limit `id`: the summed weight of its
    /// backlogged tenants that could use it (media slots: its waiting media jobs). Queue gates
    /// split evenly.
    pub fn split_weight(&self, id: LimitId) -> u64 {
        let key = self.ledger.key(id);
        match key {
            LimitKey::LaneQueuedTasks(_)
            | LimitKey::LaneQueuedUnits(_)
            | LimitKey::GlobalQueuedTasks
            | LimitKey::GlobalQueuedUnits => 1,
            // The media stage's slots are wanted by the tasks whose provider stage is done, not
            // by the lanes' backlog: a shard with only media waiters must not split to nothing.
            LimitKey::GpuUnits | LimitKey::GpuMemMb | LimitKey::CpuUnits | LimitKey::TempDiskMb => {
                self.media.len() as u64
            }
            LimitKey::LaneMediaWorkers(l) => self.media.lane_len(l) as u64,
            LimitKey::SharedMediaWorkers => Lane::ALL
                .iter()
                .filter(|l| self.node.media_pool[l.index()] == id)
                .map(|&l| self.media.lane_len(l) as u64)
                .sum(),
            _ => self.split_lanes(id, |rt| rt.backlog_weight),
        }
    }

    /// Sets this shard's share of node limit `id` and wakes stalled lanes.
    pub fn set_share(&mut self, id: LimitId, share: NodeCapacity, now: Time) {
        assert_eq!(
            self.ledger.key(id).scope(),
            Scope::Node,
            "only node limits are split"
        );
        let grew = match share {
            NodeCapacity::Slots(v) => {
                let grew = v > self.ledger.capacity(id);
                self.ledger.set_capacity(id, v);
                grew
            }
            NodeCapacity::Rate(r) => {
                let before = self.ledger.rate(id).expect("a rate share for a bucket");
                self.ledger.set_rate(id, r, now);
                if r.per_minute > 0 {
                    if let Some(i) = self.unstarted_rates.iter().position(|&u| u == id) {
                        self.unstarted_rates.swap_remove(i);
                        self.ledger.fill(id, now);
                    }
                }
                r.per_minute > before.per_minute || r.burst > before.burst
            }
        };
        // Only more capacity can unblock a stalled lane.
        if grew {
            self.unstall_all();
        }
    }

    /// The earliest time at which `poll_dispatch` may have something new without any input.
    pub fn poll_timeout(&self) -> Option<Time> {
        let delayed = self.delayed.peek().map(|Reverse((t, _))| *t);
        let stalled = self.lanes.iter().filter_map(|l| l.stalled_until).min();
        match (delayed, stalled) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum End {
    Back,
    Front,
}

mod admission;
mod calibration;
mod commands;
pub use commands::{Command, CommandLimited};
pub use quotas::{QuotaReport, QUOTA_USAGE_MAX};
mod dispatch;
mod invariants;
mod limits;
mod media;
mod queues;
mod quotas;
mod reports;

#[cfg(test)]
mod tests;
