//! Times the trace and plan file formats on synthetic inputs of realistic shape.
//!
//! `cargo run --release -p stweaver-core --example file_format_timing [ALLOCS]`
//! (default 1 000 000 allocations). Trace: ALLOCS allocations of 37 sizes, each freed
//! (requested, then completed) 8 allocations later, an iteration marker every 10 000;
//! plan: 0.9·ALLOCS never-freed prologue requests and 0.1·ALLOCS iteration requests
//! reusing 8 slots. Prints wall times of write (encode, write, fsync, rename), read
//! (map, envelope, FlatBuffers verifier, decode, then `Trace::validate` or the plan
//! verifier), the in-memory encode/decode, the trace digest and the plan verifier alone.

use std::time::Instant;

use stweaver_core::plan_file::{plan_from_bytes, plan_to_bytes, read_plan_file, write_plan_file};
use stweaver_core::trace_file::{
    read_trace_file, trace_digest, trace_from_bytes, trace_to_bytes, write_trace_file,
};
use stweaver_core::verify::verify_plan;
use stweaver_core::{
    AllocId, Allocation, Bytes, DeviceId, Event, EventKind, MarkerKind, NEVER_FREED, Offset, Plan,
    PlannedRequest, StreamId, Trace,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u32 = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 1_000_000,
    };
    let dir = tempfile::tempdir()?;

    let mut t = Trace {
        device: DeviceId(0),
        labels: vec!["iteration".into()],
        ..Trace::default()
    };
    for i in 0..n {
        t.allocations.push(Allocation {
            size: Bytes(512 + u64::from(i % 37) * 4096),
            stream: StreamId(0),
            addr: 0x7f00_0000_0000 + u64::from(i) * 512,
            preexisting: false,
        });
    }
    for i in 0..n {
        let time_us = u64::from(i);
        if i % 10_000 == 0 {
            let kind = EventKind::Marker {
                kind: MarkerKind::IterationBegin,
                label: Some(0),
            };
            t.events.push(Event { kind, time_us });
        }
        t.events.push(Event {
            kind: EventKind::Alloc(AllocId(i)),
            time_us,
        });
        if i >= 8 {
            for kind in [
                EventKind::FreeRequested(AllocId(i - 8)),
                EventKind::FreeCompleted(AllocId(i - 8)),
            ] {
                t.events.push(Event { kind, time_us });
            }
        }
    }
    let path = dir.path().join("timing.stwt");
    let s = Instant::now();
    write_trace_file(&path, &t)?;
    let write = s.elapsed();
    let s = Instant::now();
    let back = read_trace_file(&path)?;
    let read = s.elapsed();
    assert_eq!(back, t);
    let s = Instant::now();
    let bytes = trace_to_bytes(&t)?;
    let encode = s.elapsed();
    let s = Instant::now();
    trace_from_bytes(&bytes)?;
    let decode = s.elapsed();
    let s = Instant::now();
    let digest = trace_digest(&t);
    let digest_time = s.elapsed();
    println!(
        "trace: {} allocations, {} events, {} bytes\n  write {write:.0?}  read {read:.0?}  \
         encode {encode:.0?}  decode {decode:.0?}  digest {digest_time:.0?} ({digest:#018x})",
        t.allocations.len(),
        t.events.len(),
        bytes.len(),
    );

    let mut plan = Plan {
        device: DeviceId(0),
        alignment: Bytes(512),
        trace_digest: digest,
        ..Plan::default()
    };
    let (n_pro, n_it) = (u64::from(n) / 10 * 9, u64::from(n) / 10);
    let mut top = 0;
    for i in 0..n_pro {
        plan.prologue.push(PlannedRequest {
            size: Bytes(512),
            stream: StreamId(0),
            offset: Offset(top),
            start: i,
            end: NEVER_FREED,
        });
        top += 512;
    }
    plan.prologue_len = n_pro.max(1);
    for i in 0..n_it {
        plan.iteration.push(PlannedRequest {
            size: Bytes(4096),
            stream: StreamId(0),
            offset: Offset(top + (i % 8) * 4096),
            start: 2 * i,
            end: 2 * i + 15,
        });
    }
    plan.iteration_len = (2 * n_it).max(16);
    plan.pool_size = Bytes(top + 8 * 4096);
    let path = dir.path().join("timing.stwp");
    let s = Instant::now();
    write_plan_file(&path, &plan)?;
    let write = s.elapsed();
    let s = Instant::now();
    let back = read_plan_file(&path)?;
    let read = s.elapsed();
    assert_eq!(back, plan);
    let s = Instant::now();
    let bytes = plan_to_bytes(&plan)?;
    let encode = s.elapsed();
    let s = Instant::now();
    plan_from_bytes(&bytes)?;
    let decode = s.elapsed();
    let s = Instant::now();
    verify_plan(&plan)?;
    let verify = s.elapsed();
    println!(
        "plan: {} prologue + {} iteration requests, {} bytes\n  write {write:.0?}  read {read:.0?}  \
         encode {encode:.0?}  decode {decode:.0?}  (verifier alone {verify:.0?}, in each of the four)",
        plan.prologue.len(),
        plan.iteration.len(),
        bytes.len(),
    );
    Ok(())
}
