//! Multipart upload speed against a store far away: a file of SIZE_MB put into the stand-in
//! bucket (`fake_s3`), each part answered LATENCY_MS late, with 1 and then N parts in flight,
//! alternating, ROUNDS times; seconds and MB/s per run.
//!
//!   cargo run --release -p spindle-providers --example upload -- [SIZE_MB] [PART_MB] [LATENCY_MS] [N] [ROUNDS]

use std::time::{Duration, Instant};

use spindle_providers::fake_s3::FakeS3;
use spindle_providers::object_store::{upload_file, Plan};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let arg = |i: usize, default: u64| -> u64 {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let (size_mb, part_mb, latency_ms, n, rounds) =
        (arg(1, 64), arg(2, 5), arg(3, 50), arg(4, 4), arg(5, 3));
    let s3 = FakeS3::start("b", "us-test-1", "AKIDBENCH", "secret").await?;
    s3.delay_parts(latency_ms);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("rendition.mp4");
    let data: Vec<u8> = (0..size_mb << 20).map(|i| (i * 31 + i / 7) as u8).collect();
    std::fs::write(&path, &data)?;
    let tls = spindle_providers::tls::public_roots();
    println!("{size_mb} MiB in parts of {part_mb} MiB, each answered {latency_ms} ms late");
    for round in 0..rounds {
        for in_flight in [1, n as usize] {
            let plan = Plan {
                part_bytes: part_mb << 20,
                attempts: 1,
                parts_in_flight: in_flight,
            };
            let key = format!("r{round}-{in_flight}");
            let started = Instant::now();
            let deadline = started + Duration::from_secs(600);
            upload_file(
                &s3.bucket(),
                &key,
                &path,
                "video/mp4",
                &plan,
                deadline,
                &tls,
            )
            .await?;
            let secs = started.elapsed().as_secs_f64();
            anyhow::ensure!(
                s3.object(&key).as_deref() == Some(&data[..]),
                "{key} differs"
            );
            println!(
                "round {round}: {in_flight:>2} in flight: {secs:.3} s, {:.0} MB/s",
                (size_mb << 20) as f64 / secs / 1e6
            );
        }
    }
    Ok(())
}
