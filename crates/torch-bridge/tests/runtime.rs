//! The bridge runtime over host memory: everything C++ relies on, without a GPU.

use std::sync::Arc;

use stweaver_core::engine::{DeviceError, DeviceMemory, DevicePtr, HostMemory};
use stweaver_core::trace_file::read_trace_file;
use stweaver_core::units::{Bytes, StreamId};
use stweaver_torch::ffi::bridge::HistoryAction;
use stweaver_torch::tracked::BridgeDevice;
use stweaver_torch::{BridgeError, Core, Runtime, Settings};

mod common;

use common::{DEFAULT, GRAPH, MIB, S0};

const S1: usize = 0x20;

/// A runtime over `n` host devices of `cap_mib` MiB each (2 MiB granules); returns the
/// devices too, so tests can drive their fake events.
fn runtime(mode: &str, trace: &str, n: i32, cap_mib: u64) -> (Runtime, Vec<Arc<HostMemory>>) {
    runtime_with_plan(mode, "", trace, n, cap_mib)
}

/// [`runtime`] with a plan file argument too.
fn runtime_with_plan(
    mode: &str,
    plan: &str,
    trace: &str,
    n: i32,
    cap_mib: u64,
) -> (Runtime, Vec<Arc<HostMemory>>) {
    runtime_with_settings(Settings::parse(mode, plan, trace).unwrap(), n, cap_mib)
}

/// A runtime with `settings` over `n` host devices of `cap_mib` MiB each (2 MiB granules).
fn runtime_with_settings(
    settings: Settings,
    n: i32,
    cap_mib: u64,
) -> (Runtime, Vec<Arc<HostMemory>>) {
    let devs: Vec<Arc<HostMemory>> = (0..n)
        .map(|_| Arc::new(HostMemory::new(Bytes(cap_mib * MIB), Bytes(2 * MIB))))
        .collect();
    let for_factory = devs.clone();
    let factory =
        Box::new(move |d: i32| Ok(for_factory[d as usize].clone() as Arc<dyn BridgeDevice>));
    let rt = Runtime::with_core(Core::new(settings, factory));
    rt.init(n).unwrap();
    (rt, devs)
}

/// `mode` under the budget `budget` (as `STWEAVER_BUDGET` gives it), one host device of
/// `cap_mib` MiB.
fn runtime_with_budget(mode: &str, budget: &str, cap_mib: u64) -> Runtime {
    let settings = Settings::parse(mode, "", "")
        .unwrap()
        .with_budget(Some(stweaver_torch::budget::Budget::parse(budget).unwrap()));
    runtime_with_settings(settings, 1, cap_mib).0
}

#[test]
fn settings_are_validated() {
    assert!(Settings::parse("online", "", "").is_ok());
    assert!(Settings::parse("trace", "", "t.stwt").is_ok());
    for (m, p, t) in [
        ("online", "p", ""),
        ("online", "", "t"),
        ("trace", "", ""),
        ("trace", "p", "t"),
        ("bogus", "", ""),
    ] {
        let e = Settings::parse(m, p, t).unwrap_err();
        assert!(matches!(e, BridgeError::Settings(_)), "{m} {p} {t}: {e}");
    }
    assert!(Settings::parse("plan", "", "").is_err());
    assert!(Settings::parse("plan", "x.stwp", "").is_ok());
    // A trace path in plan mode records the served run.
    assert!(Settings::parse("plan", "p.stwp", "t.stwt").is_ok());
    for (p, t) in [
        ("", ""),
        ("p.stwp", ""),
        ("", "t.stwt"),
        ("p.stwp", "t.stwt"),
    ] {
        assert!(Settings::parse("auto", p, t).is_ok());
    }
    let s = Settings::parse("trace", "", "/tmp/run.stwt").unwrap();
    assert_eq!(s.trace_path_for(0).unwrap().to_str(), Some("/tmp/run.stwt"));
    assert_eq!(
        s.trace_path_for(2).unwrap().to_str(),
        Some("/tmp/run.cuda2.stwt")
    );
}

#[test]
fn use_before_init_and_bad_devices_are_errors() {
    let factory = Box::new(
        |_d: i32| -> stweaver_torch::error::Result<Arc<dyn BridgeDevice>> {
            Err(BridgeError::Settings("no device here".into()))
        },
    );
    let rt = Runtime::with_core(Core::new(
        Settings::parse("online", "", "").unwrap(),
        factory,
    ));
    assert!(matches!(
        rt.malloc(0, 512, S0, DEFAULT),
        Err(BridgeError::NotInitialised)
    ));
    rt.init(1).unwrap();
    assert!(matches!(
        rt.malloc(3, 512, S0, DEFAULT),
        Err(BridgeError::BadDevice { device: 3, .. })
    ));
    // A device that cannot be opened is a clean error naming the device.
    let e = rt.malloc(0, 512, S0, DEFAULT).unwrap_err();
    assert!(e.to_string().contains("cannot open CUDA device 0"), "{e}");
    assert!(matches!(rt.init(2), Err(BridgeError::Reinit { .. })));
    rt.init(1).unwrap();
}

#[test]
fn stats_follow_allocations_exactly() {
    let (rt, _) = runtime("online", "", 1, 64);
    let a = rt.malloc(0, 1000, S0, DEFAULT).unwrap();
    let b = rt.malloc(0, 3 * MIB as usize, S0, DEFAULT).unwrap();
    assert!(a != 0 && b != 0 && a != b);
    let s = rt.device_stats(0).unwrap();
    // 1000 -> 1024 (512-B rounding), 3 MiB stays.
    assert_eq!(s.allocated_bytes.all.current, 1024 + 3 * MIB as i64);
    assert_eq!(s.allocated_bytes.small_pool.current, 1024);
    assert_eq!(s.allocated_bytes.large_pool.current, 3 * MIB as i64);
    assert_eq!(s.requested_bytes.all.current, 1000 + 3 * MIB as i64);
    assert_eq!(s.allocation.all.current, 2);
    assert!(s.reserved_bytes.all.current >= s.allocated_bytes.all.current);
    rt.free(b).unwrap();
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.current, 1024);
    assert_eq!(s.allocated_bytes.all.peak, 1024 + 3 * MIB as i64);
    rt.reset_peak_stats(0).unwrap();
    assert_eq!(rt.device_stats(0).unwrap().allocated_bytes.all.peak, 1024);
    rt.reset_accumulated_stats(0).unwrap();
    let s = rt.device_stats(0).unwrap();
    assert_eq!(
        (s.allocated_bytes.all.allocated, s.allocated_bytes.all.freed),
        (0, 0)
    );
    // empty_cache gives back everything but the granule holding `a`.
    rt.empty_cache(-1, DEFAULT).unwrap();
    assert_eq!(
        rt.device_stats(0).unwrap().reserved_bytes.all.current,
        2 * MIB as i64
    );
    rt.free(a).unwrap();
    rt.empty_cache(0, DEFAULT).unwrap();
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(s.max_split_size, -1);
}

#[test]
fn bad_frees_are_errors_not_crashes() {
    let (rt, _) = runtime("online", "", 1, 16);
    let a = rt.malloc(0, 4096, S0, DEFAULT).unwrap();
    assert!(rt.free(a + 512).is_err());
    rt.free(a).unwrap();
    assert!(rt.free(a).is_err(), "double free must be refused");
    assert!(rt.record_stream(a, S1).is_err());
    assert!(rt.base_allocation(0x1234).is_err());
}

#[test]
fn out_of_memory_returns_zero_with_a_report_and_serving_continues() {
    let (rt, devs) = runtime("online", "", 1, 16);
    let a = rt.malloc(0, 10 * MIB as usize, S0, DEFAULT).unwrap();
    assert_eq!(rt.malloc(0, 10 * MIB as usize, S0, DEFAULT).unwrap(), 0);
    let info = rt.oom_info(0, 10 * MIB as usize).unwrap();
    assert_eq!(info.rounded, 10 * MIB);
    assert_eq!(info.allocated, 10 * MIB);
    assert_eq!(info.device_total, 16 * MIB);
    assert_eq!(info.device_free, devs[0].free_memory().unwrap().get());
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.num_ooms, 1);
    assert_eq!(s.num_alloc_retries, 1);
    // Free and retry: serving goes on.
    rt.free(a).unwrap();
    let b = rt.malloc(0, 10 * MIB as usize, S0, DEFAULT).unwrap();
    assert_ne!(b, 0);
    // A memory fraction is a limit too.
    rt.set_memory_fraction(0, 0.5).unwrap();
    assert_eq!(rt.memory_fraction(0).unwrap(), 0.5);
    assert_eq!(rt.malloc(0, 4 * MIB as usize, S0, DEFAULT).unwrap(), 0);
    let info = rt.oom_info(0, 4 * MIB as usize).unwrap();
    assert_eq!(info.limit, 8 * MIB);
    assert!(matches!(
        rt.set_memory_fraction(0, 1.5),
        Err(BridgeError::BadFraction(_))
    ));
}

#[test]
fn record_stream_defers_reuse_until_the_other_stream_passes() {
    let (rt, devs) = runtime("online", "", 1, 16);
    rt.set_history(true).unwrap();
    let a = rt.malloc(0, 1 << 20, S0, DEFAULT).unwrap();
    rt.record_stream(a, S1).unwrap();
    rt.free(a).unwrap();
    // Still active: the next allocation on S0 must not get `a`.
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.active_bytes.all.current, 1 << 20);
    assert_eq!(s.allocated_bytes.all.current, 0);
    let b = rt.malloc(0, 1 << 20, S0, DEFAULT).unwrap();
    assert_ne!(a, b, "reused memory another stream may still use");
    let ev = rt.drain_history().unwrap();
    let actions: Vec<HistoryAction> = ev.iter().map(|e| e.action).collect();
    assert!(actions.contains(&HistoryAction::FreeRequested));
    assert!(
        !ev.iter()
            .any(|e| e.action == HistoryAction::FreeCompleted && e.addr == a as u64),
        "free completed before the stream passed: {ev:?}"
    );
    // The other stream passes the event: the free completes, reported once.
    devs[0].events().pass_all(StreamId(S1 as u64));
    rt.free(b).unwrap();
    let c = rt.malloc(0, 1 << 20, S0, DEFAULT).unwrap();
    let ev = rt.drain_history().unwrap();
    let done: Vec<_> = ev
        .iter()
        .filter(|e| e.action == HistoryAction::FreeCompleted && e.addr == a as u64)
        .collect();
    assert_eq!(done.len(), 1, "{ev:?}");
    assert_eq!(done[0].size, 1 << 20);
    assert_eq!(
        rt.device_stats(0).unwrap().active_bytes.all.current,
        1 << 20
    );
    rt.free(c).unwrap();
}

#[test]
fn history_reports_allocs_frees_and_mappings_in_order() {
    let (rt, _) = runtime("online", "", 1, 16);
    assert!(rt.drain_history().unwrap().is_empty());
    rt.set_history(true).unwrap();
    let a = rt.malloc(0, 3000, S0, DEFAULT).unwrap();
    rt.free(a).unwrap();
    rt.empty_cache(-1, DEFAULT).unwrap();
    let ev = rt.drain_history().unwrap();
    let kinds: Vec<HistoryAction> = ev.iter().map(|e| e.action).collect();
    assert_eq!(
        kinds,
        vec![
            HistoryAction::SegmentMap,
            HistoryAction::Alloc,
            HistoryAction::FreeRequested,
            HistoryAction::FreeCompleted,
            HistoryAction::SegmentUnmap,
        ]
    );
    assert_eq!(ev[1].size, 3000, "alloc entries carry the requested size");
    assert_eq!(ev[1].stream, S0);
    assert_eq!(ev[0].size, 2 * MIB);
    rt.set_history(false).unwrap();
    let b = rt.malloc(0, 3000, S0, DEFAULT).unwrap();
    rt.free(b).unwrap();
    assert!(rt.drain_history().unwrap().is_empty());
}

#[test]
fn snapshot_segments_tile_their_blocks() {
    let (rt, _) = runtime("online", "", 1, 64);
    let a = rt.malloc(0, 5000, S0, DEFAULT).unwrap();
    let b = rt.malloc(0, 3 * MIB as usize, S0, DEFAULT).unwrap();
    let c = rt.malloc(0, 7 * MIB as usize, S1, DEFAULT).unwrap();
    rt.free(b).unwrap();
    let snap = rt.snapshot(DEFAULT, true).unwrap();
    assert!(!snap.segments.is_empty());
    let s = rt.device_stats(0).unwrap();
    let mut total = 0;
    let mut allocated = 0;
    let mut prev = 0;
    for seg in &snap.segments {
        assert!(seg.address >= prev, "segments sorted by address");
        prev = seg.address;
        let blocks = &snap.blocks[seg.first_block..seg.first_block + seg.num_blocks];
        let mut at = seg.address;
        for blk in blocks {
            assert_eq!(blk.address, at, "blocks tile the segment");
            at += blk.size;
        }
        assert_eq!(at - seg.address, seg.total_size);
        assert!(seg.is_expandable);
        total += seg.total_size;
        allocated += seg.allocated_size;
    }
    assert_eq!(total as i64, s.reserved_bytes.all.current);
    assert_eq!(allocated as i64, s.allocated_bytes.all.current);
    let seg_c = snap
        .segments
        .iter()
        .find(|g| g.address <= c as u64 && (c as u64) < g.address + g.total_size)
        .unwrap();
    assert_eq!(seg_c.stream, S1);
    assert!(seg_c.is_large);
    let r = rt.base_allocation(c + 4096).unwrap();
    assert_eq!((r.base, r.size), (seg_c.address, seg_c.total_size));
    assert!(rt.largest_free_block(0).unwrap() >= 3 * MIB);
    rt.free(a).unwrap();
    rt.free(c).unwrap();
}

/// The budget holds over every pool of the device (default, private, plan): a private
/// pool is refused what the default pool holds, and the report names the budget.
#[test]
fn the_budget_holds_over_every_pool_of_the_device() {
    let rt = runtime_with_budget("online", "8MiB", 64);
    let d = rt.malloc(0, 4 * MIB as usize, S0, DEFAULT).unwrap();
    rt.pool_incref(0, GRAPH).unwrap();
    let g = rt.malloc(0, 4 * MIB as usize, S0, GRAPH).unwrap();
    assert_ne!(g, 0);
    // 8 MiB mapped over the two pools: the next 2 MiB is refused in either pool, though
    // each pool alone is under the budget and the device has 56 MiB free.
    assert_eq!(rt.malloc(0, 2 * MIB as usize, S0, GRAPH).unwrap(), 0);
    let info = rt.oom_info(0, 2 * MIB as usize).unwrap();
    assert_eq!(info.limit, 8 * MIB);
    assert!(
        info.detail.contains("STWEAVER_BUDGET=8.00 MiB"),
        "{}",
        info.detail
    );
    assert!(info.detail.contains("8.00 MiB live"), "{}", info.detail);
    assert_eq!(rt.malloc(0, 2 * MIB as usize, S0, DEFAULT).unwrap(), 0);
    // The default pool's freed block is cached: its own request gets it back.
    rt.free(d).unwrap();
    let d = rt.malloc(0, 4 * MIB as usize, S0, DEFAULT).unwrap();
    assert_ne!(d, 0);
    assert_eq!(
        rt.device_stats(0).unwrap().reserved_bytes.all.current,
        8 * MIB as i64
    );
    let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
    let dev = &info["devices"][0];
    assert_eq!(dev["budget"], "8.00 MiB");
    assert_eq!(dev["limit_bytes"], 8 * MIB);
    assert_eq!(dev["mapped_bytes"], 8 * MIB);
    // A memory fraction below the budget wins; above it, the budget does.
    rt.set_memory_fraction(0, 0.0625).unwrap();
    assert_eq!(rt.oom_info(0, 0).unwrap().limit, 4 * MIB);
    rt.set_memory_fraction(0, 1.0).unwrap();
    assert_eq!(rt.oom_info(0, 0).unwrap().limit, 8 * MIB);
    rt.free(d).unwrap();
    rt.free(g).unwrap();
}

#[test]
fn private_pools_isolate_memory_and_go_away_when_released() {
    let (rt, _) = runtime("online", "", 1, 64);
    let d = rt.malloc(0, 4 * MIB as usize, S0, DEFAULT).unwrap();
    rt.pool_incref(0, GRAPH).unwrap();
    assert_eq!(rt.pool_use_count(0, GRAPH).unwrap(), 1);
    let g1 = rt.malloc(0, 4 * MIB as usize, S0, GRAPH).unwrap();
    let g2 = rt.malloc(0, 2 * MIB as usize, S0, GRAPH).unwrap();
    rt.free(g2).unwrap();
    // Freed pool memory is not handed to the default pool.
    let d2 = rt.malloc(0, 2 * MIB as usize, S0, DEFAULT).unwrap();
    assert_ne!(d2, g2);
    let live = rt.pool_live_allocations(0, GRAPH).unwrap();
    assert_eq!(live, vec![g1]);
    // Device stats add up the pools; peaks stay exact.
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.current, 10 * MIB as i64);
    assert_eq!(s.allocated_bytes.all.peak, 10 * MIB as i64);
    // Snapshots carry the pool id; a pool's snapshot holds only its segments.
    let snap = rt.snapshot(GRAPH, false).unwrap();
    assert!(!snap.segments.is_empty());
    assert!(snap.segments.iter().all(|s| s.pool == GRAPH));
    // Released while g1 is live (a graph output): the pool stays until g1 is freed.
    rt.pool_release(0, GRAPH).unwrap();
    assert_eq!(rt.pool_use_count(0, GRAPH).unwrap(), 0);
    assert!(rt.snapshot(GRAPH, false).unwrap().segments.len() == 1);
    rt.free(g1).unwrap();
    assert!(rt.snapshot(GRAPH, false).unwrap().segments.is_empty());
    assert!(rt.pool_live_allocations(0, GRAPH).is_err(), "pool is gone");
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.current, 6 * MIB as i64);
    assert_eq!(
        s.allocated_bytes.all.peak,
        10 * MIB as i64,
        "peak survives the pool"
    );
    assert_eq!(
        s.allocated_bytes.all.allocated,
        (4 + 4 + 2 + 2) * MIB as i64,
        "accumulated counters survive the pool"
    );
    assert!(matches!(
        rt.pool_release(0, GRAPH),
        Err(BridgeError::UnknownPool { .. })
    ));
    assert!(matches!(
        rt.pool_incref(0, DEFAULT),
        Err(BridgeError::DefaultPoolIsNotPrivate)
    ));
    rt.free(d).unwrap();
    rt.free(d2).unwrap();
}

/// Host memory seen at a per-device address offset: real CUDA devices share one
/// (unified) virtual address space, so their reservations never overlap.
struct Shifted {
    inner: HostMemory,
    off: u64,
}

impl DeviceMemory for Shifted {
    stweaver_core::forward_device_memory!(self => self.inner; sizes, synchronize, events);
    fn reserve(&self, size: Bytes) -> Result<DevicePtr, DeviceError> {
        Ok(DevicePtr(self.inner.reserve(size)?.get() + self.off))
    }
    fn release(&self, base: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        self.inner.release(DevicePtr(base.get() - self.off), size)
    }
    fn map(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        self.inner.map(DevicePtr(addr.get() - self.off), size)
    }
    fn unmap(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        self.inner.unmap(DevicePtr(addr.get() - self.off), size)
    }
}

impl BridgeDevice for Shifted {
    fn enable_peer_access(&self, _peer: i32) -> stweaver_torch::error::Result<()> {
        Ok(())
    }
}

#[test]
fn devices_are_independent() {
    let devs: Vec<Arc<Shifted>> = (0..2u64)
        .map(|d| {
            Arc::new(Shifted {
                inner: HostMemory::new(Bytes(32 * MIB), Bytes(2 * MIB)),
                off: d << 40,
            })
        })
        .collect();
    let for_factory = devs.clone();
    let factory =
        Box::new(move |d: i32| Ok(for_factory[d as usize].clone() as Arc<dyn BridgeDevice>));
    let rt = Runtime::with_core(Core::new(
        Settings::parse("online", "", "").unwrap(),
        factory,
    ));
    rt.init(2).unwrap();
    let a = rt.malloc(0, 1 << 20, S0, DEFAULT).unwrap();
    let b = rt.malloc(1, 3 << 20, S0, DEFAULT).unwrap();
    assert_eq!(
        rt.device_stats(0).unwrap().allocated_bytes.all.current,
        1 << 20
    );
    assert_eq!(
        rt.device_stats(1).unwrap().allocated_bytes.all.current,
        3 << 20
    );
    assert!(devs[1].inner.mapped_bytes().get() >= 3 << 20);
    // Frees find their device from the pointer alone.
    rt.free(b).unwrap();
    rt.free(a).unwrap();
    assert_eq!(rt.device_stats(1).unwrap().allocated_bytes.all.current, 0);
    assert_eq!(rt.device_stats(0).unwrap().allocated_bytes.all.current, 0);
    rt.enable_peer_access(0, 1).unwrap();
    assert!(rt.enable_peer_access(0, 5).is_err());
}

#[test]
fn trace_mode_writes_a_valid_trace_with_markers() {
    let dir = std::env::temp_dir().join(format!("stweaver-bridge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("run.stwt");
    let (rt, _) = runtime("trace", path.to_str().unwrap(), 1, 32);
    for _ in 0..3 {
        rt.step().unwrap();
        rt.mark("forward", true).unwrap();
        let a = rt.malloc(0, 1 << 20, S0, DEFAULT).unwrap();
        let b = rt.malloc(0, 4096, S0, DEFAULT).unwrap();
        rt.mark("forward", false).unwrap();
        rt.free(a).unwrap();
        rt.free(b).unwrap();
    }
    // Still live when the trace is written (parameters at exit): never freed in the trace.
    let keep = rt.malloc(0, 8192, S0, DEFAULT).unwrap();
    assert_eq!(rt.mode().unwrap(), "trace");
    let written = rt.flush_trace().unwrap();
    assert_eq!(written, vec![path.display().to_string()]);
    let trace = read_trace_file(&path).unwrap();
    assert_eq!(trace.allocations.len(), 7);
    assert_eq!(trace.allocations[0].size, Bytes(1 << 20));
    assert!(trace.labels.iter().any(|l| l == "forward"));
    assert_eq!(rt.mode().unwrap(), "trace (written)");
    let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
    assert_eq!(info["iterations"], 3);
    assert_eq!(info["devices"][0]["opened"], true);
    rt.free(keep).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    let (online, _) = runtime("online", "", 1, 8);
    assert!(online.flush_trace().is_err());
    assert!(online.mark("", true).is_err());
}

/// Plan mode given a trace path records the served run (the requests as the plan saw
/// them, markers included) and writes it on `flush_trace`; without a path it cannot.
#[test]
fn plan_mode_with_a_trace_path_records_the_served_run() {
    let dir = std::env::temp_dir().join(format!("stweaver-served-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (recorded, served) = (dir.join("rec.stwt"), dir.join("served.stwt"));
    let (rt, _) = runtime("trace", recorded.to_str().unwrap(), 1, 64);
    for _ in 0..4 {
        rt.step().unwrap();
        iteration(&rt);
    }
    rt.flush_trace().unwrap();
    let trace = read_trace_file(&recorded).unwrap();
    let plan = stweaver_planner::planning::plan_trace(
        &trace,
        &stweaver_planner::planning::PlanOptions::default(),
    )
    .unwrap()
    .plan;
    let plan_path = dir.join("p.stwp");
    stweaver_core::plan_file::write_plan_file(&plan_path, &plan).unwrap();

    let (rt, _) = runtime_with_plan(
        "plan",
        plan_path.to_str().unwrap(),
        served.to_str().unwrap(),
        1,
        64,
    );
    for _ in 0..4 {
        rt.step().unwrap();
        iteration(&rt);
    }
    assert_eq!(rt.mode().unwrap(), "plan");
    assert!(plan_stats(&rt)["hits"].as_u64().unwrap() > 0);
    assert_eq!(
        rt.flush_trace().unwrap(),
        vec![served.display().to_string()]
    );
    let got = read_trace_file(&served).unwrap();
    let sizes = |t: &stweaver_core::trace::Trace| -> Vec<u64> {
        t.allocations.iter().map(|a| a.size.get()).collect()
    };
    assert_eq!(
        sizes(&got),
        sizes(&trace),
        "the served run's requests, in order"
    );

    let (plain, _) = runtime_with_plan("plan", plan_path.to_str().unwrap(), "", 1, 64);
    assert!(
        plain.flush_trace().is_err(),
        "no trace path: nothing recorded"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One training-like iteration on S0: activations allocated and freed in a fixed pattern.
fn iteration(rt: &Runtime) {
    let sizes = [4 * MIB, 1000, 3 * MIB, 64 * 1024, 2 * MIB + 512];
    let mut live = Vec::new();
    for &s in &sizes {
        live.push(rt.malloc(0, s as usize, S0, DEFAULT).unwrap());
    }
    for p in live.drain(..).rev() {
        rt.free(p).unwrap();
    }
}

fn plan_stats(rt: &Runtime) -> serde_json::Value {
    let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
    info["devices"][0]["plan"].clone()
}

#[test]
fn auto_mode_records_plans_in_the_background_and_switches() {
    let dir = std::env::temp_dir().join(format!("stweaver-auto-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan_path = dir.join("run.stwp");
    let trace_path = dir.join("run.stwt");
    let devs: Vec<Arc<HostMemory>> =
        vec![Arc::new(HostMemory::new(Bytes(256 * MIB), Bytes(2 * MIB)))];
    let for_factory = devs.clone();
    let factory =
        Box::new(move |d: i32| Ok(for_factory[d as usize].clone() as Arc<dyn BridgeDevice>));
    let settings = Settings::parse(
        "auto",
        plan_path.to_str().unwrap(),
        trace_path.to_str().unwrap(),
    )
    .unwrap();
    let iters = settings.auto_iterations;
    let rt = Runtime::with_core(Core::new(settings, factory));
    rt.init(1).unwrap();
    let weights = rt.malloc(0, 8 * MIB as usize, S0, DEFAULT).unwrap();
    assert_eq!(rt.mode().unwrap(), "auto (recording)");
    let mut steps = 0;
    let mut online_peak = 0;
    while !rt.mode().unwrap().starts_with("auto (plan)") {
        iteration(&rt);
        // Peaks of the online phase; the step that switches starts a fresh peak.
        online_peak = online_peak.max(rt.device_stats(0).unwrap().reserved_bytes.all.peak);
        rt.reset_peak_stats(0).unwrap();
        rt.step().unwrap();
        steps += 1;
        assert!(
            !rt.mode().unwrap().starts_with("auto (online"),
            "fell back: {}",
            rt.mode().unwrap()
        );
        if rt.mode().unwrap() == "auto (planning)" {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(
            steps < 500,
            "never switched to the plan: {}",
            rt.mode().unwrap()
        );
    }
    assert!(steps > iters, "planned before recording {iters} iterations");
    assert!(plan_path.is_file() && trace_path.is_file());
    for _ in 0..6 {
        iteration(&rt);
        rt.step().unwrap();
    }
    // From the switch on, the pool replaced the online cache instead of adding to it (the
    // weights stay online; the plan's room for them is squeezed out by the switch).
    let plan_peak = rt.device_stats(0).unwrap().reserved_bytes.all.peak;
    assert!(
        plan_peak * 4 <= online_peak * 5,
        "reserved peak {plan_peak} after the switch, {online_peak} while online"
    );
    let p = plan_stats(&rt);
    assert!(p["hits"].as_u64().unwrap() >= 6 * 5, "plan hits: {p}");
    assert_eq!(p["conflicts"], 0, "{p}");
    // One iteration after the switch the online cache was emptied: only the weights'
    // arena granules and the plan pool stay mapped.
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.current, 8 * MIB as i64);
    rt.free(weights).unwrap();

    // Plan mode serves the file auto wrote.
    let (rt, devs2) = runtime_with_plan("plan", plan_path.to_str().unwrap(), "", 1, 256);
    let weights = rt.malloc(0, 8 * MIB as usize, S0, DEFAULT).unwrap();
    assert_eq!(rt.mode().unwrap(), "plan");
    for _ in 0..6 {
        rt.step().unwrap();
        iteration(&rt);
    }
    let p = plan_stats(&rt);
    assert!(p["hits"].as_u64().unwrap() >= 5 * 5, "plan hits: {p}");
    rt.free(weights).unwrap();

    // A corrupt plan file is reported and serving goes on online (invariant 3).
    let bad = dir.join("bad.stwp");
    std::fs::write(&bad, b"not a plan at all").unwrap();
    let (_, _) = (devs, devs2);
    serves_online_refusing(&bad, "bad.stwp");

    // A one-shot plan whose trace was mostly dynamic (shapes that never repeat) is
    // refused too: served, it would reserve more than online serving.
    let one_shot = dir.join("one_shot.stwp");
    let plan = stweaver_core::plan::Plan {
        alignment: Bytes(512),
        pool_size: Bytes(MIB),
        prologue: vec![stweaver_core::plan::PlannedRequest {
            size: Bytes(MIB),
            stream: StreamId(0),
            offset: stweaver_core::units::Offset(0),
            start: 0,
            end: 1,
        }],
        prologue_len: 2,
        dynamic: stweaver_core::plan::DynamicSummary {
            requests: 40,
            peak_bytes: Bytes(4 * MIB),
        },
        ..Default::default()
    };
    stweaver_core::plan_file::write_plan_file(&one_shot, &plan).unwrap();
    serves_online_refusing(&one_shot, "40 requests to dynamic serving");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One iteration of class `k` (a sequence-length bucket): `iteration`'s pattern with
/// every activation `k + 1` times larger.
fn class_iteration(rt: &Runtime, k: u64) {
    let sizes = [4 * MIB, 1000, 3 * MIB, 64 * 1024, 2 * MIB + 512];
    let mut live = Vec::new();
    for &s in &sizes {
        live.push(rt.malloc(0, (s * (k + 1)) as usize, S0, DEFAULT).unwrap());
    }
    for p in live.drain(..).rev() {
        rt.free(p).unwrap();
    }
}

/// Three classes in an order with no period (a linear congruential sequence).
fn class_sequence() -> impl FnMut() -> u64 {
    let mut x = 7u64;
    move || {
        x = (x * 1103515245 + 12345) % (1 << 31);
        (x >> 16) % 3
    }
}

/// Runs `iteration` and a step until auto mode serves its plan (never falling back
/// online, within 500 steps); the steps taken.
fn until_served(rt: &Runtime, mut iteration: impl FnMut()) -> u64 {
    let mut steps = 0;
    while !rt.mode().unwrap().starts_with("auto (plan)") {
        iteration();
        rt.step().unwrap();
        steps += 1;
        let m = rt.mode().unwrap();
        assert!(!m.starts_with("auto (online"), "fell back: {m}");
        if m == "auto (planning)" {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(steps < 500, "never switched to the plan: {m}");
    }
    steps
}

#[test]
fn auto_mode_plans_a_loop_of_several_iteration_classes_per_class() {
    use stweaver_planner::auto::CLASS_ITERATIONS;
    let (rt, _devs) = runtime("auto", "", 1, 256);
    let iters = Settings::parse("auto", "", "").unwrap().auto_iterations;
    let weights = rt.malloc(0, 8 * MIB as usize, S0, DEFAULT).unwrap();
    let mut next_class = class_sequence();
    let steps = until_served(&rt, || class_iteration(&rt, next_class()));
    // The first recording had no single repeating iteration: a second one of
    // CLASS_ITERATIONS iterations was planned per class.
    assert!(
        steps > iters + CLASS_ITERATIONS,
        "switched after {steps} steps"
    );
    let before = plan_stats(&rt);
    for _ in 0..30 {
        class_iteration(&rt, next_class());
        rt.step().unwrap();
    }
    let p = plan_stats(&rt);
    let hits = p["hits"].as_u64().unwrap() - before["hits"].as_u64().unwrap();
    // Every request of the 30 iterations at its planned offset, whatever the class.
    assert_eq!(hits, 30 * 5, "{p}");
    assert_eq!(p["conflicts"], 0, "{p}");
    rt.free(weights).unwrap();
}

/// One iteration of class `k` with `n` requests (so that an iteration the plan does not
/// know counts as one: `stweaver_planner::auto::UNKNOWN_MIN_REQUESTS`): `n` blocks of
/// `(k + 1) * (64 KiB + 512 i)`, allocated in order and freed in reverse.
fn wide_class_iteration(rt: &Runtime, k: u64, n: u64) {
    let live: Vec<usize> = (0..n)
        .map(|i| {
            rt.malloc(0, ((k + 1) * (64 * 1024 + 512 * i)) as usize, S0, DEFAULT)
                .unwrap()
        })
        .collect();
    for p in live.into_iter().rev() {
        rt.free(p).unwrap();
    }
}

#[test]
fn auto_mode_learns_an_iteration_class_first_seen_after_its_switch() {
    use stweaver_planner::auto::{RELEARN_ITERATIONS, UNKNOWN_MIN_REQUESTS};
    // Issue #18 item 2: a loop of three classes, switched to its plan per class; then a
    // fourth class (a longer length) every third iteration. Its first iteration is served
    // beside the plan; auto mode records RELEARN_ITERATIONS iterations, plans them in
    // the background and serves a plan with the fourth class added.
    let (rt, _devs) = runtime("auto", "", 1, 256);
    let n = UNKNOWN_MIN_REQUESTS + 6;
    let weights = rt.malloc(0, 8 * MIB as usize, S0, DEFAULT).unwrap();
    let mut next_class = class_sequence();
    until_served(&rt, || wide_class_iteration(&rt, next_class(), n));
    let notes = |rt: &Runtime| -> Vec<String> {
        let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
        serde_json::from_value(info["notes"].clone()).unwrap()
    };
    let learned = |rt: &Runtime| {
        notes(rt)
            .iter()
            .any(|m| m.contains("learned 1 iteration class"))
    };
    let mut k = 0;
    while !learned(&rt) {
        let class = if k % 3 == 0 { 3 } else { next_class() };
        wide_class_iteration(&rt, class, n);
        rt.step().unwrap();
        k += 1;
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(
            k < RELEARN_ITERATIONS + 200,
            "never learned the class: {:?}",
            notes(&rt)
        );
    }
    assert!(k > RELEARN_ITERATIONS, "learned after {k} steps");
    assert!(
        notes(&rt)
            .iter()
            .any(|m| m.contains("recording 40 iterations to learn it")),
        "{:?}",
        notes(&rt)
    );
    assert!(rt.mode().unwrap().starts_with("auto (plan)"));
    // From here every class, the fourth included, at its planned offsets.
    let before = plan_stats(&rt);
    for j in 0..30 {
        let class = if j % 3 == 0 { 3 } else { next_class() };
        wide_class_iteration(&rt, class, n);
        rt.step().unwrap();
    }
    let p = plan_stats(&rt);
    let hits = p["hits"].as_u64().unwrap() - before["hits"].as_u64().unwrap();
    assert_eq!(hits, 30 * n, "{p}");
    assert_eq!(p["conflicts"], 0, "{p}");
    rt.free(weights).unwrap();
}

#[test]
fn keyed_steps_tell_apart_classes_that_begin_alike() {
    // A plan of two classes that begin with the same two requests (class 1's third
    // planned where class 0's first lies), served in plan mode over alternating
    // iterations: unkeyed, each iteration's shared requests go to the class just served
    // and its third request finds its range busy; keyed (`step_key`, or `iteration_key`
    // after a plain `step`, as with the optimizer hook), only the first iteration of each
    // key guesses.
    use stweaver_core::plan::{ClassSection, Plan, PlannedRequest};
    use stweaver_core::units::Offset;
    let req = |size: u64, offset: u64, i: u64| PlannedRequest {
        size: Bytes(size),
        stream: StreamId(S0 as u64),
        offset: Offset(offset),
        start: i,
        end: 6 - i,
    };
    let plan = Plan {
        alignment: Bytes(512),
        pool_size: Bytes(5 * MIB),
        iteration: vec![req(MIB, 0, 0), req(MIB, MIB, 1), req(2 * MIB, 2 * MIB, 2)],
        iteration_len: 6,
        extra_classes: vec![ClassSection {
            requests: vec![
                req(MIB, 3 * MIB, 0),
                req(MIB, 4 * MIB, 1),
                req(3 * MIB, 0, 2),
            ],
            len: 6,
        }],
        ..Plan::default()
    };
    let dir = std::env::temp_dir().join(format!("stweaver-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("two_classes.stwp");
    stweaver_core::plan_file::write_plan_file(&path, &plan).unwrap();
    let classes = [[MIB, MIB, 2 * MIB], [MIB, MIB, 3 * MIB]];
    let serve = |how: u32| {
        let (rt, _devs) = runtime_with_plan("plan", path.to_str().unwrap(), "", 1, 64);
        // The device opens (its engine and the plan with it) at its first allocation,
        // before the first step, as in a program (the weights; on another stream, which
        // the plan does not serve).
        let weights = rt.malloc(0, 8 * MIB as usize, S1, DEFAULT).unwrap();
        for i in 0..40usize {
            let c = i % 2;
            match how {
                0 => rt.step().unwrap(),
                1 => rt.step_key(100 + c as u64).unwrap(),
                _ => {
                    rt.step().unwrap();
                    rt.iteration_key(100 + c as u64).unwrap();
                }
            }
            let ptrs: Vec<usize> = classes[c]
                .iter()
                .map(|&s| rt.malloc(0, s as usize, S0, DEFAULT).unwrap())
                .collect();
            for p in ptrs.into_iter().rev() {
                rt.free(p).unwrap();
            }
        }
        rt.free(weights).unwrap();
        plan_stats(&rt)
    };
    let (plain, keyed, late) = (serve(0), serve(1), serve(2));
    eprintln!(
        "unkeyed {plain}
step_key {keyed}
iteration_key {late}"
    );
    assert_eq!(plain["conflicts"], 39, "{plain}");
    assert_eq!(plain["hinted"], 0, "{plain}");
    for p in [&keyed, &late] {
        assert_eq!(p["conflicts"], 1, "{p}");
        assert_eq!(p["hits"], 119, "{p}");
        assert_eq!(p["hinted"], 38, "{p}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn keys_without_a_plan_are_accepted_and_change_nothing() {
    let (rt, _devs) = runtime("online", "", 1, 64);
    for k in 0..10u64 {
        rt.step_key(k).unwrap();
        rt.iteration_key(k * 7).unwrap();
        iteration(&rt);
    }
    let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
    assert_eq!(info["iterations"], 10);
    assert!(info["devices"][0]["plan"].is_null());
}

/// Plan mode on `plan` reports the refusal (its reason mentions `why`) and trains online.
fn serves_online_refusing(plan: &std::path::Path, why: &str) {
    let (rt, _devs) = runtime_with_plan("plan", plan.to_str().unwrap(), "", 1, 64);
    let m = rt.mode().unwrap();
    assert!(
        m.starts_with("online (plan rejected:") && m.contains(why),
        "{m}"
    );
    iteration(&rt);
    rt.step().unwrap();
    assert!(plan_stats(&rt).is_null());
}

/// One iteration as the run-time offloader makes it: `layers` saved 4 MiB activations
/// (packs recorded); with `threshold`, each is freed after its pack (its copy out) and
/// a new allocation made for its copy back, linked to it (`record_restore`), before its
/// unpack. Returns the links recorded. Sleeps between hooks so the trace's times give
/// the copies room (4 MiB take ~170 µs at the planner's assumed 25 GB/s).
fn offload_iteration(rt: &Runtime, layers: usize, threshold: bool) -> usize {
    let nap = || std::thread::sleep(std::time::Duration::from_millis(2));
    let mut saved = Vec::new();
    for _ in 0..layers {
        let act = rt.malloc(0, 4 * MIB as usize, S0, DEFAULT).unwrap();
        let id = rt.record_saved(act, true).unwrap();
        let tmp = rt.malloc(0, MIB as usize, S0, DEFAULT).unwrap();
        rt.free(tmp).unwrap();
        if threshold {
            rt.free(act).unwrap();
        }
        nap();
        saved.push((act, id));
    }
    let mut links = 0;
    let mut grads = Vec::new();
    for (act, id) in saved.into_iter().rev() {
        let cur = if threshold {
            let back = rt.malloc(0, 4 * MIB as usize, S0, DEFAULT).unwrap();
            if rt.record_restore(back, id).unwrap() {
                links += 1;
            }
            back
        } else {
            act
        };
        let unpacked = rt.record_saved(cur, false).unwrap();
        assert!(
            (id >= 0) == (unpacked >= 0),
            "pack and unpack recorded alike"
        );
        grads.push(rt.malloc(0, 256 * 1024, S0, DEFAULT).unwrap());
        rt.free(cur).unwrap();
        nap();
    }
    for g in grads {
        rt.free(g).unwrap();
    }
    links
}

/// Auto mode under a budget below the run's peak: the recording runs with threshold
/// offload (restore links), the background plan un-offloads it and plans the fewest
/// bytes of offload within the budget, and the switch serves that plan's schedule.
#[test]
fn auto_mode_under_a_budget_plans_offload_from_a_threshold_recording() {
    // Without offload an iteration needs 8 + 6 × 4 + 1 MiB and more: above 28 MiB.
    let rt = runtime_with_budget("auto", "28MiB", 256);
    let iters = rt.core().settings().auto_iterations;
    let weights = rt.malloc(0, 8 * MIB as usize, S0, DEFAULT).unwrap();
    // No boundary after the setup: the first iteration, recorded with threshold offload,
    // is the plan's prologue; its offloads stay as recorded (the planner undoes only the
    // later iterations' links), so its peak is not the minimum.
    let mut steps = 0;
    let mut links = 0;
    while !rt.mode().unwrap().starts_with("auto (plan)") {
        let recording = rt.mode().unwrap() == "auto (recording)";
        let l = offload_iteration(&rt, 6, true);
        if recording {
            assert_eq!(l, 6, "every copy back linked while recording");
        } else {
            assert_eq!(l, 0, "no links once recording stopped");
        }
        links += l;
        rt.step().unwrap();
        steps += 1;
        assert!(
            !rt.mode().unwrap().starts_with("auto (online"),
            "fell back: {} ({})",
            rt.mode().unwrap(),
            rt.info_json().unwrap()
        );
        assert!(steps < 500, "never switched: {}", rt.mode().unwrap());
    }
    assert!(links >= 6 * iters as usize);
    let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
    let dev = &info["devices"][0];
    let off = &dev["offload"];
    assert_eq!(off["planned"], true, "{info}");
    let limit = dev["limit_bytes"].as_u64().unwrap();
    assert_eq!(limit, 28 * MIB);
    assert_eq!(off["budget_bytes"], limit);
    // Fewer than all six activations move, and the planned peak fits.
    let tensors = off["tensors"].as_u64().unwrap();
    assert!((1..6).contains(&tensors), "{off}");
    assert_eq!(off["bytes_per_iteration"], tensors * 4 * MIB, "{off}");
    assert!(off["planned_peak"].as_u64().unwrap() <= limit, "{off}");
    assert!(
        off["pool_without_offload"].as_u64().unwrap() > limit,
        "{off}"
    );
    let sched = rt.offload_schedule(0).unwrap();
    assert_eq!(sched.len() as u64, tensors);
    assert!(
        sched
            .iter()
            .all(|s| s.bytes == 4 * MIB && s.pack < 6 && s.unpack < 6)
    );
    rt.free(weights).unwrap();
}

/// Auto mode with the plan gate on: the finished plan is held (serving stays online,
/// its offload outcome readable, with the planned waits and the link speed given), a
/// release without accepting records again from that boundary and plans
/// `auto_iterations` iterations later, and accepting serves the plan at once.
#[test]
fn auto_mode_holds_its_plan_behind_the_gate_and_records_again_when_refused() {
    let rt = runtime_with_budget("auto", "28MiB", 256);
    let iters = rt.core().settings().auto_iterations;
    assert!(
        rt.release_held_plan(true).is_err(),
        "nothing held at the start"
    );
    assert!(rt.set_offload_timing(-1.0, 0.0).is_err());
    assert!(rt.set_offload_timing(f64::NAN, 0.0).is_err());
    assert!(rt.set_offload_timing(0.0, f64::INFINITY).is_err());
    rt.set_offload_timing(40.0, 50_000.0).unwrap();
    rt.set_offload_timing(0.0, 0.0).unwrap(); // keeps 40 GB/s
    rt.set_plan_gate(true).unwrap();
    let weights = rt.malloc(0, 8 * MIB as usize, S0, DEFAULT).unwrap();
    // Runs iterations until the mode leaves recording and planning; returns the steps.
    let until_settled = |rt: &Runtime| {
        let mut steps = 0u64;
        loop {
            let m = rt.mode().unwrap();
            if !(m == "auto (recording)" || m == "auto (planning)") {
                return (steps, m);
            }
            offload_iteration(rt, 6, true);
            rt.step().unwrap();
            steps += 1;
            assert!(steps < 500, "never planned: {m}");
        }
    };
    let (first, m) = until_settled(&rt);
    assert_eq!(m, "auto (plan held)");
    assert!(first > iters, "planned after the recorded iterations");
    let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
    let off = &info["devices"][0]["offload"];
    assert_eq!(off["planned"], true, "{info}");
    assert_eq!(off["link_gbps"], 40.0, "{off}");
    assert!(off["copy_out_wait_us"].as_f64().unwrap() >= 0.0, "{off}");
    assert!(off["stall_us"].as_f64().unwrap() >= 0.0, "{off}");
    assert!(
        rt.offload_schedule(0).unwrap().is_empty(),
        "a held plan is not served"
    );
    // Held: iterations run online, with no recording (no trace id for saved tensors).
    let act = rt.malloc(0, 4 * MIB as usize, S0, DEFAULT).unwrap();
    assert_eq!(rt.record_saved(act, true).unwrap(), -1);
    rt.free(act).unwrap();
    // Refused: recording again from this boundary (saved tensors get trace ids again).
    rt.release_held_plan(false).unwrap();
    assert_eq!(rt.mode().unwrap(), "auto (recording)");
    let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
    assert!(info["devices"][0]["offload"].is_null(), "{info}");
    assert!(rt.release_held_plan(true).is_err(), "nothing held now");
    let (again, m) = until_settled(&rt);
    assert_eq!(m, "auto (plan held)");
    assert!(
        again > iters && again <= first,
        "the second recording plans as long after its start ({again} vs {first} steps)"
    );
    rt.release_held_plan(true).unwrap();
    assert_eq!(rt.mode().unwrap(), "auto (plan)");
    let sched = rt.offload_schedule(0).unwrap();
    assert!(!sched.is_empty(), "the accepted plan's schedule is served");
    rt.free(weights).unwrap();
}

/// Auto mode serving a plan records again on request (`record_again`: the served plan
/// unloaded and kept, the offload schedule gone, saved tensors recorded again), plans and
/// holds the new recording's plan, and `serve_kept_plan` serves the kept plan again at a
/// boundary without a new recording, whatever auto mode was doing; both calls refuse
/// clearly when there is nothing to act on.
#[test]
fn auto_mode_records_again_while_serving_and_serves_the_kept_plan_again() {
    let rt = runtime_with_budget("auto", "28MiB", 256);
    let err = rt.record_again().unwrap_err().to_string();
    assert!(err.contains("no plan is served"), "{err}");
    let err = rt.serve_kept_plan().unwrap_err().to_string();
    assert!(err.contains("no plan is kept"), "{err}");
    rt.set_plan_gate(true).unwrap();
    let weights = rt.malloc(0, 8 * MIB as usize, S0, DEFAULT).unwrap();
    let until_held = |rt: &Runtime| {
        let mut steps = 0u64;
        while rt.mode().unwrap() != "auto (plan held)" {
            offload_iteration(rt, 6, true);
            rt.step().unwrap();
            steps += 1;
            assert!(steps < 500, "never held: {}", rt.mode().unwrap());
        }
    };
    let served = |rt: &Runtime, n: usize| {
        for _ in 0..n {
            offload_iteration(rt, 6, true);
            rt.step().unwrap();
        }
        let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
        info["devices"][0]["plan"].clone()
    };
    until_held(&rt);
    rt.release_held_plan(true).unwrap();
    let sched_a = rt.offload_schedule(0).unwrap();
    assert!(!sched_a.is_empty());
    let stats = served(&rt, 4);
    assert!(stats["hits"].as_u64().unwrap() > 0, "{stats}");
    // Iterations the plan does not know (other sizes) start no learning round: the
    // plan offloads, and a round's recording has no saved-tensor markers.
    for _ in 0..3 {
        let other: Vec<usize> = (0..70)
            .map(|_| rt.malloc(0, 100 * 1024, S0, DEFAULT).unwrap())
            .collect();
        other.into_iter().for_each(|p| rt.free(p).unwrap());
        rt.step().unwrap();
    }
    let info: serde_json::Value = serde_json::from_str(&rt.info_json().unwrap()).unwrap();
    assert!(
        !info["notes"].to_string().contains("to learn it"),
        "no relearning of an offloading plan: {}",
        info["notes"]
    );
    assert_eq!(rt.mode().unwrap(), "auto (plan)");
    // Record again: plan A kept, nothing served.
    rt.record_again().unwrap();
    assert_eq!(rt.mode().unwrap(), "auto (recording)");
    assert!(rt.offload_schedule(0).unwrap().is_empty());
    let act = rt.malloc(0, 4 * MIB as usize, S0, DEFAULT).unwrap();
    assert!(rt.record_saved(act, true).unwrap() >= 0, "recording again");
    rt.free(act).unwrap();
    assert!(rt.record_again().is_err(), "nothing served while recording");
    // Plan B held, served, then A again.
    until_held(&rt);
    rt.release_held_plan(true).unwrap();
    served(&rt, 3);
    rt.serve_kept_plan().unwrap();
    assert_eq!(rt.mode().unwrap(), "auto (plan)");
    let sched = rt.offload_schedule(0).unwrap();
    assert_eq!(sched.len(), sched_a.len(), "plan A's schedule again");
    assert!(
        sched
            .iter()
            .zip(&sched_a)
            .all(|(a, b)| (a.pack, a.unpack, a.bytes) == (b.pack, b.unpack, b.bytes))
    );
    let before = served(&rt, 0);
    let after = served(&rt, 4);
    assert!(
        after["hits"].as_u64().unwrap() > before["hits"].as_u64().unwrap(),
        "plan A serves again: {after}"
    );
    assert!(rt.serve_kept_plan().is_err(), "kept only once");
    // Recording abandoned for the kept plan: record again, then serve A mid-recording.
    rt.record_again().unwrap();
    offload_iteration(&rt, 6, true);
    rt.step().unwrap();
    rt.serve_kept_plan().unwrap();
    assert_eq!(rt.mode().unwrap(), "auto (plan)");
    assert_eq!(rt.offload_schedule(0).unwrap().len(), sched_a.len());
    served(&rt, 4);
    let st = rt.device_stats(0).unwrap();
    let limit = 28 * MIB as i64;
    assert!(
        st.reserved_bytes.all.peak <= limit,
        "within the budget: {} > {limit}",
        st.reserved_bytes.all.peak
    );
    rt.free(weights).unwrap();
}

/// Auto mode's recording (`iteration` then a step, each within the runtime's 16 MiB),
/// planned under a memory fraction of 12 MiB set at its last iteration: steps until the
/// planning is done; the runtime's `info_json` then.
fn record_then_plan_under_12_mib(rt: &Runtime, mut iteration: impl FnMut()) -> serde_json::Value {
    let iters = rt.core().settings().auto_iterations;
    for i in 0..=iters {
        iteration();
        if i == iters {
            rt.set_memory_fraction(0, 12.0 / 256.0).unwrap();
        }
        rt.step().unwrap();
    }
    let mut steps = 0;
    while rt.mode().unwrap() == "auto (planning)" {
        std::thread::sleep(std::time::Duration::from_millis(5));
        rt.step().unwrap();
        steps += 1;
        assert!(steps < 2000, "never planned: {}", rt.mode().unwrap());
    }
    serde_json::from_str(&rt.info_json().unwrap()).unwrap()
}

/// A budget below what any offload reaches: the plan is the ordinary one of the
/// recording, with a note and the reason in `info_json`.
#[test]
fn auto_mode_below_the_minimum_falls_back_to_the_ordinary_plan_with_a_note() {
    // The recording (threshold offload) runs within 16 MiB; planning starts under a
    // memory fraction of 12 MiB, less than the weights (8 MiB), an activation (4 MiB) and
    // its temporary (1 MiB) live at once: below any offload's minimum.
    let rt = runtime_with_budget("auto", "16MiB", 256);
    let weights = rt.malloc(0, 8 * MIB as usize, S0, DEFAULT).unwrap();
    let info = record_then_plan_under_12_mib(&rt, || {
        assert_eq!(offload_iteration(&rt, 2, true), 2);
    });
    let off = &info["devices"][0]["offload"];
    assert_eq!(off["planned"], false, "{info}");
    assert_eq!(off["budget_bytes"], 12 * MIB);
    let reason = off["reason"].as_str().unwrap();
    assert!(reason.contains("below the minimum"), "{reason}");
    let notes = info["notes"].as_array().unwrap();
    assert!(
        notes
            .iter()
            .any(|n| n.as_str().unwrap().contains("no offload planned")),
        "{info}"
    );
    assert!(rt.offload_schedule(0).unwrap().is_empty());
    rt.free(weights).unwrap();
}

/// A recording over its budget with no offload schedule and no single repeating
/// iteration (three shapes in an order without a period) is not recorded again for a plan per class: such a plan
/// has no offload and cannot fit either. Planning ends with the note, and the run goes on
/// online at once (before: 40 more iterations recorded; on the H100, GPT-2 XL at 0.7 x LB
/// spent 41 slow recorded iterations so).
#[test]
fn auto_mode_over_its_budget_records_no_iteration_classes() {
    use stweaver_planner::auto::CLASS_ITERATIONS;
    let rt = runtime_with_budget("auto", "16MiB", 256);
    let weights = rt.malloc(0, 8 * MIB as usize, S0, DEFAULT).unwrap();
    let mut next_class = class_sequence();
    let info = record_then_plan_under_12_mib(&rt, || {
        offload_iteration(&rt, 1 + next_class() as usize, true);
    });
    assert_eq!(info["devices"][0]["offload"]["planned"], false, "{info}");
    let notes: Vec<&str> = info["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert!(
        notes.iter().any(|n| n.contains("no offload planned")),
        "{notes:?}"
    );
    assert!(
        !notes
            .iter()
            .any(|n| n.contains("no single repeating iteration")),
        "{notes:?}"
    );
    let mode = rt.mode().unwrap();
    assert!(mode.starts_with("auto (online"), "{mode}");
    // Nothing is recorded any more: the run is not waiting CLASS_ITERATIONS iterations
    // (under the recording's 16 MiB again).
    rt.set_memory_fraction(0, 16.0 / 256.0).unwrap();
    for _ in 0..CLASS_ITERATIONS {
        offload_iteration(&rt, 1 + next_class() as usize, true);
        rt.step().unwrap();
        assert!(rt.mode().unwrap().starts_with("auto (online"));
    }
    rt.free(weights).unwrap();
}

/// `STWEAVER_TIME_CALLS`: every malloc and free through the bridge is counted with its host
/// time; off (the default), nothing is.
#[test]
fn call_times_count_every_malloc_and_free_only_when_on() {
    let (off, _) = runtime("online", "", 1, 64);
    let p = off.malloc(0, MIB as usize, S0, DEFAULT).unwrap();
    off.free(p).unwrap();
    let t = off.call_times();
    assert!(!t.on);
    assert_eq!((t.malloc_calls, t.free_calls, t.malloc_ns), (0, 0, 0));

    let mut settings = Settings::parse("online", "", "").unwrap();
    settings.time_calls = true;
    let (on, _) = runtime_with_settings(settings, 1, 64);
    let ptrs: Vec<usize> = (0..5)
        .map(|i| on.malloc(0, (i + 1) * 4096, S0, DEFAULT).unwrap())
        .collect();
    for p in &ptrs[..3] {
        on.free(*p).unwrap();
    }
    let t = on.call_times();
    assert!(t.on);
    assert_eq!((t.malloc_calls, t.free_calls), (5, 3));
    assert!(t.malloc_ns > 0, "{t:?}");
}
