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
//! Restore links (`Engine::record_restore`, [`crate::Restore`]): the offloader allocates
//! the copy back of an offloaded tensor and names the allocation it was packed from.
//! The recorder keeps, per allocation, its `Alloc` event, its first pack and whether it
//! was linked, and records a link only when the trace will validate with it (`from`
//! packed before `into` was allocated, `into` not preexisting, neither in a link yet);
//! otherwise it records nothing and says so. `from` may still be live: the program
//! held the offloaded tensor when its copy back was made, and its later free says when
//! it let go (what the offload planner needs to know).
//!
//! Each call is O(1) amortised (a push onto the trace's vectors; labels are interned in
//! a hash map). Time stamps are microseconds since the Unix epoch.
//!
//! A trace holds at most `u32::MAX - 1` events and allocations (its indices are `u32`);
//! past that the recorder stops and reports the overflow when the trace is taken.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::trace::{Allocation, Event, EventKind, MarkerKind, Restore, Trace};
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

/// An event index not recorded (yet).
const NONE: u32 = u32::MAX;

/// What the recorder remembers of one allocation, for [`Recorder::restore`].
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// Its `Alloc` event (`NONE`: preexisting).
    alloc_at: u32,
    /// Its first `SavedPack` event (`NONE`: not packed).
    packed_at: u32,
    linked: bool,
}

/// Builds a trace; see the module documentation.
#[derive(Debug)]
pub(crate) struct Recorder {
    trace: Trace,
    labels: HashMap<String, u32>,
    /// Per allocation (indexed by trace id).
    seen: Vec<Seen>,
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
            seen: Vec::new(),
            overflowed: false,
        }
    }

    fn full(&mut self) -> bool {
        if self.trace.events.len() >= CAPACITY || self.trace.allocations.len() >= CAPACITY {
            self.overflowed = true;
        }
        self.overflowed
    }

    /// Records an event; its index, or `NONE` when the trace is full.
    fn event(&mut self, kind: EventKind) -> u32 {
        if self.full() {
            return NONE;
        }
        self.trace.events.push(Event {
            kind,
            time_us: now_us(),
        });
        (self.trace.events.len() - 1) as u32
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
        self.seen.push(Seen {
            alloc_at: NONE,
            packed_at: NONE,
            linked: false,
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
            let at = self.event(EventKind::Alloc(AllocId(id)));
            self.seen[id as usize].alloc_at = at;
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
    /// The allocation's id, or `None` when `id` is not in the trace or the trace is
    /// full.
    pub fn saved(&mut self, id: u32, kind: SavedKind) -> Option<AllocId> {
        if id == UNTRACED || self.full() {
            return None;
        }
        let at = self.event(match kind {
            SavedKind::Pack => EventKind::SavedPack(AllocId(id)),
            SavedKind::Unpack => EventKind::SavedUnpack(AllocId(id)),
        });
        let seen = &mut self.seen[id as usize];
        if kind == SavedKind::Pack && seen.packed_at == NONE {
            seen.packed_at = at;
        }
        Some(AllocId(id))
    }

    /// A restore link: allocation `into` (live, which the caller knows) is the copy
    /// back of `from`. Recorded only when the trace stays valid with it (module docs);
    /// returns whether it was.
    pub fn restore(&mut self, into: u32, from: AllocId) -> bool {
        if into == UNTRACED || self.overflowed || from.0 == into {
            return false;
        }
        let (Some(&f), Some(&t)) = (self.seen.get(from.index()), self.seen.get(into as usize))
        else {
            return false;
        };
        // `from` may still be live: the program held the offloaded tensor when its copy
        // back was made (offloading it freed nothing until the program let go of it).
        let ok = f.packed_at != NONE
            && !f.linked
            && !t.linked
            && t.alloc_at != NONE
            && f.packed_at < t.alloc_at;
        if ok {
            self.seen[from.index()].linked = true;
            self.seen[into as usize].linked = true;
            self.trace.restores.push(Restore {
                from,
                into: AllocId(into),
            });
        }
        ok
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

    #[test]
    fn records_only_restore_links_that_validate() {
        let mut r = Recorder::new(DeviceId(0));
        let pre = r.preexisting(Bytes(64), StreamId(0), 0x100);
        let a = r.alloc(Bytes(64), StreamId(0), 0x200);
        let kept = r.alloc(Bytes(64), StreamId(0), 0x300);
        assert_eq!(r.saved(a, SavedKind::Pack), Some(AllocId(a)));
        assert_eq!(r.saved(kept, SavedKind::Pack), Some(AllocId(kept)));
        let early = r.alloc(Bytes(64), StreamId(0), 0x400);
        // kept is still live (the program holds it): a link all the same, whose release
        // is its later free.
        assert!(r.restore(early, AllocId(kept)), "kept, packed, still live");
        r.free_requested(a);
        let b = r.alloc(Bytes(64), StreamId(0), 0x500);
        assert!(!r.restore(b, AllocId(kept)), "kept is linked already");
        assert!(!r.restore(b, AllocId(early)), "early was never packed");
        let late = r.alloc(Bytes(64), StreamId(0), 0x600);
        let x = r.alloc(Bytes(64), StreamId(0), 0x700);
        r.saved(late, SavedKind::Pack);
        assert!(
            !r.restore(x, AllocId(late)),
            "late was packed after x was allocated"
        );
        assert!(!r.restore(b, AllocId(99)), "no such allocation");
        assert!(!r.restore(UNTRACED, AllocId(a)));
        assert!(!r.restore(pre, AllocId(a)), "a preexisting copy back");
        assert!(r.restore(b, AllocId(a)));
        assert!(!r.restore(b, AllocId(a)), "linked once");
        r.free_completed(a);
        assert_eq!(r.saved(b, SavedKind::Unpack), Some(AllocId(b)));
        assert_eq!(r.saved(UNTRACED, SavedKind::Unpack), None);
        let t = r.finish().unwrap();
        t.validate().unwrap();
        assert_eq!(
            t.restores,
            vec![
                Restore {
                    from: AllocId(kept),
                    into: AllocId(early)
                },
                Restore {
                    from: AllocId(a),
                    into: AllocId(b)
                }
            ]
        );
    }
}
