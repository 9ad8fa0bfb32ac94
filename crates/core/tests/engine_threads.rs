//! Many threads allocating and freeing at once through one engine.
//!
//! Worker threads run random malloc / free / record_stream / process_events /
//! empty_cache programs on shared and private streams, while another thread lets
//! streams pass their events and the main thread checks the engine's consistency
//! (`check_invariants` takes the lock, so it sees the state between any two steps,
//! including blocks other threads are mapping, unmapping or recording events for).
//!
//! Checked: no two live blocks ever overlap (a shared map of live ranges, updated
//! before a free and after a malloc), every block's sentinel bytes are intact when it is
//! freed, the engine stays consistent throughout, and after every thread has freed
//! everything and `empty_cache` ran nothing is allocated, reserved, mapped or pending.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use stweaver_core::testkit::audit::never_alias;

use stweaver_core::engine::{DevicePtr, Engine, EngineConfig, HostMemory, MemoryLimit};
use stweaver_core::{Bytes, StreamId};

const G: u64 = 64 << 10;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

type Live = Arc<Mutex<BTreeMap<u64, (u64, usize)>>>;

fn claim(live: &Live, p: u64, len: u64, who: usize) {
    let mut m = live.lock().unwrap();
    if let Err((q, &(qlen, other))) = never_alias(&m, |&(l, _)| l, p, len) {
        panic!("thread {who}: {p:#x}+{len:#x} overlaps {q:#x}+{qlen:#x} of thread {other}");
    }
    m.insert(p, (len, who));
}

fn worker(
    who: usize,
    engine: &Engine<Arc<HostMemory>>,
    host: &HostMemory,
    live: &Live,
    ops: usize,
) {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15 ^ ((who as u64 + 1) * 0x1234_5678));
    // Threads 0 and 1 share stream 1; the others have their own.
    let stream = StreamId(if who < 2 { 1 } else { who as u64 });
    let mut mine: Vec<(DevicePtr, u64, u8)> = Vec::new();
    for i in 0..ops {
        match rng.below(100) {
            0..=44 if mine.len() < 48 => {
                let size = match rng.below(10) {
                    0..=5 => 1 + rng.below(8192),
                    6..=8 => 8192 + rng.below(256 << 10),
                    _ => (256 << 10) + rng.below(2 << 20),
                };
                let p = engine.malloc(Bytes(size), stream).expect("malloc");
                let len = size.div_ceil(512) * 512;
                claim(live, p.get(), len, who);
                let byte = (1 + (who * 31 + i) % 254) as u8;
                host.fill(p, Bytes(len), byte).unwrap();
                mine.push((p, len, byte));
            }
            0..=84 if !mine.is_empty() => {
                let k = rng.below(mine.len() as u64) as usize;
                let (p, len, byte) = mine.swap_remove(k);
                assert!(
                    host.check(p, Bytes(len), byte).unwrap(),
                    "thread {who}: sentinel at {p} overwritten"
                );
                if rng.below(4) == 0 {
                    let other = StreamId(100 + rng.below(3));
                    engine.record_stream(p, other).unwrap();
                }
                live.lock().unwrap().remove(&p.get());
                engine.free(p).unwrap();
            }
            85..=94 => engine.process_events().unwrap(),
            95..=96 => engine.empty_cache().unwrap(),
            _ => {
                let s = engine.stats().unwrap();
                assert!(s.allocated_bytes[0].current >= 0);
                assert!(s.reserved_bytes[0].current >= s.active_bytes[0].current);
            }
        }
    }
    for (p, len, byte) in mine {
        assert!(host.check(p, Bytes(len), byte).unwrap());
        live.lock().unwrap().remove(&p.get());
        engine.free(p).unwrap();
    }
}

/// Checks the engine's consistency while `workers` run, joins them, then stops and joins
/// the event `driver` (which runs until `done`).
fn check_until_done(
    engine: &Engine<Arc<HostMemory>>,
    workers: Vec<thread::JoinHandle<()>>,
    done: &AtomicBool,
    driver: thread::JoinHandle<()>,
) {
    let mut checks = 0;
    while workers.iter().any(|w| !w.is_finished()) {
        engine.check_invariants().unwrap();
        checks += 1;
        thread::yield_now();
    }
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::Relaxed);
    driver.join().unwrap();
    assert!(checks > 0);
}

#[test]
fn many_threads_share_one_engine() {
    const THREADS: usize = 4;
    let host = Arc::new(HostMemory::new(Bytes(4 << 30), Bytes(G)));
    let engine = Arc::new(
        Engine::new(
            host.clone(),
            EngineConfig {
                limit: MemoryLimit::Fraction(1.0),
                arena_size: Some(Bytes(1 << 30)),
                ..EngineConfig::default()
            },
        )
        .unwrap(),
    );
    let live: Live = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(THREADS + 1));

    let driver = {
        let (host, done) = (host.clone(), done.clone());
        thread::spawn(move || {
            let mut n = 0u64;
            while !done.load(Ordering::Relaxed) {
                for s in 100..103 {
                    if n.is_multiple_of(3) {
                        host.events().pass_all(StreamId(s));
                    } else {
                        host.events().pass_next(StreamId(s));
                    }
                }
                n += 1;
                thread::yield_now();
            }
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|who| {
            let (engine, host, live, start) =
                (engine.clone(), host.clone(), live.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                worker(who, &engine, &host, &live, 4000);
            })
        })
        .collect();
    start.wait();
    check_until_done(&engine, workers, &done, driver);

    engine.empty_cache().unwrap();
    engine.check_invariants().unwrap();
    let s = engine.stats().unwrap();
    assert_eq!(s.allocated_bytes[0].current, 0);
    assert_eq!(s.active_bytes[0].current, 0, "pending frees left");
    assert_eq!(s.reserved_bytes[0].current, 0);
    assert_eq!(s.segment[0].current, 0);
    assert!(s.allocation[0].allocated > 1000, "threads did allocate");
    assert_eq!(host.mapped_bytes(), Bytes(0));
    assert!(live.lock().unwrap().is_empty());
    drop(engine);
    assert_eq!(host.reservations(), 0);
    assert_eq!(host.events().live_events(), 0);
}

/// Two threads, each on its own stream, serve a plan whose ranges alternate between the
/// two streams (stream 1 uses a range, then stream 2 reuses it), while a third thread lets
/// the streams pass their events late and the main thread checks consistency. The threads'
/// interleaving never matches the plan's order exactly: requests hit, wait for the other
/// stream's pending frees (fencing what lies outside their range), conflict and take
/// holes, concurrently. Checked: no two live blocks overlap, sentinels intact at every
/// free, the engine consistent throughout, and once every stream has passed everything
/// nothing is allocated or active.
#[test]
fn threads_serve_a_two_stream_plan_with_lagging_streams() {
    use stweaver_core::engine::PlanOptions;
    use stweaver_core::plan::{Plan, PlannedRequest};
    use stweaver_core::units::{DeviceId, Offset};
    use stweaver_core::verify::verify_plan;

    const K: u64 = 1 << 10;
    let n = 24u64;
    let mut iteration = Vec::new();
    for k in 0..n {
        let size = 4 * K * (1 + k % 4);
        for (j, s) in [(0, 1u64), (1, 2)] {
            iteration.push(PlannedRequest {
                size: Bytes(size),
                stream: StreamId(s),
                offset: Offset(k * 16 * K),
                start: 2 * k + j,
                end: 2 * k + j + 1,
            });
        }
    }
    let plan = Plan {
        device: DeviceId(0),
        alignment: Bytes(512),
        pool_size: Bytes(n * 16 * K),
        iteration,
        iteration_len: 2 * n + 1,
        ..Plan::default()
    };
    verify_plan(&plan).unwrap();
    let host = Arc::new(HostMemory::new(Bytes(1 << 30), Bytes(G)));
    let engine = Arc::new(
        Engine::new(
            host.clone(),
            EngineConfig {
                arena_size: Some(Bytes(256 << 20)),
                ..EngineConfig::default()
            },
        )
        .unwrap(),
    );
    engine.load_plan(&plan, PlanOptions::default()).unwrap();
    let live: Live = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let driver = {
        let (host, done) = (host.clone(), done.clone());
        thread::spawn(move || {
            let mut n = 0u64;
            while !done.load(Ordering::Relaxed) {
                let s = StreamId(1 + n % 3);
                if n.is_multiple_of(5) {
                    host.events().pass_all(s);
                } else {
                    host.events().pass_next(s);
                }
                n += 1;
                thread::yield_now();
            }
        })
    };
    let workers: Vec<_> = [1u64, 2]
        .into_iter()
        .map(|s| {
            let (engine, host, live) = (engine.clone(), host.clone(), live.clone());
            thread::spawn(move || {
                let mut rng = XorShift(0x5851_f42d_4c95_7f2d ^ s);
                let who = s as usize;
                let mut held: Vec<(DevicePtr, u64, u8)> = Vec::new();
                for it in 0..60u64 {
                    if s == 1 {
                        engine.mark_iteration().unwrap();
                    }
                    for k in 0..n {
                        let size = 4 * K * (1 + k % 4);
                        let p = engine.malloc(Bytes(size), StreamId(s)).expect("malloc");
                        claim(&live, p.get(), size, who);
                        let byte = (1 + (it * n + k + s) % 254) as u8;
                        host.fill(p, Bytes(size), byte).unwrap();
                        held.push((p, size, byte));
                        // Stream 2 keeps a few blocks a while; stream 1 frees at once,
                        // sometimes recording a use on stream 3 first.
                        let keep = if s == 2 { rng.below(3) as usize } else { 0 };
                        while held.len() > keep {
                            let (p, len, byte) = held.remove(0);
                            assert!(
                                host.check(p, Bytes(len), byte).unwrap(),
                                "stream {s}: sentinel at {p} overwritten"
                            );
                            if rng.below(4) == 0 {
                                engine.record_stream(p, StreamId(3)).unwrap();
                            }
                            live.lock().unwrap().remove(&p.get());
                            engine.free(p).unwrap();
                        }
                    }
                }
                for (p, len, byte) in held {
                    assert!(host.check(p, Bytes(len), byte).unwrap());
                    live.lock().unwrap().remove(&p.get());
                    engine.free(p).unwrap();
                }
            })
        })
        .collect();
    check_until_done(&engine, workers, &done, driver);
    // (The plan may have been given up for too many conflicts: the interleaving is the
    // threads', not the plan's. Either way nothing may alias.)
    let st = engine.plan_stats().unwrap();
    let why = engine.plan_abandoned().unwrap();
    eprintln!("two threads, two streams: {st:?}, given up: {why:?}");
    assert!(st.is_some_and(|st| st.hits > 0) || why.is_some());
    host.events().pass_everything();
    engine.process_events().unwrap();
    engine.check_invariants().unwrap();
    let s = engine.stats().unwrap();
    assert_eq!(s.allocated_bytes[0].current, 0);
    assert_eq!(s.active_bytes[0].current, 0, "pending frees or fences left");
    assert!(live.lock().unwrap().is_empty());
}
