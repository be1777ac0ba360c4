//! Policy changes reach a running node without a restart: a lane closed and reopened through
//! spindlectl, a provider account's concurrency, a model's price, a provider account and a
//! model added. Tasks keep the version they
//! were admitted under; changes the node could not take are refused before they are stored.

mod common;

use std::time::{Duration, Instant};

use common::{http_get, poll_until, start_with, task, wait_for};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{Decision, TaskState, TenantId};

/// An operator and an admin token.
const ADMIN_TOKENS: &str = r#"
[[admin_tokens]]
name = "otto"
token = "operator-token-0123456789"
role = "operator"

[[admin_tokens]]
name = "ada"
token = "admin-token-0123456789"
role = "admin"
"#;

fn node() -> common::NodeConfig {
    common::NodeConfig::new()
        .node_id("policy-node")
        .tenants([1])
        .section(ADMIN_TOKENS)
}

fn config() -> String {
    node().toml()
}

const PROVIDER: &str = "vendor-0:acct-1:us:video-model-0";

/// Runs spindlectl with `token`; (success, stdout + stderr).
fn ctl(http: std::net::SocketAddr, token: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spindlectl"))
        .args(["--node", &http.to_string(), "--token", token])
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Writes `body` to a file spindlectl can read and sets it as `object`/`key`.
fn set(
    http: std::net::SocketAddr,
    object: &str,
    key: &str,
    body: &serde_json::Value,
) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("body.json");
    std::fs::write(&file, body.to_string()).unwrap();
    ctl(
        http,
        "admin-token-0123456789",
        &[
            "--json",
            "policy",
            "set",
            object,
            key,
            "--body",
            file.to_str().unwrap(),
            "--reason",
            "live policy test",
        ],
    )
}

fn version_of(out: &str) -> i64 {
    serde_json::from_str::<serde_json::Value>(out).unwrap()["version"]
        .as_i64()
        .unwrap_or_else(|| panic!("no version in {out}"))
}

/// The effective policy the node reports.
fn effective(http: std::net::SocketAddr) -> serde_json::Value {
    let (ok, out) = ctl(
        http,
        "operator-token-0123456789",
        &["--json", "policy", "show"],
    );
    assert!(ok, "{out}");
    serde_json::from_str::<serde_json::Value>(&out).unwrap()["effective"].clone()
}

/// Polls (bounded: 4 s) until `f` holds; how long it took.
async fn within(what: &str, f: impl AsyncFnMut() -> bool) -> Duration {
    let start = Instant::now();
    let held = poll_until(Duration::from_secs(4), f, |&held| held).await;
    assert!(held, "{what}: not within 4 s");
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_providers_and_models_change_on_a_running_node() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, &config()).await;
    let http = daemon.http;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let sql = test.sql().await.unwrap();
    let first = client.submit(task("before")).await.unwrap();
    assert_eq!(first.decision, Decision::Accepted, "{first:?}");
    wait_for(&client, first.task, TaskState::Succeeded).await;

    // Close STANDARD (tenant 1's lane) through the admission switch.
    let (ok, out) = ctl(
        http,
        "operator-token-0123456789",
        &[
            "--json",
            "lane",
            "close",
            "STANDARD",
            "--reason",
            "incident 42",
        ],
    );
    assert!(ok, "{out}");
    let closed_at = version_of(&out);
    let mut n = 0;
    let took = within("the closed lane refuses new work", async || {
        n += 1;
        let a = client.submit(task(&format!("closed-{n}"))).await.unwrap();
        a.decision == Decision::RejectResourceClassDisabled
            && a.reason
                .is_some_and(|r| r.contains("lane STANDARD is closed"))
    })
    .await;
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert_eq!(effective(http)["lanes"][2]["open"], false);
    let (_, metrics) = http_get(http, "/metrics").await;
    assert!(
        metrics.contains("spindle_lane_open{lane=\"STANDARD\"} 0\n")
            && metrics.contains("spindle_lane_open{lane=\"PAID_SHARED\"} 1\n"),
        "the dashboard's lane switch: {metrics}"
    );

    // Open again: accepted, and the task carries the version it was admitted under.
    let (ok, out) = ctl(
        http,
        "operator-token-0123456789",
        &[
            "--json",
            "lane",
            "open",
            "STANDARD",
            "--reason",
            "incident 42 over",
        ],
    );
    assert!(ok, "{out}");
    let opened_at = version_of(&out);
    assert!(opened_at > closed_at);
    let mut n = 0;
    let mut reopened = None;
    within("the reopened lane admits", async || {
        n += 1;
        let a = client.submit(task(&format!("open-{n}"))).await.unwrap();
        let accepted = a.decision == Decision::Accepted;
        reopened = accepted.then_some(a.task);
        accepted
    })
    .await;
    let versions: Vec<(i64, i64)> = sql
        .query(
            "SELECT task_id, policy_version FROM task WHERE task_id = ANY($1) ORDER BY task_id",
            &[&vec![first.task.0 as i64, reopened.unwrap().0 as i64]],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(versions.len(), 2);
    assert!(versions[0].1 < closed_at, "{versions:?}");
    assert_eq!(versions[1].1, opened_at, "{versions:?}");

    // A provider account's concurrency: the node's split and the pool in PostgreSQL follow.
    let mut account = effective(http)["providers"][0].clone();
    assert_eq!(account["name"], PROVIDER);
    account["concurrency"] = 3.into();
    let (ok, out) = set(http, "provider_account", PROVIDER, &account);
    assert!(ok, "{out}");
    within("the provider's concurrency is split anew", async || {
        let (_, metrics) = http_get(http, "/metrics").await;
        metrics.contains("spindle_node_limit_capacity{limit=\"provider:0:concurrency\"} 3\n")
    })
    .await;
    within("the provider pool is resized", async || {
        let row = sql
            .query_one(
                "SELECT sum(capacity)::bigint FROM resource_pool_shard WHERE pool_key = $1",
                &[&format!("provider:{PROVIDER}")],
            )
            .await
            .unwrap();
        row.get::<_, Option<i64>>(0) == Some(3)
    })
    .await;

    // A model's price: new tasks of the same spec are priced anew, the old ones keep theirs.
    let cost = async |id: spindle_core::TaskId| -> i64 {
        sql.query_one(
            "SELECT cost_estimate_milli FROM task WHERE task_id = $1",
            &[&(id.0 as i64)],
        )
        .await
        .unwrap()
        .get(0)
    };
    let old_cost = cost(first.task).await;
    let mut model = effective(http)["models"][0].clone();
    let per_s = model["cost_milli_per_output_s"].as_i64().unwrap();
    model["cost_milli_per_output_s"] = (per_s * 3).into();
    let (ok, out) = set(http, "model_capability", "video-model-0", &model);
    assert!(ok, "{out}");
    let mut n = 0;
    within("the repriced model prices new tasks", async || {
        n += 1;
        let a = client.submit(task(&format!("priced-{n}"))).await.unwrap();
        assert_eq!(a.decision, Decision::Accepted, "{a:?}");
        cost(a.task).await == old_cost * 3
    })
    .await;
    assert_eq!(
        cost(first.task).await,
        old_cost,
        "an admitted task was repriced"
    );

    // Refused before anything is stored: a lane that does not exist, a provider account the
    // node does not have, a key that is not the object's name.
    let lane = effective(http)["lanes"][2].clone();
    let (ok, out) = set(http, "lane", "standard", &lane);
    assert!(
        !ok && out.contains("is not one of ENTERPRISE_RESERVED"),
        "{out}"
    );
    let mut new_account = account.clone();
    new_account["id"] = 9.into();
    let (ok, out) = set(http, "provider_account", PROVIDER, &new_account);
    assert!(
        !ok && out.contains("a new provider takes the next id"),
        "{out}"
    );
    let (ok, out) = set(http, "provider_account", "vendor-9", &account);
    assert!(
        !ok && out.contains("is not the provider account's name"),
        "{out}"
    );
    let mut bad = lane;
    bad["weight"] = 0.into();
    let (ok, out) = set(http, "lane", "STANDARD", &bad);
    assert!(!ok && out.contains("lanes.STANDARD.weight: 0"), "{out}");
    let (_, metrics) = http_get(http, "/metrics").await;
    assert!(
        metrics.contains("spindle_policy_objects_skipped 0\n"),
        "{metrics}"
    );

    // Deleting the lane row returns it to the configured lane (open); the audit log has it all.
    let (ok, out) = ctl(
        http,
        "operator-token-0123456789",
        &[
            "policy",
            "delete",
            "lane",
            "STANDARD",
            "--reason",
            "back to the configuration",
        ],
    );
    assert!(ok, "{out}");
    let (ok, out) = ctl(
        http,
        "operator-token-0123456789",
        &["--json", "audit", "--limit", "20"],
    );
    assert!(ok, "{out}");
    for reason in [
        "incident 42",
        "incident 42 over",
        "back to the configuration",
    ] {
        assert!(out.contains(&format!("\"{reason}\"")), "{reason}: {out}");
    }
    assert!(
        out.contains("provider 9 is not configured"),
        "refused changes are audited: {out}"
    );
}

/// A provider account and a model that only it serves, added through `spindlectl add` while the
/// node runs: the account's pool rows are made in PostgreSQL, the node's split takes its
/// limits, and a task of the new model runs on the new account. An id that would leave a gap
/// is refused, and so is deleting the added account.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_account_and_a_model_added_while_running_take_work() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, &config()).await;
    let http = daemon.http;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let sql = test.sql().await.unwrap();
    let policy = effective(http);
    let providers = policy["providers"].as_array().unwrap().len();
    let models = policy["models"].as_array().unwrap().len();
    let name = "vendor-9:acct-1:us:video-model-9";

    let mut account = policy["providers"][0].clone();
    account["id"] = (providers + 1).into();
    account["name"] = name.into();
    account["concurrency"] = 2.into();
    let (ok, out) = set(http, "provider_account", name, &account);
    assert!(
        !ok && out.contains(&format!("takes the next id, {providers}")),
        "{out}"
    );
    // `spindlectl add` takes the next id and copies the rest; the model names the account
    // at once (before the node runs it: the store has it).
    let admin = "admin-token-0123456789";
    let add = |what: &str, name: &str, option: &str, value: &str, reason: &str| {
        ctl(
            http,
            admin,
            &["add", what, name, option, value, "--reason", reason],
        )
    };
    let (ok, out) = add("provider", name, "--concurrency", "2", "a second account");
    assert!(ok, "{out}");
    let (ok, out) = add("model", "video-model-9", "--providers", name, "a new model");
    assert!(ok, "{out}");
    let (ok, out) = add(
        "model",
        "video-model-10",
        "--providers",
        "vendor-7:none",
        "a typo",
    );
    assert!(
        !ok && out.contains("no provider account vendor-7:none"),
        "{out}"
    );

    // `policy show` lists the accounts and models the node runs, with their ids.
    let line = format!("provider {providers:<3} {name}");
    within("the node runs the new account", async || {
        let (ok, out) = ctl(http, admin, &["policy", "show"]);
        ok && out.contains(&line) && out.contains("video-model-9")
    })
    .await;
    let limit =
        format!("spindle_node_limit_capacity{{limit=\"provider:{providers}:concurrency\"}} 2\n");
    within(
        "the node splits the new account's concurrency",
        async || http_get(http, "/metrics").await.1.contains(&limit),
    )
    .await;
    let pool: Option<i64> = sql
        .query_one(
            "SELECT sum(capacity)::bigint FROM resource_pool_shard WHERE pool_key = $1",
            &[&format!("provider:{name}")],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(pool, Some(2), "the account's pool rows");

    // Each shard takes the new model when its own copy of the policy does: the one serving
    // tenant 1 may come a moment after the node's view that `policy show` reads. Until it
    // does, a task of the model is refused as not in the matrix.
    let mut n = 0;
    let mut accepted = None;
    within(
        "the tenant's shard takes tasks of the new model",
        async || {
            n += 1;
            let mut t = task(&format!("on-the-new-model-{n}"));
            t.spec.model = spindle_core::ModelId(models as u16);
            match client.submit(t).await {
                Ok(a) if a.decision == Decision::Accepted => {
                    accepted = Some(a.task);
                    true
                }
                _ => false,
            }
        },
    )
    .await;
    let a_task = accepted.expect("accepted within the bound");
    wait_for(&client, a_task, TaskState::Succeeded).await;
    let ran_on: Option<String> = sql
        .query_one(
            "SELECT attempt_provider FROM task WHERE task_id = $1",
            &[&(a_task.0 as i64)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ran_on.as_deref(), Some(name));
    let (_, metrics) = http_get(http, "/metrics").await;
    assert!(
        metrics.contains("spindle_policy_objects_skipped 0\n"),
        "{metrics}"
    );
    // Its row cannot be deleted (the id would be left unfilled at the next start).
    let (ok, out) = ctl(
        http,
        "admin-token-0123456789",
        &[
            "policy",
            "delete",
            "provider_account",
            name,
            "--reason",
            "try",
        ],
    );
    assert!(!ok && out.contains("cannot be deleted"), "{out}");
}

/// An operator suspends a tenant with spindlectl: its submits are rejected with the reason,
/// its queued tasks wait — none starts once capacity is there — while it may still read and
/// cancel them, and the change is audited with its reason. Resumed, what waited runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_tenant_takes_no_work_and_starts_none_until_it_is_resumed() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, &config()).await;
    let http = daemon.http;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let accounts = |concurrency: u64| async move {
        for (i, mut account) in effective(http)["providers"]
            .as_array()
            .unwrap()
            .clone()
            .into_iter()
            .enumerate()
        {
            let name = account["name"].as_str().unwrap().to_string();
            account["concurrency"] = concurrency.into();
            let (ok, out) = set(http, "provider_account", &name, &account);
            assert!(ok, "{out}");
            let line = format!(
                "spindle_node_limit_capacity{{limit=\"provider:{i}:concurrency\"}} {concurrency}\n"
            );
            within("the account's concurrency is split anew", async || {
                http_get(http, "/metrics").await.1.contains(&line)
            })
            .await;
        }
    };
    // No provider capacity: the tenant's tasks wait in its queue.
    accounts(0).await;
    let mut waiting = Vec::new();
    for i in 0..3 {
        let a = client.submit(task(&format!("held-{i}"))).await.unwrap();
        assert_eq!(a.decision, Decision::Accepted, "{a:?}");
        waiting.push(a.task);
    }
    let suspend = |verb: &'static str| {
        let (ok, out) = ctl(
            http,
            "operator-token-0123456789",
            &[
                "--json",
                "tenant",
                verb,
                "1",
                "--reason",
                "invoice 7 unpaid",
            ],
        );
        assert!(ok, "{out}");
    };
    suspend("suspend");
    let mut n = 0;
    within("the suspended tenant's submits are rejected", async || {
        n += 1;
        let a = client.submit(task(&format!("refused-{n}"))).await.unwrap();
        a.decision == Decision::RejectResourceClassDisabled
            && a.reason
                .is_some_and(|r| r.contains("the tenant is suspended"))
    })
    .await;
    assert_eq!(effective(http)["tenants"]["1"]["suspended"], true);
    // Capacity again: nothing of the suspended tenant starts.
    accounts(100).await;
    let started = poll_until(
        Duration::from_millis(1_500),
        async || {
            let mut states = Vec::new();
            for &t in &waiting {
                states.push(client.get(t).await.unwrap().state);
            }
            states
        },
        |states| states.iter().any(|s| *s != TaskState::Queued),
    )
    .await;
    assert!(
        started.iter().all(|s| *s == TaskState::Queued),
        "held tasks started: {started:?}"
    );
    // It may still cancel what waits.
    assert_eq!(
        client.cancel(waiting[0]).await.unwrap(),
        TaskState::Canceled
    );
    let (ok, out) = ctl(http, "operator-token-0123456789", &["audit"]);
    assert!(ok && out.contains("invoice 7 unpaid"), "{out}");
    // Resumed: what waited runs, and new work is taken.
    suspend("resume");
    for &t in &waiting[1..] {
        wait_for(&client, t, TaskState::Succeeded).await;
    }
    let a = client.submit(task("after")).await.unwrap();
    assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    assert_eq!(effective(http)["tenants"]["1"]["suspended"], false);
}

/// A tenant's user limits from the config bind per user — a user's second submit within its
/// rate is refused while the tenant's other user is served, and a user's second task waits
/// while its first runs — and never touch another tenant's users of the same ids. Raised
/// through the policy store, they reach the users the node already knows at once: the waiting
/// task starts. Without `[tenants.user]` nothing is refused or held; without the live update
/// of known users (`Shard::set_tenant_policy`) the waiting task stays queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenants_user_limits_bind_per_user_and_change_live() {
    let test = TestDb::new().await;
    // Long tasks: a running one holds its user's running slot for the length of the test.
    let config = node()
        .time_scale("10.0")
        .tenants([1, 2])
        .tenant_lines(
            1,
            "[tenants.user]\nsubmit_per_minute = 60\nrunning_tasks_max = 1",
        )
        .toml();
    let daemon = start_with(&test, &config).await;
    let http = daemon.http;
    let (one, two) = common::both_tenants(&daemon).await;
    let first = one.submit(common::task_of("u1-a", 1)).await.unwrap();
    assert_eq!(first.decision, Decision::Accepted, "{first:?}");
    let again = one.submit(common::task_of("u1-b", 1)).await.unwrap();
    assert_eq!(again.decision, Decision::RejectUserRateLimit, "{again:?}");
    let other_user = one.submit(common::task_of("u2-a", 2)).await.unwrap();
    assert_eq!(other_user.decision, Decision::Accepted, "{other_user:?}");
    // Tenant 2's user 1 is not tenant 1's: three at once, all taken.
    for i in 0..3 {
        let a = two
            .submit(common::task_of(&format!("t2-{i}"), 1))
            .await
            .unwrap();
        assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    }
    assert_eq!(
        effective(http)["tenants"]["1"]["user"]["running_tasks_max"],
        1
    );

    // A second of user 1's: taken once its rate gives a submit back (one a second).
    let mut n = 0;
    let mut second = None;
    within("user 1 may submit again", async || {
        n += 1;
        let a = one
            .submit(common::task_of(&format!("u1-b{n}"), 1))
            .await
            .unwrap();
        let taken = a.decision == Decision::Accepted;
        if taken {
            second = Some(a.task);
        }
        taken
    })
    .await;
    let second = second.unwrap();
    wait_for(&one, first.task, TaskState::Running).await;
    wait_for(&one, other_user.task, TaskState::Running).await;
    let waited = poll_until(
        Duration::from_millis(1_500),
        async || one.get(second).await.unwrap().state,
        |&s| s != TaskState::Queued,
    )
    .await;
    assert_eq!(waited, TaskState::Queued, "user 1 runs one task at a time");

    let mut tenant = effective(http)["tenants"]["1"].clone();
    tenant["user"]["running_tasks_max"] = 2.into();
    let (ok, out) = set(http, "tenant_policy", "1", &tenant);
    assert!(ok, "{out}");
    within("the raised limit reaches the waiting task", async || {
        one.get(second).await.unwrap().state != TaskState::Queued
    })
    .await;
    assert_eq!(
        one.get(first.task).await.unwrap().state,
        TaskState::Running,
        "its first still runs beside it"
    );
}
