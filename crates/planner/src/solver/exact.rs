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
use super::problem::{Problem, Span};

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
    /// The whole solve's cancellation ([`super::SolveOptions::cancel`]).
    pub interrupt: Option<&'a AtomicBool>,
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
    /// Per buffer: its spans in section indices, and how many.
    sec_spans: Vec<([Span; 2], u8)>,
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
        // Sections: the slots right before some lifetime ends. The buffers live in any
        // other slot are live in the next such slot too, so these maximal sets carry
        // every constraint (minimalloc's sweep).
        let mut marked = vec![false; p.slots as usize];
        for i in 0..n {
            for s in p.spans(i) {
                marked[s.hi as usize - 1] = true;
            }
        }
        let mut before = Vec::with_capacity(marked.len() + 1); // sections before slot t
        let mut section_slot = Vec::new();
        before.push(0u32);
        for (t, &m) in marked.iter().enumerate() {
            if m {
                section_slot.push(t);
            }
            before.push(section_slot.len() as u32);
        }
        let slots = section_slot.len();
        let mut sec_spans = Vec::with_capacity(n);
        for i in 0..n {
            let mut sp = [Span::default(); 2];
            for (k, s) in p.spans(i).iter().enumerate() {
                sp[k] = Span {
                    lo: before[s.lo as usize],
                    hi: before[s.hi as usize],
                };
            }
            sec_spans.push((sp, p.spans(i).len() as u8));
        }
        // Sections of each buffer, buffers of each section.
        let mut buf_slots = Csr {
            start: Vec::with_capacity(n + 1),
            items: Vec::new(),
        };
        buf_slots.start.push(0);
        let mut count = vec![0u32; slots + 1];
        for (sp, k) in &sec_spans {
            for s in &sp[..*k as usize] {
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
        type TwinKey = (u64, u64, [(u32, u32); 2], u32);
        let mut keyed: Vec<TwinKey> = (0..n)
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
                let per_section: Vec<Vec<(u64, u64)>> = section_slot
                    .iter()
                    .map(|&t| o.per_slot[t].clone())
                    .collect();
                let suffix = per_section
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
                        ranges: per_section,
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
            sec_spans,
            lower_bound,
        }
    }

    /// Number of free buffers.
    pub fn len(&self) -> usize {
        self.size.len()
    }

    #[inline]
    fn sections_of(&self, i: usize) -> &[Span] {
        let (sp, k) = &self.sec_spans[i];
        &sp[..*k as usize]
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

    /// Writes into `rank` the pre-order position of each of `members` for
    /// `heuristic` (0 = first), taking section totals from `totals` (minimalloc
    /// re-ranks every sub-problem with the totals left in it).
    fn rank_members(&self, heuristic: Preorder, members: &[u32], totals: &[u64], rank: &mut [u32]) {
        let len = |i: usize| self.p.raw[i].len as u128;
        let area = |i: usize| len(i) * self.size[i] as u128;
        let total = |i: usize| {
            self.buf_slots
                .row(i)
                .iter()
                .map(|&t| totals[t as usize])
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
        let mut idx: Vec<(std::cmp::Reverse<[u128; 3]>, u32)> = members
            .iter()
            .map(|&i| (std::cmp::Reverse(key(i as usize)), i))
            .collect();
        idx.sort_unstable();
        for (r, (_, i)) in idx.into_iter().enumerate() {
            rank[i as usize] = r as u32;
        }
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
        let mut rank = vec![0u32; n];
        let everyone: Vec<u32> = (0..n as u32).collect();
        self.rank_members(heuristic, &everyone, &self.slot_total, &mut rank);
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
            for sp in self.sections_of(i) {
                for t in sp.lo..sp.hi.saturating_sub(1) {
                    cuts[t as usize] += 1;
                }
            }
        }
        let mut st = State {
            ex: self,
            capacity,
            heuristic,
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
        if st.check(&all, 0, None).is_err() {
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
    heuristic: Preorder,
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
    /// Section inference over the part's sections that still have unplaced bytes:
    /// `Err(s)` names a section whose bytes cannot fit.
    fn check(&self, part: &Part, cur: u64, hint: Option<usize>) -> Result<(), usize> {
        if let Some(t) = hint
            && (part.lo as usize..part.hi as usize).contains(&t)
            && !self.fits(t, cur)
        {
            return Err(t);
        }
        for t in part.lo as usize..part.hi as usize {
            if !self.fits(t, cur) {
                return Err(t);
            }
        }
        Ok(())
    }

    #[inline]
    fn fits(&self, t: usize, cur: u64) -> bool {
        let total = self.total[t];
        if total == 0 {
            return true;
        }
        let f = self.floor[t].max(cur);
        let mut need = f + total;
        if let Some(o) = &self.ex.obstacles {
            need += o.above(t, f);
        }
        need <= self.capacity
    }

    fn out_of_budget(&mut self) -> bool {
        if self.stopped {
            return true;
        }
        self.nodes += 1;
        let timed = self.nodes & 1023 == 0
            && (self.limits.deadline.is_some_and(|d| Instant::now() >= d)
                || self
                    .limits
                    .cancel
                    .is_some_and(|c| c.load(Ordering::Relaxed))
                || self
                    .limits
                    .interrupt
                    .is_some_and(|c| c.load(Ordering::Relaxed)));
        self.stopped = self.nodes > self.limits.nodes || timed;
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
        // A section that cannot take its bytes above the offset of a candidate even
        // before that candidate is placed dooms every later candidate (offset no lower)
        // that does not live in it: placing such a buffer only raises floors there.
        let mut blocked: Option<usize> = None;
        while k < self.cands.len() && !found && !self.stopped {
            let (o, r, i) = self.cands[k];
            k += 1;
            if let Some(t) = blocked
                && !ex
                    .sections_of(i as usize)
                    .iter()
                    .any(|s| s.lo as usize <= t && t < s.hi as usize)
            {
                continue;
            }
            let cut_mark = self.cut_points.len();
            let (marks, hatless) = self.place(i as usize, o, part);
            let mut failed = None;
            match self.check(part, o, blocked) {
                Ok(()) => {
                    found = if self.cut_points.len() > cut_mark {
                        let points: Vec<u32> = self.cut_points[cut_mark..].to_vec();
                        self.split(part, &points)
                    } else {
                        self.search(part, o, Some(r), left - 1)
                    };
                }
                Err(t) => failed = Some(t),
            }
            self.unplace(i as usize, marks);
            self.cut_points.truncate(cut_mark);
            if let Some(t) = failed
                && !self.fits(t, o)
            {
                blocked = Some(t);
            }
            if hatless && !found {
                // `i` constrains no unplaced buffer: the failure below is not its
                // doing, and placing another buffer first cannot help (minimalloc's
                // hatless pruning).
                break;
            }
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
            let lo = self.ex.sections_of(i as usize)[0].lo;
            let last = groups.len() - 1;
            let g = (bounds.partition_point(|&b| b <= lo) - 1).min(last);
            groups[g].push(i);
        }
        for (g, members) in groups.into_iter().enumerate() {
            if members.is_empty() {
                continue;
            }
            let left = members.len();
            let saved: Vec<u32> = members.iter().map(|&i| self.rank[i as usize]).collect();
            self.ex
                .rank_members(self.heuristic, &members, &self.total, &mut self.rank);
            let sub = Part {
                members,
                lo: bounds[g],
                hi: bounds[g + 1],
            };
            let ok = self.search(&sub, 0, None, left);
            for (k, &i) in sub.members.iter().enumerate() {
                self.rank[i as usize] = saved[k];
            }
            if !ok {
                return false;
            }
        }
        true
    }

    /// Places `i` at `o`; returns the log marks to undo it and whether `i` overlaps
    /// no unplaced buffer. New zero-crossing section boundaries inside `part` are
    /// pushed on `cut_points`.
    fn place(&mut self, i: usize, o: u64, part: &Part) -> ((usize, usize), bool) {
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
        let mut hatless = true;
        for &j in ex.overlaps.row(i) {
            let j = j as usize;
            if self.placed[j] {
                continue;
            }
            hatless = false;
            if self.min_off[j] >= top {
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
            for sp in ex.sections_of(i) {
                for t in sp.lo..sp.hi.saturating_sub(1) {
                    let c = &mut self.cuts[t as usize];
                    *c -= 1;
                    if *c == 0 && t >= part.lo && t + 1 < part.hi {
                        self.cut_points.push(t + 1);
                    }
                }
            }
        }
        (marks, hatless)
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
            for sp in self.ex.sections_of(i) {
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
    use crate::solver::instance::minimalloc_example;
    use crate::solver::problem::{RawBuf, rb};

    fn limits() -> Limits<'static> {
        Limits {
            nodes: 1_000_000,
            deadline: None,
            cancel: None,
            interrupt: None,
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
        let (p, _) = crate::solver::portfolio::normalise(&minimalloc_example());
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

    /// Exhaustive search over every offset: the independent reference.
    fn brute(p: &Problem, cap: u64) -> bool {
        fn go(p: &Problem, cap: u64, i: usize, off: &mut Vec<u64>) -> bool {
            if i == p.len() {
                return true;
            }
            for o in 0..=cap.saturating_sub(p.size(i)) {
                if o % p.align(i) != 0 {
                    continue;
                }
                let ok = (0..i).all(|j| {
                    !p.conflict(i, j) || o + p.size(i) <= off[j] || off[j] + p.size(j) <= o
                });
                if ok {
                    off.push(o);
                    if go(p, cap, i + 1, off) {
                        return true;
                    }
                    off.pop();
                }
            }
            false
        }
        go(p, cap, 0, &mut Vec::new())
    }

    #[test]
    fn agrees_with_exhaustive_search_on_small_instances() {
        let mut rng = crate::solver::order::Rng::new(11);
        for case in 0..400 {
            let n = 2 + rng.below(5) as usize;
            let period = if case % 3 == 0 { Some(8) } else { None };
            let raw: Vec<RawBuf> = (0..n)
                .map(|_| RawBuf {
                    start: rng.below(8),
                    len: 1 + rng.below(6),
                    size: 1 + rng.below(4),
                    align: if rng.below(4) == 0 { 2 } else { 1 },
                })
                .collect();
            let p = Problem::build(raw, period);
            let ex = Exact::new(&p, None);
            let lb = p.lower_bound();
            for cap in lb..lb + 4 {
                let want = brute(&p, cap);
                for h in Preorder::ALL {
                    match ex.decide(cap, h, limits()) {
                        Outcome::Found(off) => {
                            assert!(want, "case {case} cap {cap}: found but brute force says no");
                            assert!(valid(&p, &off, cap), "case {case}: invalid packing");
                        }
                        Outcome::Infeasible => {
                            assert!(
                                !want,
                                "case {case} cap {cap} {h:?}: missed a packing of {p:?}"
                            )
                        }
                        Outcome::Stopped => panic!("node limit on a tiny instance"),
                    }
                }
            }
        }
    }

    /// Cuts the rectangle `[t0, t1) x [a0, a1)` (time x address) into `pieces`
    /// rectangles at random: a perfect packing whose load is `a1 - a0` everywhere.
    fn guillotine(
        rng: &mut crate::solver::order::Rng,
        t: (u64, u64),
        a: (u64, u64),
        pieces: usize,
        out: &mut Vec<RawBuf>,
    ) {
        let can_t = t.1 - t.0 >= 2;
        let can_a = a.1 - a.0 >= 2;
        if pieces <= 1 || (!can_t && !can_a) {
            out.push(RawBuf {
                start: t.0,
                len: t.1 - t.0,
                size: a.1 - a.0,
                align: 1,
            });
            return;
        }
        let left = 1 + rng.below(pieces as u64 - 1) as usize;
        if can_t && (!can_a || rng.below(2) == 0) {
            let cut = t.0 + 1 + rng.below(t.1 - t.0 - 1);
            guillotine(rng, (t.0, cut), a, left, out);
            guillotine(rng, (cut, t.1), a, pieces - left, out);
        } else {
            let cut = a.0 + 1 + rng.below(a.1 - a.0 - 1);
            guillotine(rng, t, (a.0, cut), left, out);
            guillotine(rng, t, (cut, a.1), pieces - left, out);
        }
    }

    #[test]
    fn finds_perfect_packings_that_exist() {
        let mut rng = crate::solver::order::Rng::new(5);
        for case in 0..200 {
            let mut raw = Vec::new();
            let pieces = 8 + rng.below(40) as usize;
            guillotine(&mut rng, (0, 64), (0, 1000), pieces, &mut raw);
            let p = Problem::build(raw, None);
            let ex = Exact::new(&p, None);
            assert_eq!(ex.lower_bound, 1000);
            let mut found = false;
            for h in Preorder::ALL {
                match ex.decide(1000, h, limits()) {
                    Outcome::Found(off) => {
                        assert!(valid(&p, &off, 1000));
                        found = true;
                    }
                    Outcome::Infeasible => {
                        panic!("case {case} {h:?}: a perfect packing was missed")
                    }
                    Outcome::Stopped => {}
                }
            }
            assert!(found, "case {case}: no pre-order found the packing");
            assert_eq!(ex.decide(999, Preorder::Taw, limits()), Outcome::Infeasible);
        }
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
