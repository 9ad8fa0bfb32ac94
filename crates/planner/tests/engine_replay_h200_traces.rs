//! Traces recorded by stweaver's own trace mode on the H200 (2026-11-21), served by the
//! engine:
//!
//! - `cargo xtask gpu-bench --allocators trace --save-traces`: GPT-2 XL with
//!   checkpointing and the 1F1B-style Llama 1B schedule, 16 and 12 iterations, each
//!   ending with the harness's post-training work (hashing every parameter: 0.5–0.6 GB
//!   temporaries that no iteration has). That tail is what pushed plan mode's reserved
//!   peak 0.5–0.6 GB over the lower bound on the GPU; it must fit in the pool's gaps.
//! - `cargo xtask gpu-bench --gpus 2` (DDP, rank 0 of 2, 30 iterations, session 5): in
//!   session 4 rank 0's plan reserved 12.49 GiB on the GPU (rank 1: 10.74); with stream
//!   waits both ranks reserved 10.74 GiB, below expandable segments' 10.83.
//! - `cargo xtask gpu-bench --gpus 2` (FSDP2, rank 0 of 2, 30 iterations): three streams
//!   (compute, all-gather, reduce-scatter) and a 500 MB tensor that outlives each
//!   iteration (so it is not planned). On the GPU, auto mode's reserved memory grew by
//!   0.49 GiB every iteration: each copy of that tensor grew the pool, because the
//!   pool's gap search ignored other streams' ranges and every gap it found was refused.

mod common;

use stweaver_core::Trace;
use stweaver_core::engine::PlanOptions as ServeOptions;
use stweaver_planner::engine_replay::{
    AutoSchedule, EngineReplayOptions, EngineReplayReport, ServeMode, plan_first_iterations,
    replay_engine,
};
use stweaver_planner::planning::{PlanOptions, plan_trace};

fn load(name: &str) -> Trace {
    common::trace_file(&format!("crates/planner/tests/data/h200/{name}"))
}

/// Auto mode: the first three iterations recorded, planned, switched to.
fn auto_replay(trace: &Trace, opts: &EngineReplayOptions) -> EngineReplayReport {
    auto_replay_after(trace, opts, 3)
}

/// Auto mode: the first `record` iterations recorded, planned, switched to.
fn auto_replay_after(
    trace: &Trace,
    opts: &EngineReplayOptions,
    record: usize,
) -> EngineReplayReport {
    let planner = |recorded: &Trace| {
        plan_trace(recorded, &PlanOptions::default())
            .map(|o| o.plan)
            .map_err(|e| e.to_string())
    };
    let mode = ServeMode::Auto {
        schedule: AutoSchedule::At(record),
        planner: &planner,
        class_planner: None,
        relearner: None,
    };
    replay_engine(trace, &mode, opts).unwrap()
}

/// Plan from the first three iterations, whole trace served; then auto mode.
/// `expandable`: PyTorch's expandable segments' peak reserved on the same workload in
/// the same benchmark (bytes).
fn check(name: &str, expandable: u64) {
    let trace = load(name);
    let opts = EngineReplayOptions::default();
    // Plan mode as `cargo xtask gpu-bench` runs it: a plan of the whole trace (its
    // last iteration keeps its loss alive past the end: that iteration counts as the
    // tail, it must not make the loss's slot dynamic everywhere).
    let whole = plan_trace(&trace, &PlanOptions::default()).unwrap();
    let r = replay_engine(&trace, &ServeMode::Plan(&whole.plan), &opts).unwrap();
    let st = r.plan_stats.unwrap();
    eprintln!(
        "{name} whole-trace plan: {} ({:.5} x LB) {st:?}",
        r.peak_reserved,
        r.reserved_over_lb()
    );
    assert!(
        r.reserved_over_lb() <= 1.001,
        "{name}: {}",
        r.reserved_over_lb()
    );
    assert_eq!(st.grown, 0, "{name}: {st:?}");
    let (outcome, _) = plan_first_iterations(&trace, 3, &PlanOptions::default()).unwrap();
    let plan = replay_engine(&trace, &ServeMode::Plan(&outcome.plan), &opts).unwrap();
    eprintln!(
        "{name} plan: {} ({:.5} x LB), served plan {} hole {} online {}",
        plan.peak_reserved,
        plan.reserved_over_lb(),
        plan.counts.plan,
        plan.counts.hole,
        plan.counts.online
    );
    assert!(
        plan.reserved_over_lb() <= 1.001,
        "{name}: {}",
        plan.reserved_over_lb()
    );
    assert_eq!(plan.counts.online, 0);
    let st = plan.plan_stats.unwrap();
    assert_eq!(st.grown, 0, "{name}: the pool grew: {st:?}");

    let auto = auto_replay(&trace, &opts);
    let after = auto.peak_reserved_after_switch.expect("switched");
    eprintln!(
        "{name} auto: whole run {}, after the switch {} ({:.5} x LB)",
        auto.peak_reserved,
        after,
        after.ratio(auto.lower_bound)
    );
    assert!(after.ratio(auto.lower_bound) <= 1.01, "{name}: {after}");
    assert!(
        auto.peak_reserved.get() < expandable,
        "{name}: {}",
        auto.peak_reserved
    );
}

#[test]
fn gpt2xl_tail_fits_in_the_pool() {
    // Expandable segments on the H200: 9.559 GiB.
    check("gpt2xl_rcp.stwt.gz", (9.559 * (1u64 << 30) as f64) as u64);
}

#[test]
fn llama_1f1b_tail_fits_in_the_pool() {
    // Expandable segments on the H200: 9.756 GiB.
    check("llama1b_1f1b.stwt.gz", (9.756 * (1u64 << 30) as f64) as u64);
}

#[test]
fn fsdp2_rank0_dynamic_tensor_does_not_grow_the_pool_every_iteration() {
    let trace = load("fsdp2_llama1b_rank0.stwt.gz");
    let opts = EngineReplayOptions::default();
    let online = replay_engine(&trace, &ServeMode::Online, &opts).unwrap();
    let (outcome, _) = plan_first_iterations(&trace, 3, &PlanOptions::default()).unwrap();
    let plan = replay_engine(&trace, &ServeMode::Plan(&outcome.plan), &opts).unwrap();
    let st = plan.plan_stats.unwrap();
    eprintln!(
        "fsdp2 online {} plan {} ({:.4} x LB) {st:?}",
        online.peak_reserved,
        plan.peak_reserved,
        plan.reserved_over_lb()
    );
    assert!(st.grown <= 1, "the pool grew {} times", st.grown);
    // Streams apart (the planner's default) cost more than the lower bound, about
    // what PyTorch's per-stream pools cost: native reserved 6.22 GiB on the GPU.
    assert!(
        plan.reserved_over_lb() <= 1.40,
        "{}",
        plan.reserved_over_lb()
    );
    let auto = auto_replay(&trace, &opts);
    let after = auto.peak_reserved_after_switch.expect("switched");
    assert!(
        after <= online.peak_reserved,
        "{after} > {}",
        online.peak_reserved
    );
}

/// The same trace with the streams running behind the host (events pass up to 500
/// trace events late). A planned range held only by frees that wait for a lagging
/// stream makes the requesting stream wait for their events (stream waits, on by
/// default), so plan mode costs what it costs in step: per-stream and joint plans
/// alike. Every reuse of memory freed behind another stream's work is checked to be
/// ordered after that work (the replay's `Unordered` check). With the waits off, the
/// same plan pays for its conflicts. Auto mode stays at the online peak.
#[test]
fn fsdp2_rank0_with_lagging_streams() {
    let trace = load("fsdp2_llama1b_rank0.stwt.gz");
    let lagging = EngineReplayOptions {
        event_lag: Some(500),
        ..EngineReplayOptions::default()
    };
    let online = replay_engine(&trace, &ServeMode::Online, &lagging).unwrap();
    let plan_with = |popts: &PlanOptions, opts: &EngineReplayOptions| {
        let (outcome, _) = plan_first_iterations(&trace, 3, popts).unwrap();
        replay_engine(&trace, &ServeMode::Plan(&outcome.plan), opts).unwrap()
    };
    let in_step = plan_with(&PlanOptions::default(), &EngineReplayOptions::default());
    let per_stream = plan_with(&PlanOptions::default(), &lagging);
    let joint_opts = PlanOptions {
        share_streams: true,
        ..PlanOptions::default()
    };
    let joint = plan_with(&joint_opts, &lagging);
    let no_waits = plan_with(
        &PlanOptions::default(),
        &EngineReplayOptions {
            serve: ServeOptions {
                wait_for_pending_frees: false,
                ..ServeOptions::default()
            },
            ..lagging.clone()
        },
    );
    for (name, r) in [
        ("in step", &in_step),
        ("lagging", &per_stream),
        ("lagging, joint", &joint),
        ("lagging, no waits", &no_waits),
    ] {
        eprintln!(
            "fsdp2 plan, {name}: {} ({:.4} x LB) {:?}",
            r.peak_reserved,
            r.reserved_over_lb(),
            r.plan_stats
        );
        assert!(r.plan_abandoned.is_none(), "{name}");
    }
    let st = per_stream.plan_stats.expect("served");
    assert!(st.waits > 0 && st.conflicts * 20 < st.hits, "{st:?}");
    assert!(
        per_stream.peak_reserved.get() <= in_step.peak_reserved.get() + (64 << 20),
        "lagging {} vs in step {}",
        per_stream.peak_reserved,
        in_step.peak_reserved
    );
    assert!(
        joint.reserved_over_lb() <= 1.15,
        "{}",
        joint.reserved_over_lb()
    );
    assert!(
        no_waits.peak_reserved.get() > per_stream.peak_reserved.get() + (512 << 20),
        "waits off {} vs on {}",
        no_waits.peak_reserved,
        per_stream.peak_reserved
    );
    let auto = auto_replay(&trace, &lagging);
    let after = auto.peak_reserved_after_switch.expect("switched");
    assert!(
        after <= online.peak_reserved,
        "{after} > {}",
        online.peak_reserved
    );
}

/// `release_before_new_peak` on the H200 traces: never above plain online serving, and
/// below it on the multi-stream FSDP2 trace (holes of every stream's arena count), with
/// every live block checked for aliasing and no partial unmap.
#[test]
fn releasing_holes_before_a_new_peak_never_costs_memory() {
    for name in [
        "gpt2xl_rcp.stwt.gz",
        "llama1b_1f1b.stwt.gz",
        "fsdp2_llama1b_rank0.stwt.gz",
    ] {
        let trace = load(name);
        let plain =
            replay_engine(&trace, &ServeMode::Online, &EngineReplayOptions::default()).unwrap();
        let opts = EngineReplayOptions {
            release_before_new_peak: true,
            ..EngineReplayOptions::default()
        };
        let r = replay_engine(&trace, &ServeMode::Online, &opts).unwrap();
        eprintln!(
            "{name}: online {} -> {} with release before a new peak ({} syncs)",
            plain.peak_reserved, r.peak_reserved, r.device_counters.synchronizes
        );
        assert!(r.peak_reserved <= plain.peak_reserved, "{name}");
        if name.starts_with("fsdp2") {
            assert!(r.peak_reserved < plain.peak_reserved, "{name}");
        }
        assert_eq!(r.device_counters.partial_unmaps, 0);
    }
}

#[test]
fn ddp_rank0_plan_and_auto_stay_below_expandable_segments() {
    let trace = load("ddp_llama1b_rank0.stwt.gz");
    // The same run on two H200s (session 5): expandable segments reserved 11 624 513 536
    // bytes per rank, the plan 11 530 141 696, auto 11 605 639 168 (whole run).
    let expandable = 11_624_513_536u64;
    let opts = EngineReplayOptions::default();
    let whole = plan_trace(&trace, &PlanOptions::default()).unwrap();
    let plan = replay_engine(&trace, &ServeMode::Plan(&whole.plan), &opts).unwrap();
    let st = plan.plan_stats.unwrap();
    eprintln!(
        "ddp plan: {} ({:.5} x LB) {st:?}",
        plan.peak_reserved,
        plan.reserved_over_lb()
    );
    assert!(
        plan.reserved_over_lb() <= 1.005,
        "{}",
        plan.reserved_over_lb()
    );
    assert!(
        plan.peak_reserved.get() < expandable,
        "{}",
        plan.peak_reserved
    );
    assert_eq!(plan.counts.online, 0);
    // Auto as the bridge runs it: four iterations recorded (DDP rebuilds its buckets
    // after the first, so three leave too short a steady state to plan).
    let auto = auto_replay_after(&trace, &opts, 4);
    let after = auto.peak_reserved_after_switch.expect("switched");
    eprintln!(
        "ddp auto: whole run {}, after the switch {after}",
        auto.peak_reserved
    );
    assert!(
        auto.peak_reserved.get() < expandable,
        "{}",
        auto.peak_reserved
    );
    assert!(after.ratio(auto.lower_bound) <= 1.01, "{after}");
}
