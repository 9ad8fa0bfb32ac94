//! `EngineConfig::release_before_new_peak`: before an online arena grows past the peak of
//! reserved memory, the free whole granules of its holes go back to the device first, so
//! the peak rises only by what the holes could not cover. Checked on a host-memory device
//! with sentinel bytes in every live block (`testkit::audit::SentinelEngine`), the engine's own invariants
//! and exact stats.

use stweaver_core::engine::EngineConfig;
use stweaver_core::testkit::audit::SentinelEngine as Checked;
use stweaver_core::units::{Bytes, StreamId};

const G: u64 = 1 << 20;
const S: StreamId = StreamId(0);

fn run(release: bool) -> (Checked, [u64; 3]) {
    let mut r = Checked::with_config(
        G,
        EngineConfig {
            arena_size: Some(Bytes(256 * G)),
            release_before_new_peak: release,
            ..EngineConfig::default()
        },
    );
    let a = r.alloc(4 * G, S);
    let b = r.alloc(4 * G, S);
    let c = r.alloc(G, S);
    r.free(a); // a 4-granule hole at the start; the peak is 9 granules
    let syncs = r.engine.stats().unwrap().num_sync_all_streams;
    let d = r.alloc(6 * G, S); // fits no hole: the arena grows
    r.engine.check_invariants().unwrap();
    let s = r.engine.stats().unwrap();
    let out = [
        s.reserved_bytes[0].peak as u64 / G,
        s.reserved_bytes[0].current as u64 / G,
        (s.num_sync_all_streams - syncs) as u64,
    ];
    // Live data survived the release, and everything frees cleanly.
    for p in [b, c, d] {
        r.free(p);
    }
    r.engine.check_invariants().unwrap();
    (r, out)
}

#[test]
fn growth_past_the_peak_gives_the_holes_back_first() {
    let (mut r, [peak, current, syncs]) = run(true);
    // 9 mapped, the 4-granule hole given back (5), then 6 more at the tail (11).
    assert_eq!((peak, current, syncs), (11, 11, 1));
    assert_eq!(r.host.counters().partial_unmaps, 0);
    // The released hole is mapped again when a request needs it, below the peak: no
    // further release.
    let e = r.alloc(4 * G, S);
    let s = r.engine.stats().unwrap();
    assert!(s.reserved_bytes[0].peak as u64 <= 11 * G);
    r.free(e);
    r.engine.empty_cache().unwrap();
    assert_eq!(r.engine.stats().unwrap().reserved_bytes[0].current, 0);
    r.engine.check_invariants().unwrap();
}

#[test]
fn without_the_option_the_arena_just_grows() {
    let (_r, [peak, current, syncs]) = run(false);
    assert_eq!((peak, current, syncs), (15, 15, 0));
}
