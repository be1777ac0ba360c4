//! Starting spindled as a process on a fresh database, and small request helpers.
#![allow(dead_code)]

pub mod config;
pub mod mock;
pub mod python;

pub use config::NodeConfig;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{Band, ModelId, TaskId, TaskSpec, TaskState, TenantId, UserId};
use spindle_wire::SubmitTask;

pub struct Daemon {
    pub child: Child,
    pub addr: SocketAddr,
    /// /livez, /readyz, /metrics.
    pub http: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Daemon {
    /// The last `n` lines the daemon logged (for failure messages).
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Everything the daemon logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("stderr.log")).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub const CONFIG: &str = r#"
node_id = "test-node"
listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
shards = 2
partitions = 8
local_provider_time_scale = 0.0001

[[tenants]]
id = 1
credential = "tenant-1-credential"

[[tenants]]
id = 2
credential = "tenant-2-credential"
"#;

/// `CONFIG` with the local provider's time scale set to `scale` (its tasks then take their
/// modelled time × `scale`) and `extra` settings added.
pub fn config_scaled(scale: &str, extra: &str) -> String {
    NodeConfig::new().time_scale(scale).lines(extra).toml()
}

/// Starts spindled on a fresh database and waits (bounded) until it serves.
pub async fn start(test: &TestDb) -> Daemon {
    start_with(test, CONFIG).await
}

/// Starts spindled with `config` (TOML) on `test`'s database.
pub async fn start_with(test: &TestDb, config_text: &str) -> Daemon {
    start_on(&test.config().conninfo, config_text).await
}

/// Starts spindled with `config` (TOML) on the database `conninfo` names.
pub async fn start_on(conninfo: &str, config_text: &str) -> Daemon {
    spawn_on(conninfo, config_text)
        .serving(Duration::from_secs(30))
        .await
}

/// [`start_with`], the daemon's environment holding `vars` too (`SPINDLE_LOG_FORMAT`, say).
#[allow(dead_code)]
pub async fn start_with_env(test: &TestDb, config_text: &str, vars: &[(&str, &str)]) -> Daemon {
    spawn_with_env(&test.config().conninfo, config_text, vars)
        .serving(Duration::from_secs(30))
        .await
}

/// Starts one spindled per configuration on `test`'s database, every one before any is waited
/// for (bounded), in order. A node takes any free partition after `takeover_grace_ms` of
/// uptime (one lease by default), so one slow to start (a busy machine) can find the
/// partitions it prefers taken: configurations whose tests depend on where a partition lives
/// set that grace long.
pub async fn start_together(test: &TestDb, configs: &[String]) -> Vec<Daemon> {
    let conninfo = &test.config().conninfo;
    let starting: Vec<Starting> = configs.iter().map(|c| spawn_on(conninfo, c)).collect();
    let mut nodes = Vec::new();
    for s in starting {
        nodes.push(s.serving(Duration::from_secs(30)).await);
    }
    nodes
}

/// A spindled process started and not yet known to serve.
pub struct Starting {
    child: Child,
    dir: tempfile::TempDir,
    ready: std::path::PathBuf,
}

/// Starts spindled with `config` (TOML) on the database `conninfo` names, without waiting.
pub fn spawn_on(conninfo: &str, config_text: &str) -> Starting {
    spawn_with_env(conninfo, config_text, &[])
}

/// [`spawn_on`], the daemon's environment holding `vars` too.
pub fn spawn_with_env(conninfo: &str, config_text: &str, vars: &[(&str, &str)]) -> Starting {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("spindled.toml");
    // The overload gate's commit-wait budget is a latency target; a debug build sharing two
    // cores with PostgreSQL and other tests' nodes misses 50 ms at times and would refuse
    // work that tests of other things expect taken. Only tests of the gate set it.
    let config_text = if config_text.contains("ack_budget_ms") {
        config_text.to_string()
    } else {
        format!("ack_budget_ms = 10000\n{config_text}")
    };
    std::fs::write(&config, config_text).unwrap();
    let ready = dir.path().join("ready");
    let child = Command::new(env!("CARGO_BIN_EXE_spindled"))
        .arg("--config")
        .arg(&config)
        .arg("--postgres")
        .arg(conninfo)
        .arg("--ready-file")
        .arg(&ready)
        .envs(vars.iter().copied())
        .stdout(Stdio::null())
        // A file, not a pipe: nobody drains a pipe while the test runs, and a full one would
        // stall the daemon's logging.
        .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    Starting { child, dir, ready }
}

impl Starting {
    /// Waits (bounded by `within`) until the node's log holds `needle`; whether it did. The
    /// node is not ready meanwhile (asserted): a test of a node that must not start serving.
    #[allow(dead_code)]
    pub async fn logs_before_serving(&mut self, needle: &str, within: Duration) -> bool {
        let began = std::time::Instant::now();
        while began.elapsed() < within {
            assert!(!self.ready.exists(), "the node got ready");
            let log =
                std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default();
            if log.contains(needle) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Stops the node that was never to serve.
    #[allow(dead_code)]
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits (bounded by `within`) until the node serves.
    pub async fn serving(mut self, within: Duration) -> Daemon {
        let began = std::time::Instant::now();
        while began.elapsed() < within {
            if let Ok(text) = std::fs::read_to_string(&self.ready) {
                if let Some(Ok(addr)) = text.lines().next().map(str::parse) {
                    let Some(Ok(http)) = text.lines().nth(1).map(str::parse) else {
                        panic!("the ready file has no HTTP address: {text:?}");
                    };
                    return Daemon {
                        child: self.child,
                        addr,
                        http,
                        _dir: self.dir,
                    };
                }
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                let err =
                    std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default();
                panic!("spindled exited ({status}): {err}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = self.child.kill();
        let err = std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default();
        panic!("spindled did not get ready in {within:?}: {err}");
    }
}

pub fn task(key: &str) -> SubmitTask {
    SubmitTask {
        idempotency_key: key.into(),
        user: UserId(1),
        spec: TaskSpec::clip_720p(ModelId(0)),
        band_hint: Some(Band::P3),
        deadline_ms: None,
        input: None,
    }
}

/// `task(key)` submitted by `user`.
pub fn task_of(key: &str, user: u32) -> SubmitTask {
    let mut t = task(key);
    t.user = UserId(user);
    t
}

/// How often `poll_until` reads.
pub const POLL_EVERY: Duration = Duration::from_millis(5);

/// Reads `read` until `done` holds of a reading, every `POLL_EVERY`, for at most `budget` (a
/// condition waited for, bounded, never a sleep standing in for it); returns the last reading,
/// for the caller to assert on, whether `done` held of it or the budget ran out.
pub async fn poll_until<T>(
    budget: Duration,
    mut read: impl AsyncFnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = std::time::Instant::now() + budget;
    loop {
        let reading = read().await;
        if done(&reading) || std::time::Instant::now() >= deadline {
            return reading;
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// Clients of `CONFIG`'s two tenants on `daemon`.
pub async fn both_tenants(daemon: &Daemon) -> (Client, Client) {
    let one = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let two = Client::connect(daemon.addr, TenantId(2), "tenant-2-credential")
        .await
        .unwrap();
    (one, two)
}

/// The one bigint `query` reads on `sql`.
pub async fn read_i64(sql: &tokio_postgres::Client, query: &str) -> i64 {
    sql.query_one(query, &[]).await.unwrap().get(0)
}

/// Polls until `task` is in `state` (bounded: 20 s).
pub async fn wait_for(client: &Client, task: TaskId, state: TaskState) {
    let last = poll_until(
        Duration::from_secs(20),
        async || client.get(task).await.unwrap(),
        |s| s.state == state,
    )
    .await;
    assert_eq!(last.state, state, "task {task}; last {last:?}");
}

/// The value of `series` (a metric name with its labels, as `/metrics` writes it) on `daemon`;
/// 0 when it is not there.
pub async fn metric(daemon: &Daemon, series: &str) -> u64 {
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0)
}

/// The sum of every series of the metric `name`, whatever its labels, in a `/metrics` text.
pub fn metric_sum(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The tasks of a batch's answers, every one of which must be accepted.
pub fn accepted_ids(
    answers: Result<Vec<spindle_wire::Admission>, spindle_client::ClientError>,
) -> Vec<i64> {
    answers
        .unwrap()
        .into_iter()
        .map(|a| {
            assert!(a.decision.is_accepted(), "{a:?}");
            a.task.0 as i64
        })
        .collect()
}

/// For each `(tenant, credential)`, `batches` frames of `per_batch` tasks keyed
/// `t{tenant}-{batch}-{i}`, every one of which must be accepted: their ids, in the order sent.
pub async fn submit_accepted(
    addr: SocketAddr,
    tenants: &[(u32, &str)],
    batches: usize,
    per_batch: usize,
) -> Vec<TaskId> {
    let mut acked = Vec::new();
    for &(tenant, credential) in tenants {
        let client = Client::connect(addr, TenantId(tenant), credential)
            .await
            .unwrap();
        for batch in 0..batches {
            let tasks: Vec<_> = (0..per_batch)
                .map(|i| task(&format!("t{tenant}-{batch}-{i}")))
                .collect();
            for a in client.submit_batch(tasks).await.unwrap() {
                assert!(a.decision.is_accepted(), "{a:?}");
                acked.push(a.task);
            }
        }
    }
    acked
}

/// A plain HTTP GET, answered with (status line, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    http_get_on(tokio::net::TcpStream::connect(addr).await.unwrap(), path).await
}

/// A GET on a connected `stream` (plain or TLS), answered with (status line, body).
pub async fn http_get_on(
    mut stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    path: &str,
) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).await.unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// Polls (bounded: 60 s) until every task in `ids` is SUCCEEDED in PostgreSQL; returns how many
/// are.
pub async fn wait_all_succeeded(sql: &tokio_postgres::Client, ids: &[i64]) -> i64 {
    wait_all_succeeded_within(sql, ids, Duration::from_secs(60)).await
}

/// `wait_all_succeeded` bounded by `budget`.
pub async fn wait_all_succeeded_within(
    sql: &tokio_postgres::Client,
    ids: &[i64],
    budget: Duration,
) -> i64 {
    poll_until(
        budget,
        async || {
            sql.query_one(
                "SELECT count(*) FROM task WHERE task_id = ANY ($1) AND state = 'SUCCEEDED'",
                &[&ids],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        },
        |&done| done == ids.len() as i64,
    )
    .await
}

/// The local provider's execution logs: no (task, attempt) line appears twice across them;
/// returns the tasks that ran.
pub fn executed_once_per_attempt(logs: &[&std::path::Path]) -> std::collections::HashSet<u64> {
    let mut seen = std::collections::HashSet::new();
    let mut ran = std::collections::HashSet::new();
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines() {
            assert!(
                seen.insert(line.to_string()),
                "attempt executed twice: {line}"
            );
            ran.insert(
                line.split_whitespace()
                    .next()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap(),
            );
        }
    }
    ran
}

/// Runs spindlectl against the admin API at `http` with `token`; (success, stdout).
pub fn ctl(http: SocketAddr, token: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_spindlectl"))
        .arg("--node")
        .arg(http.to_string())
        .arg("--token")
        .arg(token)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The admin API's three roles, one token each (`admin_tokens`).
pub const VIEWER_TOKEN: &str = "viewer-token-0123456789";
pub const OPERATOR_TOKEN: &str = "operator-token-0123456789";
pub const ADMIN_TOKEN: &str = "admin-token-0123456789";

/// `[[admin_tokens]]` for a viewer (vera), an operator (otto) and an admin (ada), to append to a
/// node configuration. The admin's is written as its SHA-256, as an operator would keep it.
pub fn admin_tokens() -> String {
    let hashed = spindle_node_base::credential::hashed_for_config(ADMIN_TOKEN).unwrap();
    [
        ("vera", VIEWER_TOKEN, "viewer"),
        ("otto", OPERATOR_TOKEN, "operator"),
        ("ada", hashed.as_str(), "admin"),
    ]
    .iter()
    .map(|(name, token, role)| {
        format!("\n[[admin_tokens]]\nname = \"{name}\"\ntoken = \"{token}\"\nrole = \"{role}\"\n")
    })
    .collect()
}

/// Polls (bounded: 30 s) until `query` (one bigint) reads `want`; returns the last reading.
pub async fn wait_reading(sql: &tokio_postgres::Client, query: &str, want: i64) -> i64 {
    poll_until(
        Duration::from_secs(30),
        async || read_i64(sql, query).await,
        |&got| got == want,
    )
    .await
}

/// Reservations still ACTIVE: none once every attempt has ended.
pub async fn active_reservations(sql: &tokio_postgres::Client) -> i64 {
    sql.query_one(
        "SELECT count(*) FROM resource_reservation WHERE status = 'ACTIVE'",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// A self-signed certificate for `localhost`: written to `dir/ca.pem` (what a node's
/// `ca_file` names), and a server's TLS configuration serving it.
pub fn localhost_tls(
    dir: &std::path::Path,
) -> (
    std::path::PathBuf,
    std::sync::Arc<spindle_providers::tls::ServerConfig>,
) {
    let rcgen::CertifiedKey { cert, key_pair } =
        rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, cert.pem()).unwrap();
    let server = spindle_providers::tls::server_config(
        cert.pem().as_bytes(),
        key_pair.serialize_pem().as_bytes(),
    )
    .unwrap();
    (ca, server)
}

/// A self-signed certificate for `localhost` and `127.0.0.1`, and its key, written to `dir`
/// for a node's listeners: the `[tls]` section naming them, and the certificate's path (what
/// a client trusts).
pub fn node_tls(dir: &std::path::Path) -> (String, std::path::PathBuf) {
    let rcgen::CertifiedKey { cert, key_pair } =
        rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    let (cert_file, key_file) = (dir.join("node.pem"), dir.join("node.key"));
    std::fs::write(&cert_file, cert.pem()).unwrap();
    std::fs::write(&key_file, key_pair.serialize_pem()).unwrap();
    let section = format!(
        "\n[tls]\ncert_file = {:?}\nkey_file = {:?}\n",
        cert_file.display().to_string(),
        key_file.display().to_string()
    );
    (section, cert_file)
}

/// A CA for client certificates and one client certificate it issued, written to `dir`:
/// (the CA's certificate, the client's certificate, the client's key).
pub fn client_ca(
    dir: &std::path::Path,
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "spindle test clients");
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut client = CertificateParams::new(vec!["client-1".into()]).unwrap();
    client
        .distinguished_name
        .push(DnType::CommonName, "client-1");
    client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client = client.signed_by(&key, &ca, &ca_key).unwrap();
    let paths = (
        dir.join("clients-ca.pem"),
        dir.join("client.pem"),
        dir.join("client.key"),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, client.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

/// What `expressions` (PromQL) name that `exposition` (a node's /metrics) does not have: a
/// metric whose family is not declared (a histogram's `_bucket`, `_sum` and `_count` are its
/// family's), or a label of a `by (…)` that no sample of the expression's metrics carries
/// (where they have samples).
pub fn unknown_series(exposition: &str, expressions: &[String]) -> Vec<String> {
    let mut families: Vec<(String, String)> = Vec::new();
    for line in exposition.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (it.next(), it.next()) {
                families.push((name.to_string(), kind.to_string()));
            }
        }
    }
    let exported = |name: &str| {
        families.iter().any(|(f, kind)| {
            name == f
                || (kind == "histogram"
                    && ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name.strip_suffix(s) == Some(f.as_str())))
        })
    };
    let mut problems = Vec::new();
    for expr in expressions {
        let names: Vec<&str> = expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("spindle_"))
            .collect();
        for name in &names {
            if !exported(name) {
                problems.push(format!("{name} (in {expr}) is not exported"));
            }
        }
        // Labels are checked where the expression's metrics have samples here (some have
        // them only with work queued or running, or a GPU).
        let sampled = exposition
            .lines()
            .any(|l| !l.starts_with('#') && names.iter().any(|n| l.starts_with(n)));
        for clause in expr.split("by (").skip(1).filter(|_| sampled) {
            let labels = clause.split(')').next().unwrap_or("");
            for label in labels.split(',').map(str::trim).filter(|l| *l != "le") {
                let carried = exposition.lines().any(|l| {
                    names.iter().any(|n| l.starts_with(n)) && l.contains(&format!("{label}=\""))
                });
                if !carried {
                    problems.push(format!(
                        "no sample of {names:?} has label {label} (in {expr})"
                    ));
                }
            }
        }
    }
    problems
}
