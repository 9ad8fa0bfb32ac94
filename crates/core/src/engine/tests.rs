//! Unit tests of the engine: bad requests, out of memory, injected device failures,
//! `record_stream` and trace recording.

use super::*;
use crate::trace::{EventKind, MarkerKind};
use crate::units::AllocId;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

const G: u64 = 64 << 10;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

/// A host device whose event recording, event queries and unmapping can be made
/// to fail, and whose granularity can be wrong.
#[derive(Debug)]
struct Flaky {
    host: HostMemory,
    granule: Option<u64>,
    fail_record: AtomicBool,
    fail_query: AtomicBool,
    fail_unmap: AtomicBool,
}

fn driver_error(call: &'static str) -> DeviceError {
    DeviceError::Driver {
        call,
        code: 999,
        message: "injected".into(),
    }
}

impl DeviceMemory for Flaky {
    fn granularity(&self) -> Bytes {
        self.granule.map_or(self.host.granularity(), Bytes)
    }
    fn total_memory(&self) -> Bytes {
        self.host.total_memory()
    }
    fn free_memory(&self) -> Result<Bytes, DeviceError> {
        self.host.free_memory()
    }
    fn reserve(&self, size: Bytes) -> Result<DevicePtr, DeviceError> {
        self.host.reserve(size)
    }
    fn release(&self, base: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        self.host.release(base, size)
    }
    fn map(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        self.host.map(addr, size)
    }
    fn unmap(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        if self.fail_unmap.load(Ordering::Relaxed) {
            return Err(driver_error("cuMemUnmap"));
        }
        self.host.unmap(addr, size)
    }
    fn synchronize(&self) -> Result<(), DeviceError> {
        self.host.synchronize()
    }
    fn create_event(&self) -> Result<DeviceEvent, DeviceError> {
        self.host.create_event()
    }
    fn record_event(&self, event: DeviceEvent, stream: StreamId) -> Result<(), DeviceError> {
        if self.fail_record.load(Ordering::Relaxed) {
            return Err(driver_error("cudaEventRecord"));
        }
        self.host.record_event(event, stream)
    }
    fn wait_event(&self, stream: StreamId, event: DeviceEvent) -> Result<(), DeviceError> {
        self.host.wait_event(stream, event)
    }
    fn query_event(&self, event: DeviceEvent) -> Result<bool, DeviceError> {
        if self.fail_query.load(Ordering::Relaxed) {
            return Err(driver_error("cudaEventQuery"));
        }
        self.host.query_event(event)
    }
    fn synchronize_event(&self, event: DeviceEvent) -> Result<(), DeviceError> {
        self.host.synchronize_event(event)
    }
    fn destroy_event(&self, event: DeviceEvent) -> Result<(), DeviceError> {
        self.host.destroy_event(event)
    }
}

fn flaky(capacity: u64) -> Arc<Flaky> {
    Arc::new(Flaky {
        host: HostMemory::new(Bytes(capacity), Bytes(G)),
        granule: None,
        fail_record: AtomicBool::new(false),
        fail_query: AtomicBool::new(false),
        fail_unmap: AtomicBool::new(false),
    })
}

fn engine(dev: Arc<Flaky>, limit: MemoryLimit) -> Engine<Arc<Flaky>> {
    Engine::new(
        dev,
        EngineConfig {
            limit,
            arena_size: Some(Bytes(64 << 20)),
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

#[test]
fn bad_requests_are_errors() {
    let e = engine(flaky(1 << 30), MemoryLimit::Fraction(1.0));
    assert_eq!(e.malloc(Bytes(0), S0), Err(EngineError::ZeroSize));
    assert_eq!(
        e.malloc(Bytes(u64::MAX), S0),
        Err(EngineError::TooLarge(Bytes(u64::MAX)))
    );
    let p = e.malloc(Bytes(1000), S0).unwrap();
    assert_eq!(e.block_info(p).unwrap().size, Bytes(1024));
    assert_eq!(e.block_info(p).unwrap().requested, Bytes(1000));
    let inner = DevicePtr(p.get() + 512);
    assert_eq!(e.free(inner), Err(EngineError::UnknownPointer(inner)));
    assert_eq!(
        e.record_stream(inner, S1),
        Err(EngineError::UnknownPointer(inner))
    );
    // Pointers no block can have, the pointer map's vacant marker among them.
    for bad in [DevicePtr(u64::MAX), DevicePtr(p.get() + 1), DevicePtr(0)] {
        assert_eq!(e.free(bad), Err(EngineError::UnknownPointer(bad)));
        assert_eq!(e.block_info(bad), Err(EngineError::UnknownPointer(bad)));
    }
    e.record_stream(p, S1).unwrap();
    e.free(p).unwrap();
    assert_eq!(e.free(p), Err(EngineError::AlreadyFreed(p)));
    assert_eq!(e.record_stream(p, S1), Err(EngineError::AlreadyFreed(p)));
    assert_eq!(
        e.set_memory_limit(MemoryLimit::Fraction(0.0)),
        Err(EngineError::InvalidLimit(0.0))
    );
    assert!(e.set_memory_limit(MemoryLimit::Fraction(1.5)).is_err());
    e.set_memory_limit(MemoryLimit::Fraction(0.25)).unwrap();
    assert_eq!(e.memory_limit().unwrap(), Bytes(1 << 28));
    e.check_invariants().unwrap();

    let mut odd = Arc::try_unwrap(flaky(1 << 20)).unwrap();
    odd.granule = Some(1000);
    assert!(matches!(
        Engine::new(odd, EngineConfig::default()),
        Err(EngineError::BadGranularity(Bytes(1000)))
    ));
}

#[test]
fn out_of_memory_says_what_was_asked_and_what_is_held() {
    let e = engine(flaky(1 << 30), MemoryLimit::Bytes(Bytes(1 << 20)));
    let _a = e.malloc(Bytes(512 << 10), S0).unwrap();
    let err = e.malloc(Bytes((1 << 20) - 100), S0).unwrap_err();
    assert_eq!(
        err,
        EngineError::OutOfMemory {
            requested: Bytes((1 << 20) - 100),
            rounded: Bytes(1 << 20),
            stream: S0,
            allocated: Bytes(512 << 10),
            reserved: Bytes(512 << 10),
            free_reserved: Bytes(0),
            limit: Bytes(1 << 20),
            device_free: Bytes((1 << 30) - (512 << 10)),
        }
    );
    let msg = err.to_string();
    assert!(msg.contains("tried to allocate 1.00 MiB"), "{msg}");
    assert!(msg.contains("512.00 KiB allocated"), "{msg}");
    let s = e.stats().unwrap();
    assert_eq!(
        (s.num_ooms, s.num_alloc_retries, s.num_sync_all_streams),
        (1, 1, 1)
    );
    e.check_invariants().unwrap();
}

#[test]
fn the_retry_releases_cached_memory_of_other_streams() {
    let e = engine(flaky(1 << 30), MemoryLimit::Bytes(Bytes(4 << 20)));
    let a = e.malloc(Bytes(3 << 20), S1).unwrap();
    e.free(a).unwrap();
    // S0 cannot have S1's cached 3 MiB without the release-and-retry.
    let b = e.malloc(Bytes(2 << 20), S0).unwrap();
    let s = e.stats().unwrap();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 0));
    assert_eq!(s.reserved_bytes[0].current, 2 << 20);
    assert_eq!(s.segment[0].current, 1, "S1's empty arena was released");
    e.free(b).unwrap();
    e.check_invariants().unwrap();
}

#[test]
fn a_failed_event_record_keeps_the_block_forever() {
    let dev = flaky(1 << 30);
    let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
    let p = e.malloc(Bytes(4096), S0).unwrap();
    e.record_stream(p, S1).unwrap();
    dev.fail_record.store(true, Ordering::Relaxed);
    assert!(matches!(e.free(p), Err(EngineError::Device(_))));
    dev.fail_record.store(false, Ordering::Relaxed);
    e.empty_cache().unwrap();
    let s = e.stats().unwrap();
    assert_eq!(s.allocated_bytes[0].current, 0);
    assert_eq!(
        s.active_bytes[0].current, 4096,
        "never reused: leaked, not aliased"
    );
    assert_eq!(e.block_info(p).unwrap().state, BlockState::PendingFree);
    let q = e.malloc(Bytes(4096), S0).unwrap();
    assert_ne!(p, q);
    e.check_invariants().unwrap();
}

/// A stream that runs behind (offload's copy stream) holds many pending frees: a
/// `malloc` queries its events only up to the first one still running (events of one
/// stream complete in order), so processing costs O(streams + completed), not one query
/// per pending free; frees still complete as their events pass, and nothing is reused
/// early.
#[test]
fn processing_stops_at_each_streams_first_running_event() {
    let dev = flaky(1 << 30);
    let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
    let ev = dev.host.events();
    let mut held = Vec::new();
    for _ in 0..50 {
        let p = e.malloc(Bytes(4096), S0).unwrap();
        e.record_stream(p, S1).unwrap();
        held.push(p);
    }
    for &p in &held {
        e.free(p).unwrap();
    }
    let active = |e: &Engine<Arc<Flaky>>| e.stats().unwrap().active_bytes[0].current;
    assert_eq!(active(&e), 50 * 4096, "all pending on S1");
    let q0 = ev.queries();
    e.process_events().unwrap();
    assert_eq!(
        ev.queries() - q0,
        1,
        "one query: S1's oldest event is still running"
    );
    for _ in 0..10 {
        assert!(ev.pass_next(S1));
    }
    let q1 = ev.queries();
    let x = e.malloc(Bytes(512), S0).unwrap(); // processes first
    assert_eq!(
        ev.queries() - q1,
        11,
        "ten passed events and the first running one"
    );
    assert_eq!(
        active(&e),
        40 * 4096 + 512,
        "exactly the passed ones completed"
    );
    ev.pass_all(S1);
    e.process_events().unwrap();
    assert_eq!(active(&e), 512);
    e.free(x).unwrap();
    e.check_invariants().unwrap();
}

#[test]
fn failed_queries_and_unmaps_leave_a_consistent_engine() {
    let dev = flaky(1 << 30);
    let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
    let p = e.malloc(Bytes(4096), S0).unwrap();
    e.record_stream(p, S1).unwrap();
    e.free(p).unwrap();
    dev.host.events().pass_all(S1);
    dev.fail_query.store(true, Ordering::Relaxed);
    assert!(matches!(e.process_events(), Err(EngineError::Device(_))));
    assert!(e.malloc(Bytes(512), S0).is_err());
    e.check_invariants().unwrap();
    dev.fail_query.store(false, Ordering::Relaxed);
    e.process_events().unwrap();
    assert_eq!(e.stats().unwrap().active_bytes[0].current, 0);

    let q = e.malloc(Bytes(3 * G), S0).unwrap();
    e.free(q).unwrap();
    let reserved = e.stats().unwrap().reserved_bytes[0].current;
    dev.fail_unmap.store(true, Ordering::Relaxed);
    assert!(matches!(e.empty_cache(), Err(EngineError::Device(_))));
    e.check_invariants().unwrap();
    assert_eq!(e.stats().unwrap().reserved_bytes[0].current, reserved);
    dev.fail_unmap.store(false, Ordering::Relaxed);
    e.empty_cache().unwrap();
    assert_eq!(e.stats().unwrap().reserved_bytes[0].current, 0);
    e.check_invariants().unwrap();
}

#[test]
fn record_stream_on_the_own_stream_frees_at_once() {
    let e = engine(flaky(1 << 30), MemoryLimit::Fraction(1.0));
    let p = e.malloc(Bytes(4096), S1).unwrap();
    e.record_stream(p, S1).unwrap();
    e.free(p).unwrap();
    assert_eq!(e.stats().unwrap().active_bytes[0].current, 0);
    assert_eq!(e.malloc(Bytes(4096), S1).unwrap(), p);
}

#[test]
fn trace_started_mid_run_has_preexisting_blocks() {
    let dev = flaky(1 << 30);
    let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
    assert_eq!(e.take_trace().unwrap(), None);
    let a = e.malloc(Bytes(1000), S0).unwrap();
    let b = e.malloc(Bytes(2000), S0).unwrap();
    e.record_stream(a, S1).unwrap();
    e.free(a).unwrap(); // pending on S1
    e.start_trace().unwrap();
    assert!(e.is_tracing().unwrap());
    e.mark(MarkerKind::PhaseBegin, Some("fwd")).unwrap();
    e.free(b).unwrap();
    dev.host.events().pass_all(S1);
    let c = e.malloc(Bytes(300), S0).unwrap(); // completes a's free first
    e.mark_iteration().unwrap();
    let t = e.take_trace().unwrap().unwrap();
    assert!(!e.is_tracing().unwrap());
    t.validate().unwrap();
    assert_eq!(t.allocations.len(), 3);
    assert!(t.allocations[0].preexisting && t.allocations[1].preexisting);
    assert_eq!(
        (t.allocations[0].addr, t.allocations[0].size),
        (a.get(), Bytes(1000))
    );
    assert_eq!(t.allocations[2].addr, c.get());
    let kinds: Vec<EventKind> = t.events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        vec![
            EventKind::Marker {
                kind: MarkerKind::PhaseBegin,
                label: Some(0)
            },
            EventKind::FreeRequested(AllocId(1)),
            EventKind::FreeCompleted(AllocId(1)),
            EventKind::FreeCompleted(AllocId(0)),
            EventKind::Alloc(AllocId(2)),
            EventKind::Marker {
                kind: MarkerKind::IterationBegin,
                label: None
            },
        ]
    );
}

#[test]
fn saved_tensor_events_name_the_live_allocation_at_the_pointer() {
    let dev = flaky(1 << 30);
    let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
    let a = e.malloc(Bytes(1000), S0).unwrap();
    assert_eq!(
        e.record_saved(a, SavedKind::Pack).unwrap(),
        None,
        "not tracing"
    );
    e.start_trace().unwrap();
    let b = e.malloc(Bytes(2048), S0).unwrap();
    assert_eq!(
        e.record_saved(b, SavedKind::Pack).unwrap(),
        Some(AllocId(1))
    );
    assert_eq!(
        e.record_saved(a, SavedKind::Pack).unwrap(),
        Some(AllocId(0))
    );
    assert_eq!(
        e.record_saved(DevicePtr(b.get() + 512), SavedKind::Pack)
            .unwrap(),
        None,
        "an interior pointer"
    );
    assert_eq!(
        e.record_saved(b, SavedKind::Unpack).unwrap(),
        Some(AllocId(1))
    );
    e.record_stream(b, S1).unwrap();
    e.free(b).unwrap(); // pending on S1
    assert_eq!(e.record_saved(b, SavedKind::Unpack).unwrap(), None, "freed");
    let t = e.take_trace().unwrap().unwrap();
    t.validate().unwrap();
    let kinds: Vec<EventKind> = t.events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        vec![
            EventKind::Alloc(AllocId(1)),
            EventKind::SavedPack(AllocId(1)),
            EventKind::SavedPack(AllocId(0)),
            EventKind::SavedUnpack(AllocId(1)),
            EventKind::FreeRequested(AllocId(1)),
        ]
    );
}

/// `record_stream_enqueued`: the free waits for the point the use was sealed at, not for
/// the later work of the stream (offload's copy stream, where later tensors' copies are
/// queued by the time a tensor is freed); a plain `record_stream` after a seal drops it.
#[test]
fn a_sealed_use_frees_at_its_own_point_of_the_stream() {
    let dev = flaky(1 << 30);
    let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
    let ev = dev.host.events();
    let active = |e: &Engine<Arc<Flaky>>| e.stats().unwrap().active_bytes[0].current;
    // Sealed: p's copy, then q's copy are queued on S1; both freed after.
    let p = e.malloc(Bytes(4096), S0).unwrap();
    e.record_stream_enqueued(p, S1).unwrap();
    let q = e.malloc(Bytes(8192), S0).unwrap();
    e.record_stream_enqueued(q, S1).unwrap();
    e.record_stream_enqueued(q, S0).unwrap(); // its own stream: nothing
    e.free(p).unwrap();
    e.free(q).unwrap();
    assert_eq!(active(&e), 4096 + 8192, "both pending on S1");
    assert!(ev.pass_next(S1)); // p's copy is done, q's is not
    e.process_events().unwrap();
    assert_eq!(active(&e), 8192, "p completes at its own point");
    assert!(ev.pass_next(S1));
    e.process_events().unwrap();
    assert_eq!(active(&e), 0);
    // The same with plain uses: the events are recorded at the frees, after both copies'
    // points, so passing the first point completes nothing.
    let p = e.malloc(Bytes(4096), S0).unwrap();
    e.record_stream(p, S1).unwrap();
    let q = e.malloc(Bytes(8192), S0).unwrap();
    e.record_stream_enqueued(q, S1).unwrap();
    e.free(p).unwrap();
    assert!(ev.pass_next(S1)); // q's seal
    e.process_events().unwrap();
    assert_eq!(
        active(&e),
        4096 + 8192,
        "p waits for its free's point; q is live"
    );
    ev.pass_all(S1);
    e.process_events().unwrap();
    assert_eq!(active(&e), 8192);
    // A plain use after a seal: more work may follow on S1, the free waits for its point.
    e.record_stream(q, S1).unwrap();
    e.free(q).unwrap();
    assert_eq!(active(&e), 8192);
    ev.pass_all(S1);
    e.process_events().unwrap();
    assert_eq!(active(&e), 0);
    assert_eq!(
        e.record_stream_enqueued(q, S1),
        Err(EngineError::UnknownPointer(q))
    );
    e.check_invariants().unwrap();
}
