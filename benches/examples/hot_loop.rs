//! Runs pick + admit in a loop (default 10k tenants / 100k queued; `hot_loop ROUNDS TENANTS
//! QUEUED`), for profilers: `perf record`, or callgrind with
//! `--toggle-collect=hot_loop::round` to count only the timed pair (instructions and cache
//! misses per round, repeatable whatever else the machine does).
use spindle_benches::Loaded;
use spindle_core::TaskId;

// As spindled runs the core: large tables on huge pages.
#[global_allocator]
static ALLOC: spindle_alloc::HugePages = spindle_alloc::HugePages;

/// One timed round: what the criterion bench's `pick_plus_admit` measures.
#[inline(never)]
fn round(loaded: &mut Loaded) -> TaskId {
    loaded.admit();
    loaded.pick()
}

fn main() {
    let arg = |i: usize, default: u64| -> u64 {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let rounds = arg(1, 2_000_000);
    let mut loaded = Loaded::new(arg(2, 10_000) as u32, arg(3, 100_000));
    let mut picked = Vec::with_capacity(1000);
    let start = std::time::Instant::now();
    let mut timed = std::time::Duration::ZERO;
    let mut done = 0;
    while done < rounds {
        let t0 = std::time::Instant::now();
        for _ in 0..1000 {
            picked.push(round(std::hint::black_box(&mut loaded)));
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
