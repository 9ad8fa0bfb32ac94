//! What the bridge's integration tests share: pools, a stream, and a runtime in online
//! mode over one host-memory device.
// Each test file uses part of it.
#![allow(dead_code)]

use std::sync::Arc;

use stweaver_core::engine::HostMemory;
use stweaver_core::units::Bytes;
use stweaver_torch::ffi::bridge::PoolId;
use stweaver_torch::tracked::BridgeDevice;
use stweaver_torch::{Core, Runtime, Settings};

pub const MIB: u64 = 1 << 20;
pub const S0: usize = 0x10;
pub const DEFAULT: PoolId = PoolId {
    first: 0,
    second: 0,
};
/// A CUDA graph's private pool.
pub const GRAPH: PoolId = PoolId {
    first: 1,
    second: 0,
};

/// A runtime in online mode over one host device of `cap_mib` MiB (2 MiB granules), and
/// the device (to fill, check and count what the engines did to it).
pub fn online_runtime(cap_mib: u64) -> (Runtime, Arc<HostMemory>) {
    let dev = Arc::new(HostMemory::new(Bytes(cap_mib * MIB), Bytes(2 * MIB)));
    let d = dev.clone();
    let factory = Box::new(move |_: i32| Ok(d.clone() as Arc<dyn BridgeDevice>));
    let rt = Runtime::with_core(Core::new(
        Settings::parse("online", "", "").unwrap(),
        factory,
    ));
    rt.init(1).unwrap();
    (rt, dev)
}
