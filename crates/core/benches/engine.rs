//! Online engine: cost of one `malloc` + `free` pair.
//!
//! - `engine/pair/<size>`: one thread, warm engine (the arena already mapped), nothing
//!   else live: the fast path.
//! - `engine/pair_1k_live/<size>`: one thread, 1000 blocks of mixed sizes live, with
//!   holes between them, so the fit tree is not trivial.
//! - `engine/contended_2t/<size>`: two threads hammering one engine (same stream, so
//!   the same arena); the time is per pair, per thread, from a common start to the last
//!   thread's finish.
//! - `engine/plan_pair/<size>`: plan mode, every request a plan hit (cursor match,
//!   occupancy-checked placement, free back into the plan pool).
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

fn contended(c: &mut Criterion) {
    const THREADS: usize = 2;
    let mut g = c.benchmark_group("engine");
    for (size, name) in SIZES {
        let e = Arc::new(engine());
        warm(&e, size);
        warm(&e, size * 2);
        g.bench_function(BenchmarkId::new("contended_2t", name), |b| {
            b.iter_custom(|iters| {
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
            })
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

criterion_group!(benches, single, contended, plan);
criterion_main!(benches);
