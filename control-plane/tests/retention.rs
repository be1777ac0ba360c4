//! Retention against a real PostgreSQL: ended tasks leave after their window with their
//! history, nothing live ever does, and a pass is bounded by its scan whatever the table holds.

mod common;

use std::time::Duration;

use common::{claim, finish, granted, setup, task, LEASE_MS, NODE};
use spindle_control::{
    ClaimResult, PartitionId, Report, ReportAction, ReportResult, Retention, StoreError,
    SubmitOutcome,
};
use spindle_core::{PolicyVersion, TaskId, TaskState};

const V1: PolicyVersion = PolicyVersion(1);
const POOL: &str = "provider:acme";
const ALL: [PartitionId; 4] = [
    PartitionId(0),
    PartitionId(1),
    PartitionId(2),
    PartitionId(3),
];

#[tokio::test]
async fn ended_tasks_leave_after_their_window_and_live_ones_never() {
    let (test, db) = setup().await;
    db.set_pool(POOL, 100, 1).await.unwrap();
    // Tasks 1..=6 of tenant 1 (partition 1); 7 of tenant 2 (partition 2).
    let batch: Vec<_> = (1..=7)
        .map(|i| task(i, if i == 7 { 2 } else { 1 }, &format!("k{i}")))
        .collect();
    db.submit_batch(&batch, V1).await.unwrap();
    let claims: Vec<_> = [1, 2, 3, 4, 7]
        .iter()
        .map(|&i| claim(i, 0, &[(POOL, 0, 1)]))
        .collect();
    let tokens: Vec<_> = db
        .claim_batch(NODE, LEASE_MS, &claims)
        .await
        .unwrap()
        .iter()
        .map(granted)
        .collect();
    // 1 is retried once: its first attempt ends in a requeue (into the history), its second
    // ends the task (kept in its row).
    let requeue = Report {
        task: TaskId(1),
        token: Some(tokens[0]),
        via: vec![],
        action: ReportAction::Requeue {
            delay_ms: 0,
            reason: "retry".into(),
        },
    };
    let r = db.report_batch(&[requeue]).await.unwrap();
    assert!(matches!(r[0], ReportResult::Applied { .. }), "{r:?}");
    let second = match &db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 2, &[(POOL, 0, 1)])])
        .await
        .unwrap()[0]
    {
        ClaimResult::Granted { token, .. } => *token,
        other => panic!("{other:?}"),
    };
    // 1 succeeded, 2 failed, 3 canceled, 7 succeeded (another partition); 4 runs; 5, 6 queue.
    let reports = vec![
        finish(1, second, TaskState::Succeeded),
        finish(2, tokens[1], TaskState::Failed),
        finish(3, tokens[2], TaskState::Canceled),
        finish(7, tokens[4], TaskState::Succeeded),
    ];
    for r in db.report_batch(&reports).await.unwrap() {
        assert!(matches!(r, ReportResult::Applied { .. }), "{r:?}");
    }
    let sql = test.sql().await.unwrap();
    let left = || async {
        let ids: Vec<i64> = common::column(&sql, "SELECT task_id FROM task ORDER BY task_id").await;
        // Ended attempts, in the history or kept in their task's row.
        let history: i64 = sql
            .query_one(
                "SELECT count(*) FROM task_attempt WHERE outcome IS NOT NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (ids, history)
    };
    assert_eq!(left().await, (vec![1, 2, 3, 4, 5, 6, 7], 5));

    // Within the window nothing goes.
    let long = Retention {
        finished: Some(Duration::from_secs(3600)),
        failed: Some(Duration::from_secs(3600)),
        after_relay: false,
    };
    let p = db.prune_finished(&ALL, long, None, 100).await.unwrap();
    assert_eq!((p.walked, p.tasks, p.next), (7, 0, None));
    // Make the ended tasks an hour old, as if the window had passed.
    sql.execute(
        "UPDATE task SET updated_at = now() - interval '2 hours' WHERE task_id IN (1, 2, 3, 7)",
        &[],
    )
    .await
    .unwrap();
    // Failed tasks keep a window of their own (here: forever); only the partitions asked for
    // are touched.
    let keep_failed = Retention {
        finished: Some(Duration::from_secs(3600)),
        failed: None,
        after_relay: false,
    };
    let p = db
        .prune_finished(&[PartitionId(1)], keep_failed, None, 100)
        .await
        .unwrap();
    assert_eq!((p.tasks, p.attempts), (2, 3), "{p:?}");
    assert_eq!(left().await, (vec![2, 4, 5, 6, 7], 2));
    // The running task is untouched by a window of zero; the failed one goes now.
    let now = Retention {
        finished: Some(Duration::ZERO),
        failed: Some(Duration::ZERO),
        after_relay: false,
    };
    db.prune_finished(&ALL, now, None, 100).await.unwrap();
    assert_eq!(left().await, (vec![4, 5, 6], 0));

    // A pruned key is forgotten: the same submit is a new task.
    let out = db.submit_batch(&[task(8, 1, "k1")], V1).await.unwrap();
    assert_eq!(out, vec![SubmitOutcome::Created]);
    // The running one still finishes as usual.
    let r = db
        .report_batch(&[finish(4, tokens[3], TaskState::Succeeded)])
        .await
        .unwrap();
    assert!(matches!(r[0], ReportResult::Applied { .. }), "{r:?}");
}

#[tokio::test]
async fn a_pass_walks_at_most_its_scan_and_hands_back_a_cursor() {
    let (test, db) = setup().await;
    let batch: Vec<_> = (1..=10).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&batch, V1).await.unwrap();
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE task SET state = 'CANCELED', created_at = now() - interval '2 hours',
                         updated_at = now() - interval '1 hour'",
        &[],
    )
    .await
    .unwrap();
    let keep = Retention {
        finished: Some(Duration::from_secs(60)),
        failed: None,
        after_relay: false,
    };
    let mut cursor = None;
    let mut passes = Vec::new();
    loop {
        let p = db.prune_finished(&ALL, keep, cursor, 4).await.unwrap();
        passes.push((p.walked, p.tasks));
        cursor = p.next;
        if cursor.is_none() {
            break;
        }
    }
    assert_eq!(passes, vec![(4, 4), (4, 4), (2, 2)]);
    let left: i64 = sql
        .query_one("SELECT count(*) FROM task", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
    // Tasks created within the window cannot have ended before it: the walk stops at them and
    // starts over at the oldest, instead of reading the recent rows pass after pass.
    let batch: Vec<_> = (11..=20).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&batch, V1).await.unwrap();
    sql.execute("UPDATE task SET state = 'CANCELED'", &[])
        .await
        .unwrap();
    let p = db.prune_finished(&ALL, keep, None, 4).await.unwrap();
    assert_eq!((p.walked, p.tasks, p.next), (4, 0, None));
    let err = db.prune_finished(&ALL, keep, None, 0).await.unwrap_err();
    assert!(matches!(err, StoreError::Invalid(_)), "{err:?}");
}

#[tokio::test]
async fn old_delivered_events_leave_and_undelivered_ones_wait_for_the_relay() {
    let (test, db) = setup().await;
    db.set_pool(POOL, 100, 1).await.unwrap();
    // One outbox row per claim batch: four rows.
    for i in 1..=4u64 {
        db.submit_batch(&[task(i, 1, &format!("k{i}"))], V1)
            .await
            .unwrap();
        db.claim_batch(NODE, LEASE_MS, &[claim(i, 0, &[(POOL, 0, 1)])])
            .await
            .unwrap();
    }
    let sql = test.sql().await.unwrap();
    let ids = rows(&sql).await;
    assert_eq!(ids.len(), 4);
    // Rows 1–3 are two days old, row 4 is new; rows 1 and 4 were delivered.
    sql.execute(
        "UPDATE outbox_batch SET created_at = now() - interval '2 days' WHERE batch_id <> $1",
        &[&ids[3]],
    )
    .await
    .unwrap();
    sql.execute(
        "UPDATE outbox_batch SET delivered = 1, delivered_at = now() WHERE batch_id = ANY ($1)",
        &[&vec![ids[0], ids[3]]],
    )
    .await
    .unwrap();
    let day = Duration::from_secs(86_400);
    assert_eq!(db.prune_events(day, false, 100).await.unwrap(), 1);
    assert_eq!(
        rows(&sql).await,
        ids[1..].to_vec(),
        "only the old delivered row left"
    );
    // Without a relay nobody takes the old undelivered rows: they go too; a pass reads at
    // most `scan` rows from the oldest.
    assert_eq!(db.prune_events(day, true, 1).await.unwrap(), 1);
    assert_eq!(db.prune_events(day, true, 100).await.unwrap(), 1);
    assert_eq!(rows(&sql).await, vec![ids[3]], "the recent row stays");
    assert!(matches!(
        db.prune_events(day, true, 0).await,
        Err(StoreError::Invalid(_))
    ));
}

async fn rows(sql: &tokio_postgres::Client) -> Vec<i64> {
    sql.query("SELECT batch_id FROM outbox_batch ORDER BY batch_id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, i64>(0))
        .collect()
}

/// A sink that takes every event, counting them.
struct Taker(usize);

impl spindle_control::events::EventSink for Taker {
    type Error = String;
    async fn deliver(&mut self, events: &[spindle_control::events::Event]) -> Result<(), String> {
        self.0 += events.len();
        Ok(())
    }
}

/// Where the cluster relays its events, an ended task stays past its window while an event
/// written at or before its end waits for the relay (which reads the task's result when it
/// sends the end event), and leaves once the relay has sent it — an event written after its
/// end does not hold it.
#[tokio::test]
async fn with_a_relay_an_ended_task_stays_until_its_end_event_is_sent() {
    let (test, mut db) = setup().await;
    db.set_pool(POOL, 100, 1).await.unwrap();
    db.submit_batch(&[task(1, 1, "k1"), task(2, 1, "k2")], V1)
        .await
        .unwrap();
    let claims = [claim(1, 0, &[(POOL, 0, 1)]), claim(2, 0, &[(POOL, 0, 1)])];
    let tokens: Vec<_> = db
        .claim_batch(NODE, LEASE_MS, &claims)
        .await
        .unwrap()
        .iter()
        .map(granted)
        .collect();
    let reports = [
        finish(1, tokens[0], TaskState::Succeeded),
        finish(2, tokens[1], TaskState::Succeeded),
    ];
    for r in db.report_batch(&reports).await.unwrap() {
        assert!(matches!(r, ReportResult::Applied { .. }), "{r:?}");
    }
    // Both ended two hours ago, and so were their events written (in the same transactions).
    let sql = test.sql().await.unwrap();
    sql.batch_execute(
        "UPDATE task SET updated_at = updated_at - interval '2 hours';
         UPDATE outbox_batch SET created_at = created_at - interval '2 hours';",
    )
    .await
    .unwrap();
    let keep = Retention {
        finished: Some(Duration::from_secs(60)),
        failed: Some(Duration::from_secs(60)),
        after_relay: true,
    };
    let tasks =
        || async { common::column::<i64>(&sql, "SELECT task_id FROM task ORDER BY 1").await };
    let p = db.prune_finished(&ALL, keep, None, 100).await.unwrap();
    assert_eq!((p.walked, p.tasks), (2, 0), "their events wait: {p:?}");
    assert_eq!(tasks().await, vec![1, 2]);

    let mut sink = Taker(0);
    let sent = db.relay_events(&mut sink, 1000).await.unwrap();
    assert!(sent.delivered > 0 && sent.failed_at.is_none(), "{sent:?}");
    // A task claimed now writes an event the relay has not sent: it is younger than their ends.
    db.submit_batch(&[task(3, 1, "k3")], V1).await.unwrap();
    let third = db
        .claim_batch(NODE, LEASE_MS, &[claim(3, 0, &[(POOL, 0, 1)])])
        .await
        .unwrap();
    assert!(matches!(third[0], ClaimResult::Granted { .. }), "{third:?}");
    let p = db.prune_finished(&ALL, keep, None, 100).await.unwrap();
    assert_eq!(p.tasks, 2, "{p:?}");
    assert_eq!(tasks().await, vec![3]);
}

/// Audit rows past their window go, oldest first, a bounded number a pass; recent ones stay.
#[tokio::test]
async fn old_audit_rows_are_pruned_and_recent_ones_kept() {
    let (test, mut db) = setup().await;
    for i in 0..3 {
        db.audit_action("ada", "refused", &format!("call {i}"), "test")
            .await
            .unwrap();
    }
    let sql = test.sql().await.unwrap();
    // All but the newest are two days old.
    sql.execute(
        "UPDATE audit_log SET at = now() - interval '2 days'
          WHERE audit_id <> (SELECT max(audit_id) FROM audit_log)",
        &[],
    )
    .await
    .unwrap();
    let count = async || -> i64 {
        sql.query_one("SELECT count(*) FROM audit_log", &[])
            .await
            .unwrap()
            .get(0)
    };
    let before = count().await;
    let day = Duration::from_secs(86_400);
    assert_eq!(db.prune_audit(day, 1).await.unwrap(), 1);
    assert_eq!(db.prune_audit(day, 100).await.unwrap(), 1);
    assert_eq!(db.prune_audit(day, 100).await.unwrap(), 0);
    assert_eq!(count().await, before - 2);
    let newest: String = sql
        .query_one(
            "SELECT object_key FROM audit_log ORDER BY audit_id DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(newest, "call 2");
    assert!(matches!(
        db.prune_audit(day, 0).await,
        Err(StoreError::Invalid(_))
    ));
}
