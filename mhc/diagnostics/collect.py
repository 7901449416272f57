"""What a forward (and optionally backward) pass through a model's :class:`~mhc.MHCBlock` s shows.

Hooks on every block read the streams each site receives and its
``coefficients(x)`` (the PyTorch reference, float32), in the order the sites ran,
which is depth order for a sequential model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..block import MHCBlock
from .metrics import logit_scale, stream_spread

__all__ = ["SiteRecord", "collect_h_res", "collect_sites"]


@dataclass
class SiteRecord:
    """One site's run: its name, mode, coefficients and what its streams looked like.

    Attributes:
        name: the block's name in the model (``named_modules``), ``"site <d>"`` without one.
        mode: the block's ``mode`` (``"mhc"``, ``"hc"``, ``"residual"``).
        projection: the block's ``projection`` (``"newton"``, ``"sinkhorn"``).
        h_pre, h_post: ``[*batch, n]`` float32 (float64 for float64 streams), detached.
        h_res: ``[*batch, n, n]``, same dtype, detached.
        spread: :func:`~mhc.diagnostics.stream_spread` of the streams the site received, ``[*batch]`` float64.
        logit_scale: the spread of the logits the site's projection turned into ``H_res``
            (:meth:`~mhc.MHCBlock.h_res_logits`): their standard deviation over the ``n²``
            entries (``n!`` for mHC-lite) of each token, ``[*batch]`` float64; None for ``hc``
            and ``residual`` sites. Sinkhorn's marginal error grows with it.
        grad_in_norm: ``‖∂loss/∂x‖_F`` of the streams the site received (all tokens), after a
            backward pass; None without one or when those streams did not require grad.
        grad_out_norm: the same for the streams the site returned.
    """

    name: str
    mode: str
    projection: str
    h_pre: Tensor
    h_post: Tensor
    h_res: Tensor
    spread: Tensor
    logit_scale: Tensor | None = None
    grad_in_norm: float | None = None
    grad_out_norm: float | None = None


def collect_sites(
    model: nn.Module,
    *args,
    loss_fn: Callable[[object], Tensor] | None = None,
    **kwargs,
) -> list[SiteRecord]:
    """Run ``model(*args, **kwargs)`` and record every :class:`~mhc.MHCBlock` it ran.

    Args:
        model: any module holding ``MHCBlock`` s (an :class:`~mhc.MHCForCausalLM`, a stack, ...).
        *args, **kwargs: the model's inputs.
        loss_fn: if given, ``loss_fn(output)`` must return a scalar tensor; its backward
            pass fills ``grad_in_norm`` / ``grad_out_norm`` (parameters' ``.grad`` are
            accumulated as in any backward). Without it the forward runs under ``no_grad``.

    Returns:
        One :class:`SiteRecord` per site call, in the order they ran.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``loss_fn`` neither callable nor ``None``.
        ValueError: the model holds no ``MHCBlock``, or ran none of them.
        RuntimeError: ``loss_fn`` under ``torch.inference_mode()``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {loss_fn!r} ({type(loss_fn).__name__})")
    if loss_fn is not None and torch.is_inference_mode_enabled():
        raise RuntimeError(
            "loss_fn needs autograd, which torch.inference_mode() switches off (enable_grad cannot turn it back "
            "on): call this outside inference_mode, or without loss_fn for the forward measures only"
        )
    names = {id(m): name for name, m in model.named_modules() if isinstance(m, MHCBlock)}
    if not names:
        raise ValueError("the model holds no MHCBlock")
    records: list[SiteRecord] = []
    grad_norms: dict[tuple[int, str], float] = {}  # (site call, "in"/"out") -> ‖grad‖_F, filled by backward

    def grad_norm_into(depth: int, key: str):
        def hook(grad: Tensor) -> None:
            grad_norms[depth, key] = float(grad.detach().double().norm())

        return hook

    recording = [True]  # off once the forward returns: activation checkpointing re-runs sites in backward

    def hook(block: MHCBlock, args: tuple, kwargs: dict, output) -> None:
        if not recording[0]:
            return
        x = args[0] if args else kwargs["x"]
        with torch.no_grad():
            h_pre, h_post, h_res = block.coefficients(x.detach())
            logits = block.h_res_logits(x.detach())
        record = SiteRecord(
            name=names[id(block)] or f"site {len(records)}",
            mode=block.mode,
            projection=block.projection,
            h_pre=h_pre.detach(),
            h_post=h_post.detach(),
            h_res=h_res.detach(),
            spread=stream_spread(x),
            # [*batch, n, n] (mHC-lite: [*batch, n!]) -> [*batch, r]
            logit_scale=None if logits is None else logit_scale(logits.flatten(x.dim() - 2)),
        )
        y = output[0] if isinstance(output, tuple) else output
        if loss_fn is not None:
            if x.requires_grad:
                x.register_hook(grad_norm_into(len(records), "in"))
            if isinstance(y, Tensor) and y.requires_grad:
                y.register_hook(grad_norm_into(len(records), "out"))
        records.append(record)

    handles = [
        m.register_forward_hook(hook, with_kwargs=True) for m in model.modules() if isinstance(m, MHCBlock)
    ]
    try:
        if loss_fn is None:
            with torch.no_grad():
                model(*args, **kwargs)
        else:
            with torch.enable_grad():
                output = model(*args, **kwargs)
                recording[0] = False
                loss = loss_fn(output)
                if not isinstance(loss, Tensor) or loss.numel() != 1:
                    raise ValueError(
                        f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}"
                    )
                loss.backward()
    finally:
        for h in handles:
            h.remove()
    if not records:
        raise ValueError("the model holds MHCBlocks but ran none of them on these inputs")
    for depth, r in enumerate(records):
        r.grad_in_norm, r.grad_out_norm = grad_norms.get((depth, "in")), grad_norms.get((depth, "out"))
    return records


@torch.no_grad()
def collect_h_res(model: nn.Module, *args, **kwargs) -> list[Tensor]:
    """Run ``model(*args, **kwargs)`` and return every :class:`~mhc.MHCBlock`'s ``H_res``.

    Blocks are listed in the order they ran, which is depth order for a
    sequential model. Each entry is ``[..., n, n]`` float32 (per token).
    """
    return [r.h_res for r in collect_sites(model, *args, **kwargs)]
