//! stweaver-core: the device-agnostic heart of stweaver.
//!
//! Vocabulary types ([`units`]), the recorded allocation history ([`trace`]), the trace
//! and plan file formats ([`trace_file`], [`plan_file`]), the plan model ([`plan`]) and
//! its verifier ([`verify`]), and the allocator itself ([`engine`]). This crate links
//! neither CUDA nor torch: the engine reaches memory only through the
//! [`DeviceMemory`](engine::DeviceMemory) trait (`stweaver-cuda` implements it over the
//! CUDA driver's virtual memory API; [`engine::HostMemory`] and
//! [`engine::VirtualMemory`] are the test devices).
//!
//! # Embedding the engine over your own memory
//!
//! A [`DeviceMemory`](engine::DeviceMemory) reserves address space, maps and unmaps
//! granule-aligned ranges of it, and records and queries stream events. Below, a device
//! that only accounts (addresses are handed out, nothing is backed: like
//! [`engine::VirtualMemory`]) and whose streams finish their work at once, so every event
//! is complete. The engine over it serves `malloc` / `free` with PyTorch-compatible
//! statistics; a plan ([`Engine::load_plan`](engine::Engine::load_plan)) or a trace
//! ([`Engine::start_trace`](engine::Engine::start_trace)) work the same way over it.
//!
//! ```
//! use std::collections::BTreeMap;
//! use std::sync::Mutex;
//!
//! use stweaver_core::engine::{
//!     DeviceError, DeviceEvent, DeviceMemory, DevicePtr, Engine, EngineConfig, StatType,
//! };
//! use stweaver_core::{Bytes, StreamId};
//!
//! const GRANULE: u64 = 2 << 20;
//!
//! /// 1 GiB of accounting-only memory; streams complete their work immediately.
//! #[derive(Default)]
//! struct Ledger {
//!     state: Mutex<State>,
//! }
//!
//! #[derive(Default)]
//! struct State {
//!     next_base: u64,
//!     reservations: BTreeMap<u64, u64>, // base -> size
//!     mapped: BTreeMap<u64, u64>,       // addr -> size of each `map` call
//!     next_event: u64,
//! }
//!
//! impl State {
//!     fn mapped_bytes(&self) -> u64 {
//!         self.mapped.values().sum()
//!     }
//! }
//!
//! impl DeviceMemory for Ledger {
//!     fn granularity(&self) -> Bytes {
//!         Bytes(GRANULE)
//!     }
//!     fn total_memory(&self) -> Bytes {
//!         Bytes(1 << 30)
//!     }
//!     fn free_memory(&self) -> Result<Bytes, DeviceError> {
//!         Ok(Bytes((1u64 << 30) - self.state.lock().unwrap().mapped_bytes()))
//!     }
//!     fn reserve(&self, size: Bytes) -> Result<DevicePtr, DeviceError> {
//!         let mut s = self.state.lock().unwrap();
//!         // Never address 0; leave a gap between reservations.
//!         let base = s.next_base.max(GRANULE);
//!         s.next_base = base + size.get() + GRANULE;
//!         s.reservations.insert(base, size.get());
//!         Ok(DevicePtr(base))
//!     }
//!     fn release(&self, base: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
//!         let mut s = self.state.lock().unwrap();
//!         let end = base.get() + size.get();
//!         if s.mapped.range(base.get()..end).next().is_some() {
//!             let reason = "still mapped";
//!             return Err(DeviceError::InvalidRange { addr: base, size, reason });
//!         }
//!         s.reservations.remove(&base.get());
//!         Ok(())
//!     }
//!     fn map(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
//!         let mut s = self.state.lock().unwrap();
//!         if s.mapped_bytes() + size.get() > (1 << 30) {
//!             return Err(DeviceError::OutOfMemory { size });
//!         }
//!         s.mapped.insert(addr.get(), size.get());
//!         Ok(())
//!     }
//!     fn unmap(&self, addr: DevicePtr, size: Bytes) -> Result<(), DeviceError> {
//!         // A union of whole earlier `map` ranges.
//!         let mut s = self.state.lock().unwrap();
//!         let end = addr.get() + size.get();
//!         let inside: Vec<(u64, u64)> =
//!             s.mapped.range(addr.get()..end).map(|(a, n)| (*a, *n)).collect();
//!         if inside.iter().map(|(_, n)| n).sum::<u64>() != size.get()
//!             || inside.iter().any(|(a, n)| a + n > end)
//!         {
//!             let reason = "not a union of whole mappings";
//!             return Err(DeviceError::InvalidRange { addr, size, reason });
//!         }
//!         for (a, _) in inside {
//!             s.mapped.remove(&a);
//!         }
//!         Ok(())
//!     }
//!     fn synchronize(&self) -> Result<(), DeviceError> {
//!         Ok(())
//!     }
//!     fn create_event(&self) -> Result<DeviceEvent, DeviceError> {
//!         let mut s = self.state.lock().unwrap();
//!         s.next_event += 1;
//!         Ok(DeviceEvent(s.next_event))
//!     }
//!     fn record_event(&self, _: DeviceEvent, _: StreamId) -> Result<(), DeviceError> {
//!         Ok(())
//!     }
//!     fn wait_event(&self, _: StreamId, _: DeviceEvent) -> Result<(), DeviceError> {
//!         Ok(())
//!     }
//!     fn query_event(&self, _: DeviceEvent) -> Result<bool, DeviceError> {
//!         Ok(true) // work finishes at once
//!     }
//!     fn synchronize_event(&self, _: DeviceEvent) -> Result<(), DeviceError> {
//!         Ok(())
//!     }
//!     fn destroy_event(&self, _: DeviceEvent) -> Result<(), DeviceError> {
//!         Ok(())
//!     }
//! }
//!
//! let engine = Engine::new(Ledger::default(), EngineConfig::default())?;
//! let stream = StreamId(0);
//! let all = StatType::Aggregate as usize;
//! let sizes = [3 << 20, 1 << 20, 8 << 20, 512];
//! // A training-like loop: the same activations every iteration.
//! let mut reserved_after_first = 0;
//! for iteration in 0..3 {
//!     let blocks: Vec<DevicePtr> = sizes
//!         .iter()
//!         .map(|&n| engine.malloc(Bytes(n), stream))
//!         .collect::<Result<_, _>>()?;
//!     // Live blocks never overlap.
//!     for (i, (&a, &na)) in blocks.iter().zip(&sizes).enumerate() {
//!         for (&b, &nb) in blocks.iter().zip(&sizes).skip(i + 1) {
//!             assert!(a.get() + na <= b.get() || b.get() + nb <= a.get());
//!         }
//!     }
//!     for p in blocks.into_iter().rev() {
//!         engine.free(p)?;
//!     }
//!     let reserved = engine.stats()?.reserved_bytes[all].current;
//!     if iteration == 0 {
//!         reserved_after_first = reserved;
//!     } else {
//!         assert_eq!(reserved, reserved_after_first, "later iterations reuse the cache");
//!     }
//! }
//! let stats = engine.stats()?;
//! assert_eq!(stats.allocated_bytes[all].current, 0);
//! assert_eq!(stats.allocated_bytes[all].peak, sizes.iter().sum::<u64>() as i64);
//! // What the engine reports reserved is exactly what the ledger has mapped, and
//! // empty_cache gives all of it back.
//! let mapped = engine.device().state.lock().unwrap().mapped_bytes();
//! assert_eq!(mapped, stats.reserved_bytes[all].current as u64);
//! engine.empty_cache()?;
//! assert_eq!(engine.device().state.lock().unwrap().mapped_bytes(), 0);
//! assert_eq!(engine.stats()?.reserved_bytes[all].current, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod engine;
pub mod file_format;
pub mod plan;
pub mod plan_file;
pub mod splitmix;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod trace;
pub mod trace_file;
pub mod units;
pub mod verify;

pub use plan::{ClassSection, DynamicSummary, NEVER_FREED, OffloadEntry, Plan, PlannedRequest};
pub use trace::{
    Allocation, Event, EventKind, Lifetime, LowerBound, MarkerKind, Restore, Trace, TraceError,
};
pub use units::{AllocId, Bytes, DeviceId, EventIdx, Offset, StreamId};
