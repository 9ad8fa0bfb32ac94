//! The improvement stage: push a component's incumbent peak down with exact search.
//!
//! Small components (up to [`EXACT_MAX`] buffers) are searched whole: a capacity
//! descent that first asks for a packing at the target (the pool-wide floor, at least
//! the component's lower bound: on most instances the optimum), then bisects between
//! the highest capacity that failed and the incumbent. Each probe is a portfolio of
//! pre-orders run round-robin with node limits that double every round (minimalloc's
//! restarts), the pre-orders of a round side by side on the worker threads. A probe
//! that proves infeasibility raises the floor for good; one that runs out of nodes only
//! moves the bisection. Found packings replace the incumbent at once, so the best plan
//! is never lost. Larger components go to the neighbourhood search ([`super::lns`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::exact::{Exact, Limits, Outcome, Preorder};
use super::lns;
use super::portfolio::{Candidate, Ctx, par_tasks};
use super::problem::Problem;

/// Components up to this many buffers are searched whole.
pub(crate) const EXACT_MAX: usize = 1_500;

/// Node budget of a whole-component descent.
const DESCENT_NODES: u64 = 24_000_000;
/// Node budget of the first probe (at the target, usually the optimum).
const FIRST_PROBE_NODES: u64 = 6_000_000;
/// Node budget of each later probe.
const PROBE_NODES: u64 = 1_500_000;

/// Improves `inc`, a packing of `p` (component `comp`), aiming at `target`.
pub(crate) fn improve(
    ctx: &Ctx<'_>,
    comp: usize,
    p: &Problem,
    inc: Candidate,
    target: u64,
    threads: usize,
) -> Candidate {
    if inc.peak <= target || ctx.expired() {
        return inc;
    }
    if p.len() <= EXACT_MAX {
        descent(ctx, comp, p, inc, target, threads)
    } else {
        lns::improve(ctx, comp, p, inc, target, threads)
    }
}

/// Whole-component capacity descent.
fn descent(
    ctx: &Ctx<'_>,
    comp: usize,
    p: &Problem,
    mut inc: Candidate,
    target: u64,
    threads: usize,
) -> Candidate {
    let ex = Exact::new(p, None);
    let lo = target.max(ex.lower_bound);
    let mut budget = DESCENT_NODES;
    // Largest capacity known (or given up) to fail; the next probe is above it.
    let mut failed = lo - 1;
    let mut first = true;
    while failed + 1 < inc.peak && budget > 0 && !ctx.expired() {
        let cap = if first {
            lo
        } else {
            failed + 1 + (inc.peak - 1 - (failed + 1)) / 2
        };
        let share = if first {
            FIRST_PROBE_NODES
        } else {
            PROBE_NODES
        }
        .min(budget);
        // With a time budget, a probe may take a share of the time left, so that a
        // hopeless probe at the lower bound cannot starve the bisection.
        let deadline = ctx.deadline.map(|d| {
            let left = d.saturating_duration_since(Instant::now());
            Instant::now() + left.mul_f64(if first { 0.4 } else { 0.25 })
        });
        first = false;
        let (outcome, used) = probe(ctx, &ex, cap, share, deadline, threads);
        budget = budget.saturating_sub(used);
        match outcome {
            Outcome::Found(offsets) => {
                let peak = (0..p.len())
                    .map(|i| offsets[i] + p.size(i))
                    .max()
                    .unwrap_or(0);
                debug_assert!(peak <= cap);
                inc = Candidate { offsets, peak };
                ctx.improved("exact", comp, peak);
            }
            Outcome::Infeasible | Outcome::Stopped => failed = cap,
        }
    }
    inc
}

/// One capacity probe: pre-orders round-robin with doubling node limits.
/// Returns the outcome and the nodes spent.
pub(crate) fn probe(
    ctx: &Ctx<'_>,
    ex: &Exact<'_>,
    capacity: u64,
    budget: u64,
    deadline: Option<Instant>,
    threads: usize,
) -> (Outcome, u64) {
    let expired = || deadline.is_some_and(|d| Instant::now() >= d) || ctx.expired();
    let heuristics = Preorder::ALL;
    let mut limit = (2 * ex.len() as u64).max(1_000);
    let mut used = 0u64;
    loop {
        let cancel: Vec<AtomicBool> = heuristics.iter().map(|_| AtomicBool::new(false)).collect();
        let results = par_tasks(ctx, threads, heuristics.len(), &|k| {
            let limits = Limits {
                nodes: limit,
                deadline,
                cancel: Some(&cancel[k]),
                interrupt: ctx.opts.cancel.as_deref(),
            };
            let out = ex.decide(capacity, heuristics[k], limits);
            if matches!(out, Outcome::Found(_)) {
                // Later pre-orders cannot win any more; earlier ones still may.
                for c in &cancel[k + 1..] {
                    c.store(true, Ordering::Relaxed);
                }
            }
            out
        });
        used += limit * heuristics.len() as u64;
        let mut proven = false;
        for r in results.into_iter().flatten() {
            match r {
                Outcome::Found(off) => return (Outcome::Found(off), used),
                Outcome::Infeasible => proven = true,
                Outcome::Stopped => {}
            }
        }
        if proven {
            return (Outcome::Infeasible, used);
        }
        if used >= budget || expired() {
            return (Outcome::Stopped, used);
        }
        limit = (2 * limit).min(budget - used);
    }
}
