//! What the node exposes on its HTTP port: `/livez`, `/readyz` (not ready while PostgreSQL is
//! unreachable or the node is stopping) and `/metrics` in Prometheus text format. Shards and
//! pipelines write plain atomics; the HTTP task reads them. The one lock is each shard's
//! per-tenant table, written once per shard tick.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

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
pub const KINDS: [&str; 4] = ["submit", "claim", "report", "read"];

/// A cumulative histogram of microseconds, with a row count for batch histograms.
pub struct Histogram {
    bounds: &'static [u64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_us: AtomicU64,
    rows: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [u64]) -> Histogram {
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
    fn render(&self, w: &mut String, name: &str, labels: &str) {
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

/// One tenant's running work on a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantRunning {
    pub tenant: u32,
    pub tasks: u64,
    pub units_milli: u64,
}

/// The node-wide limits split among shards, for `/metrics`: their names and the board.
pub struct SplitView {
    pub names: Vec<String>,
    pub board: Arc<ShareBoard>,
}

#[derive(Default)]
pub struct ShardGauges {
    pub queued_tasks: [AtomicU64; Lane::COUNT],
    pub queued_units_milli: [AtomicU64; Lane::COUNT],
    pub live_tasks: AtomicU64,
    /// Dispatched and not yet finished (what a drain waits for).
    pub running_tasks: AtomicU64,
    /// Tenants with running work, rewritten every shard tick.
    pub tenants: std::sync::Mutex<Vec<TenantRunning>>,
}

pub struct Metrics {
    pub admissions: [AtomicU64; 8],
    pub completed: AtomicU64,
    pub claims_granted: AtomicU64,
    pub claims_refused: AtomicU64,
    pub batches: [Histogram; 4],
    /// Submit frames answered, by outcome: [rejected, accepted (anything in the frame)].
    pub answers: [Histogram; 2],
    /// Admission → dispatch, per lane and band (`lane * Band::COUNT + band`).
    pub waits: Vec<Histogram>,
    pub shards: Vec<ShardGauges>,
    /// Set once the shards' board exists.
    pub split: std::sync::OnceLock<SplitView>,
    /// The last control-plane call reached PostgreSQL.
    pub postgres_ok: AtomicBool,
    pub stopping: AtomicBool,
    /// Reports queued or sent whose answer has not come back (what a drain also waits for).
    pub reports_pending: AtomicU64,
}

impl Metrics {
    pub fn new(shards: usize) -> Arc<Metrics> {
        Arc::new(Metrics {
            admissions: Default::default(),
            completed: AtomicU64::new(0),
            claims_granted: AtomicU64::new(0),
            claims_refused: AtomicU64::new(0),
            batches: std::array::from_fn(|_| Histogram::new(LATENCY_BUCKETS_US)),
            answers: std::array::from_fn(|_| Histogram::new(ANSWER_BUCKETS_US)),
            waits: (0..Lane::COUNT * Band::COUNT)
                .map(|_| Histogram::new(WAIT_BUCKETS_US))
                .collect(),
            shards: (0..shards).map(|_| ShardGauges::default()).collect(),
            split: std::sync::OnceLock::new(),
            postgres_ok: AtomicBool::new(true),
            stopping: AtomicBool::new(false),
            reports_pending: AtomicU64::new(0),
        })
    }

    /// A submit frame was answered `took` after it was decoded.
    pub fn answered_submit(&self, accepted: bool, took: std::time::Duration) {
        self.answers[usize::from(accepted)].record(took.as_micros() as u64, 1);
    }

    /// A task of `lane` and `band` waited `us` from admission to dispatch.
    pub fn waited(&self, lane: Lane, band: Band, us: u64) {
        self.waits[lane.index() * Band::COUNT + band.index()].record(us, 1);
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

    pub fn ready(&self) -> bool {
        self.postgres_ok.load(Ordering::Relaxed) && !self.stopping.load(Ordering::Relaxed)
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let w = &mut out;
        let _ = writeln!(w, "# HELP spindle_admissions_total Submits by admission decision.\n# TYPE spindle_admissions_total counter");
        for d in Decision::ALL {
            let _ = writeln!(
                w,
                "spindle_admissions_total{{decision=\"{}\"}} {}",
                d.name(),
                self.admissions[d as usize].load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            w,
            "# TYPE spindle_tasks_completed_total counter\nspindle_tasks_completed_total {}",
            self.completed.load(Ordering::Relaxed)
        );
        let _ = writeln!(w, "# TYPE spindle_claims_total counter");
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
        let _ = writeln!(w, "# HELP spindle_queued_tasks Queued tasks per shard and lane.\n# TYPE spindle_queued_tasks gauge");
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
        let _ = writeln!(w, "# HELP spindle_control_batch_seconds Control-plane batch latency by kind.\n# TYPE spindle_control_batch_seconds histogram");
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
        let _ = writeln!(w, "# HELP spindle_submit_answer_seconds Submit frames, decoded to answered, by outcome (accepted: anything in the frame was; they wait for the group commit).\n# TYPE spindle_submit_answer_seconds histogram");
        for (outcome, h) in ["rejected", "accepted"].iter().zip(&self.answers) {
            h.render(
                w,
                "spindle_submit_answer_seconds",
                &format!("outcome=\"{outcome}\""),
            );
        }
        let _ = writeln!(w, "# HELP spindle_dispatch_wait_seconds Admission to dispatch, by lane and band.\n# TYPE spindle_dispatch_wait_seconds histogram");
        for lane in Lane::ALL {
            for band in Band::ALL {
                let h = &self.waits[lane.index() * Band::COUNT + band.index()];
                let labels = format!("lane=\"{}\",band=\"{band}\"", lane.name());
                h.render(w, "spindle_dispatch_wait_seconds", &labels);
            }
        }
        let _ = writeln!(w, "# HELP spindle_tenant_running_units Cost units a tenant runs now, per shard.\n# TYPE spindle_tenant_running_units gauge");
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
            }
        }
        if let Some(split) = self.split.get() {
            let _ = writeln!(w, "# HELP spindle_node_limit_capacity Node-wide limits (slots, or requests per minute) and each shard's part of them: held, used, and the backlogged weight that asks for it.\n# TYPE spindle_node_limit_capacity gauge");
            for (k, name) in split.names.iter().enumerate() {
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
                for (i, l) in split.board.loads(k).unwrap_or_default().iter().enumerate() {
                    let labels = format!("limit=\"{name}\",shard=\"{i}\"");
                    let _ = writeln!(w, "spindle_node_limit_held{{{labels}}} {}", l.held);
                    let _ = writeln!(w, "spindle_node_limit_used{{{labels}}} {}", l.used);
                    let _ = writeln!(w, "spindle_node_limit_weight{{{labels}}} {}", l.weight);
                }
            }
        }
        let _ = writeln!(
            w,
            "# TYPE spindle_ready gauge\nspindle_ready {}",
            u8::from(self.ready())
        );
        out
    }
}

/// Serves `/livez`, `/readyz` and `/metrics` until the runtime stops. HTTP/1.0-style: one
/// request per connection, bounded request size.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = match tokio::time::timeout(
                std::time::Duration::from_secs(5),
                stream.read(&mut buf),
            )
            .await
            {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let request = String::from_utf8_lossy(&buf[..n]);
            let path = request.split_whitespace().nth(1).unwrap_or("/");
            let (status, body) = match path {
                "/livez" => ("200 OK", "ok\n".to_string()),
                "/readyz" if metrics.ready() => ("200 OK", "ready\n".to_string()),
                "/readyz" => (
                    "503 Service Unavailable",
                    "not ready: PostgreSQL unreachable or stopping\n".to_string(),
                ),
                "/metrics" => ("200 OK", metrics.render()),
                _ => ("404 Not Found", "not found\n".to_string()),
            };
            let response = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        });
    }
}
