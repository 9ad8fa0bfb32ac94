//! Planned offload under a budget (`stweaver_planner::offload`): on a transformer-like
//! trace and on random ones, every schedule verifies with `pool <= budget`, a refusal
//! names a minimum above the budget that no plan beats, and the offload plan survives
//! the plan file.

use proptest::prelude::*;
use stweaver_core::plan_file::{plan_from_bytes, plan_to_bytes};
use stweaver_core::testkit::TraceBuilder;
use stweaver_core::verify::verify_plan;
use stweaver_core::{Bytes, EventKind, MarkerKind, Trace};
use stweaver_planner::classify::{Steady, classify};
use stweaver_planner::engine_replay::{EngineReplayOptions, ServeMode, replay_engine};
use stweaver_planner::offload::{OffloadError, OffloadOptions, Timing, plan_with_budget};

const MIB: u64 = 1 << 20;

/// A trace builder whose every event is `step_us` after the previous one (all at time 0
/// when `step_us` is 0).
fn builder(step_us: u64) -> TraceBuilder {
    if step_us == 0 {
        TraceBuilder::new()
    } else {
        TraceBuilder::with_clock(1_700_000_000_000_000, step_us)
    }
}

/// One iteration's shape: saved activations (size, saved?) in forward order, the
/// backward order (a permutation), temporaries.
#[derive(Debug, Clone)]
struct Shape {
    persistent: Vec<u64>,
    acts: Vec<(u64, bool)>,
    backward: Vec<usize>,
    temp: u64,
    grad: u64,
    iterations: usize,
}

fn build(s: &Shape, step_us: u64, with_packs: bool) -> Trace {
    let mut b = builder(step_us);
    for &p in &s.persistent {
        b.alloc(p);
    }
    for _ in 0..s.iterations {
        b.iteration_begin();
        let mut ids = Vec::new();
        for &(size, saved) in &s.acts {
            let id = b.alloc(size);
            if saved && with_packs {
                b.ev(EventKind::SavedPack(id));
            }
            let t = b.alloc(s.temp);
            b.free(t);
            ids.push(id);
        }
        let mut grads = Vec::new();
        for &l in &s.backward {
            let (id, saved) = (ids[l], s.acts[l].1);
            if saved && with_packs {
                b.ev(EventKind::SavedUnpack(id));
            }
            let g = b.alloc(s.grad);
            let t = b.alloc(s.temp);
            b.free(t);
            b.free(id);
            grads.push(g);
        }
        for g in grads {
            b.free(g);
        }
    }
    b.done()
}

/// Params + optimizer state persistent (288 MiB), 12 layers of 64 MiB activations
/// saved in forward and unpacked in reverse order in backward, 8 MiB weight gradients
/// made in backward, a 16 MiB temporary per layer; 1 ms between events.
fn transformer() -> Shape {
    Shape {
        persistent: vec![8 * MIB; 36],
        acts: vec![(64 * MIB, true); 12],
        backward: (0..12).rev().collect(),
        temp: 16 * MIB,
        grad: 8 * MIB,
        iterations: 4,
    }
}

#[test]
fn saved_events_change_neither_the_period_nor_the_classes() {
    for timed in [0, 1000] {
        let with = build(&transformer(), timed, true);
        let without = build(&transformer(), timed, false);
        for t in [&with, &without] {
            // Also without iteration markers: the period comes from the sequence.
            let mut bare = t.clone();
            bare.events
                .retain(|e| !matches!(e.kind, EventKind::Marker { .. }));
            let (a, b) = (classify(t), classify(&bare));
            assert!(matches!(a.steady, Steady::Periodic(_)));
            assert!(matches!(b.steady, Steady::Periodic(_)));
        }
        let (a, b) = (classify(&with), classify(&without));
        assert_eq!(
            (a.prologue_len, a.iteration_len, a.repetitions),
            (b.prologue_len, b.iteration_len, b.repetitions)
        );
        assert_eq!(a.slots, b.slots);
        assert_eq!(a.classes, b.classes);
        let strip = |t: &Trace| {
            let mut t = t.clone();
            t.events
                .retain(|e| !matches!(e.kind, EventKind::Marker { .. }));
            classify(&t)
        };
        let (a, b) = (strip(&with), strip(&without));
        assert_eq!(
            (a.iteration_len, a.slots.len()),
            (b.iteration_len, b.slots.len())
        );
        assert_eq!(a.classes, b.classes);
    }
}

#[test]
fn transformer_at_0_8_lb_moves_far_fewer_bytes_than_everything() {
    let trace = build(&transformer(), 1000, true);
    let lb = trace.lower_bound().bytes;
    let budget = Bytes(lb.get() * 8 / 10);
    // The default times the iteration by its period split between forward and backward
    // and spread over their requests; this synthetic trace's times are the device's
    // already (one request per ms).
    let spread = plan_with_budget(&trace, &OffloadOptions::new(budget)).expect("fits");
    assert_eq!(spread.offload.timing, Timing::SpreadPhases);
    assert!(spread.outcome.plan.pool_size <= budget);
    let mut opts = OffloadOptions::new(budget);
    opts.host_times = true;
    let o = plan_with_budget(&trace, &opts).expect("fits");
    let plan = &o.outcome.plan;
    verify_plan(plan).expect("verifies");
    let r = &o.offload;
    assert!(plan.pool_size <= budget);
    assert_eq!(plan.budget, Some(budget));
    assert_eq!(plan.offload.len(), r.tensors);
    assert_eq!((plan.saved_packs, plan.saved_unpacks), (12, 12));
    assert_eq!(r.timing, Timing::TraceTimes);
    assert_eq!(r.candidates, 12);
    assert_eq!(r.candidate_bytes, Bytes(12 * 64 * MIB));
    // LB 1.16 GiB, budget 0.93 GiB: 4 activations (256 MiB) instead of all 12 (768 MiB).
    assert_eq!(lb, Bytes(1080 * MIB), "{lb}");
    assert_eq!(r.bytes_per_iteration, Bytes(4 * 64 * MIB), "{r:?}");
    assert_eq!(r.stalls, 0, "{r:?}");
    // Which ones: the first layers of forward (their windows are the longest).
    let mut packs: Vec<u32> = plan.offload.iter().map(|e| e.pack).collect();
    packs.sort_unstable();
    assert_eq!(packs, vec![0, 1, 2, 3], "{:?}", plan.offload);
    for e in &plan.offload {
        assert_eq!(e.unpack, 11 - e.pack, "reverse order");
        let trigger = e
            .prefetch_after_unpack
            .expect("an earlier unpack leaves time");
        assert!(trigger < e.unpack);
    }
    // The engine serves the run as rewritten for the schedule from the plan, with no
    // overlap (checked at every step) and every request at its planned place.
    let rewritten = o.rewritten.as_ref().expect("offloads");
    let served = replay_engine(
        rewritten,
        &ServeMode::Plan(plan),
        &EngineReplayOptions::default(),
    )
    .expect("replays");
    assert_eq!(served.plan_abandoned, None);
    let stats = served.plan_stats.expect("plan mode");
    assert_eq!(stats.conflicts, 0, "{stats:?}");
    assert_eq!(served.counts.online, 0, "{:?}", served.counts);
    assert!(served.peak_reserved <= budget, "{}", served.peak_reserved);
    // And the file keeps the schedule.
    let back = plan_from_bytes(&plan_to_bytes(plan).unwrap()).unwrap();
    assert_eq!(&back, plan);
}

#[test]
fn without_iteration_markers_the_schedule_is_the_same() {
    let mut trace = build(&transformer(), 1000, true);
    let budget = Bytes(trace.lower_bound().bytes.get() * 8 / 10);
    let marked = plan_with_budget(&trace, &OffloadOptions::new(budget)).unwrap();
    trace
        .events
        .retain(|e| !matches!(e.kind, EventKind::Marker { .. }));
    let bare = plan_with_budget(&trace, &OffloadOptions::new(budget)).unwrap();
    verify_plan(&bare.outcome.plan).unwrap();
    assert!(bare.outcome.plan.pool_size <= budget);
    assert_eq!(
        bare.offload.bytes_per_iteration,
        marked.offload.bytes_per_iteration
    );
    let ords = |o: &stweaver_planner::offload::BudgetOutcome| {
        let mut v: Vec<(u32, u32)> = o
            .outcome
            .plan
            .offload
            .iter()
            .map(|e| (e.pack, e.unpack))
            .collect();
        v.sort_unstable();
        v
    };
    assert_eq!(ords(&bare), ords(&marked));
}

#[test]
fn a_slow_link_stalls_and_event_counts_time_a_trace_without_times() {
    // Per iteration: `a` (8 MiB) saved early, 30 ms of small work, a 64 MiB temporary
    // (the peak), `b` saved 1 ms before backward unpacks `a`. At 1 GB/s the copy out
    // of `a` (8.4 ms) is done before the peak, but the copy back cannot be: a stall.
    let mut bld = builder(1000);
    bld.alloc(32 * MIB);
    for _ in 0..3 {
        bld.iteration_begin();
        let a = bld.alloc(8 * MIB);
        bld.ev(EventKind::SavedPack(a));
        for _ in 0..10 {
            let t = bld.alloc(512);
            bld.free(t);
        }
        let big = bld.alloc(64 * MIB);
        bld.free(big);
        let b = bld.alloc(512);
        bld.ev(EventKind::SavedPack(b));
        bld.ev(EventKind::SavedUnpack(a));
        bld.free(a);
        bld.ev(EventKind::SavedUnpack(b));
        bld.free(b);
    }
    let trace = bld.done();
    let budget = Bytes(100 * MIB);
    assert!(trace.lower_bound().bytes > budget);
    let mut opts = OffloadOptions::new(budget);
    opts.link_gbps = 1.0;
    opts.host_times = true;
    let o = plan_with_budget(&trace, &opts).expect("fits, with a stall");
    verify_plan(&o.outcome.plan).unwrap();
    assert_eq!(o.offload.tensors, 1);
    assert_eq!(o.offload.stalls, 1, "{:?}", o.offload);
    // 8 MiB at 1 GB/s is 8389 µs, started 1000 µs before the unpack.
    assert!((o.offload.stall_us - 7389.0).abs() < 2.0, "{:?}", o.offload);
    assert_eq!(o.outcome.plan.offload[0].prefetch_after_unpack, None);
    assert!(o.outcome.plan.pool_size <= budget);
    opts.link_gbps = 25.0;
    let o = plan_with_budget(&trace, &opts).expect("fits");
    assert_eq!(o.offload.stalls, 0, "{:?}", o.offload);

    let untimed = build(&transformer(), 0, true);
    let budget = Bytes(untimed.lower_bound().bytes.get() * 8 / 10);
    // 20 µs per request: at 25 GB/s a 64 MiB copy needs 134 requests, more than all
    // of forward, so compute must wait for the copies (planned waits); at 1 TB/s it
    // needs 4, and nothing waits.
    let o = plan_with_budget(&untimed, &OffloadOptions::new(budget)).expect("fits, waiting");
    assert_eq!(o.offload.timing, Timing::EventCounts);
    assert!(
        o.offload.copy_out_wait_us > 0.0 || o.offload.stalls > 0,
        "{:?}",
        o.offload
    );
    assert!(o.outcome.plan.pool_size <= budget);
    let mut opts = OffloadOptions::new(budget);
    opts.link_gbps = 1000.0;
    let o = plan_with_budget(&untimed, &opts).expect("fits");
    assert_eq!(o.offload.timing, Timing::EventCounts);
    assert!(o.outcome.plan.pool_size <= budget);
    assert_eq!((o.offload.copy_out_wait_us, o.offload.stalls), (0.0, 0));
}

#[test]
fn refusals_name_the_minimum_or_the_missing_packs() {
    let trace = build(&transformer(), 1000, true);
    let persistent = Bytes(36 * 8 * MIB);
    let e = plan_with_budget(&trace, &OffloadOptions::new(persistent)).unwrap_err();
    match &e {
        OffloadError::BelowMinimum {
            minimum,
            at,
            candidates,
            ..
        } => {
            assert!(*minimum > persistent);
            assert_eq!(at.persistent, persistent);
            assert_eq!(*candidates, 12);
            assert!(!at.in_prologue);
        }
        other => panic!("expected BelowMinimum, got {other}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("below the minimum") && msg.contains("persistent"),
        "{msg}"
    );

    let no_packs = build(&transformer(), 1000, false);
    let e = plan_with_budget(&no_packs, &OffloadOptions::new(persistent)).unwrap_err();
    assert!(matches!(e, OffloadError::NoSavedTensors { .. }), "{e}");
    assert!(e.to_string().contains("stweaver's trace mode"), "{e}");

    // Above the pool: the plain plan, with the budget recorded.
    let o = plan_with_budget(&no_packs, &OffloadOptions::new(Bytes(4 << 30))).unwrap();
    assert!(o.outcome.plan.offload.is_empty());
    assert_eq!(o.outcome.plan.budget, Some(Bytes(4 << 30)));
    let mut bad = OffloadOptions::new(persistent);
    bad.link_gbps = 0.0;
    assert!(matches!(
        plan_with_budget(&trace, &bad),
        Err(OffloadError::BadBandwidth(_))
    ));
}

/// The peak of padded live bytes with every saved tensor's device bytes gone from its
/// pack to its unpack (no link at all): no schedule can beat it.
fn generous_bound(t: &Trace) -> u64 {
    let pad = |s: Bytes| s.get().div_ceil(512) * 512;
    let n = t.events.len();
    let mut packed_at = vec![None; t.allocations.len()];
    let mut delta = vec![0i64; n + 1];
    for (e, ev) in t.events.iter().enumerate() {
        match ev.kind {
            EventKind::Alloc(id) => {
                delta[e] += pad(t.allocations[id.index()].size) as i64;
            }
            EventKind::FreeCompleted(id) => {
                delta[e] -= pad(t.allocations[id.index()].size) as i64;
            }
            EventKind::SavedPack(id) => packed_at[id.index()] = Some(e),
            EventKind::SavedUnpack(id) => {
                if let Some(p) = packed_at[id.index()].take() {
                    let s = pad(t.allocations[id.index()].size) as i64;
                    delta[p + 1] -= s;
                    delta[e] += s;
                }
            }
            _ => {}
        }
    }
    let (mut acc, mut best) = (0i64, 0i64);
    for d in &delta[..n] {
        acc += d;
        best = best.max(acc);
    }
    best as u64
}

fn shape() -> impl Strategy<Value = Shape> {
    (
        prop::collection::vec(1u64..64 * 1024, 1..4),
        prop::collection::vec((512u64..256 * 1024, prop::bool::weighted(0.8)), 1..8),
        1u64..32 * 1024,
        1u64..32 * 1024,
        3usize..5,
        any::<u64>(),
    )
        .prop_map(|(persistent, acts, temp, grad, iterations, seed)| {
            // A seeded permutation for the backward order (reverse most of the time).
            let mut backward: Vec<usize> = (0..acts.len()).rev().collect();
            if seed % 3 == 0 {
                let mut x = seed;
                for i in (1..backward.len()).rev() {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    backward.swap(i, (x >> 33) as usize % (i + 1));
                }
            }
            Shape {
                persistent,
                acts,
                backward,
                temp,
                grad,
                iterations,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn schedules_verify_under_the_budget_or_the_minimum_is_above_it(
        s in shape(),
        fraction in 0.4f64..1.1,
        link in prop::sample::select(vec![0.05f64, 25.0, 1e9]),
    ) {
        let trace = build(&s, 100, true);
        let lb = trace.lower_bound().bytes.get();
        let budget = Bytes((lb as f64 * fraction) as u64);
        let opts = |b: Bytes| {
            let mut o = OffloadOptions::new(b);
            o.link_gbps = link;
            o
        };
        // The minimum, as the refusal of a 1-byte budget names it.
        let minimum = match plan_with_budget(&trace, &opts(Bytes(1))) {
            Err(OffloadError::BelowMinimum { minimum, .. }) => Some(minimum),
            Err(OffloadError::NoSavedTensors { .. }) => None,
            other => panic!("a 1-byte budget: {other:?}"),
        };
        if let Some(m) = minimum {
            prop_assert!(m.get() >= generous_bound(&trace), "{m} below the no-link bound");
            // And it is reached: on an unlimited link, 2 % above it fits.
            let mut o = OffloadOptions::new(Bytes(m.get() + m.get() / 50));
            o.link_gbps = 1e9;
            let reached = plan_with_budget(&trace, &o);
            prop_assert!(reached.is_ok(), "{m}: {:?}", reached.err());
        }
        match plan_with_budget(&trace, &opts(budget)) {
            Ok(o) => {
                let plan = &o.outcome.plan;
                verify_plan(plan).expect("verifies");
                prop_assert!(plan.pool_size <= budget);
                prop_assert_eq!(plan.offload.len(), o.offload.tensors);
                if let Some(m) = minimum.filter(|_| !plan.offload.is_empty()) {
                    // The pool holds the padded peak, which the minimum bounds.
                    // (The minimum counts what serving needs beside the pool.)
                    // (The minimum counts what serving needs beside the pool, and the margin.)
                    let headroom = stweaver_planner::offload::serving_headroom(plan);
                    let kept = 1.0 - stweaver_planner::offload::DEFAULT_MARGIN;
                    prop_assert!((plan.pool_size.get() + headroom) as f64 >= m.get() as f64 * kept - 1.0,
                        "{} beat the minimum {m}", plan.pool_size);
                }
                let back = plan_from_bytes(&plan_to_bytes(plan).unwrap()).unwrap();
                prop_assert_eq!(&back, plan);
                if let Some(run) = &o.rewritten {
                    // The engine serves the rewritten run from the plan (every step
                    // overlap-checked), all at planned places.
                    let served = replay_engine(run, &ServeMode::Plan(plan), &EngineReplayOptions::default())
                        .expect("replays");
                    prop_assert_eq!(served.counts.online, 0);
                }
            }
            Err(OffloadError::BelowMinimum { minimum: m, .. }) => {
                prop_assert!(m > budget);
                prop_assert_eq!(Some(m), minimum);
            }
            Err(OffloadError::NoSavedTensors { .. }) => prop_assert!(minimum.is_none()),
            Err(OffloadError::NotReached { .. }) => {
                // Only the copy queues (a finite link) or the solver's slack above the
                // peak may keep a budget at or above the minimum out of reach.
                let m = minimum.expect("offload was needed").get();
                prop_assert!(link < 1e9 || (budget.get() as f64) < m as f64 * 1.02,
                    "budget {budget}, minimum {}", Bytes(m));
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// A GPU run's trace: the host enqueues each iteration's forward and backward in a
/// fraction of the device's time (10 µs between events here) and then waits for the
/// device at the iteration's end (100 ms). In host time every copy back would have to
/// start in forward (its 2.7 ms at 25 GB/s is longer than the whole backward's 1 ms
/// of host time), so nothing offloaded is free at the peak at the start of backward;
/// the default timing spreads the iteration's period over forward and backward, the
/// device's pace, and finds a schedule without stalls.
#[test]
fn a_host_that_runs_ahead_is_timed_by_the_iteration_period() {
    let mut trace = build(&transformer(), 10, true);
    let mut shift = 0;
    let mut seen = 0;
    for e in trace.events.iter_mut() {
        if let EventKind::Marker {
            kind: MarkerKind::IterationBegin,
            ..
        } = e.kind
        {
            seen += 1;
            if seen > 1 {
                shift += 100_000;
            }
        }
        e.time_us += shift;
    }
    trace.validate().unwrap();
    let budget = Bytes(trace.lower_bound().bytes.get() * 8 / 10);
    let o = plan_with_budget(&trace, &OffloadOptions::new(budget)).expect("fits");
    assert_eq!(o.offload.timing, Timing::SpreadPhases);
    assert_eq!(o.offload.stalls, 0, "{:?}", o.offload);
    assert_eq!(o.offload.copy_out_wait_us, 0.0, "{:?}", o.offload);
    assert!(o.outcome.plan.pool_size <= budget);
    verify_plan(&o.outcome.plan).unwrap();
    let mut host = OffloadOptions::new(budget);
    host.host_times = true;
    match plan_with_budget(&trace, &host) {
        Err(_) => {}
        Ok(h) => assert!(
            h.offload.stalls > 0,
            "host times should leave no time for the copies: {:?}",
            h.offload
        ),
    }
}

/// A device too fast for the link: forward ends before the copies out the peak needs
/// can be done. The schedule still fits the budget, with compute planned to wait at the
/// peak for them (`copy_out_wait_us`, the shortest such wait the search finds); a slower
/// device (a longer iteration) leaves the copies time and needs no wait.
#[test]
fn a_forward_shorter_than_its_copies_out_plans_a_wait_at_the_peak() {
    let trace = build(&transformer(), 10, true);
    let budget = Bytes(trace.lower_bound().bytes.get() * 8 / 10);
    let mut waits = Vec::new();
    for iteration_us in [1e3, 1e4, 1e5, 1e6] {
        let mut o = OffloadOptions::new(budget);
        o.iteration_us = Some(iteration_us);
        let r = plan_with_budget(&trace, &o).unwrap_or_else(|e| panic!("{iteration_us}: {e}"));
        verify_plan(&r.outcome.plan).unwrap();
        assert!(r.outcome.plan.pool_size <= budget);
        waits.push(r.offload.copy_out_wait_us);
    }
    assert!(waits[0] > 0.0, "{waits:?}");
    assert_eq!(*waits.last().unwrap(), 0.0, "{waits:?}");
}
