//! Frees: [`Engine::free`] gives a block back to its arena at once (pointer-map
//! remove, coalesce, treap insert: expected O(log n), no device call), or, when other
//! streams used it ([`Engine::record_stream`]), records an event on each and completes
//! the free once they have all passed them ([`Engine::process_events`], run by
//! `malloc` whenever frees are pending). The protocol and its costs: module `streams`.

use std::sync::MutexGuard;

use crate::units::StreamId;

use super::arena::Idx;
use super::stream_use::{add_use, seal_use, unseal_use};
use super::streams::PendingEvent;
use super::{BlockState, DeviceMemory, DevicePtr, Engine, EngineError, State, stats};

/// Streams with an event still running that one processing remembers (module
/// `streams`, step 2).
const RUNNING_STREAMS: usize = 8;

/// The error for a free or `record_stream` of a live block that is not `Allocated`.
#[cold]
pub(super) fn not_allocated(ptr: DevicePtr, state: BlockState, tag: u32) -> EngineError {
    match state {
        BlockState::Paused => EngineError::Paused { ptr, tag },
        _ => EngineError::AlreadyFreed(ptr),
    }
}

/// The `Allocated` block at `ptr` (`record_stream`'s target), or the error for it.
fn allocated_at(st: &State, ptr: DevicePtr) -> Result<Idx, EngineError> {
    let Some(i) = st.live.get(ptr.get()) else {
        return Err(EngineError::UnknownPointer(ptr));
    };
    let b = st.arenas.block(i);
    if b.state != BlockState::Allocated {
        return Err(not_allocated(ptr, b.state, b.tag));
    }
    Ok(i)
}

impl State {
    /// Completes the free of pending or allocated block `i`: it leaves `live`, goes
    /// back to its arena, and stops counting as active.
    pub(super) fn complete_free(&mut self, i: Idx) {
        let addr = self.arenas.block(i).addr;
        self.live.remove(addr);
        self.release_block(i);
    }

    /// [`State::complete_free`] for a block already taken out of `live`.
    fn release_block(&mut self, i: Idx) {
        let kind = self.kind_of(i);
        let b = self.arenas.block(i);
        let (size, requested, trace_id) = (b.size, b.requested, b.trace_id);
        stats::decrease(&mut self.stats.active, kind, 1);
        stats::decrease(&mut self.stats.active_bytes, kind, size);
        stats::decrease(&mut self.stats.requested_bytes, kind, requested);
        if let Some(r) = self.recorder.as_mut() {
            r.free_completed(trace_id);
        }
        self.arenas.free(i);
    }

    /// Applies events taken out of the queue: done ones complete their blocks' frees,
    /// the rest are queued again.
    pub(super) fn apply_events(&mut self, work: Vec<PendingEvent>) {
        for e in &work {
            if e.done {
                self.events.idle.push(e.event);
                let b = self.arenas.block_mut(e.block);
                b.events_left -= 1;
                if b.events_left == 0 {
                    self.complete_free(e.block);
                }
            } else {
                self.events.push(e.event, e.block, e.stream, e.seq);
            }
        }
        self.events.give_back(work);
        self.settle_inactive();
    }
}

impl<D: DeviceMemory> Engine<D> {
    /// Frees the allocation at `ptr`. If other streams used it ([`Engine::record_stream`])
    /// the memory is reused only after they pass the events recorded now.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        // One hash probe: the entry is taken out at once when nothing defers the free.
        let i = {
            let s = &mut *st;
            let Some(slot) = s.live.find(ptr.get()) else {
                return Err(EngineError::UnknownPointer(ptr));
            };
            let i = s.live.block_at(slot);
            let b = s.arenas.block(i);
            if b.state != BlockState::Allocated {
                return Err(not_allocated(ptr, b.state, b.tag));
            }
            if b.uses.is_empty() {
                s.live.remove_slot(slot);
            }
            i
        };
        let kind = st.kind_of(i);
        let (size, trace_id) = (st.arenas.block(i).size, st.arenas.block(i).trace_id);
        if st.drain > 0
            && st
                .plan
                .as_ref()
                .is_some_and(|p| p.arena != st.arenas.block(i).arena)
        {
            st.drain_pending = true;
        }
        stats::decrease(&mut st.stats.allocation, kind, 1);
        stats::decrease(&mut st.stats.allocated_bytes, kind, size);
        if let Some(r) = st.recorder.as_mut() {
            r.free_requested(trace_id);
        }
        if st.arenas.block(i).uses.is_empty() {
            st.release_block(i);
            st.settle_inactive();
            return Ok(());
        }
        // Deferred. Phase 1 (locked): take the uses out, give them idle events.
        let mut uses = {
            let s = &mut *st;
            let b = s.arenas.block_mut(i);
            b.state = BlockState::PendingFree;
            let mut uses = std::mem::take(&mut b.uses);
            b.events_left = uses.len() as u32;
            for u in uses.iter_mut().filter(|u| !u.sealed) {
                u.event = s.events.idle.pop();
                u.seq = s.events.stamp();
            }
            uses
        };
        drop(st);
        // Phase 2 (unlocked): create missing events, record each on its stream (a sealed
        // use's event was recorded when it was sealed).
        let mut first_err = None;
        for u in uses.iter_mut().filter(|u| !u.sealed) {
            if u.event.is_none() {
                match self.dev.create_event() {
                    Ok(e) => u.event = Some(e),
                    Err(e) => {
                        first_err.get_or_insert(e);
                        continue;
                    }
                }
            }
            if let Some(ev) = u.event {
                match self.dev.record_event(ev, u.stream) {
                    Ok(()) => u.recorded = true,
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        // Phase 3 (locked): queue the recorded events.
        let mut st = self.lock()?;
        for u in uses.iter_mut() {
            match (u.event.take(), u.recorded) {
                (Some(ev), true) => st.events.push(ev, i, u.stream, u.seq),
                (Some(ev), false) => st.events.idle.push(ev),
                (None, _) => {}
            }
            u.recorded = false;
            u.sealed = false;
        }
        uses.clear();
        st.arenas.block_mut(i).uses = uses;
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Marks the allocation at `ptr` as used on `stream` too (`Tensor.record_stream`):
    /// its free will wait for `stream` to pass the point of the free. A no-op for the
    /// allocation's own stream.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        let i = allocated_at(&st, ptr)?;
        if st.stream_of(i) != stream {
            let uses = &mut st.arenas.block_mut(i).uses;
            if let Some(ev) = unseal_use(uses, stream) {
                st.events.idle.push(ev);
            }
            add_use(&mut st.arenas.block_mut(i).uses, stream);
        }
        Ok(())
    }

    /// [`Engine::record_stream`] for a use whose work on `stream` is **all enqueued
    /// already** (offload's copy of the block on its copy stream): an event is recorded on
    /// `stream` now and the free waits for it alone, not for the work `stream` runs up to
    /// the free. (A copy stream runs behind the host: by a tensor's free, the copies of
    /// later tensors are queued on it too, and a planned reuse of the range waited for all
    /// of them; on the H100 GPT-2 XL's forward stalled 7 ms at once behind five 105 MB
    /// copies, BENCHMARKS.md session 18.) A later `record_stream` of the same stream
    /// drops the seal. A no-op for the block's own stream; if the event cannot be
    /// recorded, a plain use.
    pub fn record_stream_enqueued(
        &self,
        ptr: DevicePtr,
        stream: StreamId,
    ) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        let i = allocated_at(&st, ptr)?;
        if st.stream_of(i) == stream {
            return Ok(());
        }
        let idle = st.events.idle.pop();
        let seq = st.events.stamp();
        drop(st);
        // Unlocked: the device calls. The block stays allocated meanwhile (the caller
        // holds it: it has just enqueued work on it).
        let (mut recorded, mut spare) = (None, None);
        // An event that cannot be created or recorded leaves a plain use (below).
        if let Ok(ev) = idle.map_or_else(|| self.dev.create_event(), Ok) {
            match self.dev.record_event(ev, stream) {
                Ok(()) => recorded = Some(ev),
                Err(_) => spare = Some(ev),
            }
        }
        let mut st = self.lock()?;
        st.events.idle.extend(spare);
        let Some(i) = st.live.get(ptr.get()) else {
            st.events.idle.extend(recorded);
            return Err(EngineError::UnknownPointer(ptr));
        };
        match recorded {
            Some(ev) => {
                if let Some(old) = seal_use(&mut st.arenas.block_mut(i).uses, stream, ev, seq) {
                    st.events.idle.push(old);
                }
            }
            None => add_use(&mut st.arenas.block_mut(i).uses, stream),
        }
        Ok(())
    }

    /// Completes the pending frees whose events have all completed (`malloc` does this
    /// first whenever frees are pending).
    pub fn process_events(&self) -> Result<(), EngineError> {
        let st = self.lock()?;
        if !st.events.is_empty() {
            drop(self.process_events_locked(st)?);
        }
        Ok(())
    }

    pub(super) fn process_events_locked<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
    ) -> Result<MutexGuard<'a, State>, EngineError> {
        let mut work = st.events.take();
        drop(st);
        let mut first_err = None;
        // Streams with an event still running: their later events are not queried
        // (module `streams`, step 2). A handful of streams: a linear scan over an array
        // on the stack (this runs in `malloc`: no heap allocation); past
        // `RUNNING_STREAMS` streams the rest are queried event by event, only slower.
        let mut running = [StreamId(0); RUNNING_STREAMS];
        let mut n_running = 0;
        for e in work.iter_mut() {
            if running[..n_running].contains(&e.stream) {
                e.done = false;
                continue;
            }
            e.done = match self.dev.query_event(e.event) {
                Ok(done) => done,
                Err(err) => {
                    first_err.get_or_insert(err);
                    false
                }
            };
            if !e.done && n_running < RUNNING_STREAMS {
                running[n_running] = e.stream;
                n_running += 1;
            }
        }
        let mut st = self.lock()?;
        st.apply_events(work);
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(st),
        }
    }
}
