//! Exact search: does a packing under a given capacity exist? (minimalloc's algorithm)
//!
//! A depth-first branch and bound over *canonical* solutions (Moffitt, ASPLOS '23):
//! buffers are placed in non-decreasing offset order, ties in a fixed pre-order, each
//! at its current minimum offset (the top of the highest placed buffer it conflicts
//! with, pushed over fixed obstacles). Every packing can be pushed down into such a
//! form, so the search is complete. Pruning:
//!
//! - **dominance**: a buffer is never placed at or above the height where some other
//!   unplaced buffer would fit entirely below it (that gap could not be filled later);
//! - **section inference**: in every time slot, the unplaced bytes must fit between the
//!   slot's floor (its highest placed top, or the lowest minimum offset of its unplaced
//!   buffers, or the current offset) and the capacity, less fixed obstacles there;
//! - **symmetry**: identical buffers (same lifetime, size, alignment) are placed in
//!   pre-order only;
//! - **dynamic decomposition**: when no unplaced buffer crosses a slot boundary any
//!   more, the two sides are solved independently (linear time only).
//!
//! Candidates are ordered by (minimum offset, pre-order); pre-orders are minimalloc's
//! `WAT`/`TAW`/`TWA` keys (length, area, section total). State changes are undone from
//! logs, so a node costs O(n + slots + the placed buffer's overlaps and sections).
//! Fixed obstacles make the same search a large-neighbourhood move: free a window of
//! buffers, keep the rest, and ask for a lower capacity.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::bestfit::align_up;
use super::problem::Problem;

/// Address ranges that free buffers must avoid, in the problem's slot coordinates.
#[derive(Debug, Clone, Default)]
pub(crate) struct Obstacles {
    /// Per free buffer: sorted, disjoint `[lo, hi)` ranges it may not overlap.
    pub per_buffer: Vec<Vec<(u64, u64)>>,
    /// Per slot: sorted, disjoint ranges occupied by obstacles in that slot.
    pub per_slot: Vec<Vec<(u64, u64)>>,
}

/// The static buffer pre-order of a search.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Preorder {
    Wat,
    Taw,
    Twa,
    /// Size, length, area.
    Zwa,
}

impl Preorder {
    pub const ALL: [Preorder; 4] = [Preorder::Wat, Preorder::Taw, Preorder::Twa, Preorder::Zwa];
}

/// How a search ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A packing under the capacity: offsets of the free buffers.
    Found(Vec<u64>),
    /// Proven: none exists.
    Infeasible,
    /// The node limit, deadline or cancellation stopped it.
    Stopped,
}

/// When a search must stop.
#[derive(Clone, Copy)]
pub(crate) struct Limits<'a> {
    pub nodes: u64,
    pub deadline: Option<Instant>,
    pub cancel: Option<&'a AtomicBool>,
}

/// Compressed sparse rows.
#[derive(Debug, Clone, Default)]
struct Csr {
    start: Vec<u32>,
    items: Vec<u32>,
}

impl Csr {
    #[inline]
    fn row(&self, i: usize) -> &[u32] {
        &self.items[self.start[i] as usize..self.start[i + 1] as usize]
    }
}

/// Everything about a problem that does not change during search.
pub(crate) struct Exact<'p> {
    p: &'p Problem,
    size: Vec<u64>,
    align: Vec<u64>,
    /// Free buffers conflicting with each free buffer.
    overlaps: Csr,
    /// Buffers live in each slot.
    slot_bufs: Csr,
    /// Slots of each buffer.
    buf_slots: Csr,
    /// Per slot: total size of its buffers.
    slot_total: Vec<u64>,
    obstacles: Option<SlotObstacles>,
    per_buffer_obstacles: Vec<Vec<(u64, u64)>>,
    /// Identical buffers form chains; `twin[i]` is the previous member of `i`'s chain
    /// in index order (`u32::MAX` if none).
    twin_prev: Vec<u32>,
    /// Some buffer has two spans (no decomposition then: a wrapped buffer joins the
    /// two ends of the slot line).
    wrapped: bool,
    /// Lower bound of the free problem alone (max slot total).
    pub lower_bound: u64,
}

/// Per-slot obstacle ranges with suffix sums of their lengths.
struct SlotObstacles {
    ranges: Vec<Vec<(u64, u64)>>,
    suffix: Vec<Vec<u64>>,
}

impl SlotObstacles {
    /// Obstacle bytes above `f` in slot `s`.
    #[inline]
    fn above(&self, s: usize, f: u64) -> u64 {
        let r = &self.ranges[s];
        if r.is_empty() {
            return 0;
        }
        let k = r.partition_point(|&(_, hi)| hi <= f);
        if k == r.len() {
            return 0;
        }
        let cut = f.saturating_sub(r[k].0);
        self.suffix[s][k] - cut
    }
}

impl<'p> Exact<'p> {
    /// Precomputes conflict lists and slot membership: O(n log n + Σ slots per buffer ×
    /// buffers per slot).
    pub fn new(p: &'p Problem, obstacles: Option<Obstacles>) -> Exact<'p> {
        let n = p.len();
        let slots = p.slots as usize;
        // Slots of each buffer, buffers of each slot.
        let mut buf_slots = Csr {
            start: Vec::with_capacity(n + 1),
            items: Vec::new(),
        };
        buf_slots.start.push(0);
        let mut count = vec![0u32; slots + 1];
        for i in 0..n {
            for s in p.spans(i) {
                for t in s.lo..s.hi {
                    buf_slots.items.push(t);
                    count[t as usize + 1] += 1;
                }
            }
            buf_slots.start.push(buf_slots.items.len() as u32);
        }
        for t in 0..slots {
            count[t + 1] += count[t];
        }
        let mut slot_bufs = Csr {
            start: count.clone(),
            items: vec![0; buf_slots.items.len()],
        };
        let mut fill = count;
        for i in 0..n {
            for &t in buf_slots.row(i) {
                slot_bufs.items[fill[t as usize] as usize] = i as u32;
                fill[t as usize] += 1;
            }
        }
        // Overlaps: the union of the buffer's slots' members.
        let mut overlaps = Csr {
            start: Vec::with_capacity(n + 1),
            items: Vec::new(),
        };
        overlaps.start.push(0);
        let mut stamp = vec![u32::MAX; n];
        for i in 0..n {
            stamp[i] = i as u32;
            for &t in buf_slots.row(i) {
                for &j in slot_bufs.row(t as usize) {
                    if stamp[j as usize] != i as u32 {
                        stamp[j as usize] = i as u32;
                        overlaps.items.push(j);
                    }
                }
            }
            overlaps.start.push(overlaps.items.len() as u32);
        }
        let size: Vec<u64> = (0..n).map(|i| p.size(i)).collect();
        let align: Vec<u64> = (0..n).map(|i| p.align(i)).collect();
        let slot_total: Vec<u64> = (0..slots)
            .map(|t| slot_bufs.row(t).iter().map(|&i| size[i as usize]).sum())
            .collect();
        let lower_bound = slot_total.iter().copied().max().unwrap_or(0);
        // Identical buffers.
        // (size, alignment, lifetime spans, index): equal keys are identical buffers.
        type Key = (u64, u64, [(u32, u32); 2], u32);
        let mut keyed: Vec<Key> = (0..n)
            .map(|i| {
                let mut sp = [(0, 0); 2];
                for (k, s) in p.spans(i).iter().enumerate() {
                    sp[k] = (s.lo, s.hi);
                }
                (size[i], align[i], sp, i as u32)
            })
            .collect();
        keyed.sort_unstable();
        let mut twin_prev = vec![u32::MAX; n];
        for w in keyed.windows(2) {
            if (w[0].0, w[0].1, w[0].2) == (w[1].0, w[1].1, w[1].2) {
                twin_prev[w[1].3 as usize] = w[0].3;
            }
        }
        let (slot_obstacles, per_buffer_obstacles) = match obstacles {
            Some(o) if o.per_slot.iter().any(|r| !r.is_empty()) => {
                let suffix = o
                    .per_slot
                    .iter()
                    .map(|r| {
                        let mut s = vec![0u64; r.len() + 1];
                        for k in (0..r.len()).rev() {
                            s[k] = s[k + 1] + (r[k].1 - r[k].0);
                        }
                        s
                    })
                    .collect();
                (
                    Some(SlotObstacles {
                        ranges: o.per_slot,
                        suffix,
                    }),
                    o.per_buffer,
                )
            }
            Some(o) => (None, o.per_buffer),
            None => (None, vec![Vec::new(); n]),
        };
        Exact {
            p,
            size,
            align,
            overlaps,
            slot_bufs,
            buf_slots,
            slot_total,
            obstacles: slot_obstacles,
            per_buffer_obstacles,
            twin_prev,
            wrapped: (0..n).any(|i| p.spans(i).len() > 1),
            lower_bound,
        }
    }

    /// Number of free buffers.
    pub fn len(&self) -> usize {
        self.size.len()
    }

    /// The lowest offset `>= at` (aligned) where buffer `i` avoids its obstacles.
    #[inline]
    fn clear_of_obstacles(&self, i: usize, at: u64) -> u64 {
        let mut at = align_up(at, self.align[i]);
        let obs = &self.per_buffer_obstacles[i];
        if obs.is_empty() {
            return at;
        }
        let mut k = obs.partition_point(|&(_, hi)| hi <= at);
        while k < obs.len() && obs[k].0 < at + self.size[i] {
            at = align_up(obs[k].1, self.align[i]);
            k += 1;
            while k < obs.len() && obs[k].1 <= at {
                k += 1;
            }
        }
        at
    }

    /// The pre-order rank of each buffer for `heuristic`.
    fn ranks(&self, heuristic: Preorder) -> Vec<u32> {
        let n = self.size.len();
        let len = |i: usize| self.p.raw[i].len as u128;
        let area = |i: usize| len(i) * self.size[i] as u128;
        let total = |i: usize| {
            self.buf_slots
                .row(i)
                .iter()
                .map(|&t| self.slot_total[t as usize])
                .max()
                .unwrap_or(0) as u128
        };
        let key = |i: usize| -> [u128; 3] {
            match heuristic {
                Preorder::Wat => [len(i), area(i), total(i)],
                Preorder::Taw => [total(i), area(i), len(i)],
                Preorder::Twa => [total(i), len(i), area(i)],
                Preorder::Zwa => [self.size[i] as u128, len(i), area(i)],
            }
        };
        let mut idx: Vec<(std::cmp::Reverse<[u128; 3]>, u32)> = (0..n)
            .map(|i| (std::cmp::Reverse(key(i)), i as u32))
            .collect();
        idx.sort_unstable();
        let mut rank = vec![0u32; n];
        for (r, (_, i)) in idx.into_iter().enumerate() {
            rank[i as usize] = r as u32;
        }
        rank
    }

    /// Searches for a packing of the free buffers below `capacity`.
    pub fn decide(&self, capacity: u64, heuristic: Preorder, limits: Limits<'_>) -> Outcome {
        let n = self.size.len();
        if n == 0 {
            return Outcome::Found(Vec::new());
        }
        if self.lower_bound > capacity {
            return Outcome::Infeasible;
        }
        let rank = self.ranks(heuristic);
        // Symmetry chains must follow the pre-order: re-link twins by rank.
        let mut twin_prev = vec![u32::MAX; n];
        {
            let mut chains: Vec<Vec<u32>> = Vec::new();
            let mut head = vec![u32::MAX; n];
            for i in 0..n {
                let p = self.twin_prev[i];
                if p == u32::MAX {
                    head[i] = chains.len() as u32;
                    chains.push(vec![i as u32]);
                } else {
                    head[i] = head[p as usize];
                    chains[head[i] as usize].push(i as u32);
                }
            }
            for chain in &mut chains {
                chain.sort_unstable_by_key(|&i| rank[i as usize]);
                for w in chain.windows(2) {
                    twin_prev[w[1] as usize] = w[0];
                }
            }
        }
        let slots = self.slot_total.len();
        // Buffers crossing each slot boundary `t | t + 1`.
        let mut cuts = vec![0u32; slots.saturating_sub(1)];
        for i in 0..n {
            for sp in self.p.spans(i) {
                for t in sp.lo..sp.hi.saturating_sub(1) {
                    cuts[t as usize] += 1;
                }
            }
        }
        let mut st = State {
            ex: self,
            capacity,
            rank,
            twin_prev,
            decompose: !self.wrapped,
            placed: vec![false; n],
            solution: vec![0; n],
            min_off: (0..n).map(|i| self.clear_of_obstacles(i, 0)).collect(),
            floor: vec![0; slots],
            total: self.slot_total.clone(),
            cuts,
            log_min: Vec::new(),
            log_slot: Vec::new(),
            cands: Vec::new(),
            cut_points: Vec::new(),
            slot_stamp: vec![0; slots],
            epoch: 0,
            affected: Vec::new(),
            nodes: 0,
            limits,
            stopped: false,
        };
        // Floors start at the lowest minimum offset of each slot's buffers.
        for t in 0..slots {
            st.floor[t] = self
                .slot_bufs
                .row(t)
                .iter()
                .map(|&i| st.min_off[i as usize])
                .min()
                .unwrap_or(0);
        }
        let all = Part {
            members: (0..n as u32).collect(),
            lo: 0,
            hi: slots as u32,
        };
        if !st.check(&all, 0) {
            return Outcome::Infeasible;
        }
        // Split at boundaries no buffer crosses, then search.
        let initial: Vec<u32> = if st.decompose {
            (0..slots.saturating_sub(1))
                .filter(|&t| st.cuts[t] == 0)
                .map(|t| t as u32 + 1)
                .collect()
        } else {
            Vec::new()
        };
        let found = if initial.is_empty() {
            st.search(&all, 0, None, n)
        } else {
            st.split(&all, &initial)
        };
        match found {
            true => Outcome::Found(st.solution),
            false if st.stopped => Outcome::Stopped,
            false => Outcome::Infeasible,
        }
    }
}

/// A set of buffers that can be searched on its own: its unplaced members cross no
/// boundary of its slot range `[lo, hi)`.
struct Part {
    members: Vec<u32>,
    lo: u32,
    hi: u32,
}

struct State<'e, 'p> {
    ex: &'e Exact<'p>,
    capacity: u64,
    rank: Vec<u32>,
    twin_prev: Vec<u32>,
    decompose: bool,
    placed: Vec<bool>,
    /// Offsets of the latest placements: along the successful path, the answer.
    solution: Vec<u64>,
    min_off: Vec<u64>,
    floor: Vec<u64>,
    total: Vec<u64>,
    cuts: Vec<u32>,
    log_min: Vec<(u32, u64)>,
    log_slot: Vec<(u32, u64, u64)>,
    cands: Vec<(u64, u32, u32)>,
    cut_points: Vec<u32>,
    slot_stamp: Vec<u32>,
    epoch: u32,
    affected: Vec<u32>,
    nodes: u64,
    limits: Limits<'e>,
    stopped: bool,
}

impl State<'_, '_> {
    /// Section inference over the part's slots that still have unplaced bytes.
    fn check(&self, part: &Part, cur: u64) -> bool {
        for t in part.lo as usize..part.hi as usize {
            let total = self.total[t];
            if total == 0 {
                continue;
            }
            let f = self.floor[t].max(cur);
            let mut need = f + total;
            if let Some(o) = &self.ex.obstacles {
                need += o.above(t, f);
            }
            if need > self.capacity {
                return false;
            }
        }
        true
    }

    fn out_of_budget(&mut self) -> bool {
        if self.stopped {
            return true;
        }
        self.nodes += 1;
        if self.nodes > self.limits.nodes
            || (self.nodes & 1023 == 0
                && (self.limits.deadline.is_some_and(|d| Instant::now() >= d)
                    || self
                        .limits
                        .cancel
                        .is_some_and(|c| c.load(Ordering::Relaxed))))
        {
            self.stopped = true;
        }
        self.stopped
    }

    /// Depth-first search of `part`, `left` of whose members are unplaced; `cur` and
    /// `last` are the offset and rank of the part's last placement (canonical order).
    /// Leaves the state as it found it; on success `solution` holds the offsets.
    fn search(&mut self, part: &Part, cur: u64, last: Option<u32>, left: usize) -> bool {
        if left == 0 {
            return true;
        }
        if self.out_of_budget() {
            return false;
        }
        let ex = self.ex;
        let mut min_height = u64::MAX;
        for &i in &part.members {
            let i = i as usize;
            if !self.placed[i] {
                min_height = min_height.min(self.min_off[i] + ex.size[i]);
            }
        }
        if min_height <= cur {
            return false;
        }
        let base = self.cands.len();
        for &i in &part.members {
            let iu = i as usize;
            if self.placed[iu] {
                continue;
            }
            let o = self.min_off[iu];
            if o >= min_height || o + ex.size[iu] > self.capacity {
                continue;
            }
            if o < cur || (o == cur && last.is_some_and(|r| self.rank[iu] < r)) {
                continue;
            }
            let tw = self.twin_prev[iu];
            if tw != u32::MAX && !self.placed[tw as usize] {
                continue;
            }
            self.cands.push((o, self.rank[iu], i));
        }
        self.cands[base..].sort_unstable();
        let mut k = base;
        let mut found = false;
        while k < self.cands.len() && !found && !self.stopped {
            let (o, r, i) = self.cands[k];
            k += 1;
            let cut_mark = self.cut_points.len();
            let marks = self.place(i as usize, o, part);
            if self.check(part, o) {
                found = if self.cut_points.len() > cut_mark {
                    let points: Vec<u32> = self.cut_points[cut_mark..].to_vec();
                    self.split(part, &points)
                } else {
                    self.search(part, o, Some(r), left - 1)
                };
            }
            self.unplace(i as usize, marks);
            self.cut_points.truncate(cut_mark);
        }
        self.cands.truncate(base);
        found
    }

    /// Solves the unplaced members of `part` as independent parts separated at the
    /// slot boundaries `points` (each the first slot of a new part).
    fn split(&mut self, part: &Part, points: &[u32]) -> bool {
        let mut bounds: Vec<u32> = points.to_vec();
        bounds.push(part.lo);
        bounds.push(part.hi);
        bounds.sort_unstable();
        bounds.dedup();
        let mut groups: Vec<Vec<u32>> = vec![Vec::new(); bounds.len() - 1];
        for &i in &part.members {
            if self.placed[i as usize] {
                continue;
            }
            let lo = self.ex.p.spans(i as usize)[0].lo;
            let last = groups.len() - 1;
            let g = (bounds.partition_point(|&b| b <= lo) - 1).min(last);
            groups[g].push(i);
        }
        for (g, members) in groups.into_iter().enumerate() {
            if members.is_empty() {
                continue;
            }
            let left = members.len();
            let sub = Part {
                members,
                lo: bounds[g],
                hi: bounds[g + 1],
            };
            if !self.search(&sub, 0, None, left) {
                return false;
            }
        }
        true
    }

    /// Places `i` at `o`; returns the log marks to undo it. New zero-crossing slot
    /// boundaries inside `part` are pushed on `cut_points`.
    fn place(&mut self, i: usize, o: u64, part: &Part) -> (usize, usize) {
        let ex = self.ex;
        let marks = (self.log_min.len(), self.log_slot.len());
        self.placed[i] = true;
        self.solution[i] = o;
        let top = o + ex.size[i];
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.slot_stamp.iter_mut().for_each(|s| *s = u32::MAX);
            self.epoch = 1;
        }
        self.affected.clear();
        for &j in ex.overlaps.row(i) {
            let j = j as usize;
            if self.placed[j] || self.min_off[j] >= top {
                continue;
            }
            self.log_min.push((j as u32, self.min_off[j]));
            self.min_off[j] = ex.clear_of_obstacles(j, top);
            for &t in ex.buf_slots.row(j) {
                if self.slot_stamp[t as usize] != self.epoch {
                    self.slot_stamp[t as usize] = self.epoch;
                    self.affected.push(t);
                }
            }
        }
        for &t in ex.buf_slots.row(i) {
            let t = t as usize;
            self.log_slot.push((t as u32, self.floor[t], self.total[t]));
            self.floor[t] = self.floor[t].max(top);
            self.total[t] -= ex.size[i];
        }
        // A slot's floor is at least the lowest minimum offset of its unplaced buffers.
        for k in 0..self.affected.len() {
            let t = self.affected[k] as usize;
            if self.total[t] == 0 {
                continue;
            }
            let mut m = u64::MAX;
            for &j in ex.slot_bufs.row(t) {
                if !self.placed[j as usize] {
                    m = m.min(self.min_off[j as usize]);
                }
            }
            if m != u64::MAX && m > self.floor[t] {
                self.log_slot.push((t as u32, self.floor[t], self.total[t]));
                self.floor[t] = m;
            }
        }
        if self.decompose {
            for sp in ex.p.spans(i) {
                for t in sp.lo..sp.hi.saturating_sub(1) {
                    let c = &mut self.cuts[t as usize];
                    *c -= 1;
                    if *c == 0 && t >= part.lo && t + 1 < part.hi {
                        self.cut_points.push(t + 1);
                    }
                }
            }
        }
        marks
    }

    fn unplace(&mut self, i: usize, (m_min, m_slot): (usize, usize)) {
        while self.log_slot.len() > m_slot {
            let (t, f, tot) = self.log_slot.pop().expect("above mark");
            self.floor[t as usize] = f;
            self.total[t as usize] = tot;
        }
        while self.log_min.len() > m_min {
            let (j, v) = self.log_min.pop().expect("above mark");
            self.min_off[j as usize] = v;
        }
        if self.decompose {
            for sp in self.ex.p.spans(i) {
                for t in sp.lo..sp.hi.saturating_sub(1) {
                    self.cuts[t as usize] += 1;
                }
            }
        }
        self.placed[i] = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::problem::RawBuf;

    fn rb(start: u64, len: u64, size: u64) -> RawBuf {
        RawBuf {
            start,
            len,
            size,
            align: 1,
        }
    }

    fn limits() -> Limits<'static> {
        Limits {
            nodes: 1_000_000,
            deadline: None,
            cancel: None,
        }
    }

    fn valid(p: &Problem, off: &[u64], cap: u64) -> bool {
        (0..p.len()).all(|i| {
            off[i] + p.size(i) <= cap
                && (0..p.len()).all(|j| {
                    i == j
                        || !p.conflict(i, j)
                        || off[i] + p.size(i) <= off[j]
                        || off[j] + p.size(j) <= off[i]
                })
        })
    }

    #[test]
    fn solves_the_minimalloc_example_at_capacity_12() {
        let p = Problem::build(
            vec![
                rb(0, 3, 4),
                rb(3, 6, 4),
                rb(0, 9, 4),
                rb(9, 12, 4),
                rb(0, 21, 4),
            ],
            None,
        );
        let ex = Exact::new(&p, None);
        for h in Preorder::ALL {
            match ex.decide(12, h, limits()) {
                Outcome::Found(off) => assert!(valid(&p, &off, 12)),
                other => panic!("{h:?}: {other:?}"),
            }
            assert_eq!(ex.decide(11, h, limits()), Outcome::Infeasible);
        }
    }

    #[test]
    fn packs_at_the_load_and_proves_below_it_infeasible() {
        // a: [0,2) x2, b: [1,3) x2, c: [0,1) x1, d: [2,3) x1: load 4 at t = 1.
        let p = Problem::build(
            vec![rb(0, 2, 2), rb(1, 2, 2), rb(0, 1, 1), rb(2, 1, 1)],
            None,
        );
        let ex = Exact::new(&p, None);
        assert_eq!(ex.lower_bound, 4);
        assert!(matches!(
            ex.decide(4, Preorder::Wat, limits()),
            Outcome::Found(_)
        ));
        assert_eq!(ex.decide(3, Preorder::Wat, limits()), Outcome::Infeasible);
    }

    #[test]
    fn obstacles_are_avoided() {
        // One free buffer [0, 4) of size 2; an obstacle occupies [0, 3) at slot 0.
        let p = Problem::build(vec![rb(0, 4, 2)], None);
        let obstacles = Obstacles {
            per_buffer: vec![vec![(0, 3)]],
            per_slot: vec![vec![(0, 3)]],
        };
        let ex = Exact::new(&p, Some(obstacles));
        assert_eq!(
            ex.decide(5, Preorder::Wat, limits()),
            Outcome::Found(vec![3])
        );
        assert_eq!(ex.decide(4, Preorder::Wat, limits()), Outcome::Infeasible);
    }

    #[test]
    fn node_limit_stops_the_search() {
        let raw: Vec<RawBuf> = (0..30).map(|i| rb(i % 7, 3 + i % 5, 1 + i % 4)).collect();
        let p = Problem::build(raw, None);
        let ex = Exact::new(&p, None);
        let tight = Limits {
            nodes: 3,
            ..limits()
        };
        assert_eq!(
            ex.decide(ex.lower_bound, Preorder::Wat, tight),
            Outcome::Stopped
        );
    }

    #[test]
    fn twins_and_circular_spans() {
        // Period 10; three identical wrapped buffers and one in the middle.
        let p = Problem::build(
            vec![rb(8, 4, 2), rb(8, 4, 2), rb(8, 4, 2), rb(3, 4, 5)],
            Some(10),
        );
        let ex = Exact::new(&p, None);
        match ex.decide(6, Preorder::Taw, limits()) {
            Outcome::Found(off) => assert!(valid(&p, &off, 6)),
            other => panic!("{other:?}"),
        }
        assert_eq!(ex.decide(5, Preorder::Taw, limits()), Outcome::Infeasible);
    }
}
