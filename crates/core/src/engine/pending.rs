//! Plan mode: a stream waits for the pending frees that alone hold its request's
//! planned range, and the parts of them outside the range become *fences*.
//!
//! **Waiting for pending frees** ([`PlanOptions::wait_for_pending_frees`], on by
//! default). When a stream runs behind the host (a collective stream of DDP or FSDP),
//! the frees it must pass stay pending, and a request planned on their range would be
//! a conflict served elsewhere — under real lag that costs more than online serving.
//! Instead, if only such pending frees hold the planned range (all their events
//! queued), the request's stream is made to wait for their events on the device
//! ([`DeviceMemory::wait_event`]: ordering, no host blocking), the frees complete, and
//! the request takes its planned offset. The parts of those blocks outside the range
//! are kept as engine-owned pending frees (*fences*) with one event recorded on the
//! waiting stream after the waits, so no other stream gets them before that stream
//! (hence every earlier user) has passed that point. A refused wait (CUDA refuses on
//! a stream being captured) leaves everything pending: a conflict, as before. Cost:
//! a scan of the event queue per conflict, one device wait per event, one record per
//! fence. The engine replay checks every reuse of memory freed behind other streams
//! against the fake device's stream order (`FakeEvents::ordered_after`).

use std::sync::MutexGuard;

use crate::units::{Bytes, StreamId};

#[cfg(doc)]
use super::PlanOptions;
use super::arena::{ArenaId, Idx, NIL};
use super::{BlockState, DeviceEvent, DeviceMemory, Engine, EngineError, State, stats};

impl State {
    /// The pending frees that alone keep `[addr, addr + len)` of placement arena `a`
    /// from being one free block: every block meeting the range is `Free` or
    /// `PendingFree` with all its outstanding events in the queue, and at least one is
    /// pending. `None` otherwise (something live, mapping or unmapped there, or an
    /// event another thread has taken out of the queue). O(queued events + blocks in
    /// the range).
    fn pending_cover(&self, a: ArenaId, addr: u64, len: u64) -> Option<Vec<Idx>> {
        let end = addr.checked_add(len)?;
        // Pending blocks meeting the range, with how many of their events are queued.
        let mut found: Vec<(Idx, u32)> = Vec::new();
        for e in self.events.iter() {
            let b = self.arenas.block(e.block);
            if b.arena == a && b.addr < end && addr < b.addr + b.size {
                match found.iter_mut().find(|(i, _)| *i == e.block) {
                    Some(f) => f.1 += 1,
                    None => found.push((e.block, 1)),
                }
            }
        }
        if found.is_empty() {
            return None;
        }
        let all_queued = |&(i, n): &(Idx, u32)| {
            let b = self.arenas.block(i);
            b.state == BlockState::PendingFree && b.events_left == n
        };
        if !found.iter().all(all_queued) {
            return None;
        }
        let blocks: Vec<Idx> = found.into_iter().map(|f| f.0).collect();
        self.held_only_by(a, addr, end, &blocks).then_some(blocks)
    }

    /// Whether every block of placement arena `a` meeting `[addr, end)` is `Free` or one
    /// of the `PendingFree` blocks `pending`. O(log n + blocks in the range).
    fn held_only_by(&self, a: ArenaId, addr: u64, end: u64, pending: &[Idx]) -> bool {
        let ours =
            |i: Idx| pending.contains(&i) && self.arenas.block(i).state == BlockState::PendingFree;
        let contains = |i: Idx| {
            let b = self.arenas.block(i);
            b.addr <= addr && addr < b.addr + b.size
        };
        let first = pending
            .iter()
            .copied()
            .find(|&i| contains(i))
            .or_else(|| self.arenas.free_block_containing(a, addr));
        let Some(mut i) = first else {
            return false;
        };
        loop {
            let b = self.arenas.block(i);
            if !(b.state == BlockState::Free || ours(i)) {
                return false;
            }
            if b.addr + b.size >= end {
                return true;
            }
            i = b.next;
            if i == NIL {
                return false;
            }
        }
    }

    /// Makes block `f`, just cut out of free memory, an engine-owned pending free
    /// waiting for `event` (a fence: [`Engine::wait_for_pending`]). It counts as
    /// active until the event completes, as the pending free it was part of did, and
    /// sits in the pointer map (no caller knows its address; a free of it would be
    /// refused as already freed).
    fn fence(&mut self, f: Idx, event: DeviceEvent, stream: StreamId) {
        let kind = self.kind_of(f);
        let b = self.arenas.block_mut(f);
        b.state = BlockState::PendingFree;
        b.events_left = 1;
        let (addr, size) = (b.addr, b.size);
        self.live.insert(addr, f);
        stats::increase(&mut self.stats.active, kind, 1);
        stats::increase(&mut self.stats.active_bytes, kind, size);
        stats::increase(&mut self.stats.requested_bytes, kind, size);
        let seq = self.events.stamp();
        self.events.push(event, f, stream, seq);
        self.settle_inactive();
    }
}

impl<D: DeviceMemory> Engine<D> {
    /// Plan mode, a planned range `[addr, addr + rounded)` of the pool found occupied:
    /// if only frees waiting for other streams' events hold it
    /// ([`State::pending_cover`]), `stream` is made to wait for those events (no host
    /// blocking), their frees complete, and the request is placed there. Returns the
    /// placed block, or `None` (a conflict: something else holds the range, or a device
    /// call was refused; the frees then stay pending and complete as usual).
    ///
    /// Why this is safe: each event was recorded, at the free, on a stream that used
    /// the block, after all the work that stream had queued on it; work queued on
    /// `stream` after the wait runs after that work, and the new block is first used by
    /// work queued after this `malloc` returns. Only `stream` is ordered so: the parts
    /// of the pending blocks outside the range (at most one before it and one after)
    /// are **fenced** — kept as engine-owned pending frees whose one event is recorded
    /// on `stream` after the waits, so that no other stream gets them before `stream`
    /// (hence every earlier user) has passed that point. The blocks' events are taken
    /// out of the queue while locked, so no other thread completes or reuses those
    /// blocks meanwhile (they stay `PendingFree`), and the range is checked again once
    /// re-locked. Device calls: one wait per event, one record per fence (events from
    /// the idle pool, created if it runs out).
    pub(super) fn wait_for_pending<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        addr: u64,
        rounded: u64,
        size: Bytes,
        stream: StreamId,
    ) -> Result<(Option<Idx>, MutexGuard<'a, State>), EngineError> {
        let Some(arena) = st.plan.as_ref().map(|p| p.arena) else {
            return Ok((None, st));
        };
        let Some(blocks) = st.pending_cover(arena, addr, rounded) else {
            return Ok((None, st));
        };
        let end = addr + rounded;
        let lo = blocks
            .iter()
            .map(|&i| st.arenas.block(i).addr)
            .min()
            .unwrap_or(addr);
        let hi = blocks
            .iter()
            .map(|&i| st.arenas.block(i).addr + st.arenas.block(i).size)
            .max()
            .unwrap_or(end);
        // The parts of the pending blocks outside the range: (start, len).
        let fences: Vec<(u64, u64)> =
            [(lo, addr.saturating_sub(lo)), (end, hi.saturating_sub(end))]
                .into_iter()
                .filter(|&(_, len)| len > 0)
                .collect();
        let mut fence_events: Vec<DeviceEvent> = Vec::with_capacity(fences.len());
        while fence_events.len() < fences.len() {
            let Some(ev) = st.events.idle.pop() else {
                break;
            };
            fence_events.push(ev);
        }
        let mut work = st.events.take_for(&blocks);
        drop(st);
        // Unlocked: the waits, then the fences' events (recorded after the waits).
        let mut ok = true;
        for e in work.iter_mut() {
            ok &= self.dev.wait_event(stream, e.event).is_ok();
        }
        while ok && fence_events.len() < fences.len() {
            match self.dev.create_event() {
                Ok(ev) => fence_events.push(ev),
                Err(_) => ok = false,
            }
        }
        for &ev in &fence_events {
            ok = ok && self.dev.record_event(ev, stream).is_ok();
        }
        let mut st = self.lock()?;
        // Re-locked: another thread may have taken free memory of the range meanwhile.
        if !ok || !st.held_only_by(arena, addr, end, &blocks) {
            // The frees stay pending (their events go back to the queue, queried as
            // usual); the fence events were not needed.
            st.events.idle.extend(fence_events);
            st.apply_events(work);
            return Ok((None, st));
        }
        for e in work.iter_mut() {
            e.done = true;
        }
        st.apply_events(work);
        // [lo, hi) is now one free run: the block, then the fences beside it. (The two
        // errors below cannot happen — the lock was held since the check — and would leave
        // the range unfenced; they stop the request rather than hide a broken invariant.)
        let Some(placed) = st.arenas.alloc_at(arena, addr, rounded, size.get())? else {
            return Err(EngineError::Inconsistent(format!(
                "the pool range {addr:#x} + {rounded} was not free after its pending frees completed"
            )));
        };
        for (&(at, len), &ev) in fences.iter().zip(&fence_events) {
            let Some(f) = st.arenas.alloc_at(arena, at, len, len)? else {
                return Err(EngineError::Inconsistent(format!(
                    "the fence {at:#x} + {len} was not free after its pending free completed"
                )));
            };
            st.fence(f, ev, stream);
        }
        if let Some(p) = st.plan.as_mut() {
            p.cursor.stats.waits += 1;
        }
        Ok((Some(placed), st))
    }
}
