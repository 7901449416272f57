"""Launch-configuration sweep of the fused site's six Triton kernels (CUDA).

    python benchmarks/site/sweep_site_kernels.py                          # 134M and 1.1B shapes, every kernel
    python benchmarks/site/sweep_site_kernels.py --shapes 2048x8192 --kernels coeff_partial,stream_grad
    python benchmarks/site/sweep_site_kernels.py --jobs 12 --json sweep.json

For each shape (``C x T``, n = 4, bf16 streams) it builds one site's real
inputs (the forward and backward of :mod:`mhc.fused.steps`), then times each
kernel under its :class:`mhc.fused.plan.Plan` launch (``plan``) and under
every variant of the grid below: tile sizes, ``num_warps`` and
``num_stages`` (the plan leaves Triton's default of 3). Each variant's
outputs are checked against the plan's (``max rel``: the largest difference
over the largest value of each output); a variant over ``--tol`` is marked
``WRONG`` and never counted best. Times are ``triton.testing.do_bench``
medians (it clears L2 before each call), with bandwidth at each kernel's
byte floor (``common.site_kernel_bytes``) over a device copy measured in the
same process. ``--jobs N`` compiles the variants in N worker processes first
(Triton's on-disk cache), so that the timing process only loads them.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
import triton
import triton.testing

N_STREAMS = 4
# Shapes (C, T): the 134M step (batch 8 x 2048) and the 1.1B step (batch 4 x 2048).
DEFAULT_SHAPES = ((768, 16384), (2048, 8192))


def _variants(kernel: str, C: int) -> list[dict]:
    """The launch parameters tried for ``kernel`` (each a dict of constexprs and launch options)."""
    grid = {
        "coeff_partial": dict(BM=(32, 64, 128), BK=(64, 128, 256), splits=(1, 2, 4), num_warps=(4, 8), num_stages=(3, 4)),
        "coeff_fwd": dict(BM=(8, 16, 32), BC=(128, 256, 512), num_warps=(1, 2, 4), num_stages=(1, 3)),
        "postmix_fwd": dict(BC=(512, 1024), num_warps=(2, 4, 8), num_stages=(1, 2, 3)),
        "postmix_bwd": dict(BC=(128, 256, 512), num_warps=(1, 2), num_stages=(1, 2, 3, 4)),
        "coeff_bwd": dict(BC=(256, 512, 1024), num_warps=(1, 2, 4), num_stages=(1, 2, 3)),
        "stream_grad": dict(BM=(16, 32, 64), BC=(32, 64), tokens=(128, 256), num_warps=(4, 8), num_stages=(1, 2, 3)),
        "phi_grad": dict(BT=(32, 64), BN=(128, 256), splits=(16, 32), num_warps=(4, 8), num_stages=(2, 3, 4)),
    }[kernel]
    out = []
    for values in itertools.product(*grid.values()):
        v = dict(zip(grid.keys(), values))
        if "BC" in v and v["BC"] > triton.next_power_of_2(C):
            continue
        if kernel == "stream_grad" and v["tokens"] % v["BM"]:
            continue
        out.append(v)
    return out


class Site:
    """One site's inputs and intermediate tensors at streams ``[T, n, C]``, bf16, and each kernel's call."""

    def __init__(self, C: int, T: int, seed: int = 0):
        from mhc.fused import plan as fused_plan
        from mhc.fused import steps as fused_steps

        g = torch.Generator(device="cuda").manual_seed(seed)
        n, dev = N_STREAMS, "cuda"
        Z = n * n + 2 * n
        self.C, self.T, self.n, self.Z = C, T, n, Z
        self.x = torch.randn((T, n, C), device=dev, generator=g).to(torch.bfloat16)
        self.phi = 0.02 * torch.randn((Z, n * C), device=dev, generator=g)
        self.alpha = torch.tensor([0.5, 0.7, 0.9], device=dev)
        self.b_pre = 0.1 * torch.randn(n, device=dev, generator=g)
        self.b_post = 0.1 * torch.randn(n, device=dev, generator=g)
        self.b_res = torch.randn((n, n), device=dev, generator=g)
        self.plan = plan = fused_plan.plan_for(self.x)
        self.u, self.zr, self.h, self.H_res = fused_steps.pre_forward(
            plan, self.x, self.phi, self.alpha, self.b_pre, self.b_post, self.b_res, 1e-6, 1e-5)
        self.y = torch.randn((T, C), device=dev, generator=g).to(torch.bfloat16)
        self.dout = torch.randn((T, n, C), device=dev, generator=g).to(torch.bfloat16)
        self.dy, self.g_h, self.g_res = fused_steps.post_backward(plan, self.dout, self.x, self.y, self.h)
        self.du = torch.randn((T, C), device=dev, generator=g).to(torch.bfloat16)
        self.dR = torch.ops.mhc.birkhoff_backward(self.H_res, self.g_res)
        self.work = self.zr.new_empty((T, 2 * Z + 4))
        self.part = self.zr.new_empty((plan.coeff_splits, T, plan.ZP))  # the plan's partial sums, for coeff_fwd
        self.launchers = fused_plan.LAUNCHERS
        self.launchers["coeff_partial"](plan.coeff_partial, self.x, self.phi, self.part, T, C, plan.coeff_k_per_split)
        self._run("coeff_bwd", None)  # fills self.work for stream_grad and phi_grad

    def plan_params(self, kernel: str) -> dict:
        """The plan's own values of the swept parameters (``num_stages`` Triton's default, 3)."""
        launch = getattr(self.plan, kernel)
        meta = dict(launch.meta)
        p = {k: meta[k] for k in ("BM", "BK", "BC", "BT", "BN") if k in meta}
        p["num_warps"] = meta.get("num_warps", 4)
        p["num_stages"] = meta.get("num_stages", 3)
        if kernel == "stream_grad":
            p["tokens"] = self.plan.stream_tokens
        if kernel == "phi_grad":
            p["splits"] = self.plan.phi_splits
        if kernel == "coeff_partial":
            p["splits"] = self.plan.coeff_splits
        return p

    def _run(self, kernel: str, params: dict | None) -> tuple:
        """Launch ``kernel`` with ``params`` (``None``: the plan's launch); return its outputs (fresh tensors)."""
        plan, T, n, C, Z = self.plan, self.T, self.n, self.C, self.Z
        k = self.launchers[kernel].kernel
        launch = getattr(plan, kernel)
        meta = dict(launch.meta)
        params = dict(params or {})
        tokens, splits = params.pop("tokens", None), params.pop("splits", None)
        meta.update(params)
        cdiv = triton.cdiv
        if kernel == "coeff_partial":
            splits = splits or plan.coeff_splits
            per = cdiv(cdiv(n * C, splits), meta["BK"]) * meta["BK"]
            splits = cdiv(n * C, per)
            part = self.zr.new_empty((splits, T, plan.ZP))
            k[(cdiv(T, meta["BM"]), splits)](self.x, self.phi, part, T, C, per, **meta)
            return (part.sum(0),)
        if kernel == "coeff_fwd":
            zr, h, R, u = torch.empty_like(self.zr), torch.empty_like(self.h), torch.empty_like(self.H_res), torch.empty_like(self.u)
            k[(cdiv(T, meta["BM"]),)](self.part, self.x, self.alpha, self.b_pre, self.b_post, self.b_res,
                                      zr, h, R, u, T, C, 1e-6, plan.coeff_splits, **meta)
            return zr, h, R, u
        if kernel == "postmix_fwd":
            out = torch.empty_like(self.x)
            k[(T, cdiv(C, meta["BC"]))](self.x, self.y, self.h, self.H_res, out, C, **meta)
            return (out,)
        if kernel == "postmix_bwd":
            dy, g_h, g_res = torch.empty_like(self.dy), torch.empty_like(self.g_h), torch.empty_like(self.g_res)
            k[(T,)](self.dout, self.x, self.y, self.h, dy, g_h, g_res, C, **meta)
            return dy, g_h, g_res
        if kernel == "coeff_bwd":
            work = self.work if params == {} and tokens is None else torch.empty_like(self.work)
            k[(T,)](self.du, self.x, self.h, self.g_h, self.dR, self.zr, self.alpha, work, C, **meta)
            return (work,)
        if kernel == "stream_grad":
            tokens = tokens or plan.stream_tokens
            dx = torch.empty_like(self.x)
            k[(cdiv(C, meta["BC"]), cdiv(T, tokens))](self.dout, self.du, self.x, self.work, self.phi, self.h,
                                                     self.H_res, dx, T, C, tokens, **meta)
            return (dx,)
        if kernel == "phi_grad":
            splits = splits or plan.phi_splits
            per = cdiv(cdiv(T, splits), meta["BT"]) * meta["BT"]
            splits = cdiv(T, per)
            part = self.zr.new_empty((splits, Z, n * C))
            k[(cdiv(n * C, meta["BN"]), splits)](self.work, self.x, part, T, n * C, Z, per, **meta)
            return (part.sum(0),)
        raise ValueError(f"unknown kernel {kernel!r}")

    def call(self, kernel: str, params: dict | None):
        """``(fn, outputs)``: a no-argument launch of the variant for timing, and its outputs."""
        outputs = self._run(kernel, params)
        return (lambda: self._run(kernel, params)), outputs


def _max_rel(a: tuple, b: tuple) -> float:
    worst = 0.0
    for p, q in zip(a, b):
        p, q = p.double(), q.double()
        if not torch.isfinite(p).all():
            return float("inf")
        scale = q.abs().max().item() or 1.0
        worst = max(worst, (p - q).abs().max().item() / scale)
    return worst


def _compile_worker(job: tuple) -> int:
    """Compile (launch once) each variant of ``job = (C, T, [(kernel, params), ...])``; the count that failed."""
    C, T, items = job
    site = Site(C, T)
    failed = 0
    for kernel, params in items:
        try:
            site._run(kernel, params)
        except Exception:  # reported again, with its message, by the timing process
            failed += 1
    torch.cuda.synchronize()
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{c}x{t}" for c, t in DEFAULT_SHAPES), help="CxT,... (n = 4, bf16)")
    ap.add_argument("--kernels", default="coeff_partial,coeff_fwd,postmix_fwd,postmix_bwd,coeff_bwd,stream_grad,phi_grad")
    ap.add_argument("--jobs", type=int, default=8, help="worker processes that compile the variants first (1: none)")
    ap.add_argument("--tol", type=float, default=2e-2, help="largest max rel difference from the plan's outputs")
    ap.add_argument("--top", type=int, default=5, help="variants listed per kernel, fastest first")
    ap.add_argument("--json", help="also write every timing here")
    args = ap.parse_args()
    common.require_cuda("sweep_site_kernels.py")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    kernels = args.kernels.split(",")
    copy = common.copy_gbps()
    print(f"device copy: {copy:.0f} GB/s; {common.environment()}")
    results = []
    for C, T in shapes:
        items = [(kernel, v) for kernel in kernels for v in _variants(kernel, C)]
        if args.jobs > 1:
            chunks = [(C, T, items[i::args.jobs]) for i in range(args.jobs)]
            with mp.get_context("spawn").Pool(args.jobs) as pool:
                failed = sum(pool.map(_compile_worker, chunks))
            print(f"C={C} T={T}: {len(items)} variants compiled in {args.jobs} processes ({failed} failed)")
        site = Site(C, T)
        floor = common.site_kernel_bytes(T, N_STREAMS, C)
        for kernel in kernels:
            base_fn, base_out = site.call(kernel, None)
            plan_params = site.plan_params(kernel)
            rows = []
            for label, params in [("plan", None)] + [("", v) for v in _variants(kernel, C)]:
                try:
                    fn, out = (base_fn, base_out) if params is None else site.call(kernel, params)
                    err = _max_rel(out, base_out)
                    # Two rounds of do_bench medians; the better one counts (as the benchmarks do).
                    us = min(1e3 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") for _ in range(2))
                except Exception as e:  # noqa: BLE001 (a variant Triton cannot build is reported and skipped)
                    print(f"  {kernel} {params}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    continue
                rows.append(dict(kernel=kernel, C=C, T=T, params=params or plan_params, plan=params is None,
                                 us=us, x_copy=floor[kernel] / us / 1e3 / copy, max_rel=err, ok=err <= args.tol))
            results += rows
            plan_row = rows[0]
            good = sorted((r for r in rows if r["ok"]), key=lambda r: r["us"])
            print(f"C={C} T={T} {kernel}: plan {plan_row['us']:.1f} us ({plan_row['x_copy']:.2f}x copy) {plan_params}")
            for r in good[: args.top]:
                tag = " (plan)" if r["plan"] else ""
                print(f"    {r['us']:8.1f} us  {r['x_copy']:.2f}x copy  {r['us'] / plan_row['us']:.3f}x plan  "
                      f"rel {r['max_rel']:.1e}  {r['params']}{tag}")
            wrong = [r for r in rows if not r["ok"]]
            if wrong:
                print(f"    WRONG (rel > {args.tol}): {len(wrong)}, e.g. {wrong[0]['params']} rel {wrong[0]['max_rel']:.2e}")
    if args.json:
        common.write_json(args.json, {"copy_gbps": copy, "env": common.environment(), "rows": results})
    best = {}
    for r in results:
        key = (r["C"], r["kernel"])
        if r["ok"] and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("summary: best variant against the plan, per shape and kernel")
    for (C, kernel), r in sorted(best.items()):
        plan_us = next(p["us"] for p in results if p["C"] == C and p["kernel"] == kernel and p["plan"])
        print(f"  C={C} {kernel:12s} plan {plan_us:7.1f} us -> {r['us']:7.1f} us ({r['us'] / plan_us:.3f}x, "
              f"{r['x_copy']:.2f}x copy) {r['params']}")


if __name__ == "__main__":
    main()
