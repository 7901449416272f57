"""Fused mHC site for CUDA: the site's steps on Triton kernels, in a few passes over the streams.

:class:`mhc.MHCBlock` owns the site's flow (design.md §1): coefficients and
pre-mix, then the sublayer ``F``, called once, then the post-mix. It runs
those steps on one of two backends: the PyTorch reference of :mod:`mhc.site`
(CPU streams, ``fused=False``, ``mode="hc"``, Sinkhorn) or, for CUDA streams
with ``mode="mhc"`` and the Newton projection, the two steps here, each one
autograd node over the kernels of :mod:`mhc.fused.kernels`::

    u, site = site_pre(x, φ, α, b_pre, b_post, b_res)  # RMSNorm(x_flat) φᵀ, σ, Π_B(exp(·)), Σ H_pre[i] x_i
    y       = F(u)                                     # the caller's sublayer
    x'      = post_mix(y, site)                        # H_res·x + H_post ⊗ y

Neither calls ``F``. :func:`site_pre_unchecked` / :func:`post_mix_unchecked` are
:func:`site_pre` / :func:`post_mix` without their argument checks (``MHCBlock``'s).

Few nodes and little host time per launch matter as much as the kernels: at
the width of a ~125M model the forward of a site is bound by its host time,
not by the GPU (notes/block_benchmarks.md). So the projection runs inside
the first node (its implicit backward needs only ``H_res``), each backward is
one kernel per memory pass plus a couple of small reductions, the launch
geometry of a shape is worked out once and compiled kernels are launched
directly (:mod:`mhc.fused.plan`).

Backward order is fixed by the graph: the post-mix, ``F``, then the pre-step.
The post-mix node returns no gradient for ``x``; it leaves ``dx'`` in the
call's :class:`_SiteState`, and the pre-step's backward writes the whole
``dx`` in one pass (separate gradients would cost extra reads and writes of
the streams to add up). Double backward is not supported.

Under ``torch.compile`` the same kernel sequences (:mod:`mhc.fused.steps`) run as
``torch.library`` custom ops with fake impls (:mod:`mhc.fused.ops`), so dynamo traces
the site and its sublayer as one graph. Up to :data:`mhc.fused.tokens.MAX_TOKENS`
tokens (decoding) run both forwards on the extension's token kernels
(:mod:`mhc.fused.tokens`); the backward is the same.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..options import check_options
from ..projection.common import NEWTON_MAX_ITER

__all__ = [
    "available", "site_pre", "post_mix", "site_pre_unchecked", "post_mix_unchecked", "post_mix_recording",
    "post_then_pre_unchecked", "is_token_site", "token_site_normed", "clear_plans", "compiled_variants",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# Triton missing or not importable (CPU-only PyTorch builds) is the one reason the fused path may be
# absent. Kernels that fail to import while Triton imports are a bug in mhc or a Triton it does not
# support, never a reason to fall back: available() (asked before every fused-eligible CUDA forward)
# and site_pre raise the kept error, not this import, so CPU code still imports mhc.
_k = None
_TRITON_ERROR: ImportError | None = None  # why Triton is not importable
_KERNELS_ERROR: Exception | None = None  # why mhc.fused.kernels failed to import although Triton did
_plans = None  # mhc.fused.plan: launch plans and direct launches
_INTERPRETED = False  # the kernels run in Triton's interpreter (TRITON_INTERPRET=1), which takes CPU tensors
try:
    import triton  # only to tell "no Triton" from broken kernels
except ImportError as err:
    _TRITON_ERROR = err
else:
    try:
        from . import kernels as _k
        from . import ops as _ops
        from . import plan as _plans
        from . import steps as _steps
        from . import tokens as _tokens
    except Exception as err:  # a NameError in the module is as much a bug as an ImportError
        _KERNELS_ERROR = err
    else:
        _INTERPRETED = not isinstance(_k.coeff_fwd, triton.runtime.jit.JITFunction)

if _plans is not None:
    _plan, _dense = _plans.plan_for, _steps.dense


def available() -> bool:
    """Whether the fused Triton path can run; ``False`` only where Triton is not importable.

    Raises:
        ImportError: Triton imports but :mod:`mhc.fused.kernels` does not (a
            bug in mhc, or a Triton version it does not support). The original
            error is chained as ``__cause__``, with its traceback. The fused
            path is never dropped silently: ``MHCBlock(..., fused=False)`` runs
            the PyTorch path on purpose.
    """
    if _KERNELS_ERROR is not None:
        err = _KERNELS_ERROR
        raise ImportError(
            f"mhc's Triton kernels (mhc.fused.kernels) failed to import although Triton {triton.__version__} "
            f"imports: {type(err).__name__}: {err}. This is a bug in mhc or a Triton version it does not "
            "support; pass fused=False to MHCBlock (or MHCConfig) to run the PyTorch path meanwhile."
        ) from err
    return _k is not None


def clear_plans() -> None:
    """Forget every shape's launch plan and every kept compiled kernel variant.

    The next call of each shape plans again, and each variant's next launch is
    Triton's own (which compiles or loads it) before it is kept again. Triton's
    caches are untouched. Nothing to do where Triton is not importable.
    """
    if _plans is not None:
        _plans.clear()


def compiled_variants() -> dict[str, int]:
    """``{kernel name: number of compiled variants kept for direct launch}``, for the six kernels.

    A variant is kept after Triton's own first launch of it on CUDA; later
    launches of it skip Triton's argument binding (15-40 µs of host time each).
    Always 0 under Triton's interpreter and ``torch.compile``, where every
    launch is Triton's own; ``{}`` where Triton is not importable.
    """
    return _plans.compiled_variants() if _plans is not None else {}


class _SiteState:
    """One call of a site: its plan and scalars, and what ``_PostMix`` hands ``_SitePre`` in backward.

    The nodes take it as their one non-tensor argument (each argument of
    ``Function.apply`` costs host time). ``d_out`` is ``dx'`` (detached), set by
    ``_PostMix``'s backward. ``switch_device``: the forward found another CUDA
    device current, so the post-mix launches under the streams' device too.
    ``streams``: ``None`` when the nodes keep ``x`` for backward, else the
    :class:`_StreamsRecipe` that recomputes it (``keep_streams_every``).
    """

    __slots__ = ("plan", "eps", "tol", "d_out", "switch_device", "streams")

    def __init__(self, plan, eps: float, tol: float):
        self.plan, self.eps, self.tol, self.d_out, self.switch_device, self.streams = plan, eps, tol, None, False, None


class _StreamsRecipe:
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

    def __init__(self, source, y: Tensor, h: Tensor, H_res: Tensor, state: _SiteState, depth: int):
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
            source = self.source.get() if isinstance(self.source, _StreamsRecipe) else self.source
            with torch.no_grad():
                self.value = _post_launch(_post_forward, source, self.y, self.h, self.H_res, self.state)
        return self.value

    def release(self) -> None:
        self.source = self.y = self.h = self.H_res = self.state = self.value = None


class _SitePre(torch.autograd.Function):
    """Streams and coefficient parameters -> ``(u, h, H_res)``.

    One node for the norm, ``φ``, the σ activations, the projection and the
    pre-mix. ``h [T, 2n]`` is σ of H_pre's and H_post's columns (``H_post =
    2·h[:, n:]`` is formed in the kernels that use it). σ has the bits of
    torch's on CUDA, so ``φ = 0`` reproduces :meth:`mhc.MHCBlock.coefficients`
    bit for bit.

    ``x [..., n, C]`` (contiguous) keeps its leading shape through the node,
    and ``u`` has it too: the kernels only need the token count, and
    flattening outside the node would add autograd view nodes.
    """

    @staticmethod
    def forward(ctx, x, phi, alpha, b_pre, b_post, b_res, state: _SiteState):
        u, zr, h, H_res = _pre_steps(x, phi, alpha, b_pre, b_post, b_res, state)
        if state.streams is None:
            ctx.save_for_backward(x, phi, alpha, zr, h, H_res)
        else:  # recomputed in backward (keep_streams_every)
            ctx.save_for_backward(phi, alpha, zr, h, H_res)
        ctx.state = state
        return u, h, H_res

    @staticmethod
    @once_differentiable
    def backward(ctx, du, d_h, d_res):
        state: _SiteState = ctx.state
        recipe = state.streams
        if recipe is None:
            x, phi, alpha, zr, h, H_res = ctx.saved_tensors
        else:
            x, (phi, alpha, zr, h, H_res) = recipe.get(), ctx.saved_tensors
        # dx' is None when the site's output took no part in the loss (only H_post / H_res did).
        d_out, state.d_out = state.d_out, None
        dx, dphi, d_alpha, db_pre, db_post, db_res = _steps.pre_backward(
            state.plan, d_out, du, d_h, d_res, x, phi, alpha, zr, h, H_res, *ctx.needs_input_grad[:2]
        )
        if recipe is not None:  # the streams' last use in backward
            recipe.release()
        return dx, dphi, d_alpha, db_pre, db_post, db_res, None


class _PostMix(torch.autograd.Function):
    """``(x, y, h, H_res) -> x' = H_res·x + H_post ⊗ y`` with ``H_post = 2·h[:, n:]``.

    ``x [..., n, C]`` and ``y [..., C]`` (contiguous) keep their leading shape, as in :class:`_SitePre`.
    """

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, h: Tensor, h_res: Tensor, state: _SiteState):
        out = _post_forward(x, y, h, h_res, state)
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


def _direct_apply(function: type):
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


_site_pre, _post_mix = _direct_apply(_SitePre), _direct_apply(_PostMix)
# The state of a site whose first step ran without grad on the token kernels (fused_tokens.pre_no_grad).
_TOKENS_NO_GRAD = _SiteState(None, 0.0, 0.0)


def site_pre(
    x: Tensor, phi: Tensor, alpha: Tensor, b_pre: Tensor, b_post: Tensor, b_res: Tensor, *, norm_eps: float, tol: float
) -> tuple[Tensor, tuple]:
    """The site's first step on the fused kernels: coefficients, ``H_res`` and the pre-mix.

    Same maths as :func:`mhc.site.coefficients` and :func:`mhc.site.pre_mix`
    with ``mode="mhc"`` and ``projection="newton"``, in one autograd node.
    Call ``F`` on ``u`` yourself, then :func:`post_mix` with its output and
    ``site``.

    Args:
        x: streams ``[..., n, C]`` with at least one token, float32 / bfloat16 /
            float16 / float64, on the device of the parameters (CUDA; CPU only
            under ``TRITON_INTERPRET=1``).
        phi: ``[n² + 2n, n·C]``; ``alpha [3]``, ``b_pre [n]``, ``b_post [n]``,
            ``b_res [n, n]``: float parameters (the coefficients are computed
            in float32, float64 for float64 streams).
        norm_eps: the flattened RMSNorm's epsilon, finite and ``> 0``.
        tol: tolerance of the Newton projection (:func:`mhc.birkhoff_project`).

    Returns:
        ``(u, site)``: ``u [..., C]`` in ``x``'s dtype, the sublayer's input;
        ``site = (x, h, H_res, state)``, what :func:`post_mix` needs: the
        streams (contiguous), ``h [T, 2n]`` = σ of H_pre's and H_post's
        columns (``H_pre = h[:, :n]``, ``H_post = 2·h[:, n:]``), ``H_res [T, n, n]``
        (both float32, float64 for float64 streams; ``T`` tokens), and the
        call's state (``None`` under ``torch.compile``, where the streams
        entry is a view of them that carries ``dx'`` back: :mod:`mhc.fused.ops`).

    Raises:
        ImportError: Triton imports but the kernels do not (see :func:`available`).
        RuntimeError: Triton is not importable.
        TypeError: ``x`` or a parameter is not a floating-point tensor, or ``x`` has an unsupported dtype.
        ValueError: empty or misshapen streams, parameters of the wrong shape or on another device,
            CPU streams outside Triton's interpreter, or a bad ``norm_eps`` / ``tol``.
    """
    if not available():
        raise RuntimeError(f"mhc.fused needs Triton, which is not importable here ({_TRITON_ERROR})")
    if not isinstance(x, Tensor):
        raise TypeError(f"fused mHC site needs the streams as a tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused mHC site supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dim() < 2 or x.numel() == 0:
        raise ValueError(f"fused mHC site needs streams [..., n, C] with at least one token, got {tuple(x.shape)}")
    if x.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"fused mHC site needs CUDA streams (CPU ones only under TRITON_INTERPRET=1), got {x.device}")
    n, C = x.shape[-2:]
    shapes = {"phi": (n * n + 2 * n, n * C), "alpha": (3,), "b_pre": (n,), "b_post": (n,), "b_res": (n, n)}
    for (name, shape), p in zip(shapes.items(), (phi, alpha, b_pre, b_post, b_res)):
        if not isinstance(p, Tensor) or not p.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {getattr(p, 'dtype', type(p).__name__)}")
        if p.shape != shape:
            raise ValueError(f"{name} must be {list(shape)} for streams [..., {n}, {C}], got {list(p.shape)}")
        if p.device != x.device:
            raise ValueError(f"streams are on {x.device} but {name} is on {p.device}")
    scalars = check_options(norm_eps=norm_eps, tol=tol)
    return site_pre_unchecked(x, phi, alpha, b_pre, b_post, b_res, scalars["norm_eps"], scalars["tol"])


def post_mix(y: Tensor, site: tuple) -> Tensor:
    """The site's last step on the fused kernels: ``x' = H_res·x + H_post ⊗ y``.

    Args:
        y: ``F(u)``, ``[..., C]`` with ``u``'s shape, on the streams' device (any
            float dtype; used in the streams' dtype).
        site: the second value :func:`site_pre` returned.

    Returns:
        ``x'`` with the shape and dtype of the streams given to :func:`site_pre`.

    Raises:
        TypeError: ``y`` is not a floating-point tensor, or ``site`` is not from :func:`site_pre`.
        ValueError: ``y`` has the wrong shape or device.
    """
    if not (isinstance(site, tuple) and len(site) == 4 and (site[3] is None or isinstance(site[3], _SiteState))):
        raise TypeError("site must be the second value site_pre returned")
    x = site[0]
    if not isinstance(y, Tensor) or not y.is_floating_point():
        raise TypeError(f"y must be a floating-point tensor, got {getattr(y, 'dtype', type(y).__name__)}")
    if y.shape != x.shape[:-2] + x.shape[-1:]:
        raise ValueError(f"y must have u's shape {tuple(x.shape[:-2] + x.shape[-1:])}, got {tuple(y.shape)}")
    if y.device != x.device:
        raise ValueError(f"streams are on {x.device} but y is on {y.device}")
    return post_mix_unchecked(y, site)


def site_pre_unchecked(
    x, phi, alpha, b_pre, b_post, b_res, norm_eps: float, tol: float, streams: _StreamsRecipe | None = None,
    norm: tuple[Tensor, float] | None = None,
) -> tuple[Tensor, tuple]:
    """:func:`site_pre` without its argument checks, for callers that made them (:class:`mhc.MHCBlock`).

    ``norm_eps`` and ``tol`` must be Python floats. Every Python-level check costs
    microseconds of a host-bound ~125M model's step, 24 sites a step. ``streams``: how to
    recompute ``x`` in backward (from :func:`post_mix_recording` of the site
    that made ``x``); the nodes then keep no streams. Ignored without grad.
    ``norm``: the branch's input RMSNorm ``(weight, eps)``, applied to ``u``
    by the no-grad token kernels only (:func:`token_site_normed`).
    """
    if torch.compiler.is_compiling():  # custom ops dynamo traces around (mhc.fused.ops)
        return _ops.site_pre(x, phi, alpha, b_pre, b_post, b_res, norm_eps, tol)
    if x.is_cuda and not torch.is_grad_enabled():
        # Generation: a few tokens per step, where the site's cost is its host time. One call
        # into the extension decides, converts and launches (None: not its sizes).
        site = _tokens.pre_no_grad(x, phi, alpha, b_pre, b_post, b_res, norm_eps, tol, norm)
        if site is not None:
            u, mix, x, normed = site
            return u, (x, mix, normed, _TOKENS_NO_GRAD)
    x = _dense(x)  # a strided input is copied once here
    plan = _plan(x)
    cdt = plan.cdt
    params = (_dense(phi, cdt), _dense(alpha, cdt), _dense(b_pre, cdt), _dense(b_post, cdt), _dense(b_res, cdt))
    state = _SiteState(plan, norm_eps, tol)
    if streams is not None and not _under_checkpoint():
        state.streams = streams
    # Without grad (generation) no node is recorded, so the kernels run without one: at a few
    # tokens per step the site's cost is its host time.
    pre = _site_pre if torch.is_grad_enabled() else _pre_forward
    # The token kernels launch under the streams' device themselves (a CUDA guard in C++).
    device = plan.cuda_device
    if not plan.tokens and device is not None and _k.triton.runtime.driver.active.get_current_device() != device:
        # Triton launches on the current device (autograd's backward threads already set it).
        state.switch_device = True
        with torch.cuda.device(plan.cuda_device):
            u, h, H_res = pre(x, *params, state)
    else:
        u, h, H_res = pre(x, *params, state)
    return u, (x, h, H_res, state)


def _pre_steps(x, phi, alpha, b_pre, b_post, b_res, state: _SiteState):
    """The first step's kernels: ``(u, zr, h, H_res)`` (:func:`mhc.fused.steps.pre_forward`)."""
    if state.plan.tokens:
        tol_eff = state.plan.projection_tol(state.tol)
        return _tokens.pre(x, phi, alpha, b_pre, b_post, b_res, state.eps, tol_eff, NEWTON_MAX_ITER)
    return _steps.pre_forward(state.plan, x, phi, alpha, b_pre, b_post, b_res, state.eps, state.tol)


def _pre_forward(x, phi, alpha, b_pre, b_post, b_res, state: _SiteState):
    """:class:`_SitePre`'s forward without its node (grad disabled)."""
    u, _, h, H_res = _pre_steps(x, phi, alpha, b_pre, b_post, b_res, state)
    return u, h, H_res


def _post_forward(x, y, h, H_res, state: _SiteState):
    """The post-mix's kernel (:class:`_PostMix`'s forward, or the whole step with grad disabled)."""
    if state.plan.tokens:
        return _tokens.post(x, y, h, H_res)
    return _steps.post_forward(state.plan, x, y, h, H_res)


def post_mix_unchecked(y: Tensor, site: tuple) -> Tensor:
    """:func:`post_mix` without its argument checks, for callers that made them (:class:`mhc.MHCBlock`)."""
    x, h, H_res, state = site
    if state is None:  # from site_pre under torch.compile
        return _ops.post_mix(y, site)
    if state is _TOKENS_NO_GRAD:  # h holds mix (fused_tokens.pre_no_grad)
        if not torch.is_grad_enabled():
            return _tokens.post_no_grad(x, y, h)
        # Grad came on inside the branch and stayed on: the post-mix node, as after the grad path's pre-step.
        h, H_res = _tokens.unpack(h, x.shape[-2])
        state = _SiteState(_plan(x), 0.0, 0.0)
    # Grad is checked again here, not carried over from site_pre: a branch run under
    # enable_grad still gets its gradient from the post-mix node.
    return _post_launch(_post_mix if torch.is_grad_enabled() else _post_forward, x, _dense(y, x.dtype), h, H_res, state)


def post_mix_recording(y: Tensor, site: tuple, keep_every: int) -> tuple[Tensor, _StreamsRecipe | None]:
    """:func:`post_mix_unchecked`, and how to recompute its output in backward, for the next site.

    Returns ``(x', recipe)``. ``recipe`` is ``None`` where the next site must
    keep ``x'`` itself: ``keep_every`` post-mixes since the last kept streams,
    no grad, activation checkpointing (``torch.utils.checkpoint``), or a site
    that is not on the eager grad path (``torch.compile``, the no-grad token
    kernels).
    """
    x, h, H_res, state = site
    if state is None or state is _TOKENS_NO_GRAD or not torch.is_grad_enabled() or _under_checkpoint():
        return post_mix_unchecked(y, site), None
    y = _dense(y, x.dtype)  # the tensor the post-mix node keeps (dense already, so not copied again there)
    out = post_mix_unchecked(y, site)
    depth = 1 if state.streams is None else state.streams.depth + 1
    if depth >= keep_every:
        return out, None
    return out, _StreamsRecipe(x if state.streams is None else state.streams, y, h, H_res, state, depth)


def _under_checkpoint() -> bool:
    """Whether torch.utils.checkpoint manages what autograd saves here (its forward or its recomputation).

    Recipes stay off there: checkpointing checks that both passes save the
    same tensors, which a recipe taken across its boundary in one pass only
    would break, and it keeps less than a recipe would pin.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def _post_launch(post, x, y, h, H_res, state: _SiteState) -> Tensor:
    """``post(x, y, h, H_res, state)`` under the streams' device when the forward found another one current."""
    if state.switch_device:
        with torch.cuda.device(state.plan.cuda_device):
            return post(x, y, h, H_res, state)
    return post(x, y, h, H_res, state)


def is_token_site(site: tuple) -> bool:
    """Whether ``site`` (from :func:`site_pre`) ran on the no-grad token kernels (generation)."""
    return site[3] is _TOKENS_NO_GRAD


def token_site_normed(site: tuple) -> Tensor | None:
    """The branch's normed input the no-grad token kernels wrote for ``site`` (its ``norm``), or ``None``."""
    return site[2] if site[3] is _TOKENS_NO_GRAD else None


def post_then_pre_unchecked(y: Tensor, site: tuple, phi, alpha, b_pre, b_post, b_res, norm_eps: float, tol: float,
                            norm: tuple[Tensor, float] | None = None):
    """:func:`post_mix_unchecked` and the next site's :func:`site_pre_unchecked` (with its ``norm``) in one launch.

    Only for a ``site`` where :func:`is_token_site` holds, with grad still off;
    the next site's parameters must fit the streams. Returns ``(x', u', site')``,
    the same bits as the two calls (:func:`mhc.fused.tokens.post_pre_no_grad`).
    """
    step = _tokens.post_pre_no_grad(site[0], y, site[1], phi, alpha, b_pre, b_post, b_res, norm_eps, tol, norm)
    return step[0], step[1], (step[0], step[2], step[3], _TOKENS_NO_GRAD)
