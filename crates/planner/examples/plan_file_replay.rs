//! Serves a trace from a plan file with the engine (accounting-only device) and prints
//! peak reserved against the lower bound, as plan mode does on the GPU.
//!
//!     cargo run --release -p stweaver-planner --example plan_file_replay -- TRACE PLAN
use stweaver_core::plan_file::read_plan_file;
use stweaver_planner::engine_replay::{EngineReplayOptions, ServeMode, replay_engine};

fn main() -> anyhow::Result<()> {
    let mut a = std::env::args().skip(1);
    let (trace, plan) = (a.next().unwrap_or_default(), a.next().unwrap_or_default());
    let trace = stweaver_planner::input::load_traces(std::path::Path::new(&trace))?.swap_remove(0);
    let plan = read_plan_file(std::path::Path::new(&plan))?;
    let r = replay_engine(
        &trace,
        &ServeMode::Plan(&plan),
        &EngineReplayOptions::default(),
    )?;
    println!(
        "plan file: reserved {} ({:.4} x LB), plan {} hole {} online {}, {:?}, given up: {:?}",
        r.peak_reserved,
        r.reserved_over_lb(),
        r.counts.plan,
        r.counts.hole,
        r.counts.online,
        r.plan_stats,
        r.plan_abandoned
    );
    Ok(())
}
