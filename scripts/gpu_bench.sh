#!/usr/bin/env bash
# The GPU benchmark, as one command on a GPU machine without Rust (see `cargo xtask gpu-bench`,
# which prepares CARRY_DIR here and prints the exact device command):
#
#   set -o pipefail; bash scripts/gpu_bench.sh [CARRY_DIR] [HARNESS ARGS...] 2>&1 | tee $OUT/log
#
# 1. builds the torch extension ahead of time from the carried staticlib + cxx headers, the
#    way scripts/gpu_test.sh does (`python -m stweaver build`, TORCH_CUDA_ARCH_LIST set);
# 2. runs python/bench/gpu_bench.py with the carried `stweaver` CLI as the planner, inside a
#    budget (GPU_BENCH_BUDGET_S, default 500 s, build included): it stops starting runs when
#    the budget would be exceeded and reports what it skipped;
# 3. the harness writes $OUT/gpu_bench.json and $OUT/table.txt and prints the table last.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET="${GPU_BENCH_BUDGET_S:-500}"
OUT="${OUT:-/tmp/stweaver-bench-out}"
source scripts/gpu_env.sh "${1:-.bench-carry}" || exit 1
shift || true
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
nproc
grep -m1 "model name" /proc/cpuinfo || true
"$PY" -c 'import torch, transformers, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "python", sys.version.split()[0])'

echo "== build the extension"
gpu_env_build || exit 1
"$CARRY/bin/stweaver" --version 2>/dev/null || true

echo "== benchmark"
LEFT=$(( BUDGET - ($(date +%s) - T0) ))
"$PY" python/bench/gpu_bench.py run --out "$OUT" --stweaver-bin "$PWD/$CARRY/bin/stweaver" \
  --budget-s "$LEFT" "$@"
