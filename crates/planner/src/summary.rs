//! What a trace holds, in numbers: the figures `stweaver inspect` prints.
//!
//! [`summarize`] makes one pass over the events (counts, distinct sizes, streams, what
//! is still live at the end), one for the lower bound ([`Trace::lower_bound`]) and
//! one for the iteration period ([`crate::iteration::detect_period`]): O(events +
//! allocations), with hash sets for sizes and streams.

use rustc_hash::{FxHashMap, FxHashSet};
use stweaver_core::{Bytes, DeviceId, EventIdx, EventKind, StreamId, Trace};

use crate::iteration::{Period, detect_period};

/// Events by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventCounts {
    pub total: usize,
    pub alloc: usize,
    pub free_requested: usize,
    pub free_completed: usize,
    pub marker: usize,
    /// `SavedPack` / `SavedUnpack` events (autograd's saved tensors, stweaver traces).
    pub saved_pack: usize,
    pub saved_unpack: usize,
}

/// Allocations by fate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocationCounts {
    pub total: usize,
    /// Live before recording began (no `Alloc` event).
    pub preexisting: usize,
    /// Never freed (still live at the end of the trace).
    pub never_freed: usize,
}

/// One stream's share of the allocs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamUse {
    pub stream: StreamId,
    /// `Alloc` events on the stream.
    pub allocs: usize,
    /// Bytes those allocs requested, summed.
    pub bytes: Bytes,
}

/// The lower bound and when it is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeakAt {
    /// Peak of live requested bytes.
    pub bytes: Bytes,
    /// The `Alloc` event that first reaches it (`None`: preexisting blocks only).
    pub event: Option<EventIdx>,
    /// Which alloc that is, counting `Alloc` events from 0.
    pub alloc_number: Option<usize>,
    /// Its time stamp (µs since the Unix epoch; 0 when the input has none).
    pub time_us: Option<u64>,
}

/// Everything `inspect` reports about one trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceSummary {
    pub device: DeviceId,
    pub events: EventCounts,
    pub allocations: AllocationCounts,
    /// Distinct requested sizes among all allocations.
    pub distinct_sizes: usize,
    /// Streams with allocs, by stream handle.
    pub streams: Vec<StreamUse>,
    /// Bytes requested by all `Alloc` events.
    pub requested_bytes: Bytes,
    /// Bytes still live after the last event.
    pub live_at_end: Bytes,
    pub lower_bound: PeakAt,
    /// First and last event time stamps (µs), when the trace has them.
    pub time_span_us: Option<(u64, u64)>,
    /// Distinct marker labels.
    pub labels: usize,
    pub period: Option<Period>,
    /// The iterations grouped by request signature
    /// ([`crate::iteration_classes::iteration_classes`]), the most frequent first.
    pub iteration_classes: Vec<crate::iteration_classes::IterationClass>,
}

/// Summarises a trace (which should have passed [`Trace::validate`]; allocation ids
/// out of range are skipped rather than trusted).
pub fn summarize(trace: &Trace) -> TraceSummary {
    let mut events = EventCounts {
        total: trace.events.len(),
        ..EventCounts::default()
    };
    let mut freed = vec![false; trace.allocations.len()];
    let mut streams: FxHashMap<StreamId, StreamUse> = FxHashMap::default();
    let mut requested = Bytes::ZERO;
    for e in &trace.events {
        match e.kind {
            EventKind::Alloc(id) => {
                events.alloc += 1;
                if let Some(a) = trace.allocations.get(id.index()) {
                    requested += a.size;
                    let s = streams.entry(a.stream).or_insert(StreamUse {
                        stream: a.stream,
                        allocs: 0,
                        bytes: Bytes::ZERO,
                    });
                    s.allocs += 1;
                    s.bytes += a.size;
                }
            }
            EventKind::FreeRequested(id) => {
                events.free_requested += 1;
                if let Some(f) = freed.get_mut(id.index()) {
                    *f = true;
                }
            }
            EventKind::FreeCompleted(id) => {
                events.free_completed += 1;
                if let Some(f) = freed.get_mut(id.index()) {
                    *f = true;
                }
            }
            EventKind::Marker { .. } => events.marker += 1,
            EventKind::SavedPack(_) => events.saved_pack += 1,
            EventKind::SavedUnpack(_) => events.saved_unpack += 1,
        }
    }
    let mut allocations = AllocationCounts {
        total: trace.allocations.len(),
        ..AllocationCounts::default()
    };
    let mut live_at_end = Bytes::ZERO;
    let mut sizes: FxHashSet<Bytes> = FxHashSet::default();
    for (a, &f) in trace.allocations.iter().zip(&freed) {
        sizes.insert(a.size);
        allocations.preexisting += usize::from(a.preexisting);
        if !f {
            allocations.never_freed += 1;
            live_at_end += a.size;
        }
    }
    let mut streams: Vec<StreamUse> = streams.into_values().collect();
    streams.sort_by_key(|s| s.stream);

    let lb = trace.lower_bound();
    let alloc_number = lb.at.map(|at| {
        trace.events[..at.index()]
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Alloc(_)))
            .count()
    });
    let lower_bound = PeakAt {
        bytes: lb.bytes,
        event: lb.at,
        alloc_number,
        time_us: lb
            .at
            .and_then(|at| trace.events.get(at.index()))
            .map(|e| e.time_us),
    };
    let time_span_us = match (trace.events.first(), trace.events.last()) {
        (Some(f), Some(l)) if f.time_us != 0 || l.time_us != 0 => Some((f.time_us, l.time_us)),
        _ => None,
    };
    TraceSummary {
        device: trace.device,
        events,
        allocations,
        distinct_sizes: sizes.len(),
        streams,
        requested_bytes: requested,
        live_at_end,
        lower_bound,
        time_span_us,
        labels: trace.labels.len(),
        period: detect_period(trace),
        iteration_classes: crate::iteration_classes::iteration_classes(trace),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stweaver_core::{AllocId, Allocation, Event};

    #[test]
    fn counts_fates_streams_and_the_peak() {
        let a = |size, stream, preexisting| Allocation {
            size: Bytes(size),
            stream: StreamId(stream),
            addr: 0,
            preexisting,
        };
        let ev = |kind, time_us| Event { kind, time_us };
        let t = Trace {
            device: DeviceId(1),
            allocations: vec![
                a(100, 0, true),
                a(10, 0, false),
                a(20, 7, false),
                a(10, 7, false),
            ],
            events: vec![
                ev(EventKind::Alloc(AllocId(1)), 1000),
                ev(EventKind::Alloc(AllocId(2)), 1001),
                ev(EventKind::FreeRequested(AllocId(0)), 1002),
                ev(EventKind::FreeCompleted(AllocId(0)), 1003),
                ev(EventKind::FreeCompleted(AllocId(1)), 1004),
                ev(EventKind::Alloc(AllocId(3)), 1005),
            ],
            labels: vec![],
            restores: Vec::new(),
        };
        t.validate().unwrap();
        let s = summarize(&t);
        assert_eq!(s.events.total, 6);
        assert_eq!(s.events.alloc, 3);
        assert_eq!(s.events.free_requested, 1);
        assert_eq!(s.events.free_completed, 2);
        assert_eq!(s.allocations.preexisting, 1);
        assert_eq!(s.allocations.never_freed, 2);
        assert_eq!(s.live_at_end, Bytes(30));
        assert_eq!(s.distinct_sizes, 3);
        assert_eq!(s.requested_bytes, Bytes(40));
        assert_eq!(
            s.streams,
            vec![
                StreamUse {
                    stream: StreamId(0),
                    allocs: 1,
                    bytes: Bytes(10)
                },
                StreamUse {
                    stream: StreamId(7),
                    allocs: 2,
                    bytes: Bytes(30)
                },
            ]
        );
        // 100 + 10 + 20 at the second alloc.
        assert_eq!(s.lower_bound.bytes, Bytes(130));
        assert_eq!(s.lower_bound.event, Some(EventIdx(1)));
        assert_eq!(s.lower_bound.alloc_number, Some(1));
        assert_eq!(s.lower_bound.time_us, Some(1001));
        assert_eq!(s.time_span_us, Some((1000, 1005)));
        assert_eq!(s.period, None);
    }
}
