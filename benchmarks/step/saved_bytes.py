"""Activation memory kept for backward: bytes autograd saves per token, per site, residual Llama vs mHC.

One training-mode forward of a small random Llama (``LlamaForCausalLM``) and of
the same model after ``mhc.convert_to_mhc(model, n_streams, init="paper")``, on
the fused site and on the PyTorch path (``fused=False``), under
:func:`torch.autograd.graph.saved_tensors_hooks`. Which tensors autograd saves
does not depend on the device, so this runs on the CPU in seconds; there the
fused kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below
when there is no CUDA) and each converted model's ``MHCBlock`` is made to take
the fused path on CPU streams by an instance ``uses_fused`` that drops the
``x.is_cuda`` condition (the override :meth:`mhc.MHCBlock.uses_fused`
documents; the HF model's blocks themselves are the ones measured).

What is counted: every tensor handed to autograd for backward during the
forward (``save_for_backward`` of built-in ops and of mhc's autograd nodes),
each *storage* once (views of one storage and one tensor saved by several
nodes share memory; a view counts its whole storage, which is what stays
allocated), excluding the storages of the model's parameters (weights are not
activations; a cast copy of a weight made in the forward, e.g. fp32 mHC
coefficients used in a bf16 computation, is counted). Each saved storage is
attributed to the innermost module running when it was first saved: an
``MHCBlock`` itself (the mHC site: streams, ``y``, coefficients), a module
below it (the site's branch: norms, attention, MLP), or anything else
(embedding, decoder-layer glue such as ``expand_streams``, final norm/reduce,
``lm_head``).

What is not counted: transient tensors freed before the forward ends (the
forward's own peak), the backward's temporaries and gradients, optimizer
state, the caching allocator's rounding and fragmentation, tensors kept
outside autograd (e.g. a KV cache; none here), the loss (run without labels:
the logits are an output, not saved; the cross-entropy would save them),
and activation checkpointing (``recompute=True`` keeps its inputs outside
these hooks, so it is not measured here).

Per token means divided by ``batch * seq``; per site by the number of
residual sites, 2 per decoder layer, so a per-site figure is the mean of an
attention site and an MLP site (an mHC site keeps the same whichever branch it
wraps; the branches differ). ``C`` units are bytes divided by
``hidden_size * itemsize(dtype)`` of the activations. The branches' figures
depend on the attention kernel: PyTorch's CPU SDPA keeps q, k, v, the output
and the log-sum-exp, as the flash kernels on CUDA do, but a CUDA run (``--device
cuda``, where the fused site runs compiled) is the authority for the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch

if not torch.cuda.is_available():  # without CUDA the fused kernels run only in Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"

# benchmarks/common.py; the imports below come after TRITON_INTERPRET, which must be set before mhc imports Triton.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import mhc
from mhc import fused
from mhc.hf import MHCDecoderLayer

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DECODER_LAYERS = (LlamaDecoderLayer, MHCDecoderLayer)
SITE, BRANCH, GLUE, OTHER = "mhc site", "branch", "layer glue", "other"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/step/saved_bytes.py",
        allow_abbrev=False,
        description="Bytes autograd keeps for backward per token and per site: residual Llama vs its mHC conversion "
        "(fused site and fused=False). Runs on the CPU (fused kernels in Triton's interpreter) in seconds.",
    )
    p.add_argument("--hidden", type=int, default=256, help="hidden size C (default 256)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2; 2 sites each)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    p.add_argument("--intermediate", type=int, default=688, help="MLP intermediate size (default 688)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    p.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bf16", help="activation/weight dtype (default bf16)"
    )
    p.add_argument("--n-streams", type=int, default=4, help="mHC streams n (default 4)")
    p.add_argument(
        "--keep-streams-every",
        type=int,
        default=1,
        help="the mHC models' keep_streams_every (default 1: every site keeps its streams)",
    )
    p.add_argument(
        "--attn", choices=["sdpa", "eager"], default="sdpa", help="attention implementation (default sdpa)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="weights' and inputs' seed (default 0)")
    p.add_argument("--json", metavar="PATH", help="also write the header, totals and breakdowns to PATH")
    args = p.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    for name in (
        "hidden",
        "layers",
        "heads",
        "kv_heads",
        "intermediate",
        "vocab",
        "batch",
        "seq",
        "n_streams",
        "keep_streams_every",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.device not in ("cpu", "cuda"):
        p.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error(
            "--device cpu runs the fused kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
            "(done automatically on a machine without CUDA)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device")
    return args


def _interpreted_uses_fused(block: mhc.MHCBlock):
    """``block.uses_fused`` without its ``x.is_cuda``: the fused kernels on CPU streams (Triton's interpreter)."""

    def uses_fused(x: torch.Tensor) -> bool:
        return (
            block.fused
            and block.mode == "mhc"
            and block.projection == "newton"
            and block.pre_eps == 0
            and x.dtype in fused.SUPPORTED_DTYPES
            and x.numel() > 0
            and fused.available()
        )

    return uses_fused


def build(args: argparse.Namespace, variant: str) -> torch.nn.Module:
    """``variant``: "residual", "mhc fused" or "mhc fused=False"; random weights from ``args.seed``, train mode."""
    cfg = LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 8),
        attn_implementation=args.attn,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(args.device, DTYPES[args.dtype])
    if variant != "residual":
        model = mhc.convert_to_mhc(
            model,
            n_streams=args.n_streams,
            init="paper",
            fused=variant == "mhc fused",
            keep_streams_every=args.keep_streams_every if variant == "mhc fused" else 1,
        )
        if variant == "mhc fused" and args.device == "cpu":
            for block in model.modules():
                if isinstance(block, mhc.MHCBlock):
                    block.uses_fused = _interpreted_uses_fused(block)
    return model.train()


def _shape_name(shape: torch.Size, batch: int, seq: int) -> str:
    if shape and shape[0] == batch * seq and batch > 1 and seq > 1:  # flattened tokens
        return "[" + ",".join(["T", *map(str, shape[1:])]) + "]"
    dims = [
        "B" if i == 0 and d == batch else "S" if i == 1 and d == seq else str(d) for i, d in enumerate(shape)
    ]
    return "[" + ",".join(dims) + "]"


def _owner(stack: list[torch.nn.Module]) -> str:
    """Who saved a tensor, from the modules running (outermost first): the innermost ``MHCBlock`` or decoder layer
    found is the site's; saved by that block itself: the mHC site; by that layer itself: layer glue (e.g.
    ``expand_streams``; a residual layer's adds save nothing); by a module below either: the branch; none of
    them running: other (embedding, final norm and stream reduce, lm_head)."""
    for depth in range(len(stack) - 1, -1, -1):
        if isinstance(stack[depth], (mhc.MHCBlock, *DECODER_LAYERS)):
            if depth < len(stack) - 1:
                return BRANCH
            return SITE if isinstance(stack[depth], mhc.MHCBlock) else GLUE
    return OTHER


def measure(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """One forward of ``model(input_ids=ids)`` under saved-tensor hooks.

    Returns ``{"total": bytes, "by_owner": {owner: bytes}, "site_shapes": {"[B,S,n,C] dtype": bytes},
    "branch_shapes": {"[B,S,C] dtype (module class)": bytes},
    "fused_nodes": count}``: each saved storage once, parameters excluded (see the module docstring).
    """
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[torch.nn.Module] = []
    seen: dict[int, int] = {}
    by_owner: dict[str, int] = defaultdict(int)
    site_shapes: dict[str, int] = defaultdict(int)
    branch_shapes: dict[str, int] = defaultdict(int)
    batch, seq = ids.shape

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in param_ptrs or ptr in seen:
            return t
        seen[ptr] = nbytes
        owner = _owner(stack)
        by_owner[owner] += nbytes
        # the saved tensor's shape; its bytes are its whole storage's ("view": a larger one)
        name = f"{_shape_name(t.shape, batch, seq)} {str(t.dtype).removeprefix('torch.')}"
        if t.numel() * t.element_size() < nbytes:
            name += " view"
        if owner == SITE:
            site_shapes[name] += nbytes
        elif owner == BRANCH:
            branch_shapes[f"{name} ({type(stack[-1]).__name__})"] += nbytes
        return t

    def enter(module, args) -> None:
        stack.append(module)

    def leave(
        module, args, output
    ) -> None:  # returns None: a forward hook's return value replaces the output
        stack.pop()

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    fused_nodes = _count_nodes(logits.grad_fn, ("SitePre", "PostMix"))
    del logits
    return {
        "total": sum(seen.values()),
        "by_owner": dict(by_owner),
        "site_shapes": dict(site_shapes),
        "branch_shapes": dict(branch_shapes),
        "fused_nodes": fused_nodes,
    }


def _count_nodes(root, name_parts: tuple[str, ...]) -> int:
    """Autograd nodes reachable from ``root`` whose class name contains one of ``name_parts``."""
    todo, seen, count = [root], set(), 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += any(part in type(node).__name__ for part in name_parts)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return count


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            check=False,
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    tokens, sites = args.batch * args.seq, 2 * args.layers
    c_bytes = args.hidden * dtype.itemsize
    torch.manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    header = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        **common.environment(),
        "transformers": transformers.__version__,
        "commit": commit(),
        "command": "python " + " ".join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "model": f"Llama hidden {args.hidden}, {args.layers} layers ({sites} sites), "
        f"{args.heads} heads ({args.kv_heads} kv), "
        f"intermediate {args.intermediate}, vocab {args.vocab}, {args.attn}, {args.dtype}; "
        f"batch {args.batch} x seq {args.seq} = {tokens} tokens; mHC n={args.n_streams}, init=paper, "
        f"keep_streams_every={args.keep_streams_every} (fused)",
    }
    results = {}
    for variant in ("residual", "mhc fused", "mhc fused=False"):
        model = build(args, variant)
        results[variant] = measure(model, ids)
        del model
    if results["mhc fused"]["fused_nodes"] != 2 * sites:
        raise SystemExit(
            f"the fused site did not run: {results['mhc fused']['fused_nodes']} fused autograd nodes, "
            f"expected {2 * sites}"
        )
    base = results["residual"]["total"]
    rows = {}
    for variant, r in results.items():
        per_site = r["total"] / tokens / sites
        extra = (r["total"] - base) / tokens / sites
        rows[variant] = {
            "total_bytes": r["total"],
            "bytes_per_token": r["total"] / tokens,
            "bytes_per_token_per_site": per_site,
            "C_per_token_per_site": per_site / c_bytes,
            "extra_bytes_per_token_per_site": extra,
            "extra_C_per_token_per_site": extra / c_bytes,
            "by_owner_C_per_token_per_site": {
                k: v / tokens / sites / c_bytes for k, v in r["by_owner"].items()
            },
            "site_shapes_C_per_token_per_site": {
                k: v / tokens / sites / c_bytes for k, v in r["site_shapes"].items()
            },
            "branch_shapes_C_per_token_per_site": {
                k: v / tokens / sites / c_bytes for k, v in r["branch_shapes"].items()
            },
            "fused_nodes": r["fused_nodes"],
        }

    for key, value in header.items():
        print(f"# {key}: {value}")
    print(
        f"# C = {args.hidden} {args.dtype} elements = {c_bytes} bytes; sites = {sites}; tokens = {tokens}; "
        "parameters excluded, each storage once"
    )
    print(
        f"{'variant':<17}{'saved bytes':>13}{'B/token':>10}{'B/token/site':>14}{'C/token/site':>14}"
        f"{'vs residual':>13}"
    )
    for variant, row in rows.items():
        print(
            f"{variant:<17}{row['total_bytes']:>13,}{row['bytes_per_token']:>10.0f}"
            f"{row['bytes_per_token_per_site']:>14.1f}{row['C_per_token_per_site']:>14.2f}"
            f"{row['extra_C_per_token_per_site']:>+11.2f} C"
        )
    for variant, row in rows.items():
        owners = ", ".join(f"{k} {v:.2f} C" for k, v in sorted(row["by_owner_C_per_token_per_site"].items()))
        print(f"\n{variant}: per token per site by owner: {owners}")
        for shape, c in sorted(row["site_shapes_C_per_token_per_site"].items(), key=lambda kv: -kv[1]):
            print(f"  mhc site saves {shape:<40} {c:6.3f} C")
        if variant == "residual":  # the branches of the mHC variants save the same (their "branch" totals)
            for shape, c in sorted(row["branch_shapes_C_per_token_per_site"].items(), key=lambda kv: -kv[1]):
                print(f"  branch saves   {shape:<40} {c:6.3f} C")
    if args.json:
        common.write_json(
            args.json,
            {"header": header, "c_bytes": c_bytes, "tokens": tokens, "sites": sites, "variants": rows},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
