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
//! All blocks of all arenas live in one slab (module `slab`), addressed by `u32`
//! indices, so steady-state allocation reuses slots and never touches the heap.
//!
//! # Invariants (checked by `Arenas::check`, module `check`)
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
//!    index, module `free_index`), and a size query (`Arenas::fit_at_least`,
//!    `Arenas::alloc`) makes it fresh first. The non-releasable totals count every `Free`
//!    block either way.
//! 5. Block addresses and sizes are multiples of the 512-B alignment.
//! 6. The arena's mapped *units* tile its mapped memory exactly. A unit is the range of
//!    one device `map` call, which is only ever unmapped whole (on CUDA, one physical
//!    allocation): a 64 MiB-aligned chunk of a mapped block in a placement arena (the
//!    plan pool; the block's ragged ends one unit each: `growth::pool_units`), one
//!    granule in an online arena (`Arenas::whole_unit_mapping`).
//!
//! # Algorithms and costs (n = free blocks in the arena), one module each
//!
//! - `slab`: block slots and the address-order links. O(1).
//! - `treap`: the two intrusive treaps threaded through the slab. Expected O(log n).
//! - `free_index`: which free blocks are indexed where — the fit treap (best fit), a
//!   placement arena's by-address treap and its lazy fit index, the non-releasable
//!   totals (`inactive_split`).
//! - `alloc`: best fit, split, free with coalescing. Expected O(log n).
//! - `placement`: blocks at exact addresses (`Arenas::alloc_at` in the plan pool,
//!   `Arenas::claim` in any arena). O(log n).
//! - `growth`: where an arena grows and the granules carved out for mapping.
//!   O(unmapped blocks · run length).
//! - `release`: the whole units carved out for unmapping (`empty_cache`, release of
//!   holes before a new peak). O(blocks · log blocks).
//! - `pause`: pause / resume of whole mapped units.
//! - `check`: the invariants above, recomputed from the blocks.
//!
//! Fragmentation is therefore bounded as in PyTorch's expandable segments (same best
//! fit, same growth rule until a release leaves gaps), with a finer mapping unit: the granule (2 MiB) instead of the
//! 20 MiB page expandable segments map for the large pool.

use std::collections::BTreeMap;

// Each a child module, so that it reaches the slab, treap and unit internals without
// widening their visibility beyond the arenas.
mod alloc;
mod check;
mod free_index;
mod growth;
// Pause / resume of whole mapped units (`Engine::pause`).
mod pause;
mod placement;
mod release;
mod slab;
mod treap;

pub use self::growth::POOL_UNIT;
pub(crate) use self::growth::pool_units;
pub(crate) use self::pause::{Group as UnitGroup, PausedGroup};

use crate::engine::stats::PoolKind;
use crate::engine::stream_use::StreamUse;
use crate::units::StreamId;

/// Slab index of a block.
pub(crate) type Idx = u32;
/// The null index.
pub(crate) const NIL: Idx = u32::MAX;

/// Index of an arena in [`Arenas`].
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
    /// Placement arenas only: the fit treap is not kept (module `free_index`);
    /// the next size query rebuilds it. Always `false` for an online arena.
    fit_stale: bool,
    /// Placement arenas only: fit-treap updates since the last size query. Past
    /// `Arenas::lazy_after`, the treap is dropped (`fit_stale`).
    fit_quiet: u64,
    /// Placement arenas only: the number of `Free` blocks (the by-address treap's).
    free_count: u64,
    /// `Unmapped` blocks by address.
    unmapped: BTreeMap<u64, Idx>,
    /// Root of the treap of `Free` blocks by address, kept only for placement arenas
    /// (see `Arenas::add_placement_arena`): `Some(NIL)` when empty. A treap threaded
    /// through the slab rather than a `BTreeMap`, so that keeping it costs no heap
    /// allocation and about half the time on the plan-hit path.
    free_by_addr: Option<Idx>,
    /// Never unmapped or released by `Arenas::carve_releasable` / `Arenas::remove_arena`.
    pub pinned: bool,
    /// start -> end of each mapped unit: the range of one device `map` call, which is
    /// only ever unmapped whole (module `release`).
    units: BTreeMap<u64, u64>,
}

/// What placing a block at a given range of a placement arena needs
/// (`Arenas::placeable`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placeable {
    /// The range lies in one free block.
    Free,
    /// The range is free, but some of its granules are not mapped yet.
    NeedsMapping,
    /// Something else is there.
    Occupied,
}

/// Why `Arenas::carve_growth` could not carve.
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

/// All arenas of an engine and the slab their blocks live in.
#[derive(Debug)]
pub(crate) struct Arenas {
    granule: u64,
    blocks: Vec<Block>,
    vacant: Idx,
    arenas: Vec<Option<Arena>>,
    /// Non-releasable free bytes and the number of free blocks holding some, per pool
    /// (index 0 small, 1 large); maintained on every fit-tree insert and remove.
    inactive_bytes: [u64; 2],
    inactive_count: [u64; 2],
    /// The non-releasable totals changed since `Arenas::take_inactive_changed`.
    inactive_changed: bool,
    /// Placement arenas map granule by granule too (`Arenas::set_fine_units`).
    fine_units: bool,
    /// The largest unit the plan pool maps (`growth::pool_units`; 0: whole ranges).
    pool_unit: u64,
}

#[inline]
fn pool_index(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

impl Arenas {
    /// No arenas yet, with mapping unit `granule` (a power of two ≥ [`ALIGNMENT`]).
    pub fn new(granule: u64) -> Arenas {
        debug_assert!(granule.is_power_of_two() && granule >= ALIGNMENT);
        Arenas {
            granule,
            blocks: Vec::new(),
            vacant: NIL,
            arenas: Vec::new(),
            inactive_bytes: [0; 2],
            inactive_count: [0; 2],
            inactive_changed: false,
            fine_units: false,
            pool_unit: POOL_UNIT,
        }
    }

    /// Under a memory limit the plan pool maps granule by granule as online arenas do
    /// (`fine`), so that once its plan is given up every wholly free granule can go
    /// back; without one it maps 64 MiB pieces of first-touched ranges (fewer device
    /// calls, one physical allocation per piece). Applies to mappings made from now on.
    pub fn set_fine_units(&mut self, fine: bool) {
        self.fine_units = fine;
    }

    /// The largest unit the plan pool maps (`growth::pool_units`; 0: whole first-touched
    /// ranges). Applies to mappings made from now on.
    pub fn set_pool_unit(&mut self, unit: u64) {
        self.pool_unit = unit;
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
            arenas: self,
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
    /// placed at given addresses (`Arenas::alloc_at`) rather than by best fit, and the
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

    /// Removes an empty arena (see `Arenas::arena_is_empty`), returning it.
    pub fn remove_arena(&mut self, a: ArenaId) -> Option<Arena> {
        if !self.arena_is_empty(a) {
            return None;
        }
        let arena = self.arenas[a as usize].take()?;
        self.drop_block(arena.head);
        Some(arena)
    }
}

/// Iterator over the blocks of one arena in address order.
pub(crate) struct ArenaBlocks<'a> {
    arenas: &'a Arenas,
    at: Idx,
}

impl<'a> Iterator for ArenaBlocks<'a> {
    type Item = (Idx, &'a Block);

    fn next(&mut self) -> Option<Self::Item> {
        if self.at == NIL {
            return None;
        }
        let i = self.at;
        let b = self.arenas.block(i);
        self.at = b.next;
        Some((i, b))
    }
}

#[cfg(test)]
mod tests;
