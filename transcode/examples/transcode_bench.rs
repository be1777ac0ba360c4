//! In-process transcode against the ffmpeg CLI on the same encode and input, in the same run,
//! and aggregate throughput of N concurrent in-process jobs on N CPU slots.
//!
//!   cargo run --release -p spindle-transcode --example transcode_bench -- [--seconds 10] [--runs 3]
//!
//! The input is a 1080p, 25 fps clip made here from a lavfi source. The encode: scale to 720p
//! (bilinear), libx264 preset veryfast crf 28, one decoder and one encoder thread, no audio.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use spindle_transcode::{transcode, JobLimits, Rendition, Source};

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rendition() -> Rendition {
    Rendition {
        name: "720p".into(),
        height: 720,
        crf: 28,
        preset: "veryfast".into(),
    }
}

fn in_process(input: &Path, out: &Path) -> Duration {
    let t = Instant::now();
    let limits = JobLimits {
        threads: 1,
        ..JobLimits::default()
    };
    transcode(
        &Source::File(input.into()),
        out,
        &rendition(),
        &limits,
        &mut |_| {},
    )
    .expect("in-process transcode");
    t.elapsed()
}

fn cli(input: &Path, out: &Path) -> Duration {
    let t = Instant::now();
    let status = Command::new("ffmpeg")
        .args([
            "-hide_banner",
            "-loglevel",
            "error",
            "-y",
            "-threads",
            "1",
            "-i",
        ])
        .arg(input)
        .args([
            "-an",
            "-vf",
            "scale=-2:720:flags=bilinear",
            "-c:v",
            "libx264",
            "-preset",
            "veryfast",
            "-crf",
            "28",
            "-threads",
            "1",
        ])
        .arg(out)
        .status()
        .expect("running ffmpeg");
    assert!(status.success(), "ffmpeg failed");
    t.elapsed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let seconds = arg("--seconds", 10);
    let runs = arg("--runs", 3) as usize;
    let dir = std::env::temp_dir().join(format!("spindle-transcode-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("input-1080p.mp4");
    let source = Source::Lavfi(format!(
        "testsrc2=size=1920x1080:rate=25:duration={seconds}"
    ));
    let make = Rendition {
        name: "1080p".into(),
        height: 1080,
        crf: 20,
        preset: "ultrafast".into(),
    };
    let limits = JobLimits {
        threads: 2,
        ..JobLimits::default()
    };
    transcode(&source, &input, &make, &limits, &mut |_| {}).unwrap();
    let frames = seconds * 25;
    println!("input: {seconds} s of 1080p25 ({frames} frames); encode: 720p veryfast crf 28, 1 thread each");

    // Alternate the two so drift in the machine hits both alike.
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        ours.push(in_process(&input, &dir.join("ours.mp4")));
        theirs.push(cli(&input, &dir.join("cli.mp4")));
    }
    let (o, c) = (median(ours), median(theirs));
    println!(
        "one job:   in-process {:.2} s, ffmpeg CLI {:.2} s: in-process/CLI = {:.3}",
        o.as_secs_f64(),
        c.as_secs_f64(),
        o.as_secs_f64() / c.as_secs_f64()
    );

    // N concurrent jobs, one thread (one CPU slot) each.
    let slots = std::thread::available_parallelism().map_or(2, |n| n.get());
    let concurrent = |n: usize, f: fn(&Path, &Path) -> Duration| {
        let t = Instant::now();
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let input = input.clone();
                let out = dir.join(format!("c{i}.mp4"));
                std::thread::spawn(move || f(&input, &out))
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        (n as f64 * frames as f64) / t.elapsed().as_secs_f64()
    };
    let one = concurrent(1, in_process);
    let many = concurrent(slots, in_process);
    let many_cli = concurrent(slots, cli);
    println!(
        "throughput: 1 job {one:.1} frames/s; {slots} jobs {many:.1} frames/s = {:.2}× one; \
         {slots} CLI runs {many_cli:.1} frames/s: in-process/CLI = {:.3}",
        many / one,
        many / many_cli
    );
    let _ = std::fs::remove_dir_all(&dir);
}
