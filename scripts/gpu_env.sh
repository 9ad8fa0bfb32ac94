# Sourced by the GPU scripts (gpu_test.sh, gpu_bench.sh, budget_bench.sh, and by hand for one
# test: `source scripts/gpu_env.sh .carry`): the environment that builds and loads the torch
# extension from a carried staticlib on a GPU machine without Rust.
#
# CARRY (first argument, default .carry): the folder `cargo xtask gpu-test` / `gpu-bench`
# prepares. When only CARRY.tar.xz came (the device tool carries at most 64 MiB, and the
# uncompressed carry plus the repository is more), it is unpacked here first.
# Sets: CARRY, OUT (default /tmp/stweaver-gpu-out), PY, STWEAVER_LIB, STWEAVER_CXXBRIDGE,
# PYTHONPATH, TORCH_CUDA_ARCH_LIST (9.0 unless set: without it the extension build initialises
# CUDA, and the allocator can no longer be installed in that process).
CARRY="${1:-${CARRY:-.carry}}"
CARRY="${CARRY%/}"
if [ -f "$CARRY.tar.xz" ] && [ "$CARRY.tar.xz" -nt "$CARRY/.unpacked" ]; then
  # A new pack (a warm machine keeps the last unpacked folder and the extension built from
  # it): unpack afresh, and drop the extension so that it is linked with the new staticlib.
  echo "gpu_env: unpacking $CARRY.tar.xz"
  rm -rf "$CARRY" python/stweaver/_C*.so
  tar -xJf "$CARRY.tar.xz" && touch "$CARRY/.unpacked" \
    || { echo "gpu_env: cannot unpack $CARRY.tar.xz" >&2; return 1 2>/dev/null || exit 1; }
fi
if [ ! -f "$CARRY/libstweaver_torch.a" ]; then
  echo "gpu_env: no staticlib at $CARRY/libstweaver_torch.a (cargo xtask gpu-test or gpu-bench prepares it)" >&2
  return 1 2>/dev/null || exit 1
fi
OUT="${OUT:-/tmp/stweaver-gpu-out}"
mkdir -p "$OUT"
export CARRY OUT PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export STWEAVER_LIB="$PWD/$CARRY/libstweaver_torch.a"
export STWEAVER_CXXBRIDGE="$PWD/$CARRY/cxxbridge"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
# An absolute path: gpu_env_wheel runs $PY with the new venv's bin/ first on PATH, where a bare
# `python3` would be the venv's own interpreter (which does not see this one's torch when this
# one is itself a venv).
PY_ABS=$(command -v "$PY") && PY="$PY_ABS"
unset PY_ABS
export PY

# Builds the extension (python -m stweaver build) into python/stweaver/, log in $OUT/build.log;
# skipped when the built extension is newer than the carried staticlib and every C++ source
# (scripts run back to back in one call; a warm machine keeps the last build).
gpu_env_build() {
  local so src stale=""
  so=$(find python/stweaver -maxdepth 1 -name '_C*.so' -newer "$STWEAVER_LIB" 2>/dev/null | head -n 1)
  if [ -n "$so" ]; then
    for src in cpp/*.cpp cpp/*.h; do
      [ "$src" -nt "$so" ] && stale="$src"
    done
  fi
  if [ -n "$so" ] && [ -z "$stale" ]; then
    echo "extension already built"
    return 0
  fi
  [ -n "$stale" ] && echo "extension older than $stale: building again"
  local t0; t0=$(date +%s)
  if ! "$PY" -m stweaver build > "$OUT/build.log" 2>&1; then
    tail -n 40 "$OUT/build.log"
    echo "extension build failed"
    return 1
  fi
  tail -n 1 "$OUT/build.log"
  echo "build took $(( $(date +%s) - t0 )) s"
}

# The pip install path without Rust: builds a wheel from the carried Rust artefacts
# (setup.py's STWEAVER_PREBUILT=$CARRY: no cargo) against this machine's torch, installs it
# into a fresh virtual environment that sees that torch, and checks the installed package:
# the `stweaver` CLI on the venv's PATH, `import stweaver` from the venv's site-packages
# (not the checkout's python/), its extension loaded without initialising CUDA.
# The wheel is built from a copy of the package sources (setup.py, pyproject.toml, README.md,
# cpp/, python/stweaver/) in $WHEEL_WORK/src: no stale build/ of an earlier carry, nothing
# written into the checkout. setuptools >= 64 with `wheel` (or setuptools >= 70.1) must be
# importable there; when the machine's Python has neither, the wheels `cargo xtask gpu-test`
# carries in $CARRY/pywheels are installed into the venv (offline; STWEAVER_WHEEL_CARRIED=1
# installs them even when it has).
# Sets WHEEL_STATUS ("ok" or "failed: <step>"), WHEEL_FILE, WHEEL_VENV, WHEEL_PY (the venv's
# python), WHEEL_PATH (PATH with the venv's bin/ first), WHEEL_PYTHONPATH (PYTHONPATH without
# the checkout's python/), WHEEL_OUTSIDE (a working directory outside the checkout).
# Log: $WHEEL_WORK/wheel.log (WHEEL_WORK defaults to $OUT/wheel). Returns 1 on failure.
gpu_env_wheel() {
  local work="${WHEEL_WORK:-$OUT/wheel}" repo="$PWD" t0 log site torch_here torch_there entry
  t0=$(date +%s)
  log="$work/wheel.log"
  WHEEL_STATUS="failed: setup"
  WHEEL_FILE=""
  WHEEL_VENV="$work/venv"
  WHEEL_PY="$WHEEL_VENV/bin/python"
  WHEEL_OUTSIDE="$work/outside"
  WHEEL_PATH="$WHEEL_VENV/bin:$PATH"
  WHEEL_PYTHONPATH=""
  local IFS_save="$IFS"; IFS=:
  for entry in ${PYTHONPATH:-}; do
    [ -n "$entry" ] && [ "$(realpath -m "$entry")" != "$(realpath -m "$repo/python")" ] \
      && WHEEL_PYTHONPATH="${WHEEL_PYTHONPATH:+$WHEEL_PYTHONPATH:}$entry"
  done
  IFS="$IFS_save"
  export WHEEL_STATUS WHEEL_FILE WHEEL_VENV WHEEL_PY WHEEL_OUTSIDE WHEEL_PATH WHEEL_PYTHONPATH
  rm -rf "$work" && mkdir -p "$work/dist" "$work/src" "$WHEEL_OUTSIDE" || return 1
  : > "$log"
  _wheel_fail() {
    WHEEL_STATUS="failed: $1"
    echo "wheel: FAILED at $1 (log: $log)"
    tail -n 30 "$log" | sed 's/^/  | /'
    return 1
  }
  # Everything below runs with the checkout's python/ off PYTHONPATH.
  _wheel_env() {
    if [ -n "$WHEEL_PYTHONPATH" ]; then
      env PYTHONPATH="$WHEEL_PYTHONPATH" PATH="$WHEEL_PATH" "$@"
    else
      env -u PYTHONPATH PATH="$WHEEL_PATH" "$@"
    fi
  }

  # 1. The venv: --system-site-packages sees the machine's torch (and pytest, ninja). With
  #    pip from ensurepip, else without (the machine's pip, seen through the system site).
  echo "wheel: venv $WHEEL_VENV (--system-site-packages, from $PY)"
  if ! "$PY" -m venv --system-site-packages "$WHEEL_VENV" >> "$log" 2>&1; then
    rm -rf "$WHEEL_VENV"
    "$PY" -m venv --system-site-packages --without-pip "$WHEEL_VENV" >> "$log" 2>&1 \
      || { _wheel_fail "venv"; return 1; }
  fi
  # $PY may itself be a venv, whose packages --system-site-packages does not see: a .pth in
  # the new venv adds $PY's site directories (after the venv's own; duplicates are skipped).
  site=$(_wheel_env "$WHEEL_PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
    || { _wheel_fail "venv site-packages"; return 1; }
  _wheel_env "$PY" -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
    > "$site/stweaver-gpu-test-base.pth" 2>> "$log" || { _wheel_fail "base site-packages"; return 1; }
  local which_torch='import os, torch; print(torch.__version__, os.path.realpath(torch.__file__))'
  torch_here=$(_wheel_env "$PY" -c "$which_torch" 2>> "$log")
  torch_there=$(_wheel_env "$WHEEL_PY" -c "$which_torch" 2>> "$log")
  if [ -z "$torch_there" ] || [ "$torch_here" != "$torch_there" ]; then
    echo "torch of $PY: $torch_here; of the venv: ${torch_there:-none}" >> "$log"
    _wheel_fail "venv torch"; return 1
  fi
  _wheel_env "$WHEEL_PY" -m pip --version >> "$log" 2>&1 || { _wheel_fail "venv pip"; return 1; }

  # 2. Build requirements (pyproject.toml [build-system]: setuptools>=64, wheel, torch; with
  #    --no-build-isolation pip installs none of them): the carried wheels when missing.
  local need='import setuptools, sys
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
assert v >= (64, 0), "setuptools " + setuptools.__version__ + " < 64"
if v < (70, 1): import wheel'
  if [ "${STWEAVER_WHEEL_CARRIED:-0}" = 1 ] || ! _wheel_env "$WHEEL_PY" -c "$need" >> "$log" 2>&1; then
    if ! ls "$CARRY"/pywheels/*.whl > /dev/null 2>&1; then
      echo "no usable setuptools/wheel here and none carried in $CARRY/pywheels" >> "$log"
      _wheel_fail "build requirements"; return 1
    fi
    echo "wheel: installing the carried $(cd "$CARRY/pywheels" && echo *.whl) into the venv"
    _wheel_env "$WHEEL_PY" -m pip install --disable-pip-version-check --no-index --no-deps \
      "$CARRY"/pywheels/*.whl >> "$log" 2>&1 || { _wheel_fail "carried build requirements"; return 1; }
    _wheel_env "$WHEEL_PY" -c "$need" >> "$log" 2>&1 || { _wheel_fail "build requirements"; return 1; }
  fi
  echo "wheel: build with $(_wheel_env "$WHEEL_PY" -c 'import setuptools; print("setuptools", setuptools.__version__)')"

  # 3. The wheel, from the carried staticlib, cxx headers and CLI (no cargo).
  cp -r setup.py pyproject.toml README.md cpp "$work/src/" && mkdir -p "$work/src/python" \
    && cp -r python/stweaver "$work/src/python/" || { _wheel_fail "source copy"; return 1; }
  for entry in MANIFEST.in setup.cfg LICENSE*; do [ -e "$entry" ] && cp -r "$entry" "$work/src/"; done
  rm -rf "$work/src/python/stweaver/"{_C*.so,_C.build.json,_build_info.py,__pycache__}
  # ninja (torch's build) may sit next to $PY rather than on PATH.
  local scripts; scripts=$(_wheel_env "$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null)
  echo "wheel: pip wheel --no-build-isolation --no-deps (STWEAVER_PREBUILT=$repo/$CARRY, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
  if ! (cd "$work/src" && WHEEL_PATH="$WHEEL_PATH${scripts:+:$scripts}" _wheel_env \
        STWEAVER_PREBUILT="$repo/$CARRY" TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" \
        "$WHEEL_PY" -m pip wheel --disable-pip-version-check --no-index --no-build-isolation \
        --no-deps . -w "$work/dist") >> "$log" 2>&1; then
    _wheel_fail "pip wheel"; return 1
  fi
  WHEEL_FILE=$(ls "$work"/dist/stweaver-*.whl 2>/dev/null | head -n 1)
  [ -n "$WHEEL_FILE" ] || { _wheel_fail "pip wheel (no wheel written)"; return 1; }
  echo "wheel: built $(basename "$WHEEL_FILE") ($(du -h "$WHEEL_FILE" | cut -f1)) in $(( $(date +%s) - t0 )) s"

  # 4. Install it (offline, torch is already there) and check what got installed.
  _wheel_env "$WHEEL_PY" -m pip install --disable-pip-version-check --no-index --no-deps \
    "$WHEEL_FILE" >> "$log" 2>&1 || { _wheel_fail "pip install"; return 1; }
  local cli
  cli=$(cd "$WHEEL_OUTSIDE" && _wheel_env sh -c 'command -v stweaver')
  if [ "$cli" != "$WHEEL_VENV/bin/stweaver" ]; then
    echo "stweaver on PATH: ${cli:-none}, expected $WHEEL_VENV/bin/stweaver" >> "$log"
    _wheel_fail "stweaver CLI on PATH"; return 1
  fi
  (cd "$WHEEL_OUTSIDE" && _wheel_env stweaver --help) 2>&1 | tee -a "$log" | grep compare > /dev/null \
    || { _wheel_fail "stweaver --help"; return 1; }
  echo "wheel: stweaver CLI: $cli"
  local probe='import os, sys, sysconfig, torch, stweaver
from stweaver import _build
here = os.path.realpath(os.path.dirname(stweaver.__file__))
sites = {os.path.realpath(sysconfig.get_path(k)) for k in ("purelib", "platlib")}
assert os.path.dirname(here) in sites, f"stweaver imported from {here}, not the venv ({sites})"
ext = _build.load_extension()
assert os.path.dirname(os.path.realpath(ext.__file__)) == here, ext.__file__
assert not torch.cuda.is_initialized(), "loading stweaver initialised CUDA"
print("wheel: import stweaver:", here, "| extension built for torch", ext.torch_version, "| torch", torch.__version__)'
  (cd "$WHEEL_OUTSIDE" && _wheel_env "$WHEEL_PY" -c "$probe") 2>&1 | tee -a "$log" | grep '^wheel: ' \
    || { _wheel_fail "import stweaver from the venv"; return 1; }
  WHEEL_STATUS="ok"
  echo "wheel: ok in $(( $(date +%s) - t0 )) s"
}
