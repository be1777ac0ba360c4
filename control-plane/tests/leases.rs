//! Partition leases move tenants between nodes: a live owner keeps its partitions, a dead one's
//! move after expiry with a new epoch, and claims for a partition a node lost are refused.

mod common;

use common::{claim, task};
use spindle_control::testing::TestDb;
use spindle_control::{ClaimRefusal, ClaimResult, PartitionId, SubmitOutcome};
use spindle_core::PolicyVersion;

fn parts(ids: &[u32]) -> Vec<PartitionId> {
    ids.iter().copied().map(PartitionId).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_contend_for_partitions_and_a_dead_nodes_move_with_a_new_epoch() {
    let test = TestDb::new().await;
    let a = test.open().await;
    let b = test.open().await;
    a.ensure_partitions(8).await.unwrap();
    a.register_node("a", "10.0.0.1").await.unwrap();
    b.register_node("b", "10.0.0.2").await.unwrap();
    let all = parts(&[0, 1, 2, 3, 4, 5, 6, 7]);

    // Both ask for everything at once: every partition goes to exactly one of them.
    let (held_a, held_b) = tokio::join!(
        a.acquire_partitions("a", &all, 60_000),
        b.acquire_partitions("b", &all, 60_000)
    );
    let (held_a, held_b) = (held_a.unwrap(), held_b.unwrap());
    assert_eq!(held_a.len() + held_b.len(), 8, "{held_a:?} {held_b:?}");
    let mut owned: Vec<PartitionId> = held_a.iter().chain(&held_b).map(|l| l.partition).collect();
    owned.sort();
    assert_eq!(owned, all, "no partition owned twice");

    // Renewal by the owner keeps the epoch; a non-owner gets nothing while the lease lives.
    let renewed = a.acquire_partitions("a", &all, 60_000).await.unwrap();
    assert_eq!(renewed, held_a);
    let taken = b.acquire_partitions("b", &all, 60_000).await.unwrap();
    assert_eq!(taken, held_b);

    // Node a dies: its leases run out (expire them rather than wait), b takes over, epoch + 1.
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE partition_lease SET lease_until = now() - interval '1 second' WHERE owner_node = 'a'",
        &[],
    )
    .await
    .unwrap();
    let took = b.acquire_partitions("b", &all, 60_000).await.unwrap();
    assert_eq!(took.len(), 8);
    for lease in &held_a {
        let now = took
            .iter()
            .find(|l| l.partition == lease.partition)
            .unwrap();
        assert_eq!(now.epoch, lease.epoch + 1, "{:?}", lease.partition);
    }
}

#[tokio::test]
async fn claims_for_a_partition_the_node_does_not_hold_are_refused() {
    let test = TestDb::new().await;
    let db = test.open().await;
    db.ensure_partitions(4).await.unwrap();
    db.register_node("a", "").await.unwrap();
    db.register_node("b", "").await.unwrap();
    db.acquire_partitions("a", &parts(&[0, 1]), 60_000)
        .await
        .unwrap();
    db.acquire_partitions("b", &parts(&[2, 3]), 60_000)
        .await
        .unwrap();
    db.set_pool("p", 10, 1).await.unwrap();
    // Tenant 2 hashes to partition 2 (common::task uses tenant % 4), owned by b.
    db.submit_batch(&[task(1, 2, "x")], PolicyVersion(1))
        .await
        .unwrap();
    let r = db
        .claim_batch("a", 60_000, &[claim(1, 0, &[("p", 0, 1)])])
        .await
        .unwrap();
    assert_eq!(
        r[0],
        ClaimResult::Refused(ClaimRefusal::PartitionNotOwned(PartitionId(2)))
    );
    let r = db
        .claim_batch("b", 60_000, &[claim(1, 0, &[("p", 0, 1)])])
        .await
        .unwrap();
    assert!(matches!(r[0], ClaimResult::Granted { .. }), "{r:?}");
    // After a drain, b's partitions are free at once; a claims through them.
    assert_eq!(db.release_partitions("b").await.unwrap(), 2);
    db.deregister_node("b").await.unwrap();
    let held = db
        .acquire_partitions("a", &parts(&[2, 3]), 60_000)
        .await
        .unwrap();
    assert_eq!(held.len(), 2);
}

#[tokio::test]
async fn attempt_leases_renew_in_one_batch_and_only_for_the_current_token() {
    let (test, db) = common::setup().await;
    db.set_pool("p", 10, 1).await.unwrap();
    db.submit_batch(&[task(1, 1, "a"), task(2, 1, "b")], PolicyVersion(1))
        .await
        .unwrap();
    let r = db
        .claim_batch(
            common::NODE,
            common::LEASE_MS,
            &[claim(1, 0, &[("p", 0, 1)]), claim(2, 0, &[("p", 0, 1)])],
        )
        .await
        .unwrap();
    common::age_live_attempts(&test, common::LEASE_MS + 1_000).await;
    let grant = |i: usize| match &r[i] {
        ClaimResult::Granted { attempt, token, .. } => (*attempt, *token),
        other => panic!("{other:?}"),
    };
    let (a1, t1) = grant(0);
    let (a2, t2) = grant(1);
    let stale = spindle_core::FencingToken(t2.0 + 1_000);
    let renewed = db
        .renew_attempts(
            &[
                (spindle_core::TaskId(1), t1),
                (spindle_core::TaskId(2), stale),
            ],
            60_000,
        )
        .await
        .unwrap();
    assert_eq!(renewed, vec![a1]);
    let expired: Vec<_> = db
        .lapsed_owned(&[spindle_control::PartitionId(1)], 3_600_000, 10)
        .await
        .unwrap()
        .iter()
        .map(|o| o.task.task)
        .collect();
    assert_eq!(expired, vec![spindle_core::TaskId(2)], "{a2:?}");
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE node SET heartbeat_at = '2000-01-01' WHERE node_id = $1",
        &[&common::NODE],
    )
    .await
    .unwrap();
    db.heartbeat(common::NODE).await.unwrap();
    let fresh: bool = sql
        .query_one(
            "SELECT heartbeat_at > now() - interval '1 minute' FROM node WHERE node_id = $1",
            &[&common::NODE],
        )
        .await
        .unwrap()
        .get(0);
    assert!(fresh);
}

#[tokio::test]
async fn a_nodes_submits_go_only_into_the_partitions_it_holds() {
    // NODE holds partitions 0..4 (common::setup); partition 5 is nobody's.
    let (test, db) = common::setup().await;
    let mut mine = task(1, 1, "mine");
    mine.partition = PartitionId(1);
    let mut theirs = task(2, 2, "theirs");
    theirs.partition = PartitionId(5);
    let mut also_mine = task(3, 3, "also-mine");
    also_mine.partition = PartitionId(2);
    let out = db
        .submit_batch_as(
            common::NODE,
            &[mine.clone(), theirs, also_mine],
            PolicyVersion(1),
        )
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            SubmitOutcome::Created,
            SubmitOutcome::PartitionNotOwned(PartitionId(5)),
            SubmitOutcome::Created,
        ]
    );
    // Another node holds none of them; a lapsed lease fences like a lost one.
    let other = db
        .submit_batch_as("node-b", &[task(4, 1, "b")], PolicyVersion(1))
        .await
        .unwrap();
    assert_eq!(
        other,
        vec![SubmitOutcome::PartitionNotOwned(PartitionId(1))]
    );
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE partition_lease SET lease_until = now() - interval '1 second'",
        &[],
    )
    .await
    .unwrap();
    let lapsed = db
        .submit_batch_as(common::NODE, &[task(5, 1, "late")], PolicyVersion(1))
        .await
        .unwrap();
    assert_eq!(
        lapsed,
        vec![SubmitOutcome::PartitionNotOwned(PartitionId(1))]
    );
    let rows: Vec<i64> = common::column(&sql, "SELECT task_id FROM task ORDER BY task_id").await;
    assert_eq!(
        rows,
        vec![1, 3],
        "only the rows of held partitions were written"
    );
}
