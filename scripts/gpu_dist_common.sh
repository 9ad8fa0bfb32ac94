# Sourced by scripts/gpu_dist_test.sh and scripts/gpu_dist_bench.sh: environment, machine
# report and the extension build (skipped when python/stweaver/_C*.so is newer than the carried
# staticlib, so the two scripts can run back to back in one call).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARRY="${1:-.dist-carry}"
GPUS="${2:-2}"
OUT="${OUT:-/tmp/stweaver-dist-out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export STWEAVER_LIB="$PWD/$CARRY/libstweaver_torch.a"
export STWEAVER_CXXBRIDGE="$PWD/$CARRY/cxxbridge"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast off on the shared machines (NCCL NVLS, symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8
PY="${PYTHON:-python3}"

echo "== machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
nvidia-smi topo -m 2>/dev/null | head -n $((GPUS + 2)) || true
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count(), "python", sys.version.split()[0])'

dist_build() {
  if [ -n "$(find python/stweaver -maxdepth 1 -name '_C*.so' -newer "$STWEAVER_LIB" 2>/dev/null)" ]; then
    echo "== extension already built"
    return 0
  fi
  echo "== build the extension"
  local t0=$(date +%s)
  if ! "$PY" -m stweaver build > "$OUT/build.log" 2>&1; then
    tail -n 40 "$OUT/build.log"
    echo "extension build failed"
    return 1
  fi
  tail -n 1 "$OUT/build.log"
  echo "build took $(( $(date +%s) - t0 )) s"
}
