//! Iteration detection: where a trace's steady state starts and how long one
//! iteration is, so that a trace can be cut into a prologue plus a repeated iteration.
//!
//! # The request sequence
//!
//! Markers and saved-tensor events (`SavedPack`, `SavedUnpack`) aside, every event
//! becomes a token:
//!
//! - `Alloc` → (size, stream);
//! - `FreeRequested` / `FreeCompleted` → the *age* of the block in allocs (allocs made
//!   since the one being freed), which captures the free structure independently of
//!   absolute positions; frees of preexisting blocks → (size, stream) of the block.
//!
//! Tokens are interned to dense `u32`s (one hash-map probe each). Two iterations are
//! "the same" when their token sequences are equal: same sizes on the same streams in
//! the same order, freed in the same pattern — with one allowance: a free of a tensor
//! allocated *before the steady state* may differ from its counterpart. The first
//! steady iteration frees leftovers of the prologue (activations of the first
//! iteration, which was longer because the optimizer created its state), and their
//! ages differ from those of the leftovers that later iterations free. Tensors
//! allocated in the steady state must still be identical, lifetimes included, in every
//! iteration. (On `snap_llama1b_rcp` this concerns 3 frees: without the allowance the
//! steady state would start 3 requests after the first `Optimizer.step` and hold 2
//! whole iterations instead of 3.)
//!
//! # Explicit iteration markers
//!
//! When the trace has `IterationBegin` markers (else `IterationEnd` markers) they are
//! the boundaries (each marker cuts before the first request that follows it). The
//! last complete iteration sets the period; the steady state is the run of evenly
//! spaced iterations before it that the sequence repeats back to (the backward scan
//! below). It counts if it has at least [`DetectOptions::min_repetitions`] iterations;
//! otherwise detection falls back to the sequence itself.
//!
//! # Periodicity of the sequence
//!
//! A training trace is `prologue · I^k · (prefix of I)`: the steady state is a
//! *periodic suffix*. Reversed, it is a periodic prefix, and the longest prefix of a
//! string `R` with period `p` has length `p + Z[p]`, where `Z` is the Z-function of `R`
//! (`Z[p]` = longest common prefix of `R` and `R[p..]`). One Z-function pass (O(n),
//! Gusfield) therefore gives, for every candidate period `p` at once, how far back from
//! the end the sequence is `p`-periodic. The detector picks the `p` whose periodic
//! suffix is longest (ties: the smallest `p`, which rules out multiples of the true
//! period: if the suffix is `p`-periodic over `L ≥ 2p` tokens, a multiple `kp` cannot
//! reach further back), and accepts it when the suffix holds at least
//! `min_repetitions` whole periods and covers at least `min_coverage` of the requests —
//! which rejects short accidental repeats (a run of equal sizes, the repeated layers of
//! one backward pass) and traces whose sizes change every iteration (MoE). A backward
//! scan from the start of that suffix then extends it over the prologue frees allowed
//! above (O(length scanned)).
//!
//! # Phase
//!
//! The periodic suffix may start anywhere inside an iteration (the tail of the first
//! optimizer step already matches the later ones). The start is moved forward, by less
//! than one period, to a boundary the run itself marks, if one repeats with the period:
//! an `IterationBegin`/`IterationEnd` marker, else the end of an `Optimizer.step` phase
//! (PyTorch's `Optimizer.step#…` annotation, which is where stweaver switches plans at
//! run time). Without such a marker the first steady iteration starts at its first
//! alloc (not among leftover frees).
//!
//! Cost: O(n) time and memory in the number of events, interning being expected O(1)
//! per token.

use rustc_hash::{FxHashMap, FxHashSet};
use stweaver_core::{EventIdx, EventKind, MarkerKind, Trace};

/// Where the period came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeriodSource {
    /// `IterationBegin` / `IterationEnd` markers in the trace.
    IterationMarkers,
    /// The periodicity of the request sequence.
    RequestSequence,
}

/// The steady state of a trace: `repetitions` identical iterations starting at
/// `first_steady_event`, preceded by a prologue (everything before) and possibly followed
/// by an incomplete iteration (everything after the last boundary).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Period {
    /// `Alloc` events per iteration.
    pub allocs_per_iteration: usize,
    /// Alloc and free events per iteration (markers not counted).
    pub requests_per_iteration: usize,
    /// All events per iteration, markers included, when every steady iteration has the
    /// same number (they do unless marker counts differ between iterations).
    pub events_per_iteration: Option<usize>,
    /// Number of `Alloc` events before the steady state (the prologue's allocs).
    pub first_steady_alloc: usize,
    /// Event index where the first steady iteration starts (its first alloc or free).
    pub first_steady_event: EventIdx,
    /// Whole steady iterations in the trace.
    pub repetitions: usize,
    /// Event index where each steady iteration starts, then where the last one ends:
    /// `repetitions + 1` entries. An iteration starts at its first alloc or free; markers
    /// just before it belong to the previous one. The last entry may equal the number
    /// of events.
    pub boundaries: Vec<EventIdx>,
    pub source: PeriodSource,
}

/// Acceptance thresholds of [`detect_period_with`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DetectOptions {
    /// Fewest whole identical iterations that make a steady state.
    pub min_repetitions: usize,
    /// Smallest fraction of the trace's requests the periodic suffix must cover
    /// (sequence detection only; explicit markers are trusted).
    pub min_coverage: f64,
}

impl Default for DetectOptions {
    fn default() -> Self {
        DetectOptions {
            min_repetitions: 2,
            min_coverage: 0.5,
        }
    }
}

/// Detects the iteration period with [`DetectOptions::default`].
pub fn detect_period(trace: &Trace) -> Option<Period> {
    detect_period_with(trace, &DetectOptions::default())
}

/// Detects the iteration period; `None` when the trace has no steady state (fewer than
/// `min_repetitions` identical iterations, or sizes that change every iteration).
/// Expects a trace that passed [`Trace::validate`]; for one that did not, returns `None`
/// rather than panic.
pub fn detect_period_with(trace: &Trace, opts: &DetectOptions) -> Option<Period> {
    let seq = RequestSequence::of(trace)?;
    let min_reps = opts.min_repetitions.max(1);
    from_iteration_markers(&seq, trace, min_reps).or_else(|| from_periodicity(&seq, trace, opts))
}

/// A marker and the request position it cuts before.
#[derive(Debug, Clone, Copy)]
struct MarkerAt {
    kind: MarkerKind,
    label: Option<u32>,
    /// Number of requests before the marker.
    pos: usize,
}

/// The tokenised requests of a trace.
struct RequestSequence {
    tokens: Vec<u32>,
    /// Event index of each request.
    event: Vec<u32>,
    /// Allocs before each request (`allocs_before[tokens.len()]` = all allocs).
    allocs_before: Vec<u32>,
    /// Per request: [`ALLOC`], [`FREE_REQUESTED`] or [`FREE_COMPLETED`].
    kind: Vec<u8>,
    /// Per request: the request position of the allocation's `Alloc` ([`BEFORE_TRACE`]
    /// for a preexisting one).
    origin: Vec<u32>,
    markers: Vec<MarkerAt>,
}

const ALLOC: u8 = 0;
const FREE_REQUESTED: u8 = 1;
const FREE_COMPLETED: u8 = 2;
/// `origin` of a preexisting allocation.
const BEFORE_TRACE: u32 = u32::MAX;

impl RequestSequence {
    fn of(trace: &Trace) -> Option<RequestSequence> {
        let n_events = trace.events.len();
        let mut tokens = Vec::with_capacity(n_events);
        let mut event = Vec::with_capacity(n_events);
        let mut allocs_before = Vec::with_capacity(n_events + 1);
        let mut kind = Vec::with_capacity(n_events);
        let mut origin = Vec::with_capacity(n_events);
        let mut markers = Vec::new();
        // Alloc number and request position of each allocation (u32::MAX until
        // allocated, or preexisting).
        let mut alloc_no = vec![(u32::MAX, BEFORE_TRACE); trace.allocations.len()];
        let mut intern: FxHashMap<(u8, u64, u64), u32> = FxHashMap::default();
        let mut allocs: u32 = 0;
        for (i, e) in trace.events.iter().enumerate() {
            let pos = u32::try_from(tokens.len()).ok()?;
            let (key, from) = match e.kind {
                EventKind::Alloc(id) => {
                    let a = trace.allocations.get(id.index())?;
                    *alloc_no.get_mut(id.index())? = (allocs, pos);
                    ((ALLOC, a.size.get(), a.stream.0), pos)
                }
                EventKind::FreeRequested(id) | EventKind::FreeCompleted(id) => {
                    let tag = if matches!(e.kind, EventKind::FreeRequested(_)) {
                        FREE_REQUESTED
                    } else {
                        FREE_COMPLETED
                    };
                    let a = trace.allocations.get(id.index())?;
                    match *alloc_no.get(id.index())? {
                        (u32::MAX, _) => ((tag + 2, a.size.get(), a.stream.0), BEFORE_TRACE),
                        (no, at) => ((tag, u64::from(allocs - no), 0), at),
                    }
                }
                // Saved-tensor events allocate nothing and are no part of the sequence.
                EventKind::SavedPack(_) | EventKind::SavedUnpack(_) => continue,
                EventKind::Marker { kind, label } => {
                    markers.push(MarkerAt {
                        kind,
                        label,
                        pos: tokens.len(),
                    });
                    continue;
                }
            };
            let next = intern.len() as u32;
            tokens.push(*intern.entry(key).or_insert(next));
            event.push(u32::try_from(i).ok()?);
            allocs_before.push(allocs);
            kind.push(match key.0 {
                ALLOC => ALLOC,
                1 | 3 => FREE_REQUESTED,
                _ => FREE_COMPLETED,
            });
            origin.push(from);
            if key.0 == ALLOC {
                allocs += 1;
            }
        }
        allocs_before.push(allocs);
        Some(RequestSequence {
            tokens,
            event,
            allocs_before,
            kind,
            origin,
            markers,
        })
    }

    /// The earliest `q` such that `tokens[q..end]` repeats with period `p`, where a free
    /// may differ from its counterpart one period later if both are frees of the same
    /// kind and it frees an allocation made before `q` (a prologue tensor: the first
    /// steady iteration frees leftovers of the prologue, with other ages than later
    /// iterations free leftovers of steady ones). Allocations made at or after `q` are
    /// thereby identical, lifetimes included, in every period. O(end - q).
    fn steady_start(&self, p: usize, end: usize) -> usize {
        debug_assert!(p >= 1 && end >= p && end <= self.len());
        let mut q = end - p;
        // Largest `origin` among the differing frees at positions >= q.
        let mut newest: Option<u32> = None;
        while q > 0 {
            let j = q - 1;
            if self.tokens[j] != self.tokens[j + p] {
                if self.kind[j] == ALLOC || self.kind[j] != self.kind[j + p] {
                    break;
                }
                if self.origin[j] != BEFORE_TRACE {
                    newest = newest.max(Some(self.origin[j]));
                }
            }
            if newest.is_some_and(|o| o as usize >= j) {
                break; // and it stays invalid further back: `newest` only grows
            }
            q = j;
        }
        q
    }

    fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Event index at request position `pos` (the number of events for `pos == len`).
    fn event_at(&self, pos: usize, trace: &Trace) -> EventIdx {
        EventIdx(
            self.event
                .get(pos)
                .copied()
                .unwrap_or(trace.events.len() as u32),
        )
    }

    fn period(
        &self,
        trace: &Trace,
        start: usize,
        p: usize,
        reps: usize,
        source: PeriodSource,
    ) -> Period {
        let boundaries: Vec<EventIdx> = (0..=reps)
            .map(|k| self.event_at(start + k * p, trace))
            .collect();
        let first_len = boundaries[1].0 - boundaries[0].0;
        let events_per_iteration = boundaries
            .windows(2)
            .all(|w| w[1].0 - w[0].0 == first_len)
            .then_some(first_len as usize);
        Period {
            allocs_per_iteration: (self.allocs_before[start + p] - self.allocs_before[start])
                as usize,
            requests_per_iteration: p,
            events_per_iteration,
            first_steady_alloc: self.allocs_before[start] as usize,
            first_steady_event: boundaries[0],
            repetitions: reps,
            boundaries,
            source,
        }
    }
}

/// Steady state from explicit `IterationBegin`/`IterationEnd` markers.
fn from_iteration_markers(seq: &RequestSequence, trace: &Trace, min_reps: usize) -> Option<Period> {
    // IterationBegin markers if there are any (an iteration runs to the next one), else
    // IterationEnd markers (an iteration runs from the previous one).
    let has_begin = seq
        .markers
        .iter()
        .any(|m| m.kind == MarkerKind::IterationBegin);
    let wanted = if has_begin {
        MarkerKind::IterationBegin
    } else {
        MarkerKind::IterationEnd
    };
    let mut cuts: Vec<usize> = seq
        .markers
        .iter()
        .filter(|m| m.kind == wanted)
        .map(|m| m.pos)
        .collect();
    cuts.dedup(); // positions are non-decreasing; empty iterations are dropped
    if cuts.len() < 2 {
        return None;
    }
    // The last complete iteration sets the period; earlier ones belong to the steady
    // state while they are evenly spaced and the sequence repeats back to them. When
    // that leaves too few, the iteration before it is tried: the last one recorded may
    // be cut short (auto mode stops recording at a boundary, and frees still pending
    // then complete after it: on an H100 run with offload, 34 fewer completed frees).
    let mut best = None;
    for last in (cuts.len().saturating_sub(3)..cuts.len() - 1).rev() {
        let end = cuts[last + 1];
        let p = end - cuts[last];
        if p == 0 {
            continue;
        }
        let earliest = seq.steady_start(p, end);
        let mut first = last;
        while first > 0 && cuts[first - 1] >= earliest && cuts[first] - cuts[first - 1] == p {
            first -= 1;
        }
        let reps = last - first + 1;
        if reps >= min_reps {
            best = Some((cuts[first], p, reps));
            break;
        }
    }
    let (start, p, reps) = best?;
    Some(seq.period(trace, start, p, reps, PeriodSource::IterationMarkers))
}

/// Z-function (Gusfield): `z[i]` = length of the longest common prefix of `s` and
/// `s[i..]`; `z[0] = 0` by convention. O(n).
fn z_function(s: &[u32]) -> Vec<u32> {
    let n = s.len();
    let mut z = vec![0u32; n];
    let (mut l, mut r) = (0usize, 0usize);
    for i in 1..n {
        let mut k = if i < r {
            (r - i).min(z[i - l] as usize)
        } else {
            0
        };
        while i + k < n && s[k] == s[i + k] {
            k += 1;
        }
        z[i] = k as u32;
        if i + k > r {
            l = i;
            r = i + k;
        }
    }
    z
}

/// Steady state from the periodicity of the request sequence.
fn from_periodicity(seq: &RequestSequence, trace: &Trace, opts: &DetectOptions) -> Option<Period> {
    let n = seq.len();
    let min_reps = opts.min_repetitions.max(1);
    if n < 2 * min_reps {
        return None;
    }
    let reversed: Vec<u32> = seq.tokens.iter().rev().copied().collect();
    let z = z_function(&reversed);
    // (period, length of the periodic suffix), over periods 1..=n/min_reps (and < n).
    let mut best: Option<(usize, usize)> = None;
    for (p, &zp) in z.iter().enumerate().skip(1).take(n / min_reps) {
        let covered = p + zp as usize;
        if covered >= min_reps * p && best.is_none_or(|(_, b)| covered > b) {
            best = Some((p, covered));
        }
    }
    let (p, covered) = best?;
    if (covered as f64) < opts.min_coverage * n as f64 {
        return None;
    }
    let earliest = seq.steady_start(p, n).min(n - covered);
    let enough = |s: &usize| (n - s) / p >= min_reps;
    let start = aligned_start(seq, trace, earliest, p)
        .filter(enough)
        .or_else(|| {
            (earliest..earliest + p)
                .find(|&i| seq.kind[i] == ALLOC)
                .filter(enough)
        })
        .unwrap_or(earliest);
    let reps = (n - start) / p;
    Some(seq.period(trace, start, p, reps, PeriodSource::RequestSequence))
}

/// The first position in `[earliest, earliest + p)` where the run marks a boundary that
/// repeats `p` requests later (or at the end of the trace): iteration markers first,
/// then the end of an `Optimizer.step` phase.
fn aligned_start(seq: &RequestSequence, trace: &Trace, earliest: usize, p: usize) -> Option<usize> {
    let n = seq.len();
    let window = earliest..earliest + p;
    let is_step_end = |m: &MarkerAt| {
        m.kind == MarkerKind::PhaseEnd
            && m.label
                .and_then(|l| trace.labels.get(l as usize))
                .is_some_and(|l| l.starts_with("Optimizer.step"))
    };
    let at: FxHashSet<(MarkerKind, Option<u32>, usize)> = seq
        .markers
        .iter()
        .map(|m| (m.kind, m.label, m.pos))
        .collect();
    let repeats = |m: &MarkerAt| m.pos + p > n || at.contains(&(m.kind, m.label, m.pos + p));
    let pick = |pred: &dyn Fn(&MarkerAt) -> bool| {
        seq.markers
            .iter()
            .filter(|m| window.contains(&m.pos) && pred(m) && repeats(m))
            .map(|m| m.pos)
            .min()
    };
    pick(&|m| {
        matches!(
            m.kind,
            MarkerKind::IterationBegin | MarkerKind::IterationEnd
        )
    })
    .or_else(|| pick(&is_step_end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stweaver_core::testkit::TraceBuilder;

    type B = TraceBuilder;

    #[test]
    fn z_function_matches_definition() {
        let s = [1, 1, 2, 1, 1, 2, 1];
        let z = z_function(&s);
        for i in 1..s.len() {
            let lcp = s.iter().zip(&s[i..]).take_while(|(a, b)| a == b).count();
            assert_eq!(z[i] as usize, lcp, "i={i}");
        }
    }

    #[test]
    fn prologue_then_repeated_iterations() {
        let mut b = B::new();
        // Prologue: parameters (never freed) and a different first iteration.
        for s in [100, 200, 300] {
            b.alloc(s);
        }
        b.activations(&[7, 8, 9, 10]);
        for _ in 0..4 {
            b.activations(&[1, 2, 3, 2, 1]);
        }
        let t = b.done();
        let p = detect_period(&t).expect("periodic");
        assert_eq!(p.allocs_per_iteration, 5);
        assert_eq!(p.requests_per_iteration, 15);
        assert_eq!(p.events_per_iteration, Some(15));
        assert_eq!(p.repetitions, 4);
        assert_eq!(p.first_steady_alloc, 3 + 4);
        assert_eq!(p.first_steady_event, EventIdx(3 + 12));
        assert_eq!(p.boundaries.len(), 5);
        assert_eq!(p.boundaries[4].index(), t.events.len());
        assert_eq!(p.source, PeriodSource::RequestSequence);
    }

    #[test]
    fn frees_of_prologue_tensors_may_differ() {
        let mut b = B::default();
        // A prologue tensor freed in the first steady iteration, where later iterations
        // free the previous iteration's leftover (at another age).
        let mut carry = b.alloc(99);
        b.activations(&[5, 6, 7]);
        for _ in 0..4 {
            b.alloc(1);
            b.free(carry);
            b.activations(&[2, 3]);
            carry = b.alloc(4);
        }
        let p = detect_period(&b.done()).expect("periodic");
        assert_eq!(p.allocs_per_iteration, 4);
        assert_eq!(p.first_steady_alloc, 4);
        assert_eq!(p.first_steady_event, EventIdx(10));
        assert_eq!(p.repetitions, 4);
    }

    #[test]
    fn sizes_changing_every_iteration_have_no_period() {
        let mut b = B::default();
        for it in 0..6u64 {
            b.activations(&[1, 2, 3 + it, 4, 5]);
        }
        assert_eq!(detect_period(&b.done()), None);
    }

    #[test]
    fn same_sizes_but_different_free_structure_differ() {
        let mut b = B::default();
        for it in 0..6 {
            let x = b.alloc(1);
            let y = b.alloc(1);
            // Alternate which block dies first: sizes repeat with period 2 allocs, frees do not.
            if it % 2 == 0 {
                b.free(x);
                b.free(y);
            } else {
                b.free(y);
                b.free(x);
            }
        }
        let p = detect_period(&b.done()).expect("periodic with two iterations per period");
        assert_eq!(p.allocs_per_iteration, 4);
    }

    #[test]
    fn too_few_repetitions_is_none() {
        let mut b = B::default();
        b.activations(&[5, 6, 7]);
        b.activations(&[1, 2, 3]);
        b.activations(&[1, 2, 3]);
        // Two repetitions (and the frees of the first iteration): accepted by default...
        let t = b.done();
        assert_eq!(detect_period(&t).map(|p| p.repetitions), Some(2));
        // ...but not when three are required.
        let opts = DetectOptions {
            min_repetitions: 3,
            ..DetectOptions::default()
        };
        assert_eq!(detect_period_with(&t, &opts), None);
    }

    #[test]
    fn aligns_to_optimizer_step_end() {
        let mut b = B::default();
        // Each iteration: forward/backward allocs, then an optimizer step whose tail
        // looks like any other; the periodic suffix starts before the first step END.
        for it in 0..4 {
            if it == 0 {
                b.activations(&[50, 60]);
            } else {
                b.activations(&[1, 2, 3]);
            }
            b.marker(MarkerKind::PhaseBegin, "Optimizer.step#AdamW.step");
            b.activations(&[4, 4]);
            b.marker(MarkerKind::PhaseEnd, "Optimizer.step#AdamW.step");
        }
        b.activations(&[1, 2, 3]); // an incomplete fifth iteration
        let t = b.done();
        let p = detect_period(&t).expect("periodic");
        assert_eq!(p.allocs_per_iteration, 5);
        // Aligned: the steady state starts right after the first step's END marker.
        assert_eq!(p.first_steady_alloc, 4);
        let end_marker = t
            .events
            .iter()
            .position(|e| {
                matches!(
                    e.kind,
                    EventKind::Marker {
                        kind: MarkerKind::PhaseEnd,
                        ..
                    }
                )
            })
            .unwrap();
        assert_eq!(p.first_steady_event.index(), end_marker + 1);
        assert_eq!(p.repetitions, 3);
        assert_eq!(p.events_per_iteration, Some(17));
    }

    #[test]
    fn explicit_iteration_markers_win() {
        let mut b = B::default();
        b.marker(MarkerKind::IterationBegin, "it");
        b.activations(&[9, 9, 9]);
        for _ in 0..3 {
            b.marker(MarkerKind::IterationBegin, "it");
            b.activations(&[1, 2]);
            b.activations(&[3]);
        }
        b.marker(MarkerKind::IterationBegin, "it");
        let t = b.done();
        let p = detect_period(&t).expect("marked");
        assert_eq!(p.source, PeriodSource::IterationMarkers);
        assert_eq!(p.allocs_per_iteration, 3);
        assert_eq!(p.repetitions, 3);
        assert_eq!(p.first_steady_alloc, 3);
        // Marked iterations that differ fall back to the sequence, which finds nothing.
        let mut b = B::default();
        for it in 0..4u64 {
            b.marker(MarkerKind::IterationBegin, "it");
            b.activations(&[1, 2 + it]);
        }
        b.marker(MarkerKind::IterationBegin, "it");
        assert_eq!(detect_period(&b.done()), None);
    }

    #[test]
    fn empty_and_tiny_traces() {
        assert_eq!(detect_period(&Trace::default()), None);
        let mut b = B::default();
        b.alloc(1);
        assert_eq!(detect_period(&b.done()), None);
    }
}
