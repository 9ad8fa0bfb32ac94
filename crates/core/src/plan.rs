//! The plan: where every expected request goes in one pool.
//!
//! A plan has two sections, both sequences of [`PlannedRequest`]s in the order the
//! run is expected to make them:
//!
//! - the **prologue**: what happens once, from the moment serving starts until the
//!   steady state begins (model and optimizer-state creation, the first iteration);
//! - the **iteration**: the steady-state iteration, repeated forever after the prologue.
//!
//! Time is a section-local *plan clock*: each section counts its own events (allocs
//! and frees) from 0; the prologue lasts [`Plan::prologue_len`] ticks and each
//! iteration [`Plan::iteration_len`] ticks. A request lives over the half-open
//! interval `[start, end)` of its section's clock; `end` may run past the section's
//! length (a tensor that crosses into the next iteration: `end` counts on in the next
//! section's clock, i.e. `end = len + t`) and [`NEVER_FREED`] means it lives forever
//! (parameters, optimizer state).
//!
//! Laid out on one timeline, the prologue occupies `[0, P)` and iteration `k` occupies
//! `[P + k·L, P + (k+1)·L)`; a plan is valid when, on that unrolled timeline, no two
//! live requests overlap in `[offset, offset + size)` and everything fits in the pool.
//! That check is the verifier's job (`crate::verify`), not this module's: a plan is a
//! plain value.

use crate::units::{Bytes, DeviceId, Offset, StreamId};

/// `end` of a request that is never freed.
pub const NEVER_FREED: u64 = u64::MAX;

/// One expected request and where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlannedRequest {
    /// Requested bytes (as the caller asks; the slot may be larger after alignment).
    pub size: Bytes,
    /// Stream the request is expected on.
    pub stream: StreamId,
    /// Where it goes in the pool.
    pub offset: Offset,
    /// Alloc time, in the section's plan clock.
    pub start: u64,
    /// Free time, in the section's plan clock (may exceed the section length), or
    /// [`NEVER_FREED`].
    pub end: u64,
}

/// What the planner saw but left to dynamic serving (token-dependent shapes and the
/// like). For reports; the engine serves these online.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DynamicSummary {
    /// Number of requests not planned.
    pub requests: u64,
    /// Their peak of live bytes.
    pub peak_bytes: Bytes,
}

/// A complete plan for one device. Built by the planner, serialised by the plan file
/// format, checked by the verifier, served (never mutated) by the engine.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Device the plan was made for.
    pub device: DeviceId,
    /// Every offset and the pool size are multiples of this (a power of two).
    pub alignment: Bytes,
    /// Bytes the pool needs.
    pub pool_size: Bytes,
    /// Lower bound of the planned requests (peak of live requested bytes).
    pub lower_bound: Bytes,
    /// Digest of the trace the plan was made from (see the trace format), so a plan
    /// is not served against another workload by mistake.
    pub trace_digest: u64,
    /// Requests made once before the steady state.
    pub prologue: Vec<PlannedRequest>,
    /// Length of the prologue in plan-clock ticks.
    pub prologue_len: u64,
    /// The steady-state iteration.
    pub iteration: Vec<PlannedRequest>,
    /// Length of one iteration in plan-clock ticks (0 if there is no iteration section).
    pub iteration_len: u64,
    /// What was left to dynamic serving.
    pub dynamic: DynamicSummary,
}
