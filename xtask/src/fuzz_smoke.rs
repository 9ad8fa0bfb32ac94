//! `cargo xtask fuzz-smoke [--inputs N] [--seed S]`: every fuzz target of `fuzz/` built on
//! the stable toolchain and run once over N pseudo-random inputs each.
//!
//! cargo-fuzz needs a nightly toolchain (coverage instrumentation and sanitizers); the
//! project's machines have stable only. Built with plain `cargo build --release`, a target
//! links libFuzzer all the same and, given files, runs each once ("executed the target code
//! on a fixed set of inputs"): a smoke, not fuzzing — no input is mutated towards new
//! coverage. The inputs are the committed seeds (`fuzz/seeds/<target>/`) and random byte strings of 64 B to 8 KiB from a seeded generator, so
//! a failing input is the same on every machine; they stay in
//! `target/fuzz-smoke/<target>/` to reproduce with
//! `target/fuzz-smoke/build/release/<target> FILE`. For `engine_ops` a few KiB decode into
//! programs of a few hundred engine operations, every check of the target after each one.
//! Cost: the fuzz crate's release build (about a minute the first time) and a few seconds
//! per target.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The fuzz targets (`fuzz/Cargo.toml`'s `[[bin]]`s).
const TARGETS: [&str; 3] = ["engine_ops", "trace_file", "plan_file"];

/// A seeded byte source for the inputs ([`stweaver_core::splitmix`], the project's
/// generator, rather than a random-number crate: the inputs need only be fixed by the
/// seed).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        stweaver_core::splitmix::next(&mut self.0)
    }
}

fn parse(args: &[String]) -> Result<(usize, u64)> {
    let (mut inputs, mut seed) = (400usize, 0x5757_ea11u64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let val = it.next().with_context(|| format!("{a} needs a value"))?;
        match a.as_str() {
            "--inputs" => inputs = val.parse().with_context(|| format!("--inputs {val}"))?,
            "--seed" => seed = val.parse().with_context(|| format!("--seed {val}"))?,
            _ => bail!("fuzz-smoke: unknown option {a} (--inputs N, --seed S)"),
        }
    }
    if inputs == 0 {
        bail!("--inputs must be at least 1");
    }
    Ok((inputs, seed))
}

/// Writes `n` inputs for `target` into `dir` (replacing what was there); their paths.
fn inputs(dir: &Path, target: &str, n: usize, seed: u64) -> Result<Vec<PathBuf>> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| dir.display().to_string())?;
    }
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    let salt = target
        .bytes()
        .fold(seed, |h, b| h.rotate_left(5) ^ u64::from(b));
    let mut rng = SplitMix(salt);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let len = 64 + (rng.next() % (8192 - 64)) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let path = dir.join(format!("input-{i:04}"));
        std::fs::write(&path, bytes).with_context(|| path.display().to_string())?;
        out.push(path);
    }
    Ok(out)
}

pub fn fuzz_smoke(args: &[String]) -> Result<()> {
    let (n, seed) = parse(args)?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the repository root")?
        .to_path_buf();
    let work = root.join("target/fuzz-smoke");
    let build = work.join("build");
    let mut cmd = super::cargo();
    cmd.current_dir(root.join("fuzz"))
        .env("CARGO_TARGET_DIR", &build)
        .args(["build", "--release", "--bins"]);
    super::run(cmd)?;
    let mut summary = Vec::new();
    for target in TARGETS {
        let mut files = inputs(&work.join(target), target, n, seed)?;
        // The committed seeds too (valid files: they reach past the decoders' first checks).
        let seeds = root.join("fuzz/seeds").join(target);
        let mut seeded = 0;
        if seeds.is_dir() {
            for e in std::fs::read_dir(&seeds).with_context(|| seeds.display().to_string())? {
                files.push(e?.path());
                seeded += 1;
            }
        }
        let bin = build.join("release").join(target);
        let t0 = std::time::Instant::now();
        let out = Command::new(&bin)
            .args(&files)
            .output()
            .with_context(|| format!("running {}", bin.display()))?;
        let secs = t0.elapsed().as_secs_f64();
        let log = String::from_utf8_lossy(&out.stderr);
        let executed = log.matches("Executed ").count();
        if !out.status.success() || executed != files.len() {
            let tail: String = log
                .lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            bail!(
                "fuzz-smoke: {target} failed ({}; {executed} of {} inputs ran; inputs in {}):\n{tail}",
                out.status,
                files.len(),
                work.join(target).display()
            );
        }
        summary.push(format!(
            "{target:<11} {n} random + {seeded} seed inputs  {secs:6.2} s  ok"
        ));
    }
    println!("fuzz smoke (seed {seed}, stable build, no coverage):");
    for line in summary {
        println!("  {line}");
    }
    Ok(())
}
