//! Tasks around the torch extension (`cpp/` + the `stweaver-torch` staticlib):
//!
//! - `build-torch-ext` — builds the staticlib and the extension ahead of time into
//!   `python/stweaver/_C*.so` with the interpreter in `$PYTHON` (default `python3`).
//! - `gpu-test` — prepares `.carry/` (stripped staticlib, cxx headers with symlinks
//!   resolved, the CUDA crate's test binaries, the release CLI in `cli/`, and `pywheels/`:
//!   setuptools and wheel for the GPU machine's Python, see `carry_build_requirements`)
//!   and prints the one command to run on a GPU machine (`bash scripts/gpu_test.sh .carry`),
//!   which has no Rust: it builds the pip wheel there from the carry (setup.py's
//!   `STWEAVER_PREBUILT`), installs it into a fresh venv and runs the GPU suite from it.
//! - `cpp-check [VERSION...]` — compiles `cpp/` against real torch wheels' headers
//!   (default: 2.11.0 and the newest on PyPI, fetched by `scripts/fetch_torch_headers.sh`)
//!   and links the extension, then checks that every undefined symbol is provided by torch,
//!   CUDA's runtime, the C/C++ runtimes or Python, and that no Rust/cxx symbol is exported;
//!   also compiles and links (does not run) the native example `examples/cpp/train.cpp`.
//!   No GPU and no CUDA toolkit needed.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::{cargo, run};

pub(crate) fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Cargo's target directory (`CARGO_TARGET_DIR` if set, else `<workspace>/target`).
pub(crate) fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => {
            let d = PathBuf::from(d);
            if d.is_absolute() { d } else { root().join(d) }
        }
        None => root().join("target"),
    }
}

/// The warnings every g++ compile of the C++ sources turns on (as errors).
const GXX_WARNINGS: [&str; 4] = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror"];

/// `py -m module`, run in the repository root.
pub(crate) fn python_module(py: impl AsRef<OsStr>, module: &str) -> Command {
    let mut c = Command::new(py);
    c.current_dir(root()).args(["-m", module]);
    c
}

pub(crate) fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Runs `cmd` and returns its stdout; an error with both outputs if it fails.
pub(crate) fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed with {}:\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(crate) fn build_staticlib(release: bool) -> Result<PathBuf> {
    let mut c = cargo();
    c.current_dir(root())
        .args(["build", "-p", "stweaver-torch"]);
    if release {
        c.arg("--release");
    }
    run(c)?;
    let lib = target_dir()
        .join(if release { "release" } else { "debug" })
        .join("libstweaver_torch.a");
    if !lib.is_file() {
        bail!("{} was not produced", lib.display());
    }
    Ok(lib)
}

// ------------------------------------------------------------------ build-torch-ext

pub fn build_torch_ext() -> Result<()> {
    let py = python();
    let t0 = Instant::now();
    let version = output(Command::new(&py).args(["-c", "import torch; print(torch.__version__)"]))
        .with_context(|| {
            format!(
                "{py} cannot import torch; set PYTHON to an interpreter with torch \
                 (scripts/fetch_torch_headers.sh --venv makes one)"
            )
        })?;
    let version = version.lines().last().unwrap_or("").trim().to_string();
    eprintln!("torch {version} via {py}");
    build_staticlib(true)?;
    let mut c = Command::new(&py);
    c.current_dir(root())
        .args(["-m", "stweaver", "build"])
        .env("PYTHONPATH", root().join("python"))
        .env(
            "TORCH_CUDA_ARCH_LIST",
            std::env::var("TORCH_CUDA_ARCH_LIST").unwrap_or_else(|_| "9.0".into()),
        );
    run(c)?;
    eprintln!(
        "build-torch-ext: done in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

// ------------------------------------------------------------------ ci: python tests

/// CI's Python step: `pytest python/tests` with `$PYTHON` when it has pytest. What needs
/// torch skips cleanly without it, what needs a GPU skips without one; an interpreter
/// without pytest skips the step with a notice (CI installs none by itself).
pub fn python_tests() -> Result<()> {
    let py = python();
    let has_pytest = Command::new(&py)
        .args(["-c", "import pytest"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_pytest {
        eprintln!("python tests: skipped ({py} has no pytest; `pip install pytest` to run them)");
        return Ok(());
    }
    let mut c = python_module(&py, "pytest");
    c.args(["-q", "-p", "no:cacheprovider", "python/tests"])
        .env("TORCH_CUDA_ARCH_LIST", "9.0");
    run(c)
}

// ------------------------------------------------------------------ gpu-test

pub(crate) fn copy_resolved(src: &Path, dst: &Path) -> Result<u64> {
    let mut bytes = 0;
    fs::create_dir_all(dst)?;
    for entry in fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
        let entry = entry?;
        let from = entry.path();
        let to = dst.join(entry.file_name());
        // metadata() follows symlinks: cxx-build's headers are links into target/*/build.
        let md = fs::metadata(&from).with_context(|| format!("{}", from.display()))?;
        if md.is_dir() {
            bytes += copy_resolved(&from, &to)?;
        } else {
            bytes += fs::copy(&from, &to).with_context(|| format!("copying {}", from.display()))?;
        }
    }
    Ok(bytes)
}

pub(crate) fn strip_debug(path: &Path) {
    // Best effort: smaller carry; a missing `strip` only costs size.
    let _ = Command::new("strip")
        .arg("--strip-debug")
        .arg(path)
        .status();
}

/// Copies `src` to `dst` and strips its debug information; `dst`'s size.
pub(crate) fn copy_stripped(src: &Path, dst: &Path) -> Result<u64> {
    fs::copy(src, dst)?;
    strip_debug(dst);
    Ok(fs::metadata(dst)?.len())
}

/// Makes `carry` afresh (an empty `bin/` in it) holding the stripped staticlib `lib`
/// and the cxx headers, symlinks resolved; the bytes of both.
pub(crate) fn fresh_carry(carry: &Path, lib: &Path) -> Result<u64> {
    if carry.exists() {
        fs::remove_dir_all(carry)?;
    }
    fs::create_dir_all(carry.join("bin"))?;
    let lib_len = copy_stripped(lib, &carry.join("libstweaver_torch.a"))?;
    let hdr = copy_resolved(&target_dir().join("cxxbridge"), &carry.join("cxxbridge"))?;
    Ok(lib_len + hdr)
}

pub(crate) fn ensure_excluded(entry: &str) -> Result<()> {
    // `--git-path` also resolves the shared exclude file of a linked worktree.
    let rel = output(Command::new("git").current_dir(root()).args([
        "rev-parse",
        "--git-path",
        "info/exclude",
    ]))?;
    let exclude = root().join(rel.trim());
    if let Some(dir) = exclude.parent() {
        fs::create_dir_all(dir)?;
    }
    let text = fs::read_to_string(&exclude).unwrap_or_default();
    if !text.lines().any(|l| l.trim() == entry) {
        let mut new = text;
        if !new.is_empty() && !new.ends_with('\n') {
            new.push('\n');
        }
        new.push_str(entry);
        new.push('\n');
        fs::write(&exclude, new)?;
    }
    Ok(())
}

/// The test executables `cargo test --no-run --message-format=json` reports.
fn test_executables(package: &str) -> Result<Vec<PathBuf>> {
    let mut c = cargo();
    c.current_dir(root()).args([
        "test",
        "--release",
        "-p",
        package,
        "--no-run",
        "--message-format=json",
    ]);
    let out = output(&mut c)?;
    let mut exes = Vec::new();
    for line in out.lines() {
        if let Some(i) = line.find("\"executable\":\"") {
            let rest = &line[i + 14..];
            if let Some(end) = rest.find('"') {
                exes.push(PathBuf::from(&rest[..end]));
            }
        }
    }
    if exes.is_empty() {
        bail!("cargo reported no test executable for {package}");
    }
    Ok(exes)
}

/// Packs the carry folder `carry_name` into `carry_name.tar.xz` (git-excluded): the
/// device tool carries at most 64 MiB with the repository, which the uncompressed carry
/// (a 40 MB staticlib, test binaries) exceeds; `scripts/gpu_env.sh` unpacks it there.
pub(crate) fn pack_carry(carry_name: &str) -> Result<PathBuf> {
    let packed = format!("{carry_name}.tar.xz");
    let mut c = Command::new("tar");
    c.current_dir(root())
        .env("XZ_OPT", "-6 -T0")
        .args(["-cJf", &packed, carry_name]);
    run(c)?;
    ensure_excluded(&format!("/{packed}"))?;
    let path = root().join(&packed);
    eprintln!(
        "packed {} ({:.1} MiB)",
        path.display(),
        fs::metadata(&path)?.len() as f64 / (1 << 20) as f64
    );
    Ok(path)
}

/// The GPU machine's Python (its torch 2.11 wheel is cp312), for the carried build wheels.
const GPU_PYTHON_VERSION: &str = "3.12";
/// setuptools that builds the wheel there: >= 70.1 has bdist_wheel built in, and torch 2.11
/// requires setuptools < 82.
const GPU_BUILD_REQUIREMENTS: [&str; 2] = ["setuptools>=70.1,<82", "wheel"];

/// `pyproject.toml`'s build requirements as py3-none-any wheels in `carry/pywheels`:
/// `scripts/gpu_env.sh` installs them (offline) into the build venv when the GPU machine's
/// Python has no usable setuptools (a 3.12 venv has none of its own). Downloaded once with
/// `pip download` into `target/pywheels-py312`; without network (and no cached copy) the
/// carry goes without them, with a warning. Returns the bytes carried.
fn carry_build_requirements(carry: &Path) -> Result<u64> {
    let cache = target_dir().join(format!(
        "pywheels-py{}",
        GPU_PYTHON_VERSION.replace('.', "")
    ));
    let wheels = |dir: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "whl"))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    let complete = |v: &[PathBuf]| {
        ["setuptools-", "wheel-"].iter().all(|pre| {
            v.iter().any(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(pre))
            })
        })
    };
    if !complete(&wheels(&cache)) {
        let mut c = Command::new(python());
        c.args([
            "-m",
            "pip",
            "download",
            "-q",
            "--disable-pip-version-check",
            "--only-binary",
            ":all:",
            "--python-version",
            GPU_PYTHON_VERSION,
            "--no-deps",
            "-d",
        ])
        .arg(&cache)
        .args(GPU_BUILD_REQUIREMENTS);
        if let Err(e) = run(c) {
            eprintln!(
                "gpu-test: WARNING: no build wheels carried ({e:#}); the GPU machine's Python \
                 must have setuptools >= 64 (and wheel, or setuptools >= 70.1) to build the wheel"
            );
            return Ok(0);
        }
    }
    let found = wheels(&cache);
    if !complete(&found) {
        bail!(
            "pip download left no setuptools and wheel wheels in {}",
            cache.display()
        );
    }
    let dst = carry.join("pywheels");
    fs::create_dir_all(&dst)?;
    let mut bytes = 0;
    for w in &found {
        bytes += fs::copy(w, dst.join(w.file_name().context("wheel without a name")?))?;
    }
    Ok(bytes)
}

pub fn gpu_test(args: &[String]) -> Result<()> {
    let carry_name = ".carry";
    let carry = root().join(carry_name);
    let lib = build_staticlib(true)?;
    let cli = crate::gpu_bench::build_cli()?;
    let mut exes = test_executables("stweaver-cuda")?;
    exes.extend(test_executables("stweaver-torch")?);
    let lib_and_headers = fresh_carry(&carry, &lib)?;
    for exe in &exes {
        let name = exe.file_name().context("test executable without a name")?;
        copy_stripped(exe, &carry.join("bin").join(name))?;
    }
    // The release CLI (the budget benchmark's planner), outside bin/ (test binaries).
    fs::create_dir_all(carry.join("cli"))?;
    let cli_len = copy_stripped(&cli, &carry.join("cli/stweaver"))?;
    let pywheels = carry_build_requirements(&carry)?;
    ensure_excluded("/.carry/")?;
    let mut total = lib_and_headers + cli_len + pywheels;
    for e in fs::read_dir(carry.join("bin"))? {
        total += e?.metadata()?.len();
    }
    eprintln!(
        "gpu-test: {} ready ({:.1} MiB: staticlib, cxx headers, CLI, setuptools/wheel, {} test binaries)",
        carry.display(),
        total as f64 / (1 << 20) as f64,
        exes.len()
    );
    pack_carry(carry_name)?;
    let cmd = format!("bash scripts/gpu_test.sh {carry_name}");
    println!("device command: {cmd}");
    println!("carry: [\"{carry_name}.tar.xz\"]   (gpu_test.sh unpacks it)");
    if args.iter().any(|a| a == "--run-here") {
        let mut c = Command::new("bash");
        c.current_dir(root())
            .args(["scripts/gpu_test.sh", carry_name]);
        run(c)?;
    }
    Ok(())
}

// ------------------------------------------------------------------ cpp-check

fn parse_env_file(path: &Path) -> Result<Vec<(String, String)>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect())
}

fn get<'a>(env: &'a [(String, String)], key: &str) -> Result<&'a str> {
    env.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .with_context(|| format!("{key} missing from the torch paths file"))
}

fn dynamic_symbols(lib: &Path, defined: bool) -> Result<Vec<(String, String)>> {
    let flag = if defined {
        "--defined-only"
    } else {
        "--undefined-only"
    };
    let out = output(Command::new("nm").args(["-D", flag]).arg(lib))?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace().rev();
            let name = it.next()?;
            let kind = it.next()?;
            let base = name.split('@').next().unwrap_or(name);
            Some((kind.to_string(), base.to_string()))
        })
        .collect())
}

fn gcc_file(name: &str) -> Result<PathBuf> {
    let p = output(Command::new("g++").arg(format!("-print-file-name={name}")))?;
    Ok(PathBuf::from(p.trim()))
}

fn check_one(version: &str, lib: &Path) -> Result<String> {
    let t0 = Instant::now();
    let env_file = output(
        Command::new("bash")
            .arg(root().join("scripts/fetch_torch_headers.sh"))
            .arg(version),
    )?;
    let env_file = PathBuf::from(env_file.lines().last().unwrap_or("").trim());
    let env = parse_env_file(&env_file)?;
    let tv = get(&env, "TORCH_VERSION")?.to_string();
    let minor: u32 = tv
        .split('.')
        .nth(1)
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("cannot read the minor version of {tv}"))?;
    let std = if minor >= 12 { "c++20" } else { "c++17" };
    let py_inc = output(Command::new(python()).args([
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['include'])",
    ]))?;
    let work = root().join("target/cpp-check").join(&tv);
    fs::create_dir_all(&work)?;
    let includes = [
        target_dir().join("cxxbridge").display().to_string(),
        root().join("cpp").display().to_string(),
        get(&env, "TORCH_INCLUDE")?.to_string(),
        get(&env, "TORCH_API_INCLUDE")?.to_string(),
        get(&env, "CUDA_INCLUDE")?.to_string(),
        py_inc.trim().to_string(),
    ];
    let mut objects = Vec::new();
    for src in [
        "stweaver_allocator.cpp",
        "stweaver_module.cpp",
        "offload_copy.cpp",
    ] {
        let obj = work.join(src.replace(".cpp", ".o"));
        let mut c = Command::new("g++");
        c.arg(format!("-std={std}"))
            .args(["-fPIC", "-O1"])
            .args(GXX_WARNINGS)
            .args([
                "-DTORCH_EXTENSION_NAME=_C",
                "-DTORCH_API_INCLUDE_EXTENSION_H",
            ])
            // As python/stweaver/_build.py: only PyInit_* leaves the module.
            .args(["-fvisibility=hidden", "-fvisibility-inlines-hidden"])
            .arg("-c")
            .arg(root().join("cpp").join(src))
            .arg("-o")
            .arg(&obj);
        for i in &includes {
            c.arg(format!("-I{i}"));
        }
        // torch's own headers are not -Wextra clean: take them as system headers.
        for i in &includes[2..] {
            c.arg(format!("-isystem{i}"));
        }
        run(c).with_context(|| format!("compiling {src} against torch {tv}"))?;
        objects.push(obj);
    }
    let torch_lib = PathBuf::from(get(&env, "TORCH_LIB")?);
    let cuda_lib = PathBuf::from(get(&env, "CUDA_LIB")?);
    let cudart = get(&env, "CUDART_SONAME")?.to_string();
    let so = work.join("_C.so");
    let mut c = Command::new("g++");
    c.arg("-shared")
        .args(&objects)
        .arg(lib)
        .arg("-Wl,--exclude-libs,ALL")
        .arg(format!("-L{}", torch_lib.display()))
        .args([
            "-lc10",
            "-lc10_cuda",
            "-ltorch",
            "-ltorch_cpu",
            "-ltorch_cuda",
            "-ltorch_python",
        ])
        .arg(format!("-L{}", cuda_lib.display()))
        .arg(format!("-l:{cudart}"))
        .args(["-ldl", "-lpthread", "-lm"])
        .arg("-o")
        .arg(&so);
    run(c).with_context(|| format!("linking against torch {tv}"))?;

    // Every undefined symbol must come from a library the extension is loaded with.
    let mut providers: Vec<PathBuf> = [
        "libc10.so",
        "libc10_cuda.so",
        "libtorch.so",
        "libtorch_cpu.so",
        "libtorch_cuda.so",
        "libtorch_python.so",
    ]
    .iter()
    .map(|l| torch_lib.join(l))
    .collect();
    providers.push(cuda_lib.join(&cudart));
    for l in ["libstdc++.so", "libgcc_s.so.1", "libc.so.6", "libm.so.6"] {
        providers.push(gcc_file(l)?);
    }
    // The dynamic loader provides the TLS entry points (__tls_get_addr).
    let loader = Path::new("/lib64/ld-linux-x86-64.so.2");
    if loader.exists() {
        providers.push(loader.to_path_buf());
    }
    let mut defined = HashSet::new();
    for p in &providers {
        let p = fs::canonicalize(p).with_context(|| format!("{}", p.display()))?;
        for (_, name) in dynamic_symbols(&p, true)? {
            defined.insert(name);
        }
    }
    let missing: Vec<String> = dynamic_symbols(&so, false)?
        .into_iter()
        .filter(|(kind, name)| {
            kind == "U"
                && !defined.contains(name)
                && !name.starts_with("Py")
                && !name.starts_with("_Py")
        })
        .map(|(_, n)| n)
        .collect();
    if !missing.is_empty() {
        bail!(
            "torch {tv}: {} undefined symbol(s) no library provides, e.g. {:?}",
            missing.len(),
            &missing[..missing.len().min(10)]
        );
    }
    let exported = dynamic_symbols(&so, true)?;
    let leaked: Vec<&String> = exported
        .iter()
        .map(|(_, n)| n)
        .filter(|n| n.contains("cxxbridge") || n.starts_with("_ZN4core") || n.starts_with("rust_"))
        .collect();
    if !leaked.is_empty() {
        bail!(
            "torch {tv}: the extension exports Rust/cxx symbols, e.g. {:?}",
            &leaked[..leaked.len().min(5)]
        );
    }
    let example = example_build(&work, std, &includes, &objects[0], lib, &env)
        .with_context(|| format!("the native C++ example against torch {tv}"))?;
    Ok(format!(
        "torch {tv} (C++{}, {cudart}): compiled, linked, {} undefined symbols all provided, {} exported; {example}; in {:.1} s",
        &std[3..],
        dynamic_symbols(&so, false)?.len(),
        exported.len(),
        t0.elapsed().as_secs_f64()
    ))
}

/// Compiles examples/cpp/train.cpp (libtorch's C++ API) and links it into an executable
/// with the allocator object and the staticlib: the link line of README.md's "Native C++"
/// section. Not run (no GPU). torch's own dependencies (cuDNN, NCCL...) are not fetched,
/// so undefined symbols inside torch's shared libraries are allowed; ours must resolve.
fn example_build(
    work: &Path,
    std: &str,
    includes: &[String],
    allocator_obj: &Path,
    lib: &Path,
    env: &[(String, String)],
) -> Result<String> {
    let t0 = Instant::now();
    let obj = work.join("train.o");
    let mut c = Command::new("g++");
    c.arg(format!("-std={std}"))
        .arg("-O1")
        .args(GXX_WARNINGS)
        .arg("-c")
        .arg(root().join("examples/cpp/train.cpp"))
        .arg("-o")
        .arg(&obj);
    for i in &includes[..2] {
        c.arg(format!("-I{i}"));
    }
    for i in &includes[2..] {
        c.arg(format!("-isystem{i}"));
    }
    run(c).context("compiling examples/cpp/train.cpp")?;
    let exe = work.join("train");
    let mut c = Command::new("g++");
    c.arg(&obj)
        .arg(allocator_obj)
        .arg(lib)
        .arg(format!("-L{}", get(env, "TORCH_LIB")?))
        .args([
            "-Wl,--no-as-needed",
            "-ltorch",
            "-ltorch_cpu",
            "-ltorch_cuda",
            "-lc10_cuda",
            "-lc10",
            "-Wl,--as-needed",
        ])
        .arg(format!("-L{}", get(env, "CUDA_LIB")?))
        .arg(format!("-l:{}", get(env, "CUDART_SONAME")?))
        .args(["-ldl", "-lpthread", "-lm"])
        .args([
            "-Wl,--allow-shlib-undefined",
            "-Wl,--unresolved-symbols=ignore-in-shared-libs",
        ])
        .arg("-o")
        .arg(&exe);
    let out = c.output().with_context(|| format!("running {c:?}"))?;
    if !out.status.success() {
        bail!(
            "linking examples/cpp/train.cpp failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(format!(
        "examples/cpp/train.cpp compiled and linked in {:.1} s",
        t0.elapsed().as_secs_f64()
    ))
}

pub fn cpp_check(args: &[String]) -> Result<()> {
    let versions: Vec<String> = if args.is_empty() {
        vec!["2.11.0".into(), "latest".into()]
    } else {
        args.to_vec()
    };
    let t0 = Instant::now();
    let lib = build_staticlib(false)?;
    let mut report = Vec::new();
    let mut failed = false;
    for v in &versions {
        match check_one(v, &lib) {
            Ok(line) => report.push(format!("ok    {line}")),
            Err(e) => {
                failed = true;
                report.push(format!("FAIL  torch {v}: {e:#}"));
            }
        }
    }
    for line in &report {
        println!("{line}");
    }
    println!("cpp-check: {:.1} s in total", t0.elapsed().as_secs_f64());
    if failed {
        bail!("cpp-check failed");
    }
    Ok(())
}
