//! Placing buffers into the address × time holes left by fixed ones.
//!
//! The prologue is planned after the steady state (see [`super`]): its requests go
//! wherever the already-placed iteration copies and resident tensors leave room. Each
//! item, in a chosen order, gets the offset of a gap in the union of the address ranges
//! of everything (fixed or already placed) live during its lifetime: the smallest gap
//! that fits (best fit) or the lowest (first fit), and when no gap fits, the top of
//! that union. [`place_best`] runs a small portfolio of orders × fits and keeps the
//! placement with the lowest top (stopping early once the top is low enough).
//!
//! Rectangles live in a time index: those longer than a horizon (the 90th percentile of
//! lifetimes, and every unbounded one) in one list scanned by every query, the others
//! in buckets of the horizon's width by start time, so that a query over `[t0, t1)`
//! scans the long list plus the buckets from `t0 - horizon` to `t1`. Cost per item:
//! O(R_long + R_window + k log k) for the `k` rectangles it meets; per placement run
//! O(n · that); the portfolio runs [`ORDERS`] × 2 placements.

/// An occupied rectangle: addresses `[lo, hi)` over ticks `[t0, t1)` (`t1 = u64::MAX`:
/// forever).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rect {
    pub t0: u64,
    pub t1: u64,
    pub lo: u64,
    pub hi: u64,
}

/// A buffer to place: `size` bytes (already a multiple of the alignment) over `[t0, t1)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Item {
    pub t0: u64,
    pub t1: u64,
    pub size: u64,
    /// Placed first by the `crossing-first` order (it lives into the steady state).
    pub crossing: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fit {
    Best,
    First,
}

/// The orders of the portfolio.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// Crossing items first, then by size, then by lifetime (both descending).
    CrossingFirst,
    /// By size, then lifetime, descending.
    Size,
    /// By lifetime, then size, descending.
    Duration,
    /// By size × lifetime, descending.
    Area,
    /// By start (the run's own order).
    Start,
}

pub(crate) const ORDERS: [Order; 5] = [
    Order::CrossingFirst,
    Order::Size,
    Order::Duration,
    Order::Area,
    Order::Start,
];

/// Offsets of the items (same order as given) and the highest byte any of them uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placement {
    pub offsets: Vec<u64>,
    pub top: u64,
    pub order: Order,
    pub fit: Fit,
}

struct Index {
    horizon: u64,
    long: Vec<Rect>,
    buckets: Vec<Vec<Rect>>,
}

impl Index {
    fn new(horizon: u64, t_end: u64) -> Index {
        let horizon = horizon.max(1);
        let n = (t_end / horizon + 1).min(1 << 22) as usize;
        Index {
            horizon,
            long: Vec::new(),
            buckets: vec![Vec::new(); n],
        }
    }

    fn bucket(&self, t: u64) -> usize {
        ((t / self.horizon) as usize).min(self.buckets.len() - 1)
    }

    fn insert(&mut self, r: Rect) {
        if r.t1 - r.t0 > self.horizon {
            self.long.push(r);
        } else {
            let b = self.bucket(r.t0);
            self.buckets[b].push(r);
        }
    }

    /// Pushes `[lo, hi)` of every rectangle live somewhere in `[t0, t1)` into `out`.
    fn query(&self, t0: u64, t1: u64, out: &mut Vec<(u64, u64)>) {
        let hit = |r: &Rect| r.t0 < t1 && r.t1 > t0;
        out.extend(self.long.iter().filter(|r| hit(r)).map(|r| (r.lo, r.hi)));
        // A short rectangle meeting the window starts at or after `t0 - horizon`.
        let first = self.bucket(t0.saturating_sub(self.horizon));
        let last = self.bucket(t1 - 1);
        for b in &self.buckets[first..=last] {
            out.extend(b.iter().filter(|r| hit(r)).map(|r| (r.lo, r.hi)));
        }
    }
}

/// The offset for `size` bytes given the occupied ranges `occ` (sorted in place).
fn choose(occ: &mut [(u64, u64)], size: u64, fit: Fit) -> u64 {
    occ.sort_unstable();
    let mut best: Option<(u64, u64)> = None; // (gap length, offset)
    let mut reach = 0u64; // end of the merged occupied run so far
    for &(lo, hi) in occ.iter() {
        if lo > reach {
            let gap = lo - reach;
            if gap >= size {
                match fit {
                    Fit::First => return reach,
                    Fit::Best => {
                        if best.is_none_or(|(g, _)| gap < g) {
                            best = Some((gap, reach));
                        }
                    }
                }
            }
        }
        reach = reach.max(hi);
    }
    best.map_or(reach, |(_, off)| off)
}

fn order_of(items: &[Item], order: Order) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..items.len() as u32).collect();
    let dur = |i: &u32| {
        let it = &items[*i as usize];
        it.t1 - it.t0
    };
    let size = |i: &u32| items[*i as usize].size;
    match order {
        Order::CrossingFirst => idx.sort_by_key(|i| {
            (
                !items[*i as usize].crossing,
                std::cmp::Reverse(size(i)),
                std::cmp::Reverse(dur(i)),
            )
        }),
        Order::Size => idx.sort_by_key(|i| (std::cmp::Reverse(size(i)), std::cmp::Reverse(dur(i)))),
        Order::Duration => {
            idx.sort_by_key(|i| (std::cmp::Reverse(dur(i)), std::cmp::Reverse(size(i))))
        }
        Order::Area => idx.sort_by_key(|i| std::cmp::Reverse(size(i) as u128 * dur(i) as u128)),
        Order::Start => idx.sort_by_key(|i| items[*i as usize].t0),
    }
    idx
}

/// Places `items` against `fixed` in the given order and fit.
pub(crate) fn place(fixed: &[Rect], items: &[Item], order: Order, fit: Fit) -> Placement {
    let t_end = items.iter().map(|i| i.t1).max().unwrap_or(0);
    let t_begin = items.iter().map(|i| i.t0).min().unwrap_or(0);
    let mut durations: Vec<u64> = items.iter().map(|i| i.t1 - i.t0).collect();
    durations.extend(
        fixed
            .iter()
            .filter(|r| r.t1 != u64::MAX)
            .map(|r| r.t1 - r.t0),
    );
    durations.sort_unstable();
    let horizon = durations
        .get(durations.len() * 9 / 10)
        .copied()
        .unwrap_or(1);
    let mut index = Index::new(horizon, t_end);
    for r in fixed {
        // Only what can meet an item matters.
        if r.t0 < t_end && r.t1 > t_begin && r.hi > r.lo {
            index.insert(*r);
        }
    }
    let mut offsets = vec![0u64; items.len()];
    let mut top = 0u64;
    let mut occ = Vec::new();
    for i in order_of(items, order) {
        let it = items[i as usize];
        occ.clear();
        index.query(it.t0, it.t1, &mut occ);
        let off = choose(&mut occ, it.size, fit);
        offsets[i as usize] = off;
        top = top.max(off + it.size);
        index.insert(Rect {
            t0: it.t0,
            t1: it.t1,
            lo: off,
            hi: off + it.size,
        });
    }
    Placement {
        offsets,
        top,
        order,
        fit,
    }
}

/// The best of [`ORDERS`] × {best fit, first fit}: lowest top, the first such. Stops at
/// the first placement whose top is at most `good_enough` (nothing below it helps: the
/// caller's pool is at least that high anyway).
pub(crate) fn place_best(fixed: &[Rect], items: &[Item], good_enough: u64) -> Placement {
    let mut best: Option<Placement> = None;
    'search: for order in ORDERS {
        for fit in [Fit::Best, Fit::First] {
            let p = place(fixed, items, order, fit);
            if best.as_ref().is_none_or(|b| p.top < b.top) {
                best = Some(p);
            }
            if best.as_ref().is_some_and(|b| b.top <= good_enough) {
                break 'search;
            }
        }
    }
    best.unwrap_or(Placement {
        offsets: Vec::new(),
        top: 0,
        order: Order::Size,
        fit: Fit::Best,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn overlaps(a: (u64, u64, u64, u64), b: (u64, u64, u64, u64)) -> bool {
        a.0 < b.1 && b.0 < a.1 && a.2 < b.3 && b.2 < a.3
    }

    #[test]
    fn best_fit_takes_the_tightest_hole() {
        // Occupied [0,512) and [1024,2048) and [2560, 3072): holes of 512 at 512 and
        // at 2048; a 512-byte item fits either; best fit takes the first equal one.
        let mut occ = vec![(1024, 2048), (0, 512), (2560, 3072)];
        assert_eq!(choose(&mut occ, 512, Fit::Best), 512);
        let mut occ = vec![(0, 512), (1536, 2048), (2560, 3072)];
        // Holes: 1024 at 512, 512 at 2048 -> best fit 2048, first fit 512.
        assert_eq!(choose(&mut occ.clone(), 512, Fit::Best), 2048);
        assert_eq!(choose(&mut occ, 512, Fit::First), 512);
        // Nothing fits: on top.
        let mut occ = vec![(0, 512), (1024, 1536)];
        assert_eq!(choose(&mut occ, 1024, Fit::Best), 1536);
        assert_eq!(choose(&mut Vec::new(), 1024, Fit::Best), 0);
    }

    #[test]
    fn items_fill_the_holes_of_fixed_rectangles() {
        // A fixed block over [0, 10) at [0, 1024) and a forever one at [1024, 2048)
        // from tick 5: an item over [0, 4) fits under at 1024, one over [12, 20) at 0.
        let fixed = [
            Rect {
                t0: 0,
                t1: 10,
                lo: 0,
                hi: 1024,
            },
            Rect {
                t0: 5,
                t1: u64::MAX,
                lo: 1024,
                hi: 2048,
            },
        ];
        let items = [
            Item {
                t0: 0,
                t1: 4,
                size: 1024,
                crossing: false,
            },
            Item {
                t0: 12,
                t1: 20,
                size: 1024,
                crossing: false,
            },
        ];
        let p = place_best(&fixed, &items, 0);
        assert_eq!(p.offsets, vec![1024, 0]);
        assert_eq!(p.top, 2048);
    }

    proptest! {
        /// No placement overlaps a fixed rectangle or another item, whatever the order.
        #[test]
        fn placements_never_overlap(
            fixed in proptest::collection::vec((0u64..100, 1u64..40, 0u64..16, 1u64..8), 0..30),
            items in proptest::collection::vec((0u64..100, 1u64..40, 1u64..8), 1..40),
        ) {
            let fixed: Vec<Rect> = fixed
                .iter()
                .map(|&(t0, d, lo, h)| Rect { t0, t1: if d > 35 { u64::MAX } else { t0 + d }, lo: lo * 512, hi: (lo + h) * 512 })
                .collect();
            let items: Vec<Item> = items
                .iter()
                .map(|&(t0, d, s)| Item { t0, t1: t0 + d, size: s * 512, crossing: d > 20 })
                .collect();
            for order in ORDERS {
                for fit in [Fit::Best, Fit::First] {
                    let p = place(&fixed, &items, order, fit);
                    let rects: Vec<(u64, u64, u64, u64)> = items
                        .iter()
                        .zip(&p.offsets)
                        .map(|(it, &o)| (it.t0, it.t1, o, o + it.size))
                        .collect();
                    for (i, a) in rects.iter().enumerate() {
                        prop_assert_eq!(a.2 % 512, 0);
                        prop_assert!(a.3 <= p.top);
                        for f in &fixed {
                            prop_assert!(!overlaps(*a, (f.t0, f.t1, f.lo, f.hi)), "item {} vs fixed {:?}", i, f);
                        }
                        for b in &rects[..i] {
                            prop_assert!(!overlaps(*a, *b));
                        }
                    }
                }
            }
        }
    }
}
