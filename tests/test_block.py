"""MHCBlock: function-preserving init, symmetry breaking, dtypes, pass-through, bad input."""

import copy

import pytest
import torch
from torch import nn

from mhc import MHCBlock, StreamReduce, expand_streams, marginal_error, reduce_streams

C = 32


def make_branch(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(C), nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))


@pytest.mark.parametrize("mode", ["mhc", "hc", "residual"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_default_init_is_function_preserving(mode, n):
    branch = make_branch()
    block = MHCBlock(branch, C, n, mode=mode, layer_index=5)
    h = torch.randn(3, 7, C) * 3
    out = reduce_streams(block(expand_streams(h, n)))
    assert (out - (h + branch(h))).abs().max().item() <= 1e-5


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_mhc_init_is_bit_exact_on_identical_streams(n):
    """Σ H_pre rounds to exactly 1 and only stream deviations are mixed: no rounding at all."""
    branch = make_branch()
    h = torch.randn(3, 7, C) * 1000
    for layer_index in range(2 * n):
        x = MHCBlock(branch, C, n, layer_index=layer_index)(expand_streams(h, n))
        assert torch.equal(x, expand_streams(h + branch(h), n))


def test_function_preserving_through_a_stack():
    branches = [make_branch(i) for i in range(6)]
    blocks = nn.Sequential(*[MHCBlock(b, C, 4, layer_index=i) for i, b in enumerate(branches)])
    h = torch.randn(2, 5, C)
    ref = h
    for b in branches:
        ref = ref + b(ref)
    x = blocks(expand_streams(h, 4))
    # Every stream, not only the mean, carries the residual network's state.
    assert (x - ref.unsqueeze(-2)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_mode_with_one_stream_is_exactly_x_plus_f(dtype):
    branch = make_branch().to(dtype)
    block = MHCBlock(branch, C, 1, mode="residual")
    h = torch.randn(4, C, dtype=dtype)
    assert torch.equal(block(h.unsqueeze(-2)).squeeze(-2), h + branch(h))
    assert sum(p.numel() for p in block.parameters()) == sum(p.numel() for p in branch.parameters())


def test_paper_init_is_random_but_small():
    block = MHCBlock(make_branch(), C, 4, init="paper")
    assert block.phi.abs().sum() > 0
    assert torch.equal(block.alpha, torch.full((3,), 0.01))
    h = torch.randn(3, C)
    out = reduce_streams(block(expand_streams(h, 4)))
    err = (out - (h + block.branch(h))).abs().max().item()
    assert 0 < err < 0.1


@pytest.mark.parametrize("n", [2, 4, 8])
def test_h_res_is_doubly_stochastic_and_coefficients_fp32(n):
    block = MHCBlock(make_branch(), C, n, init="paper")
    with torch.no_grad():
        block.b_res.normal_(0, 3)
    x = torch.randn(5, 3, n, C, dtype=torch.bfloat16)
    H_pre, H_post, H_res = block.coefficients(x)
    assert H_pre.dtype == H_post.dtype == H_res.dtype == torch.float32
    assert H_pre.shape == (5, 3, n) and H_res.shape == (5, 3, n, n)
    assert marginal_error(H_res).max().item() <= 1e-5
    assert ((H_post > 0) & (H_post < 2)).all() and ((H_pre > 0) & (H_pre < 1)).all()
    block.branch.to(torch.bfloat16)
    assert block(x).dtype == torch.bfloat16


def test_bf16_streams_match_fp32_to_bf16_tolerance():
    block = MHCBlock(make_branch(), C, 4, init="paper")
    x = torch.randn(8, 4, C)
    ref = block(x)
    out = copy.deepcopy(block).to(torch.bfloat16)(x.to(torch.bfloat16))
    # Coefficient parameters cast to bf16 by .to() are still used in fp32 math.
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("mode", ["mhc", "hc", "residual"])
@pytest.mark.parametrize(
    "output, message",
    [
        ((), "empty tuple"),
        (None, "the branch's output is NoneType"),
        ([0.0], "the branch's output is list"),
        ({"y": 0.0}, "the branch's output is dict"),
        (("weights", 1), "the first element of the tuple the branch returned is str"),
    ],
)
def test_a_branch_that_returns_no_tensor_gets_an_error_naming_it(mode, output, message):
    """A branch returning (), None, a list, a dict or a tuple led by a non-tensor: a TypeError that says so (not
    an IndexError or AttributeError from inside the block)."""
    block = MHCBlock(lambda u: output, C, 4, mode=mode)
    with pytest.raises(TypeError, match=message):
        block(torch.randn(2, 4, C))


@pytest.mark.parametrize("mode", ["mhc", "hc"])
def test_branch_args_kwargs_and_tuple_outputs_pass_through(mode):
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(C, C)

        def forward(self, u, mask, *, scale=1.0):
            return self.proj(u) * scale * mask, "weights", 7

    attention = Attention()
    block = MHCBlock(attention, C, 4, mode=mode, init="paper")
    x = torch.randn(2, 4, C)
    mask = (torch.arange(C) % 3 != 0).float()
    out, weights, seven = block(x, mask, scale=0.5)
    assert out.shape == x.shape and weights == "weights" and seven == 7
    # The values: x' = H_res x + H_post ⊗ F(H_pre x, mask, scale=0.5), with F's own mask and scale.
    H_pre, H_post, H_res = block.coefficients(x)
    u = torch.einsum("...n,...nc->...c", H_pre, x)
    expected = H_res @ x + H_post.unsqueeze(-1) * (attention.proj(u) * 0.5 * mask).unsqueeze(-2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # scale=0 or an all-zero mask leaves only the residual mix, whatever the branch weights.
    torch.testing.assert_close(block(x, mask, scale=0.0)[0], H_res @ x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block(x, torch.zeros(C))[0], H_res @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["mhc", "hc"])
def test_all_parameters_get_gradients(mode):
    block = MHCBlock(make_branch(), C, 4, mode=mode, init="paper")
    x = torch.randn(6, 4, C)
    block(x).pow(2).sum().backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("mode", ["mhc", "hc"])
def test_block_gradcheck_float64(mode):
    """Gradients with respect to the streams and every coefficient parameter."""
    branch = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double()
    block = MHCBlock(branch, 6, 3, mode=mode, init="paper", tol=1e-13).double()
    names = ["phi", "alpha", "b_pre", "b_post", "b_res"]
    assert sorted(names) == sorted(n for n, _ in block.named_parameters(recurse=False))
    torch.manual_seed(0)
    with torch.no_grad():
        block.alpha.fill_(0.7)  # make the dynamic part matter
        block.b_res.add_(0.3 * torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    params = [getattr(block, n).detach().clone().requires_grad_() for n in names]

    def site(x, *values):
        return torch.func.functional_call(block, dict(zip(names, values)), (x,))

    assert torch.autograd.gradcheck(site, (x, *params), eps=1e-6, atol=1e-6, fast_mode=True)
    # fast_mode checks random directions; the streams (few) get the full Jacobian as well.
    assert torch.autograd.gradcheck(lambda x: site(x, *params), (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode, projection", [("hc", "newton"), ("mhc", "sinkhorn"), ("mhc", "newton")])
def test_double_backward_fused_false(mode, projection):
    """fused=False (the PyTorch path) supports create_graph=True: gradgradcheck in float64.

    Newton's backward is the implicit-function gradient; it is double-differentiable
    because mhc.projection writes it in differentiable torch ops.
    """
    torch.manual_seed(0)
    branch = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double()
    block = MHCBlock(
        branch, 6, 3, mode=mode, init="paper", projection=projection, tol=1e-13, fused=False
    ).double()
    with torch.no_grad():
        block.alpha.fill_(0.7)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(block(x).square().sum(), x, create_graph=True)
    gphi = torch.autograd.grad(gx.square().sum(), block.phi)[0]
    assert gphi.abs().sum() > 0
    assert torch.autograd.gradgradcheck(block, (x,), eps=1e-6, atol=1e-5)


def _train_stack(blocks: nn.Sequential, steps: int = 5) -> torch.Tensor:
    torch.manual_seed(1)
    h = torch.randn(16, C)
    target = torch.randn(16, C)
    head = StreamReduce(4)
    opt = torch.optim.Adam(blocks.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = (head(blocks(expand_streams(h, 4))) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return blocks(expand_streams(h, 4))


def test_training_breaks_the_symmetry_between_streams():
    blocks = nn.Sequential(*[MHCBlock(make_branch(i), C, 4, layer_index=i) for i in range(4)])
    x = _train_stack(blocks)
    spread = (x - x.mean(-2, keepdim=True)).abs().amax().item()
    assert spread > 1e-3, spread

    # The same stack with a uniform H_pre stays one residual stream in disguise.
    uniform = nn.Sequential(*[MHCBlock(make_branch(i), C, 4, layer_index=i) for i in range(4)])
    for block in uniform:
        with torch.no_grad():
            block.b_pre.fill_(torch.logit(torch.tensor(0.25)).item())
    x = _train_stack(uniform)
    assert (x - x.mean(-2, keepdim=True)).abs().amax().item() < 1e-5


def test_bad_input_raises():
    block = MHCBlock(make_branch(), C, 4)
    with pytest.raises(ValueError, match=r"\[\.\.\., 4, 32\]"):
        block(torch.randn(2, 3, C))
    with pytest.raises(ValueError):
        block(torch.randn(2, 4, C + 1))
    with pytest.raises(ValueError):
        block(torch.randn(C))
    with pytest.raises(TypeError):
        block(torch.ones(2, 4, C, dtype=torch.long))
    with pytest.raises(ValueError, match="are on meta"):
        block(torch.randn(2, 4, C, device="meta"))
    with pytest.raises(ValueError, match="branch returned"):
        MHCBlock(nn.Linear(C, C + 1), C, 4)(torch.randn(2, 4, C))


@pytest.mark.parametrize(
    "kwargs",
    [dict(mode="bogus"), dict(init="bogus"), dict(projection="bogus"), dict(n_streams=0)],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        MHCBlock(make_branch(), C, **kwargs)


def test_extra_repr_and_sinkhorn_option():
    block = MHCBlock(make_branch(), C, 4, projection="sinkhorn", sinkhorn_iters=5)
    text = repr(block)
    assert "n_streams=4" in text and "mode='mhc'" in text and "projection='sinkhorn'" in text
    assert block(torch.randn(2, 4, C)).shape == (2, 4, C)


@pytest.mark.parametrize("mode", ["mhc", "hc"])
def test_recompute_matches_and_reruns_the_branch(mode):
    torch.manual_seed(0)
    C, n = 24, 4
    calls = []
    lin = nn.Linear(C, C)

    def branch(u):
        calls.append(1)
        return torch.tanh(lin(u))

    plain = MHCBlock(branch, C, n, mode=mode, init="paper")
    again = MHCBlock(branch, C, n, mode=mode, init="paper", recompute=True)
    again.load_state_dict(plain.state_dict())
    assert "recompute=True" in repr(again)
    x = torch.randn(3, 5, n, C)
    grads = []
    for block in (plain, again):
        calls.clear()
        xg = x.clone().requires_grad_()
        loss = block(xg).square().sum()
        assert len(calls) == 1
        loss.backward()
        # recompute runs the branch once more, in backward; without it backward calls nothing
        assert len(calls) == (2 if block.recompute else 1)
        grads.append((xg.grad, *[p.grad.clone() for p in block.parameters(recurse=False)]))
        lin.zero_grad()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["mhc", "hc"])
def test_inductor_compile_forward_and_backward_match_eager(mode, fresh_seed):
    """``torch.compile`` with inductor (not only ``aot_eager``), forward *and* backward, default Newton projection.

    The Newton solver's data-dependent iterations break the graph; what must
    hold is that the compiled pieces, inductor's generated kernels included,
    give eager's output and every gradient.
    """
    C, n = 16, 4
    block = MHCBlock(nn.Sequential(nn.Linear(C, C), nn.Tanh()), C, n, mode=mode, init="paper", fused=False)
    x = torch.randn(2, 5, n, C)
    weights = torch.randn(2, 5, n, C)

    def run(module):
        block.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_()
        out = module(x_in)
        (out * weights).sum().backward()
        return out.detach(), x_in.grad, {name: p.grad.clone() for name, p in block.named_parameters()}

    out_ref, dx_ref, grads_ref = run(block)
    torch._dynamo.reset()
    out, dx, grads = run(torch.compile(block, backend="inductor"))
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-4, atol=1e-6)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("mode", ["mhc", "hc"])
def test_coefficients_and_mixes_stay_float32_under_autocast(mode, fresh_seed):
    """bf16 autocast around a block rounds its sublayer, not its coefficients or mixes (the PyTorch path)."""
    torch.manual_seed(fresh_seed)
    n, C = 4, 32
    block = MHCBlock(lambda u: torch.zeros_like(u), C, n, mode=mode, init="paper", fused=False)
    with torch.no_grad():
        block.alpha.fill_(1.0)
    x = torch.randn(2, 8, n, C) * 10
    expected_coefficients, expected = block.coefficients(x), block(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_coefficients, got = block.coefficients(x), block(x)
    for e, g in zip(expected_coefficients, got_coefficients):
        assert g.dtype == torch.float32 and torch.equal(e, g), f"seed={fresh_seed}"
    assert torch.equal(got, expected), f"seed={fresh_seed}: the mixes ran under autocast"

    lin = torch.nn.Linear(C, C)
    with_linear = MHCBlock(lin, C, n, mode=mode, init="paper", fused=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = with_linear(x)
        assert lin(x[..., 0, :]).dtype == torch.bfloat16  # the sublayer itself still runs under autocast
    assert out.dtype == torch.float32


def test_sizes_are_read_only_and_reset_parameters_takes_one_name():
    block = MHCBlock(nn.Linear(8, 8), 8, n_streams=2, init="paper", layer_index=1)
    for name, value in (("n_streams", 3), ("hidden_size", 16), ("layer_index", -3)):
        with pytest.raises(AttributeError, match=name):
            setattr(block, name, value)
    assert (block.n_streams, block.hidden_size, block.layer_index) == (2, 8, 1)
    phi, alpha = block.phi.detach().clone(), block.alpha.detach().clone()
    with torch.no_grad():
        block.phi.zero_()
        block.alpha.fill_(5.0)
    block.reset_parameters("phi")  # one name, not its letters
    assert not torch.equal(block.phi, torch.zeros_like(phi)) and torch.equal(
        block.alpha, torch.full_like(alpha, 5.0)
    )


def test_stream_reduce_refuses_another_stream_count():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"StreamReduce\(4\) expects \[\.\.\., 4, C\], got \(2, 3, 8\)"):
        StreamReduce(4)(x)
    assert torch.allclose(StreamReduce(3)(x), x.mean(-2))


def test_site_coefficients_refuse_the_residual_mode():
    from mhc import MHCOptions
    from mhc.site import coefficients

    x = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="options.mode must be 'mhc' or 'hc', got 'residual'"):
        coefficients(x, torch.zeros(4, 8), torch.ones(3), torch.zeros(2), torch.zeros(2), torch.zeros(2, 2),
                     MHCOptions(mode="residual"))  # fmt: skip


def test_standalone_block_cast_keeps_coefficients_float32(fresh_seed):
    """``.bfloat16()`` on a bare block (no HF model around it) casts the sublayer, not the coefficients;
    ``.double()`` casts both, and a StreamReduce keeps its weights the same way."""
    torch.manual_seed(fresh_seed)
    n, C = 4, 16
    block = MHCBlock(nn.Linear(C, C), C, n, fused=False)
    reduce = StreamReduce(n, learned=True)
    own = {name: p.clone() for name, p in block.named_parameters(recurse=False)}
    assert own and all(p.dtype == torch.float32 for p in own.values())
    block.bfloat16()
    reduce.bfloat16()
    for name, p in block.named_parameters(recurse=False):
        assert p.dtype == torch.float32 and torch.equal(p, own[name]), f"{name} cast to {p.dtype}"
    assert block.branch.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in reduce.parameters())
    x = torch.randn(2, 3, n, C, dtype=torch.bfloat16)
    out = block(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert reduce(out).dtype == torch.bfloat16
    block.double()
    assert all(p.dtype == torch.float64 for p in block.parameters())
