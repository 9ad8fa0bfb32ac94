//! stweaver-torch: the cxx bridge between the C++ `CUDAAllocator` subclass (`cpp/`) and
//! the Rust engine.
//!
//! - [`ffi`] — the bridge itself (`#[cxx::bridge]`, generated header
//!   `stweaver-torch/src/ffi.rs.h`) and [`ffi::Runtime`], the object C++ holds. Every
//!   entry point runs under [`error::guard`]: no panic crosses the FFI.
//! - [`runtime`] — [`runtime::Core`]: one engine per (device, pool), device stats,
//!   private pools for CUDA graphs, trace mode, history for PyTorch's memory tools.
//! - [`tracked`] — the per-engine device wrapper that maps reservations to engines and
//!   reports mapping changes.
//!
//! Built as a `staticlib` (linked into the torch extension) and an `rlib` (tests). It
//! includes no torch header: torch types are converted in `cpp/`.

pub mod budget;
pub mod dist;
pub mod error;
pub mod ffi;
pub mod runtime;
pub mod tracked;

pub use error::{BridgeError, guard};
pub use ffi::Runtime;
pub use runtime::{Core, DeviceFactory, Mode, Settings};

/// C++ holds the runtime across threads.
const _: () = {
    const fn assert_sync_send<T: Sync + Send>() {}
    assert_sync_send::<Runtime>();
};
