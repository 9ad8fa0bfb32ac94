//! `stweaver convert`, run as the built binary: snapshot → .stwt → identical trace.

mod cli;

use cli::stweaver;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use stweaver_core::DeviceId;
use stweaver_core::trace_file::{read_trace_file, trace_digest};
use stweaver_planner::input::load_traces;

fn data(name: &str) -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data")).join(name)
}

fn shared(name: &str) -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces")).join(name)
}

#[test]
fn a_real_snapshot_converts_and_reads_back_identical() {
    let input = shared("snap_llama1b_rcp.pickle.gz");
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("llama.stwt");
    let out = stweaver(&[
        "convert".as_ref(),
        input.as_os_str(),
        "-o".as_ref(),
        out_path.as_os_str(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stweaver failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let back = read_trace_file(&out_path).unwrap();
    let original = load_traces(&input).unwrap();
    assert_eq!(original.len(), 1);
    assert_eq!(back, original[0]);
    assert_eq!(back.device, DeviceId(0));
    let lb = back.lower_bound();
    assert_eq!(lb.bytes.get(), 11_510_874_376);
    assert_eq!(lb, original[0].lower_bound());

    // It says what it wrote.
    let digest = format!("{:#018x}", trace_digest(&back));
    for want in [
        "llama.stwt",
        "cuda:0",
        "11510874376 B (10.72 GiB)",
        digest.as_str(),
    ] {
        assert!(stdout.contains(want), "{want:?} missing from:\n{stdout}");
    }

    // A trace file converts to itself (the input is recognised by content).
    let again = dir.path().join("again.stwt");
    let out = stweaver(&[
        "convert".as_ref(),
        out_path.as_os_str(),
        "--output".as_ref(),
        again.as_os_str(),
    ]);
    assert!(out.status.success());
    assert_eq!(
        std::fs::read(&again).unwrap(),
        std::fs::read(&out_path).unwrap()
    );
}

#[test]
fn several_devices_need_a_device_and_it_must_exist() {
    let input = data("multi_device.pickle");
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("dev.stwt");
    let run = |extra: &[&str]| {
        let mut args: Vec<&OsStr> = vec![
            "convert".as_ref(),
            input.as_os_str(),
            "-o".as_ref(),
            out_path.as_os_str(),
        ];
        args.extend(extra.iter().map(OsStr::new));
        stweaver(&args)
    };

    let out = run(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("multi_device.pickle") && err.contains("several devices (0, 1)"),
        "{err}"
    );
    assert!(!out_path.exists());

    let out = run(&["--device", "7"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("device 7 has no allocation history"), "{err}");

    let out = run(&["--device", "1"]);
    assert!(out.status.success());
    let back = read_trace_file(&out_path).unwrap();
    let want = load_traces(&input)
        .unwrap()
        .into_iter()
        .find(|t| t.device == DeviceId(1))
        .unwrap();
    assert_eq!(back, want);
}

#[test]
fn bad_input_fails_naming_it_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("never.stwt");
    let input = data("truncated.pickle.gz");
    let out = stweaver(&[
        "convert".as_ref(),
        input.as_os_str(),
        "-o".as_ref(),
        out_path.as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("truncated.pickle.gz"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out_path.exists());

    // An output directory that does not exist is a write error naming the file.
    let input = shared("snap_llama1b_rcp.pickle.gz");
    let bad_out = dir.path().join("no/such/dir/x.stwt");
    let out = stweaver(&[
        "convert".as_ref(),
        input.as_os_str(),
        "-o".as_ref(),
        bad_out.as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("x.stwt") && err.contains("cannot write"),
        "{err}"
    );
}
