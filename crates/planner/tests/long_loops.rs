//! Issue #18's long loops, recorded on an H100 by `python/bench/long_loops.py` (stweaver's
//! trace mode, 200 iterations each, `stweaver.phase` markers around the eval and checkpoint
//! passes; `data/traces/long/`, with the GPU's own numbers per allocator in
//! `gpu_ground_truth.json`), replayed by the engine in the runtime's default mode (auto) as
//! `stweaver compare` does:
//!
//! - the replay reproduces the GPU: auto's peak reserved within 0.5 % of the auto run's
//!   on the GPU (the zero-code run, no phase markers: the traces replayed without their
//!   markers), on every loop (the eval loop's GPU numbers were measured again, session
//!   14, with the cursor's restarts: 6.916 GiB, 1.006 x the lower bound; 8.936 before
//!   them; len5's in session 15 with plans per iteration class: 13.344 GiB, 1.0012 x,
//!   13.56 online before them);
//! - with the phase markers, every loop stays at or below expandable segments' GPU peak,
//!   and within 1 % of the lower bound: `len5` too (five sequence lengths, no single
//!   repeating iteration: auto records 40 more iterations and serves a plan per
//!   iteration class, `stweaver_planner::class_planning`; 1.0012 x, 1.0177 x online);
//! - the fixed-shape loops and `len5` do not drift: the peak after iteration 200 is the
//!   peak after iteration 20.

mod common;

use stweaver_core::trace::{Event, EventKind, MarkerKind};
use stweaver_core::units::AllocId;
use stweaver_core::{Bytes, Trace};
use stweaver_planner::engine_replay::{
    EngineReplayReport, EngineReplayRow, EngineRowMode, iteration_boundaries,
};

const LOOPS: [&str; 6] = ["len5", "len50", "len5new", "eval10", "ckpt20", "moe"];

fn load(name: &str) -> Trace {
    common::trace_file(&format!("data/traces/long/trace_{name}.stwt.gz"))
}

/// `max_reserved` of the GPU run of `name` under `alloc` (`gpu_ground_truth.json`).
fn gpu(name: &str, alloc: &str) -> u64 {
    let path = common::repo("data/traces/long/gpu_ground_truth.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["loop"] == name && r["alloc"] == alloc)
        .and_then(|r| r["max_reserved"].as_u64())
        .unwrap_or_else(|| panic!("no {name}/{alloc} in gpu_ground_truth.json"))
}

fn auto(trace: &Trace) -> EngineReplayReport {
    let (r, outcome) = EngineReplayRow::new(EngineRowMode::Auto)
        .replay(trace)
        .unwrap();
    eprintln!(
        "  auto: {} ({:.4} x LB {}): {outcome}",
        r.peak_reserved,
        r.reserved_over_lb(),
        r.lower_bound
    );
    r
}

/// The trace without its phase markers: what a run without `stweaver.phase` shows.
fn without_phases(t: &Trace) -> Trace {
    let mut t = t.clone();
    t.events.retain(|e| {
        !matches!(
            e.kind,
            EventKind::Marker {
                kind: MarkerKind::PhaseBegin | MarkerKind::PhaseEnd,
                ..
            }
        )
    });
    t
}

fn ratio(a: Bytes, b: u64) -> f64 {
    a.get() as f64 / b as f64
}

#[test]
fn the_replay_reproduces_the_gpu_runs_without_phase_markers() {
    for name in LOOPS {
        eprintln!("{name}");
        let r = auto(&without_phases(&load(name)));
        let on_gpu = gpu(name, "auto");
        let q = ratio(r.peak_reserved, on_gpu);
        assert!(
            (0.995..=1.005).contains(&q),
            "{name}: replay {} vs GPU {on_gpu} ({q:.4})",
            r.peak_reserved
        );
    }
}

#[test]
fn with_phase_markers_every_loop_fits_the_lower_bound_and_beats_expandable() {
    for name in LOOPS {
        eprintln!("{name}");
        let r = auto(&load(name));
        let expandable = gpu(name, "expandable");
        assert!(
            r.peak_reserved.get() <= expandable,
            "{name}: {} > expandable's {expandable}",
            r.peak_reserved
        );
        assert!(
            r.reserved_over_lb() <= 1.01,
            "{name}: {:.4} x LB",
            r.reserved_over_lb()
        );
        if name == "len5" {
            // Served from a plan per iteration class, the classes told apart by the
            // iterations' first requests: no conflict, no growth.
            let st = r.plan_stats.expect("len5 serves its plan per class");
            assert_eq!((st.conflicts, st.grown), (0, 0), "{st:?}");
        }
        if name == "eval10" {
            // The eval passes are served beside the plan: no conflict, no growth.
            let st = r.plan_stats.expect("eval10 serves its plan");
            assert_eq!((st.conflicts, st.grown), (0, 0), "{st:?}");
        }
    }
}

#[test]
fn fixed_shape_loops_do_not_drift() {
    for name in ["eval10", "ckpt20", "len5"] {
        let r = auto(&load(name));
        let (at20, at200) = (
            r.peak_by_iteration[19],
            *r.peak_by_iteration.last().unwrap(),
        );
        assert!(r.peak_by_iteration.len() >= 200, "{name}");
        assert!(
            ratio(at200, at20.get()) <= 1.005,
            "{name}: peak {at20} after 20 iterations, {at200} at the end"
        );
    }
}

/// The event spans `[begin, end]` of the phases labelled `label`, in order.
fn phases(t: &Trace, label: &str) -> Vec<(usize, usize)> {
    let is = |l: Option<u32>| {
        l.and_then(|l| t.labels.get(l as usize)).map(String::as_str) == Some(label)
    };
    let mut out = Vec::new();
    let mut open = None;
    for (i, e) in t.events.iter().enumerate() {
        match e.kind {
            EventKind::Marker {
                kind: MarkerKind::PhaseBegin,
                label: l,
            } if is(l) => open = Some(i),
            EventKind::Marker {
                kind: MarkerKind::PhaseEnd,
                label: l,
            } if is(l) => out.extend(open.take().map(|b| (b, i))),
            _ => {}
        }
    }
    out
}

/// `t` without the events of span `[b, e]` and of every allocation made there
/// (allocation ids renumbered).
fn without_span(t: &Trace, (b, e): (usize, usize)) -> Trace {
    let mut gone = vec![false; t.allocations.len()];
    for ev in &t.events[b..=e] {
        if let EventKind::Alloc(id) = ev.kind {
            gone[id.index()] = true;
        }
    }
    let mut new_id = vec![None; t.allocations.len()];
    let mut out = t.clone();
    out.allocations.clear();
    for (i, a) in t.allocations.iter().enumerate() {
        if !gone[i] {
            new_id[i] = Some(AllocId(out.allocations.len() as u32));
            out.allocations.push(*a);
        }
    }
    out.events = t
        .events
        .iter()
        .enumerate()
        .filter(|&(i, ev)| {
            !(b..=e).contains(&i) && ev.kind.alloc().is_none_or(|id| !gone[id.index()])
        })
        .map(|(_, ev)| Event {
            kind: ev.kind.map_alloc(|id| new_id[id.index()].expect("kept")),
            ..*ev
        })
        .collect();
    out
}

/// `t` with every allocation made inside span `[b, e]` `num / den` times its size (an
/// eval pass of another batch size), rounded up to 512 bytes.
fn scaled_in_span(t: &Trace, (b, e): (usize, usize), num: u64, den: u64) -> Trace {
    let mut out = t.clone();
    for ev in &t.events[b..=e] {
        if let EventKind::Alloc(id) = ev.kind {
            let a = &mut out.allocations[id.index()];
            a.size = Bytes((a.size.get() * num / den).max(1).div_ceil(512) * 512);
        }
    }
    out
}

#[test]
fn perturbed_eval_loops_stay_within_the_lower_bound() {
    // Issue #18 item 5: a skipped eval, and an eval of another batch size (1.5 x: a class
    // never seen), each with and without the phase markers; the replay checks every
    // allocation against the live ones (no overlap) as it goes.
    let t = load("eval10");
    let evals = phases(&t, "eval");
    assert_eq!(evals.len(), 20, "an eval every 10 of 200 iterations");
    let skipped = without_span(&t, evals[4]);
    let bigger = scaled_in_span(&t, evals[9], 3, 2);
    for (what, p) in [("skipped eval", &skipped), ("1.5 x eval batch", &bigger)] {
        p.validate().unwrap();
        for (marks, tr) in [("marked", p.clone()), ("unmarked", without_phases(p))] {
            eprintln!("{what}, {marks}");
            let r = auto(&tr);
            // Unmarked, the eval of shapes the plan never saw is an implicit phase
            // (module docs of `engine/plan_serving.rs`): 1.006 x, as the unmarked eval of
            // the training shapes (1.334 x before: its large tensors grew the pool).
            assert!(
                r.reserved_over_lb() <= 1.01,
                "{what}, {marks}: {:.4} x LB",
                r.reserved_over_lb()
            );
        }
    }
}

#[test]
fn len5_with_classes_the_recording_never_saw_never_overlaps() {
    // Issue #18 item 5: classes never seen. Auto records iterations 7 to 47 for its plan
    // per class; from iteration 60 on, every fifth iteration makes its requests at
    // `num / den` of their size (a length bucket the recording never had), served beside
    // the plan: its first requests match no class, the implicit phase and the holes
    // take it; the replay checks every block against the live ones as it goes.
    //
    // Smaller than the largest planned class (3/4): within the lower bound as if every
    // class were known (1.0012 x; 1.0177 x online). Larger than every planned class
    // (5/4 of the longest length): the pool grows for it; before a growth maps past the
    // peak the pool gives its free units back, as an online arena does (module docs of
    // `engine/release.rs`): 1.0032 x (online serving: 1.0007 x; 1.16 x when the pool
    // kept its free units mapped). Either way auto mode learns the classes first seen
    // after its switch (issue #18 item 2, module docs of `stweaver_planner::auto`): the
    // first unknown iteration (60) starts a recording of 40 iterations, planned per
    // class and merged into the served plan at boundary 104 (three classes added, the
    // cursor follows eight); from there those iterations are served from the plan:
    // 97.9 k requests at their planned offset instead of 87.6 k, half the unplanned.
    let t = load("len5");
    let bounds = iteration_boundaries(&t);
    for (num, den, cap) in [(3, 4, 1.01), (5, 4, 1.01)] {
        let mut p = t.clone();
        for j in (60..bounds.len() - 1).filter(|j| j % 5 == 0) {
            p = scaled_in_span(&p, (bounds[j], bounds[j + 1] - 1), num, den);
        }
        p.validate().unwrap();
        eprintln!("len5, every fifth iteration from 60 at {num}/{den} of its sizes");
        let r = auto(&p);
        assert!(
            r.reserved_over_lb() <= cap,
            "{num}/{den}: {:.4} x LB",
            r.reserved_over_lb()
        );
        let st = r.plan_stats.expect("served a plan");
        eprintln!(
            "  {num}/{den}: {st:?}; relearned at {:?}; {:?}",
            r.relearned, r.device_counters
        );
        assert!(st.hits > 95_000, "{num}/{den}: {st:?}");
        assert!(st.unplanned < 12_000, "{num}/{den}: {st:?}");
        assert_eq!(r.relearned.len(), 1, "{num}/{den}: {:?}", r.relearned);
    }
}

#[test]
fn len5_served_from_the_start_by_its_plan_per_class() {
    // Plan mode: the whole recording planned per class (the first iteration's
    // temporaries on the whole pool, the persistent tensors once above the classes),
    // served from the first request, every block checked against the live ones:
    // 1.0003 x the lower bound.
    use stweaver_planner::class_planning::{ClassPlanOptions, plan_classes};
    use stweaver_planner::engine_replay::{EngineReplayOptions, ServeMode, replay_engine};
    let t = load("len5");
    let o = ClassPlanOptions {
        plan: stweaver_planner::auto::auto_plan_options(false),
        ..ClassPlanOptions::default()
    };
    let cp = plan_classes(&t, &o).unwrap();
    assert_eq!((cp.plan.class_count(), cp.covered), (5, cp.iterations));
    assert!(
        !cp.plan.prologue.is_empty(),
        "the persistent part is planned"
    );
    let r = replay_engine(
        &t,
        &ServeMode::Plan(&cp.plan),
        &EngineReplayOptions::default(),
    )
    .unwrap();
    let st = r.plan_stats.expect("served");
    eprintln!(
        "len5 from the start: {} ({:.4} x LB), pool {}, {st:?}",
        r.peak_reserved,
        r.reserved_over_lb(),
        cp.plan.pool_size
    );
    assert_eq!(r.plan_error, None);
    // The classes keep clear of the first iteration and the persistent part.
    assert_eq!(st.grown, 0, "{st:?}");
    assert!(st.conflicts <= 10, "{st:?}");
    assert!(
        r.reserved_over_lb() <= 1.01,
        "{:.4} x LB",
        r.reserved_over_lb()
    );
}

#[test]
#[ignore]
fn print_per_iteration() {
    let name = std::env::var("LOOP").unwrap_or("eval10".into());
    let t = load(&name);
    let t = if std::env::var_os("NO_PHASES").is_some() {
        without_phases(&t)
    } else {
        t
    };
    let r = auto(&t);
    for (i, (res, pk)) in r
        .reserved_by_iteration
        .iter()
        .zip(&r.peak_by_iteration)
        .enumerate()
    {
        eprintln!("{i:4} reserved {res} peak {pk}");
    }
    eprintln!("{:?}", r.plan_stats);
    eprintln!(
        "peak reserved {} (small {}, large {}), peak allocated {}, LB {}",
        r.peak_reserved,
        r.peak_reserved_small,
        r.peak_reserved_large,
        r.peak_allocated,
        r.lower_bound
    );
}

/// Online serving of a loop whose iterations repeat (the eval loop's training steps)
/// settles into releasing holes before a new peak in every iteration and mapping them
/// again in the next: on the H100 1.29x native's median step (BENCHMARKS.md, session
/// 15; without the stop the replay makes 244 synchronisations and 63 156 granule maps in
/// 200 iterations). In online mode (`STWEAVER_RELEASE_CHURN`, 3 by default) the engine
/// stops those releases after three repeated iterations that each released
/// (`engine::release::Churn`): the peak grows by what the loop maps again (6.90 -> 6.99
/// GiB), below expandable segments'. Auto mode keeps them (the stop fell in its planning
/// window on the GPU: 7.50 GiB).
#[test]
fn online_serving_of_a_repeating_loop_does_not_churn_mappings() {
    let t = without_phases(&load("eval10"));
    let mut row = EngineReplayRow::new(EngineRowMode::Online);
    assert_eq!(
        row.replay.release_churn_iterations, 3,
        "online mode's default"
    );
    let (r, _) = row.replay(&t).unwrap();
    let c = r.device_counters;
    eprintln!(
        "eval10 online: {c:?}, {} ({:.4} x LB)",
        r.peak_reserved,
        r.reserved_over_lb()
    );
    assert!(c.synchronizes <= 60, "{c:?}");
    assert!(c.maps <= 6_000, "{c:?}");
    assert!(r.reserved_over_lb() <= 1.02, "{:.4}", r.reserved_over_lb());
    assert!(r.peak_reserved.get() <= gpu("eval10", "expandable"));
    row.replay.release_churn_iterations = 0;
    let (plain, _) = row.replay(&t).unwrap();
    assert!(
        plain.device_counters.synchronizes > 200,
        "{:?}",
        plain.device_counters
    );
    assert_eq!(
        EngineReplayRow::new(EngineRowMode::Auto)
            .replay
            .release_churn_iterations,
        0,
        "auto mode never stops its releases"
    );
}

/// Issue #18 item 2 on the GPU loop made for it: `len5new` (`python/bench/long_loops.py`:
/// len5, and from iteration 60 every fifth iteration of a length never seen before, 320,
/// 640 or 1920; recorded on the H100 in session 16). Auto records and plans len5's five
/// classes, switches, meets the new lengths beside the plan (the pool giving its free
/// 64 MiB units back before it grows past the peak), learns them in one round (three
/// classes added: eight in all) and serves them from the plan. The background planner's
/// delay is the runtime's earliest (1 step) and the H100's (6 steps: the plan per class
/// of 40 iterations came 6 steps after planning started): within 1 % of the lower bound
/// either way and below expandable segments' GPU peak. With one unit per first-touched
/// range instead of 64 MiB units, the 8-step delay reached 1.088 x; on the H100 (one unit
/// per range) 17.71 GiB, 1.078 x.
#[test]
fn len5new_learns_the_lengths_first_seen_after_the_switch() {
    let t = load("len5new");
    for steps in [1, 6, 8] {
        let mut row = EngineReplayRow::new(EngineRowMode::Auto);
        row.replay.planner_steps = Some(steps);
        let (r, outcome) = row.replay(&t).unwrap();
        eprintln!(
            "len5new, planner {steps} step(s): {} ({:.4} x LB): {outcome}; relearned at {:?}; {:?}",
            r.peak_reserved,
            r.reserved_over_lb(),
            r.relearned,
            r.plan_stats
        );
        assert!(
            r.reserved_over_lb() <= 1.01,
            "{steps}: {:.4} x LB",
            r.reserved_over_lb()
        );
        assert!(r.peak_reserved.get() <= gpu("len5new", "expandable"));
        assert_eq!(r.relearned.len(), 1, "{:?}", r.relearned);
        assert!(r.plan_abandoned.is_none());
    }
}

/// Why the plan pool maps 64 MiB pieces (`EngineConfig::pool_unit`): on len5new with the
/// 8-step planner delay, one unit per first-touched range leaves the pool unable to give
/// back what the new lengths' small unplanned tensors share of its large ranges (1.088 x
/// the lower bound), 64 MiB pieces can (1.0063 x).
#[test]
fn len5new_needs_the_pool_in_pieces() {
    let t = load("len5new");
    let mut ratios = Vec::new();
    for unit in [
        Bytes::ZERO,
        Bytes(stweaver_core::engine::POOL_UNIT),
        Bytes(2 << 20),
    ] {
        let mut row = EngineReplayRow::new(EngineRowMode::Auto);
        row.replay.planner_steps = Some(8);
        row.replay.pool_unit = unit;
        let (r, _) = row.replay(&t).unwrap();
        eprintln!("pool unit {unit}: {:.4} x LB", r.reserved_over_lb());
        ratios.push(r.reserved_over_lb());
    }
    assert!(ratios[0] > 1.05, "{ratios:?}");
    assert!(ratios[1] <= 1.01, "{ratios:?}");
}
