//! Three spindled processes on one PostgreSQL against one mock provider: each serves its own
//! partitions, the provider accounts' concurrency (a pool row in PostgreSQL) and RPM (each node
//! runs its share) are global, and under load the mock sees no violation and no request key
//! twice, while every task completes.

mod common;

use std::time::Duration;

use common::{poll_until, task, wait_all_succeeded, Daemon, NodeConfig};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::TenantId;
use spindle_providers::{MockConfig, MockProvider};

const SECRET: &str = "cluster-secret";
const ACCOUNTS: [&str; 2] = [
    "vendor-0:acct-1:us:video-model-0",
    "vendor-1:acct-1:us:video-model-0",
];
const TENANTS: u32 = 6;

fn config(node: &str, owned: &str, provider: &str) -> String {
    NodeConfig::new()
        .node_id(node)
        .partitions(6)
        .tenants(1..=TENANTS)
        .set("owned_partitions", owned)
        .set("takeover_grace_ms", 600_000)
        // Long enough that a node starved of CPU on a busy 2-core CI machine keeps its
        // partitions: this test is about sharing the provider, takeover has tests of its own.
        .set("lease_ms", 6000)
        .set("provider_concurrency", 3)
        .set("provider_rpm", 600)
        .set("lane_capacity_units", 100_000)
        .set("retry_backoff_base_ms", 50)
        .set("retry_backoff_max_ms", 500)
        .section(&format!(
            "[provider]\nurl = \"{provider}\"\nsecret = \"{SECRET}\"\ntimeout_ms = 1000\n\
             poll_ms = [200, 400]"
        ))
        .toml()
}

/// The mock with both accounts, each of `concurrency` slots and `rpm` requests a minute.
async fn mock(concurrency: u32, rpm: u32, job_ms: u64) -> MockProvider {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    MockProvider::serve(
        listener,
        MockConfig {
            accounts: ACCOUNTS
                .iter()
                .map(|a| format!("{a}:{concurrency}:{rpm}").parse().unwrap())
                .collect(),
            secret: SECRET.into(),
            job_ms,
            cost_milli: 1_000,
            hang_ms: 2_000,
            clip: None,
        },
    )
}

/// The jobs the mock accepted over its accounts, none of which saw a concurrency or RPM
/// violation, a request key twice, or more than `concurrency` jobs at once.
fn accepted_without_violation(stats: &spindle_providers::api::Stats, concurrency: u64) -> u64 {
    let mut accepted = 0;
    for (name, s) in &stats.accounts {
        assert_eq!(
            (s.concurrency_violations, s.rpm_violations, s.duplicate_keys),
            (0, 0, 0),
            "{name}: {s:?}"
        );
        assert!(s.max_in_flight <= concurrency, "{name}: {s:?}");
        accepted += s.accepted;
    }
    accepted
}

async fn live_nodes(d: &Daemon) -> u64 {
    common::metric(d, "spindle_live_nodes").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_share_one_provider_without_a_violation() {
    let test = TestDb::new().await;
    let mock = mock(3, 600, 150).await;
    let url = mock.base_url();
    let nodes = common::start_together(
        &test,
        &[
            config("n1", "[0, 1]", &url),
            config("n2", "[2, 3]", &url),
            config("n3", "[4, 5]", &url),
        ],
    )
    .await;
    // Every node counts the others before load starts (their RPM shares depend on it).
    for n in &nodes {
        let seen = poll_until(
            Duration::from_secs(10),
            async || live_nodes(n).await,
            |&seen| seen == 3,
        )
        .await;
        assert_eq!(seen, 3, "a node never saw the other two");
    }
    // Tenant t lives on partition t % 6, so on node (t % 6) / 2.
    let mut ids = Vec::new();
    for t in 1..=TENANTS {
        let node = &nodes[((t % 6) / 2) as usize];
        let client = Client::connect(node.addr, TenantId(t), &format!("tenant-{t}-credential"))
            .await
            .unwrap();
        let batch: Vec<_> = (0..20).map(|i| task(&format!("c{t}-{i}"))).collect();
        for a in client.submit_batch(batch).await.unwrap() {
            assert!(a.decision.is_accepted(), "{a:?}");
            ids.push(a.task.0 as i64);
        }
    }
    let sql = test.sql().await.unwrap();
    // 120 tasks on 2 accounts at 570 requests a minute together: about 7 s.
    let done = wait_all_succeeded(&sql, &ids).await;
    let stats = mock
        .client(Duration::from_secs(5))
        .mock_stats()
        .await
        .unwrap();
    if done != ids.len() as i64 {
        let stuck: Vec<String> = sql
            .query(
                "SELECT task_id, state, version, attempt_no, attempt_node, partition
                   FROM task WHERE task_id = ANY ($1) AND state <> 'SUCCEEDED'",
                &[&ids],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| {
                format!(
                    "task {} {} v{} attempt {} on {:?} partition {}",
                    r.get::<_, i64>(0),
                    r.get::<_, &str>(1),
                    r.get::<_, i32>(2),
                    r.get::<_, i32>(3),
                    r.get::<_, Option<&str>>(4),
                    r.get::<_, i32>(5)
                )
            })
            .collect();
        let logs: Vec<String> = nodes.iter().map(|n| n.log_tail(40)).collect();
        panic!(
            "{done} of {} completed; not: {stuck:#?}\nmock: {stats:?}\nlogs:\n{}",
            ids.len(),
            logs.join("\n----\n")
        );
    }
    assert_eq!(
        accepted_without_violation(&stats, 3),
        ids.len() as u64,
        "each task accepted exactly once"
    );
    let held = common::active_reservations(&sql).await;
    assert_eq!(held, 0);
}

/// This node's part of shared limit `limit` (of a rate in millionths, of slots in slots).
async fn share_of(d: &Daemon, limit: &str) -> u64 {
    let (_, text) = common::http_get(d.http, "/metrics").await;
    let prefix = format!("spindle_cluster_share{{limit=\"{limit}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
        .unwrap_or_else(|| panic!("{limit}'s part not in /metrics"))
}

/// Waits (bounded: 20 s) until the parts of `limit` of nodes `a` and `b` are `want`.
async fn assert_parts(a: &Daemon, b: &Daemon, limit: &str, want: (u64, u64)) {
    let parts = poll_until(
        Duration::from_secs(20),
        async || (share_of(a, limit).await, share_of(b, limit).await),
        |&parts| parts == want,
    )
    .await;
    assert_eq!(parts, want, "{limit}");
}

/// How many of `ids` are in `state`.
async fn count_in(sql: &tokio_postgres::Client, ids: &[i64], state: &str) -> i64 {
    sql.query_one(
        "SELECT count(*) FROM task WHERE state = $1 AND task_id = ANY ($2)",
        &[&state, &ids],
    )
    .await
    .unwrap()
    .get(0)
}

/// Node `node` of a pair on the mock at `url`, serving partition `owned` of two (tenant `t`
/// lives on partition `t % 2`), with the accounts' `concurrency` and `rpm`.
fn pair_config(url: &str, node: &str, owned: u32, concurrency: u32, rpm: u32) -> String {
    NodeConfig::new()
        .node_id(node)
        .partitions(2)
        .owns(&[owned])
        .set("lease_ms", 1500)
        .set("provider_concurrency", concurrency)
        .set("provider_rpm", rpm)
        .set("lane_capacity_units", 100_000)
        .section(&format!(
            "[provider]\nurl = \"{url}\"\nsecret = \"{SECRET}\"\ntimeout_ms = 1000\n\
             poll_ms = [200, 400]"
        ))
        .toml()
}

/// The mock with accounts of `slots` slots (and RPM to spare) and jobs of `job_ms`, and two
/// nodes on it named `names`, the first serving partition 0, the second partition 1.
async fn pair(
    test: &TestDb,
    slots: u32,
    job_ms: u64,
    names: [&str; 2],
) -> (MockProvider, Daemon, Daemon) {
    let mock = mock(slots, 60_000, job_ms).await;
    let url = mock.base_url();
    let config = |i: usize| pair_config(&url, names[i], i as u32, slots, 60_000);
    let mut nodes = common::start_together(test, &[config(0), config(1)]).await;
    let second = nodes.pop().expect("two nodes");
    let first = nodes.pop().expect("two nodes");
    (mock, first, second)
}

/// Every one of `ids` succeeds, its job accepted by the mock once, with no violation and no
/// more than `slots` jobs of an account at once.
async fn assert_each_ran_once(
    sql: &tokio_postgres::Client,
    mock: &MockProvider,
    ids: &[i64],
    slots: u64,
) {
    assert_eq!(wait_all_succeeded(sql, ids).await, ids.len() as i64);
    let stats = mock
        .client(Duration::from_secs(5))
        .mock_stats()
        .await
        .unwrap();
    assert_eq!(
        accepted_without_violation(&stats, slots),
        ids.len() as u64,
        "each task accepted once"
    );
}

/// Submits tasks `r{tenant}-{from..from + n}` of `tenant` to `node`, all accepted: their ids.
async fn submit_range(node: &Daemon, tenant: u32, from: usize, n: usize) -> Vec<i64> {
    let client = Client::connect(
        node.addr,
        TenantId(tenant),
        &format!("tenant-{tenant}-credential"),
    )
    .await
    .unwrap();
    let batch: Vec<_> = (from..from + n)
        .map(|i| task(&format!("r{tenant}-{i}")))
        .collect();
    common::accepted_ids(client.submit_batch(batch).await)
}

/// Two nodes, work on one node only: that node's part of an account's RPM grows to all but
/// the idle node's standby part (before, each node ran half of it whatever waited where). Then
/// both nodes wait: the parts follow the weights, even halves. Every task completes once, with
/// no violation at the provider. (The accounts' 2 slots keep the work waiting; that parts hold
/// a binding RPM is the three-node test's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_node_takes_the_rate_an_idle_one_does_not_need() {
    let test = TestDb::new().await;
    let (mock, busy, idle) = pair(&test, 2, 200, ["busy", "idle"]).await;
    let submit = submit_range;
    // 4 slots of jobs of 200 ms: 120 tasks take over 6 s.
    let mut ids = submit(&busy, 2, 0, 120).await;
    let whole = spindle_control::cluster_shares::WHOLE;
    let standby = whole / 2 / 16;
    // (The idle node, started second, gets its standby part once the busy one's lowering has
    // passed its grace.)
    let rpm = "provider:0:rpm";
    assert_parts(&busy, &idle, rpm, (whole - standby, standby)).await;
    let sql = test.sql().await.unwrap();
    let done = count_in(&sql, &ids, "SUCCEEDED").await;
    assert!(
        done < 120,
        "the part came while the work still waited ({done} done)"
    );

    // Both wait, with equal weights: even halves (80 more each: over 8 s on the 4 slots).
    ids.extend(submit(&busy, 2, 120, 80).await);
    ids.extend(submit(&idle, 1, 0, 80).await);
    assert_parts(&busy, &idle, rpm, (whole / 2, whole / 2)).await;
    assert_each_ran_once(&sql, &mock, &ids, 2).await;
}

/// Two nodes, accounts of 4 slots each and jobs of 400 ms, work on one node first: it runs all
/// of every account's slots (the idle node's standby part of 4 rounds to none). Then the other
/// node's tenant waits too: each slot the first node's work frees goes to the second until they
/// hold half each — before, whichever node claimed first took a freed slot, so a node with a
/// deep backlog kept the account. No concurrency violation; every task completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freed_slot_goes_to_the_node_below_its_share() {
    let test = TestDb::new().await;
    let (mock, first, second) = pair(&test, 4, 400, ["first", "second"]).await;
    let slots = "provider:0:concurrency";
    // 60 tasks on 8 slots: about 3 s of work.
    let firsts = submit_range(&first, 2, 0, 60).await;
    assert_parts(&first, &second, slots, (4, 0)).await;
    let mut ids = submit_range(&second, 1, 0, 20).await;
    assert_parts(&first, &second, slots, (2, 2)).await;
    let sql = test.sql().await.unwrap();
    let left = count_in(&sql, &firsts, "QUEUED").await;
    ids.extend(firsts);
    assert!(
        left > 0,
        "the halves came while the first node's work still waited"
    );
    assert_each_ran_once(&sql, &mock, &ids, 4).await;
}
