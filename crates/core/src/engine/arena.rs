//! Growable virtual-memory arenas with best-fit allocation and coalescing.
//!
//! # Layout
//!
//! An **arena** is one reserved virtual range `[base, base + len)` (granule aligned),
//! cut into **blocks** that tile it exactly, in address order, through `prev`/`next`
//! links. A block is in one of the [`BlockState`]s:
//!
//! ```text
//!  base                                                              base + len
//!  | Allocated | Free | Allocated | PendingFree | Free |      Unmapped        |
//!  |<------------------------- mapped ------------------->|                   |
//! ```
//!
//! `Mapping` and `Unmapping` blocks are owned by a thread that is calling the device
//! with the engine's lock released; nobody else touches them.
//!
//! All blocks of all arenas live in one slab (`Vec<Block>` plus a free list of vacant
//! slots), addressed by `u32` indices, so steady-state allocation reuses slots and never
//! touches the heap.
//!
//! # Invariants (checked by `Heap::check`)
//!
//! 1. The blocks of an arena tile it: each block starts where its predecessor ends
//!    (and names the arena and its pool).
//! 2. No two `Free` blocks and no two `Unmapped` blocks are adjacent (coalescing).
//! 3. Every boundary between mapped memory (`Free`, `Allocated`, `PendingFree`,
//!    `Unmapping`) and unmapped memory (`Unmapped`, `Mapping`) is granule aligned.
//! 4. The arena's unmapped index holds exactly its `Unmapped` blocks; a placement
//!    arena's by-address treap (and its free-block count) exactly its `Free` blocks.
//!    The fit tree holds exactly the `Free` blocks whenever it is *fresh*: always in an
//!    online arena; in a placement arena, except while it is marked stale (lazy fit
//!    index below), and a size query (`Heap::fit_at_least`, `Heap::alloc`) makes it
//!    fresh first. The non-releasable totals count every `Free` block either way.
//! 5. Block addresses and sizes are multiples of the 512-B alignment.
//! 6. The arena's mapped *units* tile its mapped memory exactly. A unit is the range of
//!    one device `map` call, which is only ever unmapped whole (on CUDA, one physical
//!    allocation): a whole mapped block in a placement arena (the plan pool), one
//!    granule in an online arena (`Heap::whole_unit_mapping`).
//!
//! # Algorithms and costs (n = free blocks in the arena)
//!
//! - **Best fit** (`Heap::alloc`): the free blocks of an arena sit in an intrusive
//!   treap keyed by `(size, addr)`; the smallest key with `size >= request` is the best
//!   fit, lowest address on ties (PyTorch's rule). The block is split and the remainder
//!   goes back into the tree. Expected O(log n), no heap allocation once the slab has
//!   grown to the workload's block count.
//! - **Free** (`Heap::free`): coalesce with free neighbours, insert. Expected O(log n).
//! - **Lazy fit index** (placement arenas: the plan pool). A plan hit is placed by
//!   address (`Heap::alloc_at`, through the by-address treap) and its free coalesces by
//!   address, so the fit treap is needed only when something searches the pool by size
//!   (a hole for a request the plan does not serve). After a run of fit-treap updates
//!   with no size query (`Heap::lazy_after`: 64 plus 4 per free block), the treap is
//!   dropped (marked stale) and updates skip it: a plan hit or its free then costs
//!   only the by-address work. The next size query rebuilds it from the by-address
//!   treap (one insert per free block, O(n log n); a treap's shape is fixed by its keys
//!   and the slots' priorities, so the rebuilt tree is the one eager upkeep would have
//!   built, and every answer is the same) and it is kept again from then on, so a
//!   miss-heavy run queries a fresh treap and never rebuilds per request; the run of
//!   updates that must pass before it is dropped again (at least 4 per free block)
//!   bounds the rebuilds' share of the work.
//! - **Growth** (`Heap::carve_growth`): when nothing fits, take the run of free and
//!   unmapped space big enough for the request that needs the fewest bytes mapped,
//!   lowest address on ties, and carve out the granules that must be mapped — only the
//!   ones the request needs, not a fixed segment size. Until something is released the
//!   only run is the free tail plus the unmapped end (PyTorch's `find_expandable_block`);
//!   after a release, a gap it left in the middle of the arena (with the free blocks
//!   around it) is re-mapped when it is the cheaper place, instead of the tail growing.
//!   O(unmapped blocks · run length). The caller maps them with the lock released,
//!   then `Heap::finish_mapping` turns them into free memory.
//! - **Release** (`Heap::carve_releasable`): every unit lying wholly inside a free
//!   block is carved out for unmapping (`empty_cache`); what stays is free memory that
//!   shares a unit with a block in use. For online arenas (granule units) that is the
//!   *non-releasable* bytes the engine reports as `inactive_split`; in a placement
//!   arena, a free granule of a unit still partly in use stays mapped too (counted as
//!   releasable there: the plan pool is pinned while it serves). O(blocks · log units).
//! - **Release of holes** (`Heap::carve_holes`, before a growth past the peak): the
//!   whole units of free blocks other than the free tail (a free block before a gap an
//!   earlier release left counts as a hole), largest first, until enough; never inside
//!   the run the pending growth will map (`Heap::growth_run`). O(blocks · log blocks).
//!
//! Fragmentation is therefore bounded as in PyTorch's expandable segments (same best
//! fit, same growth rule until a release leaves gaps), with a finer mapping unit: the granule (2 MiB) instead of the
//! 20 MiB page expandable segments map for the large pool.

use std::collections::BTreeMap;

// Pause / resume of whole mapped units (`Engine::pause`): a child module, so that it
// reaches the slab and unit internals without widening their visibility.
mod pause;
pub(crate) use self::pause::{Group as UnitGroup, PausedGroup};

use crate::engine::stats::PoolKind;
use crate::engine::streams::StreamUse;
use crate::units::StreamId;

/// Slab index of a block.
pub(crate) type Idx = u32;
/// The null index.
pub(crate) const NIL: Idx = u32::MAX;

/// Index of an arena in [`Heap`].
pub(crate) type ArenaId = u32;

/// Every block address and size is a multiple of this (PyTorch's `kMinBlockSize`).
pub const ALIGNMENT: u64 = 512;

/// What a block of an arena is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// Mapped and available.
    Free,
    /// Handed out to a caller.
    Allocated,
    /// Freed by the caller, waiting for other streams to pass their events.
    PendingFree,
    /// Reserved address space with no physical memory.
    Unmapped,
    /// Being mapped by a thread that released the lock.
    Mapping,
    /// Being unmapped by a thread that released the lock.
    Unmapping,
    /// Reserved address space whose physical memory a pause gave back
    /// ([`crate::engine::Engine::pause`]): a live block (still allocated, contents kept
    /// on the host) or the free part of a paused unit. Never handed out, merged or
    /// released until resumed.
    Paused,
}

impl BlockState {
    /// Whether physical memory backs the block (for reserved-bytes accounting).
    #[inline]
    pub fn is_mapped(self) -> bool {
        !matches!(
            self,
            BlockState::Unmapped | BlockState::Mapping | BlockState::Paused
        )
    }
}

/// One block (a slab slot).
#[derive(Debug)]
pub(crate) struct Block {
    pub addr: u64,
    pub size: u64,
    /// The caller's unrounded size while `Allocated` / `PendingFree`.
    pub requested: u64,
    pub state: BlockState,
    pub arena: ArenaId,
    /// The pool of the block's arena (a copy of `Arena::kind`: one load fewer on the
    /// hot path's stats updates).
    pub kind: PoolKind,
    /// Address-order neighbours (`next` doubles as the vacant-slot list link).
    pub prev: Idx,
    pub next: Idx,
    left: Idx,
    right: Idx,
    /// Children in the placement arena's by-address treap of `Free` blocks (same
    /// priorities as the fit treap).
    aleft: Idx,
    aright: Idx,
    prio: u32,
    /// Streams other than the allocating one that use the block (`record_stream`),
    /// with the event recorded for each at free time. Capacity is kept across reuse.
    pub uses: Vec<StreamUse>,
    /// Events still outstanding while `PendingFree`.
    pub events_left: u32,
    /// The block's allocation id in the trace being recorded, or `u32::MAX`.
    pub trace_id: u32,
    /// The pause tag of the allocation (`Engine::set_tag`; 0: untagged). Meaningful
    /// only while the block is live or paused.
    pub tag: u32,
}

/// One arena: a reserved virtual range for one (stream, pool).
#[derive(Debug)]
pub(crate) struct Arena {
    pub stream: StreamId,
    pub kind: PoolKind,
    pub base: u64,
    pub len: u64,
    head: Idx,
    /// Root of the fit treap of `Free` blocks; meaningless while `fit_stale`.
    root: Idx,
    /// Placement arenas only: the fit treap is not kept (module docs, lazy fit index);
    /// the next size query rebuilds it. Always `false` for an online arena.
    fit_stale: bool,
    /// Placement arenas only: fit-treap updates since the last size query. Past
    /// `Heap::lazy_after`, the treap is dropped (`fit_stale`).
    fit_quiet: u64,
    /// Placement arenas only: the number of `Free` blocks (the by-address treap's).
    free_count: u64,
    /// `Unmapped` blocks by address.
    unmapped: BTreeMap<u64, Idx>,
    /// Root of the treap of `Free` blocks by address, kept only for placement arenas
    /// (see `Heap::add_placement_arena`): `Some(NIL)` when empty. A treap threaded
    /// through the slab rather than a `BTreeMap`, so that keeping it costs no heap
    /// allocation and about half the time on the plan-hit path.
    free_by_addr: Option<Idx>,
    /// Never unmapped or released by `Heap::carve_releasable` / `Heap::remove_arena`.
    pub pinned: bool,
    /// start -> end of each mapped unit: the range of one device `map` call, which is
    /// only ever unmapped whole (see the module docs, release).
    units: BTreeMap<u64, u64>,
}

/// What placing a block at a given range of a placement arena needs
/// (`Heap::placeable`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placeable {
    /// The range lies in one free block.
    Free,
    /// The range is free, but some of its granules are not mapped yet.
    NeedsMapping,
    /// Something else is there.
    Occupied,
}

/// Why `Heap::carve_growth` could not carve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GrowthFailure {
    /// No run of free + unmapped space in the arena is big enough.
    NoRoom,
    /// A run exists but mapping it needs `needed` bytes, more than the budget.
    OverBudget { needed: u64 },
}

/// The slab has run out of `u32` indices (4 billion blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlabFull;

/// Per-pool totals computed by `Heap::check` from the blocks themselves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub arenas: u64,
    pub mapped: u64,
    pub allocated: u64,
    pub allocated_count: u64,
    pub active: u64,
    pub active_count: u64,
    pub requested: u64,
    pub inactive: u64,
    pub inactive_count: u64,
}

/// All arenas of an engine and the slab their blocks live in.
#[derive(Debug)]
pub(crate) struct Heap {
    granule: u64,
    blocks: Vec<Block>,
    vacant: Idx,
    arenas: Vec<Option<Arena>>,
    /// Non-releasable free bytes and the number of free blocks holding some, per pool
    /// (index 0 small, 1 large); maintained on every fit-tree insert and remove.
    inactive_bytes: [u64; 2],
    inactive_count: [u64; 2],
    /// The non-releasable totals changed since `Heap::take_inactive_changed`.
    inactive_changed: bool,
    /// Placement arenas map granule by granule too (`Heap::set_fine_units`).
    fine_units: bool,
}

/// splitmix64 finaliser: treap priorities independent of slot order.
fn mix(i: u64) -> u32 {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as u32
}

#[inline]
fn pool_index(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

impl Heap {
    /// An empty heap whose mapping unit is `granule` (a power of two ≥ [`ALIGNMENT`]).
    pub fn new(granule: u64) -> Heap {
        debug_assert!(granule.is_power_of_two() && granule >= ALIGNMENT);
        Heap {
            granule,
            blocks: Vec::new(),
            vacant: NIL,
            arenas: Vec::new(),
            inactive_bytes: [0; 2],
            inactive_count: [0; 2],
            inactive_changed: false,
            fine_units: false,
        }
    }

    /// Under a memory limit the plan pool maps granule by granule as online arenas do
    /// (`fine`), so that once its plan is given up every wholly free granule can go
    /// back; without one it maps whole first-touched ranges (fewer device calls, one
    /// physical allocation per range). Applies to mappings made from now on.
    pub fn set_fine_units(&mut self, fine: bool) {
        self.fine_units = fine;
    }

    #[inline]
    pub fn block(&self, i: Idx) -> &Block {
        &self.blocks[i as usize]
    }

    #[inline]
    pub fn block_mut(&mut self, i: Idx) -> &mut Block {
        &mut self.blocks[i as usize]
    }

    #[inline]
    pub fn arena(&self, a: ArenaId) -> Option<&Arena> {
        self.arenas.get(a as usize).and_then(Option::as_ref)
    }

    #[inline]
    /// Lets a placement arena's free granules be released like an online arena's (a
    /// plan that is no longer served). Its by-address index stays.
    pub fn unpin(&mut self, a: ArenaId) {
        if self.arena(a).is_some() {
            self.arena_mut(a).pinned = false;
        }
    }

    fn arena_mut(&mut self, a: ArenaId) -> &mut Arena {
        match self.arenas.get_mut(a as usize).and_then(Option::as_mut) {
            Some(arena) => arena,
            None => unreachable!("arena {a} used after removal"),
        }
    }

    /// Ids of the live arenas.
    pub fn arena_ids(&self) -> impl Iterator<Item = ArenaId> + '_ {
        self.arenas
            .iter()
            .enumerate()
            .filter(|(_, a)| a.is_some())
            .map(|(i, _)| i as ArenaId)
    }

    /// The blocks of arena `a` in address order.
    pub fn arena_blocks(&self, a: ArenaId) -> ArenaBlocks<'_> {
        ArenaBlocks {
            heap: self,
            at: self.arena(a).map_or(NIL, |x| x.head),
        }
    }

    /// Non-releasable free bytes of `kind` (the engine's `inactive_split_bytes`).
    pub fn inactive_bytes(&self, kind: PoolKind) -> u64 {
        self.inactive_bytes[pool_index(kind)]
    }

    /// Free blocks of `kind` holding non-releasable bytes (`inactive_split`).
    pub fn inactive_count(&self, kind: PoolKind) -> u64 {
        self.inactive_count[pool_index(kind)]
    }

    /// Whether the non-releasable totals changed since the last call (they change only
    /// as free blocks are indexed, unindexed or resized), and forgets it.
    #[inline]
    pub fn take_inactive_changed(&mut self) -> bool {
        std::mem::take(&mut self.inactive_changed)
    }

    // ---------------------------------------------------------------- slab

    fn new_block(
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
        // `Heap::add_arena_with` sets its kind.
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

    fn drop_block(&mut self, i: Idx) {
        let vacant = self.vacant;
        let b = &mut self.blocks[i as usize];
        b.next = vacant;
        b.prev = NIL;
        b.size = 0;
        self.vacant = i;
    }

    /// Links `n` right after `at` in address order.
    fn link_after(&mut self, at: Idx, n: Idx) {
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
    fn link_before(&mut self, at: Idx, n: Idx) {
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
    fn unlink(&mut self, n: Idx) {
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

    // ---------------------------------------------------------------- arenas

    /// Adds an arena over the reserved range `[base, base + len)`, all unmapped.
    pub fn add_arena(
        &mut self,
        stream: StreamId,
        kind: PoolKind,
        base: u64,
        len: u64,
    ) -> Result<ArenaId, SlabFull> {
        self.add_arena_with(stream, kind, base, len, false)
    }

    /// Adds a **placement** arena over `[base, base + len)`, all unmapped: blocks are
    /// placed at given addresses (`Heap::alloc_at`) rather than by best fit, and the
    /// arena is pinned (never unmapped by a release). Its free blocks are also indexed
    /// by address, O(log n) per insert and remove.
    pub fn add_placement_arena(
        &mut self,
        stream: StreamId,
        kind: PoolKind,
        base: u64,
        len: u64,
    ) -> Result<ArenaId, SlabFull> {
        self.add_arena_with(stream, kind, base, len, true)
    }

    fn add_arena_with(
        &mut self,
        stream: StreamId,
        kind: PoolKind,
        base: u64,
        len: u64,
        placement: bool,
    ) -> Result<ArenaId, SlabFull> {
        let id = match self.arenas.iter().position(Option::is_none) {
            Some(i) => i as ArenaId,
            None => {
                self.arenas.push(None);
                (self.arenas.len() - 1) as ArenaId
            }
        };
        let head = self.new_block(base, len, BlockState::Unmapped, id)?;
        self.blocks[head as usize].kind = kind;
        let mut unmapped = BTreeMap::new();
        unmapped.insert(base, head);
        self.arenas[id as usize] = Some(Arena {
            stream,
            kind,
            base,
            len,
            head,
            root: NIL,
            fit_stale: placement,
            fit_quiet: 0,
            free_count: 0,
            unmapped,
            free_by_addr: placement.then_some(NIL),
            pinned: placement,
            units: BTreeMap::new(),
        });
        Ok(id)
    }

    /// Whether arena `a` has nothing mapped and nothing in flight (one unmapped block)
    /// and is not pinned.
    pub fn arena_is_empty(&self, a: ArenaId) -> bool {
        self.arena(a).is_some_and(|x| {
            let h = self.block(x.head);
            !x.pinned && h.state == BlockState::Unmapped && h.next == NIL
        })
    }

    /// Removes an empty arena (see `Heap::arena_is_empty`), returning it.
    pub fn remove_arena(&mut self, a: ArenaId) -> Option<Arena> {
        if !self.arena_is_empty(a) {
            return None;
        }
        let arena = self.arenas[a as usize].take()?;
        self.drop_block(arena.head);
        Some(arena)
    }

    // ---------------------------------------------------------------- treaps
    //
    // Two treaps are threaded through the slab, written once here over the const
    // parameter `A`: the fit treap (`A = false`: children `left`/`right`, key
    // `(size, addr)`) of every arena's free blocks, and the by-address treap (`A = true`:
    // `aleft`/`aright`, key `addr`) of a placement arena's. Both are heap-ordered by the
    // block's `prio`. Expected O(log n) per operation.

    #[inline]
    fn key(&self, i: Idx) -> (u64, u64) {
        let b = &self.blocks[i as usize];
        (b.size, b.addr)
    }

    #[inline]
    fn tkey<const A: bool>(&self, i: Idx) -> (u64, u64) {
        if A {
            (self.blocks[i as usize].addr, 0)
        } else {
            self.key(i)
        }
    }

    #[inline]
    fn kid<const A: bool>(&self, t: Idx, right: bool) -> Idx {
        let b = &self.blocks[t as usize];
        match (A, right) {
            (false, false) => b.left,
            (false, true) => b.right,
            (true, false) => b.aleft,
            (true, true) => b.aright,
        }
    }

    #[inline]
    fn set_kid<const A: bool>(&mut self, t: Idx, right: bool, v: Idx) {
        let b = &mut self.blocks[t as usize];
        match (A, right) {
            (false, false) => b.left = v,
            (false, true) => b.right = v,
            (true, false) => b.aleft = v,
            (true, true) => b.aright = v,
        }
    }

    /// Splits treap `t` into keys `< key` and keys `>= key`.
    fn split<const A: bool>(&mut self, t: Idx, key: (u64, u64)) -> (Idx, Idx) {
        if t == NIL {
            return (NIL, NIL);
        }
        if self.tkey::<A>(t) < key {
            let (l, r) = self.split::<A>(self.kid::<A>(t, true), key);
            self.set_kid::<A>(t, true, l);
            (t, r)
        } else {
            let (l, r) = self.split::<A>(self.kid::<A>(t, false), key);
            self.set_kid::<A>(t, false, r);
            (l, t)
        }
    }

    /// Joins treaps `a` and `b`, every key of `a` below every key of `b`.
    fn merge<const A: bool>(&mut self, a: Idx, b: Idx) -> Idx {
        if a == NIL {
            return b;
        }
        if b == NIL {
            return a;
        }
        if self.blocks[a as usize].prio > self.blocks[b as usize].prio {
            let r = self.merge::<A>(self.kid::<A>(a, true), b);
            self.set_kid::<A>(a, true, r);
            a
        } else {
            let l = self.merge::<A>(a, self.kid::<A>(b, false));
            self.set_kid::<A>(b, false, l);
            b
        }
    }

    /// Inserts node `n` (children cleared) into treap `t`; returns the new root.
    fn insert_rec<const A: bool>(&mut self, t: Idx, n: Idx) -> Idx {
        if t == NIL {
            return n;
        }
        if self.blocks[n as usize].prio > self.blocks[t as usize].prio {
            let (l, r) = self.split::<A>(t, self.tkey::<A>(n));
            self.set_kid::<A>(n, false, l);
            self.set_kid::<A>(n, true, r);
            return n;
        }
        let right = self.tkey::<A>(n) >= self.tkey::<A>(t);
        let c = self.insert_rec::<A>(self.kid::<A>(t, right), n);
        self.set_kid::<A>(t, right, c);
        t
    }

    /// Removes the node with `key` from treap `t`; returns the new root.
    fn remove_rec<const A: bool>(&mut self, t: Idx, key: (u64, u64)) -> Idx {
        if t == NIL {
            return NIL;
        }
        let tk = self.tkey::<A>(t);
        if key != tk {
            let right = key > tk;
            let c = self.remove_rec::<A>(self.kid::<A>(t, right), key);
            self.set_kid::<A>(t, right, c);
            t
        } else {
            let (l, r) = (self.kid::<A>(t, false), self.kid::<A>(t, true));
            self.set_kid::<A>(t, false, NIL);
            self.set_kid::<A>(t, true, NIL);
            self.merge::<A>(l, r)
        }
    }

    /// The free block with the greatest address `<= addr` in the treap at `t`, or NIL.
    #[inline]
    fn addr_floor(&self, mut t: Idx, addr: u64) -> Idx {
        let mut best = NIL;
        while t != NIL {
            let b = &self.blocks[t as usize];
            if b.addr <= addr {
                best = t;
                t = b.aright;
            } else {
                t = b.aleft;
            }
        }
        best
    }

    /// The `Free` block of placement arena `a` that contains `addr`, if any. O(log n).
    pub fn free_block_containing(&self, a: ArenaId, addr: u64) -> Option<Idx> {
        let root = self.arena(a)?.free_by_addr?;
        let b = self.addr_floor(root, addr);
        (b != NIL && addr < self.blocks[b as usize].addr + self.blocks[b as usize].size)
            .then_some(b)
    }

    /// In-order nodes of the by-address treap at `t`, checking the heap order
    /// (invariant checks only).
    fn addr_collect(&self, t: Idx, max_prio: u32, out: &mut Vec<Idx>) -> Result<(), String> {
        if t == NIL {
            return Ok(());
        }
        let b = &self.blocks[t as usize];
        if b.prio > max_prio || out.len() > self.blocks.len() {
            return Err(format!("by-address treap order broken at block {t}"));
        }
        self.addr_collect(b.aleft, b.prio, out)?;
        out.push(t);
        self.addr_collect(b.aright, b.prio, out)
    }

    /// Non-releasable bytes of a free block `[addr, addr + size)`: everything outside
    /// the granules that lie wholly inside it.
    #[inline]
    pub fn non_releasable(&self, addr: u64, size: u64) -> u64 {
        // The granule is a power of two (`Heap::new`): masks, not divisions (this runs
        // twice per alloc/free pair on the hot path).
        let m = self.granule - 1;
        let lo = (addr + m) & !m;
        let hi = (addr + size) & !m;
        size - hi.saturating_sub(lo)
    }

    /// Indexes free block `n` in both treaps of its arena (the by-address one only for
    /// a placement arena).
    fn tree_insert(&mut self, n: Idx) {
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
    fn tree_remove(&mut self, n: Idx) {
        self.remove_by_addr(n);
        self.fit_remove(n);
    }

    /// Takes free block `n` out of its arena's by-address treap, if it has one.
    fn remove_by_addr(&mut self, n: Idx) {
        let (a, addr) = (self.blocks[n as usize].arena, self.blocks[n as usize].addr);
        if let Some(t) = self.arena_mut(a).free_by_addr {
            let t = self.remove_rec::<true>(t, (addr, 0));
            let arena = self.arena_mut(a);
            arena.free_by_addr = Some(t);
            arena.free_count -= 1;
        }
    }

    /// Fit-treap updates a placement arena with `free` free blocks goes through without
    /// a size query before its fit treap is dropped (module docs, lazy fit index): at
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
    /// [`Heap::fit_insert`]); call it before changing the block's size or address.
    fn fit_remove(&mut self, n: Idx) {
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
    /// non-releasable totals: [`Heap::fit_remove`], the change, [`Heap::fit_insert`],
    /// with one arena look-up and, while the treap is stale, no treap work. Its
    /// by-address entry must stay valid (as for [`Heap::fit_insert`]).
    fn fit_resize(&mut self, n: Idx, addr: u64, size: u64) {
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
    fn best_fit(&mut self, a: ArenaId, want: u64) -> Idx {
        self.fit_at_least(a, (want, 0))
    }

    /// The free block of arena `a` with the smallest `(size, addr)` key that is at
    /// least `key`, or [`NIL`]. Walking it with `key = (size, addr + 1)` of the last
    /// answer lists the free blocks that fit, best fit first. O(log n) once the fit
    /// treap is fresh (`Heap::fit_fresh`).
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

    /// For an arena whose last block is unmapped: `(start of the free block before it, or
    /// the mapped end when there is none, mapped end)`. `None` when the arena's end is
    /// mapped (nothing left to grow into at the tail). O(log n).
    pub fn tail_run(&self, a: ArenaId) -> Option<(u64, u64)> {
        let arena = self.arena(a)?;
        let (&end, &u) = arena.unmapped.last_key_value()?;
        if self.blocks[u as usize].next != NIL {
            return None;
        }
        let prev = self.blocks[u as usize].prev;
        let start = if prev != NIL && self.blocks[prev as usize].state == BlockState::Free {
            self.blocks[prev as usize].addr
        } else {
            end
        };
        Some((start, end))
    }

    /// Whether `[addr, addr + size)` in placement arena `a` can take a block: wholly
    /// free, free and unmapped (some granules must be mapped first:
    /// `Heap::carve_range`), or not (something allocated, pending, being mapped or
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

    /// Carves the unmapped parts of the granules covering `[addr, addr + size)` of arena
    /// `a` out as `Mapping` blocks (returned in address order), for the caller to map
    /// and finish with `Heap::finish_mapping`. O(log n + blocks carved).
    pub fn carve_range(&mut self, a: ArenaId, addr: u64, size: u64) -> Result<Vec<Idx>, SlabFull> {
        let g = self.granule;
        let (lo, hi) = (addr / g * g, (addr + size).div_ceil(g) * g);
        let Some(arena) = self.arena(a) else {
            return Ok(Vec::new());
        };
        let mut hit: Vec<Idx> = arena
            .unmapped
            .range(..hi)
            .rev()
            .map(|(_, &b)| b)
            .take_while(|&b| {
                let blk = &self.blocks[b as usize];
                blk.addr + blk.size > lo
            })
            .collect();
        hit.reverse();
        // Slab slots first (a piece and a right remainder per block at most), so a full
        // slab changes nothing.
        let mut spares = Vec::with_capacity(2 * hit.len());
        for _ in 0..2 * hit.len() {
            match self.new_block(0, 0, BlockState::Unmapped, a) {
                Ok(s) => spares.push(s),
                Err(e) => {
                    spares.into_iter().for_each(|s| self.drop_block(s));
                    return Err(e);
                }
            }
        }
        let mut out = Vec::with_capacity(hit.len());
        for b in hit {
            let (bs, be) = (
                self.blocks[b as usize].addr,
                self.blocks[b as usize].addr + self.blocks[b as usize].size,
            );
            let (cs, ce) = (bs.max(lo), be.min(hi));
            self.arena_mut(a).unmapped.remove(&bs);
            // `b` keeps the left remainder if there is one, else becomes the piece.
            let piece = if bs < cs {
                self.blocks[b as usize].size = cs - bs;
                self.arena_mut(a).unmapped.insert(bs, b);
                let Some(m) = spares.pop() else {
                    unreachable!("two spares per block")
                };
                self.blocks[m as usize].addr = cs;
                self.link_after(b, m);
                m
            } else {
                b
            };
            self.blocks[piece as usize].size = ce - cs;
            self.blocks[piece as usize].state = BlockState::Mapping;
            if ce < be {
                let Some(r) = spares.pop() else {
                    unreachable!("two spares per block")
                };
                self.blocks[r as usize].addr = ce;
                self.blocks[r as usize].size = be - ce;
                self.blocks[r as usize].state = BlockState::Unmapped;
                self.link_after(piece, r);
                self.arena_mut(a).unmapped.insert(ce, r);
            }
            out.push(piece);
        }
        spares.into_iter().for_each(|s| self.drop_block(s));
        Ok(out)
    }

    /// The start of the lowest-addressed run of free and unmapped space in arena `a`
    /// that holds `size` bytes (where `Heap::carve_growth` would grow), or `None`.
    /// O(unmapped blocks + run length).
    pub fn lowest_run(&self, a: ArenaId, size: u64) -> Option<u64> {
        self.lowest_run_block(a, size)
            .map(|s| self.blocks[s as usize].addr)
    }

    /// The first block of that run: the first unmapped block whose run, starting at
    /// its free predecessor if it has one, holds `size` bytes.
    fn lowest_run_block(&self, a: ArenaId, size: u64) -> Option<Idx> {
        self.growth_runs(a, size).next().map(|(s, _, _)| s)
    }

    /// Every run of free and unmapped blocks of arena `a` that holds `size` bytes, in
    /// address order: its first block (an unmapped block, or the free block just before
    /// it), the bytes `carve_growth` would map there (whole granules of each unmapped
    /// block, only as many as the request still needs) and the end of its last block.
    fn growth_runs(&self, a: ArenaId, size: u64) -> impl Iterator<Item = (Idx, u64, u64)> + '_ {
        let g = self.granule;
        self.arena(a)
            .into_iter()
            .flat_map(|arena| arena.unmapped.values())
            .filter_map(move |&u| {
                let prev = self.blocks[u as usize].prev;
                let s = if prev != NIL && self.blocks[prev as usize].state == BlockState::Free {
                    prev
                } else {
                    u
                };
                let (mut sum, mut need, mut end, mut b) = (0u64, 0u64, 0u64, s);
                while b != NIL && sum < size {
                    let blk = &self.blocks[b as usize];
                    match blk.state {
                        BlockState::Free => {}
                        BlockState::Unmapped => {
                            need += (size - sum).div_ceil(g).saturating_mul(g).min(blk.size);
                        }
                        _ => break,
                    }
                    sum += blk.size;
                    end = blk.addr + blk.size;
                    b = blk.next;
                }
                (sum >= size).then_some((s, need, end))
            })
    }

    /// Where `Heap::carve_growth` grows arena `a` for `size` bytes: of the runs of free
    /// and unmapped blocks that hold `size` bytes (each starting at an unmapped block,
    /// or at the free block just before it), the one that needs the fewest bytes mapped,
    /// the lowest-addressed on ties. Returns its first block and the end of its last one.
    /// Without unmapped gaps inside the arena (nothing released yet) the only run is the
    /// free tail plus the unmapped end: PyTorch's rule. After a release, the gaps it left
    /// (with the free edges around them) are re-mapped for a request they can hold
    /// rather than the tail growing. O(unmapped blocks · run length).
    fn growth_run_block(&self, a: ArenaId, size: u64) -> Option<(Idx, u64)> {
        // `min_by_key` keeps the first of equal minima: the lowest address on ties.
        self.growth_runs(a, size)
            .min_by_key(|&(_, need, _)| need)
            .map(|(s, _, end)| (s, end))
    }

    /// The address range `[lo, hi)` of the blocks that growing arena `a` for `size` bytes
    /// would use (`Heap::carve_growth`: the free edges and the unmapped blocks of its
    /// run), or `None` if it cannot grow.
    pub fn growth_run(&self, a: ArenaId, size: u64) -> Option<(u64, u64)> {
        self.growth_run_block(a, size)
            .map(|(s, end)| (self.blocks[s as usize].addr, end))
    }

    // ---------------------------------------------------------------- serving

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

    /// Makes block `i` (just marked `Free`, in no treap) free memory of its arena:
    /// merged with its free neighbours (which are indexed) and indexed. Returns the
    /// resulting free block. A neighbour that absorbs `i` keeps its by-address entry
    /// (its address moves, if at all, to `i`'s, which no other free block passes), so
    /// only the fit treap changes unless `i` has no free neighbour.
    fn settle_free(&mut self, i: Idx) -> Idx {
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
    fn settle_unmapped(&mut self, mut i: Idx) {
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

    // ---------------------------------------------------------------- growth

    /// Finds the run of free and unmapped blocks in arena `a` that holds `size` bytes with
    /// the fewest bytes to map (`Heap::growth_run_block`), and carves out the granules of
    /// it that must be mapped (`Mapping` blocks, returned in address order with their
    /// sizes). Fails if no run is big enough, or if mapping it would take more than
    /// `budget` bytes.
    pub fn carve_growth(
        &mut self,
        a: ArenaId,
        size: u64,
        budget: u64,
    ) -> Result<Result<Vec<Idx>, GrowthFailure>, SlabFull> {
        let g = self.granule;
        let Some((start, _)) = self.growth_run_block(a, size) else {
            return Ok(Err(GrowthFailure::NoRoom));
        };
        // How much of each unmapped block in the run to map.
        let mut plan: Vec<(Idx, u64)> = Vec::new();
        let (mut left, mut b) = (size, start);
        while left > 0 {
            let blk = &self.blocks[b as usize];
            match blk.state {
                BlockState::Free => left -= left.min(blk.size),
                BlockState::Unmapped => {
                    let m = left.div_ceil(g).saturating_mul(g).min(blk.size);
                    plan.push((b, m));
                    left -= left.min(m);
                }
                _ => unreachable!("run checked above"),
            }
            b = blk.next;
        }
        let needed: u64 = plan.iter().map(|&(_, m)| m).sum();
        if needed > budget {
            return Ok(Err(GrowthFailure::OverBudget { needed }));
        }
        // Reserve slab slots first so a full slab changes nothing.
        let spare_needed = plan
            .iter()
            .filter(|&&(b, m)| m < self.blocks[b as usize].size)
            .count();
        let mut spares = Vec::with_capacity(spare_needed);
        for _ in 0..spare_needed {
            match self.new_block(0, 0, BlockState::Unmapped, a) {
                Ok(s) => spares.push(s),
                Err(e) => {
                    spares.into_iter().for_each(|s| self.drop_block(s));
                    return Err(e);
                }
            }
        }
        let mut out = Vec::with_capacity(plan.len());
        for (b, m) in plan {
            let (addr, bsize) = (self.blocks[b as usize].addr, self.blocks[b as usize].size);
            self.arena_mut(a).unmapped.remove(&addr);
            if m < bsize {
                let Some(r) = spares.pop() else {
                    unreachable!("one spare per split")
                };
                self.blocks[r as usize].addr = addr + m;
                self.blocks[r as usize].size = bsize - m;
                self.link_after(b, r);
                self.arena_mut(a).unmapped.insert(addr + m, r);
                self.blocks[b as usize].size = m;
            }
            self.blocks[b as usize].state = BlockState::Mapping;
            out.push(b);
        }
        Ok(Ok(out))
    }

    /// Ends the mapping of `Mapping` block `i`: on success it becomes free memory
    /// (coalesced, in the fit tree), on failure unmapped again.
    pub fn finish_mapping(&mut self, i: Idx, mapped: bool) {
        let whole = self.whole_unit_mapping(self.blocks[i as usize].arena);
        self.finish_mapping_as(i, mapped, whole);
    }

    /// [`Heap::finish_mapping`] for a block mapped as one unit (`whole`) or granule by
    /// granule, as the caller decided when it started the mapping.
    pub fn finish_mapping_as(&mut self, i: Idx, mapped: bool, whole: bool) {
        debug_assert_eq!(self.blocks[i as usize].state, BlockState::Mapping);
        if mapped {
            let (a, addr, size) = {
                let b = &self.blocks[i as usize];
                (b.arena, b.addr, b.size)
            };
            let g = self.granule;
            let units = &mut self.arena_mut(a).units;
            if whole {
                units.insert(addr, addr + size);
            } else {
                for u in (addr..addr + size).step_by(g as usize) {
                    units.insert(u, u + g);
                }
            }
            self.blocks[i as usize].state = BlockState::Free;
            self.settle_free(i);
        } else {
            self.settle_unmapped(i);
        }
    }

    // ---------------------------------------------------------------- release

    /// Carves every granule that lies wholly inside a free block of arena `a` out as an
    /// `Unmapping` block (returned in address order). Free heads and tails that share a
    /// granule with something else stay free.
    #[cfg(test)]
    pub fn carve_releasable(&mut self, a: ArenaId) -> Result<Vec<Idx>, SlabFull> {
        self.carve_releasable_with(a, false)
    }

    /// `Heap::carve_releasable`, for a pinned arena too when `pinned_too` (its free
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

    /// Like [`Heap::carve_releasable`] for the arenas `of` (those not pinned), but only
    /// from their *holes* (free blocks with anything after them but the arena's unmapped
    /// end: not the free tail that growth extends; a free block before an unmapped gap
    /// that an earlier release left is a hole too) and only until `want` bytes are
    /// carved, largest holes first (fewest blocks cut). `keep` (an arena and an address
    /// range: the run a pending growth will map, `Heap::growth_run`) is left alone:
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

    /// Turns `[lo, hi)` (whole units) of free block `b` of arena `a` into an `Unmapping`
    /// block (returned); what is left on either side stays free.
    fn carve_unmapping(&mut self, a: ArenaId, b: Idx, lo: u64, hi: u64) -> Result<Idx, SlabFull> {
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

    /// Whether a `Mapping` block of arena `a` is mapped as one unit (one device `map`
    /// call: one physical allocation on CUDA, faster for the kernels that use it) rather
    /// than one unit per granule. Placement arenas (the plan pool) map whole blocks: they
    /// are pinned, so nothing is released from them while they serve. Online arenas, a
    /// placement arena no longer pinned (its plan given up or unloaded), and every arena
    /// under a memory limit (`Heap::set_fine_units`) map granule by granule, so that a
    /// release can give back any free granule.
    pub fn whole_unit_mapping(&self, a: ArenaId) -> bool {
        !self.fine_units
            && self
                .arena(a)
                .is_some_and(|x| x.free_by_addr.is_some() && x.pinned)
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

    // ---------------------------------------------------------------- checking

    /// Checks the invariants of the module documentation for every arena and returns
    /// per-pool totals recomputed from the blocks (index 0 small, 1 large).
    pub fn check(&self) -> Result<[Totals; 2], String> {
        let g = self.granule;
        let mut totals = [Totals::default(); 2];
        for a in self.arena_ids() {
            let arena = self.arena(a).ok_or("listed arena missing")?;
            let t = &mut totals[pool_index(arena.kind)];
            t.arenas += 1;
            if !arena.base.is_multiple_of(g) || !arena.len.is_multiple_of(g) || arena.len == 0 {
                return Err(format!("arena {a} not granule aligned"));
            }
            let (mut at, mut prev, mut b) = (arena.base, NIL, arena.head);
            let (mut free_blocks, mut unmapped_blocks) = (0usize, 0usize);
            while b != NIL {
                let blk = self.block(b);
                let ctx = |m: &str| {
                    format!(
                        "arena {a} block {b} [{:#x}+{:#x}] {:?}: {m}",
                        blk.addr, blk.size, blk.state
                    )
                };
                if blk.arena != a || blk.kind != arena.kind {
                    return Err(ctx("belongs to another arena or pool"));
                }
                if blk.addr != at || blk.prev != prev {
                    return Err(ctx("does not continue its predecessor"));
                }
                if blk.size == 0
                    || !blk.addr.is_multiple_of(ALIGNMENT)
                    || !blk.size.is_multiple_of(ALIGNMENT)
                {
                    return Err(ctx("empty or misaligned"));
                }
                if prev != NIL {
                    let p = self.block(prev);
                    if p.state == blk.state
                        && matches!(blk.state, BlockState::Free | BlockState::Unmapped)
                    {
                        return Err(ctx("not coalesced with its predecessor"));
                    }
                    if p.state.is_mapped() != blk.state.is_mapped() && !blk.addr.is_multiple_of(g) {
                        return Err(ctx("mapped/unmapped boundary not granule aligned"));
                    }
                }
                if blk.state.is_mapped() {
                    t.mapped += blk.size;
                }
                match blk.state {
                    BlockState::Free => {
                        free_blocks += 1;
                        let nr = self.non_releasable(blk.addr, blk.size);
                        t.inactive += nr;
                        t.inactive_count += u64::from(nr > 0);
                    }
                    BlockState::Allocated => {
                        t.allocated += blk.size;
                        t.allocated_count += 1;
                        t.active += blk.size;
                        t.active_count += 1;
                        t.requested += blk.requested;
                    }
                    BlockState::PendingFree => {
                        t.active += blk.size;
                        t.active_count += 1;
                        t.requested += blk.requested;
                    }
                    BlockState::Unmapped => {
                        unmapped_blocks += 1;
                        if arena.unmapped.get(&blk.addr) != Some(&b) {
                            return Err(ctx("missing from the unmapped index"));
                        }
                    }
                    // A paused live block still counts as allocated (its tensor exists);
                    // the free part of a paused unit counts nowhere.
                    BlockState::Paused if blk.requested > 0 => {
                        t.allocated += blk.size;
                        t.allocated_count += 1;
                        t.active += blk.size;
                        t.active_count += 1;
                        t.requested += blk.requested;
                    }
                    BlockState::Mapping | BlockState::Unmapping | BlockState::Paused => {}
                }
                at = blk.addr + blk.size;
                prev = b;
                b = blk.next;
            }
            if at != arena.base + arena.len {
                return Err(format!("arena {a} blocks end at {at:#x}, not at its end"));
            }
            // The units tile exactly the mapped blocks (Free, Allocated, PendingFree,
            // Unmapping), each unit lying in one run of them.
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for (_, blk) in self.arena_blocks(a) {
                if blk.state.is_mapped() {
                    match runs.last_mut() {
                        Some(r) if r.1 == blk.addr => r.1 += blk.size,
                        _ => runs.push((blk.addr, blk.addr + blk.size)),
                    }
                }
            }
            let mut units = arena.units.iter().peekable();
            for (rs, re) in runs {
                let mut at = rs;
                while at < re {
                    match units.next() {
                        Some((&s, &e)) if s == at && e <= re && e > s => at = e,
                        other => {
                            return Err(format!(
                                "arena {a} mapped units do not tile the mapped run \
                                 [{rs:#x}, {re:#x}) at {at:#x} (unit {other:?})"
                            ));
                        }
                    }
                }
            }
            if let Some(u) = units.next() {
                return Err(format!(
                    "arena {a} has a unit outside the mapped blocks: {u:?}"
                ));
            }
            if let Some(root) = arena.free_by_addr {
                let mut v = Vec::new();
                self.addr_collect(root, u32::MAX, &mut v)?;
                if v.len() != free_blocks
                    || arena.free_count != free_blocks as u64
                    || v.windows(2)
                        .any(|w| self.block(w[0]).addr >= self.block(w[1]).addr)
                    || v.iter().any(|&i| {
                        let b = self.block(i);
                        b.state != BlockState::Free || b.arena != a
                    })
                {
                    return Err(format!("arena {a} by-address free index is stale"));
                }
            }
            if unmapped_blocks != arena.unmapped.len() {
                return Err(format!("arena {a} unmapped index has stale entries"));
            }
            // A stale fit tree (placement arenas only) is rebuilt before any size
            // query; a fresh one holds exactly the free blocks.
            if arena.fit_stale && arena.free_by_addr.is_none() {
                return Err(format!("online arena {a} has a stale fit tree"));
            }
            let mut in_tree = 0usize;
            if !arena.fit_stale {
                self.check_tree(arena.root, a, None, None, u32::MAX, &mut in_tree)?;
            }
            if !arena.fit_stale && in_tree != free_blocks {
                return Err(format!(
                    "arena {a} fit tree holds {in_tree} blocks, the arena {free_blocks} free ones"
                ));
            }
        }
        for (k, t) in totals.iter().enumerate() {
            if (t.inactive, t.inactive_count) != (self.inactive_bytes[k], self.inactive_count[k]) {
                return Err(format!(
                    "pool {k}: non-releasable bytes/blocks counted {}/{}, recomputed {}/{}",
                    self.inactive_bytes[k], self.inactive_count[k], t.inactive, t.inactive_count
                ));
            }
        }
        Ok(totals)
    }

    fn check_tree(
        &self,
        t: Idx,
        a: ArenaId,
        lo: Option<(u64, u64)>,
        hi: Option<(u64, u64)>,
        max_prio: u32,
        count: &mut usize,
    ) -> Result<(), String> {
        if t == NIL {
            return Ok(());
        }
        let b = self.block(t);
        let k = self.key(t);
        if b.state != BlockState::Free || b.arena != a {
            return Err(format!(
                "fit tree of arena {a} holds block {t} ({:?}, arena {})",
                b.state, b.arena
            ));
        }
        if lo.is_some_and(|lo| k <= lo) || hi.is_some_and(|hi| k >= hi) {
            return Err(format!("fit tree of arena {a} out of order at block {t}"));
        }
        if b.prio > max_prio {
            return Err(format!(
                "fit tree of arena {a} violates heap order at block {t}"
            ));
        }
        *count += 1;
        self.check_tree(b.left, a, lo, Some(k), b.prio, count)?;
        self.check_tree(b.right, a, Some(k), hi, b.prio, count)
    }
}

/// Iterator over the blocks of one arena in address order.
pub(crate) struct ArenaBlocks<'a> {
    heap: &'a Heap,
    at: Idx,
}

impl<'a> Iterator for ArenaBlocks<'a> {
    type Item = (Idx, &'a Block);

    fn next(&mut self) -> Option<Self::Item> {
        if self.at == NIL {
            return None;
        }
        let i = self.at;
        let b = self.heap.block(i);
        self.at = b.next;
        Some((i, b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    const G: u64 = 4096;
    const BASE: u64 = 1 << 30;

    fn heap_with_arena(len: u64) -> (Heap, ArenaId) {
        let mut h = Heap::new(G);
        let a = h
            .add_arena(StreamId(0), PoolKind::Small, BASE, len)
            .unwrap();
        (h, a)
    }

    fn grow(h: &mut Heap, a: ArenaId, size: u64) -> u64 {
        let carved = h.carve_growth(a, size, u64::MAX).unwrap().unwrap();
        let mut mapped = 0;
        for b in carved {
            mapped += h.block(b).size;
            h.finish_mapping(b, true);
        }
        mapped
    }

    #[test]
    fn best_fit_prefers_smallest_then_lowest_address() {
        let (mut h, a) = heap_with_arena(16 * G);
        assert_eq!(grow(&mut h, a, 4 * G), 4 * G);
        // Carve [x0:512][gap 1024][x1:512][gap 512][x2:512][gap 1024][rest]
        let sizes = [512, 1024, 512, 512, 512, 1024, 512];
        let ids: Vec<Idx> = sizes
            .iter()
            .map(|&s| h.alloc(a, s, s).unwrap().unwrap())
            .collect();
        for &i in &[ids[1], ids[3], ids[5]] {
            h.free(i);
        }
        h.check().unwrap();
        // A 512-B request takes the single 512-B hole, not a 1024-B one.
        let x = h.alloc(a, 512, 100).unwrap().unwrap();
        assert_eq!(h.block(x).addr, h.block(ids[3]).addr);
        // A 1024-B request: two equal holes, the lower address wins.
        let y = h.alloc(a, 1024, 1024).unwrap().unwrap();
        assert_eq!(h.block(y).addr, BASE + 512);
        h.check().unwrap();
    }

    #[test]
    fn growth_maps_only_needed_granules_and_reuses_a_free_tail() {
        let (mut h, a) = heap_with_arena(64 * G);
        assert_eq!(grow(&mut h, a, 512), G);
        let x = h.alloc(a, 512, 1).unwrap().unwrap();
        // 3.5 granules free at the tail are not enough for 2G + ...: run = free tail
        // (G - 512) + unmapped; map only what is missing.
        assert!(h.alloc(a, 2 * G, 2 * G).unwrap().is_none());
        assert_eq!(grow(&mut h, a, 2 * G), 2 * G);
        let y = h.alloc(a, 2 * G, 2 * G).unwrap().unwrap();
        assert_eq!(h.block(y).addr, BASE + 512);
        let t = h.check().unwrap();
        assert_eq!(t[0].mapped, 3 * G);
        assert_eq!(t[0].allocated, 2 * G + 512);
        // The free tail [BASE + 2G + 512, BASE + 3G) shares a granule with y.
        assert_eq!(h.inactive_bytes(PoolKind::Small), G - 512);
        h.free(x);
        h.free(y);
        assert_eq!(h.inactive_bytes(PoolKind::Small), 0);
        let carved = h.carve_releasable(a).unwrap();
        assert_eq!(carved.len(), 1);
        for b in carved {
            h.finish_unmapping(b, true);
        }
        assert!(h.arena_is_empty(a));
        assert!(h.remove_arena(a).is_some());
    }

    #[test]
    fn release_takes_whole_units_only() {
        // In a placement arena, one mapping of 4 granules is one unit: never unmapped
        // in part.
        let mut h = Heap::new(G);
        let a = h
            .add_placement_arena(StreamId(0), PoolKind::Large, BASE, 8 * G)
            .unwrap();
        assert!(h.whole_unit_mapping(a));
        let online = h
            .add_arena(StreamId(1), PoolKind::Large, BASE + 8 * G, G)
            .unwrap();
        assert!(!h.whole_unit_mapping(online));
        for b in h.carve_range(a, BASE, 4 * G).unwrap() {
            h.finish_mapping(b, true);
        }
        let x = h.alloc_at(a, BASE, 512, 512).unwrap().unwrap();
        let y = h.alloc_at(a, BASE + G, 2 * G, 2 * G).unwrap().unwrap();
        h.free(y);
        assert!(h.carve_releasable_with(a, true).unwrap().is_empty());
        h.check().unwrap();
        h.free(x);
        let carved = h.carve_releasable_with(a, true).unwrap();
        assert_eq!(carved.len(), 1);
        assert_eq!(
            (h.block(carved[0]).addr, h.block(carved[0]).size),
            (BASE, 4 * G)
        );
        h.finish_unmapping(carved[0], true);
        h.check().unwrap();
        assert_eq!(h.check().unwrap()[1].mapped, 0);
        // A placement arena no longer pinned (plan given up) maps granule by granule.
        h.unpin(a);
        assert!(!h.whole_unit_mapping(a));
        for b in h.carve_range(a, BASE, 2 * G).unwrap() {
            h.finish_mapping(b, true);
        }
        let x = h.alloc_at(a, BASE, 512, 512).unwrap().unwrap();
        let carved = h.carve_releasable(a).unwrap();
        assert_eq!(
            (h.block(carved[0]).addr, h.block(carved[0]).size),
            (BASE + G, G)
        );
        h.finish_unmapping(carved[0], true);
        h.free(x);
        h.check().unwrap();
    }

    #[test]
    fn carve_holes_takes_the_largest_holes_until_enough_and_never_the_tail() {
        let (mut h, a) = heap_with_arena(16 * G);
        grow(&mut h, a, 8 * G);
        // [x 512][h1: 3G][y 512][h2: 2G + ...][z 512][free tail ...]
        let x = h.alloc(a, 512, 512).unwrap().unwrap();
        let h1 = h.alloc(a, 3 * G, 3 * G).unwrap().unwrap();
        let y = h.alloc(a, 512, 512).unwrap().unwrap();
        let h2 = h.alloc(a, 2 * G, 2 * G).unwrap().unwrap();
        let _z = h.alloc(a, 512, 512).unwrap().unwrap();
        h.free(h1);
        h.free(h2);
        let _ = (x, y);
        // Want one granule: the largest hole gives its whole granules (2 of 3G: the
        // partial granules at its ends stay), the smaller hole and the tail are kept.
        let carved = h.carve_holes(&[a], G, None).unwrap();
        assert_eq!(carved.len(), 1);
        let (addr, size) = (h.block(carved[0]).addr, h.block(carved[0]).size);
        assert_eq!((addr, size), (BASE + G, 2 * G));
        h.finish_unmapping(carved[0], true);
        h.check().unwrap();
        // Wanting more than the holes hold takes every hole's whole granules, still
        // not the tail.
        let carved = h.carve_holes(&[a], 100 * G, None).unwrap();
        let total: u64 = carved.iter().map(|&b| h.block(b).size).sum();
        assert_eq!(total, G, "the 2 G hole holds one whole granule");
        for b in carved {
            h.finish_unmapping(b, true);
        }
        h.check().unwrap();
        assert!(h.carve_holes(&[a], G, None).unwrap().is_empty());
    }

    #[test]
    fn carve_holes_takes_a_free_block_before_a_released_gap_but_not_the_kept_run() {
        let (mut h, a) = heap_with_arena(16 * G);
        grow(&mut h, a, 8 * G);
        // [x 512][a1: 2G - 512][a2: 2G][y 512][t: the rest of the mapped 8G][unmapped]
        let _x = h.alloc(a, 512, 512).unwrap().unwrap();
        let a1 = h.alloc(a, 2 * G - 512, 1).unwrap().unwrap();
        let a2 = h.alloc(a, 2 * G, 1).unwrap().unwrap();
        let _y = h.alloc(a, 512, 512).unwrap().unwrap();
        let _t = h.alloc(a, 4 * G - 512, 1).unwrap().unwrap();
        h.free(a2);
        let carved = h.carve_holes(&[a], G, None).unwrap();
        assert_eq!(carved.len(), 1);
        assert_eq!(h.block(carved[0]).addr, BASE + 2 * G);
        h.finish_unmapping(carved[0], true);
        h.free(a1);
        h.check().unwrap();
        // a1's block now ends at an unmapped gap inside the arena, not at the arena's
        // unmapped end. A 3G growth would use it (2G to map there, 3G at the end).
        let run = h.growth_run(a, 3 * G);
        assert_eq!(
            run,
            Some((BASE + 512, BASE + 4 * G)),
            "the gap and its free edge"
        );
        // While that growth is pending, its run is kept...
        let keep = run.map(|(lo, hi)| (a, lo, hi));
        assert!(h.carve_holes(&[a], G, keep).unwrap().is_empty());
        // ...otherwise the block is a hole like any other: its whole granule goes.
        let carved = h.carve_holes(&[a], G, None).unwrap();
        assert_eq!(carved.len(), 1);
        assert_eq!(
            (h.block(carved[0]).addr, h.block(carved[0]).size),
            (BASE + G, G)
        );
        h.finish_unmapping(carved[0], true);
        h.check().unwrap();
    }

    #[test]
    fn growth_maps_the_run_needing_the_fewest_granules() {
        let (mut h, a) = heap_with_arena(16 * G);
        grow(&mut h, a, 8 * G);
        // [x 512][hole 4G][y 512][free tail 4G - 1024][unmapped]
        let _x = h.alloc(a, 512, 512).unwrap().unwrap();
        let hole = h.alloc(a, 4 * G, 1).unwrap().unwrap();
        let _y = h.alloc(a, 512, 512).unwrap().unwrap();
        h.free(hole);
        for b in h.carve_holes(&[a], G, None).unwrap() {
            h.finish_unmapping(b, true);
        }
        h.check().unwrap();
        // Both the released gap (with its free edges: 4G, 3G of it unmapped) and the
        // tail (4G - 1024 free) can hold 4G; the tail needs one granule mapped, the
        // lower-addressed gap three. The growth takes the tail.
        assert_eq!(
            h.growth_run(a, 4 * G),
            Some((BASE + 4 * G + 1024, BASE + 16 * G))
        );
        assert_eq!(grow(&mut h, a, 4 * G), G);
        let b = h.alloc(a, 4 * G, 1).unwrap().unwrap();
        assert_eq!(h.block(b).addr, BASE + 4 * G + 1024);
        h.check().unwrap();
    }

    #[test]
    fn release_keeps_partial_granules_and_over_budget_is_refused() {
        let (mut h, a) = heap_with_arena(8 * G);
        // Four units of one granule each.
        for k in 0..4 {
            for b in h.carve_range(a, BASE + k * G, G).unwrap() {
                h.finish_mapping(b, true);
            }
        }
        let x = h.alloc(a, 512, 512).unwrap().unwrap();
        let _y = h.alloc(a, G, G).unwrap().unwrap();
        let z = h.alloc(a, G, G).unwrap().unwrap();
        let _w = h.alloc(a, 512, 512).unwrap().unwrap();
        h.free(x);
        h.free(z);
        // Free: [0, 512) and [G+512, 2G+512) and [2G+1024, 4G).
        let carved = h.carve_releasable(a).unwrap();
        let got: Vec<(u64, u64)> = carved
            .iter()
            .map(|&b| (h.block(b).addr - BASE, h.block(b).size))
            .collect();
        assert_eq!(got, vec![(3 * G, G)]);
        for b in carved {
            h.finish_unmapping(b, true);
        }
        h.check().unwrap();
        assert_eq!(
            h.carve_growth(a, 5 * G, 2 * G).unwrap(),
            Err(GrowthFailure::OverBudget { needed: 5 * G })
        );
        assert_eq!(
            h.carve_growth(a, 9 * G, u64::MAX).unwrap(),
            Err(GrowthFailure::NoRoom)
        );
        h.check().unwrap();
    }

    fn placement_arena(len: u64) -> (Heap, ArenaId) {
        let mut h = Heap::new(G);
        let a = h
            .add_placement_arena(StreamId(0), PoolKind::Large, BASE, len)
            .unwrap();
        assert_eq!(grow(&mut h, a, len), len);
        (h, a)
    }

    #[test]
    fn alloc_at_places_exactly_and_refuses_occupied_ranges() {
        let (mut h, a) = placement_arena(16 * G);
        let x = h.alloc_at(a, BASE + G, 512, 500).unwrap().unwrap();
        assert_eq!((h.block(x).addr, h.block(x).size), (BASE + G, 512));
        assert_eq!(h.alloc_at(a, BASE + G, 512, 1).unwrap(), None);
        assert_eq!(h.alloc_at(a, BASE + G - 512, 1024, 1).unwrap(), None);
        assert_eq!(h.alloc_at(a, BASE + 16 * G - 512, 1024, 1).unwrap(), None);
        let y = h.alloc_at(a, BASE, 512, 1).unwrap().unwrap(); // no free head
        let z = h.alloc_at(a, BASE + 16 * G - 512, 512, 1).unwrap().unwrap(); // no tail
        h.check().unwrap();
        assert!(h.carve_releasable(a).unwrap().is_empty(), "pinned");
        for i in [x, y, z] {
            h.free(i);
        }
        h.check().unwrap();
        let t = h.check().unwrap();
        assert_eq!((t[1].mapped, t[1].allocated), (16 * G, 0));
        assert!(!h.arena_is_empty(a) && h.remove_arena(a).is_none());
        // Not a placement arena: never places.
        let (mut h2, b) = heap_with_arena(4 * G);
        grow(&mut h2, b, 4 * G);
        assert_eq!(h2.alloc_at(b, BASE, 512, 1).unwrap(), None);
    }

    #[test]
    fn claim_takes_exact_ranges_of_any_arena_and_refuses_the_rest() {
        let (mut h, a) = heap_with_arena(16 * G);
        grow(&mut h, a, 4 * G);
        let x = h.claim(a, BASE + G, 1024, 1000, NIL).unwrap().unwrap();
        assert_eq!(
            (h.block(x).addr, h.block(x).size, h.block(x).requested),
            (BASE + G, 1024, 1000)
        );
        assert_eq!(h.block(x).state, BlockState::Allocated);
        // Occupied, straddling, unmapped, outside the arena: refused.
        assert_eq!(h.claim(a, BASE + G, 512, 1, NIL).unwrap(), None);
        assert_eq!(h.claim(a, BASE + G - 512, 1024, 1, NIL).unwrap(), None);
        assert_eq!(h.claim(a, BASE + 4 * G - 512, 1024, 1, NIL).unwrap(), None);
        assert_eq!(h.claim(a, BASE + 8 * G, 512, 1, NIL).unwrap(), None);
        assert_eq!(h.claim(a, BASE + 16 * G, 512, 1, NIL).unwrap(), None);
        assert_eq!(h.claim(a, BASE - 512, 512, 1, NIL).unwrap(), None);
        // Head, tail and a whole free block, walking on from the previous claim.
        let y = h.claim(a, BASE, 512, 1, NIL).unwrap().unwrap();
        let z = h.claim(a, BASE + 2 * G, 2 * G, 1, x).unwrap().unwrap();
        assert_eq!(h.block(z).addr + h.block(z).size, BASE + 4 * G);
        // A hint past the address, or a vacant slot, falls back to the head.
        let w = h.claim(a, BASE + 512, 512, 1, z).unwrap().unwrap();
        assert_eq!(h.block(w).addr, BASE + 512);
        h.check().unwrap();
        for i in [x, y, z, w] {
            h.free(i);
        }
        let t = h.check().unwrap();
        assert_eq!((t[0].mapped, t[0].allocated), (4 * G, 0));
        // Placement arenas keep their by-address index through claims.
        let (mut p, pa) = placement_arena(4 * G);
        let q = p.claim(pa, BASE + G, G, G, NIL).unwrap().unwrap();
        p.check().unwrap();
        assert_eq!(p.alloc_at(pa, BASE + G, 512, 1).unwrap(), None);
        p.free(q);
        p.check().unwrap();
    }

    proptest! {
        /// `claim` succeeds exactly when the range lies in free mapped memory, from any
        /// starting hint, and the heap stays consistent.
        #[test]
        fn claim_matches_an_interval_model(
            ops in proptest::collection::vec((0u64..64, 1u64..=8, any::<bool>(), any::<u8>()), 1..200)
        ) {
            let (mut h, a) = heap_with_arena(16 * G);
            grow(&mut h, a, 8 * G);
            let mut live: Vec<(u64, u64, Idx)> = Vec::new();
            for (slot, len, free, hint) in ops {
                if free && !live.is_empty() {
                    let (_, _, i) = live.swap_remove(slot as usize % live.len());
                    h.free(i);
                } else {
                    let (off, size) = (slot * 512 * 3, len * 512);
                    let fits = off + size <= 8 * G
                        && live.iter().all(|&(o, l, _)| off + size <= o || o + l <= off);
                    let from = if live.is_empty() { NIL } else { live[hint as usize % live.len()].2 };
                    let got = h.claim(a, BASE + off, size, size, from).unwrap();
                    prop_assert_eq!(got.is_some(), fits);
                    if let Some(i) = got {
                        live.push((off, size, i));
                    }
                }
                h.check().map_err(TestCaseError::fail)?;
            }
        }
    }

    proptest! {
        /// `alloc_at` succeeds exactly when the range overlaps no live block, and the
        /// lazy fit index answers every size query as a `BTreeSet` of the free blocks'
        /// `(size, addr)` does, however many updates went by without one.
        #[test]
        fn alloc_at_matches_an_interval_model(
            ops in proptest::collection::vec((0u64..64, 1u64..=8, any::<bool>(), 0u8..8), 1..200)
        ) {
            let (mut h, a) = placement_arena(8 * G);
            let mut live: Vec<(u64, u64, Idx)> = Vec::new();
            for (slot, len, free, query) in ops {
                if query == 0 {
                    let model: BTreeSet<(u64, u64)> = h
                        .arena_blocks(a)
                        .filter(|(_, b)| b.state == BlockState::Free)
                        .map(|(_, b)| (b.size, b.addr))
                        .collect();
                    let mut key = (len * 512, slot * 512);
                    for want in model.range(key..).take(3) {
                        let got = h.fit_at_least(a, key);
                        prop_assert!(got != NIL);
                        prop_assert_eq!((h.block(got).size, h.block(got).addr), *want);
                        key = (want.0, want.1 + 1);
                    }
                    if model.range(key..).next().is_none() {
                        prop_assert_eq!(h.fit_at_least(a, key), NIL);
                    }
                }
                if free && !live.is_empty() {
                    let (_, _, i) = live.swap_remove(slot as usize % live.len());
                    h.free(i);
                } else {
                    let (off, size) = (slot * 512, len * 512);
                    let fits = off + size <= 8 * G
                        && live.iter().all(|&(o, l, _)| off + size <= o || o + l <= off);
                    let got = h.alloc_at(a, BASE + off, size, size).unwrap();
                    prop_assert_eq!(got.is_some(), fits);
                    if let Some(i) = got {
                        live.push((off, size, i));
                    }
                }
                h.check().map_err(TestCaseError::fail)?;
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
        Grow(u64),
        Release,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..=24).prop_map(|k| Op::Alloc(k * 512)),
            3 => any::<usize>().prop_map(Op::Free),
            1 => (1u64..=40).prop_map(|k| Op::Grow(k * 512)),
            1 => Just(Op::Release),
        ]
    }

    proptest! {
        /// The treap agrees with a `BTreeSet` of (size, addr) on every best fit, and the
        /// heap's invariants hold after every step.
        #[test]
        fn heap_matches_a_set_model(ops in proptest::collection::vec(op(), 1..200)) {
            let (mut h, a) = heap_with_arena(64 * G);
            let mut live: Vec<Idx> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(s) => {
                        let model: BTreeSet<(u64, u64)> = h
                            .arena_blocks(a)
                            .filter(|(_, b)| b.state == BlockState::Free)
                            .map(|(_, b)| (b.size, b.addr))
                            .collect();
                        let want = model.range((s, 0)..).next().map(|&(_, addr)| addr);
                        let got = h.alloc(a, s, s).unwrap();
                        prop_assert_eq!(got.map(|i| h.block(i).addr), want);
                        if let Some(i) = got {
                            live.push(i);
                        }
                    }
                    Op::Free(k) if !live.is_empty() => {
                        let i = live.swap_remove(k % live.len());
                        h.free(i);
                    }
                    Op::Free(_) => {}
                    Op::Grow(s) => {
                        if let Ok(carved) = h.carve_growth(a, s, u64::MAX).unwrap() {
                            for b in carved {
                                h.finish_mapping(b, true);
                            }
                        }
                    }
                    Op::Release => {
                        for b in h.carve_releasable(a).unwrap() {
                            h.finish_unmapping(b, true);
                        }
                    }
                }
                h.check().map_err(TestCaseError::fail)?;
            }
            for i in live {
                h.free(i);
            }
            for b in h.carve_releasable(a).unwrap() {
                h.finish_unmapping(b, true);
            }
            prop_assert!(h.arena_is_empty(a));
        }
    }
}
