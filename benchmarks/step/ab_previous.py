"""This tree's mHC against an earlier commit's, in one process: bits first, then the model step.

    python benchmarks/step/ab_previous.py --make-base dc9a7a4 ab_base      # here (needs git): a renamed copy
    python benchmarks/step/ab_previous.py --base ab_base                   # CUDA: site bits, model bits, step
    TRITON_INTERPRET=1 python benchmarks/step/ab_previous.py --base ab_base --cpu   # CPU: site bits only

``--make-base COMMIT DIR`` writes COMMIT's package as ``DIR/mhc_base``: the
same code under another name, with every ``torch.library`` op its Python
defines in the ``mhc_base`` namespace and the CUDA extension's operators
(``SHARED_OPS``) left to this tree's registration, so that both packages
import into one process and share one build of the kernels
(:func:`use_base` sets ``MHC_CSRC_DIR`` to this tree's ``mhc/csrc``; the
comparison is of the Python around the kernels, so the two commits' kernel
sources must agree).

Checks, each printed as ``bits <what>: identical`` or the largest difference:

* the fused site (``MHCBlock``, ``mode="mhc"``) forward and backward at float32
  and bfloat16, ``n`` 4 and 8, with and without grad (the decode token
  kernels without grad on CUDA), and under ``keep_streams_every=2``;
* on CUDA, the 134M (or ``--size 1b``) model's loss and every gradient.

Then (CUDA) the eager training step of the residual model and of both mHC
models, interleaved (``common.interleaved``), with the ratios. ``--recipe
autocast`` keeps the weights float32 and runs each step under
``torch.autocast("cuda", torch.bfloat16)`` (the streams are then float32, as
in ``mhc.train``); ``--steps-only`` skips every bits check (for a comparison
across a change that alters bits on purpose, e.g. a kernel's precision).
The same base in ``benchmarks/step/bench_training.py --base DIR`` times the
earlier model beside this tree's in the training benchmark's groups (every
shape, recipe and mode, compiled and with the trainer's late read included).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The ``mhc::`` ops both packages share: the CUDA extension's and those that ``mhc.projection.cuda._register``
#: adds beside them, registered once by this tree (the base's ``_register()`` is turned off).
SHARED_OPS = (
    "birkhoff_forward",
    "birkhoff_forward_info",
    "birkhoff_backward",
    "birkhoff_unconverged",
    "birkhoff_backward_graph",
)


def make_base(commit: str, out: Path) -> None:
    """Write ``commit``'s ``mhc`` package as ``out/mhc_base`` (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "base.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit, "mhc"], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        target = out / "mhc_base"
        if target.exists():
            raise SystemExit(f"{target} exists; remove it first")
        Path(tmp, "mhc").rename(target)
    # Every op the Python code defines moves to mhc_base: two definitions of one name in one process
    # replace each other (torch.library lets a custom op be redefined), so each package's calls could
    # reach the other's kernels, and the replaced registration's teardown leaves an op with no schema.
    shared = "|".join(SHARED_OPS)
    own_ops = re.compile(rf"\bmhc::(?!(?:{shared})\b)")
    own_calls = re.compile(rf"\btorch\.ops\.mhc\.(?!(?:{shared})\b)")
    for path in target.rglob("*.py"):
        text = path.read_text()
        new = own_calls.sub("torch.ops.mhc_base.", own_ops.sub("mhc_base::", text))
        new = re.sub(
            r"^(\s*)_register\(\)$",
            r"\1pass  # this process's newer mhc registers the extension's ops",
            new,
            flags=re.M,
        )
        new = re.sub(r"\bfrom mhc\b", "from mhc_base", new)
        if new != text:
            path.write_text(new)
    print(f"wrote {target} ({commit})")


def use_base(base: Path) -> None:
    """Make ``base/mhc_base`` (from :func:`make_base`) importable beside this tree's ``mhc``, on this tree's
    build of the CUDA extension."""
    os.environ["MHC_CSRC_DIR"] = str(ROOT / "mhc" / "csrc")
    sys.path.insert(0, str(base.resolve()))


def block_pair(new_mhc, base_mhc, n: int, C: int, dtype, device: str, **options):
    """Two blocks with the same parameters, one from each package (a Linear + tanh branch)."""
    import torch

    torch.manual_seed(0)
    branch = torch.nn.Sequential(torch.nn.Linear(C, C), torch.nn.Tanh()).to(device, dtype)
    blocks = []
    for pkg in (new_mhc, base_mhc):
        cls = pkg.MHCBlock
        if device == "cpu":  # Triton's interpreter takes CPU tensors: force the fused backend
            cls = type(
                "Interpreted", (cls,), {"uses_fused": lambda self, x: self.fused and self.mode == "mhc"}
            )
        torch.manual_seed(1)
        blocks.append(cls(branch, C, n, init="paper", **options).to(device))
    blocks[1].load_state_dict(blocks[0].state_dict())
    return blocks


def compare(what: str, a, b) -> bool:
    import torch

    same = all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    if same:
        print(f"bits {what}: identical")
    else:
        worst = max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))
        print(f"bits {what}: DIFFERENT (max abs difference {worst:.3e})")
    return same


def site_bits(new_mhc, base_mhc, device: str) -> bool:
    import torch

    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for n, C in ((4, 64), (8, 96)):
            for tokens in ((2, 33), (1, 3), (4, 100)):  # <= 128 tokens: the token kernels; 400: Triton
                new, base = block_pair(new_mhc, base_mhc, n, C, dtype, device)
                x = torch.randn(
                    *tokens, n, C, device=device, generator=torch.Generator(device).manual_seed(7)
                )
                x = x.to(dtype)
                outs = []
                for block in (new, base):
                    xi = x.clone().requires_grad_()
                    out = block(xi)
                    g = torch.randn(
                        out.shape, generator=torch.Generator(device).manual_seed(8), device=device
                    )
                    out.backward(g.to(dtype))
                    with torch.no_grad():
                        out_ng = block(x)
                    outs.append([out, out_ng, xi.grad, *(p.grad for p in block.parameters())])
                ok &= compare(f"site {str(dtype)[6:]} n={n} C={C} tokens={tokens}", *outs)
        # keep_streams_every: linked sites recompute their input streams in backward
        chains = []
        for pkg_index in range(2):
            blocks = [
                block_pair(new_mhc, base_mhc, 4, 64, dtype, device, keep_streams_every=2)[pkg_index]
                for _ in range(4)
            ]
            for a, b in zip(blocks, blocks[1:]):
                a.set_next_site(b)
            chains.append(blocks)
        outs = []
        for blocks in chains:
            x = torch.randn(2, 9, 4, 64, device=device, generator=torch.Generator(device).manual_seed(9))
            x = x.to(dtype).requires_grad_()
            out = x
            for block in blocks:
                out = block(out)
            out.float().square().sum().backward()
            outs.append([out, x.grad, *(p.grad for blk in blocks for p in blk.parameters())])
        ok &= compare(f"linked chain keep_streams_every=2 {str(dtype)[6:]}", *outs)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-base", nargs=2, metavar=("COMMIT", "DIR"))
    ap.add_argument("--base", type=Path, help="a DIR made by --make-base")
    ap.add_argument("--cpu", action="store_true", help="site bits only, on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--size", choices=("134m", "1b"), default="134m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recipe", choices=("bf16", "autocast"), default="bf16")
    ap.add_argument("--steps-only", action="store_true", help="time the steps, check no bits")
    args = ap.parse_args()
    if args.make_base:
        make_base(args.make_base[0], Path(args.make_base[1]))
        return
    if args.base is None:
        raise SystemExit("give --base DIR (made by --make-base) or --make-base COMMIT DIR")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, for the model's bits
    sys.path.insert(0, str(ROOT))
    use_base(args.base)
    import torch

    import mhc

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda":
        from mhc.projection import cuda as projection_cuda

        assert projection_cuda.available(), "this tree's CUDA extension did not build"
    import mhc_base

    ok = args.steps_only or site_bits(mhc, mhc_base, device)
    if device == "cpu":
        raise SystemExit(0 if ok else 1)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    sys.path.insert(0, str(ROOT / "benchmarks" / "step"))
    from bench_compile import llama_1b

    cfg = common.llama_134m(args.seq) if args.size == "134m" else llama_1b(args.seq)
    from transformers import LlamaForCausalLM

    def build(pkg):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(
            "cuda", torch.float32 if args.recipe == "autocast" else torch.bfloat16
        )
        if pkg is not None:
            model = pkg.convert_to_mhc(model, n_streams=4, init="paper")
        return model.train()

    residual, new, base = build(None), build(mhc), build(mhc_base)
    ids = torch.randint(
        0,
        cfg.vocab_size,
        (args.batch, args.seq),
        device="cuda",
        generator=torch.Generator("cuda").manual_seed(0),
    )
    # The base model's own backward is not deterministic on CUDA by default (the embedding's gradient adds
    # with atomics): deterministic algorithms for this comparison, and this tree's model twice as a control.
    if args.steps_only:
        return time_steps(args, common, residual, new, base, ids, ok)
    torch.use_deterministic_algorithms(True, warn_only=True)
    grads = []
    for model in (new, new, base):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
        model.zero_grad(set_to_none=True)
    torch.use_deterministic_algorithms(False)
    compare(f"control: this tree's {args.size} model twice, loss and gradients", grads[0], grads[1])
    grads = grads[1:]
    ok &= compare(f"{args.size} model loss and {len(grads[0]) - 1} gradients", *grads)
    # Decoding: no grad, a few tokens (the token kernels, linked boundaries), then greedy generate().
    decoded = []
    for model in (new, base):
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids[:1, :32]).logits
            out = model.generate(
                ids[:1, :16],
                max_new_tokens=8,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        decoded.append([logits, out.sequences, *out.logits])
        model.train()
    ok &= compare("decode: 32-token no-grad logits, generate(8 new tokens) ids and logits", *decoded)
    torch.cuda.synchronize()
    time_steps(args, common, residual, new, base, ids, ok)


def time_steps(args, common, residual, new, base, ids, ok: bool) -> None:
    """The interleaved eager steps of the three models (under bf16 autocast for ``--recipe autocast``)."""
    import torch

    def under_recipe(step):
        if args.recipe == "bf16":
            return step

        def autocast_step():
            with torch.autocast("cuda", torch.bfloat16):
                step()

        return autocast_step

    steps = {
        "residual": under_recipe(common.training_step(residual, ids)),
        "mhc new": under_recipe(common.training_step(new, ids)),
        "mhc base": under_recipe(common.training_step(base, ids)),
    }
    for step in steps.values():  # warm-up: the first model a process runs is slower
        step()
    times = common.interleaved(steps, rounds=args.rounds)
    r = times["residual"].ms
    for name, m in times.items():
        print(
            f"step {args.size} {args.recipe} b{args.batch}x{args.seq} {name:9s} {m.ms:8.2f} ms  x{m.ms / r:.4f} residual  "
            f"rounds {[round(v, 2) for v in m.round_medians]}"
        )
    print(f"step new / base: {times['mhc new'].ms / times['mhc base'].ms:.4f}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
