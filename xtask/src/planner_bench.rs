//! `planner-bench`: the offline planner on the external DSA instances and on the bundled
//! real traces, one table.
//!
//! `cargo xtask planner-bench [--time-budget S] [--threads N] [--only NAME] [--json FILE]`
//! builds the `stweaver` CLI in release and runs `stweaver plan INPUT --json` once per
//! input (a fresh process each, so every time includes nothing but that run):
//!
//! - **instances**: `data/planner-bench/minimalloc-challenging/*.csv` and
//!   `data/planner-bench/real/*.csv` (`id,lower,upper,size`): n = buffers, LB = the
//!   load bound, peak = the solver's pool, time = the solve. Each gets `--time-budget`
//!   (default 10 s; the exact stage would otherwise run to its own effort limits).
//! - **traces**: `data/traces/snap_*.pickle.gz` (the real PyTorch snapshots), planned
//!   end to end (classification, steady state on circular time, prologue, verifier,
//!   coverage; see `crates/planner/src/planning.rs`), with no time budget: n =
//!   allocations, LB = the peak of live requested bytes of the whole trace, peak = the
//!   plan's pool, time = the whole `plan_trace` (not the snapshot import). A trace with
//!   dynamic (unplanned) allocations also shows its planned part's LB and ratio, the
//!   figure that counts for it.
//!
//! Prints a Markdown table (for BENCHMARKS.md); `--json FILE` also writes the rows.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::torch_ext::root;

struct Args {
    time_budget: f64,
    threads: usize,
    only: Option<String>,
    json: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Args> {
    let mut a = Args {
        time_budget: 10.0,
        threads: 0,
        only: None,
        json: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .with_context(|| format!("{flag} needs a value"))
                .cloned()
        };
        match flag.as_str() {
            "--time-budget" => {
                a.time_budget = value()?
                    .parse()
                    .context("--time-budget: seconds expected")?
            }
            "--threads" => a.threads = value()?.parse().context("--threads: a count expected")?,
            "--only" => a.only = Some(value()?),
            "--json" => a.json = Some(PathBuf::from(value()?)),
            other => bail!(
                "planner-bench: unknown option {other} (--time-budget S, --threads N, --only NAME, --json FILE)"
            ),
        }
    }
    Ok(a)
}

/// One line of the table.
struct Row {
    suite: &'static str,
    name: String,
    n: u64,
    lb: u64,
    peak: u64,
    seconds: f64,
    /// For traces with dynamic allocations: (planned LB, dynamic allocations).
    planned: Option<(u64, u64)>,
}

impl Row {
    fn ratio(&self) -> f64 {
        self.peak as f64 / self.lb as f64
    }

    fn json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "suite": self.suite,
            "name": self.name,
            "n": self.n,
            "lower_bound": self.lb,
            "peak": self.peak,
            "peak_over_lb": self.ratio(),
            "seconds": self.seconds,
        });
        if let Some((lb, d)) = self.planned {
            v["planned_lower_bound"] = lb.into();
            v["dynamic"] = d.into();
        }
        v
    }
}

pub fn planner_bench(args: &[String]) -> Result<()> {
    let args = parse(args)?;
    let bin = crate::gpu_bench::build_cli()?;
    let data = root().join("data");
    let mut inputs: Vec<(&'static str, PathBuf)> = Vec::new();
    for dir in ["minimalloc-challenging", "real"] {
        for p in sorted(&data.join("planner-bench").join(dir), ".csv")? {
            inputs.push(("instance", p));
        }
    }
    for p in sorted(&data.join("traces"), ".pickle.gz")? {
        inputs.push(("trace", p));
    }
    if let Some(only) = &args.only {
        inputs.retain(|(_, p)| stem(p).contains(only.as_str()));
    }
    if inputs.is_empty() {
        bail!("planner-bench: no inputs under {}", data.display());
    }
    let mut rows = Vec::new();
    for (suite, path) in &inputs {
        eprintln!("planner-bench: {}", path.display());
        let mut cmd = Command::new(&bin);
        cmd.arg("plan")
            .arg(path)
            .args(["--json", "--threads", &args.threads.to_string()]);
        if *suite == "instance" {
            cmd.args(["--time-budget", &args.time_budget.to_string()]);
        }
        let out = cmd
            .output()
            .with_context(|| format!("running {}", bin.display()))?;
        if !out.status.success() {
            bail!(
                "stweaver plan {} failed: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        rows.push(row(suite, path, &text).with_context(|| format!("{}: {text}", path.display()))?);
    }
    println!("{}", table(&rows));
    if let Some(json) = &args.json {
        let body: Vec<serde_json::Value> = rows.iter().map(Row::json).collect();
        let text = serde_json::to_string_pretty(&body).context("encoding the rows")?;
        std::fs::write(json, text + "\n").with_context(|| format!("writing {}", json.display()))?;
        eprintln!("planner-bench: wrote {}", json.display());
    }
    Ok(())
}

fn sorted(dir: &Path, suffix: &str) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    v.sort();
    Ok(v)
}

fn stem(p: &Path) -> String {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.trim_end_matches(".pickle.gz")
        .trim_end_matches(".csv")
        .to_owned()
}

/// The row of one `stweaver plan --json` output.
fn row(suite: &'static str, path: &Path, json: &str) -> Result<Row> {
    let v: serde_json::Value = serde_json::from_str(json).context("not JSON")?;
    let num = |ptr: &str| -> Result<f64> {
        v.pointer(ptr)
            .and_then(serde_json::Value::as_f64)
            .with_context(|| format!("no number at {ptr}"))
    };
    let name = stem(path);
    if suite == "instance" {
        return Ok(Row {
            suite,
            name,
            n: num("/buffers")? as u64,
            lb: num("/lower_bound")? as u64,
            peak: num("/peak")? as u64,
            seconds: num("/seconds")?,
            planned: None,
        });
    }
    let dynamic = num("/classes/dynamic")? as u64;
    let planned_classes =
        num("/classes/persistent")? + num("/classes/prologue")? + num("/classes/per_iteration")?;
    Ok(Row {
        suite,
        name,
        n: planned_classes as u64 + dynamic,
        lb: num("/lower_bound")? as u64,
        peak: num("/pool")? as u64,
        seconds: num("/seconds/plan")?,
        planned: if dynamic > 0 {
            Some((num("/planned_lower_bound")? as u64, dynamic))
        } else {
            None
        },
    })
}

fn table(rows: &[Row]) -> String {
    let mut t = String::from(
        "| suite | input | n | LB | peak | peak/LB | time (s) | note |\n|---|---|---:|---:|---:|---:|---:|---|\n",
    );
    for r in rows {
        let note = match r.planned {
            Some((lb, d)) => format!(
                "{d} dynamic allocations; planned part: LB {lb}, pool/LB {:.5}",
                r.peak as f64 / lb as f64
            ),
            None => String::new(),
        };
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.5} | {:.2} | {note} |\n",
            r.suite,
            r.name,
            r.n,
            r.lb,
            r.peak,
            r.ratio(),
            r.seconds
        ));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_cli_json() {
        let trace = r#"{"classes":{"dynamic":5,"dynamic_by_reason":{"no_counterpart":5},"per_iteration":10,"persistent":2,"prologue":3},"dynamic":{"peak_bytes":77,"requests":5},"lower_bound":1000,"planned_lower_bound":900,"pool":905,"seconds":{"classify":0.1,"plan":1.5}}"#;
        let r = row("trace", Path::new("/x/snap_a.pickle.gz"), trace).unwrap();
        assert_eq!(r.name, "snap_a");
        assert_eq!((r.n, r.lb, r.peak), (20, 1000, 905));
        assert_eq!(r.seconds, 1.5);
        assert_eq!(r.planned, Some((900, 5)));
        let inst = r#"{"buffers":3,"input":"a.csv","lower_bound":12,"peak":13,"peak_over_lb":1.08,"seconds":0.25}"#;
        let r = row("instance", Path::new("/x/A.1048576.csv"), inst).unwrap();
        assert_eq!((r.n, r.lb, r.peak), (3, 12, 13));
        assert!(table(&[r]).contains("| instance | A.1048576 | 3 | 12 | 13 | 1.08333 |"));
    }
}
