//! The overload gate on a real node and a real PostgreSQL: a store slowed on purpose (another
//! session holds a lock every submit needs) makes the node refuse new submits at once, with a
//! `retry_after_ms` hint, instead of queueing them; what it had accepted is never refused later
//! and completes once the store recovers; and acceptance resumes by itself.

mod common;

use std::time::{Duration, Instant};

use common::{config_scaled, metric_sum, poll_until, start_with, task, wait_for};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{Decision, TaskState, TenantId};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_store_is_met_with_fast_refusals_and_acceptance_resumes_by_itself() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, &config_scaled("0.0001", "ack_budget_ms = 200")).await;
    let client = std::sync::Arc::new(
        Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
            .await
            .unwrap(),
    );
    let first = client.submit(task("before")).await.unwrap();
    assert!(first.decision.is_accepted(), "{first:?}");
    wait_for(&client, first.task, TaskState::Succeeded).await;

    // The SDK's virtualenv made before the lock is taken: a clean clone makes it on first use
    // (pip, seconds), and the lock must be released before the node's `lock_timeout` (5 s)
    // turns the admitted frames' waiting call into a refusal.
    common::python::sdk_python();
    // Another session holds the task table against inserts: every submit call now waits.
    let sql = test.sql().await.unwrap();
    sql.batch_execute("BEGIN; LOCK TABLE task IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let held = Instant::now();

    // Frames sent one after another: the first ones are admitted and wait behind the stalled
    // call; once the call has run past what the gate allows, the rest are refused.
    let mut waiting = Vec::new();
    let mut refusal = None;
    for i in 0..2_000 {
        let c = client.clone();
        let mut answer =
            tokio::spawn(async move { c.submit(task(&format!("during-{i}"))).await.unwrap() });
        // An answer within 100 ms is a refusal (nothing can commit while the lock is held);
        // a frame still unanswered then was admitted and waits for the store.
        match tokio::time::timeout(Duration::from_millis(100), &mut answer).await {
            Ok(a) => {
                refusal = Some(a.unwrap());
                break;
            }
            Err(_) => waiting.push(answer),
        }
    }
    let refused = refusal.expect("no submit was refused while the store was stalled");
    assert!(
        held.elapsed() < Duration::from_secs(4),
        "the refusal came only after {:?}: the stalled call gave up first",
        held.elapsed()
    );
    assert_eq!(
        refused.decision,
        Decision::RejectPlatformOverloaded,
        "{refused:?}"
    );
    assert!(refused.retry_after_ms > 0, "a hint: {refused:?}");
    assert!(
        refused.retry_after().unwrap() <= Duration::from_secs(10),
        "{refused:?}"
    );
    let reason = refused.reason.clone().unwrap_or_default();
    assert!(reason.contains("budget"), "{reason}");
    // Refused while the lock is still held: the refusal never waited on PostgreSQL.
    let locks: i64 = sql
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE relation = 'task'::regclass \
             AND mode = 'ExclusiveLock' AND granted",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(locks, 1, "the lock is still held");
    let (_, metrics) = common::http_get(daemon.http, "/metrics").await;
    assert!(
        metric_sum(&metrics, "spindle_overload_refused_total") > 0,
        "counted"
    );
    // The Python SDK reads the refusal and its hint alike, blocking and on asyncio.
    let lines = python(daemon.addr, "refused", "py-refused");
    assert!(
        lines[0].starts_with("blocking: refused, retry after "),
        "{lines:?}"
    );
    assert!(
        lines[1].starts_with("asyncio: refused, retry after "),
        "{lines:?}"
    );

    // The store recovers: what was admitted is acknowledged as accepted — never refused
    // afterwards — and runs.
    let stalled_for = held.elapsed();
    sql.batch_execute("ROLLBACK").await.unwrap();
    assert!(!waiting.is_empty(), "the first frames were admitted");
    for answer in waiting {
        let a = answer.await.unwrap();
        assert!(
            a.decision.is_accepted(),
            "an admitted task was refused (the store stalled for {stalled_for:?}; the node's \
             lock_timeout is 5 s): {a:?}"
        );
        wait_for(&client, a.task, TaskState::Succeeded).await;
    }
    // Acceptance resumes by itself (bounded wait).
    let mut tries = 0;
    let accepted = poll_until(
        Duration::from_secs(30),
        async || {
            tries += 1;
            client
                .submit(task(&format!("after-{tries}")))
                .await
                .unwrap()
        },
        |a| a.decision.is_accepted(),
    )
    .await;
    assert!(accepted.decision.is_accepted(), "30 s: {accepted:?}");
    wait_for(&client, accepted.task, TaskState::Succeeded).await;
    // The Python SDK's submit that honours the hint gets its task in (both clients).
    let lines = python(daemon.addr, "retrying", "py-retried");
    assert!(
        lines[0].starts_with("blocking: accepted task "),
        "{lines:?}"
    );
    assert!(lines[1].starts_with("asyncio: accepted task "), "{lines:?}");
}

/// `clients/python/tests/check_overload.py`, run by the installed SDK, against `addr` as
/// tenant 1 in `mode` with `key`: its two lines (blocking, asyncio), after asserting that it
/// succeeded.
fn python(addr: std::net::SocketAddr, mode: &str, key: &str) -> Vec<String> {
    let out = common::python::script("check_overload.py")
        .args([
            &addr.ip().to_string(),
            &addr.port().to_string(),
            "1",
            "tenant-1-credential",
        ])
        .args([mode, key])
        .output()
        .expect("the SDK's python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    let lines: Vec<String> = stdout.lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 2, "{stdout}{stderr}");
    lines
}
