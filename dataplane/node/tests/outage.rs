//! PostgreSQL goes away under a running node: paid work is refused as overloaded (not
//! buffered), readiness drops, and when PostgreSQL returns the node resumes by itself.

mod common;

use std::time::Duration;

use common::{http_get, poll_until, start_on, task, wait_for, CONFIG};
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
    let client = Client::connect(daemon.addr, TenantId(1), "one")
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
