//! stweaver-cuda: the CUDA `DeviceMemory` for the online engine.
//!
//! Thin RAII wrappers over the CUDA driver's virtual-memory API and events, through
//! `cudarc`'s raw `driver::sys` layer loaded with `dlopen` at first use:
//!
//! - [`Driver`] — libcuda loaded and `cuInit` done (or [`CudaError::NoDriver`], never a panic).
//! - [`CudaDevice`] — one device: primary context, granularity, [`CudaDevice::reserve`]
//!   ([`VaRange`]), [`CudaDevice::map`] ([`Mapping`]), [`CudaDevice::create_event`] ([`Event`]).
//!
//! - [`PinnedHost`] — page-locked host memory, pinned fast (module `host`: a huge-page
//!   mapping faulted in by several threads, then `cuMemHostRegister`).
//!
//! This crate knows nothing about torch; streams are raw `cudaStream_t` values as `usize`.

mod device;
mod driver;
mod host;
mod memory;

pub use device::{CudaDevice, Event, Mapping, PinnedHost, VaRange};
pub use driver::{CudaError, Driver, Result};
pub use host::{HostError, MAX_PIN_THREADS, host_available_bytes, pin_threads};
pub use memory::{CudaCounters, CudaMemory};

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a driver (CI, this build machine) every entry point is a clean
    /// error; on a GPU machine the same test exercises a real reserve/map/event round trip.
    #[test]
    fn no_driver_is_a_clean_error_or_a_real_round_trip() {
        if !Driver::is_present() {
            assert_eq!(Driver::get().unwrap_err(), CudaError::NoDriver);
            let err = CudaDevice::open(0).unwrap_err();
            assert_eq!(err, CudaError::NoDriver);
            assert!(err.to_string().contains("no NVIDIA driver"), "{err}");
            return;
        }
        let driver = Driver::get().expect("driver present but cuInit failed");
        if driver.device_count() == 0 {
            return;
        }
        let dev = CudaDevice::open(0).expect("open device 0");
        let g = dev.granularity();
        assert!(g.is_power_of_two());
        let range = dev.reserve(4 * g).expect("reserve");
        let m = dev.map(&range, g, 2 * g).expect("map");
        assert_eq!(m.ptr(), range.base() + g);
        assert!(range.contains(m.ptr()) && range.contains(m.ptr() + 2 * g - 1));
        // Out of range and unaligned are errors, not driver calls.
        assert!(matches!(
            dev.map(&range, 3 * g, 2 * g),
            Err(CudaError::InvalidArgument { .. })
        ));
        assert!(matches!(
            dev.reserve(g + 1),
            Err(CudaError::InvalidArgument { .. })
        ));
        let ev = dev.create_event().expect("event");
        dev.record_event(&ev, 0)
            .expect("record on the legacy stream");
        ev.synchronize().expect("sync");
        assert!(ev.query().expect("query"));
        // Pinned host memory both ways: the registered huge-page mapping (threads) and the
        // driver's allocation (0 threads); a copy through device memory and back.
        for threads in [4, 0] {
            let mut host = dev.alloc_pinned_with(3 << 20, threads).expect("pin");
            assert_eq!(host.is_registered(), threads > 0);
            host.as_mut_slice()
                .iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = (i % 253) as u8);
            dev.copy_from_host(m.ptr(), host.as_slice()).expect("h2d");
            let mut back = dev.alloc_pinned_with(3 << 20, threads).expect("pin");
            dev.copy_to_host(m.ptr(), back.as_mut_slice()).expect("d2h");
            assert!(back.as_slice() == host.as_slice(), "threads {threads}");
        }
        drop(m);
        drop(range);
    }

    #[test]
    fn opening_a_missing_device_is_an_error() {
        let err = CudaDevice::open(-1).unwrap_err();
        assert!(
            matches!(err, CudaError::NoDriver | CudaError::InvalidArgument { .. }),
            "{err:?}"
        );
    }
}
