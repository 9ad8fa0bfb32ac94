//! Plan mode: following the plan's request sequence at run time.
//!
//! A [`Cursor`] walks the expected requests of a [`Plan`] — the prologue once, then the
//! iteration section over and over — and answers, for each incoming request, the
//! planned offset or "not planned".
//!
//! # Matching and resynchronisation
//!
//! A request `(size, stream)` is matched against the next expected requests, **up to
//! `window` ahead**: the first one with the same requested size and stream wins, the
//! expected requests before it are counted as *skipped* (they did not happen, or came
//! in another order), and the cursor moves past the match. With no match in the window
//! the request is *unplanned* and the cursor stays where it is, so an extra request
//! (a one-off buffer, a logging tensor, an eval step) costs exactly one fallback
//! allocation instead of shifting every later match — the failure of purely positional
//! matching (`research/stalloc-reference.md` §4.4, §7.1).
//!
//! Iteration boundaries resynchronise: [`Cursor::mark_iteration`] (the framework's
//! `IterationBegin` marker, where the planner cuts iterations) puts the cursor at the
//! start of the iteration section, whatever happened in the one before; the prologue
//! ends at the first marker after its last expected request. Without markers the
//! cursor rolls over to the next iteration when it passes the end of one.
//!
//! A match is only a proposal: the engine hands out the planned offset only after
//! checking that nothing live occupies it (see [`crate::engine`]). The plan itself is
//! never mutated; the cursor copies what it needs once at load.
//!
//! Cost: O(window) per request in the worst case, O(1) when the run follows the plan.

use crate::plan::Plan;
use crate::units::{Offset, StreamId};

/// What plan serving has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Requests that matched an expected request and got its planned offset.
    pub hits: u64,
    /// Requests that matched, but whose planned range was occupied (served online).
    pub conflicts: u64,
    /// Requests that matched nothing in the look-ahead window (served online).
    pub unplanned: u64,
    /// Expected requests passed over by a match further ahead, or left over at an
    /// iteration boundary.
    pub skipped: u64,
    /// Iterations started (the prologue counts as none).
    pub iterations: u64,
}

/// Which section the cursor is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Prologue,
    Iteration,
}

#[derive(Debug, Clone, Copy)]
struct Expected {
    size: u64,
    stream: StreamId,
    offset: Offset,
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub(crate) struct Cursor {
    prologue: Vec<Expected>,
    iteration: Vec<Expected>,
    section: Section,
    pos: usize,
    window: usize,
    pub stats: PlanStats,
}

fn expected(reqs: &[crate::plan::PlannedRequest]) -> Vec<Expected> {
    reqs.iter()
        .map(|r| Expected {
            size: r.size.get(),
            stream: r.stream,
            offset: r.offset,
        })
        .collect()
}

impl Cursor {
    /// A cursor at the start of `plan`'s prologue (or of its iteration section when
    /// the prologue is empty), looking `window ≥ 1` requests ahead.
    pub fn new(plan: &Plan, window: usize) -> Cursor {
        let prologue = expected(&plan.prologue);
        let section = if prologue.is_empty() {
            Section::Iteration
        } else {
            Section::Prologue
        };
        Cursor {
            prologue,
            iteration: expected(&plan.iteration),
            section,
            pos: 0,
            window: window.max(1),
            stats: PlanStats {
                iterations: u64::from(section == Section::Iteration),
                ..PlanStats::default()
            },
        }
    }

    /// Where the cursor is: section and index of the next expected request.
    pub fn position(&self) -> (Section, usize) {
        (self.section, self.pos)
    }

    fn current(&self) -> &[Expected] {
        match self.section {
            Section::Prologue => &self.prologue,
            Section::Iteration => &self.iteration,
        }
    }

    /// Past the end of a section: go on with the (next) iteration.
    fn roll(&mut self) {
        if self.pos >= self.current().len() && !self.iteration.is_empty() {
            self.section = Section::Iteration;
            self.pos = 0;
            self.stats.iterations += 1;
        }
    }

    /// The planned offset for a request of `size` requested bytes on `stream`, or
    /// `None` if the request is not planned (see the module documentation).
    pub fn next(&mut self, size: u64, stream: StreamId) -> Option<Offset> {
        self.roll();
        let reqs = self.current();
        let end = reqs.len().min(self.pos.saturating_add(self.window));
        let found = (self.pos..end).find(|&j| reqs[j].size == size && reqs[j].stream == stream);
        match found {
            Some(j) => {
                let offset = reqs[j].offset;
                self.stats.skipped += (j - self.pos) as u64;
                self.stats.hits += 1;
                self.pos = j + 1;
                Some(offset)
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

    /// An iteration boundary: resynchronise to the start of the iteration section.
    /// Inside the prologue (expected requests left) it is a boundary the prologue
    /// itself spans, and changes nothing.
    pub fn mark_iteration(&mut self) {
        if self.iteration.is_empty() {
            return;
        }
        match self.section {
            Section::Prologue if self.pos < self.prologue.len() => {}
            Section::Prologue => {
                self.section = Section::Iteration;
                self.pos = 0;
                self.stats.iterations += 1;
            }
            Section::Iteration if self.pos == 0 => {}
            Section::Iteration => {
                self.stats.skipped += (self.iteration.len() - self.pos) as u64;
                self.pos = 0;
                self.stats.iterations += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::PlannedRequest;
    use crate::units::{Bytes, DeviceId};

    fn req(size: u64, offset: u64) -> PlannedRequest {
        PlannedRequest {
            size: Bytes(size),
            stream: StreamId(0),
            offset: Offset(offset),
            start: 0,
            end: 1,
        }
    }

    fn plan(prologue: &[u64], iteration: &[u64]) -> Plan {
        Plan {
            device: DeviceId(0),
            alignment: Bytes(512),
            pool_size: Bytes(1 << 20),
            prologue: prologue.iter().map(|&s| req(s, s * 10)).collect(),
            prologue_len: 2 * prologue.len() as u64,
            iteration: iteration.iter().map(|&s| req(s, s * 10)).collect(),
            iteration_len: 2 * iteration.len() as u64,
            ..Plan::default()
        }
    }

    fn off(c: &mut Cursor, size: u64) -> Option<u64> {
        c.next(size, StreamId(0)).map(Offset::get)
    }

    #[test]
    fn follows_prologue_then_repeats_the_iteration() {
        let mut c = Cursor::new(&plan(&[1, 2], &[3, 4]), 4);
        let got: Vec<Option<u64>> = [1, 2, 3, 4, 3, 4, 3]
            .iter()
            .map(|&s| off(&mut c, s))
            .collect();
        assert_eq!(got, [10, 20, 30, 40, 30, 40, 30].map(Some));
        assert_eq!(c.stats.hits, 7);
        assert_eq!(c.stats.iterations, 3);
        assert_eq!(c.next(3, StreamId(1)), None, "other stream");
    }

    #[test]
    fn an_extra_request_does_not_shift_later_matches() {
        let mut c = Cursor::new(&plan(&[], &[5, 6, 7, 8]), 8);
        assert_eq!(off(&mut c, 5), Some(50));
        assert_eq!(off(&mut c, 99), None); // one-off, unplanned
        assert_eq!(off(&mut c, 6), Some(60));
        assert_eq!(off(&mut c, 7), Some(70));
        assert_eq!(c.stats.unplanned, 1);
        assert_eq!(c.stats.skipped, 0);
    }

    #[test]
    fn a_missing_request_is_skipped() {
        let mut c = Cursor::new(&plan(&[], &[5, 6, 7, 8]), 8);
        assert_eq!(off(&mut c, 5), Some(50));
        assert_eq!(off(&mut c, 7), Some(70)); // 6 never came
        assert_eq!(off(&mut c, 8), Some(80));
        assert_eq!(off(&mut c, 5), Some(50)); // next iteration
        assert_eq!(c.stats.skipped, 1);
    }

    #[test]
    fn the_window_bounds_the_look_ahead() {
        let mut c = Cursor::new(&plan(&[], &[1, 2, 3, 4, 5]), 2);
        assert_eq!(off(&mut c, 4), None);
        assert_eq!(off(&mut c, 2), Some(20));
    }

    #[test]
    fn markers_resynchronise() {
        let mut c = Cursor::new(&plan(&[1, 2], &[3, 4, 5]), 8);
        assert_eq!(off(&mut c, 1), Some(10));
        c.mark_iteration(); // inside the prologue: a boundary it spans
        assert_eq!(c.position(), (Section::Prologue, 1));
        assert_eq!(off(&mut c, 2), Some(20));
        c.mark_iteration(); // prologue done: steady state starts
        assert_eq!(c.position(), (Section::Iteration, 0));
        assert_eq!(off(&mut c, 3), Some(30));
        c.mark_iteration(); // short iteration: 4 and 5 never came
        assert_eq!(c.stats.skipped, 2);
        assert_eq!(off(&mut c, 3), Some(30));
        assert_eq!(off(&mut c, 4), Some(40));
        assert_eq!(off(&mut c, 5), Some(50));
        c.mark_iteration();
        assert_eq!(c.position(), (Section::Iteration, 0));
        assert_eq!(c.stats.iterations, 3);
        c.conflict();
        assert_eq!((c.stats.hits, c.stats.conflicts), (5, 1));
    }

    #[test]
    fn a_plan_without_iterations_stops_after_the_prologue() {
        let mut c = Cursor::new(&plan(&[1], &[]), 4);
        assert_eq!(off(&mut c, 1), Some(10));
        assert_eq!(off(&mut c, 1), None);
        c.mark_iteration();
        assert_eq!(off(&mut c, 1), None);
    }
}
