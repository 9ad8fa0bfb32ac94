//! How an engine is set up and how it serves a plan: [`EngineConfig`] (device, memory
//! limit as a [`MemoryLimit`], arena size, trace recording, release before a new peak)
//! and [`PlanOptions`] (the cursor's window, holes, giving a plan up, waiting for
//! pending frees), with their defaults.

use super::EngineError;
use super::arena::POOL_UNIT;
use crate::units::{Bytes, DeviceId};

#[cfg(doc)]
use super::{DeviceMemory, Engine, PlanStats};

/// How much memory the engine may map.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryLimit {
    /// A fraction of the device's total memory, in `(0, 1]`
    /// (`torch.cuda.set_per_process_memory_fraction`).
    Fraction(f64),
    /// An absolute number of bytes.
    Bytes(Bytes),
}

/// How an engine is set up.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// The device served (recorded in traces).
    pub device: DeviceId,
    /// The memory limit; `Fraction(1.0)` by default.
    pub limit: MemoryLimit,
    /// Virtual size of each arena (rounded up to the granularity); by default 9/8 of
    /// the device's memory.
    pub arena_size: Option<Bytes>,
    /// Record a trace from the start ([`Engine::start_trace`]).
    pub record_trace: bool,
    /// Before an online arena grows past the peak of reserved memory, give back free
    /// whole granules of its holes (after a device synchronisation) so that the peak
    /// does not rise: less memory, at the cost of synchronisations and re-mapping (module
    /// `engine::release` docs). Off by default.
    pub release_before_new_peak: bool,
    /// With `release_before_new_peak`: after this many iterations in a row that each
    /// repeat the one before (the same requests) and each release holes before a new
    /// peak, those releases stop until the peak of live bytes grows (module
    /// `engine::release`, `Churn`); 0: never. 0 by default.
    pub release_churn_iterations: u32,
    /// Never give free memory back on its own: no release before a new peak, no cache
    /// released to retry an allocation that does not fit, none at a pause. Only
    /// [`Engine::empty_cache`](crate::engine::Engine::empty_cache) releases. For CUDA
    /// graph private pools: their free memory may be the scratch of a captured graph that
    /// replays later at those addresses (PyTorch releases a graph pool's cache only once
    /// no graph uses the pool). Off by default.
    pub keep_cache: bool,
    /// The largest unit the plan pool maps at once (one device `map` call, one physical
    /// allocation on CUDA): a first-touched range is mapped as its `pool_unit`-aligned
    /// pieces, so that a release can give back a piece a small unplanned tensor does not
    /// share (module `engine::release`, the plan pool); rounded up to whole granules;
    /// `Bytes::ZERO`: each first-touched range as one unit. [`POOL_UNIT`] (64 MiB) by
    /// default. Under a memory limit the pool maps granule by granule anyway.
    pub pool_unit: Bytes,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            device: DeviceId(0),
            limit: MemoryLimit::Fraction(1.0),
            arena_size: None,
            record_trace: false,
            release_before_new_peak: false,
            release_churn_iterations: 0,
            keep_cache: false,
            pool_unit: Bytes(POOL_UNIT),
        }
    }
}

/// How a plan is served ([`Engine::load_plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// How many expected requests a request is matched against (see
    /// [`PlanStats`] and the cursor's resynchronisation rules).
    pub window: usize,
    /// Place requests the plan does not serve at their planned offset (unplanned ones
    /// and conflicts) in free holes of the plan's pool before the online arenas.
    pub holes: bool,
    /// A hole is taken only if none of the next `hole_horizon` expected requests is
    /// planned on it.
    pub hole_horizon: usize,
    /// The plan is given up ([`Engine::plan_abandoned`]) when, in each of
    /// [`GIVE_UP_ITERATIONS`] iterations in a row, more than this percentage of the
    /// requests that the plan placed or meant to place found their planned range busy
    /// (conflicts): the run does not follow the plan's timing (streams running behind
    /// the host, as FSDP's prefetching collectives do), and conflicts served outside
    /// their place cost more memory than serving online. 0 never gives up.
    pub give_up_conflict_percent: u32,
    /// A request whose planned range is held only by frees still waiting for other
    /// streams' events (a stream running behind the host: FSDP's and DDP's collective
    /// streams) makes its own stream wait for those events
    /// ([`DeviceMemory::wait_event`], no host blocking) and takes its planned offset,
    /// instead of a conflict served elsewhere.
    pub wait_for_pending_frees: bool,
}

/// Iterations in a row with too many conflicts before a plan is given up
/// ([`PlanOptions::give_up_conflict_percent`]).
pub const GIVE_UP_ITERATIONS: u32 = 2;

/// Requests an iteration must have had for its conflict share to count.
pub(super) const GIVE_UP_MIN_REQUESTS: u64 = 64;

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            window: 64,
            holes: true,
            hole_horizon: 128,
            give_up_conflict_percent: 25,
            wait_for_pending_frees: true,
        }
    }
}

/// `limit` in bytes on a device of `total` bytes.
pub(super) fn limit_bytes(limit: MemoryLimit, total: u64) -> Result<u64, EngineError> {
    match limit {
        MemoryLimit::Bytes(b) => Ok(b.get()),
        MemoryLimit::Fraction(f) if f > 0.0 && f <= 1.0 => Ok((f * total as f64) as u64),
        MemoryLimit::Fraction(f) => Err(EngineError::InvalidLimit(f)),
    }
}
