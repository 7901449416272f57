"""The pure-PyTorch Birkhoff projection: accuracy, gradients, bad input."""

import contextlib
import math
import warnings

import mpmath
import pytest
import torch

from mhc import ConvergenceWarning, MHCBlock, birkhoff_project, marginal_error
from mhc.projection import NEWTON_MAX_ITER, birkhoff_backward, birkhoff_project_reference

DISTRIBUTIONS = {
    "normal1": lambda shape, g: torch.randn(shape, generator=g),
    "uniform1": lambda shape, g: torch.rand(shape, generator=g) * 2 - 1,
    "normal10": lambda shape, g: 10 * torch.randn(shape, generator=g),
    "uniform10": lambda shape, g: torch.rand(shape, generator=g) * 20 - 10,
    "normal30": lambda shape, g: 30 * torch.randn(shape, generator=g),
}


def fresh_generator() -> torch.Generator:
    # A new seed per run: the solver must be right on any input, not on one draw.
    g = torch.Generator()
    g.seed()
    return g


def seed_of(g: torch.Generator) -> str:
    return f"seed {g.initial_seed()}"


@contextlib.contextmanager
def reraise_with(note: str):
    """Prefix ``note`` (the seed) to an assertion or gradcheck error raised inside."""
    try:
        yield
    except (AssertionError, RuntimeError) as exc:
        raise AssertionError(f"{note}: {exc}") from exc


def project_quietly(R, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        return birkhoff_project(R, return_info=True, **kw)


TARGET_CASES = [
    (4, "normal1"),
    (4, "uniform1"),
    (4, "normal10"),
    (4, "uniform10"),
    (8, "normal1"),
    (8, "normal10"),
]


# 100k fresh matrices per case in the default tier; the target's 1M per distribution (notes/benchmarks.md) in the
# slow tier (50 s for n=8, N(0,10²) on 2 CPU cores).
@pytest.mark.parametrize(
    "n,dist,count",
    [(n, dist, 100_000) for n, dist in TARGET_CASES]
    + [pytest.param(n, dist, 1_000_000, marks=pytest.mark.slow) for n, dist in TARGET_CASES],
)
def test_newton_max_marginal_error(n, dist, count):
    g = fresh_generator()
    R = DISTRIBUTIONS[dist]((count, n, n), g)
    T, info = project_quietly(R)
    err = marginal_error(T)
    assert T.dtype == torch.float32
    assert err.max().item() <= 1e-5, f"seed {g.initial_seed()}: max error {err.max().item():.3e}"
    assert bool(info.converged.all()) and info.num_unconverged == 0, seed_of(g)
    assert (T >= 0).all(), seed_of(g)


@pytest.mark.parametrize("n,count", [(4, 200_000), (8, 100_000)])
def test_newton_beyond_the_target_range(n, count):
    """N(0,30²): a matrix that misses tol in fp32 must be flagged, never hidden (none has been seen)."""
    g = fresh_generator()
    R = DISTRIBUTIONS["normal30"]((count, n, n), g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        T, info = birkhoff_project(R, return_info=True)
    err = marginal_error(T)
    torch.testing.assert_close(info.error, err, msg=lambda m: f"{seed_of(g)}: {m}")
    assert err[info.converged].max().item() <= 1e-5, seed_of(g)
    assert (err[~info.converged] > info.tol).all(), seed_of(g)
    assert info.num_unconverged <= 2, f"seed {g.initial_seed()}: {info.num_unconverged} unconverged"


def test_solution_is_the_kl_projection():
    """T must be diag(e^a) exp(R) diag(e^b), not just any doubly stochastic matrix."""
    g = fresh_generator()
    R = 5 * torch.randn(2000, 5, 5, generator=g, dtype=torch.float64)
    T = birkhoff_project(R, tol=1e-13)
    D = T.log() - R  # must equal a_i + b_j: zero after double centring
    centred = D - D.mean(-1, keepdim=True) - D.mean(-2, keepdim=True) + D.mean((-2, -1), keepdim=True)
    assert centred.abs().max().item() < 1e-9, seed_of(g)
    assert marginal_error(T).max().item() < 1e-12, seed_of(g)


def test_float64_stays_float64_and_reaches_tight_tol():
    g = fresh_generator()
    R = 10 * torch.randn(20000, 4, 4, generator=g, dtype=torch.float64)
    T, info = project_quietly(R, tol=1e-12)
    assert T.dtype == torch.float64
    assert marginal_error(T).max().item() <= 1e-12, seed_of(g)


def test_near_permutation_solutions():
    g = fresh_generator()
    n = 6
    perms = torch.stack([torch.eye(n)[torch.randperm(n, generator=g)] for _ in range(500)])
    R = 60 * perms + torch.randn(500, n, n, generator=g)
    T, _ = project_quietly(R)
    assert marginal_error(T).max().item() <= 1e-5, seed_of(g)
    assert (T - perms).abs().max().item() < 1e-6, seed_of(g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    g = fresh_generator()
    R = (3 * torch.randn(4096, 4, 4, generator=g)).to(dtype)
    T = birkhoff_project(R)
    assert T.dtype == dtype
    ref = birkhoff_project(R.double(), tol=1e-12)
    # Exact solve of the same (rounded) logits; only the output rounding differs.
    assert (T.double() - ref).abs().max().item() <= torch.finfo(dtype).eps, seed_of(g)
    assert marginal_error(T).max().item() <= 8 * 2 * 4 * torch.finfo(dtype).eps, seed_of(g)


def test_batch_shapes_and_noncontiguous():
    g = fresh_generator()
    base = torch.randn(3, 5, 4, 4, generator=g) * 4
    T = birkhoff_project(base)
    assert T.shape == base.shape
    single = birkhoff_project(base[1, 2])
    assert single.shape == (4, 4)
    msg = lambda m: f"{seed_of(g)}: {m}"  # noqa: E731
    torch.testing.assert_close(single, T[1, 2], rtol=0, atol=1e-6, msg=msg)

    transposed = base.transpose(-1, -2)  # non-contiguous view
    assert not transposed.is_contiguous()
    torch.testing.assert_close(
        birkhoff_project(transposed), birkhoff_project(transposed.contiguous()), msg=msg
    )
    strided = base[:, ::2]
    torch.testing.assert_close(birkhoff_project(strided), T[:, ::2], rtol=0, atol=1e-6, msg=msg)


def test_empty_batch_and_n_equal_one():
    empty = torch.empty(0, 4, 4)
    out = birkhoff_project(empty)
    assert out.shape == (0, 4, 4)
    ones = birkhoff_project(torch.randn(7, 1, 1))
    assert torch.equal(ones, torch.ones(7, 1, 1))


@pytest.mark.parametrize(
    "bad,exc",
    [
        (torch.randn(4), ValueError),
        (torch.randn(3, 4, 5), ValueError),
        (torch.randn(2, 0, 0), ValueError),
        (torch.randint(0, 3, (2, 4, 4)), TypeError),
        (torch.randn(2, 4, 4, dtype=torch.complex64), TypeError),
        ([[1.0, 2.0], [3.0, 4.0]], TypeError),
    ],
)
def test_bad_input_raises(bad, exc):
    with pytest.raises(exc):
        birkhoff_project(bad)


BAD_OPTIONS = [
    ({"tol": math.nan}, ValueError, "tol"),
    ({"tol": math.inf}, ValueError, "tol"),
    ({"tol": -math.inf}, ValueError, "tol"),
    ({"tol": 0.0}, ValueError, "tol"),
    ({"tol": -1e-6}, ValueError, "tol"),
    ({"tol": True}, TypeError, "tol"),
    ({"tol": "1e-6"}, TypeError, "tol"),
    ({"tol": None}, TypeError, "tol"),
    ({"tol": torch.tensor(1e-6)}, TypeError, "tol"),
    ({"max_iter": True}, TypeError, "max_iter"),
    ({"max_iter": 10.0}, TypeError, "max_iter"),
    ({"max_iter": "10"}, TypeError, "max_iter"),
    ({"max_iter": -1}, ValueError, "max_iter"),
    ({"iters": False}, TypeError, "iters"),
    ({"iters": 2.5}, TypeError, "iters"),
    ({"iters": 0}, ValueError, "iters"),
    ({"iters": -3, "method": "sinkhorn"}, ValueError, "iters"),
    ({"method": "bogus"}, ValueError, "method"),
    ({"method": "Newton"}, ValueError, "method"),
    ({"method": None}, ValueError, "method"),
    ({"return_info": 1}, TypeError, "return_info"),
    ({"tols": 1e-6}, TypeError, "tols"),
    ({"max_iters": 5}, TypeError, "max_iters"),
]


@pytest.mark.parametrize("project", [birkhoff_project, birkhoff_project_reference])
@pytest.mark.parametrize("options,exc,name", BAD_OPTIONS)
def test_bad_options_raise_naming_the_option(project, options, exc, name):
    with pytest.raises(exc, match=name):
        project(torch.randn(4, 4), **options)


def test_valid_option_edge_cases_are_accepted():
    R = torch.randn(8, 4, 4)
    with pytest.warns(ConvergenceWarning):
        _, info = birkhoff_project(5 * R, max_iter=0, return_info=True)  # the initial sweep only
    assert (info.iterations == 0).all() and info.num_unconverged > 0
    assert marginal_error(birkhoff_project(R, tol=1)).max() <= 1  # an int tolerance is a real number
    T, info = birkhoff_project(R, method="sinkhorn", iters=1, return_info=True)
    assert (info.iterations == 1).all() and T.shape == R.shape


@pytest.mark.parametrize("method", ["newton", "sinkhorn"])
def test_info_is_a_report_outside_the_graph(method):
    """info.error takes no gradient on either method (Newton's op gives it none: attached, a penalty on it
    would get a silent zero gradient and keep the step's graph alive)."""
    R = torch.randn(3, 4, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        _, info = birkhoff_project(5 * R, method=method, max_iter=0, iters=1, return_info=True)
    assert not info.error.requires_grad and info.error.grad_fn is None


@pytest.mark.parametrize("method", ["newton", "sinkhorn"])
def test_reference_entry_point_is_the_cpu_path(method):
    g = fresh_generator()
    R = 4 * torch.randn(2, 3, 4, 4, generator=g, requires_grad=True)
    G = torch.randn(2, 3, 4, 4, generator=g)
    T, info = birkhoff_project(R, method=method, return_info=True)
    (dR,) = torch.autograd.grad(T, R, G)
    T_ref, info_ref = birkhoff_project_reference(R, method=method, return_info=True)
    (dR_ref,) = torch.autograd.grad(T_ref, R, G)
    assert torch.equal(T, T_ref) and torch.equal(dR, dR_ref), seed_of(g)
    assert torch.equal(info.iterations, info_ref.iterations) and torch.equal(info.error, info_ref.error)


def test_cpu_input_never_builds_the_cuda_extension(monkeypatch):
    """The hot path's first call on a CPU tensor must not try to compile or load the kernels."""
    from mhc import _ext
    from mhc.projection import cuda as projection_cuda

    def no_build():
        raise AssertionError("the CUDA extension was asked for by a CPU call")

    monkeypatch.setattr(projection_cuda, "fast_forward", None)
    monkeypatch.setattr(projection_cuda, "available", no_build)
    monkeypatch.setattr(_ext, "extension", no_build)
    monkeypatch.setattr(_ext.build, "load", no_build)
    R = torch.randn(8, 4, 4, generator=fresh_generator())
    assert torch.equal(birkhoff_project(R), birkhoff_project_reference(R))


def test_hot_path_calls_the_extension_once_and_set_enabled_switches_it_off(monkeypatch):
    """With the extension's hot call mocked, birkhoff_project with plain options is that one call (its answer
    returned as is); other options, a subclass or set_enabled(False) go the checked way."""
    from mhc.projection import cuda as projection_cuda

    calls = []

    def hot_call(logits, tol, max_iter):
        calls.append((tol, max_iter))
        return logits * 1

    monkeypatch.setattr(projection_cuda, "fast_forward", hot_call)
    R = torch.randn(8, 4, 4, generator=fresh_generator())
    outs = [birkhoff_project(R) for _ in range(3)]
    assert calls == [(1e-6, NEWTON_MAX_ITER)] * 3 and all(torch.equal(T, R) for T in outs)
    assert torch.equal(birkhoff_project(R, tol=1e-7, max_iter=7), R) and calls[-1] == (1e-7, 7)
    reference = birkhoff_project_reference(R)
    assert torch.equal(birkhoff_project(R, return_info=True)[0], reference) and len(calls) == 4
    assert torch.equal(birkhoff_project(torch.nn.Parameter(R)), reference) and len(calls) == 4
    previous = projection_cuda.set_enabled(False)
    try:
        assert projection_cuda.fast_forward is None
        assert torch.equal(birkhoff_project(R), reference) and len(calls) == 4
    finally:
        projection_cuda.set_enabled(previous)


@pytest.mark.parametrize("method", ["newton", "sinkhorn"])
def test_nonfinite_matrices_come_back_nan_and_others_stay_exact(method):
    g = fresh_generator()
    R = 5 * torch.randn(64, 4, 4, generator=g)
    R[3, 1, 2] = float("nan")
    R[10, 0, 0] = float("inf")
    R[11, 2, 3] = float("-inf")
    T, info = birkhoff_project(R, method=method, return_info=True)
    bad = torch.zeros(64, dtype=torch.bool)
    bad[[3, 10]] = True  # -inf is a zero of exp(R): matrix 11 is projected on its other entries
    assert T[bad].isnan().all()
    assert T[~bad].isfinite().all() and T[11, 2, 3] == 0, seed_of(g)
    torch.testing.assert_close(
        T[~bad],
        birkhoff_project(R[~bad], method=method),
        rtol=0,
        atol=1e-7,
        msg=lambda m: f"{seed_of(g)}: {m}",
    )
    assert info.num_nonfinite == 2
    if method == "newton":
        assert info.num_unconverged == 0, seed_of(g)


def test_unconverged_matrices_are_reported():
    g = fresh_generator()
    R = 30 * torch.randn(2000, 4, 4, generator=g)
    with pytest.warns(ConvergenceWarning, match="missed tol"):
        T, info = birkhoff_project(R, max_iter=1, return_info=True)
    assert info.num_unconverged > 0, seed_of(g)
    missed = ~info.converged
    # The info tells the truth about each matrix it flags.
    assert (info.error[missed] > info.tol).all(), seed_of(g)
    torch.testing.assert_close(info.error, marginal_error(T), msg=lambda m: f"{seed_of(g)}: {m}")


def test_sinkhorn_is_classic_sinkhorn_knopp():
    g = fresh_generator()
    R = 2 * torch.randn(100, 4, 4, generator=g, dtype=torch.float64)
    M = R.exp()
    for _ in range(20):
        M = M / M.sum(-1, keepdim=True)
        M = M / M.sum(-2, keepdim=True)
    torch.testing.assert_close(
        birkhoff_project(R, method="sinkhorn", iters=20), M, msg=lambda m: f"{seed_of(g)}: {m}"
    )
    # Fixed-step Sinkhorn is not exact on hard inputs; Newton is.
    hard = 10 * torch.randn(20000, 4, 4, generator=g)
    assert marginal_error(birkhoff_project(hard, method="sinkhorn")).max() > 1e-3, seed_of(g)
    assert marginal_error(birkhoff_project(hard)).max() <= 1e-5, seed_of(g)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_gradcheck_float64(n):
    g = fresh_generator()
    R = torch.randn(4, n, n, generator=g, dtype=torch.float64, requires_grad=True)
    with reraise_with(seed_of(g)):
        assert torch.autograd.gradcheck(lambda r: birkhoff_project(r, tol=1e-13), (R,), eps=1e-6, atol=1e-7)


def test_gradcheck_float64_hard_inputs():
    g = fresh_generator()
    R = (8 * torch.randn(4, 4, 4, generator=g, dtype=torch.float64)).requires_grad_()
    strided = torch.randn(4, 6, 6, generator=g, dtype=torch.float64)[:, ::2, ::2].requires_grad_()
    with reraise_with(seed_of(g)):
        assert torch.autograd.gradcheck(lambda r: birkhoff_project(r, tol=1e-13), (R,), eps=1e-6, atol=1e-6)
        assert torch.autograd.gradcheck(
            lambda r: birkhoff_project(r, tol=1e-13), (strided,), eps=1e-6, atol=1e-7
        )


# ----------------------------------------------------------------------------
# Independent gradient references: they share no code with birkhoff_backward.
# ----------------------------------------------------------------------------


def _kkt_system(T: torch.Tensor) -> torch.Tensor:
    """``[B, 2n-1, 2n-1]``: the linearised marginals of ``T = exp(R + a1ᵀ + 1bᵀ)`` in ``(a, b)``, ``b_n = 0``.

    Rows are ``d(T1)_i`` and ``d(Tᵀ1)_j`` (the last column sum is implied by the
    others), columns ``da_i`` and ``db_j``: ``[[diag(T1), T], [Tᵀ, diag(Tᵀ1)]]``.
    """
    n = T.shape[-1]
    top = torch.cat([torch.diag_embed(T.sum(-1)), T], -1)
    bottom = torch.cat([T.transpose(-1, -2), torch.diag_embed(T.sum(-2))], -1)
    return torch.cat([top, bottom], -2)[:, : 2 * n - 1, : 2 * n - 1]


def kkt_vjp(T: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``∂L/∂R`` for ``G = ∂L/∂T`` from the full first-order system, float64 ``[B, n, n]``.

    ``dT = T∘(dR + da1ᵀ + 1dbᵀ)`` with ``(da, db)`` fixed by ``dT1 = dTᵀ1 = 0``;
    its adjoint ``y`` solves ``Mᵀy = (rows, columns of T∘G)`` and gives
    ``∂L/∂R = T∘(G - y_a1ᵀ - 1y_bᵀ)``. The solve is SVD least squares (gelsd),
    which truncates the directions a near-permutation leaves singular.
    Also returns the system's smallest singular value per matrix.
    """
    n = T.shape[-1]
    S = T * G
    rhs = torch.cat([S.sum(-1), S.sum(-2)[:, : n - 1]], -1).unsqueeze(-1)
    solution = torch.linalg.lstsq(_kkt_system(T), rhs, driver="gelsd")
    y = torch.nn.functional.pad(solution.solution.squeeze(-1), (0, 1))
    return T * (G - y[:, :n, None] - y[:, None, n:]), solution.singular_values[:, -1]


def mp_vjp(R: torch.Tensor, G: torch.Tensor, start: torch.Tensor, digits: int = 40) -> torch.Tensor:
    """``∂L/∂R`` of one ``[n, n]`` matrix from the projection solved to ``digits`` digits (mpmath).

    Newton on the full system in ``(a, b)`` from ``start`` (a float64 solution;
    any positive plan converges), then the same adjoint as :func:`kkt_vjp`, all
    in mpmath, so neither the plan nor the solve carries float64 rounding.
    """
    with mpmath.workdps(digits):
        n = R.shape[0]
        Rm = mpmath.matrix(R.tolist())
        D = [[mpmath.log(float(start[i, j])) - Rm[i, j] for j in range(n)] for i in range(n)]
        b = [D[n - 1][j] - D[n - 1][n - 1] for j in range(n)]
        a = [mpmath.fsum(D[i][j] - b[j] for j in range(n)) / n for i in range(n)]
        for _ in range(100):
            T = mpmath.matrix(n, n)
            for i in range(n):
                for j in range(n):
                    T[i, j] = mpmath.exp(Rm[i, j] + a[i] + b[j])
            rows = [mpmath.fsum(T[i, j] for j in range(n)) for i in range(n)]
            cols = [mpmath.fsum(T[i, j] for i in range(n)) for j in range(n)]
            M = mpmath.matrix(2 * n - 1, 2 * n - 1)
            for i in range(n):
                M[i, i] = rows[i]
                for j in range(n - 1):
                    M[i, n + j] = M[n + j, i] = T[i, j]
            for j in range(n - 1):
                M[n + j, n + j] = cols[j]
            residual = [r - 1 for r in rows] + [c - 1 for c in cols[: n - 1]]
            if max(abs(r) for r in residual) < mpmath.mpf(10) ** (15 - digits):
                break
            step = mpmath.lu_solve(M, mpmath.matrix(residual))
            t = min(1, 20 / max(abs(x) for x in step))  # damped far from the solution
            a = [a[i] - t * step[i] for i in range(n)]
            b = [b[j] - t * step[n + j] for j in range(n - 1)] + [b[n - 1]]
        else:
            raise AssertionError("the mpmath reference did not converge")
        S = [[T[i, j] * float(G[i, j]) for j in range(n)] for i in range(n)]
        rhs = [mpmath.fsum(S[i]) for i in range(n)] + [
            mpmath.fsum(S[i][j] for i in range(n)) for j in range(n - 1)
        ]
        y = mpmath.lu_solve(M, mpmath.matrix(rhs))
        y_b = [y[n + j] for j in range(n - 1)] + [0]
        out = [[T[i, j] * (float(G[i, j]) - y[i] - y_b[j]) for j in range(n)] for i in range(n)]
        return torch.tensor([[float(v) for v in row] for row in out], dtype=torch.float64)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_kkt_reference_matches_unrolled_sinkhorn(n):
    """The reference itself: against autograd through float64 Sinkhorn run to convergence."""
    g = fresh_generator()
    R = torch.randn(64, n, n, generator=g, dtype=torch.float64, requires_grad=True)
    G = torch.randn(64, n, n, generator=g, dtype=torch.float64)
    # 1000 steps: a draw's slowest matrix can still miss 1e-13 after 300 (1.6e-13 at n = 2 in one CI run)
    T_unrolled = birkhoff_project(R, method="sinkhorn", iters=1000)
    assert marginal_error(T_unrolled).max().item() < 1e-13, seed_of(g)
    (unrolled,) = torch.autograd.grad(T_unrolled, R, G)
    ref, _ = kkt_vjp(birkhoff_project(R.detach(), tol=1e-13), G)
    err = (ref - unrolled).abs().max().item()
    assert err < 1e-12, f"{seed_of(g)}: KKT vs unrolled Sinkhorn {err:.2e}"


def test_kkt_reference_matches_40_digits_near_permutations():
    """float64 KKT stays right where its system is singular to rounding (checked at 40 digits)."""
    g = fresh_generator()
    R = 30 * torch.randn(4000, 4, 4, generator=g, dtype=torch.float64)
    G = torch.randn(4000, 4, 4, generator=g, dtype=torch.float64)
    T = birkhoff_project(R, tol=1e-13)
    ref, smallest = kkt_vjp(T, G)
    hardest = smallest.argsort()[:8]
    assert smallest[hardest[0]].item() < 1e-12, seed_of(g)  # the draw does reach singular systems
    for i in hardest.tolist():
        exact = mp_vjp(R[i], G[i], T[i])
        err = ((ref[i] - exact).norm() / G[i].norm()).item()
        assert err < 1e-12, f"{seed_of(g)}: matrix {i}: float64 KKT vs 40 digits {err:.2e}"


# (n, scale, relative error, worst matrix's error relative to its |G|): the largest of
# 6 seeds at 800_000 / n² matrices each, fp32 backward against kkt_vjp (float64).
GRADIENT_CASES = [
    (4, 1.0, 2.6e-7, 1.6e-7),
    (4, 10.0, 4.5e-7, 3.2e-7),
    (4, 30.0, 6.4e-7, 4.7e-7),
    (8, 1.0, 3.0e-7, 1.3e-7),
    (8, 10.0, 9.2e-7, 3.4e-7),
]
_MARGIN = 3.0  # allowed over the measured maxima


@pytest.mark.parametrize("n,scale,measured_rel,measured_matrix", GRADIENT_CASES)
def test_fp32_gradient_matches_float64(n, scale, measured_rel, measured_matrix):
    g = fresh_generator()
    count = 800_000 // n**2
    R = scale * torch.randn(count, n, n, generator=g)
    G = torch.randn(count, n, n, generator=g)
    r32 = R.clone().requires_grad_()
    birkhoff_project(r32).backward(G)
    got = r32.grad.double()
    G64 = G.double()
    ref, smallest = kkt_vjp(birkhoff_project(R.double(), tol=1e-13), G64)
    diff = got - ref
    rel = (diff.norm() / ref.norm()).item()
    assert rel <= _MARGIN * measured_rel, (
        f"{seed_of(g)}: relative error {rel:.2e} (measured up to {measured_rel:.1e})"
    )
    # Per matrix, the error is small against the incoming gradient's size.
    per_matrix = diff.flatten(1).norm(dim=1) / G64.flatten(1).norm(dim=1)
    worst = per_matrix.max().item()
    assert worst <= _MARGIN * measured_matrix, (
        f"{seed_of(g)}: matrix {per_matrix.argmax().item()} error {worst:.2e} (measured up to {measured_matrix:.1e})"
    )
    # Where float64 is least sure (the most singular systems, near permutations)
    # and where fp32 is worst, the judge is a 40-digit solve.
    picks = torch.cat([smallest.argsort()[:4], per_matrix.argsort(descending=True)[:2]]).tolist()
    for i in picks:
        exact = mp_vjp(R[i].double(), G64[i], birkhoff_project(R[i].double(), tol=1e-13))
        err = ((got[i] - exact).norm() / G64[i].norm()).item()
        assert err <= _MARGIN * measured_matrix, f"{seed_of(g)}: matrix {i} vs 40 digits: {err:.2e}"


# ----------------------------------------------------------------------------
# Double backward.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_gradgradcheck_float64(n):
    g = fresh_generator()
    R = torch.randn(2, n, n, generator=g, dtype=torch.float64, requires_grad=True)
    with reraise_with(seed_of(g)):
        # Full check of every second derivative for small n, random directions beyond.
        assert torch.autograd.gradgradcheck(
            lambda r: birkhoff_project(r, tol=1e-13), (R,), eps=1e-6, atol=1e-6, fast_mode=n > 2
        )


def test_gradgradcheck_float64_sinkhorn():
    g = fresh_generator()
    R = torch.randn(2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    with reraise_with(seed_of(g)):
        assert torch.autograd.gradgradcheck(lambda r: birkhoff_project(r, method="sinkhorn", iters=5), (R,))


def test_double_backward_through_block_on_the_pytorch_path():
    """README: MHCBlock(fused=False) supports create_graph=True (e.g. a gradient penalty)."""
    g = fresh_generator()
    torch.manual_seed(g.initial_seed())
    n, C = 4, 6
    block = MHCBlock(torch.nn.Linear(C, C), C, n, init="paper", fused=False).double()
    block.alpha.data.fill_(1.0)  # let the streams move H_res visibly
    x = torch.randn(3, n, C, generator=g, dtype=torch.float64, requires_grad=True)
    with reraise_with(seed_of(g)):
        assert torch.autograd.gradgradcheck(block, (x,), fast_mode=True, atol=1e-6)


def test_backward_of_a_permutation_is_zero():
    P = torch.eye(4)[[2, 0, 3, 1]].unsqueeze(0)
    grad = birkhoff_backward(P, torch.randn(1, 4, 4))
    assert grad.isfinite().all() and grad.abs().max().item() == 0


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ([[1.0, 0.0], [0.0, 1.0]], TypeError, "torch.Tensor"),
        (torch.eye(3, dtype=torch.int64), TypeError, "floating"),
        (torch.ones(4), ValueError, r"\[\.\.\., n, n\], got \(4,\)"),
        (torch.ones(2, 3, 4), ValueError, r"\[\.\.\., n, n\], got \(2, 3, 4\)"),
    ],
)
def test_marginal_error_checks_its_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        marginal_error(bad)


def test_marginal_error_of_what_it_documents():
    assert marginal_error(torch.eye(3, dtype=torch.bfloat16)).item() == 0.0
    assert marginal_error(torch.zeros(2, 5, 2, 2)).shape == (2, 5)
    assert marginal_error(torch.full((2, 2), 0.5, dtype=torch.float64)).dtype == torch.float64


def test_forward_mode_is_refused_for_newton_and_exact_for_sinkhorn(fresh_seed):
    """Newton's custom op has no forward-mode rule, so a tangent would come back as zero: refused.

    Sinkhorn's plain ops take forward mode; its JVP equals the reverse-mode Jacobian applied to the tangent.
    """
    from torch.autograd import forward_ad

    x = torch.randn(3, 4, 4, dtype=torch.float64) * 2
    v = torch.randn_like(x)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(birkhoff_project, (x,), (v,))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(birkhoff_project_reference, (x,), (v,))
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode"):
        birkhoff_project(forward_ad.make_dual(x, v))
    block = MHCBlock(torch.nn.Identity(), 8, 4, fused=False).double()
    streams = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(block, (streams,), (torch.randn_like(streams),))

    def sinkhorn(a):
        return birkhoff_project(a, method="sinkhorn", iters=30)

    _, tangent = torch.func.jvp(sinkhorn, (x,), (v,))
    jacobian = torch.autograd.functional.jacobian(sinkhorn, x).reshape(x.numel(), x.numel())
    expected = (jacobian @ v.reshape(-1)).reshape(x.shape)
    assert tangent.abs().max() > 1e-3, f"seed={fresh_seed}: a zero tangent would pass the comparison"
    torch.testing.assert_close(tangent, expected, rtol=1e-9, atol=1e-12, msg=f"seed={fresh_seed}")
