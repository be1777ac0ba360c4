//! The protocol is not Rust-only: the Python client generated from the same schema submits,
//! reads a status and receives errors from a running spindled.

mod common;

use std::process::Command;

use common::start;
use spindle_control::testing::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_submits_reads_status_and_gets_errors() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../clients/python/check_client.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(daemon.addr.ip().to_string())
        .arg(daemon.addr.port().to_string())
        .arg("1")
        .arg("one")
        .output()
        .expect("python3 runs (the test command installs the flatbuffers runtime)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python client failed:\n{stdout}\n{stderr}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{stdout}");
    assert!(lines[0].starts_with("submitted task "), "{stdout}");
    assert_eq!(lines[1], "status Succeeded");
    assert!(
        lines[2].starts_with("error NotFound: task 999999999 not found"),
        "{stdout}"
    );
    assert!(
        lines[3].starts_with("error InvalidInput: tasks[0]: `input` is not one JSON value")
            || lines[3].starts_with("error InvalidInput: `input` is not one JSON value"),
        "{stdout}"
    );
    assert_eq!(lines[4], "error AuthFailed");
}
