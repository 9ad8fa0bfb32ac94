//! The arenas' side of pause / resume (`Engine::pause`, module `engine::pause`).
//!
//! A **group** is a maximal run of consecutive mapped units of one arena joined by a
//! block that is not free straddling the boundary between two of them: the smallest
//! ranges that can be given back without cutting a live block (invariant 9: a unit is
//! unmapped whole). Pausing a group marks every block in it `Paused` (free blocks
//! crossing its ends are split there, the part inside becomes a paused *filler* with
//! `requested == 0`), takes its units out of the arena's unit map (they are mapped again,
//! one device `map` per unit, by resume) and leaves everything outside untouched. Paused
//! blocks are neither free nor unmapped, so no best fit, growth, release or claim ever
//! touches them: the addresses stay reserved and never handed out.

use super::{ArenaId, Arenas, BlockState, Idx, NIL, SlabFull};

/// One paused group of an arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PausedGroup {
    pub arena: ArenaId,
    pub lo: u64,
    pub hi: u64,
    /// Its units, in address order (each one device `map` at resume).
    pub units: Vec<(u64, u64)>,
    /// Its `Paused` blocks in address order; the live ones have `requested > 0`.
    pub blocks: Vec<Idx>,
}

/// A group found by [`Arenas::unit_groups`]: its range and the blocks meeting it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Group {
    pub lo: u64,
    pub hi: u64,
    pub blocks: Vec<Idx>,
}

impl Arenas {
    /// The groups of arena `a` (module docs), in address order, with the blocks meeting
    /// each (a free block may meet two). Changes nothing. O(blocks · log units + units).
    pub fn unit_groups(&self, a: ArenaId) -> Vec<Group> {
        let Some(arena) = self.arena(a) else {
            return Vec::new();
        };
        // Unit boundaries a non-free mapped block straddles (ascending).
        let mut joined: Vec<u64> = Vec::new();
        for (_, b) in self.arena_blocks(a) {
            if b.state.is_mapped() && b.state != BlockState::Free {
                joined.extend(
                    arena
                        .units
                        .range(b.addr + 1..b.addr + b.size)
                        .map(|(&s, _)| s),
                );
            }
        }
        let mut groups: Vec<Group> = Vec::new();
        let mut j = joined.iter().peekable();
        for (&s, &e) in &arena.units {
            while j.next_if(|&&x| x < s).is_some() {}
            match groups.last_mut() {
                Some(g) if g.hi == s && j.peek() == Some(&&s) => g.hi = e,
                _ => groups.push(Group {
                    lo: s,
                    hi: e,
                    blocks: Vec::new(),
                }),
            }
        }
        let mut g = 0;
        for (i, b) in self.arena_blocks(a) {
            let end = b.addr + b.size;
            while g < groups.len() && groups[g].hi <= b.addr {
                g += 1;
            }
            let mut h = g;
            while h < groups.len() && groups[h].lo < end {
                groups[h].blocks.push(i);
                h += 1;
            }
        }
        groups
    }

    /// Pauses group `[lo, hi)` of arena `a` (module docs), found from `anchor`, an
    /// `Allocated` block inside it; every block meeting it must be `Allocated` or `Free`
    /// (the caller checked). The units are taken out of the unit map (the caller unmaps
    /// them). A full slab leaves the group as it was. O(blocks of the group · log n).
    pub fn pause_group(
        &mut self,
        a: ArenaId,
        lo: u64,
        hi: u64,
        anchor: Idx,
    ) -> Result<PausedGroup, SlabFull> {
        let mut b = anchor;
        while self.blocks[b as usize].addr > lo {
            b = self.blocks[b as usize].prev;
        }
        let mut out: Vec<Idx> = Vec::new();
        while b != NIL && self.blocks[b as usize].addr < hi {
            let (addr, size, state) = {
                let x = &self.blocks[b as usize];
                (x.addr, x.size, x.state)
            };
            let m = match state {
                BlockState::Free => {
                    match self.carve_unmapping(a, b, addr.max(lo), (addr + size).min(hi)) {
                        Ok(m) => {
                            self.blocks[m as usize].requested = 0;
                            m
                        }
                        Err(e) => {
                            self.unpause_blocks(&out);
                            return Err(e);
                        }
                    }
                }
                _ => {
                    debug_assert_eq!(state, BlockState::Allocated);
                    b
                }
            };
            self.blocks[m as usize].state = BlockState::Paused;
            out.push(m);
            b = self.blocks[m as usize].next;
        }
        let units = &mut self.arena_mut(a).units;
        let taken: Vec<(u64, u64)> = units.range(lo..hi).map(|(&s, &e)| (s, e)).collect();
        for (s, _) in &taken {
            units.remove(s);
        }
        Ok(PausedGroup {
            arena: a,
            lo,
            hi,
            units: taken,
            blocks: out,
        })
    }

    /// Ends the pause of `g` (its units mapped again by the caller): the units go back
    /// into the unit map, live blocks become `Allocated`, fillers free memory again
    /// (coalesced). O(blocks of the group · log n).
    pub fn resume_group(&mut self, g: &PausedGroup) {
        let units = &mut self.arena_mut(g.arena).units;
        for &(s, e) in &g.units {
            units.insert(s, e);
        }
        self.unpause_blocks(&g.blocks);
    }

    fn unpause_blocks(&mut self, blocks: &[Idx]) {
        // Live blocks first, so that a filler coalesces only with free memory.
        for &i in blocks {
            if self.blocks[i as usize].requested > 0 {
                self.blocks[i as usize].state = BlockState::Allocated;
            }
        }
        for &i in blocks {
            if self.blocks[i as usize].requested == 0 {
                self.blocks[i as usize].state = BlockState::Free;
                self.settle_free(i);
            }
        }
    }
}
