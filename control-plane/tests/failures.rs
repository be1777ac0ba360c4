//! Degradation: a batch whose backend is killed mid-transaction leaves no trace; a lost
//! connection or a stopped server is a typed `Unavailable`; a call whose answer is lost is
//! `InDoubt` and the rows tell what it did; the store reconnects by itself with backoff once
//! PostgreSQL is back.

mod common;

use common::{claim, setup, task, LEASE_MS, NODE};
use spindle_control::query::lost_claim;
use spindle_control::testing::TestDb;
use spindle_control::{
    ClaimRefusal, ClaimResult, Db, DbConfig, EmbeddedOptions, EmbeddedPostgres, StoreError,
};
use spindle_core::{FencingToken, PolicyVersion, TaskId, TaskState};

/// Waits until `pid`'s backend is blocked by `blocker`'s (bounded: a condition, not a sleep).
async fn wait_until_blocked(sql: &tokio_postgres::Client, pid: i32, blocker: i32) {
    for _ in 0..10_000 {
        let blocked: bool = sql
            .query_one("SELECT $2 = ANY (pg_blocking_pids($1))", &[&pid, &blocker])
            .await
            .unwrap()
            .get(0);
        if blocked {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("backend {pid} never blocked on {blocker}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_batch_killed_mid_transaction_leaves_no_trace() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 100, 1).await.unwrap();
    let batch: Vec<_> = (1..=20).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&batch, PolicyVersion(1)).await.unwrap();

    // Another session holds the highest task's row: the batch locks 1..19, then waits on 20.
    let mut holder = test.sql().await.unwrap();
    let tx = holder.transaction().await.unwrap();
    tx.execute("SELECT 1 FROM task WHERE task_id = 20 FOR UPDATE", &[])
        .await
        .unwrap();
    let holder_pid: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    let victim_pid = db.backend_pid().await.unwrap();
    let claims: Vec<_> = (1..=20)
        .map(|i| claim(i, 0, &[("provider:acme", 0, 1)]))
        .collect();
    let batch = tokio::spawn(async move {
        let r = db.claim_batch(NODE, LEASE_MS, &claims).await;
        (db, r)
    });
    let killer = test.sql().await.unwrap();
    wait_until_blocked(&killer, victim_pid, holder_pid).await;
    let killed: bool = killer
        .query_one("SELECT pg_terminate_backend($1)", &[&victim_pid])
        .await
        .unwrap()
        .get(0);
    assert!(killed);
    let (db, result) = batch.await.unwrap();
    let err = result.unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    let again = db.backend_pid().await.unwrap_err();
    assert!(
        again.is_unavailable(),
        "a dead connection stays unavailable: {again:?}"
    );
    tx.rollback().await.unwrap();

    // Nothing of the batch is visible: tasks QUEUED at version 0, no attempt, no reservation,
    // no event, the pool untouched.
    let sql = test.sql().await.unwrap();
    let row = sql
        .query_one(
            "SELECT (SELECT count(*) FROM task WHERE state = 'QUEUED' AND version = 0),
                    (SELECT count(*) FROM task_attempt),
                    (SELECT count(*) FROM resource_reservation),
                    (SELECT count(*) FROM outbox_event),
                    (SELECT used FROM resource_pool_shard WHERE pool_key = 'provider:acme')",
            &[],
        )
        .await
        .unwrap();
    let seen: (i64, i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    assert_eq!(seen, (20, 0, 0, 0, 0));

    // A new connection claims the same tasks normally.
    let db = test.open().await;
    let claims: Vec<_> = (1..=20)
        .map(|i| claim(i, 0, &[("provider:acme", 0, 1)]))
        .collect();
    let results = db.claim_batch(NODE, LEASE_MS, &claims).await.unwrap();
    assert!(results
        .iter()
        .all(|r| matches!(r, ClaimResult::Granted { .. })));
}

#[tokio::test]
async fn a_stopped_server_is_unavailable_and_the_store_reconnects_when_it_returns() {
    let mut pg = EmbeddedPostgres::start(EmbeddedOptions::default()).unwrap();
    let mut config = DbConfig::new(pg.conninfo("postgres"));
    config.backoff_initial_ms = 20;
    config.backoff_max_ms = 200;
    let db = Db::open(&config).await.unwrap();
    // The embedded default trades no durability for speed: only how new WAL segments are made
    // and when backends start writing their pages back differ from PostgreSQL's defaults.
    for (setting, expected) in [
        ("fsync", "on"),
        ("synchronous_commit", "on"),
        ("full_page_writes", "on"),
        ("wal_init_zero", "off"),
        ("backend_flush_after", "256kB"),
    ] {
        let row = db
            .client()
            .query_one(&format!("SHOW {setting}"), &[])
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), expected, "{setting}");
    }
    db.submit_batch(&[task(1, 1, "a")], PolicyVersion(1))
        .await
        .unwrap();

    pg.stop_server().unwrap();
    let err = db
        .submit_batch(&[task(2, 1, "b")], PolicyVersion(1))
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    assert!(err.is_retryable());
    let err = Db::open(&config)
        .await
        .err()
        .expect("no server, no connection");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");

    pg.start_server().unwrap();
    // The port may change on restart: the node re-reads its configuration.
    let config = DbConfig {
        conninfo: pg.conninfo("postgres"),
        ..config
    };
    let db = Db::open_with_backoff(&config).await.unwrap();
    let out = db
        .submit_batch(&[task(1, 1, "a"), task(2, 1, "b")], PolicyVersion(1))
        .await
        .unwrap();
    // Task 1 survived the restart (a replay); task 2 never committed before (created now).
    assert_eq!(
        out,
        vec![
            spindle_control::SubmitOutcome::Replay {
                task: spindle_core::TaskId(1),
                state: spindle_core::TaskState::Queued
            },
            spindle_control::SubmitOutcome::Created,
        ]
    );
}

#[tokio::test]
async fn every_session_runs_with_statement_and_idle_transaction_timeouts() {
    let test = TestDb::new().await;
    let mut config = test.config().clone();
    config.statement_timeout_ms = 1_234;
    config.idle_in_transaction_timeout_ms = 5_678;
    let db = Db::open(&config).await.unwrap();
    let show = |name: &'static str| {
        let client = db.client();
        async move {
            client
                .query_one(&format!("SHOW {name}"), &[])
                .await
                .unwrap()
                .get::<_, String>(0)
        }
    };
    assert_eq!(show("statement_timeout").await, "1234ms");
    assert_eq!(show("idle_in_transaction_session_timeout").await, "5678ms");
    // A statement past the timeout is refused, retryable, and the session stays usable.
    let err: StoreError = db
        .client()
        .query_one("SELECT pg_sleep(5)", &[])
        .await
        .unwrap_err()
        .into();
    assert!(
        matches!(&err, StoreError::Refused { code, retryable: true, .. } if code == "57014"),
        "{err:?}"
    );
    assert!(!db.is_closed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_answer_is_lost_is_in_doubt_and_its_rows_tell_what_it_did() {
    let (test, direct) = setup().await;
    direct.set_pool("provider:acme", 100, 1).await.unwrap();
    let proxy = spindle_control::testing::Proxy::start(&test.config().conninfo);
    let config = DbConfig::new(proxy.conninfo());
    let sql = test.sql().await.unwrap();

    // A submit commits, and its answer is lost on the way back.
    let db = Db::open(&config).await.unwrap();
    proxy.lose_answer_containing(b"CREATED");
    let submit = tokio::spawn(async move {
        let r = db
            .submit_batch(&[task(1, 1, "a"), task(2, 1, "b")], PolicyVersion(1))
            .await;
        (db, r)
    });
    proxy
        .wait_lost_and(&sql, "SELECT count(*) = 2 FROM task")
        .await;
    proxy.cut();
    let (_, result) = submit.await.unwrap();
    let err = result.unwrap_err();
    assert!(err.is_in_doubt(), "{err:?}");
    assert!(err.is_unavailable() && err.is_retryable());

    // A claim of task 1 commits, its answer lost too; task 2 is not claimed.
    let db = Db::open(&config).await.unwrap();
    proxy.lose_answer_containing(b"GRANTED");
    let claim_1 = tokio::spawn(async move {
        let r = db
            .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &[("provider:acme", 0, 1)])])
            .await;
        (db, r)
    });
    let claimed = "SELECT state = 'DISPATCHING' FROM task WHERE task_id = 1";
    proxy.wait_lost_and(&sql, claimed).await;
    assert_eq!(proxy.lost(), 2);
    proxy.cut();
    let (_, result) = claim_1.await.unwrap();
    assert!(result.unwrap_err().is_in_doubt());

    // The rows say what each call did: task 1 was granted to this node (its token is the
    // row's), task 2 was never claimed, task 3 does not exist; another node's view of task 1
    // is a row that moved.
    let db = Db::open(&config).await.unwrap();
    let tasks = [TaskId(1), TaskId(2), TaskId(3)];
    let heads = db.task_heads(&tasks).await.unwrap();
    let token: i64 = sql
        .query_one("SELECT current_fencing FROM task WHERE task_id = 1", &[])
        .await
        .unwrap()
        .get(0);
    match lost_claim(TaskId(1), heads[0].as_ref(), NODE, 0) {
        Some(ClaimResult::Granted {
            token: granted,
            attempt_no: 1,
            request_key,
            ..
        }) => {
            assert_eq!(granted, FencingToken(token as u64));
            assert_eq!(request_key, "spindle-1-1");
        }
        other => panic!("task 1: {other:?}"),
    }
    assert_eq!(lost_claim(TaskId(2), heads[1].as_ref(), NODE, 0), None);
    assert_eq!(
        lost_claim(TaskId(3), heads[2].as_ref(), NODE, 0),
        Some(ClaimResult::Refused(ClaimRefusal::TaskGone))
    );
    assert!(matches!(
        lost_claim(TaskId(1), heads[0].as_ref(), "node-b", 0),
        Some(ClaimResult::Refused(ClaimRefusal::VersionMoved {
            state: TaskState::Dispatching,
            version: 1
        }))
    ));
    // What was found is what a granted claim holds: the pool charged once.
    let used: i64 = sql
        .query_one(
            "SELECT used FROM resource_pool_shard WHERE pool_key = 'provider:acme'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(used, 1);
}

/// A fresh database with the provider pool and task 1 queued in it.
async fn one_task_queued() -> TestDb {
    let (test, direct) = setup().await;
    direct.set_pool("provider:acme", 100, 1).await.unwrap();
    direct
        .submit_batch(&[task(1, 1, "a")], PolicyVersion(1))
        .await
        .unwrap();
    test
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_gone_silent_is_given_up_after_the_answer_deadline() {
    let test = one_task_queued().await;
    let proxy = spindle_control::testing::Proxy::start(&test.config().conninfo);
    let mut config = DbConfig::new(proxy.conninfo());
    // Room for a commit's flush stalled under the other tests' load: the answer must come as
    // far as the proxy before the call gives up on it, or no answer is lost.
    config.statement_timeout_ms = 1000;
    config.answer_grace_ms = 500;
    let db = Db::open(&config).await.unwrap();
    // The answer is lost and the connection stays open (nothing cuts it): a dead peer that
    // never says so.
    proxy.lose_answer_containing(b"GRANTED");
    let started = std::time::Instant::now();
    let err = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &[("provider:acme", 0, 1)])])
        .await
        .unwrap_err();
    assert!(err.is_in_doubt(), "{err:?}");
    assert!(started.elapsed() >= std::time::Duration::from_millis(1500));
    assert_eq!(proxy.lost(), 1);
    // The connection is given up: later calls fail at once instead of waiting on it.
    assert!(db.is_closed());
    let read = db.task_heads(&[TaskId(1)]).await.unwrap_err();
    assert!(read.is_unavailable() && !read.is_in_doubt(), "{read:?}");
}

/// A sink that takes every batch (the relay below never gets that far).
struct TakeAll;

impl spindle_control::events::EventSink for TakeAll {
    type Error = String;
    async fn deliver(&mut self, _: &[spindle_control::events::Event]) -> Result<(), String> {
        Ok(())
    }
}

/// Opens a connection through a proxy that loses the first answer containing `$pattern` and
/// everything after it while the connection stays open (a server that stopped answering: TCP
/// keepalive cannot tell it from a live one), runs `$call` on it and checks that the call gives
/// up within its deadline — 300 ms per statement it may run, plus 1 s — as `Unavailable` or
/// `InDoubt`, leaving the connection given up. Without a deadline the call would wait forever;
/// the test's own bound (30 s) turns that into a failure. The second of grace leaves room for
/// the lost answer to come as far as the proxy even when a commit's flush stalls under the
/// other tests' load (this disk's flushes have stalled for over 300 ms; with 200 ms of grace
/// a call once gave up before its answer arrived, and no answer had been lost). A statement
/// the server itself cancels at its 300 ms timeout before the armed answer comes (a DELETE once
/// stalled that long) loses nothing; that try does not count, and the call is made again, at
/// most three times.
macro_rules! gives_up_on_silence {
    ($test:expr, $pattern:expr, |$db:ident| $call:expr) => {{
        let proxy = spindle_control::testing::Proxy::start(&$test.config().conninfo);
        let mut config = DbConfig::new(proxy.conninfo());
        config.statement_timeout_ms = 300;
        config.answer_grace_ms = 1000;
        #[allow(unused_mut)]
        let mut $db = Db::open(&config).await.unwrap();
        proxy.lose_answer_containing($pattern);
        let mut tries = 0;
        let err = loop {
            tries += 1;
            let result = tokio::time::timeout(std::time::Duration::from_secs(30), $call)
                .await
                .unwrap_or_else(|_| {
                    panic!("`{}` waited 30 s on a silent connection", stringify!($call))
                });
            let err = result.expect_err(stringify!($call));
            // The server cancelled the statement at its own timeout before the armed answer
            // came (a stall under the other tests' load): no answer was lost, so the case
            // under test did not happen yet; the pattern stays armed for the next try.
            let timed_out = matches!(&err, StoreError::Refused { code, .. } if code == "57014");
            if timed_out && proxy.lost() == 0 && tries < 3 {
                continue;
            }
            break err;
        };
        assert!(
            err.is_unavailable() || err.is_in_doubt(),
            "`{}`: {err:?}",
            stringify!($call)
        );
        assert_eq!(proxy.lost(), 1, "`{}` lost no answer", stringify!($call));
        assert!(
            $db.is_closed(),
            "`{}` left the connection open",
            stringify!($call)
        );
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_call_gives_up_on_a_silent_server_within_its_deadline() {
    use spindle_control::PartitionId;
    let test = one_task_queued().await;
    let parts = [PartitionId(0), PartitionId(1)];
    // Transactions of several statements: the event relay, an operator's requeue, the
    // counter rebuild; read snapshots: the counter check, the policy snapshot.
    gives_up_on_silence!(test, b"pg_try_advisory_xact_lock", |db| db
        .relay_events(&mut TakeAll, 100));
    gives_up_on_silence!(test, b"budget_reserved", |db| db.requeue_failed(
        &[TaskId(1)],
        &parts,
        "ops",
        "retry"
    ));
    gives_up_on_silence!(test, b"derived", |db| db.rebuild_counters());
    gives_up_on_silence!(test, b"derived", |db| db.check_counters());
    gives_up_on_silence!(test, b"body", |db| db.policy_snapshot());
    // Single statements of the node's start, stop and background work.
    gives_up_on_silence!(test, b"INSERT", |db| db.register_node(NODE, "127.0.0.1:1"));
    gives_up_on_silence!(test, b"UPDATE", |db| db.release_partitions(NODE));
    gives_up_on_silence!(test, b"attempt_provider", |db| db.lapsed_owned(
        &[spindle_control::PartitionId(0)],
        1_000,
        10
    ));
    gives_up_on_silence!(test, b"DELETE", |db| db.prune_events(
        std::time::Duration::ZERO,
        false,
        10
    ));
}

/// A server that accepts the connection and then stops answering — in the start-up exchange,
/// at the migrations' read of what is applied, at the prepares — fails `Db::open` as
/// unavailable within its deadline, instead of holding a node's start or a pipeline's
/// reconnect forever (the driver bounds only the socket's connect). Without the deadlines each
/// open waits past the test's own bound (30 s) and fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_a_connection_gives_up_on_a_silent_server_at_every_step() {
    let (test, _migrated) = setup().await;
    // What the first answer of each step carries: a parameter status after authentication,
    // the column list of `schema_migrations`, the first prepared statement's result columns.
    for pattern in [&b"server_version"[..], b"checksum", b"o_outcome"] {
        let step = String::from_utf8_lossy(pattern);
        let proxy = spindle_control::testing::Proxy::start(&test.config().conninfo);
        proxy.lose_answer_containing(pattern);
        let mut config = DbConfig::new(proxy.conninfo());
        config.connect_timeout_ms = 300;
        config.statement_timeout_ms = 300;
        config.answer_grace_ms = 200;
        let opened = tokio::time::timeout(std::time::Duration::from_secs(30), Db::open(&config))
            .await
            .unwrap_or_else(|_| panic!("open waited 30 s on a server silent at `{step}`"));
        match opened {
            Ok(_) => panic!("opened through a server silent at `{step}`"),
            Err(e) => assert!(
                e.is_unavailable() && !e.is_in_doubt(),
                "silent at `{step}`: {e:?}"
            ),
        }
        assert_eq!(proxy.lost(), 1, "no answer containing `{step}` was lost");
    }
}
