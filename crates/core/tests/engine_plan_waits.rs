//! Property test of plan mode with streams running behind the host: random multi-stream
//! plans (placed greedily, so the verifier accepts them), served for several iterations
//! while streams pass their events late and at random, with stream waits on or refused
//! at random. Checked at every step: no two live blocks overlap and every live block's
//! sentinel is intact when freed (`SentinelEngine`); every allocation over memory whose
//! free recorded events is on a stream ordered after each of them (passed, or waited
//! for: `FakeEvents::ordered_after`); the engine's invariants. At the end, once every
//! stream has passed everything: nothing active, and the pool's pending frees (fences
//! included) all completed.

use proptest::prelude::*;
use stweaver_core::engine::PlanOptions;
use stweaver_core::plan::{Plan, PlannedRequest};
use stweaver_core::testkit::audit::SentinelEngine;
use stweaver_core::units::{Bytes, DeviceId, Offset, StreamId};
use stweaver_core::verify::verify_plan;

const K: u64 = 1 << 10;

/// One planned request of the iteration: size (KiB), stream, start tick, lifetime.
type Spec = (u64, u64, u64, u64);

/// A freed range and the recordings its free made: (start, end, (stream, sequence)).
type Hazard = (u64, u64, Vec<(StreamId, u64)>);

/// Greedy first-fit placement of the requests over time: a valid plan by construction.
fn greedy_plan(specs: &[Spec]) -> Plan {
    let len = specs.len() as u64 * 2 + 2;
    let mut placed: Vec<PlannedRequest> = Vec::new();
    for (k, &(kib, stream, _, life)) in specs.iter().enumerate() {
        let start = k as u64 * 2;
        let end = (start + 1 + life * 2).min(len);
        let size = kib * K;
        let mut off = 0;
        loop {
            let clash = placed.iter().find(|p| {
                p.start < end
                    && start < p.end
                    && p.offset.get() < off + size
                    && off < p.offset.get() + p.size.get()
            });
            match clash {
                Some(p) => off = (p.offset.get() + p.size.get()).div_ceil(512) * 512,
                None => break,
            }
        }
        placed.push(PlannedRequest {
            size: Bytes(size),
            stream: StreamId(stream),
            offset: Offset(off),
            start,
            end,
        });
    }
    let pool = placed
        .iter()
        .map(|p| p.offset.get() + p.size.get())
        .max()
        .unwrap_or(512)
        .div_ceil(512)
        * 512;
    let plan = Plan {
        device: DeviceId(0),
        alignment: Bytes(512),
        pool_size: Bytes(pool),
        prologue: vec![],
        prologue_len: 0,
        iteration: placed,
        iteration_len: len,
        ..Plan::default()
    };
    verify_plan(&plan).expect("greedy placement is valid");
    plan
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn lagging_streams_never_reuse_memory_unordered(
        specs in proptest::collection::vec((1u64..96, 0u64..3, 0u64..1, 1u64..5), 2..14),
        progress in proptest::collection::vec((0u8..6, 0u64..3), 64..256),
        record in proptest::collection::vec(0u64..4, 0..8),
        iterations in 2usize..6,
    ) {
        let plan = greedy_plan(&specs);
        let mut r = SentinelEngine::new(64 << 10, 64 << 20);
        r.engine.load_plan(&plan, PlanOptions::default()).unwrap();
        // Frees that recorded events: (start, end, recordings).
        let mut hazards: Vec<Hazard> = Vec::new();
        let mut step = 0usize;
        for _ in 0..iterations {
            r.engine.mark_iteration().unwrap();
            // The plan's program order: request k allocates at tick 2k, frees at its end.
            let mut live: Vec<(u64, stweaver_core::engine::DevicePtr)> = Vec::new();
            for tick in 0..plan.iteration_len {
                let frees: Vec<_> = live.iter().filter(|(end, _)| *end == tick).map(|x| x.1).collect();
                live.retain(|(end, _)| *end != tick);
                for p in frees {
                    let mark = r.host.events().recordings();
                    let len = r.engine.block_info(p).unwrap().size.get();
                    r.free(p);
                    let recs = r.host.events().recorded_since(mark);
                    if !recs.is_empty() {
                        hazards.push((p.get(), p.get() + len, recs));
                    }
                }
                if let Some(req) = plan.iteration.iter().find(|q| q.start == tick) {
                    let p = r.alloc(req.size.get(), req.stream);
                    let len = req.size.get().div_ceil(512) * 512;
                    let ev = r.host.events();
                    hazards.retain(|(_, _, recs)| !recs.iter().all(|&(on, seq)| ev.passed(on, seq)));
                    for (a, b, recs) in &hazards {
                        if *a < p.get() + len && p.get() < *b {
                            for &(on, seq) in recs {
                                prop_assert!(
                                    ev.ordered_after(req.stream, on, seq),
                                    "{p} on {} reuses memory freed behind {on}'s work", req.stream
                                );
                            }
                        }
                    }
                    if let Some(&s) = record.get(tick as usize % record.len().max(1))
                        && s < 3
                    {
                        r.engine.record_stream(p, StreamId(s)).unwrap();
                    }
                    live.push((req.end, p));
                }
                // Streams move on late and at random; waits are sometimes refused.
                let (what, s) = progress[step % progress.len()];
                step += 1;
                let ev = r.host.events();
                match what {
                    0 => { ev.pass_next(StreamId(s)); }
                    1 => ev.pass_all(StreamId(s)),
                    2 => r.engine.process_events().unwrap(),
                    3 => ev.refuse_waits(s == 0),
                    _ => {}
                }
                r.engine.check_invariants().unwrap();
            }
            for (_, p) in live.drain(..) {
                r.free(p);
            }
        }
        let st = r.engine.plan_stats().unwrap().expect("plan served");
        prop_assert!(st.hits + st.conflicts + st.unplanned > 0);
        r.settle_idle();
    }
}
