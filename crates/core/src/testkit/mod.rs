//! The shared test kit (cargo feature `testkit`; always on for this crate's own unit
//! tests): a [`TraceBuilder`] for hand-made traces and the [`audit`]s of the invariants
//! of `ARCHITECTURE.md`, so that tests, the planner's engine replay checks and fuzz
//! targets state them once.
//!
//! Not part of the stable API: it exists for tests (`[dev-dependencies] stweaver-core =
//! { ..., features = ["testkit"] }`).

pub mod audit;
mod trace;

pub use trace::TraceBuilder;

use crate::{Bytes, Offset, PlannedRequest, StreamId};

/// A planned request of `size` bytes at `offset` in the pool, live over plan ticks
/// `[start, end)`, on stream 0.
pub fn planned(size: u64, offset: u64, start: u64, end: u64) -> PlannedRequest {
    planned_on(size, offset, start, end, 0)
}

/// [`planned`] on `stream`.
pub fn planned_on(size: u64, offset: u64, start: u64, end: u64, stream: u64) -> PlannedRequest {
    PlannedRequest {
        size: Bytes(size),
        stream: StreamId(stream),
        offset: Offset(offset),
        start,
        end,
    }
}
