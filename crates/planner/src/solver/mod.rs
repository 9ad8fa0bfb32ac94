//! The offline solver: Dynamic Storage Allocation (DSA) for one pool.
//!
//! Input: buffers with a size, an alignment and a half-open lifetime `[lower, upper)`,
//! on a linear or a circular (periodic) clock ([`Instance`]). Output: one offset per
//! buffer such that buffers live at the same instant never share a byte, with the pool
//! size `peak = max(offset + size)` as small as possible ([`Solution`]). The lower
//! bound is the largest number of bytes live at one instant ([`lower_bound`]).
//!
//! [`solve`] runs, per independent component of the instance (connected in time):
//!
//! 1. **Normalise** (`problem.rs`): compress time to slots, split circular lifetimes
//!    that cross the period boundary into two spans sharing an offset, put buffers that
//!    are live whenever anything is at the bottom (free when alignment is 1).
//! 2. **Greedy portfolio** (`bestfit.rs`, `order.rs`): best-fit and first-fit placement
//!    under many static orderings (size, length, area, start, minimalloc's WAT/TAW/TWA
//!    contention keys) plus seeded perturbed restarts, in parallel; O(n log T + P log P)
//!    each for P conflicting pairs (no conflict graph is built: `bestfit.rs`).
//! 3. **Exact improvement** (`exact.rs`): a minimalloc-style branch and bound (canonical
//!    placements in offset order, section inference, dominance, dynamic decomposition,
//!    symmetry breaking of identical buffers) proves or finds packings at the lower
//!    bound, and tightens the capacity below the incumbent when it cannot; on large
//!    components it runs as a large-neighbourhood search on windows around the peak.
//!
//! Every result is checked by [`check_solution`], an independent sweep, before it is
//! returned: the solver never hands out an aliasing plan. Results are deterministic
//! for a seed unless the time budget, rather than the effort limits, ends a stage.

mod bestfit;
mod bound;
mod check;
pub mod csv;
mod exact;
mod improve;
mod instance;
mod lns;
mod order;
mod portfolio;
mod problem;

pub use check::{MAX_REPORTED_ERRORS, SolutionError, check_solution};
pub use instance::{Buffer, Instance, InstanceError, Solution};

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use stweaver_core::Bytes;

/// A progress report, sent whenever the best plan improves or a stage begins.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// The stage running now (`"greedy"`, `"exact"`, `"neighbourhood"`, `"done"`).
    pub stage: &'static str,
    /// The smallest peak found so far (`None` before the first plan exists).
    pub best_peak: Option<Bytes>,
    pub lower_bound: Bytes,
    /// Since `solve` began.
    pub elapsed: Duration,
}

/// A progress callback; called from solver threads.
pub type ProgressFn = Arc<dyn Fn(&Progress) + Send + Sync>;

/// How hard and how wide to search.
#[derive(Clone)]
pub struct SolveOptions {
    /// Seeds the perturbed orderings and search restarts.
    pub seed: u64,
    /// Worker threads; 0 means all available cores.
    pub threads: usize,
    /// Wall-clock limit. When it expires the best plan found so far is returned.
    /// `None`: the stages stop on their own effort limits only (deterministic).
    pub time_budget: Option<Duration>,
    /// Run the exact / neighbourhood improvement stage (default true).
    pub improve: bool,
    /// Called on progress; `None` for silence.
    pub progress: Option<ProgressFn>,
    /// Cancellation: once it reads `true` (e.g. set by a Ctrl-C handler), every stage
    /// stops as if the time budget had expired and the best plan found so far is
    /// returned. Polled, never reset by the solver.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Default for SolveOptions {
    fn default() -> SolveOptions {
        SolveOptions {
            seed: 0,
            threads: 1,
            time_budget: None,
            improve: true,
            progress: None,
            cancel: None,
        }
    }
}

impl std::fmt::Debug for SolveOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SolveOptions")
            .field("seed", &self.seed)
            .field("threads", &self.threads)
            .field("time_budget", &self.time_budget)
            .field("improve", &self.improve)
            .field("progress", &self.progress.as_ref().map(|_| "callback"))
            .field("cancel", &self.cancel)
            .finish()
    }
}

/// Why [`solve`] returned no solution.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SolveError {
    #[error("invalid instance: {0}")]
    Invalid(#[from] InstanceError),
    /// A solver bug caught by the independent checker; the plan is withheld.
    #[error("internal error: the plan failed the independent check ({} problem(s), first: {})", .0.len(), .0.first().map(|e| e.to_string()).unwrap_or_default())]
    Internal(Vec<SolutionError>),
}

/// Plans `instance`. See the module documentation for the stages.
pub fn solve(instance: &Instance, options: &SolveOptions) -> Result<Solution, SolveError> {
    let solution = portfolio::solve(instance, options)?;
    check_solution(instance, &solution).map_err(SolveError::Internal)?;
    Ok(solution)
}

pub use bound::lower_bound;
