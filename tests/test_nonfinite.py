"""NaN and Inf stay where they are: in the projection's batch and in MHCBlock's tokens (CPU, PyTorch path).

A matrix holding NaN or +Inf (or a token holding NaN) gets NaN results and
NaN gradients; every other matrix (or token) gets exactly what it gets in a
batch without the bad value, forward and backward, and nothing raises. A
-Inf logit is a zero entry of exp(R), not a bad value: the matrix is projected
on its finite entries (tests/test_projection_zeros.py); here it must leave the
others alone too.
"""

import itertools
import math
import warnings

import pytest
import torch

from mhc import MHCBlock, marginal_error
from mhc.projection import birkhoff_project_reference

METHODS = ["newton", "sinkhorn"]
NS = [2, 3, 4, 8]
DTYPES = [torch.float32, torch.float64]
BATCH_SHAPES = [(3, 5), (2, 3, 2)]
BAD_VALUES = [math.nan, math.inf]


def fresh_generator() -> torch.Generator:
    g = torch.Generator()
    g.seed()
    return g


def project_with_grad(R: torch.Tensor, G: torch.Tensor, method: str):
    """``(T, info, ∂(Σ G∘T)/∂R)`` on the PyTorch path."""
    R = R.clone().requires_grad_()
    T, info = birkhoff_project_reference(R, method=method, return_info=True)
    (dR,) = torch.autograd.grad(T, R, G)
    return T.detach(), info, dR


@pytest.mark.parametrize("method,n,dtype", list(itertools.product(METHODS, NS, DTYPES)))
def test_a_nonfinite_matrix_changes_nothing_else(method, n, dtype):
    g = fresh_generator()
    seed = f"seed {g.initial_seed()}"
    for batch, bad_value in itertools.product(BATCH_SHAPES, BAD_VALUES):
        R = 5 * torch.randn(*batch, n, n, generator=g, dtype=dtype)
        G = torch.randn(*batch, n, n, generator=g, dtype=dtype)
        where = tuple(int(torch.randint(0, s, (), generator=g)) for s in (*batch, n, n))
        bad = torch.zeros(batch, dtype=torch.bool)
        bad[where[:-2]] = True
        R_bad = R.clone()
        R_bad[where] = bad_value
        case = f"{seed}: {method}, batch {batch}, {bad_value} at {where}"

        T, info, dR = project_with_grad(R_bad, G, method)
        T_clean, info_clean, dR_clean = project_with_grad(R[~bad], G[~bad], method)

        assert T[bad].isnan().all() and dR[bad].isnan().all(), case
        assert torch.equal(T[~bad], T_clean), case
        assert torch.equal(dR[~bad], dR_clean), case
        assert info.num_nonfinite == 1 and info_clean.num_nonfinite == 0, case
        assert bool(info.error[bad].isnan().all()) and not bool(info.converged[bad].any()), case
        assert torch.equal(info.error[~bad], info_clean.error), case
        assert torch.equal(info.iterations[~bad], info_clean.iterations), case


@pytest.mark.parametrize("method,n,dtype", list(itertools.product(METHODS, NS, DTYPES)))
def test_a_neginf_logit_changes_nothing_else(method, n, dtype):
    """One -inf logit: that matrix is projected on its other entries (finite, that entry exactly 0, finite
    gradients), and every other matrix is what a batch without it gives, bit for bit."""
    g = fresh_generator()
    seed = f"seed {g.initial_seed()}"
    for batch in BATCH_SHAPES:
        R = 5 * torch.randn(*batch, n, n, generator=g, dtype=dtype)
        G = torch.randn(*batch, n, n, generator=g, dtype=dtype)
        where = tuple(int(torch.randint(0, s, (), generator=g)) for s in (*batch, n, n))
        zero = torch.zeros(batch, dtype=torch.bool)
        zero[where[:-2]] = True
        R_zero = R.clone()
        R_zero[where] = -math.inf
        case = f"{seed}: {method}, batch {batch}, -inf at {where}"

        T, info, dR = project_with_grad(R_zero, G, method)
        T_clean, info_clean, dR_clean = project_with_grad(R[~zero], G[~zero], method)

        assert T[zero].isfinite().all() and dR[zero].isfinite().all() and T[where] == 0 and dR[where] == 0, (
            case
        )
        assert torch.equal(T[~zero], T_clean) and torch.equal(dR[~zero], dR_clean), case
        assert info.num_nonfinite == 0 and torch.equal(info.error[~zero], info_clean.error), case
        if method == "newton":
            assert bool(info.converged.all()), case


@pytest.mark.parametrize("method,n,dtype", list(itertools.product(METHODS, NS, DTYPES)))
def test_a_nonfinite_incoming_gradient_changes_nothing_else(method, n, dtype):
    g = fresh_generator()
    seed = f"seed {g.initial_seed()}"
    for bad_value in BAD_VALUES:
        R = 5 * torch.randn(3, 5, n, n, generator=g, dtype=dtype)
        G = torch.randn(3, 5, n, n, generator=g, dtype=dtype)
        G_bad = G.clone()
        G_bad[1, 2, n - 1, 0] = bad_value
        _, _, dR = project_with_grad(R, G_bad, method)
        _, _, dR_clean = project_with_grad(R, G, method)
        others = torch.ones(3, 5, dtype=torch.bool)
        others[1, 2] = False
        case = f"{seed}: {method}, {bad_value} in grad_T"
        assert not dR[1, 2].isfinite().all(), case
        if method == "newton":
            # Every entry of ∂L/∂R depends on every entry of G through the dual
            # solve, so the whole matrix says so, not a finite wrong value.
            assert not dR[1, 2].isfinite().any(), case
        assert torch.equal(dR[others], dR_clean[others]), case


@pytest.mark.parametrize("method", METHODS)
def test_an_all_nan_batch_completes_backward(method):
    """What a diverged step hands the projection: no finite matrix at all."""
    R = torch.full((4, 2, 4, 4), math.nan, requires_grad=True)
    T = birkhoff_project_reference(R, method=method)
    T.sum().backward()
    assert T.isnan().all() and R.grad.isnan().all()


@pytest.mark.parametrize("method", METHODS)
def test_huge_finite_logits_do_not_raise(method):
    """Logit spreads up to float32's range: far outside what the solver converges on, but a
    result and an honest report (NaN where the spread overflows), never an exception."""
    g = fresh_generator()
    seed = f"seed {g.initial_seed()}"
    scales = torch.tensor([1.0, 1e30, 1e38, 3e38]).repeat(16)
    # randn beyond 3.4e38 / 3e38 overflows to -inf, which is a different input (a zero
    # of exp(R), tested above): keep every logit finite.
    huge = torch.finfo(torch.float32).max
    R = torch.randn(64, 4, 4, generator=g, dtype=torch.float64) * scales[:, None, None]
    R = R.clamp(-huge, huge).float().requires_grad_()
    assert R.isfinite().all(), seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T, info = birkhoff_project_reference(R, method=method, return_info=True)
    T.sum().backward()
    unit = scales == 1
    assert T[unit].isfinite().all() and R.grad[unit].isfinite().all(), seed
    error = marginal_error(T.detach())
    finite = error.isfinite()
    assert torch.equal(error.isnan(), info.error.isnan()), seed
    torch.testing.assert_close(info.error[finite], error[finite], msg=lambda m: f"{seed}: {m}")
    assert (error[info.converged] <= info.tol).all(), seed  # converged means converged
    if method == "newton":
        assert (error[unit] <= 1e-5).all(), seed
        assert (error[finite & ~info.converged] > info.tol).all(), seed


def _block(n: int, C: int, dtype: torch.dtype, projection: str) -> MHCBlock:
    block = MHCBlock(torch.nn.Linear(C, C), C, n, init="paper", projection=projection, fused=False)
    with torch.no_grad():
        block.alpha.fill_(1.0)  # coefficients that really depend on the token
    return block.to(dtype)


@pytest.mark.parametrize("projection,n,dtype", list(itertools.product(METHODS, NS, DTYPES)))
def test_block_with_a_nan_token_completes_backward(projection, n, dtype):
    g = fresh_generator()
    seed = f"seed {g.initial_seed()}"
    torch.manual_seed(g.initial_seed())
    C = 6
    block = _block(n, C, dtype, projection)
    x = torch.randn(2, 3, n, C, generator=g, dtype=dtype)
    W = torch.randn(2, 3, n, C, generator=g, dtype=dtype)
    x_bad = x.clone()
    x_bad[1, 2, n - 1, 0] = math.nan
    token = (1, 2)
    others = torch.ones(2, 3, dtype=torch.bool)
    others[token] = False

    def run(x_in):
        x_in = x_in.clone().requires_grad_()
        block.zero_grad()
        out = block(x_in)
        (out * W).sum().backward()
        return out.detach(), x_in.grad, {name: p.grad.clone() for name, p in block.named_parameters()}

    out, dx, grads = run(x_bad)
    out_clean, dx_clean, grads_clean = run(x)
    assert out[token].isnan().all() and dx[token].isnan().any(), seed
    assert torch.equal(out[others], out_clean[others]), seed
    assert torch.equal(dx[others], dx_clean[others]), seed
    # The parameters' gradients sum over tokens: NaN is expected there, and the
    # clean batch shows they are finite without the bad token.
    assert all(grad.isfinite().all() for grad in grads_clean.values()), seed
    assert grads["phi"].isnan().any(), seed


@pytest.mark.parametrize("projection", METHODS)
def test_block_survives_a_diverging_learning_rate(projection):
    """lr=1e15 blows the parameters up to Inf/NaN within a few steps; training must not raise."""
    g = fresh_generator()
    torch.manual_seed(g.initial_seed())
    block = _block(4, 8, torch.float32, projection)
    optimizer = torch.optim.SGD(block.parameters(), lr=1e15)
    x = torch.randn(2, 5, 4, 8, generator=g)
    losses = []
    for _ in range(5):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = (block(x) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert not math.isfinite(losses[-1]), f"seed {g.initial_seed()}: losses {losses}"
