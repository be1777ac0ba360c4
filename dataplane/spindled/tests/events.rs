//! The event relay against a real PostgreSQL and a real HTTP endpoint: the outbox's events
//! reach the endpoint signed and each once while nothing crashes (in id order here: all of them
//! committed before the endpoint takes any; each task's in the order they happened); a refusing
//! endpoint holds them back without losing any; past `events.pending_max` new work is refused
//! as overloaded until the backlog drains.

mod common;

use std::time::Duration;

use common::{http_get, poll_until, start_with, task, Daemon, NodeConfig};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{Decision, TaskId, TenantId};
use spindle_providers::EventReceiver;

const SECRET: &str = "events-secret";

fn config(url: &str, pending_max: u64) -> String {
    node(url, pending_max).toml()
}

/// The node relaying to `url`, its backlog bound `pending_max`.
fn node(url: &str, pending_max: u64) -> NodeConfig {
    NodeConfig::new()
        .node_id("events-node")
        .tenants([1])
        .section(&format!(
            "[events]\nurl = \"{url}\"\nsecret = \"{SECRET}\"\ntimeout_ms = 500\nidle_ms = 20\n\
             pending_max = {pending_max}"
        ))
}

async fn receiver() -> EventReceiver {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    EventReceiver::serve(listener, SECRET.as_bytes())
}

async fn submit(daemon: &Daemon, prefix: &str, n: usize) -> Vec<spindle_wire::Admission> {
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let batch: Vec<_> = (0..n).map(|i| task(&format!("{prefix}{i}"))).collect();
    client.submit_batch(batch).await.unwrap()
}

/// Whether `daemon` accepts a new task again within 10 s (one fresh task per try).
async fn accepted_again(daemon: &Daemon) -> bool {
    let mut tries = 0;
    poll_until(
        Duration::from_secs(10),
        async || {
            tries += 1;
            let answers = submit(daemon, &format!("again{tries}-"), 1).await;
            answers[0].decision.is_accepted()
        },
        |&accepted| accepted,
    )
    .await
}

/// A counter or gauge of the node's /metrics.
async fn metric(daemon: &Daemon, name: &str) -> u64 {
    let (_, text) = http_get(daemon.http, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

/// Polls (bounded: 30 s) until `done` holds.
async fn eventually(what: &str, done: impl AsyncFnMut() -> bool) {
    let held = poll_until(Duration::from_secs(30), done, |&held| held).await;
    assert!(held, "never: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_the_endpoint_in_order_and_a_refusing_endpoint_loses_none() {
    let test = TestDb::new().await;
    let rx = receiver().await;
    rx.refuse(true);
    let daemon = start_with(&test, &config(&rx.url(), 1_000_000)).await;
    let ids: Vec<TaskId> = submit(&daemon, "e", 20)
        .await
        .into_iter()
        .map(|a| {
            assert!(a.decision.is_accepted(), "{a:?}");
            a.task
        })
        .collect();
    let sql = test.sql().await.unwrap();
    let keys: Vec<i64> = ids.iter().map(|t| t.0 as i64).collect();
    assert_eq!(common::wait_all_succeeded(&sql, &keys).await, 20);
    // The endpoint refuses: the relay keeps trying, nothing is taken, nothing is lost.
    eventually("the relay tried the refusing endpoint twice", async || {
        metric(&daemon, "spindle_events_refused_total").await >= 2
    })
    .await;
    assert!(rx.events().is_empty());
    let pending: i64 = sql
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE task_id = ANY ($1)",
            &[&keys],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        pending >= 40,
        "a claim and an end per task at least: {pending}"
    );

    rx.refuse(false);
    let finished = |events: &[spindle_providers::Received]| {
        events
            .iter()
            .filter(|e| e.kind == "SUCCEEDED" && e.task.is_some_and(|t| keys.contains(&(t as i64))))
            .count()
    };
    eventually("every task's SUCCEEDED event arrived", async || {
        finished(&rx.events()) == 20
    })
    .await;
    let events = rx.events();
    assert!(
        events.windows(2).all(|w| w[0].id < w[1].id),
        "in id order, none twice"
    );
    // What arrived is what the outbox holds, every one of it.
    let stored: Vec<i64> = sql
        .query(
            "SELECT event_id FROM outbox_event WHERE task_id = ANY ($1) ORDER BY event_id",
            &[&keys],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let got: Vec<i64> = events
        .iter()
        .filter(|e| e.task.is_some_and(|t| keys.contains(&(t as i64))))
        .map(|e| e.id as i64)
        .collect();
    assert_eq!(got, stored);
    for t in &keys {
        let kinds: Vec<&str> = events
            .iter()
            .filter(|e| e.task == Some(*t as u64))
            .map(|e| e.kind.as_str())
            .collect();
        assert_eq!(kinds.first(), Some(&"DISPATCHING"), "task {t}: {kinds:?}");
        assert_eq!(kinds.last(), Some(&"SUCCEEDED"), "task {t}: {kinds:?}");
    }
    let stats = rx.stats();
    assert_eq!(stats.bad_signatures, 0, "every post signed with the secret");
    assert_eq!(stats.not_after, 0, "each event's id above the one before");
    assert!(stats.refused >= 2, "{stats:?}");
    eventually("the outbox drained", async || {
        metric(&daemon, "spindle_events_pending").await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_backlog_bound_new_work_is_refused_until_the_relay_catches_up() {
    let test = TestDb::new().await;
    let rx = receiver().await;
    rx.refuse(true);
    let daemon = start_with(&test, &config(&rx.url(), 10)).await;
    for a in submit(&daemon, "b", 20).await {
        assert!(a.decision.is_accepted(), "{a:?}");
    }
    eventually("the backlog passed its bound", async || {
        metric(&daemon, "spindle_events_pending").await > 10
    })
    .await;
    let refused = submit(&daemon, "late", 1).await.remove(0);
    assert_eq!(refused.decision, Decision::RejectPlatformOverloaded);
    let reason = refused.reason.unwrap_or_default();
    assert!(reason.contains("event relay backlog"), "{reason}");

    rx.refuse(false);
    eventually("the backlog drained", async || {
        metric(&daemon, "spindle_events_pending").await <= 10
    })
    .await;
    assert!(
        accepted_again(&daemon).await,
        "new work still refused after the backlog drained"
    );
}

/// The relay's own connection says nothing about readiness while it works: before, connecting
/// marked PostgreSQL unavailable until the next submit or claim batch, so an idle node with a
/// relay answered 503 on /readyz for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_node_with_a_relay_is_ready() {
    let test = TestDb::new().await;
    let rx = receiver().await;
    let daemon = start_with(&test, &config(&rx.url(), 1_000_000)).await;
    eventually(
        "an idle node with a relay answers /readyz 200",
        async || http_get(daemon.http, "/readyz").await.0 == "HTTP/1.1 200 OK",
    )
    .await;
}

/// Two nodes on one PostgreSQL, configured differently (as during a rolling change): one
/// relays the events (a backlog bound of 10), the other has no `[events]` and windows of a
/// second. The second's retention keeps its ended tasks and their undelivered events while the
/// first's relay has them to send — before, it pruned both after its window and the relay lost
/// them — and prunes them once they are sent; past the relay's bound it refuses new work as
/// the relay does — before, it let the backlog grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_a_relay_keeps_what_another_nodes_relay_has_to_send() {
    let test = TestDb::new().await;
    let rx = receiver().await;
    rx.refuse(true);
    // Neither node takes the other's partition however slowly it starts (a busy machine), and
    // a renewal late by two seconds keeps the lease.
    let relay_config = node(&rx.url(), 10)
        .partitions(2)
        .owns(&[0])
        .set("lease_ms", 3000)
        .toml();
    let plain_config = NodeConfig::new()
        .node_id("plain-node")
        .partitions(2)
        .tenants([1])
        .owns(&[1])
        .set("lease_ms", 3000)
        .set("retention_finished_s", 1)
        .set("retention_events_s", 1)
        .toml();
    let mut nodes = common::start_together(&test, &[relay_config, plain_config]).await;
    let (plain, relay) = (nodes.pop().unwrap(), nodes.pop().unwrap());
    // Tenant 1 lives on partition 1: the plain node's.
    let ids: Vec<i64> = submit(&plain, "k", 20)
        .await
        .into_iter()
        .map(|a| {
            assert!(a.decision.is_accepted(), "{a:?}");
            a.task.0 as i64
        })
        .collect();
    let sql = test.sql().await.unwrap();
    assert_eq!(common::wait_all_succeeded(&sql, &ids).await, 20);
    let count = async |query: &str| -> i64 { sql.query_one(query, &[&ids]).await.unwrap().get(0) };
    let tasks = "SELECT count(*) FROM task WHERE task_id = ANY ($1)";
    let waiting = "SELECT count(*) FROM outbox_event
                    WHERE task_id = ANY ($1) AND delivered_at IS NULL";
    let events = count(waiting).await;
    assert!(events >= 20, "an end event per task at least: {events}");

    // Two of the plain node's retention rounds after both windows passed: nothing went.
    let ended: f64 = sql
        .query_one(
            "SELECT extract(epoch FROM max(updated_at))::float8 FROM task WHERE task_id = ANY ($1)",
            &[&ids],
        )
        .await
        .unwrap()
        .get(0);
    eventually("both windows passed", async || {
        sql.query_one(
            "SELECT now() > to_timestamp($1) + interval '1.5 s'",
            &[&ended],
        )
        .await
        .unwrap()
        .get::<_, bool>(0)
    })
    .await;
    let rounds = metric(&plain, "spindle_retention_rounds_total").await;
    eventually("two more retention rounds", async || {
        metric(&plain, "spindle_retention_rounds_total").await >= rounds + 2
    })
    .await;
    assert_eq!(metric(&plain, "spindle_relaying_nodes").await, 1);
    assert_eq!(count(tasks).await, 20, "{}", plain.log_tail(20));
    assert_eq!(count(waiting).await, events);
    assert_eq!(metric(&plain, "spindle_events_pruned_total").await, 0);
    // Counted at the plain node's lease renewals (a count that fails keeps the last one).
    eventually("the backlog counted", async || {
        metric(&plain, "spindle_events_pending").await >= 20
    })
    .await;
    let refused = submit(&plain, "late", 1).await.remove(0);
    assert_eq!(refused.decision, Decision::RejectPlatformOverloaded);
    let reason = refused.reason.unwrap_or_default();
    assert!(reason.contains("event relay backlog"), "{reason}");

    // Sent: then they go.
    rx.refuse(false);
    eventually("the relay sent them and the tasks left", async || {
        count(waiting).await == 0 && count(tasks).await == 0
    })
    .await;
    eventually("the sent events left too", async || {
        count("SELECT count(*) FROM outbox_event WHERE task_id = ANY ($1)").await == 0
    })
    .await;
    assert!(
        accepted_again(&plain).await,
        "new work still refused after the relay caught up"
    );
    drop(relay);
}

/// An endpoint served over HTTPS by a private CA's certificate, which the node is told of
/// (`events.ca_file`): every event reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_an_https_endpoint_trusted_through_ca_file() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (ca, server) = common::localhost_tls(dir.path());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rx = EventReceiver::serve_tls(listener, SECRET.as_bytes(), server);
    assert!(rx.url().starts_with("https://localhost:"), "{}", rx.url());
    let config = config(&rx.url(), 1_000_000).replace(
        "[events]\n",
        &format!("[events]\nca_file = \"{}\"\n", ca.display()),
    );
    let daemon = start_with(&test, &config).await;
    let tasks = submit(&daemon, "tls", 3).await;
    eventually("every task's SUCCEEDED relayed over HTTPS", async || {
        let ended: Vec<u64> = rx
            .events()
            .iter()
            .filter(|e| e.kind == "SUCCEEDED")
            .filter_map(|e| e.task)
            .collect();
        tasks.iter().all(|a| ended.contains(&a.task.0))
    })
    .await;
}
