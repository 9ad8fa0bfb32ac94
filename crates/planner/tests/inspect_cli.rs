//! `stweaver inspect`, run as the built binary.

mod cli;

use cli::stweaver;
use std::path::{Path, PathBuf};

fn data(name: &str) -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data")).join(name)
}

fn shared(name: &str) -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces")).join(name)
}

fn inspect_json(path: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args: Vec<&std::ffi::OsStr> = vec!["inspect".as_ref(), "--json".as_ref()];
    args.extend(extra.iter().map(|s| std::ffi::OsStr::new(*s)));
    args.push(path.as_os_str());
    let out = stweaver(&args);
    assert!(
        out.status.success(),
        "stweaver failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

#[test]
fn json_of_a_real_snapshot() {
    let v = inspect_json(&shared("snap_gpt2xl_rcp.pickle.gz"), &[]);
    assert_eq!(v["format"], "pytorch_snapshot");
    let d = &v["devices"][0];
    assert_eq!(d["device"], 0);
    assert_eq!(d["lower_bound"]["bytes"], 9_445_508_616u64);
    assert_eq!(d["lower_bound"]["human"], "8.80 GiB");
    assert_eq!(d["events"]["alloc"], 21_504);
    assert_eq!(d["distinct_sizes"], 37);
    assert_eq!(d["period"]["allocs_per_iteration"], 5156);
    assert_eq!(d["period"]["repetitions"], 3);
    assert_eq!(d["snapshot_entries"]["segment_alloc"], 172);
    assert_eq!(v["annotations"], 16);
    // The event of the peak is an alloc, with its number and time.
    assert!(d["lower_bound"]["event"].is_u64());
    assert!(d["lower_bound"]["alloc_number"].is_u64());
    assert!(d["lower_bound"]["time_us"].as_u64().unwrap() > 0);
}

#[test]
fn text_output_and_device_filter() {
    let path = data("multi_device.pickle");
    let out = stweaver(&["inspect".as_ref(), path.as_os_str()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("device cuda:0") && text.contains("device cuda:1"),
        "{text}"
    );
    assert!(
        text.contains("lower bound         11535336 B (11.00 MiB)"),
        "{text}"
    );
    assert!(text.contains("iteration period    none"), "{text}");

    let v = inspect_json(&path, &["--device", "1"]);
    assert_eq!(v["devices"].as_array().unwrap().len(), 1);
    assert_eq!(v["devices"][0]["device"], 1);
    assert_eq!(v["devices"][0]["streams"].as_array().unwrap().len(), 2);

    let out = stweaver(&[
        "inspect".as_ref(),
        "--device".as_ref(),
        "7".as_ref(),
        path.as_os_str(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("device 7 has no allocation history (devices with one: 0, 1)"),
        "{err}"
    );
}

#[test]
fn bad_inputs_fail_with_the_file_and_the_problem() {
    for (name, problem) in [
        ("truncated.pickle.gz", "corrupt or truncated gzip data"),
        ("not_a_pickle.pickle", "unrecognised file"),
        (
            "wrong_shape.pickle",
            "device_traces[0][1]: missing key 'addr'",
        ),
        ("empty_trace.pickle", "the snapshot has no alloc events"),
        ("does_not_exist.pickle", "cannot read the file"),
    ] {
        let path = data(name);
        let out = stweaver(&["inspect".as_ref(), "--json".as_ref(), path.as_os_str()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(out.stdout.is_empty(), "{name}: nothing on stdout");
        assert!(err.contains(name) && err.contains(problem), "{name}: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
}

#[test]
fn inspects_stweaver_trace_files_too() {
    let snap =
        stweaver_planner::snapshot::load_snapshot(&data("periodic.pickle.gz")).expect("fixture");
    let dir = tempfile::tempdir().unwrap();
    // Named like a snapshot: the format is sniffed from the content.
    let path = dir.path().join("trace.pickle");
    stweaver_core::trace_file::write_trace_file(&path, &snap.traces[0]).expect("write .stwt");
    let v = inspect_json(&path, &[]);
    assert_eq!(v["format"], "stweaver_trace");
    assert!(v.get("settings").is_none() && v.get("segments").is_none());
    let d = &v["devices"][0];
    assert_eq!(
        d["lower_bound"]["bytes"],
        snap.traces[0].lower_bound().bytes.get()
    );
    assert_eq!(d["period"]["allocs_per_iteration"], 5);
    assert!(d.get("snapshot_entries").is_none());
    let traces = stweaver_planner::input::load_traces(&path).unwrap();
    assert_eq!(traces, snap.traces);
}

/// `inspect --json` with the machine-specific file path replaced by the file name.
fn portable_json(name: &str) -> String {
    let mut v = inspect_json(&data(name), &[]);
    v["file"] = name.into();
    serde_json::to_string_pretty(&v).unwrap()
}

#[test]
fn inspect_json_snapshots() {
    insta::assert_snapshot!("inspect_periodic", portable_json("periodic.pickle.gz"));
    insta::assert_snapshot!("inspect_multi_device", portable_json("multi_device.pickle"));
}

/// A gzipped stweaver trace (the repository's vendored H200 and H100 traces) is read as the
/// trace it holds, and its iterations grouped by request signature: the 1F1B Llama run is
/// 11 training iterations and one post-training tail (hashing every parameter).
#[test]
fn a_gzipped_trace_file_is_read_and_its_iteration_classes_listed() {
    let j = inspect_json(&data("h200/llama1b_1f1b.stwt.gz"), &[]);
    assert_eq!(j["format"], "stweaver_trace", "{j}");
    let classes = j["devices"][0]["iteration_classes"].as_array().unwrap();
    assert_eq!(classes.len(), 2, "{classes:?}");
    assert_eq!(classes[0]["count"], 11);
    assert_eq!(classes[1]["count"], 1);
    assert!(
        classes[0]["allocs_per_iteration"].as_u64().unwrap()
            > 10 * classes[1]["allocs_per_iteration"].as_u64().unwrap()
    );
    let out = stweaver(&[
        "inspect".as_ref(),
        data("h200/llama1b_1f1b.stwt.gz").as_os_str(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("iteration classes   2 over 12 iterations: 11 x ("),
        "{text}"
    );
}
