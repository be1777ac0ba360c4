//! An operator's requeue of FAILED tasks against a real PostgreSQL: only FAILED tasks of the
//! caller's partitions move, each budget cycle is closed and a new one opened (or the task is
//! refused when the budget no longer covers it), and the requeued task runs and settles again
//! like any other.

mod common;

use common::{claim, finish, quota, setup, task, LEASE_MS, NODE};
use spindle_control::{ClaimResult, InputError, PartitionId, Report, RequeueOutcome, StoreError};
use spindle_core::{PolicyVersion, TaskId, TaskState, TenantId};

const V1: PolicyVersion = PolicyVersion(1);
const POOL: &str = "provider:acme";

/// Claims `ids` (at `version`) and ends each as `state`.
async fn run(db: &spindle_control::Db, ids: &[u64], version: u32, state: TaskState) {
    let claims: Vec<_> = ids
        .iter()
        .map(|&i| claim(i, version, &[(POOL, 0, 1)]))
        .collect();
    let reports: Vec<Report> = db
        .claim_batch(NODE, LEASE_MS, &claims)
        .await
        .unwrap()
        .into_iter()
        .zip(ids)
        .map(|(r, &i)| match r {
            ClaimResult::Granted { token, .. } => finish(i, token, state),
            other => panic!("claim of {i}: {other:?}"),
        })
        .collect();
    db.report_batch(&reports).await.unwrap();
}

/// A task its client canceled that failed all the same (a cancel stored while its attempt was
/// ending) comes back from an operator's requeue without its cancel: the requeue is the
/// newer decision, and a node putting the task back would otherwise cancel it at once.
#[tokio::test]
async fn a_requeue_clears_an_old_cancel() {
    let (_test, mut db) = setup().await;
    db.set_pool(POOL, 100, 1).await.unwrap();
    db.submit_batch(&[task(1, 1, "k1")], V1).await.unwrap();
    assert_eq!(db.request_cancel(&[TaskId(1)]).await.unwrap(), [true]);
    run(&db, &[1], 0, TaskState::Failed).await;
    let mine = [PartitionId(1)];
    let out = db
        .requeue_failed(&[TaskId(1)], &mine, "alice", "run it after all")
        .await
        .unwrap();
    assert!(matches!(&out[0], RequeueOutcome::Requeued(_)), "{out:?}");
    let back = db.load_owned(&mine, None, 10).await.unwrap();
    assert_eq!(back.len(), 1);
    assert!(!back[0].cancel_requested, "{:?}", back[0]);
}

#[tokio::test]
async fn failed_tasks_go_back_to_their_queues_with_a_new_budget_cycle() {
    let (test, mut db) = setup().await;
    db.set_pool(POOL, 100, 1).await.unwrap();
    // Tenant 1 (partition 1) has a budget for four estimates of 1,000.
    db.set_tenant_budget(TenantId(1), 4_000, "ops", "a budget")
        .await
        .unwrap();
    let batch: Vec<_> = (1..=4).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&batch, V1).await.unwrap();
    db.submit_batch(&[task(5, 2, "k5")], V1).await.unwrap();
    run(&db, &[1, 2, 3], 0, TaskState::Failed).await;
    run(&db, &[5], 0, TaskState::Failed).await;
    let sql = test.sql().await.unwrap();
    assert_eq!(quota(&sql, 1).await, (1_000, 0), "only task 4 holds budget");

    // Task 4 is QUEUED, 9 does not exist, 5 is served elsewhere (partition 2 not given).
    let mine = [PartitionId(1)];
    let ids: Vec<TaskId> = [1, 2, 4, 9, 5].into_iter().map(TaskId).collect();
    let out = db
        .requeue_failed(&ids, &mine, "alice", "the provider is back")
        .await
        .unwrap();
    let RequeueOutcome::Requeued(q) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!((q.task, q.attempt_no), (TaskId(1), 1));
    let version = q.version;
    assert!(matches!(&out[1], RequeueOutcome::Requeued(q) if q.task == TaskId(2)));
    // Task 4, QUEUED in a partition given, comes back with its row (a requeue that committed
    // unheard and is asked again hands its node what to take back).
    assert!(
        matches!(&out[2], RequeueOutcome::AlreadyQueued(q) if q.task == TaskId(4) && q.version == 0),
        "{:?}",
        out[2]
    );
    assert_eq!(out[3], RequeueOutcome::NotFound);
    assert_eq!(out[4], RequeueOutcome::NotOwned(PartitionId(2)));
    assert_eq!(
        quota(&sql, 1).await,
        (3_000, 0),
        "1 and 2 hold their estimates again"
    );

    // A QUEUED task in a partition not given is not this caller's to take back.
    let out = db
        .requeue_failed(&[TaskId(4)], &[PartitionId(2)], "alice", "again")
        .await
        .unwrap();
    assert_eq!(out, [RequeueOutcome::NotFailed(TaskState::Queued)]);

    // Task 3's estimate no longer fits what is left (4,000 − 3,000 reserved): refused.
    db.set_tenant_budget(TenantId(1), 3_500, "ops", "less budget")
        .await
        .unwrap();
    let out = db
        .requeue_failed(&[TaskId(3)], &mine, "alice", "again")
        .await
        .unwrap();
    assert_eq!(
        out,
        [RequeueOutcome::BudgetExhausted {
            remaining_milli: 500
        }]
    );

    // The requeued tasks run again — attempt 2, a new request key — and settle their new
    // cycle: the ledger holds one cycle each, the closed ones moved aside.
    run(&db, &[1, 2], version, TaskState::Succeeded).await;
    assert_eq!(quota(&sql, 1).await, (1_000, 2_000));
    let ledger = |table: &'static str| {
        let sql = &sql;
        async move {
            sql.query(
                &format!("SELECT task_id, kind FROM {table} WHERE task_id IN (1, 2) ORDER BY task_id, entry_id"),
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get::<_, i64>(0), r.get::<_, String>(1)))
            .collect::<Vec<_>>()
        }
    };
    let open = vec![
        (1, "RESERVE".to_string()),
        (1, "SETTLE".to_string()),
        (2, "RESERVE".to_string()),
        (2, "SETTLE".to_string()),
    ];
    assert_eq!(ledger("quota_ledger").await, open);
    let closed = vec![
        (1, "RESERVE".to_string()),
        (1, "REFUND".to_string()),
        (2, "RESERVE".to_string()),
        (2, "REFUND".to_string()),
    ];
    assert_eq!(ledger("quota_ledger_closed").await, closed);
    let attempts: Vec<i32> = common::column(
        &sql,
        "SELECT attempt_no FROM task WHERE task_id IN (1, 2) ORDER BY task_id",
    )
    .await;
    assert_eq!(attempts, [2, 2]);
    // Both attempts of each are on record: the failed one moved to the history by the requeue,
    // the one that ended the task kept in its row.
    let ended: Vec<String> = common::column(
        &sql,
        "SELECT task_id || ':' || attempt_no || ':' || outcome || ':' || provider_request_key
           FROM task_attempt WHERE task_id IN (1, 2) ORDER BY task_id, attempt_no",
    )
    .await;
    assert_eq!(
        ended,
        [
            "1:1:FAILED:spindle-1-1",
            "1:2:SUCCEEDED:spindle-1-2",
            "2:1:FAILED:spindle-2-1",
            "2:2:SUCCEEDED:spindle-2-2"
        ]
    );
    // The events and the audit name the operator.
    let events: i64 = sql
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE kind = 'QUEUED'
                AND body ->> 'reason' = 'operator requeue by alice: the provider is back'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(events, 2);
    let audited: i64 = sql
        .query_one(
            "SELECT count(*) FROM audit_log WHERE actor = 'alice' AND object_kind = 'task'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(audited, 3, "one row per call");
    common::assert_counters_derived(&test).await;

    // A task that had the most attempts any task gets stays FAILED.
    sql.execute("UPDATE task SET attempt_no = 64 WHERE task_id = 3", &[])
        .await
        .unwrap();
    let out = db
        .requeue_failed(&[TaskId(3)], &mine, "alice", "once more")
        .await
        .unwrap();
    assert_eq!(out, [RequeueOutcome::AttemptsExhausted { attempts: 64 }]);

    assert!(matches!(
        db.requeue_failed(&[TaskId(1), TaskId(1)], &mine, "alice", "twice")
            .await,
        Err(StoreError::Invalid(InputError::DuplicateTask(TaskId(1))))
    ));
    assert!(matches!(
        db.requeue_failed(&[TaskId(u64::MAX)], &mine, "alice", "too large")
            .await,
        Err(StoreError::Invalid(InputError::OutOfRange {
            field: "task",
            ..
        }))
    ));
    assert!(matches!(
        db.requeue_failed(&[TaskId(1)], &mine, "alice", "").await,
        Err(StoreError::Invalid(InputError::Empty { .. }))
    ));
}
