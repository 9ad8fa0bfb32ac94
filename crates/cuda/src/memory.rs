//! [`CudaMemory`]: the engine's [`DeviceMemory`] on a real CUDA device.
//!
//! - Reservations are [`VaRange`]s kept by base address.
//! - Physical memory is created and mapped **one allocation handle per `map` call**: the
//!   driver cannot unmap part of a mapping (`cuMemUnmap` takes whole mapped ranges), and
//!   the engine only unmaps unions of whole `map` ranges (the `DeviceMemory::unmap`
//!   contract). One handle per call rather than one per 2 MiB granule matters for speed:
//!   on an H200 a streaming copy over memory mapped granule by granule took 1.29× as long
//!   as over `cudaMalloc` memory or one handle (`python/bench/vmm_probe.py`,
//!   BENCHMARKS.md). Access is set once per `map` call over the whole range, for this
//!   device and every peer enabled with [`CudaMemory::enable_peer_access`].
//! - Host buffers ([`DeviceMemory::alloc_host`], what a pause that keeps contents copies
//!   through) are page-locked ([`PinnedHost`], `cuMemHostAlloc`): device↔host copies
//!   from them run at the link's speed (about 50 GB/s on an H100's PCIe 5 link, against
//!   1–6 GB/s through fresh pageable memory).
//! - Events are driver events (timing disabled) keyed by their raw handle; an event never
//!   recorded is complete, as in CUDA.
//!
//! Every method checks the engine's contract (granule alignment, inside one reservation,
//! mapped/unmapped state) before a driver call, so a violation is
//! [`DeviceError::InvalidRange`], never a driver fault. The bookkeeping lock is never held
//! across a driver call that can be slow (`cuMemCreate`, `cuMemMap`, synchronisation).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};

use stweaver_core::engine::{
    DeviceError, DeviceEvent, DeviceMemory, DevicePtr, HostBuffer, HostMem,
};
use stweaver_core::units::{Bytes, StreamId};

use crate::device::{CudaDevice, Event, Mapping, PinnedHost, VaRange};
use crate::driver::{CudaError, Result as CudaResult};

/// Device-memory traffic counters (what `num_device_alloc` and friends count, and more).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaCounters {
    pub reserves: u64,
    pub releases: u64,
    pub maps: u64,
    pub unmaps: u64,
    pub mapped_bytes: u64,
    pub events_created: u64,
    pub synchronizes: u64,
    /// `cuStreamWaitEvent` calls (a plan placing a request over pending frees).
    pub stream_waits: u64,
    /// Page-locked host buffers allocated (`cuMemHostAlloc`) and their bytes.
    pub host_allocs: u64,
    pub host_alloc_bytes: u64,
}

impl HostMem for PinnedHost {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

/// The CUDA implementation of [`DeviceMemory`] for one device.
#[derive(Debug)]
pub struct CudaMemory {
    device: CudaDevice,
    granule: u64,
    state: Mutex<State>,
    events: Mutex<HashMap<u64, Event>>,
}

#[derive(Debug, Default)]
struct State {
    reservations: BTreeMap<u64, VaRange>,
    /// Start address → the mapping of one `map` call (one allocation handle each).
    mappings: BTreeMap<u64, Mapping>,
    /// Devices (other than ours) that may access our memory.
    peers: Vec<i32>,
    counters: CudaCounters,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded data is plain bookkeeping updated in single steps; a panic elsewhere
    // cannot leave it half-written, so keep serving instead of propagating poison.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn to_device_error(e: CudaError) -> DeviceError {
    match e {
        CudaError::Driver {
            call,
            code,
            name,
            description,
        } => DeviceError::Driver {
            call,
            code: code as i32,
            message: format!("{name}: {description}"),
        },
        CudaError::NoDriver => DeviceError::Driver {
            call: "dlopen(libcuda)",
            code: -1,
            message: e.to_string(),
        },
        CudaError::Unavailable { call, message } => DeviceError::Driver {
            call,
            code: -1,
            message,
        },
        CudaError::InvalidArgument { call, message } => DeviceError::Driver {
            call,
            code: -1,
            message: format!("invalid argument: {message}"),
        },
        CudaError::Host(e) => DeviceError::Driver {
            call: "pinned host memory",
            code: -1,
            message: e.to_string(),
        },
    }
}

fn bad(addr: u64, size: u64, reason: &'static str) -> DeviceError {
    DeviceError::InvalidRange {
        addr: DevicePtr(addr),
        size: Bytes(size),
        reason,
    }
}

impl CudaMemory {
    /// Opens CUDA device `ordinal` (see [`CudaDevice::open`]).
    pub fn open(ordinal: i32) -> CudaResult<CudaMemory> {
        let device = CudaDevice::open(ordinal)?;
        let granule = device.granularity();
        Ok(CudaMemory {
            device,
            granule,
            state: Mutex::new(State::default()),
            events: Mutex::new(HashMap::new()),
        })
    }

    /// The underlying device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Call counters and mapped bytes.
    pub fn counters(&self) -> CudaCounters {
        lock(&self.state).counters
    }

    /// Lets device `peer` read and write all memory mapped now and later (what PyTorch's
    /// `enablePeerAccess` asks of an allocator whose memory is `cuMemMap`ped). The caller
    /// enables the runtime's peer access (`cudaDeviceEnablePeerAccess`) itself.
    pub fn enable_peer_access(&self, peer: i32) -> CudaResult<()> {
        let mut st = lock(&self.state);
        if peer == self.device.ordinal() || st.peers.contains(&peer) {
            return Ok(());
        }
        for m in st.mappings.values() {
            self.device.set_access(m.ptr(), m.size(), &[peer])?;
        }
        st.peers.push(peer);
        Ok(())
    }

    /// Checks that `[addr, addr + size)` is non-empty, granule aligned and inside one
    /// reservation.
    fn check_range(&self, st: &State, addr: u64, size: u64) -> Result<(), DeviceError> {
        if size == 0 || !addr.is_multiple_of(self.granule) || !size.is_multiple_of(self.granule) {
            return Err(bad(addr, size, "not granule aligned or empty"));
        }
        let end = addr.checked_add(size).ok_or(bad(addr, size, "overflows"))?;
        match st.reservations.range(..=addr).next_back() {
            Some((_, r)) if end <= r.base() + r.size() => Ok(()),
            _ => Err(bad(addr, size, "outside every reservation")),
        }
    }

    /// Every byte of `[addr, addr + len)` lies in mappings of this device (the copies'
    /// contract: never hand the driver an unmapped range).
    fn check_mapped(&self, addr: u64, len: u64) -> Result<(), DeviceError> {
        let st = lock(&self.state);
        let end = addr.checked_add(len).ok_or(bad(addr, len, "overflows"))?;
        let mut at = addr;
        while at < end {
            match st.mappings.range(..=at).next_back() {
                Some((_, m)) if m.ptr() + m.size() > at => at = m.ptr() + m.size(),
                _ => return Err(bad(addr, len, "touches unmapped memory")),
            }
        }
        Ok(())
    }

    fn event_known(&self, event: DeviceEvent) -> Result<(), DeviceError> {
        if lock(&self.events).contains_key(&event.0) {
            Ok(())
        } else {
            Err(DeviceError::UnknownEvent(event))
        }
    }

    fn with_event<T>(
        &self,
        event: DeviceEvent,
        f: impl FnOnce(&Event) -> CudaResult<T>,
    ) -> Result<T, DeviceError> {
        let events = lock(&self.events);
        let ev = events
            .get(&event.0)
            .ok_or(DeviceError::UnknownEvent(event))?;
        // Record and query are short, non-blocking driver calls; holding the event table
        // lock across them keeps a concurrent destroy from freeing the event under us.
        f(ev).map_err(to_device_error)
    }
}

impl DeviceMemory for CudaMemory {
    fn granularity(&self) -> Bytes {
        Bytes(self.granule)
    }

    fn total_memory(&self) -> Bytes {
        Bytes(self.device.total_memory())
    }

    fn free_memory(&self) -> Result<Bytes, DeviceError> {
        let (free, _) = self.device.mem_info().map_err(to_device_error)?;
        Ok(Bytes(free))
    }

    fn reserve(&self, size: Bytes) -> Result<DevicePtr, DeviceError> {
        let size = size.get();
        if size == 0 || !size.is_multiple_of(self.granule) {
            return Err(bad(0, size, "reservation not a granule multiple"));
        }
        let range = self.device.reserve(size).map_err(|e| {
            if e.is_out_of_memory() {
                DeviceError::OutOfMemory { size: Bytes(size) }
            } else {
                to_device_error(e)
            }
        })?;
        let base = range.base();
        let mut st = lock(&self.state);
        st.reservations.insert(base, range);
        st.counters.reserves += 1;
        Ok(DevicePtr(base))
    }

    fn release(&self, base: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        let mut st = lock(&self.state);
        match st.reservations.get(&base.get()) {
            Some(r) if r.size() == size.get() => {}
            _ => return Err(bad(base.get(), size.get(), "not a whole reservation")),
        }
        let (lo, hi) = (base.get(), base.get() + size.get());
        if st.mappings.range(lo..hi).next().is_some() {
            return Err(bad(lo, size.get(), "reservation still has mapped granules"));
        }
        let range = st.reservations.remove(&lo);
        st.counters.releases += 1;
        drop(st);
        drop(range); // cuMemAddressFree
        Ok(())
    }

    fn map(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        let (addr, size) = (addr.get(), size.get());
        let peers;
        {
            let st = lock(&self.state);
            self.check_range(&st, addr, size)?;
            // Mappings never overlap, so only the last one starting below the end can.
            if st
                .mappings
                .range(..addr + size)
                .next_back()
                .is_some_and(|(_, m)| m.ptr() + m.size() > addr)
            {
                return Err(bad(addr, size, "maps an already mapped granule"));
            }
            peers = st.peers.clone();
        }
        // Create and map outside the lock (slow driver calls); the engine never maps the
        // same granule from two threads (its contract), and the reservation cannot go
        // away while the engine maps into it. One handle for the whole range.
        let m = match self.device.map_unchecked_access(addr, size) {
            Ok(m) => m,
            Err(e) => {
                return Err(if e.is_out_of_memory() {
                    DeviceError::OutOfMemory { size: Bytes(size) }
                } else {
                    to_device_error(e)
                });
            }
        };
        let mut who = vec![self.device.ordinal()];
        who.extend(peers);
        if let Err(e) = self.device.set_access(addr, size, &who) {
            drop(m);
            return Err(to_device_error(e));
        }
        let mut st = lock(&self.state);
        st.mappings.insert(addr, m);
        st.counters.maps += 1;
        st.counters.mapped_bytes += size;
        Ok(())
    }

    fn unmap(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        let (addr, size) = (addr.get(), size.get());
        let mut st = lock(&self.state);
        self.check_range(&st, addr, size)?;
        // A union of whole mappings: they must follow each other from `addr` to the end.
        let end = addr + size;
        let mut at = addr;
        for (&s, m) in st.mappings.range(addr..end) {
            if s != at || s + m.size() > end {
                break;
            }
            at = s + m.size();
        }
        if at != end {
            return Err(bad(
                addr,
                size,
                "unmaps an unmapped granule or part of a mapping",
            ));
        }
        let starts: Vec<u64> = st.mappings.range(addr..end).map(|(&s, _)| s).collect();
        let gone: Vec<Mapping> = starts
            .into_iter()
            .filter_map(|s| st.mappings.remove(&s))
            .collect();
        st.counters.unmaps += 1;
        st.counters.mapped_bytes -= size;
        drop(st);
        drop(gone); // cuMemUnmap each mapping, outside the lock
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        lock(&self.state).counters.synchronizes += 1;
        self.device.synchronize().map_err(to_device_error)
    }

    fn create_event(&self) -> Result<DeviceEvent, DeviceError> {
        let ev = self.device.create_event().map_err(to_device_error)?;
        let id = ev.raw() as u64;
        lock(&self.events).insert(id, ev);
        lock(&self.state).counters.events_created += 1;
        Ok(DeviceEvent(id))
    }

    fn record_event(&self, event: DeviceEvent, stream: StreamId) -> Result<(), DeviceError> {
        self.with_event(event, |ev| self.device.record_event(ev, stream.0 as usize))
    }

    fn wait_event(&self, stream: StreamId, event: DeviceEvent) -> Result<(), DeviceError> {
        self.with_event(event, |ev| self.device.wait_event(ev, stream.0 as usize))?;
        lock(&self.state).counters.stream_waits += 1;
        Ok(())
    }

    fn query_event(&self, event: DeviceEvent) -> Result<bool, DeviceError> {
        self.with_event(event, Event::query)
    }

    fn synchronize_event(&self, event: DeviceEvent) -> Result<(), DeviceError> {
        self.event_known(event)?;
        // Do not hold the table lock while blocking: synchronise on a raw copy. The engine
        // does not destroy an event while it waits on it (contract).
        let raw = event.0;
        crate::device::synchronize_raw_event(raw).map_err(to_device_error)
    }

    fn destroy_event(&self, event: DeviceEvent) -> Result<(), DeviceError> {
        let ev = lock(&self.events)
            .remove(&event.0)
            .ok_or(DeviceError::UnknownEvent(event))?;
        drop(ev); // cuEventDestroy
        Ok(())
    }

    fn copy_to_host(&self, addr: DevicePtr, out: &mut [u8]) -> Result<(), DeviceError> {
        let (a, n) = (addr.get(), out.len() as u64);
        self.check_mapped(a, n)?;
        self.device.copy_to_host(a, out).map_err(to_device_error)
    }

    fn copy_from_host(&self, addr: DevicePtr, data: &[u8]) -> Result<(), DeviceError> {
        let (a, n) = (addr.get(), data.len() as u64);
        self.check_mapped(a, n)?;
        self.device.copy_from_host(a, data).map_err(to_device_error)
    }

    fn alloc_host(&self, bytes: Bytes) -> Result<HostBuffer, DeviceError> {
        let len =
            usize::try_from(bytes.get()).map_err(|_| DeviceError::OutOfMemory { size: bytes })?;
        let buf = self.device.alloc_pinned(len).map_err(to_device_error)?;
        {
            let mut st = lock(&self.state);
            st.counters.host_allocs += 1;
            st.counters.host_alloc_bytes += bytes.get();
        }
        Ok(HostBuffer::new(Box::new(buf), true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Driver;

    /// Without a driver: a clean error. With one (the GPU run): the engine's contract on a
    /// real device — granule mappings, partial unmaps, contract violations as errors,
    /// events that complete.
    #[test]
    fn cuda_memory_keeps_the_device_memory_contract() {
        if !Driver::is_present() {
            let e = CudaMemory::open(0).unwrap_err();
            assert_eq!(e, CudaError::NoDriver);
            return;
        }
        if Driver::get().map(|d| d.device_count()).unwrap_or(0) == 0 {
            return;
        }
        let m = CudaMemory::open(0).expect("open device 0");
        let g = m.granularity();
        assert!(g.get().is_power_of_two() && g.get() >= 512);
        assert!(m.total_memory().get() > 0);
        let free0 = m.free_memory().unwrap();
        let base = m.reserve(Bytes(8 * g.get())).unwrap();
        // Map 1 + 2 + 1 granules, unmap the middle mapping, map it again.
        let mid = DevicePtr(base.get() + g.get());
        m.map(base, Bytes(g.get())).unwrap();
        m.map(mid, Bytes(2 * g.get())).unwrap();
        m.map(DevicePtr(base.get() + 3 * g.get()), Bytes(g.get()))
            .unwrap();
        assert!(m.free_memory().unwrap().get() <= free0.get() - 4 * g.get() + g.get());
        // Part of a mapping is never unmapped.
        assert!(matches!(
            m.unmap(mid, Bytes(g.get())),
            Err(DeviceError::InvalidRange { .. })
        ));
        m.unmap(mid, Bytes(2 * g.get())).unwrap();
        m.map(mid, Bytes(2 * g.get())).unwrap();
        // Contract violations are errors, not driver faults.
        assert!(matches!(
            m.map(base, Bytes(g.get())),
            Err(DeviceError::InvalidRange { .. })
        ));
        assert!(matches!(
            m.unmap(DevicePtr(base.get() + 6 * g.get()), Bytes(g.get())),
            Err(DeviceError::InvalidRange { .. })
        ));
        assert!(matches!(
            m.map(DevicePtr(base.get() + 7 * g.get()), Bytes(2 * g.get())),
            Err(DeviceError::InvalidRange { .. })
        ));
        assert!(matches!(
            m.release(base, Bytes(8 * g.get())),
            Err(DeviceError::InvalidRange { .. })
        ));
        let ev = m.create_event().unwrap();
        assert!(
            m.query_event(ev).unwrap(),
            "an unrecorded event is complete"
        );
        m.record_event(ev, StreamId(0)).unwrap();
        m.synchronize_event(ev).unwrap();
        assert!(m.query_event(ev).unwrap());
        m.synchronize().unwrap();
        m.destroy_event(ev).unwrap();
        assert!(matches!(
            m.query_event(ev),
            Err(DeviceError::UnknownEvent(_))
        ));
        // Page-locked host buffers: a round trip through mapped memory.
        let n = g.get() as usize + 4096;
        let mut out = m.alloc_host(Bytes(n as u64)).unwrap();
        assert!(out.is_pinned() && out.len() == n);
        out.as_mut_slice()
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i % 251) as u8);
        m.copy_from_host(base, out.as_slice()).unwrap();
        let mut back = m.alloc_host(Bytes(n as u64)).unwrap();
        m.copy_to_host(base, back.as_mut_slice()).unwrap();
        assert!(back.as_slice() == out.as_slice());
        drop((out, back));
        assert_eq!(m.counters().host_allocs, 2);
        // Several whole mappings at once.
        m.unmap(base, Bytes(4 * g.get())).unwrap();
        m.release(base, Bytes(8 * g.get())).unwrap();
        let c = m.counters();
        assert_eq!((c.maps, c.unmaps, c.mapped_bytes), (4, 2, 0));
        m.enable_peer_access(0).unwrap(); // self: a no-op
    }
}
