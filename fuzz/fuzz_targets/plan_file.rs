//! Arbitrary bytes into `plan_from_bytes` (envelope, FlatBuffers verifier, decoding
//! and the plan verifier): it must return, never panic; whatever it accepts must be a
//! plan the verifier accepts, and it must survive a write/read round trip unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stweaver_core::plan_file::{plan_from_bytes, plan_to_bytes};
use stweaver_core::verify::verify_plan;

fuzz_target!(|data: &[u8]| {
    let Ok(plan) = plan_from_bytes(data) else {
        return;
    };
    verify_plan(&plan).expect("an accepted plan verifies");
    let bytes = plan_to_bytes(&plan).expect("an accepted plan can be written");
    let back = plan_from_bytes(&bytes).expect("a written plan reads back");
    assert_eq!(back, plan);
});
