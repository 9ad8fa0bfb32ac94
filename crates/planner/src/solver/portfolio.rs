//! The solve pipeline: normalise, split, greedy portfolio, improvement, assemble.
//!
//! Components (groups of buffers connected in time) are independent: the pool peak
//! is the bottom stack plus the largest component peak, so each component is solved
//! on its own, large ones one after the other with all threads on their portfolio,
//! small ones side by side with one thread each. The improvement stage then visits
//! components from the highest peak down, each aiming at the best the whole pool can
//! reach (the largest component lower bound, raised by every component that could not
//! be pushed below it): effort spent below that level would not lower the pool.
//! Parallel work is split into numbered tasks whose results are reduced by
//! (peak, task number), so thread timing never changes the answer.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use stweaver_core::{Bytes, Offset};

use super::bestfit::{Fit, align_up, place_in_order};
use super::improve;
use super::instance::{Instance, InstanceError, Solution};
use super::order::{Features, Key};
use super::problem::{Problem, RawBuf};
use super::{Progress, SolveOptions};

/// Components up to this many buffers are solved one per thread.
const SMALL_COMPONENT: usize = 2_000;

/// A placement of one component.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    pub offsets: Vec<u64>,
    pub peak: u64,
}

/// Shared state of one `solve` call.
pub(crate) struct Ctx<'a> {
    pub opts: &'a SolveOptions,
    pub start: Instant,
    pub deadline: Option<Instant>,
    lower_bound: u64,
    base: u64,
    comp_best: Mutex<Vec<u64>>,
}

impl Ctx<'_> {
    /// True once the time budget is spent or the run was cancelled.
    pub fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d) || self.cancelled()
    }

    /// True once [`SolveOptions::cancel`] is set.
    pub fn cancelled(&self) -> bool {
        self.opts
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed))
    }

    /// Records component `comp`'s best peak and reports progress if the pool's improved.
    pub fn improved(&self, stage: &'static str, comp: usize, peak: u64) {
        let report = {
            let Ok(mut best) = self.comp_best.lock() else {
                return;
            };
            if peak >= best[comp] {
                return;
            }
            let before = best.iter().copied().max();
            best[comp] = peak;
            let after = best.iter().copied().max();
            after != before && after != Some(u64::MAX)
        };
        if report {
            self.report(stage);
        }
    }

    /// Reports the current state.
    pub fn report(&self, stage: &'static str) {
        let Some(cb) = &self.opts.progress else {
            return;
        };
        let best = self
            .comp_best
            .lock()
            .ok()
            .and_then(|b| b.iter().copied().max())
            .filter(|&m| m != u64::MAX)
            .map(|m| Bytes(self.base + m));
        cb(&Progress {
            stage,
            best_peak: best,
            lower_bound: Bytes(self.lower_bound),
            elapsed: self.start.elapsed(),
        });
    }
}

/// Runs `count` numbered tasks on `threads` threads; task 0 always runs, the others
/// only while `ctx` has time left. Results come back in task order.
pub(crate) fn par_tasks<T: Send>(
    ctx: &Ctx<'_>,
    threads: usize,
    count: usize,
    task: &(dyn Fn(usize) -> T + Sync),
) -> Vec<Option<T>> {
    run_tasks(threads, count, &|i| i == 0 || !ctx.expired(), task)
}

/// Runs the numbered tasks `0..count` on `threads` threads, each thread taking the
/// next number until they run out or `starts(i)` says task `i` must not start (then
/// that thread stops). Results come back in task order, `None` for a task not run.
fn run_tasks<T: Send>(
    threads: usize,
    count: usize,
    starts: &(dyn Fn(usize) -> bool + Sync),
    task: &(dyn Fn(usize) -> T + Sync),
) -> Vec<Option<T>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<T>>> = Mutex::new((0..count).map(|_| None).collect());
    let work = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= count || !starts(i) {
                break;
            }
            let r = task(i);
            if let Ok(mut res) = results.lock() {
                res[i] = Some(r);
            }
        }
    };
    let threads = threads.clamp(1, count.max(1));
    if threads == 1 {
        work();
    } else {
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(work);
            }
        });
    }
    results.into_inner().unwrap_or_default()
}

/// The greedy strategies of the portfolio, in task order.
fn strategies(n: usize, seed: u64) -> Vec<(Key, Fit, f64, u64)> {
    let mut out = Vec::new();
    for key in Key::ALL {
        out.push((key, Fit::Best, 0.0, 0));
    }
    for key in Key::ALL {
        out.push((key, Fit::First, 0.0, 0));
    }
    // Perturbed restarts around the keys that do best on real traces.
    let restarts = if n <= 5_000 {
        48
    } else if n <= 40_000 {
        16
    } else {
        6
    };
    let keys = [
        Key::SizeLen,
        Key::Area,
        Key::Taw,
        Key::LenSize,
        Key::Wat,
        Key::Twa,
    ];
    for r in 0..restarts {
        let key = keys[r % keys.len()];
        let amplitude = [0.02, 0.05, 0.1, 0.2][(r / keys.len()) % 4];
        out.push((key, Fit::Best, amplitude, seed.wrapping_add(r as u64 + 1)));
    }
    out
}

/// The best greedy placement of `p` over the portfolio.
pub(crate) fn greedy(ctx: &Ctx<'_>, comp: usize, p: &Problem, threads: usize) -> Candidate {
    let features = Features::new(p);
    let list = strategies(p.len(), ctx.opts.seed);
    let results = par_tasks(ctx, threads, list.len(), &|t| {
        let (key, fit, amplitude, seed) = list[t];
        let order = features.order(key, amplitude, seed);
        let (offsets, peak) = place_in_order(p, &order, fit);
        ctx.improved("greedy", comp, peak);
        Candidate { offsets, peak }
    });
    best_of(results).expect("task 0 always runs")
}

/// The lowest-peak candidate, ties to the lowest task number.
pub(crate) fn best_of(results: Vec<Option<Candidate>>) -> Option<Candidate> {
    let mut best: Option<Candidate> = None;
    for c in results.into_iter().flatten() {
        if best.as_ref().is_none_or(|b| c.peak < b.peak) {
            best = Some(c);
        }
    }
    best
}

/// The normalised problem of `instance` (zero-size buffers left out) and, per problem
/// buffer, its index in the instance.
pub fn normalise(instance: &Instance) -> (Problem, Vec<u32>) {
    let mut raw = Vec::with_capacity(instance.buffers.len());
    let mut map = Vec::with_capacity(instance.buffers.len());
    for (i, b) in instance.buffers.iter().enumerate() {
        if b.size.0 == 0 {
            continue;
        }
        let start = match instance.period {
            Some(l) => b.lower % l,
            None => b.lower,
        };
        raw.push(RawBuf {
            start,
            len: b.upper - b.lower,
            size: b.size.0,
            align: b.align.0,
        });
        map.push(i as u32);
    }
    (Problem::build(raw, instance.period), map)
}

/// Plans `instance` (validated here); the caller checks the result.
pub(crate) fn solve(instance: &Instance, opts: &SolveOptions) -> Result<Solution, InstanceError> {
    instance.validate()?;
    let start = Instant::now();
    let threads = if opts.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        opts.threads
    };
    let (full, map) = normalise(instance);
    let mut offsets = vec![Offset(0); instance.buffers.len()];
    if full.len() == 0 {
        return Ok(Solution {
            offsets,
            peak: Bytes(0),
        });
    }
    let lower_bound = full.lower_bound();

    // Bottom stack: buffers live whenever anything is.
    let always = if full.len() > 1 {
        full.always_live()
    } else {
        Vec::new()
    };
    let mut in_stack = vec![false; full.len()];
    let mut height = 0u64;
    for &i in &always {
        let i = i as usize;
        in_stack[i] = true;
        let at = align_up(height, full.align(i));
        offsets[map[i] as usize] = Offset(at);
        height = at + full.size(i);
    }
    let rest_idx: Vec<u32> = (0..full.len() as u32)
        .filter(|&i| !in_stack[i as usize])
        .collect();
    let rest = full.subproblem(&rest_idx);
    let max_align = rest.raw.iter().map(|b| b.align).max().unwrap_or(1);
    let base = align_up(height, max_align);
    let comps = rest.components();

    let ctx = Ctx {
        opts,
        start,
        deadline: opts.time_budget.map(|d| start + d),
        lower_bound,
        base,
        comp_best: Mutex::new(vec![u64::MAX; comps.len()]),
    };
    ctx.report("greedy");

    let subs: Vec<Problem> = comps.iter().map(|c| rest.subproblem(c)).collect();
    let mut cands: Vec<Option<Candidate>> = (0..comps.len()).map(|_| None).collect();
    // Large components: one at a time, all threads on the portfolio.
    for (c, sub) in subs.iter().enumerate() {
        if sub.len() > SMALL_COMPONENT {
            cands[c] = Some(greedy(&ctx, c, sub, threads));
        }
    }
    // Small components: side by side, one thread each. Every one gets a plan: the
    // outer tasks ignore the deadline, and a portfolio always runs its first strategy.
    let small: Vec<usize> = (0..subs.len())
        .filter(|&c| subs[c].len() <= SMALL_COMPONENT)
        .collect();
    let solved = par_tasks_all(threads, small.len(), &|k| {
        let c = small[k];
        greedy(&ctx, c, &subs[c], 1)
    });
    for (k, cand) in solved.into_iter().enumerate() {
        cands[small[k]] = Some(cand);
    }

    // Improvement: highest peak first, each aiming at what the pool can still reach.
    if opts.improve {
        let mut floor = subs.iter().map(|s| s.lower_bound()).max().unwrap_or(0);
        let mut order: Vec<usize> = (0..subs.len()).collect();
        order.sort_by_key(|&c| {
            (
                std::cmp::Reverse(cands[c].as_ref().map_or(0, |x| x.peak)),
                c,
            )
        });
        for c in order {
            let Some(cand) = cands[c].take() else {
                continue;
            };
            let better = improve::improve(&ctx, c, &subs[c], cand, floor, threads);
            floor = floor.max(better.peak);
            cands[c] = Some(better);
        }
    }

    // Assemble.
    let mut peak = height;
    for (c, comp) in comps.iter().enumerate() {
        let cand = cands[c].as_ref().expect("every component was planned");
        for (j, &ri) in comp.iter().enumerate() {
            let fi = rest_idx[ri as usize] as usize;
            let at = base + cand.offsets[j];
            offsets[map[fi] as usize] = Offset(at);
            peak = peak.max(at + rest.size(ri as usize));
        }
    }
    ctx.report("done");
    Ok(Solution {
        offsets,
        peak: Bytes(peak),
    })
}

/// Like [`par_tasks`], but every task runs (no deadline).
fn par_tasks_all<T: Send>(
    threads: usize,
    count: usize,
    task: &(dyn Fn(usize) -> T + Sync),
) -> Vec<T> {
    run_tasks(threads, count, &|_| true, task)
        .into_iter()
        .map(|r| r.expect("every task ran"))
        .collect()
}
