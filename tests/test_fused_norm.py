"""The branch's input RMSNorm applied by the site's kernels: the no-grad token kernels (generation) and
the grad path's Triton kernels (training).

In a decode step the first step of each site also writes ``LlamaRMSNorm(u)`` when the site's branch
starts with a norm of that form (``mhc.hf.branch.is_llama_rms_norm``), so the branch skips its norm's
~8 launches. With grad, the Triton kernels apply the same norm where they form ``u`` and take the
norm's output gradient in backward, so ``u`` is never stored. The CPU tests check which norms qualify,
the branch protocol, and the grad path in Triton's interpreter against PyTorch's norm (and against
finite differences); the CUDA tests check the token kernels against HF's norm, and converted models
with the fusion on against the same models with it off.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_fused_block import DEVICE, NO_TRITON, _rel
from test_generate import NEW_TOKENS, greedy, prompts, tiny_mhc_llama
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import mhc
from mhc import fused
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


# ----------------------------------------------------------------------------- the grad path

TRITON = pytest.mark.skipif(NO_TRITON is not None, reason=NO_TRITON or "")


def _site_parameters(n: int, C: int, dtype=torch.float32) -> list[torch.Tensor]:
    """φ, α, b_pre, b_post, b_res with coefficients that depend on each token."""
    Z = n * n + 2 * n
    return [
        0.3 * torch.randn(Z, n * C, device=DEVICE, dtype=dtype) / (n * C) ** 0.5,
        torch.tensor([0.5, 0.7, 1.5], device=DEVICE, dtype=dtype),
        torch.randn(n, device=DEVICE, dtype=dtype),
        torch.randn(n, device=DEVICE, dtype=dtype),
        2 * torch.randn(n, n, device=DEVICE, dtype=dtype),
    ]


def _normed_site(x, params, weight, lin, u_dtype, in_kernels: bool):
    """``(x', normed)`` of a site whose branch is ``lin(RMSNorm(u))``, the norm in the kernels or in PyTorch."""
    if in_kernels:
        normed, site = fused.site_pre(
            x, *params, norm_eps=1e-6, tol=1e-6, u_dtype=u_dtype, branch_norm=(weight, 1e-5)
        )
        assert site.normed is normed, "the kernels did not apply the norm"
    else:
        u, site = fused.site_pre(x, *params, norm_eps=1e-6, tol=1e-6, u_dtype=u_dtype)
        normed = fused.rms_norm_reference(u, weight, 1e-5)
    return fused.post_mix(lin(normed), site), normed


def _normed_site_grads(x, params, weight, lin, u_dtype, in_kernels, g):
    leaves = [t.detach().clone().requires_grad_() for t in (x, *params, weight)]
    lin.zero_grad(set_to_none=True)
    out, normed = _normed_site(leaves[0], leaves[1:6], leaves[6], lin, u_dtype, in_kernels)
    out.backward(g.to(out.dtype))
    return [out.detach(), normed.detach()] + [t.grad for t in leaves] + [lin.weight.grad]


@TRITON
@pytest.mark.parametrize("n, C", [(4, 64), (3, 200)])
@pytest.mark.parametrize(
    "dtype, u_dtype, weight_dtype",
    # fp32 weights (fp32 streams); fp32 weights under bf16 autocast (bf16 streams, fp32 u); a bf16 model
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ],
)
def test_grad_path_applies_the_branch_norm_as_pytorch_does(n, C, dtype, u_dtype, weight_dtype, fresh_seed):
    """fused.site_pre with branch_norm and grad: the norm's output, the site's output and every gradient
    (streams, coefficients, the norm's weight, the branch's) as with the norm applied by PyTorch to u,
    on hard streams (a token ×1e3, one ×1e-3). With a float32 u both agree to float32 rounding; with a
    bf16 u each is judged against float64 (the kernels may be 4x as far off as PyTorch, or 4e-2)."""
    torch.manual_seed(fresh_seed)
    x = torch.randn(2, 9, n, C, device=DEVICE)
    x[0, 0] *= 1e3
    x[1, -1] *= 1e-3
    x = x.to(dtype)
    params = _site_parameters(n, C)
    weight = (1 + 0.5 * torch.randn(C, device=DEVICE)).to(weight_dtype)
    normed_dtype = torch.promote_types(weight_dtype, u_dtype)
    lin = torch.nn.Linear(C, C, device=DEVICE).to(normed_dtype)
    g = torch.randn(x.shape, device=DEVICE)
    fast = _normed_site_grads(x, params, weight, lin, u_dtype, True, g)
    slow = _normed_site_grads(x, params, weight, lin, u_dtype, False, g)
    names = ["output", "normed", "dx", "dφ", "dα", "db_pre", "db_post", "db_res", "dw", "d lin"]
    assert fast[1].dtype == normed_dtype
    if u_dtype == torch.float32:
        for name, f, s in zip(names, fast, slow):
            assert _rel(f, s) < (1e-5 if name in ("output", "normed") else 1e-4), f"seed {fresh_seed}: {name}"
        return
    lin64 = torch.nn.Linear(C, C, device=DEVICE).double()
    lin64.load_state_dict(lin.state_dict())
    gold = _normed_site_grads(
        x.double(), [p.double() for p in params], weight.double(), lin64, torch.float64, False, g
    )
    for name, f, s, g64 in zip(names, fast, slow, gold):
        err_fast, err_slow = _rel(f.double(), g64), _rel(s.double(), g64)
        assert err_fast <= max(4 * err_slow, 4e-2), (
            f"seed {fresh_seed}: {name} {err_fast:.3e} vs {err_slow:.3e}"
        )


@TRITON
def test_grad_path_norm_gradcheck_float64(fresh_seed):
    """The public steps with branch_norm around a branch, against finite differences (the norm's weight too)."""
    torch.manual_seed(fresh_seed)
    n, C = 3, 4
    lin = torch.nn.Linear(C, C).double().to(DEVICE)
    x = torch.randn(2, n, C, dtype=torch.float64, device=DEVICE)
    weight = 1 + 0.5 * torch.randn(C, dtype=torch.float64, device=DEVICE)
    inputs = [t.requires_grad_() for t in (x, *_site_parameters(n, C, torch.float64), weight)]

    def site(x, phi, alpha, b_pre, b_post, b_res, weight):
        normed, mix = fused.site_pre(
            x, phi, alpha, b_pre, b_post, b_res, norm_eps=1e-6, tol=1e-12, branch_norm=(weight, 1e-5)
        )
        assert mix.normed is normed
        return fused.post_mix(torch.tanh(lin(normed)), mix)

    assert torch.autograd.gradcheck(site, inputs, atol=1e-7, rtol=1e-5)


@TRITON
def test_grad_path_norm_only_with_grad_and_within_its_width():
    """Without grad the branch keeps its own norm (evaluation keeps HF's bits); a weight of another
    length or device is never applied; the plan holds whole rows up to NORM_MAX_C and no further."""
    from mhc.fused import plan as fused_plan
    from mhc.fused import site as fused_site

    n, C = 4, 32
    x = torch.randn(3, n, C, device=DEVICE)
    weight = torch.ones(C, device=DEVICE)
    assert fused_site.takes_norm(x, weight)
    with torch.no_grad():
        assert not fused_site.takes_norm(x, weight)
        normed, site = fused.site_pre(
            x, *_site_parameters(n, C), norm_eps=1e-6, tol=1e-6, branch_norm=(weight, 1e-5)
        )
    if DEVICE == "cpu":  # (on CUDA the decode kernels apply it without grad)
        assert site.normed is None
    assert not fused_site.takes_norm(x, weight[:-1])
    assert fused_plan.fused_norm_fits(fused_plan.NORM_MAX_C) and not fused_plan.fused_norm_fits(8193)
    for width in (64, 512, 768, 2048, 8192):
        plan = fused_plan.Plan(
            torch.Size((4096, n, width)), torch.bfloat16, torch.device(DEVICE), torch.float32, torch.float32
        )
        meta = plan.coeff_fwd.meta
        assert meta["NORM"] and meta["BC"] >= width and meta["BM"] * meta["BC"] <= 8192, width
        assert plan.normed_dtype == torch.float32 and not plan.tokens
    with pytest.raises(ValueError, match="branch_norm's weight"):
        fused.site_pre(x, *_site_parameters(n, C), norm_eps=1e-6, tol=1e-6, branch_norm=(weight[:-1], 1e-5))


def count_fused_norm_calls(monkeypatch) -> list:
    """Send MHCBlocks to the fused path in Triton's interpreter, and count the sites' calls of their
    branches without the branch's own norm (``SiteBranch.call_normed``): the returned list grows by one
    each."""
    from test_fused_block import InterpretedFusedBlock

    from mhc.hf.branch import SiteBranch

    monkeypatch.setattr(mhc.MHCBlock, "uses_fused", InterpretedFusedBlock.uses_fused)
    calls = []
    inner = SiteBranch.call_normed
    monkeypatch.setattr(SiteBranch, "call_normed", lambda *a, **k: calls.append(1) or inner(*a, **k))
    return calls


@TRITON
def test_converted_llama_trains_with_its_norms_in_the_sites(monkeypatch, fresh_seed):
    """A converted Llama's training step with its four branch norms applied by the site kernels: the loss
    and every gradient (the norms' weights included) of the same model with fuse_input_norm off, and no
    branch norm run by PyTorch; without grad the norms run in the branches. Gradients are judged against
    the float64 model's: some (b_pre's, where ⟨du, x_i⟩ nearly cancels) are 1e-3 off in float32 on
    either path, so each path's error must be within 4x the other's, 1e-5 of the gradient, or 1e-6 of the
    whole gradient's norm (a b_pre gradient of norm 2e-5 was 8e-9 off on CUDA, 2e-9 on the plain path)."""
    model = tiny_mhc_llama(fresh_seed % 1000).to(DEVICE)  # converted (and self-checked) on the CPU
    gold_model = copy.deepcopy(model).double()
    normed_calls = count_fused_norm_calls(monkeypatch)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(fresh_seed)).to(DEVICE)
    layers = model.decoder_layers()

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().double(), {name: p.grad.double() for name, p in m.named_parameters()}

    loss, grads = step(model)
    assert len(normed_calls) == 2 * len(layers)
    for layer in layers:
        layer.fuse_input_norm = False
    plain_loss, plain_grads = step(model)
    assert len(normed_calls) == 2 * len(layers)
    for layer in layers:
        del layer.fuse_input_norm
    gold_loss, gold_grads = step(gold_model)  # the float64 model's sites apply its norms too
    assert len(normed_calls) == 4 * len(layers)
    assert abs(loss - gold_loss) <= max(4 * abs(plain_loss - gold_loss), 1e-6 * abs(gold_loss))
    assert any("layernorm" in name for name in grads)
    scale = torch.cat([gold.flatten() for gold in gold_grads.values()]).norm()
    for name, gold in gold_grads.items():
        err, plain_err = (grads[name] - gold).norm(), (plain_grads[name] - gold).norm()
        assert err <= max(4 * plain_err, 1e-5 * gold.norm(), 1e-6 * scale), (
            f"seed {fresh_seed}: {name} {err:.3e} vs {plain_err:.3e}"
        )
    with torch.no_grad():
        model(input_ids=ids)
    assert len(normed_calls) == 4 * len(layers) + (2 * len(layers) if DEVICE == "cuda" else 0)


@TRITON
def test_compiled_step_leaves_the_norms_to_inductor(monkeypatch):
    """While dynamo traces, a converted Llama's branch norms run in the branches (inductor fuses them with
    their neighbours; the site applying them was slower compiled), and the traced step's loss is the eager
    step's."""
    model = tiny_mhc_llama(5).to(DEVICE)
    normed_calls = count_fused_norm_calls(monkeypatch)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    eager_loss = model(input_ids=ids, labels=ids).loss
    assert len(normed_calls) == 2 * len(model.decoder_layers())
    normed_calls.clear()
    traced_loss = torch.compile(model, backend="eager")(input_ids=ids, labels=ids).loss
    assert normed_calls == []
    torch.testing.assert_close(traced_loss, eager_loss, rtol=1e-5, atol=1e-6)


@TRITON
def test_frozen_norm_weights_stay_frozen_with_fused_norms(monkeypatch):
    """LoRA-style fine-tuning freezes the norms: with their weights not requiring grad the fused sites still
    apply them, leave their .grad None, and give every trained parameter the plain path's gradient."""
    model = tiny_mhc_llama(7).to(DEVICE)
    normed_calls = count_fused_norm_calls(monkeypatch)
    norms = [p for name, p in model.named_parameters() if "layernorm" in name]
    assert norms
    for p in norms:
        p.requires_grad_(False)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    layers = model.decoder_layers()

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])

    loss, grads = step()
    assert len(normed_calls) == 2 * len(layers)
    assert all(p.grad is None for p in norms)
    for layer in layers:
        layer.fuse_input_norm = False
    plain_loss, plain_grads = step()
    assert len(normed_calls) == 2 * len(layers)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    assert (grads - plain_grads).norm() <= 1e-4 * plain_grads.norm()


@TRITON
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_fused_norms_under_activation_checkpointing(monkeypatch, use_reentrant):
    """HF activation checkpointing reruns each layer in backward: the fused sites apply the norms where grad
    is on (the rerun's sites keep their own streams), and the gradients are the uncheckpointed step's."""
    model = tiny_mhc_llama(11).to(DEVICE)
    normed_calls = count_fused_norm_calls(monkeypatch)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(11)).to(DEVICE)
    sites = 2 * len(model.decoder_layers())

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    model.train()
    loss, grads = step()
    assert len(normed_calls) == sites
    # Without grad, 14 tokens run the CUDA token kernels, which apply the norms as in generation
    # (SiteBranch.fusable_input_norm); elsewhere (the interpreter) the branches apply their own.
    with torch.no_grad():
        model(input_ids=ids)
    no_grad_calls = len(normed_calls) - sites
    assert no_grad_calls == (sites if DEVICE == "cuda" else 0)
    del normed_calls[sites:]
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ckpt_loss, ckpt_grads = step()
    # The backward's rerun applies them with grad; the reentrant forward runs without grad, as above.
    assert len(normed_calls) == 3 * sites - (sites - no_grad_calls if use_reentrant else 0)
    torch.testing.assert_close(ckpt_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@TRITON
def test_lora_on_a_converted_llama_trains_through_the_fused_norms(monkeypatch):
    """PEFT's LoRA with the sites as modules_to_save (PEFT deep-copies each MHCBlock): the copies' sites
    still apply the live layers' norms, the LoRA projections run on their output, and the trained
    parameters' gradients are those with the fusion off."""
    from peft import LoraConfig, get_peft_model

    base = tiny_mhc_llama(13)
    sites = base.mhc_module_names()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=sites)
    model = get_peft_model(base, config).to(DEVICE)
    normed_calls = count_fused_norm_calls(monkeypatch)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                p.normal_(0, 0.1)  # off zero, so that lora_A has a gradient
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(13)).to(DEVICE)
    layers = base.decoder_layers()

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        trained = [(name, p.grad) for name, p in model.named_parameters() if p.requires_grad]
        assert all(g is not None for _, g in trained)
        return loss.detach(), torch.cat([g.flatten() for _, g in trained]), {n for n, _ in trained}

    loss, grads, trained = step()
    assert len(normed_calls) == 2 * len(layers)
    assert any("lora_A" in n for n in trained) and any("modules_to_save" in n for n in trained)
    for layer in layers:
        layer.fuse_input_norm = False
    plain_loss, plain_grads, _ = step()
    assert len(normed_calls) == 2 * len(layers)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
    assert (grads - plain_grads).norm() <= 1e-4 * plain_grads.norm()
