//! Core scheduling cost at 10,000 active tenants and 100,000 queued tasks: admit (submit →
//! decision → enqueue), pick (DRR → band → fit → acquire → DISPATCHING), and the pair.
//! Completions that keep the backlog steady run outside the timed region.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use spindle_benches::Loaded;
use spindle_core::TaskId;

const TENANTS: u32 = 10_000;
const QUEUED: u64 = 100_000;
/// Operations timed back to back before the untimed clean-up that restores the backlog.
const CHUNK: u64 = 1_000;

/// Times `op` over `iters` calls in chunks; after each chunk `restore` (untimed) brings the
/// shard back to 100,000 queued tasks and nothing running.
fn timed(
    loaded: &mut Loaded,
    iters: u64,
    mut op: impl FnMut(&mut Loaded) -> Option<TaskId>,
    mut restore: impl FnMut(&mut Loaded, u64),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    let mut picked = Vec::with_capacity(CHUNK as usize);
    while done < iters {
        let n = CHUNK.min(iters - done);
        let start = Instant::now();
        for _ in 0..n {
            if let Some(t) = op(black_box(loaded)) {
                picked.push(t);
            }
        }
        total += start.elapsed();
        for t in picked.drain(..) {
            loaded.complete(t);
        }
        restore(loaded, n);
        done += n;
    }
    total
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("core_10k_tenants_100k_queued");
    group.sample_size(50);
    group.bench_function("admit", |b| {
        let mut loaded = Loaded::new(TENANTS, QUEUED);
        let admit = |l: &mut Loaded| {
            l.admit();
            None
        };
        let restore = |l: &mut Loaded, n: u64| {
            for _ in 0..n {
                let t = l.pick();
                l.complete(t);
            }
        };
        b.iter_custom(|iters| timed(&mut loaded, iters, admit, restore));
    });
    group.bench_function("pick", |b| {
        let mut loaded = Loaded::new(TENANTS, QUEUED);
        let restore = |l: &mut Loaded, n: u64| {
            for _ in 0..n {
                l.admit();
            }
        };
        b.iter_custom(|iters| timed(&mut loaded, iters, |l| Some(l.pick()), restore));
    });
    group.bench_function("pick_plus_admit", |b| {
        let mut loaded = Loaded::new(TENANTS, QUEUED);
        let op = |l: &mut Loaded| {
            l.admit();
            Some(l.pick())
        };
        b.iter_custom(|iters| timed(&mut loaded, iters, op, |_, _| {}));
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
