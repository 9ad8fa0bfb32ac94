//! Unit tests of the replay on hand-made traces: one rule per test, with the exact
//! reserved / allocated bytes PyTorch's rules give, plus a randomised test that checks
//! the allocator invariants (§6.12, block links) after every event.

use proptest::prelude::*;
use stweaver_core::DeviceId;
use stweaver_core::testkit::TraceBuilder;

use super::*;

const M: u64 = MIB;

/// A hand-made trace ([`TraceBuilder`], through `Deref`) and its replay.
#[derive(Default)]
struct T(TraceBuilder);

impl std::ops::Deref for T {
    type Target = TraceBuilder;
    fn deref(&self) -> &TraceBuilder {
        &self.0
    }
}

impl std::ops::DerefMut for T {
    fn deref_mut(&mut self) -> &mut TraceBuilder {
        &mut self.0
    }
}

impl T {
    fn run(&self, conf: &str) -> ReplayStats {
        self.run_with(conf, &ReplayOptions::default())
            .expect("replay")
    }
    fn run_with(&self, conf: &str, opts: &ReplayOptions) -> Result<ReplayStats, ReplayError> {
        let cfg = AllocatorConfig::parse(conf).expect("config");
        let stats = checked_replay(&self.trace, &cfg, opts)?;
        // The public entry point agrees with the checked driver.
        let public = replay(&self.trace, &cfg, opts)?.stats;
        assert_eq!(public, stats);
        Ok(stats)
    }
}

/// The replay loop of [`replay`], checking the invariants after every step.
fn checked_replay(
    trace: &Trace,
    cfg: &AllocatorConfig,
    opts: &ReplayOptions,
) -> Result<ReplayStats, ReplayError> {
    trace.validate()?;
    let mut e = prepare(trace, cfg, opts)?;
    e.check_invariants().expect("after preexisting");
    let completes = completion_table(trace);
    let mut timeline = TimelineRecorder::new(opts.timeline_points, trace.events.len());
    for (i, ev) in trace.events.iter().enumerate() {
        e.now = Some(i as u32);
        step(&mut e, trace, &completes, ev.kind)?;
        if let Err(msg) = e.check_invariants() {
            panic!("invariant broken after event {i} ({:?}): {msg}", ev.kind);
        }
        let (r, a, q) = e.counters();
        timeline.record(i as u32, r, a, q);
    }
    let (mut stats, _, _) = e.finish();
    stats.timeline = timeline.finish();
    Ok(stats)
}

#[test]
fn small_requests_share_a_2mib_segment() {
    let mut t = T::default();
    let a = t.alloc(1000);
    let b = t.alloc(1000);
    t.free(a);
    t.free(b);
    let s = t.run("");
    assert_eq!(s.peak_reserved, Bytes(2 * M));
    assert_eq!(s.peak_allocated, Bytes(2048));
    assert_eq!(s.peak_requested, Bytes(2000));
    assert_eq!(s.segments_allocated, 1);
    assert_eq!(s.final_allocated, Bytes(0));
}

#[test]
fn mid_size_requests_get_20mib_segments_and_split() {
    let mut t = T::default();
    let a = t.alloc(5 * M);
    let b = t.alloc(5 * M); // fits in the 15 MiB remainder
    let c = t.alloc(11 * M); // 10 MiB left: a new 12 MiB segment
    t.free(a);
    t.free(b);
    t.free(c);
    let s = t.run("");
    assert_eq!(s.peak_reserved, Bytes(32 * M));
    assert_eq!(s.segments_allocated, 2);
}

#[test]
fn remainders_of_1mib_or_less_are_handed_out_whole() {
    let mut t = T::default();
    let a = t.alloc(12 * M);
    t.free(a);
    let b = t.alloc(11 * M); // 12 MiB block, 1 MiB remainder: not > 1 MiB, no split
    t.free(b);
    let s = t.run("");
    assert_eq!(s.peak_reserved, Bytes(12 * M));
    assert_eq!(s.peak_allocated, Bytes(12 * M));
    assert_eq!(s.peak_requested, Bytes(12 * M));
}

#[test]
fn best_fit_takes_the_smallest_block_that_fits() {
    let mut t = T::default();
    let big = t.alloc(40 * M);
    let small = t.alloc(12 * M);
    t.free(big);
    t.free(small);
    // 11 MiB fits both; best fit takes the 12 MiB block, leaving 40 MiB for 30 MiB.
    let x = t.alloc(11 * M);
    let y = t.alloc(30 * M);
    t.free(x);
    t.free(y);
    let s = t.run("");
    assert_eq!(s.peak_reserved, Bytes(52 * M));
    assert_eq!(s.segments_allocated, 2);
}

#[test]
fn blocks_are_reused_only_on_their_stream() {
    let mut t = T::default();
    let a = t.alloc_on(20 * M, 1);
    t.free(a);
    let b = t.alloc_on(20 * M, 2);
    t.free(b);
    let c = t.alloc_on(20 * M, 1);
    t.free(c);
    let s = t.run("");
    assert_eq!(s.peak_reserved, Bytes(40 * M));
    assert_eq!(s.segments_allocated, 2);
}

#[test]
fn frees_coalesce_neighbours() {
    let mut t = T::default();
    let a = t.alloc(5 * M);
    let b = t.alloc(5 * M);
    let c = t.alloc(5 * M);
    t.free(a);
    t.free(c);
    t.free(b); // merges with both sides: one free 20 MiB block
    let d = t.alloc(20 * M);
    t.free(d);
    let s = t.run("");
    assert_eq!(s.peak_reserved, Bytes(20 * M));
    assert_eq!(s.segments_allocated, 1);
}

#[test]
fn pending_frees_are_not_reused_until_completed() {
    let mut t = T::default();
    let a = t.alloc(20 * M);
    t.free_requested(a);
    let b = t.alloc(20 * M); // a's block waits on events: new segment
    t.free_completed(a);
    let c = t.alloc(20 * M); // now a's block is back
    t.free(b);
    t.free(c);
    let s = t.run("");
    assert_eq!(s.peak_reserved, Bytes(40 * M));
    // allocated drops at free_requested, active only when the free completes.
    assert_eq!(s.peak_allocated, Bytes(40 * M));
    assert_eq!(s.peak_active, Bytes(40 * M));

    // Without a FreeCompleted event the block returns at FreeRequested.
    let mut t = T::default();
    let a = t.alloc(20 * M);
    t.free_requested(a);
    let b = t.alloc(20 * M);
    t.free_requested(b);
    assert_eq!(t.run("").peak_reserved, Bytes(20 * M));
}

#[test]
fn preexisting_allocations_are_placed_first_in_id_order() {
    let mut t = T::default();
    let p0 = t.preexisting(5 * M);
    let _p1 = t.preexisting(5 * M);
    let a = t.alloc(8 * M); // fits the 10 MiB left of the preexisting segment
    t.free(a);
    t.free(p0);
    let s = t.run("");
    assert_eq!(s.peak_reserved, Bytes(20 * M));
    assert_eq!(s.peak_reserved_at, None);
    assert_eq!(s.final_allocated, Bytes(5 * M));
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    let mut t = T::default();
    let a = t.alloc(30 * M);
    t.free(a);
    let b = t.alloc(10 * M); // below max_split: may not take the oversize 30 MiB block
    let c = t.alloc(25 * M); // oversize request: takes the 30 MiB block whole (30 < 25+20)
    t.free(b);
    t.free(c);
    let s = t.run("max_split_size_mb:20");
    assert_eq!(s.peak_reserved, Bytes(40 * M));
    assert_eq!(s.peak_allocated, Bytes(40 * M));
    // Unlimited: b splits the 30 MiB block, c needs a new 26 MiB segment.
    let s = t.run("");
    assert_eq!(s.peak_reserved, Bytes(56 * M));

    // max_non_split_rounding: a 50 MiB block is too big for a 25 MiB oversize request.
    let mut t = T::default();
    let a = t.alloc(50 * M);
    t.free(a);
    let c = t.alloc(25 * M);
    t.free(c);
    assert_eq!(t.run("max_split_size_mb:20").peak_reserved, Bytes(76 * M));
    assert_eq!(
        t.run("max_split_size_mb:20,max_non_split_rounding_mb:40")
            .peak_reserved,
        Bytes(50 * M)
    );
}

#[test]
fn roundup_power2_divisions_round_requests() {
    let mut t = T::default();
    let a = t.alloc(5 * M + 1);
    t.free(a);
    let s = t.run("roundup_power2_divisions:4");
    assert_eq!(s.peak_allocated, Bytes(6 * M));
    let s = t.run("");
    assert_eq!(s.peak_allocated, Bytes(5 * M + 512));
}

#[test]
fn device_limit_releases_cached_segments_and_retries() {
    let mut t = T::default();
    let a = t.alloc_on(30 * M, 0);
    t.free(a);
    let b = t.alloc_on(30 * M, 1); // stream 1 cannot use stream 0's cache; 60 > 40 MiB
    t.free(b);
    let opts = ReplayOptions {
        capacity: Some(Bytes(40 * M)),
        ..ReplayOptions::default()
    };
    let s = t.run_with("", &opts).unwrap();
    assert_eq!(s.peak_reserved, Bytes(30 * M));
    assert_eq!(s.alloc_retries, 1);
    assert_eq!(s.segments_freed, 1);
    assert_eq!(s.segments_allocated, 2);

    let mut t = T::default();
    let a = t.alloc(30 * M);
    let _b = t.alloc(20 * M);
    t.free(a);
    let err = t.run_with("", &opts).unwrap_err();
    assert!(
        matches!(
            err,
            ReplayError::OutOfMemory {
                alloc: AllocId(1),
                event: Some(EventIdx(1)),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("at event e1"), "{err}");
}

#[test]
fn oom_retry_drains_pending_frees() {
    let mut t = T::default();
    let a = t.alloc(30 * M);
    t.free_requested(a);
    let b = t.alloc(30 * M); // a still pending; 60 > 40: sync events, reuse a's segment
    t.free_completed(a); // already returned: ignored
    t.free(b);
    let opts = ReplayOptions {
        capacity: Some(Bytes(40 * M)),
        ..ReplayOptions::default()
    };
    let s = t.run_with("", &opts).unwrap();
    assert_eq!(s.peak_reserved, Bytes(30 * M));
    assert_eq!(s.alloc_retries, 1);
    // The drained block was merged back whole and released, then a new segment made.
    assert_eq!(s.segments_allocated, 2);
}

#[test]
fn release_available_cached_blocks_frees_oversize_blocks() {
    let mut t = T::default();
    let a = t.alloc(30 * M);
    let b = t.alloc(22 * M);
    let keep = t.alloc(2 * M); // a 20 MiB segment (split, so never released)
    t.free(a);
    t.free(b);
    let c = t.alloc(40 * M); // 72 + 40 > 80: frees 30 then 22 MiB (>= max(40, 20))
    t.free(c);
    t.free(keep);
    let opts = ReplayOptions {
        capacity: Some(Bytes(80 * M)),
        ..ReplayOptions::default()
    };
    let s = t.run_with("max_split_size_mb:20", &opts).unwrap();
    assert_eq!(
        s.alloc_retries, 0,
        "release_available_cached_blocks suffices"
    );
    assert_eq!(s.segments_freed, 2);
    assert_eq!(s.peak_reserved, Bytes(72 * M));
    assert_eq!(s.final_reserved, Bytes(60 * M)); // keep's 20 MiB + c's 40 MiB, cached
}

#[test]
fn garbage_collection_frees_aged_blocks_under_a_fraction() {
    let mut t = T::default();
    let a = t.alloc_on(30 * M, 0);
    t.free(a);
    let b = t.alloc_on(12 * M, 1);
    t.free(b);
    let opts = ReplayOptions {
        device_memory: Bytes(100 * M),
        ..ReplayOptions::default()
    };
    let s = t
        .run_with(
            "per_process_memory_fraction:0.5,garbage_collection_threshold:0.5",
            &opts,
        )
        .unwrap();
    assert_eq!(s.gc_runs, 1);
    assert_eq!(s.segments_freed, 1);
    assert_eq!(s.peak_reserved, Bytes(30 * M));
    assert_eq!(s.final_reserved, Bytes(12 * M));
}

#[test]
fn expandable_segments_map_only_needed_pages() {
    let mut t = T::default();
    let a = t.alloc(5 * M); // maps one 20 MiB page
    let b = t.alloc(30 * M); // 15 MiB free tail + one more page: 35 MiB, split
    t.free(a);
    t.free(b);
    let s = t.run("expandable_segments:True");
    assert_eq!(s.peak_reserved, Bytes(40 * M));
    assert_eq!(s.segments_allocated, 1);
    assert_eq!(s.segment_maps, 2);
    assert_eq!(s.bytes_mapped, Bytes(40 * M));
    assert_eq!(t.run("").peak_reserved, Bytes(50 * M));
    // large_segment_size_mb sets the large page.
    let s = t.run("expandable_segments:True,large_segment_size_mb:16");
    assert_eq!(s.peak_reserved, Bytes(48 * M));
}

#[test]
fn expandable_small_pool_uses_2mib_pages_per_stream() {
    let mut t = T::default();
    // Three ~0.95 MiB requests: two share the first 2 MiB page, the third maps a second.
    let a = t.alloc_on(1_000_000, 0);
    let b = t.alloc_on(1_000_000, 0);
    let d = t.alloc_on(1_000_000, 0);
    let c = t.alloc_on(1000, 3); // another stream: its own segment
    t.free(a);
    t.free(b);
    t.free(c);
    t.free(d);
    let s = t.run("expandable_segments:True");
    assert_eq!(s.peak_reserved, Bytes(6 * M));
    assert_eq!(s.segments_allocated, 2);
}

#[test]
fn expandable_release_unmaps_free_pages_on_oom() {
    let mut t = T::default();
    let a = t.alloc_on(40 * M, 0);
    t.free(a);
    let b = t.alloc_on(40 * M, 1); // other stream: 80 > 60 MiB, unmap stream 0's pages
    t.free(b);
    let opts = ReplayOptions {
        capacity: Some(Bytes(60 * M)),
        ..ReplayOptions::default()
    };
    let s = t.run_with("expandable_segments:True", &opts).unwrap();
    assert_eq!(s.peak_reserved, Bytes(40 * M));
    assert_eq!(s.segment_unmaps, 1);
    assert_eq!(s.bytes_unmapped, Bytes(40 * M));
    assert_eq!(
        s.segments_freed, 1,
        "the fully unmapped segment is released"
    );
    assert_eq!(s.alloc_retries, 1);
}

#[test]
fn expandable_free_tail_is_chosen_last() {
    // A free tail next to unmapped space counts as its size plus the unmapped space, so
    // best fit prefers a larger hole elsewhere.
    let mut t = T::default();
    let a = t.alloc(20 * M); // page 1, full
    let hole = t.alloc(8 * M); // page 2: [8 hole][12 tail]
    let keep = t.alloc(10 * M); // [8 hole][10 keep][2 tail | unmapped]
    t.free(hole);
    let x = t.alloc(1536 * 1024); // 1.5 MiB goes into the 8 MiB hole, not the 2 MiB tail
    let y = t.alloc(8 * M); // no hole of 8 MiB is left: tail + one more page
    for id in [x, y, a, keep] {
        t.free(id);
    }
    let s = t.run("expandable_segments:True");
    assert_eq!(s.peak_reserved, Bytes(60 * M));
    assert_eq!(s.segment_maps, 3);
}

#[test]
fn markers_and_bad_traces() {
    let mut t = T::default();
    let a = t.alloc(1000);
    t.ev(EventKind::Marker {
        kind: stweaver_core::MarkerKind::IterationEnd,
        label: None,
    });
    t.free(a);
    assert_eq!(t.run("").peak_reserved, Bytes(2 * M));
    t.free(a);
    let err = t.run_with("", &ReplayOptions::default()).unwrap_err();
    assert!(matches!(err, ReplayError::Trace(_)), "{err}");
    let cfg = AllocatorConfig::parse("backend:cudaMallocAsync").unwrap();
    let mut t = T::default();
    t.alloc(1);
    let err = replay(&t.trace, &cfg, &ReplayOptions::default()).unwrap_err();
    assert_eq!(err, ReplayError::Unsupported("backend:cudaMallocAsync"));
}

#[test]
fn recorded_bases_break_ties_like_the_recording() {
    // Two free 20 MiB segments of the same size: best fit takes the lower address.
    // With recorded bases the second segment sits *below* the first.
    let mut t = T::default();
    let a = t.alloc(20 * M);
    let b = t.alloc(20 * M);
    t.trace.allocations[0].addr = 0x7000_0000_0000;
    t.trace.allocations[1].addr = 0x6000_0000_0000;
    t.free(a);
    t.free(b);
    let c = t.alloc(20 * M);
    let opts = ReplayOptions {
        record_layout: true,
        ..ReplayOptions::default()
    };
    let cfg = AllocatorConfig::default();
    let r = replay(&t.trace, &cfg, &opts).unwrap();
    let layout = r.layout.unwrap();
    assert_eq!(layout.blocks.len(), 3);
    assert_eq!(layout.blocks[2].segment, 1, "lower address wins the tie");
    assert_eq!(layout.segments[1].base, 0x6000_0000_0000);
    let _ = c;
    let opts = ReplayOptions {
        record_layout: true,
        segment_bases: SegmentBases::Synthetic,
        ..ReplayOptions::default()
    };
    let layout = replay(&t.trace, &cfg, &opts).unwrap().layout.unwrap();
    assert_eq!(layout.blocks[2].segment, 0);
    assert_eq!(layout.blocks[0].end, Some(EventIdx(3)));
    assert_eq!(layout.blocks[2].end, None);
}

#[test]
fn overlapping_recorded_bases_fall_back_to_synthetic() {
    let mut t = T::default();
    let a = t.alloc(20 * M);
    let b = t.alloc(20 * M);
    t.trace.allocations[0].addr = 0x7000_0000_0000;
    t.trace.allocations[1].addr = 0x7000_0000_0000 + 4 * M; // inside the first segment
    t.free(a);
    t.free(b);
    let opts = ReplayOptions {
        record_layout: true,
        ..ReplayOptions::default()
    };
    let layout = replay(&t.trace, &AllocatorConfig::default(), &opts)
        .unwrap()
        .layout
        .unwrap();
    assert!(layout.segments[1].base >= 1 << 60);
}

#[test]
fn timeline_is_bucketed() {
    let mut t = T::default();
    for _ in 0..10 {
        let a = t.alloc(20 * M);
        t.free(a);
    }
    let opts = ReplayOptions {
        timeline_points: 5,
        ..ReplayOptions::default()
    };
    let s = t.run_with("", &opts).unwrap();
    assert_eq!(s.timeline.len(), 5);
    assert!(
        s.timeline
            .iter()
            .all(|p| p.reserved == Bytes(20 * M) && p.allocated == Bytes(20 * M))
    );
}

/// A random trace: sizes across both pools and the 10 MiB boundary, a few streams,
/// some frees deferred (FreeRequested now, FreeCompleted later), some never freed.
fn arb_trace() -> impl Strategy<Value = Trace> {
    let op = (0u8..10, 1u64..(48 * M), 0u64..3, any::<u16>());
    prop::collection::vec(op, 1..160).prop_map(|ops| {
        let mut t = T::default();
        let mut live: Vec<AllocId> = Vec::new();
        let mut pending: Vec<AllocId> = Vec::new();
        for (kind, size, stream, pick) in ops {
            let size = match size % 4 {
                0 => size % (64 * 1024) + 1,
                1 => size % (2 * M) + 1,
                _ => size,
            };
            match kind {
                0..=4 => live.push(t.alloc_on(size, stream)),
                5..=7 if !live.is_empty() => {
                    let id = live.swap_remove(pick as usize % live.len());
                    t.free(id);
                }
                8 if !live.is_empty() => {
                    let id = live.swap_remove(pick as usize % live.len());
                    t.free_requested(id);
                    pending.push(id);
                }
                9 if !pending.is_empty() => {
                    let id = pending.swap_remove(pick as usize % pending.len());
                    t.free_completed(id);
                }
                _ => live.push(t.alloc_on(size, stream)),
            }
        }
        t.trace.device = DeviceId(0);
        t.0.build()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn invariants_hold_on_random_traces(
        trace in arb_trace(),
        conf in prop::sample::select(vec![
            "",
            "expandable_segments:True",
            "max_split_size_mb:20",
            "roundup_power2_divisions:[1:2,16:4,>:8]",
            "expandable_segments:True,large_segment_size_mb:12",
            "max_split_size_mb:24,max_non_split_rounding_mb:64,garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
        ]),
        capacity in prop::option::of(64u64..160),
    ) {
        let cfg = AllocatorConfig::parse(conf).unwrap();
        let opts = ReplayOptions {
            capacity: capacity.map(|c| Bytes(c * M)),
            device_memory: Bytes(160 * M),
            ..ReplayOptions::default()
        };
        match checked_replay(&trace, &cfg, &opts) {
            Ok(s) => {
                // Reserved covers active, active covers allocated and requested
                // (allocated drops at free_requested, requested at free_completed).
                prop_assert!(s.peak_reserved >= s.peak_active);
                prop_assert!(s.peak_active >= s.peak_allocated);
                prop_assert!(s.peak_active >= s.peak_requested);
                // Requested bytes follow the trace's lifetimes unless an OOM retry
                // completed pending frees early.
                if s.alloc_retries == 0 {
                    prop_assert_eq!(s.peak_requested, trace.lower_bound().bytes);
                }
                if let Some(c) = opts.capacity {
                    prop_assert!(s.peak_reserved <= c);
                }
            }
            Err(ReplayError::OutOfMemory { .. }) => prop_assert!(capacity.is_some() || cfg.per_process_memory_fraction.is_some()),
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }
}
