#!/usr/bin/env bash
# The whole GPU check, as one command on a GPU machine without Rust (see `cargo xtask gpu-test`,
# which prepares CARRY_DIR here and prints the exact device command):
#
#   bash scripts/gpu_test.sh [CARRY_DIR]      (default .carry)
#
# 1. runs the carried Rust test binaries (crates/cuda: real cuMemMap round trip, events);
# 2. the pip path without Rust (gpu_env_wheel in scripts/gpu_env.sh): `pip wheel
#    --no-build-isolation` against this machine's torch from the carried staticlib, cxx
#    headers and CLI (STWEAVER_PREBUILT, no cargo; TORCH_CUDA_ARCH_LIST set, so CUDA is not
#    initialised), installed into a fresh venv (--system-site-packages: this torch) with
#    `pip install --no-index`; checks the CLI on PATH and `import stweaver` from the venv;
# 3. runs the GPU pytest suite (python/tests/gpu) under stweaver with that venv's python,
#    from outside the checkout (STWEAVER_TEST_INSTALLED=1: python/ is not on sys.path).
#    Only when step 2 failed: the extension built in place (python -m stweaver build) and
#    the suite from the checkout (PYTHONPATH=python), said so in the log and the summary;
# 4. builds and runs the native C++ example (examples/cpp/train.cpp, scripts/cpp_example.sh):
#    native vs stweaver peak reserved;
# 5. prints the summary table last (with `wheel install:` and `GPU pytest from:` lines).
# Logs and artefacts go to $OUT (or /tmp/stweaver-gpu-out); the wheel's in $OUT/wheel.
# GPU_PYTEST_K: a pytest -k expression (e.g. "not learns_a_class", to fit one device call).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh "${1:-.carry}" || exit 1
status=0

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])'

echo "== rust tests (carried binaries)"
for t in "$CARRY"/bin/*; do
  [ -x "$t" ] || continue
  echo "-- $t"
  if ! "$t" --test-threads=1 --nocapture 2>&1 | tee -a "$OUT/rust_tests.log"; then status=1; fi
done

echo "== rust timing (bridge runtime on CUDA, no torch)"
for t in "$CARRY"/bin/cuda-*; do
  [ -x "$t" ] && "$t" --ignored --nocapture bench_ 2>&1 | grep -E "ns per|test result" | tee -a "$OUT/rust_tests.log"
done

echo "== wheel: pip wheel from the carried Rust artefacts (no cargo), installed into a fresh venv"
REPO="$PWD"
if gpu_env_wheel; then
  PYTEST_FROM="installed wheel ($WHEEL_VENV)"
  echo "== GPU pytest (from the installed wheel: $WHEEL_PY, in $WHEEL_OUTSIDE, python/ not on sys.path)"
  (cd "$WHEEL_OUTSIDE" && _wheel_env env STWEAVER_TEST_INSTALLED=1 "$WHEEL_PY" -m pytest \
    "$REPO/python/tests/gpu" --rootdir "$REPO" -v -p no:cacheprovider ${GPU_PYTEST_K:+-k "$GPU_PYTEST_K"}) \
    2>&1 | tee "$OUT/pytest.log" | grep -vE '^\s*$' | tail -n 150
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  status=1
  PYTEST_FROM="the checkout (FALLBACK: in-place extension, PYTHONPATH=python; the wheel failed)"
  echo "== build the extension in place (FALLBACK: the wheel step failed)"
  gpu_env_build || status=1
  ls -la python/stweaver/_C*.so 2>/dev/null || { echo "extension not built"; status=1; }
  echo "== GPU pytest (FALLBACK: from the checkout, PYTHONPATH=python)"
  "$PY" -m pytest python/tests/gpu -v -p no:cacheprovider ${GPU_PYTEST_K:+-k "$GPU_PYTEST_K"} \
    2>&1 | tee "$OUT/pytest.log" | grep -vE '^\s*$' | tail -n 150
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

echo "== native C++ example (libtorch, scripts/cpp_example.sh)"
if ! bash scripts/cpp_example.sh "$CARRY" "$OUT/cpp-example" 2>&1 | tee "$OUT/cpp_example.log"; then
  status=1
fi

echo "== summary"
cat "$OUT/summary.txt" 2>/dev/null || echo "(no summary written)"
grep -E '^cpp-example: (peak|same|FAIL)' "$OUT/cpp_example.log" 2>/dev/null || true
echo "wheel install: $WHEEL_STATUS${WHEEL_FILE:+ ($(basename "$WHEEL_FILE"))}"
echo "GPU pytest from: $PYTEST_FROM"
exit $status
