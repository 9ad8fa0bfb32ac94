//! Trace files on disk: round trips, and every kind of bad file is a clear error.

use std::path::Path;

use proptest::prelude::*;
use stweaver_core::file_format::FormatError;
use stweaver_core::trace_file::{
    TraceFileError, read_trace_file, trace_digest, trace_from_bytes, trace_to_bytes,
    write_trace_file,
};
use stweaver_core::{
    AllocId, Allocation, Bytes, DeviceId, Event, EventKind, MarkerKind, StreamId, Trace, TraceError,
};

fn alloc(size: u64, stream: u64, preexisting: bool) -> Allocation {
    Allocation {
        size: Bytes(size),
        stream: StreamId(stream),
        addr: 0x7f3a_0000_0000 + size,
        preexisting,
    }
}

fn ev(kind: EventKind, time_us: u64) -> Event {
    Event { kind, time_us }
}

/// Preexisting allocations (one freed, one never), never-freed allocations, both
/// kinds of free, markers with and without labels, three streams.
fn rich() -> Trace {
    use EventKind::*;
    Trace {
        device: DeviceId(1),
        allocations: vec![
            alloc(1 << 30, 0, true),
            alloc(4096, 0, true),
            alloc(512, 0, false),
            alloc(2 << 20, 0x5601_2345_6000, false),
            alloc(1000, 0x5601_2345_7000, false),
            alloc(77, 0, false),
        ],
        events: vec![
            ev(
                Marker {
                    kind: MarkerKind::IterationBegin,
                    label: Some(1),
                },
                1_700_000_000_000_000,
            ),
            ev(Alloc(AllocId(2)), 1_700_000_000_000_010),
            ev(Alloc(AllocId(3)), 1_700_000_000_000_020),
            ev(FreeRequested(AllocId(3)), 1_700_000_000_000_030),
            ev(Alloc(AllocId(4)), 1_700_000_000_000_040),
            ev(
                Marker {
                    kind: MarkerKind::PhaseBegin,
                    label: None,
                },
                0,
            ),
            ev(FreeCompleted(AllocId(3)), 1_700_000_000_000_050),
            ev(FreeRequested(AllocId(1)), 1_700_000_000_000_060),
            ev(FreeCompleted(AllocId(2)), 1_700_000_000_000_070),
            ev(Alloc(AllocId(5)), 1_700_000_000_000_080),
            ev(
                Marker {
                    kind: MarkerKind::PhaseEnd,
                    label: Some(0),
                },
                1_700_000_000_000_090,
            ),
            ev(
                Marker {
                    kind: MarkerKind::IterationEnd,
                    label: Some(1),
                },
                1_700_000_000_000_100,
            ),
        ],
        labels: vec!["backward".into(), "Optimizer.step#AdamW.step".into()],
        restores: Vec::new(),
    }
}

fn format_error(r: Result<Trace, TraceFileError>) -> FormatError {
    match r {
        Err(TraceFileError::Format { error, .. }) => error,
        other => panic!("expected a format error, got {other:?}"),
    }
}

#[test]
fn file_round_trip_is_identical() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rich.stwt");
    let t = rich();
    t.validate().unwrap();
    write_trace_file(&path, &t).unwrap();
    let back = read_trace_file(&path).unwrap();
    assert_eq!(back, t);
    assert_eq!(back.lower_bound(), t.lower_bound());
    assert_eq!(trace_digest(&back), trace_digest(&t));
    // Overwriting works and leaves no temporary file behind.
    write_trace_file(&path, &t).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn writing_refuses_an_invalid_trace_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.stwt");
    let mut t = rich();
    t.events.push(ev(EventKind::Alloc(AllocId(2)), 0)); // allocated twice
    let e = write_trace_file(&path, &t).unwrap_err();
    assert!(
        matches!(
            &e,
            TraceFileError::Invalid {
                error: TraceError::DoubleAlloc { .. },
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("bad.stwt"), "{e}");
    assert!(!path.exists());
    let e = write_trace_file(&path, &Trace::default()).unwrap_err();
    assert!(matches!(
        e,
        TraceFileError::Invalid {
            error: TraceError::Empty,
            ..
        }
    ));
}

#[test]
fn empty_file_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.stwt");
    std::fs::write(&path, b"").unwrap();
    let r = read_trace_file(&path);
    let msg = r.as_ref().unwrap_err().to_string();
    assert!(msg.contains("empty.stwt") && msg.contains("empty"), "{msg}");
    assert_eq!(format_error(r), FormatError::Empty);
}

#[test]
fn missing_file_and_directory_are_read_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.stwt");
    let e = read_trace_file(&missing).unwrap_err();
    assert!(matches!(e, TraceFileError::Read { .. }), "{e}");
    assert!(e.to_string().contains("nope.stwt"), "{e}");
    assert_eq!(e.path(), missing.as_path());
    let e = read_trace_file(dir.path()).unwrap_err();
    assert!(matches!(e, TraceFileError::Read { .. }), "{e}");
}

#[test]
fn every_truncation_is_an_error_and_long_ones_say_truncated() {
    let bytes = trace_to_bytes(&rich()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.stwt");
    for len in 0..bytes.len() {
        let e = format_error(trace_from_bytes(&bytes[..len]));
        match len {
            0 => assert_eq!(e, FormatError::Empty),
            1..12 => assert!(matches!(e, FormatError::TooShort { .. }), "{len}: {e}"),
            _ => assert!(
                matches!(e, FormatError::Truncated { declared, available }
                    if declared == bytes.len() as u64 - 4 && available == len as u64 - 4),
                "{len}: {e}"
            ),
        }
    }
    // The same through a file, with the file named.
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = read_trace_file(&path).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("cut.stwt") && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn trailing_bytes_are_refused() {
    let mut bytes = trace_to_bytes(&rich()).unwrap();
    bytes.extend_from_slice(&[0; 8]);
    assert!(matches!(
        format_error(trace_from_bytes(&bytes)),
        FormatError::TrailingBytes { extra: 8, .. }
    ));
}

#[test]
fn wrong_identifiers_are_named() {
    let mut bytes = trace_to_bytes(&rich()).unwrap();
    bytes[8..12].copy_from_slice(b"STWP");
    let e = format_error(trace_from_bytes(&bytes));
    assert!(e.to_string().contains("plan file"), "{e}");
    // A gzip'd pickle (what `stweaver convert` takes) is not a trace file.
    let gz = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/traces/snap_llama1b_rcp.pickle.gz"
    ))
    .unwrap();
    let e = format_error(trace_from_bytes(&gz));
    assert!(
        matches!(e, FormatError::WrongIdentifier { .. }),
        "{e} should be a wrong identifier"
    );
}

/// Flips every byte of a valid file, one at a time, in three ways. Nothing may
/// panic; a flip that still decodes must decode to a valid trace.
#[test]
fn every_corrupted_byte_is_an_error_or_a_valid_trace() {
    let bytes = trace_to_bytes(&rich()).unwrap();
    let mut errors = 0;
    for i in 0..bytes.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[i] ^= mask;
            match trace_from_bytes(&b) {
                Ok(t) => t.validate().unwrap(),
                Err(e) => {
                    errors += 1;
                    assert!(!e.to_string().is_empty());
                }
            }
        }
    }
    // Most flips land in sizes, streams and time stamps and still decode; many
    // do not. Both must occur, or this test is not testing anything.
    assert!(errors > 0 && errors < 3 * bytes.len(), "{errors} errors");
}

#[test]
fn the_digest_survives_the_file() {
    let t = rich();
    let back = trace_from_bytes(&trace_to_bytes(&t).unwrap()).unwrap();
    assert_eq!(trace_digest(&t), trace_digest(&back));
    let mut other = t.clone();
    other.allocations[5].size = Bytes(78);
    assert_ne!(trace_digest(&t), trace_digest(&other));
}

/// A random valid trace from a list of operations.
fn arb_trace() -> impl Strategy<Value = Trace> {
    let op = (0u8..6, 1u64..1 << 40, 0u64..3, any::<u64>());
    (
        -1i32..8,
        prop::collection::vec(op, 1..200),
        prop::collection::vec("[a-zA-Z.#_ ]{0,12}", 0..4),
        0usize..4,
    )
        .prop_map(|(device, ops, labels, n_pre)| {
            let mut t = Trace {
                device: DeviceId(device),
                labels,
                ..Trace::default()
            };
            // live: allocated, free not requested; requested: awaiting completion.
            let mut live: Vec<u32> = Vec::new();
            let mut requested: Vec<u32> = Vec::new();
            for i in 0..n_pre {
                t.allocations.push(alloc(1 + i as u64, 0, true));
                live.push(i as u32);
            }
            for (op, size, stream, time) in ops {
                let kind = match op {
                    0 | 1 => {
                        let id = t.allocations.len() as u32;
                        t.allocations.push(Allocation {
                            size: Bytes(size),
                            stream: StreamId(stream * 0x1000),
                            addr: size.wrapping_mul(7),
                            preexisting: false,
                        });
                        live.push(id);
                        EventKind::Alloc(AllocId(id))
                    }
                    2 if !live.is_empty() => {
                        let id = live.swap_remove(size as usize % live.len());
                        requested.push(id);
                        EventKind::FreeRequested(AllocId(id))
                    }
                    3 if !requested.is_empty() => {
                        let id = requested.swap_remove(size as usize % requested.len());
                        EventKind::FreeCompleted(AllocId(id))
                    }
                    4 if !live.is_empty() => {
                        // Completed without a separate request.
                        let id = live.swap_remove(size as usize % live.len());
                        EventKind::FreeCompleted(AllocId(id))
                    }
                    _ => EventKind::Marker {
                        kind: [
                            MarkerKind::IterationBegin,
                            MarkerKind::IterationEnd,
                            MarkerKind::PhaseBegin,
                            MarkerKind::PhaseEnd,
                        ][stream as usize],
                        label: (!t.labels.is_empty() && size % 3 != 0)
                            .then(|| (size % t.labels.len() as u64) as u32),
                    },
                };
                t.events.push(Event {
                    kind,
                    time_us: time,
                });
            }
            t
        })
}

proptest! {
    #[test]
    fn random_traces_round_trip(t in arb_trace()) {
        t.validate().unwrap();
        let bytes = trace_to_bytes(&t).unwrap();
        let back = trace_from_bytes(&bytes).unwrap();
        prop_assert_eq!(trace_digest(&back), trace_digest(&t));
        prop_assert_eq!(back, t);
    }
}

#[test]
fn error_paths_name_the_in_memory_buffer() {
    let e = trace_from_bytes(b"").unwrap_err();
    assert_eq!(e.path(), Path::new("<in-memory buffer>"));
}
