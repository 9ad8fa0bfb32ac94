//! stweaver-planner: everything that runs offline, on a laptop, without a GPU.
//!
//! Snapshot import, iteration detection, classification, the offline solver,
//! replay models of PyTorch's caching allocator, reports and pictures. The
//! `stweaver` binary (`src/bin/stweaver`) is a thin CLI over this library.
//! This crate links neither CUDA nor torch.

pub mod auto;
pub mod class_planning;
pub mod classify;
pub mod engine_replay;
pub mod input;
pub mod iteration;
pub mod iteration_classes;
pub mod offline;
pub mod offload;
pub mod planning;
pub mod replay;
pub mod report;
pub mod snapshot;
pub mod solver;
pub mod summary;
pub mod unoffload;
pub mod viz;
