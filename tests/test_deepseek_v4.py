"""MHCBlock.from_deepseek_v4 against transformers' own DeepSeek-V4 modules (random weights, small config)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mhc import MHCBlock, marginal_error

modeling = pytest.importorskip(
    "transformers.models.deepseek_v4.modeling_deepseek_v4", reason="this transformers has no DeepSeek-V4"
)
from transformers import DeepseekV4Config  # noqa: E402

N, C = 4, 32


def small_config(**kw) -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=C, hc_mult=N, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        q_lora_rank=16, o_lora_rank=16, index_n_heads=2, index_head_dim=16, vocab_size=64, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, sliding_window=8, use_cache=False, **kw,
    )  # fmt: skip


def fresh_generator() -> torch.Generator:
    g = torch.Generator()
    g.seed()
    return g


def randomise(hc: nn.Module, g: torch.Generator, logit_scale: float = 1.0) -> None:
    """Random fn/base/scale; ``logit_scale`` stretches the comb logits (1: about unit spread)."""
    n, width = hc.hc_mult, hc.fn.shape[1]
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * width**-0.5)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
        hc.fn[2 * n :] *= logit_scale
        hc.base[2 * n :] *= logit_scale


def decoder_formula(hc: nn.Module, branch, x: torch.Tensor) -> torch.Tensor:
    """What DeepseekV4DecoderLayer does with one hyper-connection: post ⊗ F(collapsed) + combᵀ x."""
    post, comb, collapsed = hc(x)
    return post.unsqueeze(-1) * branch(collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)


def test_site_equals_the_decoder_layer_formula_with_gradients():
    g = fresh_generator()
    seed = f"seed {g.initial_seed()}"
    torch.manual_seed(g.initial_seed())
    hc = modeling.DeepseekV4HyperConnection(small_config())
    randomise(hc, g)
    branch = nn.Sequential(nn.Linear(C, C), nn.Tanh())
    x = torch.randn(2, 7, N, C, generator=g) * 3
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = decoder_formula(hc, branch, x_ref)
    block = MHCBlock.from_deepseek_v4(hc, branch)
    assert (block.projection, block.sinkhorn_iters, block.pre_eps, block.sinkhorn_eps) == (
        "sinkhorn",
        20,
        1e-6,
        1e-6,
    )
    out = block(x_ours)
    torch.testing.assert_close(
        out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"{seed}: {m}"
    )

    W = torch.randn(ref.shape, generator=g)
    (ref * W).sum().backward()
    (out * W).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{seed}: {m}")
    # fn's comb rows are phi's res rows transposed (H_res = combᵀ); pre and post rows map one to one.
    grad_fn = hc.fn.grad
    expected_phi_grad = torch.cat(
        [grad_fn[: 2 * N], grad_fn[2 * N :].reshape(N, N, -1).transpose(0, 1).reshape(N * N, -1)]
    )
    scale = grad_fn.abs().max().item()
    torch.testing.assert_close(
        block.phi.grad, expected_phi_grad, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{seed}: {m}"
    )
    # Absolute tolerances at 1e-5 of each gradient's largest entry, as for phi: these are float32 sums
    # over tokens whose order follows the intra-op thread split, so an entry near zero can be off by a
    # few 1e-6 of the whole (3.5e-6 against a fixed atol of 1e-6 at seed 12888816320414180261, in the
    # full suite only).
    expected_b_res_grad = hc.base.grad[2 * N :].reshape(N, N).t()
    torch.testing.assert_close(block.alpha.grad, hc.scale.grad, rtol=1e-4, atol=1e-5 * hc.scale.grad.abs().max().item(),
                               msg=lambda m: f"{seed}: {m}")  # fmt: skip
    torch.testing.assert_close(
        block.b_res.grad,
        expected_b_res_grad,
        rtol=1e-4,
        atol=1e-5 * expected_b_res_grad.abs().max().item(),
        msg=lambda m: f"{seed}: {m}",
    )


def test_two_blocks_reproduce_a_whole_decoder_layer():
    """attn_hc and ffn_hc as two blocks around the layer's own attention and MoE give the layer's output."""
    g = fresh_generator()
    seed = f"seed {g.initial_seed()}"
    torch.manual_seed(g.initial_seed())
    model = modeling.DeepseekV4Model(small_config()).eval()
    layer = model.layers[1]
    for hc in (layer.attn_hc, layer.ffn_hc):
        randomise(hc, g)
    seen = {}
    layer.register_forward_pre_hook(lambda m, a, kw: seen.update(x=a[0], kw=dict(kw)), with_kwargs=True)
    layer.register_forward_hook(lambda m, a, kw, out: seen.update(out=out), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (2, 12), generator=g))
        kw = seen["kw"]
        input_ids = kw.pop("input_ids")
        attn = MHCBlock.from_deepseek_v4(
            layer.attn_hc, lambda u: layer.self_attn(layer.input_layernorm(u), **kw)[0]
        )
        ffn = MHCBlock.from_deepseek_v4(
            layer.ffn_hc, lambda u: layer.mlp(layer.post_attention_layernorm(u), input_ids=input_ids)
        )
        out = ffn(attn(seen["x"]))
    ref = seen["out"]
    torch.testing.assert_close(
        out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"{seed}: {m}"
    )


def test_newton_projects_the_same_logits_exactly():
    """projection="newton": H_res doubly stochastic to tol, and the limit DeepSeek's Sinkhorn approaches."""
    g = fresh_generator()
    seed = f"seed {g.initial_seed()}"
    torch.manual_seed(g.initial_seed())
    config = small_config()
    hc = modeling.DeepseekV4HyperConnection(config)
    randomise(hc, g, logit_scale=3.0)
    branch = nn.Linear(C, C)
    x = torch.randn(3, 5, N, C, generator=g)
    truncated = MHCBlock.from_deepseek_v4(hc, branch)
    exact = MHCBlock.from_deepseek_v4(hc, branch, projection="newton")
    H_exact = exact.coefficients(x)[2]
    assert marginal_error(H_exact).max() < 1e-5, seed
    # DeepSeek's own comb with many more rounds (and no eps) converges to the exact H_res, transposed.
    long_config = small_config(hc_sinkhorn_iters=3000, hc_eps=0.0)
    long_hc = modeling.DeepseekV4HyperConnection(long_config)
    long_hc.load_state_dict(hc.state_dict())
    _, comb_long, _ = long_hc(x)
    # (Sinkhorn converges slowly where H_res nears a permutation: 3000 rounds reach ~1e-4, not rounding.)
    torch.testing.assert_close(
        H_exact, comb_long.transpose(-1, -2), rtol=0, atol=1e-3, msg=lambda m: f"{seed}: {m}"
    )
    # The truncated H_res is not exact on these logits, and the two outputs differ by more than rounding.
    H_trunc = truncated.coefficients(x)[2]
    assert marginal_error(H_trunc).max() > marginal_error(H_exact).max(), seed
    assert (exact(x) - truncated(x)).abs().max() > 1e-5, seed


def test_from_deepseek_v4_refuses_what_does_not_fit():
    hc = modeling.DeepseekV4HyperConnection(small_config())
    randomise(hc, fresh_generator())
    branch = nn.Linear(C, C)
    with pytest.raises(ValueError, match="projection must be 'sinkhorn' or 'newton'"):
        MHCBlock.from_deepseek_v4(hc, branch, projection="lite")
    with pytest.raises(ValueError, match="takes sinkhorn_iters from the hyper-connection"):
        MHCBlock.from_deepseek_v4(hc, branch, sinkhorn_iters=5)
    with pytest.raises(TypeError, match="needs a transformers DeepseekV4HyperConnection.*Linear has no"):
        MHCBlock.from_deepseek_v4(nn.Linear(C, C), branch)
    with pytest.raises(TypeError, match="unknown option 'recompte'"):
        MHCBlock.from_deepseek_v4(hc, branch, recompte=True)
    with torch.no_grad():
        hc.base[0] = float("nan")
    with pytest.raises(ValueError, match="base holds NaN"):
        MHCBlock.from_deepseek_v4(hc, branch)
    fresh = modeling.DeepseekV4HyperConnection(small_config())
    randomise(fresh, fresh_generator())
    assert MHCBlock.from_deepseek_v4(fresh, branch, recompute=True).recompute  # other options pass through


def test_the_norm_epsilon_is_read_under_either_transformers_name():
    from mhc.hf.deepseek_v4 import read_hyper_connection

    class NormWith(nn.Module):  # eps until transformers 5.24, variance_epsilon from 5.25
        def __init__(self, **epsilon):
            super().__init__()
            for name, value in epsilon.items():
                setattr(self, name, value)

    hc = modeling.DeepseekV4HyperConnection(small_config())
    randomise(hc, fresh_generator())
    for name in ("eps", "variance_epsilon"):
        hc.input_norm = NormWith(**{name: 3e-5})
        assert read_hyper_connection(hc).norm_eps == 3e-5
    hc.input_norm = NormWith(variance_epsilon=0.0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        read_hyper_connection(hc)
    hc.input_norm = NormWith()
    with pytest.raises(TypeError, match=r"input_norm \(NormWith\) has no epsilon"):
        read_hyper_connection(hc)


def test_truncation_gap_is_what_the_two_blocks_give_and_vanishes_with_enough_rounds():
    from mhc.hf.deepseek_v4 import truncation_gap

    g = fresh_generator()
    seed = f"seed {g.initial_seed()}"
    torch.manual_seed(g.initial_seed())
    hc = modeling.DeepseekV4HyperConnection(small_config())
    randomise(hc, g, logit_scale=3.0)
    branch = nn.Linear(C, C)
    x = torch.randn(4, 6, N, C, generator=g)
    error, change = truncation_gap(hc, branch, x)
    with torch.no_grad():
        truncated, exact = (
            MHCBlock.from_deepseek_v4(hc, branch),
            MHCBlock.from_deepseek_v4(hc, branch, projection="newton"),
        )
        a, b = truncated(x), exact(x)
        expected_error = marginal_error(truncated.coefficients(x)[2]).max().item()
    expected_change = ((b - a).norm(dim=(-2, -1)) / a.norm(dim=(-2, -1))).max().item()
    assert error == pytest.approx(expected_error, rel=1e-6) and change == pytest.approx(
        expected_change, rel=1e-5
    ), seed
    assert error > 1e-3 and change > 1e-4, (
        seed,
        error,
        change,
    )  # spread-out logits: 20 rounds are not enough
    long_hc = modeling.DeepseekV4HyperConnection(small_config(hc_sinkhorn_iters=3000, hc_eps=0.0))
    long_hc.load_state_dict(hc.state_dict())
    long_error, long_change = truncation_gap(long_hc, branch, x)
    # Sinkhorn converges slowly where H_res is near a permutation: much closer, not exact.
    assert long_error < error / 10 and long_change < change / 10, (
        seed,
        error,
        change,
        long_error,
        long_change,
    )
