"""``convert_to_mhc``: an existing HF causal LM's decoder layers wrapped in mHC sites, with the output kept.

The conversion builds :class:`~mhc.hf.modeling.MHCForCausalLM` around the given
model (its weights are the model's own tensors, not copies), checks the result
against the original model's logits (:mod:`mhc.hf.verify`) and puts the
original layers back if anything fails. :func:`added_parameter_count` says what
the conversion adds.
"""

from __future__ import annotations

import copy
import math

from torch import nn
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..block import MHCBlock
from ..options import reject_unknown_options
from ..streams import StreamReduce
from .adapters import Adapter
from .config import MHC_FIELDS, MHCConfig
from .generic import adapter_for_model, check_adapter_fits
from .modeling import MHCForCausalLM
from .verify import (
    ConversionMismatchError,
    check_logits,
    identity_coefficients,
    reference_logits,
    verify_by_default,
)

__all__ = ["convert_to_mhc", "added_parameter_count"]


def _check_causal_lm(model: PreTrainedModel) -> None:
    """``ValueError`` naming the class if ``model`` is a headless base model (no LM head, no logits)."""
    if getattr(model, "base_model", model) is not model or model.get_output_embeddings() is not None:
        return
    try:
        suggestion = MODEL_FOR_CAUSAL_LM_MAPPING[type(model.config)].__name__
    except (KeyError, ImportError, AttributeError):  # an architecture without a registered causal-LM class
        suggestion = "LlamaForCausalLM"
    raise ValueError(
        f"convert_to_mhc needs a causal LM with its LM head (e.g. {suggestion}), got {type(model).__name__}, "
        "a base model without one (what AutoModel loads; it returns hidden states, not logits). Load the "
        "checkpoint with AutoModelForCausalLM.from_pretrained(...) and convert that."
    )


def _restore_layers(model: PreTrainedModel, adapter: Adapter, originals: list[nn.Module]) -> None:
    """Put the original decoder layers back (after a failed conversion: ``model`` is as before)."""
    layers = model.get_submodule(adapter.layers)
    for i, layer in enumerate(originals):
        layers[i] = layer


def convert_to_mhc(
    model: PreTrainedModel,
    n_streams: int = 4,
    *,
    adapter: Adapter | None = None,
    verify: bool | None = None,
    **mhc_options,
) -> MHCForCausalLM:
    """Put mHC into an existing HF causal LM, keeping every one of its weights.

    The returned model owns the *same* modules as ``model`` (no copy; ``model``
    itself should not be used afterwards). With the default
    ``init="identity"`` its outputs equal the original's up to float rounding.
    The new coefficient parameters are float32 on the model's device. The
    adapter used is recorded in ``config.adapter`` (a saved model reloads with it).

    Args:
        model: a ``*ForCausalLM``, random or pretrained: of a registered
            architecture (:mod:`mhc.hf.adapters`), or one the generic adapter
            recognises (:mod:`mhc.hf.generic`), which is refused with a
            ``ValueError`` saying what does not fit otherwise.
        n_streams: number of streams.
        adapter: an :class:`mhc.hf.adapters.Adapter` to use instead of the
            registered or generic one.
        verify: the self-check. ``True``: run the original and the converted
            model on a random ``[2, 8]`` input (``φ`` at the identity init's
            zero during the check, whatever ``init``) and raise
            :class:`mhc.hf.verify.ConversionMismatchError` (a ``ValueError``
            with the measured max |logit difference|) beyond
            :func:`mhc.hf.verify.logit_tolerance` (``1e-4·max(1, max|logit|)``
            in fp32); the model is then left unconverted. ``False``: no
            check. ``None`` (default): check models of at most
            :data:`mhc.hf.verify.VERIFY_AUTO_MAX_PARAMETERS` (4e9)
            parameters with no weights on the meta device.
        **mhc_options: any other mHC setting of :class:`MHCConfig` (``mode``,
            ``init``, ``projection``, ``tol``, ``reduce``, ``stream_dtype``, ...);
            anything else raises ``TypeError`` naming the closest setting. The
            self-check runs with ``stream_dtype="hidden"`` whatever is asked:
            it checks the adapter, and bf16 streams of an fp32 model round.
    """
    reject_unknown_options(mhc_options, [f for f in MHC_FIELDS if f != "base_config"], "convert_to_mhc")
    if verify is not None and not isinstance(verify, bool):
        raise TypeError(f"verify must be True, False or None, got {verify!r}")
    if isinstance(model, MHCForCausalLM):
        raise ValueError("model is already an MHCForCausalLM")
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"convert_to_mhc needs a transformers PreTrainedModel, got {type(model).__name__}")
    _check_causal_lm(model)
    if adapter is None:
        adapter = adapter_for_model(model)
    elif not isinstance(adapter, Adapter):
        raise TypeError(f"adapter must be an mhc.hf.adapters.Adapter, got {type(adapter).__name__}")
    check_adapter_fits(model, adapter)
    modes = [(m, m.training) for m in model.modules()]  # train/eval, restored at the end as they were
    config = MHCConfig(base_config=model.config, n_streams=n_streams, adapter=adapter, **mhc_options)
    impl = getattr(model.config, "_attn_implementation_internal", None)
    if impl is not None:
        config._attn_implementation_internal = impl
    check = verify_by_default(model) if verify is None else verify
    if check:
        probe_ids, reference = reference_logits(model)
    # Mark the existing modules initialised so post_init() leaves their weights alone.
    for module in model.modules():
        module._is_hf_initialized = True
    ref = next(model.parameters())
    originals = list(model.get_submodule(adapter.layers))
    try:
        mhc_model = MHCForCausalLM(config, base_model=model)
    except Exception:  # e.g. a layer without a submodule the adapter names: none of them stays wrapped
        _restore_layers(model, adapter, originals)
        raise
    for module in mhc_model.modules():
        if isinstance(module, (MHCBlock, StreamReduce)):
            module.to(device=ref.device)  # stays float32
    if check:
        try:
            # The check tests the adapter: streams in the hidden state's dtype, as the original's.
            chosen = mhc_model.config.stream_dtype
            mhc_model.set_stream_dtype("hidden")
            what = f"{type(model).__name__} ({model.config.model_type})"
            try:
                with identity_coefficients(mhc_model):
                    _, converted = reference_logits(mhc_model, probe_ids)
            except Exception as e:  # the layout read does not run: the adapter does not describe the layer
                raise ConversionMismatchError(
                    f"mHC conversion self-check failed for {what}: the converted model does not run "
                    f"({type(e).__name__}: {e}). The adapter does not describe this model's decoder layer; the "
                    "model was left unconverted. Register an adapter (mhc.hf.adapters.register_adapter)."
                ) from e
            finally:
                mhc_model.set_stream_dtype(chosen)
            check_logits(reference, converted, ref.dtype, what)
        except Exception:
            _restore_layers(model, adapter, originals)
            mhc_model._final_norm_hook.remove()
            raise
    quant = getattr(model.config, "quantization_config", None)
    if isinstance(quant, dict) and quant.get("quant_method") == "gguf":
        # GGUF checkpoints are dequantized to plain float tensors on load: nothing quantized is left,
        # so the converted model (whose config is the base model's own) saves none.
        del model.config.quantization_config
    if getattr(model, "generation_config", None) is not None:
        mhc_model.generation_config = copy.deepcopy(model.generation_config)
    # The new modules take the model's mode, and every original module gets its own flag back (an
    # eval-mode model stays in eval mode: with dropout on, its outputs would not be the original's).
    mhc_model.train(modes[0][1])
    for module, training in modes:
        module.training = training
    return mhc_model


def added_parameter_count(config: MHCConfig) -> int:
    """Parameters mHC adds to the base model (what ``num_parameters()`` grows by).

    Per site (two per sequential decoder layer, one per parallel-residual
    layer: ``len(config.get_adapter().sites)``), with ``n`` streams and hidden size ``C``:
    ``mhc``: ``nC·(r + 2n) + r + 2n + 3`` with ``r = n²`` (``r = n!`` for
    ``projection="lite"``, one logit per permutation); ``hc``: ``C·(n + 2) + n² + 2n + 3``;
    ``residual``: 0. Plus ``n`` for ``reduce="learned"``.
    """
    base = config.get_text_config()
    n, C, L = config.n_streams, base.hidden_size, base.num_hidden_layers
    if config.mode == "mhc":
        r = math.factorial(n) if config.projection == "lite" else n * n
        site = n * C * (r + 2 * n) + r + 2 * n + 3
    elif config.mode == "hc":
        site = C * (n + 2) + n * n + 2 * n + 3
    else:
        site = 0
    return len(config.get_adapter().sites) * L * site + (n if config.reduce == "learned" else 0)
