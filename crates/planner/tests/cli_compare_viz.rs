//! `stweaver compare` and `stweaver viz`, run as a user runs them.
//!
//! `compare` with no argument uses the snapshot bundled into the binary; its PyTorch
//! rows must be the figures PyTorch reported for that run (`ground_truth.json`,
//! gpt2xl_rcp: native 11 337 203 712 B exactly; expandable 10 263 461 888 B, which the
//! replay also hits exactly). The stweaver row is the engine in auto mode, the runtime's
//! default, within 1 % of the lower bound; `--all-modes` adds the engine online and in
//! plan mode and the offline plan of the whole trace.

mod cli;

use cli::stweaver;
use std::path::PathBuf;
use std::process::Output;

fn data(rel: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/")).join(rel)
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "stweaver failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).expect("utf-8")
}

#[test]
fn compare_without_input_uses_the_bundled_snapshot() {
    let out = stdout(&stweaver(&["compare"]));
    assert!(out.contains("bundled snap_gpt2xl_rcp.pickle.gz"), "{out}");
    for row in [
        "lower bound (peak live bytes)",
        "PyTorch native",
        "PyTorch expandable segments",
        "stweaver (auto)",
    ] {
        assert!(out.contains(row), "missing row {row}:\n{out}");
    }
    // The outcome line: the snapshot's 4 iterations end before auto mode plans (after
    // 4 recorded iterations, at the 5th boundary).
    assert!(
        out.contains("stweaver (auto): stayed online: the trace ends after 4 iteration boundaries"),
        "{out}"
    );
    for other in ["stweaver (online)", "stweaver (plan mode)", "offline plan"] {
        assert!(!out.contains(other), "{other} is behind --modes:\n{out}");
    }
    assert!(out.contains("10.56 GiB"), "{out}");
    // Fewer recorded iterations: auto mode plans at the 3rd boundary, switches at the 4th.
    let out = stdout(&stweaver(&["compare", "--auto-iterations", "2"]));
    assert!(
        out.contains("stweaver (auto): switched to the plan at iteration 4"),
        "{out}"
    );
    let o = stweaver(&["compare", "--auto-iterations", "0"]);
    assert!(!o.status.success());
    let o = stweaver(&["compare", "--modes", "auto,nope"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("nope"));
}

#[test]
fn compare_json_has_the_ground_truth_figures() {
    let out = stdout(&stweaver(&[
        "compare",
        "--json",
        "--all-modes",
        "--plan-budget",
        "1",
    ]));
    let j: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let row = |kind: &str| {
        j["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} row"))
            .clone()
    };
    let lb = j["lower_bound"].as_u64().unwrap();
    assert_eq!(lb, 9_445_508_616);
    assert_eq!(row("pytorch_native")["peak_reserved"], 11_337_203_712u64);
    assert_eq!(row("pytorch_native")["peak_allocated"], 9_515_349_504u64);
    assert_eq!(
        row("pytorch_expandable")["peak_reserved"],
        10_263_461_888u64
    );
    let st = row("stweaver_offline_plan");
    let reserved = st["peak_reserved"].as_u64().unwrap();
    assert!(reserved >= lb && reserved < 11_337_203_712, "{st}");
    assert_eq!(reserved % (2 << 20), 0, "rounded to the 2 MiB granule");
    assert_eq!(
        st["saved_vs_native"].as_i64().unwrap(),
        11_337_203_712 - reserved as i64
    );
    // The engine rows: auto mode (the default; the trace ends before it plans, so it is
    // the online row), online, and plan mode (a plan of the first iterations).
    let auto = row("stweaver_auto");
    let reserved = auto["peak_reserved"].as_u64().unwrap();
    assert!(
        reserved >= lb && (reserved as f64) <= 1.01 * lb as f64,
        "{auto}"
    );
    assert_eq!(row("stweaver_online")["peak_reserved"], reserved);
    assert!(
        auto["outcome"]
            .as_str()
            .unwrap()
            .starts_with("stayed online"),
        "{auto}"
    );
    let plan = row("stweaver_plan_mode");
    let reserved = plan["peak_reserved"].as_u64().unwrap();
    assert!(
        reserved >= lb && (reserved as f64) <= 1.001 * lb as f64,
        "{plan}"
    );
    assert!(
        plan["outcome"]
            .as_str()
            .unwrap()
            .starts_with("served a plan of the first 3 iteration(s)"),
        "{plan}"
    );
    assert_eq!(row("lower_bound")["outcome"], serde_json::Value::Null);
    // The default: one stweaver row, auto.
    let rows = |args: &[&str]| -> Vec<String> {
        let out = stdout(&stweaver(&[&["compare", "--json"], args].concat()));
        let j: serde_json::Value = serde_json::from_str(&out).unwrap();
        j["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["kind"].as_str().unwrap().to_owned())
            .collect()
    };
    let base = ["lower_bound", "pytorch_native", "pytorch_expandable"];
    assert_eq!(rows(&[]), [&base[..], &["stweaver_auto"]].concat());
    assert_eq!(
        rows(&["--modes", "online,auto"]),
        [&base[..], &["stweaver_auto", "stweaver_online"]].concat()
    );
    // --no-plan and --no-engine leave the offline and the engine rows out.
    assert_eq!(
        rows(&["--all-modes", "--no-plan"]),
        [
            &base[..],
            &["stweaver_auto", "stweaver_online", "stweaver_plan_mode"]
        ]
        .concat()
    );
    assert_eq!(rows(&["--no-engine"]), base);
}

#[test]
fn compare_takes_a_file_and_a_config() {
    let snap = data("traces/snap_llama1b_rcp.pickle.gz");
    let out = stdout(&stweaver(&[
        "compare",
        snap.to_str().unwrap(),
        "--json",
        "--no-plan",
        "--no-engine",
        "--conf",
        "max_split_size_mb:64",
    ]));
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        j["rows"][1]["detail"]
            .as_str()
            .unwrap()
            .contains("max_split_size_mb:64")
    );
    let o = stweaver(&[
        "compare",
        "--conf",
        "max_split_size_mb:5",
        "--no-plan",
        "--no-engine",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--conf") && err.contains("max_split_size_mb"),
        "{err}"
    );
    let o = stweaver(&["compare", "/nonexistent/snap.pickle"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/snap.pickle"));
}

#[test]
fn viz_writes_svg_html_and_png() {
    let dir = tempfile::tempdir().unwrap();
    for ext in ["svg", "html", "png"] {
        let path = dir.path().join(format!("gpt2.{ext}"));
        let o = stweaver(&[
            "viz",
            "-o",
            path.to_str().unwrap(),
            "--plan-budget",
            "1",
            "--width",
            "900",
            "--plot-height",
            "300",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let bytes = std::fs::read(&path).unwrap();
        if ext == "png" {
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        } else {
            let text = String::from_utf8(bytes).unwrap();
            assert!(text.contains("PyTorch 2.11 caching allocator (replay, native (default))"));
            assert!(text.contains("stweaver (offline plan of the whole trace)"));
            assert!(text.contains("<title>"), "tooltips");
            assert!(text.contains("peak reserved 10.56 GiB"));
            if ext == "html" {
                assert!(text.starts_with("<!DOCTYPE html>"));
            }
        }
    }
    let o = stweaver(&["viz", "-o", dir.path().join("x.jpg").to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown picture format"));
}
