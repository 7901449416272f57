"""The training step with the site kernels' token order changed, against today's, in one process (CUDA).

    python benchmarks/step/order_ab.py --variant "rev=coeff_partial" --variant "rev=coeff_partial;phi_first"
    python benchmarks/step/order_ab.py --shape 134m --mode eager --variant "rev=coeff_partial,coeff_fwd"

The model-step check of ``benchmarks/site/order_sweep.py``: a variant runs chosen site kernels with their token
blocks in reverse order (``rev=``, kernel names) and/or ``phi_grad`` before ``stream_grad`` in the pre-step's
backward (``phi_first``), so that a pass finds more of its predecessor's bytes in L2. The residual model, today's
mHC model and one mHC model per variant are built as ``bench_training.py`` builds them (the small_gpu preset or
the Llama shapes; fp32 weights under bf16 autocast, or bf16 weights), compiled as ``mhc.train`` compiles them
(``--mode compiled``) or not, and timed in interleaved rounds (best of the round medians) in this one process.

A variant's kernels are swapped into ``mhc.fused``'s launchers around each of its steps (and its compile), with
their own compiled variants; inductor's caches are off, so no compiled graph is shared between the mHC models.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # training_models, bench_compile
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # common
sys.path.insert(2, str(Path(__file__).resolve().parents[1] / "site"))  # order_sweep
sys.path.insert(3, str(Path(__file__).resolve().parents[2]))  # this tree's mhc
import common  # noqa: E402
import order_sweep  # noqa: E402
import torch  # noqa: E402
import training_models as tm  # noqa: E402

from mhc.fused import plan as fused_plan  # noqa: E402
from mhc.fused import steps as fused_steps  # noqa: E402

LAUNCHES: dict[int, int] = {}  # launches (or traced launches) per kernel object


def _count_launches():
    """Count what each launcher runs, so that a variant is seen to run its own kernels."""
    call = fused_plan.Launcher.__call__

    def counting(self, spec, *args):
        LAUNCHES[id(self.kernel)] = LAUNCHES.get(id(self.kernel), 0) + 1
        return call(self, spec, *args)

    fused_plan.Launcher.__call__ = counting


class Variant:
    """``rev=k1,k2;phi_first``: which launchers take the reversed kernels, and the backward's order."""

    def __init__(self, text: str, reversed_module):
        self.label, self.rev, self.phi_first = text, set(), False
        for part in filter(None, text.split(";")):
            if part == "phi_first":
                self.phi_first = True
            elif part.startswith("rev="):
                self.rev = set(filter(None, part[4:].split(",")))
            else:
                raise SystemExit(f"order_ab: unknown variant part {part!r} (rev=k1,k2 or phi_first)")
        unknown = self.rev - set(fused_plan.LAUNCHERS)
        if unknown:
            raise SystemExit(f"order_ab: no site kernel {sorted(unknown)}; of {sorted(fused_plan.LAUNCHERS)}")
        self.kernels = {name: getattr(reversed_module, name) for name in self.rev}
        self.variants = {name: {} for name in self.rev}  # their own compiled Triton variants

    @contextlib.contextmanager
    def active(self):
        saved = {
            name: (fused_plan.LAUNCHERS[name].kernel, fused_plan.LAUNCHERS[name].variants)
            for name in self.rev
        }
        saved_stream, saved_phi = fused_steps._stream_grad, fused_steps._phi_grad
        for name in self.rev:
            fused_plan.LAUNCHERS[name].kernel, fused_plan.LAUNCHERS[name].variants = (
                self.kernels[name],
                self.variants[name],
            )
        if self.phi_first:
            # pre_backward_sums launches stream_grad, then phi_grad: hold the first until the second has run.
            held = []

            def stream_later(spec, *args):
                held.append((spec, args))

            def phi_then_stream(spec, *args):
                saved_phi(spec, *args)
                while held:
                    s, a = held.pop(0)
                    saved_stream(s, *a)

            fused_steps._stream_grad, fused_steps._phi_grad = stream_later, phi_then_stream
        try:
            yield
        finally:
            for name, (kernel, variants) in saved.items():
                fused_plan.LAUNCHERS[name].kernel, fused_plan.LAUNCHERS[name].variants = kernel, variants
            fused_steps._stream_grad, fused_steps._phi_grad = saved_stream, saved_phi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small_gpu", choices=("small_gpu", "134m", "1b"))
    ap.add_argument("--recipe", default="autocast", choices=("autocast", "bf16"))
    ap.add_argument("--mode", default="compiled", choices=("compiled", "eager"))
    ap.add_argument("--variant", action="append", default=[], help="rev=k1,k2;phi_first (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    common.require_cuda("order_ab.py")
    if not args.variant:
        ap.error("give at least one --variant")
    if args.mode == "eager" and any("phi_first" in v for v in args.variant):
        # the eager site applies the branch's norm, whose weight gradient is summed right after stream_grad
        ap.error("phi_first is for --mode compiled")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    args.init, args.tiny, args.compile_backend = "paper", False, "inductor"
    reversed_module = order_sweep.reversed_kernels()
    _count_launches()
    device = torch.device("cuda")
    plan = tm.shape_plan(args.shape, False)
    B, S = plan["batch"], plan["seq"]
    torch.manual_seed(1)
    ids = torch.randint(0, plan["vocab"], (B, S), device=device)
    cfg = tm.preset_config("mhc", batch=B, seq=S)
    kinds = {"residual": None, "mhc": None} | {v: Variant(v, reversed_module) for v in args.variant}
    steps = {}
    for label, variant in kinds.items():
        context = variant.active if variant is not None else contextlib.nullcontext
        t0 = time.perf_counter()
        with context():
            model = tm.build(
                args.shape, "residual" if label == "residual" else "mhc", args.recipe, device, args
            )
            run = tm.compile_model(model, "inductor", device, cfg) if args.mode == "compiled" else model
            step = tm.make_step(model, args.recipe, run, ids, device, cfg)
            step()
            step()
            torch.cuda.synchronize()

        def timed(step=step, context=context):
            with context():
                step()

        if variant is not None:
            idle = [name for name, kernel in variant.kernels.items() if not LAUNCHES.get(id(kernel))]
            if idle:
                raise SystemExit(f"order_ab: variant {label!r} never launched its {idle}")
        steps[label] = timed
        print(f"  {label}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
    results = common.interleaved(steps, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    res, base = results["residual"].ms, results["mhc"].ms
    print(
        f"\n{args.shape} {args.recipe} {args.mode}, {torch.cuda.get_device_name()}: best of {args.rounds} "
        f"interleaved medians of {args.steps} steps"
    )
    print("| model | ms | round medians | × residual | × today's mHC |\n|---|---|---|---|---|")
    for label, m in results.items():
        rounds = " / ".join(f"{v:.2f}" for v in m.round_medians)
        print(f"| {label} | {m.ms:.2f} | {rounds} | {m.ms / res:.3f}× | {m.ms / base:.3f}× |")


if __name__ == "__main__":
    main()
