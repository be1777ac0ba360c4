//! Several connections — standing for several nodes — race claims on one small pool. The pool
//! never goes above capacity, and the grants the callers saw are exactly the attempts and
//! reservations PostgreSQL holds: none lost, none duplicated. The pool is split over shards and
//! each racer prefers its own, so claims spill to other shards whenever the preferred one is
//! full (`spindle_pick_shards`) while the others race for them.

mod common;

use std::collections::HashSet;

use common::{assert_counters_derived, claim, task, LEASE_MS};
use spindle_control::testing::TestDb;
use spindle_control::{ClaimRefusal, ClaimResult, PartitionId, Report, ReportAction, ReportResult};
use spindle_core::{FencingToken, PolicyVersion, TaskId, TaskState};

const RACERS: u64 = 4;
const TASKS_PER_RACER: u64 = 60;
const CAPACITY: u64 = 7;
/// The shared pool's rows (capacities 3, 2, 2): racer `r` prefers shard `r % POOL_SHARDS`.
const POOL_SHARDS: u16 = 3;

/// The pool demand racer `racer` makes: one unit, preferring its own shard.
fn shared_pool(racer: u64) -> [(&'static str, u16, u64); 1] {
    [(
        "provider:shared",
        (racer % u64::from(POOL_SHARDS)) as u16,
        1,
    )]
}

/// Every shard of the shared pool is back at zero.
async fn assert_pool_empty(db: &spindle_control::Db) {
    let usage = db.pool_usage("provider:shared").await.unwrap();
    assert_eq!(usage.len(), usize::from(POOL_SHARDS));
    assert!(usage.iter().all(|u| u.used == 0), "{usage:?}");
}
const ROUNDS_MAX: usize = 200;

/// Racer `racer`'s connection and node, registered and holding partition `racer` (its tasks
/// are put there).
async fn racer_node(test: &TestDb, racer: u64) -> (spindle_control::Db, String) {
    let db = test.open().await;
    let node = format!("node-{racer}");
    db.register_node(&node, "").await.unwrap();
    let held = db
        .acquire_partitions(&node, &[PartitionId(racer as u32)], LEASE_MS)
        .await
        .unwrap();
    assert_eq!(held.len(), 1);
    (db, node)
}

/// One racer: its own node, connection and tasks; claims in batches of 8 until every task got a
/// grant, finishing some of what it holds each round so capacity keeps turning over.
async fn race(test: &TestDb, racer: u64) -> Vec<(TaskId, FencingToken)> {
    let (db, node) = racer_node(test, racer).await;
    let ids: Vec<u64> = (0..TASKS_PER_RACER).map(|i| racer * 1_000 + i).collect();
    let batch: Vec<_> = ids
        .iter()
        .map(|&id| {
            let mut t = task(id, racer as u32, &format!("r{racer}-{id}"));
            t.partition = PartitionId(racer as u32);
            t
        })
        .collect();
    db.submit_batch(&batch, PolicyVersion(1)).await.unwrap();

    let mut waiting: Vec<u64> = ids.clone();
    let mut running: Vec<(TaskId, FencingToken)> = Vec::new();
    let mut all_grants = Vec::new();
    for _ in 0..ROUNDS_MAX {
        if waiting.is_empty() && running.is_empty() {
            return all_grants;
        }
        let claims: Vec<_> = waiting
            .iter()
            .take(8)
            .map(|&id| claim(id, 0, &shared_pool(racer)))
            .collect();
        let results = db.claim_batch(&node, LEASE_MS, &claims).await.unwrap();
        for (c, r) in claims.iter().zip(&results) {
            match r {
                ClaimResult::Granted { token, .. } => {
                    waiting.retain(|&id| id != c.task.0);
                    running.push((c.task, *token));
                    all_grants.push((c.task, *token));
                }
                ClaimResult::Refused(ClaimRefusal::PoolFull(s)) => {
                    assert_eq!(s.pool, "provider:shared");
                    assert!(s.shard < POOL_SHARDS, "{s:?}");
                }
                other => panic!("racer {racer}: unexpected {other:?}"),
            }
        }
        // Finish half of what runs (at least one): capacity turns over between racers.
        let finish = running.len().div_ceil(2);
        let reports: Vec<_> = running
            .drain(..finish)
            .map(|(task, token)| Report {
                task,
                token: Some(token),
                via: Vec::new(),
                action: ReportAction::Finish {
                    state: TaskState::Canceled,
                    cost_actual_milli: None,
                    reason: None,
                    result: None,
                },
            })
            .collect();
        for r in db.report_batch(&reports).await.unwrap() {
            assert!(
                matches!(r, ReportResult::Applied { released: 1, .. }),
                "{r:?}"
            );
        }
    }
    panic!("racer {racer} did not finish in {ROUNDS_MAX} rounds");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_claims_never_overshoot_and_lose_no_grant() {
    let test = TestDb::new().await;
    let db = test.open().await;
    db.ensure_partitions(RACERS as u32).await.unwrap();
    db.set_pool("provider:shared", CAPACITY, POOL_SHARDS)
        .await
        .unwrap();

    // An observer samples the pool while the racers run, and the counter check with it: a
    // snapshot taken mid-race never shows drift, nor a shard above its capacity.
    let watch = {
        let sql = test.sql().await.unwrap();
        let mut checker = test.open().await;
        tokio::spawn(async move {
            let mut max_seen = 0i64;
            for i in 0..500 {
                let drift = checker.check_counters().await.unwrap();
                assert!(drift.is_empty(), "sample {i}: drift mid-race {drift:?}");
                let row = sql
                    .query_one(
                        "SELECT sum(used)::bigint, bool_and(used <= capacity)
                           FROM resource_pool_shard WHERE pool_key = 'provider:shared'",
                        &[],
                    )
                    .await
                    .unwrap();
                assert!(
                    row.get::<_, bool>(1),
                    "sample {i}: a shard above its capacity"
                );
                max_seen = max_seen.max(row.get::<_, i64>(0));
                tokio::task::yield_now().await;
            }
            max_seen
        })
    };
    let racers: Vec<_> = (0..RACERS)
        .map(|r| {
            let test = &test;
            async move { race(test, r).await }
        })
        .collect();
    let grants: Vec<(TaskId, FencingToken)> = futures_util::future::join_all(racers)
        .await
        .into_iter()
        .flatten()
        .collect();
    let max_seen = watch.await.unwrap();
    assert!(
        max_seen <= CAPACITY as i64,
        "observer saw {max_seen} > {CAPACITY}"
    );

    // Every task got exactly one grant; tokens are unique; PostgreSQL holds exactly these.
    assert_eq!(grants.len() as u64, RACERS * TASKS_PER_RACER);
    let tasks: HashSet<TaskId> = grants.iter().map(|g| g.0).collect();
    let tokens: HashSet<FencingToken> = grants.iter().map(|g| g.1).collect();
    assert_eq!(tasks.len(), grants.len(), "a task was granted twice");
    assert_eq!(
        tokens.len(),
        grants.len(),
        "a fencing token was handed out twice"
    );
    let sql = test.sql().await.unwrap();
    let stored: HashSet<(TaskId, FencingToken)> = sql
        .query("SELECT task_id, fencing_token FROM task_attempt", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| {
            (
                TaskId(r.get::<_, i64>(0) as u64),
                FencingToken(r.get::<_, i64>(1) as u64),
            )
        })
        .collect();
    let seen: HashSet<(TaskId, FencingToken)> = grants.iter().copied().collect();
    assert_eq!(
        stored, seen,
        "attempts in PostgreSQL differ from the grants callers saw"
    );
    let orphans: i64 = sql
        .query_one(
            "SELECT count(*) FROM resource_reservation r
              WHERE NOT EXISTS (SELECT 1 FROM task_attempt a WHERE a.attempt_id = r.attempt_id)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(orphans, 0);
    assert_pool_empty(&db).await;
    assert_counters_derived(&test).await;
}

/// Capacity split over shards holds globally: claims spread over every shard never take more
/// than the pool's total, and a full shard names itself.
#[tokio::test]
async fn a_sharded_pool_never_grants_more_than_its_total() {
    let (test, db) = common::setup().await;
    db.set_pool("platform:cost", 10, 4).await.unwrap(); // shards of 3, 3, 2, 2
    let n = 40u64;
    let batch: Vec<_> = (1..=n).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&batch, PolicyVersion(1)).await.unwrap();
    let claims: Vec<_> = (1..=n)
        .map(|i| claim(i, 0, &[("platform:cost", (i % 4) as u16, 1)]))
        .collect();
    let results = db
        .claim_batch(common::NODE, LEASE_MS, &claims)
        .await
        .unwrap();
    let granted = results
        .iter()
        .filter(|r| matches!(r, ClaimResult::Granted { .. }))
        .count();
    assert_eq!(granted, 10);
    let usage = db.pool_usage("platform:cost").await.unwrap();
    let caps: Vec<(u64, u64)> = usage.iter().map(|u| (u.capacity, u.used)).collect();
    assert_eq!(caps, vec![(3, 3), (3, 3), (2, 2), (2, 2)]);
    assert_counters_derived(&test).await;
}

/// Four nodes submit tasks of budgeted tenants carrying their claims, claim what their
/// submits could not, and finish what runs: submits that carry claims lock budgets and then
/// pools, finishing reports settle budgets and then give the pools back, so neither waits for
/// the other in a cycle (the reports gave the pools back first: a deadlock PostgreSQL breaks by
/// failing one of them). The pool is never above capacity and every task is granted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claimed_submits_and_budgeted_finishes_race_without_deadlock_or_overshoot() {
    let test = TestDb::new().await;
    let db = test.open().await;
    db.ensure_partitions(RACERS as u32).await.unwrap();
    db.set_pool("provider:shared", CAPACITY, POOL_SHARDS)
        .await
        .unwrap();
    // One budgeted tenant for all four: every submit and every finish locks its budget.
    test.open()
        .await
        .set_tenant_budget(spindle_core::TenantId(1), 1 << 40, "test", "race")
        .await
        .unwrap();
    let racers: Vec<_> = (0..RACERS)
        .map(|r| {
            let test = &test;
            async move { race_claimed_submits(test, r).await }
        })
        .collect();
    let grants: Vec<TaskId> = futures_util::future::join_all(racers)
        .await
        .into_iter()
        .flatten()
        .collect();
    let tasks: HashSet<TaskId> = grants.iter().copied().collect();
    assert_eq!(tasks.len(), grants.len(), "a task was granted twice");
    assert_eq!(grants.len() as u64, RACERS * TASKS_PER_RACER);
    assert_pool_empty(&db).await;
    assert_counters_derived(&test).await;
}

/// One node: batches of 8 new tasks carrying their claims, claims for those still waiting, and
/// half of what runs finished (settling its budget) each round; returns every task granted.
async fn race_claimed_submits(test: &TestDb, racer: u64) -> Vec<TaskId> {
    let (db, node) = racer_node(test, racer).await;
    let pool = shared_pool(racer);
    let mut next = racer * 1_000;
    let last = next + TASKS_PER_RACER;
    let (mut waiting, mut running, mut granted) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS_MAX {
        if next == last && waiting.is_empty() && running.is_empty() {
            return granted;
        }
        let ids: Vec<u64> = (next..last.min(next + 8)).collect();
        next += ids.len() as u64;
        let batch: Vec<_> = ids
            .iter()
            .map(|&id| {
                let mut t = task(id, 1, &format!("c{racer}-{id}"));
                t.partition = PartitionId(racer as u32);
                t
            })
            .collect();
        let claims: Vec<_> = ids.iter().map(|&id| Some(claim(id, 0, &pool))).collect();
        let rows = db
            .submit_claim_batch_as(&node, LEASE_MS, &batch, &claims, PolicyVersion(1))
            .await
            .unwrap();
        for (id, row) in ids.iter().zip(rows) {
            match row.claim {
                Some(ClaimResult::Granted { token, .. }) => running.push((TaskId(*id), token)),
                _ => waiting.push(*id),
            }
        }
        let claims: Vec<_> = waiting
            .iter()
            .take(8)
            .map(|&id| claim(id, 0, &pool))
            .collect();
        for (c, r) in claims
            .iter()
            .zip(db.claim_batch(&node, LEASE_MS, &claims).await.unwrap())
        {
            if let ClaimResult::Granted { token, .. } = r {
                waiting.retain(|&id| id != c.task.0);
                running.push((c.task, token));
            }
        }
        let finish = running.len().div_ceil(2);
        let reports: Vec<_> = running
            .drain(..finish)
            .map(|(task, token)| {
                granted.push(task);
                common::finish_costing(task.0, token, TaskState::Succeeded, Some(900))
            })
            .collect();
        for r in db.report_batch(&reports).await.unwrap() {
            assert!(matches!(r, ReportResult::Applied { .. }), "{r:?}");
        }
    }
    panic!("racer {racer} did not finish in {ROUNDS_MAX} rounds");
}
