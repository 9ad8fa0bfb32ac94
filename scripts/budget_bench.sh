#!/usr/bin/env bash
# The budget benchmark (issue #16), as one command on a GPU machine without Rust. Prepare the
# carry with `cargo xtask gpu-bench` (staticlib, cxx headers and the stweaver CLI in
# .bench-carry), then on the GPU machine:
#
#   set -o pipefail; bash scripts/budget_bench.sh [CARRY_DIR] [budget_bench.py ARGS...] 2>&1 | tee $OUT/log
#
# 1. builds the torch extension from the carried staticlib (TORCH_CUDA_ARCH_LIST set, so the
#    build never initialises CUDA);
# 2. runs python/bench/budget_bench.py with the carried CLI (the stweaver_plan row's planner);
#    it writes $OUT/budget_bench.json and prints its table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/stweaver-budget-out}"
source scripts/gpu_env.sh "${1:-.bench-carry}" || exit 1
shift || true
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "== build the extension"
gpu_env_build || exit 1
echo "== budget benchmark"
# The release CLI: bin/ in a gpu-bench carry, cli/ in a gpu-test carry.
CLI="$PWD/$CARRY/bin/stweaver"
[ -x "$CLI" ] || CLI="$PWD/$CARRY/cli/stweaver"
"$PY" python/bench/budget_bench.py --out "$OUT" --stweaver-bin "$CLI" "$@"
