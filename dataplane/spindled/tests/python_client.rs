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

/// `clients/python/tests/check_client.py` against `addr` as tenant 1 with `extra` arguments:
/// its lines, after asserting that it succeeded.
fn check_client(addr: SocketAddr, extra: &[&str]) -> Vec<String> {
    python("check_client.py", addr, extra)
}

/// `clients/python/tests/SCRIPT`, run by the installed SDK, against `addr` as tenant 1 with
/// `extra` arguments: its lines, after asserting that it succeeded.
fn python(script: &str, addr: SocketAddr, extra: &[&str]) -> Vec<String> {
    let out = common::python::script(script)
        .arg(addr.ip().to_string())
        .arg(addr.port().to_string())
        .arg("1")
        .arg("tenant-1-credential")
        .args(extra)
        .output()
        .expect("the SDK's python runs");
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
    let out = common::python::script("check_client.py")
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

/// The SDK's asyncio client (`check_async.py`): twenty submits awaited at once on one
/// connection each get their own answer, a batch's replay is the first task, a task is
/// followed by its events to Succeeded and read right after as the event said (the node tells
/// an end once it is stored: before, the read found it still RUNNING in PostgreSQL), refusals
/// raise their codes, and an unread event past the client's bound closes the connection with
/// EventsNotRead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_asyncio_client_pipelines_follows_and_is_refused() {
    let test = TestDb::new().await;
    // Tasks run ~1 s at the local provider: the followed one is live when it is subscribed.
    let daemon = start_with(&test, &common::config_scaled("0.05", "")).await;
    let lines = python("check_async.py", daemon.addr, &[]);
    assert_eq!(
        lines,
        [
            "pipelined 20 submits",
            "batch of 3, replays 1",
            "followed to Succeeded",
            "status Succeeded as told",
            "error NotFound",
            "error NotFound",
            "error EventsNotRead",
        ]
    );
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
    let mut child = common::python::script("check_failover.py")
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
        .expect("the SDK's python runs");
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
    let config = common::mock::node("python-waits", &m, "")
        .set("cost_calibration_samples", 0)
        .toml();
    let daemon = start_with(&test, &config).await;
    let addr = daemon.addr;
    let lines = tokio::task::spawn_blocking(move || python("check_waits.py", addr, &[]))
        .await
        .unwrap();
    assert_eq!(lines, ["steady", "told on the wire", "started as told"]);
}

/// The README's quickstart, as a new user runs it: its three lines (a node with the example
/// configuration on its embedded PostgreSQL, `pip install clients/python` into a virtualenv,
/// the example script), from the repository's root, with one change — the node is this test
/// build's spindled, not a release build compiled on the spot. The script's task is accepted,
/// followed through its states and ends Succeeded with its result printed.
#[test]
fn the_readmes_quickstart_runs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = readme
        .split("## Quickstart")
        .nth(1)
        .expect("README.md has a Quickstart section");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the quickstart has a sh block");
    let lines: Vec<&str> = block.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 3, "{block}");
    let node = lines[0]
        .strip_prefix("cargo run --release -p spindled --bin spindled -- ")
        .and_then(|l| l.strip_suffix(" &"))
        .unwrap_or_else(|| {
            panic!(
                "the first line starts the node in the background: {}",
                lines[0]
            )
        });
    let dir = tempfile::tempdir().unwrap();
    let log = std::fs::File::create(dir.path().join("spindled.log")).unwrap();
    let mut spindled = Command::new(env!("CARGO_BIN_EXE_spindled"))
        .args(node.split_whitespace())
        .current_dir(&root)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let shell = |line: &str| {
        Command::new("sh")
            .args(["-c", line])
            .current_dir(&root)
            .output()
            .unwrap()
    };
    let installed = shell(lines[1]);
    let ran = installed.status.success().then(|| shell(lines[2]));
    // The node stops on SIGTERM, and its embedded PostgreSQL with it.
    let _ = Command::new("kill")
        .args(["-TERM", &spindled.id().to_string()])
        .status();
    let _ = spindled.wait();
    let node_log = std::fs::read_to_string(dir.path().join("spindled.log")).unwrap_or_default();
    assert!(
        installed.status.success(),
        "{}: {}",
        lines[1],
        String::from_utf8_lossy(&installed.stderr)
    );
    let ran = ran.unwrap();
    let out = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success(),
        "{}: {out}{}\nnode: {node_log}",
        lines[2],
        String::from_utf8_lossy(&ran.stderr)
    );
    let printed: Vec<&str> = out.lines().collect();
    assert!(
        printed[0].contains(" accepted, expected to start in "),
        "{out}"
    );
    assert!(
        printed.iter().any(|l| l.starts_with("Running ")),
        "a state on the way is printed: {out}"
    );
    assert!(
        printed.last().unwrap().starts_with("Succeeded; result: "),
        "the end and its result are printed: {out}"
    );
}
