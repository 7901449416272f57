"""The pure-PyTorch Birkhoff projection: accuracy, gradients, bad input."""

import warnings

import pytest
import torch

from mhc import ConvergenceWarning, birkhoff_project, marginal_error
from mhc.projection import birkhoff_backward

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


def project_quietly(R, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        return birkhoff_project(R, return_info=True, **kw)


@pytest.mark.parametrize(
    "n,dist,count",
    [
        (4, "normal1", 1_000_000),
        (4, "uniform1", 1_000_000),
        (4, "normal10", 1_000_000),
        (4, "uniform10", 1_000_000),
        (8, "normal1", 1_000_000),
        (8, "normal10", 1_000_000),
    ],
)
def test_newton_max_marginal_error(n, dist, count):
    g = fresh_generator()
    R = DISTRIBUTIONS[dist]((count, n, n), g)
    T, info = project_quietly(R)
    err = marginal_error(T)
    assert T.dtype == torch.float32
    assert err.max().item() <= 1e-5, f"seed {g.initial_seed()}: max error {err.max().item():.3e}"
    assert bool(info.converged.all()) and info.num_unconverged == 0
    assert (T >= 0).all()


@pytest.mark.parametrize("n,count", [(4, 200_000), (8, 100_000)])
def test_newton_beyond_the_target_range(n, count):
    """N(0,30²): a matrix that misses tol in fp32 must be flagged, never hidden (none has been seen)."""
    g = fresh_generator()
    R = DISTRIBUTIONS["normal30"]((count, n, n), g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        T, info = birkhoff_project(R, return_info=True)
    err = marginal_error(T)
    torch.testing.assert_close(info.error, err)
    assert err[info.converged].max().item() <= 1e-5
    assert (err[~info.converged] > info.tol).all()
    assert info.num_unconverged <= 2, f"seed {g.initial_seed()}: {info.num_unconverged} unconverged"


def test_solution_is_the_kl_projection():
    """T must be diag(e^a) exp(R) diag(e^b), not just any doubly stochastic matrix."""
    g = fresh_generator()
    R = 5 * torch.randn(2000, 5, 5, generator=g, dtype=torch.float64)
    T = birkhoff_project(R, tol=1e-13)
    D = T.log() - R  # must equal a_i + b_j: zero after double centring
    centred = D - D.mean(-1, keepdim=True) - D.mean(-2, keepdim=True) + D.mean((-2, -1), keepdim=True)
    assert centred.abs().max().item() < 1e-9
    assert marginal_error(T).max().item() < 1e-12


def test_float64_stays_float64_and_reaches_tight_tol():
    g = fresh_generator()
    R = 10 * torch.randn(20000, 4, 4, generator=g, dtype=torch.float64)
    T, info = project_quietly(R, tol=1e-12)
    assert T.dtype == torch.float64
    assert marginal_error(T).max().item() <= 1e-12


def test_near_permutation_solutions():
    g = fresh_generator()
    n = 6
    perms = torch.stack([torch.eye(n)[torch.randperm(n, generator=g)] for _ in range(500)])
    R = 60 * perms + torch.randn(500, n, n, generator=g)
    T, _ = project_quietly(R)
    assert marginal_error(T).max().item() <= 1e-5
    assert (T - perms).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    g = fresh_generator()
    R = (3 * torch.randn(4096, 4, 4, generator=g)).to(dtype)
    T = birkhoff_project(R)
    assert T.dtype == dtype
    ref = birkhoff_project(R.double(), tol=1e-12)
    # Exact solve of the same (rounded) logits; only the output rounding differs.
    assert (T.double() - ref).abs().max().item() <= torch.finfo(dtype).eps
    assert marginal_error(T).max().item() <= 8 * 2 * 4 * torch.finfo(dtype).eps


def test_batch_shapes_and_noncontiguous():
    g = fresh_generator()
    base = torch.randn(3, 5, 4, 4, generator=g) * 4
    T = birkhoff_project(base)
    assert T.shape == base.shape
    single = birkhoff_project(base[1, 2])
    assert single.shape == (4, 4)
    torch.testing.assert_close(single, T[1, 2], rtol=0, atol=1e-6)

    transposed = base.transpose(-1, -2)  # non-contiguous view
    assert not transposed.is_contiguous()
    torch.testing.assert_close(birkhoff_project(transposed), birkhoff_project(transposed.contiguous()))
    strided = base[:, ::2]
    torch.testing.assert_close(birkhoff_project(strided), T[:, ::2], rtol=0, atol=1e-6)


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


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="method"):
        birkhoff_project(torch.randn(4, 4), method="bogus")
    with pytest.raises(ValueError):
        birkhoff_project(torch.randn(4, 4), max_iter=-1)


@pytest.mark.parametrize("method", ["newton", "sinkhorn"])
def test_nonfinite_matrices_come_back_nan_and_others_stay_exact(method):
    g = fresh_generator()
    R = 5 * torch.randn(64, 4, 4, generator=g)
    R[3, 1, 2] = float("nan")
    R[10, 0, 0] = float("inf")
    R[11, 2, 3] = float("-inf")
    T, info = birkhoff_project(R, method=method, return_info=True)
    bad = torch.zeros(64, dtype=torch.bool)
    bad[[3, 10, 11]] = True
    assert T[bad].isnan().all()
    assert T[~bad].isfinite().all()
    torch.testing.assert_close(T[~bad], birkhoff_project(R[~bad], method=method), rtol=0, atol=1e-7)
    assert info.num_nonfinite == 3
    if method == "newton":
        assert info.num_unconverged == 0


def test_unconverged_matrices_are_reported():
    g = fresh_generator()
    R = 30 * torch.randn(2000, 4, 4, generator=g)
    with pytest.warns(ConvergenceWarning, match="missed tol"):
        T, info = birkhoff_project(R, max_iter=1, return_info=True)
    assert info.num_unconverged > 0
    missed = ~info.converged
    # The info tells the truth about each matrix it flags.
    assert (info.error[missed] > info.tol).all()
    torch.testing.assert_close(info.error, marginal_error(T))


def test_sinkhorn_is_classic_sinkhorn_knopp():
    g = fresh_generator()
    R = 2 * torch.randn(100, 4, 4, generator=g, dtype=torch.float64)
    M = R.exp()
    for _ in range(20):
        M = M / M.sum(-1, keepdim=True)
        M = M / M.sum(-2, keepdim=True)
    torch.testing.assert_close(birkhoff_project(R, method="sinkhorn", iters=20), M)
    # Fixed-step Sinkhorn is not exact on hard inputs; Newton is.
    hard = 10 * torch.randn(20000, 4, 4, generator=g)
    assert marginal_error(birkhoff_project(hard, method="sinkhorn")).max() > 1e-3
    assert marginal_error(birkhoff_project(hard)).max() <= 1e-5


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_gradcheck_float64(n):
    g = fresh_generator()
    R = torch.randn(4, n, n, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r: birkhoff_project(r, tol=1e-13), (R,), eps=1e-6, atol=1e-7)


def test_gradcheck_float64_hard_inputs():
    g = fresh_generator()
    R = (8 * torch.randn(4, 4, 4, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda r: birkhoff_project(r, tol=1e-13), (R,), eps=1e-6, atol=1e-6)
    strided = torch.randn(4, 6, 6, generator=g, dtype=torch.float64)[:, ::2, ::2].requires_grad_()
    assert torch.autograd.gradcheck(lambda r: birkhoff_project(r, tol=1e-13), (strided,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("n,scale", [(4, 1.0), (4, 10.0), (4, 30.0), (8, 1.0), (8, 10.0)])
def test_fp32_gradient_matches_float64(n, scale):
    g = fresh_generator()
    count = 800_000 // n**2
    R = scale * torch.randn(count, n, n, generator=g)
    G = torch.randn(count, n, n, generator=g)
    r32 = R.clone().requires_grad_()
    birkhoff_project(r32).backward(G)
    r64 = R.double().requires_grad_()
    birkhoff_project(r64, tol=1e-13).backward(G.double())
    diff = r32.grad.double() - r64.grad
    assert (diff.norm() / r64.grad.norm()).item() <= 1e-4
    # Per matrix, the error is small against the incoming gradient's size.
    per_matrix = diff.flatten(1).norm(dim=1) / G.double().flatten(1).norm(dim=1)
    assert per_matrix.max().item() <= 1e-4


def test_backward_of_a_permutation_is_zero():
    P = torch.eye(4)[[2, 0, 3, 1]].unsqueeze(0)
    grad = birkhoff_backward(P, torch.randn(1, 4, 4))
    assert grad.isfinite().all() and grad.abs().max().item() == 0
