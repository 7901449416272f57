"""HuggingFace ``transformers`` integration: mHC around the decoder layers of a causal LM.

Design (why it looks like this):

* ``MHCForCausalLM`` *holds* an ordinary HF causal LM (``self.model``, built
  from ``MHCConfig.base_config`` or handed over by :func:`convert_to_mhc`) and
  delegates ``forward`` to it. Embeddings, padding/causal masks, rotary
  embeddings, the KV cache, the LM head, the loss and ``generate()`` are all the
  base model's own code, for every architecture and ``transformers`` version.
* The only surgery: each decoder layer is replaced by :class:`MHCDecoderLayer`,
  which keeps the layer's submodules under their original names (state-dict
  keys of the base weights do not change) and adds one :class:`~mhc.MHCBlock`
  per residual site of the layer's adapter (``attn_mhc`` and ``mlp_mhc``;
  ``parallel_mhc`` for a parallel-residual layer), whose branch is built from
  the layer's own norms and sublayers as the adapter describes.
  The base model's layer loop passes the hidden state through opaquely, so it
  carries the ``[B, S, n, C]`` streams from layer to layer unchanged; the first
  wrapped layer copies ``[B, S, C]`` into ``n`` streams and a forward pre-hook
  on the final norm reduces them back to ``[B, S, C]``. Masks, rotary
  embeddings and caches are built before the loop from the embeddings, so
  they never see the streams.
* The wrapper is a ``GradientCheckpointingLayer``, so
  ``activation_checkpointing_enable()`` (4.x: ``gradient_checkpointing_enable()``) checkpoints it exactly as it would the
  original layer, and the attention module (with its ``layer_idx`` and KV
  cache) is the original object.

What differs per architecture is data, not code: an adapter
(:mod:`mhc.hf.adapters`; the generic one, :mod:`mhc.hf.generic`, reads it
from one forward pass for architectures without one) lists each site's
branches (norm, sublayer, post-norm, dropout, scale). :func:`convert_to_mhc`
checks the result against the original model (:mod:`mhc.hf.verify`) and
records the adapter in the config.

Saved folders carry their loader: ``save_pretrained`` writes ``modeling_mhc.py`` and an
``auto_map`` (:mod:`mhc.hf.custom_code`), so ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` loads them without ``import mhc``; ``from_pretrained`` refuses
weights holding NaN or Inf (:class:`~mhc.hf.verify.NonFiniteWeightsError`).

Alternatives rejected: our own loop over the layers would fork every architecture's
model forward (mask, rotary and cache preparation change between releases: 5.24
renamed ``past_key_values`` to ``cache``); folding the ``n`` streams into the batch
or sequence dimension would break masks, KV caches and position ids. Llama, Mistral, Qwen2/3 and
GPT-2 tested on transformers 4.57, 5.17 and 5.24; the other families
(``tests/test_families.py``) on 5.24.

Limits: cross-attention (GPT-2 ``add_cross_attention``) is not wrapped;
``output_hidden_states`` gives stream-merged ``[B, S, C]`` states. With
``projection="sinkhorn"`` the whole model compiles with ``fullgraph=True``; the
Newton projection's data-dependent iterations cause graph breaks, not errors.
"""

from __future__ import annotations

import inspect
import os
import warnings

import torch
import transformers
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover - very old transformers
    GradientCheckpointingLayer = nn.Module
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..block import MHCBlock
from ..options import MHCOptions, close_option
from ..streams import STREAM_DTYPES, StreamReduce, effective_stream_dtype, expand_streams, stream_dtype_for
from .adapters import Adapter
from .branch import SiteBranch
from .config import MHC_FIELDS, MHCConfig
from .custom_code import AUTO_MAP, CODE_FILE, write_code_file
from .generic import check_adapter_fits
from .verify import (
    check_finite_weights,
)

__all__ = ["MHCForCausalLM", "MHCDecoderLayer"]

_MISSING = object()
_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
_SAVE_HAS_ORIGINAL_FORMAT = (
    "save_original_format" in inspect.signature(PreTrainedModel.save_pretrained).parameters
)


def _positional_names(fn) -> tuple[str, ...]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds)


class MHCDecoderLayer(GradientCheckpointingLayer):
    """A base decoder layer with its residual sites replaced by mHC sites.

    Holds the original layer's submodules under their original names (so
    ``self_attn.q_proj.weight`` etc. keep their keys), plus one
    :class:`~mhc.MHCBlock` per site of the adapter (``attn_mhc`` and
    ``mlp_mhc`` for a sequential layer, ``parallel_mhc`` for a parallel-residual
    one; :attr:`site_names`). Takes exactly the arguments the base model's layer
    loop gives the original layer; all of them except the hidden state go to
    the attention, as the original layer does.

    Shapes: ``hidden_states`` is ``[B, S, C]`` for the first layer
    (``expand_input``), which copies it into ``n`` streams, and ``[B, S, n, C]``
    otherwise; the output is ``[B, S, n, C]``.
    """

    # A site's first step on the fused kernels also applies the branch's input RMSNorm where it has HF's
    # Llama form (mhc.hf.branch.SiteBranch): in generation on the token kernels, where a decode step's
    # norms cost host time, and on the grad path, where the norm's own passes over u and the copies
    # of u it keeps cost GPU time and memory (docs/design.md, "The branch's input norm").
    fuse_input_norm: bool = True

    def __init__(
        self, layer: nn.Module, adapter: Adapter, config: MHCConfig, layer_idx: int, expand_input: bool
    ):
        super().__init__()
        for site in adapter.sites:
            for name in (n for b in site.branches for n in b.module_names()):
                if not isinstance(getattr(layer, name, None), nn.Module):
                    raise ValueError(
                        f"{type(layer).__name__} has no submodule {name!r}; the mHC adapter does not fit it"
                    )
            if hasattr(layer, site.module_name):
                raise ValueError(f"{type(layer).__name__} already has an attribute {site.module_name!r}")
        for name, child in layer.named_children():
            self.add_module(name, child)
        for name, p in layer.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in layer.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in layer._non_persistent_buffers_set)
        for key, value in vars(layer).items():  # plain attributes (e.g. attention_type) the loop may read
            # (not callables: transformers 4.x can leave a bound `forward` behind in a layer's __dict__)
            if (
                not key.startswith("_")
                and key not in ("training", "gradient_checkpointing")
                and not callable(value)
            ):
                setattr(self, key, value)
        self.train(layer.training)
        checkpoint_fn = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) and checkpoint_fn is not None:
            # enabled on the base model before conversion (e.g. by PEFT's prepare_model_for_kbit_training)
            self.gradient_checkpointing, self._gradient_checkpointing_func = True, checkpoint_fn

        names = _positional_names(type(layer).forward)[1:]  # drop self
        self._input_names = names[1:]  # after hidden_states
        self._unsupported = adapter.unsupported_inputs
        self._sites = adapter.sites
        self._site_takes_inputs = tuple(any(b.layer_inputs for b in s.branches) for s in adapter.sites)
        self.site_names = tuple(s.module_name for s in adapter.sites)
        self._tuple_output = adapter.layers == "transformer.h" and _TRANSFORMERS_MAJOR < 5  # GPT-2 in 4.x
        self.wrapped_class = type(layer).__name__
        self.layer_idx = layer_idx
        self.n_streams = config.n_streams
        self.expand_input = expand_input
        self.stream_dtype = effective_stream_dtype(config.mode, config.stream_dtype)
        hidden = config.get_text_config().hidden_size
        opts = config.options()
        k = len(adapter.sites)
        for j, site in enumerate(adapter.sites):
            block = MHCBlock(
                SiteBranch(self, j), hidden, config.n_streams, layer_index=k * layer_idx + j, options=opts
            )
            self.add_module(site.module_name, block)

    def site_branch(
        self, index: int, u: Tensor, normed_input: Tensor | None = None, **layer_inputs
    ) -> Tensor:
        """The residual update of site ``index`` from its pre-mixed input ``u: [B, S, C]`` (the block's branch).

        The sum over the site's branches of ``scale * dropout(post_norm(sublayer(norm(u))))``; branches
        naming the same norm share its output, ``normed_input`` if given (the site's one norm, applied).
        """
        # Submodules straight from _modules (where add_module and nn.Module.__setattr__ keep them):
        # Module.__getattr__ costs about a microsecond a lookup on the H200's host, four lookups a
        # site, and decoding is bound by host time.
        modules = self._modules
        normed = {} if normed_input is None else {self._sites[index].branches[0].norm: normed_input}
        total = None
        for b in self._sites[index].branches:
            if b.norm not in normed:
                normed[b.norm] = u if b.norm is None else modules[b.norm](u)
            out = modules[b.sublayer](normed[b.norm], **(layer_inputs if b.layer_inputs else {}))
            y = out[0] if isinstance(out, tuple) else out  # attention's (output, weights)
            if b.post_norm is not None:
                y = modules[b.post_norm](y)
            if b.dropout is not None:
                y = modules[b.dropout](y)
            if b.scale != 1.0:
                y = y * b.scale
            total = y if total is None else total + y
        return total

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        if args:  # (HF's loops pass everything after hidden_states by keyword)
            if len(args) > len(self._input_names):
                raise TypeError(
                    f"{self.wrapped_class} takes at most {len(self._input_names) + 1} positional arguments"
                )
            inputs = dict(zip(self._input_names, args))
            inputs.update(kwargs)
        else:
            inputs = kwargs
        for name in self._unsupported:
            if inputs.pop(name, None) is not None:
                raise NotImplementedError(
                    f"mHC does not wrap {name!r} (cross-attention) in {self.wrapped_class}"
                )
        if self.expand_input:
            dtype = stream_dtype_for(hidden_states, self.stream_dtype)
            if dtype != hidden_states.dtype:  # (no dispatcher call otherwise: decoding is host-bound)
                hidden_states = hidden_states.to(dtype)
            x = expand_streams(hidden_states, self.n_streams)
        else:
            x = hidden_states
        modules = self._modules  # (as in site_branch)
        for name, takes_inputs in zip(self.site_names, self._site_takes_inputs):
            x = modules[name](x, **inputs) if takes_inputs else modules[name](x)
        return (x,) if self._tuple_output else x

    def extra_repr(self) -> str:
        return f"wraps={self.wrapped_class}, layer_idx={self.layer_idx}, expand_input={self.expand_input}"


class MHCForCausalLM(PreTrainedModel, GenerationMixin):
    """A HuggingFace causal LM whose decoder layers run mHC residual sites.

    ``self.model`` is the base ``*ForCausalLM`` (Llama, Mistral, Qwen2, Qwen3,
    GPT-2, ...) with every decoder layer replaced by :class:`MHCDecoderLayer`;
    ``self.stream_reduce`` merges the streams before the final norm.
    ``forward`` takes and returns what the base model's does.

    Args:
        config: an :class:`MHCConfig`.
        base_model: (keyword, used by :func:`convert_to_mhc`) an existing base
            causal LM to wrap in place instead of building one from
            ``config.base_config``.
    """

    config_class = MHCConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["MHCDecoderLayer"]
    # The coefficients (φ, α, biases) and stream weights stay float32 in bf16/fp16 (per instance: the site names).
    _keep_in_fp32_modules = ["attn_mhc", "mlp_mhc", "parallel_mhc", "stream_reduce"]
    _keep_in_fp32_modules_strict = ["attn_mhc", "mlp_mhc", "parallel_mhc", "stream_reduce"]

    def __init__(self, config: MHCConfig, *inputs, base_model: PreTrainedModel | None = None, **kwargs):
        if not isinstance(config, MHCConfig):
            raise TypeError(
                f"MHCForCausalLM needs an mhc.MHCConfig, got {type(config).__name__}; wrap the base model's "
                "config: mhc.MHCConfig(base_config=config)"
            )
        if inputs or kwargs:
            # PreTrainedModel would drop them without a word, and from_pretrained passes on every keyword
            # the config did not take (a misspelt option such as n_stream=2).
            unknown = [*map(repr, inputs), *kwargs]
            guesses = {name: close_option(name, MHC_FIELDS) for name in kwargs}
            hint = "; ".join(f"did you mean {g!r} for {n!r}?" for n, g in guesses.items() if g)
            raise TypeError(
                f"MHCForCausalLM got arguments that neither it nor its config takes: {', '.join(unknown)}"
                + (f" ({hint})" if hint else "")
            )
        super().__init__(config)
        if base_model is None:
            # The base config object itself, not a copy: a second model built on this config (as HF's
            # models share theirs) then shares it with the first instead of re-pointing the first's.
            base_cfg = config.get_text_config()
            if base_cfg is config:
                raise ValueError("this MHCConfig has no base_config; pass the wrapped model's config")
            adapter = config.get_adapter()
            if type(base_cfg) not in MODEL_FOR_CAUSAL_LM_MAPPING:
                raise ValueError(f"no causal-LM class for base model_type {base_cfg.model_type!r}")
            base_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(base_cfg)]
            impl = getattr(config, "_attn_implementation_internal", None)
            # This class accepts sdpa for every base, so HF picks it by default; a base without it
            # (Gemma2) then picks its own default instead.
            if impl is not None and not (impl == "sdpa" and not base_class._supports_sdpa):
                base_cfg._attn_implementation = impl
            base_model = base_class(base_cfg)
            config._attn_implementation_internal = base_model.config._attn_implementation
        else:
            adapter = config.get_adapter()
        check_adapter_fits(base_model, adapter)
        config.attach_base_config(base_model.config)
        self.adapter = adapter
        self.model = base_model
        self.stream_reduce = StreamReduce(config.n_streams, learned=config.reduce == "learned")
        self.stream_dtype = effective_stream_dtype(config.mode, config.stream_dtype)

        layers = self.model.get_submodule(adapter.layers)
        for i in range(len(layers)):
            if isinstance(layers[i], MHCDecoderLayer):
                raise ValueError("the model already holds mHC layers")
            layers[i] = MHCDecoderLayer(layers[i], adapter, config, i, expand_input=i == 0)
        sites = [getattr(layer, name) for layer in layers for name in layer.site_names]
        for site, after in zip(sites, sites[1:]):  # generation fuses each boundary (MHCBlock.next_site)
            site.set_next_site(after)
        final_norm = self.model.get_submodule(adapter.final_norm)
        self._final_norm_hook = final_norm.register_forward_pre_hook(self._reduce_before_final_norm)
        # Only names that hold parameters here (none in residual mode; no stream_reduce for reduce="mean"):
        # transformers 4.x rejects keep-in-fp32 names that match no parameter.
        present = {part for name, _ in self.named_parameters() for part in name.split(".")}
        keep = [name for name in (*self.mhc_module_names(), "stream_reduce") if name in present]
        self._keep_in_fp32_modules = list(keep)
        self._keep_in_fp32_modules_strict = list(keep)
        self.post_init()

    def mhc_module_names(self) -> list[str]:
        """The mHC blocks' names in a decoder layer (``["attn_mhc", "mlp_mhc"]``, ...), for PEFT's ``modules_to_save``."""
        return [site.module_name for site in self.adapter.sites]

    def set_stream_dtype(self, stream_dtype: str) -> None:
        """Keep the streams in ``stream_dtype`` from the next forward on (``config.stream_dtype`` follows;
        ``mode="residual"`` keeps the hidden state's dtype whatever it is).

        Args:
            stream_dtype: one of :data:`mhc.streams.STREAM_DTYPES` (see :class:`MHCConfig`).

        Raises:
            ValueError: an unknown value.
        """
        if stream_dtype not in STREAM_DTYPES:
            raise ValueError(f"stream_dtype must be one of {', '.join(STREAM_DTYPES)}; got {stream_dtype!r}")
        self.config.stream_dtype = stream_dtype
        self.stream_dtype = effective_stream_dtype(self.config.mode, stream_dtype)
        for layer in self.decoder_layers():
            layer.stream_dtype = self.stream_dtype

    def decoder_layers(self) -> list[MHCDecoderLayer]:
        """The wrapped decoder layers, in order."""
        return list(self.model.get_submodule(self.adapter.layers))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, check_finite: bool = True, **kwargs):
        """``PreTrainedModel.from_pretrained``, then a check that every loaded weight is finite.

        Args:
            check_finite: (default ``True``) raise :class:`mhc.hf.verify.NonFiniteWeightsError`
                (a ``ValueError``) naming every parameter or persistent buffer that holds NaN or
                Inf: a damaged weights file otherwise loads without a word and computes NaN.
                ``False`` skips the check (one reduction per tensor, one host sync per device).
            *model_args, **kwargs: as for ``PreTrainedModel.from_pretrained``.
        """
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if check_finite:
            check_finite_weights(
                loaded[0] if isinstance(loaded, tuple) else loaded, pretrained_model_name_or_path
            )
        return loaded

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, plus the loader that lets the folder load without ``import mhc``.

        * Beside the weights it writes ``modeling_mhc.py``, and ``config.json`` gets an
          ``auto_map`` pointing at it (:mod:`mhc.hf.custom_code`), so that
          ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads the
          model in any process where mhc-torch is installed; the module only imports
          ``mhc``'s classes. The in-memory config is left as it was.
        * ``save_original_format=False`` by default (transformers 5): the base model's key
          conversions are regexes for its own keys (Mixtral's ``.mlp.`` matches
          ``mlp_mhc``): reverting them on save would rename the mHC blocks' keys and the
          model would not reload. This class reads its own layout.
        * The config saved describes the blocks as they run: options set on the blocks after
          the model was built (``block.projection = "sinkhorn"``) are written into the config
          first, with a ``UserWarning`` where the config said otherwise (the config's site
          settings are read once, when the model is built).

        Raises:
            ValueError: the blocks' options differ from one another; a config holds one value
                per option, so the saved model could not be rebuilt as it runs.
        """
        self._describe_blocks_in_config()
        if _SAVE_HAS_ORIGINAL_FORMAT:
            kwargs.setdefault("save_original_format", False)
        main = args[0] if args else kwargs.get("is_main_process", True)
        if os.path.isfile(save_directory):  # transformers' own error for this case
            return super().save_pretrained(save_directory, *args, **kwargs)
        if main and not getattr(
            self, "_hf_peft_config_loaded", False
        ):  # (adapter-only saves write no config)
            write_code_file(save_directory)
        config = self.config
        before = config.__dict__.get("auto_map", _MISSING)
        config.auto_map = {**(before if isinstance(before, dict) else {}), **AUTO_MAP}
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            if before is _MISSING:
                config.__dict__.pop("auto_map", None)
            else:
                config.auto_map = before

    def _describe_blocks_in_config(self) -> None:
        """Write the blocks' ``n_streams`` and options into the config, which must describe them when saved."""
        blocks = [m for m in self.modules() if isinstance(m, MHCBlock)]
        if not blocks:
            return
        values: dict[str, set] = {"n_streams": {b.n_streams for b in blocks}}
        for name in MHCOptions.fields():
            values[name] = {getattr(b.options, name) for b in blocks}
        mixed = {name: sorted(map(repr, found)) for name, found in values.items() if len(found) > 1}
        if mixed:
            listing = "; ".join(f"{name}: {', '.join(found)}" for name, found in mixed.items())
            raise ValueError(
                f"the model's mHC blocks run different options ({listing}); a saved config holds one value "
                "per option, so the model would not reload as it runs: give every block the same value first"
            )
        differ = {name: value for name, (value,) in values.items() if getattr(self.config, name) != value}
        if differ:
            said = ", ".join(f"config.{name} is {getattr(self.config, name)!r}" for name in differ)
            run = ", ".join(f"{name}={value!r}" for name, value in differ.items())
            warnings.warn(
                f"{said} but the model's blocks run {run} (the config's site settings are read when the model "
                "is built); the config now says what the blocks run, and is saved so",
                UserWarning,
                stacklevel=3,
            )
            for name, value in differ.items():
                setattr(self.config, name, value)

    def _get_files_timestamps(self, working_dir):
        # save_pretrained(push_to_hub=True) uploads the files changed since this listing, taken
        # after modeling_mhc.py is written: leaving it out has it uploaded with the rest.
        stamps = super()._get_files_timestamps(working_dir)
        stamps.pop(CODE_FILE, None)
        return stamps

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM") -> None:
        """A no-op: every :meth:`save_pretrained` writes mHC's own loader (:mod:`mhc.hf.custom_code`).

        transformers calls this on a class it loads through ``auto_map``; registering would
        make it copy ``mhc/hf/modeling.py`` into every folder the model is saved to.
        """

    def _reduce_before_final_norm(self, module: nn.Module, args: tuple):
        return (self._merged_streams(args[0]), *args[1:])

    def _merged_streams(self, streams: Tensor) -> Tensor:
        """``[..., n, C]`` streams -> the ``[..., C]`` hidden state, in the dtype the streams were made from."""
        hidden = self.stream_reduce(streams)
        if self.stream_dtype != "hidden":
            # Back to the embeddings' dtype (a quantised, non-float embedding leaves the merged streams
            # as they are): bf16 streams under autocast give the hidden states the base model has.
            weight = self.model.get_input_embeddings().weight
            if weight.is_floating_point() and hidden.dtype != weight.dtype:
                hidden = hidden.to(weight.dtype)
        return hidden

    def _init_weights(self, module: nn.Module) -> None:
        # The mHC parameters get their documented init, each one only if it is
        # not marked as loaded: transformers marks every tensor it loads from a
        # checkpoint with `_is_hf_initialized` and leaves the rest as empty memory.
        if isinstance(module, (MHCBlock, StreamReduce)):
            params = module.named_parameters(recurse=False)
            fresh = [name for name, p in params if not getattr(p, "_is_hf_initialized", False)]
            if fresh and isinstance(module, MHCBlock):
                module.reset_parameters(fresh)
            elif fresh:  # StreamReduce's one weight
                module.reset_parameters()
        elif not isinstance(module, (MHCDecoderLayer, MHCForCausalLM)):
            super()._init_weights(module)

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """Initialise what is not initialised yet, the mHC parameters included.

        transformers hands the modules inside ``self.model`` (a PreTrainedModel
        of its own) to that model's ``_init_weights``, which does not know the
        mHC blocks and would mark them initialised without touching them. So
        they are initialised here first, then everything else as usual.
        """
        for module in self.modules():
            if isinstance(module, (MHCBlock, StreamReduce)) and not getattr(
                module, "_is_hf_initialized", False
            ):
                self._init_weights(module)
                module._is_hf_initialized = True
        super().initialize_weights()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.get_output_embeddings()

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.model.set_output_embeddings(value)

    @property
    def prepare_inputs_for_generation(self):
        """The base model's own ``prepare_inputs_for_generation``, signature included.

        ``generate()`` reads that signature to decide what it may pass (a ``cache`` /
        ``past_key_values`` of the caller's, ``inputs_embeds``, an assistant model's inputs); a
        ``(*args, **kwargs)`` wrapper would hide those names and have them refused.
        """
        return self.model.prepare_inputs_for_generation

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs,
    ):
        """Same arguments and outputs as the base model's ``forward`` (KV cache under its own name).

        ``output_hidden_states=True`` returns ``[B, S, C]`` states as usual: the
        embeddings, each layer's streams merged by ``stream_reduce``, and the
        final normed state.
        """
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            kwargs["logits_to_keep"] = logits_to_keep
        want_hidden = kwargs.pop("output_hidden_states", None)
        if want_hidden is None:
            want_hidden = bool(getattr(self.config, "output_hidden_states", False))
        as_tuple = False
        if want_hidden and kwargs.get("return_dict") is False:
            # The hidden states are set on the output object, then it becomes the tuple asked for.
            kwargs["return_dict"], as_tuple = True, True
        hidden: list[Tensor] = []
        handles = self._record_hidden_states(hidden) if want_hidden else []
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                **kwargs,
            )
        finally:
            for h in handles:
                h.remove()
        if want_hidden:
            if isinstance(out, tuple):  # (a config that says return_dict=False)
                raise NotImplementedError(
                    "output_hidden_states with a config whose return_dict is False: pass return_dict=False "
                    "to the call instead"
                )
            out.hidden_states = tuple(hidden)
            if as_tuple:
                return out.to_tuple()
        return out

    def _record_hidden_states(self, sink: list) -> list:
        """Hooks that append ``[B, S, C]`` hidden states to ``sink`` in the usual HF order."""
        layers = self.decoder_layers()

        def first_input(module, args, kwargs):
            sink.append(kwargs["hidden_states"] if not args else args[0])

        def layer_output(module, args, output):
            if module is not layers[-1]:  # the last entry is the final normed state
                sink.append(self._merged_streams(output[0] if isinstance(output, tuple) else output))

        def final_output(module, args, output):
            sink.append(output)

        handles = [layers[0].register_forward_pre_hook(first_input, with_kwargs=True)]
        handles += [layer.register_forward_hook(layer_output) for layer in layers]
        handles.append(self.model.get_submodule(self.adapter.final_norm).register_forward_hook(final_output))
        return handles


AutoConfig.register(MHCConfig.model_type, MHCConfig, exist_ok=True)
AutoModelForCausalLM.register(MHCConfig, MHCForCausalLM, exist_ok=True)
