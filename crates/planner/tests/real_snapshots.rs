//! The real PyTorch snapshots of `data/traces/`: lower bounds against the ground
//! truth, and iteration periods against the `Optimizer.step` annotations.

mod common;

use stweaver_core::{EventKind, MarkerKind, Trace};
use stweaver_planner::iteration::{PeriodSource, detect_period};
use stweaver_planner::snapshot::Snapshot;

fn load(name: &str) -> Snapshot {
    common::snapshot_file(name)
}

/// `lower_bound_bytes` of `ground_truth.json`.
fn ground_truth_lb(key: &str) -> u64 {
    common::ground_truth(key)["lower_bound_bytes"]
        .as_u64()
        .expect("lower_bound_bytes")
}

/// Alloc counts at each `Optimizer.step` END annotation.
fn allocs_at_step_ends(t: &Trace) -> Vec<usize> {
    let mut allocs = 0;
    let mut out = Vec::new();
    for e in &t.events {
        match e.kind {
            EventKind::Alloc(_) => allocs += 1,
            EventKind::Marker {
                kind: MarkerKind::PhaseEnd,
                label: Some(l),
            } if t.labels[l as usize].starts_with("Optimizer.step") => out.push(allocs),
            _ => {}
        }
    }
    out
}

/// The same trace with every marker removed.
fn without_markers(t: &Trace) -> Trace {
    Trace {
        events: t
            .events
            .iter()
            .copied()
            .filter(|e| !matches!(e.kind, EventKind::Marker { .. }))
            .collect(),
        labels: vec![],
        ..t.clone()
    }
}

fn check_dense(name: &str, key: &str, lb: u64, per_iteration: usize, allocs: usize) {
    let snap = load(name);
    assert_eq!(snap.traces.len(), 1, "one device");
    let t = &snap.traces[0];
    assert_eq!(t.alloc_event_count(), allocs);
    assert_eq!(t.lower_bound().bytes.get(), lb);
    assert_eq!(lb, ground_truth_lb(key));

    // Cross-check: allocs between consecutive Optimizer.step ENDs.
    let ends = allocs_at_step_ends(t);
    assert_eq!(ends.len(), 4, "4 training iterations");
    for w in ends.windows(2).skip(1) {
        assert_eq!(w[1] - w[0], per_iteration);
    }
    assert_ne!(ends[0], per_iteration, "the first iteration differs");

    let p = detect_period(t).expect("a dense trace has a period");
    assert_eq!(p.allocs_per_iteration, per_iteration);
    assert_eq!(p.source, PeriodSource::RequestSequence);
    // Iterations 2..4 are the steady state, cut at the step ENDs.
    assert_eq!(p.repetitions, 3);
    assert_eq!(p.first_steady_alloc, ends[0]);
    let boundary_allocs: Vec<usize> = p
        .boundaries
        .iter()
        .map(|b| {
            t.events[..b.index()]
                .iter()
                .filter(|e| matches!(e.kind, EventKind::Alloc(_)))
                .count()
        })
        .collect();
    assert_eq!(boundary_allocs, ends);
    assert!(p.events_per_iteration.is_some());

    // Without annotations the period is the same (the phase may differ).
    let bare = detect_period(&without_markers(t)).expect("period without markers");
    assert_eq!(bare.allocs_per_iteration, per_iteration);
    assert!(bare.repetitions >= 2);
}

#[test]
fn llama1b_lower_bound_and_period() {
    check_dense(
        "snap_llama1b_rcp.pickle.gz",
        "llama1b_rcp",
        11_510_874_376,
        5133,
        20_977,
    );
}

#[test]
fn gpt2xl_lower_bound_and_period() {
    check_dense(
        "snap_gpt2xl_rcp.pickle.gz",
        "gpt2xl_rcp",
        9_445_508_616,
        5156,
        21_504,
    );
}

#[test]
fn qwenmoe_lower_bound_and_no_period() {
    let snap = load("snap_qwenmoe_eager_rcp.pickle.gz");
    let t = &snap.traces[0];
    assert_eq!(t.alloc_event_count(), 107_899);
    assert_eq!(t.lower_bound().bytes.get(), 10_054_396_032);
    assert_eq!(10_054_396_032, ground_truth_lb("qwenmoe_eager_rcp"));
    // Allocs between step ENDs vary: no exact period.
    let ends = allocs_at_step_ends(t);
    assert!(ends.windows(2).any(|w| w[1] - w[0] != ends[1] - ends[0]) || ends.len() < 3);
    assert_eq!(detect_period(t), None);
    assert_eq!(detect_period(&without_markers(t)), None);
}

#[test]
fn snapshot_with_shared_frames() {
    // Trace entries carry `frames`, shared dicts inside the pickle (memo references).
    let snap = load("snap_small_with_frames.pickle");
    let t = &snap.traces[0];
    assert_eq!(t.alloc_event_count(), 12);
    assert_eq!(snap.devices[0].counts.segment_alloc, 6);
    assert_eq!(snap.segments.len(), 6);
    let streams: std::collections::BTreeSet<u64> =
        t.allocations.iter().map(|a| a.stream.0).collect();
    assert_eq!(streams.len(), 3);
    // A CUDA-graph segment in the final state.
    assert!(snap.segments.iter().any(|s| s.pool_id != (0, 0)));
}

#[test]
fn settings_and_segments_of_a_real_snapshot() {
    let snap = load("snap_gpt2xl_rcp.pickle.gz");
    let s = &snap.settings;
    assert!(s.present);
    assert_eq!(s.alloc_conf, "");
    assert!(!s.expandable_segments);
    assert_eq!(s.max_split_size, None);
    assert_eq!(s.roundup_power2_divisions.len(), 16);
    assert_eq!(snap.segments.len(), 172);
    // Final reserved bytes = PyTorch's max_reserved here (nothing was ever released).
    let reserved: u64 = snap.segments.iter().map(|g| g.total_size.get()).sum();
    assert_eq!(reserved, 11_337_203_712);
    assert_eq!(snap.annotations, 16);
    assert_eq!(snap.devices[0].counts.segment_alloc, 172);
}
