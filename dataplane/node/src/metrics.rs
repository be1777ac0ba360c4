//! What the node exposes on its HTTP port: `/livez`, `/readyz` (not ready while PostgreSQL is
//! unreachable or the node is stopping) and `/metrics` in Prometheus text format. Shards and
//! pipelines write plain atomics; the HTTP task reads them. Nothing here takes a lock.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use spindle_core::{Decision, Lane};

/// Control-plane batch latency buckets (µs), Prometheus-style cumulative.
const LATENCY_BUCKETS_US: [u64; 10] = [
    500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 500_000, 2_000_000,
];
pub const KINDS: [&str; 4] = ["submit", "claim", "report", "read"];

#[derive(Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_US.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
    rows: AtomicU64,
}

impl Histogram {
    pub fn record(&self, us: u64, rows: u64) {
        for (i, b) in LATENCY_BUCKETS_US.iter().enumerate() {
            if us <= *b {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.rows.fetch_add(rows, Ordering::Relaxed);
    }
}

#[derive(Default)]
pub struct ShardGauges {
    pub queued_tasks: [AtomicU64; Lane::COUNT],
    pub queued_units_milli: [AtomicU64; Lane::COUNT],
    pub live_tasks: AtomicU64,
    /// Dispatched and not yet finished (what a drain waits for).
    pub running_tasks: AtomicU64,
}

pub struct Metrics {
    pub admissions: [AtomicU64; 8],
    pub completed: AtomicU64,
    pub claims_granted: AtomicU64,
    pub claims_refused: AtomicU64,
    pub batches: [Histogram; 4],
    pub shards: Vec<ShardGauges>,
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
            batches: Default::default(),
            shards: (0..shards).map(|_| ShardGauges::default()).collect(),
            postgres_ok: AtomicBool::new(true),
            stopping: AtomicBool::new(false),
            reports_pending: AtomicU64::new(0),
        })
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
            for (b, c) in LATENCY_BUCKETS_US.iter().zip(&h.buckets) {
                let _ = writeln!(
                    w,
                    "spindle_control_batch_seconds_bucket{{kind=\"{kind}\",le=\"{}\"}} {}",
                    *b as f64 / 1e6,
                    c.load(Ordering::Relaxed)
                );
            }
            let count = h.count.load(Ordering::Relaxed);
            let _ = writeln!(
                w,
                "spindle_control_batch_seconds_bucket{{kind=\"{kind}\",le=\"+Inf\"}} {count}"
            );
            let _ = writeln!(
                w,
                "spindle_control_batch_seconds_sum{{kind=\"{kind}\"}} {}",
                h.sum_us.load(Ordering::Relaxed) as f64 / 1e6
            );
            let _ = writeln!(
                w,
                "spindle_control_batch_seconds_count{{kind=\"{kind}\"}} {count}"
            );
            let _ = writeln!(
                w,
                "spindle_control_batch_rows_total{{kind=\"{kind}\"}} {}",
                h.rows.load(Ordering::Relaxed)
            );
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
