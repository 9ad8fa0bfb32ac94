//! Giving cached memory back: [`Engine::empty_cache`] (also the out-of-memory retry)
//! and the release of holes before a new peak.
//!
//! A release synchronises every pending event and completes the frees, carves out
//! every wholly free mapped unit (module `arena::release`), unmaps them after one
//! device synchronisation with the lock released, and releases the arenas left with
//! nothing mapped (none once a checkpoint was taken). Nothing is released while a CUDA
//! graph capture is underway.
//!
//! **Release before a new peak** (opt-in, [`EngineConfig::release_before_new_peak`]):
//! when an online arena's growth would map past the peak of reserved bytes, free whole
//! granules of the online arenas' holes (free blocks other than an arena's free tail,
//! including one before a gap an earlier release left), largest holes first, are
//! given back first (one device synchronisation, then the unmaps:
//! `Arenas::carve_holes`), by as much as the growth passes the peak — never from the run
//! that growth will map (`Arenas::growth_run`): that would only make it map more. A
//! best-fit arena's holes are what makes its peak exceed the live peak; this keeps
//! them from adding up. The gaps a release leaves are re-mapped by a later growth
//! when they are the cheapest place for it (growth takes the run needing the fewest
//! granules mapped, module `arena::growth`; growth always at the lowest run, with free blocks
//! before gaps never released, parked gigabytes on a trace whose shapes change every
//! iteration). The cost is a synchronisation per release and re-mapping what was
//! given back. Measured (peak reserved and utilization with and without release, per
//! trace, and the synchronisations): BENCHMARKS.md, "Session 6: release before a new
//! peak, fixed for changing shapes". Off by default in the engine; the torch bridge
//! turns it on (`STWEAVER_RELEASE_AT_PEAK`, default 1).
//!
//! **The plan pool** (pinned: `empty_cache` leaves it mapped while it serves) takes part
//! only when it maps past the peak for what its plan did not foresee
//! ([`State::pool_over_peak`], checked by `Engine::map_pool_range` before it maps):
//! when the pool *grows* (a large unplanned request without a hole: an iteration of a
//! class never recorded, longer than every planned one), its free whole units anywhere
//! go back first (largest first, never the range about to be mapped,
//! `Arenas::carve_pool_holes`; the pool's units are 64 MiB pieces of its ranges,
//! `arena::POOL_UNIT`, so a large range a small unplanned tensor shares still gives
//! most of itself back), then the online arenas' holes; when a planned range is
//! mapped again while the pool is still grown past its planned length, the grown part's
//! free units go first. A plan's own first pass maps a new peak at every range it
//! touches first, by design: then nothing is released. Measured on len5 (an H100 trace
//! of five sequence lengths, planned per class) with every fifth iteration from 60 at
//! 5/4 of its sizes: 1.16 x the lower bound when the pool kept its free units, 1.0032 x
//! with them given back (online serving: 1.0007 x); device synchronisations in 200
//! iterations 20 -> 23 (at 6f17c94; 26 with the rounds of learning after the switch,
//! which `crates/planner/tests/long_loops.rs` prints).
//!
//! **Churn** ([`EngineConfig::release_churn_iterations`], the bridge's
//! `STWEAVER_RELEASE_CHURN`, default 3 in online mode only): a loop whose iterations
//! repeat can settle into releasing, in every iteration, holes that the next one maps
//! again. After that many iterations in a row that each repeat the previous one's
//! requests and each released, the releases stop until the peak of live bytes grows
//! ([`Churn`]).

use crate::units::{Bytes, StreamId};

/// Whether the release of holes before a new peak churns. A loop whose iterations
/// repeat, served online, can settle into releasing holes in every iteration that the
/// next one maps again: one device synchronisation per release and one map call per
/// granule (on an H100, a Llama training loop served online ran 1.29x the native step,
/// median; its CPU replay made 1.2 synchronisations and 316 granule maps per
/// iteration). After `limit` iterations in a row
/// ([`EngineConfig::release_churn_iterations`]; 0: never) that each repeat the
/// previous one's requests (sizes and streams, in order: a running hash) and each
/// release, the releases stop: the peak grows once by the memory the loop keeps using
/// (6.90 -> 6.97 GiB on that loop's replay) and the steps no longer synchronise for
/// it. They start again when the peak of live bytes grows (the loop needs more memory:
/// holes are worth giving back again). Not while a trace is recorded (auto mode's
/// recording is followed by its plan; a trace run is what later runs replay).
/// Iterations are the engine's boundaries (`Engine::mark_iteration`); without them
/// nothing changes. O(1) per request (the hash) and per boundary.
#[derive(Debug, Default)]
pub(super) struct Churn {
    /// Iterations in a row after which the releases stop (0: never).
    limit: u32,
    /// A release happened since the last boundary.
    pub released: bool,
    /// Boundaries in a row whose iteration repeated the previous one and released.
    streak: u32,
    /// The releases stopped.
    pub off: bool,
    /// The running hash of this iteration's requests, and the last iteration's.
    sig: u64,
    prev_sig: Option<u64>,
    /// The peak of live bytes when the releases stopped.
    live_peak_at_off: u64,
}

impl Churn {
    pub fn new(limit: u32) -> Churn {
        Churn {
            limit,
            ..Churn::default()
        }
    }

    /// A request of `size` on `stream` (every served allocation). Nothing with a
    /// limit of 0 (the releases never stop: no signature is needed).
    #[inline]
    pub fn note(&mut self, size: Bytes, stream: StreamId) {
        if self.limit == 0 {
            return;
        }
        self.sig = (self.sig.rotate_left(5) ^ size.get() ^ stream.0.rotate_left(48))
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    /// At an iteration boundary: `recording` whether a trace is being recorded,
    /// `live_peak` the peak of live requested bytes so far.
    pub fn boundary(&mut self, recording: bool, live_peak: u64) {
        let repeated = self.prev_sig == Some(self.sig);
        self.streak = if self.released && repeated && !recording {
            self.streak + 1
        } else {
            0
        };
        if self.off && live_peak > self.live_peak_at_off {
            self.off = false;
        }
        if self.limit > 0 && self.streak >= self.limit && !self.off {
            self.off = true;
            self.live_peak_at_off = live_peak;
            self.streak = 0;
        }
        self.prev_sig = Some(self.sig);
        self.sig = 0;
        self.released = false;
    }
}

#[cfg(doc)]
use super::EngineConfig;
use super::arena::{ArenaId, GrowthFailure, Idx, SlabFull};
use super::{DeviceError, DeviceMemory, DevicePtr, Engine, EngineError, PoolKind, State, stats};

/// A release of the online arenas' holes before a growth past the peak
/// (`Arenas::carve_holes`): about `want` bytes, none of them in `keep` (the run the growth
/// will map).
pub(super) struct HoleRelease {
    want: u64,
    keep: Option<(ArenaId, u64, u64)>,
    /// The plan pool's free units to give back first (its arena, from which address
    /// up: [`State::pool_over_peak`]).
    pool: Option<(ArenaId, u64)>,
}

impl State {
    /// By how many bytes growing arena `a` for `rounded` bytes would map past the peak
    /// of reserved bytes (what `carve_growth` would map, not the request's size: the
    /// arena's free tail counts), with the range of the run that growth would map
    /// (`Arenas::growth_run`, kept out of the release); `None` if it would not. Changes
    /// nothing.
    pub(super) fn growth_over_peak(
        &mut self,
        a: ArenaId,
        rounded: u64,
    ) -> Result<Option<HoleRelease>, SlabFull> {
        let reserved = self.stats.reserved_bytes[0].current as u64 + self.mapping;
        let budget = (self.stats.reserved_bytes[0].peak as u64).saturating_sub(reserved);
        Ok(match self.arenas.carve_growth(a, rounded, budget)? {
            Ok(carved) => {
                for i in carved {
                    self.arenas.finish_mapping(i, false);
                }
                None
            }
            Err(GrowthFailure::OverBudget { needed }) => Some(HoleRelease {
                want: needed - budget,
                keep: self
                    .arenas
                    .growth_run(a, rounded)
                    .map(|(lo, hi)| (a, lo, hi)),
                pool: None,
            }),
            Err(GrowthFailure::NoRoom) => None,
        })
    }

    /// Whether mapping `total` more bytes of the plan pool for `[addr, addr + rounded)`
    /// would map past the peak of reserved bytes, and if so what to give back first
    /// (module docs, the plan pool): for the pool's growth (`growth`: a request the plan
    /// does not serve, placed past its holes), the pool's free units anywhere, then the
    /// online arenas' holes; for a planned range, the same only once the pool has grown
    /// past its planned length (the free units of that grown part, then the online
    /// holes): a plan's own first pass maps a new peak at every first-touched range, by
    /// design, and its free ranges are what it plans next. `None`: nothing to do.
    pub(super) fn pool_over_peak(
        &self,
        addr: u64,
        rounded: u64,
        total: u64,
        growth: bool,
    ) -> Option<HoleRelease> {
        let p = self.plan.as_ref()?;
        let reserved = self.stats.reserved_bytes[0].current as u64 + self.mapping;
        let peak = self.stats.reserved_bytes[0].peak as u64;
        if reserved + total <= peak {
            return None;
        }
        let planned_end = p.base + p.len;
        let from = if growth {
            p.base
        } else if self.arenas.mapped_end(p.arena) > planned_end {
            planned_end
        } else {
            return None;
        };
        Some(HoleRelease {
            want: reserved + total - peak,
            keep: Some((p.arena, addr, addr + rounded)),
            pool: Some((p.arena, from)),
        })
    }
}

impl<D: DeviceMemory> Engine<D> {
    /// Gives cached memory back to the device: completes every pending free (waiting for
    /// its events), unmaps every granule that holds nothing, and releases arenas left
    /// with nothing mapped. Afterwards reserved memory is what live blocks need, plus the
    /// free bytes sharing their granules (`inactive_split_bytes`).
    pub fn empty_cache(&self) -> Result<(), EngineError> {
        self.release_cached()
    }

    pub(super) fn release_cached(&self) -> Result<(), EngineError> {
        self.release(None)
    }

    /// Gives cached memory back to the device: everything releasable (`holes: None`), or
    /// (`Some`) about `want` bytes of the online arenas' holes only, outside `keep`
    /// (`Arenas::carve_holes`). Either way after a device synchronisation.
    pub(super) fn release(&self, holes: Option<HoleRelease>) -> Result<(), EngineError> {
        // 0. Nothing while a CUDA graph capture is underway: a synchronisation would
        //    invalidate it (as PyTorch, which releases no cache during a capture).
        if !self.dev.may_synchronize() {
            return Ok(());
        }
        // 1. Synchronise every pending event and complete the frees.
        let mut st = self.lock()?;
        st.stats.num_sync_all_streams += 1;
        let mut work = st.events.take();
        drop(st);
        let mut first_err: Option<DeviceError> = None;
        for e in work.iter_mut() {
            e.done = match self.dev.synchronize_event(e.event) {
                Ok(()) => true,
                Err(err) => {
                    first_err.get_or_insert(err);
                    false
                }
            };
        }
        let mut st = self.lock()?;
        st.apply_events(work);
        if let Some(e) = first_err {
            return Err(e.into());
        }
        // 2. Carve out every wholly free granule.
        let ids: Vec<ArenaId> = st.arenas.arena_ids().collect();
        let mut carved: Vec<(Idx, u64, u64, PoolKind)> = Vec::new();
        // A plan with nothing left to serve gives its pool's free granules back too.
        let spent_pool = st
            .plan
            .as_ref()
            .filter(|p| p.cursor.spent())
            .map(|p| p.arena);
        let pieces = match holes {
            None => {
                let mut all = Vec::new();
                for &a in &ids {
                    all.extend(st.arenas.carve_releasable_with(a, spent_pool == Some(a))?);
                }
                all
            }
            Some(h) => {
                let mut out = Vec::new();
                let mut want = h.want;
                if let Some((pa, from)) = h.pool {
                    let keep = h.keep.map_or((0, 0), |(_, lo, hi)| (lo, hi));
                    out = st.arenas.carve_pool_holes(pa, from, want, keep)?;
                    let got: u64 = out.iter().map(|&i| st.arenas.block(i).size).sum();
                    want = want.saturating_sub(got);
                }
                if want > 0 {
                    out.extend(st.arenas.carve_holes(&ids, want, h.keep)?);
                }
                out
            }
        };
        for i in pieces {
            let b = st.arenas.block(i);
            let kind = st.arenas.arena(b.arena).map_or(PoolKind::Small, |x| x.kind);
            carved.push((i, b.addr, b.size, kind));
        }
        st.settle_inactive();
        // 3. Unmap them after the device has finished all queued work.
        if !carved.is_empty() {
            drop(st);
            let synced = self.dev.synchronize();
            let results: Vec<Result<(), DeviceError>> = carved
                .iter()
                .map(|&(_, addr, size, _)| match &synced {
                    Ok(()) => self.dev.unmap(DevicePtr(addr), Bytes(size)),
                    Err(e) => Err(e.clone()),
                })
                .collect();
            st = self.lock()?;
            for (&(i, _, size, kind), r) in carved.iter().zip(results) {
                st.arenas.finish_unmapping(i, r.is_ok());
                match r {
                    Ok(()) => {
                        stats::decrease(&mut st.stats.reserved_bytes, kind, size);
                        st.stats.num_device_free += 1;
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            st.settle_inactive();
        }
        // 4. Release arenas with nothing mapped (none once checkpointed).
        let mut released = Vec::new();
        let keep = st.keep_arenas;
        for a in ids.into_iter().filter(|_| !keep) {
            if let Some(arena) = st.arenas.remove_arena(a) {
                st.arena_of.remove(&(arena.stream, arena.kind));
                stats::decrease(&mut st.stats.segment, arena.kind, 1);
                released.push((arena.base, arena.len));
            }
        }
        drop(st);
        for (base, len) in released {
            if let Err(e) = self.dev.release(DevicePtr(base), Bytes(len)) {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An iteration of `sizes` (stream 0), with or without a release, then its boundary.
    fn iteration(c: &mut Churn, sizes: &[u64], released: bool, recording: bool, live_peak: u64) {
        for &s in sizes {
            c.note(Bytes(s), StreamId(0));
        }
        c.released |= released;
        c.boundary(recording, live_peak);
    }

    #[test]
    fn releases_stop_after_three_repeated_iterations_that_each_released() {
        let mut c = Churn::new(3);
        // The first iteration has nothing to repeat.
        for k in 0..3 {
            assert!(!c.off, "off after {k} iterations");
            iteration(&mut c, &[512, 1024], true, false, 100);
        }
        assert!(!c.off);
        iteration(&mut c, &[512, 1024], true, false, 100);
        assert!(c.off);
        // Iterations that need no more live memory keep them stopped.
        iteration(&mut c, &[512, 2048], false, false, 100);
        assert!(c.off);
        // A new peak of live bytes starts them again.
        iteration(&mut c, &[512, 4096], false, false, 101);
        assert!(!c.off);
    }

    #[test]
    fn iterations_that_differ_or_release_nothing_or_record_reset_the_streak() {
        for breaker in 0..3 {
            let mut c = Churn::new(3);
            for k in 0..12 {
                let sizes: &[u64] = if breaker == 0 && k % 3 == 0 {
                    &[512, 7]
                } else {
                    &[512]
                };
                let released = !(breaker == 1 && k % 3 == 0);
                let recording = breaker == 2 && k % 3 == 0;
                iteration(&mut c, sizes, released, recording, 100);
                assert!(!c.off, "breaker {breaker}: off at iteration {k}");
            }
        }
    }

    #[test]
    fn a_limit_of_zero_never_stops_the_releases() {
        let mut c = Churn::new(0);
        for _ in 0..10 {
            iteration(&mut c, &[512], true, false, 100);
        }
        assert!(!c.off);
    }

    #[test]
    fn the_signature_depends_on_order_size_and_stream() {
        let sig = |reqs: &[(u64, u64)]| {
            let mut c = Churn::new(3);
            for &(s, st) in reqs {
                c.note(Bytes(s), StreamId(st));
            }
            c.sig
        };
        let base = sig(&[(512, 0), (1024, 0)]);
        assert_eq!(base, sig(&[(512, 0), (1024, 0)]));
        assert_ne!(base, sig(&[(1024, 0), (512, 0)]));
        assert_ne!(base, sig(&[(512, 0), (1024, 1)]));
        assert_ne!(base, sig(&[(512, 0), (1536, 0)]));
    }
}
