//! `stweaver viz [INPUT] -o FILE.svg|.png|.html`: address × time pictures of PyTorch's
//! replayed allocator and of stweaver's offline plan, side by side (the drawing is
//! `stweaver_planner::viz`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use stweaver_planner::classify::classify;
use stweaver_planner::offline::plan_whole_trace;
use stweaver_planner::replay::{AllocatorConfig, ReplayOptions, replay};
use stweaver_planner::solver::SolveOptions;
use stweaver_planner::viz::{
    BlockClass, VizOptions, native_panel, plan_panel, render_html, render_png, render_svg,
};

use crate::compare::load_input;

#[derive(clap::Args, Debug)]
pub struct VizArgs {
    /// A PyTorch memory snapshot or a stweaver trace file. Default: the bundled GPT-2 XL
    /// snapshot.
    pub input: Option<PathBuf>,
    /// Output file; the format follows the extension: `.svg`, `.png` or `.html`.
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// PyTorch allocator settings of the PyTorch panel (default: the recorded ones).
    #[arg(long, value_name = "STR")]
    pub conf: Option<String>,
    /// Device whose trace to draw (default: the first with allocations).
    #[arg(long, value_name = "N")]
    pub device: Option<i32>,
    /// Seconds the offline solver may spend on the plan panel.
    #[arg(long, value_name = "SECS", default_value_t = 2.0)]
    pub plan_budget: f64,
    /// Draw only the PyTorch panel.
    #[arg(long)]
    pub no_plan: bool,
    /// Picture width in pixels.
    #[arg(long, default_value_t = 1600)]
    pub width: u32,
    /// Height of each plot in pixels.
    #[arg(long, default_value_t = 560)]
    pub plot_height: u32,
    /// PNG pixels per picture pixel.
    #[arg(long, default_value_t = 1.0)]
    pub scale: f32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Svg,
    Png,
    Html,
}

pub fn run(args: VizArgs) -> Result<()> {
    let ext = args
        .output
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let format = match ext.as_deref() {
        Some("svg") => Format::Svg,
        Some("png") => Format::Png,
        Some("html" | "htm") => Format::Html,
        _ => bail!(
            "{}: unknown picture format (use a .svg, .png or .html file name)",
            args.output.display()
        ),
    };
    if !(args.scale > 0.0 && args.scale <= 8.0) {
        bail!("--scale must be in (0, 8], got {}", args.scale);
    }
    if !(args.plan_budget.is_finite() && args.plan_budget > 0.0) {
        bail!("--plan-budget must be a positive number of seconds");
    }
    let loaded = load_input(args.input.as_deref(), args.device)?;
    let cfg = match &args.conf {
        Some(s) => AllocatorConfig::parse(s).context("--conf")?,
        None => loaded.recorded.clone(),
    };
    let t0 = Instant::now();
    let opts = ReplayOptions {
        record_layout: true,
        ..ReplayOptions::default()
    };
    let r = replay(&loaded.trace, &cfg, &opts)
        .with_context(|| format!("{}: replaying PyTorch ({})", loaded.source, cfg.label()))?;
    let Some(layout) = r.layout.as_ref() else {
        bail!("the replay returned no layout");
    };
    let replay_seconds = t0.elapsed().as_secs_f64();
    let t_class = Instant::now();
    let classification = classify(&loaded.trace);
    let classes = BlockClass::of_all(&classification);
    let classify_seconds = t_class.elapsed().as_secs_f64();
    let mut panels = vec![native_panel(
        &format!("PyTorch 2.11 caching allocator (replay, {})", cfg.label()),
        layout,
        &r.stats,
        &classes,
    )];
    let lb = loaded.trace.lower_bound().bytes;
    let mut lines = vec![
        format!(
            "{} ({}): {} allocations, {} events",
            loaded.source,
            loaded.trace.device,
            loaded.trace.allocations.len(),
            loaded.trace.events.len()
        ),
        format!("lower bound (peak live bytes): {lb}"),
        format!(
            "PyTorch ({}): peak reserved {}, peak allocated {}",
            cfg.label(),
            r.stats.peak_reserved,
            r.stats.peak_allocated
        ),
    ];
    let n = &classification.counts;
    lines.push(format!(
        "classes: {} persistent, {} prologue/recurring, {} per-iteration, {} dynamic",
        n.persistent, n.prologue, n.per_iteration, n.dynamic
    ));
    let t1 = Instant::now();
    if !args.no_plan {
        let solve = SolveOptions {
            threads: 0,
            time_budget: Some(Duration::from_secs_f64(args.plan_budget)),
            ..SolveOptions::default()
        };
        let plan = plan_whole_trace(&loaded.trace, &solve)
            .with_context(|| format!("{}: planning", loaded.source))?;
        panels.push(plan_panel(
            "stweaver (offline plan of the whole trace)",
            &loaded.trace,
            &plan.offsets,
            plan.reserved,
            &classes,
        ));
        lines.push(format!(
            "stweaver (offline plan): pool {} (peak {} rounded to 2 MiB)",
            plan.reserved, plan.peak
        ));
    }
    let plan_seconds = t1.elapsed().as_secs_f64();
    let title = format!(
        "{}: where the bytes go (address x time)",
        loaded
            .source
            .rsplit('/')
            .next()
            .unwrap_or(loaded.source.as_str())
    );
    let t2 = Instant::now();
    let vopts = VizOptions {
        width: args.width,
        plot_height: args.plot_height,
    };
    let svg = render_svg(&panels, &title, lb, &vopts);
    let bytes = match format {
        Format::Svg => svg.into_bytes(),
        Format::Html => render_html(&svg, &title, &lines).into_bytes(),
        Format::Png => render_png(&svg, args.scale)?,
    };
    std::fs::write(&args.output, &bytes)
        .with_context(|| format!("{}: cannot write", args.output.display()))?;
    eprintln!(
        "wrote {} ({} bytes): load {:.3} s, replay {:.3} s, classify {:.3} s, plan {:.3} s, draw {:.3} s",
        args.output.display(),
        bytes.len(),
        loaded.load_seconds,
        replay_seconds,
        classify_seconds,
        plan_seconds,
        t2.elapsed().as_secs_f64()
    );
    Ok(())
}
