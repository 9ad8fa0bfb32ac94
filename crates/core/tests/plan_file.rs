//! Plan files on disk: round trips, verification on load, mismatch detection, and
//! every kind of bad file is a clear error.

use proptest::prelude::*;
use stweaver_core::file_format::FormatError;
use stweaver_core::plan_file::{
    PlanFileError, check_plan_matches, plan_from_bytes, plan_to_bytes, read_plan_file,
    write_plan_file,
};
use stweaver_core::verify::{PlanViolation, verify_plan};
use stweaver_core::{
    Bytes, DeviceId, DynamicSummary, NEVER_FREED, Offset, Plan, PlannedRequest, StreamId,
};

/// A planned request (argument order of the calls below; the kit's is size, offset,
/// times, stream).
fn req(size: u64, stream: u64, offset: u64, start: u64, end: u64) -> PlannedRequest {
    stweaver_core::testkit::planned_on(size, offset, start, end, stream)
}

/// Never-freed prologue requests, a prologue request that crosses into the first
/// iteration, an iteration request that crosses into the next, two streams.
fn rich() -> Plan {
    const MIB: u64 = 1 << 20;
    Plan {
        device: DeviceId(2),
        alignment: Bytes(512),
        pool_size: Bytes(16 * MIB),
        lower_bound: Bytes(12 * MIB),
        trace_digest: 0x0123_4567_89ab_cdef,
        prologue: vec![
            req(4 * MIB, 0, 0, 0, NEVER_FREED),
            req(4 * MIB - 100, 0, 4 * MIB, 1, NEVER_FREED),
            req(MIB, 0x5601_0000, 8 * MIB, 2, 5), // freed at tick 1 of iteration 0
        ],
        prologue_len: 4,
        iteration: vec![
            req(2 * MIB, 0, 9 * MIB, 0, 3),
            req(MIB, 0x5601_0000, 11 * MIB, 1, 2),
            req(3 * MIB, 0, 12 * MIB, 2, 6), // freed at tick 2 of the next iteration
        ],
        iteration_len: 4,
        dynamic: DynamicSummary {
            requests: 17,
            peak_bytes: Bytes(3 * MIB),
        },
        ..Default::default()
    }
}

fn format_error(r: Result<Plan, PlanFileError>) -> FormatError {
    match r {
        Err(PlanFileError::Format { error, .. }) => error,
        other => panic!("expected a format error, got {other:?}"),
    }
}

#[test]
fn file_round_trip_is_identical() {
    let p = rich();
    verify_plan(&p).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rich.stwp");
    write_plan_file(&path, &p).unwrap();
    let back = read_plan_file(&path).unwrap();
    assert_eq!(back, p);
    check_plan_matches(&back, DeviceId(2), 0x0123_4567_89ab_cdef).unwrap();
}

#[test]
fn a_plan_without_an_iteration_section_round_trips() {
    let mut p = rich();
    p.iteration.clear();
    p.iteration_len = 0;
    p.prologue[2].end = 4;
    assert_eq!(plan_from_bytes(&plan_to_bytes(&p).unwrap()).unwrap(), p);
}

#[test]
fn writing_refuses_an_invalid_plan_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.stwp");
    let mut p = rich();
    p.iteration[1].offset = Offset(9 * (1 << 20) + 512); // inside iteration request 0
    let e = write_plan_file(&path, &p).unwrap_err();
    let PlanFileError::Invalid { error, .. } = &e else {
        panic!("expected the verifier to refuse, got {e:?}")
    };
    assert!(
        error
            .0
            .iter()
            .any(|v| matches!(v, PlanViolation::Overlap { .. }))
    );
    assert!(e.to_string().contains("bad.stwp"), "{e}");
    assert!(!path.exists());

    let mut p = rich();
    p.alignment = Bytes(384);
    assert!(matches!(
        plan_to_bytes(&p),
        Err(PlanFileError::Invalid { .. })
    ));
}

#[test]
fn a_plan_for_another_device_or_trace_is_detected() {
    let p = rich();
    let e = check_plan_matches(&p, DeviceId(0), p.trace_digest).unwrap_err();
    assert!(matches!(
        e,
        PlanFileError::Mismatch {
            plan_device: DeviceId(2),
            expected_device: DeviceId(0),
            ..
        }
    ));
    let e = check_plan_matches(&p, DeviceId(0), 7).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("cuda:2") && msg.contains("0x0000000000000007"),
        "{msg}"
    );
}

#[test]
fn empty_missing_and_directory_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.stwp");
    std::fs::write(&empty, b"").unwrap();
    let r = read_plan_file(&empty);
    let msg = r.as_ref().unwrap_err().to_string();
    assert!(msg.contains("empty.stwp"), "{msg}");
    assert_eq!(format_error(r), FormatError::Empty);

    let e = read_plan_file(&dir.path().join("nope.stwp")).unwrap_err();
    assert!(matches!(e, PlanFileError::Read { .. }), "{e}");
    assert!(e.to_string().contains("nope.stwp"), "{e}");
    let e = read_plan_file(dir.path()).unwrap_err();
    assert!(matches!(e, PlanFileError::Read { .. }), "{e}");
}

#[test]
fn every_truncation_is_an_error_and_long_ones_say_truncated() {
    let bytes = plan_to_bytes(&rich()).unwrap();
    for len in 0..bytes.len() {
        let e = format_error(plan_from_bytes(&bytes[..len]));
        match len {
            0 => assert_eq!(e, FormatError::Empty),
            1..12 => assert!(matches!(e, FormatError::TooShort { .. }), "{len}: {e}"),
            _ => assert!(matches!(e, FormatError::Truncated { .. }), "{len}: {e}"),
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.stwp");
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let msg = read_plan_file(&path).unwrap_err().to_string();
    assert!(
        msg.contains("cut.stwp") && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn a_trace_file_is_not_a_plan_file() {
    let trace = stweaver_core::Trace {
        device: DeviceId(0),
        allocations: vec![stweaver_core::Allocation {
            size: Bytes(8),
            stream: StreamId(0),
            addr: 0,
            preexisting: false,
        }],
        events: vec![stweaver_core::Event {
            kind: stweaver_core::EventKind::Alloc(stweaver_core::AllocId(0)),
            time_us: 0,
        }],
        labels: vec![],
        restores: Vec::new(),
    };
    let bytes = stweaver_core::trace_file::trace_to_bytes(&trace).unwrap();
    let e = format_error(plan_from_bytes(&bytes));
    assert!(matches!(e, FormatError::WrongIdentifier { .. }), "{e}");
    assert!(e.to_string().contains("trace file"), "{e}");
}

/// Flips every byte of a valid file, one at a time, in three ways. Nothing may
/// panic; a flip that still loads must load a plan the verifier accepts.
#[test]
fn every_corrupted_byte_is_an_error_or_a_verified_plan() {
    let bytes = plan_to_bytes(&rich()).unwrap();
    let (mut errors, mut refused_by_verifier) = (0, 0);
    for i in 0..bytes.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[i] ^= mask;
            match plan_from_bytes(&b) {
                Ok(p) => {
                    verify_plan(&p).unwrap();
                }
                Err(e) => {
                    errors += 1;
                    if matches!(e, PlanFileError::Invalid { .. }) {
                        refused_by_verifier += 1;
                    }
                }
            }
        }
    }
    assert!(errors > 0 && errors < 3 * bytes.len(), "{errors} errors");
    // Offsets, sizes and lifetimes are in the flipped bytes: the plan verifier
    // must have caught some that the format checks cannot.
    assert!(refused_by_verifier > 0);
}

/// Random valid plans: requests stacked without overlap in address, random
/// lifetimes, then a round trip.
fn arb_plan() -> impl Strategy<Value = Plan> {
    let r = (1u64..100_000, 0u64..3, 0u64..50, 1u64..60, any::<bool>());
    (
        -1i32..8,
        prop::collection::vec(r.clone(), 0..40),
        prop::collection::vec(r, 0..40),
        any::<u64>(),
        (any::<u64>(), any::<u64>()),
    )
        .prop_map(|(device, pro, it, digest, (dr, dp))| {
            let align = 512u64;
            let mut top = 0u64;
            let mut place = |size: u64| {
                let at = top;
                top += size.div_ceil(align) * align;
                at
            };
            let prologue_len = 50;
            let iteration_len = 50;
            let prologue: Vec<_> = pro
                .into_iter()
                .map(|(size, stream, start, life, forever)| {
                    let end = if forever { NEVER_FREED } else { start + life };
                    req(size, stream, place(size), start, end)
                })
                .collect();
            // Each iteration request lives less than one iteration (so it never
            // meets its own next instance) and has its own address range.
            let iteration: Vec<_> = it
                .into_iter()
                .map(|(size, stream, start, life, _)| {
                    req(size, stream, place(size), start, start + life.min(49))
                })
                .collect();
            let mut prologue = prologue;
            prologue.sort_by_key(|r| r.start);
            let mut iteration = iteration;
            iteration.sort_by_key(|r| r.start);
            Plan {
                device: DeviceId(device),
                alignment: Bytes(align),
                pool_size: Bytes(top),
                lower_bound: Bytes(top / 2),
                trace_digest: digest,
                prologue,
                prologue_len,
                iteration_len: if iteration.is_empty() {
                    0
                } else {
                    iteration_len
                },
                iteration,
                dynamic: DynamicSummary {
                    requests: dr,
                    peak_bytes: Bytes(dp),
                },
                ..Default::default()
            }
        })
}

proptest! {
    #[test]
    fn random_plans_round_trip(p in arb_plan()) {
        verify_plan(&p).unwrap();
        let back = plan_from_bytes(&plan_to_bytes(&p).unwrap()).unwrap();
        prop_assert_eq!(back, p);
    }
}
