//! The protocol is not Rust-only: the Python client generated from the same schema submits,
//! reads a status, cancels and receives errors from a running spindled — also through a node
//! that does not serve its tenant and names the one that does, and (its cluster client) across
//! the death of the node that serves it.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{start, start_with};
use spindle_control::testing::TestDb;

/// `clients/python/check_client.py` against `addr` as tenant 1 with `extra` arguments: its
/// lines, after asserting that it succeeded.
fn check_client(addr: SocketAddr, extra: &[&str]) -> Vec<String> {
    python("check_client.py", addr, extra)
}

/// `clients/python/SCRIPT` against `addr` as tenant 1 with `extra` arguments: its lines, after
/// asserting that it succeeded.
fn python(script: &str, addr: SocketAddr, extra: &[&str]) -> Vec<String> {
    let script = format!(
        "{}/../../clients/python/{script}",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(addr.ip().to_string())
        .arg(addr.port().to_string())
        .arg("1")
        .arg("tenant-1-credential")
        .args(extra)
        .output()
        .expect("python3 runs (the test command installs the flatbuffers runtime)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python client failed:\n{stdout}\n{stderr}"
    );
    stdout.lines().map(str::to_string).collect()
}

/// The seven lines of a run that submits (one task, then a batch of three with a replay of
/// it), reads, and is refused four ways (a cancel of the ended task among them).
fn assert_checked(lines: &[String]) {
    let all = lines.join("\n");
    assert_eq!(lines.len(), 7, "{all}");
    assert!(lines[0].starts_with("submitted task "), "{all}");
    assert_eq!(lines[1], "batch of 3, replays 1");
    assert_eq!(lines[2], "status Succeeded");
    assert!(
        lines[3].starts_with("error NotFound: task ")
            && lines[3].ends_with(" not found or not cancelable"),
        "a task that has ended cannot be canceled: {all}"
    );
    assert!(
        lines[4].starts_with("error NotFound: task 999999999 not found"),
        "{all}"
    );
    assert!(
        lines[5].starts_with("error InvalidInput: tasks[0]: `input` is not one JSON value")
            || lines[5].starts_with("error InvalidInput: `input` is not one JSON value"),
        "{all}"
    );
    assert_eq!(lines[6], "error AuthFailed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_submits_reads_status_and_gets_errors() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    assert_checked(&check_client(daemon.addr, &[]));
}

/// The same over TLS: the nodes' ports speak TLS (`[tls]`) and ask for client certificates
/// (`client_ca_file`); the client (Python's own `ssl`) trusts their certificate, checks it
/// names the address it connects to — the redirect's too, when the node it asks sends it to
/// the one that serves its tenant — and presents its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_speaks_tls_to_a_node_whose_port_does() {
    let test = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let (section, ca) = common::node_tls(dir.path());
    let (clients_ca, cert, key) = common::client_ca(dir.path());
    let config = |node: &str| {
        let named =
            common::CONFIG.replace("node_id = \"test-node\"", &format!("node_id = \"{node}\""));
        format!(
            "{named}{section}client_ca_file = {:?}\n",
            clients_ca.display().to_string()
        )
    };
    // A owns every partition once it serves; B, started after, sends tenants to A.
    let daemon = start_with(&test, &config("node-a")).await;
    let ca = ca.display().to_string();
    let b = start_with(&test, &config("node-b")).await;
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let lines = check_client(
        b.addr,
        &[
            "--cluster",
            "--tls-ca",
            &ca,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ],
    );
    assert_eq!(lines.first().map(String::as_str), Some("served by node-a"));
    assert_checked(&lines[1..]);
    // Without TLS the node says so, and the client raises it.
    let script = format!(
        "{}/../../clients/python/check_client.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(daemon.addr.ip().to_string())
        .arg(daemon.addr.port().to_string())
        .args(["1", "tenant-1-credential"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("this node's port speaks TLS"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_follows_a_node_that_names_another() {
    let test = TestDb::new().await;
    let config = |node: &str| {
        common::CONFIG.replace("node_id = \"test-node\"", &format!("node_id = \"{node}\""))
    };
    // A owns every partition once it serves; B, started after, sends tenants to A.
    let _a = start_with(&test, &config("node-a")).await;
    let b = start_with(&test, &config("node-b")).await;
    let lines = check_client(b.addr, &["--cluster"]);
    assert_eq!(lines.first().map(String::as_str), Some("served by node-a"));
    assert_checked(&lines[1..]);
}

/// Events through the Python client: a task's states in order up to its end, then a
/// subscription to the ended task refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_follows_a_tasks_events_to_its_end() {
    let test = TestDb::new().await;
    // Tasks run ~1 s at the local provider: the subscription comes while the task is live.
    let daemon = start_with(&test, &common::config_scaled("0.05", "")).await;
    let lines = python("check_events.py", daemon.addr, &[]);
    assert_eq!(lines.len(), 4, "{lines:?}");
    let states: Vec<&str> = lines[0]
        .strip_prefix("events ")
        .unwrap_or_else(|| panic!("{lines:?}"))
        .split(' ')
        .collect();
    assert_eq!(states.last(), Some(&"Succeeded"), "{lines:?}");
    assert!(states.contains(&"Running"), "{lines:?}");
    assert!(lines[1].ends_with("at 100 True"), "{lines:?}");
    assert_eq!(lines[2], "error NotFound");
    assert_eq!(lines[3], "error EventsNotRead");
}

/// Two nodes on one PostgreSQL, leases of 1.5 s: the Python cluster client (seeds A and B) is
/// served by A, A is killed (-9), and its next submit is accepted by B once B holds the
/// partition; the submit from before the kill, sent again, is a replay of the same task, both
/// tasks complete, and a task subscribed to on A, running there when A died, ends SUCCEEDED
/// on B and its end reaches the subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_cluster_client_fails_over_when_its_node_dies() {
    let test = TestDb::new().await;
    // Tasks run ~3 s at the local provider: the watched one is running when A dies.
    let config = |node: &str| {
        common::config_scaled("0.1", "lease_ms = 1500")
            .replace("node_id = \"test-node\"", &format!("node_id = \"{node}\""))
    };
    let mut a = start_with(&test, &config("node-a")).await;
    let b = start_with(&test, &config("node-b")).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../clients/python/check_failover.py"
    );
    let mut child = Command::new("python3")
        .arg(script)
        .args([
            "1",
            "tenant-1-credential",
            &a.addr.to_string(),
            &b.addr.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    // Its lines arrive on a channel, so that every wait for one is bounded.
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let mut next_line = async || {
        let line = tokio::time::timeout(Duration::from_secs(90), lines.recv())
            .await
            .unwrap_or_else(|_| panic!("no line from the script within 90 s after {seen:?}"));
        let line = line.unwrap_or_else(|| panic!("the script ended after {seen:?}"));
        seen.push(line.clone());
        line
    };
    assert_eq!(next_line().await, "served by node-a");
    assert_eq!(next_line().await, "ready");
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "go").unwrap();
    drop(stdin);
    assert_eq!(next_line().await, "served by node-b");
    assert_eq!(next_line().await, "failovers 1");
    assert_eq!(next_line().await, "replayed");
    assert_eq!(next_line().await, "status Succeeded");
    assert_eq!(next_line().await, "watched Succeeded");
    let tasks = next_line().await;
    let ids: Vec<i64> = tasks
        .strip_prefix("tasks ")
        .unwrap_or_else(|| panic!("{tasks}"))
        .split(' ')
        .map(|id| id.parse().unwrap())
        .collect();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sql = test.sql().await.unwrap();
    assert_eq!(common::wait_all_succeeded(&sql, &ids).await, 2);
    drop(b);
}

/// The wait a node tells, read through the Python client and checked against the queue
/// (`check_waits.py`): the same steady lane as `provider::the_expected_start_on_the_wire_…` —
/// eight provider slots of the mock always busy with jobs of a second — and the deepest task of
/// a batch starts within a quarter of what its admission and a read while it waited said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_reads_an_expected_start_that_holds() {
    let test = TestDb::new().await;
    let (m, _admin) = common::mock::mock(1_000).await;
    let config = common::mock::node_config("python-waits", &m, "").replace(
        "retry_backoff_max_ms = 200\n",
        "retry_backoff_max_ms = 200\ncost_calibration_samples = 0\n",
    );
    let daemon = start_with(&test, &config).await;
    let addr = daemon.addr;
    let lines = tokio::task::spawn_blocking(move || python("check_waits.py", addr, &[]))
        .await
        .unwrap();
    assert_eq!(lines, ["steady", "told on the wire", "started as told"]);
}
