"""mhc.testing.assert_composite_stable: passes on exact mHC at depth, fails readably on HC and on loose Sinkhorn."""

import math

import pytest
import torch
from torch import nn

from mhc import MHCBlock, birkhoff_project, expand_streams, marginal_error
from mhc.testing import DEFAULT_MAX_MARGINAL_ERROR, assert_composite_stable

C, N, DEPTH = 8, 4, 64


def random_stack(seed: int, depth: int = DEPTH, **options) -> nn.Sequential:
    """MHCBlocks with cheap branches and random static + dynamic H_res logits (the same draw for every variant)."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for i in range(depth):
        block = MHCBlock(nn.Linear(C, C), C, N, init="paper", layer_index=i, **options)
        with torch.no_grad():
            block.b_res.add_(0.5 * torch.randn(N, N, generator=g))
            block.alpha.fill_(0.1)
        blocks.append(block)
    return nn.Sequential(*blocks)


def streams(seed: int) -> torch.Tensor:
    return expand_streams(torch.randn(2, 5, C, generator=torch.Generator().manual_seed(seed + 1)), N)


def test_passes_on_exact_mhc_at_depth_64_with_the_defaults(fresh_seed):
    report = assert_composite_stable(random_stack(fresh_seed), streams(fresh_seed))
    assert report.depth == DEPTH and report.batch_shape == (2, 5)
    worst = max(abs(g - 1) for g in report.forward_gain_max + report.backward_gain_max)
    assert worst < 1e-4, f"seed={fresh_seed}: gain off 1 by {worst}"
    assert max(report.marginal_error_max) < DEFAULT_MAX_MARGINAL_ERROR, f"seed={fresh_seed}"


def test_passes_on_an_mhc_causal_lm(fresh_seed):
    from transformers import LlamaConfig

    from mhc import MHCConfig, MHCForCausalLM

    base = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2
    )
    model = MHCForCausalLM(MHCConfig(base_config=base, n_streams=4, init="paper")).eval()
    ids = torch.randint(0, 64, (2, 7))
    report = assert_composite_stable(model, ids, model_kwargs={"use_cache": False})
    assert report.depth == 6 and report.sites[0] == "model.model.layers.0.attn_mhc", f"seed={fresh_seed}"


def test_fails_with_a_clear_report_on_hc_whose_gain_grows(fresh_seed):
    stack = random_stack(fresh_seed, mode="hc")
    with pytest.raises(AssertionError) as failure:
        assert_composite_stable(stack, streams(fresh_seed), max_gain=10.0, max_marginal_error=None)
    message = str(failure.value)
    lines = message.splitlines()
    assert lines[0].startswith(
        f"composite mapping not stable over {DEPTH} sites and 10 tokens (max_gain 10, given)"
    )
    forward = next(ln for ln in lines if ln.startswith("  - forward gain"))
    # e.g. "  - forward gain 5.6e+07 > max_gain 10: worst at depth 63 (site '63'), token (0, 2); over the limit from
    # depth 7 (site '7') on, at 54 of 64 depths"
    gain = float(forward.split()[3])
    assert gain > 10 and "worst at depth" in forward and "(site '" in forward and "token (" in forward, (
        message
    )
    assert "over the limit from depth" in forward, message
    assert any(ln.startswith("  - backward gain") for ln in lines), message
    assert "marginal error" not in message.split("per depth")[0], (
        message
    )  # not judged: max_marginal_error=None
    assert "per depth (max over tokens):" in message and " fwd gain max " in message, message
    # The same stack passes when the limit is above what it reaches.
    assert_composite_stable(stack, streams(fresh_seed), max_gain=10 * gain**2, max_marginal_error=None)


def test_fails_on_sinkhorn_whose_marginal_error_exceeds_the_limit(fresh_seed):
    stack = random_stack(fresh_seed, projection="sinkhorn", sinkhorn_iters=2)
    x = streams(fresh_seed)
    with pytest.raises(AssertionError) as failure:
        assert_composite_stable(stack, x, max_gain=1e6, max_marginal_error=1e-3)
    message = str(failure.value)
    line = next(ln for ln in message.splitlines() if ln.startswith("  - marginal error"))
    assert float(line.split()[3]) > 1e-3 and "worst at depth" in line and "token (" in line, message
    assert "gain" not in line and "  - forward gain" not in message, message  # only the marginal limit broke
    # The limit decides: a looser one passes the same model, and exact Newton passes the strict default.
    assert_composite_stable(stack, x, max_gain=1e6, max_marginal_error=10.0)
    assert_composite_stable(random_stack(fresh_seed), x)


def test_bare_h_res_tensors(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    h_res = [birkhoff_project(torch.randn(3, N, N, generator=g)) for _ in range(20)]
    report = assert_composite_stable(h_res)
    assert report.sites == [f"site {d}" for d in range(20)] and report.spread_mean == [None] * 20
    assert_composite_stable(torch.stack(h_res))
    doubled = h_res[:5] + [2 * h_res[5]] + h_res[6:]
    with pytest.raises(
        AssertionError, match=r"forward gain 2 > max_gain .*worst at depth \d+ \(site 'site \d+'\)"
    ):
        assert_composite_stable(doubled)
    nan = [h.clone() for h in h_res]
    nan[3][1, 2, 0] = math.nan
    with pytest.raises(AssertionError, match=r"forward gain nan .*from depth 3 \(site 'site 3'\)"):
        assert_composite_stable(nan, max_gain=100.0, max_marginal_error=None)
    assert marginal_error(h_res[0]).max() < DEFAULT_MAX_MARGINAL_ERROR


def test_default_max_gain_follows_the_marginal_limit():
    """Non-negative factors whose sums are within e of 1 reach at most (1 + e)^L: the default max_gain.

    A scaled identity reaches that bound and passes; a matrix with exact marginals but negative
    entries (no doubly-stochastic matrix, and what HC can learn) passes the marginal check and fails the gain.
    """
    eps = 1e-3
    h = torch.eye(N) * (1 + eps)  # marginal error 2 N eps (rows and columns)
    err = marginal_error(h).item()
    report = assert_composite_stable([h] * 10, max_marginal_error=err)
    assert report.forward_gain_max[-1] == pytest.approx((1 + eps) ** 10)
    signed = torch.tensor(
        [[1.25, -0.25], [-0.25, 1.25]]
    )  # rows and columns sum to 1; gain 1.5 per site, 1.5^10 = 57.665 at depth 9
    assert marginal_error(signed).item() == 0.0
    with pytest.raises(
        AssertionError,
        match=r"\(1 \+ max_marginal_error\) \*\* 10\):\n  - forward gain 57.665 > max_gain 1.001: "
        r"worst at depth 9 \(site 'site 9'\), the only token; over the limit from depth 0",
    ):
        assert_composite_stable([signed] * 10)
    assert_composite_stable([signed] * 10, max_gain=1.5**10 * (1 + 1e-9))


def test_bad_arguments_name_the_problem():
    h = [torch.eye(N)]
    with pytest.raises(ValueError, match="max_gain"):
        assert_composite_stable(h, max_gain=-1.0)
    with pytest.raises(TypeError, match="max_marginal_error"):
        assert_composite_stable(h, max_marginal_error=float("nan"))
    with pytest.raises(ValueError, match="give max_gain"):
        assert_composite_stable(h, max_marginal_error=None)
    with pytest.raises(TypeError, match="take none"):
        assert_composite_stable(h, torch.zeros(1))
    with pytest.raises(TypeError, match="max_gian"):
        assert_composite_stable(h, max_gian=2.0)
    with pytest.raises(ValueError, match="no MHCBlock"):
        assert_composite_stable(nn.Linear(2, 2), torch.zeros(1, 2))
    with pytest.raises(TypeError, match="nn.Module or H_res"):
        assert_composite_stable("model")
    with pytest.raises(ValueError, match="at least one"):
        assert_composite_stable([])


def test_a_gain_just_past_the_limit_reads_as_past_it():
    """A gain 2.6e-7 over max_gain=1 printed at 6 significant digits would read "1 > max_gain 1"."""
    H = torch.tensor([[1.0, 0.0], [0.0, 1.0 + 2.6e-7]], dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"gain 1\+2\.6e-07 > max_gain 1"):
        assert_composite_stable([H], max_gain=1.0)
