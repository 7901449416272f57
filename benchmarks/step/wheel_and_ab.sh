#!/usr/bin/env bash
# On a CUDA machine, from the repository root:
#   bash benchmarks/step/wheel_and_ab.sh [BEFORE_COMMIT]   (default f52d310)
# 1. builds the wheel, installs it non-editable into a fresh virtualenv and runs a fused MHCBlock from it
#    with warnings as errors (no fallback), against the PyTorch path;
# 2. times the 134M model step in alternating processes: this tree (from the wheel) and BEFORE_COMMIT
#    (git archive of its mhc/ csrc/ scripts/; its scripts/bench_block.py: the layout before mhc/csrc and benchmarks/);
# 3. runs the GPU suite against the installed wheel (python -P: the checkout is not imported).
# Logs go to $OUT (default ./wheel_and_ab_out).
set -o pipefail
export PYTHONUNBUFFERED=1
REPO=$(pwd)
BEFORE_COMMIT=${1:-f52d310}
OUT=${OUT:-$REPO/wheel_and_ab_out}; mkdir -p $OUT
BEFORE=/tmp/mhc_before; rm -rf $BEFORE; mkdir -p $BEFORE
git archive $BEFORE_COMMIT mhc csrc scripts pyproject.toml | tar -x -C $BEFORE
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.log
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/gpu.log
git log -1 --format='%H %s' 2>/dev/null | tee -a $OUT/gpu.log
# the "before" extension builds in the background meanwhile (its own cache dir)
( cd /tmp && PYTHONPATH=$BEFORE TORCH_EXTENSIONS_DIR=/tmp/ext_before MAX_JOBS=8 python3 -c "
import mhc.projection.cuda as p, mhc.fused as f; print('before projection', p.available())" ) > $OUT/before_build.log 2>&1 &
BG=$!
export TORCH_EXTENSIONS_DIR=/tmp/ext_after
{ python3 -m pip wheel -q --no-deps --no-build-isolation -w /tmp/w . && python3 -m venv --system-site-packages /tmp/venv \
  && python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))" > /tmp/venv/lib/python3.12/site-packages/base_site.pth \
  && /tmp/venv/bin/python -m pip install -q --no-deps --no-index /tmp/w/*.whl && cat /tmp/venv/lib/python3.12/site-packages/base_site.pth && ls -l /tmp/w \
  && python3 -m zipfile -l /tmp/w/*.whl | grep -E "csrc|LICENSE"; } 2>&1 | tee $OUT/wheel.log
cd /tmp && timeout 200 /tmp/venv/bin/python -P - <<'PY' 2>&1 | tee -a $OUT/wheel.log
import time, warnings
warnings.simplefilter("error")  # a fallback warning fails this check
import torch, mhc
from torch import nn
from mhc.projection import cuda as projection_cuda
print("mhc from", mhc.__file__)
t = time.time(); ok = projection_cuda.available(); print("CUDA projection available:", ok, f"(build+load {time.time() - t:.1f} s)")
C, n = 768, 4
torch.manual_seed(0)
branch = nn.Sequential(nn.RMSNorm(C), nn.Linear(C, C)).cuda()
fast = mhc.MHCBlock(branch, C, n, init="paper").cuda()
ref = mhc.MHCBlock(branch, C, n, init="paper", fused=False).cuda()
ref.load_state_dict(fast.state_dict())
x = torch.randn(2, 256, n, C, device="cuda")
print("uses_fused:", fast.uses_fused(x), "reference uses_fused:", ref.uses_fused(x))
assert fast.uses_fused(x) and not ref.uses_fused(x)
xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
ya, yb = fast(xa), ref(xb)
g = torch.randn_like(ya)
(ya * g).sum().backward(); (yb * g).sum().backward()
print("fwd max |diff|:", (ya - yb).abs().max().item(), " dx max |diff|:", (xa.grad - xb.grad).abs().max().item(),
      " dphi rel:", ((fast.phi.grad - ref.phi.grad).norm() / ref.phi.grad.norm()).item())
torch.testing.assert_close(ya, yb, rtol=1e-4, atol=1e-4)
print("WHEEL CHECK OK")
PY
cd $REPO
wait $BG; tail -3 $OUT/before_build.log
# interleaved A/B: after, before, after, before, after, before (one process each)
for i in 1 2; do
  ( cd $REPO/benchmarks/site && timeout 150 /tmp/venv/bin/python bench_block.py --skip-block --skip-torch --rounds 2 --json $OUT/after_$i.json ) 2>&1 | grep -v Warning | tee -a $OUT/ab.log
  echo "=== before $i" | tee -a $OUT/ab.log
  ( cd $BEFORE/scripts && PYTHONPATH=$BEFORE TORCH_EXTENSIONS_DIR=/tmp/ext_before timeout 150 python3 bench_block.py --skip-block --skip-torch ) 2>&1 | grep -v Warning | tee -a $OUT/ab.log
done

# the GPU suite, against the installed wheel (-P: the repo is not on sys.path)
for tt in tests/test_projection_cuda.py:140 tests/test_fused_block.py:200 tests/test_nonfinite.py:60 tests/test_block.py:100; do
  t=${tt%:*}; timeout ${tt#*:} /tmp/venv/bin/python -P -m pytest -q -p no:cacheprovider $t 2>&1 | tee $OUT/$(basename $t .py).log | tail -4
done
/tmp/venv/bin/python -P -c "import mhc; print('tests ran against', mhc.__file__)"
