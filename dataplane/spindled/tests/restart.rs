//! kill -9 under load, then a restart on the same database: every acknowledged task is present
//! and completes exactly once; no attempt of the local provider ever ran twice.

mod common;

use common::{start_with, submit_accepted, task, NodeConfig};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::TenantId;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_load_then_restart_completes_every_acked_task_exactly_once() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("executions.log");
    let config = NodeConfig::new()
        .node_id("restart-node")
        .time_scale(0.05)
        .set_str("local_provider_log", &log.display().to_string())
        .toml();

    let mut daemon = start_with(&test, &config).await;
    let acked = submit_accepted(
        daemon.addr,
        &[(1, "tenant-1-credential"), (2, "tenant-2-credential")],
        2,
        30,
    )
    .await;
    // Killed while tasks are queued, claimed and running.
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    drop(daemon);

    let _restarted = start_with(&test, &config).await;
    let sql = test.sql().await.unwrap();
    let ids: Vec<i64> = acked.iter().map(|t| t.0 as i64).collect();
    let done = common::wait_all_succeeded(&sql, &ids).await;
    assert_eq!(
        done,
        ids.len() as i64,
        "every acked task completed after the restart"
    );

    // Exactly once per attempt: no (task, attempt) line twice; every task ran at least once.
    let ran = common::executed_once_per_attempt(&[&log]);
    let text = std::fs::read_to_string(&log).unwrap();
    for t in &acked {
        assert!(ran.contains(&t.0), "task {t} completed without running");
    }
    // Each task runs 1.5 s: the kill interrupted running attempts, which ran again as new ones.
    let rerun = text.lines().filter(|l| !l.ends_with(" 1")).count();
    assert!(
        rerun > 0,
        "the kill interrupted no running attempt:\n{text}"
    );
    let row = sql
        .query_one(
            "SELECT (SELECT count(*) FROM task),
                    (SELECT count(*) FROM resource_reservation WHERE status = 'ACTIVE'),
                    (SELECT coalesce(sum(used), 0)::bigint FROM resource_pool_shard)",
            &[],
        )
        .await
        .unwrap();
    let totals: (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(
        totals,
        (ids.len() as i64, 0, 0),
        "nothing extra, nothing held"
    );
}

/// A restart that finds stored tasks it cannot put back — one whose stored request is
/// unreadable, and every task of a tenant the new configuration no longer has — fails each of
/// them with the reason instead of refusing to start (which took every other tenant down with
/// them), and serves the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_fails_the_stored_tasks_it_cannot_put_back_and_serves_the_rest() {
    let test = TestDb::new().await;
    let config = |tenants: &[u32], scale: f64, concurrency: u64| {
        common::NodeConfig::new()
            .node_id("unrestorable-node")
            .tenants(tenants.iter().copied())
            .time_scale(scale)
            .set("provider_concurrency", concurrency)
            .toml()
    };
    // Slow jobs and two slots: most of the work is QUEUED when the node dies.
    let mut daemon = start_with(&test, &config(&[1, 2], 10.0, 2)).await;
    let mut acked = [Vec::new(), Vec::new()];
    for (i, (tenant, credential)) in [(1u32, "tenant-1-credential"), (2, "tenant-2-credential")]
        .into_iter()
        .enumerate()
    {
        let client = Client::connect(daemon.addr, TenantId(tenant), credential)
            .await
            .unwrap();
        let batch: Vec<_> = (0..10).map(|k| task(&format!("u{tenant}-{k}"))).collect();
        for a in client.submit_batch(batch).await.unwrap() {
            assert!(a.decision.is_accepted(), "{a:?}");
            acked[i].push(a.task.0 as i64);
        }
    }
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    drop(daemon);

    // One of tenant 1's queued tasks gets a stored request no node can read.
    let sql = test.sql().await.unwrap();
    let broken: i64 = sql
        .query_one(
            "UPDATE task SET payload = '\\x7b'::bytea WHERE task_id = (
                 SELECT max(task_id) FROM task WHERE tenant_id = 1 AND state = 'QUEUED')
             RETURNING task_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    // Restarted without tenant 2, with fast jobs.
    let restarted = start_with(&test, &config(&[1], 0.001, 100)).await;
    let served: Vec<i64> = acked[0].iter().copied().filter(|&t| t != broken).collect();
    assert_eq!(
        common::wait_all_succeeded(&sql, &served).await,
        served.len() as i64,
        "tenant 1's readable tasks completed after the restart"
    );
    let failed_query = |tasks: &[i64], like: &str| {
        let ids = tasks
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        format!(
            "SELECT count(*) FROM task WHERE task_id IN ({ids}) AND state = 'FAILED'
                AND failure_reason LIKE '{like}'"
        )
    };
    assert_eq!(
        common::wait_reading(
            &sql,
            &failed_query(&[broken], "not restorable: task % unreadable payload%"),
            1
        )
        .await,
        1,
        "the unreadable task failed, naming why"
    );
    assert_eq!(
        common::wait_reading(
            &sql,
            &failed_query(&acked[1], "not restorable: task %: tenant 2 has no policy"),
            10
        )
        .await,
        10,
        "every task of the tenant that left the configuration failed, naming why"
    );
    let dead: i64 = sql
        .query_one(
            "SELECT count(*) FROM dead_letter WHERE failure_reason LIKE 'not restorable:%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(dead, 11, "the failed tasks are in the dead letter view");
    assert_eq!(
        common::metric(&restarted, "spindle_restore_failed_total").await,
        11
    );
    let (reservations, used, _) = common::mock::held(&sql).await;
    assert_eq!((reservations, used), (0, 0), "nothing held");

    // And the node serves new work.
    let client = Client::connect(restarted.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = client.submit(task("after")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
    common::wait_for(&client, a.task, spindle_core::TaskState::Succeeded).await;
}

/// A queued task keeps its deadline across a restart: counted from its submission, so a task
/// whose deadline passed while its node was down is expired, durably, by the node that puts
/// it back — not run (restored tasks used to come back without a deadline). Another tenant's
/// long tasks hold every provider slot until the kill, so that the task is still queued then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_tasks_deadline_survives_a_restart_and_it_expires_unrun() {
    use spindle_core::TaskState;
    let test = TestDb::new().await;
    // One slot per provider account, and long tasks that hold them for the length of the test.
    let config = &common::config_scaled("10.0", "provider_concurrency = 1");
    let mut daemon = start_with(&test, config).await;
    let busy = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut long = Vec::new();
    for i in 0..8 {
        let a = busy.submit(task(&format!("long{i}"))).await.unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
        long.push(a.task);
    }
    common::wait_for(&busy, long[0], TaskState::Running).await;
    let client = Client::connect(daemon.addr, TenantId(2), "tenant-2-credential")
        .await
        .unwrap();
    let mut waiting = task("waiting");
    waiting.deadline_ms = Some(2_000);
    let waiting = client.submit(waiting).await.unwrap();
    assert!(waiting.decision.is_accepted(), "{waiting:?}");
    let submitted = std::time::Instant::now();
    assert_eq!(
        client.get(waiting.task).await.unwrap().state,
        TaskState::Queued
    );
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    drop(daemon);
    assert!(
        submitted.elapsed() < std::time::Duration::from_millis(2_000),
        "the node was killed after the deadline: nothing shown"
    );
    // Not a wait for an event: the deadline must have passed while the node was down.
    tokio::time::sleep_until((submitted + std::time::Duration::from_millis(2_500)).into()).await;

    let restarted = start_with(&test, config).await;
    let sql = test.sql().await.unwrap();
    let key = waiting.task.0 as i64;
    let state = common::poll_until(
        std::time::Duration::from_secs(30),
        async || common::mock::state_of(&sql, key).await,
        |s| s == "EXPIRED",
    )
    .await;
    assert_eq!(state, "EXPIRED", "{}", restarted.log_tail(20));
    let row = sql
        .query_one(
            "SELECT attempt_no, failure_reason FROM task WHERE task_id = $1",
            &[&key],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, i32>(0),
        0,
        "a task past its deadline never started"
    );
    assert_eq!(
        row.get::<_, Option<String>>(1).as_deref(),
        Some("its deadline passed before it started"),
        "expired with the reason"
    );
}
