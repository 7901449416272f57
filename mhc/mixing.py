"""The two ways of making ``H_res`` that are not the Newton projection: truncated Sinkhorn and mHC-lite.

Both take per-token logits (float32 or float64) and return ``H_res: [..., n, n]``
in the convention of :mod:`mhc.site`: ``x'_i = Σ_j H_res[i, j] x_j``, so row
``i`` says what stream ``i`` collects.

* :func:`sinkhorn_h_res`: the recipe of the mHC paper as DeepSeek-V4 runs it
  (design.md, "Three ways to a doubly stochastic H_res"): a row softmax plus ``eps``, then
  alternating column and row normalisations, each dividing by ``sum + eps``.
  DeepSeek builds a matrix ``comb`` that way and mixes the streams with
  ``combᵀ``; here the logits are in ``H_res``'s own layout, so the recipe runs
  on their transpose and the result is transposed back. It is not exactly
  doubly stochastic: every sum ends ``eps``-short of one, and after a fixed
  number of steps the column marginals of ``comb`` (rows of ``H_res``) are off
  by what the last row step left.
* :func:`lite_h_res`: mHC-lite (arXiv 2601.05732): a softmax over all ``n!``
  permutation matrices, ``H_res = Σ_k w_k P_k``. Every ``P_k`` is doubly
  stochastic and the weights sum to one, so ``H_res`` is exactly doubly
  stochastic (to the rounding of the softmax's sum) with no iteration at all;
  the price is ``n!`` logits per token, which is why ``n <= 5``
  (:data:`LITE_MAX_STREAMS`).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

__all__ = [
    "SINKHORN_EPS",
    "LITE_MAX_STREAMS",
    "lite_logit_count",
    "check_lite_streams",
    "permutation_matrices",
    "lite_h_res",
    "lite_identity_logits",
    "sinkhorn_h_res",
]

SINKHORN_EPS = 1e-6
"""DeepSeek-V4's ``hc_eps``: the default epsilon of :func:`sinkhorn_h_res`."""

LITE_MAX_STREAMS = 5
"""The largest ``n`` mHC-lite accepts: ``5! = 120`` logits per token; ``6!`` would be 720."""

# (n, device, dtype) -> [n!, n, n]. A handful of tiny constant tensors, never freed.
_PERMUTATIONS: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}


def lite_logit_count(n: int) -> int:
    """``n!``: how many ``H_res`` logits mHC-lite needs per token for ``n`` streams."""
    return math.factorial(n)


def check_lite_streams(n: int) -> None:
    """Raise ``ValueError`` if mHC-lite cannot run with ``n`` streams (``1 <= n <= 5``)."""
    if not 1 <= n <= LITE_MAX_STREAMS:
        raise ValueError(
            f"projection='lite' mixes all n! permutation matrices, so n_streams must be between 1 and "
            f"{LITE_MAX_STREAMS}; got n_streams={n} ({lite_logit_count(n) if n >= 1 else 0} permutations)"
        )


def permutation_matrices(n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """All ``n!`` permutation matrices of size ``n``, ``[n!, n, n]``, identity first.

    ``P[k, i, σ_k(i)] = 1`` for the ``k``-th permutation ``σ_k`` of
    ``itertools.permutations(range(n))`` (lexicographic, so ``k = 0`` is the
    identity). Cached per ``(n, device, dtype)``; the cached tensor is a normal
    tensor (never an inference-mode one), so autograd can save it even when the
    first call ran under ``torch.inference_mode()``.

    Raises:
        ValueError: ``n`` outside ``1..5``.
    """
    check_lite_streams(n)
    device = torch.device(device)
    key = (n, device, dtype)
    cached = _PERMUTATIONS.get(key)
    if cached is None:
        order = torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long, device="cpu")
        with torch.inference_mode(False), torch.no_grad():
            eye = torch.eye(n, dtype=dtype, device="cpu")
            cached = eye[order].to(device)  # row i of P_k is e_{σ_k(i)}
        _PERMUTATIONS[key] = cached
    return cached


def lite_h_res(logits: Tensor) -> Tensor:
    """mHC-lite's ``H_res = Σ_k softmax(logits)_k P_k``, exactly doubly stochastic.

    Args:
        logits: ``[..., n!]`` float32 or float64, ``n <= 5`` (the order of
            :func:`permutation_matrices`: ``logits[..., 0]`` weighs the identity).

    Returns:
        ``[..., n, n]`` in the dtype of ``logits``. A token with a NaN or Inf
        logit gets an all-NaN ``H_res`` (and NaN gradients); the others are
        unaffected.

    Raises:
        ValueError: the last dimension is not ``n!`` for any ``n`` in ``1..5``.
    """
    count = logits.shape[-1] if logits.dim() else 0
    n = next((k for k in range(1, LITE_MAX_STREAMS + 1) if math.factorial(k) == count), None)
    if n is None:
        raise ValueError(
            f"lite_h_res needs [..., n!] logits with n in 1..{LITE_MAX_STREAMS}, got shape {tuple(logits.shape)}"
        )
    weights = torch.softmax(logits, dim=-1)
    P = permutation_matrices(n, logits.device, logits.dtype).reshape(count, n * n)
    return (weights @ P).reshape(*logits.shape[:-1], n, n) * _nan_where_nonfinite(logits, -1)


def lite_identity_logits(n: int, diagonal: float) -> Tensor:
    """float32 ``[n!]`` logits whose :func:`lite_h_res` has ``diagonal`` on every diagonal entry.

    All the weight beyond uniform goes to the identity (``logits[0] = c``,
    the rest 0). Each diagonal entry of ``Σ_k w_k P_k`` collects the identity
    and the ``(n-1)! - 1`` other permutations that fix it, so
    ``(e^c + (n-1)! - 1) / (e^c + n! - 1) = diagonal`` gives
    ``e^c = (diagonal·(n! - 1) - (n-1)! + 1) / (1 - diagonal)``. By symmetry
    every off-diagonal entry is then ``(1 - diagonal)/(n - 1)``, the start of
    the Newton projection's ``b_res``. ``n = 1`` has one permutation: ``[0.]``.

    Raises:
        ValueError: ``n`` outside ``1..5``, or ``diagonal`` not in ``(1/n, 1)`` (for ``n >= 2``).
    """
    check_lite_streams(n)
    logits = torch.zeros(lite_logit_count(n), dtype=torch.float32, device="cpu")
    if n == 1:
        return logits
    if not 1.0 / n < diagonal < 1.0:
        raise ValueError(f"diagonal must be in (1/n, 1) = ({1.0 / n:.3g}, 1), got {diagonal}")
    full, fixing = math.factorial(n), math.factorial(n - 1)
    logits[0] = math.log((diagonal * (full - 1) - fixing + 1) / (1.0 - diagonal))
    return logits


def sinkhorn_h_res(logits: Tensor, iters: int = 20, eps: float = SINKHORN_EPS) -> Tensor:
    """Truncated Sinkhorn as DeepSeek-V4 applies it, for ``H_res``-layout logits ``[..., n, n]``.

    With ``L = logitsᵀ`` (DeepSeek's ``comb`` layout):

    1. ``comb = softmax(L, over each row) + eps``;
    2. ``comb = comb / (column sums + eps)``;
    3. ``iters - 1`` times: ``comb = comb / (row sums + eps)``, then the same for the columns;

    and ``H_res = combᵀ``, since DeepSeek mixes with ``combᵀ``. Each of the
    ``iters`` rounds is a row then a column normalisation (the softmax is the
    first row step), differentiated through the loop by autograd.

    Args:
        logits: ``[..., n, n]`` float32 or float64.
        iters: rounds, an int ``>= 1`` (DeepSeek and the mHC paper: 20).
        eps: the ``hc_eps`` of the recipe, finite and ``>= 0`` (default :data:`SINKHORN_EPS`).

    Returns:
        ``[..., n, n]`` in the dtype of ``logits``. A matrix with a NaN or Inf
        logit comes back all NaN (and gets NaN gradients); the others are unaffected.
    """
    comb = torch.softmax(logits.transpose(-1, -2), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb.transpose(-1, -2) * _nan_where_nonfinite(logits, -2, -1)


def _nan_where_nonfinite(logits: Tensor, *dims: int) -> Tensor:
    # A product, not torch.where: a non-finite token's gradient must be NaN too
    # (where would hand it zeros); finite tokens are multiplied by exactly 1.
    finite = logits.isfinite()
    for d in sorted(dims):
        finite = finite.all(d, keepdim=True)
    one = torch.ones((), dtype=logits.dtype, device=logits.device)
    nan = torch.full((), math.nan, dtype=logits.dtype, device=logits.device)
    mask = torch.where(finite, one, nan)
    return mask.unsqueeze(-1) if len(dims) == 1 else mask
