"""Benchmark one mHC site against the plain residual block, and a ~125M Llama's training step (CUDA).

    python benchmarks/site/bench_block.py                  # block table, then the model step
    python benchmarks/site/bench_block.py --skip-model     # block table only
    python benchmarks/site/bench_block.py --skip-block --skip-torch   # model step, residual and fused only
    python benchmarks/site/bench_block.py --json out.json  # also write every printed figure to out.json

Block table: bf16, B=4, S=4096, C in {1024, 2048, 4096}; the branch F is a
SwiGLU MLP (intermediate 8C/3, rounded to 64) or a cheap one (RMSNorm + one
C×C linear). Rows: ``residual`` (``x + F(x)``, x: [B, S, C]), ``mhc torch``
(``MHCBlock(fused=False)``, the PyTorch path), ``mhc fused`` (the Triton
path) and ``fused rcmp`` (the Triton path with ``recompute=True``), n = 4
streams. Times are ``triton.testing.do_bench`` medians (ms)
after warm-up, all in one run. ``peak MB``: peak memory of one fwd+bwd above
the inputs. ``kept B/tok``: memory a forward leaves allocated for backward
per token, beyond its output (F's activations included; the input streams,
kept in every mode, are not counted). ``non-F GB/s``: the bytes the fused
kernels move (a model of their reads and writes) over the time the site
adds to F alone, against a device copy's GB/s measured in the same run.

Model step: LlamaForCausalLM (hidden 768, 12 layers, 12 heads, intermediate
2048, vocab 32000; ~134M parameters) against ``convert_to_mhc(n_streams=4)``
of it (``init="paper"``); bf16 weights (mHC coefficients fp32), batch 8 × seq
2048 (``--batch``, ``--seq``), SDPA attention, AdamW (fused); one step =
forward, loss, backward, optimizer step, zero_grad. The models are timed in
interleaved rounds (``--rounds``, default 2): each round runs 3 warm-up steps
and 10 timed steps (CUDA events) of every model in turn, and a model's figure
is the best of its round medians (``common.interleaved``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
from torch import nn
from triton.testing import do_bench

import mhc


class SwiGLU(nn.Module):
    def __init__(self, C: int):
        super().__init__()
        inner = (8 * C // 3 + 63) // 64 * 64
        self.gate_up = nn.Linear(C, 2 * inner, bias=False)
        self.down = nn.Linear(inner, C, bias=False)

    def forward(self, u):
        g, v = self.gate_up(u).chunk(2, dim=-1)
        return self.down(nn.functional.silu(g) * v)


class Cheap(nn.Module):
    def __init__(self, C: int):
        super().__init__()
        self.norm = nn.RMSNorm(C)
        self.lin = nn.Linear(C, C, bias=False)

    def forward(self, u):
        return self.lin(self.norm(u))


class Residual(nn.Module):
    def __init__(self, branch):
        super().__init__()
        self.branch = branch

    def forward(self, x):
        return x + self.branch(x)


def _bench(fn, grads=()):
    return do_bench(fn, warmup=50, rep=300, grad_to_none=list(grads), return_mode="median")


def _kept_bytes(module, x) -> int:
    """Memory a forward leaves allocated for backward, beyond its output (the input itself not counted)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = module(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    del out
    return kept


def _peak_mb(module, x, g) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    module(x).backward(g)
    torch.cuda.synchronize()
    for p in [x, *module.parameters()]:
        p.grad = None
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _fused_bytes(T: int, n: int, C: int, elt: int = 2) -> tuple[int, int]:
    """Stream bytes the fused kernels read and write: (forward, backward)."""
    per_kernel = common.site_stream_elements(n, C)
    fwd = per_kernel["coeff_partial"] + per_kernel["coeff_fwd"] + per_kernel["postmix_fwd"]
    bwd = sum(per_kernel[k] for k in ("postmix_bwd", "coeff_bwd", "stream_grad", "phi_grad"))
    return fwd * T * elt, bwd * T * elt


def block_table(n: int = 4, B: int = 4, S: int = 4096) -> dict:
    """Print the block table; return its figures (``copy_gbps`` and one dict per row)."""
    dt = torch.bfloat16
    copy = common.copy_gbps()
    print(f"device copy: {copy:.0f} GB/s")
    rows = []
    hdr = (
        f"{'branch':7} {'C':>5} {'impl':11} | {'fwd ms':>7} {'x res':>6} | {'f+b ms':>7} {'x res':>6} | "
        f"{'peak MB':>8} {'kept B/tok':>11} | {'non-F GB/s':>10} {'x copy':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for C in (1024, 2048, 4096):
        for bname, make in (("swiglu", SwiGLU), ("cheap", Cheap)):
            torch.manual_seed(0)
            branch = make(C).to("cuda", dt)
            x1 = torch.randn(B, S, C, device="cuda", dtype=dt, requires_grad=True)
            xs = torch.randn(B, S, n, C, device="cuda", dtype=dt, requires_grad=True)
            f_ms = _bench(lambda: branch(x1).backward(x1), [x1, *branch.parameters()])
            impls = {
                "residual": (Residual(branch), x1),
                "mhc torch": (mhc.MHCBlock(branch, C, n, init="paper", fused=False).cuda(), xs),
                "mhc fused": (mhc.MHCBlock(branch, C, n, init="paper", fused=True).cuda(), xs),
                "fused rcmp": (mhc.MHCBlock(branch, C, n, init="paper", recompute=True).cuda(), xs),
            }
            base = None
            for name, (mod, x) in impls.items():
                g = torch.randn_like(x)
                params = [x, *mod.parameters()]
                fwd = _bench(lambda: mod(x), params)
                fb = _bench(lambda: mod(x).backward(g), params)
                base = base or (fwd, fb)
                peak = _peak_mb(mod, x, g)
                kept = _kept_bytes(mod, x) / (B * S)
                row = dict(
                    branch=bname,
                    C=C,
                    impl=name,
                    fwd_ms=fwd,
                    fwd_x_res=fwd / base[0],
                    fwd_bwd_ms=fb,
                    fwd_bwd_x_res=fb / base[1],
                    peak_mb=peak,
                    kept_bytes_per_token=kept,
                )
                extra = ""
                if name == "mhc fused":
                    moved = sum(_fused_bytes(B * S, n, C))
                    gbps = moved / max(fb - f_ms, 1e-6) / 1e6
                    extra = f"{gbps:10.0f} {gbps / copy:6.2f}"
                    row.update(non_f_gbps=gbps, x_copy=gbps / copy)
                rows.append(row)
                print(
                    f"{bname:7} {C:5d} {name:11} | {fwd:7.3f} {fwd / base[0]:6.2f} | {fb:7.3f} {fb / base[1]:6.2f} | "
                    f"{peak:8.0f} {kept:11.0f} | {extra}"
                )
            impls = branch = x1 = xs = None  # freed (the step closures above read these names)
            torch.cuda.empty_cache()
    return {"copy_gbps": copy, "rows": rows}


def model_step(batch: int = 8, seq: int = 2048, torch_path: bool = True, rounds: int = 2) -> dict:
    """Print the model-step figures; return them (per model: best median ms, ratio, round medians, steps)."""
    cfg = common.llama_134m(seq)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    models = {"residual": common.llama_model(cfg), "mhc n=4 fused": common.llama_model(cfg, 4, init="paper")}
    if torch_path:
        models["mhc n=4 torch"] = common.llama_model(cfg, 4, init="paper", fused=False)
    n_params = sum(p.numel() for p in models["residual"].parameters())
    steps = {name: common.training_step(model, ids) for name, model in models.items()}
    results = common.interleaved(steps, rounds=rounds, steps=10, warmup=3)
    del models, steps
    torch.cuda.empty_cache()
    t_res = results["residual"].ms
    print(
        f"\nLlama {n_params / 1e6:.0f}M, bf16, batch {batch} x seq {seq}: training step (fwd+loss+bwd+AdamW), "
        f"best of {rounds} interleaved medians of 10"
    )
    for name, m in results.items():
        medians = " ".join(f"{ms:.2f}" for ms in m.round_medians)
        print(f"  {name:14} {m.ms:8.2f} ms  {m.ms / t_res:5.3f}x residual   (round medians {medians})")
    return {
        "params_m": n_params / 1e6,
        "batch": batch,
        "seq": seq,
        "rounds": rounds,
        "models": {
            name: {
                "ms": m.ms,
                "x_residual": m.ms / t_res,
                "round_medians": m.round_medians,
                "steps_ms": m.times,
            }
            for name, m in results.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-model", action="store_true", help="only the block table")
    ap.add_argument("--skip-block", action="store_true", help="only the model step")
    ap.add_argument("--skip-torch", action="store_true", help="model step: leave out the PyTorch mHC path")
    ap.add_argument("--batch", type=int, default=8, help="model step: sequences per batch (default 8)")
    ap.add_argument("--seq", type=int, default=2048, help="model step: sequence length (default 2048)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="model step: interleaved rounds, the best median kept (default 2)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the figures printed to PATH as JSON")
    args = ap.parse_args()
    common.require_cuda("bench_block.py")
    env = common.environment()
    print(f"{env['device']}, torch {env['torch']}")
    figures = {"environment": env}
    if not args.skip_block:
        figures["block_table"] = block_table()
    if not args.skip_model:
        figures["model_step"] = model_step(
            args.batch, args.seq, torch_path=not args.skip_torch, rounds=args.rounds
        )
    if args.json:
        common.write_json(args.json, figures)


if __name__ == "__main__":
    main()
