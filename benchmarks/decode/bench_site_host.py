"""Host and device time of one decode-sized mHC site, piece by piece (CUDA, no grad).

    python benchmarks/decode/bench_site_host.py                 # C=768, n=4, bf16, 1 and 16 tokens
    python benchmarks/decode/bench_site_host.py --hidden 2048 --tokens 1,4

A decode step of a small model is bound by its host time, so what a site
costs there is the host time of its calls. Each row runs one call ``--calls``
times: "host" is the time to enqueue them (perf_counter, no synchronisation,
fewer calls than the launch queue holds), "wall" the time until the device
has finished them too. Rows, all on the same streams ``x [T, n, C]``:

* ``site``: a whole ``MHCBlock`` call with a branch that returns its input;
* ``pre`` / ``post``: the extension's two no-grad token calls alone
  (``mhc.fused.tokens.pre_no_grad`` / ``post_no_grad``);
* ``post_pre``: a site boundary in generation, the post-mix and the next
  site's first step in one call (``mhc.fused.tokens.post_pre_no_grad``);
  ``post_pre_norm`` the same with the next branch's input RMSNorm applied too,
  against ``rms_norm``, HF's ``LlamaRMSNorm`` on ``[T, C]`` as a branch runs it;
* ``linked``: two linked blocks (``MHCBlock.set_next_site``) called in turn,
  per block (three launches for the two: a first step, a boundary, a post-mix);
* ``pre_grad`` / ``post_grad``: the same kernels called as the grad path
  calls them (``fused_tokens.pre`` / ``post``: four outputs, ``zr`` written,
  the Python-side conversions done before the call);
* ``add``: ``torch.add`` of two ``[T, C]`` tensors, the residual model's
  cost per site for comparison; ``empty``: one ``torch.empty``.

The best of ``--rounds`` interleaved rounds is kept per row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import mhc
from mhc.fused import tokens as fused_tokens


def rows_for(tokens: int, C: int, n: int, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    block = mhc.MHCBlock(lambda u: u, C, n, init="paper").cuda()
    with torch.no_grad():
        block.phi.normal_(std=0.02)
    x = torch.randn(tokens, n, C, device="cuda", dtype=dtype)
    first = mhc.MHCBlock(lambda u: u, C, n, init="paper").cuda()
    second = mhc.MHCBlock(lambda u: u, C, n, init="paper", layer_index=1).cuda()
    first.load_state_dict(block.state_dict())
    first.set_next_site(second)
    params = [p.detach() for p in (block.phi, block.alpha, block.b_pre, block.b_post, block.b_res)]
    u, mix, xs, _ = fused_tokens.pre_no_grad(x, *params, block.norm_eps, block.tol)
    rms_norm = LlamaRMSNorm(C, eps=1e-6).to("cuda", dtype)  # a branch's input norm, as HF runs it
    norm = (rms_norm.weight.detach(), rms_norm.variance_epsilon)
    tol_eff = mhc.projection.effective_tol(block.tol, n, torch.float32)
    _, _, h, h_res = fused_tokens.pre(x, *params, block.norm_eps, tol_eff, mhc.projection.NEWTON_MAX_ITER)
    a, b = (
        torch.randn(tokens, C, device="cuda", dtype=dtype),
        torch.randn(tokens, C, device="cuda", dtype=dtype),
    )
    return {
        "site": lambda: block(x),
        "pre": lambda: fused_tokens.pre_no_grad(x, *params, block.norm_eps, block.tol),
        "post": lambda: fused_tokens.post_no_grad(xs, u, mix),
        "post_pre": lambda: fused_tokens.post_pre_no_grad(xs, u, mix, *params, block.norm_eps, block.tol),
        "post_pre_norm": lambda: fused_tokens.post_pre_no_grad(
            xs, u, mix, *params, block.norm_eps, block.tol, norm
        ),
        "rms_norm": lambda: rms_norm(u),
        "linked": lambda: second(first(x)),
        "pre_grad": lambda: fused_tokens.pre(
            x, *params, block.norm_eps, tol_eff, mhc.projection.NEWTON_MAX_ITER
        ),
        "post_grad": lambda: fused_tokens.post(x, u, h, h_res),
        "add": lambda: torch.add(a, b),
        "empty": lambda: torch.empty(tokens, C, device="cuda", dtype=dtype),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768, help="C (default 768)")
    ap.add_argument("--streams", type=int, default=4, choices=(4, 8), help="n (default 4)")
    ap.add_argument("--tokens", default="1,16", help="comma-separated token counts (default 1,16)")
    ap.add_argument("--calls", type=int, default=300, help="calls per timing (default 300)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds, the best kept (default 5)")
    args = ap.parse_args()
    common.require_cuda("bench_site_host.py")
    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  C={args.hidden} n={args.streams} bf16"
    )
    print(f"  {'tokens':>6} {'call':>6} {'host µs':>9} {'wall µs':>9}")
    with torch.no_grad():
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows = rows_for(tokens, args.hidden, args.streams, torch.bfloat16)
            best = common.best_host_and_wall_us(rows, args.calls, args.rounds)
            for name, (host, wall) in best.items():
                if name == "linked":  # two blocks per call
                    host, wall = host / 2, wall / 2
                print(f"  {tokens:6d} {name:>6} {host:9.2f} {wall:9.2f}")


if __name__ == "__main__":
    main()
