//! `stweaver verify PLAN [--trace T]`: load a plan file (which runs the plan verifier)
//! and, with `--trace`, check that the plan belongs to that trace (device and trace
//! digest) and covers it: the trace is classified again and every persistent, prologue
//! and per-iteration allocation must have exactly its request
//! ([`stweaver_planner::planning::check_coverage`]).

use std::path::Path;

use anyhow::{Context, Result, bail};
use stweaver_core::plan_file::{check_plan_matches, read_plan_file};
use stweaver_core::trace_file::trace_digest;
use stweaver_core::verify::verify_plan;
use stweaver_core::{DeviceId, Trace};
use stweaver_planner::classify::classify;
use stweaver_planner::input::load_traces;
use stweaver_planner::planning::check_coverage;

pub fn run(plan_path: &Path, trace_path: Option<&Path>, device: Option<i32>) -> Result<()> {
    let name = plan_path.display();
    let plan = read_plan_file(plan_path)?;
    let report =
        verify_plan(&plan).with_context(|| format!("{name}: the plan verifier rejects it"))?;
    println!(
        "{name}: valid plan for {}: pool {} ({}), planned LB {} ({:.5}x), {} prologue + {} iteration requests; the verifier unrolled {} iterations, peak of live bytes {}",
        plan.device,
        plan.pool_size.get(),
        plan.pool_size,
        plan.lower_bound.get(),
        plan.pool_size.ratio(plan.lower_bound),
        plan.prologue.len(),
        plan.iteration.len(),
        report.iterations_unrolled,
        report.peak_live.get()
    );
    if plan.class_count() > 1 {
        let sizes: Vec<usize> = (0..plan.class_count())
            .map(|c| plan.class(c).0.len())
            .collect();
        println!(
            "{name}: {} iteration classes, requests per class {sizes:?}",
            plan.class_count()
        );
    }
    let Some(trace_path) = trace_path else {
        return Ok(());
    };
    let traces = load_traces(trace_path)?;
    let trace = pick(
        trace_path,
        traces,
        device.map(DeviceId).unwrap_or(plan.device),
    )?;
    let digest = trace_digest(&trace);
    check_plan_matches(&plan, trace.device, digest).with_context(|| {
        format!(
            "{name}: refused for {} ({})",
            trace_path.display(),
            trace.device
        )
    })?;
    if plan.class_count() > 1 {
        // Planned per class (`stweaver plan --classes`): from one iteration of each class,
        // which the classification of `check_coverage` does not know.
        println!(
            "{name}: matches {} ({}, trace digest {digest:#018x}); a plan per iteration class is made from one iteration of each class, so its coverage is the planner's own (not checked here)",
            trace_path.display(),
            trace.device,
        );
        return Ok(());
    }
    if !plan.offload.is_empty() {
        // Its requests are those of the trace rewritten for the offload schedule
        // (`stweaver_planner::offload`), whose coverage the planner checked.
        println!(
            "{name}: matches {} ({}, trace digest {digest:#018x}); it offloads {} saved tensors, so it covers the trace as rewritten for them (checked by `stweaver plan --budget`, not here)",
            trace_path.display(),
            trace.device,
            plan.offload.len()
        );
        return Ok(());
    }
    let classes = classify(&trace);
    let cov = check_coverage(&trace, &classes, &plan)
        .with_context(|| format!("{name}: against {}", trace_path.display()))?;
    println!(
        "{name}: matches {} ({}, trace digest {digest:#018x}) and covers it: {} allocations served by prologue requests, {} by iteration requests, {} dynamic",
        trace_path.display(),
        trace.device,
        cov.prologue_allocations,
        cov.iteration_allocations,
        cov.dynamic_allocations
    );
    Ok(())
}

/// The trace of `device`, else the only trace (whose device the match check will then
/// compare with the plan's).
fn pick(path: &Path, traces: Vec<Trace>, device: DeviceId) -> Result<Trace> {
    let devices: Vec<String> = traces.iter().map(|t| t.device.to_string()).collect();
    if traces.len() == 1 {
        return Ok(traces.into_iter().next().expect("one trace"));
    }
    match traces.into_iter().find(|t| t.device == device) {
        Some(t) => Ok(t),
        None => bail!(
            "{}: no allocation history for {device} (devices with one: {})",
            path.display(),
            devices.join(", ")
        ),
    }
}
