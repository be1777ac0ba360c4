//! Core scheduling cost at 10,000 active tenants and 100,000 queued tasks (and, for reference, at
//! 10 tenants and 100 tasks, where everything stays in cache): admit (submit → decision →
//! enqueue), pick (DRR → band → fit → acquire → DISPATCHING), and the pair.
//! Completions that keep the backlog steady run outside the timed region. Then a completion's
//! own cost (claim granted → provider succeeded → media done), with the estimates' calibration
//! off and on (`CalibrationPolicy`), in the same run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use spindle_benches::Loaded;
use spindle_core::TaskId;

// As spindled runs the core: large tables on huge pages (see `spindle-alloc`).
#[global_allocator]
static ALLOC: spindle_alloc::HugePages = spindle_alloc::HugePages;

/// (tenants, queued): the scale, and a cache-resident reference point.
const SHAPES: [(u32, u64); 2] = [(10_000, 100_000), (10, 100)];
/// Operations timed back to back before the untimed clean-up that restores the backlog.
const CHUNK: u64 = 1_000;

/// Times `op` over `iters` calls in chunks; after each chunk `restore` (untimed) brings the
/// shard back to its initial backlog and nothing running.
fn timed(
    loaded: &mut Loaded,
    chunk: u64,
    iters: u64,
    mut op: impl FnMut(&mut Loaded) -> Option<TaskId>,
    mut restore: impl FnMut(&mut Loaded, u64),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    let mut picked = Vec::with_capacity(chunk as usize);
    while done < iters {
        let n = chunk.min(iters - done);
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
    for (tenants, queued) in SHAPES {
        bench_shape(c, tenants, queued);
    }
}

fn bench_shape(c: &mut Criterion, tenants: u32, queued: u64) {
    let mut group = c.benchmark_group(format!("core_{tenants}_tenants_{queued}_queued"));
    // Never pick more than the backlog holds between two restores.
    let chunk = CHUNK.min(queued);
    group.sample_size(50);
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
    group.bench_function("admit", |b| {
        let mut loaded = Loaded::new(tenants, queued);
        b.iter_custom(|iters| timed(&mut loaded, chunk, iters, admit, restore));
    });
    // Every tenant's tasks from its user 1: one user id in every tenant (the user index must
    // not hash it alone).
    group.bench_function("admit_one_user_id", |b| {
        let mut loaded = Loaded::one_user_id(tenants, queued);
        b.iter_custom(|iters| timed(&mut loaded, chunk, iters, admit, restore));
    });
    group.bench_function("pick", |b| {
        let mut loaded = Loaded::new(tenants, queued);
        let restore = |l: &mut Loaded, n: u64| {
            for _ in 0..n {
                l.admit();
            }
        };
        b.iter_custom(|iters| timed(&mut loaded, chunk, iters, |l| Some(l.pick()), restore));
    });
    group.bench_function("pick_plus_admit", |b| {
        let mut loaded = Loaded::new(tenants, queued);
        let op = |l: &mut Loaded| {
            l.admit();
            Some(l.pick())
        };
        b.iter_custom(|iters| timed(&mut loaded, chunk, iters, op, |_, _| {}));
    });
    group.finish();
}

/// A picked task's completion, calibration off and on: picks (untimed), then their
/// completions timed, then admissions (untimed) bring the backlog back.
fn bench_completion(c: &mut Criterion) {
    let (tenants, queued) = SHAPES[0];
    let mut group = c.benchmark_group(format!("complete_{tenants}_tenants_{queued}_queued"));
    group.sample_size(50);
    for (name, samples_min) in [("calibration_off", 0), ("calibration_on", 16)] {
        group.bench_function(name, |b| {
            let mut policy = spindle_benches::policy(tenants);
            policy.calibration.samples_min = samples_min;
            let mut loaded = Loaded::with(policy, tenants, queued);
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                while done < iters {
                    let n = CHUNK.min(iters - done);
                    let picked: Vec<TaskId> = (0..n).map(|_| loaded.pick()).collect();
                    let start = Instant::now();
                    for &t in &picked {
                        loaded.complete(black_box(t));
                    }
                    total += start.elapsed();
                    for _ in 0..n {
                        loaded.admit();
                    }
                    done += n;
                }
                total
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench, bench_completion);
criterion_main!(benches);
