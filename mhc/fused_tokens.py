"""The fused site's two steps for a few tokens, on the CUDA extension (internal to :mod:`mhc.fused`).

A decode step runs every site on 1-16 tokens, where the Triton kernels of
:mod:`mhc.fused_kernels` are the wrong shape: ``coeff_fwd`` tiles 64 tokens per
program, so one program walks all ``n·C`` columns alone, and each Triton launch
costs more host time than the work. Without grad and for at most
:data:`MAX_TOKENS` tokens, :func:`mhc.fused.site_pre_unchecked` and
:func:`mhc.fused.post_mix_unchecked` run these instead: one block per token
(``csrc/site_tokens.cuh``), one launch per step, called through the
extension's Python module. Same maths and layouts as ``coeff_fwd`` and
``postmix_fwd`` (products in float32 FMA rather than on the tensor cores, so
results agree to rounding, not to the bit). Everything else (grad, more
tokens, ``torch.compile``, CPU) stays on the Triton path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import projection_cuda

__all__ = ["MAX_TOKENS", "takes", "pre", "post"]

MAX_TOKENS = 128  # up to here one block per token beats coeff_fwd's one program per 64 tokens
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def takes(x: Tensor) -> bool:
    """Whether these kernels run streams ``x [T, n, C]`` (dense): CUDA, ``n`` in {4, 8}, ``T <= MAX_TOKENS``."""
    return (
        x.is_cuda and x.dtype in _DTYPES and x.shape[-2] in (4, 8) and x.numel() // (x.shape[-2] * x.shape[-1]) <= MAX_TOKENS
        and projection_cuda.extension() is not None
    )


def pre(x: Tensor, phi: Tensor, alpha: Tensor, b_pre: Tensor, b_post: Tensor, b_res: Tensor,
        eps: float, tol_eff: float, max_iter: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(u [..., C], h [T, 2n], H_res [T, n, n])`` of dense streams ``x [..., n, C]`` and float32 parameters.

    ``tol_eff`` is the projection's effective tolerance; matrices that miss
    it are counted and polled like :func:`mhc.birkhoff_project`'s.
    """
    n, C = x.shape[-2:]
    u, _, h, h_res = projection_cuda.extension().site_pre_tokens(
        x.view(-1, n, C), phi, alpha, b_pre, b_post, b_res, eps, tol_eff, max_iter
    )
    projection_cuda.poll(h_res)
    return u.view(x.shape[:-2] + (C,)), h, h_res


def post(x: Tensor, y: Tensor, h: Tensor, h_res: Tensor) -> Tensor:
    """``x' = H_res·x + H_post ⊗ y`` (``H_post = 2·h[:, n:]``) of dense ``x [..., n, C]`` and ``y`` in its dtype."""
    n, C = x.shape[-2:]
    out = projection_cuda.extension().site_post_tokens(x.view(-1, n, C), y, h, h_res)
    return out.view(x.shape)
