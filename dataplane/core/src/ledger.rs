//! Every limit of design.md §4 as a non-blocking, all-or-nothing try-acquire in a fixed order.
//!
//! A [`Ledger`] holds semaphores (concurrency, running units, queued counts) and token buckets
//! (submit rates, RPM, cost per minute), each behind a dense [`LimitId`]. A [`Demand`] lists the
//! ids a step needs, sorted by id: that sort is the one global acquisition order. `try_acquire`
//! checks every entry and changes nothing unless all fit; it never waits.

use std::fmt;

use serde::Serialize;

use crate::ids::{Lane, ModelId, ProviderId, TenantId, UserId};
use crate::limits::DEMAND_KEYS_MAX;
use crate::policy::RateSpec;
use crate::time::{Time, NANOS_PER_S};

/// A limit in a ledger: the top bit says token bucket, the rest indexes its vector. Ids order
/// every semaphore before every bucket, each kind in registration order: the acquisition order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LimitId(pub u32);

const BUCKET_BIT: u32 = 1 << 31;

impl LimitId {
    fn bucket(index: usize) -> LimitId {
        LimitId(BUCKET_BIT | u32::try_from(index).expect("ledger holds < 2^31 buckets"))
    }

    fn semaphore(index: usize) -> LimitId {
        let index = u32::try_from(index).expect("ledger holds < 2^31 semaphores");
        assert!(index < BUCKET_BIT, "ledger holds < 2^31 semaphores");
        LimitId(index)
    }

    fn index(self) -> usize {
        (self.0 & !BUCKET_BIT) as usize
    }

    /// The index of a semaphore among the ledger's semaphores; `None` for a bucket.
    pub fn semaphore_index(self) -> Option<usize> {
        (self.0 & BUCKET_BIT == 0).then_some(self.0 as usize)
    }
}

/// What a limit guards: used in rejection reasons, reports and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum LimitKey {
    UserSubmitRate(UserId),
    TenantSubmitRate(TenantId),
    UserQueuedTasks(UserId),
    UserQueuedUnits(UserId),
    TenantQueuedTasks(TenantId),
    TenantQueuedUnits(TenantId),
    LaneQueuedTasks(Lane),
    LaneQueuedUnits(Lane),
    GlobalQueuedTasks,
    GlobalQueuedUnits,
    UserRunningTasks(UserId),
    UserRunningUnits(UserId),
    TenantRunningTasks(TenantId),
    TenantRunningUnits(TenantId),
    LaneUnits(Lane),
    EnterpriseBorrowed,
    LaneRunningTasks(Lane),
    ModelRunning(ModelId),
    ModelRunningUnits(ModelId),
    GlobalRunningTasks,
    GlobalRunningUnits,
    ProviderConcurrency(ProviderId),
    ProviderRpm(ProviderId),
    HighCostConcurrency,
    TenantCostPerMinute(TenantId),
    PlatformCostPerMinute,
    GpuUnits,
    GpuMemMb,
    CpuUnits,
    TempDiskMb,
    /// A lane's own cost budget ([`crate::policy::LanePolicy::cost_per_minute`]).
    LaneCostPerMinute(Lane),
    /// A lane's own media workers ([`crate::policy::LanePolicy::media_workers`]).
    LaneMediaWorkers(Lane),
    /// The media workers the lanes without their own share.
    SharedMediaWorkers,
}

/// Who a limit is shared by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Owned by one shard (its tenants and users live only there).
    Shard,
    /// Node-wide: shards hold a share set by the split rule.
    Node,
}

/// Whether a limit bounds running work (must never be exceeded) or gates new admissions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Runtime,
    /// Queue gates refuse new work when full; work already accepted that comes back to the queue
    /// (a retry) re-enters even past the gate, because dropping an accepted task would be loss.
    AdmissionGate,
}

impl LimitKey {
    pub fn scope(self) -> Scope {
        match self {
            LimitKey::UserSubmitRate(_)
            | LimitKey::TenantSubmitRate(_)
            | LimitKey::UserQueuedTasks(_)
            | LimitKey::UserQueuedUnits(_)
            | LimitKey::TenantQueuedTasks(_)
            | LimitKey::TenantQueuedUnits(_)
            | LimitKey::UserRunningTasks(_)
            | LimitKey::UserRunningUnits(_)
            | LimitKey::TenantRunningTasks(_)
            | LimitKey::TenantRunningUnits(_)
            | LimitKey::TenantCostPerMinute(_) => Scope::Shard,
            _ => Scope::Node,
        }
    }

    pub fn role(self) -> Role {
        match self {
            LimitKey::UserQueuedTasks(_)
            | LimitKey::UserQueuedUnits(_)
            | LimitKey::TenantQueuedTasks(_)
            | LimitKey::TenantQueuedUnits(_)
            | LimitKey::LaneQueuedTasks(_)
            | LimitKey::LaneQueuedUnits(_)
            | LimitKey::GlobalQueuedTasks
            | LimitKey::GlobalQueuedUnits => Role::AdmissionGate,
            _ => Role::Runtime,
        }
    }
}

impl fmt::Display for LimitKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitKey::UserSubmitRate(u) => write!(f, "user:{u}:submit_rate"),
            LimitKey::TenantSubmitRate(t) => write!(f, "tenant:{t}:submit_rate"),
            LimitKey::UserQueuedTasks(u) => write!(f, "user:{u}:queued_tasks"),
            LimitKey::UserQueuedUnits(u) => write!(f, "user:{u}:queued_units"),
            LimitKey::TenantQueuedTasks(t) => write!(f, "tenant:{t}:queued_tasks"),
            LimitKey::TenantQueuedUnits(t) => write!(f, "tenant:{t}:queued_units"),
            LimitKey::LaneQueuedTasks(l) => write!(f, "lane:{l}:queued_tasks"),
            LimitKey::LaneQueuedUnits(l) => write!(f, "lane:{l}:queued_units"),
            LimitKey::GlobalQueuedTasks => write!(f, "global:queued_tasks"),
            LimitKey::GlobalQueuedUnits => write!(f, "global:queued_units"),
            LimitKey::UserRunningTasks(u) => write!(f, "user:{u}:running_tasks"),
            LimitKey::UserRunningUnits(u) => write!(f, "user:{u}:running_units"),
            LimitKey::TenantRunningTasks(t) => write!(f, "tenant:{t}:running_tasks"),
            LimitKey::TenantRunningUnits(t) => write!(f, "tenant:{t}:running_units"),
            LimitKey::LaneUnits(l) => write!(f, "lane:{l}:running_units"),
            LimitKey::EnterpriseBorrowed => write!(f, "lane:ENTERPRISE_RESERVED:borrowed_units"),
            LimitKey::ModelRunning(m) => write!(f, "model:{m}:running"),
            LimitKey::LaneRunningTasks(l) => write!(f, "lane:{l}:running_tasks"),
            LimitKey::ModelRunningUnits(m) => write!(f, "model:{m}:running_units"),
            LimitKey::GlobalRunningTasks => write!(f, "global:running_tasks"),
            LimitKey::GlobalRunningUnits => write!(f, "global:running_units"),
            LimitKey::ProviderConcurrency(p) => write!(f, "provider:{p}:concurrency"),
            LimitKey::ProviderRpm(p) => write!(f, "provider:{p}:rpm"),
            LimitKey::HighCostConcurrency => write!(f, "high_cost:concurrency"),
            LimitKey::TenantCostPerMinute(t) => write!(f, "tenant:{t}:cost_per_minute"),
            LimitKey::PlatformCostPerMinute => write!(f, "platform:cost_per_minute"),
            LimitKey::GpuUnits => write!(f, "media:gpu_units"),
            LimitKey::GpuMemMb => write!(f, "media:gpu_mem_mb"),
            LimitKey::CpuUnits => write!(f, "media:cpu_units"),
            LimitKey::TempDiskMb => write!(f, "media:temp_disk_mb"),
            LimitKey::LaneCostPerMinute(l) => write!(f, "lane:{l}:cost_per_minute"),
            LimitKey::LaneMediaWorkers(l) => write!(f, "lane:{l}:media_workers"),
            LimitKey::SharedMediaWorkers => write!(f, "media:shared_workers"),
        }
    }
}

/// Nanoseconds in a rate window: RPM and cost budgets are per minute.
pub const WINDOW_NS: u64 = 60 * NANOS_PER_S;
/// A rate-limit signal halves the bucket's rate for this many windows (seed 003).
pub const PENALTY_WINDOWS: u64 = 2;

/// A token bucket kept in exact integer arithmetic. `level` is tokens × `WINDOW_NS`, so a refill
/// of `elapsed_ns × per_minute` is exact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    rate: RateSpec,
    level: u128,
    refilled_at: Time,
    penalty_until: Time,
    /// `rate.burst × WINDOW_NS`: the most `level` holds (kept, not recomputed at every refill).
    cap: u128,
}

impl TokenBucket {
    pub fn new(rate: RateSpec, now: Time) -> TokenBucket {
        let cap = u128::from(rate.burst) * u128::from(WINDOW_NS);
        TokenBucket {
            rate,
            level: cap,
            refilled_at: now,
            penalty_until: Time::ZERO,
            cap,
        }
    }

    fn cap(&self) -> u128 {
        self.cap
    }

    pub fn refill(&mut self, now: Time) {
        if now <= self.refilled_at {
            return;
        }
        let gained = if self.penalty_until <= self.refilled_at {
            // No penalty in the elapsed time (nearly always): full rate throughout.
            u128::from(now.since(self.refilled_at)) * u128::from(self.rate.per_minute)
        } else {
            // Split the elapsed time at the end of a penalty: half rate before, full after.
            let penalized_until = self.penalty_until.min(now);
            let slow_ns = penalized_until.since(self.refilled_at);
            let fast_ns = now.since(penalized_until);
            u128::from(slow_ns) * u128::from(self.rate.per_minute / 2)
                + u128::from(fast_ns) * u128::from(self.rate.per_minute)
        };
        self.level = (self.level + gained).min(self.cap());
        self.refilled_at = now;
    }

    pub fn tokens(&self) -> u64 {
        (self.level / u128::from(WINDOW_NS)) as u64
    }

    fn fits(&self, tokens: u64) -> bool {
        u128::from(tokens) * u128::from(WINDOW_NS) <= self.level
    }

    fn take(&mut self, tokens: u64) {
        let need = u128::from(tokens) * u128::from(WINDOW_NS);
        assert!(
            need <= self.level,
            "taking {tokens} tokens from a bucket without them"
        );
        self.level -= need;
    }

    pub(crate) fn refund(&mut self, tokens: u64) {
        self.level = (self.level + u128::from(tokens) * u128::from(WINDOW_NS)).min(self.cap());
    }

    /// Takes `tokens` if the bucket holds them now; changes nothing else otherwise. Zero always
    /// fits and refills nothing (a demand never lists a zero need).
    #[inline]
    pub fn try_take(&mut self, tokens: u64, now: Time) -> bool {
        if tokens == 0 {
            return true;
        }
        self.refill(now);
        let fits = self.fits(tokens);
        if fits {
            self.take(tokens);
        }
        fits
    }

    /// Takes one token if the bucket holds it at `now`; otherwise the nanoseconds until it
    /// will at the current rate (`u64::MAX` at a rate of zero, or a burst of zero): for a
    /// caller that waits for its token (the node's send pacing) rather than asking again.
    pub fn take_one(&mut self, now: Time) -> Result<(), u64> {
        self.refill(now);
        if self.fits(1) {
            self.take(1);
            return Ok(());
        }
        let per_minute = if self.is_penalized(now) {
            self.rate.per_minute / 2
        } else {
            self.rate.per_minute
        };
        if per_minute == 0 || self.cap < u128::from(WINDOW_NS) {
            return Err(u64::MAX);
        }
        let missing = u128::from(WINDOW_NS) - self.level;
        Err(u64::try_from(missing.div_ceil(u128::from(per_minute))).unwrap_or(u64::MAX))
    }

    /// Whether the stored tokens are within the burst (the bucket's invariant).
    pub(crate) fn within_burst(&self) -> bool {
        self.level <= self.cap()
    }

    pub fn penalize(&mut self, now: Time) {
        self.refill(now);
        self.penalty_until = now.plus_ns(PENALTY_WINDOWS * WINDOW_NS);
    }

    pub fn is_penalized(&self, now: Time) -> bool {
        now < self.penalty_until
    }

    pub fn rate(&self) -> RateSpec {
        self.rate
    }

    /// Empties the bucket at `now`: it refills from nothing (the node's tenant breaker, once
    /// it trips).
    pub fn drain(&mut self, now: Time) {
        self.refill(now);
        self.level = 0;
    }

    /// Tops the bucket up to its burst, as a new bucket starts.
    pub fn fill(&mut self, now: Time) {
        self.refill(now);
        self.level = self.cap;
    }

    /// Changes rate and burst (a new share of a node-wide budget); stored tokens above the new
    /// burst are dropped, never created.
    pub fn set_rate(&mut self, rate: RateSpec, now: Time) {
        self.refill(now);
        self.rate = rate;
        self.cap = u128::from(rate.burst) * u128::from(WINDOW_NS);
        self.level = self.level.min(self.cap);
    }
}

/// The largest submit burst an owner's submit bucket keeps exactly: its level, tokens ×
/// `WINDOW_NS`, is 64 bits. 307 million submits, more than a shard can hold queued many times
/// over.
pub const SUBMIT_BURST_MAX: u64 = u64::MAX / WINDOW_NS;

/// An owner's submit-rate bucket: a [`TokenBucket`] without the penalty (only node buckets are
/// penalized) and with a 64-bit level, in 32 bytes, so that a user's bucket and gates share one
/// cache line. Exact for bursts up to [`SUBMIT_BURST_MAX`]; a larger burst (the presets'
/// unlimited rate) is held at that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SubmitBucket {
    per_minute: u64,
    /// The burst × `WINDOW_NS`.
    cap: u64,
    level: u64,
    refilled_at: Time,
}

impl SubmitBucket {
    pub(crate) fn new(rate: RateSpec, now: Time) -> SubmitBucket {
        let cap = rate.burst.min(SUBMIT_BURST_MAX) * WINDOW_NS;
        SubmitBucket {
            per_minute: rate.per_minute,
            cap,
            level: cap,
            refilled_at: now,
        }
    }

    fn refill(&mut self, now: Time) {
        if now <= self.refilled_at {
            return;
        }
        let gained = u128::from(now.since(self.refilled_at)) * u128::from(self.per_minute);
        // At most `cap`, which is a u64.
        self.level = (u128::from(self.level) + gained).min(u128::from(self.cap)) as u64;
        self.refilled_at = now;
    }

    /// Takes one token if the bucket holds it now; changes nothing else otherwise.
    #[inline]
    pub(crate) fn try_take_one(&mut self, now: Time) -> bool {
        self.refill(now);
        match self.level.checked_sub(WINDOW_NS) {
            Some(left) => {
                self.level = left;
                true
            }
            None => false,
        }
    }

    /// How long until the next token, as last refilled; `None` at a rate of zero.
    pub(crate) fn wait_ns(&self) -> Option<u64> {
        let missing = WINDOW_NS.saturating_sub(self.level);
        (self.per_minute > 0).then(|| missing.div_ceil(self.per_minute))
    }

    /// Whether the bucket is full at `now` (refilled): forgetting it would give nothing back.
    pub(crate) fn is_full(&mut self, now: Time) -> bool {
        self.refill(now);
        self.level >= self.cap
    }

    pub(crate) fn refund_one(&mut self) {
        self.level = self.level.saturating_add(WINDOW_NS).min(self.cap);
    }

    #[cfg(test)]
    pub(crate) fn tokens(&self) -> u64 {
        self.level / WINDOW_NS
    }

    /// Changes rate and burst; stored tokens above the new burst are dropped, never created.
    pub(crate) fn set_rate(&mut self, rate: RateSpec, now: Time) {
        self.refill(now);
        self.per_minute = rate.per_minute;
        self.cap = rate.burst.min(SUBMIT_BURST_MAX) * WINDOW_NS;
        self.level = self.level.min(self.cap);
    }

    /// Whether the stored tokens are within the burst (the bucket's invariant).
    pub(crate) fn within_burst(&self) -> bool {
        self.level <= self.cap
    }
}

/// A counting semaphore: 16 bytes, so an owner's semaphores share cache lines. Node limits keep
/// theirs in the [`Ledger`]; tenants and users keep theirs inline in their own records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Semaphore {
    pub capacity: u64,
    pub used: u64,
}

impl Semaphore {
    pub(crate) fn new(capacity: u64) -> Semaphore {
        Semaphore { capacity, used: 0 }
    }

    /// Takes `amount` if it fits under the capacity; changes nothing otherwise. Zero always
    /// fits (a demand never lists a zero need).
    #[inline]
    pub(crate) fn try_take(&mut self, amount: u64) -> bool {
        if amount == 0 {
            return true;
        }
        match self.used.checked_add(amount) {
            Some(after) if after <= self.capacity => {
                self.used = after;
                true
            }
            _ => false,
        }
    }

    /// Takes `amount` past the capacity: admission gates re-entered by accepted work, running
    /// work resumed after a restart.
    pub(crate) fn force(&mut self, amount: u64) {
        self.used += amount;
    }

    /// Gives back `amount`; below zero is a double release, a bug, named by `key`.
    #[inline]
    pub(crate) fn release(&mut self, amount: u64, key: impl Fn() -> LimitKey) {
        self.used = self.used.checked_sub(amount).unwrap_or_else(|| {
            panic!(
                "release of {amount} below zero on {}: double release",
                key()
            )
        });
    }
}

/// One entry of a demand: the limit and how much of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    pub id: LimitId,
    amount: u32,
}

impl Need {
    /// One entry of a fixed, id-ordered list of needs (a short demand built in place).
    pub fn new(id: LimitId, amount: u64) -> Need {
        let amount = u32::try_from(amount).expect("one task's demand of a limit fits in 32 bits");
        Need { id, amount }
    }

    pub fn amount(self) -> u64 {
        u64::from(self.amount)
    }
}

/// The limits one step needs, sorted by id (the global acquisition order), at most
/// [`DEMAND_KEYS_MAX`] of them, each id once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demand {
    needs: [Need; DEMAND_KEYS_MAX],
    len: u8,
}

impl Default for Demand {
    fn default() -> Self {
        Demand {
            needs: [Need {
                id: LimitId(0),
                amount: 0,
            }; DEMAND_KEYS_MAX],
            len: 0,
        }
    }
}

impl Demand {
    /// Adds `amount` of `id`; zero amounts are skipped, a repeated id adds up. One task's
    /// amount of any limit fits in 32 bits (specs are bounded by `limits.rs`).
    #[inline]
    pub fn add(&mut self, id: LimitId, amount: u64) {
        if amount == 0 {
            return;
        }
        let amount = u32::try_from(amount).expect("one task's demand of a limit fits in 32 bits");
        let len = usize::from(self.len);
        // Builders add in id order: appending is the common case.
        if len < DEMAND_KEYS_MAX && (len == 0 || self.needs[len - 1].id < id) {
            self.needs[len] = Need { id, amount };
            self.len += 1;
            return;
        }
        self.insert(id, amount);
    }

    #[cold]
    fn insert(&mut self, id: LimitId, amount: u32) {
        let len = usize::from(self.len);
        let pos = self.needs[..len].partition_point(|n| n.id < id);
        if pos < len && self.needs[pos].id == id {
            self.needs[pos].amount += amount;
            return;
        }
        assert!(
            len < DEMAND_KEYS_MAX,
            "a demand holds at most {DEMAND_KEYS_MAX} limits"
        );
        self.needs.copy_within(pos..len, pos + 1);
        self.needs[pos] = Need { id, amount };
        self.len += 1;
    }

    pub fn needs(&self) -> &[Need] {
        &self.needs[..usize::from(self.len)]
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// All limits of one shard.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    semaphores: Vec<Semaphore>,
    semaphore_keys: Vec<LimitKey>,
    buckets: Vec<TokenBucket>,
    bucket_keys: Vec<LimitKey>,
}

impl Ledger {
    pub fn new() -> Ledger {
        Ledger::default()
    }

    pub fn len(&self) -> usize {
        self.semaphores.len() + self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn semaphore_count(&self) -> usize {
        self.semaphores.len()
    }

    pub fn add_semaphore(&mut self, key: LimitKey, capacity: u64) -> LimitId {
        self.semaphores.push(Semaphore { capacity, used: 0 });
        self.semaphore_keys.push(key);
        LimitId::semaphore(self.semaphores.len() - 1)
    }

    pub fn add_bucket(&mut self, key: LimitKey, rate: RateSpec, now: Time) -> LimitId {
        self.buckets.push(TokenBucket::new(rate, now));
        self.bucket_keys.push(key);
        LimitId::bucket(self.buckets.len() - 1)
    }

    pub fn key(&self, id: LimitId) -> LimitKey {
        match id.semaphore_index() {
            Some(i) => self.semaphore_keys[i],
            None => self.bucket_keys[id.index()],
        }
    }

    /// Every limit, semaphores first, in acquisition order.
    pub fn ids(&self) -> impl Iterator<Item = (LimitId, LimitKey)> + '_ {
        let sems = self
            .semaphore_keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (LimitId::semaphore(i), k));
        let buckets = self
            .bucket_keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (LimitId::bucket(i), k));
        sems.chain(buckets)
    }

    /// Semaphore usage; bucket ids report 0.
    pub fn used(&self, id: LimitId) -> u64 {
        id.semaphore_index().map_or(0, |i| self.semaphores[i].used)
    }

    /// Semaphore capacity, or a bucket's burst.
    pub fn capacity(&self, id: LimitId) -> u64 {
        match id.semaphore_index() {
            Some(i) => self.semaphores[i].capacity,
            None => self.buckets[id.index()].rate.burst,
        }
    }

    /// A bucket's rate; `None` for a semaphore.
    pub fn rate(&self, id: LimitId) -> Option<RateSpec> {
        id.semaphore_index()
            .is_none()
            .then(|| self.buckets[id.index()].rate)
    }

    /// Free semaphore units (zero when over capacity after a share shrank), or whole tokens.
    pub fn free(&self, id: LimitId) -> u64 {
        match id.semaphore_index() {
            Some(i) => self.semaphores[i]
                .capacity
                .saturating_sub(self.semaphores[i].used),
            None => self.buckets[id.index()].tokens(),
        }
    }

    fn fits(&mut self, need: Need, now: Time) -> bool {
        match need.id.semaphore_index() {
            Some(i) => {
                let s = self.semaphores[i];
                s.used
                    .checked_add(need.amount())
                    .is_some_and(|after| after <= s.capacity)
            }
            None => {
                let bucket = &mut self.buckets[need.id.index()];
                bucket.refill(now);
                bucket.fits(need.amount())
            }
        }
    }

    /// Takes one need if it fits; changes nothing otherwise (a bucket is refilled either way,
    /// which only brings it up to date).
    #[inline]
    fn take(&mut self, need: Need, now: Time) -> bool {
        match need.id.semaphore_index() {
            Some(i) => self.semaphores[i].try_take(need.amount()),
            None => self.buckets[need.id.index()].try_take(need.amount(), now),
        }
    }

    /// Whether every need of `demand` would fit now, without taking anything.
    pub fn check(&mut self, demand: &Demand, now: Time) -> Result<(), LimitId> {
        for &need in demand.needs() {
            if !self.fits(need, now) {
                return Err(need.id);
            }
        }
        Ok(())
    }

    /// Acquires every need of `demand` or none. On refusal returns the first limit, in the fixed
    /// order, that did not fit.
    ///
    /// Needs are taken one by one and, on the first refusal, the ones already taken are given
    /// back: one pass in the common case instead of a check pass and a take pass. Giving back is
    /// exact (a bucket's level after a take plus the same tokens is the level before, never above
    /// its burst), so nothing observable differs from checking first.
    pub fn try_acquire(&mut self, demand: &Demand, now: Time) -> Result<(), LimitId> {
        self.try_acquire_needs(demand.needs(), now)
    }

    /// [`Ledger::try_acquire`] over a part of a demand (its semaphores, or its buckets).
    pub(crate) fn try_acquire_needs(&mut self, needs: &[Need], now: Time) -> Result<(), LimitId> {
        for (taken, &need) in needs.iter().enumerate() {
            if !self.take(need, now) {
                self.give_back(&needs[..taken]);
                return Err(need.id);
            }
        }
        Ok(())
    }

    /// [`Ledger::try_acquire_needs`] for needs that are all semaphores (a provider stage's, the
    /// queue gates): no bucket to tell apart, and a zero need is an add of nothing, so the loop
    /// is a compare and a store per limit. A bucket among them panics (its index is out of the
    /// semaphores' range).
    #[inline]
    pub(crate) fn try_acquire_semaphores(&mut self, needs: &[Need]) -> Result<(), LimitId> {
        for (taken, need) in needs.iter().enumerate() {
            debug_assert!(
                need.id.semaphore_index().is_some(),
                "{:?} is a bucket",
                need.id
            );
            let sem = &mut self.semaphores[need.id.0 as usize];
            match sem.used.checked_add(need.amount()) {
                Some(after) if after <= sem.capacity => sem.used = after,
                _ => {
                    self.give_back(&needs[..taken]);
                    return Err(need.id);
                }
            }
        }
        Ok(())
    }

    /// [`Ledger::release_needs`] for needs that are all semaphores.
    #[inline]
    pub(crate) fn release_semaphores(&mut self, needs: &[Need]) {
        for need in needs {
            debug_assert!(
                need.id.semaphore_index().is_some(),
                "{:?} is a bucket",
                need.id
            );
            let i = need.id.0 as usize;
            let keys = &self.semaphore_keys;
            self.semaphores[i].release(need.amount(), || keys[i]);
        }
    }

    /// Undoes the takes of a refused acquisition — or of one whose later part, in limits kept
    /// outside the ledger, was refused: semaphore units and bucket tokens both.
    #[cold]
    pub(crate) fn give_back(&mut self, needs: &[Need]) {
        for &need in needs {
            match need.id.semaphore_index() {
                Some(i) => self.semaphores[i].used -= need.amount(),
                None => self.buckets[need.id.index()].refund(need.amount()),
            }
        }
    }

    /// Takes semaphore units past capacity: only for admission gates re-entered by work that was
    /// already accepted (see [`Role::AdmissionGate`]). Buckets in the demand are not touched.
    pub fn force_acquire_gates(&mut self, demand: &Demand) {
        self.force_acquire_gate_needs(demand.needs());
    }

    pub(crate) fn force_acquire_gate_needs(&mut self, needs: &[Need]) {
        for &need in needs {
            assert_eq!(
                self.key(need.id).role(),
                Role::AdmissionGate,
                "only gates may be forced"
            );
            if let Some(i) = need.id.semaphore_index() {
                self.semaphores[i].force(need.amount());
            }
        }
    }

    /// Takes semaphore units past capacity for running work that came back (a resumed attempt,
    /// see [`crate::shard::Shard::handle_resume`]): it runs whether or not it fits.
    pub(crate) fn force_acquire_running(&mut self, needs: &[Need]) {
        for &need in needs {
            if let Some(i) = need.id.semaphore_index() {
                self.semaphores[i].force(need.amount());
            }
        }
    }

    /// Gives back the semaphore units of `demand`. Bucket tokens were spent and stay spent.
    pub fn release(&mut self, demand: &Demand) {
        self.release_needs(demand.needs());
    }

    pub(crate) fn release_needs(&mut self, needs: &[Need]) {
        for &need in needs {
            if let Some(i) = need.id.semaphore_index() {
                let keys = &self.semaphore_keys;
                self.semaphores[i].release(need.amount(), || keys[i]);
            }
        }
    }

    /// Puts tokens back into a bucket (a request provably not accepted is not billed).
    pub fn refund(&mut self, id: LimitId, tokens: u64) {
        if id.semaphore_index().is_none() {
            self.buckets[id.index()].refund(tokens);
        }
    }

    pub fn penalize(&mut self, id: LimitId, now: Time) {
        if id.semaphore_index().is_none() {
            self.buckets[id.index()].penalize(now);
        }
    }

    pub fn is_penalized(&self, id: LimitId, now: Time) -> bool {
        id.semaphore_index().is_none() && self.buckets[id.index()].is_penalized(now)
    }

    /// Sets a semaphore's capacity (this shard's share of a node-wide limit).
    pub fn set_capacity(&mut self, id: LimitId, capacity: u64) {
        if let Some(i) = id.semaphore_index() {
            self.semaphores[i].capacity = capacity;
        }
    }

    pub fn set_rate(&mut self, id: LimitId, rate: RateSpec, now: Time) {
        if id.semaphore_index().is_none() {
            self.buckets[id.index()].set_rate(rate, now);
        }
    }

    /// Tops bucket `id` up to its burst (a bucket that starts only once it is given a rate).
    pub fn fill(&mut self, id: LimitId, now: Time) {
        if id.semaphore_index().is_none() {
            self.buckets[id.index()].fill(now);
        }
    }

    /// Every semaphore with its usage, for invariant checks.
    pub fn semaphores(&self) -> impl Iterator<Item = (LimitId, LimitKey, u64)> + '_ {
        self.semaphores
            .iter()
            .zip(&self.semaphore_keys)
            .enumerate()
            .map(|(i, (s, &k))| (LimitId::semaphore(i), k, s.used))
    }

    /// Runtime semaphores never exceed capacity (unless `within` is false: resumed work was
    /// taken past it); gates only through forced re-entry.
    pub fn check_invariants(&self, within: bool) {
        for (s, key) in self.semaphores.iter().zip(&self.semaphore_keys) {
            if within && key.role() == Role::Runtime {
                assert!(
                    s.used <= s.capacity,
                    "{key} used {} above capacity {}",
                    s.used,
                    s.capacity
                );
            }
        }
        for (b, key) in self.buckets.iter().zip(&self.bucket_keys) {
            assert!(b.within_burst(), "{key} bucket above its burst");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_or_nothing_reports_first_refusal_in_order() {
        let mut ledger = Ledger::new();
        let a = ledger.add_semaphore(LimitKey::GpuUnits, 2);
        let b = ledger.add_semaphore(LimitKey::CpuUnits, 1);
        let mut demand = Demand::default();
        demand.add(b, 2);
        demand.add(a, 1);
        assert_eq!(ledger.try_acquire(&demand, Time::ZERO), Err(b));
        assert_eq!(ledger.used(a), 0, "a refused demand takes nothing");
        let mut small = Demand::default();
        small.add(a, 2);
        small.add(b, 1);
        ledger.try_acquire(&small, Time::ZERO).unwrap();
        ledger.release(&small);
        assert_eq!((ledger.used(a), ledger.used(b)), (0, 0));
    }

    #[test]
    fn a_refused_demand_gives_back_what_it_took_before_the_refusal() {
        let mut ledger = Ledger::new();
        let sem = ledger.add_semaphore(LimitKey::GpuUnits, 5);
        let rate = |burst| RateSpec {
            per_minute: 60,
            burst,
        };
        let rich = ledger.add_bucket(LimitKey::PlatformCostPerMinute, rate(10), Time::ZERO);
        let poor = ledger.add_bucket(LimitKey::ProviderRpm(ProviderId(0)), rate(1), Time::ZERO);
        let mut demand = Demand::default();
        demand.add(sem, 3);
        demand.add(rich, 4);
        demand.add(poor, 2);
        assert_eq!(ledger.try_acquire(&demand, Time::ZERO), Err(poor));
        assert_eq!(
            ledger.used(sem),
            0,
            "the semaphore taken first is given back"
        );
        assert_eq!(
            ledger.free(rich),
            10,
            "the bucket taken first is refilled exactly"
        );
        assert_eq!(ledger.free(poor), 1);
        ledger.check_invariants(true);
    }

    #[test]
    fn bucket_refills_exactly_and_penalty_halves_rate() {
        let mut ledger = Ledger::new();
        let rpm = ledger.add_bucket(
            LimitKey::ProviderRpm(ProviderId(0)),
            RateSpec {
                per_minute: 60,
                burst: 2,
            },
            Time::ZERO,
        );
        let mut one = Demand::default();
        one.add(rpm, 1);
        ledger.try_acquire(&one, Time::ZERO).unwrap();
        ledger.try_acquire(&one, Time::ZERO).unwrap();
        assert_eq!(ledger.try_acquire(&one, Time::ZERO), Err(rpm));
        // One token a second at 60/min.
        assert_eq!(ledger.try_acquire(&one, Time::from_ms(999)), Err(rpm));
        ledger.try_acquire(&one, Time::from_ms(1000)).unwrap();
        ledger.penalize(rpm, Time::from_ms(1000));
        // Penalized: 30/min, so one token takes two seconds.
        assert_eq!(ledger.try_acquire(&one, Time::from_ms(2999)), Err(rpm));
        ledger.try_acquire(&one, Time::from_ms(3000)).unwrap();
        assert!(ledger.is_penalized(rpm, Time::from_secs(120)));
        assert!(!ledger.is_penalized(rpm, Time::from_secs(121)));
    }

    #[test]
    fn take_one_says_how_long_until_the_next_token_and_a_drained_bucket_starts_empty() {
        let rate = |per_minute, burst| RateSpec { per_minute, burst };
        let mut b = TokenBucket::new(rate(60, 2), Time::ZERO);
        assert_eq!(b.take_one(Time::ZERO), Ok(()));
        assert_eq!(b.take_one(Time::ZERO), Ok(()));
        // One token a second at 60/min: a second to wait, then 250 ms of it left.
        assert_eq!(b.take_one(Time::ZERO), Err(NANOS_PER_S));
        assert_eq!(b.take_one(Time::from_ms(750)), Err(250 * 1_000_000));
        assert_eq!(b.take_one(Time::from_ms(1_000)), Ok(()));
        // Penalized, it counts at half the rate.
        b.penalize(Time::from_ms(1_000));
        assert_eq!(b.take_one(Time::from_ms(1_000)), Err(2 * NANOS_PER_S));
        // Drained, it refills from nothing.
        let mut full = TokenBucket::new(rate(60, 5), Time::ZERO);
        full.drain(Time::ZERO);
        assert_eq!(full.take_one(Time::ZERO), Err(NANOS_PER_S));
        assert_eq!(full.take_one(Time::from_secs(1)), Ok(()));
        // A rate or a burst of zero never gives one.
        let mut none = TokenBucket::new(rate(0, 1), Time::ZERO);
        assert_eq!(none.take_one(Time::ZERO), Ok(()));
        assert_eq!(none.take_one(Time::from_secs(5)), Err(u64::MAX));
        let mut flat = TokenBucket::new(rate(60, 0), Time::ZERO);
        assert_eq!(flat.take_one(Time::from_secs(5)), Err(u64::MAX));
    }

    #[test]
    #[should_panic(expected = "double release")]
    fn double_release_panics() {
        let mut ledger = Ledger::new();
        let a = ledger.add_semaphore(LimitKey::GpuUnits, 2);
        let mut demand = Demand::default();
        demand.add(a, 1);
        ledger.try_acquire(&demand, Time::ZERO).unwrap();
        ledger.release(&demand);
        ledger.release(&demand);
    }

    /// One step on both buckets: advance the clock, then take, refund or change the rate.
    #[derive(Debug, Clone)]
    enum BucketStep {
        Take { after_ms: u64 },
        Refund,
        SetRate { per_minute: u64, burst: u64 },
    }

    fn bucket_step() -> impl proptest::strategy::Strategy<Value = BucketStep> {
        use proptest::prelude::*;
        prop_oneof![
            6 => (0u64..5_000).prop_map(|after_ms| BucketStep::Take { after_ms }),
            1 => Just(BucketStep::Refund),
            1 => (0u64..100_000, 1u64..1_000)
                .prop_map(|(per_minute, burst)| BucketStep::SetRate { per_minute, burst }),
        ]
    }

    proptest::proptest! {
        /// The owners' 64-bit submit bucket answers exactly as the 128-bit one without a penalty.
        #[test]
        fn submit_bucket_answers_as_the_token_bucket(
            per_minute in 0u64..100_000,
            burst in 1u64..1_000,
            steps in proptest::collection::vec(bucket_step(), 1..200),
        ) {
            let rate = RateSpec { per_minute, burst };
            let mut small = SubmitBucket::new(rate, Time::ZERO);
            let mut wide = TokenBucket::new(rate, Time::ZERO);
            let mut now = Time::ZERO;
            for step in steps {
                match step {
                    BucketStep::Take { after_ms } => {
                        now = now.plus_ns(after_ms * 1_000_000);
                        proptest::prop_assert_eq!(small.try_take_one(now), wide.try_take(1, now));
                    }
                    BucketStep::Refund => {
                        small.refund_one();
                        wide.refund(1);
                    }
                    BucketStep::SetRate { per_minute, burst } => {
                        let rate = RateSpec { per_minute, burst };
                        small.set_rate(rate, now);
                        wide.set_rate(rate, now);
                    }
                }
                proptest::prop_assert_eq!(small.tokens(), wide.tokens());
                proptest::prop_assert!(small.within_burst());
            }
        }
    }

    #[test]
    fn a_submit_burst_beyond_the_exact_range_is_held_at_it() {
        let huge = RateSpec {
            per_minute: 1 << 40,
            burst: 1 << 40,
        };
        let mut bucket = SubmitBucket::new(huge, Time::ZERO);
        assert_eq!(bucket.tokens(), SUBMIT_BURST_MAX);
        assert!(bucket.try_take_one(Time::ZERO));
        assert_eq!(bucket.tokens(), SUBMIT_BURST_MAX - 1);
        // A day at 2^40 per minute refills to the cap without overflowing.
        bucket.refill(Time::from_secs(86_400));
        assert_eq!(bucket.tokens(), SUBMIT_BURST_MAX);
        bucket.refund_one();
        assert!(bucket.within_burst());
    }
}
