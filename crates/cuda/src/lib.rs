//! stweaver-cuda: the CUDA `DeviceMemory` for the online engine.
//!
//! Thin RAII wrappers over the CUDA driver's virtual-memory API and events, through
//! `cudarc`'s raw `driver::sys` layer loaded with `dlopen` at first use:
//!
//! - [`Driver`] — libcuda loaded and `cuInit` done (or [`CudaError::NoDriver`], never a panic).
//! - [`CudaDevice`] — one device: primary context, granularity, [`CudaDevice::reserve`]
//!   ([`VaRange`]), [`CudaDevice::map`] ([`Mapping`]), [`CudaDevice::create_event`] ([`Event`]).
//!
//! This crate knows nothing about torch; streams are raw `cudaStream_t` values as `usize`.

mod device;
mod driver;
mod memory;

pub use device::{CudaDevice, Event, Mapping, PinnedHost, VaRange};
pub use driver::{CudaError, Driver, Result};
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
