//! Input dispatch: what kind of file was given, by its content (never its name).
//!
//! - bytes 8..12 `STWT` → a stweaver trace file (`.stwt`, [`stweaver_core::trace_file`]);
//!   gzipped, the same once gunzipped (`.stwt.gz`: the repository's vendored traces);
//! - gzip magic (`1f 8b`) or a pickle header (`80 02..05`) → a PyTorch memory snapshot
//!   ([`crate::snapshot`]);
//! - anything else → [`InputError::Unrecognised`], naming the file and its first bytes.
//!
//! Cost: reading the 12-byte header, then whatever the chosen reader costs.

use std::io::Read;
use std::path::{Path, PathBuf};

use stweaver_core::Trace;
use stweaver_core::trace_file::{TraceFileError, read_trace_file, trace_from_bytes};

use crate::snapshot::{
    LoadProgress, Snapshot, SnapshotError, load_snapshot_with_progress, looks_like_snapshot,
};

/// What a file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputFormat {
    /// A PyTorch memory snapshot (pickle, optionally gzip'd).
    PytorchSnapshot,
    /// A stweaver trace file (`.stwt`).
    TraceFile,
}

impl InputFormat {
    /// Stable identifier (JSON, messages).
    pub fn id(self) -> &'static str {
        match self {
            InputFormat::PytorchSnapshot => "pytorch_snapshot",
            InputFormat::TraceFile => "stweaver_trace",
        }
    }
}

/// A loaded input.
#[derive(Debug, Clone, PartialEq)]
pub enum LoadedInput {
    Snapshot(Box<Snapshot>),
    TraceFile(Trace),
}

impl LoadedInput {
    pub fn format(&self) -> InputFormat {
        match self {
            LoadedInput::Snapshot(_) => InputFormat::PytorchSnapshot,
            LoadedInput::TraceFile(_) => InputFormat::TraceFile,
        }
    }

    /// The traces, one per device with allocation history.
    pub fn traces(&self) -> &[Trace] {
        match self {
            LoadedInput::Snapshot(s) => &s.traces,
            LoadedInput::TraceFile(t) => std::slice::from_ref(t),
        }
    }

    pub fn into_traces(self) -> Vec<Trace> {
        match self {
            LoadedInput::Snapshot(s) => s.traces,
            LoadedInput::TraceFile(t) => vec![t],
        }
    }
}

/// Why an input could not be loaded. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{}: cannot read the file: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "{}: unrecognised file: neither a PyTorch memory snapshot (gzip or pickle) nor a stweaver trace file (.stwt); it starts with {head}",
        path.display()
    )]
    Unrecognised { path: PathBuf, head: String },
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    TraceFile(#[from] TraceFileError),
}

/// Size of the header [`sniff`] looks at.
pub const SNIFF_LEN: usize = 12;

/// The format of a file from its first bytes (at least [`SNIFF_LEN`] when the file
/// has them).
pub fn sniff(head: &[u8]) -> Option<InputFormat> {
    if head.get(8..12) == Some(b"STWT".as_slice()) {
        Some(InputFormat::TraceFile)
    } else if looks_like_snapshot(head) {
        Some(InputFormat::PytorchSnapshot)
    } else {
        None
    }
}

/// Loads any supported input.
pub fn load_input(path: &Path) -> Result<LoadedInput, InputError> {
    load_input_with_progress(path, &mut |_| {})
}

/// [`load_input`], reporting the progress of snapshot imports (trace files are
/// memory-mapped and fast; they report nothing).
pub fn load_input_with_progress(
    path: &Path,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<LoadedInput, InputError> {
    let head = read_head(path)?;
    if head.starts_with(&[0x1f, 0x8b]) && gzipped_trace(path)? {
        let read_err = |error| InputError::Read {
            path: path.to_owned(),
            error,
        };
        let file = std::fs::File::open(path).map_err(read_err)?;
        let mut bytes = Vec::new();
        flate2::read::MultiGzDecoder::new(file)
            .read_to_end(&mut bytes)
            .map_err(read_err)?;
        let trace = trace_from_bytes(&bytes).map_err(|e| e.with_path(path))?;
        return Ok(LoadedInput::TraceFile(trace));
    }
    match sniff(&head) {
        Some(InputFormat::TraceFile) => Ok(LoadedInput::TraceFile(read_trace_file(path)?)),
        Some(InputFormat::PytorchSnapshot) => Ok(LoadedInput::Snapshot(Box::new(
            load_snapshot_with_progress(path, progress)?,
        ))),
        None => Err(InputError::Unrecognised {
            path: path.to_owned(),
            head: describe(&head),
        }),
    }
}

/// The traces of any supported input, one per device with allocation history.
pub fn load_traces(path: &Path) -> Result<Vec<Trace>, InputError> {
    load_input(path).map(LoadedInput::into_traces)
}

/// Whether the gzip file at `path` holds a stweaver trace file (its first bytes, gunzipped,
/// carry the `STWT` identifier).
fn gzipped_trace(path: &Path) -> Result<bool, InputError> {
    let file = std::fs::File::open(path).map_err(|error| InputError::Read {
        path: path.to_owned(),
        error,
    })?;
    let mut head = Vec::with_capacity(SNIFF_LEN);
    // A broken gzip stream is the snapshot reader's to report.
    let _ = flate2::read::MultiGzDecoder::new(file)
        .take(SNIFF_LEN as u64)
        .read_to_end(&mut head);
    Ok(head.get(8..12) == Some(b"STWT".as_slice()))
}

fn read_head(path: &Path) -> Result<Vec<u8>, InputError> {
    let read_err = |error| InputError::Read {
        path: path.to_owned(),
        error,
    };
    let file = std::fs::File::open(path).map_err(read_err)?;
    let mut head = Vec::with_capacity(SNIFF_LEN);
    file.take(SNIFF_LEN as u64)
        .read_to_end(&mut head)
        .map_err(read_err)?;
    Ok(head)
}

fn describe(head: &[u8]) -> String {
    if head.is_empty() {
        return "nothing (the file is empty)".to_owned();
    }
    let hex: Vec<String> = head.iter().map(|b| format!("{b:02x}")).collect();
    let text: String = head
        .iter()
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        })
        .collect();
    format!("{} ({text:?})", hex.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffs_by_content() {
        assert_eq!(
            sniff(&[0x1f, 0x8b, 8, 0]),
            Some(InputFormat::PytorchSnapshot)
        );
        assert_eq!(sniff(&[0x80, 4, 0x95]), Some(InputFormat::PytorchSnapshot));
        assert_eq!(
            sniff(b"\x10\0\0\0\x0c\0\0\0STWT"),
            Some(InputFormat::TraceFile)
        );
        assert_eq!(sniff(b"id,lower,upper"), None);
        assert_eq!(sniff(b""), None);
    }

    #[test]
    fn unrecognised_and_missing_files_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("notes.txt");
        std::fs::write(&p, "hello, world").unwrap();
        let e = load_traces(&p).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, InputError::Unrecognised { .. }), "{msg}");
        assert!(
            msg.contains("notes.txt") && msg.contains("68 65 6c 6c 6f"),
            "{msg}"
        );
        let missing = dir.path().join("missing.pickle");
        let e = load_traces(&missing).unwrap_err();
        assert!(matches!(e, InputError::Read { .. }));
        assert!(e.to_string().contains("missing.pickle"));
    }
}
