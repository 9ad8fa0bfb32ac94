//! `cargo xtask wheel-check`: the pip install path, on a CPU machine (CI).
//!
//! 1. The torch 2.11 virtual environment of `scripts/fetch_torch_headers.sh 2.11.0 --venv`
//!    (the CUDA wheel: `import torch` works without a GPU, and pip's nvidia packages give
//!    the CUDA headers and cudart, as for `cpp-check`);
//! 2. `pip wheel --no-build-isolation . -w target/wheel-check/dist` with it (setup.py:
//!    cargo release builds, the C++ extension against that torch). The check is of the
//!    install path, not of speed: cargo builds the release profile at `opt-level = 0`
//!    without debug info, in its own target directory (`target/wheel-check/cargo`, so the
//!    real release artefacts in `target/release` are never replaced by slow ones). On the
//!    2-core box the two cargo builds take 77 s against 223 s optimised (CI's longest
//!    step after the tests). `STWEAVER_WHEEL_CHECK_OPTIMIZED=1` builds them as a user's
//!    `pip install` does;
//! 3. a fresh virtual environment that sees that torch through a `.pth` file (nothing is
//!    downloaded), `pip install --no-index` of the wheel (its `torch==` requirement must be
//!    met by the torch there), then, from outside the repository and with no cargo on
//!    PATH: `import stweaver`, the extension loaded (its symbols resolved against the real
//!    torch libraries) without initialising CUDA, and `stweaver --help` from PATH.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::run;
use crate::torch_ext::{output, python_module, root, target_dir};

const TORCH: &str = "2.11.0";

/// Runs `py -m pip install -q --disable-pip-version-check` with `args`.
fn pip_install(py: &Path, args: &[&OsStr]) -> Result<()> {
    let mut c = Command::new(py);
    c.args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
        .args(args);
    run(c)
}

/// The torch venv's path (created once, cached under `~/.cache/stweaver`).
fn torch_venv() -> Result<PathBuf> {
    let out = output(
        Command::new("bash")
            .arg(root().join("scripts/fetch_torch_headers.sh"))
            .args([TORCH, "--venv"]),
    )?;
    let env_file = PathBuf::from(out.lines().last().unwrap_or("").trim());
    let text =
        fs::read_to_string(&env_file).with_context(|| format!("reading {}", env_file.display()))?;
    let venv = text
        .lines()
        .find_map(|l| l.strip_prefix("TORCH_VENV="))
        .with_context(|| format!("no TORCH_VENV in {}", env_file.display()))?;
    Ok(PathBuf::from(venv))
}

/// setuptools < 70.1 builds wheels only with the `wheel` package (an old venv may have
/// neither): install it then, leaving setuptools (torch pins its range) alone.
fn ensure_wheel_support(py: &Path) -> Result<()> {
    let ok = Command::new(py)
        .args([
            "-c",
            "import setuptools, sys\n\
             v = tuple(int(x) for x in setuptools.__version__.split('.')[:2])\n\
             if v < (70, 1):\n    import wheel",
        ])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        pip_install(py, &["wheel".as_ref()])?;
    }
    Ok(())
}

fn site_packages(venv: &Path) -> Result<PathBuf> {
    let lib = venv.join("lib");
    for e in fs::read_dir(&lib).with_context(|| format!("reading {}", lib.display()))? {
        let p = e?.path().join("site-packages");
        if p.is_dir() {
            return Ok(p);
        }
    }
    bail!("no lib/python*/site-packages in {}", venv.display())
}

/// PATH without any directory holding cargo: the installed wheel must need no Rust.
fn path_without_cargo(first: &Path) -> String {
    let mut dirs = vec![first.display().to_string()];
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            if !d.join("cargo").exists() {
                dirs.push(d.display().to_string());
            }
        }
    }
    dirs.join(":")
}

pub fn wheel_check() -> Result<()> {
    let t0 = Instant::now();
    let venv = torch_venv()?;
    let py = venv.join("bin/python");
    ensure_wheel_support(&py)?;
    let work = target_dir().join("wheel-check");
    let dist = work.join("dist");
    if dist.exists() {
        fs::remove_dir_all(&dist)?;
    }
    let t_build = Instant::now();
    let mut c = python_module(&py, "pip");
    c.args([
        "wheel",
        "--disable-pip-version-check",
        "--no-build-isolation",
        "--no-deps",
        ".",
        "-w",
    ])
    .arg(&dist);
    if std::env::var("STWEAVER_WHEEL_CHECK_OPTIMIZED").as_deref() != Ok("1") {
        // Module docs, step 2: the same build, unoptimised, in a target directory of its own.
        c.env("CARGO_TARGET_DIR", work.join("cargo"))
            .env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "0")
            .env("CARGO_PROFILE_RELEASE_DEBUG", "false");
    }
    run(c)?;
    let build_s = t_build.elapsed().as_secs_f64();
    let wheels: Vec<PathBuf> = fs::read_dir(&dist)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    let [wheel] = wheels.as_slice() else {
        bail!("expected one wheel in {}, found {wheels:?}", dist.display());
    };
    let wheel_mib = fs::metadata(wheel)?.len() as f64 / (1 << 20) as f64;

    // A fresh environment that sees the torch venv's packages (torch) and nothing else.
    let t_install = Instant::now();
    let fresh = work.join("venv");
    if fresh.exists() {
        fs::remove_dir_all(&fresh)?;
    }
    let mut c = Command::new(&py);
    c.args(["-m", "venv"]).arg(&fresh);
    run(c)?;
    fs::write(
        site_packages(&fresh)?.join("stweaver-ci-torch.pth"),
        format!("{}\n", site_packages(&venv)?.display()),
    )?;
    let fresh_py = fresh.join("bin/python");
    pip_install(&fresh_py, &["--no-index".as_ref(), wheel.as_ref()])?;
    let install_s = t_install.elapsed().as_secs_f64();

    // Outside the repository (no python/ on sys.path), no cargo on PATH.
    let t_use = Instant::now();
    let outside = work.join("outside");
    fs::create_dir_all(&outside)?;
    let path = path_without_cargo(&fresh.join("bin"));
    let probe = format!(
        "import os, stweaver, torch\n\
         from stweaver import _build\n\
         here = os.path.realpath(stweaver.__file__)\n\
         assert here.startswith(os.path.realpath({site:?})), here\n\
         ext = _build.load_extension()\n\
         assert os.path.dirname(os.path.realpath(ext.__file__)) == os.path.dirname(here), ext.__file__\n\
         assert not torch.cuda.is_initialized(), 'loading stweaver initialised CUDA'\n\
         print('stweaver', here, '| extension built for torch', ext.torch_version, '| torch', torch.__version__)\n",
        site = site_packages(&fresh)?.display().to_string()
    );
    let out = output(
        Command::new(&fresh_py)
            .current_dir(&outside)
            .env("PATH", &path)
            .env_remove("PYTHONPATH")
            .args(["-c", &probe]),
    )
    .context("importing the installed stweaver")?;
    print!("{out}");
    let which = output(
        Command::new("sh")
            .current_dir(&outside)
            .env("PATH", &path)
            .args(["-c", "command -v stweaver"]),
    )?;
    let expected = fresh.join("bin/stweaver");
    if Path::new(which.trim()) != expected {
        bail!(
            "`stweaver` on PATH is {}, not the wheel's {}",
            which.trim(),
            expected.display()
        );
    }
    let help = output(
        Command::new("stweaver")
            .current_dir(&outside)
            .env("PATH", &path)
            .arg("--help"),
    )
    .context("running the installed `stweaver --help`")?;
    for sub in ["plan", "compare", "inspect"] {
        if !help.contains(sub) {
            bail!("`stweaver --help` does not list `{sub}`:\n{help}");
        }
    }
    let use_s = t_use.elapsed().as_secs_f64();
    println!(
        "wheel-check: {} ({wheel_mib:.1} MiB): built in {build_s:.1} s, installed into a fresh venv in {install_s:.1} s, \
         import + extension load + `stweaver --help` in {use_s:.1} s; {:.1} s in total",
        wheel.file_name().unwrap_or_default().to_string_lossy(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
