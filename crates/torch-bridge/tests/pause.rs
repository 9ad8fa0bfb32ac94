//! Pause / resume through the bridge over host memory (issue #17): tags on every pool,
//! the device budget, contents kept, errors, all or nothing across a device's pools.

mod common;

use common::{DEFAULT, GRAPH, MIB, S0, online_runtime as runtime};
use stweaver_core::engine::{DevicePtr, EngineError, HostMemory, PauseError};
use stweaver_core::units::Bytes;
use stweaver_torch::ffi::bridge::PoolId;
use stweaver_torch::{BridgeError, Runtime};

fn info(rt: &Runtime) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
    v["devices"][0].clone()
}

fn reserved(rt: &Runtime) -> i64 {
    rt.device_stats(0).unwrap().reserved_bytes.all.current
}

fn fill(dev: &HostMemory, p: usize, len: u64, byte: u8) {
    dev.fill(DevicePtr(p as u64), Bytes(len), byte).unwrap();
}

fn holds(dev: &HostMemory, p: usize, len: u64, byte: u8) -> bool {
    dev.check(DevicePtr(p as u64), Bytes(len), byte).unwrap()
}

fn pause_error(e: BridgeError) -> PauseError {
    match e {
        BridgeError::Engine(EngineError::Pause(p)) => p,
        other => panic!("not a pause error: {other}"),
    }
}

#[test]
fn pause_gives_memory_back_and_resume_restores_contents() {
    let (rt, dev) = runtime(256);
    rt.set_tag(1).unwrap();
    assert_eq!(rt.core().tag(), 1);
    let a = rt.malloc(0, (4 * MIB) as usize, S0, DEFAULT).unwrap();
    let b = rt.malloc(0, (6 * MIB) as usize, S0, DEFAULT).unwrap();
    rt.set_tag(0).unwrap();
    let c = rt.malloc(0, (4 * MIB) as usize, S0, DEFAULT).unwrap();
    fill(&dev, a, 4 * MIB, 0xaa);
    fill(&dev, b, 6 * MIB, 0xbb);
    fill(&dev, c, 4 * MIB, 0xcc);
    let (reserved0, mapped0) = (reserved(&rt), info(&rt)["mapped_bytes"].as_u64().unwrap());
    let allocated0 = rt.device_stats(0).unwrap().allocated_bytes.all.current;

    let r = rt.pause(0, 1, true).unwrap();
    assert_eq!(r.blocks, 2);
    assert!(r.bytes >= 10 * MIB, "{r:?}");
    assert_eq!(r.copied, 10 * MIB);
    assert_eq!(reserved(&rt), reserved0 - r.bytes as i64);
    let i = info(&rt);
    assert_eq!(i["mapped_bytes"].as_u64().unwrap(), mapped0 - r.bytes);
    assert_eq!(i["paused_bytes"].as_u64().unwrap(), r.bytes);
    assert_eq!(i["paused_tags"], serde_json::json!([1]));
    assert_eq!(rt.paused_bytes(0).unwrap(), r.bytes);
    // The tensors still exist.
    assert_eq!(
        rt.device_stats(0).unwrap().allocated_bytes.all.current,
        allocated0
    );

    // Freeing a paused block, or pausing again, is refused.
    let e = rt.free(a).unwrap_err();
    assert!(
        matches!(e, BridgeError::Engine(EngineError::Paused { .. })),
        "{e}"
    );
    assert_eq!(
        pause_error(rt.pause(0, 1, true).unwrap_err()),
        PauseError::AlreadyPaused(Some(1))
    );
    assert_eq!(
        pause_error(rt.pause(0, 0, true).unwrap_err()),
        PauseError::AlreadyPaused(None)
    );
    // Untagged memory serves on, and new memory never lands on the paused ranges.
    assert!(holds(&dev, c, 4 * MIB, 0xcc));
    let d = rt.malloc(0, (8 * MIB) as usize, S0, DEFAULT).unwrap() as u64;
    for (p, len) in [(a as u64, 4 * MIB), (b as u64, 6 * MIB)] {
        assert!(d + 8 * MIB <= p || p + len <= d, "{d:#x} overlaps {p:#x}");
    }
    rt.free(d as usize).unwrap();

    let back = rt.resume(0, 1).unwrap();
    assert_eq!((back.bytes, back.blocks), (r.bytes, 2));
    assert!(holds(&dev, a, 4 * MIB, 0xaa));
    assert!(holds(&dev, b, 6 * MIB, 0xbb));
    assert_eq!(rt.paused_bytes(0).unwrap(), 0);
    assert_eq!(info(&rt)["paused_tags"], serde_json::json!([]));
    assert_eq!(
        pause_error(rt.resume(0, 1).unwrap_err()),
        PauseError::NotPaused(Some(1))
    );
    rt.free(a).unwrap();
    rt.free(b).unwrap();
    rt.free(c).unwrap();
}

#[test]
fn many_cycles_keep_contents() {
    let (rt, dev) = runtime(64);
    rt.set_tag(7).unwrap();
    let a = rt.malloc(0, (4 * MIB) as usize, S0, DEFAULT).unwrap();
    rt.set_tag(0).unwrap();
    for k in 0..100u32 {
        let byte = (k % 251) as u8;
        fill(&dev, a, 4 * MIB, byte);
        // Tag 0: every tagged block.
        let r = rt.pause(0, 0, k % 2 == 0).unwrap();
        assert_eq!(r.blocks, 1);
        assert_eq!(info(&rt)["paused_tags"], serde_json::json!([0]));
        rt.resume(0, 0).unwrap();
        if k % 2 == 0 {
            assert!(holds(&dev, a, 4 * MIB, byte), "cycle {k}");
        }
    }
    assert_eq!(rt.paused_bytes(0).unwrap(), 0);
    rt.free(a).unwrap();
}

#[test]
fn tags_reach_private_pools_and_pause_covers_them() {
    let (rt, dev) = runtime(256);
    rt.pool_incref(0, GRAPH).unwrap();
    rt.set_tag(2).unwrap();
    // An engine opened after set_tag starts with the tag too.
    let other = PoolId {
        first: 0,
        second: 9,
    };
    rt.pool_incref(0, other).unwrap();
    let g = rt.malloc(0, (4 * MIB) as usize, S0, GRAPH).unwrap();
    let o = rt.malloc(0, (4 * MIB) as usize, S0, other).unwrap();
    let d = rt.malloc(0, (4 * MIB) as usize, S0, DEFAULT).unwrap();
    rt.set_tag(0).unwrap();
    for (p, byte) in [(g, 1), (o, 2), (d, 3)] {
        fill(&dev, p, 4 * MIB, byte);
    }
    let mapped0 = dev.mapped_bytes().get();
    let r = rt.pause(0, 2, true).unwrap();
    assert_eq!(r.blocks, 3);
    assert_eq!(dev.mapped_bytes().get(), mapped0 - r.bytes);
    let r2 = rt.resume(0, 2).unwrap();
    assert_eq!(r2.bytes, r.bytes);
    for (p, byte) in [(g, 1), (o, 2), (d, 3)] {
        assert!(holds(&dev, p, 4 * MIB, byte));
    }
    for p in [g, o, d] {
        rt.free(p).unwrap();
    }
}

#[test]
fn a_refusing_pool_undoes_the_whole_device() {
    let (rt, dev) = runtime(256);
    rt.pool_incref(0, GRAPH).unwrap();
    rt.set_tag(3).unwrap();
    let d = rt.malloc(0, (4 * MIB) as usize, S0, DEFAULT).unwrap();
    // Two small blocks of different tags share a unit of the graph pool.
    let s3 = rt.malloc(0, 1000, S0, GRAPH).unwrap();
    rt.set_tag(4).unwrap();
    let s4 = rt.malloc(0, 1000, S0, GRAPH).unwrap();
    rt.set_tag(0).unwrap();
    fill(&dev, d, 4 * MIB, 0x5a);
    let (reserved0, mapped0) = (reserved(&rt), dev.mapped_bytes().get());
    let e = pause_error(rt.pause(0, 3, true).unwrap_err());
    assert!(matches!(e, PauseError::MixedUnit { .. }), "{e}");
    // The default pool, paused first, is back as it was.
    assert_eq!(rt.paused_bytes(0).unwrap(), 0);
    assert_eq!(
        (reserved(&rt), dev.mapped_bytes().get()),
        (reserved0, mapped0)
    );
    assert!(holds(&dev, d, 4 * MIB, 0x5a));
    rt.free(d).unwrap();
    // Nothing is paused: resume says so.
    assert_eq!(
        pause_error(rt.resume(0, 3).unwrap_err()),
        PauseError::NotPaused(Some(3))
    );
    rt.pause(0, 4, true).unwrap_err(); // s3 (tag 3) shares s4's unit
    rt.free(s3).unwrap();
    rt.pause(0, 4, true).unwrap();
    let paused = rt.paused_bytes(0).unwrap();
    assert!(paused > 0);
    assert!(rt.free(s4).is_err());
    // A refusal as already paused leaves the pause in force as it was.
    assert_eq!(
        pause_error(rt.pause(0, 0, true).unwrap_err()),
        PauseError::AlreadyPaused(None)
    );
    assert_eq!(rt.paused_bytes(0).unwrap(), paused);
    rt.resume(0, 0).unwrap();
    rt.free(s4).unwrap();
}

#[test]
fn resume_of_an_unopened_device_is_not_paused() {
    let (rt, _dev) = runtime(64);
    assert_eq!(
        pause_error(rt.resume(0, 0).unwrap_err()),
        PauseError::NotPaused(None)
    );
    assert_eq!(rt.paused_bytes(0).unwrap(), 0);
    assert!(matches!(
        rt.pause(5, 1, true),
        Err(BridgeError::BadDevice { .. })
    ));
}

#[test]
fn a_refused_resume_pauses_the_resumed_pools_again() {
    let (rt, dev) = runtime(64);
    rt.pool_incref(0, GRAPH).unwrap();
    rt.set_tag(5).unwrap();
    let d = rt.malloc(0, (8 * MIB) as usize, S0, DEFAULT).unwrap();
    let g = rt.malloc(0, (8 * MIB) as usize, S0, GRAPH).unwrap();
    rt.set_tag(0).unwrap();
    fill(&dev, d, 8 * MIB, 0x11);
    fill(&dev, g, 8 * MIB, 0x22);
    let r = rt.pause(0, 5, true).unwrap();
    assert_eq!(r.bytes, 16 * MIB);
    // The memory is taken meanwhile: the default pool's 8 MiB fit back, the graph
    // pool's do not.
    let big = rt.malloc(0, (52 * MIB) as usize, S0, DEFAULT).unwrap();
    assert_ne!(big, 0);
    let unmaps0 = dev.counters().unmaps;
    let e = rt.resume(0, 5).unwrap_err();
    assert!(e.to_string().contains("out of memory"), "{e}");
    // The default pool's 4 units were mapped and unmapped again; the graph pool's 2
    // mapped units before the refusal were unmapped by its own resume.
    assert_eq!(dev.counters().unmaps - unmaps0, 6);
    assert_eq!(rt.paused_bytes(0).unwrap(), 16 * MIB);
    assert_eq!(info(&rt)["paused_tags"], serde_json::json!([5]));
    rt.free(big).unwrap();
    rt.empty_cache(0, DEFAULT).unwrap();
    rt.resume(0, 5).unwrap();
    assert!(holds(&dev, d, 8 * MIB, 0x11));
    assert!(holds(&dev, g, 8 * MIB, 0x22));
    rt.free(d).unwrap();
    rt.free(g).unwrap();
}

#[test]
fn kept_contents_reuse_the_devices_host_buffers_and_info_shows_them() {
    let (rt, dev) = runtime(256);
    rt.set_tag(3).unwrap();
    let a = rt.malloc(0, (4 * MIB) as usize, S0, DEFAULT).unwrap();
    rt.set_tag(0).unwrap();
    fill(&dev, a, 4 * MIB, 0x3a);
    let r = rt.pause(0, 3, true).unwrap();
    assert_eq!(r.copied, 4 * MIB);
    // The engines reach the device's host buffers through the tracked wrapper.
    assert_eq!(dev.host_allocs(), 1);
    let h = &info(&rt)["host_backup"];
    assert_eq!(h["in_use_bytes"].as_u64().unwrap(), 4 * MIB);
    assert_eq!(h["pinned_bytes"].as_u64().unwrap(), 4 * MIB);
    rt.resume(0, 3).unwrap();
    assert!(holds(&dev, a, 4 * MIB, 0x3a));
    let h = &info(&rt)["host_backup"];
    assert_eq!(h["in_use_bytes"].as_u64().unwrap(), 0);
    assert_eq!(h["cached_bytes"].as_u64().unwrap(), 4 * MIB);
    // The second pause of the tag takes the cached buffer, even after empty_cache.
    rt.empty_cache(0, DEFAULT).unwrap();
    rt.pause(0, 3, true).unwrap();
    rt.resume(0, 3).unwrap();
    assert_eq!(dev.host_allocs(), 1);
    assert!(holds(&dev, a, 4 * MIB, 0x3a));
    assert_eq!(rt.core().release_host_buffers(0).unwrap(), 4 * MIB);
    assert_eq!(dev.host_bytes(), Bytes(0));
    assert_eq!(
        info(&rt)["host_backup"]["cached_bytes"].as_u64().unwrap(),
        0
    );
    rt.free(a).unwrap();
}
