//! Pause / resume's host buffers (`DeviceMemory::alloc_host`, module `engine::pause`,
//! "Host memory"): one buffer per paused group, cached per pause key across cycles and
//! reused (no new host allocation on the next pause of the key), freed only by
//! `release_host_buffers` (not by `empty_cache`) or when the key's blocks change, and a
//! pageable fallback when the device cannot allocate one. On the host-memory device,
//! whose host allocations are counted and can be made to fail.

use std::sync::Arc;

use stweaver_core::engine::{DevicePtr, Engine, EngineConfig, HostBackup, HostMemory};
use stweaver_core::units::{Bytes, StreamId};

const G: u64 = 1 << 20;
const S: StreamId = StreamId(0);

fn engine() -> (Arc<HostMemory>, Engine<Arc<HostMemory>>) {
    let dev = Arc::new(HostMemory::new(Bytes(64 * G), Bytes(G)));
    let cfg = EngineConfig {
        arena_size: Some(Bytes(64 * G)),
        ..EngineConfig::default()
    };
    let e = Engine::new(dev.clone(), cfg).unwrap();
    (dev, e)
}

/// Blocks of `tag`, each filled with its own byte: large ones in their own units, and
/// small neighbours that share units (contiguous runs of one group).
fn tagged(
    dev: &HostMemory,
    e: &Engine<Arc<HostMemory>>,
    tag: u32,
    sizes: &[u64],
) -> Vec<(DevicePtr, u64, u8)> {
    e.set_tag(tag).unwrap();
    let out = sizes
        .iter()
        .enumerate()
        .map(|(k, &s)| {
            let p = e.malloc(Bytes(s), S).unwrap();
            let byte = (tag as u8).wrapping_mul(16).wrapping_add(k as u8 + 1);
            dev.fill(p, Bytes(s), byte).unwrap();
            (p, s, byte)
        })
        .collect();
    e.set_tag(0).unwrap();
    out
}

fn intact(dev: &HostMemory, blocks: &[(DevicePtr, u64, u8)]) -> bool {
    blocks
        .iter()
        .all(|&(p, s, b)| dev.check(p, Bytes(s), b).unwrap())
}

const SIZES: [u64; 7] = [3 * G + 512, 5 * G, 4096, 4096, 8192, G + 4096, 2 * G];

#[test]
fn the_second_pause_of_a_key_reuses_its_host_buffers_and_contents_survive_cycles() {
    let (dev, e) = engine();
    // Untagged memory first, in its own units.
    let other = tagged(&dev, &e, 0, &[2 * G]);
    let kv = tagged(&dev, &e, 7, &SIZES);
    let first = e.pause(Some(7), true).unwrap();
    assert!(first.host_allocs > 0);
    assert_eq!(dev.host_allocs(), first.host_allocs as u64);
    assert_eq!((first.pinned, first.fallbacks), (first.copied, 0));
    // One exact buffer per group, holding every live byte once.
    let held = e.host_backup().unwrap();
    assert_eq!(
        held,
        HostBackup {
            in_use: first.copied,
            cached: Bytes(0),
            pinned: first.copied,
            allocations: first.host_allocs as u64,
            fallbacks: 0,
        }
    );
    assert_eq!(dev.host_bytes(), first.copied);
    let mut cur = kv.clone();
    for cycle in 0..20 {
        let r = e.resume(Some(7)).unwrap();
        assert_eq!((r.copied, r.pinned), (first.copied, first.copied));
        assert!(intact(&dev, &cur), "cycle {cycle}");
        assert!(intact(&dev, &other));
        e.check_invariants().unwrap();
        // Resumed: the buffers stay, idle, for the next pause of the key.
        let held = e.host_backup().unwrap();
        assert_eq!((held.in_use, held.cached), (Bytes(0), first.copied));
        assert_eq!(dev.host_bytes(), first.copied);
        // The program writes new contents between pauses.
        for c in cur.iter_mut() {
            c.2 = c.2.wrapping_add(cycle as u8 + 1);
            dev.fill(c.0, Bytes(c.1), c.2).unwrap();
        }
        // empty_cache gives device memory back, never the host buffers.
        e.empty_cache().unwrap();
        assert_eq!(e.host_backup().unwrap().cached, first.copied);
        let p = e.pause(Some(7), true).unwrap();
        assert_eq!(
            (p.copied, p.pinned, p.host_allocs),
            (first.copied, first.copied, 0)
        );
        assert_eq!(dev.host_allocs(), first.host_allocs as u64, "cycle {cycle}");
        assert_eq!(dev.host_bytes(), first.copied);
        e.resume(Some(7)).unwrap();
        assert!(intact(&dev, &cur), "cycle {cycle}");
        e.pause(Some(7), true).unwrap();
    }
    e.resume(Some(7)).unwrap();
    // A pause without contents takes no buffer and leaves the cache alone.
    let r = e.pause(Some(7), false).unwrap();
    assert_eq!((r.copied, r.host_allocs), (Bytes(0), 0));
    assert_eq!(e.host_backup().unwrap().cached, first.copied);
    e.resume(Some(7)).unwrap();
    // Released on request: the next pause allocates again.
    assert_eq!(e.release_host_buffers().unwrap(), first.copied);
    assert_eq!(dev.host_bytes(), Bytes(0));
    assert_eq!(e.host_backup().unwrap().cached, Bytes(0));
    let r = e.pause(Some(7), true).unwrap();
    assert_eq!(r.host_allocs, first.host_allocs);
    e.resume(Some(7)).unwrap();
    e.check_invariants().unwrap();
}

#[test]
fn each_key_keeps_its_own_buffers_and_a_changed_key_frees_what_it_no_longer_needs() {
    let (dev, e) = engine();
    let a = tagged(&dev, &e, 1, &[3 * G, 4 * G]);
    let b = tagged(&dev, &e, 2, &[2 * G]);
    e.pause(Some(1), true).unwrap();
    e.pause(Some(2), true).unwrap();
    assert_eq!(e.host_backup().unwrap().in_use, Bytes(9 * G));
    e.resume(None).unwrap();
    assert!(intact(&dev, &a) && intact(&dev, &b));
    assert_eq!(e.host_backup().unwrap().cached, Bytes(9 * G));
    let allocs = dev.host_allocs();
    // Tag 2 pauses again: its own buffer, tag 1's stay cached.
    let r = e.pause(Some(2), true).unwrap();
    assert_eq!(r.host_allocs, 0);
    let held = e.host_backup().unwrap();
    assert_eq!((held.in_use, held.cached), (Bytes(2 * G), Bytes(7 * G)));
    e.resume(Some(2)).unwrap();
    // Tag 1 drops its 4 MiB block: the next pause reuses the 3 MiB buffer and frees the
    // one it no longer needs.
    e.free(a[1].0).unwrap();
    let r = e.pause(Some(1), true).unwrap();
    assert_eq!((r.copied, r.host_allocs), (Bytes(3 * G), 0));
    assert_eq!(dev.host_allocs(), allocs);
    assert_eq!(dev.host_bytes(), Bytes(3 * G + 2 * G));
    e.resume(Some(1)).unwrap();
    assert!(intact(&dev, &a[..1]));
    // The every-tag key has buffers of its own.
    let r = e.pause(None, true).unwrap();
    assert_eq!(r.host_allocs, 2);
    e.resume(None).unwrap();
    assert_eq!(e.host_backup().unwrap().cached, Bytes(2 * (3 * G + 2 * G)));
    assert!(intact(&dev, &a[..1]) && intact(&dev, &b));
    e.check_invariants().unwrap();
}

#[test]
fn without_host_buffers_the_pause_falls_back_to_pageable_memory() {
    let (dev, e) = engine();
    let kv = tagged(&dev, &e, 3, &SIZES);
    dev.fail_host_allocs(true);
    let r = e.pause(Some(3), true).unwrap();
    assert!(r.fallbacks > 0);
    assert_eq!((r.host_allocs, r.pinned), (0, Bytes(0)));
    assert_eq!(dev.host_allocs(), 0);
    let held = e.host_backup().unwrap();
    assert_eq!((held.in_use, held.pinned), (r.copied, Bytes(0)));
    assert_eq!(held.fallbacks, r.fallbacks as u64);
    let back = e.resume(Some(3)).unwrap();
    assert_eq!((back.copied, back.pinned), (r.copied, Bytes(0)));
    assert!(intact(&dev, &kv));
    // Fallback memory is not kept: the next pause tries the device again.
    assert_eq!(e.host_backup().unwrap().cached, Bytes(0));
    dev.fail_host_allocs(false);
    let again = e.pause(Some(3), true).unwrap();
    assert_eq!((again.fallbacks, again.host_allocs), (0, r.fallbacks));
    assert_eq!(again.pinned, r.copied);
    e.resume(Some(3)).unwrap();
    assert!(intact(&dev, &kv));
    e.check_invariants().unwrap();
}

#[test]
fn a_refused_resume_keeps_the_contents_in_their_buffers() {
    let (dev, e) = engine();
    let kv = tagged(&dev, &e, 4, &[3 * G]);
    let r = e.pause(Some(4), true).unwrap();
    dev.fail_map_in(2);
    assert!(e.resume(Some(4)).is_err());
    assert_eq!(e.host_backup().unwrap().in_use, r.copied);
    e.resume(Some(4)).unwrap();
    assert!(intact(&dev, &kv));
    assert_eq!(e.host_backup().unwrap().cached, r.copied);
    assert_eq!(dev.host_allocs(), 1);
}
