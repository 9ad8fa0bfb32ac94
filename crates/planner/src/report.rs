//! `stweaver compare`: one trace, several allocators, one table.
//!
//! Rows, in order:
//! 1. **lower bound**: the peak of live requested bytes ([`Trace::lower_bound`]); no
//!    allocator can reserve less.
//! 2. **PyTorch native**: a replay ([`crate::replay`]) with the recorded settings (or the
//!    ones given), `expandable_segments` off.
//! 3. **PyTorch expandable segments**: the same settings with `expandable_segments:True`.
//! 4. **stweaver** rows, each produced by a [`StweaverRow`] source: the engine replayed
//!    in auto mode, the runtime's default (`stweaver compare`'s only stweaver row unless
//!    asked for more), in online and in plan mode
//!    ([`crate::engine_replay::EngineReplayRow`]), and the offline plan of the whole
//!    trace ([`crate::offline::OfflinePlanRow`]). A source that is not available adds no
//!    row rather than a made-up one.
//!
//! A row's outcome (auto mode: switched to its plan at which iteration, or stayed online
//! and why) is printed under the table and is the `outcome` key of its JSON row.
//!
//! Columns: peak reserved, peak allocated, utilization (allocated / reserved), bytes
//! wasted (reserved − lower bound) and bytes saved against the native row.
//!
//! Cost: two replays, O(events · log blocks) each, plus whatever the stweaver sources
//! cost (see theirs).

use std::fmt::Write as _;
use std::time::Instant;

use stweaver_core::{Bytes, DeviceId, Trace};

use crate::replay::{AllocatorConfig, ReplayError, ReplayOptions, ReplayStats, replay};

/// What a row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowKind {
    LowerBound,
    PytorchNative,
    PytorchExpandable,
    /// stweaver's offline plan of the whole trace.
    StweaverOfflinePlan,
    /// stweaver's engine replayed over the trace in auto mode, the runtime's default
    /// (record, plan, switch or stay online).
    StweaverAuto,
    /// stweaver's engine replayed over the trace in online mode.
    StweaverOnline,
    /// stweaver's engine replayed over the trace in plan mode (a plan of the first
    /// iterations, loaded before the first request).
    StweaverPlanMode,
}

impl RowKind {
    /// Stable identifier (JSON).
    pub fn id(self) -> &'static str {
        match self {
            RowKind::LowerBound => "lower_bound",
            RowKind::PytorchNative => "pytorch_native",
            RowKind::PytorchExpandable => "pytorch_expandable",
            RowKind::StweaverOfflinePlan => "stweaver_offline_plan",
            RowKind::StweaverAuto => "stweaver_auto",
            RowKind::StweaverOnline => "stweaver_online",
            RowKind::StweaverPlanMode => "stweaver_plan_mode",
        }
    }
}

/// One allocator's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct CompareRow {
    pub kind: RowKind,
    /// What the table prints.
    pub label: String,
    pub peak_reserved: Bytes,
    pub peak_allocated: Bytes,
    /// How the row was obtained (config string, solver stage, ...).
    pub detail: String,
    /// What the mode decided over the run, if it decides anything (auto mode: switched
    /// to its plan at iteration k, or stayed online and why); printed under the table.
    pub outcome: Option<String>,
    /// Wall-clock seconds spent computing the row.
    pub seconds: f64,
}

/// A source of a stweaver row (the offline plan, later the engine).
pub trait StweaverRow {
    /// The row for `trace`, or `Ok(None)` when this source does not apply.
    fn row(&self, trace: &Trace) -> Result<Option<CompareRow>, ReportError>;
}

/// Why a comparison failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("replaying PyTorch ({config}): {source}")]
    Replay {
        config: String,
        #[source]
        source: ReplayError,
    },
    #[error("{row}: {problem}")]
    Row { row: &'static str, problem: String },
}

/// The comparison of one trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// Where the trace came from (file name, "bundled ...").
    pub source: String,
    pub device: DeviceId,
    pub allocations: usize,
    pub events: usize,
    pub lower_bound: Bytes,
    pub rows: Vec<CompareRow>,
    /// The native and expandable replays in full (for other reports and pictures).
    pub native: ReplayStats,
    pub expandable: ReplayStats,
}

/// Builds the comparison. `base` is the PyTorch configuration of the native row (its
/// `expandable_segments` is forced off there and on in the expandable row).
pub fn compare(
    source: &str,
    trace: &Trace,
    base: &AllocatorConfig,
    replay_options: &ReplayOptions,
    stweaver: &[&dyn StweaverRow],
) -> Result<Comparison, ReportError> {
    let t0 = Instant::now();
    let lb = trace.lower_bound().bytes;
    let mut rows = vec![CompareRow {
        kind: RowKind::LowerBound,
        label: "lower bound (peak live bytes)".into(),
        peak_reserved: lb,
        peak_allocated: lb,
        detail: "peak of live requested bytes".into(),
        outcome: None,
        seconds: t0.elapsed().as_secs_f64(),
    }];
    let run = |cfg: &AllocatorConfig| {
        let t0 = Instant::now();
        replay(trace, cfg, replay_options)
            .map(|r| (r.stats, t0.elapsed().as_secs_f64()))
            .map_err(|source| ReportError::Replay {
                config: cfg.label(),
                source,
            })
    };
    let native_cfg = AllocatorConfig {
        expandable_segments: false,
        ..base.clone()
    };
    let (native, seconds) = run(&native_cfg)?;
    rows.push(CompareRow {
        kind: RowKind::PytorchNative,
        label: "PyTorch native".into(),
        peak_reserved: native.peak_reserved,
        peak_allocated: native.peak_allocated,
        detail: format!(
            "replay of PyTorch 2.11's caching allocator, {}",
            native_cfg.label()
        ),
        outcome: None,
        seconds,
    });
    let exp_cfg = AllocatorConfig {
        expandable_segments: true,
        ..base.clone()
    };
    let (expandable, seconds) = run(&exp_cfg)?;
    rows.push(CompareRow {
        kind: RowKind::PytorchExpandable,
        label: "PyTorch expandable segments".into(),
        peak_reserved: expandable.peak_reserved,
        peak_allocated: expandable.peak_allocated,
        detail: format!(
            "replay of PyTorch 2.11's caching allocator, {}",
            exp_cfg.label()
        ),
        outcome: None,
        seconds,
    });
    for s in stweaver {
        let t0 = Instant::now();
        if let Some(mut row) = s.row(trace)? {
            row.seconds = t0.elapsed().as_secs_f64();
            rows.push(row);
        }
    }
    Ok(Comparison {
        source: source.to_string(),
        device: trace.device,
        allocations: trace.allocations.len(),
        events: trace.events.len(),
        lower_bound: lb,
        rows,
        native,
        expandable,
    })
}

impl Comparison {
    fn native_reserved(&self) -> Option<Bytes> {
        self.rows
            .iter()
            .find(|r| r.kind == RowKind::PytorchNative)
            .map(|r| r.peak_reserved)
    }

    /// `peak_allocated / peak_reserved` of a row.
    pub fn utilization(row: &CompareRow) -> f64 {
        row.peak_allocated.ratio(row.peak_reserved)
    }

    /// Reserved bytes above the lower bound.
    pub fn wasted(&self, row: &CompareRow) -> Bytes {
        Bytes(
            row.peak_reserved
                .get()
                .saturating_sub(self.lower_bound.get()),
        )
    }

    /// Reserved bytes saved against the native row (negative: more than native).
    pub fn saved_vs_native(&self, row: &CompareRow) -> Option<i128> {
        self.native_reserved()
            .map(|n| i128::from(n.get()) - i128::from(row.peak_reserved.get()))
    }

    /// The table, for a terminal.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} ({}): {} allocations, {} events",
            self.source, self.device, self.allocations, self.events
        );
        let header = [
            "",
            "peak reserved",
            "peak allocated",
            "utilization",
            "wasted (res. - LB)",
            "saved vs native",
        ];
        let mut cells: Vec<[String; 6]> = Vec::new();
        let native = self.native_reserved();
        for r in &self.rows {
            let wasted = self.wasted(r);
            let saved = match (self.saved_vs_native(r), native) {
                (_, None) => "-".to_string(),
                (Some(0), _) if r.kind == RowKind::PytorchNative => "-".to_string(),
                (Some(s), Some(n)) => format!(
                    "{}{} ({:+.1} %)",
                    if s < 0 { "-" } else { "" },
                    Bytes(s.unsigned_abs() as u64).human(),
                    100.0 * s as f64 / n.get() as f64
                ),
                (None, _) => "-".to_string(),
            };
            cells.push([
                r.label.clone(),
                r.peak_reserved.human(),
                r.peak_allocated.human(),
                format!("{:.2} %", 100.0 * Self::utilization(r)),
                format!(
                    "{} ({:.1} %)",
                    wasted.human(),
                    100.0 * wasted.ratio(r.peak_reserved).max(0.0)
                ),
                saved,
            ]);
        }
        let mut width = [0usize; 6];
        for row in std::iter::once(header.map(String::from)).chain(cells.iter().cloned()) {
            for (w, c) in width.iter_mut().zip(row.iter()) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |out: &mut String, row: &[String; 6]| {
            let _ = write!(out, "{:<w$}", row[0], w = width[0]);
            for (c, w) in row.iter().zip(width.iter()).skip(1) {
                let _ = write!(out, "  {c:>w$}");
            }
            out.push('\n');
        };
        line(&mut out, &header.map(String::from));
        for row in &cells {
            line(&mut out, row);
        }
        for r in &self.rows {
            if let Some(o) = &r.outcome {
                let _ = writeln!(out, "{}: {o}", r.label);
            }
        }
        out.push('\n');
        for r in &self.rows {
            let _ = writeln!(out, "  {}: {} ({:.3} s)", r.label, r.detail, r.seconds);
        }
        out
    }

    /// Whether each row's peak reserved fits a device memory budget, in row order.
    pub fn fits(&self, budget: Bytes) -> Vec<(RowKind, bool)> {
        self.rows
            .iter()
            .map(|r| (r.kind, r.peak_reserved <= budget))
            .collect()
    }

    /// The same, as JSON (bytes as integers).
    pub fn to_json(&self) -> serde_json::Value {
        let rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|r| {
                let saved = self.saved_vs_native(r);
                serde_json::json!({
                    "kind": r.kind.id(),
                    "label": r.label,
                    "detail": r.detail,
                    "outcome": r.outcome,
                    "seconds": r.seconds,
                    "peak_reserved": r.peak_reserved.get(),
                    "peak_allocated": r.peak_allocated.get(),
                    "utilization": Self::utilization(r),
                    "wasted": self.wasted(r).get(),
                    "saved_vs_native": saved.map(|s| s as i64),
                    "saved_vs_native_fraction": saved.zip(self.native_reserved())
                        .map(|(s, n)| s as f64 / n.get() as f64),
                })
            })
            .collect();
        serde_json::json!({
            "source": self.source,
            "device": self.device.0,
            "allocations": self.allocations,
            "events": self.events,
            "lower_bound": self.lower_bound.get(),
            "rows": rows,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stweaver_core::testkit::TraceBuilder;

    const M: u64 = 1 << 20;

    fn trace() -> Trace {
        // 5 MiB and 30 MiB live together, then 30 MiB freed and a 12 MiB request.
        let mut b = TraceBuilder::new();
        b.alloc(5 * M);
        let big = b.alloc(30 * M);
        b.free_completed(big);
        b.alloc(12 * M);
        b.build()
    }

    struct Fixed(Bytes);
    impl StweaverRow for Fixed {
        fn row(&self, _: &Trace) -> Result<Option<CompareRow>, ReportError> {
            Ok(Some(CompareRow {
                kind: RowKind::StweaverOfflinePlan,
                label: "fixed".into(),
                peak_reserved: self.0,
                peak_allocated: Bytes(35 * M),
                detail: "test".into(),
                outcome: None,
                seconds: 0.0,
            }))
        }
    }
    struct Absent;
    impl StweaverRow for Absent {
        fn row(&self, _: &Trace) -> Result<Option<CompareRow>, ReportError> {
            Ok(None)
        }
    }

    #[test]
    fn rows_and_derived_columns() {
        let t = trace();
        let fixed = Fixed(Bytes(60 * M));
        let c = compare(
            "hand-made",
            &t,
            &AllocatorConfig::default(),
            &ReplayOptions::default(),
            &[&fixed, &Absent],
        )
        .unwrap();
        let kinds: Vec<RowKind> = c.rows.iter().map(|r| r.kind).collect();
        assert_eq!(
            kinds,
            [
                RowKind::LowerBound,
                RowKind::PytorchNative,
                RowKind::PytorchExpandable,
                RowKind::StweaverOfflinePlan
            ]
        );
        assert_eq!(c.lower_bound, Bytes(35 * M));
        // Native: 20 MiB segment (5 MiB + 15 free) + 30 MiB segment; 12 MiB reuses the 30.
        assert_eq!(c.rows[1].peak_reserved, Bytes(50 * M));
        // Expandable: 5 MiB -> one 20 MiB page, 30 MiB -> the 15 MiB free tail + one page.
        assert_eq!(c.rows[2].peak_reserved, Bytes(40 * M));
        assert_eq!(c.wasted(&c.rows[1]), Bytes(15 * M));
        assert_eq!(c.saved_vs_native(&c.rows[2]), Some(i128::from(10 * M)));
        assert_eq!(c.saved_vs_native(&c.rows[3]), Some(-i128::from(10 * M)));
        let table = c.to_table();
        assert!(table.contains("PyTorch native"), "{table}");
        assert!(table.contains("-10.00 MiB (-20.0 %)"), "{table}");
        assert!(table.contains("10.00 MiB (+20.0 %)"), "{table}");
        let j = c.to_json();
        assert_eq!(j["rows"][1]["peak_reserved"], 50 * M);
        let fits = c.fits(Bytes(45 * M));
        assert_eq!(fits[1], (RowKind::PytorchNative, false));
        assert_eq!(fits[2], (RowKind::PytorchExpandable, true));
        assert_eq!(j["rows"][2]["saved_vs_native"], 10 * M);
        assert_eq!(j["rows"][3]["saved_vs_native"], -(10 * M as i64));
        assert_eq!(j["rows"][0]["kind"], "lower_bound");
    }
}
