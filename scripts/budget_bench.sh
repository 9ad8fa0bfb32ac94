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
CARRY="${1:-.bench-carry}"
shift || true
OUT="${OUT:-/tmp/stweaver-budget-out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export STWEAVER_LIB="$PWD/$CARRY/libstweaver_torch.a"
export STWEAVER_CXXBRIDGE="$PWD/$CARRY/cxxbridge"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "== build the extension"
if ! "$PY" -m stweaver build > "$OUT/build.log" 2>&1; then
  tail -n 40 "$OUT/build.log"
  echo "extension build failed"
  exit 1
fi
tail -n 1 "$OUT/build.log"
echo "== budget benchmark"
"$PY" python/bench/budget_bench.py --out "$OUT" --stweaver-bin "$PWD/$CARRY/bin/stweaver" "$@"
