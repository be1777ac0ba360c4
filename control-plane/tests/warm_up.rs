//! A connection's warm-up (`Db::warm_up`): the hot path run once on made-up tasks and rolled
//! back. It must leave nothing behind — no task, outbox row, reservation, budget or pool unit —
//! and leave the connection out of any transaction, so that what it runs next commits.

mod common;

use common::{setup, task, LEASE_MS, NODE};
use spindle_control::{PartitionId, PoolShard, WarmUp, Warmed};
use spindle_core::PolicyVersion;

/// Every table's row count, the pools' used units and the budgets' reserved ones: what a
/// warm-up must leave as it was.
async fn footprint(sql: &tokio_postgres::Client) -> Vec<(String, i64)> {
    let tables: Vec<String> = sql
        .query(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut out = Vec::new();
    for table in tables {
        let n: i64 = sql
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap()
            .get(0);
        out.push((table, n));
    }
    for (what, query) in [
        (
            "pool units used",
            "SELECT coalesce(sum(used), 0)::bigint FROM resource_pool_shard",
        ),
        (
            "budget reserved",
            "SELECT coalesce(sum(reserved_milli), 0)::bigint FROM tenant_quota",
        ),
    ] {
        out.push((
            what.to_string(),
            sql.query_one(query, &[]).await.unwrap().get(0),
        ));
    }
    out
}

/// Fencing tokens drawn so far.
async fn tokens_drawn(sql: &tokio_postgres::Client) -> i64 {
    sql.query_one(
        "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM fencing_token_seq",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// The state of `db`'s backend, as another connection sees it.
async fn backend_state(sql: &tokio_postgres::Client, db: &spindle_control::Db) -> String {
    let pid = db.backend_pid().await.unwrap();
    sql.query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .unwrap()
        .get(0)
}

fn warm_up(pool: &str) -> WarmUp {
    WarmUp {
        node: NODE.to_string(),
        lease_ms: LEASE_MS,
        partition: PartitionId(0),
        provider: "acme".to_string(),
        pool: PoolShard::new(pool, 0),
        policy_version: PolicyVersion(1),
    }
}

#[tokio::test]
async fn a_warm_up_runs_the_claimed_path_and_leaves_nothing_behind() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 5, 1).await.unwrap();
    let sql = test.sql().await.unwrap();
    // One real task already there, claimed: the warm-up must not touch it.
    let real = task(1, 0, "real");
    db.submit_batch_as(NODE, &[real], PolicyVersion(1))
        .await
        .unwrap();
    let before = footprint(&sql).await;
    let drawn = tokens_drawn(&sql).await;

    let warmed = db.warm_up(&warm_up("provider:acme")).await.unwrap();
    // Both claims taken and all three reports applied: the whole path ran, not a fallback.
    assert_eq!(
        warmed,
        Warmed {
            claims: 2,
            reports_applied: 3
        }
    );

    assert_eq!(
        footprint(&sql).await,
        before,
        "the warm-up left rows behind"
    );
    // Its two claims drew their tokens, a gap it leaves in the sequence.
    assert_eq!(
        tokens_drawn(&sql).await - drawn,
        2,
        "tokens drawn by the warm-up"
    );
    // The connection is out of any transaction: it is idle, and its next write commits.
    assert_eq!(backend_state(&sql, &db).await, "idle");
    db.submit_batch_as(NODE, &[task(2, 0, "after")], PolicyVersion(1))
        .await
        .unwrap();
    let seen: i64 = sql
        .query_one("SELECT count(*) FROM task WHERE task_id = 2", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(seen, 1, "a submit after the warm-up is committed");
}

/// A pool that does not exist refuses the claims: the warm-up still succeeds (what ran is
/// warm) and leaves nothing behind.
#[tokio::test]
async fn a_warm_up_whose_claims_are_refused_still_rolls_back_and_succeeds() {
    let (test, db) = setup().await;
    let sql = test.sql().await.unwrap();
    let before = footprint(&sql).await;
    let warmed = db.warm_up(&warm_up("provider:nowhere")).await.unwrap();
    assert_eq!(warmed, Warmed::default());
    assert_eq!(footprint(&sql).await, before);
    assert_eq!(backend_state(&sql, &db).await, "idle");
}

/// A pool row another session holds: the warm-up gives up after its short lock wait (200 ms),
/// well before the session's `lock_timeout` (5 s), so a node's start or reconnect is not held
/// back; it fails (the node then serves from a fresh connection, cold) and leaves nothing.
#[tokio::test]
async fn a_warm_up_that_meets_a_held_lock_gives_up_soon() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 5, 1).await.unwrap();
    let sql = test.sql().await.unwrap();
    let before = footprint(&sql).await;
    let mut holder = test.sql().await.unwrap();
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM resource_pool_shard WHERE pool_key = 'provider:acme' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let failed = db.warm_up(&warm_up("provider:acme")).await;
    let took = started.elapsed();
    assert!(failed.is_err(), "{failed:?}");
    assert!(
        failed.as_ref().unwrap_err().to_string().contains("lock"),
        "{failed:?}"
    );
    assert!(
        took < std::time::Duration::from_secs(2),
        "gave up after {took:?}"
    );
    tx.rollback().await.unwrap();
    assert_eq!(footprint(&sql).await, before);
}
