#!/usr/bin/env bash
# The distributed GPU tests, as one command on an N-GPU machine without Rust (see
# `cargo xtask gpu-test --gpus N`, which prepares CARRY_DIR here and prints the device command):
#
#   set -o pipefail; bash scripts/gpu_dist_test.sh [CARRY_DIR] [GPUS] 2>&1 | tee $OUT/log
#
# Builds the extension (TORCH_CUDA_ARCH_LIST set, so CUDA is not initialised), then runs
# python/tests/gpu_dist/run_dist_tests.py: torchrun jobs (DDP and FSDP2 on a scaled-down Llama,
# native vs stweaver online / trace / auto / per-rank plan / shared plan / refused plan; the NCCL
# stream-safety job), each with a hard timeout. NVLink multicast stays off. Results and logs go
# to $OUT (dist_tests.json, summary.txt, cases/*/log.txt); the table is printed last.
set -uo pipefail
source "$(dirname "$0")/gpu_dist_common.sh"
dist_build || exit 1
echo "== distributed tests"
"$PY" python/tests/gpu_dist/run_dist_tests.py --gpus "$GPUS" --out "$OUT/dist_tests" \
  --stweaver-bin "$PWD/$CARRY/bin/stweaver" ${DIST_TEST_ARGS:-}
status=$?
echo "== summary"
cat "$OUT/dist_tests/summary.txt" 2>/dev/null || echo "(no summary written)"
exit $status
