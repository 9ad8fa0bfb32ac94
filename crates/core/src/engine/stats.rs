//! Memory statistics, field for field what `c10::CachingDeviceAllocator::DeviceStats`
//! holds (torch 2.11), so the torch bridge copies them into the C++ struct unchanged and
//! every `torch.cuda.memory_*` API tells the truth.
//!
//! A [`Stat`] has PyTorch's semantics: `increase(n)` adds to `current` and `allocated`
//! and raises `peak`; `decrease(n)` subtracts from `current` and adds to `freed`.
//! `reset_peak` sets `peak = current`; `reset_accumulated` zeroes `allocated` and
//! `freed`. Arrays of stats are indexed by [`StatType`]: aggregate, small pool, large
//! pool. Every update is O(1).
//!
//! What the engine counts (see [`crate::engine`] for the arenas these refer to):
//!
//! | stat | meaning |
//! |---|---|
//! | `allocation`, `allocated_bytes` | blocks handed out and not yet freed by the caller (rounded sizes) |
//! | `active`, `active_bytes` | allocated blocks plus freed blocks still waiting on other streams' events |
//! | `requested_bytes` | the callers' unrounded sizes of active blocks |
//! | `reserved_bytes` | physically mapped bytes |
//! | `segment` | arenas (reserved virtual ranges) |
//! | `inactive_split`, `inactive_split_bytes` | free blocks, and their bytes, that [`crate::engine::Engine::empty_cache`] cannot give back because they share a granule with something in use — PyTorch's "non-releasable memory" |
//! | `num_device_alloc` / `num_device_free` | `map` / `unmap` calls |
//! | `num_sync_all_streams` | event synchronisations before releasing memory |
//! | `num_alloc_retries`, `num_ooms` | allocations retried after releasing cached memory; out-of-memory errors |
//!
//! The engine never refuses to split a block, so PyTorch's `max_split_size` does not
//! apply: `oversize_*` stay 0 and `max_split_size` is -1 (PyTorch's "unlimited",
//! `SIZE_MAX` as `int64_t`).

/// One statistic (`c10::CachingDeviceAllocator::Stat`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

impl Stat {
    /// Adds `amount`: `current` and `allocated` grow, `peak` follows `current`.
    #[inline]
    pub fn increase(&mut self, amount: u64) {
        let a = amount as i64;
        self.current += a;
        self.peak = self.peak.max(self.current);
        self.allocated += a;
    }

    /// Takes away `amount`: `current` shrinks, `freed` grows.
    #[inline]
    pub fn decrease(&mut self, amount: u64) {
        let a = amount as i64;
        self.current -= a;
        self.freed += a;
    }

    /// `allocated = freed = 0`.
    #[inline]
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }

    /// `peak = current`.
    #[inline]
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// Which entry of a [`StatArray`] (`c10::CachingDeviceAllocator::StatType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatType {
    Aggregate = 0,
    SmallPool = 1,
    LargePool = 2,
}

/// Stats for all, small-pool and large-pool blocks, indexed by [`StatType`].
pub type StatArray = [Stat; 3];

/// Which pool a request is served from: small for rounded sizes up to 1 MiB, large
/// above, as in PyTorch (`kSmallSize`). Small and large requests live in separate
/// arenas, so long-lived small tensors do not fragment the space large ones need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PoolKind {
    Small,
    Large,
}

impl PoolKind {
    /// Largest rounded size served from the small pool.
    pub const SMALL_MAX: u64 = 1 << 20;

    /// The pool of a request of `rounded` bytes.
    #[inline]
    pub const fn of(rounded: u64) -> PoolKind {
        if rounded <= Self::SMALL_MAX {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// The pool's entry in a [`StatArray`].
    #[inline]
    pub const fn stat_type(self) -> StatType {
        match self {
            PoolKind::Small => StatType::SmallPool,
            PoolKind::Large => StatType::LargePool,
        }
    }
}

/// `c10::CachingDeviceAllocator::DeviceStats` (torch 2.11), field for field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceStats {
    pub allocation: StatArray,
    pub segment: StatArray,
    pub active: StatArray,
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub oversize_allocations: Stat,
    pub oversize_segments: Stat,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    pub max_split_size: i64,
}

impl Default for DeviceStats {
    fn default() -> Self {
        DeviceStats {
            allocation: Default::default(),
            segment: Default::default(),
            active: Default::default(),
            inactive_split: Default::default(),
            allocated_bytes: Default::default(),
            reserved_bytes: Default::default(),
            active_bytes: Default::default(),
            inactive_split_bytes: Default::default(),
            requested_bytes: Default::default(),
            num_alloc_retries: 0,
            num_ooms: 0,
            oversize_allocations: Stat::default(),
            oversize_segments: Stat::default(),
            num_sync_all_streams: 0,
            num_device_alloc: 0,
            num_device_free: 0,
            max_split_size: -1,
        }
    }
}

/// Increases the aggregate entry and `pool`'s entry of `arr`.
#[inline]
pub(crate) fn increase(arr: &mut StatArray, pool: PoolKind, amount: u64) {
    arr[StatType::Aggregate as usize].increase(amount);
    arr[pool.stat_type() as usize].increase(amount);
}

/// Decreases the aggregate entry and `pool`'s entry of `arr`.
#[inline]
pub(crate) fn decrease(arr: &mut StatArray, pool: PoolKind, amount: u64) {
    arr[StatType::Aggregate as usize].decrease(amount);
    arr[pool.stat_type() as usize].decrease(amount);
}

/// Moves `pool`'s entry of `arr` to `target` with one increase or decrease of the
/// difference (aggregate follows).
#[inline]
pub(crate) fn settle(arr: &mut StatArray, pool: PoolKind, target: u64) {
    let cur = arr[pool.stat_type() as usize].current;
    let target = target as i64;
    if target > cur {
        increase(arr, pool, (target - cur) as u64);
    } else if target < cur {
        decrease(arr, pool, (cur - target) as u64);
    }
}

impl DeviceStats {
    /// The nine per-pool stat arrays (`[all, small, large]` each), in declaration order.
    pub fn arrays(&self) -> [&StatArray; 9] {
        [
            &self.allocation,
            &self.segment,
            &self.active,
            &self.inactive_split,
            &self.allocated_bytes,
            &self.reserved_bytes,
            &self.active_bytes,
            &self.inactive_split_bytes,
            &self.requested_bytes,
        ]
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// Every peak back to its current value (`resetPeakStats`).
    pub fn reset_peak(&mut self) {
        for arr in self.arrays_mut() {
            arr.iter_mut().for_each(Stat::reset_peak);
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// Every accumulated counter back to zero (`resetAccumulatedStats`): `allocated` and
    /// `freed` of every stat, retries, OOMs, syncs, device allocs and frees.
    pub fn reset_accumulated(&mut self) {
        for arr in self.arrays_mut() {
            arr.iter_mut().for_each(Stat::reset_accumulated);
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_follows_pytorch_semantics() {
        let mut s = Stat::default();
        s.increase(10);
        s.increase(5);
        s.decrease(12);
        assert_eq!(
            s,
            Stat {
                current: 3,
                peak: 15,
                allocated: 15,
                freed: 12
            }
        );
        s.reset_peak();
        assert_eq!(s.peak, 3);
        s.reset_accumulated();
        assert_eq!((s.allocated, s.freed, s.current), (0, 0, 3));
    }

    #[test]
    fn arrays_update_aggregate_and_pool() {
        let mut st = DeviceStats::default();
        increase(&mut st.allocated_bytes, PoolKind::Small, 512);
        increase(&mut st.allocated_bytes, PoolKind::Large, 2 << 20);
        decrease(&mut st.allocated_bytes, PoolKind::Small, 512);
        assert_eq!(st.allocated_bytes[0].current, 2 << 20);
        assert_eq!(st.allocated_bytes[0].peak, (2 << 20) + 512);
        assert_eq!(st.allocated_bytes[1].current, 0);
        assert_eq!(st.allocated_bytes[2].current, 2 << 20);
        settle(&mut st.inactive_split_bytes, PoolKind::Large, 100);
        settle(&mut st.inactive_split_bytes, PoolKind::Large, 40);
        assert_eq!(st.inactive_split_bytes[2].current, 40);
        assert_eq!(st.inactive_split_bytes[0].freed, 60);
        st.reset_peak();
        assert_eq!(st.allocated_bytes[0].peak, 2 << 20);
        st.num_device_alloc = 3;
        st.reset_accumulated();
        assert_eq!(st.num_device_alloc, 0);
        assert_eq!(st.allocated_bytes[0].allocated, 0);
        assert_eq!(st.max_split_size, -1);
        assert_eq!(PoolKind::of(1 << 20), PoolKind::Small);
        assert_eq!(PoolKind::of((1 << 20) + 512), PoolKind::Large);
    }
}
