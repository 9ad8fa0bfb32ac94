//! The memory budget of a process (`STWEAVER_BUDGET`, `stweaver.install(budget=...)`,
//! `torch.cuda.set_per_process_memory_fraction`).
//!
//! A budget is bytes (`16GiB`, `512MiB`, `17179869184`) or a fraction of the device's
//! memory (`0.8`). Each device's effective limit is the smaller of the budget and the
//! memory fraction PyTorch set ([`effective_limit`]); it is enforced device-wide, over
//! every engine of the device, by [`crate::tracked::DeviceBudget`].

use stweaver_core::units::Bytes;

use stweaver_planner::offload::parse_budget;

use crate::error::{BridgeError, Result};

/// A memory budget as the user gave it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// At most this many bytes on each device.
    Bytes(Bytes),
    /// At most this fraction of each device's total memory, in `(0, 1]`.
    Fraction(f64),
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Bytes(b) => write!(f, "{b}"),
            Budget::Fraction(x) => write!(f, "{x} of the device"),
        }
    }
}

impl Budget {
    /// Parses `16GiB`, `16G`, `512 MiB`, `1.5GB`, `17179869184` (bytes) or `0.8` (a
    /// fraction: a plain number no larger than 1). Sizes are the planner's
    /// ([`stweaver_planner::offload::parse_budget`], the CLI's `--budget`): binary units
    /// (`K`, `M`, `G`, `T` with or without `iB`) are powers of 1024; `KB`, `MB`, `GB`,
    /// `TB` are powers of 1000.
    pub fn parse(text: &str) -> Result<Budget> {
        let bad = |why: String| {
            Err(BridgeError::Settings(format!(
                "memory budget {text:?}: {why} (examples: 16GiB, 512MiB, 17179869184, 0.8)"
            )))
        };
        let t = text.trim();
        if let Ok(v) = t.parse::<f64>() {
            if !(v > 0.0 && v.is_finite()) {
                return bad("it must be positive".into());
            }
            if v <= 1.0 {
                return Ok(Budget::Fraction(v));
            }
            if t.contains('.') {
                return bad("a fraction must be in (0, 1]; bytes are a whole number".into());
            }
        }
        match parse_budget(t) {
            Ok(b) => Ok(Budget::Bytes(b)),
            Err(e) => bad(e.to_string()),
        }
    }

    /// The budget in bytes on a device of `total` bytes.
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            Budget::Bytes(b) => b.get(),
            Budget::Fraction(f) => ((f * total as f64) as u64).min(total),
        }
    }
}

/// The device-wide limit: the budget and PyTorch's memory fraction, whichever is
/// smaller, on a device of `total` bytes.
pub fn effective_limit(budget: Option<Budget>, fraction: f64, total: u64) -> u64 {
    let by_fraction = ((fraction.clamp(0.0, 1.0) * total as f64) as u64).min(total);
    budget.map_or(by_fraction, |b| b.bytes(total).min(by_fraction))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn sizes_fractions_and_bytes_parse() {
        assert_eq!(
            Budget::parse("16GiB").unwrap(),
            Budget::Bytes(Bytes(16 * GIB))
        );
        assert_eq!(
            Budget::parse(" 16 G ").unwrap(),
            Budget::Bytes(Bytes(16 * GIB))
        );
        assert_eq!(
            Budget::parse("512MiB").unwrap(),
            Budget::Bytes(Bytes(512 << 20))
        );
        assert_eq!(
            Budget::parse("1.5GB").unwrap(),
            Budget::Bytes(Bytes(1_500_000_000))
        );
        assert_eq!(
            Budget::parse("17179869184").unwrap(),
            Budget::Bytes(Bytes(16 * GIB))
        );
        assert_eq!(Budget::parse("0.8").unwrap(), Budget::Fraction(0.8));
        assert_eq!(Budget::parse("1").unwrap(), Budget::Fraction(1.0));
    }

    #[test]
    fn bad_budgets_say_what_is_wrong() {
        for (text, why) in [
            ("", "not a size"),
            ("lots", "not a size"),
            ("0", "positive"),
            ("-1GiB", "not a size"),
            ("16 parsecs", "not a size"),
            ("1.5", "fraction must be in (0, 1]"),
        ] {
            let e = Budget::parse(text).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("examples"), "{text:?}: {e}");
        }
    }

    #[test]
    fn the_smaller_of_budget_and_fraction_wins() {
        let total = 80 * GIB;
        assert_eq!(effective_limit(None, 1.0, total), total);
        assert_eq!(effective_limit(None, 0.5, total), 40 * GIB);
        let b = Some(Budget::Bytes(Bytes(16 * GIB)));
        assert_eq!(effective_limit(b, 1.0, total), 16 * GIB);
        assert_eq!(effective_limit(b, 0.1, total), 8 * GIB);
        assert_eq!(
            effective_limit(Some(Budget::Fraction(0.25)), 1.0, total),
            20 * GIB
        );
        // A budget above the device is the device.
        let huge = Some(Budget::Bytes(Bytes(1000 * GIB)));
        assert_eq!(effective_limit(huge, 1.0, total), total);
    }
}
