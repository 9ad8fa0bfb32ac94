//! Planned offload on a real trace: Llama 1B (16 layers, 8 × 2048 tokens, bf16, AdamW)
//! trained *without* activation checkpointing on an H100, recorded in trace mode with
//! every saved tensor's pack and unpack (`data/traces/trace_llama1b_norcp_offload.stwt.gz`,
//! the budget benchmark's trace run). Lower bound 34.52 GiB.
//!
//! At 0.9, 0.8 and 0.7 × LB and the link the benchmark assumes (48 GB/s per direction),
//! the planner must find a schedule: pool within the budget, verified, no stall, and fewer
//! bytes than offloading every saved tensor. (Before the copies back were scheduled
//! as late as possible, 0.8 and 0.7 were refused: "no offloadable tensor is freed there".)

use std::io::Read;

use stweaver_core::trace_file::trace_from_bytes;
use stweaver_core::verify::verify_plan;
use stweaver_core::{Bytes, Trace};
use stweaver_planner::offload::{OffloadOptions, plan_with_budget};

const TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../data/traces/trace_llama1b_norcp_offload.stwt.gz"
);
const LB: u64 = 37_062_521_480;

fn trace() -> Trace {
    let gz = std::fs::read(TRACE).expect("the vendored trace");
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut bytes)
        .expect("gunzip");
    trace_from_bytes(&bytes).expect("a valid trace file")
}

#[test]
fn llama1b_without_recompute_plans_at_0_9_0_8_and_0_7_of_lb_without_stalls() {
    let t = trace();
    let mut moved = Vec::new();
    for f in [0.9, 0.8, 0.7] {
        let budget = Bytes((f * LB as f64) as u64);
        let mut o = OffloadOptions::new(budget);
        o.link_gbps = 48.0;
        let r = plan_with_budget(&t, &o).unwrap_or_else(|e| panic!("{f} x LB: {e}"));
        let plan = &r.outcome.plan;
        verify_plan(plan).unwrap();
        assert!(plan.pool_size <= budget, "{f}: pool {}", plan.pool_size);
        assert_eq!(
            r.offload.stalls, 0,
            "{f}: {} µs of stalls",
            r.offload.stall_us
        );
        assert!(!plan.offload.is_empty());
        let b = r.offload.bytes_per_iteration.get();
        // Fewer than everything that could move (every candidate, 16.1 GiB); at 0.8,
        // fewer than half of it.
        let all = r.offload.candidate_bytes.get();
        assert!(b < all, "{f}: {b} of {all}");
        if f == 0.8 {
            assert!(2 * b < all, "{f}: {b} of {all}");
        }
        moved.push(b);
    }
    // A tighter budget moves more.
    assert!(moved[0] < moved[1] && moved[1] < moved[2], "{moved:?}");
}

/// Known failure (issue #16 stays open; session 8): the engine serving the 0.7 × LB
/// offload plan over the run it was planned for (the rewritten trace), on a device whose
/// memory is the budget. On the H100 the same plan ran out of memory at its second served
/// iteration. Here: every other iteration the 1.95 GiB fp32 logits find their planned
/// range busy and are served in a hole at the pool's tail (35 conflicts, one growth), peak
/// reserved 26.10 GiB against a 24.14 GiB pool. The plan *without* offload has the same
/// defect on this trace (34.52 GiB pool, 36.47 GiB served: `plain_plan_serving`), so it
/// is plan serving, not the offload schedule. Run with `--ignored`; it fails until fixed.
///
/// Diagnosis (plain plan): the occupant of the logits' planned range is a 4-byte tensor
/// (a3211, the loss kept alive by the training loop into the next iteration, 7 300 events)
/// that the plan does not place (it outlives the iteration: unplanned), but the engine's
/// cursor matched it by size to the planned entry of a short-lived 4-byte temporary nearby,
/// so it sits at that temporary's offset, inside the range the logits take 21 events
/// later. Every other iteration its own next copy finds the slot busy too (hence the
/// alternation). A fix: the plan keeps a placeholder for each unplanned request so that
/// the cursor never hands one a planned entry, and long-lived unplanned requests get a
/// range no planned request uses.
#[test]
#[ignore = "known failure: plan serving conflicts on the logits (issue #16)"]
fn the_engine_serves_the_offload_plan_within_the_budget() {
    use stweaver_planner::engine_replay::{EngineReplayOptions, ServeMode, replay_engine};
    let t = trace();
    let budget = Bytes((0.7 * LB as f64) as u64);
    let mut o = OffloadOptions::new(budget);
    o.link_gbps = 48.0;
    let r = plan_with_budget(&t, &o).unwrap();
    let run = r.rewritten.as_ref().expect("offloaded");
    let opts = EngineReplayOptions {
        device_memory: budget,
        ..EngineReplayOptions::default()
    };
    let served = replay_engine(run, &ServeMode::Plan(&r.outcome.plan), &opts).expect("replays");
    assert_eq!(served.plan_abandoned, None);
    assert!(served.peak_reserved <= budget);
}

/// Known failure (see above): the plan of the run without offload, served over it,
/// reserves no more than its pool.
#[test]
#[ignore = "known failure: plan serving conflicts on the logits (issue #16)"]
fn plain_plan_serving() {
    use stweaver_planner::engine_replay::{EngineReplayOptions, ServeMode, replay_engine};
    let t = stweaver_planner::unoffload::un_offload(&trace()).unwrap();
    let out = stweaver_planner::planning::plan_trace(&t, &Default::default()).unwrap();
    let served = replay_engine(
        &t,
        &ServeMode::Plan(&out.plan),
        &EngineReplayOptions::default(),
    )
    .unwrap();
    let stats = served.plan_stats.expect("plan mode");
    assert_eq!(stats.conflicts, 0, "{stats:?}");
    assert!(served.peak_reserved <= out.plan.pool_size);
}
