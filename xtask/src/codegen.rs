//! `cargo xtask codegen [--check]`: regenerate every generated source file.
//!
//! The generated files are committed, so ordinary builds need no schema compiler
//! (no `build.rs`). This task rebuilds them from their schemas:
//!
//! | schema | generated |
//! |---|---|
//! | `crates/core/schema/trace.fbs` | `crates/core/src/trace_file/trace_generated.rs` |
//! | `crates/core/schema/plan.fbs`  | `crates/core/src/plan_file/plan_generated.rs` |
//!
//! Pipeline, per schema: `flatc --rust -o <temp dir> <schema>` → prepend a
//! "generated, do not edit" preamble → `rustfmt --edition 2024` (stdin to stdout,
//! run from the repository root so it reads the same configuration as `cargo fmt`)
//! → write the file (default) or compare it with the committed one (`--check`,
//! which fails naming every stale or missing file and writes nothing).
//!
//! **flatc.** The output depends on the exact flatc version, so exactly one is
//! used: 23.5.26, built from source by the `flatc` crate on crates.io
//! (`=0.2.2+23.5.26`, vendored C++ built with cmake; its Rust output compiles with
//! `flatbuffers = "=25.12.19"`). Debian's flatc (2.0.8) is too old and nothing
//! outside the registries is reachable, so this is the registry-only route. Lookup:
//!
//! 1. `$STWEAVER_FLATC`, if set (must report version 23.5.26);
//! 2. the cached `target/flatc/bin/flatc`, if present;
//! 3. otherwise build the helper package `xtask/flatc-bin` (not a workspace member,
//!    its own `Cargo.lock`, listed in the root `[workspace] exclude`) with
//!    `cargo build --release --locked --target-dir target/flatc` — minutes the first
//!    time (cmake on the vendored sources) — and copy the binary it reports into
//!    the cache. Ordinary `cargo build/test/clippy --workspace` never compile it.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The flatc version every generated file is made with.
const FLATC_VERSION: &str = "23.5.26";

/// One generated file: its schema and where the output is committed, both relative
/// to the repository root. `flatc --rust` names its output `<schema stem>_generated.rs`.
struct Generated {
    schema: &'static str,
    output: &'static str,
}

const GENERATED: &[Generated] = &[
    Generated {
        schema: "crates/core/schema/trace.fbs",
        output: "crates/core/src/trace_file/trace_generated.rs",
    },
    Generated {
        schema: "crates/core/schema/plan.fbs",
        output: "crates/core/src/plan_file/plan_generated.rs",
    },
];

/// Entry point: `args` are the task's arguments (`--check` or nothing).
pub fn run(args: &[String]) -> Result<()> {
    let check = match args {
        [] => false,
        [flag] if flag == "--check" => true,
        _ => bail!("usage: cargo xtask codegen [--check]"),
    };
    let root = repo_root()?;
    let flatc = find_or_build_flatc(&root)?;
    let tmp = tempfile::Builder::new()
        .prefix("stweaver-codegen-")
        .tempdir()
        .context("creating a temporary directory for flatc output")?;

    let mut stale = Vec::new();
    for g in GENERATED {
        let fresh = generate(&root, &flatc, g, tmp.path())?;
        let out = root.join(g.output);
        let current = match fs::read_to_string(&out) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("reading {}", out.display())),
        };
        match (check, current) {
            (_, Some(cur)) if cur == fresh => eprintln!("codegen: {} is up to date", g.output),
            (true, Some(_)) => stale.push(format!("{} (differs from {})", g.output, g.schema)),
            (true, None) => stale.push(format!("{} (missing; made from {})", g.output, g.schema)),
            (false, _) => {
                fs::write(&out, fresh).with_context(|| format!("writing {}", out.display()))?;
                eprintln!("codegen: wrote {}", g.output);
            }
        }
    }
    if !stale.is_empty() {
        bail!(
            "stale generated files:\n  {}\nrun `cargo xtask codegen` and commit the result",
            stale.join("\n  ")
        );
    }
    Ok(())
}

/// The repository root (the parent of this package's directory).
fn repo_root() -> Result<PathBuf> {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .context("xtask's manifest directory has no parent")
}

/// Runs flatc on one schema and returns the final (preamble + rustfmt) text.
fn generate(root: &Path, flatc: &Path, g: &Generated, tmp: &Path) -> Result<String> {
    let schema = Path::new(g.schema);
    let stem = schema
        .file_stem()
        .and_then(|s| s.to_str())
        .with_context(|| format!("schema path {} has no file stem", g.schema))?;
    let out_dir = tmp.join(stem);
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;

    let mut cmd = Command::new(flatc);
    cmd.current_dir(root)
        .arg("--rust")
        .arg("-o")
        .arg(&out_dir)
        .arg(g.schema);
    let output = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !output.status.success() {
        bail!(
            "flatc failed on {} ({}):\n{}{}",
            g.schema,
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let produced = out_dir.join(format!("{stem}_generated.rs"));
    let raw = fs::read_to_string(&produced)
        .with_context(|| format!("reading flatc output {}", produced.display()))?;

    let text = format!(
        "// Generated by `cargo xtask codegen` from `{schema}` with flatc {FLATC_VERSION}\n\
         // (the `flatc` crate on crates.io). Do not edit by hand: change the schema and\n\
         // rerun `cargo xtask codegen`; `cargo xtask codegen --check` fails when this\n\
         // file is stale.\n\n{raw}",
        schema = g.schema,
    );
    rustfmt(root, &text).with_context(|| format!("formatting the code generated from {}", g.schema))
}

/// Formats Rust source with the workspace's rustfmt configuration (run from `root`).
fn rustfmt(root: &Path, source: &str) -> Result<String> {
    let rustfmt = std::env::var_os("RUSTFMT").unwrap_or_else(|| "rustfmt".into());
    let mut child = Command::new(&rustfmt)
        .current_dir(root)
        .args(["--edition", "2024", "--emit", "stdout"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", Path::new(&rustfmt).display()))?;
    // Feed stdin from a thread so a large output cannot deadlock on a full pipe.
    let mut stdin = child.stdin.take().context("rustfmt stdin")?;
    let input = source.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let output = child.wait_with_output().context("waiting for rustfmt")?;
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("rustfmt stdin writer panicked"))?
        .context("writing to rustfmt")?;
    if !output.status.success() {
        bail!(
            "rustfmt failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    String::from_utf8(output.stdout).context("rustfmt printed non-UTF-8 output")
}

/// Finds flatc (see the module docs for the order) and checks its version.
fn find_or_build_flatc(root: &Path) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("STWEAVER_FLATC") {
        let p = PathBuf::from(p);
        check_flatc_version(&p).context("checking $STWEAVER_FLATC")?;
        return Ok(p);
    }
    let cache_dir = root.join("target/flatc");
    let cached = cache_dir.join("bin/flatc");
    if cached.is_file() {
        check_flatc_version(&cached).with_context(|| {
            format!(
                "checking the cached {} (delete it to rebuild)",
                cached.display()
            )
        })?;
        return Ok(cached);
    }

    eprintln!(
        "codegen: building flatc {FLATC_VERSION} from the `flatc` crate into {} \
         (cmake; several minutes, once)",
        cache_dir.display()
    );
    let manifest = root.join("xtask/flatc-bin/Cargo.toml");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(&cargo);
    build
        .args(["build", "--release", "--locked", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&cache_dir);
    crate::run(build)?;

    let helper = cache_dir.join("release/stweaver-flatc-bin");
    let out = Command::new(&helper)
        .output()
        .with_context(|| format!("running {}", helper.display()))?;
    if !out.status.success() {
        bail!("{} failed with {}", helper.display(), out.status);
    }
    let built = PathBuf::from(
        String::from_utf8(out.stdout)
            .context("flatc path is not UTF-8")?
            .trim(),
    );
    check_flatc_version(&built)?;
    fs::create_dir_all(cached.parent().context("cache path has no parent")?)
        .with_context(|| format!("creating {}", cache_dir.display()))?;
    fs::copy(&built, &cached)
        .with_context(|| format!("copying {} to {}", built.display(), cached.display()))?;
    eprintln!("codegen: cached flatc at {}", cached.display());
    Ok(cached)
}

/// Fails unless `flatc --version` reports [`FLATC_VERSION`].
fn check_flatc_version(flatc: &Path) -> Result<()> {
    let out = Command::new(flatc)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", flatc.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.trim().strip_prefix("flatc version ").unwrap_or("");
    if !out.status.success() || version != FLATC_VERSION {
        bail!(
            "{} reports {:?}; the generated code is made with flatc {FLATC_VERSION} exactly",
            flatc.display(),
            text.trim()
        );
    }
    Ok(())
}
