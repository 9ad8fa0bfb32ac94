//! Engine replay: a [`Trace`] served by the real online engine ([`Engine`]) over an
//! accounting-only device ([`VirtualMemory`]: address ranges and mappings, no bytes), so
//! that what stweaver would reserve on a GPU is measured on a laptop.
//!
//! # What is replayed
//!
//! Preexisting allocations are allocated first, in `AllocId` order. Then every event in
//! order: `Alloc` → [`Engine::malloc`] of the requested size on its stream; the free
//! that ends the lifetime (`FreeCompleted`, or `FreeRequested` when the allocation has
//! no completed free) → [`Engine::free`]; iteration boundaries (below) →
//! [`Engine::mark_iteration`]; other markers → [`Engine::mark`] (they only matter to
//! the engine's own trace recording).
//!
//! **Iteration boundaries** are, in order of preference: the trace's `IterationBegin`
//! markers; else the ends of its `Optimizer.step` annotations (where the Python side's
//! optimizer hook calls `stweaver.step()` at run time); else the starts of the steady
//! iterations [`detect_period`] finds; else none ([`iteration_boundaries`]).
//!
//! # Modes ([`ServeMode`])
//!
//! - **online**: the engine alone;
//! - **plan**: a [`Plan`] loaded before the first request (for example one made by
//!   [`plan_first_iterations`] from the first iterations of the same trace: "plan from
//!   the first iterations, serve the whole run"); a plan the engine refuses is
//!   reported ([`EngineReplayReport::plan_error`]) and the run is served online;
//! - **auto**: the engine records its own trace online ([`Engine::start_trace`]) until an
//!   iteration boundary, a planner callback turns that recording into a plan (in a real
//!   run: a background thread), and the engine switches to it at a later boundary
//!   ([`Engine::switch_to_plan`]), the allocations of the online phase staying where
//!   they are. [`AutoSchedule`] says when: [`AutoSchedule::Runtime`] is the runtime's
//!   algorithm ([`crate::auto`]: the runtime and this replay share its constants and its
//!   planner call): plan at the boundary after `auto_iterations` recorded iterations,
//!   switch at the next one (the earliest the runtime can: it looks at the finished
//!   planner at the following step), empty the online cache one boundary after the
//!   switch; a planner error or a refused plan leaves the run online.
//!   [`AutoSchedule::At`] plans and switches at the same boundary (a planner that takes
//!   no time). A first plan without an iteration section, with a class planner given,
//!   starts a second recording of [`crate::auto::CLASS_ITERATIONS`] iterations, planned
//!   per iteration class and switched to on the same schedule. Serving a plan, an
//!   iteration the plan does not know starts a round of learning, as the
//!   runtime does ([`crate::auto`], learning after the switch: [`AutoRelearner`]);
//!   [`EngineReplayReport::relearned`] lists the boundaries where the merged plans
//!   were switched to. The report's [`AutoOutcome`] says whether and where the switch came,
//!   whether the engine gave the plan up later, or why the run stayed online (the trace
//!   ended first, the planner failed, the engine refused).
//!
//! # What is measured and checked
//!
//! Peak reserved (mapped) bytes, as the engine's stats report them and as the device
//! saw them (the two must agree); peak allocated and requested bytes; for each
//! allocation whether it was served at its planned offset, in a hole of the plan's pool
//! or by the online arenas ([`Served`]); the engine's [`PlanStats`].
//!
//! **No aliasing, checked at every step**: every live block `[ptr, ptr + rounded
//! size)` sits in an ordered map; each allocation is checked against its neighbours
//! there before it is inserted, so two live blocks that overlap fail the replay at the
//! event where it happens ([`EngineReplayError::Aliasing`]). The engine's own
//! consistency check ([`Engine::check_invariants`]) runs at every iteration boundary
//! and at the end.
//!
//! # The compare rows
//!
//! [`EngineReplayRow`] makes the engine rows of `stweaver compare`, with the runtime's
//! serving defaults ([`crate::auto::RELEASE_AT_PEAK`], the engine's default
//! [`ServeOptions`]):
//! - `stweaver (auto)`, the default and the headline: auto mode as the runtime runs it
//!   ([`AutoSchedule::Runtime`] with [`crate::auto::DEFAULT_AUTO_ITERATIONS`], the
//!   planner call [`crate::auto::plan_recording`] with
//!   [`crate::auto::auto_plan_options`]); the row's peak is the whole run's (the online
//!   phase included) and its outcome is the [`AutoOutcome`];
//! - `stweaver (online)`: the engine alone;
//! - `stweaver (plan mode)`: the plan of the first iterations ([`plan_first_iterations`];
//!   all but the last iteration, at most [`EngineReplayRow::iterations`]), refused as
//!   the runtime's plan mode refuses it when it is mostly left to dynamic serving
//!   ([`servable_from_start`]: then served online), else loaded before the first
//!   request, the whole trace served.
//!
//! Cost: O(events · log live) for the overlap map on top of the engine's own cost
//! (O(log n) per request), plus O(blocks) per boundary for the invariant check; a
//! 62 k-event trace replays in well under a second in release builds.

use std::collections::BTreeMap;
use std::sync::Arc;

use stweaver_core::engine::{
    DevicePtr, Engine, EngineConfig, EngineError, FakeEvents, PlanOptions as ServeOptions,
    PlanStats, VirtualMemory, servable_from_start,
};
use stweaver_core::{
    AllocId, Allocation, Bytes, Event, EventKind, MarkerKind, Plan, StreamId, Trace, TraceError,
};

use crate::auto::{
    DEFAULT_AUTO_ITERATIONS, RELEASE_AT_PEAK, RELEASE_CHURN, SWITCH_DELAY_STEPS, auto_plan_options,
    plan_class_recording, plan_recording, plan_relearned, planning_step,
};
use crate::iteration::detect_period;
use crate::planning::{PlanBuildError, PlanOptions, PlanOutcome, plan_trace};
use crate::report::{CompareRow, ReportError, RowKind, StweaverRow};

/// The mapping granularity of an H200 (and of every CUDA GPU stweaver targets).
pub const GRANULE: Bytes = Bytes(2 << 20);

/// Auto mode's planner: a recording to a plan, or the error the runtime reports.
pub type AutoPlanner<'a> = &'a dyn Fn(&Trace) -> Result<Plan, String>;

/// Auto mode's learning after the switch: the plan served and a later recording to the
/// plan with the classes it adds (`None`: nothing new), or the error the runtime
/// reports ([`crate::auto::plan_relearned`]).
pub type AutoRelearner<'a> = &'a dyn Fn(&Plan, &Trace) -> Result<Option<Plan>, String>;

/// How a trace is served.
pub enum ServeMode<'a> {
    /// The online engine alone.
    Online,
    /// `plan` loaded before the first request.
    Plan(&'a Plan),
    /// Online while recording, then the plan `planner` makes of the recording, switched
    /// in at an iteration boundary ([`AutoSchedule`] says which).
    Auto {
        schedule: AutoSchedule,
        planner: AutoPlanner<'a>,
        /// The planner per iteration class, for a first recording whose plan has no
        /// iteration section ([`crate::auto::needs_classes`]): the engine records
        /// [`crate::auto::CLASS_ITERATIONS`] more iterations for it (module docs of
        /// [`crate::auto`]). `None`: such a run stays online.
        class_planner: Option<AutoPlanner<'a>>,
        /// Learning after the switch to a plan per class (module docs of
        /// [`crate::auto`]): `None`, the plan per class stays as it is.
        relearner: Option<AutoRelearner<'a>>,
    },
}

/// When auto mode plans its recording and switches to the plan (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoSchedule {
    /// Planned at the `n`-th iteration boundary and switched to there, at once (a
    /// planner that takes no time); the cache is not emptied again afterwards.
    At(usize),
    /// As the runtime runs it ([`crate::auto`]): planned at boundary
    /// [`planning_step`]`(auto_iterations)`, switched to [`SWITCH_DELAY_STEPS`]
    /// boundaries later, the online cache emptied one boundary after the switch.
    Runtime { auto_iterations: u64 },
}

impl AutoSchedule {
    /// Auto mode as the runtime runs it by default ([`DEFAULT_AUTO_ITERATIONS`]).
    pub fn runtime_default() -> AutoSchedule {
        AutoSchedule::Runtime {
            auto_iterations: DEFAULT_AUTO_ITERATIONS,
        }
    }

    /// The boundary (1-based) at which the recording is planned.
    pub fn planning_boundary(self) -> usize {
        match self {
            AutoSchedule::At(n) => n,
            AutoSchedule::Runtime { auto_iterations } => planning_step(auto_iterations) as usize,
        }
    }

    /// Boundaries between planning and the switch.
    pub fn switch_delay(self) -> usize {
        match self {
            AutoSchedule::At(_) => 0,
            AutoSchedule::Runtime { .. } => SWITCH_DELAY_STEPS as usize,
        }
    }

    /// Whether the online cache is emptied one boundary after the switch.
    pub fn settles(self) -> bool {
        matches!(self, AutoSchedule::Runtime { .. })
    }
}

/// What auto mode did over a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AutoOutcome {
    /// Switched to the plan at iteration boundary `boundary` (1-based), before event
    /// `event`; `gave_up`: why the engine gave the plan up later, if it did.
    Switched {
        boundary: usize,
        event: usize,
        gave_up: Option<String>,
    },
    /// Served online from start to end, and why.
    Online(String),
}

impl std::fmt::Display for AutoOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AutoOutcome::Switched {
                boundary,
                event,
                gave_up,
            } => {
                write!(
                    f,
                    "switched to the plan at iteration {boundary} (event {event})"
                )?;
                match gave_up {
                    Some(why) => write!(f, ", then gave it up and served online: {why}"),
                    None => Ok(()),
                }
            }
            AutoOutcome::Online(why) => write!(f, "stayed online: {why}"),
        }
    }
}

impl ServeMode<'_> {
    /// Stable identifier.
    pub fn id(&self) -> &'static str {
        match self {
            ServeMode::Online => "online",
            ServeMode::Plan(_) => "plan",
            ServeMode::Auto { .. } => "auto",
        }
    }
}

/// Device and engine settings of a replay.
#[derive(Debug, Clone)]
pub struct EngineReplayOptions {
    /// Mapping granularity of the device.
    pub granule: Bytes,
    /// Device memory (the engine's limit is all of it).
    pub device_memory: Bytes,
    /// How the plan is served (look-ahead window and the like).
    pub serve: ServeOptions,
    /// Streams run behind the host: an event recorded (a stream-deferred free) passes
    /// only once the replay reaches the next multiple of this many trace events (and
    /// at every iteration boundary), instead of at once. A model of a GPU the host has run ahead
    /// of; it shows the conflicts and memory that cross-stream reuse costs. `None`:
    /// events pass at once.
    pub event_lag: Option<usize>,
    /// [`EngineConfig::release_before_new_peak`].
    pub release_before_new_peak: bool,
    /// [`EngineConfig::release_churn_iterations`].
    pub release_churn_iterations: u32,
    /// Print the device traffic so far at every iteration boundary (stderr).
    pub log_iterations: bool,
    /// Frees whose completion the trace records later than their request (a block
    /// `record_stream`ed to a side stream: an offloaded tensor's copy out) are freed
    /// at the request, pending on an event of a side stream that passes at the
    /// recorded completion ([`DEFERRED_FREE_STREAM`]), as the runtime serves them; off:
    /// freed at the completion. Events then pass only at those completions and at
    /// iteration boundaries (and with `event_lag`).
    pub deferred_frees: bool,
    /// Auto mode on the runtime's schedule: boundaries the background planner takes
    /// before the switch (`None`: [`SWITCH_DELAY_STEPS`], the earliest the runtime can
    /// switch). On the H100 the plan per class of len5's 40 recorded iterations came 6
    /// steps after planning started (BENCHMARKS.md, session 16).
    pub planner_steps: Option<usize>,
    /// [`EngineConfig::pool_unit`] (the runtime's default, 64 MiB, unless set).
    pub pool_unit: Bytes,
}

/// The side stream [`EngineReplayOptions::deferred_frees`] records its events on (no
/// trace stream has this id: a `cudaStream_t` is a pointer, aligned).
pub const DEFERRED_FREE_STREAM: StreamId = StreamId(0x5157_ea11);

impl Default for EngineReplayOptions {
    fn default() -> Self {
        EngineReplayOptions {
            granule: GRANULE,
            // An H200: 141 GB.
            device_memory: Bytes(141 * 1_000_000_000),
            serve: ServeOptions::default(),
            event_lag: None,
            release_before_new_peak: false,
            release_churn_iterations: 0,
            log_iterations: false,
            deferred_frees: false,
            planner_steps: None,
            pool_unit: Bytes(stweaver_core::engine::POOL_UNIT),
        }
    }
}

/// Where one allocation was served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Served {
    /// At its planned offset.
    Plan,
    /// In a hole of the plan's pool, or at its tail which grew for it (not planned,
    /// or its planned range was busy).
    Hole,
    /// By the online arenas.
    Online,
    /// Not allocated (never reached).
    NotServed,
}

/// How many allocations were served where.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServedCounts {
    pub plan: u64,
    pub hole: u64,
    pub online: u64,
}

impl ServedCounts {
    pub fn total(&self) -> u64 {
        self.plan + self.hole + self.online
    }
}

/// What a replay measured.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineReplayReport {
    pub mode: &'static str,
    /// The trace's lower bound (peak of live requested bytes).
    pub lower_bound: Bytes,
    /// Peak of mapped bytes (the engine's `reserved_bytes` peak, equal to the device's).
    pub peak_reserved: Bytes,
    /// Peaks of mapped bytes of the small-block and the large-block arenas (the plan
    /// pool counts as large), each reached at its own time (auto mode: from the switch
    /// on).
    pub peak_reserved_small: Bytes,
    pub peak_reserved_large: Bytes,
    /// Auto mode: the peak of mapped bytes from the switch on (`None` without a
    /// switch).
    pub peak_reserved_after_switch: Option<Bytes>,
    /// Peak of allocated (512-B rounded) bytes.
    pub peak_allocated: Bytes,
    /// Peak of requested bytes.
    pub peak_requested: Bytes,
    /// Where each allocation was served, by `AllocId`.
    pub served: Vec<Served>,
    /// The address each allocation got (0 if never allocated), by `AllocId`.
    pub addrs: Vec<u64>,
    pub counts: ServedCounts,
    /// The engine's plan statistics at the end (`None` if no plan was served).
    pub plan_stats: Option<PlanStats>,
    /// Bytes of the plan pool the engine mapped (0 without a plan).
    pub pool_size: Bytes,
    /// `mark_iteration` calls.
    pub iterations_marked: usize,
    /// Event index where the plan was switched in (auto mode), if it was.
    pub switched_at: Option<usize>,
    /// Auto mode: whether and where it switched to its plan, or why it stayed online.
    pub auto: Option<AutoOutcome>,
    /// Why the run was served online although a plan was given, if it was: the
    /// engine refused the plan (plan mode), or the planner failed or the engine refused
    /// its plan (auto mode).
    pub plan_error: Option<String>,
    /// Why the engine gave the plan up mid-run, if it did ([`Engine::plan_abandoned`]).
    pub plan_abandoned: Option<String>,
    /// Overlap checks made (one per allocation).
    pub overlap_checks: u64,
    /// Device traffic of the replay: maps, unmaps and whole-device synchronisations (a
    /// release of cached memory synchronises once).
    pub device_counters: stweaver_core::engine::HostCounters,
    /// The first [`MAX_CONFLICTS_KEPT`] conflicts, in order, with their occupants.
    pub conflicts: Vec<ConflictSeen>,
    /// At each iteration boundary, in order (before the boundary's own work: a switch or
    /// a settle): the bytes mapped then and the peak mapped so far. Drift over a long run
    /// is `peak_by_iteration[n] / peak_by_iteration[20]` (issue #18).
    pub reserved_by_iteration: Vec<Bytes>,
    pub peak_by_iteration: Vec<Bytes>,
    /// Auto mode: the boundaries at which the engine switched to a plan with the
    /// classes learned after the first switch (module docs of [`crate::auto`]).
    pub relearned: Vec<usize>,
}

impl EngineReplayReport {
    /// Peak reserved / lower bound.
    pub fn reserved_over_lb(&self) -> f64 {
        self.peak_reserved.ratio(self.lower_bound)
    }

    /// Of the requests the plan's cursor went through (hits, conflicts and expected
    /// requests passed over), the fraction served at the planned offset. 0 without a
    /// plan.
    pub fn planned_fraction(&self) -> f64 {
        match self.plan_stats {
            Some(s) if s.hits + s.conflicts + s.skipped > 0 => {
                s.hits as f64 / (s.hits + s.conflicts + s.skipped) as f64
            }
            _ => 0.0,
        }
    }
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineReplayError {
    #[error("the trace is invalid: {0}")]
    Trace(#[from] TraceError),
    #[error("event {event}: the engine failed to {what}: {error}")]
    Engine {
        event: usize,
        what: String,
        error: EngineError,
    },
    #[error(
        "event {event}: ALIASING: allocation {alloc} got [{start:#x}, {end:#x}), which overlaps live allocation {other} at [{other_start:#x}, {other_end:#x})"
    )]
    Aliasing {
        event: usize,
        alloc: AllocId,
        start: u64,
        end: u64,
        other: AllocId,
        other_start: u64,
        other_end: u64,
    },
    #[error(
        "event {event}: UNORDERED REUSE: allocation {alloc} on stream {stream} got [{start:#x}, {end:#x}), which allocation {other} used until its free, and stream {other_stream} has neither passed that free's event nor been waited for"
    )]
    Unordered {
        event: usize,
        alloc: AllocId,
        stream: StreamId,
        start: u64,
        end: u64,
        other: AllocId,
        other_stream: StreamId,
    },
    #[error("event {event}: allocation {alloc} got the misaligned address {ptr}")]
    Misaligned {
        event: usize,
        alloc: AllocId,
        ptr: DevicePtr,
    },
    #[error("the engine reports a reserved peak of {engine}, the device saw {device}")]
    ReservedMismatch { engine: Bytes, device: Bytes },
    #[error("the engine asked {count} time(s) to unmap part of a mapping (only whole ones may be)")]
    PartialUnmap { count: u64 },
}

/// The engine's plan-serving counters as JSON, one shape for every report that shows
/// them (`stweaver replay`, the runtime's `stats()`).
pub fn plan_stats_json(s: &PlanStats) -> serde_json::Value {
    serde_json::json!({
        "hits": s.hits,
        "conflicts": s.conflicts,
        "waits": s.waits,
        "unplanned": s.unplanned,
        "skipped": s.skipped,
        "iterations": s.iterations,
        "holes": s.holes,
        "grown": s.grown,
    })
}

/// Event indices where the replay calls `mark_iteration` (before handling the event),
/// ascending (module docs).
pub fn iteration_boundaries(trace: &Trace) -> Vec<usize> {
    let begin = trace.marker_events(|k, _| k == MarkerKind::IterationBegin);
    if !begin.is_empty() {
        return begin;
    }
    let steps = trace.marker_events(|k, l| {
        k == MarkerKind::PhaseEnd && l.is_some_and(|l| l.starts_with("Optimizer.step"))
    });
    if !steps.is_empty() {
        return steps;
    }
    detect_period(trace)
        .map(|p| {
            p.boundaries
                .iter()
                .map(|b| b.index())
                .filter(|&b| b < trace.events.len())
                .collect()
        })
        .unwrap_or_default()
}

/// The trace up to event `end` (exclusive): allocations made before it (and the
/// preexisting ones), renumbered in order, with the frees that happen before it.
/// Allocations still live at `end` are never freed in the prefix. O(events).
pub fn trace_prefix(trace: &Trace, end: usize) -> Trace {
    let end = end.min(trace.events.len());
    let mut new_id: Vec<Option<AllocId>> = vec![None; trace.allocations.len()];
    let mut allocations: Vec<Allocation> = Vec::new();
    for (i, a) in trace.allocations.iter().enumerate() {
        if a.preexisting {
            new_id[i] = Some(AllocId(allocations.len() as u32));
            allocations.push(*a);
        }
    }
    let mut events = Vec::with_capacity(end);
    for e in &trace.events[..end] {
        let kind = match e.kind {
            EventKind::Alloc(id) => {
                let n = AllocId(allocations.len() as u32);
                new_id[id.index()] = Some(n);
                allocations.push(trace.allocations[id.index()]);
                EventKind::Alloc(n)
            }
            EventKind::FreeRequested(id) => match new_id[id.index()] {
                Some(n) => EventKind::FreeRequested(n),
                None => continue,
            },
            EventKind::FreeCompleted(id) => match new_id[id.index()] {
                Some(n) => EventKind::FreeCompleted(n),
                None => continue,
            },
            EventKind::SavedPack(id) => match new_id[id.index()] {
                Some(n) => EventKind::SavedPack(n),
                None => continue,
            },
            EventKind::SavedUnpack(id) => match new_id[id.index()] {
                Some(n) => EventKind::SavedUnpack(n),
                None => continue,
            },
            m @ EventKind::Marker { .. } => m,
        };
        events.push(Event {
            kind,
            time_us: e.time_us,
        });
    }
    Trace {
        device: trace.device,
        allocations,
        events,
        labels: trace.labels.clone(),
        restores: Vec::new(),
    }
}

/// `trace` with an `IterationBegin` marker right after each event of `bounds` that is
/// not one already: what the engine itself records when `mark_iteration` is called at
/// those points. O(events).
pub fn with_iteration_markers(trace: &Trace, bounds: &[usize]) -> Trace {
    let mut events = Vec::with_capacity(trace.events.len() + bounds.len());
    let mut next = 0;
    for (i, e) in trace.events.iter().enumerate() {
        events.push(*e);
        while next < bounds.len() && bounds[next] < i {
            next += 1;
        }
        let already = matches!(
            e.kind,
            EventKind::Marker {
                kind: MarkerKind::IterationBegin,
                ..
            }
        );
        if next < bounds.len() && bounds[next] == i && !already {
            events.push(Event {
                kind: EventKind::Marker {
                    kind: MarkerKind::IterationBegin,
                    label: None,
                },
                time_us: e.time_us,
            });
        }
    }
    Trace {
        events,
        ..trace.clone()
    }
}

/// A plan made from the first `iterations` iterations of `trace` — the events up to
/// and including its `iterations`-th boundary ([`iteration_boundaries`]; the whole
/// trace if it has fewer), with `IterationBegin` markers at the boundaries as the
/// engine records them — and the event index where that prefix ends.
pub fn plan_first_iterations(
    trace: &Trace,
    iterations: usize,
    opts: &PlanOptions,
) -> Result<(PlanOutcome, usize), PlanBuildError> {
    let bounds = iteration_boundaries(trace);
    let end = match iterations.checked_sub(1).and_then(|k| bounds.get(k)) {
        Some(&b) => b + 1,
        None => trace.events.len(),
    };
    let prefix = with_iteration_markers(&trace_prefix(trace, end), &bounds);
    Ok((plan_trace(&prefix, opts)?, end))
}

/// Live blocks by address, to check that none overlap.
#[derive(Debug, Default)]
struct LiveRanges {
    /// start -> (end, alloc).
    map: BTreeMap<u64, (u64, AllocId)>,
    checks: u64,
}

impl LiveRanges {
    fn insert(
        &mut self,
        event: usize,
        alloc: AllocId,
        start: u64,
        end: u64,
    ) -> Result<(), EngineReplayError> {
        self.checks += 1;
        let clash = |other: AllocId, other_start: u64, other_end: u64| {
            Err(EngineReplayError::Aliasing {
                event,
                alloc,
                start,
                end,
                other,
                other_start,
                other_end,
            })
        };
        if let Some((&s, &(e, other))) = self.map.range(..end).next_back()
            && e > start
        {
            return clash(other, s, e);
        }
        self.map.insert(start, (end, alloc));
        Ok(())
    }

    fn remove(&mut self, start: u64) {
        self.map.remove(&start);
    }
}

/// Frees that recorded events (the block was used on other streams, or its planned
/// range is shared with another stream): the range and each recording (stream,
/// sequence number). Until every stream has passed them, memory in the range may only
/// be handed to a stream that is ordered after each recording (the same stream, or
/// one made to wait for the event: [`FakeEvents::ordered_after`]).
#[derive(Default)]
struct PendingRanges {
    list: Vec<PendingRange>,
}

/// `[start, end)` freed by allocation `alloc`, and the recordings its free made.
struct PendingRange {
    start: u64,
    end: u64,
    alloc: AllocId,
    recordings: Vec<(StreamId, u64)>,
}

impl PendingRanges {
    fn check(
        &self,
        events: &FakeEvents,
        event: usize,
        alloc: AllocId,
        stream: StreamId,
        start: u64,
        end: u64,
    ) -> Result<(), EngineReplayError> {
        for p in &self.list {
            if p.start >= end || start >= p.end {
                continue;
            }
            if let Some(&(on, _)) = p
                .recordings
                .iter()
                .find(|&&(on, seq)| !events.ordered_after(stream, on, seq))
            {
                return Err(EngineReplayError::Unordered {
                    event,
                    alloc,
                    stream,
                    start,
                    end,
                    other: p.alloc,
                    other_stream: on,
                });
            }
        }
        Ok(())
    }

    /// Forgets the frees whose recordings every stream has passed.
    fn prune(&mut self, events: &FakeEvents) {
        self.list
            .retain(|p| !p.recordings.iter().all(|&(on, seq)| events.passed(on, seq)));
    }
}

struct Replayer<'t> {
    trace: &'t Trace,
    engine: Engine<Arc<VirtualMemory>>,
    dev: Arc<VirtualMemory>,
    ptr: Vec<Option<DevicePtr>>,
    served: Vec<Served>,
    addrs: Vec<u64>,
    counts: ServedCounts,
    live: LiveRanges,
    pending: PendingRanges,
    plan_base: Option<(u64, u64)>,
    conflicts: Vec<ConflictSeen>,
}

/// Conflicts a report keeps (the first ones; the plan's stats count them all).
pub const MAX_CONFLICTS_KEPT: usize = 4096;

/// A request whose planned range was occupied when it came, and by what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConflictSeen {
    /// Trace event of the request.
    pub event: usize,
    pub alloc: AllocId,
    /// The planned range: its offset in the plan's pool and its length.
    pub offset: u64,
    pub len: Bytes,
    /// Live allocations overlapping the range (the occupants; the ones the plan
    /// expected gone).
    pub occupied_by: Vec<AllocId>,
    /// Freed allocations overlapping it whose frees still wait for other streams.
    pub pending: Vec<AllocId>,
}

impl Replayer<'_> {
    fn err(event: usize, what: impl Into<String>) -> impl FnOnce(EngineError) -> EngineReplayError {
        let what = what.into();
        move |error| EngineReplayError::Engine { event, what, error }
    }

    fn alloc(&mut self, event: usize, id: AllocId) -> Result<(), EngineReplayError> {
        let a = self.trace.allocations[id.index()];
        let before = self.plan_counts()?;
        let p = self
            .engine
            .malloc(a.size, a.stream)
            .map_err(Self::err(event, format!("allocate {id} ({})", a.size)))?;
        if !p.get().is_multiple_of(512) {
            return Err(EngineReplayError::Misaligned {
                event,
                alloc: id,
                ptr: p,
            });
        }
        let rounded = a.size.get().div_ceil(512) * 512;
        self.live.insert(event, id, p.get(), p.get() + rounded)?;
        self.pending.check(
            self.dev.events(),
            event,
            id,
            a.stream,
            p.get(),
            p.get() + rounded,
        )?;
        let after = self.plan_counts()?;
        if let Some((at, len)) = self
            .engine
            .take_last_conflict()
            .map_err(Self::err(event, "read its last conflict"))?
            && self.conflicts.len() < MAX_CONFLICTS_KEPT
        {
            let (lo, hi) = (at.get(), at.get() + len.get());
            let base = self.plan_base.map_or(0, |b| b.0);
            let occupied_by = self
                .live
                .map
                .range(..hi)
                .rev()
                .take_while(|(_, (end, _))| *end > lo)
                .map(|(_, &(_, a))| a)
                .filter(|&a| a != id)
                .collect();
            let pending = self
                .pending
                .list
                .iter()
                .filter(|p| p.start < hi && p.end > lo)
                .map(|p| p.alloc)
                .collect();
            self.conflicts.push(ConflictSeen {
                event,
                alloc: id,
                offset: lo.saturating_sub(base),
                len,
                occupied_by,
                pending,
            });
        }
        let served = if after.0 > before.0 {
            Served::Plan
        } else if after.1 > before.1 {
            Served::Hole
        } else {
            Served::Online
        };
        match served {
            Served::Plan => self.counts.plan += 1,
            Served::Hole => self.counts.hole += 1,
            _ => self.counts.online += 1,
        }
        self.served[id.index()] = served;
        self.addrs[id.index()] = p.get();
        self.ptr[id.index()] = Some(p);
        Ok(())
    }

    fn free(&mut self, event: usize, id: AllocId) -> Result<(), EngineReplayError> {
        if let Some(p) = self.ptr[id.index()].take() {
            self.live.remove(p.get());
            let mark = self.dev.events().recordings();
            self.engine
                .free(p)
                .map_err(Self::err(event, format!("free {id} at {p}")))?;
            let recs = self.dev.events().recorded_since(mark);
            if !recs.is_empty()
                && !recs
                    .iter()
                    .all(|&(on, seq)| self.dev.events().passed(on, seq))
            {
                let rounded = self.trace.allocations[id.index()].size.get().div_ceil(512) * 512;
                self.pending.list.push(PendingRange {
                    start: p.get(),
                    end: p.get() + rounded,
                    alloc: id,
                    recordings: recs,
                });
            }
        }
        Ok(())
    }

    /// Frees `id` as a block used on [`DEFERRED_FREE_STREAM`] too (`record_stream`):
    /// pending until that stream's event passes. The event's sequence number, if one
    /// was recorded and has not passed.
    fn free_deferred(
        &mut self,
        event: usize,
        id: AllocId,
    ) -> Result<Option<u64>, EngineReplayError> {
        let Some(p) = self.ptr[id.index()] else {
            return Ok(None);
        };
        self.engine
            .record_stream(p, DEFERRED_FREE_STREAM)
            .map_err(Self::err(event, format!("record_stream {id} at {p}")))?;
        let mark = self.dev.events().recordings();
        self.free(event, id)?;
        Ok(self
            .dev
            .events()
            .recorded_since(mark)
            .into_iter()
            .filter(|&(on, seq)| on == DEFERRED_FREE_STREAM && !self.dev.events().passed(on, seq))
            .map(|(_, seq)| seq)
            .max())
    }

    fn pool(&self) -> Result<Option<(u64, u64)>, EngineReplayError> {
        Ok(self
            .engine
            .plan_pool()
            .map_err(Self::err(0, "read the plan pool"))?
            .map(|(b, l)| (b.get(), l.get())))
    }

    /// Plan hits and hole placements so far.
    fn plan_counts(&self) -> Result<(u64, u64), EngineReplayError> {
        Ok(self
            .engine
            .plan_stats()
            .map_err(Self::err(0, "read plan stats"))?
            .map_or((0, 0), |s| (s.hits, s.holes)))
    }
}

/// Replays `trace` through the engine in `mode` (module docs).
pub fn replay_engine(
    trace: &Trace,
    mode: &ServeMode<'_>,
    opts: &EngineReplayOptions,
) -> Result<EngineReplayReport, EngineReplayError> {
    trace.validate()?;
    let dev = VirtualMemory::new(opts.device_memory, opts.granule);
    let dev = Arc::new(if opts.event_lag.is_some() || opts.deferred_frees {
        dev.manual_events()
    } else {
        dev
    });
    let config = EngineConfig {
        device: trace.device,
        record_trace: matches!(mode, ServeMode::Auto { .. }),
        release_before_new_peak: opts.release_before_new_peak,
        release_churn_iterations: opts.release_churn_iterations,
        pool_unit: opts.pool_unit,
        ..EngineConfig::default()
    };
    let engine = Engine::new(dev.clone(), config).map_err(Replayer::err(0, "start"))?;
    let n = trace.allocations.len();
    let mut r = Replayer {
        trace,
        engine,
        dev,
        ptr: vec![None; n],
        served: vec![Served::NotServed; n],
        addrs: vec![0; n],
        counts: ServedCounts::default(),
        live: LiveRanges::default(),
        pending: PendingRanges::default(),
        plan_base: None,
        conflicts: Vec::new(),
    };
    let mut plan_error = None;
    if let ServeMode::Plan(plan) = mode {
        // A plan the engine refuses is reported, and the run is served online, as in
        // a real run (training never dies because of a plan).
        match r.engine.load_plan(plan, opts.serve) {
            Ok(()) => r.plan_base = r.pool()?,
            Err(e) => plan_error = Some(e.to_string()),
        }
    }
    // The free that ends each lifetime.
    let ends: Vec<Option<usize>> = trace
        .lifetimes()
        .iter()
        .map(|l| l.end.map(|e| e.index()))
        .collect();
    // Deferred frees: where each allocation's free was requested, when its completion
    // came later (other events between the two); the side stream's sequence number of
    // its pending free once freed.
    let mut requested_at: Vec<Option<usize>> = vec![None; trace.allocations.len()];
    if opts.deferred_frees {
        for (i, e) in trace.events.iter().enumerate() {
            if let EventKind::FreeRequested(id) = e.kind
                && ends[id.index()].is_some_and(|end| end > i + 1)
            {
                requested_at[id.index()] = Some(i);
            }
        }
    }
    let mut deferred_seq: Vec<Option<u64>> = vec![None; trace.allocations.len()];
    for (i, a) in trace.allocations.iter().enumerate() {
        if a.preexisting {
            r.alloc(0, AllocId(i as u32))?;
        }
    }
    let bounds = iteration_boundaries(trace);
    let switch_delay = match mode {
        ServeMode::Auto { schedule, .. } if schedule.settles() => {
            opts.planner_steps.unwrap_or(schedule.switch_delay())
        }
        ServeMode::Auto { schedule, .. } => schedule.switch_delay(),
        _ => 0,
    };
    let mut next_bound = 0;
    let mut marked = 0;
    let mut switched_at = None;
    let mut before_switch: Option<(u64, u64, u64)> = None;
    // Auto mode: the planner's result and the boundary it is switched to at; the
    // boundary at which the online cache is emptied again; the outcome.
    let mut planned: Option<(Result<Plan, String>, usize)> = None;
    // Auto mode: the boundary at which the second recording (per iteration class) is
    // planned, once it started.
    let mut class_round: Option<usize> = None;
    let mut settle_at: Option<usize> = None;
    let mut auto: Option<AutoOutcome> = None;
    // Auto mode, learning after the switch to a plan per class: the plan served, the
    // plan counts at the last boundary (hits, misses), the boundary the round's
    // recording started at, its planner's result and the boundary to switch at, the
    // rounds so far, and the plan statistics of the plans given up for a merged one.
    let mut served_plan: Option<Plan> = None;
    let mut last_counts = (0u64, 0u64);
    let mut relearn_from: Option<usize> = None;
    let mut relearn_planned: Option<(Result<Option<Plan>, String>, usize)> = None;
    let mut relearn_rounds = 0u32;
    let mut relearned: Vec<usize> = Vec::new();
    let mut earlier_stats: Option<PlanStats> = None;
    let mut reserved_by_iteration = Vec::with_capacity(bounds.len());
    let mut peak_by_iteration = Vec::with_capacity(bounds.len());
    for (i, e) in trace.events.iter().enumerate() {
        if let Some(k) = opts.event_lag
            && k > 0
            && i % k == 0
        {
            r.dev.events().pass_everything();
            r.pending.prune(r.dev.events());
        }
        if next_bound < bounds.len() && bounds[next_bound] == i {
            next_bound += 1;
            reserved_by_iteration.push(r.dev.mapped_bytes());
            peak_by_iteration.push(r.dev.peak_mapped());
            if opts.event_lag.is_some() || opts.deferred_frees {
                r.dev.events().pass_everything();
                r.pending.prune(r.dev.events());
                r.pending.prune(r.dev.events());
            }
            r.engine
                .mark_iteration()
                .map_err(Replayer::err(i, "mark an iteration"))?;
            marked += 1;
            if opts.log_iterations {
                let c = r.dev.counters();
                eprintln!(
                    "iteration {marked}: device syncs {} maps {} unmaps {}",
                    c.synchronizes, c.maps, c.unmaps
                );
            }
            r.engine
                .check_invariants()
                .map_err(Replayer::err(i, "check its invariants"))?;
            if let ServeMode::Auto {
                schedule,
                planner,
                class_planner,
                relearner,
            } = mode
            {
                if settle_at == Some(marked) {
                    // The previous iteration's online blocks are gone: their memory goes
                    // back (the runtime's settle step).
                    r.engine
                        .empty_cache()
                        .map_err(Replayer::err(i, "empty its cache"))?;
                }
                if planned.is_none() && auto.is_none() && marked == schedule.planning_boundary() {
                    let recorded = r
                        .engine
                        .take_trace()
                        .map_err(Replayer::err(i, "hand over its trace"))?
                        .unwrap_or_default();
                    planned = Some((planner(&recorded), marked + switch_delay));
                }
                if let (Some(at), Some(cp)) = (class_round, class_planner)
                    && at == marked
                    && planned.is_none()
                    && auto.is_none()
                {
                    let recorded = r
                        .engine
                        .take_trace()
                        .map_err(Replayer::err(i, "hand over its trace"))?
                        .unwrap_or_default();
                    planned = Some((cp(&recorded), marked + switch_delay));
                }
                if let Some((result, at)) = planned.take_if(|(_, at)| *at == marked) {
                    debug_assert_eq!(at, marked);
                    match result {
                        Err(e) => {
                            auto = Some(AutoOutcome::Online(format!("planning failed: {e}")));
                            plan_error = Some(e);
                        }
                        Ok(plan)
                            if class_planner.is_some()
                                && class_round.is_none()
                                && crate::auto::needs_classes(&plan) =>
                        {
                            // No single repeating iteration: record again, for a plan
                            // per iteration class (module docs of `crate::auto`).
                            r.engine
                                .start_trace()
                                .map_err(Replayer::err(i, "record again"))?;
                            // As the runtime: planned CLASS_ITERATIONS whole
                            // iterations after this boundary.
                            class_round = Some(
                                marked + planning_step(crate::auto::CLASS_ITERATIONS) as usize,
                            );
                        }
                        Ok(plan) => {
                            // Peaks before the switch; the engine's peaks restart after
                            // it, so that what serving the plan costs is seen on its own.
                            let s = r.engine.stats().map_err(Replayer::err(i, "read stats"))?;
                            let pre = (
                                s.reserved_bytes[0].peak as u64,
                                s.allocated_bytes[0].peak as u64,
                                s.requested_bytes[0].peak as u64,
                            );
                            match r.engine.switch_to_plan(&plan, opts.serve) {
                                Ok(()) => {
                                    switched_at = Some(i);
                                    auto = Some(AutoOutcome::Switched {
                                        boundary: marked,
                                        event: i,
                                        gave_up: None,
                                    });
                                    r.plan_base = r.pool()?;
                                    before_switch = Some(pre);
                                    r.engine
                                        .reset_peak_stats()
                                        .map_err(Replayer::err(i, "reset its peaks"))?;
                                    if schedule.settles() {
                                        settle_at = Some(marked + 1);
                                    }
                                    served_plan = Some(plan);
                                }
                                Err(e) => {
                                    auto = Some(AutoOutcome::Online(format!(
                                        "the engine refused the plan: {e}"
                                    )));
                                    plan_error = Some(e.to_string());
                                }
                            }
                        }
                    }
                } else if let (Some(served), Some(relearn)) = (&served_plan, relearner) {
                    // Learning after the switch (module docs of `crate::auto`), as the
                    // runtime does it at each step.
                    let st = r
                        .engine
                        .plan_stats()
                        .map_err(Replayer::err(i, "read plan stats"))?
                        .unwrap_or_default();
                    let counts = (st.hits, st.unplanned + st.conflicts);
                    let (dh, dm) = (counts.0 - last_counts.0, counts.1 - last_counts.1);
                    last_counts = counts;
                    if let Some((result, _)) = relearn_planned.take_if(|(_, at)| *at == marked) {
                        if let Ok(Some(merged)) = result {
                            let prior = earlier_stats.unwrap_or_default();
                            earlier_stats = Some(add_stats(prior, st));
                            r.engine
                                .unload_plan()
                                .map_err(Replayer::err(i, "give the plan up"))?;
                            match r.engine.switch_to_plan(&merged, opts.serve) {
                                Ok(()) => {
                                    relearned.push(marked);
                                    served_plan = Some(merged);
                                    last_counts = (0, 0);
                                    r.plan_base = r.pool()?;
                                    if schedule.settles() {
                                        settle_at = Some(marked + 1);
                                    }
                                }
                                Err(e) => {
                                    // As the runtime: the served plan again.
                                    plan_error = Some(format!("the merged plan: {e}"));
                                    let old = served.clone();
                                    r.engine
                                        .switch_to_plan(&old, opts.serve)
                                        .map_err(Replayer::err(i, "serve the plan again"))?;
                                    last_counts = (0, 0);
                                    r.plan_base = r.pool()?;
                                }
                            }
                        }
                    } else if let Some(from) = relearn_from {
                        if marked - from == planning_step(crate::auto::RELEARN_ITERATIONS) as usize
                        {
                            let recorded = r
                                .engine
                                .take_trace()
                                .map_err(Replayer::err(i, "hand over its trace"))?
                                .unwrap_or_default();
                            relearn_planned =
                                Some((relearn(served, &recorded), marked + switch_delay));
                            relearn_from = None;
                            relearn_rounds += 1;
                        }
                    } else if relearn_planned.is_none()
                        && crate::auto::unknown_iteration(dh, dm)
                        && crate::auto::relearns(served, relearn_rounds)
                        && r.engine
                            .plan_abandoned()
                            .map_err(Replayer::err(i, "read plan state"))?
                            .is_none()
                    {
                        r.engine
                            .start_trace()
                            .map_err(Replayer::err(i, "record again"))?;
                        relearn_from = Some(marked);
                    }
                }
            }
        }
        match e.kind {
            EventKind::Alloc(id) => r.alloc(i, id)?,
            EventKind::FreeRequested(id) if requested_at[id.index()] == Some(i) => {
                deferred_seq[id.index()] = r.free_deferred(i, id)?;
            }
            EventKind::FreeRequested(id) | EventKind::FreeCompleted(id) => {
                if ends[id.index()] == Some(i) {
                    match deferred_seq[id.index()].take() {
                        // The side stream reaches this free's event (in order, as a
                        // stream does).
                        Some(seq) => {
                            let ev = r.dev.events();
                            while !ev.passed(DEFERRED_FREE_STREAM, seq)
                                && ev.pass_next(DEFERRED_FREE_STREAM)
                            {}
                            r.pending.prune(ev);
                        }
                        None if requested_at[id.index()].is_some() => {}
                        None => r.free(i, id)?,
                    }
                }
            }
            // Markers for the offload planner: nothing to allocate.
            EventKind::SavedPack(_) | EventKind::SavedUnpack(_) => {}
            EventKind::Marker { kind, label } => {
                let label = label.and_then(|l| trace.labels.get(l as usize));
                r.engine
                    .mark(kind, label.map(String::as_str))
                    .map_err(Replayer::err(i, "record a marker"))?;
            }
        }
    }
    let end = trace.events.len();
    r.engine
        .check_invariants()
        .map_err(Replayer::err(end, "check its invariants"))?;
    let stats = r.engine.stats().map_err(Replayer::err(end, "read stats"))?;
    let (pre_r, pre_a, pre_q) = before_switch.unwrap_or_default();
    let after_switch = Bytes(stats.reserved_bytes[0].peak as u64);
    let peak_reserved = Bytes(pre_r.max(after_switch.get()));
    let device = r.dev.peak_mapped();
    let partial = r.dev.counters().partial_unmaps;
    if partial > 0 {
        return Err(EngineReplayError::PartialUnmap { count: partial });
    }
    if device != peak_reserved {
        return Err(EngineReplayError::ReservedMismatch {
            engine: peak_reserved,
            device,
        });
    }
    let plan_stats = r
        .engine
        .plan_stats()
        .map_err(Replayer::err(end, "read plan stats"))?
        .map(|s| earlier_stats.map_or(s, |e| add_stats(e, s)));
    let plan_abandoned = r
        .engine
        .plan_abandoned()
        .map_err(Replayer::err(end, "read plan state"))?;
    let auto = match (mode, auto, planned, class_round) {
        (
            ServeMode::Auto { .. },
            Some(AutoOutcome::Switched {
                boundary, event, ..
            }),
            _,
            _,
        ) => Some(AutoOutcome::Switched {
            boundary,
            event,
            gave_up: plan_abandoned.clone(),
        }),
        (ServeMode::Auto { .. }, Some(online), _, _) => Some(online),
        (ServeMode::Auto { schedule, .. }, None, Some((_, at)), _) => {
            Some(AutoOutcome::Online(format!(
                "planned at iteration {}, the trace ends after {marked} iteration \
                 boundaries, before the switch at iteration {at}",
                schedule.planning_boundary()
            )))
        }
        (ServeMode::Auto { schedule, .. }, None, None, Some(class_at)) => {
            Some(AutoOutcome::Online(format!(
                "planned at iteration {}: no single repeating iteration, so auto mode records \
                 {} more for a plan per iteration class (planned at iteration {}); the trace \
                 ends after {marked} iteration boundaries",
                schedule.planning_boundary(),
                crate::auto::CLASS_ITERATIONS,
                class_at
            )))
        }
        (ServeMode::Auto { schedule, .. }, None, None, None) => Some(AutoOutcome::Online(format!(
            "the trace ends after {marked} iteration boundaries, before auto mode plans its \
             recording at the {}",
            ordinal(schedule.planning_boundary())
        ))),
        _ => None,
    };
    Ok(EngineReplayReport {
        auto,
        device_counters: r.dev.counters(),
        conflicts: std::mem::take(&mut r.conflicts),
        mode: mode.id(),
        plan_abandoned,
        lower_bound: trace.lower_bound().bytes,
        peak_reserved,
        peak_reserved_small: Bytes(stats.reserved_bytes[1].peak as u64),
        peak_reserved_large: Bytes(stats.reserved_bytes[2].peak as u64),
        peak_reserved_after_switch: switched_at.map(|_| after_switch),
        peak_allocated: Bytes(pre_a.max(stats.allocated_bytes[0].peak as u64)),
        peak_requested: Bytes(pre_q.max(stats.requested_bytes[0].peak as u64)),
        served: r.served,
        addrs: r.addrs,
        counts: r.counts,
        plan_stats,
        pool_size: Bytes(r.plan_base.map_or(0, |(_, l)| l)),
        iterations_marked: marked,
        switched_at,
        plan_error,
        overlap_checks: r.live.checks,
        reserved_by_iteration,
        peak_by_iteration,
        relearned,
    })
}

/// Two plans' statistics added up (a run that switched to a merged plan: both).
fn add_stats(a: PlanStats, b: PlanStats) -> PlanStats {
    PlanStats {
        hits: a.hits + b.hits,
        conflicts: a.conflicts + b.conflicts,
        waits: a.waits + b.waits,
        unplanned: a.unplanned + b.unplanned,
        holes: a.holes + b.holes,
        grown: a.grown + b.grown,
        skipped: a.skipped + b.skipped,
        iterations: a.iterations + b.iterations,
        hinted: a.hinted + b.hinted,
    }
}

/// "1st", "2nd", "3rd", "4th", ...
fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// Which mode an engine row of `stweaver compare` replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineRowMode {
    /// Auto mode as the runtime runs it ([`AutoSchedule::Runtime`]): the default.
    Auto,
    /// The online engine alone.
    Online,
    /// A plan of the first iterations ([`plan_first_iterations`]) loaded before the
    /// first request, the whole trace served, as plan mode serves a plan file.
    Plan,
}

impl EngineRowMode {
    /// The row's label.
    pub fn label(self) -> &'static str {
        match self {
            EngineRowMode::Auto => "stweaver (auto)",
            EngineRowMode::Online => "stweaver (online)",
            EngineRowMode::Plan => "stweaver (plan mode)",
        }
    }

    /// The row's kind.
    pub fn kind(self) -> RowKind {
        match self {
            EngineRowMode::Auto => RowKind::StweaverAuto,
            EngineRowMode::Online => RowKind::StweaverOnline,
            EngineRowMode::Plan => RowKind::StweaverPlanMode,
        }
    }
}

/// An engine row of `stweaver compare` (module docs): the trace replayed through the
/// engine in one mode, with the runtime's serving defaults.
#[derive(Debug, Clone)]
pub struct EngineReplayRow {
    pub mode: EngineRowMode,
    /// Auto mode: iterations recorded before planning (the runtime's
    /// `STWEAVER_AUTO_ITERATIONS`).
    pub auto_iterations: u64,
    /// Auto mode: the planner's settings ([`auto_plan_options`], as the runtime's).
    pub auto_plan: PlanOptions,
    /// Plan mode: plan from at most this many first iterations (never the last one: the
    /// row shows a run served beyond what was planned).
    pub iterations: usize,
    /// Plan mode: the planner's settings.
    pub plan: PlanOptions,
    pub replay: EngineReplayOptions,
}

impl EngineReplayRow {
    /// The row of `mode` with the runtime's defaults ([`crate::auto`]).
    pub fn new(mode: EngineRowMode) -> EngineReplayRow {
        EngineReplayRow {
            mode,
            auto_iterations: DEFAULT_AUTO_ITERATIONS,
            auto_plan: auto_plan_options(false),
            iterations: 3,
            plan: PlanOptions::default(),
            replay: EngineReplayOptions {
                release_before_new_peak: RELEASE_AT_PEAK,
                // As the runtime: the churn stop in online mode only.
                release_churn_iterations: if matches!(mode, EngineRowMode::Online) {
                    RELEASE_CHURN
                } else {
                    0
                },
                ..EngineReplayOptions::default()
            },
        }
    }

    /// Plan mode: the iterations planned for `trace`: all but the last, at most
    /// `self.iterations`, at least one.
    pub fn planned_iterations(&self, trace: &Trace) -> usize {
        let bounds = iteration_boundaries(trace).len();
        self.iterations.min(bounds.saturating_sub(1)).max(1)
    }

    /// The replay behind the row, and what the mode decided (the row's outcome).
    pub fn replay(&self, trace: &Trace) -> Result<(EngineReplayReport, String), String> {
        let e = |e: EngineReplayError| e.to_string();
        match self.mode {
            EngineRowMode::Online => {
                let r = replay_engine(trace, &ServeMode::Online, &self.replay).map_err(e)?;
                Ok((r, "served online".into()))
            }
            EngineRowMode::Auto => {
                let planner = |recorded: &Trace| plan_recording(recorded, &self.auto_plan);
                let class_planner =
                    |recorded: &Trace| plan_class_recording(recorded, &self.auto_plan);
                let relearner = |served: &Plan, recorded: &Trace| {
                    plan_relearned(served, recorded, &self.auto_plan)
                };
                let mode = ServeMode::Auto {
                    schedule: AutoSchedule::Runtime {
                        auto_iterations: self.auto_iterations,
                    },
                    planner: &planner,
                    class_planner: Some(&class_planner),
                    relearner: Some(&relearner),
                };
                let r = replay_engine(trace, &mode, &self.replay).map_err(e)?;
                let outcome = match (&r.auto, r.peak_reserved_after_switch) {
                    (Some(o @ AutoOutcome::Switched { gave_up: None, .. }), Some(after)) => {
                        format!(
                            "{o}; peak reserved from there {} ({:.4} x LB)",
                            after.human(),
                            after.ratio(r.lower_bound)
                        )
                    }
                    (Some(o), _) => o.to_string(),
                    (None, _) => "no outcome".into(),
                };
                Ok((r, outcome))
            }
            EngineRowMode::Plan => {
                let k = self.planned_iterations(trace);
                let (outcome, cut) =
                    plan_first_iterations(trace, k, &self.plan).map_err(|e| e.to_string())?;
                let what = format!(
                    "a plan of the first {k} iteration(s) (events 0..{cut} of {}, pool {})",
                    trace.events.len(),
                    outcome.plan.pool_size
                );
                // As the runtime's plan mode: a one-shot plan mostly left to dynamic
                // serving is refused, and the run is served online.
                if let Err(why) = servable_from_start(&outcome.plan) {
                    let r = replay_engine(trace, &ServeMode::Online, &self.replay).map_err(e)?;
                    return Ok((r, format!("refused {what}, served online: {why}")));
                }
                let r = replay_engine(trace, &ServeMode::Plan(&outcome.plan), &self.replay)
                    .map_err(e)?;
                let outcome = match (&r.plan_error, &r.plan_abandoned) {
                    (Some(why), _) => format!("the engine refused {what}, served online: {why}"),
                    (None, Some(why)) => format!("served {what}, then gave it up: {why}"),
                    (None, None) => format!("served {what}"),
                };
                Ok((r, outcome))
            }
        }
    }
}

impl StweaverRow for EngineReplayRow {
    fn row(&self, trace: &Trace) -> Result<Option<CompareRow>, ReportError> {
        let label = self.mode.label();
        let (r, outcome) = self.replay(trace).map_err(|problem| ReportError::Row {
            row: label,
            problem,
        })?;
        Ok(Some(CompareRow {
            kind: self.mode.kind(),
            label: label.into(),
            peak_reserved: r.peak_reserved,
            peak_allocated: r.peak_allocated,
            detail: format!(
                "the engine over an accounting-only device ({} granules, release at a new \
                 peak {}): {} requests at their planned offset, {} in pool holes, {} online; \
                 no overlap in {} checks",
                self.replay.granule,
                if self.replay.release_before_new_peak {
                    "on"
                } else {
                    "off"
                },
                r.counts.plan,
                r.counts.hole,
                r.counts.online,
                r.overlap_checks
            ),
            outcome: Some(outcome),
            seconds: 0.0,
        }))
    }
}
