//! [`EngineError`]: everything the engine can fail with (bad requests, out of memory
//! with what was asked and what is held, a rejected plan or checkpoint, device errors).

use super::arena::SlabFull;
use super::device::{DeviceError, DevicePtr};
use super::pause::PauseError;
use crate::units::{Bytes, StreamId};

/// Everything the engine can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("allocation of 0 bytes")]
    ZeroSize,
    #[error("allocation of {0} cannot be rounded to a multiple of 512 B")]
    TooLarge(Bytes),
    #[error(
        "out of memory: tried to allocate {rounded} ({requested} requested) on {stream}; \
         {allocated} allocated, {reserved} reserved ({free_reserved} of it free), \
         memory limit {limit}, {device_free} free on the device"
    )]
    OutOfMemory {
        requested: Bytes,
        rounded: Bytes,
        stream: StreamId,
        allocated: Bytes,
        reserved: Bytes,
        free_reserved: Bytes,
        limit: Bytes,
        device_free: Bytes,
    },
    #[error("{0} is not the start of a live allocation of this engine")]
    UnknownPointer(DevicePtr),
    #[error("{0} was already freed (waiting for other streams)")]
    AlreadyFreed(DevicePtr),
    #[error("{ptr} is paused (tag {tag}): resume it first")]
    Paused { ptr: DevicePtr, tag: u32 },
    #[error("invalid memory limit {0}: a fraction must be in (0, 1]")]
    InvalidLimit(f64),
    #[error("the device's granularity {0} is not a power of two of at least 512 B")]
    BadGranularity(Bytes),
    #[error("trace overflowed at {0} events (a trace holds fewer than 2^32)")]
    TraceOverflow(usize),
    #[error("the engine holds 2^32 blocks, its index limit")]
    TooManyBlocks,
    #[error("plan rejected: {0}")]
    PlanRejected(String),
    #[error("checkpoint cannot be restored: {0}")]
    CheckpointMismatch(String),
    #[error("engine state poisoned by an earlier panic")]
    Poisoned,
    #[error("engine state inconsistent: {0}")]
    Inconsistent(String),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Pause(#[from] PauseError),
}

impl From<SlabFull> for EngineError {
    fn from(_: SlabFull) -> Self {
        EngineError::TooManyBlocks
    }
}
