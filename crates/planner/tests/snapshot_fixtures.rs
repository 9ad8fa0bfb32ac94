//! Snapshot import on the small fixtures of `tests/data` (written by
//! `tests/data/make_fixtures.py`): what gets imported, and how bad input fails.

use std::path::{Path, PathBuf};

use stweaver_core::{AllocId, Bytes, DeviceId, EventKind, MarkerKind, StreamId};
use stweaver_planner::input::{InputError, load_traces};
use stweaver_planner::iteration::detect_period;
use stweaver_planner::snapshot::{
    BlockState, IN_MEMORY, PickleErrorKind, SnapshotErrorKind, load_snapshot,
    load_snapshot_from_bytes,
};

fn data(name: &str) -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data")).join(name)
}

#[test]
fn multi_device_multi_stream_preexisting_and_never_freed() {
    let snap = load_snapshot(&data("multi_device.pickle")).unwrap_or_else(|e| panic!("{e}"));
    // Devices 0 and 1 have history; device 2's list is empty.
    assert_eq!(snap.traces.len(), 2);
    assert_eq!(snap.devices.len(), 3);
    let (t0, t1) = (&snap.traces[0], &snap.traces[1]);
    assert_eq!((t0.device, t1.device), (DeviceId(0), DeviceId(1)));

    // Device 0: 4 allocs, 2 blocks allocated before recording began.
    assert_eq!(t0.alloc_event_count(), 4);
    assert_eq!(t0.allocations.len(), 6);
    let pre: Vec<_> = t0.allocations.iter().filter(|a| a.preexisting).collect();
    assert_eq!(pre.len(), 2);
    assert_eq!(pre[0].size, Bytes(4096));
    assert_eq!(pre[1].size, Bytes(512));
    // Both frees of the first preexisting block attach to the same allocation.
    let frees_of = |id: AllocId| {
        t0.events
            .iter()
            .filter(|e| {
                matches!(e.kind, EventKind::FreeRequested(x) | EventKind::FreeCompleted(x) if x == id)
            })
            .count()
    };
    let pre_id = AllocId(t0.allocations.iter().position(|a| a.preexisting).unwrap() as u32);
    assert_eq!(frees_of(pre_id), 2);
    // Never freed: the 3 MiB and 8 MiB blocks and the last one.
    let lifetimes = t0.lifetimes();
    let never: Vec<u64> = t0
        .allocations
        .iter()
        .zip(&lifetimes)
        .filter(|(_, l)| l.end.is_none())
        .map(|(a, _)| a.size.get())
        .collect();
    assert_eq!(never, vec![3 << 20, 8 << 20, 500]);
    // Preexisting 4096 + 512, then 1000 + 3 MiB + 8 MiB once both are gone.
    assert_eq!(t0.lower_bound().bytes, Bytes(1000 + (3 << 20) + (8 << 20)));
    let c = snap.devices[0].counts;
    assert_eq!(
        (c.alloc, c.free_requested, c.free_completed, c.preexisting),
        (4, 2, 3, 2)
    );
    assert_eq!(
        (c.segment_alloc, c.segment_free, c.snapshot, c.oom, c.other),
        (1, 1, 1, 1, 0)
    );

    // Device 1: two streams; a block freed on its stream while another is allocated.
    let streams: Vec<StreamId> = t1.allocations.iter().map(|a| a.stream).collect();
    assert_eq!(streams, vec![StreamId(0), StreamId(0xC0FFEE), StreamId(0)]);
    let c1 = snap.devices[1].counts;
    assert_eq!((c1.segment_map, c1.segment_unmap, c1.other), (1, 1, 1));
    assert_eq!(t1.lower_bound().bytes, Bytes(512 + (1 << 20) + 256));

    // Annotations: device 0 has its own pair and the global pair; device 1 one of its
    // own and the global pair; merged in time order, labels deduplicated.
    let markers = |t: &stweaver_core::Trace| -> Vec<(MarkerKind, String)> {
        t.events
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::Marker { kind, label } => {
                    Some((kind, t.labels[label.unwrap() as usize].clone()))
                }
                _ => None,
            })
            .collect()
    };
    use MarkerKind::{PhaseBegin, PhaseEnd};
    assert_eq!(
        markers(t0),
        vec![
            (PhaseBegin, "global#mark".to_owned()),
            (PhaseBegin, "phase#forward".to_owned()),
            (PhaseEnd, "phase#forward".to_owned()),
            (PhaseEnd, "global#mark".to_owned()),
        ]
    );
    assert_eq!(t0.labels.len(), 2);
    assert_eq!(markers(t1).len(), 3);
    assert_eq!(snap.annotations, 5);
    // The first marker precedes the first alloc; phase#forward START (t0+15) lands
    // before the first alloc (t0+20) too.
    assert!(matches!(t0.events[0].kind, EventKind::Marker { .. }));
    assert!(matches!(t0.events[1].kind, EventKind::Marker { .. }));
    assert!(matches!(t0.events[2].kind, EventKind::Alloc(_)));

    // Settings and final segments.
    let s = &snap.settings;
    assert!(s.expandable_segments);
    assert_eq!(
        s.alloc_conf,
        "expandable_segments:True,roundup_power2_divisions:[256:4]"
    );
    let r: Vec<(u64, u64)> = s
        .roundup_power2_divisions
        .iter()
        .filter(|r| r.divisions != 0)
        .map(|r| (r.interval_start.get(), r.divisions))
        .collect();
    assert_eq!(r, vec![(256 << 20, 4)]);
    assert_eq!(snap.segments.len(), 3);
    assert_eq!(snap.segments[0].blocks.len(), 2);
    assert_eq!(
        snap.segments[0].blocks[0].state,
        BlockState::ActiveAllocated
    );
    assert!(snap.segments[1].is_expandable);
    assert_eq!(snap.segments[2].pool_id, (1, 0));
    assert_eq!(snap.segments[2].stream, StreamId(0xC0FFEE));
}

#[test]
fn gzip_is_detected_by_content_not_name() {
    let plain = load_snapshot(&data("multi_device.pickle")).unwrap();
    let gz = load_snapshot(&data("multi_device_gzipped.pickle")).unwrap();
    assert_eq!(plain, gz);
}

#[test]
fn periodic_fixture_has_its_period() {
    let snap = load_snapshot(&data("periodic.pickle.gz")).unwrap();
    let p = detect_period(&snap.traces[0]).expect("periodic");
    assert_eq!(p.allocs_per_iteration, 5);
    assert_eq!(p.first_steady_alloc, 3 + 5 + 3);
    assert_eq!(p.repetitions, 4);
}

fn kind_of(name: &str) -> (String, SnapshotErrorKind) {
    let e = load_snapshot(&data(name)).expect_err("must fail");
    let msg = e.to_string();
    assert!(msg.contains(name), "error names the file: {msg}");
    (msg, e.kind)
}

#[test]
fn truncated_gzip() {
    let (msg, kind) = kind_of("truncated.pickle.gz");
    assert!(matches!(kind, SnapshotErrorKind::Gzip(_)), "{msg}");
    assert!(msg.contains("truncated gzip"), "{msg}");
}

#[test]
fn not_a_pickle() {
    let (msg, kind) = kind_of("not_a_pickle.pickle");
    assert!(matches!(kind, SnapshotErrorKind::NotPickle(_)), "{msg}");
    assert!(msg.contains("not a PyTorch memory snapshot"), "{msg}");
    // Through the dispatcher: unrecognised, naming the file.
    let e = load_traces(&data("not_a_pickle.pickle")).unwrap_err();
    assert!(matches!(e, InputError::Unrecognised { .. }));
    assert!(e.to_string().contains("not_a_pickle.pickle"));
}

#[test]
fn pickle_of_the_wrong_shape() {
    let (msg, kind) = kind_of("wrong_shape.pickle");
    match kind {
        SnapshotErrorKind::Shape { at, problem } => {
            assert_eq!(at, "device_traces[0][1]");
            assert_eq!(problem, "missing key 'addr'");
        }
        other => panic!("{other}"),
    }
    assert!(msg.ends_with("wrong_shape.pickle: device_traces[0][1]: missing key 'addr'"));
}

#[test]
fn empty_trace() {
    let (msg, kind) = kind_of("empty_trace.pickle");
    assert!(matches!(kind, SnapshotErrorKind::NoAllocations), "{msg}");
    assert!(msg.contains("no alloc events"), "{msg}");
}

#[test]
fn truncated_pickles_fail_cleanly_at_every_length() {
    let bytes = std::fs::read(data("multi_device.pickle")).unwrap();
    for cut in 0..bytes.len() {
        let e = load_snapshot_from_bytes(&bytes[..cut]).expect_err("truncated");
        assert!(e.to_string().starts_with(IN_MEMORY));
        if cut >= 2 {
            assert!(
                matches!(e.kind, SnapshotErrorKind::Pickle { gzipped: false, .. }),
                "cut {cut}: {e}"
            );
        }
    }
}

#[test]
fn corrupt_bytes_never_panic() {
    // Flip each byte of a real (small) snapshot in turn: every outcome is Ok or a
    // clear error, never a panic.
    let bytes = std::fs::read(data("multi_device.pickle")).unwrap();
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0xA5;
        let _ = load_snapshot_from_bytes(&b);
    }
    let gz = std::fs::read(data("periodic.pickle.gz")).unwrap();
    for i in 0..gz.len() {
        let mut b = gz.clone();
        b[i] ^= 0x5A;
        if let Err(e) = load_snapshot_from_bytes(&b) {
            assert!(!e.to_string().is_empty());
        }
    }
}

#[test]
fn semantic_errors_are_located() {
    // pickle.dumps({'device_traces': [[{'action': 'alloc', 'addr': 16, 'size': 8,
    //   'stream': 0}, {'action': 'alloc', 'addr': 16, 'size': 8, 'stream': 0}]]}, protocol=4)
    let double = b"\x80\x04\x95a\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\rdevice_traces\x94]\x94]\x94(}\x94(\x8c\x06action\x94\x8c\x05alloc\x94\x8c\x04addr\x94K\x10\x8c\x04size\x94K\x08\x8c\x06stream\x94K\x00u}\x94(h\x05h\x06h\x07K\x10h\x08K\x08h\tK\x00ueas.";
    let e = load_snapshot_from_bytes(double).unwrap_err();
    assert_eq!(
        e.to_string(),
        "<in-memory buffer>: device_traces[0][1]: alloc at address 0x10, where the block of device_traces[0][0] is still live"
    );
    // GLOBAL opcodes (objects, not plain data) are refused by name.
    let e = load_snapshot_from_bytes(b"\x80\x04cos\nsystem\n.").unwrap_err();
    assert!(matches!(
        e.kind,
        SnapshotErrorKind::Pickle {
            error: stweaver_planner::snapshot::PickleError {
                kind: PickleErrorKind::Unsupported("GLOBAL"),
                ..
            },
            ..
        }
    ));
}

mod arbitrary_pickles {
    use proptest::prelude::*;
    use stweaver_planner::snapshot::load_snapshot_from_bytes;

    /// Opcodes the VM implements (and a few it refuses), each followed by 0–8 random
    /// argument bytes: mostly structurally plausible pickles, which reach far deeper
    /// into the VM and the snapshot builder than uniformly random bytes.
    const OPCODES: &[u8] =
        b"(.012NJKM}]u\x8c\x94hjqr\x85\x86\x87\x88\x89\x8a\x8bGaestlXBC)\x8f\x90\x91\x95cR";

    fn pickle() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(
            (
                prop::sample::select(OPCODES),
                prop::collection::vec(any::<u8>(), 0..9),
            ),
            0..64,
        )
        .prop_map(|ops| {
            let mut b = vec![0x80, 4];
            for (op, args) in ops {
                b.push(op);
                b.extend(args);
            }
            b
        })
    }

    proptest! {
        #[test]
        fn never_panic(bytes in pickle()) {
            if let Err(e) = load_snapshot_from_bytes(&bytes) {
                prop_assert!(e.to_string().starts_with("<in-memory buffer>: "));
            }
        }

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = load_snapshot_from_bytes(&bytes);
        }
    }
}
