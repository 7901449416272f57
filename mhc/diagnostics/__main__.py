"""``python -m mhc.diagnostics MODEL_DIR [--text FILE]``: the stability report of a saved mHC model.

Loads the model offline (``AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True)``:
any folder ``scripts/train_lm.py`` or ``convert_to_mhc(...).save_pretrained`` wrote; a run dir
means its ``model/``), tokenizes a short built-in text or ``--text FILE`` with the tokenizer saved
beside the model (the text's UTF-8 bytes when there is none), runs one forward and one backward
pass of the LM loss, prints the per-depth table of :class:`mhc.diagnostics.StabilityReport` and
writes its figure (:func:`mhc.diagnostics.plot_report`, ``MODEL_DIR/stability.png`` unless ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from ..block import MHCBlock
from .report import DEFAULT_EPS, plot_report, stability_report

# Built-in text: a little Python and a little prose, like what the README's main job trains on.
BUILTIN_TEXT = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter(dict):
    def add(self, key, amount=1):
        self[key] = self.get(key, 0) + amount
        return self[key]

The residual stream carries every layer's output to the next one; hyper-connections widen it
into several streams and learn how to mix them at every site.
'''


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mhc.diagnostics",
        description="Stability report of a saved mHC model: composite gains, marginal error, stream collapse, "
        "saturation and gradient gain per depth, as a table and a PNG.",
    )
    p.add_argument(
        "model_dir",
        type=Path,
        help="a from_pretrained folder (e.g. runs/tiny_cpu_mhc/model; a run dir means its model/)",
    )
    p.add_argument("--text", type=Path, help="a UTF-8 text file to run (default: a short built-in text)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of the text to use (default 128)")
    p.add_argument("--out", type=Path, help="where the PNG goes (default MODEL_DIR/stability.png)")
    p.add_argument("--json", type=Path, help="also write the report's numbers here")
    p.add_argument(
        "--eps", type=float, default=DEFAULT_EPS, help=f"saturation threshold (default {DEFAULT_EPS:g})"
    )
    p.add_argument("--no-backward", action="store_true", help="forward only: no gradient ratio column")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    return p


def _token_ids(model_dir: Path, text: str) -> tuple[list[int], str]:
    """The text's token ids and what tokenized it."""
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        return list(tok(text)["input_ids"]), f"tokenizer of {model_dir}"
    return list(text.encode("utf-8")), "UTF-8 bytes (no tokenizer in the model folder)"


def run(args: argparse.Namespace) -> int:
    """Load, measure, print, plot; the exit status."""
    model_dir: Path = args.model_dir
    if not (model_dir / "config.json").is_file() and (model_dir / "model" / "config.json").is_file():
        model_dir = model_dir / "model"  # a train_lm.py run dir: its model/ folder
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a saved model folder (no config.json)")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    out = args.out if args.out is not None else model_dir / "stability.png"
    if out.suffix.lower() != ".png":  # checked before the model is loaded and run
        raise ValueError(f"--out: the figure is a PNG: give a path ending in .png, got {out}")
    try:
        text = args.text.read_text(encoding="utf-8") if args.text else BUILTIN_TEXT
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {args.text}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise ValueError(f"--device {args.device!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this torch has no CUDA device (torch {torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if device.type == "meta":
        raise ValueError(f"--device {args.device}: a meta tensor holds no data to measure")
    try:  # any other device type this torch cannot use (mps, xpu, ...)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:  # torch asserts for a backend it was built without
        raise ValueError(
            f"--device {args.device}: this torch cannot use it ({str(e).splitlines()[0]})"
        ) from None

    # (MHCForCausalLM is registered with the Auto classes: importing mhc, this module's package, did it.)
    hf_logging.disable_progress_bar()  # the table is the output; no "Loading weights" bar above it

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).to(device).eval()
    blocks = [m for m in model.modules() if isinstance(m, MHCBlock)]
    if not blocks:
        raise ValueError(
            f"{model_dir} holds no mHC sites ({type(model).__name__}); convert it with mhc.convert_to_mhc"
        )
    ids, source = _token_ids(model_dir, text)
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or args.max_tokens
    ids = ids[: min(args.max_tokens, limit)]
    if len(ids) < 2:
        raise ValueError("the text gives fewer than 2 tokens")
    vocab = model.get_input_embeddings().num_embeddings
    if max(ids) >= vocab:
        raise ValueError(f"token id {max(ids)} is outside the model's vocabulary of {vocab} ({source})")
    input_ids = torch.tensor([ids], device=device)
    loss_fn = None if args.no_backward else (lambda out: out.loss)
    kwargs = {"input_ids": input_ids, "use_cache": False}
    if loss_fn is not None:
        kwargs["labels"] = input_ids
    report = stability_report(model, loss_fn=loss_fn, eps=args.eps, **kwargs)

    b = blocks[0]
    settings = f"mode={b.mode}" + (f", projection={b.projection}" if b.mode == "mhc" else "")
    text_name = f"--text {args.text}" if args.text else "built-in text"
    print(
        f"{model_dir}: {type(model).__name__}, {len(blocks)} sites, {settings}, n_streams={b.n_streams}; "
        f"{len(ids)} tokens ({text_name}, {source})"
    )
    print(report.table())
    plot_report(report, out, title=str(model_dir))
    print(f"figure: {out}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.as_dict(), indent=1) + "\n")
        print(f"numbers: {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (2 with a one-line error for bad input)."""
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
