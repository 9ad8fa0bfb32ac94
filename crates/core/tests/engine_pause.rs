//! Pause / resume with addresses kept (`Engine::pause`, `Engine::resume`, issue #17),
//! on the host-memory device with real bytes: contents and addresses across cycles, no
//! allocation in paused ranges, exact stats (`check_invariants` recomputes every stat
//! from the blocks), the errors, the memory limit at resume, and random programs.

use std::sync::Arc;

use proptest::prelude::*;
use stweaver_core::engine::{
    DevicePtr, Engine, EngineConfig, EngineError, HostMemory, MemoryLimit, PauseError,
    VirtualMemory,
};
use stweaver_core::units::{Bytes, StreamId};

const G: u64 = 1 << 20;
const S: StreamId = StreamId(0);

fn engine(capacity: u64) -> (Arc<HostMemory>, Engine<Arc<HostMemory>>) {
    let dev = Arc::new(HostMemory::new(Bytes(capacity), Bytes(G)));
    let cfg = EngineConfig {
        arena_size: Some(Bytes(64 * G)),
        ..EngineConfig::default()
    };
    let e = Engine::new(dev.clone(), cfg).unwrap();
    (dev, e)
}

fn reserved<D: stweaver_core::engine::DeviceMemory>(e: &Engine<D>) -> u64 {
    e.stats().unwrap().reserved_bytes[0].current as u64
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

#[test]
fn contents_and_addresses_survive_100_cycles_and_nothing_lands_in_paused_memory() {
    let (dev, e) = engine(64 * G);
    // Untagged weights first, in their own granules (large pool).
    let w = e.malloc(Bytes(2 * G), S).unwrap();
    dev.fill(w, Bytes(2 * G), 0x11).unwrap();
    e.set_tag(7).unwrap();
    let sizes = [3 * G + 512, 5 * G, G + 4096, 2 * G];
    let kv: Vec<(DevicePtr, u64, u8)> = sizes
        .iter()
        .enumerate()
        .map(|(k, &s)| {
            let p = e.malloc(Bytes(s), S).unwrap();
            dev.fill(p, Bytes(s), 0xA0 + k as u8).unwrap();
            (p, s, 0xA0 + k as u8)
        })
        .collect();
    e.set_tag(0).unwrap();
    let before = reserved(&e);
    let stats_before = e.stats().unwrap();
    for cycle in 0..100 {
        let r = e.pause(Some(7), true).unwrap();
        assert_eq!(r.blocks, kv.len());
        assert!(r.bytes.get() >= sizes.iter().sum::<u64>());
        assert_eq!(
            r.copied.get(),
            sizes.iter().map(|s| s.div_ceil(512) * 512).sum()
        );
        assert_eq!(e.paused_bytes().unwrap(), r.bytes);
        assert_eq!(reserved(&e), before - r.bytes.get(), "cycle {cycle}");
        assert_eq!(dev.mapped_bytes().get(), reserved(&e));
        e.check_invariants().unwrap();
        // Allocated bytes are unchanged: the tensors still exist.
        let s = e.stats().unwrap();
        assert_eq!(
            s.allocated_bytes.map(|x| x.current),
            stats_before.allocated_bytes.map(|x| x.current)
        );
        // New allocations while paused never land in paused ranges.
        let extra: Vec<(DevicePtr, u64)> = [G, 3 * G, 4096, 7 * G]
            .iter()
            .map(|&s| (e.malloc(Bytes(s), S).unwrap(), s))
            .collect();
        for &(p, s) in &extra {
            for &(q, qs, _) in &kv {
                assert!(!overlaps((p.get(), s), (q.get(), qs)), "{p} in paused {q}");
            }
            dev.fill(p, Bytes(s), 0xEE).unwrap();
        }
        for (p, _) in extra {
            e.free(p).unwrap();
        }
        e.check_invariants().unwrap();
        let r2 = e.resume(Some(7)).unwrap();
        assert_eq!((r2.blocks, r2.bytes), (r.blocks, r.bytes));
        assert_eq!(e.paused_bytes().unwrap(), Bytes(0));
        e.check_invariants().unwrap();
        for &(p, s, byte) in &kv {
            assert!(
                dev.check(p, Bytes(s), byte).unwrap(),
                "cycle {cycle}: {p} lost"
            );
            assert_eq!(e.block_info(p).unwrap().addr, p);
        }
        assert!(dev.check(w, Bytes(2 * G), 0x11).unwrap());
        // Released cache aside, reserved memory is back to the paused bytes plus weights.
        assert!(reserved(&e) >= r.bytes.get() + 2 * G);
    }
    for (p, _, _) in kv {
        e.free(p).unwrap();
    }
    e.free(w).unwrap();
    e.check_invariants().unwrap();
}

#[test]
fn paused_blocks_refuse_free_record_stream_and_a_second_pause() {
    let (_dev, e) = engine(64 * G);
    e.set_tag(3).unwrap();
    let p = e.malloc(Bytes(2 * G), S).unwrap();
    e.set_tag(0).unwrap();
    assert_eq!(
        e.resume(Some(3)),
        Err(EngineError::Pause(PauseError::NotPaused(Some(3))))
    );
    assert_eq!(
        e.pause(Some(0), true),
        Err(EngineError::Pause(PauseError::Untagged))
    );
    e.pause(Some(3), true).unwrap();
    assert_eq!(e.free(p), Err(EngineError::Paused { ptr: p, tag: 3 }));
    assert_eq!(
        e.record_stream(p, StreamId(9)),
        Err(EngineError::Paused { ptr: p, tag: 3 })
    );
    assert_eq!(
        e.pause(Some(3), true),
        Err(EngineError::Pause(PauseError::AlreadyPaused(Some(3))))
    );
    assert_eq!(
        e.pause(None, true),
        Err(EngineError::Pause(PauseError::AlreadyPaused(None)))
    );
    assert_eq!(e.paused_tags().unwrap(), vec![Some(3)]);
    e.check_invariants().unwrap();
    e.resume(None).unwrap();
    assert_eq!(
        e.resume(None),
        Err(EngineError::Pause(PauseError::NotPaused(None)))
    );
    e.free(p).unwrap();
    e.check_invariants().unwrap();
}

#[test]
fn a_unit_holding_two_tags_is_refused_naming_it_and_nothing_changes() {
    let (dev, e) = engine(64 * G);
    e.set_tag(1).unwrap();
    let a = e.malloc(Bytes(4096), S).unwrap();
    e.set_tag(2).unwrap();
    let b = e.malloc(Bytes(4096), S).unwrap(); // same small-pool granule
    dev.fill(a, Bytes(4096), 1).unwrap();
    let before = e.stats().unwrap();
    let err = e.pause(Some(1), true).unwrap_err();
    match &err {
        EngineError::Pause(PauseError::MixedUnit {
            addr,
            size,
            tag: 1,
            other: 2,
        }) => assert!(addr.get() <= a.get() && a.get() < addr.get() + size.get()),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("tag 1 and of tag 2"));
    assert_eq!(e.paused_bytes().unwrap(), Bytes(0));
    assert_eq!(e.stats().unwrap().allocated_bytes, before.allocated_bytes);
    assert!(dev.check(a, Bytes(4096), 1).unwrap());
    // Pausing every tag takes the unit whole.
    e.pause(None, true).unwrap();
    e.check_invariants().unwrap();
    e.resume(None).unwrap();
    assert!(dev.check(a, Bytes(4096), 1).unwrap());
    e.free(a).unwrap();
    e.free(b).unwrap();
}

#[test]
fn resume_over_the_memory_limit_is_refused_and_everything_stays_paused() {
    let (dev, e) = engine(64 * G);
    e.set_memory_limit(MemoryLimit::Bytes(Bytes(8 * G)))
        .unwrap();
    e.set_tag(5).unwrap();
    let p = e.malloc(Bytes(6 * G), S).unwrap();
    dev.fill(p, Bytes(6 * G), 0x5A).unwrap();
    e.set_tag(0).unwrap();
    let r = e.pause(Some(5), true).unwrap();
    assert_eq!(r.bytes, Bytes(6 * G));
    // The memory given back serves others now.
    let q = e.malloc(Bytes(5 * G), S).unwrap();
    assert!(!overlaps((q.get(), 5 * G), (p.get(), 6 * G)));
    let err = e.resume(Some(5)).unwrap_err();
    assert!(
        matches!(err, EngineError::Pause(PauseError::OverLimit { needed, .. }) if needed == Bytes(6 * G)),
        "{err:?}"
    );
    assert_eq!(e.paused_bytes().unwrap(), Bytes(6 * G));
    assert_eq!(e.paused_tags().unwrap(), vec![Some(5)]);
    e.check_invariants().unwrap();
    e.free(q).unwrap();
    e.empty_cache().unwrap();
    e.resume(Some(5)).unwrap();
    assert!(dev.check(p, Bytes(6 * G), 0x5A).unwrap());
    e.check_invariants().unwrap();
}

#[test]
fn a_refused_map_at_resume_leaves_everything_paused() {
    let (dev, e) = engine(64 * G);
    e.set_tag(4).unwrap();
    let p = e.malloc(Bytes(3 * G), S).unwrap();
    dev.fill(p, Bytes(3 * G), 0x44).unwrap();
    e.pause(Some(4), true).unwrap();
    dev.fail_map_in(2); // the second unit's map fails
    assert!(matches!(e.resume(Some(4)), Err(EngineError::Device(_))));
    assert_eq!(e.paused_bytes().unwrap(), Bytes(3 * G));
    assert_eq!(dev.mapped_bytes().get(), reserved(&e));
    e.check_invariants().unwrap();
    e.resume(Some(4)).unwrap();
    assert!(dev.check(p, Bytes(3 * G), 0x44).unwrap());
}

#[test]
fn without_keep_addresses_stay_and_the_accounting_device_pauses_too() {
    let (_dev, e) = engine(64 * G);
    e.set_tag(1).unwrap();
    let p = e.malloc(Bytes(2 * G), S).unwrap();
    let r = e.pause(Some(1), false).unwrap();
    assert_eq!(r.copied, Bytes(0));
    e.resume(Some(1)).unwrap();
    assert_eq!(e.block_info(p).unwrap().addr, p);

    let v = Engine::new(
        VirtualMemory::new(Bytes(64 * G), Bytes(G)),
        EngineConfig::default(),
    )
    .unwrap();
    v.set_tag(1).unwrap();
    let q = v.malloc(Bytes(2 * G), S).unwrap();
    assert_eq!(v.pause(None, true).unwrap().bytes, Bytes(2 * G));
    assert_eq!(v.device().mapped_bytes(), Bytes(0));
    v.resume(None).unwrap();
    assert_eq!(v.device().mapped_bytes(), Bytes(2 * G));
    v.free(q).unwrap();
    v.check_invariants().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Alloc { tag: u32, size: u64 },
    Free(usize),
    Pause(Option<u32>),
    Resume(Option<u32>),
}

fn op() -> impl Strategy<Value = Op> {
    let tag = prop_oneof![Just(0u32), Just(1), Just(2)];
    let size = prop_oneof![1u64..4096, 4096..(G + 1), G..(4 * G)];
    let key = prop_oneof![Just(None), Just(Some(1u32)), Just(Some(2))];
    prop_oneof![
        4 => (tag, size).prop_map(|(tag, size)| Op::Alloc { tag, size }),
        3 => any::<usize>().prop_map(Op::Free),
        1 => key.clone().prop_map(Op::Pause),
        1 => key.prop_map(Op::Resume),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Random alloc / free / pause / resume: live blocks never overlap, contents
    /// survive, every stat is exact, paused bytes are what the device gave back.
    #[test]
    fn random_pause_programs_keep_contents_and_never_alias(
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let (dev, e) = engine(48 * G);
        // (ptr, size, tag, sentinel, the pause holding it)
        type Live = (DevicePtr, u64, u32, u8, Option<Option<u32>>);
        let mut live: Vec<Live> = Vec::new();
        let mut paused: Vec<Option<u32>> = Vec::new();
        let matches = |key: Option<u32>, tag: u32| tag != 0 && key.is_none_or(|t| t == tag);
        let mut n = 0u8;
        for op in ops {
            match op {
                Op::Alloc { tag, size } => {
                    e.set_tag(tag).unwrap();
                    if let Ok(p) = e.malloc(Bytes(size), S) {
                        for &(q, qs, ..) in &live {
                            prop_assert!(!overlaps((p.get(), size), (q.get(), qs)));
                        }
                        n = n.wrapping_add(1);
                        dev.fill(p, Bytes(size), n).unwrap();
                        live.push((p, size, tag, n, None));
                    }
                }
                Op::Free(k) if !live.is_empty() => {
                    let (p, _, tag, _, by) = live[k % live.len()];
                    let r = e.free(p);
                    if by.is_some() {
                        prop_assert_eq!(r, Err(EngineError::Paused { ptr: p, tag }));
                    } else {
                        prop_assert_eq!(r, Ok(()));
                        live.remove(k % live.len());
                    }
                }
                Op::Free(_) => {}
                Op::Pause(key) => {
                    let clash = paused.iter().any(|&k| key.is_none() || k.is_none() || k == key);
                    match e.pause(key, true) {
                        Ok(_) => {
                            prop_assert!(!clash);
                            paused.push(key);
                            for l in live.iter_mut().filter(|l| matches(key, l.2)) {
                                l.4 = Some(key);
                            }
                        }
                        Err(EngineError::Pause(PauseError::AlreadyPaused(_))) => prop_assert!(clash),
                        Err(EngineError::Pause(PauseError::MixedUnit { .. })) => prop_assert!(!clash),
                        Err(other) => prop_assert!(false, "{other:?}"),
                    }
                }
                Op::Resume(key) => {
                    let any = paused.iter().any(|&k| key.is_none() || k == key);
                    match e.resume(key) {
                        Ok(_) => {
                            prop_assert!(any);
                            paused.retain(|&k| !(key.is_none() || k == key));
                            for l in live.iter_mut() {
                                if l.4.is_some_and(|k| key.is_none() || k == key) {
                                    l.4 = None;
                                }
                            }
                        }
                        Err(EngineError::Pause(PauseError::NotPaused(_))) => prop_assert!(!any),
                        Err(other) => prop_assert!(false, "{other:?}"),
                    }
                }
            }
            e.check_invariants().map_err(|m| TestCaseError::fail(m.to_string()))?;
            prop_assert_eq!(dev.mapped_bytes().get(), reserved(&e));
            for &(p, s, _, byte, by) in &live {
                if by.is_none() {
                    prop_assert!(dev.check(p, Bytes(s), byte).unwrap(), "{} lost", p);
                }
            }
        }
        e.resume(None).ok();
        for (p, s, _, byte, _) in live {
            prop_assert!(dev.check(p, Bytes(s), byte).unwrap());
            e.free(p).unwrap();
        }
        e.check_invariants().map_err(|m| TestCaseError::fail(m.to_string()))?;
    }
}
