//! Plans per iteration class (issue #18, item 1): a loop whose iterations are not all
//! alike (a few sequence-length buckets) has no single repeating iteration for
//! [`crate::planning::plan_trace`] to plan; [`plan_classes`] plans each class of
//! iterations ([`crate::iteration_classes`]) on its own, all in one pool.
//!
//! # The algorithm
//!
//! 1. **Iterations and classes.** The trace is cut at its iteration boundaries
//!    ([`crate::engine_replay::iteration_boundaries`]) and the iterations grouped by
//!    request signature ([`iteration_classes`]; spans without requests are no
//!    iterations). At most
//!    [`ClassPlanOptions::max_classes`] classes are planned, the most frequent first;
//!    they must cover [`ClassPlanOptions::min_coverage_percent`] of the recorded
//!    iterations, or there is nothing worth planning (a loop of fifty lengths, each
//!    seen once or twice: online serving does as well).
//! 2. **One iteration per class.** Each class is planned from one of its iterations, the
//!    last one that more requests follow (its tensors that cross the boundary show
//!    where they are freed; a recording taken at a boundary ends there, its last
//!    iteration's gradients never freed: planned from it, they and every request of
//!    their sizes were left unplanned, and len5 served at 1.025 x the lower bound
//!    instead of 1.001 x). The clock is the event index from the iteration's
//!    start; the class's length is its number of events.
//! 3. **Boundaries.** Any class may follow any other, so nothing planned may cross a
//!    boundary (module docs of `stweaver_core::plan`, iteration classes). A tensor
//!    allocated in the iteration and freed in the next one *before that iteration's
//!    first allocation* (the gradients `zero_grad(set_to_none=True)` drops right after
//!    the optimizer step that marks the boundary) is planned as freed at the
//!    iteration's end: no request of the next iteration comes before its free. A
//!    tensor freed later (a loss kept until the next one replaces it), or never, is not
//!    planned: the engine serves it as an unplanned request (a hole of the pool or
//!    online). Should a run free a "boundary" tensor later than recorded, the next
//!    request planned on its range finds it occupied: a conflict, served from a hole,
//!    never an alias (the engine checks every planned range before use). Every request
//!    of the size and stream of an unplanned one is left unplanned too: the engine
//!    matches requests to the plan by size and stream, and which of two such tensors
//!    outlives the iteration changes from one iteration to the next (the loss scalars
//!    of len5), so a planned one could be matched by the long-lived one (invariant 15
//!    of ARCHITECTURE.md, as `DynamicReason::SharesSizeWithUnplanned` in
//!    `crate::classify`).
//! 4. **Solve.** Each class is one linear solver [`Instance`] (sizes rounded up to
//!    [`ALIGNMENT`]) solved with the existing solver; without
//!    [`PlanOptions::share_streams`] each stream's requests are solved apart and the
//!    pools stacked (as `plan_trace` does, module docs of `crate::planning`). Classes
//!    never overlap in time, so they share the pool from offset 0: the pool is the
//!    largest class's.
//! 5. **The prologue, the persistent part once.** The requests made before the first
//!    boundary (setup, the first iteration) are the prologue. Its temporaries (freed
//!    before the first boundary, or in the first iteration before its first allocation:
//!    the first gradients) are solved as one more linear instance on the whole pool (no
//!    class runs before the first boundary); the tensors it never frees (parameters,
//!    optimizer state) are stacked above both, so no class ever uses their range. The
//!    prologue's late tensors and their twins are not planned (step 3): plan mode serves
//!    them beside the plan. Auto mode, switching mid-run, serves the classes alone (the persistent
//!    tensors stay where the online phase put them; `steady_slice` squeezes their range
//!    out), and its second recording, started mid-run, has no prologue at all.
//! 6. **Check.** [`verify_plan`] checks the plan: each class after the prologue, and
//!    that nothing crosses a boundary.
//!
//! # Cost
//!
//! O(events) to cut and group the iterations, then one solver run per class and
//! stream (the solver's cost, bounded by [`crate::solver::SolveOptions::time_budget`]
//! each), and the verifier (O(classes · n log n)).

use stweaver_core::trace_file::trace_digest;
use stweaver_core::verify::{PlanViolations, verify_plan};
use stweaver_core::{
    Bytes, ClassSection, DynamicSummary, EventKind, NEVER_FREED, Offset, Plan, PlannedRequest,
    StreamId, Trace,
};

use crate::engine_replay::iteration_boundaries;
use crate::iteration_classes::iteration_classes;
use crate::planning::{ALIGNMENT, PlanOptions};
use crate::solver::{Buffer, Instance, SolveError, solve};

/// How to plan per class.
#[derive(Debug, Clone)]
pub struct ClassPlanOptions {
    /// The solver and stream settings, as for `plan_trace`.
    pub plan: PlanOptions,
    /// Classes planned at most, the most frequent first (the engine follows at most
    /// `stweaver_core::engine::MAX_PLAN_CLASSES`).
    pub max_classes: usize,
    /// The planned classes must cover at least this share of the recorded iterations.
    pub min_coverage_percent: u32,
}

impl Default for ClassPlanOptions {
    fn default() -> Self {
        ClassPlanOptions {
            plan: PlanOptions::default(),
            max_classes: stweaver_core::engine::MAX_PLAN_CLASSES,
            min_coverage_percent: 90,
        }
    }
}

/// Why no plan per class was made.
#[derive(Debug, thiserror::Error)]
pub enum ClassPlanError {
    #[error("the trace has no iterations to plan (no boundaries, or none with requests)")]
    NoIterations,
    #[error(
        "the {planned} most frequent of {classes} iteration classes cover {covered} of {iterations} iterations, less than {percent} %: too many classes to plan"
    )]
    TooManyClasses {
        classes: usize,
        planned: usize,
        covered: usize,
        iterations: usize,
        percent: u32,
    },
    /// `class` = the number of classes planned: the prologue.
    #[error("solving class {class}: {error}")]
    Solve { class: usize, error: SolveError },
    #[error("the plan per class failed verification (a planner bug): {0}")]
    Invalid(PlanViolations),
}

/// A plan per class and what it covers.
#[derive(Debug, Clone)]
pub struct ClassPlan {
    pub plan: Plan,
    /// Iteration classes in the trace, and how many were planned.
    pub classes: usize,
    pub planned: usize,
    /// Recorded iterations, and how many are of a planned class.
    pub iterations: usize,
    pub covered: usize,
}

/// Plans `trace` per iteration class (module docs).
pub fn plan_classes(trace: &Trace, opts: &ClassPlanOptions) -> Result<ClassPlan, ClassPlanError> {
    // Spans without requests (two markers at one boundary) are no iterations.
    let classes: Vec<_> = iteration_classes(trace)
        .into_iter()
        .filter(|c| c.allocs > 0)
        .collect();
    let bounds = iteration_boundaries(trace);
    let iterations: usize = classes.iter().map(|c| c.iterations.len()).sum();
    if classes.is_empty() || iterations == 0 {
        return Err(ClassPlanError::NoIterations);
    }
    let planned = classes.len().min(opts.max_classes.max(1));
    let covered: usize = classes[..planned].iter().map(|c| c.iterations.len()).sum();
    if covered * 100 < iterations * opts.min_coverage_percent as usize {
        return Err(ClassPlanError::TooManyClasses {
            classes: classes.len(),
            planned,
            covered,
            iterations,
            percent: opts.min_coverage_percent,
        });
    }
    let n = trace.events.len();
    // Iteration `j` spans events `[bounds[j], bounds[j + 1])` (the last one to the end).
    let span = |j: usize| (bounds[j], bounds.get(j + 1).copied().unwrap_or(n));
    // The first allocation at or after each event (n: none).
    let mut next_alloc = vec![n; n + 1];
    for i in (0..n).rev() {
        next_alloc[i] = if matches!(trace.events[i].kind, EventKind::Alloc(_)) {
            i
        } else {
            next_alloc[i + 1]
        };
    }
    let life = trace.lifetimes();
    // Allocations by their alloc event.
    let mut alloc_at = vec![None; n];
    for (a, l) in life.iter().enumerate() {
        if let Some(s) = l.start {
            alloc_at[s.index()] = Some(a);
        }
    }
    let mut sections: Vec<(Vec<PlannedRequest>, u64)> = Vec::with_capacity(planned);
    let mut pool = 0u64;
    let mut unplanned = 0u64;
    let mut unplanned_bytes = 0u64;
    for (ci, class) in classes[..planned].iter().enumerate() {
        // The last iteration of the class that requests follow (else its last): the
        // tensors crossing into the next iteration are then freed where the run frees
        // them (a recording taken at a boundary ends there, its last iteration's
        // gradients never freed).
        let followed = |j: usize| next_alloc[span(j).1] < n;
        let j = class
            .iterations
            .iter()
            .rev()
            .copied()
            .find(|&j| followed(j))
            .unwrap_or(*class.iterations.last().expect("a class has iterations"));
        let (b, e) = span(j);
        let len = (e - b) as u64;
        let mut reqs: Vec<PlannedRequest> = Vec::with_capacity(class.allocs);
        // (size, stream) of the requests left unplanned (module docs, step 3).
        let mut left: Vec<(Bytes, StreamId)> = Vec::new();
        for (i, a) in alloc_at.iter().enumerate().take(e).skip(b) {
            let Some(a) = *a else { continue };
            let al = &trace.allocations[a];
            let end = match life[a].end.map(|f| f.index()) {
                Some(f) if f < e => (f - b) as u64,
                // Freed in the next iteration before its first allocation (module docs).
                Some(f) if f < next_alloc[e] => len,
                _ => {
                    left.push((al.size, al.stream));
                    continue;
                }
            };
            reqs.push(PlannedRequest {
                size: al.size,
                stream: al.stream,
                offset: Offset(0),
                start: (i - b) as u64,
                end,
            });
        }
        // Requests of the size and stream of an unplanned one stay unplanned too (the
        // engine matches by size and stream: module docs, step 3).
        let before = reqs.len();
        reqs.retain(|r| !left.contains(&(r.size, r.stream)));
        unplanned += (left.len() + before - reqs.len()) as u64;
        unplanned_bytes += left.iter().map(|(s, _)| s.get()).sum::<u64>();
        pool = pool.max(place(&mut reqs, opts, ci)?);
        sections.push((reqs, len));
    }
    // The prologue (module docs, step 5): its temporaries on the whole pool (no class
    // runs before the first boundary), its persistent tensors stacked above.
    let b0 = bounds[0];
    let prologue_len = b0 as u64;
    let mut temps: Vec<PlannedRequest> = Vec::new();
    let mut late: Vec<(Bytes, StreamId)> = Vec::new();
    let mut persistent: Vec<(usize, usize)> = Vec::new();
    for (i, a) in alloc_at.iter().enumerate().take(b0) {
        let Some(a) = *a else { continue };
        let al = &trace.allocations[a];
        let end = match life[a].end.map(|f| f.index()) {
            Some(f) if f < b0 => f as u64,
            Some(f) if f < next_alloc[b0] => prologue_len,
            Some(_) => {
                late.push((al.size, al.stream));
                continue;
            }
            None => {
                persistent.push((i, a));
                continue;
            }
        };
        temps.push(PlannedRequest {
            size: al.size,
            stream: al.stream,
            offset: Offset(0),
            start: i as u64,
            end,
        });
    }
    // No temporary of the size and stream of a late one (step 3's twin rule). A
    // persistent tensor's twins stay planned: the parameters come first and the
    // optimizer state after the first backward, in order, so the first gradients, of
    // their sizes, find their own places (dropping them sent them to the pool's tail:
    // len5 from the start, 1.043 x the lower bound instead of 1.0003 x).
    let before = temps.len();
    temps.retain(|r| !late.contains(&(r.size, r.stream)));
    unplanned += (late.len() + before - temps.len()) as u64;
    let temp_top = place(&mut temps, opts, planned)?;
    let mut top = pool.max(temp_top);
    let mut prologue = temps;
    for (i, a) in persistent {
        let al = &trace.allocations[a];
        prologue.push(PlannedRequest {
            size: al.size,
            stream: al.stream,
            offset: Offset(top),
            start: i as u64,
            end: NEVER_FREED,
        });
        top += al.size.get().div_ceil(ALIGNMENT.get()) * ALIGNMENT.get();
    }
    pool = top;
    // In the order the run makes them.
    prologue.sort_by_key(|r| r.start);
    let mut sections = sections.into_iter();
    let (iteration, iteration_len) = sections.next().expect("one class at least");
    let mut plan = Plan {
        device: trace.device,
        alignment: ALIGNMENT,
        pool_size: Bytes(pool),
        lower_bound: Bytes::ZERO,
        trace_digest: trace_digest(trace),
        prologue,
        prologue_len,
        iteration,
        iteration_len,
        extra_classes: sections
            .map(|(requests, len)| ClassSection { requests, len })
            .collect(),
        dynamic: DynamicSummary {
            requests: unplanned,
            // An upper bound: the unplanned requests of the planned iterations, as if
            // all were live at once.
            peak_bytes: Bytes(unplanned_bytes),
        },
        budget: None,
        offload: Vec::new(),
        saved_packs: 0,
        saved_unpacks: 0,
    };
    let report = verify_plan(&plan).map_err(ClassPlanError::Invalid)?;
    plan.lower_bound = report.peak_live;
    Ok(ClassPlan {
        plan,
        classes: classes.len(),
        planned,
        iterations,
        covered,
    })
}

/// What [`merge_class_plans`] made: the plan auto mode switches to, and what it added.
#[derive(Debug, Clone)]
pub struct MergedClasses {
    /// The served plan's classes first, then the new ones (no prologue: a steady slice).
    pub plan: Plan,
    /// Classes of `new` the served plan did not have, and how many of them fit in.
    pub new_classes: usize,
    pub added: usize,
}

/// The request sequence (size and stream, in order) that identifies a planned class.
fn section_key(reqs: &[PlannedRequest]) -> Vec<(Bytes, StreamId)> {
    reqs.iter().map(|r| (r.size, r.stream)).collect()
}

/// Auto mode learning classes after its switch (issue #18 item 2, `crate::auto`, module
/// docs): the plan served (`served`) with the classes of a plan per class of a later
/// recording (`new`) that it does not have, up to `max_classes` in all. Both are taken
/// as their steady slices (`stweaver_core::engine::steady_slice`: the classes alone,
/// the persistent tensors' room squeezed out), so every class starts at offset 0 of one
/// pool and the pool is the largest class's: classes never overlap in time (nothing
/// planned crosses a boundary), so their sections simply stand side by side. The served
/// classes keep their places (what is live in the pool at the switch is unplanned
/// anyway); a class of `new` is the same as a served one when its request sequence
/// (sizes and streams) is. New classes are taken in `new`'s order, the most frequent
/// first. A served plan that cannot take classes (a single iteration planned across its
/// boundary, as a plan of one repeating iteration may be, or one carrying offload: see
/// [`takes_classes`]) is replaced by `new` whole when `new` has several classes. `Ok(None)`:
/// nothing new to add. The merged plan is verified ([`verify_plan`]). O(requests) plus the
/// verifier.
pub fn merge_class_plans(
    served: &Plan,
    new: &Plan,
    max_classes: usize,
) -> Result<Option<MergedClasses>, String> {
    use stweaver_core::engine::steady_slice;
    let old = steady_slice(served)?;
    let new = steady_slice(new)?;
    if !takes_classes(&old) {
        let k = new.class_count();
        if k < 2 {
            return Err(format!(
                "the served plan takes no other class (its iteration crosses its boundary, or it offloads), and the recording has {k} class(es)"
            ));
        }
        return Ok(Some(MergedClasses {
            plan: new,
            new_classes: k,
            added: k,
        }));
    }
    let known: Vec<Vec<(Bytes, StreamId)>> = (0..old.class_count())
        .map(|c| section_key(old.class(c).0))
        .collect();
    let fresh: Vec<usize> = (0..new.class_count())
        .filter(|&c| !known.contains(&section_key(new.class(c).0)))
        .collect();
    let room = max_classes.saturating_sub(old.class_count());
    let added = fresh.len().min(room);
    if added == 0 {
        return Ok(None);
    }
    let mut plan = old.clone();
    plan.pool_size = old.pool_size.max(new.pool_size);
    plan.extra_classes.extend(fresh[..added].iter().map(|&c| {
        let (requests, len) = new.class(c);
        ClassSection {
            requests: requests.to_vec(),
            len,
        }
    }));
    plan.dynamic.requests += new.dynamic.requests;
    plan.dynamic.peak_bytes = plan.dynamic.peak_bytes.max(new.dynamic.peak_bytes);
    let report = verify_plan(&plan)
        .map_err(|v| format!("the merged plan per class is invalid (a planner bug): {v}"))?;
    plan.lower_bound = report.peak_live;
    Ok(Some(MergedClasses {
        plan,
        new_classes: fresh.len(),
        added,
    }))
}

/// Whether `plan` may stand beside other classes in one plan (the rules of
/// `stweaver_core::verify`, iteration classes): no offload, and no request of its
/// classes crosses its class's end. O(requests).
pub fn takes_classes(plan: &Plan) -> bool {
    plan.offload.is_empty()
        && (0..plan.class_count()).all(|c| {
            let (reqs, len) = plan.class(c);
            reqs.iter().all(|r| r.end == NEVER_FREED || r.end <= len)
        })
}

/// Places one class's requests (module docs, step 4); returns the class's pool.
fn place(
    reqs: &mut [PlannedRequest],
    opts: &ClassPlanOptions,
    class: usize,
) -> Result<u64, ClassPlanError> {
    let align = ALIGNMENT.get();
    let mut streams: Vec<StreamId> = Vec::new();
    if opts.plan.share_streams {
        streams.push(StreamId(0));
    } else {
        for r in reqs.iter() {
            if !streams.contains(&r.stream) {
                streams.push(r.stream);
            }
        }
    }
    let mut base = 0u64;
    for s in streams {
        let mine: Vec<usize> = (0..reqs.len())
            .filter(|&i| opts.plan.share_streams || reqs[i].stream == s)
            .collect();
        let instance = Instance::new(
            mine.iter()
                .map(|&i| {
                    let r = &reqs[i];
                    Buffer::new(r.start, r.end, Bytes(r.size.get().div_ceil(align) * align))
                        .with_align(ALIGNMENT)
                })
                .collect(),
        );
        let sol = solve(&instance, &opts.plan.solve)
            .map_err(|error| ClassPlanError::Solve { class, error })?;
        for (&i, o) in mine.iter().zip(&sol.offsets) {
            reqs[i].offset = Offset(base + o.get());
        }
        base += sol.peak.get().div_ceil(align) * align;
    }
    Ok(base)
}
