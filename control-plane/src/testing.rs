//! A fresh database per test on a real PostgreSQL. The test command (`scripts/test-all`) starts
//! one private server and exports `SPINDLE_TEST_PG` (a conninfo for its `postgres` database);
//! without it each `TestDb` starts a private server of its own (slower, same behaviour).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use tokio_postgres::NoTls;

use crate::db::{Db, DbConfig};
use crate::embedded::{EmbeddedOptions, EmbeddedPostgres};
use crate::error::StoreError;

/// The environment variable naming a running server for tests.
pub const TEST_PG_ENV: &str = "SPINDLE_TEST_PG";

static NEXT_DB: AtomicU32 = AtomicU32::new(0);

pub struct TestDb {
    /// The database's name on its server.
    name: String,
    config: DbConfig,
    /// The private server when no shared one was given; dropped (stopped) with the test.
    server: Option<Arc<EmbeddedPostgres>>,
}

impl TestDb {
    /// Creates an empty database named after the test process, a counter and the clock.
    pub async fn new() -> TestDb {
        let (admin_conninfo, server) = match std::env::var(TEST_PG_ENV) {
            Ok(conninfo) => (conninfo, None),
            Err(_) => {
                let pg = EmbeddedPostgres::start(EmbeddedOptions::default())
                    .unwrap_or_else(|e| panic!("starting a private PostgreSQL for the test: {e}"));
                (pg.conninfo("postgres"), Some(Arc::new(pg)))
            }
        };
        // The clock too: process ids come round again on a server that outlives many runs.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() % 1_000_000_000_000);
        let name = format!(
            "spindle_test_{}_{}_{nanos}",
            std::process::id(),
            NEXT_DB.fetch_add(1, Ordering::Relaxed)
        );
        let (client, connection) = tokio_postgres::connect(&admin_conninfo, NoTls)
            .await
            .unwrap_or_else(|e| panic!("connecting to the test server ({admin_conninfo}): {e}"));
        let conn = tokio::spawn(connection);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("CREATE DATABASE");
        drop(client);
        conn.await
            .expect("admin connection task")
            .expect("admin connection");
        let conninfo = replace_dbname(&admin_conninfo, &name);
        TestDb {
            name,
            config: DbConfig::new(conninfo),
            server,
        }
    }

    pub fn config(&self) -> &DbConfig {
        &self.config
    }

    /// The database's name on its server (a test that creates a database beside it names it
    /// after this one).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A migrated connection.
    pub async fn open(&self) -> Db {
        Db::open(&self.config)
            .await
            .expect("open the test database")
    }

    /// The private server, when this test has one (tests that stop and restart it need it).
    pub fn private_server(&self) -> Option<&Arc<EmbeddedPostgres>> {
        self.server.as_ref()
    }

    /// A plain client for assertions in SQL.
    pub async fn sql(&self) -> Result<tokio_postgres::Client, StoreError> {
        let (client, connection) = tokio_postgres::connect(&self.config.conninfo, NoTls).await?;
        tokio::spawn(connection);
        Ok(client)
    }
}

/// `conninfo` with its `dbname` replaced (or added).
pub fn replace_dbname(conninfo: &str, dbname: &str) -> String {
    let mut parts: Vec<String> = conninfo
        .split_whitespace()
        .filter(|p| !p.starts_with("dbname="))
        .map(str::to_string)
        .collect();
    parts.push(format!("dbname={dbname}"));
    parts.join(" ")
}

/// A TCP proxy in front of a test server, for calls whose answer is lost. Armed with a
/// pattern, it drops the first answer from the server that contains it (a claim's `GRANTED`, a
/// submit's `CREATED`) and everything after it on that connection: the call ran and committed,
/// and its caller never hears so. `cut` then breaks every connection made through it so far
/// (the caller sees its connection drop under the call); new connections pass as before.
pub struct Proxy {
    conninfo: String,
    shared: Arc<ProxyShared>,
}

struct ProxyShared {
    target: std::net::SocketAddr,
    /// The armed pattern, taken by the first answer that contains it.
    armed: std::sync::Mutex<Option<Vec<u8>>>,
    /// Answers lost so far.
    lost: AtomicU32,
    stop: std::sync::atomic::AtomicBool,
    /// The client side of every connection so far, for `cut`.
    clients: std::sync::Mutex<Vec<std::net::TcpStream>>,
}

impl Proxy {
    /// Listens on a free local port and forwards to the server `conninfo` names (its `host`
    /// and `port`, TCP).
    pub fn start(conninfo: &str) -> Proxy {
        let field = |key: &str| {
            conninfo
                .split_whitespace()
                .find_map(|p| p.strip_prefix(key))
                .unwrap_or_else(|| panic!("conninfo {conninfo:?} has no {key}"))
                .to_string()
        };
        let target: std::net::SocketAddr = format!("{}:{}", field("host="), field("port="))
            .parse()
            .unwrap_or_else(|e| panic!("conninfo {conninfo:?}: {e}"));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(ProxyShared {
            target,
            armed: std::sync::Mutex::new(None),
            lost: AtomicU32::new(0),
            stop: std::sync::atomic::AtomicBool::new(false),
            clients: std::sync::Mutex::new(Vec::new()),
        });
        let accept = shared.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if accept.stop.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = std::net::TcpStream::connect(accept.target) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                if let Ok(c) = client.try_clone() {
                    lock(&accept.clients).push(c);
                }
                let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
                    continue;
                };
                std::thread::spawn(move || pump(client, server, None));
                let answers = accept.clone();
                std::thread::spawn(move || pump(s2, c2, Some(answers)));
            }
        });
        let conninfo = conninfo
            .split_whitespace()
            .filter(|p| !p.starts_with("host=") && !p.starts_with("port="))
            .map(str::to_string)
            .chain(["host=127.0.0.1".to_string(), format!("port={port}")])
            .collect::<Vec<_>>()
            .join(" ");
        Proxy { conninfo, shared }
    }

    /// The conninfo that goes through the proxy.
    pub fn conninfo(&self) -> &str {
        &self.conninfo
    }

    /// Loses the next answer that contains `pattern` (once).
    pub fn lose_answer_containing(&self, pattern: &[u8]) {
        *lock(&self.shared.armed) = Some(pattern.to_vec());
    }

    /// Answers lost so far.
    pub fn lost(&self) -> u32 {
        self.shared.lost.load(Ordering::SeqCst)
    }

    /// Waits (bounded: ~20 s, then panics) until the answer armed last was lost and
    /// `committed` — a query answering one boolean — holds on `sql` (a direct connection): a
    /// call's rows go out before its commit, so a cut before that would roll it back. Answers
    /// lost earlier do not count: with a second pattern armed, only its own loss ends the wait.
    pub async fn wait_lost_and(&self, sql: &tokio_postgres::Client, committed: &str) {
        for _ in 0..20_000 {
            let armed_lost = self.lost() > 0 && lock(&self.shared.armed).is_none();
            if armed_lost {
                let row = sql.query_one(committed, &[]).await;
                if row.is_ok_and(|r| r.get::<_, bool>(0)) {
                    return;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        panic!("lost {} answers; `{committed}` never held", self.lost());
    }

    /// Breaks every connection made through the proxy so far.
    pub fn cut(&self) {
        let clients = std::mem::take(&mut *lock(&self.shared.clients));
        for c in clients {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.shared.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so that it sees `stop`.
        let port = self
            .conninfo
            .rsplit("port=")
            .next()
            .unwrap_or("0")
            .to_string();
        let _ = std::net::TcpStream::connect(format!("127.0.0.1:{port}"));
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Copies `from` to `to` until either side ends. With `answers` (the server's side), an answer
/// that contains the armed pattern is dropped with everything after it.
fn pump(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    answers: Option<Arc<ProxyShared>>,
) {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 64 * 1024];
    // The end of the previous read, so that a pattern split across two reads is seen.
    let mut tail: Vec<u8> = Vec::new();
    let mut losing = false;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(shared) = &answers {
            if !losing {
                let mut armed = lock(&shared.armed);
                if let Some(pattern) = armed.as_ref() {
                    tail.extend_from_slice(&buf[..n]);
                    if tail.windows(pattern.len()).any(|w| w == pattern.as_slice()) {
                        *armed = None;
                        losing = true;
                        shared.lost.fetch_add(1, Ordering::SeqCst);
                    } else {
                        let keep = pattern.len().saturating_sub(1).min(tail.len());
                        tail.drain(..tail.len() - keep);
                    }
                } else {
                    tail.clear();
                }
            }
            if losing {
                continue;
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}
