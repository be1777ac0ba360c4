//! Loom model of the media ledger: demands on several engines are all-or-nothing across
//! threads — never above capacity, nothing left held by a demand that failed.
#![cfg(loom)]

use loom::thread;
use spindle_gpu::{Declared, Device, Engine, Inventory, MediaLedger};
use std::sync::Arc;

fn ledger() -> Arc<MediaLedger> {
    let dev = Device {
        index: 0,
        name: "g".into(),
        memory_mb: 1,
        compute_units: 1,
        nvenc_sessions: 1,
        nvdec_sessions: 1,
        mig: false,
        utilization_pct: None,
    };
    let inv = Inventory::declared(
        &Declared {
            cpu_units: 1,
            temp_disk_mb: 1,
            devices: vec![dev],
        },
        "loom".into(),
    );
    Arc::new(MediaLedger::new(&inv))
}

#[test]
fn two_demands_on_overlapping_engines_are_all_or_nothing() {
    loom::model(|| {
        let l = ledger();
        let a = {
            let l = l.clone();
            thread::spawn(move || {
                l.try_acquire(&[(Engine::GpuCompute(0), 1), (Engine::Nvdec(0), 1)])
                    .map(|g| {
                        assert_eq!(l.usage(Engine::Nvdec(0)), Some((1, 1)));
                        drop(g);
                    })
                    .is_ok()
            })
        };
        let b = {
            let l = l.clone();
            thread::spawn(move || {
                l.try_acquire(&[(Engine::Nvdec(0), 1), (Engine::Cpu, 1)])
                    .map(drop)
                    .is_ok()
            })
        };
        let (ga, gb) = (a.join().unwrap(), b.join().unwrap());
        assert!(
            ga || gb,
            "with each demand alone fitting, one of them is granted"
        );
        for (engine, cap, used) in l.snapshot() {
            assert!(used <= cap);
            assert_eq!(used, 0, "{engine} left held");
        }
    });
}
