//! Shared set-up for the store tests: a migrated database with one node holding partition 0.
#![allow(dead_code)]

use spindle_control::testing::TestDb;
use spindle_control::{
    ClaimRequest, ClaimResult, Db, Demand, NewTask, PartitionId, PoolShard, Report, ReportAction,
};
use spindle_core::{Band, FencingToken, Lane, TaskId, TaskState, TenantId, UserId};

pub const NODE: &str = "node-a";
pub const LEASE_MS: u32 = 30_000;

/// A fresh database, migrated, with `NODE` registered and holding partitions 0..4.
pub async fn setup() -> (TestDb, Db) {
    let test = TestDb::new().await;
    let db = test.open().await;
    db.register_node(NODE, "127.0.0.1:0").await.unwrap();
    db.ensure_partitions(4).await.unwrap();
    let parts: Vec<PartitionId> = (0..4).map(PartitionId).collect();
    let held = db.acquire_partitions(NODE, &parts, LEASE_MS).await.unwrap();
    assert_eq!(held.len(), 4);
    (test, db)
}

pub fn task(id: u64, tenant: u32, key: &str) -> NewTask {
    NewTask {
        task: TaskId(id),
        tenant: TenantId(tenant),
        user: UserId(tenant * 10),
        idempotency_key: key.to_string(),
        payload: format!("spec-of-{key}").into_bytes(),
        partition: PartitionId(tenant % 4),
        lane: Lane::Standard,
        band: Band::P2,
        cost_estimate_milli: 1_000,
        fairness_milli: 500,
    }
}

/// The token of a granted claim; anything else fails the test.
pub fn granted(r: &ClaimResult) -> FencingToken {
    match r {
        ClaimResult::Granted { token, .. } => *token,
        other => panic!("expected a grant, got {other:?}"),
    }
}

pub fn claim(id: u64, version: u32, demands: &[(&str, u16, u64)]) -> ClaimRequest {
    ClaimRequest {
        task: TaskId(id),
        expected_version: version,
        provider: "acme".into(),
        demands: demands
            .iter()
            .map(|(pool, shard, amount)| Demand {
                shard: PoolShard::new(*pool, *shard),
                amount: *amount,
            })
            .collect(),
    }
}

/// Moves every live attempt's lease end and last change `ms` into the past: the time a test
/// means to pass, written to the rows. A test that claimed with a lease of 0 and asked at once
/// for expired attempts depended on the clock moving between two calls; a coarse or stepped
/// clock gives both the same `now()`, and the attempt is not yet past its lease.
pub async fn age_live_attempts(test: &TestDb, ms: u32) {
    let sql = test.sql().await.unwrap();
    let aged = sql
        .execute(
            "UPDATE task SET attempt_lease_until = attempt_lease_until - $1::float8 * interval '1 millisecond',
                             updated_at = updated_at - $1::float8 * interval '1 millisecond'
              WHERE current_attempt IS NOT NULL",
            &[&f64::from(ms)],
        )
        .await
        .unwrap();
    assert!(aged > 0, "no live attempt to age");
}

/// Every pool shard's `used` equals the sum of its ACTIVE reservations and never exceeds its
/// capacity (invariants 1 and 5).
pub async fn assert_counters_derived(test: &TestDb) {
    // The store's own check (pools and reserved budgets) finds nothing either.
    let drift = test.open().await.check_counters().await.unwrap();
    assert!(drift.is_empty(), "the counter check found drift: {drift:?}");
    let sql = test.sql().await.unwrap();
    let rows = sql
        .query(
            "SELECT p.pool_key, p.shard, p.used, p.capacity,
                    coalesce((SELECT sum(r.amount) FROM resource_reservation r
                               WHERE r.pool_key = p.pool_key AND r.shard = p.shard
                                 AND r.status = 'ACTIVE'), 0)::bigint
               FROM resource_pool_shard p",
            &[],
        )
        .await
        .unwrap();
    for r in rows {
        let (pool, shard, used, cap, active): (String, i16, i64, i64, i64) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        assert_eq!(
            used, active,
            "{pool}/{shard}: used differs from ACTIVE reservations"
        );
        assert!(
            used <= cap,
            "{pool}/{shard}: used {used} above capacity {cap}"
        );
    }
}

/// The fenced report that ends a running attempt as `state` (SUCCEEDED through the provider
/// and media steps, anything else from RUNNING), with a reason.
pub fn finish(task: u64, token: FencingToken, state: TaskState) -> Report {
    let mut report = finish_costing(task, token, state, None);
    if let ReportAction::Finish { reason, .. } = &mut report.action {
        *reason = Some("test".into());
    }
    report
}

/// A finish with the actual cost the task reported (none: it settles at its estimate).
pub fn finish_costing(
    task: u64,
    token: FencingToken,
    state: TaskState,
    cost_actual_milli: Option<u64>,
) -> Report {
    Report {
        task: TaskId(task),
        token: Some(token),
        via: if state == TaskState::Succeeded {
            vec![
                TaskState::Running,
                TaskState::ProviderSucceeded,
                TaskState::MediaProcessing,
            ]
        } else {
            vec![TaskState::Running]
        },
        action: ReportAction::Finish {
            state,
            cost_actual_milli,
            reason: None,
            result: None,
        },
    }
}

/// A tenant's (reserved, spent) budget, in milli units.
pub async fn quota(sql: &tokio_postgres::Client, tenant: u32) -> (i64, i64) {
    let r = sql
        .query_one(
            "SELECT reserved_milli, spent_milli FROM tenant_quota WHERE tenant_id = $1",
            &[&(tenant as i32)],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

/// The first column of every row `query` returns, in order.
pub async fn column<T>(sql: &tokio_postgres::Client, query: &str) -> Vec<T>
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
{
    sql.query(query, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}
