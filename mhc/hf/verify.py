"""The conversion self-check: the converted model must compute the original's logits.

:func:`mhc.convert_to_mhc` runs the original model on a short random input
before the surgery and the converted one after it, and raises
:class:`ConversionMismatchError` (with the measured difference) if they
disagree beyond :func:`logit_tolerance`; the model is then restored. With
the default ``init="identity"`` a correct adapter reproduces the logits up to
float rounding (the order of the residual additions), so the tolerance only
has to absorb rounding, while a wrong adapter (a missing norm, a missing
residual scale, a parallel layer run sequentially) changes logits by about
their own size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from .generic import probe_input_ids
from ..block import MHCBlock

__all__ = [
    "VERIFY_AUTO_MAX_PARAMETERS",
    "ConversionMismatchError",
    "logit_tolerance",
    "verify_by_default",
    "reference_logits",
    "check_logits",
    "identity_coefficients",
]

# verify=None (the default) checks a model of at most this many parameters (two forward passes
# of 2 x 8 tokens: seconds on a CPU for 4B fp32 parameters); bigger ones only with verify=True.
VERIFY_AUTO_MAX_PARAMETERS = 4_000_000_000

# Allowed max |logit difference| relative to max(1, max |original logit|), by the model's dtype.
_RELATIVE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


class ConversionMismatchError(ValueError):
    """The converted model's logits differ from the original's beyond the tolerance."""


def logit_tolerance(reference: Tensor, dtype: torch.dtype) -> float:
    """The self-check's bound: ``rel · max(1, max |reference|)``, ``rel`` = 1e-4 for fp32
    (1e-6 fp64, 3e-2 bf16, 1e-2 fp16)."""
    return _RELATIVE_TOLERANCE.get(dtype, 1e-4) * max(1.0, reference.abs().max().item())


def verify_by_default(model: nn.Module) -> bool:
    """What ``verify=None`` means: check unless the model has more than
    :data:`VERIFY_AUTO_MAX_PARAMETERS` parameters or weights on the meta device (offloaded)."""
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        return False
    return sum(p.numel() for p in params) <= VERIFY_AUTO_MAX_PARAMETERS


def reference_logits(model: nn.Module, input_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(input_ids [2, 8], logits [2, 8, V] float32)`` of ``model`` in eval mode without a cache.

    The model's train/eval mode is restored; no global random state is used.
    """
    if input_ids is None:
        input_ids = probe_input_ids(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        model.train(was_training)
    return input_ids, logits.float()


def check_logits(reference: Tensor, converted: Tensor, dtype: torch.dtype, what: str) -> float:
    """The max |difference|; raises :class:`ConversionMismatchError` if it is beyond :func:`logit_tolerance`."""
    diff = (converted.float() - reference).abs().max().item()
    tol = logit_tolerance(reference, dtype)
    if not diff <= tol:  # NaN fails too
        raise ConversionMismatchError(
            f"mHC conversion self-check failed for {what}: the converted model's logits differ from the "
            f"original's by up to {diff:.4g} (max |logit| {reference.abs().max().item():.4g}, tolerance {tol:.3g}). "
            "The adapter does not describe this model's decoder layer; the model was left unconverted. "
            "Fix or register the adapter (mhc.hf.adapters.register_adapter), or pass verify=False to skip the check."
        )
    return diff


@contextlib.contextmanager
def identity_coefficients(model: nn.Module) -> Iterator[None]:
    """Within: every :class:`~mhc.MHCBlock` of ``model`` has ``φ = 0``; after: the values from before.

    On freshly built blocks this is the identity init (the biases and ``α`` do
    not depend on ``init``), which preserves the model's function; so the
    self-check tests the adapter whatever ``init`` was asked for.
    """
    blocks = [m for m in model.modules() if isinstance(m, MHCBlock) and m.mode != "residual"]
    saved = [b.phi.detach().clone() for b in blocks]
    with torch.no_grad():
        for b in blocks:
            b.phi.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(blocks, saved):
                b.phi.copy_(value)
