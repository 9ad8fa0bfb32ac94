#!/usr/bin/env bash
# The distributed benchmark, as one command on an N-GPU machine without Rust (see
# `cargo xtask gpu-bench --gpus N`, which prepares CARRY_DIR here and prints the device command):
#
#   set -o pipefail; bash scripts/gpu_dist_bench.sh [CARRY_DIR] [GPUS] 2>&1 | tee $OUT/log
#
# Builds the extension (unless already built), then python/bench/gpu_dist_bench.py: DDP and
# FSDP2 (`fully_shard`) training of make_traces.py's Llama 1B config under native, expandable
# segments, stweaver trace -> `stweaver plan` (per rank, carried CLI) -> plan, and stweaver
# auto, one torchrun job at a time, inside a budget (GPU_DIST_BENCH_BUDGET_S, default 380 s,
# build included). Writes $OUT/dist_bench/gpu_dist_bench.json and prints the table last.
# DIST_BENCH_ARGS passes options on, e.g. DIST_BENCH_ARGS="--lockstep 30": step time with the
# allocators' jobs (after the trace job) training side by side and taking turns, one timed
# iteration each per round (gpu_dist_bench.py's docstring).
set -uo pipefail
T0=$(date +%s)
source "$(dirname "$0")/gpu_dist_common.sh"
BUDGET="${GPU_DIST_BENCH_BUDGET_S:-380}"
dist_build || exit 1
echo "== distributed benchmark"
LEFT=$(( BUDGET - ($(date +%s) - T0) ))
"$PY" python/bench/gpu_dist_bench.py --gpus "$GPUS" --out "$OUT/dist_bench" \
  --stweaver-bin "$PWD/$CARRY/bin/stweaver" --budget-s "$LEFT" ${DIST_BENCH_ARGS:-}
