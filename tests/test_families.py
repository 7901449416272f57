"""Every supported HF decoder family (and a few outside the list, via the generic adapter), on tiny random models.

Nothing is downloaded: each config builds a 2-layer model with hidden size 32
and a 96-token vocabulary in a few milliseconds.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import mhc.hf.verify
from mhc import MHCBlock, MHCConfig, MHCForCausalLM, convert_to_mhc
from mhc.hf import MHCDecoderLayer, added_parameter_count
from mhc.hf.adapters import Adapter, Branch, Site, register_adapter, registered_adapter, unregister_adapter
from mhc.hf.generic import infer_adapter
from mhc.hf.verify import ConversionMismatchError, verify_by_default

VOCAB = 96
_TOKENS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    **_TOKENS,
)
_GEMMA = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4)

# family id -> (config class name, keyword arguments); ids with a suffix are a second layout of one model_type.
SUPPORTED = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2)),
    "gemma": ("GemmaConfig", dict(head_dim=8)),
    "phi3": ("Phi3Config", {}),
    "stablelm": ("StableLmConfig", {}),
    "stablelm_parallel": ("StableLmConfig", dict(use_parallel_residual=True)),
    "cohere": ("CohereConfig", dict(logit_scale=1.0)),
    "olmo2": ("Olmo2Config", {}),
    "gemma2": ("Gemma2Config", _GEMMA),
    "gemma3_text": ("Gemma3TextConfig", dict(**_GEMMA, layer_types=["sliding_attention", "full_attention"])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
    ),
    "granite": (
        "GraniteConfig",
        dict(
            residual_multiplier=0.22, embedding_multiplier=6.0, logits_scaling=4.0, attention_multiplier=0.125
        ),
    ),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.5)),
    "gpt_neox_sequential": ("GPTNeoXConfig", dict(rotary_pct=0.5, use_parallel_residual=False)),
    "phi": ("PhiConfig", dict(partial_rotary_factor=0.5)),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, **_TOKENS)),
}

# Families without a registered adapter that the generic one converts.
GENERIC = {
    "olmo": ("OlmoConfig", {}),
    "starcoder2": ("Starcoder2Config", {}),
    "helium": ("HeliumConfig", dict(head_dim=8)),
    "olmo3": ("Olmo3Config", {}),
    "gptj": ("GPTJConfig", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, **_TOKENS)),
}


def family_config(family: str):
    name, extra = {**SUPPORTED, **GENERIC}[family]
    cls = getattr(transformers, name)
    if name in ("GPT2Config", "GPTJConfig"):
        return cls(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **extra)
    return cls(**{**_DECODER, **extra})


def family_model(family: str, seed: int = 0):
    """A tiny random model of ``family`` in eval mode, with its matrices scaled up (x5).

    HF's 0.02-std init keeps every residual branch tiny; scaled weights make
    each sublayer's contribution to the logits large, so a wrongly wrapped
    site cannot hide under rounding.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not any(k in name for k in ("embed", "wte", "wpe")):
                p.mul_(5.0)
    return model.eval()


def token_ids(batch: int = 2, seq: int = 9, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


# ---------------------------------------------------------------------------------------------- the tests

FAMILIES = list(SUPPORTED)
# One family per layout, for the costlier checks (left padding, checkpointing, bf16): pre-norm, sandwich, post-norm,
# scaled residual, MoE, parallel with two norms, parallel with one shared norm and dropout, GPT-2.
REPRESENTATIVE = ["llama", "gemma2", "olmo2", "granite", "mixtral", "gpt_neox", "phi", "gpt2"]
LOGIT_TOLERANCE = 1e-4  # fp32, default init (issue #21)


def perturb(model, seed: int = 0, scale: float = 0.5) -> None:
    """Move the coefficient parameters off their identity init, so the mHC paths matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MHCBlock) and m.mode != "residual":
                for p in (m.phi, m.b_pre, m.b_post, m.b_res):
                    p.add_(
                        scale * torch.randn(p.shape, generator=g).to(p.device)
                    )  # the same draw on any device


def max_logit_diff(family: str) -> tuple[float, float, MHCForCausalLM]:
    base = family_model(family)
    x = token_ids()
    with torch.no_grad():
        ref = base(x).logits
    model = convert_to_mhc(base, n_streams=4)
    with torch.no_grad():
        out = model(x).logits
    return (out - ref).abs().max().item(), ref.abs().max().item(), model


@pytest.mark.parametrize("family", FAMILIES + list(GENERIC))
def test_converts_exactly(family):
    """fp32 logits within 1e-4 of the original's at the default init; only coefficients are added."""
    keys = set(family_model(family).state_dict())
    diff, biggest, model = max_logit_diff(family)
    print(f"{family}: max |logit diff| {diff:.3g} (max |logit| {biggest:.3g})")
    assert biggest > 0.3, "the tiny model's logits are too small to judge the conversion"
    assert diff <= LOGIT_TOLERANCE, f"{family}: {diff}"
    assert keys <= {k.removeprefix("model.") for k in model.state_dict()}
    added = {k.removeprefix("model.") for k in model.state_dict()} - keys
    assert added and all("_mhc." in k for k in added)
    sites = model.config.get_adapter().sites
    layers = model.decoder_layers()
    assert len(layers) == 2 and all(isinstance(layer, MHCDecoderLayer) for layer in layers)
    assert sum(isinstance(m, MHCBlock) for m in model.modules()) == 2 * len(sites)
    assert model.num_parameters() == sum(
        p.numel() for p in family_model(family).parameters()
    ) + added_parameter_count(model.config)


@pytest.mark.parametrize("family", FAMILIES + list(GENERIC))
def test_save_reload_identical(family, tmp_path):
    model = convert_to_mhc(family_model(family), n_streams=4)
    perturb(model)
    x = token_ids()
    with torch.no_grad():
        out = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is MHCForCausalLM and loaded.config.get_adapter() == model.config.get_adapter()
    with torch.no_grad():
        again = loaded.eval()(x).logits
    assert torch.equal(out, again)


@pytest.mark.parametrize("family", FAMILIES + list(GENERIC))
def test_generate_cache_matches_no_cache(family):
    model = convert_to_mhc(family_model(family), n_streams=4)
    perturb(model)
    x = token_ids(batch=2, seq=5)
    kw = dict(
        attention_mask=torch.ones_like(x),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with_cache = model.generate(x, use_cache=True, **kw)
    without = model.generate(x, use_cache=False, **kw)
    assert with_cache.sequences.shape == (2, 9)
    assert torch.equal(with_cache.sequences, without.sequences)
    for step, (a, b) in enumerate(zip(with_cache.scores, without.scores)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("family", REPRESENTATIVE)
def test_left_padding(family):
    """A left-padded row gives the same logits on its real tokens and the same 5 greedy tokens as alone."""
    model = convert_to_mhc(family_model(family), n_streams=4)
    perturb(model)
    long, short = token_ids(1, 7, seed=3), token_ids(1, 4, seed=4)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        both = model(batch, attention_mask=mask, position_ids=position_ids).logits
        alone = model(short).logits
    assert (both[1, 3:] - alone[0]).abs().max().item() <= 1e-4
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    gen_batch = model.generate(batch, attention_mask=mask, **kw)
    gen_alone = model.generate(short, attention_mask=torch.ones_like(short), **kw)
    assert gen_batch.shape == (2, 12) and torch.equal(gen_batch[1, 3:], gen_alone[0])


def enable_checkpointing(model) -> None:
    """The non-deprecated entry point of transformers 5 (activation_*), else 4.x's, non-reentrant."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@pytest.mark.parametrize("family", REPRESENTATIVE)
def test_gradient_checkpointing_same_gradients(family):
    model = convert_to_mhc(family_model(family), n_streams=4)
    perturb(model)
    model.train()
    for m in model.modules():  # dropout would draw different masks in the two runs' forward
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    x = token_ids(batch=2, seq=8)
    sublayer_calls = []
    for layer in model.decoder_layers():
        for site in model.config.get_adapter().sites:
            layer.get_submodule(site.branches[0].sublayer).register_forward_pre_hook(
                lambda *_: sublayer_calls.append(1)
            )

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(x, labels=x).loss
        sublayer_calls.clear()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(
            sublayer_calls
        )

    plain, recomputed = grads()
    assert recomputed == 0
    enable_checkpointing(model)
    ckpt, recomputed = grads()
    assert recomputed == 2 * len(
        model.config.get_adapter().sites
    )  # every site's sublayer ran again in backward
    assert plain.keys() == ckpt.keys() and any("_mhc.phi" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", REPRESENTATIVE)
def test_bf16_with_fp32_coefficients(family, tmp_path):
    model = convert_to_mhc(family_model(family), n_streams=4)
    perturb(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    coefficients = {n for n, _ in loaded.named_parameters() if "_mhc." in n}
    assert coefficients and all(
        p.dtype == torch.float32 for n, p in loaded.named_parameters() if n in coefficients
    )
    assert all(p.dtype == torch.bfloat16 for n, p in loaded.named_parameters() if n not in coefficients)
    x = token_ids()
    with torch.no_grad():
        out, ref = loaded(x).logits, model(x).logits
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()
    # a bf16 model converts exactly too (the self-check runs in bf16) and keeps fp32 coefficients
    base = family_model(family).to(torch.bfloat16)
    with torch.no_grad():
        ref16 = base(x).logits
    converted = convert_to_mhc(base, n_streams=4)
    assert all(p.dtype == torch.float32 for n, p in converted.named_parameters() if "_mhc." in n)
    with torch.no_grad():
        assert (converted(x).logits.float() - ref16.float()).abs().max() <= 3e-2 * max(
            1, ref16.abs().max().item()
        )


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_router_aux_loss_kept(family):
    base = family_model(family)
    x = token_ids()
    with torch.no_grad():
        ref = base(x, labels=x, output_router_logits=True)
    model = convert_to_mhc(base, n_streams=4)
    with torch.no_grad():
        out = model(x, labels=x, output_router_logits=True)
    assert ref.aux_loss is not None and ref.aux_loss > 0
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    assert len(out.router_logits) == len(ref.router_logits)
    for a, b in zip(out.router_logits, ref.router_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ the self-check and the generic adapter

LLAMA_NAMES = Adapter.pre_norm()
# What a user following the old error message's register_adapter hint wrote: each is silently wrong without the check.
WRONG_ADAPTERS = {
    "gemma2": LLAMA_NAMES,  # drops the sandwich norms (post_attention_layernorm taken for the MLP's pre-norm)
    "gpt_neox": Adapter.pre_norm(
        "gpt_neox.layers", "gpt_neox.final_layer_norm", attn=("input_layernorm", "attention")
    ),
    "granite": LLAMA_NAMES,  # drops residual_multiplier
}


@contextlib.contextmanager
def registered(model_type: str, adapter):
    previous = register_adapter(model_type, adapter)
    try:
        yield
    finally:
        if previous is None:
            unregister_adapter(model_type)
        else:
            register_adapter(model_type, previous)


@pytest.mark.parametrize("family", sorted(WRONG_ADAPTERS))
def test_self_check_catches_a_wrong_adapter(family):
    base = family_model(family)
    x = token_ids()
    with torch.no_grad():
        ref = base(x).logits
    original_layers = [type(m) for m in base.modules()]
    with registered(family, WRONG_ADAPTERS[family]):
        with pytest.raises(
            ConversionMismatchError, match=r"differ from the original's by up to (\d|\.)+"
        ) as info:
            convert_to_mhc(base, n_streams=4)
        print(f"{family}: {info.value}")
        # the model is left as it was: its own layers, its own logits
        assert [type(m) for m in base.modules()] == original_layers
        with torch.no_grad():
            assert torch.equal(base(x).logits, ref)
        # verify=False is the way to skip the check: the wrong adapter then converts, and the logits change
        converted = convert_to_mhc(base, n_streams=4, verify=False)
        with torch.no_grad():
            assert (converted(x).logits - ref).abs().max() > 1e-2
    # the registered adapter is back and converts exactly
    assert max_logit_diff(family)[0] <= LOGIT_TOLERANCE


def test_self_check_default_follows_the_size_threshold(monkeypatch):
    base = family_model("granite")
    assert verify_by_default(base)
    with registered("granite", WRONG_ADAPTERS["granite"]):
        monkeypatch.setattr(mhc.hf.verify, "VERIFY_AUTO_MAX_PARAMETERS", base.num_parameters() - 1)
        assert not verify_by_default(base)
        convert_to_mhc(base, n_streams=4)  # too big for the default check: converted unchecked
        with pytest.raises(ConversionMismatchError):
            convert_to_mhc(family_model("granite"), n_streams=4, verify=True)  # asked for explicitly: checked
    for bad in (1, "yes", 0.5):
        with pytest.raises(TypeError, match="verify"):
            convert_to_mhc(family_model("llama"), verify=bad)


def test_self_check_also_runs_with_the_paper_init():
    """init="paper" changes the function on purpose; the check still tests the adapter (with φ at zero)."""
    base = family_model("gpt_neox")
    with registered("gpt_neox", WRONG_ADAPTERS["gpt_neox"]), pytest.raises(ConversionMismatchError):
        convert_to_mhc(base, n_streams=4, init="paper")
    torch.manual_seed(0)
    model = convert_to_mhc(family_model("gpt_neox"), n_streams=4, init="paper")
    phi = model.decoder_layers()[0].parallel_mhc.phi
    assert 0.5 < phi.std().item() * phi.shape[1] ** 0.5 < 2  # the paper's draw, put back after the check


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "granite"])
def test_generic_adapter_reads_the_registered_layouts(family):
    """Families that share a layout need no adapter code: the generic reading equals the registered adapter."""
    base = family_model(family)
    inferred = infer_adapter(base)
    registered_one = registered_adapter(base.config)
    assert (inferred.layers, inferred.final_norm, inferred.sites) == (
        registered_one.layers,
        registered_one.final_norm,
        registered_one.sites,
    )


@pytest.mark.parametrize("family", sorted(GENERIC))
def test_family_outside_the_list_converts_by_the_generic_adapter(family):
    base = family_model(family)
    assert registered_adapter(base.config) is None
    diff, _, model = max_logit_diff(family)
    assert diff <= LOGIT_TOLERANCE
    assert model.config.adapter == infer_adapter(family_model(family)).to_dict()  # recorded for reloading


def test_granite_without_its_adapter_is_refused_naming_the_scaled_residual():
    previous = unregister_adapter("granite")
    try:
        with pytest.raises(
            ValueError, match=r"'granite'.*x \+ attn.*max \|difference\|.*residual_multiplier"
        ):
            convert_to_mhc(family_model("granite"))
    finally:
        register_adapter("granite", previous)


def test_unfitting_layout_is_refused_saying_what_does_not_fit():
    from transformers import OPTConfig

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2)
    base = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(
        ValueError, match=r"'opt'.*OPTDecoderLayer.*sublayers \['self_attn', 'fc1', 'activation_fn', 'fc2'\]"
    ):
        convert_to_mhc(base)
    assert not any(isinstance(m, MHCDecoderLayer) for m in base.modules())


def test_adapter_that_names_a_missing_submodule_leaves_the_model_unconverted():
    base = family_model("llama")
    wrong = Adapter.pre_norm(mlp=("post_attention_layernorm", "feed_forward"))
    with pytest.raises(ValueError, match="no submodule 'feed_forward'"):
        convert_to_mhc(base, adapter=wrong)
    assert not any(isinstance(m, MHCDecoderLayer) for m in base.modules())
    # a wrong final-norm path is found before any layer is wrapped
    with pytest.raises(ValueError, match="no 'model.final_norm'"):
        convert_to_mhc(base, adapter=Adapter.pre_norm(final_norm="model.final_norm"))
    assert not any(isinstance(m, MHCDecoderLayer) for m in base.modules())
    assert max_logit_diff("llama")[0] == 0.0


def test_adapter_values_are_checked():
    with pytest.raises(ValueError, match="identifier"):
        Site("attn-site", (Branch("self_attn"),))
    with pytest.raises(ValueError, match="repeat"):
        Adapter(
            "model.layers",
            "model.norm",
            (Site("a", (Branch("x", layer_inputs=True),)), Site("a", (Branch("y"),))),
        )
    with pytest.raises(ValueError, match="layer_inputs"):
        Adapter("model.layers", "model.norm", (Site("attn", (Branch("self_attn"),)),))
    with pytest.raises(ValueError, match="malformed"):
        MHCConfig(base_config=family_config("llama"), adapter={"layers": "model.layers"})
    with pytest.raises(TypeError, match="adapter"):
        MHCConfig(base_config=family_config("llama"), adapter=5)
    with pytest.raises(TypeError, match="adapter"):
        convert_to_mhc(family_model("llama"), adapter={"layers": "model.layers"})
    with pytest.raises(TypeError, match="adapter"):
        register_adapter("llama", "model.layers")
    # a dict round trip (what config.json holds) gives the same adapter
    adapter = registered_adapter(family_config("granite"))
    assert Adapter.from_dict(json.loads(json.dumps(adapter.to_dict()))) == adapter
    assert adapter.sites[0].branches[0].scale == 0.22


def test_config_without_an_adapter_for_an_unregistered_family_says_how_to_convert():
    with pytest.raises(ValueError, match="'olmo'.*convert_to_mhc"):
        MHCForCausalLM(MHCConfig(base_config=family_config("olmo")))
