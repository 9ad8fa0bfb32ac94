//! `stweaver plan INPUT`: solve the packing problem of an input and report it.
//!
//! The input kind is detected first ([`InputKind::detect`]), then each kind has its
//! own path: minimalloc CSV instances (`id,lower,upper,size`), and recorded traces
//! (PyTorch snapshots, `.stwt` trace files), which are classified and planned into a
//! plan file ([`trace`]). A new kind adds a variant, a detection rule and a function.

mod trace;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use stweaver_planner::solver::{self, Progress, SolveOptions, csv};

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The input: a PyTorch memory snapshot (`.pickle[.gz]`), a stweaver trace file
    /// (`.stwt`), or a minimalloc CSV instance (`id,lower,upper,size`, upper exclusive).
    pub input: PathBuf,
    /// Write the plan file here (snapshot and trace inputs).
    #[arg(short, long, value_name = "PLAN")]
    pub output: Option<PathBuf>,
    /// The device to plan when the snapshot has several.
    #[arg(long, value_name = "N")]
    pub device: Option<i32>,
    /// Write the solution as CSV (`id,lower,upper,size,offset`, minimalloc's format).
    #[arg(long, value_name = "FILE")]
    pub csv_out: Option<PathBuf>,
    /// Seed of the randomised orderings and restarts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Stop searching after this many seconds and keep the best plan found
    /// (0 = no time limit: the search stops on its own effort limits, deterministic).
    /// Ctrl-C also stops the search early and keeps the best plan found so far.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_TIME_BUDGET_S)]
    pub time_budget: f64,
    /// Treat the input as one iteration of a loop with this period: lifetimes are taken
    /// modulo it and may cross the boundary.
    #[arg(long, value_name = "L")]
    pub period: Option<u64>,
    /// Greedy portfolio only (no exact / neighbourhood improvement).
    #[arg(long)]
    pub no_improve: bool,
    /// One joint solve over every stream: requests of different streams may share
    /// ranges (smallest pool). At run time a stream reusing another's range waits for
    /// that stream's work on the device (a plan served with stream waits, the default).
    /// Default: each stream solved apart, pools stacked.
    #[arg(long)]
    pub share_streams: bool,
    /// Device memory budget for the pool (snapshot and trace inputs): `16GiB`,
    /// `512MiB`, `1.5GB` or bytes. Above it, saved activations are scheduled to go to
    /// pinned host memory between forward and backward (needs a trace recorded by
    /// stweaver's trace mode, which records autograd's saved tensors). A fraction of
    /// device memory is a runtime notion and is refused here.
    #[arg(long, value_name = "SIZE")]
    pub budget: Option<String>,
    /// Plan per iteration class (a loop of a few sequence lengths, which has no single
    /// repeating iteration): each class of the trace's iterations planned on its own, all
    /// in one pool, with the persistent tensors once (`class_planning`). Not with
    /// `--budget`.
    #[arg(long)]
    pub classes: bool,
    /// How saved activations are scheduled to host memory under `--budget`.
    #[command(flatten)]
    pub offload: crate::offload_args::OffloadArgs,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// No progress lines on stderr.
    #[arg(short, long)]
    pub quiet: bool,
}

/// `--time-budget`'s default, in seconds.
pub const DEFAULT_TIME_BUDGET_S: f64 = 10.0;

/// What an input file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    /// A minimalloc-style CSV instance.
    Csv,
    /// A PyTorch memory snapshot or a stweaver trace file.
    Trace,
}

impl InputKind {
    /// By extension, else by the first line of the file.
    pub fn detect(path: &Path) -> Result<InputKind> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        if ext.as_deref() == Some("csv") {
            return Ok(InputKind::Csv);
        }
        let mut head = [0u8; 256];
        let n = {
            use std::io::Read;
            let mut f = std::fs::File::open(path)
                .with_context(|| format!("{}: cannot open", path.display()))?;
            f.read(&mut head)
                .with_context(|| format!("{}: cannot read", path.display()))?
        };
        if stweaver_planner::input::sniff(&head[..n]).is_some() {
            return Ok(InputKind::Trace);
        }
        let first = String::from_utf8_lossy(&head[..n]);
        let first = first.lines().next().unwrap_or("").to_ascii_lowercase();
        if first.contains(',') && first.contains("size") {
            return Ok(InputKind::Csv);
        }
        bail!(
            "{}: unrecognised input (expected a PyTorch snapshot, a stweaver trace file, or a CSV instance with an `id,lower,upper,size` header)",
            path.display()
        )
    }
}

pub fn run(args: PlanArgs) -> Result<()> {
    match InputKind::detect(&args.input)? {
        InputKind::Csv => plan_csv(&args),
        InputKind::Trace => trace::run(&args),
    }
}

/// The options every input kind shares. The cancellation flag is set by Ctrl-C (see
/// [`Spinner::start`]).
fn solve_options(args: &PlanArgs) -> Result<SolveOptions> {
    let time_budget = match args.time_budget {
        0.0 => None,
        s if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
        s => bail!("--time-budget must be a positive number of seconds (0: no limit), not {s}"),
    };
    Ok(SolveOptions {
        seed: args.seed,
        threads: args.threads,
        time_budget,
        improve: !args.no_improve,
        progress: None,
        cancel: Some(Arc::new(AtomicBool::new(false))),
    })
}

/// Whether Ctrl-C stopped the search (the plan is the best found until then).
fn interrupted(opts: &SolveOptions) -> bool {
    opts.cancel
        .as_ref()
        .is_some_and(|c| c.load(Ordering::Relaxed))
}

fn plan_csv(args: &PlanArgs) -> Result<()> {
    if args.output.is_some() || args.device.is_some() || args.budget.is_some() {
        bail!(
            "{}: -o, --device and --budget are for snapshots and trace files; write a CSV solution with --csv-out",
            args.input.display()
        );
    }
    let mut csv = csv::read_instance(&args.input)?;
    csv.instance.period = args.period;
    let inst = &csv.instance;
    if let Err(e) = inst.validate() {
        bail!("{}: {}", args.input.display(), located(&e, &csv.lines));
    }
    let lb = solver::lower_bound(inst);
    let mut opts = solve_options(args)?;
    let started = Instant::now();
    let spinner = Spinner::start(&mut opts, !args.quiet);
    let result = solver::solve(inst, &opts);
    spinner.stop();
    let elapsed = started.elapsed();
    let stopped_early = interrupted(&opts);
    let solution = result.with_context(|| format!("{}: planning failed", args.input.display()))?;
    if let Some(out) = &args.csv_out {
        csv::write_solution_file(out, &csv.ids, inst, &solution)?;
    }
    let ratio = solution.peak.ratio(lb);
    if args.json {
        let v = serde_json::json!({
            "input": args.input.display().to_string(),
            "buffers": inst.len(),
            "lower_bound": lb.get(),
            "peak": solution.peak.get(),
            "peak_over_lb": ratio,
            "seconds": elapsed.as_secs_f64(),
            "interrupted": stopped_early,
        });
        println!("{v}");
    } else {
        println!("plan {}", args.input.display());
        println!("  buffers      {}", inst.len());
        println!("  lower bound  {} ({})", lb.get(), lb);
        println!("  peak         {} ({})", solution.peak.get(), solution.peak);
        println!("  peak/LB      {ratio:.5}");
        println!(
            "  time         {:.3} s{}",
            elapsed.as_secs_f64(),
            if stopped_early {
                " (interrupted: the best plan found until Ctrl-C)"
            } else {
                ""
            }
        );
        if let Some(out) = &args.csv_out {
            println!("  written      {}", out.display());
        }
    }
    Ok(())
}

/// An instance error with the CSV line of the buffer it names.
fn located(e: &solver::InstanceError, lines: &[usize]) -> String {
    use solver::InstanceError as E;
    let index = match e {
        E::EmptyLifetime { index, .. }
        | E::BadAlign { index, .. }
        | E::LongerThanPeriod { index, .. } => Some(*index),
        _ => None,
    };
    match index.and_then(|i| lines.get(i)) {
        Some(line) => format!("line {line}: {e}"),
        None => e.to_string(),
    }
}

/// Progress on stderr for runs longer than a second, and Ctrl-C handling.
///
/// On a terminal an in-place spinner; otherwise (logs, pipes) one line per second:
/// elapsed time, stage, best pool so far and its ratio to the lower bound. The first
/// Ctrl-C sets [`SolveOptions::cancel`]: the solver stops at its next poll and the best
/// plan found so far is written as usual; a second Ctrl-C exits at once (status 130).
pub(crate) struct Spinner {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// One progress line's text.
fn progress_text(p: Option<&Progress>, elapsed: Duration) -> String {
    match p {
        Some(p) => match p.best_peak {
            Some(best) => format!(
                "{:.0} s, {}: best pool {} = {:.5} x lower bound {}",
                elapsed.as_secs_f64(),
                p.stage,
                best,
                best.ratio(p.lower_bound),
                p.lower_bound
            ),
            None => format!(
                "{:.0} s, {}: no plan yet, lower bound {}",
                elapsed.as_secs_f64(),
                p.stage,
                p.lower_bound
            ),
        },
        None => format!("{:.0} s, preparing", elapsed.as_secs_f64()),
    }
}

/// Installs the Ctrl-C handler once per process; it sets the current solve's flag.
fn watch_ctrl_c(cancel: Arc<AtomicBool>) {
    static CURRENT: Mutex<Option<Arc<AtomicBool>>> = Mutex::new(None);
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    if let Ok(mut c) = CURRENT.lock() {
        *c = Some(cancel);
    }
    INSTALLED.call_once(|| {
        let result = ctrlc::set_handler(|| {
            let flag = CURRENT.lock().ok().and_then(|c| c.clone());
            match flag {
                Some(f) if !f.swap(true, Ordering::SeqCst) => eprintln!(
                    "\nstweaver plan: interrupted; keeping the best plan found so far (Ctrl-C again to abort)"
                ),
                _ => std::process::exit(130),
            }
        });
        if let Err(e) = result {
            eprintln!("stweaver plan: Ctrl-C will abort rather than keep the best plan ({e})");
        }
    });
}

impl Spinner {
    pub(crate) fn start(opts: &mut SolveOptions, enabled: bool) -> Spinner {
        let done = Arc::new(AtomicBool::new(false));
        if let Some(cancel) = &opts.cancel {
            watch_ctrl_c(cancel.clone());
        }
        if !enabled {
            return Spinner { done, thread: None };
        }
        let latest: Arc<Mutex<Option<Progress>>> = Arc::new(Mutex::new(None));
        let sink = latest.clone();
        opts.progress = Some(Arc::new(move |p: &Progress| {
            if let Ok(mut l) = sink.lock() {
                *l = Some(p.clone());
            }
        }));
        let flag = done.clone();
        let terminal = std::io::stderr().is_terminal();
        let thread = std::thread::spawn(move || {
            let begun = Instant::now();
            let current = || latest.lock().ok().and_then(|l| l.clone());
            // Nothing for runs shorter than a second.
            let mut next_line = Duration::from_secs(1);
            while begun.elapsed() < next_line {
                if flag.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if !terminal {
                while !flag.load(Ordering::Relaxed) {
                    if begun.elapsed() >= next_line {
                        let text = progress_text(current().as_ref(), begun.elapsed());
                        eprintln!("stweaver plan: {text}");
                        next_line += Duration::from_secs(1);
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                return;
            }
            let bar = indicatif::ProgressBar::new_spinner();
            bar.enable_steady_tick(Duration::from_millis(120));
            while !flag.load(Ordering::Relaxed) {
                bar.set_message(progress_text(current().as_ref(), begun.elapsed()));
                std::thread::sleep(Duration::from_millis(100));
            }
            bar.finish_and_clear();
        });
        Spinner {
            done,
            thread: Some(thread),
        }
    }

    pub(crate) fn stop(mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
