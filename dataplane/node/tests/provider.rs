//! spindled against spindle-mock-provider (in-process, real sockets): one test per fault mode,
//! asserting final states, reservations, budgets and the mock's counters (no concurrency or RPM
//! violation, no request key sent twice), plus callbacks that must change nothing.

mod common;

use std::time::Duration;

use common::{http_get, metric_sum, poll_until, start_on, start_with, task, Daemon};
use spindle_client::Client;
use spindle_control::testing::{Proxy, TestDb};
use spindle_core::{TaskId, TaskState, TenantId};
use spindle_providers::api::{AccountStats, Fault};
use spindle_providers::{HttpProvider, MockConfig, MockProvider};

const SECRET: &str = "mock-secret";
const ACCOUNTS: [&str; 2] = [
    "vendor-0:acct-1:us:video-model-0",
    "vendor-1:acct-1:us:video-model-0",
];

async fn mock(job_ms: u64) -> (MockProvider, HttpProvider) {
    mock_with(job_ms, None).await
}

/// A mock whose succeeded jobs return `clip`.
async fn mock_with(job_ms: u64, clip: Option<std::path::PathBuf>) -> (MockProvider, HttpProvider) {
    mock_of(job_ms, "4:6000", clip).await
}

/// A mock whose accounts' contracts are `limits` ("concurrency:rpm").
async fn mock_of(
    job_ms: u64,
    limits: &str,
    clip: Option<std::path::PathBuf>,
) -> (MockProvider, HttpProvider) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let m = MockProvider::serve(listener, mock_config(job_ms, limits, clip));
    let admin = m.client(Duration::from_secs(5));
    (m, admin)
}

fn mock_config(job_ms: u64, limits: &str, clip: Option<std::path::PathBuf>) -> MockConfig {
    MockConfig {
        accounts: ACCOUNTS
            .iter()
            .map(|a| format!("{a}:{limits}").parse().unwrap())
            .collect(),
        secret: SECRET.into(),
        job_ms,
        cost_milli: 1_234,
        hang_ms: 1_500,
        clip,
    }
}

async fn node(test: &TestDb, provider: &MockProvider) -> Daemon {
    node_named(test, provider, "provider-node").await
}

/// spindled with the mock at `provider`, as node `id` (leases of 3 s: a takeover is quick).
async fn node_named(test: &TestDb, provider: &MockProvider, id: &str) -> Daemon {
    start_with(test, &node_config(id, provider, "")).await
}

/// The provider tests' node configuration, with `provider_extra` in its `[provider]` section.
fn node_config(id: &str, provider: &MockProvider, provider_extra: &str) -> String {
    format!(
        r#"
node_id = "{id}"
lease_ms = 3000
listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
shards = 2
partitions = 8
provider_concurrency = 4
provider_rpm = 6000
lane_capacity_units = 100000
retry_backoff_base_ms = 20
retry_backoff_max_ms = 200

[provider]
url = "{}"
secret = "{SECRET}"
timeout_ms = 400
poll_ms = [100, 200]
{provider_extra}

[[tenants]]
id = 1
credential = "one"
"#,
        provider.base_url()
    )
}

/// A node whose submits to a mock hanging on them (`Fault::TimeoutAfterAccept`: it answers
/// after 1.5 s) give up after 1 s, leaving a second of doubt to act in; `provider_extra` as in
/// `node_config`.
async fn doubting_node(test: &TestDb, m: &MockProvider, provider_extra: &str) -> Daemon {
    let config = node_config("provider-node", m, provider_extra);
    start_with(
        test,
        &config.replace("timeout_ms = 400", "timeout_ms = 1000"),
    )
    .await
}

/// A test clip at `path`: lavfi's `testsrc2` of `size` at `rate` frames a second for
/// `seconds`, H.264 at `crf`.
fn make_clip(path: &std::path::Path, size: (u32, u32), rate: u32, seconds: u32, crf: u8) {
    use spindle_transcode::{JobLimits, Rendition, Source};
    let (w, h) = size;
    spindle_transcode::transcode(
        &Source::Lavfi(format!(
            "testsrc2=size={w}x{h}:rate={rate}:duration={seconds}"
        )),
        path,
        &Rendition {
            name: "src".into(),
            height: h,
            crf,
            preset: "ultrafast".into(),
        },
        &JobLimits {
            threads: 2,
            ..JobLimits::default()
        },
        &mut |_| {},
    )
    .unwrap();
}

/// spindled with the mock at `m` and a media stage writing to `out`.
async fn media_node(test: &TestDb, m: &MockProvider, out: &std::path::Path, media: &str) -> Daemon {
    let config = format!(
        r#"
node_id = "media-node"
listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
shards = 2
partitions = 8
provider_concurrency = 4
lane_capacity_units = 100000

[provider]
url = "{}"
secret = "{SECRET}"
poll_ms = [100, 200]

[media]
workers = 1
output_dir = "{}"
{media}

[[tenants]]
id = 1
credential = "one"
"#,
        m.base_url(),
        out.display()
    );
    start_with(test, &config).await
}

async fn set_fault(admin: &HttpProvider, fault: Fault) {
    for a in ACCOUNTS {
        admin.set_fault(a, fault).await.unwrap();
    }
}

/// The rendition files each task's result names (`outputs`), as its client reads them.
async fn renditions_of(daemon: &Daemon, ids: &[TaskId]) -> Vec<Vec<std::path::PathBuf>> {
    results_of(daemon, ids, "outputs").await
}

/// `field` of each task's result, as its client reads it.
async fn results_of<T: serde::de::DeserializeOwned>(
    daemon: &Daemon,
    ids: &[TaskId],
    field: &str,
) -> Vec<T> {
    let client = Client::connect(daemon.addr, TenantId(1), "one")
        .await
        .unwrap();
    let mut all = Vec::new();
    for t in ids {
        let status = client.get(*t).await.unwrap();
        let result: serde_json::Value =
            serde_json::from_str(status.result.as_deref().expect("a result")).unwrap();
        all.push(serde_json::from_value(result[field].clone()).unwrap());
    }
    all
}

/// Submits `n` tasks and waits (bounded) until every one is in a final state; returns the
/// final states in order.
async fn run(daemon: &Daemon, test: &TestDb, prefix: &str, n: usize) -> (Vec<TaskId>, Vec<String>) {
    let ids = submit(daemon, prefix, n).await;
    let states = wait_final(test, &ids).await;
    (ids, states)
}

/// Submits `n` tasks as tenant 1, all of which must be accepted.
async fn submit(daemon: &Daemon, prefix: &str, n: usize) -> Vec<TaskId> {
    let client = Client::connect(daemon.addr, TenantId(1), "one")
        .await
        .unwrap();
    let batch: Vec<_> = (0..n).map(|i| task(&format!("{prefix}{i}"))).collect();
    client
        .submit_batch(batch)
        .await
        .unwrap()
        .into_iter()
        .map(|a| {
            assert!(a.decision.is_accepted(), "{a:?}");
            a.task
        })
        .collect()
}

/// One of the mock provider's per-account counters, summed over its accounts.
async fn mock_total(admin: &HttpProvider, counter: fn(&AccountStats) -> u64) -> u64 {
    let stats = admin.mock_stats().await.unwrap();
    stats.accounts.values().map(counter).sum()
}

/// The stored state of task `key`.
async fn state_of(sql: &tokio_postgres::Client, key: i64) -> String {
    sql.query_one("SELECT state FROM task WHERE task_id = $1", &[&key])
        .await
        .unwrap()
        .get(0)
}

/// Waits (bounded) until every one of `ids` is in a final state; returns the states in order.
async fn wait_final(test: &TestDb, ids: &[TaskId]) -> Vec<String> {
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    let sql = test.sql().await.unwrap();
    poll_until(
        Duration::from_secs(30),
        async || {
            sql.query_one(
                "SELECT count(*) FROM task WHERE task_id = ANY ($1)
                    AND state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED')",
                &[&keys],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        },
        |&open| open == 0,
    )
    .await;
    sql.query(
        "SELECT state FROM task WHERE task_id = ANY ($1) ORDER BY task_id",
        &[&keys],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get::<_, String>(0))
    .collect()
}

/// Nothing held, nothing reserved from the budget, no contract broken, no key sent twice.
async fn assert_clean(test: &TestDb, admin: &HttpProvider) -> AccountStats {
    let sql = test.sql().await.unwrap();
    let row = sql
        .query_one(
            "SELECT (SELECT count(*) FROM resource_reservation WHERE status = 'ACTIVE'),
                    (SELECT coalesce(sum(used), 0)::bigint FROM resource_pool_shard),
                    (SELECT coalesce(sum(reserved_milli), 0)::bigint FROM tenant_quota)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2)
        ),
        (0, 0, 0),
        "reservations, pool usage and budget reservations all given back"
    );
    let stats = admin.mock_stats().await.unwrap();
    let mut total = AccountStats::default();
    for (name, s) in &stats.accounts {
        assert_eq!(
            (s.concurrency_violations, s.rpm_violations, s.duplicate_keys),
            (0, 0, 0),
            "{name}: {s:?}"
        );
        total.accepted += s.accepted;
        total.completed += s.completed;
        total.rate_limited += s.rate_limited;
        total.max_in_flight = total.max_in_flight.max(s.max_in_flight);
    }
    total
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

/// What the mock received for `task`'s first attempt, from whichever account ran it, once it
/// did (within 10 s).
async fn submitted(admin: &HttpProvider, task: TaskId) -> spindle_providers::mock::Submitted {
    let key = format!("spindle-{}-1", task.0);
    let found = poll_until(
        Duration::from_secs(10),
        async || {
            for account in ACCOUNTS {
                if let Some(s) = admin.mock_submission(account, &key).await.unwrap() {
                    return Some(s);
                }
            }
            None
        },
        Option::is_some,
    )
    .await;
    found.unwrap_or_else(|| panic!("no account has a job for {key}"))
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
    let client = Client::connect(daemon.addr, TenantId(1), "one")
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
    let client = Client::connect(daemon.addr, TenantId(1), "one")
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
    let config = node_config("provider-node", m, "").replacen(
        "shards = 2",
        "shards = 2\ntask_inputs_mb = 1",
        1,
    );
    let daemon = start_with(test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "one")
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
    let client = Client::connect(daemon.addr, TenantId(1), "one")
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
        let client = Client::connect(daemon.addr, TenantId(1), "one")
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
    let client = Client::connect(first.addr, TenantId(1), "one")
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
    let config = node_config("stuck-node", &m, "polls_max = 5");
    let daemon = start_with(
        &test,
        &config.replace("poll_ms = [100, 200]", "poll_ms = [20]"),
    )
    .await;
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
    let daemon = node(&test, &m).await;
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
    assert!(
        count("ignored") >= 1,
        "duplicate callbacks ignored\n{metrics}"
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
                "POST /v1/provider/callback HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-signature: {signature}\r\ncontent-length: {}\r\n\r\n",
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
    // Signed, but for an attempt that already ended: nobody watches it.
    let stale = post(spindle_providers::signature::sign(SECRET.as_bytes(), &body)).await;
    assert!(stale.starts_with("HTTP/1.1 200"), "{stale}");
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
    let client = Client::connect(daemon.addr, TenantId(1), "one")
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
    let client = Client::connect(daemon.addr, TenantId(1), "one")
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

/// The media stage: the provider's video (a clip made here) is probed and transcoded to the
/// ladder on a media worker before the task succeeds; a video that is not one fails the task
/// with the reason; a video larger than the task declared is charged as what it is (`correct`)
/// or fails the task (`reject`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_media_stage_transcodes_checks_declarations_and_fails_what_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let make = |name: &str, w: u32, h: u32| {
        let path = dir.path().join(name);
        make_clip(&path, (w, h), 25, 1, 23);
        path
    };
    // The tasks declare 1280x720, 5 s.
    let small = make("small.mp4", 854, 480);
    let large = make("large.mp4", 1920, 1080);
    let garbage = dir.path().join("garbage.mp4");
    std::fs::write(&garbage, b"not a video").unwrap();
    let out = dir.path().join("out");

    enum Expect {
        Ladder,
        Failed(&'static str),
        ChargedMore,
    }
    for (case, (input, policy, expect)) in [
        (&small, "correct", Expect::Ladder),
        (
            &garbage,
            "correct",
            Expect::Failed("media: probe: unreadable input"),
        ),
        (
            &large,
            "reject",
            Expect::Failed("declared 1280x720 5000 ms, the video is 1920x1080"),
        ),
        (&large, "correct", Expect::ChargedMore),
    ]
    .into_iter()
    .enumerate()
    {
        let out = out.join(case.to_string());
        let test = TestDb::new().await;
        let (m, admin) = mock_with(20, Some(input.clone())).await;
        let media = format!("renditions = [240, 120]\ndeclaration = \"{policy}\"");
        let daemon = media_node(&test, &m, &out, &media).await;
        let (ids, states) = run(&daemon, &test, "media", 2).await;
        let sql = test.sql().await.unwrap();
        match expect {
            Expect::Ladder => {
                assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
                // The client learns where its renditions are from the task's result.
                for outputs in renditions_of(&daemon, &ids).await {
                    assert_eq!(outputs.len(), 2, "{outputs:?}");
                    for (file, (h, w)) in outputs.iter().zip([(240, 426), (120, 212)]) {
                        assert!(file.starts_with(&out), "{file:?}");
                        let (frames, fw, fh) = spindle_transcode::decode_all(file).unwrap();
                        assert_eq!((frames, fw, fh), (25, w, h), "{file:?}");
                    }
                }
                let (_, metrics) = http_get(daemon.http, "/metrics").await;
                assert!(
                    metrics.contains("spindle_media_inventory{source=\"declared\""),
                    "{metrics}"
                );
                assert!(
                    metrics.contains("spindle_media_engine_units{engine=\"cpu\",kind=\"used\"} 0"),
                    "{metrics}"
                );
            }
            Expect::Failed(why) => {
                assert!(states.iter().all(|s| s == "FAILED"), "{states:?}");
                let reasons: Vec<String> = sql
                    .query("SELECT failure_reason FROM dead_letter", &[])
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                assert_eq!(reasons.len(), 2);
                assert!(reasons.iter().all(|r| r.contains(why)), "{reasons:?}");
                // A video beyond its declaration is refused once probed: no rendition made.
                let (_, metrics) = http_get(daemon.http, "/metrics").await;
                assert_eq!(
                    metric_sum(&metrics, "spindle_media_renditions_total"),
                    0,
                    "{policy}"
                );
            }
            Expect::ChargedMore => {
                assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
                let rows = sql
                    .query(
                        "SELECT cost_estimate_milli, cost_actual_milli FROM task",
                        &[],
                    )
                    .await
                    .unwrap();
                for r in rows {
                    let (est, actual): (i64, Option<i64>) = (r.get(0), r.get(1));
                    assert!(
                        actual.unwrap_or(0) > est,
                        "1080p charged as declared 720p: {est} -> {actual:?}"
                    );
                }
            }
        }
        assert_clean(&test, &admin).await;
    }
    let left: Vec<_> = (0..4)
        .filter_map(|case| std::fs::read_dir(out.join(case.to_string())).ok())
        .flat_map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()))
        .collect();
    // Two successful cases × 2 tasks × 2 renditions; nothing of the failed ones.
    assert_eq!(left.len(), 8, "{left:?}");
}

/// A job placed on a GPU whose engines cannot be used runs on the CPU. Here (no driver, as on
/// CI) the inventory is declared: one device with NVDEC and NVENC, so every job is placed on
/// it, the transcoder cannot make its CUDA context, and the node gives the GPU's units back,
/// takes CPU units and makes the ladder there; `/metrics` counts the fallbacks. On a machine
/// with NVML the declaration is not used and the renditions are counted where they ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_placed_on_a_gpu_that_cannot_be_used_runs_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (640, 360), 25, 1, 23);
    let out = dir.path().join("out");
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let media = r#"renditions = [240]
[media.declared]
cpu_units = 4
temp_disk_mb = 4096
[[media.declared.devices]]
index = 0
name = "declared L4"
memory_mb = 24000
compute_units = 100
nvenc_sessions = 8
nvdec_sessions = 8
mig = false
"#;
    let daemon = media_node(&test, &m, &out, media).await;
    let (ids, states) = run(&daemon, &test, "gpu", 2).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    for outputs in renditions_of(&daemon, &ids).await {
        let (frames, w, h) = spindle_transcode::decode_all(&outputs[0]).unwrap();
        assert_eq!((frames, w, h), (25, 426, 240));
    }
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    let count = |line: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {line} in\n{metrics}"))
    };
    if metrics.contains("spindle_media_inventory{source=\"declared\"") {
        assert_eq!(count("spindle_media_gpu_fallbacks_total "), 2);
        assert_eq!(
            count("spindle_media_renditions_total{decode=\"cpu\",encode=\"cpu\"} "),
            2
        );
    } else {
        let made: u64 = ["cpu", "gpu"]
            .iter()
            .flat_map(|d| ["cpu", "gpu"].map(|e| (d, e)))
            .map(|(d, e)| {
                count(&format!(
                    "spindle_media_renditions_total{{decode=\"{d}\",encode=\"{e}\"}} "
                ))
            })
            .sum();
        assert_eq!(made, 2);
    }
    // Every unit is back, the GPU's and the CPU's.
    let used: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("spindle_media_engine_units{") && l.contains("kind=\"used\""))
        .collect();
    assert!(
        !used.is_empty() && used.iter().all(|l| l.ends_with(" 0")),
        "{used:?}"
    );
    assert_clean(&test, &admin).await;
}

/// kill -9 during the media step: the restarted node finds the job again at the provider
/// (not submitted again), takes its video and runs the media step once more, writing the whole
/// ladder under the attempt's own names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_during_the_media_step_runs_it_again_from_the_providers_video() {
    let dir = tempfile::tempdir().unwrap();
    // What the tasks declare: 1280x720, 5 s.
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (1280, 720), 25, 5, 30);
    let out = dir.path().join("out");
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let media = "renditions = [720, 480]\ndeclaration = \"correct\"";
    let mut daemon = media_node(&test, &m, &out, media).await;
    let ids = submit(&daemon, "media", 1).await;
    let sql = test.sql().await.unwrap();
    let key = ids[0].0 as i64;
    let state = poll_until(
        Duration::from_secs(15),
        async || state_of(&sql, key).await,
        |s| !["QUEUED", "DISPATCHING", "RUNNING"].contains(&s.as_str()),
    )
    .await;
    assert_eq!(
        state, "MEDIA_PROCESSING",
        "the media step was not caught running"
    );
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    drop(daemon);

    let daemon = media_node(&test, &m, &out, media).await;
    let states = wait_final(&test, &ids).await;
    assert_eq!(states, ["SUCCEEDED"], "{}", daemon.log_tail(30));
    let total = assert_clean(&test, &admin).await;
    assert_eq!(
        total.accepted, 1,
        "the job was found again, not submitted again"
    );
    let token: i64 = sql
        .query_one(
            "SELECT fencing_token FROM task_attempt WHERE task_id = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    for (h, w) in [(720, 1280), (480, 852)] {
        let file = out.join(format!("task-{key}-{token}-{h}p.mp4"));
        let (frames, fw, fh) = spindle_transcode::decode_all(&file).unwrap();
        assert_eq!((frames, fw, fh), (125, w, h), "{file:?}");
    }
}

/// A client's cancel stops the task's running media job: the task ends CANCELED, its partial
/// output is removed and its media units come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_stops_a_running_media_job() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("long.mp4");
    make_clip(&clip, (1920, 1080), 25, 20, 30);
    let out = dir.path().join("out");
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip.clone())).await;
    let daemon = media_node(
        &test,
        &m,
        &out,
        "renditions = [1080, 720]\ndeclaration = \"correct\"",
    )
    .await;
    let client = Client::connect(daemon.addr, TenantId(1), "one")
        .await
        .unwrap();
    let a = client.submit(task("long")).await.unwrap();
    common::wait_for(&client, a.task, spindle_core::TaskState::MediaProcessing).await;
    client.cancel(a.task).await.unwrap();
    // Stored CANCELED once the worker stopped and the shard settled the task.
    let sql = test.sql().await.unwrap();
    let key = a.task.0 as i64;
    let state = poll_until(
        Duration::from_secs(10),
        async || state_of(&sql, key).await,
        |s| s == "CANCELED",
    )
    .await;
    assert_eq!(state, "CANCELED");
    assert_clean(&test, &admin).await;
    // The worker notices between packets; give it its bounded moment to clean up.
    let left = poll_until(
        Duration::from_secs(10),
        async || -> Vec<std::ffi::OsString> {
            std::fs::read_dir(&out)
                .map(|d| d.map(|e| e.unwrap().file_name()).collect())
                .unwrap_or_default()
        },
        Vec::is_empty,
    )
    .await;
    assert!(left.is_empty(), "outputs of a canceled job: {left:?}");
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert!(
        metrics.contains("spindle_media_engine_units{engine=\"cpu\",kind=\"used\"} 0"),
        "{metrics}"
    );
    // Counted as canceled, not failed; nothing left running.
    for (series, want) in [
        ("spindle_media_jobs_ended_total{outcome=\"canceled\"}", 1),
        ("spindle_media_jobs_ended_total{outcome=\"failed\"}", 0),
        ("spindle_media_jobs{state=\"running\"}", 0),
    ] {
        assert_eq!(metric_sum(&metrics, series), want, "{series}");
    }
}

/// A subscriber follows a task through the media stage: it enters at 60 %, the ladder's 90 %
/// milestone arrives while it runs, and the end is 100 %.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_hear_the_media_stage_milestone() {
    use spindle_core::TaskState;
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (854, 480), 25, 2, 23);
    let test = TestDb::new().await;
    // 300 ms at the provider: time to subscribe before the media stage.
    let (m, admin) = mock_with(300, Some(clip)).await;
    // The output directory served under a URL: the result names the renditions by it too.
    let media = "renditions = [240, 120]\ndeclaration = \"correct\"\n\
                 output_url = \"https://cdn.example.com/renditions/\"";
    let daemon = media_node(&test, &m, &dir.path().join("out"), media).await;
    let client = Client::connect(daemon.addr, TenantId(1), "one")
        .await
        .unwrap();
    let a = client.submit(task("followed")).await.unwrap();
    client.subscribe(a.task).await.unwrap();
    let mut seen = Vec::new();
    let last = loop {
        let e = tokio::time::timeout(Duration::from_secs(30), client.next_event())
            .await
            .expect("an event within 30 s")
            .expect("the connection stays open");
        seen.push((e.state, e.progress_pct));
        if e.state.is_terminal() {
            break e;
        }
        assert_eq!(e.result, None, "only the end carries a result: {e:?}");
    };
    // The end carries what the task produced: its renditions, as GetTask gives them.
    let result = last.result.as_deref().expect("a result with SUCCEEDED");
    let result: serde_json::Value = serde_json::from_str(result).unwrap();
    let outputs: Vec<String> = serde_json::from_value(result["outputs"].clone()).unwrap();
    assert_eq!(outputs.len(), 2, "{result}");
    assert!(outputs[0].ends_with("-240p.mp4"), "{result}");
    let urls: Vec<String> = serde_json::from_value(result["urls"].clone()).unwrap();
    for (url, path) in urls.iter().zip(&outputs) {
        let name = std::path::Path::new(path).file_name().unwrap();
        assert_eq!(
            *url,
            format!(
                "https://cdn.example.com/renditions/{}",
                name.to_string_lossy()
            ),
            "{result}"
        );
    }
    assert_eq!(urls.len(), 2, "{result}");
    let at = |x: (TaskState, u8)| seen.iter().position(|&s| s == x);
    let entered = at((TaskState::MediaProcessing, 60)).expect("entered the media stage");
    let milestone = at((TaskState::MediaProcessing, 90)).expect("the media milestone");
    assert!(entered < milestone, "{seen:?}");
    assert_eq!(seen.last(), Some(&(TaskState::Succeeded, 100)), "{seen:?}");
    assert!(
        seen.windows(2).all(|w| w[0].1 <= w[1].1),
        "progress only grows: {seen:?}"
    );
    // Subscribers hear the end as the shard decides it; the store has it once reported.
    let sql = test.sql().await.unwrap();
    assert_eq!(
        common::wait_all_succeeded(&sql, &[a.task.0 as i64]).await,
        1
    );
    assert_clean(&test, &admin).await;
}

/// A provider that charges more than the matrix says (the mock reports 1,234 milli for a task
/// the matrix prices at 50): once the node has seen `cost_calibration_samples` of them, new
/// tasks are priced — and their budgets reserved — at what such tasks cost (the ratio held
/// within ×4), while the tasks admitted before keep their estimate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_follow_what_the_provider_really_charges() {
    let test = TestDb::new().await;
    let (m, _) = mock(10).await;
    let config = node_config("calibrating-node", &m, "").replacen(
        "shards = 2\n",
        "shards = 2\ncost_calibration_samples = 4\n",
        1,
    );
    let daemon = start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "one")
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
    let config = node_config(&format!("{prefix}-node"), &m, "")
        .replace("provider_concurrency = 4", "provider_concurrency = 64")
        .replace("provider_rpm = 6000", "provider_rpm = 600");
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
    let client = Client::connect(daemon.addr, TenantId(1), "one")
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

/// `[media.upload]` for `bucket` (path-style), objects under `renditions/`; no sweep of open
/// uploads at start (its listing would land among the requests the tests count).
fn upload_config(bucket: &spindle_providers::fake_s3::FakeS3) -> String {
    let b = bucket.bucket();
    format!(
        "\n[media.upload]\nurl = \"{}\"\nregion = \"{}\"\naccess_key_id = \"{}\"\n\
         secret_access_key = \"{}\"\nprefix = \"renditions/\"\nsweep_uploads = false\n",
        b.url, b.region, b.access_key_id, b.secret_access_key
    )
}

/// Multipart uploads a node that died mid-upload left open: a node with `[media.upload]`
/// aborts, at its start (and hourly), those under its prefix named as renditions are and older
/// than a job may run; a fresh one, another application's, and one outside the prefix stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_a_dead_node_left_open_are_aborted_and_the_rest_kept() {
    use spindle_providers::object_store::create_multipart_upload;
    let dir = tempfile::tempdir().unwrap();
    let bucket = spindle_providers::fake_s3::FakeS3::start("videos", "us-test-1", "AKID", "s")
        .await
        .unwrap();
    let tls = spindle_providers::tls::public_roots();
    let open = async |key: &str| {
        create_multipart_upload(
            &bucket.bucket(),
            key,
            "video/mp4",
            Duration::from_secs(10),
            &tls,
        )
        .await
        .unwrap()
    };
    for key in [
        "renditions/task-7-3-96p.mp4",
        "renditions/backup.tar",
        "elsewhere/task-8-1-96p.mp4",
    ] {
        open(key).await;
    }
    bucket.backdate_uploads(Duration::from_secs(2 * 3600));
    open("renditions/task-9-1-96p.mp4").await;
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, None).await;
    let media = format!("renditions = [96]\n{}", upload_config(&bucket))
        .replace("sweep_uploads = false", "sweep_uploads = true");
    let daemon = media_node(&test, &m, &dir.path().join("out"), &media).await;
    let aborted = poll_until(
        Duration::from_secs(30),
        async || {
            let (_, metrics) = http_get(daemon.http, "/metrics").await;
            metric_sum(&metrics, "spindle_media_uploads_aborted_total")
        },
        |&n| n >= 1,
    )
    .await;
    assert_eq!(aborted, 1);
    assert_eq!(
        bucket.open_upload_keys(),
        [
            "elsewhere/task-8-1-96p.mp4",
            "renditions/backup.tar",
            "renditions/task-9-1-96p.mp4"
        ]
    );
    assert!(
        bucket
            .log()
            .contains(&"DELETE upload renditions/task-7-3-96p.mp4".to_string()),
        "{:?}",
        bucket.log()
    );
    assert_clean(&test, &admin).await;
}

/// What an earlier attempt left in the bucket (a node that died after its upload, before its
/// report): the attempt that ends the task deletes its renditions — those named with the task
/// and an older fencing token — once its own are in, and nothing else: another task's whose id
/// begins the same, a key not named as a rendition, one with a newer token. A first attempt
/// does not look (the upload test counts every request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_after_the_first_deletes_what_earlier_attempts_left_in_the_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (160, 120), 10, 1, 30);
    let bucket = spindle_providers::fake_s3::FakeS3::start("videos", "us-test-1", "AKID", "s")
        .await
        .unwrap();
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    set_fault(&admin, Fault::Auth).await;
    let media = format!(
        "renditions = [96]\n{}{}",
        upload_config(&bucket),
        common::admin_tokens()
    );
    let daemon = media_node(&test, &m, &dir.path().join("out"), &media).await;
    let (ids, states) = run(&daemon, &test, "again", 1).await;
    assert_eq!(states, ["FAILED"]);
    let task = ids[0].0;
    let sql = test.sql().await.unwrap();
    let first: i64 = sql
        .query_one(
            "SELECT final_fencing FROM task WHERE task_id = $1",
            &[&(task as i64)],
        )
        .await
        .unwrap()
        .get(0);
    let tls = spindle_providers::tls::public_roots();
    let left = [
        format!("renditions/task-{task}-{first}-96p.mp4"),
        format!("renditions/task-{task}-{first}-720p.mp4"),
    ];
    let kept = [
        format!("renditions/task-{task}1-{first}-96p.mp4"),
        format!("renditions/task-{task}-{first}-notes.txt"),
        format!("renditions/task-{task}-999999999-96p.mp4"),
        format!("elsewhere/task-{task}-{first}-96p.mp4"),
    ];
    for key in left.iter().chain(&kept) {
        spindle_providers::object_store::put_object(
            &bucket.bucket(),
            key,
            b"an earlier attempt's".to_vec().into(),
            "video/mp4",
            Duration::from_secs(10),
            &tls,
        )
        .await
        .unwrap();
    }
    set_fault(&admin, Fault::None).await;
    let id = task.to_string();
    let requeue = ["requeue", id.as_str(), "--reason", "provider fixed"];
    let (ok, out) = common::ctl(daemon.http, common::OPERATOR_TOKEN, &requeue);
    assert!(ok, "{out}");
    assert_eq!(wait_final(&test, &ids).await, ["SUCCEEDED"]);
    let second: i64 = sql
        .query_one(
            "SELECT final_fencing FROM task WHERE task_id = $1 AND attempt_no = 2",
            &[&(task as i64)],
        )
        .await
        .unwrap()
        .get(0);
    assert!(second > first, "tokens grow: {first} then {second}");
    let mut want: Vec<String> = kept.to_vec();
    want.push(format!("renditions/task-{task}-{second}-96p.mp4"));
    want.sort();
    assert_eq!(bucket.keys(), want);
    assert_eq!(
        common::metric(
            &daemon,
            "spindle_media_objects_deleted_total{why=\"superseded\"}"
        )
        .await,
        2
    );
    let lists = bucket.log().iter().filter(|l| *l == "GET objects").count();
    assert_eq!(lists, 1, "one listing, by the second attempt");
    assert_clean(&test, &admin).await;
}

/// A task canceled while its renditions are being put into the bucket: the upload ends, but
/// the result is nobody's — the task ends CANCELED and the objects are deleted again, by the
/// node's bucket thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renditions_of_a_task_canceled_during_their_upload_are_deleted_again() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (160, 120), 10, 1, 30);
    let bucket = spindle_providers::fake_s3::FakeS3::start("videos", "us-test-1", "AKID", "s")
        .await
        .unwrap();
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let media = format!("renditions = [96]\n{}", upload_config(&bucket));
    let daemon = media_node(&test, &m, &dir.path().join("out"), &media).await;
    bucket.hold_puts(true);
    let client = Client::connect(daemon.addr, TenantId(1), "one")
        .await
        .unwrap();
    let a = client.submit(task("canceled")).await.unwrap();
    // The rendition is in the bucket; the answer to its PUT is held.
    let keys = poll_until(
        Duration::from_secs(30),
        async || bucket.keys(),
        |k| !k.is_empty(),
    )
    .await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].starts_with(&format!("renditions/task-{}-", a.task.0)));
    client.cancel(a.task).await.unwrap();
    bucket.hold_puts(false);
    let sql = test.sql().await.unwrap();
    let state = poll_until(
        Duration::from_secs(10),
        async || state_of(&sql, a.task.0 as i64).await,
        |s| s == "CANCELED",
    )
    .await;
    assert_eq!(state, "CANCELED");
    let series = "spindle_media_objects_deleted_total{why=\"unclaimed\"}";
    let deleted = poll_until(
        Duration::from_secs(10),
        async || common::metric(&daemon, series).await,
        |&n| n >= 1,
    )
    .await;
    assert_eq!(deleted, 1);
    assert_eq!(bucket.keys(), Vec::<String>::new(), "{:?}", bucket.log());
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    for (series, want) in [
        ("spindle_media_jobs_ended_total{outcome=\"canceled\"}", 1),
        ("spindle_media_jobs_ended_total{outcome=\"succeeded\"}", 0),
    ] {
        assert_eq!(metric_sum(&metrics, series), want, "{series}");
    }
    assert!(client.get(a.task).await.unwrap().result.is_none());
    assert_clean(&test, &admin).await;
}

/// `presign_s`: each task's result names its renditions by presigned URLs, which read the
/// private bucket's objects without keys (every frame decodes); the objects' plain URLs do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presigned_urls_read_a_private_buckets_renditions_without_keys() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (160, 120), 10, 1, 30);
    let bucket = spindle_providers::fake_s3::FakeS3::start("videos", "us-test-1", "AKID", "s")
        .await
        .unwrap();
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let media = format!(
        "renditions = [96]\n{}presign_s = 3600\n",
        upload_config(&bucket)
    );
    let daemon = media_node(&test, &m, &dir.path().join("out"), &media).await;
    let (ids, states) = run(&daemon, &test, "signed", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    let urls: Vec<Vec<String>> = results_of(&daemon, &ids, "urls").await;
    let url = &urls[0][0];
    assert!(
        url.contains("X-Amz-Expires=3600&") && url.contains("&X-Amz-Signature="),
        "{url}"
    );
    let tls = spindle_providers::tls::public_roots();
    let got = dir.path().join("got.mp4");
    spindle_providers::download(url, &got, 1 << 30, Duration::from_secs(10), &tls)
        .await
        .unwrap();
    let (frames, _, h) = spindle_transcode::decode_all(&got).unwrap();
    assert_eq!((frames, h), (10, 96));
    let plain = url.split('?').next().unwrap();
    let e = spindle_providers::download(plain, &got, 1 << 30, Duration::from_secs(10), &tls)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("403"), "{e}");
    assert_clean(&test, &admin).await;
}

/// `[media.upload]`: each rendition is put into the bucket (a stand-in that checks every
/// request's SigV4 signature and payload hash, as S3 does); the result names the objects by URL
/// and nothing stays in `output_dir`; a store that is briefly unavailable is tried again; one
/// that refuses fails the task with its answer, leaving no file behind — and no object: the
/// renditions already put are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renditions_are_uploaded_to_an_s3_bucket_and_named_by_url() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (320, 240), 25, 1, 23);
    let bucket = spindle_providers::fake_s3::FakeS3::start(
        "videos",
        "us-test-1",
        "AKIDSPINDLETEST",
        "bucket-secret-for-tests",
    )
    .await
    .unwrap();
    // Two 503s first: the first rendition's upload is tried three times.
    bucket.unavailable_for(2);
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip.clone())).await;
    let out = dir.path().join("out");
    let media = format!("renditions = [120, 96]\n{}", upload_config(&bucket));
    let daemon = media_node(&test, &m, &out, &media).await;
    let (ids, states) = run(&daemon, &test, "upload", 2).await;
    assert!(states.iter().all(|s| s == "SUCCEEDED"), "{states:?}");
    let client = Client::connect(daemon.addr, TenantId(1), "one")
        .await
        .unwrap();
    assert_eq!(bucket.keys().len(), 4, "two tasks × two renditions");
    for t in &ids {
        let status = client.get(*t).await.unwrap();
        let result: serde_json::Value =
            serde_json::from_str(status.result.as_deref().expect("a result")).unwrap();
        let urls: Vec<String> = serde_json::from_value(result["urls"].clone()).unwrap();
        assert_eq!(urls.len(), 2, "{result}");
        assert!(
            result.get("outputs").is_none(),
            "files named that are gone: {result}"
        );
        for (url, height) in urls.iter().zip([120, 96]) {
            let key = url
                .strip_prefix(&format!("{}/", bucket.url()))
                .unwrap_or_else(|| panic!("{url} is not the bucket's"));
            assert!(
                key.starts_with(&format!("renditions/task-{}-", t.0))
                    && key.ends_with(&format!("-{height}p.mp4")),
                "{key}"
            );
            // The object is the rendition: every frame decodes, at its height.
            let body = bucket
                .object(key)
                .unwrap_or_else(|| panic!("{key} not in the bucket"));
            let copy = dir.path().join("object.mp4");
            std::fs::write(&copy, body).unwrap();
            let (frames, _, h) = spindle_transcode::decode_all(&copy).unwrap();
            assert_eq!((frames, h), (25, height), "{key}");
        }
    }
    assert_eq!(bucket.bad_signatures(), 0, "a signature did not check out");
    let log = bucket.log();
    assert_eq!(log.len(), 6, "4 objects + 2 unavailable: {log:?}");
    // `/metrics` tells what the media stage did: two jobs through every stage (the mock
    // serves its video over HTTP), every byte in the bucket counted.
    let stored: u64 = bucket
        .keys()
        .iter()
        .map(|k| bucket.object(k).map_or(0, |o| o.len() as u64))
        .sum();
    for (series, want) in [
        ("spindle_media_jobs_ended_total{outcome=\"succeeded\"}", 2),
        ("spindle_media_jobs_ended_total{outcome=\"failed\"}", 0),
        ("spindle_media_jobs{state=\"queued\"}", 0),
        ("spindle_media_jobs{state=\"running\"}", 0),
        ("spindle_media_stage_seconds_count{stage=\"wait\"}", 2),
        ("spindle_media_stage_seconds_count{stage=\"fetch\"}", 2),
        ("spindle_media_stage_seconds_count{stage=\"transcode\"}", 2),
        ("spindle_media_stage_seconds_count{stage=\"upload\"}", 2),
        ("spindle_media_uploaded_bytes_total", stored),
    ] {
        assert_eq!(common::metric(&daemon, series).await, want, "{series}");
    }
    assert_eq!(log.iter().filter(|l| *l == "refused 503").count(), 2);
    let left = std::fs::read_dir(&out).unwrap().count();
    assert_eq!(left, 0, "files left in output_dir after their upload");
    assert_clean(&test, &admin).await;
    drop(daemon);

    // Read through a CDN: the result names the object by `public_url`, the key the same. (Each
    // part of this test has its own prefix: a fresh database numbers its tasks from 1 again.)
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip.clone())).await;
    let cdn = format!(
        "{}public_url = \"https://cdn.example.com/v/\"\n",
        media.replace("renditions/", "cdn/")
    );
    let daemon = media_node(&test, &m, &out, &cdn).await;
    let (ids, states) = run(&daemon, &test, "cdn", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    let status = Client::connect(daemon.addr, TenantId(1), "one")
        .await
        .unwrap()
        .get(ids[0])
        .await
        .unwrap();
    let result: serde_json::Value =
        serde_json::from_str(status.result.as_deref().unwrap()).unwrap();
    let urls: Vec<String> = serde_json::from_value(result["urls"].clone()).unwrap();
    let key = format!("cdn/task-{}-", ids[0].0);
    assert!(
        urls.iter()
            .all(|u| u.starts_with(&format!("https://cdn.example.com/v/{key}"))),
        "{urls:?}"
    );
    assert_eq!(bucket.keys().len(), 6, "two more objects in the bucket");
    assert_clean(&test, &admin).await;
    drop(daemon);

    // The second rendition refused: the task fails with the store's answer, and the first,
    // already put, is deleted again.
    bucket.refuse_keys_with(Some("-96p"));
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip.clone())).await;
    let half = media.replace("renditions/", "half/");
    let daemon = media_node(&test, &m, &out, &half).await;
    let (ids, states) = run(&daemon, &test, "half", 1).await;
    assert_eq!(states, ["FAILED"]);
    let reason = failure_reason(&test).await;
    assert!(
        reason.contains("media: upload: http://") && reason.contains("HTTP 403"),
        "{reason}"
    );
    let log = bucket.log();
    let tail: Vec<&str> = log[log.len() - 3..].iter().map(String::as_str).collect();
    let first = format!("half/task-{}-", ids[0].0);
    assert!(
        tail[0].starts_with(&format!("PUT object {first}"))
            && tail[0].ends_with("-120p.mp4")
            && tail[1].starts_with("refused 403 ")
            && tail[2].starts_with(&format!("DELETE object {first}"))
            && tail[2].ends_with("-120p.mp4"),
        "{tail:?}"
    );
    let keys = bucket.keys();
    assert!(
        keys.len() == 6 && !keys.iter().any(|k| k.starts_with("half/")),
        "an object of the failed attempt stayed: {keys:?}"
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "files left");
    assert_clean(&test, &admin).await;
    drop(daemon);

    // A bucket that refuses everything (wrong credentials, say): the task fails with its
    // answer.
    bucket.refuse_keys_with(None);
    bucket.refuse_with(403);
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let daemon = media_node(&test, &m, &out, &media).await;
    let (_, states) = run(&daemon, &test, "refused", 1).await;
    assert_eq!(states, ["FAILED"]);
    let reason = failure_reason(&test).await;
    assert!(
        reason.contains("media: upload: http://") && reason.contains("HTTP 403"),
        "{reason}"
    );
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "files left");
    assert_clean(&test, &admin).await;
}

/// Temporary keys named `id`: their secret and session token follow from it.
fn temporary_keys(id: &str) -> spindle_providers::object_store::Credentials {
    spindle_providers::object_store::Credentials {
        access_key_id: id.into(),
        secret_access_key: format!("secret-of-{id}"),
        session_token: Some(format!("token-of-{id}")),
    }
}

/// `media.upload.credentials_file`: the keys (temporary ones, with their session token) are read
/// again for every job, so a rotation by an agent that rewrites the file is used without a
/// restart; a key the store no longer takes fails the job with the store's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_credentials_are_read_again_for_every_job() {
    use spindle_providers::object_store::Credentials;
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (160, 120), 10, 1, 30);
    let file = dir.path().join("credentials");
    let write = |k: &Credentials| {
        let text = format!(
            "[default]\naws_access_key_id = unused\naws_secret_access_key = unused\n\n\
             [renditions]\naws_access_key_id = {}\naws_secret_access_key = {}\n\
             aws_session_token = {}\n",
            k.access_key_id,
            k.secret_access_key,
            k.session_token.as_deref().unwrap()
        );
        // Written aside and renamed into place, as an agent does.
        let aside = dir.path().join("credentials.new");
        std::fs::write(&aside, text).unwrap();
        std::fs::rename(&aside, &file).unwrap();
    };
    let bucket = spindle_providers::fake_s3::FakeS3::start("videos", "us-test-1", "x", "y")
        .await
        .unwrap();
    bucket.rotate_key(temporary_keys("ASIAFIRST"));
    write(&temporary_keys("ASIAFIRST"));
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let out = dir.path().join("out");
    let media = format!(
        "renditions = [96]\n\n[media.upload]\nurl = \"{}\"\nregion = \"us-test-1\"\n\
         credentials_file = {:?}\nprofile = \"renditions\"\nsweep_uploads = false\n",
        bucket.url(),
        file.display().to_string()
    );
    let daemon = media_node(&test, &m, &out, &media).await;
    let (_, states) = run(&daemon, &test, "first", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);

    // The agent rotates the key: the next job uses the new one.
    bucket.rotate_key(temporary_keys("ASIASECOND"));
    write(&temporary_keys("ASIASECOND"));
    let (_, states) = run(&daemon, &test, "second", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    assert_eq!(bucket.keys().len(), 2);
    assert_eq!(bucket.bad_signatures(), 0);

    // The store moves on and the file does not: the job fails with the store's answer.
    bucket.rotate_key(temporary_keys("ASIATHIRD"));
    let (_, states) = run(&daemon, &test, "third", 1).await;
    assert_eq!(states, ["FAILED"]);
    let reason = failure_reason(&test).await;
    assert!(
        reason.contains("HTTP 403") && reason.contains("SignatureDoesNotMatch"),
        "{reason}"
    );
    assert_clean(&test, &admin).await;
}

/// What every source of temporary keys owes the bucket, run through the node: keys with 2
/// minutes left (under the refresh margin) fetched for the first job; once the source issues
/// keys for hours, which the bucket then alone takes, fetched again for the next job and kept
/// for the two after. `source` is the `[media.upload]` lines naming where keys come from (it
/// starts out issuing `temporary_keys("ASIAFIRST")` for 2 minutes); `issue` has it issue others;
/// `fetched` counts its fetches.
async fn temporary_keys_are_renewed_near_expiry(
    source: &str,
    issue: impl Fn(spindle_providers::object_store::Credentials, Duration),
    fetched: impl Fn() -> u32,
) {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.mp4");
    make_clip(&clip, (160, 120), 10, 1, 30);
    let bucket = spindle_providers::fake_s3::FakeS3::start("videos", "us-test-1", "x", "y")
        .await
        .unwrap();
    bucket.rotate_key(temporary_keys("ASIAFIRST"));
    let test = TestDb::new().await;
    let (m, admin) = mock_with(20, Some(clip)).await;
    let media = format!(
        "renditions = [96]\n\n[media.upload]\nurl = \"{}\"\nregion = \"us-test-1\"\n\
         sweep_uploads = false\n{source}",
        bucket.url(),
    );
    let daemon = media_node(&test, &m, &dir.path().join("out"), &media).await;
    let (_, states) = run(&daemon, &test, "first", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    assert_eq!(fetched(), 1);
    issue(temporary_keys("ASIASECOND"), Duration::from_secs(6 * 3600));
    bucket.rotate_key(temporary_keys("ASIASECOND"));
    let (_, states) = run(&daemon, &test, "second", 1).await;
    assert_eq!(states, ["SUCCEEDED"]);
    assert_eq!(fetched(), 2, "keys near expiry fetched again");
    let (_, states) = run(&daemon, &test, "third", 2).await;
    assert_eq!(states, ["SUCCEEDED", "SUCCEEDED"]);
    assert_eq!(fetched(), 2, "keys with hours left kept");
    assert_eq!((bucket.keys().len(), bucket.bad_signatures()), (4, 0));
    assert_clean(&test, &admin).await;
}

/// A Kubernetes service account's keys (`role_arn`, `web_identity_token_file`): traded at STS
/// for the first job, again once they near expiry, kept while they have time left — each job
/// signing with the keys and session token STS issued, which the bucket requires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_accounts_web_identity_is_traded_for_keys_at_sts() {
    let dir = tempfile::tempdir().unwrap();
    let role = "arn:aws:iam::111122223333:role/renditions";
    let token = dir.path().join("token");
    std::fs::write(&token, "projected-jwt").unwrap();
    let sts = spindle_providers::fake_sts::FakeSts::start(
        role,
        "projected-jwt",
        temporary_keys("ASIAFIRST"),
        Duration::from_secs(120),
    )
    .await
    .unwrap();
    let source = format!(
        "role_arn = \"{role}\"\nweb_identity_token_file = {:?}\nsts_url = \"{}\"\n",
        token.display().to_string(),
        sts.url()
    );
    temporary_keys_are_renewed_near_expiry(&source, |k, d| sts.issue(k, d), || sts.trades()).await;
    assert_eq!(sts.refused(), 0);
}

/// An EC2 instance's role (`instance_profile`): its keys read from the instance metadata
/// service the IMDSv2 way for the first job, again once they near expiry, kept while they
/// have hours left — each job signing with the keys and session token the instance was given,
/// which the bucket requires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_profiles_keys_are_read_from_the_metadata_service() {
    let imds = spindle_providers::fake_imds::FakeImds::start(
        Some("gpu-node"),
        temporary_keys("ASIAFIRST"),
        Duration::from_secs(120),
    )
    .await
    .unwrap();
    let source = format!("instance_profile = true\nimds_url = \"{}\"\n", imds.url());
    temporary_keys_are_renewed_near_expiry(&source, |k, d| imds.issue(k, d), || imds.key_reads())
        .await;
    assert_eq!(imds.refused(), 0, "every read carried a session token");
}

/// The reason the one dead-lettered task failed.
async fn failure_reason(test: &TestDb) -> String {
    test.sql()
        .await
        .unwrap()
        .query_one("SELECT failure_reason FROM dead_letter", &[])
        .await
        .unwrap()
        .get(0)
}
