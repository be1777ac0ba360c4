//! Periodic quotas on a node with real PostgreSQL: each scope refuses with
//! `REJECT_QUOTA_EXHAUSTED`, naming the quota and when it resets; and what was consumed on one
//! node is honoured by the node that takes its partition over (counted again from the rows).

mod common;

use std::time::Duration;

use common::{metric, poll_until, start_with, task, wait_for};
use spindle_client::{Client, ClientError};
use spindle_control::testing::TestDb;
use spindle_core::{Decision, TaskState, TenantId};
use spindle_wire::ErrorCode;

/// A node whose tenant 1 has `quotas` (TOML of `[[tenants.quotas]]` tables), with short leases
/// (a takeover is quick) and ended tasks kept long enough for a month's quota.
fn config(node: &str, quotas: &str) -> String {
    common::NodeConfig::new()
        .node_id(node)
        .set("lease_ms", 1500)
        .set("retention_finished_s", 3_000_000)
        .tenant_lines(1, quotas)
        .toml()
}

/// Tenant 1 may start three tasks a day, and each of its users one a minute: a user's second
/// in the minute is refused naming the user quota, the tenant's fourth of the day naming the
/// tenant's and midnight UTC; tenant 2, without quotas, is not counted. Without the quotas
/// (or with them not checked) every submit here is taken, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_quota_refuses_by_name_with_when_it_resets() {
    let test = TestDb::new().await;
    let daemon = start_with(
        &test,
        &config(
            "quota-node",
            "\n[[tenants.quotas]]\nscope = \"tenant\"\nperiod = \"day\"\ntasks = 3\n\
             \n[[tenants.quotas]]\nscope = \"user\"\nperiod = \"minute\"\ntasks = 1\n",
        ),
    )
    .await;
    let (one, two) = common::both_tenants(&daemon).await;
    let first = one.submit(common::task_of("a1", 1)).await.unwrap();
    assert_eq!(first.decision, Decision::Accepted, "{first:?}");
    let again = one.submit(common::task_of("a2", 1)).await.unwrap();
    assert_eq!(again.decision, Decision::RejectQuotaExhausted, "{again:?}");
    let reason = again.reason.unwrap();
    assert!(
        reason.starts_with("quota exhausted: user tasks per minute (1 used of 1"),
        "{reason}"
    );
    for user in [2, 3] {
        let a = one
            .submit(common::task_of(&format!("b{user}"), user))
            .await
            .unwrap();
        assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    }
    let fourth = one.submit(common::task_of("c4", 4)).await.unwrap();
    assert_eq!(
        fourth.decision,
        Decision::RejectQuotaExhausted,
        "{fourth:?}"
    );
    let reason = fourth.reason.unwrap();
    assert!(
        reason.starts_with("quota exhausted: tenant tasks per day (3 used of 3")
            && reason.ends_with("T00:00:00Z"),
        "{reason}"
    );
    for i in 0..5 {
        let a = two
            .submit(common::task_of(&format!("t2-{i}"), 1))
            .await
            .unwrap();
        assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    }
    // Refusals are counted by decision.
    let (_, metrics) = common::http_get(daemon.http, "/metrics").await;
    for line in [
        "spindle_admissions_total{decision=\"REJECT_QUOTA_EXHAUSTED\"} 2",
        "spindle_quota_refused_total{scope=\"user\",period=\"minute\"} 1",
        "spindle_quota_refused_total{scope=\"tenant\",period=\"day\"} 1",
    ] {
        assert!(metrics.contains(line), "{line}: {metrics}");
    }
}

/// A task that ends without its provider billing it gives its quota back: tenant 1 may submit
/// one task a day; canceled while it waits (tenant 2's long tasks hold both provider slots),
/// the next is taken. Without the refund the next is refused, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canceled_task_gives_its_quota_back() {
    let test = TestDb::new().await;
    let daemon = start_with(
        &test,
        &config(
            "refund-node",
            "\n[[tenants.quotas]]\nscope = \"tenant\"\nperiod = \"day\"\ntasks = 1\n",
        )
        .replace(
            "local_provider_time_scale = 0.0001\n",
            "local_provider_time_scale = 10.0\nprovider_concurrency = 1\n",
        ),
    )
    .await;
    let (one, two) = common::both_tenants(&daemon).await;
    for i in 0..2 {
        let blocker = two.submit(task(&format!("long{i}"))).await.unwrap();
        wait_for(&two, blocker.task, TaskState::Running).await;
    }
    let first = one.submit(task("w1")).await.unwrap();
    assert_eq!(first.decision, Decision::Accepted, "{first:?}");
    assert_eq!(one.get(first.task).await.unwrap().state, TaskState::Queued);
    let refused = one.submit(task("w2")).await.unwrap();
    assert_eq!(refused.decision, Decision::RejectQuotaExhausted);
    assert_eq!(one.cancel(first.task).await.unwrap(), TaskState::Canceled);
    let after = one.submit(task("w3")).await.unwrap();
    assert_eq!(after.decision, Decision::Accepted, "{after:?}");
    // The metrics count both charges and the one refund (the gauges follow the shard's ticks).
    let (charged, returned) = (
        "spindle_quota_charged_total{unit=\"tasks\"}",
        "spindle_quota_returned_total{unit=\"tasks\"}",
    );
    let moved = poll_until(
        std::time::Duration::from_secs(5),
        async || {
            (
                metric(&daemon, charged).await,
                metric(&daemon, returned).await,
            )
        },
        |&m| m == (2, 1),
    )
    .await;
    assert_eq!(moved, (2, 1), "charged and returned tasks");
}

/// Tenant 1 may run three tasks a day. Two run to their end on node A; A is killed and node B
/// takes its partitions over: B takes one more of tenant 1's and refuses the next, naming the
/// day's quota — it counted what A's tasks consumed from their rows. Without that count B
/// takes three more, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_consumed_on_one_node_is_honoured_by_the_node_that_takes_over() {
    let test = TestDb::new().await;
    let quotas = "\n[[tenants.quotas]]\nscope = \"tenant\"\nperiod = \"day\"\ntasks = 3\n";
    let mut a = start_with(&test, &config("node-a", quotas)).await;
    let b = start_with(&test, &config("node-b", quotas)).await;
    let on_a = Client::connect(a.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    for i in 0..2 {
        let t = on_a.submit(task(&format!("on-a-{i}"))).await.unwrap();
        assert_eq!(t.decision, Decision::Accepted, "{t:?}");
        wait_for(&on_a, t.task, TaskState::Succeeded).await;
    }
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let on_b = poll_until(
        Duration::from_secs(20),
        async || Client::connect(b.addr, TenantId(1), "tenant-1-credential").await,
        |r| !matches!(r, Err(ClientError::Refused(e)) if e.code == ErrorCode::WrongNode),
    )
    .await
    .unwrap_or_else(|e| panic!("node B never served tenant 1: {e}"));
    // Taken once B holds the partition (its submits are refused as not leased until then).
    let mut n = 0;
    let third = poll_until(
        Duration::from_secs(20),
        async || {
            n += 1;
            on_b.submit(task(&format!("on-b-{n}"))).await.unwrap()
        },
        |a| a.decision != Decision::RejectPlatformOverloaded,
    )
    .await;
    assert_eq!(
        third.decision,
        Decision::Accepted,
        "{third:?}: {}",
        b.log_tail(20)
    );
    let fourth = on_b.submit(task("on-b-last")).await.unwrap();
    assert_eq!(
        fourth.decision,
        Decision::RejectQuotaExhausted,
        "{fourth:?}"
    );
    assert!(fourth
        .reason
        .unwrap()
        .starts_with("quota exhausted: tenant tasks per day (3 used of 3"),);
}

/// An operator reads a tenant's consumption (`spindlectl quota show`), resets it (`quota reset`,
/// audited), and the reset holds across a restart: the node counts again from the rows only
/// what came after it. `quota set` replaces the tenant's quotas live. Without the stored floor
/// the restarted node counts the day's three tasks and refuses at once, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_sees_resets_and_sets_a_tenants_quotas() {
    use common::{ctl, OPERATOR_TOKEN, VIEWER_TOKEN};
    let test = TestDb::new().await;
    let text = format!(
        "{}{}",
        config(
            "ops-node",
            "\n[[tenants.quotas]]\nscope = \"tenant\"\nperiod = \"day\"\ntasks = 2\n",
        ),
        common::admin_tokens()
    )
    // Ended tasks kept a week: enough for its day quotas, not for a month's.
    .replace(
        "retention_finished_s = 3000000",
        "retention_finished_s = 604800",
    );
    let mut daemon = start_with(&test, &text).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    for i in 0..2 {
        let a = client.submit(task(&format!("d{i}"))).await.unwrap();
        assert_eq!(a.decision, Decision::Accepted, "{a:?}");
        wait_for(&client, a.task, TaskState::Succeeded).await;
    }
    let refused = client.submit(task("d2")).await.unwrap();
    assert_eq!(refused.decision, Decision::RejectQuotaExhausted);
    let (ok, out) = ctl(daemon.http, VIEWER_TOKEN, &["quota", "show", "1"]);
    assert!(ok, "{out}");
    let shown: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown["quotas"][0]["used_tasks"], 2, "{shown}");
    assert_eq!(shown["quotas"][0]["tasks"], 2, "{shown}");
    assert!(
        shown["quotas"][0]["resets_at"]
            .as_str()
            .unwrap()
            .ends_with("T00:00:00Z"),
        "{shown}"
    );
    let (ok, out) = ctl(
        daemon.http,
        VIEWER_TOKEN,
        &["quota", "reset", "1", "--reason", "x"],
    );
    assert!(!ok, "a viewer may not reset: {out}");
    // Refused by name: a tenant the node does not have, a reset without a reason.
    let (ok, out) = ctl(
        daemon.http,
        VIEWER_TOKEN,
        &["--json", "quota", "show", "99"],
    );
    assert!(
        !ok && out.contains(r#"\"99\" is not a tenant of this node's configuration"#),
        "{out}"
    );
    let (ok, out) = ctl(
        daemon.http,
        OPERATOR_TOKEN,
        &["--json", "quota", "reset", "1", "--reason", " "],
    );
    assert!(!ok && out.contains("a reset needs a reason"), "{out}");
    let (ok, out) = ctl(
        daemon.http,
        OPERATOR_TOKEN,
        &[
            "quota",
            "reset",
            "1",
            "--reason",
            "ticket 42: double-billed",
        ],
    );
    assert!(ok, "{out}");
    let after = client.submit(task("d3")).await.unwrap();
    assert_eq!(after.decision, Decision::Accepted, "{after:?}");
    wait_for(&client, after.task, TaskState::Succeeded).await;
    let (ok, out) = ctl(daemon.http, VIEWER_TOKEN, &["audit"]);
    assert!(ok && out.contains("ticket 42: double-billed"), "{out}");

    // A restart counts from the rows: the three tasks of the day, less the two before the reset.
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    drop(daemon);
    let daemon = start_with(&test, &text).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let second = client.submit(task("d4")).await.unwrap();
    assert_eq!(
        second.decision,
        Decision::Accepted,
        "{second:?}: {}",
        daemon.log_tail(10)
    );
    let over = client.submit(task("d5")).await.unwrap();
    assert_eq!(over.decision, Decision::RejectQuotaExhausted, "{over:?}");

    // Raised through the policy store: taken at once — but not a month's quota, which the
    // week of ended tasks kept could not count again after a restart.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("quotas.json");
    let set = |quotas: &str| {
        std::fs::write(&file, quotas).unwrap();
        let args = [
            "--json",
            "quota",
            "set",
            "1",
            "--body",
            file.to_str().unwrap(),
        ];
        let reason = ["--reason", "upgraded plan"];
        ctl(
            daemon.http,
            OPERATOR_TOKEN,
            &[&args[..], &reason[..]].concat(),
        )
    };
    let (ok, out) = set(r#"[{"scope": "tenant", "period": "month", "tasks": 100}]"#);
    assert!(
        !ok && out.contains("retention_finished_s (604800)") && out.contains("2764800"),
        "{out}"
    );
    let (ok, out) = set(r#"[{"scope": "tenant", "period": "day", "tasks": 10}]"#);
    assert!(ok, "{out}");
    let mut n = 0;
    let raised = poll_until(
        Duration::from_secs(10),
        async || {
            n += 1;
            client.submit(task(&format!("d-raised-{n}"))).await.unwrap()
        },
        |a| a.decision == Decision::Accepted,
    )
    .await;
    assert_eq!(raised.decision, Decision::Accepted, "{raised:?}");
}
