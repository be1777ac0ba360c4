//! Limits that hold work rather than refuse it, made to bind on a node with real PostgreSQL: a
//! tenant's cost per minute and the node's (the platform's) cost per minute. Work past them
//! waits in its queue and starts as the minute's cost comes back; another tenant's work is not
//! held by a tenant's limit.

mod common;

use std::time::Duration;

use common::{config_scaled, poll_until, start_with, task, wait_for};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{ModelId, TaskId, TaskSpec, TaskState, TenantId};

/// A clip the node's model prices as expensive (the standard clip with audio): it goes to the
/// EXPENSIVE lane.
const EXPENSIVE: TaskSpec = TaskSpec {
    audio: true,
    ..TaskSpec::clip_720p(ModelId(0))
};

/// What `spec` is priced at (milli cost units): the node's model, unchanged.
fn cost_milli(spec: &TaskSpec) -> u64 {
    let p = spindle_core::presets::small_node();
    spindle_core::cost::estimate(spec, &p.models[0], &p.cost_bases)
        .unwrap()
        .cost_milli
}

/// What one of the tests' (standard) tasks is priced at.
fn task_cost_milli() -> u64 {
    cost_milli(&TaskSpec::clip_720p(ModelId(0)))
}

async fn submit_n(client: &Client, prefix: &str, n: usize) -> Vec<TaskId> {
    submit_specs(client, prefix, n, TaskSpec::clip_720p(ModelId(0))).await
}

async fn submit_specs(client: &Client, prefix: &str, n: usize, spec: TaskSpec) -> Vec<TaskId> {
    let mut ids = Vec::new();
    for i in 0..n {
        let mut t = task(&format!("{prefix}{i}"));
        t.spec = spec;
        let a = client.submit(t).await.unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
        ids.push(a.task);
    }
    ids
}

/// Whether `task` stays QUEUED for `hold` (polled; false as soon as it is not).
async fn stays_queued(client: &Client, task: TaskId, hold: Duration) -> bool {
    let seen = poll_until(
        hold,
        async || client.get(task).await.unwrap().state,
        |&s| s != TaskState::Queued,
    )
    .await;
    seen == TaskState::Queued
}

/// Tenant 1 may start one task's cost at once and ten a minute: of three submitted together
/// the first runs at once and the second waits in the queue (about six seconds) before it
/// starts; tenant 2, unlimited, runs all of its three meanwhile. Without the tenant's
/// `cost_per_minute_milli` the second starts at once, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_cost_per_minute_holds_its_work_and_no_one_elses() {
    let test = TestDb::new().await;
    let cost = task_cost_milli();
    let config = config_scaled("0.0001", "").replace(
        "credential = \"tenant-1-credential\"\n",
        &format!(
            "credential = \"tenant-1-credential\"\ncost_per_minute_milli = {}\n",
            10 * cost
        ),
    );
    let daemon = start_with(&test, &config).await;
    let (limited, free) = common::both_tenants(&daemon).await;
    let held = submit_n(&limited, "held", 3).await;
    let others = submit_n(&free, "free", 3).await;
    wait_for(&limited, held[0], TaskState::Succeeded).await;
    for &t in &others {
        wait_for(&free, t, TaskState::Succeeded).await;
    }
    assert!(
        stays_queued(&limited, held[1], Duration::from_secs(2)).await,
        "the second task started within the minute's first tenth: {}",
        daemon.log_tail(10)
    );
    // Held, not dropped: it starts once the minute gives the cost back.
    wait_for(&limited, held[1], TaskState::Succeeded).await;
}

/// The node may start two tasks' cost at once and twenty a minute over every tenant: of five
/// submitted together two run at once and the third waits. Without
/// `platform_cost_per_minute_milli` all five run at once, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_platforms_cost_per_minute_holds_work_past_it() {
    let test = TestDb::new().await;
    let cost = task_cost_milli();
    let config = config_scaled(
        "0.0001",
        &format!("platform_cost_per_minute_milli = {}\n", 20 * cost),
    );
    let daemon = start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let ids = submit_n(&client, "p", 5).await;
    let started_at_once = poll_until(
        Duration::from_secs(2),
        async || {
            let mut n = 0;
            for &t in &ids {
                n += usize::from(client.get(t).await.unwrap().state != TaskState::Queued);
            }
            n
        },
        |&n| n >= 3,
    )
    .await;
    assert!(
        (1..=2).contains(&started_at_once),
        "{started_at_once} of 5 started within the first two seconds: {}",
        daemon.log_tail(10)
    );
    // Held, not dropped.
    for &t in &ids {
        wait_for(&client, t, TaskState::Succeeded).await;
    }
}

/// The expensive lane has a cost budget of its own, one and a half expensive tasks' cost at
/// once; the platform's adds as much of standard tasks' cost for the other lanes. Three
/// standard tasks submitted before three expensive ones, of one tenant: the first of each
/// runs at once and the second of each waits in its queue — the expensive lane's budget holds
/// its own work, and the standard tasks, picked first, take none of it. Without the lane's own
/// budget (one platform budget for every lane) the second standard task starts at once, and
/// this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expensive_lanes_own_budget_holds_its_work_and_no_other_lane_takes_it() {
    let test = TestDb::new().await;
    let (standard, expensive) = (task_cost_milli(), cost_milli(&EXPENSIVE));
    let config = config_scaled(
        "0.0001",
        &format!(
            "platform_cost_per_minute_milli = {}\n\n[lanes.EXPENSIVE]\ncost_per_minute_milli = {}\n",
            15 * (standard + expensive),
            15 * expensive
        ),
    );
    let daemon = start_with(&test, &config).await;
    let (client, _) = common::both_tenants(&daemon).await;
    let standards = submit_n(&client, "standard", 3).await;
    let expensives = submit_specs(&client, "expensive", 3, EXPENSIVE).await;
    wait_for(&client, standards[0], TaskState::Succeeded).await;
    wait_for(&client, expensives[0], TaskState::Succeeded).await;
    for held in [standards[1], expensives[1]] {
        assert!(
            stays_queued(&client, held, Duration::from_secs(2)).await,
            "{held} started within the first tenth of its budget's minute: {}",
            daemon.log_tail(10)
        );
    }
    // Held, not dropped.
    for &t in standards.iter().chain(&expensives) {
        wait_for(&client, t, TaskState::Succeeded).await;
    }
}
