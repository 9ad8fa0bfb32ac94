//! Private-pool checkpoints through the bridge (what `getCheckpointState` /
//! `setCheckpointPoolState` call), over host memory.

mod common;

use common::{DEFAULT, MIB, S0, online_runtime};
use stweaver_torch::ffi::bridge::{HistoryAction, PoolId};
use stweaver_torch::{BridgeError, Runtime};

const GRAPH: PoolId = PoolId {
    first: 3,
    second: 0,
};

fn runtime() -> Runtime {
    online_runtime(256).0
}

#[test]
fn restore_recreates_the_checkpoint_and_reports_what_it_freed() {
    let rt = runtime();
    let d = rt.malloc(0, 1000, S0, DEFAULT).unwrap();
    rt.pool_incref(0, GRAPH).unwrap();
    let a = rt.malloc(0, 3000, S0, GRAPH).unwrap();
    let b = rt.malloc(0, 5 * MIB as usize, S0, GRAPH).unwrap();
    let cp = rt.pool_checkpoint(0, GRAPH).unwrap();
    assert_eq!(cp.pool(), GRAPH);
    let blocks = cp.blocks();
    assert_eq!(blocks.len(), 2);
    assert!(blocks.windows(2).all(|w| w[0].address < w[1].address));
    assert!(
        blocks
            .iter()
            .any(|x| x.address == a as u64 && x.requested_size == 3000)
    );
    let allocated_at_cp = rt.device_stats(0).unwrap().allocated_bytes.all.current;
    // A replay would now re-create b's tensor without telling us; meanwhile a dies and
    // c is allocated.
    rt.free(a).unwrap();
    let c = rt.malloc(0, 2 * MIB as usize, S0, GRAPH).unwrap();
    rt.set_history(true).unwrap();
    let r = rt.pool_restore(0, &cp).unwrap();
    let mut freed = r.ptrs_freed.clone();
    freed.sort();
    let mut want = vec![b, c];
    want.sort();
    assert_eq!(freed, want);
    assert_eq!(r.allocated, blocks);
    let mut live = rt.pool_live_allocations(0, GRAPH).unwrap();
    live.sort();
    let mut want = vec![a, b];
    want.sort();
    assert_eq!(live, want);
    let s = rt.device_stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.current, allocated_at_cp);
    // The history saw two frees and two allocations, in the pool.
    let h = rt.drain_history().unwrap();
    let count = |a: HistoryAction| {
        h.iter()
            .filter(|e| e.action == a && e.pool == GRAPH)
            .count()
    };
    assert_eq!(count(HistoryAction::FreeRequested), 2);
    assert_eq!(count(HistoryAction::FreeCompleted), 2);
    assert_eq!(count(HistoryAction::Alloc), 2);
    rt.set_history(false).unwrap();
    // Re-created blocks are ordinary pool allocations (the DataPtrs C++ builds free them).
    rt.free(a).unwrap();
    rt.free(b).unwrap();
    rt.pool_release(0, GRAPH).unwrap();
    assert!(matches!(
        rt.pool_restore(0, &cp),
        Err(BridgeError::UnknownPool { .. })
    ));
    assert!(matches!(
        rt.pool_checkpoint(0, DEFAULT),
        Err(BridgeError::DefaultPoolIsNotPrivate)
    ));
    rt.free(d).unwrap();
}

#[test]
fn restoring_one_pool_leaves_the_others_alone() {
    let rt = runtime();
    let other = PoolId {
        first: 4,
        second: 0,
    };
    rt.pool_incref(0, GRAPH).unwrap();
    rt.pool_incref(0, other).unwrap();
    let a = rt.malloc(0, 4096, S0, GRAPH).unwrap();
    let x = rt.malloc(0, 4096, S0, other).unwrap();
    let cp = rt.pool_checkpoint(0, GRAPH).unwrap();
    // The checkpoint names its pool: restoring it touches GRAPH only.
    rt.free(a).unwrap();
    rt.pool_restore(0, &cp).unwrap();
    assert_eq!(rt.pool_live_allocations(0, other).unwrap(), vec![x]);
    assert_eq!(rt.pool_live_allocations(0, GRAPH).unwrap(), vec![a]);
    rt.free(a).unwrap();
    rt.free(x).unwrap();
    rt.pool_release(0, GRAPH).unwrap();
    rt.pool_release(0, other).unwrap();
}
