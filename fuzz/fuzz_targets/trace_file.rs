//! Arbitrary bytes into `trace_from_bytes`: it must return (never panic, never read
//! out of bounds, never allocate far beyond the input), and whatever it accepts must
//! be a valid trace that survives a write/read round trip unchanged, digest included.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stweaver_core::trace_file::{trace_digest, trace_from_bytes, trace_to_bytes};

fuzz_target!(|data: &[u8]| {
    let Ok(trace) = trace_from_bytes(data) else {
        return;
    };
    trace.validate().expect("an accepted trace is valid");
    let bytes = trace_to_bytes(&trace).expect("an accepted trace can be written");
    let back = trace_from_bytes(&bytes).expect("a written trace reads back");
    assert_eq!(back, trace);
    assert_eq!(trace_digest(&back), trace_digest(&trace));
});
