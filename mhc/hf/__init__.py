"""HuggingFace transformers integration: mHC models that wrap an existing decoder's layers.

* :mod:`mhc.hf.modeling`: :class:`MHCForCausalLM`, :class:`MHCDecoderLayer` and
  :func:`convert_to_mhc`; importing it registers ``model_type="mhc"`` with
  transformers' Auto classes.
* :mod:`mhc.hf.config`: :class:`MHCConfig`, plain serialisable fields.
* :mod:`mhc.hf.adapters` and :mod:`mhc.hf.generic`: where each family keeps its
  layers, sublayers and norms (registered adapters, and the one inferred by
  probing a model).
* :mod:`mhc.hf.branch`: the sublayer callable each :class:`mhc.MHCBlock` wraps.
* :mod:`mhc.hf.verify`: the conversion self-check, and the check that loaded weights are finite
  (:class:`NonFiniteWeightsError`).
* :mod:`mhc.hf.custom_code`: the ``modeling_mhc.py`` + ``auto_map`` that ``save_pretrained`` writes, so a
  saved folder loads with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``
  wherever mhc-torch is installed, without ``import mhc``.
* :mod:`mhc.hf.deepseek_v4`: DeepSeek-V4's hyper-connections read into an :class:`mhc.MHCBlock`.

This subpackage imports transformers; ``import mhc`` does not import it until
one of these names is used.
"""

from .modeling import (
    MHC_FIELDS, MHCConfig, MHCDecoderLayer, MHCForCausalLM, NonFiniteWeightsError, added_parameter_count,
    convert_to_mhc,
)

__all__ = [
    "MHCConfig", "MHCForCausalLM", "MHCDecoderLayer", "MHC_FIELDS", "convert_to_mhc", "added_parameter_count",
    "NonFiniteWeightsError",
]
