"""DeepSeek-V4's hyper-connection, read into the parameters of an :class:`mhc.MHCBlock` (design.md, "The DeepSeek-V4 form").

transformers' ``DeepseekV4HyperConnection`` holds one site's coefficient map:
``fn [(2 + n)·n, n·C]``, ``base [(2 + n)·n]`` and ``scale [3]``, with
``hc_mult = n``, ``hc_sinkhorn_iters``, ``hc_eps`` and the epsilon of its
unweighted input RMSNorm. Per token it computes

    pre  = σ(scale₀·z_pre + base_pre) + hc_eps
    post = 2σ(scale₁·z_post + base_post)
    comb = Sinkhorn(softmax(scale₂·z_comb + base_comb) + hc_eps)     (column first, every sum + hc_eps)

from ``z = RMSNorm(flatten(x)) fnᵀ``, and its decoder layer mixes
``x' = post ⊗ F(Σ_i pre_i x_i) + combᵀ x``. That is an mHC site whose
``H_res`` is ``combᵀ``: entry ``(i, j)`` of ``H_res`` is entry ``(j, i)`` of
``comb``, so the comb rows of ``fn`` and the comb block of ``base`` are
transposed into ``H_res``'s layout here; pre and post map one to one.

This module imports neither transformers' DeepSeek-V4 code (older
transformers lack it; only :func:`gap_table` needs it) nor :mod:`mhc.block`;
it reads any object with those attributes and returns plain tensors and
settings, which :meth:`mhc.MHCBlock.from_deepseek_v4` turns into a block.

``python scripts/study_exactness.py --deepseek-gap`` prints :func:`gap_table` (CPU, seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import site
from ..options import MHCOptions
from ..projection import marginal_error

__all__ = [
    "DeepseekV4Site",
    "PARAMETER_NAMES",
    "read_hyper_connection",
    "deepseek_v4_settings",
    "truncation_gap",
    "gap_table",
]

PARAMETER_NAMES = ("phi", "alpha", "b_pre", "b_post", "b_res")
"""The parameters of an ``mode="mhc"`` :class:`mhc.MHCBlock` that a :class:`DeepseekV4Site` fills."""

# What the hyper-connection decides; from_deepseek_v4 refuses them as options.
_FIXED_BY_HC = ("mode", "sinkhorn_iters", "norm_eps", "pre_eps", "sinkhorn_eps", "hidden_size", "n_streams")


@dataclass(frozen=True)
class DeepseekV4Site:
    """One DeepSeek-V4 hyper-connection in :class:`mhc.MHCBlock`'s terms (float32 copies, on ``fn``'s device).

    Attributes:
        n_streams: ``hc_mult``.
        hidden_size: ``C`` (``fn``'s width over ``n``).
        phi: ``[n² + 2n, n·C]``: ``fn`` with its comb rows in ``H_res`` order.
        alpha: ``[3]``, ``scale``.
        b_pre, b_post: ``[n]``, from ``base``.
        b_res: ``[n, n]``, ``base``'s comb block transposed.
        hc_eps: added to ``H_pre`` and to every Sinkhorn sum.
        sinkhorn_iters: ``hc_sinkhorn_iters``.
        norm_eps: the epsilon of the input RMSNorm.
    """

    n_streams: int
    hidden_size: int
    phi: Tensor
    alpha: Tensor
    b_pre: Tensor
    b_post: Tensor
    b_res: Tensor
    hc_eps: float
    sinkhorn_iters: int
    norm_eps: float


def _attribute(hc: object, name: str):
    if not hasattr(hc, name):
        raise TypeError(
            f"from_deepseek_v4 needs a transformers DeepseekV4HyperConnection (with fn, base, scale, hc_mult, "
            f"hc_sinkhorn_iters, hc_eps, input_norm); {type(hc).__name__} has no {name!r}"
        )
    return getattr(hc, name)


def _norm_epsilon(norm: object):
    # transformers 5.25 renamed DeepseekV4UnweightedRMSNorm.eps to variance_epsilon (its other RMSNorms' name).
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return getattr(norm, name)
    raise TypeError(
        f"DeepseekV4HyperConnection.input_norm ({type(norm).__name__}) has no epsilon (variance_epsilon or eps)"
    )


def _finite_float(name: str, value) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"DeepseekV4HyperConnection.{name} must be finite and >= 0, got {value}")
    return value


def read_hyper_connection(hc: object) -> DeepseekV4Site:
    """The parameters and settings of a ``DeepseekV4HyperConnection``, in ``H_res`` layout.

    Args:
        hc: transformers' ``DeepseekV4HyperConnection`` (or any object with its
            ``fn``, ``base``, ``scale``, ``hc_mult``, ``hc_sinkhorn_iters``,
            ``hc_eps`` and ``input_norm.variance_epsilon``, ``eps`` before
            transformers 5.25).

    Returns:
        A :class:`DeepseekV4Site`; its tensors are detached float32 copies.

    Raises:
        TypeError: an attribute is missing, or a parameter is not a floating tensor.
        ValueError: the shapes do not fit ``hc_mult``, a value is non-finite,
            or ``hc_sinkhorn_iters < 1``.
    """
    n = _attribute(hc, "hc_mult")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"DeepseekV4HyperConnection.hc_mult must be an int >= 1, got {n!r}")
    fn, base, scale = (_attribute(hc, name) for name in ("fn", "base", "scale"))
    for name, t in (("fn", fn), ("base", base), ("scale", scale)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(
                f"DeepseekV4HyperConnection.{name} must be a floating tensor, got {type(t).__name__}"
            )
    rows = (2 + n) * n
    if fn.dim() != 2 or fn.shape[0] != rows or fn.shape[1] % n or fn.shape[1] == 0:
        raise ValueError(
            f"DeepseekV4HyperConnection.fn must be [(2 + n)·n, n·C] = [{rows}, {n}·C], got {tuple(fn.shape)}"
        )
    if tuple(base.shape) != (rows,) or tuple(scale.shape) != (3,):
        raise ValueError(
            f"DeepseekV4HyperConnection.base must be [{rows}] and scale [3], got {tuple(base.shape)} and {tuple(scale.shape)}"
        )
    iters = _attribute(hc, "hc_sinkhorn_iters")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"DeepseekV4HyperConnection.hc_sinkhorn_iters must be an int >= 1, got {iters!r}")
    hc_eps = _finite_float("hc_eps", _attribute(hc, "hc_eps"))
    norm_eps = _finite_float("input_norm's epsilon", _norm_epsilon(_attribute(hc, "input_norm")))
    if norm_eps == 0:
        raise ValueError("DeepseekV4HyperConnection.input_norm's epsilon must be > 0")

    with torch.no_grad():
        fn, base, scale = (t.detach().to(torch.float32).clone() for t in (fn, base, scale))
        for name, t in (("fn", fn), ("base", base), ("scale", scale)):
            if not t.isfinite().all():
                raise ValueError(f"DeepseekV4HyperConnection.{name} holds NaN or Inf")
        width = fn.shape[1]
        # comb[j, k] sits at row 2n + j·n + k; H_res[i, j] = comb[j, i] must sit at 2n + i·n + j.
        res_rows = fn[2 * n :].reshape(n, n, width).transpose(0, 1).reshape(n * n, width)
        phi = torch.cat([fn[: 2 * n], res_rows]).contiguous()
        b_res = base[2 * n :].reshape(n, n).t().contiguous()
    return DeepseekV4Site(
        n_streams=n,
        hidden_size=width // n,
        phi=phi,
        alpha=scale,
        b_pre=base[:n].clone(),
        b_post=base[n : 2 * n].clone(),
        b_res=b_res,
        hc_eps=hc_eps,
        sinkhorn_iters=iters,
        norm_eps=norm_eps,
    )


def deepseek_v4_settings(hc: object, projection: str, options: dict) -> tuple[DeepseekV4Site, dict]:
    """The site read from ``hc`` and the :class:`mhc.MHCBlock` keywords (less the branch) that run it.

    Args:
        hc: a ``DeepseekV4HyperConnection`` (see :func:`read_hyper_connection`).
        projection: ``"sinkhorn"`` (DeepSeek's own recipe) or ``"newton"`` (the exact projection of the same logits).
        options: other :class:`mhc.MHCOptions` fields for the block (``recompute``, ``tol``, ...).

    Returns:
        ``(site, keywords)``: ``keywords`` has ``hidden_size``, ``n_streams``, ``mode="mhc"``,
        ``projection``, ``sinkhorn_iters``, ``norm_eps``, ``pre_eps = sinkhorn_eps = hc_eps`` and ``options``.

    Raises:
        ValueError: ``projection`` is neither (mHC-lite would need ``n!`` logits, DeepSeek has ``n²``),
            or ``options`` sets one of the values the hyper-connection fixes.
        TypeError, ValueError: from :func:`read_hyper_connection`.
    """
    if projection not in ("sinkhorn", "newton"):
        raise ValueError(f"from_deepseek_v4: projection must be 'sinkhorn' or 'newton', got {projection!r}")
    clash = sorted(set(options) & set(_FIXED_BY_HC))
    if clash:
        raise ValueError(
            f"from_deepseek_v4 takes {', '.join(clash)} from the hyper-connection; do not pass them"
        )
    site = read_hyper_connection(hc)
    keywords = dict(
        hidden_size=site.hidden_size,
        n_streams=site.n_streams,
        mode="mhc",
        projection=projection,
        sinkhorn_iters=site.sinkhorn_iters,
        norm_eps=site.norm_eps,
        pre_eps=site.hc_eps,
        sinkhorn_eps=site.hc_eps,
        **options,
    )
    return site, keywords


@torch.no_grad()
def truncation_gap(hc: object, branch, x: Tensor) -> tuple[float, float]:
    """How far DeepSeek-V4's truncated ``H_res`` is from the exact one on streams ``x``, and what that does to the site.

    Runs the hyper-connection's site twice on the PyTorch path (:mod:`mhc.site`, what
    :meth:`mhc.MHCBlock.from_deepseek_v4` runs): with its own ``hc_sinkhorn_iters``-round Sinkhorn
    and with the exact projection of the same logits.

    Args:
        hc: a ``DeepseekV4HyperConnection`` (:func:`read_hyper_connection`).
        branch: the sublayer, ``[..., C] -> [..., C]``.
        x: streams ``[..., n, C]``.

    Returns:
        ``(marginal error, relative change)``: the largest ``‖H1 − 1‖₁ + ‖Hᵀ1 − 1‖₁`` of the truncated
        ``H_res`` over the tokens, and the largest ``‖x'_exact − x'_truncated‖_F / ‖x'_truncated‖_F``
        of one token's ``[n, C]`` output.
    """
    ds = read_hyper_connection(hc)
    outputs, errors = {}, {}
    for projection in ("sinkhorn", "newton"):
        options = MHCOptions(projection=projection, sinkhorn_iters=ds.sinkhorn_iters, norm_eps=ds.norm_eps)
        H_pre, H_post, H_res = site.coefficients(x, *(getattr(ds, k) for k in PARAMETER_NAMES), options,
                                                 pre_eps=ds.hc_eps, sinkhorn_eps=ds.hc_eps)  # fmt: skip
        u, anchor, dev = site.pre_mix(x, H_pre)
        outputs[projection] = site.post_mix(branch(u), anchor, dev, H_post, H_res, exact_rows=projection == "newton",
                                            dtype=x.dtype)  # fmt: skip
        errors[projection] = float(marginal_error(H_res).max())
    a, b = outputs["sinkhorn"], outputs["newton"]
    return errors["sinkhorn"], float(((b - a).norm(dim=(-2, -1)) / a.norm(dim=(-2, -1))).max())


def gap_table(scales: tuple[float, ...] = (0.1, 1.0, 3.0, 10.0), seeds: int = 5) -> str:
    """Markdown table of :func:`truncation_gap` on random DeepSeek-V4 sites, by the spread of the comb logits.

    ``n = 4``, ``C = 64``, transformers' ``DeepseekV4HyperConnection`` with ``fn ~ N(0, 1/(nC))``
    (so ``z`` has unit spread on unit-RMS streams) and its comb rows times ``scale``, ``base = 0``,
    ``scale = 1``; a random linear branch; ``seeds`` draws of 1024 tokens each; maxima over all.

    Raises:
        ImportError: the installed transformers has no DeepSeek-V4.
    """
    from torch import nn
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    n, C = 4, 64
    rows = [
        "| comb logit std | marginal error, 20 rounds (max) | ‖out_exact − out_sk20‖ / ‖out‖ (max) |",
        "|---|---|---|",
    ]
    for spread in scales:
        gaps = []
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            hc = DeepseekV4HyperConnection(DeepseekV4Config(hidden_size=C, hc_mult=n))
            with torch.no_grad():
                hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * (n * C) ** -0.5)
                hc.fn[2 * n :] *= spread
                hc.base.zero_()
                hc.scale.fill_(1.0)
            torch.manual_seed(seed)  # the branch's weights
            gaps.append(truncation_gap(hc, nn.Linear(C, C), torch.randn(64, 16, n, C, generator=g)))
        rows.append(f"| {spread:g} | {max(e for e, _ in gaps):.3g} | {max(d for _, d in gaps):.3g} |")
    return "\n".join(rows)
