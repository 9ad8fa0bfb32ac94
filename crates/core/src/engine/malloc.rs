//! [`Engine::malloc`]: a short chain of stages, each with its own fallbacks, tried in
//! order until one places the block.
//!
//! 0. **Catch up** ([`Engine::catch_up`]): after a switch to a plan, freed online memory
//!    is given back (the drain); pending frees whose events completed complete.
//! 1. **Planned** ([`Engine::serve_planned`], plan mode): the request's planned place —
//!    mapped first when the run reaches those granules for the first time, or taken
//!    after waiting for the pending frees that alone hold it (module `pending`) — else,
//!    a conflict, a hole of the pool (module `plan_holes`).
//! 2. **Pool growth** ([`Engine::serve_pool_growth`], a large request on a plan's
//!    stream): the pool grows at its tail (module `plan_holes`).
//! 3. **Online** ([`Engine::serve_online`]): best fit in the arena of (stream, pool),
//!    created at first use; a small request that does not fit its arena takes a free
//!    block of the stream's large arena if one fits, before the small arena grows (the
//!    block then counts in the large pool's stats, where it lives); else the arena
//!    grows (after releasing holes first if the growth would set a new peak, module
//!    `release`), and a refused growth goes through the out-of-memory fallbacks below.
//!
//! The block placed is then registered ([`State::register`]: pointer map, stats, trace).
//! A hit costs one lock and, planned, the cursor's O(1) match and a by-address look-up,
//! or, online, a hash look-up of the arena and a best fit: expected O(log n) in the
//! arena's free blocks, no device call.
//!
//! **Out of memory** ([`Engine::after_refused_growth`]): a growth that would pass the
//! memory limit, or that the device refuses, triggers one release of cached memory (as
//! `empty_cache`) and a retry (`num_alloc_retries`); if that fails too and a plan is
//! served, the plan is given up (its free granules go back; [`Engine::plan_abandoned`]
//! says why) and the request retried once more; then [`EngineError::OutOfMemory`] says
//! what was asked and what is allocated, reserved and free (`num_ooms`).

use std::sync::MutexGuard;

use crate::units::{Bytes, StreamId};

use super::arena::{ALIGNMENT, ArenaId, Idx, SlabFull};
use super::mapping::{Growth, PoolMapping};
use super::plan_serving::PlanAnswer;
use super::{DeviceMemory, DevicePtr, Engine, EngineError, PoolKind, State, stats};

/// The out-of-memory fallbacks a request has been through (module docs).
#[derive(Debug, Default)]
struct Tried {
    /// Holes were released before a growth past the peak.
    holes: bool,
    /// The cache was given back after a refused growth.
    cache: bool,
    /// The plan was given up after a refused growth.
    plan: bool,
}

/// `size` rounded up to [`ALIGNMENT`]; zero and overflowing sizes are errors.
#[inline]
fn rounded(size: Bytes) -> Result<u64, EngineError> {
    if size == Bytes::ZERO {
        return Err(EngineError::ZeroSize);
    }
    Ok(size
        .align_up(Bytes(ALIGNMENT))
        .ok_or(EngineError::TooLarge(size))?
        .get())
}

impl State {
    /// Accounts for block `i`, just allocated for `size` requested bytes on `stream`.
    pub(super) fn register(&mut self, i: Idx, size: Bytes, stream: StreamId) -> DevicePtr {
        let kind = self.kind_of(i);
        let (addr, rounded) = (self.arenas.block(i).addr, self.arenas.block(i).size);
        self.live.insert(addr, i);
        self.arenas.block_mut(i).tag = self.pauses.tag;
        let s = &mut self.stats;
        stats::increase(&mut s.allocation, kind, 1);
        stats::increase(&mut s.allocated_bytes, kind, rounded);
        stats::increase(&mut s.active, kind, 1);
        stats::increase(&mut s.active_bytes, kind, rounded);
        stats::increase(&mut s.requested_bytes, kind, size.get());
        self.churn.note(size, stream);
        if let Some(r) = self.recorder.as_mut() {
            let id = r.alloc(size, stream, addr);
            self.arenas.block_mut(i).trace_id = id;
        }
        self.settle_inactive();
        DevicePtr(addr)
    }

    /// Best fit for an online request in arena `a` of (`stream`, `kind`); for a small
    /// request that does not fit, a free block of the stream's large arena (it counts in
    /// the large pool, where it lives), before the small arena grows.
    #[inline]
    fn fit_online(
        &mut self,
        a: ArenaId,
        stream: StreamId,
        kind: PoolKind,
        rounded: u64,
        size: Bytes,
    ) -> Result<Option<Idx>, SlabFull> {
        if let Some(i) = self.arenas.alloc(a, rounded, size.get())? {
            return Ok(Some(i));
        }
        if kind == PoolKind::Small
            && let Some(&la) = self.arena_of.get(&(stream, PoolKind::Large))
        {
            return self.arenas.alloc(la, rounded, size.get());
        }
        Ok(None)
    }
}

impl<D: DeviceMemory> Engine<D> {
    /// Allocates `size` bytes for use on `stream`. The block is `size` rounded up to
    /// 512 B, 512-B aligned, and reused only on `stream` after it is freed.
    pub fn malloc(&self, size: Bytes, stream: StreamId) -> Result<DevicePtr, EngineError> {
        let rounded = rounded(size)?;
        let st = self.catch_up(self.lock()?)?;
        let (placed, st) = self.serve_planned(st, size, rounded, stream)?;
        let (placed, st) = match placed {
            Some(i) => (Some(i), st),
            None => self.serve_pool_growth(st, size, rounded, stream)?,
        };
        let (i, mut st) = match placed {
            Some(i) => (i, st),
            None => self.serve_online(st, size, rounded, stream)?,
        };
        Ok(st.register(i, size, stream))
    }

    /// Stage 0: a switch's drain gives freed online memory back, and pending frees whose
    /// events have completed complete.
    #[inline]
    fn catch_up<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
    ) -> Result<MutexGuard<'a, State>, EngineError> {
        if st.drain_pending {
            st.drain_pending = false;
            drop(st);
            self.release_cached()?;
            st = self.lock()?;
        }
        if !st.events.is_empty() {
            st = self.process_events_locked(st)?;
        }
        Ok(st)
    }

    /// Stage 1, the plan: the planned place (mapped first, or after waiting for pending
    /// frees, when the pool answers so), else for a conflict a hole of the pool.
    /// `None`: not served from the plan.
    #[inline]
    fn serve_planned<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<(Option<Idx>, MutexGuard<'a, State>), EngineError> {
        let (e, addr) = match st.alloc_planned(size, rounded, stream)? {
            PlanAnswer::Placed(i) => return Ok((Some(i), st)),
            PlanAnswer::Nothing => return Ok((None, st)),
            PlanAnswer::Map { addr, e } => {
                let (mapped, guard) =
                    self.map_pool_range(st, addr, rounded, (size, stream), false)?;
                st = guard;
                if let PoolMapping::InHole(i) = mapped {
                    st.plan_conflict(&e, addr);
                    return Ok((Some(i), st));
                }
                if matches!(mapped, PoolMapping::Mapped)
                    && let Some(pa) = st.plan.as_ref().map(|p| p.arena)
                    && let Some(i) = st.arenas.alloc_at(pa, addr, rounded, size.get())?
                {
                    st.planned_block(i, e.cross, stream);
                    return Ok((Some(i), st));
                }
                (e, addr)
            }
            PlanAnswer::Busy { addr, e } => {
                // Part of the range may be reached for the first time (never mapped):
                // map it first (a no-op when it is mapped), so that only the pending frees
                // hold the range (on the H100, a prologue request over a
                // threshold-offloaded tensor's pending free and unmapped granules
                // conflicted, and its plan was given up).
                let (mapped, guard) =
                    self.map_pool_range(st, addr, rounded, (size, stream), false)?;
                st = guard;
                if let PoolMapping::InHole(i) = mapped {
                    st.plan_conflict(&e, addr);
                    return Ok((Some(i), st));
                }
                let (placed, guard) = self.wait_for_pending(st, addr, rounded, size, stream)?;
                st = guard;
                if let Some(i) = placed {
                    st.planned_block(i, e.cross, stream);
                    return Ok((Some(i), st));
                }
                (e, addr)
            }
        };
        st.plan_conflict(&e, addr);
        let hole = st.alloc_in_hole(size, rounded, stream)?;
        Ok((hole, st))
    }

    /// Stage 2: a large request the pool has no hole for grows the pool at its tail
    /// ([`State::pool_growth`]). `None`: not served from the pool.
    fn serve_pool_growth<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<(Option<Idx>, MutexGuard<'a, State>), EngineError> {
        if PoolKind::of(rounded) != PoolKind::Large {
            return Ok((None, st));
        }
        let Some(at) = st.pool_growth(rounded, stream) else {
            return Ok((None, st));
        };
        let (mapped, mut st) = self.map_pool_range(st, at, rounded, (size, stream), true)?;
        match mapped {
            PoolMapping::Mapped => {}
            PoolMapping::InHole(i) => return Ok((Some(i), st)),
            PoolMapping::No => return Ok((None, st)),
        }
        let placed = st.alloc_grown(at, size, rounded, stream)?;
        Ok((placed, st))
    }

    /// Stage 3, online: best fit in the arena of (`stream`, pool) ([`State::fit_online`]),
    /// else growth, with the release of holes before a new peak and the out-of-memory
    /// fallbacks ([`Engine::after_refused_growth`]) until one places the block or all
    /// are spent.
    #[inline]
    fn serve_online<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<(Idx, MutexGuard<'a, State>), EngineError> {
        let kind = PoolKind::of(rounded);
        let mut tried = Tried::default();
        loop {
            let Some(&a) = st.arena_of.get(&(stream, kind)) else {
                st = self.create_arena(st, stream, kind)?;
                continue;
            };
            if let Some(i) = st.fit_online(a, stream, kind, rounded, size)? {
                return Ok((i, st));
            }
            if !tried.holes
                && self.release_at_peak
                && !st.churn.off
                && let Some(over) = st.growth_over_peak(a, rounded)?
            {
                // Growing would set a new peak of reserved memory: first give back that
                // much of the arena's free holes, so that the growth maps no more than
                // is reserved now (module `release`).
                tried.holes = true;
                st.churn.released = true;
                drop(st);
                self.release(Some(over))?;
                st = self.lock()?;
                continue;
            }
            let (grown, guard) = self.grow(st, a, rounded)?;
            st = guard;
            if let Growth::Refused = grown {
                st = self.after_refused_growth(st, &mut tried, size, rounded, stream)?;
            }
        }
    }

    /// The next out-of-memory fallback after a refused growth (module docs): the cache
    /// given back, then the plan given up (each followed by a retry), then
    /// [`EngineError::OutOfMemory`].
    fn after_refused_growth<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        tried: &mut Tried,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<MutexGuard<'a, State>, EngineError> {
        if !tried.cache && !self.keep_cache {
            tried.cache = true;
        } else if !tried.plan && st.plan.is_some() {
            // Still refused with the cache given back: the plan's pool holds the rest.
            // Give the plan up (its blocks stay until freed; its free granules go back
            // now) before reporting out of memory.
            tried.plan = true;
            let why = format!(
                "out of memory serving {} online (limit {}, {} reserved): the plan's pool \
                 was given up for it",
                Bytes(rounded),
                Bytes(st.limit),
                Bytes(st.stats.reserved_bytes[0].current as u64),
            );
            st.stop_plan(Some(why));
        } else {
            return Err(self.out_of_memory(st, size, rounded, stream));
        }
        drop(st);
        self.release_cached()?;
        let mut st = self.lock()?;
        st.stats.num_alloc_retries += 1;
        Ok(st)
    }

    /// Counts an out-of-memory failure and says what was asked and what is held.
    #[cold]
    fn out_of_memory(
        &self,
        mut st: MutexGuard<'_, State>,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> EngineError {
        st.stats.num_ooms += 1;
        self.out_of_memory_error(st, size, rounded, stream)
    }

    /// What was asked and what is held, when `size` (`rounded`) does not fit (the lock
    /// released before the device is asked for its free memory).
    #[cold]
    pub(super) fn out_of_memory_error(
        &self,
        st: MutexGuard<'_, State>,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> EngineError {
        let s = &st.stats;
        let allocated = s.allocated_bytes[0].current as u64;
        let reserved = s.reserved_bytes[0].current as u64;
        let free_reserved = reserved.saturating_sub(s.active_bytes[0].current as u64);
        let limit = st.limit;
        drop(st);
        let device_free = self.dev.free_memory().unwrap_or(Bytes::ZERO);
        EngineError::OutOfMemory {
            requested: size,
            rounded: Bytes(rounded),
            stream,
            allocated: Bytes(allocated),
            reserved: Bytes(reserved),
            free_reserved: Bytes(free_reserved),
            limit: Bytes(limit),
            device_free,
        }
    }

    /// Reserves the arena for (`stream`, `kind`), with the lock released around the
    /// device call. Another thread may have made it meanwhile; then ours is given back.
    fn create_arena<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        stream: StreamId,
        kind: PoolKind,
    ) -> Result<MutexGuard<'a, State>, EngineError> {
        drop(st);
        let base = self.dev.reserve(Bytes(self.arena_size))?;
        let mut st = self.lock()?;
        if st.arena_of.contains_key(&(stream, kind)) {
            drop(st);
            self.dev.release(base, Bytes(self.arena_size))?;
            return self.lock();
        }
        let a = match st
            .arenas
            .add_arena(stream, kind, base.get(), self.arena_size)
        {
            Ok(a) => a,
            Err(e) => {
                drop(st);
                self.dev.release(base, Bytes(self.arena_size))?;
                return Err(e.into());
            }
        };
        st.arena_of.insert((stream, kind), a);
        stats::increase(&mut st.stats.segment, kind, 1);
        Ok(st)
    }
}
