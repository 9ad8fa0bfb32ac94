//! Checkpoints of an engine's live blocks and their restore: what CUDA graph trees
//! (`torch.compile(mode="reduce-overhead")`) need from a graph pool's allocator
//! (PyTorch's `getCheckpointState` / `setCheckpointPoolState`).
//!
//! # Why
//!
//! Replaying a CUDA graph re-creates its output tensors without any allocator call, so
//! after a replay the engine of the graph's pool no longer knows what is live. Before
//! recording a new graph on that path, the trees bring the pool back to the state it
//! had right after recording the parent graph: [`Engine::checkpoint`] records that
//! state, [`Engine::restore`] re-applies it.
//!
//! # What a checkpoint is
//!
//! The `Allocated` blocks of the engine (address, rounded size, requested size,
//! stream), in address order. Pending frees are not in it: they are free as far as the
//! caller is concerned (PyTorch's `allocated` flag). Taking one is O(n log n) in the
//! live blocks and marks the engine as *checkpointed*: from then on `empty_cache` still
//! unmaps free granules but never releases an arena's address range, so every
//! checkpointed address stays inside a reservation of this engine and can be mapped
//! again.
//!
//! # Restore
//!
//! 1. **Check** that every checkpointed block lies inside one arena of this engine,
//!    on its stream (a checkpoint of another engine fails here, changing nothing).
//! 2. **Map** the granules of the checkpointed ranges that are unmapped now (they were
//!    given back by `empty_cache` since): carved out of the arenas
//!    (`Arenas::carve_range`), checked against the memory limit, mapped with the lock
//!    released. Out of memory or a refused map fails here; the engine keeps every live
//!    block (what was mapped stays as free cached memory).
//! 3. **Free** every block allocated now (PyTorch frees them all too and reports them
//!    as `ptrs_freed`). A block other streams used (`record_stream`), or an earlier free
//!    still waiting on events, needs those streams to be done: the engine then
//!    synchronises the device once (lock released) and completes every pending free.
//! 4. **Claim** each checkpointed range at exactly its address (`Arenas::claim`): after
//!    steps 2 and 3 it lies in free mapped memory. Claims go in address order, so each
//!    arena is walked once.
//!
//! Cost: O(live + checkpointed blocks + blocks walked), plus one device map per carved
//! piece and at most one device synchronisation. Not a hot path.
//!
//! Stats stay exact and move as PyTorch's restore moves them: every freed block counts
//! as a free (`allocation`, `allocated_bytes`, `active*`, `requested_bytes` down), every
//! re-created block as an allocation, every map as a map; `inactive_split*` settle after
//! the map, after the frees completed without waiting, after the synchronised ones, and
//! after each claim.
//!
//! The lock is released only around device calls (steps 2 and 3). Another thread that
//! allocates from the same engine in that window can take a checkpointed range; the
//! claim then fails with [`EngineError::CheckpointMismatch`] rather than alias.

use super::arena::{ArenaId, Idx, NIL};
use super::device::{DeviceMemory, DevicePtr};
use super::stats;
use super::stream_use::sealed_events;
use super::{BlockInfo, BlockState, Engine, EngineError, State};
use crate::units::{Bytes, StreamId};

/// One block live when a checkpoint was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CheckpointBlock {
    pub addr: DevicePtr,
    /// Rounded size.
    pub size: Bytes,
    /// The caller's size.
    pub requested: Bytes,
    pub stream: StreamId,
}

/// The allocated blocks of one engine at one moment ([`Engine::checkpoint`]), in address
/// order. Only an engine makes one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    blocks: Vec<CheckpointBlock>,
}

impl Checkpoint {
    /// The blocks, in address order.
    pub fn blocks(&self) -> &[CheckpointBlock] {
        &self.blocks
    }
}

/// What [`Engine::restore`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    /// Every block that was allocated before the restore, as it was, in address order
    /// (all freed; some re-created at the same address).
    pub freed: Vec<BlockInfo>,
    /// The checkpoint's blocks, allocated again, in address order.
    pub created: Vec<BlockInfo>,
}

/// The arena of this engine that holds `b` on its stream.
fn arena_of_block(st: &State, b: &CheckpointBlock) -> Result<ArenaId, EngineError> {
    let (lo, size) = (b.addr.get(), b.size.get());
    let hi = lo.checked_add(size);
    st.arenas
        .arena_ids()
        .find(|&a| {
            st.arenas.arena(a).is_some_and(|x| {
                x.stream == b.stream && x.base <= lo && hi.is_some_and(|hi| hi <= x.base + x.len)
            })
        })
        .ok_or_else(|| {
            EngineError::CheckpointMismatch(format!(
                "no arena of this engine on {} holds {} + {} (a checkpoint of another pool?)",
                b.stream, b.addr, b.size
            ))
        })
}

impl<D: DeviceMemory> Engine<D> {
    /// The allocated blocks now, in address order (see the module documentation). The
    /// engine keeps its arenas' address ranges from now on. O(n log n).
    pub fn checkpoint(&self) -> Result<Checkpoint, EngineError> {
        let mut st = self.lock()?;
        st.keep_arenas = true;
        let mut blocks: Vec<CheckpointBlock> = st
            .live
            .values()
            .filter(|&i| st.arenas.block(i).state == BlockState::Allocated)
            .map(|i| {
                let b = st.arenas.block(i);
                CheckpointBlock {
                    addr: DevicePtr(b.addr),
                    size: Bytes(b.size),
                    requested: Bytes(b.requested),
                    stream: st.stream_of(i),
                }
            })
            .collect();
        blocks.sort_unstable();
        Ok(Checkpoint { blocks })
    }

    /// Brings the engine back to `checkpoint`: every block allocated now is freed, every
    /// checkpointed block is allocated again at its address (module documentation).
    pub fn restore(&self, checkpoint: &Checkpoint) -> Result<Restored, EngineError> {
        let cp = checkpoint.blocks();
        let mut st = self.lock()?;
        // 1. Check.
        for b in cp {
            arena_of_block(&st, b)?;
        }
        // 2. Map what is unmapped.
        let mut pieces: Vec<Idx> = Vec::new();
        for b in cp {
            let a = arena_of_block(&st, b)?;
            match st.arenas.carve_range(a, b.addr.get(), b.size.get()) {
                Ok(carved) => pieces.extend(carved),
                Err(e) => {
                    for &i in &pieces {
                        st.arenas.finish_mapping(i, false);
                    }
                    return Err(e.into());
                }
            }
        }
        if !pieces.is_empty() {
            st = self.map_pieces(st, &pieces, cp[0].stream)?;
        }
        // 3. Free everything allocated.
        let mut allocated: Vec<(u64, Idx)> = st
            .live
            .iter()
            .filter(|&(_, i)| st.arenas.block(i).state == BlockState::Allocated)
            .collect();
        allocated.sort_unstable();
        let mut freed = Vec::with_capacity(allocated.len());
        let mut to_sync = Vec::new();
        for &(_, i) in &allocated {
            freed.push(Self::info(&st, i));
            let kind = st.kind_of(i);
            let (size, trace_id) = (st.arenas.block(i).size, st.arenas.block(i).trace_id);
            stats::decrease(&mut st.stats.allocation, kind, 1);
            stats::decrease(&mut st.stats.allocated_bytes, kind, size);
            if let Some(r) = st.recorder.as_mut() {
                r.free_requested(trace_id);
            }
            if st.arenas.block(i).uses.is_empty() {
                st.complete_free(i);
            } else {
                // Completed below, once the device has passed every stream's work.
                let sealed: Vec<_> = sealed_events(&st.arenas.block(i).uses).collect();
                st.events.idle.extend(sealed);
                let b = st.arenas.block_mut(i);
                b.state = BlockState::PendingFree;
                b.uses.clear();
                to_sync.push(i);
            }
        }
        st.settle_inactive();
        if !to_sync.is_empty() || !st.events.is_empty() {
            st.stats.num_sync_all_streams += 1;
            let mut work = st.events.take();
            drop(st);
            let synced = self.dev.synchronize();
            st = self.lock()?;
            if let Err(e) = synced {
                // The blocks of `to_sync` stay pending for good: never reused, never
                // aliased (as a block whose event could not be recorded).
                work.iter_mut().for_each(|w| w.done = false);
                st.apply_events(work);
                return Err(e.into());
            }
            for i in to_sync {
                st.complete_free(i);
            }
            work.iter_mut().for_each(|w| w.done = true);
            st.apply_events(work);
        }
        // 4. Claim the checkpointed ranges.
        let mut created = Vec::with_capacity(cp.len());
        let mut hint: (ArenaId, Idx) = (ArenaId::MAX, NIL);
        for b in cp {
            let a = arena_of_block(&st, b)?;
            let from = if hint.0 == a { hint.1 } else { NIL };
            let Some(i) =
                st.arenas
                    .claim(a, b.addr.get(), b.size.get(), b.requested.get(), from)?
            else {
                return Err(EngineError::CheckpointMismatch(format!(
                    "{} + {} is not free (the engine was used by another thread while \
                     restoring)",
                    b.addr, b.size
                )));
            };
            st.register(i, b.requested, b.stream);
            created.push(Self::info(&st, i));
            hint = (a, i);
        }
        Ok(Restored { freed, created })
    }

    /// Maps carved `Mapping` pieces within the memory limit, the lock released around
    /// the device calls; a refused piece goes back to unmapped and the first error is
    /// returned (after every piece was tried).
    fn map_pieces<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, State>,
        pieces: &[Idx],
        stream: StreamId,
    ) -> Result<std::sync::MutexGuard<'a, State>, EngineError> {
        let total: u64 = pieces.iter().map(|&i| st.arenas.block(i).size).sum();
        let reserved = st.stats.reserved_bytes[0].current as u64;
        if reserved + st.mapping + total > st.limit {
            for &i in pieces {
                st.arenas.finish_mapping(i, false);
            }
            return Err(self.out_of_memory_error(st, Bytes(total), total, stream));
        }
        let (results, st) = self.map_blocks(st, pieces)?;
        let first_err = results.into_iter().find_map(Result::err);
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(st),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::engine::{EngineConfig, HostMemory, MemoryLimit};
    use crate::units::DeviceId;

    const G: u64 = 64 << 10;
    const S: StreamId = StreamId(7);
    const T: StreamId = StreamId(8);

    fn engine(limit: u64) -> (Arc<HostMemory>, Engine<Arc<HostMemory>>) {
        let host = Arc::new(HostMemory::new(Bytes(1 << 30), Bytes(G)));
        let e = Engine::new(
            host.clone(),
            EngineConfig {
                device: DeviceId(0),
                limit: MemoryLimit::Bytes(Bytes(limit)),
                arena_size: Some(Bytes(16 << 20)),
                record_trace: true,
                ..EngineConfig::default()
            },
        )
        .unwrap();
        (host, e)
    }

    fn alloc(e: &Engine<Arc<HostMemory>>, n: u64) -> DevicePtr {
        e.malloc(Bytes(n), S).unwrap()
    }

    #[test]
    fn restore_frees_what_is_live_and_recreates_the_checkpoint_at_its_addresses() {
        let (host, e) = engine(1 << 30);
        let a = alloc(&e, 1000);
        let b = alloc(&e, 3 << 20);
        let c = alloc(&e, 4096);
        e.free(c).unwrap();
        let cp = e.checkpoint().unwrap();
        let want: Vec<(DevicePtr, Bytes, Bytes)> = vec![
            (a, Bytes(1024), Bytes(1000)),
            (b, Bytes(3 << 20), Bytes(3 << 20)),
        ];
        let mut got: Vec<_> = cp
            .blocks()
            .iter()
            .map(|x| (x.addr, x.size, x.requested))
            .collect();
        got.sort();
        let mut want_sorted = want.clone();
        want_sorted.sort();
        assert_eq!(got, want_sorted);
        let stats_at_cp = e.stats().unwrap();
        // The run goes on: b dies, new blocks appear (one where b was).
        e.free(b).unwrap();
        let d = alloc(&e, 1 << 20);
        let f = alloc(&e, 512);
        assert_eq!(d, b, "best fit reuses b's place");
        host.fill(a, Bytes(1024), 0xAB).unwrap();
        let r = e.restore(&cp).unwrap();
        let mut freed: Vec<DevicePtr> = r.freed.iter().map(|x| x.addr).collect();
        freed.sort();
        let mut expect = vec![a, d, f];
        expect.sort();
        assert_eq!(freed, expect);
        assert!(r.freed.iter().all(|x| x.state == BlockState::Allocated));
        let created: Vec<_> = r
            .created
            .iter()
            .map(|x| (x.addr, x.size, x.requested))
            .collect();
        assert_eq!(created, want_sorted);
        e.check_invariants().unwrap();
        let s = e.stats().unwrap();
        for (now, then) in [
            (s.allocation, stats_at_cp.allocation),
            (s.allocated_bytes, stats_at_cp.allocated_bytes),
            (s.requested_bytes, stats_at_cp.requested_bytes),
        ] {
            assert_eq!(now[0].current, then[0].current);
        }
        // Memory that stayed mapped keeps its bytes (the checkpointed tensor's data).
        assert!(host.check(a, Bytes(1024), 0xAB).unwrap());
        // The re-created blocks are ordinary allocations.
        e.free(a).unwrap();
        e.free(b).unwrap();
        assert_eq!(e.stats().unwrap().allocation[0].current, 0);
        let t = e.take_trace().unwrap().unwrap();
        t.validate().unwrap();
    }

    #[test]
    fn released_granules_are_mapped_again_and_arenas_are_kept() {
        let (host, e) = engine(1 << 30);
        let a = alloc(&e, 5 << 20);
        let cp = e.checkpoint().unwrap();
        e.free(a).unwrap();
        e.empty_cache().unwrap();
        let s = e.stats().unwrap();
        assert_eq!(s.reserved_bytes[0].current, 0);
        assert_eq!(
            s.segment[0].current, 1,
            "a checkpointed engine keeps its arena"
        );
        assert_eq!(host.reservations(), 1);
        let maps = s.num_device_alloc;
        let r = e.restore(&cp).unwrap();
        assert!(r.freed.is_empty());
        assert_eq!(r.created[0].addr, a);
        let s = e.stats().unwrap();
        assert_eq!(
            s.reserved_bytes[0].current as u64,
            (5u64 << 20).div_ceil(G) * G
        );
        assert!(s.num_device_alloc > maps);
        host.fill(a, Bytes(5 << 20), 1).unwrap();
        e.check_invariants().unwrap();
        e.free(a).unwrap();
        drop(e);
        assert_eq!(host.reservations(), 0);
        assert_eq!(host.mapped_bytes(), Bytes(0));
    }

    #[test]
    fn blocks_used_on_other_streams_are_waited_for_once() {
        let (host, e) = engine(1 << 30);
        let a = alloc(&e, 4096);
        let cp = e.checkpoint().unwrap();
        let b = alloc(&e, 8192);
        e.record_stream(b, T).unwrap();
        let c = alloc(&e, 512);
        e.record_stream(c, T).unwrap();
        e.free(c).unwrap(); // pending on T
        let syncs = host.counters().synchronizes;
        let before = e.stats().unwrap().num_sync_all_streams;
        let r = e.restore(&cp).unwrap();
        assert_eq!(host.counters().synchronizes, syncs + 1);
        assert_eq!(e.stats().unwrap().num_sync_all_streams, before + 1);
        assert_eq!(r.freed.len(), 2); // a and b; c was already freed
        assert_eq!(r.created.len(), 1);
        let s = e.stats().unwrap();
        assert_eq!(s.active[0].current, 1, "nothing left pending");
        e.check_invariants().unwrap();
        // Without other streams nothing is synchronised.
        let syncs = host.counters().synchronizes;
        e.restore(&cp).unwrap();
        assert_eq!(host.counters().synchronizes, syncs);
        e.free(a).unwrap();
    }

    #[test]
    fn failures_are_errors_and_leave_live_blocks_live() {
        let (host, e) = engine(8 << 20);
        let a = alloc(&e, 6 << 20);
        let cp = e.checkpoint().unwrap();
        e.free(a).unwrap();
        e.empty_cache().unwrap();
        let b = e.malloc(Bytes(4 << 20), T).unwrap();
        // Mapping a's range again would pass the 8 MiB limit: refused, b stays.
        let err = e.restore(&cp).unwrap_err();
        assert!(matches!(err, EngineError::OutOfMemory { .. }), "{err}");
        assert_eq!(e.block_info(b).unwrap().state, BlockState::Allocated);
        e.check_invariants().unwrap();
        // A refused map: same.
        e.set_memory_limit(MemoryLimit::Bytes(Bytes(1 << 30)))
            .unwrap();
        e.free(b).unwrap();
        e.empty_cache().unwrap();
        let b = e.malloc(Bytes(512), T).unwrap();
        host.fail_map_in(1);
        assert!(matches!(e.restore(&cp), Err(EngineError::Device(_))));
        assert_eq!(e.block_info(b).unwrap().state, BlockState::Allocated);
        e.check_invariants().unwrap();
        // Another engine's checkpoint (same device): refused before anything changes.
        let other = Engine::new(host.clone(), EngineConfig::default()).unwrap();
        let x = other.malloc(Bytes(512), S).unwrap();
        let foreign = other.checkpoint().unwrap();
        assert!(matches!(
            e.restore(&foreign),
            Err(EngineError::CheckpointMismatch(_))
        ));
        assert_eq!(e.block_info(b).unwrap().state, BlockState::Allocated);
        other.free(x).unwrap();
        // And now it works.
        let r = e.restore(&cp).unwrap();
        assert_eq!(r.created[0].addr, a);
        e.check_invariants().unwrap();
        e.free(a).unwrap();
    }

    #[test]
    fn an_empty_checkpoint_frees_everything() {
        let (_, e) = engine(1 << 30);
        let cp = e.checkpoint().unwrap();
        assert!(cp.blocks().is_empty());
        let a = alloc(&e, 100);
        let r = e.restore(&cp).unwrap();
        assert_eq!(r.freed.len(), 1);
        assert_eq!(r.freed[0].addr, a);
        assert!(r.created.is_empty());
        assert_eq!(e.stats().unwrap().allocation[0].current, 0);
        assert!(matches!(e.free(a), Err(EngineError::UnknownPointer(_))));
        e.check_invariants().unwrap();
    }
}
