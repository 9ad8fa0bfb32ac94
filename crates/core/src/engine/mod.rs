//! The online engine: stweaver's allocator, device-agnostic behind [`DeviceMemory`].
//!
//! # What it does
//!
//! [`Engine::malloc`] rounds a request up to 512 B and serves it by best fit from the
//! arena of its (stream, pool) — pool *small* for rounded sizes up to 1 MiB, *large*
//! above; a small request that does not fit its arena takes a free block of the
//! stream's large arena if one fits, before the small arena grows (the block then
//! counts in the large pool's stats, where it lives) — growing the arena by mapping
//! granules when nothing fits
//! ([`arena`] has the algorithm). [`Engine::free`] returns the block at
//! once, or, when other streams used it ([`Engine::record_stream`]), once they pass the
//! events recorded at the free (module `streams`). [`Engine::empty_cache`]
//! unmaps every granule that holds nothing and releases arenas left with nothing mapped.
//! Stats ([`DeviceStats`]) are exact at all times; in trace mode
//! ([`Engine::start_trace`]) every request is recorded into a [`Trace`](crate::trace::Trace).
//!
//! # Design
//!
//! - **One arena per (stream, pool)**, each a reserved virtual range of 9/8 of device
//!   memory (as PyTorch's expandable segments), so memory freed on one stream is never
//!   handed to another, and stream order alone makes reuse safe.
//! - **State behind one mutex** ([`std::sync::Mutex`]); `Engine: Send + Sync`. The lock
//!   is **never held across a device call**: mapping, unmapping, reserving, events and
//!   synchronisation happen with the lock released, on blocks marked as owned by the
//!   calling thread (`Mapping`, `Unmapping`, `PendingFree`) or on event queues taken out
//!   of the state, and the result is applied after re-locking.
//! - **Hot path**: `malloc` = lock, hash lookup of the arena, treap best fit, split,
//!   insert of the pointer into the pointer map (module `live`: linear probing
//!   specialised to 512-B-aligned addresses); `free` = lock, pointer-map remove,
//!   coalesce, treap insert. A plan hit replaces the best fit by the cursor's O(1)
//!   match and a by-address look-up. Expected O(log n) in the number of free blocks of
//!   the arena, no device call and no heap allocation once the slab and maps have grown
//!   to the workload.
//! - **Out of memory**: one release of cached memory and a retry, then a plan given
//!   up, then [`EngineError::OutOfMemory`] (module `malloc`).
//! - **Release before a new peak** (opt-in,
//!   [`EngineConfig::release_before_new_peak`]): holes of the online arenas given back
//!   before a growth would map past the peak of reserved bytes (module `release`).
//! - **Bad input is an error**: zero-size or overflowing requests, unknown pointers,
//!   double frees, `record_stream` after free — every case returns an [`EngineError`],
//!   none panics or corrupts state.
//!
//! # When stats change
//!
//! Each stat moves at the end of the locked step that changes it, with PyTorch's
//! semantics ([`stats`]): an allocation (`allocation`, `allocated_bytes`,
//! `active`, `active_bytes`, `requested_bytes`), a free request (`allocation`,
//! `allocated_bytes`), a completed free (`active`, `active_bytes`, `requested_bytes`), a
//! finished map (`reserved_bytes`, `num_device_alloc`) or unmap (`reserved_bytes`,
//! `num_device_free`), an arena reserved or released (`segment`). `inactive_split` and
//! `inactive_split_bytes` are brought to their new values at the end of every step that
//! changes free memory, with one increase or decrease.
//!
//! # Plan mode
//!
//! [`Engine::load_plan`] reserves a verified plan's pool as one more arena beside the
//! online ones, and each request on the plan's streams is offered to the plan first
//! (module `plan_serving`); what the plan does not serve at its planned offset takes a
//! hole of the pool (module `plan_holes`), or its stream waits for the pending frees
//! that alone hold its planned range (module `pending`), else it is served online.
//!
//! # Where things are
//!
//! `malloc` (the request's stages: planned → pool growth → online, and their
//! fallbacks), `free` (frees, `record_stream`, pending events), `mapping` (growth with
//! the lock released), `release` (`empty_cache`, release before a new peak),
//! `plan_serving`, `plan_holes`, `pending` (plan mode), `trace_mode`, `pause` (pause /
//! resume), `checkpoint` (CUDA graph trees), `introspect` (stats, snapshots, the
//! invariant check), `config`, `error`; below them `arena` (the
//! blocks), `live` (the pointer map), `streams` and `stream_use` (stream-deferred frees),
//! `cursor` and `plan_pool` (the plan looked at), `record` (the trace recorder).

pub mod arena;
mod checkpoint;
mod config;
mod cursor;
pub mod device;
mod error;
mod free;
pub mod host;
mod introspect;
mod live;
mod malloc;
mod mapping;
mod pause;
mod pending;
mod plan_holes;
mod plan_pool;
mod plan_serving;
mod record;
mod release;
pub mod stats;
mod stream_use;
mod streams;
mod trace_mode;
pub mod virtual_memory;

use std::sync::{Mutex, MutexGuard};

use rustc_hash::FxHashMap;

use crate::units::{Bytes, DeviceId, StreamId};

use self::arena::{ALIGNMENT, ArenaId, Arenas, Idx};
pub use self::arena::{BlockState, POOL_UNIT};
pub use self::checkpoint::{Checkpoint, CheckpointBlock, Restored};
use self::config::limit_bytes;
pub use self::config::{EngineConfig, GIVE_UP_ITERATIONS, MemoryLimit, PlanOptions};
pub use self::cursor::{MAX_CLASSES as MAX_PLAN_CLASSES, PlanStats, Section as PlanSection};
pub use self::device::{DeviceError, DeviceEvent, DeviceMemory, DevicePtr, HostBuffer, HostMem};
pub use self::error::EngineError;
pub use self::host::{FakeEvents, HostCounters, HostMemory};
pub use self::introspect::{BlockInfo, SegmentInfo};
use self::live::LiveMap;
pub use self::pause::{HostBackup, PauseError, PauseReport};
pub use self::plan_pool::{servable_from_start, steady_slice};
use self::plan_serving::PlanServing;
pub use self::plan_serving::{CONFLICT_ITERATIONS_KEPT, ConflictsSeen};
use self::record::Recorder;
pub use self::record::SavedKind;
pub use self::stats::{DeviceStats, PoolKind, Stat, StatArray, StatType};
use self::streams::EventQueue;
pub use self::virtual_memory::VirtualMemory;

/// Everything behind the lock.
#[derive(Debug)]
struct State {
    arenas: Arenas,
    arena_of: FxHashMap<(StreamId, PoolKind), ArenaId>,
    /// Address -> block, for every `Allocated` or `PendingFree` block.
    live: LiveMap,
    stats: DeviceStats,
    limit: u64,
    /// Bytes being mapped by threads that released the lock.
    mapping: u64,
    events: EventQueue,
    recorder: Option<Recorder>,
    plan: Option<PlanServing>,
    /// After a switch to a plan: iteration boundaries left during which freed online
    /// memory is given back (the online phase's leftovers), and whether some is
    /// waiting to be.
    drain: u32,
    drain_pending: bool,
    /// Why the last plan was given up mid-run, if it was.
    abandoned: Option<String>,
    /// A checkpoint was taken ([`Engine::checkpoint`]): arenas are never released from
    /// then on (their granules still are), so every checkpointed address stays
    /// restorable.
    keep_arenas: bool,
    /// Pause / resume (module `pause`): the current tag and what is paused.
    pauses: pause::Pauses,
    /// Whether releasing holes before a new peak churns (module `release`).
    churn: release::Churn,
    /// The key of the iteration in progress (`Engine::mark_iteration_keyed`,
    /// `Engine::set_iteration_key`), for a plan loaded mid-iteration.
    iteration_key: Option<u64>,
    /// What the last plan's cursor learned about keys, for the next plan loaded.
    learned_keys: Option<cursor::LearnedKeys>,
}

/// The online engine. See the module documentation.
#[derive(Debug)]
pub struct Engine<D: DeviceMemory> {
    dev: D,
    device: DeviceId,
    granule: u64,
    total: u64,
    arena_size: u64,
    /// [`EngineConfig::release_before_new_peak`].
    release_at_peak: bool,
    /// [`EngineConfig::keep_cache`].
    keep_cache: bool,
    state: Mutex<State>,
}

impl State {
    #[inline]
    fn kind_of(&self, i: Idx) -> PoolKind {
        self.arenas.block(i).kind
    }

    fn stream_of(&self, i: Idx) -> StreamId {
        let a = self.arenas.block(i).arena;
        self.arenas.arena(a).map_or(StreamId(0), |x| x.stream)
    }

    /// Brings `inactive_split(_bytes)` to the arenas' current non-releasable totals
    /// (nothing to do unless they changed since the last time).
    #[inline]
    fn settle_inactive(&mut self) {
        if !self.arenas.take_inactive_changed() {
            return;
        }
        for kind in [PoolKind::Small, PoolKind::Large] {
            stats::settle(
                &mut self.stats.inactive_split_bytes,
                kind,
                self.arenas.inactive_bytes(kind),
            );
            stats::settle(
                &mut self.stats.inactive_split,
                kind,
                self.arenas.inactive_count(kind),
            );
        }
    }
}

impl<D: DeviceMemory> Engine<D> {
    /// An engine serving from `dev`.
    pub fn new(dev: D, config: EngineConfig) -> Result<Engine<D>, EngineError> {
        let granule = dev.granularity().get();
        if !granule.is_power_of_two() || granule < ALIGNMENT {
            return Err(EngineError::BadGranularity(Bytes(granule)));
        }
        let total = dev.total_memory().get();
        let limit = limit_bytes(config.limit, total)?;
        let want = config
            .arena_size
            .map_or(total / 8 * 9, Bytes::get)
            .max(granule);
        let arena_size = want.div_ceil(granule).saturating_mul(granule);
        let mut state = State {
            arenas: Arenas::new(granule),
            arena_of: FxHashMap::default(),
            live: LiveMap::default(),
            stats: DeviceStats::default(),
            limit,
            mapping: 0,
            events: EventQueue::default(),
            recorder: config.record_trace.then(|| Recorder::new(config.device)),
            plan: None,
            drain: 0,
            drain_pending: false,
            abandoned: None,
            keep_arenas: false,
            pauses: pause::Pauses::default(),
            churn: release::Churn::new(config.release_churn_iterations),
            iteration_key: None,
            learned_keys: None,
        };
        state.arenas.set_fine_units(limit < total);
        let pool_unit = config
            .pool_unit
            .get()
            .div_ceil(granule)
            .saturating_mul(granule);
        state.arenas.set_pool_unit(pool_unit);
        Ok(Engine {
            dev,
            device: config.device,
            granule,
            total,
            arena_size,
            release_at_peak: config.release_before_new_peak && !config.keep_cache,
            keep_cache: config.keep_cache,
            state: Mutex::new(state),
        })
    }

    /// The device behind the engine.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The mapping granularity.
    pub fn granularity(&self) -> Bytes {
        Bytes(self.granule)
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, EngineError> {
        self.state.lock().map_err(|_| EngineError::Poisoned)
    }

    /// Sets the memory limit. Memory already mapped beyond it stays mapped; growth
    /// beyond it fails (after one release of cached memory).
    pub fn set_memory_limit(&self, limit: MemoryLimit) -> Result<(), EngineError> {
        let bytes = limit_bytes(limit, self.total)?;
        let mut st = self.lock()?;
        st.limit = bytes;
        // Under a limit the plan pool maps granule by granule (`Arenas::set_fine_units`).
        st.arenas.set_fine_units(bytes < self.total);
        Ok(())
    }

    /// The memory limit in bytes.
    pub fn memory_limit(&self) -> Result<Bytes, EngineError> {
        Ok(Bytes(self.lock()?.limit))
    }
}

impl<D: DeviceMemory> Drop for Engine<D> {
    /// Unmaps everything, releases every arena and destroys every event. Errors are
    /// ignored: there is no one left to report them to.
    fn drop(&mut self) {
        let st = match self.state.get_mut() {
            Ok(st) => st,
            Err(poisoned) => poisoned.into_inner(),
        };
        let _ = self.dev.synchronize();
        let ids: Vec<ArenaId> = st.arenas.arena_ids().collect();
        for a in ids {
            let mut run: Option<(u64, u64)> = None;
            let mut runs = Vec::new();
            for (_, b) in st.arenas.arena_blocks(a) {
                if b.state.is_mapped() {
                    run = Some(match run {
                        Some((s, l)) => (s, l + b.size),
                        None => (b.addr, b.size),
                    });
                } else if let Some(r) = run.take() {
                    runs.push(r);
                }
            }
            runs.extend(run);
            for (addr, len) in runs {
                let _ = self.dev.unmap(DevicePtr(addr), Bytes(len));
            }
            if let Some(arena) = st.arenas.arena(a) {
                let _ = self.dev.release(DevicePtr(arena.base), Bytes(arena.len));
            }
        }
        for e in st
            .events
            .take()
            .into_iter()
            .map(|p| p.event)
            .chain(st.events.idle.drain(..))
        {
            let _ = self.dev.destroy_event(e);
        }
    }
}

#[cfg(test)]
mod tests;
