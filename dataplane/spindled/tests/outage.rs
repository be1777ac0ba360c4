//! PostgreSQL goes away under a running node: paid work is refused as overloaded (not
//! buffered), readiness drops, and when PostgreSQL returns the node resumes by itself.

mod common;

use std::time::Duration;

use common::{config_scaled, http_get, poll_until, start_on, task, wait_for, CONFIG};
use spindle_client::Client;
use spindle_control::{EmbeddedOptions, EmbeddedPostgres};
use spindle_core::{Decision, TaskState, TenantId};

async fn readyz(addr: std::net::SocketAddr) -> String {
    http_get(addr, "/readyz").await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_rejects_paid_work_and_the_node_resumes_by_itself() {
    let mut pg = EmbeddedPostgres::start(EmbeddedOptions::default()).unwrap();
    let daemon = start_on(&pg.conninfo("postgres"), CONFIG).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = client.submit(task("before")).await.unwrap();
    wait_for(&client, a.task, TaskState::Succeeded).await;
    assert_eq!(readyz(daemon.http).await, "HTTP/1.1 200 OK");

    pg.stop_server().unwrap();
    // Refused as overloaded — or, when the submit went out on a connection that had not yet
    // seen the server go, answered as in doubt after the node failed to read its rows back.
    match client.submit(task("during")).await {
        Ok(refused) => {
            assert_eq!(
                refused.decision,
                Decision::RejectPlatformOverloaded,
                "{refused:?}"
            );
            assert!(refused.reason.unwrap_or_default().contains("unavailable"));
        }
        Err(spindle_client::ClientError::Refused(e)) => {
            assert_eq!(e.code, spindle_wire::ErrorCode::Unavailable, "{e:?}");
            assert!(e.message.contains("may have committed"), "{e:?}");
        }
        Err(e) => panic!("{e}"),
    }
    assert_eq!(
        readyz(daemon.http).await,
        "HTTP/1.1 503 Service Unavailable"
    );

    pg.start_server().unwrap();
    // Ready again by itself, before any client sends anything (bounded wait: 30 s): a node
    // that waited for work to prove PostgreSQL back would stay out of its load balancer.
    let ready = poll_until(
        Duration::from_secs(30),
        async || readyz(daemon.http).await,
        |status| status == "HTTP/1.1 200 OK",
    )
    .await;
    assert_eq!(ready, "HTTP/1.1 200 OK", "30 s after PostgreSQL returned");
    // The node reconnects on its own (bounded wait): a submit is accepted and runs again.
    let mut tries = 0;
    let accepted = poll_until(
        Duration::from_secs(30),
        async || {
            tries += 1;
            client.submit(task(&format!("after{tries}"))).await.unwrap()
        },
        |a| a.decision.is_accepted(),
    )
    .await;
    assert!(accepted.decision.is_accepted(), "30 s: {accepted:?}");
    wait_for(&client, accepted.task, TaskState::Succeeded).await;
    assert_eq!(readyz(daemon.http).await, "HTTP/1.1 200 OK");
}

/// A cancel while PostgreSQL is away cannot be stored, so it is refused as `Unavailable` and
/// cancels nothing: the task runs on in the node. Asked again once PostgreSQL is back, it is
/// stored and holds: the task ends CANCELED in PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_that_cannot_be_stored_is_refused_and_cancels_nothing() {
    let mut pg = EmbeddedPostgres::start(EmbeddedOptions::default()).unwrap();
    // The local provider runs a task for about 6 s.
    let config = config_scaled("0.2", "");
    let daemon = start_on(&pg.conninfo("postgres"), &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = client.submit(task("long")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
    wait_for(&client, a.task, TaskState::Running).await;

    pg.stop_server().unwrap();
    match client.cancel(a.task).await {
        Err(spindle_client::ClientError::Refused(e)) => {
            assert_eq!(e.code, spindle_wire::ErrorCode::Unavailable, "{e:?}");
            assert!(e.message.contains("not stored"), "{e:?}");
        }
        other => panic!("a cancel that could not be stored: {other:?}"),
    }
    let status = client.get(a.task).await.unwrap();
    assert_eq!(status.state, TaskState::Running, "nothing canceled");

    pg.start_server().unwrap();
    // The pipeline reconnects with its next call (bounded wait).
    let canceled = poll_until(
        Duration::from_secs(30),
        async || client.cancel(a.task).await,
        Result::is_ok,
    )
    .await;
    assert!(canceled.is_ok(), "{canceled:?}");
    let (sql, connection) =
        tokio_postgres::connect(&pg.conninfo("postgres"), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let key = a.task.0 as i64;
    let ended = common::wait_reading(
        &sql,
        &format!("SELECT count(*) FROM task WHERE task_id = {key} AND state = 'CANCELED'"),
        1,
    )
    .await;
    assert_eq!(ended, 1, "{}", daemon.log_tail(20));
}

/// PostgreSQL crashes (immediate shutdown, as a power loss) while the HTTP provider runs the
/// node's jobs, and jobs end while it is away: once it is back, every task reaches its final
/// state, no slot or reservation stays held and no job was submitted twice. The reports made
/// during the outage apply in the order they were made (a finish never overtakes the RUNNING
/// that failed before it, which left a task RUNNING with its slot held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_crash_with_provider_jobs_in_flight_leaves_every_task_final_and_no_slot_held() {
    use common::mock::{mock, mock_total, ACCOUNTS};
    let mut pg = EmbeddedPostgres::start(EmbeddedOptions::default()).unwrap();
    let (m, admin) = mock(400).await;
    let config = common::mock::node_config("crash", &m, "");
    let daemon = start_on(&pg.conninfo("postgres"), &config).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let batch: Vec<_> = (0..24).map(|i| task(&format!("crash{i}"))).collect();
    let ids: Vec<i64> = client
        .submit_batch(batch)
        .await
        .unwrap()
        .into_iter()
        .map(|a| {
            assert!(a.decision.is_accepted(), "{a:?}");
            a.task.0 as i64
        })
        .collect();
    // Jobs running at the provider, then the crash; jobs end while PostgreSQL is away.
    let running = poll_until(
        Duration::from_secs(20),
        async || mock_total(&admin, |s| s.accepted).await,
        |&n| n >= 4,
    )
    .await;
    assert!(running >= 4, "{}", daemon.log_tail(20));
    pg.crash_server().unwrap();
    let completed = mock_total(&admin, |s| s.completed).await;
    let ended = poll_until(
        Duration::from_secs(20),
        async || mock_total(&admin, |s| s.completed).await,
        |&n| n >= completed + 4,
    )
    .await;
    assert!(ended >= completed + 4, "jobs ended during the outage");
    pg.start_server().unwrap();

    let (sql, connection) =
        tokio_postgres::connect(&pg.conninfo("postgres"), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let open = poll_until(
        Duration::from_secs(90),
        async || common::mock::unfinished(&sql, &ids).await,
        |&n| n == 0,
    )
    .await;
    let stuck = sql
        .query(
            "SELECT task_id, state FROM task WHERE task_id = ANY ($1)
                AND state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELED', 'EXPIRED')",
            &[&ids],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| format!("{}:{}", r.get::<_, i64>(0), r.get::<_, String>(1)))
        .collect::<Vec<_>>();
    assert_eq!(open, 0, "not final: {stuck:?}\n{}", daemon.log_tail(40));
    let held = poll_until(
        Duration::from_secs(30),
        async || {
            let (reservations, used, _) = common::mock::held(&sql).await;
            (reservations, used)
        },
        |&held| held == (0, 0),
    )
    .await;
    assert_eq!(
        held,
        (0, 0),
        "reservations and slots held after every task ended"
    );
    let stats = admin.mock_stats().await.unwrap();
    for a in ACCOUNTS {
        let s = &stats.accounts[a];
        assert_eq!(s.duplicate_keys, 0, "{a}: a job submitted twice: {s:?}");
        assert_eq!(s.concurrency_violations, 0, "{a}: {s:?}");
    }
}

/// (status line, body) of a GET, or empty strings while nothing listens on `addr`.
async fn try_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    match tokio::net::TcpStream::connect(addr).await {
        Ok(stream) => common::http_get_on(stream, path).await,
        Err(_) => (String::new(), String::new()),
    }
}

/// The seconds a starting node says it has waited (`… (attempt N, S s): …`), 0 if it says none.
fn waited_s(readyz: &str) -> u64 {
    readyz
        .split_once(", ")
        .and_then(|(_, rest)| rest.split_once(" s)"))
        .and_then(|(s, _)| s.parse().ok())
        .unwrap_or(0)
}

/// A node started while its PostgreSQL is down waits for it — alive, not ready, saying why —
/// and serves once the server is up, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_before_its_postgres_serves_once_the_server_is_up() {
    let mut pg = EmbeddedPostgres::start(EmbeddedOptions::default()).unwrap();
    let conninfo = pg.conninfo("postgres");
    pg.stop_server().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let http: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let config = CONFIG.replace(
        "http_listen = \"127.0.0.1:0\"",
        &format!("http_listen = \"{http}\""),
    );
    let starting = common::spawn_on(&conninfo, &config);
    // Longer than the ~9 s of connection attempts after which a node used to exit.
    let waiting = poll_until(
        Duration::from_secs(30),
        async || try_get(http, "/readyz").await,
        |(_, body)| waited_s(body) >= 10,
    )
    .await;
    assert_eq!(waiting.0, "HTTP/1.1 503 Service Unavailable", "{waiting:?}");
    assert!(
        waiting
            .1
            .starts_with("not ready: starting: waiting for PostgreSQL"),
        "{waiting:?}"
    );
    assert_eq!(try_get(http, "/livez").await.0, "HTTP/1.1 200 OK");

    pg.start_server().unwrap();
    let daemon = starting.serving(Duration::from_secs(60)).await;
    let ready = poll_until(
        Duration::from_secs(30),
        async || readyz(daemon.http).await,
        |status| status == "HTTP/1.1 200 OK",
    )
    .await;
    assert_eq!(ready, "HTTP/1.1 200 OK");
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = client.submit(task("after the wait")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
    wait_for(&client, a.task, TaskState::Succeeded).await;
}
