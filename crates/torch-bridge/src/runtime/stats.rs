//! Device-level stats over a device's engines (the default engine and its private
//! pools: sums, peaks at operation granularity, counters of dropped engines), their
//! conversion to the bridge's `ffi::DeviceStats`, the allocator snapshot
//! (`ffi::Snapshot`: arenas split into PyTorch segments) and [`Core::info_json`].
//! The `ffi::*` types here are cxx types used as the runtime's own output types.

use std::sync::atomic::Ordering;

use stweaver_core::engine::{BlockState, DeviceStats, PoolKind, SegmentInfo, Stat};

use super::plan::OffloadOutcome;
use super::{Core, DEFAULT_POOL, DeviceSlot, is_default, lock, read};
use crate::dist::PlanSource;
use crate::error::Result;
use crate::ffi::bridge as ffi;
use crate::ffi::bridge::PoolId;

/// Device-level stats bookkeeping across engines.
#[derive(Default)]
pub(super) struct Agg {
    /// Highest sums seen (only `peak` of each stat is used).
    pub(super) peaks: DeviceStats,
    /// Accumulated counters of dropped engines (only `allocated`, `freed` and counters).
    pub(super) retired: DeviceStats,
}

/// The 29 `Stat`s of a `DeviceStats`, in a fixed order.
pub(super) fn stats_of(s: &DeviceStats) -> [Stat; 29] {
    let mut out = [Stat::default(); 29];
    for (k, arr) in s.arrays().iter().enumerate() {
        out[3 * k..3 * k + 3].copy_from_slice(&arr[..]);
    }
    out[27] = s.oversize_allocations;
    out[28] = s.oversize_segments;
    out
}

pub(super) fn stats_of_mut(s: &mut DeviceStats) -> [&mut Stat; 29] {
    let DeviceStats {
        allocation: [a0, a1, a2],
        segment: [b0, b1, b2],
        active: [c0, c1, c2],
        inactive_split: [d0, d1, d2],
        allocated_bytes: [e0, e1, e2],
        reserved_bytes: [f0, f1, f2],
        active_bytes: [g0, g1, g2],
        inactive_split_bytes: [h0, h1, h2],
        requested_bytes: [i0, i1, i2],
        oversize_allocations: o1,
        oversize_segments: o2,
        ..
    } = s;
    [
        a0, a1, a2, b0, b1, b2, c0, c1, c2, d0, d1, d2, e0, e1, e2, f0, f1, f2, g0, g1, g2, h0, h1,
        h2, i0, i1, i2, o1, o2,
    ]
}

/// Combines engine stats into device stats (see the module documentation).
pub(super) fn combine(engines: &[DeviceStats], agg: &Agg) -> DeviceStats {
    let mut out = DeviceStats::default();
    let flats: Vec<[Stat; 29]> = engines.iter().map(stats_of).collect();
    let peaks = stats_of(&agg.peaks);
    let retired = stats_of(&agg.retired);
    for (k, o) in stats_of_mut(&mut out).into_iter().enumerate() {
        let current: i64 = flats.iter().map(|f| f[k].current).sum();
        let own_peak = flats.iter().map(|f| f[k].peak).max().unwrap_or(0);
        o.current = current;
        o.peak = peaks[k].peak.max(current).max(own_peak);
        o.allocated = flats.iter().map(|f| f[k].allocated).sum::<i64>() + retired[k].allocated;
        o.freed = flats.iter().map(|f| f[k].freed).sum::<i64>() + retired[k].freed;
    }
    let r = &agg.retired;
    out.num_alloc_retries =
        engines.iter().map(|s| s.num_alloc_retries).sum::<i64>() + r.num_alloc_retries;
    out.num_ooms = engines.iter().map(|s| s.num_ooms).sum::<i64>() + r.num_ooms;
    out.num_sync_all_streams =
        engines.iter().map(|s| s.num_sync_all_streams).sum::<i64>() + r.num_sync_all_streams;
    out.num_device_alloc =
        engines.iter().map(|s| s.num_device_alloc).sum::<i64>() + r.num_device_alloc;
    out.num_device_free =
        engines.iter().map(|s| s.num_device_free).sum::<i64>() + r.num_device_free;
    out.max_split_size = engines.first().map_or(-1, |s| s.max_split_size);
    out
}

fn to_ffi_stat(s: Stat) -> ffi::Stat {
    ffi::Stat {
        current: s.current,
        peak: s.peak,
        allocated: s.allocated,
        freed: s.freed,
    }
}

fn to_ffi_array(a: &[Stat; 3]) -> ffi::StatArray {
    ffi::StatArray {
        all: to_ffi_stat(a[0]),
        small_pool: to_ffi_stat(a[1]),
        large_pool: to_ffi_stat(a[2]),
    }
}

/// `DeviceStats` as the bridge struct.
pub fn to_ffi_stats(s: &DeviceStats) -> ffi::DeviceStats {
    ffi::DeviceStats {
        allocation: to_ffi_array(&s.allocation),
        segment: to_ffi_array(&s.segment),
        active: to_ffi_array(&s.active),
        inactive_split: to_ffi_array(&s.inactive_split),
        allocated_bytes: to_ffi_array(&s.allocated_bytes),
        reserved_bytes: to_ffi_array(&s.reserved_bytes),
        active_bytes: to_ffi_array(&s.active_bytes),
        inactive_split_bytes: to_ffi_array(&s.inactive_split_bytes),
        requested_bytes: to_ffi_array(&s.requested_bytes),
        num_alloc_retries: s.num_alloc_retries,
        num_ooms: s.num_ooms,
        oversize_allocations: to_ffi_stat(s.oversize_allocations),
        oversize_segments: to_ffi_stat(s.oversize_segments),
        num_sync_all_streams: s.num_sync_all_streams,
        num_device_alloc: s.num_device_alloc,
        num_device_free: s.num_device_free,
        max_split_size: s.max_split_size,
    }
}

/// Splits one arena into PyTorch segments: each maximal run of mapped blocks.
pub(super) fn arena_segments(
    device: i32,
    pool: PoolId,
    arena: &SegmentInfo,
    snap: &mut ffi::Snapshot,
) {
    let mut i = 0;
    let blocks = &arena.blocks;
    while i < blocks.len() {
        if !blocks[i].state.is_mapped() {
            i += 1;
            continue;
        }
        let first_block = snap.blocks.len();
        let mut seg = ffi::SnapshotSegment {
            device,
            address: blocks[i].addr.get(),
            stream: arena.stream.0 as usize,
            is_large: arena.pool == PoolKind::Large,
            is_expandable: true,
            pool,
            first_block,
            ..Default::default()
        };
        while i < blocks.len() && blocks[i].state.is_mapped() {
            let b = &blocks[i];
            let allocated = b.state == BlockState::Allocated;
            let active = allocated || b.state == BlockState::PendingFree;
            seg.total_size += b.size.get();
            if allocated {
                seg.allocated_size += b.size.get();
            }
            if active {
                seg.active_size += b.size.get();
                seg.requested_size += b.requested.get();
            }
            snap.blocks.push(ffi::SnapshotBlock {
                address: b.addr.get(),
                size: b.size.get(),
                requested_size: b.requested.get(),
                allocated,
                active,
            });
            i += 1;
        }
        seg.num_blocks = snap.blocks.len() - first_block;
        snap.segments.push(seg);
    }
}

impl Core {
    /// After every operation on `slot`: keep device-level peaks exact while private pools
    /// exist.
    pub(super) fn after_op(&self, slot: &DeviceSlot) -> Result<()> {
        if self.private_pools.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let all = self.engine_stats(slot)?;
        let mut agg = lock(&slot.agg);
        let sums = combine(&all, &Agg::default());
        let sum_flat = stats_of(&sums);
        for (k, p) in stats_of_mut(&mut agg.peaks).into_iter().enumerate() {
            p.peak = p.peak.max(sum_flat[k].current);
        }
        Ok(())
    }

    fn engine_stats(&self, slot: &DeviceSlot) -> Result<Vec<DeviceStats>> {
        let mut all = Vec::new();
        if let Some(e) = slot.default.get() {
            all.push(e.stats()?);
        }
        for p in read(&slot.private).values() {
            all.push(p.engine.stats()?);
        }
        Ok(all)
    }

    pub(super) fn device_stats_raw(&self, slot: &DeviceSlot) -> Result<DeviceStats> {
        let all = self.engine_stats(slot)?;
        let agg = lock(&slot.agg);
        if all.is_empty() {
            return Ok(combine(&[DeviceStats::default()], &agg));
        }
        Ok(combine(&all, &agg))
    }

    pub fn device_stats(&self, device: i32) -> Result<DeviceStats> {
        self.device_stats_raw(self.slot(device)?)
    }

    pub fn reset_peak_stats(&self, device: i32) -> Result<()> {
        let slot = self.slot(device)?;
        if let Some(e) = slot.default.get() {
            e.reset_peak_stats()?;
        }
        for p in read(&slot.private).values() {
            p.engine.reset_peak_stats()?;
        }
        let all = self.engine_stats(slot)?;
        let sums = stats_of(&combine(&all, &Agg::default()));
        let mut agg = lock(&slot.agg);
        for (k, p) in stats_of_mut(&mut agg.peaks).into_iter().enumerate() {
            p.peak = sums[k].current;
        }
        Ok(())
    }

    pub fn reset_accumulated_stats(&self, device: i32) -> Result<()> {
        let slot = self.slot(device)?;
        if let Some(e) = slot.default.get() {
            e.reset_accumulated_stats()?;
        }
        for p in read(&slot.private).values() {
            p.engine.reset_accumulated_stats()?;
        }
        lock(&slot.agg).retired = DeviceStats::default();
        Ok(())
    }

    pub fn snapshot(&self, pool: PoolId, all_pools: bool) -> Result<ffi::Snapshot> {
        let mut snap = ffi::Snapshot::default();
        for slot in self.slots()? {
            if (all_pools || is_default(pool))
                && let Some(e) = slot.default.get()
            {
                for arena in e.snapshot()? {
                    arena_segments(slot.ordinal, DEFAULT_POOL, &arena, &mut snap);
                }
            }
            for (&id, p) in read(&slot.private).iter() {
                if all_pools || id == pool {
                    for arena in p.engine.snapshot()? {
                        arena_segments(slot.ordinal, id, &arena, &mut snap);
                    }
                }
            }
        }
        // Sorted by (device, address), blocks renumbered to follow.
        let mut order: Vec<usize> = (0..snap.segments.len()).collect();
        order.sort_by_key(|&i| (snap.segments[i].device, snap.segments[i].address));
        let mut out = ffi::Snapshot::default();
        for i in order {
            let mut seg = snap.segments[i];
            let blocks = &snap.blocks[seg.first_block..seg.first_block + seg.num_blocks];
            seg.first_block = out.blocks.len();
            out.blocks.extend_from_slice(blocks);
            out.segments.push(seg);
        }
        Ok(out)
    }

    /// The runtime's state as JSON (for `stweaver.stats()`).
    pub fn info_json(&self) -> Result<String> {
        let mut devices = Vec::new();
        if let Some(slots) = self.devices.get() {
            for slot in slots {
                let opened = slot.default.get().is_some();
                let s = if opened {
                    Some(self.device_stats_raw(slot)?)
                } else {
                    None
                };
                let tracing = match slot.default.get() {
                    Some(e) => e.is_tracing()?,
                    None => false,
                };
                let plan = match slot.default.get() {
                    Some(e) => e.plan_stats()?.map(|p| {
                        let mut v = stweaver_planner::engine_replay::plan_stats_json(&p);
                        // Iterations whose class guess began from their key's class
                        // (`stweaver.step(key)`).
                        v["hinted"] = p.hinted.into();
                        // Where its conflicts came: the first one described, and the
                        // count per iteration (0: the prologue).
                        if let Ok(Some(c)) = e.plan_conflicts_seen() {
                            v["first_conflict"] = c.first.into();
                            v["conflicts_by_iteration"] = c
                                .by_iteration
                                .iter()
                                .map(|&(i, n)| serde_json::json!([i, n]))
                                .collect::<Vec<_>>()
                                .into();
                        }
                        v
                    }),
                    None => None,
                };
                let abandoned = match slot.default.get() {
                    Some(e) => e.plan_abandoned()?,
                    None => None,
                };
                // Pause / resume (issue #17): bytes paused now, and the tags paused (0:
                // every tag, as `pause` takes them).
                let (paused_bytes, paused_tags) = self.slot_paused(slot)?;
                // Host memory behind kept contents: holding paused contents, and cached
                // (page-locked) for the next pause of the same tag.
                let host = self.slot_host_backup(slot)?;
                devices.push(serde_json::json!({
                    "device": slot.ordinal,
                    "paused_bytes": paused_bytes,
                    "paused_tags": paused_tags,
                    "host_backup": {
                        "in_use_bytes": host.in_use.get(),
                        "cached_bytes": host.cached.get(),
                        "pinned_bytes": host.pinned.get(),
                        "allocations": host.allocations,
                        "fallbacks": host.fallbacks,
                    },
                    "plan": plan,
                    "plan_abandoned": abandoned,
                    "opened": opened,
                    "private_pools": read(&slot.private).len(),
                    "memory_fraction": *lock(&slot.fraction),
                    "budget": self.settings.budget.map(|b| b.to_string()),
                    // The device-wide limit (budget and memory fraction, the smaller) and
                    // what every pool of the device maps now; null before the device opens.
                    "limit_bytes": slot.mem.get().map(|_| slot.budget.limit()),
                    "mapped_bytes": slot.budget.mapped(),
                    "tracing": tracing,
                    // Auto mode under a budget: the offload the plan carries, or why none.
                    "offload": lock(&slot.offload_outcome).as_ref().map(OffloadOutcome::json),
                    "allocated_bytes": s.map_or(0, |s| s.allocated_bytes[0].current),
                    "reserved_bytes": s.map_or(0, |s| s.reserved_bytes[0].current),
                    "reserved_small_bytes": s.map_or(0, |s| s.reserved_bytes[1].current),
                    "pool_mapped_bytes": match slot.default.get() {
                        Some(e) => e.plan_pool()?.map_or(0, |(_, len)| len.get()),
                        None => 0,
                    },
                    "peak_allocated_bytes": s.map_or(0, |s| s.allocated_bytes[0].peak),
                    "peak_reserved_bytes": s.map_or(0, |s| s.reserved_bytes[0].peak),
                    "num_device_alloc": s.map_or(0, |s| s.num_device_alloc),
                    "num_device_free": s.map_or(0, |s| s.num_device_free),
                    "num_ooms": s.map_or(0, |s| s.num_ooms),
                }));
            }
        }
        let v = serde_json::json!({
            "mode": self.mode(),
            "initialized": self.devices.get().is_some(),
            "iterations": self.iterations.load(Ordering::Acquire),
            "trace_path": self.settings.trace_path.as_ref().map(|p| p.display().to_string()),
            "plan_path": self.settings.plan_path.as_ref().map(|p| p.display().to_string()),
            "notes": *lock(&self.notes),
            "rank": self.settings.rank.map(|r| serde_json::json!({
                "rank": r.rank,
                "local_rank": r.local_rank,
                "world_size": r.world_size,
            })),
            "home_device": self.home(),
            "plan_file": lock(&self.plan).source.as_ref().map(|s| match s {
                PlanSource::Shared(p) => serde_json::json!({"path": p.display().to_string(), "shared": true}),
                other => serde_json::json!({"path": other.path().display().to_string(), "shared": false}),
            }),
            "devices": devices,
        });
        Ok(v.to_string())
    }
}
