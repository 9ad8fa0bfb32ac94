//! Plan mode: following the plan's request sequence at run time.
//!
//! A [`Cursor`] walks the expected requests of a [`Plan`] — the prologue once, then the
//! iteration section over and over — and answers, for each incoming request, the
//! planned request it is (hence its offset) or "not planned".
//!
//! # The expected sequence
//!
//! The cursor sees the plan as one endless sequence: the prologue's `P` requests, then
//! the iteration's `L` requests, repeated. A position `v` in it is *virtual*: `v < P`
//! is prologue request `v`, `v ≥ P` is request `(v − P) mod L` of iteration
//! `(v − P) / L`. Look-ahead therefore runs across section ends (the last requests of an
//! iteration and the first of the next, the end of the prologue and the first
//! iteration) like anywhere else.
//!
//! # Matching: a small beam of alignments
//!
//! The run is the plan with local edits: an extra request (a logging buffer, an eval
//! step), a missing one, one with another size. Matching is an online alignment of the
//! run against the expected sequence, kept as a *beam* of at most [`BEAM`] hypotheses
//! `(position, cost)`. For each request `r = (size, stream)`, every hypothesis at `v`
//! moves on by one of three steps:
//!
//! - **match** (cost 0): expected request `v` has the same size and stream → `v + 1`;
//! - **insert** (cost 1): `r` is extra → stays at `v`;
//! - **skip** (cost `1 + ⌊log₂ k⌋`): the nearest expected request `j = v + k` with
//!   `0 < k < window` that matches `r`; `v .. j` did not happen → `j + 1`.
//! - **restart** (cost 4): `v` lies in the first half of an iteration, past its start
//!   `s`, and expected request `s` matches `r` → `s + 1`. The run begins the iteration
//!   again: an unmarked eval pass right after the boundary made requests of the
//!   forward's sizes, which matched the forward's places (a long loop with an eval every
//!   10 steps: 1.30 x the lower bound without restarts, 1.006 x with,
//!   `crates/planner/tests/long_loops.rs`). Not from the second half, where
//!   checkpointing's recomputed forwards repeat the forward's sizes.
//!
//! (A request of another size *instead of* an expected one is an insert followed by a
//! skip of one on the next request.) Hypotheses reaching the same position keep the
//! lower cost; the beam keeps the cheapest ones within [`MARGIN`] of the best (ties: the
//! lower position, which loses nothing). The request is served from the **best**
//! hypothesis (lowest cost; on a tie one whose step matched; then the lower position):
//! its matched expected request gives the offset, an insert means *unplanned*.
//!
//! Why a beam and not the greedy first match: a skip is decided by one request, which
//! may be an extra one that happens to have the size of a request further ahead.
//! Greedy matching jumps there, and every expected request it jumped over is lost (the
//! run then makes them, and they match nothing or something wrong, and so on: the
//! cascade of purely positional matching, `research/stalloc-reference.md` §4.4, only
//! shorter). In the beam the jump and "it was extra" are both kept; the next requests
//! tell them apart (the true one keeps matching at cost 0, the other pays 1 per
//! request), so one extra request costs one unplanned request, one missing one costs
//! nothing, and long departures (an eval pass of a few thousand requests of other
//! sizes) keep the position they left from until the run comes back to it. The skip
//! cost grows with the log of the jump so that a long jump that is real wins after a
//! few confirming requests while a false one is dropped at the first request that
//! contradicts it.
//!
//! **What no matcher can know.** A request is placed when it arrives, before the run
//! shows whether it was extra. In a run of expected requests of one size (the same
//! projection in every layer), an extra request of that size matches the next of them
//! at cost 0, and each real one then takes its neighbour's slot, until the run of
//! equal sizes ends and the alignment is right again. Those blocks live as long as
//! their own tensors, not as their slots were planned, so later requests planned on
//! those ranges find them occupied: conflicts, served from holes (module
//! `crate::engine`), never aliases. On the llama snapshot with 1 % of requests
//! inserted (sizes drawn from the trace), dropped or resized, plus an eval pass, this
//! costs 1.5–4.6 % of the planned requests
//! (`crates/planner/tests/engine_replay_perturbed.rs`).
//!
//! **Fast path.** When the beam holds one hypothesis and its expected request matches,
//! the step is O(1) (compare, advance). After [`CONFIRM`] consecutive requests whose
//! best step was a match and with no rival at the same cost, the beam collapses to the
//! best hypothesis; a run that follows the plan is on the fast path.
//!
//! # Iteration boundaries
//!
//! [`Cursor::mark_iteration`] (the framework's iteration marker, where the planner cuts
//! iterations) snaps the best hypothesis to the **nearest** iteration start and
//! collapses the beam: at index `i` of an iteration, `i < L/2` goes back to that
//! iteration's start (the cursor had run ahead: requests of this iteration's end matched
//! the next one's start), `i ≥ L/2` forward to the next start (the iteration was cut
//! short; the rest is counted as skipped). In the prologue, a marker **leaves the
//! prologue** when the cursor is within `L/2` of its end, *or when the run has made at
//! least `P − L/2` requests since the plan was loaded*, so a prologue the run never
//! finishes (requests it no longer makes, a different setup phase) does not hold the
//! plan hostage; earlier markers are boundaries the prologue itself spans and change
//! nothing.
//!
//! # Iteration classes
//!
//! A plan may have several iteration sections, one per *class* (`Plan::extra_classes`:
//! a few sequence-length buckets), any of which may follow any other. A hypothesis is
//! then `(class, position, cost)`: positions `≥ P` index the hypothesis's own class,
//! and look-ahead past its end runs into the same class again. Whenever the cursor
//! stands at an iteration start — the load of a plan without prologue (a switch
//! mid-run) and every marker — the beam *branches*: one hypothesis per class (at most
//! [`MAX_CLASSES`]), all at cost 0, the class just served first. The iteration's first
//! requests then choose the class exactly as they choose between alignments: the
//! classes whose requests do not match pay inserts and skips and fall out of the beam
//! within [`MARGIN`]; a tie goes to the earlier hypothesis (the class just served, then
//! the plan's order). A wrong guess is a request placed at another class's offset:
//! when the right class's request later finds that range occupied it is a conflict,
//! served from a hole (module `crate::engine`), never an alias. Runs without markers
//! stay in the class they are in.
//!
//! # Keyed iterations
//!
//! Classes whose first requests are the same (an eval pass and a training step of one
//! batch shape: the same forward; two length buckets sharing the embedding's buffers)
//! cannot be told apart by those requests: the class just served wins the tie and,
//! when the iteration is of the other class, its shared requests go to the wrong
//! class's places (conflicts later in the iteration, or, past `4 · CONFIRM` shared
//! requests, the beam closed on the wrong class). The program often knows the class:
//! `stweaver.step(key)` labels the iteration that begins at the boundary (an eval, a
//! length bucket). No key is in the plan file: the key → class map is *learned* at run
//! time.
//!
//! - **Learning.** At the end of an iteration with a key, if at least half of its
//!   class's requests matched (hits, and conflicts: the class was right, the range
//!   busy), that class is the key's: the best hypothesis's, with the head start below
//!   taken off (a wrong key whose iteration ended right after its requests differed,
//!   while the key's class still led, is corrected all the same).
//! - **Hint.** At the start of an iteration whose key is known, the beam branches as
//!   before, but with the key's class first and every other class at cost [`HINT`] (2):
//!   the key's class serves the shared requests and keeps the lead unless its requests
//!   clearly do not match, i.e. until it pays `HINT` more than another class (one
//!   request served unplanned, then the right class takes over, as an unkeyed branch
//!   would have at the first request that differs).
//! - **An open beam.** In an iteration with a key (known or not), a hypothesis of
//!   another class within the head start (0 for an unknown key: a tie) is a rival, and
//!   the beam does not close while one remains, not even after `4 · CONFIRM` matches:
//!   the classes stay open over a shared prefix of any length, at O(classes) per
//!   request while they all match, instead of the fast path.
//! - **A wrong key** (one whose iterations change class) is a wrong guess like the
//!   unkeyed one, a request placed at another class's offset, which is a conflict when
//!   the range is occupied, never an alias (the engine checks every planned range),
//!   plus one request unplanned while the key's class keeps its head start; the key is
//!   learned anew from that iteration. The beam is never restricted to one class.
//! - An unknown key, a plan of one class, or no plan: the key changes nothing (but for
//!   the open beam). A key given after the boundary (`stweaver.iteration_key`, when the
//!   boundaries come from the optimizer hook; [`Cursor::set_key`]) seeds the beam the
//!   same way while the cursor still stands at the iteration's start with nothing
//!   matched, and is only learned from after that. A second marker at the same start,
//!   with no request since and no key, keeps the first one's.
//! - **A plan replaced** (auto mode's plan with the classes it learned after its
//!   switch: `Engine::unload_plan`, then a new plan) keeps what was learned: the engine
//!   keeps the old cursor's [`LearnedKeys`] and the new cursor adopts each key for its
//!   class of the same request signature ([`Cursor::adopt_keys`]).
//!
//! Measured (`crates/core/tests/engine_plan_classes.rs`): two classes beginning alike,
//! alternating, 40 iterations: 39 conflicts unkeyed, 1 keyed; keys that always name the
//! wrong class (the unkeyed guess right half the time): one request unplanned per
//! iteration, 38 instead of 19 conflicts, none an overlap. Cost: O([`MAX_KEYS`]) at a
//! boundary (64 keys in a fixed array, the least recently used replaced), nothing per
//! request but the open beam.
//!
//! The virtual clock ([`Cursor::vtick`]) counts on across classes of different lengths:
//! at each marker positions are rebased to `P` and the tick where the new iteration
//! starts is kept (`base_tick`), so planned ends handed out earlier stay comparable.
//!
//! A match is only a proposal: the engine hands out the planned offset only after
//! checking that nothing live occupies it (see [`crate::engine`]). The plan itself is
//! never mutated; the cursor copies what it needs once at load.
//!
//! # Cost
//!
//! O(1) per request on the fast path; O(BEAM · window) worst case while the beam is
//! open (after a departure from the plan, or at an iteration start of a plan with
//! several classes until its first requests chose one). O([`MAX_KEYS`]) per iteration
//! boundary for the keys. No heap allocation after construction (the beam and the
//! keys are fixed arrays).

use crate::plan::{Plan, PlannedRequest};
use crate::units::{Offset, StreamId};

/// Hypotheses kept at most.
pub const BEAM: usize = 8;
/// Iteration classes followed at most (module docs, iteration classes): one hypothesis
/// each at an iteration start. A plan's later classes are not followed (their
/// iterations are served as unplanned requests, from holes).
pub const MAX_CLASSES: usize = BEAM;
/// Hypotheses costing more than the best plus this are dropped.
pub const MARGIN: u32 = 8;
/// Consecutive best-path matches (with no rival at the best cost) that close the beam.
pub const CONFIRM: u32 = 3;
/// Cost of an extra request.
const INSERT: u32 = 1;
/// Cost of going back to the start of the current iteration.
const RESTART: u32 = 4;
/// Keys remembered at most (module docs, keyed iterations); the least recently used one
/// goes first.
pub const MAX_KEYS: usize = 64;
/// The head start of a key's class at an iteration start: the other classes' hypotheses
/// begin at this cost (module docs, keyed iterations). Below [`MARGIN`], so they stay in
/// the beam.
pub const HINT: u32 = 2;

/// What plan serving has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Requests that matched an expected request and got its planned offset.
    pub hits: u64,
    /// Requests that matched, but whose planned range was occupied.
    pub conflicts: u64,
    /// Hits whose planned range was held only by frees still waiting for other
    /// streams: the request's stream was made to wait for their events
    /// ([`crate::engine::PlanOptions::wait_for_pending_frees`]), then the request got its
    /// planned offset (counted in `hits` too).
    pub waits: u64,
    /// Requests that matched nothing (the best alignment calls them extra).
    pub unplanned: u64,
    /// Requests not served at a planned offset (unplanned, conflicts) that were
    /// placed in a free hole of the plan's pool instead of the online arenas.
    pub holes: u64,
    /// Requests not served at a planned offset that found no hole and were placed
    /// above the planned part of the pool, which grew for them (counted in `holes`
    /// too).
    pub grown: u64,
    /// Expected requests passed over by a match further ahead, or left over at an
    /// iteration boundary.
    pub skipped: u64,
    /// Iterations started (the prologue counts as none).
    pub iterations: u64,
    /// Iterations whose class guess began from the class their key was last served as
    /// (module docs of `cursor`, keyed iterations).
    pub hinted: u64,
}

/// Which section the cursor is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Prologue,
    Iteration,
}

/// One expected request, as the engine needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Expected {
    pub size: u64,
    pub stream: StreamId,
    pub offset: Offset,
    /// Bytes the block takes in the pool (the size rounded up to 512 B).
    pub len: u64,
    /// Another stream of the plan uses part of this request's range: its free must
    /// wait for its own stream (module `crate::engine::plan_serving` docs, streams).
    pub cross: bool,
    /// Planned lifetime on the section's clock (`end` may be [`crate::plan::NEVER_FREED`]).
    pub start: u64,
    pub end: u64,
    /// For a match returned by [`Cursor::next`]: the planned free on the cursor's
    /// virtual clock ([`Cursor::vtick`]); 0 in the stored sequence.
    pub vend: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Hyp {
    pos: u64,
    cost: u32,
    /// The iteration class the position is in (module docs, iteration classes).
    class: u32,
}

/// One remembered key (module docs, keyed iterations).
#[derive(Debug, Clone, Copy, Default)]
struct KeySlot {
    key: u64,
    class: u32,
    /// [`KeyClasses::clock`] at its last use.
    used: u64,
}

/// What the cursor learned about iteration keys: for each key (at most [`MAX_KEYS`], the
/// least recently used one replaced), the class its last well-served iteration was. A
/// fixed array, looked up at iteration boundaries only: O(`MAX_KEYS`), no heap.
#[derive(Debug, Clone)]
struct KeyClasses {
    slots: [KeySlot; MAX_KEYS],
    n: usize,
    clock: u64,
}

impl KeyClasses {
    fn new() -> KeyClasses {
        KeyClasses {
            slots: [KeySlot::default(); MAX_KEYS],
            n: 0,
            clock: 0,
        }
    }

    /// The class `key` was last served as, if it is known (a use: it stays longer).
    fn get(&mut self, key: u64) -> Option<u32> {
        self.clock += 1;
        let clock = self.clock;
        let s = self.slots[..self.n].iter_mut().find(|s| s.key == key)?;
        s.used = clock;
        Some(s.class)
    }

    /// Remembers that `key`'s iteration was served as `class`.
    fn learn(&mut self, key: u64, class: u32) {
        self.clock += 1;
        let slot = KeySlot {
            key,
            class,
            used: self.clock,
        };
        if let Some(s) = self.slots[..self.n].iter_mut().find(|s| s.key == key) {
            *s = slot;
        } else if self.n < MAX_KEYS {
            self.slots[self.n] = slot;
            self.n += 1;
        } else if let Some(s) = self.slots.iter_mut().min_by_key(|s| s.used) {
            *s = slot;
        }
    }
}

/// What a cursor learned about keys, kept over a plan's replacement (auto mode's plan
/// with classes learned after its switch: `Engine::unload_plan`, then a new plan
/// loaded): each class named by its request signature, so that a key follows its class
/// to wherever the new plan has it.
#[derive(Debug, Clone)]
pub(crate) struct LearnedKeys {
    keys: KeyClasses,
    classes: Vec<u64>,
}

/// A class's request signature: its requests' sizes and streams (FNV-1a).
fn signature(section: &[Expected]) -> u64 {
    section
        .iter()
        .flat_map(|e| [e.size, e.stream.0])
        .fold(0xcbf2_9ce4_8422_2325, |h, x| {
            (h ^ x).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

#[derive(Debug, Clone, Copy)]
struct Cand {
    pos: u64,
    cost: u32,
    class: u32,
    /// The beam index of the hypothesis it came from (a deterministic tie-break).
    from: u32,
    /// The expected request this step matched (`None`: an insert).
    matched: Option<u64>,
    /// The step was a match at distance 0.
    direct: bool,
    skipped: u64,
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub(crate) struct Cursor {
    prologue: Vec<Expected>,
    /// The iteration section of each class (class 0: the plan's `iteration`).
    classes: Vec<Vec<Expected>>,
    /// Each class's length on the plan clock.
    class_len: Vec<u64>,
    /// The virtual tick at which iteration 0 of the current positions starts (positions
    /// are rebased at every iteration start a marker snaps to: module docs, classes).
    base_tick: u64,
    beam: [Hyp; BEAM],
    n: usize,
    streak: u32,
    window: u64,
    /// Requests offered since load.
    seen: u64,
    /// The last operation was a resynchronisation to an iteration start.
    at_start: bool,
    /// The key of the iteration in progress, if it has one (module docs, keyed
    /// iterations).
    key: Option<u64>,
    /// Each key's class, as learned.
    keys: KeyClasses,
    /// Requests matched (hits and conflicts) and `seen` when the iteration in progress
    /// began.
    matched_at_start: u64,
    seen_at_start: u64,
    /// A key's class (`lead`) leads the beam by this head start: until the beam closes,
    /// a hypothesis of another class within it of the best is a rival (0: no hint).
    handicap: u32,
    lead: u32,
    pub stats: PlanStats,
}

/// Where the cursor stood, kept over a phase ([`Cursor::bookmark`], [`Cursor::resume`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bookmark {
    beam: [Hyp; BEAM],
    n: usize,
    streak: u32,
    at_start: bool,
    base_tick: u64,
    handicap: u32,
    lead: u32,
}

fn skip_cost(k: u64) -> u32 {
    1 + k.max(1).ilog2()
}

impl Cursor {
    /// A cursor at the start of `plan`'s prologue (or of its iteration section when
    /// the prologue is empty), looking `window ≥ 1` requests ahead. `cross` says, for
    /// the prologue then the iteration requests, which ones share range with another
    /// stream.
    pub fn new(plan: &Plan, window: usize, cross: &[bool]) -> Cursor {
        let mut flags = cross.iter().copied().chain(std::iter::repeat(false));
        let mut expected = |reqs: &[PlannedRequest]| -> Vec<Expected> {
            reqs.iter()
                .map(|r| Expected {
                    size: r.size.get(),
                    stream: r.stream,
                    offset: r.offset,
                    len: r.size.get().div_ceil(512) * 512,
                    cross: flags.next().unwrap_or(false),
                    start: r.start,
                    end: r.end,
                    vend: 0,
                })
                .collect()
        };
        let prologue = expected(&plan.prologue);
        let k = plan.class_count().min(MAX_CLASSES);
        let classes: Vec<Vec<Expected>> = (0..k).map(|c| expected(plan.class(c).0)).collect();
        let class_len = (0..k).map(|c| plan.class(c).1).collect();
        let starts_in_iteration = prologue.is_empty() && !classes.is_empty();
        let mut c = Cursor {
            prologue,
            classes,
            class_len,
            base_tick: plan.prologue_len,
            beam: [Hyp::default(); BEAM],
            n: 1,
            streak: 0,
            window: window.max(1) as u64,
            seen: 0,
            at_start: starts_in_iteration,
            key: None,
            keys: KeyClasses::new(),
            matched_at_start: 0,
            seen_at_start: 0,
            handicap: 0,
            lead: 0,
            stats: PlanStats {
                iterations: u64::from(starts_in_iteration),
                ..PlanStats::default()
            },
        };
        if starts_in_iteration {
            c.branch(0, false);
        }
        c
    }

    /// The beam at the start of an iteration (position `P`), one hypothesis per class,
    /// class `first` first (the preferred one on a tie): the iteration's first requests
    /// tell the classes apart (module docs, iteration classes). All at cost 0, or, when
    /// `hinted` (`first` is the class of the iteration's key), the others at [`HINT`]
    /// (module docs, keyed iterations).
    fn branch(&mut self, first: u32, hinted: bool) {
        let k = self.classes.len();
        self.n = k.max(1);
        let p = self.p();
        let order = std::iter::once(first).chain((0..k as u32).filter(|&c| c != first));
        for (slot, class) in self.beam.iter_mut().zip(order) {
            *slot = Hyp {
                pos: p,
                cost: if hinted && class != first { HINT } else { 0 },
                class,
            };
        }
        self.handicap = if hinted && k > 1 { HINT } else { 0 };
        self.lead = first;
    }

    /// Requests matched so far: hits and conflicts.
    fn matched_count(&self) -> u64 {
        self.stats.hits + self.stats.conflicts
    }

    /// The class the iteration in progress was, for its key: the best hypothesis's,
    /// the key's head start taken off if it still holds (the key's class may lead
    /// only thanks to it: a wrong key whose iteration ended soon after its requests
    /// showed it).
    fn served_class(&self) -> u32 {
        if self.handicap == 0 {
            return self.class();
        }
        let (lead, head) = (self.lead, self.handicap);
        self.beam[..self.n]
            .iter()
            .min_by_key(|h| {
                let own = h.class == lead;
                (
                    i64::from(h.cost) - i64::from(if own { 0 } else { head }),
                    !own,
                )
            })
            .map_or(self.class(), |h| h.class)
    }

    /// The class `key` was last served as, if the plan has several classes and the key
    /// is known.
    fn hint(&mut self, key: Option<u64>) -> Option<u32> {
        let k = self.classes.len();
        if k < 2 {
            return None;
        }
        key.and_then(|key| self.keys.get(key))
            .filter(|&c| (c as usize) < k)
    }

    /// The iteration in progress has key `key` (`stweaver.iteration_key`, or a plan
    /// loaded mid-iteration): learned from at its end, and, if the cursor still stands
    /// at the iteration's start with nothing matched, its class guess begins from the
    /// key's class (module docs, keyed iterations). Later, the key is only learned from.
    pub fn set_key(&mut self, key: u64) {
        self.key = Some(key);
        if !self.at_start || self.best() != self.p() {
            return;
        }
        if let Some(h) = self.hint(Some(key)) {
            if self.handicap == 0 {
                self.stats.hinted += 1;
            }
            self.branch(h, true);
            self.streak = 0;
        }
    }

    /// What the cursor learned about keys, if anything (for a plan that replaces this
    /// one: [`Cursor::adopt_keys`]).
    pub fn learned_keys(&self) -> Option<LearnedKeys> {
        (self.keys.n > 0).then(|| LearnedKeys {
            keys: self.keys.clone(),
            classes: self.classes.iter().map(|c| signature(c)).collect(),
        })
    }

    /// Takes over what another plan's cursor learned about keys: each key's class, where
    /// this plan has a class of the same request signature (others are dropped).
    pub fn adopt_keys(&mut self, learned: &LearnedKeys) {
        if self.classes.len() < 2 {
            return;
        }
        let now: Vec<u64> = self.classes.iter().map(|c| signature(c)).collect();
        let mut slots = learned.keys.slots[..learned.keys.n].to_vec();
        // Oldest first, so that the least recently used stays so.
        slots.sort_unstable_by_key(|s| s.used);
        for s in slots {
            let class = learned.classes.get(s.class as usize);
            if let Some(c) = class.and_then(|f| now.iter().position(|g| g == f)) {
                self.keys.learn(s.key, c as u32);
            }
        }
    }

    /// The class of the best hypothesis.
    pub fn class(&self) -> u32 {
        self.beam[0].class
    }

    /// Iteration section of class `c` (empty: no iteration section).
    fn section(&self, c: u32) -> &[Expected] {
        self.classes.get(c as usize).map_or(&[], Vec::as_slice)
    }

    fn len_of(&self, c: u32) -> u64 {
        self.class_len.get(c as usize).copied().unwrap_or(0)
    }

    fn p(&self) -> u64 {
        self.prologue.len() as u64
    }

    /// Requests in one iteration of class `c`.
    fn l_of(&self, c: u32) -> u64 {
        self.section(c).len() as u64
    }

    /// Requests in one iteration of the best hypothesis's class.
    fn l(&self) -> u64 {
        self.l_of(self.class())
    }

    /// Expected request at virtual position `v` of class `c` (`None` past a
    /// prologue-only plan).
    #[inline]
    fn entry_in(&self, c: u32, v: u64) -> Option<&Expected> {
        let p = self.p();
        if v < p {
            return self.prologue.get(v as usize);
        }
        let l = self.l_of(c);
        if l == 0 {
            return None;
        }
        self.section(c).get(((v - p) % l) as usize)
    }

    /// Expected request at virtual position `v` of the best hypothesis's class.
    #[inline]
    pub fn entry(&self, v: u64) -> Option<&Expected> {
        self.entry_in(self.class(), v)
    }

    /// The best hypothesis's position.
    fn best(&self) -> u64 {
        self.beam[0].pos
    }

    /// Where the cursor is: section and index of the next expected request (at the end
    /// of an iteration not yet followed by a marker, the index is `L`).
    pub fn position(&self) -> (Section, usize) {
        let (v, p, l) = (self.best(), self.p(), self.l());
        if v < p || l == 0 {
            return (Section::Prologue, v.min(p) as usize);
        }
        let i = (v - p) % l;
        if i == 0 && v > p && !self.at_start {
            (Section::Iteration, l as usize)
        } else {
            (Section::Iteration, i as usize)
        }
    }

    /// The expected requests after the best hypothesis's position, at most `h` of them
    /// (for the engine's "is this hole needed soon" check).
    pub fn upcoming(&self, h: usize) -> impl Iterator<Item = &Expected> + '_ {
        let v = self.best();
        (0..h as u64).map_while(move |k| self.entry(v + k))
    }

    /// Every expected request of the classes other than the best hypothesis's (all of
    /// them in the prologue), each class's whole section (empty for a plan of one class):
    /// the next iteration may be any class (module docs, iteration classes).
    pub fn other_classes(&self) -> impl Iterator<Item = &Expected> + '_ {
        self.other_classes_indexed().map(|(_, e)| e)
    }

    /// [`Cursor::other_classes`], each request with its index in its class's section
    /// (0: the class's first request, the next iteration's first if it is that class).
    pub fn other_classes_indexed(&self) -> impl Iterator<Item = (usize, &Expected)> + '_ {
        // In the prologue, every class is still ahead.
        let c = if self.classes.len() < 2 {
            0
        } else if self.best() < self.p() {
            usize::MAX
        } else {
            self.class() as usize
        };
        self.classes
            .iter()
            .enumerate()
            .filter(move |&(k, _)| k != c)
            .flat_map(|(_, s)| s.iter().enumerate())
    }

    /// Whether every expected request is behind the cursor (a prologue-only plan the
    /// run has gone past).
    pub fn spent(&self) -> bool {
        self.classes.is_empty() && self.n == 1 && self.best() >= self.p()
    }

    /// The expected request at the best hypothesis's position, its virtual planned
    /// end filled in.
    pub fn peek(&self) -> Option<Expected> {
        self.matched(self.best())
    }

    /// Expected requests in the plan: the prologue's plus the largest class's.
    pub fn len(&self) -> usize {
        self.prologue.len() + self.classes.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Expected requests in one iteration of the current class (0: a prologue-only
    /// plan).
    pub fn iteration_requests(&self) -> usize {
        self.l() as usize
    }

    /// The expected requests after the best hypothesis's position that are planned to
    /// start before virtual tick `until`, at most `cap` of them.
    pub fn upcoming_until(&self, until: u64, cap: usize) -> impl Iterator<Item = &Expected> + '_ {
        let v = self.best();
        (0..cap as u64)
            .map_while(move |k| self.entry(v + k).map(|e| (v + k, e)))
            .take_while(move |&(w, e)| self.vtick(w, e.start) < until)
            .map(|(_, e)| e)
    }

    /// Tick `t` of the section that virtual position `v` is in, on one clock for the
    /// whole unrolled plan (the prologue's ticks, then each iteration's). Saturating;
    /// a never-freed end stays at the top.
    pub fn vtick(&self, v: u64, t: u64) -> u64 {
        self.vtick_in(self.class(), v, t)
    }

    /// [`Cursor::vtick`] for a position of class `c`.
    fn vtick_in(&self, c: u32, v: u64, t: u64) -> u64 {
        let p = self.p();
        let l = self.l_of(c);
        if v < p || l == 0 || t == crate::plan::NEVER_FREED {
            return t;
        }
        let k = (v - p) / l;
        self.base_tick
            .saturating_add(k.saturating_mul(self.len_of(c)))
            .saturating_add(t)
    }

    /// The stored entry at `j`, with its virtual planned end filled in.
    fn matched(&self, j: u64) -> Option<Expected> {
        self.matched_in(self.class(), j)
    }

    /// [`Cursor::matched`] for a position of class `c`.
    fn matched_in(&self, c: u32, j: u64) -> Option<Expected> {
        self.entry_in(c, j).map(|e| Expected {
            vend: self.vtick_in(c, j, e.end),
            ..*e
        })
    }

    /// The expected request for a request of `size` requested bytes on `stream`, or
    /// `None` if it is not planned (see the module documentation).
    #[inline]
    pub fn next(&mut self, size: u64, stream: StreamId) -> Option<Expected> {
        self.seen += 1;
        let v = self.beam[0].pos;
        // Fast path: one hypothesis, and it matches. `entry`, `note_consumed(v, v)` and
        // `vtick` in one: the iteration index and the index in it come from one
        // division.
        if self.n == 1 {
            let p = self.p();
            let (e, vend) = if v < p {
                match self.prologue.get(v as usize) {
                    Some(&e) if e.size == size && e.stream == stream => (e, e.end),
                    _ => return self.step(size, stream),
                }
            } else {
                let c = self.beam[0].class;
                let l = self.l_of(c);
                if l == 0 {
                    return self.step(size, stream);
                }
                let (k, i) = ((v - p) / l, (v - p) % l);
                match self.section(c).get(i as usize) {
                    Some(&e) if e.size == size && e.stream == stream => {
                        // Passing an iteration start that no marker (or the load)
                        // counted.
                        if i == 0 && !self.at_start {
                            self.stats.iterations += 1;
                        }
                        let vend = if e.end == crate::plan::NEVER_FREED {
                            e.end
                        } else {
                            self.base_tick
                                .saturating_add(k.saturating_mul(self.len_of(c)))
                                .saturating_add(e.end)
                        };
                        (e, vend)
                    }
                    _ => return self.step(size, stream),
                }
            };
            debug_assert_eq!(vend, self.vtick(v, e.end));
            self.beam[0].pos = v + 1;
            self.streak = self.streak.saturating_add(1);
            self.at_start = false;
            self.stats.hits += 1;
            return Some(Expected { vend, ..e });
        }
        self.step(size, stream)
    }

    /// The best hypothesis's class and position (virtual), for
    /// [`Cursor::lives_forever_at`].
    pub fn best_pos(&self) -> (u32, u64) {
        (self.class(), self.best())
    }

    /// Whether expected request `v` (virtual position) of class `c` is planned to live
    /// forever.
    pub fn lives_forever_at(&self, (c, v): (u32, u64)) -> bool {
        self.entry_in(c, v)
            .is_some_and(|e| e.end == crate::plan::NEVER_FREED)
    }

    /// Counts the iteration starts passed when the cursor, at `from`, consumes
    /// expected request `j ≥ from`: every start in `[from, j]`, except one at `from`
    /// that a marker (or the load) already counted.
    fn note_consumed(&mut self, c: u32, from: u64, j: u64) {
        let (p, l) = (self.p(), self.l_of(c));
        if l == 0 || j < p {
            return;
        }
        let first = if from <= p { 0 } else { (from - p).div_ceil(l) };
        let last = (j - p) / l;
        let mut n = (last + 1).saturating_sub(first);
        if self.at_start && from >= p && (from - p).is_multiple_of(l) && n > 0 {
            n -= 1;
        }
        self.stats.iterations += n;
    }

    /// The general step over the whole beam.
    fn step(&mut self, size: u64, stream: StreamId) -> Option<Expected> {
        let mut cands = [Cand {
            pos: 0,
            cost: 0,
            class: 0,
            from: 0,
            matched: None,
            direct: false,
            skipped: 0,
        }; 3 * BEAM];
        let mut m = 0;
        let mut push = |c: Cand, cands: &mut [Cand; 3 * BEAM]| {
            if let Some(x) = cands[..m]
                .iter_mut()
                .find(|x| x.pos == c.pos && x.class == c.class)
            {
                let better = (c.cost, c.matched.is_none()) < (x.cost, x.matched.is_none());
                if better {
                    *x = c;
                }
            } else {
                cands[m] = c;
                m += 1;
            }
        };
        let beam = self.beam;
        for (from, h) in (0u32..).zip(&beam[..self.n]) {
            let matches = |e: &Expected| e.size == size && e.stream == stream;
            let cand = |pos, cost, matched, direct, skipped| Cand {
                pos,
                cost,
                class: h.class,
                from,
                matched,
                direct,
                skipped,
            };
            match self.entry_in(h.class, h.pos) {
                Some(e) if matches(e) => {
                    push(cand(h.pos + 1, h.cost, Some(h.pos), true, 0), &mut cands)
                }
                _ => {
                    push(cand(h.pos, h.cost + INSERT, None, false, 0), &mut cands);
                    let found = (1..self.window)
                        .map_while(|k| self.entry_in(h.class, h.pos + k).map(|e| (k, e)))
                        .find(|(_, e)| matches(e));
                    if let Some((k, _)) = found {
                        push(
                            cand(
                                h.pos + k + 1,
                                h.cost + skip_cost(k),
                                Some(h.pos + k),
                                false,
                                k,
                            ),
                            &mut cands,
                        );
                    }
                    // Restart: the run begins this iteration again (an unmarked eval
                    // pass took the forward's places; module docs, restarts).
                    let (p, l) = (self.p(), self.l_of(h.class));
                    if l > 0 && h.pos > p && (h.pos - p) % l != 0 && (h.pos - p) % l < l / 2 {
                        let start = h.pos - (h.pos - p) % l;
                        if self.entry_in(h.class, start).is_some_and(matches) {
                            push(
                                cand(start + 1, h.cost + RESTART, Some(start), false, 0),
                                &mut cands,
                            );
                        }
                    }
                }
            }
        }
        let cands = &mut cands[..m];
        // Best first: cost, then a matching step, then the lower position, then the
        // earlier hypothesis (the class preferred at a branch).
        cands.sort_unstable_by_key(|c| (c.cost, c.matched.is_none(), c.pos, c.from));
        let best = cands[0];
        let from = self.beam[0].pos;
        let from_class = self.beam[0].class;
        // The beam: within MARGIN of the best, lowest cost then lowest position.
        let floor = best.cost;
        self.beam[0] = Hyp {
            pos: best.pos,
            cost: 0,
            class: best.class,
        };
        let mut rest: [Cand; 3 * BEAM] = [best; 3 * BEAM];
        let mut r = 0;
        for c in cands[1..].iter().filter(|c| c.cost <= floor + MARGIN) {
            rest[r] = *c;
            r += 1;
        }
        rest[..r].sort_unstable_by_key(|c| (c.cost, c.pos, c.from));
        self.n = 1 + r.min(BEAM - 1);
        for (slot, c) in self.beam[1..self.n].iter_mut().zip(&rest[..r]) {
            *slot = Hyp {
                pos: c.pos,
                cost: c.cost - floor,
                class: c.class,
            };
        }
        // A rival: another hypothesis at the best cost, or one of another class within a
        // key's head start. In an iteration with a key the beam does not close while
        // another class is a rival, however long the requests they share (module docs,
        // keyed iterations).
        let handicap = self.handicap;
        let rivals = &self.beam[1..self.n];
        let class_rival = rivals
            .iter()
            .any(|h| h.class != best.class && h.cost <= handicap);
        let rival = class_rival || rivals.iter().any(|h| h.cost == 0);
        if best.direct {
            self.streak = self.streak.saturating_add(1);
        } else {
            self.streak = 0;
        }
        let forced = self.streak >= 4 * CONFIRM && !(class_rival && self.key.is_some());
        if self.streak >= CONFIRM && !rival || forced {
            self.n = 1;
            self.handicap = 0;
        }
        self.stats.skipped += best.skipped;
        match best.matched {
            Some(j) => {
                if best.class == from_class {
                    self.note_consumed(best.class, from.min(j), j);
                } else {
                    // Another class took over (a branch's): its first iteration is the
                    // one a marker (or the load) already counted; only the starts it
                    // passed beyond are new.
                    let (p, l) = (self.p(), self.l_of(best.class));
                    if j >= p && l > 0 {
                        self.stats.iterations += (j - p) / l;
                    }
                }
                self.at_start = false;
                self.stats.hits += 1;
                self.matched_in(best.class, j)
            }
            None => {
                self.stats.unplanned += 1;
                None
            }
        }
    }

    /// Undoes the last hit's count as a hit: the engine found the range occupied.
    pub fn conflict(&mut self) {
        self.stats.hits = self.stats.hits.saturating_sub(1);
        self.stats.conflicts += 1;
    }

    /// Whether the cursor stands at an iteration start with nothing matched since (a
    /// boundary was just marked).
    pub fn at_iteration_start(&self) -> bool {
        self.at_start
    }

    /// The alignment now (not the statistics), for [`Cursor::resume`]: a phase the
    /// plan does not know (an eval pass between two iterations) is served beside the
    /// plan, and the run then goes on where it left the plan.
    pub fn bookmark(&self) -> Bookmark {
        Bookmark {
            beam: self.beam,
            n: self.n,
            streak: self.streak,
            at_start: self.at_start,
            base_tick: self.base_tick,
            handicap: self.handicap,
            lead: self.lead,
        }
    }

    /// Back to the alignment of `b` (module docs of `crate::engine::plan_serving`,
    /// phases).
    pub fn resume(&mut self, b: Bookmark) {
        self.beam = b.beam;
        self.n = b.n;
        self.streak = b.streak;
        self.at_start = b.at_start;
        self.base_tick = b.base_tick;
        self.handicap = b.handicap;
        self.lead = b.lead;
    }

    /// An iteration boundary (module docs: snap to the nearest iteration start); `key`:
    /// the key of the iteration that begins here, if it has one (module docs, keyed
    /// iterations).
    pub fn mark_iteration(&mut self, key: Option<u64>) {
        let (p, l) = (self.p(), self.l());
        if l == 0 {
            self.key = key;
            return;
        }
        let v = self.best();
        let target = if v < p {
            let near_end = p - v <= l / 2;
            let run_long_enough = self.seen + l / 2 >= p;
            if !(near_end || run_long_enough) {
                // A boundary the prologue spans: whatever follows is still the prologue.
                self.key = key;
                return;
            }
            self.stats.skipped += p - v;
            p
        } else {
            let (k, i) = ((v - p) / l, (v - p) % l);
            if i < l / 2 {
                p + k * l
            } else {
                self.stats.skipped += l - i;
                p + (k + 1) * l
            }
        };
        // A marker (or the load) already put the cursor at this very start: no new
        // iteration; with no request since, a marker without a key keeps the key the
        // first one gave.
        let repeat = self.at_start && target == v;
        let again = repeat && self.seen == self.seen_at_start;
        let key = if again { key.or(self.key) } else { key };
        // The iteration that ends here had a key: if at least half of its class's
        // requests matched (a hit, or a conflict: the range was busy, the class right),
        // the class it was served as is the key's.
        let c = self.class();
        if let Some(k) = self.key
            && !repeat
            && v >= p
            && self.classes.len() > 1
        {
            let served = self.served_class();
            let matched = self.matched_count().saturating_sub(self.matched_at_start);
            if 2 * matched >= self.l_of(served) {
                self.keys.learn(k, served);
            }
        }
        if !repeat {
            self.stats.iterations += 1;
        }
        // Positions start again at `P`, the clock where the target iteration starts
        // (module docs, iteration classes); then one hypothesis per class, the key's
        // class first if it is known, else the class just served.
        self.base_tick = self.vtick_in(c, target, 0);
        self.key = key;
        self.matched_at_start = self.matched_count();
        self.seen_at_start = self.seen;
        let hint = self.hint(key);
        if hint.is_some() && !(again && self.handicap > 0) {
            self.stats.hinted += 1;
        }
        self.branch(hint.unwrap_or(c), hint.is_some());
        self.streak = 0;
        self.at_start = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::{Bytes, DeviceId};

    /// Offsets name positions: prologue request `i` at `P0 + i`, iteration request `i`
    /// at `I0 + i` (in KiB).
    const P0: u64 = 1000;
    const I0: u64 = 2000;

    fn req(size: u64, offset: u64) -> PlannedRequest {
        PlannedRequest {
            size: Bytes(size),
            stream: StreamId(0),
            offset: Offset(offset << 10),
            start: 0,
            end: 1,
        }
    }

    fn plan(prologue: &[u64], iteration: &[u64]) -> Plan {
        Plan {
            device: DeviceId(0),
            alignment: Bytes(512),
            pool_size: Bytes(1 << 30),
            prologue: (0..).zip(prologue).map(|(i, &s)| req(s, P0 + i)).collect(),
            prologue_len: 2 * prologue.len() as u64,
            iteration: (0..).zip(iteration).map(|(i, &s)| req(s, I0 + i)).collect(),
            iteration_len: 2 * iteration.len() as u64,
            ..Plan::default()
        }
    }

    fn cursor(prologue: &[u64], iteration: &[u64], window: usize) -> Cursor {
        Cursor::new(&plan(prologue, iteration), window, &[])
    }

    /// The position a request was matched to: `P0 + i` / `I0 + i`, or `None`.
    fn at(c: &mut Cursor, size: u64) -> Option<u64> {
        c.next(size, StreamId(0)).map(|e| e.offset.get() >> 10)
    }

    fn run(c: &mut Cursor, sizes: &[u64]) -> Vec<Option<u64>> {
        sizes.iter().map(|&s| at(c, s)).collect()
    }

    /// Iteration positions `range`.
    fn its(range: std::ops::Range<u64>) -> Vec<Option<u64>> {
        range.map(|i| Some(I0 + i)).collect()
    }

    /// Class 1's request `i` at `J0 + i` (KiB).
    const J0: u64 = 3000;

    /// A plan without prologue of two classes, `a` (class 0) and `b`.
    fn two_classes(a: &[u64], b: &[u64]) -> Cursor {
        let mut p = plan(&[], a);
        p.extra_classes = vec![crate::plan::ClassSection {
            requests: (0..).zip(b).map(|(i, &s)| req(s, J0 + i)).collect(),
            len: 2 * b.len() as u64,
        }];
        Cursor::new(&p, 4, &[])
    }

    fn js(range: std::ops::Range<u64>) -> Vec<Option<u64>> {
        range.map(|i| Some(J0 + i)).collect()
    }

    #[test]
    fn each_iteration_follows_the_class_its_first_requests_show() {
        let (a, b) = ([10, 11, 12, 13], [20, 21, 22]);
        let mut c = two_classes(&a, &b);
        // Loaded at an iteration start (a switch): either class may come first.
        assert_eq!(run(&mut c, &b), js(0..3));
        assert_eq!(c.class(), 1);
        for _ in 0..3 {
            c.mark_iteration(None);
            assert_eq!(run(&mut c, &a), its(0..4));
            assert_eq!(c.class(), 0);
            c.mark_iteration(None);
            assert_eq!(run(&mut c, &b), js(0..3));
            c.mark_iteration(None);
            assert_eq!(run(&mut c, &b), js(0..3));
        }
        assert_eq!(c.stats.hits, 3 + 3 * 10);
        assert_eq!((c.stats.unplanned, c.stats.skipped), (0, 0));
        assert_eq!(c.stats.iterations, 10);
    }

    #[test]
    fn classes_sharing_their_first_requests_are_told_apart_by_the_next() {
        // Both classes begin with 5, 6; the class just served is the guess until 9.
        let (a, b) = ([5, 6, 7, 8], [5, 6, 9, 10, 11]);
        let mut c = two_classes(&a, &b);
        assert_eq!(run(&mut c, &a), its(0..4));
        c.mark_iteration(None);
        let got = run(&mut c, &b);
        // The shared prefix went to class 0's places (the wrong guess: at worst a
        // conflict for the engine), the rest to class 1's.
        assert_eq!(got[..2], its(0..2)[..]);
        assert_eq!(got[2..], js(2..5)[..]);
        assert_eq!(c.class(), 1);
        // Two iterations (the load's and the marker's): the change of class adds none.
        assert_eq!(c.stats.iterations, 2);
    }

    /// Runs `iters` (class 0 = `a`, 1 = `b`; each with its key when `keyed`) after a
    /// marker each; returns how many requests went to their own class's planned place.
    fn served_right(c: &mut Cursor, a: &[u64], b: &[u64], iters: &[u32], keyed: bool) -> usize {
        let mut right = 0;
        for &k in iters {
            c.mark_iteration(keyed.then_some(100 + u64::from(k)));
            let (seq, want) = if k == 0 {
                (a, its(0..a.len() as u64))
            } else {
                (b, js(0..b.len() as u64))
            };
            let got = run(c, seq);
            right += got.iter().zip(&want).filter(|(g, w)| g == w).count();
        }
        right
    }

    #[test]
    fn a_key_tells_apart_classes_that_share_their_first_requests() {
        // Alternating classes that begin alike: unkeyed, the class just served takes the
        // shared prefix of every iteration (the wrong one); keyed, once each key was seen,
        // the key's class does.
        let (a, b) = ([5, 6, 7, 8], [5, 6, 9, 10, 11]);
        let iters: Vec<u32> = (0..20).map(|i| i % 2).collect();
        let mut plain = two_classes(&a, &b);
        let unkeyed = served_right(&mut plain, &a, &b, &iters, false);
        let mut keyed = two_classes(&a, &b);
        let with_keys = served_right(&mut keyed, &a, &b, &iters, true);
        let all = 10 * (a.len() + b.len());
        // Unkeyed: the prefix of every iteration but the first wrong (2 × 19).
        assert_eq!(unkeyed, all - 2 * 19);
        // Keyed: wrong only where a key was new (the second iteration).
        assert_eq!(with_keys, all - 2);
        assert_eq!(keyed.stats.hinted, 18);
        assert_eq!((plain.stats.hinted, plain.stats.unplanned), (0, 0));
        assert_eq!(keyed.stats.unplanned, 0);
    }

    #[test]
    fn a_key_keeps_the_beam_open_past_a_long_shared_prefix() {
        // 15 shared requests: unkeyed, the beam closes on the class just served after
        // 4 · CONFIRM matches, and the other class's last requests match nothing.
        let shared: Vec<u64> = (1..=15).collect();
        let a: Vec<u64> = shared.iter().copied().chain([100]).collect();
        let b: Vec<u64> = shared.iter().copied().chain([200, 201]).collect();
        let iters = [0, 1, 0, 1, 0, 1];
        let mut plain = two_classes(&a, &b);
        let unkeyed = served_right(&mut plain, &a, &b, &iters, false);
        let mut keyed = two_classes(&a, &b);
        let with_keys = served_right(&mut keyed, &a, &b, &iters, true);
        let all = 3 * (a.len() + b.len());
        assert!(unkeyed < all / 2, "{unkeyed} of {all}");
        // Keyed: the beam stays open over the shared prefix while another class ties;
        // only the second iteration's prefix (key 101 still new) is wrong.
        assert_eq!(with_keys, all - 15, "{:?}", keyed.stats);
    }

    #[test]
    fn a_wrong_key_costs_one_unplanned_request_then_the_right_class_serves() {
        let (a, b) = ([5, 6, 7, 8], [5, 6, 9, 10, 11]);
        let mut c = two_classes(&a, &b);
        // Key 7 is learned as class 0.
        c.mark_iteration(Some(7));
        assert_eq!(run(&mut c, &a), its(0..4));
        // Then an iteration of class 1 with key 7: the shared prefix at class 0's places
        // (as an unkeyed guess would), one request unplanned while class 0 keeps its
        // head start, then class 1's places.
        c.mark_iteration(Some(7));
        assert_eq!(c.stats.hinted, 1);
        let got = run(&mut c, &b);
        assert_eq!(
            got,
            vec![Some(I0), Some(I0 + 1), None, Some(J0 + 3), Some(J0 + 4)]
        );
        assert_eq!(c.class(), 1);
        assert_eq!(c.stats.unplanned, 1);
        // Key 7's iteration was served as class 1 (3 of 5 hits): the key now says 1.
        c.mark_iteration(Some(7));
        assert_eq!(run(&mut c, &b), js(0..5));
    }

    #[test]
    fn a_wrong_key_is_corrected_even_when_the_classes_differ_only_in_the_last_request() {
        // Key 7 is first class 0's, then always class 1's, which differs from class 0
        // only in its last request: the iteration ends while class 0 still leads by its
        // head start, but without it class 1 would: key 7 is learned as class 1.
        let (a, b) = ([5, 6, 7], [5, 6, 9]);
        let mut c = two_classes(&a, &b);
        c.mark_iteration(Some(7));
        assert_eq!(run(&mut c, &a), its(0..3));
        c.mark_iteration(Some(7));
        assert_eq!(run(&mut c, &b), vec![Some(I0), Some(I0 + 1), None]);
        c.mark_iteration(Some(7));
        assert_eq!(run(&mut c, &b), js(0..3));
        assert_eq!(c.stats.hinted, 2);
    }

    #[test]
    fn a_key_is_learned_only_from_a_well_served_iteration() {
        let (a, b) = ([5, 6, 7, 8], [5, 6, 9, 10, 11]);
        let mut c = two_classes(&a, &b);
        assert_eq!(run(&mut c, &a), its(0..4));
        // Key 9's iteration matches nothing: nothing learned.
        c.mark_iteration(Some(9));
        assert_eq!(run(&mut c, &[70, 71, 72, 73]), vec![None; 4]);
        c.mark_iteration(None);
        // An unkeyed iteration teaches nothing either.
        assert_eq!(
            run(&mut c, &b),
            js(0..5)
                .into_iter()
                .enumerate()
                .map(|(i, j)| if i < 2 { Some(I0 + i as u64) } else { j })
                .collect::<Vec<_>>()
        );
        c.mark_iteration(Some(9));
        assert_eq!(c.stats.hinted, 0);
    }

    #[test]
    fn a_key_given_at_the_iteration_start_seeds_the_guess_later_only_teaches() {
        let (a, b) = ([5, 6, 7, 8], [5, 6, 9, 10, 11]);
        let mut c = two_classes(&a, &b);
        // Key 1 still unknown: the class just served (0) takes the shared prefix.
        c.mark_iteration(None);
        c.set_key(1);
        let got = run(&mut c, &b);
        assert_eq!(got[..2], its(0..2)[..]);
        assert_eq!(got[2..], js(2..5)[..]);
        c.mark_iteration(None);
        c.set_key(0);
        let got = run(&mut c, &a);
        assert_eq!(got[..2], js(0..2)[..]);
        assert_eq!(got[2..], its(2..4)[..]);
        assert_eq!(c.stats.hinted, 0);
        // Both keys known: given at the start, the key's class serves the shared prefix.
        c.mark_iteration(None);
        c.set_key(1);
        assert_eq!(run(&mut c, &b), js(0..5));
        assert_eq!(c.stats.hinted, 1);
        // A repeated unkeyed marker at the same start keeps the key.
        c.mark_iteration(Some(0));
        c.mark_iteration(None);
        assert_eq!(run(&mut c, &a), its(0..4));
        assert_eq!(c.stats.hinted, 2);
        // Given after the first request, a key changes nothing for this iteration.
        c.mark_iteration(None);
        assert_eq!(at(&mut c, 5), Some(I0));
        c.set_key(1);
        assert_eq!(c.stats.hinted, 2);
        assert_eq!(run(&mut c, &[6, 7, 8]), its(1..4));
    }

    #[test]
    fn keys_change_nothing_in_a_plan_of_one_class() {
        let it = [5, 6, 7, 8];
        let mut plain = cursor(&[1], &it, 4);
        let mut keyed = cursor(&[1], &it, 4);
        let seq = [1, 5, 6, 7, 8, 5, 6, 99, 8, 5, 7, 8];
        for (k, &s) in seq.iter().enumerate() {
            if k % 4 == 1 {
                plain.mark_iteration(None);
                keyed.mark_iteration(Some(k as u64 % 3));
                keyed.set_key(7);
            }
            assert_eq!(at(&mut plain, s), at(&mut keyed, s));
        }
        assert_eq!(plain.stats, keyed.stats);
        assert_eq!(keyed.stats.hinted, 0);
    }

    #[test]
    fn keys_follow_their_classes_into_a_plan_that_replaces_this_one() {
        let (a, b) = ([5, 6, 7, 8], [5, 6, 9, 10, 11]);
        let mut c = two_classes(&a, &b);
        for (k, seq) in [(0, &a[..]), (1, &b[..])] {
            c.mark_iteration(Some(k));
            let _ = run(&mut c, seq);
        }
        c.mark_iteration(None);
        let learned = c.learned_keys().expect("two keys learned");
        // The same classes in the other order, and a third: key 1 is class 0 now.
        let mut p = plan(&[], &b);
        p.extra_classes = [&a[..], &[70, 71][..]]
            .iter()
            .map(|s| crate::plan::ClassSection {
                requests: (0..).zip(*s).map(|(i, &x)| req(x, J0 + i)).collect(),
                len: 2 * s.len() as u64,
            })
            .collect();
        let mut d = Cursor::new(&p, 4, &[]);
        d.adopt_keys(&learned);
        d.set_key(0);
        assert_eq!(d.stats.hinted, 1);
        assert_eq!(run(&mut d, &a), js(0..4));
        d.mark_iteration(Some(1));
        assert_eq!(run(&mut d, &b), its(0..5));
        assert_eq!(d.stats.hinted, 2);
        assert!(cursor(&[], &a, 4).learned_keys().is_none());
    }

    #[test]
    fn the_key_map_keeps_the_most_recently_used_keys() {
        let mut m = KeyClasses::new();
        for k in 0..MAX_KEYS as u64 {
            m.learn(k, (k % 3) as u32);
        }
        assert_eq!(m.get(0), Some(0)); // used: key 1 is now the oldest
        m.learn(1000, 2);
        assert_eq!(m.get(1), None);
        assert_eq!(
            (m.get(0), m.get(2), m.get(1000)),
            (Some(0), Some(2), Some(2))
        );
        m.learn(2, 1);
        assert_eq!(m.get(2), Some(1));
        assert_eq!(m.n, MAX_KEYS);
    }

    #[test]
    fn the_virtual_clock_counts_on_across_classes_of_other_lengths() {
        // Every request lives over [0, 1) of its iteration; class 0 is 8 ticks long,
        // class 1 6: iterations a, b, b, a, b start at ticks 0, 8, 14, 20, 28.
        let (a, b) = ([10, 11, 12, 13], [20, 21, 22]);
        let mut c = two_classes(&a, &b);
        let mut ends = Vec::new();
        for seq in [&a[..], &b[..], &b[..], &a[..], &b[..]] {
            let v: Vec<u64> = seq
                .iter()
                .map(|&s| c.next(s, StreamId(0)).expect("planned").vend)
                .collect();
            assert!(v.iter().all(|&e| e == v[0]), "{v:?}");
            ends.push(v[0]);
            c.mark_iteration(None);
        }
        assert_eq!(ends, [1, 9, 15, 21, 29]);
    }

    #[test]
    fn an_unmarked_eval_pass_is_followed_by_a_restart_at_the_iteration_start() {
        // Forward 10..13, backward 20..27. After the boundary, two eval forwards (no
        // backward), then the training iteration: its forward goes back to the start.
        let fwd = [10, 11, 12, 13];
        let it: Vec<u64> = fwd.iter().copied().chain(20..28).collect();
        let mut c = cursor(&[], &it, 4);
        c.mark_iteration(None);
        let _ = run(&mut c, &fwd);
        let _ = run(&mut c, &fwd);
        // Served as extra until the restart's cost is paid back (3 requests), then at
        // their planned places to the iteration's end.
        let got = run(&mut c, &it);
        assert_eq!(got[..3], [None, None, None]);
        assert_eq!(got[3..], its(3..12)[..]);
        // A restart is not taken from the iteration's second half (checkpointing's
        // recomputed forwards in backward look like a forward too).
        c.mark_iteration(None);
        let _ = run(&mut c, &it[..8]);
        assert_eq!(run(&mut c, &[10]), vec![None]);
    }

    #[test]
    fn follows_prologue_then_repeats_the_iteration() {
        let mut c = cursor(&[1, 2], &[3, 4], 4);
        let got = run(&mut c, &[1, 2, 3, 4, 3, 4, 3]);
        let want = [P0, P0 + 1, I0, I0 + 1, I0, I0 + 1, I0].map(Some);
        assert_eq!(got, want);
        assert_eq!(c.stats.hits, 7);
        assert_eq!(c.stats.iterations, 3);
        assert_eq!(c.next(3, StreamId(1)), None, "other stream");
        assert_eq!(c.stats.unplanned, 1);
    }

    #[test]
    fn an_extra_request_costs_only_itself_even_with_a_size_seen_ahead() {
        // The extra request has the size of one three ahead: greedy matching would
        // jump there and lose 6 and 7.
        let it = [5, 6, 7, 8, 9, 10, 11, 12];
        let mut c = cursor(&[], &it, 8);
        assert_eq!(at(&mut c, 5), Some(I0));
        let extra = at(&mut c, 8);
        assert!(extra.is_none() || extra == Some(I0 + 3), "{extra:?}");
        assert_eq!(run(&mut c, &[6, 7, 8, 9, 10]), its(1..6));
        assert_eq!(c.stats.skipped, 0);
        // And an extra request of a size the plan never has.
        assert_eq!(at(&mut c, 99), None);
        assert_eq!(run(&mut c, &[11, 12, 5]), [I0 + 6, I0 + 7, I0].map(Some));
    }

    #[test]
    fn missing_and_resized_requests_are_skipped() {
        let it = [5, 6, 7, 8, 9, 10];
        let mut c = cursor(&[], &it, 8);
        assert_eq!(run(&mut c, &[5, 7, 8]), [I0, I0 + 2, I0 + 3].map(Some)); // 6 never came
        assert_eq!(c.stats.skipped, 1);
        // 9 comes as 77: unplanned, then 10 is found one further.
        assert_eq!(at(&mut c, 77), None);
        assert_eq!(run(&mut c, &[10, 5, 6]), [I0 + 5, I0, I0 + 1].map(Some));
        assert_eq!(c.stats.skipped, 2);
        assert_eq!(c.stats.unplanned, 1);
    }

    #[test]
    fn repeated_sizes_do_not_cascade() {
        // Six layers of the same three sizes, then a last one.
        let it: Vec<u64> = (0..6).flat_map(|_| [1, 2, 3]).chain([4]).collect();
        let n = it.len() as u64;
        for (extra_at, extra) in [(2, 2u64), (4, 1), (7, 3)] {
            let mut c = cursor(&[], &it, 16);
            let mut got = run(&mut c, &it[..extra_at]);
            let x = at(&mut c, extra);
            got.extend(run(&mut c, &it[extra_at..]));
            // Every real request but at most one next to the extra one keeps its slot.
            let right = got.iter().zip(its(0..n)).filter(|(g, w)| *g == w).count();
            assert!(
                right + 1 >= it.len(),
                "extra {extra} at {extra_at}: {x:?} {got:?}"
            );
            assert_eq!(c.position(), (Section::Iteration, it.len()));
            // The next iteration starts cleanly.
            assert_eq!(run(&mut c, &it[..4]), its(0..4));
        }
    }

    #[test]
    fn a_long_departure_resumes_where_it_left() {
        let it: Vec<u64> = (1..=40).collect();
        let mut c = cursor(&[], &it, 16);
        assert_eq!(run(&mut c, &it[..10]), its(0..10));
        // An eval pass: 500 requests, most of sizes the plan does not have.
        for k in 0..500 {
            let size = if k % 50 == 7 { 30 } else { 1000 + k % 37 };
            let _ = at(&mut c, size);
        }
        assert_eq!(run(&mut c, &it[10..]), its(10..40));
        assert_eq!(c.stats.skipped, 0);
    }

    #[test]
    fn look_ahead_runs_across_the_end_of_an_iteration() {
        let it = [5, 6, 7, 8];
        let mut c = cursor(&[1, 2], &it, 4);
        // The prologue's last request and the iteration's last never come; no markers.
        let got = run(&mut c, &[1, 5, 6, 7, 5, 6]);
        let want = [P0, I0, I0 + 1, I0 + 2, I0, I0 + 1].map(Some);
        assert_eq!(got, want);
        assert_eq!(c.stats.skipped, 2);
        assert_eq!(c.stats.iterations, 2);
    }

    #[test]
    fn markers_snap_to_the_nearest_iteration_start() {
        let it: Vec<u64> = (10..20).collect();
        let mut c = cursor(&[1, 2], &it, 4);
        assert_eq!(run(&mut c, &[1, 2]), [P0, P0 + 1].map(Some));
        c.mark_iteration(None); // prologue done: steady state starts
        assert_eq!(c.position(), (Section::Iteration, 0));
        assert_eq!(c.stats.iterations, 1);
        c.mark_iteration(None); // twice at the same start: nothing new
        assert_eq!(c.stats.iterations, 1);
        assert_eq!(run(&mut c, &it[..7]), its(0..7));
        c.mark_iteration(None); // cut short at 7 of 10: forward
        assert_eq!(c.position(), (Section::Iteration, 0));
        assert_eq!(c.stats.skipped, 3);
        assert_eq!(run(&mut c, &it), its(0..10));
        assert_eq!(c.position(), (Section::Iteration, 10));
        // Ran ahead: the start of the next iteration was matched before its marker.
        assert_eq!(run(&mut c, &[10, 11]), its(0..2));
        c.mark_iteration(None);
        assert_eq!(c.position(), (Section::Iteration, 0));
        assert_eq!(run(&mut c, &[10]), its(0..1));
        assert_eq!(c.stats.iterations, 4);
        c.conflict();
        assert_eq!(c.stats.conflicts, 1);
    }

    #[test]
    fn an_unfinished_prologue_is_left_at_a_marker_once_the_run_is_long_enough() {
        let pro: Vec<u64> = (100..140).collect();
        let it: Vec<u64> = (1..=10).collect();
        let mut c = cursor(&pro, &it, 4);
        // A marker early in the prologue is one the prologue spans.
        assert_eq!(run(&mut c, &pro[..5]).iter().flatten().count(), 5);
        c.mark_iteration(None);
        assert_eq!(c.position(), (Section::Prologue, 5));
        // The run does its own setup (other sizes), then starts iterating.
        for k in 0..40 {
            assert_eq!(at(&mut c, 5000 + k), None);
        }
        c.mark_iteration(None);
        assert_eq!(c.position(), (Section::Iteration, 0));
        assert_eq!(run(&mut c, &it), its(0..10));
    }

    #[test]
    fn a_plan_without_iterations_stops_after_the_prologue() {
        let mut c = cursor(&[1], &[], 4);
        assert_eq!(at(&mut c, 1), Some(P0));
        assert_eq!(at(&mut c, 1), None);
        c.mark_iteration(None);
        assert_eq!(at(&mut c, 1), None);
        assert_eq!(c.upcoming(4).count(), 0);
    }

    #[test]
    fn upcoming_lists_the_next_expected_requests_across_sections() {
        let c = cursor(&[1, 2], &[3, 4], 4);
        let sizes: Vec<u64> = c.upcoming(7).map(|e| e.size).collect();
        assert_eq!(sizes, [1, 2, 3, 4, 3, 4, 3]);
    }
}
