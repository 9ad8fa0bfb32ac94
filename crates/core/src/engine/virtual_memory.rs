//! A [`DeviceMemory`] that only does the accounting: address ranges and mappings, no
//! bytes behind them.
//!
//! [`VirtualMemory`] is [`crate::engine::HostMemory`] without the backing buffers, for
//! replaying real training traces through the engine (they peak at ~11 GB, which a
//! host-memory device would have to allocate and zero). It keeps the same contract
//! checks, so an engine bug is still an error here rather than silent:
//!
//! - **reservations** are handed out from a counter (high addresses, an unmapped guard
//!   granule after each) and kept in an ordered map (`host::VaSpace`, shared with
//!   [`crate::engine::HostMemory`]);
//! - **mappings** are an ordered set of disjoint, coalesced mapped ranges; mapping a
//!   range that is not granule aligned, outside one reservation or overlapping a mapped
//!   range is an error, as is unmapping a range that is not wholly mapped, or releasing a
//!   reservation that still has mappings. Mapping beyond the capacity fails with
//!   [`DeviceError::OutOfMemory`], like a full GPU;
//! - it counts mapped bytes and their **peak** (what a GPU would report as reserved
//!   memory), and the calls made;
//! - **events** are [`FakeEvents`], by default passed as soon as they are recorded
//!   (the GPU keeps up with the host), or left to the caller
//!   ([`VirtualMemory::manual_events`]).
//!
//! Cost: O(log r + log m) per call (r reservations, m mapped ranges), no per-granule
//! work; memory O(r + m).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use crate::engine::device::{DeviceError, DeviceMemory, DevicePtr};
use crate::engine::host::{FakeEvents, HostCounters, VaSpace};
use crate::units::Bytes;

/// First address handed out by [`VirtualMemory::reserve`].
const VA_START: u64 = 0x7f00_0000_0000;

/// Accounting-only device: see the module documentation.
#[derive(Debug)]
pub struct VirtualMemory {
    granule: u64,
    capacity: u64,
    inner: Mutex<Inner>,
    events: FakeEvents,
}

#[derive(Debug)]
struct Inner {
    va: VaSpace,
    /// start -> end of every mapped range (disjoint, not adjacent: coalesced).
    mapped: BTreeMap<u64, u64>,
    mapped_bytes: u64,
    peak_mapped: u64,
    counters: HostCounters,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain bookkeeping: keep serving after a panic elsewhere.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl VirtualMemory {
    /// A device of `capacity` bytes mapped in `granule`-byte granules (a power of two
    /// ≥ 512, else rounded up to one). Events complete as soon as they are recorded.
    pub fn new(capacity: Bytes, granule: Bytes) -> VirtualMemory {
        let granule = granule.get().max(512).next_power_of_two();
        VirtualMemory {
            granule,
            capacity: capacity.get(),
            inner: Mutex::new(Inner {
                va: VaSpace::new(VA_START, granule),
                mapped: BTreeMap::new(),
                mapped_bytes: 0,
                peak_mapped: 0,
                counters: HostCounters::default(),
            }),
            events: FakeEvents::passing_at_record(),
        }
    }

    /// The same device whose events complete only when the caller says so
    /// ([`VirtualMemory::events`]), or at a device synchronisation.
    pub fn manual_events(mut self) -> VirtualMemory {
        self.events.auto_pass = false;
        self
    }

    /// The fake events.
    pub fn events(&self) -> &FakeEvents {
        &self.events
    }

    /// Bytes mapped now.
    pub fn mapped_bytes(&self) -> Bytes {
        Bytes(lock(&self.inner).mapped_bytes)
    }

    /// The most bytes ever mapped at once.
    pub fn peak_mapped(&self) -> Bytes {
        Bytes(lock(&self.inner).peak_mapped)
    }

    /// Number of live reservations.
    pub fn reservations(&self) -> usize {
        lock(&self.inner).va.len()
    }

    /// How many calls of each kind were made.
    pub fn counters(&self) -> HostCounters {
        lock(&self.inner).counters
    }
}

impl DeviceMemory for VirtualMemory {
    fn granularity(&self) -> Bytes {
        Bytes(self.granule)
    }

    fn total_memory(&self) -> Bytes {
        Bytes(self.capacity)
    }

    fn free_memory(&self) -> Result<Bytes, DeviceError> {
        Ok(Bytes(
            self.capacity.saturating_sub(lock(&self.inner).mapped_bytes),
        ))
    }

    fn reserve(&self, size: Bytes) -> Result<DevicePtr, DeviceError> {
        let mut inner = lock(&self.inner);
        let base = inner.va.reserve(size.get())?;
        inner.counters.reserves += 1;
        Ok(DevicePtr(base))
    }

    fn release(&self, base: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        let mut inner = lock(&self.inner);
        let Inner { va, mapped, .. } = &mut *inner;
        // The last mapped range starting below `hi` is the only candidate that can
        // reach into `[lo, hi)` (ranges are disjoint and sorted).
        va.release(base, size, |lo, hi| {
            mapped
                .range(..hi)
                .next_back()
                .is_some_and(|(_, &end)| end > lo)
        })?;
        inner.counters.releases += 1;
        Ok(())
    }

    fn map(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        let mut inner = lock(&self.inner);
        let (lo, hi) = (addr.get(), inner.va.check_range(addr.get(), size.get())?);
        if inner
            .mapped
            .range(..hi)
            .next_back()
            .is_some_and(|(_, &end)| end > lo)
        {
            return Err(DeviceError::InvalidRange {
                addr,
                size,
                reason: "maps an already mapped granule",
            });
        }
        if inner.mapped_bytes + size.get() > self.capacity {
            return Err(DeviceError::OutOfMemory { size });
        }
        // Coalesce with a range ending at `lo` and one starting at `hi`.
        let mut start = lo;
        if let Some((&s, &e)) = inner.mapped.range(..lo).next_back()
            && e == lo
        {
            start = s;
        }
        let mut end = hi;
        if let Some(e) = inner.mapped.remove(&hi) {
            end = e;
        }
        inner.mapped.insert(start, end);
        inner.va.add_unit(lo, size.get());
        inner.mapped_bytes += size.get();
        inner.peak_mapped = inner.peak_mapped.max(inner.mapped_bytes);
        inner.counters.maps += 1;
        Ok(())
    }

    fn unmap(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        let mut inner = lock(&self.inner);
        let (lo, hi) = (addr.get(), inner.va.check_range(addr.get(), size.get())?);
        // Coalesced ranges: a wholly mapped range lies inside exactly one of them.
        let Some((&s, &e)) = inner.mapped.range(..=lo).next_back() else {
            return Err(DeviceError::InvalidRange {
                addr,
                size,
                reason: "unmaps an unmapped granule",
            });
        };
        if e < hi {
            return Err(DeviceError::InvalidRange {
                addr,
                size,
                reason: "unmaps an unmapped granule",
            });
        }
        if let Err(e) = inner.va.remove_units(lo, size.get()) {
            inner.counters.partial_unmaps += 1;
            return Err(e);
        }
        inner.mapped.remove(&s);
        if s < lo {
            inner.mapped.insert(s, lo);
        }
        if hi < e {
            inner.mapped.insert(hi, e);
        }
        inner.mapped_bytes -= size.get();
        inner.counters.unmaps += 1;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        lock(&self.inner).counters.synchronizes += 1;
        self.events.pass_everything();
        Ok(())
    }

    crate::forward_device_memory!(self => self.events; events);

    /// No bytes are kept: checks the range is mapped and leaves `out` as it is.
    fn copy_to_host(&self, addr: DevicePtr, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check_mapped(addr, out.len() as u64)
    }

    /// No bytes are kept: checks the range is mapped.
    fn copy_from_host(&self, addr: DevicePtr, data: &[u8]) -> Result<(), DeviceError> {
        self.check_mapped(addr, data.len() as u64)
    }
}

impl VirtualMemory {
    /// Whether every byte of `[addr, addr + len)` is mapped (the copies' contract).
    fn check_mapped(&self, addr: DevicePtr, len: u64) -> Result<(), DeviceError> {
        let bad = DeviceError::InvalidRange {
            addr,
            size: Bytes(len),
            reason: "touches unmapped memory",
        };
        let end = addr.get().checked_add(len).ok_or(bad.clone())?;
        let inner = lock(&self.inner);
        let mut at = addr.get();
        while at < end {
            match inner.mapped.range(..=at).next_back() {
                Some((_, &e)) if e > at => at = e,
                _ => return Err(bad),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, EngineConfig};
    use crate::units::StreamId;

    const G: u64 = 2 << 20;

    #[test]
    fn mappings_are_checked_coalesced_and_counted() {
        let v = VirtualMemory::new(Bytes(8 * G), Bytes(G));
        let base = v.reserve(Bytes(16 * G)).unwrap();
        let at = |k: u64| DevicePtr(base.get() + k * G);
        v.map(at(2), Bytes(2 * G)).unwrap();
        v.map(at(0), Bytes(G)).unwrap();
        v.map(at(1), Bytes(G)).unwrap(); // joins [0,1) and [2,4)
        assert_eq!(lock(&v.inner).mapped.len(), 1);
        assert_eq!(v.mapped_bytes(), Bytes(4 * G));
        assert!(
            v.map(at(3), Bytes(2 * G)).is_err(),
            "overlaps a mapped granule"
        );
        assert!(
            v.map(DevicePtr(at(5).get() + 512), Bytes(G)).is_err(),
            "unaligned"
        );
        assert!(v.map(at(15), Bytes(2 * G)).is_err(), "past the reservation");
        assert_eq!(
            v.map(at(4), Bytes(5 * G)),
            Err(DeviceError::OutOfMemory { size: Bytes(5 * G) })
        );
        assert!(
            v.unmap(at(1), Bytes(2 * G)).is_err(),
            "part of the mapping [2,4)"
        );
        v.unmap(at(1), Bytes(G)).unwrap(); // splits into [0,1) and [2,4)
        v.unmap(at(2), Bytes(2 * G)).unwrap();
        v.map(at(3), Bytes(G)).unwrap(); // [0,1) and [3,4)
        assert_eq!(lock(&v.inner).mapped.len(), 2);
        assert!(
            v.unmap(at(0), Bytes(2 * G)).is_err(),
            "granule 1 is unmapped"
        );
        assert!(v.unmap(at(2), Bytes(G)).is_err());
        assert!(v.release(base, Bytes(16 * G)).is_err(), "still mapped");
        v.unmap(at(0), Bytes(G)).unwrap();
        v.unmap(at(3), Bytes(G)).unwrap();
        assert_eq!(v.mapped_bytes(), Bytes(0));
        assert_eq!(v.peak_mapped(), Bytes(4 * G));
        assert!(
            v.release(base, Bytes(8 * G)).is_err(),
            "not the whole reservation"
        );
        v.release(base, Bytes(16 * G)).unwrap();
        assert_eq!(v.reservations(), 0);
        let c = v.counters();
        assert_eq!((c.reserves, c.releases, c.maps, c.unmaps), (1, 1, 4, 4));
    }

    #[test]
    fn events_pass_at_once_unless_manual() {
        let v = VirtualMemory::new(Bytes(G), Bytes(G));
        let e = v.create_event().unwrap();
        v.record_event(e, StreamId(3)).unwrap();
        assert!(v.query_event(e).unwrap());
        let m = VirtualMemory::new(Bytes(G), Bytes(G)).manual_events();
        let e = m.create_event().unwrap();
        m.record_event(e, StreamId(3)).unwrap();
        assert!(!m.query_event(e).unwrap());
        m.events().pass_all(StreamId(3));
        assert!(m.query_event(e).unwrap());
        m.destroy_event(e).unwrap();
        assert!(m.query_event(e).is_err());
    }

    #[test]
    fn an_engine_runs_on_it_without_backing_bytes() {
        // 64 GiB of device: far more than the test could allocate for real.
        let v = std::sync::Arc::new(VirtualMemory::new(Bytes(64 << 30), Bytes(G)));
        let e = Engine::new(v.clone(), EngineConfig::default()).unwrap();
        let big: Vec<_> = (0..6)
            .map(|_| e.malloc(Bytes(5 << 30), StreamId(0)).unwrap())
            .collect();
        assert_eq!(v.mapped_bytes(), Bytes(30 << 30));
        for p in big {
            e.free(p).unwrap();
        }
        e.empty_cache().unwrap();
        assert_eq!(v.mapped_bytes(), Bytes(0));
        assert_eq!(v.peak_mapped(), Bytes(30 << 30));
        assert_eq!(e.stats().unwrap().reserved_bytes[0].peak, 30 << 30);
        e.check_invariants().unwrap();
    }
}
