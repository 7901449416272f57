"""coeff_fwd's K split for a few tokens, A/B in one process: the fused site step with the split and without.

    python benchmarks/bench_small_tokens.py                     # T in 1,16,64,256; C=768, n=4, bf16 (estimated 30-60 s)
    python benchmarks/bench_small_tokens.py --tokens 1,16,64,256,1024 --iters 400
    python benchmarks/bench_small_tokens.py --sweep             # also the split's knobs at 1, 16, 64 tokens
    python benchmarks/bench_small_tokens.py --device cpu --C 64 --tokens 1,5 --iters 2   # logic only (interpreter)

Variants: ``old`` is ``mhc.fused_plan.SPLIT_MAX_TOKENS = 0`` (one program per
64 tokens walks all of K = n·C); ``split`` the default (up to
SPLIT_MAX_TOKENS tokens, K split over several programs per 16-token block,
the last to finish one). Plans are dropped (``mhc.fused.clear_plans()``)
between variants, so each variant's plans are made with its setting.

Rows, each in µs per site step, from CUDA events over ``--iters`` steps
(median of 5 runs), eager and replayed from a CUDA graph of 10 steps (GPU
time without host time):

* ``coeff_fwd``: the kernel alone (plan's direct launch);
* ``triton no-grad``: ``fused_steps.pre_forward`` + ``post_forward`` (coefficients,
  projection, pre-mix; post-mix), the Triton steps of a no-grad site
  called directly, so that the few-token CUDA path of ``mhc.fused_tokens``
  (which ``mhc.fused`` picks under no_grad where it is built) does not hide them;
* ``public no-grad``: ``fused.site_pre`` + ``fused.post_mix`` under no_grad,
  whichever path mhc.fused takes (printed: ``tokens`` or ``triton``);
* ``f+b``: ``fused.site_pre`` + ``post_mix`` with grad and
  ``torch.autograd.grad`` of every input (the Triton path, whose backward
  reads what coeff_fwd wrote).

Checks, printed and asserted: split against old (u, h, H_res and every
gradient, relative error), the split bitwise the same on a second call
and in a graph replay, and the split's counters back at zero.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():  # --device cpu: the kernels in Triton's interpreter, set before mhc imports
    os.environ["TRITON_INTERPRET"] = "1"

import mhc
from mhc import fused, fused_plan, fused_steps


def _median_us(fn, iters: int, graph: bool) -> float:
    """µs per call of ``fn``: eager, or replayed from a CUDA graph of 10 calls (CPU: wall time, eager)."""
    if DEVICE == "cpu":
        fn()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e6 / iters
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture, as torch.cuda.graph asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    run, per = fn, 1
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                fn()
        run, per = g.replay, 10
        run()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(max(1, iters // per)):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (max(1, iters // per) * per))
    return statistics.median(times)


def _inputs(T: int, n: int, C: int, dtype, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, n, C, device=DEVICE, generator=g).to(dtype)
    phi = torch.randn(n * n + 2 * n, n * C, device=DEVICE, generator=g) * (n * C) ** -0.5
    alpha = torch.tensor([0.5, 0.7, 2.0], device=DEVICE)
    b_pre, b_post = torch.randn(n, device=DEVICE, generator=g), torch.randn(n, device=DEVICE, generator=g)
    b_res = torch.randn(n, n, device=DEVICE, generator=g) * 3
    return x, (phi, alpha, b_pre, b_post, b_res)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _variant(split_tokens: int, T: int, n: int, C: int, dtype, iters: int, seed: int, graphs: bool) -> dict:
    fused_plan.SPLIT_MAX_TOKENS = split_tokens
    fused.clear_plans()
    x, params = _inputs(T, n, C, dtype, seed)
    eps, tol = 1e-6, 1e-6
    plan = fused_plan.plan_for(x)
    out = {"splits": plan.coeff_splits}

    # coeff_fwd alone, on buffers made once.
    zr = x.new_empty((T, plan.Z + 1), dtype=torch.float32)
    h = x.new_empty((T, 2 * n), dtype=torch.float32)
    R = x.new_empty((T, n, n), dtype=torch.float32)
    u = x.new_empty((T, C))
    part, count = plan.split_buffers() if plan.coeff_splits > 1 else (zr, zr)
    launch = fused_plan.LAUNCHERS["coeff_fwd"]

    def coeff():
        launch(plan.coeff_fwd, x, *params, zr, h, R, u, part, count, T, C, eps)

    def triton_step():
        u_, _, h_, H_ = fused_steps.pre_forward(plan, x, *params, eps, tol)
        return fused_steps.post_forward(plan, x, u_, h_, H_), u_, h_, H_

    path = []

    def public_step():
        with torch.no_grad():
            u_, site = fused.site_pre(x, *params, norm_eps=eps, tol=tol)
            path[:] = ["tokens" if getattr(site[3], "tokens", False) else "triton"]
            return fused.post_mix(u_, site)

    leaves = [t.detach().clone().requires_grad_() for t in (x, *params)]
    g_gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    g_out = torch.randn(x.shape, device=DEVICE, generator=g_gen).to(dtype)

    def fwd_bwd():
        u_, site = fused.site_pre(*leaves, norm_eps=eps, tol=tol)
        o = fused.post_mix(u_, site)
        return torch.autograd.grad(o, leaves, g_out)

    rows = {"coeff_fwd": coeff, "triton no-grad": lambda: triton_step(), "public no-grad": public_step, "f+b": fwd_bwd}
    for name, fn in rows.items():
        with torch.no_grad() if name != "f+b" else torch.enable_grad():
            out[name, "eager"] = _median_us(fn, iters, graph=False)
            if graphs:
                try:
                    out[name, "graph"] = _median_us(fn, iters, graph=True)
                except RuntimeError as err:  # reported, not hidden: a step that does not capture
                    out[name, "graph"] = f"{type(err).__name__}: {str(err)[:60]}"
    out["public path"] = path[0] if path else "?"

    with torch.no_grad():
        first = triton_step()
        again = triton_step()
        out["repeat_equal"] = all(torch.equal(a, b) for a, b in zip(first, again))
        if graphs:  # a graph replay gives the eager bits
            static = [None]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                triton_step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static[0] = triton_step()
            g.replay()
            torch.cuda.synchronize()
            out["replay_equal"] = all(torch.equal(a, b) for a, b in zip(first, static[0]))
    out["values"] = [t.float().clone() for t in first] + [t.float().clone() for t in fwd_bwd()]
    out["counters_zero"] = plan.coeff_splits == 1 or int(plan.split_buffers()[1].abs().sum()) == 0
    return out


def _fmt(v) -> str:
    return f"{v:8.1f}" if isinstance(v, float) else f"{str(v):>8}"


DEVICE = "cuda"


def main(argv=None) -> int:
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,64,256", help="comma-separated token counts T")
    p.add_argument("--C", type=int, default=768)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-graphs", action="store_true", help="eager timings only")
    p.add_argument("--sweep", action="store_true",
                   help="also coeff_fwd (graph) under a few split settings at 1/16/64 tokens")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: Triton's interpreter, logic only")
    args = p.parse_args(argv)
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (--device cpu checks the logic in Triton's interpreter)", file=sys.stderr)
        return 2
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu needs TRITON_INTERPRET=1 set before the script starts (CUDA is available here)",
              file=sys.stderr)
        return 2
    graphs = DEVICE == "cuda" and not args.no_graphs
    dtype = getattr(torch, args.dtype)
    default_split = fused_plan.SPLIT_MAX_TOKENS
    t0 = time.time()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    print(f"mhc {getattr(mhc, '__version__', '?')}, torch {torch.__version__}, {name}, "
          f"C={args.C} n={args.n} {args.dtype}, SPLIT_MAX_TOKENS={default_split}, µs per site step (median of 5)")
    failures = []
    header = f"{'T':>5} {'row':<15} {'old eager':>9} {'split eag':>9} {'old graph':>9} {'split gr':>9}"
    print(header)
    for T in [int(t) for t in args.tokens.split(",") if t]:
        old = _variant(0, T, args.n, args.C, dtype, args.iters, args.seed, graphs)
        new = _variant(default_split, T, args.n, args.C, dtype, args.iters, args.seed, graphs)
        for row in ("coeff_fwd", "triton no-grad", "public no-grad", "f+b"):
            cells = [old[row, "eager"], new[row, "eager"], old.get((row, "graph"), "-"), new.get((row, "graph"), "-")]
            note = f"  ({new['public path']})" if row == "public no-grad" else ""
            print(f"{T:>5} {row:<15} " + " ".join(_fmt(c) for c in cells) + note)
        names = ["x'", "u", "h", "H_res", "dx", "dphi", "dalpha", "db_pre", "db_post", "db_res"]
        errs = {nm: _rel(a, b) for nm, a, b in zip(names, new["values"], old["values"])}
        worst = max(errs, key=errs.get)
        print(f"{T:>5} split {new['splits']} vs old {old['splits']}: worst rel. difference {worst} {errs[worst]:.2e}; "
              f"h {errs['h']:.1e}, H_res {errs['H_res']:.1e}; repeat equal {new['repeat_equal']}, "
              f"replay equal {new.get('replay_equal', '-')}, counters zero {new['counters_zero']}")
        bound = 1e-5 if dtype == torch.float32 else 2e-2
        if errs[worst] > bound or errs["h"] > 1e-5 or not new["repeat_equal"] or not new["counters_zero"] \
                or new.get("replay_equal") is False:
            failures.append(T)
    knobs = fused_plan.SPLIT_BC, fused_plan.SPLIT_WARPS, fused_plan.SPLIT_MAX_PROGRAMS
    if args.sweep:
        print("sweep: coeff_fwd alone (graph on CUDA), µs (BC: pre-mix columns per step; P: most programs per block)")
        settings = [(bc, w, 32) for bc in (128, 256, 512) for w in (4, 8)] + [(256, 4, 8), (256, 4, 12)]
        for bc, warps, programs in settings:
            fused_plan.SPLIT_BC, fused_plan.SPLIT_WARPS, fused_plan.SPLIT_MAX_PROGRAMS = bc, warps, programs
            cells = []
            for T in (1, 16, 64):
                fused_plan.SPLIT_MAX_TOKENS = default_split
                fused.clear_plans()
                x, params = _inputs(T, args.n, args.C, dtype, args.seed)
                plan = fused_plan.plan_for(x)
                shapes = ((T, plan.Z + 1), (T, 2 * args.n), (T, args.n, args.n))
                bufs = [x.new_empty(s, dtype=torch.float32) for s in shapes]
                u = x.new_empty((T, args.C))
                part, count = plan.split_buffers() if plan.coeff_splits > 1 else (bufs[0], bufs[0])
                args_ = (x, *params, *bufs, u, part, count, T, args.C, 1e-6)

                def fn(spec=plan.coeff_fwd, args_=args_):
                    fused_plan.LAUNCHERS["coeff_fwd"](spec, *args_)

                cells.append(_median_us(fn, args.iters, graph=graphs))
            print(f"  BC={bc:<4} warps={warps} P={programs:<3} "
                  + " ".join(f"T={T}: {c:6.1f}" for T, c in zip((1, 16, 64), cells)))
        fused_plan.SPLIT_BC, fused_plan.SPLIT_WARPS, fused_plan.SPLIT_MAX_PROGRAMS = knobs
    fused_plan.SPLIT_MAX_TOKENS = default_split
    fused.clear_plans()
    print(f"{time.time() - t0:.0f} s; " + ("all checks passed" if not failures else f"CHECKS FAILED at T={failures}"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
