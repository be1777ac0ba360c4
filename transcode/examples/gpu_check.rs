//! The GPU check (issue 6), run by `tools/gpu-check/run.sh`: the NVML inventory as spindle sees
//! it, where the node would place a media job, then on a 1080p25 H.264 clip made here: decode
//! on the CPU against NVDEC, a 720p rendition with CPU decode against NVDEC decode (libx264
//! encode both), an NVENC rendition where the device has the engine (else the refusal the node
//! falls back on), and `jobs` concurrent renditions placed by the media ledger against the same
//! jobs all on the CPU, the ledger checked against its capacity throughout. Every output is
//! decoded again and checked (frames, size).
//!
//!   cargo run --release -p spindle-transcode --example gpu_check -- [seconds=20] [jobs=16]
//!
//! Without a GPU, `DECLARE_GPU=1` declares one (an H200's engines) to rehearse the run: every
//! GPU stage is then refused, as the node sees it on such a machine.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use spindle_gpu::{place, Declared, Inventory, MediaLedger, TRANSCODE_DEMAND as DEMAND};
use spindle_transcode::{
    decode, decode_all, transcode, verify_encoders, Accel, JobLimits, MediaError, Rendition,
    Source, Transcoded,
};

fn rendition_720p() -> Rendition {
    Rendition {
        name: "720p".into(),
        height: 720,
        crf: 28,
        preset: "veryfast".into(),
    }
}

fn run(input: &Path, out: &Path, accel: Accel) -> (Duration, Result<Transcoded, MediaError>) {
    let limits = JobLimits {
        threads: 1,
        accel,
        ..JobLimits::default()
    };
    let t = Instant::now();
    let got = transcode(
        &Source::File(input.into()),
        out,
        &rendition_720p(),
        &limits,
        &mut |_| {},
    );
    (t.elapsed(), got)
}

/// CPU seconds this process has used (user and system, from /proc at 100 ticks a second).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
    let f: Vec<f64> = after
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0
}

/// Decodes `out` again: the frames and size a rendition must have.
fn check(out: &Path, frames: u64) -> String {
    match decode_all(out) {
        Ok((f, w, h)) if f == frames && (w, h) == (1280, 720) => {
            format!("verified: {f} frames of {w}x{h}")
        }
        Ok((f, w, h)) => format!("WRONG: {f} frames of {w}x{h}, expected {frames} of 1280x720"),
        Err(e) => format!("WRONG: does not decode: {e}"),
    }
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let seconds = args.first().copied().unwrap_or(20);
    let jobs = args.get(1).copied().unwrap_or(16) as usize;
    let frames = seconds * 25;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;

    println!("== inventory");
    let mut inv = Inventory::discover(&Declared {
        cpu_units: cpus,
        temp_disk_mb: 100_000,
        devices: if std::env::var_os("DECLARE_GPU").is_some() {
            vec![spindle_gpu::Device {
                index: 0,
                name: "declared H200".into(),
                memory_mb: 143_771,
                compute_units: 100,
                nvenc_sessions: 0,
                nvdec_sessions: 8,
                mig: false,
                utilization_pct: None,
            }]
        } else {
            vec![]
        },
    });
    println!("source: {}", inv.source);
    for d in &inv.devices {
        println!("{d}");
    }
    let nvml_encoders: Vec<u64> = inv.devices.iter().map(|d| d.nvenc_sessions).collect();
    verify_encoders(&mut inv);
    for (d, nvml) in inv.devices.iter().zip(nvml_encoders) {
        if d.nvenc_sessions != nvml {
            println!(
                "gpu{}: NVML reports an encoder, but no NVENC session opens: encode on the CPU",
                d.index
            );
        }
    }
    let ledger = Arc::new(MediaLedger::new(&inv));
    for (engine, capacity, _) in ledger.snapshot() {
        println!("engine {engine}: capacity {capacity}");
    }
    let devices: Vec<u32> = inv.devices.iter().map(|d| d.index).collect();
    let gpu = match place(&ledger, &devices, DEMAND, None) {
        Ok(p) => {
            println!(
                "a media job is placed on {:?}: decode on GPU {}, encode on GPU {}",
                p.device
                    .map(|d| format!("gpu{d}"))
                    .unwrap_or("the CPU".into()),
                p.decode_on_gpu,
                p.encode_on_gpu
            );
            p.device.map(|d| (d, p.decode_on_gpu, p.encode_on_gpu))
        }
        Err(e) => {
            println!("no placement: {e}");
            None
        }
    };
    let Some((device, has_nvdec, has_nvenc)) = gpu else {
        println!("no GPU to check: stop");
        return;
    };

    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("clip-1080p.mp4");
    let t = Instant::now();
    let made = transcode(
        &Source::Lavfi(format!(
            "testsrc2=size=1920x1080:rate=25:duration={seconds}"
        )),
        &input,
        &Rendition {
            name: "source".into(),
            height: 1080,
            crf: 20,
            preset: "ultrafast".into(),
        },
        &JobLimits {
            threads: cpus as usize,
            ..JobLimits::default()
        },
        &mut |_| {},
    )
    .expect("making the clip");
    println!(
        "\n== clip: {} frames of 1920x1080 H.264, {} bytes, made in {:.2} s",
        made.frames,
        made.bytes,
        t.elapsed().as_secs_f64()
    );

    println!("\n== decode only ({frames} frames of 1080p)");
    for (label, nvdec, threads) in [
        ("cpu, 1 thread", None, 1),
        ("cpu, all threads", None, cpus as usize),
        ("nvdec", Some(device), 1),
        ("nvdec again (context made)", Some(device), 1),
    ] {
        let t = Instant::now();
        match decode(&input, nvdec, threads) {
            Ok(d) => {
                let s = t.elapsed().as_secs_f64();
                println!(
                    "{label}: {} frames on {} in {s:.2} s = {:.0} fps",
                    d.frames,
                    d.decoded_on,
                    d.frames as f64 / s
                );
            }
            Err(e) => println!("{label}: FAILED: {e}"),
        }
    }

    println!("\n== 720p rendition (libx264 veryfast crf 28, 1 encoder thread)");
    let mut walls = Vec::new();
    for (label, accel) in [
        ("cpu decode", Accel::CPU),
        (
            "nvdec decode",
            Accel {
                nvdec: Some(device),
                nvenc: None,
            },
        ),
    ] {
        let out = dir.path().join(format!("{}.mp4", label.replace(' ', "-")));
        let cpu = cpu_seconds();
        let (wall, got) = run(&input, &out, accel);
        let cpu = cpu_seconds() - cpu;
        match got {
            Ok(t) => {
                println!(
                    "{label}: decoded on {}, encoded on {}, {:.2} s = {:.0} fps, {cpu:.2} CPU s; {}",
                    t.decoded_on,
                    t.encoded_on,
                    wall.as_secs_f64(),
                    t.frames as f64 / wall.as_secs_f64(),
                    check(&out, frames)
                );
                walls.push(wall.as_secs_f64());
            }
            Err(e) => println!("{label}: FAILED: {e}"),
        }
    }
    if let [cpu, gpu] = walls[..] {
        println!("nvdec / cpu decode wall time: {:.2}", gpu / cpu);
    }

    println!("\n== NVENC rendition (h264_nvenc p4, vbr cq 28)");
    let out = dir.path().join("nvenc.mp4");
    let (wall, got) = run(
        &input,
        &out,
        Accel {
            nvdec: has_nvdec.then_some(device),
            nvenc: Some(device),
        },
    );
    match got {
        Ok(t) => println!(
            "nvenc: decoded on {}, encoded on {}, {:.2} s; {}",
            t.decoded_on,
            t.encoded_on,
            wall.as_secs_f64(),
            check(&out, frames)
        ),
        Err(e) => println!(
            "nvenc {}: {e} (left behind: {})",
            if has_nvenc {
                "FAILED where NVML shows an encoder"
            } else {
                "refused as expected (NVML shows no encoder)"
            },
            out.exists()
        ),
    }
    let (_, got) = run(
        &input,
        &dir.path().join("gone.mp4"),
        Accel {
            nvdec: Some(99),
            nvenc: None,
        },
    );
    println!(
        "a device that is not there: {}",
        got.err().map_or("NOT REFUSED".into(), |e| e.to_string())
    );

    for (label, on) in [
        ("placed by the ledger", &devices[..]),
        ("all on the CPU", &[][..]),
    ] {
        println!("\n== {jobs} concurrent 720p renditions, {label}");
        let ledger = Arc::new(MediaLedger::new(&Inventory {
            cpu_units: cpus,
            ..inv.clone()
        }));
        let over = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let watch = {
            let (ledger, over, done) = (ledger.clone(), over.clone(), done.clone());
            std::thread::spawn(move || {
                let mut peak: Vec<(String, u64, u64)> = Vec::new();
                while !done.load(Ordering::Relaxed) {
                    for (i, (engine, cap, used)) in ledger.snapshot().into_iter().enumerate() {
                        if used > cap {
                            over.store(true, Ordering::Relaxed);
                        }
                        if peak.len() <= i {
                            peak.push((engine.to_string(), cap, used));
                        }
                        peak[i].2 = peak[i].2.max(used);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                peak
            })
        };
        let t = Instant::now();
        let cpu = cpu_seconds();
        let handles: Vec<_> = (0..jobs)
            .map(|j| {
                let (ledger, input, on) = (ledger.clone(), input.clone(), on.to_vec());
                let out: PathBuf = dir.path().join(format!("job-{j}.mp4"));
                std::thread::spawn(move || {
                    let p = loop {
                        match place(&ledger, &on, DEMAND, None) {
                            Ok(p) => break p,
                            Err(_) => std::thread::sleep(Duration::from_millis(5)),
                        }
                    };
                    let accel = Accel {
                        nvdec: p.device.filter(|_| p.decode_on_gpu),
                        nvenc: p.device.filter(|_| p.encode_on_gpu),
                    };
                    let got = run(&input, &out, accel).1;
                    drop(p);
                    let verdict = check(&out, frames);
                    let _ = std::fs::remove_file(&out);
                    (got, verdict)
                })
            })
            .collect();
        let mut total = 0;
        let mut on_gpu = 0;
        let mut wrong = 0;
        for h in handles {
            match h.join().expect("job thread") {
                (Ok(t), verdict) => {
                    total += t.frames;
                    on_gpu += u64::from(t.decoded_on != spindle_transcode::Ran::Cpu);
                    wrong += u64::from(!verdict.starts_with("verified"));
                }
                (Err(e), _) => {
                    println!("job FAILED: {e}");
                    wrong += 1;
                }
            }
        }
        let wall = t.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu;
        done.store(true, Ordering::Relaxed);
        let peak = watch.join().expect("watcher");
        println!(
            "{jobs} jobs ({on_gpu} decoded on NVDEC): {total} frames in {wall:.2} s = {:.0} fps, {:.1} CPU ms a frame; outputs wrong: {wrong}; ledger above capacity: {}",
            total as f64 / wall,
            cpu * 1e3 / total.max(1) as f64,
            over.load(Ordering::Relaxed)
        );
        for (engine, cap, used) in peak {
            println!("  peak {engine}: {used} of {cap}");
        }
    }
}
