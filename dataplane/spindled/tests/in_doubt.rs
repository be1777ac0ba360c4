//! Calls whose answer is lost: PostgreSQL commits a submit or a claim, and the connection
//! breaks before the node hears so. The node reads the rows back instead of taking "no answer"
//! for "not committed": an acknowledged task is never left unserved in PostgreSQL, and a claimed
//! one runs, once.

mod common;

use common::{
    accepted_ids, executed_once_per_attempt, metric, poll_until, start_on, task,
    wait_all_succeeded, wait_for, CONFIG,
};
use spindle_client::Client;
use spindle_control::testing::{Proxy, TestDb};
use spindle_core::{Decision, TaskState, TenantId};

/// Once the armed answer was lost and `committed` holds, breaks every connection through the proxy.
async fn lose_one_then_cut(proxy: &Proxy, sql: &tokio_postgres::Client, committed: &str) {
    proxy.wait_lost_and(sql, committed).await;
    proxy.cut();
}

/// A node (with `config`) whose every connection to PostgreSQL goes through a proxy, a direct
/// connection for assertions, and tenant 1's client.
struct Rig {
    /// Kept to the end of the test (a private server, when there is no shared one).
    _test: TestDb,
    proxy: Proxy,
    daemon: common::Daemon,
    sql: tokio_postgres::Client,
    client: Client,
}

/// `CONFIG` with top-level `keys` added (before its tenant tables).
fn with_keys(keys: &str) -> String {
    CONFIG.replacen("[[tenants]]", &format!("{keys}\n\n[[tenants]]"), 1)
}

/// [`rig`] with `keys` and the local provider's execution log (its file, and the directory to
/// keep until the end of the test).
async fn rig_logging(keys: &str) -> (Rig, tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("executions.log");
    let config = with_keys(&format!(
        "{keys}\nlocal_provider_log = \"{}\"",
        log.display()
    ));
    (rig(&config).await, dir, log)
}

/// Submits 8 tasks (keys `prefix`0…7) while the next answer holding `pattern` is lost, then
/// cuts every connection once a task is DISPATCHING; the ids the client was told.
async fn submit_losing(rig: &Rig, pattern: &[u8], prefix: &str) -> Vec<i64> {
    rig.proxy.lose_answer_containing(pattern);
    let batch: Vec<_> = (0..8).map(|i| task(&format!("{prefix}{i}"))).collect();
    let claimed = "SELECT count(*) > 0 FROM task WHERE state = 'DISPATCHING'";
    let (answers, ()) = tokio::join!(
        rig.client.submit_batch(batch),
        lose_one_then_cut(&rig.proxy, &rig.sql, claimed)
    );
    accepted_ids(answers)
}

async fn rig(config: &str) -> Rig {
    let test = TestDb::new().await;
    let proxy = Proxy::start(&test.config().conninfo);
    let daemon = start_on(proxy.conninfo(), config).await;
    let sql = test.sql().await.unwrap();
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    Rig {
        _test: test,
        proxy,
        daemon,
        sql,
        client,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_whose_answer_is_lost_is_read_back_acknowledged_and_run() {
    let Rig {
        _test,
        proxy,
        daemon,
        sql,
        client,
    } = rig(CONFIG).await;
    let warm = client.submit(task("warm")).await.unwrap();
    wait_for(&client, warm.task, TaskState::Succeeded).await;

    // The submit commits; its answer goes nowhere, then every connection breaks.
    proxy.lose_answer_containing(b"CREATED");
    let made = "SELECT count(*) = 1 FROM task WHERE idempotency_key = 'doubt'";
    let (answer, ()) = tokio::join!(
        client.submit(task("doubt")),
        lose_one_then_cut(&proxy, &sql, made)
    );
    // Read back, not refused: the task is PostgreSQL's, so it is acknowledged and runs.
    let a = answer.unwrap();
    assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    assert!(!a.replay);
    wait_for(&client, a.task, TaskState::Succeeded).await;
    let again = client.submit(task("doubt")).await.unwrap();
    assert!(again.replay && again.task == a.task, "{again:?}");
    assert_eq!(metric(&daemon, "spindle_calls_in_doubt_total").await, 1);
}

/// Room for two tasks at a time at the provider: of a batch of eight, the first start with
/// their submit (their claims taken in its transaction) and the rest are claimed after it, as
/// room frees — the claims these tests lose.
const TWO_AT_A_TIME: &str = "provider_concurrency = 2";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_submit_whose_answer_is_lost_is_read_back_and_its_tasks_run_once() {
    let (rig, _dir, log) = rig_logging("").await;
    // The submit commits with its tasks claimed (their rows DISPATCHING); its answer goes
    // nowhere, then every connection breaks.
    let ids = submit_losing(&rig, b"DISPATCHING", "d").await;
    assert_eq!(ids.len(), 8, "read back and acknowledged, not refused");
    // The rows tell the node the claims were taken: each task runs its first attempt, once.
    assert_each_ran_once(&rig.sql, &ids, &log).await;
    assert_eq!(metric(&rig.daemon, "spindle_calls_in_doubt_total").await, 1);
}

/// Every task ends SUCCEEDED on its first attempt, each attempt executed once (the local
/// provider's `log`), and the provider pools hold nothing afterwards.
async fn assert_each_ran_once(sql: &tokio_postgres::Client, ids: &[i64], log: &std::path::Path) {
    assert_eq!(wait_all_succeeded(sql, ids).await, ids.len() as i64);
    let ran = executed_once_per_attempt(&[log]);
    assert_eq!(ran.len(), ids.len());
    let row = sql
        .query_one(
            "SELECT max(attempt_no),
                    (SELECT coalesce(sum(used), 0)::bigint FROM resource_pool_shard)
               FROM task",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i32>(0), row.get::<_, i64>(1)), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_answer_is_lost_is_read_back_and_its_task_runs_once() {
    let (rig, _dir, log) = rig_logging(TWO_AT_A_TIME).await;
    // A claim made after the submit commits unheard; then every connection breaks.
    let ids = submit_losing(&rig, b"GRANTED", "c").await;
    assert_each_ran_once(&rig.sql, &ids, &log).await;
    assert_in_doubt(&rig.daemon).await;
}

/// The lost call was taken as in doubt. Claims sent one after another are merged into one call
/// when they wait for the connection together, and each message of a call in doubt counts: one
/// lost answer may count more than once.
async fn assert_in_doubt(daemon: &common::Daemon) {
    let in_doubt = metric(daemon, "spindle_calls_in_doubt_total").await;
    assert!(in_doubt >= 1, "{in_doubt} calls in doubt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_connection_goes_silent_is_given_up_and_read_back() {
    // The answer is lost and nothing breaks the connection (a dead peer that never says so):
    // after the statement timeout and the grace the node gives the connection up by itself.
    let config = with_keys(&format!(
        "{TWO_AT_A_TIME}\npostgres_statement_timeout_ms = 1000\npostgres_answer_grace_ms = 500"
    ));
    let Rig {
        _test,
        proxy,
        daemon,
        sql,
        client,
    } = rig(&config).await;
    proxy.lose_answer_containing(b"GRANTED");
    let batch: Vec<_> = (0..8).map(|i| task(&format!("s{i}"))).collect();
    let ids = accepted_ids(client.submit_batch(batch).await);
    assert_eq!(wait_all_succeeded(&sql, &ids).await, ids.len() as i64);
    assert_eq!(proxy.lost(), 1);
    assert_in_doubt(&daemon).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_whose_answer_is_lost_still_counts_as_succeeded() {
    let Rig {
        _test,
        proxy,
        daemon,
        sql,
        client,
    } = rig(CONFIG).await;
    // The task's one (folded) report ends it SUCCEEDED; its answer is lost, and its repeat is
    // refused as stale: the task is SUCCEEDED all the same, and counted so.
    proxy.lose_answer_containing(b"SUCCEEDED");
    let a = client.submit(task("fin")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
    let done = format!(
        "SELECT state = 'SUCCEEDED' FROM task WHERE task_id = {}",
        a.task.0
    );
    lose_one_then_cut(&proxy, &sql, &done).await;
    let counted = poll_until(
        std::time::Duration::from_secs(20),
        async || metric(&daemon, "spindle_tasks_succeeded_total").await,
        |&counted| counted == 1,
    )
    .await;
    assert_eq!(counted, 1, "the committed success is counted once");
}
