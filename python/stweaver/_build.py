"""Building stweaver's torch extension: the C++ allocator (cpp/) linked with the Rust
staticlib of crates/torch-bridge.

Three ways, same flags:

- installed: ``pip install --no-build-isolation .`` (setup.py at the repository root, which
  uses :func:`native_parts` and :func:`_build_flags` from here) puts ``stweaver/_C*.so`` and
  ``stweaver/_build_info.py`` (the torch it was built against, see :func:`build_info_source`
  and ``_abi.py``) into site-packages; :func:`load_extension` then loads that module only;
- ahead of time, in a source checkout: ``cargo xtask build-torch-ext`` (or ``python -m stweaver build``) writes
  ``stweaver/_C*.so`` next to this file, plus ``_C.build.json`` naming the torch it was
  built against;
- just in time: :func:`load_extension` builds with ``torch.utils.cpp_extension.load`` into
  a cache folder when no matching prebuilt module exists.

Neither initialises CUDA: ``TORCH_CUDA_ARCH_LIST`` is set first (``cpp_extension`` queries
the GPU for it otherwise, which initialises CUDA and makes installing the allocator
impossible). The Rust side must be built already (``cargo build --release -p
stweaver-torch``); its location comes from ``STWEAVER_LIB`` / ``STWEAVER_CXXBRIDGE`` /
``STWEAVER_CPP`` or from the repository layout.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass

PKG_DIR = pathlib.Path(__file__).resolve().parent
REPO_DIR = PKG_DIR.parent.parent
SOURCES = ("stweaver_allocator.cpp", "stweaver_module.cpp", "offload_copy.cpp")
DEFAULT_ARCH_LIST = "9.0"


class BuildError(RuntimeError):
    """The extension cannot be built (missing Rust artefacts, headers, compiler...)."""


@dataclass(frozen=True)
class NativeParts:
    staticlib: pathlib.Path
    cxxbridge: pathlib.Path
    cpp_dir: pathlib.Path


def native_parts(env: dict | None = None) -> NativeParts:
    """Where the Rust staticlib, the cxx headers and the C++ sources are."""
    env = os.environ if env is None else env
    lib = pathlib.Path(env.get("STWEAVER_LIB") or REPO_DIR / "target/release/libstweaver_torch.a")
    inc = pathlib.Path(env.get("STWEAVER_CXXBRIDGE") or REPO_DIR / "target/cxxbridge")
    cpp = pathlib.Path(env.get("STWEAVER_CPP") or REPO_DIR / "cpp")
    hint = (
        "build the Rust side first: `cargo build --release -p stweaver-torch` "
        "(or `cargo xtask build-torch-ext`), or point STWEAVER_LIB / STWEAVER_CXXBRIDGE / "
        "STWEAVER_CPP at prebuilt files"
    )
    if not lib.is_file():
        raise BuildError(f"stweaver staticlib not found at {lib}; {hint}")
    if not (inc / "stweaver-torch/src/ffi.rs.h").is_file() or not (inc / "rust/cxx.h").is_file():
        raise BuildError(f"cxx headers not found under {inc}; {hint}")
    for s in SOURCES:
        if not (cpp / s).is_file():
            raise BuildError(f"C++ source {cpp / s} not found; {hint}")
    return NativeParts(lib, inc, cpp)


def _pip_cuda_root() -> pathlib.Path | None:
    """The CUDA headers and cudart of pip's nvidia packages (torch >= 2.11 wheels)."""
    for entry in sys.path:
        for hdr in glob.glob(os.path.join(entry, "nvidia", "cu*", "include", "cuda_runtime_api.h")):
            root = pathlib.Path(hdr).parent.parent
            if (root / "include/crt/host_config.h").is_file():
                return root
    return None


def _build_flags(parts: NativeParts) -> dict:
    import torch
    from torch.utils import cpp_extension as ce

    include = [str(parts.cxxbridge), str(parts.cpp_dir)]
    ldflags = [str(parts.staticlib), "-Wl,--exclude-libs,ALL"]
    if ce.CUDA_HOME is not None:
        # A CUDA toolkit (the GPU machines): cpp_extension adds its headers and -lcudart.
        return {"with_cuda": True, "include": include, "ldflags": ldflags}
    root = _pip_cuda_root()
    if root is None:
        raise BuildError(
            "no CUDA toolkit (CUDA_HOME) and no pip CUDA headers (nvidia-cuda-runtime + "
            "nvidia-cuda-crt, e.g. `pip install 'cuda-toolkit[crt]'`) found"
        )
    libdir = root / "lib"
    cudart = sorted(libdir.glob("libcudart.so.*"))
    if not cudart:
        raise BuildError(f"no libcudart.so.* in {libdir}")
    torch_lib = pathlib.Path(torch.__file__).parent / "lib"
    ldflags += [
        f"-L{torch_lib}",
        "-lc10_cuda",
        "-ltorch_cuda",
        f"-Wl,-rpath,{torch_lib}",
        f"-L{libdir}",
        f"-l:{cudart[0].name}",
        f"-Wl,-rpath,{libdir}",
    ]
    return {"with_cuda": False, "include": include + [str(root / "include")], "ldflags": ldflags}


def build(name: str, build_dir: pathlib.Path, verbose: bool = False):
    """Compiles and links the extension module `name` in `build_dir`; returns the module."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    import torch
    from torch.utils import cpp_extension as ce

    if torch.cuda.is_initialized():
        raise BuildError("CUDA is already initialised; build stweaver before any CUDA use")
    parts = native_parts()
    flags = _build_flags(parts)
    # cpp_extension runs `ninja` from PATH; pip installs it next to this interpreter.
    scripts = sysconfig.get_path("scripts")
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    build_dir.mkdir(parents=True, exist_ok=True)  # load() does not create it
    # ninja relinks only when an object changes: a rebuilt staticlib (an ldflag to it) would
    # be ignored. Remove the old module whenever the staticlib differs from the last link.
    st = parts.staticlib.stat()
    lib_id = f"{parts.staticlib.resolve()} {st.st_size} {st.st_mtime_ns}\n"
    stamp = build_dir / "staticlib.stamp"
    if not stamp.is_file() or stamp.read_text() != lib_id:
        for old in build_dir.glob(f"{name}*.so"):
            old.unlink()
        stamp.write_text(lib_id)
    module = ce.load(
        name=name,
        sources=[str(parts.cpp_dir / s) for s in SOURCES],
        extra_include_paths=flags["include"],
        # Hidden by default: only PyInit_* is exported; the staticlib's symbols are hidden
        # by --exclude-libs, cxx's templates instantiated in our objects by -fvisibility.
        extra_cflags=["-O2", "-fvisibility=hidden", "-fvisibility-inlines-hidden"],
        extra_ldflags=flags["ldflags"],
        with_cuda=flags["with_cuda"],
        build_directory=str(build_dir),
        verbose=verbose,
    )
    if torch.cuda.is_initialized():  # pragma: no cover - would be a torch regression
        raise BuildError("building the extension initialised CUDA; set TORCH_CUDA_ARCH_LIST")
    return module


def _stamp() -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    }


def build_ahead_of_time(out_dir: pathlib.Path = PKG_DIR, verbose: bool = False) -> pathlib.Path:
    """Builds ``_C`` and installs it (with its stamp) into `out_dir`; returns the .so path."""
    import torch

    started = time.monotonic()
    build_dir = REPO_DIR / "target" / "torch-ext" / torch.__version__.replace("+", "_")
    build(name="_C", build_dir=build_dir, verbose=verbose)
    built = sorted(build_dir.glob("_C*.so"))
    if not built:
        raise BuildError(f"cpp_extension produced no _C*.so in {build_dir}")
    dest = out_dir / built[0].name
    shutil.copy2(built[0], dest)
    stamp = _stamp() | {"seconds": round(time.monotonic() - started, 1)}
    (out_dir / "_C.build.json").write_text(json.dumps(stamp, indent=1) + "\n")
    return dest


def prebuilt_matches(pkg_dir: pathlib.Path = PKG_DIR) -> bool:
    """Whether a prebuilt ``_C`` exists for the torch imported now."""
    stamp_file = pkg_dir / "_C.build.json"
    if not stamp_file.is_file() or not list(pkg_dir.glob("_C*.so")):
        return False
    try:
        stamp = json.loads(stamp_file.read_text())
    except (OSError, ValueError):
        return False
    now = _stamp()
    return all(stamp.get(k) == now[k] for k in ("torch", "python", "cxx11_abi"))


def build_info_source() -> str:
    """The text of ``_build_info.py``, written by setup.py next to the installed module."""
    stamp = _stamp()
    lines = [
        '"""Written by setup.py at build time: the torch this stweaver was built against."""',
        "",
        f"TORCH_VERSION = {stamp['torch']!r}",
        f"TORCH_CUDA = {stamp['cuda']!r}",
        f"PYTHON = {stamp['python']!r}",
        f"CXX11_ABI = {stamp['cxx11_abi']!r}",
        "",
    ]
    return "\n".join(lines)


def load_extension(verbose: bool = False):
    """The extension module: an installed stweaver's own (checked against this torch), else
    in a source checkout the prebuilt one if it matches this torch, else a JIT build (cached
    under ``$STWEAVER_BUILD_DIR`` or ``~/.cache/stweaver/ext``)."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    import torch  # noqa: F401  (the extension links against it)

    from . import _abi

    built = _abi.built_torch_version()
    if built is not None:
        # Installed with pip: no sources to rebuild from; the guard names the fix.
        _abi.check(built, torch.__version__)
        from . import _C  # type: ignore[attr-defined]

        return _C
    if prebuilt_matches():
        from . import _C  # type: ignore[attr-defined]

        return _C
    base = pathlib.Path(
        os.environ.get("STWEAVER_BUILD_DIR") or pathlib.Path.home() / ".cache/stweaver/ext"
    )
    tag = torch.__version__.replace("+", "_") + f"-py{sys.version_info[0]}{sys.version_info[1]}"
    return build(name="stweaver_C", build_dir=base / tag, verbose=verbose)
