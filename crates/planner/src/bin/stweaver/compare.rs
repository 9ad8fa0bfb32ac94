//! `stweaver compare [INPUT]`: lower bound, PyTorch native, expandable segments and
//! stweaver side by side (the logic is `stweaver_planner::report`).
//!
//! The stweaver row is what the runtime's default mode does on the trace: the engine
//! replayed in auto mode (record the first iterations online, plan them, switch to the
//! plan at an iteration boundary or stay online; `stweaver_planner::auto`), with the
//! outcome printed under the table. `--modes` / `--all-modes` add the engine in online
//! and in plan mode and the offline plan of the whole trace.
//!
//! With no INPUT it runs on the snapshot bundled into the binary
//! (`data/traces/snap_gpt2xl_rcp.pickle.gz`, a real GPT-2 XL training run on an H200), so it
//! works anywhere.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use stweaver_core::Trace;
use stweaver_planner::auto::DEFAULT_AUTO_ITERATIONS;
use stweaver_planner::engine_replay::{EngineReplayRow, EngineRowMode};
use stweaver_planner::input::LoadedInput;
use stweaver_planner::offline::OfflinePlanRow;
use stweaver_planner::offload::{parse_budget, plan_with_budget};
use stweaver_planner::planning::PlanOptions;
use stweaver_planner::replay::{AllocatorConfig, ReplayOptions};
use stweaver_planner::report::{self, StweaverRow};
use stweaver_planner::snapshot::load_snapshot_from_bytes;
use stweaver_planner::solver::SolveOptions;

/// The bundled real snapshot.
pub const BUNDLED: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../data/traces/snap_gpt2xl_rcp.pickle.gz"
));
pub const BUNDLED_NAME: &str = "bundled snap_gpt2xl_rcp.pickle.gz";

#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    /// A PyTorch memory snapshot (`.pickle` or `.pickle.gz`) or a stweaver trace file
    /// (`.stwt`). Default: the bundled GPT-2 XL snapshot.
    pub input: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// PyTorch allocator settings for the PyTorch rows, `PYTORCH_CUDA_ALLOC_CONF`
    /// syntax (default: the settings recorded in the snapshot).
    #[arg(long, value_name = "STR")]
    pub conf: Option<String>,
    /// Device whose trace to compare (default: the first device with allocations).
    #[arg(long, value_name = "N")]
    pub device: Option<i32>,
    /// stweaver rows, comma-separated: `auto` (the engine in auto mode, the runtime's
    /// default: record, plan, switch or stay online), `online` (the engine alone),
    /// `plan` (plan mode: a plan of the first iterations served over the whole trace),
    /// `offline` (the offline solver's plan of the whole trace).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "auto"
    )]
    pub modes: Vec<ModeRow>,
    /// Every stweaver row (`--modes auto,online,plan,offline`).
    #[arg(long, conflicts_with = "modes")]
    pub all_modes: bool,
    /// Auto mode: iterations recorded before planning (the runtime's
    /// `STWEAVER_AUTO_ITERATIONS`).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_AUTO_ITERATIONS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub auto_iterations: u64,
    /// Seconds the offline solver may spend on the offline plan row and on the plan of
    /// the plan mode row.
    #[arg(long, value_name = "SECS", default_value_t = 2.0)]
    pub plan_budget: f64,
    /// Leave out the stweaver (offline plan) row.
    #[arg(long)]
    pub no_plan: bool,
    /// Leave out the engine rows (auto, online, plan mode).
    #[arg(long)]
    pub no_engine: bool,
    /// A device memory budget (`16GiB`, `512MiB`, bytes): says which rows fit under
    /// it, and whether stweaver fits with saved activations offloaded
    /// (`stweaver plan --budget`).
    #[arg(long, value_name = "SIZE")]
    pub budget: Option<String>,
    /// How saved activations are scheduled to host memory under `--budget`.
    #[command(flatten)]
    pub offload: crate::offload_args::OffloadArgs,
}

/// A stweaver row of `compare` (`--modes`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeRow {
    Auto,
    Online,
    Plan,
    Offline,
}

impl ModeRow {
    const ALL: [ModeRow; 4] = [
        ModeRow::Auto,
        ModeRow::Online,
        ModeRow::Plan,
        ModeRow::Offline,
    ];
}

/// A trace ready to compare or draw.
pub struct Loaded {
    pub source: String,
    pub trace: Trace,
    /// The allocator settings the run was recorded with (defaults for a trace file,
    /// which does not record them).
    pub recorded: AllocatorConfig,
    pub load_seconds: f64,
}

/// Loads `input` (a snapshot or a trace file; default: the bundled snapshot) and picks
/// the device's trace.
pub fn load_input(input: Option<&Path>, device: Option<i32>) -> Result<Loaded> {
    let t0 = Instant::now();
    let (source, loaded) = match input {
        Some(p) => (
            p.display().to_string(),
            stweaver_planner::input::load_input(p)?,
        ),
        None => (
            BUNDLED_NAME.to_string(),
            LoadedInput::Snapshot(Box::new(
                load_snapshot_from_bytes(BUNDLED).context(BUNDLED_NAME)?,
            )),
        ),
    };
    let load_seconds = t0.elapsed().as_secs_f64();
    let recorded = match &loaded {
        LoadedInput::Snapshot(snap) => AllocatorConfig::from_snapshot_settings(&snap.settings)
            .with_context(|| format!("{source}: allocator_settings"))?,
        LoadedInput::TraceFile(_) => AllocatorConfig::default(),
    };
    let traces = loaded.into_traces();
    let devices: Vec<String> = traces.iter().map(|t| t.device.to_string()).collect();
    let trace = match device {
        None => traces.into_iter().next(),
        Some(d) => traces.into_iter().find(|t| t.device.0 == d),
    };
    let Some(trace) = trace else {
        bail!(
            "{source}: no trace for device {} (devices with allocations: {})",
            device.map_or("any".to_string(), |d| d.to_string()),
            if devices.is_empty() {
                "none".to_string()
            } else {
                devices.join(", ")
            }
        );
    };
    Ok(Loaded {
        source,
        trace,
        recorded,
        load_seconds,
    })
}

pub fn run(args: CompareArgs) -> Result<()> {
    let loaded = load_input(args.input.as_deref(), args.device)?;
    let base = match &args.conf {
        Some(s) => AllocatorConfig::parse(s).context("--conf")?,
        None => loaded.recorded.clone(),
    };
    if !(args.plan_budget.is_finite() && args.plan_budget > 0.0) {
        bail!("--plan-budget must be a positive number of seconds");
    }
    let budget = match &args.budget {
        Some(b) => Some(parse_budget(b).context("--budget")?),
        None => None,
    };
    let t0 = Instant::now();
    // stweaver rows, in the order of ModeRow::ALL: the engine in auto mode (the
    // default), online and in plan mode; the offline plan of the whole trace.
    let offline = OfflinePlanRow {
        options: SolveOptions {
            threads: 0,
            time_budget: Some(Duration::from_secs_f64(args.plan_budget)),
            ..SolveOptions::default()
        },
    };
    let engine = |mode| EngineReplayRow {
        auto_iterations: args.auto_iterations,
        ..EngineReplayRow::new(mode)
    };
    let (auto, online) = (engine(EngineRowMode::Auto), engine(EngineRowMode::Online));
    let planned = EngineReplayRow {
        plan: PlanOptions {
            solve: offline.options.clone(),
            ..PlanOptions::default()
        },
        ..engine(EngineRowMode::Plan)
    };
    let wanted = |m: ModeRow| {
        (args.all_modes || args.modes.contains(&m))
            && match m {
                ModeRow::Offline => !args.no_plan,
                _ => !args.no_engine,
            }
    };
    let sources: Vec<&dyn StweaverRow> = ModeRow::ALL
        .into_iter()
        .filter(|&m| wanted(m))
        .map(|m| -> &dyn StweaverRow {
            match m {
                ModeRow::Auto => &auto,
                ModeRow::Online => &online,
                ModeRow::Plan => &planned,
                ModeRow::Offline => &offline,
            }
        })
        .collect();
    let cmp = report::compare(
        &loaded.source,
        &loaded.trace,
        &base,
        &ReplayOptions::default(),
        &sources,
    )
    .with_context(|| loaded.source.clone())?;
    let fit = budget.map(|b| {
        let offload = plan_with_budget(
            &loaded.trace,
            &args.offload.options(
                b,
                PlanOptions {
                    solve: offline.options.clone(),
                    ..PlanOptions::default()
                },
            ),
        );
        (b, cmp.fits(b), offload)
    });
    let compare_seconds = t0.elapsed().as_secs_f64();
    let text = if args.json {
        let mut j = cmp.to_json();
        j["load_seconds"] = loaded.load_seconds.into();
        j["compare_seconds"] = compare_seconds.into();
        if let Some((b, rows, offload)) = &fit {
            let rows: serde_json::Map<String, serde_json::Value> = rows
                .iter()
                .map(|(k, f)| (k.id().to_owned(), (*f).into()))
                .collect();
            let offload = match offload {
                Ok(o) => serde_json::json!({
                    "fits": true,
                    "planned_peak": o.offload.planned_peak.get(),
                    "tensors": o.offload.tensors,
                    "bytes_per_iteration": o.offload.bytes_per_iteration.get(),
                    "stalls": o.offload.stalls,
                }),
                Err(e) => serde_json::json!({ "fits": false, "why": e.to_string() }),
            };
            j["budget"] = serde_json::json!({
                "bytes": b.get(),
                "fits": rows,
                "stweaver_offload": offload,
            });
        }
        serde_json::to_string_pretty(&j)? + "\n"
    } else {
        let mut t = format!(
            "{}\nload {:.3} s, rows {:.3} s\n",
            cmp.to_table(),
            loaded.load_seconds,
            compare_seconds
        );
        if let Some((b, rows, offload)) = &fit {
            t += &format!("budget {b}:\n");
            for ((_, f), r) in rows.iter().zip(&cmp.rows) {
                t += &format!(
                    "  {:<28} {} ({})\n",
                    r.label,
                    if *f { "fits" } else { "does not fit" },
                    r.peak_reserved
                );
            }
            t += &match offload {
                Ok(o) if o.offload.tensors == 0 => format!(
                    "  {:<28} fits without offload ({})\n",
                    "stweaver plan --budget", o.offload.planned_peak
                ),
                Ok(o) => format!(
                    "  {:<28} fits ({}), offloading {} tensors, {} per iteration, {} stalls\n",
                    "stweaver plan --budget",
                    o.offload.planned_peak,
                    o.offload.tensors,
                    o.offload.bytes_per_iteration,
                    o.offload.stalls
                ),
                Err(e) => format!("  {:<28} does not fit: {e}\n", "stweaver plan --budget"),
            };
        }
        t
    };
    emit(&text)
}

/// Writes to stdout; a closed pipe (`| head`) is not an error.
pub fn emit(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}
