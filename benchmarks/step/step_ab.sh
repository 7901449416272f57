#!/usr/bin/env bash
# The model step of this tree against an older commit's, through bench_compile.py (the bf16 recipe), variants
# $STEP_AB_VARIANTS (default "residual eager,mhc eager"; add "residual compiled,mhc compiled" for the compiled step).
# Each run is its own process with the residual and mHC models interleaved, so compare the ratios to residual.
#
#   git archive OLD mhc benchmarks | (mkdir -p old_tree && tar -x -C old_tree)    # here, before the device call
#   OUT=... benchmarks/step/step_ab.sh old_tree 1b 4 new old new old                   # on the device
#
# Logs: $OUT/step_<size>_<which><i>.log. The older tree is imported through PYTHONPATH and built from this
# tree's csrc/ (MHC_CSRC_DIR), so the two share one CUDA build when their kernel sources agree.
set -o pipefail
[ $# -ge 4 ] || { echo "usage: benchmarks/step/step_ab.sh OLD_TREE SIZE(134m|1b) BATCH new|old..." >&2; exit 2; }
for which in "${@:4}"; do
  case "$which" in new|old) ;; *) echo "unknown run '$which' (new or old)" >&2; exit 2 ;; esac
done
old_tree=$(cd "$1" && pwd) || exit 2
old_script=$old_tree/benchmarks/step/bench_compile.py          # trees from before benchmarks/ had subfolders:
[ -f "$old_script" ] || old_script=$old_tree/benchmarks/bench_compile.py
size=$2; batch=$3; shift 3
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
i=0
for which in "$@"; do
  i=$((i + 1)); SECONDS=0
  log="$OUT/step_${size}_${which}${i}.log"
  args=(--size "$size" --batch "$batch" --variants "${STEP_AB_VARIANTS:-residual eager,mhc eager}")
  case "$which" in
    new) timeout 280 python3 benchmarks/step/bench_compile.py "${args[@]}" >"$log" 2>&1 ;;
    old) MHC_CSRC_DIR=$PWD/mhc/csrc PYTHONPATH=$old_tree timeout 280 python3 "$old_script" "${args[@]}" >"$log" 2>&1 ;;
  esac
  echo "$which $i: rc=$? ${SECONDS}s"
  grep -hE '^  mhc (eager|compiled) ' "$log" | tr -s ' '
done
