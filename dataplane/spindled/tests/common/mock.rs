//! The provider and media tests' shared parts: the mock provider they run against, a node's
//! tasks submitted and waited for, and the checks every such test ends with.

use std::time::Duration;

use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{TaskId, TenantId};
use spindle_providers::api::{AccountStats, Fault};
use spindle_providers::{HttpProvider, MockConfig, MockProvider};

use super::{poll_until, task, Daemon};

pub const SECRET: &str = "mock-secret";

pub const ACCOUNTS: [&str; 2] = [
    "vendor-0:acct-1:us:video-model-0",
    "vendor-1:acct-1:us:video-model-0",
];

pub async fn mock(job_ms: u64) -> (MockProvider, HttpProvider) {
    mock_with(job_ms, None).await
}

/// A mock whose succeeded jobs return `clip`.
pub async fn mock_with(
    job_ms: u64,
    clip: Option<std::path::PathBuf>,
) -> (MockProvider, HttpProvider) {
    mock_of(job_ms, "4:6000", clip).await
}

/// A mock whose accounts' contracts are `limits` ("concurrency:rpm").
pub async fn mock_of(
    job_ms: u64,
    limits: &str,
    clip: Option<std::path::PathBuf>,
) -> (MockProvider, HttpProvider) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let m = MockProvider::serve(listener, mock_config(job_ms, limits, clip));
    let admin = m.client(Duration::from_secs(5));
    (m, admin)
}

pub fn mock_config(job_ms: u64, limits: &str, clip: Option<std::path::PathBuf>) -> MockConfig {
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

/// A test clip at `path`: lavfi's `testsrc2` of `size` at `rate` frames a second for
/// `seconds`, H.264 at `crf`.
pub fn make_clip(path: &std::path::Path, size: (u32, u32), rate: u32, seconds: u32, crf: u8) {
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

pub async fn set_fault(admin: &HttpProvider, fault: Fault) {
    for a in ACCOUNTS {
        admin.set_fault(a, fault).await.unwrap();
    }
}

/// `field` of each task's result, as its client reads it.
pub async fn results_of<T: serde::de::DeserializeOwned>(
    daemon: &Daemon,
    ids: &[TaskId],
    field: &str,
) -> Vec<T> {
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
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
pub async fn run(
    daemon: &Daemon,
    test: &TestDb,
    prefix: &str,
    n: usize,
) -> (Vec<TaskId>, Vec<String>) {
    let ids = submit(daemon, prefix, n).await;
    let states = wait_final(test, &ids).await;
    (ids, states)
}

/// Submits `n` tasks as tenant 1, all of which must be accepted.
pub async fn submit(daemon: &Daemon, prefix: &str, n: usize) -> Vec<TaskId> {
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
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
pub async fn mock_total(admin: &HttpProvider, counter: fn(&AccountStats) -> u64) -> u64 {
    let stats = admin.mock_stats().await.unwrap();
    stats.accounts.values().map(counter).sum()
}

/// The stored state of task `key`.
pub async fn state_of(sql: &tokio_postgres::Client, key: i64) -> String {
    sql.query_one("SELECT state FROM task WHERE task_id = $1", &[&key])
        .await
        .unwrap()
        .get(0)
}

/// How many of the tasks `keys` are not in a final state.
pub async fn unfinished(sql: &tokio_postgres::Client, keys: &[i64]) -> i64 {
    sql.query_one(
        "SELECT count(*) FROM task WHERE task_id = ANY ($1)
            AND state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED')",
        &[&keys],
    )
    .await
    .unwrap()
    .get(0)
}

/// What is held now: ACTIVE reservations, pool usage, budget reserved.
pub async fn held(sql: &tokio_postgres::Client) -> (i64, i64, i64) {
    let row = sql
        .query_one(
            "SELECT (SELECT count(*) FROM resource_reservation WHERE status = 'ACTIVE'),
                    (SELECT coalesce(sum(used), 0)::bigint FROM resource_pool_shard),
                    (SELECT coalesce(sum(reserved_milli), 0)::bigint FROM tenant_quota)",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// Waits (bounded) until every one of `ids` is in a final state; returns the states in order.
pub async fn wait_final(test: &TestDb, ids: &[TaskId]) -> Vec<String> {
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    let sql = test.sql().await.unwrap();
    poll_until(
        Duration::from_secs(30),
        async || unfinished(&sql, &keys).await,
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
pub async fn assert_clean(test: &TestDb, admin: &HttpProvider) -> AccountStats {
    let sql = test.sql().await.unwrap();
    assert_eq!(
        held(&sql).await,
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

/// The reason the one dead-lettered task failed.
pub async fn failure_reason(test: &TestDb) -> String {
    test.sql()
        .await
        .unwrap()
        .query_one("SELECT failure_reason FROM dead_letter", &[])
        .await
        .unwrap()
        .get(0)
}

/// What the mock received for `task`'s first attempt, from whichever account ran it, once it
/// did (within 10 s).
pub async fn submitted(admin: &HttpProvider, task: TaskId) -> spindle_providers::mock::Submitted {
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

/// The provider tests' node configuration, with `provider_extra` in its `[provider]` section.
pub fn node_config(id: &str, provider: &MockProvider, provider_extra: &str) -> String {
    node(id, provider, provider_extra).toml()
}

/// [`node_config`] as a builder, for tests that change more. A key in `provider_extra`
/// replaces the section's own (`timeout_ms = 400`, `poll_ms = [100, 200]`).
pub fn node(id: &str, provider: &MockProvider, provider_extra: &str) -> super::NodeConfig {
    let extra_keys: Vec<&str> = provider_extra
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k.trim()))
        .collect();
    let defaults: String = [("timeout_ms", "400"), ("poll_ms", "[100, 200]")]
        .iter()
        .filter(|(k, _)| !extra_keys.contains(k))
        .map(|(k, v)| format!("{k} = {v}\n"))
        .collect();
    super::NodeConfig::new()
        .node_id(id)
        .tenants([1])
        .set("lease_ms", 3000)
        .set("provider_concurrency", 4)
        .set("provider_rpm", 6000)
        .set("lane_capacity_units", 100_000)
        .set("retry_backoff_base_ms", 20)
        .set("retry_backoff_max_ms", 200)
        .section(&format!(
            "[provider]\nurl = \"{}\"\nsecret = \"{SECRET}\"\n{defaults}{provider_extra}",
            provider.base_url()
        ))
}
