"""The model step under ``torch.compile``: mHC against the residual model, eager and compiled (CUDA).

    python benchmarks/step/bench_compile.py                       # 134M Llama, batch 8 x 2048
    python benchmarks/step/bench_compile.py --size 1b --batch 4   # the 1.1B Llama (GQA 32/4)
    python benchmarks/step/bench_compile.py --variants "residual compiled,mhc compiled"
    python benchmarks/step/bench_compile.py --json out.json
    python benchmarks/step/bench_compile.py --variants "residual eager,mhc eager,mhc eager keep" --keep-streams-every 5

Variants (``--variants``, comma-separated; all by default):

* ``residual eager`` / ``residual compiled``: ``LlamaForCausalLM``;
* ``mhc eager``: ``convert_to_mhc(n_streams=4, init="paper")``, fused site;
* ``mhc eager keep``: the same with ``keep_streams_every=--keep-streams-every``
  (default 5): streams kept at every k-th site, recomputed between (#22);
* ``mhc compiled``: the same model compiled, with the default ``fused=True``;
* ``mhc compiled torch``: ``fused=False``, compiled: the PyTorch site
  (:mod:`mhc.site`), which inductor fuses, around the CUDA projection op.

Compiling is ``model.forward = torch.compile(model.forward, fullgraph=True)``
(``--no-fullgraph`` drops ``fullgraph``), default mode, inductor. The first
step of a compiled model is timed on its own (compile time, forward and
backward). Dynamo's graph-break and graph counters are printed per model.
Steps are timed as in ``bench_block.py``: interleaved rounds (``--rounds``),
3 warm-up and 10 timed steps each, the best of the round medians kept.
Then each model's step peak memory (``common.step_peak_memory``: its
parameters and optimizer state plus one step's peak above what was allocated
before it), so models sharing the process are compared as if alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
from torch._dynamo.utils import counters

VARIANTS = (
    "residual eager",
    "residual compiled",
    "mhc eager",
    "mhc eager keep",
    "mhc compiled",
    "mhc compiled torch",
)


def llama_1b(seq: int):
    """The 1.1B Llama of the training-cost issue: hidden 2048, 22 layers, 32 heads (4 KV), intermediate 5632."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=2048,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=5632,
        vocab_size=32000,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )


def build(name: str, cfg, fullgraph: bool, keep_streams_every: int):
    options = {} if name.startswith("residual") else {"n_streams": 4, "init": "paper"}
    if name == "mhc compiled torch":
        options["fused"] = False
    if name == "mhc eager keep":
        options["keep_streams_every"] = keep_streams_every
    model = common.llama_model(cfg, **options)
    if "compiled" in name:
        model.forward = torch.compile(model.forward, fullgraph=fullgraph)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("134m", "1b"), default="134m", help="model size (default 134m)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    ap.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    ap.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds, the best median kept (default 2)"
    )
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS)
    )
    ap.add_argument("--no-fullgraph", action="store_true", help="compile without fullgraph=True")
    ap.add_argument(
        "--keep-streams-every", type=int, default=5, help="the 'mhc eager keep' variant's (default 5)"
    )
    ap.add_argument("--json", metavar="PATH", help="also write the figures printed to PATH as JSON")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {VARIANTS}")
    common.require_cuda("bench_compile.py")
    env = common.environment()
    print(f"{env['device']}, torch {env['torch']}")

    cfg = common.llama_134m(args.seq) if args.size == "134m" else llama_1b(args.seq)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    steps, first_step_s, dynamo, models = {}, {}, {}, {}
    for name in names:
        counters.clear()
        model = build(name, cfg, fullgraph=not args.no_fullgraph, keep_streams_every=args.keep_streams_every)
        step = common.training_step(model, ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            step()  # compiles forward and backward for compiled variants
        except Exception as err:  # reported and left out, so the other variants still run
            print(f"  {name}: first step failed: {type(err).__name__}: {str(err)[:2000]}", flush=True)
            del model, step
            torch.cuda.empty_cache()
            continue
        torch.cuda.synchronize()
        first_step_s[name] = time.perf_counter() - t0
        step()
        torch.cuda.synchronize()
        dynamo[name] = {
            "graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"]["unique_graphs"],
        }
        steps[name] = step
        models[name] = model
        print(f"  built {name:20} first step {first_step_s[name]:7.1f} s  dynamo {dynamo[name]}", flush=True)

    results = common.interleaved(steps, rounds=args.rounds, steps=10, warmup=3)
    base = {"eager": results.get("residual eager"), "compiled": results.get("residual compiled")}
    print(
        f"\nLlama {args.size}, bf16, batch {args.batch} x seq {args.seq}: training step "
        f"(fwd+loss+bwd+AdamW), best of {args.rounds} interleaved medians of 10"
    )
    figures = {"environment": env, "size": args.size, "batch": args.batch, "seq": args.seq, "models": {}}
    memory = {name: common.step_peak_memory(models[name], steps[name]) for name in steps}
    base_memory = {kind: memory.get(f"residual {kind}") for kind in ("eager", "compiled")}
    for name, m in results.items():
        kind = "compiled" if "compiled" in name else "eager"
        ref, ref_memory = base[kind], base_memory[kind]
        ratio = f"{m.ms / ref.ms:5.3f}x residual {kind}" if ref else ""
        peak = memory[name]["peak_gb"]
        peak_ratio = f" ({peak / ref_memory['peak_gb']:.3f}x)" if ref_memory else ""
        medians = " ".join(f"{ms:.2f}" for ms in m.round_medians)
        print(
            f"  {name:20} {m.ms:8.2f} ms  {ratio}   peak {peak:6.2f} GB{peak_ratio}   "
            f"(round medians {medians}; first step {first_step_s[name]:.1f} s)"
        )
        figures["models"][name] = {
            "ms": m.ms,
            "x_residual": m.ms / ref.ms if ref else None,
            "round_medians": m.round_medians,
            "first_step_s": first_step_s[name],
            "dynamo": dynamo[name],
            **memory[name],
            "peak_x_residual": peak / ref_memory["peak_gb"] if ref_memory else None,
        }
    if args.json:
        common.write_json(args.json, figures)


if __name__ == "__main__":
    main()
