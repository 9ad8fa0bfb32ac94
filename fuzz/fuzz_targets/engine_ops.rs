//! Arbitrary programs of engine operations (talc's `fuzz_talc` style): malloc, free,
//! bad frees, record_stream, streams passing events, process_events, empty_cache,
//! markers, trace start/take, stat resets, limit changes, injected map failures, refused
//! stream waits, loading and unloading a plan (random requests, kept when the verifier
//! accepts them), and tags with pause / resume (contents kept or dropped), on a host-memory
//! device with small granules. Requests that do not follow
//! the plan make the engine's occupancy check and cursor do their work, and ranges held by
//! pending frees its stream waits (fences included).
//!
//! After every operation: the engine's own consistency check passes; no live or pending
//! block overlaps another; every pending block's sentinel bytes are intact (nobody was
//! handed memory other streams may still use); every allocation over memory whose free
//! recorded events is on a stream ordered after each of them (`FakeEvents::ordered_after`:
//! passed, or waited for); allocated / active / requested bytes and the allocation count
//! equal what the harness holds (plus the engine's fences: pending blocks it owns); a paused
//! block refuses its free and `record_stream`, a pause or resume succeeds or fails as the
//! harness's model of the paused keys says, and the reserved bytes plus the paused bytes
//! cover the active ones. Every block's sentinel is checked when it is freed (after a
//! resume that kept contents, the bytes from before the pause). At the end, after freeing everything and `empty_cache`, nothing is
//! allocated, active, reserved or mapped, and a recorded trace validates.
#![no_main]

use std::collections::BTreeMap;
use std::sync::Arc;

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use stweaver_core::engine::{
    BlockState, DevicePtr, Engine, EngineConfig, EngineError, HostMemory, MemoryLimit, PauseError,
    PlanOptions,
};
use stweaver_core::plan::{NEVER_FREED, Plan, PlannedRequest};
use stweaver_core::{Bytes, DeviceId, Offset, StreamId};

const G: u64 = 4096;

#[derive(Clone)]
struct Held {
    len: u64,
    requested: u64,
    byte: u8,
    freed: bool,
    /// The engine's tag when it was allocated (0: untagged, never paused).
    tag: u32,
    /// Paused: by the pause of this key.
    paused: Option<Option<u32>>,
    /// The recordings of its sealed uses (`record_stream_enqueued`): its free waits for
    /// them, recorded before the free.
    sealed: Vec<(StreamId, u64)>,
}

/// Whether a pause of `key` (`None`: every tag) takes a block of `tag`.
fn takes(key: Option<u32>, tag: u32) -> bool {
    tag != 0 && key.is_none_or(|k| k == tag)
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let host = Arc::new(HostMemory::new(Bytes(256 << 20), Bytes(G)));
    let limit = u.int_in_range(1u64..=64)? << 18;
    let engine = Engine::new(
        host.clone(),
        EngineConfig {
            limit: MemoryLimit::Bytes(Bytes(limit)),
            arena_size: Some(Bytes(u.int_in_range(1u64..=16)? << 20)),
            record_trace: u.arbitrary()?,
            release_before_new_peak: u.arbitrary()?,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let mut held: BTreeMap<u64, Held> = BTreeMap::new();
    // Frees that recorded events: (start, end, recordings).
    let mut hazards: Vec<(u64, u64, Vec<(StreamId, u64)>)> = Vec::new();
    let mut live: Vec<u64> = Vec::new();
    let mut tag = 0u8;
    // The engine's current tag, and the keys paused now.
    let mut cur_tag = 0u32;
    let mut paused: Vec<Option<u32>> = Vec::new();
    // Pauses and resumes that went through, and frees refused as paused (ENGINE_OPS_STATS).
    let mut pause_counts = [0u32; 3];
    let stream =
        |u: &mut Unstructured<'_>| -> Result<StreamId> { Ok(StreamId(u.int_in_range(0u64..=3)?)) };

    // Decoding stops at the first error; the final checks always run.
    let _ = (|| -> Result<()> {
        for _ in 0..400 {
            if u.is_empty() {
                break;
            }
            match u.int_in_range(0u8..=17)? {
                0..=4 => {
                    let size = match u.int_in_range(0u8..=9)? {
                        0..=5 => u.int_in_range(1u64..=4096)?,
                        6..=8 => u.int_in_range(4096u64..=(256 << 10))?,
                        _ => u.int_in_range((256u64 << 10)..=(3 << 20))?,
                    };
                    let s = stream(u)?;
                    match engine.malloc(Bytes(size), s) {
                        Ok(p) => {
                            let (p, len) = (p.get(), size.div_ceil(512) * 512);
                            assert_eq!(p % 512, 0);
                            // Drop pending blocks whose frees completed (before the new
                            // block may reuse their memory).
                            held.retain(|&q, h| {
                                !h.freed
                                    || engine
                                        .block_info(DevicePtr(q))
                                        .is_ok_and(|i| i.state == BlockState::PendingFree)
                            });
                            let ev = host.events();
                            hazards.retain(|(_, _, recs)| {
                                !recs.iter().all(|&(on, seq)| ev.passed(on, seq))
                            });
                            for (a, b, recs) in &hazards {
                                if *a < p + len && p < *b {
                                    for &(on, seq) in recs {
                                        assert!(
                                            ev.ordered_after(s, on, seq),
                                            "{p:#x}+{len:#x} on {s} reuses memory freed behind {on}'s work"
                                        );
                                    }
                                }
                            }
                            if let Some((&q, h)) = held.range(..p + len).next_back() {
                                assert!(
                                    q + h.len <= p,
                                    "{p:#x}+{len:#x} overlaps {q:#x}+{:#x}",
                                    h.len
                                );
                            }
                            tag = tag.wrapping_add(1).max(1);
                            host.fill(DevicePtr(p), Bytes(len), tag).unwrap();
                            held.insert(
                                p,
                                Held {
                                    len,
                                    requested: size,
                                    byte: tag,
                                    freed: false,
                                    tag: cur_tag,
                                    paused: None,
                                    sealed: Vec::new(),
                                },
                            );
                            live.push(p);
                        }
                        Err(EngineError::OutOfMemory { requested, .. }) => {
                            assert_eq!(requested, Bytes(size))
                        }
                        Err(e) => panic!("malloc: {e}"),
                    }
                }
                5..=7 if !live.is_empty() => {
                    let i = u.choose_index(live.len())?;
                    let p = live[i];
                    if let Some(h) = held.get(&p).filter(|h| h.paused.is_some()) {
                        assert_eq!(
                            engine.free(DevicePtr(p)),
                            Err(EngineError::Paused {
                                ptr: DevicePtr(p),
                                tag: h.tag
                            })
                        );
                        pause_counts[2] += 1;
                        check(&engine, &host, &mut held);
                        continue;
                    }
                    live.swap_remove(i);
                    let h = held.get_mut(&p).unwrap();
                    assert!(
                        host.check(DevicePtr(p), Bytes(h.len), h.byte).unwrap(),
                        "sentinel at {p:#x}"
                    );
                    let mark = host.events().recordings();
                    engine.free(DevicePtr(p)).unwrap();
                    h.freed = true;
                    let mut recs = host.events().recorded_since(mark);
                    recs.append(&mut h.sealed);
                    if !recs.is_empty() {
                        hazards.push((p, p + h.len, recs));
                    }
                    assert!(matches!(
                        engine.free(DevicePtr(p)),
                        Err(EngineError::AlreadyFreed(_) | EngineError::UnknownPointer(_))
                    ));
                }
                8 if !live.is_empty() => {
                    let p = live[u.choose_index(live.len())?];
                    let st = stream(u)?;
                    let r = if u.arbitrary()? {
                        engine.record_stream(DevicePtr(p), st)
                    } else {
                        // A sealed use: the event is recorded now, the free waits for it.
                        let mark = host.events().recordings();
                        let r = engine.record_stream_enqueued(DevicePtr(p), st);
                        let recs = host.events().recorded_since(mark);
                        held.get_mut(&p).unwrap().sealed.extend(recs);
                        r
                    };
                    if held[&p].paused.is_some() {
                        assert!(r.is_err(), "record_stream of a paused block");
                    } else {
                        r.unwrap();
                    }
                }
                5..=8 => {
                    let p = DevicePtr(u.arbitrary()?);
                    if !held.contains_key(&p.get()) {
                        assert_eq!(engine.free(p), Err(EngineError::UnknownPointer(p)));
                        assert!(engine.record_stream(p, StreamId(1)).is_err());
                    }
                }
                9 => {
                    let s = stream(u)?;
                    if u.arbitrary()? {
                        host.events().pass_next(s);
                    } else {
                        host.events().pass_all(s);
                    }
                }
                10 => engine.process_events().unwrap(),
                11 => engine.empty_cache().unwrap(),
                12 => match u.int_in_range(0u8..=3)? {
                    0 => engine.mark_iteration().unwrap(),
                    1 => engine.start_trace().unwrap(),
                    2 => {
                        if let Some(t) = engine.take_trace().unwrap() {
                            if !t.events.is_empty() {
                                t.validate().expect("recorded trace is valid");
                            }
                        }
                    }
                    _ => engine.reset_peak_stats().unwrap(),
                },
                13 if u.ratio(1u8, 4u8)? => {
                    // Unloading: the plan's live blocks stay valid (checked at every
                    // step and freed later), the pool goes back when empty.
                    engine.unload_plan().unwrap();
                }
                13 if u.arbitrary()? => {
                    let plan = random_plan(u)?;
                    let window = u.int_in_range(1usize..=16)?;
                    if let Err(e) = engine.load_plan(
                        &plan,
                        PlanOptions {
                            window,
                            ..PlanOptions::default()
                        },
                    ) {
                        assert!(
                            matches!(e, EngineError::PlanRejected(_) | EngineError::Device(_)),
                            "{e}"
                        );
                    }
                }
                13 => engine.reset_accumulated_stats().unwrap(),
                14 => engine
                    .set_memory_limit(MemoryLimit::Bytes(Bytes(u.int_in_range(1u64..=64)? << 18)))
                    .unwrap(),
                15 if u.ratio(1u8, 4u8)? => host.events().refuse_waits(u.arbitrary()?),
                15 => host.fail_map_in(u.int_in_range(1u32..=3)?),
                16 => {
                    cur_tag = u.int_in_range(0u32..=2)?;
                    engine.set_tag(cur_tag).unwrap();
                }
                _ => {
                    let key = match u.int_in_range(0u8..=2)? {
                        0 => None,
                        k => Some(u32::from(k)),
                    };
                    if u.arbitrary()? {
                        let keep: bool = u.arbitrary()?;
                        let clash = paused
                            .iter()
                            .any(|&k| key.is_none() || k.is_none() || k == key);
                        match engine.pause(key, keep) {
                            Ok(_) => {
                                pause_counts[0] += 1;
                                assert!(!clash, "pause of {key:?} over {paused:?}");
                                paused.push(key);
                                for h in held.values_mut() {
                                    if !h.freed && h.paused.is_none() && takes(key, h.tag) {
                                        h.paused = Some(key);
                                        if !keep {
                                            // Contents undefined after the resume: the
                                            // harness writes them again then.
                                            h.byte = 0;
                                        }
                                    }
                                }
                            }
                            Err(EngineError::Pause(PauseError::AlreadyPaused(_))) => {
                                assert!(clash)
                            }
                            Err(EngineError::Pause(
                                PauseError::MixedUnit { .. }
                                | PauseError::Busy { .. }
                                | PauseError::PlanServed,
                            )) => {}
                            Err(e) => panic!("pause({key:?}): {e}"),
                        }
                    } else {
                        let any = paused.iter().any(|&k| key.is_none() || k == key);
                        match engine.resume(key) {
                            Ok(_) => {
                                pause_counts[1] += 1;
                                assert!(any, "resume of {key:?} over {paused:?}");
                                paused.retain(|&k| !(key.is_none() || k == key));
                                for (&q, h) in held.iter_mut() {
                                    if h.paused.is_some_and(|k| key.is_none() || k == key) {
                                        h.paused = None;
                                        if h.byte == 0 {
                                            tag = tag.wrapping_add(1).max(1);
                                            h.byte = tag;
                                            host.fill(DevicePtr(q), Bytes(h.len), tag).unwrap();
                                        }
                                    }
                                }
                            }
                            Err(EngineError::Pause(PauseError::NotPaused(_))) => assert!(!any),
                            // Over the limit, or a refused map: everything stays paused.
                            Err(
                                EngineError::Pause(PauseError::OverLimit { .. })
                                | EngineError::Device(_),
                            ) => assert!(any),
                            Err(e) => panic!("resume({key:?}): {e}"),
                        }
                    }
                }
            }
            check(&engine, &host, &mut held);
        }
        Ok(())
    })();

    // Everything paused comes back (under a limit large enough), contents checked.
    if !paused.is_empty() {
        engine
            .set_memory_limit(MemoryLimit::Bytes(Bytes(256 << 20)))
            .unwrap();
        let mut resumed = false;
        for _ in 0..4 {
            if engine.resume(None).is_ok() {
                resumed = true;
                break;
            }
        }
        assert!(resumed, "resume everything at the end");
        for (&q, h) in held.iter_mut() {
            if h.paused.take().is_some() && h.byte == 0 {
                h.byte = 1;
                host.fill(DevicePtr(q), Bytes(h.len), 1).unwrap();
            }
        }
    }
    for p in live.drain(..) {
        let h = &held[&p];
        assert!(
            host.check(DevicePtr(p), Bytes(h.len), h.byte).unwrap(),
            "sentinel at {p:#x} at the end"
        );
        engine.free(DevicePtr(p)).unwrap();
    }
    engine.empty_cache().unwrap();
    held.retain(|&q, _| engine.block_info(DevicePtr(q)).is_ok());
    assert!(held.is_empty(), "frees never completed");
    engine.check_invariants().unwrap();
    // What stays: a loaded plan's pool (pinned), wholly free or not yet mapped (it is
    // mapped granule by granule as requests first need it).
    let snap = engine.snapshot().unwrap();
    let plan_loaded = engine.plan_stats().unwrap().is_some();
    assert!(
        snap.len() <= usize::from(plan_loaded),
        "arenas left after empty_cache"
    );
    assert!(snap.iter().all(|seg| {
        seg.blocks
            .iter()
            .all(|b| matches!(b.state, BlockState::Free | BlockState::Unmapped))
    }));
    let pool: u64 = snap.iter().map(|seg| seg.mapped.get()).sum();
    let s = engine.stats().unwrap();
    for arr in [s.allocated_bytes, s.active_bytes, s.requested_bytes] {
        assert_eq!(arr[0].current, 0);
    }
    assert_eq!(s.reserved_bytes[0].current as u64, pool);
    assert_eq!(s.segment[0].current as usize, snap.len());
    if std::env::var_os("ENGINE_OPS_STATS").is_some() {
        eprintln!("plan stats: {:?}", engine.plan_stats().unwrap());
        eprintln!(
            "pauses {} resumes {} paused frees refused {}",
            pause_counts[0], pause_counts[1], pause_counts[2]
        );
    }
    assert_eq!(host.mapped_bytes(), Bytes(pool));
    assert_eq!(
        host.counters().partial_unmaps,
        0,
        "part of a mapping unmapped"
    );
    if let Some(t) = engine.take_trace().unwrap() {
        if !t.events.is_empty() {
            t.validate().expect("recorded trace is valid");
        }
    }
    Ok(())
}

/// Requests of sizes the program also asks for, at random 512-B offsets in a small
/// pool, with random lifetimes; often invalid (overlapping), which the engine rejects.
fn random_plan(u: &mut Unstructured<'_>) -> Result<Plan> {
    let pool = u.int_in_range(1u64..=64)? << 13;
    let section = |u: &mut Unstructured<'_>, n: usize, len: u64| -> Result<Vec<PlannedRequest>> {
        let mut v = Vec::new();
        for t in 0..n as u64 {
            let size = u.int_in_range(1u64..=8192)?;
            let offset = u.int_in_range(0..=(pool - size.min(pool)) / 512)? * 512;
            let end = if u.int_in_range(0u8..=7)? == 0 {
                NEVER_FREED
            } else {
                (t + u.int_in_range(1u64..=4)?).min(len)
            };
            v.push(PlannedRequest {
                size: Bytes(size),
                // Two streams half the time, so that ranges pass between streams and
                // requests wait for the other stream's pending frees.
                stream: StreamId(u.int_in_range(0u64..=3)? / 2),
                offset: Offset(offset),
                start: t,
                end: end.max(t + 1),
            });
        }
        Ok(v)
    };
    let (np, ni) = (u.int_in_range(0usize..=6)?, u.int_in_range(1usize..=12)?);
    let prologue = section(u, np, np as u64 + 4)?;
    let iteration = section(u, ni, ni as u64)?;
    Ok(Plan {
        device: DeviceId(0),
        alignment: Bytes(512),
        pool_size: Bytes(pool),
        prologue_len: np as u64 + 4,
        prologue,
        iteration_len: ni as u64,
        iteration,
        ..Plan::default()
    })
}

fn check(engine: &Engine<Arc<HostMemory>>, host: &HostMemory, held: &mut BTreeMap<u64, Held>) {
    engine.check_invariants().unwrap();
    let (mut allocated, mut count, mut active, mut requested) = (0, 0, 0, 0);
    let mut end = 0;
    held.retain(|&p, h| {
        if !h.freed {
            return true;
        }
        match engine.block_info(DevicePtr(p)) {
            Ok(info) => {
                assert_eq!(info.state, BlockState::PendingFree);
                assert!(
                    host.check(DevicePtr(p), Bytes(h.len), h.byte).unwrap(),
                    "pending {p:#x} reused"
                );
                true
            }
            Err(_) => false,
        }
    });
    // The engine's fences: pending blocks nobody holds (their size is their request).
    for seg in engine.snapshot().unwrap() {
        for b in &seg.blocks {
            if b.state == BlockState::PendingFree && !held.contains_key(&b.addr.get()) {
                active += b.size.get();
                requested += b.size.get();
            }
        }
    }
    for (&p, h) in held.iter() {
        assert!(p >= end, "held blocks overlap at {p:#x}");
        end = p + h.len;
        active += h.len;
        requested += h.requested;
        if !h.freed {
            allocated += h.len;
            count += 1;
        }
    }
    let s = engine.stats().unwrap();
    assert_eq!(s.allocated_bytes[0].current as u64, allocated);
    assert_eq!(s.allocation[0].current as u64, count);
    assert_eq!(s.active_bytes[0].current as u64, active);
    assert_eq!(s.requested_bytes[0].current as u64, requested);
    let paused = engine.paused_bytes().unwrap().get();
    assert!(s.reserved_bytes[0].current as u64 + paused >= active);
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
