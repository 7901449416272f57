"""A measured prototype, not used by mhc: one site's post-mix and the next site's first step in one pass.

Issue #22 asks for the post-mix of site k and the coefficients and pre-mix of
site k + 1 in one pass over the streams. This kernel splits the columns: a
program takes BT tokens and CC columns of every stream, writes its chunk of
``x' = H_res·x + H_post ⊗ y``, dots it with the same rows of the next site's
φ (n·CC rows, so φ's traffic is n·CC·Z per BT tokens), and posts the partial
sums. The last program of a tile to post sums the tile's parts and writes the
next site's coefficients (``coeff_fwd``'s helper); the others wait for them and
write their chunk of ``u = Σ_i h_pre[i] x'_i``. The streams are read once and
written once.

Programs take their work item from a ticket (an atomic counter), so a program
only waits on items that have started. Triton's interpreter runs programs one
after another, so there only CL = 1 (CC >= C) works.

On the H200 it is correct and 3.5-3.9x slower than the three kernels it
replaces; the dot products inside the pass cost most of it
(notes/block_benchmarks.md, "One pass, split over C"). ``SYNC``, ``TICKET``
and ``DOTS`` switch off the wait, the ticket and the dots for that ablation
(each gives wrong outputs). Run it with ``check.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mhc.fused_kernels import store_coefficients


@triton.jit
def boundary_split(
    x_ptr, y_ptr, h_ptr, hres_ptr, out_ptr,
    phi_ptr, philo_ptr, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, zr_ptr, hn_ptr, res_ptr, u_ptr,
    part_ptr, sync_ptr, T, C, eps,
    n: tl.constexpr, BT: tl.constexpr, CC: tl.constexpr, CL: tl.constexpr,
    ZP: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr, COMPILED: tl.constexpr,
    SYNC: tl.constexpr = True, TICKET: tl.constexpr = True, DOTS: tl.constexpr = True,  # ablations
):
    Z: tl.constexpr = n * n + 2 * n
    K = n * C
    tiles = tl.cdiv(T, BT)
    if TICKET:
        w = tl.atomic_add(sync_ptr + tiles, 1)
    else:  # ablation: grid order (only without SYNC)
        w = tl.program_id(0)
    tile = w // CL
    chunk = w % CL
    rt = tile * BT + tl.arange(0, BT)
    t_ok = rt < T
    rc = chunk * CC + tl.arange(0, CC)
    c_ok = rc < C
    rows = rt.to(tl.int64) * K
    m2 = t_ok[:, None] & c_ok[None, :]
    rz = tl.arange(0, ZP)
    w_ok = c_ok[:, None] & (rz[None, :] < Z)

    # x'_i for the chunk, [BT, CC] a stream, around stream 0; each x_j tile is read
    # from HBM once and again from L1 for the other streams.
    x0 = tl.load(x_ptr + rows[:, None] + rc[None, :], mask=m2, other=0.0).to(ACC)
    y = tl.load(y_ptr + rt.to(tl.int64)[:, None] * C + rc[None, :], mask=m2, other=0.0).to(ACC)
    acc = tl.zeros((BT, ZP), dtype=ACC)
    sq = tl.zeros((BT, CC), dtype=ACC)
    for i in tl.static_range(n):
        o = x0 + 2 * tl.load(h_ptr + rt * (2 * n) + n + i, mask=t_ok, other=0.0)[:, None] * y
        for j in tl.static_range(1, n):
            xj = tl.load(x_ptr + rows[:, None] + j * C + rc[None, :], mask=m2, other=0.0).to(ACC)
            o += tl.load(hres_ptr + (rt * n + i) * n + j, mask=t_ok, other=0.0)[:, None] * (xj - x0)
        xr = o.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] + i * C + rc[None, :], xr, mask=m2)
        xf = tl.where(m2, xr.to(ACC), 0.0)
        sq += xf * xf
        # φ's rows for stream i's chunk, [CC, ZP]; bf16x2: φ_hi and φ_lo are given split.
        w_off = rz[None, :] * K + (i * C + rc)[:, None]
        if not DOTS:  # ablation: no dot products
            pass
        elif PRECISION == "bf16x2":
            w_hi = tl.load(phi_ptr + w_off, mask=w_ok, other=0.0)
            w_lo = tl.load(philo_ptr + w_off, mask=w_ok, other=0.0)
            if COMPILED:
                acc = tl.dot(xr, w_hi, acc, out_dtype=ACC)
                acc = tl.dot(xr, w_lo, acc, out_dtype=ACC)
            else:
                acc = tl.dot(xf, w_hi.to(ACC), acc, input_precision="ieee", out_dtype=ACC)
                acc = tl.dot(xf, w_lo.to(ACC), acc, input_precision="ieee", out_dtype=ACC)
        else:
            acc = tl.dot(xf, tl.load(phi_ptr + w_off, mask=w_ok, other=0.0), acc, input_precision=PRECISION,
                         out_dtype=ACC)
    acc += tl.where(rz[None, :] == Z, tl.sum(sq, axis=1)[:, None], 0.0)
    tl.store(part_ptr + ((tile * CL + chunk) * BT + tl.arange(0, BT))[:, None] * ZP + rz[None, :], acc)

    # The tile's last poster sums the parts and writes the coefficients; the rest wait for them.
    tl.debug_barrier()
    arrived = tl.atomic_add(sync_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == CL - 1:
        tot = tl.zeros((BT, ZP), dtype=ACC)
        for ch in range(CL):
            tot += tl.load(part_ptr + ((tile * CL + ch) * BT + tl.arange(0, BT))[:, None] * ZP + rz[None, :],
                           cache_modifier=".cg")
        store_coefficients(tot, rt, t_ok, alpha_ptr, bpre_ptr, bpost_ptr, bres_ptr, zr_ptr, hn_ptr, res_ptr, K, eps,
                           n, ZP, COMPILED)
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + tile, CL, sem="release", scope="gpu")
    elif SYNC:  # (SYNC=False: an ablation that skips the wait, wrong u)
        seen = tl.load(sync_ptr + tile, volatile=True)
        while seen < 2 * CL:
            seen = tl.load(sync_ptr + tile, volatile=True)
        tl.atomic_add(sync_ptr + tile, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()

    # u = Σ_i h_pre[i] x'_i around stream 0 as coeff_fwd, from the x' just written (in L2).
    h_sum = tl.zeros((BT,), dtype=ACC)
    for i in tl.static_range(n):
        h_sum += tl.load(hn_ptr + rt * (2 * n) + i, mask=t_ok, other=0.0, cache_modifier=".cg")
    x0r = tl.load(out_ptr + rows[:, None] + rc[None, :], mask=m2, other=0.0, cache_modifier=".cg").to(ACC)
    u = h_sum[:, None] * x0r
    for i in tl.static_range(1, n):
        h_i = tl.load(hn_ptr + rt * (2 * n) + i, mask=t_ok, other=0.0, cache_modifier=".cg")
        xi = tl.load(out_ptr + rows[:, None] + i * C + rc[None, :], mask=m2, other=0.0, cache_modifier=".cg")
        u += h_i[:, None] * (xi.to(ACC) - x0r)
    tl.store(u_ptr + rt.to(tl.int64)[:, None] * C + rc[None, :], u.to(u_ptr.dtype.element_ty), mask=m2)


def launch(x, y, h, H_res, phi, alpha, b_pre, b_post, b_res, eps, BT=64, CC=128, num_warps=8, num_stages=1,
           SYNC=True, TICKET=True, DOTS=True):
    """``(x', u, zr, h', R')``: the post-mix of one site and the next site's first step, in one kernel."""
    T = x.numel() // (x.shape[-2] * x.shape[-1])
    n, C = x.shape[-2:]
    Z = n * n + 2 * n
    ZP = max(16, triton.next_power_of_2(Z + 1))
    CL = triton.cdiv(C, CC)
    tiles = triton.cdiv(T, BT)
    out = torch.empty_like(x)
    u = x.new_empty((*x.shape[:-2], C))
    zr = h.new_empty((T, Z + 1))
    hn = h.new_empty((T, 2 * n))
    R = h.new_empty((T, n, n))
    part = h.new_empty((tiles * CL * BT, ZP))
    sync = torch.zeros(tiles + 1, dtype=torch.int32, device=x.device)
    if x.dtype == torch.bfloat16:
        phi_hi = phi.to(torch.bfloat16)
        phi_lo = (phi - phi_hi.float()).to(torch.bfloat16)
    else:
        phi_hi = phi_lo = phi
    boundary_split[(tiles * CL,)](
        x, y, h, H_res, out, phi_hi, phi_lo, alpha, b_pre, b_post, b_res, zr, hn, R, u, part, sync, T, C, eps,
        n=n, BT=BT, CC=CC, CL=CL, ZP=ZP, ACC=tl.float32, COMPILED=x.is_cuda,
        PRECISION="bf16x2" if x.dtype == torch.bfloat16 else "ieee",
        num_warps=num_warps, num_stages=num_stages, SYNC=SYNC, TICKET=TICKET, DOTS=DOTS,
    )
    return out, u, zr, hn, R
