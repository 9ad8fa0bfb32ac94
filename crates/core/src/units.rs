//! Newtypes for the quantities every crate talks about.
//!
//! Sizes, offsets, stream handles, device ordinals and indices are distinct types so
//! that a byte count can never be passed where an offset or an event index is expected.
//! All are `Copy`, ordered and hashable, and print tersely (`1.50 GiB`, `+0x200`, `s7`,
//! `e42`, `a17`).

use std::fmt;

/// A number of bytes (a size, a peak, a lower bound).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bytes(pub u64);

impl Bytes {
    pub const ZERO: Bytes = Bytes(0);

    /// The raw count.
    #[inline]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Rounds up to a multiple of `align` (a power of two). `None` on overflow.
    #[inline]
    pub const fn align_up(self, align: Bytes) -> Option<Bytes> {
        debug_assert!(align.0.is_power_of_two());
        match self.0.checked_add(align.0 - 1) {
            Some(v) => Some(Bytes(v & !(align.0 - 1))),
            None => None,
        }
    }

    /// `self / other` as a float ratio (for reports).
    #[inline]
    pub fn ratio(self, other: Bytes) -> f64 {
        if other.0 == 0 {
            f64::NAN
        } else {
            self.0 as f64 / other.0 as f64
        }
    }

    /// Binary units with two decimals: `512 B`, `1.50 KiB`, `10.72 GiB`.
    pub fn human(self) -> String {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut v = self.0 as f64;
        let mut u = 0;
        while v >= 1024.0 && u + 1 < UNITS.len() {
            v /= 1024.0;
            u += 1;
        }
        if u == 0 {
            format!("{} B", self.0)
        } else {
            format!("{v:.2} {}", UNITS[u])
        }
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.human())
    }
}

impl std::ops::Add for Bytes {
    type Output = Bytes;
    #[inline]
    fn add(self, rhs: Bytes) -> Bytes {
        Bytes(self.0 + rhs.0)
    }
}

impl std::ops::AddAssign for Bytes {
    #[inline]
    fn add_assign(&mut self, rhs: Bytes) {
        self.0 += rhs.0;
    }
}

impl std::ops::Sub for Bytes {
    type Output = Bytes;
    #[inline]
    fn sub(self, rhs: Bytes) -> Bytes {
        Bytes(self.0 - rhs.0)
    }
}

impl std::ops::SubAssign for Bytes {
    #[inline]
    fn sub_assign(&mut self, rhs: Bytes) {
        self.0 -= rhs.0;
    }
}

impl std::iter::Sum for Bytes {
    fn sum<I: Iterator<Item = Bytes>>(iter: I) -> Bytes {
        Bytes(iter.map(|b| b.0).sum())
    }
}

/// A byte offset from the start of a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Offset(pub u64);

impl Offset {
    #[inline]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The end of a block of `size` bytes placed at this offset. `None` on overflow.
    #[inline]
    pub const fn end(self, size: Bytes) -> Option<Offset> {
        match self.0.checked_add(size.0) {
            Some(v) => Some(Offset(v)),
            None => None,
        }
    }
}

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "+{:#x}", self.0)
    }
}

/// A CUDA stream handle as PyTorch reports it (`cudaStream_t` as an integer;
/// 0 is the legacy default stream).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub u64);

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}

/// A CUDA device ordinal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId(pub i32);

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{}", self.0)
    }
}

/// Position of an event in a [`crate::trace::Trace`]'s event list; this is the
/// trace's clock. Lifetimes are half-open intervals of event indices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventIdx(pub u32);

impl EventIdx {
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for EventIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "e{}", self.0)
    }
}

/// Index of an allocation in a [`crate::trace::Trace`]'s allocation table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AllocId(pub u32);

impl AllocId {
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for AllocId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(Bytes(512).human(), "512 B");
        assert_eq!(Bytes(1536).human(), "1.50 KiB");
        assert_eq!(Bytes(11510874376).human(), "10.72 GiB");
    }

    #[test]
    fn align_up_rounds_and_detects_overflow() {
        assert_eq!(Bytes(1).align_up(Bytes(512)), Some(Bytes(512)));
        assert_eq!(Bytes(512).align_up(Bytes(512)), Some(Bytes(512)));
        assert_eq!(Bytes(u64::MAX).align_up(Bytes(512)), None);
    }
}
