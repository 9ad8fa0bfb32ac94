//! The trace file (`.stwt`): a [`Trace`] on disk.
//!
//! Format: a size-prefixed FlatBuffer with identifier `STWT` (the envelope and the
//! order of checks are in [`crate::file_format`]); schema `crates/core/schema/trace.fbs`,
//! Rust in `trace_generated.rs` (made by `cargo xtask codegen`, never edited by hand).
//! The root table holds the format version ([`FORMAT_VERSION`]), the producer, the
//! device, the allocations as 32-byte structs `{bytes, stream, addr, flags}` (bit 0 of
//! `flags`: preexisting), the events as 16-byte structs `{time_us, arg, kind, marker}`
//! (`arg` is the allocation id, or for a marker the label index, `0xFFFF_FFFF` for none)
//! and the marker labels. Version 2 (written since the saved-tensor events) adds the
//! event kinds `SavedPack = 4` and `SavedUnpack = 5`; version-1 files still load (a
//! saved-tensor event in one is a bad record), other versions are refused naming the
//! version found and the versions read ([`READ_VERSIONS`]). The optional `restores`
//! vector (8-byte structs `{from_alloc, into_alloc}`, [`Trace::restores`]) was appended
//! within version 2: it changes the meaning of no existing field, and a reader that
//! ignores it still reads the recorded run, a valid trace (the schema's compatibility
//! rule). It is written only when the trace has links, so a trace without them encodes
//! to the same bytes as before.
//!
//! Reading ([`read_trace_file`], [`trace_from_bytes`]) maps the file, checks the
//! envelope, runs the FlatBuffers verifier once (O(tables): each struct vector is one
//! bounds check), checks the version, decodes every record (O(allocations + events),
//! rejecting unknown kinds and flag bits) and finally runs [`Trace::validate`]. Any
//! failure is a [`TraceFileError`] naming the file and the problem; no input panics.
//!
//! [`trace_digest`] is a content digest of a trace, independent of the file: plans
//! carry it so that a plan is not served against another workload by mistake.

#[allow(
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    unsafe_op_in_unsafe_fn,
    unused_imports,
    dead_code,
    deprecated,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    mismatched_lifetime_syntaxes
)]
mod trace_generated;

use std::path::{Path, PathBuf};

use flatbuffers::FlatBufferBuilder;
use trace_generated::stweaver::trace_fb as fb;

use crate::file_format::{
    self, FileKind, FormatError, IN_MEMORY, MAX_BUFFER, PRODUCER_NAME, PRODUCER_VERSION,
};
use crate::trace::{Allocation, Event, EventKind, MarkerKind, Restore, Trace, TraceError};
use crate::units::{AllocId, Bytes, DeviceId, StreamId};

/// The trace format version this build writes.
pub const FORMAT_VERSION: u32 = 2;

/// The versions this build reads: 1 (no saved-tensor events) and 2 (adds `SavedPack`
/// and `SavedUnpack` events; nothing else changed).
pub const READ_VERSIONS: &[u32] = &[1, 2];

/// The conventional file extension (without the dot).
pub const EXTENSION: &str = "stwt";

const KIND: FileKind = FileKind {
    name: "trace",
    identifier: "STWT",
};

/// `EventRec.arg` of a marker without a label.
const NO_LABEL: u32 = u32::MAX;

/// Bit 0 of `AllocationRec.flags`.
const FLAG_PREEXISTING: u8 = 1;

/// Why a trace file could not be read or written. Every variant names the file
/// (`<in-memory buffer>` for [`trace_from_bytes`]).
#[derive(Debug, thiserror::Error)]
pub enum TraceFileError {
    #[error("{}: cannot read the trace file: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: cannot write the trace file: {error}", path.display())]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    /// The bytes are not a readable trace file (wrong identifier, truncated, corrupt,
    /// unsupported version, ...).
    #[error("{}: {error}", path.display())]
    Format { path: PathBuf, error: FormatError },
    /// The file decodes, but the trace breaks a structural rule (or, when writing,
    /// the trace to write does).
    #[error("{}: not a valid trace: {error}", path.display())]
    Invalid { path: PathBuf, error: TraceError },
}

impl TraceFileError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            TraceFileError::Read { path, .. }
            | TraceFileError::Write { path, .. }
            | TraceFileError::Format { path, .. }
            | TraceFileError::Invalid { path, .. } => path,
        }
    }

    /// The same error, about `file` (bytes decoded from it, e.g. after gunzip).
    pub fn with_path(mut self, file: &Path) -> TraceFileError {
        match &mut self {
            TraceFileError::Read { path, .. }
            | TraceFileError::Write { path, .. }
            | TraceFileError::Format { path, .. }
            | TraceFileError::Invalid { path, .. } => *path = file.to_path_buf(),
        }
        self
    }
}

/// Writes `trace` to `path` (atomically: a temporary sibling renamed over it). The
/// trace is validated first: an invalid trace is refused, not written.
pub fn write_trace_file(path: &Path, trace: &Trace) -> Result<(), TraceFileError> {
    let bytes = encode(trace).map_err(|e| e.at(path))?;
    file_format::write_atomically(path, &bytes).map_err(|error| TraceFileError::Write {
        path: path.to_path_buf(),
        error,
    })
}

/// Encodes `trace` into the bytes of a trace file (validating it first).
pub fn trace_to_bytes(trace: &Trace) -> Result<Vec<u8>, TraceFileError> {
    encode(trace).map_err(|e| e.at(Path::new(IN_MEMORY)))
}

/// Reads and validates the trace file at `path` (see the module docs for the checks).
pub fn read_trace_file(path: &Path) -> Result<Trace, TraceFileError> {
    file_format::with_file_bytes(path, decode)
        .map_err(|error| TraceFileError::Read {
            path: path.to_path_buf(),
            error,
        })?
        .map_err(|e| e.at(path))
}

/// Decodes and validates a trace file held in memory (all of `bytes`).
pub fn trace_from_bytes(bytes: &[u8]) -> Result<Trace, TraceFileError> {
    decode(bytes).map_err(|e| e.at(Path::new(IN_MEMORY)))
}

/// A stable 64-bit digest of a trace's content.
///
/// Algorithm: XXH3-64 (seed 0; the `xxh3_64` of the xxHash specification, so any
/// implementation can recompute it) over this byte string, integers little-endian:
///
/// ```text
/// "stweaver-trace-digest-v1\0"
/// u64 number of allocations
///   per allocation, in table order: u64 size, u64 stream, u8 preexisting (0/1)
/// u64 number of events
///   per event, in order:
///     Alloc / FreeRequested / FreeCompleted: u8 0 / 1 / 2, u32 allocation id
///     SavedPack / SavedUnpack: u8 4 / 5, u32 allocation id (a trace without them
///             hashes as before they existed)
///     Marker: u8 3, u8 marker kind (0 IterationBegin, 1 IterationEnd, 2 PhaseBegin,
///             3 PhaseEnd), then u8 0 (no label) | u8 1, u64 length, label bytes
///             (| u8 2, u32 index for a label index out of range: invalid traces only)
/// only when the trace has restore links (so a trace without them hashes as before):
///   "restores\0", u64 number of links, per link in order: u32 from, u32 into
/// ```
///
/// Included: what the planner plans from (sizes, streams, the event sequence,
/// markers with their label text, the restore links: under a budget the planner
/// plans the run they un-offload, so two traces differing only in links plan
/// differently). Excluded: the device (checked separately, see
/// `plan_file::check_plan_matches`), recorded addresses and time stamps (they differ
/// between otherwise identical runs), the order of the label table and anything
/// about the file encoding. Cost: O(allocations + events + label bytes).
pub fn trace_digest(trace: &Trace) -> u64 {
    let mut h = DigestWriter::new();
    h.bytes(b"stweaver-trace-digest-v1\0");
    h.u64(trace.allocations.len() as u64);
    for a in &trace.allocations {
        h.u64(a.size.get());
        h.u64(a.stream.0);
        h.u8(u8::from(a.preexisting));
    }
    h.u64(trace.events.len() as u64);
    for e in &trace.events {
        match e.kind {
            EventKind::Alloc(id) => {
                h.u8(0);
                h.u32(id.0);
            }
            EventKind::FreeRequested(id) => {
                h.u8(1);
                h.u32(id.0);
            }
            EventKind::FreeCompleted(id) => {
                h.u8(2);
                h.u32(id.0);
            }
            EventKind::SavedPack(id) => {
                h.u8(4);
                h.u32(id.0);
            }
            EventKind::SavedUnpack(id) => {
                h.u8(5);
                h.u32(id.0);
            }
            EventKind::Marker { kind, label } => {
                h.u8(3);
                h.u8(marker_code(kind).0);
                match label.map(|l| (l, trace.labels.get(l as usize))) {
                    None => h.u8(0),
                    Some((_, Some(text))) => {
                        h.u8(1);
                        h.u64(text.len() as u64);
                        h.bytes(text.as_bytes());
                    }
                    Some((l, None)) => {
                        h.u8(2);
                        h.u32(l);
                    }
                }
            }
        }
    }
    if !trace.restores.is_empty() {
        h.bytes(b"restores\0");
        h.u64(trace.restores.len() as u64);
        for r in &trace.restores {
            h.u32(r.from.0);
            h.u32(r.into.0);
        }
    }
    h.finish()
}

/// Batches the digest's many small writes (a few bytes each) into one
/// `Xxh3::update` per 4 KiB; the result is the same as hashing the whole string.
struct DigestWriter {
    hasher: xxhash_rust::xxh3::Xxh3,
    buf: [u8; 4096],
    len: usize,
}

impl DigestWriter {
    fn new() -> Self {
        DigestWriter {
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            buf: [0; 4096],
            len: 0,
        }
    }

    fn bytes(&mut self, mut b: &[u8]) {
        while !b.is_empty() {
            if self.len == self.buf.len() {
                self.hasher.update(&self.buf);
                self.len = 0;
            }
            let n = b.len().min(self.buf.len() - self.len);
            self.buf[self.len..self.len + n].copy_from_slice(&b[..n]);
            self.len += n;
            b = &b[n..];
        }
    }

    fn u8(&mut self, v: u8) {
        self.bytes(&[v]);
    }

    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }

    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }

    fn finish(mut self) -> u64 {
        self.hasher.update(&self.buf[..self.len]);
        self.hasher.digest()
    }
}

/// A failure before we know which path to blame.
enum Failure {
    Format(FormatError),
    Invalid(TraceError),
}

impl Failure {
    fn at(self, path: &Path) -> TraceFileError {
        let path = path.to_path_buf();
        match self {
            Failure::Format(error) => TraceFileError::Format { path, error },
            Failure::Invalid(error) => TraceFileError::Invalid { path, error },
        }
    }
}

impl From<FormatError> for Failure {
    fn from(e: FormatError) -> Self {
        Failure::Format(e)
    }
}

fn marker_code(kind: MarkerKind) -> fb::MarkerKind {
    match kind {
        MarkerKind::IterationBegin => fb::MarkerKind::IterationBegin,
        MarkerKind::IterationEnd => fb::MarkerKind::IterationEnd,
        MarkerKind::PhaseBegin => fb::MarkerKind::PhaseBegin,
        MarkerKind::PhaseEnd => fb::MarkerKind::PhaseEnd,
    }
}

fn encode(trace: &Trace) -> Result<Vec<u8>, Failure> {
    trace.validate().map_err(Failure::Invalid)?;
    // The builder panics past 2 GiB; refuse before that with an error.
    let labels_bytes: u64 = trace.labels.iter().map(|l| l.len() as u64 + 8).sum::<u64>();
    let estimated = 256
        + 32 * trace.allocations.len() as u64
        + 16 * trace.events.len() as u64
        + 4 * trace.labels.len() as u64
        + 8 * trace.restores.len() as u64
        + labels_bytes;
    if estimated >= MAX_BUFFER {
        return Err(FormatError::TooLarge { estimated }.into());
    }

    let mut fbb = FlatBufferBuilder::with_capacity(estimated as usize);
    let labels: Vec<_> = trace.labels.iter().map(|l| fbb.create_string(l)).collect();
    let labels = fbb.create_vector(&labels);
    let restores = (!trace.restores.is_empty()).then(|| {
        fbb.create_vector_from_iter(
            trace
                .restores
                .iter()
                .map(|r| fb::RestoreRec::new(r.from.0, r.into.0)),
        )
    });
    let events = fbb.create_vector_from_iter(trace.events.iter().map(|e| {
        let (kind, marker, arg) = match e.kind {
            EventKind::Alloc(id) => (fb::EventKind::Alloc, fb::MarkerKind(0), id.0),
            EventKind::FreeRequested(id) => (fb::EventKind::FreeRequested, fb::MarkerKind(0), id.0),
            EventKind::FreeCompleted(id) => (fb::EventKind::FreeCompleted, fb::MarkerKind(0), id.0),
            EventKind::SavedPack(id) => (fb::EventKind::SavedPack, fb::MarkerKind(0), id.0),
            EventKind::SavedUnpack(id) => (fb::EventKind::SavedUnpack, fb::MarkerKind(0), id.0),
            EventKind::Marker { kind, label } => (
                fb::EventKind::Marker,
                marker_code(kind),
                label.unwrap_or(NO_LABEL),
            ),
        };
        fb::EventRec::new(e.time_us, arg, kind, marker)
    }));
    let allocations = fbb.create_vector_from_iter(trace.allocations.iter().map(|a| {
        let flags = if a.preexisting { FLAG_PREEXISTING } else { 0 };
        fb::AllocationRec::new(a.size.get(), a.stream.0, a.addr, flags)
    }));
    let name = fbb.create_string(PRODUCER_NAME);
    let version = fbb.create_string(PRODUCER_VERSION);
    let producer = fb::Producer::create(
        &mut fbb,
        &fb::ProducerArgs {
            name: Some(name),
            version: Some(version),
        },
    );
    let root = fb::TraceFile::create(
        &mut fbb,
        &fb::TraceFileArgs {
            format_version: FORMAT_VERSION,
            producer: Some(producer),
            device: trace.device.0,
            allocations: Some(allocations),
            events: Some(events),
            labels: Some(labels),
            restores,
        },
    );
    fb::finish_size_prefixed_trace_file_buffer(&mut fbb, root);
    Ok(fbb.finished_data().to_vec())
}

fn decode(buf: &[u8]) -> Result<Trace, Failure> {
    file_format::check_envelope(buf, KIND)?;
    let opts = file_format::verifier_options(buf.len());
    let tf = fb::size_prefixed_root_as_trace_file_with_opts(&opts, buf)
        .map_err(|e| FormatError::Verifier(file_format::verifier_message(&e)))?;
    let version = tf.format_version();
    if !READ_VERSIONS.contains(&version) {
        let producer = tf.producer();
        return Err(FormatError::UnsupportedVersion {
            found: version,
            supported: READ_VERSIONS,
            producer: file_format::producer_text(
                producer.and_then(|p| p.name()),
                producer.and_then(|p| p.version()),
            ),
        }
        .into());
    }

    let bad = |table: &'static str, index: usize, problem: String| {
        Failure::Format(FormatError::BadRecord {
            table,
            index,
            problem,
        })
    };
    let recs = tf.allocations();
    let mut allocations = Vec::with_capacity(recs.len());
    for (i, r) in recs.iter().enumerate() {
        let flags = r.flags();
        if flags & !FLAG_PREEXISTING != 0 {
            return Err(bad(
                "allocation",
                i,
                format!("unknown flag bits {flags:#04x}"),
            ));
        }
        allocations.push(Allocation {
            size: Bytes(r.bytes()),
            stream: StreamId(r.stream()),
            addr: r.addr(),
            preexisting: flags & FLAG_PREEXISTING != 0,
        });
    }

    let recs = tf.events();
    let mut events = Vec::with_capacity(recs.len());
    for (i, r) in recs.iter().enumerate() {
        let (kind, marker, arg) = (r.kind(), r.marker(), r.arg());
        let kind = match kind {
            fb::EventKind::Alloc
            | fb::EventKind::FreeRequested
            | fb::EventKind::FreeCompleted
            | fb::EventKind::SavedPack
            | fb::EventKind::SavedUnpack
                if marker.0 != 0 =>
            {
                return Err(bad(
                    "event",
                    i,
                    format!("a {kind:?} event with marker kind {}", marker.0),
                ));
            }
            fb::EventKind::Alloc => EventKind::Alloc(AllocId(arg)),
            fb::EventKind::FreeRequested => EventKind::FreeRequested(AllocId(arg)),
            fb::EventKind::FreeCompleted => EventKind::FreeCompleted(AllocId(arg)),
            fb::EventKind::SavedPack | fb::EventKind::SavedUnpack if version < 2 => {
                return Err(bad(
                    "event",
                    i,
                    format!("a {kind:?} event in a version-{version} file (it needs version 2)"),
                ));
            }
            fb::EventKind::SavedPack => EventKind::SavedPack(AllocId(arg)),
            fb::EventKind::SavedUnpack => EventKind::SavedUnpack(AllocId(arg)),
            fb::EventKind::Marker => EventKind::Marker {
                kind: match marker {
                    fb::MarkerKind::IterationBegin => MarkerKind::IterationBegin,
                    fb::MarkerKind::IterationEnd => MarkerKind::IterationEnd,
                    fb::MarkerKind::PhaseBegin => MarkerKind::PhaseBegin,
                    fb::MarkerKind::PhaseEnd => MarkerKind::PhaseEnd,
                    other => {
                        return Err(bad("event", i, format!("unknown marker kind {}", other.0)));
                    }
                },
                label: (arg != NO_LABEL).then_some(arg),
            },
            other => return Err(bad("event", i, format!("unknown event kind {}", other.0))),
        };
        events.push(Event {
            kind,
            time_us: r.time_us(),
        });
    }

    let labels = tf
        .labels()
        .map(|v| v.iter().map(str::to_owned).collect())
        .unwrap_or_default();

    let trace = Trace {
        device: DeviceId(tf.device()),
        allocations,
        events,
        labels,
        restores: tf
            .restores()
            .map(|v| {
                v.iter()
                    .map(|r| Restore {
                        from: AllocId(r.from_alloc()),
                        into: AllocId(r.into_alloc()),
                    })
                    .collect()
            })
            .unwrap_or_default(),
    };
    trace.validate().map_err(Failure::Invalid)?;
    Ok(trace)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Trace {
        Trace {
            device: DeviceId(3),
            allocations: vec![
                Allocation {
                    size: Bytes(4096),
                    stream: StreamId(0),
                    addr: 0x7f00_0000_0000,
                    preexisting: true,
                },
                Allocation {
                    size: Bytes(512),
                    stream: StreamId(0x5555_0000),
                    addr: 0,
                    preexisting: false,
                },
            ],
            events: vec![
                Event {
                    kind: EventKind::Marker {
                        kind: MarkerKind::IterationBegin,
                        label: Some(0),
                    },
                    time_us: 1,
                },
                Event {
                    kind: EventKind::Alloc(AllocId(1)),
                    time_us: 2,
                },
                Event {
                    kind: EventKind::Marker {
                        kind: MarkerKind::PhaseEnd,
                        label: None,
                    },
                    time_us: 3,
                },
            ],
            labels: vec!["step".into()],
            restores: Vec::new(),
        }
    }

    #[test]
    fn bytes_round_trip() {
        let t = small();
        let b = trace_to_bytes(&t).unwrap();
        assert_eq!(&b[8..12], b"STWT");
        assert_eq!(trace_from_bytes(&b).unwrap(), t);
    }

    #[test]
    fn digest_ignores_device_addresses_times_and_label_order() {
        let t = small();
        let d = trace_digest(&t);
        let mut u = t.clone();
        u.device = DeviceId(0);
        u.allocations[0].addr = 1;
        for e in &mut u.events {
            e.time_us += 1000;
        }
        u.labels.insert(0, "unused".into());
        u.events[0].kind = EventKind::Marker {
            kind: MarkerKind::IterationBegin,
            label: Some(1),
        };
        assert_eq!(trace_digest(&u), d);

        let mut v = t.clone();
        v.allocations[1].size = Bytes(513);
        assert_ne!(trace_digest(&v), d);
        let mut v = t.clone();
        v.allocations[1].stream = StreamId(7);
        assert_ne!(trace_digest(&v), d);
        let mut v = t.clone();
        v.labels[0] = "stop".into();
        assert_ne!(trace_digest(&v), d);
        let mut v = t;
        v.events.swap(0, 2);
        assert_ne!(trace_digest(&v), d);
    }

    #[test]
    fn digest_is_pinned() {
        // The digest is a file-format commitment (plans carry it): this value must
        // not change. It was computed by this implementation and cross-checked with
        // Python's `xxhash.xxh3_64` over the same byte string.
        assert_eq!(trace_digest(&small()), DIGEST_OF_SMALL);
    }

    const DIGEST_OF_SMALL: u64 = 15_170_879_428_575_245_022;

    /// Builds a trace file by hand, so tests can make files our writer refuses to.
    struct Raw<'a> {
        version: u32,
        producer: Option<(&'a str, &'a str)>,
        allocations: Vec<fb::AllocationRec>,
        events: Option<Vec<fb::EventRec>>,
        labels: Vec<&'a str>,
    }

    impl Raw<'_> {
        fn valid() -> Self {
            Raw {
                version: FORMAT_VERSION,
                producer: Some(("stweaver-core", "0.1.0")),
                allocations: vec![fb::AllocationRec::new(64, 0, 0, 0)],
                events: Some(vec![fb::EventRec::new(
                    0,
                    0,
                    fb::EventKind::Alloc,
                    fb::MarkerKind(0),
                )]),
                labels: vec![],
            }
        }

        fn bytes(&self) -> Vec<u8> {
            let mut fbb = FlatBufferBuilder::new();
            let labels: Vec<_> = self.labels.iter().map(|l| fbb.create_string(l)).collect();
            let labels = fbb.create_vector(&labels);
            let events = self.events.as_ref().map(|e| fbb.create_vector(e));
            let allocations = fbb.create_vector(&self.allocations);
            let producer = self.producer.map(|(n, v)| {
                let name = Some(fbb.create_string(n));
                let version = Some(fbb.create_string(v));
                fb::Producer::create(&mut fbb, &fb::ProducerArgs { name, version })
            });
            // Built slot by slot: the generated builder asserts required fields,
            // and we want a file without one.
            let start = fbb.start_table();
            fbb.push_slot::<u32>(fb::TraceFile::VT_FORMAT_VERSION, self.version, 0);
            if let Some(p) = producer {
                fbb.push_slot_always(fb::TraceFile::VT_PRODUCER, p);
            }
            fbb.push_slot_always(fb::TraceFile::VT_ALLOCATIONS, allocations);
            if let Some(e) = events {
                fbb.push_slot_always(fb::TraceFile::VT_EVENTS, e);
            }
            fbb.push_slot_always(fb::TraceFile::VT_LABELS, labels);
            let end = fbb.end_table(start);
            let root = flatbuffers::WIPOffset::<fb::TraceFile>::new(end.value());
            fb::finish_size_prefixed_trace_file_buffer(&mut fbb, root);
            fbb.finished_data().to_vec()
        }
    }

    fn format_error(raw: &Raw) -> FormatError {
        match trace_from_bytes(&raw.bytes()) {
            Err(TraceFileError::Format { error, .. }) => error,
            other => panic!("expected a format error, got {other:?}"),
        }
    }

    #[test]
    fn hand_built_valid_file_reads() {
        let t = trace_from_bytes(&Raw::valid().bytes()).unwrap();
        assert_eq!(t.allocations.len(), 1);
        assert_eq!(t.events.len(), 1);
    }

    #[test]
    fn other_versions_are_refused_naming_the_producer() {
        let mut raw = Raw::valid();
        raw.version = 3;
        raw.producer = Some(("stweaver-core", "9.9.9"));
        let e = format_error(&raw);
        assert_eq!(
            e,
            FormatError::UnsupportedVersion {
                found: 3,
                supported: &[1, 2],
                producer: "stweaver-core 9.9.9".into()
            }
        );
        assert!(
            e.to_string().contains("version 3") && e.to_string().contains("versions 1 and 2"),
            "{e}"
        );
        raw.version = 0;
        raw.producer = None;
        assert!(matches!(
            format_error(&raw),
            FormatError::UnsupportedVersion { found: 0, .. }
        ));
    }

    fn saved_events() -> Vec<fb::EventRec> {
        vec![
            fb::EventRec::new(5, 0, fb::EventKind::Alloc, fb::MarkerKind(0)),
            fb::EventRec::new(6, 0, fb::EventKind::SavedPack, fb::MarkerKind(0)),
            fb::EventRec::new(7, 0, fb::EventKind::SavedUnpack, fb::MarkerKind(0)),
        ]
    }

    /// `small()` plus an offloaded allocation and its copy back, linked.
    fn with_link() -> Trace {
        let mut t = small();
        t.allocations.push(t.allocations[1]);
        t.allocations.push(t.allocations[1]);
        for kind in [
            EventKind::Alloc(AllocId(2)),
            EventKind::SavedPack(AllocId(2)),
            EventKind::FreeRequested(AllocId(2)),
            EventKind::Alloc(AllocId(3)),
            EventKind::SavedUnpack(AllocId(3)),
        ] {
            t.events.push(Event { kind, time_us: 9 });
        }
        t.restores.push(Restore {
            from: AllocId(2),
            into: AllocId(3),
        });
        t
    }

    #[test]
    fn restore_links_round_trip_and_files_without_them_load() {
        let t = with_link();
        let b = trace_to_bytes(&t).unwrap();
        assert_eq!(trace_from_bytes(&b).unwrap(), t);
        let tf = fb::size_prefixed_root_as_trace_file(&b).unwrap();
        assert_eq!(tf.format_version(), 2);
        assert_eq!(tf.restores().map(|r| r.len()), Some(1));
        // Without links no vector is written; files of version 1 and 2 without one load
        // with no links.
        let mut plain = t.clone();
        plain.restores.clear();
        let pb = trace_to_bytes(&plain).unwrap();
        assert!(
            fb::size_prefixed_root_as_trace_file(&pb)
                .unwrap()
                .restores()
                .is_none()
        );
        for version in [1, 2] {
            let raw = Raw {
                version,
                ..Raw::valid()
            };
            assert!(trace_from_bytes(&raw.bytes()).unwrap().restores.is_empty());
        }
        // A bad link is refused when written and when read.
        let mut bad = t.clone();
        bad.restores[0] = Restore {
            from: AllocId(3),
            into: AllocId(2),
        };
        assert!(matches!(
            trace_to_bytes(&bad),
            Err(TraceFileError::Invalid {
                error: TraceError::RestoreOrder { .. },
                ..
            })
        ));
        let mut fbb = FlatBufferBuilder::new();
        let allocations = fbb.create_vector_from_iter(bad.allocations.iter().map(|a| {
            fb::AllocationRec::new(a.size.get(), a.stream.0, a.addr, u8::from(a.preexisting))
        }));
        let events = fbb.create_vector_from_iter(bad.events.iter().map(|e| {
            let (kind, arg) = match e.kind {
                EventKind::Alloc(id) => (fb::EventKind::Alloc, id.0),
                EventKind::FreeRequested(id) => (fb::EventKind::FreeRequested, id.0),
                EventKind::SavedPack(id) => (fb::EventKind::SavedPack, id.0),
                EventKind::SavedUnpack(id) => (fb::EventKind::SavedUnpack, id.0),
                EventKind::Marker { .. } => (fb::EventKind::Marker, NO_LABEL),
                EventKind::FreeCompleted(_) => unreachable!("none in this trace"),
            };
            let marker = match e.kind {
                EventKind::Marker { kind, .. } => marker_code(kind),
                _ => fb::MarkerKind(0),
            };
            fb::EventRec::new(e.time_us, arg, kind, marker)
        }));
        let restores = fbb.create_vector(&[fb::RestoreRec::new(3, 2)]);
        let root = fb::TraceFile::create(
            &mut fbb,
            &fb::TraceFileArgs {
                format_version: 2,
                producer: None,
                device: 0,
                allocations: Some(allocations),
                events: Some(events),
                labels: None,
                restores: Some(restores),
            },
        );
        fb::finish_size_prefixed_trace_file_buffer(&mut fbb, root);
        let e = trace_from_bytes(fbb.finished_data()).unwrap_err();
        assert!(
            matches!(
                e,
                TraceFileError::Invalid {
                    error: TraceError::RestoreOrder { .. },
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn links_enter_the_digest_only_when_present() {
        let t = with_link();
        let mut plain = t.clone();
        plain.restores.clear();
        assert_ne!(trace_digest(&t), trace_digest(&plain));
        assert_eq!(trace_digest(&small()), DIGEST_OF_SMALL);
    }

    #[test]
    fn version_1_files_load_and_saved_events_need_version_2() {
        let v1 = Raw {
            version: 1,
            ..Raw::valid()
        };
        let t = trace_from_bytes(&v1.bytes()).unwrap();
        assert_eq!(t.events[0].kind, EventKind::Alloc(AllocId(0)));
        let v2 = Raw {
            events: Some(saved_events()),
            ..Raw::valid()
        };
        let t = trace_from_bytes(&v2.bytes()).unwrap();
        assert_eq!(
            t.events.iter().map(|e| e.kind).collect::<Vec<_>>(),
            vec![
                EventKind::Alloc(AllocId(0)),
                EventKind::SavedPack(AllocId(0)),
                EventKind::SavedUnpack(AllocId(0))
            ]
        );
        // Written back: version 2, same trace.
        assert_eq!(trace_from_bytes(&trace_to_bytes(&t).unwrap()).unwrap(), t);
        let v1_with_saved = Raw {
            version: 1,
            events: Some(saved_events()),
            ..Raw::valid()
        };
        let e = format_error(&v1_with_saved);
        assert!(e.to_string().contains("needs version 2"), "{e}");
    }

    #[test]
    fn saved_events_change_the_digest_and_old_digests_stay() {
        let mut t = small();
        let d = trace_digest(&t);
        t.events.push(Event {
            kind: EventKind::SavedPack(AllocId(1)),
            time_us: 4,
        });
        let packed = trace_digest(&t);
        assert_ne!(packed, d);
        t.events.last_mut().unwrap().kind = EventKind::SavedUnpack(AllocId(1));
        assert_ne!(trace_digest(&t), packed);
        assert_ne!(trace_digest(&t), d);
    }

    #[test]
    fn an_empty_event_list_is_refused() {
        let mut raw = Raw::valid();
        raw.allocations.clear();
        raw.events = Some(vec![]);
        match trace_from_bytes(&raw.bytes()) {
            Err(TraceFileError::Invalid { error, .. }) => assert_eq!(error, TraceError::Empty),
            other => panic!("expected an invalid-trace error, got {other:?}"),
        }
    }

    #[test]
    fn a_missing_required_vector_is_a_verifier_error() {
        let mut raw = Raw::valid();
        raw.events = None;
        let e = format_error(&raw);
        assert!(
            matches!(&e, FormatError::Verifier(m) if m.contains("events")),
            "{e}"
        );
    }

    #[test]
    fn unknown_kinds_and_flags_are_bad_records() {
        let ev = |kind: u8, marker: u8, arg: u32| {
            fb::EventRec::new(0, arg, fb::EventKind(kind), fb::MarkerKind(marker))
        };
        let cases: Vec<(Raw, &str)> = vec![
            (
                Raw {
                    events: Some(vec![ev(0, 0, 0), ev(7, 0, 0)]),
                    ..Raw::valid()
                },
                "unknown event kind 7",
            ),
            (
                Raw {
                    events: Some(vec![ev(0, 0, 0), ev(3, 9, NO_LABEL)]),
                    ..Raw::valid()
                },
                "unknown marker kind 9",
            ),
            (
                Raw {
                    events: Some(vec![ev(0, 2, 0)]),
                    ..Raw::valid()
                },
                "marker kind 2",
            ),
            (
                Raw {
                    allocations: vec![fb::AllocationRec::new(64, 0, 0, 0x82)],
                    ..Raw::valid()
                },
                "unknown flag bits 0x82",
            ),
        ];
        for (raw, want) in cases {
            let e = format_error(&raw);
            assert!(
                matches!(e, FormatError::BadRecord { .. }) && e.to_string().contains(want),
                "{e} should mention {want:?}"
            );
        }
    }

    #[test]
    fn structural_errors_surface_as_invalid_traces() {
        let raw = Raw {
            events: Some(vec![
                fb::EventRec::new(0, 0, fb::EventKind::Alloc, fb::MarkerKind(0)),
                fb::EventRec::new(0, 5, fb::EventKind::Marker, fb::MarkerKind::PhaseBegin),
            ]),
            ..Raw::valid()
        };
        match trace_from_bytes(&raw.bytes()) {
            Err(TraceFileError::Invalid { error, .. }) => {
                assert!(matches!(error, TraceError::UnknownLabel { label: 5, .. }))
            }
            other => panic!("expected an invalid-trace error, got {other:?}"),
        }
    }
}
