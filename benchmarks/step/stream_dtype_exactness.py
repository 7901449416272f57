"""How far a converted model's logits move from the residual model's with each ``MHCConfig.stream_dtype``.

    python benchmarks/step/stream_dtype_exactness.py                                   # tiny Llama on the CPU
    python benchmarks/step/stream_dtype_exactness.py --shape 134m --device cuda --json out.json

A random Llama (``--shape``: ``tiny``, 4 layers of 256, or the 134M of ``common.llama_134m``) is converted with the
identity init (``φ = 0``: the mHC model computes the residual model's function) once per stream dtype setting. Both
models run the same batch in two recipes, float32 and bf16 autocast (``torch.autocast``), and the table gives the
largest |logit difference| from the residual model in the same recipe, divided by the largest |logit|. For scale,
the row ``autocast itself`` is the residual model under autocast against itself in float32: what the recipe already
costs. ``hidden`` should be 0 in both recipes; ``autocast`` 0 in float32 and a bf16 rounding under autocast.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch

SETTINGS = ("hidden", "autocast")


def build_llama(shape: str, seq: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == "134m":
        cfg = common.llama_134m(seq)
    else:
        cfg = LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=seq,
        )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def logits(model, ids: torch.Tensor, recipe: str) -> torch.Tensor:
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=recipe == "autocast"):
        return model(ids).logits.float()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("tiny", "134m"), default="tiny")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--json", metavar="PATH", help="write the rows and the environment to PATH")
    args = ap.parse_args(argv)
    import mhc

    device = torch.device(args.device)
    base = build_llama(args.shape, args.seq, device)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), device=device)
    reference = {recipe: logits(base, ids, recipe) for recipe in ("float32", "autocast")}
    rows = [
        {
            "setting": "autocast itself (residual model)",
            "float32": None,
            "autocast": relative(reference["autocast"], reference["float32"]),
        }
    ]
    for setting in SETTINGS:
        model = mhc.convert_to_mhc(copy.deepcopy(base), stream_dtype=setting, verify=False).eval()
        rows.append(
            {"setting": setting, **{r: relative(logits(model, ids, r), reference[r]) for r in reference}}
        )
        del model
    print(
        f"{args.shape} Llama, {args.batch} x {args.seq} tokens on {common.environment()['device']}: "
        "max |logit - residual's| / max |logit|, same recipe"
    )
    print("| stream_dtype | float32 | bf16 autocast |\n|---|---|---|")
    for r in rows:
        cells = ("—" if r[k] is None else f"{r[k]:.2e}" for k in ("float32", "autocast"))
        print(f"| {r['setting']} | " + " | ".join(cells) + " |")
    if args.json:
        common.write_json(args.json, {"environment": common.environment(), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
