"""Per-architecture adapters: how a HuggingFace decoder layer's residual sites are built from its submodules.

An adapter only *describes*; the layer's own forward is never copied.
:class:`mhc.hf.MHCDecoderLayer` keeps the layer's submodules (so weights and
state-dict keys stay) and runs one :class:`~mhc.MHCBlock` per :class:`Site`:

    x' = H_res·x + H_postᵀ ⊗ Σ_b scale_b · dropout_b(post_norm_b(sublayer_b(norm_b(u), ...))),
    u  = H_pre·x

where the sum runs over the site's :class:`Branch` es. Every layout of the
supported families is a value of these dataclasses, not a special case in
the block:

* pre-norm (Llama, GPT-2, ...): two sites, ``x + attn(norm1 x)``, then ``x + mlp(norm2 x)``;
* sandwich norms (Gemma2/3): each branch also has a ``post_norm`` on its output;
* post-norms only (OLMo2): ``norm=None`` and a ``post_norm``;
* scaled residuals (Granite's ``residual_multiplier``): ``scale``;
* parallel residual (GPT-NeoX, Phi, Cohere: ``x + attn(ln1 x) + mlp(ln2 x)``):
  **one** site whose branch is the sum of both sublayers, read from the same
  ``u``. At the identity init (identical streams, ``Σ H_pre = 1``) it is
  exactly the original layer; it keeps the layer one residual update, as the
  architecture has (two sites would insert a stream mix between attention and
  MLP that the original does not have).

The registry maps a ``config.model_type`` to an :class:`Adapter`, or to a
function ``config -> Adapter`` where the layout depends on the config
(GPT-NeoX's ``use_parallel_residual``, Granite's multiplier). An architecture
outside it is tried by the generic adapter (:mod:`mhc.hf.generic`),
which recognises the layout from the submodules' use in one forward pass.

Every conversion is checked (:func:`mhc.convert_to_mhc` ``verify=``): the
converted model must give the original's logits, so an adapter that does not
fit its model raises instead of silently changing it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "Branch",
    "Site",
    "Adapter",
    "ADAPTERS",
    "register_adapter",
    "unregister_adapter",
    "registered_adapter",
    "supported_model_types",
]


@dataclass(frozen=True)
class Branch:
    """One sublayer's contribution to a site, by attribute names of the decoder layer.

    Computed from the site's pre-mixed input ``u: [..., C]`` as
    ``scale · dropout(post_norm(sublayer(norm(u), **layer_inputs)))``; a tuple
    result of the sublayer (HF attention's ``(output, weights)``) contributes
    its first element.

    Attributes:
        sublayer: the attention or MLP submodule.
        norm: the norm applied to ``u`` first; ``None`` for none (OLMo2).
            Branches of one site that name the same norm share one call.
        post_norm: a norm applied to the sublayer's output (Gemma2's sandwich, OLMo2).
        dropout: an ``nn.Dropout`` applied to the branch output (Phi3, GPT-NeoX).
        scale: a constant factor on the branch output (Granite's ``residual_multiplier``).
        layer_inputs: the sublayer gets, as keywords, every argument the
            model's layer loop passed to the decoder layer besides the hidden
            state (mask, position embeddings, KV cache, ...), as the original
            layer forwards them to its attention.
    """

    sublayer: str
    norm: str | None = None
    post_norm: str | None = None
    dropout: str | None = None
    scale: float = 1.0
    layer_inputs: bool = False

    def module_names(self) -> tuple[str, ...]:
        return tuple(
            name for name in (self.sublayer, self.norm, self.post_norm, self.dropout) if name is not None
        )


@dataclass(frozen=True)
class Site:
    """One residual site: one :class:`~mhc.MHCBlock`, stored as the layer's ``f"{name}_mhc"``.

    Attributes:
        name: ``"attn"`` and ``"mlp"`` for the two sites of a sequential layer
            (blocks ``attn_mhc`` and ``mlp_mhc``), ``"parallel"`` for the one
            site of a parallel-residual layer.
        branches: summed into the site's residual update (one for a
            sequential site, two for a parallel one).
    """

    name: str
    branches: tuple[Branch, ...]

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"site name must be an identifier, got {self.name!r}")
        if not self.branches or not all(isinstance(b, Branch) for b in self.branches):
            raise ValueError(f"site {self.name!r} needs one or more Branch values")

    @property
    def module_name(self) -> str:
        """The attribute name of this site's block in the decoder layer."""
        return f"{self.name}_mhc"


@dataclass(frozen=True)
class Adapter:
    """How a ``*ForCausalLM`` of one architecture is wrapped.

    Attributes:
        layers: dotted path, inside the ``*ForCausalLM`` module, of the
            ``nn.ModuleList`` of decoder layers.
        final_norm: dotted path of the norm applied after the last layer
            (the streams are reduced to one just before it).
        sites: the residual sites of one decoder layer, in order.
        unsupported_inputs: layer inputs that select a feature mHC does not
            wrap (e.g. cross-attention); they must be ``None``.
    """

    layers: str
    final_norm: str
    sites: tuple[Site, ...]
    unsupported_inputs: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.sites or not all(isinstance(s, Site) for s in self.sites):
            raise ValueError("an Adapter needs one or more Site values")
        names = [s.module_name for s in self.sites]
        if len(set(names)) != len(names):
            raise ValueError(f"site names repeat: {names}")
        if not any(b.layer_inputs for s in self.sites for b in s.branches):
            raise ValueError("no branch takes the layer inputs (layer_inputs=True): the attention needs them")

    @classmethod
    def pre_norm(
        cls,
        layers: str = "model.layers",
        final_norm: str = "model.norm",
        attn: tuple[str, str] = ("input_layernorm", "self_attn"),
        mlp: tuple[str, str] = ("post_attention_layernorm", "mlp"),
        **kwargs: Any,
    ) -> Adapter:
        """The common layout ``x + attn(norm1 x); x + mlp(norm2 x)`` from ``(norm, sublayer)`` names."""
        return cls(
            layers=layers,
            final_norm=final_norm,
            sites=(
                Site("attn", (Branch(attn[1], norm=attn[0], layer_inputs=True),)),
                Site("mlp", (Branch(mlp[1], norm=mlp[0]),)),
            ),
            **kwargs,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (stored in :class:`mhc.MHCConfig` as ``adapter``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Adapter:
        """Inverse of :meth:`to_dict`; a ``ValueError`` naming what is wrong for a malformed dict."""
        try:
            sites = tuple(Site(s["name"], tuple(Branch(**b) for b in s["branches"])) for s in data["sites"])
            return cls(
                layers=data["layers"],
                final_norm=data["final_norm"],
                sites=sites,
                unsupported_inputs=tuple(data.get("unsupported_inputs", ())),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed mHC adapter description {data!r}: {err}") from None


AdapterSpec = Adapter | Callable[[Any], Adapter]

_LLAMA = Adapter.pre_norm()

_PHI3 = Adapter(
    layers="model.layers",
    final_norm="model.norm",
    sites=(
        Site(
            "attn",
            (Branch("self_attn", norm="input_layernorm", dropout="resid_attn_dropout", layer_inputs=True),),
        ),
        Site("mlp", (Branch("mlp", norm="post_attention_layernorm", dropout="resid_mlp_dropout"),)),
    ),
)

# Gemma2/3: "sandwich" norms, one before and one after each sublayer.
_SANDWICH = Adapter(
    layers="model.layers",
    final_norm="model.norm",
    sites=(
        Site(
            "attn",
            (
                Branch(
                    "self_attn",
                    norm="input_layernorm",
                    post_norm="post_attention_layernorm",
                    layer_inputs=True,
                ),
            ),
        ),
        Site(
            "mlp", (Branch("mlp", norm="pre_feedforward_layernorm", post_norm="post_feedforward_layernorm"),)
        ),
    ),
)

# OLMo2: no norm before the sublayers, one after each.
_POST_NORM = Adapter(
    layers="model.layers",
    final_norm="model.norm",
    sites=(
        Site("attn", (Branch("self_attn", post_norm="post_attention_layernorm", layer_inputs=True),)),
        Site("mlp", (Branch("mlp", post_norm="post_feedforward_layernorm"),)),
    ),
)


def _parallel(layers: str, final_norm: str, attn: Branch, mlp: Branch) -> Adapter:
    return Adapter(layers=layers, final_norm=final_norm, sites=(Site("parallel", (attn, mlp)),))


# Cohere: x + attn(ln x) + mlp(ln x), one shared norm.
_COHERE = _parallel(
    "model.layers",
    "model.norm",
    Branch("self_attn", norm="input_layernorm", layer_inputs=True),
    Branch("mlp", norm="input_layernorm"),
)

# Phi(-1/2): like Cohere, with one dropout module applied to both outputs.
_PHI = _parallel(
    "model.layers",
    "model.final_layernorm",
    Branch("self_attn", norm="input_layernorm", dropout="resid_dropout", layer_inputs=True),
    Branch("mlp", norm="input_layernorm", dropout="resid_dropout"),
)

_GPT2 = Adapter.pre_norm(
    layers="transformer.h",
    final_norm="transformer.ln_f",
    attn=("ln_1", "attn"),
    mlp=("ln_2", "mlp"),
    unsupported_inputs=("encoder_hidden_states", "encoder_attention_mask"),
)


def _granite(config) -> Adapter:
    """``x + s·attn(ln1 x); x + s·mlp(ln2 x)`` with ``s = residual_multiplier``.

    (``embedding_multiplier`` and ``logits_scaling`` act outside the decoder
    layers, in the base model's own code, which runs unchanged.)
    """
    s = float(config.residual_multiplier)
    return Adapter(
        layers="model.layers",
        final_norm="model.norm",
        sites=(
            Site("attn", (Branch("self_attn", norm="input_layernorm", scale=s, layer_inputs=True),)),
            Site("mlp", (Branch("mlp", norm="post_attention_layernorm", scale=s),)),
        ),
    )


def _gpt_neox(config) -> Adapter:
    """Parallel ``x + attn(ln1 x) + mlp(ln2 x)`` when ``use_parallel_residual`` (the default), else sequential."""
    attn = Branch("attention", norm="input_layernorm", dropout="post_attention_dropout", layer_inputs=True)
    mlp = Branch("mlp", norm="post_attention_layernorm", dropout="post_mlp_dropout")
    if config.use_parallel_residual:
        return _parallel("gpt_neox.layers", "gpt_neox.final_layer_norm", attn, mlp)
    return Adapter(
        "gpt_neox.layers", "gpt_neox.final_layer_norm", (Site("attn", (attn,)), Site("mlp", (mlp,)))
    )


def _stablelm(config) -> Adapter:
    """Parallel with one shared norm when ``use_parallel_residual``, else pre-norm; dropout on the MLP output."""
    attn = Branch("self_attn", norm="input_layernorm", layer_inputs=True)
    if config.use_parallel_residual:
        return _parallel(
            "model.layers", "model.norm", attn, Branch("mlp", norm="input_layernorm", dropout="dropout")
        )
    mlp = Branch("mlp", norm="post_attention_layernorm", dropout="dropout")
    return Adapter("model.layers", "model.norm", (Site("attn", (attn,)), Site("mlp", (mlp,))))


ADAPTERS: dict[str, AdapterSpec] = {
    **dict.fromkeys(
        ["llama", "mistral", "qwen2", "qwen3", "smollm3", "gemma", "mixtral", "qwen3_moe"], _LLAMA
    ),
    "phi3": _PHI3,
    "stablelm": _stablelm,
    "cohere": _COHERE,
    "olmo2": _POST_NORM,
    "gemma2": _SANDWICH,
    "gemma3_text": _SANDWICH,
    "granite": _granite,
    "gpt_neox": _gpt_neox,
    "phi": _PHI,
    "gpt2": _GPT2,
}


def register_adapter(model_type: str, adapter: AdapterSpec) -> AdapterSpec | None:
    """Make ``model_type`` (a ``config.model_type``) convertible with ``adapter``.

    Args:
        model_type: the architecture's ``config.model_type``; an existing
            entry (a built-in one included) is replaced.
        adapter: an :class:`Adapter`, or a function of the base model's
            config returning one (for layouts that depend on the config).

    Returns:
        The adapter registered before for ``model_type``, or ``None``.

    The adapter is checked whenever a model is converted with it:
    :func:`mhc.convert_to_mhc` (``verify=True``, the default up to
    :data:`mhc.hf.VERIFY_AUTO_MAX_PARAMETERS` parameters) runs the original and
    the converted model on a short random input and raises ``ValueError``,
    with the measured logit difference, if they disagree; the model is then
    left unconverted. A wrong adapter cannot silently change a model unless
    the check is turned off (``verify=False``), with one limit: the check
    sees the weights the model has. On a freshly initialised model every
    norm's weight is one, so an adapter that swaps two norms (the attention
    reading ``post_attention_layernorm``) passes there and computes
    something else once the norms are trained; verify a new adapter on
    trained weights.
    """
    if not isinstance(model_type, str) or not model_type:
        raise TypeError(f"model_type must be a non-empty str, got {model_type!r}")
    if not (isinstance(adapter, Adapter) or callable(adapter)):
        raise TypeError(
            f"adapter must be an Adapter or a function config -> Adapter, got {type(adapter).__name__}"
        )
    previous = ADAPTERS.get(model_type)
    ADAPTERS[model_type] = adapter
    return previous


def unregister_adapter(model_type: str) -> AdapterSpec | None:
    """Remove ``model_type`` from the registry (it is then tried by the generic adapter); returns what was there."""
    return ADAPTERS.pop(model_type, None)


def supported_model_types() -> list[str]:
    """The ``model_type`` values with a registered adapter."""
    return sorted(ADAPTERS)


def registered_adapter(config) -> Adapter | None:
    """The registered adapter for a base model config (a ``PretrainedConfig``), or ``None``."""
    spec = ADAPTERS.get(getattr(config, "model_type", None))
    if spec is None or isinstance(spec, Adapter):
        return spec
    adapter = spec(config)
    if not isinstance(adapter, Adapter):
        raise TypeError(
            f"the adapter function for {config.model_type!r} returned {type(adapter).__name__}, "
            "not an Adapter"
        )
    return adapter
