//! Checks of the invariants of `ARCHITECTURE.md`, named after them, for tests and fuzz
//! targets: invariant 1 ([`never_alias`], and [`SentinelEngine`], which also proves it
//! by sentinel bytes) and invariant 6 ([`stats_exact_idle`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::engine::{DeviceMemory, DevicePtr, Engine, EngineConfig, HostMemory};
use crate::units::{Bytes, StreamId};

/// Invariant 1, *never alias*: the block of `live` (start address -> block, blocks
/// pairwise disjoint; `len_of` gives a block's length) that overlaps
/// `[start, start + len)`, as `Err((its start, it))`; `Ok(())` when none does.
/// O(log n): only the block that starts last below the range's end can overlap it.
pub fn never_alias<T>(
    live: &BTreeMap<u64, T>,
    len_of: impl Fn(&T) -> u64,
    start: u64,
    len: u64,
) -> Result<(), (u64, &T)> {
    match live.range(..start + len).next_back() {
        Some((&q, other)) if q + len_of(other) > start => Err((q, other)),
        _ => Ok(()),
    }
}

/// Invariant 6, *stats are exact*, at rest: the engine's own invariants hold and
/// nothing is allocated, active (pending frees, fences) or counted as an allocation.
pub fn stats_exact_idle<D: DeviceMemory>(engine: &Engine<D>) {
    engine.check_invariants().unwrap();
    let s = engine.stats().unwrap();
    assert_eq!(s.allocated_bytes[0].current, 0, "still allocated");
    assert_eq!(s.active_bytes[0].current, 0, "pending frees or fences left");
    assert_eq!(s.active[0].current, 0);
}

/// An engine on a [`HostMemory`] device whose every live block is filled with its own
/// sentinel byte on allocation and checked on free, and checked against every other
/// live block ([`never_alias`]) on allocation, so that aliasing fails the test where it
/// happens.
pub struct SentinelEngine {
    pub host: Arc<HostMemory>,
    pub engine: Engine<Arc<HostMemory>>,
    /// Live blocks: ptr -> (len, sentinel byte).
    live: BTreeMap<u64, (u64, u8)>,
    tag: u8,
}

impl SentinelEngine {
    /// 1 GiB of host memory in `granule`-byte granules, online arenas of `arena` bytes.
    pub fn new(granule: u64, arena: u64) -> SentinelEngine {
        SentinelEngine::with_config(
            granule,
            EngineConfig {
                arena_size: Some(Bytes(arena)),
                ..EngineConfig::default()
            },
        )
    }

    /// 1 GiB of host memory in `granule`-byte granules, an engine made with `config`.
    pub fn with_config(granule: u64, config: EngineConfig) -> SentinelEngine {
        let host = Arc::new(HostMemory::new(Bytes(1 << 30), Bytes(granule)));
        let engine = Engine::new(host.clone(), config).unwrap();
        SentinelEngine {
            host,
            engine,
            live: BTreeMap::new(),
            tag: 0,
        }
    }

    /// `malloc(size, stream)`, which must succeed, checked and filled.
    pub fn alloc(&mut self, size: u64, stream: StreamId) -> DevicePtr {
        let p = self.engine.malloc(Bytes(size), stream).unwrap();
        let len = size.div_ceil(512) * 512;
        if let Err((q, _)) = never_alias(&self.live, |&(l, _)| l, p.get(), len) {
            panic!("{p} overlaps {q:#x}");
        }
        self.tag = self.tag.wrapping_add(1).max(1);
        self.host.fill(p, Bytes(len), self.tag).unwrap();
        self.live.insert(p.get(), (len, self.tag));
        p
    }

    /// Checks the sentinel of `p`, then frees it.
    pub fn free(&mut self, p: DevicePtr) {
        let (len, byte) = self.live.remove(&p.get()).unwrap();
        assert!(
            self.host.check(p, Bytes(len), byte).unwrap(),
            "sentinel at {p}"
        );
        self.engine.free(p).unwrap();
    }

    /// Lets every stream pass everything, completes the pending frees (the engine's
    /// fences included) and checks that nothing is left allocated or active.
    pub fn settle_idle(&mut self) {
        self.host.events().pass_everything();
        self.engine.process_events().unwrap();
        stats_exact_idle(&self.engine);
    }

    /// Whether `p` lies in the plan's pool (a plan must be served).
    pub fn in_pool(&self, p: DevicePtr) -> bool {
        let (base, len) = self.engine.plan_pool().unwrap().unwrap();
        p.get() >= base.get() && p.get() < base.get() + len.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_alias_finds_the_overlapping_block() {
        let live: BTreeMap<u64, u64> = [(0, 10), (20, 10)].into_iter().collect();
        assert!(never_alias(&live, |&l| l, 10, 10).is_ok());
        assert!(never_alias(&live, |&l| l, 30, 5).is_ok());
        assert_eq!(never_alias(&live, |&l| l, 25, 10), Err((20, &10)));
        assert_eq!(never_alias(&live, |&l| l, 5, 1), Err((0, &10)));
    }
}
