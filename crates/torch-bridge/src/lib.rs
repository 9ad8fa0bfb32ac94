//! stweaver-torch: the cxx bridge between the C++ `CUDAAllocator` subclass and the
//! Rust engine.
//!
//! Not implemented yet (issue "PyTorch integration"): it will be a `staticlib` whose
//! every entry point catches panics and returns errors. It exists now so the
//! workspace has its final shape and dependency direction.
