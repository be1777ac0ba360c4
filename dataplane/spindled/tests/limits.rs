//! Limits that hold work rather than refuse it, made to bind on a node with real PostgreSQL: a
//! tenant's cost per minute and the node's (the platform's) cost per minute. Work past them
//! waits in its queue and starts as the minute's cost comes back; another tenant's work is not
//! held by a tenant's limit.

mod common;

use common::{config_scaled, start_with, task, wait_for};
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
/// When each of `tasks` (ended, one attempt each) started, in seconds, as PostgreSQL stored it.
/// A budget's hold is read from these, not from how soon the test looked: a machine too busy
/// to look in time cannot make a held task look started, or the reverse.
async fn started_at(test: &TestDb, tasks: &[TaskId]) -> Vec<f64> {
    let sql = test.sql().await.unwrap();
    let mut at = Vec::new();
    for t in tasks {
        let row = sql
            .query_one(
                "SELECT extract(epoch FROM attempt_started_at)::float8 FROM task WHERE task_id = $1",
                &[&(t.0 as i64)],
            )
            .await
            .unwrap();
        at.push(row.get::<_, f64>(0));
    }
    at
}

/// A budget of `per_minute` holds `tenths` of it at once (a tenth: `cost_per_minute_milli`'s
/// burst) and refills continuously: after a task of `cost` took it down to `left`, the next such
/// task waits `(cost - left) / (per_minute / 60)` seconds.
fn refill_s(per_minute: u64, left: u64, cost: u64) -> f64 {
    cost.saturating_sub(left) as f64 * 60.0 / per_minute as f64
}

/// Tenant 1 may start one task's cost at once and ten a minute: of three submitted together
/// the first starts at once and the second about six seconds later (when the minute has given
/// its cost back); tenant 2, unlimited, runs all of its three meanwhile. Without the tenant's
/// `cost_per_minute_milli` the second starts at once, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_cost_per_minute_holds_its_work_and_no_one_elses() {
    let test = TestDb::new().await;
    let cost = task_cost_milli();
    let config = common::NodeConfig::new()
        .tenant_lines(1, &format!("cost_per_minute_milli = {}", 10 * cost))
        .toml();
    let daemon = start_with(&test, &config).await;
    let (limited, free) = common::both_tenants(&daemon).await;
    let held = submit_n(&limited, "held", 3).await;
    let others = submit_n(&free, "free", 3).await;
    for &t in &others {
        wait_for(&free, t, TaskState::Succeeded).await;
    }
    // Held, not dropped: it starts once the minute gives the cost back.
    for &t in &held[..2] {
        wait_for(&limited, t, TaskState::Succeeded).await;
    }
    let at = started_at(&test, &held[..2]).await;
    let gap = at[1] - at[0];
    let due = refill_s(10 * cost, 0, cost);
    assert!(
        gap >= due - 1.5,
        "the second task started {gap:.2} s after the first, its cost due back after {due:.1} s: {}",
        daemon.log_tail(10)
    );
}

/// The node may start just over one task's cost at once and ten and a half a minute over every
/// tenant: of five submitted together one starts at once and the next about five seconds
/// later. Without `platform_cost_per_minute_milli` all five start at once, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_platforms_cost_per_minute_holds_work_past_it() {
    let test = TestDb::new().await;
    let cost = task_cost_milli();
    let per_minute = 10 * cost + cost / 2;
    let config = config_scaled(
        "0.0001",
        &format!("platform_cost_per_minute_milli = {per_minute}\n"),
    );
    let daemon = start_with(&test, &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let ids = submit_n(&client, "p", 5).await;
    // Held, not dropped.
    for &t in &ids[..2] {
        wait_for(&client, t, TaskState::Succeeded).await;
    }
    let mut at = started_at(&test, &ids[..2]).await;
    at.sort_by(f64::total_cmp);
    let (gap, due) = (
        at[1] - at[0],
        refill_s(per_minute, per_minute / 10 - cost, cost),
    );
    assert!(
        gap >= due - 1.5,
        "the second task started {gap:.2} s after the first, due after {due:.1} s: {}",
        daemon.log_tail(10)
    );
}

/// The expensive lane has a cost budget of its own, just over one expensive task's cost at
/// once; the platform's adds as much of standard tasks' cost for the other lanes. Three
/// standard tasks submitted before three expensive ones, of one tenant: the first of each
/// starts at once and the second of each about five seconds later — the expensive lane's
/// budget holds its own work, and the standard tasks, picked first, take none of it. Without
/// the lane's own budget (one platform budget for every lane) the second standard task starts
/// at once, and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expensive_lanes_own_budget_holds_its_work_and_no_other_lane_takes_it() {
    let test = TestDb::new().await;
    let (standard, expensive) = (task_cost_milli(), cost_milli(&EXPENSIVE));
    let (others, lane) = (21 * standard / 2, 21 * expensive / 2);
    let config = config_scaled(
        "0.0001",
        &format!(
            "platform_cost_per_minute_milli = {}\n\n[lanes.EXPENSIVE]\ncost_per_minute_milli = {lane}\n",
            others + lane,
        ),
    );
    let daemon = start_with(&test, &config).await;
    let (client, _) = common::both_tenants(&daemon).await;
    let standards = submit_n(&client, "standard", 3).await;
    let expensives = submit_specs(&client, "expensive", 3, EXPENSIVE).await;
    // Held, not dropped.
    for &t in standards[..2].iter().chain(&expensives[..2]) {
        wait_for(&client, t, TaskState::Succeeded).await;
    }
    for (what, tasks, per_minute, cost) in [
        ("standard", &standards, others, standard),
        ("expensive", &expensives, lane, expensive),
    ] {
        let at = started_at(&test, &tasks[..2]).await;
        let (gap, due) = (
            at[1] - at[0],
            refill_s(per_minute, per_minute / 10 - cost, cost),
        );
        assert!(
            gap >= due - 1.5,
            "the second {what} task started {gap:.2} s after the first, due after {due:.1} s: {}",
            daemon.log_tail(10)
        );
    }
}
