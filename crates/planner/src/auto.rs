//! Auto mode's policy, in one place for the runtime that runs it
//! (`crates/torch-bridge/src/runtime/plan.rs`) and the engine replay that reproduces it
//! on a CPU ([`crate::engine_replay`], the `stweaver (auto)` row of `stweaver compare`).
//!
//! # The algorithm
//!
//! The runtime counts iteration boundaries (`stweaver.step()`, called by the optimizer
//! hook at the end of each optimizer step): the `n`-th boundary is *step* `n`.
//!
//! 1. **Record.** From the first request on, the default pool's engine serves online
//!    (best fit over growable arenas) and records its own trace.
//! 2. **Plan.** At the first step `n` with [`plans_at_step`]`(n, auto_iterations)`
//!    (`n > auto_iterations`: the recording then holds `auto_iterations` whole
//!    iterations after the first step, [`DEFAULT_AUTO_ITERATIONS`] unless
//!    `STWEAVER_AUTO_ITERATIONS` says) the recording is taken from the engine and
//!    planned in the background with [`plan_recording`] (the planner's greedy stage only,
//!    [`auto_plan_options`]). Serving stays online meanwhile.
//! 3. **Switch.** At the first later step at which the planner has finished (in the
//!    replay: the next one, [`SWITCH_DELAY_STEPS`], the earliest the runtime can), the
//!    engine switches to the plan's steady iteration (`Engine::switch_to_plan`: the online
//!    cache is released first, the online allocations stay where they are). A planner
//!    error or a plan the engine refuses means the run stays online, for good.
//! 4. **Settle.** One step after the switch the online cache is emptied again: the
//!    previous iteration's online blocks are gone by then.
//!
//! **Iteration classes.** A recording with no single repeating iteration (a loop of a
//! few sequence lengths) plans to a plan without an iteration section, which the engine
//! cannot switch to ([`needs_classes`]). Auto mode then records again, from that step,
//! for [`CLASS_ITERATIONS`] iterations, and plans that recording per iteration class
//! ([`plan_class_recording`]: `crate::class_planning`, issue #18 item 1); the switch
//! follows as in step 3. A recording whose classes are too many to plan (the planned
//! ones cover less than 90 % of its iterations) leaves the run online, as before.
//!
//! **Learning after the switch** (issue #18 item 2). A plan per class serves the
//! classes its recording saw; a class first seen later (a longer sequence length, an
//! eval of another batch) is served beside the plan, from the pool's holes and its
//! growth. At a boundary whose iteration was mostly not served by the plan
//! ([`unknown_iteration`]: more requests unplanned or in conflict than planned hits, of
//! [`UNKNOWN_MIN_REQUESTS`] at least), auto mode records again, from that step, for
//! [`RELEARN_ITERATIONS`] iterations while the plan keeps serving, plans that
//! recording per class in the background ([`plan_relearned`]: every class it saw, no
//! coverage floor) and adds the classes the served plan lacks
//! ([`crate::class_planning::merge_class_plans`]: the served classes keep their
//! places, the pool grows to the largest class). At the first later step at which the
//! planner has finished, the engine gives up the old plan and switches to the merged
//! one (`Engine::unload_plan`, then `Engine::switch_to_plan`; what is live in the old
//! pool stays there until freed), and the cache is emptied one step later as after the
//! first switch. At most [`MAX_RELEARNS`] rounds per run, and none once the plan has
//! [`stweaver_core::engine::MAX_PLAN_CLASSES`] classes (the cursor follows no more); a
//! round that finds nothing new, or whose planning fails, leaves the served plan as it
//! is. A plan of one repeating iteration learns too: its first recording's few iterations
//! may have been alike by chance (three lengths drawn at random, the first ones equal; on
//! the H100 a small loop served such a plan with more requests unplanned than planned).
//! Its iteration, planned across the boundary, is no class to merge with: the round's
//! plan per class replaces it. Loops whose strays are phases (an eval, a checkpoint) do
//! not start rounds: their iterations stay mostly planned (the long loops' replays).
//!
//! From the switch on the engine may still give the plan up (its ranges stay busy, or
//! its pool hits the memory limit): serving is online from there.
//!
//! Serving defaults of the runtime that the replay shares: [`RELEASE_AT_PEAK`],
//! [`RELEASE_CHURN`].

use std::time::Duration;

use stweaver_core::{Plan, Trace};

use crate::class_planning::{ClassPlanOptions, merge_class_plans, plan_classes};
use crate::planning::{PlanOptions, plan_trace};
use crate::solver::SolveOptions;

/// Iterations auto mode records before it plans, unless `STWEAVER_AUTO_ITERATIONS` says.
pub const DEFAULT_AUTO_ITERATIONS: u64 = 4;

/// Iterations auto mode records for a plan per iteration class (module docs): with
/// five classes in random order, all five are in 40 iterations but with probability
/// 5 x 0.8^40 < 0.1 %.
pub const CLASS_ITERATIONS: u64 = 40;

/// Iterations auto mode records to learn the classes first seen after its switch
/// (module docs, learning after the switch).
pub const RELEARN_ITERATIONS: u64 = CLASS_ITERATIONS;

/// Rounds of learning after the switch, at most, per run (module docs).
pub const MAX_RELEARNS: u32 = 3;

/// Requests an iteration must make, at least, to count as one of a class the plan
/// does not know ([`unknown_iteration`]): a boundary with a few stray requests
/// (a checkpoint's digest) is no class.
pub const UNKNOWN_MIN_REQUESTS: u64 = 64;

/// Whether an iteration served by a plan per class was of a class the plan does not
/// know: `hits` of its requests were served at their planned offsets, `misses`
/// (unplanned and conflicts) were not; more misses than hits, of
/// [`UNKNOWN_MIN_REQUESTS`] requests at least.
pub fn unknown_iteration(hits: u64, misses: u64) -> bool {
    hits + misses >= UNKNOWN_MIN_REQUESTS && misses > hits
}

/// Whether auto mode, serving `served` after `rounds` rounds of learning, starts
/// another at an unknown iteration (module docs): fewer than [`MAX_RELEARNS`] rounds,
/// fewer than the engine's class limit, and no offload schedule (a plan that offloads
/// was made under a budget from a recording with saved-tensor markers, which a round's
/// recording lacks: its plan would lose the offload and not fit the budget).
pub fn relearns(served: &Plan, rounds: u32) -> bool {
    rounds < MAX_RELEARNS
        && served.class_count() < stweaver_core::engine::MAX_PLAN_CLASSES
        && served.offload.is_empty()
}

/// The plan auto mode switches to after a round of learning (module docs): `trace` (the
/// round's recording) planned per class with `opts`'s solver and stream settings and no
/// coverage floor, its classes that `served` lacks added to it; when `served` cannot take
/// classes (a single iteration planned across its boundary) and the recording has
/// several, the recording's plan per class alone. `Ok(None)`: nothing new. The error is
/// the text the runtime reports.
pub fn plan_relearned(
    served: &Plan,
    trace: &Trace,
    opts: &PlanOptions,
) -> Result<Option<Plan>, String> {
    let o = ClassPlanOptions {
        plan: opts.clone(),
        min_coverage_percent: 0,
        ..ClassPlanOptions::default()
    };
    let new = plan_classes(trace, &o).map_err(|e| format!("no plan per iteration class: {e}"))?;
    // A single iteration planned across its boundary (a first recording whose few
    // iterations looked periodic) takes no classes: merge_class_plans replaces it.
    Ok(merge_class_plans(served, &new.plan, o.max_classes)?.map(|m| m.plan))
}

/// Steps between the one that starts the planner and the earliest one that can switch to
/// its plan: the runtime looks at the finished planner at the following step.
pub const SWITCH_DELAY_STEPS: u64 = 1;

/// The runtime's default for `EngineConfig::release_before_new_peak` (its
/// `STWEAVER_RELEASE_AT_PEAK`, on unless set to `0`): an online arena about to set a new
/// reserved peak first gives the largest holes of the cache back.
pub const RELEASE_AT_PEAK: bool = true;

/// The runtime's default for `EngineConfig::release_churn_iterations` in **online mode**
/// (its `STWEAVER_RELEASE_CHURN`): a loop served online that releases holes before a new
/// peak in every iteration and maps them again stops releasing after 3 such iterations
/// in a row. On the H100 eval10 served online went from 1.29x native's median step to
/// native's, at 6.99 instead of 6.90 GiB. Other modes never stop (0): in auto mode the
/// stop can fall in the planning window, where eval10's online peak rose to 7.50 GiB on
/// the GPU (and in its replay with the GPU's four planning iterations), against 6.92.
pub const RELEASE_CHURN: u32 = 3;

/// Whether auto mode, still recording, plans at step `step` (module docs, step 2).
pub fn plans_at_step(step: u64, auto_iterations: u64) -> bool {
    step > auto_iterations
}

/// The first step at which auto mode plans.
pub fn planning_step(auto_iterations: u64) -> u64 {
    auto_iterations + 1
}

/// The planner settings of auto mode's background planning: the greedy stage alone,
/// tens of milliseconds on a real trace (37 ms for 1802 allocations, within 0.7 % of the
/// lower bound), so the switch comes a few iterations after recording; the improvement
/// stage took 0.5 s there, longer than whole short runs. `share_streams`:
/// `STWEAVER_SHARE_STREAMS`.
pub fn auto_plan_options(share_streams: bool) -> PlanOptions {
    PlanOptions {
        share_streams,
        solve: SolveOptions {
            improve: false,
            time_budget: Some(Duration::from_secs(5)),
            ..SolveOptions::default()
        },
        ..PlanOptions::default()
    }
}

/// Auto mode's plan of a recording without a memory budget: [`plan_trace`] with `opts`
/// (normally [`auto_plan_options`]). The error is the text the runtime reports.
pub fn plan_recording(trace: &Trace, opts: &PlanOptions) -> Result<Plan, String> {
    plan_trace(trace, opts)
        .map(|o| o.plan)
        .map_err(|e| e.to_string())
}

/// Whether auto mode, whose first recording planned to `plan`, records again for a plan
/// per iteration class (module docs): the plan has no iteration section to switch to.
pub fn needs_classes(plan: &Plan) -> bool {
    plan.iteration.is_empty()
}

/// Auto mode's plan per iteration class of a recording ([`plan_classes`] with `opts`'s
/// solver and stream settings and the default class limits). The error is the text the
/// runtime reports.
pub fn plan_class_recording(trace: &Trace, opts: &PlanOptions) -> Result<Plan, String> {
    let o = ClassPlanOptions {
        plan: opts.clone(),
        ..ClassPlanOptions::default()
    };
    plan_classes(trace, &o)
        .map(|c| c.plan)
        .map_err(|e| format!("no plan per iteration class: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_once_the_iterations_are_recorded() {
        let k = DEFAULT_AUTO_ITERATIONS;
        assert!(!plans_at_step(k, k));
        assert!(plans_at_step(planning_step(k), k));
        assert_eq!(planning_step(k), k + 1);
        let o = auto_plan_options(true);
        assert!(o.share_streams && !o.solve.improve);
        assert_eq!(o.solve.time_budget, Some(Duration::from_secs(5)));
    }
}
