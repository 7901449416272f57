"""A forward boundary kernel between two sites, against the two kernels it would replace (CUDA; issue #50's route).

    python benchmarks/site/boundary_sweep.py                       # small_gpu, 134M and 1.1B shapes, every variant
    python benchmarks/site/boundary_sweep.py --shapes 512x16384 --json boundary.json
    TRITON_INTERPRET=1 python benchmarks/site/boundary_sweep.py --device cpu --shapes 32x40 --limit 2   # a check

Today site k's ``postmix_fwd`` writes its output streams ``x'`` and site k+1's ``coeff_partial`` reads them back
for the dot products with its ``φ`` and the square sums (about 13 KB a token at C = 512 in bf16, 8 KB of it
``x'``). ``postmix_partial`` below does both in one pass: a program of ``BM`` tokens walks the columns in blocks
of ``BC``, forms every stream's ``x'`` there, stores it, and multiplies the stored (rounded) values with the
matching columns of the next ``φ`` on the tensor cores (``φ`` in two bf16 parts, as ``coeff_partial`` does), so
``x'`` is never read back. The partial sums come out as ``coeff_partial``'s with one split.

This is a measurement, not a path of the library: it times the kernel's variants under ``do_bench`` against the
plan's ``postmix_fwd`` + ``coeff_partial`` at each shape, after checking each variant's ``x'`` and sums against
theirs. Whether it pays is decided here first, and then in the model step (linking two sites' ops).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # this tree's mhc, installed or not
import common  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.testing  # noqa: E402

N_STREAMS = 4
SHAPES = ((512, 16384), (768, 16384), (2048, 8192))  # (C, T): small_gpu, 134M, 1.1B steps
GRID = dict(BM=(16, 32, 64), BC=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2, 3))


@triton.jit
def postmix_partial(
    x_ptr,
    y_ptr,
    h_ptr,
    hres_ptr,
    out_ptr,
    phi_ptr,
    part_ptr,
    T,
    C,
    n: tl.constexpr,
    NP: tl.constexpr,
    ZP: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
    COMPILED: tl.constexpr,
):
    """``x' = H_res x + H_post ⊗ y`` for BM tokens (written around stream 0, as ``postmix_fwd``), and the next
    site's ``[x' φᵀ | Σ x'²]`` rows (``part [T, ZP]``) from the stored ``x'``."""
    Z: tl.constexpr = n * n + 2 * n
    K = n * C
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = rm < T
    tok = rm.to(tl.int64)
    ri = tl.arange(0, NP)
    rz = tl.arange(0, ZP)
    row_i = m_ok[:, None] & (ri[None, :] < n)
    hpost = 2 * tl.load(h_ptr + tok[:, None] * (2 * n) + n + ri[None, :], mask=row_i, other=0.0)
    acc = tl.zeros((BM, ZP), dtype=tl.float32)
    sq = tl.zeros((BM, NP, BC), dtype=tl.float32)
    for c0 in range(0, C, BC):
        rc = c0 + tl.arange(0, BC)
        c_ok = rc < C
        mt = m_ok[:, None] & c_ok[None, :]
        x0 = tl.load(x_ptr + tok[:, None] * K + rc[None, :], mask=mt, other=0.0).to(tl.float32)
        mix = tl.zeros((BM, NP, BC), dtype=tl.float32)
        for j in tl.static_range(1, n):
            h_j = tl.load(hres_ptr + tok[:, None] * (n * n) + ri[None, :] * n + j, mask=row_i, other=0.0)
            x_j = tl.load(x_ptr + tok[:, None] * K + j * C + rc[None, :], mask=mt, other=0.0).to(tl.float32)
            mix += h_j[:, :, None] * (x_j - x0)[:, None, :]
        y = tl.load(y_ptr + tok[:, None] * C + rc[None, :], mask=mt, other=0.0).to(tl.float32)
        out = x0[:, None, :] + mix + hpost[:, :, None] * y[:, None, :]
        mask3 = row_i[:, :, None] & c_ok[None, None, :]
        stored = tl.where(mask3, out, 0.0).to(out_ptr.dtype.element_ty)
        tl.store(
            out_ptr + tok[:, None, None] * K + ri[None, :, None] * C + rc[None, None, :], stored, mask=mask3
        )
        xf = stored.to(tl.float32)
        sq += xf * xf
        w = tl.load(
            phi_ptr + rz[None, None, :] * K + ri[:, None, None] * C + rc[None, :, None],
            mask=(ri[:, None, None] < n) & c_ok[None, :, None] & (rz[None, None, :] < Z),
            other=0.0,
        )
        w = tl.reshape(w, (NP * BC, ZP))
        w_hi = w.to(tl.bfloat16)
        w_lo = (w - w_hi.to(tl.float32)).to(tl.bfloat16)
        if COMPILED:
            xt = tl.reshape(stored, (BM, NP * BC))
            acc = tl.dot(xt, w_hi, acc, out_dtype=tl.float32)
            acc = tl.dot(xt, w_lo, acc, out_dtype=tl.float32)
        else:  # the interpreter has no bf16 dot: the same exact products in fp32
            xt = tl.reshape(xf, (BM, NP * BC))
            acc = tl.dot(xt, w_hi.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
            acc = tl.dot(xt, w_lo.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
    total = tl.sum(tl.sum(sq, axis=2), axis=1)
    acc += tl.where(rz[None, :] == Z, total[:, None], 0.0)
    tl.store(part_ptr + tok[:, None] * ZP + rz[None, :], acc, mask=m_ok[:, None])


def site_inputs(C: int, T: int, device: str, seed: int = 0) -> dict:
    """One boundary's inputs: site k's streams, branch output and coefficients, site k+1's φ."""
    n, Z = N_STREAMS, N_STREAMS * N_STREAMS + 2 * N_STREAMS
    g = torch.Generator(device=device).manual_seed(seed)
    H_res = torch.softmax(torch.randn((T, n, n), device=device, generator=g), -1)
    return dict(
        x=torch.randn((T, n, C), device=device, generator=g).to(torch.bfloat16),
        y=torch.randn((T, C), device=device, generator=g).to(torch.bfloat16),
        h=torch.rand((T, 2 * n), device=device, generator=g),
        H_res=(H_res + H_res.transpose(1, 2)) / 2,  # rows and columns sum to one
        phi=0.02 * torch.randn((Z, n * C), device=device, generator=g),
    )


def reference(inp: dict):
    """``(fn, (x', part [T, ZP]))``: the plan's ``postmix_fwd`` then ``coeff_partial`` (splits summed)."""
    from mhc.fused import plan as fused_plan

    x, phi = inp["x"], inp["phi"]
    plan = fused_plan.plan_for(x)
    T, C = plan.T, plan.C
    kernels = fused_plan.LAUNCHERS
    out = torch.empty_like(x)
    part = x.new_empty((plan.coeff_splits, T, plan.ZP), dtype=torch.float32)

    def run():
        kernels["postmix_fwd"](plan.postmix_fwd, x, inp["y"], inp["h"], inp["H_res"], out, C)
        kernels["coeff_partial"](plan.coeff_partial, out, phi, part, T, C, plan.coeff_k_per_split)

    run()
    return run, (out.clone(), part.sum(0))


def merged(inp: dict, params: dict):
    """``(fn, (x', part))``: one launch of ``postmix_partial`` with ``params`` (tile sizes, warps, stages)."""
    x = inp["x"]
    T, n, C = x.shape
    ZP = triton.next_power_of_2(n * n + 2 * n + 1)
    out = torch.empty_like(x)
    part = x.new_empty((T, ZP), dtype=torch.float32)
    p = dict(params)
    grid = (triton.cdiv(T, p["BM"]),)

    def run():
        postmix_partial[grid](
            x,
            inp["y"],
            inp["h"],
            inp["H_res"],
            out,
            inp["phi"],
            part,
            T,
            C,
            n=n,
            NP=triton.next_power_of_2(n),
            ZP=ZP,
            COMPILED=x.is_cuda,
            **p,
        )

    run()
    return run, (out, part)


def errors(got, want) -> tuple[float, float]:
    """``(x' max rel, part max rel)``: each over its output's largest value."""
    rel = []
    for a, b in zip(got, want):
        a, b = a.double(), b.double()
        rel.append(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return rel[0], rel[1]


def variants(C: int, limit: int | None) -> list[dict]:
    out = []
    for values in itertools.product(*GRID.values()):
        v = dict(zip(GRID, values))
        if v["BC"] <= triton.next_power_of_2(C):
            out.append(v)
    return out[:limit]


def bench(fn, device: str, rep: float) -> float:
    """µs: the better of two do_bench medians (one timed call on the CPU)."""
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return min(1e3 * triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") for _ in range(2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="CxT,... (n = 4; default 512x16384,768x16384,2048x8192)")
    ap.add_argument(
        "--device", default="cuda", help="cuda (default), or cpu under TRITON_INTERPRET=1 (a check)"
    )
    ap.add_argument("--limit", type=int, help="at most this many variants a shape")
    ap.add_argument("--rep", type=float, default=40.0, help="do_bench's ms a round (default 40)")
    ap.add_argument(
        "--tol", type=float, default=2e-2, help="largest max rel of x' and of the sums (default 2e-2)"
    )
    ap.add_argument("--json", help="write every timing here")
    args = ap.parse_args(argv)
    from mhc import _ext

    _ext.set_enabled(False)  # only Triton kernels here: nothing waits on the CUDA extension's build
    shapes = (
        [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else list(SHAPES)
    )
    copy = common.copy_gbps() if args.device == "cuda" else float("nan")
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    say(f"device copy {copy:.0f} GB/s; n = {N_STREAMS}, bf16 streams")
    rows = []
    for C, T in shapes:
        inp = site_inputs(C, T, args.device)
        ref_fn, ref_out = reference(inp)
        ref_us = bench(ref_fn, args.device, args.rep)
        nbytes = common.site_kernel_bytes(T, N_STREAMS, C, 2)
        floor = nbytes["postmix_fwd"] + nbytes["coeff_partial"] - T * N_STREAMS * C * 2  # x' not read back
        say(
            f"C={C} T={T}: postmix_fwd + coeff_partial {ref_us:.1f} us; the merged kernel's floor "
            f"{floor / copy / 1e3:.1f} us at copy speed"
        )
        results = []
        for v in variants(C, args.limit):
            try:
                fn, out = merged(inp, v)
                e_out, e_part = errors(out, ref_out)
                us = bench(fn, args.device, args.rep)
            except Exception as e:  # noqa: BLE001 (a variant Triton cannot build is reported and skipped)
                say(f"  {v}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                continue
            ok = max(e_out, e_part) <= args.tol
            results.append(dict(C=C, T=T, params=v, us=us, rel_out=e_out, rel_part=e_part, ok=ok))
        good = sorted((r for r in results if r["ok"]), key=lambda r: r["us"])
        for r in good[:5]:
            say(
                f"  {r['us']:8.1f} us  {r['us'] / ref_us:.3f}x the pair  {floor / r['us'] / 1e3 / copy:.2f}x copy  "
                f"rel x' {r['rel_out']:.1e} sums {r['rel_part']:.1e}  {r['params']}"
            )
        wrong = [r for r in results if not r["ok"]]
        if wrong:
            say(f"  WRONG: {len(wrong)} of {len(results)}, e.g. {wrong[0]}")
        rows.append(dict(C=C, T=T, pair_us=ref_us, floor_bytes=floor, variants=results))
        if args.json:
            Path(args.json).write_text(json.dumps(dict(copy_gbps=copy, shapes=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
