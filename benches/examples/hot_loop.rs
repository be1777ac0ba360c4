//! Runs pick + admit in a loop at 10k tenants / 100k queued, for profilers (`perf record`).
use spindle_benches::Loaded;

fn main() {
    let rounds: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000_000);
    let mut loaded = Loaded::new(10_000, 100_000);
    let mut picked = Vec::with_capacity(1000);
    let start = std::time::Instant::now();
    let mut timed = std::time::Duration::ZERO;
    let mut done = 0;
    while done < rounds {
        let t0 = std::time::Instant::now();
        for _ in 0..1000 {
            loaded.admit();
            picked.push(loaded.pick());
        }
        timed += t0.elapsed();
        for t in picked.drain(..) {
            loaded.complete(t);
        }
        done += 1000;
    }
    println!(
        "pick+admit: {:.0} ns/op (total {:?})",
        timed.as_nanos() as f64 / rounds as f64,
        start.elapsed()
    );
}
