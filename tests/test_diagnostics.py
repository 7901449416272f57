"""Composite mapping across many layers: mHC stays doubly stochastic, HC drifts."""

import itertools
import json
import math
import runpy
import sys
import warnings

import matplotlib.image
import pytest
import torch
from torch import nn

from mhc import MHCBlock, expand_streams, marginal_error
from mhc.diagnostics import (
    backward_gain,
    collect_h_res,
    collect_sites,
    composite_gains,
    composite_mapping,
    forward_gain,
    logit_scale,
    near_zero_or_one,
    one_hot_rows,
    plot_report,
    report_from_h_res,
    report_from_sites,
    stability_report,
    stream_spread,
    suffix_backward_gain,
    token_gains,
)

C, N, LAYERS = 16, 4, 160


def random_stack(mode: str, seed: int) -> nn.Sequential:
    """A deep stack whose static and dynamic H_res logits are random (the same draw for every mode)."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for i in range(LAYERS):
        block = MHCBlock(nn.Linear(C, C), C, N, mode=mode, init="paper", layer_index=i)
        with torch.no_grad():
            block.b_res.add_(0.5 * torch.randn(N, N, generator=g))
            block.alpha.fill_(0.1)
        blocks.append(block)
    return nn.Sequential(*blocks)


def test_composite_of_raw_tensors():
    H = torch.stack([2 * torch.eye(3)] * 5)
    gains = composite_gains(H)
    torch.testing.assert_close(gains.forward_gain, 2.0 ** torch.arange(1, 6, dtype=torch.float64))
    torch.testing.assert_close(gains.spectral_norm, gains.forward_gain)
    A = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    P = composite_mapping([A, A.t()])
    torch.testing.assert_close(P[1], (A.t() @ A).double())
    gains = composite_gains([torch.tensor([[1.0, -2.0], [0.0, 0.5]])])
    assert gains.forward_gain.item() == 3.0 and gains.backward_gain.item() == 2.5


def test_mhc_composite_stays_doubly_stochastic_over_many_layers():
    seed = torch.seed()  # reseeds the global RNG: torch.manual_seed(seed) replays a failing run
    stack = random_stack("mhc", seed)
    x = expand_streams(torch.randn(8, C), N)
    h_res = collect_h_res(stack, x)
    assert len(h_res) == LAYERS and h_res[0].shape == (8, N, N)
    P = composite_mapping(h_res)
    error = marginal_error(P).max().item()
    assert error <= 1e-4, f"seed={seed}: marginal error {error}"
    gains = composite_gains(h_res)
    for name, series in (("forward", gains.forward_gain), ("backward", gains.backward_gain)):
        worst = (series - 1).abs().max().item()
        assert worst <= 1e-4, f"seed={seed}: {name} gain off 1 by {worst}"
    spectral = gains.spectral_norm.max().item()
    assert spectral <= 1 + 1e-4, f"seed={seed}: spectral norm {spectral}"


def test_hc_composite_drifts_far_from_one():
    seed = torch.seed()  # reseeds the global RNG: torch.manual_seed(seed) replays a failing run
    x = expand_streams(torch.randn(8, C), N)
    hc = composite_gains(collect_h_res(random_stack("hc", seed), x))
    mhc = composite_gains(collect_h_res(random_stack("mhc", seed), x))
    hc_fwd, hc_bwd, mhc_fwd = (
        hc.forward_gain[-1].item(),
        hc.backward_gain[-1].item(),
        mhc.forward_gain[-1].item(),
    )
    assert hc_fwd > 100 and hc_bwd > 100, f"seed={seed}: hc gains {hc_fwd}, {hc_bwd}"
    assert hc_fwd > 100 * mhc_fwd, f"seed={seed}: hc {hc_fwd} vs mhc {mhc_fwd}"


def test_bad_input_raises():
    with pytest.raises(ValueError):
        composite_gains([])
    with pytest.raises(ValueError):
        composite_mapping(torch.randn(3, 2, 4))
    with pytest.raises(ValueError, match="no MHCBlock"):
        collect_h_res(nn.Linear(2, 2), torch.randn(1, 2))


# ----------------------------------------------------------------------------- orientation


def static_hc_stack(h_res: list[torch.Tensor], branch=None) -> nn.Sequential:
    """HC blocks with alpha = 0 (static coefficients): H_res = the given matrix, H_post = 0 (branch ignored),
    so the stack is exactly x -> H_res^{L-1} ... H_res^0 x."""
    n = h_res[0].shape[0]
    blocks = []
    for i, h in enumerate(h_res):
        block = MHCBlock(branch or nn.Linear(1, 1), 1, n, mode="hc", layer_index=i)
        with torch.no_grad():
            block.alpha.zero_()
            block.b_post.zero_()
            block.b_res.copy_(h)
        blocks.append(block)
    return nn.Sequential(*blocks).double()


def sign_vectors(n: int) -> torch.Tensor:
    """All 2^n vectors of +-1, [2^n, n] float64."""
    return torch.tensor(list(itertools.product((-1.0, 1.0), repeat=n)), dtype=torch.float64)


def test_orientation_forward_is_row_sums_backward_is_column_sums_later_sites_on_the_left():
    """Pinned against what the streams do: a non-symmetric, non-commuting pair of H_res.

    The forward gain must be the most the stack can grow an input of max-norm 1 (sup over sign
    vectors, the max row sum of the composite), the backward gain the most it can grow a gradient
    of max-norm 1 (autograd, the max column sum). Swapping rows and columns, or multiplying the
    sites in the other order, gives other numbers for these matrices.
    """
    A = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 1.0]])
    B = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 3.0, 1.0]])  # BA: rows 3, cols 4; AB: 4, 5.5
    stack = static_hc_stack([A, B])
    s = sign_vectors(3).unsqueeze(-1)  # [8, n, C=1]: every corner of the max-norm ball
    out = stack(s)
    torch.testing.assert_close(out, (B @ A).double() @ s)  # x_2 = H^1 H^0 x_0
    sup_forward = out.abs().amax((-2, -1)).max().item()
    x = torch.zeros(8, 3, 1, dtype=torch.float64, requires_grad=True)
    (stack(x) * s).sum().backward()  # the gradient of <g, x_2> for every sign vector g at once
    sup_backward = x.grad.abs().amax((-2, -1)).max().item()

    gains = composite_gains(collect_h_res(stack, torch.zeros(1, 3, 1, dtype=torch.float64)))
    forward, backward = gains.forward_gain[-1].item(), gains.backward_gain[-1].item()
    assert forward == pytest.approx(sup_forward) and backward == pytest.approx(sup_backward)
    assert (forward, backward) == (3.0, 4.0)
    # The example tells the conventions apart: fwd != bwd, and the other order gives other gains.
    other_order = composite_gains([B, A])
    assert abs(forward - backward) > 0.5, (forward, backward)
    assert abs(other_order.forward_gain[-1].item() - forward) > 0.5, (other_order.forward_gain, forward)
    report = report_from_h_res([A, B])
    assert report.forward_gain_max[-1] == pytest.approx(forward) and report.backward_gain_max[
        -1
    ] == pytest.approx(backward)


def test_suffix_backward_gain_is_the_gradient_path_back_to_each_depth():
    g = torch.Generator().manual_seed(0)
    H = [torch.randn(4, 4, generator=g) for _ in range(5)]
    got = suffix_backward_gain(H)
    for d in range(5):
        S = torch.eye(4, dtype=torch.float64)
        for h in H[d:]:
            S = h.double() @ S  # H^{L-1} ... H^d
        assert got[d].item() == pytest.approx(S.abs().sum(0).max().item()), d


# ----------------------------------------------------------------------------- per-token summaries, collapse, saturation


def test_token_gains_mean_max_and_worst_token():
    """Three tokens, one of them with a gain of 3: its position is reported, the mean is (1 + 1 + 3) / 3."""
    eye = torch.eye(2).expand(1, 3, 2, 2).clone()
    big = eye.clone()
    big[0, 2] = torch.tensor([[1.0, 2.0], [0.0, 1.0]])  # row sums 3, 1; column sums 1, 3
    report = report_from_h_res([eye, big])
    assert report.batch_shape == (1, 3)
    assert report.forward_gain_max == [1.0, 3.0] and report.forward_gain_token[1] == (0, 2)
    assert report.forward_gain_mean[1] == pytest.approx(5 / 3)
    assert report.backward_gain_max[1] == 3.0 and report.backward_gain_token[1] == (0, 2)
    tg = token_gains([eye, big])
    assert tg.forward.shape == (2, 1, 3) and tg.forward[1, 0].tolist() == [1.0, 1.0, 3.0]
    assert report.marginal_error_max[1] == pytest.approx(4.0) and report.marginal_error_token[1] == (0, 2)


def test_stream_spread_and_saturation_values():
    x = torch.randn(5, 1, 8).expand(5, 4, 8)
    assert stream_spread(x).abs().max().item() < 1e-12  # four copies: collapsed
    one = torch.zeros(4, 8)
    one[2] = torch.randn(8)
    assert stream_spread(one).item() == pytest.approx(math.sqrt(1 - 1 / 4))
    assert stream_spread(torch.stack([one[2], -one[2]])).item() == pytest.approx(1.0)  # streams that cancel
    report = report_from_h_res([torch.eye(4), torch.full((4, 4), 0.25), torch.tensor([[0.9995, 0.0005], [0.0005, 0.9995]])
                                .repeat(2, 2) / 2])  # fmt: skip
    assert report.h_res_saturated_entries[:2] == [1.0, 0.0] and report.h_res_saturated_rows[:2] == [1.0, 0.0]
    assert report.h_res_saturated_rows[2] == 0.0  # 0.49975 is far from 1
    assert report.spread_mean == [None] * 3 and report.pre_saturated == [None] * 3


def test_collect_sites_reads_collapse_and_sigmoid_saturation_of_a_model():
    """Identical streams into site 0 have spread 0; b_pre = +-30 puts every H_pre in the sigmoid's flat part."""
    seed = torch.seed()
    stack = random_stack("mhc", seed)[:3]
    with torch.no_grad():
        stack[1].b_pre.copy_(torch.tensor([30.0, -30.0, 30.0, -30.0]))
        stack[1].alpha.zero_()
    x = expand_streams(torch.randn(2, 5, C), N)
    report = stability_report(stack, x)
    assert report.spread_mean[0] == 0.0 and report.spread_mean[1] > 1e-3, (seed, report.spread_mean)
    assert report.pre_saturated[1] == 1.0 and report.pre_saturated[0] == 0.0, (seed, report.pre_saturated)
    assert report.post_saturated[1] == 0.0, seed
    assert report.grad_ratio == [None] * 3  # no backward pass asked for
    records = collect_sites(stack, x)
    assert [r.name for r in records] == ["0", "1", "2"] and records[0].h_pre.shape == (2, 5, N)


@pytest.mark.parametrize("projection", ["newton", "sinkhorn", "lite"])
def test_logit_scale_is_the_spread_of_what_the_projection_received(projection, monkeypatch):
    """Each site's logit scale against the logits its projection was called with, captured at the call (the
    projection is wrapped, so the oracle is the tensor it really saw, not a second derivation); per token,
    then mean and max in the report."""
    import mhc.site

    name = {
        "newton": "birkhoff_project",
        "sinkhorn": "sinkhorn_h_res_unchecked",
        "lite": "lite_h_res_unchecked",
    }
    seen = []
    project = getattr(mhc.site, name[projection])

    def capture(logits, *args, **kwargs):
        seen.append(logits.detach().clone())
        return project(logits, *args, **kwargs)

    monkeypatch.setattr(mhc.site, name[projection], capture)
    seed = torch.seed()
    stack = nn.Sequential(
        *(
            MHCBlock(nn.Linear(C, C), C, N, init="paper", layer_index=i, projection=projection)
            for i in range(3)
        )
    )
    with torch.no_grad():
        for block in stack:
            block.b_res.add_(torch.randn(block.b_res.shape))
            block.alpha.fill_(1.0)  # the dynamic part varies the logits from token to token
    x = torch.randn(2, 5, N, C)
    records = collect_sites(stack, x)
    report = report_from_sites(records)
    # collect_sites runs each block forward, then its coefficients again: the second call of each pair
    assert len(seen) == 6, len(seen)
    for d, r in enumerate(records):
        logits = seen[2 * d + 1]
        expected = logits.double().reshape(2, 5, -1).std(-1, correction=0)
        assert logits.shape[-1] == (math.factorial(N) if projection == "lite" else N)
        torch.testing.assert_close(r.logit_scale, expected, rtol=1e-6, atol=1e-9)
        assert report.logit_scale_mean[d] == pytest.approx(expected.mean().item(), rel=1e-6)
        assert report.logit_scale_max[d] == pytest.approx(expected.max().item(), rel=1e-6)
        assert expected.max() > expected.min() * (1 + 1e-3), seed  # tokens differ: a mean and a max
    assert "logit std" in report.table()


def test_logit_scale_is_none_without_a_projection_and_reads_sigma_for_iid_logits():
    stack = random_stack("hc", 0)[:2]
    records = collect_sites(stack, torch.randn(3, N, C))
    assert [r.logit_scale for r in records] == [None, None]
    report = report_from_sites(records)
    assert report.logit_scale_mean == [None, None] and report.logit_scale_max == [None, None]
    assert report_from_h_res([torch.eye(3)]).logit_scale_max == [None]
    # The population standard deviation of r i.i.d. N(0, σ²) draws has mean σ·sqrt((r-1)/r)·c4(r), 0.968·0.984·σ
    # at r = 16 (6.67 for σ = 7); the mean over 20000 tokens is within 0.05 of it (its own spread is 0.009), and
    # the Bessel-corrected deviation (6.88) or the variance would be far off.
    sigma, r = 7.0, 16
    c4 = math.sqrt(2 / (r - 1)) * math.exp(math.lgamma(r / 2) - math.lgamma((r - 1) / 2))
    scale = logit_scale(sigma * torch.randn(20000, r))
    assert scale.dtype == torch.float64 and scale.shape == (20000,)
    assert scale.mean().item() == pytest.approx(sigma * math.sqrt((r - 1) / r) * c4, abs=0.05)
    assert logit_scale(torch.full((3, 16), 2.5)).abs().max().item() == 0.0  # a constant shift has no spread


@pytest.mark.parametrize("mode", ["mhc", "hc"])
def test_grad_ratio_is_the_measured_gradient_norm_back_to_each_depth(mode):
    """With static coefficients (alpha = 0) and a zero branch, the gradient reaching depth d is
    exactly S_d^T g for S_d = H^{L-1} ... H^d, so the measured ratio is ||S_d^T g|| / ||g||."""
    seed = torch.seed()
    stack = random_stack(mode, seed)[:6]
    with torch.no_grad():
        for block in stack:  # a zero Linear: y = 0 and no gradient into u
            block.branch.weight.zero_()
            block.branch.bias.zero_()
            block.alpha.zero_()
    x = expand_streams(torch.randn(3, C), N).requires_grad_()
    w = torch.randn(3, N, C)
    report = stability_report(stack, x, loss_fn=lambda y: (y * w).sum())
    H = [h.double() for h in collect_h_res(stack, x)]
    for d in range(6):
        S = torch.eye(N, dtype=torch.float64)
        for h in H[d:]:
            S = h @ S
        expected = (S.transpose(-1, -2) @ w.double()).norm() / w.double().norm()
        assert report.grad_ratio[d] == pytest.approx(expected.item(), rel=1e-5), (seed, d)
    if mode == "mhc":  # doubly stochastic: the residual path cannot grow the gradient
        assert max(report.grad_ratio) <= 1 + 1e-5 and max(report.predicted_backward_gain) <= 1 + 1e-5, seed


def test_report_table_and_figure(tmp_path):
    seed = torch.seed()
    x = expand_streams(torch.randn(2, 3, C), N).requires_grad_()
    report = stability_report(random_stack("hc", seed)[:8], x, loss_fn=lambda y: y.square().sum())
    table = report.table()
    lines = table.splitlines()
    assert lines[0].startswith("8 sites, 6 tokens") and "fwd max" in lines[1] and "grad ratio" in lines[1]
    assert len([ln for ln in lines if ln.lstrip()[:1].isdigit() and " hc " in ln]) == 8, table
    path = plot_report(report, tmp_path / "fig" / "s.png", title="hc")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(path).shape[:2] == (800, 1100)
    d = report.as_dict()
    assert json.loads(json.dumps(d))["forward_gain_max"] == report.forward_gain_max
    with pytest.raises(ValueError, match="png"):
        plot_report(report, tmp_path / "s.svg")
    with pytest.raises(ValueError, match="eps"):
        report_from_h_res([torch.eye(2)], eps=0.7)
    with pytest.raises(ValueError, match="one shape"):
        report_from_h_res([torch.eye(2), torch.eye(3)])


# ----------------------------------------------------------------------------- the command line


def _diagnostics_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``python -m mhc.diagnostics ARGV`` run in this process (runpy, as ``-m`` does)."""
    old = sys.argv
    sys.argv = ["mhc.diagnostics", *argv]
    try:
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_module("mhc.diagnostics", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = old
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


TINY_RUN = dict(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seq_len=32, batch_size=4, data="stdlib",
    max_corpus_mb=0.3, max_steps=3, warmup_steps=1, eval_interval=0, eval_batches=1, ckpt_interval=0,
    progress=False, plots=False, threads=1,
)  # fmt: skip


def test_cli_on_a_train_lm_run_dir(tmp_path, cli, capsys):
    """What the README's main job writes (a run's model/ with its tokenizer), at a tiny size: table and PNG."""
    sets = sum((["--set", f"{k}={v}"] for k, v in {**TINY_RUN, "cache_dir": tmp_path / "cache"}.items()), [])
    assert cli.main(["--run-dir", str(tmp_path / "run"), *sets]) == 0
    capsys.readouterr()
    model_dir = tmp_path / "run" / "model"
    code, out, err = _diagnostics_cli([str(model_dir), "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, err
    assert "MHCForCausalLM, 4 sites, mode=mhc" in out and "tokenizer of" in out, out
    rows = [ln for ln in out.splitlines() if ln.lstrip()[:1].isdigit() and "_mhc" in ln]
    assert [ln.split()[1] for ln in rows] == [
        f"model.model.layers.{i}.{s}_mhc" for i in (0, 1) for s in ("attn", "mlp")
    ]
    assert (model_dir / "stability.png").read_bytes()[
        :8
    ] == b"\x89PNG\r\n\x1a\n" and f"figure: {model_dir}" in out
    numbers = json.loads((tmp_path / "r.json").read_text())
    assert max(numbers["marginal_error_max"]) < 1e-4 and all(r is not None for r in numbers["grad_ratio"])
    assert max(abs(g - 1) for g in numbers["forward_gain_max"] + numbers["backward_gain_max"]) < 1e-4
    text = tmp_path / "t.txt"
    text.write_text("print('hello')\n" * 20)
    code, out, err = _diagnostics_cli(
        [str(model_dir), "--text", str(text), "--out", str(tmp_path / "o.png")], capsys
    )
    assert code == 0 and "32 tokens (--text" in out and (tmp_path / "o.png").is_file(), out + err
    code, out, err = _diagnostics_cli(
        [str(tmp_path / "run"), "--no-backward"], capsys
    )  # the run dir: its model/
    assert code == 0 and out.startswith(f"{model_dir}: MHCForCausalLM"), out + err


def test_cli_on_a_converted_model_without_tokenizer_and_bad_input(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from mhc import convert_to_mhc

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=64))  # fmt: skip
    convert_to_mhc(base, n_streams=2).save_pretrained(tmp_path / "conv")
    code, out, err = _diagnostics_cli([str(tmp_path / "conv"), "--no-backward", "--max-tokens", "20"], capsys)
    assert code == 0, err
    assert "20 tokens" in out and "UTF-8 bytes" in out and "n_streams=2" in out, out
    code, _, err = _diagnostics_cli([str(tmp_path / "nothing")], capsys)
    assert code == 2 and "no config.json" in err
    small = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))  # fmt: skip
    convert_to_mhc(small, n_streams=2).save_pretrained(tmp_path / "small")
    code, _, err = _diagnostics_cli([str(tmp_path / "small")], capsys)
    assert code == 2 and "outside the model's vocabulary of 50" in err
    small.save_pretrained(tmp_path / "plain")
    code, _, err = _diagnostics_cli([str(tmp_path / "plain")], capsys)
    assert code == 2 and "no mHC sites" in err


def test_cli_tokenizes_with_the_tokenizer_saved_beside_the_model(tmp_path, capsys):
    """A word-level tokenizer in the folder: 2 ids per "hello world", not 12 bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from mhc import convert_to_mhc

    base = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=64))  # fmt: skip
    convert_to_mhc(base, n_streams=2).save_pretrained(tmp_path / "m")
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "m")
    (tmp_path / "t.txt").write_text("hello world " * 5)
    code, out, err = _diagnostics_cli([str(tmp_path / "m"), "--text", str(tmp_path / "t.txt")], capsys)
    assert code == 0, err
    assert "; 10 tokens (--text" in out and "tokenizer of" in out, out


def test_grad_ratio_with_activation_checkpointing_records_each_site_once():
    """An HF model with gradient checkpointing re-runs its layers in backward: still one record per site."""
    from transformers import LlamaConfig

    from mhc import MHCConfig, MHCForCausalLM

    torch.manual_seed(0)
    base = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    model = MHCForCausalLM(MHCConfig(base_config=base, n_streams=4, init="paper"))
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name; the old one warns
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 64, (1, 8))
    plain = stability_report(model, input_ids=ids, labels=ids, loss_fn=lambda out: out.loss)
    assert plain.depth == 4 and all(r is not None and r > 0 for r in plain.grad_ratio), plain.grad_ratio


# ----------------------------------------------------------------------------- argument checks (issue #52)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: forward_gain([[1.0]]), TypeError, "M must be a torch.Tensor"),
        (lambda: backward_gain(torch.ones(3)), ValueError, r"M must be \[\.\.\., n, n\], got \(3,\)"),
        (lambda: forward_gain(torch.ones(2, 3, 4)), ValueError, r"got \(2, 3, 4\)"),
        (lambda: stream_spread([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
        (lambda: stream_spread(torch.ones(5)), ValueError, r"x must be \[\.\.\., n, C\], got \(5,\)"),
        (lambda: near_zero_or_one([0.5], 1e-3), TypeError, "values must be a torch.Tensor"),
        (
            lambda: near_zero_or_one(torch.ones(3), -1e-3),
            ValueError,
            "eps must be finite and >= 0, got -0.001",
        ),
        (lambda: near_zero_or_one(torch.ones(3), math.nan), ValueError, "eps must be finite"),
        (lambda: near_zero_or_one(torch.ones(3), "0.1"), TypeError, "eps must be a real number"),
        (lambda: one_hot_rows(torch.eye(3), math.inf), ValueError, "eps must be finite"),
        (lambda: one_hot_rows(torch.ones(3), 1e-3), ValueError, r"h_res must be \[\.\.\., n, n\]"),
        (lambda: one_hot_rows(torch.ones(2, 3), 1e-3), ValueError, r"h_res must be \[\.\.\., n, n\]"),
        (lambda: logit_scale(torch.ones(3, dtype=torch.int64)), TypeError, "logits must be a floating-point"),
        (lambda: logit_scale(torch.tensor(1.0)), ValueError, r"logits must be \[\.\.\., r\]"),
        (lambda: logit_scale(torch.ones(2, 0)), ValueError, r"logits must be \[\.\.\., r\]"),
        (lambda: collect_sites("model"), TypeError, "model must be an nn.Module"),
        (
            lambda: collect_sites(nn.Linear(2, 2), loss_fn="mean"),
            TypeError,
            "loss_fn must be callable or None",
        ),
        (
            lambda: stability_report(nn.Linear(2, 2), torch.ones(1, 2), eps=2.0),
            ValueError,
            r"eps must be a number in \(0, 0.5\)",
        ),
        (lambda: report_from_h_res([torch.eye(3)], eps="0.1"), TypeError, "eps must be a real number"),
        (lambda: report_from_h_res([torch.eye(3)], names=[7]), TypeError, "names must be strings"),
        (
            lambda: report_from_h_res([torch.eye(3)], names="site"),
            TypeError,
            "names must be a sequence of strings",
        ),
        (lambda: report_from_sites([torch.eye(3)]), TypeError, "records must be SiteRecord"),
        (lambda: plot_report("report", "x.png"), TypeError, "report must be a StabilityReport"),
        (
            lambda: plot_report(report_from_h_res([torch.eye(3)]), 7),
            TypeError,
            "path must be a str or os.PathLike",
        ),
        (
            lambda: plot_report(report_from_h_res([torch.eye(3)]), "x.png", title=3),
            TypeError,
            "title must be a str",
        ),
    ],
)
def test_public_functions_check_their_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_stability_report_checks_eps_before_running_the_model():
    calls = []

    class Counting(nn.Module):
        def forward(self, x):
            calls.append(1)
            return x

    with pytest.raises(ValueError, match="eps"):
        stability_report(Counting(), torch.ones(1), eps=0.0)
    assert calls == []


def test_no_tokens_is_a_clear_error():
    from mhc.testing import assert_composite_stable

    with pytest.raises(ValueError, match="H_res holds no matrices"):
        assert_composite_stable([torch.empty(0, 4, 4)])
    # a model run on an empty batch gets the same error, with no warning from the logits' spread before it
    stack = random_stack("mhc", 0)[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="H_res holds no matrices"):
            stability_report(stack, torch.randn(0, 5, N, C))


def test_cli_refuses_a_cuda_device_it_does_not_have(tmp_path, capsys):
    from mhc.diagnostics.__main__ import main

    (tmp_path / "config.json").write_text("{}")
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    assert main([str(tmp_path), "--device", missing]) == 2
    err = capsys.readouterr().err
    assert f"--device {missing}" in err and "Traceback" not in err, err


def test_a_diverged_token_gives_nan_gains_from_its_depth_on():
    """composite_gains on a model with a NaN token: NaN (not the SVD's LinAlgError) from the first
    depth whose composite holds it; the table's header shows a NaN marginal error behind finite ones."""
    eye = torch.eye(3, dtype=torch.float64).expand(4, 3, 3).clone()
    bad = eye.clone()
    bad[2, 0, 1] = math.nan
    gains = composite_gains([eye, bad, eye])
    for values in (gains.forward_gain, gains.backward_gain, gains.spectral_norm):
        assert values[0] == 1 and values[1:].isnan().all(), gains
    report = report_from_h_res([eye, eye, bad])
    assert report.marginal_error_max[:2] == [0.0, 0.0] and math.isnan(report.marginal_error_max[2])
    assert report.table().splitlines()[0].endswith("max marginal error nan")


def test_cli_checks_device_and_figure_path_before_loading(tmp_path, capsys):
    from mhc.diagnostics.__main__ import main

    (tmp_path / "config.json").write_text("{}")  # never loaded: each check comes first
    for device, message in (
        ("meta", "holds no data"),
        ("xpu" if not torch.xpu.is_available() else "mps", "cannot use it"),
    ):
        assert main([str(tmp_path), "--device", device]) == 2
        err = capsys.readouterr().err
        assert f"--device {device}" in err and message in err and "Traceback" not in err, err
    assert main([str(tmp_path), "--out", str(tmp_path / "s.pdf")]) == 2
    assert "ending in .png" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert main([str(tmp_path), "--text", str(tmp_path / "latin1.txt")]) == 2
    err = capsys.readouterr().err
    assert "latin1.txt" in err and "not UTF-8" in err, err
