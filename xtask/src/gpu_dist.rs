//! `gpu-test --gpus N` and `gpu-bench --gpus N` (N > 1): the distributed tests and benchmark
//! (torchrun, DDP and FSDP2) as one device call on an N-GPU machine.
//!
//! Both prepare `.dist-carry/` here (the stripped `stweaver-torch` staticlib, the cxx headers
//! with symlinks resolved and the release `stweaver` CLI, which plans each rank's trace there)
//! and print the device command and its carry. The GPU machine has no Rust: the scripts build
//! the extension with `python -m stweaver build` and launch `torchrun` jobs:
//! `scripts/gpu_dist_test.sh` (`python/tests/gpu_dist/run_dist_tests.py`) and
//! `scripts/gpu_dist_bench.sh` (`python/bench/gpu_dist_bench.py`).

use anyhow::{Result, bail};

use crate::gpu_bench::prepare_cli_carry;

const CARRY: &str = ".dist-carry";

/// `--gpus N` among `args` (None when absent).
pub fn gpus_arg(args: &[String]) -> Result<Option<u32>> {
    let Some(i) = args.iter().position(|a| a == "--gpus") else {
        return Ok(None);
    };
    match args.get(i + 1).and_then(|v| v.parse::<u32>().ok()) {
        Some(n) if n >= 1 => Ok(Some(n)),
        _ => bail!("--gpus takes a GPU count (e.g. --gpus 2)"),
    }
}

fn prepare() -> Result<()> {
    prepare_cli_carry(CARRY, "")
}

/// Prepares the carry and prints the device command of `script` on `gpus` GPUs.
fn device_call(script: &str, gpus: u32, timeout_s: u32) -> Result<()> {
    prepare()?;
    let kind = match gpus {
        2 => "nvidia-h200-x2",
        4 => "nvidia-h200-x4",
        8 => "nvidia-h200-x8",
        _ => "a machine with that many GPUs",
    };
    println!(
        "device command: set -o pipefail; bash scripts/{script} {CARRY} {gpus} 2>&1 | tee $OUT/log"
    );
    crate::torch_ext::pack_carry(CARRY)?;
    println!(
        "carry: [\"{CARRY}.tar.xz\"]   kind: {kind}   timeout_s: {timeout_s}   (the script unpacks it)"
    );
    Ok(())
}

pub fn gpu_test(gpus: u32) -> Result<()> {
    device_call("gpu_dist_test.sh", gpus, 300)
}

pub fn gpu_bench(gpus: u32) -> Result<()> {
    device_call("gpu_dist_bench.sh", gpus, 420)
}
