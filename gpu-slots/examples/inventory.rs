//! Prints the node's media inventory as spindle sees it (NVML, or the declared fallback and
//! why), and the engines the media ledger would hold.
//!
//!   cargo run --release -p spindle-gpu --example inventory

use spindle_gpu::{Declared, Inventory, MediaLedger, Source};

fn main() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let inv = Inventory::discover(&Declared {
        cpu_units: cpus,
        temp_disk_mb: 10_000,
        devices: vec![],
    });
    match &inv.source {
        Source::Nvml { driver } => println!("source: NVML, driver {driver}"),
        Source::Declared { why } => println!("source: declared (NVML unavailable: {why})"),
    }
    for d in &inv.devices {
        println!(
            "gpu{}: {} | {} MB | NVENC sessions {} | NVDEC sessions {} | MIG {} | utilization {:?} %",
            d.index, d.name, d.memory_mb, d.nvenc_sessions, d.nvdec_sessions, d.mig, d.utilization_pct
        );
    }
    println!(
        "cpu units {} | temp disk {} MB",
        inv.cpu_units, inv.temp_disk_mb
    );
    let ledger = MediaLedger::new(&inv);
    for (engine, capacity, _) in ledger.snapshot() {
        println!("engine {engine}: capacity {capacity}");
    }
}
