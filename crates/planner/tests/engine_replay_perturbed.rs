//! Plan matching under a run that departs from the plan: the llama snapshot with 1 %
//! of its requests inserted, dropped or resized (seeded), and an eval-like pass
//! (forward only, other sizes) inserted between two training iterations, served from
//! the plan of the *unperturbed* run's first iterations. The replay checks every live
//! block for overlap at every step; on top, at least 95 % of the requests the plan
//! served in the unperturbed run must still be served from the plan.

mod common;

use stweaver_core::{AllocId, Allocation, Bytes, Event, EventKind, Trace, splitmix};
use stweaver_planner::engine_replay::{
    EngineReplayOptions, ServeMode, Served, iteration_boundaries, plan_first_iterations,
    replay_engine, with_iteration_markers,
};
use stweaver_planner::planning::PlanOptions;

/// xorshift64*: a seeded, dependency-free generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// What happened to each original allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Kept,
    Dropped,
    Resized,
}

/// The perturbed run, and for each of its allocations the original it stands for
/// (`None`: inserted or eval).
struct Perturbed {
    trace: Trace,
    origin: Vec<Option<AllocId>>,
    fate: Vec<Fate>,
    inserted: usize,
    eval_allocs: usize,
}

/// Builds the perturbed run (module docs). `trace` carries `IterationBegin` markers.
fn perturb(trace: &Trace, seed: u64, rate_per_10k: u64) -> Perturbed {
    // splitmix64 of the seed: distinct seeds, distinct non-zero states.
    let mut rng = Rng(splitmix::mix(seed.wrapping_add(splitmix::GAMMA)) | 1);
    let n = trace.allocations.len();
    let mut fate = vec![Fate::Kept; n];
    let mut new_size: Vec<Bytes> = trace.allocations.iter().map(|a| a.size).collect();
    // Requests to insert before event i: (size, free after how many events).
    let mut insert_at: Vec<Vec<(Bytes, usize)>> = vec![Vec::new(); trace.events.len()];
    let sizes: Vec<Bytes> = trace.allocations.iter().map(|a| a.size).collect();
    let mut inserted = 0;
    for (i, e) in trace.events.iter().enumerate() {
        let EventKind::Alloc(id) = e.kind else {
            continue;
        };
        if rng.below(10_000) >= rate_per_10k {
            continue;
        }
        match rng.below(3) {
            0 => fate[id.index()] = Fate::Dropped,
            1 => {
                fate[id.index()] = Fate::Resized;
                let s = sizes[id.index()].get();
                // Another size, same order of magnitude.
                let t = (s / 2 + rng.below(s.max(2))).max(1);
                new_size[id.index()] = Bytes(if t == s { s + 512 } else { t });
            }
            _ => {
                // A size the run really uses: the hard case for matching.
                let size = sizes[rng.below(n as u64) as usize];
                insert_at[i].push((size, 1 + rng.below(60) as usize));
                inserted += 1;
            }
        }
    }
    // The eval pass: the forward part (first 40 %) of the second steady iteration,
    // sizes scaled by 3/4, everything it leaves live freed at its end; inserted at the
    // boundary after that iteration.
    let bounds = iteration_boundaries(trace);
    let (from, to) = (bounds[1], bounds[2]);
    let fwd_end = from + (to - from) * 2 / 5;
    let mut out = Trace {
        device: trace.device,
        allocations: Vec::new(),
        events: Vec::new(),
        labels: trace.labels.clone(),
        restores: Vec::new(),
    };
    let mut origin: Vec<Option<AllocId>> = Vec::new();
    let mut new_id: Vec<Option<AllocId>> = vec![None; n];
    // Pending frees of inserted requests: (event index in the original, new id).
    let mut pending: Vec<(usize, AllocId)> = Vec::new();
    let mut eval_allocs = 0;
    let ev = |kind| Event { kind, time_us: 0 };
    for (i, a) in trace.allocations.iter().enumerate() {
        if a.preexisting {
            new_id[i] = Some(AllocId(out.allocations.len() as u32));
            out.allocations.push(*a);
            origin.push(Some(AllocId(i as u32)));
        }
    }
    for (i, e) in trace.events.iter().enumerate() {
        if i == to {
            // Eval pass first (the marker at `to` belongs to the next iteration).
            let mut eval_id: Vec<Option<AllocId>> = vec![None; n];
            let mut live = Vec::new();
            for e in &trace.events[from..fwd_end] {
                match e.kind {
                    EventKind::Alloc(id) => {
                        let a = trace.allocations[id.index()];
                        let size = Bytes((a.size.get() * 3 / 4).max(1));
                        let nid = AllocId(out.allocations.len() as u32);
                        out.allocations.push(Allocation { size, ..a });
                        origin.push(None);
                        out.events.push(ev(EventKind::Alloc(nid)));
                        eval_id[id.index()] = Some(nid);
                        live.push(nid);
                        eval_allocs += 1;
                    }
                    EventKind::FreeRequested(id) | EventKind::FreeCompleted(id) => {
                        if let Some(nid) = eval_id[id.index()] {
                            let kind = match e.kind {
                                EventKind::FreeRequested(_) => EventKind::FreeRequested(nid),
                                _ => EventKind::FreeCompleted(nid),
                            };
                            out.events.push(ev(kind));
                            if matches!(kind, EventKind::FreeCompleted(_)) {
                                live.retain(|&x| x != nid);
                            }
                        }
                    }
                    EventKind::Marker { .. }
                    | EventKind::SavedPack(_)
                    | EventKind::SavedUnpack(_) => {}
                }
            }
            for nid in live {
                out.events.push(ev(EventKind::FreeRequested(nid)));
                out.events.push(ev(EventKind::FreeCompleted(nid)));
            }
        }
        for &(size, after) in &insert_at[i] {
            let nid = AllocId(out.allocations.len() as u32);
            out.allocations.push(Allocation {
                size,
                stream: trace.allocations[0].stream,
                addr: 0,
                preexisting: false,
            });
            origin.push(None);
            out.events.push(ev(EventKind::Alloc(nid)));
            pending.push((i + after, nid));
        }
        pending.retain(|&(at, nid)| {
            if at <= i {
                out.events.push(ev(EventKind::FreeRequested(nid)));
                out.events.push(ev(EventKind::FreeCompleted(nid)));
                false
            } else {
                true
            }
        });
        let kind = match e.kind {
            EventKind::Alloc(id) if fate[id.index()] == Fate::Dropped => continue,
            EventKind::Alloc(id) => {
                let nid = AllocId(out.allocations.len() as u32);
                new_id[id.index()] = Some(nid);
                out.allocations.push(Allocation {
                    size: new_size[id.index()],
                    ..trace.allocations[id.index()]
                });
                origin.push(Some(id));
                EventKind::Alloc(nid)
            }
            EventKind::FreeRequested(id) => match new_id[id.index()] {
                Some(nid) => EventKind::FreeRequested(nid),
                None => continue,
            },
            EventKind::FreeCompleted(id) => match new_id[id.index()] {
                Some(nid) => EventKind::FreeCompleted(nid),
                None => continue,
            },
            m => m,
        };
        out.events.push(ev(kind));
    }
    for (_, nid) in pending {
        out.events.push(ev(EventKind::FreeRequested(nid)));
        out.events.push(ev(EventKind::FreeCompleted(nid)));
    }
    out.validate().expect("the perturbed trace is valid");
    Perturbed {
        trace: out,
        origin,
        fate,
        inserted,
        eval_allocs,
    }
}

#[test]
fn a_perturbed_run_with_an_eval_pass_still_follows_the_plan() {
    let base = common::snapshot("llama1b_rcp");
    let marked = with_iteration_markers(&base, &iteration_boundaries(&base));
    let (outcome, _) = plan_first_iterations(&marked, 3, &PlanOptions::default()).unwrap();
    let opts = EngineReplayOptions::default();
    let clean = replay_engine(&marked, &ServeMode::Plan(&outcome.plan), &opts).unwrap();
    assert_eq!(clean.counts.plan as usize, marked.alloc_event_count());

    for seed in [1u64, 2, 3] {
        let p = perturb(&marked, seed, 100);
        let r = replay_engine(&p.trace, &ServeMode::Plan(&outcome.plan), &opts)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        // Of the requests the plan served in the clean run and that the perturbed run
        // still makes unchanged, how many are still served from the plan.
        let (mut kept, mut still) = (0u64, 0u64);
        for (nid, o) in p.origin.iter().enumerate() {
            if let Some(o) = o
                && p.fate[o.index()] == Fate::Kept
                && clean.served[o.index()] == Served::Plan
            {
                kept += 1;
                still += u64::from(r.served[nid] == Served::Plan);
            }
        }
        let changed = p.fate.iter().filter(|&&f| f != Fate::Kept).count();
        let clean_planned = clean.counts.plan;
        let fraction = still as f64 / kept as f64;
        let of_all = still as f64 / clean_planned as f64;
        eprintln!(
            "seed {seed}: {} dropped or resized, {} inserted, eval pass of {} allocations; \
             {still} of {kept} unchanged planned requests still from the plan ({:.2} %, \
             {:.2} % of all {clean_planned}); reserved {} ({:.4} x LB, clean {:.4}); \
             served plan {} hole {} online {}; {:?}",
            changed,
            p.inserted,
            p.eval_allocs,
            100.0 * fraction,
            100.0 * of_all,
            r.peak_reserved,
            r.reserved_over_lb(),
            clean.reserved_over_lb(),
            r.counts.plan,
            r.counts.hole,
            r.counts.online,
            r.plan_stats,
        );
        assert!(fraction >= 0.95, "seed {seed}: {:.2} %", 100.0 * fraction);
        assert!(r.overlap_checks as usize >= p.trace.alloc_event_count());
    }
}
