//! The solver's input and output: [`Instance`], [`Buffer`], [`Solution`].
//!
//! An instance is a list of buffers, each with a size, an alignment and a half-open
//! lifetime `[lower, upper)` on an abstract clock. With `period: Some(L)` the clock is
//! circular: the instance is one iteration of a loop that repeats forever, a buffer's
//! lifetime is taken modulo `L` (so it may cross the iteration boundary, `upper > L`),
//! and two buffers conflict when their lifetimes overlap modulo `L`.
//!
//! [`Instance::validate`] checks the rules once, O(n).

use stweaver_core::{Bytes, Offset};

/// One buffer to place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Buffer {
    /// First instant the buffer is live.
    pub lower: u64,
    /// First instant it is no longer live (exclusive). `upper > lower`; with a period
    /// `L`, also `upper - lower <= L`.
    pub upper: u64,
    /// Bytes it needs. A zero-size buffer conflicts with nothing and gets offset 0.
    pub size: Bytes,
    /// Its offset must be a multiple of this (a power of two; 1 = unaligned).
    pub align: Bytes,
}

impl Buffer {
    /// An unaligned buffer live over `[lower, upper)`.
    pub fn new(lower: u64, upper: u64, size: Bytes) -> Buffer {
        Buffer {
            lower,
            upper,
            size,
            align: Bytes(1),
        }
    }

    /// Same buffer, with an alignment.
    pub fn with_align(self, align: Bytes) -> Buffer {
        Buffer { align, ..self }
    }
}

/// A Dynamic Storage Allocation instance.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Instance {
    pub buffers: Vec<Buffer>,
    /// `Some(L)`: the clock is circular with period `L` (steady-state iteration).
    pub period: Option<u64>,
}

/// An assignment of offsets, one per buffer of the instance (same order), and the
/// resulting pool size `peak = max(offset + size)` (0 for an empty instance).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Solution {
    pub offsets: Vec<Offset>,
    pub peak: Bytes,
}

/// Why an instance cannot be solved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InstanceError {
    #[error("buffer {index}: lifetime [{lower}, {upper}) is empty (upper must exceed lower)")]
    EmptyLifetime {
        index: usize,
        lower: u64,
        upper: u64,
    },
    #[error("buffer {index}: alignment {align} is not a power of two")]
    BadAlign { index: usize, align: u64 },
    #[error("the period must be positive")]
    ZeroPeriod,
    #[error("buffer {index}: lifetime [{lower}, {upper}) is longer than the period {period}")]
    LongerThanPeriod {
        index: usize,
        lower: u64,
        upper: u64,
        period: u64,
    },
    #[error("the instance has {0} buffers; at most 2^31 are supported")]
    TooManyBuffers(usize),
    #[error("the sizes (rounded up to their alignments) add up to more than 2^63 bytes")]
    TooLarge,
}

/// minimalloc's example (its `input.12.csv`): five 4-byte buffers over `[0, 21)`
/// whose best packing peaks at 12 bytes. For the solver's unit tests.
#[cfg(test)]
pub(crate) fn minimalloc_example() -> Instance {
    Instance::new(vec![
        Buffer::new(0, 3, Bytes(4)),
        Buffer::new(3, 9, Bytes(4)),
        Buffer::new(0, 9, Bytes(4)),
        Buffer::new(9, 21, Bytes(4)),
        Buffer::new(0, 21, Bytes(4)),
    ])
}

impl Instance {
    /// A linear-time instance.
    pub fn new(buffers: Vec<Buffer>) -> Instance {
        Instance {
            buffers,
            period: None,
        }
    }

    /// Number of buffers.
    pub fn len(&self) -> usize {
        self.buffers.len()
    }

    /// True when there are no buffers.
    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    /// Checks every rule stated on [`Buffer`] and [`Instance`]: non-empty lifetimes,
    /// power-of-two alignments, lifetimes no longer than the period, and a total size
    /// that leaves room for any packing in 63 bits (so no offset arithmetic overflows).
    pub fn validate(&self) -> Result<(), InstanceError> {
        if self.buffers.len() > (1usize << 31) {
            return Err(InstanceError::TooManyBuffers(self.buffers.len()));
        }
        if self.period == Some(0) {
            return Err(InstanceError::ZeroPeriod);
        }
        let mut total: u64 = 0;
        for (index, b) in self.buffers.iter().enumerate() {
            if b.upper <= b.lower {
                return Err(InstanceError::EmptyLifetime {
                    index,
                    lower: b.lower,
                    upper: b.upper,
                });
            }
            if !b.align.0.is_power_of_two() {
                return Err(InstanceError::BadAlign {
                    index,
                    align: b.align.0,
                });
            }
            if let Some(period) = self.period
                && b.upper - b.lower > period
            {
                return Err(InstanceError::LongerThanPeriod {
                    index,
                    lower: b.lower,
                    upper: b.upper,
                    period,
                });
            }
            // Worst case every buffer is padded by its alignment.
            let padded = b
                .size
                .0
                .checked_add(b.align.0)
                .ok_or(InstanceError::TooLarge)?;
            total = total.checked_add(padded).ok_or(InstanceError::TooLarge)?;
            if total > (1u64 << 63) {
                return Err(InstanceError::TooLarge);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_rejects_each_rule() {
        let ok = Buffer::new(0, 2, Bytes(4));
        assert!(Instance::new(vec![ok]).validate().is_ok());
        let empty = Instance::new(vec![ok, Buffer::new(3, 3, Bytes(1))]);
        assert_eq!(
            empty.validate(),
            Err(InstanceError::EmptyLifetime {
                index: 1,
                lower: 3,
                upper: 3
            })
        );
        let align = Instance::new(vec![ok.with_align(Bytes(3))]);
        assert!(matches!(
            align.validate(),
            Err(InstanceError::BadAlign { index: 0, align: 3 })
        ));
        let long = Instance {
            buffers: vec![Buffer::new(5, 16, Bytes(1))],
            period: Some(10),
        };
        assert!(matches!(
            long.validate(),
            Err(InstanceError::LongerThanPeriod { index: 0, .. })
        ));
        let zero = Instance {
            buffers: vec![],
            period: Some(0),
        };
        assert_eq!(zero.validate(), Err(InstanceError::ZeroPeriod));
        let huge = Instance::new(vec![
            Buffer::new(0, 1, Bytes(1 << 62)),
            Buffer::new(0, 1, Bytes(1 << 62)),
            Buffer::new(0, 1, Bytes(1 << 62)),
        ]);
        assert_eq!(huge.validate(), Err(InstanceError::TooLarge));
    }

    #[test]
    fn exactly_one_period_is_allowed() {
        let inst = Instance {
            buffers: vec![Buffer::new(7, 17, Bytes(1))],
            period: Some(10),
        };
        assert!(inst.validate().is_ok());
    }
}
