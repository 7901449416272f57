"""What both Birkhoff projection paths share: argument checks, tolerances and the solver report.

:mod:`mhc.projection.reference` (the PyTorch solver) and
:mod:`mhc.projection.cuda` (the CUDA op) check, round and report the same
way through this module; :mod:`mhc.projection` re-exports its public names.
It imports no other ``mhc`` module.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.autograd import forward_ad

__all__ = [
    "METHODS",
    "NEWTON_MAX_ITER",
    "ConvergenceWarning",
    "ProjectionInfo",
    "check_arguments",
    "compute_dtype",
    "effective_tol",
    "is_traced",
    "marginal_error",
    "newton_report",
    "warn_unconverged",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
METHODS = ("newton", "sinkhorn")
NEWTON_MAX_ITER = 100  # birkhoff_project's default iteration cap (the fused site uses it too)


def is_traced(t: Tensor) -> bool:
    """Whether ``t`` is a tensor of a trace, with no data: a fake or functional tensor.

    What ``torch.compile`` hands an op's fake impl (its fake pass) and a
    ``triton_op``'s body (AOTAutograd's functionalisation). Such code must
    record ops, not read addresses or launch kernels. ``torch.compiler.is_compiling()``
    does not tell: on torch 2.11 it is ``False`` inside a fake impl that dynamo calls.
    """
    return isinstance(t, (FakeTensor, FunctionalTensor))


class ConvergenceWarning(RuntimeWarning):
    """Some matrices did not reach the requested tolerance."""


@dataclass
class ProjectionInfo:
    """Per-matrix solver report, returned by ``birkhoff_project(..., return_info=True)``.

    Attributes:
        iterations: ``[...]`` int32, solver steps each matrix took.
        error: ``[...]`` float64, ``‖T1-1‖₁ + ‖Tᵀ1-1‖₁`` of the compute-precision
            result; NaN for input holding NaN or ``+inf`` (and for finite
            logits whose spread overflows the compute dtype, ~3e38 in
            float32); ``inf`` where the finite logits hold no permutation, so
            that no doubly stochastic matrix lives on them (``-inf`` logits
            are zeros of ``exp(R)``; such a matrix comes back NaN).
        converged: ``[...]`` bool, whether the matrix met the tolerance.
        tol: the tolerance actually enforced (``tol`` raised to the rounding
            floor of the compute dtype, see :func:`birkhoff_project`).
    """

    iterations: Tensor
    error: Tensor
    converged: Tensor
    tol: float

    @property
    def num_unconverged(self) -> int:
        """Matrices that missed the tolerance: after ``max_iter``, or with no projection at all (``error`` inf)."""
        return int((~self.converged & ~self.error.isnan()).sum())

    @property
    def num_nonfinite(self) -> int:
        """Matrices returned as NaN because their input held NaN or ``+inf`` (or overflowed, see ``error``)."""
        return int(self.error.isnan().sum())


def marginal_error(T: Tensor) -> Tensor:
    """``‖T1 - 1‖₁ + ‖Tᵀ1 - 1‖₁`` per matrix, computed in float64.

    Args:
        T: ``[..., n, n]`` any floating dtype.

    Returns:
        ``[...]`` float64.

    Raises:
        TypeError: ``T`` is not a floating-point tensor.
        ValueError: ``T`` is not ``[..., n, n]``.
    """
    if not isinstance(T, Tensor):
        raise TypeError(f"marginal_error expects a torch.Tensor, got {type(T).__name__}")
    if not T.is_floating_point():
        raise TypeError(f"marginal_error expects a floating-point tensor, got {T.dtype}")
    if T.dim() < 2 or T.shape[-1] != T.shape[-2]:
        raise ValueError(f"marginal_error expects square matrices [..., n, n], got {tuple(T.shape)}")
    T = T.double()
    return (T.sum(-1) - 1).abs().sum(-1) + (T.sum(-2) - 1).abs().sum(-1)


def check_arguments(logits, tol, max_iter, method, iters, return_info) -> None:
    """Check ``birkhoff_project``'s arguments: ``TypeError``/``ValueError`` naming the bad one.

    Rejects option values that would otherwise be coerced or ignored without a word.
    """
    if not isinstance(logits, Tensor):
        raise TypeError(f"birkhoff_project expects a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"birkhoff_project supports float16, bfloat16, float32 and float64 logits, got {logits.dtype}"
        )
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(
            f"birkhoff_project expects square matrices of shape [..., n, n], got {tuple(logits.shape)}"
        )
    if logits.shape[-1] < 1:
        raise ValueError("birkhoff_project needs n >= 1, got 0x0 matrices")
    if not isinstance(tol, numbers.Real) or isinstance(tol, bool):
        raise TypeError(f"birkhoff_project: tol must be a real number, got {type(tol).__name__} {tol!r}")
    # Comparisons only (False for NaN): torch.compile traces a float that changed between calls (a
    # block's tol set anew, dynamic=True) as a symbol, which math.isfinite cannot take.
    if not 0 < tol < math.inf:
        raise ValueError(f"birkhoff_project: tol must be finite and > 0, got {float(tol)!r}")
    if not _is_int(max_iter):
        raise TypeError(
            f"birkhoff_project: max_iter must be an int, got {type(max_iter).__name__} {max_iter!r}"
        )
    if max_iter < 0:
        # 0 is allowed: the initial Sinkhorn sweep only, reported honestly as unconverged.
        raise ValueError(f"birkhoff_project: max_iter must be >= 0, got {max_iter}")
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"birkhoff_project: method must be one of {METHODS}, got {method!r}")
    if not _is_int(iters):
        raise TypeError(f"birkhoff_project: iters must be an int, got {type(iters).__name__} {iters!r}")
    if iters < 1:
        raise ValueError(f"birkhoff_project: iters must be >= 1, got {iters}")
    if not isinstance(return_info, bool):
        raise TypeError(f"birkhoff_project: return_info must be a bool, got {type(return_info).__name__}")
    # Newton's op has a reverse-mode backward only; a forward-mode tangent would come back as zero.
    if (
        method == "newton"
        and not torch.compiler.is_compiling()
        and forward_ad.unpack_dual(logits).tangent is not None
    ):
        raise NotImplementedError(
            "birkhoff_project: method='newton' has no forward-mode derivative (torch.func.jvp, jacfwd, "
            "hessian, torch.autograd.forward_ad); use torch.autograd's reverse mode (backward(), "
            "torch.autograd.grad, double backward included), or method='sinkhorn', whose plain ops take "
            "every transform"
        )


def _is_int(value) -> bool:
    return isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the solver runs in for ``dtype`` logits: float64 stays, the rest use float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def effective_tol(tol: float, n: int, dtype: torch.dtype) -> float:
    """``tol`` raised to what a ``dtype`` matrix can represent.

    Each of the 2n marginals of a rounded matrix carries a few ``eps`` of
    rounding (its n entries, and the exponent each came from), so no solver
    can promise less than ``4·n·eps`` in that dtype.
    """
    return max(float(tol), 4 * n * torch.finfo(compute_dtype(dtype)).eps)


def warn_unconverged(error: Tensor, tol: float, max_iter: int) -> int:
    """Warn (:class:`ConvergenceWarning`) if matrices missed ``tol``; returns how many did.

    ``error`` is a flat ``[B]`` float64 of marginal errors: NaN for NaN or
    ``+inf`` input, which is not counted (those matrices come back as NaN), and
    ``inf`` for a matrix whose finite entries hold no permutation, which is
    (it has no projection; the warning says so).
    """
    unconverged = int(((error > tol) & ~error.isnan()).sum())
    if unconverged:
        infeasible = int(error.isinf().sum())
        missed = unconverged - infeasible
        parts = []
        if missed:
            worst = float(torch.where(error.isfinite(), error, 0).max())
            parts.append(f"{missed} missed tol={tol:.1e} after max_iter={max_iter} (worst error {worst:.2e})")
        if infeasible:
            parts.append(
                f"{infeasible} have no doubly stochastic matrix on their finite entries (their -inf logits leave "
                "no permutation) and came back NaN"
            )
        warnings.warn(
            f"birkhoff_project: of {error.numel()} matrices, {'; '.join(parts)}; use return_info=True to find them",
            ConvergenceWarning,
            stacklevel=2,
        )
    return unconverged


def newton_report(
    iterations: Tensor,
    error: Tensor,
    tol: float,
    max_iter: int,
    batch_shape: torch.Size,
    *,
    warn: bool = True,
) -> ProjectionInfo:
    """Build the :class:`ProjectionInfo` of a Newton solve (``iterations``, ``error``: flat ``[B]``).

    Shared by the PyTorch and CUDA paths, so both report the same way. With
    ``warn`` (the default) it also warns about missed tolerances
    (:func:`warn_unconverged`); the reference op has warned already.
    """
    if warn:
        warn_unconverged(error, tol, max_iter)
    error = error.detach()  # a report: the op's backward gives it no gradient, so it takes none
    converged = error <= tol
    return ProjectionInfo(
        iterations=iterations.reshape(batch_shape),
        error=error.reshape(batch_shape),
        converged=converged.reshape(batch_shape),
        tol=tol,
    )
