//! spindled against spindle-mock-provider (in-process, real sockets): one test per fault mode,
//! asserting final states, reservations, budgets and the mock's counters (no concurrency or RPM
//! violation, no request key sent twice), plus callbacks that must change nothing.

mod common;

use std::time::Duration;

use common::mock::*;
use common::{http_get, metric_sum, poll_until, start_on, start_with, task, Daemon};
use spindle_client::Client;
use spindle_control::testing::{Proxy, TestDb};
use spindle_core::{TaskId, TaskState, TenantId};
use spindle_providers::api::{AccountStats, Fault};
use spindle_providers::{HttpProvider, MockProvider};

async fn node(test: &TestDb, provider: &MockProvider) -> Daemon {
    node_named(test, provider, "provider-node").await
}

/// spindled with the mock at `provider`, as node `id` (leases of 3 s: a takeover is quick).
async fn node_named(test: &TestDb, provider: &MockProvider, id: &str) -> Daemon {
    start_with(test, &node_config(id, provider, "")).await
}

/// A node whose submits to a mock hanging on them (`Fault::TimeoutAfterAccept`: it answers
/// after 1.5 s) give up after 1 s, leaving a second of doubt to act in; `provider_extra` as in
/// `node_config`.
async fn doubting_node(test: &TestDb, m: &MockProvider, provider_extra: &str) -> Daemon {
    let config = node_config(
        "provider-node",
        m,
        &format!("timeout_ms = 1000\n{provider_extra}"),
    );
    start_with(test, &config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_provider_runs_everything_once_with_its_actual_cost() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    let daemon = node(&test, &m).await;
    let (_, states) = run(&daemon, &test, "ok", 40).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    let total = assert_clean(&test, &admin).await;
    assert_eq!((total.accepted, total.completed), (40, 40));
    assert!(total.max_in_flight <= 4);
    let sql = test.sql().await.unwrap();
    let costs: i64 = sql
        .query_one(
            "SELECT count(*) FROM task WHERE cost_actual_milli = 1234",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(costs, 40, "the provider's cost is recorded");
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert!(
        metrics.contains("spindle_provider_submits_total{result=\"accepted\"} 40"),
        "{metrics}"
    );
}

/// The client's input and the task's model reach the provider as sent — the input as the same
/// JSON value, a task without one as null — and a task put back by a restart is sent with its
/// input too (read back from its stored request). The node holds each input once while its
/// task lives (`spindle_task_input_bytes`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tasks_input_and_model_reach_the_provider_as_the_client_sent_them() {
    let test = TestDb::new().await;
    // Jobs outlive the test: what is sent is read at the mock while they run.
    let (m, admin) = mock(600_000).await;
    let input = serde_json::json!({
        "prompt": "a paper boat on a canal at dusk, \"slow pan\"",
        "references": ["https://example.com/ref-1.png"],
        "seed": 7,
        "strength": 0.35
    });
    let client_task = |key: &str, input: Option<&serde_json::Value>| {
        let mut t = task(key);
        t.input = input.map(|i| i.to_string());
        t
    };
    let daemon = node(&test, &m).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let with = client
        .submit(client_task("with", Some(&input)))
        .await
        .unwrap();
    let without = client.submit(client_task("without", None)).await.unwrap();
    let got = submitted(&admin, with.task).await;
    assert_eq!(got.input, input);
    // A live task's status, answered from the node's memory, counts its attempt and gives its
    // state's milestone.
    let status = client.get(with.task).await.unwrap();
    assert_eq!(status.attempt_no, 1, "{status:?}");
    assert!(
        matches!(
            (status.state, status.progress_pct),
            (TaskState::Dispatching | TaskState::SubmitUnknown, 10) | (TaskState::Running, 30)
        ),
        "{status:?}"
    );
    assert_eq!(got.model, "video-model-0");
    assert_eq!(
        submitted(&admin, without.task).await.input,
        serde_json::Value::Null
    );
    let held = poll_until(
        Duration::from_secs(5),
        async || {
            let (_, metrics) = http_get(daemon.http, "/metrics").await;
            metric_sum(&metrics, "spindle_task_input_bytes") as usize
        },
        |&held| held == input.to_string().len(),
    )
    .await;
    assert_eq!(held, input.to_string().len(), "the input is held once");

    // Every slot of the provider's two accounts (4 each) taken, a task with an input waits
    // QUEUED when its node dies; the next node puts it back and, once slots free, sends it
    // with its input.
    let fill: Vec<_> = (0..6)
        .map(|i| client_task(&format!("fill{i}"), None))
        .collect();
    let mut running: Vec<TaskId> = client
        .submit_batch(fill)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.task)
        .collect();
    running.extend([with.task, without.task]);
    let queued = client
        .submit(client_task("queued", Some(&input)))
        .await
        .unwrap();
    let in_flight = poll_until(
        Duration::from_secs(10),
        async || mock_total(&admin, |s| s.in_flight).await,
        |&n| n == 8,
    )
    .await;
    assert_eq!(in_flight, 8);
    let sql = test.sql().await.unwrap();
    assert_eq!(state_of(&sql, queued.task.0 as i64).await, "QUEUED");
    drop(client);
    drop(daemon);
    let daemon = node(&test, &m).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    for t in running {
        client.cancel(t).await.unwrap();
    }
    assert_eq!(submitted(&admin, queued.task).await.input, input);
}

/// A node of 1 MiB for inputs (two shards: one shard holds 32 of [`big_inputs`]), a client of
/// tenant 1, and the node's configuration.
async fn inputs_node(test: &TestDb, m: &MockProvider) -> (Daemon, Client, String) {
    let config = common::mock::node("provider-node", m, "")
        .set("task_inputs_mb", 1)
        .toml();
    let daemon = start_with(test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    (daemon, client, config)
}

/// Task `i`'s input of 16 KiB, its number first.
fn input_of(i: usize) -> String {
    format!("\"{i:05}{}\"", "x".repeat(16 * 1024 - 7))
}

/// Tasks `big{i}` with [`input_of`]`(i)`.
fn big_inputs(range: std::ops::Range<usize>) -> Vec<spindle_wire::SubmitTask> {
    range
        .map(|i| {
            let mut t = task(&format!("big{i}"));
            t.input = Some(input_of(i));
            t
        })
        .collect()
}

/// Past the node's bound on inputs held in memory (`task_inputs_mb`), a task's input is left in
/// its stored request and read back when its attempt goes to the provider: every task reaches
/// the provider with its own input, held or not — also after a kill -9 and a restart, which
/// puts the queued ones back under the same bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_past_the_nodes_bound_are_read_back_for_the_provider() {
    let test = TestDb::new().await;
    let (m, admin) = mock(20).await;
    let (daemon, client, config) = inputs_node(&test, &m).await;
    let batch = big_inputs;
    let answers = client.submit_batch(batch(0..40)).await.unwrap();
    assert!(
        answers.iter().all(|a| a.decision.is_accepted()),
        "{answers:?}"
    );
    for (i, a) in answers.iter().enumerate() {
        let got = submitted(&admin, a.task).await;
        assert_eq!(got.input.to_string(), input_of(i), "task {i}");
    }

    // Killed with the next 40 queued: the restarted node puts them back under the same bound
    // and each still reaches the provider with its own input, whichever attempt sends it.
    let answers = client.submit_batch(batch(40..80)).await.unwrap();
    assert!(answers.iter().all(|a| a.decision.is_accepted()));
    let mut daemon = daemon;
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    let restarted = start_with(&test, &config).await;
    let ids: Vec<TaskId> = answers.iter().map(|a| a.task).collect();
    let states = wait_final(&test, &ids).await;
    assert!(
        states.iter().all(|s| s == "SUCCEEDED"),
        "{states:?}\n{}",
        restarted.log_tail(20)
    );
    let sql = test.sql().await.unwrap();
    for (i, a) in (40..).zip(&answers) {
        let attempt: i32 = sql
            .query_one(
                "SELECT attempt_no FROM task WHERE task_id = $1",
                &[&(a.task.0 as i64)],
            )
            .await
            .unwrap()
            .get(0);
        let key = format!("spindle-{}-{attempt}", a.task.0);
        let mut got = None;
        for account in ACCOUNTS {
            got = got.or(admin.mock_submission(account, &key).await.unwrap());
        }
        let got = got.unwrap_or_else(|| panic!("no job for {key}"));
        assert_eq!(got.input.to_string(), input_of(i), "task {i}");
    }
}

/// An input left in PostgreSQL whose stored request no longer parses (overwritten here, as a
/// damaged row or a foreign writer would leave it) ends its task FAILED at its first attempt,
/// with the reason and without a retry — no attempt could read it — while the node's other
/// tasks run as sent, and nothing stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_stored_input_fails_its_task_without_a_retry() {
    let test = TestDb::new().await;
    // Jobs of 1.5 s: the 8 claimed at submit hold the provider while the rows are overwritten.
    let (m, admin) = mock(1_500).await;
    // Inputs 0..32 held, 32..40 left stored.
    let (daemon, client, _) = inputs_node(&test, &m).await;
    let answers = client.submit_batch(big_inputs(0..40)).await.unwrap();
    assert!(answers.iter().all(|a| a.decision.is_accepted()));
    let ids: Vec<TaskId> = answers.iter().map(|a| a.task).collect();
    let damaged: Vec<i64> = ids[36..].iter().map(|t| t.0 as i64).collect();
    let sql = test.sql().await.unwrap();
    let overwritten = sql
        .execute(
            "UPDATE task SET payload = '\\x7b'::bytea
              WHERE task_id = ANY ($1) AND state = 'QUEUED' AND attempt_no = 0",
            &[&damaged],
        )
        .await
        .unwrap();
    assert_eq!(overwritten, 4, "the damaged tasks were still waiting");

    let states = wait_final(&test, &ids).await;
    assert_eq!(
        states,
        [vec!["SUCCEEDED"; 36], vec!["FAILED"; 4]].concat(),
        "{}",
        daemon.log_tail(20)
    );
    for row in sql
        .query(
            "SELECT attempt_no, failure_reason FROM task WHERE task_id = ANY ($1)",
            &[&damaged],
        )
        .await
        .unwrap()
    {
        let reason: String = row.get(1);
        assert_eq!(row.get::<_, i32>(0), 1, "not retried: {reason}");
        assert!(
            reason.contains("could not be read: its stored request is unreadable"),
            "{reason}"
        );
    }
    for (i, &task) in ids[..36].iter().enumerate() {
        let got = submitted(&admin, task).await;
        assert_eq!(got.input.to_string(), input_of(i), "task {i}");
    }
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 36, "no job for a damaged task");
}

/// Without a media stage, a succeeded task's result is the provider's video: `GetTask` tells
/// the client where it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_succeeded_task_tells_where_its_video_is() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    std::fs::write(&clip, b"the provider's video").unwrap();
    let (m, _admin) = mock_with(20, Some(clip.clone())).await;
    let daemon = node(&test, &m).await;
    let (ids, states) = run(&daemon, &test, "video", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let status = client.get(ids[0]).await.unwrap();
    let result: serde_json::Value =
        serde_json::from_str(status.result.as_deref().expect("a result")).unwrap();
    let url = result["output_url"].as_str().expect("the provider's URL");
    assert_eq!(url, format!("{}/v1/jobs/job-1/output", m.base_url()));
}

/// Submits 16 tasks to `node` and waits until the provider runs all it may for the node (2
/// accounts × 4, the other 8 queued); returns the tasks.
async fn submit_until_jobs_run(admin: &HttpProvider, node: &Daemon, prefix: &str) -> Vec<TaskId> {
    let ids = submit(node, prefix, 16).await;
    let in_flight = poll_until(
        Duration::from_secs(15),
        async || mock_total(admin, |s| s.in_flight).await,
        |&in_flight| in_flight == 8,
    )
    .await;
    assert_eq!(in_flight, 8, "the provider never ran the node's first jobs");
    ids
}

/// Submits 16 tasks to `node` and kills it (-9) once the provider runs all it may for the node;
/// returns the tasks.
async fn kill_while_jobs_run(admin: &HttpProvider, mut node: Daemon) -> Vec<TaskId> {
    let ids = submit_until_jobs_run(admin, &node, "resume").await;
    node.child.kill().unwrap();
    node.child.wait().unwrap();
    ids
}

/// Every one of `ids` SUCCEEDED with its first attempt, its job accepted and run once, the
/// contract never broken, nothing left held.
async fn assert_each_job_ran_once(
    test: &TestDb,
    admin: &HttpProvider,
    ids: &[TaskId],
    by: &Daemon,
) {
    let states = wait_final(test, ids).await;
    assert!(
        states.iter().all(|s| s == "SUCCEEDED"),
        "{states:?}\n{}",
        by.log_tail(30)
    );
    let total = assert_clean(test, admin).await;
    assert_eq!(
        (total.accepted, total.completed),
        (ids.len() as u64, ids.len() as u64),
        "each task's job accepted and run once"
    );
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    let sql = test.sql().await.unwrap();
    let first: i64 = sql
        .query_one(
            "SELECT count(*) FROM task WHERE task_id = ANY ($1) AND attempt_no = 1",
            &[&keys],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(first, keys.len() as i64, "no task needed a second attempt");
}

/// kill -9 while the provider runs jobs, then a restart: the new process asks the provider for
/// each live attempt by its request key and follows the job it finds to its end. Nothing is
/// submitted twice (the old process's jobs still run there, so a second submit would also
/// break the account's concurrency contract), and every task ends with its first attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_follows_the_providers_running_jobs_instead_of_submitting_them_again() {
    let test = TestDb::new().await;
    let (m, admin) = mock(1_500).await;
    let ids = kill_while_jobs_run(&admin, node(&test, &m).await).await;
    let restarted = node(&test, &m).await;
    assert_each_job_ran_once(&test, &admin, &ids, &restarted).await;
}

/// kill -9 again and again while tasks queue, dispatch and run at the provider: after the last
/// restart every stored task (each acknowledged one among them) SUCCEEDED, the provider
/// accepted and ran exactly one job per task — no restart submitted a job a dead process had
/// sent, and none was lost — and the contract was never broken, nothing left held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_kills_under_load_lose_no_task_and_submit_no_job_twice() {
    const ROUNDS: usize = 6;
    const BATCHES: usize = 6;
    let test = TestDb::new().await;
    let (m, admin) = mock(300).await;
    let mut acked: Vec<TaskId> = Vec::new();
    for round in 0..ROUNDS {
        let mut daemon = node(&test, &m).await;
        let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
            .await
            .unwrap();
        for b in 0..BATCHES {
            let batch: Vec<_> = (0..4)
                .map(|i| task(&format!("chaos-{round}-{b}-{i}")))
                .collect();
            for a in client.submit_batch(batch).await.unwrap() {
                assert!(a.decision.is_accepted(), "{a:?}");
                acked.push(a.task);
            }
        }
        // Killed at a different stage each round: right after the acknowledgements (claims
        // and provider submits in flight), once the provider runs this round's jobs (more
        // queued behind them), or once one of them finished (its report in flight).
        let (counter, at_least): (fn(&AccountStats) -> u64, u64) = match round % 3 {
            0 => (|s| s.accepted, 0),
            1 => (|s| s.accepted, 4),
            _ => (|s| s.completed, 1),
        };
        let before = mock_total(&admin, counter).await;
        let now = poll_until(
            Duration::from_secs(15),
            async || mock_total(&admin, counter).await,
            |&n| n >= before + at_least,
        )
        .await;
        assert!(
            now >= before + at_least,
            "round {round}: the provider never got there"
        );
        daemon.child.kill().unwrap();
        daemon.child.wait().unwrap();
    }
    let last = node(&test, &m).await;
    let sql = test.sql().await.unwrap();
    let stored: Vec<i64> = sql
        .query("SELECT task_id FROM task ORDER BY task_id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        stored.len(),
        ROUNDS * BATCHES * 4,
        "every acknowledged task is stored"
    );
    let ids: Vec<TaskId> = stored.iter().map(|&t| TaskId(t as u64)).collect();
    let states = wait_final(&test, &ids).await;
    assert!(
        states.iter().all(|s| s == "SUCCEEDED"),
        "{states:?}\n{}",
        last.log_tail(30)
    );
    for t in &acked {
        assert!(stored.contains(&(t.0 as i64)), "{t} was acknowledged");
    }
    let total = assert_clean(&test, &admin).await;
    assert_eq!(
        (total.accepted, total.completed),
        (ids.len() as u64, ids.len() as u64),
        "one job per task, each run once"
    );
}

/// Canceled tasks stay canceled when their node dies right after answering: two queued and
/// two at the provider are canceled, the node is killed (-9) at once, and the restarted node
/// ends all four CANCELED (the jobs canceled at the provider) while the rest run to success.
/// (The cancels lived in the dead node's memory before: the restarted node ran them on.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answered_cancel_outlives_its_node() {
    let test = TestDb::new().await;
    // Jobs outlast the restart, so that a canceled one is stopped, not run out.
    let (m, admin) = mock(4_000).await;
    let mut first = node(&test, &m).await;
    let ids = submit_until_jobs_run(&admin, &first, "gone").await;
    let sql = test.sql().await.unwrap();
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    let in_state = async |states: &[&str]| -> Vec<i64> {
        let states: Vec<String> = states.iter().map(|s| s.to_string()).collect();
        sql.query(
            "SELECT task_id FROM task WHERE task_id = ANY ($1) AND state = ANY ($2)
              ORDER BY task_id LIMIT 2",
            &[&keys, &states],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
    };
    let mut canceled = in_state(&["QUEUED"]).await;
    canceled.extend(in_state(&["DISPATCHING", "SUBMIT_UNKNOWN", "RUNNING"]).await);
    assert_eq!(canceled.len(), 4, "two queued and two at the provider");
    let client = Client::connect(first.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    for &t in &canceled {
        client.cancel(TaskId(t as u64)).await.unwrap();
    }
    first.child.kill().unwrap();
    first.child.wait().unwrap();

    let restarted = node(&test, &m).await;
    let states = wait_final(&test, &ids).await;
    for (t, state) in ids.iter().zip(&states) {
        let want = if canceled.contains(&(t.0 as i64)) {
            "CANCELED"
        } else {
            "SUCCEEDED"
        };
        assert_eq!(state, want, "task {t}\n{}", restarted.log_tail(30));
    }
    let total = assert_clean(&test, &admin).await;
    assert_eq!(
        total.completed, 12,
        "the canceled tasks' jobs did not run out"
    );
}

/// The same when another node takes the dead node's partitions over after their leases lapse:
/// it follows the dead node's jobs (their callbacks go to the dead node; it polls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_follows_the_dead_nodes_running_jobs() {
    let test = TestDb::new().await;
    let (m, admin) = mock(1_500).await;
    let first = node_named(&test, &m, "node-a").await;
    let second = node_named(&test, &m, "node-b").await;
    let ids = kill_while_jobs_run(&admin, first).await;
    assert_each_job_ran_once(&test, &admin, &ids, &second).await;
}

/// However many attempts run, the node has at most `provider.requests_max` calls open at the
/// provider; the rest wait their turn, and everything still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_open_at_the_provider_stay_within_requests_max() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    let config = node_config("bounded-node", &m, "requests_max = 2");
    let daemon = start_with(&test, &config).await;
    let (_, states) = run(&daemon, &test, "bounded", 24).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 24);
    let stats = admin.mock_stats().await.unwrap();
    assert!(
        (1..=2).contains(&stats.max_open_requests),
        "{} calls open at once",
        stats.max_open_requests
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_storm_is_retried_with_backoff_and_never_breaks_the_contract() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    set_fault(&admin, Fault::RateLimit).await;
    let daemon = node(&test, &m).await;
    let (_, states) = run(&daemon, &test, "rl", 30).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 30, "each task accepted once");
    assert!(total.rate_limited > 0, "the storm never hit: {total:?}");
    // The 429s halved an account's rate for two minutes; /metrics (and the dashboard) say so.
    let penalized = poll_until(
        Duration::from_secs(10),
        async || {
            let (_, metrics) = http_get(daemon.http, "/metrics").await;
            metrics
                .lines()
                .any(|l| l.starts_with("spindle_provider_penalized") && l.ends_with(" 1"))
        },
        |&penalized| penalized,
    )
    .await;
    assert!(penalized, "no account shown as penalized after a 429 storm");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_after_acceptance_is_resolved_by_request_key_not_resubmitted() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    set_fault(&admin, Fault::TimeoutAfterAccept).await;
    let daemon = node(&test, &m).await;
    let (_, states) = run(&daemon, &test, "to", 8).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 8, "found by key, never sent again");
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert!(
        metrics.contains("spindle_provider_submits_total{result=\"unknown\"} 8"),
        "{metrics}"
    );
}

/// A submit without an answer, then the provider's queries down for longer than a round of
/// them: the attempt stays in doubt, holding its reservation, and is asked about again until
/// the provider answers — then found and completed, never submitted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_in_doubt_is_asked_about_again_until_the_provider_answers() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    set_fault(&admin, Fault::TimeoutAfterAccept).await;
    let daemon = node(&test, &m).await;
    let ids = submit(&daemon, "doubt", 2).await;
    let accepted = poll_until(
        Duration::from_secs(10),
        async || mock_total(&admin, |s| s.accepted).await,
        |&accepted| accepted == 2,
    )
    .await;
    assert_eq!(accepted, 2);
    // Before the node's first query (one call timeout after the unknown outcome).
    set_fault(&admin, Fault::QueryOutage).await;
    let rounds = poll_until(
        Duration::from_secs(30),
        async || common::metric(&daemon, "spindle_provider_unresolved_total").await,
        |&rounds| rounds >= 2,
    )
    .await;
    assert!(rounds >= 2, "no round of queries went unanswered");
    let sql = test.sql().await.unwrap();
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    let doubt: i64 = sql
        .query_one(
            "SELECT count(*) FROM task WHERE task_id = ANY ($1) AND state = 'SUBMIT_UNKNOWN'",
            &[&keys],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        doubt, 2,
        "in doubt, reservations held, while nobody can tell"
    );
    set_fault(&admin, Fault::None).await;
    let states = wait_final(&test, &ids).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 2, "found by key once the provider answered");
}

/// A job that never ends at the provider (its callbacks lost, polls answering "running"):
/// after `polls_max` polls it is canceled there and its task ends FAILED with the reason,
/// its reservations given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_stuck_at_the_provider_is_canceled_after_its_polls_and_fails_with_the_reason() {
    let test = TestDb::new().await;
    let (m, admin) = mock(600_000).await;
    set_fault(&admin, Fault::LostCallback).await;
    let config = node_config("stuck-node", &m, "polls_max = 5\npoll_ms = [20]");
    let daemon = start_with(&test, &config).await;
    let (ids, states) = run(&daemon, &test, "stuck", 2).await;
    assert_eq!(states, ["FAILED", "FAILED"]);
    let sql = test.sql().await.unwrap();
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    for r in sql
        .query(
            "SELECT failure_reason FROM task WHERE task_id = ANY ($1)",
            &[&keys],
        )
        .await
        .unwrap()
    {
        let reason: String = r.get(0);
        assert!(
            reason.contains("no final state after 5 polls: canceled at the provider"),
            "{reason}"
        );
    }
    let total = assert_clean(&test, &admin).await;
    assert_eq!(
        total.accepted, 2,
        "not retried: a stuck job is not run again"
    );
}

/// The expensive lane's execution timeout (400 ms) binds on its jobs and on no other lane's:
/// of two tasks whose jobs run 2 s at the provider, the expensive one (a clip with audio) is
/// canceled there at its timeout and ends FAILED with the reason, not run again; the standard
/// one succeeds. Without the lane's `execution_timeout_ms` both succeed, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expensive_lanes_execution_timeout_cancels_its_jobs_and_no_others() {
    let test = TestDb::new().await;
    let (m, admin) = mock(2_000).await;
    let config =
        node_config("timeout-node", &m, "") + "\n[lanes.EXPENSIVE]\nexecution_timeout_ms = 400\n";
    let daemon = start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut expensive = task("expensive");
    expensive.spec.audio = true;
    let mut ids = Vec::new();
    for t in [expensive, task("standard")] {
        let a = client.submit(t).await.unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
        ids.push(a.task);
    }
    wait_final(&test, &ids).await;
    let sql = test.sql().await.unwrap();
    let ended = |task: TaskId| {
        let sql = &sql;
        async move {
            let row = sql
                .query_one(
                    "SELECT state, coalesce(failure_reason, '') FROM task WHERE task_id = $1",
                    &[&(task.0 as i64)],
                )
                .await
                .unwrap();
            (row.get::<_, String>(0), row.get::<_, String>(1))
        }
    };
    let (state, reason) = ended(ids[0]).await;
    assert_eq!(state, "FAILED", "{}", daemon.log_tail(10));
    assert!(
        reason.contains("EXPENSIVE lane's execution timeout (400 ms): canceled at the provider"),
        "{reason}"
    );
    assert_eq!(ended(ids[1]).await.0, "SUCCEEDED");
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 2, "a timed-out job is not run again");
    assert_eq!(mock_total(&admin, |s| s.canceled).await, 1);
}

/// Dead letters from a provider that refused every submit: once it is fixed, an operator
/// requeues them (`spindlectl requeue`) and they run — each accepted once, as its next attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_requeues_dead_letters_and_they_run_again() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    set_fault(&admin, Fault::Auth).await;
    let config = node_config("requeue-node", &m, "") + &common::admin_tokens();
    let daemon = start_with(&test, &config).await;
    let (ids, states) = run(&daemon, &test, "dead", 3).await;
    assert_eq!(states, ["FAILED", "FAILED", "FAILED"]);
    // What an operator looks at first: the task, whatever its tenant, and why it failed.
    let id = ids[0].0.to_string();
    let (ok, out) = common::ctl(daemon.http, common::VIEWER_TOKEN, &["task", &id]);
    assert!(ok, "{out}");
    assert!(
        out.starts_with(&format!("task {id} of tenant 1: FAILED")),
        "{out}"
    );
    assert!(out.contains("failed: refused (Auth)"), "{out}");
    let (ok, out) = common::ctl(
        daemon.http,
        common::VIEWER_TOKEN,
        &["--json", "task", "999999"],
    );
    assert!(!ok && out.contains("task 999999 not found"), "{out}");
    // The dead-letter queue, two tasks looked at per page: every FAILED task, once, in order.
    let mut listed = Vec::new();
    let mut after = 0u64;
    for _ in 0..10 {
        let after_arg = after.to_string();
        let args = [
            "--json",
            "dead-letters",
            "--scan",
            "2",
            "--after",
            &after_arg,
        ];
        let (ok, out) = common::ctl(daemon.http, common::VIEWER_TOKEN, &args);
        assert!(ok, "{out}");
        let page: serde_json::Value = serde_json::from_str(&out).unwrap();
        for t in page["tasks"].as_array().unwrap() {
            assert_eq!(t["state"], "FAILED", "{t}");
            listed.push(TaskId(t["task"].as_u64().unwrap()));
        }
        match page["next_after"].as_u64() {
            Some(next) => after = next,
            None => break,
        }
    }
    assert_eq!(listed, ids, "the dead letters, page by page");
    set_fault(&admin, Fault::None).await;
    let mut args: Vec<String> = vec!["--json".into(), "requeue".into()];
    args.extend(ids.iter().map(|t| t.0.to_string()));
    args.extend([
        "999999".into(),
        "--reason".into(),
        "credentials fixed".into(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // A viewer may not.
    let (ok, _) = common::ctl(daemon.http, common::VIEWER_TOKEN, &args);
    assert!(!ok, "a viewer requeued tasks");
    let (ok, out) = common::ctl(daemon.http, common::OPERATOR_TOKEN, &args);
    assert!(ok, "{out}");
    let answer: serde_json::Value = serde_json::from_str(&out).unwrap();
    let outcomes: Vec<&str> = answer["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["requeued", "requeued", "requeued", "not_found"]);
    let states = wait_final(&test, &ids).await;
    assert_eq!(states, ["SUCCEEDED", "SUCCEEDED", "SUCCEEDED"]);
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 3, "refused first, then accepted once each");
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    let sql = test.sql().await.unwrap();
    let second: i64 = sql
        .query_one(
            "SELECT count(*) FROM task WHERE task_id = ANY ($1) AND attempt_no = 2",
            &[&keys],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        second, 3,
        "each ran as its next attempt (a new request key)"
    );
    // Requeued again, SUCCEEDED tasks stay as they are.
    let first = ids[0].0.to_string();
    let again = ["requeue", first.as_str(), "--reason", "again"];
    let (ok, out) = common::ctl(daemon.http, common::OPERATOR_TOKEN, &again);
    assert!(ok, "{out}");
    assert!(out.contains("not_failed (SUCCEEDED)"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_requeue_that_committed_unheard_is_taken_back_when_asked_again() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    set_fault(&admin, Fault::Auth).await;
    let config = node_config("requeue-again-node", &m, "") + &common::admin_tokens();
    let daemon = start_with(&test, &config).await;
    let (ids, states) = run(&daemon, &test, "unheard", 1).await;
    assert_eq!(states, ["FAILED"]);
    set_fault(&admin, Fault::None).await;
    // The requeue committed in PostgreSQL and its answer never reached the node (its shard
    // never took the task back): QUEUED in the store, unknown to the node.
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE task SET state = 'QUEUED', version = version + 1, failure_reason = NULL
          WHERE task_id = $1",
        &[&(ids[0].0 as i64)],
    )
    .await
    .unwrap();
    // Asked again: the task is handed back to its shard and runs.
    let task = ids[0].0.to_string();
    let args = ["--json", "requeue", task.as_str(), "--reason", "again"];
    let (ok, out) = common::ctl(daemon.http, common::OPERATOR_TOKEN, &args);
    assert!(ok, "{out}");
    let answer: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(answer["tasks"][0]["outcome"], "already_queued", "{out}");
    assert_eq!(wait_final(&test, &ids).await, ["SUCCEEDED"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_whose_answer_was_lost_is_claimed_again_at_its_stored_version() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    set_fault(&admin, Fault::ServerError).await;
    let proxy = Proxy::start(&test.config().conninfo);
    let daemon = start_on(proxy.conninfo(), &node_config("requeue-node", &m, "")).await;
    // After a 503 the attempt is in doubt at the provider until a query by request key finds
    // nothing; then it is requeued. That requeue commits, its answer (the one answer after
    // the submit's to name QUEUED) is lost, and its retry finds the attempt gone: the task's
    // next claim expects the version from before the requeue.
    let ids = submit(&daemon, "lost", 1).await;
    proxy.lose_answer_containing(b"QUEUED");
    let sql = test.sql().await.unwrap();
    // A call's rows go out before its commit: the cut waits for the requeue to be committed
    // (claimed at version 1, SUBMIT_UNKNOWN at 2, requeued at 3).
    let requeued = "SELECT state = 'QUEUED' AND version = 3 FROM task";
    proxy.wait_lost_and(&sql, requeued).await;
    assert_eq!(proxy.lost(), 1, "the requeue's answer was lost");
    set_fault(&admin, Fault::None).await;
    proxy.cut();
    // Claimed again at the version PostgreSQL has, not dropped as moved by another writer.
    assert_eq!(wait_final(&test, &ids).await, ["SUCCEEDED"]);
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_retried_then_fail_with_the_reason() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    set_fault(&admin, Fault::ServerError).await;
    let daemon = node(&test, &m).await;
    let (ids, states) = run(&daemon, &test, "5xx", 3).await;
    assert!(states.iter().all(|s| s == "FAILED"), "{states:?}");
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 0);
    let sql = test.sql().await.unwrap();
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    // The dead-letter view names them, their attempts, the reason and the last provider.
    let rows = sql
        .query(
            "SELECT attempts, failure_reason, last_provider FROM dead_letter
              WHERE task_id = ANY ($1)",
            &[&keys],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 3);
    for r in rows {
        let (attempts, reason): (i32, Option<String>) = (r.get(0), r.get(1));
        assert!(
            r.get::<_, Option<String>>(2).is_some(),
            "the last provider is named"
        );
        assert_eq!(attempts, 4, "the first attempt and the lane's 3 retries");
        assert!(
            reason.unwrap_or_default().contains("never accepted"),
            "the reason names what happened"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_fail_at_once_and_refund_the_budget() {
    let test = TestDb::new().await;
    let mut db = spindle_control::Db::open(test.config()).await.unwrap();
    db.set_tenant_budget(
        TenantId(1),
        1_000_000_000,
        "test",
        "a budget to refund into",
    )
    .await
    .unwrap();
    let (m, admin) = mock(30).await;
    // Checked every second: the dead-letter count follows the failures.
    let daemon = start_with(
        &test,
        &format!(
            "counter_check_s = 1\n{}",
            node_config("provider-node", &m, "")
        ),
    )
    .await;
    for (fault, class) in [
        (Fault::Auth, "Auth"),
        (Fault::Balance, "Balance"),
        (Fault::InvalidParameters, "InvalidParameters"),
        (Fault::Moderation, "Moderation"),
    ] {
        set_fault(&admin, fault).await;
        let (ids, states) = run(&daemon, &test, &format!("{class}-"), 2).await;
        assert!(
            states.iter().all(|s| s == "FAILED"),
            "{fault:?}: {states:?}"
        );
        let sql = test.sql().await.unwrap();
        let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
        for r in sql
            .query(
                "SELECT attempt_no, failure_reason FROM task WHERE task_id = ANY ($1)",
                &[&keys],
            )
            .await
            .unwrap()
        {
            assert_eq!(r.get::<_, i32>(0), 1, "{fault:?}: never retried");
            let reason: String = r.get(1);
            assert!(reason.contains(class), "{fault:?}: {reason}");
        }
    }
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 0);
    let sql = test.sql().await.unwrap();
    let refunds: i64 = sql
        .query_one(
            "SELECT count(*) FROM quota_ledger WHERE kind = 'REFUND'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(refunds, 8, "every failed task's budget came back");
    let spent: i64 = sql
        .query_one(
            "SELECT spent_milli FROM tenant_quota WHERE tenant_id = 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(spent, 0, "nothing was charged");
    let dead = poll_until(
        std::time::Duration::from_secs(10),
        async || common::metric(&daemon, "spindle_dead_letters").await,
        |&n| n == 8,
    )
    .await;
    assert_eq!(dead, 8, "every failed task in the dead-letter count");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_callbacks_are_covered_by_polling_and_duplicates_change_nothing() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    let daemon = node(&test, &m).await;
    set_fault(&admin, Fault::LostCallback).await;
    let (_, states) = run(&daemon, &test, "lost", 6).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    set_fault(&admin, Fault::DuplicateCallback).await;
    let (_, states) = run(&daemon, &test, "dup", 6).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    set_fault(&admin, Fault::Slow).await;
    let (_, states) = run(&daemon, &test, "slow", 2).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    let total = assert_clean(&test, &admin).await;
    assert_eq!((total.accepted, total.completed), (14, 14));
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    let count = |kind: &str| -> u64 {
        let prefix = format!("spindle_provider_callbacks_total{{kind=\"{kind}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
            .unwrap_or(0)
    };
    assert!(
        count("polled") >= 6,
        "lost callbacks found by polling\n{metrics}"
    );
    // The mock's second copy carries the same signature: taken once, the copy is a replay.
    assert!(
        count("replayed") >= 1,
        "duplicate callbacks not acted on twice\n{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_stale_callbacks_change_nothing() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    let daemon = node(&test, &m).await;
    let (ids, states) = run(&daemon, &test, "done", 1).await;
    assert_eq!(states, vec!["SUCCEEDED".to_string()]);
    let view = spindle_providers::JobView {
        job_id: "job-1".into(),
        account: ACCOUNTS[0].into(),
        request_key: format!("spindle-{}-1", ids[0]),
        state: spindle_providers::JobState::Failed,
        progress: 100,
        cost_milli: None,
        error: Some("late".into()),
        retryable: false,
        output_url: None,
    };
    let body = serde_json::to_vec(&view).unwrap();
    let post = |signature: String| {
        let body = body.clone();
        async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(daemon.http).await.unwrap();
            let head = format!(
                "POST /v1/provider/callback HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\nx-signature: {signature}\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).await.unwrap();
            s.write_all(&body).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        }
    };
    let forged = post("sha256=".to_string() + &"0".repeat(64)).await;
    assert!(forged.starts_with("HTTP/1.1 401"), "{forged}");
    // Signed without a time (the untimed form): refused.
    let untimed = post(spindle_providers::signature::sign(SECRET.as_bytes(), &body)).await;
    assert!(untimed.starts_with("HTTP/1.1 401"), "{untimed}");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    // Signed ten minutes ago (a captured callback sent again later): refused, the window is
    // five minutes.
    let old = spindle_providers::signature::sign_at(SECRET.as_bytes(), now_ms - 600_000, &body);
    let late = post(old).await;
    assert!(
        late.starts_with("HTTP/1.1 401") && late.contains("outside the 300000 ms window"),
        "{late}"
    );
    // Signed now, but for an attempt that already ended: nobody watches it.
    let signed = spindle_providers::signature::sign_at(SECRET.as_bytes(), now_ms, &body);
    let stale = post(signed.clone()).await;
    assert!(stale.starts_with("HTTP/1.1 200"), "{stale}");
    // The same again, within the window: seen already, not acted on.
    let again = post(signed).await;
    assert!(again.contains("seen already"), "{again}");
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    for kind in ["outside_window", "replayed"] {
        assert!(
            metrics.contains(&format!(
                "spindle_provider_callbacks_total{{kind=\"{kind}\"}} 1"
            )),
            "{kind}: {metrics}"
        );
    }
    let sql = test.sql().await.unwrap();
    let state: String = sql
        .query_one(
            "SELECT state FROM task WHERE task_id = $1",
            &[&(ids[0].0 as i64)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        state, "SUCCEEDED",
        "a late callback cannot undo a finished task"
    );
    assert_clean(&test, &admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_racing_the_callback_ends_canceled_with_nothing_held() {
    let test = TestDb::new().await;
    let (m, admin) = mock(300).await;
    let daemon = node(&test, &m).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut ids = Vec::new();
    let mut canceled = Vec::new();
    // Rounds of six: a round whose jobs all ended before its cancels came (a loaded machine
    // can take the jobs' 300 ms between the two) cancels nothing, and another goes.
    for round in 0..5 {
        let mut batch = Vec::new();
        for i in 0..6 {
            let a = client.submit(task(&format!("c{round}-{i}"))).await.unwrap();
            batch.push(a.task);
        }
        // Cancel once they run at the provider (jobs take 300 ms); some may already be done.
        let running = poll_until(
            Duration::from_secs(10),
            async || mock_total(&admin, |s| s.in_flight).await,
            |&running| running > 0,
        )
        .await;
        assert!(running > 0, "no job ran at the provider");
        for t in &batch {
            if client.cancel(*t).await.is_ok() {
                canceled.push(t.0 as i64);
            }
        }
        ids.extend(batch);
        if !canceled.is_empty() {
            break;
        }
        // The next round's jobs start once these have left the provider.
        wait_final(&test, &ids).await;
    }
    assert!(
        !canceled.is_empty(),
        "nothing was cancelable in five rounds"
    );
    let states = wait_final(&test, &ids).await;
    assert!(
        states.iter().all(|s| s == "SUCCEEDED" || s == "CANCELED"),
        "{states:?} (canceled {canceled:?} of {ids:?})\n{}",
        daemon.log_tail(60)
    );
    let sql = test.sql().await.unwrap();
    let ended_canceled: i64 = sql
        .query_one(
            "SELECT count(*) FROM task WHERE task_id = ANY ($1) AND state = 'CANCELED'",
            &[&canceled],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        ended_canceled,
        canceled.len() as i64,
        "every acknowledged cancel holds"
    );
    assert_clean(&test, &admin).await;
}

/// With one request to the provider open at a time, the second of two granted tasks waits for
/// its turn while the first's submit hangs (accepted, answered past the node's timeout). Both
/// are canceled then: the waiting submit is never sent, the first's job — in doubt — is stopped
/// once the query by request key finds it and watched to its end, and both end CANCELED with
/// nothing held. (Before, the waiting submit went out after the cancel, and the job found for
/// the first was stopped but not watched: nothing ended its attempt, and the task stayed
/// SUBMIT_UNKNOWN for good, holding its reservations.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_waiting_its_turn_is_not_sent_once_its_task_is_canceled() {
    let test = TestDb::new().await;
    let (m, admin) = mock(10_000).await;
    set_fault(&admin, Fault::TimeoutAfterAccept).await;
    let daemon = doubting_node(&test, &m, "requests_max = 1").await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let ids = submit(&daemon, "turn", 2).await;
    let accepted = poll_until(
        Duration::from_secs(10),
        async || mock_total(&admin, |s| s.accepted).await,
        |&accepted| accepted == 1,
    )
    .await;
    assert_eq!(accepted, 1, "the first submit never reached the provider");
    for t in &ids {
        client.cancel(*t).await.unwrap();
    }
    let states = wait_final(&test, &ids).await;
    assert_eq!(states, ["CANCELED", "CANCELED"], "{}", daemon.log_tail(30));
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 1, "a canceled task's submit was sent");
    assert_eq!(total.completed, 0, "the job was stopped, not run out");
    assert_eq!(mock_total(&admin, |s| s.in_flight).await, 0);
    let withdrawn = "spindle_provider_submits_total{result=\"withdrawn\"}";
    assert_eq!(common::metric(&daemon, withdrawn).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_provider_opens_its_circuit_and_work_fails_over_to_a_compatible_one() {
    let test = TestDb::new().await;
    let (m, admin) = mock(30).await;
    admin
        .set_fault(ACCOUNTS[0], Fault::ServerError)
        .await
        .unwrap();
    let daemon = node(&test, &m).await;
    let (_, states) = run(&daemon, &test, "fo", 12).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    assert_clean(&test, &admin).await;
    let stats = admin.mock_stats().await.unwrap();
    assert_eq!(stats.accounts[ACCOUNTS[0]].accepted, 0);
    assert_eq!(
        stats.accounts[ACCOUNTS[1]].accepted, 12,
        "each task accepted once, there"
    );
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    let opened = format!(
        "spindle_provider_circuit_opened_total{{provider=\"{}\"}} 0",
        ACCOUNTS[0]
    );
    assert!(
        !metrics.contains(&opened),
        "the circuit never opened\n{metrics}"
    );
}

/// A provider that charges more than the matrix says (the mock reports 1,234 milli for a task
/// the matrix prices at 50): once the node has seen `cost_calibration_samples` of them, new
/// tasks are priced — and their budgets reserved — at what such tasks cost (the ratio held
/// within ×4), while the tasks admitted before keep their estimate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_follow_what_the_provider_really_charges() {
    let test = TestDb::new().await;
    let (m, _) = mock(10).await;
    let config = common::mock::node("calibrating-node", &m, "")
        .set("cost_calibration_samples", 4)
        .toml();
    let daemon = start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut seen = Vec::new();
    for i in 0..5 {
        // One at a time: each is priced after the ones before it completed.
        let a = client.submit(task(&format!("charged-{i}"))).await.unwrap();
        common::wait_for(&client, a.task, TaskState::Succeeded).await;
        let status = client.get(a.task).await.unwrap();
        seen.push((status.cost_estimate_milli, status.cost_actual_milli));
    }
    assert_eq!(
        seen,
        [
            (50, 1_234),
            (50, 1_234),
            (50, 1_234),
            (50, 1_234),
            (200, 1_234)
        ],
        "the fifth priced at 4 × the matrix (1,234 / 50 held at ×4)"
    );
}

/// A node on the mock (its two accounts at 10 requests a second, burst 10), running them at
/// 9.5 (burst 4) with slots to spare; `n` tasks submitted as `prefix…`, and 1.5 s in, once the
/// first bursts went, every claim held up for 2 s by a lock on the pool rows (as a disk's
/// flush stall or a starved thread holds them).
async fn stalled_at_full_rate(test: &TestDb, prefix: &str, n: usize) -> Stalled {
    let (m, admin) = mock_of(10, "64:600", None).await;
    let config = common::mock::node(&format!("{prefix}-node"), &m, "")
        .set("provider_concurrency", 64)
        .set("provider_rpm", 600)
        .toml();
    let daemon = start_with(test, &config).await;
    let ids = submit(&daemon, prefix, n).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let mut sql = test.sql().await.unwrap();
    let tx = sql.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE resource_pool_shard IN EXCLUSIVE MODE")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    tx.commit().await.unwrap();
    Stalled {
        daemon,
        ids,
        admin,
        _mock: m,
    }
}

/// A node after [`stalled_at_full_rate`]'s stall.
struct Stalled {
    daemon: Daemon,
    ids: Vec<TaskId>,
    /// The mock's admin client.
    admin: HttpProvider,
    _mock: MockProvider,
}

/// A stall between taking an RPM token and sending the submit (here: PostgreSQL's claims held
/// up by a lock for 2 s, as a disk's flush stall or a starved thread holds them) must not let
/// the tasks picked meanwhile reach the provider together: the mock's contract (10 a second, a
/// burst of 10, per account; the node runs 9.5 with a burst of 4) is never broken, because
/// submits are paced where they leave the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_held_up_after_their_rpm_token_reach_the_provider_paced() {
    let test = TestDb::new().await;
    // The mock lives as long as `_mock`.
    let Stalled {
        daemon,
        ids,
        admin,
        _mock,
    } = stalled_at_full_rate(&test, "paced", 80).await;
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    let done = common::wait_all_succeeded(&test.sql().await.unwrap(), &keys).await;
    assert_eq!(done, 80);
    // Without the pacing where submits leave, the mock counted ~9 violations per account here.
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 80, "each task accepted once");
    // The submits picked during the stall were held back, ~50 s in all (~2 s without the
    // stall: at an account's full rate a submit waits out its claim's jitter).
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    let held: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("spindle_provider_paced_seconds_total "))
        .and_then(|v| v.parse().ok())
        .expect("the pacing's seconds in /metrics");
    assert!(held > 10.0, "the stall bunched nothing: {held} s held");
}

/// The provider over HTTPS, its certificate issued by a private CA the node is told of
/// (`provider.ca_file`): its API and the video it returns (fetched by the media stage) both
/// over TLS; every task completes once, nothing held after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provider_is_reached_over_https_trusting_the_configured_ca() {
    use spindle_providers::tls;
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (ca, server) = common::localhost_tls(dir.path());
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (320, 240), 25, 1, 23);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let m = MockProvider::serve_tls(listener, mock_config(30, "4:6000", Some(clip)), server);
    assert!(m.base_url().starts_with("https://"));
    let admin = m
        .client(Duration::from_secs(5))
        .with_tls(&tls::with_roots_file(&ca).unwrap());
    let out = dir.path().join("out");
    let config = node_config("tls-node", &m, &format!("ca_file = \"{}\"", ca.display()));
    let media = format!(
        "[media]\nworkers = 1\noutput_dir = \"{}\"\nrenditions = [120]\ndeclaration = \"correct\"\n",
        out.display()
    );
    let daemon = start_with(&test, &format!("{config}\n{media}")).await;
    let (ids, states) = run(&daemon, &test, "tls", 6).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    // Each task's rendition was made from the video fetched over HTTPS.
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    for t in &ids {
        let result = client.get(*t).await.unwrap().result.expect("a result");
        let result: serde_json::Value = serde_json::from_str(&result).unwrap();
        assert_eq!(
            result["outputs"].as_array().map(Vec::len),
            Some(1),
            "{result}"
        );
    }
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 6);
}

/// After a stall bunched an account's submits at the pacer, the shard picks nothing more for
/// the account until they have left: with the account kept busy (tasks still queued for it),
/// the backlog drains in about its own length of time, where before it stood for as long as
/// the account stayed busy, every later submit waiting behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_a_stall_left_at_the_pacer_drains_while_the_account_stays_busy() {
    let test = TestDb::new().await;
    // ~17 s of work at the two accounts' ~19 requests a second.
    // The mock lives as long as `_mock`.
    let Stalled {
        daemon,
        ids,
        admin,
        _mock,
    } = stalled_at_full_rate(&test, "backlog", 320).await;
    let waiting = async || common::metric(&daemon, "spindle_provider_paced_waiting").await;
    // What the stall held up now waits at the pacers (~15 per account)...
    let peak = common::poll_until(Duration::from_secs(5), waiting, |w| *w >= 8).await;
    assert!(
        peak >= 8,
        "the stall bunched nothing: {peak} submits waiting"
    );
    // ... and has left within a few seconds, while most of the work is still queued.
    let left = common::poll_until(Duration::from_secs(8), waiting, |w| *w <= 2).await;
    let queued = common::read_i64(
        &test.sql().await.unwrap(),
        "SELECT count(*) FROM task WHERE state = 'QUEUED'",
    )
    .await;
    assert!(left <= 2, "the backlog stood: {left} submits still waiting");
    assert!(
        queued > 20,
        "the accounts ran out of work first ({queued} queued)"
    );
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    let done = common::wait_all_succeeded(&test.sql().await.unwrap(), &keys).await;
    assert_eq!(done, 320);
    let total = assert_clean(&test, &admin).await;
    assert_eq!(total.accepted, 320, "each task accepted once");
}

/// The wait a client is told is true: in a steady lane (eight provider slots always busy with
/// jobs of a second, the node's rate measured over its last completions), a batch submitted
/// behind a standing queue is told when each of its tasks will start — on the admission, and
/// again on a GetTask while it waits — and the deepest task starts within a quarter of both.
/// (Before, the admission said "the shard's uptime plus the wait" and GetTask said nothing.)
/// The bound is what a loaded machine keeps: with another process on both cores the node's
/// own time per slot cycle (the report, the claim, the next submit) moves by tens of
/// milliseconds, which jobs of 400 ms turned into 38 % once; jobs of a second keep it well
/// inside a quarter, and a quiet machine inside a tenth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expected_start_on_the_wire_is_within_a_quarter_of_the_actual_start() {
    let test = TestDb::new().await;
    let (m, _admin) = mock(1_000).await;
    // Every task priced alike throughout (a calibration would price the later ones at what
    // the provider reports, not what the earlier ones were counted at).
    let config = common::mock::node("provider-node", &m, "")
        .set("cost_calibration_samples", 0)
        .toml();
    let daemon = start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let sql = test.sql().await.unwrap();
    // The standing queue: 8 run, the rest wait; the rate is measured once 40 have finished.
    let warm: Vec<_> = (0..72).map(|i| task(&format!("warm{i}"))).collect();
    common::accepted_ids(client.submit_batch(warm).await);
    let done = poll_until(
        Duration::from_secs(60),
        async || {
            common::read_i64(&sql, "SELECT count(*) FROM task WHERE state = 'SUCCEEDED'").await
        },
        |&n| n >= 40,
    )
    .await;
    assert!(done >= 40, "{}", daemon.log_tail(20));

    let batch: Vec<_> = (0..40).map(|i| task(&format!("timed{i}"))).collect();
    let answers = client.submit_batch(batch).await.unwrap();
    let answered = std::time::Instant::now();
    assert!(
        answers.iter().all(|a| a.decision.is_accepted()),
        "{answers:?}"
    );
    let told: Vec<u32> = answers.iter().map(|a| a.expected_start_ms).collect();
    assert!(
        told.windows(2).all(|w| w[0] <= w[1]),
        "later tasks of the batch wait longer: {told:?}"
    );
    let last = answers.last().unwrap().task;
    let told_at_answer = Duration::from_millis(u64::from(*told.last().unwrap()));
    // Asked again a second into its wait.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let status = client.get(last).await.unwrap();
    let asked = std::time::Instant::now();
    assert_eq!(status.state, TaskState::Queued, "{status:?}");
    let told_when_asked = Duration::from_millis(u64::from(status.expected_start_ms));
    assert!(told_when_asked > Duration::ZERO, "{status:?}");
    let started = poll_until(
        Duration::from_secs(60),
        async || client.get(last).await.unwrap().state,
        |&s| s != TaskState::Queued,
    )
    .await;
    assert_ne!(started, TaskState::Queued);
    let (since_answer, since_asked) = (answered.elapsed(), asked.elapsed());
    let within_a_quarter = |told: Duration, actual: Duration| {
        let diff = told.abs_diff(actual);
        assert!(
            diff * 4 <= actual,
            "told {told:?}, started after {actual:?} (admissions: {told:?}) {}",
            daemon.log_tail(45)
        );
    };
    within_a_quarter(told_at_answer, since_answer);
    within_a_quarter(told_when_asked, since_asked);
}
