r"""Fused mHC site for CUDA: the site's steps on Triton kernels, in a few passes over the streams.

:class:`mhc.MHCBlock` owns the site's flow (design.md §1): coefficients and
pre-mix, then the sublayer ``F``, called once, then the post-mix. For CUDA
streams with ``mode="mhc"`` and the Newton projection it runs the two steps
here, on the backend it chose (:class:`Backend`)::

    u, site = site_pre(x, φ, α, b_pre, b_post, b_res)  # RMSNorm(x_flat) φᵀ, σ, Π_B(exp(·)), Σ H_pre[i] x_i
    y       = F(u)                                     # the caller's sublayer
    x'      = post_mix(y, site)                        # H_res·x + H_post ⊗ y

Neither calls ``F``. ``site`` is a :class:`FusedSite`.

The modules, by what they hold:

* :mod:`~mhc.fused.kernels`: the Triton kernels; :mod:`~mhc.fused.plan`: each
  shape's launch geometry, worked out once, and direct launches of compiled
  variants; :mod:`~mhc.fused.steps`: the kernel sequence of each step, forward
  and backward, written once.
* :mod:`~mhc.fused.nodes`: the eager autograd nodes over those sequences;
  :mod:`~mhc.fused.ops`: the same sequences as ``torch.library`` ops for
  ``torch.compile`` (triton ops, whose kernels inductor launches itself);
  :mod:`~mhc.fused.tokens`: a decode step's few tokens on the CUDA
  extension's kernels.
* :mod:`~mhc.fused.site`: the two steps on a chosen backend (what the block
  calls); :mod:`~mhc.fused.chain`: linked sites, whose post-mix serves the next
  site (decoding, ``keep_streams_every``); :mod:`~mhc.fused.record`: the
  backends and :class:`FusedSite`.

Few nodes and little host time per launch matter as much as the kernels: at
the width of a ~125M model the forward of a site is bound by its host time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..options import check_options
from .record import Backend, FusedSite, SiteLink, fused_backend

__all__ = [
    "available",
    "site_pre",
    "post_mix",
    "clear_plans",
    "rms_norm_reference",
    "compiled_variants",
    "SUPPORTED_DTYPES",
    "Backend",
    "FusedSite",
    "fused_backend",
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
        from . import chain as _chain
        from . import kernels as _k
        from . import plan as _plans
        from . import site as _site
    except Exception as err:  # a NameError in the module is as much a bug as an ImportError
        _KERNELS_ERROR = err
    else:
        _INTERPRETED = not isinstance(_k.coeff_fwd, triton.runtime.jit.JITFunction)


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


def site_pre(
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    *,
    norm_eps: float,
    tol: float,
    u_dtype: torch.dtype | None = None,
    branch_norm: tuple[Tensor, float] | None = None,
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
        u_dtype: the dtype of ``u``, one of :data:`SUPPORTED_DTYPES` (default ``x``'s):
            :class:`mhc.MHCBlock` passes :func:`mhc.site.branch_input_dtype`. The kernels
            compute ``u`` in float32 (float64 for float64 streams) and round it once, to this.
        branch_norm: ``(weight [C], eps)`` of an RMSNorm to apply to ``u``, HF's ``LlamaRMSNorm``:
            ``weight · (u_f · rsqrt(mean(u_f²) + eps)).to(u_dtype)`` with ``u_f`` u in float32,
            in ``weight``'s and ``u_dtype`` promoted. With grad the kernels apply it where
            they form ``u`` (:func:`mhc.fused.site.takes_norm`) and never store ``u``, and
            so do the decode kernels without grad; else PyTorch applies it to ``u``
            (:func:`rms_norm_reference`).

    Returns:
        ``(u, site)``: ``u [..., C]`` in ``u_dtype``, the sublayer's input (with ``branch_norm``,
        the norm's output instead);
        ``site``, a :class:`FusedSite`, what :func:`post_mix` needs: the
        streams, ``h [T, 2n]`` = σ of H_pre's and H_post's columns
        (``H_pre = h[:, :n]``, ``H_post = 2·h[:, n:]``) and ``H_res [T, n, n]``
        (both float32, float64 for float64 streams; ``T`` tokens). Without grad
        on CUDA a few tokens run the extension's kernels, whose ``site.h``
        packs both (:attr:`Backend.TOKENS`).

    Raises:
        ImportError: Triton imports but the kernels do not (see :func:`available`).
        RuntimeError: Triton is not importable.
        TypeError: ``x`` or a parameter is not a floating-point tensor, or ``x`` or ``u_dtype`` is an
            unsupported dtype.
        ValueError: empty or misshapen streams, parameters of the wrong shape or on another device,
            CPU streams outside Triton's interpreter, or a bad ``norm_eps`` / ``tol``.
    """
    if not available():
        raise RuntimeError(f"mhc.fused needs Triton, which is not importable here ({_TRITON_ERROR})")
    if not isinstance(x, Tensor):
        raise TypeError(f"fused mHC site needs the streams as a tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused mHC site supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if u_dtype is None:
        u_dtype = x.dtype
    elif u_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused mHC site writes u in one of {SUPPORTED_DTYPES}, got u_dtype={u_dtype!r}")
    if x.dim() < 2 or x.numel() == 0:
        raise ValueError(
            f"fused mHC site needs streams [..., n, C] with at least one token, got {tuple(x.shape)}"
        )
    if x.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(
            f"fused mHC site needs CUDA streams (CPU ones only under TRITON_INTERPRET=1), got {x.device}"
        )
    n, C = x.shape[-2:]
    shapes = {"phi": (n * n + 2 * n, n * C), "alpha": (3,), "b_pre": (n,), "b_post": (n,), "b_res": (n, n)}
    for (name, shape), p in zip(shapes.items(), (phi, alpha, b_pre, b_post, b_res)):
        if not isinstance(p, Tensor) or not p.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor, got {getattr(p, 'dtype', type(p).__name__)}"
            )
        if p.shape != shape:
            raise ValueError(f"{name} must be {list(shape)} for streams [..., {n}, {C}], got {list(p.shape)}")
        if p.device != x.device:
            raise ValueError(f"streams are on {x.device} but {name} is on {p.device}")
    scalars = check_options(norm_eps=norm_eps, tol=tol)
    norm_eps, tol = scalars["norm_eps"], scalars["tol"]
    if branch_norm is not None:
        weight, eps = branch_norm
        if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.shape != (C,):
            raise ValueError(
                f"branch_norm's weight must be a floating-point tensor [{C}], got {weight!r:.80}"
            )
        if weight.device != x.device:
            raise ValueError(f"streams are on {x.device} but branch_norm's weight is on {weight.device}")
        branch_norm = (weight, check_options(norm_eps=eps)["norm_eps"])
    backend = fused_backend(x)
    u, site = _site.pre(
        backend, x, phi, alpha, b_pre, b_post, b_res, norm_eps, tol, None, branch_norm, u_dtype
    )
    if branch_norm is None:
        return u, site
    if site.normed is not None:
        return site.normed, site
    return rms_norm_reference(u, *branch_norm), site


def rms_norm_reference(u: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's ``LlamaRMSNorm`` of ``u [..., C]`` in PyTorch: what the fused site's norm computes.

    ``weight · (u_f · rsqrt(mean(u_f²) + eps)).to(u.dtype)``, ``u_f`` u in float32
    (float64 stays float64); the result in ``weight``'s and ``u``'s dtypes promoted.
    """
    u_f = u.to(torch.float64 if u.dtype == torch.float64 else torch.float32)
    u_f = u_f * torch.rsqrt(u_f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * u_f.to(u.dtype)


def post_mix(y: Tensor, site: FusedSite) -> Tensor:
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
    if not isinstance(site, FusedSite):
        raise TypeError(f"site must be the FusedSite site_pre returned, got {type(site).__name__}")
    x = site.streams
    if not isinstance(y, Tensor) or not y.is_floating_point():
        raise TypeError(f"y must be a floating-point tensor, got {getattr(y, 'dtype', type(y).__name__)}")
    if y.shape != x.shape[:-2] + x.shape[-1:]:
        raise ValueError(f"y must have u's shape {tuple(x.shape[:-2] + x.shape[-1:])}, got {tuple(y.shape)}")
    if y.device != x.device:
        raise ValueError(f"streams are on {x.device} but y is on {y.device}")
    return _site.post(y, site)


def pre(
    backend: Backend,
    x,
    phi,
    alpha,
    b_pre,
    b_post,
    b_res,
    norm_eps: float,
    tol: float,
    streams=None,
    norm=None,
    u_dtype=None,
):
    """:func:`site_pre` on a chosen ``backend``, without checks, for :class:`mhc.MHCBlock` (:func:`mhc.fused.site.pre`)."""
    return _site.pre(backend, x, phi, alpha, b_pre, b_post, b_res, norm_eps, tol, streams, norm, u_dtype)


def post_linked(link: SiteLink, y: Tensor, site: FusedSite, keep_every: int) -> Tensor:
    """:func:`post_mix` without checks, serving the next linked site (:func:`mhc.fused.chain.post`)."""
    return _chain.post(link, y, site, keep_every)
