//! `stweaver`: inspect, convert, plan, verify, compare, replay and draw allocation traces.

use clap::{Parser, Subcommand};

mod compare;
mod convert;
mod inspect;
mod offload_args;
mod plan;
mod replay;
mod verify;
mod viz;

#[derive(Parser)]
#[command(
    name = "stweaver",
    version,
    about = "Plan GPU memory for PyTorch training from recorded traces"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// What a snapshot or trace holds: events, allocations, sizes, streams, the lower
    /// bound and when it is reached, the iteration period.
    Inspect(inspect::InspectArgs),
    /// Write one device's trace of a snapshot (or trace) as a stweaver trace file (.stwt).
    Convert(convert::ConvertArgs),
    /// Plan a snapshot or trace file into a plan file (or solve a CSV instance) and
    /// report the pool vs the lower bound.
    Plan(plan::PlanArgs),
    /// Lower bound, PyTorch native, expandable segments and stweaver, side by side
    /// (default input: a bundled real GPT-2 XL snapshot).
    Compare(compare::CompareArgs),
    /// Address x time pictures (.svg, .png, .html) of PyTorch's replayed allocator and
    /// of stweaver's plan, side by side.
    Viz(viz::VizArgs),
    /// Check a plan file (and, with --trace, that it matches and covers a trace), or a
    /// CSV solution (`id,lower,upper,size,offset`) with the independent checker.
    Verify(verify::VerifyArgs),
    /// Serve a plan file over a trace's requests in the engine (the trace of the run
    /// that served the plan, say) and name the requests it did not serve as planned.
    Replay(replay::ReplayArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {
        Command::Inspect(args) => inspect::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Compare(args) => compare::run(args),
        Command::Viz(args) => viz::run(args),
        Command::Verify(args) => verify::run(args),
        Command::Replay(args) => replay::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stweaver: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
