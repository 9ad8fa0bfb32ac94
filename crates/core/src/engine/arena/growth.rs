//! Growth: where an arena maps more memory, and the `Mapping` blocks carved out for it.
//!
//! **Growth** (`Arenas::carve_growth`): when nothing fits, take the run of free and
//! unmapped space big enough for the request that needs the fewest bytes mapped,
//! lowest address on ties, and carve out the granules that must be mapped — only the
//! ones the request needs, not a fixed segment size. Until something is released the
//! only run is the free tail plus the unmapped end (PyTorch's `find_expandable_block`);
//! after a release, a gap it left in the middle of the arena (with the free blocks
//! around it) is re-mapped when it is the cheaper place, instead of the tail growing.
//! O(unmapped blocks · run length). The caller maps them with the lock released,
//! then `Arenas::finish_mapping` turns them into free memory and records their mapped
//! units (invariant 6: one per granule online, one per block in a pinned placement
//! arena, `Arenas::whole_unit_mapping`).
//!
//! The plan pool maps exact ranges as they are first touched (`Arenas::carve_range`,
//! O(log n + blocks carved)) and grows at its tail (`Arenas::tail_run`,
//! `Arenas::lowest_run`).

use super::{ArenaId, Arenas, BlockState, GrowthFailure, Idx, NIL, SlabFull};

impl Arenas {
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

    /// Carves the unmapped parts of the granules covering `[addr, addr + size)` of arena
    /// `a` out as `Mapping` blocks (returned in address order), for the caller to map
    /// and finish with `Arenas::finish_mapping`. O(log n + blocks carved).
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
    /// that holds `size` bytes (where `Arenas::carve_growth` would grow), or `None`.
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

    /// Where `Arenas::carve_growth` grows arena `a` for `size` bytes: of the runs of free
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
    /// would use (`Arenas::carve_growth`: the free edges and the unmapped blocks of its
    /// run), or `None` if it cannot grow.
    pub fn growth_run(&self, a: ArenaId, size: u64) -> Option<(u64, u64)> {
        self.growth_run_block(a, size)
            .map(|(s, end)| (self.blocks[s as usize].addr, end))
    }

    /// Finds the run of free and unmapped blocks in arena `a` that holds `size` bytes with
    /// the fewest bytes to map (`Arenas::growth_run_block`), and carves out the granules of
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
        let unit = self.mapping_unit(self.blocks[i as usize].arena);
        self.finish_mapping_as(i, mapped, unit);
    }

    /// [`Arenas::finish_mapping`] for a block mapped in units of `unit` bytes
    /// (`pool_units`; [`Arenas::mapping_unit`] when the caller started the mapping).
    pub fn finish_mapping_as(&mut self, i: Idx, mapped: bool, unit: u64) {
        debug_assert_eq!(self.blocks[i as usize].state, BlockState::Mapping);
        if mapped {
            let (a, addr, size) = {
                let b = &self.blocks[i as usize];
                (b.arena, b.addr, b.size)
            };
            self.arena_mut(a).units.extend(pool_units(addr, size, unit));
            self.blocks[i as usize].state = BlockState::Free;
            self.settle_free(i);
        } else {
            self.settle_unmapped(i);
        }
    }

    /// Whether a `Mapping` block of arena `a` is mapped in large units (`pool_units`:
    /// one device `map` call each, one physical allocation on CUDA, faster for the
    /// kernels that use it) rather than one unit per granule. Placement arenas (the plan
    /// pool) map large units: they are pinned, so only what their plan did not foresee
    /// is ever released from them while they serve (module `engine::release`). Online arenas, a
    /// placement arena no longer pinned (its plan given up or unloaded), and every arena
    /// under a memory limit (`Arenas::set_fine_units`) map granule by granule, so that a
    /// release can give back any free granule.
    pub fn whole_unit_mapping(&self, a: ArenaId) -> bool {
        !self.fine_units
            && self
                .arena(a)
                .is_some_and(|x| x.free_by_addr.is_some() && x.pinned)
    }

    /// The unit a `Mapping` block of arena `a` is mapped in (`pool_units`): the pool's
    /// piece size ([`Arenas::set_pool_unit`]) where [`Arenas::whole_unit_mapping`], else a
    /// granule.
    pub fn mapping_unit(&self, a: ArenaId) -> u64 {
        if self.whole_unit_mapping(a) {
            self.pool_unit
        } else {
            self.granule
        }
    }
}

/// The largest unit the plan pool maps by default (`pool_units`,
/// `EngineConfig::pool_unit`): 64 MiB. Streaming copies over handles of 64 MiB run within
/// 0.4 % of `cudaMalloc` memory (1.17 x over 2 MiB handles; BENCHMARKS.md, "Mapping
/// granularity, swept"), and a release can give back a 64 MiB piece of a large
/// first-touched range that a small unplanned tensor shares: with one unit per range,
/// len5new (lengths first seen after auto's switch) reached 1.088 x the lower bound in
/// its replay, against 1.006 x (BENCHMARKS.md, session 16).
pub const POOL_UNIT: u64 = 64 << 20;

/// The units a mapping of `[addr, addr + size)` in units of `unit` bytes makes (`addr`
/// and `size` whole granules): the whole `unit`-aligned chunks it covers, and the ragged
/// pieces at its ends as one unit each (with `unit` a granule: every granule); `unit` 0:
/// the whole range as one unit. `(start, end)` pairs in address order; no allocation.
pub(crate) fn pool_units(addr: u64, size: u64, unit: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = addr + size;
    let mut at = addr;
    std::iter::from_fn(move || {
        (at < end).then(|| {
            let next = at
                .checked_div(unit)
                .map_or(end, |k| (k + 1).saturating_mul(unit).min(end));
            let piece = (at, next);
            at = next;
            piece
        })
    })
}
