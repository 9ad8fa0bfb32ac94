//! `stweaver plan TRACE --budget SIZE` and `stweaver compare TRACE --budget SIZE` end to
//! end: the JSON fields, the plan file with its schedule, and the refusals.

mod cli;

use cli::{stweaver, text};

use stweaver_core::plan_file::read_plan_file;
use stweaver_core::testkit::TraceBuilder;
use stweaver_core::trace_file::write_trace_file;
use stweaver_core::{Bytes, Trace};

const MIB: u64 = 1 << 20;

/// 96 MiB persistent; per iteration 8 layers of 32 MiB activations saved in forward
/// and unpacked in reverse in backward, a 4 MiB temporary per layer; 1 ms per event.
/// Without packs: the same allocations, as a PyTorch snapshot would have them.
fn trace(with_packs: bool) -> Trace {
    let mut b = TraceBuilder::with_clock(1_700_000_000_000_000, 1000);
    for _ in 0..12 {
        b.alloc(8 * MIB);
    }
    for _ in 0..4 {
        b.iteration_begin();
        let mut acts = Vec::new();
        for _ in 0..8 {
            let a = b.alloc(32 * MIB);
            if with_packs {
                b.saved_pack(a);
            }
            let tmp = b.alloc(4 * MIB);
            b.free(tmp);
            acts.push(a);
        }
        for a in acts.into_iter().rev() {
            if with_packs {
                b.saved_unpack(a);
            }
            let tmp = b.alloc(4 * MIB);
            b.free(tmp);
            b.free(a);
        }
    }
    b.done()
}

#[test]
fn plan_with_a_budget_reports_and_writes_the_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("t.stwt");
    write_trace_file(&input, &trace(true)).unwrap();
    let out = dir.path().join("p.stwp");
    // LB = 96 + 8·32 + 4 = 356 MiB; the budget wants 3 activations gone.
    let o = stweaver(&[
        "plan",
        input.to_str().unwrap(),
        "--budget",
        "280MiB",
        "--json",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["budget"], 280 * MIB);
    assert!(j["planned_peak"].as_u64().unwrap() <= 280 * MIB, "{j}");
    assert_eq!(j["offload"]["tensors"], 3, "{j}");
    assert_eq!(j["offload"]["bytes_per_iteration"], 3 * 32 * MIB);
    assert_eq!(j["offload"]["candidates"], 8);
    assert_eq!(j["offload"]["stalls"], 0);
    assert_eq!(j["offload"]["timing"], "spread_phases");
    assert_eq!(j["offload"]["copy_out_wait_us"], 0.0);
    let plan = read_plan_file(&out).unwrap();
    assert_eq!(plan.budget, Some(Bytes(280 * MIB)));
    assert_eq!(plan.offload.len(), 3);
    assert_eq!(plan.pool_size.get(), j["planned_peak"].as_u64().unwrap());

    // Text mode says the same.
    let o = stweaver(&["plan", input.to_str().unwrap(), "--budget", "280MiB"]);
    assert!(o.status.success(), "{}", text(&o));
    let s = text(&o);
    assert!(s.contains("3 of 8 saved tensors"), "{s}");
}

#[test]
fn plan_refuses_fractions_budgets_below_the_minimum_and_traces_without_packs() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("t.stwt");
    write_trace_file(&input, &trace(true)).unwrap();
    let input = input.to_str().unwrap();

    let o = stweaver(&["plan", input, "--budget", "0.8"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("fraction of device memory"),
        "{}",
        text(&o)
    );

    let o = stweaver(&["plan", input, "--budget", "100MiB"]);
    assert!(!o.status.success());
    let s = text(&o);
    assert!(
        s.contains("below the minimum") && s.contains("96.00 MiB persistent"),
        "{s}"
    );

    let bare = dir.path().join("bare.stwt");
    write_trace_file(&bare, &trace(false)).unwrap();
    let o = stweaver(&["plan", bare.to_str().unwrap(), "--budget", "280MiB"]);
    assert!(!o.status.success());
    let s = text(&o);
    assert!(
        s.contains("no saved tensors") && s.contains("stweaver's trace mode"),
        "{s}"
    );

    // A budget the plain plan meets: no offload, and the plan records the budget.
    let o = stweaver(&["plan", bare.to_str().unwrap(), "--budget", "1GiB", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["offload"]["tensors"], 0);
}

#[test]
fn compare_says_which_rows_fit_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("t.stwt");
    write_trace_file(&input, &trace(true)).unwrap();
    let o = stweaver(&[
        "compare",
        input.to_str().unwrap(),
        "--budget",
        "300MiB",
        "--json",
        "--no-engine",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let b = &j["budget"];
    assert_eq!(b["bytes"], 300 * MIB);
    assert_eq!(b["fits"]["pytorch_native"], false, "{b}");
    assert_eq!(b["fits"]["lower_bound"], false, "{b}");
    assert_eq!(b["stweaver_offload"]["fits"], true, "{b}");
    assert!(
        b["stweaver_offload"]["tensors"].as_u64().unwrap() >= 2,
        "{b}"
    );

    let o = stweaver(&[
        "compare",
        input.to_str().unwrap(),
        "--budget",
        "300MiB",
        "--no-engine",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let s = text(&o);
    assert!(
        s.contains("budget 300.00 MiB") && s.contains("does not fit") && s.contains("offloading"),
        "{s}"
    );
}

#[test]
fn verify_accepts_an_offload_plan_for_its_trace() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("t.stwt");
    write_trace_file(&input, &trace(true)).unwrap();
    let out = dir.path().join("p.stwp");
    let (i, p) = (input.to_str().unwrap(), out.to_str().unwrap());
    let o = stweaver(&["plan", i, "--budget", "280MiB", "-o", p]);
    assert!(o.status.success(), "{}", text(&o));
    let o = stweaver(&["verify", p, "--trace", i]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("offloads 3 saved tensors"),
        "{}",
        text(&o)
    );
}
