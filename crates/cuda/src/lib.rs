//! stweaver-cuda: the CUDA `DeviceMemory` for the online engine.
//!
//! Not implemented yet (issue "PyTorch integration"): this crate will hold the cudarc
//! driver-API backend (virtual-address reservations, granule mappings, events). It
//! exists now so the workspace has its final shape and dependency direction.
