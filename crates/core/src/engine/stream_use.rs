//! The streams a block is used on besides its own (`record_stream`), kept in the
//! block (`Block::uses`, module `arena`) until its free records an event on each
//! (the protocol: module `streams`). A module of its own so that imports go one way:
//! `streams` (which queues blocks by slab index) → `arena` (which stores the uses) →
//! `stream_use`. O(uses) per update; the block's `Vec` keeps its capacity across
//! reuse of the slot.

use crate::engine::device::DeviceEvent;
use crate::units::StreamId;

/// A stream other than its own that a block is used on, and (once freed) the event
/// recorded on that stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamUse {
    pub stream: StreamId,
    pub event: Option<DeviceEvent>,
    /// Whether `event` was recorded successfully (phase 1 of the free).
    pub recorded: bool,
    /// `event` was recorded when the user said every use on `stream` was enqueued
    /// ([`crate::engine::Engine::record_stream_enqueued`]): the free waits for that point,
    /// not for whatever `stream` runs up to the free.
    pub sealed: bool,
    /// `event`'s stamp ([`crate::engine::streams::EventQueue::stamp`]), once recorded.
    pub seq: u64,
}

/// Adds `stream` to `uses` unless it is already there. O(uses).
pub(crate) fn add_use(uses: &mut Vec<StreamUse>, stream: StreamId) {
    if !uses.iter().any(|u| u.stream == stream) {
        uses.push(StreamUse {
            stream,
            event: None,
            recorded: false,
            sealed: false,
            seq: 0,
        });
    }
}

/// The use of `stream` in `uses` sealed with `event` (recorded on `stream` just now);
/// returns the event it replaces, if any, for the idle pool. O(uses).
pub(crate) fn seal_use(
    uses: &mut Vec<StreamUse>,
    stream: StreamId,
    event: DeviceEvent,
    seq: u64,
) -> Option<DeviceEvent> {
    let sealed = StreamUse {
        stream,
        event: Some(event),
        recorded: true,
        sealed: true,
        seq,
    };
    match uses.iter_mut().find(|u| u.stream == stream) {
        Some(u) => std::mem::replace(u, sealed).event,
        None => {
            uses.push(sealed);
            None
        }
    }
}

/// A later plain use of `stream` (`record_stream` after a seal: more work may come):
/// the seal is dropped; returns its event for the idle pool. O(uses).
pub(crate) fn unseal_use(uses: &mut [StreamUse], stream: StreamId) -> Option<DeviceEvent> {
    let u = uses.iter_mut().find(|u| u.stream == stream && u.sealed)?;
    u.sealed = false;
    u.recorded = false;
    u.event.take()
}

/// The events of sealed uses (for the idle pool, when `uses` is dropped unfreed).
pub(crate) fn sealed_events(uses: &[StreamUse]) -> impl Iterator<Item = DeviceEvent> + '_ {
    uses.iter().filter(|u| u.sealed).filter_map(|u| u.event)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_are_deduplicated() {
        let mut u = Vec::new();
        add_use(&mut u, StreamId(3));
        add_use(&mut u, StreamId(4));
        add_use(&mut u, StreamId(3));
        assert_eq!(u.len(), 2);
    }

    #[test]
    fn a_seal_replaces_the_use_and_a_plain_use_drops_it() {
        let mut u = Vec::new();
        add_use(&mut u, StreamId(3));
        assert_eq!(seal_use(&mut u, StreamId(3), DeviceEvent(7), 1), None);
        assert_eq!(seal_use(&mut u, StreamId(4), DeviceEvent(8), 2), None);
        assert_eq!(u.len(), 2);
        assert_eq!(
            seal_use(&mut u, StreamId(4), DeviceEvent(9), 3),
            Some(DeviceEvent(8))
        );
        assert_eq!(
            sealed_events(&u).collect::<Vec<_>>(),
            vec![DeviceEvent(7), DeviceEvent(9)]
        );
        assert_eq!(unseal_use(&mut u, StreamId(3)), Some(DeviceEvent(7)));
        assert_eq!(unseal_use(&mut u, StreamId(3)), None);
        assert!(!u[0].sealed && u[0].event.is_none());
        assert_eq!(sealed_events(&u).count(), 1);
    }
}
