"""Boundary kernels between two sites, against the two kernels each would replace (CUDA; issue #50's route).

    python benchmarks/site/boundary_sweep.py                       # every boundary, three shapes, every variant
    python benchmarks/site/boundary_sweep.py --boundaries backward --shapes 512x16384 --json boundary.json
    TRITON_INTERPRET=1 python benchmarks/site/boundary_sweep.py --device cpu --shapes 32x40 --limit 2   # a check

Today site k's ``postmix_fwd`` writes its output streams ``x'`` and site k+1's ``coeff_partial`` reads them back
for the dot products with its ``φ`` and the square sums (about 13 KB a token at C = 512 in bf16, 8 KB of it
``x'``). ``postmix_partial`` below does both in one pass: a program of ``BM`` tokens walks the columns in blocks
of ``BC``, forms every stream's ``x'`` there, stores it, and multiplies the stored (rounded) values with the
matching columns of the next ``φ`` on the tensor cores (``φ`` in two bf16 parts, as ``coeff_partial`` does), so
``x'`` is never read back. The partial sums come out as ``coeff_partial``'s with one split.

Backward, site k+1's ``stream_grad`` writes ``dx`` and site k's ``postmix_bwd`` reads it back as its ``dx'``,
with site k's streams and branch output, for ``dy = Σ_i H_post[i] dx'_i`` and the per-token sums
``⟨dx'_i, y⟩`` and ``⟨dx'_i, x_j⟩``. ``grad_boundary`` does ``stream_grad``'s work and then, on the tile it
has just stored, ``dy`` and those sums over its block of columns (partial sums per block, added up after), so
``dx`` is never read back.

``forward_cuda``, ``dots_cuda`` and ``backward_cuda`` time a CUDA prototype (``boundary_dots.cuh``, built
here on first use). A CTA holds one split of the columns of every stream and φ's slice for it in shared memory,
loops over tiles of tokens, and runs the products with φ on ``mma.sync`` from registers loaded in the fragments'
layout. ``forward_cuda`` forms and stores ``x'`` first (against the forward pair above); ``dots_cuda`` takes the
streams as they are (against ``coeff_partial`` alone, the kernel it could replace with no ops linked across
sites); ``forward_pipe_cuda`` and ``dots_pipe_cuda`` are the same two with the streams staged through shared
memory by ``cp.async`` (``boundary_pipe.cuh``); ``backward_cuda`` is ``grad_boundary`` on the same terms (φ's
fp32 slice, the (r·dz)φ product in tf32).
The Triton kernels above lost to their pairs on the H100 (2026-12-06, notes/training_cost.md): the forward
1.07-1.13x, the backward 1.11-1.14x.

These are measurements, not paths of the library: each kernel's variants are timed under ``do_bench`` against the
plan's pair at each shape, after each variant's outputs are checked against the pair's. Whether a boundary
pays is decided here first, and then in the model step (linking two sites' ops).
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

from mhc.fused import plan as fused_plan  # noqa: E402

KERNELS = fused_plan.LAUNCHERS

N_STREAMS = 4
SHAPES = ((512, 16384), (768, 16384), (2048, 8192))  # (C, T): small_gpu, 134M, 1.1B steps


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
    cols_per_split,
    n: tl.constexpr,
    ZP: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
    COMPILED: tl.constexpr,
):
    """``x' = H_res x + H_post ⊗ y`` for BM tokens (written around stream 0, as ``postmix_fwd``) over one split
    of the columns, ``cols_per_split`` of every stream, and the next site's ``[x' φᵀ | Σ x'²]`` over them from
    the stored ``x'``: ``part [split, T, ZP]``, as ``coeff_partial`` writes it (its splits run over ``n·C`` in
    order, these over ``C`` in every stream at once; ``coeff_fwd`` sums either).

    Every tile is 2-d, ``[BM, BC]``: the streams' deviations from stream 0 are held for the block, and each
    output stream is formed, stored and multiplied with its own ``[BC, ZP]`` block of ``φ`` in turn. (The
    first prototype, e02097a, formed all streams as one ``[BM, n, BC]`` tile and reshaped it for one dot: on
    the H100 that needed 250-430 KB of shared memory at 128-wide blocks and ran at 0.1x a copy.) Written for
    n = 4, the streams held by name."""
    tl.static_assert(n == 4)
    Z: tl.constexpr = n * n + 2 * n
    K = n * C
    split = tl.program_id(1)
    c_begin = split * cols_per_split
    c_end = tl.minimum(c_begin + cols_per_split, C)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = rm < T
    tok = rm.to(tl.int64)
    rz = tl.arange(0, ZP)
    acc = tl.zeros((BM, ZP), dtype=tl.float32)
    sq = tl.zeros((BM, BC), dtype=tl.float32)
    for c0 in range(c_begin, c_end, BC):
        rc = c0 + tl.arange(0, BC)
        c_ok = rc < c_end
        mt = m_ok[:, None] & c_ok[None, :]
        rows = x_ptr + tok[:, None] * K + rc[None, :]
        x0 = tl.load(rows, mask=mt, other=0.0).to(tl.float32)
        d1 = tl.load(rows + C, mask=mt, other=0.0).to(tl.float32) - x0
        d2 = tl.load(rows + 2 * C, mask=mt, other=0.0).to(tl.float32) - x0
        d3 = tl.load(rows + 3 * C, mask=mt, other=0.0).to(tl.float32) - x0
        y = tl.load(y_ptr + tok[:, None] * C + rc[None, :], mask=mt, other=0.0).to(tl.float32)
        for i in tl.static_range(n):
            h_row = hres_ptr + tok * (n * n) + i * n
            mix = tl.load(h_row + 1, mask=m_ok, other=0.0)[:, None] * d1
            mix += tl.load(h_row + 2, mask=m_ok, other=0.0)[:, None] * d2
            mix += tl.load(h_row + 3, mask=m_ok, other=0.0)[:, None] * d3
            hpost = 2 * tl.load(h_ptr + tok * (2 * n) + n + i, mask=m_ok, other=0.0)
            out = x0 + mix + hpost[:, None] * y
            stored = tl.where(mt, out, 0.0).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + tok[:, None] * K + i * C + rc[None, :], stored, mask=mt)
            xf = stored.to(tl.float32)
            sq += xf * xf
            # φ's block for stream i as stored, [Z, K] read as [BC, ZP] (coeff_partial's layout)
            w = tl.load(
                phi_ptr + rz[None, :] * K + (i * C + rc)[:, None],
                mask=c_ok[:, None] & (rz[None, :] < Z),
                other=0.0,
            )
            w_hi = w.to(tl.bfloat16)
            w_lo = (w - w_hi.to(tl.float32)).to(tl.bfloat16)
            if COMPILED:
                acc = tl.dot(stored, w_hi, acc, out_dtype=tl.float32)
                acc = tl.dot(stored, w_lo, acc, out_dtype=tl.float32)
            else:  # the interpreter has no bf16 dot: the same exact products in fp32
                acc = tl.dot(xf, w_hi.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
                acc = tl.dot(xf, w_lo.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
    acc += tl.where(rz[None, :] == Z, tl.sum(sq, axis=1)[:, None], 0.0)
    tl.store(part_ptr + (split * T + tok)[:, None] * ZP + rz[None, :], acc, mask=m_ok[:, None])


@triton.jit
def grad_boundary(
    dout_ptr,
    du_ptr,
    x_ptr,
    work_ptr,
    phi_ptr,
    h_ptr,
    hres_ptr,
    dx_ptr,
    xk_ptr,
    yk_ptr,
    hk_ptr,
    dyk_ptr,
    sums_ptr,
    T,
    C,
    tokens_per_prog,
    n: tl.constexpr,
    NP: tl.constexpr,
    ZP: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
):
    """Site k+1's ``stream_grad`` (bf16 streams, no branch norm; its arguments first), then site k's
    ``postmix_bwd`` on the stored ``dx`` tile: ``dy_k`` and, per block of columns, the partial sums
    ``⟨dx_i, x_k,j⟩`` (``sums[block, t, i·n + j]``) and ``⟨dx_i, y_k⟩`` (``sums[block, t, n² + i]``)."""
    Z: tl.constexpr = n * n + 2 * n
    W: tl.constexpr = n * n + n
    K = n * C
    rc = tl.program_id(0) * BC + tl.arange(0, BC)
    rz = tl.arange(0, ZP)
    rj = tl.arange(0, NP)
    c_ok = rc < C
    jc_ok = (rj[:, None] < n) & c_ok[None, :]
    w = tl.load(
        phi_ptr + rz[:, None, None] * K + rj[None, :, None] * C + rc[None, None, :],
        mask=(rz[:, None, None] < Z) & jc_ok[None, :, :],
        other=0.0,
    )
    w = tl.reshape(w, (ZP, NP * BC))
    t_begin = tl.program_id(1) * tokens_per_prog
    t_end = tl.minimum(t_begin + tokens_per_prog, T)
    for t0 in range(t_begin, t_end, BM):
        rm = t0 + tl.arange(0, BM)
        m_ok = rm < t_end
        tok = rm.to(tl.int64)
        row = work_ptr + tok * (2 * Z + 4)
        dzr = tl.load(row[:, None] + rz[None, :], mask=m_ok[:, None] & (rz[None, :] < Z), other=0.0)
        acc = tl.reshape(tl.dot(dzr, w, input_precision="tf32", out_dtype=tl.float32), (BM, NP, BC))
        offs = tok[:, None, None] * K + rj[None, :, None] * C + rc[None, None, :]
        mask3 = m_ok[:, None, None] & jc_ok[None, :, :]
        c2 = tl.load(row + 2 * Z + 3, mask=m_ok, other=0.0)
        acc -= c2[:, None, None] * tl.load(x_ptr + offs, mask=mask3, other=0.0).to(tl.float32)
        row_j = m_ok[:, None] & (rj[None, :] < n)
        mt = m_ok[:, None] & c_ok[None, :]
        du = tl.load(du_ptr + tok[:, None] * C + rc[None, :], mask=mt, other=0.0).to(tl.float32)
        hpre = tl.load(h_ptr + tok[:, None] * (2 * n) + rj[None, :], mask=row_j, other=0.0)
        acc += hpre[:, :, None] * du[:, None, :]
        for i in tl.static_range(n):
            hi = tl.load(hres_ptr + tok[:, None] * (n * n) + i * n + rj[None, :], mask=row_j, other=0.0)
            di = tl.load(dout_ptr + tok[:, None] * K + i * C + rc[None, :], mask=mt, other=0.0)
            acc += hi[:, :, None] * di.to(tl.float32)[:, None, :]
        stored = acc.to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + offs, stored, mask=mask3)
        # site k's post-mix backward on the stored dx (its dx'): dy, then the block's partial sums
        d = tl.where(mask3, stored.to(tl.float32), 0.0)
        hpost = 2 * tl.load(hk_ptr + tok[:, None] * (2 * n) + n + rj[None, :], mask=row_j, other=0.0)
        dy = tl.sum(hpost[:, :, None] * d, axis=1)
        tl.store(dyk_ptr + tok[:, None] * C + rc[None, :], dy.to(dyk_ptr.dtype.element_ty), mask=mt)
        sums = sums_ptr + (tl.program_id(0) * T + tok[:, None]) * W
        y = tl.load(yk_ptr + tok[:, None] * C + rc[None, :], mask=mt, other=0.0).to(tl.float32)
        tl.store(sums + n * n + rj[None, :], tl.sum(d * y[:, None, :], axis=2), mask=row_j)
        for j in tl.static_range(n):
            xj = tl.load(xk_ptr + tok[:, None] * K + j * C + rc[None, :], mask=mt, other=0.0).to(tl.float32)
            tl.store(sums + rj[None, :] * n + j, tl.sum(d * xj[:, None, :], axis=2), mask=row_j)


def doubly_stochastic(T: int, n: int, device: str, g: torch.Generator) -> torch.Tensor:
    """``[T, n, n]`` float32 matrices whose rows and columns sum to one (a row softmax, symmetrised)."""
    H = torch.softmax(torch.randn((T, n, n), device=device, generator=g), -1)
    return (H + H.transpose(1, 2)) / 2


class Forward:
    """Site k's ``postmix_fwd`` and site k+1's ``coeff_partial`` against ``postmix_partial``."""

    name = "forward"
    # 24 compiles (a few seconds each in this process), each over 1, 2, 4 and 8 splits of the columns: from
    # coeff_partial's programs of whole rows to postmix_fwd's grid of column blocks
    grid = dict(BM=(32, 64, 128), BC=(64, 128), num_warps=(4, 8), num_stages=(2, 3), splits=(1, 2, 4, 8))

    @staticmethod
    def inputs(C: int, T: int, device: str, seed: int = 0) -> dict:
        """Site k's streams, branch output and coefficients, site k+1's φ."""
        n, Z = N_STREAMS, N_STREAMS * N_STREAMS + 2 * N_STREAMS
        g = torch.Generator(device=device).manual_seed(seed)
        H_res = doubly_stochastic(T, n, device, g)
        return dict(
            x=torch.randn((T, n, C), device=device, generator=g).to(torch.bfloat16),
            y=torch.randn((T, C), device=device, generator=g).to(torch.bfloat16),
            h=torch.rand((T, 2 * n), device=device, generator=g),
            H_res=H_res,
            phi=0.02 * torch.randn((Z, n * C), device=device, generator=g),
        )

    @staticmethod
    def floor_bytes(C: int, T: int) -> int:
        nbytes = common.site_kernel_bytes(T, N_STREAMS, C, 2)
        return nbytes["postmix_fwd"] + nbytes["coeff_partial"] - T * N_STREAMS * C * 2  # x' not read back

    @staticmethod
    def reference(inp: dict):
        """``(fn, (x', part [T, ZP]))``: the plan's ``postmix_fwd`` then ``coeff_partial`` (splits summed)."""
        x, phi = inp["x"], inp["phi"]
        plan = fused_plan.plan_for(x)
        T, C = plan.T, plan.C
        out = torch.empty_like(x)
        part = x.new_empty((plan.coeff_splits, T, plan.ZP), dtype=torch.float32)

        def run():
            KERNELS["postmix_fwd"](plan.postmix_fwd, x, inp["y"], inp["h"], inp["H_res"], out, C)
            KERNELS["coeff_partial"](plan.coeff_partial, out, phi, part, T, C, plan.coeff_k_per_split)

        run()
        return run, (out.clone(), part.sum(0))

    @staticmethod
    def merged(inp: dict, params: dict):
        """``(fn, (x', part))``: one launch of ``postmix_partial`` with ``params`` (tile sizes, warps, stages)."""
        x = inp["x"]
        T, n, C = x.shape
        p = dict(params)
        per = triton.cdiv(triton.cdiv(C, p.pop("splits")), p["BC"]) * p["BC"]  # whole column blocks
        splits = triton.cdiv(C, per)
        out = torch.empty_like(x)
        part = x.new_empty((splits, T, triton.next_power_of_2(n * n + 2 * n + 1)), dtype=torch.float32)
        grid = (triton.cdiv(T, p["BM"]), splits)

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
                per,
                n=n,
                ZP=part.shape[2],
                COMPILED=x.is_cuda,
                **p,
            )

        run()
        # the splits' partial rows summed for the check only: coeff_fwd reads them as they are, as it
        # reads coeff_partial's (whose splits the reference sums outside its timing too)
        return run, (out, part.sum(0))


class Backward:
    """Site k+1's ``stream_grad`` and site k's ``postmix_bwd`` against ``grad_boundary`` (and its sums' sum)."""

    name = "backward"
    # around stream_grad's plan (64 tokens x 64 columns over 256 tokens, 4 warps, 1 stage): 16 variants
    grid = dict(BM=(32, 64), BC=(32, 64), tokens=(256,), num_warps=(4, 8), num_stages=(1, 2))

    @staticmethod
    def inputs(C: int, T: int, device: str, seed: int = 0) -> dict:
        """Site k+1's ``dx'``, ``du``, streams, work rows and coefficients; site k's streams, branch output and h."""
        n, Z = N_STREAMS, N_STREAMS * N_STREAMS + 2 * N_STREAMS
        g = torch.Generator(device=device).manual_seed(seed)

        def streams(*shape):
            return torch.randn(shape, device=device, generator=g).to(torch.bfloat16)

        H_res = doubly_stochastic(T, n, device, g)
        return dict(
            dout=streams(T, n, C),
            du=streams(T, C),
            x=streams(T, n, C),
            work=0.01 * torch.randn((T, 2 * Z + 4), device=device, generator=g),
            phi=0.02 * torch.randn((Z, n * C), device=device, generator=g),
            h=torch.rand((T, 2 * n), device=device, generator=g),
            H_res=H_res,
            x_k=streams(T, n, C),
            y_k=streams(T, C),
            h_k=torch.rand((T, 2 * n), device=device, generator=g),
        )

    @staticmethod
    def floor_bytes(C: int, T: int) -> int:
        nbytes = common.site_kernel_bytes(T, N_STREAMS, C, 2)
        return nbytes["stream_grad"] + nbytes["postmix_bwd"] - T * N_STREAMS * C * 2  # dx not read back

    @staticmethod
    def reference(inp: dict):
        """``(fn, (dx, dy_k, g_res_k [T, n, n], g_post_k [T, n]))``: the plan's ``stream_grad`` then
        ``postmix_bwd``."""
        x = inp["x"]
        plan = fused_plan.plan_for(x)
        T, n, C = plan.T, plan.n, plan.C
        dx, dy = torch.empty_like(x), torch.empty_like(inp["y_k"])
        g_h, g_res = inp["h"].new_empty((T, 2 * n)), inp["h"].new_empty((T, n, n))
        unused = inp["work"]  # the branch norm's pointers (NORM is off)

        def run():
            KERNELS["stream_grad"](
                plan.stream_grad,
                inp["dout"],
                inp["du"],
                x,
                inp["work"],
                inp["phi"],
                inp["h"],
                inp["H_res"],
                dx,
                unused,
                unused,
                unused,
                unused,
                T,
                C,
                plan.stream_tokens,
            )
            KERNELS["postmix_bwd"](
                plan.postmix_bwd, dx, inp["x_k"], inp["y_k"], inp["h_k"], dy, g_h, g_res, C
            )

        run()
        return run, (dx.clone(), dy.clone(), g_res.clone(), g_h[:, n:] / 2)

    @staticmethod
    def merged(inp: dict, params: dict):
        """``(fn, (dx, dy_k, g_res_k, g_post_k))``: ``grad_boundary`` with ``params``, then its sums' sum."""
        x = inp["x"]
        T, n, C = x.shape
        p = dict(params)
        tokens = p.pop("tokens")
        blocks = triton.cdiv(C, p["BC"])
        dx, dy = torch.empty_like(x), torch.empty_like(inp["y_k"])
        sums = inp["h"].new_empty((blocks, T, n * n + n))
        out = {}

        def run():
            grad_boundary[(blocks, triton.cdiv(T, tokens))](
                inp["dout"],
                inp["du"],
                x,
                inp["work"],
                inp["phi"],
                inp["h"],
                inp["H_res"],
                dx,
                inp["x_k"],
                inp["y_k"],
                inp["h_k"],
                dy,
                sums,
                T,
                C,
                tokens,
                n=n,
                NP=triton.next_power_of_2(n),
                ZP=triton.next_power_of_2(n * n + 2 * n),
                **p,
            )
            out["total"] = sums.sum(0)

        run()
        total = out["total"]
        return run, (dx, dy, total[:, : n * n].view(T, n, n), total[:, n * n :])


_CUDA_PROTOTYPE = None


def cuda_prototype():
    """The CUDA prototype of ``boundary_dots.cu`` beside this script, built on first use (ninja, under
    ``TORCH_EXTENSIONS_DIR``)."""
    global _CUDA_PROTOTYPE
    if _CUDA_PROTOTYPE is None:
        from torch.utils.cpp_extension import load

        here = Path(__file__).resolve().parent
        _CUDA_PROTOTYPE = load(
            name="mhc_boundary_dots_prototype",
            sources=[
                str(here / name) for name in ("boundary_dots.cu", "boundary_pipe.cu", "boundary_grad.cu")
            ],
            extra_include_paths=[str(here)],
            extra_cuda_cflags=["-O3", "-std=c++17"],
        )
    return _CUDA_PROTOTYPE


def phi_parts(phi: torch.Tensor) -> torch.Tensor:
    """``[2, Z, K]`` bf16: φ's hi and lo parts, as ``coeff_partial``'s ``bf16x2`` splits it in its tiles."""
    hi = phi.to(torch.bfloat16)
    return torch.stack((hi, (phi - hi.float()).to(torch.bfloat16))).contiguous()


def cuda_launch_shape(C: int, T: int, params: dict) -> tuple[int, int]:
    """``(splits, CTAs a split)``: the prototype's grid, about ``ctas_per_sm`` CTAs an SM in all, each CTA
    looping over the tiles of ``16·warps`` tokens it is given (so φ's slice is loaded once for several)."""
    splits = triton.cdiv(C, params["cols_per_split"])
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    tiles = triton.cdiv(T, 16 * params["warps"])
    return splits, max(1, min(tiles, triton.cdiv(sms * params["ctas_per_sm"], splits)))


def cuda_merged(inp: dict, params: dict, postmix: bool, pipe: bool = False):
    """``(fn, outputs)``: one launch of the prototype with ``params`` on ``inp``, with the post-mix (outputs
    ``(x', part)``) or without (``(part,)``); the splits' partial rows summed for the check only. ``pipe``:
    ``dots_pipe_kernel`` (the loads staged by ``cp.async``), else ``boundary_dots_kernel``."""
    x = inp["x"]
    T, n, C = x.shape
    splits, grid_y = cuda_launch_shape(C, T, params)
    phi2 = phi_parts(inp["phi"])  # once a step per site in a library path, outside the timing here
    part = x.new_empty((splits, T, 32), dtype=torch.float32)
    if postmix:
        out = torch.empty_like(x)
        args = (x, inp["y"], inp["h"], inp["H_res"], out, phi2, part)
    else:
        none = x.new_empty(0)
        args = (x, none, none, none, none, phi2, part)
    ext, p = cuda_prototype(), params
    if pipe:
        launch, tail = ext.dots_pipe, (p["warps"], p["chunk_cols"], p["stages"])
    else:
        launch, tail = ext.dots, (p["prefetch"], p["warps"])

    def run():
        launch(*args, p["cols_per_split"], grid_y, postmix, *tail)

    run()
    return run, ((out, part.sum(0)) if postmix else (part.sum(0),))


class ForwardCuda(Forward):
    """:class:`Forward`'s pair against the CUDA prototype (``boundary_dots.cuh`` with the post-mix): φ's
    slice resident in shared memory, the dots on ``mma.sync``, 8-byte loads in the fragments' layout."""

    name = "forward_cuda"
    devices = ("cuda",)
    grid = dict(cols_per_split=(64, 128, 256), ctas_per_sm=(2, 4, 8), prefetch=(False, True), warps=(4, 8))

    @staticmethod
    def valid(v: dict, C: int) -> bool:
        return v["cols_per_split"] <= C and 2 * 24 * (4 * v["cols_per_split"] + 16) * 2 <= 200 * 1024

    @staticmethod
    def merged(inp: dict, params: dict):
        return cuda_merged(inp, params, postmix=True)


class DotsCuda:
    """``coeff_partial`` alone (the plan's launch) against the CUDA prototype without the post-mix: whether the
    dots with φ resident beat today's kernel in its own place, with no ops linked across sites."""

    name = "dots_cuda"
    devices = ("cuda",)
    grid = ForwardCuda.grid
    valid = ForwardCuda.valid

    @staticmethod
    def inputs(C: int, T: int, device: str, seed: int = 0) -> dict:
        return {k: v for k, v in Forward.inputs(C, T, device, seed).items() if k in ("x", "phi")}

    @staticmethod
    def floor_bytes(C: int, T: int) -> int:
        return common.site_kernel_bytes(T, N_STREAMS, C, 2)["coeff_partial"]

    @staticmethod
    def reference(inp: dict):
        x, phi = inp["x"], inp["phi"]
        plan = fused_plan.plan_for(x)
        part = x.new_empty((plan.coeff_splits, plan.T, plan.ZP), dtype=torch.float32)

        def run():
            KERNELS["coeff_partial"](plan.coeff_partial, x, phi, part, plan.T, plan.C, plan.coeff_k_per_split)

        run()
        return run, (part.sum(0),)

    @staticmethod
    def merged(inp: dict, params: dict):
        return cuda_merged(inp, params, postmix=False)


def pipe_shared_bytes(v: dict, postmix: bool) -> int:
    """Shared memory of one CTA of ``dots_pipe_kernel`` (``boundary_pipe.cuh``'s ``pipe_shared_bytes``)."""
    cols = (4 + postmix) * v["chunk_cols"]
    row = cols + (16 - cols) % 64
    return 2 * 24 * (4 * v["cols_per_split"] + 16) * 2 + v["stages"] * 16 * v["warps"] * row * 2


PIPE_GRID = dict(
    cols_per_split=(64, 128, 256), chunk_cols=(16, 32), stages=(2, 3, 4), warps=(4, 8), ctas_per_sm=(1, 2, 4)
)


def pipe_valid(postmix: bool):
    def valid(v: dict, C: int) -> bool:
        return (
            v["cols_per_split"] <= C
            and C % v["chunk_cols"] == 0
            and v["cols_per_split"] % v["chunk_cols"] == 0
            and pipe_shared_bytes(v, postmix) <= 227 * 1024
        )

    return staticmethod(valid)


class DotsPipeCuda(DotsCuda):
    """``coeff_partial`` alone against the prototype's ``dots_pipe_kernel`` (``boundary_pipe.cuh``): the dots of
    :class:`DotsCuda` with the streams staged through shared memory by ``cp.async`` in a ring of ``stages``
    steps of ``chunk_cols`` columns of every stream, so that a CTA keeps enough bytes in flight (``dots_cuda``'s
    register loads reached 0.45-0.50x a copy on the H100). Whether CUDA dots can run at a copy's speed decides
    whether a boundary kernel built on them can beat its pair."""

    name = "dots_pipe_cuda"
    grid = PIPE_GRID
    valid = pipe_valid(postmix=False)

    @staticmethod
    def merged(inp: dict, params: dict):
        return cuda_merged(inp, params, postmix=False, pipe=True)


class ForwardPipeCuda(ForwardCuda):
    """:class:`Forward`'s pair against ``dots_pipe_kernel`` with the post-mix: the streams and y staged by
    ``cp.async``, ``x'`` formed in registers, stored, and multiplied with φ as stored."""

    name = "forward_pipe_cuda"
    grid = PIPE_GRID
    valid = pipe_valid(postmix=True)

    @staticmethod
    def merged(inp: dict, params: dict):
        return cuda_merged(inp, params, postmix=True, pipe=True)


class BackwardCuda(Backward):
    """:class:`Backward`'s pair against the CUDA prototype's ``grad_boundary_kernel``: φ's fp32 slice in shared
    memory in B-fragment order, (r·dz)φ on tf32 ``mma.sync``, then site k's post-mix backward on the stored tile;
    the per-token coefficients in registers or (``coef_smem``) in shared memory."""

    name = "backward_cuda"
    devices = ("cuda",)
    grid = dict(cols_per_split=(64, 128, 256), ctas_per_sm=(1, 2, 4), warps=(4, 8), coef_smem=(False, True))

    @staticmethod
    def valid(v: dict, C: int) -> bool:
        return v["cols_per_split"] <= C

    @staticmethod
    def merged(inp: dict, params: dict):
        """``(fn, (dx, dy_k, g_res_k, g_post_k))``: one launch of the prototype, then its sums' sum."""
        x = inp["x"]
        T, n, C = x.shape
        splits, grid_y = cuda_launch_shape(C, T, params)
        dx, dy = torch.empty_like(x), torch.empty_like(inp["y_k"])
        sums = inp["h"].new_empty((splits, T, n * n + n))
        ext, p = cuda_prototype(), params
        args = [inp[k] for k in ("dout", "du", "x", "work", "phi", "h", "H_res")]
        args += [dx, inp["x_k"], inp["y_k"], inp["h_k"], dy, sums]

        def run():
            ext.grad(*args, p["cols_per_split"], grid_y, p["warps"], p["coef_smem"])

        run()
        total = sums.sum(0)
        return run, (dx, dy, total[:, : n * n].view(T, n, n), total[:, n * n :])


BOUNDARIES = {
    b.name: b for b in (Forward, Backward, ForwardCuda, DotsCuda, ForwardPipeCuda, DotsPipeCuda, BackwardCuda)
}


def errors(got, want) -> list[float]:
    """Each output's max rel: the largest difference over the largest value."""
    rel = []
    for a, b in zip(got, want):
        a, b = a.double(), b.double()
        rel.append(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return rel


def triton_tiles_fit(v: dict, C: int) -> bool:
    """A Triton variant's tiles fit the shape: a column block within C, whole token blocks, no empty split."""
    return (
        v["BC"] <= triton.next_power_of_2(C)
        and v.get("tokens", v["BM"]) % v["BM"] == 0
        and v.get("splits", 1) * v["BC"] <= max(C, v["BC"])
    )


def variants(boundary, C: int, limit: int | None) -> list[dict]:
    valid = getattr(boundary, "valid", triton_tiles_fit)
    out = []
    for values in itertools.product(*boundary.grid.values()):
        v = dict(zip(boundary.grid, values))
        if valid(v, C):
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
    ap.add_argument(
        "--boundaries",
        help="of " + ",".join(BOUNDARIES) + " (default: all that run on --device; the *_cuda ones need CUDA)",
    )
    ap.add_argument("--shapes", help="CxT,... (n = 4; default 512x16384,768x16384,2048x8192)")
    ap.add_argument(
        "--device", default="cuda", help="cuda (default), or cpu under TRITON_INTERPRET=1 (a check)"
    )
    ap.add_argument("--limit", type=int, help="at most this many variants a shape")
    ap.add_argument("--rep", type=float, default=40.0, help="do_bench's ms a round (default 40)")
    ap.add_argument("--tol", type=float, default=2e-2, help="largest max rel of any output (default 2e-2)")
    ap.add_argument("--json", help="write every timing here")
    args = ap.parse_args(argv)
    if args.boundaries is None:
        args.boundaries = ",".join(
            n for n, b in BOUNDARIES.items() if args.device in getattr(b, "devices", ("cuda", "cpu"))
        )
    if unknown := set(args.boundaries.split(",")) - set(BOUNDARIES):
        ap.error(f"unknown boundaries {sorted(unknown)}")
    from mhc import _ext

    enabled = _ext.set_enabled(False)  # only Triton kernels here: nothing waits on the CUDA extension's build
    try:
        return _sweep(args)
    finally:
        _ext.set_enabled(enabled)


def _sweep(args) -> int:
    shapes = (
        [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else list(SHAPES)
    )
    copy = common.copy_gbps() if args.device == "cuda" else float("nan")
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    say(f"device copy {copy:.0f} GB/s; n = {N_STREAMS}, bf16 streams")
    if any(name.endswith("_cuda") for name in args.boundaries.split(",")):
        t0 = time.perf_counter()
        cuda_prototype()  # built once here: a failed build stops the sweep with its error, not every variant
        say(f"CUDA prototype built or loaded in {time.perf_counter() - t0:.0f} s")
    rows = []
    for name in args.boundaries.split(","):
        boundary = BOUNDARIES[name]
        for C, T in shapes:
            inp = boundary.inputs(C, T, args.device)
            ref_fn, ref_out = boundary.reference(inp)
            ref_us = bench(ref_fn, args.device, args.rep)
            floor = boundary.floor_bytes(C, T)
            say(
                f"{name} C={C} T={T}: the pair {ref_us:.1f} us; the merged kernel's floor "
                f"{floor / copy / 1e3:.1f} us at copy speed"
            )
            results = []
            for v in variants(boundary, C, args.limit):
                try:
                    fn, out = boundary.merged(inp, v)
                    rel = errors(out, ref_out)
                    us = bench(fn, args.device, args.rep)
                except Exception as e:  # noqa: BLE001 (a variant Triton cannot build is reported and skipped)
                    say(f"  {v}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                    continue
                results.append(dict(params=v, us=us, rel=rel, ok=max(rel) <= args.tol))
            good = sorted((r for r in results if r["ok"]), key=lambda r: r["us"])
            for r in good[:5]:
                say(
                    f"  {r['us']:8.1f} us  {r['us'] / ref_us:.3f}x the pair  {floor / r['us'] / 1e3 / copy:.2f}x copy  "
                    f"rel {max(r['rel']):.1e}  {r['params']}"
                )
            wrong = [r for r in results if not r["ok"]]
            if wrong:
                say(f"  WRONG: {len(wrong)} of {len(results)}, e.g. {wrong[0]}")
            rows.append(dict(boundary=name, C=C, T=T, pair_us=ref_us, floor_bytes=floor, variants=results))
            if args.json:
                Path(args.json).write_text(json.dumps(dict(copy_gbps=copy, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
