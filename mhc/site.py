"""The mHC site's steps in plain PyTorch: the reference backend of :class:`mhc.MHCBlock`.

A site is ``x' = H_res·x + H_postᵀ ⊗ F(H_pre·x)`` (design.md §1). Its steps,
around the sublayer ``F`` that :class:`mhc.MHCBlock` calls in between:

* :func:`coefficients`: ``(H_pre, H_post, H_res)`` per token, in float32
  (float64 for float64 streams) whatever the streams' dtype;
* :func:`pre_mix`: ``u = Σ_i H_pre[i] x_i``, the sublayer's input, in
  :func:`branch_input_dtype`;
* :func:`post_mix`: ``x'_i = Σ_j H_res[i, j] x_j + H_post[i] y``.

:mod:`mhc.fused` provides the same steps on fused Triton kernels for CUDA
streams; these functions are the reference they are tested against, the CPU
implementation, and the only path with double backward.

Both mixes are written around stream 0: ``Σ_i h_i x_i = (Σ_i h_i) x_0 +
Σ_i h_i (x_i - x_0)``. Same maths, but on identical streams (a freshly
converted model) the deviations are exactly zero, so the site returns
``x + F(x)`` to the bit instead of ``n`` roundings of ``|x|`` away.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from .mixing import SINKHORN_EPS, lite_h_res_unchecked, sinkhorn_h_res_unchecked
from .options import MHCOptions
from .projection import birkhoff_project

__all__ = [
    "branch_input_dtype",
    "coefficients",
    "h_res_logits",
    "residual_coefficients",
    "pre_mix",
    "post_mix",
]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps")


def branch_input_dtype(x: Tensor, weight_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of the sublayer's input ``u`` for streams ``x``: ``x``'s, or wider under autocast.

    Under autocast on ``x``'s device, ``u`` takes ``torch.promote_types(x.dtype, weight_dtype)``:
    with float32 weights and bf16 streams (``MHCConfig.stream_dtype="autocast"``), the sublayer
    gets a float32 input, as the residual model's sublayer gets its float32 hidden state. Its
    input norm then makes no casts (in eager mode a bf16 input costs it four passes over
    ``[T, C]``: up to float32, back down, and both again in backward), and ``u`` keeps the
    pre-mix's float32 value instead of its rounding to the streams' dtype. Without autocast, or
    with weights no wider than the streams (a model cast to bf16), ``u`` has ``x``'s dtype; and
    while ``torch.compile`` traces, where inductor fuses the norm's casts, so that a wider ``u``
    would only add bytes to the site's kernels and to the norm (notes/training_cost.md).

    Args:
        x: the streams ``[..., n, C]``.
        weight_dtype: the block's parameters' dtype, or ``None`` for a block without any
            (``mode="residual"``), whose ``u`` keeps ``x``'s dtype.
    """
    if weight_dtype is None or weight_dtype == x.dtype or torch.compiler.is_compiling():
        return x.dtype
    device_type = x.device.type
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.promote_types(x.dtype, weight_dtype)
    return x.dtype


def _without_autocast(step):
    """Run ``step`` with autocast off on its first tensor's device.

    Under bf16 autocast the matmuls and einsums of the coefficients and the
    mixes would run in bf16 while their results claim float32; coefficient
    math stays float32 (the sublayer, called outside these steps, keeps
    autocast).
    """

    @functools.wraps(step)
    def run(x, *args, **kwargs):
        device_type = x.device.type
        if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return step(x, *args, **kwargs)
        return step(x, *args, **kwargs)

    return run


@_without_autocast
def coefficients(
    x: Tensor,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    options: MHCOptions,
    *,
    pre_eps: float = 0.0,
    sinkhorn_eps: float = SINKHORN_EPS,
) -> tuple[Tensor, Tensor, Tensor]:
    """The mixing coefficients of streams ``x: [..., n, C]`` (``options.mode`` ``"mhc"`` or ``"hc"``).

    * ``"mhc"``: flattened RMSNorm over all ``n·C`` values, ``z = x̃ φᵀ`` with
      ``phi [2n + r, n·C]``, ``H_pre = σ(α_pre z_pre + b_pre) + pre_eps``,
      ``H_post = 2σ(α_post z_post + b_post)`` and ``H_res`` from the ``r``
      logits ``α_res z_res + b_res`` by ``options.projection``: ``"newton"``
      (:func:`mhc.birkhoff_project`, ``r = n²``), ``"sinkhorn"``
      (:func:`mhc.mixing.sinkhorn_h_res` with ``sinkhorn_iters`` and
      ``sinkhorn_eps``, ``r = n²``) or ``"lite"`` (:func:`mhc.mixing.lite_h_res`,
      ``r = n!``).
    * ``"hc"``: per-stream RMSNorm, ``phi [n + 2, C]``, ``H = α·tanh(x̃ φᵀ) + b``, a free ``H_res``.

    Args:
        x: streams ``[..., n, C]``, any float dtype.
        phi, alpha ``[3]``, b_pre ``[n]``, b_post ``[n]``, b_res ``[n, n]`` (``[n!]`` for
            ``"lite"``): the parameters.
        options: ``mode``, ``norm_eps``, ``projection``, ``tol``, ``sinkhorn_iters`` are read.
        pre_eps: added to ``H_pre`` (mode ``"mhc"``; DeepSeek-V4 adds its ``hc_eps``).
        sinkhorn_eps: the epsilon of :func:`mhc.mixing.sinkhorn_h_res`.

    Returns:
        ``(H_pre [..., n], H_post [..., n], H_res [..., n, n])``, float32
        (float64 if ``x`` is float64).
    """
    n, C = x.shape[-2:]
    acc = torch.promote_types(x.dtype, torch.float32)
    a_pre, a_post, a_res = alpha.to(acc)
    b_pre, b_post, b_res = b_pre.to(acc), b_post.to(acc), b_res.to(acc)
    phi = phi.to(acc)
    if options.mode == "mhc":
        pre, post, res = _mhc_projections(x, phi, options)
        H_pre = torch.sigmoid(a_pre * pre + b_pre)
        if pre_eps:
            H_pre = H_pre + pre_eps
        H_post = 2 * torch.sigmoid(a_post * post + b_post)
        # The block checked its options and sizes when it was built: the unchecked variants, no per-call checks.
        if options.projection == "lite":
            return H_pre, H_post, lite_h_res_unchecked(a_res * res + b_res, n)
        logits = a_res * rearrange(res, "... (i j) -> ... i j", i=n) + b_res
        if options.projection == "sinkhorn":
            H_res = sinkhorn_h_res_unchecked(logits, options.sinkhorn_iters, sinkhorn_eps)
        else:
            H_res = birkhoff_project(logits, tol=options.tol)
        return H_pre, H_post, H_res

    if options.mode != "hc":
        raise ValueError(f"coefficients: options.mode must be 'mhc' or 'hc', got {options.mode!r}")
    x_norm = F.rms_norm(x.to(acc), (C,), eps=options.norm_eps)
    dyn = torch.tanh(x_norm @ phi.t())  # [..., n, n + 2]: row i is read off stream i
    H_pre = a_pre * dyn[..., 0] + b_pre
    H_post = a_post * dyn[..., 1] + b_post
    H_res = a_res * dyn[..., 2:] + b_res
    return H_pre, H_post, H_res


def _mhc_projections(x: Tensor, phi: Tensor, options: MHCOptions) -> tuple[Tensor, Tensor, Tensor]:
    """``x̃ φᵀ`` split into its ``H_pre``, ``H_post`` and ``H_res`` parts (mode ``"mhc"``; ``phi`` in float32 or 64)."""
    n, C = x.shape[-2:]
    x_flat = rearrange(x, "... n c -> ... (n c)").to(phi.dtype)
    x_norm = F.rms_norm(x_flat, (n * C,), eps=options.norm_eps)
    res_count = math.factorial(n) if options.projection == "lite" else n * n
    return (x_norm @ phi.t()).split([n, n, res_count], dim=-1)


@_without_autocast
def h_res_logits(x: Tensor, phi: Tensor, alpha: Tensor, b_res: Tensor, options: MHCOptions) -> Tensor:
    """The logits that ``options.projection`` turns into ``H_res`` (mode ``"mhc"``): ``α_res z_res + b_res``.

    What the projection's accuracy depends on: Sinkhorn's marginal error grows
    with their spread, the exact projection's does not.

    Args:
        x: streams ``[..., n, C]``, any float dtype.
        phi, alpha ``[3]``, b_res: the site's parameters, as :func:`coefficients` takes them.
        options: ``mode`` must be ``"mhc"``; ``norm_eps`` and ``projection`` are read.

    Returns:
        ``[..., n, n]`` (``[..., n!]`` for ``projection="lite"``), float32 (float64 for float64 streams).

    Raises:
        ValueError: ``options.mode`` is not ``"mhc"`` (HC's ``H_res`` is not projected).
    """
    if options.mode != "mhc":
        raise ValueError(f"H_res logits exist in mode 'mhc' only, got mode {options.mode!r}")
    n = x.shape[-2]
    acc = torch.promote_types(x.dtype, torch.float32)
    res = _mhc_projections(x, phi.to(acc), options)[2]
    if options.projection != "lite":
        res = rearrange(res, "... (i j) -> ... i j", i=n)
    return alpha[2].to(acc) * res + b_res.to(acc)


def residual_coefficients(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``mode="residual"``'s fixed coefficients for ``x: [..., n, C]``: ``H_pre = 1/n``, ``H_post = 1``, ``H_res = I``.

    Same shapes and dtype as :func:`coefficients`; ``H_res`` is an expanded view.
    """
    n = x.shape[-2]
    acc = torch.promote_types(x.dtype, torch.float32)
    ones = x.new_ones(x.shape[:-1], dtype=acc)
    return ones / n, ones, torch.eye(n, dtype=acc, device=x.device).expand(*x.shape[:-2], n, n)


@_without_autocast
def pre_mix(x: Tensor, H_pre: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``u = Σ_i H_pre[i] x_i``, around stream 0.

    Args:
        x: streams ``[..., n, C]``.
        H_pre: ``[..., n]``, the coefficients' dtype.
        dtype: of ``u`` (default ``x``'s; :func:`branch_input_dtype`).

    Returns:
        ``(u [..., C]`` in ``dtype``, ``anchor [..., 1, C]``, ``dev [..., n, C]``)``: stream 0 and
        the deviations ``x_i - x_0``, in ``H_pre``'s dtype, which :func:`post_mix` mixes.
    """
    xs = x.to(H_pre.dtype)
    anchor = xs[..., :1, :]
    dev = xs - anchor
    u = H_pre.sum(-1, keepdim=True) * anchor.squeeze(-2) + torch.einsum("...n,...nc->...c", H_pre, dev)
    return u.to(x.dtype if dtype is None else dtype), anchor, dev


@_without_autocast
def post_mix(
    y: Tensor,
    anchor: Tensor,
    dev: Tensor,
    H_post: Tensor,
    H_res: Tensor,
    *,
    exact_rows: bool,
    dtype: torch.dtype,
) -> Tensor:
    """``x'_i = Σ_j H_res[i, j] x_j + H_post[i] y``, around stream 0.

    Args:
        y: the sublayer's output ``[..., C]``.
        anchor, dev: from :func:`pre_mix`.
        H_post: ``[..., n]``; H_res: ``[..., n, n]``.
        exact_rows: ``H_res``'s rows sum to one by construction (Newton's
            projection), so the anchor is mixed with the exact 1 instead of
            the rows' rounded sums.
        dtype: of the result (the streams').

    Returns:
        ``x' [..., n, C]`` in ``dtype``.
    """
    rows = 1.0 if exact_rows else H_res.sum(-1, keepdim=True)
    mixed = rows * anchor + H_res @ dev + H_post.unsqueeze(-1) * y.to(dev.dtype).unsqueeze(-2)
    return mixed.to(dtype)
