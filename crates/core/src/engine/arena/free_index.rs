//! The indexes of free blocks: the fit treap of every arena (best fit by
//! `(size, addr)`), a placement arena's by-address treap, and the per-pool
//! non-releasable totals (`inactive_split`), all updated together as a free block is
//! indexed, unindexed or resized.
//!
//! **Lazy fit index** (placement arenas: the plan pool). A plan hit is placed by
//! address (`Arenas::alloc_at`, through the by-address treap) and its free coalesces by
//! address, so the fit treap is needed only when something searches the pool by size
//! (a hole for a request the plan does not serve). After a run of fit-treap updates
//! with no size query (`Arenas::lazy_after`: 64 plus 4 per free block), the treap is
//! dropped (marked stale) and updates skip it: a plan hit or its free then costs
//! only the by-address work. The next size query rebuilds it from the by-address
//! treap (one insert per free block, O(n log n); a treap's shape is fixed by its keys
//! and the slots' priorities, so the rebuilt tree is the one eager upkeep would have
//! built, and every answer is the same) and it is kept again from then on, so a
//! miss-heavy run queries a fresh treap and never rebuilds per request; the run of
//! updates that must pass before it is dropped again (at least 4 per free block)
//! bounds the rebuilds' share of the work.
//!
//! Costs: expected O(log n) per index update and per size query on a fresh fit
//! treap; O(1) non-releasable arithmetic (masks: the granule is a power of two).

use super::{Arena, ArenaId, Arenas, BlockState, Idx, NIL, pool_index};

impl Arenas {
    /// The `Free` block of placement arena `a` that contains `addr`, if any. O(log n).
    pub fn free_block_containing(&self, a: ArenaId, addr: u64) -> Option<Idx> {
        let root = self.arena(a)?.free_by_addr?;
        let b = self.addr_floor(root, addr);
        (b != NIL && addr < self.blocks[b as usize].addr + self.blocks[b as usize].size)
            .then_some(b)
    }

    /// Non-releasable bytes of a free block `[addr, addr + size)`: everything outside
    /// the granules that lie wholly inside it.
    #[inline]
    pub fn non_releasable(&self, addr: u64, size: u64) -> u64 {
        // The granule is a power of two (`Arenas::new`): masks, not divisions (this runs
        // twice per alloc/free pair on the hot path).
        let m = self.granule - 1;
        let lo = (addr + m) & !m;
        let hi = (addr + size) & !m;
        size - hi.saturating_sub(lo)
    }

    /// Indexes free block `n` in both treaps of its arena (the by-address one only for
    /// a placement arena).
    pub(super) fn tree_insert(&mut self, n: Idx) {
        let a = self.blocks[n as usize].arena;
        if let Some(t) = self.arena_mut(a).free_by_addr {
            self.blocks[n as usize].aleft = NIL;
            self.blocks[n as usize].aright = NIL;
            let t = self.insert_rec::<true>(t, n);
            let arena = self.arena_mut(a);
            arena.free_by_addr = Some(t);
            arena.free_count += 1;
        }
        self.fit_insert(n);
    }

    /// Takes free block `n` out of both treaps of its arena.
    pub(super) fn tree_remove(&mut self, n: Idx) {
        self.remove_by_addr(n);
        self.fit_remove(n);
    }

    /// Takes free block `n` out of its arena's by-address treap, if it has one.
    pub(super) fn remove_by_addr(&mut self, n: Idx) {
        let (a, addr) = (self.blocks[n as usize].arena, self.blocks[n as usize].addr);
        if let Some(t) = self.arena_mut(a).free_by_addr {
            let t = self.remove_rec::<true>(t, (addr, 0));
            let arena = self.arena_mut(a);
            arena.free_by_addr = Some(t);
            arena.free_count -= 1;
        }
    }

    /// Fit-treap updates a placement arena with `free` free blocks goes through without
    /// a size query before its fit treap is dropped (module docs): at
    /// least four per free block, so that the rebuild at the next query (one insert per
    /// free block) costs at most a quarter of the updates it follows.
    #[inline]
    fn lazy_after(free: u64) -> u64 {
        const BASE: u64 = if cfg!(test) { 4 } else { 64 };
        BASE + 4 * free
    }

    /// Whether `arena`'s fit treap is to be updated now: it is kept (an online arena
    /// always), and for a placement arena, the run of updates without a size query is
    /// not long enough yet to drop it (it is dropped here when it is).
    #[inline]
    fn fit_kept(arena: &mut Arena) -> bool {
        if arena.fit_stale {
            return false;
        }
        if arena.free_by_addr.is_some() {
            arena.fit_quiet += 1;
            if arena.fit_quiet > Self::lazy_after(arena.free_count) {
                arena.fit_stale = true;
                arena.root = NIL;
                return false;
            }
        }
        true
    }

    /// Adds `sign * nr` (`nr` non-releasable bytes of one free block) to pool `k`'s
    /// totals, and notes that they changed.
    #[inline]
    fn count_inactive(&mut self, k: usize, nr: u64, add: bool) {
        if nr == 0 {
            return;
        }
        if add {
            self.inactive_bytes[k] += nr;
            self.inactive_count[k] += 1;
        } else {
            self.inactive_bytes[k] -= nr;
            self.inactive_count[k] -= 1;
        }
        self.inactive_changed = true;
    }

    /// The arena of block `n`.
    #[inline]
    fn arena_of_block(&mut self, n: Idx) -> &mut Arena {
        let a = self.blocks[n as usize].arena;
        self.arena_mut(a)
    }

    /// Makes arena `a`'s fit treap fresh before a size query: a stale one (placement
    /// arenas) is rebuilt from the by-address treap, one insert per free block, and kept
    /// from then on until the next run of updates without a query. O(1) when fresh,
    /// O(n log n) to rebuild.
    fn fit_fresh(&mut self, a: ArenaId) {
        let Some(arena) = self.arenas.get_mut(a as usize).and_then(Option::as_mut) else {
            return;
        };
        arena.fit_quiet = 0;
        if !arena.fit_stale {
            return;
        }
        arena.fit_stale = false;
        let by_addr = arena.free_by_addr.unwrap_or(NIL);
        let root = self.fit_rebuild(NIL, by_addr);
        self.arena_mut(a).root = root;
    }

    /// Inserts every block of the by-address subtree `t` into the fit treap at `root`
    /// (in address order); returns the new root.
    fn fit_rebuild(&mut self, mut root: Idx, t: Idx) -> Idx {
        if t == NIL {
            return root;
        }
        let (l, r) = (
            self.blocks[t as usize].aleft,
            self.blocks[t as usize].aright,
        );
        root = self.fit_rebuild(root, l);
        self.blocks[t as usize].left = NIL;
        self.blocks[t as usize].right = NIL;
        root = self.insert_rec::<false>(root, t);
        self.fit_rebuild(root, r)
    }

    /// Indexes free block `n` in the fit treap only (and counts its non-releasable
    /// bytes). Alone, this is for a block whose by-address entry stays valid: its
    /// address changed, if at all, without passing another free block's.
    fn fit_insert(&mut self, n: Idx) {
        let (addr, size) = (self.blocks[n as usize].addr, self.blocks[n as usize].size);
        debug_assert_eq!(self.blocks[n as usize].state, BlockState::Free);
        let nr = self.non_releasable(addr, size);
        let arena = self.arena_of_block(n);
        let (k, kept, root) = (pool_index(arena.kind), Self::fit_kept(arena), arena.root);
        self.count_inactive(k, nr, true);
        if kept {
            self.blocks[n as usize].left = NIL;
            self.blocks[n as usize].right = NIL;
            let root = self.insert_rec::<false>(root, n);
            self.arena_of_block(n).root = root;
        }
    }

    /// Takes free block `n` out of the fit treap only (the counterpart of
    /// [`Arenas::fit_insert`]); call it before changing the block's size or address.
    pub(super) fn fit_remove(&mut self, n: Idx) {
        let (addr, size) = (self.blocks[n as usize].addr, self.blocks[n as usize].size);
        debug_assert_eq!(self.blocks[n as usize].state, BlockState::Free);
        let nr = self.non_releasable(addr, size);
        let arena = self.arena_of_block(n);
        let (k, kept, root) = (pool_index(arena.kind), Self::fit_kept(arena), arena.root);
        self.count_inactive(k, nr, false);
        if kept {
            let root = self.remove_rec::<false>(root, (size, addr));
            self.arena_of_block(n).root = root;
        }
    }

    /// Moves free block `n` to `[addr, addr + size)` in the fit treap and the
    /// non-releasable totals: [`Arenas::fit_remove`], the change, [`Arenas::fit_insert`],
    /// with one arena look-up and, while the treap is stale, no treap work. Its
    /// by-address entry must stay valid (as for [`Arenas::fit_insert`]).
    pub(super) fn fit_resize(&mut self, n: Idx, addr: u64, size: u64) {
        let (oaddr, osize) = (self.blocks[n as usize].addr, self.blocks[n as usize].size);
        debug_assert_eq!(self.blocks[n as usize].state, BlockState::Free);
        let (onr, nr) = (
            self.non_releasable(oaddr, osize),
            self.non_releasable(addr, size),
        );
        let arena = self.arena_of_block(n);
        let (k, kept) = (pool_index(arena.kind), Self::fit_kept(arena));
        // Two updates of the treap when kept, as remove + insert would count.
        let kept = kept && Self::fit_kept(arena);
        let root = arena.root;
        self.count_inactive(k, onr, false);
        self.count_inactive(k, nr, true);
        if kept {
            let root = self.remove_rec::<false>(root, (osize, oaddr));
            let b = &mut self.blocks[n as usize];
            (b.addr, b.size, b.left, b.right) = (addr, size, NIL, NIL);
            let root = self.insert_rec::<false>(root, n);
            self.arena_of_block(n).root = root;
        } else {
            let b = &mut self.blocks[n as usize];
            (b.addr, b.size) = (addr, size);
        }
    }

    /// The free block of arena `a` with the smallest `(size, addr)` such that
    /// `size >= want`, or [`NIL`].
    pub(super) fn best_fit(&mut self, a: ArenaId, want: u64) -> Idx {
        self.fit_at_least(a, (want, 0))
    }

    /// The free block of arena `a` with the smallest `(size, addr)` key that is at
    /// least `key`, or [`NIL`]. Walking it with `key = (size, addr + 1)` of the last
    /// answer lists the free blocks that fit, best fit first. O(log n) once the fit
    /// treap is fresh (`Arenas::fit_fresh`).
    pub fn fit_at_least(&mut self, a: ArenaId, key: (u64, u64)) -> Idx {
        self.fit_fresh(a);
        let mut t = self.arena(a).map_or(NIL, |x| x.root);
        let mut best = NIL;
        while t != NIL {
            if self.key(t) >= key {
                best = t;
                t = self.blocks[t as usize].left;
            } else {
                t = self.blocks[t as usize].right;
            }
        }
        best
    }
}
