//! Reports and claims in one call (`Db::work_batch`, `spindle_work`) against a real PostgreSQL:
//! the reports run first, so the claims see the slots they released; each batch is answered
//! row for row in its own order, and the counters stay the sum of the live reservations.

mod common;

use common::{assert_counters_derived, claim, finish, granted, setup, task, LEASE_MS, NODE};
use spindle_control::{ClaimRefusal, ClaimResult, ReportResult};
use spindle_core::{PolicyVersion, TaskState};

const V1: PolicyVersion = PolicyVersion(1);

#[tokio::test]
async fn a_claim_in_the_same_call_takes_the_slot_its_report_released() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 1, 1).await.unwrap();
    db.submit_batch(&[task(1, 1, "k1"), task(2, 1, "k2")], V1)
        .await
        .unwrap();
    let one = granted(
        &db.claim_batch(NODE, LEASE_MS, &[claim(1, 0, &[("provider:acme", 0, 1)])])
            .await
            .unwrap()[0],
    );
    // The one slot is taken: task 2's claim alone is refused.
    let alone = db
        .claim_batch(NODE, LEASE_MS, &[claim(2, 0, &[("provider:acme", 0, 1)])])
        .await
        .unwrap();
    assert!(
        matches!(alone[0], ClaimResult::Refused(ClaimRefusal::PoolFull(_))),
        "{alone:?}"
    );
    // Task 1's finish and task 2's claim in one call: the claim sees the released slot.
    let (reported, claimed) = db
        .work_batch(
            NODE,
            LEASE_MS,
            &[finish(1, one, TaskState::Succeeded)],
            &[claim(2, 0, &[("provider:acme", 0, 1)])],
        )
        .await
        .unwrap();
    assert!(
        matches!(
            reported[..],
            [ReportResult::Applied {
                state: TaskState::Succeeded,
                released: 1,
                ..
            }]
        ),
        "{reported:?}"
    );
    let two = granted(&claimed[0]);
    assert_ne!(one, two);
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 1);
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn each_batch_of_a_work_call_is_answered_in_its_own_order() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 3, 1).await.unwrap();
    let tasks: Vec<_> = (1..=6).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&tasks, V1).await.unwrap();
    let running: Vec<_> = db
        .claim_batch(
            NODE,
            LEASE_MS,
            &(1..=3)
                .map(|i| claim(i, 0, &[("provider:acme", 0, 1)]))
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap()
        .iter()
        .map(granted)
        .collect();
    // Three finishes (reported out of task order) and three claims: every slot changes hands.
    let (reported, claimed) = db
        .work_batch(
            NODE,
            LEASE_MS,
            &[
                finish(3, running[2], TaskState::Failed),
                finish(1, running[0], TaskState::Succeeded),
                finish(2, running[1], TaskState::Succeeded),
            ],
            &[
                claim(6, 0, &[("provider:acme", 0, 1)]),
                claim(4, 0, &[("provider:acme", 0, 1)]),
                claim(5, 0, &[("provider:acme", 0, 1)]),
            ],
        )
        .await
        .unwrap();
    let states: Vec<_> = reported
        .iter()
        .map(|r| match r {
            ReportResult::Applied { state, .. } => *state,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        states,
        [
            TaskState::Failed,
            TaskState::Succeeded,
            TaskState::Succeeded
        ]
    );
    let keys: Vec<_> = claimed
        .iter()
        .map(|c| match c {
            ClaimResult::Granted { request_key, .. } => request_key.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(keys, ["spindle-6-1", "spindle-4-1", "spindle-5-1"]);
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 3);
    // Either batch empty: the other's own call.
    let (none, alone) = db
        .work_batch(
            NODE,
            LEASE_MS,
            &[],
            &[claim(1, 9, &[("provider:acme", 0, 1)])],
        )
        .await
        .unwrap();
    assert!(none.is_empty());
    assert_eq!(alone.len(), 1);
    let (only, none) = db.work_batch(NODE, LEASE_MS, &[], &[]).await.unwrap();
    assert!(only.is_empty() && none.is_empty());
    assert_counters_derived(&test).await;
}
