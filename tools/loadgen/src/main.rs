//! spindle-loadgen: `run` drives a node you point it at; `demo` starts a private PostgreSQL and
//! an in-process spindled and runs the noisy-neighbour mix (one tenant at 100× the others);
//! `connects` measures how fast a node takes new connections.

mod connects;
mod harness;
mod pacer;
mod plot;
mod report;
mod run;
mod scrape;
mod soak;
mod storm;
mod workload;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::workload::{Arrival, TenantLoad};

#[derive(Parser)]
#[command(
    name = "spindle-loadgen",
    version,
    about = "Open-loop load generator for spindled"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct Common {
    /// Seconds of sending.
    #[arg(long, default_value_t = 15)]
    duration: u64,
    /// Tasks per submit frame (1: single submits).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Bytes of the JSON input (`{"prompt":"…"}`) sent with every task, for the provider;
    /// 0: none.
    #[arg(long, default_value_t = 0)]
    input_bytes: usize,
    #[arg(long, value_enum, default_value_t = Arrival::Poisson)]
    arrival: Arrival,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds to wait for accepted tasks to finish after sending.
    #[arg(long, default_value_t = 10)]
    drain: u64,
    /// Where report.json, timeline.svg and tenants.svg go.
    #[arg(long, default_value = "target/loadgen")]
    out: PathBuf,
    /// Print the JSON report instead of the table.
    #[arg(long)]
    json: bool,
    /// Send a task the node refused for its load (REJECT_PLATFORM_OVERLOADED) again, no sooner
    /// than the refusal's `retry_after_ms` (doubled at each try, with jitter), up to N times
    /// (10 when N is left out), within a retry budget of a fifth of the tenant's first sends;
    /// the report counts tasks retried, accepted on a retry and given up, beside goodput.
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "10",
          value_parser = clap::value_parser!(u32).range(0..=i64::from(run::RETRIES_MAX)))]
    retry_refused: Option<u32>,
}

/// Where the node's ports speak TLS (its `[tls]`).
#[derive(clap::Args)]
struct TlsArgs {
    /// The CA certificates (PEM) the nodes' certificates chain to — the only roots trusted.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// The name the nodes' certificates must carry (default: the host each is reached at).
    #[arg(long, requires = "tls_ca")]
    tls_name: Option<String>,
    /// A client certificate (PEM chain) to present, where the node asks for one
    /// (`tls.client_ca_file`); with `--tls-key`.
    #[arg(long, requires_all = ["tls_ca", "tls_key"])]
    tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

/// The HTTP port's trust and the name its certificate must carry (for `--metrics`).
type HttpTls = (
    std::sync::Arc<rustls::ClientConfig>,
    rustls::pki_types::ServerName<'static>,
);

impl TlsArgs {
    /// The client's TLS, `None` without `--tls-ca`.
    fn client(&self) -> anyhow::Result<Option<spindle_client::Tls>> {
        let Some(ca) = &self.tls_ca else {
            return Ok(None);
        };
        let mut tls = spindle_client::Tls::trusting_file(ca)?;
        if let Some(n) = &self.tls_name {
            tls = tls.server_name(n)?;
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            tls = tls.with_client_cert_files(cert, key)?;
        }
        Ok(Some(tls))
    }

    /// What a scrape of the HTTP port at `at` trusts, `None` without `--tls-ca`.
    fn http(&self, at: SocketAddr) -> anyhow::Result<Option<HttpTls>> {
        let Some(ca) = &self.tls_ca else {
            return Ok(None);
        };
        let config = spindle_providers::tls::with_roots_file(ca)?;
        let name = match &self.tls_name {
            Some(n) => rustls::pki_types::ServerName::try_from(n.clone())?,
            None => rustls::pki_types::ServerName::from(at.ip()),
        };
        Ok(Some((config, name)))
    }
}

#[derive(Subcommand)]
enum Command {
    /// Drive a running node (or a cluster through any of its nodes).
    Run {
        /// A node's client address (host:port, a name or an address); a tenant another node
        /// serves is sent there (WrongNode's redirect).
        #[arg(long, value_parser = spindle_node_base::config::address)]
        addr: SocketAddr,
        /// `ID:CREDENTIAL:RATE`, one per tenant.
        #[arg(long = "tenant", required = true)]
        tenants: Vec<String>,
        /// The node's HTTP port: completions are then counted from its committed-success
        /// counter (`spindle_tasks_succeeded_total`), sampled every 100 ms, instead of by asking
        /// for every task until it ends — which loads the node it measures. Every accepted task
        /// is still checked once, after the measurement.
        #[arg(long, value_parser = spindle_node_base::config::address)]
        metrics: Option<SocketAddr>,
        #[command(flatten)]
        tls: TlsArgs,
        #[command(flatten)]
        common: Common,
    },
    /// Private PostgreSQL + mock provider in a 429 storm + in-process spindled: the accepted
    /// rate per second against the provider's real limit.
    Storm {
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Tasks a second offered (the storm's real limit is 20/s).
        #[arg(long, default_value_t = 40)]
        rate: u64,
        #[arg(long, default_value = "target/loadgen")]
        out: PathBuf,
    },
    /// Private PostgreSQL + mock provider + three spindled nodes under steady load: the mock's
    /// violation counters must stay at zero (exit status 1 otherwise).
    Soak {
        #[arg(long, default_value_t = 300)]
        seconds: u64,
        /// Tasks a second offered across six tenants.
        #[arg(long, default_value_t = 30)]
        rate: u64,
    },
    /// Opens connections to a node, each closed once its Hello is answered: connections a
    /// second and connect → HelloOk latency (a reconnect storm after a failover).
    Connects {
        #[arg(long)]
        addr: String,
        /// `ID:CREDENTIAL` of the tenant every connection authenticates as.
        #[arg(long)]
        tenant: String,
        #[arg(long, default_value_t = 2_000)]
        count: u64,
        /// Connections being made at once.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        #[command(flatten)]
        tls: TlsArgs,
        /// Every connection a full TLS handshake (as to a node never reached before), not a
        /// resumption of an earlier session.
        #[arg(long, requires = "tls_ca")]
        full_handshakes: bool,
    },
    /// Draws `benches/node/overload`'s goodput curve (its last line, a JSON object with
    /// `max_rate` and `points`) as `overload.svg` in `--out`.
    OverloadPlot {
        /// The file holding the curve's JSON.
        #[arg(long)]
        curve: PathBuf,
        #[arg(long, default_value = "target/loadgen")]
        out: PathBuf,
    },
    /// Private PostgreSQL + in-process spindled + the noisy-neighbour mix.
    Demo {
        /// Tasks per second of each of the nine quiet tenants (the loud one sends 100×).
        #[arg(long, default_value_t = 2.0)]
        quiet_rate: f64,
        /// A spike: for `--spike-seconds` from `--spike-at`, the loud tenant alone sends this
        /// many times the demo's whole rate (0: none); the report shows what the node refused
        /// then, and that the quiet tenants went on as before.
        #[arg(long, default_value_t = 3.0)]
        spike: f64,
        #[arg(long, default_value_t = 5)]
        spike_at: u64,
        #[arg(long, default_value_t = 3)]
        spike_seconds: u64,
        /// The node's `ack_budget_ms` (default: the node's own): past it a submit is refused as
        /// overloaded. A test on a machine busy with other work sets it long, so that the
        /// demo shows fairness rather than that machine's load.
        #[arg(long)]
        ack_budget_ms: Option<u32>,
        #[command(flatten)]
        common: Common,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run {
            addr,
            tenants,
            metrics,
            tls,
            common,
        } => {
            let tenants = tenants
                .iter()
                .map(|t| TenantLoad::parse(t))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let metrics = match metrics {
                Some(addr) => Some(scrape::Endpoint {
                    addr,
                    tls: tls.http(addr)?,
                }),
                None => None,
            };
            drive(addr, metrics, tls.client()?, tenants, &common)
        }
        Command::Demo {
            quiet_rate,
            spike,
            spike_at,
            spike_seconds,
            ack_budget_ms,
            common,
        } => {
            anyhow::ensure!(
                (0.0..=1_000.0).contains(&spike),
                "--spike must be 0..=1000 times the demo's rate"
            );
            let spike = (spike > 0.0 && spike_seconds > 0).then(|| workload::Spike {
                at: Duration::from_secs(spike_at),
                lasting: Duration::from_secs(spike_seconds),
                // The demo's whole rate: the loud tenant's 100× and nine quiet ones.
                rate: spike * quiet_rate * 109.0,
            });
            demo(quiet_rate, spike, ack_budget_ms, &common)
        }
        Command::OverloadPlot { curve, out } => {
            let text = std::fs::read_to_string(&curve)
                .with_context(|| format!("reading {}", curve.display()))?;
            let path = curve;
            let curve: serde_json::Value = serde_json::from_str(text.trim())
                .with_context(|| format!("{} is not one JSON object", path.display()))?;
            anyhow::ensure!(
                curve["points"].is_array(),
                "{} has no \"points\" array",
                path.display()
            );
            std::fs::create_dir_all(&out)?;
            let path = out.join("overload.svg");
            std::fs::write(&path, report::overload_svg(&curve))?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Connects {
            addr,
            tenant,
            count,
            concurrency,
            tls,
            full_handshakes,
        } => {
            let (id, credential) = tenant
                .split_once(':')
                .and_then(|(id, c)| Some((id.parse::<u32>().ok()?, c.to_string())))
                .context("--tenant must be ID:CREDENTIAL")?;
            let tls = tls.client()?.map(|t| {
                if full_handshakes {
                    t.without_resumption()
                } else {
                    t
                }
            });
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let outcome = rt.block_on(connects::run(connects::Options {
                addr,
                tenant: id,
                credential,
                count,
                concurrency,
                tls,
            }))?;
            println!("{}", connects::line(&outcome));
            anyhow::ensure!(outcome.failed == 0, "{} connections failed", outcome.failed);
            Ok(())
        }
        Command::Soak { seconds, rate } => {
            quiet_logs();
            soak::run(soak::Options { seconds, rate })
        }
        Command::Storm { seconds, rate, out } => {
            quiet_logs();
            storm::run(storm::Options { seconds, rate, out })
        }
    }
}

fn drive(
    addr: SocketAddr,
    metrics: Option<scrape::Endpoint>,
    tls: Option<spindle_client::Tls>,
    tenants: Vec<TenantLoad>,
    common: &Common,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=spindle_wire::limits::BATCH_MAX).contains(&common.batch),
        "--batch must be 1..=1024"
    );
    let input = workload::input_of(common.input_bytes)?;
    let offered: f64 = tenants
        .iter()
        .map(|t| t.mean_rate(Duration::from_secs(common.duration)))
        .sum();
    let opts = run::Options {
        addr,
        tenants,
        duration: Duration::from_secs(common.duration),
        batch: common.batch,
        input,
        arrival: common.arrival,
        seed: common.seed,
        progress: !common.json,
        drain: Duration::from_secs(common.drain),
        metrics,
        tls,
        retries: common.retry_refused.unwrap_or(0),
    };
    // One thread: the generator shares the machine with what it measures, and two workers
    // woke each other for every frame — 61k context switches in a 10 s run at 20,000 tasks/s
    // against 17k on one thread, 10.8–11.5 against 6.6–6.9 µs of CPU per task, sends no later
    // (docs/benchmarks/journal.md, "Sixteenth round").
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let outcome = rt.block_on(run::run(opts))?;
    let report = report::json(&outcome, offered);
    report::write_all(&report, &common.out)?;
    if common.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report::text(&report));
        println!(
            "report: {}/report.json; plots: {}/timeline.svg, {}/tenants.svg",
            common.out.display(),
            common.out.display(),
            common.out.display()
        );
    }
    Ok(())
}

/// The most tasks a demo tenant may have queued.
const DEMO_QUEUED_MAX: u64 = 1_000;

/// Set once the demo is over: the in-process node's logs stop (its database is going away).
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn demo(
    quiet_rate: f64,
    spike: Option<workload::Spike>,
    ack_budget_ms: Option<u32>,
    common: &Common,
) -> anyhow::Result<()> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let quiet = tracing_subscriber::filter::filter_fn(|_| {
        !QUIET.load(std::sync::atomic::Ordering::Relaxed)
    });
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(tracing_subscriber::EnvFilter::new("warn"))
                .with_filter(quiet),
        )
        .init();
    let pg = spindle_control::EmbeddedPostgres::start(spindle_control::EmbeddedOptions::default())
        .context("starting a private PostgreSQL")?;
    let dir = tempfile_dir()?;
    let ready = dir.join("ready");
    let mut tenants_toml = String::new();
    let mut loads = Vec::new();
    for t in 1..=10u32 {
        let rate = if t == 1 {
            quiet_rate * 100.0
        } else {
            quiet_rate
        };
        // Each tenant's queue is bounded (the presets leave it unbounded): a spike past what
        // the provider's slots drain is refused at once, with the reason, instead of queued
        // for minutes.
        tenants_toml.push_str(&format!(
            "[[tenants]]\nid = {t}\ncredential = \"{}\"\nqueued_tasks_max = {DEMO_QUEUED_MAX}\n\n",
            // Kept as its SHA-256, as a configuration should keep it.
            spindle_node_base::credential::hashed_for_config(&format!("demo-credential-{t}"))
                .map_err(|e| anyhow::anyhow!("demo credential: {e}"))?
        ));
        loads.push(TenantLoad {
            tenant: t,
            credential: format!("demo-credential-{t}"),
            rate,
            spike: if t == 1 { spike } else { None },
        });
    }
    let budget = ack_budget_ms.map_or(String::new(), |ms| format!("ack_budget_ms = {ms}\n"));
    let config_text = format!(
        "node_id = \"demo\"\nlisten = \"127.0.0.1:0\"\nhttp_listen = \"127.0.0.1:0\"\npostgres = \"{}\"\nlocal_provider_time_scale = 0.01\n{budget}\n{tenants_toml}",
        pg.conninfo("postgres")
    );
    let config: spindle_node_base::config::Config = toml_config(&config_text, &ready)?;
    println!(
        "demo: PostgreSQL {} (PGPASSFILE={}) ; spindled with 10 tenants (tenant 1 sends {:.0}/s, nine others {quiet_rate}/s each) for {} s",
        pg.conninfo_public("postgres"),
        pg.pgpass().display(),
        quiet_rate * 100.0,
        common.duration
    );
    if let Some(s) = spike {
        println!(
            "demo: a spike from {} s to {} s: tenant 1 alone sends {:.0}/s",
            s.at.as_secs(),
            (s.at + s.lasting).as_secs(),
            s.rate
        );
    }
    let node = start_node("spindled", config, &ready)?;
    // Its `/metrics` count completions as they happen (the timeline's), not only at the end.
    let metrics = scrape::Endpoint {
        addr: node.http,
        tls: None,
    };
    let result = drive(node.client, Some(metrics), None, loads, common);
    // The node's threads end with the process; the private PostgreSQL is stopped here.
    QUIET.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(pg);
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    std::process::exit(0);
}

/// An in-process spindled's addresses: its client protocol's and its HTTP port's.
struct Serving {
    client: SocketAddr,
    http: SocketAddr,
}

/// Runs spindled in this process on a thread named `name`; its addresses once it serves.
fn start_node(
    name: &str,
    config: spindle_node_base::config::Config,
    ready: &std::path::Path,
) -> anyhow::Result<Serving> {
    let thread = name.to_string();
    std::thread::Builder::new()
        .name(thread.clone())
        .spawn(move || {
            if let Err(e) = spindled::run(config) {
                eprintln!("{thread} stopped: {e:#}");
            }
        })?;
    wait_ready(ready)
}

/// Waits (bounded: 30 s) for an in-process spindled's ready file (its client address, then
/// its HTTP port's); its addresses.
fn wait_ready(ready: &std::path::Path) -> anyhow::Result<Serving> {
    for _ in 0..600 {
        if let Ok(text) = std::fs::read_to_string(ready) {
            let mut lines = text.lines().map(|l| l.parse().ok());
            if let (Some(Some(client)), Some(Some(http))) = (lines.next(), lines.next()) {
                return Ok(Serving { client, http });
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    anyhow::bail!("spindled did not start within 30 s")
}

/// Tasks per state in the database at `conninfo`.
async fn final_states(conninfo: &str) -> anyhow::Result<std::collections::BTreeMap<String, i64>> {
    let db = spindle_control::Db::open(&spindle_control::DbConfig::new(conninfo)).await?;
    let rows = db
        .client()
        .query("SELECT state, count(*) FROM task GROUP BY state", &[])
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Set once a run's verdict is printed and its private PostgreSQL is being stopped under the
/// in-process nodes: what they log then (every connection ending) is not the run's.
static TEARING_DOWN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Warnings only, on stderr (none once the run is [`TEARING_DOWN`]).
fn quiet_logs() {
    let _ = tracing_subscriber::fmt()
        .with_writer(|| -> Box<dyn std::io::Write> {
            if TEARING_DOWN.load(std::sync::atomic::Ordering::Relaxed) {
                Box::new(std::io::sink())
            } else {
                Box::new(std::io::stderr())
            }
        })
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .try_init();
}

fn toml_config(
    text: &str,
    ready: &std::path::Path,
) -> anyhow::Result<spindle_node_base::config::Config> {
    toml_config_at(text, ready, "spindled.toml")
}

/// A node's configuration from `text`, written beside `ready` as `file` and loaded like the
/// daemon loads it.
fn toml_config_at(
    text: &str,
    ready: &std::path::Path,
    file: &str,
) -> anyhow::Result<spindle_node_base::config::Config> {
    let path = ready.with_file_name(file);
    std::fs::write(&path, text)?;
    let args = spindle_node_base::config::Args::file(path, Some(ready.to_path_buf()));
    spindle_node_base::config::Config::load(&args)
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("spindle-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
