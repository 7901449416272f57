"""The streams' dtype (MHCConfig.stream_dtype): the rule, the HF model under autocast, the self-check, training."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mhc
from mhc import MHCBlock, MHCConfig, MHCForCausalLM, convert_to_mhc
from mhc.streams import DEFAULT_STREAM_DTYPE, STREAM_DTYPES, effective_stream_dtype, stream_dtype_for
from mhc.train import config as train_config

VOCAB = 64


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def site_and_norm_dtypes(
    model: MHCForCausalLM, ids: torch.Tensor, branch_inputs: set | None = None
) -> tuple[set, torch.dtype, torch.Tensor]:
    """The dtypes of the streams every site sees, the final norm's input dtype, and the logits.

    ``branch_inputs``: a set that collects the input dtypes of the decoder layers' input norms (the
    first op of each site's branch, which gets its ``u``).
    """
    seen, norm_in = set(), []
    blocks = [m for m in model.modules() if isinstance(m, MHCBlock)]
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.add(args[0].dtype)) for m in blocks]
    if branch_inputs is not None:
        hooks += [
            layer.get_submodule(name).register_forward_pre_hook(
                lambda mod, args: branch_inputs.add(args[0].dtype)
            )
            for layer in model.model.model.layers
            for name in ("input_layernorm", "post_attention_layernorm")
        ]
    # (registered after the model's own pre-hook, which merges the streams: this one sees its output)
    hooks.append(
        model.model.model.norm.register_forward_pre_hook(lambda mod, args: norm_in.append(args[0].dtype))
    )
    try:
        logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return seen, norm_in[0], logits


def test_stream_dtype_for_follows_the_setting_and_autocast():
    h = torch.randn(2, 8)
    assert stream_dtype_for(h, "hidden") is torch.float32
    assert stream_dtype_for(h, "autocast") is torch.float32  # autocast off
    assert stream_dtype_for(h.double(), "autocast") is torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert stream_dtype_for(h, "autocast") is torch.bfloat16
        assert stream_dtype_for(h, "hidden") is torch.float32
        assert stream_dtype_for(h.double(), "autocast") is torch.float64  # only float32 is lowered
    with torch.autocast("cpu", dtype=torch.float16):
        assert stream_dtype_for(h, "autocast") is torch.float16
    for bad in ("bf16", "bfloat16", "float32"):  # no fixed dtype (mhc/streams.py says why)
        with pytest.raises(ValueError, match="stream dtype must be one of hidden, autocast"):
            stream_dtype_for(h, bad)


def test_config_checks_and_saves_stream_dtype(tmp_path):
    base = tiny_llama().config
    assert MHCConfig(base_config=base).stream_dtype == "autocast" == DEFAULT_STREAM_DTYPE
    with pytest.raises(ValueError, match="stream_dtype must be one of"):
        MHCConfig(base_config=base, stream_dtype="bf16")
    with pytest.raises(TypeError, match="did you mean 'stream_dtype'"):
        MHCConfig(base_config=base, stream_dtypes="autocast")
    model = MHCForCausalLM(MHCConfig(base_config=base, stream_dtype="autocast"))
    model.save_pretrained(tmp_path)
    loaded = MHCForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.stream_dtype == "autocast" and loaded.stream_dtype == "autocast"
    assert all(layer.stream_dtype == "autocast" for layer in loaded.decoder_layers())
    with pytest.raises(ValueError, match="stream_dtype must be one of"):
        loaded.set_stream_dtype("half")
    assert STREAM_DTYPES == ("hidden", "autocast")


def test_autocast_streams_are_bf16_under_autocast_and_exact_without():
    """'autocast': bf16 streams under bf16 autocast (the final norm still gets float32, as the residual
    model's), float32 streams without it, where the converted model is bit-identical to the original;
    under autocast the logits differ from the residual model's by a few bf16 roundings only."""
    base = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = base(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_autocast = base(ids).logits.float()
    hidden = convert_to_mhc(copy.deepcopy(base), stream_dtype="hidden")
    model = convert_to_mhc(copy.deepcopy(base), stream_dtype="autocast")
    with torch.no_grad():
        seen, norm_dtype, logits = site_and_norm_dtypes(model, ids)
        assert seen == {torch.float32} and norm_dtype is torch.float32 and torch.equal(logits, ref)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            branch_inputs = set()
            seen, norm_dtype, logits = site_and_norm_dtypes(model, ids, branch_inputs)
            _, _, logits_hidden = site_and_norm_dtypes(hidden, ids)
    assert seen == {torch.bfloat16} and norm_dtype is torch.float32
    # the sublayers get float32 inputs, as the residual model's get its float32 hidden state
    assert branch_inputs == {torch.float32}
    assert torch.equal(logits_hidden.float(), ref_autocast)  # 'hidden' streams: the residual model's bits
    scale = ref_autocast.abs().max().item()
    assert (logits.float() - ref_autocast).abs().max().item() <= 4 * 2**-8 * scale


def test_autocast_setting_leaves_a_bf16_model_alone_and_passes_the_self_check():
    """A model cast wholly to bf16 keeps bf16 streams either way ('autocast' lowers only float32), and its
    logits are the 'hidden' model's bit for bit, with and without autocast; the self-check runs in 'hidden'
    and the asked setting is back after it."""
    base = tiny_llama().to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    hidden = convert_to_mhc(copy.deepcopy(base), stream_dtype="hidden", verify=True)
    model = convert_to_mhc(copy.deepcopy(base), stream_dtype="autocast", verify=True)
    assert model.stream_dtype == "autocast" and model.config.stream_dtype == "autocast"
    assert all(layer.stream_dtype == "autocast" for layer in model.decoder_layers())
    with torch.no_grad():
        for enabled in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                seen, norm_dtype, logits = site_and_norm_dtypes(model, ids)
                _, _, ref = site_and_norm_dtypes(hidden, ids)
            assert seen == {torch.bfloat16} and norm_dtype is torch.bfloat16 and torch.equal(logits, ref)


def test_bf16_streams_train_with_float32_gradients_under_autocast():
    """Backward through bf16 streams under autocast: every gradient finite and float32 (the weights'),
    and close to the float32 streams' gradients."""
    base = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    grads = {}
    for choice in ("hidden", "autocast"):
        model = convert_to_mhc(copy.deepcopy(base), stream_dtype=choice).train()
        # move φ off zero so the dynamic coefficients (and their gradients) depend on the streams
        with torch.no_grad():
            for block in (m for m in model.modules() if isinstance(m, MHCBlock)):
                block.phi.normal_(0, 0.05, generator=torch.Generator().manual_seed(4))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(ids).logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
        grads[choice] = {n: p.grad for n, p in model.named_parameters()}
    total = torch.cat([g.flatten() for g in grads["hidden"].values()]).norm()
    for name, g in grads["autocast"].items():
        ref = grads["hidden"][name]
        assert g is not None and g.dtype is torch.float32 and torch.isfinite(g).all(), name
        # (H_res's gradients are ~1e-7 of the total here: streams that barely differ yet)
        assert (g - ref).norm() <= 0.1 * ref.norm() + 1e-4 * total, name
    flat = torch.cat([g.flatten() for g in grads["autocast"].values()])
    assert (flat - torch.cat([g.flatten() for g in grads["hidden"].values()])).norm() <= 0.05 * total


def test_default_streams_are_bf16_under_autocast_and_residual_mode_keeps_its_stream():
    """The default ('autocast'): a converted float32 model runs bf16 streams under bf16 autocast. mode='residual'
    is the base model: float32 stream under autocast whatever the setting, logits the base model's bit for bit."""
    base = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    model = convert_to_mhc(copy.deepcopy(base))
    assert model.stream_dtype == "autocast"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = base(ids).logits
        seen, _, _ = site_and_norm_dtypes(model, ids)
        assert seen == {torch.bfloat16}
        for choice in STREAM_DTYPES:
            residual = convert_to_mhc(copy.deepcopy(base), mode="residual", n_streams=1, stream_dtype=choice)
            assert residual.stream_dtype == "hidden" and residual.config.stream_dtype == choice
            seen, norm_dtype, logits = site_and_norm_dtypes(residual, ids)
            assert seen == {torch.float32} and torch.equal(logits, ref), choice
            residual.set_stream_dtype("autocast")
            assert residual.stream_dtype == "hidden"
            assert all(layer.stream_dtype == "hidden" for layer in residual.decoder_layers())
    assert [effective_stream_dtype(m, "autocast") for m in ("residual", "hc", "mhc")] == [
        "hidden",
        "autocast",
        "autocast",
    ]


def test_trainer_passes_stream_dtype_through_mhc_options():
    cfg = train_config.TrainConfig(variant="mhc", mhc_options={"stream_dtype": "autocast"})
    assert train_config.mhc_config_options(cfg)["stream_dtype"] == "autocast"
    with pytest.raises(ValueError, match="stream_dtype must be one of"):
        mhc.MHCConfig(
            base_config=tiny_llama().config,
            **train_config.mhc_config_options(
                train_config.TrainConfig(variant="mhc", mhc_options={"stream_dtype": "fp8"})
            ),
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fused site on bf16 streams)")
def test_autocast_streams_on_the_fused_site_match_the_reference_path():
    """fp32 weights under bf16 autocast with 'autocast' streams: the fused site (bf16 streams, fp32
    coefficients) against the PyTorch reference path, outputs and gradients."""
    base = tiny_llama().cuda()
    ids = torch.randint(0, VOCAB, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    out = {}
    for fused in (True, False):
        model = convert_to_mhc(copy.deepcopy(base), stream_dtype="autocast", fused=fused).train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids).logits.float()
        logits.square().mean().backward()
        out[fused] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(out[True][0], out[False][0], rtol=2e-2, atol=2e-2)
    for name, g in out[True][1].items():
        ref = out[False][1][name]
        assert torch.isfinite(g).all() and (g - ref).norm() <= 0.05 * ref.norm() + 1e-5, name


def test_branch_input_is_float32_under_autocast_in_eager_mode_and_the_streams_dtype_compiled():
    """mhc.site.branch_input_dtype: fp32 weights under bf16 autocast give the sublayer a float32 u in
    eager mode (the norm's casts, notes/training_cost.md), the streams' bf16 while torch.compile traces
    (inductor fuses those casts; a float32 u there only adds bytes), and bf16 without autocast."""
    from mhc.site import branch_input_dtype

    x = torch.randn(2, 4, 8, dtype=torch.bfloat16)

    def u_like(x):
        return torch.zeros(1, dtype=branch_input_dtype(x, torch.float32))

    compiled = torch.compile(u_like, backend="eager", fullgraph=True)
    assert u_like(x).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert u_like(x).dtype == torch.float32
        assert compiled(x).dtype == torch.bfloat16
    assert branch_input_dtype(x, None) == torch.bfloat16
