#!/usr/bin/env bash
# Build and install the peer projection kernels (mHC-proj, which also carries mHC.cu's n=4
# Sinkhorn) from the source copy in .peers/mHC-proj, for benchmarks/projection/bench_projection_peers.py.
# Run on the GPU machine from the repository root; no network is needed (pip --no-deps
# --no-build-isolation against the torch already installed). Only the CUDA extension is
# built: the TileLang peers need tilelang, which is not installed there.
# A failed or missing peer build is reported and the script still exits 0, so a device
# run that goes on to the benchmark keeps going (the benchmark then prints "n/a (reason)").
# Environment: PEERS_DIR (default .peers), PYTHON (default python3), MAX_JOBS (default 8),
# TORCH_CUDA_ARCH_LIST (default 9.0, the H200), OUT (the build log goes there, else /tmp).
# Make the source copy, here, before the device run (then name .peers in the run's carry):
#   mkdir -p .peers/mHC-proj && git -C /work/.mirror/yixuan+mHC-proj/repo archive HEAD | tar -x -C .peers/mHC-proj
USAGE="Usage: benchmarks/projection/build_peers.sh [--help]"
case "${1:-}" in
  -h|--help) echo "$USAGE"; sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "unknown argument '$1'; $USAGE" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
PEERS_DIR=${PEERS_DIR:-.peers}
SRC="$PEERS_DIR/mHC-proj"
LOG_DIR=${OUT:-/tmp}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/build_peers.log"

if [ ! -f "$SRC/setup.py" ]; then
  echo "peer build: SKIPPED, no source at $SRC/setup.py (create it as this script's header says, and carry $PEERS_DIR)"
  exit 0
fi

export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-8}
CUDA_HOME_FOUND=$("$PYTHON" -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or '')" 2>/dev/null)
SHIM=$(mktemp -d /tmp/peer_build.XXXXXX)
# setup.py links -lcuda -lcudart. Containers often mount only libcuda.so.1 and pip's CUDA wheels
# ship only libcudart.so.13: give the linker an unversioned name for each (the SONAME stays
# versioned, so the library the process already has is what loads at run time).
for d in "$CUDA_HOME_FOUND/lib64/stubs" "$CUDA_HOME_FOUND/lib/stubs" "$CUDA_HOME_FOUND/targets/x86_64-linux/lib/stubs" \
         /usr/local/nvidia/lib64; do
  [ -d "$d" ] && LIBRARY_PATH="${LIBRARY_PATH:+$LIBRARY_PATH:}$d"
done
for lib in cuda cudart; do
  found=""
  for d in ${LIBRARY_PATH//:/ } "$CUDA_HOME_FOUND/lib64" "$CUDA_HOME_FOUND/lib"; do
    [ -e "$d/lib$lib.so" ] && found="$d/lib$lib.so" && break
  done
  if [ -z "$found" ]; then
    versioned=$( (ldconfig -p 2>/dev/null | grep -o "/.*/lib$lib\.so\.[0-9]*$"; \
      "$PYTHON" -c "import glob, site; print(*glob.glob(site.getsitepackages()[0] + '/nvidia/**/lib$lib.so.[0-9]*', recursive=True), sep='\n')" 2>/dev/null) | head -1)
    if [ -n "$versioned" ]; then
      ln -sf "$versioned" "$SHIM/lib$lib.so"; LIBRARY_PATH="${LIBRARY_PATH:+$LIBRARY_PATH:}$SHIM"; found="$SHIM/lib$lib.so -> $versioned"
    fi
  fi
  echo "peer build: -l$lib from ${found:-nowhere found (the link may fail)}"
done
export LIBRARY_PATH
# mHC.cu's mhc_types.h includes cublasLt.h for one error-check helper (cublasStatus_t) that the
# n=4 kernels never call. Where the toolkit lacks the header, a two-line stand-in declares that
# type (a pip wheel's include folder would bring its own, possibly newer, CUDA headers with it).
if [ -f "$CUDA_HOME_FOUND/include/cublasLt.h" ]; then
  echo "peer build: cublasLt.h from $CUDA_HOME_FOUND/include"
else
  printf '%s\n' '#pragma once' 'typedef enum { CUBLAS_STATUS_SUCCESS = 0 } cublasStatus_t;' >"$SHIM/cublasLt.h"
  export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-I$SHIM"
  echo "peer build: no cublasLt.h under CUDA_HOME; a stand-in declares cublasStatus_t ($SHIM/cublasLt.h)"
fi
echo "peer build: $SRC (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS CUDA_HOME=${CUDA_HOME_FOUND:-?}" \
     "nvcc=$(command -v nvcc || echo none)); log: $LOG"

SECONDS=0
if "$PYTHON" -m pip install --no-deps --no-build-isolation --no-cache-dir -v "$SRC" >"$LOG" 2>&1; then
  build_s=$SECONDS
  # Import from outside the source tree, so the installed extension is what loads.
  if (cd / && "$PYTHON" -c "import torch, mhc_proj; mhc_proj.torch.birkhoff_proj_n4; mhc_proj.torch.sinkhorn_knopp_n4; print('mhc_proj', mhc_proj.__version__, 'from', mhc_proj.__file__)") >>"$LOG" 2>&1; then
    echo "peer build: OK in ${build_s}s: $(tail -1 "$LOG")"
  else
    echo "peer build: installed in ${build_s}s but 'import mhc_proj' FAILED:"
    tail -15 "$LOG"
  fi
else
  echo "peer build: FAILED after ${SECONDS}s (pip exit status $?); the end of $LOG:"
  grep -E "error|Error|ERROR" "$LOG" | head -15
  echo "..."
  tail -25 "$LOG"
fi
exit 0
