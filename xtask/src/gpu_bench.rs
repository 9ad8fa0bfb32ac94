//! `gpu-bench`: the GPU benchmark (`python/bench/gpu_bench.py`) as one device call.
//!
//! - `cargo xtask gpu-bench` — builds the `stweaver-torch` staticlib and the `stweaver` CLI
//!   (the planner of the trace -> plan -> plan-run path) in release, prepares `.bench-carry/`
//!   the way `gpu-test` prepares `.carry/` (stripped staticlib, cxx headers with symlinks
//!   resolved) plus `bin/stweaver`, and prints the device command and its carry. The GPU
//!   machine has no Rust: `scripts/gpu_bench.sh` builds the extension there with
//!   `python -m stweaver build` (as `gpu_test.sh` does) and runs the harness, which writes
//!   `gpu_bench.json`, `table.txt` and the child logs' tails to `$OUT`.
//! - `cargo xtask gpu-bench --dry-run` — the harness on the CPU with tiny models and a fake
//!   stweaver (needs `$PYTHON` with torch and transformers); checks the orchestration, the
//!   five training loops, the cap search and the report, not the allocator.
//! - `cargo xtask gpu-bench --report RESULT.json` — the Markdown table and the targets
//!   (met / missed) for BENCHMARKS.md, and `docs/gpu_bench.png` (needs matplotlib).
//!
//! Issue #18's long loops (`python/bench/long_loops.py`: five 200-iteration loops — 5 and 50
//! sequence lengths, an eval every 10, a checkpoint every 20, MoE — under native, expandable,
//! auto, trace and auto with phase markers):
//!
//! - `cargo xtask gpu-bench --long-loops` — the same carry as `gpu-bench`, and three device
//!   commands, one per call (the groups do not fit one 600 s call): `scripts/long_loops.sh`
//!   builds the extension there and runs `--parallel 2 --loops len5,len50` (len50's native run
//!   grows to 48 GB: two length-loop runs at a time), `--parallel 4 --loops
//!   eval10,ckpt20,moe`, or (issue #18 item 2: the step time inside auto's planning window)
//!   `--parallel 1 --loops eval10 --allocs online,auto,online_aa --iters 60` (one run at a
//!   time, so that the step times are not a neighbour's) inside a budget
//!   (`LONG_LOOPS_BUDGET_S`, 540 s with the build), and leaves `long_loops.json`, `table.txt`
//!   and the trace run's `traces/*.stwt.gz` in `$OUT`.
//! - `cargo xtask gpu-bench --long-loops --dry-run [long_loops.py ARGS...]` — the loops' CPU
//!   path (tiny models, no allocator, 21 iterations, native / expandable / auto; needs
//!   `$PYTHON` with torch and transformers) and the report over its JSON: the plumbing only.
//! - `cargo xtask gpu-bench --long-loops --report JSON...` — the Markdown table for
//!   BENCHMARKS.md with issue #18's targets per loop, met or missed: peak reserved <= 1.01 x
//!   the lower bound, no drift (reserved after the last iteration within 0.5 % of after
//!   iteration 20), auto <= expandable after every iteration. The two calls' files merge; the
//!   lower bound is the trace's peak of live bytes (`traces/` beside the JSON, read with the
//!   release `stweaver` CLI when `target/release/stweaver` exists), else the least peak
//!   allocated of the loop's runs. `data/traces/long/gpu_ground_truth.json` holds the last
//!   measured numbers.
//!
//! Issue #16's budget proof (`python/bench/budget_bench.py`: Llama 1B and GPT-2 XL without
//! recomputation under budgets of 0.9 / 0.8 / 0.7 x the lower bound, against full
//! recomputation, `save_on_cpu`, native and expandable; tokens/s at a fixed cap):
//!
//! - `cargo xtask gpu-bench --budget` — the same carry, and one device command per call
//!   (`BUDGET_CALLS`: each fits one 600 s call; `scripts/budget_bench.sh` builds the extension
//!   there, writes `budget_bench.json` to `$OUT` and prints its table last).
//! - `cargo xtask gpu-bench --budget --dry-run [budget_bench.py ARGS...]` — its CPU path (tiny
//!   models, needs `$PYTHON` with torch and transformers): the plumbing only.

use std::fs;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::torch_ext::{
    build_staticlib, copy_stripped, ensure_excluded, fresh_carry, python, root, target_dir,
};
use crate::{cargo, run};

const CARRY: &str = ".bench-carry";
/// The device call's limit, and the harness's own budget inside it (build included).
const DEVICE_TIMEOUT_S: u32 = 540;

pub(crate) fn build_cli() -> Result<PathBuf> {
    let mut c = cargo();
    c.current_dir(root()).args([
        "build",
        "--release",
        "-p",
        "stweaver-planner",
        "--bin",
        "stweaver",
    ]);
    run(c)?;
    let bin = target_dir().join("release/stweaver");
    if !bin.is_file() {
        bail!("{} was not produced", bin.display());
    }
    Ok(bin)
}

/// Builds the stripped staticlib, the cxx headers (symlinks resolved) and the release
/// `stweaver` CLI into the git-excluded folder `carry` of the repository, for a GPU
/// machine without Rust. Shared by `gpu-bench` and `gpu-test/gpu-bench --gpus N`.
pub(crate) fn prepare_cli_carry(carry_name: &str, what: &str) -> Result<()> {
    let lib = build_staticlib(true)?;
    let cli = build_cli()?;
    let carry = root().join(carry_name);
    let lib_and_headers = fresh_carry(&carry, &lib)?;
    let cli_len = copy_stripped(&cli, &carry.join("bin/stweaver"))?;
    ensure_excluded(&format!("/{carry_name}/"))?;
    let total = lib_and_headers + cli_len;
    eprintln!(
        "{what}{} ready ({:.1} MiB: staticlib, cxx headers, stweaver CLI)",
        carry.display(),
        total as f64 / (1 << 20) as f64
    );
    Ok(())
}

fn prepare() -> Result<()> {
    prepare_cli_carry(CARRY, "gpu-bench: ")?;
    println!(
        "device command: set -o pipefail; bash scripts/gpu_bench.sh {CARRY} 2>&1 | tee $OUT/log"
    );
    crate::torch_ext::pack_carry(CARRY)?;
    println!(
        "carry: [\"{CARRY}.tar.xz\"]   timeout_s: {DEVICE_TIMEOUT_S}   (the script unpacks it)"
    );
    // Lockstep (memory, losses and step time from the same processes; BENCHMARKS.md,
    // session 6) does not fit the five loops in one call: two calls, training on 3 CPUs.
    println!(
        "lockstep, call 1: GPU_BENCH_BUDGET_S=540 bash scripts/gpu_bench.sh {CARRY} --no-cap \\\n  \
         --only llama1b_rcp,gpt2xl_rcp,qwenmoe_eager_rcp --lockstep 30,qwenmoe_eager_rcp=12 --train-cpus 8-10"
    );
    println!(
        "lockstep, call 2: GPU_BENCH_BUDGET_S=540 bash scripts/gpu_bench.sh {CARRY} --no-cap \\\n  \
         --only llama1b_1f1b,llama1b_varlen --lockstep 40,llama1b_1f1b=14 --train-cpus 8-10 \\\n  \
         --trace-iters llama1b_varlen=48"
    );
    Ok(())
}

fn dry_run(args: &[String]) -> Result<()> {
    let out = target_dir().join("gpu-bench-dry");
    let mut c = Command::new(python());
    c.current_dir(root())
        .arg("python/bench/gpu_bench.py")
        .args(["run", "--dry-run", "--budget-s", "3600", "--out"])
        .arg(&out)
        .args(args);
    // The trace of the planner step: any real `.stwt` (the GPU tests write one), else none.
    if !args.iter().any(|a| a == "--dry-trace") {
        let cli = target_dir().join("release/stweaver");
        if cli.is_file() {
            c.arg("--stweaver-bin").arg(cli);
        }
    }
    run(c)?;
    eprintln!(
        "gpu-bench --dry-run: {}",
        out.join("gpu_bench.json").display()
    );
    Ok(())
}

fn report(json: &str) -> Result<()> {
    let json = fs::canonicalize(json).with_context(|| format!("{json}: no such result file"))?;
    let mut c = Command::new(python());
    c.current_dir(root())
        .arg("python/bench/gpu_bench.py")
        .arg("report")
        .arg(&json)
        .args(["--markdown", "--targets"]);
    run(c)?;
    let png = root().join("docs/gpu_bench.png");
    let mut c = Command::new(python());
    c.current_dir(root())
        .arg("python/bench/plot_bench.py")
        .arg(&json)
        .arg("-o")
        .arg(&png);
    run(c)?;
    eprintln!("gpu-bench --report: {}", png.display());
    Ok(())
}

/// The budget proof's device calls: (what, `budget_bench.py` arguments), each meant to fit
/// one 600 s call. On an H100 (BENCHMARKS.md, session 21) the first took 435 s, and the
/// third without native and batch 5 took 256 s; the second's rows ran as one call in
/// session 19 (s19-9). None ran as a set, nor with `--train-cpus` but s21-7.
const BUDGET_CALLS: [(&str, &str); 3] = [
    (
        "0.8 x LB, every comparison row",
        "--workloads gpt2xl_norcp,llama1b_norcp --fractions 0.8 \
             --rows unlimited_aa,stweaver_auto,recompute,save_on_cpu,native,expandable \
             --iters 6 --warmup 2 --timeout-s 200 --train-cpus auto",
    ),
    (
        "auto at 0.9 and 0.7 x LB",
        "--workloads llama1b_norcp,gpt2xl_norcp --fractions 0.9,0.7 --rows stweaver_auto \
             --iters 6 --warmup 2 --timeout-s 200 --train-cpus auto",
    ),
    (
        "tokens/s under a fixed 27.62 GiB cap (0.8 x batch 8's LB), the best batch of each",
        "--workloads llama1b_norcp --batches 5,6,7,8 --cap-gib 27.62 \
             --rows native,expandable,stweaver_auto --iters 6 --warmup 2 --timeout-s 200 --train-cpus auto",
    ),
];

fn budget_prepare() -> Result<()> {
    prepare_cli_carry(CARRY, "gpu-bench --budget: ")?;
    crate::torch_ext::pack_carry(CARRY)?;
    for (k, (what, args)) in BUDGET_CALLS.iter().enumerate() {
        println!(
            "device command (call {} of {}, {what}):\n  set -o pipefail; timeout 590 bash scripts/budget_bench.sh {CARRY} {args} 2>&1 | tee $OUT/log",
            k + 1,
            BUDGET_CALLS.len()
        );
    }
    println!(
        "carry: [\"{CARRY}.tar.xz\"]   timeout_s: 600   (the script unpacks it; each call writes \
         budget_bench.json and budget_bench.txt to $OUT)"
    );
    Ok(())
}

/// A harness's `--dry-run` in a fresh `target/DIR`: the output folder and `$PYTHON SCRIPT
/// --dry-run` run from the repository root (the caller adds the rest, `--out` included).
fn dry_run_command(dir: &str, script: &str) -> Result<(PathBuf, Command)> {
    let out = target_dir().join(dir);
    if out.exists() {
        fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    let mut c = Command::new(python());
    c.current_dir(root()).arg(script).arg("--dry-run");
    Ok((out, c))
}

fn budget_dry_run(args: &[String]) -> Result<()> {
    let (out, mut c) = dry_run_command("budget-dry", "python/bench/budget_bench.py")?;
    c.arg("--out").arg(&out).args(args);
    run(c)?;
    eprintln!(
        "gpu-bench --budget --dry-run: {}",
        out.join("budget_bench.json").display()
    );
    Ok(())
}

fn budget(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        None => budget_prepare(),
        Some("--dry-run") => budget_dry_run(&args[1..]),
        Some(other) => bail!(
            "gpu-bench --budget: unknown argument {other:?} (usage: gpu-bench --budget \
             [--dry-run [budget_bench.py ARGS...]])"
        ),
    }
}

/// The long loops' device calls: (what, `long_loops.py` arguments).
const LONG_LOOP_CALLS: [(&str, &str); 3] = [
    (
        "the length loops, two runs at a time",
        "--parallel 2 --loops len5,len50",
    ),
    (
        "eval, checkpoint and MoE, four at a time",
        "--parallel 4 --loops eval10,ckpt20,moe",
    ),
    (
        "the step time inside auto's planning window against online serving, one run at a time",
        "--parallel 1 --loops eval10 --allocs online,auto,online_aa --iters 60",
    ),
];
/// The long loops' device call limit (the script's budget, 540 s with the build, is inside it).
const LONG_LOOPS_TIMEOUT_S: u32 = 600;

fn long_loops_prepare() -> Result<()> {
    prepare_cli_carry(CARRY, "gpu-bench --long-loops: ")?;
    crate::torch_ext::pack_carry(CARRY)?;
    for (k, (what, args)) in LONG_LOOP_CALLS.iter().enumerate() {
        println!(
            "device command (call {} of {}, {what}): set -o pipefail; bash scripts/long_loops.sh {CARRY} {args} 2>&1 | tee $OUT/log",
            k + 1,
            LONG_LOOP_CALLS.len()
        );
    }
    println!(
        "carry: [\"{CARRY}.tar.xz\"]   timeout_s: {LONG_LOOPS_TIMEOUT_S}   (the script unpacks it; \
         each call writes long_loops.json, table.txt and traces/ to $OUT)"
    );
    println!(
        "then: cargo xtask gpu-bench --long-loops --report CALL1/long_loops.json CALL2/long_loops.json \
         CALL3/long_loops.json"
    );
    Ok(())
}

/// `long_loops.py --report` with the release CLI when there is one (the exact lower bound
/// from the traces; without it, the least peak allocated of each loop's runs).
fn long_loops_report(jsons: &[String]) -> Result<()> {
    if jsons.is_empty() {
        bail!("usage: cargo xtask gpu-bench --long-loops --report long_loops.json [MORE.json...]");
    }
    let mut c = Command::new(python());
    c.current_dir(root())
        .arg("python/bench/long_loops.py")
        .arg("--report");
    for j in jsons {
        c.arg(fs::canonicalize(j).with_context(|| format!("{j}: no such result file"))?);
    }
    let cli = target_dir().join("release/stweaver");
    if cli.is_file() {
        c.arg("--stweaver-bin").arg(cli);
    } else {
        eprintln!(
            "gpu-bench --long-loops --report: no {} (cargo build --release -p stweaver-planner --bin stweaver): \
             the lower bound is each loop's least peak allocated",
            cli.display()
        );
    }
    run(c)
}

fn long_loops_dry_run(args: &[String]) -> Result<()> {
    let (out, mut c) = dry_run_command("long-loops-dry", "python/bench/long_loops.py")?;
    c.args(["--iters", "21", "--parallel", "2"])
        .args(["--allocs", "native,expandable,auto", "--out"])
        .arg(&out)
        .args(args);
    run(c)?;
    let json = out.join("long_loops.json");
    long_loops_report(&[json.to_string_lossy().into_owned()])?;
    eprintln!("gpu-bench --long-loops --dry-run: {}", json.display());
    Ok(())
}

fn long_loops(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        None => long_loops_prepare(),
        Some("--dry-run") => long_loops_dry_run(&args[1..]),
        Some("--report") => long_loops_report(&args[1..]),
        Some(other) => bail!(
            "gpu-bench --long-loops: unknown argument {other:?} (usage: gpu-bench --long-loops \
             [--dry-run [long_loops.py ARGS...] | --report JSON...])"
        ),
    }
}

pub fn gpu_bench(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        None => prepare(),
        Some("--long-loops") => long_loops(&args[1..]),
        Some("--budget") => budget(&args[1..]),
        Some("--dry-run") => dry_run(&args[1..]),
        Some("--report") => match args.get(1) {
            Some(json) => report(json),
            None => bail!("usage: cargo xtask gpu-bench --report RESULT.json"),
        },
        Some(other) => bail!(
            "gpu-bench: unknown argument {other:?} (usage: gpu-bench [--dry-run [HARNESS ARGS...] | --report RESULT.json \
             | --long-loops [--dry-run [ARGS...] | --report JSON...] | --budget [--dry-run [ARGS...]]])"
        ),
    }
}
