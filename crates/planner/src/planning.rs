//! Trace → plan: the offline planner's front door ([`plan_trace`]).
//!
//! # What is planned where
//!
//! The trace is classified first ([`crate::classify`]): persistent and prologue
//! allocations become the plan's prologue section, per-iteration slots its iteration
//! section (one representative steady iteration, repeated forever), dynamic ones are
//! only summarised ([`Plan::dynamic`]: count and peak of live bytes). Times are on the
//! plan clock (alloc and free events; see [`crate::classify::plan_clock`]). Every offset
//! is a multiple of [`ALIGNMENT`] (512 B, PyTorch's own block rounding) and every size
//! is packed rounded up to it; requests keep the exact requested size.
//!
//! # With a steady state: iteration first, then the prologue in the holes
//!
//! 1. **Steady state, on circular time.** One solver [`Instance`] with `period = L`:
//!    every iteration slot with its relative lifetime `[s, e)` (crossing the boundary
//!    when `e > L`), plus every *resident* tensor as a buffer live over the whole period
//!    `[0, L)`. Residents are the persistent allocations the trace never frees
//!    (parameters, optimizer state). The circular solution is valid for the iteration
//!    repeated forever next to the residents; its peak `H` is the steady pool.
//! 2. **Prologue, into the holes.** The remaining prologue-section requests (prologue
//!    temporaries, persistent tensors freed in the steady state such as the first
//!    iteration's gradients) are placed on the unrolled timeline against fixed
//!    rectangles: each resident from its alloc tick on, and the copies of every iteration
//!    slot for the iterations those requests reach into. Before the steady state only
//!    the residents are there (optimizer state not yet created leaves its region free);
//!    in the first steady iterations, the room the circular plan keeps for the previous
//!    iteration's crossing tensors is free, because iteration −1 does not exist — that is
//!    exactly where the first iteration's leftovers fit. The placer
//!    (`holes::place_best`) keeps the best of a small portfolio of orders × fits.
//! 3. If the prologue did not fit under `H`, the steady state is solved again with every
//!    persistent tensor resident (their room is then reserved for good) and the smaller
//!    pool of the two plans is kept.
//!
//! Pool = `max(H, prologue top)` rounded up to the alignment. Nothing can collide: the
//! solver's checked circular solution separates iteration copies and residents, the
//! placer separates prologue requests from everything else, and
//! [`stweaver_core::verify::verify_plan`] checks the unrolled result independently
//! before it is returned.
//!
//! # Streams
//!
//! With requests on several streams (a collective stream beside the compute stream),
//! step 1 solves each stream's slots and residents apart and stacks the pools, so no
//! address range of the steady iteration is used by two streams: at run time a range
//! that changes streams must wait for the first stream's work to pass the free, and a
//! collective stream running behind the host would turn every such reuse into a
//! conflict. [`PlanOptions::share_streams`] asks for the joint solve instead.
//!
//! # Without a steady state
//!
//! A prologue-only plan: one linear [`Instance`] of the planned allocations (persistent
//! and recurring) over the whole trace, a never-freed one living to the end.
//!
//! # Checks before returning
//!
//! [`verify_plan`] (address × time on the unrolled timeline) and [`check_coverage`]
//! (every planned allocation has exactly its request) must both pass; a failure is a
//! planner bug and an error, never a returned plan. [`Plan::lower_bound`] is the peak
//! of live requested bytes of the planned requests on the unrolled timeline, as the
//! verifier measures it; it is also checked to be at least the planned allocations'
//! own peak within the trace.
//!
//! # Cost
//!
//! Classification (O(events), or the window alignments without a steady state), one or
//! two solver runs (the solver's cost, bounded by [`SolveOptions::time_budget`]), the
//! placer (module `holes`) and the verifier (O(N log N) on the unrolled timeline).

mod coverage;
mod holes;

pub use coverage::{CoverageError, CoverageProblem, CoverageReport, check_coverage};

use std::time::{Duration, Instant};

use stweaver_core::trace_file::trace_digest;
use stweaver_core::verify::{PlanViolations, verify_plan};
use stweaver_core::{
    Bytes, DynamicSummary, NEVER_FREED, Offset, Plan, PlannedRequest, Trace, TraceError,
};

use crate::classify::{
    AllocClass, ClassCounts, Classification, ClassifyOptions, DynamicReason, Steady, classify_with,
    plan_clock, tick_lifetimes,
};
use crate::solver::{Buffer, Instance, SolveError, SolveOptions, lower_bound, solve};

use holes::{Item, Rect};

/// Offset alignment and packing granularity of every plan.
pub const ALIGNMENT: Bytes = Bytes(512);

/// How to plan.
#[derive(Debug, Clone, Default)]
pub struct PlanOptions {
    /// Solver settings (seed, threads, time budget, improvement stage).
    pub solve: SolveOptions,
    /// Classification settings. `stweaver verify --trace` classifies with the defaults,
    /// so a plan made with other settings may not pass its coverage check.
    pub classify: ClassifyOptions,
    /// Let the steady iteration's requests of different streams share address ranges
    /// (one joint solve: the smallest pool). Off by default: each stream's requests
    /// and residents are solved apart and the pools stacked (module docs, streams),
    /// because a range one stream frees and another reuses must wait at run time for
    /// the first stream's work to pass the free — which, with collectives running
    /// behind the host (FSDP), is later than the plan's clock says.
    pub share_streams: bool,
}

/// Which steady-state layout won (module docs, steps 1–3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// No steady state: one linear instance.
    Linear,
    /// Never-freed persistent tensors resident, the rest of the prologue in the holes.
    ResidentNeverFreed,
    /// Every persistent tensor resident.
    ResidentAllPersistent,
}

impl Layout {
    pub fn id(self) -> &'static str {
        match self {
            Layout::Linear => "linear",
            Layout::ResidentNeverFreed => "resident_never_freed",
            Layout::ResidentAllPersistent => "resident_all_persistent",
        }
    }
}

/// Where the time went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanTimings {
    pub classify: Duration,
    pub solve: Duration,
    pub place: Duration,
    pub verify: Duration,
    pub total: Duration,
}

/// What [`plan_trace`] reports besides the plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanReport {
    /// Peak of live requested bytes of the whole trace (dynamic allocations included).
    pub trace_lower_bound: Bytes,
    /// Peak of live requested bytes of the planned requests ([`Plan::lower_bound`]).
    pub planned_lower_bound: Bytes,
    /// The pool the plan needs ([`Plan::pool_size`]).
    pub pool_size: Bytes,
    /// Allocations per class.
    pub counts: ClassCounts,
    pub dynamic: DynamicSummary,
    /// Requests in each section, and the plan clock.
    pub prologue_requests: usize,
    pub iteration_requests: usize,
    pub prologue_len: u64,
    pub iteration_len: u64,
    /// Whole steady iterations in the trace (0 without a steady state).
    pub repetitions: u64,
    pub layout: Layout,
    /// The steady state's pool alone (`H`, module docs; 0 without one).
    pub steady_peak: Bytes,
    pub timings: PlanTimings,
}

impl PlanReport {
    /// Pool / LB of the whole trace.
    pub fn pool_over_trace_lb(&self) -> f64 {
        self.pool_size.ratio(self.trace_lower_bound)
    }

    /// Pool / LB of the planned part.
    pub fn pool_over_planned_lb(&self) -> f64 {
        self.pool_size.ratio(self.planned_lower_bound)
    }
}

/// A plan and how it came about.
#[derive(Debug, Clone)]
pub struct PlanOutcome {
    pub plan: Plan,
    pub report: PlanReport,
    pub classification: Classification,
}

/// Why no plan was made.
#[derive(Debug, thiserror::Error)]
pub enum PlanBuildError {
    #[error("the trace is invalid: {0}")]
    Trace(#[from] TraceError),
    #[error("the solver failed on the {stage} instance: {error}")]
    Solve {
        stage: &'static str,
        error: SolveError,
    },
    #[error("an allocation of {0} cannot be rounded up to the 512-byte alignment")]
    Overflow(Bytes),
    #[error("internal error: the plan failed verification: {0}")]
    Invalid(PlanViolations),
    #[error("internal error: {0}")]
    Coverage(CoverageError),
    #[error(
        "internal error: the verified peak of the planned requests ({verified}) is below their peak within the trace ({in_trace})"
    )]
    LowerBound { verified: Bytes, in_trace: Bytes },
}

/// Plans `trace` (module docs).
pub fn plan_trace(trace: &Trace, opts: &PlanOptions) -> Result<PlanOutcome, PlanBuildError> {
    let started = Instant::now();
    trace.validate()?;
    let classification = classify_with(trace, &opts.classify);
    let mut timings = PlanTimings {
        classify: started.elapsed(),
        ..PlanTimings::default()
    };
    let (ticks, total) = plan_clock(trace);
    let life = tick_lifetimes(trace, &ticks);
    let mut padded = Vec::with_capacity(trace.allocations.len());
    for a in &trace.allocations {
        padded.push(
            a.size
                .align_up(ALIGNMENT)
                .ok_or(PlanBuildError::Overflow(a.size))?
                .get(),
        );
    }
    let ctx = Ctx {
        trace,
        c: &classification,
        life: &life,
        padded: &padded,
        total,
        opts,
    };
    let built = match classification.steady {
        Steady::Periodic(_) => ctx.periodic(&mut timings)?,
        Steady::Aperiodic { .. } => ctx.linear(&mut timings)?,
    };
    let mut plan = ctx.assemble(&built);

    let t = Instant::now();
    let verified = verify_plan(&plan).map_err(PlanBuildError::Invalid)?;
    check_coverage(trace, &classification, &plan).map_err(PlanBuildError::Coverage)?;
    timings.verify = t.elapsed();
    let in_trace = planned_peak_in_trace(trace, &classification, &life);
    if verified.peak_live < in_trace {
        return Err(PlanBuildError::LowerBound {
            verified: verified.peak_live,
            in_trace,
        });
    }
    plan.lower_bound = verified.peak_live;
    timings.total = started.elapsed();

    let report = PlanReport {
        trace_lower_bound: trace.lower_bound().bytes,
        planned_lower_bound: plan.lower_bound,
        pool_size: plan.pool_size,
        counts: classification.counts,
        dynamic: plan.dynamic,
        prologue_requests: plan.prologue.len(),
        iteration_requests: plan.iteration.len(),
        prologue_len: plan.prologue_len,
        iteration_len: plan.iteration_len,
        repetitions: classification.repetitions,
        layout: built.layout,
        steady_peak: Bytes(built.steady_peak),
        timings,
    };
    Ok(PlanOutcome {
        plan,
        report,
        classification,
    })
}

/// Offsets decided for one plan.
struct Built {
    /// Offset of every prologue-section allocation (indexed by `AllocId`; others 0).
    alloc_offset: Vec<u64>,
    /// Offset of every iteration slot.
    slot_offset: Vec<u64>,
    /// The highest byte used (before rounding).
    top: u64,
    steady_peak: u64,
    layout: Layout,
}

struct Ctx<'a> {
    trace: &'a Trace,
    c: &'a Classification,
    life: &'a [(u64, Option<u64>)],
    padded: &'a [u64],
    total: u64,
    opts: &'a PlanOptions,
}

impl Ctx<'_> {
    fn in_prologue(&self, i: usize) -> bool {
        matches!(
            self.c.classes[i],
            AllocClass::Persistent | AllocClass::Prologue
        )
    }

    fn solve(
        &self,
        inst: &Instance,
        stage: &'static str,
        timings: &mut PlanTimings,
    ) -> Result<Vec<u64>, PlanBuildError> {
        let t = Instant::now();
        let sol = solve(inst, &self.opts.solve)
            .map_err(|error| PlanBuildError::Solve { stage, error })?;
        timings.solve += t.elapsed();
        Ok(sol.offsets.iter().map(|o| o.get()).collect())
    }

    /// The steady state's offsets: one joint solve, or with streams apart
    /// ([`PlanOptions::share_streams`] off and more than one stream), one solve per
    /// stream (in order of first appearance) with each stream's pool stacked above the
    /// previous one's.
    fn solve_streams(
        &self,
        inst: &Instance,
        stream_of: &[stweaver_core::StreamId],
        timings: &mut PlanTimings,
    ) -> Result<Vec<u64>, PlanBuildError> {
        let mut streams: Vec<stweaver_core::StreamId> = Vec::new();
        for &s in stream_of {
            if !streams.contains(&s) {
                streams.push(s);
            }
        }
        if self.opts.share_streams || streams.len() < 2 {
            return self.solve(inst, "steady-state", timings);
        }
        let mut offsets = vec![0u64; inst.buffers.len()];
        let mut base = 0u64;
        for s in streams {
            let ids: Vec<usize> = (0..inst.buffers.len())
                .filter(|&i| stream_of[i] == s)
                .collect();
            let sub = Instance {
                buffers: ids.iter().map(|&i| inst.buffers[i]).collect(),
                period: inst.period,
            };
            let o = self.solve(&sub, "steady-state (one stream)", timings)?;
            let mut top = 0u64;
            for (k, (&i, &oi)) in ids.iter().zip(&o).enumerate() {
                offsets[i] = base + oi;
                top = top.max(oi + sub.buffers[k].size.get());
            }
            base += top.div_ceil(ALIGNMENT.get()) * ALIGNMENT.get();
        }
        Ok(offsets)
    }

    /// Prologue-only plan: one linear instance.
    fn linear(&self, timings: &mut PlanTimings) -> Result<Built, PlanBuildError> {
        let ids: Vec<usize> = (0..self.trace.allocations.len())
            .filter(|&i| self.in_prologue(i))
            .collect();
        let buffers = ids
            .iter()
            .map(|&i| {
                let (s, e) = self.life[i];
                Buffer::new(s, e.unwrap_or(self.total).max(s + 1), Bytes(self.padded[i]))
                    .with_align(ALIGNMENT)
            })
            .collect();
        let offsets = self.solve(&Instance::new(buffers), "whole-trace", timings)?;
        let mut alloc_offset = vec![0u64; self.trace.allocations.len()];
        let mut top = 0;
        for (&i, &o) in ids.iter().zip(&offsets) {
            alloc_offset[i] = o;
            top = top.max(o + self.padded[i]);
        }
        Ok(Built {
            alloc_offset,
            slot_offset: Vec::new(),
            top,
            steady_peak: 0,
            layout: Layout::Linear,
        })
    }

    fn periodic(&self, timings: &mut PlanTimings) -> Result<Built, PlanBuildError> {
        let first = self.periodic_with(Layout::ResidentNeverFreed, timings)?;
        if first.top <= first.steady_peak {
            return Ok(first);
        }
        let second = self.periodic_with(Layout::ResidentAllPersistent, timings)?;
        Ok(if second.top < first.top {
            second
        } else {
            first
        })
    }

    fn periodic_with(
        &self,
        layout: Layout,
        timings: &mut PlanTimings,
    ) -> Result<Built, PlanBuildError> {
        let (p, l) = (self.c.prologue_len, self.c.iteration_len);
        let resident = |i: usize| {
            self.c.classes[i] == AllocClass::Persistent
                && (self.life[i].1.is_none() || layout == Layout::ResidentAllPersistent)
        };
        // 1. The steady state on circular time.
        let mut buffers: Vec<Buffer> = self
            .c
            .slots
            .iter()
            .map(|s| {
                Buffer::new(s.start, s.end, Bytes(self.padded[s.alloc.index()]))
                    .with_align(ALIGNMENT)
            })
            .collect();
        let residents: Vec<usize> = (0..self.trace.allocations.len())
            .filter(|&i| resident(i))
            .collect();
        buffers.extend(
            residents
                .iter()
                .map(|&i| Buffer::new(0, l, Bytes(self.padded[i])).with_align(ALIGNMENT)),
        );
        let stream_of: Vec<_> = self
            .c
            .slots
            .iter()
            .map(|s| self.trace.allocations[s.alloc.index()].stream)
            .chain(residents.iter().map(|&i| self.trace.allocations[i].stream))
            .collect();
        let inst = Instance {
            buffers,
            period: Some(l),
        };
        let offsets = self.solve_streams(&inst, &stream_of, timings)?;
        let n_slots = self.c.slots.len();
        let slot_offset = offsets[..n_slots].to_vec();
        let steady_peak = inst
            .buffers
            .iter()
            .zip(&offsets)
            .map(|(b, o)| o + b.size.get())
            .max()
            .unwrap_or(0);
        let mut alloc_offset = vec![0u64; self.trace.allocations.len()];
        for (&i, &o) in residents.iter().zip(&offsets[n_slots..]) {
            alloc_offset[i] = o;
        }

        // 2. The rest of the prologue section, in the holes.
        let t = Instant::now();
        let items_ids: Vec<usize> = (0..self.trace.allocations.len())
            .filter(|&i| self.in_prologue(i) && !resident(i))
            .collect();
        let items: Vec<Item> = items_ids
            .iter()
            .map(|&i| {
                let (s, e) = self.life[i];
                let e = e.unwrap_or(self.total).max(s + 1);
                Item {
                    t0: s,
                    t1: e,
                    size: self.padded[i],
                    crossing: e > p,
                }
            })
            .collect();
        let reach = items.iter().map(|it| it.t1).max().unwrap_or(0);
        let mut fixed: Vec<Rect> = residents
            .iter()
            .zip(&offsets[n_slots..])
            .map(|(&i, &o)| Rect {
                t0: self.life[i].0,
                t1: u64::MAX,
                lo: o,
                hi: o + self.padded[i],
            })
            .collect();
        if reach > p {
            let iterations = (reach - p).div_ceil(l);
            for k in 0..iterations {
                let base = p + k * l;
                for (s, &o) in self.c.slots.iter().zip(&slot_offset) {
                    fixed.push(Rect {
                        t0: base + s.start,
                        t1: base + s.end,
                        lo: o,
                        hi: o + self.padded[s.alloc.index()],
                    });
                }
            }
        }
        let placed = holes::place_best(&fixed, &items, steady_peak);
        for (&i, &o) in items_ids.iter().zip(&placed.offsets) {
            alloc_offset[i] = o;
        }
        timings.place += t.elapsed();
        Ok(Built {
            alloc_offset,
            slot_offset,
            top: steady_peak.max(placed.top),
            steady_peak,
            layout,
        })
    }

    fn assemble(&self, b: &Built) -> Plan {
        let trace = self.trace;
        let mut prologue_ids: Vec<usize> = (0..trace.allocations.len())
            .filter(|&i| self.in_prologue(i))
            .collect();
        // The run's order: preexisting allocations first, then by alloc tick.
        prologue_ids.sort_by_key(|&i| (self.life[i].0, !trace.allocations[i].preexisting, i));
        let prologue = prologue_ids
            .iter()
            .map(|&i| {
                let a = &trace.allocations[i];
                let (s, e) = self.life[i];
                PlannedRequest {
                    size: a.size,
                    stream: a.stream,
                    offset: Offset(b.alloc_offset[i]),
                    start: s,
                    end: e.unwrap_or(NEVER_FREED),
                }
            })
            .collect();
        let iteration = self
            .c
            .slots
            .iter()
            .zip(&b.slot_offset)
            .map(|(s, &o)| {
                let a = &trace.allocations[s.alloc.index()];
                PlannedRequest {
                    size: a.size,
                    stream: a.stream,
                    offset: Offset(o),
                    start: s.start,
                    end: s.end,
                }
            })
            .collect();
        Plan {
            device: trace.device,
            alignment: ALIGNMENT,
            // `top` is a sum of aligned sizes at aligned offsets: already aligned.
            pool_size: Bytes(b.top),
            lower_bound: Bytes::ZERO,
            trace_digest: trace_digest(trace),
            prologue,
            prologue_len: self.c.prologue_len,
            iteration,
            iteration_len: self.c.iteration_len,
            // One class: `crate::class_planning` plans several.
            extra_classes: Vec::new(),
            dynamic: dynamic_summary(trace, self.c, self.life),
            // Set by `crate::offload` for a plan made under a budget.
            budget: None,
            offload: Vec::new(),
            saved_packs: 0,
            saved_unpacks: 0,
        }
    }
}

/// Peak of live requested bytes over the allocations `keep` selects, on the plan clock.
fn peak_of(trace: &Trace, life: &[(u64, Option<u64>)], keep: impl Fn(usize) -> bool) -> Bytes {
    let mut ev: Vec<(u64, bool, u64)> = Vec::new();
    for (i, a) in trace.allocations.iter().enumerate() {
        if keep(i) {
            let (s, e) = life[i];
            ev.push((s, true, a.size.get()));
            if let Some(e) = e {
                ev.push((e, false, a.size.get()));
            }
        }
    }
    // Frees before allocs at a tick (half-open lifetimes).
    ev.sort_unstable_by_key(|&(t, is_alloc, _)| (t, is_alloc));
    let (mut live, mut peak) = (0u64, 0u64);
    for (_, is_alloc, size) in ev {
        if is_alloc {
            live += size;
            peak = peak.max(live);
        } else {
            live -= size;
        }
    }
    Bytes(peak)
}

/// How far ahead in the iteration section [`dynamic_summary`] looks for the slot of a
/// tail copy (the cursor's skip window is of the same order: `stweaver_core`'s
/// `engine::cursor`).
const TAIL_SKIP_WINDOW: usize = 16;

/// The dynamic requests and the peak the engine serves of them online beside the pool.
///
/// A copy in the tail (the recording's last iteration, cut off or followed by other work)
/// that is irregular only for its lifetime (the size of the slot that its place in the
/// tail's order gives it) is not counted in the peak: a run serves every iteration from
/// the iteration section, where that slot's request serves it (the engine's cursor
/// matches requests in order, by size). It is dynamic here because the recording's end timed it
/// differently (on the H100, a threshold-offloading GPT-2 XL trace freed its last
/// iteration's copies ~50 requests earlier; counted, they made a 4.45 GiB online peak
/// that the budget planner kept free beside the pool, and refused 0.8 x LB). A tail copy
/// of another size than its slot's, or past the last slot, still counts. O(allocations).
fn dynamic_summary(
    trace: &Trace,
    c: &Classification,
    life: &[(u64, Option<u64>)],
) -> DynamicSummary {
    // Allocation ids follow request order. Walk the tail with a slot cursor as the
    // engine's cursor walks the iteration section: a planned copy puts it after its slot,
    // an irregular one takes the next slot of its size; the other dynamic requests are
    // dynamic in every iteration and have no slot.
    let tail_start = c.prologue_len + c.repetitions * c.iteration_len;
    let mut served_by_its_slot = vec![false; trace.allocations.len()];
    if c.iteration_len > 0
        && let Some(first_tail) = life.iter().position(|&(start, _)| start >= tail_start)
    {
        let mut next = 0usize;
        let tail = (first_tail..trace.allocations.len()).zip(&mut served_by_its_slot[first_tail..]);
        for (i, served) in tail {
            match c.classes[i] {
                AllocClass::PerIteration { slot, .. } => next = slot as usize + 1,
                AllocClass::Dynamic(DynamicReason::Irregular) => {
                    // The nearest slot of its size within a few (a request the tail
                    // lacks is skipped, as the cursor skips it); none: an extra request.
                    let size = trace.allocations[i].size;
                    if let Some(k) = c
                        .slots
                        .iter()
                        .skip(next)
                        .take(TAIL_SKIP_WINDOW)
                        .position(|s| trace.allocations[s.alloc.index()].size == size)
                    {
                        *served = true;
                        next += k + 1;
                    }
                }
                _ => {}
            }
        }
    }
    DynamicSummary {
        requests: c.counts.dynamic as u64,
        peak_bytes: peak_of(trace, life, |i| {
            !c.classes[i].is_planned() && !served_by_its_slot[i]
        }),
    }
}

fn planned_peak_in_trace(trace: &Trace, c: &Classification, life: &[(u64, Option<u64>)]) -> Bytes {
    peak_of(trace, life, |i| c.classes[i].is_planned())
}

/// The load lower bound of the circular steady state alone (slots and never-freed
/// persistent tensors, requested sizes): what the pool cannot go below once the run has
/// settled. For reports and tests.
pub fn steady_lower_bound(trace: &Trace, c: &Classification) -> Bytes {
    if c.iteration_len == 0 {
        return Bytes::ZERO;
    }
    let (ticks, _) = plan_clock(trace);
    let life = tick_lifetimes(trace, &ticks);
    let mut buffers: Vec<Buffer> = c
        .slots
        .iter()
        .map(|s| Buffer::new(s.start, s.end, trace.allocations[s.alloc.index()].size))
        .collect();
    for (i, a) in trace.allocations.iter().enumerate() {
        if c.classes[i] == AllocClass::Persistent && life[i].1.is_none() {
            buffers.push(Buffer::new(0, c.iteration_len, a.size));
        }
    }
    lower_bound(&Instance {
        buffers,
        period: Some(c.iteration_len),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stweaver_core::testkit::TraceBuilder;

    /// Parameters, a first iteration whose gradient lives into the steady state, then
    /// steady iterations with activations and a gradient crossing the boundary.
    fn trace() -> Trace {
        let mut b = TraceBuilder::new();
        b.alloc(1 << 20);
        let warm = b.alloc(9000);
        let mut grad = b.alloc(1 << 19);
        b.free_completed(warm);
        for _ in 0..4 {
            let a = b.alloc(1 << 18);
            b.free_completed(grad);
            let t = b.alloc(3 << 16);
            b.free_completed(t);
            b.free_completed(a);
            grad = b.alloc(1 << 19);
        }
        b.done()
    }

    /// The tail's copies that differ from their slots only in lifetime are served by the
    /// iteration section at run time: they stay dynamic (the coverage check counts them)
    /// but leave the online peak; a tail request past the last slot still counts.
    #[test]
    fn tail_copies_a_slot_serves_leave_the_dynamic_peak() {
        let mut b = TraceBuilder::new();
        for _ in 0..5 {
            b.iteration_begin();
            let act = b.alloc(1 << 20);
            let t = b.alloc(4096);
            b.free(t);
            b.free(act);
        }
        b.iteration_begin();
        let act = b.alloc(1 << 20);
        let t = b.alloc(4096);
        b.free(act); // earlier than in the steady iterations
        b.free(t);
        let odd = b.alloc(7);
        b.free(odd);
        let t = b.done();
        let out = plan_trace(&t, &PlanOptions::default()).unwrap();
        let c = &out.classification;
        assert!(matches!(c.steady, Steady::Periodic(_)), "{:?}", c.steady);
        let dynamic = |id: stweaver_core::AllocId| {
            c.classes[id.index()] == AllocClass::Dynamic(DynamicReason::Irregular)
        };
        assert!(dynamic(act) && dynamic(odd), "{:?}", c.classes);
        assert!(out.plan.dynamic.requests >= 2);
        assert_eq!(
            out.plan.dynamic.peak_bytes,
            Bytes(7),
            "only the odd request counts"
        );
    }

    /// Both steady-state layouts give plans that pass the verifier and the coverage check.
    #[test]
    fn both_layouts_are_valid() {
        let t = trace();
        let opts = PlanOptions::default();
        let c = classify_with(&t, &opts.classify);
        assert!(matches!(c.steady, Steady::Periodic(_)));
        let (ticks, total) = plan_clock(&t);
        let life = tick_lifetimes(&t, &ticks);
        let padded: Vec<u64> = t
            .allocations
            .iter()
            .map(|a| a.size.align_up(ALIGNMENT).unwrap().get())
            .collect();
        let ctx = Ctx {
            trace: &t,
            c: &c,
            life: &life,
            padded: &padded,
            total,
            opts: &opts,
        };
        let steady_lb = steady_lower_bound(&t, &c);
        for layout in [Layout::ResidentNeverFreed, Layout::ResidentAllPersistent] {
            let mut timings = PlanTimings::default();
            let built = ctx.periodic_with(layout, &mut timings).unwrap();
            assert_eq!(built.layout, layout);
            let plan = ctx.assemble(&built);
            verify_plan(&plan).unwrap_or_else(|e| panic!("{layout:?}: {e}"));
            check_coverage(&t, &c, &plan).unwrap_or_else(|e| panic!("{layout:?}: {e}"));
            assert!(plan.pool_size >= steady_lb);
        }
        // The first gradient (persistent, freed in the steady state) fits where the
        // previous iteration's gradient would be: the pool is the steady state's.
        let out = plan_trace(&t, &opts).unwrap();
        assert_eq!(out.report.layout, Layout::ResidentNeverFreed);
        assert_eq!(out.report.pool_size, out.report.steady_peak);
        assert_eq!(out.report.pool_size, out.report.trace_lower_bound);
    }

    #[test]
    fn an_invalid_trace_is_an_error() {
        let t = Trace::default();
        assert!(matches!(
            plan_trace(&t, &PlanOptions::default()),
            Err(PlanBuildError::Trace(_))
        ));
    }
}
