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
    TENANT_VISITS_PER_POLL_MAX, USERS_MAX,
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
/// Service-rate measurement: completions are summed per bucket, then folded into an EWMA.
const RATE_BUCKET_NS: u64 = 5 * NANOS_PER_S;
/// EWMA weight of the newest bucket, as 1/RATE_EWMA_DIV.
const RATE_EWMA_DIV: u64 = 4;

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
    platform_cost: LimitId,
    gpu_units: LimitId,
    gpu_mem_mb: LimitId,
    cpu_units: LimitId,
    temp_disk_mb: LimitId,
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
    rate_milli_per_s: u64,
    rate_bucket_start: Time,
    rate_bucket_milli: u64,
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
}

/// One shard of the scheduling core.
#[derive(Debug, Clone)]
pub struct Shard {
    policy: Policy,
    ledger: Ledger,
    node: NodeIds,
    node_limit_ids: Vec<LimitId>,
    tenants: Vec<TenantRt>,
    tenant_slots: RunMap<TenantId, u32>,
    users: Vec<UserRt>,
    user_slots: RunMap<UserId, u32>,
    tasks: Tasks,
    estimates: Estimates,
    lanes: [LaneRt; Lane::COUNT],
    delayed: BinaryHeap<Reverse<(Time, TaskId)>>,
    media_queue: VecDeque<TaskId>,
    media_head_skips: u32,
    stats: ShardStats,
    /// Resumed attempts holding their provider stage past a capacity (until they release it,
    /// new work cannot take what they hold above it, and the capacity checks of
    /// `check_invariants` allow the excess).
    over_capacity: u32,
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
    /// proportion).
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

    /// Where each shard's part should go: slots by the split rule of [`crate::share`]; rates,
    /// which nobody holds, in proportion to backlogged weight (evenly when nothing waits).
    pub fn split_targets(self, loads: &[ShardLoad]) -> Vec<u64> {
        match self {
            NodeCapacity::Slots(total) => split(total, loads),
            NodeCapacity::Rate(r) => {
                let weights: u64 = loads.iter().map(|l| l.weight).sum();
                let n = loads.len() as u64;
                loads
                    .iter()
                    .map(|l| {
                        let (w, total) = if weights == 0 {
                            (1, n)
                        } else {
                            (l.weight, weights)
                        };
                        (u128::from(r.per_minute) * u128::from(w) / u128::from(total)) as u64
                    })
                    .collect()
            }
        }
    }
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
        LimitKey::PlatformCostPerMinute => Some(NodeCapacity::Rate(n.platform_cost_per_minute)),
        LimitKey::GpuUnits => slots(n.gpu_units),
        LimitKey::GpuMemMb => slots(n.gpu_mem_mb),
        LimitKey::CpuUnits => slots(n.cpu_units),
        LimitKey::TempDiskMb => slots(n.temp_disk_mb),
        _ => None,
    }
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
    match even_share(capacity, shards) {
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
            platform_cost: add(&mut ledger, LimitKey::PlatformCostPerMinute),
            gpu_units: add(&mut ledger, LimitKey::GpuUnits),
            gpu_mem_mb: add(&mut ledger, LimitKey::GpuMemMb),
            cpu_units: add(&mut ledger, LimitKey::CpuUnits),
            temp_disk_mb: add(&mut ledger, LimitKey::TempDiskMb),
        };
        let node_limit_ids = ledger.ids().map(|(id, _)| id).collect();
        let mut lanes: [LaneRt; Lane::COUNT] = Default::default();
        for lane in Lane::ALL {
            let rt = &mut lanes[lane.index()];
            rt.rate_milli_per_s = policy.lane(lane).initial_rate_milli_per_s;
            rt.rate_bucket_start = now;
        }
        Shard {
            policy,
            ledger,
            node,
            node_limit_ids,
            tenants: Vec::new(),
            tenant_slots: RunMap::default(),
            users: Vec::new(),
            user_slots: RunMap::default(),
            tasks: Tasks::default(),
            estimates: Estimates::default(),
            lanes,
            delayed: BinaryHeap::new(),
            media_queue: VecDeque::new(),
            media_head_skips: 0,
            stats: ShardStats::default(),
            over_capacity: 0,
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

    pub fn task_count(&self) -> usize {
        self.tasks.len()
    }

    pub fn task_state(&self, task: TaskId) -> Option<TaskState> {
        self.tasks.get(&task).map(|e| e.state.state)
    }

    /// The provider a dispatched task's attempt goes to.
    pub fn task_provider(&self, task: TaskId) -> Option<ProviderId> {
        self.tasks.get(&task).and_then(|e| e.provider)
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

    /// Measured service rate of a lane, milli-units per second.
    pub fn service_rate_milli_per_s(&self, lane: Lane) -> u64 {
        self.lanes[lane.index()].rate_milli_per_s
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
        }
    }

    /// The weight this shard brings to the split of node limit `id`: the summed weight of its
    /// backlogged tenants that could use it (media slots: its waiting media jobs). Queue gates
    /// split evenly.
    pub fn split_weight(&self, id: LimitId) -> u64 {
        let lane_w = |l: Lane| self.lanes[l.index()].backlog_weight;
        match self.ledger.key(id) {
            LimitKey::LaneQueuedTasks(_)
            | LimitKey::LaneQueuedUnits(_)
            | LimitKey::GlobalQueuedTasks
            | LimitKey::GlobalQueuedUnits => 1,
            LimitKey::LaneUnits(Lane::PaidShared) | LimitKey::LaneUnits(Lane::Standard) => {
                // Best-effort work borrows these lanes' leftovers.
                lane_w(Lane::PaidShared) + lane_w(Lane::Standard) + lane_w(Lane::BestEffort)
            }
            LimitKey::LaneUnits(Lane::EnterpriseReserved) => Lane::ALL
                .iter()
                .filter(|&&l| l != Lane::Recovery)
                .map(|&l| lane_w(l))
                .sum(),
            LimitKey::LaneUnits(l) | LimitKey::LaneRunningTasks(l) => lane_w(l),
            LimitKey::EnterpriseBorrowed => {
                lane_w(Lane::PaidShared) + lane_w(Lane::Standard) + lane_w(Lane::Expensive)
            }
            // The media stage's slots are wanted by the tasks whose provider stage is done, not
            // by the lanes' backlog: a shard with only media waiters must not split to nothing.
            LimitKey::GpuUnits | LimitKey::GpuMemMb | LimitKey::CpuUnits | LimitKey::TempDiskMb => {
                self.media_queue.len() as u64
            }
            _ => Lane::ALL.iter().map(|&l| lane_w(l)).sum(),
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

    // ---------------------------------------------------------------- admission

    /// The server's price of a spec, from the model's capability row, interned with one more
    /// holder: every path that does not keep the task releases it.
    fn intern(&mut self, spec: &TaskSpec) -> Result<EstimateRef, SubmitError> {
        let model =
            self.policy
                .models
                .get(spec.model.0 as usize)
                .ok_or(SubmitError::InvalidSpec(
                    crate::cost::CostError::UnknownModel(spec.model),
                ))?;
        let bases = &self.policy.cost_bases;
        self.estimates
            .acquire(spec, || estimate(spec, model, bases))
            .map_err(SubmitError::InvalidSpec)
    }

    /// Decides on a submit. `Ok` carries every decision, accept or reject; `Err` is a request the
    /// core cannot decide on.
    pub fn handle_submit(
        &mut self,
        now: Time,
        req: SubmitRequest,
    ) -> Result<Admission, SubmitError> {
        let slot = self.ensure_tenant(req.tenant)?;
        let estimate = self.intern(&req.spec)?;
        if self.tasks.contains_key(&req.task) {
            self.estimates.release(estimate);
            return Err(SubmitError::DuplicateTask(req.task));
        }
        match self.admit(now, &req, slot, estimate) {
            Ok(accepted) => {
                self.stats.admitted += 1;
                Ok(accepted)
            }
            Err(rejected) => {
                self.estimates.release(estimate);
                self.stats.rejected += 1;
                Ok(rejected)
            }
        }
    }

    /// Admission proper: every check in order, then the queue. `Err` is the rejection.
    fn admit(
        &mut self,
        now: Time,
        req: &SubmitRequest,
        slot: u32,
        estimate: EstimateRef,
    ) -> Result<Admission, Admission> {
        let est = *self.estimates.get(estimate);
        let tenant = &self.tenants[slot as usize];
        let band = tenant.band_for(req.band_hint);
        let mut lane = tenant.lane_for(est.class);
        let reject = |decision, reason, lane| Admission {
            task: req.task,
            decision,
            reason: Some(reason),
            lane,
            band,
            estimate: est,
            estimated_start_at: None,
            queue_level: None,
        };
        if self.tasks.len() >= TASKS_MAX || self.users.len() >= USERS_MAX {
            let reason = RejectReason::ShardFull;
            return Err(reject(Decision::RejectPlatformOverloaded, reason, lane));
        }
        if !tenant.classes.contains(est.class) {
            let reason = RejectReason::ClassNotAllowed(est.class);
            return Err(reject(Decision::RejectResourceClassDisabled, reason, lane));
        }
        if !self.policy.lane(lane).open {
            let reason = RejectReason::LaneClosed(lane);
            return Err(reject(Decision::RejectResourceClassDisabled, reason, lane));
        }
        let user_slot = self.ensure_user(req.user, slot);
        // Rate buckets first: a flood of requests spends tokens even when rejected later.
        if let Err(key) = self.take_submit_tokens(slot, user_slot, now) {
            let reason = RejectReason::Limit(key);
            return Err(reject(Decision::RejectUserRateLimit, reason, lane));
        }
        let tenant = &self.tenants[slot as usize];
        let remaining = tenant.cost_room_milli.max(0) as u64;
        if est.cost_milli > remaining || est.cost_milli > tenant.cost_burst_milli {
            let reason = RejectReason::CostQuota {
                needed_milli: est.cost_milli,
                remaining_milli: remaining,
            };
            return Err(reject(Decision::RejectCostBudget, reason, lane));
        }
        let (max_wait_ms, overflow) = (tenant.max_wait_ms(), tenant.wait_overflow);
        let mut wait_ms = self.expected_wait_ms(lane, now);
        if wait_ms > max_wait_ms {
            let overflow_to_be = overflow == WaitOverflow::BestEffort
                && self.policy.lane(Lane::BestEffort).open
                && lane != Lane::BestEffort;
            if !overflow_to_be {
                let reason = RejectReason::ExpectedWait {
                    wait_ms,
                    max_ms: max_wait_ms,
                };
                return Err(reject(Decision::RejectExpectedWaitTooLong, reason, lane));
            }
            lane = Lane::BestEffort;
            wait_ms = self.expected_wait_ms(lane, now);
        }
        let mut entry = TaskEntry {
            enqueued_at: now,
            deadline: req.deadline.unwrap_or(NO_DEADLINE),
            tenant_slot: slot,
            user_slot,
            estimate,
            state: Versioned::new(TaskState::Created),
            attempt_no: 0,
            provider: None,
            hold: None,
            lane,
            band,
            place: Place::Band,
        };
        if let Err(key) = self.take_gates(&entry) {
            let decision = match key.scope() {
                Scope::Shard => Decision::RejectTenantQueueFull,
                Scope::Node => Decision::RejectPlatformOverloaded,
            };
            return Err(reject(decision, RejectReason::Limit(key), lane));
        }
        entry
            .state
            .transition(TaskState::Queued, Actor::System)
            .expect("CREATED → QUEUED");
        self.tenants[slot as usize].reserve_cost(est.cost_milli);
        let entry = self.tasks.insert(req.task, entry, TaskCold::default());
        self.enqueue(slot, lane, band, entry, End::Back);
        let decision = if lane == Lane::BestEffort {
            Decision::AcceptedBestEffort
        } else {
            Decision::Accepted
        };
        Ok(Admission {
            task: req.task,
            decision,
            reason: None,
            lane,
            band,
            estimate: est,
            estimated_start_at: Some(now.plus_ns(wait_ms * NANOS_PER_MS)),
            queue_level: Some(QueueLevel::from_wait_ms(wait_ms)),
        })
    }

    /// One submit token from the tenant's and then the user's bucket, both or neither.
    fn take_submit_tokens(
        &mut self,
        tenant_slot: u32,
        user_slot: u32,
        now: Time,
    ) -> Result<(), LimitKey> {
        let tenant = &mut self.tenants[tenant_slot as usize];
        if !tenant.submit_rate.try_take_one(now) {
            return Err(LimitKey::TenantSubmitRate(tenant.id));
        }
        let user = &mut self.users[user_slot as usize];
        if !user.submit_rate.try_take_one(now) {
            let key = LimitKey::UserSubmitRate(user.id);
            tenant.submit_rate.refund_one();
            return Err(key);
        }
        Ok(())
    }

    /// What a task put back from PostgreSQL needs first: its tenant's and user's slots and its
    /// interned estimate; refused for a task the shard already has, or one whose `attempts`
    /// (those it had, and the one it may be about to have) pass `ATTEMPTS_MAX`.
    fn take_back(
        &mut self,
        req: &SubmitRequest,
        attempts: u32,
    ) -> Result<(u32, u32, EstimateRef), SubmitError> {
        if attempts > ATTEMPTS_MAX {
            return Err(SubmitError::AttemptsExhausted(req.task, attempts));
        }
        let slot = self.ensure_tenant(req.tenant)?;
        let estimate = self.intern(&req.spec)?;
        if self.tasks.contains_key(&req.task) {
            self.estimates.release(estimate);
            return Err(SubmitError::DuplicateTask(req.task));
        }
        Ok((slot, self.ensure_user(req.user, slot), estimate))
    }

    /// Puts back a task that PostgreSQL holds as QUEUED (after a restart or a partition
    /// takeover). It was admitted before, so no admission check can refuse it now: its queue
    /// gates are taken by force, like a retry's. Its lane and band are the stored ones.
    pub fn handle_restore(
        &mut self,
        now: Time,
        restore: RestoreRequest,
    ) -> Result<(), SubmitError> {
        let req = restore.submit;
        let (slot, user_slot, estimate) =
            self.take_back(&req, restore.attempts_before.saturating_add(1))?;
        let mut state = Versioned::new(TaskState::Created);
        state
            .transition(TaskState::Queued, Actor::System)
            .expect("CREATED → QUEUED");
        let entry = TaskEntry {
            enqueued_at: now,
            deadline: req.deadline.unwrap_or(NO_DEADLINE),
            tenant_slot: slot,
            user_slot,
            estimate,
            state,
            attempt_no: restore.attempts_before,
            provider: None,
            hold: None,
            lane: restore.lane,
            band: restore.band,
            place: Place::Band,
        };
        self.force_gates(&entry);
        let cost = self.estimates.get(estimate).cost_milli;
        self.tenants[slot as usize].reserve_cost(cost);
        let entry_slot = self.tasks.insert(req.task, entry, TaskCold::default());
        self.enqueue(slot, restore.lane, restore.band, entry_slot, End::Back);
        self.stats.restored += 1;
        Ok(())
    }

    /// Puts back a live attempt (after a restart or a partition takeover): its provider stage
    /// is held again, as it was when the attempt was claimed, and its fencing token is the
    /// stored one, so the shell can follow the provider's job instead of submitting it anew.
    ///
    /// Its semaphores and running limits are taken like a dispatch's when they fit. They may
    /// not: the shard's part of a node limit can be smaller now than what the resumed work of
    /// its tenants holds (the parts are re-split as the shards publish their use), or the
    /// policy lowered a limit. The job runs at the provider regardless, and PostgreSQL counted
    /// it within the node-wide limit when it was claimed, so it is then held past the capacity:
    /// nothing new fits there until it ends. Rate and cost tokens were spent when the attempt
    /// was claimed and are not taken again. Returns the estimate the attempt holds.
    pub fn handle_resume(
        &mut self,
        now: Time,
        r: ResumeRequest,
    ) -> Result<CostEstimate, SubmitError> {
        let req = r.submit;
        if r.provider.0 as usize >= self.policy.providers.len() {
            return Err(SubmitError::UnknownProvider(r.provider));
        }
        if !matches!(r.state, TaskState::SubmitUnknown | TaskState::Running) {
            return Err(SubmitError::NotResumable(req.task, r.state));
        }
        let (slot, user_slot, estimate) = self.take_back(&req, r.attempt_no)?;
        let mut state = Versioned::new(TaskState::Created);
        for to in [TaskState::Queued, TaskState::Dispatching, r.state] {
            state
                .transition(to, Actor::System)
                .expect("CREATED → QUEUED → DISPATCHING → SUBMIT_UNKNOWN | RUNNING");
        }
        let entry = TaskEntry {
            enqueued_at: now,
            deadline: req.deadline.unwrap_or(NO_DEADLINE),
            tenant_slot: slot,
            user_slot,
            estimate,
            state,
            attempt_no: r.attempt_no,
            provider: Some(r.provider),
            hold: Some(CapacityMode::Normal),
            lane: r.lane,
            band: r.band,
            place: Place::Provider,
        };
        let demand = self.provider_demand(&entry, r.provider, CapacityMode::Normal);
        let units = self.estimates.get(estimate).slots.milli();
        let fits = self
            .take_running(slot, user_slot, &demand.semaphores, units)
            .is_ok();
        if !fits {
            self.ledger.force_acquire_running(&demand.semaphores);
            self.tenants[slot as usize].running.force(units);
            self.users[user_slot as usize].running.force(units);
            self.over_capacity += 1;
        }
        self.lanes[r.lane.index()].running_tasks += 1;
        let cost = self.estimates.get(estimate).cost_milli;
        self.tenants[slot as usize].reserve_cost(cost);
        let cold = TaskCold {
            fencing: Some(r.token),
            over_capacity: !fits,
            ..TaskCold::default()
        };
        self.tasks.insert(req.task, entry, cold);
        self.stats.resumed += 1;
        Ok(*self.estimates.get(estimate))
    }

    /// Queued units ahead in the lane over its measured service rate (seed 000 §18.11.3).
    fn expected_wait_ms(&mut self, lane: Lane, now: Time) -> u64 {
        self.roll_rate(lane, now);
        let rt = &self.lanes[lane.index()];
        let rate = rt.rate_milli_per_s.max(1);
        rt.queued_units_milli.saturating_mul(1000) / rate
    }

    fn roll_rate(&mut self, lane: Lane, now: Time) {
        let rt = &mut self.lanes[lane.index()];
        let elapsed = now.since(rt.rate_bucket_start);
        if elapsed < RATE_BUCKET_NS {
            return;
        }
        let buckets = elapsed / RATE_BUCKET_NS;
        // Idle lanes keep their rate: no work running is not a slow lane.
        if rt.running_tasks > 0 || rt.rate_bucket_milli > 0 {
            let sample = rt.rate_bucket_milli * NANOS_PER_S / RATE_BUCKET_NS;
            rt.rate_milli_per_s =
                rt.rate_milli_per_s - rt.rate_milli_per_s / RATE_EWMA_DIV + sample / RATE_EWMA_DIV;
            for _ in 1..buckets.min(16) {
                if rt.running_tasks == 0 {
                    break;
                }
                rt.rate_milli_per_s -= rt.rate_milli_per_s / RATE_EWMA_DIV;
            }
        }
        rt.rate_bucket_milli = 0;
        rt.rate_bucket_start = rt.rate_bucket_start.plus_ns(buckets * RATE_BUCKET_NS);
    }

    /// One object of a newer policy version, checked first ([`Policy::check`]; on an error
    /// nothing changed). Queued and running tasks keep the lane, band and estimate they were
    /// admitted with; what reads the policy at each decision (a lane closed or reweighted, retry
    /// limits, a model's price for new tasks) follows at once. Node-wide capacities are the
    /// shell's to re-split: see [`Shard::node_limits`].
    pub fn apply_patch(&mut self, patch: PolicyPatch, now: Time) -> Result<(), PolicyError> {
        self.policy.check(&patch)?;
        match patch {
            PolicyPatch::Tenant(tenant, policy) => self.set_tenant_policy(tenant, policy, now),
            PolicyPatch::Model(m) => {
                self.estimates.forget_model(m.id);
                self.policy.apply(PolicyPatch::Model(m))?;
            }
            patch @ (PolicyPatch::Lane(..) | PolicyPatch::Provider(_)) => {
                self.policy.apply(patch)?;
                // A lane opened or reweighted may go on.
                self.unstall_all();
            }
        }
        Ok(())
    }

    /// The policy version new tasks are admitted under.
    pub fn set_policy_version(&mut self, version: PolicyVersion) {
        self.policy.version = version;
    }

    /// A tenant's policy changed (a newer policy version). Its limits and DRR weight apply from
    /// now on; its queued and running tasks keep the lane, band and estimate they were admitted
    /// with.
    pub fn set_tenant_policy(&mut self, tenant: TenantId, policy: TenantPolicy, now: Time) {
        let Some(&slot) = self.tenant_slots.get(&tenant) else {
            self.policy.tenants.insert(tenant, policy);
            return;
        };
        let t = &mut self.tenants[slot as usize];
        let (old_w, new_w) = (u64::from(t.weight), u64::from(policy.weight));
        for lane in Lane::ALL {
            if t.queue(lane).is_some_and(|q| q.in_ring) {
                let rt = &mut self.lanes[lane.index()];
                rt.backlog_weight = rt.backlog_weight - old_w + new_w;
            }
        }
        t.set_policy(&policy, now);
        self.policy.tenants.insert(tenant, policy);
        // More room may let a stalled lane go on.
        self.unstall_all();
    }

    fn ensure_tenant(&mut self, tenant: TenantId) -> Result<u32, SubmitError> {
        if let Some(&slot) = self.tenant_slots.get(&tenant) {
            return Ok(slot);
        }
        let policy = self
            .policy
            .tenants
            .get(&tenant)
            .ok_or(SubmitError::UnknownTenant(tenant))?;
        assert!(
            self.tenants.len() < TENANTS_MAX,
            "more tenants than TENANTS_MAX in one shard"
        );
        let slot = self.tenants.len() as u32;
        self.tenants.push(TenantRt::new(tenant, policy));
        self.tenant_slots.insert(tenant, slot);
        Ok(slot)
    }

    fn ensure_user(&mut self, user: UserId, tenant_slot: u32) -> u32 {
        if let Some(&slot) = self.user_slots.get(&user) {
            return slot;
        }
        let tenant = self.tenants[tenant_slot as usize].id;
        let p = &self.policy.tenants[&tenant].user;
        let record = UserRt {
            submit_rate: SubmitBucket::new(p.submit_rate, Time::ZERO),
            gates: OwnedPair::new((p.queued_tasks_max, p.queued_units_max)),
            running: OwnedPair::new((p.running_tasks_max, p.running_units_max)),
            id: user,
        };
        let slot = u32::try_from(self.users.len()).expect("users bounded by USERS_MAX");
        self.users.push(record);
        self.user_slots.insert(user, slot);
        slot
    }

    // ---------------------------------------------------------------- limits

    // Every acquisition keeps one global order: node semaphores (in ledger id order), then the
    // tenant's own semaphores, then its user's, then node buckets, then the tenant's cost
    // bucket. (It is the order of the limits' ids from when all of them lived in the ledger;
    // the first refused limit names the rejection and classifies a blocked task.) Demands are
    // built in registration order, so every `Demand::add` is an append.

    /// One task and `units` from the tenant's and then the user's `hold` pair, all or nothing.
    fn take_owned(
        &mut self,
        tenant_slot: u32,
        user_slot: u32,
        hold: Hold,
        units: u64,
    ) -> Result<(), LimitKey> {
        let tenant = &mut self.tenants[tenant_slot as usize];
        if let Err(i) = tenant.pair_mut(hold).try_take(units) {
            return Err(tenant.keys(hold)[i]);
        }
        let user = &mut self.users[user_slot as usize];
        if let Err(i) = user.pair_mut(hold).try_take(units) {
            let key = user.keys(hold)[i];
            let keys = tenant.keys(hold);
            tenant.pair_mut(hold).release(units, keys);
            return Err(key);
        }
        Ok(())
    }

    fn release_owned(&mut self, tenant_slot: u32, user_slot: u32, hold: Hold, units: u64) {
        let tenant = &mut self.tenants[tenant_slot as usize];
        let keys = tenant.keys(hold);
        tenant.pair_mut(hold).release(units, keys);
        let user = &mut self.users[user_slot as usize];
        let keys = user.keys(hold);
        user.pair_mut(hold).release(units, keys);
    }

    /// The node-wide queue gates of a task of `lane` with fairness `units`, in id order.
    #[inline]
    fn node_gates(&self, lane: Lane, units: u64) -> [Need; 4] {
        [
            Need::new(self.node.lane_queued_tasks[lane.index()], 1),
            Need::new(self.node.lane_queued_units[lane.index()], units),
            Need::new(self.node.global_queued_tasks, 1),
            Need::new(self.node.global_queued_units, units),
        ]
    }

    /// Takes every queue gate of `e`: the node's, its tenant's, its user's.
    fn take_gates(&mut self, e: &TaskEntry) -> Result<(), LimitKey> {
        let units = self.estimates.get(e.estimate).fairness.milli();
        let node = self.node_gates(e.lane, units);
        if let Err(id) = self.ledger.try_acquire_semaphores(&node) {
            return Err(self.ledger.key(id));
        }
        if let Err(key) = self.take_owned(e.tenant_slot, e.user_slot, Hold::Queued, units) {
            self.ledger.give_back(&node);
            return Err(key);
        }
        Ok(())
    }

    /// Takes the gates of accepted work coming back (a retry, a restore), past capacity if need
    /// be (see [`crate::ledger::Role::AdmissionGate`]).
    fn force_gates(&mut self, e: &TaskEntry) {
        let units = self.estimates.get(e.estimate).fairness.milli();
        self.ledger
            .force_acquire_gate_needs(&self.node_gates(e.lane, units));
        self.tenants[e.tenant_slot as usize].gates.force(units);
        self.users[e.user_slot as usize].gates.force(units);
    }

    fn release_gates(&mut self, e: &TaskEntry) {
        let units = self.estimates.get(e.estimate).fairness.milli();
        self.ledger
            .release_semaphores(&self.node_gates(e.lane, units));
        self.release_owned(e.tenant_slot, e.user_slot, Hold::Queued, units);
    }

    /// The lane pool a provider stage held in `mode` draws on.
    #[inline]
    fn lane_key(&self, lane: Lane, mode: CapacityMode) -> LimitId {
        match mode {
            CapacityMode::Normal => self.node.lane_units[lane.index()],
            CapacityMode::Borrowed(donor) => self.node.lane_units[donor.index()],
        }
    }

    /// The node limits the provider stage holds, in id order: running counts and units per lane,
    /// model, provider and high-cost class (semaphores), then RPM and platform cost tokens
    /// (buckets). The tenant's and user's running limits and the tenant's cost bucket are its
    /// other part. A need that does not apply (no borrowing, not high-cost) is there with zero,
    /// which always fits and releases nothing, so the shape is fixed and built in place.
    #[inline]
    fn provider_demand(
        &self,
        e: &TaskEntry,
        provider: ProviderId,
        mode: CapacityMode,
    ) -> StageNeeds {
        let est = self.estimates.get(e.estimate);
        let model = self.estimates.model(e.estimate).0 as usize;
        let p = provider.0 as usize;
        let units = est.slots.milli();
        let borrowed = mode == CapacityMode::Borrowed(Lane::EnterpriseReserved);
        let high_cost = est.class == ResourceClass::Expensive;
        let n = &self.node;
        StageNeeds {
            semaphores: [
                Need::new(self.lane_key(e.lane, mode), units),
                Need::new(n.enterprise_borrowed, if borrowed { units } else { 0 }),
                Need::new(n.lane_running_tasks[e.lane.index()], 1),
                Need::new(n.model_running[model], 1),
                Need::new(n.model_running_units[model], units),
                Need::new(n.provider_concurrency[p], 1),
                Need::new(n.high_cost, u64::from(high_cost)),
                Need::new(n.global_running_tasks, 1),
                Need::new(n.global_running_units, units),
            ],
            buckets: [
                Need::new(n.provider_rpm[p], 1),
                Need::new(n.platform_cost, est.cost_milli),
            ],
        }
    }

    /// Acquires the whole provider stage of the task in `slot`, all or nothing, in the global
    /// order; on refusal names the first limit that did not fit.
    fn try_provider_stage(
        &mut self,
        slot: u32,
        provider: ProviderId,
        mode: CapacityMode,
        now: Time,
    ) -> Result<(), LimitKey> {
        let e = self.tasks.at(slot);
        let (tenant_slot, user_slot) = (e.tenant_slot, e.user_slot);
        let est = self.estimates.get(e.estimate);
        let (units, cost) = (est.slots.milli(), est.cost_milli);
        let demand = self.provider_demand(e, provider, mode);
        let (sems, buckets) = (&demand.semaphores, &demand.buckets);
        self.take_running(tenant_slot, user_slot, sems, units)?;
        let refused = match self.ledger.try_acquire_needs(buckets, now) {
            Err(id) => Some(self.ledger.key(id)),
            Ok(()) => {
                let tenant = &mut self.tenants[tenant_slot as usize];
                let taken = tenant.cost_per_minute.try_take(cost, now);
                if !taken {
                    self.ledger.give_back(buckets);
                }
                (!taken).then_some(LimitKey::TenantCostPerMinute(tenant.id))
            }
        };
        if let Some(key) = refused {
            self.release_owned(tenant_slot, user_slot, Hold::Running, units);
            self.ledger.give_back(sems);
            return Err(key);
        }
        Ok(())
    }

    /// The semaphore part of a provider stage (`sems`) and the tenant's and user's running
    /// pair, all or nothing; on refusal names the first limit that did not fit.
    #[inline(always)]
    fn take_running(
        &mut self,
        tenant_slot: u32,
        user_slot: u32,
        sems: &[Need],
        units: u64,
    ) -> Result<(), LimitKey> {
        if let Err(id) = self.ledger.try_acquire_semaphores(sems) {
            return Err(self.ledger.key(id));
        }
        if let Err(key) = self.take_owned(tenant_slot, user_slot, Hold::Running, units) {
            self.ledger.give_back(sems);
            return Err(key);
        }
        Ok(())
    }

    // Inlined: a demand returned from a call is copied out (136 bytes).
    #[inline(always)]
    fn media_demand(&self, e: &TaskEntry) -> Demand {
        let m = self.estimates.get(e.estimate).media;
        let mut d = Demand::default();
        d.add(self.node.gpu_units, m.gpu_units.into());
        d.add(self.node.gpu_mem_mb, m.gpu_mem_mb.into());
        d.add(self.node.cpu_units, m.cpu_units.into());
        d.add(self.node.temp_disk_mb, m.temp_disk_mb.into());
        d
    }

    /// Lane capacity a task of `lane` may use, in preference order: its own pool, then what it
    /// may borrow (DESIGN §4: enterprise reserve with headroom; best effort on leftovers only).
    fn lane_options(&self, lane: Lane, units: u64) -> ([CapacityMode; 3], usize) {
        let mut options = [CapacityMode::Normal; 3];
        let mut n = 1;
        let idle = |l: Lane| self.lanes[l.index()].queued_tasks == 0;
        match lane {
            Lane::PaidShared | Lane::Standard | Lane::Expensive => {
                let ent = Lane::EnterpriseReserved;
                let id = self.node.lane_units[ent.index()];
                if idle(ent) && self.ledger.free(id) >= units + self.headroom_share(id) {
                    options[n] = CapacityMode::Borrowed(ent);
                    n += 1;
                }
            }
            Lane::BestEffort => {
                for donor in [Lane::Standard, Lane::PaidShared] {
                    if idle(donor) {
                        options[n] = CapacityMode::Borrowed(donor);
                        n += 1;
                    }
                }
            }
            Lane::EnterpriseReserved | Lane::Recovery => {}
        }
        (options, n)
    }

    /// This shard's part of the enterprise headroom that must stay unborrowed, in proportion to
    /// its share of the enterprise pool.
    fn headroom_share(&self, ent_id: LimitId) -> u64 {
        let node_cap = self.policy.lane(Lane::EnterpriseReserved).capacity.milli();
        if node_cap == 0 {
            return 0;
        }
        let headroom = self.policy.reserve.minimum_reserved_headroom.milli();
        let share = self.ledger.capacity(ent_id);
        (u128::from(headroom) * u128::from(share)).div_ceil(u128::from(node_cap)) as u64
    }

    // ---------------------------------------------------------------- queues

    #[inline]
    fn fairness_milli(&self, entry: u32) -> u64 {
        self.estimates
            .get(self.tasks.at(entry).estimate)
            .fairness
            .milli()
    }

    fn enqueue(&mut self, slot: u32, lane: Lane, band: Band, entry: u32, end: End) {
        let cost_milli = self.fairness_milli(entry);
        let initial_credit = self.policy.drr.initial_burst_credit.milli() as i64;
        let tenant = &mut self.tenants[slot as usize];
        let weight = u64::from(tenant.weight);
        let q = tenant.queue_mut(lane);
        let mut bands = Bands {
            tasks: &mut self.tasks,
            estimates: &self.estimates,
        };
        match end {
            End::Back => q.push_back(&mut bands, band, entry),
            End::Front => q.push_front(&mut bands, band, entry),
        }
        let rt = &mut self.lanes[lane.index()];
        rt.queued_tasks += 1;
        rt.queued_units_milli += cost_milli;
        if !q.in_ring {
            // A tenant becoming active again starts from min(previous, initial burst credit).
            q.in_ring = true;
            q.deficit = q.deficit.min(initial_credit);
            q.needs_quantum = true;
            rt.ring.push_back(slot);
            rt.backlog_weight += weight;
        }
        rt.stalled_until = None;
        rt.blocked_streak = 0;
    }

    /// Takes `entry`, which follows `prev` (`NIL`: it is the head), out of tenant `slot`'s
    /// `band` in `lane`, with the bookkeeping that goes with it.
    fn dequeue(&mut self, slot: u32, lane: Lane, band: Band, prev: u32, entry: u32) {
        let cost_milli = self.fairness_milli(entry);
        let tenant = &mut self.tenants[slot as usize];
        let weight = u64::from(tenant.weight);
        let q = tenant.queue_mut(lane);
        let mut bands = Bands {
            tasks: &mut self.tasks,
            estimates: &self.estimates,
        };
        q.unlink(&mut bands, band, prev, entry);
        self.dequeued(slot, lane, entry, cost_milli, weight);
    }

    /// Bookkeeping after `entry` left tenant `slot`'s queue in `lane`.
    fn dequeued(&mut self, slot: u32, lane: Lane, entry: u32, cost_milli: u64, weight: u64) {
        let rt = &mut self.lanes[lane.index()];
        rt.queued_tasks -= 1;
        rt.queued_units_milli -= cost_milli;
        let q = self.tenants[slot as usize].queue_mut(lane);
        if q.skipped_head == entry {
            q.skipped_head = NIL;
            q.skips = 0;
        }
        if q.is_empty() && q.in_ring {
            q.in_ring = false;
            let pos = rt
                .ring
                .iter()
                .position(|&s| s == slot)
                .expect("active tenant is in the ring");
            rt.ring.remove(pos);
            rt.backlog_weight -= weight;
        }
    }

    fn unstall_all(&mut self) {
        for rt in &mut self.lanes {
            rt.stalled_until = None;
            rt.blocked_streak = 0;
        }
    }

    fn promote_delayed(&mut self, now: Time) {
        while let Some(&Reverse((at, task))) = self.delayed.peek() {
            if at > now {
                break;
            }
            self.delayed.pop();
            let Some(entry) = self.tasks.slot(task) else {
                continue;
            };
            let e = self.tasks.at_mut(entry);
            if e.place != Place::Delayed || e.state.state != TaskState::Queued {
                continue;
            }
            e.place = Place::Band;
            let e = e.clone();
            self.force_gates(&e);
            self.enqueue(e.tenant_slot, e.lane, e.band, entry, End::Front);
        }
    }

    // ---------------------------------------------------------------- dispatch

    /// Picks the next task to run, if any: weighted lane choice, then DRR over the lane's active
    /// tenants, then bands with aging and a bounded fit-scan inside the tenant.
    pub fn poll_dispatch(&mut self, now: Time) -> Poll {
        self.promote_delayed(now);
        let mut visits = 0usize;
        let mut tried = [false; Lane::COUNT];
        loop {
            let Some(lane) = self.next_lane(now, &tried) else {
                return Poll::Idle;
            };
            tried[lane.index()] = true;
            loop {
                if visits >= TENANT_VISITS_PER_POLL_MAX {
                    return Poll::Yield;
                }
                visits += 1;
                match self.serve_lane_once(lane, now) {
                    Some(TurnResult::Dispatched(entry)) => {
                        self.charge_lane_choice(lane);
                        self.stats.dispatched += 1;
                        let d = self.dispatch_of(entry);
                        if matches!(d.mode, CapacityMode::Borrowed(_)) {
                            self.stats.borrowed_dispatches += 1;
                        }
                        return Poll::Dispatch(d);
                    }
                    Some(TurnResult::Expired(task)) => {
                        self.stats.expired += 1;
                        return Poll::Expired(task);
                    }
                    Some(TurnResult::OutOfCredit | TurnResult::Blocked(_)) => continue,
                    None => break,
                }
            }
        }
    }

    /// Smooth weighted round robin among lanes with work that are not stalled.
    fn next_lane(&mut self, now: Time, tried: &[bool; Lane::COUNT]) -> Option<Lane> {
        let mut best: Option<(Lane, i64)> = None;
        for lane in Lane::ALL {
            let rt = &mut self.lanes[lane.index()];
            if tried[lane.index()] || rt.ring.is_empty() {
                continue;
            }
            if let Some(until) = rt.stalled_until {
                if now < until {
                    continue;
                }
                rt.stalled_until = None;
                rt.blocked_streak = 0;
            }
            let current = rt.swrr_current;
            if best.is_none_or(|(_, c)| current > c) {
                best = Some((lane, current));
            }
        }
        best.map(|(lane, _)| lane)
    }

    fn charge_lane_choice(&mut self, chosen: Lane) {
        let mut total = 0i64;
        for lane in Lane::ALL {
            if !self.lanes[lane.index()].ring.is_empty() || lane == chosen {
                let w = i64::from(self.policy.lane(lane).weight);
                self.lanes[lane.index()].swrr_current += w;
                total += w;
            }
        }
        self.lanes[chosen.index()].swrr_current -= total;
    }

    /// One DRR visit to the tenant at the front of `lane`'s ring. `None` when the lane has no
    /// tenant or every tenant in it is blocked (the lane is then stalled).
    fn serve_lane_once(&mut self, lane: Lane, now: Time) -> Option<TurnResult> {
        let rt = &self.lanes[lane.index()];
        let &slot = rt.ring.front()?;
        if rt.blocked_streak >= rt.ring.len() {
            let rt = &mut self.lanes[lane.index()];
            rt.stalled_until = Some(now.plus_ns(STALL_RETRY_NS));
            return None;
        }
        let drr = self.policy.drr;
        let tenant = &mut self.tenants[slot as usize];
        let quantum = drr.base_quantum.milli() as i64 * i64::from(tenant.weight);
        let cap = quantum * i64::from(drr.burst_rounds);
        let q = tenant.queue_mut(lane);
        if q.needs_quantum {
            q.needs_quantum = false;
            // Fairness debt is paid out of the quantum (a refund adds to it), at most one quantum.
            let pay = q.debt.clamp(-quantum, quantum);
            q.debt -= pay;
            q.deficit = (q.deficit + quantum - pay).min(cap);
        }
        let result = self.tenant_turn(slot, lane, now, cap);
        let rt = &mut self.lanes[lane.index()];
        match &result {
            TurnResult::Dispatched(_) | TurnResult::Expired(_) => rt.blocked_streak = 0,
            TurnResult::OutOfCredit => {
                rt.blocked_streak = 0;
                rt.ring.rotate_left(1);
                self.tenants[slot as usize].queue_mut(lane).needs_quantum = true;
            }
            TurnResult::Blocked(Block::LanePool) => {
                rt.stalled_until = Some(now.plus_ns(STALL_RETRY_NS));
                return None;
            }
            TurnResult::Blocked(Block::Tenant | Block::Resource) => {
                rt.blocked_streak += 1;
                rt.ring.rotate_left(1);
            }
        }
        Some(result)
    }

    /// The tenant's turn: the head of its best band after aging, then up to `fit_scan_max` tasks
    /// behind it if the head does not fit, unless the head was skipped `skips_max` times already.
    fn tenant_turn(&mut self, slot: u32, lane: Lane, now: Time, cap: i64) -> TurnResult {
        let aging_ns = self.policy.aging.aging_step_ms * NANOS_PER_MS;
        let fit_scan = self.policy.aging.fit_scan_max.min(FIT_SCAN_MAX);
        let skips_max = self.policy.aging.skips_max;
        let q = self.tenants[slot as usize]
            .queue(lane)
            .expect("a ringed tenant has a queue");
        let bands = Bands {
            tasks: &self.tasks,
            estimates: &self.estimates,
        };
        let band = q
            .best_band(&bands, now, aging_ns)
            .expect("a ringed tenant has queued work");
        let head = q.head(band).expect("best band has a head");
        let deadline = self.tasks.at(head).deadline;
        if deadline != NO_DEADLINE && deadline <= now {
            let task = self.tasks.id_at(head);
            self.expire_head(slot, lane, band, head);
            return TurnResult::Expired(task);
        }
        let may_skip = !(q.skipped_head == head && q.skips >= skips_max);
        let scan = if may_skip { fit_scan + 1 } else { 1 };
        let deficit = q.deficit;
        let mut first_failure = TurnResult::Blocked(Block::Resource);
        // A candidate at least as large as one the lane pool refused cannot fit either.
        let mut lane_refused_milli = u64::MAX;
        let (mut prev, mut cand) = (NIL, head);
        for pos in 0..scan {
            if cand == NIL {
                break;
            }
            let next = self.tasks.link(cand);
            let cost_milli = self.fairness_milli(cand);
            let credit_ok = cost_milli as i64 <= deficit || deficit >= cap;
            if !credit_ok {
                if pos == 0 {
                    first_failure = TurnResult::OutOfCredit;
                }
            } else if cost_milli < lane_refused_milli {
                match self.try_start(cand, now) {
                    Ok(()) => {
                        let q = self.tenants[slot as usize].queue_mut(lane);
                        q.deficit -= cost_milli as i64;
                        if pos > 0 {
                            if q.skipped_head != head {
                                q.skipped_head = head;
                                q.skips = 0;
                            }
                            q.skips += 1;
                            self.stats.fit_scan_skips += 1;
                        }
                        self.dequeue(slot, lane, band, prev, cand);
                        // The tenant's next visit reads the task behind this one.
                        self.tasks.prefetch(next);
                        return TurnResult::Dispatched(cand);
                    }
                    Err(block) => {
                        if pos == 0 {
                            first_failure = TurnResult::Blocked(block);
                        }
                        if block == Block::LanePool {
                            lane_refused_milli = lane_refused_milli.min(cost_milli);
                        }
                    }
                }
            }
            (prev, cand) = (cand, next);
        }
        first_failure
    }

    fn expire_head(&mut self, slot: u32, lane: Lane, band: Band, head: u32) {
        self.dequeue(slot, lane, band, NIL, head);
        let e = self.tasks.at_mut(head);
        e.state
            .transition(TaskState::Expired, Actor::System)
            .expect("QUEUED → EXPIRED");
        let e = e.clone();
        self.release_gates(&e);
        self.finish(self.tasks.id_at(head));
    }

    /// Tries every provider of the task's model with every lane option; on the first complete
    /// acquisition moves the task QUEUED → DISPATCHING. Changes nothing otherwise, and says why.
    fn try_start(&mut self, entry: u32, now: Time) -> Result<(), Block> {
        let e = self.tasks.at(entry);
        let units = self.estimates.get(e.estimate).slots.milli();
        let model = self.estimates.model(e.estimate).0 as usize;
        let (lane_opts, n_opts) = self.lane_options(e.lane, units);
        let n_providers = self.policy.models[model].providers.len();
        // The first refused limit in the fixed order classifies the block: node limits come
        // first, so a tenant block shows only once the shared ones would fit.
        let mut block = Block::LanePool;
        for &mode in &lane_opts[..n_opts] {
            for i in 0..n_providers {
                let provider = self.policy.models[model].providers[i];
                let Err(key) = self.try_provider_stage(entry, provider, mode, now) else {
                    self.started(entry, provider, mode);
                    return Ok(());
                };
                block = match (key, key.scope()) {
                    (_, Scope::Shard) => return Err(Block::Tenant),
                    (LimitKey::LaneUnits(_) | LimitKey::EnterpriseBorrowed, _) => block,
                    _ => Block::Resource,
                };
            }
        }
        Err(block)
    }

    /// QUEUED → DISPATCHING once the provider-stage demand is held.
    fn started(&mut self, entry: u32, provider: ProviderId, mode: CapacityMode) {
        let e = self.tasks.at(entry).clone();
        self.release_gates(&e);
        debug_assert!(
            self.tasks.cold(entry).fencing.is_none(),
            "a queued task holds no fencing token"
        );
        let e = self.tasks.at_mut(entry);
        e.state
            .transition(TaskState::Dispatching, Actor::System)
            .expect("QUEUED → DISPATCHING");
        e.place = Place::Provider;
        e.provider = Some(provider);
        e.hold = Some(mode);
        e.attempt_no += 1;
        assert!(
            e.attempt_no <= ATTEMPTS_MAX,
            "attempts bounded by retry limits"
        );
        let lane = e.lane;
        self.lanes[lane.index()].running_tasks += 1;
    }

    /// What the shell is told of the task in `entry`, which has just started.
    fn dispatch_of(&self, entry: u32) -> Dispatch {
        let e = self.tasks.at(entry);
        Dispatch {
            task: self.tasks.id_at(entry),
            tenant: self.tenants[e.tenant_slot as usize].id,
            user: self.users[e.user_slot as usize].id,
            lane: e.lane,
            band: e.band,
            provider: e.provider.expect("a started task has its provider"),
            mode: e.hold.expect("a started task holds its provider stage"),
            attempt_no: e.attempt_no,
            estimate: *self.estimates.get(e.estimate),
            policy_version: self.policy.version,
        }
    }

    /// A canceled task's running step reported back: release what it held and forget it.
    fn drop_canceled_attempt(&mut self, task: TaskId) {
        self.release_provider_hold(task);
        self.finish(task);
    }

    fn release_provider_hold(&mut self, task: TaskId) {
        let slot = self.tasks.slot(task).expect("entry");
        let e = self.tasks.at(slot).clone();
        assert_eq!(
            e.place,
            Place::Provider,
            "task {task} holds no provider reservation"
        );
        let mode = e.hold.expect("provider hold has a capacity mode");
        let provider = e.provider.expect("provider hold has a provider");
        let demand = self.provider_demand(&e, provider, mode);
        self.ledger.release_semaphores(&demand.semaphores);
        let units = self.estimates.get(e.estimate).slots.milli();
        self.release_owned(e.tenant_slot, e.user_slot, Hold::Running, units);
        self.lanes[e.lane.index()].running_tasks -= 1;
        self.tasks.at_mut(slot).hold = None;
        let cold = self.tasks.cold_mut(slot);
        if std::mem::take(&mut cold.over_capacity) {
            self.over_capacity -= 1;
        }
        self.unstall_all();
    }

    // ---------------------------------------------------------------- provider reports

    /// The slot of `task` if `token` is its current fencing token.
    fn fenced(&self, task: TaskId, token: FencingToken) -> Result<u32, ShardError> {
        let slot = self.tasks.slot(task).ok_or(ShardError::UnknownTask(task))?;
        let current = self.tasks.cold(slot).fencing;
        if current != Some(token) {
            return Err(ShardError::StaleFencing {
                task,
                presented: token,
                current,
            });
        }
        Ok(slot)
    }

    fn transition(&mut self, task: TaskId, to: TaskState) -> Result<(), ShardError> {
        let slot = self.tasks.slot(task).ok_or(ShardError::UnknownTask(task))?;
        self.tasks
            .at_mut(slot)
            .state
            .transition(to, Actor::System)
            .map(|_| ())
            .map_err(|error| ShardError::Transition { task, error })
    }

    /// Like `fenced`, and the task must be in its provider stage (a report about an attempt
    /// that has already moved on is refused, whatever its token). Returns its state.
    fn fenced_provider(
        &self,
        task: TaskId,
        token: FencingToken,
        to: TaskState,
    ) -> Result<TaskState, ShardError> {
        let e = self.tasks.at(self.fenced(task, token)?);
        if e.place != Place::Provider {
            let from = e.state.state;
            return Err(ShardError::Transition {
                task,
                error: TransitionError::Illegal { from, to },
            });
        }
        Ok(e.state.state)
    }

    /// The slot of a task whose claim is outstanding (dispatched, no token yet), refusing
    /// anything else as an illegal move to `to`.
    fn claim_pending(&self, task: TaskId, to: TaskState) -> Result<u32, ShardError> {
        let slot = self.tasks.slot(task).ok_or(ShardError::UnknownTask(task))?;
        let e = self.tasks.at(slot);
        if e.place != Place::Provider || self.tasks.cold(slot).fencing.is_some() {
            return Err(ShardError::Transition {
                task,
                error: TransitionError::Illegal {
                    from: e.state.state,
                    to,
                },
            });
        }
        Ok(slot)
    }

    /// The control plane committed the claim and issued `token` for this attempt. Returns
    /// `Canceled` when a cancel won the race: the shell must then not submit anything.
    pub fn handle_claim_granted(
        &mut self,
        task: TaskId,
        token: FencingToken,
    ) -> Result<ClaimOutcome, ShardError> {
        let slot = self.claim_pending(task, TaskState::Dispatching)?;
        self.tasks.cold_mut(slot).fencing = Some(token);
        if self.tasks.at(slot).state.state == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(ClaimOutcome::Canceled);
        }
        Ok(ClaimOutcome::Submit)
    }

    /// The control plane refused the claim (the task moved, or a global pool key was full): undo
    /// the local reservation and put the task back at the front of its band.
    pub fn handle_claim_refused(&mut self, now: Time, task: TaskId) -> Result<(), ShardError> {
        self.handle_claim_refused_until(task, now)
    }

    /// [`Shard::handle_claim_refused`], the task eligible again only from `eligible_at` (a
    /// refusal that a later moment may lift, such as a lease about to be renewed).
    pub fn handle_claim_refused_until(
        &mut self,
        task: TaskId,
        eligible_at: Time,
    ) -> Result<(), ShardError> {
        let slot = self.claim_pending(task, TaskState::Queued)?;
        if self.tasks.at(slot).state.state == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(());
        }
        self.release_provider_hold(task);
        self.transition(task, TaskState::Queued)?;
        self.tasks.at_mut(slot).attempt_no -= 1;
        self.requeue_at(task, eligible_at);
        Ok(())
    }

    /// The provider accepted the request (or a query found it after SUBMIT_UNKNOWN).
    pub fn handle_provider_accepted(
        &mut self,
        task: TaskId,
        token: FencingToken,
    ) -> Result<(), ShardError> {
        if self.fenced_provider(task, token, TaskState::Running)? == TaskState::Canceled {
            return Ok(());
        }
        self.transition(task, TaskState::Running)
    }

    /// The submit timed out: the provider may have accepted. Keep every reservation.
    pub fn handle_submit_unknown(
        &mut self,
        task: TaskId,
        token: FencingToken,
    ) -> Result<(), ShardError> {
        let state = self.fenced_provider(task, token, TaskState::SubmitUnknown)?;
        if state == TaskState::Canceled {
            return Ok(());
        }
        self.transition(task, TaskState::SubmitUnknown)
    }

    /// A query by request key says the provider never saw the attempt: release and requeue at
    /// once (no penalty, it was our loss).
    pub fn handle_provider_not_found(
        &mut self,
        now: Time,
        task: TaskId,
        token: FencingToken,
    ) -> Result<FailOutcome, ShardError> {
        if self.fenced_provider(task, token, TaskState::Queued)? == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(FailOutcome::Canceled);
        }
        self.transition(task, TaskState::Queued)?;
        self.release_provider_hold(task);
        self.requeue_at(task, now);
        Ok(FailOutcome::Requeued { eligible_at: now })
    }

    /// A provider attempt failed. `jitter_milli` (700..=1300) comes from the shell's RNG so the
    /// core stays deterministic.
    pub fn handle_provider_failed(
        &mut self,
        now: Time,
        task: TaskId,
        token: FencingToken,
        failure: Failure,
        jitter_milli: u64,
    ) -> Result<FailOutcome, ShardError> {
        assert!((700..=1300).contains(&jitter_milli), "jitter is 0.7–1.3");
        let state = self.fenced_provider(task, token, TaskState::Queued)?;
        if state == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(FailOutcome::Canceled);
        }
        if failure == Failure::RateLimited && state != TaskState::Dispatching {
            // Only an answer to our submit proves the request was not accepted.
            return Err(ShardError::Transition {
                task,
                error: TransitionError::Illegal {
                    from: state,
                    to: TaskState::Queued,
                },
            });
        }
        let slot = self.tasks.slot(task).expect("entry");
        let e = self.tasks.at(slot).clone();
        let lane = self.policy.lane(e.lane);
        let (retries_max, rate_limit_retries_max) = (lane.retries_max, lane.rate_limit_retries_max);
        let cold = self.tasks.cold_mut(slot);
        let (retry_no, limit) = match failure {
            Failure::RateLimited => {
                cold.rate_limit_retries += 1;
                (cold.rate_limit_retries, rate_limit_retries_max)
            }
            Failure::Retryable => {
                cold.retries += 1;
                (cold.retries, retries_max)
            }
            Failure::NonRetryable => (u32::MAX, 0),
        };
        let provider = e.provider.expect("a failed attempt had a provider");
        if failure == Failure::RateLimited {
            // Not accepted, so not billed: refund cost tokens; slow the provider's bucket down.
            let cost = self.estimates.get(e.estimate).cost_milli;
            let rpm = self.node.provider_rpm[provider.0 as usize];
            self.ledger.penalize(rpm, now);
            self.tenants[e.tenant_slot as usize]
                .cost_per_minute
                .refund(cost);
            self.ledger.refund(self.node.platform_cost, cost);
        }
        let exhausted = retry_no > limit || e.attempt_no >= ATTEMPTS_MAX;
        if exhausted {
            self.transition(task, TaskState::Failed)?;
            self.release_provider_hold(task);
            self.stats.failed += 1;
            self.finish(task);
            return Ok(FailOutcome::Failed);
        }
        self.transition(task, TaskState::Queued)?;
        self.release_provider_hold(task);
        let eligible_at = now.plus_ns(self.policy.retry.backoff_ns(retry_no, jitter_milli));
        self.requeue_at(task, eligible_at);
        self.stats.requeued += 1;
        Ok(FailOutcome::Requeued { eligible_at })
    }

    fn requeue_at(&mut self, task: TaskId, eligible_at: Time) {
        let slot = self.tasks.slot(task).expect("entry");
        self.tasks.cold_mut(slot).fencing = None;
        let e = self.tasks.at_mut(slot);
        e.provider = None;
        e.place = Place::Delayed;
        assert!(
            self.delayed.len() < DELAYED_MAX,
            "delay heap bounded by TASKS_MAX"
        );
        self.delayed.push(Reverse((eligible_at, task)));
    }

    /// The provider finished the work. `actual` is the measured fairness cost; the difference to
    /// the estimate becomes fairness debt (capped per task). The task waits for a media slot.
    pub fn handle_provider_succeeded(
        &mut self,
        now: Time,
        task: TaskId,
        token: FencingToken,
        actual: Units,
    ) -> Result<CompleteOutcome, ShardError> {
        let state = self.fenced_provider(task, token, TaskState::ProviderSucceeded)?;
        if state == TaskState::Canceled {
            self.drop_canceled_attempt(task);
            return Ok(CompleteOutcome::Canceled);
        }
        self.transition(task, TaskState::ProviderSucceeded)?;
        self.release_provider_hold(task);
        let slot = self.tasks.slot(task).expect("entry");
        let e = self.tasks.at(slot);
        let (tenant_slot, lane) = (e.tenant_slot, e.lane);
        let estimated = self.estimates.get(e.estimate).fairness.milli() as i64;
        let cap = self.policy.drr.debt_cap_per_task.milli() as i64;
        let delta = (actual.milli() as i64 - estimated).clamp(-cap, cap);
        self.tenants[tenant_slot as usize].queue_mut(lane).debt += delta;
        self.roll_rate(lane, now);
        self.lanes[lane.index()].rate_bucket_milli += actual.milli();
        self.tasks.at_mut(slot).place = Place::MediaQueue;
        assert!(
            self.media_queue.len() < MEDIA_QUEUE_MAX,
            "media queue bounded by TASKS_MAX"
        );
        self.media_queue.push_back(task);
        Ok(CompleteOutcome::AwaitingMedia)
    }

    /// Starts the next media job whose slots fit, FIFO with a bounded fit-scan.
    pub fn poll_media(&mut self, now: Time) -> Option<MediaStart> {
        let skips_max = self.policy.aging.skips_max;
        let scan = if self.media_head_skips >= skips_max {
            1
        } else {
            FIT_SCAN_MAX + 1
        };
        for pos in 0..scan.min(self.media_queue.len()) {
            let task = self.media_queue[pos];
            let demand = self.media_demand(&self.tasks[&task]);
            if self.ledger.try_acquire(&demand, now).is_err() {
                continue;
            }
            self.media_queue.remove(pos);
            self.media_head_skips = if pos == 0 {
                0
            } else {
                self.media_head_skips + 1
            };
            self.transition(task, TaskState::MediaProcessing)
                .expect("PROVIDER_SUCCEEDED → MEDIA_PROCESSING");
            let slot = self.tasks.slot(task).expect("entry");
            let e = self.tasks.at_mut(slot);
            e.place = Place::Media;
            let (tenant_slot, estimate) = (e.tenant_slot, e.estimate);
            return Some(MediaStart {
                task,
                tenant: self.tenants[tenant_slot as usize].id,
                estimate: *self.estimates.get(estimate),
            });
        }
        None
    }

    /// The media stage ended: release its slots; the task is SUCCEEDED or FAILED.
    pub fn handle_media_done(
        &mut self,
        task: TaskId,
        token: FencingToken,
        ok: bool,
    ) -> Result<CompleteOutcome, ShardError> {
        let e = self.tasks.at(self.fenced(task, token)?);
        if e.place != Place::Media {
            return Err(ShardError::Transition {
                task,
                error: TransitionError::Illegal {
                    from: e.state.state,
                    to: TaskState::Succeeded,
                },
            });
        }
        let canceled = e.state.state == TaskState::Canceled;
        let demand = self.media_demand(e);
        if !canceled {
            let to = if ok {
                TaskState::Succeeded
            } else {
                TaskState::Failed
            };
            self.transition(task, to)?;
        }
        self.ledger.release(&demand);
        self.unstall_all();
        self.finish(task);
        Ok(match (canceled, ok) {
            (true, _) => CompleteOutcome::Canceled,
            (false, true) => {
                self.stats.succeeded += 1;
                CompleteOutcome::Succeeded
            }
            (false, false) => {
                self.stats.failed += 1;
                CompleteOutcome::Failed
            }
        })
    }

    /// Cancels a task: at once if it waits; otherwise it becomes CANCELED and keeps its
    /// reservations until its running step reports (a canceled task is never submitted again).
    pub fn handle_cancel(&mut self, task: TaskId) -> Result<CancelOutcome, ShardError> {
        let slot = self.tasks.slot(task).ok_or(ShardError::UnknownTask(task))?;
        let e = self.tasks.at(slot).clone();
        self.transition(task, TaskState::Canceled)?;
        self.stats.canceled += 1;
        match e.place {
            Place::Band => {
                let cost_milli = self.fairness_milli(slot);
                let tenant = &mut self.tenants[e.tenant_slot as usize];
                let weight = u64::from(tenant.weight);
                let mut bands = Bands {
                    tasks: &mut self.tasks,
                    estimates: &self.estimates,
                };
                let found = tenant
                    .queue_mut(e.lane)
                    .remove_task(&mut bands, e.band, slot);
                assert!(found, "a queued task is in its band");
                self.dequeued(e.tenant_slot, e.lane, slot, cost_milli, weight);
                self.release_gates(&e);
                self.finish(task);
                Ok(CancelOutcome::Canceled)
            }
            Place::Delayed => {
                // Its heap entry is skipped when it comes due.
                self.finish(task);
                Ok(CancelOutcome::Canceled)
            }
            Place::MediaQueue => {
                let pos = self
                    .media_queue
                    .iter()
                    .position(|&t| t == task)
                    .expect("in media queue");
                self.media_queue.remove(pos);
                self.finish(task);
                Ok(CancelOutcome::Canceled)
            }
            Place::Provider | Place::Media => Ok(CancelOutcome::CanceledPendingRelease),
        }
    }

    /// Drops a task that left the shard for good, settling its cost reservation.
    fn finish(&mut self, task: TaskId) {
        let e = self.tasks.remove(&task).expect("entry");
        assert!(
            e.state.state.is_terminal(),
            "finishing a task in {}",
            e.state.state
        );
        let cost = self.estimates.get(e.estimate).cost_milli;
        self.tenants[e.tenant_slot as usize].cost_room_milli += cost as i64;
        self.estimates.release(e.estimate);
    }

    // ---------------------------------------------------------------- invariants

    /// Recomputes every counter from the tasks and compares: the in-memory form of "counters are
    /// derived" (DESIGN §2.5). O(tasks + limits): for tests and the simulator.
    pub fn check_invariants(&self) {
        let within = self.over_capacity == 0;
        self.ledger.check_invariants(within);
        let mut expected = vec![0u64; self.ledger.semaphore_count()];
        let mut add = |needs: &[Need]| {
            for n in needs {
                if let Some(i) = n.id.semaphore_index() {
                    expected[i] += n.amount();
                }
            }
        };
        // Per owner: (queued tasks, queued units, running tasks, running units).
        let mut tenant_held = vec![[0u64; 4]; self.tenants.len()];
        let mut user_held = vec![[0u64; 4]; self.users.len()];
        let mut hold = |e: &TaskEntry, h: Hold, units: u64| {
            let at = if h == Hold::Queued { 0 } else { 2 };
            for held in [
                &mut tenant_held[e.tenant_slot as usize],
                &mut user_held[e.user_slot as usize],
            ] {
                held[at] += 1;
                held[at + 1] += units;
            }
        };
        let mut holders = vec![0u32; self.estimates.slots()];
        let mut lane_tasks = [0u64; Lane::COUNT];
        let mut lane_units = [0u64; Lane::COUNT];
        let mut lane_running = [0u64; Lane::COUNT];
        let mut reserved = vec![0u64; self.tenants.len()];
        for (task, _, e) in self.tasks.iter() {
            holders[e.estimate.index()] += 1;
            let est = self.estimates.get(e.estimate);
            reserved[e.tenant_slot as usize] += est.cost_milli;
            match e.place {
                Place::Band => {
                    assert_eq!(e.state.state, TaskState::Queued, "task {task} in a band");
                    let units = est.fairness.milli();
                    add(&self.node_gates(e.lane, units));
                    hold(e, Hold::Queued, units);
                    lane_tasks[e.lane.index()] += 1;
                    lane_units[e.lane.index()] += units;
                }
                Place::Delayed => {
                    assert_eq!(e.state.state, TaskState::Queued, "task {task} delayed")
                }
                Place::Provider => {
                    let mode = e.hold.expect("provider hold");
                    add(&self
                        .provider_demand(e, e.provider.expect("provider"), mode)
                        .semaphores);
                    hold(e, Hold::Running, est.slots.milli());
                    lane_running[e.lane.index()] += 1;
                    assert!(
                        matches!(
                            e.state.state,
                            TaskState::Dispatching
                                | TaskState::SubmitUnknown
                                | TaskState::Running
                                | TaskState::Canceled
                        ),
                        "task {task} holding a provider slot in {}",
                        e.state.state
                    );
                }
                Place::MediaQueue => {
                    assert_eq!(
                        e.state.state,
                        TaskState::ProviderSucceeded,
                        "task {task} in media queue"
                    )
                }
                Place::Media => add(self.media_demand(e).needs()),
            }
        }
        for (id, key, used) in self.ledger.semaphores() {
            let i = id.semaphore_index().expect("a semaphore");
            assert_eq!(
                used, expected[i],
                "{key} counter {used} differs from its reservations {}",
                expected[i]
            );
        }
        let owned = |pairs: [&OwnedPair; 2],
                     keys: &dyn Fn(Hold) -> [LimitKey; 2],
                     submit: &SubmitBucket,
                     held: [u64; 4]| {
            for (pair, at, h) in [(pairs[0], 0, Hold::Queued), (pairs[1], 2, Hold::Running)] {
                let used = pair.used();
                let [tasks, units] = keys(h);
                assert_eq!(used.0, held[at], "{tasks} differs from its reservations");
                assert_eq!(
                    used.1,
                    held[at + 1],
                    "{units} differs from its reservations"
                );
            }
            if within {
                pairs[1].check_within(keys(Hold::Running));
            }
            assert!(submit.within_burst(), "submit bucket above its burst");
        };
        for (slot, t) in self.tenants.iter().enumerate() {
            let pairs = [&t.gates, &t.running];
            owned(pairs, &|h| t.keys(h), &t.submit_rate, tenant_held[slot]);
            assert_eq!(
                t.cost_burst_milli,
                t.cost_per_minute.rate().burst,
                "tenant {} admission copy of its cost burst drifted",
                t.id
            );
            assert!(
                t.cost_per_minute.within_burst(),
                "tenant {} cost bucket above its burst",
                t.id
            );
            assert_eq!(
                t.cost_reserved_milli(),
                reserved[slot],
                "tenant {} cost reservation drifted",
                t.id
            );
        }
        for (slot, u) in self.users.iter().enumerate() {
            let pairs = [&u.gates, &u.running];
            owned(pairs, &|h| u.keys(h), &u.submit_rate, user_held[slot]);
        }
        self.estimates.check_invariants(&holders);
        self.check_queues(&lane_tasks, &lane_units, &lane_running);
    }

    /// Lanes, rings and every tenant queue against the counts taken from the tasks.
    fn check_queues(
        &self,
        lane_tasks: &[u64; Lane::COUNT],
        lane_units: &[u64; Lane::COUNT],
        lane_running: &[u64; Lane::COUNT],
    ) {
        let bands = Bands {
            tasks: &self.tasks,
            estimates: &self.estimates,
        };
        let cap =
            self.policy.drr.base_quantum.milli() as i64 * i64::from(self.policy.drr.burst_rounds);
        let mut ringed = [0usize; Lane::COUNT];
        for (slot, t) in self.tenants.iter().enumerate() {
            for (lane, q) in t.queues() {
                q.check_invariants(&bands);
                for band in Band::ALL {
                    for s in q.band(&bands, band) {
                        let e = self.tasks.at(s);
                        assert_eq!(e.place, Place::Band, "a listed task out of its band");
                        assert_eq!(
                            (e.tenant_slot as usize, e.lane, e.band),
                            (slot, lane, band),
                            "task {} listed in another tenant's, lane's or band's queue",
                            self.tasks.id_at(s)
                        );
                    }
                }
                assert_eq!(q.in_ring, !q.is_empty(), "tenant {} ring flag", t.id);
                ringed[lane.index()] += usize::from(q.in_ring);
                assert!(
                    q.deficit <= cap * i64::from(t.weight),
                    "deficit above its cap"
                );
            }
        }
        for lane in Lane::ALL {
            let rt = &self.lanes[lane.index()];
            assert_eq!(
                rt.queued_tasks,
                lane_tasks[lane.index()],
                "{lane} queued tasks drifted"
            );
            assert_eq!(
                rt.queued_units_milli,
                lane_units[lane.index()],
                "{lane} queued units drifted"
            );
            assert_eq!(
                rt.running_tasks,
                lane_running[lane.index()],
                "{lane} running tasks drifted"
            );
            let mut weight = 0;
            for &slot in &rt.ring {
                let t = &self.tenants[slot as usize];
                let q = t.queue(lane).expect("ringed queue");
                assert!(q.in_ring && !q.is_empty(), "ring holds an idle tenant");
                weight += u64::from(t.weight);
            }
            assert_eq!(weight, rt.backlog_weight, "{lane} backlog weight drifted");
            assert_eq!(ringed[lane.index()], rt.ring.len(), "{lane} ring length");
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum End {
    Back,
    Front,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    const LINE: usize = 64;

    fn line_of(offset: usize) -> usize {
        offset / LINE
    }

    /// The lines an admission reads of a tenant (0–2) and of a user (0–1) stay where the
    /// records' comments say; a field added in the wrong place fails here, not in a bench.
    #[test]
    fn owner_records_keep_their_cache_lines() {
        assert_eq!(size_of::<TenantRt>(), 5 * LINE);
        let admission = [
            offset_of!(TenantRt, submit_rate),
            offset_of!(TenantRt, submit_rate) + size_of::<SubmitBucket>() - 1,
            offset_of!(TenantRt, gates),
            offset_of!(TenantRt, weight),
            offset_of!(TenantRt, max_wait_ms),
            offset_of!(TenantRt, cost_room_milli),
            offset_of!(TenantRt, cost_burst_milli),
            offset_of!(TenantRt, lane),
            offset_of!(TenantRt, base_band),
            offset_of!(TenantRt, wait_overflow),
            offset_of!(TenantRt, classes),
            offset_of!(TenantRt, home_lane),
            offset_of!(TenantRt, home) + TenantQueue::APPEND_BYTES - 1,
        ];
        for offset in admission {
            assert!(line_of(offset) <= 1, "admission field at {offset}");
        }
        let cost = offset_of!(TenantRt, cost_per_minute);
        assert_eq!(
            (line_of(cost), line_of(cost + size_of::<TokenBucket>() - 1)),
            (3, 3)
        );
        assert_eq!(line_of(offset_of!(TenantRt, running)), 4);

        assert_eq!(size_of::<UserRt>(), 2 * LINE);
        assert_eq!(offset_of!(UserRt, gates) + size_of::<OwnedPair>(), LINE);
        assert_eq!(offset_of!(UserRt, running), LINE);
    }
}
