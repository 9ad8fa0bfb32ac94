//! `stweaver replay TRACE --plan PLAN`: the engine serving a plan file over a trace's
//! requests, on an accounting-only device the size of the plan's budget (or `--limit`),
//! as the runtime serves it ([`replay_engine`] in plan mode, every allocation checked
//! against the live ones).
//!
//! The use: a plan that conflicted or was given up on a GPU. Record the run that served
//! it (`STWEAVER_TRACE` in plan mode, or `budget_bench.py --served-traces`), then replay
//! that trace against the same plan here: the report names the requests the plan did not
//! serve at their planned offsets (which iteration, which size, where they went), the
//! peak reserved against the limit, and why the engine gave the plan up, if it did.
//! Cost: one engine replay, O(events × log live).

use std::path::PathBuf;

use anyhow::{Context, Result};
use stweaver_core::Bytes;
use stweaver_core::plan_file::read_plan_file;
use stweaver_core::trace::EventKind;
use stweaver_planner::engine_replay::{
    ConflictSeen, EngineReplayOptions, EngineReplayReport, ServeMode, Served, iteration_boundaries,
    plan_stats_json, replay_engine,
};
use stweaver_planner::offload::parse_budget;

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// The trace (or snapshot) whose requests are served.
    #[arg(value_name = "TRACE")]
    pub input: PathBuf,
    /// The plan file to serve.
    #[arg(long, value_name = "PLAN")]
    pub plan: PathBuf,
    /// The device's memory, the engine's limit (`16GiB`, bytes). Default: the plan's
    /// budget, else an H200's 141 GB.
    #[arg(long, value_name = "SIZE")]
    pub limit: Option<String>,
    /// Events pass only every N trace events (and at iteration boundaries): a GPU the
    /// host runs ahead of. Default: at once.
    #[arg(long, value_name = "N")]
    pub event_lag: Option<usize>,
    /// Free every block when the trace says its free completed, instead of freeing
    /// at the request and keeping the block pending until then (the runtime's
    /// `record_stream` rule, the default).
    #[arg(long)]
    pub frees_at_completion: bool,
    /// The device whose trace to replay (default: the plan's).
    #[arg(long, value_name = "N")]
    pub device: Option<i32>,
    /// How many requests not served at their planned offset to list.
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub show: usize,
    /// JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One request the plan did not serve at its planned offset.
#[derive(serde::Serialize)]
struct Miss {
    alloc: u32,
    size: u64,
    stream: u64,
    event: usize,
    /// Iteration boundaries before it (0: the prologue).
    iteration: usize,
    served: &'static str,
    /// A conflict: its planned offset in the pool and the allocations that occupied the
    /// planned range (live, then pending on other streams).
    #[serde(skip_serializing_if = "Option::is_none")]
    planned_offset: Option<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    occupied_by: Vec<Occupant>,
}

/// An allocation that occupied a conflict's planned range.
#[derive(serde::Serialize)]
struct Occupant {
    alloc: u32,
    size: u64,
    /// Event of its allocation, and its iteration.
    event: usize,
    iteration: usize,
    pending: bool,
}

fn served_name(s: Served) -> &'static str {
    match s {
        Served::Plan => "plan",
        Served::Hole => "hole",
        Served::Online => "online",
        Served::NotServed => "not served",
    }
}

pub fn run(args: ReplayArgs) -> Result<()> {
    let plan = read_plan_file(&args.plan).with_context(|| args.plan.display().to_string())?;
    let traces = stweaver_planner::input::load_traces(&args.input)
        .with_context(|| args.input.display().to_string())?;
    let device = args.device.unwrap_or(plan.device.0);
    let trace = traces
        .into_iter()
        .find(|t| t.device.0 == device)
        .with_context(|| format!("{}: no trace for device {device}", args.input.display()))?;
    let limit = match &args.limit {
        Some(s) => parse_budget(s).context("--limit")?,
        None => plan
            .budget
            .unwrap_or(EngineReplayOptions::default().device_memory),
    };
    let opts = EngineReplayOptions {
        device_memory: limit,
        event_lag: args.event_lag,
        deferred_frees: !args.frees_at_completion,
        ..EngineReplayOptions::default()
    };
    let report = replay_engine(&trace, &ServeMode::Plan(&plan), &opts).with_context(|| {
        format!(
            "replaying {} against {}",
            args.input.display(),
            args.plan.display()
        )
    })?;

    // Where each allocation was requested (event index, iteration: the boundaries the
    // replay marked before it).
    let bounds = iteration_boundaries(&trace);
    let mut at = vec![(0usize, 0usize); trace.allocations.len()];
    for (k, ev) in trace.events.iter().enumerate() {
        if let EventKind::Alloc(a) = ev.kind {
            at[a.index()] = (k, bounds.partition_point(|&b| b <= k));
        }
    }
    let iteration = bounds.len();
    let mut per_iteration: Vec<u64> = vec![0; iteration + 1];
    let conflicts: std::collections::HashMap<usize, &ConflictSeen> = report
        .conflicts
        .iter()
        .map(|c| (c.alloc.index(), c))
        .collect();
    let occupant = |a: stweaver_core::AllocId, pending: bool| Occupant {
        alloc: a.0,
        size: trace.allocations[a.index()].size.get(),
        event: at[a.index()].0,
        iteration: at[a.index()].1,
        pending,
    };
    let mut misses = Vec::new();
    for (i, &s) in report.served.iter().enumerate() {
        if matches!(s, Served::Hole | Served::Online) && !trace.allocations[i].preexisting {
            let (event, it) = at[i];
            per_iteration[it] += 1;
            misses.push(Miss {
                alloc: i as u32,
                size: trace.allocations[i].size.get(),
                stream: trace.allocations[i].stream.0 as u64,
                event,
                iteration: it,
                served: served_name(s),
                planned_offset: conflicts.get(&i).map(|c| c.offset),
                occupied_by: conflicts.get(&i).map_or_else(Vec::new, |c| {
                    c.occupied_by
                        .iter()
                        .map(|&a| occupant(a, false))
                        .chain(c.pending.iter().map(|&a| occupant(a, true)))
                        .collect()
                }),
            });
        }
    }
    misses.sort_by_key(|m| m.event);
    if args.json {
        let j = serde_json::json!({
            "trace": args.input.display().to_string(),
            "plan": args.plan.display().to_string(),
            "limit": limit.get(),
            "lower_bound": report.lower_bound.get(),
            "plan_pool": plan.pool_size.get(),
            "peak_reserved": report.peak_reserved.get(),
            "peak_allocated": report.peak_allocated.get(),
            "pool_mapped": report.pool_size.get(),
            "plan_error": report.plan_error,
            "plan_abandoned": report.plan_abandoned,
            "plan_stats": report.plan_stats.as_ref().map(plan_stats_json),
            "served": {"plan": report.counts.plan, "hole": report.counts.hole, "online": report.counts.online},
            "misses_per_iteration": per_iteration,
            "misses": misses.iter().take(args.show).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    print!(
        "{}",
        text(&args, &report, &plan, limit, &per_iteration, &misses)
    );
    Ok(())
}

fn text(
    args: &ReplayArgs,
    r: &EngineReplayReport,
    plan: &stweaver_core::plan::Plan,
    limit: Bytes,
    per_iteration: &[u64],
    misses: &[Miss],
) -> String {
    let mut t = format!(
        "{} served by {} under {limit}\n",
        args.input.display(),
        args.plan.display()
    );
    t += &format!(
        "lower bound {}, plan pool {}, peak reserved {} ({:.4} x LB), pool mapped {}\n",
        r.lower_bound,
        plan.pool_size,
        r.peak_reserved,
        r.reserved_over_lb(),
        r.pool_size
    );
    t += &format!(
        "served: {} at their planned offset, {} in pool holes, {} online\n",
        r.counts.plan, r.counts.hole, r.counts.online
    );
    if let Some(s) = r.plan_stats {
        t += &format!(
            "plan: {} hits ({} after waiting), {} conflicts, {} unplanned, {} holes, {} grown, {} skipped, {} iterations\n",
            s.hits, s.waits, s.conflicts, s.unplanned, s.holes, s.grown, s.skipped, s.iterations
        );
    }
    match (&r.plan_error, &r.plan_abandoned) {
        (Some(e), _) => t += &format!("the engine refused the plan: {e}\n"),
        (None, Some(why)) => t += &format!("the plan was given up: {why}\n"),
        (None, None) => t += "the plan was served to the end\n",
    }
    let counts: Vec<String> = per_iteration.iter().map(u64::to_string).collect();
    t += &format!(
        "not at their planned offset, per iteration (0: prologue): {}\n",
        counts.join(" ")
    );
    for m in misses.iter().take(args.show) {
        t += &format!(
            "  alloc {} ({} on stream {:#x}) at event {}, iteration {}: {}",
            m.alloc,
            Bytes(m.size),
            m.stream,
            m.event,
            m.iteration,
            m.served
        );
        if let Some(off) = m.planned_offset {
            let occ: Vec<String> = m
                .occupied_by
                .iter()
                .map(|o| {
                    format!(
                        "alloc {} ({}, from event {}, iteration {}{})",
                        o.alloc,
                        Bytes(o.size),
                        o.event,
                        o.iteration,
                        if o.pending { ", free pending" } else { "" }
                    )
                })
                .collect();
            t += &format!(
                "; conflict at pool offset {off:#x}, occupied by {}",
                if occ.is_empty() {
                    "nothing live (unmapped or being mapped)".to_string()
                } else {
                    occ.join(", ")
                }
            );
        }
        t.push('\n');
    }
    if misses.len() > args.show {
        t += &format!("  ... {} more (--show N)\n", misses.len() - args.show);
    }
    t
}
