//! Best-fit placement in a given order (the XLA / TFLite / idealloc bootstrap greedy).
//!
//! Buffers are placed one at a time. For each, the already-placed buffers that
//! conflict with it in time are collected, sorted by offset, and the gaps between
//! them scanned: the buffer goes into the smallest gap it fits (ties: lowest offset),
//! or on top of everything it conflicts with. [`Fit::First`] takes the lowest gap
//! instead.
//!
//! No pairwise conflict graph is built. Placed spans (as their `(offset, top)`
//! address ranges, so a query reads contiguous memory) are indexed by two segment trees
//! over the compressed time slots: `cover` stores a span in its O(log T) canonical
//! nodes (a root-to-leaf walk at slot `t` yields every placed span covering `t`), and
//! `starts` stores it in the O(log T) ancestors of its first slot (the canonical nodes
//! of `(lo, hi)` yield every placed span starting strictly inside). The two sets are
//! disjoint, so a query costs O(log T + k) plus the sort, where k is the
//! number of placed buffers overlapping in time. A whole run costs
//! O(n log T + P) for P conflicting pairs on typical inputs (the offset sort is a
//! bucket sort), memory O(n log T).

use super::problem::{Problem, Span};

/// Which gap a buffer takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Fit {
    /// The smallest gap it fits; ties go to the lowest.
    Best,
    /// The lowest gap it fits.
    First,
}

/// An index of placed buffers by time, and the best-fit placement over it.
pub(crate) struct Placer<'p> {
    p: &'p Problem,
    base: usize,
    cover: Vec<Vec<(u64, u64)>>,
    starts: Vec<Vec<(u64, u64)>>,
    offset: Vec<u64>,
    placed: Vec<bool>,
    scratch: Vec<(u64, u64)>,
    tmp: Vec<(u64, u64)>,
    counts: Vec<u32>,
    peak: u64,
}

impl<'p> Placer<'p> {
    pub fn new(p: &'p Problem) -> Placer<'p> {
        let base = (p.slots.max(1) as usize).next_power_of_two();
        Placer {
            p,
            base,
            cover: vec![Vec::new(); 2 * base],
            starts: vec![Vec::new(); 2 * base],
            offset: vec![0; p.len()],
            placed: vec![false; p.len()],
            scratch: Vec::new(),
            tmp: Vec::new(),
            counts: Vec::new(),
            peak: 0,
        }
    }

    /// Highest `offset + size` so far.
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// Offsets of all buffers (0 for unplaced ones).
    pub fn into_offsets(self) -> Vec<u64> {
        self.offset
    }

    /// Fixes buffer `i` at `offset` (the caller guarantees it conflicts with nothing).
    pub fn fix(&mut self, i: usize, offset: u64) {
        debug_assert!(!self.placed[i]);
        self.offset[i] = offset;
        self.placed[i] = true;
        let top = offset + self.p.size(i);
        self.peak = self.peak.max(top);
        let e = (offset, top);
        let base = self.base;
        for s in self.p.spans(i) {
            let (mut l, mut r) = (s.lo as usize + base, s.hi as usize + base);
            while l < r {
                if l & 1 == 1 {
                    self.cover[l].push(e);
                    l += 1;
                }
                if r & 1 == 1 {
                    r -= 1;
                    self.cover[r].push(e);
                }
                l >>= 1;
                r >>= 1;
            }
            let mut node = s.lo as usize + base;
            while node >= 1 {
                self.starts[node].push(e);
                node >>= 1;
            }
        }
    }

    /// Collects `(offset, top)` of every placed buffer conflicting with `i` into
    /// `self.scratch`, sorted by offset. A buffer met through two spans appears twice,
    /// which the gap scan does not mind.
    fn gather(&mut self, i: usize) {
        let p = self.p;
        self.gather_spans(p.spans(i));
    }

    /// [`Self::gather`] for any slot spans.
    fn gather_spans(&mut self, spans: &[Span]) {
        self.scratch.clear();
        let base = self.base;
        for s in spans {
            let mut node = s.lo as usize + base;
            while node >= 1 {
                self.scratch.extend_from_slice(&self.cover[node]);
                node >>= 1;
            }
            let (mut l, mut r) = (s.lo as usize + 1 + base, s.hi as usize + base);
            while l < r {
                if l & 1 == 1 {
                    self.scratch.extend_from_slice(&self.starts[l]);
                    l += 1;
                }
                if r & 1 == 1 {
                    r -= 1;
                    self.scratch.extend_from_slice(&self.starts[r]);
                }
                l >>= 1;
                r >>= 1;
            }
        }
        sort_by_offset(
            &mut self.scratch,
            &mut self.tmp,
            &mut self.counts,
            self.peak,
        );
    }

    /// The address ranges of placed buffers live at some instant of `spans`, sorted
    /// and merged.
    pub fn occupied(&mut self, spans: &[Span]) -> Vec<(u64, u64)> {
        self.gather_spans(spans);
        let mut out: Vec<(u64, u64)> = Vec::new();
        for &(lo, hi) in &self.scratch {
            match out.last_mut() {
                Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        out
    }

    /// Where buffer `i` would go.
    pub fn choose(&mut self, i: usize, fit: Fit) -> u64 {
        self.gather(i);
        let size = self.p.size(i);
        let align = self.p.align(i);
        let mut reach = 0u64;
        let mut best: Option<(u64, u64)> = None; // (gap length, offset)
        for &(lo, hi) in &self.scratch {
            if lo > reach {
                let at = align_up(reach, align);
                if at + size <= lo {
                    let len = lo - reach;
                    match fit {
                        Fit::First => return at,
                        Fit::Best => {
                            if best.is_none_or(|(bl, _)| len < bl) {
                                best = Some((len, at));
                                if len == size {
                                    return at;
                                }
                            }
                        }
                    }
                }
            }
            reach = reach.max(hi);
        }
        match best {
            Some((_, at)) => at,
            None => align_up(reach, align),
        }
    }

    /// Places buffer `i` by `fit` and returns its offset.
    pub fn place(&mut self, i: usize, fit: Fit) -> u64 {
        let at = self.choose(i, fit);
        self.fix(i, at);
        at
    }
}

/// Sorts `(offset, top)` pairs by offset, all offsets below `bound`: one counting
/// pass into about `len / 2` buckets by the offset's high bits, then a small sort per
/// bucket. Linear on typical inputs, O(k log k) at worst (all in one bucket).
fn sort_by_offset(
    v: &mut Vec<(u64, u64)>,
    tmp: &mut Vec<(u64, u64)>,
    counts: &mut Vec<u32>,
    bound: u64,
) {
    let k = v.len();
    if k < 48 {
        v.sort_unstable_by_key(|e| e.0);
        return;
    }
    let buckets = (k / 2).next_power_of_two();
    let bits = u64::BITS - bound.leading_zeros();
    let shift = bits.saturating_sub(buckets.trailing_zeros());
    counts.clear();
    counts.resize(buckets + 1, 0);
    for e in v.iter() {
        counts[(e.0 >> shift) as usize + 1] += 1;
    }
    for b in 1..=buckets {
        counts[b] += counts[b - 1];
    }
    tmp.clear();
    tmp.resize(k, (0, 0));
    for &e in v.iter() {
        let b = (e.0 >> shift) as usize;
        tmp[counts[b] as usize] = e;
        counts[b] += 1;
    }
    // counts[b] is now the end of bucket b; bucket b starts at the end of b - 1.
    let mut begin = 0usize;
    for &end in &counts[..buckets] {
        let end = end as usize;
        if end - begin > 1 {
            tmp[begin..end].sort_unstable_by_key(|e| e.0);
        }
        begin = end;
    }
    std::mem::swap(v, tmp);
}

#[inline]
pub(crate) fn align_up(x: u64, align: u64) -> u64 {
    (x + align - 1) & !(align - 1)
}

/// Places every buffer of `p` in `order` by `fit`; returns offsets and peak.
pub(crate) fn place_in_order(p: &Problem, order: &[u32], fit: Fit) -> (Vec<u64>, u64) {
    let mut placer = Placer::new(p);
    for &i in order {
        placer.place(i as usize, fit);
    }
    let peak = placer.peak();
    (placer.into_offsets(), peak)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::problem::rb;

    #[test]
    fn best_fit_takes_the_smallest_gap() {
        // Three long buffers with two holes (sizes 4 and 2) between them, then a
        // short buffer of size 2: it should take the 2-hole, not the 4-hole.
        let p = Problem::build(
            vec![
                rb(0, 10, 1),
                rb(0, 10, 1),
                rb(0, 10, 1),
                rb(0, 10, 4),
                rb(0, 10, 2),
                rb(2, 3, 2),
            ],
            None,
        );
        let mut pl = Placer::new(&p);
        pl.fix(0, 0);
        pl.fix(1, 5);
        pl.fix(2, 9);
        assert_eq!(pl.place(5, Fit::Best), 6);
        assert_eq!(pl.choose(4, Fit::First), 1);
        assert_eq!(pl.choose(3, Fit::Best), 1);
        assert_eq!(pl.peak(), 10);
    }

    #[test]
    fn finds_conflicts_that_start_inside_the_lifetime() {
        let p = Problem::build(vec![rb(5, 2, 8), rb(0, 20, 8), rb(19, 3, 8)], None);
        let mut pl = Placer::new(&p);
        pl.fix(0, 0);
        pl.fix(2, 8);
        assert_eq!(pl.place(1, Fit::Best), 16);
    }

    #[test]
    fn circular_spans_conflict() {
        let p = Problem::build(vec![rb(8, 5, 4), rb(1, 1, 4), rb(4, 2, 4)], Some(10));
        let (off, peak) = place_in_order(&p, &[0, 1, 2], Fit::Best);
        assert_eq!(off, vec![0, 4, 0]);
        assert_eq!(peak, 8);
    }

    #[test]
    fn bucket_sort_sorts() {
        let mut rng = crate::solver::order::Rng::new(3);
        for k in [0usize, 1, 47, 48, 100, 1000] {
            for spread in [1u64, 1000, 1 << 40] {
                let mut v: Vec<(u64, u64)> = (0..k)
                    .map(|_| {
                        let o = rng.below(spread);
                        (o, o + 1)
                    })
                    .collect();
                let mut want = v.clone();
                want.sort_unstable_by_key(|e| e.0);
                sort_by_offset(&mut v, &mut Vec::new(), &mut Vec::new(), spread);
                let got: Vec<u64> = v.iter().map(|e| e.0).collect();
                let exp: Vec<u64> = want.iter().map(|e| e.0).collect();
                assert_eq!(got, exp);
            }
        }
    }

    #[test]
    fn alignment_is_respected() {
        let mut b = rb(0, 4, 3);
        b.align = 4;
        let p = Problem::build(vec![rb(0, 4, 5), b], None);
        let (off, peak) = place_in_order(&p, &[0, 1], Fit::Best);
        assert_eq!(off, vec![0, 8]);
        assert_eq!(peak, 11);
    }
}
