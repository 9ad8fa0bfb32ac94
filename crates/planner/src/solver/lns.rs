//! Large-neighbourhood search: exact re-packing of windows around the peak.
//!
//! For a component too large to search whole, pick a capacity `C` below the incumbent
//! peak. Every buffer reaching above `C` must move; they are grouped into time
//! clusters. For each cluster, a neighbourhood is freed: the buffers live in the
//! cluster's time window (widened by a margin) whose tops are highest, up to a size
//! limit; everything else stays where it is. The fixed buffers become obstacles (per
//! free buffer: the address ranges of fixed buffers it meets in time; per slot: those
//! live in the slot, for section inference), and the branch and bound of
//! [`super::exact`] looks for a re-packing under `C`. Success commits the window at
//! once (the plan stays valid after every step); failure halves the step `peak - C`
//! and, after a few failures at one step, widens the neighbourhood. The first attempt
//! aims straight at the target. A window costs O(n log T) to index the fixed buffers
//! plus the search, which is node-limited.

use super::bestfit::Placer;
use super::exact::{Exact, Obstacles, Outcome};
use super::improve::probe;
use super::portfolio::{Candidate, Ctx};
use super::problem::{Problem, Span};

/// Neighbourhood sizes tried, smallest first.
const SIZES: [usize; 4] = [150, 300, 600, 1_000];
/// Node budget of one window search.
const WINDOW_NODES: u64 = 400_000;
/// Window searches per component (absent a time budget).
const MAX_WINDOWS: usize = 200;

/// Improves `inc`, a packing of `p` (component `comp`), aiming at `target`.
pub(crate) fn improve(
    ctx: &Ctx<'_>,
    comp: usize,
    p: &Problem,
    mut inc: Candidate,
    target: u64,
    threads: usize,
) -> Candidate {
    let floor = target.max(p.lower_bound());
    if inc.peak <= floor {
        return inc;
    }
    let mut step = inc.peak - floor;
    let mut size_idx = 0usize;
    let mut windows = 0usize;
    let min_step = (inc.peak - floor).div_ceil(4096).max(1);
    while inc.peak > floor && windows < MAX_WINDOWS && !ctx.expired() {
        let cap = inc.peak.saturating_sub(step).max(floor);
        let (ok, tried) = repack(ctx, p, &mut inc, cap, SIZES[size_idx], threads);
        windows += tried.max(1);
        if ok {
            ctx.improved("neighbourhood", comp, inc.peak);
        } else if step > min_step {
            step = (step / 2).max(min_step);
        } else if size_idx + 1 < SIZES.len() {
            size_idx += 1;
            step = (inc.peak - floor).max(1);
        } else {
            break;
        }
    }
    inc
}

/// Tries to bring every buffer of `inc` under `cap` by re-packing windows of at most
/// `limit` buffers. Returns whether the whole plan is now under `cap` (windows that
/// succeed are kept even if another fails) and how many windows were searched.
fn repack(
    ctx: &Ctx<'_>,
    p: &Problem,
    inc: &mut Candidate,
    cap: u64,
    limit: usize,
    threads: usize,
) -> (bool, usize) {
    let n = p.len();
    let top = |inc: &Candidate, i: usize| inc.offsets[i] + p.size(i);
    let high: Vec<usize> = (0..n).filter(|&i| top(inc, i) > cap).collect();
    if high.is_empty() {
        return (true, 0);
    }
    if high.len() > limit {
        return (false, 0);
    }
    // Cluster the buffers above `cap` by time: spans sorted by start, merged.
    let mut spans: Vec<(Span, usize)> = high
        .iter()
        .flat_map(|&i| p.spans(i).iter().map(move |&s| (s, i)))
        .collect();
    spans.sort_unstable_by_key(|(s, _)| (s.lo, s.hi));
    let mut clusters: Vec<Vec<Span>> = Vec::new();
    let mut hull_hi = 0u32;
    for (s, _) in &spans {
        match clusters.last_mut() {
            Some(c) if s.lo < hull_hi => {
                c.push(*s);
                hull_hi = hull_hi.max(s.hi);
            }
            _ => {
                clusters.push(vec![*s]);
                hull_hi = s.hi;
            }
        }
    }
    let mut tried = 0;
    for cluster in clusters {
        if ctx.expired() {
            break;
        }
        tried += 1;
        let lo = cluster.iter().map(|s| s.lo).min().unwrap_or(0);
        let hi = cluster.iter().map(|s| s.hi).max().unwrap_or(0);
        if !repack_window(ctx, p, inc, cap, Span { lo, hi }, limit, threads) {
            break;
        }
    }
    // Windows that succeeded moved buffers under `cap`: the peak can only have dropped.
    let peak = (0..n).map(|i| top(inc, i)).max().unwrap_or(0);
    inc.peak = peak;
    (peak <= cap, tried)
}

/// Re-packs the neighbourhood of `window` under `cap`; commits and returns true on
/// success.
fn repack_window(
    ctx: &Ctx<'_>,
    p: &Problem,
    inc: &mut Candidate,
    cap: u64,
    window: Span,
    limit: usize,
    threads: usize,
) -> bool {
    let n = p.len();
    let top = |i: usize| inc.offsets[i] + p.size(i);
    // Widen the window while the candidates stay few; take the highest tops.
    let live_in = |w: Span| -> Vec<usize> {
        (0..n)
            .filter(|&i| p.spans(i).iter().any(|s| s.meets(w)))
            .collect()
    };
    let mut w = window;
    let mut cands = live_in(w);
    for _ in 0..8 {
        let grow = ((w.hi - w.lo) / 2).max(1);
        let wider = Span {
            lo: w.lo.saturating_sub(grow),
            hi: (w.hi + grow).min(p.slots),
        };
        if wider == w {
            break;
        }
        let more = live_in(wider);
        if more.len() > limit {
            break;
        }
        w = wider;
        cands = more;
    }
    cands.sort_unstable_by_key(|&i| (std::cmp::Reverse(top(i)), i));
    cands.truncate(limit);
    let mut free = vec![false; n];
    for &i in &cands {
        free[i] = true;
    }
    if (0..n).any(|i| !free[i] && top(i) > cap) {
        return false;
    }
    let idx: Vec<u32> = cands.iter().map(|&i| i as u32).collect();
    let sub = p.subproblem(&idx);

    // Obstacles: the fixed buffers, indexed by time.
    let mut fixed = Placer::new(p);
    for (i, &is_free) in free.iter().enumerate() {
        if !is_free {
            fixed.fix(i, inc.offsets[i]);
        }
    }
    let clip = |v: Vec<(u64, u64)>| -> Vec<(u64, u64)> {
        v.into_iter()
            .filter(|&(lo, _)| lo < cap)
            .map(|(lo, hi)| (lo, hi.min(cap)))
            .collect()
    };
    let per_buffer: Vec<Vec<(u64, u64)>> = cands
        .iter()
        .map(|&i| clip(fixed.occupied(p.spans(i))))
        .collect();
    let mut per_slot = Vec::with_capacity(sub.slots as usize);
    for k in 0..sub.slots as usize {
        let (Some(a), Some(b)) = (p.slot_at(sub.points[k]), p.slot_at(sub.points[k + 1])) else {
            return false;
        };
        per_slot.push(clip(fixed.occupied(&[Span { lo: a, hi: b }])));
    }
    let ex = Exact::new(
        &sub,
        Some(Obstacles {
            per_buffer,
            per_slot,
        }),
    );
    let (outcome, _) = probe(ctx, &ex, cap, WINDOW_NODES, ctx.deadline, threads);
    match outcome {
        Outcome::Found(off) => {
            for (k, &i) in cands.iter().enumerate() {
                inc.offsets[i] = off[k];
            }
            true
        }
        Outcome::Infeasible | Outcome::Stopped => false,
    }
}
