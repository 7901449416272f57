"""The fused site's two steps for a few tokens, on the CUDA extension (internal to :mod:`mhc.fused`).

A decode step runs every site on 1-16 tokens, where the Triton kernels of
:mod:`mhc.fused.kernels` are the wrong shape: ``coeff_partial`` tiles 64 tokens per
program, so a few programs walk all ``n·C`` columns, and each Triton launch
costs more host time than the work. For CUDA streams of at most
:data:`MAX_TOKENS` tokens (``n`` in {4, 8}) the forward of both steps runs
these instead, with or without grad, eagerly or as custom ops of
:mod:`mhc.fused.ops` under ``torch.compile``: a cluster of blocks per token on Hopper, else one
block (``csrc/site_tokens.cuh``), one launch per step, called through the
extension's Python module. Same maths and layouts as ``coeff_partial``/``coeff_fwd``
and ``postmix_fwd`` (products in float32 FMA rather than on the tensor cores, so
results agree with theirs to rounding, not to the bit), so the backward kernels
are the same. More tokens and CPU streams (Triton's interpreter) keep the Triton
kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _ext
from ..projection import cuda as projection_cuda
from ..projection.common import NEWTON_MAX_ITER

__all__ = [
    "MAX_TOKENS",
    "takes",
    "takes_shape",
    "pre",
    "post",
    "pre_no_grad",
    "post_no_grad",
    "post_pre_no_grad",
    "unpack",
]

MAX_TOKENS = 128  # measured when coeff_fwd was one kernel of 64-token programs: a token's own blocks beat it up to here
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NO_NORM = (None, 0.0)  # the extension's (weight, eps) for "no branch norm to apply"


_extension = None  # the CUDA extension's module, kept by the first takes() that finds it


def takes(x: Tensor) -> bool:
    """Whether these kernels run streams ``x [..., n, C]`` (dense).

    True for CUDA float32 / bfloat16 / float16 streams with ``n`` in {4, 8} and
    at most :data:`MAX_TOKENS` tokens, once the CUDA extension is available.
    """
    return takes_shape(x.shape, x.dtype, x.device)


def takes_shape(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> bool:
    """:func:`takes` for streams of this shape, dtype and device (what :class:`mhc.fused.plan.Plan` records)."""
    global _extension
    n, C = shape[-2:]
    if not (
        device.type == "cuda" and dtype in _DTYPES and n in (4, 8) and shape.numel() // (n * C) <= MAX_TOKENS
    ):
        return False
    _extension = _ext.extension()
    return _extension is not None


def pre(
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    eps: float,
    tol_eff: float,
    max_iter: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`mhc.fused.steps.pre_forward`'s ``(u [..., C], zr [T, Z+1], h [T, 2n], H_res [T, n, n])``.

    Only for streams :func:`takes` accepted. ``x [..., n, C]`` dense, the
    parameters dense float32. ``tol_eff`` is the projection's effective
    tolerance; matrices that miss it are counted and polled like
    :func:`mhc.birkhoff_project`'s.
    """
    u, zr, h, h_res = _extension.site_pre_tokens(x, phi, alpha, b_pre, b_post, b_res, eps, tol_eff, max_iter)
    projection_cuda.poll(h_res)  # (never traced: under torch.compile this runs inside a custom op)
    return u, zr, h, h_res


def post(x: Tensor, y: Tensor, h: Tensor, h_res: Tensor) -> Tensor:
    """``x' = H_res·x + H_post ⊗ y`` (``H_post = 2·h[:, n:]``) of dense ``x [..., n, C]`` and ``y`` in its dtype."""
    return _extension.site_post_tokens(x, y, h, h_res)


def pre_no_grad(
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    eps: float,
    tol: float,
    norm: tuple[Tensor, float] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
    """The first step without grad (generation): ``(u [..., C], mix, x, normed)``, or ``None`` if these kernels do not run.

    One call into the extension, which decides (CUDA streams of float32 /
    bfloat16 / float16, ``n`` in {4, 8}, 1 to :data:`MAX_TOKENS` tokens), makes
    the streams contiguous and the parameters float32 where they are not,
    raises ``tol`` to the projection's effective tolerance and launches the
    kernel once. Nothing the backward would need is written. ``mix`` is one
    float32 tensor, ``h [T, 2n]`` then ``H_res [T, n, n]``; ``x`` the streams
    as read (contiguous), both for :func:`post_no_grad`. Only for CUDA streams.

    ``norm = (weight, eps)``: the branch's input RMSNorm, HF's ``LlamaRMSNorm``
    (``weight * (u_f * rsqrt(mean(u_f²) + eps)).to(dtype)``), which the kernel
    then applies to ``u`` too: ``normed [..., C]``, in the streams' dtype. Only
    a dense ``weight [C]`` of the streams' dtype and device is applied;
    ``normed`` is ``None`` otherwise, and without ``norm``.
    """
    global _extension
    if _extension is None:
        _extension = _ext.extension()
        if _extension is None:
            return None
    weight, norm_eps = norm or _NO_NORM
    site = _extension.site_pre_tokens_packed(
        x, phi, alpha, b_pre, b_post, b_res, eps, tol, NEWTON_MAX_ITER, MAX_TOKENS, weight, norm_eps
    )
    if site is not None:
        projection_cuda.poll(site[1])
    return site


def post_no_grad(x: Tensor, y: Tensor, mix: Tensor) -> Tensor:
    """``x' = H_res·x + H_post ⊗ y`` after :func:`pre_no_grad` (``x`` and ``mix`` from it; ``y`` any float dtype)."""
    return _extension.site_post_tokens_packed(x, y, mix)


def post_pre_no_grad(
    x: Tensor,
    y: Tensor,
    mix: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    eps: float,
    tol: float,
    norm: tuple[Tensor, float] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:func:`post_no_grad` and the next site's :func:`pre_no_grad` on its result in one launch: ``(x', u', mix', normed')``.

    ``x`` and ``mix`` from :func:`pre_no_grad` (so CUDA streams these kernels
    take); the next site's parameters, scalars and branch ``norm``. The same
    bits as the two calls.
    """
    weight, norm_eps = norm or _NO_NORM
    site = _extension.site_post_pre_tokens_packed(
        x, y, mix, phi, alpha, b_pre, b_post, b_res, eps, tol, NEWTON_MAX_ITER, weight, norm_eps
    )
    projection_cuda.poll(site[2])
    return site


def unpack(mix: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``(h [T, 2n], H_res [T, n, n])``, views of :func:`pre_no_grad`'s ``mix``."""
    T = mix.numel() // (2 * n + n * n)
    return mix[: T * 2 * n].view(T, 2 * n), mix[T * 2 * n :].view(T, n, n)
