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
//! ([`Engine::start_trace`]) every request is recorded into a [`Trace`].
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
//! - **Out of memory**: a growth that would pass the memory limit, or that the device
//!   refuses, triggers one release of cached memory (as `empty_cache`) and a retry
//!   (`num_alloc_retries`); if that fails too and a plan is served, the plan is given up
//!   (its free granules go back; [`Engine::plan_abandoned`] says why) and the request
//!   retried once more; then [`EngineError::OutOfMemory`] says what was asked and what
//!   is allocated, reserved and free (`num_ooms`).
//! - **Release before a new peak** (opt-in, [`EngineConfig::release_before_new_peak`]):
//!   when an online arena's growth would map past the peak of reserved bytes, free whole
//!   granules of the online arenas' holes (free blocks other than an arena's free tail,
//!   including one before a gap an earlier release left), largest holes first, are
//!   given back first (one device synchronisation, then the unmaps:
//!   `Heap::carve_holes`), by as much as the growth passes the peak — never from the run
//!   that growth will map (`Heap::growth_run`): that would only make it map more. A
//!   best-fit arena's holes are what makes its peak exceed the live peak; this keeps
//!   them from adding up. The gaps a release leaves are re-mapped by a later growth
//!   when they are the cheapest place for it (growth takes the run needing the fewest
//!   granules mapped, [`arena`]; growth always at the lowest run, with free blocks
//!   before gaps never released, parked gigabytes on a trace whose shapes change every
//!   iteration). The cost is a synchronisation per release and re-mapping what was
//!   given back. Measured (peak reserved and utilization with and without release, per
//!   trace, and the synchronisations): BENCHMARKS.md, "Session 6: release before a new
//!   peak, fixed for changing shapes". Off by default in the engine; the torch bridge
//!   turns it on (`STWEAVER_RELEASE_AT_PEAK`, default 1).
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
//! online ones: a *placement* arena (blocks go at given offsets, not by best fit;
//! pinned, so `empty_cache` leaves it mapped). Its granules are mapped when a request
//! first needs them, so reserved memory follows what the run has reached of the plan. Each request on one of the plan's
//! streams is first offered to the plan's cursor (module `cursor`: a small beam of
//! alignments between the run and the plan's request sequence, look-ahead across
//! section ends, resynchronisation at `mark_iteration`); a planned offset is handed out
//! only if its whole range lies inside one free block of the pool — since free blocks
//! are always coalesced, that is exactly "nothing live occupies it" (invariant 1).
//!
//! **Dynamic space.** A request the plan does not serve at its planned offset (the
//! cursor calls it unplanned, or its planned range is occupied: a *conflict*) is
//! placed in a **hole** of the pool — a free block, best fit first, in the smallest gap
//! between the ranges that the next [`PlanOptions::hole_horizon`] expected requests are
//! planned on (so the hole stays free long enough for what is coming; flush with the
//! block's end when the gap reaches it). Work the plan never saw — an evaluation pass,
//! the post-training checkpoint — thus lands between the first requests of the next
//! iteration instead of growing the pool. O(k log k) for the k ranges looked at. A
//! large request with no such hole makes the pool **grow at its tail** (its address
//! range reaches as far as an online arena's; granules are mapped as for an online
//! arena): it goes at the high end of the free tail of the pool plus new granules if
//! the next expected requests do not need that range, else wholly above the mapped end,
//! where nothing is planned. Only small requests without a hole, and requests on
//! streams the plan does not know, go to the online arenas. The placement goes through the same
//! occupancy-checked `alloc_at`, so it can never alias; at worst it makes a later
//! planned request a conflict, which then takes a hole or goes online in turn.
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
//! **Waiting for pending frees** ([`PlanOptions::wait_for_pending_frees`], on by
//! default). When a stream runs behind the host (a collective stream of DDP or FSDP),
//! the frees it must pass stay pending, and a request planned on their range would be
//! a conflict served elsewhere — under real lag that costs more than online serving.
//! Instead, if only such pending frees hold the planned range (all their events
//! queued), the request's stream is made to wait for their events on the device
//! ([`DeviceMemory::wait_event`]: ordering, no host blocking), the frees complete, and
//! the request takes its planned offset. The parts of those blocks outside the range
//! are kept as engine-owned pending frees (*fences*) with one event recorded on the
//! waiting stream after the waits, so no other stream gets them before that stream
//! (hence every earlier user) has passed that point. A refused wait (CUDA refuses on
//! a stream being captured) leaves everything pending: a conflict, as before. Cost:
//! a scan of the event queue per conflict, one device wait per event, one record per
//! fence. The engine replay checks every reuse of memory freed behind other streams
//! against the fake device's stream order (`FakeEvents::ordered_after`).
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
//! is dropped during long runs of plan hits and rebuilt at the next query ([`arena`],
//! lazy fit index).

pub mod arena;
mod checkpoint;
mod config;
mod cursor;
pub mod device;
mod error;
pub mod host;
mod introspect;
mod live;
mod pause;
mod plan_pool;
mod record;
pub mod stats;
mod stream_use;
mod streams;
pub mod virtual_memory;

use std::sync::{Mutex, MutexGuard};

use rustc_hash::FxHashMap;

use crate::plan::Plan;
use crate::trace::{MarkerKind, Trace};
use crate::units::{AllocId, Bytes, DeviceId, StreamId};

pub use self::arena::BlockState;
use self::arena::{ALIGNMENT, ArenaId, GrowthFailure, Heap, Idx, NIL, Placeable, SlabFull};
pub use self::checkpoint::{Checkpoint, CheckpointBlock, Restored};
pub use self::config::{EngineConfig, GIVE_UP_ITERATIONS, MemoryLimit, PlanOptions};
use self::config::{GIVE_UP_MIN_REQUESTS, limit_bytes};
use self::cursor::Cursor;
pub use self::cursor::{PlanStats, Section as PlanSection};
pub use self::device::{DeviceError, DeviceEvent, DeviceMemory, DevicePtr};
pub use self::error::EngineError;
pub use self::host::{FakeEvents, HostCounters, HostMemory};
pub use self::introspect::{BlockInfo, SegmentInfo};
use self::live::LiveMap;
pub use self::pause::{PauseError, PauseReport};
use self::plan_pool::stream_ranges;
pub use self::plan_pool::{servable_from_start, steady_slice};
use self::record::Recorder;
pub use self::record::SavedKind;
pub use self::stats::{DeviceStats, PoolKind, Stat, StatArray, StatType};
use self::stream_use::add_use;
use self::streams::{EventQueue, PendingEvent};
pub use self::virtual_memory::VirtualMemory;

/// Iteration boundaries after a switch to a plan during which online memory freed by
/// the online phase's leftovers is given back (see [`Engine::switch_to_plan`]).
const SWITCH_DRAIN_ITERATIONS: u32 = 2;

/// Free blocks of the pool looked at for one hole placement (best fit first).
const HOLE_CANDIDATES: usize = 8;
/// Expected requests a hole is checked against, at most, for a request whose planned
/// lifetime is known (a conflict).
const HOLE_SPAN_CAP: usize = 4096;

/// An unplanned request keeps clear, over a whole iteration, of the planned requests at
/// least this many times its size ([`PlanServing::unplanned_blocked`]): if it outlives
/// its hole's free time, what it displaces is no bigger than this many times itself.
const UNPLANNED_DISPLACE_FACTOR: u64 = 16;

/// What the plan pool answers to a request ([`State::alloc_planned`]).
enum PlanAnswer {
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
struct PlanServing {
    cursor: Cursor,
    arena: ArenaId,
    base: u64,
    /// Bytes of the planned part of the pool (granule multiple); the arena reaches
    /// further, for growth at the tail.
    len: u64,
    /// The plan's streams, each with the union of its requests' pool ranges (offsets,
    /// sorted, disjoint).
    streams: plan_pool::StreamRanges,
    options: PlanOptions,
    /// The pool's free granules were given back once the plan was spent.
    released: bool,
    /// For the request being served: the virtual tick until which a hole must stay
    /// free (its planned end, for a conflict), or `None` (unplanned: the next
    /// `hole_horizon` expected requests).
    until: Option<u64>,
    /// Scratch for [`PlanServing::collect_blocked`]: the pool ranges the expected
    /// requests a hole must avoid, sorted. Its capacity is reserved at load, so a miss
    /// does not allocate.
    blocked: Vec<(u64, u64)>,
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
}

/// Whether the sorted disjoint ranges `union` meet `[lo, hi)`. O(log n).
fn meets(union: &[(u64, u64)], lo: u64, hi: u64) -> bool {
    let i = union.partition_point(|&(a, _)| a < hi);
    i > 0 && union[i - 1].1 > lo
}

impl PlanServing {
    /// Whether the plan has stream `plan_stream` (a plan id).
    fn serves(&self, plan_stream: StreamId) -> bool {
        self.streams.iter().any(|(s, _)| *s == plan_stream)
    }

    /// The plan stream run stream `run` is bound to, if any.
    #[inline]
    fn to_plan(&self, run: StreamId) -> Option<StreamId> {
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

    fn multi_stream(&self) -> bool {
        self.streams.len() > 1
    }

    /// Whether `[lo, hi)` (offsets) lies wholly inside the ranges plan stream `s`
    /// plans on. O(log n).
    fn own(&self, s: StreamId, lo: u64, hi: u64) -> bool {
        self.streams
            .iter()
            .find(|(x, _)| *x == s)
            .is_some_and(|(_, u)| {
                let i = u.partition_point(|&(a, _)| a <= lo);
                i > 0 && u[i - 1].1 >= hi
            })
    }

    /// Whether no other stream's planned request ever touches `[lo, hi)` (offsets).
    fn exclusive(&self, stream: StreamId, lo: u64, hi: u64) -> bool {
        self.streams
            .iter()
            .all(|(s, u)| *s == stream || !meets(u, lo, hi))
    }

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
            Some(u64::MAX) => v.extend(self.cursor.upcoming(self.cursor.len()).map(range)),
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
    /// planned later needs sends that request to the pool's tail (on an H100 Llama trace,
    /// a 128 KiB tensor living one iteration displaced the 1.95 GiB logits: +5.6 %
    /// reserved). Clearing every planned request of the cycle instead sent the short-lived
    /// unplanned requests of a plan's tail iteration online (+5-7 % on the H200 traces).
    fn unplanned_blocked(&self, len: u64) -> impl Iterator<Item = &cursor::Expected> + '_ {
        // One iteration ahead (a prologue-only plan, an aperiodic run, has none: its
        // unplanned requests are the irregular ones, short-lived), at most HOLE_SPAN_CAP.
        let near = self.options.hole_horizon;
        let cycle = self.cursor.iteration_requests().min(HOLE_SPAN_CAP);
        self.cursor
            .upcoming(near.max(cycle))
            .enumerate()
            .filter(move |&(k, e)| {
                k < near || e.len >= len.saturating_mul(UNPLANNED_DISPLACE_FACTOR)
            })
            .map(|(_, e)| e)
    }

    fn hole_ok(&self, stream: StreamId, lo: u64, len: u64) -> bool {
        let hi = lo + len;
        let clear = |e: &cursor::Expected| e.offset.get() >= hi || e.offset.get() + e.len <= lo;
        (!self.multi_stream() || self.exclusive(stream, lo, hi))
            && match self.until {
                Some(u64::MAX) => self.cursor.upcoming(self.cursor.len()).all(clear),
                Some(until) => self.cursor.upcoming_until(until, HOLE_SPAN_CAP).all(clear),
                None => self.unplanned_blocked(len).all(clear),
            }
    }
}

/// Everything behind the lock.
#[derive(Debug)]
struct State {
    heap: Heap,
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

/// One block's device result in [`Engine::map_blocks`].
type MapResult = Result<(), DeviceError>;

/// A release of the online arenas' holes before a growth past the peak
/// (`Heap::carve_holes`): about `want` bytes, none of them in `keep` (the run the growth
/// will map).
struct HoleRelease {
    want: u64,
    keep: Option<(ArenaId, u64, u64)>,
}

/// What a growth attempt came to.
enum Growth {
    /// Memory was mapped (or another thread's was): try the arena again.
    Retry,
    /// The limit, the arena or the device refused.
    Refused,
}

/// The error for a free or `record_stream` of a live block that is not `Allocated`.
#[cold]
fn not_allocated(ptr: DevicePtr, state: BlockState, tag: u32) -> EngineError {
    match state {
        BlockState::Paused => EngineError::Paused { ptr, tag },
        _ => EngineError::AlreadyFreed(ptr),
    }
}

impl State {
    #[inline]
    fn kind_of(&self, i: Idx) -> PoolKind {
        self.heap.block(i).kind
    }

    fn stream_of(&self, i: Idx) -> StreamId {
        let a = self.heap.block(i).arena;
        self.heap.arena(a).map_or(StreamId(0), |x| x.stream)
    }

    /// By how many bytes growing arena `a` for `rounded` bytes would map past the peak
    /// of reserved bytes (what `carve_growth` would map, not the request's size: the
    /// arena's free tail counts), with the range of the run that growth would map
    /// (`Heap::growth_run`, kept out of the release); `None` if it would not. Changes
    /// nothing.
    fn growth_over_peak(
        &mut self,
        a: ArenaId,
        rounded: u64,
    ) -> Result<Option<HoleRelease>, SlabFull> {
        let reserved = self.stats.reserved_bytes[0].current as u64 + self.mapping;
        let budget = (self.stats.reserved_bytes[0].peak as u64).saturating_sub(reserved);
        Ok(match self.heap.carve_growth(a, rounded, budget)? {
            Ok(carved) => {
                for i in carved {
                    self.heap.finish_mapping(i, false);
                }
                None
            }
            Err(GrowthFailure::OverBudget { needed }) => Some(HoleRelease {
                want: needed - budget,
                keep: self.heap.growth_run(a, rounded).map(|(lo, hi)| (a, lo, hi)),
            }),
            Err(GrowthFailure::NoRoom) => None,
        })
    }

    /// Accounts for block `i`, just allocated for `size` requested bytes on `stream`.
    fn register(&mut self, i: Idx, size: Bytes, stream: StreamId) -> DevicePtr {
        let kind = self.kind_of(i);
        let (addr, rounded) = (self.heap.block(i).addr, self.heap.block(i).size);
        self.live.insert(addr, i);
        self.heap.block_mut(i).tag = self.pauses.tag;
        let s = &mut self.stats;
        stats::increase(&mut s.allocation, kind, 1);
        stats::increase(&mut s.allocated_bytes, kind, rounded);
        stats::increase(&mut s.active, kind, 1);
        stats::increase(&mut s.active_bytes, kind, rounded);
        stats::increase(&mut s.requested_bytes, kind, size.get());
        if let Some(r) = self.recorder.as_mut() {
            let id = r.alloc(size, stream, addr);
            self.heap.block_mut(i).trace_id = id;
        }
        self.settle_inactive();
        DevicePtr(addr)
    }

    /// The plan pool's answer to a request: its planned place if the plan has one and
    /// nothing occupies it, else a free hole of the pool that the next expected
    /// requests do not need (module docs, plan mode), else nothing.
    #[inline]
    fn alloc_planned(
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
        // Where the plan was before this request (for `until` below).
        let before = p.cursor.best_pos();
        if let Some(e) = p.cursor.next(size.get(), ps) {
            let (arena, addr) = (p.arena, p.base + e.offset.get());
            // The common case first: the range is mapped and free.
            if let Some(i) = self.heap.alloc_at(arena, addr, rounded, size.get())? {
                self.planned_block(i, e.cross, stream);
                return Ok(PlanAnswer::Placed(i));
            }
            if self.heap.placeable(arena, addr, rounded) == Placeable::NeedsMapping {
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
            self.plan_conflict(&e);
        } else {
            // An unplanned request where the plan expected a tensor that lives forever
            // (setup: parameters, optimizer state) is taken to live forever too. (`until`
            // is read only by the hole search and the pool's growth for this request,
            // which a conflict and a failed mapping set it for.)
            p.until = p.cursor.lives_forever_at(before).then_some(u64::MAX);
        }
        Ok(match self.alloc_in_hole(size, rounded, stream)? {
            Some(i) => PlanAnswer::Placed(i),
            None => PlanAnswer::Nothing,
        })
    }

    /// Block `i` was just placed at its planned offset.
    #[inline]
    fn planned_block(&mut self, i: Idx, cross: bool, stream: StreamId) {
        if cross {
            // Another stream plans on this range: the free waits for ours.
            add_use(&mut self.heap.block_mut(i).uses, stream);
        }
    }

    /// The planned range of `e` was occupied: counted as a conflict, and a hole for it
    /// must stay free until its planned end.
    fn plan_conflict(&mut self, e: &cursor::Expected) {
        if let Some(p) = self.plan.as_mut() {
            p.cursor.conflict();
            p.until = Some(e.vend);
        }
    }

    /// The pending frees that alone keep `[addr, addr + len)` of placement arena `a`
    /// from being one free block: every block meeting the range is `Free` or
    /// `PendingFree` with all its outstanding events in the queue, and at least one is
    /// pending. `None` otherwise (something live, mapping or unmapped there, or an
    /// event another thread has taken out of the queue). O(queued events + blocks in
    /// the range).
    fn pending_cover(&self, a: ArenaId, addr: u64, len: u64) -> Option<Vec<Idx>> {
        let end = addr.checked_add(len)?;
        // Pending blocks meeting the range, with how many of their events are queued.
        let mut found: Vec<(Idx, u32)> = Vec::new();
        for e in self.events.iter() {
            let b = self.heap.block(e.block);
            if b.arena == a && b.addr < end && addr < b.addr + b.size {
                match found.iter_mut().find(|(i, _)| *i == e.block) {
                    Some(f) => f.1 += 1,
                    None => found.push((e.block, 1)),
                }
            }
        }
        if found.is_empty() {
            return None;
        }
        let all_queued = |&(i, n): &(Idx, u32)| {
            let b = self.heap.block(i);
            b.state == BlockState::PendingFree && b.events_left == n
        };
        if !found.iter().all(all_queued) {
            return None;
        }
        let blocks: Vec<Idx> = found.into_iter().map(|f| f.0).collect();
        self.held_only_by(a, addr, end, &blocks).then_some(blocks)
    }

    /// Whether every block of placement arena `a` meeting `[addr, end)` is `Free` or one
    /// of the `PendingFree` blocks `pending`. O(log n + blocks in the range).
    fn held_only_by(&self, a: ArenaId, addr: u64, end: u64, pending: &[Idx]) -> bool {
        let ours =
            |i: Idx| pending.contains(&i) && self.heap.block(i).state == BlockState::PendingFree;
        let contains = |i: Idx| {
            let b = self.heap.block(i);
            b.addr <= addr && addr < b.addr + b.size
        };
        let first = pending
            .iter()
            .copied()
            .find(|&i| contains(i))
            .or_else(|| self.heap.free_block_containing(a, addr));
        let Some(mut i) = first else {
            return false;
        };
        loop {
            let b = self.heap.block(i);
            if !(b.state == BlockState::Free || ours(i)) {
                return false;
            }
            if b.addr + b.size >= end {
                return true;
            }
            i = b.next;
            if i == NIL {
                return false;
            }
        }
    }

    /// A free hole of the plan's pool for a request the plan does not serve: the free
    /// blocks that fit, best fit first, each tried at its low then its high end.
    fn alloc_in_hole(
        &mut self,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<Option<Idx>, SlabFull> {
        let State { plan, heap, .. } = self;
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
                let b = heap.fit_at_least(p.arena, key);
                if b == NIL {
                    break;
                }
                let (ba, bs) = (heap.block(b).addr, heap.block(b).size);
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
                if let Some(i) = heap.alloc_at(p.arena, p.base + off, rounded, size.get())? {
                    // The next user of this range may be on another stream, unless the
                    // range lies wholly in what this stream plans on (other streams'
                    // requests, planned or not, never go there: they need ranges
                    // exclusive to their own stream).
                    if p.multi_stream() && !ps.is_some_and(|ps| p.own(ps, off, off + rounded)) {
                        add_use(&mut heap.block_mut(i).uses, stream);
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
    fn pool_growth(&self, rounded: u64, stream: StreamId) -> Option<u64> {
        let p = self.plan.as_ref()?;
        let ps = p.to_plan(stream)?;
        if !p.options.holes {
            return None;
        }
        if p.cursor.spent() {
            // Nothing planned any more: the pool grows as an online arena does, at
            // its lowest run of free and unmapped space.
            return self.heap.lowest_run(p.arena, rounded);
        }
        let (free_start, end) = self.heap.tail_run(p.arena)?;
        let planned_end = p.base + p.len;
        // The free tail (and the unmapped space after it) if the next expected requests
        // do not need it, else above both the mapped end and the planned part.
        let at = if free_start < end && p.hole_ok(ps, free_start - p.base, rounded) {
            free_start
        } else {
            end.max(planned_end)
        };
        (self.heap.placeable(p.arena, at, rounded) != Placeable::Occupied).then_some(at)
    }

    /// Places a request at `at` in the pool arena after it grew (`None` if another
    /// thread took the range meanwhile).
    fn alloc_grown(
        &mut self,
        at: u64,
        size: Bytes,
        rounded: u64,
        stream: StreamId,
    ) -> Result<Option<Idx>, SlabFull> {
        let Some(pa) = self.plan.as_ref().map(|p| p.arena) else {
            return Ok(None);
        };
        let placed = self.heap.alloc_at(pa, at, rounded, size.get())?;
        if let Some(i) = placed
            && let Some(p) = self.plan.as_mut()
        {
            p.cursor.stats.holes += 1;
            p.cursor.stats.grown += 1;
            if p.multi_stream() {
                // As for any hole: the next user may be on another stream.
                add_use(&mut self.heap.block_mut(i).uses, stream);
            }
        }
        Ok(placed)
    }

    /// Stops serving the plan, if one is served (returns whether one was): its blocks
    /// stay until freed, its pool is unpinned so that it goes back like an online arena,
    /// and a switch's drain ends. `why`: the plan was given up mid-run
    /// ([`Engine::plan_abandoned`]).
    fn stop_plan(&mut self, why: Option<String>) -> bool {
        let Some(p) = self.plan.take() else {
            return false;
        };
        self.heap.unpin(p.arena);
        self.drain = 0;
        self.drain_pending = false;
        if why.is_some() {
            self.abandoned = why;
        }
        true
    }

    /// Brings `inactive_split(_bytes)` to the heap's current non-releasable totals
    /// (nothing to do unless they changed since the last time).
    #[inline]
    fn settle_inactive(&mut self) {
        if !self.heap.take_inactive_changed() {
            return;
        }
        for kind in [PoolKind::Small, PoolKind::Large] {
            stats::settle(
                &mut self.stats.inactive_split_bytes,
                kind,
                self.heap.inactive_bytes(kind),
            );
            stats::settle(
                &mut self.stats.inactive_split,
                kind,
                self.heap.inactive_count(kind),
            );
        }
    }

    /// Completes the free of pending or allocated block `i`: it leaves `live`, goes
    /// back to its arena, and stops counting as active.
    fn complete_free(&mut self, i: Idx) {
        let addr = self.heap.block(i).addr;
        self.live.remove(addr);
        self.release_block(i);
    }

    /// [`State::complete_free`] for a block already taken out of `live`.
    fn release_block(&mut self, i: Idx) {
        let kind = self.kind_of(i);
        let b = self.heap.block(i);
        let (size, requested, trace_id) = (b.size, b.requested, b.trace_id);
        stats::decrease(&mut self.stats.active, kind, 1);
        stats::decrease(&mut self.stats.active_bytes, kind, size);
        stats::decrease(&mut self.stats.requested_bytes, kind, requested);
        if let Some(r) = self.recorder.as_mut() {
            r.free_completed(trace_id);
        }
        self.heap.free(i);
    }

    /// Makes block `f`, just cut out of free memory, an engine-owned pending free
    /// waiting for `event` (a fence: [`Engine::wait_for_pending`]). It counts as
    /// active until the event completes, as the pending free it was part of did, and
    /// sits in the pointer map (no caller knows its address; a free of it would be
    /// refused as already freed).
    fn fence(&mut self, f: Idx, event: DeviceEvent) {
        let kind = self.kind_of(f);
        let b = self.heap.block_mut(f);
        b.state = BlockState::PendingFree;
        b.events_left = 1;
        let (addr, size) = (b.addr, b.size);
        self.live.insert(addr, f);
        stats::increase(&mut self.stats.active, kind, 1);
        stats::increase(&mut self.stats.active_bytes, kind, size);
        stats::increase(&mut self.stats.requested_bytes, kind, size);
        self.events.push(event, f);
        self.settle_inactive();
    }

    /// Applies events taken out of the queue: done ones complete their blocks' frees,
    /// the rest are queued again.
    fn apply_events(&mut self, work: Vec<PendingEvent>) {
        for e in &work {
            if e.done {
                self.events.idle.push(e.event);
                let b = self.heap.block_mut(e.block);
                b.events_left -= 1;
                if b.events_left == 0 {
                    self.complete_free(e.block);
                }
            } else {
                self.events.push(e.event, e.block);
            }
        }
        self.events.give_back(work);
        self.settle_inactive();
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
            heap: Heap::new(granule),
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
        };
        state.heap.set_fine_units(limit < total);
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

    // ------------------------------------------------------------------ serving

    /// Allocates `size` bytes for use on `stream`. The block is `size` rounded up to
    /// 512 B, 512-B aligned, and reused only on `stream` after it is freed.
    pub fn malloc(&self, size: Bytes, stream: StreamId) -> Result<DevicePtr, EngineError> {
        if size == Bytes::ZERO {
            return Err(EngineError::ZeroSize);
        }
        let rounded = size
            .align_up(Bytes(ALIGNMENT))
            .ok_or(EngineError::TooLarge(size))?
            .get();
        let kind = PoolKind::of(rounded);
        let mut st = self.lock()?;
        if st.drain_pending {
            st.drain_pending = false;
            drop(st);
            self.release_cached()?;
            st = self.lock()?;
        }
        if !st.events.is_empty() {
            st = self.process_events_locked(st)?;
        }
        match st.alloc_planned(size, rounded, stream)? {
            PlanAnswer::Placed(i) => return Ok(st.register(i, size, stream)),
            PlanAnswer::Map { addr, e } => {
                let (mapped, guard) = self.map_pool_range(st, addr, rounded)?;
                st = guard;
                if mapped
                    && let Some(pa) = st.plan.as_ref().map(|p| p.arena)
                    && let Some(i) = st.heap.alloc_at(pa, addr, rounded, size.get())?
                {
                    st.planned_block(i, e.cross, stream);
                    return Ok(st.register(i, size, stream));
                }
                st.plan_conflict(&e);
                if let Some(i) = st.alloc_in_hole(size, rounded, stream)? {
                    return Ok(st.register(i, size, stream));
                }
            }
            PlanAnswer::Busy { addr, e } => {
                let (placed, guard) = self.wait_for_pending(st, addr, rounded, size, stream)?;
                st = guard;
                if let Some(i) = placed {
                    st.planned_block(i, e.cross, stream);
                    return Ok(st.register(i, size, stream));
                }
                st.plan_conflict(&e);
                if let Some(i) = st.alloc_in_hole(size, rounded, stream)? {
                    return Ok(st.register(i, size, stream));
                }
            }
            PlanAnswer::Nothing => {}
        }
        if kind == PoolKind::Large
            && let Some(at) = st.pool_growth(rounded, stream)
        {
            let (mapped, guard) = self.map_pool_range(st, at, rounded)?;
            st = guard;
            if mapped && let Some(i) = st.alloc_grown(at, size, rounded, stream)? {
                return Ok(st.register(i, size, stream));
            }
        }
        let (mut retried, mut released_holes, mut gave_up_plan) = (false, false, false);
        loop {
            let Some(&a) = st.arena_of.get(&(stream, kind)) else {
                st = self.create_arena(st, stream, kind)?;
                continue;
            };
            if let Some(i) = st.heap.alloc(a, rounded, size.get())? {
                return Ok(st.register(i, size, stream));
            }
            // Before the small arena grows, a free block of the stream's large arena
            // will do (it counts in the large pool, where it lives).
            if kind == PoolKind::Small
                && let Some(&la) = st.arena_of.get(&(stream, PoolKind::Large))
                && let Some(i) = st.heap.alloc(la, rounded, size.get())?
            {
                return Ok(st.register(i, size, stream));
            }
            if !released_holes
                && self.release_at_peak
                && let Some(over) = st.growth_over_peak(a, rounded)?
            {
                // Growing would set a new peak of reserved memory: first give back that
                // much of the arena's free holes, so that the growth maps no more than
                // is reserved now (module docs, release before a new peak).
                released_holes = true;
                drop(st);
                self.release(Some(over))?;
                st = self.lock()?;
                continue;
            }
            let (grown, guard) = self.grow(st, a, rounded)?;
            st = guard;
            match grown {
                Growth::Retry => continue,
                Growth::Refused if !retried && !self.keep_cache => {
                    retried = true;
                    drop(st);
                    self.release_cached()?;
                    st = self.lock()?;
                    st.stats.num_alloc_retries += 1;
                }
                Growth::Refused if !gave_up_plan && st.plan.is_some() => {
                    // Still refused with the cache given back: the plan's pool holds the
                    // rest. Give the plan up (its blocks stay until freed; its free
                    // granules go back now) before reporting out of memory.
                    gave_up_plan = true;
                    let why = format!(
                        "out of memory serving {} online (limit {}, {} reserved): the \
                         plan's pool was given up for it",
                        Bytes(rounded),
                        Bytes(st.limit),
                        Bytes(st.stats.reserved_bytes[0].current as u64),
                    );
                    st.stop_plan(Some(why));
                    drop(st);
                    self.release_cached()?;
                    st = self.lock()?;
                    st.stats.num_alloc_retries += 1;
                }
                Growth::Refused => {
                    st.stats.num_ooms += 1;
                    let s = &st.stats;
                    let allocated = s.allocated_bytes[0].current as u64;
                    let reserved = s.reserved_bytes[0].current as u64;
                    let free_reserved = reserved.saturating_sub(s.active_bytes[0].current as u64);
                    let limit = st.limit;
                    drop(st);
                    let device_free = self.dev.free_memory().unwrap_or(Bytes::ZERO);
                    return Err(EngineError::OutOfMemory {
                        requested: size,
                        rounded: Bytes(rounded),
                        stream,
                        allocated: Bytes(allocated),
                        reserved: Bytes(reserved),
                        free_reserved: Bytes(free_reserved),
                        limit: Bytes(limit),
                        device_free,
                    });
                }
            }
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
        let a = match st.heap.add_arena(stream, kind, base.get(), self.arena_size) {
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

    /// Maps the granules arena `a` needs for `rounded` more bytes, within the limit.
    fn grow<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        a: ArenaId,
        rounded: u64,
    ) -> Result<(Growth, MutexGuard<'a, State>), EngineError> {
        let reserved = st.stats.reserved_bytes[0].current as u64;
        let budget = st.limit.saturating_sub(reserved + st.mapping);
        let carved = match st.heap.carve_growth(a, rounded, budget)? {
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
    fn map_blocks<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        blocks: &[Idx],
    ) -> Result<(Vec<MapResult>, MutexGuard<'a, State>), EngineError> {
        let ranges: Vec<(u64, u64, bool, PoolKind)> = blocks
            .iter()
            .map(|&i| {
                let b = st.heap.block(i);
                let kind = st.heap.arena(b.arena).map_or(PoolKind::Large, |x| x.kind);
                (b.addr, b.size, st.heap.whole_unit_mapping(b.arena), kind)
            })
            .collect();
        let total: u64 = ranges.iter().map(|r| r.1).sum();
        st.mapping += total;
        drop(st);
        let results: Vec<Result<(), DeviceError>> = ranges
            .iter()
            .map(|&(addr, size, whole, _)| self.map_units(addr, size, whole))
            .collect();
        let mut st = self.lock()?;
        st.mapping -= total;
        for ((&i, &(_, size, whole, kind)), r) in blocks.iter().zip(&ranges).zip(&results) {
            st.heap.finish_mapping_as(i, r.is_ok(), whole);
            if r.is_ok() {
                stats::increase(&mut st.stats.reserved_bytes, kind, size);
                st.stats.num_device_alloc += 1;
            }
        }
        st.settle_inactive();
        Ok((results, st))
    }

    /// Maps `[addr, addr + size)` as one device `map` call (`whole`), or granule by
    /// granule (the units `Heap::finish_mapping` records for the block), all or nothing.
    fn map_units(&self, addr: u64, size: u64, whole: bool) -> Result<(), DeviceError> {
        let g = self.granularity().get();
        if whole || size <= g {
            return self.dev.map(DevicePtr(addr), Bytes(size));
        }
        for at in (addr..addr + size).step_by(g as usize) {
            if let Err(e) = self.dev.map(DevicePtr(at), Bytes(g)) {
                for done in (addr..at).step_by(g as usize) {
                    let _ = self.dev.unmap(DevicePtr(done), Bytes(g));
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Maps the granules of `[addr, addr + rounded)` of the plan pool that are not
    /// mapped yet, within the memory limit (the lock released around the device calls).
    /// Whether the range is mapped now.
    fn map_pool_range<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        addr: u64,
        rounded: u64,
    ) -> Result<(bool, MutexGuard<'a, State>), EngineError> {
        let mut released = false;
        let (carved, total, reserved) = loop {
            let Some(pa) = st.plan.as_ref().map(|p| p.arena) else {
                return Ok((false, st));
            };
            let carved = st.heap.carve_range(pa, addr, rounded)?;
            let total: u64 = carved.iter().map(|&i| st.heap.block(i).size).sum();
            let reserved = st.stats.reserved_bytes[0].current as u64;
            if released || reserved + st.mapping + total <= st.limit {
                break (carved, total, reserved);
            }
            // Over the limit: first give back the cached memory of the online arenas
            // (after a switch, the online phase's cache is still held), as an OOM retry.
            for i in carved {
                st.heap.finish_mapping(i, false);
            }
            drop(st);
            self.release_cached()?;
            st = self.lock()?;
            st.stats.num_alloc_retries += 1;
            released = true;
        };
        if reserved + st.mapping + total > st.limit {
            for i in carved {
                st.heap.finish_mapping(i, false);
            }
            // The plan does not fit under the limit next to what is held: give it up
            // (its blocks stay until freed, its pool goes back like an online arena)
            // and serve online from now on.
            let why = format!(
                "mapping {} of the plan's pool would exceed the memory limit {} ({} reserved)",
                Bytes(total),
                Bytes(st.limit),
                Bytes(reserved)
            );
            st.stop_plan(Some(why));
            return Ok((false, st));
        }
        let (grown, st) = self.map_carved(st, &carved)?;
        Ok((matches!(grown, Growth::Retry), st))
    }

    /// Frees the allocation at `ptr`. If other streams used it ([`Engine::record_stream`])
    /// the memory is reused only after they pass the events recorded now.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        // One hash probe: the entry is taken out at once when nothing defers the free.
        let i = {
            let s = &mut *st;
            let Some(slot) = s.live.find(ptr.get()) else {
                return Err(EngineError::UnknownPointer(ptr));
            };
            let i = s.live.block_at(slot);
            let b = s.heap.block(i);
            if b.state != BlockState::Allocated {
                return Err(not_allocated(ptr, b.state, b.tag));
            }
            if b.uses.is_empty() {
                s.live.remove_slot(slot);
            }
            i
        };
        let kind = st.kind_of(i);
        let (size, trace_id) = (st.heap.block(i).size, st.heap.block(i).trace_id);
        if st.drain > 0
            && st
                .plan
                .as_ref()
                .is_some_and(|p| p.arena != st.heap.block(i).arena)
        {
            st.drain_pending = true;
        }
        stats::decrease(&mut st.stats.allocation, kind, 1);
        stats::decrease(&mut st.stats.allocated_bytes, kind, size);
        if let Some(r) = st.recorder.as_mut() {
            r.free_requested(trace_id);
        }
        if st.heap.block(i).uses.is_empty() {
            st.release_block(i);
            st.settle_inactive();
            return Ok(());
        }
        // Deferred. Phase 1 (locked): take the uses out, give them idle events.
        let mut uses = {
            let s = &mut *st;
            let b = s.heap.block_mut(i);
            b.state = BlockState::PendingFree;
            let mut uses = std::mem::take(&mut b.uses);
            b.events_left = uses.len() as u32;
            for u in uses.iter_mut() {
                u.event = s.events.idle.pop();
            }
            uses
        };
        drop(st);
        // Phase 2 (unlocked): create missing events, record each on its stream.
        let mut first_err = None;
        for u in uses.iter_mut() {
            if u.event.is_none() {
                match self.dev.create_event() {
                    Ok(e) => u.event = Some(e),
                    Err(e) => {
                        first_err.get_or_insert(e);
                        continue;
                    }
                }
            }
            if let Some(ev) = u.event {
                match self.dev.record_event(ev, u.stream) {
                    Ok(()) => u.recorded = true,
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        // Phase 3 (locked): queue the recorded events.
        let mut st = self.lock()?;
        for u in uses.iter_mut() {
            match (u.event.take(), u.recorded) {
                (Some(ev), true) => st.events.push(ev, i),
                (Some(ev), false) => st.events.idle.push(ev),
                (None, _) => {}
            }
            u.recorded = false;
        }
        uses.clear();
        st.heap.block_mut(i).uses = uses;
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Marks the allocation at `ptr` as used on `stream` too (`Tensor.record_stream`):
    /// its free will wait for `stream` to pass the point of the free. A no-op for the
    /// allocation's own stream.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        let Some(i) = st.live.get(ptr.get()) else {
            return Err(EngineError::UnknownPointer(ptr));
        };
        let b = st.heap.block(i);
        if b.state != BlockState::Allocated {
            return Err(not_allocated(ptr, b.state, b.tag));
        }
        if st.stream_of(i) != stream {
            add_use(&mut st.heap.block_mut(i).uses, stream);
        }
        Ok(())
    }

    /// Completes the pending frees whose events have all completed (`malloc` does this
    /// first whenever frees are pending).
    pub fn process_events(&self) -> Result<(), EngineError> {
        let st = self.lock()?;
        if !st.events.is_empty() {
            drop(self.process_events_locked(st)?);
        }
        Ok(())
    }

    fn process_events_locked<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
    ) -> Result<MutexGuard<'a, State>, EngineError> {
        let mut work = st.events.take();
        drop(st);
        let mut first_err = None;
        for e in work.iter_mut() {
            e.done = match self.dev.query_event(e.event) {
                Ok(done) => done,
                Err(err) => {
                    first_err.get_or_insert(err);
                    false
                }
            };
        }
        let mut st = self.lock()?;
        st.apply_events(work);
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(st),
        }
    }

    /// Plan mode, a planned range `[addr, addr + rounded)` of the pool found occupied:
    /// if only frees waiting for other streams' events hold it
    /// ([`State::pending_cover`]), `stream` is made to wait for those events (no host
    /// blocking), their frees complete, and the request is placed there. Returns the
    /// placed block, or `None` (a conflict: something else holds the range, or a device
    /// call was refused; the frees then stay pending and complete as usual).
    ///
    /// Why this is safe: each event was recorded, at the free, on a stream that used
    /// the block, after all the work that stream had queued on it; work queued on
    /// `stream` after the wait runs after that work, and the new block is first used by
    /// work queued after this `malloc` returns. Only `stream` is ordered so: the parts
    /// of the pending blocks outside the range (at most one before it and one after)
    /// are **fenced** — kept as engine-owned pending frees whose one event is recorded
    /// on `stream` after the waits, so that no other stream gets them before `stream`
    /// (hence every earlier user) has passed that point. The blocks' events are taken
    /// out of the queue while locked, so no other thread completes or reuses those
    /// blocks meanwhile (they stay `PendingFree`), and the range is checked again once
    /// re-locked. Device calls: one wait per event, one record per fence (events from
    /// the idle pool, created if it runs out).
    fn wait_for_pending<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        addr: u64,
        rounded: u64,
        size: Bytes,
        stream: StreamId,
    ) -> Result<(Option<Idx>, MutexGuard<'a, State>), EngineError> {
        let Some(arena) = st.plan.as_ref().map(|p| p.arena) else {
            return Ok((None, st));
        };
        let Some(blocks) = st.pending_cover(arena, addr, rounded) else {
            return Ok((None, st));
        };
        let end = addr + rounded;
        let lo = blocks
            .iter()
            .map(|&i| st.heap.block(i).addr)
            .min()
            .unwrap_or(addr);
        let hi = blocks
            .iter()
            .map(|&i| st.heap.block(i).addr + st.heap.block(i).size)
            .max()
            .unwrap_or(end);
        // The parts of the pending blocks outside the range: (start, len).
        let fences: Vec<(u64, u64)> =
            [(lo, addr.saturating_sub(lo)), (end, hi.saturating_sub(end))]
                .into_iter()
                .filter(|&(_, len)| len > 0)
                .collect();
        let mut fence_events: Vec<DeviceEvent> = Vec::with_capacity(fences.len());
        while fence_events.len() < fences.len() {
            let Some(ev) = st.events.idle.pop() else {
                break;
            };
            fence_events.push(ev);
        }
        let mut work = st.events.take_for(&blocks);
        drop(st);
        // Unlocked: the waits, then the fences' events (recorded after the waits).
        let mut ok = true;
        for e in work.iter_mut() {
            ok &= self.dev.wait_event(stream, e.event).is_ok();
        }
        while ok && fence_events.len() < fences.len() {
            match self.dev.create_event() {
                Ok(ev) => fence_events.push(ev),
                Err(_) => ok = false,
            }
        }
        for &ev in &fence_events {
            ok = ok && self.dev.record_event(ev, stream).is_ok();
        }
        let mut st = self.lock()?;
        // Re-locked: another thread may have taken free memory of the range meanwhile.
        if !ok || !st.held_only_by(arena, addr, end, &blocks) {
            // The frees stay pending (their events go back to the queue, queried as
            // usual); the fence events were not needed.
            st.events.idle.extend(fence_events);
            st.apply_events(work);
            return Ok((None, st));
        }
        for e in work.iter_mut() {
            e.done = true;
        }
        st.apply_events(work);
        // [lo, hi) is now one free run: the block, then the fences beside it. (The two
        // errors below cannot happen — the lock was held since the check — and would leave
        // the range unfenced; they stop the request rather than hide a broken invariant.)
        let Some(placed) = st.heap.alloc_at(arena, addr, rounded, size.get())? else {
            return Err(EngineError::Inconsistent(format!(
                "the pool range {addr:#x} + {rounded} was not free after its pending frees completed"
            )));
        };
        for (&(at, len), &ev) in fences.iter().zip(&fence_events) {
            let Some(f) = st.heap.alloc_at(arena, at, len, len)? else {
                return Err(EngineError::Inconsistent(format!(
                    "the fence {at:#x} + {len} was not free after its pending free completed"
                )));
            };
            st.fence(f, ev);
        }
        if let Some(p) = st.plan.as_mut() {
            p.cursor.stats.waits += 1;
        }
        Ok((Some(placed), st))
    }

    // ------------------------------------------------------------------ releasing

    /// Gives cached memory back to the device: completes every pending free (waiting for
    /// its events), unmaps every granule that holds nothing, and releases arenas left
    /// with nothing mapped. Afterwards reserved memory is what live blocks need, plus the
    /// free bytes sharing their granules (`inactive_split_bytes`).
    pub fn empty_cache(&self) -> Result<(), EngineError> {
        self.release_cached()
    }

    fn release_cached(&self) -> Result<(), EngineError> {
        self.release(None)
    }

    /// Gives cached memory back to the device: everything releasable (`holes: None`), or
    /// (`Some`) about `want` bytes of the online arenas' holes only, outside `keep`
    /// (`Heap::carve_holes`). Either way after a device synchronisation.
    fn release(&self, holes: Option<HoleRelease>) -> Result<(), EngineError> {
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
        let ids: Vec<ArenaId> = st.heap.arena_ids().collect();
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
                    all.extend(st.heap.carve_releasable_with(a, spent_pool == Some(a))?);
                }
                all
            }
            Some(h) => st.heap.carve_holes(&ids, h.want, h.keep)?,
        };
        for i in pieces {
            let b = st.heap.block(i);
            let kind = st.heap.arena(b.arena).map_or(PoolKind::Small, |x| x.kind);
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
                st.heap.finish_unmapping(i, r.is_ok());
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
            if let Some(arena) = st.heap.remove_arena(a) {
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

    // ------------------------------------------------------------------ limits (stats: introspect.rs)

    /// Sets the memory limit. Memory already mapped beyond it stays mapped; growth
    /// beyond it fails (after one release of cached memory).
    pub fn set_memory_limit(&self, limit: MemoryLimit) -> Result<(), EngineError> {
        let bytes = limit_bytes(limit, self.total)?;
        let mut st = self.lock()?;
        st.limit = bytes;
        // Under a limit the plan pool maps granule by granule (`Heap::set_fine_units`).
        st.heap.set_fine_units(bytes < self.total);
        Ok(())
    }

    /// The memory limit in bytes.
    pub fn memory_limit(&self) -> Result<Bytes, EngineError> {
        Ok(Bytes(self.lock()?.limit))
    }

    // ------------------------------------------------------------------ plan mode

    /// Starts serving `plan`: verifies it ([`crate::verify::verify_plan`]), reserves and
    /// maps its pool (one large-pool segment, pinned: `empty_cache` leaves it mapped), and
    /// from then on offers every request on the plan's stream to the plan's cursor
    /// first. A planned offset is used only if nothing live occupies its range;
    /// everything else is served online, as before.
    ///
    /// A plan whose requests span several streams is served with the stream rules of
    /// the module docs (plan mode). A plan for another device, a second plan, or a pool
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
        // so that it can grow at its tail (module docs, dynamic space). Nothing is
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
            .heap
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
        let cursor = Cursor::new(plan, options.window, &cross);
        let stream_ranges: usize = streams.iter().map(|(_, u)| u.len()).sum();
        let blocked = Vec::with_capacity(
            HOLE_SPAN_CAP.max(options.hole_horizon).max(cursor.len()) + stream_ranges,
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

    // ------------------------------------------------------------------ trace mode

    /// Starts recording a trace (a no-op if one is being recorded). Live blocks become
    /// preexisting allocations of the new trace.
    pub fn start_trace(&self) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        if st.recorder.is_some() {
            return Ok(());
        }
        let mut rec = Recorder::new(self.device);
        let mut live: Vec<Idx> = st.live.values().collect();
        live.sort_by_key(|&i| st.heap.block(i).addr);
        for i in live {
            let (requested, addr) = (st.heap.block(i).requested, st.heap.block(i).addr);
            let stream = st.stream_of(i);
            let id = rec.preexisting(Bytes(requested), stream, addr);
            st.heap.block_mut(i).trace_id = id;
        }
        st.recorder = Some(rec);
        Ok(())
    }

    /// Whether a trace is being recorded.
    pub fn is_tracing(&self) -> Result<bool, EngineError> {
        Ok(self.lock()?.recorder.is_some())
    }

    /// Stops recording and returns the trace (`None` if none was being recorded).
    pub fn take_trace(&self) -> Result<Option<Trace>, EngineError> {
        let rec = self.lock()?.recorder.take();
        match rec.map(Recorder::finish) {
            None => Ok(None),
            Some(Ok(t)) => Ok(Some(t)),
            Some(Err(n)) => Err(EngineError::TraceOverflow(n)),
        }
    }

    /// An iteration boundary: recorded as an `IterationBegin` marker in the trace, and
    /// the plan's cursor (if a plan is served) resynchronises to the start of the
    /// iteration section.
    pub fn mark_iteration(&self) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        let mut give_up = None;
        if let Some(p) = st.plan.as_mut() {
            p.cursor.mark_iteration();
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

    /// Records a `SavedPack` / `SavedUnpack` event for the allocation handed out at
    /// `ptr` (autograd's saved-tensor hooks, whose tensor's storage is that whole
    /// allocation). Returns the allocation's trace id when an event was recorded,
    /// `None` when no trace is being recorded, when no allocation that the caller has
    /// not freed starts at `ptr` (an interior pointer, a freed or unknown block), or
    /// when the allocation is not in the trace (the trace is full). O(1).
    pub fn record_saved(
        &self,
        ptr: DevicePtr,
        kind: SavedKind,
    ) -> Result<Option<AllocId>, EngineError> {
        let mut st = self.lock()?;
        let st = &mut *st;
        let Some(rec) = st.recorder.as_mut() else {
            return Ok(None);
        };
        let Some(i) = st.live.get(ptr.get()) else {
            return Ok(None);
        };
        let b = st.heap.block(i);
        if b.state != BlockState::Allocated {
            return Ok(None);
        }
        Ok(rec.saved(b.trace_id, kind))
    }

    /// Records a restore link ([`crate::Restore`]): the allocation handed out at
    /// `into_ptr` is the copy back of the offloaded allocation `from` (an id that
    /// [`Engine::record_saved`] returned for its pack in this trace). Returns whether a
    /// link was recorded: `false` when not tracing, when no allocation the caller has
    /// not freed starts at `into_ptr`, or when the link would not validate (`from`
    /// unknown, not packed or not freed before `into_ptr`'s allocation, either already
    /// linked, the copy back preexisting or not in the trace). O(1).
    pub fn record_restore(&self, into_ptr: DevicePtr, from: AllocId) -> Result<bool, EngineError> {
        let mut st = self.lock()?;
        let st = &mut *st;
        let Some(rec) = st.recorder.as_mut() else {
            return Ok(false);
        };
        let Some(i) = st.live.get(into_ptr.get()) else {
            return Ok(false);
        };
        let b = st.heap.block(i);
        if b.state != BlockState::Allocated {
            return Ok(false);
        }
        Ok(rec.restore(b.trace_id, from))
    }

    /// Records a marker in the trace (a no-op when not tracing).
    pub fn mark(&self, kind: MarkerKind, label: Option<&str>) -> Result<(), EngineError> {
        if let Some(r) = self.lock()?.recorder.as_mut() {
            r.marker(kind, label);
        }
        Ok(())
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
        let ids: Vec<ArenaId> = st.heap.arena_ids().collect();
        for a in ids {
            let mut run: Option<(u64, u64)> = None;
            let mut runs = Vec::new();
            for (_, b) in st.heap.arena_blocks(a) {
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
            if let Some(arena) = st.heap.arena(a) {
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
mod tests {
    use super::*;
    use crate::trace::EventKind;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    const G: u64 = 64 << 10;
    const S0: StreamId = StreamId(0);
    const S1: StreamId = StreamId(1);

    /// A host device whose event recording, event queries and unmapping can be made
    /// to fail, and whose granularity can be wrong.
    #[derive(Debug)]
    struct Flaky {
        host: HostMemory,
        granule: Option<u64>,
        fail_record: AtomicBool,
        fail_query: AtomicBool,
        fail_unmap: AtomicBool,
    }

    fn driver_error(call: &'static str) -> DeviceError {
        DeviceError::Driver {
            call,
            code: 999,
            message: "injected".into(),
        }
    }

    impl DeviceMemory for Flaky {
        fn granularity(&self) -> Bytes {
            self.granule.map_or(self.host.granularity(), Bytes)
        }
        fn total_memory(&self) -> Bytes {
            self.host.total_memory()
        }
        fn free_memory(&self) -> Result<Bytes, DeviceError> {
            self.host.free_memory()
        }
        fn reserve(&self, size: Bytes) -> Result<DevicePtr, DeviceError> {
            self.host.reserve(size)
        }
        fn release(&self, base: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
            self.host.release(base, size)
        }
        fn map(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
            self.host.map(addr, size)
        }
        fn unmap(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
            if self.fail_unmap.load(Ordering::Relaxed) {
                return Err(driver_error("cuMemUnmap"));
            }
            self.host.unmap(addr, size)
        }
        fn synchronize(&self) -> Result<(), DeviceError> {
            self.host.synchronize()
        }
        fn create_event(&self) -> Result<DeviceEvent, DeviceError> {
            self.host.create_event()
        }
        fn record_event(&self, event: DeviceEvent, stream: StreamId) -> Result<(), DeviceError> {
            if self.fail_record.load(Ordering::Relaxed) {
                return Err(driver_error("cudaEventRecord"));
            }
            self.host.record_event(event, stream)
        }
        fn wait_event(&self, stream: StreamId, event: DeviceEvent) -> Result<(), DeviceError> {
            self.host.wait_event(stream, event)
        }
        fn query_event(&self, event: DeviceEvent) -> Result<bool, DeviceError> {
            if self.fail_query.load(Ordering::Relaxed) {
                return Err(driver_error("cudaEventQuery"));
            }
            self.host.query_event(event)
        }
        fn synchronize_event(&self, event: DeviceEvent) -> Result<(), DeviceError> {
            self.host.synchronize_event(event)
        }
        fn destroy_event(&self, event: DeviceEvent) -> Result<(), DeviceError> {
            self.host.destroy_event(event)
        }
    }

    fn flaky(capacity: u64) -> Arc<Flaky> {
        Arc::new(Flaky {
            host: HostMemory::new(Bytes(capacity), Bytes(G)),
            granule: None,
            fail_record: AtomicBool::new(false),
            fail_query: AtomicBool::new(false),
            fail_unmap: AtomicBool::new(false),
        })
    }

    fn engine(dev: Arc<Flaky>, limit: MemoryLimit) -> Engine<Arc<Flaky>> {
        Engine::new(
            dev,
            EngineConfig {
                limit,
                arena_size: Some(Bytes(64 << 20)),
                ..EngineConfig::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn bad_requests_are_errors() {
        let e = engine(flaky(1 << 30), MemoryLimit::Fraction(1.0));
        assert_eq!(e.malloc(Bytes(0), S0), Err(EngineError::ZeroSize));
        assert_eq!(
            e.malloc(Bytes(u64::MAX), S0),
            Err(EngineError::TooLarge(Bytes(u64::MAX)))
        );
        let p = e.malloc(Bytes(1000), S0).unwrap();
        assert_eq!(e.block_info(p).unwrap().size, Bytes(1024));
        assert_eq!(e.block_info(p).unwrap().requested, Bytes(1000));
        let inner = DevicePtr(p.get() + 512);
        assert_eq!(e.free(inner), Err(EngineError::UnknownPointer(inner)));
        assert_eq!(
            e.record_stream(inner, S1),
            Err(EngineError::UnknownPointer(inner))
        );
        // Pointers no block can have, the pointer map's vacant marker among them.
        for bad in [DevicePtr(u64::MAX), DevicePtr(p.get() + 1), DevicePtr(0)] {
            assert_eq!(e.free(bad), Err(EngineError::UnknownPointer(bad)));
            assert_eq!(e.block_info(bad), Err(EngineError::UnknownPointer(bad)));
        }
        e.record_stream(p, S1).unwrap();
        e.free(p).unwrap();
        assert_eq!(e.free(p), Err(EngineError::AlreadyFreed(p)));
        assert_eq!(e.record_stream(p, S1), Err(EngineError::AlreadyFreed(p)));
        assert_eq!(
            e.set_memory_limit(MemoryLimit::Fraction(0.0)),
            Err(EngineError::InvalidLimit(0.0))
        );
        assert!(e.set_memory_limit(MemoryLimit::Fraction(1.5)).is_err());
        e.set_memory_limit(MemoryLimit::Fraction(0.25)).unwrap();
        assert_eq!(e.memory_limit().unwrap(), Bytes(1 << 28));
        e.check_invariants().unwrap();

        let mut odd = Arc::try_unwrap(flaky(1 << 20)).unwrap();
        odd.granule = Some(1000);
        assert!(matches!(
            Engine::new(odd, EngineConfig::default()),
            Err(EngineError::BadGranularity(Bytes(1000)))
        ));
    }

    #[test]
    fn out_of_memory_says_what_was_asked_and_what_is_held() {
        let e = engine(flaky(1 << 30), MemoryLimit::Bytes(Bytes(1 << 20)));
        let _a = e.malloc(Bytes(512 << 10), S0).unwrap();
        let err = e.malloc(Bytes((1 << 20) - 100), S0).unwrap_err();
        assert_eq!(
            err,
            EngineError::OutOfMemory {
                requested: Bytes((1 << 20) - 100),
                rounded: Bytes(1 << 20),
                stream: S0,
                allocated: Bytes(512 << 10),
                reserved: Bytes(512 << 10),
                free_reserved: Bytes(0),
                limit: Bytes(1 << 20),
                device_free: Bytes((1 << 30) - (512 << 10)),
            }
        );
        let msg = err.to_string();
        assert!(msg.contains("tried to allocate 1.00 MiB"), "{msg}");
        assert!(msg.contains("512.00 KiB allocated"), "{msg}");
        let s = e.stats().unwrap();
        assert_eq!(
            (s.num_ooms, s.num_alloc_retries, s.num_sync_all_streams),
            (1, 1, 1)
        );
        e.check_invariants().unwrap();
    }

    #[test]
    fn the_retry_releases_cached_memory_of_other_streams() {
        let e = engine(flaky(1 << 30), MemoryLimit::Bytes(Bytes(4 << 20)));
        let a = e.malloc(Bytes(3 << 20), S1).unwrap();
        e.free(a).unwrap();
        // S0 cannot have S1's cached 3 MiB without the release-and-retry.
        let b = e.malloc(Bytes(2 << 20), S0).unwrap();
        let s = e.stats().unwrap();
        assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 0));
        assert_eq!(s.reserved_bytes[0].current, 2 << 20);
        assert_eq!(s.segment[0].current, 1, "S1's empty arena was released");
        e.free(b).unwrap();
        e.check_invariants().unwrap();
    }

    #[test]
    fn a_failed_event_record_keeps_the_block_forever() {
        let dev = flaky(1 << 30);
        let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
        let p = e.malloc(Bytes(4096), S0).unwrap();
        e.record_stream(p, S1).unwrap();
        dev.fail_record.store(true, Ordering::Relaxed);
        assert!(matches!(e.free(p), Err(EngineError::Device(_))));
        dev.fail_record.store(false, Ordering::Relaxed);
        e.empty_cache().unwrap();
        let s = e.stats().unwrap();
        assert_eq!(s.allocated_bytes[0].current, 0);
        assert_eq!(
            s.active_bytes[0].current, 4096,
            "never reused: leaked, not aliased"
        );
        assert_eq!(e.block_info(p).unwrap().state, BlockState::PendingFree);
        let q = e.malloc(Bytes(4096), S0).unwrap();
        assert_ne!(p, q);
        e.check_invariants().unwrap();
    }

    #[test]
    fn failed_queries_and_unmaps_leave_a_consistent_engine() {
        let dev = flaky(1 << 30);
        let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
        let p = e.malloc(Bytes(4096), S0).unwrap();
        e.record_stream(p, S1).unwrap();
        e.free(p).unwrap();
        dev.host.events().pass_all(S1);
        dev.fail_query.store(true, Ordering::Relaxed);
        assert!(matches!(e.process_events(), Err(EngineError::Device(_))));
        assert!(e.malloc(Bytes(512), S0).is_err());
        e.check_invariants().unwrap();
        dev.fail_query.store(false, Ordering::Relaxed);
        e.process_events().unwrap();
        assert_eq!(e.stats().unwrap().active_bytes[0].current, 0);

        let q = e.malloc(Bytes(3 * G), S0).unwrap();
        e.free(q).unwrap();
        let reserved = e.stats().unwrap().reserved_bytes[0].current;
        dev.fail_unmap.store(true, Ordering::Relaxed);
        assert!(matches!(e.empty_cache(), Err(EngineError::Device(_))));
        e.check_invariants().unwrap();
        assert_eq!(e.stats().unwrap().reserved_bytes[0].current, reserved);
        dev.fail_unmap.store(false, Ordering::Relaxed);
        e.empty_cache().unwrap();
        assert_eq!(e.stats().unwrap().reserved_bytes[0].current, 0);
        e.check_invariants().unwrap();
    }

    #[test]
    fn record_stream_on_the_own_stream_frees_at_once() {
        let e = engine(flaky(1 << 30), MemoryLimit::Fraction(1.0));
        let p = e.malloc(Bytes(4096), S1).unwrap();
        e.record_stream(p, S1).unwrap();
        e.free(p).unwrap();
        assert_eq!(e.stats().unwrap().active_bytes[0].current, 0);
        assert_eq!(e.malloc(Bytes(4096), S1).unwrap(), p);
    }

    #[test]
    fn trace_started_mid_run_has_preexisting_blocks() {
        let dev = flaky(1 << 30);
        let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
        assert_eq!(e.take_trace().unwrap(), None);
        let a = e.malloc(Bytes(1000), S0).unwrap();
        let b = e.malloc(Bytes(2000), S0).unwrap();
        e.record_stream(a, S1).unwrap();
        e.free(a).unwrap(); // pending on S1
        e.start_trace().unwrap();
        assert!(e.is_tracing().unwrap());
        e.mark(MarkerKind::PhaseBegin, Some("fwd")).unwrap();
        e.free(b).unwrap();
        dev.host.events().pass_all(S1);
        let c = e.malloc(Bytes(300), S0).unwrap(); // completes a's free first
        e.mark_iteration().unwrap();
        let t = e.take_trace().unwrap().unwrap();
        assert!(!e.is_tracing().unwrap());
        t.validate().unwrap();
        assert_eq!(t.allocations.len(), 3);
        assert!(t.allocations[0].preexisting && t.allocations[1].preexisting);
        assert_eq!(
            (t.allocations[0].addr, t.allocations[0].size),
            (a.get(), Bytes(1000))
        );
        assert_eq!(t.allocations[2].addr, c.get());
        let kinds: Vec<EventKind> = t.events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            vec![
                EventKind::Marker {
                    kind: MarkerKind::PhaseBegin,
                    label: Some(0)
                },
                EventKind::FreeRequested(AllocId(1)),
                EventKind::FreeCompleted(AllocId(1)),
                EventKind::FreeCompleted(AllocId(0)),
                EventKind::Alloc(AllocId(2)),
                EventKind::Marker {
                    kind: MarkerKind::IterationBegin,
                    label: None
                },
            ]
        );
    }

    #[test]
    fn saved_tensor_events_name_the_live_allocation_at_the_pointer() {
        let dev = flaky(1 << 30);
        let e = engine(dev.clone(), MemoryLimit::Fraction(1.0));
        let a = e.malloc(Bytes(1000), S0).unwrap();
        assert_eq!(
            e.record_saved(a, SavedKind::Pack).unwrap(),
            None,
            "not tracing"
        );
        e.start_trace().unwrap();
        let b = e.malloc(Bytes(2048), S0).unwrap();
        assert_eq!(
            e.record_saved(b, SavedKind::Pack).unwrap(),
            Some(AllocId(1))
        );
        assert_eq!(
            e.record_saved(a, SavedKind::Pack).unwrap(),
            Some(AllocId(0))
        );
        assert_eq!(
            e.record_saved(DevicePtr(b.get() + 512), SavedKind::Pack)
                .unwrap(),
            None,
            "an interior pointer"
        );
        assert_eq!(
            e.record_saved(b, SavedKind::Unpack).unwrap(),
            Some(AllocId(1))
        );
        e.record_stream(b, S1).unwrap();
        e.free(b).unwrap(); // pending on S1
        assert_eq!(e.record_saved(b, SavedKind::Unpack).unwrap(), None, "freed");
        let t = e.take_trace().unwrap().unwrap();
        t.validate().unwrap();
        let kinds: Vec<EventKind> = t.events.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            vec![
                EventKind::Alloc(AllocId(1)),
                EventKind::SavedPack(AllocId(1)),
                EventKind::SavedPack(AllocId(0)),
                EventKind::SavedUnpack(AllocId(1)),
                EventKind::FreeRequested(AllocId(1)),
            ]
        );
    }
}
