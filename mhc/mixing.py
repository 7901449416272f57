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
import numbers

import torch
from torch import Tensor

from .options import check_int, check_option, check_real

__all__ = [
    "SINKHORN_EPS",
    "LITE_MAX_STREAMS",
    "lite_logit_count",
    "check_lite_streams",
    "permutation_matrices",
    "lite_h_res",
    "lite_h_res_unchecked",
    "lite_identity_logits",
    "sinkhorn_h_res",
    "sinkhorn_h_res_unchecked",
]

SINKHORN_EPS = 1e-6
"""DeepSeek-V4's ``hc_eps``: the default epsilon of :func:`sinkhorn_h_res`."""

LITE_MAX_STREAMS = 5
"""The largest ``n`` mHC-lite accepts: ``5! = 120`` logits per token; ``6!`` would be 720."""

# (n, device, dtype) -> [n!, n, n]. A handful of tiny constant tensors, never freed.
_PERMUTATIONS: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}


def lite_logit_count(n: int) -> int:
    """``n!``: how many ``H_res`` logits mHC-lite needs per token for ``n`` streams (an int ``>= 1``).

    Raises:
        TypeError: ``n`` is not an int (a ``bool`` is not).
        ValueError: ``n < 1``.
    """
    return math.factorial(check_int("n", n, 1))


def _is_int(n) -> bool:
    return isinstance(n, numbers.Integral) and not isinstance(n, bool)


def check_lite_streams(n: int) -> None:
    """Raise if mHC-lite cannot run with ``n`` streams: ``TypeError`` unless an int, ``ValueError`` unless ``1 <= n <= 5``."""
    if not _is_int(n):
        check_option("n_streams", n)  # raises MHCBlock's TypeError for it
    if not 1 <= n <= LITE_MAX_STREAMS:
        raise ValueError(
            f"projection='lite' mixes all n! permutation matrices, so n_streams must be between 1 and "
            f"{LITE_MAX_STREAMS}; got n_streams={n} ({lite_logit_count(n) if n >= 1 else 0} permutations)"
        )


def permutation_matrices(
    n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Tensor:
    """All ``n!`` permutation matrices of size ``n``, ``[n!, n, n]``, identity first.

    ``P[k, i, σ_k(i)] = 1`` for the ``k``-th permutation ``σ_k`` of
    ``itertools.permutations(range(n))`` (lexicographic, so ``k = 0`` is the
    identity). Cached per ``(n, device, dtype)``; the cached tensor is a normal
    tensor (never an inference-mode one), so autograd can save it even when the
    first call ran under ``torch.inference_mode()``.

    Raises:
        TypeError: ``n`` not an int, ``device`` not a ``str`` / ``torch.device``,
            ``dtype`` not a ``torch.dtype``.
        ValueError: ``n`` outside ``1..5``, or ``device`` names no device.
    """
    if not _is_int(n):
        check_int("n", n, 1)  # raises the TypeError
    check_lite_streams(n)
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {device!r} ({type(device).__name__})")
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device {device!r} is not a device: {err}") from None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r} ({type(dtype).__name__})")
    return _permutations(int(n), device, dtype)


def _permutations(n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """:func:`permutation_matrices` for checked arguments (``device`` a ``torch.device``)."""
    key = (n, device, dtype)
    cached = _PERMUTATIONS.get(key)
    if cached is None:
        order = torch.tensor(list(itertools.permutations(range(n))), dtype=torch.long, device="cpu")
        with torch.inference_mode(False), torch.no_grad():
            eye = torch.eye(n, dtype=dtype, device="cpu")
            cached = eye[order].to(device)  # row i of P_k is e_{σ_k(i)}
        # Only a real tensor is kept: one built while tracing (torch.compile, export, a FakeTensorMode
        # dry run) is a traced or fake value, or an inference tensor once the graph runs.
        if not torch.compiler.is_compiling() and type(cached) is Tensor and not cached.is_inference():
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
        TypeError: ``logits`` is not a float32 or float64 tensor.
        ValueError: the last dimension is not ``n!`` for any ``n`` in ``1..5``.
    """
    _check_logits(logits, "lite_h_res")
    count = logits.shape[-1] if logits.dim() else 0
    n = next((k for k in range(1, LITE_MAX_STREAMS + 1) if math.factorial(k) == count), None)
    if n is None:
        raise ValueError(
            f"lite_h_res needs [..., n!] logits with n in 1..{LITE_MAX_STREAMS}, got shape {tuple(logits.shape)}"
        )
    return lite_h_res_unchecked(logits, n)


def lite_h_res_unchecked(logits: Tensor, n: int) -> Tensor:
    """:func:`lite_h_res` of ``logits [..., n!]`` that the caller has checked (MHCBlock's forward), no checks.

    Anyone else: call :func:`lite_h_res`.
    """
    weights = torch.softmax(logits, dim=-1)
    P = _permutations(n, logits.device, logits.dtype).reshape(logits.shape[-1], n * n)
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
        TypeError: ``n`` not an int, or ``diagonal`` not a real number.
        ValueError: ``n`` outside ``1..5``, ``diagonal`` not finite, or not in
            ``(1/n, 1)`` (for ``n >= 2``).
    """
    if not _is_int(n):
        check_int("n", n, 1)  # raises the TypeError
    check_lite_streams(n)
    diagonal = check_real("diagonal", diagonal, False)
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
        logits: ``[..., n, n]`` float32 or float64, ``n >= 1``.
        iters: rounds, an int ``>= 1`` (DeepSeek and the mHC paper: 20).
        eps: the ``hc_eps`` of the recipe, finite and ``>= 0`` (default :data:`SINKHORN_EPS`).

    Returns:
        ``[..., n, n]`` in the dtype of ``logits``. A matrix with a NaN or Inf
        logit comes back all NaN (and gets NaN gradients); the others are unaffected.

    Raises:
        TypeError: ``logits`` is not a float32 or float64 tensor, ``iters`` not
            an int or ``eps`` not a real number (a ``bool`` is neither).
        ValueError: ``logits`` not ``[..., n, n]`` with ``n >= 1``, ``iters < 1``,
            or ``eps`` negative, NaN or infinite: :class:`mhc.MHCBlock`'s checks
            of ``sinkhorn_iters`` and ``sinkhorn_eps``
            (:func:`mhc.options.check_option`).
    """
    _check_logits(logits, "sinkhorn_h_res")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn_h_res needs square matrices [..., n, n], got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError(f"sinkhorn_h_res needs n >= 1, got {tuple(logits.shape)}")
    iters = check_option("sinkhorn_iters", iters, name="iters")
    eps = check_option("sinkhorn_eps", eps, name="eps")
    return sinkhorn_h_res_unchecked(logits, iters, eps)


def sinkhorn_h_res_unchecked(logits: Tensor, iters: int, eps: float) -> Tensor:
    """:func:`sinkhorn_h_res` for arguments the caller has checked (MHCBlock's forward), no checks.

    Anyone else: call :func:`sinkhorn_h_res`.
    """
    comb = torch.softmax(logits.transpose(-1, -2), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb.transpose(-1, -2) * _nan_where_nonfinite(logits, -2, -1)


def _check_logits(logits, owner: str) -> None:
    if not isinstance(logits, Tensor):
        raise TypeError(f"{owner}: logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{owner}: logits must be float32 or float64, got {logits.dtype}")


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
