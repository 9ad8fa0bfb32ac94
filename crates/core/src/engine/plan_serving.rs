//! Plan mode: serving a loaded plan's requests at their planned offsets.
//!
//! [`Engine::load_plan`] reserves a verified plan's pool as one more arena beside the
//! online ones: a *placement* arena (blocks go at given offsets, not by best fit;
//! pinned, so `empty_cache` leaves it mapped). Its granules are mapped when a request
//! first needs them, so reserved memory follows what the run has reached of the plan.
//! Each request on one of the plan's streams is first offered to the plan's cursor
//! (module `cursor`: a small beam of alignments between the run and the plan's request
//! sequence, look-ahead across section ends, resynchronisation at `mark_iteration`); a
//! planned offset is handed out only if its whole range lies inside one free block of
//! the pool — since free blocks are always coalesced, that is exactly "nothing live
//! occupies it" (invariant 1).
//!
//! What the plan does not serve at its planned offset takes a hole of the pool or
//! grows it (module `plan_holes`), or waits for the pending frees that alone hold its
//! range (module `pending`); the rest is served online (module `malloc`).
//!
//! **Streams.** The pool may serve several streams. Per stream, the union of the pool
//! ranges its planned requests use is computed at load (module `plan_pool`). A
//! planned request whose range another stream also plans on is freed through the
//! stream-deferred free machinery (an event on its own stream, as `record_stream`
//! does for other streams), so the next user of the range, on whatever stream, cannot
//! overtake the work queued before the free; a request no other stream plans on is
//! reused in its stream's own order, which needs no event. On a multi-stream plan a
//! request takes a hole only where no other stream plans anything, and its free is
//! always deferred. Requests on streams the plan does not know are served online.
//!
//! **A spent plan** — a prologue-only plan the run has gone past — has nothing left to
//! say: at the next iteration boundary its pool's free granules are given back, and
//! from then on a large request without a hole grows the pool at its lowest run of
//! free and unmapped space, as an online arena grows before any release.
//!
//! **Switching mid-run** (auto mode: trace the first iterations online, plan them
//! elsewhere, switch): [`Engine::switch_to_plan`] serves the plan's steady iteration
//! only ([`steady_slice`]), with the online phase's live allocations left where they
//! are, after giving cached online memory back.
//!
//! Frees, stream-deferred frees, stats and the trace treat plan blocks like any other:
//! the pointer map, the slab and the stats are shared. [`PlanStats`] counts hits,
//! conflicts, unplanned requests, hole placements and skipped expected requests.
//!
//! [`Engine::unload_plan`] stops serving a plan; its blocks stay until freed and its
//! pool is then given back like an online arena. The pool's free blocks are indexed
//! by address in a second treap threaded through the slab (no heap allocation); its
//! size-keyed fit treap, which only the hole search and the pool's growth rules query,
//! is dropped during long runs of plan hits and rebuilt at the next query (module
//! `arena::free_index`, lazy fit index).
//!
//! At each iteration boundary ([`Engine::mark_iteration`]) the cursor resynchronises,
//! a plan whose requests keep finding their ranges busy is given up
//! ([`PlanOptions::give_up_conflict_percent`]), and a spent plan's pool gives back its
//! free granules.
//!
//! # Phases
//!
//! A phase marker (`Engine::mark` with `PhaseBegin` / `PhaseEnd`: `stweaver.phase("eval")`
//! around an eval pass or a checkpoint save between two iterations) that begins at an
//! iteration start (a boundary just marked, nothing matched since) takes the phase's
//! requests off the plan: the cursor's alignment is bookmarked at the begin, every
//! request inside is unplanned and goes to any free hole of the pool (the upcoming
//! planned ranges are not kept clear: the phase's tensors are gone when it ends), and
//! the end resumes the bookmark, so the next iteration matches from where the plan was
//! left. A phase that begins inside an iteration (a profiler's `Optimizer.step`
//! annotation in a snapshot) was recorded with the iteration and stays planned. An
//! iteration boundary inside a phase ends it.
//!
//! Without markers, an eval forward of the training shapes matches the iteration's
//! forward; the cursor's *restart* step (`cursor.rs`) then takes the training forward
//! back to the iteration's start. On 200 iterations with an eval every 10 (an H100
//! trace, `crates/planner/tests/long_loops.rs`): 1.30 x the lower bound before either,
//! 1.006 x with restarts alone, 1.004 x with the phase marked.
//!
//! # Implicit phases
//!
//! An unmarked pass of shapes the plan never saw (an eval of another batch size) matches
//! nothing: its requests are unplanned, and an unplanned request keeps clear of the
//! next iteration's planned ranges (module `plan_holes`), which at an iteration start
//! cover most of the pool, so the pass's large tensors grew the pool (the eval above at
//! 1.5 x the batch: 1.334 x the lower bound). So an *implicit phase* is detected
//! ([`ImplicitPhase`], O(1) per request): after a boundary that put the cursor at an
//! iteration start, [`IMPLICIT_PHASE_RUN`] (8) unplanned requests in a row, with no
//! run of [`IMPLICIT_PHASE_FOLLOWED`] (8) hits since the boundary, begin one; until
//! 8 hits in a row (the run follows the plan again) or the next boundary, unplanned
//! requests take any free hole of the pool, as in a marked phase (a stray hit inside
//! the pass, a tensor of a size the iteration has too, does not end it). The cursor
//! is not bookmarked: it is fed every request as before (its inserts keep the
//! position it left from, its restarts bring a drifted alignment back), so nothing
//! changes for requests it matches. The eval above: 1.006 x, as the unmarked eval of
//! the training shapes.
//!
//! With several iteration classes (`Plan::extra_classes`), an iteration whose first
//! requests match no class (a class the recording never saw: a length bucket first
//! seen after the switch) begins an implicit phase the same way, and the phase lasts to
//! the next boundary: the run of hits that ends one in a plan of one class comes there
//! from the tensors every class has (the gradients), which the cursor places at their
//! planned offsets all the same, while the class's own requests still match nothing;
//! served with every other class's large requests kept clear (module `plan_holes`),
//! they grew the pool instead (len5 with every fifth iteration from 60 at 3/4 of its
//! sizes, a length the recording never had: 1.107 x the lower bound with phases ending
//! at 8 hits, 1.001 x with them lasting to the boundary,
//! `crates/planner/tests/long_loops.rs`).
//!
//! A short run is not a phase: one unplanned request at an iteration start that lives
//! on while the iteration's planned requests come (a batch of a new shape) must keep
//! clear of their ranges, or they find them occupied. Serving every unplanned request
//! at an iteration start from any hole (a run of 1) failed the unit tests of holes and
//! tail growth (`crates/core/tests/engine_plan_pool.rs`) and the H100 Llama replays
//! (1280 conflicts serving the plan without offload; two runs under a budget out of
//! memory); a run of 2 already passes them, 8 leaves a margin and still catches an eval
//! pass within its first batch's inputs. What an implicit phase places is checked like
//! any hole placement (`alloc_at` over a free block, invariant 1): a tensor of it that
//! outlives it makes the planned request on its range a conflict, served in a hole in
//! turn, never an alias. A pass of fewer than 8 requests, or one that begins after 8
//! hits in a row since the boundary, is served as before.

use crate::plan::Plan;
use crate::trace::MarkerKind;
use crate::units::{Bytes, StreamId};

#[cfg(doc)]
use super::PlanStats;
use super::arena::{ALIGNMENT, ArenaId, BlockState, Idx, Placeable, SlabFull};
use super::config::GIVE_UP_MIN_REQUESTS;
use super::cursor::{self, Cursor};
use super::plan_holes::HOLE_SPAN_CAP;
use super::plan_pool::{self, stream_ranges};
use super::stream_use::add_use;
use super::{
    DeviceMemory, Engine, EngineError, GIVE_UP_ITERATIONS, PlanOptions, PoolKind, State, stats,
    steady_slice,
};

/// Iteration boundaries after a switch to a plan during which online memory freed by
/// the online phase's leftovers is given back (see [`Engine::switch_to_plan`]).
const SWITCH_DRAIN_ITERATIONS: u32 = 2;

/// Iterations with conflicts whose counts a served plan keeps
/// ([`Engine::plan_conflicts_seen`]).
pub const CONFLICT_ITERATIONS_KEPT: usize = 32;

/// Where a served plan's conflicts came ([`Engine::plan_conflicts_seen`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConflictsSeen {
    /// The first conflict, described: the request, its planned range, what occupied it,
    /// where the plan's cursor was.
    pub first: Option<String>,
    /// `(iteration, conflicts)` for the first [`CONFLICT_ITERATIONS_KEPT`] iterations
    /// that had any (0: the prologue, before the first iteration boundary).
    pub by_iteration: Vec<(u64, u64)>,
}

/// What the plan pool answers to a request ([`State::alloc_planned`]).
pub(super) enum PlanAnswer {
    /// A block, placed.
    Placed(Idx),
    /// The planned place `addr` of `e` is free but partly unmapped: map it, then place.
    Map { addr: u64, e: cursor::Expected },
    /// The planned place `addr` of `e` is occupied while frees wait for other streams'
    /// events: if only those hold it, wait for them and place; else a conflict.
    Busy { addr: u64, e: cursor::Expected },
    /// Nothing: serve online.
    Nothing,
}

/// A plan being served: its cursor and the placement arena of its pool.
#[derive(Debug)]
pub(super) struct PlanServing {
    pub(super) cursor: Cursor,
    pub(super) arena: ArenaId,
    pub(super) base: u64,
    /// Bytes of the planned part of the pool (granule multiple); the arena reaches
    /// further, for growth at the tail.
    pub(super) len: u64,
    /// The plan's streams, each with the union of its requests' pool ranges (offsets,
    /// sorted, disjoint).
    pub(super) streams: plan_pool::StreamRanges,
    pub(super) options: PlanOptions,
    /// The pool's free granules were given back once the plan was spent.
    released: bool,
    /// For the request being served: the virtual tick until which a hole must stay
    /// free (its planned end, for a conflict), or `None` (unplanned: the next
    /// `hole_horizon` expected requests).
    pub(super) until: Option<u64>,
    /// Scratch for [`PlanServing::collect_blocked`]: the pool ranges the expected
    /// requests a hole must avoid, sorted. Its capacity is reserved at load, so a miss
    /// does not allocate.
    pub(super) blocked: Vec<(u64, u64)>,
    /// Run streams bound to the plan's streams, `(run, plan)`. Stream handles are
    /// process-local (a side stream's `cudaStream_t` differs between the run that was
    /// traced and the one served), so the plan's streams are bound to the run's as they
    /// first show up ([`PlanServing::bind`]); the plan's own ids are used inside the plan
    /// (cursor, stream ranges), the run's for events.
    bound: Vec<(StreamId, StreamId)>,
    /// Hits and conflicts at the last iteration boundary, and the iterations in a row
    /// with too many conflicts since ([`PlanOptions::give_up_conflict_percent`]).
    at_boundary: (u64, u64),
    bad_iterations: u32,
    /// The planned range `(addr, len)` of the last conflict, until taken
    /// ([`Engine::take_last_conflict`]: what occupied it, for a replay's report).
    pub(super) last_conflict: Option<(u64, u64)>,
    /// The first conflict of the plan, described (the request, its planned range, what
    /// occupied it, where the cursor was): a give-up's message carries it, and
    /// [`Engine::plan_conflicts_seen`] reports it.
    first_conflict: Option<String>,
    /// `(iteration, conflicts)` for the first [`CONFLICT_ITERATIONS_KEPT`] iterations
    /// that had any, in order (the iteration as [`cursor::PlanStats::iterations`]
    /// counts it when the conflict came: 0 is the prologue).
    conflict_iterations: Vec<(u64, u64)>,
    /// Open phases (`PhaseBegin` markers not closed yet) and the cursor's alignment
    /// when the outermost one began (module docs, phases).
    pub(super) phase_depth: u32,
    phase_mark: Option<cursor::Bookmark>,
    /// An unmarked pass detected at an iteration start (module docs, implicit phases).
    pub(super) implicit: ImplicitPhase,
}

/// Unplanned requests in a row, from an iteration start with no run of
/// [`IMPLICIT_PHASE_FOLLOWED`] hits since, that begin an implicit phase (module docs).
pub(super) const IMPLICIT_PHASE_RUN: u32 = 8;
/// Hits in a row after which the run is taken to follow the plan again: no implicit
/// phase begins before the next iteration boundary.
pub(super) const IMPLICIT_PHASE_FOLLOWED: u32 = 8;

/// The state of the implicit-phase detector (module docs, implicit phases). O(1) per
/// request.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct ImplicitPhase {
    /// Serving an implicit phase: unplanned requests take any free hole.
    pub(super) on: bool,
    /// The run follows the plan in this iteration (or the cursor is not at an iteration
    /// start of the plan's iteration section): no implicit phase may begin.
    following: bool,
    /// Unplanned requests in a row, and hits in a row.
    unplanned: u32,
    hits: u32,
    /// The plan has several iteration classes: a phase, once begun, lasts to the next
    /// boundary (module docs, implicit phases).
    sticky: bool,
}

impl ImplicitPhase {
    /// The detector just after a boundary; `at_start`: the cursor stands at an
    /// iteration start of the iteration section.
    fn after_boundary(at_start: bool, sticky: bool) -> ImplicitPhase {
        ImplicitPhase {
            following: !at_start,
            sticky,
            ..ImplicitPhase::default()
        }
    }

    /// The cursor matched a request (a hit or a conflict). After
    /// [`IMPLICIT_PHASE_FOLLOWED`] in a row the run follows the plan again: an implicit
    /// phase ends, and no other begins before the next boundary. (A stray match inside
    /// the pass, a tensor of a size the iteration has too, does not end it.)
    #[inline]
    fn matched(&mut self) {
        self.unplanned = 0;
        self.hits = self.hits.saturating_add(1);
        if self.hits >= IMPLICIT_PHASE_FOLLOWED && !(self.on && self.sticky) {
            self.following = true;
            self.on = false;
        }
    }

    /// The cursor called a request unplanned.
    #[inline]
    fn unmatched(&mut self) {
        self.hits = 0;
        self.unplanned = self.unplanned.saturating_add(1);
        if !self.following && self.unplanned >= IMPLICIT_PHASE_RUN {
            self.on = true;
        }
    }
}

/// Whether the sorted disjoint ranges `union` meet `[lo, hi)`. O(log n).
fn meets(union: &[(u64, u64)], lo: u64, hi: u64) -> bool {
    let i = union.partition_point(|&(a, _)| a < hi);
    i > 0 && union[i - 1].1 > lo
}

impl PlanServing {
    /// Where this plan's conflicts came (for [`Engine::plan_conflicts_seen`]).
    pub(super) fn conflicts_seen(&self) -> ConflictsSeen {
        ConflictsSeen {
            first: self.first_conflict.clone(),
            by_iteration: self.conflict_iterations.clone(),
        }
    }

    /// A phase begins (a `PhaseBegin` marker: `stweaver.phase("eval")`) at an iteration
    /// start: the cursor's alignment is kept, and until the phase ends every request is
    /// served beside the plan (module docs, phases). Nested phases count; a phase that
    /// begins inside an iteration is left to the plan.
    pub(super) fn begin_phase(&mut self) {
        if self.phase_depth == 0 {
            if !self.cursor.at_iteration_start() {
                // Inside an iteration: part of what was planned (a profiler annotation
                // such as `Optimizer.step` in a snapshot), served as planned.
                return;
            }
            self.phase_mark = Some(self.cursor.bookmark());
        }
        self.phase_depth += 1;
    }

    /// A phase ends (`PhaseEnd`): the outermost one puts the cursor back where the
    /// phase found it. An end without a begin changes nothing.
    pub(super) fn end_phase(&mut self) {
        if self.phase_depth == 0 {
            return;
        }
        self.phase_depth -= 1;
        if self.phase_depth == 0
            && let Some(b) = self.phase_mark.take()
        {
            self.cursor.resume(b);
        }
    }

    /// Whether the plan has stream `plan_stream` (a plan id).
    fn serves(&self, plan_stream: StreamId) -> bool {
        self.streams.iter().any(|(s, _)| *s == plan_stream)
    }

    /// The plan stream run stream `run` is bound to, if any.
    #[inline]
    pub(super) fn to_plan(&self, run: StreamId) -> Option<StreamId> {
        self.bound.iter().find(|(r, _)| *r == run).map(|&(_, p)| p)
    }

    /// The plan stream for a request of `size` bytes on run stream `run`, binding the
    /// two at the first request: the same id if the plan has it and it is free (the
    /// default stream; auto mode, same process), else the stream of the expected
    /// request if that stream is unbound and the sizes agree. `None`: a stream the plan
    /// does not serve. O(streams).
    #[inline]
    fn bind(&mut self, run: StreamId, size: u64) -> Option<StreamId> {
        if let Some(p) = self.to_plan(run) {
            return Some(p);
        }
        let free = |p: StreamId, b: &[(StreamId, StreamId)]| b.iter().all(|&(_, q)| q != p);
        let p = if self.serves(run) && free(run, &self.bound) {
            run
        } else {
            let e = self.cursor.peek()?;
            if e.size != size || !free(e.stream, &self.bound) {
                return None;
            }
            e.stream
        };
        self.bound.push((run, p));
        Some(p)
    }

    pub(super) fn multi_stream(&self) -> bool {
        self.streams.len() > 1
    }

    /// Whether `[lo, hi)` (offsets) lies wholly inside the ranges plan stream `s`
    /// plans on. O(log n).
    pub(super) fn own(&self, s: StreamId, lo: u64, hi: u64) -> bool {
        self.streams
            .iter()
            .find(|(x, _)| *x == s)
            .is_some_and(|(_, u)| {
                let i = u.partition_point(|&(a, _)| a <= lo);
                i > 0 && u[i - 1].1 >= hi
            })
    }

    /// Whether no other stream's planned request ever touches `[lo, hi)` (offsets).
    pub(super) fn exclusive(&self, stream: StreamId, lo: u64, hi: u64) -> bool {
        self.streams
            .iter()
            .all(|(s, u)| *s == stream || !meets(u, lo, hi))
    }
}

impl State {
    /// The plan pool's answer to a request: its planned place if the plan has one and
    /// nothing occupies it, else a free hole of the pool that the next expected
    /// requests do not need (module docs), else nothing.
    #[inline]
    pub(super) fn alloc_planned(
        &mut self,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<PlanAnswer, SlabFull> {
        let Some(p) = self.plan.as_mut() else {
            return Ok(PlanAnswer::Nothing);
        };
        let Some(ps) = p.bind(stream, size.get()) else {
            return Ok(PlanAnswer::Nothing);
        };
        if p.phase_depth > 0 {
            // Inside a phase: beside the plan, in any free hole of the pool (the phase's
            // requests are gone when it ends and the cursor resumes).
            p.cursor.stats.unplanned += 1;
            p.until = None;
            return Ok(match self.alloc_in_hole(size, rounded, stream)? {
                Some(i) => PlanAnswer::Placed(i),
                None => PlanAnswer::Nothing,
            });
        }
        // Where the plan was before this request (for `until` below).
        let before = p.cursor.best_pos();
        if let Some(e) = p.cursor.next(size.get(), ps) {
            p.implicit.matched();
            let (arena, addr) = (p.arena, p.base + e.offset.get());
            // The common case first: the range is mapped and free.
            if let Some(i) = self.arenas.alloc_at(arena, addr, rounded, size.get())? {
                self.planned_block(i, e.cross, stream);
                return Ok(PlanAnswer::Placed(i));
            }
            if self.arenas.placeable(arena, addr, rounded) == Placeable::NeedsMapping {
                // First use of these granules: the caller maps them.
                return Ok(PlanAnswer::Map { addr, e });
            }
            // (Read here, off the hit path: only an occupied range asks.)
            let wait = self
                .plan
                .as_ref()
                .is_some_and(|p| p.options.wait_for_pending_frees);
            if wait && !self.events.is_empty() {
                return Ok(PlanAnswer::Busy { addr, e });
            }
            // A conflict: its hole must stay free until its planned end.
            self.plan_conflict(&e, addr);
        } else {
            // An unplanned request where the plan expected a tensor that lives forever
            // (setup: parameters, optimizer state) is taken to live forever too. (`until`
            // is read only by the hole search and the pool's growth for this request,
            // which a conflict and a failed mapping set it for.)
            p.until = p.cursor.lives_forever_at(before).then_some(u64::MAX);
            p.implicit.unmatched();
        }
        Ok(match self.alloc_in_hole(size, rounded, stream)? {
            Some(i) => PlanAnswer::Placed(i),
            None => PlanAnswer::Nothing,
        })
    }

    /// Block `i` was just placed at its planned offset.
    #[inline]
    pub(super) fn planned_block(&mut self, i: Idx, cross: bool, stream: StreamId) {
        if cross {
            // Another stream plans on this range: the free waits for ours.
            add_use(&mut self.arenas.block_mut(i).uses, stream);
        }
    }

    /// The planned range of `e` was occupied: counted as a conflict, and a hole for it
    /// must stay free until its planned end.
    pub(super) fn plan_conflict(&mut self, e: &cursor::Expected, addr: u64) {
        let State { plan, arenas, .. } = self;
        if let Some(p) = plan.as_mut() {
            p.cursor.conflict();
            p.until = Some(e.vend);
            p.last_conflict = Some((addr, e.len));
            let it = p.cursor.stats.iterations;
            let seen = &mut p.conflict_iterations;
            if let Some((i, n)) = seen.last_mut()
                && *i == it
            {
                *n += 1;
            } else if seen.len() < CONFLICT_ITERATIONS_KEPT {
                seen.push((it, 1));
            }
            if p.first_conflict.is_none() {
                // Once per plan, off the hit path: a walk over the pool's blocks.
                let (lo, hi) = (addr, addr + e.len);
                let held: Vec<String> = arenas
                    .arena_blocks(p.arena)
                    .filter(|(_, b)| b.addr < hi && b.addr + b.size > lo)
                    .filter(|(_, b)| b.state != BlockState::Free)
                    .take(3)
                    .map(|(_, b)| {
                        format!(
                            "{:?} {} at +{}{}",
                            b.state,
                            Bytes(b.size),
                            b.addr - p.base,
                            if b.uses.is_empty() {
                                ""
                            } else {
                                " (used by other streams)"
                            }
                        )
                    })
                    .collect();
                let (section, index) = p.cursor.position();
                p.first_conflict = Some(format!(
                    "a request of {} planned at +{} ({section:?} request {index}, {} iterations served) found {}",
                    Bytes(e.size),
                    e.offset.get(),
                    p.cursor.stats.iterations,
                    if held.is_empty() {
                        "its range partly unmapped or being mapped".to_string()
                    } else {
                        held.join(", ")
                    }
                ));
            }
        }
    }

    /// Stops serving the plan, if one is served (returns whether one was): its blocks
    /// stay until freed, its pool is unpinned so that it goes back like an online arena,
    /// and a switch's drain ends. `why`: the plan was given up mid-run
    /// ([`Engine::plan_abandoned`]).
    pub(super) fn stop_plan(&mut self, why: Option<String>) -> bool {
        let Some(p) = self.plan.take() else {
            return false;
        };
        self.arenas.unpin(p.arena);
        self.drain = 0;
        self.drain_pending = false;
        // Kept for the next plan (auto mode replaces its plan by one with more classes).
        self.learned_keys = p.cursor.learned_keys();
        if let Some(why) = why {
            self.abandoned = Some(match p.first_conflict {
                Some(c) => format!("{why}; first conflict: {c}"),
                None => why,
            });
        }
        true
    }
}

impl<D: DeviceMemory> Engine<D> {
    /// Starts serving `plan`: verifies it ([`crate::verify::verify_plan`]), reserves and
    /// maps its pool (one large-pool segment, pinned: `empty_cache` leaves it mapped), and
    /// from then on offers every request on the plan's stream to the plan's cursor
    /// first. A planned offset is used only if nothing live occupies its range;
    /// everything else is served online, as before.
    ///
    /// A plan whose requests span several streams is served with the stream rules of
    /// the module docs. A plan for another device, a second plan, or a pool
    /// larger than the memory limit itself is rejected. The pool is mapped granule by
    /// granule as the run reaches it, so a pool that fits the limit only once the
    /// memory held now is freed (auto mode under `set_per_process_memory_fraction`) is
    /// accepted; if mapping a planned range ever hits the limit, the plan is given up
    /// ([`Engine::unload_plan`]; [`Engine::plan_abandoned`] says why) and the run goes
    /// on online, where the usual free-the-cache-and-retry path applies.
    pub fn load_plan(&self, plan: &Plan, options: PlanOptions) -> Result<(), EngineError> {
        let reject = |m: String| Err(EngineError::PlanRejected(m));
        if let Err(v) = crate::verify::verify_plan(plan) {
            return reject(v.to_string());
        }
        if plan.device != self.device {
            return reject(format!("made for {}, serving {}", plan.device, self.device));
        }
        if plan.alignment.get() < ALIGNMENT {
            return reject(format!("alignment {} below 512 B", plan.alignment));
        }
        if plan.prologue.is_empty() && plan.iteration.is_empty() {
            return reject("no requests".into());
        }
        let (streams, cross) = stream_ranges(plan);
        let len = plan
            .pool_size
            .get()
            .max(ALIGNMENT)
            .div_ceil(self.granule)
            .saturating_mul(self.granule);
        {
            let mut st = self.lock()?;
            if st.plan.is_some() {
                return reject("a plan is already being served".into());
            }
            if len > st.limit {
                return reject(format!(
                    "pool of {} does not fit the memory limit {}",
                    Bytes(len),
                    Bytes(st.limit),
                ));
            }
            st.abandoned = None;
            st.mapping += len;
        }
        // The pool's address range reaches past the pool, as far as an online arena's,
        // so that it can grow at its tail (module `plan_holes`). Nothing is
        // mapped yet: each granule is mapped when a request first needs it, so memory
        // is taken as the run reaches it (after a switch mid-run, while the online
        // phase's leftovers are still being freed).
        let vlen = len.max(self.arena_size);
        let reserved_va = self.dev.reserve(Bytes(vlen));
        let mut st = self.lock()?;
        st.mapping -= len;
        let base = reserved_va?;
        // The pool's arena is listed under the plan's first stream (snapshots, stats);
        // it is never reached through `arena_of`, so any stream may be served from it.
        let arena = st
            .arenas
            .add_placement_arena(streams[0].0, PoolKind::Large, base.get(), vlen)
            .map_err(EngineError::from);
        let arena = match arena {
            Ok(a) => a,
            Err(e) => {
                drop(st);
                let _ = self.dev.release(base, Bytes(vlen));
                return Err(e);
            }
        };
        stats::increase(&mut st.stats.segment, PoolKind::Large, 1);
        let mut cursor = Cursor::new(plan, options.window, &cross);
        // What the last plan learned about keys, for the classes this one has too; and,
        // loaded at an iteration boundary (a switch), the iteration in progress may have
        // a key already.
        if let Some(l) = st.learned_keys.take() {
            cursor.adopt_keys(&l);
        }
        if let Some(k) = st.iteration_key {
            cursor.set_key(k);
        }
        let stream_ranges: usize = streams.iter().map(|(_, u)| u.len()).sum();
        // With several classes a hole also keeps clear of the other classes' requests
        // (module `plan_holes`): room for all of them, so that a miss never allocates.
        let others: usize = if plan.class_count() > 1 {
            plan.class_requests().count()
        } else {
            0
        };
        let blocked = Vec::with_capacity(
            HOLE_SPAN_CAP.max(options.hole_horizon).max(cursor.len()) + others + stream_ranges,
        );
        st.plan = Some(PlanServing {
            cursor,
            arena,
            base: base.get(),
            len,
            streams,
            options,
            released: false,
            until: None,
            blocked,
            bound: Vec::new(),
            at_boundary: (0, 0),
            bad_iterations: 0,
            last_conflict: None,
            first_conflict: None,
            conflict_iterations: Vec::new(),
            phase_depth: 0,
            phase_mark: None,
            implicit: ImplicitPhase::after_boundary(false, plan.class_count() > 1),
        });
        Ok(())
    }

    /// Switches a running engine to `plan` at an iteration boundary (auto mode: the
    /// engine served the first iterations online, recording them; the plan was made
    /// from that recording elsewhere). What the online phase allocated stays where it
    /// is, in the online arenas, and keeps being served there until freed; the plan's
    /// prologue — what the run already did — is not replayed: only its steady
    /// iteration is served ([`steady_slice`]: the iteration section, with the pool
    /// ranges no iteration request uses, such as the persistent tensors' room, squeezed
    /// out). Cached online memory is released first, so that the pool replaces it
    /// rather than adds to it; and until the second iteration boundary after the switch,
    /// online memory freed (the online phase's tensors that cross into the first
    /// iterations, such as gradients freed by the next `zero_grad`) is given back at the
    /// next `malloc` or boundary, so that the pool and those leftovers are not counted
    /// twice for longer than they live. The cursor starts at the beginning of an
    /// iteration, so call this right after [`Engine::mark_iteration`].
    ///
    /// A plan without an iteration section, or one [`Engine::load_plan`] refuses, is
    /// rejected and the engine goes on serving online.
    pub fn switch_to_plan(&self, plan: &Plan, options: PlanOptions) -> Result<(), EngineError> {
        let slice = steady_slice(plan).map_err(EngineError::PlanRejected)?;
        if self.lock()?.plan.is_some() {
            return Err(EngineError::PlanRejected(
                "a plan is already being served".into(),
            ));
        }
        self.release_cached()?;
        self.load_plan(&slice, options)?;
        self.lock()?.drain = SWITCH_DRAIN_ITERATIONS;
        Ok(())
    }

    /// Stops serving the plan, if one is served; returns whether one was. Blocks the
    /// plan placed stay where they are until freed (the pointer map is shared), every
    /// later request is served online, and the pool's free granules are given back at
    /// once, the rest as its blocks are freed and the cache is emptied; once wholly free,
    /// its address range is released like an online arena's. Another plan may be
    /// loaded afterwards.
    pub fn unload_plan(&self) -> Result<bool, EngineError> {
        let mut st = self.lock()?;
        if !st.stop_plan(None) {
            return Ok(false);
        }
        drop(st);
        self.release_cached()?;
        Ok(true)
    }

    /// An iteration boundary: recorded as an `IterationBegin` marker in the trace, and
    /// the plan's cursor (if a plan is served) resynchronises to the start of the
    /// iteration section. [`Engine::mark_iteration_keyed`] with no key.
    pub fn mark_iteration(&self) -> Result<(), EngineError> {
        self.mark_iteration_keyed(None)
    }

    /// The key of the iteration in progress is `key` (`stweaver.iteration_key`: the
    /// boundary came from elsewhere, the optimizer hook), as if the last boundary had
    /// been marked with it ([`Engine::mark_iteration_keyed`]): learned from at the
    /// iteration's end; given before the iteration's first planned request, its class
    /// guess begins from the key's class too. Without a plan of several classes the key
    /// is kept (a plan loaded later starts with it) and changes nothing else.
    pub fn set_iteration_key(&self, key: u64) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        st.iteration_key = Some(key);
        if let Some(p) = st.plan.as_mut() {
            p.cursor.set_key(key);
        }
        Ok(())
    }

    /// An iteration boundary ([`Engine::mark_iteration`]) where an iteration of key `key`
    /// begins (`stweaver.step(key)`: an eval pass, a sequence-length bucket). With a plan
    /// of several iteration classes the cursor learns, per key, the class the key's last
    /// well-served iteration was, and begins the class guess of a known key's iteration
    /// from that class (module docs of `cursor`, keyed iterations); a wrong key costs a
    /// few unplanned requests, never an overlap. Without a plan, or with a plan of one
    /// class, the key changes nothing. O(keys) (at most 64, a fixed array), no heap
    /// allocation.
    pub fn mark_iteration_keyed(&self, key: Option<u64>) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        st.iteration_key = key;
        let (recording, live_peak) = (
            st.recorder.is_some(),
            st.stats.requested_bytes[0].peak as u64,
        );
        st.churn.boundary(recording, live_peak);
        let mut give_up = None;
        if let Some(p) = st.plan.as_mut() {
            // A boundary inside a phase ends it: the run is back in its iterations.
            p.phase_depth = 0;
            p.phase_mark = None;
            p.cursor.mark_iteration(key);
            let sticky = p.implicit.sticky;
            p.implicit = ImplicitPhase::after_boundary(p.cursor.at_iteration_start(), sticky);
            let (h, c) = (p.cursor.stats.hits, p.cursor.stats.conflicts);
            let (dh, dc) = (h - p.at_boundary.0, c - p.at_boundary.1);
            p.at_boundary = (h, c);
            let pct = u64::from(p.options.give_up_conflict_percent);
            if pct > 0 && dh + dc >= GIVE_UP_MIN_REQUESTS && dc * 100 > pct * (dh + dc) {
                p.bad_iterations += 1;
                if p.bad_iterations >= GIVE_UP_ITERATIONS {
                    give_up = Some(format!(
                        "{dc} of {} requests of the last iteration found their planned range \
                         busy (more than {pct} % in {GIVE_UP_ITERATIONS} iterations in a row): \
                         the run does not keep the plan's timing",
                        dh + dc
                    ));
                }
            } else {
                p.bad_iterations = 0;
            }
        }
        let gave_up = give_up.is_some_and(|why| st.stop_plan(Some(why)));
        if let Some(r) = st.recorder.as_mut() {
            r.marker(MarkerKind::IterationBegin, None);
        }
        let mut release = gave_up;
        if st.drain > 0 {
            st.drain -= 1;
            release = std::mem::take(&mut st.drain_pending);
        }
        // A plan whose requests are all behind (a prologue-only plan the run has
        // passed): its pool's free granules go back at this boundary, once.
        if let Some(p) = st.plan.as_mut()
            && p.cursor.spent()
            && !p.released
        {
            p.released = true;
            release = true;
        }
        if release {
            drop(st);
            self.release_cached()?;
        }
        Ok(())
    }
}
