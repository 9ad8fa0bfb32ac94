//! Tests of the arenas: best fit, growth, release, placement and claims against
//! interval and set models.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeSet;

const G: u64 = 4096;
const BASE: u64 = 1 << 30;

fn one_arena(len: u64) -> (Arenas, ArenaId) {
    let mut h = Arenas::new(G);
    let a = h
        .add_arena(StreamId(0), PoolKind::Small, BASE, len)
        .unwrap();
    (h, a)
}

fn grow(h: &mut Arenas, a: ArenaId, size: u64) -> u64 {
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
    let (mut h, a) = one_arena(16 * G);
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
    let (mut h, a) = one_arena(64 * G);
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
    let mut h = Arenas::new(G);
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
    let (mut h, a) = one_arena(16 * G);
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
    let (mut h, a) = one_arena(16 * G);
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
    let (mut h, a) = one_arena(16 * G);
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
    let (mut h, a) = one_arena(8 * G);
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

fn placement_arena(len: u64) -> (Arenas, ArenaId) {
    let mut h = Arenas::new(G);
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
    let (mut h2, b) = one_arena(4 * G);
    grow(&mut h2, b, 4 * G);
    assert_eq!(h2.alloc_at(b, BASE, 512, 1).unwrap(), None);
}

#[test]
fn claim_takes_exact_ranges_of_any_arena_and_refuses_the_rest() {
    let (mut h, a) = one_arena(16 * G);
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
    /// starting hint, and the arenas stay consistent.
    #[test]
    fn claim_matches_an_interval_model(
        ops in proptest::collection::vec((0u64..64, 1u64..=8, any::<bool>(), any::<u8>()), 1..200)
    ) {
        let (mut h, a) = one_arena(16 * G);
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
    /// arenas' invariants hold after every step.
    #[test]
    fn arenas_match_a_set_model(ops in proptest::collection::vec(op(), 1..200)) {
        let (mut h, a) = one_arena(64 * G);
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

#[test]
fn pool_units_are_aligned_64_mib_chunks_with_ragged_ends() {
    use super::growth::{POOL_UNIT, pool_units};
    const M: u64 = 1 << 20;
    // Inside one chunk: one unit.
    assert_eq!(
        pool_units(2 * M, 4 * M, POOL_UNIT).collect::<Vec<_>>(),
        vec![(2 * M, 6 * M)]
    );
    // Across chunks: the ragged head, the whole chunks, the ragged tail.
    let u: Vec<_> = pool_units(60 * M, 200 * M, POOL_UNIT).collect();
    assert_eq!(
        u,
        vec![
            (60 * M, 64 * M),
            (64 * M, 128 * M),
            (128 * M, 192 * M),
            (192 * M, 256 * M),
            (256 * M, 260 * M)
        ]
    );
    assert!(u.windows(2).all(|w| w[0].1 == w[1].0));
    assert!(u.iter().all(|&(a, b)| b - a <= POOL_UNIT));
    // Exactly one chunk.
    assert_eq!(
        pool_units(POOL_UNIT, POOL_UNIT, POOL_UNIT).collect::<Vec<_>>(),
        vec![(POOL_UNIT, 2 * POOL_UNIT)]
    );
    // Unit 0: the whole range.
    assert_eq!(
        pool_units(60 * M, 200 * M, 0).collect::<Vec<_>>(),
        vec![(60 * M, 260 * M)]
    );
}
