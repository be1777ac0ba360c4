//! Scenario files: TOML, documented in `scenarios/README.md`. Parsing rejects unknown fields and
//! every semantic error names the file, the line and the field.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use spindle_core::cost::example_model;
use spindle_core::policy::{Policy, ProviderPolicy, RateSpec};
use spindle_core::presets;
use spindle_core::{Band, Lane, ModelId, ProviderId, TenantId, Units};
use toml::Spanned;

/// Scenario size bounds: a file cannot ask the simulator for unbounded work.
pub const TENANTS_MAX: u64 = 100_000;
pub const SHARDS_MAX: u64 = 64;
pub const DURATION_S_MAX: u64 = 7 * 24 * 3600;
pub const MIX_ENTRIES_MAX: usize = 64;
pub const PROVIDERS_MAX: usize = 64;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "one")]
    pub seed: u64,
    /// Arrivals stop here; the run continues until every task has ended or `drain_s` passed.
    pub duration_s: Spanned<u64>,
    #[serde(default = "default_drain")]
    pub drain_s: u64,
    /// Fairness is measured from here to `duration_s`.
    #[serde(default)]
    pub warmup_s: u64,
    #[serde(default = "one_shard")]
    pub shards: Spanned<u64>,
    /// A task that heads its tenant's queue longer than this without dispatch is starved.
    pub starvation_bound_s: u64,
    #[serde(default = "default_resplit")]
    pub resplit_ms: u64,
    #[serde(default = "default_sample")]
    pub sample_ms: u64,
    /// The fairness targets (share error, Jain) apply to this scenario.
    #[serde(default)]
    pub fairness: bool,
    #[serde(default)]
    pub lanes: BTreeMap<Lane, LaneOverride>,
    #[serde(default)]
    pub drr: DrrOverride,
    #[serde(default)]
    pub aging: AgingOverride,
    #[serde(default)]
    pub reserve: ReserveOverride,
    #[serde(default)]
    pub node: NodeOverride,
    pub providers: Vec<ProviderSpec>,
    pub tenants: Vec<TenantGroup>,
}

fn one() -> u64 {
    1
}
fn one_shard() -> Spanned<u64> {
    Spanned::new(0..0, 1)
}
fn default_drain() -> u64 {
    6 * 3600
}
fn default_resplit() -> u64 {
    10
}
fn default_sample() -> u64 {
    1000
}
fn default_weight() -> Spanned<u32> {
    Spanned::new(0..0, 1)
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaneOverride {
    pub capacity: Option<u64>,
    pub running_tasks_max: Option<u64>,
    pub weight: Option<u32>,
    pub queued_tasks_max: Option<u64>,
    pub retries_max: Option<u32>,
    pub rate_limit_retries_max: Option<u32>,
    pub open: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrrOverride {
    pub base_quantum: Option<u64>,
    pub burst_rounds: Option<u32>,
    pub initial_burst_credit: Option<u64>,
    pub debt_cap_per_task: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgingOverride {
    pub aging_step_s: Option<u64>,
    pub fit_scan_max: Option<usize>,
    pub skips_max: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReserveOverride {
    pub borrow_limit: Option<u64>,
    pub minimum_reserved_headroom: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeOverride {
    pub global_queued_tasks_max: Option<u64>,
    pub high_cost_concurrency: Option<u64>,
    pub model_running_max: Option<u64>,
    pub global_running_tasks_max: Option<u64>,
    pub global_running_units_max: Option<u64>,
    pub platform_cost_per_minute: Option<u64>,
    pub gpu_units: Option<u64>,
    pub cpu_units: Option<u64>,
}

/// A period in which a provider answers rate-limit to a share of requests.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Storm {
    pub start_s: u64,
    pub end_s: u64,
    pub rate_limit_prob: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderSpec {
    pub name: String,
    pub concurrency: Spanned<u64>,
    pub rpm: u64,
    pub rpm_burst: u64,
    /// Shape of the log-normal run-time multiplier (median 1).
    #[serde(default = "default_sigma")]
    pub latency_sigma: f64,
    #[serde(default = "default_submit_latency")]
    pub submit_latency_ms: u64,
    #[serde(default = "zero_prob")]
    pub rate_limit_prob: Spanned<f64>,
    /// Accepted, but the answer is lost: the node sees a timeout (SUBMIT_UNKNOWN).
    #[serde(default = "zero_prob")]
    pub timeout_prob: Spanned<f64>,
    /// Of the timeouts, the share where the provider in fact never got the request.
    #[serde(default = "zero_prob")]
    pub lost_prob: Spanned<f64>,
    /// A retryable failure at the end of the run.
    #[serde(default = "zero_prob")]
    pub failure_prob: Spanned<f64>,
    #[serde(default)]
    pub storms: Vec<Storm>,
}

fn zero_prob() -> Spanned<f64> {
    Spanned::new(0..0, 0.0)
}
fn default_sigma() -> f64 {
    0.25
}
fn default_submit_latency() -> u64 {
    200
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Resolution {
    #[serde(rename = "720p")]
    P720,
    #[serde(rename = "1080p")]
    P1080,
    #[serde(rename = "4k")]
    K4,
}

impl Resolution {
    pub fn size(self) -> (u32, u32) {
        match self {
            Resolution::P720 => (1280, 720),
            Resolution::P1080 => (1920, 1080),
            Resolution::K4 => (3840, 2160),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixEntry {
    pub res: Resolution,
    pub duration_s: u32,
    #[serde(default = "one_u32")]
    pub weight: u32,
    #[serde(default = "default_fps")]
    pub fps: u32,
    #[serde(default)]
    pub audio: bool,
    #[serde(default)]
    pub references: u8,
    /// A band the client asks for (it can only lower its tenant's base band).
    pub band: Option<Band>,
}

impl MixEntry {
    /// The task this entry submits, of the scenarios' one model.
    pub fn spec(&self) -> spindle_core::TaskSpec {
        let (width, height) = self.res.size();
        spindle_core::TaskSpec {
            model: spindle_core::ModelId(0),
            width,
            height,
            duration_ms: self.duration_s * 1000,
            fps: self.fps,
            audio: self.audio,
            references: self.references,
        }
    }
}

fn one_u32() -> u32 {
    1
}
fn default_fps() -> u32 {
    24
}

/// How a tenant submits.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Arrival {
    /// Poisson at `rate_per_s` for the whole run.
    Poisson { rate_per_s: f64 },
    /// Poisson at `rate_per_s` during `on_s`, silent for `off_s`, repeating.
    Bursty {
        rate_per_s: f64,
        on_s: u64,
        off_s: u64,
    },
    /// Poisson at `rate_per_s` only between `start_s` and `end_s`.
    Window {
        rate_per_s: f64,
        start_s: u64,
        end_s: u64,
    },
}

impl Arrival {
    pub fn rate_per_s(&self) -> f64 {
        match *self {
            Arrival::Poisson { rate_per_s }
            | Arrival::Bursty { rate_per_s, .. }
            | Arrival::Window { rate_per_s, .. } => rate_per_s,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantGroup {
    pub name: String,
    pub count: Spanned<u64>,
    pub lane: Lane,
    #[serde(default = "default_weight")]
    pub weight: Spanned<u32>,
    pub base_band: Option<Band>,
    #[serde(default = "one_u32")]
    pub users: u32,
    pub arrival: Spanned<Arrival>,
    pub mix: Spanned<Vec<MixEntry>>,
    pub queued_tasks_max: Option<u64>,
    pub running_tasks_max: Option<u64>,
    pub max_wait_s: Option<u64>,
}

/// A scenario file that cannot be used, with where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScenarioError {
    pub file: PathBuf,
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file.display(),
            self.line,
            self.column,
            self.message
        )
    }
}

impl std::error::Error for ScenarioError {}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, column)
}

struct Checker<'a> {
    file: &'a Path,
    text: &'a str,
}

impl Checker<'_> {
    fn err(&self, span: std::ops::Range<usize>, field: &str, message: String) -> ScenarioError {
        let (line, column) = line_col(self.text, span.start);
        ScenarioError {
            file: self.file.to_path_buf(),
            line,
            column,
            message: format!("field `{field}`: {message}"),
        }
    }

    fn range_u64<T: Copy + Into<u64>>(
        &self,
        v: &Spanned<T>,
        field: &str,
        min: u64,
        max: u64,
    ) -> Result<(), ScenarioError> {
        let value: u64 = (*v.get_ref()).into();
        if value < min || value > max {
            return Err(self.err(v.span(), field, format!("{value} is outside {min}..={max}")));
        }
        Ok(())
    }

    /// A policy the core refuses, placed at the line of the field's last key in the file (the
    /// file's first line when the field was left at its default).
    fn policy_err(&self, e: &spindle_core::PolicyError) -> ScenarioError {
        let field = match e {
            spindle_core::PolicyError::Range { field, .. } => field.clone(),
            other => format!("{other:?}"),
        };
        let key = field.rsplit('.').next().unwrap_or(&field).to_string();
        let at = self
            .text
            .match_indices(&key)
            .map(|(i, _)| i)
            .find(|&i| self.text[i + key.len()..].trim_start().starts_with('='))
            .unwrap_or(0);
        let (line, column) = line_col(self.text, at);
        ScenarioError {
            file: self.file.to_path_buf(),
            line,
            column,
            message: format!("policy: {e}"),
        }
    }

    fn prob(&self, v: &Spanned<f64>, field: &str) -> Result<(), ScenarioError> {
        let p = *v.get_ref();
        if !(0.0..=1.0).contains(&p) {
            return Err(self.err(
                v.span(),
                field,
                format!("{p} is not a probability in 0..=1"),
            ));
        }
        Ok(())
    }
}

impl Scenario {
    pub fn parse(file: &Path, text: &str) -> Result<Scenario, ScenarioError> {
        let scenario: Scenario = toml::from_str(text).map_err(|e| {
            let (line, column) = e.span().map_or((1, 1), |s| line_col(text, s.start));
            ScenarioError {
                file: file.to_path_buf(),
                line,
                column,
                message: e.message().to_string(),
            }
        })?;
        let checker = Checker { file, text };
        scenario.validate(&checker)?;
        scenario
            .policy()
            .validate()
            .map_err(|e| checker.policy_err(&e))?;
        Ok(scenario)
    }

    pub fn load(file: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(file).map_err(|e| ScenarioError {
            file: file.to_path_buf(),
            line: 0,
            column: 0,
            message: format!("cannot read: {e}"),
        })?;
        Scenario::parse(file, &text)
    }

    fn validate(&self, c: &Checker<'_>) -> Result<(), ScenarioError> {
        c.range_u64(&self.duration_s, "duration_s", 1, DURATION_S_MAX)?;
        c.range_u64(&self.shards, "shards", 1, SHARDS_MAX)?;
        let whole = 0..c.text.len().min(1);
        if self.providers.is_empty() || self.providers.len() > PROVIDERS_MAX {
            let msg = format!(
                "{} providers; 1..={PROVIDERS_MAX} are needed",
                self.providers.len()
            );
            return Err(c.err(whole, "providers", msg));
        }
        for (i, p) in self.providers.iter().enumerate() {
            c.range_u64(
                &p.concurrency,
                &format!("providers[{i}].concurrency"),
                1,
                1 << 32,
            )?;
            c.prob(
                &p.rate_limit_prob,
                &format!("providers[{i}].rate_limit_prob"),
            )?;
            c.prob(&p.timeout_prob, &format!("providers[{i}].timeout_prob"))?;
            c.prob(&p.lost_prob, &format!("providers[{i}].lost_prob"))?;
            c.prob(&p.failure_prob, &format!("providers[{i}].failure_prob"))?;
        }
        let mut tenants = 0u64;
        for (i, g) in self.tenants.iter().enumerate() {
            c.range_u64(&g.count, &format!("tenants[{i}].count"), 1, TENANTS_MAX)?;
            c.range_u64(&g.weight, &format!("tenants[{i}].weight"), 1, 10_000)?;
            tenants += *g.count.get_ref();
            let rate = g.arrival.get_ref().rate_per_s();
            if !(rate.is_finite() && rate > 0.0 && rate <= 1e6) {
                let msg = format!("rate_per_s {rate} is outside (0, 1e6]");
                return Err(c.err(g.arrival.span(), &format!("tenants[{i}].arrival"), msg));
            }
            let mix = g.mix.get_ref();
            if mix.is_empty() || mix.len() > MIX_ENTRIES_MAX {
                let msg = format!("{} entries; 1..={MIX_ENTRIES_MAX} are needed", mix.len());
                return Err(c.err(g.mix.span(), &format!("tenants[{i}].mix"), msg));
            }
            if let Some(m) = mix.iter().find(|m| m.duration_s == 0 || m.weight == 0) {
                let msg = format!("duration_s and weight must be positive (got {m:?})");
                return Err(c.err(g.mix.span(), &format!("tenants[{i}].mix"), msg));
            }
        }
        if tenants == 0 || tenants > TENANTS_MAX {
            let msg = format!("{tenants} tenants in all; 1..={TENANTS_MAX} are allowed");
            return Err(c.err(whole, "tenants", msg));
        }
        Ok(())
    }

    pub fn tenant_count(&self) -> u64 {
        self.tenants.iter().map(|g| *g.count.get_ref()).sum()
    }

    /// The core policy this scenario runs under: the simulator's defaults with its overrides.
    pub fn policy(&self) -> Policy {
        let mut policy = presets::small_node();
        presets::lift_node_limits(&mut policy);
        // Borrowing of the enterprise reserve only where a scenario asks for it, so that lane
        // capacities mean the same for spindle and the baselines elsewhere.
        policy.reserve.borrow_limit = Units::ZERO;
        policy.drr.burst_rounds = 2;
        policy.drr.base_quantum = Units::whole(48);
        policy.drr.initial_burst_credit = Units::whole(48);
        for (&lane, o) in &self.lanes {
            let l = &mut policy.lanes[lane.index()];
            if let Some(v) = o.capacity {
                l.capacity = Units::whole(v);
            }
            if let Some(v) = o.weight {
                l.weight = v;
            }
            if let Some(v) = o.running_tasks_max {
                l.running_tasks_max = v;
            }
            if let Some(v) = o.queued_tasks_max {
                l.queued_tasks_max = v;
            }
            if let Some(v) = o.retries_max {
                l.retries_max = v;
            }
            if let Some(v) = o.rate_limit_retries_max {
                l.rate_limit_retries_max = v;
            }
            if let Some(v) = o.open {
                l.open = v;
            }
        }
        let d = &self.drr;
        if let Some(v) = d.base_quantum {
            policy.drr.base_quantum = Units::whole(v);
        }
        if let Some(v) = d.burst_rounds {
            policy.drr.burst_rounds = v;
        }
        if let Some(v) = d.initial_burst_credit {
            policy.drr.initial_burst_credit = Units::whole(v);
        }
        if let Some(v) = d.debt_cap_per_task {
            policy.drr.debt_cap_per_task = Units::whole(v);
        }
        let a = &self.aging;
        if let Some(v) = a.aging_step_s {
            policy.aging.aging_step_ms = v * 1000;
        }
        if let Some(v) = a.fit_scan_max {
            policy.aging.fit_scan_max = v;
        }
        if let Some(v) = a.skips_max {
            policy.aging.skips_max = v;
        }
        if let Some(v) = self.reserve.borrow_limit {
            policy.reserve.borrow_limit = Units::whole(v);
        }
        if let Some(v) = self.reserve.minimum_reserved_headroom {
            policy.reserve.minimum_reserved_headroom = Units::whole(v);
        }
        let n = &self.node;
        if let Some(v) = n.global_queued_tasks_max {
            policy.node.global_queued_tasks_max = v;
        }
        if let Some(v) = n.high_cost_concurrency {
            policy.node.high_cost_concurrency = v;
        }
        if let Some(v) = n.model_running_max {
            policy.node.model_running_max = v;
        }
        if let Some(v) = n.global_running_tasks_max {
            policy.node.global_running_tasks_max = v;
        }
        if let Some(v) = n.global_running_units_max {
            policy.node.global_running_units_max = Units::whole(v);
        }
        if let Some(v) = n.platform_cost_per_minute {
            policy.node.platform_cost_per_minute = RateSpec {
                per_minute: v,
                burst: v,
            };
        }
        if let Some(v) = n.gpu_units {
            policy.node.gpu_units = v;
        }
        if let Some(v) = n.cpu_units {
            policy.node.cpu_units = v;
        }
        policy.providers = self
            .providers
            .iter()
            .enumerate()
            .map(|(i, p)| ProviderPolicy {
                id: ProviderId(i as u16),
                name: p.name.clone(),
                concurrency: *p.concurrency.get_ref(),
                rpm: RateSpec {
                    per_minute: p.rpm,
                    burst: p.rpm_burst,
                },
            })
            .collect();
        let all: Vec<ProviderId> = (0..self.providers.len() as u16).map(ProviderId).collect();
        policy.models = vec![example_model(ModelId(0), all)];
        for (tenant, group) in self.tenant_ids() {
            let mut t = presets::tenant(group.lane, *group.weight.get_ref());
            if let Some(b) = group.base_band {
                t.base_band = b;
            }
            if let Some(v) = group.queued_tasks_max {
                t.queued_tasks_max = v;
            }
            if let Some(v) = group.running_tasks_max {
                t.running_tasks_max = v;
            }
            if let Some(v) = group.max_wait_s {
                t.max_wait_ms = v * 1000;
            }
            policy.tenants.insert(tenant, t);
        }
        policy
    }

    /// Every tenant with its group, ids from 1 in file order.
    pub fn tenant_ids(&self) -> impl Iterator<Item = (TenantId, &TenantGroup)> {
        let mut next = 0u32;
        self.tenants.iter().flat_map(move |g| {
            let first = next + 1;
            next += *g.count.get_ref() as u32;
            (first..=next).map(move |t| (TenantId(t), g))
        })
    }
}

#[cfg(test)]
mod tests {
    use expect_test::expect;

    use super::*;

    const GOOD: &str = r#"
name = "tiny"
duration_s = 60
starvation_bound_s = 600
[[providers]]
name = "p"
concurrency = 10
rpm = 600
rpm_burst = 10
[[tenants]]
name = "t"
count = 2
lane = "STANDARD"
arrival = { kind = "poisson", rate_per_s = 0.5 }
mix = [{ res = "720p", duration_s = 5 }]
"#;

    fn err(text: &str) -> String {
        Scenario::parse(Path::new("s.toml"), text)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn good_file_parses_and_builds_a_valid_policy() {
        let s = Scenario::parse(Path::new("s.toml"), GOOD).unwrap();
        assert_eq!(s.tenant_count(), 2);
        s.policy().validate().unwrap();
    }

    #[test]
    fn errors_name_file_line_and_field() {
        expect!["s.toml:16:1: unknown field `colour`, expected one of `name`, `count`, `lane`, `weight`, `base_band`, `users`, `arrival`, `mix`, `queued_tasks_max`, `running_tasks_max`, `max_wait_s`"]
            .assert_eq(&err(&format!("{GOOD}colour = \"red\"\n")));
        expect!["s.toml:7:15: field `providers[0].concurrency`: 0 is outside 1..=4294967296"]
            .assert_eq(&err(&GOOD.replace("concurrency = 10", "concurrency = 0")));
        expect!["s.toml:13:8: unknown variant `FAST`, expected one of `ENTERPRISE_RESERVED`, `PAID_SHARED`, `STANDARD`, `BEST_EFFORT`, `EXPENSIVE`, `RECOVERY`"]
            .assert_eq(&err(&GOOD.replace("\"STANDARD\"", "\"FAST\"")));
        expect!["s.toml:14:11: field `tenants[0].arrival`: rate_per_s -1 is outside (0, 1e6]"]
            .assert_eq(&err(&GOOD.replace("0.5", "-1")));
        expect!["s.toml:15:7: field `tenants[0].mix`: duration_s and weight must be positive (got MixEntry { res: P720, duration_s: 0, weight: 1, fps: 24, audio: false, references: 0, band: None })"]
            .assert_eq(&err(&GOOD.replace("duration_s = 5", "duration_s = 0")));
        expect!["s.toml:17:1: policy: drr.burst_rounds: 1 is outside 2..=64"]
            .assert_eq(&err(&format!("{GOOD}[drr]\nburst_rounds = 1\n")));
        expect!["s.toml:1:1: missing field `starvation_bound_s`"]
            .assert_eq(&err(&GOOD.replace("starvation_bound_s = 600\n", "")));
    }
}
