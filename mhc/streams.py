"""Streams in and out: one hidden state ``[..., C]`` to ``n`` streams ``[..., n, C]`` and back."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["expand_streams", "reduce_streams", "StreamReduce"]


def expand_streams(h: Tensor, n: int) -> Tensor:
    """Copy a hidden state into ``n`` identical streams.

    Args:
        h: ``[..., C]`` any dtype.
        n: number of streams, ``n >= 1``.

    Returns:
        ``[..., n, C]`` contiguous, same dtype and device as ``h``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if h.dim() < 1:
        raise ValueError("expand_streams needs a tensor with a hidden dimension [..., C]")
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]).contiguous()


def reduce_streams(x: Tensor, weights: Tensor | None = None) -> Tensor:
    """Reduce ``n`` streams to one hidden state.

    Args:
        x: ``[..., n, C]``.
        weights: optional ``[n]`` (or broadcastable to ``[..., n]``) stream
            weights; ``None`` takes the mean.

    Returns:
        ``[..., C]`` in the dtype of ``x``. A weighted reduction accumulates in
        float32 (or better) and casts back.
    """
    if x.dim() < 2:
        raise ValueError(f"reduce_streams expects [..., n, C], got shape {tuple(x.shape)}")
    if weights is None:
        return x.mean(dim=-2)
    if weights.shape[-1] != x.shape[-2]:
        raise ValueError(f"weights have {weights.shape[-1]} entries for {x.shape[-2]} streams")
    acc = torch.promote_types(x.dtype, torch.float32)
    return torch.einsum("...n,...nc->...c", weights.to(acc), x.to(acc)).to(x.dtype)


class StreamReduce(nn.Module):
    """Reduce ``n`` streams by the mean, or by learned weights initialised to the mean.

    Args:
        n_streams: number of streams.
        learned: learn one fp32 weight per stream (starts at ``1/n``).

    Shapes: ``[..., n, C] -> [..., C]``.
    """

    def __init__(self, n_streams: int, learned: bool = False):
        super().__init__()
        self.n_streams = n_streams
        self.weight = nn.Parameter(torch.full((n_streams,), 1.0 / n_streams)) if learned else None

    def forward(self, x: Tensor) -> Tensor:
        return reduce_streams(x, self.weight)

    def extra_repr(self) -> str:
        return f"n_streams={self.n_streams}, learned={self.weight is not None}"
