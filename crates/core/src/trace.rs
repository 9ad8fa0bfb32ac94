//! The trace: what a training run asked of the allocator, in order.
//!
//! A [`Trace`] is one device's ordered list of [`Event`]s over a table of
//! [`Allocation`]s. The event index ([`EventIdx`]) is the trace's clock: an allocation
//! is live over the half-open interval `[alloc event, free event)`. Allocations that
//! already existed when recording began are `preexisting` (live from before event 0,
//! they have no `Alloc` event); allocations never freed stay live to the end.
//!
//! Two free events exist because PyTorch has two: `FreeRequested` (the tensor died)
//! and `FreeCompleted` (the memory went back to the pool, possibly later, once other
//! streams using it passed their recorded events). Lifetimes end at `FreeCompleted`
//! when present, else at `FreeRequested`.
//!
//! Two more events are markers that allocate nothing: `SavedPack` (autograd's pack hook
//! saved, in forward, a tensor whose storage is a whole live allocation) and
//! `SavedUnpack` (backward unpacked it). They say when a saved activation is needed
//! again, which is what planned offload to host memory works from
//! (`stweaver_planner::offload`).
//!
//! A run recorded with activation offload also carries **restore links**
//! ([`Trace::restores`]): a [`Restore`] says that allocation `into` is the copy back
//! (from pinned host memory, made in backward) of the offloaded allocation `from`,
//! which was packed before it; `from` is freed when the program let go of it, which
//! may come after its copy back is made (the program still held the tensor: offloading
//! it freed nothing until then). The links change nothing about the
//! recorded run itself; they let the planner rewrite it into the run without offload
//! (`stweaver_planner::unoffload`) and choose again what to offload.
//!
//! [`Trace::validate`] checks the structural rules once (O(events + allocations));
//! everything downstream may then rely on them.

use crate::units::{AllocId, Bytes, DeviceId, EventIdx, StreamId};

/// One allocation request of the recorded run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Requested bytes (what the caller asked for, not rounded).
    pub size: Bytes,
    /// The stream the allocation was made on.
    pub stream: StreamId,
    /// Address the recorded run handed out (0 when unknown). Informational: used to
    /// check replays against the recording, never to place anything.
    pub addr: u64,
    /// Live before recording began (no `Alloc` event in the trace).
    pub preexisting: bool,
}

/// What a marker says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MarkerKind {
    IterationBegin,
    IterationEnd,
    PhaseBegin,
    PhaseEnd,
}

/// One thing that happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Alloc(AllocId),
    FreeRequested(AllocId),
    FreeCompleted(AllocId),
    /// An annotation; `label` indexes [`Trace::labels`].
    Marker {
        kind: MarkerKind,
        label: Option<u32>,
    },
    /// Autograd's pack hook saved a tensor whose storage is this whole allocation (in
    /// forward). Allocates nothing; the allocation is live here.
    SavedPack(AllocId),
    /// Backward unpacked a tensor saved by a `SavedPack` of this allocation. Allocates
    /// nothing; the allocation is live here.
    SavedUnpack(AllocId),
}

impl EventKind {
    /// The allocation the event is about (`None` for a marker).
    #[inline]
    pub fn alloc(self) -> Option<AllocId> {
        match self {
            EventKind::Alloc(id)
            | EventKind::FreeRequested(id)
            | EventKind::FreeCompleted(id)
            | EventKind::SavedPack(id)
            | EventKind::SavedUnpack(id) => Some(id),
            EventKind::Marker { .. } => None,
        }
    }

    /// The same event about allocation `f(id)` (a marker unchanged): for traces whose
    /// allocations are renumbered.
    #[inline]
    pub fn map_alloc(self, f: impl FnOnce(AllocId) -> AllocId) -> EventKind {
        match self {
            EventKind::Alloc(id) => EventKind::Alloc(f(id)),
            EventKind::FreeRequested(id) => EventKind::FreeRequested(f(id)),
            EventKind::FreeCompleted(id) => EventKind::FreeCompleted(f(id)),
            EventKind::SavedPack(id) => EventKind::SavedPack(f(id)),
            EventKind::SavedUnpack(id) => EventKind::SavedUnpack(f(id)),
            m @ EventKind::Marker { .. } => m,
        }
    }

    /// True for the events that are requests to the allocator (`Alloc`,
    /// `FreeRequested`, `FreeCompleted`): the ticks of the planner's plan clock. Markers
    /// and saved-tensor events are not.
    #[inline]
    pub fn is_request(self) -> bool {
        matches!(
            self,
            EventKind::Alloc(_) | EventKind::FreeRequested(_) | EventKind::FreeCompleted(_)
        )
    }
}

/// A restore link: allocation `into` is the copy back of the offloaded allocation
/// `from` (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Restore {
    pub from: AllocId,
    pub into: AllocId,
}

/// An event and when it happened (µs since the Unix epoch, 0 when unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    pub time_us: u64,
}

/// One device's allocation history.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    pub device: DeviceId,
    pub allocations: Vec<Allocation>,
    pub events: Vec<Event>,
    /// Marker labels (e.g. `Optimizer.step#AdamW.step`).
    pub labels: Vec<String>,
    /// Restore links of a run recorded with offload (empty otherwise), in recording
    /// order.
    pub restores: Vec<Restore>,
}

/// The live interval of one allocation, in event indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetime {
    /// Event index of the `Alloc` event, `None` for a preexisting allocation.
    pub start: Option<EventIdx>,
    /// Event index of the free that ends the lifetime, `None` if never freed.
    pub end: Option<EventIdx>,
}

/// The lower bound of any plan: the peak of live requested bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LowerBound {
    pub bytes: Bytes,
    /// The first event index at which the peak is reached (the `Alloc` that reaches it;
    /// `None` if the peak is made of preexisting allocations only).
    pub at: Option<EventIdx>,
}

/// A structural problem in a trace.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    #[error("the trace has no events")]
    Empty,
    #[error(
        "event {event} refers to allocation {alloc}, but the trace has only {count} allocations"
    )]
    UnknownAlloc {
        event: EventIdx,
        alloc: AllocId,
        count: usize,
    },
    #[error("allocation {alloc} has size 0")]
    ZeroSize { alloc: AllocId },
    #[error("allocation {alloc} is allocated twice (events {first} and {second})")]
    DoubleAlloc {
        alloc: AllocId,
        first: EventIdx,
        second: EventIdx,
    },
    #[error("allocation {alloc} is preexisting but has an alloc event at {event}")]
    PreexistingAllocated { alloc: AllocId, event: EventIdx },
    #[error("allocation {alloc} is not preexisting and has no alloc event")]
    NeverAllocated { alloc: AllocId },
    #[error("event {event} frees allocation {alloc}, which is not live there")]
    FreeOfDead { alloc: AllocId, event: EventIdx },
    #[error(
        "event {event} is a saved-tensor {what} of allocation {alloc}, which is not live there"
    )]
    SavedOfDead {
        alloc: AllocId,
        event: EventIdx,
        /// `"pack"` or `"unpack"`.
        what: &'static str,
    },
    #[error("event {event} marker label {label} is out of range ({count} labels)")]
    UnknownLabel {
        event: EventIdx,
        label: u32,
        count: usize,
    },
    #[error("the trace has {0} events, more than the 2^32-1 an event index holds")]
    TooManyEvents(usize),
    #[error(
        "restore link {link} ({from} -> {into}) names allocation {alloc}, but the trace has only {count} allocations"
    )]
    RestoreUnknownAlloc {
        link: usize,
        from: AllocId,
        into: AllocId,
        alloc: AllocId,
        count: usize,
    },
    #[error(
        "restore link {link} ({from} -> {into}): allocation {alloc} is already in link {other} (an allocation is in at most one link)"
    )]
    RestoreTwice {
        link: usize,
        from: AllocId,
        into: AllocId,
        alloc: AllocId,
        other: usize,
    },
    #[error(
        "restore link {link} ({from} -> {into}): the copy back {into} is preexisting (it must be allocated in the trace)"
    )]
    RestorePreexisting {
        link: usize,
        from: AllocId,
        into: AllocId,
    },
    #[error(
        "restore link {link} ({from} -> {into}): the offloaded allocation {from} {problem} before the copy back {into} is allocated (event {into_alloc})"
    )]
    RestoreOrder {
        link: usize,
        from: AllocId,
        into: AllocId,
        into_alloc: EventIdx,
        /// `"is not packed"`.
        problem: &'static str,
    },
}

impl Trace {
    /// Checks the structural rules: every event names an existing allocation; every
    /// allocation has a non-zero size, exactly one `Alloc` event unless preexisting
    /// (then none), and at most one `FreeRequested` and one `FreeCompleted`, each after
    /// its `Alloc`, `FreeCompleted` after `FreeRequested`; marker labels exist; a
    /// `SavedPack` / `SavedUnpack` names an allocation that is live (allocated or
    /// preexisting, no free requested yet) at the event. Restore links name existing
    /// allocations, each allocation is in at most one link, `into` is not preexisting,
    /// and `from` is packed before `into`'s `Alloc` (freed anywhere, or never).
    pub fn validate(&self) -> Result<(), TraceError> {
        if self.events.is_empty() {
            return Err(TraceError::Empty);
        }
        if self.events.len() >= u32::MAX as usize {
            return Err(TraceError::TooManyEvents(self.events.len()));
        }
        let count = self.allocations.len();
        for (i, a) in self.allocations.iter().enumerate() {
            if a.size == Bytes::ZERO {
                return Err(TraceError::ZeroSize {
                    alloc: AllocId(i as u32),
                });
            }
        }
        // Per allocation: 0 = not yet allocated, 1 = live, 2 = free requested, 3 = done.
        let mut state: Vec<u8> = self
            .allocations
            .iter()
            .map(|a| if a.preexisting { 1 } else { 0 })
            .collect();
        let mut alloc_at: Vec<Option<EventIdx>> = vec![None; count];
        for (i, e) in self.events.iter().enumerate() {
            let event = EventIdx(i as u32);
            let id = match e.kind {
                EventKind::Alloc(id)
                | EventKind::FreeRequested(id)
                | EventKind::FreeCompleted(id)
                | EventKind::SavedPack(id)
                | EventKind::SavedUnpack(id) => id,
                EventKind::Marker { label, .. } => {
                    if let Some(label) = label
                        && label as usize >= self.labels.len()
                    {
                        return Err(TraceError::UnknownLabel {
                            event,
                            label,
                            count: self.labels.len(),
                        });
                    }
                    continue;
                }
            };
            if id.index() >= count {
                return Err(TraceError::UnknownAlloc {
                    event,
                    alloc: id,
                    count,
                });
            }
            let s = &mut state[id.index()];
            match e.kind {
                EventKind::Alloc(_) => {
                    if self.allocations[id.index()].preexisting {
                        return Err(TraceError::PreexistingAllocated { alloc: id, event });
                    }
                    if let Some(first) = alloc_at[id.index()] {
                        return Err(TraceError::DoubleAlloc {
                            alloc: id,
                            first,
                            second: event,
                        });
                    }
                    alloc_at[id.index()] = Some(event);
                    *s = 1;
                }
                EventKind::FreeRequested(_) => {
                    if *s != 1 {
                        return Err(TraceError::FreeOfDead { alloc: id, event });
                    }
                    *s = 2;
                }
                EventKind::FreeCompleted(_) => {
                    if *s != 1 && *s != 2 {
                        return Err(TraceError::FreeOfDead { alloc: id, event });
                    }
                    *s = 3;
                }
                EventKind::SavedPack(_) | EventKind::SavedUnpack(_) => {
                    if *s != 1 {
                        let what = if matches!(e.kind, EventKind::SavedPack(_)) {
                            "pack"
                        } else {
                            "unpack"
                        };
                        return Err(TraceError::SavedOfDead {
                            alloc: id,
                            event,
                            what,
                        });
                    }
                }
                EventKind::Marker { .. } => unreachable!("markers handled above"),
            }
        }
        for (i, a) in self.allocations.iter().enumerate() {
            if !a.preexisting && alloc_at[i].is_none() {
                return Err(TraceError::NeverAllocated {
                    alloc: AllocId(i as u32),
                });
            }
        }
        if !self.restores.is_empty() {
            self.validate_restores(&alloc_at)?;
        }
        Ok(())
    }

    /// The restore-link rules (see [`Trace::validate`]); `alloc_at` is every
    /// allocation's `Alloc` event. O(events + allocations + links).
    fn validate_restores(&self, alloc_at: &[Option<EventIdx>]) -> Result<(), TraceError> {
        let count = self.allocations.len();
        let mut link_of: Vec<u32> = vec![u32::MAX; count];
        for (link, r) in self.restores.iter().enumerate() {
            let (from, into) = (r.from, r.into);
            for alloc in [from, into] {
                if alloc.index() >= count {
                    return Err(TraceError::RestoreUnknownAlloc {
                        link,
                        from,
                        into,
                        alloc,
                        count,
                    });
                }
                let other = link_of[alloc.index()];
                if other != u32::MAX {
                    return Err(TraceError::RestoreTwice {
                        link,
                        from,
                        into,
                        alloc,
                        other: other as usize,
                    });
                }
                link_of[alloc.index()] = link as u32;
            }
        }
        // The first pack of every `from` (its free may come anywhere: module docs).
        let mut packed: Vec<Option<EventIdx>> = vec![None; count];
        for (i, e) in self.events.iter().enumerate() {
            if let EventKind::SavedPack(id) = e.kind
                && packed[id.index()].is_none()
            {
                packed[id.index()] = Some(EventIdx(i as u32));
            }
        }
        for (link, r) in self.restores.iter().enumerate() {
            let (from, into) = (r.from, r.into);
            let Some(into_alloc) = alloc_at[into.index()] else {
                return Err(TraceError::RestorePreexisting { link, from, into });
            };
            let order = |problem| TraceError::RestoreOrder {
                link,
                from,
                into,
                into_alloc,
                problem,
            };
            if packed[from.index()].is_none_or(|p| p >= into_alloc) {
                return Err(order("is not packed"));
            }
        }
        Ok(())
    }

    /// The lifetime of every allocation, indexed by [`AllocId`]. Assumes a valid trace.
    pub fn lifetimes(&self) -> Vec<Lifetime> {
        let mut out = vec![
            Lifetime {
                start: None,
                end: None
            };
            self.allocations.len()
        ];
        for (i, e) in self.events.iter().enumerate() {
            let at = EventIdx(i as u32);
            match e.kind {
                EventKind::Alloc(id) => out[id.index()].start = Some(at),
                EventKind::FreeRequested(id) => {
                    // Only if no FreeCompleted comes later; overwritten by it otherwise.
                    if out[id.index()].end.is_none() {
                        out[id.index()].end = Some(at);
                    }
                }
                EventKind::FreeCompleted(id) => out[id.index()].end = Some(at),
                EventKind::Marker { .. } | EventKind::SavedPack(_) | EventKind::SavedUnpack(_) => {}
            }
        }
        out
    }

    /// The peak of live requested bytes and where it is first reached. Lifetimes are
    /// half-open and end at the completed free (else the requested one). O(events).
    pub fn lower_bound(&self) -> LowerBound {
        let lifetimes = self.lifetimes();
        let mut ends_here: Vec<u64> = vec![0; self.events.len()];
        let mut live: u64 = 0;
        for (a, l) in self.allocations.iter().zip(&lifetimes) {
            if l.start.is_none() {
                live += a.size.0;
            }
            if let Some(end) = l.end {
                ends_here[end.index()] += a.size.0;
            }
        }
        let mut best = LowerBound {
            bytes: Bytes(live),
            at: None,
        };
        for (i, e) in self.events.iter().enumerate() {
            live -= ends_here[i];
            if let EventKind::Alloc(id) = e.kind {
                live += self.allocations[id.index()].size.0;
                if live > best.bytes.0 {
                    best = LowerBound {
                        bytes: Bytes(live),
                        at: Some(EventIdx(i as u32)),
                    };
                }
            }
        }
        best
    }

    /// Indices of the marker events for which `pred(kind, label text)` holds,
    /// ascending (a label index out of range reads as no label).
    pub fn marker_events(&self, pred: impl Fn(MarkerKind, Option<&str>) -> bool) -> Vec<usize> {
        self.events
            .iter()
            .enumerate()
            .filter_map(|(i, e)| match e.kind {
                EventKind::Marker { kind, label } => {
                    let label = label.and_then(|l| self.labels.get(l as usize));
                    pred(kind, label.map(String::as_str)).then_some(i)
                }
                _ => None,
            })
            .collect()
    }

    /// Number of `Alloc` events.
    pub fn alloc_event_count(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Alloc(_)))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(size: u64) -> Allocation {
        Allocation {
            size: Bytes(size),
            stream: StreamId(0),
            addr: 0,
            preexisting: false,
        }
    }

    fn ev(kind: EventKind) -> Event {
        Event { kind, time_us: 0 }
    }

    #[test]
    fn lower_bound_counts_half_open_lifetimes_and_preexisting() {
        let mut pre = alloc(100);
        pre.preexisting = true;
        let t = Trace {
            device: DeviceId(0),
            allocations: vec![pre, alloc(10), alloc(20), alloc(5)],
            events: vec![
                ev(EventKind::Alloc(AllocId(1))),
                ev(EventKind::FreeRequested(AllocId(1))),
                ev(EventKind::FreeCompleted(AllocId(1))),
                ev(EventKind::Alloc(AllocId(2))), // 120: 1 is gone (half-open)
                ev(EventKind::FreeCompleted(AllocId(0))),
                ev(EventKind::Alloc(AllocId(3))),
            ],
            labels: vec![],
            restores: Vec::new(),
        };
        t.validate().unwrap();
        let lb = t.lower_bound();
        assert_eq!(lb.bytes, Bytes(120));
        assert_eq!(lb.at, Some(EventIdx(3)));
    }

    #[test]
    fn validate_rejects_double_free_and_unknown_ids() {
        let t = Trace {
            device: DeviceId(0),
            allocations: vec![alloc(1)],
            events: vec![
                ev(EventKind::Alloc(AllocId(0))),
                ev(EventKind::FreeCompleted(AllocId(0))),
                ev(EventKind::FreeCompleted(AllocId(0))),
            ],
            labels: vec![],
            restores: Vec::new(),
        };
        assert_eq!(
            t.validate(),
            Err(TraceError::FreeOfDead {
                alloc: AllocId(0),
                event: EventIdx(2)
            })
        );
        let t = Trace {
            device: DeviceId(0),
            allocations: vec![],
            events: vec![ev(EventKind::Alloc(AllocId(3)))],
            labels: vec![],
            restores: Vec::new(),
        };
        assert!(matches!(t.validate(), Err(TraceError::UnknownAlloc { .. })));
        assert_eq!(Trace::default().validate(), Err(TraceError::Empty));
    }

    #[test]
    fn saved_events_need_a_live_allocation_and_allocate_nothing() {
        let base = |kinds: Vec<EventKind>| Trace {
            device: DeviceId(0),
            allocations: vec![alloc(10)],
            events: kinds.into_iter().map(ev).collect(),
            labels: vec![],
            restores: Vec::new(),
        };
        let ok = base(vec![
            EventKind::Alloc(AllocId(0)),
            EventKind::SavedPack(AllocId(0)),
            EventKind::SavedUnpack(AllocId(0)),
            EventKind::FreeRequested(AllocId(0)),
        ]);
        ok.validate().unwrap();
        assert_eq!(ok.lower_bound().bytes, Bytes(10));
        assert_eq!(ok.lifetimes()[0].end, Some(EventIdx(3)));
        assert!(!EventKind::SavedPack(AllocId(0)).is_request());
        assert!(EventKind::FreeCompleted(AllocId(0)).is_request());
        let late = base(vec![
            EventKind::Alloc(AllocId(0)),
            EventKind::FreeRequested(AllocId(0)),
            EventKind::SavedUnpack(AllocId(0)),
        ]);
        assert_eq!(
            late.validate(),
            Err(TraceError::SavedOfDead {
                alloc: AllocId(0),
                event: EventIdx(2),
                what: "unpack"
            })
        );
        let early = base(vec![
            EventKind::SavedPack(AllocId(0)),
            EventKind::Alloc(AllocId(0)),
        ]);
        assert!(matches!(
            early.validate(),
            Err(TraceError::SavedOfDead { what: "pack", .. })
        ));
    }
}
