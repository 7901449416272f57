"""Benchmark one mHC site against the plain residual block, and a ~125M Llama's training step (CUDA).

    python scripts/bench_block.py                  # block table, then the model step
    python scripts/bench_block.py --skip-model     # block table only
    python scripts/bench_block.py --skip-block --skip-torch   # model step, residual and fused only

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
of it; bf16 weights (mHC coefficients fp32), batch 8 × seq 2048 (``--batch``, ``--seq``), SDPA
attention, AdamW (fused); one step = forward, loss, backward, optimizer
step, zero_grad.
"""

from __future__ import annotations

import argparse

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


def _copy_gbps() -> float:
    a = torch.empty(2**28, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a))
    return 2 * a.numel() * 2 / ms / 1e6


def _fused_bytes(T: int, n: int, C: int, elt: int = 2) -> tuple[int, int]:
    """Stream bytes the fused kernels read and write: (forward, backward)."""
    nC = n * C
    fwd = (nC) + (nC + C) + (nC + C + nC)  # coefficients; pre-mix; post-mix
    bwd = (2 * nC + 2 * C) + (nC + C) + (2 * nC + C + nC) + nC  # postmix_bwd; coeff_bwd; stream_grad (dx); phi_grad
    return fwd * T * elt, bwd * T * elt


def block_table(n: int = 4, B: int = 4, S: int = 4096) -> None:
    dt = torch.bfloat16
    copy = _copy_gbps()
    print(f"device copy: {copy:.0f} GB/s")
    hdr = (f"{'branch':7} {'C':>5} {'impl':11} | {'fwd ms':>7} {'x res':>6} | {'f+b ms':>7} {'x res':>6} | "
           f"{'peak MB':>8} {'kept B/tok':>11} | {'non-F GB/s':>10} {'x copy':>6}")
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
                extra = ""
                if name == "mhc fused":
                    moved = sum(_fused_bytes(B * S, n, C))
                    gbps = moved / max(fb - f_ms, 1e-6) / 1e6
                    extra = f"{gbps:10.0f} {gbps / copy:6.2f}"
                print(f"{bname:7} {C:5d} {name:11} | {fwd:7.3f} {fwd / base[0]:6.2f} | {fb:7.3f} {fb / base[1]:6.2f} | "
                      f"{peak:8.0f} {kept:11.0f} | {extra}")
            del impls, branch, x1, xs
            torch.cuda.empty_cache()


def llama_134m(seq: int = 2048):
    """The LlamaConfig of the model-step benchmark (hidden 768, 12 layers, ~134M parameters)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
        intermediate_size=2048, vocab_size=32000, max_position_embeddings=seq, attn_implementation="sdpa",
    )


def model_step(batch: int = 8, seq: int = 2048, torch_path: bool = True) -> None:
    from transformers import LlamaForCausalLM

    cfg = llama_134m(seq)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

    def step_ms(model, steps: int = 10) -> float:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        times = []
        for i in range(3 + steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:  # warm-up: allocator, kernel compilation, autotuning
                times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    def fresh():
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)

    base = fresh()
    n_params = sum(p.numel() for p in base.parameters())
    results = {"residual": step_ms(base)}
    del base
    model = mhc.convert_to_mhc(fresh(), n_streams=4, init="paper")
    results["mhc n=4 fused"] = step_ms(model)
    if torch_path:
        for m in model.modules():
            if isinstance(m, mhc.MHCBlock):
                m.fused = False
        results["mhc n=4 torch"] = step_ms(model)
    del model
    torch.cuda.empty_cache()
    t_res = results["residual"]
    print(f"\nLlama {n_params / 1e6:.0f}M, bf16, batch {batch} x seq {seq}: training step (fwd+loss+bwd+AdamW), median of 10")
    for name, ms in results.items():
        print(f"  {name:14} {ms:8.2f} ms  {ms / t_res:5.3f}x residual")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-model", action="store_true", help="only the block table")
    ap.add_argument("--skip-block", action="store_true", help="only the model step")
    ap.add_argument("--skip-torch", action="store_true", help="model step: leave out the PyTorch mHC path")
    ap.add_argument("--batch", type=int, default=8, help="model step: sequences per batch (default 8)")
    ap.add_argument("--seq", type=int, default=2048, help="model step: sequence length (default 2048)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_block.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if not args.skip_block:
        block_table()
    if not args.skip_model:
        model_step(args.batch, args.seq, torch_path=not args.skip_torch)


if __name__ == "__main__":
    main()
