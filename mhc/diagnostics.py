"""Composite-mapping analysis: how the residual path ``Π_l H_res^(l)`` behaves with depth.

Across layers the streams' residual path multiplies the ``H_res`` of every
site. For mHC each factor is doubly stochastic, so the composite is too: its
max row and column sums stay 1 and its spectral norm at most 1. For HC the
product is unconstrained and can blow up. The mHC paper's "Amax gain
magnitude" is the max absolute row sum (forward gain) and the max absolute
column sum (backward gain) of that composite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["CompositeGains", "composite_mapping", "composite_gains", "collect_h_res"]


@dataclass
class CompositeGains:
    """Gains of the composite ``H_res^(l) ⋯ H_res^(1)`` for every prefix depth ``l``.

    All fields are float64 tensors of shape ``[L]``; entry ``l-1`` is the
    worst case over the batch (tokens) at depth ``l``.

    Attributes:
        forward_gain: max absolute row sum (how much a forward signal can grow).
        backward_gain: max absolute column sum (how much a gradient can grow).
        spectral_norm: largest singular value.
    """

    forward_gain: Tensor
    backward_gain: Tensor
    spectral_norm: Tensor

    def as_dict(self) -> dict[str, list[float]]:
        """Plain lists, for JSON logs."""
        return {k: getattr(self, k).tolist() for k in ("forward_gain", "backward_gain", "spectral_norm")}


def _stack(h_res: Sequence[Tensor] | Tensor) -> Tensor:
    if isinstance(h_res, Tensor):
        stacked = h_res
    else:
        if len(h_res) == 0:
            raise ValueError("composite mapping needs at least one layer's H_res")
        stacked = torch.stack([h.detach() for h in h_res])
    if stacked.dim() < 3 or stacked.shape[-1] != stacked.shape[-2]:
        raise ValueError(f"H_res must be [L, ..., n, n] square matrices, got {tuple(stacked.shape)}")
    if stacked.shape[0] == 0:
        raise ValueError("composite mapping needs at least one layer's H_res")
    return stacked.detach().double()


def composite_mapping(h_res: Sequence[Tensor] | Tensor) -> Tensor:
    """Prefix products ``P_l = H_res^(l) ⋯ H_res^(1)``, in float64.

    Args:
        h_res: per-layer ``H_res``, as a list of ``[..., n, n]`` tensors or one
            ``[L, ..., n, n]`` tensor, first layer first (all with one batch shape).

    Returns:
        ``[L, ..., n, n]`` float64: entry ``l-1`` maps the streams entering
        layer 1 to those leaving layer ``l`` along the residual path.
    """
    H = _stack(h_res)
    prefix = [H[0]]
    for layer in H[1:]:
        prefix.append(layer @ prefix[-1])
    return torch.stack(prefix)


def composite_gains(h_res: Sequence[Tensor] | Tensor) -> CompositeGains:
    """Forward/backward Amax gains and spectral norm of the composite at every depth.

    Args:
        h_res: as for :func:`composite_mapping`.

    Returns:
        :class:`CompositeGains` with ``[L]`` float64 tensors (max over the batch).
    """
    P = composite_mapping(h_res)
    flat = P.flatten(1, -3) if P.dim() > 3 else P.unsqueeze(1)  # [L, B, n, n]
    forward = flat.abs().sum(-1).amax(-1).amax(-1)
    backward = flat.abs().sum(-2).amax(-1).amax(-1)
    spectral = torch.linalg.matrix_norm(flat, ord=2).amax(-1)
    return CompositeGains(forward_gain=forward, backward_gain=backward, spectral_norm=spectral)


@torch.no_grad()
def collect_h_res(model: nn.Module, *args, **kwargs) -> list[Tensor]:
    """Run ``model(*args, **kwargs)`` and return every :class:`~mhc.MHCBlock`'s ``H_res``.

    Blocks are listed in the order they ran, which is depth order for a
    sequential model. Each entry is ``[..., n, n]`` float32 (per token).
    """
    from .block import MHCBlock

    captured: list[Tensor] = []

    def hook(block: MHCBlock, args: tuple, kwargs: dict, _output) -> None:
        x = args[0] if args else kwargs["x"]
        captured.append(block.coefficients(x)[2].detach())

    handles = [
        m.register_forward_hook(hook, with_kwargs=True) for m in model.modules() if isinstance(m, MHCBlock)
    ]
    if not handles:
        raise ValueError("the model holds no MHCBlock")
    try:
        model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return captured
