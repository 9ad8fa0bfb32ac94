//! Online engine: cost of one `malloc` + `free` pair.
//!
//! - `engine/pair/<size>`: one thread, warm engine (the arena already mapped), nothing
//!   else live: the fast path.
//! - `engine/pair_1k_live/<size>`: one thread, 1000 blocks of mixed sizes live, with
//!   holes between them, so the fit tree is not trivial.
//! - `engine/pair_pending_300/<size>`: one thread, 300 frees pending on another stream
//!   that never passes their events (offload's copy stream running behind): every
//!   `malloc` processes the pending queue first, which queries each stream's events only
//!   up to its first one still running.
//! - `engine/contended_2t/<size>`: two threads hammering one engine (same stream, so
//!   the same arena); the time is per pair, per thread, from a common start to the last
//!   thread's finish.
//! - `engine/plan_pair/<size>`: plan mode, every request a plan hit (cursor match,
//!   occupancy-checked placement, free back into the plan pool).
//! - `engine/plan_miss/<size>`: plan mode, every request a miss (a size the plan does
//!   not have): the cursor's general step (beam, look-ahead over the window), then a
//!   hole of the pool checked against the next expected requests (`hole_horizon`).
//! - `engine/plan_contended_2t/<size>` and `engine/plan_miss_contended_2t/<size>`: the
//!   same, two threads on one engine (per pair, per thread, as `contended_2t`).
//!
//! The device is [`HostMemory`]; in steady state the hot path makes no device call, so
//! what is measured is the engine itself (PyTorch's native allocator takes ~1.5–1.7 µs
//! per `torch.empty` + `del` pair on an H200, including its Python overhead).

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use stweaver_core::engine::{Engine, EngineConfig, HostMemory, PlanOptions};
use stweaver_core::plan::{Plan, PlannedRequest};
use stweaver_core::{Bytes, Offset, StreamId};

const SIZES: [(u64, &str); 3] = [(512, "512B"), (256 << 10, "256KiB"), (8 << 20, "8MiB")];

fn engine() -> Engine<HostMemory> {
    let host = HostMemory::new(Bytes(64 << 30), Bytes(2 << 20));
    Engine::new(host, EngineConfig::default()).unwrap()
}

fn warm(e: &Engine<HostMemory>, size: u64) {
    let p = e.malloc(Bytes(size), StreamId(0)).unwrap();
    e.free(p).unwrap();
}

fn single(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    for (size, name) in SIZES {
        let e = engine();
        warm(&e, size);
        g.bench_function(BenchmarkId::new("pair", name), |b| {
            b.iter(|| {
                let p = e.malloc(black_box(Bytes(size)), StreamId(0)).unwrap();
                e.free(black_box(p)).unwrap();
            })
        });
    }
    for (size, name) in SIZES {
        let e = engine();
        // 2000 mixed blocks, every other one freed: 1000 live, ~1000 holes.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut ptrs = Vec::new();
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let s = 512 + (x % (2 << 20));
            ptrs.push(e.malloc(Bytes(s), StreamId(0)).unwrap());
        }
        for p in ptrs.iter().step_by(2) {
            e.free(*p).unwrap();
        }
        warm(&e, size);
        g.bench_function(BenchmarkId::new("pair_1k_live", name), |b| {
            b.iter(|| {
                let p = e.malloc(black_box(Bytes(size)), StreamId(0)).unwrap();
                e.free(black_box(p)).unwrap();
            })
        });
    }
    g.finish();
}

fn pending(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    for (size, name) in SIZES {
        let e = engine();
        let mut held = Vec::new();
        for _ in 0..300 {
            let p = e.malloc(Bytes(4096), StreamId(0)).unwrap();
            e.record_stream(p, StreamId(1)).unwrap();
            held.push(p);
        }
        for p in held {
            e.free(p).unwrap();
        }
        warm(&e, size);
        g.bench_function(BenchmarkId::new("pair_pending_300", name), |b| {
            b.iter(|| {
                let p = e.malloc(black_box(Bytes(size)), StreamId(0)).unwrap();
                e.free(black_box(p)).unwrap();
            })
        });
    }
    g.finish();
}

/// Threads of the contended benchmarks.
const THREADS: usize = 2;

/// `iters` malloc + free pairs of `size` bytes on each of [`THREADS`] threads sharing
/// `e`, timed from a common start to the last thread's finish.
fn pairs_on_threads(e: &Arc<Engine<HostMemory>>, size: u64, iters: u64) -> Duration {
    let start = Arc::new(Barrier::new(THREADS + 1));
    let workers: Vec<_> = (0..THREADS)
        .map(|_| {
            let (e, start) = (e.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                for _ in 0..iters {
                    let p = e.malloc(black_box(Bytes(size)), StreamId(0)).unwrap();
                    e.free(black_box(p)).unwrap();
                }
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    for w in workers {
        w.join().unwrap();
    }
    t0.elapsed().max(Duration::from_nanos(1))
}

fn contended(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    for (size, name) in SIZES {
        let e = Arc::new(engine());
        warm(&e, size);
        warm(&e, size * 2);
        g.bench_function(BenchmarkId::new("contended_2t", name), |b| {
            b.iter_custom(|iters| pairs_on_threads(&e, size, iters))
        });
    }
    g.finish();
}

fn plan(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    for (size, name) in SIZES {
        let e = engine();
        let plan = Plan {
            alignment: Bytes(512),
            pool_size: Bytes(size),
            iteration: vec![PlannedRequest {
                size: Bytes(size),
                stream: StreamId(0),
                offset: Offset(0),
                start: 0,
                end: 1,
            }],
            iteration_len: 2,
            ..Plan::default()
        };
        e.load_plan(&plan, PlanOptions::default()).unwrap();
        g.bench_function(BenchmarkId::new("plan_pair", name), |b| {
            b.iter(|| {
                let p = e.malloc(black_box(Bytes(size)), StreamId(0)).unwrap();
                e.free(black_box(p)).unwrap();
            })
        });
        let st = e.plan_stats().unwrap().unwrap();
        assert_eq!((st.conflicts, st.unplanned), (0, 0), "every request a hit");
    }
    g.finish();
}

/// A plan of `slots` requests of `size` at distinct offsets (a 2-entry iteration
/// alternates between them), and a pool with room above them for misses.
fn slots_plan(size: u64, slots: u64) -> Plan {
    let len = size.div_ceil(512) * 512;
    Plan {
        alignment: Bytes(512),
        pool_size: Bytes(2 * slots * len + (16 << 20)),
        iteration: (0..slots)
            .map(|k| PlannedRequest {
                size: Bytes(size),
                stream: StreamId(0),
                offset: Offset(k * len),
                start: k,
                end: k + 1,
            })
            .collect(),
        iteration_len: slots + 1,
        ..Plan::default()
    }
}

/// Serves the plan's slots once, so the pool's granules under them are mapped.
fn map_slots(e: &Engine<HostMemory>, size: u64, slots: u64) {
    let ptrs: Vec<_> = (0..slots)
        .map(|_| e.malloc(Bytes(size), StreamId(0)).unwrap())
        .collect();
    for p in ptrs {
        e.free(p).unwrap();
    }
}

fn plan_more(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    for (size, name) in SIZES {
        // Misses: a size the plan does not have; served from a hole above the slots.
        let e = engine();
        e.load_plan(&slots_plan(size, 4), PlanOptions::default())
            .unwrap();
        map_slots(&e, size, 4);
        let miss = size + 512;
        warm(&e, miss);
        let before = e.plan_stats().unwrap().unwrap();
        let mut ran = false;
        g.bench_function(BenchmarkId::new("plan_miss", name), |b| {
            ran = true;
            b.iter(|| {
                let p = e.malloc(black_box(Bytes(miss)), StreamId(0)).unwrap();
                e.free(black_box(p)).unwrap();
            })
        });
        let st = e.plan_stats().unwrap().unwrap();
        assert_eq!(st.hits, before.hits, "every request a miss");
        // (A filtered-out benchmark does not run.)
        assert!(
            !ran || st.holes > before.holes,
            "served from the pool's holes"
        );
    }
    for (label, delta) in [("plan_contended_2t", 0u64), ("plan_miss_contended_2t", 512)] {
        for (size, name) in SIZES {
            let e = Arc::new(engine());
            e.load_plan(&slots_plan(size, 4), PlanOptions::default())
                .unwrap();
            map_slots(&e, size, 4);
            let want = size + delta;
            warm(&e, want);
            g.bench_function(BenchmarkId::new(label, name), |b| {
                b.iter_custom(|iters| pairs_on_threads(&e, want, iters))
            });
            let st = e.plan_stats().unwrap().unwrap();
            eprintln!("{label}/{name}: {st:?}");
        }
    }
    g.finish();
}

criterion_group!(benches, single, pending, contended, plan, plan_more);
criterion_main!(benches);
