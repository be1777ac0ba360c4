//! One PostgreSQL connection with spindle's session settings and prepared batch statements.
//! Each `Db` is one connection; the control plane holds several (one per batcher) rather than a
//! pool, because every hot call is a single statement on a connection of its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls, Statement};

use crate::error::StoreError;
use crate::limits::CONNECT_ATTEMPTS_MAX;
use crate::migrate;

/// How to reach PostgreSQL and the limits every session runs under.
#[derive(Debug, Clone)]
pub struct DbConfig {
    /// libpq-style: `host=… port=… user=… dbname=…`.
    pub conninfo: String,
    /// `statement_timeout`: no statement (a batch is one) runs longer.
    pub statement_timeout_ms: u32,
    /// `idle_in_transaction_session_timeout`: a session stuck inside a transaction is ended.
    pub idle_in_transaction_timeout_ms: u32,
    /// `lock_timeout`: a batch waiting this long for a row lock gives up (retryable).
    pub lock_timeout_ms: u32,
    pub connect_timeout_ms: u32,
    /// How long past `statement_timeout` a call's answer may take before the connection is
    /// given up (the server ends every statement at its timeout and answers, so a longer
    /// silence is a connection that went dead without closing — a network partition, a
    /// failover that left the socket half open): the call fails as unavailable, or in doubt
    /// if it changes rows.
    pub answer_grace_ms: u32,
    /// First delay of `open_with_backoff`; doubled per attempt up to `backoff_max_ms`.
    pub backoff_initial_ms: u32,
    pub backoff_max_ms: u32,
    pub application_name: String,
    /// What a connection to a primary without a synchronous standby does.
    pub sync_standby: SyncStandby,
}

/// Whether a primary must have a synchronous standby: with one, a commit PostgreSQL
/// acknowledged is on two servers, and a failover to the standby loses none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncStandby {
    /// Not looked at (a private server, tests, tools).
    #[default]
    Ignore,
    /// Looked at on every connection; a primary without one is used, and a warning says so.
    Warn,
    /// A primary without one is not used: the connection fails `Unavailable`, naming why, and
    /// is tried again as any unreachable server is.
    Require,
}

impl DbConfig {
    pub fn new(conninfo: impl Into<String>) -> DbConfig {
        DbConfig {
            conninfo: conninfo.into(),
            statement_timeout_ms: 10_000,
            idle_in_transaction_timeout_ms: 10_000,
            lock_timeout_ms: 5_000,
            connect_timeout_ms: 5_000,
            answer_grace_ms: 5_000,
            backoff_initial_ms: 50,
            backoff_max_ms: 2_000,
            application_name: "spindle".into(),
            sync_standby: SyncStandby::Ignore,
        }
    }
}

/// The batch statements, prepared once per connection.
pub(crate) struct Statements {
    pub submit: Statement,
    pub submit_leased: Statement,
    pub submit_claim: Statement,
    pub claim: Statement,
    pub report: Statement,
    pub work: Statement,
    pub renew: Statement,
}

pub struct Db {
    client: Client,
    pub(crate) stmts: Statements,
    connection: JoinHandle<()>,
    /// `statement_timeout` and `answer_grace_ms`: see [`Db::answered`].
    statement_timeout: Duration,
    answer_grace: Duration,
    /// Set when a call went unanswered past its deadline: the connection is closed from then
    /// on, whenever its task finishes ending.
    given_up: Arc<AtomicBool>,
}

/// What a call to PostgreSQL does, which decides what its lost answer means: a read that went
/// unanswered is only unavailable; a call that writes and was sent may have committed, so it is
/// in doubt (its rows are read back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    Reads,
    Writes,
}

/// How long one unit of work on a connection may go unanswered, and what giving up on it does:
/// the connection is marked given up and its task aborted, so every later call fails at once.
/// Owned (a few handles), so that a unit of work can borrow the connection mutably while its
/// deadline runs — [`Db::within`].
pub(crate) struct Deadline {
    within: Duration,
    given_up: Arc<AtomicBool>,
    connection: tokio::task::AbortHandle,
    /// Whether the connection was live when the work started (a change sent on a live
    /// connection and left unanswered is in doubt).
    open: bool,
}

impl Deadline {
    /// The deadline of up to `statements` statements on the connection `connection` drives.
    fn of(
        statement_timeout: Duration,
        answer_grace: Duration,
        statements: u32,
        given_up: &Arc<AtomicBool>,
        connection: &JoinHandle<()>,
        open: bool,
    ) -> Deadline {
        Deadline {
            within: statement_timeout * statements.max(1) + answer_grace,
            given_up: given_up.clone(),
            connection: connection.abort_handle(),
            open,
        }
    }

    /// Awaits `work` for at most the deadline. Past it the connection is given up and the work
    /// fails `Unavailable` — or `InDoubt` if it writes ([`Call::Writes`]) and was sent on a live
    /// connection.
    pub(crate) async fn run<T>(
        self,
        call: Call,
        work: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if self.given_up.load(Ordering::Relaxed) {
            // Not sent: nothing of it can have committed.
            return Err(StoreError::Unavailable(
                "the connection was given up".into(),
            ));
        }
        match tokio::time::timeout(self.within, work).await {
            Ok(Err(e)) if e.is_read_only() => {
                // The server became a standby under this connection (a failover demoted it):
                // given up, so that the caller connects again and finds the primary.
                self.given_up.store(true, Ordering::Relaxed);
                self.connection.abort();
                Err(e)
            }
            Ok(answer) => answer,
            Err(_) => {
                self.given_up.store(true, Ordering::Relaxed);
                self.connection.abort();
                let text = format!(
                    "no answer within {} ms; the connection is given up",
                    self.within.as_millis()
                );
                tracing::warn!("PostgreSQL: {text}");
                Err(if call == Call::Writes && self.open {
                    StoreError::InDoubt(text)
                } else {
                    StoreError::Unavailable(text)
                })
            }
        }
    }
}

impl Db {
    /// Connects, applies pending migrations (under the advisory lock) and prepares statements,
    /// each step under a deadline: the start-up exchange within `connect_timeout` + the grace
    /// (the driver bounds only the socket's connect), the migrations and the prepares as
    /// `Db::within` bounds any call. A server that accepts the connection and then stops
    /// answering fails the open `Unavailable` instead of holding the caller — a node's start,
    /// a pipeline's reconnect — forever.
    pub async fn open(config: &DbConfig) -> Result<Db, StoreError> {
        let statement_timeout = Duration::from_millis(u64::from(config.statement_timeout_ms));
        let answer_grace = Duration::from_millis(u64::from(config.answer_grace_ms));
        let start_up = Duration::from_millis(u64::from(config.connect_timeout_ms)) + answer_grace;
        let (mut client, connection) = tokio::time::timeout(start_up, connect(config))
            .await
            .map_err(|_| {
                StoreError::Unavailable(format!(
                    "no answer to the connection's start-up within {} ms",
                    start_up.as_millis()
                ))
            })??;
        let given_up = Arc::new(AtomicBool::new(false));
        let deadline = |statements: u32| {
            Deadline::of(
                statement_timeout,
                answer_grace,
                statements,
                &given_up,
                &connection,
                true,
            )
        };
        let ready = async {
            deadline(1)
                .run(Call::Reads, server_role(&client, config.sync_standby))
                .await?;
            migrate::apply_bounded(&mut client, &deadline).await?;
            deadline(Statements::COUNT)
                .run(Call::Reads, prepare(&client))
                .await
        }
        .await;
        let stmts = match ready {
            Ok(stmts) => stmts,
            Err(e) => {
                connection.abort();
                return Err(e);
            }
        };
        Ok(Db {
            client,
            stmts,
            connection,
            statement_timeout,
            answer_grace,
            given_up,
        })
    }

    /// Awaits `call`, one statement on this connection, for at most the answer deadline:
    /// `statement_timeout` + `answer_grace_ms` (the server ends every statement at its timeout
    /// and answers, so a longer silence is a connection that went dead without closing, or a
    /// server that stopped answering — a backend stuck on I/O, a paused machine — which TCP
    /// keepalive cannot tell from a live one). Past it the connection is given up (every later
    /// call fails `Unavailable` until the caller opens a new one). A call that writes
    /// ([`Call::Writes`]) and was sent on a live connection is in doubt when it fails without the server's
    /// answer, whether the connection broke or went silent.
    pub(crate) async fn answered<T>(
        &self,
        kind: Call,
        call: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, StoreError> {
        let deadline = self.within(1);
        let open = deadline.open;
        deadline
            .run(kind, async {
                call.await.map_err(|e| {
                    if kind == Call::Writes {
                        crate::error::sent_call_error(e, open)
                    } else {
                        e.into()
                    }
                })
            })
            .await
    }

    /// The deadline of a unit of work of up to `statements` statements (a transaction, a read
    /// and its follow-up): each may run to `statement_timeout`, and the answer may take the
    /// grace on top. Every call of the store goes through it or [`Db::answered`], so no call
    /// waits on PostgreSQL without bound.
    pub(crate) fn within(&self, statements: u32) -> Deadline {
        Deadline::of(
            self.statement_timeout,
            self.answer_grace,
            statements,
            &self.given_up,
            &self.connection,
            !self.is_closed(),
        )
    }

    /// `open`, retried with exponential backoff while PostgreSQL is unavailable; other errors
    /// return at once. After `CONNECT_ATTEMPTS_MAX` attempts the last `Unavailable` is returned.
    pub async fn open_with_backoff(config: &DbConfig) -> Result<Db, StoreError> {
        let mut delay = u64::from(config.backoff_initial_ms);
        let mut attempt = 1;
        loop {
            match Db::open(config).await {
                Ok(db) => return Ok(db),
                Err(e) if e.is_unavailable() && attempt < CONNECT_ATTEMPTS_MAX => {
                    tokio::time::sleep(Duration::from_millis(delay)).await;
                    delay = (delay * 2).min(u64::from(config.backoff_max_ms));
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// True once the connection is gone; every call then returns `Unavailable`.
    pub fn is_closed(&self) -> bool {
        self.given_up.load(Ordering::Relaxed) || self.client.is_closed()
    }

    /// The backend's process id (for operators and for tests that terminate it).
    pub async fn backend_pid(&self) -> Result<i32, StoreError> {
        let call = self.client.query_one("SELECT pg_backend_pid()", &[]);
        Ok(self.answered(Call::Reads, call).await?.get(0))
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn client_mut(&mut self) -> &mut Client {
        &mut self.client
    }

    /// A read-only transaction on one snapshot (repeatable read): every read in it sees the
    /// same committed state.
    pub(crate) async fn read_snapshot(
        &mut self,
    ) -> Result<tokio_postgres::Transaction<'_>, StoreError> {
        Ok(self
            .client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await?)
    }
}

/// `Db::open` is awaited inside spawned tasks (a pipeline's reconnect): its future must stay
/// `Send`.
#[allow(dead_code)]
fn open_is_send(config: &DbConfig) -> impl Send + '_ {
    Db::open(config)
}

impl Drop for Db {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

/// TCP keepalive on every connection: the first probe after this much silence…
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// …then one probe this often, and the connection ends after this many go unanswered
/// (10 + 3 × 3 s ≈ 20 s for a dead peer while a call waits).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);
const KEEPALIVE_PROBES: u32 = 3;
/// Data sent and not acknowledged for this long ends the connection (a peer gone mid-write).
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(20);

async fn connect(config: &DbConfig) -> Result<(Client, JoinHandle<()>), StoreError> {
    let tls = crate::pg_tls::parse(&config.conninfo)
        .map_err(|e| StoreError::Unavailable(format!("bad conninfo: {e}")))?;
    let mut pg: tokio_postgres::Config =
        tls.conninfo.parse().map_err(|e: tokio_postgres::Error| {
            StoreError::Unavailable(format!("bad conninfo: {e}"))
        })?;
    // A peer that went away without closing (a partition, a failover that left the socket
    // half open) is found by the kernel on every call (see `KEEPALIVE_*`), and within the
    // answer deadline on the calls that go through `Db::answered`.
    pg.application_name(&config.application_name)
        .connect_timeout(Duration::from_millis(u64::from(config.connect_timeout_ms)))
        .keepalives(true)
        .keepalives_idle(KEEPALIVE_IDLE)
        .keepalives_interval(KEEPALIVE_INTERVAL)
        .keepalives_retries(KEEPALIVE_PROBES)
        .tcp_user_timeout(TCP_USER_TIMEOUT)
        .options(format!(
            // jit off: spindle's statements are short; compiling one costs more than running it.
            "-c statement_timeout={} -c idle_in_transaction_session_timeout={} -c lock_timeout={} -c jit=off",
            config.statement_timeout_ms,
            config.idle_in_transaction_timeout_ms,
            config.lock_timeout_ms
        ));
    let (client, handle) = match tls.tls {
        None => {
            let (client, connection) = pg.connect(NoTls).await?;
            (client, watch(connection))
        }
        Some(config) => {
            // A refused handshake (an unknown certificate, a server without TLS) is named
            // with its cause: it is the operator's to fix, and retried like any unreachable
            // server meanwhile.
            let (client, connection) = pg
                .connect(crate::pg_tls::MakeRustls(config))
                .await
                .map_err(|e| match e.as_db_error() {
                    Some(_) => StoreError::from(e),
                    None => StoreError::Unavailable(error_chain(&e)),
                })?;
            (client, watch(connection))
        }
    };
    Ok((client, handle))
}

/// The first thing asked of a new connection: is the server a primary (a standby — a host of a
/// multi-host conninfo that is not the primary now, an old primary that came back as a
/// standby — is never used: `Unavailable`, and the caller tries again), and, as
/// `sync_standby` asks, does it commit synchronously to a standby.
async fn server_role(client: &Client, sync_standby: SyncStandby) -> Result<(), StoreError> {
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery(), current_setting('synchronous_standby_names'), \
             current_setting('synchronous_commit')",
            &[],
        )
        .await?;
    let (standby, names, commit): (bool, String, String) = (row.get(0), row.get(1), row.get(2));
    if standby {
        return Err(StoreError::Unavailable(
            "the server is a standby (in recovery), not the primary: not used".into(),
        ));
    }
    if sync_standby == SyncStandby::Ignore {
        return Ok(());
    }
    let missing = if names.trim().is_empty() {
        Some("synchronous_standby_names is empty".to_string())
    } else if matches!(commit.as_str(), "off" | "local") {
        Some(format!("synchronous_commit is {commit}"))
    } else {
        None
    };
    match (missing, sync_standby) {
        (None, _) => Ok(()),
        (Some(why), SyncStandby::Require) => Err(StoreError::Unavailable(format!(
            "the primary commits without a synchronous standby ({why}) and \
             require_sync_standby is set: not used"
        ))),
        (Some(why), _) => {
            tracing::warn!(
                "PostgreSQL commits without a synchronous standby ({why}): a commit it \
                 acknowledged can be lost when it fails over (require_sync_standby refuses such \
                 a primary)"
            );
            Ok(())
        }
    }
}

/// Runs a connection's I/O; its end is logged here, and callers see it through the client
/// (every call then fails `Unavailable`).
fn watch<F>(connection: F) -> JoinHandle<()>
where
    F: std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!("connection to PostgreSQL ended: {e}");
        }
    })
}

/// An error and its causes, one after the other.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl Statements {
    /// Statements `prepare` prepares, one round trip each.
    const COUNT: u32 = 6;
}

async fn prepare(client: &Client) -> Result<Statements, StoreError> {
    Ok(Statements {
        submit: client
            .prepare("SELECT * FROM spindle_submit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)")
            .await?,
        submit_leased: client
            .prepare(
                "SELECT * FROM spindle_submit_leased($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
                 $11, $12)",
            )
            .await?,
        // A claim's pool shard is the one it prefers; `spindle_pick_shards` moves demands whose
        // shard is full to another shard of their pool with room (`spindle_pick_shards`).
        submit_claim: client
            .prepare(
                "SELECT * FROM spindle_submit_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
                 $11, $12, $13, $14, $15, $16, $17, spindle_pick_shards($17, $18, $19), $19, $20)",
            )
            .await?,
        claim: client
            .prepare(
                "SELECT * FROM spindle_claim($1, $2, $3, $4, $5, $6, $7, $8, \
                 spindle_pick_shards($8, $9, $10), $10, $11)",
            )
            .await?,
        report: client
            .prepare("SELECT * FROM spindle_report($1, $2, $3, $4, $5, $6, $7, $8)")
            .await?,
        work: client
            .prepare(
                "SELECT * FROM spindle_work($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
                 $13, $14, $15, $16, $17, $18, $19)",
            )
            .await?,
        renew: client
            .prepare("SELECT * FROM spindle_renew($1, $2, $3)")
            .await?,
    })
}
