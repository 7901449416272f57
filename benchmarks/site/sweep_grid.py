"""The variants ``sweep_site_kernels.py`` tries and when one is correct: the kernels, shapes and precisions,
the launch-parameter grids (bf16, float32 and the coarse one), the variants of a kernel and the compile each
shares, and the error of a variant's outputs against its bound."""

from __future__ import annotations

import itertools

import torch
import triton

N_STREAMS = 4
KERNELS = ("coeff_partial", "coeff_fwd", "postmix_fwd", "postmix_bwd", "coeff_bwd", "stream_grad", "phi_grad")
DOT_KERNELS = ("coeff_partial", "stream_grad", "phi_grad")  # the kernels with a tl.dot (PRECISION)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Shapes (C, T): the small_gpu preset's step (batch 32 x 512 at hidden 512, issue #49's profile), the 134M
# step (batch 8 x 2048) and the 1.1B step (batch 4 x 2048).
DEFAULT_SHAPES = {
    "bfloat16": ((512, 16384), (768, 16384), (2048, 8192)),
    "float32": ((512, 16384), (768, 16384), (2048, 8192)),
}
DEFAULT_KERNELS = {"bfloat16": KERNELS, "float32": ("coeff_partial", "stream_grad", "phi_grad", "coeff_bwd")}
PRECISIONS = ("ieee", "tf32x3", "tf32")
SMEM_BYTES = 232448  # the H200's shared memory a block may take (227 KB)
REL_FLOOR = 1e-6  # float64 reference: a max rel this small is fp32-accurate whatever the plan's

GRID = {  # bf16, as swept for the plan (notes/block_benchmarks.md)
    "coeff_partial": dict(
        BM=(32, 64, 128), BK=(64, 128, 256), splits=(1, 2, 4), num_warps=(4, 8), num_stages=(3, 4)
    ),
    "coeff_fwd": dict(BM=(8, 16, 32), BC=(128, 256, 512), num_warps=(1, 2, 4), num_stages=(1, 3)),
    "postmix_fwd": dict(BC=(256, 512, 1024), num_warps=(1, 2, 4, 8), num_stages=(1, 2, 3)),
    "postmix_bwd": dict(BC=(128, 256, 512), num_warps=(1, 2), num_stages=(1, 2, 3, 4)),
    "coeff_bwd": dict(BC=(256, 512, 1024), num_warps=(1, 2, 4), num_stages=(1, 2, 3)),
    "stream_grad": dict(
        BM=(16, 32, 64), BC=(32, 64), tokens=(128, 256), num_warps=(4, 8), num_stages=(1, 2, 3)
    ),
    "phi_grad": dict(BT=(32, 64), BN=(128, 256), splits=(16, 32), num_warps=(4, 8), num_stages=(2, 3, 4)),
}
GRID_FP32 = {  # float32 streams: a tile holds half the values of bf16's at the same bytes
    **GRID,
    "coeff_partial": dict(
        BM=(32, 64, 128), BK=(32, 64, 128), splits=(1, 2, 4), num_warps=(4, 8), num_stages=(3, 4)
    ),
    "coeff_bwd": dict(BC=(128, 256, 512, 1024), num_warps=(1, 2, 4), num_stages=(1, 2, 3)),
    "phi_grad": dict(BT=(32, 64), BN=(64, 128, 256), splits=(8, 16, 32), num_warps=(4, 8), num_stages=(2, 3)),
}
COARSE = {  # the --coarse precisions' grid (tf32: enough to show its error and its speed)
    "coeff_partial": dict(BM=(64, 128), BK=(64, 128), splits=(1, 2), num_warps=(4,), num_stages=(3,)),
    "stream_grad": dict(BM=(32, 64), BC=(32, 64), tokens=(256,), num_warps=(4,), num_stages=(1, 3)),
    "phi_grad": dict(BT=(32, 64), BN=(128, 256), splits=(16,), num_warps=(4,), num_stages=(3,)),
}
RUNTIME_PARAMS = (
    "splits",
    "tokens",
)  # launch arguments, not constexprs: variants that differ only here share a compile


def expand(kernel: str, grid: dict, C: int, dtype: torch.dtype) -> list[dict]:
    out = []
    for values in itertools.product(*grid.values()):
        v = dict(zip(grid.keys(), values))
        if "BC" in v and v["BC"] > triton.next_power_of_2(C):
            continue
        if kernel == "stream_grad" and v["tokens"] % v["BM"]:
            continue
        if kernel == "coeff_partial" and dtype != torch.bfloat16:
            # Triton's pipeline keeps num_stages - 1 steps of the x and φ tiles in shared memory (plan.py).
            ZP = triton.next_power_of_2(N_STREAMS * N_STREAMS + 2 * N_STREAMS)
            if (v["num_stages"] - 1) * v["BK"] * (v["BM"] * dtype.itemsize + ZP * 4) > SMEM_BYTES:
                continue
        out.append(v)
    return out


def grid_variants(
    kernel: str,
    C: int,
    dtype: torch.dtype = torch.bfloat16,
    precisions=(),
    coarse=(),
    limit: int | None = None,
) -> list[dict]:
    """The launch parameters tried for ``kernel`` (each a dict of constexprs and launch options).

    With ``precisions``, a kernel with a ``tl.dot`` gets each one as ``PRECISION`` (the ``coarse`` ones over
    :data:`COARSE`'s grid); ``limit`` keeps the first few of each precision (a smoke test).
    """
    grid = (GRID if dtype == torch.bfloat16 else GRID_FP32)[kernel]
    if kernel not in DOT_KERNELS or not precisions:
        return expand(kernel, grid, C, dtype)[:limit]
    out = []
    for p in precisions:
        out += [
            dict(v, PRECISION=p)
            for v in expand(kernel, COARSE[kernel] if p in coarse else grid, C, dtype)[:limit]
        ]
    return out


def compile_key(kernel: str, params: dict) -> tuple:
    return kernel, tuple(sorted((k, v) for k, v in params.items() if k not in RUNTIME_PARAMS))


def max_rel(a: tuple, b: tuple) -> float:
    """The largest ``max |a - b| / max |b|`` over the outputs (``inf`` where ``a`` is not finite)."""
    worst = 0.0
    for p, q in zip(a, b):
        p, q = p.double(), q.double()
        if not torch.isfinite(p).all():
            return float("inf")
        scale = q.abs().max().item() or 1.0
        worst = max(worst, (p - q).abs().max().item() / scale)
    return worst


def error_bound(reference: str, tol: float, plan_rel: float | None, rel_factor: float) -> float:
    """The largest ``max rel`` a variant may have: ``tol`` against the plan's outputs; against float64,
    ``rel_factor`` x the plan's own error (at least :data:`REL_FLOOR`), and never over ``tol``."""
    if reference == "plan" or plan_rel is None:
        return tol
    return min(tol, max(rel_factor * plan_rel, REL_FLOOR))
