//! A claim names the pool shard it prefers; when that shard has no room the database charges
//! the next shard of the same pool that has (`spindle_pick_shards`). A pool refuses only when none of
//! its shards has room, and what a task holds goes back to the shard that was charged.

mod common;

use common::{assert_counters_derived, claim, finish, granted, setup, task, LEASE_MS, NODE};
use spindle_control::{ClaimRefusal, ClaimResult, ReportResult, SubmitOutcome};
use spindle_core::{PolicyVersion, TaskState};

const V1: PolicyVersion = PolicyVersion(1);
const POOL: &str = "provider:acme";

/// Each shard's (capacity, used).
async fn usage(db: &spindle_control::Db) -> Vec<(u64, u64)> {
    db.pool_usage(POOL)
        .await
        .unwrap()
        .iter()
        .map(|u| (u.capacity, u.used))
        .collect()
}

/// The shard each task holds, by task id.
async fn held_shards(test: &spindle_control::testing::TestDb) -> Vec<(i64, Vec<i16>)> {
    test.sql()
        .await
        .unwrap()
        .query(
            "SELECT task_id, res_shard FROM task WHERE res_shard IS NOT NULL ORDER BY task_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[tokio::test]
async fn claims_spill_from_a_full_preferred_shard_to_the_next_with_room() {
    let (test, db) = setup().await;
    db.set_pool(POOL, 6, 3).await.unwrap(); // shards of 2, 2, 2
    let tasks: Vec<_> = (1..=7).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&tasks, V1).await.unwrap();

    // Five claims preferring shard 1, in one batch: 1 takes two, then 2, then (wrapping) 0.
    let claims: Vec<_> = (1..=5).map(|i| claim(i, 0, &[(POOL, 1, 1)])).collect();
    let out = db.claim_batch(NODE, LEASE_MS, &claims).await.unwrap();
    let mut tokens: Vec<_> = out.iter().map(granted).collect();
    assert_eq!(usage(&db).await, vec![(2, 1), (2, 2), (2, 2)]);
    assert_eq!(
        held_shards(&test).await,
        vec![
            (1, vec![1]),
            (2, vec![1]),
            (3, vec![2]),
            (4, vec![2]),
            (5, vec![0])
        ]
    );
    assert_counters_derived(&test).await;

    // The last unit, asked of a full shard, is found on shard 0; then the pool is full.
    let out = db
        .claim_batch(NODE, LEASE_MS, &[claim(6, 0, &[(POOL, 2, 1)])])
        .await
        .unwrap();
    tokens.push(granted(&out[0]));
    let out = db
        .claim_batch(NODE, LEASE_MS, &[claim(7, 0, &[(POOL, 0, 1)])])
        .await
        .unwrap();
    assert!(
        matches!(&out[0], ClaimResult::Refused(ClaimRefusal::PoolFull(s)) if s.pool == POOL),
        "{out:?}"
    );
    assert_eq!(usage(&db).await, vec![(2, 2), (2, 2), (2, 2)]);

    // Each finished task gives its unit back to the shard it was charged on.
    let reports: Vec<_> = (1..=6u64)
        .zip(&tokens)
        .map(|(id, t)| finish(id, *t, TaskState::Succeeded))
        .collect();
    for r in db.report_batch(&reports[..2]).await.unwrap() {
        assert!(
            matches!(r, ReportResult::Applied { released: 1, .. }),
            "{r:?}"
        );
    }
    assert_eq!(usage(&db).await, vec![(2, 2), (2, 0), (2, 2)]);
    for r in db.report_batch(&reports[2..]).await.unwrap() {
        assert!(
            matches!(r, ReportResult::Applied { released: 1, .. }),
            "{r:?}"
        );
    }
    assert_eq!(usage(&db).await, vec![(2, 0), (2, 0), (2, 0)]);
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn a_submit_carrying_claims_spills_too_and_stays_whole_or_unclaimed() {
    let (test, db) = setup().await;
    db.set_pool(POOL, 4, 2).await.unwrap(); // shards of 2, 2
    let first: Vec<_> = (1..=3).map(|i| task(i, 1, &format!("k{i}"))).collect();
    let claims: Vec<_> = (1..=3)
        .map(|i| Some(claim(i, 0, &[(POOL, 0, 1)])))
        .collect();
    let out = db
        .submit_claim_batch_as(NODE, LEASE_MS, &first, &claims, V1)
        .await
        .unwrap();
    assert!(out
        .iter()
        .all(|r| matches!(r.claim, Some(ClaimResult::Granted { .. }))));
    assert_eq!(usage(&db).await, vec![(2, 2), (2, 1)]);
    assert_eq!(
        held_shards(&test).await,
        vec![(1, vec![0]), (2, vec![0]), (3, vec![1])]
    );

    // Two more claims with one unit left anywhere: the batch is submitted unclaimed, whole.
    let second: Vec<_> = (4..=5).map(|i| task(i, 1, &format!("k{i}"))).collect();
    let claims: Vec<_> = (4..=5)
        .map(|i| Some(claim(i, 0, &[(POOL, 1, 1)])))
        .collect();
    let out = db
        .submit_claim_batch_as(NODE, LEASE_MS, &second, &claims, V1)
        .await
        .unwrap();
    assert!(
        out.iter()
            .all(|r| r.outcome == SubmitOutcome::Created && r.claim.is_none()),
        "{out:?}"
    );
    assert_eq!(usage(&db).await, vec![(2, 2), (2, 1)]);
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn a_preferred_shard_the_pool_does_not_have_starts_the_search_from_its_first() {
    let (test, db) = setup().await;
    db.set_pool(POOL, 2, 2).await.unwrap(); // shards of 1, 1
    let tasks: Vec<_> = (1..=2).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&tasks, V1).await.unwrap();
    let claims: Vec<_> = (1..=2).map(|i| claim(i, 0, &[(POOL, 9, 1)])).collect();
    let out = db.claim_batch(NODE, LEASE_MS, &claims).await.unwrap();
    for r in &out {
        granted(r);
    }
    assert_eq!(held_shards(&test).await, vec![(1, vec![0]), (2, vec![1])]);
    assert_counters_derived(&test).await;
}
