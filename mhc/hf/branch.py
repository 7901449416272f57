"""The branch callable of an mHC site in a wrapped HF decoder layer (see :class:`SiteBranch`)."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module

__all__ = ["SiteBranch", "is_llama_rms_norm"]

_RMS_NORM_CLASSES: dict[type, bool] = {}  # is_llama_rms_norm's answers


def is_llama_rms_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` computes HF's ``LlamaRMSNorm``: ``weight * (x_f * rsqrt(mean(x_f²) + eps)).to(dtype)``.

    That is the norm the no-grad token kernels can apply where they write a
    site's ``u`` (``csrc/site_tokens.cuh``). Recognised by its class's
    ``forward`` having ``LlamaRMSNorm.forward``'s bytecode, names and
    constants (the families that copy it: Mistral, Qwen2, Qwen3, Phi-3,
    Granite, ...), with no ``forward`` set on the instance and no forward hook
    on it or on every module; a ``weight`` parameter and a float
    ``variance_epsilon``. Gemma's ``1 + weight`` and OLMo2's norm differ, and
    so does any subclass that overrides ``forward``.
    """
    cls = type(norm)
    known = _RMS_NORM_CLASSES.get(cls)
    if known is None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        mine, llama = getattr(cls.forward, "__code__", None), LlamaRMSNorm.forward.__code__
        known = mine is not None and (mine.co_code, mine.co_names, mine.co_consts) == (
            llama.co_code,
            llama.co_names,
            llama.co_consts,
        )
        _RMS_NORM_CLASSES[cls] = known
    return (
        known
        and "forward" not in norm.__dict__
        and not (norm._forward_hooks or norm._forward_pre_hooks)
        and not (_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)
        and isinstance(norm._parameters.get("weight"), Tensor)
        and isinstance(norm.__dict__.get("variance_epsilon"), float)
    )


class SiteBranch:
    """``layer.site_branch(site, ...)`` as an :class:`~mhc.MHCBlock` branch, without a bound method.

    A bound method in a block makes ``copy.deepcopy(block)`` deep-copy the
    whole decoder layer with it, so the copy would run a private copy of the
    attention or MLP (PEFT's ``modules_to_save`` copies the blocks this way,
    and LoRA on the live layer then has no effect). This holds the layer
    weakly (no reference cycle through the block) and, when deep-copied,
    follows the layer into the copy only if the layer itself is being copied;
    a block copied alone keeps calling the live layer.
    """

    __slots__ = ("_layer", "site", "_norm")

    def __init__(self, layer: nn.Module, site: int):
        self._layer = weakref.ref(layer)
        self.site = site
        self._norm = False  # the name of the site's one input norm, None for none; False: not looked up yet

    @property
    def layer(self) -> nn.Module:
        """The decoder layer whose site ``site`` this computes."""
        layer = self._layer()
        if layer is None:
            raise RuntimeError(f"the decoder layer of this mHC branch (site {self.site}) no longer exists")
        return layer

    def __call__(self, u: Tensor, **kwargs):
        return self.layer.site_branch(self.site, u, **kwargs)

    def training_input_norm(self) -> tuple[Tensor, float] | None:
        """``(weight, eps)`` of the site's input norm if the site's first step may apply it (:meth:`call_normed`), or ``None``.

        Asked by :class:`~mhc.MHCBlock` on the fused grad path (training).
        Only where the layer's ``fuse_input_norm`` is on (the default), every
        branch of the site starts with the same norm, and it
        :func:`is_llama_rms_norm`.
        """
        layer = self.layer
        if self._norm is False:
            norms = {b.norm for b in layer._sites[self.site].branches}
            self._norm = norms.pop() if len(norms) == 1 else None
        if self._norm is None or not layer.fuse_input_norm:
            return None
        norm = layer._modules.get(self._norm)
        if norm is None or not is_llama_rms_norm(norm):
            return None
        return norm._parameters["weight"], norm.variance_epsilon

    def fusable_input_norm(self) -> tuple[Tensor, float] | None:
        """:meth:`training_input_norm`, asked in generation on the token kernels: ``None`` under autocast too."""
        if torch.is_autocast_enabled("cuda"):
            return None
        return self.training_input_norm()

    def call_normed(self, u: Tensor | None, normed: Tensor, **kwargs):
        """The branch on ``u`` whose input norm's output is ``normed`` already (:meth:`training_input_norm`'s).

        ``u`` may be ``None`` (the grad path's kernels do not store it): the site's branches all start
        with that norm, so none reads ``u`` itself.
        """
        return self.layer.site_branch(self.site, u, normed_input=normed, **kwargs)

    def __deepcopy__(self, memo: dict) -> SiteBranch:  # (the norm is looked up again in the copy)
        layer = self.layer
        return type(self)(memo.get(id(layer), layer), self.site)

    def __reduce__(self):  # pickling (e.g. torch.save of a whole model) keeps the layer by reference
        return type(self), (self.layer, self.site)

    def __repr__(self) -> str:
        layer = self._layer()
        return f"{type(self).__name__}({type(layer).__name__ if layer is not None else 'dead'}, site={self.site})"
