//! `stweaver`: inspect, convert, plan, verify, compare and draw allocation traces.

use clap::{Parser, Subcommand};

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
enum Command {}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {};
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stweaver: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
