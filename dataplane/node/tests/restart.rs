//! kill -9 under load, then a restart on the same database: every acknowledged task is present
//! and completes exactly once; no attempt of the local provider ever ran twice.

mod common;

use common::{start_with, task};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{TaskId, TenantId};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_load_then_restart_completes_every_acked_task_exactly_once() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("executions.log");
    let config = format!(
        r#"
node_id = "restart-node"
listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
shards = 2
partitions = 8
local_provider_time_scale = 0.05
local_provider_log = "{}"

[[tenants]]
id = 1
credential = "one"

[[tenants]]
id = 2
credential = "two"
"#,
        log.display()
    );

    let mut daemon = start_with(&test, &config).await;
    let mut acked: Vec<TaskId> = Vec::new();
    for tenant in [1u32, 2] {
        let client = Client::connect(
            daemon.addr,
            TenantId(tenant),
            if tenant == 1 { "one" } else { "two" },
        )
        .await
        .unwrap();
        for b in 0..2 {
            let batch: Vec<_> = (0..30)
                .map(|i| task(&format!("t{tenant}-{b}-{i}")))
                .collect();
            for a in client.submit_batch(batch).await.unwrap() {
                assert!(a.decision.is_accepted(), "{a:?}");
                acked.push(a.task);
            }
        }
    }
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
