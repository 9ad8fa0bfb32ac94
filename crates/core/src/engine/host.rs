//! A [`DeviceMemory`] in host memory, for tests, fuzzing and benchmarks.
//!
//! [`HostMemory`] keeps real bookkeeping of what a GPU driver would track, and real bytes
//! behind every mapped granule, so a test can write sentinel patterns into allocations
//! and read them back:
//!
//! - **reservations** are address ranges handed out from a counter (starting high and
//!   separated by an unmapped guard gap, so an overrun never lands in a neighbour);
//! - **mapping** a granule allocates a zeroed buffer of one granule for it; unmapping
//!   drops it. Mapping more than the configured capacity fails with
//!   [`DeviceError::OutOfMemory`], like a full GPU;
//! - every contract violation (unaligned range, range outside a reservation, mapping a
//!   mapped granule, unmapping an unmapped one, releasing a reservation that still has
//!   mappings, touching unmapped bytes) is an error, so tests catch engine bugs here;
//! - **events** are [`FakeEvents`]: a test decides when a stream passes the events
//!   recorded on it. [`DeviceMemory::synchronize`] passes every event on every stream
//!   (after a device sync all queued work has finished). [`DeviceMemory::wait_event`]
//!   orders a stream after an event as CUDA does: the stream's later events pass only
//!   once the awaited one has, and [`FakeEvents::ordered_after`] tells a test whether a
//!   stream's next work runs after a recorded point of another (passed, or waited for,
//!   directly or through other streams).
//!
//! - **host buffers** ([`DeviceMemory::alloc_host`]) are boxed slices, reported as
//!   pinned; [`HostMemory::host_allocs`] and [`HostMemory::host_bytes`] count them and
//!   [`HostMemory::fail_host_allocs`] makes them fail, like an exhausted host.
//!
//! Costs are test-grade: a `Mutex` around `HashMap`s, O(granules) per map/unmap and per
//! byte range touched.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::engine::device::{
    DeviceError, DeviceEvent, DeviceMemory, DevicePtr, HostBuffer, HostMem,
};
use crate::units::{Bytes, StreamId};

/// First address handed out by [`HostMemory::reserve`].
const VA_START: u64 = 0x7e00_0000_0000;

/// The address-space bookkeeping both test devices share ([`HostMemory`] and
/// [`crate::engine::VirtualMemory`]): reservations handed out from a counter starting
/// high, each followed by an unmapped guard granule so that neighbours never touch, and
/// the range checks every map, unmap and release makes. O(log r) per call.
#[derive(Debug)]
pub(crate) struct VaSpace {
    granule: u64,
    next_va: u64,
    /// base -> size of every live reservation.
    reservations: BTreeMap<u64, u64>,
    /// start -> end of every mapped unit: the range of one `map` call, which (as a CUDA
    /// mapping of one physical allocation) can only be unmapped whole.
    units: BTreeMap<u64, u64>,
}

impl VaSpace {
    /// Reservations from `start` on, in `granule`-byte units.
    pub(crate) fn new(start: u64, granule: u64) -> VaSpace {
        VaSpace {
            granule,
            next_va: start,
            reservations: BTreeMap::new(),
            units: BTreeMap::new(),
        }
    }

    /// Number of live reservations.
    pub(crate) fn len(&self) -> usize {
        self.reservations.len()
    }

    /// A new reservation of `size` bytes (a granule multiple).
    pub(crate) fn reserve(&mut self, size: u64) -> Result<u64, DeviceError> {
        if size == 0 || !size.is_multiple_of(self.granule) {
            return Err(DeviceError::InvalidRange {
                addr: DevicePtr(0),
                size: Bytes(size),
                reason: "reservation not a granule multiple",
            });
        }
        let base = self.next_va;
        let next = base
            .checked_add(size)
            .and_then(|e| e.checked_add(self.granule))
            .ok_or(DeviceError::OutOfMemory { size: Bytes(size) })?;
        self.next_va = next;
        self.reservations.insert(base, size);
        Ok(base)
    }

    /// Checks that `[addr, addr + size)` is granule aligned, non-empty and inside one
    /// reservation; returns its end.
    pub(crate) fn check_range(&self, addr: u64, size: u64) -> Result<u64, DeviceError> {
        let bad = |reason| DeviceError::InvalidRange {
            addr: DevicePtr(addr),
            size: Bytes(size),
            reason,
        };
        if size == 0 || !addr.is_multiple_of(self.granule) || !size.is_multiple_of(self.granule) {
            return Err(bad("not granule aligned or empty"));
        }
        let end = addr.checked_add(size).ok_or(bad("overflows"))?;
        match self.reservations.range(..=addr).next_back() {
            Some((&base, &len)) if end <= base + len => Ok(end),
            _ => Err(bad("outside every reservation")),
        }
    }

    /// Records `[addr, addr + size)` (just mapped by one `map` call) as a unit.
    pub(crate) fn add_unit(&mut self, addr: u64, size: u64) {
        self.units.insert(addr, addr + size);
    }

    /// Checks that `[addr, addr + size)` is a union of whole units (the
    /// [`DeviceMemory::unmap`] contract: a mapping is never unmapped in part), then
    /// forgets them. Nothing changes on error.
    ///
    /// [`DeviceMemory::unmap`]: super::DeviceMemory::unmap
    pub(crate) fn remove_units(&mut self, addr: u64, size: u64) -> Result<(), DeviceError> {
        let end = addr + size;
        let mut at = addr;
        for (&s, &e) in self.units.range(addr..end) {
            if s != at || e > end {
                break;
            }
            at = e;
        }
        if at != end {
            return Err(DeviceError::InvalidRange {
                addr: DevicePtr(addr),
                size: Bytes(size),
                reason: "unmaps part of a mapping (not a union of whole `map` ranges)",
            });
        }
        let starts: Vec<u64> = self.units.range(addr..end).map(|(&s, _)| s).collect();
        for s in starts {
            self.units.remove(&s);
        }
        Ok(())
    }

    /// Releases the reservation `[base, base + size)` if it is a whole one and
    /// `mapped_inside(lo, hi)` says nothing is mapped in it.
    pub(crate) fn release(
        &mut self,
        base: DevicePtr,
        size: Bytes,
        mapped_inside: impl FnOnce(u64, u64) -> bool,
    ) -> Result<(), DeviceError> {
        let bad = |reason| DeviceError::InvalidRange {
            addr: base,
            size,
            reason,
        };
        match self.reservations.get(&base.get()) {
            Some(&len) if len == size.get() => {}
            _ => return Err(bad("not a whole reservation")),
        }
        if mapped_inside(base.get(), base.get() + size.get()) {
            return Err(bad("reservation still has mapped granules"));
        }
        self.reservations.remove(&base.get());
        Ok(())
    }
}

/// Host-memory device: see the module documentation.
#[derive(Debug)]
pub struct HostMemory {
    granule: u64,
    capacity: u64,
    inner: Mutex<HostInner>,
    events: FakeEvents,
    host: Arc<HostAllocs>,
}

/// Host buffers handed out by [`HostMemory::alloc_host`].
#[derive(Debug, Default)]
struct HostAllocs {
    /// Successful allocations so far.
    allocs: AtomicU64,
    /// Bytes of buffers alive now.
    live: AtomicU64,
    /// Refuse every allocation (fault injection).
    fail: AtomicBool,
}

/// A host buffer of the test device: a boxed slice that gives its bytes back to the
/// device's count when dropped.
struct TestHostMem {
    bytes: Box<[u8]>,
    owner: Arc<HostAllocs>,
}

impl HostMem for TestHostMem {
    fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
}

impl Drop for TestHostMem {
    fn drop(&mut self) {
        self.owner
            .live
            .fetch_sub(self.bytes.len() as u64, Ordering::SeqCst);
    }
}

#[derive(Debug)]
struct HostInner {
    va: VaSpace,
    /// granule address -> its bytes.
    granules: HashMap<u64, Box<[u8]>>,
    mapped: u64,
    counters: HostCounters,
    /// Fail the next `n`-th map call with out-of-memory (fault injection).
    fail_map_in: Option<u32>,
}

/// How often each device call was made (for tests that count device traffic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostCounters {
    pub reserves: u64,
    pub releases: u64,
    pub maps: u64,
    pub unmaps: u64,
    pub synchronizes: u64,
    /// Unmaps refused for taking part of a `map` range (an engine bug: tests assert 0).
    pub partial_unmaps: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding this test-only lock leaves plain bookkeeping behind; keep
    // serving so the test reports the original panic rather than a poison error.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl HostMemory {
    /// A device with `capacity` bytes of physical memory mapped in `granule`-byte
    /// granules. `granule` must be a power of two ≥ 512 (else it is rounded up to one).
    pub fn new(capacity: Bytes, granule: Bytes) -> HostMemory {
        let granule = granule.get().max(512).next_power_of_two();
        HostMemory {
            granule,
            capacity: capacity.get(),
            inner: Mutex::new(HostInner {
                va: VaSpace::new(VA_START, granule),
                granules: HashMap::new(),
                mapped: 0,
                counters: HostCounters::default(),
                fail_map_in: None,
            }),
            events: FakeEvents::default(),
            host: Arc::default(),
        }
    }

    /// Host buffers allocated so far ([`DeviceMemory::alloc_host`] calls that succeeded).
    pub fn host_allocs(&self) -> u64 {
        self.host.allocs.load(Ordering::SeqCst)
    }

    /// Bytes of host buffers alive now (allocated and not yet dropped).
    pub fn host_bytes(&self) -> Bytes {
        Bytes(self.host.live.load(Ordering::SeqCst))
    }

    /// Makes every later [`DeviceMemory::alloc_host`] fail (`true`, as on a host out of
    /// page-lockable memory) or work again.
    pub fn fail_host_allocs(&self, fail: bool) {
        self.host.fail.store(fail, Ordering::SeqCst);
    }

    /// The fake events, to decide when streams pass them.
    pub fn events(&self) -> &FakeEvents {
        &self.events
    }

    /// Bytes currently mapped.
    pub fn mapped_bytes(&self) -> Bytes {
        Bytes(lock(&self.inner).mapped)
    }

    /// Number of live reservations.
    pub fn reservations(&self) -> usize {
        lock(&self.inner).va.len()
    }

    /// How many calls of each kind were made.
    pub fn counters(&self) -> HostCounters {
        lock(&self.inner).counters
    }

    /// Makes the `n`-th next `map` call (1 = the very next) fail with out-of-memory.
    pub fn fail_map_in(&self, n: u32) {
        lock(&self.inner).fail_map_in = Some(n.max(1));
    }

    /// Fills `[ptr, ptr + len)` with `byte`. Every byte must be mapped.
    pub fn fill(&self, ptr: DevicePtr, len: Bytes, byte: u8) -> Result<(), DeviceError> {
        self.with_bytes(ptr, len, |chunk| chunk.fill(byte))
    }

    /// Whether every byte of `[ptr, ptr + len)` equals `byte`. Every byte must be mapped.
    pub fn check(&self, ptr: DevicePtr, len: Bytes, byte: u8) -> Result<bool, DeviceError> {
        let pattern = [byte; 4096];
        let mut ok = true;
        self.with_bytes(ptr, len, |chunk| {
            ok &= chunk
                .chunks(pattern.len())
                .all(|c| c == &pattern[..c.len()]);
        })?;
        Ok(ok)
    }

    /// Copies `[ptr, ptr + out.len())` into `out`. Every byte must be mapped.
    pub fn read(&self, ptr: DevicePtr, out: &mut [u8]) -> Result<(), DeviceError> {
        let mut at = 0;
        self.with_bytes(ptr, Bytes(out.len() as u64), |chunk| {
            out[at..at + chunk.len()].copy_from_slice(chunk);
            at += chunk.len();
        })
    }

    /// Calls `f` on each granule-sized piece of `[ptr, ptr + len)`, in address order.
    fn with_bytes(
        &self,
        ptr: DevicePtr,
        len: Bytes,
        mut f: impl FnMut(&mut [u8]),
    ) -> Result<(), DeviceError> {
        let bad = |reason| DeviceError::InvalidRange {
            addr: ptr,
            size: len,
            reason,
        };
        let end = ptr.get().checked_add(len.get()).ok_or(bad("overflows"))?;
        let mut inner = lock(&self.inner);
        let mut at = ptr.get();
        while at < end {
            let g = at & !(self.granule - 1);
            let lo = (at - g) as usize;
            let hi = ((end - g).min(self.granule)) as usize;
            let buf = inner
                .granules
                .get_mut(&g)
                .ok_or(bad("touches unmapped memory"))?;
            f(&mut buf[lo..hi]);
            at = g + hi as u64;
        }
        Ok(())
    }
}

impl DeviceMemory for HostMemory {
    fn granularity(&self) -> Bytes {
        Bytes(self.granule)
    }

    fn total_memory(&self) -> Bytes {
        Bytes(self.capacity)
    }

    fn free_memory(&self) -> Result<Bytes, DeviceError> {
        Ok(Bytes(
            self.capacity.saturating_sub(lock(&self.inner).mapped),
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
        let HostInner { va, granules, .. } = &mut *inner;
        va.release(base, size, |lo, hi| {
            granules.keys().any(|&g| g >= lo && g < hi)
        })?;
        inner.counters.releases += 1;
        Ok(())
    }

    fn map(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        let mut inner = lock(&self.inner);
        inner.va.check_range(addr.get(), size.get())?;
        let granules = addr.get()..addr.get() + size.get();
        if granules
            .clone()
            .step_by(self.granule as usize)
            .any(|g| inner.granules.contains_key(&g))
        {
            return Err(DeviceError::InvalidRange {
                addr,
                size,
                reason: "maps an already mapped granule",
            });
        }
        if let Some(n) = inner.fail_map_in {
            if n <= 1 {
                inner.fail_map_in = None;
                return Err(DeviceError::OutOfMemory { size });
            }
            inner.fail_map_in = Some(n - 1);
        }
        if inner.mapped + size.get() > self.capacity {
            return Err(DeviceError::OutOfMemory { size });
        }
        for g in granules.step_by(self.granule as usize) {
            inner
                .granules
                .insert(g, vec![0u8; self.granule as usize].into_boxed_slice());
        }
        inner.va.add_unit(addr.get(), size.get());
        inner.mapped += size.get();
        inner.counters.maps += 1;
        Ok(())
    }

    fn unmap(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
        let mut inner = lock(&self.inner);
        inner.va.check_range(addr.get(), size.get())?;
        let granules = addr.get()..addr.get() + size.get();
        if !granules
            .clone()
            .step_by(self.granule as usize)
            .all(|g| inner.granules.contains_key(&g))
        {
            return Err(DeviceError::InvalidRange {
                addr,
                size,
                reason: "unmaps an unmapped granule",
            });
        }
        if let Err(e) = inner.va.remove_units(addr.get(), size.get()) {
            inner.counters.partial_unmaps += 1;
            return Err(e);
        }
        for g in granules.step_by(self.granule as usize) {
            inner.granules.remove(&g);
        }
        inner.mapped -= size.get();
        inner.counters.unmaps += 1;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        lock(&self.inner).counters.synchronizes += 1;
        self.events.pass_everything();
        Ok(())
    }

    crate::forward_device_memory!(self => self.events; events);

    fn copy_to_host(&self, addr: DevicePtr, out: &mut [u8]) -> Result<(), DeviceError> {
        self.read(addr, out)
    }

    fn alloc_host(&self, bytes: Bytes) -> Result<HostBuffer, DeviceError> {
        if self.host.fail.load(Ordering::SeqCst) {
            return Err(DeviceError::OutOfMemory { size: bytes });
        }
        let len =
            usize::try_from(bytes.get()).map_err(|_| DeviceError::OutOfMemory { size: bytes })?;
        self.host.allocs.fetch_add(1, Ordering::SeqCst);
        self.host.live.fetch_add(bytes.get(), Ordering::SeqCst);
        let mem = TestHostMem {
            bytes: vec![0u8; len].into_boxed_slice(),
            owner: Arc::clone(&self.host),
        };
        Ok(HostBuffer::new(Box::new(mem), true))
    }

    fn copy_from_host(&self, addr: DevicePtr, data: &[u8]) -> Result<(), DeviceError> {
        let mut at = 0;
        self.with_bytes(addr, Bytes(data.len() as u64), |chunk| {
            let n = chunk.len();
            chunk.copy_from_slice(&data[at..at + n]);
            at += n;
        })
    }
}

/// Events whose completion a test controls.
///
/// Each stream has a count of events recorded on it and a count of events it has
/// passed; an event recorded as the stream's `n`-th completes once the stream has passed
/// `n` events. Streams pass events in the order they were recorded, as CUDA streams do.
/// An event never recorded is complete (CUDA semantics); re-recording moves it.
///
/// A stream told to wait for an event ([`DeviceMemory::wait_event`]) is ordered after
/// the event's stream up to that event: [`FakeEvents::ordered_after`] answers whether
/// work queued on one stream now runs after a recorded point of another, so that tests
/// can check a reuse of pending memory against every recording made at its free
/// ([`FakeEvents::recorded_since`]).
#[derive(Debug, Default)]
pub struct FakeEvents {
    inner: Mutex<FakeInner>,
    /// Each recording is passed at once (its stream's events all pass), as
    /// [`crate::engine::VirtualMemory`]'s are by default.
    pub(crate) auto_pass: bool,
}

#[derive(Debug, Default)]
struct FakeInner {
    next_id: u64,
    /// event -> (stream, sequence number on that stream) of its last recording.
    events: HashMap<u64, Option<(StreamId, u64)>>,
    streams: HashMap<StreamId, StreamClock>,
    /// Per stream, the waits it was told to do, in order.
    waits: HashMap<StreamId, Vec<Wait>>,
    /// Every recording, in order: (stream, sequence number).
    log: Vec<(StreamId, u64)>,
    /// Successful waits.
    wait_calls: u64,
    /// [`DeviceMemory::query_event`] calls so far.
    query_calls: u64,
    /// Refuse every wait (as CUDA does on a stream being captured).
    refuse_waits: bool,
}

/// `stream.wait_event(e)`: the waiting stream's recordings after the first `at` pass
/// only once stream `on` has passed its `seq`-th recording.
#[derive(Debug, Clone, Copy)]
struct Wait {
    at: u64,
    on: StreamId,
    seq: u64,
}

impl FakeInner {
    fn passed(&self, on: StreamId, seq: u64) -> bool {
        self.streams.get(&on).is_some_and(|c| c.passed >= seq)
    }

    /// The last recording `stream` may pass now: before its first wait whose event
    /// has not been passed yet.
    fn cap(&self, stream: StreamId) -> u64 {
        let recorded = self.streams.get(&stream).map_or(0, |c| c.recorded);
        self.waits.get(&stream).map_or(recorded, |ws| {
            ws.iter()
                .filter(|w| !self.passed(w.on, w.seq))
                .map(|w| w.at)
                .min()
                .unwrap_or(recorded)
                .min(recorded)
        })
    }

    /// Lets `stream` pass everything its waits allow; whether it moved.
    fn pass_allowed(&mut self, stream: StreamId) -> bool {
        let cap = self.cap(stream);
        let clock = self.streams.entry(stream).or_default();
        let moved = clock.passed < cap;
        if moved {
            clock.passed = cap;
            self.prune_waits();
        }
        moved
    }

    /// Forgets the waits for passed events: they hold nothing back, and whatever they
    /// order after has been passed too (a stream passes a point only once everything
    /// it waited for before it is passed), which [`FakeInner::passed`] answers.
    fn prune_waits(&mut self) {
        let mut waits = std::mem::take(&mut self.waits);
        for ws in waits.values_mut() {
            ws.retain(|w| !self.passed(w.on, w.seq));
        }
        waits.retain(|_, ws| !ws.is_empty());
        self.waits = waits;
    }

    /// Makes stream `on` pass its `seq`-th recording, and first whatever it waits for
    /// before it (a blocking synchronisation: everything before completes).
    fn force(&mut self, on: StreamId, seq: u64) {
        let before: Vec<Wait> = self
            .waits
            .get(&on)
            .map(|ws| ws.iter().filter(|w| w.at < seq).copied().collect())
            .unwrap_or_default();
        for w in before {
            if !self.passed(w.on, w.seq) {
                self.force(w.on, w.seq);
            }
        }
        let clock = self.streams.entry(on).or_default();
        clock.passed = clock.passed.max(seq);
        self.prune_waits();
    }

    /// Whether recording `k` of stream `z` (`u64::MAX`: work `z` queues from now on)
    /// comes after recording `seq` of stream `on`, through waits (`z`'s, then those
    /// of the streams it waited for before that point, and so on). A search that keeps,
    /// per stream, the latest point reached: O(waits) per call.
    fn after(&self, z: StreamId, k: u64, on: StreamId, seq: u64) -> bool {
        let mut best: HashMap<StreamId, u64> = HashMap::from([(z, k)]);
        let mut stack = vec![(z, k)];
        while let Some((z, k)) = stack.pop() {
            if z == on && k >= seq {
                return true;
            }
            for w in self.waits.get(&z).into_iter().flatten() {
                if w.at < k && best.get(&w.on).is_none_or(|&b| b < w.seq) {
                    best.insert(w.on, w.seq);
                    stack.push((w.on, w.seq));
                }
            }
        }
        false
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct StreamClock {
    recorded: u64,
    passed: u64,
}

impl FakeEvents {
    /// Events each passed as soon as it is recorded (`auto_pass`).
    pub(crate) fn passing_at_record() -> FakeEvents {
        FakeEvents {
            auto_pass: true,
            ..FakeEvents::default()
        }
    }

    pub(crate) fn create_event(&self) -> Result<DeviceEvent, DeviceError> {
        let mut inner = lock(&self.inner);
        inner.next_id += 1;
        let id = inner.next_id;
        inner.events.insert(id, None);
        Ok(DeviceEvent(id))
    }

    pub(crate) fn record_event(
        &self,
        event: DeviceEvent,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        {
            let mut inner = lock(&self.inner);
            if !inner.events.contains_key(&event.0) {
                return Err(DeviceError::UnknownEvent(event));
            }
            let clock = inner.streams.entry(stream).or_default();
            clock.recorded += 1;
            let seq = clock.recorded;
            inner.events.insert(event.0, Some((stream, seq)));
            inner.log.push((stream, seq));
        }
        if self.auto_pass {
            self.pass_all(stream);
        }
        Ok(())
    }

    pub(crate) fn wait_event(
        &self,
        stream: StreamId,
        event: DeviceEvent,
    ) -> Result<(), DeviceError> {
        let mut inner = lock(&self.inner);
        if inner.refuse_waits {
            return Err(DeviceError::Driver {
                call: "cuStreamWaitEvent",
                code: 900,
                message: "refused by the test (as on a stream being captured)".into(),
            });
        }
        match inner.events.get(&event.0).copied() {
            None => Err(DeviceError::UnknownEvent(event)),
            Some(None) => {
                inner.wait_calls += 1;
                Ok(())
            }
            Some(Some((on, seq))) => {
                let at = inner.streams.get(&stream).map_or(0, |c| c.recorded);
                inner
                    .waits
                    .entry(stream)
                    .or_default()
                    .push(Wait { at, on, seq });
                inner.wait_calls += 1;
                Ok(())
            }
        }
    }

    /// Whether work queued on `stream` from now on runs after the `seq`-th recording on
    /// stream `on`: the same stream, `on` has passed it, or `stream` waited for it or
    /// for a later point of a stream that waited for it (and so on).
    pub fn ordered_after(&self, stream: StreamId, on: StreamId, seq: u64) -> bool {
        let inner = lock(&self.inner);
        inner.passed(on, seq) || inner.after(stream, u64::MAX, on, seq)
    }

    /// Whether stream `on` has passed its `seq`-th recording.
    pub fn passed(&self, on: StreamId, seq: u64) -> bool {
        lock(&self.inner).passed(on, seq)
    }

    /// How many recordings were made so far (a mark for [`FakeEvents::recorded_since`]).
    pub fn recordings(&self) -> usize {
        lock(&self.inner).log.len()
    }

    /// The recordings made since `mark` (from [`FakeEvents::recordings`]), as (stream,
    /// sequence number) pairs for [`FakeEvents::ordered_after`].
    pub fn recorded_since(&self, mark: usize) -> Vec<(StreamId, u64)> {
        lock(&self.inner).log.get(mark..).unwrap_or(&[]).to_vec()
    }

    /// Makes every later [`DeviceMemory::wait_event`] fail (`true`) or work again.
    pub fn refuse_waits(&self, refuse: bool) {
        lock(&self.inner).refuse_waits = refuse;
    }

    /// Successful [`DeviceMemory::wait_event`] calls so far.
    pub fn waits(&self) -> u64 {
        lock(&self.inner).wait_calls
    }

    /// [`DeviceMemory::query_event`] calls so far.
    pub fn queries(&self) -> u64 {
        lock(&self.inner).query_calls
    }

    pub(crate) fn query_event(&self, event: DeviceEvent) -> Result<bool, DeviceError> {
        let mut inner = lock(&self.inner);
        inner.query_calls += 1;
        match inner.events.get(&event.0) {
            None => Err(DeviceError::UnknownEvent(event)),
            Some(None) => Ok(true),
            Some(Some((stream, seq))) => {
                Ok(inner.streams.get(stream).is_some_and(|c| c.passed >= *seq))
            }
        }
    }

    pub(crate) fn synchronize_event(&self, event: DeviceEvent) -> Result<(), DeviceError> {
        let mut inner = lock(&self.inner);
        match inner.events.get(&event.0).copied() {
            None => Err(DeviceError::UnknownEvent(event)),
            Some(None) => Ok(()),
            Some(Some((stream, seq))) => {
                inner.force(stream, seq);
                Ok(())
            }
        }
    }

    pub(crate) fn destroy_event(&self, event: DeviceEvent) -> Result<(), DeviceError> {
        match lock(&self.inner).events.remove(&event.0) {
            Some(_) => Ok(()),
            None => Err(DeviceError::UnknownEvent(event)),
        }
    }

    /// Lets `stream` pass its oldest not yet passed event, unless a wait holds it
    /// back. Returns whether it passed one.
    pub fn pass_next(&self, stream: StreamId) -> bool {
        let mut inner = lock(&self.inner);
        let cap = inner.cap(stream);
        let clock = inner.streams.entry(stream).or_default();
        if clock.passed < cap {
            clock.passed += 1;
            true
        } else {
            false
        }
    }

    /// Lets `stream` pass every event recorded on it so far, up to where a wait for an
    /// event not passed yet holds it back.
    pub fn pass_all(&self, stream: StreamId) {
        lock(&self.inner).pass_allowed(stream);
    }

    /// Lets every stream pass every event recorded so far.
    pub fn pass_everything(&self) {
        let mut inner = lock(&self.inner);
        let streams: Vec<StreamId> = inner.streams.keys().copied().collect();
        // Waits only refer to earlier recordings, so this settles.
        while streams
            .iter()
            .fold(false, |moved, &s| inner.pass_allowed(s) | moved)
        {}
    }

    /// Events recorded on `stream` that it has not passed yet.
    pub fn outstanding(&self, stream: StreamId) -> u64 {
        let inner = lock(&self.inner);
        inner
            .streams
            .get(&stream)
            .map_or(0, |c| c.recorded - c.passed)
    }

    /// Events created and not destroyed.
    pub fn live_events(&self) -> usize {
        lock(&self.inner).events.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 4096;

    #[test]
    fn map_write_read_unmap_release() {
        let h = HostMemory::new(Bytes(4 * G), Bytes(G));
        let base = h.reserve(Bytes(8 * G)).unwrap();
        assert!(h.fill(base, Bytes(10), 1).is_err(), "unmapped bytes");
        h.map(base, Bytes(2 * G)).unwrap();
        let p = DevicePtr(base.get() + G - 3);
        h.fill(p, Bytes(6), 0xab).unwrap();
        assert!(h.check(p, Bytes(6), 0xab).unwrap());
        assert!(!h.check(DevicePtr(p.get() - 1), Bytes(2), 0xab).unwrap());
        let mut buf = [0u8; 8];
        h.read(DevicePtr(p.get() - 1), &mut buf).unwrap();
        assert_eq!(buf, [0, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0]);
        assert!(h.map(base, Bytes(G)).is_err(), "double map");
        assert!(
            h.map(DevicePtr(base.get() + 1), Bytes(G)).is_err(),
            "unaligned"
        );
        assert!(h.map(base.add(Bytes(8 * G)).unwrap(), Bytes(G)).is_err());
        assert_eq!(
            h.map(base.add(Bytes(2 * G)).unwrap(), Bytes(3 * G)),
            Err(DeviceError::OutOfMemory { size: Bytes(3 * G) })
        );
        assert!(h.release(base, Bytes(8 * G)).is_err(), "still mapped");
        assert!(
            h.unmap(base, Bytes(3 * G)).is_err(),
            "third granule unmapped"
        );
        h.unmap(base, Bytes(2 * G)).unwrap();
        assert_eq!(h.mapped_bytes(), Bytes(0));
        h.release(base, Bytes(8 * G)).unwrap();
        assert_eq!(h.reservations(), 0);
    }

    #[test]
    fn fake_events_complete_in_stream_order() {
        let h = HostMemory::new(Bytes(G), Bytes(G));
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = h.create_event().unwrap();
        let b = h.create_event().unwrap();
        let c = h.create_event().unwrap();
        assert!(h.query_event(a).unwrap(), "unrecorded event is complete");
        h.record_event(a, s1).unwrap();
        h.record_event(b, s1).unwrap();
        h.record_event(c, s2).unwrap();
        assert!(!h.query_event(a).unwrap());
        assert!(h.events().pass_next(s1));
        assert!(h.query_event(a).unwrap());
        assert!(!h.query_event(b).unwrap());
        assert!(!h.query_event(c).unwrap());
        h.synchronize_event(c).unwrap();
        assert!(h.query_event(c).unwrap());
        assert!(!h.query_event(b).unwrap());
        h.synchronize().unwrap();
        assert!(h.query_event(b).unwrap());
        h.destroy_event(a).unwrap();
        assert_eq!(
            h.query_event(a),
            Err(DeviceError::UnknownEvent(DeviceEvent(a.0)))
        );
        assert_eq!(h.events().live_events(), 2);
    }

    #[test]
    fn injected_map_failure() {
        let h = HostMemory::new(Bytes(8 * G), Bytes(G));
        let base = h.reserve(Bytes(8 * G)).unwrap();
        h.fail_map_in(2);
        h.map(base, Bytes(G)).unwrap();
        assert!(matches!(
            h.map(base.add(Bytes(G)).unwrap(), Bytes(G)),
            Err(DeviceError::OutOfMemory { .. })
        ));
        h.map(base.add(Bytes(G)).unwrap(), Bytes(G)).unwrap();
    }
}
