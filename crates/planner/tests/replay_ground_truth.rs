//! The replay against what PyTorch 2.11 itself reported on an H200 for the same runs
//! (`data/traces/ground_truth.json`).
//!
//! - Native (the recorded settings): `max_reserved` must match **exactly**, and so must
//!   `max_allocated` (measured: identical to the byte on all three traces).
//! - `expandable_segments:True`: the ground truth comes from a separate run, whose
//!   request sequence is not exactly the recorded one, so the replay of the recorded
//!   trace must be within 0.5 % of it. Measured: llama1b and gpt2xl exact, qwenmoe
//!   +0.20 % (10 345 250 816 vs 10 324 279 296); `max_allocated` identical on all three.

use std::path::PathBuf;

use stweaver_planner::replay::{AllocatorConfig, ReplayOptions, ReplayStats, replay};
use stweaver_planner::snapshot::load_snapshot;

fn data(rel: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/")).join(rel)
}

struct Truth {
    max_allocated: u64,
    max_reserved: u64,
}

fn truth(name: &str, config: &str) -> Truth {
    let path = data("traces/ground_truth.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("ground_truth.json");
    let get = |k: &str| {
        json[name][config][k]
            .as_u64()
            .unwrap_or_else(|| panic!("ground_truth.json: {name}.{config}.{k} missing"))
    };
    Truth {
        max_allocated: get("max_allocated"),
        max_reserved: get("max_reserved"),
    }
}

/// Replays `snap_<name>` natively (with its recorded settings) and with expandable
/// segments.
fn replay_both(name: &str) -> (ReplayStats, ReplayStats) {
    let path = data(&format!("traces/snap_{name}.pickle.gz"));
    let snap = load_snapshot(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(snap.traces.len(), 1, "{name}: one device");
    let trace = &snap.traces[0];
    let native = AllocatorConfig::from_snapshot_settings(&snap.settings).expect("settings");
    assert!(
        native.is_default(),
        "{name} was recorded with default settings"
    );
    let opts = ReplayOptions::default();
    let n = replay(trace, &native, &opts).expect("native replay").stats;
    let exp = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let e = replay(trace, &exp, &opts).expect("expandable replay").stats;
    (n, e)
}

fn check(name: &str) {
    let (native, expandable) = replay_both(name);
    let t = truth(name, "torch");
    assert_eq!(
        native.peak_reserved.get(),
        t.max_reserved,
        "{name}: native max_reserved"
    );
    assert_eq!(
        native.peak_allocated.get(),
        t.max_allocated,
        "{name}: native max_allocated"
    );

    let t = truth(name, "expandable");
    let rel = |got: u64, want: u64| (got as f64 - want as f64).abs() / want as f64;
    let r = rel(expandable.peak_reserved.get(), t.max_reserved);
    eprintln!(
        "{name}: expandable reserved {} vs {} ({:+.3} %), allocated {} vs {}",
        expandable.peak_reserved.get(),
        t.max_reserved,
        100.0 * (expandable.peak_reserved.get() as f64 / t.max_reserved as f64 - 1.0),
        expandable.peak_allocated.get(),
        t.max_allocated
    );
    assert!(
        r <= 0.005,
        "{name}: expandable max_reserved off by {:.3} %",
        100.0 * r
    );
    let a = rel(expandable.peak_allocated.get(), t.max_allocated);
    assert!(
        a <= 0.005,
        "{name}: expandable max_allocated off by {:.3} %",
        100.0 * a
    );
    // Expandable segments: one virtual segment per pool, pages mapped on demand.
    assert_eq!(
        expandable.segments_allocated, 2,
        "{name}: one segment per pool"
    );
    assert!(expandable.peak_reserved < native.peak_reserved);
}

#[test]
fn llama1b_matches_pytorch() {
    check("llama1b_rcp");
}

#[test]
fn gpt2xl_matches_pytorch() {
    check("gpt2xl_rcp");
}

#[test]
fn qwenmoe_matches_pytorch() {
    check("qwenmoe_eager_rcp");
}

#[test]
fn native_replay_makes_the_recorded_segments() {
    // The recording has one segment_alloc entry per cudaMalloc; the replay must make the
    // same number (it never frees any: no empty_cache, no OOM).
    for (name, segments) in [
        ("llama1b_rcp", 152),
        ("gpt2xl_rcp", 172),
        ("qwenmoe_eager_rcp", 142),
    ] {
        let path = data(&format!("traces/snap_{name}.pickle.gz"));
        let snap = load_snapshot(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(snap.devices[0].counts.segment_alloc, segments, "{name}");
        let s = replay(
            &snap.traces[0],
            &AllocatorConfig::default(),
            &ReplayOptions::default(),
        )
        .unwrap()
        .stats;
        assert_eq!(s.segments_allocated, segments, "{name}");
        assert_eq!(s.segments_freed, 0, "{name}");
        assert_eq!(
            s.peak_requested,
            snap.traces[0].lower_bound().bytes,
            "{name}"
        );
    }
}
