//! The consistency check: every invariant of the module docs (`super`) recomputed
//! from the blocks themselves, with per-pool totals the engine compares its stats
//! against (`Engine::check_invariants`). O(blocks + units) per arena; never on the hot
//! path.

use super::{ALIGNMENT, ArenaId, Arenas, BlockState, Idx, NIL, pool_index};

/// Per-pool totals computed by `Arenas::check` from the blocks themselves.
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

impl Arenas {
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

    /// Checks the invariants of the arena module documentation for every arena and returns
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
