//! [`Core`]: the process's allocator state behind the bridge — one [`Engine`] per
//! (device, pool), device-level stats, private pools for CUDA graphs and `MemPool`s,
//! trace mode, and the history PyTorch's memory tools read.
//!
//! # Pools
//!
//! Each CUDA device has a *default* engine (opened at its first allocation) and one
//! engine per live private pool (`beginAllocateToPool` / `createOrIncrefPool` create it,
//! `releasePool` drops a reference). A private pool's memory is never handed to another
//! pool; when its last reference is released its cache is emptied at once and the
//! engine is dropped as soon as nothing in it is live (a graph's outputs may outlive the
//! graph). Engines share the device ([`BridgeDevice`]) through [`Tracked`], which maps
//! every reservation to its engine, so `free(ptr)` needs no per-pointer table.
//!
//! # Device stats
//!
//! With only the default engine, a device's stats are that engine's (exact). With
//! private pools, current values and counters are sums over the engines (plus what
//! dropped engines accumulated), and each peak is the largest of: the highest sum seen
//! at the end of any operation on the device, the current sum, and each engine's own
//! peak (each a lower bound of the true peak; together exact at operation granularity).
//!
//! # History
//!
//! When PyTorch records memory history (or a trace tracker is attached), every
//! allocation, free request, free completion (late for stream-deferred frees) and
//! mapping change is reported as a [`HistoryEvent`], which C++ turns into `TraceEntry`s.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard};
use std::time::Duration;

use stweaver_core::Plan;
use stweaver_core::engine::PlanOptions as EnginePlanOptions;
use stweaver_core::engine::servable_from_start;
use stweaver_core::engine::{
    BlockState, Checkpoint, DeviceMemory, DevicePtr, DeviceStats, Engine, EngineConfig,
    EngineError, MemoryLimit, PoolKind, Restored, SavedKind, SegmentInfo, Stat,
};
use stweaver_core::plan::OffloadEntry;
use stweaver_core::plan_file::{read_plan_file, write_plan_file};
use stweaver_core::trace::{EventKind, MarkerKind, Trace};
use stweaver_core::trace_file::write_trace_file;
use stweaver_core::units::{AllocId, Bytes, DeviceId, StreamId};
use stweaver_planner::offload::{OffloadOptions, plan_with_budget};
use stweaver_planner::planning::{PlanOptions as PlannerOptions, plan_trace};
use stweaver_planner::solver::SolveOptions;

use crate::budget::{Budget, effective_limit};
use crate::dist::{self, PlanSource, RankInfo};
use crate::error::{BridgeError, Result};
use crate::ffi::bridge as ffi;
use crate::ffi::bridge::{HistoryAction, HistoryEvent, PoolId};
use crate::tracked::{BridgeDevice, DeviceBudget, Owner, Shared, Tracked};

/// Opens device `ordinal` (CUDA in production, host memory in tests).
pub type DeviceFactory = Box<dyn Fn(i32) -> Result<Arc<dyn BridgeDevice>> + Send + Sync>;

const DEFAULT_POOL: PoolId = PoolId {
    first: 0,
    second: 0,
};

fn is_default(p: PoolId) -> bool {
    p == DEFAULT_POOL
}

/// How the runtime serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Online best fit only.
    Online,
    /// Online, recording every request of the default pools into a trace.
    Trace,
    /// Serving a plan file (online for what it does not foresee).
    Plan,
    /// Online while recording the first iterations, then planning them in the
    /// background and serving the plan from an iteration boundary on.
    Auto,
}

/// Iterations `auto` records before it plans, unless `STWEAVER_AUTO_ITERATIONS` says.
pub const DEFAULT_AUTO_ITERATIONS: u64 = 4;

/// Validated install settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub mode: Mode,
    /// Trace mode: where the trace goes; auto: where the recorded trace is kept (optional).
    /// Device 0's path; other devices get `.cudaN` before the extension.
    pub trace_path: Option<PathBuf>,
    /// Plan mode: the plan to serve; auto: where the plan made is kept (optional).
    pub plan_path: Option<PathBuf>,
    /// Auto mode: iterations recorded before planning.
    pub auto_iterations: u64,
    /// Under `torchrun` (`WORLD_SIZE` > 1): this process's rank; file names carry it
    /// (module [`crate::dist`]).
    pub rank: Option<RankInfo>,
    /// `STWEAVER_RELEASE_AT_PEAK` (default on; `0` turns it off):
    /// [`EngineConfig::release_before_new_peak`]. It trades a device synchronisation
    /// each time an online arena would set a new reserved peak for a lower peak (on the
    /// H200, Qwen2-MoE online 97.58 -> 98.69 %, variable lengths 92.60 -> 95.12 %).
    pub release_at_peak: bool,
    /// `STWEAVER_PLAN_WAIT` (default on; `0` turns it off):
    /// [`EnginePlanOptions::wait_for_pending_frees`]. A planned request whose range only
    /// frees pending on other streams hold makes its stream wait for their events
    /// instead of being served elsewhere (streams running behind the host: DDP, FSDP).
    pub plan_wait: bool,
    /// `STWEAVER_SHARE_STREAMS` (default off): auto mode plans with
    /// [`PlannerOptions::share_streams`] (one joint solve; streams reuse each other's
    /// ranges, waiting on the device for the earlier stream's work).
    pub share_streams: bool,
    /// `STWEAVER_BUDGET` (`16GiB`, `0.8`, bytes; `stweaver.install(budget=...)` sets
    /// it): at most this much device memory, over every pool of the device. With
    /// `set_per_process_memory_fraction` too, the smaller limit holds
    /// ([`crate::budget::effective_limit`]).
    pub budget: Option<Budget>,
}

/// A boolean environment setting: `default` when unset; the same words as the Python
/// side's `parse_bool`.
fn env_bool(name: &str, default: bool) -> Result<bool> {
    match std::env::var(name) {
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(BridgeError::Settings(format!(
                "{name}={v:?} is not a boolean (use 1/0, true/false, yes/no, on/off)"
            ))),
        },
        Err(_) => Ok(default),
    }
}

impl Settings {
    /// Parses `install(mode, plan, trace)` arguments ("" = not given).
    /// `STWEAVER_AUTO_ITERATIONS` (a positive integer) sets `auto_iterations`.
    pub fn parse(mode: &str, plan: &str, trace: &str) -> Result<Settings> {
        let bad = |m: String| Err(BridgeError::Settings(m));
        let path = |s: &str| (!s.is_empty()).then(|| PathBuf::from(s));
        let auto_iterations = match std::env::var("STWEAVER_AUTO_ITERATIONS") {
            Ok(v) => match v.trim().parse::<u64>() {
                Ok(n) if n > 0 => n,
                _ => {
                    return bad(format!(
                        "STWEAVER_AUTO_ITERATIONS={v:?} is not a positive integer"
                    ));
                }
            },
            Err(_) => DEFAULT_AUTO_ITERATIONS,
        };
        let rank = RankInfo::from_env().map_err(BridgeError::Settings)?;
        let release_at_peak = env_bool("STWEAVER_RELEASE_AT_PEAK", true)?;
        let plan_wait = env_bool("STWEAVER_PLAN_WAIT", true)?;
        let share_streams = env_bool("STWEAVER_SHARE_STREAMS", false)?;
        let budget = match std::env::var("STWEAVER_BUDGET") {
            Ok(v) if !v.trim().is_empty() => Some(
                Budget::parse(&v)
                    .map_err(|e| BridgeError::Settings(format!("STWEAVER_BUDGET: {e}")))?,
            ),
            _ => None,
        };
        let settings = |mode| Settings {
            mode,
            trace_path: path(trace),
            plan_path: path(plan),
            auto_iterations,
            rank,
            release_at_peak,
            plan_wait,
            share_streams,
            budget,
        };
        match mode {
            "online" => {
                if !plan.is_empty() || !trace.is_empty() {
                    return bad(format!(
                        "mode \"online\" takes no plan or trace file (got plan={plan:?}, \
                         trace={trace:?}); use mode \"trace\" to record one"
                    ));
                }
                Ok(settings(Mode::Online))
            }
            "trace" => {
                if trace.is_empty() {
                    return bad("mode \"trace\" needs a trace file path".into());
                }
                if !plan.is_empty() {
                    return bad(format!(
                        "mode \"trace\" records a trace and serves online; it takes no plan \
                         (got {plan:?})"
                    ));
                }
                Ok(settings(Mode::Trace))
            }
            "plan" => {
                if plan.is_empty() {
                    return bad("mode \"plan\" needs a plan file path".into());
                }
                if !trace.is_empty() {
                    return bad(format!("mode \"plan\" takes no trace file (got {trace:?})"));
                }
                Ok(settings(Mode::Plan))
            }
            "auto" => Ok(settings(Mode::Auto)),
            other => bad(format!(
                "unknown mode {other:?}: expected \"online\", \"trace\", \"plan\" or \"auto\""
            )),
        }
    }

    /// These settings with `budget` (what `STWEAVER_BUDGET` sets).
    pub fn with_budget(mut self, budget: Option<Budget>) -> Settings {
        self.budget = budget;
        self
    }

    /// These settings as rank `rank` of a `torchrun` job (`None`: a single process).
    pub fn with_rank(mut self, rank: Option<RankInfo>) -> Settings {
        self.rank = rank;
        self
    }

    /// The trace file of device `d` (outside torchrun; see [`Settings::trace_path_on`]).
    pub fn trace_path_for(&self, d: i32) -> Option<PathBuf> {
        self.trace_path_on(d, None)
    }

    /// Auto mode: the plan file of device `d` (outside torchrun).
    pub fn plan_path_for(&self, d: i32) -> Option<PathBuf> {
        self.plan_path_on(d, None)
    }

    /// The trace file of device `d` when the rank's home device is `home`: the rank in
    /// the name under torchrun, `.cudaN` for a device other than the home device
    /// (device 0 outside torchrun). See [`crate::dist`].
    pub fn trace_path_on(&self, d: i32, home: Option<i32>) -> Option<PathBuf> {
        Some(self.output_on(self.trace_path.as_ref()?, d, home))
    }

    /// Auto mode: the plan file kept for device `d` (as [`Settings::trace_path_on`]).
    pub fn plan_path_on(&self, d: i32, home: Option<i32>) -> Option<PathBuf> {
        Some(self.output_on(self.plan_path.as_ref()?, d, home))
    }

    fn output_on(&self, p: &Path, d: i32, home: Option<i32>) -> PathBuf {
        let p = dist::output_path(p, self.rank.as_ref());
        dist::device_path(&p, d, home.filter(|_| self.rank.is_some()))
    }

    /// Plan mode: the plan file this process serves (per rank under torchrun).
    pub fn plan_source(&self) -> Option<PlanSource> {
        let p = self.plan_path.as_ref()?;
        Some(dist::resolve_plan(p, self.rank.as_ref(), Path::is_file))
    }
}

/// Where plan serving stands (plan and auto modes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanStage {
    /// Online mode, or trace mode.
    NotPlanning,
    /// Auto: recording iterations.
    Recording,
    /// Auto: the background planner runs.
    Planning,
    /// A plan is served (on the devices listed).
    Serving(Vec<i32>),
    /// No plan could be served: serving online. The reason, for the user.
    Fallback(String),
}

/// A background planning job of auto mode, per device.
/// What auto mode's planning under a budget decided for a device (`info_json`'s
/// `offload`).
#[derive(Debug, Clone)]
enum OffloadOutcome {
    /// The plan fits the budget, offloading these tensors per iteration (none when
    /// the run fits without offload).
    Planned {
        budget: u64,
        tensors: usize,
        bytes_per_iteration: u64,
        planned_peak: u64,
        pool_without_offload: u64,
        stalls: usize,
    },
    /// Planned without offload, and why.
    NotPlanned { budget: u64, reason: String },
}

impl OffloadOutcome {
    fn json(&self) -> serde_json::Value {
        match self {
            OffloadOutcome::Planned {
                budget,
                tensors,
                bytes_per_iteration,
                planned_peak,
                pool_without_offload,
                stalls,
            } => serde_json::json!({
                "planned": true,
                "budget_bytes": budget,
                "tensors": tensors,
                "bytes_per_iteration": bytes_per_iteration,
                "planned_peak": planned_peak,
                "pool_without_offload": pool_without_offload,
                "stalls": stalls,
            }),
            OffloadOutcome::NotPlanned { budget, reason } => serde_json::json!({
                "planned": false,
                "budget_bytes": budget,
                "reason": reason,
            }),
        }
    }
}

/// A background plan: the plan, and under a budget what offload it carries.
type PlanResult = std::result::Result<(Plan, Option<OffloadOutcome>), String>;

struct PlanJob {
    device: i32,
    handle: std::thread::JoinHandle<PlanResult>,
}

struct PlanControl {
    stage: PlanStage,
    /// Plan mode: the plan read at install (verified on read).
    file_plan: Option<Arc<Plan>>,
    /// Plan mode: where it came from (per-rank, shared by all ranks).
    source: Option<PlanSource>,
    jobs: Vec<PlanJob>,
    /// Engines to empty once, one iteration after they switched to a plan.
    settle: Vec<i32>,
}

/// A private pool: its engine and how many users hold it.
struct PrivatePool {
    engine: Engine<Tracked>,
    use_count: i32,
}

/// Device-level stats bookkeeping across engines.
#[derive(Default)]
struct Agg {
    /// Highest sums seen (only `peak` of each stat is used).
    peaks: DeviceStats,
    /// Accumulated counters of dropped engines (only `allocated`, `freed` and counters).
    retired: DeviceStats,
}

struct DeviceSlot {
    ordinal: i32,
    open_mu: Mutex<()>,
    mem: OnceLock<Arc<dyn BridgeDevice>>,
    default: OnceLock<Engine<Tracked>>,
    private: RwLock<BTreeMap<PoolId, PrivatePool>>,
    fraction: Mutex<f64>,
    /// The device-wide budget every engine of the device maps within.
    budget: Arc<DeviceBudget>,
    /// The offload schedule of the plan the default engine serves (empty: none).
    offload: Mutex<Vec<OffloadEntry>>,
    /// Auto mode under a budget: what planning decided about offload.
    offload_outcome: Mutex<Option<OffloadOutcome>>,
    agg: Mutex<Agg>,
}

/// Auto mode's background planning of one device's recorded trace. Without a budget
/// (`budget` `None`): the ordinary plan. Under one, when the trace has saved packs:
/// [`plan_with_budget`] (which plans the run without the recording's own offload);
/// a refusal (a budget below the minimum, ...) falls back to the ordinary plan, the
/// outcome saying why.
fn plan_in_background(
    trace: &Trace,
    opts: &PlannerOptions,
    budget: Option<u64>,
    has_packs: bool,
) -> PlanResult {
    let plain = |trace: &Trace| plan_trace(trace, opts).map(|o| o.plan);
    let Some(budget) = budget else {
        return plain(trace).map(|p| (p, None)).map_err(|e| e.to_string());
    };
    if !has_packs {
        let plan = plain(trace).map_err(|e| e.to_string())?;
        let outcome = (plan.pool_size.get() > budget).then(|| OffloadOutcome::NotPlanned {
            budget,
            reason: format!(
                "no offload planned: the plan needs {} over the budget {}, and the recording has no saved tensors (enable stweaver._offload while recording)",
                plan.pool_size,
                Bytes(budget)
            ),
        });
        return Ok((plan, outcome));
    }
    let mut o = OffloadOptions::new(Bytes(budget));
    o.plan = opts.clone();
    match plan_with_budget(trace, &o) {
        Ok(b) => {
            let r = &b.offload;
            let outcome = OffloadOutcome::Planned {
                budget,
                tensors: r.tensors,
                bytes_per_iteration: r.bytes_per_iteration.get(),
                planned_peak: r.planned_peak.get(),
                pool_without_offload: r.pool_without_offload.get(),
                stalls: r.stalls,
            };
            Ok((b.outcome.plan, Some(outcome)))
        }
        Err(err) => {
            let reason = format!(
                "no offload planned under the budget {}: {err}; planning without offload",
                Bytes(budget)
            );
            let plan = plain(trace).map_err(|e| format!("{reason}, which failed too: {e}"))?;
            Ok((plan, Some(OffloadOutcome::NotPlanned { budget, reason })))
        }
    }
}

/// A free whose completion has not been reported to the history yet.
#[derive(Debug, Clone, Copy)]
struct PendingFree {
    owner: Owner,
    ptr: u64,
    size: u64,
    stream: usize,
}

thread_local! {
    /// The last out-of-memory error of this thread (for `oom_info`, called right after).
    static LAST_OOM: RefCell<Option<(i32, EngineError)>> = const { RefCell::new(None) };
}

/// The process's allocator state. See the module documentation.
pub struct Core {
    settings: Settings,
    factory: DeviceFactory,
    shared: Arc<Shared>,
    devices: OnceLock<Vec<DeviceSlot>>,
    /// Private pools alive on all devices.
    private_pools: AtomicUsize,
    /// Devices whose default engine exists, and the last one opened.
    opened: AtomicUsize,
    last_opened: AtomicI32,
    /// The first device whose default engine opened: a rank's home device.
    first_opened: AtomicI32,
    iterations: AtomicU64,
    pending: Mutex<Vec<PendingFree>>,
    has_pending: AtomicBool,
    trace_flushed: AtomicBool,
    plan: Mutex<PlanControl>,
    /// Things the user should know that are not errors (a trace or plan file that could
    /// not be written, a device whose plan was rejected while another serves one).
    notes: Mutex<Vec<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every value behind these locks is updated in single assignments.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

/// The 29 `Stat`s of a `DeviceStats`, in a fixed order.
fn stats_of(s: &DeviceStats) -> [Stat; 29] {
    let mut out = [Stat::default(); 29];
    let arrays = [
        &s.allocation,
        &s.segment,
        &s.active,
        &s.inactive_split,
        &s.allocated_bytes,
        &s.reserved_bytes,
        &s.active_bytes,
        &s.inactive_split_bytes,
        &s.requested_bytes,
    ];
    for (k, arr) in arrays.iter().enumerate() {
        out[3 * k..3 * k + 3].copy_from_slice(&arr[..]);
    }
    out[27] = s.oversize_allocations;
    out[28] = s.oversize_segments;
    out
}

fn stats_of_mut(s: &mut DeviceStats) -> [&mut Stat; 29] {
    let DeviceStats {
        allocation: [a0, a1, a2],
        segment: [b0, b1, b2],
        active: [c0, c1, c2],
        inactive_split: [d0, d1, d2],
        allocated_bytes: [e0, e1, e2],
        reserved_bytes: [f0, f1, f2],
        active_bytes: [g0, g1, g2],
        inactive_split_bytes: [h0, h1, h2],
        requested_bytes: [i0, i1, i2],
        oversize_allocations: o1,
        oversize_segments: o2,
        ..
    } = s;
    [
        a0, a1, a2, b0, b1, b2, c0, c1, c2, d0, d1, d2, e0, e1, e2, f0, f1, f2, g0, g1, g2, h0, h1,
        h2, i0, i1, i2, o1, o2,
    ]
}

/// Combines engine stats into device stats (see the module documentation).
fn combine(engines: &[DeviceStats], agg: &Agg) -> DeviceStats {
    let mut out = DeviceStats::default();
    let flats: Vec<[Stat; 29]> = engines.iter().map(stats_of).collect();
    let peaks = stats_of(&agg.peaks);
    let retired = stats_of(&agg.retired);
    for (k, o) in stats_of_mut(&mut out).into_iter().enumerate() {
        let current: i64 = flats.iter().map(|f| f[k].current).sum();
        let own_peak = flats.iter().map(|f| f[k].peak).max().unwrap_or(0);
        o.current = current;
        o.peak = peaks[k].peak.max(current).max(own_peak);
        o.allocated = flats.iter().map(|f| f[k].allocated).sum::<i64>() + retired[k].allocated;
        o.freed = flats.iter().map(|f| f[k].freed).sum::<i64>() + retired[k].freed;
    }
    let r = &agg.retired;
    out.num_alloc_retries =
        engines.iter().map(|s| s.num_alloc_retries).sum::<i64>() + r.num_alloc_retries;
    out.num_ooms = engines.iter().map(|s| s.num_ooms).sum::<i64>() + r.num_ooms;
    out.num_sync_all_streams =
        engines.iter().map(|s| s.num_sync_all_streams).sum::<i64>() + r.num_sync_all_streams;
    out.num_device_alloc =
        engines.iter().map(|s| s.num_device_alloc).sum::<i64>() + r.num_device_alloc;
    out.num_device_free =
        engines.iter().map(|s| s.num_device_free).sum::<i64>() + r.num_device_free;
    out.max_split_size = engines.first().map_or(-1, |s| s.max_split_size);
    out
}

fn to_ffi_stat(s: Stat) -> ffi::Stat {
    ffi::Stat {
        current: s.current,
        peak: s.peak,
        allocated: s.allocated,
        freed: s.freed,
    }
}

fn to_ffi_array(a: &[Stat; 3]) -> ffi::StatArray {
    ffi::StatArray {
        all: to_ffi_stat(a[0]),
        small_pool: to_ffi_stat(a[1]),
        large_pool: to_ffi_stat(a[2]),
    }
}

/// `DeviceStats` as the bridge struct.
pub fn to_ffi_stats(s: &DeviceStats) -> ffi::DeviceStats {
    ffi::DeviceStats {
        allocation: to_ffi_array(&s.allocation),
        segment: to_ffi_array(&s.segment),
        active: to_ffi_array(&s.active),
        inactive_split: to_ffi_array(&s.inactive_split),
        allocated_bytes: to_ffi_array(&s.allocated_bytes),
        reserved_bytes: to_ffi_array(&s.reserved_bytes),
        active_bytes: to_ffi_array(&s.active_bytes),
        inactive_split_bytes: to_ffi_array(&s.inactive_split_bytes),
        requested_bytes: to_ffi_array(&s.requested_bytes),
        num_alloc_retries: s.num_alloc_retries,
        num_ooms: s.num_ooms,
        oversize_allocations: to_ffi_stat(s.oversize_allocations),
        oversize_segments: to_ffi_stat(s.oversize_segments),
        num_sync_all_streams: s.num_sync_all_streams,
        num_device_alloc: s.num_device_alloc,
        num_device_free: s.num_device_free,
        max_split_size: s.max_split_size,
    }
}

/// Splits one arena into PyTorch segments: each maximal run of mapped blocks.
fn arena_segments(device: i32, pool: PoolId, arena: &SegmentInfo, snap: &mut ffi::Snapshot) {
    let mut i = 0;
    let blocks = &arena.blocks;
    while i < blocks.len() {
        if !blocks[i].state.is_mapped() {
            i += 1;
            continue;
        }
        let first_block = snap.blocks.len();
        let mut seg = ffi::SnapshotSegment {
            device,
            address: blocks[i].addr.get(),
            stream: arena.stream.0 as usize,
            is_large: arena.pool == PoolKind::Large,
            is_expandable: true,
            pool,
            first_block,
            ..Default::default()
        };
        while i < blocks.len() && blocks[i].state.is_mapped() {
            let b = &blocks[i];
            let allocated = b.state == BlockState::Allocated;
            let active = allocated || b.state == BlockState::PendingFree;
            seg.total_size += b.size.get();
            if allocated {
                seg.allocated_size += b.size.get();
            }
            if active {
                seg.active_size += b.size.get();
                seg.requested_size += b.requested.get();
            }
            snap.blocks.push(ffi::SnapshotBlock {
                address: b.addr.get(),
                size: b.size.get(),
                requested_size: b.requested.get(),
                allocated,
                active,
            });
            i += 1;
        }
        seg.num_blocks = snap.blocks.len() - first_block;
        snap.segments.push(seg);
    }
}

impl Core {
    /// A runtime with `settings`, opening devices with `factory`.
    pub fn new(settings: Settings, factory: DeviceFactory) -> Core {
        let mut control = PlanControl {
            stage: PlanStage::NotPlanning,
            file_plan: None,
            source: None,
            jobs: Vec::new(),
            settle: Vec::new(),
        };
        match settings.mode {
            Mode::Auto => control.stage = PlanStage::Recording,
            Mode::Plan => {
                // A bad plan never stops training: it is reported and serving is online
                // (invariant 3). The file is verified once, here.
                // Under torchrun, a plan named for another rank is refused (crate::dist).
                let source = settings
                    .plan_source()
                    .unwrap_or_else(|| PlanSource::Own(PathBuf::new()));
                if let Some(why) = source.refusal() {
                    control.stage = PlanStage::Fallback(why);
                } else {
                    match read_plan_file(source.path()) {
                        // A one-shot plan of shapes that do not repeat would reserve more
                        // than online serving (plan_pool::servable_from_start).
                        Ok(plan) => match servable_from_start(&plan) {
                            Ok(()) => control.file_plan = Some(Arc::new(plan)),
                            Err(why) => {
                                let why = format!("{}: {why}", source.path().display());
                                eprintln!("stweaver: warning: plan refused, serving online: {why}");
                                control.stage = PlanStage::Fallback(why);
                            }
                        },
                        Err(e) => control.stage = PlanStage::Fallback(e.to_string()),
                    }
                }
                control.source = Some(source);
            }
            Mode::Online | Mode::Trace => {}
        }
        Core {
            settings,
            factory,
            shared: Arc::new(Shared::default()),
            devices: OnceLock::new(),
            private_pools: AtomicUsize::new(0),
            opened: AtomicUsize::new(0),
            last_opened: AtomicI32::new(-1),
            first_opened: AtomicI32::new(-1),
            iterations: AtomicU64::new(0),
            pending: Mutex::new(Vec::new()),
            has_pending: AtomicBool::new(false),
            trace_flushed: AtomicBool::new(false),
            plan: Mutex::new(control),
            notes: Mutex::new(Vec::new()),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    // ------------------------------------------------------------------ devices

    pub fn init(&self, device_count: i32) -> Result<()> {
        let n = device_count.max(0);
        let slots = (0..n)
            .map(|ordinal| DeviceSlot {
                ordinal,
                open_mu: Mutex::new(()),
                mem: OnceLock::new(),
                default: OnceLock::new(),
                private: RwLock::new(BTreeMap::new()),
                fraction: Mutex::new(1.0),
                budget: Arc::new(DeviceBudget::default()),
                offload: Mutex::new(Vec::new()),
                offload_outcome: Mutex::new(None),
                agg: Mutex::new(Agg::default()),
            })
            .collect();
        if self.devices.set(slots).is_err() {
            let first = self.devices.get().map_or(0, Vec::len) as i32;
            if first != n {
                return Err(BridgeError::Reinit { first, got: n });
            }
        }
        Ok(())
    }

    fn slots(&self) -> Result<&[DeviceSlot]> {
        self.devices
            .get()
            .map(Vec::as_slice)
            .ok_or(BridgeError::NotInitialised)
    }

    fn slot(&self, device: i32) -> Result<&DeviceSlot> {
        let slots = self.slots()?;
        usize::try_from(device)
            .ok()
            .and_then(|d| slots.get(d))
            .ok_or(BridgeError::BadDevice {
                device,
                count: slots.len(),
            })
    }

    fn device_memory(&self, slot: &DeviceSlot) -> Result<Arc<dyn BridgeDevice>> {
        if let Some(m) = slot.mem.get() {
            return Ok(m.clone());
        }
        let _g = lock(&slot.open_mu);
        if let Some(m) = slot.mem.get() {
            return Ok(m.clone());
        }
        let m = (self.factory)(slot.ordinal).map_err(|e| BridgeError::OpenDevice {
            device: slot.ordinal,
            error: e.to_string(),
        })?;
        let total = DeviceMemory::total_memory(&*m).get();
        slot.budget.set_limit(effective_limit(
            self.settings.budget,
            *lock(&slot.fraction),
            total,
        ));
        let _ = slot.mem.set(m.clone());
        Ok(m)
    }

    fn new_engine(&self, slot: &DeviceSlot, pool: PoolId) -> Result<Engine<Tracked>> {
        let mem = self.device_memory(slot)?;
        let owner = Owner {
            device: slot.ordinal,
            pool,
        };
        let config = EngineConfig {
            device: DeviceId(slot.ordinal),
            limit: MemoryLimit::Bytes(Bytes(slot.budget.limit())),
            arena_size: None,
            record_trace: matches!(self.settings.mode, Mode::Trace | Mode::Auto)
                && is_default(pool),
            release_before_new_peak: self.settings.release_at_peak,
        };
        Ok(Engine::new(
            Tracked::new(mem, owner, self.shared.clone(), slot.budget.clone()),
            config,
        )?)
    }

    fn default_engine<'a>(&self, slot: &'a DeviceSlot) -> Result<&'a Engine<Tracked>> {
        if let Some(e) = slot.default.get() {
            return Ok(e);
        }
        let engine = self.new_engine(slot, DEFAULT_POOL)?;
        let opened_now = {
            let _g = lock(&slot.open_mu);
            if slot.default.get().is_none() {
                let _ = slot.default.set(engine);
                self.opened.fetch_add(1, Ordering::AcqRel);
                self.last_opened.store(slot.ordinal, Ordering::Release);
                let _ = self.first_opened.compare_exchange(
                    -1,
                    slot.ordinal,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                true
            } else {
                false
            }
        };
        let e = slot.default.get().ok_or(BridgeError::NotInitialised)?;
        if opened_now && self.settings.mode == Mode::Plan {
            self.serve_file_plan(slot.ordinal, e);
        }
        Ok(e)
    }

    /// The rank's home device (the first device opened), under torchrun only.
    fn home(&self) -> Option<i32> {
        self.settings.rank?;
        let d = self.first_opened.load(Ordering::Acquire);
        (d >= 0).then_some(d)
    }

    /// Plan mode: serves the install-time plan on the device it was made for. Under
    /// torchrun the rank's home device decides: a rank's own plan made for another
    /// device is refused (with a warning), a shared plan is served there (crate::dist).
    fn serve_file_plan(&self, device: i32, e: &Engine<Tracked>) {
        let mut pc = lock(&self.plan);
        let Some(mut plan) = pc.file_plan.clone() else {
            return;
        };
        if plan.device != DeviceId(device) {
            let Some(rank) = self.settings.rank else {
                return; // a single process may open its plan's device later
            };
            if self.home() != Some(device) || pc.stage != PlanStage::NotPlanning {
                return;
            }
            let path = pc
                .source
                .as_ref()
                .map(|s| s.path().display().to_string())
                .unwrap_or_default();
            if matches!(pc.source, Some(PlanSource::Shared(_))) {
                lock(&self.notes).push(format!(
                    "rank {}: serving the shared plan {path} (recorded on {}) on cuda:{device}",
                    rank.rank, plan.device
                ));
                let mut p = (*plan).clone();
                p.device = DeviceId(device);
                plan = Arc::new(p);
            } else {
                let why = format!(
                    "rank {}: {path} was made for {} but this rank allocates on cuda:{device}: \
                     refused, this rank trains online",
                    rank.rank, plan.device
                );
                eprintln!("stweaver: warning: {why}");
                pc.stage = PlanStage::Fallback(why);
                pc.file_plan = None;
                return;
            }
        }
        match e.load_plan(&plan, self.plan_options()) {
            Ok(()) => {
                if let Ok(slot) = self.slot(device) {
                    *lock(&slot.offload) = plan.offload.clone();
                }
                pc.stage = PlanStage::Serving(vec![device]);
            }
            Err(err) => pc.stage = PlanStage::Fallback(format!("cuda:{device}: {err}")),
        }
    }

    /// How the engines serve a plan (install settings).
    fn plan_options(&self) -> EnginePlanOptions {
        EnginePlanOptions {
            wait_for_pending_frees: self.settings.plan_wait,
            ..EnginePlanOptions::default()
        }
    }

    /// Runs `f` on the engine of `owner`.
    fn with_engine<T>(
        &self,
        owner: Owner,
        f: impl FnOnce(&Engine<Tracked>) -> Result<T>,
    ) -> Result<T> {
        let slot = self.slot(owner.device)?;
        if is_default(owner.pool) {
            return f(self.default_engine(slot)?);
        }
        let pools = read(&slot.private);
        let p = pools.get(&owner.pool).ok_or(BridgeError::UnknownPool {
            device: owner.device,
            pool: owner.pool,
        })?;
        f(&p.engine)
    }

    /// The engine that handed out `ptr`.
    fn owner_of(&self, ptr: usize) -> Result<Owner> {
        if self.private_pools.load(Ordering::Acquire) == 0
            && self.opened.load(Ordering::Acquire) == 1
        {
            return Ok(Owner {
                device: self.last_opened.load(Ordering::Acquire),
                pool: DEFAULT_POOL,
            });
        }
        self.shared
            .owner_of(ptr as u64)
            .ok_or(BridgeError::UnknownPointer(ptr))
    }

    // ------------------------------------------------------------------ serving

    /// Allocates; `Ok(0)` on out-of-memory (details for [`Core::oom_info`]).
    pub fn malloc(&self, device: i32, size: usize, stream: usize, pool: PoolId) -> Result<usize> {
        let slot = self.slot(device)?;
        let owner = Owner { device, pool };
        let result = self.with_engine(owner, |e| {
            Ok(e.malloc(Bytes(size as u64), StreamId(stream as u64)))
        })?;
        let ptr = match result {
            Ok(p) => p,
            Err(e @ EngineError::OutOfMemory { .. }) => {
                LAST_OOM.with(|c| *c.borrow_mut() = Some((device, e)));
                self.after_op(slot)?;
                return Ok(0);
            }
            Err(e) => return Err(e.into()),
        };
        if self.shared.history_on() {
            self.resolve_pending();
            self.shared.push(HistoryEvent {
                action: HistoryAction::Alloc,
                device,
                addr: ptr.get(),
                size: size as u64,
                stream,
                pool,
            });
        }
        self.after_op(slot)?;
        Ok(ptr.get() as usize)
    }

    /// Frees `ptr` (deferred behind other streams' use).
    pub fn free(&self, ptr: usize) -> Result<()> {
        let owner = self.owner_of(ptr)?;
        let history = self.shared.history_on();
        let dptr = DevicePtr(ptr as u64);
        self.with_engine(owner, |e| {
            let info = if history {
                Some(e.block_info(dptr)?)
            } else {
                None
            };
            e.free(dptr)?;
            if let Some(info) = info {
                let ev = |action| HistoryEvent {
                    action,
                    device: owner.device,
                    addr: dptr.get(),
                    size: info.requested.get(),
                    stream: info.stream.0 as usize,
                    pool: owner.pool,
                };
                self.shared.push(ev(HistoryAction::FreeRequested));
                match e.block_info(dptr) {
                    Ok(b) if b.state == BlockState::PendingFree => {
                        lock(&self.pending).push(PendingFree {
                            owner,
                            ptr: dptr.get(),
                            size: info.requested.get(),
                            stream: info.stream.0 as usize,
                        });
                        self.has_pending.store(true, Ordering::Release);
                    }
                    _ => self.shared.push(ev(HistoryAction::FreeCompleted)),
                }
            }
            Ok(())
        })?;
        let slot = self.slot(owner.device)?;
        if !is_default(owner.pool) {
            self.maybe_retire(slot, owner.pool)?;
        }
        self.after_op(slot)
    }

    pub fn record_stream(&self, ptr: usize, stream: usize) -> Result<()> {
        let owner = self.owner_of(ptr)?;
        self.with_engine(owner, |e| {
            Ok(e.record_stream(DevicePtr(ptr as u64), StreamId(stream as u64))?)
        })
    }

    /// Reports the completion of deferred frees (history only).
    fn resolve_pending(&self) {
        if !self.has_pending.load(Ordering::Acquire) {
            return;
        }
        let mut pending = lock(&self.pending);
        pending.retain(|p| {
            let still = self
                .with_engine(p.owner, |e| {
                    Ok(matches!(
                        e.block_info(DevicePtr(p.ptr)),
                        Ok(b) if b.state == BlockState::PendingFree
                    ))
                })
                .unwrap_or(false);
            if !still {
                self.shared.push(HistoryEvent {
                    action: HistoryAction::FreeCompleted,
                    device: p.owner.device,
                    addr: p.ptr,
                    size: p.size,
                    stream: p.stream,
                    pool: p.owner.pool,
                });
            }
            still
        });
        self.has_pending
            .store(!pending.is_empty(), Ordering::Release);
    }

    /// After every operation on `slot`: keep device-level peaks exact while private pools
    /// exist.
    fn after_op(&self, slot: &DeviceSlot) -> Result<()> {
        if self.private_pools.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let all = self.engine_stats(slot)?;
        let mut agg = lock(&slot.agg);
        let sums = combine(&all, &Agg::default());
        let sum_flat = stats_of(&sums);
        for (k, p) in stats_of_mut(&mut agg.peaks).into_iter().enumerate() {
            p.peak = p.peak.max(sum_flat[k].current);
        }
        Ok(())
    }

    fn engine_stats(&self, slot: &DeviceSlot) -> Result<Vec<DeviceStats>> {
        let mut all = Vec::new();
        if let Some(e) = slot.default.get() {
            all.push(e.stats()?);
        }
        for p in read(&slot.private).values() {
            all.push(p.engine.stats()?);
        }
        Ok(all)
    }

    // ------------------------------------------------------------------ caching, limits

    fn for_devices(&self, device: i32) -> Result<Vec<&DeviceSlot>> {
        if device < 0 {
            Ok(self.slots()?.iter().collect())
        } else {
            Ok(vec![self.slot(device)?])
        }
    }

    pub fn empty_cache(&self, device: i32, pool: PoolId) -> Result<()> {
        for slot in self.for_devices(device)? {
            if is_default(pool) {
                if let Some(e) = slot.default.get() {
                    e.empty_cache()?;
                }
                let released: Vec<PoolId> = read(&slot.private)
                    .iter()
                    .filter(|(_, p)| p.use_count == 0)
                    .map(|(&id, _)| id)
                    .collect();
                for id in released {
                    if let Some(p) = read(&slot.private).get(&id) {
                        p.engine.empty_cache()?;
                    }
                    self.maybe_retire(slot, id)?;
                }
            } else if let Some(p) = read(&slot.private).get(&pool) {
                p.engine.empty_cache()?;
            }
            if !is_default(pool) {
                self.maybe_retire(slot, pool)?;
            }
            self.after_op(slot)?;
        }
        self.resolve_pending();
        Ok(())
    }

    pub fn set_memory_fraction(&self, device: i32, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(BridgeError::BadFraction(fraction));
        }
        let slot = self.slot(device)?;
        *lock(&slot.fraction) = fraction;
        let limit = match slot.mem.get() {
            Some(m) => {
                let total = DeviceMemory::total_memory(&**m).get();
                let bytes = effective_limit(self.settings.budget, fraction, total);
                slot.budget.set_limit(bytes);
                MemoryLimit::Bytes(Bytes(bytes))
            }
            // Not opened yet: the device's engines take the limit when they open.
            None => return Ok(()),
        };
        if let Some(e) = slot.default.get() {
            e.set_memory_limit(limit)?;
        }
        for p in read(&slot.private).values() {
            p.engine.set_memory_limit(limit)?;
        }
        Ok(())
    }

    pub fn memory_fraction(&self, device: i32) -> Result<f64> {
        Ok(*lock(&self.slot(device)?.fraction))
    }

    pub fn oom_info(&self, device: i32, size: usize) -> Result<ffi::OomInfo> {
        let slot = self.slot(device)?;
        let mem = self.device_memory(slot)?;
        let total = DeviceMemory::total_memory(&*mem).get();
        let last = LAST_OOM.with(|c| c.borrow_mut().take());
        // Device-wide: every pool of the device, as the budget counts.
        let s = self.device_stats_raw(slot)?;
        let live = s.allocated_bytes[0].current.max(0) as u64;
        let reserved = s.reserved_bytes[0].current.max(0) as u64;
        let limit = slot.budget.limit().min(total);
        let mut detail = Vec::new();
        if let Some(b) = self.settings.budget {
            detail.push(format!(
                "The stweaver budget is {} (STWEAVER_BUDGET={b}); with \
                 set_per_process_memory_fraction the smaller limit holds.",
                Bytes(b.bytes(total).min(total))
            ));
        }
        detail.push(format!(
            "Over every pool of the device: {} live, {} cached (reserved but free) after \
             giving the cache back.",
            Bytes(live),
            Bytes(reserved.saturating_sub(live)),
        ));
        if let Some(e) = slot.default.get()
            && let Some(why) = e.plan_abandoned()?
        {
            detail.push(format!("The plan is no longer served: {why}."));
        }
        if let Some((
            d,
            EngineError::OutOfMemory {
                rounded,
                allocated,
                reserved,
                free_reserved,
                device_free,
                ..
            },
        )) = last
            && d == device
        {
            if free_reserved >= rounded {
                detail.push(format!(
                    "stweaver holds {free_reserved} free inside this pool's arenas, but no \
                     free block of {rounded} fits on this stream (fragmentation; empty_cache \
                     cannot help)."
                ));
            }
            return Ok(ffi::OomInfo {
                rounded: rounded.get(),
                allocated: allocated.get(),
                reserved: reserved.get(),
                limit,
                device_free: device_free.get(),
                device_total: total,
                detail: detail.join(" "),
            });
        }
        let rounded = (size as u64).div_ceil(512) * 512;
        Ok(ffi::OomInfo {
            rounded,
            allocated: live,
            reserved,
            limit,
            device_free: DeviceMemory::free_memory(&*mem).map_or(0, Bytes::get),
            device_total: total,
            detail: detail.join(" "),
        })
    }

    pub fn largest_free_block(&self, device: i32) -> Result<u64> {
        let slot = self.slot(device)?;
        let Some(e) = slot.default.get() else {
            return Ok(0);
        };
        Ok(e.snapshot()?
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state == BlockState::Free)
            .map(|b| b.size.get())
            .max()
            .unwrap_or(0))
    }

    pub fn base_allocation(&self, ptr: usize) -> Result<ffi::Range> {
        let owner = self
            .shared
            .owner_of(ptr as u64)
            .ok_or(BridgeError::UnknownPointer(ptr))?;
        let mut snap = ffi::Snapshot::default();
        self.with_engine(owner, |e| {
            for arena in e.snapshot()? {
                arena_segments(owner.device, owner.pool, &arena, &mut snap);
            }
            Ok(())
        })?;
        let p = ptr as u64;
        snap.segments
            .iter()
            .find(|s| p >= s.address && p - s.address < s.total_size)
            .map(|s| ffi::Range {
                base: s.address,
                size: s.total_size,
            })
            .ok_or(BridgeError::UnknownPointer(ptr))
    }

    // ------------------------------------------------------------------ stats, snapshot

    fn device_stats_raw(&self, slot: &DeviceSlot) -> Result<DeviceStats> {
        let all = self.engine_stats(slot)?;
        let agg = lock(&slot.agg);
        if all.is_empty() {
            return Ok(combine(&[DeviceStats::default()], &agg));
        }
        Ok(combine(&all, &agg))
    }

    pub fn device_stats(&self, device: i32) -> Result<DeviceStats> {
        self.device_stats_raw(self.slot(device)?)
    }

    pub fn reset_peak_stats(&self, device: i32) -> Result<()> {
        let slot = self.slot(device)?;
        if let Some(e) = slot.default.get() {
            e.reset_peak_stats()?;
        }
        for p in read(&slot.private).values() {
            p.engine.reset_peak_stats()?;
        }
        let all = self.engine_stats(slot)?;
        let sums = stats_of(&combine(&all, &Agg::default()));
        let mut agg = lock(&slot.agg);
        for (k, p) in stats_of_mut(&mut agg.peaks).into_iter().enumerate() {
            p.peak = sums[k].current;
        }
        Ok(())
    }

    pub fn reset_accumulated_stats(&self, device: i32) -> Result<()> {
        let slot = self.slot(device)?;
        if let Some(e) = slot.default.get() {
            e.reset_accumulated_stats()?;
        }
        for p in read(&slot.private).values() {
            p.engine.reset_accumulated_stats()?;
        }
        lock(&slot.agg).retired = DeviceStats::default();
        Ok(())
    }

    pub fn snapshot(&self, pool: PoolId, all_pools: bool) -> Result<ffi::Snapshot> {
        let mut snap = ffi::Snapshot::default();
        for slot in self.slots()? {
            if (all_pools || is_default(pool))
                && let Some(e) = slot.default.get()
            {
                for arena in e.snapshot()? {
                    arena_segments(slot.ordinal, DEFAULT_POOL, &arena, &mut snap);
                }
            }
            for (&id, p) in read(&slot.private).iter() {
                if all_pools || id == pool {
                    for arena in p.engine.snapshot()? {
                        arena_segments(slot.ordinal, id, &arena, &mut snap);
                    }
                }
            }
        }
        // Sorted by (device, address), blocks renumbered to follow.
        let mut order: Vec<usize> = (0..snap.segments.len()).collect();
        order.sort_by_key(|&i| (snap.segments[i].device, snap.segments[i].address));
        let mut out = ffi::Snapshot::default();
        for i in order {
            let mut seg = snap.segments[i];
            let blocks = &snap.blocks[seg.first_block..seg.first_block + seg.num_blocks];
            seg.first_block = out.blocks.len();
            out.blocks.extend_from_slice(blocks);
            out.segments.push(seg);
        }
        Ok(out)
    }

    // ------------------------------------------------------------------ private pools

    pub fn pool_incref(&self, device: i32, pool: PoolId) -> Result<()> {
        if is_default(pool) {
            return Err(BridgeError::DefaultPoolIsNotPrivate);
        }
        let slot = self.slot(device)?;
        if let Some(p) = slot
            .private
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&pool)
        {
            p.use_count += 1;
            return Ok(());
        }
        // Before the first private pool, fold the default engine's peaks into the device
        // peaks: from now on peaks are tracked across engines.
        if let Some(e) = slot.default.get() {
            let s = stats_of(&e.stats()?);
            let mut agg = lock(&slot.agg);
            for (k, p) in stats_of_mut(&mut agg.peaks).into_iter().enumerate() {
                p.peak = p.peak.max(s[k].peak);
            }
        }
        let engine = self.new_engine(slot, pool)?;
        let mut pools = slot.private.write().unwrap_or_else(|e| e.into_inner());
        match pools.get_mut(&pool) {
            Some(p) => p.use_count += 1, // another thread made it meanwhile; ours drops
            None => {
                pools.insert(
                    pool,
                    PrivatePool {
                        engine,
                        use_count: 1,
                    },
                );
                self.private_pools.fetch_add(1, Ordering::AcqRel);
            }
        }
        Ok(())
    }

    pub fn pool_release(&self, device: i32, pool: PoolId) -> Result<()> {
        let slot = self.slot(device)?;
        {
            let mut pools = slot.private.write().unwrap_or_else(|e| e.into_inner());
            let p = pools
                .get_mut(&pool)
                .ok_or(BridgeError::UnknownPool { device, pool })?;
            if p.use_count <= 0 {
                return Err(BridgeError::PoolOverReleased { device, pool });
            }
            p.use_count -= 1;
            if p.use_count > 0 {
                return Ok(());
            }
        }
        // Nobody will allocate from it again: give its cache back now.
        if let Some(p) = read(&slot.private).get(&pool) {
            p.engine.empty_cache()?;
        }
        self.maybe_retire(slot, pool)
    }

    pub fn pool_use_count(&self, device: i32, pool: PoolId) -> Result<i32> {
        let slot = self.slot(device)?;
        Ok(read(&slot.private).get(&pool).map_or(0, |p| p.use_count))
    }

    pub fn pool_live_allocations(&self, device: i32, pool: PoolId) -> Result<Vec<usize>> {
        let owner = Owner { device, pool };
        self.with_engine(owner, |e| {
            Ok(e.snapshot()?
                .iter()
                .flat_map(|s| s.blocks.iter())
                .filter(|b| b.state == BlockState::Allocated)
                .map(|b| b.addr.get() as usize)
                .collect())
        })
    }

    /// The allocated blocks of a private pool (`getCheckpointState`, taken by CUDA graph
    /// trees right after recording a graph). The pool keeps its address ranges from now
    /// on, so the checkpoint stays restorable while the pool lives.
    pub fn pool_checkpoint(&self, device: i32, pool: PoolId) -> Result<Checkpoint> {
        if is_default(pool) {
            return Err(BridgeError::DefaultPoolIsNotPrivate);
        }
        self.with_engine(Owner { device, pool }, |e| Ok(e.checkpoint()?))
    }

    /// Brings a private pool back to `checkpoint` (`setCheckpointPoolState`): every block
    /// allocated in it now is freed, every checkpointed block allocated again at its
    /// address ([`Engine::restore`]). The history sees the frees and the allocations.
    pub fn pool_restore(
        &self,
        device: i32,
        pool: PoolId,
        checkpoint: &Checkpoint,
    ) -> Result<Restored> {
        if is_default(pool) {
            return Err(BridgeError::DefaultPoolIsNotPrivate);
        }
        let slot = self.slot(device)?;
        let r = self.with_engine(Owner { device, pool }, |e| Ok(e.restore(checkpoint)?))?;
        if self.shared.history_on() {
            self.resolve_pending();
            let ev = |action, b: &stweaver_core::engine::BlockInfo| HistoryEvent {
                action,
                device,
                addr: b.addr.get(),
                size: b.requested.get(),
                stream: b.stream.0 as usize,
                pool,
            };
            for b in &r.freed {
                self.shared.push(ev(HistoryAction::FreeRequested, b));
                self.shared.push(ev(HistoryAction::FreeCompleted, b));
            }
            for b in &r.created {
                self.shared.push(ev(HistoryAction::Alloc, b));
            }
        }
        self.after_op(slot)?;
        Ok(r)
    }

    /// Drops a released private pool once nothing in it is active.
    fn maybe_retire(&self, slot: &DeviceSlot, pool: PoolId) -> Result<()> {
        let removable = match read(&slot.private).get(&pool) {
            Some(p) => p.use_count == 0 && p.engine.stats()?.active[0].current == 0,
            None => false,
        };
        if !removable {
            return Ok(());
        }
        let removed = {
            let mut pools = slot.private.write().unwrap_or_else(|e| e.into_inner());
            match pools.get(&pool) {
                Some(p) if p.use_count == 0 => pools.remove(&pool),
                _ => None,
            }
        };
        let Some(p) = removed else {
            return Ok(());
        };
        p.engine.empty_cache()?;
        let s = p.engine.stats()?;
        {
            // Keep the device's peaks and accumulated counters across the drop.
            let mut agg = lock(&slot.agg);
            let own = stats_of(&s);
            for (k, r) in stats_of_mut(&mut agg.retired).into_iter().enumerate() {
                r.allocated += own[k].allocated;
                r.freed += own[k].freed;
            }
            let r = &mut agg.retired;
            r.num_alloc_retries += s.num_alloc_retries;
            r.num_ooms += s.num_ooms;
            r.num_sync_all_streams += s.num_sync_all_streams;
            r.num_device_alloc += s.num_device_alloc;
            r.num_device_free += s.num_device_free;
        }
        drop(p); // unmaps and releases whatever is left
        self.private_pools.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }

    // ------------------------------------------------------------------ history, peers

    pub fn set_history(&self, enabled: bool) {
        self.shared.set_history(enabled);
        if !enabled {
            lock(&self.pending).clear();
            self.has_pending.store(false, Ordering::Release);
        }
    }

    pub fn drain_history(&self) -> Vec<HistoryEvent> {
        self.resolve_pending();
        self.shared.drain()
    }

    pub fn enable_peer_access(&self, device: i32, peer: i32) -> Result<()> {
        let slot = self.slot(device)?;
        self.slot(peer)?;
        self.device_memory(slot)?.enable_peer_access(peer)
    }

    // ------------------------------------------------------------------ iterations, trace

    /// Default engines of the devices opened so far (none before CUDA's lazy init).
    fn opened_engines(&self) -> Vec<&Engine<Tracked>> {
        self.devices
            .get()
            .map(|slots| slots.iter().filter_map(|s| s.default.get()).collect())
            .unwrap_or_default()
    }

    pub fn step(&self) -> Result<()> {
        let n = self.iterations.fetch_add(1, Ordering::AcqRel) + 1;
        for e in self.opened_engines() {
            e.mark_iteration()?;
        }
        self.plan_step(n)
    }

    /// Plan bookkeeping at an iteration boundary: releases the online cache one iteration
    /// after a switch to a plan; in auto mode, starts planning after the recorded
    /// iterations and switches to the plan once it is ready.
    fn plan_step(&self, n: u64) -> Result<()> {
        let mut pc = lock(&self.plan);
        for d in std::mem::take(&mut pc.settle) {
            // The previous iteration's online blocks are gone: give their memory back.
            if let Some(e) = self.slot(d)?.default.get() {
                e.empty_cache()?;
            }
        }
        if self.settings.mode != Mode::Auto {
            return Ok(());
        }
        match pc.stage {
            PlanStage::Recording if n > self.settings.auto_iterations => {
                let share_streams = self.settings.share_streams;
                let mut jobs = Vec::new();
                for slot in self.slots()? {
                    let Some(e) = slot.default.get() else {
                        continue;
                    };
                    let Some(trace) = e.take_trace()? else {
                        continue;
                    };
                    if let Some(path) = self.settings.trace_path_on(slot.ordinal, self.home())
                        && let Err(err) = write_trace_file(&path, &trace)
                    {
                        lock(&self.notes).push(err.to_string());
                    }
                    // Under a budget, with saved tensors recorded: plan the fewest
                    // bytes of offload that fit the device's limit (budget and memory
                    // fraction), from the run without the recording's own offload
                    // (restore links, `un_offload`).
                    let budget = self.settings.budget.map(|_| slot.budget.limit());
                    let has_packs = trace
                        .events
                        .iter()
                        .any(|e| matches!(e.kind, EventKind::SavedPack(_)));
                    let handle = std::thread::Builder::new()
                        .name(format!("stweaver-plan-cuda{}", slot.ordinal))
                        .spawn(move || {
                            // The greedy stage alone: tens of milliseconds on a real
                            // trace (37 ms for 1802 allocations, within 0.7 % of the
                            // lower bound), so the switch comes a few iterations after
                            // recording; the improvement stage took 0.5 s there, longer
                            // than whole short runs.
                            let opts = PlannerOptions {
                                share_streams,
                                solve: SolveOptions {
                                    improve: false,
                                    time_budget: Some(Duration::from_secs(5)),
                                    ..SolveOptions::default()
                                },
                                ..PlannerOptions::default()
                            };
                            plan_in_background(&trace, &opts, budget, has_packs)
                        })
                        .map_err(|e| {
                            BridgeError::Settings(format!("cannot start the planner: {e}"))
                        })?;
                    jobs.push(PlanJob {
                        device: slot.ordinal,
                        handle,
                    });
                }
                pc.stage = if jobs.is_empty() {
                    PlanStage::Fallback("no allocation was recorded to plan".into())
                } else {
                    PlanStage::Planning
                };
                pc.jobs = jobs;
            }
            PlanStage::Planning if pc.jobs.iter().all(|j| j.handle.is_finished()) => {
                let mut serving = Vec::new();
                let mut errors = Vec::new();
                for job in std::mem::take(&mut pc.jobs) {
                    let d = job.device;
                    let plan = match job.handle.join() {
                        Ok(Ok((plan, outcome))) => {
                            if let Some(OffloadOutcome::NotPlanned { reason, .. }) = &outcome {
                                lock(&self.notes).push(format!("cuda:{d}: {reason}"));
                            }
                            *lock(&self.slot(d)?.offload_outcome) = outcome;
                            plan
                        }
                        Ok(Err(e)) => {
                            errors.push(format!("cuda:{d}: planning failed: {e}"));
                            continue;
                        }
                        Err(_) => {
                            errors.push(format!("cuda:{d}: the planner panicked"));
                            continue;
                        }
                    };
                    if let Some(path) = self.settings.plan_path_on(d, self.home())
                        && let Err(err) = write_plan_file(&path, &plan)
                    {
                        lock(&self.notes).push(err.to_string());
                    }
                    let Some(e) = self.slot(d)?.default.get() else {
                        continue;
                    };
                    // The engine serves the plan's steady iteration from here on (the
                    // prologue already ran online; the persistent tensors' room is squeezed
                    // out of the pool) and releases the online cache first, so the pool
                    // replaces it instead of adding to it. step() marked the iteration.
                    match e.switch_to_plan(&plan, self.plan_options()) {
                        Ok(()) => {
                            *lock(&self.slot(d)?.offload) = plan.offload.clone();
                            serving.push(d);
                            pc.settle.push(d);
                        }
                        Err(err) => errors.push(format!("cuda:{d}: {err}")),
                    }
                }
                if serving.is_empty() {
                    pc.stage = PlanStage::Fallback(errors.join("; "));
                } else {
                    lock(&self.notes).extend(errors);
                    pc.stage = PlanStage::Serving(serving);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The default engine of the allocation starting at `ptr`, if any (private pools
    /// record nothing).
    fn recording_engine(&self, ptr: usize) -> Result<Option<&Engine<Tracked>>> {
        if ptr == 0 {
            return Ok(None);
        }
        let Some(owner) = self.shared.owner_of(ptr as u64) else {
            return Ok(None);
        };
        if !is_default(owner.pool) {
            return Ok(None);
        }
        Ok(self.slot(owner.device)?.default.get())
    }

    /// Records a saved-tensor pack or unpack for the allocation starting at `ptr` (the
    /// default pool's recorder; private pools record nothing). The allocation's trace
    /// id, `None` when nothing was recorded: not recording, `ptr` 0, or no live
    /// allocation starts there.
    pub fn record_saved(&self, ptr: usize, pack: bool) -> Result<Option<AllocId>> {
        let Some(e) = self.recording_engine(ptr)? else {
            return Ok(None);
        };
        let kind = if pack {
            SavedKind::Pack
        } else {
            SavedKind::Unpack
        };
        Ok(e.record_saved(DevicePtr(ptr as u64), kind)?)
    }

    /// Records a restore link: the allocation starting at `ptr` is the copy back of the
    /// offloaded allocation `from` (the id [`Core::record_saved`] returned for its
    /// pack, on the same device). False when nothing was recorded: `from` negative or
    /// too large, `ptr` 0 or not a live default-pool allocation, not recording, or a
    /// link the trace would refuse ([`Engine::record_restore`]).
    pub fn record_restore(&self, ptr: usize, from: i64) -> Result<bool> {
        let Ok(from) = u32::try_from(from) else {
            return Ok(false);
        };
        let Some(e) = self.recording_engine(ptr)? else {
            return Ok(false);
        };
        Ok(e.record_restore(DevicePtr(ptr as u64), AllocId(from))?)
    }

    /// The offload schedule of the plan `device` serves (empty when none).
    pub fn offload_schedule(&self, device: i32) -> Result<Vec<ffi::OffloadItem>> {
        Ok(lock(&self.slot(device)?.offload)
            .iter()
            .map(|o| ffi::OffloadItem {
                pack: o.pack,
                unpack: o.unpack,
                prefetch_after_unpack: o.prefetch_after_unpack.map_or(-1, i64::from),
                bytes: o.bytes.get(),
            })
            .collect())
    }

    /// Where plan serving stands.
    pub fn plan_stage(&self) -> PlanStage {
        lock(&self.plan).stage.clone()
    }

    pub fn mark(&self, label: &str, begin: bool) -> Result<()> {
        if label.is_empty() {
            return Err(BridgeError::Settings(
                "a phase label must not be empty".into(),
            ));
        }
        let kind = if begin {
            MarkerKind::PhaseBegin
        } else {
            MarkerKind::PhaseEnd
        };
        for e in self.opened_engines() {
            e.mark(kind, Some(label))?;
        }
        Ok(())
    }

    pub fn mode(&self) -> String {
        // A plan given up mid-run (its pool hit the memory limit) serves no more.
        let abandoned = self.devices.get().and_then(|slots| {
            slots.iter().find_map(|s| {
                let why = s.default.get()?.plan_abandoned().ok()??;
                Some(format!("cuda:{}: plan given up: {why}", s.ordinal))
            })
        });
        if let (Mode::Plan | Mode::Auto, PlanStage::Serving(_), Some(why)) =
            (self.settings.mode, self.plan_stage(), &abandoned)
        {
            return match self.settings.mode {
                Mode::Plan => format!("online ({why})"),
                _ => format!("auto (online: {why})"),
            };
        }
        match (self.settings.mode, self.plan_stage()) {
            (Mode::Online, _) => "online".into(),
            (Mode::Trace, _) if self.trace_flushed.load(Ordering::Acquire) => {
                "trace (written)".into()
            }
            (Mode::Trace, _) => "trace".into(),
            (Mode::Plan, PlanStage::Fallback(why)) => format!("online (plan rejected: {why})"),
            (Mode::Plan, PlanStage::Serving(_)) => "plan".into(),
            (Mode::Plan, _) => "plan (waiting for its device)".into(),
            (Mode::Auto, PlanStage::Recording) => "auto (recording)".into(),
            (Mode::Auto, PlanStage::Planning) => "auto (planning)".into(),
            (Mode::Auto, PlanStage::Serving(_)) => "auto (plan)".into(),
            (Mode::Auto, PlanStage::Fallback(why)) => format!("auto (online: {why})"),
            (Mode::Auto, PlanStage::NotPlanning) => "auto".into(),
        }
    }

    /// Stops recording and writes every device's trace; returns the files written.
    pub fn flush_trace(&self) -> Result<Vec<String>> {
        if self.settings.mode != Mode::Trace {
            return Err(BridgeError::Settings(format!(
                "flush_trace: not recording a trace (mode is {})",
                self.mode()
            )));
        }
        let mut written = Vec::new();
        for slot in self.slots()? {
            let Some(e) = slot.default.get() else {
                continue;
            };
            let Some(trace) = e.take_trace()? else {
                continue;
            };
            let path = self
                .settings
                .trace_path_on(slot.ordinal, self.home())
                .ok_or_else(|| BridgeError::Settings("trace mode without a path".into()))?;
            write_trace_file(Path::new(&path), &trace)?;
            written.push(path.display().to_string());
        }
        self.trace_flushed.store(true, Ordering::Release);
        Ok(written)
    }

    /// The runtime's state as JSON (for `stweaver.stats()`).
    pub fn info_json(&self) -> Result<String> {
        let mut devices = Vec::new();
        if let Some(slots) = self.devices.get() {
            for slot in slots {
                let opened = slot.default.get().is_some();
                let s = if opened {
                    Some(self.device_stats_raw(slot)?)
                } else {
                    None
                };
                let tracing = match slot.default.get() {
                    Some(e) => e.is_tracing()?,
                    None => false,
                };
                let plan = match slot.default.get() {
                    Some(e) => e.plan_stats()?.map(|p| {
                        serde_json::json!({
                            "hits": p.hits,
                            "conflicts": p.conflicts,
                            "waits": p.waits,
                            "unplanned": p.unplanned,
                            "skipped": p.skipped,
                            "iterations": p.iterations,
                            "holes": p.holes,
                            "grown": p.grown,
                        })
                    }),
                    None => None,
                };
                let abandoned = match slot.default.get() {
                    Some(e) => e.plan_abandoned()?,
                    None => None,
                };
                devices.push(serde_json::json!({
                    "device": slot.ordinal,
                    "plan": plan,
                    "plan_abandoned": abandoned,
                    "opened": opened,
                    "private_pools": read(&slot.private).len(),
                    "memory_fraction": *lock(&slot.fraction),
                    "budget": self.settings.budget.map(|b| b.to_string()),
                    // The device-wide limit (budget and memory fraction, the smaller) and
                    // what every pool of the device maps now; null before the device opens.
                    "limit_bytes": slot.mem.get().map(|_| slot.budget.limit()),
                    "mapped_bytes": slot.budget.mapped(),
                    "tracing": tracing,
                    // Auto mode under a budget: the offload the plan carries, or why none.
                    "offload": lock(&slot.offload_outcome).as_ref().map(OffloadOutcome::json),
                    "allocated_bytes": s.map_or(0, |s| s.allocated_bytes[0].current),
                    "reserved_bytes": s.map_or(0, |s| s.reserved_bytes[0].current),
                    "reserved_small_bytes": s.map_or(0, |s| s.reserved_bytes[1].current),
                    "pool_mapped_bytes": match slot.default.get() {
                        Some(e) => e.plan_pool()?.map_or(0, |(_, len)| len.get()),
                        None => 0,
                    },
                    "peak_allocated_bytes": s.map_or(0, |s| s.allocated_bytes[0].peak),
                    "peak_reserved_bytes": s.map_or(0, |s| s.reserved_bytes[0].peak),
                    "num_device_alloc": s.map_or(0, |s| s.num_device_alloc),
                    "num_device_free": s.map_or(0, |s| s.num_device_free),
                    "num_ooms": s.map_or(0, |s| s.num_ooms),
                }));
            }
        }
        let v = serde_json::json!({
            "mode": self.mode(),
            "initialized": self.devices.get().is_some(),
            "iterations": self.iterations.load(Ordering::Acquire),
            "trace_path": self.settings.trace_path.as_ref().map(|p| p.display().to_string()),
            "plan_path": self.settings.plan_path.as_ref().map(|p| p.display().to_string()),
            "notes": *lock(&self.notes),
            "rank": self.settings.rank.map(|r| serde_json::json!({
                "rank": r.rank,
                "local_rank": r.local_rank,
                "world_size": r.world_size,
            })),
            "home_device": self.home(),
            "plan_file": lock(&self.plan).source.as_ref().map(|s| match s {
                PlanSource::Shared(p) => serde_json::json!({"path": p.display().to_string(), "shared": true}),
                other => serde_json::json!({"path": other.path().display().to_string(), "shared": false}),
            }),
            "devices": devices,
        });
        Ok(v.to_string())
    }
}
