#!/usr/bin/env bash
# The H200 checks of issues #23 and #27, in stages, logs under $OUT (default ./gpu_out):
#   setup    install mhc (editable) and build the CUDA extension into .ext_cache/ (TORCH_EXTENSIONS_DIR); a build
#            carried there from an earlier call is reused (the sources' fresh copy is dated back so ninja keeps it), else
#            the new build comes back as $OUT/ext_cache.tgz: `mkdir -p .ext_cache && tar -xzf ext_cache.tgz` here, then
#            `carry: [".ext_cache"]` saves the next cold machine the 60-150 s build
#   tests    the test files that hold CUDA tests (GPU_TEST_FILES, default the list below), one pytest process per file,
#            TESTS_JOBS (8) at a time, each under TESTS_TIMEOUT (500 s), marker TESTS_MARK ("not slow"; "slow or not
#            slow" for both tiers); logs $OUT/pytest_<file>.log and $OUT/pytest_summary.log; fails if any file fails
#   peers    build mHC-proj / mHC.cu (benchmarks/projection/build_peers.sh), then bench_projection_peers.py
#   decode   benchmarks/decode/bench_decode.py (eager and static-cache compiled generate, batch 1 and 16, --profile --step-times)
#   sitehost benchmarks/decode/bench_site_host.py (host and device time of a decode-sized site, piece by piece)
#   projhost benchmarks/projection/bench_projection_host.py (a small-batch projection call, layer by layer; after peers
#            it has mHC-proj's call beside ours)
#   compile  benchmarks/step/bench_compile.py, 134M: residual and mHC, eager and compiled (fullgraph)
#   compile1b  the same for the 1.1B model (batch 4)
#   training benchmarks/step/bench_training.py --kernels --commit $COMMIT --json $OUT/training.json $TRAINING_ARGS:
#            the training-cost table (residual and mHC; small_gpu, 134m and 1b; bf16 and autocast; eager and
#            compiled), one process under timeout 560; TRAINING_ARGS="--shapes 1b" runs a shape in a call of its own;
#            TRAINING_ARGS="--base ab_base ..." adds an earlier commit's mHC model to the same rounds (the A/B of a
#            change in one process; ab_base made here first by `python benchmarks/step/ab_previous.py --make-base
#            COMMIT ab_base`, untracked, so it travels with the tree)
#   hostgap  benchmarks/step/host_gap.py --shape S --rounds HOSTGAP_ROUNDS (4) for each S of HOSTGAP_SHAPES
#            ("small_gpu"): the trainer's step against the same calls with no host read, both models in one
#            process, compiled, autocast; $OUT/host_gap_<S>.log
#   profile  benchmarks/step/profile_step.py $PROFILE_ARGS (default: the compiled small_gpu step in the autocast recipe,
#            with its host table): both models' kernel tables and the site kernels against a copy; $OUT/profile.log
#   sweep    benchmarks/site/sweep_site_kernels.py (launch configurations of the site kernels; SWEEP_ARGS)
#   boundary benchmarks/site/boundary_sweep.py: boundary kernels (site k's post-mix with site k+1's dot products;
#            site k+1's stream_grad with site k's postmix_bwd) against the pairs they would replace, in Triton and
#            as a CUDA prototype (built in the call, ~1 min), every variant, at the small_gpu, 134M and 1.1B shapes
#            (BOUNDARY_ARGS, e.g. "--boundaries forward_cuda,dots_cuda,backward_cuda"); needs no setup stage
#   sweep32  the same for float32 streams (issue #49, fp32 weights under bf16 autocast): coeff_partial, stream_grad,
#            phi_grad, coeff_bwd at 512x16384, 768x16384 and 2048x8192, the dot kernels over PRECISION ieee / tf32x3 /
#            tf32, outputs against float64; --budget 450 under timeout 500, JSON after each kernel (SWEEP32_ARGS).
#            Needs no setup stage (this tree's mhc, Triton kernels only)
#   ab       benchmarks/step/step_ab.sh: the bf16 step of this tree against $OLD_TREE's (made before the call with
#            `git archive OLD mhc benchmarks | tar -x -C old_tree`), 1.1B then 134M, new/old/new/old; eager, or the
#            variants in STEP_AB_VARIANTS (e.g. "residual eager,mhc eager,residual compiled,mhc compiled")
#   trainab  benchmarks/step/training_ab.sh: bench_training.py on this tree against $OLD_TREE's mhc (made before
#            the call with `git archive OLD mhc | tar -x -C old_tree`; - when no run is old) or other trees holding
#            mhc/, process by process, TRAINING_AB_RUNS (default "new old new old"; a run is new, old or a tree's
#            path) with TRAINING_AB_ARGS (default "--recipes autocast --modes eager"); logs in $OUT/training_ab.tgz
# Usage: COMMIT=<sha> benchmarks/gpu_session.sh setup tests peers ...   (from the repository root)
# Environment: OUT, COMMIT; GPU_TEST_FILES, TESTS_JOBS, TESTS_TIMEOUT, TESTS_MARK (tests),
# HOSTGAP_SHAPES, HOSTGAP_ROUNDS (hostgap), DECODE_ARGS (default --profile --step-times), COMPILE_VARIANTS (bench_compile.py --variants), TRAINING_ARGS
# (bench_training.py options added after the stage's), PROFILE_ARGS (profile_step.py's, in place of the default),
# SWEEP_ARGS / SWEEP32_ARGS / BOUNDARY_ARGS (likewise added), OLD_TREE (ab, trainab), TRAINING_AB_ARGS and TRAINING_AB_RUNS (trainab).
USAGE="Usage: benchmarks/gpu_session.sh STAGE... (setup tests peers decode sitehost projhost compile compile1b training hostgap profile sweep boundary sweep32 ab trainab)"
[ $# -eq 0 ] && { echo "$USAGE" >&2; exit 2; }
for stage in "$@"; do
  case "$stage" in setup|tests|peers|decode|sitehost|projhost|compile|compile1b|training|hostgap|profile|sweep|boundary|sweep32|ab|trainab) ;; *) echo "unknown stage '$stage'; $USAGE" >&2; exit 2 ;; esac
done
set -o pipefail
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.ext_cache}
OUT=${OUT:-$PWD/gpu_out}
# The test files that hold CUDA tests (each skips them without CUDA), for the stage tests.
DEFAULT_GPU_TEST_FILES="tests/test_projection_cuda.py tests/test_projection_zeros.py tests/test_fused_block.py
  tests/test_fused_tokens.py tests/test_fused_launches.py tests/test_fused_norm.py tests/test_keep_streams.py
  tests/test_nonfinite.py tests/test_compile.py tests/test_generate.py tests/test_block.py tests/test_stream_dtype.py
  tests/test_training_config.py tests/test_benchmark_training_and_sweep.py
  tests/test_training_late_values.py"
COMMIT=${COMMIT:-unknown}
mkdir -p "$OUT"
status=0  # 1 once a test file failed (stage tests); the exit status
for stage in "$@"; do
  SECONDS=0
  echo "=== $stage (commit $COMMIT)"
  case "$stage" in
    setup)
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
      python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
      # ninja rebuilds when a source is newer than its recorded output; the carried tree's sources are fresh copies
      carried=$(find "$TORCH_EXTENSIONS_DIR" -name '*.so' 2>/dev/null | head -n 1)
      [ -n "$carried" ] && touch -d 2001-01-01 mhc/csrc/*
      python3 -m mhc.cuda_build >/tmp/build.log 2>&1 || { tail -60 /tmp/build.log; exit 1; }
      echo "extension: $(find "$TORCH_EXTENSIONS_DIR" -name '*.so' -newer /tmp/pip.log | wc -l) .so built here (0: the carried build was reused)"
      [ -z "$carried" ] && tar -czf "$OUT/ext_cache.tgz" -C "$TORCH_EXTENSIONS_DIR" . ;;
    tests)
      # One pytest process per file, TESTS_JOBS at a time (Triton's compiles are CPU-bound and the machine has 16
      # cores; the GPU is shared): each file's verbose log in $OUT/pytest_<file>.log, its last line printed here.
      files=${GPU_TEST_FILES-$DEFAULT_GPU_TEST_FILES}
      export OUT TESTS_MARK=${TESTS_MARK-not slow} TESTS_TIMEOUT=${TESTS_TIMEOUT:-500}
      printf '%s\n' $files | xargs -P "${TESTS_JOBS:-8}" -I{} bash -c \
        'f={}; log="$OUT/pytest_$(basename "$f" .py).log"; timeout "$TESTS_TIMEOUT" python3 -m pytest -v -rs \
           -p no:cacheprovider --durations=10 -m "$TESTS_MARK" "$f" >"$log" 2>&1; rc=$?;
         echo "$f: rc=$rc: $(grep -E "(passed|failed|error|skipped|no tests ran)" "$log" | tail -n 1)"' \
        | sort | tee "$OUT/pytest_summary.log"
      grep -qv ": rc=0: " "$OUT/pytest_summary.log" && status=1 ;;
    peers)
      OUT=$OUT timeout 200 bash benchmarks/projection/build_peers.sh
      timeout 240 python3 benchmarks/projection/bench_projection_peers.py --commit "$COMMIT" --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log" ;;
    decode)
      timeout 300 python3 benchmarks/decode/bench_decode.py ${DECODE_ARGS---profile --step-times} 2>&1 | tee "$OUT/decode.log" ;;
    sitehost)
      timeout 120 python3 benchmarks/decode/bench_site_host.py 2>&1 | tee "$OUT/sitehost.log" ;;
    projhost)
      timeout 120 python3 benchmarks/projection/bench_projection_host.py 2>&1 | tee "$OUT/projhost.log" ;;
    compile)
      timeout 400 python3 benchmarks/step/bench_compile.py --variants "${COMPILE_VARIANTS-residual eager,residual compiled,mhc eager,mhc compiled}" 2>&1 | tee "$OUT/compile.log" ;;
    compile1b)
      timeout 500 python3 benchmarks/step/bench_compile.py --size 1b --batch 4 --variants "${COMPILE_VARIANTS-residual eager,residual compiled,mhc eager,mhc compiled}" 2>&1 | tee "$OUT/compile1b.log" ;;
    training)
      timeout 560 python3 benchmarks/step/bench_training.py --kernels --commit "$COMMIT" --json "$OUT/training.json" ${TRAINING_ARGS-} 2>&1 | tee "$OUT/training.log" ;;
    hostgap)
      for shape in ${HOSTGAP_SHAPES-small_gpu}; do
        timeout 280 python3 benchmarks/step/host_gap.py --shape "$shape" --rounds "${HOSTGAP_ROUNDS:-4}" 2>&1 \
          | tee "$OUT/host_gap_$shape.log" | tail -n 16
      done ;;
    profile)
      # shellcheck disable=SC2086  # the arguments are a list
      timeout 400 python3 benchmarks/step/profile_step.py ${PROFILE_ARGS---recipe autocast --shape small_gpu --compile --host-table} \
        2>&1 | tee "$OUT/profile.log" ;;
    sweep)
      timeout 500 python3 benchmarks/site/sweep_site_kernels.py --jobs 14 --json "$OUT/sweep.json" ${SWEEP_ARGS-} 2>&1 | tee "$OUT/sweep.log" ;;
    boundary)
      # shellcheck disable=SC2086  # the arguments are a list
      timeout 400 python3 benchmarks/site/boundary_sweep.py --json "$OUT/boundary.json" ${BOUNDARY_ARGS-} 2>&1 | tee "$OUT/boundary.log" ;;
    sweep32)
      timeout 500 python3 benchmarks/site/sweep_site_kernels.py --dtype float32 --jobs 14 --budget 450 \
        --json "$OUT/sweep32.json" ${SWEEP32_ARGS-} 2>&1 | tee "$OUT/sweep32.log" ;;
    ab)
      [ -d "${OLD_TREE-}" ] || { echo "ab: set OLD_TREE to a tree made by git archive" >&2; exit 2; }
      OUT=$OUT bash benchmarks/step/step_ab.sh "$OLD_TREE" 1b 4 new old new old
      OUT=$OUT bash benchmarks/step/step_ab.sh "$OLD_TREE" 134m 8 new old new old ;;
    trainab)
      [ -d "${OLD_TREE-}" ] || [ "${OLD_TREE-}" = - ] || { echo "trainab: set OLD_TREE to a tree made by git archive, or -" >&2; exit 2; }
      # shellcheck disable=SC2086  # the runs are a list
      OUT=$OUT bash benchmarks/step/training_ab.sh "$OLD_TREE" "${TRAINING_AB_ARGS---recipes autocast --modes eager}" \
        ${TRAINING_AB_RUNS-new old new old} || status=1 ;;
  esac
  echo "=== $stage: ${SECONDS}s"
done
exit $status
