//! The device the engine allocates from, as a trait.
//!
//! The engine never talks to CUDA directly: it asks a [`DeviceMemory`] for
//!
//! - **virtual address ranges** ([`DeviceMemory::reserve`] / [`DeviceMemory::release`];
//!   CUDA: `cuMemAddressReserve` / `cuMemAddressFree`),
//! - **physical backing** of granule-aligned sub-ranges of a reservation
//!   ([`DeviceMemory::map`] / [`DeviceMemory::unmap`]; CUDA: `cuMemCreate` + `cuMemMap` +
//!   `cuMemSetAccess`, and `cuMemUnmap` + `cuMemRelease`), in multiples of
//!   [`DeviceMemory::granularity`] (2 MiB on an H200),
//! - **events** to order a free behind work on other streams
//!   ([`DeviceMemory::create_event`], [`DeviceMemory::record_event`],
//!   [`DeviceMemory::query_event`], [`DeviceMemory::synchronize_event`],
//!   [`DeviceMemory::wait_event`],
//!   [`DeviceMemory::destroy_event`]; CUDA: `cudaEvent*`),
//! - a **device-wide synchronisation** before memory is unmapped
//!   ([`DeviceMemory::synchronize`]), and the device's **memory size**
//!   ([`DeviceMemory::total_memory`], [`DeviceMemory::free_memory`]),
//! - **host buffers** the device can copy into and out of at full speed
//!   ([`DeviceMemory::alloc_host`], a [`HostBuffer`]; CUDA: `cuMemHostAlloc` /
//!   `cuMemFreeHost`, page-locked memory), and the copies themselves
//!   ([`DeviceMemory::copy_to_host`] / [`DeviceMemory::copy_from_host`]), which a pause
//!   that keeps contents makes.
//!
//! The host implementation for tests is [`crate::engine::HostMemory`].
//!
//! # Contract
//!
//! Implementations are `Send + Sync`: the engine calls them from any thread, and never
//! while holding its own lock (so a slow `cuMemMap` does not stall other threads'
//! allocations). Every range passed to `map`/`unmap` lies inside one reservation and is
//! granule-aligned in address and size; `map` is only called on unmapped granules and
//! `unmap` only on mapped ones; `release` is only called on a whole reservation with
//! nothing mapped. A violation of these is reported as [`DeviceError::InvalidRange`],
//! never undefined behaviour.

use std::fmt;

use crate::units::{Bytes, StreamId};

/// A device virtual address (`CUdeviceptr`). 0 is never a valid allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The raw address.
    #[inline]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The address `bytes` further on. `None` on overflow.
    #[inline]
    pub const fn add(self, bytes: Bytes) -> Option<DevicePtr> {
        match self.0.checked_add(bytes.0) {
            Some(v) => Some(DevicePtr(v)),
            None => None,
        }
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// An event handle issued by a [`DeviceMemory`] (`cudaEvent_t` as an integer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceEvent(pub u64);

impl fmt::Display for DeviceEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ev{}", self.0)
    }
}

/// What a device call can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The device has no physical memory (or address space) left for the request.
    #[error("device out of memory mapping {size}")]
    OutOfMemory { size: Bytes },
    /// A range that is not granule-aligned, not inside one reservation, or not in the
    /// mapped/unmapped state the call needs.
    #[error("invalid range {addr} + {size}: {reason}")]
    InvalidRange {
        addr: DevicePtr,
        size: Bytes,
        reason: &'static str,
    },
    /// An event handle the device did not issue (or already destroyed).
    #[error("unknown event {0}")]
    UnknownEvent(DeviceEvent),
    /// The device does not implement the call (a pause that keeps contents on a
    /// device that cannot copy to the host).
    #[error("{0} is not supported by this device")]
    Unsupported(&'static str),
    /// A device synchronisation was asked for while a CUDA graph capture allocates on
    /// the device: it would invalidate the capture ([`DeviceMemory::may_synchronize`]).
    #[error(
        "the device cannot synchronise while a CUDA graph capture (or a MemPool context) allocates on it"
    )]
    CaptureUnderway,
    /// Any other failure of the driver, with the call that failed.
    #[error("{call} failed: {message} (code {code})")]
    Driver {
        call: &'static str,
        code: i32,
        message: String,
    },
}

/// The storage behind a [`HostBuffer`]: host memory a device allocated (page-locked
/// memory for CUDA), freed when dropped.
pub trait HostMem: Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, writable.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl HostMem for Box<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// Host memory to copy device bytes into and back ([`DeviceMemory::alloc_host`]):
/// page-locked (*pinned*) when the device made it so, so that a copy runs at the link's
/// speed instead of through a staging buffer, plain (*pageable*) memory otherwise. Freed
/// when dropped.
pub struct HostBuffer {
    mem: Box<dyn HostMem>,
    pinned: bool,
}

impl HostBuffer {
    /// A buffer over a device's own host allocation; `pinned` says whether the device can
    /// copy to and from it directly (page-locked).
    pub fn new(mem: Box<dyn HostMem>, pinned: bool) -> HostBuffer {
        HostBuffer { mem, pinned }
    }

    /// `len` zeroed bytes of ordinary (pageable) heap memory.
    pub fn pageable(len: usize) -> HostBuffer {
        HostBuffer::new(Box::new(vec![0u8; len].into_boxed_slice()), false)
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.mem.bytes().len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.mem.bytes()
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem.bytes_mut()
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len())
            .field("pinned", &self.pinned)
            .finish()
    }
}

/// Virtual memory, physical backing and stream events of one device.
///
/// See the module documentation for the contract the engine keeps.
pub trait DeviceMemory: Send + Sync {
    /// The mapping granularity: reservations, `map` and `unmap` ranges are multiples of
    /// it. A power of two, at least 512 B.
    fn granularity(&self) -> Bytes;

    /// Total memory of the device.
    fn total_memory(&self) -> Bytes;

    /// Memory the device could still map now (for out-of-memory reports).
    fn free_memory(&self) -> Result<Bytes, DeviceError>;

    /// Reserves `size` bytes (a granule multiple) of virtual address space, granule
    /// aligned, with nothing mapped.
    fn reserve(&self, size: Bytes) -> Result<DevicePtr, DeviceError>;

    /// Gives back a whole reservation made by [`DeviceMemory::reserve`]. Nothing in it
    /// may be mapped.
    fn release(&self, base: DevicePtr, size: Bytes) -> Result<(), DeviceError>;

    /// Backs `[addr, addr + size)` with physical memory, readable and writable by the
    /// device. The range is granule aligned, inside one reservation, and unmapped. It is
    /// later unmapped only whole (possibly together with neighbouring mapped ranges).
    fn map(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError>;

    /// Removes the physical backing of `[addr, addr + size)`: a union of whole ranges of
    /// earlier [`DeviceMemory::map`] calls (a mapping is never unmapped in part, so that
    /// a CUDA implementation can back each `map` call with one physical allocation).
    fn unmap(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError>;

    /// Waits until all work queued on the device has finished (before unmapping memory
    /// that kernels queued earlier might still touch).
    fn synchronize(&self) -> Result<(), DeviceError>;

    /// Whether [`DeviceMemory::synchronize`] may be called now. `false` while a CUDA
    /// graph capture is underway on the device (a synchronisation would invalidate it):
    /// the engine then gives no memory back at all (no device synchronisation, no
    /// unmap), as PyTorch's allocator releases no cache while a capture is underway; an
    /// allocation that does not fit is out of memory. `true` unless implemented.
    fn may_synchronize(&self) -> bool {
        true
    }

    /// Creates an event (completed until first recorded, as in CUDA).
    fn create_event(&self) -> Result<DeviceEvent, DeviceError>;

    /// Records `event` on `stream`: it completes once the stream has passed this point.
    fn record_event(&self, event: DeviceEvent, stream: StreamId) -> Result<(), DeviceError>;

    /// Makes work queued on `stream` from now on wait until `event` has completed,
    /// without blocking the host (CUDA: `cuStreamWaitEvent`). The engine calls it when a
    /// plan places a request on memory whose free still waits for `event` (plan mode,
    /// "waiting for pending frees": module `engine::pending`). A device that cannot
    /// order `stream` behind `event` (a stream being captured into a CUDA graph) returns
    /// an error, and the engine serves the request elsewhere.
    fn wait_event(&self, stream: StreamId, event: DeviceEvent) -> Result<(), DeviceError>;

    /// Whether the stream `event` was recorded on has passed it. Never blocks.
    fn query_event(&self, event: DeviceEvent) -> Result<bool, DeviceError>;

    /// Blocks until `event` has completed.
    fn synchronize_event(&self, event: DeviceEvent) -> Result<(), DeviceError>;

    /// Destroys an event.
    fn destroy_event(&self, event: DeviceEvent) -> Result<(), DeviceError>;

    /// Copies the device bytes `[addr, addr + out.len())` (mapped memory) into `out`,
    /// synchronously (CUDA: `cuMemcpyDtoH`). Used by [`crate::engine::Engine::pause`]
    /// to keep contents across a pause. Not supported unless implemented.
    fn copy_to_host(&self, addr: DevicePtr, out: &mut [u8]) -> Result<(), DeviceError> {
        let _ = (addr, out);
        Err(DeviceError::Unsupported("copy_to_host"))
    }

    /// Copies `data` to the device bytes `[addr, addr + data.len())` (mapped memory),
    /// synchronously (CUDA: `cuMemcpyHtoD`). Used by [`crate::engine::Engine::resume`].
    fn copy_from_host(&self, addr: DevicePtr, data: &[u8]) -> Result<(), DeviceError> {
        let _ = (addr, data);
        Err(DeviceError::Unsupported("copy_from_host"))
    }

    /// `bytes` of host memory that [`DeviceMemory::copy_to_host`] and
    /// [`DeviceMemory::copy_from_host`] copy to and from fastest (CUDA: page-locked,
    /// `cuMemHostAlloc`), zeroed or not. An error when the host cannot give it (the
    /// engine then falls back to pageable memory). Kept by the engine across pauses
    /// ([`crate::engine::Engine::pause`]). Pageable heap memory unless implemented.
    fn alloc_host(&self, bytes: Bytes) -> Result<HostBuffer, DeviceError> {
        let len =
            usize::try_from(bytes.get()).map_err(|_| DeviceError::OutOfMemory { size: bytes })?;
        Ok(HostBuffer::pageable(len))
    }
}

/// A shared device (one device behind several engines or a test's own handle).
impl<T: DeviceMemory + ?Sized> DeviceMemory for std::sync::Arc<T> {
    crate::forward_device_memory!(self => (**self);
        sizes, address_space, synchronize, events, host_copies);
}

/// Implements groups of [`DeviceMemory`]'s methods by calling the same method of `$to`
/// (an expression of `$self`, written `self` at the call site) with the same
/// arguments: for a device that wraps another (an `Arc`, a test's shifted or tracked
/// device) or hands its events to a [`FakeEvents`](crate::engine::FakeEvents). The
/// groups: `sizes` (`granularity`, `total_memory`, `free_memory`), `address_space`
/// (`reserve`, `release`, `map`, `unmap`), `synchronize` (and `may_synchronize`),
/// `events` (the six `*_event` methods) and `host_copies` (`copy_to_host`,
/// `copy_from_host`, `alloc_host`).
///
/// ```ignore
/// impl DeviceMemory for Wrapper {
///     stweaver_core::forward_device_memory!(self => self.inner; sizes, events);
///     // ... the methods it implements itself
/// }
/// ```
#[macro_export]
macro_rules! forward_device_memory {
    ($self:ident => $to:expr; $($group:ident),+ $(,)?) => {
        $($crate::forward_device_memory!(@$group $self ($to));)+
    };
    (@sizes $self:ident ($to:expr)) => {
        fn granularity(&$self) -> $crate::units::Bytes { $to.granularity() }
        fn total_memory(&$self) -> $crate::units::Bytes { $to.total_memory() }
        fn free_memory(&$self) -> ::core::result::Result<$crate::units::Bytes, $crate::engine::DeviceError> { $to.free_memory() }
    };
    (@address_space $self:ident ($to:expr)) => {
        fn reserve(&$self, size: $crate::units::Bytes) -> ::core::result::Result<$crate::engine::DevicePtr, $crate::engine::DeviceError> { $to.reserve(size) }
        fn release(&$self, base: $crate::engine::DevicePtr, size: $crate::units::Bytes) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.release(base, size) }
        fn map(&$self, addr: $crate::engine::DevicePtr, size: $crate::units::Bytes) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.map(addr, size) }
        fn unmap(&$self, addr: $crate::engine::DevicePtr, size: $crate::units::Bytes) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.unmap(addr, size) }
    };
    (@synchronize $self:ident ($to:expr)) => {
        fn synchronize(&$self) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.synchronize() }
        fn may_synchronize(&$self) -> bool { $to.may_synchronize() }
    };
    (@events $self:ident ($to:expr)) => {
        fn create_event(&$self) -> ::core::result::Result<$crate::engine::DeviceEvent, $crate::engine::DeviceError> { $to.create_event() }
        fn record_event(&$self, event: $crate::engine::DeviceEvent, stream: $crate::units::StreamId) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.record_event(event, stream) }
        fn wait_event(&$self, stream: $crate::units::StreamId, event: $crate::engine::DeviceEvent) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.wait_event(stream, event) }
        fn query_event(&$self, event: $crate::engine::DeviceEvent) -> ::core::result::Result<bool, $crate::engine::DeviceError> { $to.query_event(event) }
        fn synchronize_event(&$self, event: $crate::engine::DeviceEvent) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.synchronize_event(event) }
        fn destroy_event(&$self, event: $crate::engine::DeviceEvent) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.destroy_event(event) }
    };
    (@host_copies $self:ident ($to:expr)) => {
        fn copy_to_host(&$self, addr: $crate::engine::DevicePtr, out: &mut [u8]) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.copy_to_host(addr, out) }
        fn copy_from_host(&$self, addr: $crate::engine::DevicePtr, data: &[u8]) -> ::core::result::Result<(), $crate::engine::DeviceError> { $to.copy_from_host(addr, data) }
        fn alloc_host(&$self, bytes: $crate::units::Bytes) -> ::core::result::Result<$crate::engine::HostBuffer, $crate::engine::DeviceError> { $to.alloc_host(bytes) }
    };
}
