"""Streams in and out: one hidden state ``[..., C]`` to ``n`` streams ``[..., n, C]`` and back."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .options import check_options, coefficient_dtype

__all__ = [
    "STREAM_DTYPES",
    "DEFAULT_STREAM_DTYPE",
    "effective_stream_dtype",
    "expand_streams",
    "reduce_streams",
    "stream_dtype_for",
    "StreamReduce",
]

# What a model's streams are kept in (MHCConfig.stream_dtype); see stream_dtype_for.
# (No fixed dtype: a sublayer gets its input in the streams' dtype, and float32 weights outside autocast
# take no bf16 input, nor bf16 weights a float32 one.)
STREAM_DTYPES = ("hidden", "autocast")
# bf16 streams under bf16 autocast: the paper's recipe, and the only one whose stream traffic fits
# issue #49's training-cost bars (fp32 streams double the site's bytes; notes/stream_dtype.md).
DEFAULT_STREAM_DTYPE = "autocast"


def stream_dtype_for(hidden: Tensor, choice: str) -> torch.dtype:
    """The dtype of the streams made from ``hidden`` under the setting ``choice``.

    Args:
        hidden: the hidden state ``[..., C]`` the streams are made from (a floating tensor).
        choice: one of :data:`STREAM_DTYPES`:

            - ``"hidden"``: ``hidden``'s dtype, as the residual model keeps its one stream (float32
              for float32 weights, under autocast too);
            - ``"autocast"``: for a float32 ``hidden``, autocast's dtype when autocast is on for its
              device (bf16 streams under ``torch.autocast(dtype=torch.bfloat16)``, as the mHC paper
              trains); ``hidden``'s dtype otherwise, so evaluation without autocast stays exact (and
              a bf16 or float64 model keeps its own).

    Raises:
        ValueError: ``choice`` is not one of :data:`STREAM_DTYPES`.
    """
    if choice == "hidden":
        return hidden.dtype
    if choice == "autocast":
        device_type = hidden.device.type
        if hidden.dtype is torch.float32 and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return hidden.dtype
    raise ValueError(f"stream dtype must be one of {', '.join(STREAM_DTYPES)}; got {choice!r}")


def effective_stream_dtype(mode: str, choice: str) -> str:
    """The setting a model of ``mode`` applies for ``MHCConfig.stream_dtype = choice``.

    ``mode="residual"`` is the base model itself, so it keeps its one stream as the base model
    does (``"hidden"``) whatever is asked; ``"hc"`` and ``"mhc"`` apply ``choice``.
    """
    return "hidden" if mode == "residual" else choice


def expand_streams(h: Tensor, n: int) -> Tensor:
    """Copy a hidden state into ``n`` identical streams.

    Args:
        h: ``[..., C]`` any dtype.
        n: number of streams, an int ``>= 1``.

    Returns:
        ``[..., n, C]`` contiguous, same dtype and device as ``h``.

    Raises:
        TypeError: ``h`` is not a tensor, or ``n`` not an int.
        ValueError: ``h`` has no dimension, or ``n < 1``.
    """
    n = check_options(n_streams=n)["n_streams"]
    if not isinstance(h, Tensor):
        raise TypeError(f"expand_streams: h must be a torch.Tensor, got {type(h).__name__}")
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
        ``[..., C]`` in the dtype of ``x``. The sum accumulates in float32 (or
        better; the weights are used in that precision too) and is cast back
        once, so bf16 streams lose nothing to a bf16 running sum. It is taken
        around stream 0, ``(Σ_i w_i) x_0 + Σ_i w_i (x_i - x_0)``, as the site's
        mixes are (:mod:`mhc.site`): ``n`` equal streams give back that stream
        exactly whenever the weights sum to one in float32 (the mean for every
        ``n``), so a converted model's logits equal the original's.

    Raises:
        TypeError: ``x`` is not a tensor, or ``weights`` neither a tensor nor ``None``.
        ValueError: ``x`` is not ``[..., n, C]``, or ``weights`` do not broadcast to ``[..., n]``.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"reduce_streams: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"reduce_streams expects [..., n, C], got shape {tuple(x.shape)}")
    acc = torch.promote_types(x.dtype, torch.float32)
    x0 = x[..., :1, :].to(acc)
    deviations = x.to(acc) - x0
    if weights is None:
        return (x0.squeeze(-2) + deviations.mean(dim=-2)).to(x.dtype)
    if not isinstance(weights, Tensor):
        raise TypeError(
            f"reduce_streams: weights must be a torch.Tensor or None, got {type(weights).__name__}"
        )
    if weights.dim() < 1 or weights.shape[-1] != x.shape[-2]:
        raise ValueError(
            f"weights of shape {tuple(weights.shape)} need one entry per stream: {x.shape[-2]} streams "
            f"(x of shape {tuple(x.shape)})"
        )
    if weights.dim() > 1:  # ([n] weights, StreamReduce's, always broadcast)
        target = tuple(x.shape[:-1])
        try:
            broadcast = torch.broadcast_shapes(weights.shape, target)
        except RuntimeError:
            broadcast = None
        if broadcast != target:
            raise ValueError(
                f"weights of shape {tuple(weights.shape)} do not broadcast to [..., n] = {target} "
                f"(x of shape {tuple(x.shape)})"
            )
    weights = weights.to(acc)
    mixed = torch.einsum("...n,...nc->...c", weights, deviations)
    return (weights.sum(-1, keepdim=True) * x0.squeeze(-2) + mixed).to(x.dtype)


class Float32Coefficients(nn.Module):
    """A module whose own float32 parameters stay float32 through ``.half()``, ``.bfloat16()`` and
    ``.to(dtype)`` (its submodules are cast as usual); devices follow a move, and a cast to float64
    applies. The mHC paper keeps the coefficients in fp32 while the streams run in bf16."""

    def _apply(self, fn, recurse=True):
        kept = {name: p.data for name, p in self.named_parameters(recurse=False) if p.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, p in self.named_parameters(recurse=False):
            if name in kept and p.dtype in (torch.float16, torch.bfloat16):
                p.data = kept[name].to(device=p.device)
                if p.grad is not None:
                    p.grad = p.grad.to(torch.float32)
        return self


class StreamReduce(Float32Coefficients):
    """Reduce ``n`` streams by the mean, or by learned weights initialised to the mean.

    Args:
        n_streams: number of streams, an int ``>= 1``.
        learned: learn one fp32 weight per stream (starts at ``1/n``).

    Shapes: ``[..., n, C] -> [..., C]``.
    """

    def __init__(self, n_streams: int, learned: bool = False):
        super().__init__()
        if not isinstance(learned, bool):
            raise TypeError(f"learned must be True or False, got {learned!r}")
        self.n_streams = check_options(n_streams=n_streams)["n_streams"]
        self.weight = (
            nn.Parameter(torch.empty(self.n_streams, dtype=coefficient_dtype())) if learned else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Learned weights back to the mean, ``1/n`` each (float32)."""
        if self.weight is not None:
            with torch.no_grad():
                self.weight.fill_(1.0 / self.n_streams)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., n, C]`` streams -> ``[..., C]`` (:func:`reduce_streams`); ``n`` must be this module's."""
        if isinstance(x, Tensor) and (x.dim() < 2 or x.shape[-2] != self.n_streams):
            raise ValueError(
                f"StreamReduce({self.n_streams}) expects [..., {self.n_streams}, C], got {tuple(x.shape)}"
            )
        return reduce_streams(x, self.weight)

    def extra_repr(self) -> str:
        return f"n_streams={self.n_streams}, learned={self.weight is not None}"
