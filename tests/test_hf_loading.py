"""Loading mHC models: errors that name their cause (CPU).

* :func:`mhc.convert_to_mhc` refuses a model without an LM head, naming it;
* an :class:`mhc.MHCConfig` whose recorded adapter does not fit its base model says which disagree.
"""

from __future__ import annotations

import pytest
from transformers import GPT2Model, LlamaModel

from mhc import MHCConfig, MHCForCausalLM, convert_to_mhc
from mhc.hf.adapters import ADAPTERS
from test_hf import tiny_base, tiny_config


@pytest.mark.parametrize("verify", [None, False])
@pytest.mark.parametrize("arch,headless,causal", [("llama", LlamaModel, "LlamaForCausalLM"),
                                                  ("gpt2", GPT2Model, "GPT2LMHeadModel")])
def test_convert_refuses_a_model_without_lm_head(arch, headless, causal, verify):
    """A headless base model (what AutoModel loads) is refused before anything runs, naming its class and
    the causal-LM class to load instead (before: AttributeError about `logits`, or about `model` with
    verify=False)."""
    model = headless(tiny_config(arch))
    with pytest.raises(ValueError) as info:
        convert_to_mhc(model, n_streams=2, verify=verify)
    msg = str(info.value)
    assert headless.__name__ in msg and causal in msg and "LM head" in msg, msg
    assert "AutoModelForCausalLM" in msg, msg
    assert not any(type(m).__name__ == "MHCDecoderLayer" for m in model.modules())  # left as it was


def test_config_whose_adapter_does_not_fit_its_base_model_type():
    """A GPT-2 base config with Llama's adapter names both and the fix (before: "GPT2LMHeadModel has no
    attribute `model`")."""
    cfg = MHCConfig(base_config=tiny_config("gpt2"), n_streams=2, adapter=ADAPTERS["llama"])
    with pytest.raises(ValueError) as info:
        MHCForCausalLM(cfg)
    msg = str(info.value)
    assert "'gpt2'" in msg and "GPT2LMHeadModel" in msg, msg
    assert "'model.layers'" in msg and "'transformer.h'" in msg, msg  # what the adapter names, where they are
    assert "llama" in msg, msg  # whose adapter it is
    assert "adapter=None" in msg, msg  # the fix
    # The fix works: the registered adapter of the base model_type.
    cfg.adapter = None
    assert isinstance(MHCForCausalLM(cfg), MHCForCausalLM)


def test_convert_with_an_adapter_that_does_not_fit_names_it():
    """An explicit adapter whose layer path is not in the model: the same message, the model left unconverted."""
    base = tiny_base("gpt2")
    with pytest.raises(ValueError, match="'model.layers'") as info:
        convert_to_mhc(base, n_streams=2, adapter=ADAPTERS["llama"])
    assert "GPT2LMHeadModel" in str(info.value)
    assert not any(type(m).__name__ == "MHCDecoderLayer" for m in base.modules())
