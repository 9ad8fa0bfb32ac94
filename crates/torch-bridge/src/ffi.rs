//! The cxx bridge: what `cpp/stweaver_allocator.cpp` may call.
//!
//! One direction only (C++ → Rust); no torch type crosses: pointers and `cudaStream_t`
//! travel as `usize`, stats and snapshots as plain shared structs the C++ side copies
//! into torch's own structs. Every function returns `Result`: an `Err` becomes a C++
//! `rust::Error` exception, which the C++ side turns into `c10::Error`. Every body runs
//! under `catch_unwind` (see [`crate::guard`]), so no panic reaches C++.
//!
//! Out of memory is not an error here: [`Runtime::malloc`] returns 0 and C++ asks
//! [`Runtime::oom_info`] for the report, calls the OOM observers, and throws
//! `c10::OutOfMemoryError` (→ `torch.OutOfMemoryError`).

#[cxx::bridge(namespace = "stweaver::ffi")]
pub mod bridge {
    /// `c10::CachingAllocator::Stat`.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct Stat {
        current: i64,
        peak: i64,
        allocated: i64,
        freed: i64,
    }

    /// `c10::CachingAllocator::StatArray`: aggregate, small pool, large pool.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct StatArray {
        all: Stat,
        small_pool: Stat,
        large_pool: Stat,
    }

    /// `c10::CachingDeviceAllocator::DeviceStats` (torch 2.11), field for field.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct DeviceStats {
        allocation: StatArray,
        segment: StatArray,
        active: StatArray,
        inactive_split: StatArray,
        allocated_bytes: StatArray,
        reserved_bytes: StatArray,
        active_bytes: StatArray,
        inactive_split_bytes: StatArray,
        requested_bytes: StatArray,
        num_alloc_retries: i64,
        num_ooms: i64,
        oversize_allocations: Stat,
        oversize_segments: Stat,
        num_sync_all_streams: i64,
        num_device_alloc: i64,
        num_device_free: i64,
        max_split_size: i64,
    }

    /// `c10::MempoolId_t`: `(0, 0)` is the default pool, `(k, 0)` a CUDA graph's private
    /// pool, `(0, k)` a `torch.cuda.MemPool`.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    struct PoolId {
        first: u64,
        second: u64,
    }

    /// One saved activation the served plan moves to host memory in each iteration
    /// (`stweaver_core::plan::OffloadEntry`): ordinals count the iteration's recorded
    /// pack and unpack calls.
    #[derive(Debug, Default, Clone, PartialEq, Eq)]
    struct OffloadItem {
        pack: u32,
        unpack: u32,
        /// The copy back starts right after this unpack ordinal; -1: at the first
        /// unpack of the iteration.
        prefetch_after_unpack: i64,
        bytes: u64,
    }

    /// Cumulative host time in `malloc` and `free` (`STWEAVER_TIME_CALLS=1`; zeros and
    /// `on` false otherwise).
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct CallTimes {
        on: bool,
        malloc_ns: u64,
        malloc_calls: u64,
        free_ns: u64,
        free_calls: u64,
    }

    /// What C++ needs to report an out-of-memory error and call the OOM observers.
    #[derive(Debug, Default, Clone, PartialEq, Eq)]
    struct OomInfo {
        /// The request, rounded as the engine rounds it.
        rounded: u64,
        /// Bytes the caller holds (allocated) and the engine has mapped (reserved).
        allocated: u64,
        reserved: u64,
        /// The memory-fraction limit in bytes, or the device's total memory if unset.
        limit: u64,
        /// Free and total device memory as the driver reports them.
        device_free: u64,
        device_total: u64,
        /// A human explanation (which limit was hit, fragmentation).
        detail: String,
    }

    /// A contiguous address range.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct Range {
        base: u64,
        size: u64,
    }

    /// One block of a snapshot segment (`c10::CachingDeviceAllocator::BlockInfo`).
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct SnapshotBlock {
        address: u64,
        size: u64,
        requested_size: u64,
        /// Handed out to the caller.
        allocated: bool,
        /// Allocated, or freed but waiting for other streams.
        active: bool,
    }

    /// One snapshot segment (`c10::CachingDeviceAllocator::SegmentInfo`): a contiguous
    /// mapped range of one arena; its blocks are `blocks[first_block..first_block+num_blocks]`.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct SnapshotSegment {
        device: i32,
        address: u64,
        total_size: u64,
        requested_size: u64,
        allocated_size: u64,
        active_size: u64,
        stream: usize,
        is_large: bool,
        is_expandable: bool,
        pool: PoolId,
        first_block: usize,
        num_blocks: usize,
    }

    /// Segments (sorted by device, then address) and their blocks.
    #[derive(Debug, Default, Clone, PartialEq, Eq)]
    struct Snapshot {
        segments: Vec<SnapshotSegment>,
        blocks: Vec<SnapshotBlock>,
    }

    /// `c10::CachingDeviceAllocator::TraceEntry::Action`, minus what C++ records itself
    /// (`SNAPSHOT`, `OOM`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum HistoryAction {
        Alloc,
        FreeRequested,
        FreeCompleted,
        SegmentAlloc,
        SegmentFree,
        SegmentMap,
        SegmentUnmap,
    }

    /// One entry of the allocator's history, for `torch.cuda.memory._record_memory_history`
    /// and trace trackers (sizes as PyTorch defines them per action).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct HistoryEvent {
        action: HistoryAction,
        device: i32,
        addr: u64,
        size: u64,
        stream: usize,
        pool: PoolId,
    }

    /// One block of a private-pool checkpoint (allocated when it was taken, or
    /// re-created by a restore).
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct CheckpointBlock {
        address: u64,
        /// Rounded size.
        size: u64,
        requested_size: u64,
        stream: usize,
    }

    /// What restoring a checkpoint did (`c10::cuda::CUDACachingAllocator::CheckpointDelta`
    /// before C++ builds the DataPtrs): the pointers of every block that was allocated
    /// (all freed), and the checkpoint's blocks, allocated again at their addresses.
    #[derive(Debug, Default, Clone, PartialEq, Eq)]
    struct PoolRestore {
        ptrs_freed: Vec<usize>,
        allocated: Vec<CheckpointBlock>,
    }

    /// What a pause or resume moved over a device's pools
    /// (`stweaver_core::engine::PauseReport`, summed).
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    struct PauseReport {
        /// Live blocks paused (resumed).
        blocks: u64,
        /// Mapped units unmapped (mapped again).
        units: u64,
        /// Physical bytes given back to the device (mapped again).
        bytes: u64,
        /// Bytes copied to (from) host memory.
        copied: u64,
    }

    extern "Rust" {
        /// All allocator state of the process: one engine per (device, pool).
        type Runtime;

        /// The allocated blocks of a private pool at one moment (opaque to C++, held by
        /// its `AllocatorState`).
        type PoolCheckpoint;

        /// A runtime serving in `mode` ("online", "trace", "plan" or "auto"). `plan` and
        /// `trace` are file paths ("" for none): the plan to serve, where to write the trace.
        fn new_runtime(mode: &str, plan: &str, trace: &str) -> Result<Box<Runtime>>;

        /// PyTorch's lazy CUDA init: `device_count` devices exist. Devices are opened
        /// lazily at their first allocation.
        fn init(self: &Runtime, device_count: i32) -> Result<()>;

        /// Allocates `size` (> 0) bytes on `device` for `stream` from `pool`. Returns the
        /// address, or 0 when the device is out of memory (after releasing cached memory
        /// and retrying).
        fn malloc(
            self: &Runtime,
            device: i32,
            size: usize,
            stream: usize,
            pool: PoolId,
        ) -> Result<usize>;

        /// Frees a pointer returned by `malloc`. Memory used by other streams
        /// (`record_stream`) is reused only after they pass this point. Unknown pointers
        /// and double frees are errors.
        fn free(self: &Runtime, ptr: usize) -> Result<()>;

        /// `Tensor.record_stream`: the block at `ptr` is also used on `stream`.
        fn record_stream(self: &Runtime, ptr: usize, stream: usize) -> Result<()>;
        /// `record_stream` for a use whose work on `stream` is all enqueued already (the
        /// offloader's copy): the free waits for this point of `stream`, not for the work
        /// `stream` runs up to the free.
        fn record_stream_enqueued(self: &Runtime, ptr: usize, stream: usize) -> Result<()>;

        /// Returns cached memory to the device: `device` -1 for all; `pool` (0,0) for the
        /// default pools plus every released private pool, else that pool only.
        fn empty_cache(self: &Runtime, device: i32, pool: PoolId) -> Result<()>;

        fn device_stats(self: &Runtime, device: i32) -> Result<DeviceStats>;
        fn reset_peak_stats(self: &Runtime, device: i32) -> Result<()>;
        fn reset_accumulated_stats(self: &Runtime, device: i32) -> Result<()>;

        /// `set_per_process_memory_fraction`: 0 ≤ fraction ≤ 1 of the device's memory.
        fn set_memory_fraction(self: &Runtime, device: i32, fraction: f64) -> Result<()>;
        fn memory_fraction(self: &Runtime, device: i32) -> Result<f64>;

        /// The report for a failed `malloc` of `size` bytes on `device`.
        fn oom_info(self: &Runtime, device: i32, size: usize) -> Result<OomInfo>;

        /// Largest free cached block on `device` (for cuDNN's workspace sizing).
        fn largest_free_block(self: &Runtime, device: i32) -> Result<u64>;

        /// The arena range that holds `ptr` (`getBaseAllocation`).
        fn base_allocation(self: &Runtime, ptr: usize) -> Result<Range>;

        /// Segments and blocks of `pool`, or of every pool when `all_pools`.
        fn snapshot(self: &Runtime, pool: PoolId, all_pools: bool) -> Result<Snapshot>;

        /// Private pools: create or take a reference (`beginAllocateToPool`,
        /// `createOrIncrefPool`), drop one (`releasePool`; at zero the pool's memory is
        /// returned once nothing in it is live), count references.
        fn pool_incref(self: &Runtime, device: i32, pool: PoolId) -> Result<()>;
        fn pool_release(self: &Runtime, device: i32, pool: PoolId) -> Result<()>;
        /// `beginAllocateToPool` / `endAllocateToPool`: a reference to the pool, and
        /// while it lasts (a CUDA graph capture) no device synchronisation, so no cache
        /// given back, on that device.
        fn pool_begin_allocate(self: &Runtime, device: i32, pool: PoolId) -> Result<()>;
        fn pool_end_allocate(self: &Runtime, device: i32, pool: PoolId) -> Result<()>;
        fn pool_use_count(self: &Runtime, device: i32, pool: PoolId) -> Result<i32>;
        /// Addresses of the blocks allocated in a pool (`checkPoolLiveAllocations`).
        fn pool_live_allocations(self: &Runtime, device: i32, pool: PoolId) -> Result<Vec<usize>>;
        /// `getCheckpointState`: the allocated blocks of private pool `pool`.
        fn pool_checkpoint(
            self: &Runtime,
            device: i32,
            pool: PoolId,
        ) -> Result<Box<PoolCheckpoint>>;
        /// `setCheckpointPoolState`: frees every block allocated in `checkpoint`'s pool
        /// and allocates the checkpoint's blocks again at their addresses.
        fn pool_restore(
            self: &Runtime,
            device: i32,
            checkpoint: &PoolCheckpoint,
        ) -> Result<PoolRestore>;
        /// The checkpoint's pool and its blocks (address order).
        fn pool(self: &PoolCheckpoint) -> PoolId;
        fn blocks(self: &PoolCheckpoint) -> Vec<CheckpointBlock>;

        /// Starts or stops collecting [`HistoryEvent`]s (history recording or trace trackers).
        fn set_history(self: &Runtime, enabled: bool) -> Result<()>;
        /// Takes the events collected since the last call, oldest first.
        fn drain_history(self: &Runtime) -> Result<Vec<HistoryEvent>>;

        /// Lets `peer` access all memory of `device` (after `cudaDeviceEnablePeerAccess`).
        fn enable_peer_access(self: &Runtime, device: i32, peer: i32) -> Result<()>;

        /// An iteration boundary (`stweaver.step()`).
        fn step(self: &Runtime) -> Result<()>;
        /// An iteration boundary where an iteration of key `key` begins
        /// (`stweaver.step(key)`: the key hashed to 64 bits): with a plan of several
        /// iteration classes, the class of a key's iterations is learned and guessed
        /// first; otherwise the key changes nothing.
        fn step_key(self: &Runtime, key: u64) -> Result<()>;
        /// The iteration in progress has key `key`, without a boundary
        /// (`stweaver.iteration_key(key)`, when the optimizer hook marks the boundaries).
        fn iteration_key(self: &Runtime, key: u64) -> Result<()>;
        /// A named phase marker: `begin` true opens the phase `label`, false closes it.
        fn mark(self: &Runtime, label: &str, begin: bool) -> Result<()>;
        /// The serving mode now ("online", "trace", "plan"; "auto" reports its stage).
        fn mode(self: &Runtime) -> Result<String>;
        /// Writes the recorded trace(s) now (trace and auto modes); returns the paths.
        fn flush_trace(self: &Runtime) -> Result<Vec<String>>;
        /// A JSON object with the runtime's state and counters (for `stweaver.stats()`).
        fn info_json(self: &Runtime) -> Result<String>;
        /// Records that autograd saved (`pack`) or unpacked the tensor whose storage starts
        /// at `ptr` (trace and auto's recording); the allocation's trace id, -1 when
        /// nothing was recorded.
        fn record_saved(self: &Runtime, ptr: usize, pack: bool) -> Result<i64>;
        /// Records that the allocation starting at `ptr` is the copy back of the
        /// offloaded allocation `from` (an id `record_saved` returned for its pack);
        /// false when nothing was recorded.
        fn record_restore(self: &Runtime, ptr: usize, from: i64) -> Result<bool>;
        /// The offload schedule of the plan `device` serves (empty when none).
        fn offload_schedule(self: &Runtime, device: i32) -> Result<Vec<OffloadItem>>;
        /// Host time in `malloc` / `free` so far (`STWEAVER_TIME_CALLS=1`).
        fn call_times(self: &Runtime) -> CallTimes;

        /// Auto mode: hold a finished plan (mode "auto (plan held)") instead of serving
        /// it, until `release_held_plan`.
        fn set_plan_gate(self: &Runtime, on: bool) -> Result<()>;
        /// Auto mode under a budget: time the next offload schedules with this link
        /// speed (GB/s per direction).
        fn set_offload_timing(self: &Runtime, link_gbps: f64, iteration_us: f64) -> Result<()>;
        /// The held plan: `accept` serves it now (at an iteration boundary), else auto
        /// mode records again from here.
        fn release_held_plan(self: &Runtime, accept: bool) -> Result<()>;
        /// Auto mode serving a plan: records again from this boundary, keeping the
        /// served plan for `serve_kept_plan`.
        fn record_again(self: &Runtime) -> Result<()>;
        /// Serves the plan `record_again` kept, from this boundary.
        fn serve_kept_plan(self: &Runtime) -> Result<()>;

        /// Pause / resume (issue #17). The tag of allocations made from now on, on every
        /// pool of every device (0: untagged, never paused).
        fn set_tag(self: &Runtime, tag: u32) -> Result<()>;
        /// Gives the physical memory of the blocks of `tag` (0: every tagged block) on
        /// `device` back to the device, addresses kept (contents saved on the host when
        /// `keep`); every pool of the device, all or nothing.
        fn pause(self: &Runtime, device: i32, tag: u32, keep: bool) -> Result<PauseReport>;
        /// Maps the paused memory of `tag` (0: every pause) on `device` again at the same
        /// addresses and restores the saved contents.
        fn resume(self: &Runtime, device: i32, tag: u32) -> Result<PauseReport>;
        /// Bytes of `device` paused now.
        fn paused_bytes(self: &Runtime, device: i32) -> Result<u64>;

        /// Page-locked host memory (the offloader's pool buffers): owned by C++ as a
        /// `rust::Box`, given back when dropped.
        type PinnedBuffer;

        /// `bytes` bytes of page-locked host memory, portable, made in `device`'s primary
        /// context (`stweaver_cuda`'s fast pin: a huge-page mapping faulted in by several
        /// threads, then registered; `STWEAVER_PIN_THREADS=0`: `cuMemHostAlloc`). More
        /// than the host can give is an error before any page is touched.
        fn pin_host(device: i32, bytes: usize) -> Result<Box<PinnedBuffer>>;
        /// Its first byte's address.
        fn ptr(self: &PinnedBuffer) -> usize;
    }
}

use std::sync::Arc;

use stweaver_cuda::CudaMemory;

use crate::error::{BridgeError, guard};
use crate::runtime::{Core, DeviceFactory, Settings, to_ffi_stats};
use crate::tracked::BridgeDevice;
use bridge::{
    CallTimes, CheckpointBlock, DeviceStats, HistoryEvent, OomInfo, PauseReport, PoolId,
    PoolRestore, Range, Snapshot,
};
use stweaver_core::engine::{BlockInfo, Checkpoint};

/// The object C++ holds (`rust::Box<stweaver::ffi::Runtime>`): the guarded face of a
/// [`Core`]. Every method runs under [`guard`], so no panic reaches C++.
pub struct Runtime {
    core: Core,
}

/// A private pool's checkpoint as C++ holds it: the pool and the engine's
/// [`Checkpoint`].
pub struct PoolCheckpoint {
    pool: PoolId,
    checkpoint: Checkpoint,
}

impl PoolCheckpoint {
    pub fn pool(&self) -> PoolId {
        self.pool
    }

    pub fn blocks(&self) -> Vec<CheckpointBlock> {
        self.checkpoint
            .blocks()
            .iter()
            .map(|b| CheckpointBlock {
                address: b.addr.get(),
                size: b.size.get(),
                requested_size: b.requested.get(),
                stream: b.stream.0 as usize,
            })
            .collect()
    }
}

fn to_ffi_report(r: stweaver_core::engine::PauseReport) -> PauseReport {
    PauseReport {
        blocks: r.blocks as u64,
        units: r.units as u64,
        bytes: r.bytes.get(),
        copied: r.copied.get(),
    }
}

fn to_ffi_block(b: &BlockInfo) -> CheckpointBlock {
    CheckpointBlock {
        address: b.addr.get(),
        size: b.size.get(),
        requested_size: b.requested.get(),
        stream: b.stream.0 as usize,
    }
}

/// Pinned host memory handed to C++ (the bridge's `pin_host`).
pub struct PinnedBuffer(stweaver_cuda::PinnedHost);

impl PinnedBuffer {
    pub fn ptr(&self) -> usize {
        self.0.as_slice().as_ptr() as usize
    }
}

fn pin_host(device: i32, bytes: usize) -> Result<Box<PinnedBuffer>, BridgeError> {
    guard("pin_host", || {
        let dev = stweaver_cuda::CudaDevice::open(device)?;
        Ok(Box::new(PinnedBuffer(dev.alloc_pinned(bytes)?)))
    })
}

/// Opens CUDA devices through the driver API.
pub fn cuda_factory() -> DeviceFactory {
    Box::new(|d| Ok(Arc::new(CudaMemory::open(d)?) as Arc<dyn BridgeDevice>))
}

fn new_runtime(mode: &str, plan: &str, trace: &str) -> Result<Box<Runtime>, BridgeError> {
    guard("new_runtime", || {
        let settings = Settings::parse(mode, plan, trace)?;
        Ok(Box::new(Runtime::with_core(Core::new(
            settings,
            cuda_factory(),
        ))))
    })
}

impl Runtime {
    /// A runtime over any device factory (tests use host memory).
    pub fn with_core(core: Core) -> Runtime {
        Runtime { core }
    }

    /// The state behind the guard.
    pub fn core(&self) -> &Core {
        &self.core
    }

    pub fn init(&self, device_count: i32) -> Result<(), BridgeError> {
        guard("init", || self.core.init(device_count))
    }

    pub fn malloc(
        &self,
        device: i32,
        size: usize,
        stream: usize,
        pool: PoolId,
    ) -> Result<usize, BridgeError> {
        guard("malloc", || self.core.malloc(device, size, stream, pool))
    }

    pub fn free(&self, ptr: usize) -> Result<(), BridgeError> {
        guard("free", || self.core.free(ptr))
    }

    pub fn record_stream(&self, ptr: usize, stream: usize) -> Result<(), BridgeError> {
        guard("record_stream", || self.core.record_stream(ptr, stream))
    }

    pub fn record_stream_enqueued(&self, ptr: usize, stream: usize) -> Result<(), BridgeError> {
        guard("record_stream_enqueued", || {
            self.core.record_stream_enqueued(ptr, stream)
        })
    }

    pub fn empty_cache(&self, device: i32, pool: PoolId) -> Result<(), BridgeError> {
        guard("empty_cache", || self.core.empty_cache(device, pool))
    }

    pub fn device_stats(&self, device: i32) -> Result<DeviceStats, BridgeError> {
        guard("device_stats", || {
            Ok(to_ffi_stats(&self.core.device_stats(device)?))
        })
    }

    pub fn reset_peak_stats(&self, device: i32) -> Result<(), BridgeError> {
        guard("reset_peak_stats", || self.core.reset_peak_stats(device))
    }

    pub fn reset_accumulated_stats(&self, device: i32) -> Result<(), BridgeError> {
        guard("reset_accumulated_stats", || {
            self.core.reset_accumulated_stats(device)
        })
    }

    pub fn set_memory_fraction(&self, device: i32, fraction: f64) -> Result<(), BridgeError> {
        guard("set_memory_fraction", || {
            self.core.set_memory_fraction(device, fraction)
        })
    }

    pub fn memory_fraction(&self, device: i32) -> Result<f64, BridgeError> {
        guard("memory_fraction", || self.core.memory_fraction(device))
    }

    pub fn oom_info(&self, device: i32, size: usize) -> Result<OomInfo, BridgeError> {
        guard("oom_info", || self.core.oom_info(device, size))
    }

    pub fn largest_free_block(&self, device: i32) -> Result<u64, BridgeError> {
        guard("largest_free_block", || {
            self.core.largest_free_block(device)
        })
    }

    pub fn base_allocation(&self, ptr: usize) -> Result<Range, BridgeError> {
        guard("base_allocation", || self.core.base_allocation(ptr))
    }

    pub fn snapshot(&self, pool: PoolId, all_pools: bool) -> Result<Snapshot, BridgeError> {
        guard("snapshot", || self.core.snapshot(pool, all_pools))
    }

    pub fn pool_incref(&self, device: i32, pool: PoolId) -> Result<(), BridgeError> {
        guard("pool_incref", || self.core.pool_incref(device, pool))
    }

    pub fn pool_begin_allocate(&self, device: i32, pool: PoolId) -> Result<(), BridgeError> {
        guard("pool_begin_allocate", || {
            self.core.pool_begin_allocate(device, pool)
        })
    }

    pub fn pool_end_allocate(&self, device: i32, pool: PoolId) -> Result<(), BridgeError> {
        guard("pool_end_allocate", || {
            self.core.pool_end_allocate(device, pool)
        })
    }

    pub fn pool_release(&self, device: i32, pool: PoolId) -> Result<(), BridgeError> {
        guard("pool_release", || self.core.pool_release(device, pool))
    }

    pub fn pool_use_count(&self, device: i32, pool: PoolId) -> Result<i32, BridgeError> {
        guard("pool_use_count", || self.core.pool_use_count(device, pool))
    }

    pub fn pool_live_allocations(
        &self,
        device: i32,
        pool: PoolId,
    ) -> Result<Vec<usize>, BridgeError> {
        guard("pool_live_allocations", || {
            self.core.pool_live_allocations(device, pool)
        })
    }

    pub fn pool_checkpoint(
        &self,
        device: i32,
        pool: PoolId,
    ) -> Result<Box<PoolCheckpoint>, BridgeError> {
        guard("pool_checkpoint", || {
            Ok(Box::new(PoolCheckpoint {
                pool,
                checkpoint: self.core.pool_checkpoint(device, pool)?,
            }))
        })
    }

    pub fn pool_restore(
        &self,
        device: i32,
        checkpoint: &PoolCheckpoint,
    ) -> Result<PoolRestore, BridgeError> {
        guard("pool_restore", || {
            let r = self
                .core
                .pool_restore(device, checkpoint.pool, &checkpoint.checkpoint)?;
            Ok(PoolRestore {
                ptrs_freed: r.freed.iter().map(|b| b.addr.get() as usize).collect(),
                allocated: r.created.iter().map(to_ffi_block).collect(),
            })
        })
    }

    pub fn set_history(&self, enabled: bool) -> Result<(), BridgeError> {
        guard("set_history", || {
            self.core.set_history(enabled);
            Ok(())
        })
    }

    pub fn drain_history(&self) -> Result<Vec<HistoryEvent>, BridgeError> {
        guard("drain_history", || Ok(self.core.drain_history()))
    }

    pub fn enable_peer_access(&self, device: i32, peer: i32) -> Result<(), BridgeError> {
        guard("enable_peer_access", || {
            self.core.enable_peer_access(device, peer)
        })
    }

    pub fn step(&self) -> Result<(), BridgeError> {
        guard("step", || self.core.step())
    }

    pub fn step_key(&self, key: u64) -> Result<(), BridgeError> {
        guard("step_key", || self.core.step_keyed(Some(key)))
    }

    pub fn iteration_key(&self, key: u64) -> Result<(), BridgeError> {
        guard("iteration_key", || self.core.iteration_key(key))
    }

    pub fn mark(&self, label: &str, begin: bool) -> Result<(), BridgeError> {
        guard("mark", || self.core.mark(label, begin))
    }

    pub fn mode(&self) -> Result<String, BridgeError> {
        guard("mode", || Ok(self.core.mode()))
    }

    pub fn flush_trace(&self) -> Result<Vec<String>, BridgeError> {
        guard("flush_trace", || self.core.flush_trace())
    }

    pub fn info_json(&self) -> Result<String, BridgeError> {
        guard("info_json", || self.core.info_json())
    }

    pub fn record_saved(&self, ptr: usize, pack: bool) -> Result<i64, BridgeError> {
        guard("record_saved", || {
            Ok(self
                .core
                .record_saved(ptr, pack)?
                .map_or(-1, |id| i64::from(id.0)))
        })
    }

    pub fn call_times(&self) -> CallTimes {
        self.core.call_times()
    }

    pub fn set_plan_gate(&self, on: bool) -> Result<(), BridgeError> {
        guard("set_plan_gate", || {
            self.core.set_plan_gate(on);
            Ok(())
        })
    }

    pub fn set_offload_timing(&self, link_gbps: f64, iteration_us: f64) -> Result<(), BridgeError> {
        guard("set_offload_timing", || {
            self.core.set_offload_timing(link_gbps, iteration_us)
        })
    }

    pub fn release_held_plan(&self, accept: bool) -> Result<(), BridgeError> {
        guard("release_held_plan", || self.core.release_held_plan(accept))
    }

    pub fn record_again(&self) -> Result<(), BridgeError> {
        guard("record_again", || self.core.record_again())
    }

    pub fn serve_kept_plan(&self) -> Result<(), BridgeError> {
        guard("serve_kept_plan", || self.core.serve_kept_plan())
    }

    pub fn record_restore(&self, ptr: usize, from: i64) -> Result<bool, BridgeError> {
        guard("record_restore", || self.core.record_restore(ptr, from))
    }

    pub fn offload_schedule(&self, device: i32) -> Result<Vec<bridge::OffloadItem>, BridgeError> {
        guard("offload_schedule", || self.core.offload_schedule(device))
    }

    pub fn set_tag(&self, tag: u32) -> Result<(), BridgeError> {
        guard("set_tag", || self.core.set_tag(tag))
    }

    pub fn pause(&self, device: i32, tag: u32, keep: bool) -> Result<PauseReport, BridgeError> {
        guard("pause", || {
            Ok(to_ffi_report(self.core.pause(device, tag, keep)?))
        })
    }

    pub fn resume(&self, device: i32, tag: u32) -> Result<PauseReport, BridgeError> {
        guard("resume", || {
            Ok(to_ffi_report(self.core.resume(device, tag)?))
        })
    }

    pub fn paused_bytes(&self, device: i32) -> Result<u64, BridgeError> {
        guard("paused_bytes", || self.core.paused_bytes(device))
    }
}
