"""The H_res variants besides Newton: mHC-lite (exact by construction) and truncated Sinkhorn (the paper's recipe)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mhc import MHCBlock, MHCOptions, birkhoff_project, expand_streams, marginal_error
from mhc.mixing import (
    LITE_MAX_STREAMS,
    check_lite_streams,
    lite_h_res,
    lite_identity_logits,
    lite_logit_count,
    permutation_matrices,
    sinkhorn_h_res,
)

C = 8


def fresh_generator() -> torch.Generator:
    g = torch.Generator()
    g.seed()
    return g


def seed_of(g: torch.Generator) -> str:
    return f"seed {g.initial_seed()}"


# ----------------------------------------------------------------------------- mHC-lite


@pytest.mark.parametrize("n", range(1, LITE_MAX_STREAMS + 1))
def test_permutation_matrices_are_all_n_factorial_identity_first(n):
    P = permutation_matrices(n, "cpu", torch.float64)
    assert P.shape == (math.factorial(n), n, n)
    assert torch.equal(P[0], torch.eye(n, dtype=torch.float64))
    assert torch.equal(P.sum(-1), torch.ones(P.shape[:2], dtype=torch.float64))  # one 1 per row ...
    assert torch.equal(P.sum(-2), torch.ones(P.shape[:2], dtype=torch.float64))  # ... and per column
    assert len({tuple(p.flatten().tolist()) for p in P}) == math.factorial(n)  # all distinct


@pytest.mark.parametrize("n", range(1, LITE_MAX_STREAMS + 1))
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 2e-5), (torch.float64, 1e-13)])
def test_lite_h_res_is_exactly_doubly_stochastic_even_on_huge_logits(n, dtype, bound):
    """Where 20 Sinkhorn rounds leave marginal errors of order one (N(0, 10²) logits), mHC-lite is at rounding."""
    g = fresh_generator()
    for std in (1.0, 10.0, 100.0):
        logits = (torch.randn(500, lite_logit_count(n), generator=g, dtype=torch.float64) * std).to(dtype)
        H = lite_h_res(logits)
        assert H.dtype == dtype and H.shape == (500, n, n)
        assert H.min() >= 0, seed_of(g)
        err = marginal_error(H).max().item()
        assert err <= bound, f"{seed_of(g)}, std {std}: marginal error {err:.3g}"
    # The same logits through 20 Sinkhorn rounds are far from doubly stochastic (the point of the variant).
    if n == 4:
        sk = sinkhorn_h_res(torch.randn(500, n, n, generator=g, dtype=torch.float64) * 10.0, 20)
        assert marginal_error(sk).max() > 1e-2, seed_of(g)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_lite_h_res_gradcheck_float64(n):
    g = fresh_generator()
    logits = (torch.randn(2, lite_logit_count(n), generator=g, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lite_h_res, (logits,), eps=1e-6, atol=1e-7), seed_of(g)
    if n <= 3:  # double backward: the same ops, so the small sizes suffice
        assert torch.autograd.gradgradcheck(lite_h_res, (logits,), eps=1e-6, atol=1e-7), seed_of(g)


def test_lite_h_res_is_the_weighted_sum_of_permutations():
    g = fresh_generator()
    logits = torch.randn(3, 24, generator=g, dtype=torch.float64)
    w = torch.softmax(logits, -1)
    expected = torch.zeros(3, 4, 4, dtype=torch.float64)
    for k, perm in enumerate(itertools.permutations(range(4))):
        for i, j in enumerate(perm):
            expected[:, i, j] += w[:, k]
    torch.testing.assert_close(lite_h_res(logits), expected, msg=lambda m: f"{seed_of(g)}: {m}")


def test_lite_h_res_refuses_other_sizes_and_keeps_nan_local():
    for bad in (torch.zeros(3, 7), torch.zeros(3, 720), torch.zeros(())):
        with pytest.raises(ValueError, match="n!"):
            lite_h_res(bad)
    logits = torch.randn(3, 24)
    logits[1, 5] = math.nan
    H = lite_h_res(logits)
    assert H[1].isnan().all() and H[[0, 2]].isfinite().all()
    logits[1, 5] = math.inf
    assert lite_h_res(logits)[1].isnan().all()


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_lite_identity_logits_put_point_nine_on_the_diagonal(n):
    H = lite_h_res(lite_identity_logits(n, 0.9).double())
    off = (1 - 0.9) / (n - 1)
    expected = torch.full((n, n), off, dtype=torch.float64) + torch.eye(n, dtype=torch.float64) * (0.9 - off)
    torch.testing.assert_close(H, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="diagonal"):
        lite_identity_logits(n, 1.0 / n)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_lite_block_init_is_bit_exact_on_identical_streams(n):
    torch.manual_seed(0)
    branch = nn.Sequential(nn.Linear(C, C), nn.GELU())
    h = torch.randn(3, 5, C) * 1000
    for layer_index in range(n + 1):
        block = MHCBlock(branch, C, n, projection="lite", layer_index=layer_index)
        assert block.phi.shape == (2 * n + math.factorial(n), n * C) and block.b_res.shape == (
            math.factorial(n),
        )
        assert torch.equal(block(expand_streams(h, n)), expand_streams(h + branch(h), n))
        H_res = block.coefficients(expand_streams(h, n))[2]
        torch.testing.assert_close(
            H_res.diagonal(dim1=-2, dim2=-1), torch.full((3, 5, n), 0.9), rtol=0, atol=1e-6
        )


def test_lite_block_gradcheck_float64():
    g = fresh_generator()
    torch.manual_seed(g.initial_seed())
    branch = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double()
    block = MHCBlock(branch, 6, 3, projection="lite", init="paper").double()
    with torch.no_grad():
        block.alpha.fill_(0.7)
        block.b_res.add_(torch.randn(6, generator=g, dtype=torch.float64))
    names = ["phi", "alpha", "b_pre", "b_post", "b_res"]
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    params = [getattr(block, k).detach().clone().requires_grad_() for k in names]

    def site(x, *values):
        return torch.func.functional_call(block, dict(zip(names, values)), (x,))

    assert torch.autograd.gradcheck(site, (x, *params), eps=1e-6, atol=1e-6), seed_of(g)
    H = block.coefficients(x)[2]
    assert marginal_error(H).max() < 1e-13, seed_of(g)


def test_lite_refuses_more_than_five_streams_and_cannot_be_switched_to_or_from():
    with pytest.raises(ValueError, match="n_streams must be between 1 and 5; got n_streams=6"):
        MHCBlock(nn.Linear(C, C), C, 6, projection="lite")
    MHCBlock(nn.Linear(C, C), C, 6, mode="hc", projection="lite")  # hc ignores the projection
    lite = MHCBlock(nn.Linear(C, C), C, 4, projection="lite")
    newton = MHCBlock(nn.Linear(C, C), C, 4)
    with pytest.raises(ValueError, match="cannot change to or from 'lite'"):
        lite.projection = "newton"
    with pytest.raises(ValueError, match="cannot change to or from 'lite'"):
        newton.options = MHCOptions(projection="lite")
    assert lite.projection == "lite" and newton.projection == "newton"
    newton.projection = "sinkhorn"  # same parameter shapes: allowed
    lite.fused = False
    assert newton.projection == "sinkhorn" and lite.options == MHCOptions(projection="lite", fused=False)


def test_lite_block_keeps_a_nan_token_local():
    g = fresh_generator()
    torch.manual_seed(g.initial_seed())
    block = MHCBlock(nn.Linear(C, C), C, 4, projection="lite", init="paper")
    with torch.no_grad():
        block.alpha.fill_(1.0)
    x = torch.randn(2, 3, 4, C, generator=g)
    x_bad = x.clone()
    x_bad[1, 2, 3, 0] = math.nan
    out, clean = block(x_bad), block(x)
    assert out[1, 2].isnan().all(), seed_of(g)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    assert torch.equal(out[mask], clean[mask]), seed_of(g)


def test_lite_block_learns():
    torch.manual_seed(0)
    blocks = nn.Sequential(
        *[MHCBlock(nn.Linear(C, C), C, 4, projection="lite", layer_index=i) for i in range(3)]
    )
    x, target = torch.randn(16, 4, C), torch.randn(16, 4, C)
    opt = torch.optim.Adam(blocks.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = (blocks(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(b.b_res.grad is not None and b.b_res.grad.abs().sum() > 0 for b in blocks)


# ----------------------------------------------------------------------------- truncated Sinkhorn


def plain_recipe(logits: list[list[float]], iters: int, eps: float) -> list[list[float]]:
    """DeepSeek-V4's comb on H_res-layout logits, in plain Python floats, returned as H_res = combᵀ."""
    n = len(logits)
    L = [[logits[j][i] for j in range(n)] for i in range(n)]  # comb layout: the transpose
    comb = []
    for row in L:
        top = max(row)
        e = [math.exp(v - top) for v in row]
        s = sum(e)
        comb.append([v / s + eps for v in e])

    def columns(m):
        sums = [sum(m[r][c] for r in range(n)) for c in range(n)]
        return [[m[r][c] / (sums[c] + eps) for c in range(n)] for r in range(n)]

    def rows(m):
        return [[v / (sum(row) + eps) for v in row] for row in m]

    comb = columns(comb)
    for _ in range(iters - 1):
        comb = columns(rows(comb))
    return [[comb[j][i] for j in range(n)] for i in range(n)]


@pytest.mark.parametrize("n, iters, eps", [(4, 20, 1e-6), (3, 1, 1e-6), (4, 5, 0.0), (2, 20, 1e-3)])
def test_sinkhorn_h_res_matches_a_plain_loop_of_the_recipe(n, iters, eps):
    g = fresh_generator()
    logits = torch.randn(6, n, n, generator=g, dtype=torch.float64) * 3
    got = sinkhorn_h_res(logits, iters, eps)
    for b in range(6):
        expected = torch.tensor(plain_recipe(logits[b].tolist(), iters, eps), dtype=torch.float64)
        torch.testing.assert_close(
            got[b], expected, rtol=1e-12, atol=1e-14, msg=lambda m: f"{seed_of(g)}: {m}"
        )


def test_sinkhorn_block_runs_the_recipe_on_its_logits():
    """MHCBlock(projection="sinkhorn") with the defaults is mhc-sk20: 20 rounds, eps 1e-6, applied transposed."""
    g = fresh_generator()
    torch.manual_seed(g.initial_seed())
    n = 4
    block = MHCBlock(nn.Linear(C, C), C, n, projection="sinkhorn", init="paper").double()
    assert (block.sinkhorn_iters, block.sinkhorn_eps, block.pre_eps) == (20, 1e-6, 0.0)
    with torch.no_grad():
        block.alpha.fill_(3.0)
    x = torch.randn(5, n, C, generator=g, dtype=torch.float64)
    z = F.rms_norm(x.reshape(5, n * C), (n * C,), eps=block.norm_eps) @ block.phi.t()
    logits = block.alpha[2] * z[:, 2 * n :].reshape(5, n, n) + block.b_res
    H_res = block.coefficients(x)[2]
    for b in range(5):
        expected = torch.tensor(plain_recipe(logits[b].tolist(), 20, 1e-6), dtype=torch.float64)
        torch.testing.assert_close(
            H_res[b], expected, rtol=1e-10, atol=1e-12, msg=lambda m: f"{seed_of(g)}: {m}"
        )


def test_sinkhorn_without_eps_is_classic_sinkhorn_on_the_transpose():
    """eps = 0 leaves row/column rounds of exp(Lᵀ): the projection module's fixed-step Sinkhorn, transposed."""
    g = fresh_generator()
    R = torch.randn(50, 4, 4, generator=g, dtype=torch.float64) * 5
    for iters in (1, 7, 20):
        classic = birkhoff_project(R.transpose(-1, -2), method="sinkhorn", iters=iters).transpose(-1, -2)
        torch.testing.assert_close(sinkhorn_h_res(R, iters, 0.0), classic, msg=lambda m: f"{seed_of(g)}: {m}")


def test_sinkhorn_rows_end_exact_columns_do_not():
    """The last step normalises comb's columns, i.e. H_res's rows: those sum to 1 (less eps), the columns do not."""
    g = fresh_generator()
    H = sinkhorn_h_res(torch.randn(2000, 4, 4, generator=g, dtype=torch.float64) * 10, 20, 1e-6)
    assert (H.sum(-1) - 1).abs().max() < 1e-5, seed_of(g)
    assert (H.sum(-2) - 1).abs().max() > 1e-2, seed_of(g)


def test_sinkhorn_gradgradcheck_float64():
    g = fresh_generator()
    R = torch.randn(2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    f = lambda r: sinkhorn_h_res(r, 5, 1e-3)  # noqa: E731
    assert torch.autograd.gradcheck(f, (R,)) and torch.autograd.gradgradcheck(f, (R,)), seed_of(g)


def test_sinkhorn_init_is_function_preserving_to_eps():
    """eps makes every row sum 1 - O(eps): identical streams give x + F(x) to ~1e-6 relative, not to the bit."""
    torch.manual_seed(0)
    branch = nn.Linear(C, C)
    h = torch.randn(3, C) * 10
    out = MHCBlock(branch, C, 4, projection="sinkhorn")(expand_streams(h, 4))
    ref = expand_streams(h + branch(h), 4)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


# ----------------------------------------------------------------------------- misspelt or bad values


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(projection="lit"), ValueError, "projection must be one of"),
        (dict(projection="Lite"), ValueError, "projection must be one of"),
        (dict(projection="sinkhorn20"), ValueError, "projection must be one of"),
        (dict(pre_eps=-1e-6), ValueError, "pre_eps must be finite and >= 0"),
        (dict(sinkhorn_eps=math.nan), ValueError, "sinkhorn_eps must be finite"),
        (dict(sinkhorn_eps="1e-6"), TypeError, "sinkhorn_eps must be a real number"),
        (dict(sinkhorn_epsilon=1e-6), TypeError, "did you mean 'sinkhorn_eps'"),
        (dict(pre_epss=0.0), TypeError, "did you mean 'pre_eps'"),
    ],
)
def test_bad_variant_values_raise_naming_the_option(kwargs, error, match):
    with pytest.raises(error, match=match):
        MHCBlock(nn.Linear(C, C), C, 4, **kwargs)


def test_block_epsilons_are_read_only_and_shown():
    block = MHCBlock(
        nn.Linear(C, C), C, 4, projection="sinkhorn", pre_eps=1e-5, sinkhorn_eps=1e-4, sinkhorn_iters=7
    )
    assert "pre_eps=1e-05" in repr(block) and "sinkhorn_iters=7, sinkhorn_eps=0.0001" in repr(block)
    with pytest.raises(AttributeError):
        block.pre_eps = 0.0
    x = torch.randn(2, 4, C)
    H_pre = block.coefficients(x)[0]
    plain = MHCBlock(nn.Linear(C, C), C, 4, projection="sinkhorn", sinkhorn_eps=1e-4, sinkhorn_iters=7)
    with torch.no_grad():
        for name in ("phi", "alpha", "b_pre", "b_post", "b_res"):
            getattr(plain, name).copy_(getattr(block, name))
    torch.testing.assert_close(H_pre, plain.coefficients(x)[0] + 1e-5, rtol=0, atol=1e-7)


def test_permutations_cached_under_inference_mode_still_train():
    """The cache is filled by whichever call comes first; an inference-mode first call must not poison it."""
    with torch.inference_mode():
        P = permutation_matrices(2, "cpu", torch.bfloat16)
    assert not P.is_inference()
    w = torch.randn(3, 2, dtype=torch.bfloat16, requires_grad=True)
    (w @ permutation_matrices(2, "cpu", torch.bfloat16).reshape(2, 4)).sum().backward()
    assert w.grad is not None and w.grad.shape == (3, 2)


# ----------------------------------------------------------------------------- argument checks (issue #52)

SINKHORN_BAD = [
    (dict(eps=-1.0), ValueError, "eps must be finite and >= 0, got -1.0"),
    (dict(eps=math.nan), ValueError, "eps must be finite"),
    (dict(eps=math.inf), ValueError, "eps must be finite"),
    (dict(eps="1e-6"), TypeError, "eps must be a real number"),
    (dict(eps=True), TypeError, "eps must be a real number"),
    (dict(eps=None), TypeError, "eps must be a real number"),
    (dict(iters=0), ValueError, "iters must be >= 1, got 0"),
    (dict(iters=-5), ValueError, "iters must be >= 1, got -5"),
    (dict(iters=2.0), TypeError, "iters must be an int"),
    (dict(iters=True), TypeError, "iters must be an int"),
]


@pytest.mark.parametrize("kwargs, error, match", SINKHORN_BAD)
def test_sinkhorn_h_res_checks_its_options(kwargs, error, match):
    """The checks MHCBlock makes of sinkhorn_iters / sinkhorn_eps, under the function's own argument names."""
    with pytest.raises(error, match=match):
        sinkhorn_h_res(torch.randn(2, 4, 4), **kwargs)


@pytest.mark.parametrize(
    "logits, error, match",
    [
        (torch.randn(2, 3, 4), ValueError, r"square matrices \[\.\.\., n, n\], got \(2, 3, 4\)"),
        (torch.randn(4), ValueError, r"got \(4,\)"),
        (torch.randn(2, 0, 0), ValueError, "n >= 1"),
        (torch.randn(2, 4, 4).to(torch.bfloat16), TypeError, "float32 or float64"),
        (torch.ones(2, 4, 4, dtype=torch.int64), TypeError, "float32 or float64"),
        ([[0.0, 1.0], [1.0, 0.0]], TypeError, "torch.Tensor"),
    ],
)
def test_sinkhorn_h_res_checks_its_logits(logits, error, match):
    with pytest.raises(error, match=match):
        sinkhorn_h_res(logits)


def test_sinkhorn_h_res_accepts_the_edges():
    R = torch.randn(2, 3, 3, dtype=torch.float64)
    assert sinkhorn_h_res(R, 1, 0).shape == R.shape  # one round, an int zero epsilon
    assert sinkhorn_h_res(R[0], iters=3, eps=1e-3).shape == (3, 3)
    assert sinkhorn_h_res(torch.randn(0, 4, 4)).shape == (0, 4, 4)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: lite_h_res([0.0, 1.0]), TypeError, "torch.Tensor"),
        (lambda: lite_h_res(torch.zeros(3, 24, dtype=torch.bfloat16)), TypeError, "float32 or float64"),
        (lambda: lite_h_res(torch.zeros(3, 2, dtype=torch.int64)), TypeError, "float32 or float64"),
        (lambda: lite_logit_count(0), ValueError, "n must be >= 1, got 0"),
        (lambda: lite_logit_count(True), TypeError, "n must be an int"),
        (lambda: lite_logit_count(3.0), TypeError, "n must be an int"),
        (lambda: check_lite_streams(2.0), TypeError, "n_streams must be an int"),
        (lambda: check_lite_streams(True), TypeError, "n_streams must be an int"),
        (lambda: permutation_matrices(2.0), TypeError, "n must be an int"),
        (lambda: permutation_matrices(True), TypeError, "n must be an int"),
        (lambda: permutation_matrices(3, dtype="float32"), TypeError, "dtype must be a torch.dtype"),
        (lambda: permutation_matrices(3, device="gpu7"), ValueError, "device"),
        (lambda: permutation_matrices(3, device=1.5), TypeError, "device"),
        (lambda: lite_identity_logits(1, "0.9"), TypeError, "diagonal must be a real number"),
        (lambda: lite_identity_logits(3, None), TypeError, "diagonal must be a real number"),
        (lambda: lite_identity_logits(3, math.nan), ValueError, "diagonal must be finite"),
        (lambda: lite_identity_logits(3.0, 0.9), TypeError, "n must be an int"),
    ],
)
def test_lite_functions_check_their_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("projection", ["sinkhorn", "lite"])
def test_the_block_forward_skips_the_public_checks(projection, monkeypatch):
    """MHCBlock checked its options once, when it was built: its forward calls the unchecked variants
    (mhc.mixing.sinkhorn_h_res_unchecked, lite_h_res_unchecked), so the public checks cost it nothing."""
    import mhc.mixing
    import mhc.site

    block = MHCBlock(nn.Linear(C, C), C, 4, projection=projection, init="paper")
    x = torch.randn(3, 4, C)
    expected = block(x)

    def refuse(*args, **kwargs):
        raise AssertionError("the block's forward called a checked public function")

    for name in (
        "sinkhorn_h_res",
        "lite_h_res",
        "lite_logit_count",
        "permutation_matrices",
        "check_lite_streams",
    ):
        monkeypatch.setattr(mhc.mixing, name, refuse)
        monkeypatch.setattr(mhc.site, name, refuse, raising=False)
    assert torch.equal(block(x), expected)


def test_lite_permutations_built_while_tracing_are_not_kept(monkeypatch):
    """The permutation matrices are cached per (n, device, dtype). One built while tracing is not kept: under
    torch.export or a FakeTensorMode dry run it is fake (every later eager lite block returned fake tensors),
    and a graph compiled under inference_mode made it an inference tensor (later training raised)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mhc import mixing

    monkeypatch.setattr(mixing, "_PERMUTATIONS", {})
    C, n = 8, 3
    x = torch.randn(2, n, C)
    with FakeTensorMode() as mode:
        fake_out = lite_h_res(mode.from_tensor(torch.randn(5, math.factorial(n))))
    assert type(fake_out) is not torch.Tensor
    torch.export.export(MHCBlock(nn.Linear(C, C), C, n, projection="lite", init="paper"), (x,))
    with torch.inference_mode():
        torch.compile(MHCBlock(nn.Linear(C, C), C, n + 1, projection="lite"), backend="aot_eager")(
            torch.randn(2, n + 1, C)
        )
    assert all(type(P) is torch.Tensor and not P.is_inference() for P in mixing._PERMUTATIONS.values())
    for streams in (n, n + 1):
        block = MHCBlock(nn.Linear(C, C), C, streams, projection="lite", init="paper")
        xs = torch.randn(2, streams, C, requires_grad=True)
        out = block(xs)
        assert type(out) is torch.Tensor and torch.isfinite(out).all()
        out.sum().backward()
        assert type(xs.grad) is torch.Tensor and block.b_res.grad is not None
