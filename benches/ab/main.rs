//! Both cores in one process: alternating chunks of 1,000 timed pick + admit rounds on a base
//! and a current shard (each chunk followed by its untimed completions), so that a neighbour on
//! the host slows both alike. Prints ns per pair for each and the ratio, per block of chunks.
#[allow(dead_code)]
mod h_base;
#[allow(dead_code)]
mod h_now;
use std::time::{Duration, Instant};

// As spindled runs the core (see `spindle-alloc`).
#[global_allocator]
static ALLOC: spindle_alloc::HugePages = spindle_alloc::HugePages;

macro_rules! chunk {
    ($l:expr, $picked:expr) => {{
        let t0 = Instant::now();
        for _ in 0..1000 {
            $l.admit();
            $picked.push($l.pick());
        }
        let d = t0.elapsed();
        for t in $picked.drain(..) {
            $l.complete(t);
        }
        d
    }};
}

fn main() {
    let arg = |i: usize, d: u64| {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let (blocks, per_block) = (arg(1, 20), arg(2, 200));
    let (tenants, queued) = (arg(3, 10_000) as u32, arg(4, 100_000));
    let mut a = h_base::Loaded::new(tenants, queued);
    let mut b = h_now::Loaded::new(tenants, queued);
    let (mut pa, mut pb) = (Vec::with_capacity(1000), Vec::with_capacity(1000));
    let mut ratios = Vec::new();
    for blk in 0..blocks {
        let (mut ta, mut tb) = (Duration::ZERO, Duration::ZERO);
        for i in 0..per_block {
            if (i + blk) % 2 == 0 {
                ta += chunk!(a, pa);
                tb += chunk!(b, pb);
            } else {
                tb += chunk!(b, pb);
                ta += chunk!(a, pa);
            }
        }
        let n = (per_block * 1000) as f64;
        let (na, nb) = (ta.as_nanos() as f64 / n, tb.as_nanos() as f64 / n);
        ratios.push(nb / na);
        println!(
            "block {blk}: base {na:.0} ns, now {nb:.0} ns, now/base {:.3}",
            nb / na
        );
    }
    ratios.sort_by(|x, y| x.partial_cmp(y).unwrap());
    println!(
        "median now/base {:.3} (min {:.3}, max {:.3}) over {} blocks",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
        ratios.len()
    );
}
