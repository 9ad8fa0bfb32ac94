#!/usr/bin/env bash
# The plan pool's piece size (STWEAVER_POOL_UNIT_MIB, 64 vs 0 = whole ranges) on the GPU: eval10
# auto step time, one run at a time, alternating (twice each), and len5new auto peak reserved.
# Usage on the device: OUT=$OUT bash scripts/pool_unit_ab.sh (after cargo xtask gpu-test's carry).
set -o pipefail
# A/B of the plan pool's piece size on eval10 (one run at a time, alternating) and on len5new.
for i in 1 2; do for u in 64 0; do
  STWEAVER_POOL_UNIT_MIB=$u OUT=$OUT/eval10_u${u}_$i LONG_LOOPS_WORK=/tmp/llw_${u}_${i} LONG_LOOPS_BUDGET_S=120 bash scripts/long_loops.sh .carry --parallel 1 --loops eval10 --allocs auto --iters 100 2>&1 | grep -E "^\| eval10|build took"
done; done
STWEAVER_POOL_UNIT_MIB=0 OUT=$OUT/len5new_u0 LONG_LOOPS_WORK=/tmp/llw_n0 LONG_LOOPS_BUDGET_S=150 bash scripts/long_loops.sh .carry --parallel 1 --loops len5new --allocs auto --iters 200 2>&1 | grep -E "^\| len5new" &
STWEAVER_POOL_UNIT_MIB=64 OUT=$OUT/len5new_u64 LONG_LOOPS_WORK=/tmp/llw_n64 LONG_LOOPS_BUDGET_S=150 bash scripts/long_loops.sh .carry --parallel 1 --loops len5new --allocs auto --iters 200 2>&1 | grep -E "^\| len5new" &
wait
python3 - <<'PY'
import json, glob, os, statistics as st
out = os.environ["OUT"]
for f in sorted(glob.glob(out + "/*/long_loops.json")):
    for r in json.load(open(f))["results"]:
        s = r.get("step_s", [])[20:]
        print(os.path.basename(os.path.dirname(f)), r["alloc"], "peak %.3f GiB" % (r["max_reserved"] / 2**30),
              "median %.2f min %.2f ms" % (1e3 * st.median(s), 1e3 * min(s)) if s else "-", r.get("driver_calls"))
PY
find $OUT \( -name "*.stwt*" -o -name table.txt \) -delete
