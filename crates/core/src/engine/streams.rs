//! Stream-ordered frees: the bookkeeping behind `record_stream`.
//!
//! PyTorch's rule (and ours): memory allocated on stream `s` is reused only by later
//! work on `s` (each stream has its own arenas, so stream order alone makes reuse safe).
//! When a block is also used by other streams (`record_stream(ptr, t)`), freeing it
//! records one event on each such stream `t` and the block stays *pending*: active,
//! not allocated, not reusable. Once every one of those events has completed — every
//! user stream has passed the point of the free — the free completes and the block
//! returns to its arena.
//!
//! The protocol keeps the engine's lock off every device call:
//!
//! 1. **free** (locked): the block becomes `PendingFree`; its [`StreamUse`]s are taken
//!    out of the block and given idle events from the pool. (unlocked): missing events
//!    are created and each is recorded on its stream. (locked): each recorded event is
//!    queued as a [`PendingEvent`]; the block keeps a count of outstanding events. An
//!    event that could not be created or recorded is never queued, so its block stays
//!    pending forever: leaking is safe, reusing would not be.
//! 2. **process** (on every `malloc` while anything is pending, and on demand): the
//!    queue is taken out whole (locked), events queried (unlocked), and completed
//!    events are applied (locked): the event goes back to the idle pool, the block's
//!    count drops, and at zero the free completes. Events still running are requeued.
//!    Because the queue is taken out, two threads never process the same event.
//!    Events of one stream complete in the order they were recorded, and the queue
//!    holds them in that order (each event is stamped as it is recorded and queued
//!    among its stream's by stamp: a use sealed early, `Engine::record_stream_enqueued`,
//!    is queued only at its free; two threads recording on one stream at once can only
//!    put an older event behind a newer one), so querying stops, per
//!    stream, at the first event still running: the ones queued behind it are taken
//!    as running without a query. O(streams + completed events) queries per process
//!    instead of one per pending event: a stream that runs behind (offload's copy
//!    stream, holding a few hundred frees in a forward) cost a query per pending free
//!    on every `malloc` (GPT-2 XL at 0.8 x LB: tens of ms of host time per forward).
//!    Taking an event as running when it has completed only delays its free.
//! 3. **release** (`empty_cache` and the out-of-memory retry): as in 2, but each event
//!    is synchronised instead of queried, so every pending free completes.
//!
//! Costs: free with `k` user streams makes `k` record calls; processing makes one query
//! per completed event plus one per stream with events still running. Steady state reuses the idle events and both queue buffers (no
//! heap allocation, no event creation).

use crate::engine::arena::Idx;
use crate::engine::device::DeviceEvent;
#[cfg(doc)]
use crate::engine::stream_use::StreamUse;
use crate::units::StreamId;

/// An event recorded for a pending free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PendingEvent {
    pub event: DeviceEvent,
    pub block: Idx,
    /// The stream the event was recorded on.
    pub stream: StreamId,
    /// Set by whoever queried or synchronised the event while it was taken out.
    pub done: bool,
    /// When it was recorded, by the queue's stamp ([`EventQueue::stamp`]): the queue
    /// keeps each stream's events in this order.
    pub seq: u64,
}

/// The queue of pending events and the pool of idle ones.
#[derive(Debug, Default)]
pub(crate) struct EventQueue {
    pending: Vec<PendingEvent>,
    /// The buffer the queue swaps with when it is taken out, so taking it out and
    /// bringing it back never allocates.
    spare: Vec<PendingEvent>,
    /// Created events not recorded for any pending free.
    pub idle: Vec<DeviceEvent>,
    /// The last stamp given ([`EventQueue::stamp`]).
    stamps: u64,
}

impl EventQueue {
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// A stamp for an event about to be recorded: stamps increase with each call, so an
    /// event stamped before another of the same stream was recorded before it (up to two
    /// threads recording on one stream at once, whose order only delays a free).
    pub fn stamp(&mut self) -> u64 {
        self.stamps += 1;
        self.stamps
    }

    /// Queues `event` (stamped `seq`) behind the events of `stream` stamped before it and
    /// ahead of those stamped after it: a free's events are stamped when recorded, but a
    /// use sealed early (`Engine::record_stream_enqueued`) is queued only at its free.
    /// O(1) when it is the stream's newest (scanning back over other streams' events).
    pub fn push(&mut self, event: DeviceEvent, block: Idx, stream: StreamId, seq: u64) {
        let mut at = self.pending.len();
        for (k, e) in self.pending.iter().enumerate().rev() {
            if e.stream == stream {
                if e.seq > seq {
                    at = k;
                } else {
                    break;
                }
            }
        }
        self.pending.insert(
            at,
            PendingEvent {
                event,
                block,
                stream,
                done: false,
                seq,
            },
        );
    }

    /// Takes every queued event out (for querying without the lock).
    pub fn take(&mut self) -> Vec<PendingEvent> {
        let spare = std::mem::take(&mut self.spare);
        std::mem::replace(&mut self.pending, spare)
    }

    /// Gives back a buffer returned by [`EventQueue::take`] once its events have been
    /// dealt with (unfinished ones requeued with [`EventQueue::push`]); the buffer is
    /// kept for the next take.
    pub fn give_back(&mut self, mut work: Vec<PendingEvent>) {
        work.clear();
        if work.capacity() > self.spare.capacity() {
            self.spare = work;
        }
    }

    /// Takes the queued events of `blocks` out of the queue (the rest stay queued), for
    /// waiting on them without the lock; give them back through the engine's
    /// `apply_events`. O(queue × blocks).
    pub fn take_for(&mut self, blocks: &[Idx]) -> Vec<PendingEvent> {
        let mut taken = Vec::new();
        self.pending.retain(|e| {
            let ours = blocks.contains(&e.block);
            if ours {
                taken.push(*e);
            }
            !ours
        });
        taken
    }

    /// Every queued event (for consistency checks).
    pub fn iter(&self) -> impl Iterator<Item = &PendingEvent> {
        self.pending.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_and_give_back_reuse_buffers() {
        let mut q = EventQueue::default();
        q.push(DeviceEvent(1), 7, StreamId(0), 1);
        q.push(DeviceEvent(2), 8, StreamId(0), 2);
        let work = q.take();
        assert_eq!(work.len(), 2);
        assert!(q.is_empty());
        q.push(DeviceEvent(3), 9, StreamId(0), 3);
        let cap = work.capacity();
        q.give_back(work);
        let again = q.take();
        assert_eq!(again.len(), 1);
        // The next take swaps in the buffer given back.
        q.give_back(again);
        assert!(q.spare.capacity() >= cap.min(1));
        assert!(q.iter().next().is_none());
    }

    #[test]
    fn each_streams_events_stay_in_stamp_order() {
        let mut q = EventQueue::default();
        let (a, b, c, d) = (q.stamp(), q.stamp(), q.stamp(), q.stamp());
        // Stamped a < b < c < d; queued d, b (other stream), c, then a sealed early.
        q.push(DeviceEvent(4), 4, StreamId(1), d);
        q.push(DeviceEvent(2), 2, StreamId(2), b);
        q.push(DeviceEvent(3), 3, StreamId(1), c);
        q.push(DeviceEvent(1), 1, StreamId(1), a);
        let s1: Vec<u64> = q
            .iter()
            .filter(|e| e.stream == StreamId(1))
            .map(|e| e.seq)
            .collect();
        assert_eq!(s1, vec![a, c, d]);
        assert_eq!(q.iter().count(), 4);
    }
}
