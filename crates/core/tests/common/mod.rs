//! Shared by the plan-mode engine tests: an engine on a [`HostMemory`] device whose
//! every live block is filled with its own sentinel byte on allocation and checked on
//! free, and checked for overlap against every other live block on allocation, so that
//! aliasing fails the test where it happens.

use std::collections::HashMap;
use std::sync::Arc;

use stweaver_core::engine::{DevicePtr, Engine, EngineConfig, HostMemory};
use stweaver_core::units::{Bytes, StreamId};

pub struct Checked {
    pub host: Arc<HostMemory>,
    pub engine: Engine<Arc<HostMemory>>,
    /// Live blocks: ptr -> (len, sentinel byte).
    live: HashMap<u64, (u64, u8)>,
    tag: u8,
}

impl Checked {
    /// 1 GiB of host memory in `granule`-byte granules, online arenas of `arena` bytes.
    #[allow(dead_code)] // not every test file that shares this module uses it
    pub fn new(granule: u64, arena: u64) -> Checked {
        Checked::with_config(
            granule,
            EngineConfig {
                arena_size: Some(Bytes(arena)),
                ..EngineConfig::default()
            },
        )
    }

    /// 1 GiB of host memory in `granule`-byte granules, an engine made with `config`.
    #[allow(dead_code)] // not every test file that shares this module uses it
    pub fn with_config(granule: u64, config: EngineConfig) -> Checked {
        let host = Arc::new(HostMemory::new(Bytes(1 << 30), Bytes(granule)));
        let engine = Engine::new(host.clone(), config).unwrap();
        Checked {
            host,
            engine,
            live: HashMap::new(),
            tag: 0,
        }
    }

    pub fn alloc(&mut self, size: u64, stream: StreamId) -> DevicePtr {
        let p = self.engine.malloc(Bytes(size), stream).unwrap();
        let len = size.div_ceil(512) * 512;
        for (&q, &(l, _)) in &self.live {
            assert!(
                q + l <= p.get() || p.get() + len <= q,
                "{p} overlaps {q:#x}"
            );
        }
        self.tag = self.tag.wrapping_add(1).max(1);
        self.host.fill(p, Bytes(len), self.tag).unwrap();
        self.live.insert(p.get(), (len, self.tag));
        p
    }

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
    #[allow(dead_code)] // not every test binary asks
    pub fn settle_idle(&mut self) {
        self.host.events().pass_everything();
        self.engine.process_events().unwrap();
        self.engine.check_invariants().unwrap();
        let s = self.engine.stats().unwrap();
        assert_eq!(s.allocated_bytes[0].current, 0, "still allocated");
        assert_eq!(s.active_bytes[0].current, 0, "pending frees or fences left");
        assert_eq!(s.active[0].current, 0);
    }

    /// Whether `p` lies in the plan's pool (a plan must be served).
    #[allow(dead_code)] // not every test binary asks
    pub fn in_pool(&self, p: DevicePtr) -> bool {
        let (base, len) = self.engine.plan_pool().unwrap().unwrap();
        p.get() >= base.get() && p.get() < base.get() + len.get()
    }
}
