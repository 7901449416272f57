#!/usr/bin/env bash
# One-shot GPU check: install, build, then the projection kernels (smoke test,
# GPU pytest, benchmark) or the fused block (stage "block": its tests,
# benchmarks/site/gpu_block_smoke.py and benchmarks/site/bench_block.py). Logs go to $OUT (or ./gpu_out).
# Run from the repository root.
USAGE="Usage: benchmarks/gpu_check.sh [all|smoke|test|bench|block] [pytest -k expression]"
case "${1:-}" in
  -h|--help) echo "$USAGE"; sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  ""|all|smoke|test|bench|block) ;;
  *) echo "unknown stage '$1'; $USAGE" >&2; exit 2 ;;
esac
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STAGE=${1:-all}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/env.log"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
SECONDS=0
python3 -m mhc.cuda_build >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: ${SECONDS}s"
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)" | tee -a "$OUT/env.log"

if [ "$STAGE" = block ]; then
  SECONDS=0
  timeout 300 python3 -m pytest -q -rs tests/test_fused_block.py tests/test_block.py ${2:+-k "$2"} 2>&1 | tee "$OUT/pytest_block.log" | tail -15
  echo "pytest: ${SECONDS}s"
  timeout 120 python3 benchmarks/site/gpu_block_smoke.py 2>&1 | tee "$OUT/gpu_block_smoke.log"
  SECONDS=0
  timeout 400 python3 benchmarks/site/bench_block.py --json "$OUT/bench_block.json" 2>&1 | tee "$OUT/bench_block.log"
  echo "bench: ${SECONDS}s"
  exit 0
fi

timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/smoke.log"
import time, torch, mhc
from mhc import projection as P
for n in (4, 8):
    for sigma in (1.0, 10.0, 30.0):
        R = torch.randn(1 << 20, n, n, device="cuda") * sigma
        T, info = mhc.birkhoff_project(R, return_info=True)
        torch.cuda.synchronize()
        e = mhc.marginal_error(T)
        it = info.iterations.float()
        print(f"smoke n={n} sigma={sigma}: err mean {e.mean():.2e} max {e.max():.2e} "
              f"unconverged {info.num_unconverged} iters mean {it.mean():.2f} max {int(it.max())}", flush=True)
PY
[ "$STAGE" = smoke ] && exit 0

if [ "$STAGE" = all ] || [ "$STAGE" = test ]; then
  SECONDS=0
  timeout 240 python3 -m pytest -q -rA -s --durations=8 tests/test_projection_cuda.py ${2:+-k "$2"} 2>&1 | tee "$OUT/pytest.log" | grep -E "PASS|FAIL|ERROR|passed|failed|error|marginal err|grad n=|iterations|Error|assert" | head -120
  echo "pytest: ${SECONDS}s"
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  SECONDS=0
  timeout 200 python3 benchmarks/projection/bench_projection.py 2>&1 | tee "$OUT/bench.log"
  echo "bench: ${SECONDS}s"
fi
