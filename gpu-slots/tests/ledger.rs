//! The media ledger and placement: engines per device (an H200-like device decodes on NVDEC and
//! encodes on the CPU), best fit with affinity, CPU fallback, the no-NVML path, and a stress run
//! of concurrent jobs that never sees an engine above its capacity.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use spindle_gpu::{place, Declared, Device, Engine, Inventory, MediaDemand, MediaLedger, Source};

fn device(index: u32, nvenc: u64, nvdec: u64) -> Device {
    Device {
        index,
        name: format!("test-gpu-{index}"),
        memory_mb: 80_000,
        compute_units: 100,
        nvenc_sessions: nvenc,
        nvdec_sessions: nvdec,
        mig: false,
        utilization_pct: None,
    }
}

fn ledger(devices: Vec<Device>, cpu: u64) -> (Arc<MediaLedger>, Vec<u32>) {
    let inv = Inventory::declared(
        &Declared {
            cpu_units: cpu,
            temp_disk_mb: 10_000,
            devices: devices.clone(),
        },
        "test".into(),
    );
    (
        Arc::new(MediaLedger::new(&inv)),
        devices.iter().map(|d| d.index).collect(),
    )
}

const JOB: MediaDemand = MediaDemand {
    gpu_units: 30,
    gpu_mem_mb: 4_000,
    cpu_units_per_stage: 1,
    temp_disk_mb: 500,
};

#[test]
fn without_nvml_the_declared_inventory_is_used_and_says_why() {
    let declared = Declared {
        cpu_units: 2,
        temp_disk_mb: 1_000,
        devices: vec![],
    };
    let inv = Inventory::discover(&declared);
    // This machine has no NVIDIA driver; a machine with one reports Nvml instead.
    match &inv.source {
        Source::Declared { why } => assert!(!why.is_empty()),
        Source::Nvml { driver } => assert!(!driver.is_empty()),
    }
    if matches!(inv.source, Source::Declared { .. }) {
        assert!(inv.devices.is_empty());
        assert_eq!(inv.cpu_units, 2);
    }
}

#[test]
fn an_h200_decodes_on_the_gpu_and_encodes_on_the_cpu() {
    let (l, devs) = ledger(vec![device(0, 0, 8)], 4);
    assert!(!l.has(Engine::Nvenc(0)), "no NVENC engine on this device");
    let p = place(&l, &devs, JOB, None).unwrap();
    assert_eq!(
        (p.device, p.decode_on_gpu, p.encode_on_gpu),
        (Some(0), true, false)
    );
    assert_eq!(
        l.usage(Engine::Cpu),
        Some((4, 1)),
        "one CPU stage: the encode"
    );
    assert_eq!(l.usage(Engine::Nvdec(0)), Some((8, 1)));
    drop(p);
    assert_eq!(
        l.usage(Engine::Cpu),
        Some((4, 0)),
        "dropping the grant gives back"
    );
    assert_eq!(l.usage(Engine::GpuCompute(0)), Some((100, 0)));
}

#[test]
fn best_fit_affinity_and_cpu_fallback() {
    let (l, devs) = ledger(vec![device(0, 4, 4), device(1, 4, 4)], 4);
    // Device 1 is half full: the tightest fit for the next job.
    let first = place(&l, &devs, JOB, Some(1)).unwrap();
    assert_eq!(first.device, Some(1));
    assert!(first.encode_on_gpu && first.decode_on_gpu);
    let tight = place(&l, &devs, JOB, None).unwrap();
    assert_eq!(tight.device, Some(1), "best fit packs the used device");
    let affine = place(&l, &devs, JOB, Some(0)).unwrap();
    assert_eq!(affine.device, Some(0), "affinity wins where it fits");
    // Fill both devices' compute; the next job runs on the CPU.
    let mut held = vec![first, tight, affine];
    while let Ok(p) = place(&l, &devs, JOB, None) {
        if p.device.is_none() {
            assert_eq!(
                l.usage(Engine::Cpu).unwrap().1,
                2,
                "decode and encode on the CPU"
            );
            held.push(p);
            break;
        }
        held.push(p);
    }
    assert!(held.iter().any(|p| p.device.is_none()));
    // CPU full too: the refusal names the engine.
    let big = MediaDemand {
        cpu_units_per_stage: 3,
        ..JOB
    };
    let e = place(&l, &devs, big, None).unwrap_err();
    assert_eq!(e.engine, Engine::Cpu);
    drop(held);
    for (engine, _, used) in l.snapshot() {
        assert_eq!(used, 0, "{engine} still held");
    }
}

#[test]
fn concurrent_jobs_never_push_an_engine_above_its_capacity() {
    let (l, devs) = ledger(vec![device(0, 2, 3), device(1, 0, 2)], 3);
    let stop = Arc::new(AtomicBool::new(false));
    let observer = {
        let (l, stop) = (l.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut samples = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for (engine, cap, used) in l.snapshot() {
                    assert!(used <= cap, "{engine}: {used} of {cap}");
                }
                samples += 1;
            }
            samples
        })
    };
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let (l, devs) = (l.clone(), devs.clone());
            std::thread::spawn(move || {
                let mut placed = 0;
                for i in 0..2_000u32 {
                    let affinity = Some((w + i) % 2);
                    if let Ok(p) = place(&l, &devs, JOB, affinity) {
                        placed += 1;
                        std::hint::black_box(&p);
                    }
                }
                placed
            })
        })
        .collect();
    let placed: u32 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    stop.store(true, Ordering::Relaxed);
    let samples = observer.join().unwrap();
    assert!(placed > 0 && samples > 0);
    for (engine, _, used) in l.snapshot() {
        assert_eq!(used, 0, "{engine} leaked");
    }
}

/// A GPU that a refresh no longer finds takes no new work: placement goes to another device
/// (or the CPU), its engines show no capacity, and the grant already held on it is given back
/// as usual; found again, it takes work again.
#[test]
fn a_missing_gpu_takes_no_new_work_until_it_is_back() {
    let (ledger, devices) = ledger(vec![device(0, 8, 8), device(1, 8, 8)], 4);
    let held = place(&ledger, &devices, JOB, Some(0)).unwrap();
    assert_eq!(held.device, Some(0));
    let only_one = Inventory::declared(
        &Declared {
            cpu_units: 4,
            temp_disk_mb: 10_000,
            devices: vec![device(1, 8, 8)],
        },
        "refresh".into(),
    );
    assert_eq!(ledger.apply_refresh(&only_one), vec![(0, false)]);
    assert_eq!(
        ledger.apply_refresh(&only_one),
        vec![],
        "no change, nothing to say"
    );
    assert!(!ledger.is_online(0));
    let (cap, used) = ledger.usage(Engine::GpuCompute(0)).unwrap();
    assert_eq!(
        (cap, used),
        (0, 30),
        "no capacity for new work; the running job still holds"
    );
    let next = place(&ledger, &devices, JOB, Some(0)).unwrap();
    assert_eq!(
        next.device,
        Some(1),
        "affinity cannot bring work to a missing GPU"
    );
    // With every GPU gone, work runs on the CPU.
    let none = Inventory::declared(
        &Declared {
            cpu_units: 4,
            temp_disk_mb: 10_000,
            devices: vec![],
        },
        "refresh".into(),
    );
    assert_eq!(ledger.apply_refresh(&none), vec![(1, false)]);
    let cpu = place(&ledger, &devices, JOB, None).unwrap();
    assert_eq!(cpu.device, None);
    drop((held, next, cpu));
    assert!(
        ledger.snapshot().iter().all(|&(_, _, used)| used == 0),
        "all given back"
    );
    let both = Inventory::declared(
        &Declared {
            cpu_units: 4,
            temp_disk_mb: 10_000,
            devices: vec![device(0, 8, 8), device(1, 8, 8)],
        },
        "refresh".into(),
    );
    assert_eq!(ledger.apply_refresh(&both), vec![(0, true), (1, true)]);
    assert_eq!(
        place(&ledger, &devices, JOB, Some(0)).unwrap().device,
        Some(0)
    );
}
