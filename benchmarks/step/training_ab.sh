#!/usr/bin/env bash
# bench_training.py on this tree against other trees' mhc, process by process, in the order given.
# Each process times the residual model and mHC interleaved, so compare the mHC/residual ratios across them.
#
#   git archive OLD mhc | (mkdir -p old_tree && tar -x -C old_tree)     # here, before the device call
#   OUT=... benchmarks/step/training_ab.sh old_tree "--shapes 134m --recipes autocast --modes eager" new old new old
#
# A run is `new` (this tree's mhc), `old` (OLD_TREE's) or the path of any other tree holding mhc/ (for
# several candidates in one call: `git archive BRANCH mhc | tar -x -C ab/BRANCH` for each, untracked so it
# travels; pass - as OLD_TREE when no run is `old`). Each run imports its mhc through PYTHONPATH and runs this
# tree's benchmark; every tree is built from this tree's csrc/ (MHC_CSRC_DIR), so all share one CUDA build when
# their kernel sources agree. A run gets TRAINING_AB_TIMEOUT seconds (default 560; a compiled 1.1B group
# needs ~300 on a cold inductor cache). Logs and JSON go to $OUT/training_ab/<i>_<run>.{log,json}, packed at
# the end into $OUT/training_ab.tgz (the device tool brings back at most 8 files); each run's table rows and
# the mhc it imported are printed.
set -o pipefail
[ $# -ge 3 ] || { echo "usage: benchmarks/step/training_ab.sh OLD_TREE|- 'BENCH_TRAINING_ARGS' RUN..." >&2; exit 2; }
old_tree=-
if [ "$1" != - ]; then
  old_tree=$(cd "$1" && pwd) || exit 2
  [ -f "$old_tree/mhc/__init__.py" ] || { echo "$old_tree has no mhc/ (make it with git archive OLD mhc)" >&2; exit 2; }
fi
bench_args=$2; shift 2
trees=()
for which in "$@"; do
  case "$which" in
    new) trees+=("$PWD") ;;
    old) [ "$old_tree" != - ] || { echo "run 'old' needs OLD_TREE" >&2; exit 2; }; trees+=("$old_tree") ;;
    *) [ -f "$which/mhc/__init__.py" ] || { echo "unknown run '$which' (new, old, or a tree holding mhc/)" >&2; exit 2; }
       trees+=("$(cd "$which" && pwd)") ;;
  esac
done
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.ext_cache} MHC_CSRC_DIR=$PWD/mhc/csrc
OUT=${OUT:-$PWD/gpu_out}; logs=$OUT/training_ab; mkdir -p "$logs"
i=0; status=0
for which in "$@"; do
  tree=${trees[$i]}; i=$((i + 1)); SECONDS=0
  base="$logs/${i}_$(basename "$which")"
  # shellcheck disable=SC2086  # bench_args is a list of options
  PYTHONPATH=$tree timeout "${TRAINING_AB_TIMEOUT:-560}" python3 benchmarks/step/bench_training.py $bench_args \
    --json "$base.json" >"$base.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  echo "$which $i: rc=$rc ${SECONDS}s, $(grep -m1 -o 'mhc: [^ ]*' "$base.log" || echo 'mhc: ?')"
  grep -E '^\[.*\] residual' "$base.log" | sed 's/^/  /'
done
tar -czf "$OUT/training_ab.tgz" -C "$OUT" training_ab && rm -r "$logs"
exit $status
