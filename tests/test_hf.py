"""HuggingFace integration: MHCConfig, MHCForCausalLM, convert_to_mhc on tiny random models (CPU)."""

from __future__ import annotations

import collections
import copy
import inspect
import math

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

import mhc
from mhc import MHCBlock, MHCConfig, MHCForCausalLM, convert_to_mhc
from mhc.hf import MHCDecoderLayer, added_parameter_count

VOCAB = 96
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]


def tiny_config(arch: str, layers: int = 2):
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama_like = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **common,
    )
    if arch == "llama":
        return LlamaConfig(**llama_like)
    if arch == "mistral":
        return MistralConfig(**llama_like)
    if arch == "qwen2":
        return Qwen2Config(**llama_like)
    if arch == "qwen3":
        return Qwen3Config(head_dim=8, **llama_like)
    if arch == "gpt2":
        return GPT2Config(
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    raise KeyError(arch)


def tiny_base(arch: str, seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers))
    # Random init keeps the residual branches tiny; scale the weights up so the
    # test sees real sublayer contributions (an mHC bug could hide under 0.02-std weights).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "wte" not in name and "embed" not in name and "wpe" not in name:
                p.mul_(5.0)
    return model.eval()


def ids(batch: int = 2, seq: int = 9, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def count_sublayer_calls(model: MHCForCausalLM) -> collections.Counter:
    """A counter of the attention and MLP sublayers' calls (keys "attn", "mlp"), kept up to date by hooks."""
    calls: collections.Counter = collections.Counter()
    adapter = model.config.get_adapter()
    for layer in model.decoder_layers():
        for key, site in zip(("attn", "mlp"), adapter.sites):
            name = site.branches[0].sublayer
            layer.get_submodule(name).register_forward_pre_hook(lambda *_, key=key: calls.update([key]))
    return calls


def perturb_mhc(model: MHCForCausalLM, seed: int = 0, scale: float = 0.5) -> None:
    """Move the coefficient parameters off their identity init, so the mHC paths matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MHCBlock) and m.mode != "residual":
                for p in (m.phi, m.b_pre, m.b_post, m.b_res):
                    p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_conversion_preserves_logits(arch, dtype):
    """The documented default (mode="mhc", init="identity", n=4) keeps the logits to the bit."""
    base = tiny_base(arch).to(dtype)
    x = ids()
    with torch.no_grad():
        ref = base(x).logits
    keys = set(base.state_dict())
    model = convert_to_mhc(base, n_streams=4)
    assert isinstance(model, MHCForCausalLM)
    assert keys <= {k.removeprefix("model.") for k in model.state_dict()}  # original weights kept, same keys
    added = {k.removeprefix("model.") for k in model.state_dict()} - keys
    assert added and all(
        "_mhc." in k for k in added
    )  # only coefficients are new: no sublayer registered twice
    n_layers = tiny_config(arch).num_hidden_layers
    assert sum(isinstance(m, MHCDecoderLayer) for m in model.modules()) == n_layers
    assert sum(isinstance(m, MHCBlock) for m in model.modules()) == 2 * n_layers
    with torch.no_grad():
        out = model(x).logits
    assert ref.abs().max() > 0.1
    assert torch.equal(out, ref)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("reduce", ["mean", "learned"])
@pytest.mark.parametrize("mode", ["mhc", "hc", "residual"])
def test_conversion_modes(mode, reduce, n):
    base = tiny_base("llama")
    x = ids()
    with torch.no_grad():
        ref = base(x).logits
        out = convert_to_mhc(base, n_streams=n, mode=mode, reduce=reduce)(x).logits
    if n == 4 and mode != "hc":
        # Σ H_pre is exactly 1 and 4 identical streams average exactly: bit for bit.
        assert torch.equal(out, ref)
    else:
        # 1/3 (mean or learned weight of 3 streams) and hc's untuned H_pre round in float32.
        assert (out - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
def test_save_reload_identical(arch, tmp_path):
    model = convert_to_mhc(tiny_base(arch), n_streams=4, reduce="learned")
    perturb_mhc(model)
    with torch.no_grad():
        model.stream_reduce.weight.copy_(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    x = ids()
    with torch.no_grad():
        out = model(x).logits
    model.save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, MHCConfig) and cfg.base_config["model_type"] == arch and cfg.n_streams == 4
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is MHCForCausalLM
    loaded.eval()
    with torch.no_grad():
        again = loaded(x).logits
    assert torch.equal(out, again)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_cache_matches_no_cache(arch):
    model = convert_to_mhc(tiny_base(arch), n_streams=4)
    perturb_mhc(model)
    x = ids(batch=2, seq=5)
    mask = torch.ones_like(x)
    kw = dict(
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with_cache = model.generate(x, use_cache=True, **kw)
    without = model.generate(x, use_cache=False, **kw)
    assert with_cache.sequences.shape == (2, 13)
    assert torch.equal(with_cache.sequences, without.sequences)
    # The scores, not only the argmax: cached attention over past keys equals the full recompute.
    assert len(with_cache.scores) == len(without.scores) == 8
    for step, (a, b) in enumerate(zip(with_cache.scores, without.scores)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("arch", ARCHS)
def test_training_lowers_loss(arch):
    model = convert_to_mhc(tiny_base(arch), n_streams=4)
    model.train()
    x = ids(batch=4, seq=12)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    # the coefficient parameters get gradient and move off their init
    block = next(m for m in model.modules() if isinstance(m, MHCBlock))
    assert block.phi.abs().max() > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing_same_gradients(arch):
    model = convert_to_mhc(tiny_base(arch), n_streams=4)
    perturb_mhc(model)
    model.train()
    x = ids(batch=2, seq=8)
    calls = count_sublayer_calls(model)

    def grads():
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = model(x, labels=x).loss
        forward_calls = dict(calls)
        calls.clear()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return grads, forward_calls, dict(calls)

    plain, forward_calls, backward_calls = grads()
    layers = tiny_config(arch).num_hidden_layers
    assert forward_calls == {"attn": layers, "mlp": layers} and backward_calls == {}
    # transformers 5's non-deprecated entry point (4.x: gradient_checkpointing_enable), non-reentrant
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert all(m.gradient_checkpointing for m in model.modules() if isinstance(m, MHCDecoderLayer))
    ckpt, forward_calls, backward_calls = grads()
    # Checkpointing runs each layer's attention and MLP once more, during backward.
    assert forward_calls == backward_calls == {"attn": layers, "mlp": layers}
    assert plain.keys() == ckpt.keys()
    assert any("attn_mhc.phi" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_checkpointing_enabled_before_conversion_stays_on():
    """PEFT's prepare_model_for_kbit_training and others enable checkpointing on the base model first:
    the converted layers checkpoint too (each sublayer runs again in backward), as the model reports."""
    base = tiny_base("llama")
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = convert_to_mhc(base, n_streams=4)
    assert all(layer.gradient_checkpointing for layer in model.decoder_layers())
    model.train()
    calls = count_sublayer_calls(model)
    x = ids(batch=2, seq=8)
    loss = model(x, labels=x, use_cache=False).loss
    calls.clear()
    loss.backward()
    layers = tiny_config("llama").num_hidden_layers
    assert dict(calls) == {"attn": layers, "mlp": layers}


def test_bf16_load_keeps_coefficients_fp32(tmp_path):
    model = convert_to_mhc(tiny_base("llama"), n_streams=4, reduce="learned")
    perturb_mhc(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    mhc_params = {n: p for n, p in loaded.named_parameters() if "_mhc." in n or "stream_reduce" in n}
    assert mhc_params and all(p.dtype == torch.float32 for p in mhc_params.values())
    others = [p for n, p in loaded.named_parameters() if n not in mhc_params]
    assert all(p.dtype == torch.bfloat16 for p in others)
    for n, p in model.named_parameters():
        if n in mhc_params:
            assert torch.equal(mhc_params[n], p)  # fp32 values survive the bf16 load unrounded
    x = ids()
    with torch.no_grad():
        out = loaded(x).logits
        ref = model(x).logits
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()
    # converting a bf16 model: new coefficients are fp32 as well
    bf = convert_to_mhc(tiny_base("qwen3").to(torch.bfloat16), n_streams=4)
    assert all(p.dtype == torch.float32 for n, p in bf.named_parameters() if "_mhc." in n)
    with torch.no_grad():
        assert bf(x).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_new_coefficients_are_fp32_when_a_model_is_built_in_bf16(tmp_path, low_cpu_mem_usage):
    """transformers builds a model loaded or made with ``dtype=`` under that default dtype; the mHC
    parameters it has no weights for (a plain checkpoint, a config) are still made in float32, at their
    init values, so that an optimizer step at a small learning rate moves α and the biases."""
    base = tiny_base("llama")
    base.save_pretrained(tmp_path)
    config = MHCConfig(base_config=base.config, n_streams=4, reduce="learned", init="paper")
    loaded = MHCForCausalLM.from_pretrained(
        tmp_path, config=config, dtype=torch.bfloat16, low_cpu_mem_usage=low_cpu_mem_usage
    )
    built = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh = MHCForCausalLM(config)  # float32 throughout, for the init values
    for model in (loaded, built):
        mhc_params = {n: p for n, p in model.named_parameters() if "_mhc." in n or "stream_reduce" in n}
        assert mhc_params and {p.dtype for p in mhc_params.values()} == {torch.float32}
        for n, p in fresh.named_parameters():
            if n in mhc_params and not n.endswith(".phi"):  # φ is drawn at random under "paper"
                assert torch.equal(mhc_params[n], p), n
    b_pre = loaded.decoder_layers()[0].attn_mhc.b_pre
    before = b_pre.detach().clone()
    loaded.train()
    x = ids()
    loaded(x, labels=x).loss.backward()
    torch.optim.AdamW([b_pre], lr=1e-4).step()
    assert not torch.equal(b_pre, before)  # in bf16 a step of 1e-4 is lost (its spacing at 3.5 is 0.016)


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16, torch.float64])
def test_block_coefficients_follow_a_wider_default_dtype_only(default):
    """Under a bf16 or fp16 default dtype (transformers' loading) the parameters stay float32; under
    float64 (gradcheck) they follow it."""
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(default)
        block = MHCBlock(torch.nn.Identity(), 8, 4)
        reduce = mhc.StreamReduce(4, learned=True)
    finally:
        torch.set_default_dtype(previous)
    expected = torch.float64 if default is torch.float64 else torch.float32
    assert {p.dtype for p in [*block.parameters(), *reduce.parameters()]} == {expected}


def test_unsupported_architecture_raises():
    from transformers import OPTConfig

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2)
    base = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="opt.*gpt2.*llama.*mistral.*qwen2.*qwen3"):
        convert_to_mhc(base)
    with pytest.raises(ValueError, match="supported model types"):
        MHCForCausalLM(MHCConfig(base_config=cfg))


@pytest.mark.parametrize("mode", ["mhc", "hc", "residual"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_num_parameters(arch, mode):
    base = tiny_base(arch)
    n_base = base.num_parameters()
    model = convert_to_mhc(base, n_streams=4, mode=mode, reduce="learned")
    added = added_parameter_count(model.config)
    assert model.num_parameters() == n_base + added
    n, C, L = 4, 32, 2
    per_site = {"mhc": n * C * (n * n + 2 * n) + n * n + 2 * n + 3, "hc": C * (n + 2) + n * n + 2 * n + 3}
    assert added == 2 * L * per_site.get(mode, 0) + n


@pytest.mark.parametrize("n", [3, 4])
def test_num_parameters_of_lite_counts_one_logit_per_permutation(n):
    base = tiny_base("llama")
    n_base = base.num_parameters()
    model = convert_to_mhc(base, n_streams=n, projection="lite")
    added = added_parameter_count(model.config)
    assert model.num_parameters() == n_base + added
    r, C, L = math.factorial(n), 32, 2
    assert added == 2 * L * (n * C * (r + 2 * n) + r + 2 * n + 3)


@pytest.mark.parametrize("name", ["pre_eps", "sinkhorn_eps"])
def test_config_refuses_block_only_keywords(name):
    """They are not stored in config.json, so taking them would ignore them without a word."""
    with pytest.raises(TypeError, match=name):
        MHCConfig(base_config=tiny_config("llama"), **{name: 1e-3})


def test_constructor_usage_and_residual_baseline(tmp_path):
    """The training script's usage; residual with one stream is exactly the base model."""
    base_cfg = tiny_config("llama")
    for mode, n in [("mhc", 4), ("hc", 2), ("residual", 1)]:
        cfg = MHCConfig(
            base_config=base_cfg, n_streams=n, mode=mode, init="paper" if mode == "hc" else "identity"
        )
        model = MHCForCausalLM(cfg)
        out = model(ids(), labels=ids())
        assert out.logits.shape == (2, 9, VOCAB) and torch.isfinite(out.loss)
    # dict base config, and attributes of the base read through
    cfg = MHCConfig(base_config=base_cfg.to_dict(), n_streams=1, mode="residual")
    assert cfg.hidden_size == 32 and cfg.num_hidden_layers == 2 and cfg.vocab_size == VOCAB
    assert cfg.get_text_config().model_type == "llama"
    residual = MHCForCausalLM(cfg).eval()
    plain = AutoModelForCausalLM.from_config(base_cfg).eval()
    missing, unexpected = plain.load_state_dict(
        {k.removeprefix("model."): v for k, v in residual.state_dict().items()}, strict=True
    )
    x = ids()
    with torch.no_grad():
        assert torch.equal(residual(x).logits, plain(x).logits)
    residual.save_pretrained(tmp_path)
    assert MHCConfig.from_pretrained(tmp_path).to_dict()["base_config"]["hidden_size"] == 32


def test_collect_h_res_on_hf_model():
    model = convert_to_mhc(tiny_base("llama"), n_streams=4)
    perturb_mhc(model, scale=1.0)
    h = mhc.diagnostics.collect_h_res(model, ids())
    assert len(h) == 4 and h[0].shape == (2, 9, 4, 4)
    for t in h:
        torch.testing.assert_close(t.sum(-1), torch.ones(2, 9, 4), atol=1e-5, rtol=0)
        torch.testing.assert_close(t.sum(-2), torch.ones(2, 9, 4), atol=1e-5, rtol=0)


def test_streams_diverge_after_training():
    """H_pre rotates with depth, so streams stop being copies of each other once trained."""
    model = convert_to_mhc(tiny_base("llama"), n_streams=4)
    model.train()
    x = ids(batch=4, seq=12)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    captured = {}
    final = model.model.model.norm
    handle = model.model.model.layers[-1].register_forward_hook(lambda m, a, o: captured.setdefault("x", o))
    with torch.no_grad():
        model(x)
    handle.remove()
    streams = captured["x"]
    assert streams.shape[-2:] == (4, 32)
    assert (streams - streams.mean(-2, keepdim=True)).abs().max() > 1e-3
    assert final is not None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_torch_compile_fullgraph(arch):
    """The integration itself adds no graph break: with the Sinkhorn projection the
    whole model (embeddings, masks, cache-free layers, head) is one graph, forward and backward."""
    model = convert_to_mhc(tiny_base(arch), n_streams=4, projection="sinkhorn")
    perturb_mhc(model)
    model.train()
    x = ids()

    def loss_and_grads(m):
        model.zero_grad(set_to_none=True)
        logits = m(x).logits  # loss outside: the base model's loss_function may log (a graph break)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = loss_and_grads(model)
    torch._dynamo.reset()
    loss, grads = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_torch_compile_newton_matches_eager():
    """Default (Newton) projection: data-dependent iterations break the graph, results are unchanged."""
    model = convert_to_mhc(tiny_base("llama"), n_streams=4)
    perturb_mhc(model)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
        torch._dynamo.reset()
        out = torch.compile(model, backend="aot_eager")(x).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_deepcopy_is_independent():
    model = convert_to_mhc(tiny_base("llama"), n_streams=4, reduce="learned")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.stream_reduce.weight.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0]))
        for m in twin.modules():
            if isinstance(m, MHCBlock):
                m.b_pre.add_(1.0)
    x = ids()
    with torch.no_grad():
        a, b = model(x).logits, twin(x).logits
    assert not torch.equal(a, b)
    # Each block's branch calls its own model's layer: a copied layer's blocks follow it into the copy.
    for m, other in ((model, twin), (twin, model)):
        for layer, foreign in zip(m.model.model.layers, other.model.model.layers):
            assert layer.attn_mhc.branch.layer is layer and layer.mlp_mhc.branch.layer is layer
            assert foreign is not layer
    # A block copied alone (as PEFT's modules_to_save does) keeps calling the live layer.
    layer = model.model.model.layers[0]
    block = copy.deepcopy(layer.attn_mhc)
    assert block.branch.layer is layer
    assert block.phi is not layer.attn_mhc.phi and torch.equal(block.phi, layer.attn_mhc.phi)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_output_hidden_states(arch):
    base = tiny_base(arch)
    x = ids()
    with torch.no_grad():
        ref = base(x, output_hidden_states=True).hidden_states
        out = convert_to_mhc(base, n_streams=4)(x, output_hidden_states=True).hidden_states
    assert len(out) == len(ref) == tiny_config(arch).num_hidden_layers + 1
    for a, b in zip(out, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_cast_to_bf16_keeps_coefficients_fp32():
    model = convert_to_mhc(tiny_base("llama"), n_streams=4, reduce="learned")
    perturb_mhc(model)
    before = {
        n: p.detach().clone() for n, p in model.named_parameters() if "_mhc." in n or "stream_reduce" in n
    }
    model.to(torch.bfloat16)
    after = dict(model.named_parameters())
    for n, p in before.items():
        assert after[n].dtype == torch.float32 and torch.equal(after[n], p)
    assert model.model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(ids()).logits.dtype == torch.bfloat16


def test_output_attentions_eager():
    base = tiny_base("llama")
    base.set_attn_implementation("eager")
    x = ids()
    with torch.no_grad():
        ref = base(x, output_attentions=True).attentions
        out = convert_to_mhc(base, n_streams=4)(x, output_attentions=True).attentions
    assert len(out) == len(ref) == 2
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_recompute_option_same_gradients_and_saved(arch, tmp_path):
    """MHCConfig(recompute=True) reaches every block, survives save/load and leaves gradients unchanged."""
    x = ids(batch=2, seq=8)
    grads = []
    for recompute in (False, True):
        model = convert_to_mhc(tiny_base(arch), n_streams=4, recompute=recompute, fused=not recompute)
        perturb_mhc(model)
        model.train()
        blocks = [m for m in model.modules() if isinstance(m, MHCBlock)]
        assert blocks and all(b.recompute == recompute and b.fused == (not recompute) for b in blocks)
        calls = count_sublayer_calls(model)
        loss = model(x, labels=x).loss
        calls.clear()
        loss.backward()
        # each site reruns its sublayer in backward with recompute=True, never without
        assert dict(calls) == ({"attn": 2, "mlp": 2} if recompute else {})
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, again = grads
    assert plain.keys() == again.keys()
    for name in plain:
        torch.testing.assert_close(again[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    model.save_pretrained(tmp_path)
    loaded = MHCForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.recompute is True and loaded.config.fused is False
    assert all(b.recompute for b in loaded.modules() if isinstance(b, MHCBlock))


# ----------------------------------------------------------------------------- what a user passes through


def test_conversion_keeps_an_eval_model_in_eval_mode_and_exact():
    """A pretrained model loads in eval mode with its dropouts: the converted model stays in eval mode
    (the self-check used to leave every module in train mode, so the outputs differed by dropout)."""
    base = tiny_base("gpt2")
    base.config.resid_pdrop = base.config.embd_pdrop = base.config.attn_pdrop = 0.1
    for m in base.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    base.eval()
    x = ids()
    with torch.no_grad():
        reference = base(x).logits
    attn = base.transformer.h[0].attn
    attn.train()  # a mixed mode is kept module by module too (the layer itself becomes a new wrapper)
    model = convert_to_mhc(base, n_streams=4)
    assert not model.training and not model.model.training and not model.model.transformer.h[1].training
    assert model.model.transformer.h[0].attn is attn and attn.training
    attn.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, reference)


def test_generate_takes_a_callers_cache_and_inputs_embeds():
    model = convert_to_mhc(tiny_base("llama"), n_streams=2).eval()
    x = ids(batch=1)
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    plain = model.generate(x, **kw)
    from transformers import DynamicCache

    cache_name = (
        "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    )
    with_cache = model.generate(x, **{cache_name: DynamicCache(config=model.config.get_text_config())}, **kw)
    assert torch.equal(with_cache, plain)
    embeds = model.get_input_embeddings()(x)
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(x), **kw)
    assert torch.equal(from_embeds, plain[:, x.shape[1] :])  # only the new tokens, as for the base model


def test_hidden_states_come_back_in_a_tuple_too():
    model = convert_to_mhc(tiny_base("llama"), n_streams=2).eval()
    x = ids()
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
        as_tuple = model(x, output_hidden_states=True, return_dict=False, use_cache=False)
    assert isinstance(as_tuple, tuple)
    assert torch.equal(as_tuple[0], out.logits)
    assert len(as_tuple[-1]) == len(out.hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(as_tuple[-1], out.hidden_states))


def test_generic_adapter_refuses_parameters_it_would_drop():
    """A learned residual scale that starts at 1 passes the value check: the layer's own parameters
    (and any unused submodule with parameters) must stop the generic adapter, not be dropped."""
    from mhc.hf.generic import UnsupportedLayoutError, infer_adapter

    base = tiny_base("llama")
    for layer in base.model.layers:
        layer.residual_scale = torch.nn.Parameter(torch.ones(32))
    with pytest.raises(UnsupportedLayoutError, match="residual_scale"):
        infer_adapter(base)
    base = tiny_base("llama")
    for layer in base.model.layers:
        layer.unused_proj = torch.nn.Linear(32, 32)
    with pytest.raises(UnsupportedLayoutError, match="unused_proj"):
        infer_adapter(base)
    assert infer_adapter(tiny_base("llama")).sites  # the plain layer still fits


def test_hidden_states_under_autocast_have_the_base_models_dtype():
    """bf16 streams under autocast: each layer's merged state goes back to the embeddings' dtype, as the
    final norm's input does (the base model's hidden states are float32 there)."""
    model = convert_to_mhc(tiny_base("llama"), n_streams=2).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        states = model(ids(), output_hidden_states=True).hidden_states
    assert {h.dtype for h in states} == {torch.float32}, [h.dtype for h in states]


@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize("reduce", ["mean", "learned"])
def test_conversion_is_bit_exact_for_stream_counts_whose_mean_rounds(n, reduce):
    """A float32 mean of n equal streams rounds for n = 3, 5, ... (|Δlogit| 1e-7 before); the reduce
    around stream 0 keeps conversion bit-exact for every n >= 2."""
    base = tiny_base("llama").eval()
    x = ids()
    with torch.no_grad():
        reference = base(x).logits
        model = convert_to_mhc(base, n_streams=n, reduce=reduce)
        assert torch.equal(model(x).logits, reference)


def test_a_second_model_built_on_a_live_config_shares_it_as_hf_models_do():
    """Building a model from ``model.config`` used to re-point the first model's base config at the
    second model's copy: after ``resize_token_embeddings`` the first model's loss then failed."""
    model = convert_to_mhc(tiny_base("llama"))
    twin = MHCForCausalLM(model.config)
    also = AutoModelForCausalLM.from_config(model.config)
    assert model.config.get_text_config() is model.model.config
    assert twin.model.config is model.model.config and also.model.config is model.model.config
    model.resize_token_embeddings(VOCAB + 8)
    x = ids()
    loss = model(input_ids=x, labels=x).loss
    assert torch.isfinite(loss)
    model.config.use_cache = False
    assert model.model.config.use_cache is False


def test_standard_keywords_reach_the_base_config_and_read_back():
    """``MHCConfig(use_cache=False, pad_token_id=..., ...)`` used to stay on the wrapper (or be lost) while
    the model read the base config; a saved file's top-level copy of such a field no longer wins."""
    given = dict(
        use_cache=False, tie_word_embeddings=True, pad_token_id=3, bos_token_id=7, output_hidden_states=True
    )
    config = MHCConfig(base_config=tiny_config("llama"), **given)
    base = config.get_text_config()
    for name, value in given.items():
        assert getattr(config, name) == value and getattr(base, name) == value, name
    model = MHCForCausalLM(config)
    assert model.model.lm_head.weight is model.model.model.embed_tokens.weight  # tied as asked
    config.output_hidden_states = False
    assert base.output_hidden_states is False and config.output_hidden_states is False
    stale = config.to_dict()
    stale["bos_token_id"] = None  # as an older file's top level held a default beside the base's value
    assert MHCConfig.from_dict(stale).bos_token_id == 7


def test_output_hidden_states_set_on_the_base_model_before_conversion():
    base = tiny_base("llama").eval()
    base.config.output_hidden_states = True
    x = ids()
    expected = base(x).hidden_states
    got = convert_to_mhc(base)(x).hidden_states
    assert len(got) == len(expected) == 3
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)


def test_generic_adapter_refuses_a_sublayer_that_flattens_the_tokens():
    """Llama4's MoE returns [B·S, C] (its layer reshapes it back): conversion used to fail on adding it
    to [B, S, C] with a bare shape error from inside the adapter's probe."""
    import transformers

    from mhc.hf.generic import UnsupportedLayoutError

    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Llama4")
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
    )  # fmt: skip
    base = AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        UnsupportedLayoutError, match=r"'feed_forward' has shape \(\d+, 32\), the layer input"
    ):
        convert_to_mhc(base)


def test_loading_mistakes_get_errors_that_say_what_to_do(tmp_path):
    plain = tmp_path / "plain"
    tiny_base("llama").save_pretrained(plain)
    with pytest.raises(ValueError, match="'llama' config, not an mHC one.*base_config=AutoConfig"):
        MHCForCausalLM.from_pretrained(plain)
    with pytest.raises(TypeError, match="needs an mhc.MHCConfig, got LlamaConfig"):
        MHCForCausalLM(tiny_config("llama"))
    with pytest.raises(TypeError, match="needs an mhc.MHCConfig"):
        MHCForCausalLM.from_pretrained(plain, config=tiny_config("llama"))
    saved = tmp_path / "mhc"
    convert_to_mhc(tiny_base("llama")).save_pretrained(saved)
    # PreTrainedModel drops keywords it does not know; a misspelt option used to load the default silently
    with pytest.raises(TypeError, match="n_stream.*did you mean 'n_streams'"):
        MHCForCausalLM.from_pretrained(saved, n_stream=2)
    with pytest.raises(TypeError, match="foo_bar"):
        MHCForCausalLM.from_pretrained(saved, foo_bar=2)
    assert MHCForCausalLM.from_pretrained(saved, sinkhorn_iters=7).config.sinkhorn_iters == 7
