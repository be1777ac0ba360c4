//! The protocol is not Rust-only: the Python client generated from the same schema submits,
//! reads a status and receives errors from a running spindled — also through a node that does
//! not serve its tenant and names the one that does.

mod common;

use std::net::SocketAddr;
use std::process::Command;

use common::{start, start_with};
use spindle_control::testing::TestDb;

/// `clients/python/check_client.py` against `addr` as tenant 1 with `extra` arguments: its
/// lines, after asserting that it succeeded.
fn check_client(addr: SocketAddr, extra: &[&str]) -> Vec<String> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../clients/python/check_client.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(addr.ip().to_string())
        .arg(addr.port().to_string())
        .arg("1")
        .arg("one")
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

/// The five lines of a run that submits, reads, and is refused three ways.
fn assert_checked(lines: &[String]) {
    let all = lines.join("\n");
    assert_eq!(lines.len(), 5, "{all}");
    assert!(lines[0].starts_with("submitted task "), "{all}");
    assert_eq!(lines[1], "status Succeeded");
    assert!(
        lines[2].starts_with("error NotFound: task 999999999 not found"),
        "{all}"
    );
    assert!(
        lines[3].starts_with("error InvalidInput: tasks[0]: `input` is not one JSON value")
            || lines[3].starts_with("error InvalidInput: `input` is not one JSON value"),
        "{all}"
    );
    assert_eq!(lines[4], "error AuthFailed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_submits_reads_status_and_gets_errors() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    assert_checked(&check_client(daemon.addr, &[]));
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
