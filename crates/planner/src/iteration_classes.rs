//! Iteration classes (issue #18, item 1's analysis): the recorded iterations grouped by
//! their request signature, so that a loop with an eval pass every N steps, a checkpoint
//! save, or a few sequence-length buckets shows as a few classes that each repeat, where
//! the period detector ([`crate::iteration::detect_period`]) sees no steady state at all.
//!
//! **Iterations** are the spans between the boundaries the engine replay marks
//! ([`crate::engine_replay::iteration_boundaries`]: `IterationBegin` markers, else the ends
//! of optimizer steps, else the detected period); events before the first boundary are the
//! prologue, in no class, and an empty span after the last boundary is no iteration.
//! **Signature**: the sequence of the iteration's allocation requests
//! (size and stream, in order), hashed; two iterations with the same sequence make the
//! same requests and are one class (the planner's single-period plan serves only traces
//! whose steady iterations are all one class). For each class: its iterations, their
//! requests, and the peak of live requested bytes over its iterations (bytes live when an
//! iteration starts included), the memory a plan for that class alone would need at least.
//!
//! Cost: O(events) time (one pass for the live bytes, one for the signatures), O(iterations)
//! memory besides the trace's lifetimes.

use std::hash::{Hash, Hasher};

use rustc_hash::{FxHashMap, FxHasher};
use stweaver_core::{Bytes, EventKind, Trace};

use crate::engine_replay::iteration_boundaries;

/// Iterations that make the same requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IterationClass {
    /// The hash of the request sequence (size and stream of each allocation, in order).
    pub signature: u64,
    /// The iterations of the class, by index (0: the first after the first boundary).
    pub iterations: Vec<usize>,
    /// Allocation requests per iteration.
    pub allocs: usize,
    /// The peak of live requested bytes over the class's iterations.
    pub peak: Bytes,
}

/// The iterations of `trace` grouped by request signature, the most frequent class first
/// (ties: the one seen first). Empty without iteration boundaries. O(events).
pub fn iteration_classes(trace: &Trace) -> Vec<IterationClass> {
    let bounds = iteration_boundaries(trace);
    if bounds.is_empty() {
        return Vec::new();
    }
    // Live requested bytes after each event (frees at the end of each lifetime).
    let ends: Vec<Option<usize>> = trace
        .lifetimes()
        .iter()
        .map(|l| l.end.map(|e| e.index()))
        .collect();
    let mut live: u64 = trace
        .allocations
        .iter()
        .filter(|a| a.preexisting)
        .map(|a| a.size.get())
        .sum();
    let mut classes: Vec<IterationClass> = Vec::new();
    let mut by_signature: FxHashMap<u64, usize> = FxHashMap::default();
    let mut k = 0; // the next boundary
    let mut current: Option<(FxHasher, usize, u64)> = None; // (hash, allocs, peak)
    let mut index = 0;
    let mut close = |cur: Option<(FxHasher, usize, u64)>, index: &mut usize| {
        if let Some((h, allocs, peak)) = cur {
            let signature = h.finish();
            let at = *by_signature.entry(signature).or_insert_with(|| {
                classes.push(IterationClass {
                    signature,
                    iterations: Vec::new(),
                    allocs,
                    peak: Bytes::ZERO,
                });
                classes.len() - 1
            });
            let c = &mut classes[at];
            c.iterations.push(*index);
            c.peak = Bytes(c.peak.get().max(peak));
            *index += 1;
        }
    };
    for (i, e) in trace.events.iter().enumerate() {
        if k < bounds.len() && bounds[k] == i {
            k += 1;
            close(current.take(), &mut index);
            current = Some((FxHasher::default(), 0, live));
        }
        match e.kind {
            EventKind::Alloc(a) => {
                let al = &trace.allocations[a.index()];
                live += al.size.get();
                if let Some((h, allocs, peak)) = current.as_mut() {
                    (al.size.get(), al.stream.0).hash(h);
                    *allocs += 1;
                    *peak = (*peak).max(live);
                }
            }
            EventKind::FreeRequested(a) | EventKind::FreeCompleted(a)
                if ends[a.index()] == Some(i) =>
            {
                live -= trace.allocations[a.index()].size.get();
            }
            _ => {}
        }
    }
    // The span after the last boundary is an iteration only if it made requests (a run
    // that marks a boundary after its last step ends with an empty one).
    if current.as_ref().is_some_and(|c| c.1 > 0) {
        close(current.take(), &mut index);
    }
    let mut order: Vec<usize> = (0..classes.len()).collect();
    order.sort_by_key(|&c| {
        (
            std::cmp::Reverse(classes[c].iterations.len()),
            classes[c].iterations[0],
        )
    });
    order.into_iter().map(|c| classes[c].clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use stweaver_core::testkit::TraceBuilder;

    const MIB: u64 = 1 << 20;

    /// 12 iterations: training (two activations, a temporary) except every 4th, an eval
    /// pass (one larger activation, no temporary), and the 7th with a checkpoint save (an
    /// extra 32 MiB buffer).
    fn trace() -> stweaver_core::Trace {
        let mut b = TraceBuilder::new();
        b.alloc(8 * MIB);
        for it in 0..12 {
            b.iteration_begin();
            if it % 4 == 3 {
                let x = b.alloc(24 * MIB);
                b.free(x);
                continue;
            }
            let a = b.alloc(16 * MIB);
            let c = b.alloc(16 * MIB);
            let t = b.alloc(4 * MIB);
            b.free(t);
            if it == 6 {
                let s = b.alloc(32 * MIB);
                b.free(s);
            }
            b.free(c);
            b.free(a);
        }
        b.build()
    }

    #[test]
    fn train_eval_and_checkpoint_iterations_are_three_classes() {
        let classes = iteration_classes(&trace());
        assert_eq!(classes.len(), 3, "{classes:?}");
        let (train, eval, ckpt) = (&classes[0], &classes[1], &classes[2]);
        assert_eq!(train.iterations, vec![0, 1, 2, 4, 5, 8, 9, 10]);
        assert_eq!(eval.iterations, vec![3, 7, 11]);
        assert_eq!(ckpt.iterations, vec![6]);
        assert_eq!((train.allocs, eval.allocs, ckpt.allocs), (3, 1, 4));
        // Peaks include the 8 MiB live across iterations.
        assert_eq!(train.peak, Bytes(44 * MIB));
        assert_eq!(eval.peak, Bytes(32 * MIB));
        assert_eq!(ckpt.peak, Bytes(72 * MIB));
        assert!(iteration_classes(&TraceBuilder::new().build()).is_empty());
        // A boundary marked after the last step adds no iteration.
        let mut b = TraceBuilder::new();
        for _ in 0..3 {
            b.iteration_begin();
            let x = b.alloc(MIB);
            b.free(x);
        }
        b.iteration_begin();
        let c = iteration_classes(&b.build());
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].iterations, vec![0, 1, 2]);
    }
}
