//! The load lower bound of an instance: the largest total size live at one instant.
//!
//! No packing can beat it (the buffers live at that instant must be stacked), and on
//! interval graphs there is no better clique bound. Circular lifetimes are taken modulo
//! the period, so a buffer crossing the boundary counts at both ends of the iteration.
//! A sweep over start/end events, ends before starts at equal instants (half-open
//! lifetimes): O(n log n). Total on any input: empty lifetimes count for nothing, a
//! lifetime longer than the period counts everywhere, sums saturate at `u64::MAX`.

use stweaver_core::Bytes;

use super::instance::Instance;

/// The load lower bound of `instance`.
pub fn lower_bound(instance: &Instance) -> Bytes {
    let mut events: Vec<(u64, bool, u64)> = Vec::with_capacity(2 * instance.buffers.len());
    let mut always: u128 = 0;
    for b in &instance.buffers {
        if b.upper <= b.lower || b.size.0 == 0 {
            continue;
        }
        match instance.period {
            None | Some(0) => {
                events.push((b.lower, true, b.size.0));
                events.push((b.upper, false, b.size.0));
            }
            Some(period) => {
                let len = b.upper - b.lower;
                if len >= period {
                    always += b.size.0 as u128;
                    continue;
                }
                let start = b.lower % period;
                let end = start + len;
                if end <= period {
                    events.push((start, true, b.size.0));
                    events.push((end, false, b.size.0));
                } else {
                    events.push((start, true, b.size.0));
                    events.push((period, false, b.size.0));
                    events.push((0, true, b.size.0));
                    events.push((end - period, false, b.size.0));
                }
            }
        }
    }
    events.sort_unstable_by_key(|&(t, is_start, _)| (t, is_start));
    let mut live: u128 = always;
    let mut best: u128 = always;
    for (_, is_start, size) in events {
        if is_start {
            live += size as u128;
            best = best.max(live);
        } else {
            live -= size as u128;
        }
    }
    Bytes(best.min(u64::MAX as u128) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::instance::{Buffer, minimalloc_example};

    #[test]
    fn linear_bound_is_the_peak_of_live_bytes() {
        let inst = minimalloc_example();
        assert_eq!(lower_bound(&inst), Bytes(12));
        assert_eq!(lower_bound(&Instance::default()), Bytes(0));
    }

    #[test]
    fn circular_bound_counts_wrapped_lifetimes() {
        // [8, 13) mod 10 is live over [8,10) and [0,3), where [1,2) also lives.
        let inst = Instance {
            buffers: vec![
                Buffer::new(8, 13, Bytes(4)),
                Buffer::new(1, 2, Bytes(3)),
                Buffer::new(4, 6, Bytes(5)),
            ],
            period: Some(10),
        };
        assert_eq!(lower_bound(&inst), Bytes(7));
        let linear = Instance {
            period: None,
            ..inst
        };
        assert_eq!(lower_bound(&linear), Bytes(5));
    }

    #[test]
    fn bad_input_does_not_panic() {
        let inst = Instance {
            buffers: vec![
                Buffer::new(5, 5, Bytes(4)),
                Buffer::new(0, 50, Bytes(u64::MAX)),
                Buffer::new(1, 2, Bytes(u64::MAX)),
            ],
            period: Some(10),
        };
        assert_eq!(lower_bound(&inst), Bytes(u64::MAX));
    }
}
