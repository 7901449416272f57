"""HuggingFace transformers integration: mHC models that wrap an existing decoder's layers.

* :mod:`mhc.hf.modeling`: :class:`MHCForCausalLM` and :class:`MHCDecoderLayer`;
  importing it registers ``model_type="mhc"`` with transformers' Auto classes.
* :mod:`mhc.hf.convert`: :func:`convert_to_mhc` and :func:`added_parameter_count`.
* :mod:`mhc.hf.custom_code`: the loader a saved folder carries (``trust_remote_code=True``).
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

from .config import MHC_FIELDS, MHCConfig, check_model_settings
from .convert import added_parameter_count, convert_to_mhc
from .modeling import MHCDecoderLayer, MHCForCausalLM
from .verify import NonFiniteWeightsError

__all__ = [
    "MHCConfig",
    "MHCForCausalLM",
    "MHCDecoderLayer",
    "MHC_FIELDS",
    "check_model_settings",
    "convert_to_mhc",
    "added_parameter_count",
    "NonFiniteWeightsError",
]
