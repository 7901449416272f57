"""Check the one-pass boundary prototype (kernel.py) against the site's kernels; on CUDA, time it.

    TRITON_INTERPRET=1 python benchmarks/boundary_split/check.py   # CPU, Triton's interpreter: CL = 1 cases
    python benchmarks/boundary_split/check.py                       # CUDA: the checks (CL > 1, so with the wait)
    python benchmarks/boundary_split/check.py --bench configs       # CUDA: six launch configurations
    python benchmarks/boundary_split/check.py --bench ablation      # CUDA: without the wait, the ticket, the dots

The reference is the site's own kernels on the same inputs: ``postmix_fwd``,
then ``coeff_partial`` and ``coeff_fwd`` on its output. Times are
``triton.testing.do_bench`` medians (each call allocates its outputs, as the
site does), both sides interleaved, best of two, at the 134M and 1.1B shapes
(n = 4, bf16), with the pass's byte floor ``(2n·C + 2C)·T`` at a device copy's
speed measured in the same process.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # kernel.py, and benchmarks/common.py


def site_inputs(T, n, C, dtype, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    Z = n * n + 2 * n

    def rnd(*s, scale=1.0):
        return (scale * torch.randn(s, generator=g)).to(dev)

    x = rnd(T, n, C).to(dtype)
    y = rnd(T, C).to(dtype)
    h = torch.rand((T, 2 * n), generator=g).to(dev)
    Hr = torch.rand((T, n, n), generator=g)
    Hr = (Hr / Hr.sum(-1, keepdim=True)).to(dev)
    phi = rnd(Z, n * C, scale=0.02)
    alpha = torch.tensor([0.5, 0.7, 0.9], device=dev)
    b_pre, b_post, b_res = rnd(n, scale=0.1), rnd(n, scale=0.1), rnd(n, n)
    return x, y, h, Hr, phi, alpha, b_pre, b_post, b_res


def per_site(plan, x, y, h, Hr, phi, alpha, b_pre, b_post, b_res, eps):
    from mhc import fused_plan, fused_steps

    L = fused_plan.LAUNCHERS
    out = fused_steps.post_forward(plan, x, y, h, Hr)
    T, n, C, Z = plan.T, plan.n, plan.C, plan.Z
    zr = x.new_empty((T, Z + 1), dtype=plan.cdt)
    hn = x.new_empty((T, 2 * n), dtype=plan.cdt)
    R = x.new_empty((T, n, n), dtype=plan.cdt)
    u = x.new_empty((*x.shape[:-2], C))
    part = x.new_empty((plan.coeff_splits, T, plan.ZP), dtype=plan.cdt)
    L["coeff_partial"](plan.coeff_partial, out, phi, part, T, C, plan.coeff_k_per_split)
    L["coeff_fwd"](plan.coeff_fwd, part, out, alpha, b_pre, b_post, b_res, zr, hn, R, u, T, C, eps, plan.coeff_splits)
    return out, u, zr, hn, R


def compare(a, b):
    names = ("x'", "u", "zr", "h", "R")
    worst = {}
    for name, p, q in zip(names, a, b):
        p, q = p.double(), q.double()
        worst[name] = ((p - q).abs().max() / q.abs().max().clamp_min(1e-30)).item()
    return worst


def check(dev, cases):
    import kernel as bs
    from mhc import fused_plan

    bad = 0
    for T, n, C, dtype, BT, CC in cases:
        args = site_inputs(T, n, C, dtype, dev)
        plan = fused_plan.plan_for(args[0])
        ref = per_site(plan, *args, 1e-6)
        got = bs.launch(*args, 1e-6, BT=BT, CC=CC)
        err = compare(got, ref)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        # x' and u are rounded to the streams' dtype: allow one ulp there.
        coeff_tol = 1e-3 if dtype == torch.bfloat16 else 1e-4  # coefficients of x' that may differ by one ulp
        ok = all(v <= (tol if k in ("x'", "u") else coeff_tol) for k, v in err.items())
        bad += not ok
        print(f"T={T} n={n} C={C} {dtype} BT={BT} CC={CC}: " + " ".join(f"{k} {v:.1e}" for k, v in err.items())
              + ("" if ok else "  WRONG"))
    return bad


def bench(shapes, variants):
    import common
    import kernel as bs
    import triton.testing
    from mhc import fused_plan

    copy_gbps = common.copy_gbps()
    print(f"device copy {copy_gbps:.0f} GB/s")
    for C, T in shapes:
        n = 4
        args = site_inputs(T, n, C, torch.bfloat16, "cuda")
        plan = fused_plan.plan_for(args[0])
        floor_bytes = (2 * n * C + 2 * C) * T * 2
        floor_us = floor_bytes / copy_gbps / 1e3
        ref = per_site(plan, *args, 1e-6)
        rows = []
        base = lambda: per_site(plan, *args, 1e-6)  # noqa: E731
        for v in variants:
            try:
                got = bs.launch(*args, 1e-6, **v)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(f"C={C} {v}: failed {type(e).__name__}: {str(e)[:200]}")
                continue
            err = compare(got, ref)
            wrong = max(err.values()) > 2e-2 and v.get("SYNC", True) and v.get("DOTS", True)
            fn = lambda v=v: bs.launch(*args, 1e-6, **v)  # noqa: E731
            times_new, times_old = [], []
            for _ in range(2):
                times_old.append(triton.testing.do_bench(base, rep=100) * 1e3)
                times_new.append(triton.testing.do_bench(fn, rep=100) * 1e3)
            rows.append((min(times_new), min(times_old), v, err, wrong))
        rows.sort(key=lambda r: r[0])
        print(f"\nC={C} T={T}: floor {floor_us:.1f} us (2nC+2C at copy speed)")
        for new, old, v, err, wrong in rows[:12]:
            print(f"  {new:7.1f} us vs three kernels {old:7.1f} us ({new / old:.2f}x) {v}"
                  f" max rel {max(err.values()):.1e}{'  WRONG' if wrong else ''}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", choices=("configs", "ablation"),
                   help="time it (CUDA): launch configurations, or the ablation")
    a = p.parse_args()
    from mhc import projection_cuda
    projection_cuda.set_enabled(False)  # no extension build: these kernels do not use it
    if a.bench and not torch.cuda.is_available():
        p.error("--bench needs CUDA")
    if torch.cuda.is_available():
        cases = [(T, n, C, dt, 64, 128) for (T, n, C) in ((300, 4, 2048), (257, 4, 768), (100, 4, 200))
                 for dt in (torch.bfloat16, torch.float32)] + [(64, 8, 512, torch.bfloat16, 32, 64)]
        bad = 0 if a.bench else check("cuda", cases)
        if a.bench:
            if a.bench == "configs":
                configs = ((64, 128, 8), (32, 128, 4), (64, 64, 4), (128, 64, 8), (32, 256, 8), (64, 256, 8))
                variants = [dict(BT=bt, CC=cc, num_warps=w, num_stages=1) for bt, cc, w in configs]
            else:  # each switch gives wrong outputs: a timing only
                switches = (dict(), dict(SYNC=False), dict(SYNC=False, TICKET=False),
                            dict(SYNC=False, TICKET=False, DOTS=False))
                variants = [dict(BT=64, CC=64, num_warps=4, num_stages=1, **abl) for abl in switches]
            bench(((768, 16384), (2048, 8192)), variants)
    else:
        cases = [(37, 4, 40, torch.float32, 16, 64), (37, 4, 40, torch.bfloat16, 16, 64),
                 (20, 3, 24, torch.float32, 8, 32), (9, 8, 16, torch.float32, 4, 16)]
        bad = check("cpu", cases)
    print("bad cases:", bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
