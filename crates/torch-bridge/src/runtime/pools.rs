//! Private pools (CUDA graphs, `MemPool`s): one engine per live pool, its use count,
//! its retirement once released and empty (keeping the device's counters), and pool
//! checkpoints for CUDA graph trees ([`Core::pool_checkpoint`], [`Core::pool_restore`]).
//! Pools are keyed by the bridge's `PoolId` (a cxx type).

use std::sync::atomic::Ordering;

use stweaver_core::engine::{BlockState, Checkpoint, Engine, Restored};

use super::stats::{stats_of, stats_of_mut};
use super::{Core, DeviceSlot, is_default, lock, read};
use crate::error::{BridgeError, Result};
use crate::ffi::bridge::{HistoryAction, HistoryEvent, PoolId};
use crate::tracked::{Owner, Tracked};

/// A private pool: its engine and how many users hold it.
pub(super) struct PrivatePool {
    pub(super) engine: Engine<Tracked>,
    pub(super) use_count: i32,
}

impl Core {
    pub fn pool_incref(&self, device: i32, pool: PoolId) -> Result<()> {
        if is_default(pool) {
            return Err(BridgeError::DefaultPoolIsNotPrivate);
        }
        let slot = self.slot(device)?;
        if let Some(p) = slot
            .private
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&pool)
        {
            p.use_count += 1;
            return Ok(());
        }
        // Before the first private pool, fold the default engine's peaks into the device
        // peaks: from now on peaks are tracked across engines.
        if let Some(e) = slot.default.get() {
            let s = stats_of(&e.stats()?);
            let mut agg = lock(&slot.agg);
            for (k, p) in stats_of_mut(&mut agg.peaks).into_iter().enumerate() {
                p.peak = p.peak.max(s[k].peak);
            }
        }
        let engine = self.new_engine(slot, pool)?;
        let mut pools = slot.private.write().unwrap_or_else(|e| e.into_inner());
        match pools.get_mut(&pool) {
            Some(p) => p.use_count += 1, // another thread made it meanwhile; ours drops
            None => {
                pools.insert(
                    pool,
                    PrivatePool {
                        engine,
                        use_count: 1,
                    },
                );
                self.private_pools.fetch_add(1, Ordering::AcqRel);
                // A `set_tag` between the engine's creation and now did not reach it.
                if let Some(p) = pools.get(&pool) {
                    p.engine.set_tag(self.tag.load(Ordering::SeqCst))?;
                }
            }
        }
        Ok(())
    }

    /// `beginAllocateToPool`: a reference to `pool` (created at its first use), and an
    /// allocation to a private pool in progress on `device` until
    /// [`Core::pool_end_allocate`]: a CUDA graph capture, during which no engine of the
    /// device synchronises it or gives memory back ([`crate::tracked::CaptureGate`]).
    pub fn pool_begin_allocate(&self, device: i32, pool: PoolId) -> Result<()> {
        self.pool_incref(device, pool)?;
        self.slot(device)?.captures.begin();
        Ok(())
    }

    /// `endAllocateToPool`: the allocation to `pool` begun by
    /// [`Core::pool_begin_allocate`] is over (its reference stays until `releasePool`).
    pub fn pool_end_allocate(&self, device: i32, pool: PoolId) -> Result<()> {
        if is_default(pool) {
            return Err(BridgeError::DefaultPoolIsNotPrivate);
        }
        if !self.slot(device)?.captures.end() {
            return Err(BridgeError::NotAllocatingToPool { device, pool });
        }
        Ok(())
    }

    pub fn pool_release(&self, device: i32, pool: PoolId) -> Result<()> {
        let slot = self.slot(device)?;
        {
            let mut pools = slot.private.write().unwrap_or_else(|e| e.into_inner());
            let p = pools
                .get_mut(&pool)
                .ok_or(BridgeError::UnknownPool { device, pool })?;
            if p.use_count <= 0 {
                return Err(BridgeError::PoolOverReleased { device, pool });
            }
            p.use_count -= 1;
            if p.use_count > 0 {
                return Ok(());
            }
        }
        // Nobody will allocate from it again: give its cache back now.
        if let Some(p) = read(&slot.private).get(&pool) {
            p.engine.empty_cache()?;
        }
        self.maybe_retire(slot, pool)
    }

    pub fn pool_use_count(&self, device: i32, pool: PoolId) -> Result<i32> {
        let slot = self.slot(device)?;
        Ok(read(&slot.private).get(&pool).map_or(0, |p| p.use_count))
    }

    pub fn pool_live_allocations(&self, device: i32, pool: PoolId) -> Result<Vec<usize>> {
        let owner = Owner { device, pool };
        self.with_engine(owner, |e| {
            Ok(e.snapshot()?
                .iter()
                .flat_map(|s| s.blocks.iter())
                .filter(|b| b.state == BlockState::Allocated)
                .map(|b| b.addr.get() as usize)
                .collect())
        })
    }

    /// The allocated blocks of a private pool (`getCheckpointState`, taken by CUDA graph
    /// trees right after recording a graph). The pool keeps its address ranges from now
    /// on, so the checkpoint stays restorable while the pool lives.
    pub fn pool_checkpoint(&self, device: i32, pool: PoolId) -> Result<Checkpoint> {
        if is_default(pool) {
            return Err(BridgeError::DefaultPoolIsNotPrivate);
        }
        self.with_engine(Owner { device, pool }, |e| Ok(e.checkpoint()?))
    }

    /// Brings a private pool back to `checkpoint` (`setCheckpointPoolState`): every block
    /// allocated in it now is freed, every checkpointed block allocated again at its
    /// address ([`Engine::restore`]). The history sees the frees and the allocations.
    pub fn pool_restore(
        &self,
        device: i32,
        pool: PoolId,
        checkpoint: &Checkpoint,
    ) -> Result<Restored> {
        if is_default(pool) {
            return Err(BridgeError::DefaultPoolIsNotPrivate);
        }
        let slot = self.slot(device)?;
        let r = self.with_engine(Owner { device, pool }, |e| Ok(e.restore(checkpoint)?))?;
        if self.shared.history_on() {
            self.resolve_pending();
            let ev = |action, b: &stweaver_core::engine::BlockInfo| HistoryEvent {
                action,
                device,
                addr: b.addr.get(),
                size: b.requested.get(),
                stream: b.stream.0 as usize,
                pool,
            };
            for b in &r.freed {
                self.shared.push(ev(HistoryAction::FreeRequested, b));
                self.shared.push(ev(HistoryAction::FreeCompleted, b));
            }
            for b in &r.created {
                self.shared.push(ev(HistoryAction::Alloc, b));
            }
        }
        self.after_op(slot)?;
        Ok(r)
    }

    /// Drops a released private pool once nothing in it is active.
    pub(super) fn maybe_retire(&self, slot: &DeviceSlot, pool: PoolId) -> Result<()> {
        let removable = match read(&slot.private).get(&pool) {
            Some(p) => p.use_count == 0 && p.engine.stats()?.active[0].current == 0,
            None => false,
        };
        if !removable {
            return Ok(());
        }
        let removed = {
            let mut pools = slot.private.write().unwrap_or_else(|e| e.into_inner());
            match pools.get(&pool) {
                Some(p) if p.use_count == 0 => pools.remove(&pool),
                _ => None,
            }
        };
        let Some(p) = removed else {
            return Ok(());
        };
        p.engine.empty_cache()?;
        let s = p.engine.stats()?;
        {
            // Keep the device's peaks and accumulated counters across the drop.
            let mut agg = lock(&slot.agg);
            let own = stats_of(&s);
            for (k, r) in stats_of_mut(&mut agg.retired).into_iter().enumerate() {
                r.allocated += own[k].allocated;
                r.freed += own[k].freed;
            }
            let r = &mut agg.retired;
            r.num_alloc_retries += s.num_alloc_retries;
            r.num_ooms += s.num_ooms;
            r.num_sync_all_streams += s.num_sync_all_streams;
            r.num_device_alloc += s.num_device_alloc;
            r.num_device_free += s.num_device_free;
        }
        drop(p); // unmaps and releases whatever is left
        self.private_pools.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }
}
