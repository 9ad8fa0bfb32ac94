//! [`Core`]: the process's allocator state behind the bridge — one [`Engine`] per
//! (device, pool), device-level stats, private pools for CUDA graphs and `MemPool`s,
//! trace mode, and the history PyTorch's memory tools read.
//!
//! # Pools
//!
//! Each CUDA device has a *default* engine (opened at its first allocation) and one
//! engine per live private pool (`beginAllocateToPool` / `createOrIncrefPool` create it,
//! `releasePool` drops a reference). A private pool's memory is never handed to another
//! pool; when its last reference is released its cache is emptied at once and the
//! engine is dropped as soon as nothing in it is live (a graph's outputs may outlive the
//! graph). Engines share the device ([`BridgeDevice`]) through [`Tracked`], which maps
//! every reservation to its engine, so `free(ptr)` needs no per-pointer table.
//!
//! # Device stats
//!
//! With only the default engine, a device's stats are that engine's (exact). With
//! private pools, current values and counters are sums over the engines (plus what
//! dropped engines accumulated), and each peak is the largest of: the highest sum seen
//! at the end of any operation on the device, the current sum, and each engine's own
//! peak (each a lower bound of the true peak; together exact at operation granularity).
//!
//! # History
//!
//! When PyTorch records memory history (or a trace tracker is attached), every
//! allocation, free request, free completion (late for stream-deferred frees) and
//! mapping change is reported as a [`HistoryEvent`], which C++ turns into `TraceEntry`s.
//!
//! # Files
//!
//! - `mod.rs`: [`Core`], its devices (opened lazily, one default engine each), serving
//!   (malloc, free, record_stream), caching and limits, OOM details, iterations and
//!   phase marks, [`Core::mode`], trace mode's flush.
//! - `settings.rs`: [`Settings`], [`Mode`] and their parsing from the environment.
//! - `stats.rs`: device stats over engines, the snapshot, [`Core::info_json`].
//! - `pools.rs`: private pools and their checkpoints.
//! - `pause.rs`: allocation tags and pause / resume over a device's engines (issue #17).
//! - `plan.rs`: plan and auto modes (plan stage, background planning, the switch,
//!   the offload schedule).
//! - `history.rs`: memory-history events and pending frees.
//!
//! cxx types (`crate::ffi::bridge::*`) are used inside the runtime, not only at the
//! bridge: `PoolId` (pool keys, [`Owner`]), `HistoryEvent` (`history.rs`), and the
//! output types of `stats.rs` (`DeviceStats`, `Snapshot`), `OomInfo` and `Range` here,
//! `OffloadItem` (`plan.rs`).

mod call_times;
mod history;
mod pause;
mod plan;
mod pools;
mod settings;
mod stats;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard};

use stweaver_core::engine::{
    BlockState, DeviceMemory, DevicePtr, Engine, EngineConfig, EngineError, MemoryLimit,
};
use stweaver_core::plan::OffloadEntry;
use stweaver_core::trace::MarkerKind;
use stweaver_core::trace_file::write_trace_file;
use stweaver_core::units::{Bytes, DeviceId, StreamId};

use crate::budget::effective_limit;
use crate::error::{BridgeError, Result};
use crate::ffi::bridge as ffi;
use crate::ffi::bridge::{HistoryAction, HistoryEvent, PoolId};
use crate::tracked::{BridgeDevice, CaptureGate, DeviceBudget, Owner, Shared, Tracked};

use call_times::CallTimes;
use history::PendingFree;
pub use plan::PlanStage;
use plan::{OffloadOutcome, PlanControl};
use pools::PrivatePool;
pub use settings::{DEFAULT_AUTO_ITERATIONS, Mode, Settings};
pub use stats::to_ffi_stats;
use stats::{Agg, arena_segments};

/// Opens device `ordinal` (CUDA in production, host memory in tests).
pub type DeviceFactory = Box<dyn Fn(i32) -> Result<Arc<dyn BridgeDevice>> + Send + Sync>;

const DEFAULT_POOL: PoolId = PoolId {
    first: 0,
    second: 0,
};

fn is_default(p: PoolId) -> bool {
    p == DEFAULT_POOL
}

struct DeviceSlot {
    ordinal: i32,
    open_mu: Mutex<()>,
    mem: OnceLock<Arc<dyn BridgeDevice>>,
    default: OnceLock<Engine<Tracked>>,
    private: RwLock<BTreeMap<PoolId, PrivatePool>>,
    fraction: Mutex<f64>,
    /// The device-wide budget every engine of the device maps within.
    budget: Arc<DeviceBudget>,
    /// Allocations to a private pool in progress (CUDA graph captures): no device
    /// synchronisation meanwhile.
    captures: Arc<CaptureGate>,
    /// The offload schedule of the plan the default engine serves (empty: none).
    offload: Mutex<Vec<OffloadEntry>>,
    /// Auto mode under a budget: what planning decided about offload.
    offload_outcome: Mutex<Option<OffloadOutcome>>,
    agg: Mutex<Agg>,
}

thread_local! {
    /// The last out-of-memory error of this thread (for `oom_info`, called right after).
    static LAST_OOM: RefCell<Option<(i32, EngineError)>> = const { RefCell::new(None) };
}

/// The process's allocator state. See the module documentation.
pub struct Core {
    settings: Settings,
    factory: DeviceFactory,
    shared: Arc<Shared>,
    devices: OnceLock<Vec<DeviceSlot>>,
    /// Private pools alive on all devices.
    private_pools: AtomicUsize,
    /// Devices whose default engine exists, and the last one opened.
    opened: AtomicUsize,
    last_opened: AtomicI32,
    /// The first device whose default engine opened: a rank's home device.
    first_opened: AtomicI32,
    iterations: AtomicU64,
    /// The tag of allocations made from now on (`Core::set_tag`; 0: untagged), given to
    /// engines as they open.
    tag: AtomicU32,
    pending: Mutex<Vec<PendingFree>>,
    has_pending: AtomicBool,
    trace_flushed: AtomicBool,
    plan: Mutex<PlanControl>,
    /// Things the user should know that are not errors (a trace or plan file that could
    /// not be written, a device whose plan was rejected while another serves one).
    notes: Mutex<Vec<String>>,
    /// Host time in `malloc` / `free` (`STWEAVER_TIME_CALLS`; module `call_times`).
    call_times: CallTimes,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every value behind these locks is updated in single assignments.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

impl Core {
    /// A runtime with `settings`, opening devices with `factory`.
    pub fn new(settings: Settings, factory: DeviceFactory) -> Core {
        let control = PlanControl::new(&settings);
        let settings_time_calls = settings.time_calls;
        Core {
            settings,
            factory,
            shared: Arc::new(Shared::default()),
            devices: OnceLock::new(),
            private_pools: AtomicUsize::new(0),
            opened: AtomicUsize::new(0),
            last_opened: AtomicI32::new(-1),
            first_opened: AtomicI32::new(-1),
            iterations: AtomicU64::new(0),
            tag: AtomicU32::new(0),
            pending: Mutex::new(Vec::new()),
            has_pending: AtomicBool::new(false),
            trace_flushed: AtomicBool::new(false),
            plan: Mutex::new(control),
            notes: Mutex::new(Vec::new()),
            call_times: CallTimes::new(settings_time_calls),
        }
    }

    /// Cumulative host time in `malloc` and `free` (zeros while `STWEAVER_TIME_CALLS` is
    /// off).
    pub fn call_times(&self) -> ffi::CallTimes {
        self.call_times.snapshot()
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    // ------------------------------------------------------------------ devices

    pub fn init(&self, device_count: i32) -> Result<()> {
        let n = device_count.max(0);
        let slots = (0..n)
            .map(|ordinal| DeviceSlot {
                ordinal,
                open_mu: Mutex::new(()),
                mem: OnceLock::new(),
                default: OnceLock::new(),
                private: RwLock::new(BTreeMap::new()),
                fraction: Mutex::new(1.0),
                budget: Arc::new(DeviceBudget::default()),
                captures: Arc::new(CaptureGate::default()),
                offload: Mutex::new(Vec::new()),
                offload_outcome: Mutex::new(None),
                agg: Mutex::new(Agg::default()),
            })
            .collect();
        if self.devices.set(slots).is_err() {
            let first = self.devices.get().map_or(0, Vec::len) as i32;
            if first != n {
                return Err(BridgeError::Reinit { first, got: n });
            }
        }
        Ok(())
    }

    fn slots(&self) -> Result<&[DeviceSlot]> {
        self.devices
            .get()
            .map(Vec::as_slice)
            .ok_or(BridgeError::NotInitialised)
    }

    fn slot(&self, device: i32) -> Result<&DeviceSlot> {
        let slots = self.slots()?;
        usize::try_from(device)
            .ok()
            .and_then(|d| slots.get(d))
            .ok_or(BridgeError::BadDevice {
                device,
                count: slots.len(),
            })
    }

    fn device_memory(&self, slot: &DeviceSlot) -> Result<Arc<dyn BridgeDevice>> {
        if let Some(m) = slot.mem.get() {
            return Ok(m.clone());
        }
        let _g = lock(&slot.open_mu);
        if let Some(m) = slot.mem.get() {
            return Ok(m.clone());
        }
        let m = (self.factory)(slot.ordinal).map_err(|e| BridgeError::OpenDevice {
            device: slot.ordinal,
            error: e.to_string(),
        })?;
        let total = DeviceMemory::total_memory(&*m).get();
        slot.budget.set_limit(effective_limit(
            self.settings.budget,
            *lock(&slot.fraction),
            total,
        ));
        let _ = slot.mem.set(m.clone());
        Ok(m)
    }

    fn new_engine(&self, slot: &DeviceSlot, pool: PoolId) -> Result<Engine<Tracked>> {
        let mem = self.device_memory(slot)?;
        let owner = Owner {
            device: slot.ordinal,
            pool,
        };
        let config = EngineConfig {
            device: DeviceId(slot.ordinal),
            limit: MemoryLimit::Bytes(Bytes(slot.budget.limit())),
            arena_size: None,
            record_trace: self.records_trace() && is_default(pool),
            release_before_new_peak: self.settings.release_at_peak,
            // Online mode only: in auto mode the stop can fall in the planning window,
            // where the online peak then rose (eval10 on the H100: 7.50 against 6.92 GiB;
            // `Settings::release_churn`).
            release_churn_iterations: if self.settings.mode == Mode::Online {
                self.settings.release_churn
            } else {
                0
            },
            // A private pool's free memory may be a captured graph's scratch: it is
            // given back only by empty_cache once no graph uses the pool (keep_cache also
            // turns release before a new peak off).
            keep_cache: !is_default(pool),
            pool_unit: Bytes(self.settings.pool_unit_mib << 20),
        };
        let engine = Engine::new(
            Tracked::new(
                mem,
                owner,
                self.shared.clone(),
                slot.budget.clone(),
                slot.captures.clone(),
            ),
            config,
        )?;
        engine.set_tag(self.tag.load(Ordering::SeqCst))?;
        Ok(engine)
    }

    fn default_engine<'a>(&self, slot: &'a DeviceSlot) -> Result<&'a Engine<Tracked>> {
        if let Some(e) = slot.default.get() {
            return Ok(e);
        }
        let engine = self.new_engine(slot, DEFAULT_POOL)?;
        let opened_now = {
            let _g = lock(&slot.open_mu);
            if slot.default.get().is_none() {
                let _ = slot.default.set(engine);
                self.opened.fetch_add(1, Ordering::AcqRel);
                self.last_opened.store(slot.ordinal, Ordering::Release);
                let _ = self.first_opened.compare_exchange(
                    -1,
                    slot.ordinal,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                true
            } else {
                false
            }
        };
        let e = slot.default.get().ok_or(BridgeError::NotInitialised)?;
        if opened_now {
            // A `set_tag` between the engine's creation and now did not reach it.
            e.set_tag(self.tag.load(Ordering::SeqCst))?;
        }
        if opened_now && self.settings.mode == Mode::Plan {
            self.serve_file_plan(slot.ordinal, e);
        }
        Ok(e)
    }

    /// The rank's home device (the first device opened), under torchrun only.
    fn home(&self) -> Option<i32> {
        self.settings.rank?;
        let d = self.first_opened.load(Ordering::Acquire);
        (d >= 0).then_some(d)
    }

    /// Runs `f` on the engine of `owner`.
    fn with_engine<T>(
        &self,
        owner: Owner,
        f: impl FnOnce(&Engine<Tracked>) -> Result<T>,
    ) -> Result<T> {
        let slot = self.slot(owner.device)?;
        if is_default(owner.pool) {
            return f(self.default_engine(slot)?);
        }
        let pools = read(&slot.private);
        let p = pools.get(&owner.pool).ok_or(BridgeError::UnknownPool {
            device: owner.device,
            pool: owner.pool,
        })?;
        f(&p.engine)
    }

    /// The engine that handed out `ptr`.
    fn owner_of(&self, ptr: usize) -> Result<Owner> {
        if self.private_pools.load(Ordering::Acquire) == 0
            && self.opened.load(Ordering::Acquire) == 1
        {
            return Ok(Owner {
                device: self.last_opened.load(Ordering::Acquire),
                pool: DEFAULT_POOL,
            });
        }
        self.shared
            .owner_of(ptr as u64)
            .ok_or(BridgeError::UnknownPointer(ptr))
    }

    // ------------------------------------------------------------------ serving

    /// Allocates; `Ok(0)` on out-of-memory (details for [`Core::oom_info`]).
    pub fn malloc(&self, device: i32, size: usize, stream: usize, pool: PoolId) -> Result<usize> {
        let t = self.call_times.start();
        let r = self.malloc_untimed(device, size, stream, pool);
        self.call_times.malloc_done(t);
        r
    }

    fn malloc_untimed(
        &self,
        device: i32,
        size: usize,
        stream: usize,
        pool: PoolId,
    ) -> Result<usize> {
        let slot = self.slot(device)?;
        let owner = Owner { device, pool };
        let attempt = || {
            self.with_engine(owner, |e| {
                Ok(e.malloc(Bytes(size as u64), StreamId(stream as u64)))
            })
        };
        let mut result = attempt()?;
        // The engine gave its own cache back and still does not fit: the device's other
        // pools may hold cache under the same budget (as PyTorch frees every pool's cache
        // before its OOM). Never during a capture (that needs a synchronisation).
        if matches!(result, Err(EngineError::OutOfMemory { .. }))
            && self.release_other_pools(slot, pool)?
        {
            result = attempt()?;
        }
        let ptr = match result {
            Ok(p) => p,
            Err(e @ EngineError::OutOfMemory { .. }) => {
                LAST_OOM.with(|c| *c.borrow_mut() = Some((device, e)));
                self.after_op(slot)?;
                return Ok(0);
            }
            Err(e) => return Err(e.into()),
        };
        if self.shared.history_on() {
            self.resolve_pending();
            self.shared.push(HistoryEvent {
                action: HistoryAction::Alloc,
                device,
                addr: ptr.get(),
                size: size as u64,
                stream,
                pool,
            });
        }
        self.after_op(slot)?;
        Ok(ptr.get() as usize)
    }

    /// Frees `ptr` (deferred behind other streams' use).
    pub fn free(&self, ptr: usize) -> Result<()> {
        let t = self.call_times.start();
        let r = self.free_untimed(ptr);
        self.call_times.free_done(t);
        r
    }

    fn free_untimed(&self, ptr: usize) -> Result<()> {
        let owner = self.owner_of(ptr)?;
        let history = self.shared.history_on();
        let dptr = DevicePtr(ptr as u64);
        self.with_engine(owner, |e| {
            let info = if history {
                Some(e.block_info(dptr)?)
            } else {
                None
            };
            e.free(dptr)?;
            if let Some(info) = info {
                self.report_free(e, owner, dptr, &info);
            }
            Ok(())
        })?;
        let slot = self.slot(owner.device)?;
        if !is_default(owner.pool) {
            self.maybe_retire(slot, owner.pool)?;
        }
        self.after_op(slot)
    }

    pub fn record_stream(&self, ptr: usize, stream: usize) -> Result<()> {
        let owner = self.owner_of(ptr)?;
        self.with_engine(owner, |e| {
            Ok(e.record_stream(DevicePtr(ptr as u64), StreamId(stream as u64))?)
        })
    }

    /// [`Core::record_stream`] for a use whose work on `stream` is all enqueued already
    /// (offload's copies): the free waits for this point of `stream` only
    /// ([`Engine::record_stream_enqueued`]).
    pub fn record_stream_enqueued(&self, ptr: usize, stream: usize) -> Result<()> {
        let owner = self.owner_of(ptr)?;
        self.with_engine(owner, |e| {
            Ok(e.record_stream_enqueued(DevicePtr(ptr as u64), StreamId(stream as u64))?)
        })
    }

    // ------------------------------------------------------------------ caching, limits

    fn for_devices(&self, device: i32) -> Result<Vec<&DeviceSlot>> {
        if device < 0 {
            Ok(self.slots()?.iter().collect())
        } else {
            Ok(vec![self.slot(device)?])
        }
    }

    /// Gives back the cache of `slot`'s pools other than `pool` that may release it: the
    /// default pool, and private pools no graph uses any more (use count 0). Nothing
    /// while a capture is underway. Whether any memory went back.
    fn release_other_pools(&self, slot: &DeviceSlot, pool: PoolId) -> Result<bool> {
        if slot.captures.active() {
            return Ok(false);
        }
        let before = slot.budget.mapped();
        if !is_default(pool)
            && let Some(e) = slot.default.get()
        {
            e.empty_cache()?;
        }
        self.empty_unused_pools(slot, Some(pool))?;
        Ok(slot.budget.mapped() < before)
    }

    /// Empties the cache of `slot`'s private pools no graph uses any more (use count 0),
    /// but `except`, and retires those left empty.
    fn empty_unused_pools(&self, slot: &DeviceSlot, except: Option<PoolId>) -> Result<()> {
        let released: Vec<PoolId> = read(&slot.private)
            .iter()
            .filter(|&(&id, p)| Some(id) != except && p.use_count == 0)
            .map(|(&id, _)| id)
            .collect();
        for id in released {
            if let Some(p) = read(&slot.private).get(&id) {
                p.engine.empty_cache()?;
            }
            self.maybe_retire(slot, id)?;
        }
        Ok(())
    }

    pub fn empty_cache(&self, device: i32, pool: PoolId) -> Result<()> {
        for slot in self.for_devices(device)? {
            if is_default(pool) {
                if let Some(e) = slot.default.get() {
                    e.empty_cache()?;
                }
                self.empty_unused_pools(slot, None)?;
            } else if let Some(p) = read(&slot.private).get(&pool) {
                p.engine.empty_cache()?;
            }
            if !is_default(pool) {
                self.maybe_retire(slot, pool)?;
            }
            self.after_op(slot)?;
        }
        self.resolve_pending();
        Ok(())
    }

    pub fn set_memory_fraction(&self, device: i32, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(BridgeError::BadFraction(fraction));
        }
        let slot = self.slot(device)?;
        *lock(&slot.fraction) = fraction;
        let limit = match slot.mem.get() {
            Some(m) => {
                let total = DeviceMemory::total_memory(&**m).get();
                let bytes = effective_limit(self.settings.budget, fraction, total);
                slot.budget.set_limit(bytes);
                MemoryLimit::Bytes(Bytes(bytes))
            }
            // Not opened yet: the device's engines take the limit when they open.
            None => return Ok(()),
        };
        if let Some(e) = slot.default.get() {
            e.set_memory_limit(limit)?;
        }
        for p in read(&slot.private).values() {
            p.engine.set_memory_limit(limit)?;
        }
        Ok(())
    }

    pub fn memory_fraction(&self, device: i32) -> Result<f64> {
        Ok(*lock(&self.slot(device)?.fraction))
    }

    pub fn oom_info(&self, device: i32, size: usize) -> Result<ffi::OomInfo> {
        let slot = self.slot(device)?;
        let mem = self.device_memory(slot)?;
        let total = DeviceMemory::total_memory(&*mem).get();
        let last = LAST_OOM.with(|c| c.borrow_mut().take());
        // Device-wide: every pool of the device, as the budget counts.
        let s = self.device_stats_raw(slot)?;
        let live = s.allocated_bytes[0].current.max(0) as u64;
        let reserved = s.reserved_bytes[0].current.max(0) as u64;
        let limit = slot.budget.limit().min(total);
        let mut detail = Vec::new();
        if let Some(b) = self.settings.budget {
            detail.push(format!(
                "The stweaver budget is {} (STWEAVER_BUDGET={b}); with \
                 set_per_process_memory_fraction the smaller limit holds.",
                Bytes(b.bytes(total).min(total))
            ));
        }
        detail.push(format!(
            "Over every pool of the device: {} live, {} cached (reserved but free) after \
             giving the cache back.",
            Bytes(live),
            Bytes(reserved.saturating_sub(live)),
        ));
        if let Some(e) = slot.default.get()
            && let Some(why) = e.plan_abandoned()?
        {
            detail.push(format!("The plan is no longer served: {why}."));
        }
        if let Some((
            d,
            EngineError::OutOfMemory {
                rounded,
                allocated,
                reserved,
                free_reserved,
                device_free,
                ..
            },
        )) = last
            && d == device
        {
            if free_reserved >= rounded {
                detail.push(format!(
                    "stweaver holds {free_reserved} free inside this pool's arenas, but no \
                     free block of {rounded} fits on this stream (fragmentation; empty_cache \
                     cannot help)."
                ));
            }
            return Ok(ffi::OomInfo {
                rounded: rounded.get(),
                allocated: allocated.get(),
                reserved: reserved.get(),
                limit,
                device_free: device_free.get(),
                device_total: total,
                detail: detail.join(" "),
            });
        }
        let rounded = (size as u64).div_ceil(512) * 512;
        Ok(ffi::OomInfo {
            rounded,
            allocated: live,
            reserved,
            limit,
            device_free: DeviceMemory::free_memory(&*mem).map_or(0, Bytes::get),
            device_total: total,
            detail: detail.join(" "),
        })
    }

    pub fn largest_free_block(&self, device: i32) -> Result<u64> {
        let slot = self.slot(device)?;
        let Some(e) = slot.default.get() else {
            return Ok(0);
        };
        Ok(e.snapshot()?
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state == BlockState::Free)
            .map(|b| b.size.get())
            .max()
            .unwrap_or(0))
    }

    pub fn base_allocation(&self, ptr: usize) -> Result<ffi::Range> {
        let owner = self
            .shared
            .owner_of(ptr as u64)
            .ok_or(BridgeError::UnknownPointer(ptr))?;
        let mut snap = ffi::Snapshot::default();
        self.with_engine(owner, |e| {
            for arena in e.snapshot()? {
                arena_segments(owner.device, owner.pool, &arena, &mut snap);
            }
            Ok(())
        })?;
        let p = ptr as u64;
        snap.segments
            .iter()
            .find(|s| p >= s.address && p - s.address < s.total_size)
            .map(|s| ffi::Range {
                base: s.address,
                size: s.total_size,
            })
            .ok_or(BridgeError::UnknownPointer(ptr))
    }

    pub fn enable_peer_access(&self, device: i32, peer: i32) -> Result<()> {
        let slot = self.slot(device)?;
        self.slot(peer)?;
        self.device_memory(slot)?.enable_peer_access(peer)
    }

    // ------------------------------------------------------------------ iterations, trace

    /// Default engines of the devices opened so far (none before CUDA's lazy init).
    fn opened_engines(&self) -> Vec<&Engine<Tracked>> {
        self.devices
            .get()
            .map(|slots| slots.iter().filter_map(|s| s.default.get()).collect())
            .unwrap_or_default()
    }

    pub fn step(&self) -> Result<()> {
        self.step_keyed(None)
    }

    /// An iteration boundary where an iteration of key `key` begins (`stweaver.step(key)`):
    /// each default engine's plan learns which class each key's iterations are and
    /// begins a known key's class guess from it (module docs of `stweaver_core`'s
    /// `cursor`, keyed iterations). Without a plan of several classes the key changes
    /// nothing.
    pub fn step_keyed(&self, key: Option<u64>) -> Result<()> {
        let n = self.iterations.fetch_add(1, Ordering::AcqRel) + 1;
        for e in self.opened_engines() {
            e.mark_iteration_keyed(key)?;
        }
        self.plan_step(n)
    }

    /// The iteration in progress has key `key`, without a boundary
    /// (`stweaver.iteration_key`: the boundaries come from the optimizer hook).
    pub fn iteration_key(&self, key: u64) -> Result<()> {
        for e in self.opened_engines() {
            e.set_iteration_key(key)?;
        }
        Ok(())
    }

    pub fn mark(&self, label: &str, begin: bool) -> Result<()> {
        if label.is_empty() {
            return Err(BridgeError::Settings(
                "a phase label must not be empty".into(),
            ));
        }
        let kind = if begin {
            MarkerKind::PhaseBegin
        } else {
            MarkerKind::PhaseEnd
        };
        for e in self.opened_engines() {
            e.mark(kind, Some(label))?;
        }
        Ok(())
    }

    pub fn mode(&self) -> String {
        // A plan given up mid-run (its pool hit the memory limit) serves no more.
        let abandoned = self.devices.get().and_then(|slots| {
            slots.iter().find_map(|s| {
                let why = s.default.get()?.plan_abandoned().ok()??;
                Some(format!("cuda:{}: plan given up: {why}", s.ordinal))
            })
        });
        if let (Mode::Plan | Mode::Auto, PlanStage::Serving(_), Some(why)) =
            (self.settings.mode, self.plan_stage(), &abandoned)
        {
            return match self.settings.mode {
                Mode::Plan => format!("online ({why})"),
                _ => format!("auto (online: {why})"),
            };
        }
        match (self.settings.mode, self.plan_stage()) {
            (Mode::Online, _) => "online".into(),
            (Mode::Trace, _) if self.trace_flushed.load(Ordering::Acquire) => {
                "trace (written)".into()
            }
            (Mode::Trace, _) => "trace".into(),
            (Mode::Plan, PlanStage::Fallback(why)) => format!("online (plan rejected: {why})"),
            (Mode::Plan, PlanStage::Serving(_)) => "plan".into(),
            (Mode::Plan, _) => "plan (waiting for its device)".into(),
            (Mode::Auto, PlanStage::Recording) => "auto (recording)".into(),
            (Mode::Auto, PlanStage::Planning) => "auto (planning)".into(),
            (Mode::Auto, PlanStage::Held) => "auto (plan held)".into(),
            (Mode::Auto, PlanStage::Serving(_)) => "auto (plan)".into(),
            (Mode::Auto, PlanStage::Fallback(why)) => format!("auto (online: {why})"),
            (Mode::Auto, PlanStage::NotPlanning) => "auto".into(),
        }
    }

    /// Whether the default pools record a trace: trace and auto modes, and plan mode
    /// given a trace path (the served run, for a CPU replay against the plan).
    fn records_trace(&self) -> bool {
        match self.settings.mode {
            Mode::Trace | Mode::Auto => true,
            Mode::Plan => self.settings.trace_path.is_some(),
            Mode::Online => false,
        }
    }

    /// Stops recording and writes every device's trace (trace mode, or plan mode given a
    /// trace path); returns the files written.
    pub fn flush_trace(&self) -> Result<Vec<String>> {
        let plan_trace = self.settings.mode == Mode::Plan && self.settings.trace_path.is_some();
        if self.settings.mode != Mode::Trace && !plan_trace {
            return Err(BridgeError::Settings(format!(
                "flush_trace: not recording a trace (mode is {})",
                self.mode()
            )));
        }
        let mut written = Vec::new();
        for slot in self.slots()? {
            let Some(e) = slot.default.get() else {
                continue;
            };
            let Some(trace) = e.take_trace()? else {
                continue;
            };
            let path = self
                .settings
                .trace_path_on(slot.ordinal, self.home())
                .ok_or_else(|| BridgeError::Settings("trace mode without a path".into()))?;
            write_trace_file(Path::new(&path), &trace)?;
            written.push(path.display().to_string());
        }
        self.trace_flushed.store(true, Ordering::Release);
        Ok(written)
    }
}
