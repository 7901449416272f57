"""The branch callable of an mHC site in a wrapped HF decoder layer (see :class:`SiteBranch`)."""

from __future__ import annotations

import weakref

from torch import Tensor, nn

__all__ = ["SiteBranch"]


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

    __slots__ = ("_layer", "site")

    def __init__(self, layer: nn.Module, site: int):
        self._layer = weakref.ref(layer)
        self.site = site

    @property
    def layer(self) -> nn.Module:
        """The decoder layer whose site ``site`` this computes."""
        layer = self._layer()
        if layer is None:
            raise RuntimeError(f"the decoder layer of this mHC branch (site {self.site}) no longer exists")
        return layer

    def __call__(self, u: Tensor, **kwargs):
        return self.layer.site_branch(self.site, u, **kwargs)

    def __deepcopy__(self, memo: dict) -> SiteBranch:
        layer = self.layer
        return type(self)(memo.get(id(layer), layer), self.site)

    def __reduce__(self):  # pickling (e.g. torch.save of a whole model) keeps the layer by reference
        return type(self), (self.layer, self.site)

    def __repr__(self) -> str:
        layer = self._layer()
        return f"{type(self).__name__}({type(layer).__name__ if layer is not None else 'dead'}, site={self.site})"
