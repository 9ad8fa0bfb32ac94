//! The plan file (`.stwp`): a [`Plan`] on disk.
//!
//! Format: a size-prefixed FlatBuffer with identifier `STWP` (the envelope and the
//! order of checks are in [`crate::file_format`]); schema `crates/core/schema/plan.fbs`,
//! Rust in `plan_generated.rs` (made by `cargo xtask codegen`, never edited by hand).
//! The root table holds the format version ([`FORMAT_VERSION`]), the producer, the
//! device, alignment, pool size, lower bound, the digest of the trace the plan was
//! made from ([`crate::trace_file::trace_digest`]), the prologue and iteration request
//! sequences as 40-byte structs `{bytes, stream, offset, start, end}` with their
//! clock lengths, and the dynamic summary. Version 2 adds the budget (0: none), the
//! offload schedule (32-byte structs `{bytes, pack, unpack, prefetch_after_unpack,
//! out_request, back_request}`, `0xFFFF_FFFF` for no trigger) and the saved-tensor
//! event counts per iteration. Version 3 adds the other iteration classes (`classes`: a
//! vector of tables `{requests, len}`, [`Plan::extra_classes`]). Version-1 and -2 files
//! still load (no budget, no offload; one iteration class), other versions are refused naming the version found and those read ([`READ_VERSIONS`]).
//!
//! Reading ([`read_plan_file`], [`plan_from_bytes`]) maps the file, checks the
//! envelope, runs the FlatBuffers verifier once (O(tables): each struct vector is one
//! bounds check), checks the version, decodes the requests (O(requests)) and then runs
//! the plan verifier, [`crate::verify::verify_plan`] (alignment, bounds, lifetimes and
//! no overlap in address × time on the unrolled timeline; its module docs give the
//! cost). A plan that loads is therefore safe to serve as a value (invariant 7):
//! nothing downstream re-checks it. Writing verifies too, so an invalid plan is never
//! written. Whether a loaded plan belongs to *this* run is a separate question,
//! answered by [`check_plan_matches`] (device and trace digest).

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
mod plan_generated;

use std::path::{Path, PathBuf};

use flatbuffers::FlatBufferBuilder;
use plan_generated::stweaver::plan_fb as fb;

use crate::file_format::{
    self, FileKind, FormatError, IN_MEMORY, MAX_BUFFER, PRODUCER_NAME, PRODUCER_VERSION,
};
use crate::plan::{ClassSection, DynamicSummary, OffloadEntry, Plan, PlannedRequest};
use crate::units::{Bytes, DeviceId, Offset, StreamId};
use crate::verify::{PlanViolations, verify_plan};

/// The plan format version this build writes.
pub const FORMAT_VERSION: u32 = 3;

/// The versions this build reads: 1 (no budget, no offload schedule), 2 (adds
/// `budget`, `offload`, `saved_packs`, `saved_unpacks`; nothing else changed) and 3
/// (adds `classes`: a version-2 file is a plan of one iteration class).
pub const READ_VERSIONS: &[u32] = &[1, 2, 3];

/// `OffloadRec.prefetch_after_unpack` for `None`.
const NO_TRIGGER: u32 = u32::MAX;

/// The conventional file extension (without the dot).
pub const EXTENSION: &str = "stwp";

const KIND: FileKind = FileKind {
    name: "plan",
    identifier: "STWP",
};

/// Why a plan file could not be read or written, or does not belong to this run.
/// Every variant but [`PlanFileError::Mismatch`] names the file (`<in-memory buffer>`
/// for [`plan_from_bytes`]).
#[derive(Debug, thiserror::Error)]
pub enum PlanFileError {
    #[error("{}: cannot read the plan file: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: cannot write the plan file: {error}", path.display())]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    /// The bytes are not a readable plan file (wrong identifier, truncated, corrupt,
    /// unsupported version, ...).
    #[error("{}: {error}", path.display())]
    Format { path: PathBuf, error: FormatError },
    /// The file decodes, but the plan verifier rejects the plan (or, when writing,
    /// the plan to write).
    #[error("{}: {error}", path.display())]
    Invalid {
        path: PathBuf,
        error: PlanViolations,
    },
    /// A valid plan, but made for another device or from another trace
    /// ([`check_plan_matches`]).
    #[error("{}", mismatch_message(*plan_device, *expected_device, *plan_digest, *expected_digest))]
    Mismatch {
        plan_device: DeviceId,
        expected_device: DeviceId,
        plan_digest: u64,
        expected_digest: u64,
    },
}

impl PlanFileError {
    /// The file the error is about (`None` for a mismatch, which is about a value).
    pub fn path(&self) -> Option<&Path> {
        match self {
            PlanFileError::Read { path, .. }
            | PlanFileError::Write { path, .. }
            | PlanFileError::Format { path, .. }
            | PlanFileError::Invalid { path, .. } => Some(path),
            PlanFileError::Mismatch { .. } => None,
        }
    }
}

fn mismatch_message(
    plan_device: DeviceId,
    expected_device: DeviceId,
    plan_digest: u64,
    expected_digest: u64,
) -> String {
    let mut parts = Vec::new();
    if plan_device != expected_device {
        parts.push(format!(
            "it was made for {plan_device}, this is {expected_device}"
        ));
    }
    if plan_digest != expected_digest {
        parts.push(format!(
            "it was made from trace {plan_digest:#018x}, this workload's trace is {expected_digest:#018x}"
        ));
    }
    format!("the plan does not match: {}", parts.join("; "))
}

/// Checks that `plan` was made for `device` from the trace whose
/// [`trace_digest`](crate::trace_file::trace_digest) is `trace_digest`; a
/// [`PlanFileError::Mismatch`] naming what differs otherwise.
pub fn check_plan_matches(
    plan: &Plan,
    device: DeviceId,
    trace_digest: u64,
) -> Result<(), PlanFileError> {
    if plan.device == device && plan.trace_digest == trace_digest {
        Ok(())
    } else {
        Err(PlanFileError::Mismatch {
            plan_device: plan.device,
            expected_device: device,
            plan_digest: plan.trace_digest,
            expected_digest: trace_digest,
        })
    }
}

/// Writes `plan` to `path` (atomically: a temporary sibling renamed over it). The
/// plan is verified first: an invalid plan is refused, not written.
pub fn write_plan_file(path: &Path, plan: &Plan) -> Result<(), PlanFileError> {
    let bytes = encode(plan).map_err(|e| e.at(path))?;
    file_format::write_atomically(path, &bytes).map_err(|error| PlanFileError::Write {
        path: path.to_path_buf(),
        error,
    })
}

/// Encodes `plan` into the bytes of a plan file (verifying it first).
pub fn plan_to_bytes(plan: &Plan) -> Result<Vec<u8>, PlanFileError> {
    encode(plan).map_err(|e| e.at(Path::new(IN_MEMORY)))
}

/// Reads the plan file at `path` and verifies the plan (see the module docs).
pub fn read_plan_file(path: &Path) -> Result<Plan, PlanFileError> {
    file_format::with_file_bytes(path, decode)
        .map_err(|error| PlanFileError::Read {
            path: path.to_path_buf(),
            error,
        })?
        .map_err(|e| e.at(path))
}

/// Decodes and verifies a plan file held in memory (all of `bytes`).
pub fn plan_from_bytes(bytes: &[u8]) -> Result<Plan, PlanFileError> {
    decode(bytes).map_err(|e| e.at(Path::new(IN_MEMORY)))
}

/// A failure before we know which path to blame.
enum Failure {
    Format(FormatError),
    Invalid(PlanViolations),
}

impl Failure {
    fn at(self, path: &Path) -> PlanFileError {
        let path = path.to_path_buf();
        match self {
            Failure::Format(error) => PlanFileError::Format { path, error },
            Failure::Invalid(error) => PlanFileError::Invalid { path, error },
        }
    }
}

impl From<FormatError> for Failure {
    fn from(e: FormatError) -> Self {
        Failure::Format(e)
    }
}

fn record(r: &PlannedRequest) -> fb::RequestRec {
    fb::RequestRec::new(r.size.get(), r.stream.0, r.offset.get(), r.start, r.end)
}

fn request(r: &fb::RequestRec) -> PlannedRequest {
    PlannedRequest {
        size: Bytes(r.bytes()),
        stream: StreamId(r.stream()),
        offset: Offset(r.offset()),
        start: r.start(),
        end: r.end(),
    }
}

fn offload_record(o: &OffloadEntry) -> fb::OffloadRec {
    fb::OffloadRec::new(
        o.bytes.get(),
        o.pack,
        o.unpack,
        o.prefetch_after_unpack.unwrap_or(NO_TRIGGER),
        o.out_request,
        o.back_request,
    )
}

fn offload_entry(r: &fb::OffloadRec) -> OffloadEntry {
    OffloadEntry {
        pack: r.pack(),
        unpack: r.unpack(),
        prefetch_after_unpack: (r.prefetch_after_unpack() != NO_TRIGGER)
            .then_some(r.prefetch_after_unpack()),
        bytes: Bytes(r.bytes()),
        out_request: r.out_request(),
        back_request: r.back_request(),
    }
}

fn encode(plan: &Plan) -> Result<Vec<u8>, Failure> {
    verify_plan(plan).map_err(Failure::Invalid)?;
    // The builder panics past 2 GiB; refuse before that with an error.
    let extra: u64 = plan
        .extra_classes
        .iter()
        .map(|c| 64 + 40 * c.requests.len() as u64)
        .sum();
    let estimated = 512
        + 40 * (plan.prologue.len() as u64 + plan.iteration.len() as u64)
        + 32 * plan.offload.len() as u64
        + extra;
    if estimated >= MAX_BUFFER {
        return Err(FormatError::TooLarge { estimated }.into());
    }

    let mut fbb = FlatBufferBuilder::with_capacity(estimated as usize);
    let iteration = fbb.create_vector_from_iter(plan.iteration.iter().map(record));
    let prologue = fbb.create_vector_from_iter(plan.prologue.iter().map(record));
    let offload = fbb.create_vector_from_iter(plan.offload.iter().map(offload_record));
    let classes: Vec<_> = plan
        .extra_classes
        .iter()
        .map(|c| {
            let requests = fbb.create_vector_from_iter(c.requests.iter().map(record));
            fb::ClassRec::create(
                &mut fbb,
                &fb::ClassRecArgs {
                    requests: Some(requests),
                    len: c.len,
                },
            )
        })
        .collect();
    let classes = fbb.create_vector(&classes);
    let name = fbb.create_string(PRODUCER_NAME);
    let version = fbb.create_string(PRODUCER_VERSION);
    let producer = fb::Producer::create(
        &mut fbb,
        &fb::ProducerArgs {
            name: Some(name),
            version: Some(version),
        },
    );
    let dynamic = fb::DynamicSummaryRec::new(plan.dynamic.requests, plan.dynamic.peak_bytes.get());
    let root = fb::PlanFile::create(
        &mut fbb,
        &fb::PlanFileArgs {
            format_version: FORMAT_VERSION,
            producer: Some(producer),
            device: plan.device.0,
            align_bytes: plan.alignment.get(),
            pool_size: plan.pool_size.get(),
            lower_bound: plan.lower_bound.get(),
            trace_digest: plan.trace_digest,
            prologue: Some(prologue),
            prologue_len: plan.prologue_len,
            iteration: Some(iteration),
            iteration_len: plan.iteration_len,
            dynamic: Some(&dynamic),
            budget: plan.budget.map_or(0, Bytes::get),
            offload: Some(offload),
            saved_packs: plan.saved_packs,
            saved_unpacks: plan.saved_unpacks,
            classes: Some(classes),
        },
    );
    fb::finish_size_prefixed_plan_file_buffer(&mut fbb, root);
    Ok(fbb.finished_data().to_vec())
}

fn decode(buf: &[u8]) -> Result<Plan, Failure> {
    file_format::check_envelope(buf, KIND)?;
    let opts = file_format::verifier_options(buf.len());
    let pf = fb::size_prefixed_root_as_plan_file_with_opts(&opts, buf)
        .map_err(|e| FormatError::Verifier(file_format::verifier_message(&e)))?;
    if !READ_VERSIONS.contains(&pf.format_version()) {
        let producer = pf.producer();
        return Err(FormatError::UnsupportedVersion {
            found: pf.format_version(),
            supported: READ_VERSIONS,
            producer: file_format::producer_text(
                producer.and_then(|p| p.name()),
                producer.and_then(|p| p.version()),
            ),
        }
        .into());
    }
    let dynamic = pf
        .dynamic()
        .map_or_else(DynamicSummary::default, |d| DynamicSummary {
            requests: d.requests(),
            peak_bytes: Bytes(d.peak_bytes()),
        });
    let plan = Plan {
        device: DeviceId(pf.device()),
        alignment: Bytes(pf.align_bytes()),
        pool_size: Bytes(pf.pool_size()),
        lower_bound: Bytes(pf.lower_bound()),
        trace_digest: pf.trace_digest(),
        prologue: pf.prologue().iter().map(request).collect(),
        prologue_len: pf.prologue_len(),
        iteration: pf.iteration().iter().map(request).collect(),
        iteration_len: pf.iteration_len(),
        // Versions 1 and 2 have no `classes`: one iteration class.
        extra_classes: pf
            .classes()
            .map(|v| {
                v.iter()
                    .map(|c| ClassSection {
                        requests: c.requests().iter().map(request).collect(),
                        len: c.len(),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        dynamic,
        // Version 1 has none of these fields: they read as absent (0, none).
        budget: (pf.budget() != 0).then_some(Bytes(pf.budget())),
        offload: pf
            .offload()
            .map(|v| v.iter().map(offload_entry).collect())
            .unwrap_or_default(),
        saved_packs: pf.saved_packs(),
        saved_unpacks: pf.saved_unpacks(),
    };
    verify_plan(&plan).map_err(Failure::Invalid)?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::NEVER_FREED;
    use crate::verify::PlanViolation;

    use crate::testkit::planned as req;

    fn small() -> Plan {
        Plan {
            device: DeviceId(0),
            alignment: Bytes(512),
            pool_size: Bytes(4096),
            lower_bound: Bytes(2048),
            trace_digest: 0xfeed,
            prologue: vec![req(1024, 0, 0, NEVER_FREED)],
            prologue_len: 1,
            iteration: vec![req(1000, 1024, 0, 2), req(24, 2048, 1, 3)],
            iteration_len: 4,
            dynamic: DynamicSummary {
                requests: 3,
                peak_bytes: Bytes(99),
            },
            ..Plan::default()
        }
    }

    /// Builds a plan file by hand, so tests can make files our writer refuses to.
    fn raw(version: u32, plan: &Plan, with_iteration: bool) -> Vec<u8> {
        let mut fbb = FlatBufferBuilder::new();
        let prologue = fbb.create_vector_from_iter(plan.prologue.iter().map(record));
        let iteration = fbb.create_vector_from_iter(plan.iteration.iter().map(record));
        let start = fbb.start_table();
        fbb.push_slot::<u32>(fb::PlanFile::VT_FORMAT_VERSION, version, 0);
        fbb.push_slot::<u64>(fb::PlanFile::VT_ALIGN_BYTES, plan.alignment.get(), 0);
        fbb.push_slot::<u64>(fb::PlanFile::VT_POOL_SIZE, plan.pool_size.get(), 0);
        fbb.push_slot::<u64>(fb::PlanFile::VT_PROLOGUE_LEN, plan.prologue_len, 0);
        fbb.push_slot::<u64>(fb::PlanFile::VT_ITERATION_LEN, plan.iteration_len, 0);
        fbb.push_slot_always(fb::PlanFile::VT_PROLOGUE, prologue);
        if with_iteration {
            fbb.push_slot_always(fb::PlanFile::VT_ITERATION, iteration);
        }
        let end = fbb.end_table(start);
        let root = flatbuffers::WIPOffset::<fb::PlanFile>::new(end.value());
        fb::finish_size_prefixed_plan_file_buffer(&mut fbb, root);
        fbb.finished_data().to_vec()
    }

    fn format_error(bytes: &[u8]) -> FormatError {
        match plan_from_bytes(bytes) {
            Err(PlanFileError::Format { error, .. }) => error,
            other => panic!("expected a format error, got {other:?}"),
        }
    }

    #[test]
    fn bytes_round_trip() {
        let p = small();
        let b = plan_to_bytes(&p).unwrap();
        assert_eq!(&b[8..12], b"STWP");
        assert_eq!(plan_from_bytes(&b).unwrap(), p);
    }

    #[test]
    fn hand_built_file_without_producer_or_dynamic_reads() {
        let p = small();
        let back = plan_from_bytes(&raw(FORMAT_VERSION, &p, true)).unwrap();
        assert_eq!(back.prologue, p.prologue);
        assert_eq!(back.iteration, p.iteration);
        assert_eq!(back.dynamic, DynamicSummary::default());
    }

    #[test]
    fn other_versions_are_refused() {
        let e = format_error(&raw(7, &small(), true));
        assert_eq!(
            e,
            FormatError::UnsupportedVersion {
                found: 7,
                supported: READ_VERSIONS,
                producer: "an unnamed producer".into()
            }
        );
    }

    #[test]
    fn version_1_files_load_without_budget_or_offload() {
        // `raw` writes the version-1 layout: none of the version-2 fields.
        let p = small();
        let back = plan_from_bytes(&raw(1, &p, true)).unwrap();
        assert_eq!(back.iteration, p.iteration);
        assert_eq!(back.budget, None);
        assert!(back.offload.is_empty());
        let e = format_error(&raw(4, &p, true));
        assert!(e.to_string().contains("versions 1, 2 and 3"), "{e}");
    }

    #[test]
    fn iteration_classes_round_trip_and_version_2_files_are_one_class() {
        let mut p = small();
        // Class 1 reuses class 0's range: classes never overlap in time.
        let (at, len) = (p.iteration[0].offset.get(), 4);
        p.extra_classes = vec![ClassSection {
            requests: vec![req(700, at, 0, 3), req(100, at + 1024, 1, 2)],
            len,
        }];
        let b = plan_to_bytes(&p).unwrap();
        assert_eq!(plan_from_bytes(&b).unwrap(), p);
        let back = plan_from_bytes(&raw(2, &p, true)).unwrap();
        assert!(back.extra_classes.is_empty());
        assert_eq!(back.iteration, p.iteration);
        // A class request crossing its class's end is refused by the writer.
        p.extra_classes[0].requests[0].end = len + 1;
        assert!(matches!(
            plan_to_bytes(&p),
            Err(PlanFileError::Invalid { .. })
        ));
    }

    #[test]
    fn an_offload_schedule_round_trips() {
        let mut p = small();
        // Request 1 ([1, 3), 24 B) becomes the copy back of request 0's
        // first 24 bytes: both 24 B.
        p.iteration = vec![req(24, 1024, 0, 2), req(24, 2048, 1, 3)];
        p.budget = Some(Bytes(4096));
        p.saved_packs = 3;
        p.saved_unpacks = 2;
        p.offload = vec![OffloadEntry {
            pack: 2,
            unpack: 1,
            prefetch_after_unpack: None,
            bytes: Bytes(24),
            out_request: 0,
            back_request: 1,
        }];
        let b = plan_to_bytes(&p).unwrap();
        assert_eq!(plan_from_bytes(&b).unwrap(), p);
        p.offload[0].prefetch_after_unpack = Some(0);
        let b = plan_to_bytes(&p).unwrap();
        assert_eq!(plan_from_bytes(&b).unwrap(), p);
    }

    #[test]
    fn a_missing_required_vector_is_a_verifier_error() {
        let e = format_error(&raw(FORMAT_VERSION, &small(), false));
        assert!(
            matches!(&e, FormatError::Verifier(m) if m.contains("iteration")),
            "{e}"
        );
    }

    #[test]
    fn an_overlapping_plan_in_a_well_formed_file_is_refused_on_load() {
        let mut p = small();
        p.iteration[1].offset = Offset(1536); // inside request 0's [1024, 2024)
        let bytes = raw(FORMAT_VERSION, &p, true);
        match plan_from_bytes(&bytes) {
            Err(PlanFileError::Invalid { error, .. }) => assert!(
                error
                    .0
                    .iter()
                    .any(|v| matches!(v, PlanViolation::Overlap { .. })),
                "{error}"
            ),
            other => panic!("expected the verifier to refuse, got {other:?}"),
        }
        // And the writer refuses to write it.
        assert!(matches!(
            plan_to_bytes(&p),
            Err(PlanFileError::Invalid { .. })
        ));
    }

    #[test]
    fn mismatch_names_what_differs() {
        let p = small();
        check_plan_matches(&p, DeviceId(0), 0xfeed).unwrap();
        let e = check_plan_matches(&p, DeviceId(1), 0xfeed).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("cuda:0") && msg.contains("cuda:1") && !msg.contains("trace"),
            "{msg}"
        );
        assert!(e.path().is_none());
        let msg = check_plan_matches(&p, DeviceId(0), 0xbeef)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("0x000000000000feed") && msg.contains("0x000000000000beef"),
            "{msg}"
        );
        assert!(!msg.contains("cuda:"), "{msg}");
    }
}
