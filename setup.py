"""The build behind pyproject.toml (why setuptools: see the comment there).

`pip install --no-build-isolation .` / `pip wheel --no-build-isolation . -w dist`:

1. build_ext runs cargo: `cargo build --release -p stweaver-torch` (the staticlib and the
   cxx bridge header under target/cxxbridge) and `cargo build --release -p
   stweaver-planner --bin stweaver` (the CLI);
2. compiles cpp/ with torch's BuildExtension against the torch imported here and links
   the staticlib into `stweaver._C` (flags shared with the JIT path:
   python/stweaver/_build.py), with `TORCH_CUDA_ARCH_LIST` set so that nothing
   initialises CUDA;
3. writes `stweaver/_build_info.py` (the torch it was built against: the import guard in
   python/stweaver/_abi.py compares it with the torch at run time);
4. ships the `stweaver` binary as a script of the wheel, so it lands on PATH (bin/).

`STWEAVER_PREBUILT=<dir>` replaces step 1 (no cargo, no Rust needed): the Rust artefacts are
taken from <dir> (absolute, or relative to this file's folder), in the layout of the carry
`cargo xtask gpu-test` packs for GPU machines (.carry/):

    <dir>/libstweaver_torch.a        the staticlib (cargo build --release -p stweaver-torch)
    <dir>/cxxbridge/rust/cxx.h       the cxx headers (target/cxxbridge, symlinks resolved)
    <dir>/cxxbridge/stweaver-torch/src/ffi.rs.h
    <dir>/cli/stweaver               the release CLI (bin/stweaver, the bench carries' place,
                                     is accepted too)

A missing one stops the build with its path. Without the variable, cargo builds them.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

# Before torch.utils.cpp_extension looks at it: otherwise it queries the GPU for its
# architectures, which initialises CUDA (and fails on a machine without one).
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

from setuptools import setup  # noqa: E402
from setuptools.dist import Distribution  # noqa: E402

# setuptools' own build_scripts (it has no public module of its own).
build_scripts = Distribution().get_command_class("build_scripts")

ROOT = pathlib.Path(__file__).resolve().parent

try:
    import torch  # noqa: E402
    from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402
except ImportError as e:  # pragma: no cover - the message is the point
    sys.exit(
        f"stweaver: building needs torch in this environment ({e}). Install torch first, then "
        "`pip install --no-build-isolation .` (without --no-build-isolation pip would build "
        "against another torch in a temporary environment)."
    )


def _load_build_helpers():
    """python/stweaver/_build.py, without importing the package (the JIT path's flags)."""
    spec = importlib.util.spec_from_file_location(
        "_stweaver_build_helpers", ROOT / "python" / "stweaver" / "_build.py"
    )
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


helpers = _load_build_helpers()


def target_dir() -> pathlib.Path:
    d = os.environ.get("CARGO_TARGET_DIR")
    if not d:
        return ROOT / "target"
    d = pathlib.Path(d)
    return d if d.is_absolute() else ROOT / d


def prebuilt_dir() -> pathlib.Path | None:
    """`STWEAVER_PREBUILT` (see the top): Rust artefacts built elsewhere, no cargo here."""
    d = os.environ.get("STWEAVER_PREBUILT")
    if not d:
        return None
    d = pathlib.Path(d)
    return (d if d.is_absolute() else ROOT / d).resolve()


def _prebuilt_paths(d: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """The staticlib, the cxx header folder and the CLI under `d`; exits naming what is
    missing."""
    lib, inc = d / "libstweaver_torch.a", d / "cxxbridge"
    clis = [d / "cli" / "stweaver", d / "bin" / "stweaver"]
    cli = next((c for c in clis if c.is_file()), clis[0])
    missing = [
        str(p)
        for p in (lib, inc / "rust" / "cxx.h", inc / "stweaver-torch" / "src" / "ffi.rs.h")
        if not p.is_file()
    ]
    if not cli.is_file():
        missing.append(f"{clis[0]} (or {clis[1]})")
    if missing:
        raise SystemExit(
            f"stweaver: STWEAVER_PREBUILT={d} lacks " + ", ".join(missing) + ". It must hold "
            "the carry layout of `cargo xtask gpu-test` (.carry/: libstweaver_torch.a, "
            "cxxbridge/, cli/stweaver); unset it to build the Rust side with cargo."
        )
    return lib, inc, cli


PREBUILT = prebuilt_dir()
if PREBUILT is not None:
    STATICLIB, CXXBRIDGE, CLI = _prebuilt_paths(PREBUILT)
    print(f"stweaver: STWEAVER_PREBUILT={PREBUILT}: no cargo build", flush=True)
else:
    STATICLIB = target_dir() / "release" / "libstweaver_torch.a"
    CXXBRIDGE = target_dir() / "cxxbridge"
    CLI = target_dir() / "release" / "stweaver"


def _cargo() -> str:
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if cargo is None:
        home = pathlib.Path(os.environ.get("CARGO_HOME", pathlib.Path.home() / ".cargo"))
        if (home / "bin" / "cargo").is_file():
            cargo = str(home / "bin" / "cargo")
    if cargo is None:
        raise SystemExit(
            "stweaver: building from source needs Rust's cargo (https://rustup.rs), which is "
            "not on PATH. A wheel built elsewhere (`pip wheel --no-build-isolation . -w dist`) "
            "installs without Rust."
        )
    return cargo


_cargo_done = False


def cargo_build() -> None:
    """The staticlib, the cxx header and the CLI, in release mode (once per build)."""
    global _cargo_done
    if _cargo_done or PREBUILT is not None:  # prebuilt: checked when this file loaded
        return
    cargo = _cargo()
    for args in (
        ["build", "--release", "-p", "stweaver-torch"],
        ["build", "--release", "-p", "stweaver-planner", "--bin", "stweaver"],
    ):
        print(f"stweaver: $ cargo {' '.join(args)}", flush=True)
        subprocess.run([cargo, *args], cwd=ROOT, check=True)
    for p in (STATICLIB, CLI, CXXBRIDGE / "stweaver-torch" / "src" / "ffi.rs.h"):
        if not p.exists():
            raise SystemExit(f"stweaver: cargo did not produce {p}")
    _cargo_done = True


def _relocatable_ldflags(flags: list[str]) -> list[str]:
    """Rewrites absolute rpaths into site-packages as `$ORIGIN/..`-relative ones: the wheel
    is installed next to torch (and pip's nvidia packages), wherever that is."""
    site = pathlib.Path(torch.__file__).resolve().parent.parent
    out = []
    for f in flags:
        if f.startswith("-Wl,-rpath,"):
            path = pathlib.Path(f[len("-Wl,-rpath,"):]).resolve()
            try:
                rel = path.relative_to(site)
            except ValueError:
                out.append(f)
                continue
            out.append(f"-Wl,-rpath,$ORIGIN/../{rel.as_posix()}")
        else:
            out.append(f)
    return out


class StweaverBuildExt(BuildExtension):
    """cargo first, then torch's BuildExtension, then the build-info module."""

    def run(self):
        if torch.cuda.is_initialized():  # pragma: no cover - would be a torch regression
            raise SystemExit("stweaver: CUDA got initialised before the build; set TORCH_CUDA_ARCH_LIST")
        cargo_build()
        # torch's ninja build needs `ninja` on PATH; pip installs it next to this interpreter.
        scripts = sysconfig.get_path("scripts")
        if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        parts = helpers.native_parts(
            {
                "STWEAVER_LIB": str(STATICLIB),
                "STWEAVER_CXXBRIDGE": str(CXXBRIDGE),
                "STWEAVER_CPP": str(ROOT / "cpp"),
            }
        )
        flags = helpers._build_flags(parts)
        for ext in self.extensions:
            ext.include_dirs = [*flags["include"], *ext.include_dirs]
            ext.extra_link_args = [*_relocatable_ldflags(flags["ldflags"]), "-Wl,--strip-debug"]
            if flags["with_cuda"]:
                # A CUDA toolkit (the GPU machines): its headers and cudart, as CUDAExtension.
                from torch.utils import cpp_extension as ce

                ext.include_dirs += ce.include_paths(device_type="cuda")
                ext.library_dirs += ce.library_paths(device_type="cuda")
                ext.libraries += ["cudart", "c10_cuda", "torch_cuda"]
        super().run()
        if torch.cuda.is_initialized():  # pragma: no cover
            raise SystemExit("stweaver: building the extension initialised CUDA")
        info = pathlib.Path(self.build_lib) / "stweaver" / "_build_info.py"
        info.parent.mkdir(parents=True, exist_ok=True)
        info.write_text(helpers.build_info_source())
        if self.inplace:
            # `setup.py build_ext --inplace`: next to the sources, as the wheel has it.
            shutil.copy2(info, ROOT / "python" / "stweaver" / "_build_info.py")


class StweaverBuildScripts(build_scripts):
    """The `stweaver` CLI is a native executable: copied as is (setuptools' build_scripts
    reads scripts as text to rewrite their `#!python` line)."""

    def run(self):
        cargo_build()
        out = pathlib.Path(self.build_dir)
        out.mkdir(parents=True, exist_ok=True)
        dest = out / "stweaver"
        shutil.copy2(CLI, dest)
        # Best effort: a smaller wheel; a missing `strip` only costs size.
        if shutil.which("strip"):
            subprocess.run(["strip", "--strip-debug", str(dest)], check=False)
        dest.chmod(0o755)


def _torch_requirement() -> str:
    # `torch==2.11.0` also matches local versions (2.11.0+cu130): the public version is what
    # the C++ ABI follows; the import guard checks the rest.
    return f"torch=={torch.__version__.split('+')[0]}"


ext = CppExtension(
    name="stweaver._C",
    sources=["cpp/stweaver_allocator.cpp", "cpp/stweaver_module.cpp", "cpp/offload_copy.cpp"],
    # Hidden by default: only PyInit_* is exported; the staticlib's symbols are hidden by
    # --exclude-libs, cxx's templates instantiated in our objects by -fvisibility.
    extra_compile_args=["-O2", "-fvisibility=hidden", "-fvisibility-inlines-hidden"],
    # A relink when the staticlib, the bridge header or torch changes (setuptools compares
    # these files' times with the built module's).
    depends=[
        os.path.relpath(STATICLIB, ROOT),
        "cpp/stweaver_allocator.h",
        "cpp/offload_copy.h",
        str(pathlib.Path(torch.__file__).parent / "version.py"),
    ],
)

setup(
    install_requires=[_torch_requirement()],
    ext_modules=[ext],
    # The cargo-built CLI; listed so that setuptools runs build_scripts / install_scripts
    # (ours builds it first and copies it as a binary): the wheel's `stweaver` script.
    scripts=[os.path.relpath(CLI, ROOT)],
    cmdclass={
        "build_ext": StweaverBuildExt.with_options(use_ninja=True),
        "build_scripts": StweaverBuildScripts,
    },
)
