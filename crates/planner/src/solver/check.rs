//! The independent solution checker.
//!
//! Deliberately its own simple code path, sharing nothing with the solver's data
//! structures: every buffer becomes one or two time pieces (two when a circular
//! lifetime crosses the period boundary), the pieces' start and end events are swept
//! in time order (ends before starts at equal instants: lifetimes are half-open), and
//! the live address ranges are kept in an ordered map. A newly live range is compared
//! with its two neighbours in address order. The first insertion that overlaps a live
//! range always meets it as a neighbour (everything live before it was disjoint), so
//! any invalid solution is reported. Also checks the offset count, alignment, and that
//! `peak` is exactly `max(offset + size)`. O(n log n) time, O(n) memory.

use std::collections::BTreeMap;

use super::instance::{Instance, InstanceError, Solution};

/// At most this many errors are collected before the checker stops.
pub const MAX_REPORTED_ERRORS: usize = 64;

/// One way a solution breaks the rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SolutionError {
    #[error("the instance itself is invalid: {0}")]
    InvalidInstance(#[from] InstanceError),
    #[error("the solution has {got} offsets for {expected} buffers")]
    WrongLength { expected: usize, got: usize },
    #[error("buffer {index}: offset {offset} is not a multiple of its alignment {align}")]
    Misaligned {
        index: usize,
        offset: u64,
        align: u64,
    },
    #[error("buffer {index}: offset {offset} + size {size} overflows")]
    Overflow {
        index: usize,
        offset: u64,
        size: u64,
    },
    #[error("buffer {index}: it ends at {top}, above the claimed peak {peak}")]
    AbovePeak { index: usize, top: u64, peak: u64 },
    #[error("the claimed peak is {claimed} but the buffers reach only {actual}")]
    PeakMismatch { claimed: u64, actual: u64 },
    #[error(
        "buffers {first} and {second} are both live at time {time} and overlap in memory ([{first_offset}, {first_end}) vs [{second_offset}, {second_end}))"
    )]
    Overlap {
        first: usize,
        second: usize,
        time: u64,
        first_offset: u64,
        first_end: u64,
        second_offset: u64,
        second_end: u64,
    },
}

/// Checks `solution` against `instance`. `Ok(())` means: one offset per buffer, each a
/// multiple of its buffer's alignment, no two buffers live at the same instant
/// (modulo the period, if any) share a byte, and `peak` equals `max(offset + size)`.
pub fn check_solution(instance: &Instance, solution: &Solution) -> Result<(), Vec<SolutionError>> {
    instance.validate().map_err(|e| vec![e.into()])?;
    let n = instance.buffers.len();
    if solution.offsets.len() != n {
        return Err(vec![SolutionError::WrongLength {
            expected: n,
            got: solution.offsets.len(),
        }]);
    }
    let mut errors = Vec::new();
    let mut actual_peak = 0u64;
    let mut tops = Vec::with_capacity(n);
    for (index, (b, off)) in instance.buffers.iter().zip(&solution.offsets).enumerate() {
        let offset = off.0;
        if offset % b.align.0 != 0 {
            errors.push(SolutionError::Misaligned {
                index,
                offset,
                align: b.align.0,
            });
        }
        let Some(top) = offset.checked_add(b.size.0) else {
            errors.push(SolutionError::Overflow {
                index,
                offset,
                size: b.size.0,
            });
            tops.push(None);
            continue;
        };
        tops.push(Some(top));
        if b.size.0 > 0 {
            actual_peak = actual_peak.max(top);
            if top > solution.peak.0 {
                errors.push(SolutionError::AbovePeak {
                    index,
                    top,
                    peak: solution.peak.0,
                });
            }
        }
        if errors.len() >= MAX_REPORTED_ERRORS {
            return Err(errors);
        }
    }
    if actual_peak != solution.peak.0 && errors.is_empty() {
        errors.push(SolutionError::PeakMismatch {
            claimed: solution.peak.0,
            actual: actual_peak,
        });
    }

    // Time pieces: (time, is_start, buffer). Ends sort before starts at equal times.
    let mut events: Vec<(u64, bool, u32)> = Vec::with_capacity(2 * n + 16);
    for (index, b) in instance.buffers.iter().enumerate() {
        if b.size.0 == 0 || tops[index].is_none() {
            continue;
        }
        let i = index as u32;
        match instance.period {
            None => {
                events.push((b.lower, true, i));
                events.push((b.upper, false, i));
            }
            Some(period) => {
                let start = b.lower % period;
                let end = start + (b.upper - b.lower); // <= 2 * period, no overflow
                if end <= period {
                    events.push((start, true, i));
                    events.push((end, false, i));
                } else {
                    events.push((start, true, i));
                    events.push((period, false, i));
                    events.push((0, true, i));
                    events.push((end - period, false, i));
                }
            }
        }
    }
    events.sort_unstable();

    // Live ranges keyed by (offset, buffer) so equal offsets can coexist (and be caught).
    let mut live: BTreeMap<(u64, u32), u64> = BTreeMap::new();
    for &(time, is_start, i) in &events {
        let offset = solution.offsets[i as usize].0;
        if !is_start {
            live.remove(&(offset, i));
            continue;
        }
        let Some(top) = tops[i as usize] else {
            continue;
        };
        if let Some((&(p_off, p), &p_top)) = live.range(..(offset, i)).next_back()
            && p_top > offset
        {
            errors.push(overlap(p, p_off, p_top, i, offset, top, time));
        }
        if let Some((&(s_off, s), &s_top)) = live.range((offset, i)..).next()
            && s_off < top
        {
            errors.push(overlap(i, offset, top, s, s_off, s_top, time));
        }
        if errors.len() >= MAX_REPORTED_ERRORS {
            break;
        }
        live.insert((offset, i), top);
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

fn overlap(
    a: u32,
    a_off: u64,
    a_top: u64,
    b: u32,
    b_off: u64,
    b_top: u64,
    time: u64,
) -> SolutionError {
    SolutionError::Overlap {
        first: a as usize,
        second: b as usize,
        time,
        first_offset: a_off,
        first_end: a_top,
        second_offset: b_off,
        second_end: b_top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::instance::{Buffer, minimalloc_example};
    use stweaver_core::{Bytes, Offset};

    fn sol(offsets: &[u64], peak: u64) -> Solution {
        Solution {
            offsets: offsets.iter().map(|&o| Offset(o)).collect(),
            peak: Bytes(peak),
        }
    }

    #[test]
    fn accepts_a_valid_packing() {
        let inst = minimalloc_example();
        assert_eq!(check_solution(&inst, &sol(&[8, 8, 4, 4, 0], 12)), Ok(()));
    }

    #[test]
    fn half_open_lifetimes_may_touch() {
        let inst = Instance::new(vec![
            Buffer::new(0, 5, Bytes(8)),
            Buffer::new(5, 9, Bytes(8)),
        ]);
        assert_eq!(check_solution(&inst, &sol(&[0, 0], 8)), Ok(()));
    }

    #[test]
    fn finds_overlap_hidden_behind_a_nested_range() {
        // A = [0,10) covers C = [5,6) (an error) and B = [7,8): B's neighbour in address
        // order is C, not A; the first error must still be reported.
        let inst = Instance::new(vec![
            Buffer::new(0, 10, Bytes(10)),
            Buffer::new(1, 10, Bytes(1)),
            Buffer::new(2, 10, Bytes(1)),
        ]);
        let errs = check_solution(&inst, &sol(&[0, 5, 7], 10)).unwrap_err();
        assert!(
            errs.iter()
                .any(|e| matches!(e, SolutionError::Overlap { .. }))
        );
    }

    #[test]
    fn reports_each_kind_of_error() {
        let inst = Instance::new(vec![
            Buffer::new(0, 4, Bytes(4)).with_align(Bytes(4)),
            Buffer::new(2, 6, Bytes(4)),
        ]);
        let errs = check_solution(&inst, &sol(&[2, 4], 8)).unwrap_err();
        assert!(matches!(
            errs[0],
            SolutionError::Misaligned { index: 0, .. }
        ));
        assert!(
            errs.iter()
                .any(|e| matches!(e, SolutionError::Overlap { .. }))
        );
        let errs = check_solution(&inst, &sol(&[0, 4], 7)).unwrap_err();
        assert!(matches!(errs[0], SolutionError::AbovePeak { index: 1, .. }));
        let errs = check_solution(&inst, &sol(&[0, 4], 9)).unwrap_err();
        assert_eq!(
            errs,
            vec![SolutionError::PeakMismatch {
                claimed: 9,
                actual: 8
            }]
        );
        let errs = check_solution(&inst, &sol(&[0], 8)).unwrap_err();
        assert!(matches!(errs[0], SolutionError::WrongLength { .. }));
        let errs = check_solution(&inst, &sol(&[0, u64::MAX - 1], u64::MAX)).unwrap_err();
        assert!(matches!(errs[0], SolutionError::Overflow { index: 1, .. }));
    }

    #[test]
    fn circular_conflicts_wrap_around() {
        // Period 10: [8, 13) is live over [8,10) and [0,3); it conflicts with [1, 2).
        let inst = Instance {
            buffers: vec![Buffer::new(8, 13, Bytes(4)), Buffer::new(1, 2, Bytes(4))],
            period: Some(10),
        };
        assert!(check_solution(&inst, &sol(&[0, 0], 4)).is_err());
        assert_eq!(check_solution(&inst, &sol(&[0, 4], 8)), Ok(()));
        // [3, 8) does not meet [8, 13) modulo 10.
        let inst = Instance {
            buffers: vec![Buffer::new(8, 13, Bytes(4)), Buffer::new(3, 8, Bytes(4))],
            period: Some(10),
        };
        assert_eq!(check_solution(&inst, &sol(&[0, 0], 4)), Ok(()));
        // Lifetimes given in a later period are taken modulo the period.
        let inst = Instance {
            buffers: vec![Buffer::new(21, 22, Bytes(4)), Buffer::new(1, 2, Bytes(4))],
            period: Some(10),
        };
        assert!(check_solution(&inst, &sol(&[0, 0], 4)).is_err());
    }

    #[test]
    fn zero_size_buffers_conflict_with_nothing() {
        let inst = Instance::new(vec![
            Buffer::new(0, 4, Bytes(4)),
            Buffer::new(0, 4, Bytes(0)),
        ]);
        assert_eq!(check_solution(&inst, &sol(&[0, 2], 4)), Ok(()));
    }
}
