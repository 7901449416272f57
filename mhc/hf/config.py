"""``MHCConfig``: the configuration of an mHC causal LM (a base model's config plus the mHC settings).

Plain serialisable fields, as HF configs are: the base model's config is saved
as a JSON dict inside ``config.json``, and the mHC settings are the fields of
:class:`mhc.MHCOptions` plus ``n_streams``, ``expand`` and ``reduce``. The
model that reads it is :class:`mhc.MHCForCausalLM` (:mod:`mhc.hf`).

In memory the base config is one object, which a built model shares with its
base model: HF and users change the text config (``resize_token_embeddings``,
``use_cache``) on it, and a separate copy here would be stale when the model
runs or is saved.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

try:
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:  # transformers 4.x
    from transformers import PretrainedConfig as _BaseConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..mixing import check_lite_streams
from ..options import MHCOptions, check_options, close_option
from ..streams import DEFAULT_STREAM_DTYPE, STREAM_DTYPES
from .adapters import Adapter, registered_adapter, supported_model_types

__all__ = ["MHCConfig", "MHC_FIELDS", "check_model_settings"]

# Base-config keys MHCConfig never exposes as its own attributes. The RoPE settings are the base
# model's alone: PretrainedConfig validates them on the wrapper too, and transformers 5.17 reads
# Gemma3's per-layer-type dict through the wrapper as a flat one (AttributeError at conversion).
_NOT_DELEGATED = frozenset(
    {
        "model_type",
        "architectures",
        "auto_map",
        "transformers_version",
        "quantization_config",
        "dtype",
        "torch_dtype",
        "rope_parameters",
        "rope_scaling",
    }
)

# The mHC settings of MHCConfig (everything else it takes goes to PretrainedConfig).
_BLOCK_FIELDS = ("n_streams", *MHCOptions.fields())
MHC_FIELDS = ("base_config", *_BLOCK_FIELDS, "expand", "reduce", "stream_dtype")
_OWN_FIELDS = frozenset({*MHC_FIELDS, "adapter"})
# Keyword arguments every PretrainedConfig takes (4.x and 5.x), whatever their resemblance to an mHC field.
_STANDARD_CONFIG_KEYS = frozenset(inspect.signature(_BaseConfig.__init__).parameters) | frozenset(
    {
        "torch_dtype",
        "name_or_path",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "use_cache",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_scaling",
    }
)


# MHCBlock keywords that are not MHCOptions fields, so not stored in config.json (mhc.block).
_BLOCK_ONLY_KEYWORDS = frozenset({"pre_eps", "sinkhorn_eps"})


def check_model_settings(**settings: Any) -> None:
    """Check the model-level mHC settings among ``settings`` (``expand``, ``reduce``, ``stream_dtype``).

    The site settings are :class:`mhc.MHCOptions`' (:func:`mhc.options.check_options`); other
    keywords are ignored. :class:`MHCConfig` checks these when it is built, and the trainer
    (:mod:`mhc.train`) before it prepares anything.

    Raises:
        ValueError: a value :class:`MHCConfig` does not take, naming the setting.
    """
    if "expand" in settings and settings["expand"] != "copy":
        raise ValueError(f"expand must be 'copy', got {settings['expand']!r}")
    if "reduce" in settings and settings["reduce"] not in ("mean", "learned"):
        raise ValueError(f"reduce must be 'mean' or 'learned', got {settings['reduce']!r}")
    if "stream_dtype" in settings and settings["stream_dtype"] not in STREAM_DTYPES:
        raise ValueError(
            f"stream_dtype must be one of {', '.join(STREAM_DTYPES)}; got {settings['stream_dtype']!r}"
        )


def _reject_misspelled_fields(kwargs: dict[str, Any], base_config: dict[str, Any]) -> None:
    """``TypeError`` for a keyword that looks like a misspelt mHC field.

    PretrainedConfig keeps any unknown keyword as an attribute, and HF passes
    many of its own when loading (``torch_dtype``, ``architectures``, token
    ids, ``_attn_implementation``, ...), so unknown names cannot all be
    refused. Refused: a name that is not private (``_...``), not a standard
    PretrainedConfig keyword, not a key of the base config, and within
    ``difflib``'s 0.8 similarity of an mHC field (``projecton``,
    ``n_stream``, ``Mode``, ...).
    """
    for name in kwargs:
        if name in _BLOCK_ONLY_KEYWORDS:
            raise TypeError(
                f"MHCConfig does not take {name!r}: it is an MHCBlock keyword that HF models leave at its "
                "default (build MHCBlock yourself to set it)"
            )
        if name.startswith("_") or name in _STANDARD_CONFIG_KEYS or name in base_config:
            continue
        guess = close_option(name, MHC_FIELDS)
        if guess is not None:
            raise TypeError(f"MHCConfig got {name!r}, which is not an mHC option; did you mean {guess!r}?")


class MHCConfig(_BaseConfig):
    """Configuration of an mHC causal LM: a base model's config plus the mHC settings.

    Args:
        base_config: the wrapped model's config, as a ``PretrainedConfig`` or
            a dict holding its ``model_type`` (copied). It is kept as one config
            object (:meth:`get_text_config`; a model built on this config shares
            its base model's own, :meth:`attach_base_config`) and serialised as a
            dict inside ``config.json``; ``config.base_config`` is a read-only
            snapshot of it. Its fields (``hidden_size``, ``vocab_size``,
            ``num_hidden_layers``, ``use_cache``, token ids, ...) read through on
            this config, and setting one here sets it there, where the model reads
            it (``resize_token_embeddings`` and ``config.use_cache = False`` work
            as on the base model). A keyword naming a field of the base config
            (``hidden_size=64``, ``use_cache=False``, ``pad_token_id=0``) sets
            that field of the base config.
        n_streams: number of residual streams ``n`` (default 4).
        mode: ``"mhc"`` (doubly stochastic ``H_res``), ``"hc"`` (unconstrained
            hyper-connections) or ``"residual"`` (no parameters; with
            ``n_streams=1`` exactly the base model).
        init: ``"identity"`` (function-preserving: a converted model keeps its
            outputs) or ``"paper"`` (random ``φ``).
        projection: how ``H_res`` is made doubly stochastic: ``"newton"`` (the
            exact projection), ``"sinkhorn"`` (``sinkhorn_iters`` fixed steps) or
            ``"lite"`` (mHC-lite: a convex combination of the ``n!`` permutation
            matrices, exact by construction; ``n_streams`` ≤ 5).
        tol: Newton tolerance on the marginal error.
        sinkhorn_iters: steps for ``projection="sinkhorn"``.
        fused: run CUDA streams on the fused Triton kernels (``MHCBlock(fused=...)``).
        recompute: each site keeps only its inputs for backward and runs its
            forward again there (``MHCBlock(recompute=...)``).
        keep_streams_every: keep the streams for backward only at every
            ``k``-th site and recompute the others' (:class:`mhc.MHCOptions`).
        alpha_init: initial dynamic scale ``α``.
        norm_eps: epsilon of the coefficient RMSNorm.
        expand: how the embedding enters the streams; ``"copy"`` (the only
            one) puts the same hidden state in every stream.
        reduce: ``"mean"`` or ``"learned"`` (one fp32 weight per stream,
            starting at ``1/n``) to merge the streams before the final norm.
        stream_dtype: what the streams are kept in (:func:`mhc.streams.stream_dtype_for`):
            ``"autocast"`` (default: bf16 streams while bf16 autocast is on,
            as the mHC paper trains, for half the site's stream traffic; the
            hidden state's dtype otherwise, so a model without autocast is
            exact) or ``"hidden"`` (the hidden state's dtype: float32 for
            float32 weights under bf16 autocast, as the residual model keeps
            its stream, and bit-exact to the base model under autocast too).
            The coefficients are float32 whatever it is. The merged streams go
            back to the embeddings' dtype before the final norm. ``mode="residual"``
            is the base model and keeps its stream in the hidden state's dtype
            whatever this says.
        adapter: how the base model's decoder layers are wrapped, an
            :class:`mhc.hf.adapters.Adapter` or its ``to_dict()`` (stored as the
            dict). :func:`mhc.convert_to_mhc` records the adapter it used, so a
            saved model reloads with it; ``None`` takes the registered adapter
            of the base ``model_type`` (:meth:`get_adapter`).
        **kwargs: PretrainedConfig's own settings (token ids, ``dtype``, ...).

    The site settings are stored as plain fields (what ``config.json``
    holds) and checked as :class:`mhc.MHCOptions` checks them (``n_streams``
    an int ``>= 1``, not a bool or ``2.7``; ``tol`` finite and ``> 0``; ...);
    :meth:`options` returns them as one ``MHCOptions``; setting one later is checked
    the same way. Unknown keywords go to ``PretrainedConfig``, which keeps
    them as attributes (HF passes its own when loading), except one that looks
    like a misspelt mHC field (``projecton=``): that raises ``TypeError``
    naming the field it resembles.
    """

    model_type = "mhc"

    def __init__(
        self,
        base_config: _BaseConfig | dict | None = None,
        n_streams: int = 4,
        mode: str = "mhc",
        init: str = "identity",
        projection: str = "newton",
        tol: float = 1e-6,
        sinkhorn_iters: int = 20,
        fused: bool = True,
        recompute: bool = False,
        keep_streams_every: int = 1,
        alpha_init: float = 0.01,
        norm_eps: float = 1e-6,
        expand: str = "copy",
        reduce: str = "mean",
        stream_dtype: str = DEFAULT_STREAM_DTYPE,
        adapter: Adapter | dict | None = None,
        **kwargs,
    ):
        if isinstance(base_config, _BaseConfig):
            base_config = base_config.to_dict()
        elif base_config is None:
            base_config = {}
        elif isinstance(base_config, dict):
            base_config = copy.deepcopy(dict(base_config))
        else:
            raise TypeError(
                f"base_config must be a PretrainedConfig or a dict, got {type(base_config).__name__}"
            )
        base_config.pop("transformers_version", None)
        if base_config and not base_config.get("model_type"):
            raise ValueError("base_config needs its 'model_type' (e.g. 'llama')")
        if base_config.get("model_type") == self.model_type:
            raise ValueError("base_config is itself an MHCConfig; pass the wrapped model's config")
        _reject_misspelled_fields(kwargs, base_config)
        n_streams = check_options(n_streams=n_streams)["n_streams"]
        opts = MHCOptions(
            mode=mode,
            init=init,
            projection=projection,
            tol=tol,
            sinkhorn_iters=sinkhorn_iters,
            fused=fused,
            recompute=recompute,
            keep_streams_every=keep_streams_every,
            alpha_init=alpha_init,
            norm_eps=norm_eps,
        )
        check_model_settings(expand=expand, reduce=reduce, stream_dtype=stream_dtype)
        # The base model's config lives as one object (a model built on this config shares its own, see
        # attach_base_config); base_config is its dict view. Keywords that are fields of the base model's
        # config, not PretrainedConfig's own, go to it: a shadowing copy here would not reach the model.
        base = self.__dict__["_mhc_base"] = _build_base_config(base_config) if base_config else None
        for name in [k for k in kwargs if k in base_config and _delegated(k)]:
            setattr(base, name, kwargs.pop(name))
        self.n_streams = n_streams
        for name, value in opts.to_dict().items():
            setattr(self, name, value)
        self.expand = expand
        self.reduce = reduce
        self.stream_dtype = stream_dtype
        if isinstance(adapter, dict):
            adapter = Adapter.from_dict(adapter)
        elif adapter is not None and not isinstance(adapter, Adapter):
            raise TypeError(
                f"adapter must be an mhc.hf.adapters.Adapter, its to_dict() or None, got {type(adapter).__name__}"
            )
        if opts.mode == "mhc" and opts.projection == "lite":
            check_lite_streams(n_streams)
        self.adapter = None if adapter is None else adapter.to_dict()
        super().__init__(**kwargs)
        if base is not None:
            # PretrainedConfig set its defaults of fields the base config holds too (token ids,
            # output_hidden_states, tie_word_embeddings, ...); a copy here would shadow the base's value,
            # which the model reads, so these read through.
            for name in [k for k in self.__dict__ if _delegated(k) and _has_field(base, k)]:
                del self.__dict__[name]
                if not _same(getattr(self, name, None), getattr(base, name)):
                    # a class-level default of PretrainedConfig answers before __getattr__ can read
                    # through (output_hidden_states): keep a copy, which __setattr__ keeps in step
                    self.__dict__[name] = getattr(base, name)
        self.__dict__["_mhc_ready"] = True  # from here on, setting a base model's field writes it there

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        """``PretrainedConfig.from_dict``, where a field saved both at the top and in ``base_config`` takes the
        base config's value (files written before the top-level copies were dropped hold stale defaults there)."""
        found = config_dict.get("model_type")
        if found is not None and found != cls.model_type:
            raise ValueError(
                f"this config is a {found!r} config, not an mHC one: load a plain checkpoint into mHC with "
                "MHCForCausalLM.from_pretrained(path, config=MHCConfig(base_config=AutoConfig.from_pretrained(path))), "
                "or convert a loaded model with mhc.convert_to_mhc"
            )
        base = config_dict.get("base_config") or {}
        config_dict = {k: v for k, v in config_dict.items() if not (k in base and _delegated(k))}
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig") -> None:
        """A no-op: :meth:`mhc.MHCForCausalLM.save_pretrained` writes mHC's own loader (:mod:`mhc.hf.custom_code`).

        transformers calls this on a config class it loads through ``auto_map``; registering
        would make every ``save_pretrained`` copy ``mhc/hf/config.py`` into the folder.
        """

    def get_adapter(self) -> Adapter:
        """The :class:`~mhc.hf.adapters.Adapter` the model is built with: the recorded one, else the registered one.

        Raises:
            ValueError: none is recorded and the base ``model_type`` has no registered adapter.
        """
        if self.adapter is not None:
            return Adapter.from_dict(self.adapter)
        base = self.get_base_config()
        adapter = registered_adapter(base)
        if adapter is None:
            raise ValueError(
                f"mHC has no adapter for architecture {base.model_type!r}; supported model types: "
                f"{', '.join(supported_model_types())}. mhc.convert_to_mhc(model) tries the generic adapter on "
                "other architectures (and records it in the config); mhc.hf.adapters.register_adapter adds one."
            )
        return adapter

    def options(self) -> MHCOptions:
        """The site settings as an :class:`mhc.MHCOptions` (checked again: the fields are assignable)."""
        return MHCOptions.from_dict(
            {name: getattr(self, name) for name in MHCOptions.fields()}, owner="MHCConfig"
        )

    @property
    def base_config(self) -> Mapping[str, Any]:
        """The base model's config as a read-only dict (``model_type`` included; empty without one).

        A snapshot of :meth:`get_text_config`'s object, the one the model reads: set a field on this
        config (``config.vocab_size = ...``) or on that object, not in this dict.
        """
        base = self.__dict__.get("_mhc_base")
        return MappingProxyType({} if base is None else _base_dict(base))

    def attach_base_config(self, base: _BaseConfig) -> None:
        """Share ``base``, the wrapped model's own config object, as this config's base config.

        :class:`mhc.MHCForCausalLM` calls it once its base model exists, so that what HF changes
        on the text config (``resize_token_embeddings`` sets ``vocab_size`` there) and what is set
        on this config reach the model and are saved with it.
        """
        if not isinstance(base, _BaseConfig):
            raise TypeError(f"base must be a PretrainedConfig, got {type(base).__name__}")
        if base.model_type == self.model_type:
            raise ValueError("base is itself an MHCConfig; pass the wrapped model's config")
        self.__dict__["_mhc_base"] = base

    def get_base_config(self) -> _BaseConfig:
        """A fresh config object of the wrapped architecture, a copy of :meth:`get_text_config`'s."""
        base = self.__dict__.get("_mhc_base")
        if base is None:
            raise ValueError("this MHCConfig has no base_config; pass the wrapped model's config")
        return _build_base_config(_base_dict(base))

    def get_text_config(self, *args, **kwargs) -> _BaseConfig:
        """The base config object: what the model, generation and caches read (layers, heads, vocabulary).

        The same object on every call; once a model is built on this config, the base model's own
        ``config`` (:meth:`attach_base_config`). This config itself where there is no base config.
        """
        base = self.__dict__.get("_mhc_base")
        return self if base is None else base

    def to_dict(self) -> dict[str, Any]:
        base = self.__dict__.pop("_mhc_base", None)
        try:
            out = super().to_dict()
        finally:
            self.__dict__["_mhc_base"] = base
        out.pop("_mhc_ready", None)
        out["base_config"] = {} if base is None else _base_dict(base)
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_mhc_ready"):  # the constructor's own settings
            super().__setattr__(name, value)
            return
        # The mHC settings are checked as the constructor checks them (the model reads them when built).
        if name in _BLOCK_FIELDS:
            value = check_options(**{name: value})[name]
        elif name in ("expand", "reduce", "stream_dtype"):
            check_model_settings(**{name: value})
        base = self.__dict__.get("_mhc_base")
        if base is not None and _delegated(name) and _has_field(base, name):
            # The model reads the base config: a value set only here would not reach it.
            setattr(base, name, value)
            if name not in self.__dict__:
                return
        super().__setattr__(name, value)

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: read the base model's fields through.
        base = self.__dict__.get("_mhc_base")
        if base is not None and _delegated(name) and _has_field(base, name):
            return getattr(base, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def _delegated(name: str) -> bool:
    """Whether ``name`` may be read from (and written to) the base config through an :class:`MHCConfig`."""
    return not name.startswith("_") and name not in _NOT_DELEGATED and name not in _OWN_FIELDS


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # values without a plain truth value
        return False


def _has_field(base: _BaseConfig, name: str) -> bool:
    return name in vars(base) or name in getattr(base, "attribute_map", {})


def _base_dict(base: _BaseConfig) -> dict[str, Any]:
    data = base.to_dict()
    data.pop("transformers_version", None)
    return data


def _build_base_config(data: dict[str, Any]) -> _BaseConfig:
    """A config object from ``data``, a dict of the caller's own (a copy or a fresh ``to_dict()``)."""
    data = dict(data)  # (not the caller's: model_type is popped)
    model_type = data.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"unknown base model_type {model_type!r}")
    return CONFIG_MAPPING[model_type].from_dict(data)
