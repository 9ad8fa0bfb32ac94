//! What the planner's integration tests share: the real traces vendored in the repository
//! (`data/traces/`: PyTorch snapshots, stweaver trace files, `ground_truth.json`; and
//! `crates/planner/tests/data/`), loaded one way.
//!
//! Each test binary uses part of it.
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};

use stweaver_core::Trace;
use stweaver_core::trace_file::trace_from_bytes;
use stweaver_planner::snapshot::{Snapshot, load_snapshot};

/// A path relative to the repository's root.
pub fn repo(rel: &str) -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join(rel)
}

/// `data/traces/<name>`.
pub fn shared(name: &str) -> PathBuf {
    repo("data/traces").join(name)
}

/// The snapshot file `data/traces/<name>`, whole.
pub fn snapshot_file(name: &str) -> Snapshot {
    load_snapshot(&shared(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The first device's trace of the bundled snapshot `data/traces/snap_<name>.pickle.gz`.
pub fn snapshot(name: &str) -> Trace {
    let mut s = snapshot_file(&format!("snap_{name}.pickle.gz"));
    s.traces.swap_remove(0)
}

/// A stweaver trace file (`.stwt`, or gzipped `.stwt.gz`) at `rel` from the repository's
/// root.
pub fn trace_file(rel: &str) -> Trace {
    let path = repo(rel);
    let raw = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let bytes = if rel.ends_with(".gz") {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .unwrap_or_else(|e| panic!("{}: gunzip: {e}", path.display()));
        out
    } else {
        raw
    };
    trace_from_bytes(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The entry `key` of `data/traces/ground_truth.json` (measured on the GPU).
pub fn ground_truth(key: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(shared("ground_truth.json")).expect("ground_truth.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    v[key].clone()
}
