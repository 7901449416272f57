"""The stability metrics, as plain tensor maths (no model, no hooks).

Orientation. A site mixes its ``n`` streams as ``x_{l+1} = H_res^l x_l`` (streams
are the rows of ``x: [n, C]``; ``H_res[i, j]`` carries stream ``j`` into stream
``i``), so the residual path from the input of site 0 to the output of site
``d`` is the *prefix composite*

    ``P_d = H_res^d H_res^{d-1} ⋯ H_res^0``   (later sites on the left).

The gradient runs the other way: ``∂loss/∂x_0 = P_dᵀ ∂loss/∂x_{d+1}`` along that path.

* **forward gain** of a matrix ``M``: ``max_i Σ_j |M_ij|``, its max absolute *row*
  sum (``‖M‖_∞``): the most any output stream can grow over the largest input stream.
* **backward gain**: ``max_j Σ_i |M_ij|``, its max absolute *column* sum
  (``‖M‖_1 = ‖Mᵀ‖_∞``): the same for a gradient travelling back through ``M``.

Both are the mHC paper's "Amax gain magnitude". They are computed per token (every
batch position has its own ``H_res``) and summarised over the tokens by mean and max.
For exact mHC every factor is doubly stochastic and non-negative, so every composite
is too and both gains are 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..options import check_non_negative
from ..projection import marginal_error

__all__ = [
    "CompositeGains",
    "logit_scale",
    "TokenGains",
    "stack_h_res",
    "composite_mapping",
    "composite_gains",
    "token_gains",
    "suffix_backward_gain",
    "forward_gain",
    "backward_gain",
    "stream_spread",
    "near_zero_or_one",
    "one_hot_rows",
    "marginal_error",
]


@dataclass
class CompositeGains:
    """Gains of the prefix composite ``H_res^{d} ⋯ H_res^{0}`` for every depth ``d``.

    All fields are float64 tensors of shape ``[L]``; entry ``d`` is the worst case over
    the batch (tokens) of the composite through site ``d`` (0-based).

    Attributes:
        forward_gain: max absolute row sum (how much a forward signal can grow).
        backward_gain: max absolute column sum (how much a gradient can grow).
        spectral_norm: largest singular value.
    """

    forward_gain: Tensor
    backward_gain: Tensor
    spectral_norm: Tensor

    def as_dict(self) -> dict[str, list[float]]:
        """Plain lists, for JSON logs."""
        return {k: getattr(self, k).tolist() for k in ("forward_gain", "backward_gain", "spectral_norm")}


@dataclass
class TokenGains:
    """Per-token gains of the prefix composites: float64 ``[L, *batch]`` each.

    Attributes:
        forward: max absolute row sum of ``P_d`` at every token.
        backward: max absolute column sum of ``P_d`` at every token.
    """

    forward: Tensor
    backward: Tensor


def stack_h_res(h_res: Sequence[Tensor] | Tensor) -> Tensor:
    """Per-site ``H_res`` as one detached float64 ``[L, *batch, n, n]`` tensor, first site first.

    Raises:
        ValueError: no site, no matrix (a batch of zero tokens, or ``n = 0``), non-square
            matrices, or sites with different batch shapes.
        TypeError: an entry that is not a floating-point tensor.
    """
    if isinstance(h_res, Tensor):
        stacked = h_res
    else:
        h_res = list(h_res)
        if len(h_res) == 0:
            raise ValueError("composite mapping needs at least one site's H_res")
        for i, h in enumerate(h_res):
            if not isinstance(h, Tensor) or not h.is_floating_point():
                raise TypeError(
                    f"H_res of site {i} must be a floating-point tensor, got {getattr(h, 'dtype', type(h))}"
                )
        shapes = {tuple(h.shape) for h in h_res}
        if len(shapes) > 1:
            raise ValueError(
                f"every site's H_res needs one shape [..., n, n] for a composite, got {sorted(shapes)}"
            )
        stacked = torch.stack([h.detach() for h in h_res])
    if not stacked.is_floating_point():
        raise TypeError(f"H_res must be floating point, got {stacked.dtype}")
    if stacked.dim() < 3 or stacked.shape[-1] != stacked.shape[-2]:
        raise ValueError(f"H_res must be [L, ..., n, n] square matrices, got {tuple(stacked.shape)}")
    if stacked.shape[0] == 0:
        raise ValueError("composite mapping needs at least one site's H_res")
    if stacked[0].numel() == 0:
        raise ValueError(
            f"H_res holds no matrices (shape {tuple(stacked.shape)}): there is nothing to measure"
        )
    return stacked.detach().double()


def composite_mapping(h_res: Sequence[Tensor] | Tensor) -> Tensor:
    """Prefix composites ``P_d = H_res^d ⋯ H_res^0`` (later sites multiply on the left), in float64.

    Args:
        h_res: per-site ``H_res``, a list of ``[..., n, n]`` tensors or one
            ``[L, ..., n, n]`` tensor, first site first (one batch shape for all).

    Returns:
        ``[L, ..., n, n]`` float64: entry ``d`` maps the streams entering site 0 to
        those leaving site ``d`` along the residual path (``x_{d+1} = P_d x_0``).
    """
    H = stack_h_res(h_res)
    prefix = [H[0]]
    for layer in H[1:]:
        prefix.append(layer @ prefix[-1])
    return torch.stack(prefix)


def _check_tensor(name: str, value, dims: str, square: bool) -> None:
    """``TypeError`` unless ``value`` is a tensor, ``ValueError`` unless it has the trailing dims ``[..., a, b]``."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() < 2 or (square and value.shape[-1] != value.shape[-2]):
        raise ValueError(f"{name} must be {dims}, got {tuple(value.shape)}")


def forward_gain(M: Tensor) -> Tensor:
    """Max absolute row sum of ``M: [..., n, n]`` (``‖M‖_∞``): ``[...]``, M's dtype.

    Raises:
        TypeError: ``M`` is not a tensor. ValueError: not ``[..., n, n]``.
    """
    _check_tensor("M", M, "[..., n, n]", square=True)
    return M.abs().sum(-1).amax(-1)


def backward_gain(M: Tensor) -> Tensor:
    """Max absolute column sum of ``M: [..., n, n]`` (``‖M‖_1``): ``[...]``, M's dtype.

    Raises:
        TypeError: ``M`` is not a tensor. ValueError: not ``[..., n, n]``.
    """
    _check_tensor("M", M, "[..., n, n]", square=True)
    return M.abs().sum(-2).amax(-1)


def token_gains(h_res: Sequence[Tensor] | Tensor) -> TokenGains:
    """Forward and backward gain of every prefix composite at every token (see the module docstring).

    Args:
        h_res: as for :func:`composite_mapping`.

    Returns:
        :class:`TokenGains` of float64 ``[L, *batch]`` tensors.
    """
    P = composite_mapping(h_res)
    return TokenGains(forward=forward_gain(P), backward=backward_gain(P))


def composite_gains(h_res: Sequence[Tensor] | Tensor) -> CompositeGains:
    """Forward/backward gains and spectral norm of the prefix composite at every depth, worst token.

    Args:
        h_res: as for :func:`composite_mapping`.

    Returns:
        :class:`CompositeGains` with ``[L]`` float64 tensors (max over the batch). A token whose
        composite holds NaN or Inf (a diverged model) makes all three NaN at that depth and after.
    """
    P = composite_mapping(h_res)
    flat = P.flatten(1, -3) if P.dim() > 3 else P.unsqueeze(1)  # [L, B, n, n]
    finite = torch.isfinite(flat).flatten(-2).all(-1)  # [L, B]; the SVD refuses the others
    spectral = torch.linalg.matrix_norm(torch.where(finite[..., None, None], flat, 0), ord=2)
    spectral = spectral.masked_fill(~finite, math.nan).amax(-1)
    return CompositeGains(
        forward_gain=forward_gain(flat).amax(-1),
        backward_gain=backward_gain(flat).amax(-1),
        spectral_norm=spectral,
    )


def suffix_backward_gain(h_res: Sequence[Tensor] | Tensor) -> Tensor:
    """Backward gain of the *suffix* composites ``S_d = H_res^{L-1} ⋯ H_res^d``, worst token.

    ``S_dᵀ`` is what the residual path alone does to the gradient on its way from
    the last site's output back to the input of site ``d``, so entry ``d`` is the
    gain :func:`mhc.diagnostics.stability_report` puts beside the measured
    ``‖∂loss/∂x_d‖ / ‖∂loss/∂x_L‖``.

    Returns:
        ``[L]`` float64.
    """
    H = stack_h_res(h_res)
    suffix = [H[-1]]
    for layer in H[:-1].flip(0):
        suffix.append(suffix[-1] @ layer)
    S = torch.stack(suffix[::-1])
    return backward_gain(S).reshape(S.shape[0], -1).amax(-1)


def stream_spread(x: Tensor) -> Tensor:
    """How far the ``n`` streams of each token differ: ``‖x - x̄‖_F / ‖x‖_F`` per token.

    ``x̄`` is the mean stream. It lies in ``[0, 1]`` (``‖x - x̄‖² = ‖x‖² - n‖x̄‖²``): 0
    means the streams have collapsed into one (they are equal), 1 that they average to
    zero; one non-zero stream among ``n`` gives ``sqrt(1 - 1/n)``. An all-zero token counts as 0.

    Args:
        x: streams ``[..., n, C]``, any float dtype.

    Returns:
        ``[...]`` float64.

    Raises:
        TypeError: ``x`` is not a tensor. ValueError: not ``[..., n, C]``.
    """
    _check_tensor("x", x, "[..., n, C]", square=False)
    x = x.detach().double()
    dev = (x - x.mean(-2, keepdim=True)).flatten(-2).norm(dim=-1)
    total = x.flatten(-2).norm(dim=-1)
    return torch.where(
        total > 0, dev / total.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(total)
    )


def logit_scale(logits: Tensor) -> Tensor:
    """The spread of each token's ``H_res`` logits: their standard deviation over the last dimension.

    The population standard deviation (no Bessel correction) of the ``r`` logits of a token:
    ``r = n²`` for a Newton or Sinkhorn site (flatten ``[..., n, n]`` first), ``n!`` for mHC-lite.
    Logits drawn i.i.d. with standard deviation ``σ`` read about ``σ``; the larger it is, the
    sharper ``H_res`` and the further a truncated Sinkhorn falls from doubly stochastic.

    Args:
        logits: ``[..., r]``, any float dtype, ``r ≥ 1``.

    Returns:
        ``[...]`` float64.

    Raises:
        TypeError: ``logits`` is not a floating-point tensor. ValueError: it has no dimension or an empty last one.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {type(logits).__name__}"
                        f"{'' if not isinstance(logits, Tensor) else ' of ' + str(logits.dtype)}")  # fmt: skip
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., r] with r >= 1, got shape {tuple(logits.shape)}")
    if logits.numel() == 0:  # an empty batch; torch.std would warn about 0/0 degrees of freedom
        return logits.new_empty(logits.shape[:-1], dtype=torch.float64)
    return logits.detach().double().std(dim=-1, correction=0)


def near_zero_or_one(values: Tensor, eps: float) -> Tensor:
    """Whether each value lies within ``eps`` of 0 or of 1 (bool, same shape).

    For ``H_res`` entries this is saturation of the projection (``T(1-T)`` near 0,
    almost no gradient); for ``H_pre = σ(z)`` and ``H_post / 2 = σ(z)`` it is the flat
    part of the sigmoid (``σ'(z) = σ(1-σ) < eps``).

    Raises:
        TypeError: ``values`` is not a tensor, or ``eps`` not a real number.
        ValueError: ``eps`` negative, NaN or infinite.
    """
    if not isinstance(values, Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    eps = check_non_negative("eps", eps)
    v = values.detach().double()
    return (v.abs() <= eps) | ((v - 1).abs() <= eps)


def one_hot_rows(h_res: Tensor, eps: float) -> Tensor:
    """Whether each row of ``h_res: [..., n, n]`` is within ``eps`` of a one-hot row: ``[..., n]`` bool.

    A row whose largest entry is at least ``1 - eps`` (and whose others are then
    below ``eps`` for a doubly stochastic matrix) has saturated: it routes one
    stream and its logits get almost no gradient.

    Raises:
        TypeError: ``h_res`` is not a tensor, or ``eps`` not a real number.
        ValueError: ``h_res`` not ``[..., n, n]``, or ``eps`` negative, NaN or infinite.
    """
    _check_tensor("h_res", h_res, "[..., n, n]", square=True)
    eps = check_non_negative("eps", eps)
    return h_res.detach().double().amax(-1) >= 1 - eps
