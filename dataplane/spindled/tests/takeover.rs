//! Two nodes on one PostgreSQL. The first owns every partition; the second refuses its
//! tenants, naming the owner (a cluster client follows it there, and fails over to the second
//! once the first dies). After the first is killed (-9) under load, the second takes the
//! partitions over once their leases expire and completes every acknowledged task, no attempt
//! executed twice across the two nodes — also when the two are killed in turn, round after
//! round.

mod common;

use std::time::Duration;

use common::{poll_until, start_with, task, NodeConfig};
use spindle_client::{Client, ClientError, ClusterClient};
use spindle_control::testing::TestDb;
use spindle_core::TenantId;
use spindle_wire::ErrorCode;

fn config(node: &str, log: &std::path::Path) -> String {
    NodeConfig::new()
        .node_id(node)
        .time_scale(0.05)
        .set("lease_ms", 1500)
        .set_str("local_provider_log", &log.display().to_string())
        .toml()
}

/// A client of `tenant` on `node` once the node serves the tenant's partition (bounded: 20 s),
/// after answers that name another node.
async fn once_served(node: &common::Daemon, tenant: u32, credential: &str) -> Client {
    let answer = poll_until(
        Duration::from_secs(20),
        async || Client::connect(node.addr, TenantId(tenant), credential).await,
        |r| !matches!(r, Err(ClientError::Refused(e)) if e.code == ErrorCode::WrongNode),
    )
    .await;
    answer.unwrap_or_else(|e| panic!("tenant {tenant}'s partition never served there: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_takes_over_after_the_first_dies_and_completes_every_acked_task() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (log_a, log_b) = (dir.path().join("a.log"), dir.path().join("b.log"));
    let mut a = start_with(&test, &config("node-a", &log_a)).await;
    let b = start_with(&test, &config("node-b", &log_b)).await;

    // B owns nothing while A lives: it sends tenants to A.
    match Client::connect(b.addr, TenantId(1), "tenant-1-credential").await {
        Err(ClientError::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::WrongNode, "{e:?}");
            assert!(
                e.message.contains(&format!("node node-a at {}", a.addr)),
                "{e:?}"
            );
            assert_eq!(e.redirect, Some(a.addr.to_string()), "{e:?}");
        }
        other => panic!("node B served a tenant of node A: {:?}", other.map(|_| ())),
    }
    // A client of the cluster that asks B is sent on to A, and served there.
    let through_b =
        Client::connect_cluster(&b.addr.to_string(), TenantId(1), "tenant-1-credential")
            .await
            .unwrap();
    assert_eq!(through_b.hello().node_id, "node-a");
    let through_b_task = through_b.submit(task("through-b")).await.unwrap().task;
    drop(through_b);
    // B counted both refusals (the plain client's and the cluster client's first Hello).
    assert_eq!(common::metric(&b, "spindle_wrong_node_total").await, 2);

    // A cluster client (seeds A and B) is served by A until A dies.
    let seeds = [a.addr.to_string(), b.addr.to_string()];
    let cluster = ClusterClient::connect(&seeds, TenantId(2), "tenant-2-credential")
        .await
        .unwrap();
    assert_eq!(cluster.client().await.unwrap().hello().node_id, "node-a");
    let before_kill = cluster.submit(task("cluster-before")).await.unwrap();

    let mut acked = common::submit_accepted(
        a.addr,
        &[(1, "tenant-1-credential"), (2, "tenant-2-credential")],
        2,
        30,
    )
    .await;
    acked.extend([through_b_task, before_kill.task]);
    a.child.kill().unwrap();
    a.child.wait().unwrap();

    // Its next submit fails over to B once B holds the partition (A refuses connections, B
    // sends it to A until A's lease lapses), within the client's failover window.
    let after_kill = cluster.submit(task("cluster-after")).await.unwrap();
    assert!(after_kill.decision.is_accepted(), "{after_kill:?}");
    assert_eq!(cluster.client().await.unwrap().hello().node_id, "node-b");
    assert_eq!(cluster.failovers(), 1);
    // The submit from before the kill, sent again with its key, is a replay of the same task.
    let again = cluster.submit(task("cluster-before")).await.unwrap();
    assert_eq!((again.task, again.replay), (before_kill.task, true));
    acked.push(after_kill.task);

    // B serves tenant 1 once it holds its partition: the lease (1.5 s) must lapse first.
    let client = once_served(&b, 1, "tenant-1-credential").await;
    // And it takes new work for it.
    let fresh = client.submit(task("after-takeover")).await.unwrap();
    assert!(fresh.decision.is_accepted(), "{fresh:?}");
    acked.push(fresh.task);

    let sql = test.sql().await.unwrap();
    let ids: Vec<i64> = acked.iter().map(|t| t.0 as i64).collect();
    let done = common::wait_all_succeeded(&sql, &ids).await;
    assert_eq!(
        done,
        ids.len() as i64,
        "every acked task completed on node B"
    );
    let owners: Vec<String> = sql
        .query("SELECT DISTINCT owner_node FROM partition_lease", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(owners, vec!["node-b".to_string()]);

    // Exactly once per attempt across both nodes; every task ran.
    let ran = common::executed_once_per_attempt(&[&log_a, &log_b]);
    for t in &acked {
        assert!(ran.contains(&t.0), "task {t} completed without running");
    }
    let on_b = std::fs::read_to_string(&log_b).unwrap_or_default();
    assert!(
        on_b.lines().count() > 1,
        "node B ran only the new task: the takeover restored nothing"
    );
    let held = common::active_reservations(&sql).await;
    assert_eq!(held, 0, "nothing held after the last completion");
    drop(b);
}

/// A cluster client's subscription follows the takeover: subscribed on A to a task A runs, it
/// receives the task's end from B after A is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_clients_subscription_follows_the_takeover() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    // Tasks run 3 s at the provider: the one watched is still running when A dies.
    let slow = |node: &str, log: &std::path::Path| {
        config(node, log).replace(
            "local_provider_time_scale = 0.05",
            "local_provider_time_scale = 0.1",
        )
    };
    let mut a = start_with(&test, &slow("node-a", &dir.path().join("a.log"))).await;
    let b = start_with(&test, &slow("node-b", &dir.path().join("b.log"))).await;
    let seeds = [a.addr.to_string(), b.addr.to_string()];
    let cluster = ClusterClient::connect(&seeds, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let watched = cluster.submit(task("watched")).await.unwrap().task;
    cluster.subscribe(watched).await.unwrap();
    let first = cluster.next_event().await.unwrap();
    assert_eq!(first.task, watched);
    assert!(!first.state.is_terminal(), "{first:?}");
    a.child.kill().unwrap();
    a.child.wait().unwrap();

    let end = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let e = cluster.next_event().await.unwrap();
            if e.task == watched && e.state.is_terminal() {
                return e;
            }
        }
    })
    .await
    .expect("the watched task's end within a minute of the kill");
    assert_eq!(end.state, spindle_core::TaskState::Succeeded, "{end:?}");
    assert_eq!(cluster.failovers(), 1);
    assert_eq!(cluster.client().await.unwrap().hello().node_id, "node-b");
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_into_a_partition_whose_lease_moved_is_refused_and_not_written() {
    let test = TestDb::new().await;
    let daemon = common::start(&test).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let before = client.submit(task("before")).await.unwrap();
    assert!(before.decision.is_accepted(), "{before:?}");
    // Tenant 1's partition moves to another node behind this one's back (as when this node's
    // lease lapsed while it could not reach PostgreSQL), before its next renewal (every 10 s).
    let sql = test.sql().await.unwrap();
    sql.batch_execute(
        "INSERT INTO node (node_id) VALUES ('other');
         UPDATE partition_lease SET owner_node = 'other', epoch = epoch + 1,
                lease_until = now() + interval '1 hour'
          WHERE partition = 1 % (SELECT count(*) FROM partition_lease)",
    )
    .await
    .unwrap();
    let after = client.submit(task("after")).await.unwrap();
    assert_eq!(
        after.decision,
        spindle_core::Decision::RejectPlatformOverloaded,
        "{after:?}"
    );
    assert!(
        after
            .reason
            .unwrap_or_default()
            .contains("not leased to this node"),
        "the reason names the lease"
    );
    let written: i64 = sql
        .query_one(
            "SELECT count(*) FROM task WHERE idempotency_key = 'after'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        written, 0,
        "nothing written into the other node's partition"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_refused_while_the_nodes_own_lease_lapsed_wait_for_its_renewal() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("executions.log");
    // One provider slot and short tasks: claims keep coming, one at a time.
    let config = NodeConfig::new()
        .node_id("lapse-node")
        .shards(1)
        .time_scale(0.005)
        .tenants([1])
        .set("lease_ms", 1500)
        .set("provider_concurrency", 1)
        .set_str("local_provider_log", &log.display().to_string())
        .toml();
    let daemon = start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let batch: Vec<_> = (0..20).map(|i| task(&format!("l{i}"))).collect();
    let ids = common::accepted_ids(client.submit_batch(batch).await);
    // The node's leases lapse (as when PostgreSQL was out of its reach past `lease_ms`) and
    // nobody takes them: kept lapsed until a claim was refused for it.
    let sql = test.sql().await.unwrap();
    let refused = poll_until(
        Duration::from_secs(20),
        async || {
            sql.execute(
                "UPDATE partition_lease SET lease_until = now() - interval '1 second'
                  WHERE owner_node = 'lapse-node'",
                &[],
            )
            .await
            .unwrap();
            common::metric(&daemon, "spindle_claims_total{result=\"refused\"}").await
        },
        |&refused| refused > 0,
    )
    .await;
    assert!(
        refused > 0,
        "no claim was refused while the lease was lapsed"
    );
    // The next renewal takes the leases back: the refused claims go again, nothing is dropped.
    assert_eq!(
        common::wait_all_succeeded(&sql, &ids).await,
        ids.len() as i64
    );
    let ran = common::executed_once_per_attempt(&[log.as_path()]);
    assert_eq!(ran.len(), ids.len());
}

/// A takeover that finds a stored task it cannot read fails that task with the reason and
/// serves the partition. (It failed the whole takeover instead, every round: the partition's
/// other tasks waited unserved for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_fails_a_task_it_cannot_read_and_serves_the_partition() {
    let test = TestDb::new().await;
    let node = |name: &str, scale: f64, concurrency: u64| {
        NodeConfig::new()
            .node_id(name)
            .time_scale(scale)
            .tenants([1])
            .set("lease_ms", 1500)
            .set("provider_concurrency", concurrency)
            .toml()
    };
    // Slow jobs and two slots on A: most of its work stays QUEUED.
    let mut a = start_with(&test, &node("node-a", 10.0, 2)).await;
    let b = start_with(&test, &node("node-b", 0.001, 100)).await;
    let client = Client::connect(a.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let batch: Vec<_> = (0..10).map(|k| task(&format!("r-{k}"))).collect();
    let mut acked: Vec<i64> = Vec::new();
    for adm in client.submit_batch(batch).await.unwrap() {
        assert!(adm.decision.is_accepted(), "{adm:?}");
        acked.push(adm.task.0 as i64);
    }
    // The newest queued task (the last A would start) gets a stored request nobody can read;
    // A keeps its own copy in memory, B reads the row when it takes the partition over.
    let sql = test.sql().await.unwrap();
    let broken: i64 = sql
        .query_one(
            "UPDATE task SET payload = '\\x7b'::bytea WHERE task_id = (
                 SELECT max(task_id) FROM task WHERE state = 'QUEUED')
             RETURNING task_id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    a.child.kill().unwrap();
    a.child.wait().unwrap();

    let client = once_served(&b, 1, "tenant-1-credential").await;
    let rest: Vec<i64> = acked.iter().copied().filter(|&t| t != broken).collect();
    assert_eq!(
        common::wait_all_succeeded(&sql, &rest).await,
        rest.len() as i64,
        "the readable tasks completed on node B"
    );
    // Its failure goes with the shard's reports: waited for until committed.
    let failed = format!("SELECT count(*) FROM task WHERE task_id = {broken} AND state = 'FAILED'");
    assert_eq!(
        common::wait_reading(&sql, &failed, 1).await,
        1,
        "the task failed"
    );
    let reason: Option<String> = sql
        .query_one(
            "SELECT failure_reason FROM task WHERE task_id = $1",
            &[&broken],
        )
        .await
        .unwrap()
        .get(0);
    let reason = reason.expect("with a reason");
    assert!(
        reason.starts_with("not restorable: ") && reason.contains("unreadable payload"),
        "{reason}"
    );
    assert_eq!(common::metric(&b, "spindle_restore_failed_total").await, 1);
    let fresh = client.submit(task("after")).await.unwrap();
    assert!(fresh.decision.is_accepted(), "{fresh:?}");
    common::wait_for(&client, fresh.task, spindle_core::TaskState::Succeeded).await;
}

/// Two nodes, killed in turn: each round the node that serves the tenants is killed (-9) under
/// load, the other takes the partitions over once their leases lapse, and the killed one is
/// started again (serving nothing until the next round). After three rounds every acknowledged
/// task completed, no attempt ran twice across the nodes, nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_killed_in_turn_lose_no_acknowledged_task() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let names = ["node-a", "node-b"];
    let logs = [dir.path().join("a.log"), dir.path().join("b.log")];
    let mut nodes = [
        start_with(&test, &config(names[0], &logs[0])).await,
        start_with(&test, &config(names[1], &logs[1])).await,
    ];
    let mut acked = Vec::new();
    let mut serving = 0;
    for round in 0..3 {
        for (tenant, credential) in [(1, "tenant-1-credential"), (2, "tenant-2-credential")] {
            let client = once_served(&nodes[serving], tenant, credential).await;
            for batch in 0..2 {
                let tasks: Vec<_> = (0..20)
                    .map(|i| task(&format!("r{round}-t{tenant}-{batch}-{i}")))
                    .collect();
                for a in client.submit_batch(tasks).await.unwrap() {
                    assert!(a.decision.is_accepted(), "{a:?}");
                    acked.push(a.task);
                }
            }
        }
        nodes[serving].child.kill().unwrap();
        nodes[serving].child.wait().unwrap();
        let other = 1 - serving;
        // The other node serves both tenants once the leases lapse; the killed one comes back.
        once_served(&nodes[other], 1, "tenant-1-credential").await;
        once_served(&nodes[other], 2, "tenant-2-credential").await;
        nodes[serving] = start_with(&test, &config(names[serving], &logs[serving])).await;
        serving = other;
    }
    let sql = test.sql().await.unwrap();
    let ids: Vec<i64> = acked.iter().map(|t| t.0 as i64).collect();
    let done = common::wait_all_succeeded(&sql, &ids).await;
    assert_eq!(done, ids.len() as i64, "every acknowledged task completed");
    let ran = common::executed_once_per_attempt(&[&logs[0], &logs[1]]);
    for t in &acked {
        assert!(ran.contains(&t.0), "task {t} completed without running");
    }
    let held = common::active_reservations(&sql).await;
    assert_eq!(held, 0, "nothing held after the last completion");
}
