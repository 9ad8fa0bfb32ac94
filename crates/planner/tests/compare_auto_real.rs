//! `stweaver compare`'s headline row, `stweaver (auto)`: the engine replayed in auto mode
//! as the runtime runs it (record 4 iterations online, plan at the 5th boundary, switch
//! at the 6th, or stay online), on every shared and recorded trace: the snapshots of
//! `data/traces/` (bundled into the binary: gpt2xl), the traces stweaver recorded there
//! (`*.stwt.gz`) and on the H200 (`tests/data/h200/`).
//!
//! Issue #18 item 4 asks for a row ≤ 1.01 × LB on each. It holds on six of the nine; on
//! three it does not, and the tests below assert the measured figure rather than the
//! target (measured with this replay, release build):
//!
//! | trace | LB (B) | native | expandable | auto | outcome |
//! |---|---:|---:|---:|---:|---|
//! | snap_gpt2xl_rcp | 9 445 508 616 | 1.2003 | 1.0866 | 1.0100 | online: 4 boundaries, plans at the 5th |
//! | snap_llama1b_rcp | 11 510 874 376 | 1.1358 | 1.0645 | 1.0039 | online: 4 boundaries |
//! | snap_qwenmoe_eager_rcp | 10 054 396 032 | 1.1672 | 1.0289 | 1.0060 | online: 4 boundaries |
//! | trace_llama1b_norcp_offload | 37 062 521 480 | 1.0810 | 1.0508 | 1.0007 | switched at 6 |
//! | h200 ddp_llama1b_rank0 | 11 505 820 166 | 1.0511 | 1.0103 | 1.0054 | switched at 6 |
//! | h200 llama1b_1f1b | 9 941 254 472 | 1.1807 | 1.0537 | 1.0052 | switched at 6 |
//! | h200 gpt2xl_rcp | 9 445 508 620 | 1.1981 | 1.0866 | **1.0124** | switched at 6 (1.0051 after) |
//! | h200 fsdp2_llama1b_rank0 | 5 201 218 058 | 1.2850 | 1.3036 | **1.2370** | switched at 6 (1.2350 after) |
//! | trace_llama1b_norcp_auto_offload | 12 279 427 720 | 1.3769 | 1.2869 | **1.0628** | online: planned at 5, ends before the switch |
//!
//! Where auto mode switches, the whole run's peak is mostly the online phase's (then the
//! row equals the online engine's; on trace_llama1b_norcp_offload the plan's 1.0007 is
//! above the online engine's 1.0002). h200 gpt2xl misses by its online phase (the plan
//! from the switch on: 1.0051); fsdp2's plan (its streams solved apart and stacked,
//! `share_streams` off) is as large as its online phase; auto_offload, recorded under
//! offload, ends before the switch.

mod common;
use common::{snapshot, trace_file};

use stweaver_core::Trace;
use stweaver_planner::engine_replay::{
    AutoOutcome, EngineReplayRow, EngineRowMode, ServeMode, replay_engine,
};

/// What auto mode is expected to do on a trace.
enum Expect {
    /// Stay online, the outcome starting so.
    Online(&'static str),
    /// Switch to the plan at this boundary and keep it; the peak from there at most
    /// this many × LB.
    Switched(usize, f64),
}

/// The auto row of `name` at most `max` × LB, doing what `expect` says (the online
/// engine's row alongside, for the record).
fn check(name: &str, trace: &Trace, max: f64, expect: Expect) {
    let row = EngineReplayRow::new(EngineRowMode::Auto);
    let (r, outcome) = row.replay(trace).unwrap();
    let online = replay_engine(trace, &ServeMode::Online, &row.replay).unwrap();
    eprintln!(
        "{name}: LB {} B, auto {} B = {:.4} x LB, online {} B = {:.4} x LB; {outcome}",
        r.lower_bound.get(),
        r.peak_reserved.get(),
        r.reserved_over_lb(),
        online.peak_reserved.get(),
        online.reserved_over_lb()
    );
    assert!(
        r.reserved_over_lb() <= max,
        "{name}: {:.5} x LB > {max}",
        r.reserved_over_lb()
    );
    match expect {
        Expect::Online(why) => {
            assert!(
                matches!(&r.auto, Some(AutoOutcome::Online(w)) if w.starts_with(why)),
                "{name}: {outcome}"
            );
            assert_eq!(r.peak_reserved, online.peak_reserved, "{name}");
        }
        Expect::Switched(at, after) => {
            assert!(
                matches!(
                    r.auto,
                    Some(AutoOutcome::Switched { boundary, gave_up: None, .. }) if boundary == at
                ),
                "{name}: {outcome}"
            );
            let a = r.peak_reserved_after_switch.unwrap();
            assert!(
                a.ratio(r.lower_bound) <= after,
                "{name}: after the switch {a}"
            );
            // Served from the plan: at most 0.1 % of its requests found their range busy.
            let st = r.plan_stats.unwrap();
            assert!(st.conflicts * 1000 <= st.hits, "{name}: {st:?}");
        }
    }
}

const FOUR: &str = "the trace ends after 4 iteration boundaries, before auto mode plans";

#[test]
fn bundled_snapshots_within_one_percent() {
    // The snapshots hold 4 optimizer steps: auto mode is still recording at the end.
    for name in ["gpt2xl_rcp", "llama1b_rcp", "qwenmoe_eager_rcp"] {
        check(name, &snapshot(name), 1.01, Expect::Online(FOUR));
    }
}

#[test]
fn recorded_offload_traces() {
    check(
        "trace_llama1b_norcp_offload",
        &trace_file("data/traces/trace_llama1b_norcp_offload.stwt.gz"),
        1.01,
        Expect::Switched(6, 1.001),
    );
    // Not within 1 %: recorded in auto mode under offload, the trace is the recording
    // itself (5 boundaries) and ends before the switch; the online phase is the row.
    check(
        "trace_llama1b_norcp_auto_offload",
        &trace_file("data/traces/trace_llama1b_norcp_auto_offload.stwt.gz"),
        1.065,
        Expect::Online("planned at iteration 5, the trace ends after 5 iteration boundaries"),
    );
}

#[test]
fn h200_recordings() {
    let h200 = |name: &str| trace_file(&format!("crates/planner/tests/data/h200/{name}.stwt.gz"));
    check(
        "ddp_llama1b_rank0",
        &h200("ddp_llama1b_rank0"),
        1.01,
        Expect::Switched(6, 1.005),
    );
    check(
        "llama1b_1f1b",
        &h200("llama1b_1f1b"),
        1.01,
        Expect::Switched(6, 1.006),
    );
    // Not within 1 %: the online phase peaks at 1.0124 x LB; the plan from the switch
    // on at 1.0051.
    check(
        "gpt2xl_rcp",
        &h200("gpt2xl_rcp"),
        1.013,
        Expect::Switched(6, 1.006),
    );
    // Not within 1 %: FSDP2's streams are planned apart and stacked (share_streams off),
    // so the plan needs as much as the online phase, 1.235 x LB (the offline plan of the
    // whole trace, one joint solve: 1.0003).
    check(
        "fsdp2_llama1b_rank0",
        &h200("fsdp2_llama1b_rank0"),
        1.24,
        Expect::Switched(6, 1.24),
    );
}
