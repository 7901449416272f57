"""The fused site's two steps on the backend :class:`mhc.MHCBlock` chose (internal to :mod:`mhc.fused`).

:func:`pre` runs the coefficients, ``H_res`` and the pre-mix and returns a
:class:`~mhc.fused.record.FusedSite`; :func:`post` runs the post-mix on the
backend that record names. :func:`post_recording` and :func:`post_then_pre`
are the two ways a post-mix serves the next linked site
(:mod:`mhc.fused.chain`). None of them checks its arguments: the block did
(:func:`mhc.fused.site_pre` is the checked entry), and every Python-level
check costs microseconds of a host-bound ~125M model's step, 24 sites a step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernels as _k
from . import ops as _ops
from . import tokens as _tokens
from .nodes import (
    SiteState,
    StreamsRecipe,
    post_forward,
    post_launch,
    post_mix_node,
    pre_forward,
    site_pre_node,
    under_checkpoint,
)
from .plan import fused_norm_fits, plan_for
from .record import Backend, FusedSite
from .steps import dense

__all__ = ["pre", "post", "post_recording", "post_then_pre", "takes_norm"]


def pre(
    backend: Backend,
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    norm_eps: float,
    tol: float,
    streams: StreamsRecipe | None = None,
    norm: tuple[Tensor, float] | None = None,
    u_dtype: torch.dtype | None = None,
) -> tuple[Tensor, FusedSite]:
    """The first step: ``(u [..., C], site)`` on ``backend`` (not :attr:`~Backend.REFERENCE`).

    ``norm_eps`` and ``tol`` are Python floats. ``streams``: how to recompute
    ``x`` in backward (:func:`post_recording` of the site that made it); the
    nodes then keep no streams. Ignored without grad. ``norm``: the branch's
    input RMSNorm ``(weight, eps)``, which :attr:`~Backend.TOKENS` applies to
    ``u`` too, and so do :attr:`~Backend.EAGER` and :attr:`~Backend.COMPILED`
    with grad where :func:`takes_norm`; then ``site.normed`` holds the norm's
    output, and ``u`` is ``None`` on the latter two (it is never stored).
    ``u_dtype``: ``u``'s dtype (default ``x``'s);
    another than ``x``'s runs :attr:`~Backend.TOKENS` on the eager kernels,
    since the token kernels write ``u`` in the streams' dtype.
    """
    if u_dtype is None:
        u_dtype = x.dtype
    if backend is Backend.TOKENS and u_dtype == x.dtype:
        # One call into the extension decides, converts and launches (None: not its sizes).
        taken = _tokens.pre_no_grad(x, phi, alpha, b_pre, b_post, b_res, norm_eps, tol, norm)
        if taken is not None:
            u, mix, x, normed = taken
            return u, FusedSite(Backend.TOKENS, x, mix, None, normed=normed)
    if norm is not None and not takes_norm(x, norm[0]):
        norm = None  # the branch applies its norm itself
    if backend is Backend.COMPILED:
        return _ops.site_pre(x, phi, alpha, b_pre, b_post, b_res, norm_eps, tol, u_dtype, norm)
    x = dense(x)  # a strided input is copied once here
    weight = None if norm is None else dense(norm[0])
    plan = plan_for(x, u_dtype, None if weight is None else weight.dtype)
    cdt = plan.cdt
    params = (dense(phi, cdt), dense(alpha, cdt), dense(b_pre, cdt), dense(b_post, cdt), dense(b_res, cdt))
    state = SiteState(plan, norm_eps, tol, 0.0 if norm is None else norm[1])
    if streams is not None and not under_checkpoint():
        state.streams = streams
    # Without grad no node is recorded, so the kernels run without one.
    if torch.is_grad_enabled():
        step, params = site_pre_node, (*params, weight)
    else:
        step = pre_forward
    # The token kernels launch under the streams' device themselves (a CUDA guard in C++).
    device = plan.cuda_device
    if (
        not plan.tokens
        and device is not None
        and _k.triton.runtime.driver.active.get_current_device() != device
    ):
        # Triton launches on the current device (autograd's backward threads already set it).
        state.switch_device = True
        with torch.cuda.device(device):
            u, h, H_res = step(x, *params, state)
    else:
        u, h, H_res = step(x, *params, state)
    if weight is not None:
        return None, FusedSite(Backend.EAGER, x, h, H_res, state, normed=u)
    return u, FusedSite(Backend.EAGER, x, h, H_res, state)


def takes_norm(x: Tensor, weight: Tensor) -> bool:
    """Whether the grad path's kernels apply a branch norm with ``weight`` to streams ``x [..., n, C]``.

    With grad only (without, the branch applies its own norm, so evaluation
    keeps HF's bits); a dense float ``[C]`` weight on the streams' device, and
    ``C`` within :func:`mhc.fused.plan.fused_norm_fits`.
    """
    C = x.shape[-1]
    return (
        torch.is_grad_enabled()
        and weight.shape == (C,)
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        and weight.device == x.device
        and fused_norm_fits(C)
    )


def post(y: Tensor, site: FusedSite) -> Tensor:
    """The post-mix ``x' = H_res·x + H_post ⊗ y`` on the backend ``site`` ran on."""
    backend, x = site.backend, site.streams
    if backend is Backend.COMPILED:
        return _ops.post_mix(y, site)
    h, H_res, state = site.h, site.h_res, site.state
    if backend is Backend.TOKENS:
        if not torch.is_grad_enabled():
            return _tokens.post_no_grad(x, y, h)
        # Grad came on inside the branch and stayed on: the post-mix node, as after the grad path's pre-step.
        h, H_res = _tokens.unpack(h, x.shape[-2])
        state = SiteState(plan_for(x), 0.0, 0.0)
    # Grad is checked again here, not carried over from pre(): a branch run under
    # enable_grad still gets its gradient from the post-mix node.
    step = post_mix_node if torch.is_grad_enabled() else post_forward
    return post_launch(step, x, dense(y, x.dtype), h, H_res, state)


def post_recording(y: Tensor, site: FusedSite, keep_every: int) -> tuple[Tensor, StreamsRecipe | None]:
    """:func:`post`, and how to recompute its output in backward, for the next site.

    Returns ``(x', recipe)``. ``recipe`` is ``None`` where the next site must
    keep ``x'`` itself: ``keep_every`` post-mixes since the last kept streams,
    no grad, activation checkpointing (``torch.utils.checkpoint``), or a site
    that is not on :attr:`~Backend.EAGER`.
    """
    if site.backend is not Backend.EAGER or not torch.is_grad_enabled() or under_checkpoint():
        return post(y, site), None
    x, state = site.streams, site.state
    y = dense(y, x.dtype)  # the tensor the post-mix node keeps (dense already, so not copied again there)
    out = post(y, site)
    depth = 1 if state.streams is None else state.streams.depth + 1
    if depth >= keep_every:
        return out, None
    return out, StreamsRecipe(
        x if state.streams is None else state.streams, y, site.h, site.h_res, state, depth
    )


def post_then_pre(
    y: Tensor,
    site: FusedSite,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    norm_eps: float,
    tol: float,
    norm: tuple[Tensor, float] | None = None,
) -> tuple[Tensor, Tensor, FusedSite]:
    """:func:`post` and the next site's :func:`pre` (with its ``norm``) in one launch: ``(x', u', site')``.

    Only for a ``site`` on :attr:`~Backend.TOKENS`, with grad still off; the
    next site's parameters must fit the streams. The same bits as the two
    calls (:func:`mhc.fused.tokens.post_pre_no_grad`).
    """
    x_new, u, mix, normed = _tokens.post_pre_no_grad(
        site.streams, y, site.h, phi, alpha, b_pre, b_post, b_res, norm_eps, tol, norm
    )
    return x_new, u, FusedSite(Backend.TOKENS, x_new, mix, None, normed=normed)
