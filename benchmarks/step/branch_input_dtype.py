"""What the branch's input dtype costs a decoder layer's input norm under bf16 autocast (issue #49).

A converted Llama layer under ``torch.autocast(bfloat16)`` with float32 weights gets its
branch input ``u`` in the streams' dtype (bf16), where the residual model's norm gets a
float32 hidden state. LlamaRMSNorm then casts ``u`` up, back down and multiplies a float32
weight by a bf16 tensor, and autograd casts the gradients back. This times the norm and the
first projection (forward and backward) on a bf16 and on a float32 ``u`` of the same values,
interleaved, best of two medians (CUDA events).

Usage: python benchmarks/step/branch_input_dtype.py [--tokens 8192] [--hidden 2048]
"""

from __future__ import annotations

import argparse

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda")
    T, C = args.tokens, args.hidden
    norm = LlamaRMSNorm(C).to(dev)
    proj = torch.nn.Linear(C, 3 * C, bias=False).to(dev)  # q, k, v as one
    base = torch.randn(T, C, device=dev).bfloat16()
    inputs = {"bf16": base.clone(), "fp32": base.float()}
    grad = torch.randn(T, 3 * C, device=dev).bfloat16()

    def step(u: torch.Tensor) -> None:
        u = u.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = proj(norm(u))
        out.backward(grad)

    times = {k: [] for k in inputs}
    for _ in range(2):
        for name, u in inputs.items():
            for _ in range(5):
                step(u)
            runs = []
            for _ in range(args.steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step(u)
                b.record()
                b.synchronize()
                runs.append(a.elapsed_time(b))
            runs.sort()
            times[name].append(runs[len(runs) // 2])
    best = {k: min(v) for k, v in times.items()}
    print(
        f"{torch.cuda.get_device_name()}: T={T} C={C}, norm + [C, 3C] projection, forward + backward, autocast bf16"
    )
    for k, v in best.items():
        print(f"  u {k}: {v * 1e3:8.1f} µs (round medians {', '.join(f'{t * 1e3:.1f}' for t in times[k])})")
    print(f"  fp32 - bf16: {(best['fp32'] - best['bf16']) * 1e3:+.1f} µs per norm")


if __name__ == "__main__":
    main()
