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
