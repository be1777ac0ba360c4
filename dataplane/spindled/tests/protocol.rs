//! The daemon facing bad input: every malformed frame gets an error frame naming the problem,
//! only framing errors close the connection, and other connections are served throughout.

mod common;

use std::time::Duration;

use common::{start, task, wait_for};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::{TaskState, TenantId};
use spindle_wire::testkit::{get_payload, malformed};
use spindle_wire::{
    decode_response, Encoder, ErrorCode, FrameReader, Hello, Request, RequestFrame, Response,
    ResponseFrame, PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A raw connection that can send anything and read whole answers.
struct Raw {
    stream: TcpStream,
    frames: FrameReader,
}

/// A Hello for `tenant`, framed, as request 1.
fn hello_frame(tenant: u32, credential: &str) -> Vec<u8> {
    let mut out = Vec::new();
    Encoder::new().request(
        &RequestFrame {
            request_id: 1,
            body: Request::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                tenant: TenantId(tenant),
                credential: credential.into(),
                client_name: None,
            }),
        },
        &mut out,
    );
    out
}

impl Raw {
    async fn connect(addr: std::net::SocketAddr, tenant: u32, credential: &str) -> Raw {
        let mut raw = Raw {
            stream: TcpStream::connect(addr).await.unwrap(),
            frames: FrameReader::new(),
        };
        raw.stream
            .write_all(&hello_frame(tenant, credential))
            .await
            .unwrap();
        assert!(matches!(
            raw.read().await.unwrap().body,
            Response::HelloOk(_)
        ));
        raw
    }

    /// The next answer, or `None` at end of stream (bounded by a 10 s timeout).
    async fn read(&mut self) -> Option<ResponseFrame> {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(f) = self.frames.next_frame().unwrap() {
                return Some(decode_response(f).unwrap());
            }
            let n = tokio::time::timeout(Duration::from_secs(10), self.stream.read(&mut buf))
                .await
                .expect("an answer within 10 s")
                .unwrap_or(0);
            if n == 0 {
                return None;
            }
            self.frames.extend(&buf[..n]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_are_answered_and_other_connections_keep_working() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let bystander = Client::connect(daemon.addr, TenantId(2), "tenant-2-credential")
        .await
        .unwrap();
    for case in malformed() {
        let mut raw = Raw::connect(daemon.addr, 1, "tenant-1-credential").await;
        raw.stream.write_all(&case.frame).await.unwrap();
        let answer = raw
            .read()
            .await
            .unwrap_or_else(|| panic!("{}: no answer", case.name));
        let Response::Error(e) = answer.body else {
            panic!("{}: expected an error frame, got {answer:?}", case.name);
        };
        assert_eq!(e.code, case.code, "{}: {e}", case.name);
        assert!(
            !e.message.is_empty(),
            "{}: the error names the problem",
            case.name
        );
        if case.closes {
            assert!(
                raw.read().await.is_none(),
                "{}: the connection closes",
                case.name
            );
        } else {
            // The same connection still answers a valid request.
            let mut out = Vec::new();
            spindle_wire::frame::write_frame(&mut out, &get_payload(12345));
            raw.stream.write_all(&out).await.unwrap();
            let next = raw.read().await.unwrap();
            assert!(
                matches!(&next.body, Response::Error(e) if e.code == ErrorCode::NotFound),
                "{}: {next:?}",
                case.name
            );
        }
        // And the daemon serves everyone else.
        let a = bystander
            .submit(task(&format!("after {}", case.name)))
            .await
            .unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
    }
}

/// A request refused for what it asks (a field out of range, an input that is not JSON) is
/// answered under its own request id, so that a client with requests pipelined matches the
/// error to the request; the pipelined requests around it are answered as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_is_answered_under_its_own_id() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let mut raw = Raw::connect(daemon.addr, 1, "tenant-1-credential").await;
    let mut out = Vec::new();
    let mut bad_fps = task("bad-fps");
    bad_fps.spec.fps = 0;
    let mut bad_input = task("bad-input");
    bad_input.input = Some(r#"{"prompt": "unclosed"#.into());
    let mut good = task("good");
    good.input = Some(r#"{"prompt":"a kite"}"#.into());
    let mut encoder = Encoder::new();
    for (id, t) in [(7, bad_fps), (8, bad_input), (9, good)] {
        let frame = RequestFrame {
            request_id: id,
            body: Request::Submit(t),
        };
        encoder.request(&frame, &mut out);
    }
    raw.stream.write_all(&out).await.unwrap();
    let mut answers = std::collections::BTreeMap::new();
    for _ in 0..3 {
        let a = raw.read().await.expect("an answer");
        answers.insert(a.request_id, a.body);
    }
    let code = |id| match &answers[&id] {
        Response::Error(e) => Some(e.code),
        _ => None,
    };
    assert_eq!(code(7), Some(ErrorCode::OutOfRange), "{answers:?}");
    assert_eq!(code(8), Some(ErrorCode::InvalidInput), "{answers:?}");
    assert!(
        matches!(&answers[&9], Response::Admission(a) if a.decision.is_accepted()),
        "{answers:?}"
    );
}

/// A cancel is stored before it is answered; a task that ends on the node while its cancel is
/// being stored is answered "has ended" (not canceled), and ends as it did. Here a test
/// transaction holds the task's row, so the cancel waits in PostgreSQL while the task finishes
/// (its finish report queues behind the cancel on the same pipeline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_ends_while_its_cancel_is_stored_is_answered_has_ended() {
    let test = TestDb::new().await;
    // Tasks take ~1.5 s at the local provider: time to hold the row and send the cancel.
    let config = common::config_scaled("0.05", "");
    let daemon = common::start_with(&test, &config).await;
    let client = std::sync::Arc::new(
        Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
            .await
            .unwrap(),
    );
    let a = client.submit(task("ending")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
    let (mut holder, connection) =
        tokio_postgres::connect(&test.config().conninfo, tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM task WHERE task_id = $1 FOR UPDATE",
        &[&(a.task.0 as i64)],
    )
    .await
    .unwrap();
    let canceling = {
        let client = client.clone();
        tokio::spawn(async move { client.cancel(a.task).await })
    };
    // The task ends on the node (it leaves the node's live tasks) while the cancel waits.
    let live = common::poll_until(
        Duration::from_secs(10),
        async || {
            let (_, metrics) = common::http_get(daemon.http, "/metrics").await;
            common::metric_sum(&metrics, "spindle_live_tasks")
        },
        |&live| live == 0,
    )
    .await;
    assert_eq!(live, 0, "the task did not end");
    assert!(
        !canceling.is_finished(),
        "the cancel was answered before it was stored"
    );
    tx.commit().await.unwrap();
    match canceling.await.unwrap() {
        Err(spindle_client::ClientError::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::NotFound, "{e}");
            assert!(e.message.contains("has ended"), "{e}");
        }
        other => panic!("expected \"has ended\", got {other:?}"),
    }
    wait_for(&client, a.task, TaskState::Succeeded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_racing_dispatch_never_runs_a_canceled_task() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..100 {
        let a = client.submit(task(&format!("race{i}"))).await.unwrap();
        // Cancel at once: the task may be queued, being claimed, or already running.
        let canceled = client.cancel(a.task).await;
        tasks.push((a.task, canceled.is_ok()));
    }
    let sql = test.sql().await.unwrap();
    for (t, canceled) in tasks {
        if canceled {
            // Canceled tasks end CANCELED and never SUCCEEDED.
            wait_for(&client, t, TaskState::Canceled).await;
        } else {
            wait_for(&client, t, TaskState::Succeeded).await;
        }
    }
    let active = common::active_reservations(&sql).await;
    assert_eq!(active, 0, "every reservation was released");
}

/// Frames sent right behind the Hello, in the same write, are served: the connection carries
/// what it read past the Hello when it moves to the shard owning its tenant. Several
/// connections per tenant, so that some are accepted by the other shard's executor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_pipelined_behind_the_hello_are_answered() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    for i in 0..8u64 {
        for (tenant, credential) in [(1u32, "tenant-1-credential"), (2, "tenant-2-credential")] {
            let mut stream = TcpStream::connect(daemon.addr).await.unwrap();
            let mut out = hello_frame(tenant, credential);
            // Two lookups of a task that does not exist, in the same write as the Hello.
            spindle_wire::frame::write_frame(&mut out, &get_payload(900 + i));
            spindle_wire::frame::write_frame(&mut out, &get_payload(1900 + i));
            stream.write_all(&out).await.unwrap();
            let mut raw = Raw {
                stream,
                frames: FrameReader::new(),
            };
            let hello = raw.read().await.unwrap();
            assert!(matches!(hello.body, Response::HelloOk(_)), "{hello:?}");
            for _ in 0..2 {
                let next = raw.read().await.expect("answered, not closed");
                assert!(
                    matches!(&next.body, Response::Error(e) if e.code == ErrorCode::NotFound),
                    "tenant {tenant}, connection {i}: {next:?}"
                );
            }
        }
    }
}

/// Cancels and status reads that cost PostgreSQL a call are held to their tenant's rates: past
/// its burst, tenant 1 is answered `RateLimited`, told when to try again, and nothing of the
/// refused cancel is stored; tenant 2's cancels and reads go on, and a live task's status
/// (answered from memory) is never counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_past_its_cancel_and_read_rates_is_refused_and_the_others_are_not() {
    let test = TestDb::new().await;
    // Tasks that run for their modelled time (seconds): each stays live to be canceled.
    let config = common::config_scaled("1.0", "").replace(
        "credential = \"tenant-1-credential\"",
        "credential = \"tenant-1-credential\"\ncancel_per_minute = 20\nstore_reads_per_minute = 1",
    );
    let daemon = common::start_with(&test, &config).await;
    let (one, two) = common::both_tenants(&daemon).await;
    let mut tasks = Vec::new();
    for i in 0..10 {
        tasks.push(one.submit(task(&format!("c{i}"))).await.unwrap().task);
    }
    // 20 a minute, 2 at once: past the first two, one more every 3 s.
    let started = std::time::Instant::now();
    let mut refused = Vec::new();
    for &t in &tasks {
        match one.cancel(t).await {
            Ok(state) => assert_eq!(state, TaskState::Canceled),
            Err(spindle_client::ClientError::Refused(e)) => {
                assert_eq!(e.code, ErrorCode::RateLimited, "{e}");
                assert!(
                    e.message.contains(
                        "tenant 1's cancels are limited to 20 a minute, 2 at once: the next in "
                    ),
                    "{}",
                    e.message
                );
                refused.push(t);
            }
            Err(e) => panic!("cancel of {t}: {e}"),
        }
    }
    let elapsed = started.elapsed().as_secs();
    let accepted = tasks.len() - refused.len();
    assert!(
        (2..=3 + elapsed as usize / 3).contains(&accepted),
        "{accepted} cancels accepted in {elapsed} s"
    );
    assert!(!refused.is_empty(), "no cancel refused in {elapsed} s");
    let sql = test.sql().await.unwrap();
    for &t in &refused {
        // Live (its status from memory, however many reads) and not marked canceled.
        for _ in 0..3 {
            assert_ne!(one.get(t).await.unwrap().state, TaskState::Canceled);
        }
        let row = sql
            .query_one(
                "SELECT cancel_requested FROM task WHERE task_id = $1",
                &[&(t.0 as i64)],
            )
            .await
            .unwrap();
        assert!(!row.get::<_, bool>(0), "{t}: a refused cancel was stored");
    }
    // One read a minute of tasks no longer live: a task the store has not got is such a read.
    let absent = spindle_core::TaskId(1 << 40);
    match one.get(absent).await {
        Err(spindle_client::ClientError::Refused(e)) => assert_eq!(e.code, ErrorCode::NotFound),
        other => panic!("{other:?}"),
    }
    match one.get(absent).await {
        Err(spindle_client::ClientError::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::RateLimited, "{e}");
            assert!(
                e.message.contains("status reads from PostgreSQL"),
                "{}",
                e.message
            );
        }
        other => panic!("{other:?}"),
    }
    // Tenant 2 has rates of its own (the defaults).
    for i in 0..4 {
        let t = two.submit(task(&format!("t{i}"))).await.unwrap().task;
        assert_eq!(two.cancel(t).await.unwrap(), TaskState::Canceled);
        match two.get(absent).await {
            Err(spindle_client::ClientError::Refused(e)) => {
                assert_eq!(e.code, ErrorCode::NotFound)
            }
            other => panic!("{other:?}"),
        }
    }
    let limited =
        |command: &str| format!("spindle_commands_limited_total{{command=\"{command}\"}}");
    assert_eq!(
        common::metric(&daemon, &limited("cancel")).await,
        refused.len() as u64
    );
    assert_eq!(common::metric(&daemon, &limited("store_read")).await, 1);
}

/// A tenant whose requests keep being refused — here, submits past its rate, sent as fast as
/// they are answered — is suspended by the tenant breaker: its connection is told why and
/// closed, its Hellos are refused until the cooldown ends, and then it is served again.
/// Another tenant is served throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_refused_too_fast_is_suspended_for_a_cooldown_and_the_others_are_not() {
    let test = TestDb::new().await;
    let config = format!(
        "{}\n[breaker]\nrefusals_per_s = 20\nburst_s = 1\ncooldown_ms = 3000\ncooldown_max_ms = 6000\n",
        common::CONFIG.replace(
            "credential = \"tenant-1-credential\"",
            "credential = \"tenant-1-credential\"\nsubmit_per_minute = 1"
        )
    );
    let daemon = common::start_with(&test, &config).await;
    let (one, two) = common::both_tenants(&daemon).await;
    let suspended = |e: &spindle_wire::WireError| {
        e.code == ErrorCode::TenantSuspended && e.message.contains("tenant 1 is suspended for")
    };
    let started = std::time::Instant::now();
    let mut rejected = 0u64;
    let ended = loop {
        assert!(
            rejected < 10_000,
            "not suspended after {rejected} rejections"
        );
        match one.submit(task(&format!("flood{rejected}"))).await {
            Ok(a) if a.decision.is_accepted() => {}
            Ok(_) => rejected += 1,
            Err(e) => break e,
        }
    };
    let elapsed = started.elapsed().as_secs_f64();
    match &ended {
        spindle_client::ClientError::Refused(e) => assert!(suspended(e), "{e}"),
        // The node's last word can lose a race with the client's writer meeting the closed
        // socket; the Hello below is refused with it either way.
        spindle_client::ClientError::Closed => {}
        other => panic!("{other}"),
    }
    // Twenty refusals at once, then twenty a second.
    assert!(
        rejected >= 20 && rejected as f64 <= 21.0 + 20.0 * elapsed,
        "suspended after {rejected} rejections in {elapsed:.2} s"
    );
    match Client::connect(daemon.addr, TenantId(1), "tenant-1-credential").await {
        Err(spindle_client::ClientError::Refused(e)) => assert!(suspended(&e), "{e}"),
        Ok(_) => panic!("a suspended tenant's Hello was accepted"),
        Err(other) => panic!("{other}"),
    }
    assert_eq!(
        common::metric(&daemon, "spindle_breaker_trips_total").await,
        1
    );
    // The other tenant is served.
    let a = two.submit(task("meanwhile")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
    wait_for(&two, a.task, TaskState::Succeeded).await;
    // After the cooldown the tenant is served again (its submits still past its rate).
    let again = common::poll_until(
        Duration::from_secs(15),
        async || Client::connect(daemon.addr, TenantId(1), "tenant-1-credential").await,
        Result::is_ok,
    )
    .await
    .expect("served again after the cooldown");
    let a = again.submit(task("after")).await.unwrap();
    assert!(!a.decision.is_accepted(), "{a:?}");
    assert_eq!(
        common::metric(&daemon, "spindle_tenants_suspended").await,
        0
    );
}

/// `connections_max`: past the node's bound a connection is refused `Overloaded`, naming the
/// bound, and counted; the connections served hold their places whichever shard serves them
/// (handed over or not), and give them back when they end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_nodes_bound_are_refused_and_their_places_come_back() {
    let test = TestDb::new().await;
    let daemon = common::start_with(
        &test,
        &common::config_scaled("0.0001", "connections_max = 4"),
    )
    .await;
    let overloaded =
        async || match Client::connect(daemon.addr, TenantId(1), "tenant-1-credential").await {
            Err(spindle_client::ClientError::Refused(e)) => {
                assert_eq!(e.code, ErrorCode::Overloaded, "{e:?}");
                assert!(e.message.contains("most client connections (4)"), "{e:?}");
            }
            Err(other) => panic!("refused without a word: {other}"),
            Ok(_) => panic!("a connection past the bound was served"),
        };
    // Both tenants: the kernel spreads connections over the shards, so some are handed over.
    let mut clients = Vec::new();
    for i in 0..4 {
        let (tenant, credential) = [(1, "tenant-1-credential"), (2, "tenant-2-credential")][i % 2];
        let client = Client::connect(daemon.addr, TenantId(tenant), credential)
            .await
            .unwrap();
        let a = client.submit(task(&format!("held-{i}"))).await.unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
        clients.push(client);
    }
    overloaded().await;
    assert_eq!(common::metric(&daemon, "spindle_connections_open").await, 4);
    assert_eq!(
        common::metric(&daemon, "spindle_connections_refused_total").await,
        1
    );
    // Two end: their places come back, two new ones are served, the next is refused again.
    clients.truncate(2);
    let open = common::poll_until(
        Duration::from_secs(10),
        async || common::metric(&daemon, "spindle_connections_open").await,
        |n| *n == 2,
    )
    .await;
    assert_eq!(open, 2, "places given back");
    for i in 0..2 {
        let client = Client::connect(daemon.addr, TenantId(2), "tenant-2-credential")
            .await
            .unwrap_or_else(|e| panic!("a place freed, connection {i}: {e}"));
        let a = client.submit(task(&format!("again-{i}"))).await.unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
        clients.push(client);
    }
    overloaded().await;
    assert_eq!(
        common::metric(&daemon, "spindle_connections_refused_total").await,
        2
    );
    // The ones held were served throughout.
    let a = clients[0].submit(task("still")).await.unwrap();
    wait_for(&clients[0], a.task, TaskState::Succeeded).await;
}

/// `connection_rate_max`: new connections are taken no faster than the rate (a second's worth
/// at once), the rest waiting in the kernel's backlog — none refused. One shard, so that the
/// kernel's spread of connections over shards cannot hide a burst of one too many: at 4/s, 12
/// connections take at least 2 s (4 at once, then 8 at 4 a second); a token held while the
/// shard waited for its next connection lets them through sooner, by as long as the node had
/// been up before the first (up to a quarter second: 1.98 s seen).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_connections_are_taken_no_faster_than_the_configured_rate() {
    let test = TestDb::new().await;
    let config = common::config_scaled("0.0001", "connection_rate_max = 4")
        .replace("shards = 2", "shards = 1");
    let daemon = common::start_with(&test, &config).await;
    let started = std::time::Instant::now();
    for i in 0..12 {
        Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
            .await
            .unwrap_or_else(|e| panic!("connection {i}: {e}"));
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_secs(2),
        "12 connections in {elapsed:?} at 4/s"
    );
    assert_eq!(
        common::metric(&daemon, "spindle_connections_refused_total").await,
        0
    );
}

/// A cluster client refused for want of a place (`Overloaded`) tries again, pausing, within its
/// failover window: it connects once a place frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_client_refused_for_want_of_a_place_connects_once_one_frees() {
    let test = TestDb::new().await;
    let daemon = common::start_with(
        &test,
        &common::config_scaled("0.0001", "connections_max = 1"),
    )
    .await;
    let holder = Client::connect(daemon.addr, TenantId(2), "tenant-2-credential")
        .await
        .unwrap();
    let seeds = [daemon.addr.to_string()];
    let connecting = tokio::spawn(async move {
        spindle_client::ClusterClient::connect(&seeds, TenantId(1), "tenant-1-credential").await
    });
    // Refused at least once while the holder keeps the one place.
    let refused = common::poll_until(
        Duration::from_secs(10),
        async || common::metric(&daemon, "spindle_connections_refused_total").await,
        |n| *n >= 1,
    )
    .await;
    assert!(refused >= 1, "never refused");
    assert!(
        !connecting.is_finished(),
        "gave up (or got in) while no place was free"
    );
    drop(holder);
    let cluster = tokio::time::timeout(Duration::from_secs(30), connecting)
        .await
        .expect("connected within its window")
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let a = cluster.submit(task("in")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
}

/// A shard that cannot accept — the process is out of file descriptors — pauses between tries
/// (`ACCEPT_ERROR_PAUSE`, 50 ms) instead of retrying at once, and so does the HTTP port's loop
/// (on the control plane's thread, beside the pipelines): while connections wait in the
/// backlog each logs the failure about twenty times a second, not thousands (nor, as the HTTP
/// loop did, spins without a word), and once descriptors are there again both serve. The
/// daemon starts with its usual limit and serves a task (so every connection it opens at start
/// is open); the test then lowers the soft limit (`prlimit`, util-linux) to three above what
/// it has open, and puts it back after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_out_of_file_descriptors_pauses_its_accepts_and_serves_once_some_are_free() {
    let test = TestDb::new().await;
    let config = common::CONFIG.replace("shards = 2", "shards = 1");
    let daemon = common::start_with(&test, &config).await;
    let before = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let a = before.submit(task("before")).await.unwrap();
    wait_for(&before, a.task, TaskState::Succeeded).await;
    let pid = daemon.child.id();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let usual: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a descriptor limit")
        .split_whitespace()
        .skip(3)
        .take(2)
        .collect();
    let set_limit = |soft: &str, hard: &str| {
        let set = std::process::Command::new("prlimit")
            .arg(format!("--pid={pid}"))
            .arg(format!("--nofile={soft}:{hard}"))
            .output()
            .expect("prlimit (util-linux) runs");
        assert!(
            set.status.success(),
            "prlimit --nofile={soft}:{hard}: {}",
            String::from_utf8_lossy(&set.stderr)
        );
    };
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    // The soft limit only: raising a hard limit back takes a privilege (CAP_SYS_RESOURCE).
    set_limit(&(open + 3).to_string(), usual[1]);
    // More connections than descriptors left: the first few are taken (and wait for their
    // Hello), the rest stay in the kernel's backlog.
    let mut waiting = Vec::new();
    for _ in 0..16 {
        waiting.push(TcpStream::connect(daemon.addr).await.unwrap());
    }
    // As many to the HTTP port as there are descriptors left, so that one waits there too
    // whichever loop takes the last ones.
    for _ in 0..4 {
        waiting.push(TcpStream::connect(daemon.http).await.unwrap());
    }
    // Failed accepts logged so far: the client port's, the HTTP port's.
    let failures = || {
        let log = daemon.log_tail(usize::MAX);
        let http = log.lines().filter(|l| l.contains("http accept: ")).count();
        let client = log.lines().filter(|l| l.contains(" accept: ")).count() - http;
        (client, http)
    };
    let first = common::poll_until(
        Duration::from_secs(5),
        async || failures(),
        |&(client, http)| client > 0 && http > 0,
    )
    .await;
    assert!(
        first.0 > 0 && first.1 > 0,
        "failed accepts logged (client port, HTTP port): {first:?}: {}",
        daemon.log_tail(20)
    );
    // A window shorter than the Hello timeout of the connections taken (10 s) and than the
    // HTTP port's 5 s for a request, so nothing frees a descriptor inside it.
    let window = Duration::from_secs(1);
    tokio::time::sleep(window).await;
    let now = failures();
    for (port, during) in [("client", now.0 - first.0), ("HTTP", now.1 - first.1)] {
        assert!(
            (1..=40).contains(&during),
            "{during} failed accepts on the {port} port logged in {window:?} (one per 50 ms \
             pause expected): {}",
            daemon.log_tail(5)
        );
    }
    // Descriptors there again, the node takes connections again.
    drop(waiting);
    set_limit(usual[0], usual[1]);
    let (head, _) = tokio::time::timeout(
        Duration::from_secs(30),
        common::http_get(daemon.http, "/livez"),
    )
    .await
    .expect("the HTTP port serves once descriptors are there");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let client = tokio::time::timeout(
        Duration::from_secs(30),
        Client::connect(daemon.addr, TenantId(1), "tenant-1-credential"),
    )
    .await
    .expect("a connection served once descriptors are there")
    .unwrap();
    let a = client.submit(task("after")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
}
