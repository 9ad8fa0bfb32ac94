//! Blocks at exact addresses: `Arenas::alloc_at` places a planned block in a placement
//! arena (the plan pool) through its by-address treap, O(log n); `Arenas::claim`
//! re-creates a checkpointed block in any arena by walking its address list from a
//! hint, O(blocks walked + log n). Since free blocks are always coalesced, "the range
//! lies inside one free block" is exactly "nothing live, pending, in flight or
//! unmapped is there": the occupancy check behind invariant 1 of plan serving.
//! `Arenas::placeable` tells a free range from one that must be mapped first. A block
//! cut out of a free one keeps the rest free on either side, and the free block keeps
//! its by-address entry whenever it only shrinks (`Arenas::take_range`).

use super::{ALIGNMENT, ArenaId, Arenas, BlockState, Idx, NIL, Placeable, SlabFull};

impl Arenas {
    /// Whether `[addr, addr + size)` in placement arena `a` can take a block: wholly
    /// free, free and unmapped (some granules must be mapped first:
    /// `Arenas::carve_range`), or not (something allocated, pending, being mapped or
    /// unmapped there, or outside the arena). O(log n + blocks in the range).
    pub fn placeable(&self, a: ArenaId, addr: u64, size: u64) -> Placeable {
        let Some(arena) = self.arena(a) else {
            return Placeable::Occupied;
        };
        let Some(by_addr) = arena.free_by_addr else {
            return Placeable::Occupied;
        };
        let Some(end) = addr.checked_add(size) else {
            return Placeable::Occupied;
        };
        if addr < arena.base || end > arena.base + arena.len {
            return Placeable::Occupied;
        }
        let contains = |b: Idx| {
            let blk = &self.blocks[b as usize];
            blk.addr <= addr && addr < blk.addr + blk.size
        };
        let first = Some(self.addr_floor(by_addr, addr))
            .filter(|&b| b != NIL && contains(b))
            .or_else(|| {
                arena
                    .unmapped
                    .range(..=addr)
                    .next_back()
                    .map(|(_, &b)| b)
                    .filter(|&b| contains(b))
            });
        let Some(mut b) = first else {
            return Placeable::Occupied;
        };
        let mut unmapped = false;
        loop {
            let blk = &self.blocks[b as usize];
            match blk.state {
                BlockState::Free => {}
                BlockState::Unmapped => unmapped = true,
                _ => return Placeable::Occupied,
            }
            if blk.addr + blk.size >= end {
                break;
            }
            b = blk.next;
            if b == NIL {
                return Placeable::Occupied;
            }
        }
        if unmapped {
            Placeable::NeedsMapping
        } else {
            Placeable::Free
        }
    }

    /// Places a block of `size` bytes at exactly `addr` in placement arena `a`, if the
    /// whole range `[addr, addr + size)` is free. Since free neighbours are always
    /// coalesced, "inside one free block" is exactly "nothing allocated, pending, being
    /// mapped or unmapped, or unmapped there": this is the check that a planned offset is
    /// unoccupied. `Ok(None)` when it is not (or `a` is not a placement arena).
    /// O(log n).
    #[inline]
    pub fn alloc_at(
        &mut self,
        a: ArenaId,
        addr: u64,
        size: u64,
        requested: u64,
    ) -> Result<Option<Idx>, SlabFull> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGNMENT) && addr.is_multiple_of(ALIGNMENT));
        let Some(root) = self.arena(a).and_then(|x| x.free_by_addr) else {
            return Ok(None);
        };
        let b = self.addr_floor(root, addr);
        if b == NIL {
            return Ok(None);
        }
        let (baddr, bsize) = (self.blocks[b as usize].addr, self.blocks[b as usize].size);
        let Some(end) = addr.checked_add(size) else {
            return Ok(None);
        };
        if end > baddr + bsize {
            return Ok(None);
        }
        self.take_range(b, addr, size, requested).map(Some)
    }

    /// Cuts `[addr, addr + size)` out of free block `b` (which holds it) as an
    /// `Allocated` block of `requested` bytes; what is left on either side stays free.
    /// O(log n).
    #[inline]
    fn take_range(
        &mut self,
        b: Idx,
        addr: u64,
        size: u64,
        requested: u64,
    ) -> Result<Idx, SlabFull> {
        let a = self.blocks[b as usize].arena;
        let (baddr, bsize) = (self.blocks[b as usize].addr, self.blocks[b as usize].size);
        let end = addr + size;
        debug_assert!(
            self.blocks[b as usize].state == BlockState::Free
                && baddr <= addr
                && end <= baddr + bsize
        );
        let (head, tail) = (addr - baddr, baddr + bsize - end);
        // Slots first, so a full slab changes nothing.
        let x = if head > 0 {
            Some(self.new_block(addr, size, BlockState::Allocated, a)?)
        } else {
            None
        };
        let t = if tail > 0 {
            match self.new_block(end, tail, BlockState::Free, a) {
                Ok(t) => Some(t),
                Err(e) => {
                    if let Some(x) = x {
                        self.drop_block(x);
                    }
                    return Err(e);
                }
            }
        } else {
            None
        };
        // A free block keeps its by-address entry when it only shrinks, or moves its
        // start up without passing another free block's (none lies inside it): only
        // its fit key changes. That saves two of the by-address treap's updates on a
        // plan hit.
        let x = match x {
            // `b` stays the free head `[baddr, addr)`; the block goes right after it.
            Some(x) => {
                self.fit_resize(b, baddr, head);
                self.link_after(b, x);
                x
            }
            // `b` becomes the free tail; a new block takes `[addr, end)` before it.
            None if tail > 0 => {
                let Some(t) = t else {
                    unreachable!("a slot is taken for every tail")
                };
                // The spare slot is the allocated block; `b` keeps its place.
                {
                    let blk = &mut self.blocks[t as usize];
                    blk.addr = addr;
                    blk.size = size;
                    blk.state = BlockState::Allocated;
                    blk.requested = requested;
                }
                self.link_before(b, t);
                self.fit_resize(b, end, tail);
                return Ok(t);
            }
            None => {
                self.fit_remove(b);
                self.remove_by_addr(b);
                self.blocks[b as usize].size = size;
                self.blocks[b as usize].state = BlockState::Allocated;
                b
            }
        };
        self.blocks[x as usize].requested = requested;
        if let Some(t) = t {
            self.link_after(x, t);
            self.tree_insert(t);
        }
        Ok(x)
    }

    /// Claims `[addr, addr + size)` of arena `a` (any arena, placement or not) as an
    /// `Allocated` block of `requested` bytes at exactly that address, if the whole range
    /// lies inside one `Free` block — i.e. nothing live, pending, in flight or unmapped
    /// is there (free neighbours are always coalesced). Used to re-create checkpointed
    /// blocks. The block holding `addr` is found by walking the arena in address order
    /// from `from` (a block of `a` that starts at or below `addr`, such as the previous
    /// claim; [`NIL`] or anything else starts at the arena's head), so a series of claims
    /// in ascending address order walks each arena once: O(blocks walked + log n).
    /// `Ok(None)` when the range is not wholly free and mapped.
    pub fn claim(
        &mut self,
        a: ArenaId,
        addr: u64,
        size: u64,
        requested: u64,
        from: Idx,
    ) -> Result<Option<Idx>, SlabFull> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGNMENT) && addr.is_multiple_of(ALIGNMENT));
        let Some(arena) = self.arena(a) else {
            return Ok(None);
        };
        let Some(end) = addr.checked_add(size) else {
            return Ok(None);
        };
        if addr < arena.base || end > arena.base + arena.len {
            return Ok(None);
        }
        // A vacant slot has size 0; a live one of `a` is in `a`'s address list.
        let start = match self.blocks.get(from as usize) {
            Some(f) if f.arena == a && f.size > 0 && f.addr <= addr => from,
            _ => arena.head,
        };
        let mut b = start;
        while b != NIL {
            let blk = &self.blocks[b as usize];
            if blk.addr + blk.size > addr {
                break;
            }
            b = blk.next;
        }
        if b == NIL {
            return Ok(None);
        }
        let blk = &self.blocks[b as usize];
        if blk.state != BlockState::Free || blk.addr > addr || end > blk.addr + blk.size {
            return Ok(None);
        }
        self.take_range(b, addr, size, requested).map(Some)
    }
}
