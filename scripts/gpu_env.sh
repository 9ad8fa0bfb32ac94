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
export PY

# Builds the extension (python -m stweaver build) into python/stweaver/, log in $OUT/build.log;
# skipped when the built extension is newer than the carried staticlib (scripts run back to
# back in one call).
gpu_env_build() {
  if [ -n "$(find python/stweaver -maxdepth 1 -name '_C*.so' -newer "$STWEAVER_LIB" 2>/dev/null)" ]; then
    echo "extension already built"
    return 0
  fi
  local t0; t0=$(date +%s)
  if ! "$PY" -m stweaver build > "$OUT/build.log" 2>&1; then
    tail -n 40 "$OUT/build.log"
    echo "extension build failed"
    return 1
  fi
  tail -n 1 "$OUT/build.log"
  echo "build took $(( $(date +%s) - t0 )) s"
}
