//! Import of PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`).
//!
//! A snapshot is a pickled dict (optionally gzip'd; detected by the magic bytes, not the
//! name) with `device_traces` (one list of trace entries per device), `segments` (the
//! allocator's state at the end), `allocator_settings` and `external_annotations`; see
//! `shared/research/pytorch-allocator-2.11.md` §4. [`load_snapshot`] turns it into one
//! [`Trace`] per device that has allocation history, plus the settings and final
//! segments:
//!
//! - `alloc` makes a new [`Allocation`] (requested size, stream, address) and an
//!   `Alloc` event; `free_requested` / `free_completed` become events of the allocation
//!   live at that address. A free of an address with nothing live there is a block
//!   allocated before recording began: it becomes a `preexisting` allocation (size and
//!   stream from the free), and its `free_requested` and `free_completed` both attach
//!   to it. Blocks never freed stay live to the end.
//! - `segment_*`, `snapshot`, `oom` (and actions this reader does not know) are the
//!   allocator's own business, not requests: they are counted ([`EntryCounts`]), not
//!   imported.
//! - `external_annotations` (`{stage: START|END, name, device, time_us}`) become
//!   `Marker { PhaseBegin | PhaseEnd, label }` events, merged into their device's
//!   events by `time_us` (stable: after entries of the same microsecond); labels are
//!   deduplicated per trace. An annotation with a negative device goes to every device.
//!
//! Cost: one pass to gunzip, one pass of the pickle VM (`pickle.rs`, O(bytes)), one pass
//! over the entries with a hash map from address to live allocation (O(entries)
//! expected), and one sort of the annotations. On `snap_qwenmoe_eager_rcp` (23 MB of
//! pickle, 323 k entries) a whole `stweaver inspect` takes 0.2–0.3 s of CPU in release
//! (figures and commands in `BENCHMARKS.md`).
//!
//! Every malformed input is a [`SnapshotError`] naming the file and the problem, with
//! the path inside the document for shape errors (`device_traces[0][17]: missing key
//! 'addr'`); nothing panics on bad input. [`load_snapshot_from_bytes`] is the entry
//! point for tests and fuzzing.

mod pickle;

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use rustc_hash::FxHashMap;
use stweaver_core::{
    AllocId, Allocation, Bytes, DeviceId, Event, EventKind, MarkerKind, StreamId, Trace, TraceError,
};

use pickle::{Pickle, Value};
pub use pickle::{PickleError, PickleErrorKind};

/// The first two bytes of every gzip member.
pub const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// `PROTO`, the first opcode of every pickle of protocol 2 or later.
pub const PICKLE_PROTO: u8 = 0x80;

/// Name used in errors for [`load_snapshot_from_bytes`].
pub const IN_MEMORY: &str = "<in-memory buffer>";

/// True when `bytes` start like something [`load_snapshot_from_bytes`] can read: gzip,
/// or a pickle of protocol 2–5.
pub fn looks_like_snapshot(bytes: &[u8]) -> bool {
    bytes.starts_with(&GZIP_MAGIC)
        || (bytes.first() == Some(&PICKLE_PROTO)
            && bytes.get(1).is_some_and(|v| (2..=5).contains(v)))
}

/// A PyTorch memory snapshot, imported.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// One trace per device that has `alloc` or free entries, `device` set, in device
    /// order. Every trace passed [`Trace::validate`].
    pub traces: Vec<Trace>,
    /// The allocator configuration of the recorded run.
    pub settings: AllocatorSettings,
    /// The allocator's segments when the snapshot was taken (its final state).
    pub segments: Vec<SegmentInfo>,
    /// What each `device_traces[i]` held, for every device (with events or not).
    pub devices: Vec<DeviceEntries>,
    /// Number of `external_annotations` (all devices).
    pub annotations: usize,
}

/// The `allocator_settings` of the recorded run (defaults when the snapshot has none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllocatorSettings {
    /// Whether the snapshot had an `allocator_settings` entry at all.
    pub present: bool,
    /// `PYTORCH_CUDA_ALLOC_CONF` as set for the run ("" if unset).
    pub alloc_conf: String,
    /// `expandable_segments:True`.
    pub expandable_segments: bool,
    /// Blocks at least this large are never split; `None` = unlimited (PyTorch's -1).
    pub max_split_size: Option<Bytes>,
    /// `roundup_power2_divisions`, by size interval, sorted by interval start.
    pub roundup_power2_divisions: Vec<RoundupDivisions>,
    /// `garbage_collection_threshold` (0 = off).
    pub garbage_collection_threshold: f64,
}

/// One interval of `roundup_power2_divisions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundupDivisions {
    /// Start of the size interval (the snapshot's key is in MiB).
    pub interval_start: Bytes,
    /// Power-of-two divisions for sizes in the interval (0 = off).
    pub divisions: u64,
}

/// One segment (cudaMalloc'd range, or mapped range of an expandable segment) at the end
/// of the recording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    pub device: DeviceId,
    pub address: u64,
    pub total_size: Bytes,
    pub allocated_size: Bytes,
    pub active_size: Bytes,
    pub requested_size: Bytes,
    pub stream: StreamId,
    /// `segment_type == "large"` (the large-block pool; else the small one).
    pub large_pool: bool,
    /// `segment_pool_id`: (0, 0) default pool, (k, 0) CUDA graph, (0, k) `MemPool`.
    pub pool_id: (u64, u64),
    pub is_expandable: bool,
    pub blocks: Vec<BlockInfo>,
}

/// One block of a final segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    pub address: u64,
    pub size: Bytes,
    /// Stale for inactive blocks (the last user's request).
    pub requested_size: Bytes,
    pub state: BlockState,
}

/// State of a block in a final segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    ActiveAllocated,
    ActivePendingFree,
    Inactive,
}

/// What one `device_traces[i]` list held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceEntries {
    pub device: DeviceId,
    pub counts: EntryCounts,
}

/// Trace entries by action, plus what the import derived from them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EntryCounts {
    pub alloc: u64,
    pub free_requested: u64,
    pub free_completed: u64,
    pub segment_alloc: u64,
    pub segment_free: u64,
    pub segment_map: u64,
    pub segment_unmap: u64,
    pub snapshot: u64,
    pub oom: u64,
    /// Entries with an action this reader does not know (skipped).
    pub other: u64,
    /// Allocations made up for frees of blocks allocated before recording began.
    pub preexisting: u64,
    /// External annotations merged into this device's events.
    pub annotations: u64,
}

impl EntryCounts {
    /// All entries of the device's list.
    pub fn entries(&self) -> u64 {
        self.alloc
            + self.free_requested
            + self.free_completed
            + self.segment_alloc
            + self.segment_free
            + self.segment_map
            + self.segment_unmap
            + self.snapshot
            + self.oom
            + self.other
    }
}

/// Why a snapshot could not be imported: the file, and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{}: {kind}", path.display())]
pub struct SnapshotError {
    /// The file ([`IN_MEMORY`] for [`load_snapshot_from_bytes`]).
    pub path: PathBuf,
    pub kind: SnapshotErrorKind,
}

/// What is wrong with a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotErrorKind {
    #[error("cannot read the file: {0}")]
    Io(std::io::Error),
    #[error("corrupt or truncated gzip data: {0}")]
    Gzip(std::io::Error),
    #[error(
        "not a PyTorch memory snapshot: expected gzip or a pickle of protocol 2 to 5, found {0}"
    )]
    NotPickle(String),
    #[error("malformed pickle{}: {error}", if *.gzipped { " (after gunzip)" } else { "" })]
    Pickle { error: PickleError, gzipped: bool },
    /// The pickle decoded, but is not shaped like a snapshot. `at` is the path inside
    /// the document (`device_traces[0][17]`).
    #[error("{at}: {problem}")]
    Shape { at: String, problem: String },
    #[error(
        "the snapshot has no alloc events (was torch.cuda.memory._record_memory_history(enabled=\"all\") active while the run allocated?)"
    )]
    NoAllocations,
    #[error("device_traces[{device}]: the imported trace is invalid: {error}")]
    InvalidTrace { device: i32, error: TraceError },
}

/// A stage of [`load_snapshot_with_progress`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadStage {
    /// `done`/`total`: compressed bytes consumed.
    Decompress,
    /// `done`/`total`: pickle bytes decoded.
    Parse,
    /// `done`/`total`: trace entries converted (all devices).
    Build,
}

/// Progress of a load, reported a few times per second's worth of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadProgress {
    pub stage: LoadStage,
    pub done: u64,
    pub total: u64,
}

/// Reads a snapshot file (`.pickle` or gzip'd `.pickle.gz`).
pub fn load_snapshot(path: &Path) -> Result<Snapshot, SnapshotError> {
    load_snapshot_with_progress(path, &mut |_| {})
}

/// [`load_snapshot`], calling `progress` as the work advances (for progress bars).
pub fn load_snapshot_with_progress(
    path: &Path,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Snapshot, SnapshotError> {
    let bytes = std::fs::read(path).map_err(|e| SnapshotError {
        path: path.to_owned(),
        kind: SnapshotErrorKind::Io(e),
    })?;
    decode(&bytes, progress).map_err(|kind| SnapshotError {
        path: path.to_owned(),
        kind,
    })
}

/// Imports a snapshot held in memory (gzip'd or not). Errors name [`IN_MEMORY`].
pub fn load_snapshot_from_bytes(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    decode(bytes, &mut |_| {}).map_err(|kind| SnapshotError {
        path: PathBuf::from(IN_MEMORY),
        kind,
    })
}

fn decode(
    bytes: &[u8],
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Snapshot, SnapshotErrorKind> {
    let gzipped = bytes.starts_with(&GZIP_MAGIC);
    let owned;
    let data: &[u8] = if gzipped {
        owned = gunzip(bytes, progress)?;
        &owned
    } else {
        bytes
    };
    if data.first() != Some(&PICKLE_PROTO) {
        return Err(SnapshotErrorKind::NotPickle(describe_start(data, gzipped)));
    }
    let total = data.len() as u64;
    let parsed = pickle::parse(data, &mut |at| {
        progress(LoadProgress {
            stage: LoadStage::Parse,
            done: at as u64,
            total,
        })
    })
    .map_err(|error| SnapshotErrorKind::Pickle { error, gzipped })?;
    build(&parsed, progress)
}

/// A short description of what a non-pickle starts with.
fn describe_start(data: &[u8], gzipped: bool) -> String {
    let what = if gzipped {
        "gzip data that does not hold a pickle"
    } else {
        "bytes"
    };
    if data.is_empty() {
        return if gzipped {
            "gzip data holding nothing".to_owned()
        } else {
            "an empty file".to_owned()
        };
    }
    let head = &data[..data.len().min(8)];
    let hex: Vec<String> = head.iter().map(|b| format!("{b:02x}")).collect();
    let text: String = head
        .iter()
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        })
        .collect();
    format!("{what} starting {} ({text:?})", hex.join(" "))
}

/// A reader over a byte slice that counts what it handed out (decompression progress).
struct CountingSlice<'a, 'p> {
    rest: &'a [u8],
    consumed: u64,
    total: u64,
    next_report: u64,
    progress: &'p mut dyn FnMut(LoadProgress),
}

impl Read for CountingSlice<'_, '_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.rest.read(buf)?;
        self.consumed += n as u64;
        if self.consumed >= self.next_report {
            (self.progress)(LoadProgress {
                stage: LoadStage::Decompress,
                done: self.consumed,
                total: self.total,
            });
            self.next_report = self.consumed + (1 << 18);
        }
        Ok(n)
    }
}

fn gunzip(
    bytes: &[u8],
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Vec<u8>, SnapshotErrorKind> {
    // The trailer's ISIZE is the last member's size mod 2^32: a good capacity hint for
    // the usual single-member file, capped by deflate's best ratio (~1032:1) so a lying
    // trailer cannot make us reserve absurd amounts.
    let hint = bytes
        .len()
        .checked_sub(4)
        .and_then(|at| bytes.get(at..))
        .and_then(|t| <[u8; 4]>::try_from(t).ok())
        .map_or(0, |t| u32::from_le_bytes(t) as usize)
        .min(bytes.len().saturating_mul(1032));
    let mut out = Vec::new();
    // Only a hint: if the reservation fails, the vector grows as it is filled.
    let _ = out.try_reserve(hint);
    let reader = CountingSlice {
        rest: bytes,
        consumed: 0,
        total: bytes.len() as u64,
        next_report: 1 << 18,
        progress,
    };
    flate2::read::MultiGzDecoder::new(reader)
        .read_to_end(&mut out)
        .map_err(SnapshotErrorKind::Gzip)?;
    Ok(out)
}

// ---------------------------------------------------------------------------------
// From decoded pickle to snapshot.

/// A position in the document, for error messages. Built on the stack, formatted only
/// when something is wrong.
#[derive(Clone, Copy)]
enum Loc<'a> {
    Root(&'static str),
    Key(&'a Loc<'a>, &'static str),
    Index(&'a Loc<'a>, usize),
}

impl fmt::Display for Loc<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Loc::Root(k) => f.write_str(k),
            Loc::Key(parent, k) => write!(f, "{parent}.{k}"),
            Loc::Index(parent, i) => write!(f, "{parent}[{i}]"),
        }
    }
}

fn shape(at: &Loc<'_>, problem: impl Into<String>) -> SnapshotErrorKind {
    SnapshotErrorKind::Shape {
        at: at.to_string(),
        problem: problem.into(),
    }
}

type Dict<'p> = &'p [(Value, Value)];

/// Typed access to the decoded document with located errors.
struct Doc<'p, 'a> {
    p: &'p Pickle<'a>,
}

impl<'p, 'a> Doc<'p, 'a> {
    fn dict(&self, v: Value, at: &Loc<'_>) -> Result<Dict<'p>, SnapshotErrorKind> {
        self.p
            .dict(v)
            .ok_or_else(|| shape(at, format!("expected a dict, found {}", v.type_name())))
    }

    /// A list or tuple.
    fn seq(&self, v: Value, at: &Loc<'_>) -> Result<&'p [Value], SnapshotErrorKind> {
        match v {
            Value::List(_) | Value::Tuple(_) => Ok(self.p.seq(v).unwrap_or(&[])),
            _ => Err(shape(
                at,
                format!("expected a list, found {}", v.type_name()),
            )),
        }
    }

    fn field(
        &self,
        d: Dict<'p>,
        key: &'static str,
        at: &Loc<'_>,
    ) -> Result<Value, SnapshotErrorKind> {
        self.p
            .get(d, key)
            .ok_or_else(|| shape(at, format!("missing key '{key}'")))
    }

    fn u64(&self, v: Value, at: &Loc<'_>) -> Result<u64, SnapshotErrorKind> {
        self.p.as_u64(v).ok_or_else(|| match v {
            Value::Int(_) | Value::BigInt { .. } => shape(
                at,
                "expected a non-negative integer below 2^64, found a negative or larger one",
            ),
            _ => shape(at, format!("expected an int, found {}", v.type_name())),
        })
    }

    fn i64(&self, v: Value, at: &Loc<'_>) -> Result<i64, SnapshotErrorKind> {
        self.p.as_i64(v).ok_or_else(|| match v {
            Value::BigInt { .. } => shape(at, "integer out of the 64-bit range"),
            _ => shape(at, format!("expected an int, found {}", v.type_name())),
        })
    }

    fn str(&self, v: Value, at: &Loc<'_>) -> Result<&'a str, SnapshotErrorKind> {
        match self.p.str(v) {
            Some(Ok(s)) => Ok(s),
            Some(Err(_)) => Err(shape(at, "string is not valid UTF-8")),
            None => Err(shape(
                at,
                format!("expected a str, found {}", v.type_name()),
            )),
        }
    }

    fn bool(&self, v: Value, at: &Loc<'_>) -> Result<bool, SnapshotErrorKind> {
        match v {
            Value::Bool(b) => Ok(b),
            Value::Int(i @ (0 | 1)) => Ok(i == 1),
            _ => Err(shape(
                at,
                format!("expected a bool, found {}", v.type_name()),
            )),
        }
    }

    fn f64(&self, v: Value, at: &Loc<'_>) -> Result<f64, SnapshotErrorKind> {
        self.p
            .as_f64(v)
            .ok_or_else(|| shape(at, format!("expected a float, found {}", v.type_name())))
    }

    /// An optional key: `None` when absent, an error when present with a bad value.
    fn opt<T>(
        &self,
        d: Dict<'p>,
        key: &'static str,
        at: &Loc<'_>,
        conv: impl FnOnce(&Self, Value, &Loc<'_>) -> Result<T, SnapshotErrorKind>,
    ) -> Result<Option<T>, SnapshotErrorKind> {
        match self.p.get(d, key) {
            None => Ok(None),
            Some(v) => conv(self, v, &Loc::Key(at, key)).map(Some),
        }
    }

    /// A required key, converted.
    fn req<T>(
        &self,
        d: Dict<'p>,
        key: &'static str,
        at: &Loc<'_>,
        conv: impl FnOnce(&Self, Value, &Loc<'_>) -> Result<T, SnapshotErrorKind>,
    ) -> Result<T, SnapshotErrorKind> {
        let v = self.field(d, key, at)?;
        conv(self, v, &Loc::Key(at, key))
    }
}

fn device_id(i: usize, at: &Loc<'_>) -> Result<DeviceId, SnapshotErrorKind> {
    i32::try_from(i)
        .map(DeviceId)
        .map_err(|_| shape(at, "too many devices"))
}

fn build(
    p: &Pickle<'_>,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Snapshot, SnapshotErrorKind> {
    let doc = Doc { p };
    let root = match p.root {
        Value::Dict(_) => doc.dict(p.root, &Loc::Root("<root>"))?,
        Value::List(_) => {
            // `torch.cuda.memory_snapshot()` (segments only), which memory_viz accepts.
            return Err(SnapshotErrorKind::Shape {
                at: "<root>".into(),
                problem: "a list of segments without device_traces (written from torch.cuda.memory_snapshot(), not torch.cuda.memory._snapshot()); it holds no allocation history".into(),
            });
        }
        other => {
            return Err(SnapshotErrorKind::Shape {
                at: "<root>".into(),
                problem: format!("expected a dict, found {}", other.type_name()),
            });
        }
    };

    let settings = match p.get(root, "allocator_settings") {
        None => AllocatorSettings::default(),
        Some(v) => parse_settings(&doc, v)?,
    };

    let segments = match p.get(root, "segments") {
        None => Vec::new(),
        Some(v) => {
            let at = Loc::Root("segments");
            let items = doc.seq(v, &at)?;
            let mut out = Vec::with_capacity(items.len());
            for (i, &s) in items.iter().enumerate() {
                out.push(parse_segment(&doc, s, &Loc::Index(&at, i))?);
            }
            out
        }
    };

    let traces_at = Loc::Root("device_traces");
    let device_lists = doc.seq(
        doc.field(root, "device_traces", &Loc::Root("<root>"))
            .map_err(|_| {
                shape(
                    &Loc::Root("<root>"),
                    "missing key 'device_traces' (is this a torch.cuda.memory._snapshot() dump?)",
                )
            })?,
        &traces_at,
    )?;
    let mut lists = Vec::with_capacity(device_lists.len());
    for (i, &l) in device_lists.iter().enumerate() {
        lists.push(doc.seq(l, &Loc::Index(&traces_at, i))?);
    }

    let (annotations, annotation_count) = match p.get(root, "external_annotations") {
        None => (vec![Vec::new(); lists.len()], 0),
        Some(v) => parse_annotations(&doc, v, lists.len())?,
    };

    let total_entries: u64 = lists.iter().map(|l| l.len() as u64).sum();
    let mut done_before = 0u64;
    let mut traces = Vec::new();
    let mut devices = Vec::with_capacity(lists.len());
    for (i, (entries, marks)) in lists.iter().zip(annotations).enumerate() {
        let at = Loc::Index(&traces_at, i);
        let device = device_id(i, &at)?;
        let mut report = |done: u64| {
            progress(LoadProgress {
                stage: LoadStage::Build,
                done: done_before + done,
                total: total_entries,
            })
        };
        let (trace, counts) = build_device(&doc, device, entries, marks, &at, &mut report)?;
        done_before += entries.len() as u64;
        if let Some(trace) = trace {
            trace
                .validate()
                .map_err(|error| SnapshotErrorKind::InvalidTrace {
                    device: device.0,
                    error,
                })?;
            traces.push(trace);
        }
        devices.push(DeviceEntries { device, counts });
    }
    if devices.iter().all(|d| d.counts.alloc == 0) {
        return Err(SnapshotErrorKind::NoAllocations);
    }
    Ok(Snapshot {
        traces,
        settings,
        segments,
        devices,
        annotations: annotation_count,
    })
}

fn parse_settings(doc: &Doc<'_, '_>, v: Value) -> Result<AllocatorSettings, SnapshotErrorKind> {
    let at = Loc::Root("allocator_settings");
    let d = doc.dict(v, &at)?;
    let mut s = AllocatorSettings {
        present: true,
        ..AllocatorSettings::default()
    };
    if let Some(conf) = doc.opt(d, "PYTORCH_CUDA_ALLOC_CONF", &at, Doc::str)? {
        s.alloc_conf = conf.to_owned();
    }
    if let Some(e) = doc.opt(d, "expandable_segments", &at, Doc::bool)? {
        s.expandable_segments = e;
    }
    if let Some(m) = doc.opt(d, "max_split_size", &at, Doc::i64)? {
        s.max_split_size = u64::try_from(m).ok().map(Bytes);
    }
    if let Some(g) = doc.opt(d, "garbage_collection_threshold", &at, Doc::f64)? {
        s.garbage_collection_threshold = g;
    }
    if let Some(r) = p_get(doc, d, "roundup_power2_divisions") {
        let rat = Loc::Key(&at, "roundup_power2_divisions");
        let rd = doc.dict(r, &rat)?;
        for &(k, v) in rd {
            let key = doc.str(k, &rat)?;
            let mib: u64 = key
                .parse()
                .map_err(|_| shape(&rat, format!("key {key:?} is not an interval start in MiB")))?;
            let interval_start = mib
                .checked_mul(1 << 20)
                .map(Bytes)
                .ok_or_else(|| shape(&rat, format!("interval start {mib} MiB is too large")))?;
            let divisions = doc.u64(v, &rat)?;
            s.roundup_power2_divisions.push(RoundupDivisions {
                interval_start,
                divisions,
            });
        }
        s.roundup_power2_divisions.sort_by_key(|r| r.interval_start);
    }
    Ok(s)
}

fn p_get(doc: &Doc<'_, '_>, d: Dict<'_>, key: &str) -> Option<Value> {
    doc.p.get(d, key)
}

fn parse_segment(
    doc: &Doc<'_, '_>,
    v: Value,
    at: &Loc<'_>,
) -> Result<SegmentInfo, SnapshotErrorKind> {
    let d = doc.dict(v, at)?;
    let device = doc.req(d, "device", at, Doc::i64)?;
    let device = i32::try_from(device).map(DeviceId).map_err(|_| {
        shape(
            &Loc::Key(at, "device"),
            format!("device {device} out of range"),
        )
    })?;
    let bytes = |key: &'static str| -> Result<Bytes, SnapshotErrorKind> {
        Ok(Bytes(doc.opt(d, key, at, Doc::u64)?.unwrap_or(0)))
    };
    let large_pool = match doc.opt(d, "segment_type", at, Doc::str)? {
        None | Some("large") => true,
        Some("small") => false,
        Some(other) => {
            return Err(shape(
                &Loc::Key(at, "segment_type"),
                format!("expected 'small' or 'large', found {other:?}"),
            ));
        }
    };
    let pool_id = match p_get(doc, d, "segment_pool_id") {
        None => (0, 0),
        Some(v) => {
            let pat = Loc::Key(at, "segment_pool_id");
            match doc.seq(v, &pat)? {
                &[a, b] => (doc.u64(a, &pat)?, doc.u64(b, &pat)?),
                other => {
                    return Err(shape(
                        &pat,
                        format!("expected a pair, found {} items", other.len()),
                    ));
                }
            }
        }
    };
    let mut blocks = Vec::new();
    if let Some(bv) = p_get(doc, d, "blocks") {
        let bat = Loc::Key(at, "blocks");
        for (i, &b) in doc.seq(bv, &bat)?.iter().enumerate() {
            let at = Loc::Index(&bat, i);
            let bd = doc.dict(b, &at)?;
            let state = match doc.req(bd, "state", &at, Doc::str)? {
                "active_allocated" => BlockState::ActiveAllocated,
                "active_pending_free" => BlockState::ActivePendingFree,
                "inactive" => BlockState::Inactive,
                other => {
                    return Err(shape(
                        &Loc::Key(&at, "state"),
                        format!(
                            "expected 'active_allocated', 'active_pending_free' or 'inactive', found {other:?}"
                        ),
                    ));
                }
            };
            blocks.push(BlockInfo {
                address: doc.req(bd, "address", &at, Doc::u64)?,
                size: Bytes(doc.req(bd, "size", &at, Doc::u64)?),
                requested_size: Bytes(doc.opt(bd, "requested_size", &at, Doc::u64)?.unwrap_or(0)),
                state,
            });
        }
    }
    Ok(SegmentInfo {
        device,
        address: doc.req(d, "address", at, Doc::u64)?,
        total_size: Bytes(doc.req(d, "total_size", at, Doc::u64)?),
        allocated_size: bytes("allocated_size")?,
        active_size: bytes("active_size")?,
        requested_size: bytes("requested_size")?,
        stream: StreamId(doc.opt(d, "stream", at, Doc::u64)?.unwrap_or(0)),
        large_pool,
        pool_id,
        is_expandable: doc.opt(d, "is_expandable", at, Doc::bool)?.unwrap_or(false),
        blocks,
    })
}

/// A phase marker to merge into a device's events.
#[derive(Debug, Clone)]
struct Annotation<'a> {
    time_us: u64,
    kind: MarkerKind,
    name: &'a str,
}

/// Annotations per device, each list sorted (stably) by time; plus the total count.
#[allow(clippy::type_complexity)]
fn parse_annotations<'a>(
    doc: &Doc<'_, 'a>,
    v: Value,
    devices: usize,
) -> Result<(Vec<Vec<Annotation<'a>>>, usize), SnapshotErrorKind> {
    let at = Loc::Root("external_annotations");
    let items = doc.seq(v, &at)?;
    let mut per_device: Vec<Vec<Annotation<'a>>> = vec![Vec::new(); devices];
    for (i, &a) in items.iter().enumerate() {
        let at = Loc::Index(&at, i);
        let d = doc.dict(a, &at)?;
        let kind = match doc.req(d, "stage", &at, Doc::str)? {
            "START" => MarkerKind::PhaseBegin,
            "END" => MarkerKind::PhaseEnd,
            other => {
                return Err(shape(
                    &Loc::Key(&at, "stage"),
                    format!("expected 'START' or 'END', found {other:?}"),
                ));
            }
        };
        let ann = Annotation {
            time_us: doc.req(d, "time_us", &at, Doc::u64)?,
            kind,
            name: doc.req(d, "name", &at, Doc::str)?,
        };
        match doc.opt(d, "device", &at, Doc::i64)? {
            Some(dev) if dev >= 0 => {
                // Annotations of devices without a trace list have nothing to mark.
                if let Some(list) = usize::try_from(dev)
                    .ok()
                    .and_then(|d| per_device.get_mut(d))
                {
                    list.push(ann);
                }
            }
            // No device, or a negative one: a global annotation, on every device.
            _ => {
                for list in &mut per_device {
                    list.push(ann.clone());
                }
            }
        }
    }
    for list in &mut per_device {
        list.sort_by_key(|a| a.time_us); // stable
    }
    Ok((per_device, items.len()))
}

/// The live allocation at an address.
#[derive(Clone, Copy)]
struct Live {
    id: u32,
    /// Entry index of its `alloc` (for messages); `usize::MAX` for preexisting blocks.
    entry: usize,
    free_requested: bool,
}

/// Converts one device's entries. Returns no trace when the device has no alloc/free
/// entries.
fn build_device<'a>(
    doc: &Doc<'_, '_>,
    device: DeviceId,
    entries: &[Value],
    marks: Vec<Annotation<'a>>,
    list_at: &Loc<'_>,
    report: &mut dyn FnMut(u64),
) -> Result<(Option<Trace>, EntryCounts), SnapshotErrorKind> {
    let mut counts = EntryCounts::default();
    let mut allocations: Vec<Allocation> = Vec::new();
    let mut events: Vec<Event> = Vec::with_capacity(entries.len() + marks.len());
    let mut live: FxHashMap<u64, Live> = FxHashMap::default();
    let mut labels: Vec<String> = Vec::new();
    let mut label_ids: FxHashMap<&'a str, u32> = FxHashMap::default();
    let mut marks = marks.into_iter().peekable();
    let mut requests = 0u64;

    let mut push_marker = |events: &mut Vec<Event>, a: Annotation<'a>| {
        let next = labels.len() as u32;
        let label = *label_ids.entry(a.name).or_insert_with(|| {
            labels.push(a.name.to_owned());
            next
        });
        events.push(Event {
            kind: EventKind::Marker {
                kind: a.kind,
                label: Some(label),
            },
            time_us: a.time_us,
        });
    };

    let new_id = |allocations: &Vec<Allocation>, at: &Loc<'_>| {
        u32::try_from(allocations.len())
            .ok()
            .filter(|&id| id < u32::MAX)
            .ok_or_else(|| shape(at, "more than 2^32-1 allocations"))
    };

    for (i, &e) in entries.iter().enumerate() {
        if i % 65536 == 0 && i > 0 {
            report(i as u64);
        }
        let at = Loc::Index(list_at, i);
        let d = doc.dict(e, &at)?;
        let action_v = doc.field(d, "action", &at)?;
        let action = doc.p.str_bytes(action_v).ok_or_else(|| {
            shape(
                &Loc::Key(&at, "action"),
                format!("expected a str, found {}", action_v.type_name()),
            )
        })?;
        let kind = match action {
            b"alloc" => 0u8,
            b"free_requested" => 1,
            b"free_completed" => 2,
            other => {
                match other {
                    b"segment_alloc" => counts.segment_alloc += 1,
                    b"segment_free" => counts.segment_free += 1,
                    b"segment_map" => counts.segment_map += 1,
                    b"segment_unmap" => counts.segment_unmap += 1,
                    b"snapshot" => counts.snapshot += 1,
                    b"oom" => counts.oom += 1,
                    _ => counts.other += 1,
                }
                continue;
            }
        };
        let addr = doc.req(d, "addr", &at, Doc::u64)?;
        let size = doc.req(d, "size", &at, Doc::u64)?;
        let stream = StreamId(doc.req(d, "stream", &at, Doc::u64)?);
        let time_us = doc.opt(d, "time_us", &at, Doc::u64)?.unwrap_or(0);
        if size == 0 {
            return Err(shape(&Loc::Key(&at, "size"), "a block of size 0"));
        }
        while let Some(m) = marks.next_if(|m| m.time_us < time_us) {
            push_marker(&mut events, m);
        }
        requests += 1;
        let event_kind = match kind {
            0 => {
                counts.alloc += 1;
                let id = new_id(&allocations, &at)?;
                if let Some(prev) = live.insert(
                    addr,
                    Live {
                        id,
                        entry: i,
                        free_requested: false,
                    },
                ) {
                    let by = if prev.entry == usize::MAX {
                        "a block allocated before recording began".to_owned()
                    } else {
                        format!("the block of {list_at}[{}]", prev.entry)
                    };
                    return Err(shape(
                        &at,
                        format!("alloc at address {addr:#x}, where {by} is still live"),
                    ));
                }
                allocations.push(Allocation {
                    size: Bytes(size),
                    stream,
                    addr,
                    preexisting: false,
                });
                EventKind::Alloc(AllocId(id))
            }
            1 => {
                counts.free_requested += 1;
                match live.get_mut(&addr) {
                    Some(l) if l.free_requested => {
                        return Err(shape(
                            &at,
                            format!("second free_requested of the block at address {addr:#x}"),
                        ));
                    }
                    Some(l) => {
                        l.free_requested = true;
                        EventKind::FreeRequested(AllocId(l.id))
                    }
                    None => {
                        let id = new_id(&allocations, &at)?;
                        counts.preexisting += 1;
                        allocations.push(Allocation {
                            size: Bytes(size),
                            stream,
                            addr,
                            preexisting: true,
                        });
                        live.insert(
                            addr,
                            Live {
                                id,
                                entry: usize::MAX,
                                free_requested: true,
                            },
                        );
                        EventKind::FreeRequested(AllocId(id))
                    }
                }
            }
            _ => {
                counts.free_completed += 1;
                match live.remove(&addr) {
                    Some(l) => EventKind::FreeCompleted(AllocId(l.id)),
                    None => {
                        let id = new_id(&allocations, &at)?;
                        counts.preexisting += 1;
                        allocations.push(Allocation {
                            size: Bytes(size),
                            stream,
                            addr,
                            preexisting: true,
                        });
                        EventKind::FreeCompleted(AllocId(id))
                    }
                }
            }
        };
        events.push(Event {
            kind: event_kind,
            time_us,
        });
    }
    for m in marks {
        push_marker(&mut events, m);
    }
    report(entries.len() as u64);
    counts.annotations = events.len() as u64 - requests;
    if requests == 0 {
        return Ok((None, counts));
    }
    Ok((
        Some(Trace {
            device,
            allocations,
            events,
            labels,
            restores: Vec::new(),
        }),
        counts,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_kind(bytes: &[u8]) -> SnapshotErrorKind {
        load_snapshot_from_bytes(bytes)
            .expect_err("should fail")
            .kind
    }

    #[test]
    fn sniffing() {
        assert!(looks_like_snapshot(&[0x1f, 0x8b, 8]));
        assert!(looks_like_snapshot(&[0x80, 4, 0x95]));
        assert!(!looks_like_snapshot(&[0x80, 9]));
        assert!(!looks_like_snapshot(b"STWT"));
        assert!(!looks_like_snapshot(b""));
    }

    #[test]
    fn not_a_pickle_names_the_first_bytes() {
        let e = load_snapshot_from_bytes(b"hello world").unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with(IN_MEMORY), "{msg}");
        assert!(msg.contains("68 65 6c 6c 6f"), "{msg}");
        assert!(matches!(err_kind(b""), SnapshotErrorKind::NotPickle(s) if s == "an empty file"));
    }

    #[test]
    fn wrong_root_and_missing_traces() {
        // pickle.dumps(3, protocol=4)
        let e = err_kind(b"\x80\x04K\x03.");
        assert!(
            matches!(&e, SnapshotErrorKind::Shape { at, problem } if at == "<root>" && problem == "expected a dict, found int"),
            "{e}"
        );
        // pickle.dumps({}, protocol=4)
        let e = err_kind(b"\x80\x04}\x94.");
        assert!(e.to_string().contains("missing key 'device_traces'"), "{e}");
        // pickle.dumps([], protocol=4)
        let e = err_kind(b"\x80\x04]\x94.");
        assert!(e.to_string().contains("without device_traces"), "{e}");
    }
}
