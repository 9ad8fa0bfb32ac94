//! What a replay reports: the allocator's own statistics (the counters behind
//! `torch.cuda.memory_stats()`, research §6.12), a down-sampled timeline for pictures,
//! and optionally the full layout (every segment and block in address × time).
//!
//! The timeline keeps, per bucket of consecutive events, the maximum of each counter in
//! the bucket, so a drawn curve never hides a peak. Recording costs O(1) per event.

use stweaver_core::{AllocId, Bytes, EventIdx, StreamId};

/// Which of the two default pools a block or segment belongs to (§6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    /// Rounded requests up to 1 MiB; 2 MiB segments.
    Small,
    /// Everything else.
    Large,
}

/// The maximum of the allocator's counters over one bucket of events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimelinePoint {
    /// First event of the bucket.
    pub event: EventIdx,
    /// Bytes reserved from the device (segments, or mapped pages).
    pub reserved: Bytes,
    /// Bytes of allocated blocks (rounded sizes).
    pub allocated: Bytes,
    /// Requested bytes of active blocks.
    pub requested: Bytes,
}

/// Summary of one replay. Byte counters follow PyTorch's definitions (§6.12).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// `max_reserved`: the peak of bytes held from the device.
    pub peak_reserved: Bytes,
    /// First event at which `peak_reserved` is reached (`None`: before event 0, while
    /// placing preexisting allocations).
    pub peak_reserved_at: Option<EventIdx>,
    /// `max_allocated`: the peak of allocated block bytes (rounded sizes, including
    /// unsplit remainders handed out whole).
    pub peak_allocated: Bytes,
    /// The peak of requested bytes of active blocks.
    pub peak_requested: Bytes,
    /// The peak of active bytes (allocated plus blocks whose free waits on events).
    pub peak_active: Bytes,
    /// Counters at the end of the trace.
    pub final_reserved: Bytes,
    pub final_allocated: Bytes,
    /// Allocations served (`malloc` calls).
    pub allocations: u64,
    /// Segments created: `cudaMalloc` calls, or expandable segments (VA reservations).
    pub segments_allocated: u64,
    /// Segments given back (`cudaFree` or released expandable segments).
    pub segments_freed: u64,
    /// Expandable segments: map and unmap operations and their bytes.
    pub segment_maps: u64,
    pub segment_unmaps: u64,
    pub bytes_mapped: Bytes,
    pub bytes_unmapped: Bytes,
    /// `num_alloc_retries`: allocations that needed `release_cached_blocks`.
    pub alloc_retries: u64,
    /// Garbage-collection passes that ran (§6.10).
    pub gc_runs: u64,
    /// Down-sampled counters over the trace (empty unless requested).
    pub timeline: Vec<TimelinePoint>,
}

impl ReplayStats {
    /// `peak_allocated / peak_reserved` (what `ground_truth.json` calls utilization).
    pub fn utilization(&self) -> f64 {
        self.peak_allocated.ratio(self.peak_reserved)
    }
}

/// One segment over its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentSpan {
    /// Base address in the replay's address space.
    pub base: u64,
    /// `cudaMalloc` size, or the VA reservation of an expandable segment.
    pub size: Bytes,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub expandable: bool,
    /// Event at which it was created (`EventIdx(0)` for segments made for
    /// preexisting allocations).
    pub created: EventIdx,
    /// Event at which it was released, `None` if held to the end.
    pub released: Option<EventIdx>,
}

/// One allocation's block over its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSpan {
    pub alloc: AllocId,
    /// Index into [`ReplayLayout::segments`].
    pub segment: u32,
    /// Offset of the block from its segment's base.
    pub offset: Bytes,
    /// Block size (rounded; may include an unsplit remainder).
    pub size: Bytes,
    /// Requested size.
    pub requested: Bytes,
    /// Alloc event (`EventIdx(0)` for preexisting allocations).
    pub start: EventIdx,
    /// Event at which the block went back to the pool, `None` if never.
    pub end: Option<EventIdx>,
}

/// Where the replayed allocator put everything, for pictures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayLayout {
    pub segments: Vec<SegmentSpan>,
    /// In allocation order.
    pub blocks: Vec<BlockSpan>,
    /// Number of events of the trace (the time axis).
    pub events: u32,
}

/// Bucketed maxima of the counters; O(1) per event.
#[derive(Debug)]
pub(crate) struct TimelineRecorder {
    bucket_len: u64,
    points: Vec<TimelinePoint>,
}

impl TimelineRecorder {
    /// `points` buckets over `events` events (none when `points == 0`).
    pub(crate) fn new(points: usize, events: usize) -> Self {
        let points = points.min(events.max(1));
        let bucket_len = if points == 0 {
            0
        } else {
            (events.max(1) as u64).div_ceil(points as u64)
        };
        TimelineRecorder {
            bucket_len,
            points: Vec::with_capacity(points),
        }
    }

    #[inline]
    pub(crate) fn record(&mut self, event: u32, reserved: u64, allocated: u64, requested: u64) {
        if self.bucket_len == 0 {
            return;
        }
        let bucket = u64::from(event) / self.bucket_len;
        if self.points.len() as u64 <= bucket {
            self.points.push(TimelinePoint {
                event: EventIdx((bucket * self.bucket_len) as u32),
                ..TimelinePoint::default()
            });
        }
        if let Some(p) = self.points.last_mut() {
            p.reserved = p.reserved.max(Bytes(reserved));
            p.allocated = p.allocated.max(Bytes(allocated));
            p.requested = p.requested.max(Bytes(requested));
        }
    }

    pub(crate) fn finish(self) -> Vec<TimelinePoint> {
        self.points
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_keeps_bucket_maxima() {
        let mut t = TimelineRecorder::new(2, 4);
        t.record(0, 10, 1, 1);
        t.record(1, 30, 2, 2);
        t.record(2, 20, 5, 3);
        t.record(3, 5, 4, 4);
        let p = t.finish();
        assert_eq!(p.len(), 2);
        assert_eq!(
            (p[0].event, p[0].reserved, p[0].allocated),
            (EventIdx(0), Bytes(30), Bytes(2))
        );
        assert_eq!(
            (p[1].event, p[1].reserved, p[1].requested),
            (EventIdx(2), Bytes(20), Bytes(4))
        );
        let mut none = TimelineRecorder::new(0, 4);
        none.record(0, 1, 1, 1);
        assert!(none.finish().is_empty());
    }
}
