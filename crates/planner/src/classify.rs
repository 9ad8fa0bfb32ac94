//! Classification: which allocations of a trace a plan can serve, and in which section.
//!
//! Every allocation gets one [`AllocClass`]:
//!
//! - **persistent** — made before the steady state (or preexisting) and still live when
//!   it begins: never freed (parameters, optimizer state) or freed later (the first
//!   iteration's gradients, freed by the next `zero_grad`). Planned in the prologue
//!   section; a request freed in the steady state ends past the prologue
//!   (`end > prologue_len`), one never freed ends at [`stweaver_core::NEVER_FREED`].
//! - **prologue** — made and freed before the steady state (setup temporaries, the
//!   first iteration's activations). Planned in the prologue section.
//! - **per-iteration** — made in a steady iteration and identical in every one: same
//!   position in the request sequence, size, stream and lifetime (which may cross into
//!   the next iteration). All copies share one request of the iteration section.
//! - **dynamic** — not repeating, so not planned ([`DynamicReason`] says why); the
//!   engine serves these online.
//!
//! # The plan clock
//!
//! Time is counted in *requests*: alloc and free events, markers excluded
//! ([`plan_clock`]). An allocation lives over `[tick(alloc), tick(free))`, the free
//! being `FreeCompleted` when the trace has it, else `FreeRequested` (as
//! [`Trace::lifetimes`]). Dynamic requests count too: the clock is the run's, whatever
//! the plan covers.
//!
//! # With a steady state
//!
//! [`crate::iteration::detect_period`] gives it (from `IterationBegin`/`IterationEnd`
//! markers when the trace has them, else from the periodicity of the request sequence,
//! aligned to the end of an `Optimizer.step` annotation): the prologue is the first `P`
//! ticks, steady iteration `k` the ticks `[P + k·L, P + (k+1)·L)` for `k < repetitions`,
//! and what follows is an incomplete *tail*. (When the steady state starts at the very
//! first request of a trace with preexisting allocations, its first iteration becomes
//! the prologue instead, so that those allocations have a section to start in.) The first steady iteration is the
//! representative: each of its allocations is a *slot*, keyed by its tick relative to
//! the iteration start, with its relative lifetime `[s, e)`. A slot is dynamic for all
//! its copies when the representative is never freed (a tensor allocated every
//! iteration and never freed piles up: [`DynamicReason::NeverFreedInSteadyState`]),
//! lives longer than one iteration (`e - s > L`: two copies would be live at once at
//! one offset: [`DynamicReason::OutlivesIteration`]), or when a copy in a complete
//! iteration differs from it. Every allocation of iteration `k` (or of the tail) at
//! relative tick `s` is then compared with slot `s`: same size and stream, and either
//! freed at relative tick `e`, or not freed before the trace ends while the slot's
//! lifetime would reach past it. Equal: per-iteration; different:
//! [`DynamicReason::Irregular`] (a mismatch in the tail only affects that copy).
//! The detector guarantees that complete iterations match, so in practice only the
//! tail of a marker-cut trace can be irregular. When the last complete iteration has a
//! copy never freed where its slot is freed (the script keeps the last loss alive after
//! training), that iteration joins the tail, so that the copy alone is dynamic.
//!
//! # Without a steady state (MoE: token-dependent sizes)
//!
//! The whole trace is the prologue (`prologue_len` = all ticks, no iteration section).
//! Allocations live at the end of the trace (never freed) or preexisting are
//! persistent. The others are planned (class prologue) when they *recur*, dynamic
//! otherwise. Recurrence is judged position by position across iteration *windows*,
//! cut by `IterationBegin` markers, else `IterationEnd` markers, else the ends of
//! `Optimizer.step` annotations: the allocation sequences of each pair of adjacent
//! windows, as (size, stream) tokens, are aligned by a longest common subsequence
//! ([`lcs`]), and an allocation recurs when the alignment matches it with one of the
//! same size and stream at the same place of a neighbouring window. Token-dependent
//! sizes (expert activations) find no counterpart and are dynamic
//! ([`DynamicReason::NoCounterpart`]); the model's own tensors align. With fewer than
//! two windows there is nothing to align: an allocation whose (size, stream) occurs
//! only once in the trace is dynamic ([`DynamicReason::UniqueSize`]), the others are
//! planned.
//!
//! # Cost
//!
//! O(events + allocations) plus the period detector (O(events)) with a steady state;
//! without one, O(Σ (n_w + n_{w+1})·D_w) for the window alignments, `D_w` being the
//! number of unaligned allocations of two neighbouring windows (about 0.5 s per pair
//! of 27 k-allocation windows on `snap_qwenmoe_eager_rcp`).

mod lcs;

use rustc_hash::FxHashMap;
use stweaver_core::{AllocId, EventKind, MarkerKind, Trace};

use crate::iteration::{DetectOptions, Period, detect_period_with};

pub use lcs::lcs;

/// What the plan does with one allocation (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocClass {
    /// Made before the steady state and live when it begins (or never freed).
    Persistent,
    /// Made and freed before the steady state (or, without one, a recurring allocation).
    Prologue,
    /// A copy of iteration slot `slot` (index into [`Classification::slots`], which is
    /// also the index of its request in the plan's iteration section) made in steady
    /// iteration `iteration` (`== repetitions` for the incomplete tail).
    PerIteration { iteration: u32, slot: u32 },
    /// Not planned.
    Dynamic(DynamicReason),
}

impl AllocClass {
    /// True for the classes a plan has a request for.
    pub fn is_planned(self) -> bool {
        !matches!(self, AllocClass::Dynamic(_))
    }
}

/// Why an allocation is left to dynamic serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DynamicReason {
    /// No steady state: no allocation of the same size and stream at the aligned place of
    /// a neighbouring iteration window.
    NoCounterpart,
    /// No steady state and no iteration windows: its size and stream occur only once.
    UniqueSize,
    /// Made in every steady iteration and never freed: it would pile up.
    NeverFreedInSteadyState,
    /// Live for more than one iteration: consecutive copies overlap, one offset cannot
    /// serve them all.
    OutlivesIteration,
    /// Differs (size, stream or lifetime) from its counterpart in the representative
    /// iteration.
    Irregular,
    /// Has the size and stream of an unplanned request of the iteration. The engine
    /// matches a request to the plan by size and stream: the unplanned one (say the
    /// loss scalar the loop keeps into the next iteration) would take this slot's
    /// planned entry and hold its range past the slot's planned free, into ranges planned
    /// for later requests (measured on an H100 Llama trace: the 1.95 GiB logits found
    /// their range busy every other iteration, +5.6 % reserved). Left unplanned too.
    SharesSizeWithUnplanned,
}

impl DynamicReason {
    pub const ALL: [DynamicReason; 6] = [
        DynamicReason::NoCounterpart,
        DynamicReason::UniqueSize,
        DynamicReason::NeverFreedInSteadyState,
        DynamicReason::OutlivesIteration,
        DynamicReason::Irregular,
        DynamicReason::SharesSizeWithUnplanned,
    ];

    /// Stable identifier (JSON, tables).
    pub fn id(self) -> &'static str {
        match self {
            DynamicReason::NoCounterpart => "no_counterpart",
            DynamicReason::UniqueSize => "unique_size",
            DynamicReason::NeverFreedInSteadyState => "never_freed_in_steady_state",
            DynamicReason::OutlivesIteration => "outlives_iteration",
            DynamicReason::Irregular => "irregular",
            DynamicReason::SharesSizeWithUnplanned => "shares_size_with_unplanned",
        }
    }
}

/// One request of the iteration section: the representative allocation (made in the
/// first steady iteration) and its lifetime on the iteration's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IterationSlot {
    pub alloc: AllocId,
    /// Alloc tick relative to the start of the iteration (`< iteration_len`).
    pub start: u64,
    /// Free tick relative to the start of the iteration (`start < end <= start + L`;
    /// `end > L` crosses into the next iteration).
    pub end: u64,
}

/// How many allocations fell in each class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassCounts {
    pub persistent: usize,
    pub prologue: usize,
    pub per_iteration: usize,
    pub dynamic: usize,
    /// `dynamic`, by [`DynamicReason`] (in [`DynamicReason::ALL`] order).
    pub dynamic_by_reason: [usize; DynamicReason::ALL.len()],
}

impl ClassCounts {
    pub fn planned(&self) -> usize {
        self.persistent + self.prologue + self.per_iteration
    }

    pub fn dynamic_for(&self, reason: DynamicReason) -> usize {
        self.dynamic_by_reason[reason_index(reason)]
    }
}

/// How near (plan-clock ticks, an allocation or a free each) an unplanned request must be
/// to a slot of its size and stream to take the slot's planned entry: the engine's match
/// window (`PlanOptions::window`, 64 expected requests) with room for their frees.
const LENDING_TICKS: u64 = 256;

fn reason_index(r: DynamicReason) -> usize {
    DynamicReason::ALL
        .iter()
        .position(|&x| x == r)
        .expect("every reason is in ALL")
}

/// Where the prologue / steady split came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Steady {
    /// A steady state, as detected.
    Periodic(Period),
    /// None: the whole trace is the prologue. `windows` iteration windows were aligned
    /// to find recurring allocations (0 or 1: the size-count rule was used instead).
    Aperiodic { windows: usize },
}

/// The classification of a trace (module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classification {
    /// One class per allocation, indexed by [`AllocId`].
    pub classes: Vec<AllocClass>,
    /// The iteration section's requests, in order (empty without a steady state).
    pub slots: Vec<IterationSlot>,
    /// Ticks before the steady state: the prologue's length on the plan clock (all the
    /// trace's ticks without a steady state).
    pub prologue_len: u64,
    /// Ticks per steady iteration (0 without a steady state).
    pub iteration_len: u64,
    /// Whole steady iterations in the trace (0 without a steady state).
    pub repetitions: u64,
    /// Ticks in the whole trace (its alloc and free events).
    pub total_ticks: u64,
    pub steady: Steady,
    pub counts: ClassCounts,
}

/// Options of [`classify_with`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ClassifyOptions {
    /// Period detection thresholds.
    pub detect: DetectOptions,
}

/// The plan-clock tick of every event (the number of alloc and free events before it;
/// a marker or saved-tensor event gets the tick of the request that follows it), and the total number of
/// ticks. O(events).
pub fn plan_clock(trace: &Trace) -> (Vec<u64>, u64) {
    let mut ticks = Vec::with_capacity(trace.events.len());
    let mut t = 0u64;
    for e in &trace.events {
        ticks.push(t);
        if e.kind.is_request() {
            t += 1;
        }
    }
    (ticks, t)
}

/// Lifetimes on the plan clock, indexed by [`AllocId`]: `(start, end)` with `start = 0`
/// for a preexisting allocation and `end = None` when it is never freed. Assumes a
/// valid trace. O(events).
pub fn tick_lifetimes(trace: &Trace, ticks: &[u64]) -> Vec<(u64, Option<u64>)> {
    trace
        .lifetimes()
        .iter()
        .map(|l| {
            (
                l.start.map_or(0, |e| ticks[e.index()]),
                l.end.map(|e| ticks[e.index()]),
            )
        })
        .collect()
}

/// [`classify_with`] with default options.
pub fn classify(trace: &Trace) -> Classification {
    classify_with(trace, &ClassifyOptions::default())
}

/// Classifies every allocation of `trace` (module docs). Expects a trace that passed
/// [`Trace::validate`].
pub fn classify_with(trace: &Trace, opts: &ClassifyOptions) -> Classification {
    let (ticks, total) = plan_clock(trace);
    let life = tick_lifetimes(trace, &ticks);
    let mut c = detect_period_with(trace, &opts.detect)
        .and_then(|period| periodic(trace, &ticks, total, &life, period))
        .unwrap_or_else(|| aperiodic(trace, total, &life));
    c.counts = count(&c.classes);
    c
}

fn count(classes: &[AllocClass]) -> ClassCounts {
    let mut n = ClassCounts::default();
    for c in classes {
        match *c {
            AllocClass::Persistent => n.persistent += 1,
            AllocClass::Prologue => n.prologue += 1,
            AllocClass::PerIteration { .. } => n.per_iteration += 1,
            AllocClass::Dynamic(r) => {
                n.dynamic += 1;
                n.dynamic_by_reason[reason_index(r)] += 1;
            }
        }
    }
    n
}

fn periodic(
    trace: &Trace,
    ticks: &[u64],
    total: u64,
    life: &[(u64, Option<u64>)],
    period: Period,
) -> Option<Classification> {
    let mut p = ticks
        .get(period.first_steady_event.index())
        .copied()
        .unwrap_or(total);
    let l = period.requests_per_iteration as u64;
    let mut reps = period.repetitions as u64;
    if p == 0 && trace.allocations.iter().any(|a| a.preexisting) {
        // Preexisting allocations need a prologue to live in (a request starts inside
        // its section): the first steady iteration becomes the prologue.
        if reps < 2 {
            return None;
        }
        p = l;
        reps -= 1;
    }
    let n = trace.allocations.len();
    let mut classes = vec![AllocClass::Dynamic(DynamicReason::Irregular); n];

    // Prologue-side allocations, and the steady ones by (iteration, relative start).
    let mut steady: Vec<(u64, u64, usize)> = Vec::new();
    for (i, (a, &(start, end))) in trace.allocations.iter().zip(life).enumerate() {
        if a.preexisting || start < p {
            classes[i] = match end {
                Some(e) if e <= p => AllocClass::Prologue,
                _ => AllocClass::Persistent,
            };
        } else {
            let rel = start - p;
            steady.push((rel / l, rel % l, i));
        }
    }
    steady.sort_unstable();

    // Candidate slots: the allocations of the first steady iteration.
    struct Cand {
        alloc: usize,
        start: u64,
        end: Option<u64>,
        bad: Option<DynamicReason>,
    }
    let mut cands: Vec<Cand> = Vec::new();
    let mut by_start: FxHashMap<u64, usize> = FxHashMap::default();
    for &(k, rel, i) in &steady {
        if k > 0 {
            break;
        }
        let end = life[i].1.map(|e| e - p);
        let bad = match end {
            None => Some(DynamicReason::NeverFreedInSteadyState),
            Some(e) if e - rel > l => Some(DynamicReason::OutlivesIteration),
            Some(_) => None,
        };
        by_start.insert(rel, cands.len());
        cands.push(Cand {
            alloc: i,
            start: rel,
            end,
            bad,
        });
    }

    // Does the allocation `i` of iteration `k` match candidate `c`?
    let matches = |k: u64, rel: u64, i: usize, c: &Cand| -> bool {
        let (a, r) = (&trace.allocations[i], &trace.allocations[c.alloc]);
        if a.size != r.size || a.stream != r.stream || rel != c.start {
            return false;
        }
        let base = p + k * l;
        match (life[i].1, c.end) {
            (Some(e), Some(ce)) => e - base == ce,
            // Not freed before the trace ends: fine if the slot's lifetime reaches past it.
            (None, Some(ce)) => base + ce >= total,
            (_, None) => life[i].1.is_none(),
        }
    };
    // The last complete iteration is often followed by other work (evaluation, saving,
    // the end of the script) that keeps some of its per-iteration tensors alive (the last
    // loss): a copy never freed where its slot is freed says nothing about the steady
    // state. Then that iteration counts as the tail, where a mismatch only affects the
    // copy, instead of making its slot irregular in every iteration.
    if reps >= 3 {
        let last = reps - 1;
        let kept_alive = steady.iter().any(|&(k, rel, i)| {
            k == last
                && life[i].1.is_none()
                && by_start
                    .get(&rel)
                    .is_some_and(|&c| cands[c].end.is_some() && cands[c].bad.is_none())
        });
        if kept_alive {
            reps = last;
        }
    }
    // A slot whose copy in a complete iteration differs is irregular everywhere.
    for &(k, rel, i) in &steady {
        if k == 0 || k >= reps {
            continue;
        }
        match by_start.get(&rel) {
            Some(&c) if matches(k, rel, i, &cands[c]) => {}
            Some(&c) => {
                let c = &mut cands[c];
                c.bad = c.bad.or(Some(DynamicReason::Irregular));
            }
            None => {} // an allocation with no slot: itself irregular (below)
        }
    }
    // A good slot of the size and stream of a bad one would lend its planned entry to the
    // bad one's requests (the engine matches by size and stream): unplanned too.
    // Only near one (the engine looks `PlanOptions::window` expected requests ahead):
    // a slot far from every unplanned request of its size cannot lend it its entry.
    let mut unplanned: FxHashMap<(u64, u64), Vec<u64>> = FxHashMap::default();
    for c in cands.iter().filter(|c| c.bad.is_some()) {
        let a = &trace.allocations[c.alloc];
        unplanned
            .entry((a.size.get(), a.stream.0))
            .or_default()
            .push(c.start);
    }
    for c in &mut cands {
        let a = &trace.allocations[c.alloc];
        if c.bad.is_none()
            && unplanned
                .get(&(a.size.get(), a.stream.0))
                .is_some_and(|v| v.iter().any(|&s| s.abs_diff(c.start) <= LENDING_TICKS))
        {
            c.bad = Some(DynamicReason::SharesSizeWithUnplanned);
        }
    }
    // Number the good slots: their order is the iteration section's request order.
    let mut slot_of: Vec<Option<u32>> = Vec::with_capacity(cands.len());
    let mut slots = Vec::new();
    for c in &cands {
        if c.bad.is_none() {
            slot_of.push(Some(slots.len() as u32));
            slots.push(IterationSlot {
                alloc: AllocId(c.alloc as u32),
                start: c.start,
                end: c.end.expect("good slots are freed"),
            });
        } else {
            slot_of.push(None);
        }
    }
    for &(k, rel, i) in &steady {
        classes[i] = match by_start.get(&rel) {
            Some(&c) => match (cands[c].bad, slot_of[c]) {
                (Some(reason), _) => AllocClass::Dynamic(reason),
                (None, Some(slot)) if matches(k, rel, i, &cands[c]) => AllocClass::PerIteration {
                    iteration: k as u32,
                    slot,
                },
                _ => AllocClass::Dynamic(DynamicReason::Irregular),
            },
            None => AllocClass::Dynamic(DynamicReason::Irregular),
        };
    }
    Some(Classification {
        classes,
        slots,
        prologue_len: p,
        iteration_len: l,
        repetitions: reps,
        total_ticks: total,
        steady: Steady::Periodic(period),
        counts: ClassCounts::default(),
    })
}

/// Event indices where iteration windows begin (module docs), ascending, deduplicated.
fn window_cuts(trace: &Trace) -> Vec<usize> {
    let begin = trace.marker_events(|k, _| k == MarkerKind::IterationBegin);
    if !begin.is_empty() {
        return begin;
    }
    let end = trace.marker_events(|k, _| k == MarkerKind::IterationEnd);
    if !end.is_empty() {
        return end;
    }
    trace.marker_events(|k, l| {
        k == MarkerKind::PhaseEnd && l.is_some_and(|l| l.starts_with("Optimizer.step"))
    })
}

fn aperiodic(trace: &Trace, total: u64, life: &[(u64, Option<u64>)]) -> Classification {
    let n = trace.allocations.len();
    // Token (size, stream) of every allocation, interned.
    let mut intern: FxHashMap<(u64, u64), u32> = FxHashMap::default();
    let token: Vec<u32> = trace
        .allocations
        .iter()
        .map(|a| {
            let next = intern.len() as u32;
            *intern.entry((a.size.get(), a.stream.0)).or_insert(next)
        })
        .collect();

    // Allocations in order, split into windows.
    let cuts = window_cuts(trace);
    let mut windows: Vec<Vec<usize>> = vec![Vec::new()];
    let mut next_cut = 0;
    for (i, e) in trace.events.iter().enumerate() {
        while next_cut < cuts.len() && cuts[next_cut] <= i {
            next_cut += 1;
            if !windows.last().is_some_and(Vec::is_empty) {
                windows.push(Vec::new());
            }
        }
        if let EventKind::Alloc(id) = e.kind {
            windows.last_mut().expect("one window").push(id.index());
        }
    }
    windows.retain(|w| !w.is_empty());

    let mut recurring = vec![false; n];
    let unmatched_reason;
    if windows.len() >= 2 {
        unmatched_reason = DynamicReason::NoCounterpart;
        for pair in windows.windows(2) {
            let ta: Vec<u32> = pair[0].iter().map(|&i| token[i]).collect();
            let tb: Vec<u32> = pair[1].iter().map(|&i| token[i]).collect();
            for (x, y) in lcs(&ta, &tb) {
                recurring[pair[0][x]] = true;
                recurring[pair[1][y]] = true;
            }
        }
    } else {
        unmatched_reason = DynamicReason::UniqueSize;
        let mut occurrences = vec![0u32; intern.len()];
        for &t in &token {
            occurrences[t as usize] += 1;
        }
        for (r, &t) in recurring.iter_mut().zip(&token) {
            *r = occurrences[t as usize] >= 2;
        }
    }
    let classes = trace
        .allocations
        .iter()
        .zip(life)
        .zip(&recurring)
        .map(|((a, &(_, end)), &rec)| {
            if a.preexisting || end.is_none() {
                AllocClass::Persistent
            } else if rec {
                AllocClass::Prologue
            } else {
                AllocClass::Dynamic(unmatched_reason)
            }
        })
        .collect();
    Classification {
        classes,
        slots: Vec::new(),
        prologue_len: total,
        iteration_len: 0,
        repetitions: 0,
        total_ticks: total,
        steady: Steady::Aperiodic {
            windows: if windows.len() >= 2 { windows.len() } else { 0 },
        },
        counts: ClassCounts::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stweaver_core::Bytes;
    use stweaver_core::testkit::TraceBuilder;

    type B = TraceBuilder;

    #[test]
    fn plan_clock_skips_markers() {
        let mut b = B::default();
        let a = b.alloc(8);
        b.marker(MarkerKind::PhaseBegin, "x");
        b.free(a);
        let t = b.done();
        let (ticks, total) = plan_clock(&t);
        assert_eq!(ticks, vec![0, 1, 1, 2]);
        assert_eq!(total, 3);
        assert_eq!(
            tick_lifetimes(&t, &ticks),
            vec![(0, Some(2))],
            "ends at the completed free"
        );
    }

    /// Parameters, a first iteration with a leftover freed in the steady state, steady
    /// iterations with a tensor crossing the boundary and one piling up.
    #[test]
    fn periodic_trace_classes() {
        let mut b = B::default();
        let params: Vec<AllocId> = [4096, 8192].iter().map(|&s| b.alloc(s)).collect();
        // First iteration: different sizes; `g0` lives into the first steady iteration.
        let x = b.alloc(300);
        let g0 = b.alloc(1000);
        b.free(x);
        let mut carry = g0;
        let mut crossing = Vec::new();
        let mut piles = Vec::new();
        let mut acts = Vec::new();
        for _ in 0..4 {
            let a1 = b.alloc(100);
            b.free(carry); // frees the previous iteration's gradient (or g0)
            let a2 = b.alloc(200);
            piles.push(b.alloc(64)); // never freed: piles up
            b.free(a2);
            b.free(a1);
            acts.push((a1, a2));
            carry = b.alloc(1000); // freed in the next iteration
            crossing.push(carry);
        }
        let t = b.done();
        let c = classify(&t);
        let Steady::Periodic(ref period) = c.steady else {
            panic!("periodic: {:?}", c.steady)
        };
        assert_eq!(period.allocs_per_iteration, 4);
        for p in &params {
            assert_eq!(c.classes[p.index()], AllocClass::Persistent);
        }
        assert_eq!(c.classes[x.index()], AllocClass::Prologue);
        assert_eq!(c.classes[g0.index()], AllocClass::Persistent, "live across");
        for id in &piles {
            assert_eq!(
                c.classes[id.index()],
                AllocClass::Dynamic(DynamicReason::NeverFreedInSteadyState)
            );
        }
        // The steady state starts at the first alloc of size 100 (index 0 of `acts`).
        for (k, &(a1, a2)) in acts.iter().enumerate() {
            let AllocClass::PerIteration { iteration, slot } = c.classes[a1.index()] else {
                panic!("a1 of iteration {k}: {:?}", c.classes[a1.index()])
            };
            assert_eq!((iteration, slot), (k as u32, 0));
            assert!(matches!(
                c.classes[a2.index()],
                AllocClass::PerIteration { slot: 1, .. }
            ));
        }
        // The crossing tensor: a slot whose end passes the iteration length.
        let cross = c.slots[2];
        assert_eq!(t.allocations[cross.alloc.index()].size, Bytes(1000));
        assert!(cross.end > c.iteration_len && cross.end - cross.start <= c.iteration_len);
        // The last copy is not freed before the trace ends: still per-iteration.
        assert!(matches!(
            c.classes[crossing[3].index()],
            AllocClass::PerIteration { .. }
        ));
        assert_eq!(c.slots.len(), 3);
        assert_eq!(c.counts.persistent, 3);
        assert_eq!(c.counts.prologue, 1);
        assert_eq!(c.counts.per_iteration, 12);
        assert_eq!(c.counts.dynamic, 4);
        assert_eq!(
            c.counts.dynamic_for(DynamicReason::NeverFreedInSteadyState),
            4
        );
        assert_eq!(c.counts.planned() + c.counts.dynamic, t.allocations.len());
    }

    #[test]
    fn a_tensor_living_longer_than_an_iteration_is_dynamic() {
        let mut b = B::default();
        // Each `long` is freed two iterations after it is made.
        let mut longs = vec![b.alloc(20), b.alloc(20)];
        let mut made = Vec::new();
        let mut short = Vec::new();
        for _ in 0..5 {
            let a = b.alloc(10);
            b.free(a);
            short.push(a);
            let l = b.alloc(20);
            longs.push(l);
            made.push(l);
            let old = longs.remove(0);
            b.free(old);
        }
        let t = b.done();
        let c = classify(&t);
        assert!(matches!(c.steady, Steady::Periodic(_)), "{:?}", c.steady);
        assert_eq!(c.repetitions, 5);
        for l in &made {
            assert_eq!(
                c.classes[l.index()],
                AllocClass::Dynamic(DynamicReason::OutlivesIteration)
            );
        }
        for a in &short {
            assert!(matches!(
                c.classes[a.index()],
                AllocClass::PerIteration { .. }
            ));
        }
        assert_eq!(
            c.counts.persistent, 2,
            "the two made before the steady state"
        );
        assert_eq!(c.slots.len(), 1);
    }

    #[test]
    fn irregular_tail_after_marked_iterations() {
        let mut b = B::default();
        for it in 0..4 {
            b.marker(MarkerKind::IterationBegin, "it");
            let a = b.alloc(if it == 0 { 99 } else { 1 });
            let c = b.alloc(2);
            b.free(c);
            b.free(a);
        }
        b.marker(MarkerKind::IterationBegin, "it");
        // The tail: the first slot matches, the second has another size.
        let a = b.alloc(1);
        let odd = b.alloc(7);
        b.free(odd);
        b.free(a);
        let t = b.done();
        let c = classify(&t);
        assert!(matches!(c.steady, Steady::Periodic(_)));
        assert_eq!(c.repetitions, 3);
        assert!(matches!(
            c.classes[a.index()],
            AllocClass::PerIteration { iteration: 3, .. }
        ));
        assert_eq!(
            c.classes[odd.index()],
            AllocClass::Dynamic(DynamicReason::Irregular)
        );
    }

    #[test]
    fn a_loss_kept_alive_after_the_last_iteration_stays_planned() {
        // Each iteration's loss lives into the next iteration (freed there, after the
        // activations); the script keeps the last one alive past the end.
        let mut b = B::default();
        let mut prev_loss = None;
        let mut losses = Vec::new();
        for _ in 0..6 {
            b.marker(MarkerKind::IterationBegin, "it");
            let act = b.alloc(4096);
            if let Some(l) = prev_loss.take() {
                b.free(l);
            }
            let loss = b.alloc(4);
            b.free(act);
            losses.push(loss);
            prev_loss = Some(loss);
        }
        b.marker(MarkerKind::IterationBegin, "it");
        let eval = b.alloc(1 << 20); // work after training
        b.free(eval);
        let t = b.done();
        let c = classify(&t);
        assert!(matches!(c.steady, Steady::Periodic(_)), "{:?}", c.steady);
        // The last complete iteration became the tail: only its loss is dynamic.
        let dynamic: Vec<_> = losses
            .iter()
            .filter(|l| matches!(c.classes[l.index()], AllocClass::Dynamic(_)))
            .collect();
        assert_eq!(dynamic, [losses.last().unwrap()], "{:?}", c.classes);
        assert!(c.slots.len() >= 2, "the loss keeps its slot");
    }

    #[test]
    fn aperiodic_windows_align_recurring_allocations() {
        let mut b = B::default();
        let w = b.alloc(1 << 20); // parameters: persistent
        for it in 0..4u64 {
            let x = b.alloc(512);
            // A token-dependent size between two fixed ones.
            let e = b.alloc(1000 + 37 * it);
            let y = b.alloc(2048);
            b.free(e);
            b.free(y);
            b.free(x);
            b.marker(MarkerKind::PhaseEnd, "Optimizer.step#AdamW.step");
        }
        let t = b.done();
        let c = classify(&t);
        assert_eq!(c.steady, Steady::Aperiodic { windows: 4 });
        assert_eq!(c.classes[w.index()], AllocClass::Persistent);
        assert_eq!(c.iteration_len, 0);
        assert_eq!(c.prologue_len, c.total_ticks);
        for (i, a) in t.allocations.iter().enumerate().skip(1) {
            let want = if a.size.get() == 512 || a.size.get() == 2048 {
                AllocClass::Prologue
            } else {
                AllocClass::Dynamic(DynamicReason::NoCounterpart)
            };
            assert_eq!(c.classes[i], want, "allocation {i} of {}", a.size);
        }
        assert_eq!(c.counts.dynamic, 4);
    }

    #[test]
    fn aperiodic_without_windows_uses_size_counts() {
        let mut b = B::default();
        for s in [5u64, 6, 5, 7, 7, 9] {
            let a = b.alloc(s);
            b.free(a);
        }
        let t = b.done();
        let c = classify(&t);
        assert_eq!(c.steady, Steady::Aperiodic { windows: 0 });
        let dynamic: Vec<u64> = t
            .allocations
            .iter()
            .zip(&c.classes)
            .filter(|(_, c)| !c.is_planned())
            .map(|(a, _)| a.size.get())
            .collect();
        assert_eq!(dynamic, vec![6, 9]);
        assert_eq!(c.counts.dynamic_for(DynamicReason::UniqueSize), 2);
    }
}
