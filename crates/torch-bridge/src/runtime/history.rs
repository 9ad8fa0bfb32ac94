//! PyTorch memory history: the events reported while history is on (allocations,
//! free requests, free completions; mapping changes come from [`crate::tracked`]), and
//! the frees deferred behind other streams whose completion is reported later.
//! Events are the bridge's `HistoryEvent` (a cxx type).

use std::sync::atomic::Ordering;

use stweaver_core::engine::{BlockInfo, BlockState, DevicePtr, Engine};

use super::{Core, lock};
use crate::ffi::bridge::{HistoryAction, HistoryEvent};
use crate::tracked::{Owner, Tracked};

/// A free whose completion has not been reported to the history yet.
#[derive(Debug, Clone, Copy)]
pub(super) struct PendingFree {
    owner: Owner,
    ptr: u64,
    size: u64,
    stream: usize,
}

impl Core {
    /// History: reports the free of `dptr` (`info`: its block before the free) as
    /// requested, and as completed unless the engine deferred it behind other streams
    /// (then pending until [`Core::resolve_pending`] sees it complete).
    pub(super) fn report_free(
        &self,
        e: &Engine<Tracked>,
        owner: Owner,
        dptr: DevicePtr,
        info: &BlockInfo,
    ) {
        let ev = |action| HistoryEvent {
            action,
            device: owner.device,
            addr: dptr.get(),
            size: info.requested.get(),
            stream: info.stream.0 as usize,
            pool: owner.pool,
        };
        self.shared.push(ev(HistoryAction::FreeRequested));
        match e.block_info(dptr) {
            Ok(b) if b.state == BlockState::PendingFree => {
                lock(&self.pending).push(PendingFree {
                    owner,
                    ptr: dptr.get(),
                    size: info.requested.get(),
                    stream: info.stream.0 as usize,
                });
                self.has_pending.store(true, Ordering::Release);
            }
            _ => self.shared.push(ev(HistoryAction::FreeCompleted)),
        }
    }

    /// Reports the completion of deferred frees (history only).
    pub(super) fn resolve_pending(&self) {
        if !self.has_pending.load(Ordering::Acquire) {
            return;
        }
        let mut pending = lock(&self.pending);
        pending.retain(|p| {
            let still = self
                .with_engine(p.owner, |e| {
                    Ok(matches!(
                        e.block_info(DevicePtr(p.ptr)),
                        Ok(b) if b.state == BlockState::PendingFree
                    ))
                })
                .unwrap_or(false);
            if !still {
                self.shared.push(HistoryEvent {
                    action: HistoryAction::FreeCompleted,
                    device: p.owner.device,
                    addr: p.ptr,
                    size: p.size,
                    stream: p.stream,
                    pool: p.owner.pool,
                });
            }
            still
        });
        self.has_pending
            .store(!pending.is_empty(), Ordering::Release);
    }

    pub fn set_history(&self, enabled: bool) {
        self.shared.set_history(enabled);
        if !enabled {
            lock(&self.pending).clear();
            self.has_pending.store(false, Ordering::Release);
        }
    }

    pub fn drain_history(&self) -> Vec<HistoryEvent> {
        self.resolve_pending();
        self.shared.drain()
    }
}
