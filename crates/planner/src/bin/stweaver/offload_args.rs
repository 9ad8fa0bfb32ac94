//! The offload schedule's options, shared by `stweaver plan` and `stweaver compare`
//! (`--budget` with saved activations to move).

use stweaver_core::Bytes;
use stweaver_planner::offload::{OffloadOptions, OutReuse};
use stweaver_planner::planning::PlanOptions;

/// `--timing`: the offload schedule's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClockArg {
    /// Forward `--forward-share` of the iteration, backward the rest, each spread evenly.
    Phases,
    /// The whole iteration spread evenly over its requests.
    Spread,
    /// The trace's time stamps as they are.
    Trace,
}

/// Flattened into each command that plans under a budget.
#[derive(Debug, Clone, clap::Args)]
pub struct OffloadArgs {
    /// Host link bandwidth per direction for the offload schedule, GB/s.
    #[arg(long, value_name = "G", default_value_t = stweaver_planner::offload::DEFAULT_LINK_GBPS)]
    pub link_gbps: f64,
    /// When an offloaded tensor's device memory may be reused: `after-copy` (once its
    /// copy to host is done on the schedule's clock; compute waits only where the plan
    /// says so) or `at-pack` (right away: compute waits on the device for each copy).
    #[arg(long, value_name = "WHEN", default_value = "after-copy")]
    pub reuse_offloaded: OutReuse,
    /// The offload schedule's clock. The host runs ahead of the device, so a trace's time
    /// stamps are not the device's: `phases` (the default) gives forward (up to the first
    /// unpack) `--forward-share` of the steady iteration's duration and the rest to
    /// backward, each spread evenly over its requests; `spread` spreads the whole
    /// iteration evenly; `trace` takes the time stamps as they are (a trace recorded with
    /// the host in step with the device).
    #[arg(long, value_name = "CLOCK", value_enum, default_value_t = ClockArg::Phases)]
    pub timing: ClockArg,
    /// Forward's share of an iteration's device time (`--timing phases`).
    #[arg(long, value_name = "F", default_value_t = stweaver_planner::offload::DEFAULT_FORWARD_SHARE)]
    pub forward_share: f64,
    /// One iteration's device time, ms, for the offload schedule's clock (e.g. the step
    /// time of a run without offload). Default: the fastest iteration of the trace.
    #[arg(long, value_name = "MS")]
    pub iteration_ms: Option<f64>,
    /// Share of the budget left free beside the plan's pool, for what a run holds outside
    /// it.
    #[arg(long, value_name = "F", default_value_t = stweaver_planner::offload::DEFAULT_MARGIN)]
    pub margin: f64,
    /// Saved tensors smaller than this many bytes are never offloaded (each costs the host
    /// a pack and an unpack whatever its size).
    #[arg(long, value_name = "BYTES", default_value_t = stweaver_planner::offload::DEFAULT_MIN_TENSOR_BYTES)]
    pub offload_min_bytes: u64,
    /// Host cost of one offloaded tensor, µs of link time, that the selection weighs
    /// beside its bytes (0: bytes alone).
    #[arg(long, value_name = "US", default_value_t = stweaver_planner::offload::DEFAULT_PER_TENSOR_US)]
    pub per_tensor_us: f64,
}

impl OffloadArgs {
    /// The planner's options for `budget`.
    pub fn options(&self, budget: Bytes, plan: PlanOptions) -> OffloadOptions {
        let mut o = OffloadOptions::new(budget);
        o.link_gbps = self.link_gbps;
        o.reuse = self.reuse_offloaded;
        o.host_times = self.timing == ClockArg::Trace;
        o.forward_share = (self.timing == ClockArg::Phases).then_some(self.forward_share);
        o.iteration_us = self.iteration_ms.map(|ms| ms * 1e3);
        o.margin = self.margin;
        o.min_tensor_bytes = Bytes(self.offload_min_bytes);
        o.per_tensor_us = self.per_tensor_us;
        o.plan = plan;
        o
    }
}
