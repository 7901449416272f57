"""The fused site under ``torch.compile``: its steps as ``torch.library`` ops (internal to :mod:`mhc.fused`).

Dynamo cannot trace the eager nodes of :mod:`mhc.fused.nodes`: they launch compiled
Triton kernels directly and hand ``dx'`` from the post-mix node to the
pre-step node through a Python object. Under ``torch.compile``
:func:`mhc.fused.site.pre` and :func:`mhc.fused.site.post` come here instead:
four ops (``mhc::fused_site_pre``, ``mhc::fused_site_pre_backward``,
``mhc::fused_post_mix``, ``mhc::fused_post_mix_backward``) whose bodies are
the kernel sequences of :mod:`mhc.fused.steps`, and two autograd nodes that
dynamo traces. The ``dx'`` hand-off goes through the graph: the pre-step node
returns its streams as a view (``link``) that the post-mix node reads, and
the post-mix backward returns ``dx'`` as ``link``'s gradient, which the
pre-step backward folds into ``dx`` (``H_resᵀ dx'``), as the eager nodes do.

The four ops are ``torch.library.triton_op``s: inductor traces their bodies,
launches the Triton kernels from the code it generates, allocates their
buffers with the rest of the graph's and fuses the small sums and casts
around them. As opaque custom ops, each call went through the dispatcher and
Python, 75-300 µs of host time per call under the profiler (small_gpu,
notes/training_cost.md), which made the compiled step host-bound. Two cases
stay opaque custom ops: a decode step's few tokens
(``mhc::fused_site_pre_tokens``, ``mhc::fused_post_mix_tokens``), which run
the extension's CUDA token kernels, and Triton's interpreter (the CPU tests),
whose kernels cannot be traced; there the four ops are custom ops with the
same bodies, traced on fake tensors only for their output shapes.

Why the eager backend does not run these ops as well: an op call goes
through the dispatcher and its Python wrapper, more host time than
:mod:`mhc.fused.nodes`' direct launches, and its outputs must be fresh tensors, so ``dx'`` could not
reach the pre-step's backward without autograd adding it to ``dx`` in a pass
of its own. Both backends run the same kernel sequences (:mod:`mhc.fused.steps`);
only the autograd layer differs.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..projection.common import NEWTON_MAX_ITER, is_traced
from . import plan as _plans
from . import steps as _steps
from . import tokens as _tokens
from .record import Backend, FusedSite

__all__ = ["site_pre", "post_mix", "SitePre", "PostMix"]


def _on_device(x: Tensor):
    # Triton launches on the current CUDA device; the op may run under another. Entering a device
    # context costs host time on every call, so only when it is another. Traced, inductor places
    # the launches itself.
    if x.is_cuda and not is_traced(x) and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def _coefficient_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _step_op(name: str):
    """Register a step as ``mhc::<name>``: a ``triton_op``, or an opaque custom op under Triton's interpreter."""

    def register(fn):
        if _plans.TRACEABLE:
            return torch.library.triton_op(f"mhc::{name}", fn, mutates_args=())
        op = torch.library.custom_op(f"mhc::{name}", fn, mutates_args=())
        op.register_fake(fn)  # traced on fake tensors, the launches are skipped (plan.Launcher)
        return op

    return register


@torch.library.custom_op("mhc::fused_site_pre_tokens", mutates_args=())
def _site_pre_tokens_op(
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    eps: float,
    tol_eff: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(u, zr, h, H_res)`` of a decode step's few tokens (:func:`mhc.fused.tokens.pre`)."""
    return _tokens.pre(x, phi, alpha, b_pre, b_post, b_res, eps, tol_eff, NEWTON_MAX_ITER)


@_site_pre_tokens_op.register_fake
def _site_pre_tokens_fake(x, phi, alpha, b_pre, b_post, b_res, eps, tol_eff):
    n, C = x.shape[-2:]
    T, cdt = x.numel() // (n * C), _coefficient_dtype(x)
    return (
        x.new_empty((*x.shape[:-2], C)),
        x.new_empty((T, n * n + 2 * n + 1), dtype=cdt),
        x.new_empty((T, 2 * n), dtype=cdt),
        x.new_empty((T, n, n), dtype=cdt),
    )


@torch.library.custom_op("mhc::fused_post_mix_tokens", mutates_args=())
def _post_mix_tokens_op(x: Tensor, y: Tensor, h: Tensor, H_res: Tensor) -> Tensor:
    """``x' = H_res·x + H_post ⊗ y`` of a decode step's few tokens (:func:`mhc.fused.tokens.post`)."""
    return _tokens.post(x, y, h, H_res)


@_post_mix_tokens_op.register_fake
def _post_mix_tokens_fake(x, y, h, H_res):
    return torch.empty_like(x)


@_step_op("fused_site_pre")
def _site_pre_op(
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    eps: float,
    tol: float,
    u_dtype: torch.dtype,
    norm_weight: Tensor | None,
    norm_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(u, zr, h, H_res, rn)`` of :func:`mhc.fused.steps.pre_forward`, ``u`` in ``u_dtype``; ``rn`` empty.

    With ``norm_weight``: :func:`mhc.fused.steps.pre_forward_normed`'s, the first output the
    branch's norm of ``u``.
    """
    x = _steps.dense(x)
    plan = _plans.plan_for(x, u_dtype, None if norm_weight is None else norm_weight.dtype)
    params = [_steps.dense(p, plan.cdt) for p in (phi, alpha, b_pre, b_post, b_res)]
    if plan.tokens:
        return (*_site_pre_tokens_op(x, *params, eps, plan.projection_tol(tol)), x.new_empty((0,)))
    with _on_device(x):
        if norm_weight is not None:
            return _steps.pre_forward_normed(plan, x, *params, eps, tol, _steps.dense(norm_weight), norm_eps)
        u, zr, h, H_res = _steps.pre_forward(plan, x, *params, eps, tol)
    return u, zr, h, H_res, zr.new_empty((0,))


@_step_op("fused_site_pre_backward")
def _site_pre_backward_op(
    d_out: Tensor,
    du: Tensor,
    d_h: Tensor,
    d_res: Tensor,
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    zr: Tensor,
    h: Tensor,
    H_res: Tensor,
    u_dtype: torch.dtype,
    norm_weight: Tensor | None,
    rn: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dφ, sums, dw)`` of :func:`mhc.fused.steps.pre_backward_sums` (``sums``: the small gradients).

    ``du``: the gradient of ``u``, or with ``norm_weight`` of the norm's output; ``dw`` is empty without it.
    """
    x = _steps.dense(x)
    plan = _plans.plan_for(x, u_dtype, None if norm_weight is None else norm_weight.dtype)
    phi, alpha = _steps.dense(phi, plan.cdt), _steps.dense(alpha, plan.cdt)
    norm = None if norm_weight is None else (_steps.dense(norm_weight), _steps.dense(rn))
    with _on_device(x):
        dx, dphi, sums, dw = _steps.pre_backward_sums(
            plan,
            d_out,
            du,
            d_h,
            d_res,
            x,
            phi,
            alpha,
            _steps.dense(zr),
            _steps.dense(h),
            _steps.dense(H_res),
            True,
            True,
            norm,
        )
    return dx, dphi, sums, sums.new_empty((0,)) if dw is None else dw


@_step_op("fused_post_mix")
def _post_mix_op(x: Tensor, y: Tensor, h: Tensor, H_res: Tensor) -> Tensor:
    """``x' = H_res·x + H_post ⊗ y`` (:func:`mhc.fused.steps.post_forward`)."""
    x = _steps.dense(x)
    plan = _plans.plan_for(x)
    y, h, H_res = _steps.dense(y, x.dtype), _steps.dense(h), _steps.dense(H_res)
    if plan.tokens:
        return _post_mix_tokens_op(x, y, h, H_res)
    with _on_device(x):
        return _steps.post_forward(plan, x, y, h, H_res)


@_step_op("fused_post_mix_backward")
def _post_mix_backward_op(dout: Tensor, x: Tensor, y: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dy, dh, dH_res)`` of :func:`mhc.fused.steps.post_backward`."""
    x = _steps.dense(x)
    with _on_device(x):
        return _steps.post_backward(
            _plans.plan_for(x), _steps.dense(dout), x, _steps.dense(y, x.dtype), _steps.dense(h)
        )


class SitePre(torch.autograd.Function):
    """Streams and parameters -> ``(u, h, H_res, link)``; ``link`` is ``x`` for :class:`PostMix`."""

    @staticmethod
    def forward(
        ctx,
        x,
        phi,
        alpha,
        b_pre,
        b_post,
        b_res,
        eps: float,
        tol: float,
        u_dtype,
        norm_weight,
        norm_eps: float,
    ):
        u, zr, h, H_res, rn = _site_pre_op(
            x, phi, alpha, b_pre, b_post, b_res, eps, tol, u_dtype, norm_weight, norm_eps
        )
        ctx.save_for_backward(x, phi, alpha, zr, h, H_res, norm_weight, rn)
        ctx.u_dtype, ctx.grad_dtype = u_dtype, u.dtype
        return u, h, H_res, x.view_as(x)

    @staticmethod
    def backward(ctx, du, d_h, d_res, d_link):
        x, phi, alpha, zr, h, H_res, norm_weight, rn = ctx.saved_tensors
        # d_link is dx' (what PostMix's backward returns for link), not a gradient of x itself.
        zeros = torch.zeros_like
        dx, dphi, sums, dw = _site_pre_backward_op(
            zeros(x) if d_link is None else d_link,
            zeros(x[..., 0, :], dtype=ctx.grad_dtype) if du is None else du.to(ctx.grad_dtype),
            zeros(h) if d_h is None else d_h,
            zeros(H_res) if d_res is None else d_res,
            x,
            phi,
            alpha,
            zr,
            h,
            H_res,
            ctx.u_dtype,
            norm_weight,
            rn,
        )
        dw = None if norm_weight is None else dw.to(norm_weight.dtype)
        return dx, dphi, *_steps.coefficient_grads(sums, x.shape[-2]), None, None, None, dw, None


class PostMix(torch.autograd.Function):
    """``(link, y, h, H_res) -> x'``; ``dx'`` goes back as ``link``'s gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx, link, y, h, H_res):
        ctx.save_for_backward(link, y, h)
        return _post_mix_op(link, y, h, H_res)

    @staticmethod
    def backward(ctx, dout):
        link, y, h = ctx.saved_tensors
        dy, d_h, d_res = _post_mix_backward_op(dout, link, y, h)
        return dout, dy.to(y.dtype), d_h, d_res


def site_pre(
    x, phi, alpha, b_pre, b_post, b_res, norm_eps: float, tol: float, u_dtype: torch.dtype, norm=None
) -> tuple[Tensor | None, FusedSite]:
    """:func:`mhc.fused.site.pre` under ``torch.compile``: ``(u, site)``, ``site.streams`` the link to the post-mix.

    With ``norm`` (``(weight, eps)``), ``u`` is ``None`` and ``site.normed`` the norm's output.
    """
    cdt = _coefficient_dtype(x)
    params = (phi.to(cdt), alpha.to(cdt), b_pre.to(cdt), b_post.to(cdt), b_res.to(cdt))
    weight, eps = (None, 0.0) if norm is None else norm
    u, h, H_res, link = SitePre.apply(x.contiguous(), *params, norm_eps, tol, u_dtype, weight, eps)
    if weight is not None:
        return None, FusedSite(Backend.COMPILED, link, h, H_res, normed=u)
    return u, FusedSite(Backend.COMPILED, link, h, H_res)


def post_mix(y: Tensor, site: FusedSite) -> Tensor:
    """:func:`mhc.fused.site.post` under ``torch.compile``."""
    link = site.streams
    return PostMix.apply(link, y.to(link.dtype), site.h, site.h_res)
