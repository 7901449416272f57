"""The starting values of an :class:`mhc.MHCBlock`'s coefficient biases (used by ``reset_parameters``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["RES_INIT_DIAGONAL", "pre_init_weights", "exact_sum_logits"]

# H_res at the default init: this much mass on the diagonal. Any doubly
# stochastic start preserves the function; a mostly-diagonal one lets streams
# keep their own content while the projection still has gradient (T(1-T) > 0).
RES_INIT_DIAGONAL = 0.9


def pre_init_weights(n: int, layer_index: int) -> Tensor:
    """Unequal ``H_pre`` that sums to one, peaked on stream ``layer_index mod n``.

    Uniform weights would give every stream the same gradient forever, so n
    streams would be one residual stream in disguise (design.md, "Break the
    symmetry"). The peak rotates with depth, as in HC's one-hot init.
    """
    off = min(0.01, 0.5 / n)
    # Built on the CPU explicitly: HF may construct models under a meta-device context.
    w = torch.full((n,), off, dtype=torch.float64, device="cpu")
    w[layer_index % n] = 1.0 - off * (n - 1)
    return w


def exact_sum_logits(weights: Tensor, peak: int) -> Tensor:
    """float32 logits whose sigmoids are ``weights`` and sum to exactly 1.0 in float32.

    The forward computes ``u = (Σ_i H_pre[i])·x_0 + ...``; with a sum of exactly
    one, a converted model reproduces its original outputs bit for bit. One
    small weight is nudged by ulps (its sigmoid moves in steps far finer than
    the sum's rounding) until the float32 sum rounds to 1. For ``n = 1`` no
    unsaturated logit does, and the weight stays ``1 - 1e-6``.
    """
    logits = torch.logit(weights.clamp(1e-6, 1 - 1e-6)).float()
    n = weights.numel()
    if n == 1:
        return logits
    tuned = (peak + 1) % n
    for _ in range(1000):
        total = torch.sigmoid(logits).sum()
        if total == 1:
            break
        logits[tuned] = torch.nextafter(
            logits[tuned],
            torch.tensor(math.inf if total < 1 else -math.inf, dtype=logits.dtype, device="cpu"),
        )
    return logits
