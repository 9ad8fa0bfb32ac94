//! `stweaver plan SNAPSHOT|TRACE [-o PLAN]`: classify a recorded trace, plan it
//! ([`stweaver_planner::planning::plan_trace`]) and write the plan file.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use stweaver_core::engine::servable_from_start;
use stweaver_core::plan_file::write_plan_file;
use stweaver_core::{Bytes, DeviceId, Trace};
use stweaver_planner::classify::{DynamicReason, Steady};
use stweaver_planner::input::load_traces;
use stweaver_planner::offload::{OffloadReport, parse_budget, plan_with_budget};
use stweaver_planner::planning::{PlanOptions, PlanOutcome, plan_trace};

use super::{PlanArgs, Spinner, interrupted, solve_options};

/// The trace of `device` (or the only one) among those of `path`.
pub fn pick_trace(path: &Path, traces: Vec<Trace>, device: Option<i32>) -> Result<Trace> {
    let devices = || {
        traces
            .iter()
            .map(|t| t.device.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match device {
        Some(d) => {
            let listed = devices();
            traces
                .into_iter()
                .find(|t| t.device == DeviceId(d))
                .with_context(|| {
                    format!(
                        "{}: no allocation history for cuda:{d} (devices with one: {listed})",
                        path.display()
                    )
                })
        }
        None => match traces.len() {
            0 => bail!("{}: no device has allocation history", path.display()),
            1 => Ok(traces.into_iter().next().expect("one trace")),
            _ => bail!(
                "{}: several devices have allocation history ({}); pick one with --device N",
                path.display(),
                devices()
            ),
        },
    }
}

pub fn run(args: &PlanArgs) -> Result<()> {
    if args.csv_out.is_some() || args.period.is_some() {
        bail!(
            "{}: --csv-out and --period are for CSV instances; a snapshot or trace is planned from its own iterations (write the plan with -o)",
            args.input.display()
        );
    }
    let started = Instant::now();
    let traces = load_traces(&args.input)?;
    let trace = pick_trace(&args.input, traces, args.device)?;
    let loaded = started.elapsed();
    let mut opts = PlanOptions {
        solve: solve_options(args)?,
        share_streams: args.share_streams,
        ..PlanOptions::default()
    };
    if args.classes {
        return per_class(args, &trace, opts);
    }
    let budget = match &args.budget {
        Some(b) => Some(parse_budget(b).context("--budget")?),
        None => None,
    };
    let spinner = Spinner::start(&mut opts.solve, !args.quiet);
    let (outcome, offload) = match budget {
        None => {
            let result = plan_trace(&trace, &opts);
            spinner.stop();
            if interrupted(&opts.solve) {
                eprintln!("stweaver plan: interrupted: writing the best plan found until Ctrl-C");
            }
            let outcome =
                result.with_context(|| format!("{}: planning failed", args.input.display()))?;
            (outcome, None)
        }
        Some(budget) => {
            let result = plan_with_budget(&trace, &args.offload.options(budget, opts));
            spinner.stop();
            let b = result.with_context(|| {
                format!(
                    "{}: no plan within the budget {budget}",
                    args.input.display()
                )
            })?;
            (b.outcome, Some(b.offload))
        }
    };
    if let Some(out) = &args.output {
        write_plan_file(out, &outcome.plan)?;
    }
    if args.json {
        let mut j = json(args, &outcome, loaded.as_secs_f64());
        if let Some(r) = &offload {
            j["budget"] = r.budget.get().into();
            j["planned_peak"] = r.planned_peak.get().into();
            j["offload"] = offload_json(r);
        }
        println!("{j}");
    } else {
        print_text(args, &outcome, loaded.as_secs_f64());
        if let Some(r) = &offload {
            print_offload(r);
        }
    }
    Ok(())
}

fn offload_json(r: &OffloadReport) -> serde_json::Value {
    serde_json::json!({
        "tensors": r.tensors,
        "bytes_per_iteration": r.bytes_per_iteration.get(),
        "candidates": r.candidates,
        "candidate_bytes": r.candidate_bytes.get(),
        "minimum": r.minimum.get(),
        "pool_without_offload": r.pool_without_offload.get(),
        "stalls": r.stalls,
        "stall_us": r.stall_us,
        "copy_out_wait_us": r.copy_out_wait_us,
        "timing": r.timing.id(),
        "link_gbps": r.link_gbps,
        "reuse_offloaded": r.reuse.id(),
        "plans_made": r.attempts,
    })
}

fn print_offload(r: &OffloadReport) {
    let b = |x: Bytes| format!("{} ({})", x.get(), x);
    println!("  budget           {}", b(r.budget));
    println!("  planned peak     {}", b(r.planned_peak));
    if r.tensors == 0 {
        println!(
            "  offload          none needed (pool without offload {})",
            r.pool_without_offload
        );
        return;
    }
    println!(
        "  offload          {} of {} saved tensors, {} of {} per iteration (pool without offload {}, minimum {})",
        r.tensors,
        r.candidates,
        r.bytes_per_iteration,
        r.candidate_bytes,
        r.pool_without_offload,
        r.minimum
    );
    println!(
        "  copy-out wait    {:.0} µs per iteration (compute waits at the peak for copies the link cannot finish before it)",
        r.copy_out_wait_us
    );
    println!(
        "  copy stalls      {} ({:.0} µs per iteration; link {} GB/s per direction, timed by {}, memory reused {})",
        r.stalls,
        r.stall_us,
        r.link_gbps,
        r.timing.id(),
        r.reuse.id()
    );
}

fn json(args: &PlanArgs, o: &PlanOutcome, load_s: f64) -> serde_json::Value {
    let r = &o.report;
    let c = &r.counts;
    let dynamic_by_reason: serde_json::Map<String, serde_json::Value> = DynamicReason::ALL
        .iter()
        .map(|&d| (d.id().to_owned(), c.dynamic_for(d).into()))
        .collect();
    serde_json::json!({
        "input": args.input.display().to_string(),
        "device": o.plan.device.0,
        "output": args.output.as_ref().map(|p| p.display().to_string()),
        "trace_digest": format!("{:#018x}", o.plan.trace_digest),
        "steady_state": steady(&o.classification.steady),
        "prologue_len": r.prologue_len,
        "iteration_len": r.iteration_len,
        "repetitions": r.repetitions,
        "lower_bound": r.trace_lower_bound.get(),
        "planned_lower_bound": r.planned_lower_bound.get(),
        "pool": r.pool_size.get(),
        "pool_over_lb": r.pool_over_trace_lb(),
        "pool_over_planned_lb": r.pool_over_planned_lb(),
        "steady_peak": r.steady_peak.get(),
        "layout": r.layout.id(),
        "classes": {
            "persistent": c.persistent,
            "prologue": c.prologue,
            "per_iteration": c.per_iteration,
            "dynamic": c.dynamic,
            "dynamic_by_reason": dynamic_by_reason,
        },
        "requests": { "prologue": r.prologue_requests, "iteration": r.iteration_requests },
        "dynamic": { "requests": r.dynamic.requests, "peak_bytes": r.dynamic.peak_bytes.get() },
        "plan_mode_refuses": servable_from_start(&o.plan).err(),
        "seconds": {
            "load": load_s,
            "classify": r.timings.classify.as_secs_f64(),
            "solve": r.timings.solve.as_secs_f64(),
            "place": r.timings.place.as_secs_f64(),
            "verify": r.timings.verify.as_secs_f64(),
            "plan": r.timings.total.as_secs_f64(),
        },
    })
}

fn steady(s: &Steady) -> String {
    match s {
        Steady::Periodic(p) => format!("periodic ({:?})", p.source),
        Steady::Aperiodic { windows } => format!("none ({windows} windows aligned)"),
    }
}

fn print_text(args: &PlanArgs, o: &PlanOutcome, load_s: f64) {
    let r = &o.report;
    let c = &r.counts;
    let b = |x: Bytes| format!("{} ({})", x.get(), x);
    println!("plan {} ({})", args.input.display(), o.plan.device);
    println!("  steady state     {}", steady(&o.classification.steady));
    if r.iteration_len > 0 {
        println!(
            "  plan clock       prologue {} ticks, iteration {} ticks ({} in the trace)",
            r.prologue_len, r.iteration_len, r.repetitions
        );
    } else {
        println!(
            "  plan clock       prologue {} ticks (prologue only)",
            r.prologue_len
        );
    }
    println!(
        "  classes          {} persistent, {} prologue, {} per-iteration, {} dynamic",
        c.persistent, c.prologue, c.per_iteration, c.dynamic
    );
    for d in DynamicReason::ALL {
        let n = c.dynamic_for(d);
        if n > 0 {
            println!("    dynamic: {:<28}{n}", d.id());
        }
    }
    println!(
        "  requests         {} prologue + {} per iteration",
        r.prologue_requests, r.iteration_requests
    );
    println!("  lower bound      {}", b(r.trace_lower_bound));
    println!("  planned LB       {}", b(r.planned_lower_bound));
    println!("  pool (peak)      {}", b(r.pool_size));
    println!("  pool/LB          {:.5}", r.pool_over_trace_lb());
    println!("  pool/planned LB  {:.5}", r.pool_over_planned_lb());
    if r.dynamic.requests > 0 {
        println!(
            "  dynamic          {} requests, peak {}",
            r.dynamic.requests,
            b(r.dynamic.peak_bytes)
        );
    }
    println!("  layout           {}", r.layout.id());
    println!(
        "  time             {:.3} s plan (classify {:.3}, solve {:.3}, place {:.3}, verify {:.3}) + {:.3} s load",
        r.timings.total.as_secs_f64(),
        r.timings.classify.as_secs_f64(),
        r.timings.solve.as_secs_f64(),
        r.timings.place.as_secs_f64(),
        r.timings.verify.as_secs_f64(),
        load_s
    );
    match &args.output {
        Some(out) => println!("  written          {}", out.display()),
        None => println!("  written          nothing (no -o)"),
    }
    if let Err(why) = servable_from_start(&o.plan) {
        println!("  warning          plan mode will not serve it: {why}; use auto mode");
    }
}

/// `--classes`: the trace planned per iteration class
/// ([`stweaver_planner::class_planning::plan_classes`]), written with `-o`, summarised.
fn per_class(args: &PlanArgs, trace: &stweaver_core::Trace, opts: PlanOptions) -> Result<()> {
    use stweaver_planner::class_planning::{ClassPlanOptions, plan_classes};
    if args.budget.is_some() {
        bail!("--classes plans without offload: leave out --budget");
    }
    let o = ClassPlanOptions {
        plan: opts,
        ..ClassPlanOptions::default()
    };
    let cp = plan_classes(trace, &o)
        .with_context(|| format!("{}: no plan per iteration class", args.input.display()))?;
    if let Some(out) = &args.output {
        write_plan_file(out, &cp.plan)?;
    }
    let p = &cp.plan;
    let lb = trace.lower_bound().bytes;
    let sizes: Vec<usize> = (0..p.class_count()).map(|c| p.class(c).0.len()).collect();
    if args.json {
        let v = serde_json::json!({
            "input": args.input.display().to_string(),
            "output": args.output.as_ref().map(|p| p.display().to_string()),
            "classes": cp.classes,
            "planned_classes": cp.planned,
            "iterations": cp.iterations,
            "covered_iterations": cp.covered,
            "class_requests": sizes,
            "prologue_requests": p.prologue.len(),
            "unplanned_requests": p.dynamic.requests,
            "lower_bound": lb.get(),
            "pool": p.pool_size.get(),
            "pool_over_lb": p.pool_size.ratio(lb),
        });
        println!("{v}");
    } else {
        println!("plan {} per iteration class", args.input.display());
        println!(
            "  classes          {} planned of {} ({} of {} iterations)",
            cp.planned, cp.classes, cp.covered, cp.iterations
        );
        println!("  class requests   {sizes:?}");
        println!("  prologue         {} requests", p.prologue.len());
        println!("  lower bound      {} ({})", lb.get(), lb);
        println!(
            "  pool             {} ({}, {:.5} x lower bound)",
            p.pool_size.get(),
            p.pool_size,
            p.pool_size.ratio(lb)
        );
        if let Some(out) = &args.output {
            println!("  written          {}", out.display());
        }
    }
    Ok(())
}
