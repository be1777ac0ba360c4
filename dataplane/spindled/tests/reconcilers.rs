//! The reconcilers a node schedules (`spindle_node_control::reconciler`), on real PostgreSQL with the
//! node as a process: attempts nobody follows are followed again or requeued through the
//! RECOVERY lane without a request to the node, a job whose answer was lost is found by its
//! request key and never submitted twice, orphan jobs are canceled at the provider, cost drift
//! is reported, and each partition's reconciling is done by its owner only.

mod common;

use std::time::Duration;

use common::mock::{self, ACCOUNTS};
use common::{poll_until, Daemon};
use spindle_control::testing::TestDb;
use spindle_control::{ClaimRequest, ClaimResult, Demand, NewTask, PartitionId, PoolShard};
use spindle_core::{Band, FencingToken, Lane, PolicyVersion, TaskId, TenantId, UserId};
use spindle_providers::{AsyncJobProvider, Submission};

const PARTITIONS: u32 = 8;

/// A task of `tenant` claimed as `node`'s attempt 1 at `account`, straight in PostgreSQL —
/// what a node that lost track of an attempt leaves behind: nobody renews its lease
/// (`lease_ms`), and no shard holds it.
async fn plant_attempt(
    test: &TestDb,
    node: &str,
    tenant: u32,
    task: u64,
    account: &str,
    lease_ms: u32,
) -> FencingToken {
    let db = test.open().await;
    let t = common::task(&format!("planted-{task}"));
    let payload = serde_json::to_vec(&spindle_node_base::messages::StoredRequest {
        user: 1,
        spec: t.spec,
        band_hint: t.band_hint,
        deadline_ms: None,
        input: None,
    })
    .unwrap();
    let partition = spindle_node_base::config::partition_of(tenant, PARTITIONS);
    db.submit_batch(
        &[NewTask {
            task: TaskId(task),
            tenant: TenantId(tenant),
            user: UserId(1),
            idempotency_key: format!("planted-{task}"),
            payload,
            partition: PartitionId(partition),
            lane: Lane::Standard,
            band: Band::P3,
            cost_estimate_milli: 1_000,
            fairness_milli: 1_000,
        }],
        PolicyVersion(1),
    )
    .await
    .unwrap();
    let pool = spindle_node_control::control::provider_pool(account);
    let claim = ClaimRequest {
        task: TaskId(task),
        expected_version: 0,
        provider: account.into(),
        demands: vec![Demand {
            shard: PoolShard::new(pool.as_str(), 0),
            amount: 1,
        }],
    };
    match db
        .claim_batch(node, lease_ms, &[claim])
        .await
        .unwrap()
        .pop()
    {
        Some(ClaimResult::Granted { token, .. }) => token,
        refused => panic!("planting {task}: {refused:?}"),
    }
}

/// A task id far from the blocks the node hands out.
const PLANTED: u64 = 1 << 40;

async fn metrics(daemon: &Daemon) -> String {
    common::http_get(daemon.http, "/metrics").await.1
}

/// One reconciler's series, for `job`.
async fn reconciler(daemon: &Daemon, series: &str, job: &str) -> u64 {
    let text = metrics(daemon).await;
    let line = format!("spindle_reconciler_{series}{{job=\"{job}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&line))
        .map_or(0, |v| v.trim().parse().unwrap())
}

async fn state(sql: &tokio_postgres::Client, task: u64) -> (String, i32) {
    let r = sql
        .query_one(
            "SELECT state, attempt_no FROM task WHERE task_id = $1",
            &[&(task as i64)],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

/// `task`'s state and attempt once it SUCCEEDED, or as they are after 30 s.
async fn until_succeeded(sql: &tokio_postgres::Client, task: u64) -> (String, i32) {
    poll_until(
        Duration::from_secs(30),
        async || state(sql, task).await,
        |(s, _)| s == "SUCCEEDED",
    )
    .await
}

/// With the local provider, an attempt nobody holds (its lease lapsed, the node otherwise
/// idle, no request sent to it) is requeued by the scheduled job within two of its periods,
/// runs again through the RECOVERY lane, and nothing stays held. Without the scheduled job
/// (`attempts_every_ms = 0`) the task stays DISPATCHING with its slot held, and this fails.
#[tokio::test]
async fn a_lapsed_attempt_nobody_holds_is_requeued_through_the_recovery_lane() {
    let test = TestDb::new().await;
    const EVERY_MS: u64 = 1_000;
    let daemon = common::start_with(
        &test,
        &common::config_scaled(
            "0.0001",
            &format!("[reconcile]\nattempts_every_ms = {EVERY_MS}\n"),
        ),
    )
    .await;
    let sql = test.sql().await.unwrap();
    plant_attempt(&test, "test-node", 1, PLANTED, ACCOUNTS[0], 200).await;
    assert_eq!(state(&sql, PLANTED).await.0, "DISPATCHING");
    let lapsed = std::time::Instant::now() + Duration::from_millis(200);

    let (done, attempt) = until_succeeded(&sql, PLANTED).await;
    assert_eq!(done, "SUCCEEDED", "{}", daemon.log_tail(20));
    assert_eq!(attempt, 2, "a new attempt ran it");
    assert!(
        lapsed.elapsed() < Duration::from_millis(2 * EVERY_MS * 13 / 10) + Duration::from_secs(2),
        "the scheduled job took {:?}",
        lapsed.elapsed()
    );
    assert_eq!(reconciler(&daemon, "repairs_total", "attempts").await, 1);
    let recovery: u64 = metrics(&daemon)
        .await
        .lines()
        .filter(|l| l.starts_with("spindle_dispatch_wait_seconds_count{lane=\"RECOVERY\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(recovery, 1, "it went through the RECOVERY lane");
    assert_eq!(mock::held(&sql).await, (0, 0, 0));
}

/// A submission as the node would send it for attempt 1 of `task`.
fn submission(account: &str, task: u64) -> Submission {
    Submission {
        account: account.into(),
        request_key: format!("spindle-{task}-1"),
        model: "video-model-0".into(),
        input: serde_json::Value::Null,
        callback_url: None,
    }
}

/// The provider node the tests below run, with `reconcile` as its `[reconcile]` section.
async fn provider_node(
    test: &TestDb,
    id: &str,
    m: &spindle_providers::MockProvider,
    reconcile: &str,
) -> Daemon {
    let config = mock::node_config(id, m, &format!("\n[reconcile]\n{reconcile}\n"));
    common::start_with(test, &config).await
}

/// A task left in DISPATCHING by a node that lost track of it, whose provider accepted the
/// submit (its answer lost), is found by its request key and followed to its end: SUCCEEDED,
/// one job at the provider, no request key sent twice, nothing held. Without the scheduled
/// job it stays DISPATCHING with its slot held.
#[tokio::test]
async fn a_dispatching_task_whose_answer_was_lost_is_found_by_its_request_key() {
    let test = TestDb::new().await;
    let (m, admin) = mock::mock(300).await;
    let daemon = provider_node(&test, "lost-answer", &m, "attempts_every_ms = 500").await;
    plant_attempt(&test, "lost-answer", 1, PLANTED, ACCOUNTS[0], 200).await;
    let job = admin
        .submit(&submission(ACCOUNTS[0], PLANTED))
        .await
        .unwrap();
    let sql = test.sql().await.unwrap();
    let (done, attempt) = until_succeeded(&sql, PLANTED).await;
    assert_eq!(done, "SUCCEEDED", "{}", daemon.log_tail(20));
    assert_eq!(attempt, 1, "the job the provider had, not a new attempt");
    let stats = mock::assert_clean(&test, &admin).await;
    assert_eq!(stats.accepted, 1, "one job only: {}", job.job_id);
    assert_eq!(reconciler(&daemon, "repairs_total", "attempts").await, 1);
}

/// A live job at the provider whose attempt is not live in PostgreSQL (here: a task with no
/// row) is canceled there by the orphan job; the jobs of the node's own live tasks are not.
#[tokio::test]
async fn a_provider_job_with_no_live_attempt_is_canceled_and_live_ones_are_not() {
    let test = TestDb::new().await;
    let (m, admin) = mock::mock(3_000).await;
    let daemon = provider_node(&test, "orphans", &m, "orphans_every_ms = 300").await;
    let ids = mock::submit(&daemon, "live", 2).await;
    let orphan = admin
        .submit(&submission(ACCOUNTS[1], PLANTED))
        .await
        .unwrap();
    let canceled = poll_until(
        Duration::from_secs(20),
        async || mock::mock_total(&admin, |s| s.canceled).await,
        |&n| n >= 1,
    )
    .await;
    assert_eq!(canceled, 1, "{}", daemon.log_tail(20));
    match admin.job(ACCOUNTS[1], &orphan.job_id).await.unwrap() {
        spindle_providers::Lookup::Found(v) => {
            assert_eq!(v.state, spindle_providers::api::JobState::Canceled)
        }
        spindle_providers::Lookup::NotFound => panic!("the orphan job is gone"),
    }
    let states = mock::wait_final(&test, &ids).await;
    assert_eq!(states, ["SUCCEEDED", "SUCCEEDED"]);
    assert_eq!(
        mock::mock_total(&admin, |s| s.canceled).await,
        1,
        "the node's own jobs ran to their end"
    );
    assert!(reconciler(&daemon, "repairs_total", "orphans").await >= 1);
}

/// A succeeded task whose settled cost differs from what the provider reports for its job is
/// drift, found by the cost job; tasks that settled what the provider reported are not.
#[tokio::test]
async fn a_settled_cost_the_provider_disagrees_with_is_reported_as_drift() {
    let test = TestDb::new().await;
    let (m, admin) = mock::mock(50).await;
    let daemon = provider_node(&test, "costs", &m, "costs_every_ms = 300").await;
    let (ids, states) = mock::run(&daemon, &test, "cost", 3).await;
    assert_eq!(states, ["SUCCEEDED"; 3]);
    let passes = reconciler(&daemon, "runs_total", "costs").await;
    poll_until(
        Duration::from_secs(10),
        async || reconciler(&daemon, "runs_total", "costs").await,
        |&n| n > passes,
    )
    .await;
    assert_eq!(
        reconciler(&daemon, "findings_total", "costs").await,
        0,
        "settled as reported"
    );
    let sql = test.sql().await.unwrap();
    sql.execute(
        "UPDATE task SET cost_actual_milli = cost_actual_milli * 2 WHERE task_id = $1",
        &[&(ids[1].0 as i64)],
    )
    .await
    .unwrap();
    let found = poll_until(
        Duration::from_secs(10),
        async || reconciler(&daemon, "findings_total", "costs").await,
        |&n| n >= 1,
    )
    .await;
    assert!(found >= 1, "{}", daemon.log_tail(20));
    assert_eq!(
        reconciler(&daemon, "last_findings", "costs").await,
        1,
        "one task drifted"
    );
    drop(admin);
}

/// Two nodes, each owning its half of the partitions: an attempt nobody follows in each half
/// is repaired by that half's owner only; once one node is gone and the other took its
/// partitions over, a new one in them is repaired by the new owner.
#[tokio::test]
async fn each_partitions_attempts_are_reconciled_by_its_owner_only() {
    let test = TestDb::new().await;
    let (m, admin) = mock::mock(100).await;
    // Tenants 1 and 2 land in different partitions (of 8), owned by different nodes.
    let (p1, p2) = (
        spindle_node_base::config::partition_of(1, PARTITIONS),
        spindle_node_base::config::partition_of(2, PARTITIONS),
    );
    assert_ne!(p1, p2);
    let node = |id: &str, owned: u32| {
        mock::node_config(id, &m, "\n[reconcile]\nattempts_every_ms = 500\n")
            .replace(
                "partitions = 8\n",
                // Neither node takes the other's partition while both start, however slowly (a
                // busy machine); node b takes node a's over once node a is gone.
                &format!(
                    "partitions = 8\nowned_partitions = [{owned}]\ntakeover_grace_ms = 8000\n"
                ),
            )
            .replace(
                "[[tenants]]\nid = 1\ncredential = \"tenant-1-credential\"\n",
                "[[tenants]]\nid = 1\ncredential = \"tenant-1-credential\"\n\n\
             [[tenants]]\nid = 2\ncredential = \"tenant-2-credential\"\n",
            )
    };
    let mut nodes = common::start_together(&test, &[node("node-a", p1), node("node-b", p2)]).await;
    let (b, a) = (nodes.pop().unwrap(), nodes.pop().unwrap());
    plant_attempt(&test, "node-a", 1, PLANTED, ACCOUNTS[0], 200).await;
    plant_attempt(&test, "node-b", 2, PLANTED + 1, ACCOUNTS[0], 200).await;
    let sql = test.sql().await.unwrap();
    let planted = [PLANTED as i64, PLANTED as i64 + 1];
    poll_until(
        Duration::from_secs(30),
        async || mock::unfinished(&sql, &planted).await,
        |&n| n == 0,
    )
    .await;
    assert_eq!(
        mock::unfinished(&sql, &planted).await,
        0,
        "{}",
        b.log_tail(20)
    );
    assert_eq!(reconciler(&a, "repairs_total", "attempts").await, 1);
    assert_eq!(reconciler(&b, "repairs_total", "attempts").await, 1);

    drop(a);
    // Node b takes partition p1 over once node-a's lease (3 s) lapsed.
    let owner = poll_until(
        Duration::from_secs(30),
        async || -> String {
            sql.query_one(
                "SELECT owner_node FROM partition_lease WHERE partition = $1",
                &[&(p1 as i32)],
            )
            .await
            .unwrap()
            .get(0)
        },
        |o| o == "node-b",
    )
    .await;
    assert_eq!(owner, "node-b");
    plant_attempt(&test, "node-b", 1, PLANTED + 2, ACCOUNTS[0], 200).await;
    let left = poll_until(
        Duration::from_secs(30),
        async || mock::unfinished(&sql, &[PLANTED as i64 + 2]).await,
        |&n| n == 0,
    )
    .await;
    assert_eq!(left, 0, "{}", b.log_tail(20));
    assert_eq!(reconciler(&b, "repairs_total", "attempts").await, 2);
    mock::assert_clean(&test, &admin).await;
}
