"""The Python an mHC decoder layer runs around its kernels at a decode step, on any machine (no GPU needed).

    python benchmarks/decode/bench_site_glue.py                 # best of 200 rounds of 50 layer calls
    python benchmarks/decode/bench_site_glue.py --rounds 50 --profile

A decode step is host-bound (``notes/decode_and_projection.md``), so every
microsecond of Python per site counts 24 times a step in the 134M model. This
times one converted Llama decoder layer on a one-token ``[1, 1, n, C]`` input
with its norms, attention and MLP replaced by pass-throughs and the fused
site's kernel calls (``mhc.fused.site.pre``, ``post_then_pre`` and ``post``,
on the decode backend ``Backend.TOKENS``) replaced by functions
returning fixed tensors, so that what is left is the layer's and the sites'
own Python (the HF glue, ``MHCBlock``'s checks, the branch call, the boundary
link). The residual ``LlamaDecoderLayer`` with the same pass-throughs runs in
the same rounds, interleaved; "per site" is the difference over the layer's
two sites. ``bench_site_host.py`` times the real calls on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import time

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import mhc
from mhc import fused
from mhc.fused import site as fused_site  # needs Triton (the test extra has it)
from mhc.fused.record import Backend, FusedSite

N_STREAMS, HIDDEN = 4, 64


class PassAttention(nn.Module):
    def forward(self, hidden_states, **kwargs):
        return hidden_states, None


class Pass(nn.Module):
    def forward(self, x):
        return x


def cheap_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        layer.self_attn, layer.mlp = PassAttention(), Pass()
        layer.input_layernorm, layer.post_attention_layernorm = Pass(), Pass()
    return model.eval()


def mock_extension_calls() -> None:
    """The fused site's extension calls return fixed tensors (one per shape); every block takes the token path."""
    mix = torch.zeros(2 * N_STREAMS + N_STREAMS**2)
    held: dict = {}

    def fixed(shape: torch.Size) -> torch.Tensor:
        if shape not in held:
            held[shape] = torch.zeros(shape)
        return held[shape]

    def pre(backend, x, *args):
        return fixed(x.shape[:-2] + x.shape[-1:]), FusedSite(Backend.TOKENS, x, mix, None)

    def post_pre(y, site, *args):
        x_new = fixed(site.streams.shape)
        return x_new, fixed(x_new.shape[:-2] + x_new.shape[-1:]), FusedSite(Backend.TOKENS, x_new, mix, None)

    mhc.MHCBlock.uses_fused = lambda self, x: True
    fused.fused_backend = lambda x: Backend.TOKENS
    fused_site.pre = pre
    fused_site.post_then_pre = post_pre
    fused_site.post = lambda y, site: fixed(site.streams.shape)


def layer_call(layer: nn.Module, hidden: torch.Tensor, calls: int) -> float:
    """µs per call of ``layer(hidden, **decode inputs)``, over ``calls`` calls."""
    cache = (
        "cache" if "cache" in inspect.signature(LlamaDecoderLayer.forward).parameters else "past_key_values"
    )
    inputs = {
        "attention_mask": None,
        "position_ids": torch.zeros(1, 1, dtype=torch.long),
        cache: None,
        "use_cache": True,
        "cache_position": torch.zeros(1, dtype=torch.long),
        "position_embeddings": (torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)),
    }
    t0 = time.perf_counter()
    for _ in range(calls):
        layer(hidden, **inputs)
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="interleaved rounds, the best kept (default 200)")
    ap.add_argument("--calls", type=int, default=50, help="layer calls a round (default 50)")
    ap.add_argument("--profile", action="store_true", help="also cProfile the mHC layer (20000 calls)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        ap.error("--rounds and --calls must be >= 1")
    torch.manual_seed(0)
    residual = cheap_llama().model.layers[1]  # a layer after the first: no stream expansion
    converted = mhc.convert_to_mhc(cheap_llama(), n_streams=N_STREAMS, init="paper").eval()
    layer = converted.decoder_layers()[1]
    mock_extension_calls()
    h_residual, h_mhc = torch.zeros(1, 1, HIDDEN), torch.zeros(1, 1, N_STREAMS, HIDDEN)
    best = {"residual": float("inf"), "mhc": float("inf")}
    with torch.no_grad():
        for _ in range(3):  # warm-up
            layer_call(residual, h_residual, args.calls)
            layer_call(layer, h_mhc, args.calls)
        for _ in range(args.rounds):
            best["residual"] = min(best["residual"], layer_call(residual, h_residual, args.calls))
            best["mhc"] = min(best["mhc"], layer_call(layer, h_mhc, args.calls))
    per_site = (best["mhc"] - best["residual"]) / len(layer.site_names)
    print(
        f"decoder layer, one token, pass-through sublayers, best of {args.rounds} rounds of {args.calls} calls: "
        f"residual {best['residual']:.2f} µs, mHC {best['mhc']:.2f} µs; {per_site:.2f} µs more a site"
    )
    if args.profile:
        profiler = cProfile.Profile()
        with torch.no_grad():
            profiler.runcall(layer_call, layer, h_mhc, 20000)
        pstats.Stats(profiler).strip_dirs().sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
