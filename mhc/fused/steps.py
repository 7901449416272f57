"""The fused site's kernel sequences, forward and backward of each step (internal to :mod:`mhc.fused`).

Plain functions over one :class:`mhc.fused.plan.Plan`: what each autograd node
of :mod:`mhc.fused` (eager) and each custom op of :mod:`mhc.fused.ops`
(``torch.compile``) runs, written once. Imported only once
:mod:`mhc.fused.kernels` has imported. Every tensor a kernel sees is
contiguous and 16-byte aligned (:func:`dense`) or a fresh allocation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..projection import NEWTON_MAX_ITER, birkhoff_project
from ..projection import cuda as _projection_cuda
from ..projection.common import is_traced
from . import plan as _plans

__all__ = [
    "dense",
    "pre_forward",
    "pre_forward_normed",
    "pre_backward",
    "pre_backward_sums",
    "coefficient_grads",
    "post_forward",
    "post_backward",
]

_coeff_partial, _coeff_fwd, _postmix_fwd, _postmix_bwd, _coeff_bwd, _stream_grad, _phi_grad = (
    _plans.LAUNCHERS.values()
)


def dense(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` as a contiguous, 16-byte aligned tensor of ``dtype``; no dispatcher call when it is one.

    This is what lets :class:`mhc.fused.plan.Launcher` reuse compiled variants.
    A site runs a few dozen such calls per step, and on the H200's host each
    no-op ``.to()`` / ``.contiguous()`` still costs microseconds of dispatch.
    """
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if not t.is_contiguous():
        return t.contiguous()
    if is_traced(t):
        return t  # no address; inductor works out the alignment of what it launches on
    return t if t.data_ptr() % 16 == 0 else t.clone()  # a view at an unaligned offset


def pre_forward(plan, x, phi, alpha, b_pre, b_post, b_res, eps: float, tol: float):
    """Norm, ``φ``, σ, projection and pre-mix: ``(u [..., C], zr [T, Z+1], h [T, 2n], H_res [T, n, n])``.

    ``x [..., n, C]`` dense; the parameters dense in ``plan.cdt``; ``u`` in ``plan.u_dtype``. ``zr`` holds
    ``z`` and the norm's ``1/rms``; ``h`` is σ of H_pre's and H_post's columns.
    """
    u, zr, h, H_res, _ = _pre(plan, x, phi, alpha, b_pre, b_post, b_res, eps, tol, None, 0.0)
    return u, zr, h, H_res


def pre_forward_normed(plan, x, phi, alpha, b_pre, b_post, b_res, eps: float, tol: float, weight, norm_eps):
    """:func:`pre_forward` with the branch's input RMSNorm applied to ``u``: ``(normed, zr, h, H_res, rn [T])``.

    For a plan with a ``normed_dtype``. ``normed [..., C]`` is HF's ``LlamaRMSNorm`` of ``u`` (weight
    ``[C]`` dense, float ``norm_eps``), in ``plan.normed_dtype``; ``u`` itself is not stored. ``rn``
    is each token's ``rsqrt(mean(u²) + norm_eps)``, in ``plan.cdt``.
    """
    return _pre(plan, x, phi, alpha, b_pre, b_post, b_res, eps, tol, weight, norm_eps)


def _pre(plan, x, phi, alpha, b_pre, b_post, b_res, eps, tol, weight, norm_eps):
    T, n, C, Z = plan.T, plan.n, plan.C, plan.Z
    zr = x.new_empty((T, Z + 1), dtype=plan.cdt)
    h = x.new_empty((T, 2 * n), dtype=plan.cdt)
    R = x.new_empty((T, n, n), dtype=plan.cdt)  # α·z + b of R's columns
    normed = plan.normed_dtype is not None
    u = x.new_empty((*x.shape[:-2], C), dtype=plan.normed_dtype if normed else plan.u_dtype)
    rn = x.new_empty((T,), dtype=plan.cdt) if normed else zr  # (zr: a pointer the kernel does not use)
    part = x.new_empty((plan.coeff_splits, T, plan.ZP), dtype=plan.cdt)  # x φᵀ and Σ x², per split of n·C
    _coeff_partial(plan.coeff_partial, x, phi, part, T, C, plan.coeff_k_per_split)
    _coeff_fwd(
        plan.coeff_fwd,
        part,
        x,
        alpha,
        b_pre,
        b_post,
        b_res,
        zr,
        h,
        R,
        u,
        weight if normed else alpha,
        rn,
        T,
        C,
        eps,
        plan.coeff_splits,
        norm_eps,
    )
    if plan.cuda_projection:
        H_res = _projection_cuda.project_no_autograd(R, plan.projection_tol(tol), NEWTON_MAX_ITER)
    else:
        H_res = birkhoff_project(R, tol=tol, max_iter=NEWTON_MAX_ITER)
    return u, zr, h, H_res, rn if normed else None


def pre_backward(
    plan, d_out, du, d_h, d_res, x, phi, alpha, zr, h, H_res, needs_dx: bool, needs_dphi: bool, norm=None
):
    """Gradients of :func:`pre_forward`: ``(dx, dφ, dα, db_pre, db_post, db_res [n, n], dw)``.

    ``d_out`` is ``dx'``, the post-mix's output gradient (its ``H_resᵀ dx'``
    term is added here, in the same pass that writes ``dx``), or ``None``
    when the site's output took no part in the loss. ``dx`` / ``dφ`` are
    ``None`` unless asked for. The four small gradients are views of one
    vector (:func:`pre_backward_sums`). ``norm`` and ``dw``: the branch's
    norm, as in :func:`pre_backward_sums`.
    """
    dx, dphi, sums, dw = pre_backward_sums(
        plan, d_out, du, d_h, d_res, x, phi, alpha, zr, h, H_res, needs_dx, needs_dphi, norm
    )
    return dx, dphi, *coefficient_grads(sums, plan.n), dw


def coefficient_grads(sums: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dα [3], db_pre [n], db_post [n], db_res [n, n])``: views of :func:`pre_backward_sums`' ``sums``."""
    Z = n * n + 2 * n
    _, db_pre, db_post, db_res, d_alpha, _ = sums.split_with_sizes([Z, n, n, n * n, 3, 1])
    return d_alpha, db_pre, db_post, db_res.view(n, n)


def pre_backward_sums(
    plan, d_out, du, d_h, d_res, x, phi, alpha, zr, h, H_res, needs_dx: bool, needs_dphi: bool, norm=None
):
    """:func:`pre_backward` with the small gradients left in one vector: ``(dx, dφ, sums [2Z + 4], dw)``.

    ``sums`` is the token sum of the coefficient backward's per-token rows;
    :func:`coefficient_grads` takes it apart. A custom op returns it whole,
    since its outputs may not be views of one another and copying four small
    views costs host time on every call. ``norm``: ``(weight, rn)`` where the
    forward applied the branch's norm (:func:`pre_forward_normed`); ``du`` is
    then the gradient of its output, and ``dw`` the weight's gradient in
    ``plan.cdt`` (``None`` without ``norm``).
    """
    T, n, C, Z = plan.T, plan.n, plan.C, plan.Z
    d_res = dense(d_res, plan.cdt)
    # The projection's implicit backward needs only its output (design.md §2).
    # Both as ops: a traced body (mhc.fused.ops) keeps the reference's data-dependent solve opaque.
    if plan.cuda_projection:
        dR = torch.ops.mhc.birkhoff_backward(H_res, d_res)
    else:
        dR = torch.ops.mhc.birkhoff_reference_backward(H_res, d_res)
    # (the kernels' variants are compiled for u's dtype, or the norm output's)
    du = dense(du, plan.u_dtype if norm is None else plan.normed_dtype)
    work = zr.new_empty((T, 2 * Z + 4))  # per token [r·dz | dv | α's group sums | c2]
    if norm is None:
        weight, rn, q = alpha, zr, zr  # (pointers the kernels do not use)
    else:
        (weight, rn), q = norm, zr.new_empty((T,))  # q: per token, du = rn·dn·w − q·u
    _coeff_bwd(plan.coeff_bwd, du, x, h, dense(d_h), dR, zr, alpha, work, weight, rn, q, C)
    sums = work.sum(0)

    dx = dphi = dw = None
    if needs_dx or norm is not None:  # (stream_grad sums the norm weight's gradient too)
        d_out = dense(d_out) if d_out is not None else torch.zeros_like(x)
        dx = torch.empty_like(x)
        dw_part = zr.new_empty((plan.stream_programs, C)) if norm is not None else zr
        _stream_grad(
            plan.stream_grad,
            d_out,
            du,
            x,
            work,
            phi,
            h,
            H_res,
            dx,
            weight,
            rn,
            q,
            dw_part,
            T,
            C,
            plan.stream_tokens,
        )
        if norm is not None:
            dw = dw_part.sum(0)
            dx = dx if needs_dx else None
    if needs_dphi:
        part = zr.new_empty((plan.phi_splits, Z, n * C))
        _phi_grad(plan.phi_grad, work, x, part, T, n * C, Z, plan.phi_tokens)
        dphi = part.sum(0)
    return dx, dphi, sums, dw


def post_forward(plan, x, y, h, H_res) -> Tensor:
    """``x' = H_res·x + H_post ⊗ y`` with ``H_post = 2·h[:, n:]``; ``x``, ``y`` dense, ``y`` in ``x``'s dtype."""
    out = torch.empty_like(x)
    _postmix_fwd(plan.postmix_fwd, x, y, h, H_res, out, plan.C)
    return out


def post_backward(plan, dout, x, y, h):
    """Gradients of :func:`post_forward` but ``x``'s: ``(dy, dh [T, 2n], dH_res [T, n, n])``.

    ``dout`` dense. ``x``'s gradient ``H_resᵀ dout`` is left to :func:`pre_backward`.
    """
    dy = torch.empty_like(y)
    g_h = torch.empty_like(h)
    g_res = h.new_empty((plan.T, plan.n, plan.n))
    _postmix_bwd(plan.postmix_bwd, dout, x, y, h, dy, g_h, g_res, plan.C)
    return dy, g_h, g_res
