//! spindled as a process against a real PostgreSQL, driven through the Rust client.

mod common;

use std::time::Duration;

use common::{
    http_get, metric, metric_sum, poll_until, start, task, wait_all_succeeded_within, wait_for,
};
use spindle_client::{Client, ClientError};
use spindle_control::testing::TestDb;
use spindle_core::{Decision, TaskState, TenantId};
use spindle_wire::ErrorCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_ack_complete_and_idempotent_resubmit() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    assert_eq!(client.hello().node_id, "test-node");

    let a = client.submit(task("k1")).await.unwrap();
    assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    assert!(!a.replay);
    wait_for(&client, a.task, TaskState::Succeeded).await;

    // The same key again: the original task, not a new one.
    let again = client.submit(task("k1")).await.unwrap();
    assert_eq!((again.task, again.replay), (a.task, true));
    // The same key with another spec: refused, naming the original.
    let mut other = task("k1");
    other.spec.duration_ms = 9_000;
    let conflict = client.submit(other).await.unwrap();
    assert_eq!(conflict.task, a.task);
    assert_eq!(conflict.decision, Decision::RejectIdempotencyConflict);
    assert!(conflict
        .reason
        .unwrap_or_default()
        .contains("different request"));

    // A batch: one frame, one group commit, every task completes.
    let batch: Vec<_> = (0..50).map(|i| task(&format!("b{i}"))).collect();
    let admissions = client.submit_batch(batch).await.unwrap();
    assert_eq!(admissions.len(), 50);
    for a in &admissions {
        assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    }
    for a in &admissions {
        wait_for(&client, a.task, TaskState::Succeeded).await;
    }
    // PostgreSQL agrees: every accepted task SUCCEEDED once, nothing holds a reservation.
    let sql = test.sql().await.unwrap();
    let row = sql
        .query_one(
            "SELECT count(*) FILTER (WHERE state = 'SUCCEEDED'), count(*),
                    (SELECT count(*) FROM resource_reservation WHERE status = 'ACTIVE'),
                    (SELECT coalesce(sum(used), 0)::bigint FROM resource_pool_shard)
               FROM task",
            &[],
        )
        .await
        .unwrap();
    let seen: (i64, i64, i64, i64) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(seen, (51, 51, 0, 0));
}

/// A task's input is part of the request a replay is compared with, and the inputs a shard
/// holds in memory are bounded: past `task_inputs_mb` (1 MiB here, 512 KiB per shard), a task
/// with an input is accepted with its input left in its stored request (read back at dispatch:
/// `provider::inputs_past_the_nodes_bound_are_read_back_for_the_provider`), its replay is a
/// replay, and an input let go (its task canceled) makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_inputs_are_part_of_the_request_and_held_within_a_bound_per_shard() {
    let test = TestDb::new().await;
    // Tasks run for their modelled time (tens of seconds): every one stays live.
    let config = common::config_scaled("1.0", "task_inputs_mb = 1");
    let daemon = common::start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let with_input = |key: &str, input: &str| {
        let mut t = task(key);
        t.input = Some(input.to_string());
        t
    };
    let a = client
        .submit(with_input("r", r#"{"prompt":"a"}"#))
        .await
        .unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
    let again = client
        .submit(with_input("r", r#"{"prompt":"a"}"#))
        .await
        .unwrap();
    assert_eq!((again.task, again.replay), (a.task, true));
    let other = client
        .submit(with_input("r", r#"{"prompt":"b"}"#))
        .await
        .unwrap();
    assert_eq!(
        (other.task, other.decision),
        (a.task, Decision::RejectIdempotencyConflict),
        "another input is another request: {other:?}"
    );

    // 16 KiB inputs: 31 fit in memory beside the first task's; the 32nd and the 33rd are left
    // in their stored requests (their tasks are accepted all the same).
    let big = format!("\"{}\"", "x".repeat(16 * 1024 - 2));
    let batch: Vec<_> = (0..33)
        .map(|i| with_input(&format!("big{i}"), &big))
        .collect();
    let answers = client.submit_batch(batch).await.unwrap();
    assert!(
        answers.iter().all(|a| a.decision.is_accepted()),
        "{answers:?}"
    );
    let kept = async || {
        let (_, metrics) = http_get(daemon.http, "/metrics").await;
        (
            metric_sum(&metrics, "spindle_task_input_bytes") as usize,
            metric_sum(&metrics, "spindle_task_inputs_stored"),
        )
    };
    let first = r#"{"prompt":"a"}"#.len();
    let want = (first + 31 * big.len(), 2);
    let now = poll_until(Duration::from_secs(5), kept, |k| *k == want).await;
    assert_eq!(now, want, "bytes held, inputs left in PostgreSQL");
    // A replay of a task whose input was left in PostgreSQL is a replay.
    let replay = client.submit(with_input("big32", &big)).await.unwrap();
    assert_eq!((replay.task, replay.replay), (answers[32].task, true));

    // Canceled tasks let their inputs go, held or left.
    client.cancel(answers[0].task).await.unwrap();
    client.cancel(answers[32].task).await.unwrap();
    let want = (first + 30 * big.len(), 1);
    let now = poll_until(Duration::from_secs(5), kept, |k| *k == want).await;
    assert_eq!(now, want);
    let room = client.submit(with_input("after", &big)).await.unwrap();
    assert!(room.decision.is_accepted(), "{room:?}");
    let want = (first + 31 * big.len(), 1);
    let now = poll_until(Duration::from_secs(5), kept, |k| *k == want).await;
    assert_eq!(now, want, "room again in memory after a cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_and_credentials_checked() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let wrong = Client::connect(daemon.addr, TenantId(1), "tenant-2-credential").await;
    assert!(
        matches!(wrong, Err(ClientError::Refused(ref e)) if e.code == ErrorCode::AuthFailed),
        "{:?}",
        wrong.err()
    );
    let (one, two) = common::both_tenants(&daemon).await;
    let a = one.submit(task("mine")).await.unwrap();
    // Tenant 2 can neither read nor cancel tenant 1's task: it does not exist for them.
    let read = two.get(a.task).await;
    assert!(
        matches!(read, Err(ClientError::Refused(ref e)) if e.code == ErrorCode::NotFound),
        "{read:?}"
    );
    let cancel = two.cancel(a.task).await;
    assert!(
        matches!(cancel, Err(ClientError::Refused(ref e)) if e.code == ErrorCode::NotFound),
        "{cancel:?}"
    );
    wait_for(&one, a.task, TaskState::Succeeded).await;
}

/// A batch the core cannot decide on in full (its last task names a model the policy does not
/// have) is refused as a whole — and the tasks admitted before the bad one are let go again:
/// none stays in the shard, queued or dispatched, with no row behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_for_one_task_leaves_nothing_of_the_others_behind() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut batch: Vec<_> = (0..3).map(|i| task(&format!("fine{i}"))).collect();
    let mut bad = task("bad");
    bad.spec.model = spindle_core::ModelId(999);
    batch.push(bad);
    let refused = client.submit_batch(batch).await;
    assert!(
        matches!(refused, Err(ClientError::Refused(ref e))
            if e.code == ErrorCode::InvalidSpec && e.message.contains("task 3")),
        "{refused:?}"
    );
    // The node goes on: a task after it runs to the end.
    let a = client.submit(task("after")).await.unwrap();
    assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    wait_for(&client, a.task, TaskState::Succeeded).await;
    // Nothing of the refused batch is live in any shard (the gauge follows each pump).
    let live = poll_until(
        Duration::from_secs(10),
        async || {
            metric_sum(
                &http_get(daemon.http, "/metrics").await.1,
                "spindle_live_tasks",
            )
        },
        |&live| live == 0,
    )
    .await;
    assert_eq!(live, 0, "tasks of the refused batch stayed live in a shard");
    // And none of them has a row.
    let sql = test.sql().await.unwrap();
    let rows: i64 = sql
        .query_one("SELECT count(*) FROM task", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "only the task submitted after the refusal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics_are_served() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    assert_eq!(http_get(daemon.http, "/livez").await.0, "HTTP/1.1 200 OK");
    assert_eq!(http_get(daemon.http, "/readyz").await.0, "HTTP/1.1 200 OK");
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = client.submit(task("metered")).await.unwrap();
    wait_for(&client, a.task, TaskState::Succeeded).await;
    let (status, body) = http_get(daemon.http, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(
        body.contains("spindle_admissions_total{decision=\"ACCEPTED\"} 1"),
        "{body}"
    );
    assert!(body.contains("spindle_tasks_completed_total 1"), "{body}");
    assert!(
        body.contains("spindle_control_batch_seconds_count{kind=\"submit\"}"),
        "{body}"
    );
    assert_eq!(
        http_get(daemon.http, "/nope").await.0,
        "HTTP/1.1 404 Not Found"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_receive_progress_until_the_task_ends() {
    let test = TestDb::new().await;
    // Tasks take 300 ms at the provider: time to subscribe while they run.
    let config = common::config_scaled("0.01", "");
    let daemon = common::start_with(&test, &config).await;
    let (client, other) = common::both_tenants(&daemon).await;
    let a = client.submit(task("watched")).await.unwrap();
    client.subscribe(a.task).await.unwrap();
    // Another tenant cannot watch it.
    let denied = other.subscribe(a.task).await;
    assert!(
        matches!(denied, Err(ClientError::Refused(ref e)) if e.code == ErrorCode::NotFound),
        "{denied:?}"
    );
    let mut seen = Vec::new();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(10), client.next_event())
            .await
            .expect("an event within 10 s")
            .expect("the connection stays open");
        assert_eq!(e.task, a.task);
        seen.push((e.state, e.progress_pct));
        if e.state.is_terminal() {
            break;
        }
    }
    assert_eq!(seen.last(), Some(&(TaskState::Succeeded, 100)), "{seen:?}");
    let pcts: Vec<u8> = seen.iter().map(|(_, p)| *p).collect();
    assert!(
        pcts.windows(2).all(|w| w[0] <= w[1]),
        "progress only grows: {seen:?}"
    );
    assert!(seen.len() >= 2, "more than the final event: {seen:?}");
    // A finished task cannot be subscribed to (GetTask answers for it).
    let late = client.subscribe(a.task).await;
    assert!(
        matches!(late, Err(ClientError::Refused(ref e)) if e.code == ErrorCode::NotFound),
        "{late:?}"
    );
}

/// Batches that run a shard through its block of task ids mid-request (4,096 ids a block):
/// every acknowledged task must complete; a claim must never overtake its own submit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_across_task_id_blocks_all_complete() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut acked = Vec::new();
    for b in 0..5 {
        let batch: Vec<_> = (0..1_000).map(|i| task(&format!("blk{b}-{i}"))).collect();
        for a in client.submit_batch(batch).await.unwrap() {
            assert!(a.decision.is_accepted(), "{a:?}");
            acked.push(a.task.0 as i64);
        }
    }
    let sql = test.sql().await.unwrap();
    // Bounded at 120 s: a debug build on two cores moves a few hundred tasks a second here; a
    // stranded task never completes however long the wait.
    let done = wait_all_succeeded_within(&sql, &acked, Duration::from_secs(120)).await;
    if done != 5_000 {
        let states: Vec<(String, i64)> = sql
            .query("SELECT state, count(*) FROM task GROUP BY state", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let (_, metrics) = http_get(daemon.http, "/metrics").await;
        let log = daemon.log_tail(60);
        panic!("{done} of 5000 completed; states {states:?}\n{metrics}\nlog:\n{log}");
    }
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert!(
        metrics.contains("spindle_claims_total{result=\"refused\"} 0"),
        "{metrics}"
    );
    // Every task's first dispatch is in the submit → dispatch histogram, once.
    assert!(
        metrics.contains("spindle_submit_dispatch_seconds_count{attempt=\"first\"} 5000\n"),
        "{metrics}"
    );
}

/// design.md §3: a node-wide limit is split among shards by backlogged weight. Tenant 1 lives on
/// shard 1 and is the only one with work: it gets both providers whole (2 × 4 slots), not the
/// half of each its shard starts with — and never more than the 8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_tenant_gets_the_whole_provider_not_its_shards_half() {
    let test = TestDb::new().await;
    let config = common::NodeConfig::new()
        .set("provider_concurrency", 4)
        .set("lane_capacity_units", 100_000)
        // Long enough that the tasks are still running when the test looks.
        .time_scale("10.0")
        .toml();
    let daemon = common::start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let batch: Vec<_> = (0..12).map(|i| task(&format!("w{i}"))).collect();
    for a in client.submit_batch(batch).await.unwrap() {
        assert!(a.decision.is_accepted(), "{a:?}");
    }
    let sql = test.sql().await.unwrap();
    let running = || async {
        sql.query_one(
            "SELECT count(*) FROM task WHERE state IN ('DISPATCHING', 'RUNNING')",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    };
    // The shards re-split every tick (20 ms); 10 s is far beyond what that takes.
    let seen = poll_until(
        Duration::from_secs(10),
        async || {
            let seen = running().await;
            assert!(seen <= 8, "{seen} running on 8 provider slots");
            seen
        },
        |&seen| seen == 8,
    )
    .await;
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert_eq!(seen, 8, "tenant 1 stayed at its shard's half\n{metrics}");
    // The per-tenant gauges are written every 10 shard ticks (200 ms).
    let gauge = "spindle_tenant_running_tasks{shard=\"1\",tenant=\"1\"} 8";
    let metrics = poll_until(
        Duration::from_secs(10),
        async || http_get(daemon.http, "/metrics").await.1,
        |metrics| metrics.contains(gauge),
    )
    .await;
    assert!(metrics.contains(gauge), "{metrics}");
    let waits = metric_sum(&metrics, "spindle_dispatch_wait_seconds_count");
    assert!(
        waits >= 8,
        "8 dispatches, {waits} waits recorded\n{metrics}"
    );
}

/// A tenant over its configured submit rate is rejected by the core alone: no PostgreSQL row,
/// a decision that names the limit, and the node's own answer time in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_submit_rate_is_rejected_at_admission() {
    let test = TestDb::new().await;
    let config = common::NodeConfig::new()
        .tenants([1])
        .tenant_lines(1, "submit_per_minute = 60")
        .toml();
    let daemon = common::start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut accepted = 0;
    let mut rejected = 0;
    for i in 0..10 {
        let a = client.submit(task(&format!("r{i}"))).await.unwrap();
        if a.decision.is_accepted() {
            accepted += 1;
        } else {
            assert_eq!(a.decision, Decision::RejectUserRateLimit, "{a:?}");
            assert!(
                a.reason.as_deref().unwrap_or("").contains("submit_rate"),
                "{a:?}"
            );
            rejected += 1;
        }
    }
    // A burst of one a second: ten submits within a second get one or two through.
    assert!((1..=2).contains(&accepted), "{accepted} accepted");
    let sql = test.sql().await.unwrap();
    let rows: i64 = sql
        .query_one("SELECT count(*) FROM task", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, accepted, "a rejected submit leaves no row");
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert!(
        metrics.contains(&format!(
            "spindle_submit_answer_seconds_count{{outcome=\"rejected\"}} {rejected}"
        )),
        "{metrics}"
    );
}

/// Retention: a node removes its partitions' ended tasks once their window has passed, and
/// leaves what still runs or waits alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_tasks_leave_postgres_after_their_retention_window() {
    let test = TestDb::new().await;
    let config = common::CONFIG.replace(
        "partitions = 8\n",
        "partitions = 8\nlease_ms = 1000\nretention_finished_s = 1\n",
    );
    let daemon = common::start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let done: Vec<_> = client
        .submit_batch((0..20).map(|i| task(&format!("r{i}"))).collect())
        .await
        .unwrap();
    for a in &done {
        wait_for(&client, a.task, TaskState::Succeeded).await;
    }
    let sql = test.sql().await.unwrap();
    let ids: Vec<i64> = done.iter().map(|a| a.task.0 as i64).collect();
    // Ended attempts on record, in the history or kept in their task's row.
    let attempts = || async {
        sql.query_one(
            "SELECT count(*) FROM task_attempt WHERE task_id = ANY ($1) AND outcome IS NOT NULL",
            &[&ids],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    };
    let left = poll_until(
        Duration::from_secs(15),
        async || {
            sql.query_one(
                "SELECT count(*) FROM task WHERE task_id = ANY ($1)",
                &[&ids],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        },
        |&left| left == 0,
    )
    .await;
    assert_eq!(left, 0, "{}", daemon.log_tail(40));
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert!(
        metrics.contains("spindle_retention_pruned_total 20\n"),
        "{metrics}"
    );
    assert_eq!(
        attempts().await,
        0,
        "the pruned tasks' attempts went with them"
    );
    // Gone for the client too; a new task of the same tenant still runs.
    let err = client.get(done[0].task).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Refused(e) if e.code == ErrorCode::NotFound),
        "{err:?}"
    );
    let again = client.submit(task("after")).await.unwrap();
    wait_for(&client, again.task, TaskState::Succeeded).await;
}

/// A running attempt's lease is renewed while it runs (every third of a lease), so that the
/// lease in PostgreSQL says which work still has a live owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_attempts_lease_is_renewed_while_it_runs() {
    let test = TestDb::new().await;
    // Tasks take ~4 s at the provider; leases last 1.5 s.
    let config = common::config_scaled("0.13", "lease_ms = 1500");
    let daemon = common::start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = client.submit(task("long")).await.unwrap();
    let sql = test.sql().await.unwrap();
    let lease = async || -> Option<std::time::SystemTime> {
        sql.query_one(
            "SELECT attempt_lease_until FROM task WHERE task_id = $1 AND state = 'RUNNING'",
            &[&(a.task.0 as i64)],
        )
        .await
        .ok()
        .and_then(|r| r.get(0))
    };
    let first = poll_until(Duration::from_secs(10), lease, Option::is_some)
        .await
        .expect("the task never ran");
    // Two renewals later the lease lies past where the claim put it.
    let renewed = poll_until(Duration::from_secs(3), lease, |l| {
        l.is_some_and(|l| l > first + Duration::from_millis(600))
    })
    .await
    .filter(|&l| l > first + Duration::from_millis(600));
    let renewed = renewed.expect("the running attempt's lease was never renewed");
    assert!(
        renewed > std::time::SystemTime::now(),
        "renewed into the future"
    );
    wait_for(&client, a.task, TaskState::Succeeded).await;
}

/// A shard's consecutive submit calls charge different rows of a provider's pool: the report
/// that gives back the tasks of one call does not lock the row the next call charges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consecutive_submit_calls_of_a_shard_charge_different_pool_rows() {
    let test = TestDb::new().await;
    // One shard; 64 slots are 4 rows; the tasks keep running while the rows are read.
    let config = common::CONFIG
        .replace("shards = 2", "shards = 1\nprovider_concurrency = 64")
        .replace(
            "local_provider_time_scale = 0.0001",
            "local_provider_time_scale = 1.0",
        );
    let daemon = common::start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut ids = Vec::new();
    for i in 0..3 {
        // Each acknowledged before the next is sent: one submit call each.
        let a = client.submit(task(&format!("row{i}"))).await.unwrap();
        assert_eq!(a.decision, Decision::Accepted, "{a:?}");
        ids.push(a.task.0 as i64);
    }
    let sql = test.sql().await.unwrap();
    let rows: Vec<i16> = sql
        .query(
            "SELECT res_shard[1] FROM task WHERE task_id = ANY ($1) AND res_shard IS NOT NULL
              ORDER BY task_id",
            &[&ids],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rows.len(), 3, "every task claimed in its submit: {rows:?}");
    let distinct: std::collections::HashSet<_> = rows.iter().collect();
    assert_eq!(distinct.len(), 3, "one row per call: {rows:?}");
}

/// Every authenticated connection is served by the shard that owns its tenant, whichever
/// shard's executor accepted it (a connection accepted elsewhere is handed over after its
/// Hello, so its frames and answers do not cross threads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_served_on_the_shard_that_owns_their_tenant() {
    let test = TestDb::new().await;
    // Two shards, eight partitions: tenant 1 is shard 1's, tenant 2 shard 0's.
    let daemon = start(&test).await;
    let mut clients = Vec::new();
    for i in 0..6 {
        for (tenant, credential) in [(1, "tenant-1-credential"), (2, "tenant-2-credential")] {
            let client = Client::connect(daemon.addr, TenantId(tenant), credential)
                .await
                .unwrap();
            let a = client
                .submit(task(&format!("conn-{tenant}-{i}")))
                .await
                .unwrap();
            assert_eq!(a.decision, Decision::Accepted, "{a:?}");
            clients.push(client);
        }
    }
    let served = [
        metric(&daemon, "spindle_connections_served_total{shard=\"0\"}").await,
        metric(&daemon, "spindle_connections_served_total{shard=\"1\"}").await,
    ];
    assert_eq!(
        served,
        [6, 6],
        "tenant 2's six on shard 0, tenant 1's on shard 1"
    );
}

/// `http_connections_max`: at the bound a new connection closes the oldest one that is not in
/// a request (idle, or still sending its head) and is served; only with every connection in a
/// request is one more answered `503` with `retry-after` at once, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_port_serves_a_bounded_number_of_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let test = TestDb::new().await;
    let daemon = common::start_with(
        &test,
        &common::config_scaled("0.0001", "http_connections_max = 2"),
    )
    .await;
    // Two connections that send nothing do not keep a third from being served: the oldest of
    // them is closed for it.
    let mut idle = [
        tokio::net::TcpStream::connect(daemon.http).await.unwrap(),
        tokio::net::TcpStream::connect(daemon.http).await.unwrap(),
    ];
    let (status, _) = common::http_get(daemon.http, "/livez").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    let mut b = [0u8; 1];
    let closed = tokio::time::timeout(std::time::Duration::from_secs(5), idle[0].read(&mut b))
        .await
        .expect("the oldest idle connection is closed")
        .unwrap_or(0);
    assert_eq!(closed, 0);
    drop(idle);
    // Two requests in progress (a body announced and not sent; the node's `100 Continue` says
    // it is reading it): every place is in a request, so a third connection is refused at once.
    let mut busy = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(daemon.http).await.unwrap();
        s.write_all(
            b"POST /v1/provider/callback HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\
              expect: 100-continue\r\n\r\n",
        )
        .await
        .unwrap();
        let mut continued = [0u8; 25];
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            s.read_exact(&mut continued),
        )
        .await
        .expect("100 Continue")
        .unwrap();
        assert!(continued.starts_with(b"HTTP/1.1 100 Continue"));
        busy.push(s);
    }
    let refused = common::poll_until(
        std::time::Duration::from_secs(10),
        async || {
            let mut third = tokio::net::TcpStream::connect(daemon.http).await.unwrap();
            let mut answer = String::new();
            let _ = tokio::time::timeout(
                std::time::Duration::from_secs(1),
                third.read_to_string(&mut answer),
            )
            .await;
            answer
        },
        |a| a.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
    )
    .await;
    assert!(
        refused.starts_with("HTTP/1.1 503 Service Unavailable\r\n")
            && refused.contains("retry-after: 1"),
        "{refused:?}"
    );
    drop(busy);
    // Their places come back as they end; a GET of /metrics is served again.
    let get = async || -> Option<String> {
        let mut s = tokio::net::TcpStream::connect(daemon.http).await.ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).await.ok()?;
        Some(text)
    };
    let served = common::poll_until(std::time::Duration::from_secs(10), get, |t| {
        t.as_deref().is_some_and(|t| t.starts_with("HTTP/1.1 200"))
    })
    .await
    .expect("served again");
    assert!(common::metric_sum(&served, "spindle_http_connections_refused_total") >= 1);
    assert!(common::metric_sum(&served, "spindle_http_connections_evicted_total") >= 1);
}

/// The expected start an admission carries is ms from the answer (the schema's word), not the
/// shard's clock: on a node up for seconds, a task that can start at once is told it starts
/// within a second, at the shortest queue level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expected_start_is_counted_from_the_answer() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let up = std::time::Instant::now();
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let first = client.submit(task("first")).await.unwrap();
    wait_for(&client, first.task, TaskState::Succeeded).await;
    // Not a wait for an event: the node must be older than the bound below, so that a start
    // counted on its clock (its uptime plus the wait) would exceed it.
    tokio::time::sleep_until((up + Duration::from_secs(3)).into()).await;
    let second = client.submit(task("second")).await.unwrap();
    assert!(second.decision.is_accepted(), "{second:?}");
    assert!(
        second.expected_start_ms < 1_000,
        "an idle lane's task is told it starts in {} ms",
        second.expected_start_ms
    );
    assert_eq!(second.queue_level, 0, "{second:?}");
}

/// The configuration builder's default is the configuration the tests share.
#[test]
fn the_config_builders_default_is_the_shared_config() {
    common::config::assert_the_default_is_the_shared_config();
}

/// A live node's exposition passes `promtool check metrics` (Debian's `prometheus` package; the
/// test command installs it): every family typed once, with its help, names and labels well
/// formed, counters named `_total`. Read after work ran, so that the per-tenant, per-limit and
/// histogram series are there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_nodes_metrics_pass_promtool() {
    let test = TestDb::new().await;
    // With media workers, so that their families (the media pool's own) are checked too.
    let out = tempfile::tempdir().unwrap();
    let config = common::NodeConfig::new()
        .time_scale("0.001")
        .set("counter_check_s", 1)
        .section(&format!(
            "[media]\nworkers = 1\noutput_dir = \"{}\"",
            out.path().display()
        ))
        .toml();
    let daemon = common::start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut accepted = Vec::new();
    for i in 0..5 {
        let a = client.submit(task(&format!("promtool-{i}"))).await.unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
        accepted.push(a.task.0 as i64);
    }
    let sql = test.sql().await.unwrap();
    assert_eq!(common::wait_all_succeeded(&sql, &accepted).await, 5);
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    let mut promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package) on PATH");
    use std::io::Write as _;
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(metrics.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool: {said}"
    );
    assert!(
        metrics.lines().filter(|l| l.starts_with("# TYPE ")).count() > 60,
        "{metrics}"
    );
    // The parts with families of their own: the live policy's lanes, the media pool's.
    for family in ["spindle_lane_open", "spindle_media_engine_units"] {
        assert!(
            metrics.contains(&format!("# TYPE {family} gauge")),
            "{family}: {metrics}"
        );
    }
    // The Grafana dashboard and the alert rules (deploy/prometheus) read only what a node
    // exports.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("deploy/grafana/spindle.json")).unwrap(),
    )
    .unwrap();
    let mut expressions: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    assert!(expressions.len() >= 16, "{expressions:?}");
    let alerts: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root.join("deploy/prometheus/spindle-alerts.yml")).unwrap(),
    )
    .unwrap();
    let dashboard_expressions = expressions.len();
    for group in alerts["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            expressions.push(rule["expr"].as_str().unwrap().to_string());
        }
    }
    // A renamed metric would leave an alert that can never fire: the rules are read here.
    let named_in_rules = expressions[dashboard_expressions..]
        .iter()
        .flat_map(|e| e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
        .filter(|w| w.starts_with("spindle_"))
        .count();
    assert!(
        named_in_rules >= 6,
        "{named_in_rules} metric names in the rules"
    );
    let problems = common::unknown_series(&metrics, &expressions);
    assert!(problems.is_empty(), "{problems:#?}");
    // The check finds a metric no node exports, and a label its samples do not carry.
    let wrong = common::unknown_series(
        &metrics,
        &[
            "rate(spindle_no_such_total[1m])".into(),
            "sum by (colour) (spindle_admissions_total)".into(),
        ],
    );
    assert_eq!(wrong.len(), 2, "{wrong:#?}");
}

/// The queues' ages, for the starvation alert: QUEUED tasks that wait behind busy slots are
/// counted by lane and band, with how long the oldest has waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_tasks_and_the_oldest_wait_are_exported_by_lane_and_band() {
    let test = TestDb::new().await;
    let config = common::config_scaled("10.0", "provider_concurrency = 1\ncounter_check_s = 1");
    let daemon = common::start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    for i in 0..8 {
        let a = client.submit(task(&format!("busy{i}"))).await.unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
    }
    let series = "spindle_cluster_queued_tasks{lane=\"STANDARD\",band=\"P3\"}";
    let queued = poll_until(
        Duration::from_secs(10),
        async || metric(&daemon, series).await,
        |&n| n >= 4,
    )
    .await;
    assert!(queued >= 4, "{queued} queued behind the busy slots");
    let (_, text) = http_get(daemon.http, "/metrics").await;
    let oldest: f64 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("spindle_queued_oldest_seconds{lane=\"STANDARD\",band=\"P3\"} ")?
                .parse()
                .ok()
        })
        .expect("the oldest wait of the queue");
    assert!(oldest > 0.0 && oldest < 60.0, "{oldest}");
}
