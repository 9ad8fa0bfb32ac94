//! Plan mode beyond exact hits: requests placed in the pool's holes, plans spanning
//! several streams, and switching to a plan mid-run. Every block is filled with a
//! sentinel byte on allocation and checked on free (`HostMemory` keeps real bytes), so
//! an overlap between two live blocks fails the test.

use stweaver_core::engine::{DevicePtr, PlanOptions, PlanSection, steady_slice};
use stweaver_core::plan::{NEVER_FREED, Plan, PlannedRequest};
use stweaver_core::testkit::audit::SentinelEngine;
use stweaver_core::units::{Bytes, DeviceId, Offset, StreamId};
use stweaver_core::verify::verify_plan;

const G: u64 = 64 << 10;
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);
const K: u64 = 1 << 10;

fn req(size: u64, offset: u64, start: u64, end: u64, stream: StreamId) -> PlannedRequest {
    PlannedRequest {
        size: Bytes(size),
        stream,
        offset: Offset(offset),
        start,
        end,
    }
}

/// A plan on device 0 with 512-B alignment, checked by the verifier.
fn verified_plan(
    pool: u64,
    prologue: Vec<PlannedRequest>,
    prologue_len: u64,
    iteration: Vec<PlannedRequest>,
    iteration_len: u64,
) -> Plan {
    let plan = Plan {
        device: DeviceId(0),
        alignment: Bytes(512),
        pool_size: Bytes(pool),
        prologue,
        prologue_len,
        iteration,
        iteration_len,
        ..Plan::default()
    };
    verify_plan(&plan).unwrap();
    plan
}

/// Granules of 64 KiB, online arenas of 64 MiB.
type Run = SentinelEngine;

fn run() -> Run {
    Run::new(G, 64 << 20)
}

/// One stream: a 64 KiB parameter, then an iteration of two activations (32 KiB each)
/// and a temporary, in a 128 KiB pool: [0, 64K) parameter, [64K, 96K) and [96K, 128K)
/// activations; the temporary reuses the first activation's range after it dies.
/// A run serving `plan` with `opts`, and the base of its pool.
fn serving(plan: &Plan, opts: PlanOptions) -> (Run, DevicePtr) {
    let r = run();
    r.engine.load_plan(plan, opts).unwrap();
    let (base, _) = r.engine.plan_pool().unwrap().unwrap();
    (r, base)
}

fn one_stream_plan() -> Plan {
    verified_plan(
        128 * K,
        vec![req(64 * K, 0, 0, NEVER_FREED, S1)],
        1,
        vec![
            req(32 * K, 64 * K, 0, 2, S1),
            req(32 * K, 96 * K, 1, 4, S1),
            req(8 * K, 64 * K, 3, 5, S1),
        ],
        6,
    )
}

fn one_iteration(r: &mut Run, extra: Option<u64>) {
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    let b = r.alloc(32 * K, S1);
    r.free(a);
    // An unplanned request while [64K, 96K) is free again.
    let x = extra.map(|size| r.alloc(size, S1));
    let c = r.alloc(8 * K, S1);
    r.free(b);
    r.free(c);
    if let Some(x) = x {
        r.free(x);
    }
}

#[test]
fn unplanned_requests_take_holes_the_plan_does_not_need_soon() {
    let plan = one_stream_plan();
    let mut r = run();
    // Looking one expected request ahead (the plan's iteration is so short that a
    // longer horizon covers its whole pool).
    let opts = PlanOptions {
        hole_horizon: 1,
        ..PlanOptions::default()
    };
    r.engine.load_plan(&plan, opts).unwrap();
    let param = r.alloc(64 * K, S1);
    for _ in 0..3 {
        one_iteration(&mut r, Some(4 * K));
    }
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!(
        (st.hits, st.conflicts, st.unplanned),
        (1 + 9, 0, 3),
        "{st:?}"
    );
    assert_eq!(st.holes, 3, "{st:?}");
    // Nothing went online: reserved memory is the pool alone.
    let s = r.engine.stats().unwrap();
    assert_eq!(s.reserved_bytes[0].peak as u64, 128 * K);
    // The extra request did not take [64K, 72K), where the temporary comes next.
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    let b = r.alloc(32 * K, S1);
    r.free(a);
    let x = r.alloc(4 * K, S1);
    let (base, _) = r.engine.plan_pool().unwrap().unwrap();
    let off = x.get() - base.get();
    assert_eq!(off, 92 * K, "the high end of the hole");
    let c = r.alloc(8 * K, S1);
    assert_eq!(c.get() - base.get(), 64 * K, "the temporary still hits");
    for p in [b, c, x, param] {
        r.free(p);
    }
    r.engine.check_invariants().unwrap();
}

#[test]
fn an_unplanned_request_keeps_clear_of_a_much_larger_request_planned_later() {
    // A 512 KiB activation freed, then an unplanned 16 KiB request (its lifetime
    // unknown: it lives on here), while a 1 MiB request is planned over the whole pool
    // four requests later, beyond the one-request horizon. Put in the free 512 KiB, the
    // small request would send the 1 MiB one to the pool's tail.
    let plan = verified_plan(
        1024 * K,
        vec![],
        0,
        vec![
            req(512 * K, 0, 0, 2, S1),
            req(64 * K, 512 * K, 1, 4, S1),
            req(64 * K, 576 * K, 3, 6, S1),
            req(64 * K, 640 * K, 5, 7, S1),
            req(1024 * K, 0, 8, 9, S1),
        ],
        10,
    );
    let opts = PlanOptions {
        hole_horizon: 1,
        ..PlanOptions::default()
    };
    let (mut r, base) = serving(&plan, opts);
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(512 * K, S1);
    let b = r.alloc(64 * K, S1);
    r.free(a);
    let x = r.alloc(16 * K, S1);
    assert!(
        x.get() < base.get() || x.get() >= base.get() + 1024 * K,
        "the unplanned request took a hole the 1 MiB request needs"
    );
    let c = r.alloc(64 * K, S1);
    r.free(b);
    let d = r.alloc(64 * K, S1);
    r.free(c);
    r.free(d);
    let big = r.alloc(1024 * K, S1);
    assert_eq!(big, base, "the 1 MiB request at its planned offset");
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!((st.conflicts, st.grown), (0, 0), "{st:?}");
    r.free(big);
    r.free(x);
    r.engine.check_invariants().unwrap();
}

#[test]
fn without_a_safe_hole_a_request_goes_online() {
    let plan = one_stream_plan();
    let mut r = run();
    r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
    let param = r.alloc(64 * K, S1);
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    let b = r.alloc(32 * K, S1);
    r.free(a);
    // 24 KiB (a size the plan does not have) fits only in [64K, 96K), where the
    // temporary and the next iteration's first activation come next.
    let x = r.alloc(24 * K, S1);
    assert!(!r.in_pool(x));
    let c = r.alloc(8 * K, S1);
    assert!(r.in_pool(c));
    for p in [b, c, x, param] {
        r.free(p);
    }
    // With holes off, every unplanned request goes online.
    let mut r = run();
    r.engine
        .load_plan(
            &plan,
            PlanOptions {
                holes: false,
                ..PlanOptions::default()
            },
        )
        .unwrap();
    let param = r.alloc(64 * K, S1);
    let y = r.alloc(512, S1);
    assert!(!r.in_pool(y));
    assert_eq!(r.engine.plan_stats().unwrap().unwrap().holes, 0);
    r.free(y);
    r.free(param);
    r.engine.check_invariants().unwrap();
}

/// Stream 1 writes [0, 32K) then stream 2 reuses it; [32K, 64K) is stream 2's alone.
fn shared_range_plan() -> Plan {
    verified_plan(
        64 * K,
        vec![],
        0,
        vec![
            req(32 * K, 0, 0, 1, S1),
            req(32 * K, 0, 2, 4, S2),
            req(16 * K, 32 * K, 3, 5, S2),
        ],
        6,
    )
}

/// Plan options with stream waits off: a range held by a pending free is a conflict.
fn no_waits() -> PlanOptions {
    PlanOptions {
        wait_for_pending_frees: false,
        ..PlanOptions::default()
    }
}

#[test]
fn a_range_shared_by_two_streams_is_reused_only_after_the_event() {
    // Without stream waits: stream 2 gets the range only once stream 1 has passed it.
    let plan = shared_range_plan();
    let (mut r, base) = serving(&plan, no_waits());
    for it in 0..3 {
        r.engine.mark_iteration().unwrap();
        let a = r.alloc(32 * K, S1);
        assert_eq!(a, base, "iteration {it}: stream 1's request hits");
        r.free(a);
        // Stream 1 has not passed the free yet: its range is still pending.
        let b = r.alloc(32 * K, S2);
        assert_ne!(
            b, base,
            "iteration {it}: reused before stream 1 passed the free"
        );
        let c = r.alloc(16 * K, S2);
        assert_eq!(
            c.get(),
            base.get() + 32 * K,
            "stream 2's own range needs no event"
        );
        r.free(b);
        r.free(c);
        r.host.events().pass_all(S1);
        r.host.events().pass_all(S2);
        r.engine.process_events().unwrap();
    }
    // Once stream 1 keeps up, stream 2 gets the shared range as planned.
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    r.free(a);
    r.host.events().pass_all(S1);
    let b = r.alloc(32 * K, S2);
    assert_eq!(b, base);
    r.free(b);
    r.host.events().pass_all(S2);
    r.engine.process_events().unwrap();
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert!(st.conflicts >= 3, "{st:?}");
    r.engine.check_invariants().unwrap();
    assert_eq!(r.engine.stats().unwrap().active_bytes[0].current, 0);
}

#[test]
fn switching_mid_run_serves_the_steady_slice_next_to_the_online_allocations() {
    let plan = one_stream_plan();
    let slice = steady_slice(&plan).unwrap();
    assert_eq!(
        slice.pool_size,
        Bytes(64 * K),
        "the parameter's room is squeezed out"
    );
    let mut r = run();
    r.engine.start_trace().unwrap();
    // Online phase: the parameter and two iterations.
    let param = r.alloc(64 * K, S1);
    for _ in 0..2 {
        one_iteration(&mut r, None);
    }
    let online_reserved = r.engine.stats().unwrap().reserved_bytes[0].current as u64;
    r.engine.mark_iteration().unwrap();
    let trace = r.engine.take_trace().unwrap().unwrap();
    trace.validate().unwrap();
    r.engine
        .switch_to_plan(&plan, PlanOptions::default())
        .unwrap();
    assert_eq!(
        r.engine.plan_position().unwrap(),
        Some((PlanSection::Iteration, 0))
    );
    let (_, pool) = r.engine.plan_pool().unwrap().unwrap();
    assert_eq!(pool, Bytes(G), "one granule for the 64 KiB slice");
    for _ in 0..3 {
        let a = r.alloc(32 * K, S1);
        assert!(r.in_pool(a));
        let b = r.alloc(32 * K, S1);
        r.free(a);
        let c = r.alloc(8 * K, S1);
        r.free(b);
        r.free(c);
        r.engine.mark_iteration().unwrap();
    }
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!((st.hits, st.conflicts, st.unplanned), (9, 0, 0), "{st:?}");
    // The parameter stayed online, where it was.
    assert!(!r.in_pool(param));
    let s = r.engine.stats().unwrap();
    assert!(s.reserved_bytes[0].current as u64 <= online_reserved.max(G) + G);
    assert!(
        r.engine
            .switch_to_plan(&plan, PlanOptions::default())
            .is_err()
    );
    r.free(param);
    r.engine.check_invariants().unwrap();
}

#[test]
fn a_large_request_without_a_hole_grows_the_pool_at_its_tail() {
    // Pool of 4 granules: a 3-granule parameter, then per iteration an activation of
    // one granule at the top.
    let plan = verified_plan(
        4 * G,
        vec![req(3 * G, 0, 0, NEVER_FREED, S1)],
        1,
        vec![req(G, 3 * G, 0, 1, S1)],
        2,
    );
    let mut r = run();
    r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
    let (base, len) = r.engine.plan_pool().unwrap().unwrap();
    assert_eq!(len, Bytes(4 * G));
    let param = r.alloc(3 * G, S1);
    r.engine.mark_iteration().unwrap();
    // 2 MiB (large pool), unplanned: no hole, the top granule is planned next.
    let big = r.alloc(2 << 20, S1);
    assert!(
        big.get() >= base.get() + 4 * G,
        "wholly above the planned pool"
    );
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!((st.grown, st.holes, st.unplanned), (1, 1, 1));
    let reserved = r.engine.stats().unwrap().reserved_bytes[0].current as u64;
    // The pool maps granules as they are first used: the parameter's 3, and the big
    // request's own, not yet the activation's.
    assert_eq!(reserved, 3 * G + (2 << 20), "only the granules used");
    let act = r.alloc(G, S1);
    assert_eq!(
        act.get(),
        base.get() + 3 * G,
        "the planned request still hits"
    );
    let reserved = r.engine.stats().unwrap().reserved_bytes[0].current as u64;
    assert_eq!(reserved, 4 * G + (2 << 20));
    r.free(act);
    r.free(big);
    // The grown tail is a hole now: the next big request reuses it, no growth.
    r.engine.mark_iteration().unwrap();
    let again = r.alloc(2 << 20, S1);
    assert_eq!(again, big);
    assert_eq!(r.engine.plan_stats().unwrap().unwrap().grown, 1);
    r.free(again);
    r.free(param);
    r.engine.check_invariants().unwrap();
}

#[test]
fn a_spent_prologue_only_plan_gives_back_its_free_granules_and_grows_like_an_arena() {
    // Prologue only: a parameter (never freed) at the top, a 2 MiB temporary below.
    const M2: u64 = 2 << 20;
    let plan = verified_plan(
        M2 + G,
        vec![req(G, M2, 0, NEVER_FREED, S1), req(M2, 0, 1, 2, S1)],
        3,
        vec![],
        0,
    );
    let (mut r, base) = serving(&plan, PlanOptions::default());
    let param = r.alloc(G, S1);
    let tmp = r.alloc(M2, S1);
    assert_eq!(tmp, base);
    r.free(tmp);
    let reserved = |r: &Run| r.engine.stats().unwrap().reserved_bytes[0].current as u64;
    assert_eq!(reserved(&r), M2 + G);
    // The run goes on past the plan: at the next boundary the free granules go back.
    r.engine.mark_iteration().unwrap();
    assert_eq!(reserved(&r), G, "only the parameter's granule stays mapped");
    // A large request now goes at the lowest free-and-unmapped run of the pool.
    let big = r.alloc(M2, S1);
    assert_eq!(big, base, "the lowest run: the temporary's old place");
    assert_eq!(reserved(&r), G + M2);
    // Larger than that run: above the parameter.
    let bigger = r.alloc(M2 + G, S1);
    assert_eq!(bigger.get(), base.get() + M2 + G);
    r.free(bigger);
    r.free(big);
    r.free(param);
    r.engine.check_invariants().unwrap();
}

#[test]
fn an_unplanned_request_takes_the_gap_between_the_ranges_the_next_requests_need() {
    // Pool of 4 granules: a parameter in the first, then per iteration two activations
    // at the two ends of the rest, [G, 1.5G) and [3.5G, 4G). Between iterations (an
    // evaluation, a checkpoint), the free block [G, 4G) has both ends planned next, but
    // its middle is free until the activations come and go again.
    let h = G / 2;
    // A setup temporary maps the whole pool first.
    let plan = verified_plan(
        4 * G,
        vec![req(G, 0, 0, NEVER_FREED, S1), req(3 * G, G, 1, 2, S1)],
        3,
        vec![req(h, G, 0, 2, S1), req(h, 4 * G - h, 1, 3, S1)],
        4,
    );
    let (mut r, base) = serving(&plan, PlanOptions::default());
    let param = r.alloc(G, S1);
    let setup = r.alloc(3 * G, S1);
    r.free(setup);
    for _ in 0..2 {
        r.engine.mark_iteration().unwrap();
        let a = r.alloc(h, S1);
        let b = r.alloc(h, S1);
        assert_eq!((a.get(), b.get()), (base.get() + G, base.get() + 4 * G - h));
        r.free(a);
        r.free(b);
        // Unplanned, 1.5 granules: neither end of the free block is safe, the middle
        // is. It goes there, inside the planned pool, which does not grow.
        let x = r.alloc(G + h, S1);
        assert!(
            x.get() >= base.get() + G + h && x.get() + G + h <= base.get() + 4 * G - h,
            "{x} is not in the gap"
        );
        r.free(x);
    }
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!((st.hits, st.grown, st.conflicts), (6, 0, 0), "{st:?}");
    r.free(param);
    r.engine.check_invariants().unwrap();
}

#[test]
fn unloading_a_plan_keeps_its_live_blocks_serves_online_and_gives_the_pool_back() {
    let plan = one_stream_plan();
    let mut r = run();
    r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
    let param = r.alloc(64 * K, S1);
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    assert!(r.in_pool(a));
    let (base, _) = r.engine.plan_pool().unwrap().unwrap();
    assert!(r.engine.unload_plan().unwrap());
    assert!(!r.engine.unload_plan().unwrap(), "nothing left to unload");
    assert!(r.engine.plan_pool().unwrap().is_none());
    r.engine.check_invariants().unwrap();
    // The next request is served online, outside the old pool.
    let b = r.alloc(32 * K, S1);
    assert!(
        b.get() < base.get() || b.get() >= base.get() + 128 * K,
        "{b}"
    );
    // The pool's blocks are still valid and freed as usual (sentinels checked).
    r.free(a);
    r.free(param);
    r.engine.empty_cache().unwrap();
    r.engine.check_invariants().unwrap();
    let s = r.engine.stats().unwrap();
    assert_eq!(
        s.reserved_bytes[0].current as u64, G,
        "only b's granule is left mapped"
    );
    // A plan can be loaded again.
    r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
    let param = r.alloc(64 * K, S1);
    assert!(r.in_pool(param));
    r.free(param);
    r.free(b);
    r.engine.check_invariants().unwrap();
}

/// A 3-granule memory limit, two granules held online by another stream, then the
/// 2-granule plan: accepted, since its pool is mapped only as the run reaches it. Its
/// first request is served (one granule). Returns the run, the other stream's block and
/// that first request.
fn limited_run_with_plan() -> (Run, DevicePtr, DevicePtr) {
    use stweaver_core::engine::MemoryLimit;
    let mut r = run();
    r.engine
        .set_memory_limit(MemoryLimit::Bytes(Bytes(3 * G)))
        .unwrap();
    let other = r.alloc(2 * G, S2);
    r.engine
        .load_plan(&one_stream_plan(), PlanOptions::default())
        .unwrap();
    let param = r.alloc(64 * K, S1);
    assert!(r.in_pool(param));
    (r, other, param)
}

#[test]
fn a_plan_that_hits_the_memory_limit_is_given_up_and_the_run_goes_on_online() {
    let (mut r, other, param) = limited_run_with_plan();
    // The activation's granule would make 4 > 3 granules, and the other stream's two
    // are live (nothing cached to give back): the plan is given up, and the request
    // (served online now) is out of memory until the other stream frees.
    r.engine.mark_iteration().unwrap();
    let err = r.engine.malloc(Bytes(32 * K), S1).unwrap_err();
    assert!(
        matches!(err, stweaver_core::engine::EngineError::OutOfMemory { .. }),
        "{err}"
    );
    let why = r.engine.plan_abandoned().unwrap().expect("abandoned");
    assert!(why.contains("memory limit"), "{why}");
    assert!(r.engine.plan_pool().unwrap().is_none());
    r.engine.check_invariants().unwrap();
    r.free(other);
    let a = r.alloc(32 * K, S1);
    let b = r.alloc(32 * K, S1);
    r.engine.check_invariants().unwrap();
    for p in [a, b, param] {
        r.free(p);
    }
    r.engine.empty_cache().unwrap();
    assert_eq!(r.engine.stats().unwrap().reserved_bytes[0].current, 0);
    r.engine.check_invariants().unwrap();
}

#[test]
fn at_the_memory_limit_a_request_takes_any_free_hole_of_the_pool_before_the_plan_is_given_up() {
    use stweaver_core::engine::MemoryLimit;
    // Granule 0 of the pool holds a 16K parameter and 48K free; the iteration's
    // requests are planned in granule 1, which the limit (3 granules, two held by
    // another stream) does not let the run map.
    let plan = verified_plan(
        128 * K,
        vec![req(16 * K, 0, 0, NEVER_FREED, S1)],
        1,
        vec![req(32 * K, 64 * K, 0, 2, S1), req(16 * K, 96 * K, 1, 3, S1)],
        4,
    );
    let mut r = run();
    r.engine
        .set_memory_limit(MemoryLimit::Bytes(Bytes(3 * G)))
        .unwrap();
    let other = r.alloc(2 * G, S2);
    r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
    let param = r.alloc(16 * K, S1);
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    let b = r.alloc(16 * K, S1);
    // Both in granule 0's free part: the plan goes on, each counted as a conflict.
    assert!(r.in_pool(a) && r.in_pool(b));
    assert!(a.get() < r.engine.plan_pool().unwrap().unwrap().0.get() + G);
    assert_eq!(r.engine.plan_abandoned().unwrap(), None);
    assert_eq!(
        r.engine.stats().unwrap().reserved_bytes[0].current as u64,
        3 * G
    );
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!(st.conflicts, 2, "{st:?}");
    r.engine.check_invariants().unwrap();
    // Once the other stream's memory is gone, the plan's own places are served.
    r.free(a);
    r.free(b);
    r.free(other);
    r.engine.empty_cache().unwrap();
    r.engine.mark_iteration().unwrap();
    let base = r.engine.plan_pool().unwrap().unwrap().0.get();
    let a = r.alloc(32 * K, S1);
    assert_eq!(a.get(), base + 64 * K);
    r.free(a);
    r.free(param);
    r.engine.check_invariants().unwrap();
}

#[test]
fn cached_online_memory_is_given_back_before_a_plan_is_given_up_for_the_limit() {
    // The other stream's two granules are cached online once freed, as the online
    // phase of auto mode leaves them.
    let (mut r, other, param) = limited_run_with_plan();
    r.free(other);
    r.engine.mark_iteration().unwrap();
    // The activation's granule would make 4 > 3 granules: the cached two go back to the
    // device first, and the plan goes on serving.
    let a = r.alloc(32 * K, S1);
    assert!(r.in_pool(a), "served from the plan's pool");
    assert_eq!(r.engine.plan_abandoned().unwrap(), None);
    let s = r.engine.stats().unwrap();
    assert_eq!(s.reserved_bytes[0].current as u64, 2 * G);
    assert_eq!(s.num_alloc_retries, 1);
    r.engine.check_invariants().unwrap();
    for p in [a, param] {
        r.free(p);
    }
    r.engine.check_invariants().unwrap();
}

/// Near the limit the engine gives back cache first, then the plan's pool, then reports
/// out of memory: an online request that fits only once the pool's free granules go back
/// gives the plan up and is served.
#[test]
fn an_online_request_over_the_limit_gives_up_the_plan_before_out_of_memory() {
    use stweaver_core::engine::{EngineError, MemoryLimit};
    let mut r = run();
    r.engine
        .set_memory_limit(MemoryLimit::Bytes(Bytes(4 * G)))
        .unwrap();
    let other = r.alloc(G, S2);
    r.engine
        .load_plan(&one_stream_plan(), PlanOptions::default())
        .unwrap();
    let param = r.alloc(64 * K, S1);
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    let b = r.alloc(32 * K, S1);
    assert!(r.in_pool(a) && r.in_pool(b));
    r.free(a);
    r.free(b);
    // 3 granules mapped (one online, two of the pool), one of them free in the pool.
    assert_eq!(
        r.engine.stats().unwrap().reserved_bytes[0].current,
        3 * G as i64
    );
    // Two more granules online: 5 > 4 with the cache given back (the pool is pinned),
    // so the plan is given up, its free granule goes back, and the request fits.
    let big = r.alloc(2 * G, S2);
    let why = r
        .engine
        .plan_abandoned()
        .unwrap()
        .expect("the plan was given up");
    assert!(why.contains("given up"), "{why}");
    assert!(r.engine.plan_pool().unwrap().is_none());
    assert_eq!(r.engine.stats().unwrap().num_alloc_retries, 2);
    r.engine.check_invariants().unwrap();
    // Nothing left to give back: out of memory, and the run is intact.
    let err = r.engine.malloc(Bytes(G), S2).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory { .. }), "{err}");
    for p in [big, other, param] {
        r.free(p);
    }
    r.engine.empty_cache().unwrap();
    assert_eq!(r.engine.stats().unwrap().reserved_bytes[0].current, 0);
    r.engine.check_invariants().unwrap();
}

/// Under a memory limit the pool maps granule by granule: a first-touched range of four
/// granules, later holding one small live block, gives back its three free granules once
/// the plan is given up (one unit of four granules would stay mapped whole, and the
/// online request below would be out of memory).
#[test]
fn under_a_limit_a_given_up_pool_gives_back_every_free_granule() {
    use stweaver_core::engine::MemoryLimit;
    let plan = verified_plan(
        4 * G,
        vec![],
        0,
        vec![req(4 * G, 0, 0, 1, S1), req(8 * K, 0, 1, 3, S1)],
        3,
    );
    let mut r = run();
    r.engine
        .set_memory_limit(MemoryLimit::Bytes(Bytes(6 * G)))
        .unwrap();
    let other = r.alloc(G, S2);
    r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
    r.engine.mark_iteration().unwrap();
    let big = r.alloc(4 * G, S1);
    assert!(r.in_pool(big));
    r.free(big);
    let small = r.alloc(8 * K, S1);
    assert!(r.in_pool(small));
    assert_eq!(
        r.engine.stats().unwrap().reserved_bytes[0].current,
        5 * G as i64
    );
    // 5 + 3 > 6: the cache goes back (none: the pool is pinned), then the plan, whose
    // three free granules go back, and the request fits: 2 + 3 <= 6.
    let x = r.alloc(3 * G, S2);
    assert!(r.engine.plan_abandoned().unwrap().is_some());
    assert_eq!(
        r.engine.stats().unwrap().reserved_bytes[0].current,
        5 * G as i64
    );
    r.engine.check_invariants().unwrap();
    for p in [x, small, other] {
        r.free(p);
    }
    r.engine.empty_cache().unwrap();
    assert_eq!(r.engine.stats().unwrap().reserved_bytes[0].current, 0);
}

#[test]
fn the_plan_streams_are_bound_to_the_run_streams_as_they_first_show_up() {
    // The plan was made in another process: its side stream had handle 2, the run's
    // has 7. Stream 1 (say the default stream) keeps its id.
    let run_side = StreamId(7);
    let plan = verified_plan(
        64 * K,
        vec![],
        0,
        vec![
            req(32 * K, 0, 0, 1, S1),
            req(16 * K, 32 * K, 2, 4, S2),
            req(8 * K, 48 * K, 3, 5, S1),
        ],
        6,
    );
    let (mut r, base) = serving(&plan, PlanOptions::default());
    for it in 0..3 {
        r.engine.mark_iteration().unwrap();
        let a = r.alloc(32 * K, S1);
        assert_eq!(a, base, "iteration {it}");
        r.free(a);
        // A stream the plan has never heard of, with a request the plan does not
        // expect: not bound, served online.
        let x = r.alloc(4 * K, StreamId(9));
        assert!(!r.in_pool(x));
        let b = r.alloc(16 * K, run_side);
        assert_eq!(
            b.get(),
            base.get() + 32 * K,
            "iteration {it}: side stream bound"
        );
        let c = r.alloc(8 * K, S1);
        assert_eq!(c.get(), base.get() + 48 * K, "iteration {it}");
        for p in [x, b, c] {
            r.free(p);
        }
        r.host.events().pass_all(S1);
        r.host.events().pass_all(run_side);
        r.engine.process_events().unwrap();
    }
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!((st.hits, st.conflicts), (9, 0), "{st:?}");
    r.engine.check_invariants().unwrap();
}

#[test]
fn a_plan_whose_ranges_stay_busy_is_given_up_after_two_iterations() {
    // 40 pairs per iteration: stream 1 uses a range, then stream 2 reuses it. Stream
    // 1's work never passes its frees here (a collective stream running behind), so
    // every stream-2 request finds its range busy: half the requests conflict.
    let n = 40u64;
    let mut iteration = Vec::new();
    for k in 0..n {
        iteration.push(req(4 * K, k * 4 * K, 2 * k, 2 * k + 1, S1));
        iteration.push(req(4 * K, k * 4 * K, 2 * k + 1, 2 * k + 2, S2));
    }
    let plan = verified_plan(n * 4 * K, vec![], 0, iteration, 2 * n + 1);
    let mut r = run();
    // (With stream waits on, stream 2 would wait for stream 1's frees instead.)
    r.engine.load_plan(&plan, no_waits()).unwrap();
    let mut held = Vec::new();
    for it in 0..4 {
        r.engine.mark_iteration().unwrap();
        let served = r.engine.plan_pool().unwrap().is_some();
        assert_eq!(served, it < 2, "iteration {it}");
        for _ in 0..n {
            let a = r.alloc(4 * K, S1);
            r.free(a);
            let b = r.alloc(4 * K, S2);
            held.push(b);
        }
        for b in held.drain(..) {
            r.free(b);
        }
        r.host.events().pass_all(S2);
        r.engine.process_events().unwrap();
    }
    let why = r.engine.plan_abandoned().unwrap().expect("given up");
    assert!(why.contains("planned range busy"), "{why}");
    r.engine.check_invariants().unwrap();
    // With the option at 0 the plan is kept.
    let mut r = run();
    let opts = PlanOptions {
        give_up_conflict_percent: 0,
        ..no_waits()
    };
    r.engine.load_plan(&plan, opts).unwrap();
    for _ in 0..4 {
        r.engine.mark_iteration().unwrap();
        for _ in 0..n {
            let a = r.alloc(4 * K, S1);
            r.free(a);
            let b = r.alloc(4 * K, S2);
            r.free(b);
        }
    }
    assert!(r.engine.plan_pool().unwrap().is_some());
    assert!(r.engine.plan_abandoned().unwrap().is_none());
}

#[test]
fn a_range_held_by_a_pending_free_is_taken_after_its_stream_waits() {
    let plan = shared_range_plan();
    let (mut r, base) = serving(&plan, PlanOptions::default());
    for it in 0..3 {
        r.engine.mark_iteration().unwrap();
        let a = r.alloc(32 * K, S1);
        assert_eq!(a, base, "iteration {it}");
        let mark = r.host.events().recordings();
        r.free(a);
        // The free recorded one event on stream 1, which has not passed it.
        let recs = r.host.events().recorded_since(mark);
        assert_eq!(recs.len(), 1, "iteration {it}: {recs:?}");
        let (on, seq) = recs[0];
        assert_eq!(on, S1);
        assert!(!r.host.events().passed(on, seq));
        assert!(!r.host.events().ordered_after(S2, on, seq));
        // Stream 2 is made to wait for it, and gets its planned range.
        let b = r.alloc(32 * K, S2);
        assert_eq!(b, base, "iteration {it}: planned range after the wait");
        assert!(r.host.events().ordered_after(S2, on, seq), "iteration {it}");
        let c = r.alloc(16 * K, S2);
        assert_eq!(c.get(), base.get() + 32 * K);
        r.free(b);
        r.free(c);
        r.engine.check_invariants().unwrap();
    }
    // Stream 2 waited in every iteration, and stream 1 from the second on (for stream
    // 2's free of the shared range, which no stream passed either).
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!((st.waits, st.conflicts), (5, 0), "{st:?}");
    let ev = r.host.events();
    assert_eq!(ev.waits(), 5);
    // Each stream waited for the other's frees: stream 1 alone stops at its first wait
    // for an event stream 2 has not passed, and both get through together.
    ev.pass_all(S1);
    assert!(ev.outstanding(S1) > 0);
    r.settle_idle();
    let ev = r.host.events();
    assert_eq!((ev.outstanding(S1), ev.outstanding(S2)), (0, 0));
}

#[test]
fn the_part_of_a_pending_free_outside_the_range_is_fenced_behind_the_waiting_stream() {
    // Stream 1 uses [0, 64K); then stream 2 reuses [0, 32K) and stream 3 [32K, 64K).
    let s3 = StreamId(3);
    let plan = verified_plan(
        64 * K,
        vec![],
        0,
        vec![
            req(64 * K, 0, 0, 1, S1),
            req(32 * K, 0, 2, 5, S2),
            req(32 * K, 32 * K, 3, 5, s3),
        ],
        6,
    );
    let (mut r, base) = serving(&plan, PlanOptions::default());
    for it in 0..3 {
        r.engine.mark_iteration().unwrap();
        let a = r.alloc(64 * K, S1);
        assert_eq!(a, base, "iteration {it}");
        let mark = r.host.events().recordings();
        r.free(a);
        let (on, seq) = r.host.events().recorded_since(mark)[0];
        let b = r.alloc(32 * K, S2);
        assert_eq!(b, base, "iteration {it}: stream 2 waited");
        // [32K, 64K) was freed by stream 1 too: stream 3 may have it only once it is
        // ordered after stream 1's free (through stream 2's fence event).
        let c = r.alloc(32 * K, s3);
        if c.get() == base.get() + 32 * K {
            assert!(
                r.host.events().ordered_after(s3, on, seq),
                "iteration {it}: stream 3 got stream 1's memory unordered"
            );
        }
        r.free(b);
        r.free(c);
        r.engine.check_invariants().unwrap();
    }
    // Nothing in use is left once every stream has passed everything.
    r.settle_idle();
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert!(st.waits >= 3, "{st:?}");
}

#[test]
fn a_live_block_in_the_planned_range_is_a_conflict_not_a_wait() {
    let plan = shared_range_plan();
    let (mut r, base) = serving(&plan, PlanOptions::default());
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    assert_eq!(a, base);
    // Something else pending, so that the engine looks for pending frees at all.
    let x = r.alloc(4 * K, S1);
    r.engine.record_stream(x, S2).unwrap();
    r.free(x);
    // Stream 1's block is still live: stream 2 must go elsewhere.
    let b = r.alloc(32 * K, S2);
    assert_ne!(b, base);
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!((st.waits, st.conflicts), (0, 1), "{st:?}");
    assert_eq!(r.host.events().waits(), 0);
    r.free(a);
    r.free(b);
    r.engine.check_invariants().unwrap();
}

#[test]
fn a_refused_wait_leaves_the_free_pending_and_serves_the_request_elsewhere() {
    let plan = shared_range_plan();
    let (mut r, base) = serving(&plan, PlanOptions::default());
    r.host.events().refuse_waits(true);
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    r.free(a);
    let b = r.alloc(32 * K, S2);
    assert_ne!(b, base, "no wait, no reuse");
    let c = r.alloc(16 * K, S2);
    r.free(b);
    r.free(c);
    r.engine.check_invariants().unwrap();
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!((st.waits, st.conflicts), (0, 1), "{st:?}");
    // The free is still pending, and completes once stream 1 passes it.
    assert!(r.engine.stats().unwrap().active_bytes[0].current > 0);
    r.settle_idle();
    // Waits work again: the next iteration waits instead.
    r.host.events().refuse_waits(false);
    r.engine.mark_iteration().unwrap();
    let a = r.alloc(32 * K, S1);
    r.free(a);
    let b = r.alloc(32 * K, S2);
    assert_eq!(b, base);
    r.free(b);
    r.engine.check_invariants().unwrap();
}

#[test]
fn a_planned_range_partly_pending_and_partly_never_mapped_is_mapped_then_waited_for() {
    // A (one granule) is used on stream 2 too and freed: pending on stream 2's event.
    // B (two granules) is planned over A's granule and one never mapped yet: the new
    // granule is mapped, stream 1 waits for the event, and B gets its planned place (a
    // threshold-offloaded tensor's pending free under a prologue's first large request).
    let plan = verified_plan(
        2 * G,
        vec![],
        0,
        vec![req(G, 0, 0, 1, S1), req(2 * G, 0, 2, 3, S1)],
        4,
    );
    let (mut r, base) = serving(&plan, PlanOptions::default());
    for it in 0..3 {
        r.engine.mark_iteration().unwrap();
        let a = r.alloc(G, S1);
        assert_eq!(a, base, "iteration {it}");
        r.engine.record_stream(a, S2).unwrap();
        let mark = r.host.events().recordings();
        r.free(a);
        let (on, seq) = r.host.events().recorded_since(mark)[0];
        assert!(!r.host.events().passed(on, seq));
        let b = r.alloc(2 * G, S1);
        assert_eq!(
            b, base,
            "iteration {it}: B waited and got its planned place"
        );
        assert!(r.host.events().ordered_after(S1, on, seq), "iteration {it}");
        r.free(b);
        r.engine.check_invariants().unwrap();
    }
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert_eq!(st.conflicts, 0, "{st:?}");
    assert!(st.waits >= 1, "{st:?}");
    r.settle_idle();
}
