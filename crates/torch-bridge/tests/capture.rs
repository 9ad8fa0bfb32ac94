//! CUDA graph private pools through the bridge over host memory: no device
//! synchronisation (so no cache given back) while a capture allocates, a graph pool's
//! free memory (the graph's scratch) never given back while the pool is in use (pause
//! included), and an out-of-memory in one pool first empties the device's other pools.

mod common;

use common::{DEFAULT, GRAPH, MIB, S0, online_runtime as runtime};
use stweaver_core::engine::{DevicePtr, HostMemory};
use stweaver_core::units::Bytes;
use stweaver_torch::Runtime;

fn reserved(rt: &Runtime) -> i64 {
    rt.device_stats(0).unwrap().reserved_bytes.all.current
}

fn writable(dev: &HostMemory, p: usize, len: u64) -> bool {
    dev.fill(DevicePtr(p as u64), Bytes(len), 0x33).is_ok()
}

#[test]
fn no_synchronisation_and_no_cache_given_back_during_a_capture() {
    let (rt, dev) = runtime(64);
    // 40 MiB cached in the default pool.
    let a = rt.malloc(0, (40 * MIB) as usize, S0, DEFAULT).unwrap();
    rt.free(a).unwrap();
    let cached = reserved(&rt);
    assert!(cached >= (40 * MIB) as i64);
    rt.pool_begin_allocate(0, GRAPH).unwrap();
    let syncs = dev.counters().synchronizes;
    // 32 MiB more do not fit the 64 MiB device beside the cache, and the cache cannot
    // be given back without a synchronisation: out of memory (0), the capture intact.
    assert_eq!(rt.malloc(0, (32 * MIB) as usize, S0, GRAPH).unwrap(), 0);
    rt.empty_cache(0, DEFAULT).unwrap();
    assert_eq!(
        dev.counters().synchronizes,
        syncs,
        "synchronised during a capture"
    );
    assert_eq!(reserved(&rt), cached, "cache given back during a capture");
    // What fits is served.
    let small = rt.malloc(0, (8 * MIB) as usize, S0, GRAPH).unwrap();
    assert_ne!(small, 0);
    rt.pool_end_allocate(0, GRAPH).unwrap();
    assert!(rt.pool_end_allocate(0, GRAPH).is_err(), "ended twice");
    // After the capture, the graph pool's out-of-memory empties the default pool first.
    let big = rt.malloc(0, (32 * MIB) as usize, S0, GRAPH).unwrap();
    assert_ne!(big, 0);
    assert!(dev.counters().synchronizes > syncs);
    for p in [small, big] {
        rt.free(p).unwrap();
    }
    rt.pool_release(0, GRAPH).unwrap();
}

#[test]
fn a_graph_pools_scratch_stays_mapped_through_oom_and_pause() {
    let (rt, dev) = runtime(64);
    rt.pool_begin_allocate(0, GRAPH).unwrap();
    rt.set_tag(5).unwrap();
    let out = rt.malloc(0, (4 * MIB) as usize, S0, GRAPH).unwrap();
    // Freed during the capture: every replay of the graph writes it again.
    let scratch = rt.malloc(0, (4 * MIB) as usize, S0, GRAPH).unwrap();
    rt.free(scratch).unwrap();
    rt.set_tag(0).unwrap();
    rt.pool_end_allocate(0, GRAPH).unwrap();
    // An allocation of the pool that does not fit does not give the scratch back.
    assert_eq!(rt.malloc(0, (62 * MIB) as usize, S0, GRAPH).unwrap(), 0);
    assert!(
        writable(&dev, scratch, 4 * MIB),
        "scratch unmapped by an OOM retry"
    );
    // Pausing the region pauses `out`, not the free scratch.
    let r = rt.pause(0, 5, true).unwrap();
    assert_eq!(r.bytes, 4 * MIB);
    assert!(
        writable(&dev, scratch, 4 * MIB),
        "scratch unmapped by a pause"
    );
    rt.resume(0, 5).unwrap();
    assert!(writable(&dev, out, 4 * MIB) && writable(&dev, scratch, 4 * MIB));
    // empty_cache keeps it while the pool is in use, and gives it back once released.
    rt.empty_cache(0, DEFAULT).unwrap();
    assert!(
        writable(&dev, scratch, 4 * MIB),
        "scratch given back by empty_cache"
    );
    rt.free(out).unwrap();
    rt.pool_release(0, GRAPH).unwrap();
    rt.empty_cache(0, DEFAULT).unwrap();
    assert_eq!(reserved(&rt), 0);
    assert_eq!(dev.mapped_bytes().get(), 0);
}
