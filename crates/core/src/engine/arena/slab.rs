//! The slab: all blocks of all arenas in one `Vec<Block>` plus a free list of vacant
//! slots (threaded through `next`), addressed by `u32` indices, so steady-state
//! allocation reuses slots and never touches the heap; and the links that keep an
//! arena's blocks in address order. Every operation is O(1); a new slot is pushed only
//! when no vacant one is left (amortised O(1)), and past 4 billion slots taking one
//! fails with [`SlabFull`] (callers take their slots before changing anything, so a
//! full slab leaves everything as it was).

use super::{ArenaId, Arenas, Block, BlockState, Idx, NIL, SlabFull};
use crate::engine::stats::PoolKind;

/// splitmix64 finaliser: treap priorities independent of slot order.
fn mix(i: u64) -> u32 {
    crate::splitmix::mix(i.wrapping_add(crate::splitmix::GAMMA)) as u32
}

impl Arenas {
    pub(super) fn new_block(
        &mut self,
        addr: u64,
        size: u64,
        state: BlockState,
        arena: ArenaId,
    ) -> Result<Idx, SlabFull> {
        let i = if self.vacant != NIL {
            let i = self.vacant;
            self.vacant = self.blocks[i as usize].next;
            i
        } else {
            if self.blocks.len() >= NIL as usize {
                return Err(SlabFull);
            }
            let i = self.blocks.len() as Idx;
            self.blocks.push(Block {
                addr: 0,
                size: 0,
                requested: 0,
                state: BlockState::Unmapped,
                arena: 0,
                kind: PoolKind::Large,
                prev: NIL,
                next: NIL,
                left: NIL,
                right: NIL,
                aleft: NIL,
                aright: NIL,
                prio: mix(i as u64),
                uses: Vec::new(),
                events_left: 0,
                trace_id: u32::MAX,
                tag: 0,
            });
            i
        };
        // The head block of a new arena is made before the arena is in place:
        // `Arenas::add_arena_with` sets its kind.
        let kind = self
            .arenas
            .get(arena as usize)
            .and_then(Option::as_ref)
            .map_or(PoolKind::Large, |x| x.kind);
        let b = &mut self.blocks[i as usize];
        b.addr = addr;
        b.size = size;
        b.requested = 0;
        b.state = state;
        b.arena = arena;
        b.kind = kind;
        b.prev = NIL;
        b.next = NIL;
        b.left = NIL;
        b.right = NIL;
        b.uses.clear();
        b.events_left = 0;
        b.trace_id = u32::MAX;
        b.tag = 0;
        Ok(i)
    }

    pub(super) fn drop_block(&mut self, i: Idx) {
        let vacant = self.vacant;
        let b = &mut self.blocks[i as usize];
        b.next = vacant;
        b.prev = NIL;
        b.size = 0;
        self.vacant = i;
    }

    /// Links `n` right after `at` in address order.
    pub(super) fn link_after(&mut self, at: Idx, n: Idx) {
        let next = self.blocks[at as usize].next;
        self.blocks[n as usize].prev = at;
        self.blocks[n as usize].next = next;
        self.blocks[at as usize].next = n;
        if next != NIL {
            self.blocks[next as usize].prev = n;
        }
    }

    /// Links `n` right before `at` in address order (`n` becomes the arena's head if
    /// `at` was).
    pub(super) fn link_before(&mut self, at: Idx, n: Idx) {
        let prev = self.blocks[at as usize].prev;
        self.blocks[n as usize].prev = prev;
        self.blocks[n as usize].next = at;
        self.blocks[at as usize].prev = n;
        if prev != NIL {
            self.blocks[prev as usize].next = n;
        } else {
            let a = self.blocks[at as usize].arena;
            self.arena_mut(a).head = n;
        }
    }

    /// Unlinks `n` from its arena's address list (its successor becomes the arena's
    /// head if `n` was).
    pub(super) fn unlink(&mut self, n: Idx) {
        let (prev, next) = (self.blocks[n as usize].prev, self.blocks[n as usize].next);
        if next != NIL {
            self.blocks[next as usize].prev = prev;
        }
        if prev != NIL {
            self.blocks[prev as usize].next = next;
        } else {
            debug_assert!(next != NIL, "an arena keeps at least one block");
            let a = self.blocks[n as usize].arena;
            self.arena_mut(a).head = next;
        }
    }
}
