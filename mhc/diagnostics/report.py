"""A model's stability report: every metric per depth, as data, a text table and a figure."""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..options import check_real
from ..projection import marginal_error
from .collect import SiteRecord, collect_sites
from .metrics import near_zero_or_one, one_hot_rows, stack_h_res, suffix_backward_gain, token_gains

__all__ = [
    "DEFAULT_EPS",
    "StabilityReport",
    "stability_report",
    "report_from_h_res",
    "report_from_sites",
    "plot_report",
]

#: Saturation threshold: a value within this of 0 or 1 is saturated.
DEFAULT_EPS = 1e-3


@dataclass
class StabilityReport:
    """Every stability metric of one run of a model, per depth ``d`` (site ``d``, 0-based, in run order).

    Gains are those of the prefix composite ``P_d = H_res^d ⋯ H_res^0`` (see
    :mod:`mhc.diagnostics.metrics` for the orientation), per token, then the mean and
    the max over the ``tokens`` (every batch position). Each list has one entry per depth.
    Token positions are indices into the batch shape (``(sequence, position)`` for an LM).

    Attributes:
        sites: the sites' names; ``modes``: their ``mode`` (``"mhc"``, ``"hc"``, ``"residual"``).
        batch_shape: the token batch shape of every ``H_res`` (``[*batch, n, n]``).
        forward_gain_mean, forward_gain_max, forward_gain_token: the composite's max
            absolute row sum: mean and max over the tokens, and the token of the max.
        backward_gain_mean, backward_gain_max, backward_gain_token: the same for the max
            absolute column sum.
        marginal_error_mean, marginal_error_max, marginal_error_token: the doubly-stochastic
            deviation ``‖H1 - 1‖₁ + ‖Hᵀ1 - 1‖₁`` (:func:`mhc.marginal_error`) of the site's own
            ``H_res`` (not the composite's): about 1e-6 for Newton, larger for few Sinkhorn steps.
        spread_mean, spread_min: :func:`~mhc.diagnostics.stream_spread` of the streams entering
            the site, mean and min over the tokens (0: collapsed into one stream); None when
            built from bare ``H_res`` tensors.
        logit_scale_mean, logit_scale_max: :func:`~mhc.diagnostics.logit_scale` of the logits the
            site's projection turned into ``H_res``, mean and max over the tokens; None for ``hc``
            and ``residual`` sites and when built from bare ``H_res`` tensors.
        h_res_saturated_entries: fraction of the site's ``H_res`` entries within ``eps`` of 0 or 1
            (where the projection's gradient ``T(1-T)`` vanishes).
        h_res_saturated_rows: fraction of its rows within ``eps`` of one-hot.
        pre_saturated, post_saturated: fraction of ``H_pre = σ(·)`` and ``H_post / 2 = σ(·)``
            within ``eps`` of 0 or 1 (the sigmoid's flat part); None for bare ``H_res``.
            All four are None for ``hc`` and ``residual`` sites: their coefficients pass through
            no projection or sigmoid (HC's ``H_res`` starts at the identity, all 0 and 1, unsaturated).
        grad_ratio: ``‖∂loss/∂x_d‖ / ‖∂loss/∂x_L‖`` (Frobenius norms over all tokens) of the
            streams entering site ``d`` against those leaving the last site, from one backward
            pass; None without one.
        predicted_backward_gain: the backward gain of the suffix composite
            ``H_res^{L-1} ⋯ H_res^d`` (worst token): what the residual path alone does to the
            gradient on its way back to depth ``d``; the branches add paths of their own, so
            ``grad_ratio`` reads beside it, not under it.
        eps: the saturation threshold used.
    """

    sites: list[str]
    modes: list[str]
    batch_shape: tuple[int, ...]
    forward_gain_mean: list[float]
    forward_gain_max: list[float]
    forward_gain_token: list[tuple[int, ...]]
    backward_gain_mean: list[float]
    backward_gain_max: list[float]
    backward_gain_token: list[tuple[int, ...]]
    marginal_error_mean: list[float]
    marginal_error_max: list[float]
    marginal_error_token: list[tuple[int, ...]]
    spread_mean: list[float | None]
    spread_min: list[float | None]
    logit_scale_mean: list[float | None]
    logit_scale_max: list[float | None]
    h_res_saturated_entries: list[float | None]
    h_res_saturated_rows: list[float | None]
    pre_saturated: list[float | None]
    post_saturated: list[float | None]
    grad_ratio: list[float | None]
    predicted_backward_gain: list[float]
    eps: float

    @property
    def depth(self) -> int:
        """The number of sites."""
        return len(self.sites)

    def as_dict(self) -> dict:
        """Plain lists and numbers, for JSON (tuples become lists)."""
        return asdict(self)

    def table(self) -> str:
        """The report as a fixed-width text table, one row per depth, with a heading and a key."""
        return format_table(self)


def _token(flat_index: int, batch_shape: tuple[int, ...]) -> tuple[int, ...]:
    if not batch_shape:
        return ()
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), batch_shape))


def _summaries(values: Tensor, batch_shape: tuple[int, ...]) -> tuple[list[float], list[float], list[tuple]]:
    """Mean, max and the argmax token of ``values: [L, *batch]`` per depth (NaN counts as the max)."""
    flat = values.reshape(values.shape[0], -1)
    worst = torch.where(torch.isnan(flat), torch.inf, flat).argmax(-1)
    return (
        flat.mean(-1).tolist(),
        flat.gather(1, worst[:, None]).squeeze(1).tolist(),
        [_token(int(i), batch_shape) for i in worst],
    )


def _fraction(mask: Tensor) -> float:
    return float(mask.double().mean()) if mask.numel() else 0.0


def _check_eps(eps) -> float:
    """The saturation threshold: a real number in ``(0, 0.5)`` (``TypeError`` / ``ValueError``)."""
    eps = check_real("eps", eps, False)
    if not 0 < eps < 0.5:
        raise ValueError(f"eps must be a number in (0, 0.5), got {eps!r}")
    return eps


def _build(
    h_res: Tensor, names: list[str], modes: list[str], eps: float, records: Sequence[SiteRecord] | None
) -> StabilityReport:
    eps = _check_eps(eps)
    batch_shape = tuple(h_res.shape[1:-2])
    gains = token_gains(h_res)
    fwd_mean, fwd_max, fwd_tok = _summaries(gains.forward, batch_shape)
    bwd_mean, bwd_max, bwd_tok = _summaries(gains.backward, batch_shape)
    err_mean, err_max, err_tok = _summaries(marginal_error(h_res), batch_shape)
    depth = h_res.shape[0]
    spread_mean, spread_min, scale_mean, scale_max, pre_sat, post_sat, grad_ratio = (
        [None] * depth for _ in range(7)
    )
    if records is not None:
        last_out = records[-1].grad_out_norm
        for d, r in enumerate(records):
            spread_mean[d], spread_min[d] = (
                float(r.spread.mean()),
                float(r.spread.min()) if r.spread.numel() else None,
            )
            if r.logit_scale is not None and r.logit_scale.numel():
                scale_mean[d], scale_max[d] = float(r.logit_scale.mean()), float(r.logit_scale.max())
            if r.mode == "mhc":
                pre_sat[d] = _fraction(near_zero_or_one(r.h_pre, eps))
                post_sat[d] = _fraction(near_zero_or_one(r.h_post / 2, eps))
            if r.grad_in_norm is not None and last_out:
                grad_ratio[d] = r.grad_in_norm / last_out
    return StabilityReport(
        sites=list(names),
        modes=list(modes),
        batch_shape=batch_shape,
        forward_gain_mean=fwd_mean,
        forward_gain_max=fwd_max,
        forward_gain_token=fwd_tok,
        backward_gain_mean=bwd_mean,
        backward_gain_max=bwd_max,
        backward_gain_token=bwd_tok,
        marginal_error_mean=err_mean,
        marginal_error_max=err_max,
        marginal_error_token=err_tok,
        spread_mean=spread_mean,
        spread_min=spread_min,
        logit_scale_mean=scale_mean,
        logit_scale_max=scale_max,
        h_res_saturated_entries=[
            _fraction(near_zero_or_one(h, eps)) if m in ("mhc", "?") else None for h, m in zip(h_res, modes)
        ],
        h_res_saturated_rows=[
            _fraction(one_hot_rows(h, eps)) if m in ("mhc", "?") else None for h, m in zip(h_res, modes)
        ],
        pre_saturated=pre_sat,
        post_saturated=post_sat,
        grad_ratio=grad_ratio,
        predicted_backward_gain=suffix_backward_gain(h_res).tolist(),
        eps=float(eps),
    )


def report_from_h_res(
    h_res: Sequence[Tensor] | Tensor, *, names: Sequence[str] | None = None, eps: float = DEFAULT_EPS
) -> StabilityReport:
    """The report of bare per-site ``H_res`` tensors (no streams: spread and ``H_pre``/``H_post`` are None).

    Args:
        h_res: a list of ``[*batch, n, n]`` tensors or one ``[L, *batch, n, n]`` tensor, first site first.
        names: one name per site, strings (default ``"site <d>"``).
        eps: the saturation threshold, a real number in ``(0, 0.5)``.

    Raises:
        TypeError: ``names`` not a sequence of strings, ``eps`` not a real number, or
            ``h_res`` not floating-point tensors.
        ValueError: no site, not ``[..., n, n]``, sites of different shapes, a name count
            that is not the site count, or ``eps`` outside ``(0, 0.5)``.
    """
    eps = _check_eps(eps)
    H = stack_h_res(h_res)
    if names is not None and (isinstance(names, (str, bytes)) or not isinstance(names, Sequence)):
        raise TypeError(f"names must be a sequence of strings, got {type(names).__name__}")
    names = [f"site {d}" for d in range(H.shape[0])] if names is None else list(names)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"names must be strings, got {[type(name).__name__ for name in names]}")
    if len(names) != H.shape[0]:
        raise ValueError(f"{len(names)} names for {H.shape[0]} sites")
    return _build(H, names, ["?"] * H.shape[0], eps, None)


def report_from_sites(records: Sequence[SiteRecord], *, eps: float = DEFAULT_EPS) -> StabilityReport:
    """The report of what :func:`~mhc.diagnostics.collect_sites` recorded.

    Raises:
        TypeError: ``records`` are not :class:`~mhc.diagnostics.SiteRecord` s, or ``eps`` not a real number.
        ValueError: no records, or ``eps`` outside ``(0, 0.5)``.
    """
    eps = _check_eps(eps)
    if not records:
        raise ValueError("no site records")
    if not all(isinstance(r, SiteRecord) for r in records):
        raise TypeError(
            f"records must be SiteRecord objects (collect_sites), got {[type(r).__name__ for r in records]}"
        )
    H = stack_h_res([r.h_res for r in records])
    return _build(H, [r.name for r in records], [r.mode for r in records], eps, list(records))


def stability_report(
    model: nn.Module,
    *args,
    loss_fn: Callable[[object], Tensor] | None = None,
    eps: float = DEFAULT_EPS,
    **kwargs,
) -> StabilityReport:
    """Run ``model(*args, **kwargs)`` (and ``loss_fn(output).backward()`` if given) and report on its sites.

    Without ``loss_fn`` the run is under ``no_grad`` and ``grad_ratio`` is None.
    ``eps`` (a real number in ``(0, 0.5)``) is checked before the model runs.
    """
    eps = _check_eps(eps)
    return report_from_sites(collect_sites(model, *args, loss_fn=loss_fn, **kwargs), eps=eps)


# ------------------------------------------------------------------------------- text


def _fmt_gain(v: float | None) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v) or abs(v - 1) >= 1e-3:
        return f"{v:.5g}"
    d = v - 1
    return "1" if d == 0 else f"1{'+' if d > 0 else '-'}{abs(d):.1e}"


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


_COLUMNS = (
    ("depth", 5), ("site", 0), ("mode", 8), ("fwd mean", 11), ("fwd max", 11), ("bwd mean", 11), ("bwd max", 11),
    ("marg err max", 12), ("logit std", 9), ("spread", 8), ("sat H_res", 9), ("sat rows", 8), ("sat pre", 7), ("sat post", 8),
    ("grad ratio", 10), ("pred bwd", 11),
)  # fmt: skip


def format_table(report: StabilityReport) -> str:
    """:meth:`StabilityReport.table`."""
    site_width = max(4, *(len(s) for s in report.sites))
    widths = [w or site_width for _, w in _COLUMNS]
    rows = []
    for d in range(report.depth):
        rows.append([
            str(d), report.sites[d], report.modes[d],
            _fmt_gain(report.forward_gain_mean[d]), _fmt_gain(report.forward_gain_max[d]),
            _fmt_gain(report.backward_gain_mean[d]), _fmt_gain(report.backward_gain_max[d]),
            _fmt(report.marginal_error_max[d], ".2e"), _fmt(report.logit_scale_max[d]), _fmt(report.spread_mean[d]),
            _fmt(report.h_res_saturated_entries[d]), _fmt(report.h_res_saturated_rows[d]),
            _fmt(report.pre_saturated[d]), _fmt(report.post_saturated[d]),
            _fmt(report.grad_ratio[d], ".4g"), _fmt_gain(report.predicted_backward_gain[d]),
        ])  # fmt: skip

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    tokens = math.prod(report.batch_shape)
    last = report.depth - 1
    head = [
        f"{report.depth} sites, {tokens} tokens (batch shape {tuple(report.batch_shape)}); at full depth: "
        f"forward gain {_fmt_gain(report.forward_gain_max[last])} (token {report.forward_gain_token[last]}), "
        f"backward gain {_fmt_gain(report.backward_gain_max[last])} (token {report.backward_gain_token[last]}); "
        f"max marginal error {max(report.marginal_error_max, key=lambda v: math.inf if math.isnan(v) else v):.2e}",
        line([c for c, _ in _COLUMNS]),
    ]
    key = (
        f"fwd/bwd: max abs row/column sum of H_res^d ... H_res^0, mean and max over tokens; marg err: of the site's "
        f"own H_res; logit std: of the logits projected to H_res, worst token; spread: ||x - mean stream|| / ||x|| of the streams entering the site (0 = collapsed); "
        f"sat: fraction within {report.eps:g} of 0 or 1 (rows: of one-hot; pre/post: sigmoid); grad ratio: "
        f"||dloss/dx_d|| / ||dloss/dx_L||; pred bwd: backward gain of H_res^(L-1) ... H_res^d."
    )
    return "\n".join(head + [line(r) for r in rows] + [textwrap.fill(key, 110)])


# ------------------------------------------------------------------------------- figure


def plot_report(report: StabilityReport, path: str | os.PathLike, *, title: str = "") -> Path:
    """A PNG of ``report`` at ``path``: gains, their distance from 1 (log), collapse and saturation, vs depth.

    Panels: (1) forward/backward gain, mean and max over tokens; (2) ``|gain - 1|`` on a
    log axis (0 drawn at the float64 floor), with the marginal error; (3) stream spread
    and saturation fractions; (4) the measured gradient ratio beside the predicted
    backward gain, when the report has one. Returns ``Path(path)``.

    Raises:
        TypeError: ``report`` not a :class:`StabilityReport`, ``path`` not a ``str`` / ``os.PathLike``,
            ``title`` not a ``str``.
        ValueError: ``path`` does not end in ``.png``.
    """
    if not isinstance(report, StabilityReport):
        raise TypeError(f"report must be a StabilityReport, got {type(report).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    # matplotlib only here: half a second to import, which `import mhc` does not need to spend.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"the figure is a PNG: give a path ending in .png, got {path}")
    depth = list(range(report.depth))
    fig = Figure(figsize=(11, 8), dpi=100, layout="constrained")
    (ax_gain, ax_dev), (ax_state, ax_grad) = fig.subplots(2, 2, sharex=True)
    series = {
        "forward gain, max": (report.forward_gain_max, "#1f77b4", "-"),
        "forward gain, mean": (report.forward_gain_mean, "#1f77b4", ":"),
        "backward gain, max": (report.backward_gain_max, "#ff7f0e", "--"),
        "backward gain, mean": (report.backward_gain_mean, "#ff7f0e", "-."),
    }
    floor = 1e-16
    for label, (values, color, ls) in series.items():
        ax_gain.plot(depth, values, color=color, ls=ls, marker=".", label=label)
        ax_dev.plot(
            depth, [max(abs(v - 1), floor) for v in values], color=color, ls=ls, marker=".", label=label
        )
    ax_dev.plot(depth, [max(v, floor) for v in report.marginal_error_max], color="#7f7f7f", marker="x", ls="",
                label="marginal error of H_res, max")  # fmt: skip
    gains = [v for values, _, _ in series.values() for v in values if math.isfinite(v)]
    if gains and max(gains) > 10:
        ax_gain.set_yscale("log")
    elif gains and max(abs(v - 1) for v in gains) < 1e-3:
        ax_gain.set_ylim(0.9, 1.1)  # all at 1 to within 1e-3: the |gain - 1| panel shows the differences
    else:
        ax_gain.yaxis.get_major_formatter().set_useOffset(False)
    ax_gain.set_ylabel("gain of H_res^d ... H_res^0")
    ax_dev.set_yscale("log")
    ax_dev.set_ylabel("|gain - 1|")
    # The saturation fractions are often all 0 together: each line gets its own line style and a hollow
    # marker of its own shape and size, the larger drawn first, so lines lying on one another all show.
    for i, (label, values, color, ls, marker, size) in enumerate(
        (
            ("stream spread (0 = collapsed)", report.spread_mean, "#2ca02c", "-", "o", 4),
            ("H_res entries saturated", report.h_res_saturated_entries, "#d62728", "-", "o", 11),
            ("H_res rows one-hot", report.h_res_saturated_rows, "#9467bd", "--", "s", 8),
            ("H_pre saturated", report.pre_saturated, "#8c564b", "-.", "D", 5.5),
            ("H_post saturated", report.post_saturated, "#e377c2", ":", "^", 3.5),
        )
    ):
        points = [(d, v) for d, v in zip(depth, values) if v is not None]
        if points:
            if i and all(v == 0 for _, v in points):
                label += " (0 at every depth)"
            ax_state.plot(*zip(*points), color=color, ls=ls, marker=marker, markersize=size, fillstyle="none",
                          markeredgewidth=1.3, zorder=2 + i, clip_on=False, label=label)  # fmt: skip
    # symlog: a spread of 1e-5 (streams nearly collapsed) stays visible beside fractions near 1. The
    # axis starts a little below 0, so lines at 0 sit above its edge rather than on it.
    ax_state.set_yscale("symlog", linthresh=1e-6)
    ax_state.set_ylim(-3e-7, 1.05)
    ax_state.set_ylabel(f"stream spread; fraction saturated (within {report.eps:g} of 0/1)")
    points = [(d, v) for d, v in zip(depth, report.grad_ratio) if v is not None]
    if points:
        ax_grad.plot(
            *zip(*points), color="#17becf", marker="o", label="measured ||dloss/dx_d|| / ||dloss/dx_L||"
        )
    ax_grad.plot(depth, report.predicted_backward_gain, color="#bcbd22", ls="--", marker=".",
                 label="predicted: backward gain of H_res^(L-1) ... H_res^d")  # fmt: skip
    ratios = [v for _, v in points if v > 0] + [v for v in report.predicted_backward_gain if v > 0]
    if ratios and max(ratios) / min(ratios) > 10:
        ax_grad.set_yscale("log")
    ax_grad.set_ylabel("gradient gain back to depth d")
    for ax in (ax_gain, ax_dev, ax_state, ax_grad):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_state, ax_grad):
        ax.set_xlabel("depth d (site, in run order)")
    tokens = math.prod(report.batch_shape)
    fig.suptitle(f"{title + ': ' if title else ''}stability over {report.depth} sites, {tokens} tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})
    return path
