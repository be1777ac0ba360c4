//! Overload control: a new submit is admitted only while the durable path can make it durable
//! within `ack_budget_ms`; past that it is refused at once, `REJECT_PLATFORM_OVERLOADED` with a
//! `retry_after_ms` hint, without touching PostgreSQL.
//!
//! The durable path is a pair of pipelines (`spindle_node_control::control`): the submit connection, and the
//! claim-and-report connection that finishes accepted work. Each has a [`PathGauge`]: the rows
//! waiting for a call (counted from the moment a shard admits them: a [`Queued`] guard travels
//! with the message and is dropped when the pipeline takes it), the call in flight, and a model
//! of how long a call of `n` rows takes — a line `fixed + n × per_row` fitted by the pipeline
//! over its recent calls ([`CallModel`]), so that the bound follows the host's speed. From
//! those a gauge predicts how long rows sent now wait for their commit ([`PathGauge::wait`]):
//! what remains of the call in flight (one that overran its model is expected to take as long
//! again as it has so far: a stalled store keeps raising the prediction), then the calls the
//! rows ahead need.
//!
//! The gate ([`Gate::judge`]) takes the submit path's prediction, scaled by how much longer
//! committed frames really waited than predicted ([`Calibration`]: the hops to the pipeline's
//! thread and back, the shard's turn), over the budget as the pressure `p`, and compares it with
//! the frame's tenant's level ([`level`]): a share of the budget that is smaller the more the
//! tenant offers per unit of weight against the node's active tenants' mean — an eighth for a
//! tenant at or over the mean, the whole budget for one at an eighth of it, twice the budget for
//! the quietest. Under its
//! level a frame is admitted; from twice it (or the whole budget) it is refused; in between it
//! is refused with a probability rising in proportion, so that tenants offering alike are
//! refused alike (random early refusal: deterministic thresholds let the phase of a tenant's
//! frames against the calls decide who gets in). So a whale is shed before quiet tenants, who
//! keep their acks within the budget, and tenants sharing alike are held between an eighth and
//! a quarter of it. The levels apply only while a queue stands ([`Standing`], as CoDel tells a
//! standing queue from a burst): until then — a light load whose store hiccups — every tenant
//! is admitted up to the whole budget.
//!
//! Claims and reports are never refused. The work path's wait is held to four times the budget
//! by the same levels ([`WORK_BUDGETS`]): when accepted work is not keeping up, new submits are
//! refused until it does — the node finishes accepted work before it starts new work ("finish
//! before start"). A task is refused here or never: once admitted it goes to its commit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use spindle_core::TenantId;

/// What a call is assumed to cost before any has been measured, and the prior the fitted model
/// leans on where the calls seen say little (all of one size): 1 ms a call and 20 µs a row,
/// about what a submit call cost on the 2-core development machine (docs/benchmarks/journal.md,
/// round 35).
const PRIOR_FIXED_NS: f64 = 1_000_000.0;
const PRIOR_ROW_NS: f64 = 20_000.0;
/// Weight of the prior's two points against the decayed weight of the calls seen (which tends
/// to `1 / CALL_DECAY` = 32).
const PRIOR_WEIGHT: f64 = 0.05;
const CALL_DECAY: f64 = 1.0 / 32.0;
/// How long the submit path must have been idle before a frame its model would refuse goes
/// through all the same, to measure it again ([`Gate::judge`]).
pub const PROBE_AFTER: Duration = Duration::from_millis(250);
/// How far off the model one call may pull it ([`CallModel::observe`]), once it has seen this
/// many calls' worth (decayed) to be off from.
const OUTLIER_FACTOR: f64 = 4.0;
const CALLS_BEFORE_BOUND: f64 = 8.0;
/// The model's bounds: a call fixed cost and a row's cost never read as more than this.
const FIXED_NS_MAX: f64 = 1e9;
const ROW_NS_MAX: f64 = 1e6;

/// The time constant of a tenant's offered rate (an exponentially decayed count).
const OFFER_TAU_S: f64 = 1.0;
/// A tenant offering less than this (tasks a second) is no longer counted active.
const OFFER_ACTIVE_MIN: f64 = 0.01;
/// The longest hint given.
const RETRY_AFTER_MAX_MS: u64 = 10_000;
/// The work path's waits are held to this many ack budgets: they delay completions, not
/// acknowledgements, and a report call waits for a fuller batch (`report_hold_us`) by design.
/// At two, the work path's levels held the node's goodput at saturation lower (25,478 against
/// 28,640 tasks a second at twice the maximum, budget 50 ms, one spell; docs/benchmarks/journal.md,
/// "Goodput under overload").
pub const WORK_BUDGETS: f64 = 4.0;

/// One pipeline's load as the shards see it (shared between the pipeline's thread and the
/// shards' threads: plain atomics).
pub struct PathGauge {
    epoch: Instant,
    batch_max: u64,
    /// Rows admitted or sent and not yet taken into a call (briefly below zero is possible:
    /// read as zero).
    queued: AtomicI64,
    in_call_rows: AtomicU64,
    /// When the call in flight started, in ns since `epoch` plus one; 0 while none runs.
    call_started: AtomicU64,
    /// The call model: ns a call, and ps a row.
    fixed_ns: AtomicU64,
    row_ps: AtomicU64,
    /// When the last call ended, in ns since `epoch` (0: none yet).
    last_end: AtomicU64,
    /// The [`Calibration`] ratio its shards learn together (f64 bits): the hops a commit
    /// waits for beyond its calls are much the same for every shard of the pair.
    calibration: AtomicU64,
}

impl PathGauge {
    pub fn new(batch_max: usize) -> Arc<PathGauge> {
        PathGauge::since(batch_max, Instant::now())
    }

    /// A gauge whose clock starts at `epoch`.
    fn since(batch_max: usize, epoch: Instant) -> Arc<PathGauge> {
        Arc::new(PathGauge {
            epoch,
            batch_max: batch_max.max(1) as u64,
            queued: AtomicI64::new(0),
            in_call_rows: AtomicU64::new(0),
            call_started: AtomicU64::new(0),
            fixed_ns: AtomicU64::new(PRIOR_FIXED_NS as u64),
            row_ps: AtomicU64::new((PRIOR_ROW_NS * 1e3) as u64),
            calibration: AtomicU64::new(1f64.to_bits()),
            last_end: AtomicU64::new(0),
        })
    }

    /// How long the path has had nothing to do: no call in flight, no row waiting, since its
    /// last call ended (zero while it works).
    pub fn idle_for(&self) -> Duration {
        if self.call_started.load(Relaxed) != 0 || self.queued() > 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.now_ns().saturating_sub(self.last_end.load(Relaxed)))
    }

    /// The shared calibration now.
    pub fn calibration(&self) -> Calibration {
        Calibration {
            ratio: f64::from_bits(self.calibration.load(Relaxed)),
        }
    }

    /// A committed frame predicted to wait `predicted` waited `actual`. (Two shards learning at
    /// once may lose one's step: a decayed mean does not mind.)
    pub fn calibrate(&self, predicted: Duration, actual: Duration) {
        let mut c = self.calibration();
        c.observe(predicted, actual);
        self.calibration.store(c.ratio.to_bits(), Relaxed);
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Counts `rows` as waiting until the guard is dropped (by the pipeline when it takes
    /// them into a call, or wherever they go instead).
    pub fn enqueue(self: &Arc<Self>, rows: usize) -> Queued {
        self.queued.fetch_add(rows as i64, Relaxed);
        Queued {
            gauge: Some(self.clone()),
            rows: rows as i64,
        }
    }

    /// Rows waiting now.
    pub fn queued(&self) -> u64 {
        self.queued.load(Relaxed).max(0) as u64
    }

    /// A call of `rows` starts (the pipeline's).
    pub fn call_started(&self, rows: usize) {
        self.in_call_rows.store(rows as u64, Relaxed);
        self.call_started.store(self.now_ns() + 1, Relaxed);
    }

    /// The call in flight ended; `model` is the fit with it.
    pub fn call_ended(&self, model: (f64, f64)) {
        self.last_end.store(self.now_ns(), Relaxed);
        self.call_started.store(0, Relaxed);
        self.in_call_rows.store(0, Relaxed);
        self.fixed_ns.store(model.0 as u64, Relaxed);
        self.row_ps.store((model.1 * 1e3) as u64, Relaxed);
    }

    /// The model in use: (ns a call, ns a row).
    pub fn model(&self) -> (f64, f64) {
        (
            self.fixed_ns.load(Relaxed) as f64,
            self.row_ps.load(Relaxed) as f64 / 1e3,
        )
    }

    /// How long `extra` rows sent now would wait for the end of their call: what remains of
    /// the call in flight, then the calls of every row ahead and theirs.
    pub fn wait(&self, extra: usize) -> Duration {
        let (fixed, row) = self.model();
        let started = self.call_started.load(Relaxed);
        let remaining = if started == 0 {
            0.0
        } else {
            let expected = fixed + row * self.in_call_rows.load(Relaxed) as f64;
            let elapsed = self.now_ns().saturating_sub(started - 1) as f64;
            // A call past its model is expected to take as long again as it has so far.
            if elapsed <= expected {
                expected - elapsed
            } else {
                elapsed - expected
            }
        };
        let rows = self.queued() + extra as u64;
        let calls = rows.div_ceil(self.batch_max).max(1);
        let ns = remaining + calls as f64 * fixed + rows as f64 * row;
        Duration::from_nanos(ns as u64)
    }
}

/// A pair of pipelines' gauges: (submit, work).
pub type Paths = (Arc<PathGauge>, Arc<PathGauge>);

/// Rows counted as waiting in a [`PathGauge`] while this lives.
pub struct Queued {
    gauge: Option<Arc<PathGauge>>,
    rows: i64,
}

impl Queued {
    /// Counts nothing (for messages no gauge follows: tests).
    pub fn none() -> Queued {
        Queued {
            gauge: None,
            rows: 0,
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some(g) = &self.gauge {
            g.queued.fetch_sub(self.rows, Relaxed);
        }
    }
}

/// The line `duration = fixed + rows × per_row` fitted by weighted least squares over a
/// pipeline's calls, the older ones decayed, with a prior of two points (`PRIOR_*`) so that
/// calls all of one size still give a usable slope.
#[derive(Debug, Clone, Default)]
pub struct CallModel {
    w: f64,
    n: f64,
    d: f64,
    nn: f64,
    nd: f64,
    batch_max: f64,
}

impl CallModel {
    pub fn new(batch_max: usize) -> CallModel {
        CallModel {
            batch_max: batch_max.max(1) as f64,
            ..CallModel::default()
        }
    }

    /// A call of `rows` took `took`; returns the model (ns a call, ns a row). A call far off
    /// the model (a stall of the store, a flush) is taken as at most `OUTLIER_FACTOR` times
    /// off it: one stall must not teach the model a cost that makes the gate refuse nearly
    /// everything — and so starve it of the calls that would teach it better. (The stall
    /// itself weighs while it lasts: [`PathGauge::wait`] counts a call past its model.) A
    /// lasting change still moves the model, by up to that factor every few calls.
    pub fn observe(&mut self, rows: usize, took: Duration) -> (f64, f64) {
        let keep = 1.0 - CALL_DECAY;
        let n = rows as f64;
        let d = if self.w >= CALLS_BEFORE_BOUND {
            let (fixed, row) = self.fit();
            let expected = (fixed + row * n).max(1.0);
            (took.as_nanos() as f64).clamp(expected / OUTLIER_FACTOR, expected * OUTLIER_FACTOR)
        } else {
            took.as_nanos() as f64
        };
        self.w = self.w * keep + 1.0;
        self.n = self.n * keep + n;
        self.d = self.d * keep + d;
        self.nn = self.nn * keep + n * n;
        self.nd = self.nd * keep + n * d;
        self.fit()
    }

    /// The fitted (ns a call, ns a row).
    pub fn fit(&self) -> (f64, f64) {
        // The prior: a call of no rows and one of `batch_max` rows, as PRIOR_* price them.
        let big = self.batch_max;
        let w = self.w + 2.0 * PRIOR_WEIGHT;
        let n = self.n + PRIOR_WEIGHT * big;
        let d = self.d + PRIOR_WEIGHT * (2.0 * PRIOR_FIXED_NS + big * PRIOR_ROW_NS);
        let nn = self.nn + PRIOR_WEIGHT * big * big;
        let nd = self.nd + PRIOR_WEIGHT * big * (PRIOR_FIXED_NS + big * PRIOR_ROW_NS);
        let (mean_n, mean_d) = (n / w, d / w);
        let var = nn / w - mean_n * mean_n;
        let cov = nd / w - mean_n * mean_d;
        let mut row = if var > 0.0 { cov / var } else { PRIOR_ROW_NS };
        let mut fixed = mean_d - row * mean_n;
        if row < 0.0 {
            row = 0.0;
            fixed = mean_d;
        }
        if fixed < 0.0 {
            fixed = 0.0;
            row = if mean_n > 0.0 {
                mean_d / mean_n
            } else {
                PRIOR_ROW_NS
            };
        }
        (fixed.min(FIXED_NS_MAX), row.min(ROW_NS_MAX))
    }
}

/// What each shard's tenants offer, published every shard tick so that any shard can tell a
/// tenant's offer against the node's: per shard, the sum of its active tenants' offered rates
/// (tasks a second) and of their weights.
pub struct OfferBoard {
    shards: Vec<(AtomicU64, AtomicU64)>,
}

impl OfferBoard {
    pub fn new(shards: usize) -> Arc<OfferBoard> {
        Arc::new(OfferBoard {
            shards: (0..shards)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
        })
    }

    fn publish(&self, shard: usize, rate: f64, weight: f64) {
        if let Some((r, w)) = self.shards.get(shard) {
            r.store(rate.to_bits(), Relaxed);
            w.store(weight.to_bits(), Relaxed);
        }
    }

    /// The sums of every shard but `except` (whose own are fresher where it asks).
    fn others(&self, except: usize) -> (f64, f64) {
        self.shards
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != except)
            .fold((0.0, 0.0), |(rate, weight), (_, (r, w))| {
                (
                    rate + f64::from_bits(r.load(Relaxed)),
                    weight + f64::from_bits(w.load(Relaxed)),
                )
            })
    }
}

/// An exponentially decayed count of tasks, read as a rate (tasks a second).
#[derive(Debug, Clone, Copy)]
struct Rate {
    value: f64,
    at: Instant,
}

impl Rate {
    fn at(&self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.value * (-dt / OFFER_TAU_S).exp()
    }

    fn add(&mut self, now: Instant, tasks: f64) {
        self.value = self.at(now) + tasks / OFFER_TAU_S;
        self.at = now;
    }
}

/// Why a frame is refused, and when to come back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: String,
    pub retry_after_ms: u32,
}

/// The pressure level a verdict was reached at (for `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// Past its tenant's level: a share of the budget that is smaller the more the tenant
    /// sends for its weight ([`level`]).
    OverShare = 0,
    /// The submit path was past the budget.
    Full = 1,
    /// The work path (claims and reports of accepted work) was past the budget.
    Behind = 2,
}

impl Shed {
    pub const ALL: [Shed; 3] = [Shed::OverShare, Shed::Full, Shed::Behind];

    pub fn name(self) -> &'static str {
        match self {
            Shed::OverShare => "over_share",
            Shed::Full => "full",
            Shed::Behind => "behind",
        }
    }
}

/// The share of the budget from which a tenant offering `x` times the node's mean per unit of
/// weight may be refused: an eighth for a tenant at or over the mean, rising in inverse
/// proportion as its offer falls — the whole budget at an eighth of the mean — up to twice the
/// budget for the quietest (a sixteenth of the mean or less), so that a store's hiccup under
/// overload does not refuse them either.
pub fn level(x: f64) -> f64 {
    if x.is_nan() {
        return 1.0;
    }
    (LEVEL_MIN / x.max(1e-9)).clamp(LEVEL_MIN, LEVEL_MAX)
}

/// The level of a tenant at or over the mean: tenants sending alike are held between this and
/// twice it of the budget.
pub const LEVEL_MIN: f64 = 0.125;
/// The level of the quietest tenants.
pub const LEVEL_MAX: f64 = 2.0;

/// The pure decision for a tenant offering `x` times the node's mean per unit of weight, from
/// the paths' pressures — `submit`: the submit path's wait over the budget; `work`: the work
/// path's over [`WORK_BUDGETS`] times it (its waits delay completions, not acknowledgements) —
/// and `draw`, a
/// number drawn uniformly from [0, 1). On each path a tenant is admitted under its [`level`];
/// under the whole budget it is refused from twice its level, and in between with a
/// probability rising in proportion: random early refusal (as RED drops packets), so that
/// tenants offering alike are refused alike instead of by the phase of their frames against
/// the calls. A level of the whole budget or more is a plain bound. `None`: admitted.
pub fn verdict(submit: f64, work: f64, x: f64, draw: f64) -> Option<Shed> {
    let low = level(x);
    let high = (2.0 * low).min(1.0).max(low);
    let refused = |p: f64| p >= high || (p >= low && draw < (p - low) / (high - low));
    if refused(work) {
        Some(Shed::Behind)
    } else if refused(submit) && submit >= 1.0 {
        Some(Shed::Full)
    } else if refused(submit) {
        Some(Shed::OverShare)
    } else {
        None
    }
}

/// Whether a queue stands (CoDel's distinction between a burst that drains by itself and a
/// queue that stays): the per-tenant levels apply only while one does. It stands once the
/// pressure has stayed at or over the heaviest senders' level ([`LEVEL_MIN`]) for
/// [`STANDING_INTERVAL`] — less the further over it is, by the square: a sixty-fourth of it at
/// eight times the level — and until an interval passes without a frame at that level. Outside,
/// every tenant is admitted up to the whole budget: a hiccup of the store under a light load
/// refuses no one, however unevenly its few tenants send.
#[derive(Debug, Clone, Copy)]
pub struct Standing {
    /// Since when every frame judged found the pressure at or over the level.
    above_since: Option<Instant>,
    /// The last frame that did.
    last_above: Option<Instant>,
    on: bool,
}

/// How long the pressure must stay at the heaviest senders' level before a queue is taken as
/// standing (at the level; less above it), and how long under it before it no longer is.
pub const STANDING_INTERVAL: Duration = Duration::from_millis(50);

impl Standing {
    pub const fn new() -> Standing {
        Standing {
            above_since: None,
            last_above: None,
            on: false,
        }
    }

    /// A frame judged at `now` found the pressure `p`: whether a queue stands now.
    pub fn note(&mut self, now: Instant, p: f64) -> bool {
        if p >= LEVEL_MIN {
            let since = *self.above_since.get_or_insert(now);
            self.last_above = Some(now);
            let needed = STANDING_INTERVAL.mul_f64((LEVEL_MIN / p).min(1.0).powi(2));
            if now.saturating_duration_since(since) >= needed {
                self.on = true;
            }
        } else {
            self.above_since = None;
            let quiet_for = self
                .last_above
                .map_or(Duration::MAX, |t| now.saturating_duration_since(t));
            if quiet_for >= STANDING_INTERVAL {
                self.on = false;
            }
        }
        self.on
    }
}

impl Default for Standing {
    fn default() -> Standing {
        Standing::new()
    }
}

/// The hint a refusal at `wait` gives: the time the work ahead needs to fall below the level
/// of the heaviest senders (an eighth of the budget), at least an eighth of the budget.
pub fn retry_after(wait: Duration, budget: Duration) -> u32 {
    let ms = wait
        .saturating_sub(budget.mul_f64(LEVEL_MIN))
        .max(budget.mul_f64(LEVEL_MIN))
        .as_millis()
        .max(1) as u64;
    ms.min(RETRY_AFTER_MAX_MS) as u32
}

/// How much longer a committed frame really waited than its prediction said, as a decayed mean
/// of the ratio (bounded): the predictions count a call's time in PostgreSQL but not the hops
/// around it (to the pipeline's thread and back, the shard's turn), which grow when the host's
/// cores are busy. The gate scales its predictions by it.
#[derive(Debug, Clone, Copy)]
pub struct Calibration {
    ratio: f64,
}

/// Predictions shorter than this say too little of the hops to learn from.
const CALIBRATION_MIN: Duration = Duration::from_millis(1);
const CALIBRATION_DECAY: f64 = 1.0 / 64.0;
const CALIBRATION_RANGE: (f64, f64) = (0.5, 4.0);

impl Default for Calibration {
    fn default() -> Calibration {
        Calibration { ratio: 1.0 }
    }
}

impl Calibration {
    pub fn observe(&mut self, predicted: Duration, actual: Duration) {
        if predicted < CALIBRATION_MIN {
            return;
        }
        let r = (actual.as_secs_f64() / predicted.as_secs_f64())
            .clamp(CALIBRATION_RANGE.0, CALIBRATION_RANGE.1);
        self.ratio += (r - self.ratio) * CALIBRATION_DECAY;
    }

    pub fn scale(&self, predicted: Duration) -> Duration {
        predicted.mul_f64(self.ratio)
    }

    pub fn ratio(&self) -> f64 {
        self.ratio
    }
}

/// One shard's gate for new submits (on the shard's thread).
pub struct Gate {
    budget: Duration,
    submits: Arc<PathGauge>,
    work: Arc<PathGauge>,
    board: Arc<OfferBoard>,
    shard: usize,
    /// This shard's tenants' offered rates, and their sum (decayed alike, so it is the sum of
    /// theirs) and the sum of the active ones' weights (kept at each tick).
    offers: HashMap<TenantId, (Rate, u32)>,
    total: Rate,
    weights: f64,
    /// Refused tasks by [`Shed`], for `/metrics`.
    pub refused: Arc<[AtomicU64; 3]>,
    /// The state of [`Gate::draw`] (never zero).
    rng: u64,
    standing: Standing,
}

impl Gate {
    pub fn new(
        budget: Duration,
        submits: Arc<PathGauge>,
        work: Arc<PathGauge>,
        board: Arc<OfferBoard>,
        shard: usize,
        refused: Arc<[AtomicU64; 3]>,
    ) -> Gate {
        let now = Instant::now();
        Gate {
            budget,
            submits,
            work,
            board,
            shard,
            offers: HashMap::new(),
            total: Rate {
                value: 0.0,
                at: now,
            },
            weights: 0.0,
            refused,
            rng: 0x9e37_79b9_7f4a_7c15 ^ (shard as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9),
            standing: Standing::new(),
        }
    }

    /// The submit path's wait for `rows` more sent now (calibrated): what the tenant levels
    /// apply to.
    pub fn wait(&self, rows: usize) -> Duration {
        self.submits.calibration().scale(self.submits.wait(rows))
    }

    /// The work path's wait for what it holds now: held to [`WORK_BUDGETS`] budgets (past
    /// them accepted work is not keeping up, and nothing new is admitted).
    pub fn work_wait(&self) -> Duration {
        self.work.wait(0)
    }

    /// A number drawn uniformly from [0, 1) (xorshift64*).
    fn draw(&mut self) -> f64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The submit path's raw prediction for `rows` sent now: what [`Gate::observe`] is later
    /// told with the wait it came to.
    pub fn predict(&self, rows: usize) -> Duration {
        self.submits.wait(rows)
    }

    /// A committed frame, predicted to wait `predicted`, waited `actual` from its admission to
    /// its answer.
    pub fn observe(&mut self, predicted: Duration, actual: Duration) {
        self.submits.calibrate(predicted, actual);
    }

    /// The calibration's ratio now (for `/metrics`).
    pub fn calibration(&self) -> f64 {
        self.submits.calibration().ratio()
    }

    /// A frame of `rows` tasks from `tenant` (of DRR weight `weight`): counted as offered, and
    /// refused with a reason and a hint where the durable path is too full for it.
    pub fn judge(
        &mut self,
        now: Instant,
        tenant: TenantId,
        weight: u32,
        rows: usize,
    ) -> Option<Refusal> {
        let weight = weight.max(1);
        let entry = self.offers.entry(tenant).or_insert_with(|| {
            self.weights += f64::from(weight);
            (
                Rate {
                    value: 0.0,
                    at: now,
                },
                weight,
            )
        });
        entry.0.add(now, rows as f64);
        let tenant_rate = entry.0.at(now);
        self.total.add(now, rows as f64);
        if self.budget.is_zero() {
            return None;
        }
        let (submit, work) = (self.wait(rows), self.work_wait());
        let (others_rate, others_weight) = self.board.others(self.shard);
        let weights = (self.weights + others_weight).max(1.0);
        // A tenant's offer per unit of weight is told against the active tenants' mean, or —
        // where they offer less in all than the submit path could take (the inverse of a row's
        // cost) — against that capacity's share per unit of weight: a tenant sending most of
        // a light load is no whale.
        let capacity = 1e9 / self.submits.model().1.max(1.0);
        let mean = (self.total.at(now) + others_rate).max(capacity) / weights;
        let norm = tenant_rate / f64::from(weight);
        let budget = self.budget.as_secs_f64();
        let (p_submit, p_work) = (
            submit.as_secs_f64() / budget,
            work.as_secs_f64() / (WORK_BUDGETS * budget),
        );
        // Without a standing queue, no tenant is told apart (x = 0: the whole budget).
        let x = match self.standing.note(now, p_submit.max(p_work)) {
            true if mean > 0.0 => norm / mean,
            true => 1.0,
            false => 0.0,
        };
        let shed = verdict(p_submit, p_work, x, self.draw())?;
        if shed != Shed::Behind && self.submits.idle_for() >= PROBE_AFTER {
            // The submit path is idle, so the wait predicted is the model's alone: a frame
            // goes through to measure it again (a model taught a cost the store no longer has
            // would otherwise refuse the very calls that would correct it).
            return None;
        }
        let wait = submit.max(work);
        self.refused[shed as usize].fetch_add(rows as u64, Relaxed);
        let budget_ms = self.budget.as_millis();
        let reason = match shed {
            Shed::Full => format!(
                "the node is overloaded: a submit would wait {} ms for its commit, past the \
                 {budget_ms} ms budget",
                wait.as_millis()
            ),
            Shed::Behind => format!(
                "the node is overloaded: the claims and reports of accepted work would wait {} \
                 ms, past the {budget_ms} ms budget; it finishes them before it takes new work",
                work.as_millis()
            ),
            Shed::OverShare => format!(
                "the node is overloaded (a submit would wait {} ms of its {budget_ms} ms budget); \
                 the tenants sending the most for their weight are refused first, and this one \
                 sends {:.1} times the average",
                wait.as_millis(),
                x
            ),
        };
        Some(Refusal {
            reason,
            retry_after_ms: retry_after(wait, self.budget),
        })
    }

    /// Every shard tick: tenants idle long enough are forgotten, the weights summed again, and
    /// this shard's sums published.
    pub fn tick(&mut self, now: Instant) {
        self.offers
            .retain(|_, (r, _)| r.at(now) >= OFFER_ACTIVE_MIN);
        self.weights = self.offers.values().map(|(_, w)| f64::from(*w)).sum();
        let rate = if self.offers.is_empty() {
            self.total = Rate {
                value: 0.0,
                at: now,
            };
            0.0
        } else {
            self.total.at(now)
        };
        self.board.publish(self.shard, rate, self.weights);
    }

    /// Tenants this shard counts as offering work now.
    pub fn active_tenants(&self) -> usize {
        self.offers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_model_follows_the_calls_and_leans_on_the_prior_where_they_say_little() {
        // Calls of 2 ms + 10 µs a row over a spread of sizes: the fit finds the line.
        let mut m = CallModel::new(1024);
        for i in 0..400 {
            let rows = 10 + (i * 37) % 1000;
            m.observe(rows, Duration::from_nanos(2_000_000 + 10_000 * rows as u64));
        }
        let (fixed, row) = m.fit();
        assert!((fixed - 2e6).abs() < 0.2e6, "{fixed}");
        assert!((row - 10e3).abs() < 1e3, "{row}");
        // Calls all of one row (an idle node) at 0.4 ms: a call of one row is read as about
        // that, and a large one is not read as a thousand times it.
        let mut idle = CallModel::new(1024);
        for _ in 0..200 {
            idle.observe(1, Duration::from_micros(400));
        }
        let (fixed, row) = idle.fit();
        let one = fixed + row;
        assert!((300e3..700e3).contains(&one), "{one}");
        let full = fixed + 1024.0 * row;
        assert!(full < 40e6, "{full}");
    }

    #[test]
    fn a_stall_moves_the_model_a_little_and_a_lasting_change_moves_it_all_the_way() {
        let mut m = CallModel::new(1024);
        let call = |m: &CallModel, rows: f64| {
            let (fixed, row) = m.fit();
            fixed + row * rows
        };
        for i in 0..200 {
            let rows = 10 + (i * 37) % 500;
            m.observe(rows, Duration::from_nanos(1_000_000 + 20_000 * rows as u64));
        }
        let before = call(&m, 64.0);
        // One call stalled for 10 s: a 64-row call is still read as a few ms, not seconds.
        m.observe(64, Duration::from_secs(10));
        let after = call(&m, 64.0);
        assert!(after < before * 1.5, "{before} → {after}");
        // The host slows down three times for good: the model follows within a few hundred
        // calls.
        for i in 0..400 {
            let rows = 10 + (i * 37) % 500;
            m.observe(
                rows,
                Duration::from_nanos(3 * (1_000_000 + 20_000 * rows as u64)),
            );
        }
        let slow = call(&m, 64.0);
        assert!((slow / before - 3.0).abs() < 0.3, "{before} → {slow}");
    }

    #[test]
    fn an_idle_path_lets_a_frame_through_to_measure_a_model_that_refuses_everything() {
        let submits = PathGauge::since(1024, Instant::now() - Duration::from_secs(1));
        let work = PathGauge::new(1024);
        // A model that prices a row at a millisecond: a frame of 64 reads as 65 ms.
        submits.call_ended((1e6, 1e6));
        let refused: Arc<[AtomicU64; 3]> = Arc::default();
        let mut gate = Gate::new(
            20 * MS,
            submits.clone(),
            work,
            OfferBoard::new(1),
            0,
            refused,
        );
        let now = Instant::now();
        let whale = TenantId(1);
        assert!(gate.judge(now, whale, 1, 64).is_some());
        // Idle for a while (no call in flight, nothing waiting, none ended for a second): one
        // gets by.
        submits.last_end.store(0, Relaxed);
        assert_eq!(gate.judge(now, whale, 1, 64), None);
        // Not while anything waits or runs: that wait is real.
        let _q = submits.enqueue(1);
        assert!(gate.judge(now, whale, 1, 64).is_some());
    }

    #[test]
    fn a_gauge_predicts_the_queue_and_a_stalled_call_keeps_raising_it() {
        let g = PathGauge::new(100);
        g.call_ended((1e6, 10e3));
        assert_eq!(g.wait(0), Duration::from_millis(1));
        let q = g.enqueue(150);
        // Two calls (batch_max 100): 2 × 1 ms + 150 × 10 µs.
        assert_eq!(g.wait(0), Duration::from_micros(3_500));
        assert_eq!(g.queued(), 150);
        drop(q);
        assert_eq!(g.queued(), 0);
        // A call of 100 rows is expected to take 2 ms; one that has run far past it is
        // expected to take as long again.
        g.call_started(100);
        assert!(g.wait(0) <= Duration::from_millis(3));
        g.call_started.store(1, Relaxed); // started at the epoch
        std::thread::sleep(Duration::from_millis(20));
        assert!(g.wait(0) >= Duration::from_millis(18), "{:?}", g.wait(0));
    }

    #[test]
    fn verdicts_shed_the_tenants_over_their_share_first() {
        // The levels: an eighth of the budget at or over the mean, all of it at an eighth of
        // the mean or under, in between in proportion.
        assert_eq!(level(1.0), 0.125);
        assert_eq!(level(100.0), 0.125);
        assert_eq!(level(0.5), 0.25);
        assert_eq!(level(0.0625), 2.0);
        assert_eq!(level(0.0), 2.0);
        let refused = |submit: f64, work: f64, x: f64| -> f64 {
            let n = 10_000;
            let hits = (0..n)
                .filter(|i| verdict(submit, work, x, (*i as f64 + 0.5) / n as f64).is_some())
                .count();
            hits as f64 / n as f64
        };
        // A tenant at or over the mean: in under an eighth, out from a quarter, in between in
        // proportion.
        assert_eq!(refused(0.12, 0.0, 3.0), 0.0);
        assert!((refused(0.15, 0.0, 3.0) - 0.2).abs() < 1e-3);
        assert!((refused(0.1875, 0.0, 1.0) - 0.5).abs() < 1e-3);
        assert_eq!(refused(0.25, 0.0, 1.0), 1.0);
        assert_eq!(verdict(0.15, 0.0, 1.0, 0.0), Some(Shed::OverShare));
        // A tenant at half the mean: from a quarter to half the budget.
        assert_eq!(refused(0.24, 0.0, 0.5), 0.0);
        assert!((refused(0.375, 0.0, 0.5) - 0.5).abs() < 1e-3);
        // One at an eighth of the mean: only past the whole budget, on either path.
        assert_eq!(level(0.125), 1.0);
        assert_eq!(refused(0.99, 0.99, 0.125), 0.0);
        assert_eq!(verdict(1.0, 0.0, 0.125, 0.99), Some(Shed::Full));
        assert_eq!(verdict(0.0, 1.0, 0.125, 0.99), Some(Shed::Behind));
        // The quietest: up to twice the budget.
        assert_eq!(level(0.01), 2.0);
        assert_eq!(refused(1.99, 1.99, 0.01), 0.0);
        assert_eq!(verdict(2.0, 0.0, 0.01, 0.99), Some(Shed::Full));
        // The work path's levels are the submit path's.
        assert!((refused(0.0, 0.1875, 1.0) - 0.5).abs() < 1e-3);
        // The hint: the time to fall below an eighth of the budget, at least an eighth of it.
        let budget = 80 * MS;
        assert_eq!(retry_after(30 * MS, budget), 20);
        assert_eq!(retry_after(12 * MS, budget), 10);
        assert_eq!(retry_after(Duration::from_secs(60), budget), 10_000);
    }

    #[test]
    fn a_queue_stands_once_the_pressure_stays_up_for_an_interval() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut s = Standing::new();
        // A hiccup: one frame over the level, then under it.
        assert!(!s.note(at(0), 0.2));
        assert!(!s.note(at(10), 0.05));
        // Over the level through an interval: it stands.
        assert!(!s.note(at(20), 0.13));
        assert!(!s.note(at(60), 0.13));
        assert!(s.note(at(70), 0.13));
        // A frame under the level does not end it; an interval without one over it does.
        assert!(s.note(at(80), 0.05));
        assert!(s.note(at(100), 0.2));
        assert!(s.note(at(140), 0.05));
        assert!(!s.note(at(150), 0.05));
        // Far over the level it stands sooner: at 0.25, a quarter of the interval.
        assert!(!s.note(at(200), 0.25));
        assert!(!s.note(at(212), 0.25));
        assert!(s.note(at(213), 0.25));
    }

    #[test]
    fn the_calibration_learns_how_much_longer_frames_wait_than_predicted() {
        let mut c = Calibration::default();
        assert_eq!(c.scale(10 * MS), 10 * MS);
        for _ in 0..1_000 {
            c.observe(10 * MS, 15 * MS);
            // Predictions too short to tell are not learned from.
            c.observe(Duration::from_micros(100), Duration::from_secs(1));
        }
        assert!((c.ratio() - 1.5).abs() < 0.01, "{}", c.ratio());
        // Bounded, whatever a stall made one frame wait.
        for _ in 0..1_000 {
            c.observe(10 * MS, Duration::from_secs(60));
        }
        assert!((c.ratio() - 4.0).abs() < 1e-6, "{}", c.ratio());
    }

    #[test]
    fn a_whale_is_refused_while_a_quiet_tenant_of_the_same_shard_is_admitted() {
        let submits = PathGauge::new(1024);
        let work = PathGauge::new(1024);
        submits.call_ended((1e6, 10e3));
        work.call_ended((1e6, 10e3));
        let board = OfferBoard::new(2);
        let refused: Arc<[AtomicU64; 3]> = Arc::default();
        let mut gate = Gate::new(
            40 * MS,
            submits.clone(),
            work.clone(),
            board.clone(),
            0,
            refused.clone(),
        );
        let now = Instant::now();
        let (whale, quiet) = (TenantId(1), TenantId(2));
        // At first the whale sends 100 frames of 64 (6,400 tasks a second, under a tenth of
        // the 100,000 rows a second the path could take) and the quiet tenant one task; with
        // 1,000 rows waiting and a queue standing, the whale is not told apart: it sends most
        // of a light load.
        for _ in 0..100 {
            assert_eq!(gate.judge(now, whale, 1, 64), None);
        }
        assert_eq!(gate.judge(now, quiet, 1, 1), None);
        {
            let _q = submits.enqueue(1_000);
            assert_eq!(gate.judge(now, whale, 1, 64), None);
            assert_eq!(gate.judge(now + STANDING_INTERVAL, whale, 1, 64), None);
        }
        // Then it sends 2,000 frames more: 134,400 a second, past what the path could take.
        for _ in 0..2_000 {
            assert_eq!(gate.judge(now, whale, 1, 64), None);
        }
        // 1,000 rows waiting: a call of 1,064 rows, 2 + 10.64 ms of a 40 ms budget — past
        // the top of the whale's ramp (a quarter of the budget), under the quiet tenant's
        // level (all of it). (A queue stands since the check above.)
        let now = now + STANDING_INTERVAL;
        let _q = submits.enqueue(1_000);
        let r = gate
            .judge(now, whale, 1, 64)
            .expect("the whale sends the most");
        assert!(r.reason.contains("refused first"), "{}", r.reason);
        assert_eq!(r.retry_after_ms, 7);
        assert_eq!(gate.judge(now, quiet, 1, 1), None);
        // The work path past twice its allowance of four budgets: even the quietest tenant is
        // refused (finish before start).
        let _w = work.enqueue(32_000);
        let r = gate.judge(now, quiet, 1, 1).expect("behind");
        assert!(r.reason.contains("finishes them before"), "{}", r.reason);
        assert_eq!(refused[Shed::OverShare as usize].load(Relaxed), 64);
        assert_eq!(refused[Shed::Behind as usize].load(Relaxed), 1);
        // Frames that waited three times their prediction triple the predictions: 300 rows
        // waiting (4.64 ms, under the whale's level) then read as 13.9 ms, past its ramp.
        drop(_w);
        drop(_q);
        let _q = submits.enqueue(300);
        assert_eq!(
            verdict(gate.wait(64).as_secs_f64() / 0.04, 0.0, 1.0, 0.0),
            None
        );
        for _ in 0..1_000 {
            gate.observe(10 * MS, 30 * MS);
        }
        assert!(gate.judge(now, whale, 1, 64).is_some());
        // Another shard's heavy tenants raise the mean: this one's whale is then within it.
        gate.tick(now);
        assert_eq!(gate.active_tenants(), 2);
        board.publish(1, 1e9, 1.0);
        assert_eq!(gate.judge(now, whale, 1, 64), None);
        // Idle tenants are forgotten.
        gate.tick(now + Duration::from_secs(60));
        assert_eq!(gate.active_tenants(), 0);
    }
}
