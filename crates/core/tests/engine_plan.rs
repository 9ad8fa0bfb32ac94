//! Plan mode: serving a training loop from a plan, and staying safe when the run
//! departs from it.
//!
//! The workload is a small training loop: parameters allocated once (never freed),
//! then iterations of forward (activations kept, temporaries freed at once) and
//! backward (gradients, activations freed in reverse), with `mark_iteration` at each
//! iteration start. The test plans it with a naive greedy placement (parameters first,
//! then each iteration request at the lowest offset free over its lifetime), checks the
//! plan with the verifier, and serves runs of the workload from it:
//!
//! - the exact workload: every request hits its planned offset, nothing is served
//!   online, reserved memory is the plan's pool;
//! - with an extra request per iteration and a missing one: the cursor resynchronises,
//!   the extra request is served online, every other request still hits;
//! - with an activation kept alive past its planned free: the next request planned on
//!   its range is a conflict, served online, and nothing ever overlaps (sentinels);
//! - bad plans (another device, overlapping requests, too big, a second plan) are rejected
//!   and the engine keeps serving online.

use std::collections::HashMap;
use stweaver_core::testkit::audit::SentinelEngine;

use stweaver_core::engine::{DevicePtr, EngineError, MemoryLimit, PlanOptions, PlanSection};
use stweaver_core::plan::{NEVER_FREED, Plan, PlannedRequest};
use stweaver_core::units::{Bytes, DeviceId, Offset, StreamId};
use stweaver_core::verify::verify_plan;

const G: u64 = 64 << 10;
const S: StreamId = StreamId(7);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    Alloc(usize, u64),
    Free(usize),
}

fn params() -> Vec<u64> {
    vec![3 << 20, 1000, 512 << 10, 7777]
}

/// One iteration; ids are local to the iteration.
fn iteration() -> Vec<Step> {
    let mut v = Vec::new();
    let layers = 6;
    for l in 0..layers {
        v.push(Step::Alloc(l, (l as u64 + 1) * 100_000 + 123)); // activation
        v.push(Step::Alloc(100 + l, 40_000 + l as u64 * 512)); // temporary
        v.push(Step::Free(100 + l));
    }
    for l in (0..layers).rev() {
        v.push(Step::Alloc(200 + l, (l as u64 + 1) * 90_000)); // gradient
        v.push(Step::Free(l));
        v.push(Step::Free(200 + l));
    }
    v
}

fn round(n: u64) -> u64 {
    n.div_ceil(512) * 512
}

/// Greedy plan: parameters at the bottom, iteration requests at the lowest offset
/// free over their lifetime (in the iteration's plan clock).
fn make_plan() -> Plan {
    let mut prologue = Vec::new();
    let mut top = 0;
    for (t, &size) in params().iter().enumerate() {
        prologue.push(PlannedRequest {
            size: Bytes(size),
            stream: S,
            offset: Offset(top),
            start: t as u64,
            end: NEVER_FREED,
        });
        top += round(size);
    }
    let steps = iteration();
    let mut start: HashMap<usize, (u64, u64)> = HashMap::new();
    let mut reqs: Vec<(u64, u64, u64)> = Vec::new(); // (size, start, end)
    let mut index: HashMap<usize, usize> = HashMap::new();
    for (t, s) in steps.iter().enumerate() {
        match *s {
            Step::Alloc(id, size) => {
                start.insert(id, (size, t as u64));
                index.insert(id, reqs.len());
                reqs.push((size, t as u64, 0));
            }
            Step::Free(id) => reqs[index[&id]].2 = t as u64,
        }
    }
    let mut placed: Vec<(u64, u64, u64, u64)> = Vec::new(); // (off, len, start, end)
    let mut iteration = Vec::new();
    for &(size, s, e) in &reqs {
        let len = round(size);
        let mut off = top;
        loop {
            let clash = placed
                .iter()
                .find(|&&(o, l, ps, pe)| s < pe && ps < e && off < o + l && o < off + len);
            match clash {
                Some(&(o, l, _, _)) => off = o + l,
                None => break,
            }
        }
        placed.push((off, len, s, e));
        iteration.push(PlannedRequest {
            size: Bytes(size),
            stream: S,
            offset: Offset(off),
            start: s,
            end: e,
        });
    }
    let pool = placed
        .iter()
        .map(|&(o, l, _, _)| o + l)
        .max()
        .unwrap_or(top);
    let plan = Plan {
        device: DeviceId(0),
        alignment: Bytes(512),
        pool_size: Bytes(pool),
        lower_bound: Bytes(0),
        trace_digest: 0,
        prologue_len: params().len() as u64,
        prologue,
        iteration_len: steps.len() as u64,
        iteration,
        dynamic: Default::default(),
        ..Default::default()
    };
    verify_plan(&plan).expect("the test's plan is valid");
    plan
}

/// The checked engine (granules of 64 KiB, online arenas of 256 MiB), its requests all
/// on stream `S`.
struct Run(SentinelEngine);

impl std::ops::Deref for Run {
    type Target = SentinelEngine;
    fn deref(&self) -> &SentinelEngine {
        &self.0
    }
}

impl std::ops::DerefMut for Run {
    fn deref_mut(&mut self) -> &mut SentinelEngine {
        &mut self.0
    }
}

impl Run {
    fn new() -> Run {
        Run(SentinelEngine::new(G, 256 << 20))
    }

    fn alloc(&mut self, size: u64) -> DevicePtr {
        self.0.alloc(size, S)
    }

    /// Runs one iteration; `extra` allocates and frees an unplanned buffer after the
    /// third step, `skip` leaves out the allocation (and free) of that id, `leak` keeps
    /// that id alive past the iteration (returned).
    fn iteration(
        &mut self,
        extra: bool,
        skip: Option<usize>,
        leak: Option<usize>,
    ) -> Vec<DevicePtr> {
        self.engine.mark_iteration().unwrap();
        self.steps(extra, skip, leak)
    }

    /// One iteration's requests, without its boundary (see [`Run::iteration`]).
    fn steps(&mut self, extra: bool, skip: Option<usize>, leak: Option<usize>) -> Vec<DevicePtr> {
        let mut ptrs: HashMap<usize, DevicePtr> = HashMap::new();
        let mut kept = Vec::new();
        for (t, s) in iteration().into_iter().enumerate() {
            match s {
                Step::Alloc(id, _) | Step::Free(id) if Some(id) == skip => {}
                Step::Alloc(id, size) => {
                    ptrs.insert(id, self.alloc(size));
                }
                Step::Free(id) if Some(id) == leak => kept.push(ptrs[&id]),
                Step::Free(id) => {
                    let p = ptrs[&id];
                    self.free(p);
                }
            }
            if extra && t == 3 {
                let p = self.alloc(12_345);
                self.free(p);
            }
        }
        kept
    }

    fn prologue(&mut self) -> Vec<DevicePtr> {
        params().into_iter().map(|s| self.alloc(s)).collect()
    }
}

#[test]
fn the_planned_workload_is_served_entirely_from_the_plan() {
    let plan = make_plan();
    let mut r = Run::new();
    r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
    let pool = plan.pool_size.get().div_ceil(G) * G;
    let base = r.engine.snapshot().unwrap()[0].base.get();
    let ps = r.prologue();
    for (p, req) in ps.iter().zip(&plan.prologue) {
        assert_eq!(p.get(), base + req.offset.get());
    }
    for _ in 0..5 {
        r.iteration(false, None, None);
    }
    let st = r.engine.plan_stats().unwrap().unwrap();
    let n = (plan.prologue.len() + 5 * plan.iteration.len()) as u64;
    assert_eq!(
        (st.hits, st.unplanned, st.conflicts, st.skipped),
        (n, 0, 0, 0)
    );
    assert_eq!(st.iterations, 5);
    let s = r.engine.stats().unwrap();
    assert_eq!(
        s.reserved_bytes[0].peak as u64, pool,
        "nothing grown online"
    );
    assert_eq!(s.segment[0].current, 1);
    r.engine.check_invariants().unwrap();
    // The plan pool stays mapped through empty_cache.
    r.engine.empty_cache().unwrap();
    assert_eq!(
        r.engine.stats().unwrap().reserved_bytes[0].current as u64,
        pool
    );
    for p in ps {
        r.free(p);
    }
    r.engine.check_invariants().unwrap();
}

#[test]
fn extra_and_missing_requests_do_not_derail_the_plan() {
    let plan = make_plan();
    let mut r = Run::new();
    r.engine
        .load_plan(
            &plan,
            PlanOptions {
                window: 8,
                ..PlanOptions::default()
            },
        )
        .unwrap();
    let ps = r.prologue();
    r.iteration(false, None, None);
    r.iteration(true, None, None); // one unplanned request
    r.iteration(false, Some(2), None); // layer 2's activation never comes
    r.iteration(true, Some(104), None);
    r.iteration(false, None, None);
    let st = r.engine.plan_stats().unwrap().unwrap();
    let per = plan.iteration.len() as u64;
    assert_eq!(st.unplanned, 2);
    assert_eq!(st.conflicts, 0);
    assert_eq!(st.skipped, 2);
    assert_eq!(st.hits, plan.prologue.len() as u64 + 5 * per - 2);
    assert_eq!(
        r.engine.plan_position().unwrap(),
        Some((PlanSection::Iteration, per as usize))
    );
    for p in ps {
        r.free(p);
    }
    r.engine.check_invariants().unwrap();
}

/// An eval pass: the forward's activations and temporaries, each freed at once (no
/// autograd graph kept), the same sizes as the training forward's.
fn eval_pass(r: &mut Run) {
    for l in 0..6u64 {
        let a = r.alloc((l + 1) * 100_000 + 123);
        let t = r.alloc(40_000 + l * 512);
        r.free(t);
        r.free(a);
    }
}

/// `plan` served over its prologue and one iteration, then three times: a boundary, `eval`
/// (inside `stweaver.phase("eval")` markers when `marked`), the next iteration's steps. The
/// run and its prologue's live blocks, invariants checked.
fn serve_with_eval_passes(
    plan: &Plan,
    marked: bool,
    eval: impl Fn(&mut Run),
) -> (Run, Vec<DevicePtr>) {
    use stweaver_core::trace::MarkerKind;
    let mut r = Run::new();
    r.engine.load_plan(plan, PlanOptions::default()).unwrap();
    let ps = r.prologue();
    r.iteration(false, None, None);
    for _ in 0..3 {
        // The boundary comes at the optimizer step; the eval pass after it, before the
        // next iteration's forward (as `python/bench/long_loops.py`'s eval10).
        r.engine.mark_iteration().unwrap();
        if marked {
            r.engine.mark(MarkerKind::PhaseBegin, Some("eval")).unwrap();
        }
        eval(&mut r);
        if marked {
            r.engine.mark(MarkerKind::PhaseEnd, Some("eval")).unwrap();
        }
        r.steps(false, None, None);
    }
    r.engine.check_invariants().unwrap();
    (r, ps)
}

#[test]
fn an_eval_pass_marked_as_a_phase_is_served_beside_the_plan() {
    let plan = make_plan();
    let per = plan.iteration.len() as u64;
    let mut stats = Vec::new();
    for phases in [true, false] {
        let (mut r, ps) = serve_with_eval_passes(&plan, phases, eval_pass);
        let st = r.engine.plan_stats().unwrap().unwrap();
        stats.push(st);
        if phases {
            // Every training request at its planned offset; the eval's 36 requests in
            // the pool's holes; nothing online, the pool not grown.
            assert_eq!(st.hits, plan.prologue.len() as u64 + 4 * per, "{st:?}");
            assert_eq!(
                (st.unplanned, st.holes, st.conflicts, st.grown),
                (36, 36, 0, 0),
                "{st:?}"
            );
            let pool = plan.pool_size.get().div_ceil(G) * G;
            assert_eq!(
                r.engine.stats().unwrap().reserved_bytes[0].peak as u64,
                pool
            );
            assert_eq!(
                r.engine.plan_position().unwrap(),
                Some((PlanSection::Iteration, per as usize))
            );
        }
        for p in ps {
            r.free(p);
        }
    }
    // Without the markers the eval's requests are taken for the iteration's (they match
    // its forward): the cursor counts them as iterations of their own. (What that costs
    // on a real loop: `crates/planner/tests/long_loops.rs`.)
    assert_eq!(
        (stats[1].unplanned, stats[1].iterations),
        (6, 7),
        "{stats:?}"
    );
}

/// An unmarked eval pass of another batch size: per batch, a few small inputs, then
/// the forward's activations and temporaries at 3 x the training forward's sizes (sizes
/// the plan never saw; the larger activations in the large pool), each freed at once.
fn eval_pass_scaled(r: &mut Run, batches: usize) {
    for _ in 0..batches {
        let inputs: Vec<DevicePtr> = (0..4).map(|k| r.alloc(2048 + k * 512)).collect();
        for l in 0..6u64 {
            let a = r.alloc(((l + 1) * 100_000 + 123) * 3);
            let t = r.alloc((40_000 + l * 512) * 3);
            r.free(t);
            r.free(a);
        }
        for p in inputs {
            r.free(p);
        }
    }
}

#[test]
fn an_unmarked_eval_pass_of_unseen_shapes_is_served_beside_the_plan() {
    let plan = make_plan();
    let mut stats = Vec::new();
    for phases in [true, false] {
        let (mut r, ps) = serve_with_eval_passes(&plan, phases, |r| eval_pass_scaled(r, 2));
        let st = r.engine.plan_stats().unwrap().unwrap();
        let s = r.engine.stats().unwrap();
        let (peak, peak_large) = (s.reserved_bytes[0].peak, s.reserved_bytes[2].peak);
        stats.push((st, peak, peak_large));
        for p in ps {
            r.free(p);
        }
    }
    let pool = (plan.pool_size.get().div_ceil(G) * G) as i64;
    let (marked, unmarked) = (stats[0], stats[1]);
    // Marked: every training request at its planned offset, the eval's 96 requests in
    // the pool's holes, the pool not grown.
    let per = plan.iteration.len() as u64;
    assert_eq!(
        marked.0.hits,
        plan.prologue.len() as u64 + 4 * per,
        "{marked:?}"
    );
    assert_eq!(
        (marked.0.unplanned, marked.0.holes, marked.0.grown, marked.1),
        (96, 96, 0, pool),
        "{marked:?}"
    );
    // Unmarked: after 8 unplanned requests in a row at the iteration start, an implicit
    // phase; the rest of the pass takes the holes the marked one takes. The training
    // requests still all hit, with no conflict; the pool does not grow (before: its large
    // activations found no hole clear of the next iteration's ranges and the pool grew
    // 3 times, to 1.29 x its size) and nothing goes to an online large arena. Only
    // requests before the detection (inputs of a few KiB, small temporaries) go online.
    assert_eq!(unmarked.0.hits, marked.0.hits, "{unmarked:?}");
    assert_eq!(
        (unmarked.0.conflicts, unmarked.0.grown, unmarked.2),
        (0, 0, pool),
        "{unmarked:?}"
    );
    assert!(unmarked.0.holes + 3 * 8 >= 96, "{unmarked:?}");
    assert!(unmarked.1 <= pool + (1 << 20), "{unmarked:?}");
}

#[test]
fn a_late_free_makes_a_conflict_never_an_overlap() {
    let plan = make_plan();
    let mut r = Run::new();
    r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
    let ps = r.prologue();
    // Keep layer 5's activation (planned to die mid-iteration) alive into the next
    // iterations: requests planned on its range must go online instead.
    let kept = r.iteration(false, None, Some(5));
    r.iteration(false, None, None);
    r.iteration(false, None, None);
    let st = r.engine.plan_stats().unwrap().unwrap();
    assert!(st.conflicts > 0, "{st:?}");
    // The report says where: from the iteration that kept it on (the prologue is 0,
    // that iteration 1: its later requests planned on the range), every conflict
    // counted, and the first one names the block in its range.
    let seen = r.engine.plan_conflicts_seen().unwrap().unwrap();
    assert_eq!(
        seen.by_iteration
            .iter()
            .map(|&(i, _)| i)
            .collect::<Vec<_>>(),
        [1, 2, 3],
        "{seen:?}"
    );
    assert_eq!(
        seen.by_iteration.iter().map(|&(_, n)| n).sum::<u64>(),
        st.conflicts,
        "{seen:?}"
    );
    let first = seen.first.expect("described");
    assert!(first.contains("found Allocated"), "{first}");
    r.engine.check_invariants().unwrap();
    for p in kept.into_iter().chain(ps) {
        r.free(p);
    }
    r.iteration(false, None, None);
    r.engine.check_invariants().unwrap();
    assert_eq!(r.engine.stats().unwrap().allocated_bytes[0].current, 0);
}

#[test]
fn bad_plans_are_rejected_and_serving_goes_on() {
    let plan = make_plan();
    let r = Run::new();
    let mut other_device = plan.clone();
    other_device.device = DeviceId(3);
    let mut broken = plan.clone();
    broken.iteration[1].offset = broken.iteration[0].offset; // overlaps in time
    for bad in [&other_device, &broken] {
        assert!(matches!(
            r.engine.load_plan(bad, PlanOptions::default()),
            Err(EngineError::PlanRejected(_))
        ));
    }
    r.engine
        .set_memory_limit(MemoryLimit::Bytes(Bytes(G)))
        .unwrap();
    assert!(matches!(
        r.engine.load_plan(&plan, PlanOptions::default()),
        Err(EngineError::PlanRejected(m)) if m.contains("memory limit")
    ));
    r.engine
        .set_memory_limit(MemoryLimit::Fraction(1.0))
        .unwrap();
    r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
    assert!(r.engine.load_plan(&plan, PlanOptions::default()).is_err());
    // Requests on other streams are served online.
    let p = r.engine.malloc(Bytes(4096), StreamId(1)).unwrap();
    r.engine.free(p).unwrap();
    assert_eq!(r.engine.plan_stats().unwrap().unwrap().hits, 0);
    r.engine.check_invariants().unwrap();
    let host = r.host.clone();
    drop(r);
    assert_eq!(host.mapped_bytes(), Bytes(0));
    assert_eq!(host.reservations(), 0);
}
