//! Submit → claim → advance → finish against a real PostgreSQL, with the fences and idempotency
//! that make each step safe to repeat.

mod common;

use common::{
    assert_counters_derived, claim, finish, finish_costing, granted, setup, task, LEASE_MS, NODE,
};
use spindle_control::{
    ClaimRefusal, ClaimResult, NewTask, PoolShard, Report, ReportAction, ReportResult,
    SubmitOutcome,
};
use spindle_core::{FencingToken, PolicyVersion, TaskId, TaskState};

const V1: PolicyVersion = PolicyVersion(1);

/// Submits `tasks` and claims each on one unit of `provider:acme`; their tokens, in order.
async fn submit_and_claim(db: &spindle_control::Db, tasks: &[NewTask]) -> Vec<FencingToken> {
    db.submit_batch(tasks, V1).await.unwrap();
    let claims: Vec<_> = tasks
        .iter()
        .map(|t| claim(t.task.0, 0, &[("provider:acme", 0, 1)]))
        .collect();
    db.claim_batch(NODE, LEASE_MS, &claims)
        .await
        .unwrap()
        .iter()
        .map(granted)
        .collect()
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
        via: Vec::new(),
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
                via: Vec::new(),
                action: ReportAction::Advance(to),
            }])
            .await
            .unwrap();
        assert!(matches!(r[0], ReportResult::Applied { .. }), "{r:?}");
    }
    let finish = Report {
        task: TaskId(1),
        token: Some(token),
        via: Vec::new(),
        action: ReportAction::Finish {
            state: TaskState::Succeeded,
            cost_actual_milli: Some(1_300),
            reason: None,
            result: None,
        },
    };
    let r = db
        .report_batch(std::slice::from_ref(&finish))
        .await
        .unwrap();
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
    assert_eq!(
        r[0],
        ReportResult::StaleToken {
            current: None,
            state: TaskState::Succeeded
        }
    );
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

/// A batch granted whole (the fast path) charges each pool the batch's total and gives every
/// claim its own token; a batch whose total does not fit, though each claim would alone, is
/// decided claim by claim: the first ones granted, the rest refused, nothing charged for them.
#[tokio::test]
async fn a_batch_is_granted_whole_or_claim_by_claim_when_its_total_does_not_fit() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 5, 1).await.unwrap();
    db.set_pool("gpu:h200", 3, 1).await.unwrap();
    let tasks: Vec<_> = (1..=5).map(|i| task(i, 1, &format!("k{i}"))).collect();
    db.submit_batch(&tasks, V1).await.unwrap();
    let both = [("provider:acme", 0, 1), ("gpu:h200", 0, 1)];
    let res = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &both), claim(2, 0, &both)])
        .await
        .unwrap();
    let (a, b) = (granted(&res[0]), granted(&res[1]));
    assert!(b.0 > a.0, "one token per claim, growing");
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 2);
    assert_eq!(db.pool_usage("gpu:h200").await.unwrap()[0].used, 2);
    // One unit of gpu:h200 left for three claims.
    let res = db
        .claim_batch(
            NODE,
            LEASE_MS,
            &[claim(3, 0, &both), claim(4, 0, &both), claim(5, 0, &both)],
        )
        .await
        .unwrap();
    granted(&res[0]);
    let full = ClaimResult::Refused(ClaimRefusal::PoolFull(PoolShard::new("gpu:h200", 0)));
    assert_eq!(res[1..], [full.clone(), full]);
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 3);
    assert_eq!(db.pool_usage("gpu:h200").await.unwrap()[0].used, 3);
    let sql = test.sql().await.unwrap();
    let states: Vec<(i64, String, i32)> = sql
        .query(
            "SELECT task_id, state, cardinality(res_pool) FROM task ORDER BY task_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get::<_, Option<i32>>(2).unwrap_or(0)))
        .collect();
    let d = |id| (id, "DISPATCHING".to_string(), 2);
    let q = |id| (id, "QUEUED".to_string(), 0);
    assert_eq!(states, vec![d(1), d(2), d(3), q(4), q(5)]);
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn submits_are_idempotent_and_a_changed_replay_is_a_conflict() {
    let (test, db) = setup().await;
    let mut changed = task(2, 1, "k1");
    changed.payload = b"another spec".to_vec();
    // One batch: a new task, the same key again (replay of the row before), a changed replay.
    let out = db
        .submit_batch(&[task(1, 1, "k1"), task(3, 1, "k1"), changed], V1)
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            SubmitOutcome::Created,
            SubmitOutcome::Replay {
                task: TaskId(1),
                state: TaskState::Queued
            },
            SubmitOutcome::Conflict { task: TaskId(1) },
        ]
    );
    // A later batch replaying it (new task id from the node) gets the original back.
    let out = db.submit_batch(&[task(4, 1, "k1")], V1).await.unwrap();
    assert_eq!(
        out,
        vec![SubmitOutcome::Replay {
            task: TaskId(1),
            state: TaskState::Queued
        }]
    );
    // The same key for another tenant is another task.
    let out = db.submit_batch(&[task(5, 2, "k1")], V1).await.unwrap();
    assert_eq!(out, vec![SubmitOutcome::Created]);
    let sql = test.sql().await.unwrap();
    let n: i64 = sql
        .query_one("SELECT count(*) FROM task", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
}

/// A batch of new keys that fits its budgets is inserted as it is (the fast path); one replayed
/// key in a batch sends the whole batch to the row-by-row path, and nothing of the attempt
/// stays: every task once, every budget reserved once.
#[tokio::test]
async fn a_batch_with_a_replayed_key_is_decided_row_by_row_and_reserves_once() {
    let (test, mut db) = setup().await;
    db.set_tenant_budget(spindle_core::TenantId(1), 10_000, "ops", "test budget")
        .await
        .unwrap();
    // Budgeted tenant 1 and unbudgeted tenant 2 in one batch that fits: all created.
    let out = db
        .submit_batch(&[task(1, 1, "a"), task(2, 2, "a"), task(3, 1, "b")], V1)
        .await
        .unwrap();
    assert_eq!(out, vec![SubmitOutcome::Created; 3]);
    // New keys around a replay of "b": the replay is answered with task 3, the rest created.
    let out = db
        .submit_batch(&[task(4, 1, "c"), task(5, 1, "b"), task(6, 1, "d")], V1)
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            SubmitOutcome::Created,
            SubmitOutcome::Replay {
                task: TaskId(3),
                state: TaskState::Queued
            },
            SubmitOutcome::Created,
        ]
    );
    let sql = test.sql().await.unwrap();
    let tasks: Vec<i64> = common::column(&sql, "SELECT task_id FROM task ORDER BY task_id").await;
    assert_eq!(tasks, vec![1, 2, 3, 4, 6]);
    let r = sql
        .query_one(
            "SELECT reserved_milli FROM tenant_quota WHERE tenant_id = 1",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        r.get::<_, i64>(0),
        4_000,
        "tasks 1, 3, 4 and 6 at 1,000 each"
    );
    let reserves: Vec<(i64, bool)> = sql
        .query(
            "SELECT l.task_id, t.budget_reserved FROM quota_ledger l JOIN task t USING (task_id)
              WHERE l.kind = 'RESERVE' ORDER BY l.task_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(reserves, vec![(1, true), (3, true), (4, true), (6, true)]);
    let unbudgeted: bool = sql
        .query_one("SELECT budget_reserved FROM task WHERE task_id = 2", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!unbudgeted);
    assert_counters_derived(&test).await;
}

/// One report batch finishing the budgeted tasks of two tenants: each tenant's reservation and
/// spend move by exactly its tasks' estimates and actual costs, summed over the batch; a task
/// whose ledger row is already there (a settle recorded before) is not counted again.
#[tokio::test]
async fn a_finishing_batch_settles_each_tenants_budget_by_its_own_rows() {
    let (test, mut db) = setup().await;
    for tenant in [1, 2] {
        db.set_tenant_budget(spindle_core::TenantId(tenant), 10_000, "ops", "budget")
            .await
            .unwrap();
    }
    db.set_pool("provider:acme", 10, 1).await.unwrap();
    let batch: Vec<_> = (1..=6)
        .map(|i| task(i, if i <= 4 { 1 } else { 2 }, &format!("k{i}")))
        .collect();
    let tokens = submit_and_claim(&db, &batch).await;
    let sql = test.sql().await.unwrap();
    assert_eq!(common::quota(&sql, 1).await, (4_000, 0));
    assert_eq!(common::quota(&sql, 2).await, (2_000, 0));
    sql.execute(
        "INSERT INTO quota_ledger (tenant_id, task_id, kind, amount_milli) VALUES (1, 4, 'SETTLE', 700)",
        &[],
    )
    .await
    .unwrap();
    let end = |i: u64, state: TaskState, cost: Option<u64>| {
        common::finish_costing(i, tokens[i as usize - 1], state, cost)
    };
    let reports = [
        end(1, TaskState::Succeeded, Some(300)),
        end(2, TaskState::Succeeded, None),
        end(3, TaskState::Failed, None),
        end(4, TaskState::Succeeded, Some(500)),
        end(5, TaskState::Succeeded, Some(200)),
        end(6, TaskState::Canceled, None),
    ];
    for r in db.report_batch(&reports).await.unwrap() {
        assert!(matches!(r, ReportResult::Applied { .. }), "{r:?}");
    }
    // Tenant 1: 1 and 2 settled (300, and the estimate without an actual cost), 3 refunded;
    // 4's settle skipped, its ledger row being there already (its estimate stays reserved).
    assert_eq!(common::quota(&sql, 1).await, (1_000, 1_300));
    assert_eq!(common::quota(&sql, 2).await, (0, 200));
    let kinds: Vec<String> = common::column(
        &sql,
        "SELECT task_id || ':' || kind || ':' || amount_milli FROM quota_ledger
          WHERE kind <> 'RESERVE' ORDER BY task_id, kind",
    )
    .await;
    assert_eq!(
        kinds,
        [
            "1:SETTLE:300",
            "2:SETTLE:1000",
            "3:REFUND:1000",
            "4:SETTLE:700",
            "5:SETTLE:200",
            "6:REFUND:1000"
        ]
    );
}

#[tokio::test]
async fn budgets_are_reserved_at_submit_and_settled_or_refunded_once() {
    let (test, mut db) = setup().await;
    db.set_tenant_budget(spindle_core::TenantId(1), 2_500, "ops", "test budget")
        .await
        .unwrap();
    db.set_pool("provider:acme", 10, 1).await.unwrap();
    let out = db
        .submit_batch(&[task(1, 1, "a"), task(2, 1, "b"), task(3, 1, "c")], V1)
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            SubmitOutcome::Created,
            SubmitOutcome::Created,
            SubmitOutcome::QuotaExceeded {
                remaining_milli: 500
            },
        ]
    );
    let sql = test.sql().await.unwrap();
    assert_eq!(common::quota(&sql, 1).await, (2_000, 0));

    let res = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &[("provider:acme", 0, 1)])])
        .await
        .unwrap();
    let token = granted(&res[0]);
    let done = Report {
        task: TaskId(1),
        token: Some(token),
        via: Vec::new(),
        action: ReportAction::Finish {
            state: TaskState::Failed,
            cost_actual_milli: None,
            reason: Some("invalid parameters".into()),
            result: None,
        },
    };
    // DISPATCHING → FAILED is on the whitelist: refund the estimate.
    let r = db.report_batch(&[done]).await.unwrap();
    assert!(
        matches!(
            r[0],
            ReportResult::Applied {
                state: TaskState::Failed,
                released: 1,
                ..
            }
        ),
        "{r:?}"
    );
    assert_eq!(common::quota(&sql, 1).await, (1_000, 0));
    // Cancel the queued task 2 (no attempt, no token): refund once.
    let cancel = Report {
        task: TaskId(2),
        token: None,
        via: Vec::new(),
        action: ReportAction::Finish {
            state: TaskState::Canceled,
            cost_actual_milli: None,
            reason: None,
            result: None,
        },
    };
    let r = db
        .report_batch(std::slice::from_ref(&cancel))
        .await
        .unwrap();
    assert!(
        matches!(
            r[0],
            ReportResult::Applied {
                state: TaskState::Canceled,
                released: 0,
                ..
            }
        ),
        "{r:?}"
    );
    assert_eq!(common::quota(&sql, 1).await, (0, 0));
    // Canceling again: CANCELED is terminal, nothing moves.
    let r = db.report_batch(&[cancel]).await.unwrap();
    assert_eq!(
        r[0],
        ReportResult::IllegalTransition {
            from: TaskState::Canceled,
            to: TaskState::Canceled
        }
    );
    assert_eq!(common::quota(&sql, 1).await, (0, 0));
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn a_requeued_task_gets_a_new_attempt_and_the_old_token_is_fenced() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 1, 1).await.unwrap();
    db.submit_batch(&[task(1, 1, "a")], V1).await.unwrap();
    let demand = [("provider:acme", 0, 1)];
    let first = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &demand)])
        .await
        .unwrap();
    let old = granted(&first[0]);
    // 429: released (the provider provably did not accept) and requeued.
    let requeue = Report {
        task: TaskId(1),
        token: Some(old),
        via: Vec::new(),
        action: ReportAction::Requeue {
            delay_ms: 0,
            reason: "429".into(),
        },
    };
    let r = db.report_batch(&[requeue]).await.unwrap();
    assert_eq!(
        r[0],
        ReportResult::Applied {
            state: TaskState::Queued,
            version: 2,
            released: 1
        }
    );
    let second = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 2, &demand)])
        .await
        .unwrap();
    let new = granted(&second[0]);
    let ClaimResult::Granted {
        attempt_no,
        request_key,
        ..
    } = &second[0]
    else {
        unreachable!()
    };
    assert_eq!((*attempt_no, request_key.as_str()), (2, "spindle-1-2"));
    assert!(new.0 > old.0, "fencing tokens grow");

    // The first attempt's worker wakes up late: every write it tries is fenced.
    for action in [
        ReportAction::Advance(TaskState::Running),
        ReportAction::Release,
        ReportAction::Finish {
            state: TaskState::Succeeded,
            cost_actual_milli: Some(1),
            reason: None,
            result: None,
        },
    ] {
        let r = db
            .report_batch(&[Report {
                task: TaskId(1),
                token: Some(old),
                via: Vec::new(),
                action,
            }])
            .await
            .unwrap();
        assert_eq!(
            r[0],
            ReportResult::StaleToken {
                current: Some(new),
                state: TaskState::Dispatching
            }
        );
    }
    assert_eq!(
        db.pool_usage("provider:acme").await.unwrap()[0].used,
        1,
        "the live attempt keeps its slot"
    );

    // Releasing twice gives the slot back once.
    let release = Report {
        task: TaskId(1),
        token: Some(new),
        via: Vec::new(),
        action: ReportAction::Release,
    };
    let r = db
        .report_batch(std::slice::from_ref(&release))
        .await
        .unwrap();
    assert!(
        matches!(
            r[0],
            ReportResult::Applied {
                state: TaskState::Dispatching,
                released: 1,
                ..
            }
        ),
        "{r:?}"
    );
    let r = db.report_batch(&[release]).await.unwrap();
    assert!(
        matches!(r[0], ReportResult::Applied { released: 0, .. }),
        "{r:?}"
    );
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 0);

    // An illegal jump is refused and changes nothing.
    let r = db
        .report_batch(&[Report {
            task: TaskId(1),
            token: Some(new),
            via: Vec::new(),
            action: ReportAction::Advance(TaskState::MediaProcessing),
        }])
        .await
        .unwrap();
    assert_eq!(
        r[0],
        ReportResult::IllegalTransition {
            from: TaskState::Dispatching,
            to: TaskState::MediaProcessing
        }
    );
    let sql = test.sql().await.unwrap();
    let live: i64 = sql
        .query_one(
            "SELECT count(*) FROM task_attempt WHERE task_id = 1 AND ended_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(live, 1, "one live attempt per task");
    assert_counters_derived(&test).await;
}

#[tokio::test]
async fn bad_batches_are_refused_before_any_round_trip_with_the_row_named() {
    let (_test, db) = setup().await;
    let mut long_key = task(1, 1, "x");
    long_key.idempotency_key = "k".repeat(200);
    let e = db.submit_batch(&[long_key], V1).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: row 0: field `idempotency_key` is 200 bytes, more than 128"
    );
    let e = db
        .submit_batch(&[task(1, 1, "a"), task(1, 1, "b")], V1)
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: task 1 appears twice in one batch"
    );
    let dup = claim(1, 0, &[("p", 0, 1), ("p", 0, 2)]);
    let e = db.claim_batch(NODE, LEASE_MS, &[dup]).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: row 0: pool shard p/0 demanded twice"
    );
    let zero = claim(1, 0, &[("p", 0, 0)]);
    let e = db.claim_batch(NODE, LEASE_MS, &[zero]).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: row 0: field `amount` is out of range (0)"
    );
    let bad = Report {
        task: TaskId(1),
        token: None,
        via: Vec::new(),
        action: ReportAction::Finish {
            state: TaskState::Running,
            cost_actual_milli: None,
            reason: None,
            result: None,
        },
    };
    let e = db.report_batch(&[bad]).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: row 0: finish in non-terminal state RUNNING"
    );
    let mut long_way = Report::new(TaskId(1), None, ReportAction::Advance(TaskState::Running));
    long_way.via = vec![TaskState::Running; spindle_control::report::VIA_MAX + 1];
    let e = db.report_batch(&[long_way]).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "invalid input: row 0: {} states on the way (at most {})",
            spindle_control::report::VIA_MAX + 1,
            spindle_control::report::VIA_MAX
        )
    );
    let e = db
        .claim_batch(NODE, LEASE_MS, &[claim(1, 0, &[("pool\u{1f}x", 0, 1)])])
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: row 0: pool key \"pool\\u{1f}x\" contains a control character"
    );
    let many: Vec<_> = (0..5_000).map(|i| task(i, 1, &format!("k{i}"))).collect();
    let e = db.submit_batch(&many, V1).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: batch of 5000 rows exceeds the maximum of 4096"
    );
}

#[tokio::test]
async fn a_multi_step_report_checks_every_hop_and_writes_once() {
    use TaskState as S;
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 4, 1).await.unwrap();
    let tasks = [task(1, 1, "a"), task(2, 1, "b"), task(3, 1, "c")];
    db.submit_batch(&tasks, V1).await.unwrap();
    let claims: Vec<_> = (1..=3)
        .map(|t| claim(t, 0, &[("provider:acme", 0, 1)]))
        .collect();
    let res = db.claim_batch(NODE, LEASE_MS, &claims).await.unwrap();
    let tokens: Vec<FencingToken> = res.iter().map(granted).collect();
    let succeed = |t: u64, token: FencingToken, via: Vec<S>| {
        let mut r = Report::new(
            TaskId(t),
            Some(token),
            ReportAction::Finish {
                state: S::Succeeded,
                cost_actual_milli: Some(900),
                reason: None,
                result: None,
            },
        );
        r.via = via;
        r
    };
    let succeeded_releasing_one = |r: &ReportResult| {
        matches!(
            r,
            ReportResult::Applied {
                state: S::Succeeded,
                released: 1,
                ..
            }
        )
    };
    let whole = vec![S::Running, S::ProviderSucceeded, S::MediaProcessing];
    // Task 2 skips MEDIA_PROCESSING: PROVIDER_SUCCEEDED → SUCCEEDED is not on the whitelist.
    let skipping = vec![S::Running, S::ProviderSucceeded];
    // Task 3 already reported RUNNING: a hop to the state it is in repeats it harmlessly.
    let running = Report::new(
        TaskId(3),
        Some(tokens[2]),
        ReportAction::Advance(S::Running),
    );
    db.report_batch(&[running]).await.unwrap();
    let r = db
        .report_batch(&[
            succeed(1, tokens[0], whole.clone()),
            succeed(2, tokens[1], skipping),
            succeed(3, tokens[2], whole),
        ])
        .await
        .unwrap();
    assert!(succeeded_releasing_one(&r[0]), "{r:?}");
    assert_eq!(
        r[1],
        ReportResult::IllegalTransition {
            from: S::ProviderSucceeded,
            to: S::Succeeded
        }
    );
    assert!(
        matches!(r[2], ReportResult::Applied { released: 1, .. }),
        "{r:?}"
    );
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 1);

    // One row write and one event for the whole path; the event names the way it came.
    let sql = test.sql().await.unwrap();
    let row = sql
        .query_one(
            "SELECT t.state, t.version, e.body->>'via'
               FROM task t JOIN outbox_event e ON e.task_id = t.task_id AND e.kind = 'SUCCEEDED'
              WHERE t.task_id = 1",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, i32>(1),
            row.get::<_, String>(2)
        ),
        (
            "SUCCEEDED".to_owned(),
            2,
            "RUNNING>PROVIDER_SUCCEEDED>MEDIA_PROCESSING".to_owned()
        )
    );
    let state2: String = sql
        .query_one("SELECT state FROM task WHERE task_id = 2", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(state2, "DISPATCHING", "a refused path changes nothing");

    // A batch with nothing to refuse is checked as a whole: task 2 the whole way, with a
    // repeated hop. Then a repeat of task 1's finish, alone in its batch: its token is gone, so
    // the whole-batch check refuses it and the row-by-row loop answers STALE_TOKEN.
    let again = vec![
        S::Running,
        S::Running,
        S::ProviderSucceeded,
        S::MediaProcessing,
    ];
    let r = db
        .report_batch(&[succeed(2, tokens[1], again)])
        .await
        .unwrap();
    assert!(succeeded_releasing_one(&r[0]), "{r:?}");
    assert_eq!(db.pool_usage("provider:acme").await.unwrap()[0].used, 0);
    let r = db
        .report_batch(&[succeed(1, tokens[0], Vec::new())])
        .await
        .unwrap();
    assert_eq!(
        r[0],
        ReportResult::StaleToken {
            current: None,
            state: S::Succeeded
        }
    );

    let mut through_terminal = succeed(1, tokens[0], vec![S::Failed]);
    through_terminal.task = TaskId(9);
    let e = db.report_batch(&[through_terminal]).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: row 0: passes through terminal state FAILED"
    );
    assert_counters_derived(&test).await;
}

/// A report batch in no particular task order is answered row by row for each row's own task,
/// on the fast path (every row current) and on the row-by-row one (a stale row among them),
/// and its outbox row lists each task with its own new state (the report builds both from one
/// sort of the batch).
#[tokio::test]
async fn a_report_batch_in_any_order_answers_each_row_for_its_own_task() {
    let (test, db) = setup().await;
    db.set_pool("provider:acme", 8, 1).await.unwrap();
    let tasks: Vec<_> = (1..=6).map(|i| task(i, 1, &format!("k{i}"))).collect();
    let tokens = submit_and_claim(&db, &tasks).await;
    let token = |id: u64| tokens[id as usize - 1];

    // Fast path: every row current, ids out of order, two different ends.
    let batch = [
        finish(5, token(5), TaskState::Succeeded),
        finish(2, token(2), TaskState::Failed),
        finish(6, token(6), TaskState::Succeeded),
        finish(1, token(1), TaskState::Failed),
    ];
    let states: Vec<TaskState> = db
        .report_batch(&batch)
        .await
        .unwrap()
        .iter()
        .map(|r| match r {
            ReportResult::Applied { state, .. } => *state,
            other => panic!("expected applied, got {other:?}"),
        })
        .collect();
    use TaskState::{Failed, Succeeded};
    assert_eq!(states, vec![Succeeded, Failed, Succeeded, Failed]);
    let sql = test.sql().await.unwrap();
    let row = sql
        .query_one(
            "SELECT tasks, kinds FROM outbox_batch ORDER BY batch_id DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap();
    let (ids, kinds): (Vec<i64>, Vec<String>) = (row.get(0), row.get(1));
    let listed: Vec<(i64, &str)> = ids
        .iter()
        .copied()
        .zip(kinds.iter().map(|k| k.as_str()))
        .collect();
    assert_eq!(
        listed,
        vec![
            (5, "SUCCEEDED"),
            (2, "FAILED"),
            (6, "SUCCEEDED"),
            (1, "FAILED")
        ]
    );

    // Row by row: a stale token between two current rows.
    let stale = FencingToken(token(3).0 + 1_000);
    let out = db
        .report_batch(&[
            finish(4, token(4), TaskState::Failed),
            finish(3, stale, TaskState::Succeeded),
            finish(1, token(1), TaskState::Succeeded),
        ])
        .await
        .unwrap();
    assert!(
        matches!(out[0], ReportResult::Applied { state: Failed, .. }),
        "{out:?}"
    );
    assert_eq!(
        out[1],
        ReportResult::StaleToken {
            current: Some(token(3)),
            state: TaskState::Dispatching
        }
    );
    assert_eq!(
        out[2],
        ReportResult::StaleToken {
            current: None,
            state: Failed
        }
    );
    assert_counters_derived(&test).await;
}

/// A finish's result is stored with its task only from the attempt that holds it (a stale token
/// writes nothing), read back by `task_statuses`, and a result too long is refused by name
/// before anything reaches PostgreSQL.
#[tokio::test]
async fn a_result_is_stored_by_the_attempt_that_finishes_and_by_no_other() {
    let (_test, db) = setup().await;
    db.set_pool("provider:acme", 2, 1).await.unwrap();
    let tokens = submit_and_claim(&db, &[task(1, 1, "k1"), task(2, 1, "k2")]).await;
    let with_result = |task: u64, token: FencingToken, text: &str| {
        let mut r = finish_costing(task, token, TaskState::Succeeded, None);
        if let ReportAction::Finish { result, .. } = &mut r.action {
            *result = Some(text.to_string());
        }
        r
    };
    let stale = FencingToken(tokens[1].0 + 1_000);
    let out = db
        .report_batch(&[
            with_result(1, tokens[0], r#"{"outputs":["a.mp4"]}"#),
            with_result(2, stale, r#"{"outputs":["forged.mp4"]}"#),
        ])
        .await
        .unwrap();
    assert!(matches!(out[0], ReportResult::Applied { .. }), "{out:?}");
    assert!(matches!(out[1], ReportResult::StaleToken { .. }), "{out:?}");
    let stored = db
        .task_statuses(&[TaskId(1), TaskId(2)])
        .await
        .unwrap()
        .into_iter()
        .map(|(_, s)| (s.task.0, s.result))
        .collect::<std::collections::BTreeMap<_, _>>();
    assert_eq!(stored[&1].as_deref(), Some(r#"{"outputs":["a.mp4"]}"#));
    assert_eq!(stored[&2], None, "a stale attempt wrote a result");

    let long = "x".repeat(spindle_control::limits::RESULT_BYTES_MAX + 1);
    let err = db
        .report_batch(&[with_result(2, tokens[1], &long)])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("field `result`"), "{err}");
    // A result comes from an attempt: without its token it is refused, naming why.
    let mut tokenless = with_result(2, tokens[1], "{}");
    tokenless.token = None;
    let err = db.report_batch(&[tokenless]).await.unwrap_err();
    assert!(err.to_string().contains("it needs its token"), "{err}");
    assert_eq!(
        db.task_statuses(&[TaskId(2)]).await.unwrap()[0].1.result,
        None
    );
    // The dead-letter walk is bounded like every walk.
    for scan in [0, spindle_control::limits::SCAN_MAX + 1] {
        let err = db.failed_tasks(TaskId(0), scan).await.unwrap_err();
        assert!(err.to_string().contains("`scan`"), "{err}");
    }
}
