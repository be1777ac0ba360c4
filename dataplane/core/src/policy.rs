//! Scheduling policy: lanes, tenants, DRR and aging parameters, providers, the capability matrix
//! and node capacities. Plain data, validated once. A newer policy version changes single objects
//! ([`PolicyPatch`]), each checked before it is applied; provider accounts and models are fixed
//! at start in number and name (their ids index the shard's limits), their values are not.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::cost::{CostBases, ModelCapability, ResourceClass};
use crate::ids::{Band, Lane, ModelId, PolicyVersion, ProviderId, TenantId};
use crate::limits::{
    BURST_ROUNDS_MAX, FIT_SCAN_MAX, MODELS_MAX, PROVIDERS_MAX, PROVIDERS_PER_MODEL_MAX, SKIPS_MAX,
    TENANTS_MAX, WEIGHT_MAX,
};
use crate::units::Units;

/// A token bucket: `per_minute` tokens refill continuously, at most `burst` stored. A tenant's or
/// user's submit rate keeps bursts exactly up to [`crate::ledger::SUBMIT_BURST_MAX`] (307 million
/// submits); a larger one, like the presets' unlimited rate, is held at that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateSpec {
    pub per_minute: u64,
    pub burst: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LanePolicy {
    pub open: bool,
    /// Weight in the weighted lane choice.
    pub weight: u32,
    /// Running fairness units the lane may hold on this node (its own pool).
    pub capacity: Units,
    pub queued_tasks_max: u64,
    pub queued_units_max: Units,
    /// Tasks the lane may run at once (its pool bounds slot units; this bounds the count).
    pub running_tasks_max: u64,
    /// Retries after retryable failures.
    pub retries_max: u32,
    /// Requeues after provider rate-limit answers (provably not accepted).
    pub rate_limit_retries_max: u32,
    /// Service rate assumed before the first completion is measured (milli-units per second).
    pub initial_rate_milli_per_s: u64,
    /// A cost budget of the lane's own: cost (milli units) a minute its tasks may start. No other
    /// lane draws on it, and the lane draws on nothing else (the node's platform budget less
    /// every lane's own is what the lanes without one share). `None`: it shares that rest.
    #[serde(default)]
    pub cost_per_minute: Option<RateSpec>,
    /// How long one provider job of the lane may run, from its attempt's start, before it is
    /// canceled at the provider and its task fails with that reason; 0: no limit of its own.
    #[serde(default)]
    pub execution_timeout_ms: u64,
    /// Media workers of the lane's own: its media jobs run at most this many at once, on
    /// workers no other lane uses. `None`: it shares the node's workers less every lane's own.
    #[serde(default)]
    pub media_workers: Option<u64>,
}

/// The enterprise reserve: other lanes may borrow it up to `borrow_limit` while at least
/// `minimum_reserved_headroom` stays free, and only while enterprise work is not waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservePolicy {
    pub borrow_limit: Units,
    pub minimum_reserved_headroom: Units,
}

/// What to do with a task whose expected wait exceeds the tenant's `max_wait_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitOverflow {
    Reject,
    BestEffort,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserPolicy {
    pub submit_rate: RateSpec,
    pub queued_tasks_max: u64,
    pub queued_units_max: Units,
    pub running_tasks_max: u64,
    pub running_units_max: Units,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantPolicy {
    pub lane: Lane,
    pub weight: u32,
    /// The band the tenant's tasks start in; a client may only ask for a lower one.
    pub base_band: Band,
    pub submit_rate: RateSpec,
    pub queued_tasks_max: u64,
    pub queued_units_max: Units,
    pub running_tasks_max: u64,
    pub running_units_max: Units,
    /// Cost per minute (milli cost units) this tenant may start.
    pub cost_per_minute: RateSpec,
    /// Total cost (milli) the tenant may have reserved by admitted, unfinished work.
    pub cost_quota_milli: u64,
    pub max_wait_ms: u64,
    pub wait_overflow: WaitOverflow,
    pub allowed_classes: Vec<ResourceClass>,
    pub user: UserPolicy,
    /// Cancels it may send: each one is stored in PostgreSQL before it is answered (design.md
    /// §4: a flood of create-then-cancel). Unlimited where a stored policy predates it.
    #[serde(default = "unlimited_rate")]
    pub cancel_rate: RateSpec,
    /// Status reads answered from PostgreSQL — a task no shard holds live (ended, or another
    /// node's); a live task's status comes from memory and spends nothing of this. Unlimited
    /// where a stored policy predates it.
    #[serde(default = "unlimited_rate")]
    pub store_read_rate: RateSpec,
    /// Suspended by an operator: its submits are rejected and its queued tasks wait (none is
    /// started) until it is resumed; its running work goes on, and it may still read and
    /// cancel its tasks.
    #[serde(default)]
    pub suspended: bool,
    /// Periodic quotas (`crate::quota`): cost and task counts per minute, day or month, of the
    /// tenant, each of its users, or one model. None where a stored policy predates them.
    #[serde(default)]
    pub quotas: Vec<crate::quota::Quota>,
    /// The tenant's time zone for its quotas' periods, in minutes from UTC.
    #[serde(default)]
    pub utc_offset_min: i32,
}

fn unlimited_rate() -> RateSpec {
    crate::presets::UNLIMITED_RATE
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrrPolicy {
    /// Quantum of a weight-1 tenant; should be at least the largest task's cost.
    pub base_quantum: Units,
    pub burst_rounds: u32,
    pub initial_burst_credit: Units,
    /// Largest correction one task's actual-vs-estimate error may add to the tenant's debt.
    pub debt_cap_per_task: Units,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgingPolicy {
    /// Waiting this long promotes a task one band (never above P1).
    pub aging_step_ms: u64,
    pub fit_scan_max: usize,
    pub skips_max: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryPolicy {
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
}

impl RetryPolicy {
    /// Exponential backoff for the `retry_no`-th retry (from 1), capped, times a jitter in milli
    /// (700..=1300) that the caller draws.
    pub fn backoff_ns(&self, retry_no: u32, jitter_milli: u64) -> u64 {
        let exp = self
            .backoff_base_ms
            .saturating_mul(1u64 << retry_no.saturating_sub(1).min(30));
        exp.min(self.backoff_max_ms) * jitter_milli / 1000 * crate::time::NANOS_PER_MS
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderPolicy {
    pub id: ProviderId,
    /// provider:account:region:model
    pub name: String,
    pub concurrency: u64,
    pub rpm: RateSpec,
}

/// Node-wide capacities. Shards share them through the split rule of [`crate::share`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePolicy {
    pub global_queued_tasks_max: u64,
    pub global_queued_units_max: Units,
    pub high_cost_concurrency: u64,
    /// Running tasks per model.
    pub model_running_max: u64,
    /// Running slot units per model.
    pub model_running_units_max: Units,
    pub global_running_tasks_max: u64,
    pub global_running_units_max: Units,
    pub platform_cost_per_minute: RateSpec,
    pub gpu_units: u64,
    pub gpu_mem_mb: u64,
    pub cpu_units: u64,
    pub temp_disk_mb: u64,
    /// Media jobs the node runs at once, over every lane (its media workers): lanes with
    /// workers of their own ([`LanePolicy::media_workers`]) take theirs out of it.
    #[serde(default = "unbounded")]
    pub media_workers: u64,
}

fn unbounded() -> u64 {
    crate::presets::UNBOUNDED
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub version: PolicyVersion,
    /// Indexed by [`Lane::index`].
    pub lanes: Vec<LanePolicy>,
    pub reserve: ReservePolicy,
    pub drr: DrrPolicy,
    pub aging: AgingPolicy,
    pub retry: RetryPolicy,
    pub node: NodePolicy,
    pub cost_bases: CostBases,
    /// Estimates that follow what a model's tasks really cost (off unless set).
    #[serde(default)]
    pub calibration: CalibrationPolicy,
    /// Indexed by `ProviderId.0`.
    pub providers: Vec<ProviderPolicy>,
    /// Indexed by `ModelId.0`.
    pub models: Vec<ModelCapability>,
    pub tenants: HashMap<TenantId, TenantPolicy>,
}

/// Estimates that follow what a model's tasks really cost (design.md §4: a large task's
/// misestimate is calibrated with the historical P95 of actual consumption). Each shard keeps,
/// per model, the ratio of reported to estimated cost of its last completions; once it has
/// `samples_min` of them, new tasks of the model are priced at the window's 95th percentile of
/// that ratio (within ×0.5..×4), so budgets reserve what such tasks really spend. Tasks
/// admitted before keep their estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CalibrationPolicy {
    /// Completions with a reported cost a model needs before its estimates follow them; 0
    /// turns calibration off. At most `shard::CALIBRATION_WINDOW`.
    pub samples_min: u32,
}

/// A policy the core refuses to run with; each names the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyError {
    LaneCount(usize),
    Range {
        field: String,
        value: u64,
        min: u64,
        max: u64,
    },
    IdMismatch {
        field: &'static str,
        index: usize,
        id: u64,
    },
    UnknownProvider {
        model: ModelId,
        provider: ProviderId,
    },
    NoTiers(ModelId),
    /// A change the running node cannot take (it needs the configuration and a restart).
    NotLive(String),
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::LaneCount(n) => {
                write!(f, "lanes: expected {} entries, got {n}", Lane::COUNT)
            }
            PolicyError::Range {
                field,
                value,
                min,
                max,
            } => {
                write!(f, "{field}: {value} is outside {min}..={max}")
            }
            PolicyError::IdMismatch { field, index, id } => {
                write!(
                    f,
                    "{field}[{index}] has id {id}; ids must equal their index"
                )
            }
            PolicyError::UnknownProvider { model, provider } => {
                write!(
                    f,
                    "model {model} names provider {provider}, which is not configured"
                )
            }
            PolicyError::NoTiers(model) => write!(f, "model {model} has no resolution tiers"),
            PolicyError::NotLive(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for PolicyError {}

fn range(field: impl Into<String>, value: u64, min: u64, max: u64) -> Result<(), PolicyError> {
    if value < min || value > max {
        return Err(PolicyError::Range {
            field: field.into(),
            value,
            min,
            max,
        });
    }
    Ok(())
}

impl TenantPolicy {
    /// The lane a task of `class` goes to: high-cost work has its own lane.
    pub fn lane_for(&self, class: ResourceClass) -> Lane {
        match class {
            ResourceClass::Expensive => Lane::Expensive,
            ResourceClass::Standard => self.lane,
        }
    }

    /// The band a task starts in: the client's hint can only lower the tenant's base band.
    pub fn band_for(&self, hint: Option<Band>) -> Band {
        hint.map_or(self.base_band, |hint| hint.max(self.base_band))
    }
}

impl Policy {
    pub fn lane(&self, lane: Lane) -> &LanePolicy {
        &self.lanes[lane.index()]
    }

    /// What the lanes without a cost budget of their own share: the platform's budget less
    /// every lane's own (checked by [`Policy::validate`] to leave some when a lane shares it).
    pub fn shared_cost_per_minute(&self) -> RateSpec {
        let platform = self.node.platform_cost_per_minute;
        let own = |f: fn(&RateSpec) -> u64| -> u64 {
            self.lanes
                .iter()
                .filter_map(|l| l.cost_per_minute.as_ref().map(f))
                .sum()
        };
        RateSpec {
            per_minute: platform.per_minute.saturating_sub(own(|r| r.per_minute)),
            burst: platform.burst.saturating_sub(own(|r| r.burst)),
        }
    }

    /// The media workers the lanes without workers of their own share: the node's less every
    /// lane's own.
    pub fn shared_media_workers(&self) -> u64 {
        let own: u64 = self.lanes.iter().filter_map(|l| l.media_workers).sum();
        self.node.media_workers.saturating_sub(own)
    }

    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.lanes.len() != Lane::COUNT {
            return Err(PolicyError::LaneCount(self.lanes.len()));
        }
        for lane in Lane::ALL {
            check_lane(lane, self.lane(lane))?;
        }
        check_lane_shares(&self.lanes, &self.node)?;
        range(
            "drr.base_quantum",
            self.drr.base_quantum.milli(),
            1,
            u64::from(u32::MAX),
        )?;
        // A backlogged tenant ends a turn with up to one task's cost left; with the cap at a single
        // quantum that remainder would be clipped and large-task tenants shortchanged.
        range(
            "drr.burst_rounds",
            self.drr.burst_rounds.into(),
            2,
            BURST_ROUNDS_MAX.into(),
        )?;
        range("aging.aging_step_ms", self.aging.aging_step_ms, 1, u64::MAX)?;
        range(
            "calibration.samples_min",
            self.calibration.samples_min.into(),
            0,
            crate::limits::CALIBRATION_WINDOW as u64,
        )?;
        range(
            "aging.fit_scan_max",
            self.aging.fit_scan_max as u64,
            0,
            FIT_SCAN_MAX as u64,
        )?;
        range(
            "aging.skips_max",
            self.aging.skips_max.into(),
            0,
            SKIPS_MAX.into(),
        )?;
        range(
            "cost_bases.provider_ms",
            self.cost_bases.provider_ms,
            1,
            u64::MAX,
        )?;
        range(
            "cost_bases.cost_milli",
            self.cost_bases.cost_milli,
            1,
            u64::MAX,
        )?;
        range("cost_bases.gpu_ms", self.cost_bases.gpu_ms, 1, u64::MAX)?;
        range(
            "providers",
            self.providers.len() as u64,
            0,
            PROVIDERS_MAX as u64,
        )?;
        range("models", self.models.len() as u64, 0, MODELS_MAX as u64)?;
        // A shard holds at most every tenant of its policy (tenants are never removed from a
        // running one), so this bounds the shard's tenant table too.
        range("tenants", self.tenants.len() as u64, 0, TENANTS_MAX as u64)?;
        for (index, p) in self.providers.iter().enumerate() {
            if p.id.0 as usize != index {
                return Err(PolicyError::IdMismatch {
                    field: "providers",
                    index,
                    id: p.id.0.into(),
                });
            }
        }
        for (index, m) in self.models.iter().enumerate() {
            if m.id.0 as usize != index {
                return Err(PolicyError::IdMismatch {
                    field: "models",
                    index,
                    id: m.id.0.into(),
                });
            }
            self.check_model(m)?;
        }
        for (&tenant, t) in &self.tenants {
            check_tenant(tenant, t)?;
        }
        Ok(())
    }

    fn check_model(&self, m: &ModelCapability) -> Result<(), PolicyError> {
        let index = m.id.0;
        if m.tiers.is_empty() {
            return Err(PolicyError::NoTiers(m.id));
        }
        range(
            format!("models[{index}].fps_base"),
            m.fps_base.into(),
            1,
            u64::from(u32::MAX),
        )?;
        range(
            format!("models[{index}].providers"),
            m.providers.len() as u64,
            1,
            PROVIDERS_PER_MODEL_MAX as u64,
        )?;
        if let Some(&provider) = m
            .providers
            .iter()
            .find(|p| p.0 as usize >= self.providers.len())
        {
            return Err(PolicyError::UnknownProvider {
                model: m.id,
                provider,
            });
        }
        Ok(())
    }

    /// Whether `patch` could be applied to this (valid) policy: the object's own checks, and
    /// for a provider account or a model, that it is one this policy has under that name, or a
    /// new one: the next id (ids stay their index), a name no other has, within the maximum.
    pub fn check(&self, patch: &PolicyPatch) -> Result<(), PolicyError> {
        match patch {
            PolicyPatch::Tenant(tenant, t) => {
                if !self.tenants.contains_key(tenant) {
                    let count = self.tenants.len() as u64 + 1;
                    range("tenants", count, 0, TENANTS_MAX as u64)?;
                }
                check_tenant(*tenant, t)
            }
            PolicyPatch::Lane(lane, l) => {
                check_lane(*lane, l)?;
                let old = self.lane(*lane);
                if old.cost_per_minute.is_some() != l.cost_per_minute.is_some()
                    || old.media_workers.is_some() != l.media_workers.is_some()
                {
                    return Err(PolicyError::NotLive(format!(
                        "lane {lane}: a cost budget or media workers of its own may change \
                         live, not appear or go (that needs the configuration and a restart)"
                    )));
                }
                let mut lanes = self.lanes.clone();
                lanes[lane.index()] = l.clone();
                check_lane_shares(&lanes, &self.node)
            }
            PolicyPatch::Provider(p) => match self.providers.get(p.id.0 as usize) {
                Some(old) if old.name == p.name => Ok(()),
                Some(old) => Err(PolicyError::NotLive(format!(
                    "provider {} is {:?}; a live change cannot rename it to {:?}",
                    p.id, old.name, p.name
                ))),
                None => {
                    let next = self.providers.len();
                    Self::check_new(
                        "provider",
                        p.id.0.into(),
                        next,
                        PROVIDERS_MAX,
                        &p.name,
                        self.providers.iter().map(|q| q.name.as_str()),
                    )
                }
            },
            PolicyPatch::Model(m) => match self.models.get(m.id.0 as usize) {
                Some(old) if old.name == m.name => self.check_model(m),
                Some(old) => Err(PolicyError::NotLive(format!(
                    "model {} is {:?}; a live change cannot rename it to {:?}",
                    m.id, old.name, m.name
                ))),
                None => {
                    let next = self.models.len();
                    Self::check_new(
                        "model",
                        m.id.0.into(),
                        next,
                        MODELS_MAX,
                        &m.name,
                        self.models.iter().map(|q| q.name.as_str()),
                    )?;
                    self.check_model(m)
                }
            },
        }
    }

    /// A provider account or model added to a running policy: it takes the next id (`next`,
    /// ids are indexes), stays within `max`, and its name is not taken.
    fn check_new<'a>(
        what: &str,
        id: u64,
        next: usize,
        max: usize,
        name: &str,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), PolicyError> {
        if id != next as u64 {
            return Err(PolicyError::NotLive(format!(
                "{what} {id} is not configured; a new {what} takes the next id, {next}"
            )));
        }
        range(format!("{what}s"), next as u64 + 1, 0, max as u64)?;
        if names.into_iter().any(|n| n == name) {
            return Err(PolicyError::NotLive(format!(
                "{what} {id} is named {name:?}, which another {what} has"
            )));
        }
        Ok(())
    }

    /// Applies `patch` after [`Policy::check`]; on an error nothing changed.
    pub fn apply(&mut self, patch: PolicyPatch) -> Result<(), PolicyError> {
        self.check(&patch)?;
        match patch {
            PolicyPatch::Tenant(tenant, t) => {
                self.tenants.insert(tenant, t);
            }
            PolicyPatch::Lane(lane, l) => self.lanes[lane.index()] = l,
            PolicyPatch::Provider(p) => match self.providers.get_mut(p.id.0 as usize) {
                Some(old) => *old = p,
                None => self.providers.push(p),
            },
            PolicyPatch::Model(m) => match self.models.get_mut(m.id.0 as usize) {
                Some(old) => *old = m,
                None => self.models.push(m),
            },
        }
        Ok(())
    }

    /// What turns `self` into `to`, object by object (tenants only `to` has, or has changed;
    /// a tenant is never removed from a running policy). `to` has every provider and model
    /// `self` has, under the same ids, and may have more after them (added at run time).
    pub fn diff(&self, to: &Policy) -> Vec<PolicyPatch> {
        let mut patches = Vec::new();
        for lane in Lane::ALL {
            if self.lane(lane) != to.lane(lane) {
                patches.push(PolicyPatch::Lane(lane, to.lane(lane).clone()));
            }
        }
        // Providers first, new ones after changed ones: a model may name a new provider.
        for (i, new) in to.providers.iter().enumerate() {
            if self.providers.get(i) != Some(new) {
                patches.push(PolicyPatch::Provider(new.clone()));
            }
        }
        for (i, new) in to.models.iter().enumerate() {
            if self.models.get(i) != Some(new) {
                patches.push(PolicyPatch::Model(new.clone()));
            }
        }
        let mut tenants: Vec<_> = to
            .tenants
            .iter()
            .filter(|(id, t)| self.tenants.get(id) != Some(t))
            .collect();
        tenants.sort_by_key(|(id, _)| **id);
        patches.extend(
            tenants
                .into_iter()
                .map(|(&id, t)| PolicyPatch::Tenant(id, t.clone())),
        );
        patches
    }
}

/// One policy object of a newer policy version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum PolicyPatch {
    Tenant(TenantId, TenantPolicy),
    Lane(Lane, LanePolicy),
    Provider(ProviderPolicy),
    Model(ModelCapability),
}

/// `lanes`' own budgets and workers fit in `node`'s, and leave some (one or more) for the
/// lanes that share the rest.
fn check_lane_shares(lanes: &[LanePolicy], node: &NodePolicy) -> Result<(), PolicyError> {
    let sum = |values: &mut dyn Iterator<Item = u64>| values.fold(0u64, u64::saturating_add);
    let own_cost: Vec<RateSpec> = lanes.iter().filter_map(|l| l.cost_per_minute).collect();
    let left_min = u64::from(own_cost.len() < lanes.len());
    let platform = node.platform_cost_per_minute;
    for (what, all, own) in [
        (
            "per_minute",
            platform.per_minute,
            sum(&mut own_cost.iter().map(|r| r.per_minute)),
        ),
        (
            "burst",
            platform.burst,
            sum(&mut own_cost.iter().map(|r| r.burst)),
        ),
    ] {
        range(
            format!(
                "lanes.*.cost_per_minute.{what} (their sum: within the platform's {all}, \
                 leaving {left_min} or more to the lanes without a budget of their own)"
            ),
            own,
            0,
            all.saturating_sub(left_min),
        )?;
    }
    let own_workers: Vec<u64> = lanes.iter().filter_map(|l| l.media_workers).collect();
    let left_min = u64::from(own_workers.len() < lanes.len());
    let all = node.media_workers;
    range(
        format!(
            "lanes.*.media_workers (their sum: within the node's {all}, leaving {left_min} \
             or more to the lanes without workers of their own)"
        ),
        sum(&mut own_workers.into_iter()),
        0,
        all.saturating_sub(left_min),
    )
}

fn check_lane(lane: Lane, l: &LanePolicy) -> Result<(), PolicyError> {
    range(
        format!("lanes.{lane}.weight"),
        l.weight.into(),
        1,
        WEIGHT_MAX.into(),
    )?;
    range(
        format!("lanes.{lane}.execution_timeout_ms"),
        l.execution_timeout_ms,
        0,
        crate::limits::EXECUTION_TIMEOUT_MS_MAX,
    )?;
    if let Some(n) = l.media_workers {
        range(format!("lanes.{lane}.media_workers"), n, 1, u64::MAX)?;
    }
    if let Some(r) = l.cost_per_minute {
        range(
            format!("lanes.{lane}.cost_per_minute.per_minute"),
            r.per_minute,
            1,
            u64::MAX,
        )?;
        range(
            format!("lanes.{lane}.cost_per_minute.burst"),
            r.burst,
            1,
            u64::MAX,
        )?;
    }
    Ok(())
}

fn check_tenant(tenant: TenantId, t: &TenantPolicy) -> Result<(), PolicyError> {
    range(
        format!("tenants.{tenant}.weight"),
        t.weight.into(),
        1,
        WEIGHT_MAX.into(),
    )?;
    range(
        format!("tenants.{tenant}.quotas"),
        t.quotas.len() as u64,
        0,
        crate::quota::QUOTAS_PER_TENANT_MAX as u64,
    )?;
    let max = crate::quota::UTC_OFFSET_MIN_MAX;
    range(
        format!("tenants.{tenant}.utc_offset_min (+{max})"),
        (i64::from(t.utc_offset_min) + i64::from(max)) as u64,
        0,
        2 * max as u64,
    )?;
    for (i, q) in t.quotas.iter().enumerate() {
        if q.cost_milli.is_none() && q.tasks.is_none() {
            return Err(PolicyError::Range {
                field: format!("tenants.{tenant}.quotas[{i}]: neither cost_milli nor tasks"),
                value: 0,
                min: 1,
                max: 1,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use expect_test::expect;

    use crate::ids::{ModelId, ProviderId};
    use crate::presets::small_node;

    fn err(edit: impl FnOnce(&mut super::Policy)) -> String {
        let mut policy = small_node();
        edit(&mut policy);
        policy.validate().unwrap_err().to_string()
    }

    #[test]
    fn invalid_policies_name_the_field() {
        expect!["lanes: expected 6 entries, got 5"].assert_eq(&err(|p| {
            p.lanes.pop();
        }));
        expect!["models[0] has id 3; ids must equal their index"]
            .assert_eq(&err(|p| p.models[0].id = ModelId(3)));
        expect!["model 0 names provider 9, which is not configured"]
            .assert_eq(&err(|p| p.models[0].providers.push(ProviderId(9))));
        expect!["model 0 has no resolution tiers"].assert_eq(&err(|p| p.models[0].tiers.clear()));
        expect!["drr.burst_rounds: 1 is outside 2..=64"]
            .assert_eq(&err(|p| p.drr.burst_rounds = 1));
        expect!["calibration.samples_min: 65 is outside 0..=64"]
            .assert_eq(&err(|p| p.calibration.samples_min = 65));
        expect!["lanes.STANDARD.weight: 0 is outside 1..=10000"]
            .assert_eq(&err(|p| p.lanes[2].weight = 0));
    }

    /// More tenants than a shard's table holds is a policy error, by validation and by patch,
    /// not a shard that stops at its first submit from one too many.
    #[test]
    fn a_policy_holds_at_most_tenants_max_tenants() {
        use super::PolicyPatch;
        use crate::ids::TenantId;
        use crate::limits::TENANTS_MAX;

        let mut p = small_node();
        let one = crate::presets::tenant(crate::ids::Lane::Standard, 1);
        let first = p.tenants.keys().map(|t| t.0 + 1).max().unwrap_or(0);
        let missing = TENANTS_MAX - p.tenants.len();
        p.tenants.reserve(missing + 1);
        for i in 0..missing as u32 {
            p.tenants.insert(TenantId(first + i), one.clone());
        }
        p.validate().expect("TENANTS_MAX tenants are allowed");
        let next = TenantId(first + missing as u32);
        let before = p.tenants.len();
        let e = p.apply(PolicyPatch::Tenant(next, one.clone())).unwrap_err();
        expect!["tenants: 1048577 is outside 0..=1048576"].assert_eq(&e.to_string());
        assert_eq!(p.tenants.len(), before, "a refused tenant was added");
        // A tenant already there still takes a new policy.
        p.apply(PolicyPatch::Tenant(TenantId(first), one.clone()))
            .expect("a known tenant's change");
        p.tenants.insert(next, one);
        expect!["tenants: 1048577 is outside 0..=1048576"]
            .assert_eq(&p.validate().unwrap_err().to_string());
    }

    #[test]
    fn patches_are_checked_and_leave_a_refused_policy_unchanged() {
        use super::PolicyPatch;
        use crate::ids::{Lane, TenantId};
        use crate::presets::tenant;

        let base = small_node();
        let mut p = base.clone();
        let refuse = |p: &mut super::Policy, patch: PolicyPatch| {
            let before = p.clone();
            let e = p.apply(patch).unwrap_err().to_string();
            assert_eq!(*p, before, "a refused patch changed the policy");
            e
        };

        let mut closed = p.lane(Lane::Standard).clone();
        closed.open = false;
        p.apply(PolicyPatch::Lane(Lane::Standard, closed.clone()))
            .unwrap();
        assert!(!p.lane(Lane::Standard).open);
        let mut zero = closed;
        zero.weight = 0;
        expect!["lanes.STANDARD.weight: 0 is outside 1..=10000"]
            .assert_eq(&refuse(&mut p, PolicyPatch::Lane(Lane::Standard, zero)));

        let mut renamed = p.providers[1].clone();
        renamed.name = "elsewhere".into();
        expect![[r#"provider 1 is "vendor-1:acct-1:us:video-model-0"; a live change cannot rename it to "elsewhere""#]]
            .assert_eq(&refuse(&mut p, PolicyPatch::Provider(renamed)));
        let mut new = p.providers[1].clone();
        new.id = ProviderId(7);
        expect!["provider 7 is not configured; a new provider takes the next id, 2"]
            .assert_eq(&refuse(&mut p, PolicyPatch::Provider(new.clone())));
        new.id = ProviderId(2);
        expect![[
            r#"provider 2 is named "vendor-1:acct-1:us:video-model-0", which another provider has"#
        ]]
        .assert_eq(&refuse(&mut p, PolicyPatch::Provider(new.clone())));
        let mut model = p.models[0].clone();
        model.providers.push(ProviderId(2));
        expect!["model 0 names provider 2, which is not configured"]
            .assert_eq(&refuse(&mut p, PolicyPatch::Model(model.clone())));
        // A new account under a new name, then a new model that it serves.
        new.name = "vendor-2:acct-1:us:video-model-9".into();
        p.apply(PolicyPatch::Provider(new)).unwrap();
        assert_eq!(p.providers.len(), 3);
        let mut added = p.models[0].clone();
        added.id = ModelId(1);
        expect![[r#"model 1 is named "video-model-0", which another model has"#]]
            .assert_eq(&refuse(&mut p, PolicyPatch::Model(added.clone())));
        added.name = "video-model-9".into();
        added.providers = vec![ProviderId(2)];
        p.apply(PolicyPatch::Model(added)).unwrap();
        assert_eq!(p.models[1].providers, [ProviderId(2)]);
        let mut model = p.models[0].clone();
        model.cost_milli_per_output_s *= 2;
        p.apply(PolicyPatch::Model(model)).unwrap();
        p.apply(PolicyPatch::Tenant(
            TenantId(4),
            tenant(Lane::PaidShared, 3),
        ))
        .unwrap();

        // The diff from the old policy replays every change, in a fixed order.
        let mut replayed = base.clone();
        let patches = base.diff(&p);
        assert_eq!(patches.len(), 5);
        for patch in patches {
            replayed.apply(patch).unwrap();
        }
        assert_eq!(replayed, p);
        assert!(p.diff(&p).is_empty());
    }
}
