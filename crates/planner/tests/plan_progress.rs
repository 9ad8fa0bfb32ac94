//! `stweaver plan`'s time budget, progress lines and Ctrl-C, end to end on a real
//! instance (`data/planner-bench/real/pangu_2.6B.csv`, 18 692 buffers: its exhaustive
//! search runs for minutes, so only the budget or Ctrl-C ends these runs early). The only
//! timing bounds are generous ones that a run ignoring its budget or Ctrl-C would miss.

mod cli;

use cli::text;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use stweaver_core::Bytes;
use stweaver_planner::solver::{Solution, check_solution, csv, lower_bound};

fn instance() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/planner-bench/real/pangu_2.6B.csv")
}

fn stweaver(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_stweaver"));
    c.args(args);
    c
}

/// The written solution is a complete, non-aliasing packing of the instance; its peak.
fn check_written(solution: &Path) -> u64 {
    let inst = csv::read_instance(&instance()).expect("instance");
    let sol = csv::read_solution(solution).expect("solution written");
    assert_eq!(sol.csv.ids, inst.ids, "every buffer, in order");
    let peak = sol
        .offsets
        .iter()
        .zip(&inst.instance.buffers)
        .map(|(o, b)| o.0 + b.size.get())
        .max()
        .unwrap_or(0);
    let s = Solution {
        offsets: sol.offsets.clone(),
        peak: Bytes(peak),
    };
    check_solution(&inst.instance, &s).expect("a valid packing");
    assert!(peak >= lower_bound(&inst.instance).get());
    peak
}

fn progress_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("stweaver plan: ") && l.contains("lower bound"))
        .collect()
}

#[test]
fn a_time_budget_ends_the_search_and_progress_goes_to_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sol.csv");
    let t0 = Instant::now();
    let o = stweaver(&["plan"])
        .arg(instance())
        .args(["--time-budget", "1", "--csv-out"])
        .arg(&out)
        .output()
        .unwrap();
    let took = t0.elapsed();
    assert!(o.status.success(), "{}", text(&o));
    // The first greedy strategy always completes (seconds in a debug build); the rest
    // stops at the budget. Exhaustive search takes minutes.
    assert!(took < Duration::from_secs(120), "took {took:?}");
    let stderr = String::from_utf8_lossy(&o.stderr);
    let lines = progress_lines(&stderr);
    if took > Duration::from_millis(1500) {
        assert!(!lines.is_empty(), "no progress line in {stderr}");
    }
    // At most about one line per second.
    assert!(
        lines.len() as f64 <= took.as_secs_f64() + 1.0,
        "{} lines in {took:?}",
        lines.len()
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("peak/LB"), "{stdout}");
    assert!(!stdout.contains("interrupted"), "{stdout}");
    check_written(&out);

    // --quiet: the same run, no progress lines.
    let o = stweaver(&["plan", "-q"])
        .arg(instance())
        .args(["--time-budget", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        progress_lines(&String::from_utf8_lossy(&o.stderr)).is_empty(),
        "{}",
        text(&o)
    );
}

#[test]
fn a_bad_time_budget_is_refused() {
    for bad in ["-1", "NaN", "inf"] {
        let o = stweaver(&["plan"])
            .arg(instance())
            .arg(format!("--time-budget={bad}"))
            .output()
            .unwrap();
        assert!(!o.status.success(), "{bad}: {}", text(&o));
        assert!(text(&o).contains("--time-budget"), "{bad}: {}", text(&o));
    }
}

#[cfg(unix)]
#[test]
fn ctrl_c_keeps_the_best_plan_found_so_far() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sol.csv");
    // No time limit: only Ctrl-C ends this search early.
    let mut child = stweaver(&["plan"])
        .arg(instance())
        .args(["--time-budget", "0", "--csv-out"])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    // Wait for a progress line with a plan in it.
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let has_plan = line.contains("best pool");
                seen.push(line);
                if has_plan {
                    break;
                }
            }
            Err(_) => {
                let _ = child.kill();
                panic!("no progress line with a plan: {seen:?}");
            }
        }
    }
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let interrupted_at = Instant::now();
    let exit = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if interrupted_at.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("still searching 60 s after Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let o = child.wait_with_output().unwrap();
    reader.join().unwrap();
    let rest: Vec<String> = rx.try_iter().collect();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(exit.success(), "{exit:?}: {stdout} {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("interrupted")),
        "no notice on stderr: {rest:?}"
    );
    assert!(stdout.contains("interrupted"), "{stdout}");
    check_written(&out);
}
