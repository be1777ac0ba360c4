//! Prints the node's media inventory as spindle sees it (NVML, or the declared fallback and
//! why), and the engines the media ledger would hold.
//!
//!   cargo run --release -p spindle-gpu --example inventory

use spindle_gpu::{Declared, Inventory, MediaLedger};

fn main() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let inv = Inventory::discover(&Declared {
        cpu_units: cpus,
        temp_disk_mb: 10_000,
        devices: vec![],
    });
    println!("source: {}", inv.source);
    for d in &inv.devices {
        println!("{d}");
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
