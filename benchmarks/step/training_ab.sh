#!/usr/bin/env bash
# bench_training.py on this tree against an older commit's mhc, process by process (new old new old ...).
# Each process times the residual model and mHC interleaved, so compare the mHC/residual ratios across them.
#
#   git archive OLD mhc | (mkdir -p old_tree && tar -x -C old_tree)     # here, before the device call
#   OUT=... benchmarks/step/training_ab.sh old_tree "--shapes 134m --recipes autocast --modes eager" new old new old
#
# Each run imports its mhc through PYTHONPATH (this tree's, or the older one, which this tree's benchmarks run
# on); the older one is built from this tree's csrc/ (MHC_CSRC_DIR), so the two share one CUDA build when their
# kernel sources agree. Logs and JSON: $OUT/training_ab_<which><i>.{log,json}; each run's table rows are printed,
# and the log's first line names the mhc it imported.
set -o pipefail
[ $# -ge 3 ] || { echo "usage: benchmarks/step/training_ab.sh OLD_TREE 'BENCH_TRAINING_ARGS' new|old..." >&2; exit 2; }
for which in "${@:3}"; do
  case "$which" in new|old) ;; *) echo "unknown run '$which' (new or old)" >&2; exit 2 ;; esac
done
old_tree=$(cd "$1" && pwd) || exit 2
[ -f "$old_tree/mhc/__init__.py" ] || { echo "$old_tree has no mhc/ (make it with git archive OLD mhc)" >&2; exit 2; }
bench_args=$2; shift 2
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.ext_cache}
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
i=0; status=0
for which in "$@"; do
  i=$((i + 1)); SECONDS=0
  base="$OUT/training_ab_${which}${i}"
  # shellcheck disable=SC2086  # bench_args is a list of options
  case "$which" in
    new) PYTHONPATH=$PWD timeout 560 python3 benchmarks/step/bench_training.py $bench_args --json "$base.json" >"$base.log" 2>&1 ;;
    old) MHC_CSRC_DIR=$PWD/mhc/csrc PYTHONPATH=$old_tree timeout 560 python3 benchmarks/step/bench_training.py \
           $bench_args --json "$base.json" >"$base.log" 2>&1 ;;
  esac
  rc=$?; [ $rc -eq 0 ] || status=1
  echo "$which $i: rc=$rc ${SECONDS}s, $(grep -m1 -o 'mhc: [^ ]*' "$base.log" || echo 'mhc: ?')"
  grep -E '^\| (small_gpu|134m|1b) ' "$base.log" | sort -u
done
exit $status
