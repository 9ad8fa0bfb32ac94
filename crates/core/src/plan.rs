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
//! # Offload under a memory budget
//!
//! A plan made for a device memory budget ([`Plan::budget`]) may move saved
//! activations to pinned host memory between forward and backward
//! ([`Plan::offload`], steady iteration only). Each [`OffloadEntry`] splits one
//! tensor's allocation in two requests of the iteration section: the *out* request
//! (the tensor as made in forward; at its `SavedPack` the runtime starts an async copy
//! to host on a side stream and drops the device reference, so the free is requested
//! at the pack and completes when the copy is done) and the *back* request (the copy
//! back, allocated when the prefetch is triggered and freed where the original tensor
//! was). Pack and unpack are counted per steady iteration, from 0, in the order the
//! run makes them ([`Plan::saved_packs`], [`Plan::saved_unpacks`] per iteration).
//!
//! # Iteration classes
//!
//! A loop whose iterations are not all alike (a few sequence-length buckets: issue #18)
//! has one section per *iteration class*: [`Plan::iteration`] is class 0 and
//! [`Plan::extra_classes`] the others, each with its own requests and length on its own
//! clock. Any class may follow any other, in any order, so a plan with extra classes
//! keeps every iteration request of every class within its iteration (`end <= len`:
//! nothing crosses a boundary, where the next class's requests could sit), and the
//! classes share the whole pool: iterations never overlap in time. Such a plan has no
//! offload schedule. On the unrolled timeline the prologue is followed by any sequence
//! of classes; the plan is valid when the prologue followed by each class repeated is.
//!
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

/// One saved activation moved to pinned host memory in every steady iteration (module
/// docs, offload).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OffloadEntry {
    /// Ordinal of the tensor's `SavedPack` within the steady iteration (0-based).
    pub pack: u32,
    /// Ordinal of the tensor's `SavedUnpack` within the steady iteration.
    pub unpack: u32,
    /// The copy back starts right after the `SavedUnpack` of this ordinal (an earlier
    /// unpack of the same iteration); `None`: right after the last `SavedPack` of the
    /// iteration that precedes this tensor's unpack (the end of forward), the earliest
    /// point of backward, used when no unpack leaves the copy enough time (a stall).
    pub prefetch_after_unpack: Option<u32>,
    /// The tensor's size (the out and back requests' size).
    pub bytes: Bytes,
    /// Index in [`Plan::iteration`] of the original (device) request.
    pub out_request: u32,
    /// Index in [`Plan::iteration`] of the copy-back request.
    pub back_request: u32,
}

/// One more iteration class of a plan (module docs, iteration classes): its requests,
/// in order, on its own clock of `len` ticks, every one freed by `len`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ClassSection {
    /// The class's requests, in the order the run makes them.
    pub requests: Vec<PlannedRequest>,
    /// Length of one iteration of the class in plan-clock ticks.
    pub len: u64,
}

/// What the planner saw but left to dynamic serving (token-dependent shapes and the
/// like). For reports; the engine serves these online.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DynamicSummary {
    /// Number of requests not planned.
    pub requests: u64,
    /// Their peak of live bytes, without the copies of the recording's last iteration
    /// that the iteration section serves at run time (irregular only for their lifetime:
    /// the planner's `planning::dynamic_summary`).
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
    /// The other iteration classes, [`Plan::iteration`] being class 0 (module docs,
    /// iteration classes); empty for a loop of one class.
    pub extra_classes: Vec<ClassSection>,
    /// What was left to dynamic serving.
    pub dynamic: DynamicSummary,
    /// The device memory budget the plan was made for (`pool_size <= budget`), if any.
    pub budget: Option<Bytes>,
    /// Saved activations moved to host memory in every steady iteration (module docs).
    pub offload: Vec<OffloadEntry>,
    /// `SavedPack` events per steady iteration (0 unless the plan offloads).
    pub saved_packs: u32,
    /// `SavedUnpack` events per steady iteration (0 unless the plan offloads).
    pub saved_unpacks: u32,
}

impl Plan {
    /// Number of iteration classes: 0 without an iteration section, else 1 plus the
    /// extra classes.
    pub fn class_count(&self) -> usize {
        if self.iteration.is_empty() {
            0
        } else {
            1 + self.extra_classes.len()
        }
    }

    /// Every class's requests, class 0 first, then the extra classes in order.
    pub fn class_requests(&self) -> impl Iterator<Item = &PlannedRequest> + '_ {
        (0..self.class_count()).flat_map(|c| self.class(c).0)
    }

    /// Class `c`'s requests and length (class 0: [`Plan::iteration`]).
    pub fn class(&self, c: usize) -> (&[PlannedRequest], u64) {
        if c == 0 {
            (&self.iteration, self.iteration_len)
        } else {
            let x = &self.extra_classes[c - 1];
            (&x.requests, x.len)
        }
    }
}
