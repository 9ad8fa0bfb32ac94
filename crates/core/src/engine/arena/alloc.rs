//! Serving by best fit, and giving blocks back with coalescing.
//!
//! - **Best fit** (`Arenas::alloc`): the free blocks of an arena sit in an intrusive
//!   treap keyed by `(size, addr)` (module `free_index`); the smallest key with
//!   `size >= request` is the best fit, lowest address on ties (PyTorch's rule). The
//!   block is split and the remainder goes back into the tree. Expected O(log n), no
//!   heap allocation once the slab has grown to the workload's block count.
//! - **Free** (`Arenas::free`): coalesce with free neighbours, insert. Expected O(log n).
//!   Unmapped blocks coalesce the same way (`Arenas::settle_unmapped`, after an unmap or
//!   a refused map), indexed by address in the arena's unmapped map.

use super::{ALIGNMENT, ArenaId, Arenas, BlockState, Idx, NIL, SlabFull};

impl Arenas {
    /// Best fit for `size` bytes (a multiple of [`ALIGNMENT`]) in arena `a`: the block is
    /// split to exactly `size` and marked `Allocated`. `Ok(None)` when no free block is
    /// big enough.
    pub fn alloc(
        &mut self,
        a: ArenaId,
        size: u64,
        requested: u64,
    ) -> Result<Option<Idx>, SlabFull> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGNMENT));
        let b = self.best_fit(a, size);
        if b == NIL {
            return Ok(None);
        }
        let rest = self.blocks[b as usize].size - size;
        // Take the slot for the remainder before touching the tree, so a full slab
        // leaves everything as it was.
        let r = if rest > 0 {
            let addr = self.blocks[b as usize].addr + size;
            Some(self.new_block(addr, rest, BlockState::Free, a)?)
        } else {
            None
        };
        self.tree_remove(b);
        {
            let blk = &mut self.blocks[b as usize];
            blk.size = size;
            blk.state = BlockState::Allocated;
            blk.requested = requested;
        }
        if let Some(r) = r {
            self.link_after(b, r);
            self.tree_insert(r);
        }
        Ok(Some(b))
    }

    /// Returns `Allocated`/`PendingFree` block `i` to the free memory of its arena,
    /// coalescing with free neighbours. Returns the index of the resulting free block.
    pub fn free(&mut self, i: Idx) -> Idx {
        debug_assert!(matches!(
            self.blocks[i as usize].state,
            BlockState::Allocated | BlockState::PendingFree
        ));
        {
            let b = &mut self.blocks[i as usize];
            b.state = BlockState::Free;
            b.requested = 0;
            b.events_left = 0;
            b.trace_id = u32::MAX;
            b.uses.clear();
        }
        self.settle_free(i)
    }

    /// Makes block `i` (just marked `Free`, in no treap) free memory of its arena:
    /// merged with its free neighbours (which are indexed) and indexed. Returns the
    /// resulting free block. A neighbour that absorbs `i` keeps its by-address entry
    /// (its address moves, if at all, to `i`'s, which no other free block passes), so
    /// only the fit treap changes unless `i` has no free neighbour.
    pub(super) fn settle_free(&mut self, i: Idx) -> Idx {
        let prev = self.blocks[i as usize].prev;
        let next = self.blocks[i as usize].next;
        let prev_free = prev != NIL && self.blocks[prev as usize].state == BlockState::Free;
        let next_free = next != NIL && self.blocks[next as usize].state == BlockState::Free;
        let size = self.blocks[i as usize].size;
        if prev_free {
            let (paddr, mut psize) = (
                self.blocks[prev as usize].addr,
                self.blocks[prev as usize].size + size,
            );
            self.unlink(i);
            self.drop_block(i);
            if next_free {
                self.tree_remove(next);
                psize += self.blocks[next as usize].size;
                self.unlink(next);
                self.drop_block(next);
            }
            self.fit_resize(prev, paddr, psize);
            return prev;
        }
        if next_free {
            // `next` grows down over `i`.
            let (addr, nsize) = (
                self.blocks[i as usize].addr,
                self.blocks[next as usize].size + size,
            );
            self.unlink(i);
            self.drop_block(i);
            self.fit_resize(next, addr, nsize);
            return next;
        }
        self.tree_insert(i);
        i
    }

    /// Marks block `i` `Unmapped`, merging it with unmapped neighbours and indexing it.
    pub(super) fn settle_unmapped(&mut self, mut i: Idx) {
        let a = self.blocks[i as usize].arena;
        self.blocks[i as usize].state = BlockState::Unmapped;
        let prev = self.blocks[i as usize].prev;
        if prev != NIL && self.blocks[prev as usize].state == BlockState::Unmapped {
            let size = self.blocks[i as usize].size;
            self.blocks[prev as usize].size += size;
            self.unlink(i);
            self.drop_block(i);
            i = prev;
        }
        let next = self.blocks[i as usize].next;
        if next != NIL && self.blocks[next as usize].state == BlockState::Unmapped {
            let (naddr, nsize) = (
                self.blocks[next as usize].addr,
                self.blocks[next as usize].size,
            );
            self.arena_mut(a).unmapped.remove(&naddr);
            self.blocks[i as usize].size += nsize;
            self.unlink(next);
            self.drop_block(next);
        }
        let addr = self.blocks[i as usize].addr;
        self.arena_mut(a).unmapped.insert(addr, i);
    }
}
