//! Mapping memory with the engine's lock released: an online arena's growth
//! ([`Engine::grow`]) and the plan pool's first-touched ranges
//! ([`Engine::map_pool_range`], which gives the plan up when they would pass the memory
//! limit even after the cache is given back).
//!
//! The arena carves the blocks to map out as `Mapping` (owned by the calling thread);
//! they are mapped with the lock released as the arena's mapped *units* (one device
//! `map` call each: a granule online, a 64 MiB-aligned chunk of a first-touched range in the
//! plan pool (`arena::pool_units`);
//! only whole units are ever unmapped), then finished under the lock: free memory
//! counted in `reserved_bytes` and `num_device_alloc`, or unmapped again where the
//! device refused. One device call per unit.

use std::sync::MutexGuard;

use crate::units::{Bytes, StreamId};

use super::arena::{ArenaId, GrowthFailure, Idx, pool_units};
use super::{DeviceError, DeviceMemory, DevicePtr, Engine, EngineError, PoolKind, State, stats};

/// One block's device result in [`Engine::map_blocks`].
type MapResult = Result<(), DeviceError>;

/// What a growth attempt came to.
pub(super) enum Growth {
    /// Memory was mapped (or another thread's was): try the arena again.
    Retry,
    /// The limit, the arena or the device refused.
    Refused,
}

impl<D: DeviceMemory> Engine<D> {
    /// Maps the granules arena `a` needs for `rounded` more bytes, within the limit.
    pub(super) fn grow<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        a: ArenaId,
        rounded: u64,
    ) -> Result<(Growth, MutexGuard<'a, State>), EngineError> {
        let reserved = st.stats.reserved_bytes[0].current as u64;
        let budget = st.limit.saturating_sub(reserved + st.mapping);
        let carved = match st.arenas.carve_growth(a, rounded, budget)? {
            Ok(carved) => carved,
            Err(GrowthFailure::NoRoom | GrowthFailure::OverBudget { .. }) => {
                return Ok((Growth::Refused, st));
            }
        };
        self.map_carved(st, &carved)
    }

    /// Maps blocks carved out as `Mapping` (the lock released around the device calls)
    /// and turns them into free memory; a block the device refuses goes back to
    /// unmapped. `Growth::Refused` if the device was out of memory for one.
    fn map_carved<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        carved: &[Idx],
    ) -> Result<(Growth, MutexGuard<'a, State>), EngineError> {
        let (results, st) = self.map_blocks(st, carved)?;
        let mut outcome = Growth::Retry;
        for r in results {
            match r {
                Ok(()) => {}
                Err(DeviceError::OutOfMemory { .. }) => outcome = Growth::Refused,
                Err(e) => return Err(e.into()),
            }
        }
        Ok((outcome, st))
    }

    /// The one mapping step: maps each `Mapping` block (as its arena's units,
    /// [`Engine::map_units`]) with the lock released, then finishes it — free memory
    /// counted in `reserved_bytes` and `num_device_alloc`, or unmapped again. Returns
    /// each block's device result, in order.
    pub(super) fn map_blocks<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        blocks: &[Idx],
    ) -> Result<(Vec<MapResult>, MutexGuard<'a, State>), EngineError> {
        let ranges: Vec<(u64, u64, u64, PoolKind)> = blocks
            .iter()
            .map(|&i| {
                let b = st.arenas.block(i);
                let kind = st.arenas.arena(b.arena).map_or(PoolKind::Large, |x| x.kind);
                (b.addr, b.size, st.arenas.mapping_unit(b.arena), kind)
            })
            .collect();
        let total: u64 = ranges.iter().map(|r| r.1).sum();
        st.mapping += total;
        drop(st);
        let results: Vec<Result<(), DeviceError>> = ranges
            .iter()
            .map(|&(addr, size, unit, _)| self.map_units(addr, size, unit))
            .collect();
        let mut st = self.lock()?;
        st.mapping -= total;
        for ((&i, &(_, size, unit, kind)), r) in blocks.iter().zip(&ranges).zip(&results) {
            st.arenas.finish_mapping_as(i, r.is_ok(), unit);
            if r.is_ok() {
                stats::increase(&mut st.stats.reserved_bytes, kind, size);
                st.stats.num_device_alloc += 1;
            }
        }
        st.settle_inactive();
        Ok((results, st))
    }

    /// Maps `[addr, addr + size)` in units of `unit` bytes (`arena::pool_units`: one
    /// device `map` call per unit, the units `Arenas::finish_mapping_as` records for the
    /// block), all or nothing: on a failure the units already mapped are unmapped again.
    fn map_units(&self, addr: u64, size: u64, unit: u64) -> Result<(), DeviceError> {
        for (lo, hi) in pool_units(addr, size, unit) {
            if let Err(e) = self.dev.map(DevicePtr(lo), Bytes(hi - lo)) {
                for (l, h) in pool_units(addr, lo - addr, unit) {
                    let _ = self.dev.unmap(DevicePtr(l), Bytes(h - l));
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Maps the granules of `[addr, addr + rounded)` of the plan pool that are not
    /// mapped yet, within the memory limit (the lock released around the device calls),
    /// for a request of `size` on `stream`. Over the limit even with the online cache
    /// given back, the request first takes any free hole of the pool big enough
    /// ([`State::alloc_in_any_hole`]: what the plan expects there later becomes a
    /// conflict, served in turn), and only without one is the plan given up.
    pub(super) fn map_pool_range<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        addr: u64,
        rounded: u64,
        (size, stream): (Bytes, StreamId),
        growth: bool,
    ) -> Result<(PoolMapping, MutexGuard<'a, State>), EngineError> {
        let mut released = false;
        let mut peak_released = false;
        let (carved, total, reserved) = loop {
            let Some(pa) = st.plan.as_ref().map(|p| p.arena) else {
                return Ok((PoolMapping::No, st));
            };
            let carved = st.arenas.carve_range(pa, addr, rounded)?;
            if carved.is_empty() {
                // Every granule is mapped (or being mapped): nothing to do, whatever the
                // limit.
                return Ok((PoolMapping::Mapped, st));
            }
            let total: u64 = carved.iter().map(|&i| st.arenas.block(i).size).sum();
            if !peak_released
                && self.release_at_peak
                && !st.churn.off
                && let Some(h) = st.pool_over_peak(addr, rounded, total, growth)
            {
                // Mapping this would set a new peak of reserved memory while the pool
                // (grown past its plan) or the online arenas hold free units: give
                // those back first (module `release`, the plan pool).
                peak_released = true;
                st.churn.released = true;
                for i in carved {
                    st.arenas.finish_mapping(i, false);
                }
                drop(st);
                self.release(Some(h))?;
                st = self.lock()?;
                continue;
            }
            let reserved = st.stats.reserved_bytes[0].current as u64;
            if released || reserved + st.mapping + total <= st.limit {
                break (carved, total, reserved);
            }
            // Over the limit: first give back the cached memory of the online arenas
            // (after a switch, the online phase's cache is still held), as an OOM retry.
            for i in carved {
                st.arenas.finish_mapping(i, false);
            }
            drop(st);
            self.release_cached()?;
            st = self.lock()?;
            st.stats.num_alloc_retries += 1;
            released = true;
        };
        if reserved + st.mapping + total > st.limit {
            for i in carved {
                st.arenas.finish_mapping(i, false);
            }
            if let Some(i) = st.alloc_in_any_hole(size, rounded, stream)? {
                st.stats.num_alloc_retries += 1;
                return Ok((PoolMapping::InHole(i), st));
            }
            // The plan does not fit under the limit next to what is held: give it up
            // (its blocks stay until freed, its pool goes back like an online arena)
            // and serve online from now on.
            // What was served outside the plan so far says why (a prologue that did not
            // match the recorded one leaves online memory beside the pool).
            // Where the reserved bytes are: the pool's mapped part against its planned
            // length, and the free bytes the online arenas cannot give back (they share a
            // granule with a live block: `inactive_split`).
            let served = st.plan.as_ref().map_or(String::new(), |p| {
                let s = &p.cursor.stats;
                let pool_mapped: u64 = st
                    .arenas
                    .arena_blocks(p.arena)
                    .filter(|(_, b)| b.state.is_mapped())
                    .map(|(_, b)| b.size)
                    .sum();
                let held = st.arenas.inactive_bytes(PoolKind::Small)
                    + st.arenas.inactive_bytes(PoolKind::Large);
                format!(
                    "; {} allocated; the pool {} mapped of {} planned; {} free but not releasable; served so far: {} planned, {} conflicts, {} unplanned ({} in pool holes), {} iterations",
                    Bytes(st.stats.allocated_bytes[0].current as u64),
                    Bytes(pool_mapped),
                    Bytes(p.len),
                    Bytes(held),
                    s.hits,
                    s.conflicts,
                    s.unplanned,
                    s.holes,
                    s.iterations
                )
            });
            let why = format!(
                "mapping {} of the plan's pool would exceed the memory limit {} ({} reserved{served})",
                Bytes(total),
                Bytes(st.limit),
                Bytes(reserved)
            );
            st.stop_plan(Some(why));
            return Ok((PoolMapping::No, st));
        }
        let (grown, st) = self.map_carved(st, &carved)?;
        let mapped = if matches!(grown, Growth::Retry) {
            PoolMapping::Mapped
        } else {
            PoolMapping::No
        };
        Ok((mapped, st))
    }
}

/// What [`Engine::map_pool_range`] did.
pub(super) enum PoolMapping {
    /// The range is mapped now.
    Mapped,
    /// Not mapped (no plan, a device failure, or the plan given up at the limit).
    No,
    /// Not mapped (the memory limit): the request was placed in this free hole of the
    /// pool instead.
    InHole(Idx),
}
