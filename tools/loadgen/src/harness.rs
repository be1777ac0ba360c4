//! What `storm` and `soak` share: a private PostgreSQL with a runtime and a scratch directory
//! for the duration of a run, the mock provider's two accounts, and the task they submit.

use anyhow::Context;
use spindle_core::{Band, ModelId, TaskSpec, UserId};
use spindle_providers::{MockConfig, MockProvider};
use spindle_wire::SubmitTask;

/// The preset's two provider accounts (one model served by both).
pub const ACCOUNTS: [&str; 2] = [
    "vendor-0:acct-1:us:video-model-0",
    "vendor-1:acct-1:us:video-model-0",
];

/// Runs `body` against a private PostgreSQL (its conninfo) and a scratch directory, then exits
/// the process with `body`'s verdict (in-process nodes end with it).
pub fn with_private_postgres<F, Fut>(name: &str, body: F) -> anyhow::Result<()>
where
    F: FnOnce(String, std::path::PathBuf) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let pg = spindle_control::EmbeddedPostgres::start(spindle_control::EmbeddedOptions::default())
        .context("starting a private PostgreSQL")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let dir = std::env::temp_dir().join(format!("spindle-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = rt.block_on(body(pg.conninfo("postgres"), dir.clone()));
    crate::TEARING_DOWN.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(pg);
    let _ = std::fs::remove_dir_all(&dir);
    let ok = result?;
    std::process::exit(if ok { 0 } else { 1 });
}

/// The mock provider serving both accounts with `concurrency` and `rpm` each; jobs take
/// `job_ms`.
pub async fn mock(
    concurrency: u64,
    rpm: u64,
    job_ms: u64,
    secret: &str,
) -> anyhow::Result<MockProvider> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    Ok(MockProvider::serve(
        listener,
        MockConfig {
            accounts: ACCOUNTS
                .iter()
                .map(|a| format!("{a}:{concurrency}:{rpm}").parse())
                .collect::<Result<_, _>>()
                .map_err(|e: String| anyhow::anyhow!(e))?,
            secret: secret.into(),
            job_ms,
            cost_milli: 1_000,
            hang_ms: 5_000,
            clip: None,
        },
    ))
}

/// A 5 s 720p task of the preset's model, keyed `key`.
pub fn video_task(key: String) -> SubmitTask {
    SubmitTask {
        idempotency_key: key,
        user: UserId(1),
        spec: TaskSpec::clip_720p(ModelId(0)),
        band_hint: Some(Band::P3),
        deadline_ms: None,
        input: None,
    }
}
