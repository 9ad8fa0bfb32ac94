//! [`TraceBuilder`]: hand-made traces for tests.

use crate::{AllocId, Allocation, Bytes, Event, EventKind, MarkerKind, Restore, StreamId, Trace};

/// Builds a [`Trace`] event by event: `alloc(size)` returns the new allocation's id,
/// `free(id)` emits both the free request and its completion, markers intern their
/// labels. Every event is stamped by the builder's clock: time 0 by default
/// ([`TraceBuilder::new`]), or `step_us` after the previous tick
/// ([`TraceBuilder::with_clock`]; [`TraceBuilder::skip`] ticks without an event).
#[derive(Debug, Clone, Default)]
pub struct TraceBuilder {
    /// The trace built so far (tests may edit it directly).
    pub trace: Trace,
    now: u64,
    step_us: u64,
}

impl TraceBuilder {
    /// An empty trace on device 0 whose events are all at time 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty trace whose clock starts at `start_us` and advances `step_us` before
    /// every event (and every [`skip`](Self::skip)).
    pub fn with_clock(start_us: u64, step_us: u64) -> Self {
        TraceBuilder {
            trace: Trace::default(),
            now: start_us,
            step_us,
        }
    }

    /// Appends `kind` at the next tick of the clock.
    pub fn ev(&mut self, kind: EventKind) {
        self.now += self.step_us;
        self.trace.events.push(Event {
            kind,
            time_us: self.now,
        });
    }

    /// Advances the clock one tick without an event.
    pub fn skip(&mut self) {
        self.now += self.step_us;
    }

    fn push_allocation(&mut self, size: u64, stream: u64, preexisting: bool) -> AllocId {
        let id = AllocId(self.trace.allocations.len() as u32);
        self.trace.allocations.push(Allocation {
            size: Bytes(size),
            stream: StreamId(stream),
            addr: 0,
            preexisting,
        });
        id
    }

    /// An allocation of `size` bytes on stream 0, and its `Alloc` event.
    pub fn alloc(&mut self, size: u64) -> AllocId {
        self.alloc_on(size, 0)
    }

    /// An allocation of `size` bytes on `stream`, and its `Alloc` event.
    pub fn alloc_on(&mut self, size: u64, stream: u64) -> AllocId {
        let id = self.push_allocation(size, stream, false);
        self.ev(EventKind::Alloc(id));
        id
    }

    /// An allocation live before the trace starts (no `Alloc` event), on stream 0.
    pub fn preexisting(&mut self, size: u64) -> AllocId {
        self.push_allocation(size, 0, true)
    }

    /// The free request of `id` and its completion.
    pub fn free(&mut self, id: AllocId) {
        self.free_requested(id);
        self.free_completed(id);
    }

    /// Only the free request of `id` (the completion comes later, or never).
    pub fn free_requested(&mut self, id: AllocId) {
        self.ev(EventKind::FreeRequested(id));
    }

    /// Only the completion of `id`'s free.
    pub fn free_completed(&mut self, id: AllocId) {
        self.ev(EventKind::FreeCompleted(id));
    }

    /// The index of `label` in the trace's labels, added if new.
    pub fn label(&mut self, label: &str) -> u32 {
        let labels = &mut self.trace.labels;
        let i = match labels.iter().position(|l| l == label) {
            Some(i) => i,
            None => {
                labels.push(label.to_owned());
                labels.len() - 1
            }
        };
        i as u32
    }

    /// A marker of `kind` labelled `label`.
    pub fn marker(&mut self, kind: MarkerKind, label: &str) {
        let label = Some(self.label(label));
        self.ev(EventKind::Marker { kind, label });
    }

    /// A marker of `kind` without a label.
    pub fn marker_unlabelled(&mut self, kind: MarkerKind) {
        self.ev(EventKind::Marker { kind, label: None });
    }

    /// An unlabelled `IterationBegin` marker.
    pub fn iteration_begin(&mut self) {
        self.marker_unlabelled(MarkerKind::IterationBegin);
    }

    /// Autograd saved `id` (a `SavedPack` event).
    pub fn saved_pack(&mut self, id: AllocId) {
        self.ev(EventKind::SavedPack(id));
    }

    /// Backward unpacked `id` (a `SavedUnpack` event).
    pub fn saved_unpack(&mut self, id: AllocId) {
        self.ev(EventKind::SavedUnpack(id));
    }

    /// A restore link: `into` is the copy back of the offloaded `from`.
    pub fn restore(&mut self, from: AllocId, into: AllocId) {
        self.trace.restores.push(Restore { from, into });
    }

    /// One "iteration": activations of `sizes`, freed in reverse.
    pub fn activations(&mut self, sizes: &[u64]) {
        let ids: Vec<AllocId> = sizes.iter().map(|&s| self.alloc(s)).collect();
        for id in ids.into_iter().rev() {
            self.free(id);
        }
    }

    /// The trace, checked by [`Trace::validate`] (panics on a malformed test trace).
    pub fn done(self) -> Trace {
        self.trace.validate().expect("valid test trace");
        self.trace
    }

    /// The trace as built, unchecked (for tests of malformed traces).
    pub fn build(self) -> Trace {
        self.trace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_what_it_says() {
        let mut b = TraceBuilder::with_clock(100, 10);
        let p = b.preexisting(64);
        let a = b.alloc_on(512, 2);
        b.marker(MarkerKind::PhaseBegin, "x");
        b.skip();
        b.marker(MarkerKind::PhaseEnd, "x");
        b.free(a);
        b.free(p);
        let t = b.done();
        assert_eq!(t.labels, vec!["x".to_owned()]);
        assert!(t.allocations[0].preexisting);
        assert_eq!(t.allocations[1].stream, StreamId(2));
        let times: Vec<u64> = t.events.iter().map(|e| e.time_us).collect();
        assert_eq!(times, vec![110, 120, 140, 150, 160, 170, 180]);
        assert_eq!(TraceBuilder::new().build(), Trace::default());
    }
}
