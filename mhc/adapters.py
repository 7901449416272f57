"""Per-architecture adapters: where a HuggingFace causal LM keeps the pieces mHC wraps.

An adapter only *names* things: the list of decoder layers, the final norm,
and, inside one decoder layer, the (norm, sublayer) pair of each of its two
residual sites. The layer's own forward is never copied. ``mhc.hf`` replaces
each decoder layer with :class:`mhc.hf.MHCDecoderLayer`, which keeps the named
submodules (so weights and state-dict keys stay) and computes
``x' = H_res·x + H_postᵀ ⊗ sublayer(norm(H_pre·x))`` at both sites.

Adding an architecture whose decoder layer is the pre-norm pattern
``x + attn(norm1(x)); x + mlp(norm2(x))`` is one :func:`register_adapter` call.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Adapter", "ADAPTERS", "register_adapter", "get_adapter", "supported_model_types"]


@dataclass(frozen=True)
class Adapter:
    """Names of the pieces of one architecture.

    Attributes:
        layers: dotted path, inside the ``*ForCausalLM`` module, of the
            ``nn.ModuleList`` of decoder layers.
        final_norm: dotted path of the norm applied after the last layer
            (the streams are reduced to one just before it).
        attn: ``(norm, sublayer)`` attribute names of the attention site in a
            decoder layer. The sublayer is called as ``sublayer(norm(u), **kw)``
            where ``kw`` are all the arguments the model's layer loop passed to
            the decoder layer (mask, position embeddings, KV cache, ...), as the
            original layer forwards them to its attention.
        mlp: ``(norm, sublayer)`` of the MLP site; called as ``sublayer(norm(u))``.
        unsupported_inputs: layer inputs that select a feature mHC does not
            wrap (e.g. cross-attention); they must be ``None``.
    """

    layers: str
    final_norm: str
    attn: tuple[str, str]
    mlp: tuple[str, str]
    unsupported_inputs: tuple[str, ...] = ()


_LLAMA_LIKE = Adapter(
    layers="model.layers",
    final_norm="model.norm",
    attn=("input_layernorm", "self_attn"),
    mlp=("post_attention_layernorm", "mlp"),
)

_GPT2 = Adapter(
    layers="transformer.h",
    final_norm="transformer.ln_f",
    attn=("ln_1", "attn"),
    mlp=("ln_2", "mlp"),
    unsupported_inputs=("encoder_hidden_states", "encoder_attention_mask"),
)

ADAPTERS: dict[str, Adapter] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gpt2": _GPT2,
}


def register_adapter(model_type: str, adapter: Adapter) -> None:
    """Make ``model_type`` (a ``config.model_type``) convertible with ``adapter``."""
    ADAPTERS[model_type] = adapter


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def get_adapter(model_type: str | None) -> Adapter:
    """The adapter for ``model_type``; a ``ValueError`` naming the supported ones if none."""
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise ValueError(
            f"mHC has no adapter for architecture {model_type!r}; supported model types: "
            f"{', '.join(supported_model_types())}. A pre-norm decoder layer can be added with "
            "mhc.adapters.register_adapter(model_type, Adapter(...))."
        ) from None
