"""The pure-PyTorch Birkhoff projection ``Π_B(exp(R))``: the reference solver.

``T = Π_B(exp(R))`` is the unique doubly stochastic matrix of the form
``T_ij = exp(R_ij + a_i + b_j)`` (design.md §2). This module is the CPU
implementation and the float64 ground truth for the fused CUDA kernels
(:mod:`mhc.projection.cuda`); :func:`mhc.birkhoff_project`
(:mod:`mhc.projection`) chooses between the two. It imports only
:mod:`mhc.projection.common` (checks and reports shared with the CUDA path).

* ``method="newton"`` (default): batched Newton on the (n-1)-dimensional dual
  ``f(b) = Σ_i logsumexp_j(R_ij + b_j) - Σ_j b_j`` with ``b_n = 0``, an Armijo
  line search, and a log-domain Sinkhorn sweep wherever the Newton step fails
  (near-permutation solutions make the Hessian nearly singular). It runs until
  every matrix meets ``tol``; its backward is the implicit-function gradient,
  which needs only ``T`` and is written in differentiable torch ops, so it
  supports double backward.
* ``method="sinkhorn"``: classic fixed-step Sinkhorn-Knopp, differentiated
  through its iterations, kept for comparison with the mHC paper.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import (
    NEWTON_MAX_ITER,
    ProjectionInfo,
    check_arguments,
    compute_dtype,
    effective_tol,
    marginal_error,
    newton_report,
    warn_unconverged,
)

__all__ = [
    "birkhoff_project_reference",
    "project_unchecked",
    "birkhoff_backward",
    "dual_hessian",
    "permutation_support",
]

_ARMIJO_C1 = 1e-4
_MAX_HALVINGS = 30
_MAX_STEP = 24.0  # trust-region radius of a Newton step in log space (kMaxStep in csrc)


# ----------------------------------------------------------------------------
# Dual pieces shared by the Newton solver and the implicit backward.
# ----------------------------------------------------------------------------


def _pad_last(b: Tensor) -> Tensor:
    """``[B, n-1] -> [B, n]`` with ``b_n = 0`` (the dual's gauge)."""
    return torch.nn.functional.pad(b, (0, 1))


def _exclusive_row_sums(T: Tensor) -> Tensor:
    """``Σ_{k≠j} T_ik`` without the cancellation of ``rowsum - T_ij``.

    When ``T_ij`` is close to 1, ``1 - T_ij`` is below the dtype's resolution,
    but the sum of the other entries is not: prefix plus suffix sums keep it.
    """
    zero = T.new_zeros(T.shape[:-1] + (1,))
    before = torch.cat([zero, T.cumsum(-1)[..., :-1]], dim=-1)
    after = torch.cat([T.flip(-1).cumsum(-1)[..., :-1].flip(-1), zero], dim=-1)
    return before + after


def dual_hessian(T: Tensor) -> Tensor:
    """``diag(c) - TᵀT`` restricted to the first n-1 columns: ``[..., n, n] -> [..., n-1, n-1]``.

    The diagonal ``Σ_i T_ij (1 - T_ij)`` is formed from the other entries of
    each row, so it stays accurate as ``T`` approaches a permutation.
    """
    m = T.shape[-1] - 1
    Tm = T[..., :m]
    off = -(Tm.transpose(-1, -2) @ Tm)
    diag = (T * _exclusive_row_sums(T)).sum(-2)[..., :m]
    eye = torch.eye(m, dtype=torch.bool, device=T.device)
    return torch.where(eye, torch.diag_embed(diag), off)


def _spd_solve(H: Tensor, rhs: Tensor, damping: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Solve ``(H + damping·I) x = rhs`` for symmetric PSD ``H [B, m, m]``; returns ``(x, ok)``.

    The Hessian is nearly singular when ``T`` nears a permutation or splits
    into blocks coupled only by entries far below rounding. A ridge of
    ``eps·max(diag)`` (eps of ``H``'s dtype) bounds the step along directions
    that are singular only to rounding, and the factorisation runs in float64
    so that fp32 rounding cannot make the ridged matrix indefinite. Where the
    Cholesky factorisation still fails, a pseudo-inverse drops the directions
    whose eigenvalues are below that rounding level: along them the blocks
    are decoupled to working precision, and ``T`` does not depend on them.
    ``ok`` is False only where the result is not finite (always where ``H``
    or ``rhs`` is not).
    """
    eps = torch.finfo(H.dtype).eps
    H64 = H.double()
    scale = H64.diagonal(dim1=-2, dim2=-1).amax(-1).clamp_min(torch.finfo(H.dtype).tiny)
    rhs64 = rhs.double()
    ridge = eps * scale if damping is None else eps * scale + damping.double()
    eye = torch.eye(H.shape[-1], dtype=torch.float64, device=H.device)
    H64 = H64 + ridge[:, None, None] * eye
    L, info = torch.linalg.cholesky_ex(H64)
    failed = (info != 0).nonzero().squeeze(-1)  # NaN in H makes a pivot NaN, which fails
    if failed.numel():
        # A failed factor holds garbage, which cholesky_solve's backward would carry into the whole
        # batch's gradient (0·NaN under double backward): those matrices are factored as the identity,
        # and their x comes from the pseudo-inverse below.
        L, _ = torch.linalg.cholesky_ex(torch.where((info != 0)[:, None, None], eye, H64))
    x = torch.cholesky_solve(rhs64.unsqueeze(-1), L).squeeze(-1)
    if failed.numel():
        H_failed = H64[failed]
        # eigh raises for the whole batch on one non-finite matrix (a NaN/Inf
        # T): it gets the identity, and its x is NaN.
        finite = H_failed.isfinite().flatten(1).all(-1)
        evals, evecs = torch.linalg.eigh(torch.where(finite[:, None, None], H_failed, eye))
        cutoff = (H.shape[-1] * eps * scale[failed]).unsqueeze(-1)
        inv = torch.where(evals > cutoff, 1.0 / evals, torch.zeros_like(evals))
        coords = (evecs.transpose(-1, -2) @ rhs64[failed].unsqueeze(-1)).squeeze(-1)
        fallback = torch.where(finite[:, None], (evecs @ (inv * coords).unsqueeze(-1)).squeeze(-1), math.nan)
        # Out of place: cholesky_solve's backward (double backward) needs x as it was.
        x = x.index_put((failed,), fallback)
    x = x.to(H.dtype)
    return x, x.isfinite().all(-1)


# ----------------------------------------------------------------------------
# Newton solver.
# ----------------------------------------------------------------------------


def _sinkhorn_sweep(L: Tensor) -> Tensor:
    """One log-domain Sinkhorn step: normalise the columns of ``exp(L)``, then its rows.

    Coordinate descent on the dual: it never stalls, however close ``T`` is
    to a permutation, and in logs an all-underflowed column still moves.
    """
    return torch.log_softmax(L - torch.logsumexp(L, dim=-2, keepdim=True), dim=-1)


def _newton_step(L: Tensor, T: Tensor) -> Tensor:
    """One globalised Newton step for every log-plan ``L`` of the batch.

    The dual variable is folded into ``L`` after every step, so the step
    starts from ``b = 0``, ``f(0) = 0``, and the logits the solver adds to are
    ``log T`` itself: small where ``T`` is not, which keeps the fp32 rounding
    of ``L + b`` near ``eps`` instead of ``eps·|R|``.
    """
    n = L.shape[-1]
    g = T.sum(-2)[:, : n - 1] - 1
    H = dual_hessian(T)
    d, ok = _spd_solve(H, -g)
    # Trust region in log space: near a permutation the Hessian is singular up
    # to its ridge and the raw step can be ~1e7, all of it along the null
    # space, where f(L + t·d) is rounding noise. There take the
    # Levenberg-Marquardt step (H + λI) d = -g with λ = ‖g‖/Δ, so ‖d‖ ≤ Δ.
    long = (d.abs().amax(-1) > _MAX_STEP).nonzero().squeeze(-1)
    if long.numel():
        damping = g[long].norm(dim=-1) / _MAX_STEP
        d[long], ok[long] = _spd_solve(H[long], -g[long], damping=damping)
    slope = (g * d).sum(-1)
    ok &= slope < 0
    d = _pad_last(d)
    # f is near 0 here, so its rounding is a few eps per row; without this
    # slack the quadratic finish would be rejected as "no descent".
    slack = 8 * n * torch.finfo(L.dtype).eps

    new_L = L.clone()
    pending = ok.nonzero().squeeze(-1)
    t = 1.0
    for _ in range(_MAX_HALVINGS):
        if pending.numel() == 0:
            break
        trial = L[pending] + t * d[pending].unsqueeze(-2)
        lse = torch.logsumexp(trial, dim=-1, keepdim=True)
        f1 = lse.squeeze(-1).sum(-1) - t * d[pending].sum(-1)
        accept = f1 <= _ARMIJO_C1 * t * slope[pending] + slack
        new_L[pending[accept]] = (trial - lse)[accept]
        pending = pending[~accept]
        t *= 0.5

    failed = torch.cat([(~ok).nonzero().squeeze(-1), pending])
    if failed.numel():
        new_L[failed] = _sinkhorn_sweep(L[failed])
    return new_L


def _solve_newton(R: Tensor, tol: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor]:
    """Project finite ``R [B, n, n]``; returns ``(T, iterations, error)``."""
    B = R.shape[0]
    T_out = torch.empty_like(R)
    iterations = torch.zeros(B, dtype=torch.int32, device=R.device)
    error = torch.empty(B, dtype=torch.float64, device=R.device)

    active = torch.arange(B, device=R.device)
    L = _sinkhorn_sweep(torch.log_softmax(R, dim=-1))
    for step in range(max_iter + 1):
        T = L.exp()
        err = marginal_error(T)
        done = err <= tol
        if step == max_iter:
            done = torch.ones_like(done)
        finished = active[done]
        T_out[finished] = T[done]
        error[finished] = err[done]
        keep = ~done
        active, L, T = active[keep], L[keep], T[keep]
        if active.numel() == 0:
            break
        iterations[active] += 1
        L = _newton_step(L, T)
    return T_out, iterations, error


# ----------------------------------------------------------------------------
# Autograd: the implicit-function backward.
# ----------------------------------------------------------------------------


def _row_centred(T: Tensor, X: Tensor) -> Tensor:
    """``X_ij - Σ_k T_ik X_ik`` evaluated as ``Σ_{k≠j} T_ik (X_ij - X_ik)``.

    Equal when rows of ``T`` sum to one, but this form never subtracts two
    large numbers: near a permutation, ``X`` can be huge (``w`` along a nearly
    singular Hessian direction) while the result is tiny, and the plain form
    would leave rounding noise of ``eps·|X|`` on entries where ``T ≈ 1``.
    """
    return X * _exclusive_row_sums(T) - _exclusive_row_sums(T * X)


def birkhoff_backward(T: Tensor, grad_T: Tensor) -> Tensor:
    """``∂L/∂R`` from ``T`` and ``G = ∂L/∂T`` alone (design.md §2).

    With ``w`` from ``Δ w = μ_c - Tᵀμ_r`` (``Δ`` the dual Hessian, ``w_n = 0``)
    the gradient is ``T ∘ (G - v1ᵀ - 1wᵀ)`` with ``v = μ_r - Tw``; both the
    right-hand side and the gradient are formed by :func:`_row_centred`.

    Written in differentiable torch ops: called with grad mode on (as
    autograd does under ``create_graph=True``) it records its own graph, which
    is what double backward of the Newton projection differentiates.

    Args:
        T: ``[B, n, n]`` the projection's output, in compute precision.
        grad_T: ``[B, n, n]`` same dtype as ``T``.

    Returns:
        ``[B, n, n]`` gradient with respect to the logits. A matrix whose
        ``T`` or ``grad_T`` holds NaN or Inf gets a non-finite gradient (NaN
        for NaN); the other matrices of the batch are unaffected.
    """
    n = T.shape[-1]
    if n == 1:
        return torch.zeros_like(T)
    rhs = (T * _row_centred(T, grad_T)).sum(-2)[:, : n - 1]
    w, _ = _spd_solve(dual_hessian(T), rhs)
    # Where even the ridged Hessian fails on finite data, T is a permutation
    # to rounding and ∂T/∂R is 0 there; any w gives that, so take w = 0. A
    # non-finite right-hand side (NaN/Inf in T or grad_T) keeps a NaN in w,
    # which makes the whole matrix's gradient NaN, not a finite wrong value.
    w = _pad_last(torch.where(w.isfinite(), w, 0 * rhs))  # 0 * rhs: 0, or NaN where rhs is not finite
    return T * _row_centred(T, grad_T - w.unsqueeze(-2))


# The Newton solve is one opaque custom op, so torch.compile (fullgraph too)
# traces around it: its loop, the per-matrix bookkeeping and the convergence
# warning all depend on the data and run eagerly inside the op.
@torch.library.custom_op("mhc::birkhoff_reference", mutates_args=())
def _newton_op(R: Tensor, tol: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(T, iterations, error)`` for ``R [B, n, n]``, B >= 1, float32 or float64."""
    T, iterations, error = _solve_finite(R, tol, max_iter)
    warn_unconverged(error, tol, max_iter)
    return T, iterations, error


@_newton_op.register_fake
def _newton_op_fake(R: Tensor, tol: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor]:
    B = R.shape[0]
    return torch.empty_like(R), R.new_empty(B, dtype=torch.int32), R.new_empty(B, dtype=torch.float64)


def _newton_op_setup(ctx, inputs, output) -> None:
    # T is saved as this node's output, so under create_graph=True the graph
    # birkhoff_backward records leads back to R through this node.
    ctx.save_for_backward(output[0])


def _newton_op_backward(ctx, grad_T, _grad_iterations, _grad_error):
    (T,) = ctx.saved_tensors
    if grad_T is None:
        return None, None, None
    grad_T = grad_T.to(T.dtype)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # create_graph=True: differentiable ops, so double backward goes through them
        return birkhoff_backward(T, grad_T), None, None
    return _backward_op(T, grad_T), None, None


# The backward's ridged solve picks failed matrices by data (nonzero), so it is
# opaque to compiled graphs too.
@torch.library.custom_op("mhc::birkhoff_reference_backward", mutates_args=())
def _backward_op(T: Tensor, grad_T: Tensor) -> Tensor:
    """:func:`birkhoff_backward` as one op, for backward passes that record no graph."""
    return birkhoff_backward(T, grad_T)


@_backward_op.register_fake
def _backward_op_fake(T: Tensor, grad_T: Tensor) -> Tensor:
    return torch.empty_like(T)


_newton_op.register_autograd(_newton_op_backward, setup_context=_newton_op_setup)


def _solve_finite(R: Tensor, tol: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor]:
    """Run the solver on the matrices of ``R [B, n, n]`` that have a projection; the rest become NaN.

    All-finite matrices are solved as they are (and alone, so their bits do not
    depend on the rest of the batch). A matrix with ``-inf`` entries (zeros of
    ``exp(R)``) and no NaN or ``+inf`` is solved on the entries that lie on a
    permutation inside its finite ones (:func:`permutation_support`; the others
    are set to ``-inf``: they are zero in every doubly stochastic matrix on that
    support), or, where its finite entries hold no permutation, comes back NaN
    with error ``inf`` (unconverged). NaN or ``+inf`` anywhere: NaN, error NaN.
    """
    B = R.shape[0]
    finite = R.isfinite().all(-1).all(-1)
    if bool(finite.all()):
        return _solve_newton(R, tol, max_iter)
    T = torch.full_like(R, math.nan)
    iterations = torch.zeros(B, dtype=torch.int32, device=R.device)
    error = torch.full((B,), math.nan, dtype=torch.float64, device=R.device)
    idx = finite.nonzero().squeeze(-1)
    if idx.numel():
        T[idx], iterations[idx], error[idx] = _solve_newton(R[idx], tol, max_iter)
    # -inf entries and nothing worse (R < inf is False for NaN and +inf).
    zeros = (~finite & (R < math.inf).all(-1).all(-1)).nonzero().squeeze(-1)
    if zeros.numel():
        allowed = permutation_support(R[zeros] > -math.inf)
        feasible = allowed.any(-1).any(-1)
        error[zeros[~feasible]] = math.inf
        solve = zeros[feasible]
        if solve.numel():
            pruned = R[solve].masked_fill(~allowed[feasible], -math.inf)
            T[solve], iterations[solve], error[solve] = _solve_newton(pruned, tol, max_iter)
    return T, iterations, error


def permutation_support(support: Tensor) -> Tensor:
    """The entries of ``support`` that lie on a permutation inside it: ``[K, n, n]`` bool -> ``[K, n, n]`` bool.

    ``support`` marks the finite logits of each matrix (the nonzero entries of
    ``exp(R)``). A doubly stochastic matrix on that support is a convex
    combination of the permutation matrices inside it (Birkhoff-von Neumann), so
    its support is at most the union of those permutations, and the projection's
    support is exactly that union: every other entry is 0 whatever its logit.
    On the union the projection is an ordinary diagonal scaling
    ``T_ij = exp(R_ij + a_i + b_j)`` with finite ``a, b`` (the union has total
    support), which the Newton solver finds; on the full support the potentials
    would diverge. A matrix whose support holds no permutation at all (a row or
    column without a finite entry, or any set of k rows whose finite entries
    lie in fewer than k columns) has no doubly stochastic matrix on it: its
    result is all False.

    Per distinct pattern, in Python on the CPU: a maximum matching by
    augmenting paths; entry ``(i, j)`` off the matching, with ``j`` matched to
    row ``i'``, lies on a permutation iff row ``i'`` reaches row ``i`` in the
    graph with an edge ``a -> b`` where row ``a`` has a finite entry in the
    column matched to row ``b`` (an alternating cycle through ``(i, j)``).
    Only matrices with ``-inf`` entries come here, so the common (dense) batch
    never pays for it.
    """
    K, n = support.shape[0], support.shape[-1]
    if K == 0:
        return support.clone()
    patterns, inverse = torch.unique(support.reshape(K, n * n).cpu(), dim=0, return_inverse=True)
    allowed = torch.zeros(patterns.shape[0], n, n, dtype=torch.bool)
    for p, pattern in enumerate(patterns.reshape(-1, n, n).tolist()):
        union = _permutation_union(pattern)
        if union is not None:
            allowed[p] = torch.tensor(union, dtype=torch.bool)
    return allowed[inverse].to(support.device)


def _permutation_union(rows: list[list[bool]]) -> list[list[bool]] | None:
    """:func:`permutation_support` of one ``n x n`` pattern (lists of bools), or ``None`` without a permutation."""
    n = len(rows)
    columns = [[j for j in range(n) if rows[i][j]] for i in range(n)]
    col_of, row_of = [-1] * n, [-1] * n
    for root in range(n):  # augmenting path from each row in turn (breadth first)
        prev = [-1] * n  # column -> the row that reached it
        seen, queue, free = [False] * n, [root], -1
        for i in queue:
            for j in columns[i]:
                if not seen[j]:
                    seen[j], prev[j] = True, i
                    if row_of[j] < 0:
                        free = j
                        break
                    queue.append(row_of[j])
            if free >= 0:
                break
        if free < 0:
            return None  # Hall's condition fails: no perfect matching
        j = free
        while j >= 0:  # flip the path back to the root
            i = prev[j]
            j_next = col_of[i]
            col_of[i], row_of[j] = j, i
            j = j_next
    # reach[a]: bitmask of the rows reachable from row a (edges a -> row_of[j] for each finite (a, j)).
    reach = [sum(1 << row_of[j] for j in columns[a]) for a in range(n)]
    for k in range(n):  # transitive closure (Warshall)
        bit = 1 << k
        for a in range(n):
            if reach[a] & bit:
                reach[a] |= reach[k]
    return [
        [rows[i][j] and (row_of[j] == i or bool(reach[row_of[j]] >> i & 1)) for j in range(n)]
        for i in range(n)
    ]


def _sinkhorn(R: Tensor, iters: int) -> Tensor:
    """Classic Sinkhorn-Knopp: ``iters`` row-then-column normalisations of ``exp(R)``, in logs."""
    log_T = R
    for _ in range(iters):
        log_T = log_T - torch.logsumexp(log_T, dim=-1, keepdim=True)
        log_T = log_T - torch.logsumexp(log_T, dim=-2, keepdim=True)
    return log_T.exp()


# ----------------------------------------------------------------------------
# Public entry point.
# ----------------------------------------------------------------------------


def birkhoff_project_reference(
    logits: Tensor,
    *,
    tol: float = 1e-6,
    max_iter: int = NEWTON_MAX_ITER,
    method: str = "newton",
    iters: int = 20,
    return_info: bool = False,
) -> Tensor | tuple[Tensor, ProjectionInfo]:
    """:func:`mhc.birkhoff_project` on the pure-PyTorch path, whatever the device.

    The reference the CUDA kernels are tested against: same arguments,
    checks, results and autograd (double backward included) as
    :func:`mhc.birkhoff_project`, but CUDA tensors never reach the fused kernels.
    """
    check_arguments(logits, tol, max_iter, method, iters, return_info)
    return project_unchecked(
        logits, tol=tol, max_iter=max_iter, method=method, iters=iters, return_info=return_info
    )


def project_unchecked(
    logits: Tensor, *, tol: float, max_iter: int, method: str, iters: int, return_info: bool
) -> Tensor | tuple[Tensor, ProjectionInfo]:
    """:func:`birkhoff_project_reference` for arguments :func:`check_arguments` has passed.

    For :func:`mhc.birkhoff_project`, which checks once and then picks a path;
    anyone else: call :func:`birkhoff_project_reference`.
    """
    shape, n = logits.shape, logits.shape[-1]
    R = logits.to(compute_dtype(logits.dtype)).reshape(-1, n, n)
    tol = effective_tol(tol, n, logits.dtype)

    if method == "sinkhorn":
        # NaN or +inf anywhere (R < inf is False there): NaN. -inf entries are zeros of exp(R) that the
        # iteration keeps; a row or column of them comes back NaN by itself (0/0).
        valid = (R < math.inf).all(-1, keepdim=True).all(-2, keepdim=True)
        # A product, not torch.where: a NaN matrix's gradient is NaN too
        # (where would hand it zeros), and the others are multiplied by 1.
        T = _sinkhorn(R, iters) * torch.where(valid, 1.0, math.nan).to(R.dtype)
        info = None
        if return_info:
            error = marginal_error(T).detach()
            info = ProjectionInfo(
                iterations=torch.full_like(error, iters, dtype=torch.int32).reshape(shape[:-2]),
                error=error.reshape(shape[:-2]),
                converged=(error <= tol).reshape(shape[:-2]),
                tol=tol,
            )
    else:
        if R.shape[0] == 0:
            T = R.clone()
            iterations = torch.zeros(0, dtype=torch.int32, device=R.device)
            error = torch.zeros(0, dtype=torch.float64, device=R.device)
        else:
            T, iterations, error = _newton_op(R, tol, max_iter)
        # the op itself warned about missed tolerances, at run time also under torch.compile
        info = (
            newton_report(iterations, error, tol, max_iter, shape[:-2], warn=False) if return_info else None
        )

    T = T.reshape(shape).to(logits.dtype)
    return (T, info) if return_info else T
