"""The backends a site runs on, and the records the fused site keeps between steps and between sites.

None of this needs Triton: :class:`mhc.MHCBlock` names its backend and holds
its :class:`SiteLink` even where the fused kernels cannot run.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Backend", "FusedSite", "SiteLink", "fused_backend"]


class Backend(enum.Enum):
    """Where a site's coefficients, pre-mix and post-mix run (docs/design.md, "Backends")."""

    REFERENCE = "reference"
    """PyTorch ops (:mod:`mhc.site`): every mode and projection, CPU streams, double backward."""
    EAGER = "fused"
    """Triton kernels inside two autograd nodes (:mod:`mhc.fused.nodes`)."""
    COMPILED = "compiled"
    """The same kernels as ``torch.library`` ops, which dynamo and inductor trace (:mod:`mhc.fused.ops`)."""
    TOKENS = "tokens"
    """The CUDA extension's few-token kernels without grad: decoding (:mod:`mhc.fused.tokens`)."""


@dataclass(eq=False)
class FusedSite:
    """One call of a fused site between its pre-step and its post-mix.

    Attributes:
        backend: where the pre-step ran; the post-mix runs there too.
        streams: the streams ``x [..., n, C]`` as the kernels read them
            (contiguous); under :attr:`Backend.COMPILED` a view of them whose
            gradient carries ``dx'`` back to the pre-step's node.
        h: ``[T, 2n]``, σ of H_pre's and H_post's columns (``H_post = 2·h[:, n:]``);
            float32 (float64 for float64 streams). On :attr:`Backend.TOKENS`
            the extension's packed ``mix``: ``h`` then ``H_res``, flat.
        h_res: ``H_res [T, n, n]`` in ``h``'s dtype; ``None`` on :attr:`Backend.TOKENS`.
        state: the eager nodes' shared state (:class:`mhc.fused.nodes.SiteState`),
            :attr:`Backend.EAGER` only.
        normed: on :attr:`Backend.TOKENS`, the branch's input norm applied to
            ``u`` by the same kernel (``None`` when it was not asked for).
    """

    backend: Backend
    streams: Tensor
    h: Tensor
    h_res: Tensor | None
    state: Any = None
    normed: Tensor | None = None


def fused_backend(x: Tensor) -> Backend:
    """Which fused backend runs streams ``x`` that the fused path takes (the block checked the rest).

    :attr:`Backend.COMPILED` while dynamo traces; :attr:`Backend.TOKENS` for
    CUDA streams without grad (decoding: the extension takes up to
    :data:`mhc.fused.tokens.MAX_TOKENS` tokens, and the pre-step falls back to
    :attr:`Backend.EAGER`'s kernels for more, recording that in its
    :class:`FusedSite`); :attr:`Backend.EAGER` otherwise.
    """
    if torch.compiler.is_compiling():
        return Backend.COMPILED
    if x.is_cuda and not torch.is_grad_enabled():
        return Backend.TOKENS
    return Backend.EAGER


class SiteLink:
    """A block's place in a chain of linked sites: the next block (held weakly) and what the previous one left.

    ``inbox`` is ``(x', version, u, site)`` (decoding: this block's first step,
    already run) or ``(x', version, recipe)`` (training: how to recompute
    ``x'`` in backward), or ``None``.
    """

    __slots__ = ("next_site", "inbox")

    def __init__(self) -> None:
        self.next_site: weakref.ref | None = None
        self.inbox: tuple | None = None

    def next_block(self):
        """The next block, or ``None`` (unlinked, or collected)."""
        return self.next_site() if self.next_site is not None else None

    def take(self, x: Tensor) -> tuple | None:
        """What the previous block left for this call if ``x`` is its output, unmodified; emptied either way.

        ``(u, site)`` without grad, ``(recipe,)`` with grad.
        """
        stash = self.inbox
        if stash is None:
            return None
        self.inbox = None
        # (x is the stash's own tensor, made outside inference_mode, so it has a version counter.)
        if stash[0] is not x or (len(stash) == 3) != torch.is_grad_enabled() or x._version != stash[1]:
            return None
        return stash[2:]
