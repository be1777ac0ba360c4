//! What the node exposes on its HTTP port: `/livez`, `/readyz` (not ready while PostgreSQL is
//! unreachable or the node is stopping) and `/metrics` in Prometheus text format. Shards and
//! pipelines write plain atomics; the HTTP task reads them. The one lock is each shard's
//! per-tenant table, written every 10 shard ticks (200 ms).
//!
//! Long file: every counter the node keeps and its exposition, a few lines a family. The next
//! step moves the rendering into `spindle-node-http`, from a snapshot of these counters.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

#[cfg(test)]
use crate::exposition::Exposition;
use crate::exposition::{label, Collect};
use spindle_core::{Band, Decision, Lane};
use spindle_sync::ShareBoard;

/// Control-plane batch latency buckets (µs), Prometheus-style cumulative.
const LATENCY_BUCKETS_US: &[u64] = &[
    500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 500_000, 2_000_000,
];
/// The node's submit answer time (µs): frame decoded to answer encoded.
const ANSWER_BUCKETS_US: &[u64] = &[
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 50_000, 250_000,
];
/// Queue wait buckets (µs): admission to dispatch.
const WAIT_BUCKETS_US: &[u64] = &[
    1_000,
    5_000,
    20_000,
    100_000,
    500_000,
    1_000_000,
    5_000_000,
    30_000_000,
    120_000_000,
    600_000_000,
];
/// Submit to dispatch buckets (µs): fine around the few milliseconds a dispatch should take,
/// then out to the minutes a task waits behind scarce slots (as the queue waits').
const DISPATCH_BUCKETS_US: &[u64] = &[
    250,
    500,
    1_000,
    1_500,
    2_000,
    3_000,
    4_000,
    5_000,
    7_500,
    10_000,
    15_000,
    20_000,
    30_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    5_000_000,
    30_000_000,
    120_000_000,
    600_000_000,
];
/// Control-plane calls by kind ("work": reports and claims together, `Db::work_batch`).
pub const KINDS: [&str; 5] = ["submit", "claim", "report", "read", "work"];
/// Provider submit results (withdrawn: its task was canceled before its turn; nothing sent).
pub const PROVIDER_RESULTS: [&str; 6] = [
    "accepted",
    "rate_limited",
    "refused",
    "not_sent",
    "unknown",
    "withdrawn",
];
/// Provider callbacks and polls: progress, final (ended a watch), ignored (nobody watched:
/// a duplicate or late one), polled (a poll found the end), bad_signature, outside_window (its
/// signed time too far from now), replayed (taken already within the window).
pub const CALLBACK_KINDS: [&str; 10] = [
    "progress",
    "final",
    "ignored",
    "polled",
    "bad_signature",
    "outside_window",
    "replayed",
    // A vendor's callback that named an attempt in doubt, MiniMax's URL check echoed, and
    // one that could not be read.
    "resolved",
    "challenge",
    "unreadable",
];

/// A cumulative histogram of microseconds, with a row count for batch histograms.
pub struct Histogram {
    bounds: &'static [u64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_us: AtomicU64,
    rows: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [u64]) -> Histogram {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
            rows: AtomicU64::new(0),
        }
    }

    pub fn record(&self, us: u64, rows: u64) {
        for (b, c) in self.bounds.iter().zip(&self.buckets) {
            if us <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.rows.fetch_add(rows, Ordering::Relaxed);
    }

    /// `name_bucket`, `name_sum` and `name_count` lines in seconds, under `labels`.
    pub fn render(&self, w: &mut String, name: &str, labels: &str) {
        for (b, c) in self.bounds.iter().zip(&self.buckets) {
            let _ = writeln!(
                w,
                "{name}_bucket{{{labels},le=\"{}\"}} {}",
                *b as f64 / 1e6,
                c.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(w, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ = writeln!(
            w,
            "{name}_sum{{{labels}}} {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(w, "{name}_count{{{labels}}} {count}");
    }
}

/// Histogram `name` (its `help` and type, then each histogram) with one label, `label`, whose
/// value names each.
pub fn histograms<'a>(
    w: &mut String,
    name: &str,
    help: &str,
    label: &str,
    each: impl Iterator<Item = (&'a &'a str, &'a Histogram)>,
) {
    let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (value, h) in each {
        h.render(w, name, &format!("{label}=\"{value}\""));
    }
}

/// A counter family: `name`, its help, and one series per (label value, counter).
pub fn counters<'a, V: std::fmt::Display>(
    w: &mut String,
    name: &str,
    help: &str,
    label: &str,
    each: impl Iterator<Item = (V, &'a AtomicU64)>,
) {
    let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} counter");
    for (value, n) in each {
        let _ = writeln!(
            w,
            "{name}{{{label}=\"{value}\"}} {}",
            n.load(Ordering::Relaxed)
        );
    }
}

/// One tenant's running work on a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantRunning {
    pub tenant: u32,
    pub tasks: u64,
    pub units_milli: u64,
    /// The tenant's DRR weight (its entitlement, relative to the others').
    pub weight: u32,
}

/// The node-wide limits split among shards, for `/metrics`: their names (shard 0 adds those
/// of limits added while the node runs) and the board.
pub struct SplitView {
    pub names: std::sync::Mutex<Vec<String>>,
    pub board: Arc<ShareBoard>,
    /// The node's parts of the limits it shares with the cluster.
    pub ownership: Arc<crate::ownership::Ownership>,
}

#[derive(Default)]
pub struct ShardGauges {
    pub queued_tasks: [AtomicU64; Lane::COUNT],
    pub queued_units_milli: [AtomicU64; Lane::COUNT],
    pub live_tasks: AtomicU64,
    /// Bytes of task inputs held in memory for live tasks (bounded by `task_inputs_mb`).
    pub input_bytes: AtomicU64,
    /// Live tasks whose input was left in their stored request (past `task_inputs_mb`).
    pub inputs_stored: AtomicU64,
    /// Authenticated client connections this shard served (each on the shard owning its
    /// tenant: one accepted elsewhere is handed over after its Hello).
    pub connections: AtomicU64,
    /// Dispatched and not yet finished (what a drain waits for).
    pub running_tasks: AtomicU64,
    /// Tenants with running work, rewritten every shard tick.
    pub tenants: std::sync::Mutex<Vec<TenantRunning>>,
    /// Provider accounts whose RPM this shard has halved after a 429 (per tick).
    pub penalized: std::sync::Mutex<Vec<String>>,
    /// The overload gate's calibration (how much longer committed frames waited than
    /// predicted), in thousandths, and the tenants it counts as offering work (per tick).
    pub gate_calibration_milli: AtomicU64,
    pub gate_tenants: AtomicU64,
    /// Subscriptions the shard holds (every tick).
    pub subscriptions: AtomicU64,
    /// When the shard's loop last ticked, in ms since [`Metrics::started`].
    pub heartbeat_ms: AtomicU64,
    /// What admitted work moved into its tenants' periodic quotas and out of them (the core's
    /// `ShardStats::quota_charged` / `quota_returned`): tasks, then milli cost.
    pub quota_charged: [AtomicU64; 2],
    pub quota_returned: [AtomicU64; 2],
}

pub struct Metrics {
    pub admissions: [AtomicU64; Decision::ALL.len()],
    pub completed: AtomicU64,
    /// Tasks whose SUCCEEDED is committed in PostgreSQL (their finish report was applied).
    pub succeeded_durable: AtomicU64,
    pub claims_granted: AtomicU64,
    pub claims_refused: AtomicU64,
    /// Submit and claim batches whose answer was lost, decided from their rows since.
    pub calls_in_doubt: AtomicU64,
    /// Ended tasks the retention passes removed from PostgreSQL.
    pub retention_pruned: AtomicU64,
    /// Stored tasks a restore or takeover could not put back, failed with the reason.
    pub restore_failed: AtomicU64,
    /// Counter checks done, and the pool shards and budgets the last one found drifted.
    pub counter_checks: AtomicU64,
    /// Counter checks that failed (the store unreachable, a timeout).
    pub counter_check_failures: AtomicU64,
    /// Tasks in the dead-letter list at the last check.
    pub dead_letters: AtomicU64,
    /// Submits a periodic quota refused, by the quota's scope (tenant, user, model) and period
    /// (minute, day, month).
    pub quota_refused: [[AtomicU64; 3]; 3],
    /// The reconcilers' passes, by job ([`crate::config::Job`]).
    pub reconcilers: [ReconcilerCounts; crate::config::Job::COUNT],
    /// The cluster's QUEUED tasks by lane and band at the last check, and their oldest's wait.
    pub queue_ages: std::sync::Mutex<Vec<spindle_control::reconcile::QueueAge>>,
    pub counter_drift_shards: AtomicU64,
    pub counter_drift_budgets: AtomicU64,
    /// Repairs the periodic check made of what it found drifted (`counter_repair`).
    pub counter_repairs: AtomicU64,
    /// Hellos and submits refused `WrongNode`: the tenant is another node's (or none's).
    pub wrong_node: AtomicU64,
    /// Outbox rows (event batches) the retention passes removed.
    pub events_pruned: AtomicU64,
    /// Audit rows past `retention_audit_s` the retention passes removed.
    pub audit_pruned: AtomicU64,
    /// Retention rounds run (one after each lease renewal), and the nodes relaying the
    /// cluster's events the last one counted (this one included): while it is above zero,
    /// nothing a relay has yet to send is pruned.
    pub retention_rounds: AtomicU64,
    pub relaying_nodes: AtomicU64,
    /// Allotments of the node's parts of the limits it shares with the cluster that succeeded.
    pub share_allotments: AtomicU64,
    /// The event relay (when `[events]` is configured): events the sink took, batches it
    /// refused, events pending as last counted, and whether that is above `pending_max`.
    pub events_relayed: AtomicU64,
    pub events_refused: AtomicU64,
    /// Client connections open (greeting or served), and those refused at `connections_max`.
    pub connections_open: std::sync::atomic::AtomicUsize,
    pub connections_refused: AtomicU64,
    /// Client connections greeting now (TLS handshake and Hello), and those closed to make
    /// room for newer ones (`unauthenticated_max`, `unauthenticated_per_address_max`).
    pub connections_greeting: AtomicU64,
    pub connections_evicted: AtomicU64,
    /// HTTP port connections refused at `http_connections_max` (every one in a request), and
    /// those closed to make room for a new one (idle, or still sending their head).
    pub http_refused: AtomicU64,
    pub http_evicted: AtomicU64,
    /// Admin calls turned away before anything was done: [no valid token, past its role].
    pub admin_refused: [AtomicU64; 2],
    /// Hellos that failed their credential, refused unchecked (their address cooling down),
    /// and delayed (their tenant guessed at): [`crate::auth_guard`].
    pub auth: Arc<[AtomicU64; 3]>,
    /// When the node's metrics began: the shards' heartbeats count from it.
    pub started: std::time::Instant,
    pub events_pending: AtomicU64,
    pub events_backlogged: AtomicBool,
    pub batches: [Histogram; KINDS.len()],
    pub provider_calls: [AtomicU64; PROVIDER_RESULTS.len()],
    /// Rounds of queries by request key that got no answer at all (each asked again later).
    pub provider_unresolved: AtomicU64,
    /// Submits held back by the send pacing (`spindle_node_workers::dispatch`), and for how long in all (µs).
    pub provider_paced: AtomicU64,
    pub provider_paced_us: AtomicU64,
    /// Provider submits waiting for their turn to leave now (a gauge).
    pub provider_paced_waiting: AtomicU64,
    /// Tenants the breaker suspended (the shards' breakers), and who is suspended now.
    pub breaker_trips: AtomicU64,
    pub suspensions: Arc<crate::suspensions::Suspensions>,
    /// Commands refused for their tenant's rate, by `spindle_core::Command`.
    pub commands_limited: [AtomicU64; spindle_core::Command::ALL.len()],
    pub callbacks: [AtomicU64; CALLBACK_KINDS.len()],
    /// Submit frames answered, by outcome: [rejected, accepted (anything in the frame)].
    pub answers: [Histogram; 2],
    /// Admission → dispatch, per lane and band (`lane * Band::COUNT + band`).
    pub waits: Vec<Histogram>,
    /// A task's first attempt: admission to its claim committed and the attempt started
    /// (what a provider call waits for), over every lane.
    pub dispatch: Histogram,
    /// A task's admission (or its requeue) to its provider accepting the attempt (RUNNING):
    /// what a client waits for its job to start, over every lane.
    pub running: Histogram,
    pub shards: Vec<ShardGauges>,
    /// Set once the shards' board exists.
    pub split: std::sync::OnceLock<SplitView>,
    pub health: std::sync::OnceLock<Arc<crate::health::ProviderHealth>>,
    /// The last control-plane call reached PostgreSQL.
    pub postgres_ok: AtomicBool,
    pub stopping: AtomicBool,
    /// Set once the node serves; until then it is starting (alive, not ready).
    pub serving: AtomicBool,
    /// What a starting node waits for, as `/readyz` tells it.
    pub starting: std::sync::Mutex<String>,
    /// Live nodes of the cluster as this node last counted them.
    pub live_nodes: AtomicU64,
    /// The policy store's version this node has applied.
    pub policy_version: AtomicU64,
    /// Stored policy objects the node could not take (see `spindle_node_control::live_policy`).
    pub policy_skipped: AtomicU64,
    /// Reports queued or sent whose answer has not come back (what a drain also waits for).
    pub reports_pending: AtomicU64,
    /// Reports PostgreSQL answered without applying (stale token, illegal step, task gone).
    pub reports_refused: AtomicU64,
    /// Tasks the overload gate refused, by `crate::overload::Shed` (over their tenant's share
    /// while the durable path was past half its budget; past all of it).
    pub overload_refused: Arc<[AtomicU64; 3]>,
    /// Each shard's pipelines' gauges (submit, work), in shard order: the predicted waits.
    pub paths: std::sync::OnceLock<Vec<crate::overload::Paths>>,
}

impl Metrics {
    pub fn new(shards: usize) -> Arc<Metrics> {
        Arc::new(Metrics {
            admissions: Default::default(),
            completed: AtomicU64::new(0),
            succeeded_durable: AtomicU64::new(0),
            claims_granted: AtomicU64::new(0),
            claims_refused: AtomicU64::new(0),
            calls_in_doubt: AtomicU64::new(0),
            retention_pruned: AtomicU64::new(0),
            restore_failed: AtomicU64::new(0),
            counter_checks: AtomicU64::new(0),
            counter_check_failures: AtomicU64::new(0),
            dead_letters: AtomicU64::new(0),
            reconcilers: Default::default(),
            quota_refused: Default::default(),
            queue_ages: std::sync::Mutex::new(Vec::new()),
            counter_drift_shards: AtomicU64::new(0),
            counter_drift_budgets: AtomicU64::new(0),
            counter_repairs: AtomicU64::new(0),
            wrong_node: AtomicU64::new(0),
            events_pruned: AtomicU64::new(0),
            audit_pruned: AtomicU64::new(0),
            retention_rounds: AtomicU64::new(0),
            relaying_nodes: AtomicU64::new(0),
            share_allotments: AtomicU64::new(0),
            events_relayed: AtomicU64::new(0),
            events_refused: AtomicU64::new(0),
            connections_open: std::sync::atomic::AtomicUsize::new(0),
            connections_refused: AtomicU64::new(0),
            connections_greeting: AtomicU64::new(0),
            connections_evicted: AtomicU64::new(0),
            http_refused: AtomicU64::new(0),
            http_evicted: AtomicU64::new(0),
            admin_refused: Default::default(),
            auth: Arc::default(),
            started: std::time::Instant::now(),
            events_pending: AtomicU64::new(0),
            events_backlogged: AtomicBool::new(false),
            batches: std::array::from_fn(|_| Histogram::new(LATENCY_BUCKETS_US)),
            answers: std::array::from_fn(|_| Histogram::new(ANSWER_BUCKETS_US)),
            provider_calls: Default::default(),
            provider_unresolved: AtomicU64::new(0),
            provider_paced: AtomicU64::new(0),
            provider_paced_us: AtomicU64::new(0),
            provider_paced_waiting: AtomicU64::new(0),
            commands_limited: Default::default(),
            breaker_trips: AtomicU64::new(0),
            suspensions: Default::default(),
            callbacks: Default::default(),
            waits: (0..Lane::COUNT * Band::COUNT)
                .map(|_| Histogram::new(WAIT_BUCKETS_US))
                .collect(),
            dispatch: Histogram::new(DISPATCH_BUCKETS_US),
            running: Histogram::new(DISPATCH_BUCKETS_US),
            shards: (0..shards).map(|_| ShardGauges::default()).collect(),
            split: std::sync::OnceLock::new(),
            health: std::sync::OnceLock::new(),
            postgres_ok: AtomicBool::new(true),
            stopping: AtomicBool::new(false),
            serving: AtomicBool::new(false),
            starting: std::sync::Mutex::new("starting".into()),
            live_nodes: AtomicU64::new(1),
            policy_version: AtomicU64::new(0),
            policy_skipped: AtomicU64::new(0),
            reports_refused: AtomicU64::new(0),
            reports_pending: AtomicU64::new(0),
            overload_refused: Arc::default(),
            paths: std::sync::OnceLock::new(),
        })
    }

    pub fn provider_call(&self, result: &str) {
        if let Some(i) = PROVIDER_RESULTS.iter().position(|r| *r == result) {
            self.provider_calls[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn callback(&self, kind: &str) {
        if let Some(i) = CALLBACK_KINDS.iter().position(|k| *k == kind) {
            self.callbacks[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A submit frame was answered `took` after it was decoded.
    pub fn answered_submit(&self, accepted: bool, took: std::time::Duration) {
        self.answers[usize::from(accepted)].record(took.as_micros() as u64, 1);
    }

    /// A task of `lane` and `band` waited `us` from admission to dispatch.
    pub fn waited(&self, lane: Lane, band: Band, us: u64) {
        self.waits[lane.index() * Band::COUNT + band.index()].record(us, 1);
    }

    /// A submit refused by a quota of `scope` and `period`.
    pub fn quota_refused(
        &self,
        scope: spindle_core::quota::QuotaScope,
        period: spindle_core::quota::QuotaPeriod,
    ) {
        use spindle_core::quota::QuotaScope;
        let s = match scope {
            QuotaScope::Tenant => 0,
            QuotaScope::User => 1,
            QuotaScope::Model { .. } => 2,
        };
        self.quota_refused[s][period as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn admitted(&self, d: Decision) {
        self.admissions[d as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn running(&self) -> u64 {
        self.shards
            .iter()
            .map(|g| g.running_tasks.load(Ordering::Relaxed))
            .sum()
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// A shard's loop ticked: its heartbeat, for `/livez`.
    pub fn beat(&self, shard: usize) {
        if let Some(g) = self.shards.get(shard) {
            g.heartbeat_ms
                .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
    }

    /// The first shard whose loop has not ticked for `stale` or more, and for how long (a
    /// shard that never ticked counts from the node's start).
    pub fn stale_shard(&self, stale: std::time::Duration) -> Option<(usize, std::time::Duration)> {
        // A starting node's shards beat once it serves (it may wait for PostgreSQL first).
        if !self.serving.load(Ordering::Relaxed) {
            return None;
        }
        let now = self.started.elapsed();
        self.shards.iter().enumerate().find_map(|(i, g)| {
            let beat = std::time::Duration::from_millis(g.heartbeat_ms.load(Ordering::Relaxed));
            let since = now.saturating_sub(beat);
            (since >= stale).then_some((i, since))
        })
    }

    pub fn ready(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
            && self.postgres_ok.load(Ordering::Relaxed)
            && !self.stopping.load(Ordering::Relaxed)
    }

    /// Why the node is not ready, for `/readyz`.
    pub fn not_ready_why(&self) -> String {
        if !self.serving.load(Ordering::Relaxed) {
            let why = self.starting.lock().map(|w| w.clone()).unwrap_or_default();
            return format!("starting: {why}");
        }
        if self.stopping.load(Ordering::Relaxed) {
            return "stopping".into();
        }
        "PostgreSQL unreachable".into()
    }

    /// A series with one value per shard: `name{shard="i"} value`, after its HELP and TYPE.
    fn per_shard(
        &self,
        w: &mut String,
        name: &str,
        kind: &str,
        help: &str,
        value: impl Fn(&ShardGauges) -> &AtomicU64,
    ) {
        let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (i, g) in self.shards.iter().enumerate() {
            let _ = writeln!(
                w,
                "{name}{{shard=\"{i}\"}} {}",
                value(g).load(Ordering::Relaxed)
            );
        }
    }

    /// The overload gate: what it refused, and the waits it predicts for each shard's
    /// pipelines (the model's fixed and per-row cost of a call too).
    fn render_overload(&self, w: &mut String) {
        counters(
            w,
            "spindle_overload_refused_total",
            "Submitted tasks the overload gate refused: over_share (the submit path past the \
             tenant's level, a share of the ack budget that is smaller the more it sends for \
             its weight), full (the submit path past the whole budget), behind (the claims \
             and reports of accepted work past it).",
            "level",
            crate::overload::Shed::ALL
                .iter()
                .map(|s| s.name())
                .zip(self.overload_refused.iter()),
        );
        self.per_shard(
            w,
            "spindle_overload_calibration",
            "gauge",
            "How much longer committed submit frames waited than the gate predicted (a decayed \
             mean of the ratio, which scales its predictions), in thousandths.",
            |g| &g.gate_calibration_milli,
        );
        self.per_shard(
            w,
            "spindle_subscriptions",
            "gauge",
            "Subscriptions to live tasks' events the shard holds (a closed connection's go at once).",
            |g| &g.subscriptions,
        );
        self.per_shard(
            w,
            "spindle_overload_active_tenants",
            "gauge",
            "Tenants the overload gate counts as offering work (their offered rate decays with a \
             1 s time constant).",
            |g| &g.gate_tenants,
        );
        let Some(paths) = self.paths.get() else {
            return;
        };
        type Read = fn(&crate::overload::PathGauge) -> f64;
        let gauges: [(&str, &str, Read); 3] = [
            (
                "spindle_durable_wait_seconds",
                "How long rows sent now would wait for their call's end, as the gate predicts.",
                |g| g.wait(0).as_secs_f64(),
            ),
            (
                "spindle_durable_call_fixed_seconds",
                "The fitted fixed time of a call.",
                |g| g.model().0 / 1e9,
            ),
            (
                "spindle_durable_call_row_seconds",
                "The fitted time a row adds to a call.",
                |g| g.model().1 / 1e9,
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (i, (submit, work)) in paths.iter().enumerate() {
                for (path, g) in [("submit", submit), ("work", work)] {
                    let _ = writeln!(w, "{name}{{shard=\"{i}\",path=\"{path}\"}} {}", value(g));
                }
            }
        }
    }

    fn render_reconcilers(&self, w: &mut String) {
        type Read = fn(&ReconcilerCounts) -> u64;
        let series: [(&str, &str, &str, Read); 5] = [
            (
                "spindle_reconciler_runs_total",
                "counter",
                "Reconciler passes that completed, by job.",
                |c| c.runs.load(Ordering::Relaxed),
            ),
            (
                "spindle_reconciler_failures_total",
                "counter",
                "Reconciler passes that failed (the store or the provider unreachable), by job.",
                |c| c.failures.load(Ordering::Relaxed),
            ),
            (
                "spindle_reconciler_findings_total",
                "counter",
                "What the reconcilers found wrong, by job: lapsed attempts nobody followed, orphan provider jobs, cost drift, starving tasks.",
                |c| c.findings.load(Ordering::Relaxed),
            ),
            (
                "spindle_reconciler_repairs_total",
                "counter",
                "What the reconcilers repaired, by job: attempts followed again, requeued or ended; orphan jobs canceled.",
                |c| c.repairs.load(Ordering::Relaxed),
            ),
            (
                "spindle_reconciler_last_findings",
                "gauge",
                "What the last pass of each reconciler found.",
                |c| c.last_findings.load(Ordering::Relaxed),
            ),
        ];
        for (name, kind, help, read) in series {
            let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for job in crate::config::Job::ALL {
                let c = &self.reconcilers[job as usize];
                let _ = writeln!(w, "{name}{{job=\"{}\"}} {}", job.name(), read(c));
            }
        }
    }

    /// Admissions, completions, claims, the overload gate, calls in doubt, retention and
    /// restore, the checks of reservations, the reconcilers.
    fn render_tasks(&self, w: &mut String) {
        let _ = writeln!(w, "# HELP spindle_admissions_total Submits by admission decision.\n# TYPE spindle_admissions_total counter");
        for d in Decision::ALL {
            let _ = writeln!(
                w,
                "spindle_admissions_total{{decision=\"{}\"}} {}",
                d.name(),
                self.admissions[d as usize].load(Ordering::Relaxed)
            );
        }
        self.render_overload(w);
        let _ = writeln!(
            w,
            "# HELP spindle_tasks_completed_total Tasks this node saw end, whatever their end.\n# TYPE spindle_tasks_completed_total counter\nspindle_tasks_completed_total {}",
            self.completed.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_tasks_succeeded_total Tasks whose SUCCEEDED is committed in PostgreSQL.\n# TYPE spindle_tasks_succeeded_total counter\nspindle_tasks_succeeded_total {}",
            self.succeeded_durable.load(Ordering::Relaxed)
        );
        let _ = writeln!(w, "# HELP spindle_claims_total Claims the store granted or refused.\n# TYPE spindle_claims_total counter");
        let _ = writeln!(
            w,
            "spindle_claims_total{{result=\"granted\"}} {}",
            self.claims_granted.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "spindle_claims_total{{result=\"refused\"}} {}",
            self.claims_refused.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_calls_in_doubt_total Submit and claim batches whose answer was lost (decided from their rows).\n# TYPE spindle_calls_in_doubt_total counter\nspindle_calls_in_doubt_total {}",
            self.calls_in_doubt.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_retention_pruned_total Ended tasks removed by retention.\n# TYPE spindle_retention_pruned_total counter\nspindle_retention_pruned_total {}",
            self.retention_pruned.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_restore_failed_total Stored tasks a restart or takeover could not put back (unreadable, or their tenant, model or provider gone from the policy), failed with the reason.\n# TYPE spindle_restore_failed_total counter\nspindle_restore_failed_total {}",
            self.restore_failed.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_reservation_checks_total Checks of the pool counters against their reservations.\n# TYPE spindle_reservation_checks_total counter\nspindle_reservation_checks_total {}",
            self.counter_checks.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_reservation_check_failures_total Counter checks that failed (the store unreachable or too slow).\n# TYPE spindle_reservation_check_failures_total counter\nspindle_reservation_check_failures_total {}\n# HELP spindle_dead_letters Tasks in the dead-letter list (ended FAILED) at the last check.\n# TYPE spindle_dead_letters gauge\nspindle_dead_letters {}",
            self.counter_check_failures.load(Ordering::Relaxed),
            self.dead_letters.load(Ordering::Relaxed)
        );
        self.render_reconcilers(w);
    }

    /// Quotas and the cluster's queues.
    fn render_quotas(&self, w: &mut String) {
        for (name, help, moves) in [
            (
                "spindle_quota_charged_total",
                "What admitted tasks added to their tenants' periodic quotas: tasks, and milli cost (estimates, then what bills and probed videos added).",
                (|g: &ShardGauges| &g.quota_charged) as fn(&ShardGauges) -> &[AtomicU64; 2],
            ),
            (
                "spindle_quota_returned_total",
                "What came back to tenants' periodic quotas: tasks that ended unbilled, and bills under the estimate.",
                |g: &ShardGauges| &g.quota_returned,
            ),
        ] {
            let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} counter");
            for (i, unit) in ["tasks", "cost_milli"].iter().enumerate() {
                let sum: u64 = self.shards.iter().map(|g| moves(g)[i].load(Ordering::Relaxed)).sum();
                let _ = writeln!(w, "{name}{{unit=\"{unit}\"}} {sum}");
            }
        }
        let _ = writeln!(
            w,
            "# HELP spindle_quota_refused_total Submits a periodic quota refused, by its scope and period.\n# TYPE spindle_quota_refused_total counter"
        );
        for (s, scope) in ["tenant", "user", "model"].iter().enumerate() {
            for period in spindle_core::quota::QuotaPeriod::ALL {
                let _ = writeln!(
                    w,
                    "spindle_quota_refused_total{{scope=\"{scope}\",period=\"{}\"}} {}",
                    period.name(),
                    self.quota_refused[s][period as usize].load(Ordering::Relaxed)
                );
            }
        }
        {
            let _ = writeln!(
                w,
                "# HELP spindle_cluster_queued_tasks QUEUED tasks that may start now, the cluster's, by lane and band (at the last check).\n# TYPE spindle_cluster_queued_tasks gauge\n# HELP spindle_queued_oldest_seconds How long the oldest of them has waited since its submission.\n# TYPE spindle_queued_oldest_seconds gauge"
            );
            let ages = self
                .queue_ages
                .lock()
                .map(|a| a.clone())
                .unwrap_or_default();
            for a in ages {
                let lane = spindle_core::Lane::ALL.get(a.lane as usize);
                let band = spindle_core::Band::ALL.get(a.band as usize);
                let (Some(lane), Some(band)) = (lane, band) else {
                    continue;
                };
                let _ = writeln!(
                    w,
                    "spindle_cluster_queued_tasks{{lane=\"{}\",band=\"{band}\"}} {}\nspindle_queued_oldest_seconds{{lane=\"{}\",band=\"{band}\"}} {:.3}",
                    lane.name(),
                    a.queued,
                    lane.name(),
                    a.oldest_s
                );
            }
        }
    }

    /// The checks' drift and repairs, partitions, the event relay, connections, the breaker and
    /// Hello throttling.
    fn render_cluster(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "# HELP spindle_reservation_drift_shards Pool shards whose counter differed from their reservations at the last check.\n# TYPE spindle_reservation_drift_shards gauge\nspindle_reservation_drift_shards {}",
            self.counter_drift_shards.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_reservation_drift_budgets Tenants whose reserved budget differed from their open reservations at the last check.\n# TYPE spindle_reservation_drift_budgets gauge\nspindle_reservation_drift_budgets {}",
            self.counter_drift_budgets.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_reservation_repairs_total Repairs the periodic check made of drifted counters (counter_repair).\n# TYPE spindle_reservation_repairs_total counter\nspindle_reservation_repairs_total {}",
            self.counter_repairs.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_wrong_node_total Hellos and submits refused WrongNode (the tenant is served by another node).\n# TYPE spindle_wrong_node_total counter\nspindle_wrong_node_total {}",
            self.wrong_node.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_retention_rounds_total Retention rounds run (one after each lease renewal).\n# TYPE spindle_retention_rounds_total counter\nspindle_retention_rounds_total {}",
            self.retention_rounds.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_relaying_nodes Nodes relaying the cluster's events (this one included) heard from within the events' retention window, as the last retention round counted: while above zero nothing a relay has yet to send is pruned.\n# TYPE spindle_relaying_nodes gauge\nspindle_relaying_nodes {}",
            self.relaying_nodes.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_events_pruned_total Outbox rows removed by retention.\n# TYPE spindle_events_pruned_total counter\nspindle_events_pruned_total {}",
            self.events_pruned.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_audit_pruned_total Audit rows older than retention_audit_s the retention passes removed.\n# TYPE spindle_audit_pruned_total counter\nspindle_audit_pruned_total {}",
            self.audit_pruned.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_events_relayed_total Events the event sink took.\n# TYPE spindle_events_relayed_total counter\nspindle_events_relayed_total {}",
            self.events_relayed.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_events_refused_total Event batches the sink refused or did not answer.\n# TYPE spindle_events_refused_total counter\nspindle_events_refused_total {}",
            self.events_refused.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_events_pending Events not yet relayed, as last counted.\n# TYPE spindle_events_pending gauge\nspindle_events_pending {}",
            self.events_pending.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_connections_open Client connections open, greeting or served (at most connections_max).\n# TYPE spindle_connections_open gauge\nspindle_connections_open {}",
            self.connections_open.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_connections_refused_total Client connections refused at connections_max.\n# TYPE spindle_connections_refused_total counter\nspindle_connections_refused_total {}",
            self.connections_refused.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_connections_greeting Client connections greeting now (TLS handshake and Hello), held to unauthenticated_max.\n# TYPE spindle_connections_greeting gauge\nspindle_connections_greeting {}\n# HELP spindle_connections_evicted_total Greeting connections closed to make room for newer ones (unauthenticated_max, unauthenticated_per_address_max).\n# TYPE spindle_connections_evicted_total counter\nspindle_connections_evicted_total {}",
            self.connections_greeting.load(Ordering::Relaxed),
            self.connections_evicted.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_http_connections_refused_total HTTP port connections refused at http_connections_max.\n# TYPE spindle_http_connections_refused_total counter\nspindle_http_connections_refused_total {}",
            self.http_refused.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_http_connections_evicted_total HTTP port connections closed to make room for a new one at http_connections_max (idle between requests, or still sending their head).\n# TYPE spindle_http_connections_evicted_total counter\nspindle_http_connections_evicted_total {}",
            self.http_evicted.load(Ordering::Relaxed)
        );
        counters(
            w,
            "spindle_admin_refused_total",
            "Admin calls turned away before anything was done: anonymous (no valid token), role (past the token's role); a few a second are logged, none written to PostgreSQL.",
            "why",
            ["anonymous", "role"].into_iter().zip(self.admin_refused.iter()),
        );
        counters(
            w,
            "spindle_hello_guarded_total",
            "Hellos the credential guard saw: failed (a wrong credential), refused (unchecked: their address failed too often), delayed (their tenant is being guessed at).",
            "outcome",
            ["failed", "refused", "delayed"].into_iter().zip(self.auth.iter()),
        );
    }

    /// Each shard's queues, live tasks and inputs, and the control plane's batches.
    fn render_shards(&self, w: &mut String) {
        self.per_shard(
            w,
            "spindle_connections_served_total",
            "counter",
            "Authenticated client connections served, per shard (the shard owning the connection's tenant).",
            |g| &g.connections,
        );
        let _ = writeln!(w, "# HELP spindle_queued_tasks Queued tasks per shard and lane.\n# TYPE spindle_queued_tasks gauge\n# HELP spindle_queued_units Queued cost units per shard and lane.\n# TYPE spindle_queued_units gauge\n# HELP spindle_live_tasks Tasks a shard holds live (queued or running).\n# TYPE spindle_live_tasks gauge");
        for (i, g) in self.shards.iter().enumerate() {
            for lane in Lane::ALL {
                let _ = writeln!(
                    w,
                    "spindle_queued_tasks{{shard=\"{i}\",lane=\"{}\"}} {}",
                    lane.name(),
                    g.queued_tasks[lane.index()].load(Ordering::Relaxed)
                );
                let _ = writeln!(
                    w,
                    "spindle_queued_units{{shard=\"{i}\",lane=\"{}\"}} {:.3}",
                    lane.name(),
                    g.queued_units_milli[lane.index()].load(Ordering::Relaxed) as f64 / 1000.0
                );
            }
            let _ = writeln!(
                w,
                "spindle_live_tasks{{shard=\"{i}\"}} {}",
                g.live_tasks.load(Ordering::Relaxed)
            );
        }
        self.per_shard(
            w,
            "spindle_task_input_bytes",
            "gauge",
            "Bytes of task inputs held in memory for live tasks, per shard (bounded by task_inputs_mb).",
            |g| &g.input_bytes,
        );
        self.per_shard(
            w,
            "spindle_task_inputs_stored",
            "gauge",
            "Live tasks whose input is read back from PostgreSQL at dispatch (past task_inputs_mb), per shard.",
            |g| &g.inputs_stored,
        );
        let _ = writeln!(w, "# HELP spindle_control_batch_seconds Control-plane batch latency by kind.\n# TYPE spindle_control_batch_seconds histogram\n# HELP spindle_control_batch_rows_total Rows the control plane's batches carried, by kind.\n# TYPE spindle_control_batch_rows_total counter");
        for (kind, h) in KINDS.iter().zip(&self.batches) {
            h.render(
                w,
                "spindle_control_batch_seconds",
                &format!("kind=\"{kind}\""),
            );
            let _ = writeln!(
                w,
                "spindle_control_batch_rows_total{{kind=\"{kind}\"}} {}",
                h.rows.load(Ordering::Relaxed)
            );
        }
    }

    /// Provider submits, callbacks, pacing, resolution, penalties and health.
    fn render_provider(&self, w: &mut String) {
        counters(
            w,
            "spindle_provider_submits_total",
            "Provider submits by result.",
            "result",
            PROVIDER_RESULTS.iter().zip(&self.provider_calls),
        );
        let _ = writeln!(
            w,
            "# HELP spindle_provider_paced_total Provider submits held back to keep to the RPM part where they leave the node (their token was taken at pick; a stall before the claim committed bunched them).\n# TYPE spindle_provider_paced_total counter\nspindle_provider_paced_total {}",
            self.provider_paced.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_provider_paced_seconds_total Time provider submits were held back by that pacing.\n# TYPE spindle_provider_paced_seconds_total counter\nspindle_provider_paced_seconds_total {:.6}",
            self.provider_paced_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(
            w,
            "# HELP spindle_provider_paced_waiting Provider submits waiting for their turn to leave now (while a shard has any for an account, it picks no more for it).\n# TYPE spindle_provider_paced_waiting gauge\nspindle_provider_paced_waiting {}",
            self.provider_paced_waiting.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_provider_unresolved_total Rounds of queries by request key without any answer.\n# TYPE spindle_provider_unresolved_total counter\nspindle_provider_unresolved_total {}",
            self.provider_unresolved.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_breaker_trips_total Tenants suspended by the tenant breaker (requests refused too fast).\n# TYPE spindle_breaker_trips_total counter\nspindle_breaker_trips_total {}",
            self.breaker_trips.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_tenants_suspended Tenants the breaker holds suspended now.\n# TYPE spindle_tenants_suspended gauge\nspindle_tenants_suspended {}",
            self.suspensions.count(std::time::Instant::now())
        );
        counters(
            w,
            "spindle_commands_limited_total",
            "Cancels and store reads refused for their tenant's rate.",
            "command",
            spindle_core::Command::ALL
                .iter()
                .map(|c| c.name())
                .zip(&self.commands_limited),
        );
        counters(
            w,
            "spindle_provider_callbacks_total",
            "Provider callbacks and polls by kind.",
            "kind",
            CALLBACK_KINDS.iter().zip(&self.callbacks),
        );
        let mut penalized: Vec<String> = self
            .shards
            .iter()
            .flat_map(|g| g.penalized.lock().map(|p| p.clone()).unwrap_or_default())
            .collect();
        penalized.sort();
        penalized.dedup();
        if let Some(health) = self.health.get() {
            let _ = writeln!(w, "# HELP spindle_provider_penalized Whether a provider account's rate is halved after a 429 (on any shard).\n# TYPE spindle_provider_penalized gauge");
            for (name, _, _) in health.snapshot() {
                let _ = writeln!(
                    w,
                    "spindle_provider_penalized{{provider=\"{}\"}} {}",
                    label(&name),
                    u8::from(penalized.contains(&name))
                );
            }
            let _ = writeln!(w, "# HELP spindle_provider_circuit_open Whether a provider account's circuit is open (no new work).\n# TYPE spindle_provider_circuit_open gauge\n# HELP spindle_provider_circuit_opened_total How often a provider account's circuit opened.\n# TYPE spindle_provider_circuit_opened_total counter");
            for (name, open, opened) in health.snapshot() {
                let name = label(&name);
                let _ = writeln!(
                    w,
                    "spindle_provider_circuit_open{{provider=\"{name}\"}} {}",
                    u8::from(open)
                );
                let _ = writeln!(
                    w,
                    "spindle_provider_circuit_opened_total{{provider=\"{name}\"}} {opened}"
                );
            }
        }
    }

    /// The node's submit answer times.
    fn render_answers(&self, w: &mut String) {
        histograms(
            w,
            "spindle_submit_answer_seconds",
            "Submit frames, decoded to answered, by outcome (accepted: anything in the frame was; they wait for the group commit).",
            "outcome",
            ["rejected", "accepted"].iter().zip(&self.answers),
        );
    }

    /// Queue waits, submit to dispatch and to running, and the tenants' running units and
    /// weights.
    fn render_waits(&self, w: &mut String) {
        let _ = writeln!(w, "# HELP spindle_dispatch_wait_seconds Admission to dispatch, by lane and band.\n# TYPE spindle_dispatch_wait_seconds histogram");
        for lane in Lane::ALL {
            for band in Band::ALL {
                let h = &self.waits[lane.index() * Band::COUNT + band.index()];
                let labels = format!("lane=\"{}\",band=\"{band}\"", lane.name());
                h.render(w, "spindle_dispatch_wait_seconds", &labels);
            }
        }
        let _ = writeln!(w, "# HELP spindle_submit_dispatch_seconds A first attempt's admission to its claim committed and the attempt started.\n# TYPE spindle_submit_dispatch_seconds histogram");
        self.dispatch
            .render(w, "spindle_submit_dispatch_seconds", "attempt=\"first\"");
        let _ = writeln!(w, "# HELP spindle_submit_running_seconds A task's admission (or requeue) to its provider accepting the attempt (RUNNING).\n# TYPE spindle_submit_running_seconds histogram");
        self.running
            .render(w, "spindle_submit_running_seconds", "provider=\"any\"");
        let _ = writeln!(w, "# HELP spindle_tenant_running_units Cost units a tenant runs now, per shard.\n# TYPE spindle_tenant_running_units gauge");
        let _ = writeln!(w, "# HELP spindle_tenant_running_tasks Tasks a tenant runs now, per shard.\n# TYPE spindle_tenant_running_tasks gauge");
        let _ = writeln!(w, "# HELP spindle_tenant_weight A running tenant's DRR weight, per shard.\n# TYPE spindle_tenant_weight gauge");
        for (i, g) in self.shards.iter().enumerate() {
            let tenants = g.tenants.lock().map(|t| t.clone()).unwrap_or_default();
            for t in tenants {
                let _ = writeln!(
                    w,
                    "spindle_tenant_running_units{{shard=\"{i}\",tenant=\"{}\"}} {:.3}",
                    t.tenant,
                    t.units_milli as f64 / 1000.0
                );
                let _ = writeln!(
                    w,
                    "spindle_tenant_running_tasks{{shard=\"{i}\",tenant=\"{}\"}} {}",
                    t.tenant, t.tasks
                );
                let _ = writeln!(
                    w,
                    "spindle_tenant_weight{{shard=\"{i}\",tenant=\"{}\"}} {}",
                    t.tenant, t.weight
                );
            }
        }
    }

    /// The node-wide limits and their shards' parts, the cluster's shares, the policy in force,
    /// reports, live nodes, readiness.
    fn render_limits_and_policy(&self, w: &mut String) {
        if let Some(split) = self.split.get() {
            let _ = writeln!(w, "# HELP spindle_node_limit_capacity Node-wide limits (slots, or requests per minute).\n# TYPE spindle_node_limit_capacity gauge");
            for (name, help) in [
                ("free", "What no shard holds of each node-wide limit."),
                (
                    "owed",
                    "What shards must give back of each node-wide limit to meet their targets.",
                ),
                ("held", "Each shard's part of each node-wide limit."),
                (
                    "used",
                    "What each shard uses of its part of each node-wide limit.",
                ),
                (
                    "weight",
                    "The backlogged weight each shard asks its part of each node-wide limit for.",
                ),
            ] {
                let _ = writeln!(w, "# HELP spindle_node_limit_{name} {help}\n# TYPE spindle_node_limit_{name} gauge");
            }
            let names = split.names.lock().map(|n| n.clone()).unwrap_or_default();
            for (k, name) in names.iter().enumerate() {
                let name = label(name);
                let _ = writeln!(
                    w,
                    "spindle_node_limit_capacity{{limit=\"{name}\"}} {}",
                    split.board.capacity(k)
                );
                let _ = writeln!(
                    w,
                    "spindle_node_limit_free{{limit=\"{name}\"}} {}",
                    split.board.free(k)
                );
                let _ = writeln!(
                    w,
                    "spindle_node_limit_owed{{limit=\"{name}\"}} {}",
                    split.board.owed(k)
                );
                for (i, l) in split.board.loads(k).unwrap_or_default().iter().enumerate() {
                    let labels = format!("limit=\"{name}\",shard=\"{i}\"");
                    let _ = writeln!(w, "spindle_node_limit_held{{{labels}}} {}", l.held);
                    let _ = writeln!(w, "spindle_node_limit_used{{{labels}}} {}", l.used);
                    let _ = writeln!(w, "spindle_node_limit_weight{{{labels}}} {}", l.weight);
                }
            }
            let _ = writeln!(w, "# HELP spindle_cluster_share This node's part of each limit the cluster's nodes share (a rate's in millionths, slots in slots), allotted by backlogged weight every second.\n# TYPE spindle_cluster_share gauge");
            for l in split.ownership.shared_limits() {
                let _ = writeln!(
                    w,
                    "spindle_cluster_share{{limit=\"{}\"}} {}",
                    label(&l.name),
                    split.ownership.share(l.place).unwrap_or(0)
                );
            }
        }
        let _ = writeln!(
            w,
            "# HELP spindle_share_allotments_total Allotments of this node's parts of the limits it shares with the cluster.\n# TYPE spindle_share_allotments_total counter\nspindle_share_allotments_total {}",
            self.share_allotments.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_policy_version The policy version in force.\n# TYPE spindle_policy_version gauge\nspindle_policy_version {}",
            self.policy_version.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_policy_objects_skipped Stored policy objects the node could not take.\n# TYPE spindle_policy_objects_skipped gauge\nspindle_policy_objects_skipped {}",
            self.policy_skipped.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_reports_pending Reports queued or sent and not yet answered.\n# TYPE spindle_reports_pending gauge\nspindle_reports_pending {}\n# HELP spindle_reports_refused_total Reports PostgreSQL answered without applying them.\n# TYPE spindle_reports_refused_total counter\nspindle_reports_refused_total {}",
            self.reports_pending.load(Ordering::Relaxed),
            self.reports_refused.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_live_nodes Nodes heard from within a lease, this one included.\n# TYPE spindle_live_nodes gauge\nspindle_live_nodes {}",
            self.live_nodes.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            w,
            "# HELP spindle_ready 1 while the node is ready (serving, PostgreSQL reachable, not stopping).\n# TYPE spindle_ready gauge\nspindle_ready {}",
            u8::from(self.ready())
        );
    }
}

/// Every section, as written (the HTTP port groups them with the other parts' families:
/// [`crate::exposition::Exposition::collect`]).
impl Collect for Metrics {
    fn collect(&self, w: &mut String) {
        self.render_tasks(w);
        self.render_quotas(w);
        self.render_cluster(w);
        self.render_shards(w);
        self.render_provider(w);
        self.render_answers(w);
        self.render_waits(w);
        self.render_limits_and_policy(w);
    }
}

/// One reconciler's counts (`spindle_reconciler_*{job}`).
#[derive(Debug, Default)]
pub struct ReconcilerCounts {
    pub runs: AtomicU64,
    pub failures: AtomicU64,
    pub findings: AtomicU64,
    pub repairs: AtomicU64,
    /// What the last completed pass found.
    pub last_findings: AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family the node renders has its help and type, once: without the grouping a
    /// family written in two places would be declared twice (as `spindle_queued_tasks` was);
    /// a running tenant's families lacked their help (promtool saw it on a loaded machine).
    #[test]
    fn every_family_is_declared_once_with_its_help_and_type() {
        let metrics = Metrics::new(2);
        // The families written only while there is something to write: a running tenant, a
        // penalized account, a queue's age.
        *metrics.shards[1].tenants.lock().unwrap() = vec![TenantRunning {
            tenant: 7,
            tasks: 2,
            units_milli: 1_500,
            weight: 3,
        }];
        metrics.shards[0]
            .penalized
            .lock()
            .unwrap()
            .push("vendor-0:acct-1".into());
        metrics
            .queue_ages
            .lock()
            .unwrap()
            .push(spindle_control::reconcile::QueueAge {
                lane: 1,
                band: 3,
                queued: 4,
                oldest_s: 12.5,
            });
        let grouped = Exposition::collect(&[&*metrics]);
        assert!(grouped.problems.is_empty(), "{:#?}", grouped.problems);
        assert!(
            grouped.text.matches("# TYPE ").count() > 60,
            "{}",
            grouped.text
        );
    }
}
