//! The bridge's error type and the panic guard every FFI entry point runs under.

use std::panic::{AssertUnwindSafe, catch_unwind};

use stweaver_core::engine::EngineError;
use stweaver_core::trace_file::TraceFileError;
use stweaver_cuda::CudaError;

use crate::ffi::bridge::PoolId;

/// Everything a bridge call can fail with. C++ sees the `Display` text.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("cannot open CUDA device {device}: {error}")]
    OpenDevice { device: i32, error: String },
    #[error("{0}")]
    Cuda(#[from] CudaError),
    #[error("the allocator is used before CUDA's lazy init called init()")]
    NotInitialised,
    #[error("init() called again with {got} devices (first call: {first})")]
    Reinit { first: i32, got: i32 },
    #[error("device {device} does not exist ({count} CUDA devices)")]
    BadDevice { device: i32, count: usize },
    #[error("{0:#x} is not a pointer stweaver handed out (unknown or already freed)")]
    UnknownPointer(usize),
    #[error("memory pool ({}, {}) does not exist on device {device}", pool.first, pool.second)]
    UnknownPool { device: i32, pool: PoolId },
    #[error("memory pool ({}, {}) on device {device} was released more often than it was used", pool.first, pool.second)]
    PoolOverReleased { device: i32, pool: PoolId },
    #[error(
        "endAllocateToPool: no allocation to pool ({}, {}) is in progress on device {device}",
        pool.first, pool.second
    )]
    NotAllocatingToPool { device: i32, pool: PoolId },
    #[error("the default pool (0, 0) is not a private pool")]
    DefaultPoolIsNotPrivate,
    #[error("invalid memory fraction {0}: it must be in [0, 1]")]
    BadFraction(f64),
    #[error("invalid settings: {0}")]
    Settings(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("device {device}: {error}; undoing the other pools of the device failed too: {undo}")]
    PauseUndo {
        device: i32,
        error: String,
        undo: String,
    },
    #[error(transparent)]
    TraceFile(#[from] TraceFileError),
    #[error(
        "internal error: {what} panicked: {message} (the allocator state is unchanged or poisoned; please report)"
    )]
    Panic { what: &'static str, message: String },
}

pub type Result<T, E = BridgeError> = std::result::Result<T, E>;

/// Runs `f`, turning a panic into [`BridgeError::Panic`]: no panic may unwind into C++
/// (cxx would abort the process).
pub fn guard<T>(what: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let message = if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "non-string panic payload".to_string()
            };
            Err(BridgeError::Panic { what, message })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_turns_panics_into_errors() {
        let r: Result<()> = guard("probe", || panic!("boom {}", 7));
        let e = r.unwrap_err();
        assert!(matches!(e, BridgeError::Panic { what: "probe", .. }));
        assert!(e.to_string().contains("boom 7"), "{e}");
        assert_eq!(guard("ok", || Ok(3)).unwrap(), 3);
    }
}
