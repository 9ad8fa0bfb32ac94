//! `stweaver inspect FILE [--json] [--device N]`: what a snapshot or trace file holds.
//!
//! Per device: events by kind, allocations (preexisting, never freed), distinct sizes,
//! streams, the lower bound (peak of live requested bytes) and where it is reached, and
//! the iteration period; for snapshots also the allocator settings, the final segments
//! and the counts of entries that are not requests (segment events, annotations, ...).
//! `--json` prints the same as one JSON object. Loading shows a progress bar on stderr
//! when it takes over a second and stderr is a terminal.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use stweaver_core::Bytes;
use stweaver_planner::input::{LoadedInput, load_input_with_progress};
use stweaver_planner::iteration::PeriodSource;
use stweaver_planner::snapshot::{EntryCounts, LoadProgress, LoadStage, Snapshot};
use stweaver_planner::summary::{TraceSummary, summarize};

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// A PyTorch memory snapshot (`.pickle` or `.pickle.gz`) or a stweaver trace (`.stwt`).
    pub file: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Only this device.
    #[arg(long, value_name = "N")]
    pub device: Option<i32>,
}

pub fn run(args: InspectArgs) -> Result<()> {
    let input = load_with_progress_bar(&args.file)?;
    let report = Report::new(&args.file, &input, args.device)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

/// Loads `path`, drawing a progress bar once loading has taken a second (only when
/// stderr is a terminal).
fn load_with_progress_bar(path: &Path) -> Result<LoadedInput> {
    let interactive = std::io::stderr().is_terminal();
    let started = Instant::now();
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
    let mut shown = false;
    let mut on_progress = |p: LoadProgress| {
        if !interactive || started.elapsed() < Duration::from_secs(1) {
            return;
        }
        if !shown {
            shown = true;
            bar.set_draw_target(ProgressDrawTarget::stderr());
            if let Ok(style) =
                ProgressStyle::with_template("{msg:>12} [{bar:40}] {percent:>3}% ({elapsed})")
            {
                bar.set_style(style.progress_chars("=> "));
            }
        }
        bar.set_message(match p.stage {
            LoadStage::Decompress => "gunzip",
            LoadStage::Parse => "unpickle",
            LoadStage::Build => "build trace",
        });
        bar.set_length(p.total.max(1));
        bar.set_position(p.done);
    };
    let loaded = load_input_with_progress(path, &mut on_progress);
    bar.finish_and_clear();
    Ok(loaded?)
}

#[derive(Serialize)]
struct Report {
    file: String,
    format: &'static str,
    /// Snapshot only.
    #[serde(skip_serializing_if = "Option::is_none")]
    settings: Option<SettingsJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    segments: Option<SegmentsJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    annotations: Option<usize>,
    devices: Vec<DeviceJson>,
}

#[derive(Serialize)]
struct SettingsJson {
    pytorch_cuda_alloc_conf: String,
    expandable_segments: bool,
    /// `null`: unlimited.
    max_split_size: Option<u64>,
    /// Interval start in bytes → divisions, non-zero entries only.
    roundup_power2_divisions: Vec<(u64, u64)>,
    garbage_collection_threshold: f64,
}

#[derive(Serialize)]
struct SegmentsJson {
    count: usize,
    total_bytes: u64,
    expandable: usize,
}

#[derive(Serialize)]
struct DeviceJson {
    device: i32,
    events: EventsJson,
    allocations: AllocationsJson,
    distinct_sizes: usize,
    streams: Vec<StreamJson>,
    requested_bytes: u64,
    live_at_end_bytes: u64,
    lower_bound: LowerBoundJson,
    /// First and last event time (µs since the epoch).
    #[serde(skip_serializing_if = "Option::is_none")]
    time_span_us: Option<(u64, u64)>,
    period: Option<PeriodJson>,
    /// The iterations grouped by request signature; left out without iteration boundaries.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    iteration_classes: Vec<ClassJson>,
    /// Snapshot only: what the device's trace list held besides requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot_entries: Option<EntriesJson>,
}

#[derive(Serialize)]
struct ClassJson {
    /// How many iterations, and which (0: the first after the first boundary).
    count: usize,
    iterations: Vec<usize>,
    allocs_per_iteration: usize,
    peak_bytes: u64,
}

#[derive(Serialize)]
struct EventsJson {
    total: usize,
    alloc: usize,
    free_requested: usize,
    free_completed: usize,
    marker: usize,
    /// Autograd's saved tensors (stweaver trace mode); left out when 0.
    #[serde(skip_serializing_if = "is_zero")]
    saved_pack: usize,
    #[serde(skip_serializing_if = "is_zero")]
    saved_unpack: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[derive(Serialize)]
struct AllocationsJson {
    total: usize,
    preexisting: usize,
    never_freed: usize,
}

#[derive(Serialize)]
struct StreamJson {
    stream: u64,
    allocs: usize,
    bytes: u64,
}

#[derive(Serialize)]
struct LowerBoundJson {
    bytes: u64,
    human: String,
    event: Option<u32>,
    alloc_number: Option<usize>,
    time_us: Option<u64>,
}

#[derive(Serialize)]
struct PeriodJson {
    allocs_per_iteration: usize,
    requests_per_iteration: usize,
    events_per_iteration: Option<usize>,
    first_steady_alloc: usize,
    first_steady_event: u32,
    repetitions: usize,
    source: &'static str,
}

#[derive(Serialize)]
struct EntriesJson {
    total: u64,
    segment_alloc: u64,
    segment_free: u64,
    segment_map: u64,
    segment_unmap: u64,
    snapshot: u64,
    oom: u64,
    other: u64,
    annotations: u64,
}

impl Report {
    fn new(path: &Path, input: &LoadedInput, device: Option<i32>) -> Result<Report> {
        let snapshot: Option<&Snapshot> = match input {
            LoadedInput::Snapshot(s) => Some(s),
            LoadedInput::TraceFile(_) => None,
        };
        let traces: Vec<_> = input
            .traces()
            .iter()
            .filter(|t| device.is_none_or(|d| t.device.0 == d))
            .collect();
        if let Some(d) = device
            && traces.is_empty()
        {
            let have: Vec<String> = input
                .traces()
                .iter()
                .map(|t| t.device.0.to_string())
                .collect();
            bail!(
                "{}: device {d} has no allocation history (devices with one: {})",
                path.display(),
                if have.is_empty() {
                    "none".to_owned()
                } else {
                    have.join(", ")
                }
            );
        }
        let devices = traces
            .into_iter()
            .map(|t| {
                let entries = snapshot.and_then(|s| {
                    s.devices
                        .iter()
                        .find(|d| d.device == t.device)
                        .map(|d| entries_json(&d.counts))
                });
                device_json(&summarize(t), entries)
            })
            .collect();
        Ok(Report {
            file: path.display().to_string(),
            format: input.format().id(),
            settings: snapshot.map(|s| {
                let st = &s.settings;
                SettingsJson {
                    pytorch_cuda_alloc_conf: st.alloc_conf.clone(),
                    expandable_segments: st.expandable_segments,
                    max_split_size: st.max_split_size.map(Bytes::get),
                    roundup_power2_divisions: st
                        .roundup_power2_divisions
                        .iter()
                        .filter(|r| r.divisions != 0)
                        .map(|r| (r.interval_start.get(), r.divisions))
                        .collect(),
                    garbage_collection_threshold: st.garbage_collection_threshold,
                }
            }),
            segments: snapshot.map(|s| {
                let segs = s
                    .segments
                    .iter()
                    .filter(|g| device.is_none_or(|d| g.device.0 == d));
                let (mut count, mut total_bytes, mut expandable) = (0, 0, 0);
                for g in segs {
                    count += 1;
                    total_bytes += g.total_size.get();
                    expandable += usize::from(g.is_expandable);
                }
                SegmentsJson {
                    count,
                    total_bytes,
                    expandable,
                }
            }),
            annotations: snapshot.map(|s| s.annotations),
            devices,
        })
    }

    fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut o = String::new();
        let fmt_name = match self.format {
            "pytorch_snapshot" => "PyTorch memory snapshot",
            _ => "stweaver trace file",
        };
        let _ = writeln!(o, "{}: {fmt_name}", self.file);
        if let Some(s) = &self.settings {
            let split = s
                .max_split_size
                .map_or("unlimited".to_owned(), |b| Bytes(b).human());
            let roundup = if s.roundup_power2_divisions.is_empty() {
                "off".to_owned()
            } else {
                s.roundup_power2_divisions
                    .iter()
                    .map(|(start, d)| format!("{}:{d}", Bytes(*start).human()))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let _ = writeln!(
                o,
                "  allocator settings  PYTORCH_CUDA_ALLOC_CONF={:?} expandable_segments={} max_split_size={split} roundup_power2_divisions={roundup} garbage_collection_threshold={}",
                s.pytorch_cuda_alloc_conf, s.expandable_segments, s.garbage_collection_threshold
            );
        }
        if let Some(g) = &self.segments {
            let _ = writeln!(
                o,
                "  final segments      {} ({} reserved, {} expandable)",
                g.count,
                Bytes(g.total_bytes).human(),
                g.expandable
            );
        }
        if let Some(a) = self.annotations {
            let _ = writeln!(o, "  annotations         {a}");
        }
        for d in &self.devices {
            let _ = writeln!(o, "\ndevice cuda:{}", d.device);
            let e = &d.events;
            let _ = writeln!(
                o,
                "  events              {} (alloc {}, free_requested {}, free_completed {}, marker {})",
                e.total, e.alloc, e.free_requested, e.free_completed, e.marker
            );
            if e.saved_pack + e.saved_unpack > 0 {
                let _ = writeln!(
                    o,
                    "  saved tensors       {} packed, {} unpacked",
                    e.saved_pack, e.saved_unpack
                );
            }
            let a = &d.allocations;
            let _ = writeln!(
                o,
                "  allocations         {} (preexisting {}, never freed {}: {} live at the end)",
                a.total,
                a.preexisting,
                a.never_freed,
                Bytes(d.live_at_end_bytes).human()
            );
            let _ = writeln!(o, "  distinct sizes      {}", d.distinct_sizes);
            let streams: Vec<String> = d
                .streams
                .iter()
                .map(|s| {
                    format!(
                        "s{} ({} allocs, {})",
                        s.stream,
                        s.allocs,
                        Bytes(s.bytes).human()
                    )
                })
                .collect();
            let _ = writeln!(
                o,
                "  streams             {}: {}",
                d.streams.len(),
                streams.join(", ")
            );
            let _ = writeln!(
                o,
                "  requested           {} in all",
                Bytes(d.requested_bytes).human()
            );
            let lb = &d.lower_bound;
            let mut when = String::new();
            if let (Some(ev), Some(n)) = (lb.event, lb.alloc_number) {
                let _ = write!(when, " at event {ev} (alloc #{n}");
                if let (Some(t), Some((t0, _))) = (lb.time_us, d.time_span_us) {
                    let _ = write!(
                        when,
                        ", t = {t} µs, {:.3} s after the first event",
                        t.saturating_sub(t0) as f64 / 1e6
                    );
                }
                when.push(')');
            } else {
                when.push_str(" (preexisting blocks only)");
            }
            let _ = writeln!(
                o,
                "  lower bound         {} B ({}){when}",
                lb.bytes, lb.human
            );
            match &d.period {
                None => {
                    let _ = writeln!(o, "  iteration period    none");
                }
                Some(p) => {
                    let events = p
                        .events_per_iteration
                        .map_or("varying".to_owned(), |e| e.to_string());
                    let _ = writeln!(
                        o,
                        "  iteration period    {} allocs ({} events) per iteration; steady from alloc #{} (event {}), {} repetitions [{}]",
                        p.allocs_per_iteration,
                        events,
                        p.first_steady_alloc,
                        p.first_steady_event,
                        p.repetitions,
                        p.source
                    );
                }
            }
            if !d.iteration_classes.is_empty() {
                let n: usize = d.iteration_classes.iter().map(|c| c.iterations.len()).sum();
                let shown: Vec<String> = d
                    .iteration_classes
                    .iter()
                    .take(4)
                    .map(|c| {
                        format!(
                            "{} x ({} allocs, peak {})",
                            c.count,
                            c.allocs_per_iteration,
                            Bytes(c.peak_bytes)
                        )
                    })
                    .collect();
                let more = d.iteration_classes.len().saturating_sub(4);
                let _ = writeln!(
                    o,
                    "  iteration classes   {} over {n} iterations: {}{}",
                    d.iteration_classes.len(),
                    shown.join(", "),
                    if more > 0 {
                        format!(", {more} more")
                    } else {
                        String::new()
                    }
                );
            }
            if let Some(x) = &d.snapshot_entries {
                let _ = writeln!(
                    o,
                    "  snapshot entries    {} (segment_alloc {}, segment_free {}, segment_map {}, segment_unmap {}, snapshot {}, oom {}, other {}); annotations {}",
                    x.total,
                    x.segment_alloc,
                    x.segment_free,
                    x.segment_map,
                    x.segment_unmap,
                    x.snapshot,
                    x.oom,
                    x.other,
                    x.annotations
                );
            }
        }
        o
    }
}

fn device_json(s: &TraceSummary, snapshot_entries: Option<EntriesJson>) -> DeviceJson {
    DeviceJson {
        device: s.device.0,
        events: EventsJson {
            total: s.events.total,
            alloc: s.events.alloc,
            free_requested: s.events.free_requested,
            free_completed: s.events.free_completed,
            marker: s.events.marker,
            saved_pack: s.events.saved_pack,
            saved_unpack: s.events.saved_unpack,
        },
        allocations: AllocationsJson {
            total: s.allocations.total,
            preexisting: s.allocations.preexisting,
            never_freed: s.allocations.never_freed,
        },
        distinct_sizes: s.distinct_sizes,
        streams: s
            .streams
            .iter()
            .map(|u| StreamJson {
                stream: u.stream.0,
                allocs: u.allocs,
                bytes: u.bytes.get(),
            })
            .collect(),
        requested_bytes: s.requested_bytes.get(),
        live_at_end_bytes: s.live_at_end.get(),
        lower_bound: LowerBoundJson {
            bytes: s.lower_bound.bytes.get(),
            human: s.lower_bound.bytes.human(),
            event: s.lower_bound.event.map(|e| e.0),
            alloc_number: s.lower_bound.alloc_number,
            time_us: s.lower_bound.time_us,
        },
        time_span_us: s.time_span_us,
        period: s.period.as_ref().map(|p| PeriodJson {
            allocs_per_iteration: p.allocs_per_iteration,
            requests_per_iteration: p.requests_per_iteration,
            events_per_iteration: p.events_per_iteration,
            first_steady_alloc: p.first_steady_alloc,
            first_steady_event: p.first_steady_event.0,
            repetitions: p.repetitions,
            source: match p.source {
                PeriodSource::IterationMarkers => "iteration_markers",
                PeriodSource::RequestSequence => "request_sequence",
            },
        }),
        iteration_classes: s
            .iteration_classes
            .iter()
            .map(|c| ClassJson {
                count: c.iterations.len(),
                iterations: c.iterations.clone(),
                allocs_per_iteration: c.allocs,
                peak_bytes: c.peak.get(),
            })
            .collect(),
        snapshot_entries,
    }
}

fn entries_json(c: &EntryCounts) -> EntriesJson {
    EntriesJson {
        total: c.entries(),
        segment_alloc: c.segment_alloc,
        segment_free: c.segment_free,
        segment_map: c.segment_map,
        segment_unmap: c.segment_unmap,
        snapshot: c.snapshot,
        oom: c.oom,
        other: c.other,
        annotations: c.annotations,
    }
}
