//! spindled on a highly available PostgreSQL — pg_auto_failover's monitor, a primary and its
//! synchronous standby (`spindle_control::autofailover`) — reached through one conninfo naming
//! both hosts with `target_session_attrs=read-write`. Under a steady load with the HTTP mock
//! provider the primary is failed over as planned (`pg_autoctl perform failover`) and then
//! lost (its keeper and postmaster killed with SIGKILL) `SPINDLE_FAILOVERS` times (1 in the test
//! command; `scripts/failover-bench` runs 10). After each, the same node process serves again
//! by itself; at the end every task the client had an accepted answer for exists and ended,
//! the mock saw no request key twice and no limit broken, and nothing is held.
//!
//! Also: a connection to the standby is refused by name, and a node that requires a
//! synchronous standby does not serve on a server without one.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::mock::{held, mock, node, ACCOUNTS};
use common::{spawn_on, start_on, task};
use spindle_client::Client;
use spindle_control::autofailover::AutoFailover;
use spindle_control::testing::TestDb;
use spindle_control::{Db, DbConfig};
use spindle_core::{TaskId, TenantId};

/// What the load saw: each accepted task, and when each accepted submit was sent and answered.
#[derive(Default)]
struct Load {
    accepted: Vec<TaskId>,
    /// (sent, answered) of each accepted submit.
    accepted_at: Vec<(Instant, Instant)>,
    refused: u64,
}

/// Submits one task every 10 ms until `stop`, reconnecting when the node drops the
/// connection; records what was accepted and when.
fn steady_load(
    addr: std::net::SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> (Arc<Mutex<Load>>, tokio::task::JoinHandle<()>) {
    let load = Arc::new(Mutex::new(Load::default()));
    let l = load.clone();
    let handle = tokio::spawn(async move {
        let mut client = None;
        let mut i = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if client.is_none() {
                client = Client::connect(addr, TenantId(1), "tenant-1-credential")
                    .await
                    .ok();
            }
            if let Some(c) = &client {
                i += 1;
                let sent = Instant::now();
                match tokio::time::timeout(
                    Duration::from_secs(30),
                    c.submit(task(&format!("ha-{i}"))),
                )
                .await
                {
                    Ok(Ok(a)) if a.decision.is_accepted() => {
                        let mut l = l.lock().unwrap();
                        l.accepted.push(a.task);
                        l.accepted_at.push((sent, Instant::now()));
                    }
                    Ok(Ok(_)) => l.lock().unwrap().refused += 1,
                    Ok(Err(_)) | Err(_) => client = None,
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    (load, handle)
}

/// The first submit sent after `since` and accepted: how long after `since` its answer came.
async fn first_accepted_after(load: &Mutex<Load>, since: Instant, within: Duration) -> Duration {
    let began = Instant::now();
    while began.elapsed() < within {
        if let Some((_, answered)) = load
            .lock()
            .unwrap()
            .accepted_at
            .iter()
            .find(|(sent, _)| *sent > since)
        {
            return *answered - since;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no submit accepted within {within:?} of the failover");
}

/// Pool counters equal what the ACTIVE reservations hold, and reserved budgets what the open
/// ledger cycles add up to, in one snapshot of the primary (the node's own counter check).
async fn assert_counters_hold(conninfo: &str, when: &str) {
    let mut db = Db::open(&DbConfig::new(conninfo)).await.unwrap();
    let drift = db.check_counters().await.unwrap();
    assert!(
        drift.pools.is_empty() && drift.budgets.is_empty(),
        "{when}: counters drifted from the reservations: {drift:?}"
    );
}

async fn sql(conninfo: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_tasks_outlive_planned_and_unplanned_failovers() {
    let ha = tokio::task::spawn_blocking(AutoFailover::start)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let ha = Arc::new(Mutex::new(ha));
    let primary = ha.lock().unwrap().primary().expect("a primary");
    // The setting the node relies on: commits wait for the standby.
    let names = {
        let ha = ha.lock().unwrap();
        ha.sql(
            ha.node_port(primary),
            spindle_control::autofailover::DBNAME,
            "SHOW synchronous_standby_names",
        )
        .unwrap()
    };
    assert!(
        names.contains("ANY 1"),
        "synchronous replication: {names:?}"
    );
    // A connection that lands on the standby is refused, naming why.
    let standby = ha.lock().unwrap().node_conninfo(1 - primary);
    let refused = Db::open(&DbConfig::new(standby))
        .await
        .err()
        .expect("refused");
    assert!(refused.to_string().contains("standby"), "{refused}");

    let conninfo = ha.lock().unwrap().conninfo();
    let (m, admin) = mock(30).await;
    // Two data nodes: after the primary's loss the new one has no standby until the old one
    // is back, and commits without one (pg_auto_failover's wait_primary). A node that required
    // a synchronous standby would pause paid work until then; this one goes on (and warns).
    let config = node("ha-node", &m, "").toml();
    let mut daemon = start_on(&conninfo, &config).await;
    let pid = daemon.child.id();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (load, loader) = steady_load(daemon.addr, stop.clone());
    first_accepted_after(&load, Instant::now(), Duration::from_secs(30)).await;

    // Planned.
    let h = ha.clone();
    tokio::task::spawn_blocking(move || h.lock().unwrap().perform_failover())
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let at = Instant::now();
    let planned = first_accepted_after(&load, at, Duration::from_secs(60)).await;
    eprintln!("planned failover: first accepted submit {planned:?} after it completed");
    assert_counters_hold(&conninfo, "after the planned failover").await;
    let now_primary = ha.lock().unwrap().primary();
    assert_eq!(now_primary, Some(1 - primary), "the standby took over");

    // Unplanned: the primary's machine lost, then back as the standby.
    let rounds: usize = std::env::var("SPINDLE_FAILOVERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut times = Vec::new();
    for round in 0..rounds {
        let h = ha.clone();
        let (killed, at) = tokio::task::spawn_blocking(move || {
            let mut ha = h.lock().unwrap();
            let p = ha
                .wait_stable(Duration::from_secs(120))
                .unwrap_or_else(|e| panic!("{e}"));
            ha.kill(p).unwrap();
            // From when the primary is gone (the kill itself takes a few ms).
            (p, Instant::now())
        })
        .await
        .unwrap();
        let took = first_accepted_after(&load, at, Duration::from_secs(90)).await;
        eprintln!("unplanned failover {round}: first accepted submit {took:?} after the kill");
        times.push(took);
        assert_counters_hold(&conninfo, &format!("after unplanned failover {round}")).await;
        let h = ha.clone();
        tokio::task::spawn_blocking(move || {
            let mut ha = h.lock().unwrap();
            ha.restart(killed).unwrap();
            ha.wait_stable(Duration::from_secs(120))
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .await
        .unwrap();
    }
    times.sort();
    eprintln!(
        "unplanned failovers: {} — kill to first accepted submit: median {:?}, max {:?}",
        times.len(),
        times[times.len() / 2],
        times[times.len() - 1]
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    loader.await.unwrap();

    // The same process served throughout.
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "{}",
        daemon.log_tail(40)
    );
    assert_eq!(daemon.child.id(), pid);
    // Every task acknowledged exists and ends; nothing held; the provider saw each once.
    let (accepted, refused) = {
        let l = load.lock().unwrap();
        (l.accepted.clone(), l.refused)
    };
    eprintln!("{} accepted, {refused} refused", accepted.len());
    let keys: Vec<i64> = accepted.iter().map(|t| t.0 as i64).collect();
    let began = Instant::now();
    let open = loop {
        let client = sql(&conninfo).await;
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELED')), \
                 count(*) FROM task WHERE task_id = ANY ($1)",
                &[&keys],
            )
            .await
            .unwrap();
        let (open, found): (i64, i64) = (row.get(0), row.get(1));
        assert_eq!(found as usize, keys.len(), "every acknowledged task exists");
        if open == 0 || began.elapsed() > Duration::from_secs(90) {
            break open;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(open, 0, "{}", daemon.log_tail(40));
    let client = sql(&conninfo).await;
    let failed: i64 = client
        .query_one(
            "SELECT count(*) FROM task WHERE task_id = ANY ($1) AND state <> 'SUCCEEDED'",
            &[&keys],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(failed, 0, "every acknowledged task succeeded");
    assert_eq!(
        held(&client).await,
        (0, 0, 0),
        "counters equal what is held: nothing"
    );
    let stats = admin.mock_stats().await.unwrap();
    for name in ACCOUNTS {
        if let Some(s) = stats.accounts.get(name) {
            assert_eq!(
                (s.duplicate_keys, s.concurrency_violations, s.rpm_violations),
                (0, 0, 0),
                "{name}: {s:?}"
            );
        }
    }
    daemon.child.kill().ok();
}

/// With `require_sync_standby`, a node on a server that commits without a synchronous standby
/// does not serve, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_requiring_a_synchronous_standby_does_not_serve_without_one() {
    let test = TestDb::new().await;
    let config = common::NodeConfig::new()
        .tenants([1])
        .set("require_sync_standby", true)
        .toml();
    let mut starting = spawn_on(&test.config().conninfo, &config);
    assert!(
        starting
            .logs_before_serving("require_sync_standby is set", Duration::from_secs(30))
            .await,
        "the node named why it waits"
    );
    starting.kill();
}
