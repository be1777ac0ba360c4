//! The node's listeners over TLS (`[tls]`): tenants submit, read and follow events through
//! the Rust and Python clients whichever shard's executor accepted their connections (a
//! connection's TLS session moves with it to its tenant's shard); requests pipelined right
//! behind the Hello are answered; a frame larger than a TLS record goes both ways; a client
//! that speaks the protocol without TLS is told the port speaks TLS, one that does not trust
//! the certificate refuses it on its own side; `/metrics` is HTTPS and nothing plain.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{node_tls, start_with, task, CONFIG};
use spindle_client::{Client, ClientError, Tls};
use spindle_control::testing::TestDb;
use spindle_core::{TaskState, TenantId};
use spindle_wire::{
    decode_response, Encoder, ErrorCode, FrameReader, Hello, Request, RequestFrame, Response,
    PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WITHIN: Duration = Duration::from_secs(30);

/// A node with `[tls]` (and `extra` settings) on a fresh database.
struct TlsNode {
    daemon: common::Daemon,
    /// The node's certificate, self-signed: what clients trust.
    ca: std::path::PathBuf,
    /// Where its certificate and key are (`node.pem`, `node.key`).
    dir: tempfile::TempDir,
    _test: TestDb,
}

async fn tls_node(extra: &str) -> TlsNode {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (section, ca) = node_tls(dir.path());
    let daemon = start_with(&test, &format!("{CONFIG}{extra}{section}")).await;
    TlsNode {
        daemon,
        ca,
        dir,
        _test: test,
    }
}

/// The node's certificate as the only root a client trusts.
fn trusting(ca: &std::path::Path) -> Tls {
    Tls::trusting_file(ca).unwrap()
}

fn client_config(ca: &std::path::Path) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    use rustls::pki_types::pem::PemObject;
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    Arc::new(config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_tenants_are_served_on_their_shards_and_plain_clients_are_told() {
    let node = tls_node("").await;
    let (daemon, ca) = (&node.daemon, node.ca.clone());
    let addr = daemon.addr.to_string();
    let tls = trusting(&ca);

    // Eight connections per tenant: the kernel spreads them over both shards' listeners, so
    // some are accepted by the shard that does not own their tenant and handed over with
    // their sessions (2^-16 that none is).
    let mut clients = Vec::new();
    for round in 0..8 {
        for (tenant, credential) in [(1, "tenant-1-credential"), (2, "tenant-2-credential")] {
            let client =
                Client::connect_with(&addr, TenantId(tenant), credential, WITHIN, Some(&tls))
                    .await
                    .unwrap_or_else(|e| panic!("round {round}, tenant {tenant}: {e}"));
            clients.push((tenant, client));
        }
    }
    let mut ids = Vec::new();
    for (i, (tenant, client)) in clients.iter().enumerate() {
        let a = client.submit(task(&format!("tls-{i}"))).await.unwrap();
        assert!(a.decision.is_accepted(), "tenant {tenant}: {a:?}");
        ids.push(a.task);
    }
    for ((tenant, client), id) in clients.iter().zip(&ids) {
        let done = common::poll_until(
            WITHIN,
            async || client.get(*id).await.unwrap().state,
            |s| *s == TaskState::Succeeded,
        )
        .await;
        assert_eq!(done, TaskState::Succeeded, "tenant {tenant}'s task {id}");
    }
    // Every connection was served on its tenant's shard (CONFIG: 8 partitions, 2 shards).
    let metrics = https_get(daemon.http, &ca, "/metrics").await.1;
    for shard in 0..2u32 {
        let owned = clients
            .iter()
            .filter(|(t, _)| spindle_node_base::config::shard_of(*t, 8, 2) == shard as usize)
            .count() as u64;
        let served = common::metric_sum(
            &metrics,
            &format!("spindle_connections_served_total{{shard=\"{shard}\"}}"),
        );
        assert_eq!(served, owned, "connections served on shard {shard}");
    }

    // A frame larger than a TLS record (16 KiB) each way: a batch of 600 tasks and its
    // answer; then events of a subscription.
    let (_, one) = &clients[0];
    let batch: Vec<_> = (0..600).map(|i| task(&format!("tls-batch-{i}"))).collect();
    let answers = one.submit_batch(batch).await.unwrap();
    assert_eq!(answers.len(), 600);
    assert!(answers.iter().all(|a| a.decision.is_accepted()));
    let watched = one.submit(task("tls-watched")).await.unwrap().task;
    one.subscribe(watched).await.unwrap();
    let mut states = Vec::new();
    while states.last() != Some(&TaskState::Succeeded) {
        let event = tokio::time::timeout(WITHIN, one.next_event())
            .await
            .expect("an event within 30 s")
            .expect("the connection stays up");
        if event.task == watched {
            states.push(event.state);
        }
    }

    // Without TLS, the node says what it wants, in a frame the client reads.
    match Client::connect(daemon.addr, TenantId(1), "tenant-1-credential").await {
        Err(ClientError::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::NotAuthenticated);
            assert!(e.message.contains("speaks TLS"), "{e:?}");
        }
        other => panic!("a plain client on a TLS port: {:?}", other.map(|_| ())),
    }
    // A certificate the client does not trust: refused on the client's side, naming why.
    let stranger = tempfile::tempdir().unwrap();
    let (_, other_ca) = node_tls(stranger.path());
    let refused = Client::connect_with(
        &addr,
        TenantId(1),
        "tenant-1-credential",
        WITHIN,
        Some(&trusting(&other_ca)),
    )
    .await
    .map(|_| ())
    .unwrap_err();
    // (Both certificates are rcgen's with one subject: the stranger's is taken for the issuer,
    // and its signature does not check out.)
    assert!(
        refused.to_string().contains("invalid peer certificate"),
        "{refused}"
    );
    // The certificate names localhost: reached by that name it checks out too.
    let by_name = format!("localhost:{}", daemon.addr.port());
    let named = Client::connect_with(
        &by_name,
        TenantId(2),
        "tenant-2-credential",
        WITHIN,
        Some(&tls),
    )
    .await
    .unwrap();
    assert_eq!(named.get(ids[1]).await.unwrap().state, TaskState::Succeeded);
    // A name the certificate does not carry is refused.
    let misnamed = tls.clone().server_name("elsewhere.example").unwrap();
    let e = Client::connect_with(
        &addr,
        TenantId(2),
        "tenant-2-credential",
        WITHIN,
        Some(&misnamed),
    )
    .await
    .map(|_| ())
    .unwrap_err();
    assert!(e.to_string().contains("not valid for name"), "{e}");

    // The cluster client over TLS.
    let cluster = spindle_client::ClusterClient::connect_with(
        std::slice::from_ref(&addr),
        TenantId(1),
        "tenant-1-credential",
        WITHIN,
        Some(tls.clone()),
    )
    .await
    .unwrap();
    assert_eq!(
        cluster.get(ids[0]).await.unwrap().state,
        TaskState::Succeeded
    );

    // The HTTP port: HTTPS, and a plain request gets no answer.
    let (status, body) = https_get(daemon.http, &ca, "/livez").await;
    assert_eq!(
        (status.as_str(), body.as_str()),
        ("HTTP/1.1 200 OK", "ok\n")
    );
    let mut plain = tokio::net::TcpStream::connect(daemon.http).await.unwrap();
    plain
        .write_all(b"GET /livez HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut text = Vec::new();
    let _ = tokio::time::timeout(WITHIN, plain.read_to_end(&mut text)).await;
    assert!(
        !String::from_utf8_lossy(&text).contains("200 OK"),
        "a plain request answered"
    );
}

/// Through a node that does not serve the tenant, over TLS: the redirect names the node that
/// does, and the client checks that node's certificate against the redirect's address; the
/// cluster client fails over to it the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_a_redirect_reaches_the_node_that_serves_the_tenant() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (section, ca) = node_tls(dir.path());
    let config = |node: &str| {
        let named = CONFIG.replace("node_id = \"test-node\"", &format!("node_id = \"{node}\""));
        format!("{named}{section}")
    };
    // A owns every partition once it serves; B, started after, sends tenants to A.
    let a = start_with(&test, &config("node-a")).await;
    let b = start_with(&test, &config("node-b")).await;
    let tls = trusting(&ca);
    let seed = b.addr.to_string();
    let client =
        Client::connect_cluster_with(&seed, TenantId(1), "tenant-1-credential", Some(&tls))
            .await
            .unwrap();
    assert_eq!(client.hello().node_id, "node-a");
    let id = client.submit(task("redirected")).await.unwrap().task;
    let cluster = spindle_client::ClusterClient::connect_with(
        &[seed, a.addr.to_string()],
        TenantId(1),
        "tenant-1-credential",
        WITHIN,
        Some(tls),
    )
    .await
    .unwrap();
    assert_eq!(cluster.client().await.unwrap().hello().node_id, "node-a");
    let done = common::poll_until(
        WITHIN,
        async || cluster.get(id).await.unwrap().state,
        |s| *s == TaskState::Succeeded,
    )
    .await;
    assert_eq!(done, TaskState::Succeeded);
}

/// mTLS: with `tls.client_ca_file` the client protocol's port serves only clients whose
/// certificate chains to that CA — one without a certificate, or with another CA's, is refused
/// in the handshake — while the HTTP port asks for none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_clients_holding_its_certificates_are_served() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (section, ca) = node_tls(dir.path());
    let (clients_ca, cert, key) = common::client_ca(dir.path());
    let section = format!(
        "{section}client_ca_file = {:?}\n",
        clients_ca.display().to_string()
    );
    let daemon = start_with(&test, &format!("{CONFIG}{section}")).await;
    let addr = daemon.addr.to_string();
    let with_cert = trusting(&ca).with_client_cert_files(&cert, &key).unwrap();
    let client = Client::connect_with(
        &addr,
        TenantId(1),
        "tenant-1-credential",
        WITHIN,
        Some(&with_cert),
    )
    .await
    .unwrap();
    let a = client.submit(task("mtls")).await.unwrap();
    assert!(a.decision.is_accepted());
    // No certificate: the node's alert ends the connection before the Hello is answered.
    let refused = Client::connect_with(
        &addr,
        TenantId(1),
        "tenant-1-credential",
        WITHIN,
        Some(&trusting(&ca)),
    )
    .await
    .map(|_| ())
    .unwrap_err();
    assert!(!matches!(refused, ClientError::Refused(_)), "{refused}");
    // Another CA's client certificate: refused the same way.
    let other = tempfile::tempdir().unwrap();
    let (_, other_cert, other_key) = common::client_ca(other.path());
    let stranger = trusting(&ca)
        .with_client_cert_files(&other_cert, &other_key)
        .unwrap();
    let refused = Client::connect_with(
        &addr,
        TenantId(1),
        "tenant-1-credential",
        WITHIN,
        Some(&stranger),
    )
    .await
    .map(|_| ())
    .unwrap_err();
    assert!(!matches!(refused, ClientError::Refused(_)), "{refused}");
    // The first client is served throughout; the HTTP port takes no client certificate.
    assert_eq!(client.get(a.task).await.unwrap().task, a.task);
    let (status, _) = https_get(daemon.http, &ca, "/livez").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
}

/// Requests written together with the client's last handshake message, in one segment, are
/// answered: the ciphertext that follows the handshake is kept for the connection's reads
/// (rustls, driven by hand here, sends what was written before the handshake ended right
/// behind its Finished).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sent_with_the_handshakes_last_message_are_answered() {
    use std::io::{Read, Write};
    let node = tls_node("").await;
    let (daemon, ca) = (&node.daemon, node.ca.clone());
    for round in 0..4 {
        let mut out = Vec::new();
        let mut encoder = Encoder::new();
        encoder.request(
            &RequestFrame {
                request_id: 1,
                body: Request::Hello(Hello {
                    protocol_version: PROTOCOL_VERSION,
                    tenant: TenantId(1),
                    credential: "tenant-1-credential".into(),
                    client_name: None,
                }),
            },
            &mut out,
        );
        for id in 2..=4 {
            encoder.request(
                &RequestFrame {
                    request_id: id,
                    body: Request::Get(spindle_core::TaskId(999_000 + id)),
                },
                &mut out,
            );
        }
        let mut conn =
            rustls::ClientConnection::new(client_config(&ca), "localhost".try_into().unwrap())
                .unwrap();
        conn.writer().write_all(&out).unwrap();
        let mut tcp = tokio::net::TcpStream::connect(daemon.addr).await.unwrap();
        let mut frames = FrameReader::new();
        let mut answers = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        let mut plain = vec![0u8; 64 * 1024];
        while answers.len() < 4 {
            let mut cipher = Vec::new();
            while conn.wants_write() {
                conn.write_tls(&mut cipher).unwrap();
            }
            tcp.write_all(&cipher).await.unwrap();
            let n = tokio::time::timeout(WITHIN, tcp.read(&mut buf))
                .await
                .expect("answers within 30 s")
                .unwrap();
            assert!(
                n > 0,
                "round {round}: closed after {} answers",
                answers.len()
            );
            let mut got = &buf[..n];
            while !got.is_empty() {
                conn.read_tls(&mut got).unwrap();
                conn.process_new_packets().unwrap();
            }
            while let Ok(n) = conn.reader().read(&mut plain) {
                if n == 0 {
                    break;
                }
                frames.extend(&plain[..n]);
            }
            while let Some(f) = frames.next_frame().unwrap() {
                answers.push(decode_response(f).unwrap());
            }
        }
        assert!(
            matches!(answers[0].body, Response::HelloOk(_)),
            "{:?}",
            answers[0]
        );
        let mut ids: Vec<u64> = answers[1..].iter().map(|a| a.request_id).collect();
        ids.sort_unstable();
        assert_eq!(ids, [2, 3, 4], "round {round}");
        for a in &answers[1..] {
            assert!(
                matches!(&a.body, Response::Error(e) if e.code == ErrorCode::NotFound),
                "{a:?}"
            );
        }
    }
}

/// A connection that has not said Hello within `hello_timeout_ms` (2 s by default) is closed —
/// over TLS, one that never starts its handshake too — while a connected tenant is served
/// throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_silent_past_the_hello_bound_is_closed() {
    let node = tls_node("").await;
    let (daemon, ca) = (&node.daemon, node.ca.clone());
    let started = std::time::Instant::now();
    let mut silent = tokio::net::TcpStream::connect(daemon.addr).await.unwrap();
    let served = Client::connect_with(
        &daemon.addr.to_string(),
        TenantId(1),
        "tenant-1-credential",
        WITHIN,
        Some(&trusting(&ca)),
    )
    .await
    .unwrap();
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(30), silent.read(&mut buf))
        .await
        .expect("closed within 30 s")
        .unwrap_or(0);
    let waited = started.elapsed();
    assert_eq!(n, 0, "the node wrote to a connection that never spoke");
    assert!(
        waited >= Duration::from_millis(1_900),
        "closed after {waited:?}, before the bound"
    );
    let a = served.submit(task("still-served")).await.unwrap();
    assert!(a.decision.is_accepted());
}

/// spindlectl reaches the admin API over HTTPS with `--tls-ca`; without it, or trusting
/// another certificate, it fails and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spindlectl_speaks_https_to_a_node_with_tls() {
    let node = tls_node(&common::admin_tokens()).await;
    let (daemon, ca) = (&node.daemon, node.ca.clone());
    let ca = ca.display().to_string();
    let (ok, out) = common::ctl(
        daemon.http,
        common::VIEWER_TOKEN,
        &["--json", "--tls-ca", &ca, "policy", "show"],
    );
    assert!(ok, "{out}");
    let policy: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(policy["effective"]["aging"].is_object(), "{out}");
    let (ok, _) = common::ctl(daemon.http, common::VIEWER_TOKEN, &["policy", "show"]);
    assert!(!ok, "plain HTTP to an HTTPS port");
    let stranger = tempfile::tempdir().unwrap();
    let (_, other) = node_tls(stranger.path());
    let (ok, _) = common::ctl(
        daemon.http,
        common::VIEWER_TOKEN,
        &["--tls-ca", &other.display().to_string(), "policy", "show"],
    );
    assert!(!ok, "a certificate spindlectl does not trust");
}

/// A renewed certificate is in use for new connections within a few seconds of its files
/// changing (`tls::RELOAD_EVERY`), without a restart; connections already up keep going; a key
/// that is not the certificate's (one file renewed before the other) leaves the one in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_served_without_a_restart() {
    let node = tls_node("").await;
    let (daemon, served, dir) = (&node.daemon, node.ca.clone(), node.dir.path());
    let addr = daemon.addr.to_string();
    // What clients trust of the first certificate: a copy (its file is about to be replaced).
    let first = dir.join("first.pem");
    std::fs::copy(&served, &first).unwrap();
    let old = trusting(&first);
    let up = Client::connect_with(
        &addr,
        TenantId(1),
        "tenant-1-credential",
        WITHIN,
        Some(&old),
    )
    .await
    .unwrap();

    // The renewal, made aside: first only its certificate is put in place (its key not yet).
    let renewed = tempfile::tempdir().unwrap();
    let (_, second) = node_tls(renewed.path());
    let key_now = std::fs::read(dir.join("node.key")).unwrap();
    std::fs::copy(&second, dir.join("node.pem.new")).unwrap();
    std::fs::rename(dir.join("node.pem.new"), dir.join("node.pem")).unwrap();
    // Until the key follows, the node keeps the first certificate: a client trusting it still
    // connects, across more than one reload. (Each check with a fresh client configuration: a
    // client resumes its earlier TLS sessions, which are not certificate checks.)
    let started = std::time::Instant::now();
    while started.elapsed() < 2 * spindle_node_shard::tls::RELOAD_EVERY {
        Client::connect_with(
            &addr,
            TenantId(2),
            "tenant-2-credential",
            WITHIN,
            Some(&trusting(&first)),
        )
        .await
        .unwrap_or_else(|e| panic!("after {:?} of a half-renewed pair: {e}", started.elapsed()));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(std::fs::read(dir.join("node.key")).unwrap(), key_now);
    std::fs::copy(renewed.path().join("node.key"), dir.join("node.key.new")).unwrap();
    std::fs::rename(dir.join("node.key.new"), dir.join("node.key")).unwrap();

    let reached = common::poll_until(
        3 * spindle_node_shard::tls::RELOAD_EVERY,
        async || {
            Client::connect_with(
                &addr,
                TenantId(2),
                "tenant-2-credential",
                WITHIN,
                Some(&trusting(&second)),
            )
            .await
            .is_ok()
        },
        |ok| *ok,
    )
    .await;
    assert!(reached, "the renewed certificate was not served");
    let e = Client::connect_with(
        &addr,
        TenantId(2),
        "tenant-2-credential",
        WITHIN,
        Some(&trusting(&first)),
    )
    .await
    .map(|_| ())
    .unwrap_err();
    assert!(e.to_string().contains("invalid peer certificate"), "{e}");
    // The connection made before the renewal is served as before.
    let a = up.submit(task("across-the-renewal")).await.unwrap();
    assert!(a.decision.is_accepted());
}

/// A GET over HTTPS trusting `ca`: (status line, body).
async fn https_get(
    addr: std::net::SocketAddr,
    ca: &std::path::Path,
    path: &str,
) -> (String, String) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let stream = tokio_rustls::TlsConnector::from(client_config(ca))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    common::http_get_on(stream, path).await
}

/// Past `connections_max` a TLS connection is told `Overloaded`, naming the bound, after its
/// handshake, and counted; a flood of them is handshaken with no faster than
/// `TLS_REFUSALS_PER_S` a shard (the rest closed at once, counted too); a place given back
/// serves the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_bound_a_tls_connection_is_told_why_at_a_bounded_rate() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (section, ca) = node_tls(dir.path());
    let config = format!(
        "{}{section}",
        common::config_scaled("0.0001", "connections_max = 1")
    );
    let daemon = start_with(&test, &config).await;
    let tls = trusting(&ca);
    let addr = daemon.addr.to_string();
    let connect = || {
        Client::connect_with(
            &addr,
            TenantId(1),
            "tenant-1-credential",
            WITHIN,
            Some(&tls),
        )
    };
    let held = connect().await.unwrap();
    let told = |outcome: Result<Client, ClientError>| match outcome {
        Err(ClientError::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::Overloaded, "{e:?}");
            assert!(e.message.contains("most client connections (1)"), "{e:?}");
            true
        }
        Err(_) => false,
        Ok(_) => panic!("a connection past the bound was served"),
    };
    assert!(told(connect().await), "one refusal, told why over TLS");

    // A flood: every shard handshakes with a second's worth at once, then its rate.
    const FLOOD: usize = 150;
    let started = std::time::Instant::now();
    let outcomes = futures_util::future::join_all((0..FLOOD).map(|_| connect())).await;
    let elapsed = started.elapsed().as_secs_f64();
    let told_why = outcomes.into_iter().map(&told).filter(|t| *t).count();
    let shards = 2.0;
    let rate = spindle_node_shard::server::TLS_REFUSALS_PER_S as f64;
    let most = (shards * rate * (1.0 + elapsed)).ceil() as usize;
    assert!(told_why >= 1, "none of the flood told why");
    assert!(
        told_why <= most,
        "{told_why} of {FLOOD} handshaken in {elapsed:.2} s: at most {most} at {rate}/s a shard"
    );
    let count = async |series: &str| {
        common::metric_sum(&https_get(daemon.http, &ca, "/metrics").await.1, series)
    };
    assert_eq!(
        count("spindle_connections_refused_total").await,
        1 + FLOOD as u64
    );
    drop(held);
    let open = common::poll_until(
        WITHIN,
        async || count("spindle_connections_open").await,
        |n| *n == 0,
    )
    .await;
    assert_eq!(open, 0, "the place given back");
    let client = connect().await.unwrap();
    let a = client.submit(task("after")).await.unwrap();
    assert!(a.decision.is_accepted(), "{a:?}");
}
