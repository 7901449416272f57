"""PEFT on a converted model: LoRA on the attention plus the mHC sites as modules_to_save.

PEFT's modules_to_save deep-copies each MHCBlock; the copy must keep calling
the live decoder layer (whose projections carry the LoRA weights), or LoRA
silently stops doing anything.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from test_families import family_model as tiny_base
from test_hf import ids, perturb_mhc

from mhc import MHCBlock, convert_to_mhc

# gpt_neox: a parallel-residual layer, one site per layer (parallel_mhc).
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "gpt_neox": ["query_key_value"]}
ARCHS = sorted(TARGETS)


def lora_model(arch: str):
    model = convert_to_mhc(tiny_base(arch), n_streams=4)
    perturb_mhc(model)  # off the identity init, so every coefficient has a gradient
    sites = model.mhc_module_names()  # the blocks' names, what modules_to_save needs
    assert sites == (["parallel_mhc"] if arch == "gpt_neox" else ["attn_mhc", "mlp_mhc"])
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[arch], modules_to_save=sites)
    return get_peft_model(model, config), sites


def train_steps(model, steps: int) -> dict[str, torch.Tensor]:
    """A few AdamW steps; returns the gradients of the last one."""
    model.train()
    x = ids(batch=2, seq=8)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(x, labels=x).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
    return grads


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_and_mhc_coefficients_both_train(arch):
    model, sites = lora_model(arch)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {n for n in trainable if "lora_" in n}
    mhc = {n for n in trainable if any(f"{site}.modules_to_save." in n for site in sites)}
    assert lora and mhc and trainable == lora | mhc
    assert len(mhc) == 2 * len(sites) * 5  # 2 layers x sites x (phi, alpha, b_pre, b_post, b_res)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    # The first site sees n copies of the embedding: H_res mixes zero deviations, so b_res has no gradient there.
    first_b_res = {n for n in mhc if f".0.{sites[0]}." in n and n.endswith(".b_res")}
    assert len(first_b_res) == 1
    grads = train_steps(model, 1)
    for name in (mhc - first_b_res) | {
        n for n in lora if "lora_B" in n
    }:  # lora_A's gradient is 0 while lora_B is 0
        assert grads[name].abs().sum() > 0, name
    grads = train_steps(model, 1)
    for name in trainable - first_b_res:
        assert grads[name].abs().sum() > 0, name
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name

    # LoRA is live: moving lora_B moves the logits.
    model.eval()
    x = ids()
    with torch.no_grad():
        before = model(x).logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)
        after = model(x).logits
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_peft_save_reload_and_merge(arch, tmp_path):
    model, sites = lora_model(arch)
    train_steps(model, 3)
    model.eval()
    x = ids()
    with torch.no_grad():
        out = model(x).logits
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_B" in k for k in saved) and any(k.endswith(f"{sites[0]}.phi") for k in saved)
    for key, value in saved.items():
        if "_mhc." in key:  # saved under the block's own name, with the trained values
            assert torch.equal(value, trained[key.replace("_mhc.", "_mhc.modules_to_save.default.")]), key

    fresh = convert_to_mhc(tiny_base(arch), n_streams=4)  # the same base weights, identity mHC
    reloaded = PeftModel.from_pretrained(fresh, tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, out)

    # merge_and_unload: a plain mHC model again, with the trained blocks and merged LoRA weights.
    merged = reloaded.merge_and_unload()
    assert set(merged.state_dict()) == set(convert_to_mhc(tiny_base(arch), n_streams=4).state_dict())
    blocks = [m for m in merged.modules() if isinstance(m, MHCBlock)]
    assert len(blocks) == 2 * len(sites)
    assert all(any(getattr(b.branch.layer, site) is b for site in sites) for b in blocks)
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, out, rtol=1e-5, atol=1e-5)
