//! SIGTERM: the node stops admitting and dispatching, lets running work finish within the
//! drain window, gives its partitions back and exits; queued work stays QUEUED for the next
//! owner.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{poll_until, read_i64, start_with, task, NodeConfig};
use spindle_client::{Client, ClientError};
use spindle_control::testing::TestDb;
use spindle_core::TenantId;
use spindle_wire::ErrorCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_running_work_and_releases_partitions() {
    let test = TestDb::new().await;
    // Tasks run 1.5 s; the lane runs 4 at a time, so most of 20 wait in the queue.
    let config = NodeConfig::new()
        .node_id("drain-node")
        .shards(1)
        .partitions(4)
        .time_scale(0.05)
        .tenants([1])
        .set("lane_capacity_units", 4)
        .set("drain_ms", 20_000)
        .toml();
    let mut daemon = start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let batch: Vec<_> = (0..20).map(|i| task(&format!("d{i}"))).collect();
    for a in client.submit_batch(batch).await.unwrap() {
        assert!(a.decision.is_accepted(), "{a:?}");
    }
    // Wait (bounded) until some work runs.
    let sql = test.sql().await.unwrap();
    let running = poll_until(
        Duration::from_secs(10),
        async || read_i64(&sql, "SELECT count(*) FROM task WHERE state = 'RUNNING'").await,
        |&running| running > 0,
    )
    .await;
    assert!(running > 0, "no work ran in 10 s");
    let pid = daemon.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());

    // While draining, new work is refused with a reason. (Submits that land before the signal
    // is handled are accepted as usual: they are counted.)
    let mut accepted_late = 0;
    let refused = poll_until(
        Duration::from_secs(10),
        async || match client.submit(task(&format!("late{accepted_late}"))).await {
            Err(ClientError::Refused(e)) if e.code == ErrorCode::Draining => true,
            Ok(a) if a.decision.is_accepted() => {
                accepted_late += 1;
                false
            }
            other => panic!("unexpected answer while stopping: {other:?}"),
        },
        |&refused| refused,
    )
    .await;
    assert!(refused, "submits during the drain are refused as Draining");

    let status = tokio::task::spawn_blocking(move || daemon.child.wait().unwrap())
        .await
        .unwrap();
    assert!(
        status.success(),
        "spindled exits cleanly after draining: {status}"
    );
    let row = sql
        .query_one(
            "SELECT count(*) FILTER (WHERE state = 'SUCCEEDED'),
                    count(*) FILTER (WHERE state = 'QUEUED'),
                    count(*) FILTER (WHERE state NOT IN ('SUCCEEDED', 'QUEUED')),
                    (SELECT count(*) FROM partition_lease WHERE owner_node IS NOT NULL),
                    (SELECT count(*) FROM resource_reservation WHERE status = 'ACTIVE')
               FROM task",
            &[],
        )
        .await
        .unwrap();
    let (done, queued, other, leased, active): (i64, i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    assert!(done >= 1, "running work finished: {done}");
    assert_eq!(
        done + queued,
        20 + accepted_late,
        "every task either finished or still queued ({other} other)"
    );
    assert_eq!(other, 0);
    assert_eq!(leased, 0, "partitions given back");
    assert_eq!(active, 0, "nothing holds a reservation");
}
