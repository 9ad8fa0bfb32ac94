//! Host time spent inside the allocator's `malloc` and `free` (opt-in,
//! `STWEAVER_TIME_CALLS=1`): where a training step's host time goes when it runs slower
//! under stweaver than under PyTorch's allocator.
//!
//! Each timed call reads the monotonic clock twice (`Instant::now`, a vDSO read) and adds
//! the difference and one call to relaxed atomic counters; off, a call pays one test of a
//! plain `bool` fixed at install. The counters are cumulative; a reader takes differences
//! ([`Core::call_times`](super::Core::call_times) before and after a phase).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::ffi::bridge as ffi;

/// Cumulative host time in the allocator's calls; see the module doc.
#[derive(Debug, Default)]
pub(super) struct CallTimes {
    on: bool,
    malloc_ns: AtomicU64,
    malloc_calls: AtomicU64,
    free_ns: AtomicU64,
    free_calls: AtomicU64,
}

/// One call's clock, started by [`CallTimes::start`] (`None`: timing is off).
pub(super) type Started = Option<Instant>;

impl CallTimes {
    pub(super) fn new(on: bool) -> CallTimes {
        CallTimes {
            on,
            ..CallTimes::default()
        }
    }

    #[inline]
    pub(super) fn start(&self) -> Started {
        self.on.then(Instant::now)
    }

    #[inline]
    pub(super) fn malloc_done(&self, t: Started) {
        if let Some(t) = t {
            add(&self.malloc_ns, &self.malloc_calls, t);
        }
    }

    #[inline]
    pub(super) fn free_done(&self, t: Started) {
        if let Some(t) = t {
            add(&self.free_ns, &self.free_calls, t);
        }
    }

    pub(super) fn snapshot(&self) -> ffi::CallTimes {
        ffi::CallTimes {
            on: self.on,
            malloc_ns: self.malloc_ns.load(Ordering::Relaxed),
            malloc_calls: self.malloc_calls.load(Ordering::Relaxed),
            free_ns: self.free_ns.load(Ordering::Relaxed),
            free_calls: self.free_calls.load(Ordering::Relaxed),
        }
    }
}

fn add(ns: &AtomicU64, calls: &AtomicU64, t: Instant) {
    let d = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
    ns.fetch_add(d, Ordering::Relaxed);
    calls.fetch_add(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_counts_nothing_and_on_counts_every_call() {
        let off = CallTimes::new(false);
        off.malloc_done(off.start());
        off.free_done(off.start());
        assert_eq!(off.snapshot(), ffi::CallTimes::default());

        let on = CallTimes::new(true);
        for _ in 0..3 {
            let t = on.start();
            std::thread::sleep(std::time::Duration::from_micros(50));
            on.malloc_done(t);
        }
        on.free_done(on.start());
        let s = on.snapshot();
        assert!(s.on);
        assert_eq!((s.malloc_calls, s.free_calls), (3, 1));
        assert!(s.malloc_ns >= 150_000, "three sleeps of 50 us: {s:?}");
    }
}
