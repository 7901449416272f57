"""The fused site's eager autograd nodes: the pre-step and the post-mix over the Triton kernels.

Two nodes a site (each ``Function.apply`` argument and each node costs host
time, which bounds a ~125M model's step): :class:`SitePre` runs the norm,
``φ``, the σ activations, the projection and the pre-mix; :class:`PostMix`
the post-mix. Backward order is fixed by the graph: the post-mix, ``F``, then
the pre-step. The post-mix node returns no gradient for ``x``; it leaves
``dx'`` in the call's :class:`SiteState`, and the pre-step's backward writes
the whole ``dx`` in one pass (separate gradients would cost extra reads and
writes of the streams to add up). Double backward is not supported.

The kernel sequences are :mod:`mhc.fused.steps`' (the compiled backend's custom
ops run the same ones); a few tokens run :mod:`mhc.fused.tokens`' instead.
:class:`StreamsRecipe` lets a site keep how to recompute its input streams in
backward instead of the streams (``keep_streams_every``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..projection.common import NEWTON_MAX_ITER
from . import steps as _steps
from . import tokens as _tokens

__all__ = [
    "SiteState",
    "StreamsRecipe",
    "SitePre",
    "PostMix",
    "site_pre_node",
    "post_mix_node",
    "pre_forward",
    "post_forward",
    "post_launch",
    "under_checkpoint",
]

_dense = _steps.dense


class SiteState:
    """One call of a site: its plan and scalars, and what ``PostMix`` hands ``SitePre`` in backward.

    The nodes take it as their one non-tensor argument (each argument of
    ``Function.apply`` costs host time). ``d_out`` is ``dx'`` (detached), set by
    ``PostMix``'s backward. ``switch_device``: the forward found another CUDA
    device current, so the post-mix launches under the streams' device too.
    ``streams``: ``None`` when the nodes keep ``x`` for backward, else the
    :class:`StreamsRecipe` that recomputes it (``keep_streams_every``).
    """

    __slots__ = ("plan", "eps", "tol", "d_out", "switch_device", "streams", "norm_eps")

    def __init__(self, plan, eps: float, tol: float, norm_eps: float = 0.0):
        self.plan, self.eps, self.tol, self.d_out, self.switch_device, self.streams = (
            plan,
            eps,
            tol,
            None,
            False,
            None,
        )
        self.norm_eps = norm_eps  # the branch's RMSNorm's ε, where the plan applies it


class StreamsRecipe:
    """A site's output streams ``x' = H_res·x + H_post ⊗ y``, kept as how to compute them again.

    The next site's nodes hold this instead of ``x'``. ``source`` is the
    site's own input streams (a tensor) or their recipe in turn; ``y``, ``h``
    and ``H_res`` are tensors the site's nodes keep anyway, so a recipe costs
    no activation memory. :meth:`get` runs the post-mix kernel again the
    first time the backward needs ``x'`` (with the same inputs and kernel, so
    the same bits) and keeps the result, and the chain's, until
    :meth:`release` (the next site's last use of ``x'``, its pre-step
    backward). ``depth``: post-mixes since the last kept streams.
    """

    __slots__ = ("source", "y", "h", "H_res", "state", "depth", "value")

    def __init__(self, source, y: Tensor, h: Tensor, H_res: Tensor, state: SiteState, depth: int):
        self.source, self.y, self.h, self.H_res, self.state, self.depth = source, y, h, H_res, state, depth
        self.value = None

    def get(self) -> Tensor:
        if self.value is None:
            if self.state is None:
                raise RuntimeError(
                    "mhc: these streams were recomputed and released by an earlier backward through this graph; "
                    "keep_streams_every > 1 supports one backward per forward (use keep_streams_every=1 for "
                    "retain_graph=True)"
                )
            source = self.source.get() if isinstance(self.source, StreamsRecipe) else self.source
            with torch.no_grad():
                self.value = post_launch(post_forward, source, self.y, self.h, self.H_res, self.state)
        return self.value

    def release(self) -> None:
        self.source = self.y = self.h = self.H_res = self.state = self.value = None


class SitePre(torch.autograd.Function):
    """Streams and coefficient parameters -> ``(u, h, H_res)``.

    One node for the norm, ``φ``, the σ activations, the projection and the
    pre-mix. ``h [T, 2n]`` is σ of H_pre's and H_post's columns (``H_post =
    2·h[:, n:]`` is formed in the kernels that use it). σ has the bits of
    torch's on CUDA, so ``φ = 0`` reproduces :meth:`mhc.MHCBlock.coefficients`
    bit for bit.

    ``x [..., n, C]`` (contiguous) keeps its leading shape through the node,
    and ``u`` has it too: the kernels only need the token count, and
    flattening outside the node would add autograd view nodes.

    With ``norm_weight`` (``[C]``; the plan has a ``normed_dtype``), the first
    output is the branch's input RMSNorm of ``u`` instead of ``u``
    (:func:`mhc.fused.steps.pre_forward_normed`), and the node returns the
    weight's gradient too. ``u`` is formed again from the streams in backward.
    """

    @staticmethod
    def forward(ctx, x, phi, alpha, b_pre, b_post, b_res, norm_weight, state: SiteState):
        if norm_weight is None:
            u, zr, h, H_res = pre_steps(x, phi, alpha, b_pre, b_post, b_res, state)
            kept = (zr, h, H_res)
        else:
            u, zr, h, H_res, rn = _steps.pre_forward_normed(
                state.plan,
                x,
                phi,
                alpha,
                b_pre,
                b_post,
                b_res,
                state.eps,
                state.tol,
                norm_weight,
                state.norm_eps,
            )
            kept = (zr, h, H_res, norm_weight, rn)
        if state.streams is None:
            ctx.save_for_backward(x, phi, alpha, *kept)
        else:  # recomputed in backward (keep_streams_every)
            ctx.save_for_backward(phi, alpha, *kept)
        ctx.state = state
        return u, h, H_res

    @staticmethod
    @once_differentiable
    def backward(ctx, du, d_h, d_res):
        state: SiteState = ctx.state
        recipe = state.streams
        if recipe is None:
            x, phi, alpha, zr, h, H_res, *norm = ctx.saved_tensors
        else:
            x, (phi, alpha, zr, h, H_res, *norm) = recipe.get(), ctx.saved_tensors
        # dx' is None when the site's output took no part in the loss (only H_post / H_res did).
        d_out, state.d_out = state.d_out, None
        if norm and du is None:  # the norm's output took no part in the loss
            du = torch.zeros(x.shape[:-2] + x.shape[-1:], dtype=state.plan.normed_dtype, device=x.device)
        dx, dphi, d_alpha, db_pre, db_post, db_res, dw = _steps.pre_backward(
            state.plan,
            d_out,
            du,
            d_h,
            d_res,
            x,
            phi,
            alpha,
            zr,
            h,
            H_res,
            *ctx.needs_input_grad[:2],
            norm or None,
        )
        if recipe is not None:  # the streams' last use in backward
            recipe.release()
        if dw is not None:
            dw = dw.to(norm[0].dtype) if ctx.needs_input_grad[6] else None
        return dx, dphi, d_alpha, db_pre, db_post, db_res, dw, None


class PostMix(torch.autograd.Function):
    """``(x, y, h, H_res) -> x' = H_res·x + H_post ⊗ y`` with ``H_post = 2·h[:, n:]``.

    ``x [..., n, C]`` and ``y [..., C]`` (contiguous) keep their leading shape, as in :class:`SitePre`.
    """

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, h: Tensor, h_res: Tensor, state: SiteState):
        out = post_forward(x, y, h, h_res, state)
        if state.streams is None:
            ctx.save_for_backward(x, y, h)
        else:  # recomputed in backward (keep_streams_every)
            ctx.save_for_backward(y, h)
        ctx.state = state
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor):
        if ctx.state.streams is None:
            x, y, h = ctx.saved_tensors
        else:
            x, (y, h) = ctx.state.streams.get(), ctx.saved_tensors
        dout = _dense(dout)
        dy, g_h, g_res = _steps.post_backward(ctx.state.plan, dout, x, y, h)
        ctx.state.d_out = dout
        return None, dy, g_h, g_res, None


def direct_apply(function: type):
    """``function.apply`` without the Python layer of ``torch.autograd.Function.apply``.

    That layer binds default arguments (these nodes have none) and unwraps
    functorch's dead wrappers (there are none outside functorch transforms),
    a few microseconds per call on the H200's host. Under functorch transforms
    or ``torch.compile``, which handle ``Function.apply`` themselves, it is
    still called.
    """
    base_apply = super(torch.autograd.Function, function).apply

    def apply(*args):
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return function.apply(*args)
        return base_apply(*args)

    return apply


site_pre_node, post_mix_node = direct_apply(SitePre), direct_apply(PostMix)


def pre_steps(x, phi, alpha, b_pre, b_post, b_res, state: SiteState):
    """The first step's kernels: ``(u, zr, h, H_res)`` (:func:`mhc.fused.steps.pre_forward`)."""
    if state.plan.tokens:
        tol_eff = state.plan.projection_tol(state.tol)
        return _tokens.pre(x, phi, alpha, b_pre, b_post, b_res, state.eps, tol_eff, NEWTON_MAX_ITER)
    return _steps.pre_forward(state.plan, x, phi, alpha, b_pre, b_post, b_res, state.eps, state.tol)


def pre_forward(x, phi, alpha, b_pre, b_post, b_res, state: SiteState):
    """:class:`SitePre`'s forward without its node (grad disabled)."""
    u, _, h, H_res = pre_steps(x, phi, alpha, b_pre, b_post, b_res, state)
    return u, h, H_res


def post_forward(x, y, h, H_res, state: SiteState):
    """The post-mix's kernel (:class:`PostMix`'s forward, or the whole step with grad disabled)."""
    if state.plan.tokens:
        return _tokens.post(x, y, h, H_res)
    return _steps.post_forward(state.plan, x, y, h, H_res)


def under_checkpoint() -> bool:
    """Whether torch.utils.checkpoint manages what autograd saves here (its forward or its recomputation).

    Recipes stay off there: checkpointing checks that both passes save the
    same tensors, which a recipe taken across its boundary in one pass only
    would break, and it keeps less than a recipe would pin.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def post_launch(post, x, y, h, H_res, state: SiteState) -> Tensor:
    """``post(x, y, h, H_res, state)`` under the streams' device when the forward found another one current."""
    if state.switch_device:
        with torch.cuda.device(state.plan.cuda_device):
            return post(x, y, h, H_res, state)
    return post(x, y, h, H_res, state)
