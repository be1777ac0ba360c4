//! Reconciler jobs' queries, one test each: counter rebuild, lapsed and stuck attempts, the
//! QUEUED rebuild, the starvation detector, and the outbox relay.

mod common;

use common::{
    age_live_attempts, assert_counters_derived, claim, finish, setup, task, LEASE_MS, NODE,
};
use spindle_control::events::{Event, EventSink};
use spindle_control::reconcile::{BudgetDrift, Counters};
use spindle_control::{ClaimResult, PartitionId, Report, ReportAction, ReportResult};
use spindle_core::{PolicyVersion, TaskId, TaskState, TenantId};

const V1: PolicyVersion = PolicyVersion(1);

#[tokio::test]
async fn drifted_counters_are_rebuilt_from_active_reservations() {
    let (test, mut db) = setup().await;
    db.set_pool("provider:acme", 10, 2).await.unwrap();
    db.submit_batch(&[task(1, 1, "a"), task(2, 1, "b")], V1)
        .await
        .unwrap();
    db.claim_batch(
        NODE,
        LEASE_MS,
        &[
            claim(1, 0, &[("provider:acme", 0, 3)]),
            claim(2, 0, &[("provider:acme", 1, 2)]),
        ],
    )
    .await
    .unwrap();
    assert!(
        db.check_counters().await.unwrap().is_empty(),
        "no drift yet"
    );
    assert!(
        db.rebuild_counters().await.unwrap().is_empty(),
        "no drift yet"
    );
    // Inject drift: a counter lost an update, another gained a phantom one.
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE resource_pool_shard SET used = 0 WHERE shard = 0",
        &[],
    )
    .await
    .unwrap();
    sql.execute(
        "UPDATE resource_pool_shard SET used = 5 WHERE shard = 1",
        &[],
    )
    .await
    .unwrap();
    let seen = |drift: Counters| -> Vec<(u16, i64, i64)> {
        assert!(drift.budgets.is_empty(), "{drift:?}");
        drift
            .pools
            .iter()
            .map(|d| (d.shard.shard, d.stored, d.derived))
            .collect()
    };
    // The check sees the drift and changes nothing; the rebuild repairs it.
    assert_eq!(
        seen(db.check_counters().await.unwrap()),
        vec![(0, 0, 3), (1, 5, 2)]
    );
    assert_eq!(
        seen(db.check_counters().await.unwrap()),
        vec![(0, 0, 3), (1, 5, 2)]
    );
    assert_eq!(
        seen(db.rebuild_counters().await.unwrap()),
        vec![(0, 0, 3), (1, 5, 2)]
    );
    assert!(db.check_counters().await.unwrap().is_empty());
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn a_drifted_reserved_budget_is_found_and_rebuilt_from_the_open_ledger_cycles() {
    let (test, mut db) = setup().await;
    db.set_tenant_budget(TenantId(1), 10_000, "ops", "test budget")
        .await
        .unwrap();
    // Three tasks of 1,000 reserved; one of them finished (its cycle closed with a REFUND).
    let batch: Vec<_> = (1..=3).map(|i| task(i, 1, &format!("b{i}"))).collect();
    db.submit_batch(&batch, V1).await.unwrap();
    let granted = db
        .claim_batch(NODE, LEASE_MS, &[claim(3, 0, &[])])
        .await
        .unwrap();
    let ClaimResult::Granted { token, .. } = granted[0] else {
        panic!("{granted:?}");
    };
    let finished = db
        .report_batch(&[finish(3, token, TaskState::Canceled)])
        .await
        .unwrap();
    assert!(
        matches!(finished[0], ReportResult::Applied { .. }),
        "{finished:?}"
    );
    let reserved = async || -> i64 {
        test.sql()
            .await
            .unwrap()
            .query_one(
                "SELECT reserved_milli FROM tenant_quota WHERE tenant_id = 1",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    };
    assert_eq!(reserved().await, 2_000);
    assert!(db.check_counters().await.unwrap().is_empty());
    // A lost update: the counter forgot one reservation.
    test.sql()
        .await
        .unwrap()
        .execute(
            "UPDATE tenant_quota SET reserved_milli = 1000 WHERE tenant_id = 1",
            &[],
        )
        .await
        .unwrap();
    let expected = vec![BudgetDrift {
        tenant: TenantId(1),
        stored: 1_000,
        derived: 2_000,
    }];
    let found = db.check_counters().await.unwrap();
    assert_eq!((found.pools.len(), &found.budgets), (0, &expected));
    assert_eq!(reserved().await, 1_000, "the check changes nothing");
    assert_eq!(db.rebuild_counters().await.unwrap().budgets, expected);
    assert_eq!(reserved().await, 2_000);
    assert_counters_derived(&test).await;
}

/// The attempts reconciler's question: of the owned partitions' live attempts, those whose
/// lease lapsed (lapsed first) and those stuck in DISPATCHING or SUBMIT_UNKNOWN past the
/// threshold even with a renewed lease — never a fresh one, one of another partition, one that
/// ended, or more than the bound.
#[tokio::test]
async fn lapsed_and_stuck_attempts_of_owned_partitions_are_found_and_no_others() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 10, 1).await.unwrap();
    // Tenant 1's tasks are in partition 1, tenant 2's in partition 2.
    let batch = [
        task(1, 1, "a"),
        task(2, 1, "b"),
        task(3, 1, "c"),
        task(4, 2, "d"),
    ];
    db.submit_batch(&batch, V1).await.unwrap();
    let claims: Vec<_> = (1..=4)
        .map(|i| claim(i, 0, &[("provider:acme", 0, 1)]))
        .collect();
    let grants = db.claim_batch(NODE, LEASE_MS, &claims).await.unwrap();
    let token = |i: usize| match &grants[i] {
        ClaimResult::Granted { token, .. } => *token,
        other => panic!("{other:?}"),
    };
    let mine = [PartitionId(1)];
    let found = async |stuck_ms: u32, limit: usize| -> Vec<u64> {
        db.lapsed_owned(&mine, stuck_ms, limit)
            .await
            .unwrap()
            .iter()
            .map(|o| o.task.task.0)
            .collect()
    };
    assert!(found(60_000, 100).await.is_empty(), "fresh attempts");
    // Task 2 reached RUNNING; then the node stopped renewing.
    db.report_batch(&[Report::new(
        TaskId(2),
        Some(token(1)),
        ReportAction::Advance(TaskState::Running),
    )])
    .await
    .unwrap();
    age_live_attempts(&test, LEASE_MS + 1_000).await;
    let mut lapsed = found(3_600_000, 100).await;
    lapsed.sort_unstable();
    assert_eq!(lapsed, [1, 2, 3]);
    assert_eq!(found(3_600_000, 2).await.len(), 2, "bounded");
    // Task 3 ended meanwhile; task 1's lease is renewed but it sat in DISPATCHING too long.
    db.report_batch(&[Report::new(
        TaskId(3),
        Some(token(2)),
        ReportAction::Finish {
            state: TaskState::Canceled,
            cost_actual_milli: None,
            reason: None,
            result: None,
        },
    )])
    .await
    .unwrap();
    db.renew_attempts(&[(TaskId(1), token(0))], LEASE_MS)
        .await
        .unwrap();
    assert_eq!(found(3_600_000, 100).await, [2], "lapsed only");
    assert_eq!(
        found(1_000, 100).await,
        [2, 1],
        "the lapsed one first, then the stuck one"
    );
    let live = db.lapsed_owned(&mine, 1_000, 100).await.unwrap();
    let of_1 = live[1].live.as_ref().expect("a live attempt");
    assert_eq!(
        (of_1.state, of_1.token, of_1.request_key.as_str()),
        (TaskState::Dispatching, token(0), "spindle-1-1")
    );
}

#[tokio::test]
async fn queued_tasks_and_live_attempts_of_owned_partitions_are_reloaded_page_by_page() {
    let (_test, db) = setup().await;
    // Tenants 1..=8 hash to partition tenant % 4.
    let batch: Vec<_> = (1..=40)
        .map(|i| task(i, (i % 8 + 1) as u32, &format!("k{i}")))
        .collect();
    db.submit_batch(&batch, V1).await.unwrap();
    db.set_pool("p", 100, 1).await.unwrap();
    db.claim_batch(NODE, LEASE_MS, &[claim(1, 0, &[("p", 0, 1)])])
        .await
        .unwrap();
    let mine = [PartitionId(1), PartitionId(2)];
    let mut seen = Vec::new();
    let mut live = Vec::new();
    let mut last = None;
    loop {
        let page = db.load_owned(&mine, last, 7).await.unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 7);
        for o in &page {
            match &o.live {
                None => seen.push((o.task.partition, o.task.task)),
                Some(l) => live.push((o.task.task, l.state, l.request_key.clone())),
            }
        }
        last = page.last().map(|o| o.task.task);
    }
    assert_eq!(
        live,
        [(TaskId(1), TaskState::Dispatching, "spindle-1-1".to_string())],
        "the claimed task comes back with its live attempt"
    );
    let mut expected: Vec<(PartitionId, TaskId)> = batch
        .iter()
        .filter(|t| mine.contains(&t.partition) && t.task != TaskId(1))
        .map(|t| (t.partition, t.task))
        .collect();
    expected.sort();
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(
        sorted, expected,
        "every queued task of the partitions, once"
    );
    assert_eq!(seen.len(), expected.len());
}

/// A stored cancel marks a task that has not ended, and the task comes back marked when a
/// node puts its partition's tasks back (queued, or with its live attempt); an ended task or a
/// missing one is not marked, and marking again changes nothing.
#[tokio::test]
async fn a_stored_cancel_marks_a_live_task_and_comes_back_with_it() {
    let (_test, db) = setup().await;
    // Tenant 1's tasks are on partition 1.
    let batch: Vec<_> = (1..=3).map(|i| task(i, 1, &format!("c{i}"))).collect();
    db.submit_batch(&batch, V1).await.unwrap();
    db.set_pool("p", 100, 1).await.unwrap();
    db.claim_batch(NODE, LEASE_MS, &[claim(2, 0, &[("p", 0, 1)])])
        .await
        .unwrap();
    let ended = Report::new(
        TaskId(3),
        None,
        ReportAction::Finish {
            state: TaskState::Canceled,
            cost_actual_milli: None,
            reason: None,
            result: None,
        },
    );
    let applied = db.report_batch(&[ended]).await.unwrap();
    assert!(
        matches!(applied[0], ReportResult::Applied { .. }),
        "{applied:?}"
    );
    let asked = [TaskId(1), TaskId(2), TaskId(3), TaskId(99)];
    assert_eq!(
        db.request_cancel(&asked).await.unwrap(),
        [true, true, false, false]
    );
    assert_eq!(
        db.request_cancel(&asked).await.unwrap(),
        [true, true, false, false],
        "marking again"
    );
    let back = db.load_owned(&[PartitionId(1)], None, 10).await.unwrap();
    let marks: Vec<(TaskId, bool, bool)> = back
        .iter()
        .map(|o| (o.task.task, o.live.is_some(), o.cancel_requested))
        .collect();
    assert_eq!(
        marks,
        [(TaskId(1), false, true), (TaskId(2), true, true)],
        "the queued and the live task, both marked; the ended one not put back"
    );
    // Read as stored, a marked task keeps its state; its client reads it CANCELED (it was
    // told so), and an ended one as it ended.
    let mut stored = db
        .task_statuses(&[TaskId(1), TaskId(2), TaskId(3)])
        .await
        .unwrap();
    stored.sort_by_key(|(_, t)| t.task);
    let raw: Vec<(TaskState, bool)> = stored
        .iter()
        .map(|(_, t)| (t.state, t.cancel_requested))
        .collect();
    assert_eq!(
        raw,
        [
            (TaskState::Queued, true),
            (TaskState::Dispatching, true),
            (TaskState::Canceled, false)
        ]
    );
    for (tenant, t) in &stored {
        let seen = db.task_status(*tenant, t.task).await.unwrap().unwrap();
        assert_eq!(seen.state, TaskState::Canceled, "{}", t.task);
    }
}

#[tokio::test]
async fn the_starvation_detector_reports_long_waits_but_not_backoffs() {
    let (test, db) = setup().await;
    db.submit_batch(&[task(1, 1, "a"), task(2, 2, "b"), task(3, 3, "c")], V1)
        .await
        .unwrap();
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE task SET created_at = now() - interval '10 minutes' WHERE task_id IN (1, 2)",
        &[],
    )
    .await
    .unwrap();
    // Task 2 is backing off after a 429: not starving, waiting on purpose.
    sql.execute(
        "UPDATE task SET next_eligible_at = now() + interval '1 minute' WHERE task_id = 2",
        &[],
    )
    .await
    .unwrap();
    let starved = db
        .starved_tasks(&(0..4).map(PartitionId).collect::<Vec<_>>(), 60_000, 100)
        .await
        .unwrap();
    assert_eq!(starved.len(), 1);
    assert_eq!(starved[0].task, TaskId(1));
    assert!(starved[0].waited_ms >= 600_000, "{starved:?}");
}

/// A sink that refuses once, then takes everything.
struct FlakySink {
    fail_next: bool,
    got: Vec<u64>,
    bodies: Vec<serde_json::Value>,
}

impl EventSink for FlakySink {
    type Error = String;
    async fn deliver(&mut self, events: &[Event]) -> Result<(), String> {
        if std::mem::take(&mut self.fail_next) {
            return Err("sink down".into());
        }
        for e in events {
            self.got.push(e.id);
            self.bodies.push(e.body.clone());
        }
        Ok(())
    }
}

#[tokio::test]
async fn the_outbox_is_relayed_at_least_once_and_consumers_apply_each_event_once() {
    let (_test, mut db) = setup().await;
    db.set_pool("p", 100, 1).await.unwrap();
    let batch: Vec<_> = (1..=5).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&batch, V1).await.unwrap();
    let claims: Vec<_> = (1..=5).map(|i| claim(i, 0, &[("p", 0, 1)])).collect();
    db.claim_batch(NODE, LEASE_MS, &claims).await.unwrap();
    assert_eq!(db.pending_events().await.unwrap(), 5);

    let mut sink = FlakySink {
        fail_next: true,
        got: Vec::new(),
        bodies: Vec::new(),
    };
    let first_id = {
        let sql = db.client();
        sql.query_one("SELECT min(event_id) FROM outbox_event", &[])
            .await
            .unwrap()
            .get::<_, i64>(0) as u64
    };
    // A refused batch stays pending, whole.
    let r = db.relay_events(&mut sink, 100).await.unwrap();
    assert_eq!(r.delivered, 0);
    assert_eq!(r.failed_at, Some((first_id, "sink down".to_string())));
    assert_eq!(db.pending_events().await.unwrap(), 5);
    // Part of a row, then the rest of it.
    let r = db.relay_events(&mut sink, 2).await.unwrap();
    assert_eq!((r.delivered, r.failed_at.clone()), (2, None));
    assert_eq!(db.pending_events().await.unwrap(), 3);
    let r = db.relay_events(&mut sink, 100).await.unwrap();
    assert_eq!((r.delivered, r.failed_at), (3, None));
    assert_eq!(
        sink.got,
        (first_id..first_id + 5).collect::<Vec<_>>(),
        "in order, none skipped, none twice"
    );
    assert_eq!(db.pending_events().await.unwrap(), 0);
    // Each event's body comes out of its batch row's details, the same through the relay and
    // through the view.
    let viewed: Vec<serde_json::Value> = common::column(
        db.client(),
        "SELECT body FROM outbox_event ORDER BY event_id",
    )
    .await;
    assert_eq!(sink.bodies, viewed);
    assert_eq!(sink.bodies[3]["attempt_no"], 1);
    assert_eq!(sink.bodies[3]["node"], NODE);
    assert!(
        sink.bodies[3]["attempt"].as_i64().is_some(),
        "{:?}",
        sink.bodies[3]
    );

    // A consumer that sees an event twice (a relay crashed before its commit) applies it once.
    let mut applied = 0;
    for id in [first_id, first_id, first_id + 1] {
        if db.consume_once("billing", id).await.unwrap() {
            applied += 1;
        }
    }
    assert_eq!(applied, 2);
}

/// A SUCCEEDED event, as relayed, carries its task's result; the task's other events do not.
#[tokio::test]
async fn a_relayed_success_carries_the_tasks_result() {
    let (_test, mut db) = setup().await;
    db.set_pool("p", 100, 1).await.unwrap();
    db.submit_batch(&[task(1, 1, "k1")], V1).await.unwrap();
    let granted = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &[("p", 0, 1)])])
        .await
        .unwrap();
    let mut done =
        common::finish_costing(1, common::granted(&granted[0]), TaskState::Succeeded, None);
    if let ReportAction::Finish { result, .. } = &mut done.action {
        *result = Some(r#"{"outputs":["/media/task-1-720p.mp4"]}"#.into());
    }
    let applied = db.report_batch(&[done]).await.unwrap();
    assert!(
        matches!(applied[0], ReportResult::Applied { .. }),
        "{applied:?}"
    );
    let mut sink = FlakySink {
        fail_next: false,
        got: Vec::new(),
        bodies: Vec::new(),
    };
    db.relay_events(&mut sink, 100).await.unwrap();
    let kinds: Vec<String> = common::column(
        db.client(),
        "SELECT kind FROM outbox_event ORDER BY event_id",
    )
    .await;
    assert_eq!(kinds.len(), sink.bodies.len());
    for (kind, body) in kinds.iter().zip(&sink.bodies) {
        if kind == "SUCCEEDED" {
            assert_eq!(
                body["result"],
                serde_json::json!({ "outputs": ["/media/task-1-720p.mp4"] })
            );
        } else {
            assert!(body.get("result").is_none(), "{kind}: {body}");
        }
    }
    assert!(kinds.iter().any(|k| k == "SUCCEEDED"), "{kinds:?}");
}

/// A sink that, while it holds a batch, has a second relay (another connection: another node)
/// try at the same time.
struct RacingSink {
    other: spindle_control::Db,
    others_report: Option<spindle_control::events::RelayReport>,
    got: usize,
}

impl EventSink for RacingSink {
    type Error = String;
    async fn deliver(&mut self, events: &[Event]) -> Result<(), String> {
        let mut inner = FlakySink {
            fail_next: false,
            got: Vec::new(),
            bodies: Vec::new(),
        };
        let r = self.other.relay_events(&mut inner, 100).await.unwrap();
        assert!(
            inner.got.is_empty(),
            "a second relay delivered {:?}",
            inner.got
        );
        self.others_report = Some(r);
        self.got += events.len();
        Ok(())
    }
}

#[tokio::test]
async fn one_relay_runs_at_a_time_across_nodes() {
    let (test, mut db) = setup().await;
    db.set_pool("p", 100, 1).await.unwrap();
    let batch: Vec<_> = (1..=3).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&batch, V1).await.unwrap();
    let claims: Vec<_> = (1..=3).map(|i| claim(i, 0, &[("p", 0, 1)])).collect();
    db.claim_batch(NODE, LEASE_MS, &claims).await.unwrap();
    let mut sink = RacingSink {
        other: spindle_control::Db::open(test.config()).await.unwrap(),
        others_report: None,
        got: 0,
    };
    let r = db.relay_events(&mut sink, 100).await.unwrap();
    assert_eq!((r.delivered, sink.got), (3, 3));
    assert_eq!(
        sink.others_report,
        Some(Default::default()),
        "the second relay stood aside"
    );
    assert_eq!(db.pending_events().await.unwrap(), 0);
}
