"""``birkhoff_project``: the Birkhoff projection ``Π_B(exp(R))``, on the best path for the input.

``T = Π_B(exp(R))`` is the exact doubly stochastic ``H_res`` (design.md §2).
This module only chooses the path: the fused CUDA kernels
(:mod:`mhc.projection.cuda`) for CUDA tensors with ``n`` in {4, 8} and
float32 / bfloat16 / float16 logits, the pure-PyTorch reference solver
(:mod:`mhc.projection.reference`) for everything else. It re-exports the
public names of both and of :mod:`mhc.projection.common` (``birkhoff_project_reference``,
``birkhoff_backward``, ``ProjectionInfo``, ``ConvergenceWarning``, ...), so
``from mhc.projection import ...`` finds them all.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import cuda as projection_cuda
from .common import (
    METHODS,
    NEWTON_MAX_ITER,
    ConvergenceWarning,
    ProjectionInfo,
    check_arguments,
    compute_dtype,
    effective_tol,
    marginal_error,
    newton_report,
)
from .reference import birkhoff_backward, birkhoff_project_reference, dual_hessian, project_unchecked

__all__ = [
    "birkhoff_project",
    "birkhoff_project_reference",
    "birkhoff_backward",
    "marginal_error",
    "ProjectionInfo",
    "ConvergenceWarning",
    "NEWTON_MAX_ITER",
    "METHODS",
    "effective_tol",
    "compute_dtype",
    "dual_hessian",
    "newton_report",
    "check_arguments",
]


# The defaults, compared by identity on the fast path (equal values passed explicitly are type-checked there).
_NEWTON = "newton"
_TOL = 1e-6
_MAX_ITER = NEWTON_MAX_ITER
_ITERS = 20
_is_compiling = torch.compiler.is_compiling  # dynamo knows the function, not the name


def birkhoff_project(
    logits: Tensor,
    *,
    tol: float = _TOL,
    max_iter: int = _MAX_ITER,
    method: str = _NEWTON,
    iters: int = _ITERS,
    return_info: bool = False,
) -> Tensor | tuple[Tensor, ProjectionInfo]:
    """Project ``exp(logits)`` onto the Birkhoff polytope (doubly stochastic matrices).

    Args:
        logits: ``[..., n, n]`` float16, bfloat16, float32 or float64; any
            leading batch shape, contiguous or not. An empty batch gives an
            empty result.
        tol: target for ``‖T1-1‖₁ + ‖Tᵀ1-1‖₁`` per matrix (Newton only), a
            finite real > 0. It is raised to ``4·n·eps`` of the compute dtype,
            below which rounding alone decides the error.
        max_iter: Newton iterations (each with its line search or fallback
            sweep) before giving up on a matrix, an int >= 0 (0: only the
            initial Sinkhorn sweep).
        method: ``"newton"`` (exact, implicit backward) or ``"sinkhorn"``
            (``iters`` fixed Sinkhorn-Knopp steps, backward through the loop).
        iters: Sinkhorn steps for ``method="sinkhorn"``, an int >= 1.
        return_info: also return a :class:`ProjectionInfo`.

    Returns:
        ``T`` with the shape and dtype of ``logits``. The solver runs in
        float32 (float64 for float64 input). Newton matrices that miss the
        tolerance raise a :class:`ConvergenceWarning` and are flagged in the
        info; they are never reported as converged.

        ``-inf`` logits are zero entries of ``exp(logits)`` (design.md §2,
        "Zero entries"). Such a matrix is projected on its finite entries:
        ``T`` is exactly 0 where the logit is ``-inf`` and on the finite
        entries that lie on no permutation inside the finite ones (every
        doubly stochastic matrix on that support is 0 there), so finite
        entries on exactly one permutation give that permutation matrix,
        with a zero gradient. Where the finite entries hold no permutation
        (a row or column all ``-inf``, or any ``k`` rows whose finite entries
        lie in fewer than ``k`` columns) no doubly stochastic matrix exists:
        Newton returns NaN with NaN gradients, ``info.error`` ``inf`` and
        ``converged`` False, counts the matrix as unconverged and warns
        (:class:`ConvergenceWarning`; on CUDA also
        :func:`mhc.projection.cuda.unconverged_count`). ``method="sinkhorn"``
        iterates on ``exp(logits)`` with its zeros as they are.

        Matrices holding NaN or ``+inf`` come back as NaN and get NaN
        gradients (``info.error`` NaN). Either way the other matrices, and
        their gradients, are unaffected.

    Raises:
        TypeError: ``logits`` is not a floating tensor of a supported dtype,
            or an option has the wrong type (``bool`` is not an int here).
        ValueError: not ``[..., n, n]`` with ``n >= 1``, or an option is out
            of range (``tol`` NaN, Inf or <= 0; unknown ``method``).
    """
    # The common call (CUDA kernels, plain options) in a few exact type tests that imply every
    # check of check_arguments, then projection_cuda.project_fast's call made inline: at small
    # batches this wrapper's host time is the call's cost, and a Python frame a visible part of it.
    if (
        type(logits) is Tensor
        and method is _NEWTON
        and return_info is False
        and (
            tol is _TOL
            and max_iter is _MAX_ITER
            and iters is _ITERS
            or type(tol) is float
            and 0.0 < tol < math.inf
            and type(max_iter) is int
            and max_iter >= 0
            and type(iters) is int
            and iters >= 1
        )
    ):
        forward = projection_cuda.fast_forward  # None until the extension loads, or when switched off
        if forward is not None and not _is_compiling():  # dynamo traces the op instead
            T = forward(logits, tol, max_iter)  # None where the kernels do not take logits
            if T is not None:
                return T
    check_arguments(logits, tol, max_iter, method, iters, return_info)
    if method == "newton" and logits.is_cuda:
        # Fused kernels for n in {4, 8} and fp32/bf16/fp16 (mhc/projection_cuda.py).
        if projection_cuda.supports(logits) and projection_cuda.available():
            return projection_cuda.project(logits, tol=tol, max_iter=max_iter, return_info=return_info)
    return project_unchecked(
        logits, tol=tol, max_iter=max_iter, method=method, iters=iters, return_info=return_info
    )
