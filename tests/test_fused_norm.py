"""The branch's input RMSNorm applied by the no-grad token kernels (generation).

In a decode step the first step of each site also writes ``LlamaRMSNorm(u)`` when the site's branch
starts with a norm of that form (``mhc.hf.branch.is_llama_rms_norm``), so the branch skips its norm's
~8 launches. The CPU tests check which norms qualify and the branch protocol; the CUDA tests check the
kernels against HF's norm and a converted model's generation against the same model with the fusion off.
"""

from __future__ import annotations

import pytest
import torch
from test_generate import NEW_TOKENS, greedy, prompts, tiny_mhc_llama
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import mhc
from mhc.hf.branch import is_llama_rms_norm

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _ScaledNorm(LlamaRMSNorm):
    def forward(self, hidden_states):
        return 2 * super().forward(hidden_states)


def test_llama_style_norms_are_recognised_and_others_are_not():
    """Llama's norm and its copies qualify; Gemma's (1 + w), OLMo2's, a subclass with its own forward,
    a LayerNorm, and any norm with a forward hook (its own or global) or an instance forward do not."""
    for cls in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm):
        assert is_llama_rms_norm(cls(16, eps=1e-5)), cls.__name__
    for norm in (GemmaRMSNorm(16), Olmo2RMSNorm(16), _ScaledNorm(16), torch.nn.LayerNorm(16)):
        assert not is_llama_rms_norm(norm), type(norm).__name__
    norm = LlamaRMSNorm(16)
    handle = norm.register_forward_hook(lambda m, args, out: None)
    assert not is_llama_rms_norm(norm)
    handle.remove()
    handle = norm.register_forward_pre_hook(lambda m, args: None)
    assert not is_llama_rms_norm(norm)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
    try:
        assert not is_llama_rms_norm(norm)
    finally:
        handle.remove()
    assert is_llama_rms_norm(norm)
    norm.forward = lambda h: h
    assert not is_llama_rms_norm(norm)


def test_site_branch_offers_its_norm_and_runs_on_the_normed_input(fresh_seed):
    """A converted Llama layer's branches offer (weight, eps) of their input norms; given the normed
    input, the branch skips its norm and returns the bits of the plain call (and uses what it is given).
    The layer's fuse_input_norm switches the offer off; GPT-2's LayerNorm is never offered."""
    model = tiny_mhc_llama(fresh_seed % 1000)
    layer = model.decoder_layers()[0]
    torch.manual_seed(fresh_seed)
    u = torch.randn(2, 3, 32)
    for site_name, norm_name in (("attn_mhc", "input_layernorm"), ("mlp_mhc", "post_attention_layernorm")):
        branch = getattr(layer, site_name).branch
        norm = getattr(layer, norm_name)
        weight, eps = branch.fusable_input_norm()
        assert weight is norm.weight and eps == norm.variance_epsilon
        kwargs = {}
        if site_name == "attn_mhc":
            kwargs = {
                "position_embeddings": model.model.model.rotary_emb(u, torch.arange(3)[None]),
                "attention_mask": None,
            }
        with torch.no_grad():
            plain = branch(u, **kwargs)
            assert torch.equal(branch.call_normed(u, norm(u), **kwargs), plain), site_name
            assert not torch.equal(branch.call_normed(u, 2 * norm(u), **kwargs), plain), site_name
    layer.fuse_input_norm = False
    assert layer.attn_mhc.branch.fusable_input_norm() is None
    del layer.fuse_input_norm  # back to the class default
    assert layer.attn_mhc.branch.fusable_input_norm() is not None
    cfg = GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32)
    gpt2 = mhc.convert_to_mhc(GPT2LMHeadModel(cfg), n_streams=4)
    assert all(s.branch.fusable_input_norm() is None for s in gpt2.modules() if isinstance(s, mhc.MHCBlock))


@CUDA
@pytest.mark.parametrize("C", [64, 1100])
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_token_kernels_apply_the_branch_norm_as_hf_does(C, n, dtype, fresh_seed):
    """pre_no_grad and post_pre_no_grad with a norm: u keeps its bits, normed is LlamaRMSNorm(u) to the
    output dtype's rounding (bit-equal in nearly every element), on hard streams too (a token ×1e3, one
    ×1e-3); the boundary call's normed has the bits of pre_no_grad on its x'. A weight of another
    dtype or length is not applied (normed None). C = 1100: 8 blocks a token, a ragged last one.

    Half precision rounds twice, as HF's norm does (``u·r``, then ``w·that``): where our ``r`` and
    torch's differ in their last bit, the first rounding can land one ulp apart and the product two
    (seen on the H200: at most 2 ulps, in under 0.1 % of elements over 40 seeds per case)."""
    from mhc.fused import tokens as fused_tokens

    torch.manual_seed(fresh_seed)
    block = mhc.MHCBlock(torch.nn.Identity(), C, n, init="paper").cuda()
    with torch.no_grad():
        block.phi.normal_(std=0.05)
    params = [p.detach() for p in (block.phi, block.alpha, block.b_pre, block.b_post, block.b_res)]
    norm = LlamaRMSNorm(C, eps=1e-6).cuda().to(dtype)
    with torch.no_grad():
        norm.weight.normal_(mean=1.0, std=0.5)
    weight = norm.weight.detach()
    equal = total = 0
    for T in (1, 5, fused_tokens.MAX_TOKENS):
        x = torch.randn(T, n, C, device="cuda")
        x[0] *= 1e3
        x[-1] *= 1e-3
        x = x.to(dtype)
        with torch.no_grad():
            u, mix, xs, none = fused_tokens.pre_no_grad(x, *params, 1e-6, 1e-6)
            u2, mix2, _, normed = fused_tokens.pre_no_grad(x, *params, 1e-6, 1e-6, (weight, 1e-6))
            reference = norm(u)
        assert none is None and torch.equal(u, u2) and torch.equal(mix, mix2), f"seed {fresh_seed}"
        assert normed.dtype == dtype and normed.shape == (T, C)
        if dtype == torch.float32:
            torch.testing.assert_close(normed, reference, rtol=1e-5, atol=1e-6)
        else:
            ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
            torch.testing.assert_close(normed.float(), reference.float(), rtol=2 * ulp, atol=1e-5)
            equal, total = equal + int((normed == reference).sum()), total + normed.numel()
        y = torch.randn(T, C, device="cuda").to(dtype)
        with torch.no_grad():
            x_new, u_next, mix_next, normed_next = fused_tokens.post_pre_no_grad(
                xs, y, mix, *params, 1e-6, 1e-6, (weight, 1e-6)
            )
            u_own, mix_own, _, normed_own = fused_tokens.pre_no_grad(
                x_new, *params, 1e-6, 1e-6, (weight, 1e-6)
            )
        assert torch.equal(u_next, u_own) and torch.equal(mix_next, mix_own), f"seed {fresh_seed}"
        assert torch.equal(normed_next, normed_own), f"seed {fresh_seed}"
    assert equal >= 0.99 * total, f"seed {fresh_seed}: {total - equal} of {total} elements differ"
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    for bad in (weight.to(other), weight[:-1], weight.cpu()):
        assert fused_tokens.pre_no_grad(x, *params, 1e-6, 1e-6, (bad, 1e-6))[3] is None


def _rsqrt_calls(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tokens, logits = greedy(model, ids, mask)
    return tokens, logits, sum(e.count for e in prof.key_averages() if e.key == "aten::rsqrt")


@CUDA
def test_generation_with_fused_norms_matches_the_model_that_runs_them(fresh_seed):
    """A converted Llama generates with its four branch norms fused into the sites' first steps: the
    tokens of the same model with fuse_input_norm off, logits to float32 rounding, and only the final
    norm's rsqrt left per forward. A norm with a hook runs itself (the hook sees every forward)."""
    model = tiny_mhc_llama(fresh_seed % 1000).cuda()
    ids, mask = (t.cuda() for t in prompts(fresh_seed, batch=2))
    layers = model.decoder_layers()
    tokens, logits, fused_rsqrt = _rsqrt_calls(model, ids, mask)
    for layer in layers:
        layer.fuse_input_norm = False
    try:
        plain_tokens, plain_logits, plain_rsqrt = _rsqrt_calls(model, ids, mask)
    finally:
        for layer in layers:
            del layer.fuse_input_norm
    assert torch.equal(tokens, plain_tokens), f"seed {fresh_seed}"
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-4)
    assert (fused_rsqrt, plain_rsqrt) == (NEW_TOKENS, 5 * NEW_TOKENS), (fused_rsqrt, plain_rsqrt)
    seen = []
    handle = layers[0].input_layernorm.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    try:
        hooked_tokens, _, hooked_rsqrt = _rsqrt_calls(model, ids, mask)
    finally:
        handle.remove()
    assert len(seen) == NEW_TOKENS and hooked_rsqrt == 2 * NEW_TOKENS and torch.equal(hooked_tokens, tokens)
    half = model.to(torch.bfloat16)  # the weights and streams share a dtype: the norms are fused there too
    assert _rsqrt_calls(half, ids, mask)[2] == NEW_TOKENS
