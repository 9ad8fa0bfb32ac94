#!/usr/bin/env bash
# Builds the native C++ example (examples/cpp/train.cpp) against this machine's torch and
# runs it under PyTorch's allocator and under stweaver (auto mode), printing both peaks.
#
#   bash scripts/cpp_example.sh [STATICLIB_DIR] [BUILD_DIR]
#
# STATICLIB_DIR holds libstweaver_torch.a and cxxbridge/ (default target/release and
# target/cxxbridge, i.e. `cargo build --release -p stweaver-torch`; on a GPU machine
# without Rust the carry of `cargo xtask gpu-test`). Needs g++, the python in $PYTHON (or
# python3) with torch, and a CUDA runtime (pip's nvidia packages, else $CUDA_HOME). The link
# line below is the documented one (README.md, "Native C++"); with cmake on PATH the CMake
# package (cmake/stweaverConfig.cmake) builds it a second time.
# Prints "cpp-example: ..." lines; exit status non-zero if a build or run fails or the two
# runs' losses differ.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY="${1:-}"
BUILD="${2:-target/cpp-example}"
PY="${PYTHON:-python3}"
if [ -n "$CARRY" ]; then
  LIB="$CARRY/libstweaver_torch.a"; BRIDGE="$CARRY/cxxbridge"
else
  LIB="target/release/libstweaver_torch.a"; BRIDGE="target/cxxbridge"
fi
[ -f "$LIB" ] || { echo "cpp-example: no staticlib at $LIB (cargo build --release -p stweaver-torch)" >&2; exit 1; }
mkdir -p "$BUILD"

# torch's locations and flags, CUDA runtime: pip's nvidia package first (what torch loads).
eval "$("$PY" - <<'PYEOF'
import glob, os, sys, torch
from torch.utils import cpp_extension as ce
tdir = os.path.dirname(torch.__file__)
minor = int(torch.__version__.split(".")[1])
major = int(torch.__version__.split(".")[0])
cuda_inc = cuda_lib = ""
for entry in sys.path:
    for hdr in glob.glob(os.path.join(entry, "nvidia", "cu*", "include", "cuda_runtime_api.h")):
        root = os.path.dirname(os.path.dirname(hdr))
        if glob.glob(os.path.join(root, "lib", "libcudart.so.*")):
            cuda_inc, cuda_lib = os.path.join(root, "include"), os.path.join(root, "lib")
            break
    if cuda_inc:
        break
# pip's runtime package may ship cuda_runtime.h without crt/host_config.h (that header is in
# nvidia-cuda-crt, or only in a toolkit): take the headers from CUDA_HOME then, keep pip's lib.
if cuda_inc and not os.path.isfile(os.path.join(cuda_inc, "crt", "host_config.h")):
    home = os.path.join(ce.CUDA_HOME, "include") if ce.CUDA_HOME else ""
    if home and os.path.isfile(os.path.join(home, "crt", "host_config.h")):
        cuda_inc = home
if not cuda_inc and ce.CUDA_HOME:
    cuda_inc = os.path.join(ce.CUDA_HOME, "include")
    cuda_lib = os.path.join(ce.CUDA_HOME, "lib64")
cudart = sorted(glob.glob(os.path.join(cuda_lib, "libcudart.so.*"))) if cuda_lib else []
print(f"TORCH_DIR={tdir!r}")
print(f"TORCH_VERSION={torch.__version__!r}")
print(f"CXXSTD={'c++20' if (major, minor) >= (2, 12) else 'c++17'}")
print(f"ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
print(f"CUDA_INC={cuda_inc!r}")
print(f"CUDA_LIB={cuda_lib!r}")
print(f"CUDART={os.path.basename(cudart[0]) if cudart else ''!r}")
PYEOF
)"
[ -n "$CUDART" ] || { echo "cpp-example: no CUDA runtime (pip nvidia-cuda-runtime or CUDA_HOME)" >&2; exit 1; }
echo "cpp-example: torch $TORCH_VERSION ($CXXSTD), cudart $CUDA_LIB/$CUDART, CUDA headers $CUDA_INC"

# The documented link line.
t0=$(date +%s)
g++ -std="$CXXSTD" -O2 -D_GLIBCXX_USE_CXX11_ABI="$ABI" \
  -Icpp -I"$BRIDGE" \
  -isystem "$TORCH_DIR/include" -isystem "$TORCH_DIR/include/torch/csrc/api/include" \
  -isystem "$CUDA_INC" \
  examples/cpp/train.cpp cpp/stweaver_allocator.cpp "$LIB" \
  -L"$TORCH_DIR/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -ltorch_cuda -lc10_cuda -lc10 \
  -Wl,--as-needed -L"$CUDA_LIB" -l:"$CUDART" -ldl -lpthread -lm \
  -Wl,-rpath,"$TORCH_DIR/lib" -Wl,-rpath,"$CUDA_LIB" \
  -o "$BUILD/train"
echo "cpp-example: built $BUILD/train with g++ in $(( $(date +%s) - t0 )) s"

STEPS="${CPP_EXAMPLE_STEPS:-30}"
native="$("$BUILD/train" native "$STEPS")"
stweaver="$("$BUILD/train" auto "$STEPS")"
echo "cpp-example: native:   $native"
echo "cpp-example: stweaver: $stweaver"
field() { sed -n "s/.*$1=\([^ ]*\).*/\1/p" <<<"$2"; }
nres="$(field peak_reserved "$native")"; sres="$(field peak_reserved "$stweaver")"
python3 - "$nres" "$sres" <<'PYEOF'
import sys
n, s = (int(x) for x in sys.argv[1:3])
gib = 1 << 30
print(f"cpp-example: peak reserved native {n / gib:.3f} GiB, stweaver {s / gib:.3f} GiB "
      f"({(n - s) / n * 100:+.1f} % saved)")
PYEOF
case "$stweaver" in
  *allocator=stweaver*) ;;
  *) echo "cpp-example: FAIL: the stweaver run did not report stweaver as its allocator" >&2; exit 1 ;;
esac
if [ "$(field last_loss "$native")" != "$(field last_loss "$stweaver")" ]; then
  echo "cpp-example: FAIL: the losses differ between native and stweaver" >&2
  exit 1
fi
echo "cpp-example: same last loss under both allocators"

if command -v cmake >/dev/null 2>&1; then
  t0=$(date +%s)
  prefix="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
  if cmake -S examples/cpp -B "$BUILD/cmake" -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_PREFIX_PATH="$prefix" -Dstweaver_DIR="$PWD/cmake" \
       -DSTWEAVER_LIB="$PWD/$LIB" -DSTWEAVER_CXXBRIDGE="$PWD/$BRIDGE" >"$BUILD/cmake.log" 2>&1 \
     && cmake --build "$BUILD/cmake" -j >>"$BUILD/cmake.log" 2>&1; then
    echo "cpp-example: CMake (find_package(stweaver)) build in $(( $(date +%s) - t0 )) s: $("$BUILD/cmake/train" auto 3)"
  else
    echo "cpp-example: FAIL: the CMake build failed; last lines of $BUILD/cmake.log:" >&2
    tail -n 30 "$BUILD/cmake.log" >&2
    exit 1
  fi
else
  echo "cpp-example: no cmake on PATH: the CMake package was not exercised"
fi
