//! stweaver-core: the device-agnostic heart of stweaver.
//!
//! Vocabulary types ([`units`]), the recorded allocation history ([`trace`]), and
//! (as they land) the trace and plan file formats, the plan verifier and the online
//! engine. This crate links neither CUDA nor torch.

pub mod engine;
pub mod file_format;
pub mod plan;
pub mod plan_file;
pub mod trace;
pub mod trace_file;
pub mod units;
pub mod verify;

pub use plan::{DynamicSummary, NEVER_FREED, OffloadEntry, Plan, PlannedRequest};
pub use trace::{
    Allocation, Event, EventKind, Lifetime, LowerBound, MarkerKind, Restore, Trace, TraceError,
};
pub use units::{AllocId, Bytes, DeviceId, EventIdx, Offset, StreamId};
