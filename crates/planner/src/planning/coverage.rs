//! Coverage: does a plan serve exactly the allocations a classification says it plans?
//!
//! Independent of how the plan was built: requests are looked up by their start tick
//! (one alloc per tick, so a tick names one request of a section), never by the
//! planner's slot numbering. The checks:
//!
//! 1. the plan's clock matches the classification: same prologue length and, with a
//!    steady state, the same iteration length;
//! 2. every persistent or prologue allocation has a prologue request at its alloc tick
//!    (tick 0 for a preexisting one) with its size and stream, ending at its free tick,
//!    or at [`NEVER_FREED`] when the trace never frees it; each request serves one
//!    allocation, and no prologue request is left over;
//! 3. every per-iteration allocation made in iteration `k` at tick `P + k·L + s` has
//!    an iteration request starting at `s` with its size and stream, ending where the
//!    trace frees it (`P + k·L + end`), or — when the trace ends first — not before the
//!    trace's end; in each complete iteration every iteration request serves exactly
//!    one allocation, in the incomplete tail at most one;
//! 4. no dynamic allocation has a request (by 2 and 3: none is left over), and the
//!    plan's dynamic summary counts them.
//!
//! Cost: O(allocations + requests) with hash maps.

use std::fmt;

use rustc_hash::FxHashMap;
use stweaver_core::{AllocId, Bytes, NEVER_FREED, Plan, StreamId, Trace};

use crate::classify::{AllocClass, Classification, plan_clock, tick_lifetimes};

/// One way a plan fails to cover a trace.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoverageProblem {
    #[error(
        "the plan's clock (prologue {plan_prologue} ticks, iteration {plan_iteration}) does not match the trace's (prologue {trace_prologue}, iteration {trace_iteration})"
    )]
    Clock {
        plan_prologue: u64,
        plan_iteration: u64,
        trace_prologue: u64,
        trace_iteration: u64,
    },
    #[error(
        "allocation {alloc} ({size} on {stream}, alloc tick {start}) has no {section} request starting at tick {rel_start}"
    )]
    Missing {
        alloc: AllocId,
        size: Bytes,
        stream: StreamId,
        start: u64,
        section: &'static str,
        rel_start: u64,
    },
    #[error(
        "allocation {alloc} ({size} on {stream}) meets {section} request #{request} ({req_size} on {req_stream}), which differs in {what}"
    )]
    Differs {
        alloc: AllocId,
        size: Bytes,
        stream: StreamId,
        section: &'static str,
        request: usize,
        req_size: Bytes,
        req_stream: StreamId,
        what: &'static str,
    },
    #[error("{section} request #{request} serves allocations {first} and {second}")]
    Twice {
        section: &'static str,
        request: usize,
        first: AllocId,
        second: AllocId,
    },
    #[error("prologue request #{request} serves no allocation of the trace")]
    UnusedPrologueRequest { request: usize },
    #[error("iteration request #{request} serves no allocation in steady iteration {iteration}")]
    UnusedIterationRequest { request: usize, iteration: u64 },
    #[error("the plan says {plan} requests are dynamic, the trace has {trace}")]
    DynamicCount { plan: u64, trace: u64 },
    #[error("the classification has {classes} entries for {allocations} allocations")]
    Shape { classes: usize, allocations: usize },
}

/// The problems found (at most `MAX_REPORTED`, 32).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoverageError(pub Vec<CoverageProblem>);

/// Coverage stops collecting after this many problems.
pub const MAX_REPORTED: usize = 32;

impl fmt::Display for CoverageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the plan does not cover the trace ({} problem{}{})",
            self.0.len(),
            if self.0.len() == 1 { "" } else { "s" },
            if self.0.len() >= MAX_REPORTED {
                ", list truncated"
            } else {
                ""
            }
        )?;
        for p in &self.0 {
            write!(f, "\n  - {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CoverageError {}

/// What a covering plan serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CoverageReport {
    /// Allocations served by prologue requests.
    pub prologue_allocations: usize,
    /// Allocations served by iteration requests (all iterations).
    pub iteration_allocations: usize,
    /// Allocations left to dynamic serving.
    pub dynamic_allocations: usize,
}

/// Checks that `plan` serves exactly the planned allocations of `trace` as `classes`
/// classifies them (module docs).
pub fn check_coverage(
    trace: &Trace,
    classes: &Classification,
    plan: &Plan,
) -> Result<CoverageReport, CoverageError> {
    let mut problems = Vec::new();
    if classes.classes.len() != trace.allocations.len() {
        return Err(CoverageError(vec![CoverageProblem::Shape {
            classes: classes.classes.len(),
            allocations: trace.allocations.len(),
        }]));
    }
    let periodic = !classes.slots.is_empty() || classes.iteration_len > 0;
    if plan.prologue_len != classes.prologue_len
        || (periodic && plan.iteration_len != classes.iteration_len)
        || (!periodic && !plan.iteration.is_empty())
    {
        return Err(CoverageError(vec![CoverageProblem::Clock {
            plan_prologue: plan.prologue_len,
            plan_iteration: plan.iteration_len,
            trace_prologue: classes.prologue_len,
            trace_iteration: classes.iteration_len,
        }]));
    }
    let (ticks, total) = plan_clock(trace);
    let life = tick_lifetimes(trace, &ticks);
    let (p, l) = (classes.prologue_len, classes.iteration_len);

    let mut pro_at: FxHashMap<u64, Vec<usize>> = FxHashMap::default();
    for (i, r) in plan.prologue.iter().enumerate() {
        pro_at.entry(r.start).or_default().push(i);
    }
    let mut it_at: FxHashMap<u64, usize> = FxHashMap::default();
    for (i, r) in plan.iteration.iter().enumerate() {
        it_at.insert(r.start, i);
    }
    let mut pro_used: Vec<Option<AllocId>> = vec![None; plan.prologue.len()];
    // (iteration request, iteration) -> the allocation it serves there.
    let mut it_used: FxHashMap<(usize, u64), AllocId> = FxHashMap::default();
    let mut report = CoverageReport::default();

    let push = |problems: &mut Vec<CoverageProblem>, pb| {
        if problems.len() < MAX_REPORTED {
            problems.push(pb);
        }
    };
    for (i, (a, class)) in trace.allocations.iter().zip(&classes.classes).enumerate() {
        let id = AllocId(i as u32);
        let (start, end) = life[i];
        match *class {
            AllocClass::Dynamic(_) => report.dynamic_allocations += 1,
            AllocClass::Persistent | AllocClass::Prologue => {
                let want_end = end.unwrap_or(NEVER_FREED);
                let cands = pro_at.get(&start).map_or(&[][..], Vec::as_slice);
                let found = cands.iter().copied().find(|&r| {
                    let q = &plan.prologue[r];
                    pro_used[r].is_none()
                        && q.size == a.size
                        && q.stream == a.stream
                        && q.end == want_end
                });
                match found {
                    Some(r) => {
                        pro_used[r] = Some(id);
                        report.prologue_allocations += 1;
                    }
                    None => {
                        let pb = match cands.first() {
                            Some(&r) => {
                                let q = &plan.prologue[r];
                                CoverageProblem::Differs {
                                    alloc: id,
                                    size: a.size,
                                    stream: a.stream,
                                    section: "prologue",
                                    request: r,
                                    req_size: q.size,
                                    req_stream: q.stream,
                                    what: if q.size != a.size {
                                        "size"
                                    } else if q.stream != a.stream {
                                        "stream"
                                    } else if q.end != want_end {
                                        "free tick"
                                    } else {
                                        "being taken by another allocation"
                                    },
                                }
                            }
                            None => CoverageProblem::Missing {
                                alloc: id,
                                size: a.size,
                                stream: a.stream,
                                start,
                                section: "prologue",
                                rel_start: start,
                            },
                        };
                        push(&mut problems, pb);
                    }
                }
            }
            AllocClass::PerIteration { iteration, .. } => {
                let k = u64::from(iteration);
                let base = p + k * l;
                // The iteration request starting where this allocation does (relative
                // to its iteration), if it starts inside that iteration at all.
                let request = start
                    .checked_sub(base)
                    .filter(|&rel| rel < l)
                    .and_then(|rel| it_at.get(&rel).copied());
                let Some(r) = request else {
                    push(
                        &mut problems,
                        CoverageProblem::Missing {
                            alloc: id,
                            size: a.size,
                            stream: a.stream,
                            start,
                            section: "iteration",
                            rel_start: start.saturating_sub(base),
                        },
                    );
                    continue;
                };
                let q = &plan.iteration[r];
                let end_ok = match end {
                    Some(e) => base + q.end == e,
                    None => base.saturating_add(q.end) >= total,
                };
                let what = if q.size != a.size {
                    Some("size")
                } else if q.stream != a.stream {
                    Some("stream")
                } else if !end_ok {
                    Some("free tick")
                } else {
                    None
                };
                if let Some(what) = what {
                    push(
                        &mut problems,
                        CoverageProblem::Differs {
                            alloc: id,
                            size: a.size,
                            stream: a.stream,
                            section: "iteration",
                            request: r,
                            req_size: q.size,
                            req_stream: q.stream,
                            what,
                        },
                    );
                    continue;
                }
                if let Some(&first) = it_used.get(&(r, k)) {
                    push(
                        &mut problems,
                        CoverageProblem::Twice {
                            section: "iteration",
                            request: r,
                            first,
                            second: id,
                        },
                    );
                    continue;
                }
                it_used.insert((r, k), id);
                report.iteration_allocations += 1;
            }
        }
    }
    for (r, used) in pro_used.iter().enumerate() {
        if used.is_none() {
            push(
                &mut problems,
                CoverageProblem::UnusedPrologueRequest { request: r },
            );
        }
    }
    // Every iteration request serves one allocation in each complete iteration.
    'requests: for r in 0..plan.iteration.len() {
        for k in 0..classes.repetitions {
            if !it_used.contains_key(&(r, k)) {
                push(
                    &mut problems,
                    CoverageProblem::UnusedIterationRequest {
                        request: r,
                        iteration: k,
                    },
                );
                continue 'requests;
            }
        }
    }
    if plan.dynamic.requests != report.dynamic_allocations as u64 {
        push(
            &mut problems,
            CoverageProblem::DynamicCount {
                plan: plan.dynamic.requests,
                trace: report.dynamic_allocations as u64,
            },
        );
    }
    if problems.is_empty() {
        Ok(report)
    } else {
        Err(CoverageError(problems))
    }
}
