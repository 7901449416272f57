"""The fused site at decode sizes: the token kernels (:mod:`mhc.fused.tokens`) and the no-grad path.

A few tokens (at most ``mhc.fused.tokens.MAX_TOKENS``) run both forward steps on the CUDA extension's
one-block-per-token kernels in every mode; on the CPU (Triton's interpreter) the same token counts run the
Triton kernels, so the CPU tests here check the site at those sizes and the CUDA tests the token kernels.
Shares its blocks and comparisons with tests/test_fused_block.py.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_block import (  # noqa: F401
    DEVICE,
    NO_CUDA,
    _blocks,
    _compare,
    _compare_against_float64,
    _rel,
    pytestmark,
)

import mhc


# 129 is where CUDA leaves the token kernels for Triton's; on the CPU both sides run Triton's interpreter, so
# there it only adds time to the default tier and runs in the slow one.
@pytest.mark.parametrize(
    "token_count",
    [1, 5, 16, 64, 129 if torch.cuda.is_available() else pytest.param(129, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_site_at_few_tokens_matches_reference(token_count, n, dtype, fresh_seed):
    """Decode-sized token counts (on CUDA up to mhc.fused.tokens.MAX_TOKENS = 128 take the token kernels,
    129 the Triton ones): forward and backward match the reference, and a second call gives the same bits.
    C = 200 is not a multiple of 128."""
    C = 200
    ref, fast = _blocks(n, C, dtype, fresh_seed)
    x = torch.randn(token_count, n, C, device=DEVICE).to(dtype)
    if dtype == torch.float32:
        _compare(ref, fast, x, 1e-5, 1e-4)
    else:
        _compare_against_float64(ref, fast, x)
    with torch.no_grad():
        first = fast(x)
        assert torch.equal(fast(x), first), f"seed={fresh_seed}: a second call differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_site_without_grad_matches_the_recorded_forward(dtype, fresh_seed):
    """Under no_grad (generation) the site runs its kernels without autograd nodes: the recorded
    forward's bits, at decode sizes (mhc.fused.tokens on CUDA) and above."""
    n, C = 4, 72
    _, fast = _blocks(n, C, dtype, fresh_seed)
    for token_count in (1, 3, 16, 300):
        x = torch.randn(token_count, n, C, device=DEVICE, dtype=dtype) * 2
        recorded = fast(x.clone().requires_grad_())
        with torch.no_grad():
            plain = fast(x)
        assert plain.grad_fn is None and recorded.grad_fn is not None
        assert torch.equal(plain, recorded.detach()), f"seed={fresh_seed}: {token_count} tokens"


@pytest.mark.skipif(DEVICE != "cuda", reason=NO_CUDA)
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("C", [72, 200, 768, 1100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_kernels_match_the_triton_steps(n, C, dtype, fresh_seed):
    """mhc.fused.tokens (at most MAX_TOKENS tokens) against the Triton kernel sequences of mhc.fused.steps:
    u, h, H_res and x', then the whole site with grad against the PyTorch reference. On the H200 a token's
    columns are split over a cluster of ceil(C / 128) blocks, at most 8: C = 72 runs one block, 200 two,
    768 six and 1100 eight, with a ragged last block."""
    from mhc.fused import plan as fused_plan
    from mhc.fused import steps as fused_steps
    from mhc.fused import tokens as fused_tokens

    ref, fast = _blocks(n, C, dtype, fresh_seed)
    params = [p.detach() for p in (fast.phi, fast.alpha, fast.b_pre, fast.b_post, fast.b_res)]
    for token_count in (1, 5, 16, fused_tokens.MAX_TOKENS):
        x = torch.randn(token_count, n, C, device="cuda", dtype=dtype) * 3
        assert fused_tokens.takes(x)
        plan = fused_plan.plan_for(x)
        u_t, zr_t, h_t, res_t = fused_steps.pre_forward(plan, x, *params, fast.norm_eps, fast.tol)
        u_k, zr_k, h_k, res_k = fused_tokens.pre(x, *params, fast.norm_eps, _projection_tol(fast.tol, n), 100)
        # The token kernels' products are float32 FMAs; the Triton kernel's, for bf16 streams, take φ in
        # two bf16 parts (16 significant bits): that one is the rounder of the two.
        xf = x.double().reshape(token_count, n * C)
        z64 = xf @ params[0].double().T * (xf.square().mean(-1, keepdim=True) + fast.norm_eps).rsqrt()
        assert _rel(zr_k[:, :-1], z64) < 1e-5, f"seed={fresh_seed}, T={token_count}"
        loose = 1e-5 if dtype == torch.float32 else 1e-4  # bf16x2 against exact products
        assert _rel(zr_k, zr_t) < loose and _rel(h_k, h_t) < loose, f"seed={fresh_seed}, T={token_count}"
        assert _rel(res_k, res_t) < 10 * loose, f"seed={fresh_seed}, T={token_count}"
        assert float(mhc.marginal_error(res_k).max()) <= 1e-5, f"seed={fresh_seed}"
        assert _rel(u_k, u_t) < (1e-5 if dtype == torch.float32 else 8e-3), f"seed={fresh_seed}"
        y = torch.randn(token_count, C, device="cuda", dtype=dtype)
        out_k = fused_tokens.post(x, y, h_t, res_t)
        out_t = fused_steps.post_forward(plan, x, y, h_t, res_t)
        assert _rel(out_k, out_t) < (1e-6 if dtype == torch.float32 else 4e-3), f"seed={fresh_seed}"
        lead = torch.randn(2, 3, n, C, device="cuda", dtype=dtype)  # any leading shape
        assert fused_tokens.pre(lead, *params, fast.norm_eps, 1e-6, 100)[0].shape == (2, 3, C)
        # the site with grad (token kernels forward, Triton backward) against the reference
        if dtype == torch.float32:
            _compare(ref, fast, x, 1e-5, 1e-4)
        else:
            _compare_against_float64(ref, fast, x)
    # NaN in one token stays in that token
    x = torch.randn(4, n, C, device="cuda", dtype=dtype)
    x[2, 1, 3] = float("nan")
    u_k, _, h_k, res_k = fused_tokens.pre(x, *params, fast.norm_eps, _projection_tol(fast.tol, n), 100)
    assert torch.isnan(res_k[2]).all() and torch.isfinite(res_k[[0, 1, 3]]).all()
    assert torch.isfinite(u_k[[0, 1, 3]]).all()


def _projection_tol(tol, n):
    return mhc.projection.effective_tol(tol, n, torch.float32)


@pytest.mark.skipif(DEVICE != "cuda", reason=NO_CUDA)
@pytest.mark.parametrize("token_count", [1, 16])
def test_fused_decode_site_replays_in_a_cuda_graph(token_count, fresh_seed):
    """A no-grad site (a decode step's) is capturable: replays give the eager result for new inputs."""
    n, C = 4, 256
    _, fast = _blocks(n, C, torch.bfloat16, fresh_seed)
    static_x = torch.randn(token_count, n, C, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):  # plans, kept variants and the projection's poll set up before capture
            fast(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fast(static_x)
        for _ in range(2):
            x = torch.randn_like(static_x)
            static_x.copy_(x)
            graph.replay()
            assert torch.equal(static_out, fast(x)), f"seed={fresh_seed}: replay differs from eager"


@pytest.mark.skipif(DEVICE != "cuda", reason=NO_CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_grad_token_path_takes_what_the_grad_path_takes(dtype, fresh_seed):
    """The no-grad token call (mhc.fused.tokens.pre_no_grad / post_no_grad) converts what the grad path's
    Python does: strided streams, coefficients cast to bf16, a branch output in another dtype. Same bits
    as the recorded forward; None (the Triton path) for more than MAX_TOKENS tokens or float64."""
    from mhc.fused import tokens as fused_tokens

    n, C = 4, 200

    class Widen(torch.nn.Module):  # returns float32 for bf16 streams
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(C, C, device="cuda", dtype=dtype)

        def forward(self, u):
            return self.lin(u).float()

    torch.manual_seed(fresh_seed)
    block = mhc.MHCBlock(Widen(), C, n, init="paper").cuda()
    with torch.no_grad():
        block.phi.normal_(std=0.05)
    wide = torch.randn(3, 2 * n, C, device="cuda", dtype=dtype)
    for streams in (wide[:, ::2], wide[:, 1::2]):  # non-contiguous
        assert not streams.is_contiguous()
        recorded = block(streams.clone().requires_grad_())
        with torch.no_grad():
            plain = block(streams)
        assert torch.equal(plain, recorded.detach()), f"seed={fresh_seed}"
    low = mhc.MHCBlock(Widen(), C, n, init="paper").cuda()
    low.load_state_dict(block.state_dict())
    for name in ("phi", "alpha", "b_pre", "b_post", "b_res"):
        setattr(low, name, torch.nn.Parameter(getattr(low, name).detach().to(torch.bfloat16)))
    x = torch.randn(5, n, C, device="cuda", dtype=dtype)
    recorded = low(x.clone().requires_grad_())
    with torch.no_grad():
        assert torch.equal(low(x), recorded.detach()), f"seed={fresh_seed}: bf16 coefficients"
    params = [p.detach() for p in (block.phi, block.alpha, block.b_pre, block.b_post, block.b_res)]
    big = torch.randn(fused_tokens.MAX_TOKENS + 1, n, C, device="cuda", dtype=dtype)
    assert fused_tokens.pre_no_grad(big, *params, 1e-6, 1e-6) is None
    assert fused_tokens.pre_no_grad(x.double(), *params, 1e-6, 1e-6) is None
    u, mix, streams, normed = fused_tokens.pre_no_grad(x, *params, 1e-6, 1e-6)
    h, H_res = fused_tokens.unpack(mix, n)
    assert (
        u.shape == (5, C)
        and h.shape == (5, 2 * n)
        and H_res.shape == (5, n, n)
        and streams.data_ptr() == x.data_ptr()
    )
    assert normed is None  # no norm asked for
    with pytest.raises(RuntimeError, match="phi"):
        fused_tokens.pre_no_grad(x, params[0][:, :-1], *params[1:], 1e-6, 1e-6)


@pytest.mark.skipif(DEVICE != "cuda", reason=NO_CUDA)
def test_grad_switched_on_inside_the_branch_still_records_the_post_mix(fresh_seed):
    """A branch that turns grad on and leaves it on after a no-grad pre-step: the post-mix is recorded
    (the gradient reaches the branch through y), and its value is the
    plain forward's."""
    n, C = 4, 64
    torch.manual_seed(fresh_seed)
    lin = torch.nn.Linear(C, C).cuda()

    def branch(u):
        torch.set_grad_enabled(True)
        return lin(u)

    block = mhc.MHCBlock(branch, C, n, init="paper").cuda()
    x = torch.randn(3, n, C, device="cuda")
    try:
        with torch.no_grad():
            out = block(x)
            assert torch.is_grad_enabled()
            out.sum().backward()
    finally:
        torch.set_grad_enabled(True)
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()
    plain = mhc.MHCBlock(lin, C, n, init="paper").cuda()
    plain.load_state_dict(block.state_dict(), strict=False)  # the coefficients; the branch is lin itself
    with torch.no_grad():
        assert torch.equal(out.detach(), plain(x)), f"seed={fresh_seed}"


def test_decode_under_autocast_gives_the_branch_float32_and_matches_the_grad_path(fresh_seed):
    """float32 weights, bf16 streams, bf16 autocast, no grad, decode-sized token counts: the branch gets u in
    float32 (mhc.site.branch_input_dtype), which the token kernels do not write, so the site runs the Triton
    kernels instead (on CUDA) and gives the recorded forward's bits; linked sites do not hand over a bf16 u."""
    from test_fused_block import _RecordingBranch, fused_block

    torch.manual_seed(fresh_seed)
    n, C = 4, 64
    blocks = [fused_block(_RecordingBranch(C), C, n, layer_index=i, init="paper") for i in range(2)]
    blocks[0].set_next_site(blocks[1])
    for token_count in (1, 16):
        x = torch.randn(token_count, n, C, device=DEVICE).bfloat16()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            recorded = blocks[1](blocks[0](x.clone().requires_grad_()))
            with torch.no_grad():
                plain = blocks[1](blocks[0](x))
        assert all(u.dtype == torch.float32 for b in blocks for u in b.branch.seen)
        assert torch.equal(plain, recorded.detach()), f"seed={fresh_seed}, {token_count} tokens"
        for b in blocks:
            b.branch.seen.clear()
