//! Hostile clients against a real node: nothing big is buffered before a Hello, and sockets
//! that never say Hello cannot keep the clients that do from being served.

mod common;

use std::time::Duration;

use common::{config_scaled, metric, poll_until, start_with, task};
use spindle_client::Client;
use spindle_control::testing::TestDb;
use spindle_core::TenantId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The daemon's resident memory, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// 400 connections that each send a partial frame and then nothing: the node holds at most a
/// few KiB for each (a Hello is tiny; a frame past 4 KiB before one is a framing error and the
/// connection closes at once). Before, each such connection held its read buffer and up to
/// 1 MiB of the frame: 71 → 500 MiB for 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_before_their_hello_hold_a_few_kib_each() {
    let test = TestDb::new().await;
    let daemon = start_with(
        &test,
        &config_scaled(
            "0.0001",
            "unauthenticated_max = 1000\nunauthenticated_per_address_max = 1000\n\
             hello_timeout_ms = 60000",
        ),
    )
    .await;
    let pid = daemon.child.id();
    // One served connection first: whatever a shard allocates once is there before we count.
    let warm = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    assert!(warm
        .submit(task("warm"))
        .await
        .unwrap()
        .decision
        .is_accepted());
    let before = rss_kib(pid);
    let mut held = Vec::new();
    for _ in 0..400 {
        let mut s = tokio::net::TcpStream::connect(daemon.addr).await.unwrap();
        // A frame of 4,000 bytes announced (within the pre-Hello bound), 3,000 of them sent.
        s.write_all(&4_000u32.to_le_bytes()).await.unwrap();
        s.write_all(&[0xAB; 3_000]).await.unwrap();
        held.push(s);
    }
    let greeting = poll_until(
        Duration::from_secs(20),
        async || metric(&daemon, "spindle_connections_greeting").await,
        |&n| n >= 400,
    )
    .await;
    assert_eq!(greeting, 400, "every connection is greeting");
    let after = rss_kib(pid);
    let per = after.saturating_sub(before) as f64 / 400.0;
    assert!(
        per <= 16.0,
        "{per:.1} KiB per connection before its Hello ({before} → {after} KiB)"
    );
    // One that announces a 1 MiB frame before its Hello is told so and closed at once.
    let mut big = tokio::net::TcpStream::connect(daemon.addr).await.unwrap();
    big.write_all(&(1u32 << 20).to_le_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), big.read_to_end(&mut answer))
        .await
        .expect("closed")
        .unwrap();
    assert!(
        String::from_utf8_lossy(&answer).contains("exceeds the maximum of 4096 before a Hello"),
        "{answer:?}"
    );
    drop(held);
    assert!(warm
        .submit(task("still"))
        .await
        .unwrap()
        .decision
        .is_accepted());
}

/// Twice `connections_max` sockets that connect and say nothing: the clients that say Hello
/// are served all the same — each new connection past the greeting budget closes the oldest
/// still greeting — and the idle ones are closed (counted as evicted). Before, 520 idle
/// sockets against a bound of 500 had legitimate clients told `Overloaded` (2 of 12 got in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_unauthenticated_sockets_cannot_keep_clients_out() {
    let test = TestDb::new().await;
    let daemon = start_with(
        &test,
        &config_scaled(
            "0.0001",
            "connections_max = 20\nunauthenticated_max = 20\n\
             unauthenticated_per_address_max = 20\nhello_timeout_ms = 60000",
        ),
    )
    .await;
    let mut idle = Vec::new();
    for _ in 0..40 {
        idle.push(tokio::net::TcpStream::connect(daemon.addr).await.unwrap());
    }
    // Each shard greets at most its half of the budget: the rest were closed already.
    let seen = poll_until(
        Duration::from_secs(20),
        async || {
            metric(&daemon, "spindle_connections_greeting").await
                + metric(&daemon, "spindle_connections_evicted_total").await
        },
        |&n| n >= 40,
    )
    .await;
    // (An evicted connection is counted as such at once, and leaves the greeting gauge when
    // its task ends: the sum may pass 40 for a moment.)
    assert!(seen >= 40, "greeting and evicted: {seen}");
    assert!(metric(&daemon, "spindle_connections_greeting").await <= 20);
    let evicted_before = metric(&daemon, "spindle_connections_evicted_total").await;
    // Twelve clients, one after another, each served while the idle sockets sit there.
    let mut served = Vec::new();
    for i in 0..12 {
        let c = Client::connect(
            daemon.addr,
            TenantId(1 + i % 2),
            ["tenant-1-credential", "tenant-2-credential"][i as usize % 2],
        )
        .await
        .unwrap_or_else(|e| panic!("client {i} was not served: {e}"));
        let a = c.submit(task(&format!("c{i}"))).await.unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
        served.push(c);
    }
    // A client landing on a shard whose greeting places are all held closed the oldest idle
    // socket there; once greeted it gave its place back, so the next one found room.
    let evicted = metric(&daemon, "spindle_connections_evicted_total").await;
    assert!(
        evicted > evicted_before,
        "{evicted_before} evicted before the clients, {evicted} after"
    );
    // Those evicted were closed: reads end.
    let mut closed = 0;
    for s in &mut idle {
        let mut b = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(100), s.read(&mut b)).await {
            closed += 1;
        }
    }
    assert!(closed > 20, "{closed} idle sockets closed");
}

/// 100 connections subscribe to queued tasks and close: within a second their subscriptions
/// are gone and their places among the served connections free — before, both were held until
/// each task changed state (its frame queue kept alive by the subscription, and with it the
/// connection's writer and socket).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_connections_subscriptions_and_place_go_at_once() {
    let test = TestDb::new().await;
    // One slot of each provider account: the rest of the tasks stay queued for minutes.
    let daemon = start_with(&test, &config_scaled("10", "provider_concurrency = 1")).await;
    let client = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
        .await
        .unwrap();
    let mut queued = Vec::new();
    for i in 0..10 {
        let a = client.submit(task(&format!("q{i}"))).await.unwrap();
        assert!(a.decision.is_accepted(), "{a:?}");
        queued.push(a.task);
    }
    let open_before = metric(&daemon, "spindle_connections_open").await;
    let mut subscribers = Vec::new();
    for i in 0..100 {
        let c = Client::connect(daemon.addr, TenantId(1), "tenant-1-credential")
            .await
            .unwrap();
        c.subscribe(queued[i % queued.len()]).await.unwrap();
        subscribers.push(c);
    }
    let held = poll_until(
        Duration::from_secs(5),
        async || metric_sum_of(&daemon, "spindle_subscriptions").await,
        |&n| n >= 100,
    )
    .await;
    assert!(held >= 100, "{held} subscriptions");
    assert_eq!(
        metric(&daemon, "spindle_connections_open").await,
        open_before + 100
    );
    drop(subscribers);
    let closed = std::time::Instant::now();
    let left = poll_until(
        Duration::from_secs(5),
        async || {
            (
                metric_sum_of(&daemon, "spindle_subscriptions").await,
                metric(&daemon, "spindle_connections_open").await,
            )
        },
        |&(subs, open)| subs == 0 && open == open_before,
    )
    .await;
    assert_eq!(left, (0, open_before), "after {:?}", closed.elapsed());
    assert!(
        closed.elapsed() <= Duration::from_secs(1),
        "released after {:?}",
        closed.elapsed()
    );
}

/// The sum over shards of a per-shard gauge.
async fn metric_sum_of(daemon: &common::Daemon, name: &str) -> u64 {
    let (_, text) = common::http_get(daemon.http, "/metrics").await;
    common::metric_sum(&text, name)
}

/// The HTTP port keeps a connection alive across requests, answers `HEAD`, and reads a body
/// sent in chunks (the old hand-written server closed after one request, had no `HEAD`, and
/// read a chunked body as empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_port_keeps_connections_alive_answers_head_and_reads_chunked_bodies() {
    let test = TestDb::new().await;
    let daemon = start_with(
        &test,
        &format!("{}{}", common::CONFIG, common::admin_tokens()),
    )
    .await;
    let mut s = tokio::net::TcpStream::connect(daemon.http).await.unwrap();
    // Two requests on one connection, each answered.
    for path in ["/livez", "/readyz"] {
        s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let (status, body) = read_response(&mut s).await;
        assert_eq!(status, "HTTP/1.1 200 OK", "{path}");
        assert!(!body.is_empty());
    }
    // HEAD: the head and no body.
    s.write_all(b"HEAD /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("content-length: "), "{head}");
    // A chunked body reaches the admin API whole (read as empty, it was refused as not
    // `{tasks, reason}`).
    let body = r#"{"tasks": [7], "reason": "sent in chunks"}"#;
    let (a, b) = body.split_at(10);
    let chunked = format!(
        "POST /admin/v1/tasks/cancel HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\n\
         transfer-encoding: chunked\r\ncontent-type: application/json\r\n\r\n\
         {:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
        common::OPERATOR_TOKEN,
        a.len(),
        b.len()
    );
    s.write_all(chunked.as_bytes()).await.unwrap();
    let (status, answer) = read_response(&mut s).await;
    assert_eq!(status, "HTTP/1.1 200 OK", "{answer}");
    assert!(answer.contains('7'), "{answer}");
}

/// `/livez` answers every probe while 2,000 idle connections sit on the HTTP port (each new
/// connection past the bound closes the oldest idle one). Before, with 1,100 idle connections
/// it answered 1 of 20 probes: a kubelet would have restarted a healthy node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_are_answered_with_two_thousand_idle_http_connections_open() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, common::CONFIG).await;
    let mut idle = Vec::new();
    for _ in 0..2_000 {
        idle.push(tokio::net::TcpStream::connect(daemon.http).await.unwrap());
    }
    for i in 0..20 {
        let (status, body) = common::http_get(daemon.http, "/livez").await;
        assert_eq!(
            (status.as_str(), body.as_str()),
            ("HTTP/1.1 200 OK", "ok\n"),
            "probe {i}"
        );
    }
    assert!(metric(&daemon, "spindle_http_connections_evicted_total").await >= 20);
    drop(idle);
}

/// One response off `s`: its status line and its body (by its content-length).
async fn read_response(s: &mut tokio::net::TcpStream) -> (String, String) {
    let head = read_head(s).await;
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.unwrap();
    (
        head.lines().next().unwrap_or("").to_string(),
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// A response's head off `s`, up to its blank line.
async fn read_head(s: &mut tokio::net::TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte))
            .await
            .expect("an answer")
            .unwrap();
        assert_eq!(n, 1, "closed: {}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Wrong Hellos as fast as one address can send them (over a thousand a second): after a
/// burst the address is refused unchecked for a cooldown, so its credential checks stay at a
/// few a second; each failure is counted. Before, ~1,200 guesses a second were checked, with no
/// slow-down, metric or log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessing_credentials_from_one_address_is_cut_to_a_few_checks_a_second() {
    let test = TestDb::new().await;
    let daemon = start_with(&test, common::CONFIG).await;
    let started = std::time::Instant::now();
    let run = Duration::from_secs(2);
    let mut guessers = Vec::new();
    for g in 0..16 {
        let addr = daemon.addr;
        guessers.push(tokio::spawn(async move {
            let (mut checked, mut refused, mut sent) = (0u64, 0u64, 0u64);
            while started.elapsed() < run {
                sent += 1;
                match Client::connect(addr, TenantId(1), &format!("guess-{g}-{sent}")).await {
                    Err(spindle_client::ClientError::Refused(e)) => {
                        if e.message.contains("too many failed Hellos") {
                            refused += 1;
                        } else {
                            assert!(e.message.contains("tenant 1 refused"), "{e:?}");
                            checked += 1;
                        }
                    }
                    other => panic!("a guess: {:?}", other.map(|_| ())),
                }
            }
            (checked, refused, sent)
        }));
    }
    let (mut checked, mut refused, mut sent) = (0, 0, 0);
    for g in guessers {
        let (c, r, s) = g.await.unwrap();
        (checked, refused, sent) = (checked + c, refused + r, sent + s);
    }
    let elapsed = started.elapsed().as_secs_f64();
    assert!(
        sent as f64 / elapsed >= 500.0,
        "{sent} guesses in {elapsed:.1} s: the test did not guess fast"
    );
    assert!(
        checked as f64 <= 10.0 * elapsed.ceil() + 10.0,
        "{checked} of {sent} guesses checked in {elapsed:.1} s"
    );
    assert_eq!(checked + refused, sent);
    assert_eq!(
        metric(&daemon, "spindle_hello_guarded_total{outcome=\"failed\"}").await,
        checked
    );
    assert_eq!(
        metric(&daemon, "spindle_hello_guarded_total{outcome=\"refused\"}").await,
        refused
    );
    // The address is refused unchecked while it cools down, the right credential too.
    match Client::connect(daemon.addr, TenantId(1), "tenant-1-credential").await {
        Err(spindle_client::ClientError::Refused(e)) => {
            assert!(e.message.contains("too many failed Hellos"), "{e:?}")
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
}
