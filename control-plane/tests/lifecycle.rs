//! Submit → claim → advance → finish against a real PostgreSQL, with the fences and idempotency
//! that make each step safe to repeat.

mod common;

use common::{assert_counters_derived, claim, setup, task, LEASE_MS, NODE};
use spindle_control::{
    ClaimRefusal, ClaimResult, PoolShard, Report, ReportAction, ReportResult, SubmitOutcome,
};
use spindle_core::{FencingToken, PolicyVersion, TaskId, TaskState};

const V1: PolicyVersion = PolicyVersion(1);

fn granted(r: &ClaimResult) -> FencingToken {
    match r {
        ClaimResult::Granted { token, .. } => *token,
        other => panic!("expected a grant, got {other:?}"),
    }
}

#[tokio::test]
async fn a_task_runs_from_submit_to_success_and_gives_its_capacity_back() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 2, 1).await.unwrap();
    let out = db.submit_batch(&[task(1, 1, "k1")], V1).await.unwrap();
    assert_eq!(out, vec![SubmitOutcome::Created]);

    let res = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &[("provider:acme", 0, 1)])])
        .await
        .unwrap();
    let token = granted(&res[0]);
    let ClaimResult::Granted {
        request_key,
        attempt_no,
        ..
    } = &res[0]
    else {
        unreachable!()
    };
    assert_eq!((request_key.as_str(), *attempt_no), ("spindle-1-1", 1));
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 1);

    let advance = Report {
        task: TaskId(1),
        token: Some(token),
        action: ReportAction::Advance(TaskState::Running),
    };
    let r = db.report_batch(&[advance]).await.unwrap();
    assert!(
        matches!(
            r[0],
            ReportResult::Applied {
                state: TaskState::Running,
                released: 0,
                ..
            }
        ),
        "{r:?}"
    );
    for to in [TaskState::ProviderSucceeded, TaskState::MediaProcessing] {
        let r = db
            .report_batch(&[Report {
                task: TaskId(1),
                token: Some(token),
                action: ReportAction::Advance(to),
            }])
            .await
            .unwrap();
        assert!(matches!(r[0], ReportResult::Applied { .. }), "{r:?}");
    }
    let finish = Report {
        task: TaskId(1),
        token: Some(token),
        action: ReportAction::Finish {
            state: TaskState::Succeeded,
            cost_actual_milli: Some(1_300),
            reason: None,
        },
    };
    let r = db.report_batch(&[finish.clone()]).await.unwrap();
    assert!(
        matches!(
            r[0],
            ReportResult::Applied {
                state: TaskState::Succeeded,
                released: 1,
                ..
            }
        ),
        "{r:?}"
    );
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 0);

    // The same finish again: the attempt's token is no longer current, nothing changes.
    let r = db.report_batch(&[finish]).await.unwrap();
    assert_eq!(r[0], ReportResult::StaleToken { current: None });
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 0);

    let sql = test.sql().await.unwrap();
    let row = sql
        .query_one(
            "SELECT cost_estimate_milli, cost_actual_milli FROM task WHERE task_id = 1",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, Option<i64>>(1)),
        (1_000, Some(1_300))
    );
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn a_claim_is_all_or_nothing_and_names_the_full_pool() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 5, 1).await.unwrap();
    db.set_pool("gpu:h200", 1, 1).await.unwrap();
    db.submit_batch(&[task(1, 1, "a"), task(2, 1, "b")], V1)
        .await
        .unwrap();
    let both = [("provider:acme", 0, 1), ("gpu:h200", 0, 1)];
    let res = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &both), claim(2, 0, &both)])
        .await
        .unwrap();
    granted(&res[0]);
    assert_eq!(
        res[1],
        ClaimResult::Refused(ClaimRefusal::PoolFull(PoolShard::new("gpu:h200", 0)))
    );
    // The refused claim charged nothing: acme holds only the first claim's unit.
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 1);
    let res = db
        .claim_batch(NODE, LEASE_MS, &[claim(2, 0, &[("nope", 0, 1)])])
        .await
        .unwrap();
    assert_eq!(
        res[0],
        ClaimResult::Refused(ClaimRefusal::UnknownPool(PoolShard::new("nope", 0)))
    );
    let res = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &[]), claim(99, 0, &[])])
        .await
        .unwrap();
    assert_eq!(
        res,
        vec![
            ClaimResult::Refused(ClaimRefusal::VersionMoved {
                state: TaskState::Dispatching,
                version: 1
            }),
            ClaimResult::Refused(ClaimRefusal::TaskGone),
        ]
    );
    assert_counters_derived(&test).await;
}
