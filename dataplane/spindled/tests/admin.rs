//! The admin API and spindlectl against a running node: roles, reasons, the policy store's
//! versions and audit rows, a holder's refused changes audited as refused (calls without a
//! valid token or past their role counted, not audited), drain.

mod common;

use common::{
    admin_tokens, ctl, http_get, metric, poll_until, start_with, Daemon, NodeConfig, ADMIN_TOKEN,
    OPERATOR_TOKEN, VIEWER_TOKEN,
};
use spindle_control::testing::TestDb;

/// The node with the admin API's three roles.
fn config() -> String {
    NodeConfig::new()
        .node_id("admin-node")
        .time_scale(0.001)
        .tenants([1])
        .section(&admin_tokens())
        .toml()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_reasons_versions_and_refusals_are_all_audited() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, &config()).await;
    let http = daemon.http;
    let dir = tempfile::tempdir().unwrap();
    let tenant = dir.path().join("tenant.json");
    let body = serde_json::to_string(&spindle_core::presets::tenant(
        spindle_core::Lane::Standard,
        3,
    ))
    .unwrap();
    std::fs::write(&tenant, body).unwrap();
    let tenant = tenant.to_str().unwrap();

    // The operator changes a tenant, with a reason: a new version and an audit row.
    let (ok, out) = ctl(
        http,
        OPERATOR_TOKEN,
        &[
            "--json",
            "policy",
            "set",
            "tenant_policy",
            "7",
            "--body",
            tenant,
            "--reason",
            "onboarding",
        ],
    );
    assert!(ok, "{out}");
    let version = serde_json::from_str::<serde_json::Value>(&out).unwrap()["version"]
        .as_u64()
        .unwrap();
    // A viewer reads it back.
    let (ok, out) = ctl(http, VIEWER_TOKEN, &["--json", "policy", "show"]);
    assert!(ok, "{out}");
    let policy: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(policy["version"].as_u64(), Some(version));
    assert!(policy["objects"]
        .as_array()
        .unwrap()
        .iter()
        .any(|o| o["object"] == "tenant_policy" && o["key"] == "7" && o["body"]["weight"] == 3));

    // Refused: a viewer changing, an operator touching a provider account, no token at all.
    let (ok, _) = ctl(
        http,
        VIEWER_TOKEN,
        &[
            "policy",
            "set",
            "tenant_policy",
            "8",
            "--body",
            tenant,
            "--reason",
            "sneaky",
        ],
    );
    assert!(!ok, "a viewer changed policy");
    let (ok, _) = ctl(
        http,
        OPERATOR_TOKEN,
        &[
            "policy",
            "delete",
            "provider_account",
            "vendor-0",
            "--reason",
            "cleanup",
        ],
    );
    assert!(!ok, "an operator changed a provider account");
    let (ok, _) = ctl(http, "not-a-token-at-all-xx", &["policy", "show"]);
    assert!(!ok, "no token, yet served");
    // A change without a reason is refused too.
    let (ok, _) = ctl(
        http,
        ADMIN_TOKEN,
        &[
            "policy",
            "set",
            "tenant_policy",
            "9",
            "--body",
            tenant,
            "--reason",
            " ",
        ],
    );
    assert!(!ok, "a change without a reason went through");

    let (ok, out) = ctl(http, ADMIN_TOKEN, &["--json", "audit", "--limit", "10"]);
    assert!(ok, "{out}");
    let audit: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let has = |actor: &str, object: &str, needle: &str| {
        audit.iter().any(|e| {
            e["actor"] == actor
                && e["object"] == object
                && (e["reason"].as_str().unwrap_or("").contains(needle)
                    || e["key"].as_str().unwrap_or("").contains(needle))
        })
    };
    assert!(has("otto", "tenant_policy", "onboarding"), "{audit:#?}");
    // Calls turned away before anything was done — no valid token, or past the token's
    // role — are counted and sampled into the log, not written one audit row each (anyone can
    // send them); a holder's refused change is audited.
    assert!(
        !has("vera", "refused", "PUT /admin/v1/policy/tenant_policy/8"),
        "{audit:#?}"
    );
    assert!(!has("otto", "refused", "provider_account"), "{audit:#?}");
    assert!(
        !has("anonymous", "refused", "no valid admin token"),
        "{audit:#?}"
    );
    assert!(
        has("ada", "refused", "a change needs a reason"),
        "{audit:#?}"
    );
    let (_, metrics) = common::http_get(http, "/metrics").await;
    assert!(
        metrics.contains("spindle_admin_refused_total{why=\"anonymous\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("spindle_admin_refused_total{why=\"role\"} 2"),
        "{metrics}"
    );
    // The policy version moved only for the accepted change.
    let (_, out) = ctl(http, VIEWER_TOKEN, &["--json", "policy", "show"]);
    let after: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(after["version"].as_u64(), Some(version));

    // An admin drains the node: not ready any more, and the drain is in the audit log.
    let (ok, out) = ctl(http, ADMIN_TOKEN, &["drain", "--reason", "kernel upgrade"]);
    assert!(ok, "{out}");
    let (status, _) = http_get(http, "/readyz").await;
    assert!(status.contains("503"), "{status}");
    let (_, out) = ctl(http, VIEWER_TOKEN, &["--json", "audit"]);
    assert!(out.contains("drain: kernel upgrade"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_reaches_the_running_node_within_two_seconds() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, &config()).await;
    let client = spindle_client::Client::connect(
        daemon.addr,
        spindle_core::TenantId(1),
        "tenant-1-credential",
    )
    .await
    .unwrap();
    let a = client.submit(common::task("before")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");

    // Tenant 1 may now submit once a second.
    let mut slow = spindle_core::presets::tenant(spindle_core::Lane::Standard, 1);
    slow.submit_rate = spindle_core::policy::RateSpec {
        per_minute: 60,
        burst: 1,
    };
    let dir = tempfile::tempdir().unwrap();
    let body = dir.path().join("slow.json");
    std::fs::write(&body, serde_json::to_string(&slow).unwrap()).unwrap();
    let started = std::time::Instant::now();
    let (ok, out) = ctl(
        daemon.http,
        OPERATOR_TOKEN,
        &[
            "--json",
            "policy",
            "set",
            "tenant_policy",
            "1",
            "--body",
            body.to_str().unwrap(),
            "--reason",
            "abuse",
        ],
    );
    assert!(ok, "{out}");
    let version = serde_json::from_str::<serde_json::Value>(&out).unwrap()["version"]
        .as_u64()
        .unwrap();
    let applied = format!("spindle_policy_version {version}");
    let metrics = poll_until(
        std::time::Duration::from_secs(2).saturating_sub(started.elapsed()),
        async || http_get(daemon.http, "/metrics").await.1,
        |metrics| metrics.contains(&applied),
    )
    .await;
    assert!(
        metrics.contains(&applied),
        "version {version} not applied within 2 s"
    );
    let mut accepted = 0;
    for i in 0..5 {
        let a = client
            .submit(common::task(&format!("after{i}")))
            .await
            .unwrap();
        accepted += u32::from(a.decision.is_accepted());
    }
    assert!(accepted <= 2, "{accepted} of 5 accepted at one a second");
}

/// Makes one pool shard's counter drift: `by` units more than anything holds.
/// Every pool's usage added up.
async fn pool_used(sql: &tokio_postgres::Client) -> i64 {
    common::read_i64(
        sql,
        "SELECT coalesce(sum(used), 0)::bigint FROM resource_pool_shard",
    )
    .await
}

async fn drift_one_pool(sql: &tokio_postgres::Client, by: i64) {
    let changed = sql
        .execute(
            "UPDATE resource_pool_shard SET used = used + $1
              WHERE (pool_key, shard) = (SELECT pool_key, shard FROM resource_pool_shard
                                          ORDER BY pool_key, shard LIMIT 1)",
            &[&by],
        )
        .await
        .unwrap();
    assert_eq!(changed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_rebuilds_drifted_pool_counters_from_what_live_attempts_hold() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, &config()).await;
    let sql = test.sql().await.unwrap();
    // A pool counter that drifted (nothing holds it): three units too many.
    drift_one_pool(&sql, 3).await;
    let args = [
        "--json",
        "rebuild-counters",
        "--reason",
        "usage looked wrong",
    ];
    let (ok, _) = ctl(daemon.http, OPERATOR_TOKEN, &args);
    assert!(!ok, "an operator rebuilt the counters");
    let (ok, out) = ctl(daemon.http, ADMIN_TOKEN, &args);
    assert!(ok, "{out}");
    let answer: serde_json::Value = serde_json::from_str(&out).unwrap();
    let repaired = answer["repaired"].as_array().unwrap();
    assert_eq!(repaired.len(), 1, "{answer}");
    assert_eq!(
        (
            repaired[0]["stored"].as_i64(),
            repaired[0]["derived"].as_i64()
        ),
        (Some(3), Some(0))
    );
    let used = pool_used(&sql).await;
    assert_eq!(used, 0, "repaired");
    // Nothing drifted any more; the rebuild is audited with its reason.
    let (ok, out) = ctl(daemon.http, ADMIN_TOKEN, &args[1..]);
    assert!(ok, "{out}");
    assert!(out.contains("no drift"), "{out}");
    let audited: i64 = sql
        .query_one(
            "SELECT count(*) FROM audit_log WHERE actor = 'ada' AND object_kind = 'counters'
                AND reason LIKE 'rebuild: usage looked wrong%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(audited, 2);
}

/// Polls the node's metrics (bounded: 30 s) until `done` holds for the counter checks done and
/// the drifted shards the last one found.
async fn until_checked(daemon: &Daemon, done: impl Fn(u64, u64) -> bool) -> (u64, u64) {
    let (checks, drifted) = poll_until(
        std::time::Duration::from_secs(30),
        async || {
            let checks = metric(daemon, "spindle_reservation_checks_total").await;
            (
                checks,
                metric(daemon, "spindle_reservation_drift_shards").await,
            )
        },
        |&(checks, drifted)| done(checks, drifted),
    )
    .await;
    assert!(
        done(checks, drifted),
        "the counter check did not get there in 30 s: {checks} checks, {drifted} drifted"
    );
    (checks, drifted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_periodic_counter_check_finds_drift_without_repairing_it() {
    let test = TestDb::new().await;
    let config = format!(
        "counter_check_s = 1\ncounter_repair = false\nlease_ms = 1500\n{}",
        config()
    );
    let daemon = start_with(&test, &config).await;
    let (checks, _) = until_checked(&daemon, |checks, drifted| checks >= 1 && drifted == 0).await;
    let sql = test.sql().await.unwrap();
    let used = async || pool_used(&sql).await;
    drift_one_pool(&sql, 2).await;
    // A later check sees the one drifted shard, and leaves it as it found it.
    let (seen_at, _) = until_checked(&daemon, |c, drifted| c > checks && drifted == 1).await;
    assert_eq!(used().await, 2, "the check repaired nothing");
    // A viewer asks for the same check on demand: it names the shard and repairs nothing.
    let (ok, out) = ctl(daemon.http, VIEWER_TOKEN, &["--json", "check-counters"]);
    assert!(ok, "{out}");
    let answer: serde_json::Value = serde_json::from_str(&out).unwrap();
    let drifted = answer["drifted"].as_array().unwrap();
    assert_eq!(drifted.len(), 1, "{answer}");
    assert_eq!(
        (
            drifted[0]["stored"].as_i64(),
            drifted[0]["derived"].as_i64()
        ),
        (Some(2), Some(0))
    );
    assert_eq!(answer["budgets_drifted"].as_array().map(Vec::len), Some(0));
    let (ok, out) = ctl(daemon.http, VIEWER_TOKEN, &["check-counters"]);
    assert!(ok && out.contains("stored 2 → derived 0"), "{out}");
    assert_eq!(used().await, 2, "checking on demand repaired nothing");
    let args = [
        "--json",
        "rebuild-counters",
        "--reason",
        "the check said so",
    ];
    let (ok, out) = ctl(daemon.http, ADMIN_TOKEN, &args);
    assert!(ok, "{out}");
    assert_eq!(used().await, 0);
    // The first check after the repair finds nothing.
    until_checked(&daemon, |c, drifted| c > seen_at + 1 && drifted == 0).await;
}

/// By default a check that finds drift repairs it at once: the counter comes back to what
/// live attempts hold, the repair is counted and audited as the node's, and the next check
/// finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_periodic_counter_check_repairs_the_drift_it_finds() {
    let test = TestDb::new().await;
    let config = format!("counter_check_s = 1\nlease_ms = 1500\n{}", config());
    let daemon = start_with(&test, &config).await;
    let (checks, _) = until_checked(&daemon, |checks, drifted| checks >= 1 && drifted == 0).await;
    let sql = test.sql().await.unwrap();
    drift_one_pool(&sql, 2).await;
    let repaired = poll_until(
        std::time::Duration::from_secs(30),
        async || metric(&daemon, "spindle_reservation_repairs_total").await,
        |&n| n >= 1,
    )
    .await;
    assert_eq!(repaired, 1, "one repair of one drift");
    let used = pool_used(&sql).await;
    assert_eq!(used, 0, "repaired to what live attempts hold (nothing)");
    let audited = common::read_i64(
        &sql,
        "SELECT count(*) FROM audit_log WHERE actor = 'node admin-node'
            AND object_kind = 'counters' AND reason LIKE 'rebuild: automatic%'",
    )
    .await;
    assert_eq!(audited, 1);
    let (seen, _) = until_checked(&daemon, |c, drifted| c > checks + 1 && drifted == 0).await;
    until_checked(&daemon, |c, drifted| c > seen && drifted == 0).await;
    assert_eq!(
        metric(&daemon, "spindle_reservation_repairs_total").await,
        1
    );
}

/// An operator cancels any tenant's tasks with spindlectl: one queued and one running end
/// CANCELED (as their client sees), an unknown task and an ended one are said to be so, the
/// call is audited with its reason first, and a viewer may not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_cancels_a_tenants_tasks_and_a_viewer_may_not() {
    let test = TestDb::new().await;
    // Tasks that run for their modelled time (tens of seconds) on one slot per account: the
    // first two run, the third waits.
    let config = NodeConfig::new()
        .node_id("admin-node")
        .time_scale(1.0)
        .tenants([1])
        .set("provider_concurrency", 1)
        .section(&admin_tokens())
        .toml();
    let daemon = start_with(&test, &config).await;
    let http = daemon.http;
    let client = spindle_client::Client::connect(
        daemon.addr,
        spindle_core::TenantId(1),
        "tenant-1-credential",
    )
    .await
    .unwrap();
    let mut tasks = Vec::new();
    for i in 0..3 {
        tasks.push(
            client
                .submit(common::task(&format!("op-{i}")))
                .await
                .unwrap()
                .task,
        );
    }
    let running = tasks[0];
    common::wait_for(&client, running, spindle_core::TaskState::Running).await;
    let queued = tasks[2];
    assert_eq!(
        client.get(queued).await.unwrap().state,
        spindle_core::TaskState::Queued
    );
    let ids = |ts: &[u64]| ts.iter().map(u64::to_string).collect::<Vec<_>>();
    let mut args = vec!["--json".to_string(), "cancel".into()];
    args.extend(ids(&[running.0, queued.0, 1 << 40]));
    args.extend(["--reason".into(), "ticket 314: customer asked".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, _) = ctl(http, VIEWER_TOKEN, &args);
    assert!(!ok, "a viewer canceled tasks");
    let (ok, out) = ctl(http, OPERATOR_TOKEN, &args);
    assert!(ok, "{out}");
    let answer: serde_json::Value = serde_json::from_str(&out).unwrap();
    let outcomes: Vec<(u64, &str)> = answer["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["task"].as_u64().unwrap(), t["outcome"].as_str().unwrap()))
        .collect();
    assert_eq!(
        outcomes,
        [
            (running.0, "canceled"),
            (queued.0, "canceled"),
            (1 << 40, "not_found")
        ],
        "{out}"
    );
    for t in [running, queued] {
        assert_eq!(
            client.get(t).await.unwrap().state,
            spindle_core::TaskState::Canceled
        );
    }
    // Asked again, the queued one has ended (its shard let it go): said so, by its state.
    let (ok, out) = ctl(
        http,
        OPERATOR_TOKEN,
        &[
            "--json",
            "cancel",
            &queued.0.to_string(),
            "--reason",
            "again",
        ],
    );
    assert!(ok, "{out}");
    let again: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(again["tasks"][0]["outcome"], "ended", "{out}");
    assert_eq!(again["tasks"][0]["detail"], "CANCELED", "{out}");
    let (ok, out) = ctl(http, VIEWER_TOKEN, &["audit"]);
    assert!(ok && out.contains("ticket 314: customer asked"), "{out}");
    // At most 1,000 tasks a call: more are refused by name, nothing canceled.
    let many: Vec<String> = (1..=1_001u64).map(|t| t.to_string()).collect();
    let mut args = vec!["--json", "cancel"];
    args.extend(many.iter().map(String::as_str));
    args.extend(["--reason", "too many"]);
    let (ok, out) = ctl(http, OPERATOR_TOKEN, &args);
    assert!(!ok && out.contains("at most 1000 tasks per call"), "{out}");
    assert_eq!(
        client.get(tasks[1]).await.unwrap().state,
        spindle_core::TaskState::Running
    );
}

/// A node asked to cancel a task of a partition another node serves names that node, and
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_names_the_node_that_serves_a_task_it_does_not() {
    let test = TestDb::new().await;
    let config = |node: &str| {
        NodeConfig::new()
            .node_id(node)
            .time_scale(1.0)
            .section(&admin_tokens())
            .toml()
    };
    // A owns every partition once it serves; B, started after, owns none while A lives.
    let a = start_with(&test, &config("node-a")).await;
    let b = start_with(&test, &config("node-b")).await;
    let client =
        spindle_client::Client::connect(a.addr, spindle_core::TenantId(1), "tenant-1-credential")
            .await
            .unwrap();
    let task = client.submit(common::task("elsewhere")).await.unwrap().task;
    let id = task.0.to_string();
    let (ok, out) = ctl(
        b.http,
        OPERATOR_TOKEN,
        &["--json", "cancel", &id, "--reason", "r"],
    );
    assert!(ok, "{out}");
    let answer: serde_json::Value = serde_json::from_str(&out).unwrap();
    let only = &answer["tasks"][0];
    assert_eq!(only["outcome"], "not_served_here", "{out}");
    let detail = only["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!("served by node node-a at {}", a.addr))
            && detail.contains("cancel it through that node's admin API"),
        "{detail}"
    );
    let state = client.get(task).await.unwrap().state;
    assert!(!state.is_terminal(), "{state:?}");
}
