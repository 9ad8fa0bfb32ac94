//! The offline plan of a whole trace: what stweaver would reserve if it knew the entire
//! run in advance. It is the stweaver row of `stweaver compare` and the right panel of
//! `stweaver viz` until the online engine can be replayed over a trace.
//!
//! Every allocation becomes one solver [`Buffer`]: its requested size, aligned to 512 B
//! (the alignment PyTorch's blocks give kernels), live over its lifetime on the trace's
//! event clock shifted by one, `[alloc + 1, free + 1)`, so that preexisting allocations
//! start at 0 and an allocation never freed lives to `events + 1`. The free is the
//! completed one when the trace has it (the memory is busy until then), as in
//! [`Trace::lower_bound`], whose value the instance's lower bound therefore equals.
//! [`crate::solver::solve`] places the buffers (its result is checked independently
//! before it is returned); stweaver maps its pool in 2 MiB granules, so the reserved
//! figure is the solution's peak rounded up to [`GRANULE`].
//!
//! Cost: O(events + allocations) to build the instance, then the solver's cost, bounded
//! by [`SolveOptions::time_budget`].

use stweaver_core::{Bytes, Offset, Trace};

use crate::report::{CompareRow, ReportError, RowKind, StweaverRow};
use crate::solver::{Buffer, Instance, SolveError, SolveOptions, solve};

/// The granule stweaver maps device memory in.
pub const GRANULE: Bytes = Bytes(2 << 20);
/// Offset alignment of every planned buffer.
pub const ALIGN: Bytes = Bytes(512);

/// A plan of a whole trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracePlan {
    /// Offset of every allocation (indexed by `AllocId`).
    pub offsets: Vec<Offset>,
    /// The highest byte used: `max(offset + size)`.
    pub peak: Bytes,
    /// `peak` rounded up to [`GRANULE`]: what stweaver would map.
    pub reserved: Bytes,
    /// Buffer lifetimes on the shifted clock (`[lower, upper)`), indexed by `AllocId`.
    pub buffers: Vec<Buffer>,
}

/// The solver instance of `trace` (see the module documentation). O(events + allocations).
pub fn instance(trace: &Trace) -> Instance {
    let end = trace.events.len() as u64 + 1;
    let buffers = trace
        .lifetimes()
        .iter()
        .zip(&trace.allocations)
        .map(|(l, a)| {
            let lower = l.start.map_or(0, |e| u64::from(e.0) + 1);
            let upper = l.end.map_or(end, |e| u64::from(e.0) + 1);
            Buffer::new(lower, upper, a.size).with_align(ALIGN)
        })
        .collect();
    Instance::new(buffers)
}

/// Plans `trace` with the offline solver.
pub fn plan_whole_trace(trace: &Trace, options: &SolveOptions) -> Result<TracePlan, SolveError> {
    let inst = instance(trace);
    let sol = solve(&inst, options)?;
    let reserved = sol.peak.align_up(GRANULE).unwrap_or(sol.peak);
    Ok(TracePlan {
        offsets: sol.offsets,
        peak: sol.peak,
        reserved,
        buffers: inst.buffers,
    })
}

/// The "stweaver (offline plan)" row of `stweaver compare`.
#[derive(Debug, Clone, Default)]
pub struct OfflinePlanRow {
    pub options: SolveOptions,
}

impl StweaverRow for OfflinePlanRow {
    fn row(&self, trace: &Trace) -> Result<Option<CompareRow>, ReportError> {
        let plan = plan_whole_trace(trace, &self.options).map_err(|e| ReportError::Row {
            row: "stweaver (offline plan)",
            problem: e.to_string(),
        })?;
        Ok(Some(CompareRow {
            kind: RowKind::StweaverOfflinePlan,
            label: "stweaver (offline plan)".into(),
            peak_reserved: plan.reserved,
            // stweaver hands out the requested bytes (offsets aligned, sizes not rounded).
            peak_allocated: trace.lower_bound().bytes,
            detail: format!(
                "offline solver over the whole trace, peak {} rounded up to the {} granule{}",
                plan.peak,
                GRANULE,
                match self.options.time_budget {
                    Some(b) => format!(", time budget {:.0} s", b.as_secs_f64()),
                    None => String::new(),
                }
            ),
            outcome: None,
            seconds: 0.0,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stweaver_core::testkit::TraceBuilder;

    fn t() -> Trace {
        let mut b = TraceBuilder::new();
        let pre = b.preexisting(1000);
        b.alloc(3000);
        b.free(pre);
        b.alloc(5000);
        b.build()
    }

    #[test]
    fn lifetimes_follow_the_trace_clock() {
        let inst = instance(&t());
        let spans: Vec<(u64, u64, u64)> = inst
            .buffers
            .iter()
            .map(|b| (b.lower, b.upper, b.size.get()))
            .collect();
        // Preexisting from 0 to its completed free (event 2); never freed to events + 1.
        assert_eq!(spans, [(0, 3, 1000), (1, 5, 3000), (4, 5, 5000)]);
        assert!(inst.buffers.iter().all(|b| b.align == ALIGN));
    }

    #[test]
    fn plan_is_valid_and_rounded_to_the_granule() {
        let trace = t();
        let plan = plan_whole_trace(&trace, &SolveOptions::default()).unwrap();
        // 1000 and 3000 overlap, then 3000 and 5000: at least 8000 bytes (+ alignment).
        assert!(plan.peak >= trace.lower_bound().bytes);
        assert_eq!(plan.reserved, GRANULE);
        let row = OfflinePlanRow::default().row(&trace).unwrap().unwrap();
        assert_eq!(row.kind, RowKind::StweaverOfflinePlan);
        assert_eq!(row.peak_reserved, GRANULE);
        assert_eq!(row.peak_allocated, Bytes(8000));
        // Live buffers never overlap.
        for i in 0..3 {
            for j in 0..i {
                let (a, b) = (&plan.buffers[i], &plan.buffers[j]);
                if a.lower < b.upper && b.lower < a.upper {
                    let (oa, ob) = (plan.offsets[i].get(), plan.offsets[j].get());
                    assert!(oa + a.size.get() <= ob || ob + b.size.get() <= oa);
                }
            }
        }
    }
}
