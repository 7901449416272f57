"""What the branch's input dtype costs a decoder layer's input norm under bf16 autocast (issue #49).

Until 0a3dd54 a converted Llama layer under ``torch.autocast(bfloat16)`` with float32 weights
got its branch input ``u`` in the streams' dtype (bf16), where the residual model's norm gets
a float32 hidden state; LlamaRMSNorm then cast ``u`` up, back down and multiplied a float32
weight by a bf16 tensor, and autograd cast the gradients back. Now ``u`` is float32 there
(:func:`mhc.site.branch_input_dtype`). This times the norm and the first projection (forward
and backward) on a bf16 and on a float32 ``u`` of the same values (``common.interleaved``:
best of two interleaved round medians).

Usage: python benchmarks/step/branch_input_dtype.py [--tokens 8192] [--hidden 2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    common.require_cuda("branch_input_dtype.py")
    T, C = args.tokens, args.hidden
    norm = LlamaRMSNorm(C).cuda()
    proj = torch.nn.Linear(C, 3 * C, bias=False).cuda()  # q, k, v as one
    base = torch.randn(T, C, device="cuda").bfloat16()
    grad = torch.randn(T, 3 * C, device="cuda").bfloat16()

    def step(u: torch.Tensor):
        def run() -> None:
            leaf = u.detach().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = proj(norm(leaf))
            out.backward(grad)

        return run

    results = common.interleaved(
        {"bf16": step(base), "fp32": step(base.float())}, rounds=2, steps=args.steps, warmup=5
    )
    env = common.environment()
    print(f"{env['device']}: T={T} C={C}, norm + [C, 3C] projection, forward + backward, autocast bf16")
    for name, m in results.items():
        medians = ", ".join(f"{t * 1e3:.1f}" for t in m.round_medians)
        print(f"  u {name}: {m.ms * 1e3:8.1f} µs (round medians {medians})")
    print(f"  fp32 - bf16: {(results['fp32'].ms - results['bf16'].ms) * 1e3:+.1f} µs per norm")


if __name__ == "__main__":
    main()
