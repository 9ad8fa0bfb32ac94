//! The device each engine gets: a [`BridgeDevice`] shared by all engines (pools) of one
//! CUDA device, wrapped so that the runtime learns what the engine does with it.
//!
//! [`Tracked`] forwards every [`DeviceMemory`] call and, on the side,
//! - records which reservation belongs to which (device, pool), so a free or a
//!   `record_stream` finds its engine from the pointer alone ([`Shared::owner_of`]);
//! - emits `segment_map` / `segment_unmap` history events for PyTorch's memory history;
//! - holds every engine of the device to one memory budget ([`DeviceBudget`]): each engine
//!   also checks its own limit, but only the device-wide count sees the default pool,
//!   the private pools and the plan pool together, as PyTorch's
//!   `set_per_process_memory_fraction` does for its whole device allocator.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use stweaver_core::engine::{DeviceError, DeviceMemory, DevicePtr, HostMemory};
use stweaver_core::units::Bytes;
use stweaver_cuda::CudaMemory;

use crate::error::{BridgeError, Result};
use crate::ffi::bridge::{HistoryAction, HistoryEvent, PoolId};

/// A [`DeviceMemory`] the bridge can also give peer access to.
pub trait BridgeDevice: DeviceMemory {
    /// Lets device `peer` access all memory mapped now and later.
    fn enable_peer_access(&self, peer: i32) -> Result<()>;
}

impl BridgeDevice for CudaMemory {
    fn enable_peer_access(&self, peer: i32) -> Result<()> {
        CudaMemory::enable_peer_access(self, peer).map_err(BridgeError::from)
    }
}

impl BridgeDevice for HostMemory {
    /// Host memory is accessible from everywhere.
    fn enable_peer_access(&self, _peer: i32) -> Result<()> {
        Ok(())
    }
}

/// The memory budget of one device, shared by all its engines: bytes mapped now by any
/// of them, and the most they may map together (`u64::MAX`: no budget).
///
/// A map call takes its bytes from the budget before it reaches the device (one
/// compare-and-swap loop, no lock) and gives them back if the device refuses; an unmap
/// gives them back. A map over the budget fails as [`DeviceError::OutOfMemory`], so the
/// engine's own out-of-memory path (give back its cache, retry, then report) applies.
#[derive(Debug)]
pub struct DeviceBudget {
    mapped: AtomicU64,
    limit: AtomicU64,
}

impl Default for DeviceBudget {
    fn default() -> Self {
        DeviceBudget {
            mapped: AtomicU64::new(0),
            limit: AtomicU64::new(u64::MAX),
        }
    }
}

impl DeviceBudget {
    /// Bytes mapped by every engine of the device now.
    pub fn mapped(&self) -> u64 {
        self.mapped.load(Ordering::Acquire)
    }

    /// The budget in bytes (`u64::MAX`: none).
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }

    /// Sets the budget. Memory mapped above a lowered budget stays mapped; later maps
    /// wait until enough is given back.
    pub fn set_limit(&self, bytes: u64) {
        self.limit.store(bytes, Ordering::Release);
    }

    /// Takes `n` bytes if they fit under the budget.
    fn try_take(&self, n: u64) -> bool {
        let limit = self.limit();
        self.mapped
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
                m.checked_add(n).filter(|&after| after <= limit)
            })
            .is_ok()
    }

    fn give(&self, n: u64) {
        let _ = self
            .mapped
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
                Some(m.saturating_sub(n))
            });
    }
}

/// Allocations to a private pool in progress on one device, shared by all its engines:
/// `beginAllocateToPool` .. `endAllocateToPool`, i.e. a CUDA graph capture (or a
/// `torch.cuda.use_mem_pool` context, which looks the same to an allocator). While any
/// is in progress a device synchronisation could invalidate the capture, so [`Tracked`]
/// refuses it ([`DeviceError::CaptureUnderway`]) and says so in
/// [`DeviceMemory::may_synchronize`]: the engines then give no cache back, as PyTorch's
/// allocator releases none while a capture is underway.
#[derive(Debug, Default)]
pub struct CaptureGate {
    active: AtomicU64,
}

impl CaptureGate {
    /// An allocation to a private pool begins.
    pub fn begin(&self) {
        self.active.fetch_add(1, Ordering::AcqRel);
    }

    /// One ends; `false` (and no change) when none was in progress.
    pub fn end(&self) -> bool {
        self.active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Whether one is in progress.
    pub fn active(&self) -> bool {
        self.active.load(Ordering::Acquire) > 0
    }
}

/// Which engine a reservation belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub device: i32,
    pub pool: PoolId,
}

/// State shared by the runtime and every [`Tracked`] device.
#[derive(Debug, Default)]
pub struct Shared {
    history_on: AtomicBool,
    history: Mutex<Vec<HistoryEvent>>,
    /// Reservation base → (length, owner).
    owners: RwLock<BTreeMap<u64, (u64, Owner)>>,
}

impl Shared {
    /// Whether history events are being collected.
    #[inline]
    pub fn history_on(&self) -> bool {
        self.history_on.load(Ordering::Acquire)
    }

    pub fn set_history(&self, on: bool) {
        self.history_on.store(on, Ordering::Release);
        if !on {
            lock(&self.history).clear();
        }
    }

    /// Appends an event if history is on.
    pub fn push(&self, e: HistoryEvent) {
        if self.history_on() {
            lock(&self.history).push(e);
        }
    }

    /// Takes every collected event, oldest first.
    pub fn drain(&self) -> Vec<HistoryEvent> {
        std::mem::take(&mut *lock(&self.history))
    }

    /// The engine whose reservation holds `ptr`.
    pub fn owner_of(&self, ptr: u64) -> Option<Owner> {
        let owners = self.owners.read().unwrap_or_else(|e| e.into_inner());
        match owners.range(..=ptr).next_back() {
            Some((&base, &(len, owner))) if ptr - base < len => Some(owner),
            _ => None,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain event buffers: a panic elsewhere cannot leave them half-updated.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One engine's view of its device. See the module documentation.
pub struct Tracked {
    inner: Arc<dyn BridgeDevice>,
    owner: Owner,
    shared: Arc<Shared>,
    budget: Arc<DeviceBudget>,
    captures: Arc<CaptureGate>,
}

impl std::fmt::Debug for Tracked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracked")
            .field("owner", &self.owner)
            .finish()
    }
}

impl Tracked {
    pub fn new(
        inner: Arc<dyn BridgeDevice>,
        owner: Owner,
        shared: Arc<Shared>,
        budget: Arc<DeviceBudget>,
        captures: Arc<CaptureGate>,
    ) -> Tracked {
        Tracked {
            inner,
            owner,
            shared,
            budget,
            captures,
        }
    }

    fn event(&self, action: HistoryAction, addr: DevicePtr, size: Bytes) {
        self.shared.push(HistoryEvent {
            action,
            device: self.owner.device,
            addr: addr.get(),
            size: size.get(),
            stream: 0,
            pool: self.owner.pool,
        });
    }
}

impl DeviceMemory for Tracked {
    stweaver_core::forward_device_memory!(self => self.inner; sizes);

    fn reserve(&self, size: Bytes) -> Result<DevicePtr, DeviceError> {
        let base = self.inner.reserve(size)?;
        self.shared
            .owners
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(base.get(), (size.get(), self.owner));
        Ok(base)
    }

    fn release(&self, base: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        self.inner.release(base, size)?;
        self.shared
            .owners
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&base.get());
        Ok(())
    }

    fn map(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        if !self.budget.try_take(size.get()) {
            return Err(DeviceError::OutOfMemory { size });
        }
        if let Err(e) = self.inner.map(addr, size) {
            self.budget.give(size.get());
            return Err(e);
        }
        self.event(HistoryAction::SegmentMap, addr, size);
        Ok(())
    }

    fn unmap(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        self.inner.unmap(addr, size)?;
        self.budget.give(size.get());
        self.event(HistoryAction::SegmentUnmap, addr, size);
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        if self.captures.active() {
            return Err(DeviceError::CaptureUnderway);
        }
        self.inner.synchronize()
    }

    fn may_synchronize(&self) -> bool {
        !self.captures.active()
    }

    stweaver_core::forward_device_memory!(self => self.inner; events, host_copies);
}
