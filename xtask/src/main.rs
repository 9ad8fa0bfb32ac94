//! Project automation: `cargo xtask <task>`.
//!
//! - `ci`: exactly what CI runs (fmt check, clippy -D warnings, tests, rustdoc -D warnings,
//!   codegen --check, fuzz-smoke, python tests, cpp-check, wheel-check).
//! - `codegen [--check]`: regenerate the committed generated code (see `codegen.rs`).
//! - `fuzz-smoke [--inputs N] [--seed S]`: every fuzz target built on stable and run over N
//!   seeded random inputs (see `fuzz_smoke.rs`).
//! - `build-torch-ext`, `gpu-test [--run-here]`, `cpp-check [VERSION...]`: the torch
//!   extension (see `torch_ext.rs`).
//! - `wheel-check`: builds the pip wheel against torch 2.11 and installs it into a fresh
//!   virtual environment (see `wheel.rs`).
//! - `gpu-bench [--dry-run | --report RESULT.json]`: the GPU benchmark (see `gpu_bench.rs`).
//! - `gpu-bench --long-loops [--dry-run | --report JSON...]`: issue #18's 200-iteration
//!   loops on the GPU (see `gpu_bench.rs`).
//! - `gpu-bench --budget [--dry-run [ARGS...]]`: issue #16's budget proof on the GPU, one
//!   device command per call (see `gpu_bench.rs`).
//! - `gpu-test --gpus N`, `gpu-bench --gpus N` (N > 1): the distributed (torchrun, DDP and
//!   FSDP2) tests and benchmark (see `gpu_dist.rs`).
//! - `planner-bench [--time-budget S] [--threads N] [--only NAME] [--json FILE]`: the
//!   offline planner on the DSA instances and the bundled traces (see `planner_bench.rs`).

use std::process::Command;

use anyhow::{Context, Result, bail};

mod codegen;
mod fuzz_smoke;
mod gpu_bench;
mod gpu_dist;
mod planner_bench;
mod torch_ext;
mod wheel;

const USAGE: &str = "usage: cargo xtask <ci|codegen [--check]|fuzz-smoke [--inputs N] [--seed S]|build-torch-ext|gpu-test [--run-here|--gpus N]|cpp-check [VERSION...]|wheel-check|gpu-bench [--dry-run [HARNESS ARGS...]|--report JSON|--gpus N|--long-loops [--dry-run|--report JSON...]|--budget [--dry-run [ARGS...]]]|planner-bench [--time-budget S] [--threads N] [--only NAME] [--json FILE]>";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().take(2).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return Ok(());
    }
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("codegen") => codegen::run(&args[1..]),
        Some("fuzz-smoke") => fuzz_smoke::fuzz_smoke(&args[1..]),
        Some("build-torch-ext") => torch_ext::build_torch_ext(),
        Some("gpu-test") => match gpu_dist::gpus_arg(&args[1..])? {
            Some(n) if n > 1 => gpu_dist::gpu_test(n),
            _ => torch_ext::gpu_test(&args[1..]),
        },
        Some("cpp-check") => torch_ext::cpp_check(&args[1..]),
        Some("wheel-check") => wheel::wheel_check(),
        Some("gpu-bench") => match gpu_dist::gpus_arg(&args[1..])? {
            Some(n) if n > 1 => gpu_dist::gpu_bench(n),
            _ => gpu_bench::gpu_bench(&args[1..]),
        },
        Some("planner-bench") => planner_bench::planner_bench(&args[1..]),
        _ => {
            eprintln!("{USAGE}");
            bail!("unknown or missing task")
        }
    }
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn run(mut cmd: Command) -> Result<()> {
    eprintln!("$ {cmd:?}");
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

/// fmt --check, clippy with warnings denied, and the workspace tests.
fn ci() -> Result<()> {
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);
    run(fmt)?;
    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]);
    run(clippy)?;
    let mut test = cargo();
    test.args(["test", "--workspace"]);
    run(test)?;
    // The API docs build without a warning (broken or private links); their examples ran
    // as doctests above.
    let mut doc = cargo();
    doc.args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings");
    run(doc)?;
    codegen::run(&["--check".to_owned()])?;
    // The fuzz targets, on stable: each run over seeded random inputs (no coverage).
    fuzz_smoke::fuzz_smoke(&[])?;
    torch_ext::python_tests()?;
    // The C++ allocator compiles and links against the real torch 2.11 and the newest
    // torch wheels from PyPI (no GPU needed).
    torch_ext::cpp_check(&[])?;
    // `pip wheel --no-build-isolation .` against torch 2.11, installed into a fresh venv:
    // import, extension load, `stweaver --help` from PATH.
    wheel::wheel_check()
}
