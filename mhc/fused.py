"""Fused mHC site for CUDA: the streams are read and written in a few passes.

:class:`mhc.MHCBlock` (``mode="mhc"``) sends CUDA streams here when Triton is
importable; the PyTorch code in :mod:`mhc.block` stays the reference and the
CPU implementation. The kernels are in :mod:`mhc.fused_kernels`.

The site is two autograd nodes around the sublayer ``F`` (plus the
projection's own)::

    u, H_post, R = _SitePre(x, φ, α, b)     # RMSNorm(x_flat) φᵀ, σ / 2σ, Σ H_pre[i] x_i
    H_res        = birkhoff_project(R)
    y            = F(u)
    x'           = _PostMix(x, y, H_post, H_res)

Backward order is fixed by the graph: ``_PostMix``, ``F`` and the
projection, then ``_SitePre``. ``_PostMix`` returns no gradient for ``x``; it
leaves ``dx'`` in a per-call :class:`_SiteState`, and ``_SitePre`` writes the
whole ``dx`` in one pass (separate gradients would cost extra reads and
writes of the streams to add up). Double backward is not supported.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .projection import birkhoff_project

__all__ = ["available", "mhc_site", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

try:
    from . import fused_kernels as _k
except ImportError:  # no Triton (CPU-only PyTorch builds)
    _k = None


def available() -> bool:
    """Whether the Triton kernels can be used (Triton importable)."""
    return _k is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(v: int, lo: int = 1) -> int:
    return max(lo, 1 << (int(v) - 1).bit_length())


@functools.cache
def _column_groups(n: int, device: torch.device) -> Tensor:
    """Which α scales each column of ``z``: 0 for H_pre's n, 1 for H_post's n, 2 for R's n²."""
    # Cached: building it per call would be a blocking host-to-device copy.
    return torch.tensor([0] * n + [1] * n + [2] * (n * n), device=device)


def _coef_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _numerics(x: Tensor) -> dict:
    # bf16/fp16 streams are exact in tf32, so there only φ and dz are rounded
    # (to 10 bits) on the tensor cores; fp32/fp64 streams keep full products.
    precise = x.dtype in (torch.float32, torch.float64)
    return dict(PRECISION="ieee" if precise else "tf32", ACC=_k.acc_type(x.dtype))


class _SiteState:
    """What the two nodes of one call share in backward (detached tensors)."""

    __slots__ = ("h_res", "d_out")

    def __init__(self):
        self.h_res = self.d_out = None


class _SitePre(torch.autograd.Function):
    """Streams and coefficient parameters -> ``(u, H_post, R)``; ``H_res = Π_B(exp(R))`` is taken outside.

    One node for the norm, ``φ``, the σ / 2σ activations and the pre-mix, so
    that a site costs a few host-side launches instead of a graph of small ops.
    The activations are the same PyTorch ops as :meth:`mhc.MHCBlock.coefficients`
    (so ``φ = 0`` reproduces them bit for bit), run without autograd.
    """

    @staticmethod
    def forward(ctx, x, phi, alpha, b_pre, b_post, b_res, eps: float, state: _SiteState):
        T, n, C = x.shape
        K, Z = n * C, phi.shape[0]
        ZP = _pow2(Z, 16)
        z = x.new_empty((T, Z), dtype=_coef_dtype(x))
        r = x.new_empty((T,), dtype=_coef_dtype(x))
        # Measured on the H200 (n=4, C=2048): neither other tile shapes nor a split
        # over n·C beat 64 x 64 tiles (notes/block_benchmarks.md).
        BM, BK = 64, 64
        _k.coeff_fwd[(_cdiv(T, BM),)](x, phi, z, r, T, K, Z, eps, BM=BM, BK=BK, ZP=ZP, **_numerics(x))

        # Per-column α and bias: columns [0, n) are H_pre's, [n, 2n) H_post's, the rest R's.
        group = _column_groups(n, x.device)
        scale = alpha.index_select(0, group)
        v = z * scale + torch.cat([b_pre, b_post, b_res.reshape(-1)])
        h_pre = torch.sigmoid(v[:, :n]).contiguous()  # the pre-mix kernel reads it as [T, n]
        h_post = 2 * torch.sigmoid(v[:, n : 2 * n])
        R = v[:, 2 * n :].reshape(T, n, n)

        u = x.new_empty((T, C))
        BC = min(4096 // _pow2(n), _pow2(C, 16))
        _k.premix_fwd[(T, _cdiv(C, BC))](x, h_pre, u, C, n=n, NP=_pow2(n), BC=BC, ACC=_k.acc_type(x.dtype))
        ctx.save_for_backward(x, phi, z, r, h_pre, h_post, group, scale)
        ctx.state = state
        return u, h_post, R

    @staticmethod
    @once_differentiable
    def backward(ctx, du, d_post, dR):
        x, phi, z, r, h_pre, h_post, group, scale = ctx.saved_tensors
        state: _SiteState = ctx.state
        T, n, C = x.shape
        K, Z = n * C, phi.shape[0]
        ZP = _pow2(Z, 16)
        du = du.contiguous()
        g_pre = x.new_empty((T, n), dtype=z.dtype)
        _k.premix_bwd[(T,)](du, x, g_pre, C, n=n, NP=_pow2(n), BC=min(512, _pow2(C, 16)), ACC=_k.acc_type(x.dtype))
        # Back through σ, 2σ and the affine map v = α·z + b.
        dv = torch.cat([g_pre * h_pre * (1 - h_pre), d_post * h_post * (1 - 0.5 * h_post), dR.reshape(T, n * n)], 1)
        d_alpha = None
        if ctx.needs_input_grad[2]:
            d_alpha = scale.new_zeros(3).index_add_(0, group, (dv * z).sum(0))
        db_pre, db_post, db_res = dv.sum(0).split([n, n, n * n])
        dz = dv * scale

        dx = dphi = None
        if ctx.needs_input_grad[0]:
            # d/dx of z = r·x φᵀ: r·(dz φ) − r³·x·⟨dz φ, x⟩/K, and ⟨dz φ, x⟩ = ⟨dz, z⟩/r.
            c2 = (dz * z).sum(-1) * r * r / K
            # No dx' when the site's output took no part in the loss (only H_post / R did).
            d_out = state.d_out.contiguous() if state.d_out is not None else torch.zeros_like(x)
            dx = torch.empty_like(x)
            BM, BC = 16, 64
            _k.stream_grad[(_cdiv(T, BM), _cdiv(C, BC))](
                d_out, du, x, dz, r, c2, phi, h_pre, state.h_res, dx, T, C, Z,
                n=n, NP=_pow2(n), ZP=ZP, BM=BM, BC=BC, **_numerics(x),
            )
        if ctx.needs_input_grad[1]:
            dzr = dz * r[:, None]
            BT, BN = 32, 128
            splits = max(1, min(16, T // 1024))
            per = _cdiv(_cdiv(T, splits), BT) * BT
            splits = _cdiv(T, per)
            part = x.new_empty((splits, ZP, K), dtype=z.dtype)
            _k.phi_grad[(_cdiv(K, BN), splits)](dzr, x, part, T, K, Z, per, ZP=ZP, BT=BT, BN=BN, **_numerics(x))
            dphi = part.sum(0)[:Z]
        state.d_out = None
        return dx, dphi, d_alpha, db_pre, db_post, db_res.reshape(n, n), None, None


class _PostMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, h_post: Tensor, h_res: Tensor, exact_rows: bool, state: _SiteState):
        T, n, C = x.shape
        h_post, h_res = h_post.contiguous(), h_res.contiguous()
        out = torch.empty_like(x)
        # Measured on the H200 (n=4, C=2048): [n, 1024] tiles with 4 warps run at
        # copy speed; 256- or 512-wide tiles, or 8 warps, were 8-30x slower.
        BC = min(4096 // _pow2(n), _pow2(C, 16))
        _k.postmix_fwd[(T, _cdiv(C, BC))](
            x, y, h_post, h_res, out, C, n=n, NP=_pow2(n), BC=BC, EXACT_ROWS=exact_rows, ACC=_k.acc_type(x.dtype),
        )
        state.h_res = h_res.detach()
        ctx.save_for_backward(x, y, h_post)
        ctx.state = state
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor):
        x, y, h_post = ctx.saved_tensors
        T, n, C = x.shape
        dout = dout.contiguous()
        dy = torch.empty_like(y)
        g_post = x.new_empty((T, n), dtype=_coef_dtype(x))
        g_res = x.new_empty((T, n, n), dtype=_coef_dtype(x))
        NP = _pow2(n)
        BC = min(max(16, 4096 // (NP * NP)), _pow2(C, 16))
        _k.postmix_bwd[(T,)](
            dout, x, y, h_post, dy, g_post, g_res, C, n=n, NP=NP, BC=BC, ACC=_k.acc_type(x.dtype), num_warps=2,
        )
        ctx.state.d_out = dout
        return None, dy, g_post, g_res, None, None


def mhc_site(
    x: Tensor,
    branch,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    *,
    norm_eps: float,
    tol: float,
    projection: str = "newton",
    sinkhorn_iters: int = 20,
    branch_args: tuple = (),
    branch_kwargs: dict | None = None,
):
    """One mHC site ``x' = H_res·x + H_postᵀ ⊗ F(H_pre·x)`` on the fused kernels.

    Same maths, parameters and outputs as :meth:`mhc.MHCBlock.forward` with
    ``mode="mhc"`` (see there); used by it for CUDA streams.

    Args:
        x: streams ``[..., n, C]``, float32 / bfloat16 / float16 / float64, on the
            device of the parameters (CUDA; CPU only under
            ``TRITON_INTERPRET=1``).
        branch: the sublayer, called as ``branch(u, *branch_args, **branch_kwargs)``
            with ``u: [..., C]`` in ``x``'s dtype; a tuple result mixes its
            first element and returns the rest beside the new streams.
        phi: ``[n² + 2n, n·C]``; ``alpha [3]``, ``b_pre [n]``, ``b_post [n]``,
            ``b_res [n, n]``; float32 parameters (the coefficients are
            computed in float32, float64 for float64 streams).

    Returns:
        ``x'`` with the shape and dtype of ``x`` (or ``(x', *rest)``).
    """
    if _k is None:
        raise RuntimeError("mhc.fused needs Triton, which this PyTorch install does not have")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused mHC site supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dim() < 2 or x.numel() == 0:
        raise ValueError(f"fused mHC site needs streams [..., n, C] with at least one token, got {tuple(x.shape)}")
    n, C = x.shape[-2:]
    if phi.shape != (n * n + 2 * n, n * C):
        raise ValueError(f"phi must be [{n * n + 2 * n}, {n * C}] for streams [..., {n}, {C}], got {tuple(phi.shape)}")
    if phi.device != x.device:
        raise ValueError(f"streams are on {x.device} but phi is on {phi.device}")
    lead = x.shape[:-2]
    xs = x.reshape(-1, n, C).contiguous()
    T = xs.shape[0]
    cdt = _coef_dtype(x)
    state = _SiteState()
    u, H_post, R = _SitePre.apply(
        xs, phi.to(cdt).contiguous(), alpha.to(cdt), b_pre.to(cdt), b_post.to(cdt), b_res.to(cdt),
        float(norm_eps), state,
    )
    H_res = birkhoff_project(R, tol=tol, method=projection, iters=sinkhorn_iters)

    out = branch(u.reshape(*lead, C), *branch_args, **(branch_kwargs or {}))
    y, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
    if y.shape != (*lead, C):
        raise ValueError(f"branch returned shape {tuple(y.shape)}; MHCBlock needs {(*lead, C)}")
    y = y.reshape(T, C).to(x.dtype).contiguous()
    x_new = _PostMix.apply(xs, y, H_post, H_res, projection == "newton", state).reshape(x.shape)
    return x_new if rest is None else (x_new, *rest)
