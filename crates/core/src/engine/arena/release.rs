//! Release: the whole mapped units carved out of free memory for unmapping.
//!
//! - **Release** (`Arenas::carve_releasable`): every unit lying wholly inside a free
//!   block is carved out for unmapping (`empty_cache`); what stays is free memory that
//!   shares a unit with a block in use. For online arenas (granule units) that is the
//!   *non-releasable* bytes the engine reports as `inactive_split`; in a placement
//!   arena, a free granule of a unit still partly in use stays mapped too (counted as
//!   releasable there: the plan pool is pinned while it serves). O(blocks · log units).
//! - **Release of holes** (`Arenas::carve_holes`, before a growth past the peak): the
//!   whole units of free blocks other than the free tail (a free block before a gap an
//!   earlier release left counts as a hole), largest first, until enough; never inside
//!   the run the pending growth will map (`Arenas::growth_run`). O(blocks · log blocks).
//!
//! The caller unmaps the carved `Unmapping` blocks with the lock released, then
//! `Arenas::finish_unmapping` makes them unmapped (or free again on failure).

use super::{ArenaId, Arenas, BlockState, Idx, NIL, SlabFull};

impl Arenas {
    /// Carves every granule that lies wholly inside a free block of arena `a` out as an
    /// `Unmapping` block (returned in address order). Free heads and tails that share a
    /// granule with something else stay free.
    #[cfg(test)]
    pub fn carve_releasable(&mut self, a: ArenaId) -> Result<Vec<Idx>, SlabFull> {
        self.carve_releasable_with(a, false)
    }

    /// `Arenas::carve_releasable`, for a pinned arena too when `pinned_too` (its free
    /// granules go; the arena itself stays).
    pub fn carve_releasable_with(
        &mut self,
        a: ArenaId,
        pinned_too: bool,
    ) -> Result<Vec<Idx>, SlabFull> {
        let g = self.granule;
        let mut out = Vec::new();
        let mut b = match self.arena(a) {
            Some(x) if !x.pinned || pinned_too => x.head,
            _ => NIL,
        };
        while b != NIL {
            let blk = &self.blocks[b as usize];
            let next = blk.next;
            if blk.state == BlockState::Free {
                let (addr, size) = (blk.addr, blk.size);
                let (lo, hi) = self.whole_units_in(a, addr.div_ceil(g) * g, (addr + size) / g * g);
                if hi > lo {
                    out.push(self.carve_unmapping(a, b, lo, hi)?);
                }
            }
            b = next;
        }
        Ok(out)
    }

    /// Like [`Arenas::carve_releasable`] for the arenas `of` (those not pinned), but only
    /// from their *holes* (free blocks with anything after them but the arena's unmapped
    /// end: not the free tail that growth extends; a free block before an unmapped gap
    /// that an earlier release left is a hole too) and only until `want` bytes are
    /// carved, largest holes first (fewest blocks cut). `keep` (an arena and an address
    /// range: the run a pending growth will map, `Arenas::growth_run`) is left alone:
    /// releasing it would only make that growth map more. O(blocks · log blocks).
    pub fn carve_holes(
        &mut self,
        of: &[ArenaId],
        want: u64,
        keep: Option<(ArenaId, u64, u64)>,
    ) -> Result<Vec<Idx>, SlabFull> {
        let g = self.granule;
        let mut cands: Vec<(u64, u64, u64, Idx, ArenaId)> = Vec::new();
        for &a in of {
            if self.arena(a).is_none_or(|x| x.pinned) {
                continue;
            }
            for (b, blk) in self.arena_blocks(a) {
                let next = blk.next;
                let hole = next != NIL
                    && (self.blocks[next as usize].state.is_mapped()
                        || self.blocks[next as usize].next != NIL);
                let kept = keep.is_some_and(|(ka, lo, hi)| {
                    ka == a && blk.addr < hi && blk.addr + blk.size > lo
                });
                if blk.state == BlockState::Free && hole && !kept {
                    let (lo, hi) = self.whole_units_in(
                        a,
                        blk.addr.div_ceil(g) * g,
                        (blk.addr + blk.size) / g * g,
                    );
                    if hi > lo {
                        cands.push((hi - lo, lo, hi, b, a));
                    }
                }
            }
        }
        self.carve_largest(cands, want)
    }

    /// Carves candidates `(len, lo, hi, block, arena)` (one per free block) out as
    /// `Unmapping` blocks, largest first (fewest blocks cut), until `want` bytes are
    /// carved. O(c log c).
    fn carve_largest(
        &mut self,
        mut cands: Vec<(u64, u64, u64, Idx, ArenaId)>,
        want: u64,
    ) -> Result<Vec<Idx>, SlabFull> {
        cands.sort_unstable_by(|x, y| y.cmp(x));
        let (mut out, mut got) = (Vec::new(), 0);
        for (_, lo, hi, b, a) in cands {
            if got >= want {
                break;
            }
            got += hi - lo;
            out.push(self.carve_unmapping(a, b, lo, hi)?);
        }
        Ok(out)
    }

    /// The plan pool's share of a release before a new peak (module `engine::release`):
    /// the whole units of the free blocks of arena `a` (pinned or not) that lie at or
    /// above `from`, largest first, until `want` bytes are carved; a free block that
    /// overlaps `keep` (`[lo, hi)`: the range about to be mapped) is left alone, and so is
    /// the free tail's unmapped end (nothing mapped there to give back).
    /// O(blocks · log blocks).
    pub fn carve_pool_holes(
        &mut self,
        a: ArenaId,
        from: u64,
        want: u64,
        keep: (u64, u64),
    ) -> Result<Vec<Idx>, SlabFull> {
        let g = self.granule;
        let mut cands: Vec<(u64, u64, u64, Idx, ArenaId)> = Vec::new();
        for (b, blk) in self.arena_blocks(a) {
            if blk.state != BlockState::Free {
                continue;
            }
            let end = blk.addr + blk.size;
            if end <= from || (blk.addr < keep.1 && end > keep.0) {
                continue;
            }
            let (lo, hi) = self.whole_units_in(a, blk.addr.max(from).div_ceil(g) * g, end / g * g);
            if hi > lo {
                cands.push((hi - lo, lo, hi, b, a));
            }
        }
        self.carve_largest(cands, want)
    }

    /// The end of arena `a`'s highest mapped unit (its base when nothing is mapped).
    pub fn mapped_end(&self, a: ArenaId) -> u64 {
        self.arena(a).map_or(0, |x| {
            x.units.last_key_value().map_or(x.base, |(_, &end)| end)
        })
    }

    /// Turns `[lo, hi)` (whole units) of free block `b` of arena `a` into an `Unmapping`
    /// block (returned); what is left on either side stays free.
    pub(super) fn carve_unmapping(
        &mut self,
        a: ArenaId,
        b: Idx,
        lo: u64,
        hi: u64,
    ) -> Result<Idx, SlabFull> {
        let (addr, size) = (self.blocks[b as usize].addr, self.blocks[b as usize].size);
        // The free head and tail left on either side, as new blocks (both slots taken
        // before anything changes, so a full slab leaves the arena as it was).
        let head = if lo > addr {
            Some(self.new_block(addr, lo - addr, BlockState::Free, a)?)
        } else {
            None
        };
        let tail = if addr + size > hi {
            match self.new_block(hi, addr + size - hi, BlockState::Free, a) {
                Ok(t) => Some(t),
                Err(e) => {
                    head.into_iter().for_each(|h| self.drop_block(h));
                    return Err(e);
                }
            }
        } else {
            None
        };
        self.tree_remove(b);
        // `b` becomes the unmapping middle.
        self.blocks[b as usize].addr = lo;
        self.blocks[b as usize].size = hi - lo;
        self.blocks[b as usize].state = BlockState::Unmapping;
        if let Some(s) = head {
            self.link_before(b, s);
            self.tree_insert(s);
        }
        if let Some(s) = tail {
            self.link_after(b, s);
            self.tree_insert(s);
        }
        Ok(b)
    }

    /// The largest range inside the granule-aligned mapped range `[lo, hi)` that is a
    /// union of whole units of arena `a` (units tile the mapped granules, so only the
    /// unit holding `lo` and the one holding `hi - 1` can stick out). O(log units).
    fn whole_units_in(&self, a: ArenaId, lo: u64, hi: u64) -> (u64, u64) {
        let Some(arena) = self.arena(a) else {
            return (lo, lo);
        };
        if hi <= lo {
            return (lo, lo);
        }
        let lo = match arena.units.range(..=lo).next_back() {
            Some((&s, &e)) if s < lo && e > lo => e,
            _ => lo,
        };
        let hi = match arena.units.range(..hi).next_back() {
            Some((&s, &e)) if e > hi => s,
            _ => hi,
        };
        (lo, hi.max(lo))
    }

    /// Ends the unmapping of `Unmapping` block `i`: on success it becomes unmapped
    /// (coalesced, indexed), on failure free memory again.
    pub fn finish_unmapping(&mut self, i: Idx, unmapped: bool) {
        debug_assert_eq!(self.blocks[i as usize].state, BlockState::Unmapping);
        if unmapped {
            let (a, addr, size) = {
                let b = &self.blocks[i as usize];
                (b.arena, b.addr, b.size)
            };
            let units = &mut self.arena_mut(a).units;
            let gone: Vec<u64> = units.range(addr..addr + size).map(|(&s, _)| s).collect();
            for s in gone {
                units.remove(&s);
            }
            self.settle_unmapped(i);
        } else {
            self.blocks[i as usize].state = BlockState::Free;
            self.settle_free(i);
        }
    }
}
