//! spindled's configuration: a TOML file (see `spindled.example.toml`); every field settable
//! by a `SPINDLE_*` environment variable and every secret from a file (`sources`); the most
//! used also by a command-line flag.
//!
//! Long file: every top-level field with its default, its bound and its check; the sections
//! have files of their own.

mod admin;
mod breaker;
mod events;
mod media;
mod provider;
mod reconcile;
pub mod sources;
mod tls;
mod upload;

pub use admin::{AdminToken, Role};
pub use breaker::BreakerConfig;
pub use events::EventsConfig;
pub use media::{DeclarationPolicy, MediaConfig, OUTPUT_URL_BYTES_MAX};
pub use provider::ProviderConfig;
pub use reconcile::{Job, ReconcileConfig};
pub use tls::{TlsConfig, CLIENT_CAS_MAX};
pub use upload::{
    KeySource, UploadConfig, UPLOAD_ATTEMPTS_MAX, UPLOAD_PARTS_IN_FLIGHT_MAX, UPLOAD_PART_MB_MAX,
    UPLOAD_PREFIX_BYTES_MAX,
};

use std::net::SocketAddr;
use std::path::PathBuf;

pub use crate::limits::{CONNECTIONS_MAX, CONNECTION_RATE_MAX, HTTP_CONNECTIONS_MAX};
use crate::limits::{COUNTER_CHECK_S_MAX, CPU_WAKE_LATENCY_US_MAX, TASK_INPUTS_MB_MAX};
use serde::Deserialize;
use spindle_core::Lane;

#[derive(Debug, Clone, clap::Parser)]
#[command(name = "spindled", version, about = "spindle's node daemon")]
pub struct Args {
    /// The configuration file (TOML).
    #[arg(long, env = "SPINDLE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to serve the client protocol on (port 0: any free port).
    #[arg(long, env = "SPINDLE_LISTEN", value_parser = address)]
    pub listen: Option<SocketAddr>,
    /// Address of /livez, /readyz and /metrics.
    #[arg(long, env = "SPINDLE_HTTP_LISTEN", value_parser = address)]
    pub http_listen: Option<SocketAddr>,
    /// The client address other nodes send this node's tenants to ("host:port").
    #[arg(long, env = "SPINDLE_ADVERTISE")]
    pub advertise: Option<String>,
    /// PostgreSQL conninfo, or "embedded" for a private server started by the daemon.
    #[arg(long, env = "SPINDLE_POSTGRES")]
    pub postgres: Option<String>,
    /// Shards (one glommio executor each).
    #[arg(long, env = "SPINDLE_SHARDS")]
    pub shards: Option<u32>,
    #[arg(long, env = "SPINDLE_NODE_ID")]
    pub node_id: Option<String>,
    /// Once serving, write the client address (line 1) and the HTTP address (line 2) to this
    /// file (for scripts and tests).
    #[arg(long, env = "SPINDLE_READY_FILE")]
    pub ready_file: Option<PathBuf>,
    /// Read a tenant credential from standard input, check its strength and print the
    /// `sha256:…` form to write as the tenant's `credential`; then exit.
    #[arg(long)]
    pub hash_credential: bool,
    /// How the log is written to standard error: `text` (coloured only on a terminal), or
    /// `json`, one object a line with the event's fields for a log collector: an event about a
    /// task carries `tenant`, `task` and `attempt` as keys (the shards' events), others what
    /// they name.
    #[arg(long, env = "SPINDLE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// [`Args::log_format`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_node_id")]
    pub node_id: String,
    #[serde(default = "default_listen", deserialize_with = "deserialize_address")]
    pub listen: SocketAddr,
    /// The client address ("host:port") other nodes name when they send this node's tenants
    /// here (`WrongNode`'s redirect); default: the address `listen` bound. Set it where
    /// `listen` is a wildcard (`0.0.0.0`) or behind NAT: a wildcard is never sent as a
    /// redirect.
    #[serde(default)]
    pub advertise: Option<String>,
    /// `/livez`, `/readyz` and `/metrics` (port 0: any free port).
    #[serde(
        default = "default_http_listen",
        deserialize_with = "deserialize_address"
    )]
    pub http_listen: SocketAddr,
    #[serde(default = "default_postgres")]
    pub postgres: String,
    #[serde(default = "default_shards")]
    pub shards: u32,
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// The partitions this node takes at start (default: every one that is free). Several
    /// nodes on one PostgreSQL each list theirs; any node takes over a partition whose owner's
    /// lease expired.
    #[serde(default)]
    pub owned_partitions: Option<Vec<u32>>,
    /// Lease of running attempts and of partitions.
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u32,
    /// Uptime after which this node also takes partitions it does not prefer when they are
    /// free or expired (default: one lease). Until then only its `owned_partitions` are
    /// taken, so every node of a starting cluster has that long to take its own; a cluster
    /// whose nodes start slowly (a busy machine, an image pull) sets it longer.
    #[serde(default)]
    pub takeover_grace_ms: Option<u32>,
    /// PostgreSQL's `statement_timeout` for the node's sessions (a batch is one statement).
    #[serde(default = "default_postgres_statement_timeout_ms")]
    pub postgres_statement_timeout_ms: u32,
    /// How long past the statement timeout a call may go unanswered before its connection is
    /// given up as dead (a partition or failover that left the socket half open): the call is
    /// then in doubt and the node reads its rows back.
    #[serde(default = "default_postgres_answer_grace_ms")]
    pub postgres_answer_grace_ms: u32,
    /// A primary that commits without a synchronous standby (`synchronous_standby_names`
    /// empty, or `synchronous_commit` off or local) is not used: the node waits, not ready,
    /// saying why, until it has one. Without it such a primary is used with a warning on each
    /// connection (an acknowledged commit may then be lost in a failover). Not looked at with
    /// the embedded server.
    #[serde(default)]
    pub require_sync_standby: bool,
    /// On SIGTERM: how long running work may take to finish before the node exits anyway.
    #[serde(default = "default_drain_ms")]
    pub drain_ms: u64,
    /// Rows per control-plane batch (default 1024; at most the store's limit): calls carry
    /// what waits, so this bounds them only under load, where larger calls share PostgreSQL's
    /// fixed cost per call among more rows (docs/benchmarks/journal.md, "Seventeenth round").
    #[serde(default = "default_batch_max")]
    pub batch_max: usize,
    /// Pairs of control-plane pipelines (a submit connection and a claim-and-report
    /// connection each) the shards share: shard `i` uses pair `i % control_pipelines`. Fewer
    /// pairs make fewer, larger calls, and PostgreSQL's cost per call — a function's statements
    /// started and ended, a commit — is most of a small batch's. Default: one pair per four
    /// shards ([`Config::control_pipelines`]).
    #[serde(default)]
    pub control_pipelines: Option<u32>,
    /// How long, at most, a claim-and-report pipeline that is free holds reports back for a
    /// fuller call (`batch_max` rows); 0: a call starts as soon as anything waits. A finish
    /// becomes durable (and visible, and its slots free) up to this much later; PostgreSQL's
    /// fixed cost per call is shared by more reports, and fewer report calls compete with the
    /// submits for the CPU (docs/benchmarks/journal.md, "Seventeenth round").
    #[serde(default = "default_report_hold_us")]
    pub report_hold_us: u32,
    /// How long a new submit may be expected to wait for its commit (or the accepted work
    /// ahead of it for its claims and reports, twice this) before the node refuses it at once,
    /// `REJECT_PLATFORM_OVERLOADED` with a `retry_after_ms` hint, instead of queueing it. The
    /// tenants sending the most for their weight are refused first, from an eighth of it,
    /// and the quietest only past twice it (`spindle_node_base::overload`). 0: never refused for the
    /// durable path's load.
    #[serde(default = "default_ack_budget_ms")]
    pub ack_budget_ms: u32,
    /// The local provider finishes a task after its modelled provider time × this factor.
    #[serde(default = "default_time_scale")]
    pub local_provider_time_scale: f64,
    /// Where the local provider appends "task attempt" per execution (tests prove exactly-once
    /// across restarts with it); none by default.
    #[serde(default)]
    pub local_provider_log: Option<PathBuf>,
    /// MiB of task inputs (`SubmitTask.input`) the node holds in memory for its live tasks,
    /// split evenly among the shards: an input is kept from admission until its task ends (each
    /// attempt at the provider sends it). Past a shard's part, a new task's input is left in its
    /// stored request (in PostgreSQL) and read back when an attempt goes to the provider.
    #[serde(default = "default_task_inputs_mb")]
    pub task_inputs_mb: u32,
    /// Requests one connection may have in flight.
    #[serde(default = "default_inflight")]
    pub connection_inflight_max: usize,
    /// Authenticated client connections the node serves at once (1..=1048576). A connection
    /// that finds it full is refused, answered `Overloaded` naming the bound (a TLS one after
    /// its handshake, while its shard's 32 such handshakes a second allow; past them closed at
    /// once, so a flood costs little CPU); counted in `spindle_connections_refused_total`.
    /// Connections still greeting (before their Hello is answered) do not count here: they
    /// have a budget of their own, `unauthenticated_max`.
    #[serde(default = "default_connections_max")]
    pub connections_max: usize,
    /// Connections the node lets greet at once (TLS handshake and Hello, 1..=1048576), each
    /// shard its share, and from one source address (1..=`unauthenticated_max`). A new one
    /// past either bound closes the oldest still greeting — from its own address when that
    /// address holds its most — so that idle or slow unauthenticated sockets never keep a
    /// client that says Hello at once from being served; counted in
    /// `spindle_connections_evicted_total`.
    #[serde(default = "default_unauthenticated_max")]
    pub unauthenticated_max: usize,
    #[serde(default = "default_unauthenticated_per_address_max")]
    pub unauthenticated_per_address_max: usize,
    /// How long a connection may take to complete its TLS handshake and Hello before it is
    /// closed (100..=60000 ms). Before its Hello a connection's frames are held to 4 KiB.
    #[serde(default = "default_hello_timeout_ms")]
    pub hello_timeout_ms: u32,
    /// New client connections taken per second, the node's shards together (0: no bound, the
    /// default), each shard its share, a second's worth at once. Past it a shard holds the
    /// connection it accepted until the rate allows, the next ones waiting in the kernel's
    /// backlog: a reconnect storm's TLS handshakes (~0.25 ms of CPU each) then take at most
    /// this much of the CPU the running work needs (docs/benchmarks/journal.md).
    #[serde(default)]
    pub connection_rate_max: u32,
    /// Connections the HTTP port (metrics, probes, admin API, provider callbacks) holds at
    /// once (1..=65536). A new one past it closes the oldest that is not in a request (idle
    /// between requests, or still sending its head); with every one in a request it is
    /// answered `503` with `retry-after: 1` (closed at once over TLS), counted in
    /// `spindle_http_connections_refused_total` (`spindle_node_http::serve`).
    #[serde(default = "default_http_connections_max")]
    pub http_connections_max: usize,
    /// Backoff before the first retry of a failed attempt (doubling per retry, × a jitter of
    /// 0.7–1.3), and its cap.
    #[serde(default = "default_backoff_base_ms")]
    pub retry_backoff_base_ms: u64,
    #[serde(default = "default_backoff_max_ms")]
    pub retry_backoff_max_ms: u64,
    /// An HTTP provider (the generic async-job API). Without it the in-process local provider
    /// runs every task after its modelled time.
    #[serde(default)]
    pub provider: Option<ProviderConfig>,
    /// The media stage (probe and transcode of each finished job's video on worker threads).
    /// Without it the media step completes at once.
    #[serde(default)]
    pub media: Option<MediaConfig>,
    /// Tokens of the admin API on the HTTP port (none: the admin API answers 404).
    #[serde(default)]
    pub admin_tokens: Vec<AdminToken>,
    /// Microseconds a shard's executor keeps polling after it runs out of work before it
    /// sleeps: a wake-up from another thread (a connection on another executor, an answer from
    /// the control plane) then costs nothing instead of tens of microseconds. 0 turns it off
    /// (for nodes where a spinning core is worth more elsewhere).
    #[serde(default = "default_idle_spin_us")]
    pub idle_spin_us: u64,
    /// Microseconds within which an idle CPU must be able to run again, asked of the kernel for
    /// as long as the node runs (Linux PM QoS: `spindled::wake_latency`). Unset: not asked. 0
    /// keeps idle CPUs polling — on a virtual machine whose idle CPUs halt, each wake-up of a
    /// commit's path otherwise goes through the hypervisor.
    #[serde(default)]
    pub cpu_wake_latency_us: Option<u32>,
    /// Ended tasks (SUCCEEDED, CANCELED, EXPIRED) leave PostgreSQL this long after they ended,
    /// with their attempt history; their idempotency keys are forgotten with them. 0 keeps
    /// every task forever.
    #[serde(default = "default_retention_finished_s")]
    pub retention_finished_s: u64,
    /// The same for FAILED tasks (the dead-letter queue); 0 keeps them forever.
    #[serde(default = "default_retention_failed_s")]
    pub retention_failed_s: u64,
    /// Outbox rows (the events of the changes they were written with) leave this long after
    /// they were written: delivered ones, and without an `[events]` relay every one (nobody
    /// would take them). With a relay, undelivered events wait for it however old. 0 keeps
    /// them forever.
    #[serde(default = "default_retention_events_s")]
    pub retention_events_s: u64,
    /// Seconds the admin API's audit log is kept (default 90 days; each node's retention
    /// passes remove older rows, oldest first). 0 keeps it forever.
    #[serde(default = "default_retention_audit_s")]
    pub retention_audit_s: u64,
    /// Seconds a starting node waits for PostgreSQL to answer, trying again with backoff (not
    /// ready meanwhile, saying why on `/readyz` and in the log), before it exits. 0: as long
    /// as it takes.
    #[serde(default)]
    pub postgres_wait_s: u64,
    /// The event relay: where the outbox's events are posted. None: events stay in
    /// PostgreSQL (for `retention_events_s`).
    #[serde(default)]
    pub events: Option<EventsConfig>,
    /// Rows of the task table one retention pass looks at (passes run after each lease renewal,
    /// for up to a quarter of the renewal interval).
    #[serde(default = "default_retention_scan_rows")]
    pub retention_scan_rows: usize,
    /// Seconds between checks that every pool counter equals the sum of its ACTIVE
    /// reservations (a read-only snapshot that walks the task table once; drift is logged,
    /// counted in `spindle_reservation_drift_shards`, and repaired with `counter_repair`).
    /// 0 turns the check off.
    #[serde(default = "default_counter_check_s")]
    pub counter_check_s: u64,
    /// Whether a check that finds drift repairs it at once (`Db::rebuild_counters`, audited as
    /// the node's): every counter is derived from what live attempts hold (design.md §2.5, §8),
    /// and a counter below it lets claims past a limit. false: drift is only logged and
    /// counted, for an admin's `spindlectl rebuild-counters`.
    #[serde(default = "default_counter_repair")]
    pub counter_repair: bool,
    /// The reconcilers' periods and bounds (`spindle_node_control::reconciler`): lapsed and stuck attempts,
    /// orphan provider jobs, provider cost drift, starving tasks.
    #[serde(default)]
    pub reconcile: ReconcileConfig,
    /// Completions with a reported cost a model needs before its new tasks are priced at what
    /// its tasks really cost (the 95th percentile of reported over estimated cost of its last
    /// 64, within ×0.5..×4: `spindle_core::policy::CalibrationPolicy`); 0 turns it off.
    #[serde(default = "default_cost_calibration_samples")]
    pub cost_calibration_samples: u32,
    /// Concurrency of each of the two local provider accounts (global: a pool in PostgreSQL).
    #[serde(default = "default_provider_concurrency")]
    pub provider_concurrency: u64,
    /// Requests per minute of each provider account (the node runs 95 % of it, with a burst
    /// of half a second's worth).
    #[serde(default = "default_provider_rpm")]
    pub provider_rpm: u64,
    /// Cost (milli cost units) a minute the node may start over all its tenants, a tenth of
    /// it at once: work past it waits in its queue (unlimited when absent).
    #[serde(default)]
    pub platform_cost_per_minute_milli: Option<u64>,
    /// Concurrent units each lane may run (the enterprise reserve keeps its preset share).
    #[serde(default = "default_lane_capacity")]
    pub lane_capacity_units: u64,
    /// One lane's own settings, by its name (`[lanes.EXPENSIVE]`): over `lane_capacity_units`
    /// and the presets, and under the policy store's `lane/NAME` objects.
    #[serde(default)]
    pub lanes: std::collections::BTreeMap<Lane, LaneConfig>,
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    /// Other cells — each its own nodes and PostgreSQL — and the tenants they serve: a client
    /// of one of those tenants that reaches this node is sent to its cell (`WrongNode`,
    /// redirecting to the cell's address) before it is authenticated (docs/scaling.md).
    #[serde(default)]
    pub cells: Vec<CellConfig>,
    /// The tenant breaker: a tenant whose requests are refused faster than this for longer
    /// than its burst is suspended for a cooldown (`spindle_node_shard::breaker`).
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// TLS on the client protocol's port and the HTTP port, with this certificate and key;
    /// both plain without it.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    #[serde(skip)]
    pub ready_file: Option<PathBuf>,
}

/// A lane's own settings (`[lanes.NAME]`); the preset's where absent.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaneConfig {
    /// Concurrent units the lane may run (its pool).
    #[serde(default)]
    pub capacity_units: Option<u64>,
    /// Tasks the lane may run at once.
    #[serde(default)]
    pub running_tasks_max: Option<u64>,
    /// Retries of a task after retryable failures.
    #[serde(default)]
    pub retries_max: Option<u32>,
    /// A cost budget of its own (milli cost units a minute, a tenth of it at once): its tasks
    /// wait past it, and no other lane's draw on it; the lanes without one share what is left
    /// of `platform_cost_per_minute_milli`.
    #[serde(default)]
    pub cost_per_minute_milli: Option<u64>,
    /// How long one of its provider jobs may run from its attempt's start: past it the job is
    /// canceled at the provider and the task fails, with that reason.
    #[serde(default)]
    pub execution_timeout_ms: Option<u64>,
    /// Media workers of its own: its media jobs run at most this many at once, and no other
    /// lane's on them; the lanes without share what is left of `media.workers`.
    #[serde(default)]
    pub media_workers: Option<u64>,
}

impl LaneConfig {
    /// Sets what this section names in `lane`.
    pub fn apply(&self, lane: &mut spindle_core::policy::LanePolicy) {
        if let Some(units) = self.capacity_units {
            lane.capacity = spindle_core::Units::whole(units);
        }
        if let Some(n) = self.running_tasks_max {
            lane.running_tasks_max = n;
        }
        if let Some(n) = self.retries_max {
            lane.retries_max = n;
        }
        if let Some(per_minute) = self.cost_per_minute_milli {
            lane.cost_per_minute = Some(spindle_core::policy::RateSpec {
                per_minute,
                burst: (per_minute / 10).max(1),
            });
        }
        if let Some(ms) = self.execution_timeout_ms {
            lane.execution_timeout_ms = ms;
        }
        if self.media_workers.is_some() {
            lane.media_workers = self.media_workers;
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub id: u32,
    /// The tenant's credential, presented in Hello: `sha256:<hex>` of it (`spindled
    /// --hash-credential`), or the secret itself, at least 16 characters of some variety
    /// (`crate::credential`).
    pub credential: String,
    #[serde(default = "default_lane")]
    pub lane: Lane,
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Submits a minute the tenant may make (unlimited when absent); more are rejected at
    /// admission as rate limited, without touching PostgreSQL.
    #[serde(default)]
    pub submit_per_minute: Option<u64>,
    /// Tasks the tenant may have queued (unlimited when absent).
    #[serde(default)]
    pub queued_tasks_max: Option<u64>,
    /// Cancels a minute the tenant may send (each is stored in PostgreSQL before its answer),
    /// a tenth of it at once; more are answered `RateLimited` with when to try again.
    #[serde(default = "default_cancel_per_minute")]
    pub cancel_per_minute: u64,
    /// Status reads a minute the tenant may make of tasks no longer live (read from
    /// PostgreSQL; a live task's status is answered from memory and not counted), a tenth of it
    /// at once; more are answered `RateLimited`. Unlimited when absent: a client that checks
    /// every task it submitted (the loadgen does) reads them all.
    #[serde(default)]
    pub store_reads_per_minute: Option<u64>,
    /// Cost (milli cost units) a minute the tenant may start, a tenth of it at once: work past
    /// it waits in its queue (unlimited when absent).
    #[serde(default)]
    pub cost_per_minute_milli: Option<u64>,
    /// The limits each of the tenant's users gets (unlimited where absent).
    #[serde(default)]
    pub user: UserLimits,
    /// Periodic quotas (`[[tenants.quotas]]`: `scope` = "tenant", "user" or "model" with
    /// `model`, `period` = "minute", "day" or "month", `cost_milli` and/or `tasks`).
    #[serde(default)]
    pub quotas: Vec<spindle_core::quota::Quota>,
    /// The tenant's time zone for its quotas' periods, in minutes from UTC.
    #[serde(default)]
    pub utc_offset_min: i32,
}

/// A tenant's limits for each of its users (`[tenants.user]`): unlimited where absent.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserLimits {
    /// Submits a minute a user may make, a sixtieth of it at once (at least one): more are
    /// rejected `RejectUserRateLimit`.
    pub submit_per_minute: Option<u64>,
    /// Tasks a user may have queued; more are rejected `RejectTenantQueueFull` naming the
    /// user's limit.
    pub queued_tasks_max: Option<u64>,
    /// Units of work a user may have queued.
    pub queued_units_max: Option<u64>,
    /// Tasks a user may have running: more wait in the queue (the tenant's other users' work
    /// goes past them).
    pub running_tasks_max: Option<u64>,
    /// Units of work a user may have running.
    pub running_units_max: Option<u64>,
}

impl UserLimits {
    /// These limits over `user` (the preset's, unlimited).
    pub fn apply(&self, user: &mut spindle_core::policy::UserPolicy) {
        if let Some(per_minute) = self.submit_per_minute {
            user.submit_rate = spindle_core::policy::RateSpec {
                per_minute,
                burst: (per_minute / 60).max(1),
            };
        }
        if let Some(n) = self.queued_tasks_max {
            user.queued_tasks_max = n;
        }
        if let Some(n) = self.queued_units_max {
            user.queued_units_max = spindle_core::Units::whole(n);
        }
        if let Some(n) = self.running_tasks_max {
            user.running_tasks_max = n;
        }
        if let Some(n) = self.running_units_max {
            user.running_units_max = spindle_core::Units::whole(n);
        }
    }
}

fn default_cancel_per_minute() -> u64 {
    6_000
}

fn default_node_id() -> String {
    "node-1".into()
}
/// `host:port` as a socket address: an address (`10.0.0.7:7070`, `[::1]:7070`) as it is, a
/// name (`localhost:7070`, `spindled-0.spindled:7070`) resolved now, its first address taken.
/// Every address spindle's programs take goes through this.
pub fn address(text: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = text.parse() {
        return Ok(a);
    }
    host_port(text).ok_or_else(|| format!("{text:?} is not host:port"))?;
    text.to_socket_addrs()
        .map_err(|e| format!("{text}: {e}"))?
        .next()
        .ok_or_else(|| format!("{text}: the name has no address"))
}

/// `host:port` split at its last colon: a host that is not empty and a port (a bracketed IPv6
/// host keeps its brackets). What [`address`] resolves (port 0: any free one) and `advertise`
/// sends (never port 0).
pub fn host_port(text: &str) -> Option<(&str, u16)> {
    let (host, port) = text.rsplit_once(':')?;
    let port = port.parse::<u16>().ok()?;
    (!host.is_empty()).then_some((host, port))
}

fn deserialize_address<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(d)?;
    address(&text).map_err(serde::de::Error::custom)
}

fn default_listen() -> SocketAddr {
    "127.0.0.1:7070".parse().expect("literal address")
}
fn default_http_listen() -> SocketAddr {
    "127.0.0.1:7072".parse().expect("literal address")
}
fn default_postgres() -> String {
    "embedded".into()
}
fn default_shards() -> u32 {
    2
}
fn default_partitions() -> u32 {
    64
}
fn default_task_inputs_mb() -> u32 {
    1024
}
fn default_lease_ms() -> u32 {
    30_000
}
fn default_postgres_statement_timeout_ms() -> u32 {
    10_000
}
fn default_postgres_answer_grace_ms() -> u32 {
    5_000
}
fn default_drain_ms() -> u64 {
    30_000
}
fn default_report_hold_us() -> u32 {
    5_000
}
fn default_ack_budget_ms() -> u32 {
    50
}
/// The longest `ack_budget_ms` accepted.
const ACK_BUDGET_MAX_MS: u32 = 60_000;
/// The longest `report_hold_us` accepted.
const REPORT_HOLD_MAX_US: u32 = 100_000;
/// Shards per pair of control-plane pipelines by default.
const SHARDS_PER_PIPELINES: u32 = 4;

fn default_batch_max() -> usize {
    1024
}
fn default_time_scale() -> f64 {
    0.001
}
fn default_inflight() -> usize {
    4096
}
fn default_connections_max() -> usize {
    16_384
}
fn default_unauthenticated_max() -> usize {
    1_024
}
fn default_unauthenticated_per_address_max() -> usize {
    128
}
fn default_hello_timeout_ms() -> u32 {
    2_000
}
fn default_http_connections_max() -> usize {
    1_024
}
fn default_provider_concurrency() -> u64 {
    100
}
fn default_provider_rpm() -> u64 {
    6_000
}
fn default_lane_capacity() -> u64 {
    40
}
fn default_backoff_base_ms() -> u64 {
    1_000
}
fn default_backoff_max_ms() -> u64 {
    60_000
}
fn default_retention_finished_s() -> u64 {
    7 * 24 * 3600
}
fn default_retention_failed_s() -> u64 {
    30 * 24 * 3600
}
fn default_retention_events_s() -> u64 {
    24 * 3600
}
fn default_retention_audit_s() -> u64 {
    90 * 24 * 3600
}
fn default_retention_scan_rows() -> usize {
    5_000
}
fn default_cost_calibration_samples() -> u32 {
    16
}
fn default_counter_repair() -> bool {
    true
}
fn default_counter_check_s() -> u64 {
    300
}
fn default_idle_spin_us() -> u64 {
    200
}
fn default_lane() -> Lane {
    Lane::Standard
}
fn default_weight() -> u32 {
    1
}

impl Args {
    /// Only a configuration file (no flag or environment overrides), optionally a ready file.
    pub fn file(config: PathBuf, ready_file: Option<PathBuf>) -> Args {
        Args {
            config: Some(config),
            listen: None,
            http_listen: None,
            advertise: None,
            postgres: None,
            shards: None,
            node_id: None,
            ready_file,
            hash_credential: false,
            log_format: LogFormat::Text,
        }
    }
}

/// A retention window of `seconds`; `None` (0): kept forever.
pub fn retention_window(seconds: u64) -> Option<std::time::Duration> {
    (seconds > 0).then(|| std::time::Duration::from_secs(seconds))
}

impl Config {
    /// The file (if any), then flags and environment on top; checks the result.
    pub fn load(args: &Args) -> anyhow::Result<Config> {
        Config::load_with(args, std::env::vars())
    }

    /// [`Config::load`] with `vars` for the process's environment: the file, then the
    /// `SPINDLE_*` variables among `vars`, then secrets read from their files, then the flags.
    pub fn load_with(
        args: &Args,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> anyhow::Result<Config> {
        let text = match &args.config {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?,
            None => String::new(),
        };
        let from = |e: &dyn std::fmt::Display| match &args.config {
            Some(path) => anyhow::anyhow!("{}: {e}", path.display()),
            None => anyhow::anyhow!("{e}"),
        };
        let mut doc: toml::Table = toml::from_str(&text).map_err(|e| from(&e))?;
        let applied = sources::overlay_env(&mut doc, vars, sources::fields_of::<Config>())?;
        let mut doc = toml::Value::Table(doc);
        sources::read_secret_files(&mut doc, "")?;
        let mut config = Config::deserialize(doc).map_err(|e| {
            if applied.is_empty() {
                from(&e)
            } else {
                from(&format!("{e} (with {})", applied.join(", ")))
            }
        })?;
        if let Some(v) = args.listen {
            config.listen = v;
        }
        if let Some(v) = args.http_listen {
            config.http_listen = v;
        }
        if let Some(v) = &args.advertise {
            config.advertise = Some(v.clone());
        }
        if let Some(v) = &args.postgres {
            config.postgres = v.clone();
        }
        if let Some(v) = args.shards {
            config.shards = v;
        }
        if let Some(v) = &args.node_id {
            config.node_id = v.clone();
        }
        config.ready_file = args.ready_file.clone();
        config.check()?;
        Ok(config)
    }

    /// The pairs of control-plane pipelines: as configured, else one per four shards.
    pub fn control_pipelines(&self) -> u32 {
        self.control_pipelines
            .unwrap_or(self.shards.div_ceil(SHARDS_PER_PIPELINES))
    }

    /// Whether ended tasks are kept long enough for `tenant`'s `quotas`: a restart or takeover
    /// counts the current periods' consumption from the ended tasks PostgreSQL still holds, so
    /// they must outlive the longest period a quota counts (and a day for time zones).
    pub fn check_quota_retention(
        &self,
        tenant: u32,
        quotas: &[spindle_core::quota::Quota],
    ) -> Result<(), String> {
        let longest = quotas.iter().map(|q| q.period.longest_ms() / 1_000).max();
        match (longest, self.retention_finished_s) {
            (Some(s), kept) if kept > 0 && kept < s + 86_400 => Err(format!(
                "tenant {tenant}: a quota counts periods of up to {s} s, but retention_finished_s \
                 ({kept}) would prune the ended tasks a restart counts them from: set it to at \
                 least {}",
                s + 86_400
            )),
            _ => Ok(()),
        }
    }

    fn check(&self) -> anyhow::Result<()> {
        self.check_listeners_and_store()?;
        self.check_limits()?;
        self.check_sections()?;
        self.check_admin_and_partitions()?;
        self.check_tenants()?;
        self.check_cells()?;
        Ok(())
    }

    /// Addresses, shards and partitions, the store's timeouts, batches and pipelines.
    fn check_listeners_and_store(&self) -> anyhow::Result<()> {
        if let Some(a) = &self.advertise {
            anyhow::ensure!(
                a.len() <= spindle_wire::limits::ADDRESS_BYTES_MAX
                    && host_port(a).is_some_and(|(_, port)| port != 0),
                "advertise must be \"host:port\" (a port 1..=65535, at most {} bytes), not {a:?}",
                spindle_wire::limits::ADDRESS_BYTES_MAX
            );
        }
        anyhow::ensure!(
            (1..=64).contains(&self.shards),
            "shards must be 1..=64, not {}",
            self.shards
        );
        anyhow::ensure!(
            // A node leases, walks and restores its partitions in one batch each.
            self.partitions >= self.shards
                && self.partitions as usize <= spindle_control::limits::BATCH_MAX,
            "partitions must be shards..={}, not {}",
            spindle_control::limits::BATCH_MAX,
            self.partitions
        );
        anyhow::ensure!(
            (1..=spindle_control::limits::BATCH_MAX).contains(&self.batch_max),
            "batch_max must be 1..={}",
            spindle_control::limits::BATCH_MAX
        );
        anyhow::ensure!(
            self.report_hold_us <= REPORT_HOLD_MAX_US,
            "report_hold_us must be 0..={REPORT_HOLD_MAX_US}, not {}",
            self.report_hold_us
        );
        anyhow::ensure!(
            self.ack_budget_ms <= ACK_BUDGET_MAX_MS,
            "ack_budget_ms must be 0..={ACK_BUDGET_MAX_MS}, not {}",
            self.ack_budget_ms
        );
        anyhow::ensure!(
            (1..=self.shards).contains(&self.control_pipelines()),
            "control_pipelines must be 1..=shards ({}), not {}",
            self.shards,
            self.control_pipelines()
        );
        anyhow::ensure!(self.lease_ms >= 1_000, "lease_ms must be at least 1000");
        anyhow::ensure!(
            self.takeover_grace_ms.is_none_or(|g| g <= 3_600_000),
            "takeover_grace_ms must be at most 3600000 (an hour)"
        );
        anyhow::ensure!(
            (1..=CONNECTIONS_MAX).contains(&self.connections_max),
            "connections_max must be 1..={CONNECTIONS_MAX}, not {}",
            self.connections_max
        );
        anyhow::ensure!(
            (1..=CONNECTIONS_MAX).contains(&self.unauthenticated_max),
            "unauthenticated_max must be 1..={CONNECTIONS_MAX}, not {}",
            self.unauthenticated_max
        );
        anyhow::ensure!(
            (1..=self.unauthenticated_max).contains(&self.unauthenticated_per_address_max),
            "unauthenticated_per_address_max must be 1..=unauthenticated_max ({}), not {}",
            self.unauthenticated_max,
            self.unauthenticated_per_address_max
        );
        anyhow::ensure!(
            (100..=60_000).contains(&self.hello_timeout_ms),
            "hello_timeout_ms must be 100..=60000, not {}",
            self.hello_timeout_ms
        );
        anyhow::ensure!(
            (1..=HTTP_CONNECTIONS_MAX).contains(&self.http_connections_max),
            "http_connections_max must be 1..={HTTP_CONNECTIONS_MAX}, not {}",
            self.http_connections_max
        );
        Ok(())
    }

    /// Connections, rates, budgets, retention and the periodic checks.
    fn check_limits(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.connection_rate_max <= CONNECTION_RATE_MAX,
            "connection_rate_max must be 0..={CONNECTION_RATE_MAX}, not {}",
            self.connection_rate_max
        );
        anyhow::ensure!(
            (1..=TASK_INPUTS_MB_MAX).contains(&self.task_inputs_mb),
            "task_inputs_mb must be 1..={TASK_INPUTS_MB_MAX}, not {}",
            self.task_inputs_mb
        );
        anyhow::ensure!(
            (100..=600_000).contains(&self.postgres_statement_timeout_ms),
            "postgres_statement_timeout_ms must be 100..=600000"
        );
        anyhow::ensure!(
            (100..=600_000).contains(&self.postgres_answer_grace_ms),
            "postgres_answer_grace_ms must be 100..=600000"
        );
        anyhow::ensure!(
            (1..=1_000_000).contains(&self.provider_concurrency),
            "provider_concurrency must be 1..=1000000"
        );
        anyhow::ensure!(
            (60..=1_000_000_000).contains(&self.provider_rpm),
            "provider_rpm must be 60..=1000000000"
        );
        anyhow::ensure!(
            (1..=1_000_000).contains(&self.lane_capacity_units),
            "lane_capacity_units must be 1..=1000000"
        );
        anyhow::ensure!(
            self.local_provider_time_scale >= 0.0 && self.local_provider_time_scale <= 10.0,
            "local_provider_time_scale must be 0..=10"
        );
        anyhow::ensure!(
            self.idle_spin_us <= 10_000,
            "idle_spin_us must be 0..=10000"
        );
        anyhow::ensure!(
            self.cpu_wake_latency_us
                .is_none_or(|us| us <= CPU_WAKE_LATENCY_US_MAX),
            "cpu_wake_latency_us must be 0..={CPU_WAKE_LATENCY_US_MAX}"
        );
        anyhow::ensure!(
            (1..=spindle_control::limits::SCAN_MAX).contains(&self.retention_scan_rows),
            "retention_scan_rows must be 1..={}",
            spindle_control::limits::SCAN_MAX
        );
        self.breaker.validate()?;
        anyhow::ensure!(
            self.cost_calibration_samples as usize <= spindle_core::limits::CALIBRATION_WINDOW,
            "cost_calibration_samples must be 0..={}",
            spindle_core::limits::CALIBRATION_WINDOW
        );
        anyhow::ensure!(
            self.counter_check_s <= COUNTER_CHECK_S_MAX,
            "counter_check_s must be 0..={COUNTER_CHECK_S_MAX}"
        );
        self.reconcile.check()?;
        Ok(())
    }

    /// Lanes, the policy the configuration makes, and the optional sections.
    fn check_sections(&self) -> anyhow::Result<()> {
        for (lane, l) in &self.lanes {
            if let Some(units) = l.capacity_units {
                anyhow::ensure!(
                    (1..=1_000_000).contains(&units),
                    "lanes.{lane}.capacity_units must be 1..=1000000, not {units}"
                );
            }
        }
        // What the tenants' (and lanes') sections make of the policy (their quotas, say) is checked
        // as the policy store checks it.
        crate::policy::policy(self)
            .validate()
            .map_err(|e| anyhow::anyhow!("the configured policy: {e}"))?;
        // A restart or takeover counts the current periods' consumption from the ended tasks
        // PostgreSQL still holds: they must outlive the longest period a quota counts.
        for t in &self.tenants {
            self.check_quota_retention(t.id, &t.quotas)
                .map_err(anyhow::Error::msg)?;
        }
        if let Some(p) = &self.provider {
            p.check()?;
        }
        if let Some(m) = &self.media {
            m.check()?;
        }
        if let Some(e) = &self.events {
            e.check()?;
        }
        if let Some(t) = &self.tls {
            t.check()?;
        }
        Ok(())
    }

    /// Admin tokens, the wait for PostgreSQL and the owned partitions.
    fn check_admin_and_partitions(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.postgres_wait_s <= 7 * 86_400,
            "postgres_wait_s must be 0..=604800"
        );
        for t in &self.admin_tokens {
            anyhow::ensure!(
                t.token.len() >= 16,
                "admin token of {} is shorter than 16 bytes",
                t.name
            );
            anyhow::ensure!(
                crate::credential::hashed_form_ok(&t.token) != Some(false),
                "admin token of {}: sha256: must be followed by 64 hex digits",
                t.name
            );
            anyhow::ensure!(!t.name.is_empty(), "an admin token needs a name");
        }
        anyhow::ensure!(
            (1..=3_600_000).contains(&self.retry_backoff_base_ms)
                && (self.retry_backoff_base_ms..=3_600_000).contains(&self.retry_backoff_max_ms),
            "retry backoff: 1 <= retry_backoff_base_ms <= retry_backoff_max_ms <= 3600000"
        );
        if let Some(owned) = &self.owned_partitions {
            let mut sorted = owned.clone();
            sorted.sort_unstable();
            sorted.dedup();
            anyhow::ensure!(
                sorted.len() == owned.len(),
                "owned_partitions lists a partition twice"
            );
            if let Some(p) = owned.iter().find(|&&p| p >= self.partitions) {
                anyhow::bail!(
                    "owned_partitions: {p} is not below partitions ({})",
                    self.partitions
                );
            }
        }
        Ok(())
    }

    /// The tenants: unique ids, credentials of some strength, their limits' bounds.
    /// Each cell named once, reached at a `host:port`, and no tenant in two places.
    fn check_cells(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.cells.len() <= CELLS_MAX,
            "at most {CELLS_MAX} cells, not {}",
            self.cells.len()
        );
        let mut names = std::collections::HashSet::new();
        let mut seen: std::collections::HashSet<u32> = self.tenants.iter().map(|t| t.id).collect();
        let mut total = 0usize;
        for c in &self.cells {
            anyhow::ensure!(
                !c.name.is_empty() && c.name.len() <= 64 && names.insert(c.name.as_str()),
                "cells: a cell's name is 1..=64 bytes and named once, not {:?}",
                c.name
            );
            anyhow::ensure!(
                c.address.len() <= spindle_wire::limits::ADDRESS_BYTES_MAX
                    && host_port(&c.address).is_some_and(|(_, port)| port != 0),
                "cells: cell {:?}'s address must be \"host:port\", not {:?}",
                c.name,
                c.address
            );
            anyhow::ensure!(
                !c.tenants.is_empty(),
                "cells: cell {:?} names no tenant",
                c.name
            );
            total += c.tenants.len();
            anyhow::ensure!(
                total <= CELL_TENANTS_MAX,
                "cells: at most {CELL_TENANTS_MAX} tenants in all"
            );
            for &t in &c.tenants {
                anyhow::ensure!(
                    t != 0 && seen.insert(t),
                    "cells: tenant {t} of cell {:?} is also served here or by another cell",
                    c.name
                );
            }
        }
        Ok(())
    }

    /// Tenant → (cell, address) of the tenants other cells serve.
    pub fn other_cells(&self) -> std::collections::HashMap<u32, (String, String)> {
        self.cells
            .iter()
            .flat_map(|c| {
                c.tenants
                    .iter()
                    .map(|&t| (t, (c.name.clone(), c.address.clone())))
            })
            .collect()
    }

    fn check_tenants(&self) -> anyhow::Result<()> {
        let mut ids: Vec<u32> = self.tenants.iter().map(|t| t.id).collect();
        ids.sort_unstable();
        ids.dedup();
        anyhow::ensure!(ids.len() == self.tenants.len(), "a tenant id appears twice");
        anyhow::ensure!(!ids.contains(&0), "tenant id 0 is reserved");
        for t in &self.tenants {
            if let Err(e) = crate::credential::Credential::parse(&t.credential) {
                anyhow::bail!("tenant {}: credential: {e}", t.id);
            }
            anyhow::ensure!(
                t.submit_per_minute
                    .is_none_or(|r| (1..=1_000_000_000).contains(&r)),
                "tenant {}: submit_per_minute must be 1..=1000000000",
                t.id
            );
            anyhow::ensure!(
                t.queued_tasks_max
                    .is_none_or(|q| (1..=1 << 30).contains(&q)),
                "tenant {}: queued_tasks_max must be 1..=1073741824",
                t.id
            );
            for (name, rate) in [
                ("cancel_per_minute", Some(t.cancel_per_minute)),
                ("store_reads_per_minute", t.store_reads_per_minute),
            ] {
                anyhow::ensure!(
                    rate.is_none_or(|r| (1..=1_000_000_000).contains(&r)),
                    "tenant {}: {name} must be 1..=1000000000",
                    t.id
                );
            }
        }
        Ok(())
    }

    /// The address other nodes send this node's tenants to, the client protocol bound at
    /// `bound`: `advertise` when set.
    pub fn client_address(&self, bound: SocketAddr) -> String {
        self.advertise.clone().unwrap_or_else(|| bound.to_string())
    }

    /// The shard that owns `tenant` ([`shard_of`]).
    pub fn shard_of(&self, tenant: u32) -> usize {
        shard_of(tenant, self.partitions, self.shards)
    }
}

/// Cells a node may name.
pub const CELLS_MAX: usize = 1_024;
/// Tenants the cells may name in all.
pub const CELL_TENANTS_MAX: usize = 1_000_000;

/// Another cell: its name, the client address its nodes are reached at (a load balancer or
/// one node's `advertise`; a cluster client finds the rest by `WrongNode`), its tenants.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellConfig {
    pub name: String,
    pub address: String,
    pub tenants: Vec<u32>,
}

/// Tenants hash to partitions: the partition `tenant` is in, of `partitions`.
pub fn partition_of(tenant: u32, partitions: u32) -> u32 {
    tenant % partitions
}

/// Partitions hash to shards: the shard of `shards` that owns `tenant`. Every router (the
/// connection hand-over, restores, policy changes) goes by this one rule.
pub fn shard_of(tenant: u32, partitions: u32, shards: u32) -> usize {
    (partition_of(tenant, partitions) % shards) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(file: &str) -> anyhow::Result<Config> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../spindled")
            .join(file);
        Config::load(&Args::file(path, None))
    }

    /// Loads `text` as a configuration file.
    fn load_text(text: &str) -> anyhow::Result<Config> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(&Args::file(path, None))
    }

    /// The example with its commented-out sections and fields uncommented, its [tls] files
    /// made in `tmp`: a configuration that sets (nearly) every field.
    fn full_example(tmp: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../spindled");
        let text = std::fs::read_to_string(dir.join("spindled.example.toml")).unwrap();
        let uncommented: String = text
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(rest)
                    if rest.starts_with('[')
                        || rest.split_once(" = ").is_some_and(|(k, _)| {
                            k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                        }) =>
                {
                    rest
                }
                _ => l,
            })
            .map(|l| format!("{l}\n"))
            .collect();
        // The [tls] files, made here where the example names its own.
        let rcgen::CertifiedKey { cert, key_pair } =
            rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (c, k) = (tmp.join("node.pem"), tmp.join("node.key"));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key_pair.serialize_pem()).unwrap();
        let uncommented = uncommented
            .replace("/etc/spindle/node.pem", &c.display().to_string())
            .replace("/etc/spindle/node.key", &k.display().to_string())
            .replace("/etc/spindle/clients-ca.pem", &c.display().to_string());
        let path = tmp.join("full.toml");
        std::fs::write(&path, uncommented).unwrap();
        (path, k)
    }

    /// The example's commented-out sections are valid too, once uncommented.
    #[test]
    fn the_examples_optional_sections_load() {
        let tmp = tempfile::tempdir().unwrap();
        let (path, k) = full_example(tmp.path());
        let c = tmp.path().join("node.pem");
        let full = Config::load(&Args::file(path, None)).unwrap();
        assert_eq!(full.tls.as_ref().map(|t| &t.key_file), Some(&k));
        assert_eq!(
            full.tls.as_ref().and_then(|t| t.client_ca_file.as_ref()),
            Some(&c)
        );
        let provider = full.provider.expect("[provider] uncommented");
        assert_eq!(provider.polls_max, 1_000);
        let events = full.events.expect("[events] uncommented");
        assert_eq!(events.pending_max, 1_000_000);
        assert_eq!(full.admin_tokens.len(), 1);
        assert!(full.local_provider_log.is_some());
    }

    /// The variables `SPINDLE_…` naming every key of `table` (sections' keys with `__`), each
    /// set to its value as TOML writes it (arrays, and maps keyed by names — `lanes` —, whole).
    fn as_variables(table: &toml::Table, path: &str, out: &mut Vec<(String, String)>) {
        for (k, v) in table {
            let name = format!("{path}{}", k.to_ascii_uppercase());
            match v {
                toml::Value::Table(t) if k != "lanes" => as_variables(t, &format!("{name}__"), out),
                v => out.push((format!("{}{name}", sources::PREFIX), v.to_string())),
            }
        }
    }

    /// Every field the full example sets — it sets every top-level field of the configuration
    /// — set instead by `SPINDLE_*` variables on an empty file gives the same configuration;
    /// variables that are not the node's are left alone.
    #[test]
    fn every_field_can_come_from_a_variable() {
        let tmp = tempfile::tempdir().unwrap();
        let (path, _) = full_example(tmp.path());
        let text = std::fs::read_to_string(&path).unwrap();
        let doc: toml::Table = toml::from_str(&text).unwrap();
        let unset: Vec<&str> = sources::fields_of::<Config>()
            .iter()
            .copied()
            .filter(|f| !doc.contains_key(*f))
            .collect();
        assert!(unset.is_empty(), "the full example leaves {unset:?} unset");
        let mut vars = Vec::new();
        as_variables(&doc, "", &mut vars);
        assert!(vars.len() > 60, "{}", vars.len());
        vars.push(("SPINDLE_TEST_PG".into(), "host=elsewhere".into()));
        vars.push(("SPINDLE_CONFIG".into(), "/not/read".into()));
        let empty = tmp.path().join("empty.toml");
        std::fs::write(&empty, "").unwrap();
        let from_file = Config::load_with(&Args::file(path, None), []).unwrap();
        let from_vars = Config::load_with(&Args::file(empty, None), vars).unwrap();
        assert_eq!(format!("{from_vars:?}"), format!("{from_file:?}"));
    }

    /// Cells name each tenant once, beside this node's, at a `host:port`.
    #[test]
    fn cells_are_checked() {
        let tenant = "[[tenants]]\nid = 1\ncredential = \"a-credential-of-some-length\"\n";
        let cell = |name: &str, address: &str, tenants: &str| {
            format!("[[cells]]\nname = {name:?}\naddress = {address:?}\ntenants = {tenants}\n")
        };
        let ok = load_text(&format!(
            "{tenant}{}",
            cell("b", "b.internal:7070", "[2, 3]")
        ))
        .unwrap();
        assert_eq!(
            ok.other_cells()[&3],
            ("b".to_string(), "b.internal:7070".to_string())
        );
        for (bad, named) in [
            (cell("b", "b.internal:7070", "[1]"), "tenant 1"),
            (cell("b", "b.internal", "[2]"), "host:port"),
            (cell("b", "b.internal:0", "[2]"), "host:port"),
            (cell("", "b.internal:7070", "[2]"), "name"),
            (cell("b", "b.internal:7070", "[]"), "names no tenant"),
            (
                format!("{}{}", cell("b", "b:1", "[2]"), cell("c", "c:1", "[2]")),
                "tenant 2",
            ),
            (
                format!("{}{}", cell("b", "b:1", "[2]"), cell("b", "c:1", "[3]")),
                "name",
            ),
        ] {
            let e = load_text(&format!("{tenant}{bad}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(named), "{bad}: {e}");
        }
    }

    /// Addresses take names as well as addresses (resolved at load), and say what is wrong.
    #[test]
    fn addresses_take_host_names() {
        assert_eq!(address("10.0.0.7:7070").unwrap().port(), 7070);
        assert_eq!(address("[::1]:7072").unwrap().port(), 7072);
        let named = address("localhost:7070").unwrap();
        assert!(named.ip().is_loopback() && named.port() == 7070, "{named}");
        for bad in ["localhost", ":7070", "localhost:port", "localhost:70000"] {
            assert!(address(bad).unwrap_err().contains("host:port"), "{bad}");
        }
        let c = load_text("listen = \"localhost:0\"\nhttp_listen = \"localhost:0\"\n").unwrap();
        assert!(c.listen.ip().is_loopback() && c.http_listen.ip().is_loopback());
    }

    /// A variable wins over the file; a bad value is refused naming the variable.
    #[test]
    fn a_variable_overrides_the_file_and_a_bad_one_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("c.toml");
        std::fs::write(
            &path,
            "lease_ms = 5000\n[provider]\nurl = \"http://a\"\nsecret = \"s\"\n",
        )
        .unwrap();
        let args = Args::file(path, None);
        let vars = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        let c = Config::load_with(
            &args,
            vars(&[
                ("SPINDLE_LEASE_MS", "7000"),
                ("SPINDLE_PROVIDER__URL", "http://b:8080"),
            ]),
        )
        .unwrap();
        assert_eq!(c.lease_ms, 7000);
        assert_eq!(c.provider.unwrap().url, "http://b:8080");
        let e = Config::load_with(&args, vars(&[("SPINDLE_LEASE_MS", "soon")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("lease_ms") && e.contains("SPINDLE_LEASE_MS"),
            "{e}"
        );
        let e = Config::load_with(&args, vars(&[("SPINDLE_PROVIDER__URLL", "http://c")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("urll") && e.contains("SPINDLE_PROVIDER__URLL"),
            "{e}"
        );
    }

    /// Each secret may come from a file, at any depth (a tenant's credential, the provider's
    /// secret, an admin token); both forms of one is refused, naming it.
    #[test]
    fn secrets_come_from_files() {
        let tmp = tempfile::tempdir().unwrap();
        let secret = |name: &str, text: &str| {
            let p = tmp.path().join(name);
            std::fs::write(&p, text).unwrap();
            p.display().to_string()
        };
        let (cred, prov, admin) = (
            secret("cred", "tenant-9-credential-from-a-file\n"),
            secret("prov", "provider-secret-from-a-file"),
            secret("admin", "admin-token-from-a-file-0123\n"),
        );
        let text = format!(
            "[provider]\nurl = \"http://p\"\nsecret_file = \"{prov}\"\n\n\
             [[admin_tokens]]\nname = \"ops\"\ntoken_file = \"{admin}\"\nrole = \"admin\"\n\n\
             [[tenants]]\nid = 9\ncredential_file = \"{cred}\"\n"
        );
        let c = load_text(&text).unwrap();
        assert_eq!(c.tenants[0].credential, "tenant-9-credential-from-a-file");
        assert_eq!(c.provider.unwrap().secret, "provider-secret-from-a-file");
        assert_eq!(c.admin_tokens[0].token, "admin-token-from-a-file-0123");
        let both = text.replace("credential_file", "credential = \"x\"\ncredential_file");
        let e = load_text(&both).unwrap_err().to_string();
        assert!(e.contains("tenants[0].credential_file"), "{e}");
        let missing = text.replace(&cred, "/nonexistent/cred");
        let e = format!("{:#}", load_text(&missing).unwrap_err());
        assert!(e.contains("/nonexistent/cred"), "{e}");
    }

    #[test]
    fn the_shipped_configurations_load() {
        let example = load("spindled.example.toml").unwrap();
        let two = example.tenants.iter().find(|t| t.id == 2).unwrap();
        assert_eq!(
            (two.submit_per_minute, two.queued_tasks_max),
            (Some(600_000), Some(100_000))
        );
        load("bench.toml").unwrap();
        let reject = load("bench-reject.toml").unwrap();
        assert_eq!(reject.tenants[1].submit_per_minute, Some(60));
        // One provider slot, held: what benches/node/memory keeps queued depends on it.
        let memory = load("bench-memory.toml").unwrap();
        assert_eq!(memory.provider_concurrency, 1);
    }

    /// docs/operations.md's configuration reference names every key of `Config` (read from this
    /// file's source, so a new field without documentation fails here).
    #[test]
    fn the_operations_guide_lists_every_key() {
        let source = include_str!("mod.rs");
        let body = source
            .split("pub struct Config {")
            .nth(1)
            .and_then(|b| b.split("\n}\n").next())
            .expect("the Config struct");
        let fields: Vec<&str> = body
            .lines()
            .filter_map(|l| l.trim().strip_prefix("pub "))
            .filter_map(|l| l.split(':').next())
            .collect();
        assert!(fields.len() > 20, "{fields:?}");
        let guide = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md"),
        )
        .unwrap();
        for f in fields {
            assert!(
                guide.contains(&format!("| `{f}` |")),
                "docs/operations.md lacks `{f}`"
            );
        }
    }

    #[test]
    fn a_bad_tenant_limit_is_named() {
        let e = load_text(
            "[[tenants]]\nid = 3\ncredential = \"tenant-3-credential\"\nsubmit_per_minute = 0\n",
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "tenant 3: submit_per_minute must be 1..=1000000000"
        );
    }

    /// A month's quota needs the ended tasks it is counted from (after a restart or a
    /// takeover) kept a month and a day; the default week is refused by name.
    #[test]
    fn a_quota_longer_than_the_retention_is_refused() {
        let tenant = "[[tenants]]\nid = 3\ncredential = \"tenant-3-credential\"\n\
                      [[tenants.quotas]]\nscope = \"tenant\"\nperiod = \"month\"\ntasks = 9\n";
        let e = load_text(tenant).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tenant 3: a quota counts periods of up to 2678400 s, but retention_finished_s \
             (604800) would prune the ended tasks a restart counts them from: set it to at least \
             2764800"
        );
        let kept = load_text(&format!("retention_finished_s = 2764800\n{tenant}")).unwrap();
        assert_eq!(kept.tenants[0].quotas.len(), 1);
        let kept = |quota: &str| {
            load_text(&format!(
                "retention_finished_s = 2764800\n[[tenants]]\nid = 3\n\
                 credential = \"tenant-3-credential\"\n[[tenants.quotas]]\n{quota}"
            ))
        };
        let model =
            kept("scope = \"model\"\nmodel = 0\nperiod = \"day\"\ncost_milli = 5\n").unwrap();
        assert_eq!(
            model.tenants[0].quotas[0].scope,
            spindle_core::quota::QuotaScope::Model {
                model: spindle_core::ModelId(0)
            }
        );
        for (bad, why) in [
            (
                "scope = \"model\"\nperiod = \"day\"\ntasks = 1\n",
                "names its `model`",
            ),
            (
                "scope = \"user\"\nmodel = 1\nperiod = \"day\"\ntasks = 1\n",
                "only a model",
            ),
            (
                "scope = \"tenant\"\nperiod = \"day\"\ntaks = 1\n",
                "unknown field `taks`",
            ),
            (
                "scope = \"tenant\"\nperiod = \"week\"\ntasks = 1\n",
                "unknown variant `week`",
            ),
            (
                "scope = \"tenant\"\nperiod = \"day\"\n",
                "neither cost_milli nor tasks",
            ),
        ] {
            let e = format!("{:#}", kept(bad).unwrap_err());
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn a_weak_credential_is_refused_at_load_by_tenant_without_repeating_it() {
        let e = load_text("[[tenants]]\nid = 4\ncredential = \"hunter2\"\n").unwrap_err();
        let e = e.to_string();
        assert!(
            e.starts_with("tenant 4: credential: a credential must have at least 16"),
            "{e}"
        );
        assert!(!e.contains("hunter2"), "{e}");
        let e = load_text("[[tenants]]\nid = 4\ncredential = \"sha256:00\"\n").unwrap_err();
        assert!(e.to_string().contains("64 hex digits"), "{e}");
        // The hashed form of a strong secret, and the secret itself, both load.
        let hashed = crate::credential::hashed_for_config("tenant-4-credential").unwrap();
        for credential in [hashed.as_str(), "tenant-4-credential"] {
            load_text(&format!(
                "[[tenants]]\nid = 4\ncredential = \"{credential}\"\n"
            ))
            .unwrap();
        }
    }

    #[test]
    fn the_task_inputs_bound_is_named() {
        for mb in [0, TASK_INPUTS_MB_MAX + 1] {
            let e = load_text(&format!("task_inputs_mb = {mb}\n")).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("task_inputs_mb must be 1..={TASK_INPUTS_MB_MAX}, not {mb}")
            );
        }
        assert_eq!(load_text("").unwrap().task_inputs_mb, 1024);
    }

    #[test]
    fn the_provider_and_events_bounds_are_named() {
        let provider = "[provider]\nurl = \"http://127.0.0.1:1\"\nsecret = \"s\"\n";
        let events = "[events]\nurl = \"http://127.0.0.1:2/e\"\nsecret = \"s\"\n";
        for (text, why) in [
            (
                format!("{provider}polls_max = 0\n"),
                "provider.polls_max must be 1..=1000000",
            ),
            (
                format!("{provider}requests_max = 0\n"),
                "provider.requests_max must be 1..=65536",
            ),
            (
                format!("{events}batch_max = 10001\n"),
                "events.batch_max must be 1..=10000",
            ),
            (
                format!("{events}pending_max = 0\n"),
                "events.pending_max must be at least 1",
            ),
            (
                events.replace("http://", "ftp://"),
                "events.url must be an http:// or https:// URL",
            ),
            (
                provider.replace("http://", "ftp://"),
                "provider.url must be an http:// or https:// URL",
            ),
            (
                format!("{provider}ca_file = \"/nonexistent/ca.pem\"\n"),
                "provider.ca_file: /nonexistent/ca.pem: No such file or directory (os error 2)",
            ),
            (
                format!("{events}idle_ms = 0\n"),
                "events.idle_ms must be 1..=60000",
            ),
        ] {
            let e = load_text(&text).unwrap_err();
            assert_eq!(e.to_string(), why, "{text}");
        }
    }

    /// `[tls]`: a file that cannot be read is named; a certificate and key that do not make a
    /// server's configuration are named with both files; a usable pair loads.
    #[test]
    fn the_listeners_tls_files_are_checked_at_load() {
        let e = load_text("[tls]\ncert_file = \"/nonexistent/node.pem\"\nkey_file = \"/k\"\n")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "tls.cert_file: /nonexistent/node.pem: No such file or directory (os error 2)"
        );
        let dir = tempfile::tempdir().unwrap();
        let rcgen::CertifiedKey { cert, key_pair } =
            rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (c, k) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, "not a key").unwrap();
        let text = format!("[tls]\ncert_file = {c:?}\nkey_file = {k:?}\n");
        let e = load_text(&text).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("tls: {} with {}: ", c.display(), k.display())),
            "{e}"
        );
        std::fs::write(&k, key_pair.serialize_pem()).unwrap();
        let config = load_text(&text).unwrap();
        assert_eq!(config.tls.unwrap().cert_file, c);
        // Client certificates' CAs: a file with none in it is named.
        let e = load_text(&format!("{text}client_ca_file = {k:?}\n"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!(
                "tls.client_ca_file: {}: no PEM certificate in it",
                k.display()
            )
        );
        let config = load_text(&format!("{text}client_ca_file = {c:?}\n")).unwrap();
        assert_eq!(config.tls.unwrap().client_ca_file, Some(c));
    }

    #[test]
    fn calls_carry_1024_rows_and_reports_are_held_five_ms_by_default() {
        let config = load_text("").unwrap();
        assert_eq!(config.batch_max, 1024);
        assert_eq!(config.report_hold_us, 5_000);
        // The hold is at most a tenth of a second.
        assert!(load_text("report_hold_us = 100000\n").is_ok());
        let e = load_text("report_hold_us = 100001\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "report_hold_us must be 0..=100000, not 100001"
        );
    }

    #[test]
    fn the_ack_budget_is_bounded_and_zero_turns_the_gate_off() {
        assert_eq!(load_text("").unwrap().ack_budget_ms, 50);
        assert_eq!(load_text("ack_budget_ms = 0\n").unwrap().ack_budget_ms, 0);
        let e = load_text("ack_budget_ms = 60001\n").unwrap_err();
        assert_eq!(e.to_string(), "ack_budget_ms must be 0..=60000, not 60001");
    }

    #[test]
    fn more_partitions_than_a_batch_holds_are_refused() {
        let e = load_text("shards = 2\npartitions = 4097\n").unwrap_err();
        assert_eq!(e.to_string(), "partitions must be shards..=4096, not 4097");
        assert_eq!(
            load_text("shards = 2\npartitions = 4096\n")
                .unwrap()
                .partitions,
            4096
        );
    }

    #[test]
    fn a_retention_scan_outside_its_bounds_is_named() {
        for rows in [0, spindle_control::limits::SCAN_MAX + 1] {
            let e = load_text(&format!("retention_scan_rows = {rows}\n")).unwrap_err();
            assert_eq!(e.to_string(), "retention_scan_rows must be 1..=10000");
        }
    }

    #[test]
    fn a_counter_check_interval_past_a_day_is_named() {
        let e = load_text("counter_check_s = 86401\n").unwrap_err();
        assert_eq!(e.to_string(), "counter_check_s must be 0..=86400");
        assert_eq!(
            load_text("counter_check_s = 0\n").unwrap().counter_check_s,
            0
        );
    }

    #[test]
    fn an_advertised_address_is_host_and_port() {
        for bad in ["nohost", ":7070", "host:0", "host:70000", "host:"] {
            let e = load_text(&format!("advertise = \"{bad}\"\n")).unwrap_err();
            assert!(
                e.to_string().starts_with("advertise must be \"host:port\""),
                "{bad}: {e}"
            );
        }
        let long = format!("advertise = \"{}:7070\"\n", "h".repeat(260));
        assert!(load_text(&long).is_err());
        for good in ["10.0.0.7:7070", "spindled-0.spindled:7070", "[::1]:7070"] {
            let config = load_text(&format!("advertise = \"{good}\"\n")).unwrap();
            assert_eq!(config.client_address(config.listen), good);
        }
        let config = load_text("").unwrap();
        let bound: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(config.client_address(bound), "127.0.0.1:4000");
    }

    #[test]
    fn abuse_limits_and_calibration_outside_their_bounds_are_named() {
        let tenant = |extra: &str| {
            format!("[[tenants]]\nid = 1\ncredential = \"tenant-1-credential\"\n{extra}\n")
        };
        let cases = [
            (
                tenant("cancel_per_minute = 0"),
                "tenant 1: cancel_per_minute must be 1..=1000000000",
            ),
            (
                tenant("store_reads_per_minute = 0"),
                "tenant 1: store_reads_per_minute must be 1..=1000000000",
            ),
            (
                "[breaker]\nrefusals_per_s = 10000001\n".into(),
                "breaker.refusals_per_s must be 0..=10000000",
            ),
            (
                "[breaker]\nburst_s = 0\n".into(),
                "breaker.burst_s must be 1..=3600",
            ),
            (
                "[breaker]\ncooldown_ms = 70000\n".into(),
                "breaker.cooldown_ms must be 1..=cooldown_max_ms",
            ),
            (
                "[breaker]\ncooldown_max_ms = 86400001\ncooldown_ms = 1000\n".into(),
                "breaker.cooldown_max_ms must be at most 86400000 (a day)",
            ),
            (
                "cost_calibration_samples = 65\n".into(),
                "cost_calibration_samples must be 0..=64",
            ),
        ];
        for (text, named) in cases {
            let e = load_text(&text).unwrap_err();
            assert_eq!(e.to_string(), named, "{text}");
        }
        let config = load_text(&tenant("")).unwrap();
        assert_eq!(config.tenants[0].cancel_per_minute, 6_000);
        assert_eq!(config.tenants[0].store_reads_per_minute, None);
        assert_eq!(config.breaker.refusals_per_s, 5_000);
        assert_eq!(config.cost_calibration_samples, 16);
    }

    #[test]
    fn a_cpu_wake_latency_past_a_second_is_named() {
        let e = load_text("cpu_wake_latency_us = 1000001\n").unwrap_err();
        assert_eq!(e.to_string(), "cpu_wake_latency_us must be 0..=1000000");
        let config = load_text("cpu_wake_latency_us = 0\n").unwrap();
        assert_eq!(config.cpu_wake_latency_us, Some(0));
        let config = load_text("").unwrap();
        assert_eq!(config.cpu_wake_latency_us, None, "not asked unless set");
    }

    #[test]
    fn control_pipelines_default_to_one_pair_per_four_shards_and_at_most_one_per_shard() {
        for (shards, pairs) in [(1, 1), (2, 1), (4, 1), (5, 2), (16, 4)] {
            let config = load_text(&format!("shards = {shards}\npartitions = 64\n")).unwrap();
            assert_eq!(config.control_pipelines(), pairs, "{shards} shards");
        }
        for pairs in [0, 3] {
            let e = load_text(&format!("shards = 2\ncontrol_pipelines = {pairs}\n")).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("control_pipelines must be 1..=shards (2), not {pairs}")
            );
        }
        let config = load_text("shards = 2\ncontrol_pipelines = 2\n").unwrap();
        assert_eq!(config.control_pipelines(), 2);
    }

    #[test]
    fn the_postgres_timeouts_outside_their_bounds_are_named() {
        for key in ["postgres_statement_timeout_ms", "postgres_answer_grace_ms"] {
            for ms in [99, 600_001] {
                let e = load_text(&format!("{key} = {ms}\n")).unwrap_err();
                assert_eq!(e.to_string(), format!("{key} must be 100..=600000"));
            }
        }
    }
}
