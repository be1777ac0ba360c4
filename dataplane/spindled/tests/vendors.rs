//! spindled dispatching to each real vendor's API — Replicate, fal.ai, MiniMax — as its local
//! stand-in serves it (`spindle_providers::vendors::standin`, answering with the recorded
//! shapes): tasks run to SUCCEEDED on the vendor's signed webhooks (MiniMax's URL challenge
//! echoed first), every reservation is given back, and submits whose answers came after the
//! node gave up are found again — by query at Replicate, by the webhook naming their key at
//! fal and MiniMax — and never sent twice.

mod common;

use std::time::Duration;

use common::mock::{held, wait_final};
use common::{http_get, metric_sum, start_with_env, Daemon};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{TaskId, TenantId};
use spindle_providers::vendors::standin::{Standin, StandinFault};
use spindle_providers::Vendor;

const KEY: &str = "vendor-api-key";

fn vendor_model(vendor: Vendor) -> &'static str {
    match vendor {
        Vendor::Replicate => "minimax/video-01",
        Vendor::Fal => "fal-ai/kling-video/v1/standard/text-to-video",
        _ => "MiniMax-Hailuo-02",
    }
}

/// A node whose provider is `vendor`'s stand-in: submits give up after 400 ms, and the
/// watch's first poll waits 20 s — so a task that ends sooner ended on its webhook.
async fn node(test: &TestDb, standin: &Standin, vendor: Vendor, dir: &std::path::Path) -> Daemon {
    let secret = match vendor {
        Vendor::Replicate => standin.signing_secret(),
        _ => "node-callback-secret".to_string(),
    };
    let mut section = format!(
        "[provider]\nvendor = \"{}\"\nurl = \"{}\"\ntoken = \"{KEY}\"\nsecret = \"{secret}\"\n\
         timeout_ms = 400\npoll_ms = [20000]\n",
        vendor.name(),
        standin.base_url(),
    );
    if vendor == Vendor::Fal {
        let jwks = dir.join("fal-jwks.json");
        std::fs::write(&jwks, standin.jwks()).unwrap();
        section.push_str(&format!("jwks_file = \"{}\"\n", jwks.display()));
    }
    section.push_str(&format!(
        "[provider.models]\n\"video-model-0\" = \"{}\"\n",
        vendor_model(vendor)
    ));
    let config = common::NodeConfig::new()
        .node_id(&format!("{}-node", vendor.name()))
        .tenants([1])
        .set("provider_concurrency", 4)
        .set("provider_rpm", 6000)
        .set("lane_capacity_units", 100_000)
        .set("retry_backoff_base_ms", 20)
        .set("retry_backoff_max_ms", 200)
        .section(&section);
    // The JSON log, whose task lines carry tenant, task and attempt as keys.
    start_with_env(test, &config.toml(), &[("SPINDLE_LOG_FORMAT", "json")]).await
}

/// Submits `n` tasks with a prompt as their input (what the vendors' video models take), all
/// of which must be accepted.
async fn submit(daemon: &Daemon, prefix: &str, n: usize) -> Vec<TaskId> {
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let batch = (0..n)
        .map(|i| {
            let mut t = common::task(&format!("{prefix}{i}"));
            t.input = Some(format!(r#"{{"prompt": "a lighthouse at dusk, take {i}"}}"#));
            t
        })
        .collect();
    let answers = client.submit_batch(batch).await.unwrap();
    answers
        .into_iter()
        .map(|a| {
            assert!(a.decision.is_accepted(), "{a:?}");
            a.task
        })
        .collect()
}

/// Why tasks failed, for an assertion's message.
async fn reasons(test: &TestDb) -> Vec<String> {
    let sql = test.sql().await.unwrap();
    sql.query("SELECT coalesce(failure_reason, '') FROM task", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn runs_on(vendor: Vendor) {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let standin = Standin::start(vendor, KEY, Duration::from_millis(300))
        .await
        .unwrap();
    let daemon = node(&test, &standin, vendor, dir.path()).await;

    // Healthy: each task's job taken once and ended by its webhook.
    let ids = submit(&daemon, "ok", 6).await;
    let states = wait_final(&test, &ids).await;
    assert!(
        states.iter().all(|s| s == "SUCCEEDED"),
        "{vendor:?}: {states:?} {:?}",
        reasons(&test).await
    );
    let stats = standin.stats();
    assert_eq!(
        (stats.accepted, stats.duplicate_keys),
        (6, 0),
        "{vendor:?}: {stats:?}"
    );
    assert_eq!(stats.unauthorized, 0, "the API key went with every call");
    assert!(stats.callbacks_delivered >= 6, "{vendor:?}: {stats:?}");
    if vendor == Vendor::Minimax {
        assert!(stats.challenges_echoed >= 6, "{stats:?}");
    }
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert!(
        metric_sum(&metrics, "spindle_provider_callbacks_total{kind=\"final\"}") >= 6,
        "{vendor:?}: ended by webhooks, not polls: {metrics}"
    );

    // Taken, answered after the node gave up: in doubt, found again, never sent twice.
    standin.set_fault(StandinFault::SlowAfterAccept {
        answer_after_ms: 1_500,
    });
    let ids = submit(&daemon, "doubt", 3).await;
    let states = wait_final(&test, &ids).await;
    assert!(
        states.iter().all(|s| s == "SUCCEEDED"),
        "{vendor:?}: {states:?}"
    );
    let stats = standin.stats();
    assert_eq!(
        (stats.submits, stats.accepted, stats.duplicate_keys),
        (9, 9, 0),
        "{vendor:?}: {stats:?}"
    );
    let (_, metrics) = http_get(daemon.http, "/metrics").await;
    assert_eq!(
        metric_sum(
            &metrics,
            "spindle_provider_submits_total{result=\"unknown\"}"
        ),
        3,
        "{vendor:?}"
    );
    let sql = test.sql().await.unwrap();
    assert_eq!(
        held(&sql).await,
        (0, 0, 0),
        "{vendor:?}: every reservation given back"
    );

    // Each submit in doubt was logged as a JSON object naming its tenant, task and attempt.
    let log = daemon.log();
    let doubted: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.contains("no answer to its submit"))
        })
        .collect();
    assert_eq!(doubted.len(), 3, "{log}");
    for line in &doubted {
        assert_eq!(
            (&line["tenant"], &line["attempt"]),
            (&1.into(), &1.into()),
            "{line}"
        );
        let named = line["task"].as_str().unwrap_or_default().to_string();
        assert!(ids.iter().any(|t| t.to_string() == named), "{line} {ids:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_run_on_replicate() {
    runs_on(Vendor::Replicate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_run_on_fal() {
    runs_on(Vendor::Fal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_run_on_minimax() {
    runs_on(Vendor::Minimax).await;
}
