//! The pointer map: address → block for every `Allocated` or `PendingFree` block.
//!
//! One insert (`malloc`) and one remove (`free`) per pair, so this is on the hot path.
//! A general-purpose hash map (hashbrown with FxHash) spends about 13 ns per insert +
//! remove there; this table, specialised to its keys, about 1 ns (measured on the 2-core
//! development box, both behind the engine's mutex).
//!
//! # Layout and algorithm
//!
//! Open addressing with linear probing over a power-of-two array of `(addr, block)`
//! slots. Keys are block addresses, multiples of 512 B, so [`EMPTY`] (`u64::MAX`, not a
//! multiple of 512) marks a vacant slot and the low 9 bits carry no information: the
//! home slot is the top bits of `(addr >> 9) · φ·2⁶⁴` (Fibonacci hashing). Removal
//! shifts the following entries of the probe run back (no tombstones), so probe runs
//! stay as short as the load allows; the load is kept at most 1/2 by doubling.
//!
//! Costs: expected O(1) per operation; a growth re-inserts everything (amortised O(1))
//! and is the only allocation, so a workload that has seen its peak number of live
//! blocks never allocates here again.

use super::arena::{ALIGNMENT, Idx};

/// A vacant slot's key (no block address: not a multiple of [`ALIGNMENT`]).
const EMPTY: u64 = u64::MAX;

/// Slots of a new, empty table.
const MIN_SLOTS: usize = 16;

/// Address → block index, for live blocks (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct LiveMap {
    slots: Vec<(u64, Idx)>,
    /// `slots.len() - 1`.
    mask: usize,
    /// `64 - log2(slots.len())`: the home slot is the hash's top bits.
    shift: u32,
    len: usize,
}

impl Default for LiveMap {
    fn default() -> Self {
        LiveMap::with_slots(MIN_SLOTS)
    }
}

impl LiveMap {
    fn with_slots(n: usize) -> LiveMap {
        debug_assert!(n.is_power_of_two() && n >= 2);
        LiveMap {
            slots: vec![(EMPTY, 0); n],
            mask: n - 1,
            shift: 64 - n.trailing_zeros(),
            len: 0,
        }
    }

    /// The home slot of `addr`.
    #[inline]
    fn home(&self, addr: u64) -> usize {
        ((addr / ALIGNMENT).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Number of entries.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// The slot holding `addr`, if any (for [`LiveMap::block_at`] and
    /// [`LiveMap::remove_slot`]: one probe for a look-up and a removal).
    #[inline]
    pub fn find(&self, addr: u64) -> Option<usize> {
        // A caller's pointer may be anything; only a multiple of 512 can be a block's
        // (and `EMPTY` is not one, so it never matches a vacant slot).
        if !addr.is_multiple_of(ALIGNMENT) {
            return None;
        }
        let mut i = self.home(addr);
        loop {
            let k = self.slots[i].0;
            if k == addr {
                return Some(i);
            }
            if k == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The block at `addr`, if any.
    #[inline]
    pub fn get(&self, addr: u64) -> Option<Idx> {
        self.find(addr).map(|i| self.slots[i].1)
    }

    /// Maps `addr` (a multiple of 512) to `block`, replacing any earlier entry.
    #[inline]
    pub fn insert(&mut self, addr: u64, block: Idx) {
        debug_assert!(addr.is_multiple_of(ALIGNMENT));
        if 2 * (self.len + 1) > self.slots.len() {
            self.grow();
        }
        let mut i = self.home(addr);
        loop {
            let k = self.slots[i].0;
            if k == EMPTY {
                self.slots[i] = (addr, block);
                self.len += 1;
                return;
            }
            if k == addr {
                self.slots[i].1 = block;
                return;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Doubles the table (the only allocation).
    #[cold]
    fn grow(&mut self) {
        let old = std::mem::replace(self, LiveMap::with_slots(2 * self.slots.len()));
        for (addr, block) in old.slots {
            if addr != EMPTY {
                self.insert(addr, block);
            }
        }
    }

    /// The block in occupied slot `i` (from [`LiveMap::find`]).
    #[inline]
    pub fn block_at(&self, i: usize) -> Idx {
        self.slots[i].1
    }

    /// Takes `addr`'s entry out, returning its block.
    #[inline]
    pub fn remove(&mut self, addr: u64) -> Option<Idx> {
        let i = self.find(addr)?;
        Some(self.remove_slot(i))
    }

    /// Empties slot `i` (occupied, from [`LiveMap::find`] with no change since), moving later entries of its probe run back into the
    /// gap where their home allows (backward-shift deletion), and returns its block.
    pub fn remove_slot(&mut self, mut i: usize) -> Idx {
        let block = self.slots[i].1;
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let (k, _) = self.slots[j];
            if k == EMPTY {
                break;
            }
            // The entry at `j` may fill the gap at `i` unless its home lies cyclically
            // in `(i, j]` (then it would sit before its home).
            let home = self.home(k);
            if (j.wrapping_sub(home) & self.mask) >= (j.wrapping_sub(i) & self.mask) {
                self.slots[i] = self.slots[j];
                i = j;
            }
        }
        self.slots[i] = (EMPTY, 0);
        self.len -= 1;
        block
    }

    /// Every `(addr, block)` entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, Idx)> + '_ {
        self.slots.iter().copied().filter(|&(k, _)| k != EMPTY)
    }

    /// Every block, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = Idx> + '_ {
        self.iter().map(|(_, b)| b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn insert_get_remove_grow() {
        let mut m = LiveMap::default();
        for k in 0..1000u64 {
            m.insert(k * 512, k as Idx);
        }
        assert_eq!(m.len(), 1000);
        assert!(m.slots.len() >= 2000);
        for k in 0..1000u64 {
            assert_eq!(m.get(k * 512), Some(k as Idx));
        }
        assert_eq!(m.get(1000 * 512), None);
        m.insert(512, 7);
        assert_eq!((m.get(512), m.len()), (Some(7), 1000));
        for k in (0..1000u64).step_by(2) {
            assert!(m.remove(k * 512).is_some());
        }
        assert_eq!(m.remove(0), None);
        assert_eq!(m.len(), 500);
        // Pointers no block can have (a caller's free of garbage): never found, even
        // the vacant slots' marker.
        for bad in [EMPTY, 512 + 1, 511, EMPTY - 511] {
            assert_eq!((m.get(bad), m.find(bad), m.remove(bad)), (None, None, None));
        }
        assert_eq!(m.len(), 500);
        let mut got: Vec<u64> = m.iter().map(|(a, _)| a / 512).collect();
        got.sort_unstable();
        assert_eq!(got, (1..1000).step_by(2).collect::<Vec<u64>>());
    }

    proptest! {
        /// Agrees with a `BTreeMap` on every operation, with keys crowded into a few
        /// home slots (long probe runs, wrap-around, shifts on removal).
        #[test]
        fn matches_a_btreemap(
            ops in proptest::collection::vec((0u8..3, 0u64..64, any::<u32>()), 1..400),
            spread in prop_oneof![Just(1u64), Just(1 << 20), Just(0x9E37_79B9 << 9)],
        ) {
            let mut m = LiveMap::default();
            let mut model: BTreeMap<u64, Idx> = BTreeMap::new();
            for (op, k, v) in ops {
                let addr = (k * spread * 512) % (1 << 62);
                let addr = addr - addr % 512;
                match op {
                    0 => {
                        m.insert(addr, v);
                        model.insert(addr, v);
                    }
                    1 => prop_assert_eq!(m.remove(addr), model.remove(&addr)),
                    _ => prop_assert_eq!(m.get(addr), model.get(&addr).copied()),
                }
                // Any other word, aligned or not: as the model says.
                let probe = addr.wrapping_add(u64::from(v % 1024));
                prop_assert_eq!(m.get(probe), model.get(&probe).copied());
                prop_assert_eq!(m.get(EMPTY - probe % 1024), None);
                prop_assert_eq!(m.len(), model.len());
                prop_assert!(2 * m.len() <= m.slots.len());
                for (&a, &b) in &model {
                    prop_assert_eq!(m.get(a), Some(b));
                }
                let mut all: Vec<(u64, Idx)> = m.iter().collect();
                all.sort_unstable();
                prop_assert_eq!(all, model.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>());
            }
        }
    }
}
