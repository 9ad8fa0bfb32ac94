//! The solver's internal, normalised form of an instance.
//!
//! Time is compressed to *slots*: the distinct lifetime end points `p_0 < … < p_m`
//! delimit slots `k = [p_k, p_{k+1})`, and a lifetime becomes a half-open slot range.
//! A circular lifetime that crosses the period boundary becomes two *spans*,
//! `[start, L)` and `[0, end - L)`, which must share one offset; two buffers conflict
//! exactly when some span of one meets some span of the other. Every engine works on
//! spans, so linear and circular instances share all code.
//!
//! Also here: the per-slot load profile (its maximum is the lower bound), the split
//! into independent components (connected through time, or through the two spans of
//! one buffer), and the extraction of buffers that are live whenever anything else is
//! (they go to a bottom stack; with unit alignment this loses nothing). Building is
//! O(n log n); components and load are O(n + slots).

/// A half-open range of slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Span {
    pub lo: u32,
    pub hi: u32,
}

impl Span {
    #[inline]
    pub fn meets(self, other: Span) -> bool {
        self.lo < other.hi && other.lo < self.hi
    }
}

/// A buffer before time compression: normalised start (already reduced modulo the
/// period), length, size, alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawBuf {
    pub start: u64,
    pub len: u64,
    pub size: u64,
    pub align: u64,
}

/// A buffer of alignment 1 starting at `start` for `len` ticks (the solver's unit
/// tests).
#[cfg(test)]
pub(crate) fn rb(start: u64, len: u64, size: u64) -> RawBuf {
    RawBuf {
        start,
        len,
        size,
        align: 1,
    }
}

/// A normalised problem. Buffer `i` of a problem is `raw[i]`.
#[derive(Debug, Clone)]
pub struct Problem {
    pub raw: Vec<RawBuf>,
    spans: Vec<[Span; 2]>,
    nspans: Vec<u8>,
    /// Number of slots.
    pub slots: u32,
    /// Slot boundaries in (normalised) time: slot `k` is `[points[k], points[k + 1])`.
    pub points: Vec<u64>,
    /// The period, for circular problems.
    pub period: Option<u64>,
}

impl Problem {
    /// Compresses time. `period` must be the one the `raw` starts were reduced by.
    pub fn build(raw: Vec<RawBuf>, period: Option<u64>) -> Problem {
        let n = raw.len();
        let mut points: Vec<u64> = Vec::with_capacity(2 * n + 2);
        let mut pieces: Vec<([(u64, u64); 2], u8)> = Vec::with_capacity(n);
        for b in &raw {
            let end = b.start + b.len;
            let p = match period {
                Some(l) if end > l => ([(b.start, l), (0, end - l)], 2),
                _ => ([(b.start, end), (0, 0)], 1),
            };
            for &(lo, hi) in &p.0[..p.1 as usize] {
                points.push(lo);
                points.push(hi);
            }
            pieces.push(p);
        }
        points.sort_unstable();
        points.dedup();
        let rank = |t: u64| points.binary_search(&t).expect("endpoint was collected") as u32;
        let mut spans = Vec::with_capacity(n);
        let mut nspans = Vec::with_capacity(n);
        for (p, k) in &pieces {
            let mut s = [Span::default(); 2];
            for j in 0..*k as usize {
                s[j] = Span {
                    lo: rank(p[j].0),
                    hi: rank(p[j].1),
                };
            }
            spans.push(s);
            nspans.push(*k);
        }
        Problem {
            raw,
            spans,
            nspans,
            slots: points.len().saturating_sub(1) as u32,
            points,
            period,
        }
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    #[inline]
    pub fn spans(&self, i: usize) -> &[Span] {
        &self.spans[i][..self.nspans[i] as usize]
    }

    #[inline]
    pub fn size(&self, i: usize) -> u64 {
        self.raw[i].size
    }

    #[inline]
    pub fn align(&self, i: usize) -> u64 {
        self.raw[i].align
    }

    /// True when buffers `i` and `j` are live at a common instant.
    #[cfg(test)]
    pub fn conflict(&self, i: usize, j: usize) -> bool {
        self.spans(i)
            .iter()
            .any(|a| self.spans(j).iter().any(|b| a.meets(*b)))
    }

    /// The slot whose range starts at time `t` (`t` must be a boundary).
    pub fn slot_at(&self, t: u64) -> Option<u32> {
        self.points.binary_search(&t).ok().map(|k| k as u32)
    }

    /// Live bytes per slot. O(n + slots).
    pub fn load(&self) -> Vec<u64> {
        let mut diff = vec![0i128; self.slots as usize + 1];
        for i in 0..self.len() {
            for s in self.spans(i) {
                diff[s.lo as usize] += self.raw[i].size as i128;
                diff[s.hi as usize] -= self.raw[i].size as i128;
            }
        }
        let mut out = Vec::with_capacity(self.slots as usize);
        let mut acc = 0i128;
        for d in &diff[..self.slots as usize] {
            acc += d;
            out.push(acc as u64);
        }
        out
    }

    /// The load lower bound: the maximum live bytes over time.
    pub fn lower_bound(&self) -> u64 {
        self.load().into_iter().max().unwrap_or(0)
    }

    /// Independent groups of buffers: two buffers are in one group when a chain of
    /// buffers overlapping in time joins them. Each group is sorted; groups are in
    /// order of their first buffer. O(n α(n) + slots).
    pub fn components(&self) -> Vec<Vec<u32>> {
        let slots = self.slots as usize;
        // Segment id per slot: consecutive covered slots share one.
        let mut cover = vec![0i64; slots + 1];
        for i in 0..self.len() {
            for s in self.spans(i) {
                cover[s.lo as usize] += 1;
                cover[s.hi as usize] -= 1;
            }
        }
        let mut seg = vec![u32::MAX; slots];
        let mut next = 0u32;
        let mut acc = 0i64;
        let mut open = false;
        for k in 0..slots {
            acc += cover[k];
            if acc > 0 {
                if !open {
                    next += 1;
                    open = true;
                }
                seg[k] = next - 1;
            } else {
                open = false;
            }
        }
        let mut uf = UnionFind::new(next as usize);
        for i in 0..self.len() {
            let sp = self.spans(i);
            if sp.len() == 2 {
                uf.union(
                    seg[sp[0].lo as usize] as usize,
                    seg[sp[1].lo as usize] as usize,
                );
            }
        }
        let mut group_of_root: Vec<u32> = vec![u32::MAX; next as usize];
        let mut groups: Vec<Vec<u32>> = Vec::new();
        for i in 0..self.len() {
            let root = uf.find(seg[self.spans(i)[0].lo as usize] as usize);
            if group_of_root[root] == u32::MAX {
                group_of_root[root] = groups.len() as u32;
                groups.push(Vec::new());
            }
            groups[group_of_root[root] as usize].push(i as u32);
        }
        groups
    }

    /// The problem made of buffers `idx` (in that order), time re-compressed.
    pub fn subproblem(&self, idx: &[u32]) -> Problem {
        Problem::build(
            idx.iter().map(|&i| self.raw[i as usize]).collect(),
            self.period,
        )
    }

    /// Buffers that are live whenever any other buffer is: with a period, those live
    /// the whole period; without, those that overlap every other buffer (found to a
    /// fixpoint). Such a buffer can sit below everything else at no cost when
    /// alignments are 1. Returns them in index order.
    pub fn always_live(&self) -> Vec<u32> {
        let n = self.len();
        if let Some(l) = self.period {
            return (0..n as u32)
                .filter(|&i| self.raw[i as usize].len == l)
                .collect();
        }
        let mut taken = vec![false; n];
        let mut out = Vec::new();
        loop {
            // Smallest two uppers and largest two lowers among the rest.
            let (mut up1, mut up2) = ((u64::MAX, usize::MAX), u64::MAX);
            let (mut lo1, mut lo2) = ((0u64, usize::MAX), 0u64);
            let mut rest = 0usize;
            for i in (0..n).filter(|&i| !taken[i]) {
                rest += 1;
                let b = &self.raw[i];
                let up = b.start + b.len;
                if up < up1.0 {
                    up2 = up1.0;
                    up1 = (up, i);
                } else if up < up2 {
                    up2 = up;
                }
                if b.start > lo1.0 || lo1.1 == usize::MAX {
                    lo2 = lo1.0;
                    lo1 = (b.start, i);
                } else if b.start > lo2 {
                    lo2 = b.start;
                }
            }
            if rest <= 1 {
                break;
            }
            let mut found = Vec::new();
            for i in (0..n).filter(|&i| !taken[i]) {
                let b = &self.raw[i];
                let min_up_others = if up1.1 == i { up2 } else { up1.0 };
                let max_lo_others = if lo1.1 == i { lo2 } else { lo1.0 };
                if b.start < min_up_others && b.start + b.len > max_lo_others {
                    found.push(i);
                }
            }
            if found.is_empty() {
                break;
            }
            // Taking one changes the extremes; take all found: each overlaps every
            // other remaining buffer, including the other found ones.
            for i in found {
                taken[i] = true;
                out.push(i as u32);
            }
            if out.len() + 1 >= n {
                break;
            }
        }
        out.sort_unstable();
        out
    }
}

/// Disjoint sets with path halving and union by size.
pub(crate) struct UnionFind {
    parent: Vec<u32>,
    size: Vec<u32>,
}

impl UnionFind {
    pub fn new(n: usize) -> UnionFind {
        UnionFind {
            parent: (0..n as u32).collect(),
            size: vec![1; n],
        }
    }

    pub fn find(&mut self, mut x: usize) -> usize {
        while self.parent[x] as usize != x {
            let p = self.parent[x] as usize;
            self.parent[x] = self.parent[p];
            x = self.parent[x] as usize;
        }
        x
    }

    pub fn union(&mut self, a: usize, b: usize) {
        let (mut a, mut b) = (self.find(a), self.find(b));
        if a == b {
            return;
        }
        if self.size[a] < self.size[b] {
            std::mem::swap(&mut a, &mut b);
        }
        self.parent[b] = a as u32;
        self.size[a] += self.size[b];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compresses_time_and_keeps_conflicts() {
        let p = Problem::build(vec![rb(0, 10, 1), rb(10, 5, 1), rb(5, 6, 1)], None);
        assert_eq!(p.slots, 4); // points 0,5,10,11,15
        assert!(!p.conflict(0, 1));
        assert!(p.conflict(0, 2));
        assert!(p.conflict(1, 2));
    }

    #[test]
    fn circular_buffers_get_two_spans() {
        let p = Problem::build(vec![rb(8, 5, 4), rb(1, 1, 4), rb(3, 5, 4)], Some(10));
        assert_eq!(p.spans(0).len(), 2);
        assert!(p.conflict(0, 1));
        assert!(!p.conflict(0, 2));
        assert_eq!(p.lower_bound(), 8);
    }

    #[test]
    fn components_split_in_time_and_join_through_wraps() {
        let p = Problem::build(vec![rb(0, 2, 1), rb(1, 2, 1), rb(5, 2, 1)], None);
        assert_eq!(p.components(), vec![vec![0, 1], vec![2]]);
        // With period 10, [9, 11) joins [0, 1) and [8, 9)... through its two spans.
        let p = Problem::build(vec![rb(0, 1, 1), rb(9, 2, 1), rb(5, 1, 1)], Some(10));
        assert_eq!(p.components(), vec![vec![0, 1], vec![2]]);
    }

    #[test]
    fn always_live_buffers_are_found() {
        let p = Problem::build(
            vec![rb(0, 100, 1), rb(0, 10, 1), rb(20, 10, 1), rb(5, 20, 1)],
            None,
        );
        assert_eq!(p.always_live(), vec![0, 3]);
        let p = Problem::build(vec![rb(3, 10, 1), rb(0, 4, 1)], Some(10));
        assert_eq!(p.always_live(), vec![0]);
    }
}
