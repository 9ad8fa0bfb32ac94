#!/usr/bin/env bash
# Issue #18's long loops (python/bench/long_loops.py: five 200-iteration loops under native,
# expandable, auto, trace and auto with phase markers), as one command per device call on a GPU
# machine without Rust. `cargo xtask gpu-bench --long-loops` prepares CARRY_DIR (.bench-carry,
# the carry of `gpu-bench`) and prints the two calls' exact commands:
#
#   set -o pipefail; bash scripts/long_loops.sh .bench-carry --parallel 2 --loops len5,len50 2>&1 | tee $OUT/log
#   set -o pipefail; bash scripts/long_loops.sh .bench-carry --parallel 4 --loops eval10,ckpt20,moe 2>&1 | tee $OUT/log
#
# (len50's native run grows to 48 GB: at most two length-loop runs share an 80 GB card; the two
# groups together do not fit one 600 s call.)
# 1. builds the torch extension from the carried staticlib (skipped when already built;
#    TORCH_CUDA_ARCH_LIST set, so the build never initialises CUDA);
# 2. runs long_loops.py inside a budget (LONG_LOOPS_BUDGET_S, default 540 s, build included):
#    it starts no run that would end past it and stops those still going, so that the JSON and
#    the table are always written;
# 3. $OUT gets long_loops.json, table.txt and traces/trace_<loop>.stwt.gz (the per-run results,
#    logs and raw traces stay in LONG_LOOPS_WORK, default /tmp/stweaver-long-loops-runs: the
#    device tool brings back at most 8 files). The table is printed last; the failed runs' log
#    tails before it. `cargo xtask gpu-bench --long-loops --report long_loops.json [...]` then
#    prints the Markdown table with issue #18's targets.
# With no long_loops.py arguments: every loop, two runs at a time (longer than one call).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET="${LONG_LOOPS_BUDGET_S:-540}"
OUT="${OUT:-/tmp/stweaver-long-loops-out}"
WORK="${LONG_LOOPS_WORK:-/tmp/stweaver-long-loops-runs}"
source scripts/gpu_env.sh "${1:-.bench-carry}" || exit 1
shift || true
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
nproc
"$PY" -c 'import torch, transformers, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "python", sys.version.split()[0])'
echo "== build the extension"
gpu_env_build || exit 1
echo "== long loops"
rm -rf "$WORK" && mkdir -p "$WORK"
LEFT=$(( BUDGET - ($(date +%s) - T0) ))
echo "budget left: $LEFT s"
"$PY" python/bench/long_loops.py --out "$OUT" --work "$WORK" --budget-s "$LEFT" "$@"
RC=$?
echo "== long loops: exit $RC in $(( $(date +%s) - T0 )) s; in $OUT: $(cd "$OUT" && ls -d long_loops.json table.txt traces/* 2>/dev/null | tr '\n' ' ')"
exit $RC
