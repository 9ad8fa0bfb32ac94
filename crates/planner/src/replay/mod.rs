//! Replay of a [`Trace`] through a model of PyTorch 2.11's CUDA caching allocator
//! (native backend, default pools), to reproduce what PyTorch would reserve.
//!
//! The driver places preexisting allocations first (in id order, before event 0), then
//! walks the events: `Alloc` calls `malloc` at the event's position; `FreeRequested`
//! ends the block's "allocated" life and, when no `FreeCompleted` follows, returns it
//! to the pool at once; `FreeCompleted` returns it to the pool (PyTorch's
//! `free_block`, after stream events, research §6.6). Markers do nothing.
//!
//! The rules modelled are those of research `pytorch-allocator-2.11.md` §6.1–§6.11,
//! documented in [`native`](self) and `expandable`: `round_size` and
//! `roundup_power2_divisions`, small/large pools, per-stream reuse, segment sizes, best
//! fit with split rules, `max_split_size_mb` and `max_non_split_rounding_mb`,
//! coalescing, garbage collection, the release-and-retry path against an optional device
//! `capacity`, and `expandable_segments:True` with `large_segment_size_mb`.
//!
//! **Segment addresses.** Best fit breaks ties by address, so bit-exact replay needs the
//! addresses PyTorch got from `cudaMalloc` (§6.14). A trace records where every
//! allocation went; a block placed in a brand-new segment sits at the segment's base,
//! so with [`SegmentBases::Recorded`] a new `cudaMalloc` segment takes the recorded
//! address of the allocation that caused it (when known and not overlapping a live
//! segment). Expandable segments and [`SegmentBases::Synthetic`] use fresh ascending
//! addresses above 2^60.
//!
//! Cost: O((events + allocations) · log(free blocks)) time, O(allocations) memory (plus
//! the layout when recorded). The 108 k-allocation MoE trace replays in milliseconds.

mod config;
mod expandable;
mod native;
mod stats;

pub use config::{
    AllocatorConfig, Backend, ConfigError, DEFAULT_LARGE_SEGMENT, MIB, MIN_BLOCK_SIZE,
    ROUNDUP_INTERVALS, SMALL_BUFFER, SMALL_SIZE,
};
pub use stats::{BlockSpan, PoolKind, ReplayLayout, ReplayStats, SegmentSpan, TimelinePoint};

use stweaver_core::{AllocId, Bytes, EventIdx, EventKind, Trace, TraceError};

use native::Engine;
use stats::TimelineRecorder;

/// `totalGlobalMem` of the NVIDIA H200 the bundled traces were recorded on; sizes the
/// virtual reservation of expandable segments.
pub const H200_MEMORY: Bytes = Bytes(150_109_880_320);

/// Where new segments are placed in the replay's address space.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SegmentBases {
    /// A new `cudaMalloc` segment takes the recorded address of the allocation that
    /// caused it (bit-exact tie-breaks when replaying the recorded settings).
    #[default]
    Recorded,
    /// Fresh ascending addresses.
    Synthetic,
}

/// How to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Device memory limit: `cudaMalloc` / page mapping fails beyond it, which triggers
    /// the release-and-retry path and then out of memory. `None` = unlimited.
    pub capacity: Option<Bytes>,
    /// The device's total memory (`totalGlobalMem`): sizes expandable reservations and
    /// `per_process_memory_fraction`.
    pub device_memory: Bytes,
    pub segment_bases: SegmentBases,
    /// Number of timeline points to keep (0 = none).
    pub timeline_points: usize,
    /// Keep every segment and block span (for pictures).
    pub record_layout: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            capacity: None,
            device_memory: H200_MEMORY,
            segment_bases: SegmentBases::Recorded,
            timeline_points: 0,
            record_layout: false,
        }
    }
}

/// Why a replay stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error("invalid trace: {0}")]
    Trace(#[from] TraceError),
    #[error("the replay does not model {0}")]
    Unsupported(&'static str),
    #[error(
        "out of memory {} replaying allocation {alloc} ({requested} requested, {rounded} rounded): {reserved} reserved, {allocated} allocated, limit {limit}",
        .event.map_or_else(|| "before event 0".to_string(), |e| format!("at event {e}"))
    )]
    OutOfMemory {
        alloc: AllocId,
        event: Option<EventIdx>,
        requested: Bytes,
        rounded: Bytes,
        reserved: Bytes,
        allocated: Bytes,
        limit: Bytes,
    },
    #[error("the replay ran out of synthetic address space")]
    AddressSpaceExhausted,
    #[error("replay invariant broken: {0} (a bug in stweaver)")]
    Internal(&'static str),
}

/// The outcome of a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    pub stats: ReplayStats,
    /// Present when [`ReplayOptions::record_layout`] was set.
    pub layout: Option<ReplayLayout>,
}

/// Replays `trace` under `config`. Validates the trace first.
pub fn replay(
    trace: &Trace,
    config: &AllocatorConfig,
    options: &ReplayOptions,
) -> Result<Replay, ReplayError> {
    trace.validate()?;
    let mut engine = prepare(trace, config, options)?;
    let mut timeline = TimelineRecorder::new(options.timeline_points, trace.events.len());
    let completes = completion_table(trace);
    for (i, e) in trace.events.iter().enumerate() {
        engine.now = Some(i as u32);
        step(&mut engine, trace, &completes, e.kind)?;
        let (r, a, q) = engine.counters();
        timeline.record(i as u32, r, a, q);
    }
    let (mut stats, segments, blocks) = engine.finish();
    stats.timeline = timeline.finish();
    let layout = match (segments, blocks) {
        (Some(segments), Some(blocks)) => Some(ReplayLayout {
            segments,
            blocks,
            events: trace.events.len() as u32,
        }),
        _ => None,
    };
    Ok(Replay { stats, layout })
}

fn prepare<'c>(
    trace: &Trace,
    config: &'c AllocatorConfig,
    options: &ReplayOptions,
) -> Result<Engine<'c>, ReplayError> {
    if config.backend == Backend::CudaMallocAsync {
        return Err(ReplayError::Unsupported("backend:cudaMallocAsync"));
    }
    let mut engine = Engine::new(config, options, trace.allocations.len());
    for (i, a) in trace.allocations.iter().enumerate() {
        if a.preexisting {
            engine.malloc(AllocId(i as u32), a.size.get(), a.stream.0, a.addr)?;
        }
    }
    Ok(engine)
}

/// Per allocation: does a `FreeCompleted` event exist?
fn completion_table(trace: &Trace) -> Vec<bool> {
    let mut completes = vec![false; trace.allocations.len()];
    for e in &trace.events {
        if let EventKind::FreeCompleted(id) = e.kind {
            completes[id.index()] = true;
        }
    }
    completes
}

fn step(
    engine: &mut Engine<'_>,
    trace: &Trace,
    completes: &[bool],
    kind: EventKind,
) -> Result<(), ReplayError> {
    match kind {
        EventKind::Alloc(id) => {
            let a = &trace.allocations[id.index()];
            engine.malloc(id, a.size.get(), a.stream.0, a.addr)
        }
        EventKind::FreeRequested(id) => engine.free_requested(id, completes[id.index()]),
        EventKind::FreeCompleted(id) => engine.free_completed(id),
        EventKind::Marker { .. } | EventKind::SavedPack(_) | EventKind::SavedUnpack(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests;
