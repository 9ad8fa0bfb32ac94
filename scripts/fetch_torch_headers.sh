#!/usr/bin/env bash
# Fetch a real torch wheel and the CUDA runtime/crt header packages it was built against, so
# that the C++ allocator (cpp/) compiles and links on a machine with no GPU and no CUDA toolkit.
#
#   scripts/fetch_torch_headers.sh [VERSION] [--venv]
#
# VERSION   torch version on PyPI (default 2.11.0); "latest" asks PyPI for the newest.
# --venv    also create a full virtual environment with that torch and its dependencies
#           (several GiB) so that `import torch` works and the extension can be built with
#           torch.utils.cpp_extension and imported (no GPU needed for that).
#
# Idempotent: a finished download is recorded by a stamp file and not repeated.
# Layout (STWEAVER_CACHE, default ~/.cache/stweaver):
#   torch-VERSION-cpXY/site/            torch/ and nvidia/ unpacked (pip --target, no deps)
#   torch-VERSION-cpXY/paths.env        TORCH_VERSION, TORCH_SITE, CUDA_INCLUDE, CUDA_LIB, ...
#   venv-torch-VERSION-cpXY/            (with --venv)
# The last line printed is the path of paths.env.
set -euo pipefail

VERSION="2.11.0"
WANT_VENV=0
for arg in "$@"; do
  case "$arg" in
    --venv) WANT_VENV=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) echo "fetch_torch_headers: unknown option $arg" >&2; exit 2 ;;
    *) VERSION="$arg" ;;
  esac
done

PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "fetch_torch_headers: $PY not found (set PYTHON)" >&2; exit 2; }
PYTAG="cp$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
PYVER="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
CACHE="${STWEAVER_CACHE:-$HOME/.cache/stweaver}"

if [ "$VERSION" = "latest" ]; then
  VERSION="$("$PY" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p' | head -n1)"
  [ -n "$VERSION" ] || { echo "fetch_torch_headers: could not ask PyPI for the newest torch" >&2; exit 1; }
fi
case "$VERSION" in
  [0-9]*.[0-9]*.[0-9]*) ;;
  *) echo "fetch_torch_headers: '$VERSION' is not a version like 2.11.0" >&2; exit 2 ;;
esac

DEST="$CACHE/torch-$VERSION-$PYTAG"
SITE="$DEST/site"
STAMP="$DEST/.complete"
ENVF="$DEST/paths.env"
PIP=("$PY" -m pip --disable-pip-version-check -q)
PLATFORM_ARGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

if [ ! -f "$STAMP" ]; then
  echo "== fetching torch $VERSION ($PYTAG) into $SITE" >&2
  rm -rf "$SITE"
  mkdir -p "$SITE"
  "${PIP[@]}" install --no-deps --target "$SITE" "${PLATFORM_ARGS[@]}" "torch==$VERSION"
  META="$(ls -d "$SITE"/torch-"$VERSION"*.dist-info)/METADATA"
  # torch >= 2.11 pins the CUDA runtime through the `cuda-toolkit` meta package.
  CTK="$(sed -n 's/^Requires-Dist: cuda-toolkit\[[^]]*\]==\([0-9.]*\).*/\1/p' "$META" | head -n1)"
  if [ -z "$CTK" ]; then
    echo "fetch_torch_headers: torch $VERSION does not pin cuda-toolkit (a CPU or pre-2.11 wheel?);" \
         "its Requires-Dist lines are:" >&2
    grep '^Requires-Dist' "$META" >&2 || true
    exit 1
  fi
  echo "== torch $VERSION wants cuda-toolkit $CTK: fetching its cudart and crt headers" >&2
  "${PIP[@]}" install --target "$SITE" "${PLATFORM_ARGS[@]}" --upgrade "cuda-toolkit[cudart,crt]==$CTK"
  CUDA_ROOT="$(dirname "$(ls -d "$SITE"/nvidia/cu*/include/cuda_runtime_api.h | head -n1)")/.."
  CUDA_ROOT="$(cd "$CUDA_ROOT" && pwd)"
  [ -f "$CUDA_ROOT/include/crt/host_config.h" ] || {
    echo "fetch_torch_headers: $CUDA_ROOT/include/crt/host_config.h missing after install" >&2; exit 1; }
  CUDART="$(ls "$CUDA_ROOT"/lib/libcudart.so.* | head -n1)"
  cat >"$ENVF" <<EOF
TORCH_VERSION=$VERSION
TORCH_CUDA_TOOLKIT=$CTK
TORCH_PYTAG=$PYTAG
TORCH_SITE=$SITE
TORCH_INCLUDE=$SITE/torch/include
TORCH_API_INCLUDE=$SITE/torch/include/torch/csrc/api/include
TORCH_LIB=$SITE/torch/lib
CUDA_INCLUDE=$CUDA_ROOT/include
CUDA_LIB=$CUDA_ROOT/lib
CUDART_SONAME=$(basename "$CUDART")
EOF
  touch "$STAMP"
else
  echo "== torch $VERSION ($PYTAG) already in $DEST" >&2
fi

if [ "$WANT_VENV" = 1 ]; then
  VENV="$CACHE/venv-torch-$VERSION-$PYTAG"
  if [ ! -f "$VENV/.complete" ]; then
    echo "== creating $VENV (full torch $VERSION with dependencies)" >&2
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    CTK="$(sed -n 's/^TORCH_CUDA_TOOLKIT=//p' "$ENVF")"
    "$VENV/bin/python" -m pip --disable-pip-version-check -q install \
      "torch==$VERSION" "cuda-toolkit[crt]==$CTK" ninja pytest numpy
    touch "$VENV/.complete"
  else
    echo "== $VENV already complete" >&2
  fi
  grep -q '^TORCH_VENV=' "$ENVF" || echo "TORCH_VENV=$VENV" >>"$ENVF"
fi

echo "$ENVF"
