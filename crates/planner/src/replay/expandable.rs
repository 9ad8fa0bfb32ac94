//! `expandable_segments:True` (research `pytorch-allocator-2.11.md` §5.1, §6.11).
//!
//! Each (stream, pool) gets one virtual segment, reserved lazily with room for
//! `ceil(1.125 × device memory / page)` pages, where a page is 2 MiB in the small pool
//! and `large_segment_size` (20 MiB by default) in the large pool. Reserved memory is
//! the mapped pages only. Blocks of the segment are the usual linked list, except that
//! some are *unmapped* (kept in the pool's `(stream, address)` set).
//!
//! When best fit finds nothing, `find_expandable_block` takes the lowest-addressed
//! unmapped block of the stream (or the free block right before it) that, together with
//! the free and unmapped blocks following it, covers the request; `map_block` maps only
//! the pages the request needs (`round_size` bytes, not the allocation size), splitting
//! off the unmapped rest and merging with free mapped neighbours. `unmap_block` (only on
//! the release path: OOM retry) unmaps the pages lying wholly inside a free block and
//! gives back a segment that ends up completely unmapped.
//!
//! Cost: O(log n) per map or unmap plus the walk over adjacent free blocks, which is
//! one or two steps in practice (free mapped and unmapped blocks alternate).

use super::ReplayError;
use super::config::SMALL_BUFFER;
use super::native::{Block, Engine, NIL, Segment, State, pool_index};
use super::stats::PoolKind;

impl Engine<'_> {
    /// `try_allocate_expandable_block`: a free mapped block of at least `size` bytes,
    /// out of the pool sets, or `None` if mapping hit the device limit.
    pub(super) fn try_allocate_expandable(
        &mut self,
        pool: PoolKind,
        stream: u64,
        size: u64,
    ) -> Result<Option<u32>, ReplayError> {
        let mut c = self.find_expandable_block(pool, stream, size)?;
        if !self.b(c).mapped {
            let len = self.b(c).size.min(size);
            if !self.map_block(c, len)? {
                return Ok(None);
            }
        }
        while self.b(c).size < size {
            let n = self.b(c).next;
            if n == NIL || self.b(n).mapped || self.b(n).state != State::Free {
                return Err(ReplayError::Internal(
                    "expandable candidate is not followed by unmapped space",
                ));
            }
            let len = (size - self.b(c).size).min(self.b(n).size);
            if !self.map_block(n, len)? {
                return Ok(None);
            }
            // `n` absorbed `c` when it merged with its free predecessor.
            c = n;
        }
        self.remove_free(c);
        Ok(Some(c))
    }

    /// `find_expandable_block`.
    fn find_expandable_block(
        &mut self,
        pool: PoolKind,
        stream: u64,
        size: u64,
    ) -> Result<u32, ReplayError> {
        let p = pool_index(pool);
        let allocatable = |e: &Self, i: u32| i != NIL && e.b(i).state == State::Free;
        let has_space = |e: &Self, mut i: u32| {
            let mut bytes = 0u64;
            while bytes < size && allocatable(e, i) {
                bytes += e.b(i).size;
                i = e.b(i).next;
            }
            bytes >= size
        };
        let mut found = None;
        for &(s, _, u) in self.pools[p].unmapped.range((stream, 0, 0)..) {
            if s != stream {
                break;
            }
            let prev = self.b(u).prev;
            let c = if allocatable(self, prev) { prev } else { u };
            if has_space(self, c) {
                found = Some(c);
                break;
            }
        }
        if let Some(c) = found {
            return Ok(c);
        }
        // A new segment: VA for 1 1/8 of the device memory, in pages.
        let page = match pool {
            PoolKind::Small => SMALL_BUFFER,
            PoolKind::Large => self.cfg.large_segment_size.get(),
        };
        let dm = self.device_memory;
        let va = (dm + dm / 8).div_ceil(page).max(1) * page;
        let base = self.synthetic_base(va)?;
        let now = self.now.unwrap_or(0);
        let b = self.new_segment_block(
            Segment {
                base,
                size: va,
                stream,
                pool,
                page,
                created: now,
                released: None,
            },
            false,
        );
        self.insert_unmapped(b);
        Ok(b)
    }

    /// `map_block(b, len)`: maps the pages covering `[b.ptr, b.ptr + len)` of the
    /// unmapped block `b`; the block becomes free and mapped and enters the pool.
    /// `false` if the device limit refuses the pages.
    fn map_block(&mut self, b: u32, len: u64) -> Result<bool, ReplayError> {
        let blk = *self.b(b);
        let seg = self.segments[blk.segment as usize];
        let page = seg.page;
        let begin = (blk.ptr - seg.base) / page;
        let end = (blk.ptr + len - seg.base).div_ceil(page);
        let msize = ((end - begin) * page).min(blk.size);
        if msize == 0 {
            return Err(ReplayError::Internal("mapping zero bytes"));
        }
        if self.exceeds_capacity(msize) {
            return Ok(false);
        }
        self.remove_unmapped(b);
        self.bm(b).mapped = true;
        if msize < blk.size {
            let rest = self.new_block(Block {
                ptr: blk.ptr + msize,
                size: blk.size - msize,
                prev: b,
                next: blk.next,
                mapped: false,
                state: State::Free,
                ..blk
            });
            if blk.next != NIL {
                self.bm(blk.next).prev = rest;
            }
            let m = self.bm(b);
            m.next = rest;
            m.size = msize;
            self.insert_unmapped(rest);
        }
        let prev = self.b(b).prev;
        self.try_merge(b, prev);
        let next = self.b(b).next;
        self.try_merge(b, next);
        self.insert_free(b);
        self.add_reserved(msize);
        self.stats.segment_maps += 1;
        self.stats.bytes_mapped += stweaver_core::Bytes(msize);
        Ok(true)
    }

    /// `unmap_block(b)`: unmaps the pages wholly inside the free mapped block `b`
    /// (in the pool); mapped remnants before and after stay free blocks.
    pub(super) fn unmap_block(&mut self, b: u32) -> Result<(), ReplayError> {
        let blk = *self.b(b);
        if blk.state != State::Free || !blk.mapped {
            return Err(ReplayError::Internal(
                "unmapping a block that is not free and mapped",
            ));
        }
        let seg = self.segments[blk.segment as usize];
        let page = seg.page;
        let begin = (blk.ptr - seg.base).div_ceil(page);
        let end = (blk.ptr + blk.size - seg.base) / page;
        if begin >= end {
            return Ok(());
        }
        let uptr = seg.base + begin * page;
        let usize_ = (end - begin) * page;
        self.remove_free(b);
        let before = uptr - blk.ptr;
        if before > 0 {
            let bf = self.new_block(Block {
                ptr: blk.ptr,
                size: before,
                prev: blk.prev,
                next: b,
                ..blk
            });
            if blk.prev != NIL {
                self.bm(blk.prev).next = bf;
            }
            self.bm(b).prev = bf;
            self.insert_free(bf);
        }
        let after = blk.size - before - usize_;
        if after > 0 {
            let next = self.b(b).next;
            let af = self.new_block(Block {
                ptr: uptr + usize_,
                size: after,
                prev: b,
                next,
                ..blk
            });
            if next != NIL {
                self.bm(next).prev = af;
            }
            self.bm(b).next = af;
            self.insert_free(af);
        }
        let m = self.bm(b);
        m.ptr = uptr;
        m.size = usize_;
        m.mapped = false;
        let prev = self.b(b).prev;
        self.try_merge(b, prev);
        let next = self.b(b).next;
        self.try_merge(b, next);
        self.insert_unmapped(b);
        self.reserved -= usize_;
        self.stats.segment_unmaps += 1;
        self.stats.bytes_unmapped += stweaver_core::Bytes(usize_);
        Ok(())
    }

    /// `release_expandable_segment`: the segment is one unmapped block; drop it.
    pub(super) fn release_expandable_segment(&mut self, b: u32) {
        self.remove_unmapped(b);
        let seg = self.b(b).segment;
        self.retire_segment(seg);
        self.drop_block(b);
    }
}
