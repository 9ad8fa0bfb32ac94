//! `stweaver convert INPUT -o OUT.stwt [--device N]`: one device's trace as a stweaver
//! trace file.
//!
//! INPUT is anything `stweaver_planner::input` reads (a PyTorch memory snapshot,
//! gzip'd or not, or a trace file), recognised by its content. The trace written is
//! the only device's, or the one `--device` names when the input has several (then
//! `--device` is required). The file is written atomically and read back before
//! anything is printed, so "wrote" means the file loads (envelope, verifier,
//! validation) and holds exactly the trace converted.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use stweaver_core::trace_file::{read_trace_file, trace_digest, write_trace_file};
use stweaver_core::{DeviceId, EventKind, Trace};
use stweaver_planner::input::load_traces;

#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// A PyTorch memory snapshot (`.pickle` or `.pickle.gz`) or a stweaver trace (`.stwt`).
    pub input: PathBuf,
    /// The trace file to write (conventionally `.stwt`); replaced if it exists.
    #[arg(short, long, value_name = "OUT.stwt")]
    pub output: PathBuf,
    /// The device whose trace to write; required when the input has several.
    #[arg(long, value_name = "N")]
    pub device: Option<i32>,
}

pub fn run(args: ConvertArgs) -> Result<()> {
    let traces = load_traces(&args.input)?;
    let trace = choose(traces, args.device.map(DeviceId))
        .with_context(|| format!("{}", args.input.display()))?;
    write_trace_file(&args.output, &trace)?;
    let back = read_trace_file(&args.output)?;
    if back != trace {
        bail!(
            "{}: the file was written but does not read back as the trace converted",
            args.output.display()
        );
    }
    let size = std::fs::metadata(&args.output)
        .with_context(|| {
            format!(
                "{}: cannot stat the file just written",
                args.output.display()
            )
        })?
        .len();
    // The file is written and checked; a closed stdout (`| head`) is not an error.
    match writeln!(std::io::stdout().lock(), "{}", summary(&args, &trace, size)) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing the summary to stdout"),
    }
}

/// The trace of `device`, or the only one when `device` is `None`.
fn choose(traces: Vec<Trace>, device: Option<DeviceId>) -> Result<Trace> {
    let list = |traces: &[Trace]| {
        traces
            .iter()
            .map(|t| t.device.0.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match device {
        Some(d) => {
            let available = list(&traces);
            match traces.into_iter().find(|t| t.device == d) {
                Some(t) => Ok(t),
                None => bail!(
                    "device {} has no allocation history (devices with one: {available})",
                    d.0
                ),
            }
        }
        None => match traces.len() {
            0 => bail!("no device has any allocation history"),
            1 => Ok(traces.into_iter().next().expect("one trace")),
            _ => bail!(
                "the input has traces for several devices ({}): choose one with --device N",
                list(&traces)
            ),
        },
    }
}

/// What was written, in one paragraph.
fn summary(args: &ConvertArgs, trace: &Trace, file_bytes: u64) -> String {
    let preexisting = trace.allocations.iter().filter(|a| a.preexisting).count();
    let markers = trace
        .events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Marker { .. }))
        .count();
    let lb = trace.lower_bound();
    format!(
        "wrote {out} ({file_bytes} bytes) from {input}\n  \
         device       {device}\n  \
         allocations  {allocs} ({preexisting} preexisting)\n  \
         events       {events} ({alloc_events} allocs, {markers} markers), {labels} labels\n  \
         lower bound  {lb_bytes} B ({lb_human})\n  \
         digest       {digest:#018x}",
        out = args.output.display(),
        input = args.input.display(),
        device = trace.device,
        allocs = trace.allocations.len(),
        events = trace.events.len(),
        alloc_events = trace.alloc_event_count(),
        labels = trace.labels.len(),
        lb_bytes = lb.bytes.get(),
        lb_human = lb.bytes,
        digest = trace_digest(trace),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(device: i32) -> Trace {
        Trace {
            device: DeviceId(device),
            ..Trace::default()
        }
    }

    #[test]
    fn choose_takes_the_only_device_or_the_named_one() {
        assert_eq!(choose(vec![trace(3)], None).unwrap().device, DeviceId(3));
        let two = || vec![trace(0), trace(1)];
        assert_eq!(
            choose(two(), Some(DeviceId(1))).unwrap().device,
            DeviceId(1)
        );
        let e = choose(two(), None).unwrap_err().to_string();
        assert!(
            e.contains("several devices (0, 1)") && e.contains("--device"),
            "{e}"
        );
        let e = choose(two(), Some(DeviceId(5))).unwrap_err().to_string();
        assert!(e.contains("device 5") && e.contains("0, 1"), "{e}");
        assert!(choose(vec![], None).is_err());
    }
}
