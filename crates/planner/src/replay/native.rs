//! The block-level model of PyTorch 2.11's `DeviceCachingAllocator` (one device, the
//! two default pools; research `pytorch-allocator-2.11.md` §6).
//!
//! Modelled rules, in the order `malloc` applies them (§6.1):
//! - `round_size` and `get_allocation_size` ([`AllocatorConfig`], §6.2–§6.3);
//! - small pool for rounded sizes ≤ 1 MiB, large pool otherwise; each pool is a set of
//!   free blocks ordered by **(stream, size, address)**, so a block is only ever reused
//!   by the stream that allocated it (§6.8);
//! - `get_free_block`: best fit by `lower_bound`, ties to the lowest address, the
//!   expandable "size including the unmapped tail" tweak, and the two
//!   `max_split_size` / `max_non_split_rounding` refusals (§6.4);
//! - garbage collection of aged, unsplit large blocks when a memory fraction and a
//!   threshold are both set (§6.10);
//! - a new segment (`cudaMalloc` of the allocation size, or mapping pages of the
//!   stream's expandable segment, see `expandable.rs`); on failure against the device
//!   limit: `release_available_cached_blocks` (only with `max_split_size`), then
//!   `release_cached_blocks` (drain event-pending frees, free every whole free segment,
//!   unmap every free expandable page) and one retry; then out of memory (§6.1, §6.7);
//! - `should_split` (remainder ≥ 512 B in the small pool or with expandable segments;
//!   in the large pool only below `max_split_size` and for remainders > 1 MiB) and
//!   `alloc_found_block`, which hands out the whole block when it does not split (§6.5);
//! - free: the block stops counting as allocated at `free()` and returns to the pool,
//!   merged with free neighbours of the same mapped state, when its free completes
//!   (§6.6).
//!
//! Not modelled: private pools (CUDA graphs, `MemPool`s; the trace does not say which
//! allocations used them), `empty_cache` calls by the program (not in the trace model).
//!
//! Cost: every malloc and free is O(log n) in the number of free blocks (a `BTreeSet`
//! lookup, a split, at most two merges), as in PyTorch. The expandable best-fit tweak
//! walks forward over equal-stream neighbours and the release paths scan the pools, but
//! those run only when the plain path fails.

use std::collections::{BTreeMap, BTreeSet};

use stweaver_core::{AllocId, Bytes, EventIdx};

use super::ReplayError;
use super::config::{AllocatorConfig, MIN_BLOCK_SIZE, ROUND_LARGE, SMALL_SIZE};
use super::stats::{BlockSpan, PoolKind, ReplayStats, SegmentSpan};
use super::{ReplayOptions, SegmentBases};

/// "No block" in the `prev` / `next` links.
pub(super) const NIL: u32 = u32::MAX;

/// Where synthetic segment addresses start: far above any real GPU virtual address.
const SYNTHETIC_BASE: u64 = 1 << 60;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// In its pool (mapped) or in the pool's unmapped set; usable.
    Free,
    /// Handed out.
    Allocated,
    /// `free()` was called but the free has not completed (stream events).
    Pending,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Block {
    pub ptr: u64,
    pub size: u64,
    pub stream: u64,
    pub pool: PoolKind,
    pub segment: u32,
    pub prev: u32,
    pub next: u32,
    pub state: State,
    pub mapped: bool,
    /// Requested bytes of the current user.
    pub requested: u64,
    /// Allocation using the block (`NIL` if none).
    pub alloc: u32,
    /// Index into the recorded layout (`NIL` if none).
    pub span: u32,
    /// `gc_count_base`: the pool's `get_free_block` call count at insertion.
    pub gc_base: u64,
}

impl Block {
    /// A free block with no user, not linked to neighbours (`prev`, `next`: `NIL`).
    pub(super) fn free(
        ptr: u64,
        size: u64,
        stream: u64,
        pool: PoolKind,
        segment: u32,
        mapped: bool,
    ) -> Block {
        Block {
            ptr,
            size,
            stream,
            pool,
            segment,
            prev: NIL,
            next: NIL,
            state: State::Free,
            mapped,
            requested: 0,
            alloc: NIL,
            span: NIL,
            gc_base: 0,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Pool {
    /// Free mapped blocks: (stream, size, ptr, block).
    pub blocks: BTreeSet<(u64, u64, u64, u32)>,
    /// Free unmapped blocks of expandable segments: (stream, ptr, block).
    pub unmapped: BTreeSet<(u64, u64, u32)>,
    /// `get_free_blocks_call_count` (only counted while GC is active).
    pub free_calls: u64,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Segment {
    pub base: u64,
    pub size: u64,
    pub stream: u64,
    pub pool: PoolKind,
    /// Page size of an expandable segment; 0 for a `cudaMalloc` segment.
    pub page: u64,
    pub created: u32,
    pub released: Option<u32>,
}

/// The allocator state of one replay.
pub(super) struct Engine<'c> {
    pub cfg: &'c AllocatorConfig,
    pub blocks: Vec<Block>,
    free_slots: Vec<u32>,
    pub pools: [Pool; 2],
    pub segments: Vec<Segment>,
    /// Live `cudaMalloc` segments by base (to keep recorded bases from overlapping).
    live_ranges: BTreeMap<u64, u64>,
    next_synthetic: u64,
    segment_bases: SegmentBases,
    /// Block of each live allocation, `NIL` otherwise.
    block_of: Vec<u32>,
    /// Blocks whose free waits on events.
    pending: BTreeSet<u32>,
    /// Physical limit (`capacity`), and the fraction limit (`allowed_memory_maximum`).
    pub capacity: Option<u64>,
    allowed: Option<u64>,
    pub device_memory: u64,
    pub reserved: u64,
    allocated: u64,
    requested: u64,
    active: u64,
    pub stats: ReplayStats,
    /// Current event (`None` while placing preexisting allocations).
    pub now: Option<u32>,
    spans: Option<Vec<BlockSpan>>,
}

impl<'c> Engine<'c> {
    pub fn new(cfg: &'c AllocatorConfig, options: &ReplayOptions, allocations: usize) -> Self {
        let device_memory = options.device_memory.get();
        let allowed = cfg
            .per_process_memory_fraction
            .map(|f| (f * device_memory as f64) as u64);
        Engine {
            cfg,
            blocks: Vec::new(),
            free_slots: Vec::new(),
            pools: [Pool::default(), Pool::default()],
            segments: Vec::new(),
            live_ranges: BTreeMap::new(),
            next_synthetic: SYNTHETIC_BASE,
            segment_bases: options.segment_bases,
            block_of: vec![NIL; allocations],
            pending: BTreeSet::new(),
            capacity: options.capacity.map(Bytes::get),
            allowed,
            device_memory,
            reserved: 0,
            allocated: 0,
            requested: 0,
            active: 0,
            stats: ReplayStats::default(),
            now: None,
            spans: options.record_layout.then(Vec::new),
        }
    }

    pub fn counters(&self) -> (u64, u64, u64) {
        (self.reserved, self.allocated, self.requested)
    }

    fn now_idx(&self) -> u32 {
        self.now.unwrap_or(0)
    }

    // ------------------------------------------------------------------ blocks

    pub(super) fn new_block(&mut self, b: Block) -> u32 {
        if let Some(i) = self.free_slots.pop() {
            self.blocks[i as usize] = b;
            i
        } else {
            self.blocks.push(b);
            (self.blocks.len() - 1) as u32
        }
    }

    pub(super) fn drop_block(&mut self, i: u32) {
        self.free_slots.push(i);
    }

    #[inline]
    pub(super) fn b(&self, i: u32) -> &Block {
        &self.blocks[i as usize]
    }

    #[inline]
    pub(super) fn bm(&mut self, i: u32) -> &mut Block {
        &mut self.blocks[i as usize]
    }

    #[inline]
    pub(super) fn pool_of(&self, i: u32) -> usize {
        pool_index(self.b(i).pool)
    }

    #[inline]
    pub(super) fn is_expandable(&self, i: u32) -> bool {
        self.segments[self.b(i).segment as usize].page != 0
    }

    #[inline]
    pub(super) fn is_split(&self, i: u32) -> bool {
        let b = self.b(i);
        b.prev != NIL || b.next != NIL
    }

    /// Inserts a free mapped block into its pool (`insert_into_blocks`).
    pub(super) fn insert_free(&mut self, i: u32) {
        let p = self.pool_of(i);
        let calls = self.pools[p].free_calls;
        let b = self.bm(i);
        b.gc_base = calls;
        let key = (b.stream, b.size, b.ptr, i);
        self.pools[p].blocks.insert(key);
    }

    pub(super) fn remove_free(&mut self, i: u32) {
        let p = self.pool_of(i);
        let b = self.b(i);
        let key = (b.stream, b.size, b.ptr, i);
        self.pools[p].blocks.remove(&key);
    }

    pub(super) fn insert_unmapped(&mut self, i: u32) {
        let p = self.pool_of(i);
        let b = self.b(i);
        let key = (b.stream, b.ptr, i);
        self.pools[p].unmapped.insert(key);
    }

    pub(super) fn remove_unmapped(&mut self, i: u32) {
        let p = self.pool_of(i);
        let b = self.b(i);
        let key = (b.stream, b.ptr, i);
        self.pools[p].unmapped.remove(&key);
    }

    /// `try_merge_blocks(dst, src)`: absorbs a free neighbour of the same mapped state.
    /// `dst` must be out of the pool sets. Returns the bytes absorbed.
    pub(super) fn try_merge(&mut self, dst: u32, src: u32) -> u64 {
        if src == NIL {
            return 0;
        }
        let s = *self.b(src);
        if s.state != State::Free || s.mapped != self.b(dst).mapped {
            return 0;
        }
        if s.mapped {
            self.remove_free(src);
        } else {
            self.remove_unmapped(src);
        }
        if self.b(dst).prev == src {
            let d = self.bm(dst);
            d.ptr = s.ptr;
            d.prev = s.prev;
            if s.prev != NIL {
                self.bm(s.prev).next = dst;
            }
        } else {
            self.bm(dst).next = s.next;
            if s.next != NIL {
                self.bm(s.next).prev = dst;
            }
        }
        self.bm(dst).size += s.size;
        self.drop_block(src);
        s.size
    }

    // ---------------------------------------------------------------- counters

    pub(super) fn add_reserved(&mut self, n: u64) {
        self.reserved += n;
        if self.reserved > self.stats.peak_reserved.get() {
            self.stats.peak_reserved = Bytes(self.reserved);
            self.stats.peak_reserved_at = self.now.map(EventIdx);
        }
    }

    /// Would `n` more reserved bytes exceed the physical capacity?
    pub(super) fn exceeds_capacity(&self, n: u64) -> bool {
        self.capacity
            .is_some_and(|c| self.reserved.saturating_add(n) > c)
    }

    // ---------------------------------------------------------------- segments

    /// A fresh address range of `size` bytes that overlaps no live segment.
    pub(super) fn synthetic_base(&mut self, size: u64) -> Result<u64, ReplayError> {
        loop {
            let base = self.next_synthetic;
            let end = base
                .checked_add(size)
                .and_then(|e| e.checked_add(ROUND_LARGE))
                .ok_or(ReplayError::AddressSpaceExhausted)?;
            self.next_synthetic = end.div_ceil(ROUND_LARGE) * ROUND_LARGE;
            if !self.overlaps(base, size) {
                return Ok(base);
            }
        }
    }

    fn overlaps(&self, base: u64, size: u64) -> bool {
        let end = base.saturating_add(size);
        if let Some((_, &e)) = self.live_ranges.range(..=base).next_back()
            && e > base
        {
            return true;
        }
        self.live_ranges.range(base..end).next().is_some()
    }

    pub(super) fn new_segment(&mut self, seg: Segment) -> u32 {
        self.live_ranges.insert(seg.base, seg.base + seg.size);
        self.segments.push(seg);
        self.stats.segments_allocated += 1;
        (self.segments.len() - 1) as u32
    }

    /// A new segment `seg` and one free block (`mapped` or not) spanning all of it;
    /// the block.
    pub(super) fn new_segment_block(&mut self, seg: Segment, mapped: bool) -> u32 {
        let s = self.new_segment(seg);
        self.new_block(Block::free(
            seg.base, seg.size, seg.stream, seg.pool, s, mapped,
        ))
    }

    pub(super) fn retire_segment(&mut self, s: u32) {
        let now = self.now_idx();
        let seg = &mut self.segments[s as usize];
        seg.released = Some(now);
        let base = seg.base;
        self.live_ranges.remove(&base);
        self.stats.segments_freed += 1;
    }

    /// `alloc_block`: a new segment (or expandable pages) for a request that found no
    /// free block. `Ok(None)` when the device limit or the memory fraction refuses it.
    fn alloc_block(
        &mut self,
        pool: PoolKind,
        stream: u64,
        size: u64,
        alloc_size: u64,
        recorded_addr: u64,
        is_retry: bool,
    ) -> Result<Option<u32>, ReplayError> {
        if is_retry {
            self.stats.alloc_retries += 1;
        }
        if let Some(allowed) = self.allowed
            && self.reserved.saturating_add(alloc_size) > allowed
        {
            return Ok(None);
        }
        if self.cfg.expandable_segments {
            return self.try_allocate_expandable(pool, stream, size);
        }
        if self.exceeds_capacity(alloc_size) {
            return Ok(None);
        }
        let base = match self.segment_bases {
            SegmentBases::Recorded
                if recorded_addr != 0
                    && recorded_addr.checked_add(alloc_size).is_some()
                    && !self.overlaps(recorded_addr, alloc_size) =>
            {
                recorded_addr
            }
            _ => self.synthetic_base(alloc_size)?,
        };
        let now = self.now_idx();
        let b = self.new_segment_block(
            Segment {
                base,
                size: alloc_size,
                stream,
                pool,
                page: 0,
                created: now,
                released: None,
            },
            true,
        );
        self.add_reserved(alloc_size);
        Ok(Some(b))
    }

    /// `release_block`: `cudaFree` of a whole free segment (in its pool).
    fn release_block(&mut self, i: u32) {
        self.remove_free(i);
        let b = *self.b(i);
        self.reserved -= b.size;
        self.retire_segment(b.segment);
        self.drop_block(i);
    }

    // ---------------------------------------------------------------- search

    /// `get_free_block` (§6.4).
    fn get_free_block(&mut self, p: usize, stream: u64, size: u64, gc_active: bool) -> Option<u32> {
        if gc_active {
            self.pools[p].free_calls += 1;
        }
        let found = {
            let mut it = self.pools[p].blocks.range((stream, size, 0, 0)..);
            let first = it.next()?;
            if first.0 != stream {
                return None;
            }
            let mut cur = *first;
            if self.is_expandable(cur.3) {
                if self.cfg.expandable_segments {
                    // Count a free tail next to unmapped space as its expandable size,
                    // so that it is chosen last.
                    for next in it {
                        if next.0 != stream
                            || !self.is_expandable(cur.3)
                            || self.expandable_size(next.3) >= self.expandable_size(cur.3)
                        {
                            break;
                        }
                        cur = *next;
                    }
                } else {
                    // Expandable segments were turned off: skip their blocks.
                    loop {
                        let next = it.next()?;
                        if next.0 != stream {
                            return None;
                        }
                        if !self.is_expandable(next.3) {
                            cur = *next;
                            break;
                        }
                    }
                }
            }
            cur.3
        };
        let bsize = self.b(found).size;
        let max_split = self.cfg.max_split();
        if size < max_split && bsize >= max_split {
            return None;
        }
        if size >= max_split && bsize >= size.saturating_add(self.cfg.max_non_split_rounding.get())
        {
            return None;
        }
        self.remove_free(found);
        Some(found)
    }

    fn expandable_size(&self, i: u32) -> u64 {
        let b = self.b(i);
        if b.next != NIL && !self.b(b.next).mapped {
            b.size + self.b(b.next).size
        } else {
            b.size
        }
    }

    fn should_split(&self, i: u32, size: u64) -> bool {
        let b = self.b(i);
        let rem = b.size - size;
        if b.pool == PoolKind::Small || self.cfg.expandable_segments {
            rem >= MIN_BLOCK_SIZE
        } else {
            size < self.cfg.max_split() && rem > SMALL_SIZE
        }
    }

    // ---------------------------------------------------------------- release

    /// `release_available_cached_blocks` (§6.7): with `max_split_size` set, free one
    /// cached block of at least `max(size, max_split)` on this stream, or else oversize
    /// blocks from the largest down until that much is freed.
    fn release_available_cached_blocks(&mut self, p: usize, stream: u64, size: u64) -> bool {
        let max_split = self.cfg.max_split();
        if max_split == u64::MAX {
            return false;
        }
        let key = size.max(max_split);
        let hit = self.pools[p]
            .blocks
            .range((stream, key, 0, 0)..)
            .next()
            .copied();
        match hit {
            Some(h) if h.0 == stream && !self.is_expandable(h.3) => {
                if self.is_split(h.3) {
                    return false;
                }
                self.release_block(h.3);
                true
            }
            _ => {
                let candidates: Vec<(u64, u32)> = self.pools[p]
                    .blocks
                    .range(..(stream, key, 0, 0))
                    .rev()
                    .take_while(|k| k.0 == stream && k.1 >= max_split)
                    .map(|k| (k.1, k.3))
                    .collect();
                let mut released = 0u64;
                for (bsize, i) in candidates {
                    if released >= key {
                        break;
                    }
                    // Oversize blocks are whole segments; a split one is left alone.
                    if !self.is_expandable(i) && !self.is_split(i) {
                        self.release_block(i);
                        released += bsize;
                    }
                }
                released >= key
            }
        }
    }

    /// `release_cached_blocks` (§6.7): complete every event-pending free, then give back
    /// every whole free segment and unmap every free expandable page.
    fn release_cached_blocks(&mut self) -> Result<(), ReplayError> {
        for b in std::mem::take(&mut self.pending) {
            self.free_block(b);
        }
        for p in [pool_index(PoolKind::Large), pool_index(PoolKind::Small)] {
            let items: Vec<u32> = self.pools[p].blocks.iter().map(|k| k.3).collect();
            let mut to_unmap = Vec::new();
            for i in items {
                if self.is_expandable(i) {
                    to_unmap.push(i);
                } else if !self.is_split(i) {
                    self.release_block(i);
                }
            }
            for i in to_unmap {
                self.unmap_block(i)?;
                if !self.b(i).mapped && !self.is_split(i) {
                    self.release_expandable_segment(i);
                }
            }
        }
        Ok(())
    }

    /// `garbage_collect_cached_blocks` (§6.10).
    fn garbage_collect(&mut self) {
        let (Some(allowed), Some(gc)) = (self.allowed, self.cfg.garbage_collection_threshold)
        else {
            return;
        };
        let threshold = (gc * allowed as f64) as u64;
        if self.reserved <= threshold {
            return;
        }
        let target = self.reserved - threshold;
        let p = pool_index(PoolKind::Large);
        let calls = self.pools[p].free_calls;
        let mut total_age = 0u64;
        let mut count = 0u64;
        for k in &self.pools[p].blocks {
            if !self.is_split(k.3) {
                total_age += calls - self.b(k.3).gc_base;
                count += 1;
            }
        }
        if count == 0 {
            return;
        }
        self.stats.gc_runs += 1;
        let mut reclaimed = 0u64;
        let mut freed = true;
        while reclaimed < target && freed && count > 0 {
            let age_threshold = total_age as f64 / count as f64;
            freed = false;
            let items: Vec<u32> = self.pools[p].blocks.iter().map(|k| k.3).collect();
            for i in items {
                let age = calls - self.b(i).gc_base;
                if !self.is_split(i) && !self.is_expandable(i) && age as f64 >= age_threshold {
                    freed = true;
                    reclaimed += self.b(i).size;
                    total_age -= age;
                    count -= 1;
                    self.release_block(i);
                }
            }
        }
    }

    // ---------------------------------------------------------------- API

    /// `malloc(orig_size, stream)` for allocation `alloc`.
    pub fn malloc(
        &mut self,
        alloc: AllocId,
        orig: u64,
        stream: u64,
        recorded_addr: u64,
    ) -> Result<(), ReplayError> {
        let size = self.cfg.round_size(Bytes(orig)).get();
        let pool = if size <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        let p = pool_index(pool);
        let alloc_size = self.cfg.allocation_size(Bytes(size)).get();
        let gc_active = self.allowed.is_some() && self.cfg.garbage_collection_threshold.is_some();

        let mut block = self.get_free_block(p, stream, size, gc_active);
        if block.is_none() {
            if gc_active {
                self.garbage_collect();
            }
            block = self.alloc_block(pool, stream, size, alloc_size, recorded_addr, false)?;
            if block.is_none() && self.release_available_cached_blocks(p, stream, size) {
                block = self.alloc_block(pool, stream, size, alloc_size, recorded_addr, false)?;
            }
            if block.is_none() {
                self.release_cached_blocks()?;
                block = self.alloc_block(pool, stream, size, alloc_size, recorded_addr, true)?;
            }
        }
        let Some(mut b) = block else {
            return Err(ReplayError::OutOfMemory {
                alloc,
                event: self.now.map(EventIdx),
                requested: Bytes(orig),
                rounded: Bytes(size),
                reserved: Bytes(self.reserved),
                allocated: Bytes(self.allocated),
                limit: Bytes(
                    self.capacity
                        .unwrap_or(u64::MAX)
                        .min(self.allowed.unwrap_or(u64::MAX)),
                ),
            });
        };

        if self.should_split(b, size) {
            let r = *self.b(b);
            let head = self.new_block(Block {
                prev: r.prev,
                next: b,
                ..Block::free(r.ptr, size, stream, pool, r.segment, true)
            });
            if r.prev != NIL {
                self.bm(r.prev).next = head;
            }
            let rem = self.bm(b);
            rem.prev = head;
            rem.ptr += size;
            rem.size -= size;
            self.insert_free(b);
            b = head;
        }

        let bsize = self.b(b).size;
        let (ptr, segment) = (self.b(b).ptr, self.b(b).segment);
        let span = match &mut self.spans {
            Some(spans) => {
                spans.push(BlockSpan {
                    alloc,
                    segment,
                    offset: Bytes(ptr - self.segments[segment as usize].base),
                    size: Bytes(bsize),
                    requested: Bytes(orig),
                    start: EventIdx(self.now.unwrap_or(0)),
                    end: None,
                });
                (spans.len() - 1) as u32
            }
            None => NIL,
        };
        let blk = self.bm(b);
        blk.state = State::Allocated;
        blk.requested = orig;
        blk.alloc = alloc.0;
        blk.span = span;
        self.block_of[alloc.index()] = b;

        self.stats.allocations += 1;
        self.allocated += bsize;
        self.requested += orig;
        self.active += bsize;
        let s = &mut self.stats;
        s.peak_allocated = s.peak_allocated.max(Bytes(self.allocated));
        s.peak_requested = s.peak_requested.max(Bytes(self.requested));
        s.peak_active = s.peak_active.max(Bytes(self.active));
        Ok(())
    }

    /// `free()`: the tensor died. The block stops counting as allocated; it returns to
    /// the pool now unless `completes_later` (a `FreeCompleted` event follows).
    pub fn free_requested(
        &mut self,
        alloc: AllocId,
        completes_later: bool,
    ) -> Result<(), ReplayError> {
        let b = self.live_block(alloc)?;
        if self.b(b).state != State::Allocated {
            return Err(ReplayError::Internal(
                "free of a block that is not allocated",
            ));
        }
        self.allocated -= self.b(b).size;
        if completes_later {
            self.bm(b).state = State::Pending;
            self.pending.insert(b);
        } else {
            self.free_block(b);
        }
        Ok(())
    }

    /// The free completed: the block goes back to the pool (if an OOM retry has not
    /// already drained it).
    pub fn free_completed(&mut self, alloc: AllocId) -> Result<(), ReplayError> {
        let b = self.block_of[alloc.index()];
        if b == NIL {
            return Ok(()); // already returned by `synchronize_and_free_events`
        }
        match self.b(b).state {
            State::Pending => {
                self.pending.remove(&b);
            }
            State::Allocated => self.allocated -= self.b(b).size,
            State::Free => return Err(ReplayError::Internal("free of a free block")),
        }
        self.free_block(b);
        Ok(())
    }

    fn live_block(&self, alloc: AllocId) -> Result<u32, ReplayError> {
        match self.block_of.get(alloc.index()) {
            Some(&b) if b != NIL => Ok(b),
            _ => Err(ReplayError::Internal(
                "free of an allocation that is not live",
            )),
        }
    }

    /// `free_block`: back to the pool, merged with free neighbours.
    fn free_block(&mut self, b: u32) {
        let blk = *self.b(b);
        self.requested -= blk.requested;
        self.active -= blk.size;
        if blk.alloc != NIL {
            self.block_of[blk.alloc as usize] = NIL;
        }
        if let (Some(spans), true) = (&mut self.spans, blk.span != NIL) {
            spans[blk.span as usize].end = Some(EventIdx(self.now.unwrap_or(0)));
        }
        let m = self.bm(b);
        m.state = State::Free;
        m.alloc = NIL;
        m.span = NIL;
        m.requested = 0;
        self.try_merge(b, blk.prev);
        let next = self.b(b).next;
        self.try_merge(b, next);
        self.insert_free(b);
    }

    /// The counters at the end, and the layout if it was recorded.
    pub fn finish(
        mut self,
    ) -> (
        ReplayStats,
        Option<Vec<SegmentSpan>>,
        Option<Vec<BlockSpan>>,
    ) {
        self.stats.final_reserved = Bytes(self.reserved);
        self.stats.final_allocated = Bytes(self.allocated);
        let segments = self.spans.is_some().then(|| {
            self.segments
                .iter()
                .map(|s| SegmentSpan {
                    base: s.base,
                    size: Bytes(s.size),
                    stream: stweaver_core::StreamId(s.stream),
                    pool: s.pool,
                    expandable: s.page != 0,
                    created: EventIdx(s.created),
                    released: s.released.map(EventIdx),
                })
                .collect()
        });
        (self.stats, segments, self.spans)
    }

    /// Checks the §6.12 invariants and the block links (for tests): reserved = Σ live
    /// segment bytes (mapped bytes for expandable), allocated = Σ allocated blocks, every
    /// free block is in exactly the right set, neighbours are linked both ways and
    /// contiguous, and no two free neighbours of the same mapped state are unmerged.
    #[cfg(test)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let dropped: std::collections::HashSet<u32> = self.free_slots.iter().copied().collect();
        let mut allocated = 0u64;
        let mut mapped = 0u64;
        let mut in_sets = 0usize;
        for (i, b) in self.blocks.iter().enumerate() {
            let i = i as u32;
            if dropped.contains(&i) {
                continue;
            }
            if self.segments[b.segment as usize].released.is_some() {
                return Err(format!("block {i} in a released segment"));
            }
            if b.mapped {
                mapped += b.size;
            }
            if b.state == State::Allocated {
                allocated += b.size;
            }
            let p = &self.pools[pool_index(b.pool)];
            let in_blocks = p.blocks.contains(&(b.stream, b.size, b.ptr, i));
            let in_unmapped = p.unmapped.contains(&(b.stream, b.ptr, i));
            let want = b.state == State::Free;
            if (in_blocks || in_unmapped) != want || (want && in_blocks != b.mapped) {
                return Err(format!(
                    "block {i} {b:?}: in blocks {in_blocks}, unmapped {in_unmapped}"
                ));
            }
            in_sets += usize::from(in_blocks || in_unmapped);
            if b.next != NIL {
                let n = self.b(b.next);
                if n.prev != i || b.ptr + b.size != n.ptr {
                    return Err(format!("block {i} and next {} are not linked", b.next));
                }
                if b.state == State::Free && n.state == State::Free && b.mapped == n.mapped {
                    return Err(format!("free blocks {i} and {} are not merged", b.next));
                }
            }
        }
        let set_len: usize = self
            .pools
            .iter()
            .map(|p| p.blocks.len() + p.unmapped.len())
            .sum();
        if set_len != in_sets {
            return Err(format!(
                "pool sets hold {set_len} entries, {in_sets} blocks are free"
            ));
        }
        if allocated != self.allocated {
            return Err(format!("allocated {} != sum {allocated}", self.allocated));
        }
        let live_non_exp: u64 = self
            .segments
            .iter()
            .filter(|s| s.released.is_none() && s.page == 0)
            .map(|s| s.size)
            .sum();
        let mapped_exp = mapped - {
            let mut m = 0;
            for (i, b) in self.blocks.iter().enumerate() {
                if !dropped.contains(&(i as u32))
                    && b.mapped
                    && self.segments[b.segment as usize].page == 0
                {
                    m += b.size;
                }
            }
            m
        };
        if live_non_exp + mapped_exp != self.reserved {
            return Err(format!(
                "reserved {} != segments {live_non_exp} + mapped {mapped_exp}",
                self.reserved
            ));
        }
        Ok(())
    }
}

pub(super) fn pool_index(p: PoolKind) -> usize {
    match p {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}
