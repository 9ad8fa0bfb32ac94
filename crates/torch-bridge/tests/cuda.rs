//! The bridge runtime over a real CUDA device (the GPU run carries this test binary); on a
//! machine without a driver, opening the device is a clean error.

use stweaver_cuda::Driver;
use stweaver_torch::ffi::bridge::PoolId;
use stweaver_torch::ffi::{Runtime, cuda_factory};
use stweaver_torch::{Core, Settings};

const DEFAULT: PoolId = PoolId {
    first: 0,
    second: 0,
};

#[test]
fn runtime_on_cuda_device_zero() {
    let rt = Runtime::with_core(Core::new(
        Settings::parse("online", "", "").unwrap(),
        cuda_factory(),
    ));
    rt.init(1).unwrap();
    if !Driver::is_present() || Driver::get().map(|d| d.device_count()).unwrap_or(0) == 0 {
        let e = rt.malloc(0, 4096, 0, DEFAULT).unwrap_err();
        assert!(e.to_string().contains("cannot open CUDA device 0"), "{e}");
        return;
    }
    let a = rt.malloc(0, 3 << 20, 0, DEFAULT).unwrap();
    let b = rt.malloc(0, 1000, 0, DEFAULT).unwrap();
    assert!(a != 0 && b != 0 && a.is_multiple_of(512) && b.is_multiple_of(512));
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.current, (3 << 20) + 1024);
    rt.free(a).unwrap();
    rt.free(b).unwrap();
    rt.empty_cache(-1, DEFAULT).unwrap();
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.reserved_bytes.all.current, 0);
    // A request larger than the device is out of memory (0), not an error.
    assert_eq!(rt.malloc(0, 1 << 50, 0, DEFAULT).unwrap(), 0);
    let info = rt.oom_info(0, 1 << 50).unwrap();
    assert!(info.device_total > 0 && info.device_free <= info.device_total);
}

/// The bridge's own cost on a real device (no torch, no C++): malloc + free pairs through
/// the runtime, steady state. Run by scripts/gpu_test.sh (`--ignored`); prints ns per pair.
#[test]
#[ignore = "timing; run explicitly on a GPU machine"]
fn bench_runtime_pairs_on_cuda() {
    if !Driver::is_present() || Driver::get().map(|d| d.device_count()).unwrap_or(0) == 0 {
        return;
    }
    let rt = Runtime::with_core(Core::new(
        Settings::parse("online", "", "").unwrap(),
        cuda_factory(),
    ));
    rt.init(1).unwrap();
    let keep: Vec<usize> = (0..200)
        .map(|i| rt.malloc(0, 4096 + i * 512, 0, DEFAULT).unwrap())
        .collect();
    for size in [4096usize, 1 << 20, 64 << 20] {
        for _ in 0..10_000 {
            let p = rt.malloc(0, size, 0, DEFAULT).unwrap();
            rt.free(p).unwrap();
        }
        let n = 200_000;
        let t = std::time::Instant::now();
        for _ in 0..n {
            let p = rt.malloc(0, size, 0, DEFAULT).unwrap();
            rt.free(p).unwrap();
        }
        println!(
            "bridge runtime on CUDA: {size:>9} B: {:.1} ns per malloc+free",
            t.elapsed().as_nanos() as f64 / n as f64
        );
    }
    for p in keep {
        rt.free(p).unwrap();
    }
}
