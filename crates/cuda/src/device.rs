//! One CUDA device: its primary context, the virtual-memory granule, and thin RAII
//! wrappers over the driver's virtual-memory API and events.
//!
//! - [`VaRange`] — a reserved virtual address range (`cuMemAddressReserve`, freed with
//!   `cuMemAddressFree` on drop).
//! - [`Mapping`] — physical memory mapped into a range (`cuMemCreate` + `cuMemMap` +
//!   `cuMemSetAccess`; the allocation handle is released right after mapping, so the
//!   memory lives exactly as long as the mapping; `cuMemUnmap` on drop returns it).
//! - [`Event`] — a CUDA event recorded on a raw stream (`cuEventCreate` with timing
//!   disabled, `cuEventRecord`, `cuEventQuery`, `cuEventDestroy` on drop).
//! - [`PinnedHost`] — page-locked host memory (a registered huge-page mapping, or
//!   `cuMemHostAlloc`; portable to every context; see module `host`), which device copies
//!   reach at the link's speed.
//!
//! Dropping a [`VaRange`] while a [`Mapping`] inside it is alive is a driver error, which
//! the range's drop ignores; owners drop mappings first.

use std::marker::PhantomData;

use cudarc::driver::sys::{self, CUresult};

use crate::driver::{CtxGuard, CudaError, Driver, Result, call, call_raw, check};

/// A CUDA device, with its primary context retained for the device's lifetime.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    granularity: u64,
    total_memory: u64,
}

// Safety: `CUcontext` is a driver handle usable from any thread (we only push it as the
// current context around calls); the struct holds no thread-affine state.
unsafe impl Send for CudaDevice {}
// Safety: every method takes `&self` and only passes the handles to thread-safe driver calls.
unsafe impl Sync for CudaDevice {}

fn alloc_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // Safety: `CUmemAllocationProp` is a plain C struct for which all-zero is the documented
    // "no flags" initial value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    prop
}

impl CudaDevice {
    /// Opens device `ordinal`: loads the driver if needed, retains the primary context
    /// (the one the CUDA runtime, hence PyTorch, uses) and reads the mapping granularity.
    pub fn open(ordinal: i32) -> Result<CudaDevice> {
        let driver = Driver::get()?;
        if ordinal < 0 || ordinal >= driver.device_count() {
            return Err(CudaError::invalid(
                "CudaDevice::open",
                format!(
                    "device {ordinal} does not exist (the driver sees {} device(s))",
                    driver.device_count()
                ),
            ));
        }
        let mut dev: sys::CUdevice = 0;
        // Safety: valid out-pointer, ordinal checked against the device count.
        call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // Safety: valid out-pointer and device handle.
        call("cuDevicePrimaryCtxRetain", || unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        let mut total: usize = 0;
        // Safety: valid out-pointer and device handle.
        let total_res = call("cuDeviceTotalMem", || unsafe {
            sys::cuDeviceTotalMem_v2(&mut total, dev)
        });
        let prop = alloc_prop(dev);
        let mut gran: usize = 0;
        // Safety: `prop` is fully initialised; valid out-pointer.
        let gran_res = call("cuMemGetAllocationGranularity", || unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        });
        if let Err(e) = total_res.and(gran_res) {
            // Safety: balances the retain above; nothing else holds this reference yet.
            let _ = call("cuDevicePrimaryCtxRelease", || unsafe {
                sys::cuDevicePrimaryCtxRelease_v2(dev)
            });
            return Err(e);
        }
        if gran == 0 || !gran.is_power_of_two() {
            return Err(CudaError::invalid(
                "cuMemGetAllocationGranularity",
                format!("driver reported granularity {gran}, not a power of two"),
            ));
        }
        Ok(CudaDevice {
            ordinal,
            dev,
            ctx,
            granularity: gran as u64,
            total_memory: total as u64,
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The mapping granule (2 MiB on current GPUs): every reservation, offset and mapping
    /// size is a multiple of it.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> u64 {
        self.total_memory
    }

    /// Free and total device memory as the driver sees them (`cuMemGetInfo`).
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        let _g = CtxGuard::push(self.ctx)?;
        let (mut free, mut total) = (0usize, 0usize);
        // Safety: valid out-pointers; a context is current (guard).
        call("cuMemGetInfo", || unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    fn check_granular(&self, call: &'static str, what: &str, v: u64) -> Result<()> {
        if v == 0 || !v.is_multiple_of(self.granularity) {
            return Err(CudaError::invalid(
                call,
                format!(
                    "{what} = {v} is not a positive multiple of the granularity {}",
                    self.granularity
                ),
            ));
        }
        Ok(())
    }

    /// Reserves `size` bytes of virtual address space (no physical memory).
    pub fn reserve(&self, size: u64) -> Result<VaRange> {
        self.check_granular("cuMemAddressReserve", "size", size)?;
        let _g = CtxGuard::push(self.ctx)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // Safety: valid out-pointer; size checked; alignment = granularity; no fixed address.
        call("cuMemAddressReserve", || unsafe {
            sys::cuMemAddressReserve(&mut ptr, size as usize, self.granularity as usize, 0, 0)
        })?;
        Ok(VaRange {
            base: ptr,
            size,
            _not_sync: PhantomData,
        })
    }

    /// Backs `[offset, offset + size)` of `range` with new physical memory, readable and
    /// writable by this device. A driver out-of-memory is reported as such
    /// ([`CudaError::is_out_of_memory`]).
    pub fn map(&self, range: &VaRange, offset: u64, size: u64) -> Result<Mapping> {
        self.check_granular("cuMemMap", "size", size)?;
        if !offset.is_multiple_of(self.granularity)
            || offset.checked_add(size).is_none_or(|end| end > range.size)
        {
            return Err(CudaError::invalid(
                "cuMemMap",
                format!(
                    "offset {offset} + size {size} does not fit granule-aligned in a range of {}",
                    range.size
                ),
            ));
        }
        let mapping = self.map_unchecked_access(range.base + offset, size)?;
        // On error `mapping` drops here and unmaps.
        self.set_access(mapping.ptr(), size, &[self.ordinal])?;
        Ok(mapping)
    }

    /// `cuMemCreate` + `cuMemMap` of `size` bytes at `va`, then `cuMemRelease` of the
    /// handle (the mapping keeps the memory alive until it is unmapped). Access is not set.
    /// The caller guarantees `va..va+size` is granule aligned, inside a live reservation
    /// and unmapped.
    pub(crate) fn map_unchecked_access(&self, va: u64, size: u64) -> Result<Mapping> {
        let _g = CtxGuard::push(self.ctx)?;
        let prop = alloc_prop(self.dev);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // Safety: valid out-pointer; `prop` initialised; size is a granule multiple.
        call("cuMemCreate", || unsafe {
            sys::cuMemCreate(&mut handle, size as usize, &prop, 0)
        })?;
        // Safety: `va..va+size` lies inside a live reservation and is unmapped (caller), and
        // `handle` is a fresh allocation of exactly `size` bytes.
        let mapped = call("cuMemMap", || unsafe {
            sys::cuMemMap(va, size as usize, 0, handle, 0)
        });
        // Safety: releases our reference to the handle: if the map succeeded the mapping
        // holds the memory until `cuMemUnmap`; if it failed nothing references it.
        let released = call("cuMemRelease", || unsafe { sys::cuMemRelease(handle) });
        mapped?;
        let mapping = Mapping {
            ptr: va,
            size,
            _not_sync: PhantomData,
        };
        released?;
        Ok(mapping)
    }

    /// Gives `devices` read/write access to the mapped range `[va, va + size)` (one
    /// `cuMemSetAccess` call with one descriptor per device).
    pub(crate) fn set_access(&self, va: u64, size: u64, devices: &[i32]) -> Result<()> {
        let descs: Vec<sys::CUmemAccessDesc> = devices
            .iter()
            .map(|&d| {
                // Safety: zero is a valid "no flags" initial value of this plain C struct.
                let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                desc.location.id = d;
                desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                desc
            })
            .collect();
        let _g = CtxGuard::push(self.ctx)?;
        // Safety: `va..va+size` is fully mapped (caller); `descs` holds `len` descriptors.
        call("cuMemSetAccess", || unsafe {
            sys::cuMemSetAccess(va, size as usize, descs.as_ptr(), descs.len())
        })
    }

    /// `len` bytes of page-locked host memory, portable (pinned for every context), not
    /// zeroed as far as the caller may assume. Made fast where it can be (module `host`:
    /// an anonymous huge-page mapping faulted in by [`crate::pin_threads`] threads, then
    /// `cuMemHostRegister`), else by `cuMemHostAlloc` (`STWEAVER_PIN_THREADS=0`, or a
    /// mapping or registration that failed for another reason than memory). Holds a
    /// reference on this device's primary context until dropped, so the memory is given
    /// back (`cuMemHostUnregister` + `munmap`, or `cuMemFreeHost`) in the context it was
    /// made in, whatever happens to this `CudaDevice` first. More than the host can give
    /// is [`CudaError::Host`] (checked before any page is touched); a host out of
    /// page-lockable memory is a driver error (`CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn alloc_pinned(&self, len: usize) -> Result<PinnedHost> {
        self.alloc_pinned_with(len, crate::host::pin_threads()?)
    }

    /// [`CudaDevice::alloc_pinned`] with `threads` faulting the pages in (`0`:
    /// `cuMemHostAlloc`), whatever `STWEAVER_PIN_THREADS` says.
    pub fn alloc_pinned_with(&self, len: usize, threads: usize) -> Result<PinnedHost> {
        if len == 0 {
            return Err(CudaError::invalid(
                "cuMemHostAlloc",
                "a zero-byte host buffer",
            ));
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // Safety: valid out-pointer and device handle; balanced by the release below on
        // failure, or by `PinnedHost`'s drop.
        call("cuDevicePrimaryCtxRetain", || unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, self.dev)
        })?;
        let release = || {
            // Safety: balances the retain above (this buffer's own reference).
            let _ = call("cuDevicePrimaryCtxRelease", || unsafe {
                sys::cuDevicePrimaryCtxRelease_v2(self.dev)
            });
        };
        let made = if threads > 0 {
            match self.register_pinned(ctx, len, threads) {
                Ok(map) => Ok((map.as_ptr().cast_mut(), Some(map))),
                Err(e) if e.is_out_of_memory() => Err(e),
                // Another failure (no huge-page support is not one: that only slows the
                // touch): the driver's own allocation may still work.
                Err(_) => self.driver_pinned(ctx, len).map(|p| (p, None)),
            }
        } else {
            self.driver_pinned(ctx, len).map(|p| (p, None))
        };
        match made {
            Ok((ptr, map)) => Ok(PinnedHost {
                ptr,
                len,
                dev: self.dev,
                ctx,
                map,
            }),
            Err(e) => {
                release();
                Err(e)
            }
        }
    }

    /// The fast path of [`CudaDevice::alloc_pinned`]: a faulted huge-page mapping,
    /// registered with the driver (portable).
    fn register_pinned(
        &self,
        ctx: sys::CUcontext,
        len: usize,
        threads: usize,
    ) -> Result<memmap2::MmapMut> {
        let mut map = crate::host::faulted_mapping(len, threads)?;
        let _g = CtxGuard::push(ctx)?;
        // Safety: `map` is a live mapping of exactly `len` bytes that outlives the
        // registration (`PinnedHost` unregisters before dropping it); a context is current.
        call("cuMemHostRegister", || unsafe {
            sys::cuMemHostRegister_v2(
                map.as_mut_ptr().cast(),
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        })?;
        Ok(map)
    }

    /// `cuMemHostAlloc` (portable) of `len` bytes in `ctx`.
    fn driver_pinned(&self, ctx: sys::CUcontext, len: usize) -> Result<*mut u8> {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        CtxGuard::push(ctx).and_then(|_g| {
            // Safety: valid out-pointer; `len` > 0; a context is current (guard).
            call("cuMemHostAlloc", || unsafe {
                sys::cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE)
            })
        })?;
        if p.is_null() {
            return Err(CudaError::invalid(
                "cuMemHostAlloc",
                "the driver returned a null pointer",
            ));
        }
        Ok(p.cast())
    }

    /// Copies `out.len()` bytes from device address `src` (mapped memory of this device)
    /// into `out` (`cuMemcpyDtoH`: synchronous; at the link's speed when `out` is
    /// page-locked, [`CudaDevice::alloc_pinned`], staged through a driver buffer otherwise).
    pub fn copy_to_host(&self, src: u64, out: &mut [u8]) -> Result<()> {
        let _g = CtxGuard::push(self.ctx)?;
        // Safety: a context is current (guard); `out` is a valid writable host buffer of
        // `out.len()` bytes for the whole (synchronous) call; the caller guarantees the
        // device range is mapped (a bad range is a driver error, not UB on the host).
        call("cuMemcpyDtoH", || unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, out.len())
        })
    }

    /// Copies `data` to device address `dst` (mapped memory of this device)
    /// (`cuMemcpyHtoD`: returns once the source buffer may be reused).
    pub fn copy_from_host(&self, dst: u64, data: &[u8]) -> Result<()> {
        let _g = CtxGuard::push(self.ctx)?;
        // Safety: a context is current (guard); `data` is a valid readable host buffer of
        // `data.len()` bytes for the whole call; a bad device range is a driver error.
        call("cuMemcpyHtoD", || unsafe {
            sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len())
        })?;
        // Make the bytes visible before the engine hands the blocks back.
        self.synchronize()
    }

    /// Waits for all work queued on this device (`cuCtxSynchronize` in its primary context).
    pub fn synchronize(&self) -> Result<()> {
        let _g = CtxGuard::push(self.ctx)?;
        // Safety: a context is current (guard).
        call("cuCtxSynchronize", || unsafe { sys::cuCtxSynchronize() })
    }

    /// Records `event` (created by this device) on `stream` — a raw `cudaStream_t`; 0 is
    /// the legacy default stream — with this device's context current, so the call works
    /// from any thread, including one on which the CUDA runtime never made it current.
    pub fn record_event(&self, event: &Event, stream: usize) -> Result<()> {
        let _g = CtxGuard::push(self.ctx)?;
        event.record_raw(stream)
    }

    /// Makes work queued on `stream` from now on wait for `event`'s last recording
    /// (`cuStreamWaitEvent`; the host does not block). Refused, with nothing queued, on a
    /// stream being captured into a CUDA graph: a captured wait on an event recorded
    /// outside the capture would invalidate the capture.
    pub fn wait_event(&self, event: &Event, stream: usize) -> Result<()> {
        let _g = CtxGuard::push(self.ctx)?;
        let s = stream as sys::CUstream;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // Safety: `stream` is a live stream handle of this device's context (the caller got
        // it from PyTorch), `status` a valid out-pointer; a context is current.
        call("cuStreamIsCapturing", || unsafe {
            sys::cuStreamIsCapturing(s, &mut status)
        })?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(CudaError::invalid(
                "cuStreamWaitEvent",
                "the stream is being captured into a CUDA graph",
            ));
        }
        // Safety: `event.raw` is a live event and `stream` a live stream of this context.
        call("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(s, event.raw, 0)
        })
    }

    /// Creates an event (timing disabled) in this device's context.
    pub fn create_event(&self) -> Result<Event> {
        let _g = CtxGuard::push(self.ctx)?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // Safety: valid out-pointer; a context is current.
        call("cuEventCreate", || unsafe {
            sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Event { raw: ev })
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Safety: balances the retain in `open`.
        let _ = call("cuDevicePrimaryCtxRelease", || unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev)
        });
    }
}

/// A reserved range of device virtual addresses. Freed on drop; mappings inside it must be
/// dropped first.
#[derive(Debug)]
pub struct VaRange {
    base: u64,
    size: u64,
    // Owned, movable between threads, but not shared by reference across threads.
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl VaRange {
    /// The first address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The length in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether `addr` lies inside the range.
    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.base && addr - self.base < self.size
    }
}

impl Drop for VaRange {
    fn drop(&mut self) {
        // Safety: `base/size` are exactly what `cuMemAddressReserve` returned; the range is
        // freed once (drop).
        let _ = call("cuMemAddressFree", || unsafe {
            sys::cuMemAddressFree(self.base, self.size as usize)
        });
    }
}

/// Physical memory mapped at `[ptr, ptr + size)`. Unmapped (and the memory returned to the
/// device) on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: u64,
    size: u64,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl Mapping {
    /// The first mapped address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Mapped bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Safety: unmaps exactly the range mapped in `CudaDevice::map`, once. The memory is
        // no longer handed out by the owner (the engine frees before it unmaps).
        let _ = call("cuMemUnmap", || unsafe {
            sys::cuMemUnmap(self.ptr, self.size as usize)
        });
    }
}

/// Page-locked host memory from [`CudaDevice::alloc_pinned`]: `len` bytes the device
/// copies to and from directly. Given back on drop (unregistered and unmapped, or
/// `cuMemFreeHost`), in the primary context it was made in, which it keeps retained
/// until then.
#[derive(Debug)]
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    /// The registered mapping (fast path); None: `ptr` is the driver's `cuMemHostAlloc`.
    map: Option<memmap2::MmapMut>,
}

// Safety: the buffer owns its memory exclusively (no other pointer to it is handed out
// except through `&self`/`&mut self` borrows), and plain bytes may move between threads;
// the context handle is only used to free the memory, which the driver allows from any
// thread.
unsafe impl Send for PinnedHost {}
// Safety: shared access only reads the bytes (`as_slice`); writes need `&mut self`.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes (never: `alloc_pinned` refuses zero bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether it was made by the fast path (a registered mapping) rather than
    /// `cuMemHostAlloc`.
    pub fn is_registered(&self) -> bool {
        self.map.is_some()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // Safety: `ptr` points to `len` bytes (a registered mapping, every byte written
        // zero by its touch, or the driver's `cuMemHostAlloc`: host-visible memory, every
        // byte initialised, its value unspecified until written), live until drop; shared
        // borrows exclude writes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // Safety: as in `as_slice`; `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        match CtxGuard::push(self.ctx) {
            Ok(_g) if self.map.is_some() => {
                // Safety: `ptr` was registered in this context (our retain keeps it
                // alive) and is unregistered once, before the mapping is unmapped (when
                // `self.map` drops after this function).
                let _ = call("cuMemHostUnregister", || unsafe {
                    sys::cuMemHostUnregister(self.ptr.cast())
                });
            }
            Ok(_g) => {
                // Safety: `ptr` came from `cuMemHostAlloc` in this context, which our
                // retain keeps alive; freed once (drop), and no borrow of the bytes
                // outlives `self`.
                let _ = call("cuMemFreeHost", || unsafe {
                    sys::cuMemFreeHost(self.ptr.cast())
                });
            }
            // No context to unregister in: the driver may still hold the pages, so the
            // mapping is left mapped (leaked) rather than unmapped under it.
            Err(_) => std::mem::forget(self.map.take()),
        }
        // Safety: balances the retain in `alloc_pinned`.
        let _ = call("cuDevicePrimaryCtxRelease", || unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev)
        });
    }
}

/// A CUDA event for stream ordering. Destroyed on drop (the driver defers destruction of a
/// recorded event until it completes).
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
}

// Safety: CUDA events are driver handles that may be recorded, queried and destroyed from
// any thread.
unsafe impl Send for Event {}
// Safety: as above; `record` and `query` are thread-safe driver calls.
unsafe impl Sync for Event {}

impl Event {
    /// Records the event on `stream` with a context current (see
    /// [`CudaDevice::record_event`], the public way in).
    fn record_raw(&self, stream: usize) -> Result<()> {
        let s = stream as sys::CUstream;
        // Safety: `raw` is a live event; `stream` is a stream handle the caller got from the
        // CUDA runtime (PyTorch) for a live stream of the event's device, and the device's
        // context is current (the legacy stream 0 names the current context's stream).
        call("cuEventRecord", || unsafe {
            sys::cuEventRecord(self.raw, s)
        })
    }

    /// Whether all work captured by the last `record` has completed.
    pub fn query(&self) -> Result<bool> {
        // Safety: `raw` is a live event.
        let r = call_raw("cuEventQuery", || unsafe { sys::cuEventQuery(self.raw) })?;
        match r {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|_| false),
        }
    }

    /// Blocks until the event completes.
    pub fn synchronize(&self) -> Result<()> {
        // Safety: `raw` is a live event.
        call("cuEventSynchronize", || unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// The raw handle (for logging).
    pub fn raw(&self) -> usize {
        self.raw as usize
    }
}

/// Blocks until the event with raw handle `raw` completes.
pub(crate) fn synchronize_raw_event(raw: u64) -> Result<()> {
    let ev = raw as sys::CUevent;
    // Safety: the caller checked `raw` is a live event it created.
    call("cuEventSynchronize", || unsafe {
        sys::cuEventSynchronize(ev)
    })
}

impl Drop for Event {
    fn drop(&mut self) {
        // Safety: destroys the event created in `create_event`, once.
        let _ = call("cuEventDestroy", || unsafe {
            sys::cuEventDestroy_v2(self.raw)
        });
    }
}
