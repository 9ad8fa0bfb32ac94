//! The plan verifier against a brute-force oracle: random small plans, checked pairwise
//! over a long unrolled timeline. Both must agree on valid vs invalid.

use proptest::prelude::*;
use stweaver_core::verify::verify_plan;
use stweaver_core::{Bytes, DeviceId, NEVER_FREED, Plan};

use stweaver_core::testkit::planned as req;

/// Pairwise check over `k` iterations: true when no two live requests overlap.
fn brute_force_ok(plan: &Plan, k: u64) -> bool {
    let p = plan.prologue_len;
    let l = plan.iteration_len;
    let mut items: Vec<(u64, u64, u64, u64)> = Vec::new(); // (t0, t1, lo, hi)
    for r in &plan.prologue {
        items.push((r.start, r.end, r.offset.0, r.offset.0 + r.size.0));
    }
    for i in 0..k {
        for r in &plan.iteration {
            let b = p + i * l;
            items.push((b + r.start, b + r.end, r.offset.0, r.offset.0 + r.size.0));
        }
    }
    for (i, a) in items.iter().enumerate() {
        for b in &items[i + 1..] {
            let time = a.0 < b.1 && b.0 < a.1;
            let space = a.2 < b.3 && b.2 < a.3;
            if time && space {
                return false;
            }
        }
    }
    true
}

fn arb_plan() -> impl Strategy<Value = Plan> {
    let l = 1u64..6;
    let p = 0u64..6;
    (l, p).prop_flat_map(|(l, p)| {
        let pro = proptest::collection::vec(
            (
                1u64..4,
                0u64..6,
                0u64..p.max(1),
                prop_oneof![Just(None), (1u64..12).prop_map(Some)],
            ),
            0..4,
        );
        let it = proptest::collection::vec((1u64..4, 0u64..6, 0u64..l, 1u64..(2 * l + 1)), 0..6);
        (Just(l), Just(p), pro, it).prop_map(|(l, p, pro, it)| Plan {
            device: DeviceId(0),
            alignment: Bytes(1),
            pool_size: Bytes(64),
            lower_bound: Bytes(0),
            trace_digest: 0,
            prologue: pro
                .into_iter()
                .filter(|_| p > 0)
                .map(|(s, o, st, len)| req(s, o, st, len.map_or(NEVER_FREED, |len| st + len)))
                .collect(),
            prologue_len: p,
            iteration: it
                .into_iter()
                .map(|(s, o, st, len)| req(s, o, st, st + len))
                .collect(),
            iteration_len: l,
            dynamic: Default::default(),
            ..Default::default()
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn verifier_agrees_with_brute_force(plan in arb_plan()) {
        // Finite prologue requests end by tick 6 + 12; iteration spans are at most 2L;
        // 30 iterations cover every pair the pattern can produce.
        let brute = brute_force_ok(&plan, 30);
        let fast = verify_plan(&plan);
        prop_assert_eq!(brute, fast.is_ok(), "verifier said {:?}", fast);
    }
}
