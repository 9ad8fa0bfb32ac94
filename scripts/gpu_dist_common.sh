# Sourced by scripts/gpu_dist_test.sh and scripts/gpu_dist_bench.sh: environment, machine
# report and the extension build (skipped when python/stweaver/_C*.so is newer than the carried
# staticlib, so the two scripts can run back to back in one call).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/stweaver-dist-out}"
source scripts/gpu_env.sh "${1:-.dist-carry}" || exit 1
GPUS="${2:-2}"
# NVLink multicast off on the shared machines (NCCL NVLS, symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8

echo "== machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
nvidia-smi topo -m 2>/dev/null | head -n $((GPUS + 2)) || true
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count(), "python", sys.version.split()[0])'

dist_build() {
  echo "== build the extension"
  gpu_env_build
}
