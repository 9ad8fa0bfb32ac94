//! Running the `stweaver` binary in the CLI integration tests (`mod cli;` in each).
#![allow(dead_code)] // each test file uses what it needs

use std::ffi::OsStr;
use std::process::{Command, Output};

/// `stweaver ARGS...`, run to completion.
pub fn stweaver<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stweaver"))
        .args(args)
        .output()
        .expect("run stweaver")
}

/// stdout then stderr, as text.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
