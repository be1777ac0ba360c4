//! A submit that carries its tasks' first claims (`spindle_submit_claim`): taken in the submit's
//! transaction when the whole batch can be, else the batch is submitted unclaimed with the
//! answers a plain submit gives — never half of each.

mod common;

use common::{assert_counters_derived, claim, column, finish, setup, task, LEASE_MS, NODE};
use spindle_control::query::lost_claim;
use spindle_control::submit::ClaimedSubmit;
use spindle_control::{
    ClaimRequest, ClaimResult, InputError, NewTask, ReportResult, StoreError, SubmitOutcome,
};
use spindle_core::{FencingToken, PolicyVersion, TaskId, TaskState};

const V1: PolicyVersion = PolicyVersion(1);
const PROVIDER: (&str, u16, u64) = ("provider:acme", 0, 1);

fn token(row: &ClaimedSubmit) -> FencingToken {
    match row {
        ClaimedSubmit {
            outcome: SubmitOutcome::Created,
            claim: Some(ClaimResult::Granted { token, .. }),
        } => *token,
        other => panic!("expected a task created claimed, got {other:?}"),
    }
}

fn unclaimed(outcome: SubmitOutcome) -> ClaimedSubmit {
    ClaimedSubmit {
        outcome,
        claim: None,
    }
}

/// Rows as (task, state, version, attempt_no, held pool units).
async fn rows(test: &spindle_control::testing::TestDb) -> Vec<(i64, String, i32, i32, i32)> {
    test.sql()
        .await
        .unwrap()
        .query(
            "SELECT task_id, state, version, attempt_no, coalesce(cardinality(res_pool), 0)
               FROM task ORDER BY task_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect()
}

fn claims_for(tasks: &[NewTask], claimed: &[u64]) -> Vec<Option<ClaimRequest>> {
    tasks
        .iter()
        .map(|t| {
            claimed
                .contains(&t.task.0)
                .then(|| claim(t.task.0, 0, &[PROVIDER]))
        })
        .collect()
}

#[tokio::test]
async fn a_submit_carrying_claims_writes_its_tasks_claimed_in_one_transaction() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 5, 1).await.unwrap();
    let tasks: Vec<NewTask> = (1..=3).map(|i| task(i, 1, &format!("k{i}"))).collect();
    let out = db
        .submit_claim_batch_as(NODE, LEASE_MS, &tasks, &claims_for(&tasks, &[1, 2]), V1)
        .await
        .unwrap();
    let (a, b) = (token(&out[0]), token(&out[1]));
    assert!(b.0 > a.0, "one token per claim, growing");
    assert_eq!(out[2], unclaimed(SubmitOutcome::Created));
    let Some(ClaimResult::Granted {
        request_key,
        attempt_no,
        attempt,
        ..
    }) = &out[0].claim
    else {
        unreachable!()
    };
    assert_eq!(
        (request_key.as_str(), *attempt_no, attempt.0),
        ("spindle-1-1", 1, a.0)
    );
    // What a claim after the submit would have left: DISPATCHING at version 1, attempt 1.
    let d = |id| (id, "DISPATCHING".to_string(), 1, 1, 1);
    assert_eq!(
        rows(&test).await,
        vec![d(1), d(2), (3, "QUEUED".into(), 0, 0, 0)]
    );
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 2);
    let sql = test.sql().await.unwrap();
    let kinds: Vec<Vec<String>> = column(&sql, "SELECT kinds FROM outbox_batch").await;
    assert_eq!(kinds, vec![vec!["DISPATCHING".to_string(); 2]]);
    assert_counters_derived(&test).await;

    // The attempt runs and ends like a claimed one; the unclaimed task is claimed as before.
    let r = db
        .report_batch(&[finish(1, a, TaskState::Succeeded)])
        .await
        .unwrap();
    assert!(
        matches!(r[0], ReportResult::Applied { released: 1, .. }),
        "{r:?}"
    );
    let c = db
        .claim_batch(NODE, LEASE_MS, &[claim(3, 0, &[PROVIDER])])
        .await
        .unwrap();
    assert!(matches!(c[0], ClaimResult::Granted { .. }), "{c:?}");
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 2);
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn claims_that_do_not_all_fit_leave_the_batch_submitted_unclaimed() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 1, 1).await.unwrap();
    let tasks: Vec<NewTask> = (1..=2).map(|i| task(i, 1, &format!("k{i}"))).collect();
    let out = db
        .submit_claim_batch_as(NODE, LEASE_MS, &tasks, &claims_for(&tasks, &[1, 2]), V1)
        .await
        .unwrap();
    assert_eq!(out, vec![unclaimed(SubmitOutcome::Created); 2]);
    let q = |id| (id, "QUEUED".to_string(), 0, 0, 0);
    assert_eq!(rows(&test).await, vec![q(1), q(2)]);
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 0);
    // An unknown pool: the same.
    let more: Vec<NewTask> = vec![task(3, 1, "k3")];
    let out = db
        .submit_claim_batch_as(
            NODE,
            LEASE_MS,
            &more,
            &[Some(claim(3, 0, &[("provider:nobody", 0, 1)]))],
            V1,
        )
        .await
        .unwrap();
    assert_eq!(out, vec![unclaimed(SubmitOutcome::Created)]);
    let sql = test.sql().await.unwrap();
    let batches: Vec<i64> = column(&sql, "SELECT count(*) FROM outbox_batch").await;
    assert_eq!(batches, vec![0], "nothing was claimed, nothing announced");
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn a_replayed_key_sends_the_batch_unclaimed_with_a_plain_submits_answers() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 5, 1).await.unwrap();
    db.submit_batch_as(NODE, &[task(1, 1, "k1")], V1)
        .await
        .unwrap();
    // Task 2 repeats task 1's key and request: a replay. Task 3 is new.
    let mut again = task(2, 1, "k1");
    again.payload = task(1, 1, "k1").payload;
    let tasks = vec![again, task(3, 1, "k3")];
    let out = db
        .submit_claim_batch_as(NODE, LEASE_MS, &tasks, &claims_for(&tasks, &[2, 3]), V1)
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            unclaimed(SubmitOutcome::Replay {
                task: TaskId(1),
                state: TaskState::Queued
            }),
            unclaimed(SubmitOutcome::Created),
        ]
    );
    let q = |id| (id, "QUEUED".to_string(), 0, 0, 0);
    assert_eq!(rows(&test).await, vec![q(1), q(3)]);
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 0);
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn a_partition_not_held_sends_the_batch_unclaimed() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 5, 1).await.unwrap();
    // Partition 2 (tenant 2's) leased to another node.
    db.register_node("node-b", "127.0.0.1:0").await.unwrap();
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE partition_lease SET owner_node = 'node-b' WHERE partition = 2",
        &[],
    )
    .await
    .unwrap();
    let tasks = vec![task(1, 1, "k1"), task(2, 2, "k2")];
    let out = db
        .submit_claim_batch_as(NODE, LEASE_MS, &tasks, &claims_for(&tasks, &[1, 2]), V1)
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            unclaimed(SubmitOutcome::Created),
            unclaimed(SubmitOutcome::PartitionNotOwned(
                spindle_control::PartitionId(2)
            )),
        ]
    );
    assert_eq!(rows(&test).await, vec![(1, "QUEUED".into(), 0, 0, 0)]);
    assert_counters_derived(&test).await;
}

/// A claimed submit whose answer was lost reads back, from its row, as the grant it was.
#[tokio::test]
async fn a_claimed_submit_reads_back_as_granted_from_its_row() {
    let (_test, db) = setup().await;
    db.set_pool("provider:acme", 5, 1).await.unwrap();
    let tasks = vec![task(1, 1, "k1"), task(2, 1, "k2")];
    let out = db
        .submit_claim_batch_as(NODE, LEASE_MS, &tasks, &claims_for(&tasks, &[1]), V1)
        .await
        .unwrap();
    let heads = db.task_heads(&[TaskId(1), TaskId(2)]).await.unwrap();
    assert_eq!(
        lost_claim(TaskId(1), heads[0].as_ref(), NODE, 0),
        out[0].claim
    );
    assert_eq!(lost_claim(TaskId(2), heads[1].as_ref(), NODE, 0), None);
}

#[tokio::test]
async fn a_claim_that_is_not_its_rows_first_is_refused_before_any_round_trip() {
    let (_test, db) = setup().await;
    let tasks = vec![task(1, 1, "k1"), task(2, 1, "k2")];
    let refused = |e: Result<Vec<ClaimedSubmit>, StoreError>| match e {
        Err(StoreError::Invalid(InputError::Illegal { row, .. })) => row,
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Another task's claim, a claim at a later version, one claim short.
    let other = vec![None, Some(claim(1, 0, &[PROVIDER]))];
    let later = vec![Some(claim(1, 1, &[PROVIDER])), None];
    let short = vec![None];
    for (claims, row) in [(other, 1), (later, 0), (short, 1)] {
        let got = db
            .submit_claim_batch_as(NODE, LEASE_MS, &tasks, &claims, V1)
            .await;
        assert_eq!(refused(got), row);
    }
}
