//! `stweaver replay TRACE --plan PLAN` end to end: a served run that matches its plan is
//! served to the end at the planned offsets; one where a temporary outlives what the plan
//! expected names the conflict it causes and the allocation that occupied the range.

mod cli;

use cli::{stweaver, text};

use std::path::Path;

use stweaver_core::testkit::TraceBuilder;
use stweaver_core::trace_file::write_trace_file;
use stweaver_core::{AllocId, Trace};

const MIB: u64 = 1 << 20;

/// `stweaver plan TRACE -o PLAN`, which must succeed.
fn plan_file(trace: &Path, plan: &Path) {
    let o = stweaver(&[
        "plan",
        trace.to_str().unwrap(),
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

/// `stweaver replay TRACE --plan PLAN --json EXTRA...`, which must succeed: its report.
fn replay_json(trace: &Path, plan: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "replay",
        trace.to_str().unwrap(),
        "--plan",
        plan.to_str().unwrap(),
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = stweaver(&args);
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// 16 MiB persistent; per iteration 6 activations of 8 MiB, each followed by a 4 MiB
/// temporary; with `late` set, the temporary of the 2nd layer of the 3rd iteration is
/// freed only after the 3rd layer's allocations (the served run kept it alive).
fn trace(late: bool) -> (Trace, Option<AllocId>) {
    let mut b = TraceBuilder::new();
    b.alloc(16 * MIB);
    let mut kept = None;
    for it in 0..5 {
        b.iteration_begin();
        let mut acts = Vec::new();
        let mut held = None;
        for layer in 0..6 {
            acts.push(b.alloc(8 * MIB));
            let tmp = b.alloc(4 * MIB);
            if late && it == 2 && layer == 1 {
                held = Some(tmp);
                kept = Some(tmp);
            } else {
                b.free(tmp);
            }
            if layer == 2
                && let Some(h) = held.take()
            {
                b.free(h);
            }
        }
        for a in acts.into_iter().rev() {
            b.free(a);
        }
    }
    (b.build(), kept)
}

#[test]
fn replay_names_the_requests_a_plan_did_not_serve_and_what_held_their_place() {
    let dir = tempfile::tempdir().unwrap();
    let (recorded, served, plan) = (
        dir.path().join("rec.stwt"),
        dir.path().join("served.stwt"),
        dir.path().join("p.stwp"),
    );
    write_trace_file(&recorded, &trace(false).0).unwrap();
    let (late, kept) = trace(true);
    write_trace_file(&served, &late).unwrap();
    plan_file(&recorded, &plan);

    // The recorded run against its own plan: every iteration at its planned offsets.
    let j = replay_json(&recorded, &plan, &[]);
    assert_eq!(j["plan_abandoned"], serde_json::Value::Null);
    assert_eq!(j["plan_stats"]["conflicts"], 0, "{j}");
    assert_eq!(j["served"]["online"], 0, "{j}");

    // The served run with a temporary kept alive: a conflict, occupied by that temporary.
    let j = replay_json(&served, &plan, &[]);
    assert!(j["plan_stats"]["conflicts"].as_u64().unwrap() >= 1, "{j}");
    let kept = kept.unwrap().0 as u64;
    let named = j["misses"].as_array().unwrap().iter().any(|m| {
        m["occupied_by"]
            .as_array()
            .is_some_and(|occ| occ.iter().any(|o| o["alloc"] == kept))
    });
    assert!(named, "the kept temporary a{kept} is named: {j}");
    let per_it: Vec<u64> = j["misses_per_iteration"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(
        per_it[3] >= 1,
        "the misses are in the 3rd iteration: {per_it:?}"
    );

    // The text report says the same, and a plan file that is not one is a clear error.
    let o = stweaver(&[
        "replay",
        served.to_str().unwrap(),
        "--plan",
        plan.to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(
        t.contains("conflict at pool offset") && t.contains(&format!("alloc {kept} (")),
        "{t}"
    );
    let o = stweaver(&[
        "replay",
        served.to_str().unwrap(),
        "--plan",
        served.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("served.stwt"), "{}", text(&o));
}

/// Per iteration: an 8 MiB activation freed, then another 8 MiB one (planned in its
/// place). In the served run the first free's completion is recorded after the second
/// allocation (a `record_stream`ed block whose event the host saw late).
fn deferred(late_completion: bool) -> Trace {
    let mut b = TraceBuilder::new();
    b.alloc(16 * MIB);
    for _ in 0..4 {
        b.iteration_begin();
        let a = b.alloc(8 * MIB);
        b.free_requested(a);
        if late_completion {
            let c = b.alloc(8 * MIB);
            b.free_completed(a);
            b.free(c);
        } else {
            b.free_completed(a);
            let c = b.alloc(8 * MIB);
            b.free(c);
        }
    }
    b.build()
}

#[test]
fn replay_keeps_a_freed_block_pending_until_its_recorded_completion() {
    let dir = tempfile::tempdir().unwrap();
    let (recorded, served, plan) = (
        dir.path().join("rec.stwt"),
        dir.path().join("served.stwt"),
        dir.path().join("p.stwp"),
    );
    write_trace_file(&recorded, &deferred(false)).unwrap();
    write_trace_file(&served, &deferred(true)).unwrap();
    plan_file(&recorded, &plan);
    let run = |extra: &[&str]| replay_json(&served, &plan, extra);
    // As the runtime serves it: the second request waits for the pending free.
    let j = run(&[]);
    assert_eq!(j["plan_stats"]["conflicts"], 0, "{j}");
    assert!(j["plan_stats"]["waits"].as_u64().unwrap() >= 3, "{j}");
    // Freed only at the completion: the planned place is still taken.
    let j = run(&["--frees-at-completion"]);
    assert!(j["plan_stats"]["conflicts"].as_u64().unwrap() >= 3, "{j}");
}
