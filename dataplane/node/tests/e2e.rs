//! spindled as a process against a real PostgreSQL, driven through the Rust client.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use spindle_client::{Client, ClientError};
use spindle_control::testing::TestDb;
use spindle_core::{Band, Decision, ModelId, TaskId, TaskSpec, TaskState, TenantId, UserId};
use spindle_wire::{ErrorCode, SubmitTask};

struct Daemon {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const CONFIG: &str = r#"
node_id = "test-node"
listen = "127.0.0.1:0"
shards = 2
partitions = 8
local_provider_time_scale = 0.0001

[[tenants]]
id = 1
credential = "one"

[[tenants]]
id = 2
credential = "two"
"#;

/// Starts spindled on a fresh database and waits (bounded) until it serves.
async fn start(test: &TestDb) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("spindled.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let ready = dir.path().join("ready");
    let mut child = Command::new(env!("CARGO_BIN_EXE_spindled"))
        .arg("--config")
        .arg(&config)
        .arg("--postgres")
        .arg(&test.config().conninfo)
        .arg("--ready-file")
        .arg(&ready)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    for _ in 0..3_000 {
        if let Ok(text) = std::fs::read_to_string(&ready) {
            if let Ok(addr) = text.trim().parse() {
                return Daemon {
                    child,
                    addr,
                    _dir: dir,
                };
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("spindled exited ({status}): {err}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("spindled did not get ready in 30 s");
}

fn task(key: &str) -> SubmitTask {
    SubmitTask {
        idempotency_key: key.into(),
        user: UserId(1),
        spec: TaskSpec {
            model: ModelId(0),
            width: 1280,
            height: 720,
            duration_ms: 5_000,
            fps: 24,
            audio: false,
            references: 0,
        },
        band_hint: Some(Band::P3),
        deadline_ms: None,
    }
}

/// Polls until `task` is in `state` (bounded: 2,000 polls).
async fn wait_for(client: &Client, task: TaskId, state: TaskState) {
    let mut last = None;
    for _ in 0..2_000 {
        let s = client.get(task).await.unwrap();
        if s.state == state {
            return;
        }
        last = Some(s);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("task {task} never reached {state:?}; last {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_ack_complete_and_idempotent_resubmit() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let client = Client::connect(daemon.addr, TenantId(1), "one")
        .await
        .unwrap();
    assert_eq!(client.hello().node_id, "test-node");

    let a = client.submit(task("k1")).await.unwrap();
    assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    assert!(!a.replay);
    wait_for(&client, a.task, TaskState::Succeeded).await;

    // The same key again: the original task, not a new one.
    let again = client.submit(task("k1")).await.unwrap();
    assert_eq!((again.task, again.replay), (a.task, true));
    // The same key with another spec: refused, naming the original.
    let mut other = task("k1");
    other.spec.duration_ms = 9_000;
    let conflict = client.submit(other).await.unwrap();
    assert_eq!(conflict.task, a.task);
    assert!(conflict
        .reason
        .unwrap_or_default()
        .contains("different request"));

    // A batch: one frame, one group commit, every task completes.
    let batch: Vec<_> = (0..50).map(|i| task(&format!("b{i}"))).collect();
    let admissions = client.submit_batch(batch).await.unwrap();
    assert_eq!(admissions.len(), 50);
    for a in &admissions {
        assert_eq!(a.decision, Decision::Accepted, "{a:?}");
    }
    for a in &admissions {
        wait_for(&client, a.task, TaskState::Succeeded).await;
    }
    // PostgreSQL agrees: every accepted task SUCCEEDED once, nothing holds a reservation.
    let sql = test.sql().await.unwrap();
    let row = sql
        .query_one(
            "SELECT count(*) FILTER (WHERE state = 'SUCCEEDED'), count(*),
                    (SELECT count(*) FROM resource_reservation WHERE status = 'ACTIVE'),
                    (SELECT coalesce(sum(used), 0)::bigint FROM resource_pool_shard)
               FROM task",
            &[],
        )
        .await
        .unwrap();
    let seen: (i64, i64, i64, i64) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(seen, (51, 51, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_and_credentials_checked() {
    let test = TestDb::new().await;
    let daemon = start(&test).await;
    let wrong = Client::connect(daemon.addr, TenantId(1), "two").await;
    assert!(
        matches!(wrong, Err(ClientError::Refused(ref e)) if e.code == ErrorCode::AuthFailed),
        "{:?}",
        wrong.err()
    );
    let one = Client::connect(daemon.addr, TenantId(1), "one")
        .await
        .unwrap();
    let two = Client::connect(daemon.addr, TenantId(2), "two")
        .await
        .unwrap();
    let a = one.submit(task("mine")).await.unwrap();
    // Tenant 2 can neither read nor cancel tenant 1's task: it does not exist for them.
    let read = two.get(a.task).await;
    assert!(
        matches!(read, Err(ClientError::Refused(ref e)) if e.code == ErrorCode::NotFound),
        "{read:?}"
    );
    let cancel = two.cancel(a.task).await;
    assert!(
        matches!(cancel, Err(ClientError::Refused(ref e)) if e.code == ErrorCode::NotFound),
        "{cancel:?}"
    );
    wait_for(&one, a.task, TaskState::Succeeded).await;
}
