//! spindled, the node daemon, as wiring only: it reads nothing but its configuration, starts
//! each part of the node from it — PostgreSQL (embedded or not), the control plane's thread,
//! the provider and media workers, one glommio executor per shard with its listeners, the HTTP
//! port — hands each the channels and shared state it needs, and waits for the end. What each
//! part does is in its own crate: `spindle-node-base` (configuration, policy, shared state),
//! `spindle-node-workers` (provider I/O, media), `spindle-node-control` (the control plane),
//! `spindle-node-shard` (the shards), `spindle-node-http` (the HTTP port). Two process-wide
//! things are the daemon's own: systemd's notifications and the CPU wake-up latency it holds.

pub use spindle_node_base::config;
pub use spindle_node_base::credential;

pub mod systemd;
pub mod wake_latency;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::mpsc as std_mpsc;

use std::sync::Arc;

use anyhow::Context;
use glommio::{LocalExecutorBuilder, Placement};
use spindle_control::{DbConfig, EmbeddedOptions, EmbeddedPostgres, SyncStandby};

use spindle_node_base::config::Config;
use spindle_node_base::messages::ShardMsg;
use spindle_node_base::{auth_guard, health, metrics, overload, ownership, policy::policy};
use spindle_node_control::{control, live_policy};
use spindle_node_http::{admin, serve as http};
use spindle_node_shard::server::ConnCtx;
use spindle_node_shard::shard::{ShardSetup, ShardState, SHARD_QUEUE_MAX};
use spindle_node_shard::{breaker, server, shard, tls};
use spindle_node_workers::{dispatch, media, runtime};

/// Marks an error as the configuration's (it cannot run as written): `spindled` exits with 78
/// for it, which its systemd unit does not restart.
#[derive(Debug, thiserror::Error)]
#[error("the configuration cannot run")]
pub struct ConfigError;

/// The embedded PostgreSQL, when the node runs one; stopped on the way out.
static EMBEDDED: std::sync::Mutex<Option<EmbeddedPostgres>> = std::sync::Mutex::new(None);

/// Runs the node until the process is stopped. A failed start stops the embedded PostgreSQL
/// it may have begun.
pub fn run(config: Config) -> anyhow::Result<()> {
    let result = run_node(config);
    if result.is_err() {
        drop(EMBEDDED.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
    result
}

fn run_node(config: Config) -> anyhow::Result<()> {
    // Held to the end of the process (the kernel drops the request with its file).
    let _wake_latency = config.cpu_wake_latency_us.and_then(|us| {
        wake_latency::hold(us)
            .inspect(|_| tracing::info!("idle CPUs asked to wake within {us} µs"))
            .inspect_err(|e| tracing::warn!("cpu_wake_latency_us not applied: {e}"))
            .ok()
    });
    // Both listeners' TLS, read once (before anything starts: an unusable file stops here).
    let listeners = config
        .tls
        .as_ref()
        .map(tls::Listeners::from_config)
        .transpose()
        .map_err(|e| e.context(ConfigError))?;
    let live = live_policy::LivePolicy::new(policy(&config));
    let db_config = postgres(&config)?;
    let metrics = metrics::Metrics::new(config.shards as usize);
    let ownership = Arc::new(ownership::Ownership::new(config.partitions));
    let channels = Channels::new(config.shards);
    let callbacks: http::CallbackSink = Default::default();
    let collectors: http::Collectors = Arc::new(std::sync::Mutex::new(vec![live.clone()]));
    let (mut started, http_addr) = start_control_plane(ControlParts {
        config: config.clone(),
        db_config: db_config.clone(),
        live: live.clone(),
        metrics: metrics.clone(),
        ownership: ownership.clone(),
        inboxes: channels.senders.clone(),
        callbacks: callbacks.clone(),
        collectors: collectors.clone(),
        listeners: listeners
            .as_ref()
            .map(|l| (l.http.clone(), l.certificates.clone())),
    })?;
    let callback_base = format!(
        "{}://{http_addr}",
        if listeners.is_some() { "https" } else { "http" }
    );
    let workers = start_workers(
        &config,
        &started.policy,
        &channels.senders,
        &metrics,
        &callbacks,
        callback_base,
    )?;
    if let Some(pool) = &workers.media {
        let mut parts = collectors.lock().unwrap_or_else(|p| p.into_inner());
        parts.push(Arc::new(pool.clone()));
    }
    let board = show_split_and_paths(&mut started, &metrics, &ownership)?;
    let wiring = ShardWiring {
        policy: started.policy.clone(),
        senders: channels.senders.clone(),
        handoffs: channels.handoff_senders.clone(),
        credentials: tenant_credentials(&config)?,
        other_cells: Arc::new(config.other_cells()),
        connections: server::Connections::new(config.connections_max, metrics.clone()),
        tls: listeners.as_ref().map(|l| l.protocol.clone()),
        reads: started.reads.clone(),
        board,
        offers: overload::OfferBoard::new(config.shards as usize),
        auth: Arc::new(std::sync::Mutex::new(auth_guard::AuthGuard::new(
            metrics.auth.clone(),
        ))),
        metrics: metrics.clone(),
        ownership,
        workers,
        // Each shard takes its share of the node's connection rate (0: no bound).
        accepts_per_s: u64::from(config.connection_rate_max).div_ceil(u64::from(config.shards)),
        config: config.clone(),
    };
    let mut handles = Vec::new();
    let mut addr: SocketAddr = config.listen;
    let mut restores = std::mem::take(&mut started.restores).into_iter();
    let shards = channels
        .inboxes
        .into_iter()
        .zip(channels.handoff_inboxes)
        .zip(
            std::mem::take(&mut started.pipes)
                .into_iter()
                .zip(std::mem::take(&mut started.id_blocks)),
        );
    for (i, ((inbox, handoffs_in), (pipes, ids))) in shards.enumerate() {
        let own = ShardOwn {
            index: i,
            inbox,
            handoffs_in,
            pipes,
            ids,
            restore: restores.next().unwrap_or_default(),
        };
        let (bound, handle) = spawn_shard(&wiring, own, addr)?;
        addr = bound;
        handles.push(handle);
    }
    announce(&config, addr, http_addr, &db_config, &metrics)?;
    for h in handles {
        h.join()
            .map_err(|e| anyhow::anyhow!("a shard stopped: {e:?}"))?;
    }
    Ok(())
}

/// The store's connection settings: the configured server, or an embedded one started here.
fn postgres(config: &Config) -> anyhow::Result<DbConfig> {
    let conninfo = if config.postgres == "embedded" {
        let pg = EmbeddedPostgres::start(EmbeddedOptions::default())
            .context("starting the embedded PostgreSQL")?;
        let c = pg.conninfo("postgres");
        tracing::info!(
            "embedded PostgreSQL at {} (its password in PGPASSFILE={})",
            pg.conninfo_public("postgres"),
            pg.pgpass().display()
        );
        // Kept where the stop path can reach it: process::exit runs no destructors.
        *EMBEDDED.lock().unwrap_or_else(|p| p.into_inner()) = Some(pg);
        c
    } else {
        config.postgres.clone()
    };
    let sync_standby = if config.postgres == "embedded" {
        SyncStandby::Ignore
    } else if config.require_sync_standby {
        SyncStandby::Require
    } else {
        SyncStandby::Warn
    };
    Ok(DbConfig {
        statement_timeout_ms: config.postgres_statement_timeout_ms,
        answer_grace_ms: config.postgres_answer_grace_ms,
        sync_standby,
        ..DbConfig::new(conninfo)
    })
}

/// Each shard's inbox and the queue connections are handed to it on.
struct Channels {
    senders: Vec<tokio::sync::mpsc::Sender<ShardMsg>>,
    inboxes: Vec<tokio::sync::mpsc::Receiver<ShardMsg>>,
    handoff_senders: Vec<tokio::sync::mpsc::Sender<server::Handoff>>,
    handoff_inboxes: Vec<tokio::sync::mpsc::Receiver<server::Handoff>>,
}

impl Channels {
    fn new(shards: u32) -> Channels {
        let mut c = Channels {
            senders: Vec::new(),
            inboxes: Vec::new(),
            handoff_senders: Vec::new(),
            handoff_inboxes: Vec::new(),
        };
        for _ in 0..shards {
            let (tx, rx) = tokio::sync::mpsc::channel::<ShardMsg>(SHARD_QUEUE_MAX);
            c.senders.push(tx);
            c.inboxes.push(rx);
            let (tx, rx) = tokio::sync::mpsc::channel(server::HANDOFF_QUEUE_MAX);
            c.handoff_senders.push(tx);
            c.handoff_inboxes.push(rx);
        }
        c
    }
}

/// What the control plane's thread is started with.
struct ControlParts {
    config: Config,
    db_config: DbConfig,
    live: Arc<live_policy::LivePolicy>,
    metrics: Arc<metrics::Metrics>,
    ownership: Arc<ownership::Ownership>,
    inboxes: Vec<tokio::sync::mpsc::Sender<ShardMsg>>,
    callbacks: http::CallbackSink,
    collectors: http::Collectors,
    /// The HTTP port's TLS and the certificate it presents (reloaded on this thread).
    listeners: Option<(Arc<rustls::ServerConfig>, Arc<tls::Certificates>)>,
}

/// Starts the control plane's thread, with the HTTP port on its runtime; returns what the
/// control plane started (pipelines, restores, the split) and the HTTP port's address.
fn start_control_plane(parts: ControlParts) -> anyhow::Result<(control::Started, SocketAddr)> {
    let (started_tx, started_rx) = std_mpsc::channel();
    let ControlParts {
        config,
        db_config,
        live,
        metrics,
        ownership,
        inboxes,
        callbacks,
        collectors,
        listeners,
    } = parts;
    let admin = (!config.admin_tokens.is_empty()).then(|| {
        Arc::new(admin::Admin::new(
            config.admin_tokens.clone(),
            db_config.clone(),
            metrics.clone(),
            live.clone(),
            admin::Shards {
                config: config.clone(),
                ownership: ownership.clone(),
                inboxes: inboxes.clone(),
            },
        ))
    });
    let (http_tls, certificates) = match listeners {
        Some((http, certs)) => (Some(tokio_rustls::TlsAcceptor::from(http)), Some(certs)),
        None => (None, None),
    };
    runtime::spawn_thread("control-plane", move || async move {
        let started = async {
            let http = tokio::net::TcpListener::bind(config.http_listen)
                .await
                .with_context(|| format!("binding {}", config.http_listen))?;
            let http_addr = http.local_addr()?;
            if let Some(certs) = certificates {
                tokio::spawn(certs.watch());
            }
            tokio::spawn(http::serve(
                http,
                http_tls,
                config.http_connections_max,
                Arc::new(http::Port {
                    metrics: metrics.clone(),
                    sink: callbacks,
                    collectors,
                    admin,
                    seen: Default::default(),
                }),
            ));
            let started =
                control::start(&config, &db_config, &live, &metrics, &ownership, inboxes).await?;
            anyhow::Ok((started, http_addr))
        }
        .await;
        let ok = started.is_ok();
        let _ = started_tx.send(started);
        if ok {
            wait_for_stop(&config, &db_config, &metrics).await;
        }
    })
    .context("spawning the control plane thread")?;
    started_rx.recv().context("the control plane thread died")?
}

/// The provider thread and the media workers, where configured.
#[derive(Clone)]
struct Workers {
    health: Arc<health::ProviderHealth>,
    dispatch: Option<dispatch::DispatchHandle>,
    media: Option<media::MediaPool>,
}

/// Starts the provider thread (callbacks to `callback_base`) and the media workers.
fn start_workers(
    config: &Config,
    policy: &spindle_core::Policy,
    shards: &[tokio::sync::mpsc::Sender<ShardMsg>],
    metrics: &Arc<metrics::Metrics>,
    callbacks: &http::CallbackSink,
    callback_base: String,
) -> anyhow::Result<Workers> {
    let health = Arc::new(health::ProviderHealth::new(
        policy.providers.iter().map(|p| p.name.clone()).collect(),
        live_policy::ADDED_WHILE_RUNNING_MAX,
    ));
    let _ = metrics.health.set(health.clone());
    // The roots the provider's certificates (its API's and its videos') are checked against,
    // read once for the provider thread and the media workers.
    let provider_tls = match &config.provider {
        Some(p) => p.tls()?,
        None => spindle_providers::tls::public_roots(),
    };
    let dispatch = match &config.provider {
        Some(p) => {
            let handle = dispatch::start(
                p.clone(),
                &provider_tls,
                callback_base,
                shards.to_vec(),
                metrics.clone(),
                health.clone(),
            )
            .context("starting the provider thread")?;
            let _ = callbacks.set(handle.dispatcher.clone());
            tracing::info!(
                "provider {} (callbacks to {})",
                p.url,
                handle.callback_url()
            );
            Some(handle)
        }
        None => None,
    };
    let media = match &config.media {
        Some(m) => {
            let pool =
                media::MediaPool::start(m, &config.node_id, shards.to_vec(), provider_tls.clone())
                    .context("starting the media workers")?;
            Some(pool)
        }
        None => None,
    };
    Ok(Workers {
        health,
        dispatch,
        media,
    })
}

/// The configured tenants' credentials, parsed; a warning names tenants whose credential is
/// in the clear.
fn tenant_credentials(config: &Config) -> anyhow::Result<HashMap<u32, credential::Credential>> {
    let credentials: HashMap<u32, credential::Credential> = config
        .tenants
        .iter()
        .map(|t| {
            credential::Credential::parse(&t.credential)
                .map(|c| (t.id, c))
                .map_err(|e| anyhow::anyhow!("tenant {}: credential: {e}", t.id))
        })
        .collect::<anyhow::Result<_>>()?;
    let clear: Vec<u32> = config
        .tenants
        .iter()
        .filter(|t| credentials.get(&t.id).is_some_and(|c| c.in_the_clear))
        .map(|t| t.id)
        .collect();
    if !clear.is_empty() {
        tracing::warn!(
            "the credentials of tenants {clear:?} are in the configuration in the clear: \
             write them as `sha256:…` (spindled --hash-credential prints it)"
        );
    }
    Ok(credentials)
}

/// Takes the control plane's split board for the shards, and hands it and the pipelines'
/// gauges to `/metrics`.
fn show_split_and_paths(
    started: &mut control::Started,
    metrics: &Arc<metrics::Metrics>,
    ownership: &Arc<ownership::Ownership>,
) -> anyhow::Result<Arc<spindle_sync::ShareBoard>> {
    let split = started
        .split
        .take()
        .context("the control plane split no board")?;
    let board = Arc::new(split.board);
    let _ = metrics.split.set(metrics::SplitView {
        names: std::sync::Mutex::new(split.names),
        board: board.clone(),
        ownership: ownership.clone(),
    });
    let _ = metrics.paths.set(
        started
            .pipes
            .iter()
            .map(|p| (p.submit_gauge.clone(), p.work_gauge.clone()))
            .collect(),
    );
    Ok(board)
}

/// What every shard is started with (each takes its own clones).
struct ShardWiring {
    config: Config,
    policy: spindle_core::Policy,
    senders: Vec<tokio::sync::mpsc::Sender<ShardMsg>>,
    handoffs: Vec<tokio::sync::mpsc::Sender<server::Handoff>>,
    credentials: HashMap<u32, credential::Credential>,
    /// Tenant → (cell, address) of the tenants other cells serve.
    other_cells: Arc<HashMap<u32, (String, String)>>,
    connections: Arc<server::Connections>,
    tls: Option<Arc<rustls::ServerConfig>>,
    reads: tokio::sync::mpsc::Sender<control::ReadMsg>,
    board: Arc<spindle_sync::ShareBoard>,
    offers: Arc<overload::OfferBoard>,
    auth: Arc<std::sync::Mutex<auth_guard::AuthGuard>>,
    metrics: Arc<metrics::Metrics>,
    ownership: Arc<ownership::Ownership>,
    workers: Workers,
    accepts_per_s: u64,
}

/// What is one shard's alone.
struct ShardOwn {
    index: usize,
    inbox: tokio::sync::mpsc::Receiver<ShardMsg>,
    handoffs_in: tokio::sync::mpsc::Receiver<server::Handoff>,
    pipes: control::Pipes,
    ids: std::ops::Range<u64>,
    restore: control::ShardRestores,
}

/// Starts shard `own.index` on its executor, listening on `addr` (port 0: any; the shards after
/// the first bind the port it got); returns the address bound and the executor's handle.
fn spawn_shard(
    wiring: &ShardWiring,
    own: ShardOwn,
    addr: SocketAddr,
) -> anyhow::Result<(SocketAddr, glommio::ExecutorJoinHandle<()>)> {
    let i = own.index;
    let config = wiring.config.clone();
    let log = local_provider_log(&config)?;
    let (bound_tx, bound_rx) = std_mpsc::channel();
    let policy = wiring.policy.clone();
    let senders = wiring.senders.clone();
    let handoffs = wiring.handoffs.clone();
    let credentials = wiring.credentials.clone();
    let other_cells = wiring.other_cells.clone();
    let connections = wiring.connections.clone();
    let listener_tls = wiring.tls.clone();
    let reads = wiring.reads.clone();
    let metrics = wiring.metrics.clone();
    let board = wiring.board.clone();
    let offers = wiring.offers.clone();
    let auth = wiring.auth.clone();
    let ownership = wiring.ownership.clone();
    let workers = wiring.workers.clone();
    let accepts_per_s = wiring.accepts_per_s;
    let ShardOwn {
        inbox,
        handoffs_in,
        pipes,
        ids,
        restore,
        ..
    } = own;
    let handle = LocalExecutorBuilder::new(Placement::Unbound)
        .name(&format!("shard-{i}"))
        .spin_before_park(std::time::Duration::from_micros(config.idle_spin_us))
        .spawn(move || async move {
            let mut shard = ShardState::new(ShardSetup {
                node: config.node_id.clone(),
                policy,
                shards: config.shards,
                pipes,
                reads,
                ids,
                partitions: config.partitions,
                time_scale: config.local_provider_time_scale,
                log,
                metrics: metrics.clone(),
                index: i,
                board,
                ownership: ownership.clone(),
                dispatch: workers.dispatch,
                health: workers.health,
                media: workers.media,
                lease_ms: config.lease_ms,
                inputs_bytes_max: (config.task_inputs_mb as usize).saturating_mul(1 << 20)
                    / config.shards as usize,
                ack_budget: std::time::Duration::from_millis(config.ack_budget_ms.into()),
                offers,
            });
            // A stored task that cannot come back is failed with its reason (logged and
            // counted), not left unserved; the node serves the others.
            let done = shard.restore(restore);
            shard.send_calls(done.calls);

            let listener = match glommio::net::TcpListener::bind(addr) {
                Ok(l) => l,
                Err(e) => {
                    let _ = bound_tx.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = bound_tx.send(listener.local_addr().map_err(|e| e.to_string()));
            let state = Rc::new(std::cell::RefCell::new(shard));
            glommio::spawn_local(shard::run(state.clone(), inbox)).detach();
            let ctx = Rc::new(ConnCtx {
                node_id: config.node_id.clone(),
                index: i,
                shards: senders,
                handoffs,
                credentials,
                other_cells: other_cells.clone(),
                partitions: config.partitions,
                inflight_max: config.connection_inflight_max,
                ownership,
                local: state,
                breaker: breaker::Breaker::new(config.breaker, metrics.clone()),
                metrics,
                tls: listener_tls,
                connections,
                refusing: std::cell::Cell::new(0),
                tls_refusals: std::cell::RefCell::new(server::AcceptPace::new(
                    server::TLS_REFUSALS_PER_S,
                    std::time::Instant::now(),
                )),
                // Each shard its share of the greeting budgets.
                greeting: std::cell::RefCell::new(server::Greeting::new(
                    config.unauthenticated_max.div_ceil(config.shards as usize),
                    config
                        .unauthenticated_per_address_max
                        .div_ceil(config.shards as usize),
                )),
                hello_within: std::time::Duration::from_millis(config.hello_timeout_ms.into()),
                auth,
            });
            glommio::spawn_local(server::take_handoffs(handoffs_in, ctx.clone())).detach();
            server::accept(listener, ctx, accepts_per_s).await;
        })
        .map_err(|e| anyhow::anyhow!("starting shard {i}: {e}"))?;
    let bound = bound_rx
        .recv()
        .context("a shard died while binding")?
        .map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
    Ok((bound, handle))
}

/// The local provider's log of executions (`local_provider_log`), opened to append.
fn local_provider_log(config: &Config) -> anyhow::Result<Option<std::fs::File>> {
    let Some(path) = &config.local_provider_log else {
        return Ok(None);
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    Ok(Some(file))
}

/// Says the node serves: its address registered where the port was chosen at bind, the log,
/// systemd, and the ready file.
fn announce(
    config: &Config,
    addr: SocketAddr,
    http_addr: SocketAddr,
    db_config: &DbConfig,
    metrics: &metrics::Metrics,
) -> anyhow::Result<()> {
    if addr != config.listen && config.advertise.is_none() {
        // The port was chosen at bind: other nodes name this address to redirect clients.
        register_address(&config.node_id, addr, db_config).context("registering the address")?;
    }
    if config.advertise.is_none() && addr.ip().is_unspecified() {
        tracing::warn!(
            "listening on {addr} without `advertise`: other nodes cannot send this node's \
             tenants here by address (their WrongNode answers carry none); set advertise"
        );
    }
    tracing::info!(
        "serving on {addr} with {} shards; /metrics, /livez, /readyz on {http_addr}",
        config.shards
    );
    metrics
        .serving
        .store(true, std::sync::atomic::Ordering::Relaxed);
    systemd::notify(&format!("READY=1\nSTATUS=serving on {addr}"));
    if let Some(path) = &config.ready_file {
        // Written aside and renamed: a reader never sees half of it.
        let tmp = path.with_extension("partial");
        std::fs::write(&tmp, format!("{addr}\n{http_addr}\n")).context("writing the ready file")?;
        std::fs::rename(&tmp, path).context("publishing the ready file")?;
    }
    Ok(())
}

fn register_address(node: &str, addr: SocketAddr, db_config: &DbConfig) -> anyhow::Result<()> {
    runtime::block_on(async {
        let db = spindle_control::Db::open(db_config).await?;
        db.register_node(node, &addr.to_string()).await?;
        anyhow::Ok(())
    })?
}

/// Waits for SIGTERM or SIGINT; then refuses new submits (Draining), stops dispatching, waits
/// up to `drain_ms` for running work to finish, gives the partitions back and exits.
async fn wait_for_stop(config: &Config, db_config: &DbConfig, metrics: &metrics::Metrics) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install signal handlers");
        return std::future::pending().await;
    };
    // The systemd watchdog is fed from the control plane's runtime: a wedged runtime stops
    // feeding it. A PostgreSQL outage does not (the node keeps running work through one).
    if let Some(every) = systemd::watchdog_interval() {
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                _ = tick.tick() => {
                    systemd::notify("WATCHDOG=1");
                }
            }
        }
    } else {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
    systemd::notify("STOPPING=1");
    tracing::info!(
        "stopping: no new work; draining running work for up to {} ms",
        config.drain_ms
    );
    metrics
        .stopping
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(config.drain_ms);
    // The shards publish their running counts every pump (≤ 20 ms); the last completions'
    // reports must have been answered too.
    let busy = || {
        metrics.running() > 0
            || metrics
                .reports_pending
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0
    };
    while busy() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let left = metrics.running();
    if left > 0 {
        tracing::warn!(
            "{left} tasks still running after the drain window; the next owner recovers them"
        );
    }
    if let Ok(db) = spindle_control::Db::open(db_config).await {
        if let Err(e) = db.release_partitions(&config.node_id).await {
            tracing::warn!("releasing partitions: {e}");
        }
        if let Err(e) = db.deregister_node(&config.node_id).await {
            tracing::warn!("deregistering: {e}");
        }
    }
    drop(EMBEDDED.lock().unwrap_or_else(|p| p.into_inner()).take());
    std::process::exit(0);
}
