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
}

/// Adds `stream` to `uses` unless it is already there. O(uses).
pub(crate) fn add_use(uses: &mut Vec<StreamUse>, stream: StreamId) {
    if !uses.iter().any(|u| u.stream == stream) {
        uses.push(StreamUse {
            stream,
            event: None,
            recorded: false,
        });
    }
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
}
