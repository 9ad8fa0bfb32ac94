//! Generates the C++ side of the bridge (`target/cxxbridge/stweaver-torch/src/ffi.rs.h`)
//! and compiles its glue into this crate (bundled into the staticlib).
//!
//! The glue includes no torch header; C++17 matches torch 2.11's `cpp_extension` (newer
//! torch compiles the extension as C++20, which links against C++17 glue unchanged).
fn main() {
    cxx_build::bridge("src/ffi.rs")
        .std("c++17")
        .compile("stweaver_torch_bridge");
    println!("cargo:rerun-if-changed=src/ffi.rs");
}
