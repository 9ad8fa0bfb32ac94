//! A plan run starting from a plan file: a good file is served; a corrupt, truncated,
//! other-device or other-trace file is refused with an error that says which file and
//! what is wrong, and the run is served online — through `read_plan_file`,
//! `check_plan_matches` and `Engine::load_plan`, as the runtime does it.

mod common;

use std::path::Path;

use stweaver_core::plan_file::{check_plan_matches, read_plan_file, write_plan_file};
use stweaver_core::trace_file::trace_digest;
use stweaver_core::{DeviceId, Plan, Trace};
use stweaver_planner::engine_replay::{
    EngineReplayOptions, EngineReplayReport, ServeMode, iteration_boundaries,
    plan_first_iterations, replay_engine, trace_prefix, with_iteration_markers,
};
use stweaver_planner::planning::PlanOptions;

/// What the runtime does with `STWEAVER_PLAN=path`: read and verify the file, check it
/// belongs to this device and workload, load it; any refusal is reported and the run
/// is served online.
fn serve_from_file(
    path: &Path,
    device: DeviceId,
    digest: u64,
    trace: &Trace,
) -> (EngineReplayReport, Option<String>) {
    let opts = EngineReplayOptions::default();
    let plan =
        read_plan_file(path).and_then(|p| check_plan_matches(&p, device, digest).map(|()| p));
    match plan {
        Ok(plan) => {
            let r = replay_engine(trace, &ServeMode::Plan(&plan), &opts).unwrap();
            let refused = r.plan_error.clone();
            (r, refused)
        }
        Err(e) => (
            replay_engine(trace, &ServeMode::Online, &opts).unwrap(),
            Some(e.to_string()),
        ),
    }
}

#[test]
fn bad_plan_files_are_refused_and_the_run_is_served_online() {
    let trace = common::snapshot("llama1b_rcp");
    let bounds = iteration_boundaries(&trace);
    let (outcome, cut) = plan_first_iterations(&trace, 3, &PlanOptions::default()).unwrap();
    // The workload the plan belongs to: the trace it was made from.
    let digest = trace_digest(&with_iteration_markers(&trace_prefix(&trace, cut), &bounds));
    assert_eq!(outcome.plan.trace_digest, digest);
    let device = trace.device;
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("llama.stwp");
    write_plan_file(&good, &outcome.plan).unwrap();
    let bytes = std::fs::read(&good).unwrap();

    let online =
        replay_engine(&trace, &ServeMode::Online, &EngineReplayOptions::default()).unwrap();

    // The good file is served from the plan.
    let (r, refused) = serve_from_file(&good, device, digest, &trace);
    assert_eq!(refused, None);
    assert_eq!(r.counts.plan as usize, trace.alloc_event_count());
    assert!(r.peak_reserved < online.peak_reserved);

    let corrupt = dir.path().join("corrupt.stwp");
    let mut c = bytes.clone();
    let mid = c.len() / 2;
    for b in &mut c[mid..mid + 64] {
        *b ^= 0x5a;
    }
    std::fs::write(&corrupt, &c).unwrap();

    let truncated = dir.path().join("truncated.stwp");
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();

    let other_device = dir.path().join("other_device.stwp");
    write_plan_file(
        &other_device,
        &Plan {
            device: DeviceId(device.0 + 1),
            ..outcome.plan.clone()
        },
    )
    .unwrap();

    // A plan of the whole run (another trace: more iterations).
    let (whole, _) = plan_first_iterations(&trace, 4, &PlanOptions::default()).unwrap();
    let other_trace = dir.path().join("other_trace.stwp");
    write_plan_file(&other_trace, &whole.plan).unwrap();

    let missing = dir.path().join("missing.stwp");

    for (path, says) in [
        (&corrupt, ""),
        (&truncated, "truncated"),
        (&other_device, "made for"),
        (&other_trace, "made from trace"),
        (&missing, "cannot read"),
    ] {
        let (r, refused) = serve_from_file(path, device, digest, &trace);
        let msg = refused.unwrap_or_else(|| panic!("{} was served", path.display()));
        eprintln!("{}: {msg}", path.display());
        assert!(msg.contains(says), "{msg}");
        let names_file = msg.contains(&path.display().to_string());
        let is_mismatch = says.starts_with("made");
        assert!(names_file || is_mismatch, "{msg}");
        assert_eq!(r.plan_stats, None, "served online");
        assert_eq!(r.peak_reserved, online.peak_reserved);
        assert_eq!(r.counts.online as usize, trace.alloc_event_count());
    }

    // A plan for another device handed to the engine directly: the engine refuses it
    // too, and the replay goes on online.
    let r = replay_engine(
        &trace,
        &ServeMode::Plan(&Plan {
            device: DeviceId(device.0 + 1),
            ..outcome.plan.clone()
        }),
        &EngineReplayOptions::default(),
    )
    .unwrap();
    let msg = r.plan_error.clone().expect("refused");
    assert!(msg.contains("plan rejected: made for"), "{msg}");
    assert_eq!(r.peak_reserved, online.peak_reserved);
}
