//! Introspection of an engine, none of it on the hot path: its stats ([`Engine::stats`]
//! and their resets), blocks ([`Engine::block_info`]) and arenas ([`Engine::snapshot`],
//! as [`BlockInfo`] and [`SegmentInfo`]), the consistency check
//! ([`Engine::check_invariants`]) and what plan serving has done ([`Engine::plan_stats`],
//! [`Engine::plan_pool`], [`Engine::plan_abandoned`], [`Engine::plan_position`],
//! [`Engine::plan_conflicts_seen`]).

use super::arena::Idx;
use super::plan_serving::ConflictsSeen;
use super::{
    BlockState, DeviceMemory, DevicePtr, DeviceStats, Engine, EngineError, PlanSection, PlanStats,
    PoolKind, State,
};
use crate::units::{Bytes, StreamId};

/// A block as reported by [`Engine::snapshot`] and [`Engine::block_info`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    pub addr: DevicePtr,
    /// Rounded size (what `allocated_bytes` counts).
    pub size: Bytes,
    /// The caller's size (0 unless allocated or pending).
    pub requested: Bytes,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub state: BlockState,
}

/// An arena as reported by [`Engine::snapshot`] (PyTorch's `SegmentInfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    pub stream: StreamId,
    pub pool: PoolKind,
    pub base: DevicePtr,
    /// Reserved virtual size.
    pub len: Bytes,
    /// Mapped bytes.
    pub mapped: Bytes,
    /// Every block, in address order.
    pub blocks: Vec<BlockInfo>,
}

impl<D: DeviceMemory> Engine<D> {
    /// A copy of the stats.
    pub fn stats(&self) -> Result<DeviceStats, EngineError> {
        Ok(self.lock()?.stats)
    }

    /// Every peak back to its current value.
    pub fn reset_peak_stats(&self) -> Result<(), EngineError> {
        self.lock()?.stats.reset_peak();
        Ok(())
    }

    /// Every accumulated counter back to zero.
    pub fn reset_accumulated_stats(&self) -> Result<(), EngineError> {
        self.lock()?.stats.reset_accumulated();
        Ok(())
    }

    pub(super) fn info(st: &State, i: Idx) -> BlockInfo {
        let b = st.arenas.block(i);
        BlockInfo {
            addr: DevicePtr(b.addr),
            size: Bytes(b.size),
            requested: Bytes(b.requested),
            stream: st.stream_of(i),
            pool: st.kind_of(i),
            state: b.state,
        }
    }

    /// The live (allocated or pending) block at `ptr`.
    pub fn block_info(&self, ptr: DevicePtr) -> Result<BlockInfo, EngineError> {
        let st = self.lock()?;
        match st.live.get(ptr.get()) {
            Some(i) => Ok(Self::info(&st, i)),
            None => Err(EngineError::UnknownPointer(ptr)),
        }
    }

    /// Every arena and its blocks (for `torch.cuda.memory_snapshot`). O(blocks).
    pub fn snapshot(&self) -> Result<Vec<SegmentInfo>, EngineError> {
        let st = self.lock()?;
        let mut out = Vec::new();
        for a in st.arenas.arena_ids() {
            let Some(arena) = st.arenas.arena(a) else {
                continue;
            };
            let blocks: Vec<BlockInfo> = st
                .arenas
                .arena_blocks(a)
                .map(|(i, _)| Self::info(&st, i))
                .collect();
            let mapped = blocks
                .iter()
                .filter(|b| b.state.is_mapped())
                .map(|b| b.size.get())
                .sum();
            out.push(SegmentInfo {
                stream: arena.stream,
                pool: arena.kind,
                base: DevicePtr(arena.base),
                len: Bytes(arena.len),
                mapped: Bytes(mapped),
                blocks,
            });
        }
        out.sort_by_key(|s| s.base);
        Ok(out)
    }

    /// Recomputes everything from the blocks and checks it against the bookkeeping:
    /// the arena invariants ([`arena`](super::arena)), every stat's current value, the
    /// pointer map and the event queue. O(blocks). For tests and fuzzing.
    pub fn check_invariants(&self) -> Result<(), EngineError> {
        let st = self.lock()?;
        let fail = |m: String| Err(EngineError::Inconsistent(m));
        let totals = match st.arenas.check() {
            Ok(t) => t,
            Err(m) => return fail(m),
        };
        let s = &st.stats;
        for (kind, t) in [PoolKind::Small, PoolKind::Large].into_iter().zip(totals) {
            let k = kind.stat_type() as usize;
            let pairs: [(&str, i64, u64); 9] = [
                ("segment", s.segment[k].current, t.arenas),
                ("reserved_bytes", s.reserved_bytes[k].current, t.mapped),
                ("allocation", s.allocation[k].current, t.allocated_count),
                ("allocated_bytes", s.allocated_bytes[k].current, t.allocated),
                ("active", s.active[k].current, t.active_count),
                ("active_bytes", s.active_bytes[k].current, t.active),
                ("requested_bytes", s.requested_bytes[k].current, t.requested),
                (
                    "inactive_split",
                    s.inactive_split[k].current,
                    t.inactive_count,
                ),
                (
                    "inactive_split_bytes",
                    s.inactive_split_bytes[k].current,
                    t.inactive,
                ),
            ];
            for (name, stat, real) in pairs {
                if stat != real as i64 {
                    return fail(format!(
                        "{name} of {kind:?} pool is {stat}, blocks say {real}"
                    ));
                }
            }
        }
        for arr in s.arrays() {
            if arr[0].current != arr[1].current + arr[2].current {
                return fail(format!("aggregate {:?} is not small + large", arr[0]));
            }
        }
        let active: u64 = totals.iter().map(|t| t.active_count).sum();
        if st.live.len() as u64 != active {
            return fail(format!(
                "{} live pointers, {active} active blocks",
                st.live.len()
            ));
        }
        for (addr, i) in st.live.iter() {
            let b = st.arenas.block(i);
            if b.addr != addr
                || !matches!(
                    b.state,
                    BlockState::Allocated | BlockState::PendingFree | BlockState::Paused
                )
            {
                return fail(format!(
                    "live pointer {addr:#x} maps to block {i} {:?} at {:#x}",
                    b.state, b.addr
                ));
            }
        }
        for e in st.events.iter() {
            if st.arenas.block(e.block).state != BlockState::PendingFree {
                return fail(format!(
                    "event {} queued for a block that is not pending",
                    e.event
                ));
            }
        }
        for (&(stream, kind), &a) in &st.arena_of {
            match st.arenas.arena(a) {
                Some(x) if x.stream == stream && x.kind == kind => {}
                _ => return fail(format!("arena map entry ({stream}, {kind:?}) is stale")),
            }
        }
        Ok(())
    }

    /// Why the plan was given up mid-run (its pool hit the memory limit), if it was.
    pub fn plan_abandoned(&self) -> Result<Option<String>, EngineError> {
        Ok(self.lock()?.abandoned.clone())
    }

    /// Where the served plan's conflicts came (`None`: no plan served). For reports
    /// (`stweaver.stats()`): which iteration a plan began to conflict in, and with what.
    pub fn plan_conflicts_seen(&self) -> Result<Option<ConflictsSeen>, EngineError> {
        Ok(self.lock()?.plan.as_ref().map(|p| p.conflicts_seen()))
    }

    /// The planned range (address, length) of the last request whose planned place
    /// was occupied (a conflict), once: taking it clears it. `None` when there was no
    /// conflict since the last call or no plan is served. For replays that name what
    /// occupied the range (`stweaver replay`).
    pub fn take_last_conflict(&self) -> Result<Option<(DevicePtr, Bytes)>, EngineError> {
        Ok(self
            .lock()?
            .plan
            .as_mut()
            .and_then(|p| p.last_conflict.take())
            .map(|(a, l)| (DevicePtr(a), Bytes(l))))
    }

    /// The plan pool's base address and mapped length (`None` when no plan is served).
    pub fn plan_pool(&self) -> Result<Option<(DevicePtr, Bytes)>, EngineError> {
        Ok(self
            .lock()?
            .plan
            .as_ref()
            .map(|p| (DevicePtr(p.base), Bytes(p.len))))
    }

    /// What plan serving has done so far (`None` when no plan is served).
    pub fn plan_stats(&self) -> Result<Option<PlanStats>, EngineError> {
        Ok(self.lock()?.plan.as_ref().map(|p| p.cursor.stats))
    }

    /// Where the plan's cursor is: section and index of the next expected request.
    pub fn plan_position(&self) -> Result<Option<(PlanSection, usize)>, EngineError> {
        Ok(self.lock()?.plan.as_ref().map(|p| p.cursor.position()))
    }
}
