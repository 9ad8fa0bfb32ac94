//! A trace recorded with threshold offload (restore links, `stweaver_planner::unoffload`)
//! plans under a budget exactly like the same run recorded without offload: it
//! normalises to that run, the budget plan of both is identical, and it moves fewer
//! bytes than the threshold did. Links survive the trace file.

use stweaver_core::testkit::TraceBuilder;
use stweaver_core::trace_file::{trace_digest, trace_from_bytes, trace_to_bytes};
use stweaver_core::{AllocId, Bytes, EventKind, Restore, Trace, TraceError};
use stweaver_planner::offload::{OffloadOptions, plan_with_budget};
use stweaver_planner::planning::plan_trace;
use stweaver_planner::unoffload::un_offload;

const MIB: u64 = 1 << 20;

/// A builder with 288 MiB of persistent tensors (36 of 8 MiB). Its clock also ticks for
/// the events one variant of [`run`] skips, so both variants stamp the events they share
/// alike.
fn persistent() -> TraceBuilder {
    let mut b = TraceBuilder::with_clock(1_700_000_000_000_000, 1000);
    for _ in 0..36 {
        b.alloc(8 * MIB);
    }
    b
}

/// Activations saved in forward (64 MiB, and a 1 MiB one per layer under the
/// threshold), unpacked in reverse in backward, over 288 MiB persistent; with
/// `threshold`, every saved activation of at least `threshold` bytes is offloaded as
/// the run-time offloader does it: freed after its copy out, a new allocation for the
/// copy back before its unpack, and a restore link.
fn run(threshold: Option<u64>) -> Trace {
    let layers = 12;
    let mut b = persistent();
    for _ in 0..4 {
        b.iteration_begin();
        let mut saved = Vec::new();
        for _ in 0..layers {
            for size in [64 * MIB, MIB] {
                let id = b.alloc(size);
                b.ev(EventKind::SavedPack(id));
                let out = threshold.is_some_and(|m| size >= m);
                if out {
                    b.free(id); // the copy out is done
                } else {
                    b.skip();
                    b.skip();
                }
                saved.push((id, size, out));
            }
            let t = b.alloc(16 * MIB);
            b.free(t);
        }
        let mut grads = Vec::new();
        for &(id, size, out) in saved.iter().rev() {
            let cur = if out {
                let back = b.alloc(size);
                b.restore(id, back);
                back
            } else {
                b.skip();
                id
            };
            b.ev(EventKind::SavedUnpack(cur));
            grads.push(b.alloc(4 * MIB));
            let t = b.alloc(16 * MIB);
            b.free(t);
            b.free(cur);
        }
        for g in grads {
            b.free(g);
        }
    }
    b.done()
}

#[test]
fn a_threshold_recording_normalises_to_the_run_without_offload() {
    let recorded = run(Some(64 * MIB));
    let direct = run(None);
    assert_eq!(recorded.restores.len(), 4 * 12);
    assert!(direct.restores.is_empty());
    let normalised = un_offload(&recorded).unwrap();
    assert_eq!(normalised, direct);
    assert!(recorded.lower_bound().bytes < direct.lower_bound().bytes);
    // Links enter the digest; a trace without them hashes as before.
    let mut unlinked = recorded.clone();
    unlinked.restores.clear();
    assert_ne!(trace_digest(&unlinked), trace_digest(&recorded));
}

#[test]
fn the_budget_plan_of_a_threshold_recording_is_that_of_the_run_without_offload() {
    let recorded = run(Some(64 * MIB));
    let direct = run(None);
    let pool = plan_trace(&direct, &Default::default())
        .unwrap()
        .plan
        .pool_size;
    let budget = Bytes(pool.get() * 8 / 10);
    let opts = OffloadOptions::new(budget);
    let from_recorded = plan_with_budget(&recorded, &opts).expect("fits");
    let from_direct = plan_with_budget(&direct, &opts).expect("fits");
    let (mut a, b) = (
        from_recorded.outcome.plan.clone(),
        from_direct.outcome.plan.clone(),
    );
    assert_eq!(a.trace_digest, trace_digest(&recorded));
    assert_eq!(b.trace_digest, trace_digest(&direct));
    a.trace_digest = b.trace_digest;
    assert_eq!(a, b);
    assert_eq!(from_recorded.offload, from_direct.offload);
    assert_eq!(from_recorded.rewritten, from_direct.rewritten);
    let r = &from_recorded.offload;
    assert!(a.pool_size <= budget);
    assert_eq!(r.pool_without_offload, pool);
    // Every saved activation is a candidate again (24 per iteration), and fewer bytes
    // move than the threshold moved (12 × 64 MiB).
    assert_eq!(r.candidates, 24);
    assert!(r.tensors > 0 && !a.offload.is_empty(), "{r:?}");
    assert!(r.bytes_per_iteration < Bytes(12 * 64 * MIB), "{r:?}");

    // Without the links the recording's tensors are no candidates: its own peak is
    // already under the budget, so it plans no offload at all — and the run, no longer
    // offloading, would exceed it.
    let mut unlinked = recorded.clone();
    unlinked.restores.clear();
    let blind = plan_with_budget(&unlinked, &opts).expect("fits as recorded");
    assert!(blind.outcome.plan.offload.is_empty());
    // Planned without a budget, a trace with links is planned as recorded.
    let plain = plan_trace(&recorded, &Default::default()).unwrap().plan;
    let plain_unlinked = plan_trace(&unlinked, &Default::default()).unwrap().plan;
    assert_eq!(plain.pool_size, plain_unlinked.pool_size);
    assert!(plain.pool_size < pool);
}

#[test]
fn links_survive_the_trace_file() {
    let recorded = run(Some(64 * MIB));
    let bytes = trace_to_bytes(&recorded).unwrap();
    assert_eq!(trace_from_bytes(&bytes).unwrap(), recorded);
    // Without links nothing is written for them.
    let mut unlinked = recorded.clone();
    unlinked.restores.clear();
    let plain = trace_to_bytes(&unlinked).unwrap();
    assert!(plain.len() + 8 * recorded.restores.len() <= bytes.len());
    assert_eq!(trace_from_bytes(&plain).unwrap(), unlinked);
}

#[test]
fn bad_links_are_refused() {
    let recorded = run(Some(64 * MIB));
    let link = recorded.restores[0];
    let with = |f: &dyn Fn(&mut Trace)| {
        let mut t = recorded.clone();
        f(&mut t);
        t.validate().unwrap_err()
    };
    let n = recorded.allocations.len() as u32;
    assert!(matches!(
        with(&|t| t.restores[0].into = AllocId(n)),
        TraceError::RestoreUnknownAlloc { link: 0, .. }
    ));
    assert!(matches!(
        with(&|t| t.restores.push(link)),
        TraceError::RestoreTwice { other: 0, .. }
    ));
    // Backwards: the copy back is allocated before the offloaded one is even packed.
    assert!(matches!(
        with(&|t| t.restores[0] = Restore {
            from: link.into,
            into: link.from
        }),
        TraceError::RestoreOrder {
            problem: "is not packed",
            ..
        }
    ));
    // The first layer's 1 MiB activation (after the 36 persistent tensors and that
    // layer's 64 MiB one) is packed, but freed only at the end of backward: a link all
    // the same (the program held it past its copy back).
    assert_eq!(recorded.allocations[37].size, Bytes(MIB));
    let mut held = recorded.clone();
    held.restores[0].from = AllocId(37);
    held.validate().unwrap();
    // A persistent tensor as the copy back: preexisting.
    assert!(matches!(
        with(&|t| {
            t.allocations[0].preexisting = true;
            t.events.remove(0);
            t.restores[0].into = AllocId(0);
        }),
        TraceError::RestorePreexisting { link: 0, .. }
    ));
    assert!(
        un_offload(&{
            let mut t = recorded.clone();
            t.restores.push(link);
            t
        })
        .is_err()
    );
}

/// As recorded at run time, the first iteration marker comes at the end of the first
/// iteration (`stweaver.step()`): that iteration is the plan's prologue, which offloads
/// at run time as recorded, so its links stay; the later iterations' are undone.
#[test]
fn the_first_iterations_offloads_stay_as_recorded() {
    let mut recorded = run(Some(64 * MIB));
    let first = recorded
        .events
        .iter()
        .position(|e| matches!(e.kind, EventKind::Marker { .. }))
        .unwrap();
    recorded.events.remove(first);
    recorded.validate().unwrap();
    let direct = run(None);
    let pool = plan_trace(&direct, &Default::default())
        .unwrap()
        .plan
        .pool_size;
    let budget = Bytes(pool.get() * 8 / 10);
    let o = plan_with_budget(&recorded, &OffloadOptions::new(budget)).expect("fits");
    assert!(o.outcome.plan.pool_size <= budget);
    assert!(!o.outcome.plan.offload.is_empty());
    // The rewritten run still has the first iteration's 12 copies back as their own
    // allocations: 48 links recorded, 36 undone.
    let rewritten = o.rewritten.expect("offload planned");
    assert_eq!(
        rewritten.allocations.len(),
        direct.allocations.len() + 12 + o.outcome.plan.offload.len() * 3,
        "{} allocations",
        rewritten.allocations.len()
    );
}

/// As [`run`] with threshold offload of the 64 MiB activations, but forward holds each
/// of them until three more layers' have been made (later layers read it): its free,
/// recorded when the program let go of it, comes three layers after its pack.
fn held_three_layers() -> Trace {
    let layers = 12;
    let mut b = persistent();
    for _ in 0..4 {
        b.iteration_begin();
        let mut saved = Vec::new();
        let mut held = std::collections::VecDeque::new();
        for _ in 0..layers {
            let id = b.alloc(64 * MIB);
            b.ev(EventKind::SavedPack(id));
            let t = b.alloc(16 * MIB);
            b.free(t);
            held.push_back(id);
            if held.len() > 3 {
                let h = held.pop_front().unwrap();
                b.free(h); // let go of three layers later
            }
            saved.push(id);
        }
        for h in held.drain(..) {
            b.free(h);
        }
        let mut grads = Vec::new();
        for &id in saved.iter().rev() {
            let back = b.alloc(64 * MIB);
            b.restore(id, back);
            b.ev(EventKind::SavedUnpack(back));
            grads.push(b.alloc(4 * MIB));
            let t = b.alloc(16 * MIB);
            b.free(t);
            b.free(back);
        }
        for g in grads {
            b.free(g);
        }
    }
    b.done()
}

/// The recorded frees of offloaded tensors say when the program let go of them; the
/// planner frees their memory no earlier (on the H100, GPT-2 XL's layer inputs were
/// still read by the next layer after their pack, the plan counted on their memory at
/// the copy's end, and the run conflicted at the peak). A recording without that
/// information (links dropped) is planned as if the memory went at the copy's end.
#[test]
fn offloaded_memory_is_free_no_earlier_than_the_program_let_go_of_it() {
    let held = held_three_layers();
    let (normalised, releases) =
        stweaver_planner::unoffload::un_offload_with_releases(&held).unwrap();
    assert_eq!(releases.iter().filter(|r| r.is_some()).count(), 4 * 12);
    assert_eq!(normalised, un_offload(&held).unwrap());
    let pool = plan_trace(&normalised, &Default::default())
        .unwrap()
        .plan
        .pool_size;
    let mut opts = OffloadOptions::new(Bytes(pool.get() / 10));
    opts.iteration_us = Some(1e9); // copies take no time: only the releases bound the windows
    let minimum = |t: &Trace| match plan_with_budget(t, &opts) {
        Err(stweaver_planner::offload::OffloadError::BelowMinimum { minimum, .. }) => minimum,
        other => panic!("expected a refusal naming the minimum: {:?}", other.err()),
    };
    let with_releases = minimum(&held);
    let without = minimum(&normalised);
    // Held three layers longer: two more 64 MiB activations on the device at the peak
    // (forward's, now above backward's) than when each goes at its copy's end.
    assert!(
        with_releases.get() >= without.get() + 64 * MIB,
        "{with_releases} vs {without}"
    );
    // A budget between the two is refused with the releases, planned without them.
    let mid = Bytes((with_releases.get() + without.get()) / 2);
    let mut o = opts.clone();
    o.budget = mid;
    o.margin = 0.0;
    assert!(plan_with_budget(&held, &o).is_err());
}
