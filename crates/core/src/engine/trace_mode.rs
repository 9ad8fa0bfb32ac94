//! Trace mode: recording the run into a [`Trace`] ([`Engine::start_trace`]: live blocks
//! become preexisting allocations; [`Engine::take_trace`]), markers ([`Engine::mark`];
//! iteration marks: [`Engine::mark_iteration`]), autograd's saved tensors and the restore
//! links of offloaded ones ([`Engine::record_saved`], [`Engine::record_restore`]). O(1)
//! per call besides the sort of the live blocks at the start; the recording itself:
//! module `record`.

use crate::trace::{MarkerKind, Trace};
use crate::units::{AllocId, Bytes};

use super::arena::Idx;
use super::record::{Recorder, SavedKind};
use super::{BlockState, DeviceMemory, DevicePtr, Engine, EngineError};

impl<D: DeviceMemory> Engine<D> {
    /// Starts recording a trace (a no-op if one is being recorded). Live blocks become
    /// preexisting allocations of the new trace.
    pub fn start_trace(&self) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        if st.recorder.is_some() {
            return Ok(());
        }
        let mut rec = Recorder::new(self.device);
        let mut live: Vec<Idx> = st.live.values().collect();
        live.sort_by_key(|&i| st.arenas.block(i).addr);
        for i in live {
            let (requested, addr) = (st.arenas.block(i).requested, st.arenas.block(i).addr);
            let stream = st.stream_of(i);
            let id = rec.preexisting(Bytes(requested), stream, addr);
            st.arenas.block_mut(i).trace_id = id;
        }
        st.recorder = Some(rec);
        Ok(())
    }

    /// Whether a trace is being recorded.
    pub fn is_tracing(&self) -> Result<bool, EngineError> {
        Ok(self.lock()?.recorder.is_some())
    }

    /// Stops recording and returns the trace (`None` if none was being recorded).
    pub fn take_trace(&self) -> Result<Option<Trace>, EngineError> {
        let rec = self.lock()?.recorder.take();
        match rec.map(Recorder::finish) {
            None => Ok(None),
            Some(Ok(t)) => Ok(Some(t)),
            Some(Err(n)) => Err(EngineError::TraceOverflow(n)),
        }
    }

    /// Records a `SavedPack` / `SavedUnpack` event for the allocation handed out at
    /// `ptr` (autograd's saved-tensor hooks, whose tensor's storage is that whole
    /// allocation). Returns the allocation's trace id when an event was recorded,
    /// `None` when no trace is being recorded, when no allocation that the caller has
    /// not freed starts at `ptr` (an interior pointer, a freed or unknown block), or
    /// when the allocation is not in the trace (the trace is full). O(1).
    pub fn record_saved(
        &self,
        ptr: DevicePtr,
        kind: SavedKind,
    ) -> Result<Option<AllocId>, EngineError> {
        let mut st = self.lock()?;
        let st = &mut *st;
        let Some(rec) = st.recorder.as_mut() else {
            return Ok(None);
        };
        let Some(i) = st.live.get(ptr.get()) else {
            return Ok(None);
        };
        let b = st.arenas.block(i);
        if b.state != BlockState::Allocated {
            return Ok(None);
        }
        Ok(rec.saved(b.trace_id, kind))
    }

    /// Records a restore link ([`crate::Restore`]): the allocation handed out at
    /// `into_ptr` is the copy back of the offloaded allocation `from` (an id that
    /// [`Engine::record_saved`] returned for its pack in this trace). Returns whether a
    /// link was recorded: `false` when not tracing, when no allocation the caller has
    /// not freed starts at `into_ptr`, or when the link would not validate (`from`
    /// unknown, not packed before `into_ptr`'s allocation, either already
    /// linked, the copy back preexisting or not in the trace). O(1).
    pub fn record_restore(&self, into_ptr: DevicePtr, from: AllocId) -> Result<bool, EngineError> {
        let mut st = self.lock()?;
        let st = &mut *st;
        let Some(rec) = st.recorder.as_mut() else {
            return Ok(false);
        };
        let Some(i) = st.live.get(into_ptr.get()) else {
            return Ok(false);
        };
        let b = st.arenas.block(i);
        if b.state != BlockState::Allocated {
            return Ok(false);
        }
        Ok(rec.restore(b.trace_id, from))
    }

    /// Records a marker in the trace (when tracing); a phase marker also opens or closes
    /// a phase of a served plan (`plan_serving`).
    pub fn mark(&self, kind: MarkerKind, label: Option<&str>) -> Result<(), EngineError> {
        let mut st = self.lock()?;
        if let Some(r) = st.recorder.as_mut() {
            r.marker(kind, label);
        }
        // A served plan keeps its place over a phase (`plan_serving`'s module docs).
        if let Some(p) = st.plan.as_mut() {
            match kind {
                MarkerKind::PhaseBegin => p.begin_phase(),
                MarkerKind::PhaseEnd => p.end_phase(),
                MarkerKind::IterationBegin | MarkerKind::IterationEnd => {}
            }
        }
        Ok(())
    }
}
