//! The hot path does not touch the heap once the engine has seen the workload.
//!
//! A counting global allocator (counting only on the thread that asks) wraps the system
//! allocator. A mixed workload of `malloc` / `free` (LIFO and FIFO, small and large
//! pools, two streams, stream-deferred frees) runs once to let the slab, the pointer
//! map and the event pool grow, then again with counting on: no allocation may happen.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use stweaver_core::engine::{DevicePtr, Engine, EngineConfig, HostMemory, PlanOptions};
use stweaver_core::plan::{Plan, PlannedRequest};
use stweaver_core::{Bytes, Offset, StreamId};

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    /// Allocations counted on this thread: per thread, so that the tests running beside
    /// (the counter's own test allocates while counting) never add to another's count.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// Safety: every method forwards to `System` with the caller's arguments unchanged; the
// counter and the flag are const-initialised thread-locals, which do not allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.with(|n| n.set(n.get() + 1));
        }
        // Safety: same contract as ours, passed through.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Safety: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.with(|n| n.set(n.get() + 1));
        }
        // Safety: same contract as ours, passed through.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn workload(e: &Engine<HostMemory>) {
    let (s0, s1) = (StreamId(0), StreamId(1));
    let sizes = [
        512u64,
        3000,
        70_000,
        1 << 20,
        (1 << 20) + 1,
        5 << 20,
        123_457,
    ];
    let mut live: [DevicePtr; 7] = [DevicePtr(0); 7];
    for round in 0..50 {
        for (slot, &s) in sizes.iter().enumerate() {
            live[slot] = e
                .malloc(Bytes(s), if slot % 2 == 0 { s0 } else { s1 })
                .unwrap();
        }
        if round % 3 == 0 {
            e.record_stream(live[2], StreamId(9)).unwrap();
        }
        // FIFO half, LIFO half.
        for &p in &live[..3] {
            e.free(p).unwrap();
        }
        for &p in live[3..].iter().rev() {
            e.free(p).unwrap();
        }
        e.device().events().pass_all(StreamId(9));
        e.process_events().unwrap();
    }
}

#[test]
fn steady_state_malloc_and_free_do_not_allocate() {
    let e = engine();
    workload(&e);
    workload(&e);
    assert_eq!(
        counted(|| workload(&e)),
        0,
        "heap allocations in steady state"
    );
    e.check_invariants().unwrap();
}

/// Allocations `f` makes on this thread.
fn counted(f: impl FnOnce()) -> u64 {
    let before = ALLOCS.with(Cell::get);
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCS.with(Cell::get) - before
}

/// An engine over 1 GiB of host memory with 2 MiB granules.
fn engine() -> Engine<HostMemory> {
    Engine::new(
        HostMemory::new(Bytes(1 << 30), Bytes(2 << 20)),
        EngineConfig::default(),
    )
    .unwrap()
}

/// A planned request on stream 0.
fn req(size: u64, offset: u64, start: u64, end: u64) -> PlannedRequest {
    PlannedRequest {
        size: Bytes(size),
        stream: StreamId(0),
        offset: Offset(offset),
        start,
        end,
    }
}

#[test]
fn the_counter_counts() {
    assert_eq!(counted(|| drop(std::hint::black_box(vec![1u8; 10]))), 1);
}

#[test]
fn plan_hits_do_not_allocate() {
    let e = engine();
    // One iteration: a (kept) and b (temporary) overlap, c reuses b's place.
    let plan = Plan {
        alignment: Bytes(512),
        pool_size: Bytes(3 << 20),
        iteration: vec![
            req(1 << 20, 0, 0, 5),
            req(4096, 1 << 20, 1, 2),
            req(8192, 1 << 20, 3, 4),
        ],
        iteration_len: 6,
        ..Plan::default()
    };
    e.load_plan(&plan, PlanOptions::default()).unwrap();
    let iteration = || {
        for _ in 0..100 {
            e.mark_iteration().unwrap();
            let a = e.malloc(Bytes(1 << 20), StreamId(0)).unwrap();
            let b = e.malloc(Bytes(4096), StreamId(0)).unwrap();
            e.free(b).unwrap();
            let c = e.malloc(Bytes(8192), StreamId(0)).unwrap();
            e.free(c).unwrap();
            e.free(a).unwrap();
        }
    };
    iteration();
    let n = counted(iteration);
    let st = e.plan_stats().unwrap().unwrap();
    assert_eq!((st.hits, st.conflicts, st.unplanned), (600, 0, 0));
    assert_eq!(n, 0, "heap allocations on the plan hit path");
}

#[test]
fn plans_per_class_and_their_misses_do_not_allocate() {
    let e = engine();
    // Two classes sharing the pool; every iteration also makes a request no class has
    // (a hole search against every class's requests).
    let plan = Plan {
        alignment: Bytes(512),
        pool_size: Bytes(4 << 20),
        iteration: vec![req(1 << 20, 0, 0, 3), req(4096, 1 << 20, 1, 2)],
        iteration_len: 4,
        extra_classes: vec![stweaver_core::ClassSection {
            requests: vec![req(2 << 20, 0, 0, 3), req(8192, 2 << 20, 1, 2)],
            len: 4,
        }],
        ..Plan::default()
    };
    e.load_plan(&plan, PlanOptions::default()).unwrap();
    let iterations = || {
        for k in 0..100u64 {
            e.mark_iteration().unwrap();
            let (big, small) = if k % 3 == 0 {
                (2 << 20, 8192)
            } else {
                (1 << 20, 4096)
            };
            let a = e.malloc(Bytes(big), StreamId(0)).unwrap();
            let b = e.malloc(Bytes(small), StreamId(0)).unwrap();
            let x = e.malloc(Bytes(1536), StreamId(0)).unwrap();
            e.free(x).unwrap();
            e.free(b).unwrap();
            e.free(a).unwrap();
        }
    };
    iterations();
    let n = counted(iterations);
    let st = e.plan_stats().unwrap().unwrap();
    assert_eq!((st.hits, st.conflicts, st.unplanned), (400, 0, 200));
    assert_eq!(n, 0, "heap allocations serving a plan per class");
}

#[test]
fn keyed_iterations_do_not_allocate() {
    let e = engine();
    // Two classes beginning alike; every boundary keyed (200 keys: more than the 64
    // remembered, so keys are replaced too), and a key given after the boundary.
    let plan = Plan {
        alignment: Bytes(512),
        pool_size: Bytes(4 << 20),
        iteration: vec![req(4096, 0, 0, 3), req(1 << 20, 1 << 20, 1, 2)],
        iteration_len: 4,
        extra_classes: vec![stweaver_core::ClassSection {
            requests: vec![req(4096, 3 << 20, 0, 3), req(2 << 20, 0, 1, 2)],
            len: 4,
        }],
        ..Plan::default()
    };
    e.load_plan(&plan, PlanOptions::default()).unwrap();
    let iterations = || {
        for k in 0..400u64 {
            let class = k % 3 == 0;
            e.mark_iteration_keyed(Some(k % 200 + u64::from(class)))
                .unwrap();
            if k % 5 == 0 {
                e.set_iteration_key(u64::from(class)).unwrap();
            }
            let a = e.malloc(Bytes(4096), StreamId(0)).unwrap();
            let b = e
                .malloc(Bytes(if class { 2 << 20 } else { 1 << 20 }), StreamId(0))
                .unwrap();
            e.free(b).unwrap();
            e.free(a).unwrap();
        }
    };
    iterations();
    let n = counted(iterations);
    let st = e.plan_stats().unwrap().unwrap();
    assert!(st.hinted > 0, "{st:?}");
    assert_eq!(n, 0, "heap allocations at keyed boundaries");
}
