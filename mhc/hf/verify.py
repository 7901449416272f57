"""The conversion self-check, and the load-time check that weights are finite.

**Conversion.**

:func:`mhc.convert_to_mhc` runs the original model on a short random input
before the surgery and the converted one after it, and raises
:class:`ConversionMismatchError` (with the measured difference) if they
disagree beyond :func:`logit_tolerance`; the model is then restored. With
the default ``init="identity"`` a correct adapter reproduces the logits up to
float rounding (the order of the residual additions), so the tolerance only
has to absorb rounding, while a wrong adapter (a missing norm, a missing
residual scale, a parallel layer run sequentially) changes logits by about
their own size.

**Loading.** :meth:`mhc.MHCForCausalLM.from_pretrained` runs :func:`check_finite_weights`
on the loaded model and raises :class:`NonFiniteWeightsError`, naming the tensors, if
any weight holds NaN or Inf (a damaged file gives NaN logits, silently, otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..block import MHCBlock
from .generic import probe_input_ids

__all__ = [
    "VERIFY_AUTO_MAX_PARAMETERS",
    "ConversionMismatchError",
    "logit_tolerance",
    "verify_by_default",
    "reference_logits",
    "check_logits",
    "identity_coefficients",
    "NonFiniteWeightsError",
    "nonfinite_tensors",
    "check_finite_weights",
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

    Every module's train/eval flag is restored as it was (not the top module's flag spread over
    all: a fresh wrapper around an eval-mode model is in train mode itself); no global random
    state is used.
    """
    if input_ids is None:
        input_ids = probe_input_ids(model)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        for module, training in modes:
            module.training = training
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


class NonFiniteWeightsError(ValueError):
    """Loaded weights hold NaN or Inf; the message names the tensors (``tensors``: their names)."""

    def __init__(self, message: str, tensors: list[str]):
        super().__init__(message)
        self.tensors = tensors


def _checked_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(state-dict name, tensor)`` of every parameter and persistent buffer, each tensor once.

    What a checkpoint can hold. Non-persistent buffers (rotary frequencies, masks) are
    computed by the model's code, not read from the file, so they are left out.
    """
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        persistent = (
            (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
        )
        for name, t in (*module._parameters.items(), *persistent):
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield (f"{prefix}.{name}" if prefix else name), t


def _local_data(t: Tensor) -> Tensor:
    t = t.detach()
    to_local = getattr(t, "to_local", None)  # a DTensor (tensor parallel): this rank's shard
    return to_local() if callable(to_local) else t


def _finite_flag(t: Tensor) -> Tensor:
    """A 0-dim bool tensor on ``t``'s device, ``False`` if ``t`` holds NaN or ±Inf (no host sync).

    One reduction: ``aminmax`` propagates NaN, and ±Inf shows as the min or max. Dtypes it does
    not support (float8) are read in float32 chunks.
    """
    if t.is_complex():
        t = torch.view_as_real(t)
    try:
        lo, hi = torch.aminmax(t)
    except (RuntimeError, NotImplementedError):
        parts = [torch.stack(torch.aminmax(c.float())) for c in t.reshape(-1).split(1 << 24)]
        lo, hi = torch.cat(parts).aminmax()
    return lo.isfinite() & hi.isfinite()


def nonfinite_tensors(model: nn.Module) -> list[str]:
    """Names of the parameters and persistent buffers of ``model`` that hold NaN or ±Inf.

    Floating-point (and complex) tensors only; tensors on the meta device (offloaded) are
    skipped. Cost: one reduction per tensor and one host sync per device, not per tensor.
    """
    names: dict[torch.device, list[str]] = {}
    flags: dict[torch.device, list[Tensor]] = {}
    with torch.no_grad():
        for name, t in _checked_tensors(model):
            data = _local_data(t)
            if data.is_meta or data.numel() == 0 or not (data.is_floating_point() or data.is_complex()):
                continue
            names.setdefault(data.device, []).append(name)
            flags.setdefault(data.device, []).append(_finite_flag(data))
        bad = []
        for device, device_flags in flags.items():
            finite = torch.stack(device_flags).tolist()  # the device's one sync
            bad += [name for name, ok in zip(names[device], finite) if not ok]
    order = {name: i for i, (name, _) in enumerate(_checked_tensors(model))}
    return sorted(bad, key=order.__getitem__)


def _describe(t: Tensor) -> str:
    """``"3 NaN, 1 +Inf of 1024"`` (counts, on the error path only)."""
    data = _local_data(t)
    if data.is_complex():
        data = torch.view_as_real(data)
    try:
        counts = [int(data.isnan().sum()), int(data.isposinf().sum()), int(data.isneginf().sum())]
    except (RuntimeError, NotImplementedError):
        data = data.float()
        counts = [int(data.isnan().sum()), int(data.isposinf().sum()), int(data.isneginf().sum())]
    parts = [f"{c} {kind}" for c, kind in zip(counts, ("NaN", "+Inf", "-Inf")) if c]
    return f"{', '.join(parts)} of {data.numel()}"


def check_finite_weights(model: nn.Module, source: Any = None, max_listed: int = 20) -> None:
    """Raise :class:`NonFiniteWeightsError` if a parameter or persistent buffer of ``model`` holds NaN or Inf.

    The message names each such tensor with its counts (the first ``max_listed``), and
    ``source`` (the folder or repo loaded) if given.
    """
    bad = nonfinite_tensors(model)
    if not bad:
        return
    tensors = dict(_checked_tensors(model))
    listed = "; ".join(f"{name} ({_describe(tensors[name])})" for name in bad[:max_listed])
    if len(bad) > max_listed:
        listed += f"; and {len(bad) - max_listed} more"
    where = (
        f"{type(model).__name__}.from_pretrained({str(source)!r})"
        if source is not None
        else type(model).__name__
    )
    raise NonFiniteWeightsError(
        f"{where}: {len(bad)} of {len(tensors)} loaded tensors hold NaN or Inf, so the model would compute "
        f"NaN: {listed}. The weights file is damaged (an interrupted download or copy, a failing disk) or "
        "was saved from a run that had diverged; download or save it again. "
        "Pass check_finite=False to load it anyway.",
        bad,
    )
