//! Trace mode: the engine serves online and writes down what it was asked.
//!
//! A [`Recorder`] builds a [`Trace`] as the engine runs: one [`Allocation`] per `malloc`
//! (the caller's unrounded size, the stream, the address handed out) with an `Alloc`
//! event, a `FreeRequested` event when the caller frees, a `FreeCompleted` event when the
//! memory is back in its arena (later than the request when other streams still used
//! it), markers (`mark_iteration`, `mark`) and autograd's saved-tensor events
//! (`SavedPack` / `SavedUnpack`, from `Engine::record_saved`). Blocks live when recording starts become
//! *preexisting* allocations, so the trace is valid on its own ([`Trace::validate`]).
//!
//! Each call is O(1) amortised (a push onto the trace's vectors; labels are interned in
//! a hash map). Time stamps are microseconds since the Unix epoch.
//!
//! A trace holds at most `u32::MAX - 1` events and allocations (its indices are `u32`);
//! past that the recorder stops and reports the overflow when the trace is taken.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::trace::{Allocation, Event, EventKind, MarkerKind, Trace};
use crate::units::{AllocId, Bytes, DeviceId, StreamId};

/// Trace id of a block not in the trace.
pub(crate) const UNTRACED: u32 = u32::MAX;

/// The largest number of events or allocations a trace may hold.
const CAPACITY: usize = (u32::MAX - 1) as usize;

/// Which saved-tensor hook ran ([`crate::engine::Engine::record_saved`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SavedKind {
    /// Autograd's pack hook saved the tensor (forward): a `SavedPack` event.
    Pack,
    /// Backward unpacked it: a `SavedUnpack` event.
    Unpack,
}

/// Builds a trace; see the module documentation.
#[derive(Debug)]
pub(crate) struct Recorder {
    trace: Trace,
    labels: HashMap<String, u32>,
    overflowed: bool,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Recorder {
    pub fn new(device: DeviceId) -> Recorder {
        Recorder {
            trace: Trace {
                device,
                ..Trace::default()
            },
            labels: HashMap::new(),
            overflowed: false,
        }
    }

    fn full(&mut self) -> bool {
        if self.trace.events.len() >= CAPACITY || self.trace.allocations.len() >= CAPACITY {
            self.overflowed = true;
        }
        self.overflowed
    }

    fn event(&mut self, kind: EventKind) {
        if !self.full() {
            self.trace.events.push(Event {
                kind,
                time_us: now_us(),
            });
        }
    }

    fn allocation(&mut self, size: Bytes, stream: StreamId, addr: u64, preexisting: bool) -> u32 {
        if self.full() {
            return UNTRACED;
        }
        let id = self.trace.allocations.len() as u32;
        self.trace.allocations.push(Allocation {
            size,
            stream,
            addr,
            preexisting,
        });
        id
    }

    /// A block live when recording began. Returns its trace id.
    pub fn preexisting(&mut self, size: Bytes, stream: StreamId, addr: u64) -> u32 {
        self.allocation(size, stream, addr, true)
    }

    /// A new allocation. Returns its trace id.
    pub fn alloc(&mut self, size: Bytes, stream: StreamId, addr: u64) -> u32 {
        // Check room for the event before adding the allocation, so an allocation
        // never lacks its `Alloc` event.
        if self.trace.events.len() >= CAPACITY {
            self.overflowed = true;
            return UNTRACED;
        }
        let id = self.allocation(size, stream, addr, false);
        if id != UNTRACED {
            self.event(EventKind::Alloc(AllocId(id)));
        }
        id
    }

    pub fn free_requested(&mut self, id: u32) {
        if id != UNTRACED {
            self.event(EventKind::FreeRequested(AllocId(id)));
        }
    }

    pub fn free_completed(&mut self, id: u32) {
        if id != UNTRACED {
            self.event(EventKind::FreeCompleted(AllocId(id)));
        }
    }

    /// A saved-tensor event of allocation `id` (which the caller knows is live).
    /// False when `id` is not in the trace or the trace is full.
    pub fn saved(&mut self, id: u32, kind: SavedKind) -> bool {
        if id == UNTRACED || self.full() {
            return false;
        }
        self.event(match kind {
            SavedKind::Pack => EventKind::SavedPack(AllocId(id)),
            SavedKind::Unpack => EventKind::SavedUnpack(AllocId(id)),
        });
        true
    }

    pub fn marker(&mut self, kind: MarkerKind, label: Option<&str>) {
        let label = label.map(|l| match self.labels.get(l) {
            Some(&i) => i,
            None => {
                let i = self.trace.labels.len() as u32;
                self.trace.labels.push(l.to_owned());
                self.labels.insert(l.to_owned(), i);
                i
            }
        });
        self.event(EventKind::Marker { kind, label });
    }

    /// The trace, or the number of events it reached if it overflowed.
    pub fn finish(self) -> Result<Trace, usize> {
        if self.overflowed {
            Err(self.trace.events.len())
        } else {
            Ok(self.trace)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_a_valid_trace_with_preexisting_and_labels() {
        let mut r = Recorder::new(DeviceId(1));
        let p = r.preexisting(Bytes(100), StreamId(0), 0x1000);
        let a = r.alloc(Bytes(10), StreamId(7), 0x2000);
        r.marker(MarkerKind::IterationBegin, Some("step"));
        r.free_requested(a);
        r.free_completed(a);
        r.free_completed(p);
        r.marker(MarkerKind::IterationBegin, Some("step"));
        r.free_requested(UNTRACED);
        let t = r.finish().unwrap();
        t.validate().unwrap();
        assert_eq!(t.device, DeviceId(1));
        assert_eq!(t.allocations.len(), 2);
        assert!(t.allocations[0].preexisting);
        assert_eq!(t.allocations[1].stream, StreamId(7));
        assert_eq!(t.events.len(), 6);
        assert_eq!(t.labels, vec!["step".to_owned()]);
    }
}
