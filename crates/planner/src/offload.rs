//! Planned offload of saved activations under a device memory budget
//! ([`plan_with_budget`]), TENSILE-style: when the plan's pool is above the budget,
//! choose which autograd-saved activations go to pinned host memory between forward
//! and backward, moving as few bytes as the budget allows.
//!
//! # The model
//!
//! A stweaver trace records autograd's saved tensors (`SavedPack` in forward,
//! `SavedUnpack` in backward, each naming the allocation that is the tensor's whole
//! storage). Offloading tensor `i` splits its allocation in two requests:
//!
//! - the **out** request, live from its alloc until its copy to host is done: at the
//!   pack the runtime starts an async copy on a side stream and drops the device
//!   reference, so its free is *requested* at the pack and *completes* when the copy
//!   is done;
//! - the **back** request, of the same size, live from the prefetch *trigger* until the
//!   original free (the copy back lands there before the unpack needs it).
//!
//! **Clock.** The host runs ahead of the device, so a trace's time stamps are not the
//! device's. By default ([`Timing::SpreadPhases`]) an iteration lasts
//! [`OffloadOptions::iteration_us`] (given: e.g. the step time measured without offload;
//! else the fastest iteration between two iteration markers of the trace, an upper
//! bound), forward (up to the iteration's first unpack) takes
//! [`OffloadOptions::forward_share`] of it ([`DEFAULT_FORWARD_SHARE`], a third) and
//! each phase is spread evenly over its requests. [`Timing::TraceTimes`] takes the time
//! stamps as they are; a trace without usable times is timed by event counts
//! ([`US_PER_REQUEST_WITHOUT_TIMES`] µs per request). Copies move at a link bandwidth
//! ([`DEFAULT_LINK_GBPS`] per direction, a conservative half of the 55 GB/s pinned
//! measured on an H100), serialised per direction: copies out in pack order, copies back
//! in the order their unpacks need them, a copy back starting at `max(trigger, its copy
//! out done, the previous copy back done)`. The trigger is the latest unpack (of another
//! tensor, after the last pack that precedes the tensor's own unpack) from which the
//! copy back still completes before the unpack; when none does, the copy back starts
//! right after that last pack (the end of forward,
//! [`stweaver_core::OffloadEntry::prefetch_after_unpack`] `None`) and the unpack waits:
//! a *stall*, reported.
//!
//! **Reuse** ([`OutReuse`]): by default an offloaded tensor's memory is reused only once
//! its copy out is done on that clock, so compute does not wait for it. When the link
//! cannot move the bytes the peak needs out before the peak (forward too short), the
//! plan makes compute **wait** there: the selection below fails at a request where no
//! candidate's copy is done, and a wait is inserted at that request (every later event
//! happens that much later, copies go on), the shortest that lets the selection past it
//! (binary search); at most eight such points. The
//! run waits the same way: the engine makes a planned request wait on the copy stream's
//! event of a range still being copied out. The planned wait is
//! [`OffloadReport::copy_out_wait_us`]. A copy back that cannot be in time for a window
//! to cover a peak is likewise started at the first trigger past it, stalling its unpack.
//!
//! # The transform
//!
//! A trace recorded with offload (restore links) is first rewritten into the run
//! without offload ([`crate::unoffload`]), so every tensor the recording offloaded is
//! a candidate again. Build: choose the set (below) → rewrite the trace (every complete steady iteration
//! alike, at the same plan-clock positions: a `FreeRequested` of the out request right
//! after the pack, its `FreeCompleted` before the first request at or after the
//! estimated copy-out completion (no later than the unpack), a new `Alloc` of the back
//! request right after the request that precedes the trigger, and the original frees
//! and the unpack moved to the back request) → plan the rewritten trace with the
//! ordinary planner ([`plan_trace`]) → check `pool <= budget`. The solver's pool may
//! land a hair above the rewritten lower bound and so above the budget; then the target
//! is lowered by the difference and the set chosen again (at most
//! [`MAX_ATTEMPTS`] times).
//!
//! # Selection
//!
//! Candidates: iteration slots whose representative allocation is at least
//! [`OffloadOptions::min_tensor_bytes`] (1 MiB: each offloaded tensor costs the host two
//! hook calls and their CUDA calls whatever its size) and has exactly one pack and one
//! unpack, the pack before the unpack, both in the steady iteration, and whose
//! copies in every complete steady iteration have them at the same positions. The
//! profile is `V[t]`, the live padded bytes of the planned allocations after request
//! `t` of the whole trace (prologue included: it is served from the same pool), held
//! in a segment tree (range add, global max with its position). Offloading a candidate
//! subtracts its size over its *freed window* (copy out done → trigger) in each copy.
//!
//! Greedy: while `max V > target`, among the unchosen candidates whose freed window
//! covers the current peak tick, take the one with the most bytes saved over the
//! target per byte moved (`min(size, excess) / size`; ties: the longer window, then the
//! larger tensor), assuming it alone on the link (its *standalone* window, the largest
//! it can have); when the peak is under the target, simulate the copy queues for the
//! chosen set and apply the actual windows, and go on if the peak rose again. When no
//! unchosen candidate's window covers the peak tick, a chosen one whose copy out is done
//! by then but whose copy back the queue started before it (too late for its unpack on
//! any trigger, it got the earliest) is made to start its copy back past the peak: a
//! longer stall, no more bytes; only then is an unchosen one taken with a stall. Then
//! drop, largest first, every chosen tensor whose removal keeps the peak under the
//! target (removing one only widens the others' windows), and simulate once more.
//!
//! **Minimum**: the peak with every candidate offloaded on its widest window (free from
//! its pack to its last trigger: any wait at all). No choice and no schedule in this
//! model does better, and the pool is at least the peak, so a budget below it is refused
//! ([`OffloadError::BelowMinimum`], naming what holds it).
//!
//! # Cost
//!
//! O(E) to analyse the trace (E events), O(T) to build the tree (T requests); the
//! greedy makes at most C picks (C candidates), each O(C·k + w·k·log T) (k copies per
//! candidate, w the ticks of a window, here applied as one range update: O(k log T)),
//! every queue simulation is O(S log S + S·u) (S chosen, u unpacks per iteration); the
//! prune is O(S·k·log T). Then one ordinary plan per attempt, which dominates.

use rustc_hash::FxHashMap;
use stweaver_core::trace_file::trace_digest;
use stweaver_core::verify::{PlanViolations, verify_plan};
use stweaver_core::{
    AllocId, Allocation, Bytes, Event, EventKind, MarkerKind, OffloadEntry, Trace, TraceError,
};

use crate::classify::{AllocClass, Classification, Steady, plan_clock};
use crate::planning::{ALIGNMENT, PlanBuildError, PlanOptions, PlanOutcome, plan_trace};
use crate::unoffload::un_offload_with_releases;

/// Link bandwidth per direction assumed by default, in GB/s (10^9 bytes per second):
/// half of the 55 GB/s pinned host ↔ device measured on an H100.
pub const DEFAULT_LINK_GBPS: f64 = 25.0;

/// Without usable time stamps, each allocator request of the iteration counts as this
/// many microseconds (a transformer step on a big GPU makes a request every few tens
/// of µs; the lower figure leaves copies less time, so the schedule errs on stalls
/// rather than on memory).
pub const US_PER_REQUEST_WITHOUT_TIMES: f64 = 20.0;

/// The share of a training iteration's device time spent in forward, by default: a
/// backward pass does twice a forward's arithmetic (the gradients of both operands of
/// every matmul), so forward is about a third of forward + backward. Measured on an H100
/// without recomputation (device time from CUDA events, `budget_bench.py`'s phases):
/// Llama 1B 91 of 290 ms (0.31), GPT-2 XL 60 of 178 ms (0.34), optimizer step included.
/// Spreading the period evenly over the requests instead gave forward about half of the
/// iteration on Llama 1B: the schedule then expected its copies out to be done long before
/// the device got there, and compute waited for them.
pub const DEFAULT_FORWARD_SHARE: f64 = 1.0 / 3.0;

/// Copy-out waits searched before a budget is declared out of reach: the binary search
/// over the planned wait ([`OffloadReport::copy_out_wait_us`]) stops at this relative
/// precision.
const WAIT_SEARCH_STEPS: usize = 14;

/// Points of an iteration where a plan may make compute wait for copies out.
const MAX_WAIT_POINTS: usize = 8;

/// Share of the budget a plan leaves free beside its pool and [`serving_headroom`], for
/// what a run does that its recording did not (a request in a pool hole, a conflict).
/// Plans on the H100 that gave their pool up in their first scheduled iteration did so
/// with or without it: the cause was the planner counting on memory the program still
/// held (tensors scheduled but not offloadable, tensors read after their pack), fixed in
/// the model (`r_release`, whole-storage packs); with that fix every budget row the planner
/// accepted on the H100 bench kept its plan (BENCHMARKS.md, session 10). The margin stays
/// as slack.
pub const DEFAULT_MARGIN: f64 = 0.02;

/// The smallest saved tensor a plan offloads, by default: as threshold offload's
/// (`STWEAVER_OFFLOAD_MIN_BYTES`, 1 MiB). Each offloaded tensor costs the host a pack and an
/// unpack hook with their copies and events whatever its size (65-110 µs a call, the hooks
/// alone, on an H100 host: `STWEAVER_TIME_CALLS`, BENCHMARKS.md session 18); a GPT-2 XL plan
/// offloaded 78 tensors of 1 B to 800 KiB (9 MB in all) beside 33 of 13-105 MB, and its
/// hooks took 13.3 ms of forward's host time (8.2 ms with this minimum).
pub const DEFAULT_MIN_TENSOR_BYTES: u64 = 1 << 20;

/// The host cost of one offloaded tensor, in µs of link time, that the selection may weigh
/// beside its bytes (its score is then bytes saved over `bytes + per_tensor_us x link`), so
/// that of two tensors that free as much at the peak the larger one's fewer copies win.
/// **Off by default (0)**: at 100 µs it chose 18 instead of 34 tensors for the same bytes on
/// the GPT-2 XL trace of session 18, but on `trace_llama1b_norcp_offload` it left a 1.5 ms
/// copy-back stall at 0.7 x LB and a plan the engine replay served with 153 conflicts at
/// 0.8 x LB (`tests/offload_real.rs`), where bytes alone give neither; not yet understood.
pub const DEFAULT_PER_TENSOR_US: f64 = 0.0;

/// Plans tried before giving up on a budget the selection should reach. Each attempt
/// after an overshoot lowers the selection's target by the overshoot, doubled at every
/// further attempt (an H100 run stopped 3.87 MiB over after five attempts that each
/// lowered it by the last overshoot alone).
pub const MAX_ATTEMPTS: usize = 8;

/// How to plan under a budget.
#[derive(Debug, Clone)]
pub struct OffloadOptions {
    /// Device memory the plan's pool must fit in.
    pub budget: Bytes,
    /// Host link bandwidth per direction, GB/s.
    pub link_gbps: f64,
    /// How to plan (the same options as [`plan_trace`]).
    pub plan: PlanOptions,
    /// When the out request's memory may be reused ([`OutReuse`]; default
    /// [`OutReuse::AfterCopy`]).
    pub reuse: OutReuse,
    /// Time events by the trace's host `time_us` as they are ([`Timing::TraceTimes`])
    /// instead of the iteration's period spread over its requests.
    pub host_times: bool,
    /// The share of the steady iteration's duration that forward takes on the device
    /// (from the iteration's start to its first unpack), each phase's time spread over
    /// its requests ([`Timing::SpreadPhases`]); `None`: the whole period spread evenly
    /// ([`Timing::SpreadPeriod`]). Default [`DEFAULT_FORWARD_SHARE`].
    pub forward_share: Option<f64>,
    /// The device time of one iteration, µs (spread timings): what the schedule's copies
    /// are timed against. `None`: the fastest iteration between two iteration markers of
    /// the trace (the trace's host clock: an upper bound, as recording slows the host).
    pub iteration_us: Option<f64>,
    /// Share of the budget kept free beside the pool and [`serving_headroom`]
    /// ([`DEFAULT_MARGIN`]).
    pub margin: f64,
    /// Saved tensors smaller than this are never offloaded ([`DEFAULT_MIN_TENSOR_BYTES`]).
    pub min_tensor_bytes: Bytes,
    /// Host cost per offloaded tensor in µs of link time, weighed by the selection
    /// ([`DEFAULT_PER_TENSOR_US`]).
    pub per_tensor_us: f64,
}

impl OffloadOptions {
    pub fn new(budget: Bytes) -> Self {
        OffloadOptions {
            budget,
            link_gbps: DEFAULT_LINK_GBPS,
            plan: PlanOptions::default(),
            reuse: OutReuse::AfterCopy,
            host_times: false,
            forward_share: Some(DEFAULT_FORWARD_SHARE),
            iteration_us: None,
            margin: DEFAULT_MARGIN,
            min_tensor_bytes: Bytes(DEFAULT_MIN_TENSOR_BYTES),
            per_tensor_us: DEFAULT_PER_TENSOR_US,
        }
    }
}

/// When an offloaded tensor's device memory may be reused by a later request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutReuse {
    /// Once its copy to host is done in the schedule's (device-paced) time: the plan
    /// places nothing in the range before then, so compute never waits on a copy out
    /// while the model's times hold (the default). On the H100 (Llama 1B without
    /// recomputation, 0.8 x LB) the plan reusing at the pack ran 1.70 x the unlimited
    /// step: every reuse made compute wait for a copy that had just started, which
    /// serialised forward with its copies.
    #[default]
    AfterCopy,
    /// Right after the pack: the engine serves a planned request whose range is held
    /// only by a free pending on the copy stream by making the request's stream wait
    /// for the copy on the device (`PlanOptions::wait_for_pending_frees`), so the host
    /// never waits, but compute does, for each copy out it reuses. The longest freed
    /// windows, hence the smallest minimum.
    AtPack,
}

impl OutReuse {
    pub fn id(self) -> &'static str {
        match self {
            OutReuse::AfterCopy => "after-copy",
            OutReuse::AtPack => "at-pack",
        }
    }
}

impl std::str::FromStr for OutReuse {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "after-copy" => Ok(OutReuse::AfterCopy),
            "at-pack" => Ok(OutReuse::AtPack),
            _ => Err(format!("expected after-copy or at-pack, not {s:?}")),
        }
    }
}

/// Where the schedule's times came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// The trace's `time_us` ([`OffloadOptions::host_times`]).
    TraceTimes,
    /// The iteration's duration ([`OffloadOptions::iteration_us`], else the trace's
    /// fastest marked iteration) spread evenly over its requests (`forward_share: None`).
    /// On a GPU the host runs ahead of the device within an iteration and waits at its
    /// end, so the host times of a forward and backward pass are a fraction of the
    /// device's; spreading the period is the device's pace to first order, but gives
    /// forward too much of it (its requests are many and its arithmetic a third).
    SpreadPeriod,
    /// The period split between forward (up to the iteration's first unpack) and the rest
    /// by [`OffloadOptions::forward_share`], each part spread evenly over its requests:
    /// the default.
    SpreadPhases,
    /// Event counts ([`US_PER_REQUEST_WITHOUT_TIMES`]).
    EventCounts,
}

impl Timing {
    pub fn id(self) -> &'static str {
        match self {
            Timing::TraceTimes => "trace_times",
            Timing::SpreadPeriod => "spread_period",
            Timing::SpreadPhases => "spread_phases",
            Timing::EventCounts => "event_counts",
        }
    }
}

/// What [`plan_with_budget`] reports besides the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadReport {
    pub budget: Bytes,
    /// The pool of the returned plan (its planned device peak).
    pub planned_peak: Bytes,
    /// The pool of the plan without offload.
    pub pool_without_offload: Bytes,
    /// Tensors moved per iteration, and their bytes.
    pub tensors: usize,
    pub bytes_per_iteration: Bytes,
    /// Tensors that could have been moved, and their bytes ("offload everything").
    pub candidates: usize,
    pub candidate_bytes: Bytes,
    /// The model's minimum peak (every candidate offloaded); 0 when no offload was needed.
    pub minimum: Bytes,
    /// Copies back that finish after their unpack, and the iteration's delay from them
    /// (the longest: a stall delays every later unpack as well).
    pub stalls: usize,
    pub stall_us: f64,
    /// The planned wait for copies out per iteration: when the link cannot move enough
    /// bytes out before the peak (forward too short for them), compute waits there this
    /// long for the copies the peak needs done (the engine makes it wait on the copy
    /// stream's events); 0 when the budget is met without.
    pub copy_out_wait_us: f64,
    pub timing: Timing,
    pub link_gbps: f64,
    pub reuse: OutReuse,
    /// Plans made (1 when no offload was needed).
    pub attempts: usize,
}

/// A plan made under a budget.
#[derive(Debug, Clone)]
pub struct BudgetOutcome {
    /// The plan (of the rewritten trace when it offloads; `budget` and `offload` set)
    /// with its report and classification.
    pub outcome: PlanOutcome,
    pub offload: OffloadReport,
    /// The trace as the run will look with the schedule applied (what the plan's
    /// requests are made from; `None` without offload): replay it against the plan to
    /// see the engine serve it (`engine_replay`).
    pub rewritten: Option<Trace>,
}

/// What holds the minimum peak (see [`OffloadError::BelowMinimum`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinimumAt {
    /// Request tick of the whole trace where the minimum peak is reached.
    pub tick: u64,
    /// True when that tick is before the steady state (the prologue, where nothing is
    /// offloaded).
    pub in_prologue: bool,
    /// Persistent bytes live there (parameters, optimizer state, ...).
    pub persistent: Bytes,
    /// The other live bytes there, which no offload can move.
    pub unmovable: Bytes,
}

/// Why no plan fits the budget.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    #[error(transparent)]
    Plan(#[from] PlanBuildError),
    #[error("the trace is invalid: {0}")]
    Trace(#[from] TraceError),
    #[error("the link bandwidth must be a positive number of GB/s, not {0}")]
    BadBandwidth(f64),
    #[error(
        "the plan needs {pool} (lower bound {lower_bound}), more than the budget {budget}, and the trace records no saved tensors (SavedPack events; PyTorch snapshots never do): record the trace with stweaver's trace mode, which records autograd's saved tensors, to plan offload"
    )]
    NoSavedTensors {
        pool: Bytes,
        lower_bound: Bytes,
        budget: Bytes,
    },
    #[error(
        "the plan needs {pool}, more than the budget {budget}, and the trace has no steady state to offload in"
    )]
    NoSteadyState { pool: Bytes, budget: Bytes },
    #[error(
        "the budget {budget} is below the minimum {minimum} (every one of {candidates} offloadable tensors offloaded): at request {} ({}) {} persistent and {} of other live tensors that cannot be offloaded", at.tick, if at.in_prologue { "in the prologue, before the steady state, where the plan moves nothing: record the trace with STWEAVER_OFFLOAD=1, whose first iteration offloads as a budgeted run's does" } else { "in the steady state" }, at.persistent, at.unmovable
    )]
    BelowMinimum {
        budget: Bytes,
        minimum: Bytes,
        candidates: usize,
        at: MinimumAt,
    },
    #[error(
        "no schedule found within the budget {budget} (minimum {minimum}): the best plan needs {best_pool} after {attempts} attempts ({reason})"
    )]
    NotReached {
        budget: Bytes,
        minimum: Bytes,
        best_pool: Bytes,
        attempts: usize,
        reason: String,
    },
    #[error("internal error: the offload plan failed verification: {0}")]
    Invalid(PlanViolations),
    #[error("internal error: {0}")]
    Internal(String),
}

/// `trace` without the restore links of the tensors packed before its first iteration
/// marker: the first iteration (before the first `stweaver.step()`) is the plan's
/// prologue, which carries no schedule and offloads at run time as it did when recorded
/// (by threshold, under a budget), so it stays as recorded; the later iterations'
/// offloads are undone and chosen again. A trace without iteration markers keeps every
/// link (all undone).
fn keep_first_iteration_offloaded(trace: &Trace) -> Trace {
    let Some(first) = trace.events.iter().position(|e| {
        matches!(
            e.kind,
            EventKind::Marker {
                kind: MarkerKind::IterationBegin | MarkerKind::IterationEnd,
                ..
            }
        )
    }) else {
        return trace.clone();
    };
    let mut packed_early = vec![false; trace.allocations.len()];
    for e in &trace.events[..first] {
        if let EventKind::SavedPack(a) = e.kind {
            packed_early[a.index()] = true;
        }
    }
    let mut t = trace.clone();
    t.restores.retain(|r| !packed_early[r.from.index()]);
    t
}

/// Plans `trace` so that the pool fits `opts.budget`, offloading saved activations if
/// it must (module docs).
///
/// A trace recorded with offload (restore links, [`Trace::restores`]) is planned as
/// the run without offload ([`crate::unoffload::un_offload`]), so the tensors it
/// offloaded are chosen again; the plan's `trace_digest` is that of `input`, links
/// included, and [`BudgetOutcome::rewritten`] is made from the run without offload.
pub fn plan_with_budget(
    input: &Trace,
    opts: &OffloadOptions,
) -> Result<BudgetOutcome, OffloadError> {
    if !(opts.link_gbps.is_finite() && opts.link_gbps > 0.0) {
        return Err(OffloadError::BadBandwidth(opts.link_gbps));
    }
    let normalised;
    let mut releases = Vec::new();
    let trace = if input.restores.is_empty() {
        input.validate()?;
        input
    } else {
        input.validate()?;
        (normalised, releases) = un_offload_with_releases(&keep_first_iteration_offloaded(input))?;
        &normalised
    };
    let budget = opts.budget;
    let mut base = plan_trace(trace, &opts.plan)?;
    base.plan.trace_digest = trace_digest(input);
    let pool_without_offload = base.plan.pool_size;
    // What serving needs beside the pool ([`serving_headroom`]): the pool must fit in
    // the rest.
    let margin = opts.margin.clamp(0.0, 0.5);
    let serving = serving_headroom(&base.plan);
    let headroom = serving + (budget.get() as f64 * margin) as u64;
    let fit = Bytes(budget.get().saturating_sub(headroom));
    // The smallest budget whose pool may hold `peak`: `peak` + what serving needs, with
    // the margin on top.
    let smallest_budget =
        |peak: u64| Bytes(((peak + serving) as f64 / (1.0 - margin)).ceil() as u64);
    let mut report = OffloadReport {
        budget,
        planned_peak: pool_without_offload,
        pool_without_offload,
        tensors: 0,
        bytes_per_iteration: Bytes::ZERO,
        candidates: 0,
        candidate_bytes: Bytes::ZERO,
        minimum: Bytes::ZERO,
        stalls: 0,
        stall_us: 0.0,
        copy_out_wait_us: 0.0,
        timing: Timing::TraceTimes,
        link_gbps: opts.link_gbps,
        reuse: opts.reuse,
        attempts: 1,
    };
    if pool_without_offload <= fit {
        base.plan.budget = Some(budget);
        verify_plan(&base.plan).map_err(OffloadError::Invalid)?;
        return Ok(BudgetOutcome {
            outcome: base,
            offload: report,
            rewritten: None,
        });
    }
    if !trace
        .events
        .iter()
        .any(|e| matches!(e.kind, EventKind::SavedPack(_)))
    {
        return Err(OffloadError::NoSavedTensors {
            pool: pool_without_offload,
            lower_bound: base.report.planned_lower_bound,
            budget,
        });
    }
    if !matches!(base.classification.steady, Steady::Periodic(_)) {
        return Err(OffloadError::NoSteadyState {
            pool: pool_without_offload,
            budget,
        });
    }

    let clock = Clock::new(trace, &base.classification, opts);
    let (p, l) = (
        base.classification.prologue_len,
        base.classification.iteration_len.max(1),
    );
    let analysis = |waits: &[(u64, f64)]| {
        Analysis::new(trace, &base.classification, opts, &clock, &releases, waits)
    };
    let a0 = analysis(&[]);
    report.candidates = a0.cands.len();
    report.candidate_bytes = a0.cands.iter().map(|c| c.bytes).sum();
    report.timing = clock.timing;
    // The longest copy-out wait worth planning at one point: every candidate's copy,
    // back to back.
    let max_wait = match opts.reuse {
        OutReuse::AfterCopy => report.candidate_bytes.get() as f64 * a0.us_per_byte,
        OutReuse::AtPack => 0.0,
    };

    // The minimum: every candidate free from its pack to its last trigger (any wait at
    // all, every copy back as late as it may start).
    let mut tree = a0.base_profile();
    for c in &a0.cands {
        let w = a0.widest(c);
        a0.apply(&mut tree, c, w, -1);
    }
    // The smallest budget: that peak and what serving needs beside the pool.
    let (minimum, at) = tree.max();
    report.minimum = smallest_budget(minimum);
    if Bytes(minimum) > fit {
        return Err(OffloadError::BelowMinimum {
            budget,
            minimum: report.minimum,
            candidates: a0.cands.len(),
            at: a0.minimum_at(at as u64, minimum),
        });
    }

    // The selection for `target` with the fewest copy-out waits: where the selection
    // finds no tensor free (its copy not done by then), compute is made to wait there
    // (the engine waits on the copy stream), the shortest wait that lets the selection
    // past that request (binary search: a longer wait only moves copy completions
    // earlier on the plan clock); repeated at the next such request.
    let choose = |target: u64| -> Result<Chosen<'_>, String> {
        let mut waits: Vec<(u64, f64)> = Vec::new();
        let mut a = analysis(&waits);
        for _ in 0..MAX_WAIT_POINTS {
            let unmet = match a.select(target) {
                Ok(c) => {
                    // From +0: an empty f64 `sum` is -0.0, printed "-0".
                    let total = waits.iter().fold(0.0, |t, w| t + w.1);
                    return Ok((a, c, total));
                }
                Err(u) => u,
            };
            let Some(at) = unmet.at.filter(|&t| t >= p && max_wait > 0.0) else {
                return Err(unmet.why);
            };
            let rel = |t: u64| (t >= p).then(|| (t - p) % l);
            // A wait where the selection fails; when even the longest wait there makes it
            // fail earlier (another peak, before copies could be done), the wait goes to
            // that earlier request instead (it delays both).
            let failed = (at - p) % l;
            let mut gap = failed;
            loop {
                let mut w = waits.clone();
                w.push((gap, max_wait));
                match analysis(&w).select(target) {
                    Err(u) => match u.at.and_then(rel) {
                        Some(g) if g < gap => gap = g,
                        Some(g) if g > gap => break,
                        None if u.at.is_none() => break,
                        _ => return Err(unmet.why),
                    },
                    Ok(_) => break,
                }
            }
            let past = |u: &Unmet| u.at.is_none_or(|t| rel(t).is_some_and(|g| g > failed));
            let with = |us: f64| {
                let mut w = waits.clone();
                w.push((gap, us));
                w
            };
            let (mut lo, mut hi) = (0.0f64, max_wait);
            for _ in 0..WAIT_SEARCH_STEPS {
                let mid = 0.5 * (lo + hi);
                let r = analysis(&with(mid)).select(target);
                match r {
                    Err(u) if !past(&u) => lo = mid,
                    _ => hi = mid,
                }
            }
            waits = with(hi);
            a = analysis(&waits);
        }
        Err(format!(
            "more than {MAX_WAIT_POINTS} points where compute would wait for copies out"
        ))
    };

    let mut target = fit.get();
    let mut best_pool = pool_without_offload;
    let mut reason = String::new();
    for attempt in 1..=MAX_ATTEMPTS {
        report.attempts = attempt + 1;
        let (a, (chosen, forced), wait) = match choose(target) {
            Ok(x) => x,
            Err(why) => {
                reason = why;
                break;
            }
        };
        report.copy_out_wait_us = wait;
        let sched = a.simulate(&chosen, &forced);
        let (rewritten, backs) = a.rewrite(&chosen, &sched);
        let mut out = plan_trace(&rewritten, &opts.plan)?;
        best_pool = best_pool.min(out.plan.pool_size);
        if out.plan.pool_size > fit {
            // Lower the target by the solver's overshoot and choose again.
            let over = out.plan.pool_size.get() - fit.get();
            let step = (over.div_ceil(ALIGNMENT.get()) * ALIGNMENT.get())
                .saturating_mul(1 << (attempt - 1).min(16));
            if target <= minimum.saturating_add(step) {
                reason = format!(
                    "the solver's pool stays {} above the live-bytes peak",
                    Bytes(over)
                );
                break;
            }
            target -= step;
            reason = format!("the solver's pool was {} over", Bytes(over));
            continue;
        }
        let entries = a.entries(&chosen, &sched, &backs, &out.classification)?;
        out.plan.budget = Some(budget);
        out.plan.offload = entries;
        out.plan.saved_packs = a.saved_packs;
        out.plan.saved_unpacks = a.saved_unpacks;
        out.plan.trace_digest = trace_digest(input);
        verify_plan(&out.plan).map_err(OffloadError::Invalid)?;
        report.planned_peak = out.plan.pool_size;
        report.tensors = chosen.len();
        report.bytes_per_iteration = chosen.iter().map(|&c| a.cands[c].bytes).sum();
        report.stalls = sched.iter().filter(|s| s.stall_us > 0.0).count();
        // A stall delays every later unpack too: the iteration's delay is the longest.
        report.stall_us = sched.iter().map(|s| s.stall_us).fold(0.0, f64::max);
        return Ok(BudgetOutcome {
            outcome: out,
            offload: report,
            rewritten: Some(rewritten),
        });
    }
    Err(OffloadError::NotReached {
        budget,
        minimum: report.minimum,
        best_pool,
        attempts: report.attempts.saturating_sub(1),
        reason,
    })
}

/// Memory the engine maps beside a plan's pool when serving it (measured by replaying the
/// H100 Llama trace, `tests/offload_real.rs`): the pool rounded up to the device's mapping
/// granule, and the online arenas of the requests the plan leaves unplanned (their peak of
/// live bytes rounded up to granules, plus the small pool's first granule). A plan whose
/// pool fits the budget but not this beside it would run out of memory at the budget.
pub fn serving_headroom(plan: &stweaver_core::Plan) -> u64 {
    let granule = crate::engine_replay::GRANULE.get();
    let dynamic = if plan.dynamic.requests > 0 {
        plan.dynamic.peak_bytes.get().div_ceil(granule) * granule + granule
    } else {
        0
    };
    granule + dynamic
}

/// Per chosen candidate (index into `cands`), the earliest trigger (index into its
/// `triggers`) it may take.
type Forced = FxHashMap<usize, usize>;

/// A selection with its analysis (the clock with its waits) and the total planned wait.
type Chosen<'a> = (Analysis<'a>, (Vec<usize>, Forced), f64);

/// Why a selection did not reach its target, and the request (a tick of the whole
/// trace) where no offloadable tensor was free.
#[derive(Debug)]
struct Unmet {
    why: String,
    at: Option<u64>,
}

/// One offloadable tensor (an iteration slot).
#[derive(Debug, Clone)]
struct Cand {
    /// The representative copy (first steady iteration).
    alloc: AllocId,
    bytes: Bytes,
    padded: u64,
    /// Relative ticks (gaps) of its pack and unpack events.
    r_pack: u64,
    r_unpack: u64,
    /// The gap from which the program no longer holds it (its recorded forward free,
    /// [`crate::unoffload::un_offload_with_releases`]); `r_pack` when unknown. Its
    /// memory is free no earlier, whenever its copy is done.
    r_release: u64,
    /// Times (µs, iteration-relative clock) of its pack and unpack.
    t_pack: f64,
    t_unpack: f64,
    /// Ordinals of its pack and unpack in the steady iteration.
    pack_ord: u32,
    unpack_ord: u32,
    /// Trigger options, earliest first: (unpack ordinal or None for "after the last
    /// pack before the unpack", gap, time).
    triggers: Vec<(Option<u32>, u64, f64)>,
    /// Copies to rewrite: (allocation, base tick of its iteration).
    copies: Vec<(AllocId, u64)>,
}

/// One chosen tensor's schedule.
#[derive(Debug, Clone, Copy)]
struct Sched {
    /// Gap (relative tick) where the out request's free completes.
    r_done: u64,
    /// Index into the candidate's `triggers`.
    trigger: usize,
    stall_us: f64,
}

/// A freed window in relative ticks: `V[base + lo .. base + hi)` lose the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    lo: u64,
    hi: u64,
}

/// The schedule's clock over the first steady iteration (module docs, "The model"): how
/// an event's time is estimated, and where a copy-out wait goes.
struct Clock {
    /// Plan-clock tick of every event, and their count.
    ticks: Vec<u64>,
    total: u64,
    timing: Timing,
    /// The first steady iteration's first event time (trace times).
    t0: u64,
    period_us: f64,
    /// Relative tick of the iteration's first unpack (the end of forward), and the share
    /// of the period before it ([`Timing::SpreadPhases`]).
    forward_end: u64,
    forward_share: f64,
    iteration_len: u64,
}

impl Clock {
    fn new(trace: &Trace, c: &Classification, opts: &OffloadOptions) -> Clock {
        let (ticks, total) = plan_clock(trace);
        let (p, l) = (c.prologue_len, c.iteration_len);
        let in_iter0 = |e: usize| ticks[e] >= p && ticks[e] < p + l;
        // Event times of the first steady iteration: usable when set and not going back.
        let window: Vec<usize> = (0..trace.events.len()).filter(|&e| in_iter0(e)).collect();
        let usable = !window.is_empty()
            && window.iter().all(|&e| trace.events[e].time_us > 0)
            && window
                .windows(2)
                .all(|w| trace.events[w[0]].time_us <= trace.events[w[1]].time_us);
        let t0 = window.first().map_or(0, |&e| trace.events[e].time_us);
        // The period: from the iteration's first request to the next iteration's first
        // event (else its own last event).
        let next = (0..trace.events.len())
            .find(|&e| ticks[e] >= p + l && trace.events[e].time_us >= t0)
            .or(window.last().copied());
        let first_period = next.map_or(0, |e| trace.events[e].time_us.saturating_sub(t0)) as f64;
        // The device's pace: the given iteration time, else the fastest iteration between
        // two iteration markers (the first steady one may carry warm-up; noise only adds
        // time), else the first steady iteration's.
        let marked: Vec<u64> = trace
            .events
            .iter()
            .filter(|e| {
                matches!(
                    e.kind,
                    EventKind::Marker {
                        kind: MarkerKind::IterationBegin | MarkerKind::IterationEnd,
                        ..
                    }
                )
            })
            .map(|e| e.time_us)
            .collect();
        let fastest = marked
            .windows(2)
            .filter(|w| w[1] > w[0])
            .map(|w| (w[1] - w[0]) as f64)
            .min_by(f64::total_cmp);
        let period_us = match (opts.iteration_us, fastest) {
            (Some(us), _) if us > 0.0 => us,
            (_, Some(us)) if first_period > 0.0 => us.min(first_period),
            _ => first_period,
        };
        let forward_end = window
            .iter()
            .find(|&&e| matches!(trace.events[e].kind, EventKind::SavedUnpack(_)))
            .map(|&e| ticks[e] - p);
        let share = opts.forward_share.filter(|f| *f > 0.0 && *f < 1.0);
        let timing = if !usable || period_us <= 0.0 {
            Timing::EventCounts
        } else if opts.host_times {
            Timing::TraceTimes
        } else if share.is_some() && forward_end.is_some_and(|f| f > 0 && f < l) {
            Timing::SpreadPhases
        } else {
            Timing::SpreadPeriod
        };
        Clock {
            ticks,
            total,
            timing,
            t0,
            period_us,
            forward_end: forward_end.unwrap_or(0),
            forward_share: share.unwrap_or(DEFAULT_FORWARD_SHARE),
            iteration_len: l,
        }
    }

    /// Event `e`'s time (µs from the iteration's start) without waits; `g` its relative
    /// tick.
    fn time_of(&self, trace: &Trace, e: usize, g: u64) -> f64 {
        let l = self.iteration_len.max(1);
        let g = g.min(l);
        match self.timing {
            Timing::TraceTimes => (trace.events[e].time_us.max(self.t0) - self.t0) as f64,
            Timing::SpreadPeriod => g as f64 * self.period_us / l as f64,
            Timing::SpreadPhases => {
                let (f, fe) = (self.forward_share * self.period_us, self.forward_end as f64);
                if (g as f64) < fe {
                    g as f64 * f / fe
                } else {
                    f + (g as f64 - fe) * (self.period_us - f) / (l as f64 - fe)
                }
            }
            Timing::EventCounts => g as f64 * US_PER_REQUEST_WITHOUT_TIMES,
        }
    }
}

struct Analysis<'a> {
    trace: &'a Trace,
    c: &'a Classification,
    /// Plan-clock ticks and how times are estimated (shared by every analysis of one
    /// planning, whatever its waits).
    clock: &'a Clock,
    /// Time (µs, relative) of each gap `0..=L` of the first steady iteration, waits
    /// included.
    gap_time: Vec<f64>,
    /// Microseconds per byte on the link.
    us_per_byte: f64,
    /// [`OffloadOptions::per_tensor_us`] as bytes of link time: weighed beside each
    /// candidate's size by the greedy.
    tensor_overhead: u64,
    /// [`OffloadOptions::reuse`].
    reuse: OutReuse,
    cands: Vec<Cand>,
    saved_packs: u32,
    saved_unpacks: u32,
}

impl<'a> Analysis<'a> {
    /// The analysis with copy-out waits `(gap, µs)` inserted: every event of the
    /// iteration at or after a wait's gap happens that much later (copies go on).
    fn new(
        trace: &'a Trace,
        c: &'a Classification,
        opts: &OffloadOptions,
        clock: &'a Clock,
        releases: &[Option<usize>],
        waits: &[(u64, f64)],
    ) -> Self {
        let (link_gbps, reuse) = (opts.link_gbps, opts.reuse);
        let ticks = &clock.ticks;
        let (p, l) = (c.prologue_len, c.iteration_len);
        let in_iter0 = |e: usize| ticks[e] >= p && ticks[e] < p + l;
        let window: Vec<usize> = (0..trace.events.len()).filter(|&e| in_iter0(e)).collect();
        let time_of = |e: usize| -> f64 {
            let g = ticks[e].saturating_sub(p);
            clock.time_of(trace, e, g)
                + waits
                    .iter()
                    .filter(|&&(at, _)| g >= at)
                    .map(|&(_, us)| us)
                    .sum::<f64>()
        };
        // Gap g's time: that of request p + g (the end of the window for g = L).
        let mut gap_time = vec![f64::NAN; l as usize + 1];
        for &e in &window {
            if trace.events[e].kind.is_request() {
                gap_time[(ticks[e] - p) as usize] = time_of(e);
            }
        }
        let end = window.last().map_or(0.0, |&e| time_of(e));
        gap_time[l as usize] = end;
        for g in (0..l as usize).rev() {
            if gap_time[g].is_nan() {
                gap_time[g] = gap_time[g + 1];
            }
        }

        // Saved events: per allocation, and the ordinals in the first steady iteration.
        let mut packs: FxHashMap<u32, Vec<usize>> = FxHashMap::default();
        let mut unpacks: FxHashMap<u32, Vec<usize>> = FxHashMap::default();
        let mut pack_ord: FxHashMap<usize, u32> = FxHashMap::default();
        let mut unpack_ord: FxHashMap<usize, u32> = FxHashMap::default();
        let mut pack_events: Vec<usize> = Vec::new();
        for (e, ev) in trace.events.iter().enumerate() {
            match ev.kind {
                EventKind::SavedPack(id) => {
                    packs.entry(id.0).or_default().push(e);
                    if in_iter0(e) {
                        pack_ord.insert(e, pack_ord.len() as u32);
                        pack_events.push(e);
                    }
                }
                EventKind::SavedUnpack(id) => {
                    unpacks.entry(id.0).or_default().push(e);
                    if in_iter0(e) {
                        unpack_ord.insert(e, unpack_ord.len() as u32);
                    }
                }
                _ => {}
            }
        }
        let mut iter0_unpacks: Vec<usize> = unpack_ord.keys().copied().collect();
        iter0_unpacks.sort_unstable();

        // Copies of each slot.
        let mut copies_of: Vec<Vec<(AllocId, u64)>> = vec![Vec::new(); c.slots.len()];
        for (i, class) in c.classes.iter().enumerate() {
            if let AllocClass::PerIteration { iteration, slot } = *class {
                copies_of[slot as usize].push((AllocId(i as u32), p + u64::from(iteration) * l));
            }
        }
        let one = |m: &FxHashMap<u32, Vec<usize>>, id: AllocId| -> Option<usize> {
            match m.get(&id.0).map(Vec::as_slice) {
                Some([e]) => Some(*e),
                _ => None,
            }
        };
        let mut cands = Vec::new();
        for (s, slot) in c.slots.iter().enumerate() {
            let id = slot.alloc;
            if trace.allocations[id.index()].size < opts.min_tensor_bytes {
                continue;
            }
            let (Some(pe), Some(ue)) = (one(&packs, id), one(&unpacks, id)) else {
                continue;
            };
            if pe > ue || !in_iter0(pe) || !in_iter0(ue) {
                continue;
            }
            let (r_pack, r_unpack) = (ticks[pe] - p, ticks[ue] - p);
            if r_pack == 0 {
                continue;
            }
            // Every complete iteration's copy must have them at the same positions;
            // tail copies are rewritten when they do, left alone otherwise.
            let mut copies = Vec::new();
            let mut regular = true;
            for &(x, b) in &copies_of[s] {
                let same = match (one(&packs, x), one(&unpacks, x)) {
                    (Some(px), Some(ux)) => {
                        px < ux && ticks[px] == b + r_pack && ticks[ux] == b + r_unpack
                    }
                    _ => false,
                };
                if same {
                    copies.push((x, b));
                } else if b < p + c.repetitions * l {
                    regular = false;
                    break;
                }
            }
            if !regular {
                continue;
            }
            // Trigger options: after the last pack before the unpack, then each unpack
            // between it and the tensor's own.
            let last_pack = pack_events
                .iter()
                .copied()
                .take_while(|&e| e < ue)
                .last()
                .expect("the tensor's own pack precedes its unpack");
            let mut triggers = vec![(None, ticks[last_pack] - p, time_of(last_pack))];
            for &u in &iter0_unpacks {
                if u > last_pack && u < ue {
                    triggers.push((Some(unpack_ord[&u]), ticks[u] - p, time_of(u)));
                }
            }
            // Where forward let go of it (known when the recording offloaded it): its
            // memory is free no earlier, in any copy.
            let released = |x: AllocId| -> Option<u64> {
                let e = releases.get(x.index()).copied().flatten()?;
                Some(ticks.get(e).copied().unwrap_or(clock.total))
            };
            let r_release = copies
                .iter()
                .filter_map(|&(x, b)| released(x).map(|t| t.saturating_sub(b)))
                .chain(released(id).map(|t| t.saturating_sub(p)))
                .max()
                .unwrap_or(0)
                .clamp(r_pack, r_unpack);
            let a = &trace.allocations[id.index()];
            cands.push(Cand {
                alloc: id,
                bytes: a.size,
                padded: pad(a.size),
                r_pack,
                r_unpack,
                r_release,
                t_pack: time_of(pe),
                t_unpack: time_of(ue),
                pack_ord: pack_ord[&pe],
                unpack_ord: unpack_ord[&ue],
                triggers,
                copies,
            });
        }
        Analysis {
            trace,
            c,
            clock,
            gap_time,
            us_per_byte: 1.0 / (link_gbps * 1e3),
            tensor_overhead: (opts.per_tensor_us.max(0.0) * link_gbps * 1e3) as u64,
            reuse,
            cands,
            saved_packs: pack_ord.len() as u32,
            saved_unpacks: unpack_ord.len() as u32,
        }
    }

    /// The first gap at or after `from` whose request starts at or after `t`, at most
    /// `limit`.
    fn gap_at(&self, from: u64, t: f64, limit: u64) -> u64 {
        let mut g = from;
        while g < limit && self.gap_time[g as usize] < t {
            g += 1;
        }
        g
    }

    fn window_of(&self, c: &Cand, s: Sched) -> Window {
        let g = c.triggers[s.trigger].1;
        Window {
            lo: s.r_done,
            hi: g.saturating_sub(1).max(s.r_done),
        }
    }

    /// The schedule of `c` alone on the link.
    fn standalone_sched(&self, c: &Cand) -> Sched {
        let dur = c.bytes.get() as f64 * self.us_per_byte;
        let done = c.t_pack + dur;
        let r_done = self
            .gap_at(c.r_pack, self.free_at(c, done), c.r_unpack)
            .max(c.r_release);
        self.pick_trigger(c, done, 0.0)
            .map(|(trigger, stall_us)| Sched {
                r_done,
                trigger,
                stall_us,
            })
            .expect("a candidate has a trigger option")
    }

    /// When `c`'s out memory is free for reuse, in trace time, given its copy is done at
    /// `done` ([`OffloadOptions::reuse`]).
    fn free_at(&self, c: &Cand, done: f64) -> f64 {
        match self.reuse {
            OutReuse::AtPack => c.t_pack,
            OutReuse::AfterCopy => done,
        }
    }

    /// The longest freed window `c` can have: from its pack or, if later, its release (compute waiting for its copy
    /// out) to its last trigger (its unpack waiting for the copy back).
    fn widest(&self, c: &Cand) -> Window {
        let hi = c.triggers.last().map_or(c.r_pack, |t| t.1);
        Window {
            lo: c.r_release,
            hi: hi.saturating_sub(1).max(c.r_release),
        }
    }

    fn standalone(&self, c: &Cand) -> Window {
        self.window_of(c, self.standalone_sched(c))
    }

    /// The latest trigger whose copy back, starting at `max(trigger, done, queue)`,
    /// completes by the unpack; else the earliest, with its stall.
    fn pick_trigger(&self, c: &Cand, done: f64, queue: f64) -> Option<(usize, f64)> {
        let dur = c.bytes.get() as f64 * self.us_per_byte;
        let finish = |t: f64| t.max(done).max(queue) + dur;
        if let Some(k) = (0..c.triggers.len())
            .rev()
            .find(|&k| finish(c.triggers[k].2) <= c.t_unpack)
        {
            return Some((k, 0.0));
        }
        (!c.triggers.is_empty()).then(|| (0, finish(c.triggers[0].2) - c.t_unpack))
    }

    /// The two copy queues for the chosen set (module docs); `forced`: the earliest
    /// trigger a candidate may take (one whose window must cover a peak, at the price of
    /// a stall).
    fn simulate(&self, chosen: &[usize], forced: &Forced) -> Vec<Sched> {
        let mut out = vec![
            Sched {
                r_done: 0,
                trigger: 0,
                stall_us: 0.0,
            };
            chosen.len()
        ];
        let mut by_pack: Vec<usize> = (0..chosen.len()).collect();
        by_pack.sort_by(|&x, &y| {
            let (a, b) = (&self.cands[chosen[x]], &self.cands[chosen[y]]);
            a.t_pack
                .total_cmp(&b.t_pack)
                .then(a.pack_ord.cmp(&b.pack_ord))
        });
        let mut done = vec![0.0; chosen.len()];
        let mut q = 0.0f64;
        for &x in &by_pack {
            let c = &self.cands[chosen[x]];
            q = q.max(c.t_pack) + c.bytes.get() as f64 * self.us_per_byte;
            done[x] = q;
            out[x].r_done = self
                .gap_at(c.r_pack, self.free_at(c, q), c.r_unpack)
                .max(c.r_release);
        }
        let mut by_unpack: Vec<usize> = (0..chosen.len()).collect();
        by_unpack.sort_by(|&x, &y| {
            let (a, b) = (&self.cands[chosen[x]], &self.cands[chosen[y]]);
            a.t_unpack
                .total_cmp(&b.t_unpack)
                .then(a.unpack_ord.cmp(&b.unpack_ord))
        });
        // Copies back, as late as possible: walked from the last unpack back, each copy
        // must be done by its unpack and before the next copy in the queue starts, and is
        // issued at its latest trigger no later than that start (the serial queue's
        // latest schedule: every freed window as long as the link allows). A greedy walk
        // forward (each copy as late as it alone could go) would push the later ones
        // into stalls on their earliest trigger, ending their windows before the peak.
        let mut end = f64::INFINITY;
        for &x in by_unpack.iter().rev() {
            let c = &self.cands[chosen[x]];
            let dur = c.bytes.get() as f64 * self.us_per_byte;
            let start = c.t_unpack.min(end) - dur;
            let k = (0..c.triggers.len())
                .rev()
                .find(|&k| c.triggers[k].2 <= start)
                .unwrap_or(0)
                .max(forced.get(&chosen[x]).copied().unwrap_or(0));
            out[x].trigger = k;
            end = start.min(c.triggers[k].2.max(done[x]));
        }
        // Then forward, the times that schedule gives: a copy starts at its trigger, once
        // its copy out is done and the link is free; late is a stall.
        let mut q = 0.0f64;
        for &x in &by_unpack {
            let c = &self.cands[chosen[x]];
            let k = out[x].trigger;
            q = c.triggers[k].2.max(done[x]).max(q) + c.bytes.get() as f64 * self.us_per_byte;
            out[x].stall_us = (q - c.t_unpack).max(0.0);
        }
        out
    }

    /// `V[t]`: live padded bytes of the planned allocations after request `t`.
    fn base_profile(&self) -> MaxTree {
        let n = self.clock.total.max(1) as usize;
        let mut diff = vec![0i64; n + 1];
        for (i, l) in self.trace.lifetimes().iter().enumerate() {
            if !self.c.classes[i].is_planned() {
                continue;
            }
            let s = l.start.map_or(0, |e| self.clock.ticks[e.index()]) as usize;
            let e = l
                .end
                .map_or(n, |e| self.clock.ticks[e.index()] as usize)
                .min(n);
            if s < e {
                let b = pad(self.trace.allocations[i].size) as i64;
                diff[s] += b;
                diff[e] -= b;
            }
        }
        let mut v = Vec::with_capacity(n);
        let mut acc = 0i64;
        for d in &diff[..n] {
            acc += d;
            v.push(acc);
        }
        MaxTree::new(&v)
    }

    /// Adds `sign · size` over `c`'s window in each of its copies.
    fn apply(&self, tree: &mut MaxTree, c: &Cand, w: Window, sign: i64) {
        if w.hi <= w.lo {
            return;
        }
        for &(_, b) in &c.copies {
            let (lo, hi) = ((b + w.lo) as usize, ((b + w.hi) as usize).min(tree.n));
            if lo < hi {
                tree.add(lo, hi, sign * c.padded as i64);
            }
        }
    }

    fn covers(&self, c: &Cand, w: Window, t: u64) -> bool {
        c.copies.iter().any(|&(_, b)| b + w.lo <= t && t < b + w.hi)
    }

    fn minimum_at(&self, tick: u64, peak: u64) -> MinimumAt {
        let mut persistent = 0u64;
        for (i, l) in self.trace.lifetimes().iter().enumerate() {
            if self.c.classes[i] != AllocClass::Persistent {
                continue;
            }
            let s = l.start.map_or(0, |e| self.clock.ticks[e.index()]);
            let e = l.end.map_or(u64::MAX, |e| self.clock.ticks[e.index()]);
            if s <= tick && tick < e {
                persistent += pad(self.trace.allocations[i].size);
            }
        }
        MinimumAt {
            tick,
            in_prologue: tick < self.c.prologue_len,
            persistent: Bytes(persistent),
            unmovable: Bytes(peak.saturating_sub(persistent)),
        }
    }

    /// The greedy selection for `target` (module docs): indices into `cands`.
    fn select(&self, target: u64) -> Result<(Vec<usize>, Forced), Unmet> {
        let mut tree = self.base_profile();
        let mut forced: Forced = FxHashMap::default();
        let standalone: Vec<Window> = self.cands.iter().map(|c| self.standalone(c)).collect();
        let mut chosen: Vec<usize> = Vec::new();
        let mut is_chosen = vec![false; self.cands.len()];
        // The window applied to the tree for each chosen candidate.
        let mut applied: FxHashMap<usize, Window> = FxHashMap::default();
        let resim = |tree: &mut MaxTree,
                     chosen: &[usize],
                     applied: &mut FxHashMap<usize, Window>,
                     forced: &Forced| {
            let sched = self.simulate(chosen, forced);
            for (&c, s) in chosen.iter().zip(&sched) {
                let w = self.window_of(&self.cands[c], *s);
                let old = applied.insert(c, w).expect("applied");
                if old != w {
                    self.apply(tree, &self.cands[c], old, 1);
                    self.apply(tree, &self.cands[c], w, -1);
                }
            }
        };
        for _round in 0..=self.cands.len() + 1 {
            // Greedy picks on standalone windows.
            loop {
                let (peak, at) = tree.max();
                if peak <= target {
                    break;
                }
                let excess = peak - target;
                let best = (0..self.cands.len())
                    .filter(|&k| {
                        !is_chosen[k] && self.covers(&self.cands[k], standalone[k], at as u64)
                    })
                    .max_by(|&x, &y| {
                        let score = |k: usize| {
                            let c = &self.cands[k];
                            (
                                c.padded.min(excess) as f64
                                    / (c.padded + self.tensor_overhead) as f64,
                                standalone[k].hi - standalone[k].lo,
                                c.padded,
                            )
                        };
                        let (a, b) = (score(x), score(y));
                        a.0.total_cmp(&b.0)
                            .then(a.1.cmp(&b.1))
                            .then(a.2.cmp(&b.2))
                            .then(y.cmp(&x))
                    });
                if let Some(k) = best {
                    // Its window must keep covering `at` when the copy-back queue is
                    // simulated: its copy back may start no earlier than the first
                    // trigger past `at` (a stall, if the queue cannot be in time).
                    let c = &self.cands[k];
                    let w = standalone[k];
                    if let Some(&(_, b)) = c
                        .copies
                        .iter()
                        .find(|&&(_, b)| b + w.lo <= at as u64 && (at as u64) < b + w.hi)
                    {
                        let rel = at as u64 - b;
                        if let Some(ti) = c.triggers.iter().position(|t| t.1 > rel + 1) {
                            forced.insert(k, ti);
                        }
                    }
                    is_chosen[k] = true;
                    chosen.push(k);
                    applied.insert(k, standalone[k]);
                    self.apply(&mut tree, &self.cands[k], standalone[k], -1);
                    continue;
                }
                // A chosen tensor whose copy out is done by `at` but whose copy back
                // starts before it (the copy-back queue, too long to have it in time, gave
                // it its earliest trigger) has its copy back start past `at` instead: no
                // more bytes moved, a longer stall, and its memory free at the peak. (On
                // GPT-2 XL at 0.7 x LB without recomputation, the link-bound schedule gave
                // dozens of chosen tensors windows ending at backward's first unpacks, right
                // at the peak, and the budget was refused although its minimum was 11.85
                // GiB of 18.48.)
                let refit = chosen
                    .iter()
                    .copied()
                    .filter_map(|k| {
                        let c = &self.cands[k];
                        let w = applied[&k];
                        // (A window's `hi` is never below its `lo`: its copy out is done
                        // by `at` too.)
                        let &(_, b) = c.copies.iter().find(|&&(_, b)| {
                            b + w.hi <= at as u64 && (at as u64) < b + c.r_unpack
                        })?;
                        let rel = at as u64 - b;
                        let ti = c.triggers.iter().position(|t| t.1 > rel + 1)?;
                        if forced.get(&k).is_some_and(|&f| f >= ti) {
                            return None;
                        }
                        Some((k, ti, c.padded.min(excess)))
                    })
                    .max_by(|a, b| a.2.cmp(&b.2).then(b.0.cmp(&a.0)));
                if let Some((k, ti, _)) = refit {
                    let c = &self.cands[k];
                    let old = applied[&k];
                    let new = Window {
                        lo: old.lo,
                        hi: c.triggers[ti].1.saturating_sub(1).max(old.lo),
                    };
                    forced.insert(k, ti);
                    applied.insert(k, new);
                    self.apply(&mut tree, c, old, 1);
                    self.apply(&mut tree, c, new, -1);
                    continue;
                }
                // No tensor's copy back can wait past `at` and still be in time: take the
                // one whose copy out is done by `at` whose copy back, started at the first
                // trigger past `at`, stalls its unpack least per byte it frees there.
                let late = (0..self.cands.len())
                    .filter(|&k| !is_chosen[k])
                    .filter_map(|k| {
                        let c = &self.cands[k];
                        let w = standalone[k];
                        let &(_, b) = c.copies.iter().find(|&&(_, b)| {
                            b + w.lo <= at as u64 && (at as u64) < b + c.r_unpack
                        })?;
                        let rel = at as u64 - b;
                        let ti = c.triggers.iter().position(|t| t.1 > rel + 1)?;
                        let dur = c.bytes.get() as f64 * self.us_per_byte;
                        let done = c.t_pack + dur;
                        let stall = (c.triggers[ti].2.max(done) + dur - c.t_unpack).max(0.0);
                        let win = Window {
                            lo: w.lo,
                            hi: c.triggers[ti].1.saturating_sub(1).max(w.lo),
                        };
                        Some((k, ti, win, stall / c.padded.min(excess) as f64))
                    })
                    .min_by(|a, b| a.3.total_cmp(&b.3).then(a.0.cmp(&b.0)));
                let Some((k, ti, win, _)) = late else {
                    return Err(Unmet {
                        why: format!(
                            "{} live at request {at} over the target {}, and no offloadable tensor is freed there",
                            Bytes(peak),
                            Bytes(target)
                        ),
                        at: Some(at as u64),
                    });
                };
                is_chosen[k] = true;
                chosen.push(k);
                forced.insert(k, ti);
                applied.insert(k, win);
                self.apply(&mut tree, &self.cands[k], win, -1);
            }
            resim(&mut tree, &chosen, &mut applied, &forced);
            if tree.max().0 > target {
                continue;
            }
            // Prune, largest first.
            let mut order = chosen.clone();
            order.sort_by_key(|&k| std::cmp::Reverse((self.cands[k].padded, k)));
            for k in order {
                let w = applied[&k];
                self.apply(&mut tree, &self.cands[k], w, 1);
                if tree.max().0 <= target {
                    applied.remove(&k);
                    forced.remove(&k);
                    is_chosen[k] = false;
                    chosen.retain(|&x| x != k);
                } else {
                    self.apply(&mut tree, &self.cands[k], w, -1);
                }
            }
            resim(&mut tree, &chosen, &mut applied, &forced);
            if tree.max().0 <= target {
                chosen.sort_unstable();
                return Ok((chosen, forced));
            }
        }
        Err(Unmet {
            why: "the copy queues keep the peak over the target".to_owned(),
            at: None,
        })
    }

    /// The rewritten trace (module docs) and the back allocation of every rewritten
    /// copy (indexed like `trace.allocations`).
    fn rewrite(&self, chosen: &[usize], sched: &[Sched]) -> (Trace, Vec<Option<AllocId>>) {
        #[derive(Clone, Copy)]
        enum Ins {
            FreeRequested(AllocId),
            FreeCompleted(AllocId),
            Alloc(AllocId),
        }
        let mut allocations: Vec<Allocation> = self.trace.allocations.clone();
        let mut back: Vec<Option<AllocId>> = vec![None; allocations.len()];
        // Frees right before request `t` (after the gap's other events); allocs right
        // after request `t - 1` (before them).
        let mut late: FxHashMap<u64, Vec<Ins>> = FxHashMap::default();
        let mut early: FxHashMap<u64, Vec<Ins>> = FxHashMap::default();
        for (&k, s) in chosen.iter().zip(sched) {
            let c = &self.cands[k];
            let g = c.triggers[s.trigger].1;
            for &(x, b) in &c.copies {
                let y = AllocId(allocations.len() as u32);
                allocations.push(Allocation {
                    addr: 0,
                    preexisting: false,
                    ..self.trace.allocations[x.index()]
                });
                back[x.index()] = Some(y);
                late.entry(b + c.r_pack)
                    .or_default()
                    .push(Ins::FreeRequested(x));
                early.entry(b + g).or_default().push(Ins::Alloc(y));
                late.entry(b + s.r_done)
                    .or_default()
                    .push(Ins::FreeCompleted(x));
            }
        }
        for v in late.values_mut() {
            // Every FreeRequested before any FreeCompleted of the same gap.
            v.sort_by_key(|i| matches!(i, Ins::FreeCompleted(_)));
        }
        let to_kind = |i: Ins| match i {
            Ins::FreeRequested(x) => EventKind::FreeRequested(x),
            Ins::FreeCompleted(x) => EventKind::FreeCompleted(x),
            Ins::Alloc(y) => EventKind::Alloc(y),
        };
        let relabel = |x: AllocId| back[x.index()].unwrap_or(x);
        let mut events = Vec::with_capacity(self.trace.events.len() + 3 * chosen.len());
        let mut time = 0;
        for (e, ev) in self.trace.events.iter().enumerate() {
            time = ev.time_us;
            let t = self.clock.ticks[e];
            let request = ev.kind.is_request();
            if request && let Some(v) = late.remove(&t) {
                events.extend(v.into_iter().map(|i| Event {
                    kind: to_kind(i),
                    time_us: time,
                }));
            }
            let kind = match ev.kind {
                EventKind::FreeRequested(x) => EventKind::FreeRequested(relabel(x)),
                EventKind::FreeCompleted(x) => EventKind::FreeCompleted(relabel(x)),
                EventKind::SavedUnpack(x) => EventKind::SavedUnpack(relabel(x)),
                k => k,
            };
            events.push(Event {
                kind,
                time_us: ev.time_us,
            });
            if request && let Some(v) = early.remove(&(t + 1)) {
                events.extend(v.into_iter().map(|i| Event {
                    kind: to_kind(i),
                    time_us: time,
                }));
            }
        }
        let mut rest: Vec<(u64, Vec<Ins>)> = late.into_iter().collect();
        rest.sort_by_key(|r| r.0);
        for (_, v) in rest {
            events.extend(v.into_iter().map(|i| Event {
                kind: to_kind(i),
                time_us: time,
            }));
        }
        (
            Trace {
                device: self.trace.device,
                allocations,
                events,
                labels: self.trace.labels.clone(),
                restores: Vec::new(),
            },
            back,
        )
    }

    /// The plan's offload entries, from the rewritten trace's classification.
    fn entries(
        &self,
        chosen: &[usize],
        sched: &[Sched],
        back: &[Option<AllocId>],
        rc: &Classification,
    ) -> Result<Vec<OffloadEntry>, OffloadError> {
        if rc.prologue_len != self.c.prologue_len || !matches!(rc.steady, Steady::Periodic(_)) {
            return Err(OffloadError::Internal(format!(
                "the rewritten trace's steady state starts at request {} instead of {}",
                rc.prologue_len, self.c.prologue_len
            )));
        }
        let slot = |id: AllocId| -> Option<u32> {
            match rc.classes.get(id.index()) {
                Some(AllocClass::PerIteration { iteration: 0, slot }) => Some(*slot),
                _ => None,
            }
        };
        let mut out = Vec::with_capacity(chosen.len());
        for (&k, s) in chosen.iter().zip(sched) {
            let c = &self.cands[k];
            let y = back[c.alloc.index()].expect("the representative copy is rewritten");
            let (Some(out_request), Some(back_request)) = (slot(c.alloc), slot(y)) else {
                return Err(OffloadError::Internal(format!(
                    "offloaded allocation {} or its copy back {y} is not an iteration request of the rewritten trace",
                    c.alloc
                )));
            };
            out.push(OffloadEntry {
                pack: c.pack_ord,
                unpack: c.unpack_ord,
                prefetch_after_unpack: c.triggers[s.trigger].0,
                bytes: c.bytes,
                out_request,
                back_request,
            });
        }
        out.sort_by_key(|o| o.pack);
        Ok(out)
    }
}

/// Why a budget string is not a size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetParseError {
    #[error(
        "budget {0:?} looks like a fraction of device memory, which only the runtime knows; give a size (e.g. 16GiB, 512MiB, or bytes)"
    )]
    Fraction(String),
    #[error("budget {0:?} is not a size (e.g. 16GiB, 512MiB, 1.5GB, or bytes)")]
    NotASize(String),
    #[error("budget {0:?} is zero or too large")]
    OutOfRange(String),
}

/// Parses a budget: bytes (`1073741824`), or a number with a binary (`KiB`, `MiB`,
/// `GiB`, `TiB`) or decimal (`KB`, `MB`, `GB`, `TB`) unit, case-insensitive, e.g.
/// `16GiB`, `512MiB`, `1.5GB`. A bare number in `(0, 1]` with a decimal point (`0.8`)
/// is a fraction of device memory, a runtime notion: refused.
pub fn parse_budget(s: &str) -> Result<Bytes, BudgetParseError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(BudgetParseError::NotASize(s.to_owned())),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| BudgetParseError::NotASize(s.to_owned()))?;
    if unit.is_empty() && num.contains('.') && v > 0.0 && v <= 1.0 {
        return Err(BudgetParseError::Fraction(s.to_owned()));
    }
    let bytes = (v * mult).round();
    if !(bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(BudgetParseError::OutOfRange(s.to_owned()));
    }
    Ok(Bytes(bytes as u64))
}

/// `size` rounded up to the plan alignment (sizes that overflow were refused by the
/// planner already).
fn pad(size: Bytes) -> u64 {
    size.align_up(ALIGNMENT).map_or(u64::MAX, Bytes::get)
}

/// Range add, global max (and its first position) over `n` values. O(log n) per add.
struct MaxTree {
    n: usize,
    size: usize,
    max: Vec<i64>,
    lazy: Vec<i64>,
}

impl MaxTree {
    fn new(v: &[i64]) -> Self {
        let n = v.len().max(1);
        let size = n.next_power_of_two();
        let mut max = vec![i64::MIN / 4; 2 * size];
        max[size..size + v.len()].copy_from_slice(v);
        for i in (1..size).rev() {
            max[i] = max[2 * i].max(max[2 * i + 1]);
        }
        MaxTree {
            n,
            size,
            max,
            lazy: vec![0; 2 * size],
        }
    }

    /// Adds `d` to positions `[lo, hi)`.
    fn add(&mut self, lo: usize, hi: usize, d: i64) {
        self.add_rec(1, 0, self.size, lo, hi, d);
    }

    fn add_rec(&mut self, node: usize, l: usize, r: usize, lo: usize, hi: usize, d: i64) {
        if hi <= l || r <= lo {
            return;
        }
        if lo <= l && r <= hi {
            self.max[node] += d;
            self.lazy[node] += d;
            return;
        }
        let m = (l + r) / 2;
        self.add_rec(2 * node, l, m, lo, hi, d);
        self.add_rec(2 * node + 1, m, r, lo, hi, d);
        self.max[node] = self.max[2 * node].max(self.max[2 * node + 1]) + self.lazy[node];
    }

    /// The maximum (clamped at 0) and its first position. Along the path from the
    /// root, a node's true value is its `max` plus its strict ancestors' `lazy`.
    fn max(&self) -> (u64, usize) {
        let top = self.max[1];
        let (mut node, mut acc) = (1, 0i64);
        while node < self.size {
            acc += self.lazy[node];
            node = if self.max[2 * node] + acc == top {
                2 * node
            } else {
                2 * node + 1
            };
        }
        (top.max(0) as u64, node - self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_sizes_and_refuse_fractions() {
        assert_eq!(parse_budget("16GiB"), Ok(Bytes(16 << 30)));
        assert_eq!(parse_budget("512 MiB"), Ok(Bytes(512 << 20)));
        assert_eq!(parse_budget("1.5gb"), Ok(Bytes(1_500_000_000)));
        assert_eq!(parse_budget("4096"), Ok(Bytes(4096)));
        assert!(matches!(
            parse_budget("0.8"),
            Err(BudgetParseError::Fraction(_))
        ));
        assert!(
            parse_budget("0.8")
                .unwrap_err()
                .to_string()
                .contains("runtime")
        );
        assert!(matches!(
            parse_budget("16 parsecs"),
            Err(BudgetParseError::NotASize(_))
        ));
        assert!(matches!(
            parse_budget("0"),
            Err(BudgetParseError::OutOfRange(_))
        ));
        assert!(matches!(
            parse_budget(""),
            Err(BudgetParseError::NotASize(_))
        ));
    }

    #[test]
    fn max_tree_matches_a_plain_array() {
        let mut v: Vec<i64> = (0..37).map(|i| (i * 7919 % 101) as i64).collect();
        let mut t = MaxTree::new(&v);
        let ops = [
            (0, 37, -5),
            (3, 9, 40),
            (20, 21, 200),
            (0, 20, 7),
            (21, 37, -300),
        ];
        for (lo, hi, d) in ops {
            t.add(lo, hi, d);
            for x in &mut v[lo..hi] {
                *x += d;
            }
            let m = *v.iter().max().unwrap();
            let at = v.iter().position(|&x| x == m).unwrap();
            assert_eq!(t.max(), (m.max(0) as u64, at));
        }
    }
}
