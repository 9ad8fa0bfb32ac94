//! Dynamic space in the plan's pool: holes for what the plan does not serve at its
//! planned offset, and the pool's growth at its tail.
//!
//! **Dynamic space.** A request the plan does not serve at its planned offset (the
//! cursor calls it unplanned, or its planned range is occupied: a *conflict*) is
//! placed in a **hole** of the pool — a free block, best fit first, in the smallest gap
//! between the ranges that the next [`PlanOptions::hole_horizon`] expected requests are
//! planned on (with several iteration classes, also every other class's first
//! `hole_horizon` and large requests for an unplanned request, and all of them for one
//! taken to live forever: the next iteration may be of any class) (so the hole stays
//! free long enough for what is coming; flush with the block's end when the gap reaches
//! it). Work the plan never saw — an evaluation pass,
//! the post-training checkpoint — thus lands between the first requests of the next
//! iteration instead of growing the pool. Inside a phase (marked, or an unmarked pass the
//! plan never saw, detected at an iteration start: module `plan_serving`, implicit phases) an
//! unplanned request takes any free hole. O(k log k) for the k ranges looked at. A
//! large request with no such hole makes the pool **grow at its tail** (its address
//! range reaches as far as an online arena's; granules are mapped as for an online
//! arena): it goes at the high end of the free tail of the pool plus new granules if
//! the next expected requests do not need that range, else wholly above the mapped end,
//! where nothing is planned. A growth (or a planned range mapped again while the pool is
//! grown) that would map past the peak of reserved bytes first gives the pool's free
//! units back (module `release`, the plan pool). Only small requests without a hole, and requests on
//! streams the plan does not know, go to the online arenas. The placement goes through
//! the same occupancy-checked `alloc_at`, so it can never alias; at worst it makes a
//! later planned request a conflict, which then takes a hole or goes online in turn.

use crate::units::{Bytes, StreamId};

#[cfg(doc)]
use super::PlanOptions;
use super::State;
use super::arena::{Idx, NIL, Placeable, SlabFull};
use super::cursor;
use super::plan_serving::PlanServing;
use super::stream_use::add_use;

/// Free blocks of the pool looked at for one hole placement (best fit first).
const HOLE_CANDIDATES: usize = 8;
/// Expected requests a hole is checked against, at most, for a request whose planned
/// lifetime is known (a conflict).
pub(super) const HOLE_SPAN_CAP: usize = 4096;

/// An unplanned request keeps clear, over a whole iteration, of the planned requests at
/// least this many times its size ([`PlanServing::unplanned_blocked`]): if it outlives
/// its hole's free time, what it displaces is no bigger than this many times itself.
const UNPLANNED_DISPLACE_FACTOR: u64 = 16;

impl PlanServing {
    /// Whether a request on `stream` may take the hole `[lo, lo + len)` (offsets): on a
    /// multi-stream plan no other stream plans anything there, and no expected request
    /// coming before the request's planned end (a conflict: its lifetime is known; one
    /// taken to live forever is checked against a whole prologue and iteration), or
    /// among the next `hole_horizon` (an unplanned request), is planned on it.
    /// Fills `blocked` with the ranges (offsets) of the expected requests a hole must
    /// avoid for the request being served (those [`PlanServing::hole_ok`] checks), sorted
    /// by start. O(k log k) for k of them.
    /// On a multi-stream plan, every range another stream than `plan_stream` (the
    /// request's, `None` if unbound: all streams) ever plans on is blocked too.
    fn collect_blocked(&mut self, plan_stream: Option<StreamId>, len: u64) {
        let mut v = std::mem::take(&mut self.blocked);
        v.clear();
        let range = |e: &cursor::Expected| (e.offset.get(), e.offset.get() + e.len);
        match self.until {
            Some(u64::MAX) => v.extend(
                self.cursor
                    .upcoming(self.cursor.len())
                    .chain(self.cursor.other_classes())
                    .map(range),
            ),
            Some(until) => v.extend(self.cursor.upcoming_until(until, HOLE_SPAN_CAP).map(range)),
            None => v.extend(self.unplanned_blocked(len).map(range)),
        }
        if self.multi_stream() {
            for (s, u) in &self.streams {
                if Some(*s) != plan_stream {
                    v.extend_from_slice(u);
                }
            }
        }
        v.sort_unstable();
        self.blocked = v;
    }

    /// The best-fitting place for `len` bytes in the free range `[lo, hi)` (offsets)
    /// that avoids every range of `blocked` (filled by
    /// [`PlanServing::collect_blocked`]): the low end of the smallest gap between
    /// blocked ranges that holds it, or `None`. O(k) for the k blocked ranges that start
    /// below `hi`.
    fn gap_in(&self, lo: u64, hi: u64, len: u64) -> Option<u64> {
        let mut cur = lo;
        let mut best: Option<(u64, u64, u64)> = None; // (slack, gap start, gap end)
        let mut consider = |a: u64, z: u64| {
            if z >= a + len {
                let slack = z - a - len;
                if best.is_none_or(|(s, _, _)| slack < s) {
                    best = Some((slack, a, z));
                }
            }
        };
        // Sorted by start: a range before `lo` may still reach into [lo, hi).
        for &(a, z) in &self.blocked {
            if a >= hi || cur >= hi {
                break;
            }
            if z <= cur {
                continue;
            }
            if a > cur {
                consider(cur, a);
            }
            cur = z;
        }
        if cur < hi {
            consider(cur, hi);
        }
        // Flush with an end of the free block when the gap reaches one (the rest of the
        // block stays in one piece), else at the gap's low end.
        best.map(|(_, a, z)| if a != lo && z == hi { hi - len } else { a })
    }

    /// The expected requests an unplanned request of `len` bytes must keep clear of: the
    /// next `hole_horizon`, and over the next iteration's worth every one at least
    /// [`UNPLANNED_DISPLACE_FACTOR`] times its size. An unplanned request's lifetime is
    /// unknown, and the ones a plan leaves may outlive their iteration (the loss a loop
    /// keeps, a tensor living into the next step): one in a hole that a much larger request
    /// planned later needs sends that request to the pool's tail. Clearing every planned
    /// request of the cycle instead sends the short-lived unplanned requests of a plan's
    /// tail iteration online. Both measured: BENCHMARKS.md, "Moved from engine/mod.rs
    /// module docs". With several iteration classes, every other class's section too,
    /// kept clear of as the own class's next iteration (its first `hole_horizon`
    /// requests, the large ones of the rest): an unplanned tensor that outlives its
    /// iteration (the batch or the loss a loop keeps) must not sit where the next
    /// iteration's class, whichever it is, plans its largest tensors (len5's auto
    /// replay: 1.0082 x the lower bound without this, 1.0012 x with it; with a length
    /// never recorded every fifth iteration, 1.174 x and 1.001 x).
    fn unplanned_blocked(&self, len: u64) -> impl Iterator<Item = &cursor::Expected> + '_ {
        // One iteration ahead (a prologue-only plan, an aperiodic run, has none: its
        // unplanned requests are the irregular ones, short-lived), at most HOLE_SPAN_CAP.
        // Inside a phase, marked or implicit, nothing: its requests are gone before the
        // plan resumes (module `plan_serving`, phases).
        let (near, cycle) = if self.phase_depth > 0 || self.implicit.on {
            (0, 0)
        } else {
            let cycle = self.cursor.iteration_requests().min(HOLE_SPAN_CAP);
            (self.options.hole_horizon, cycle)
        };
        let large =
            move |e: &&cursor::Expected| e.len >= len.saturating_mul(UNPLANNED_DISPLACE_FACTOR);
        // With several iteration classes the next iteration may be any of them: every
        // other class's section as the own class's is kept clear of, its first
        // `near` requests all and the large ones of the rest. (With the large ones
        // alone, a loss left in a hole at the end of one class's forward sat where the
        // next iteration, of another class, planned a small activation: a conflict in
        // every such iteration; class_planning's proptest, CI stop 33.)
        let others = (cycle > 0)
            .then(|| {
                self.cursor
                    .other_classes_indexed()
                    .filter(move |(k, e)| *k < near || large(e))
                    .map(|(_, e)| e)
            })
            .into_iter()
            .flatten();
        self.cursor
            .upcoming(near.max(cycle))
            .enumerate()
            .filter(move |(k, e)| *k < near || large(e))
            .map(|(_, e)| e)
            .chain(others)
    }

    fn hole_ok(&self, stream: StreamId, lo: u64, len: u64) -> bool {
        let hi = lo + len;
        let clear = |e: &cursor::Expected| e.offset.get() >= hi || e.offset.get() + e.len <= lo;
        (!self.multi_stream() || self.exclusive(stream, lo, hi))
            && match self.until {
                Some(u64::MAX) => self
                    .cursor
                    .upcoming(self.cursor.len())
                    .chain(self.cursor.other_classes())
                    .all(clear),
                Some(until) => self.cursor.upcoming_until(until, HOLE_SPAN_CAP).all(clear),
                None => self.unplanned_blocked(len).all(clear),
            }
    }
}

impl State {
    /// The last resort before the plan is given up at the memory limit
    /// ([`super::Engine::map_pool_range`]): a free hole of the pool for the request
    /// wherever one fits, kept clear of nothing the plan expects next (a planned
    /// request there later is a conflict and takes a hole in turn; at a boundary a plan
    /// with too many conflicts is still given up). A multi-stream plan's other
    /// streams' ranges stay out of bounds. `alloc_in_hole`'s cost.
    pub(super) fn alloc_in_any_hole(
        &mut self,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<Option<Idx>, SlabFull> {
        let Some(p) = self.plan.as_mut() else {
            return Ok(None);
        };
        // Clear of the requests planned to start before tick 0: of none. (`until` is the
        // request's own: every request sets it before a hole search.)
        p.until = Some(0);
        self.alloc_in_hole(size, rounded, stream)
    }

    /// A free hole of the plan's pool for a request the plan does not serve: the free
    /// blocks that fit, best fit first, each tried at its low then its high end.
    pub(super) fn alloc_in_hole(
        &mut self,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<Option<Idx>, SlabFull> {
        let State { plan, arenas, .. } = self;
        let Some(p) = plan.as_mut() else {
            return Ok(None);
        };
        if !p.options.holes {
            return Ok(None);
        }
        let ps = p.to_plan(stream);
        // Two passes over the best-fitting free blocks: first their ends alone (cheap:
        // no sorting), then the smallest gap inside each between the ranges the coming
        // requests need.
        for gaps in [false, true] {
            if gaps {
                p.collect_blocked(ps, rounded);
            }
            let mut key = (rounded, 0);
            for _ in 0..HOLE_CANDIDATES {
                let b = arenas.fit_at_least(p.arena, key);
                if b == NIL {
                    break;
                }
                let (ba, bs) = (arenas.block(b).addr, arenas.block(b).size);
                key = (bs, ba + 1);
                let (lo, hi) = (ba - p.base, ba + bs - p.base);
                let at = if gaps {
                    p.gap_in(lo, hi, rounded)
                } else {
                    [lo, hi - rounded]
                        .into_iter()
                        .find(|&off| ps.is_some_and(|ps| p.hole_ok(ps, off, rounded)))
                };
                let Some(off) = at else {
                    continue;
                };
                if p.multi_stream() && !ps.is_some_and(|ps| p.exclusive(ps, off, off + rounded)) {
                    continue;
                }
                if let Some(i) = arenas.alloc_at(p.arena, p.base + off, rounded, size.get())? {
                    // The next user of this range may be on another stream, unless the
                    // range lies wholly in what this stream plans on (other streams'
                    // requests, planned or not, never go there: they need ranges
                    // exclusive to their own stream).
                    if p.multi_stream() && !ps.is_some_and(|ps| p.own(ps, off, off + rounded)) {
                        add_use(&mut arenas.block_mut(i).uses, stream);
                    }
                    p.cursor.stats.holes += 1;
                    return Ok(Some(i));
                }
            }
        }
        Ok(None)
    }

    /// Where a large request the pool has no hole for goes when the pool grows at its
    /// tail: `(pool arena, bytes the tail run must hold, address)`. The block is put at
    /// the high end of the tail run if the next expected requests do not need that
    /// range, else wholly above the mapped end (never planned on). `None` without a
    /// plan serving `stream` with holes on.
    pub(super) fn pool_growth(&self, rounded: u64, stream: StreamId) -> Option<u64> {
        let p = self.plan.as_ref()?;
        let ps = p.to_plan(stream)?;
        if !p.options.holes {
            return None;
        }
        if p.cursor.spent() {
            // Nothing planned any more: the pool grows as an online arena does, at
            // its lowest run of free and unmapped space.
            return self.arenas.lowest_run(p.arena, rounded);
        }
        let (free_start, end) = self.arenas.tail_run(p.arena)?;
        let planned_end = p.base + p.len;
        // The free tail (and the unmapped space after it) if the next expected requests
        // do not need it, else above both the mapped end and the planned part.
        let at = if free_start < end && p.hole_ok(ps, free_start - p.base, rounded) {
            free_start
        } else {
            end.max(planned_end)
        };
        (self.arenas.placeable(p.arena, at, rounded) != Placeable::Occupied).then_some(at)
    }

    /// Places a request at `at` in the pool arena after it grew (`None` if another
    /// thread took the range meanwhile).
    pub(super) fn alloc_grown(
        &mut self,
        at: u64,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<Option<Idx>, SlabFull> {
        let Some(pa) = self.plan.as_ref().map(|p| p.arena) else {
            return Ok(None);
        };
        let placed = self.arenas.alloc_at(pa, at, rounded, size.get())?;
        if let Some(i) = placed
            && let Some(p) = self.plan.as_mut()
        {
            p.cursor.stats.holes += 1;
            p.cursor.stats.grown += 1;
            if p.multi_stream() {
                // As for any hole: the next user may be on another stream.
                add_use(&mut self.arenas.block_mut(i).uses, stream);
            }
        }
        Ok(placed)
    }
}
