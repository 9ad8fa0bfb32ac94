#!/usr/bin/env bash
# The GPU-sharing benchmark (issue #17 item 3), as one command on a GPU machine without Rust.
# Prepare the carry with `cargo xtask gpu-test` or `gpu-bench` (staticlib and cxx headers),
# then on the GPU machine:
#
#   OUT=/tmp/sb bash scripts/share_bench.sh [CARRY_DIR] [share_bench.py ARGS...] 2>&1 | tee /tmp/sb.log
#
# 1. builds the torch extension from the carried staticlib (skipped when already built;
#    TORCH_CUDA_ARCH_LIST set, so the build never initialises CUDA);
# 2. runs python/bench/share_bench.py (its docstring says what it measures): pause/resume speed
#    of 1, 10 and 40 GiB against PyTorch's empty_cache + reallocation, a ctypes cuMemUnmap /
#    cuMemMap loop and torch_memory_saver (third_party/ wheel, installed into a temporary
#    folder when it does not import), then two trainers taking turns on the GPU. It writes
#    $OUT/share_bench.json and $OUT/share_bench.txt and prints its table last (about 7.5 min
#    with the defaults; --deadline-s bounds it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/stweaver-share-out}"
source scripts/gpu_env.sh "${1:-.carry}" || exit 1
shift || true
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
free -g | head -2 || true
echo "== build the extension"
gpu_env_build || exit 1
echo "== share benchmark"
"$PY" python/bench/share_bench.py --out "$OUT" "$@"
