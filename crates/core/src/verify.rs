//! The plan verifier: the one checker every plan passes, in tests, in the CLI and on load.
//!
//! It shares no code with the solver. It checks a [`Plan`] as a value:
//!
//! 1. **alignment**: the alignment is a power of two and every offset is a multiple of it;
//! 2. **bounds**: `offset + size <= pool_size` (no overflow) for every request;
//! 3. **lifetimes**: `start < end`, `start` inside its section, iteration requests freed
//!    eventually (a never-freed request cannot repeat forever at one offset) and within
//!    one iteration's length (`end - start <= L`: a longer one overlaps its own next
//!    instance, which lives at the same offset);
//! 4. **no overlap in address × time**: on the unrolled timeline (the prologue on
//!    `[0, P)`, iteration `k` on `[P + k·L, P + (k+1)·L)`), no two live requests share a
//!    byte.
//! 5. **budget and offload** (a plan with [`Plan::budget`] or [`Plan::offload`]):
//!    `pool_size <= budget` (the pool is the planned device peak); an offload schedule
//!    needs a budget; every [`crate::plan::OffloadEntry`] names two different existing
//!    iteration requests (its out and back requests, each used by no other entry) of
//!    its size and on one stream, the back request starts after the out request
//!    starts and ends after it ends, the out request ends within its iteration (the
//!    device copy is gone before the iteration's backward needs the tensor back);
//!    ordinals are in range (`pack < saved_packs`, `unpack` and the prefetch trigger
//!    `< saved_unpacks`), the trigger is an earlier unpack than the tensor's own, and
//!    no two entries share a pack or an unpack. O(entries + iteration requests).
//!
//! 6. **iteration classes** (a plan with [`Plan::extra_classes`]): the plan has an
//!    iteration section (class 0), no offload schedule, and no iteration request of any
//!    class ends past its class's length (any class may follow any other: nothing may
//!    cross a boundary); then each class is checked as above as the only iteration
//!    section after the prologue. That covers every order of classes: iterations never
//!    overlap in time, and a prologue request meets the earliest instance of a class's
//!    request when that class comes first, which its own check unrolls. O(classes ·
//!    (prologue + 4 · class requests) · log).
//!
//! Coverage (every planned allocation of a trace has a request) is checked by the
//! planner, which owns the mapping from trace to plan.
//!
//! ## How the overlap check works, and what it costs
//!
//! A request of iteration `k` lives on `[P + k·L + start, P + k·L + end)`. Let `m` be the
//! largest number of iterations any iteration request spans (`ceil((end - start) / L)`,
//! at most 1 once check 3 passed). Two iteration instances can be live together only
//! when their iterations differ by at most `m`, and whether they overlap depends only on
//! that difference, so iterations `0 .. 2m + 2` hold every such pair. A prologue request
//! `R` (it starts before `P`) and instance `k` of an iteration request `i` are live
//! together iff `P + k·L + start_i < end_R`, which is weakest at `k = 0`: iteration 0
//! already shows every prologue–iteration clash, however long `R` lives (never-freed
//! ones included), so a long-lived prologue request adds no iterations. The peak of
//! live bytes is reached in the prologue or iterations `0 ..= m` (later iterations
//! repeat the iteration part while the prologue part only shrinks), so the reported
//! peak is exact. The verifier unrolls `2m + 2` iterations and sweeps time in order
//! (frees before allocs at the same tick, since lifetimes are half-open) with an ordered
//! map of live address ranges: inserting a range checks only its two neighbours. Cost:
//! O(N log N) time and O(N) memory for N = prologue + (2m + 2) · iteration requests
//! ≤ prologue + 4 · iteration requests, whatever the lifetimes in the file say.

use std::collections::BTreeMap;
use std::fmt;

use crate::plan::{NEVER_FREED, Plan, PlannedRequest};
use crate::units::{Bytes, Offset};

/// Which request a finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestRef {
    /// Index into [`Plan::prologue`].
    Prologue(usize),
    /// Index into [`Plan::iteration`], in unrolled iteration `k`.
    Iteration { index: usize, k: u64 },
}

impl fmt::Display for RequestRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestRef::Prologue(i) => write!(f, "prologue request #{i}"),
            RequestRef::Iteration { index, k } => {
                write!(f, "iteration request #{index} (iteration {k})")
            }
        }
    }
}

/// One thing wrong with a plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanViolation {
    #[error("alignment {0} is not a power of two")]
    BadAlignment(Bytes),
    #[error("{at}: offset {offset} is not a multiple of the alignment {align}")]
    Misaligned {
        at: RequestRef,
        offset: Offset,
        align: Bytes,
    },
    #[error("{at}: size 0")]
    ZeroSize { at: RequestRef },
    #[error("{at}: [{offset}, +{size}) ends past the pool ({pool})")]
    OutOfBounds {
        at: RequestRef,
        offset: Offset,
        size: Bytes,
        pool: Bytes,
    },
    #[error(
        "{at}: lifetime [{start}, {end}) is empty or starts outside its section (length {len})"
    )]
    BadLifetime {
        at: RequestRef,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("{at}: an iteration request that is never freed cannot repeat at one offset")]
    IterationNeverFreed { at: RequestRef },
    #[error(
        "{at}: lifetime [{start}, {end}) is longer than one iteration ({len} ticks), so it overlaps its own next instance"
    )]
    OutlivesIteration {
        at: RequestRef,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("an iteration section has {count} requests but length 0")]
    EmptyIterationClock { count: usize },
    #[error(
        "{a} [{a_offset}, +{a_size}) and {b} [{b_offset}, +{b_size}) are live together at tick {tick} and overlap"
    )]
    Overlap {
        a: RequestRef,
        a_offset: Offset,
        a_size: Bytes,
        b: RequestRef,
        b_offset: Offset,
        b_size: Bytes,
        tick: u64,
    },
    #[error("the pool ({pool}) is larger than the plan's budget ({budget})")]
    OverBudget { pool: Bytes, budget: Bytes },
    #[error("the plan offloads {0} tensors but has no budget")]
    OffloadWithoutBudget(usize),
    #[error("offload entry #{entry}: {problem}")]
    BadOffload { entry: usize, problem: String },
    #[error("iteration class {class}: {violation}")]
    InClass {
        class: usize,
        violation: Box<PlanViolation>,
    },
    #[error(
        "iteration class {class}, request #{index}: ends at tick {end}, past its class's {len} ticks (a plan with several classes lets no request cross a boundary)"
    )]
    CrossesClassBoundary {
        class: usize,
        index: usize,
        end: u64,
        len: u64,
    },
    #[error("the plan has {0} extra iteration classes but no iteration section")]
    ClassesWithoutIteration(usize),
    #[error("the plan has several iteration classes and an offload schedule")]
    OffloadWithClasses,
    #[error("the unrolled timeline would need {0} entries, more than the verifier accepts")]
    TooLarge(u128),
    #[error(
        "the unrolled timeline runs past the last plan-clock tick (2^64 - 1): prologue length {prologue_len}, iteration length {iteration_len}, {iterations} iterations unrolled"
    )]
    ClockOverflow {
        prologue_len: u64,
        iteration_len: u64,
        iterations: u64,
    },
}

/// All violations found (at most [`MAX_REPORTED`]), in the order found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanViolations(pub Vec<PlanViolation>);

/// The verifier stops collecting after this many violations.
pub const MAX_REPORTED: usize = 64;

/// Unrolled timelines larger than this are refused rather than checked slowly.
const MAX_UNROLLED: u128 = 1 << 28;

impl fmt::Display for PlanViolations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "plan is invalid ({} problem", self.0.len())?;
        if self.0.len() != 1 {
            f.write_str("s")?;
        }
        if self.0.len() >= MAX_REPORTED {
            f.write_str(", list truncated")?;
        }
        f.write_str(")")?;
        for v in &self.0 {
            write!(f, "\n  - {v}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PlanViolations {}

/// What a valid plan looks like from the verifier's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyReport {
    /// The highest `offset + size` of any request (≤ the pool size).
    pub used: Bytes,
    /// The peak of live requested bytes on the unrolled timeline.
    pub peak_live: Bytes,
    /// Iterations unrolled to check the repeating section.
    pub iterations_unrolled: u64,
}

/// Checks a plan. See the module docs for what is checked and the cost.
pub fn verify_plan(plan: &Plan) -> Result<VerifyReport, PlanViolations> {
    if plan.extra_classes.is_empty() {
        return verify_one(plan);
    }
    let mut errs = Vec::new();
    if plan.iteration.is_empty() {
        errs.push(PlanViolation::ClassesWithoutIteration(
            plan.extra_classes.len(),
        ));
    }
    if !plan.offload.is_empty() {
        errs.push(PlanViolation::OffloadWithClasses);
    }
    for c in 0..plan.class_count() {
        let (reqs, len) = plan.class(c);
        for (index, r) in reqs.iter().enumerate() {
            if r.end != NEVER_FREED && r.end > len {
                errs.push(PlanViolation::CrossesClassBoundary {
                    class: c,
                    index,
                    end: r.end,
                    len,
                });
            }
        }
    }
    if !errs.is_empty() {
        errs.truncate(MAX_REPORTED);
        return Err(PlanViolations(errs));
    }
    let mut report = VerifyReport {
        used: Bytes::ZERO,
        peak_live: Bytes::ZERO,
        iterations_unrolled: 0,
    };
    for c in 0..plan.class_count() {
        let (reqs, len) = plan.class(c);
        let one = Plan {
            device: plan.device,
            alignment: plan.alignment,
            pool_size: plan.pool_size,
            lower_bound: plan.lower_bound,
            trace_digest: plan.trace_digest,
            prologue: plan.prologue.clone(),
            prologue_len: plan.prologue_len,
            iteration: reqs.to_vec(),
            iteration_len: len,
            extra_classes: Vec::new(),
            dynamic: plan.dynamic,
            budget: plan.budget,
            offload: Vec::new(),
            saved_packs: 0,
            saved_unpacks: 0,
        };
        match verify_one(&one) {
            Ok(r) => {
                report.used = report.used.max(r.used);
                report.peak_live = report.peak_live.max(r.peak_live);
                report.iterations_unrolled = report.iterations_unrolled.max(r.iterations_unrolled);
            }
            Err(v) => errs.extend(v.0.into_iter().map(|violation| PlanViolation::InClass {
                class: c,
                violation: Box::new(violation),
            })),
        }
        if errs.len() >= MAX_REPORTED {
            errs.truncate(MAX_REPORTED);
            break;
        }
    }
    if errs.is_empty() {
        Ok(report)
    } else {
        Err(PlanViolations(errs))
    }
}

/// [`verify_plan`] for a plan of one iteration class (module docs, checks 1–5).
fn verify_one(plan: &Plan) -> Result<VerifyReport, PlanViolations> {
    let mut errs = Vec::new();
    let align = plan.alignment;
    if !align.get().is_power_of_two() {
        errs.push(PlanViolation::BadAlignment(align));
        return Err(PlanViolations(errs));
    }
    if !plan.iteration.is_empty() && plan.iteration_len == 0 {
        errs.push(PlanViolation::EmptyIterationClock {
            count: plan.iteration.len(),
        });
        return Err(PlanViolations(errs));
    }

    let mut used = 0u64;
    let mut check_static = |at: RequestRef, r: &PlannedRequest, len: u64, errs: &mut Vec<_>| {
        if r.size == Bytes::ZERO {
            errs.push(PlanViolation::ZeroSize { at });
        }
        if !r.offset.get().is_multiple_of(align.get()) {
            errs.push(PlanViolation::Misaligned {
                at,
                offset: r.offset,
                align,
            });
        }
        match r.offset.end(r.size) {
            Some(end) if end.get() <= plan.pool_size.get() => used = used.max(end.get()),
            _ => errs.push(PlanViolation::OutOfBounds {
                at,
                offset: r.offset,
                size: r.size,
                pool: plan.pool_size,
            }),
        }
        if r.start >= r.end || r.start >= len {
            errs.push(PlanViolation::BadLifetime {
                at,
                start: r.start,
                end: r.end,
                len,
            });
        }
    };
    for (i, r) in plan.prologue.iter().enumerate() {
        check_static(RequestRef::Prologue(i), r, plan.prologue_len, &mut errs);
    }
    for (i, r) in plan.iteration.iter().enumerate() {
        let at = RequestRef::Iteration { index: i, k: 0 };
        check_static(at, r, plan.iteration_len, &mut errs);
        if r.end == NEVER_FREED {
            errs.push(PlanViolation::IterationNeverFreed { at });
        } else if r.start < r.end && r.end - r.start > plan.iteration_len {
            errs.push(PlanViolation::OutlivesIteration {
                at,
                start: r.start,
                end: r.end,
                len: plan.iteration_len,
            });
        }
    }
    check_offload(plan, &mut errs);
    if !errs.is_empty() {
        errs.truncate(MAX_REPORTED);
        return Err(PlanViolations(errs));
    }

    // How many iterations to unroll (module docs).
    let p = plan.prologue_len;
    let l = plan.iteration_len;
    let iterations: u128 = if plan.iteration.is_empty() {
        0
    } else {
        // At most 1: every iteration request lives at most `l` ticks (checked above).
        let m = plan
            .iteration
            .iter()
            .map(|r| (r.end - r.start).div_ceil(l))
            .max()
            .unwrap_or(1);
        2 * m as u128 + 2
    };
    let total = (plan.prologue.len() as u128)
        .saturating_add(iterations.saturating_mul(plan.iteration.len() as u128));
    if total > MAX_UNROLLED {
        return Err(PlanViolations(vec![PlanViolation::TooLarge(total)]));
    }
    // Now `iterations <= total <= MAX_UNROLLED`. Every tick of the unrolled timeline
    // (at most `p + iterations·l + end` for an iteration request; finite prologue ends
    // are stored ticks) must fit the u64 clock.
    let iterations = iterations as u64;
    let last_tick = plan
        .iteration
        .iter()
        .map(|r| r.end as u128)
        .max()
        .map_or(0, |end| p as u128 + iterations as u128 * l as u128 + end);
    if last_tick > u64::MAX as u128 {
        return Err(PlanViolations(vec![PlanViolation::ClockOverflow {
            prologue_len: p,
            iteration_len: l,
            iterations,
        }]));
    }

    // Timeline entries: (tick, is_alloc, request). Frees sort before allocs at a tick.
    struct Live {
        at: RequestRef,
        r: PlannedRequest,
    }
    let mut entries: Vec<(u64, bool, u32)> = Vec::with_capacity(2 * total as usize);
    let mut live_tab: Vec<Live> = Vec::with_capacity(total as usize);
    for (i, r) in plan.prologue.iter().enumerate() {
        let id = live_tab.len() as u32;
        live_tab.push(Live {
            at: RequestRef::Prologue(i),
            r: *r,
        });
        entries.push((r.start, true, id));
        if r.end != NEVER_FREED {
            entries.push((r.end, false, id));
        }
    }
    for k in 0..iterations {
        let base = p + k * l;
        for (i, r) in plan.iteration.iter().enumerate() {
            let id = live_tab.len() as u32;
            live_tab.push(Live {
                at: RequestRef::Iteration { index: i, k },
                r: *r,
            });
            entries.push((base + r.start, true, id));
            entries.push((base + r.end, false, id));
        }
    }
    entries.sort_unstable();

    // offset -> id of the live request starting there.
    let mut live: BTreeMap<u64, u32> = BTreeMap::new();
    let mut live_bytes = 0u64;
    let mut peak_live = 0u64;
    for &(tick, is_alloc, id) in &entries {
        let me = &live_tab[id as usize];
        let lo = me.r.offset.get();
        let hi = lo + me.r.size.get();
        if !is_alloc {
            if live.get(&lo) == Some(&id) {
                live.remove(&lo);
                live_bytes -= me.r.size.get();
            }
            continue;
        }
        let mut clash = None;
        if let Some((_, &other)) = live.range(..=lo).next_back() {
            let o = &live_tab[other as usize].r;
            if o.offset.get() + o.size.get() > lo {
                clash = Some(other);
            }
        }
        if clash.is_none()
            && let Some((&start, &other)) = live.range(lo..).next()
            && start < hi
        {
            clash = Some(other);
        }
        if let Some(other) = clash {
            let o = &live_tab[other as usize];
            errs.push(PlanViolation::Overlap {
                a: o.at,
                a_offset: o.r.offset,
                a_size: o.r.size,
                b: me.at,
                b_offset: me.r.offset,
                b_size: me.r.size,
                tick,
            });
            if errs.len() >= MAX_REPORTED {
                break;
            }
            // Leave the clashing request out so later findings stay independent.
            continue;
        }
        live.insert(lo, id);
        live_bytes += me.r.size.get();
        peak_live = peak_live.max(live_bytes);
    }
    if !errs.is_empty() {
        return Err(PlanViolations(errs));
    }
    Ok(VerifyReport {
        used: Bytes(used),
        peak_live: Bytes(peak_live),
        iterations_unrolled: iterations,
    })
}

/// Check 5 of the module docs.
fn check_offload(plan: &Plan, errs: &mut Vec<PlanViolation>) {
    if let Some(budget) = plan.budget
        && plan.pool_size > budget
    {
        errs.push(PlanViolation::OverBudget {
            pool: plan.pool_size,
            budget,
        });
    }
    if plan.offload.is_empty() {
        return;
    }
    if plan.budget.is_none() {
        errs.push(PlanViolation::OffloadWithoutBudget(plan.offload.len()));
    }
    let n = plan.iteration.len();
    let mut request_used = vec![false; n];
    let mut pack_used = std::collections::HashSet::new();
    let mut unpack_used = std::collections::HashSet::new();
    for (entry, o) in plan.offload.iter().enumerate() {
        let mut bad = |problem: String| errs.push(PlanViolation::BadOffload { entry, problem });
        let (out, back) = (o.out_request as usize, o.back_request as usize);
        if out >= n || back >= n || out == back {
            bad(format!(
                "out request #{out} and back request #{back} must be two different requests of the {n} of the iteration"
            ));
            continue;
        }
        for r in [out, back] {
            if std::mem::replace(&mut request_used[r], true) {
                bad(format!("iteration request #{r} is used by another entry"));
            }
        }
        let (ro, rb) = (&plan.iteration[out], &plan.iteration[back]);
        if ro.size != o.bytes || rb.size != o.bytes {
            bad(format!(
                "{} moved, but the out request has {} and the back request {}",
                o.bytes, ro.size, rb.size
            ));
        }
        if ro.stream != rb.stream {
            bad(format!(
                "the out request is on {} and the back request on {}",
                ro.stream, rb.stream
            ));
        }
        if rb.start <= ro.start || rb.end <= ro.end {
            bad(format!(
                "the back request [{}, {}) must start after the out request [{}, {}) starts and end after it ends",
                rb.start, rb.end, ro.start, ro.end
            ));
        }
        if ro.end > plan.iteration_len {
            bad(format!(
                "the out request ends at tick {}, past its iteration ({} ticks)",
                ro.end, plan.iteration_len
            ));
        }
        if o.pack >= plan.saved_packs {
            bad(format!(
                "pack ordinal {} but {} packs per iteration",
                o.pack, plan.saved_packs
            ));
        } else if !pack_used.insert(o.pack) {
            bad(format!("pack ordinal {} is used by another entry", o.pack));
        }
        if o.unpack >= plan.saved_unpacks {
            bad(format!(
                "unpack ordinal {} but {} unpacks per iteration",
                o.unpack, plan.saved_unpacks
            ));
        } else if !unpack_used.insert(o.unpack) {
            bad(format!(
                "unpack ordinal {} is used by another entry",
                o.unpack
            ));
        }
        if let Some(t) = o.prefetch_after_unpack
            && t >= o.unpack
        {
            bad(format!(
                "the copy back is triggered by unpack {t}, not before the tensor's own unpack {}",
                o.unpack
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::{DeviceId, StreamId};

    use crate::testkit::planned as req;

    fn plan(prologue: Vec<PlannedRequest>, p: u64, iteration: Vec<PlannedRequest>, l: u64) -> Plan {
        Plan {
            device: DeviceId(0),
            alignment: Bytes(512),
            pool_size: Bytes(1 << 20),
            lower_bound: Bytes(0),
            trace_digest: 0,
            prologue,
            prologue_len: p,
            iteration,
            iteration_len: l,
            dynamic: Default::default(),
            ..Plan::default()
        }
    }

    /// An activation (request 0) offloaded at its pack and copied back as request 2.
    fn offload_plan() -> Plan {
        let mut p = plan(
            vec![],
            0,
            vec![req(512, 0, 0, 2), req(512, 0, 2, 4), req(512, 512, 3, 5)],
            6,
        );
        p.pool_size = Bytes(1024);
        p.budget = Some(Bytes(1024));
        p.saved_packs = 1;
        p.saved_unpacks = 2;
        p.offload = vec![crate::plan::OffloadEntry {
            pack: 0,
            unpack: 1,
            prefetch_after_unpack: Some(0),
            bytes: Bytes(512),
            out_request: 0,
            back_request: 2,
        }];
        p
    }

    fn offload_problems(p: &Plan) -> Vec<String> {
        match verify_plan(p) {
            Ok(_) => vec![],
            Err(v) => v.0.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn checks_budget_and_offload_entries() {
        assert_eq!(offload_problems(&offload_plan()), Vec::<String>::new());
        let mut p = offload_plan();
        p.budget = Some(Bytes(512));
        assert!(offload_problems(&p)[0].contains("larger than the plan's budget"));
        let mut p = offload_plan();
        p.budget = None;
        assert!(offload_problems(&p)[0].contains("no budget"));
        type Edit = fn(&mut Plan);
        let cases: Vec<(Edit, &str)> = vec![
            (|p| p.offload[0].back_request = 7, "two different requests"),
            (|p| p.offload[0].back_request = 0, "two different requests"),
            (|p| p.offload[0].bytes = Bytes(511), "moved, but"),
            (|p| p.iteration[2].stream = StreamId(9), "on s0"),
            (|p| p.iteration[2].start = 0, "must start after"),
            (|p| p.iteration[0].end = 7, "past its iteration"),
            (|p| p.offload[0].pack = 1, "pack ordinal 1 but 1"),
            (|p| p.offload[0].unpack = 2, "unpack ordinal 2 but 2"),
            (
                |p| p.offload[0].prefetch_after_unpack = Some(1),
                "not before the tensor's own unpack",
            ),
            (
                |p| {
                    let e = p.offload[0];
                    p.offload.push(e);
                },
                "used by another entry",
            ),
        ];
        for (edit, want) in cases {
            let mut p = offload_plan();
            edit(&mut p);
            let problems = offload_problems(&p);
            assert!(
                problems.iter().any(|m| m.contains(want)),
                "{want:?} not in {problems:?}"
            );
        }
    }

    #[test]
    fn accepts_a_valid_plan_with_reuse_and_a_crossing_request() {
        // A persistent weight at 0, two activations that reuse one slot in turn, and a
        // gradient buffer that crosses into the next iteration (freed at tick 2 there).
        let p = plan(
            vec![req(1024, 0, 0, NEVER_FREED)],
            2,
            vec![
                req(512, 1024, 0, 2),
                req(512, 1024, 2, 4),
                req(512, 1536, 3, 6),
            ],
            4,
        );
        let report = verify_plan(&p).expect("valid");
        assert_eq!(report.used, Bytes(2048));
        assert_eq!(report.peak_live, Bytes(2048));
    }

    #[test]
    fn checks_each_iteration_class_and_forbids_crossing_a_boundary() {
        use crate::plan::ClassSection;
        // A weight at 0; class 0 uses [1024, 2048), class 1 [1024, 3072): classes never
        // overlap in time, so they share the pool.
        let mut p = plan(
            vec![req(1024, 0, 0, NEVER_FREED)],
            1,
            vec![req(512, 1024, 0, 2), req(512, 1536, 1, 4)],
            4,
        );
        p.extra_classes = vec![ClassSection {
            requests: vec![req(2048, 1024, 0, 3), req(512, 1024, 3, 6)],
            len: 6,
        }];
        let report = verify_plan(&p).expect("valid");
        assert_eq!(report.used, Bytes(3072));
        assert_eq!(report.peak_live, Bytes(3072));
        // A class-1 request over the weight: found in class 1.
        let mut bad = p.clone();
        bad.extra_classes[0].requests[1].offset = Offset(512);
        let e = verify_plan(&bad).unwrap_err();
        assert!(
            e.0.iter().any(|v| matches!(
                v,
                PlanViolation::InClass { class: 1, violation }
                    if matches!(**violation, PlanViolation::Misaligned { .. } | PlanViolation::Overlap { .. })
            )),
            "{e}"
        );
        // Crossing a boundary (fine with one class) is refused with several, in any
        // class.
        let mut bad = p.clone();
        bad.iteration[1].end = 5;
        let e = verify_plan(&bad).unwrap_err();
        assert!(
            matches!(
                e.0[..],
                [PlanViolation::CrossesClassBoundary {
                    class: 0,
                    index: 1,
                    end: 5,
                    len: 4
                }]
            ),
            "{e}"
        );
        bad.extra_classes.clear();
        verify_plan(&bad).expect("one class may cross");
        let mut bad = p.clone();
        bad.extra_classes[0].requests[0].end = 7;
        assert!(matches!(
            verify_plan(&bad).unwrap_err().0[..],
            [PlanViolation::CrossesClassBoundary { class: 1, .. }]
        ));
        // Classes without a class 0, or with an offload schedule.
        let mut bad = p.clone();
        bad.iteration.clear();
        assert!(verify_plan(&bad).is_err());
    }

    #[test]
    fn finds_overlap_across_the_iteration_boundary() {
        // The crossing request is still live when the next iteration's first request
        // reuses its offset.
        let ok = plan(vec![], 0, vec![req(512, 0, 0, 2), req(512, 512, 2, 5)], 4);
        assert!(verify_plan(&ok).is_ok());
        let p = plan(vec![], 0, vec![req(512, 0, 0, 2), req(512, 0, 2, 5)], 4);
        let errs = verify_plan(&p).unwrap_err().0;
        assert!(
            matches!(errs[0], PlanViolation::Overlap { tick: 4, .. }),
            "{errs:?}"
        );
    }

    #[test]
    fn finds_misalignment_bounds_and_lifetime_errors() {
        let mut p = plan(
            vec![
                req(512, 100, 0, 1),
                req(512, (1 << 20) - 256, 0, 1),
                req(1, 0, 3, 3),
            ],
            2,
            vec![req(512, 0, 0, NEVER_FREED)],
            1,
        );
        let errs = verify_plan(&p).unwrap_err().0;
        assert!(
            errs.iter()
                .any(|e| matches!(e, PlanViolation::Misaligned { .. }))
        );
        assert!(
            errs.iter()
                .any(|e| matches!(e, PlanViolation::OutOfBounds { .. }))
        );
        assert!(
            errs.iter()
                .any(|e| matches!(e, PlanViolation::BadLifetime { .. }))
        );
        assert!(
            errs.iter()
                .any(|e| matches!(e, PlanViolation::IterationNeverFreed { .. }))
        );
        p.alignment = Bytes(3);
        assert_eq!(
            verify_plan(&p).unwrap_err().0,
            vec![PlanViolation::BadAlignment(Bytes(3))]
        );
    }

    #[test]
    fn corrupt_clock_values_are_violations_not_panics() {
        // Near-2^64 clock lengths and lifetimes, as a corrupted plan file can hold.
        let p = plan(vec![], u64::MAX - 8, vec![req(512, 0, 0, 2)], 4);
        assert!(matches!(
            verify_plan(&p).unwrap_err().0[0],
            PlanViolation::ClockOverflow { .. }
        ));
        let p = plan(vec![], 0, vec![req(512, 0, 0, u64::MAX - 1)], 1);
        assert!(matches!(
            verify_plan(&p).unwrap_err().0[0],
            PlanViolation::OutlivesIteration { .. }
        ));
    }

    #[test]
    fn a_long_lived_prologue_request_costs_no_extra_iterations() {
        // Freed 2^40 ticks into the steady state: checked against iteration 0 only.
        let p = plan(
            vec![req(512, 0, 0, 1 << 40)],
            1,
            vec![req(512, 512, 0, 1)],
            1,
        );
        assert_eq!(verify_plan(&p).expect("valid").iterations_unrolled, 4);
        let clash = plan(vec![req(512, 0, 0, 1 << 40)], 1, vec![req(512, 0, 0, 1)], 1);
        assert!(matches!(
            verify_plan(&clash).unwrap_err().0[0],
            PlanViolation::Overlap { .. }
        ));
    }

    #[test]
    fn persistent_prologue_request_meets_every_iteration() {
        let p = plan(
            vec![req(512, 0, 0, NEVER_FREED)],
            1,
            vec![req(512, 0, 0, 1)],
            1,
        );
        let errs = verify_plan(&p).unwrap_err().0;
        assert!(matches!(errs[0], PlanViolation::Overlap { .. }));
    }
}
