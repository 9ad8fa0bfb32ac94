//! Serves one trace with the engine in every mode and prints peak reserved against the
//! lower bound: online, plan (from the first iterations, the whole trace served), auto
//! (record the first iterations online, plan them, switch at once) and auto as the runtime
//! runs it (`stweaver_planner::auto`: 4 iterations recorded, switch two boundaries later).
//!
//!     [LAG=K] [RELEASE_AT_PEAK=1] [LOG_ITERATIONS=1] [SHARE_STREAMS=1] [NO_PLAN_WAIT=1] cargo run --release -p stweaver-planner --example replay_modes -- TRACE [ITERATIONS]
//!
//! TRACE: a `.stwt` trace or a PyTorch snapshot; ITERATIONS (default 3): how many the plan
//! and the auto recording take.
use std::time::Instant;

use stweaver_core::Trace;
use stweaver_planner::auto::{auto_plan_options, plan_recording};
use stweaver_planner::engine_replay::{
    AutoSchedule, EngineReplayOptions, EngineReplayReport, ServeMode, plan_first_iterations,
    replay_engine,
};
use stweaver_planner::planning::{PlanOptions, plan_trace};

fn show(r: &EngineReplayReport, secs: f64) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    print!(
        "{:<7} reserved {:>8.3} GiB = {:.4} x LB, util {:>6.2} %, plan {:>7} hole {:>6} online {:>7}",
        r.mode,
        gib(r.peak_reserved.get()),
        r.reserved_over_lb(),
        100.0 * r.peak_allocated.get() as f64 / r.peak_reserved.get() as f64,
        r.counts.plan,
        r.counts.hole,
        r.counts.online,
    );
    print!(
        ", small {:.3} large {:.3} GiB",
        gib(r.peak_reserved_small.get()),
        gib(r.peak_reserved_large.get())
    );
    if let Some(a) = r.peak_reserved_after_switch {
        print!(
            ", after switch {:.3} GiB = {:.4} x LB",
            gib(a.get()),
            a.ratio(r.lower_bound)
        );
    }
    if let Some(st) = &r.plan_stats {
        print!(", conflicts {} grown {}", st.conflicts, st.grown);
    }
    let c = &r.device_counters;
    print!(
        ", maps {} unmaps {} syncs {}",
        c.maps, c.unmaps, c.synchronizes
    );
    if let Some(e) = &r.plan_abandoned {
        print!(", plan given up: {e}");
    }
    if let Some(e) = &r.plan_error {
        print!(", plan error: {e}");
    }
    println!(" ({secs:.2} s)");
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: replay_modes TRACE [ITERATIONS]"))?;
    let k: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(3);
    let trace: Trace =
        stweaver_planner::input::load_traces(std::path::Path::new(&path))?.swap_remove(0);
    let opts = EngineReplayOptions {
        // LAG=K: streams run up to K trace events behind the host.
        event_lag: std::env::var("LAG").ok().and_then(|v| v.parse().ok()),
        // RELEASE_AT_PEAK=1: give back free holes before an online arena sets a new peak.
        release_before_new_peak: std::env::var_os("RELEASE_AT_PEAK").is_some(),
        // LOG_ITERATIONS=1: device traffic at every iteration boundary.
        log_iterations: std::env::var_os("LOG_ITERATIONS").is_some(),
        // NO_PLAN_WAIT=1: a planned range held by pending frees is a conflict
        // (`wait_for_pending_frees` off, the engine before stream waits).
        serve: stweaver_core::engine::PlanOptions {
            wait_for_pending_frees: std::env::var_os("NO_PLAN_WAIT").is_none(),
            ..stweaver_core::engine::PlanOptions::default()
        },
        ..EngineReplayOptions::default()
    };
    // SHARE_STREAMS=1: one joint solve over all streams (`PlanOptions::share_streams`).
    let popts = PlanOptions {
        share_streams: std::env::var_os("SHARE_STREAMS").is_some(),
        ..PlanOptions::default()
    };
    println!(
        "{path}: lower bound {:.3} GiB",
        trace.lower_bound().bytes.get() as f64 / (1u64 << 30) as f64
    );
    let t = Instant::now();
    let r = replay_engine(&trace, &ServeMode::Online, &opts)?;
    show(&r, t.elapsed().as_secs_f64());
    let t = Instant::now();
    match plan_first_iterations(&trace, k, &popts) {
        Ok((outcome, _)) => {
            let r = replay_engine(&trace, &ServeMode::Plan(&outcome.plan), &opts)?;
            show(&r, t.elapsed().as_secs_f64());
        }
        Err(e) => println!("plan    (first {k} iterations): {e}"),
    }
    let planner = |recorded: &Trace| {
        plan_trace(recorded, &popts)
            .map(|o| o.plan)
            .map_err(|e| e.to_string())
    };
    let t = Instant::now();
    let r = replay_engine(
        &trace,
        &ServeMode::Auto {
            schedule: AutoSchedule::At(k),
            planner: &planner,
            class_planner: None,
            relearner: None,
        },
        &opts,
    )?;
    show(&r, t.elapsed().as_secs_f64());
    // Auto mode as the runtime runs it (`stweaver compare`'s row, there with release at
    // a new peak on): record DEFAULT_AUTO_ITERATIONS, plan at the next boundary with the
    // runtime's planner settings, switch one boundary later.
    let planner = |recorded: &Trace| plan_recording(recorded, &auto_plan_options(false));
    let t = Instant::now();
    let r = replay_engine(
        &trace,
        &ServeMode::Auto {
            schedule: AutoSchedule::runtime_default(),
            planner: &planner,
            class_planner: None,
            relearner: None,
        },
        &opts,
    )?;
    show(&r, t.elapsed().as_secs_f64());
    if let Some(o) = &r.auto {
        println!("        runtime schedule: {o}");
    }
    Ok(())
}
