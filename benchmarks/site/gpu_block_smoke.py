"""MHCBlock on CUDA (bf16 streams, fused site) against the same block on the CPU in fp32.

    python benchmarks/site/gpu_block_smoke.py

Prints the relative errors of the output, of dx and of the coefficient
parameters' gradients, and fails (AssertionError) above 2e-2 / 5e-2 / 5e-2.
"""

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
from torch import nn

import mhc


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    common.require_cuda("gpu_block_smoke.py")
    torch.manual_seed(0)
    C, n = 256, 4
    branch = nn.Sequential(nn.RMSNorm(C), nn.Linear(C, 3 * C), nn.SiLU(), nn.Linear(3 * C, C))
    cpu = mhc.MHCBlock(branch, C, n, init="paper")
    with torch.no_grad():
        cpu.b_res.normal_(0, 3)
        cpu.alpha.fill_(0.5)
    gpu = copy.deepcopy(cpu).cuda()
    gpu.branch.to(torch.bfloat16)
    x = torch.randn(4, 512, n, C)
    x_gpu = x.cuda().to(torch.bfloat16).requires_grad_()
    x_cpu = x_gpu.detach().float().cpu().requires_grad_()
    assert gpu.uses_fused(x_gpu), "the CUDA block does not run the fused site"
    ref, out = cpu(x_cpu), gpu(x_gpu)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g.cuda().to(torch.bfloat16))
    rel = ((out.float().cpu() - ref).norm() / ref.norm()).item()
    grel = ((x_gpu.grad.float().cpu() - x_cpu.grad).norm() / x_cpu.grad.norm()).item()
    prel = max(
        ((pg.grad.float().cpu() - pc.grad).norm() / pc.grad.norm()).item()
        for (name, pc), (_, pg) in zip(cpu.named_parameters(), gpu.named_parameters())
        if not name.startswith("branch")
    )
    H = gpu.coefficients(x_gpu)[2]
    print(
        f"block cuda bf16 vs cpu fp32: out rel {rel:.2e}  dx rel {grel:.2e}  coeff-param grad rel (max) {prel:.2e}  "
        f"H_res dtype {H.dtype}  max marginal err {mhc.marginal_error(H).max().item():.2e}"
    )
    assert rel < 2e-2 and grel < 5e-2 and prel < 5e-2


if __name__ == "__main__":
    main()
