"""Figures of training runs, drawn with matplotlib: loss curves, composite gains vs depth, a comparison.

The ``plot_*`` functions take plain data (the records of ``metrics.jsonl`` and the ``composite_gains``
dict of ``summary.json``), write one PNG and return its :class:`~pathlib.Path`; ``loss_figure``,
``gains_figure`` and ``comparison_figure`` return the :class:`~matplotlib.figure.Figure` instead
(to show in a notebook, restyle, or save in another format)::

    plot_loss(train_records, eval_records, title="mhc (n=4)", unigram_entropy=6.70, path="loss.png")
    plot_gains(summary["composite_gains"], title="mhc (n=4)", step=1750, path="gains.png")
    plot_comparison({"mhc": {"eval": evals, "gains": gains}, ...}, path="compare.png")

Figures are plain :class:`matplotlib.figure.Figure` objects, never pyplot ones: nothing changes
matplotlib's global backend or registers with pyplot's figure manager, so a figure is freed when
its function returns. ``import mhc`` imports neither this module nor matplotlib. The PNG bytes
depend only on the data: no software/version text chunk is written.

mHC's composite ``H_res`` products are doubly stochastic, so its forward gain, backward gain and
spectral norm all sit at 1 to within ~1e-6 and would draw as one line. Whenever some gain is near 1
a second panel plots ``|gain - 1|`` on a log axis, where the series separate.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, FuncFormatter, MaxNLocator

__all__ = ["ema", "variant_colors", "VARIANT_COLORS", "plot_loss", "plot_gains", "plot_comparison"]
__all__ += ["loss_figure", "gains_figure", "comparison_figure"]

#: Fixed colors of the variants the project trains, so a variant looks the same in every figure.
VARIANT_COLORS = {"residual": "#2ca02c", "hc": "#d62728", "mhc": "#1f77b4"}
# Other variant names get one of these (tab10 less the three above), picked by a hash of the name.
_OTHER_COLORS = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
_RUN_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# (key in composite_gains, legend name, color, linestyle, marker, marker size, filled). Sizes shrink
# and the first marker is open, so three series at the same value still show three markers.
_GAIN_STYLES = (
    ("forward_gain", "forward gain (max row sum)", "#1f77b4", "-", "o", 8.0, False),
    ("backward_gain", "backward gain (max col sum)", "#ff7f0e", "--", "s", 5.5, True),
    ("spectral_norm", "spectral norm", "#2ca02c", ":", "^", 4.5, True),
)
_GAIN_KEYS = tuple(s[0] for s in _GAIN_STYLES)
# The comparison's (key, short name, linestyle, filled, z-order); its color and marker are the run's.
_FWD_BWD_STYLES = (("forward_gain", "fwd", "-", False, 2), ("backward_gain", "bwd", "--", True, 3))
_RUN_KEYS = ("variant", "train", "eval", "gains", "gains_step", "unigram_entropy")
# All gains within _NEAR_ONE of 1: the gain axis is a fixed 0.9..1.1 and labels read "1 + 6.9e-07".
_NEAR_ONE = 1e-3
# Some gain within _DEVIATION_PANEL_BELOW of 1: the figure gets the |gain - 1| panel.
_DEVIATION_PANEL_BELOW = 0.1
_FLOAT32_EPS = float(np.finfo(np.float32).eps)
_DPI = 100


def ema(values: Sequence[float], beta: float | None = None) -> np.ndarray:
    """Bias-corrected exponential moving average of a 1-D series.

    Args:
        values: T finite numbers.
        beta: decay in [0, 1); defaults to ``1 - 20 / T`` (averages over ~1/20 of the series).

    Returns:
        float64 array of shape (T,): ``m_t / (1 - beta**t)``, ``m_t = beta m_{t-1} + (1 - beta) v_t``.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"ema: values must be 1-D, got shape {v.shape}")
    if not np.isfinite(v).all():
        raise ValueError("ema: values contain NaN or Inf; drop them before smoothing")
    if beta is None:
        beta = max(0.0, 1.0 - 20.0 / max(len(v), 1))
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"ema: beta must be in [0, 1), got {beta}")
    out, m = np.empty_like(v), 0.0
    for i, x in enumerate(v):
        m = beta * m + (1.0 - beta) * x
        out[i] = m / (1.0 - beta ** (i + 1))
    return out


def variant_colors(variants: Sequence[str]) -> dict[str, str]:
    """Color of each variant name: :data:`VARIANT_COLORS`, else a pick by a stable hash (crc32) of the name.

    So an unknown variant has the same color in every figure; unknown names that collide within
    one call get distinct colors.
    """
    out: dict[str, str] = {}
    for name in variants:
        if name in out:
            continue
        if name in VARIANT_COLORS:
            out[name] = VARIANT_COLORS[name]
            continue
        start, used = zlib.crc32(name.encode()) % len(_OTHER_COLORS), set(out.values())
        free = [_OTHER_COLORS[(start + k) % len(_OTHER_COLORS)] for k in range(len(_OTHER_COLORS))]
        out[name] = next((c for c in free if c not in used), free[0])
    return out


def _series(records: Sequence[Mapping], ykey: str, what: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, values, number dropped) of the records whose ``tokens`` and ``ykey`` are finite.

    A ``ykey`` of None (an eval that measured nothing) is dropped like a NaN.
    """
    xs, ys, dropped = [], [], 0
    for i, r in enumerate(records):
        if not isinstance(r, Mapping):
            raise TypeError(f"{what}[{i}] must be a dict (a metrics.jsonl record), got {type(r).__name__}")
        for key in ("tokens", ykey):
            if key not in r:
                raise ValueError(f"{what}[{i}] has no '{key}' field (keys: {sorted(r)})")
        x, y = r["tokens"], r[ykey]
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
            dropped += 1
            continue
        xs.append(float(x))
        ys.append(float(y))
    return np.asarray(xs), np.asarray(ys), dropped


def _tokens_to_steps(records: Sequence[Mapping]):
    """(tokens -> step, step -> tokens) maps through the records' (tokens, step) pairs and (0, 0), or None.

    Piecewise linear, extended linearly past the last record so axis ticks beyond it stay monotone;
    with a constant ``tokens = step * tokens_per_step`` it is exactly that ratio.
    """
    pairs = {(0.0, 0.0)}
    for r in records:
        t, st = r.get("tokens"), r.get("step")
        if t is not None and st is not None and math.isfinite(t) and math.isfinite(st) and t > 0 and st > 0:
            pairs.add((float(t), float(st)))
    t, st = np.asarray(sorted(pairs)).T
    if len(t) < 2 or np.any(np.diff(t) <= 0) or np.any(np.diff(st) <= 0):
        return None  # no records, or tokens and steps that do not grow together
    return (lambda x: _interp_linear_ends(x, t, st)), (lambda x: _interp_linear_ends(x, st, t))


def _interp_linear_ends(x, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    lo = fp[0] + (x - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0])
    hi = fp[-1] + (x - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    return np.where(x < xp[0], lo, np.where(x > xp[-1], hi, np.interp(x, xp, fp)))


def _check_gains(gains: Mapping, what: str) -> dict[str, np.ndarray]:
    """The series of a ``composite_gains`` dict as float64 arrays of one shape (D,), D >= 1."""
    if not isinstance(gains, Mapping):
        raise TypeError(f"{what} must be a dict of per-depth lists, got {type(gains).__name__}")
    unknown = sorted(set(gains) - set(_GAIN_KEYS))
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; expected {list(_GAIN_KEYS)}")
    for key in ("forward_gain", "backward_gain"):
        if key not in gains:
            raise ValueError(f"{what}: missing '{key}'")
    out = {k: np.asarray(gains[k], dtype=np.float64) for k in _GAIN_KEYS if k in gains}
    shapes = {k: v.shape for k, v in out.items()}
    if len(set(shapes.values())) != 1 or len(shapes["forward_gain"]) != 1 or shapes["forward_gain"][0] == 0:
        raise ValueError(f"{what}: the series must be non-empty 1-D lists of one length, got shapes {shapes}")
    return out


def _fmt_gain(v: float) -> str:
    """A gain as text: ``20.37``; ``1 + 6.9e-07`` within 1e-3 of 1; ``exactly 1``."""
    d = v - 1.0
    if not math.isfinite(v) or abs(d) >= _NEAR_ONE:
        return f"{v:.4g}"
    return "exactly 1" if d == 0.0 else f"1 {'+' if d > 0 else '-'} {abs(d):.2g}"


def _deviation(g: np.ndarray) -> np.ndarray:
    """|g - 1|, with exact zeros and non-finite values as NaN (gaps on a log axis)."""
    d = np.abs(g - 1.0)
    return np.where(np.isfinite(d) & (d > 0), d, np.nan)


def _needs_deviation_panel(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return bool(finite.size) and bool(np.min(np.abs(finite - 1.0)) < _DEVIATION_PANEL_BELOW)


def _all_near_one(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return bool(finite.size) and bool(np.max(np.abs(finite - 1.0)) < _NEAR_ONE)


def _png_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"path must end in .png, got {str(path)!r}")
    return path


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No "Software" text chunk: the bytes then depend on the data, not on the matplotlib version.
    fig.savefig(path, format="png", dpi=_DPI, metadata={"Software": None})
    fig.clear()
    return path


def _loss_axes(ax, records: Sequence[Mapping], title: str) -> None:
    """Tokens on the bottom x axis, the optimizer step of the same point on the top one."""
    ax.set_xlabel("tokens")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    maps = _tokens_to_steps(records)
    if maps is not None:
        top = ax.secondary_xaxis("top", functions=maps)
        top.set_xlabel("step")
        top.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.35")


def _draw_gain(ax_gain, ax_dev, depth, series, *, label, color, ls, marker, ms, filled, zorder) -> bool:
    """One gain series on the gain panel and its |g - 1| on the deviation panel (if any).

    Returns True if some deviation was drawn (exact 1s and non-finite values leave gaps).
    """
    style = dict(color=color, ls=ls, marker=marker, ms=ms, mfc=color if filled else "none", mew=1.4, lw=1.6)
    ax_gain.plot(depth, np.where(np.isfinite(series), series, np.nan), label=label, zorder=zorder, **style)
    dev = _deviation(series)
    if ax_dev is None or np.isnan(dev).all():
        return False
    ax_dev.plot(depth, dev, zorder=zorder, **style)
    return True


def _label_2_and_5(v: float, _pos) -> str:
    """Minor-tick label of a log axis: only the 2s and 5s of each decade."""
    mantissa = v / 10 ** math.floor(math.log10(v))
    return f"{v:g}" if round(mantissa, 6) in (2.0, 5.0) else ""


def _finish_gain_axes(
    ax_gain, ax_dev, values: np.ndarray, any_dev: bool, depth_max: int, legend_on_dev: bool
) -> None:
    """Scales, limits, references and the one legend of a gain panel and its optional |gain - 1| panel.

    Args:
        values: every gain drawn (any shape); picks log/linear y and the reference lines.
        any_dev: whether some |gain - 1| was drawn on ``ax_dev``.
        legend_on_dev: put the legend on ``ax_dev`` rather than ``ax_gain``.
    """
    finite = values[np.isfinite(values)]
    if _all_near_one(values):
        # A fixed 0.9..1.1 axis says "all at 1"; the deviation panel tells the series apart.
        ax_gain.set_ylim(0.9, 1.1)
        ax_gain.set_yticks([0.9, 1.0, 1.1])
    elif finite.size and finite.min() > 0 and (finite.max() > 20 or finite.max() / finite.min() > 10):
        ax_gain.set_yscale("log")
        ax_gain.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax_gain.yaxis.set_minor_formatter(FuncFormatter(_label_2_and_5))
    ax_gain.axhline(1.0, color="0.6", lw=0.8, zorder=0)
    ax_gain.set_ylabel("gain")
    panels = (ax_gain,) if ax_dev is None else (ax_gain, ax_dev)
    for ax in panels:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0.5, depth_max + 0.5)
    panels[-1].set_xlabel("depth (number of composed H_res sites)")
    handles, labels = ax_gain.get_legend_handles_labels()
    if ax_dev is not None:
        ax_dev.set_yscale("log")
        ax_dev.set_ylabel("|gain − 1|  (log)")
        if not any_dev:
            ax_dev.set_ylim(1e-9, 1.0)
            _no_data(ax_dev, "every gain is exactly 1 at every depth (|gain − 1| = 0)")
        elif np.nanmax(_deviation(values)) < _NEAR_ONE:
            eps = ax_dev.axhline(_FLOAT32_EPS, color="0.5", lw=1.0, ls="-.", zorder=0)
            handles, labels = handles + [eps], labels + ["float32 eps (1.2e-7), for scale"]
    # One legend for both panels: the deviation lines repeat the gain lines' styles.
    (ax_dev if legend_on_dev and ax_dev is not None else ax_gain).legend(
        handles, labels, loc="best", fontsize="small"
    )


# --------------------------------------------------------------------------------------
# The three figures
# --------------------------------------------------------------------------------------


def plot_loss(
    train_records: Sequence[Mapping],
    eval_records: Sequence[Mapping],
    *,
    title: str,
    unigram_entropy: float | None,
    path: str | os.PathLike,
) -> Path:
    """Write :func:`loss_figure` of the same arguments to ``path`` (a ``.png``) and return ``Path(path)``."""
    path = _png_path(path)
    return _save(loss_figure(train_records, eval_records, title=title, unigram_entropy=unigram_entropy), path)


def loss_figure(
    train_records: Sequence[Mapping],
    eval_records: Sequence[Mapping],
    *,
    title: str,
    unigram_entropy: float | None,
) -> Figure:
    """Loss curves of one run: train loss (faint) and its EMA, val loss with markers, unigram entropy.

    Args:
        train_records: ``kind == "train"`` records, each with ``tokens``, ``step`` and ``loss``.
        eval_records: ``kind == "eval"`` records, each with ``tokens``, ``step`` and ``val_loss``
            (may be empty).
        title: figure title (e.g. ``"mhc (n=4)"``).
        unigram_entropy: nats/token of the data's unigram distribution (a dashed reference), or None.

    NaN/Inf/None losses are not drawn; the legend says how many were dropped. The bottom x axis is
    tokens, the top one the step of the same point; the last val point is labelled with its step.
    """
    if unigram_entropy is not None and not math.isfinite(unigram_entropy):
        raise ValueError(f"unigram_entropy must be finite or None, got {unigram_entropy}")
    tx, ty, t_drop = _series(train_records, "loss", "train_records")
    vx, vy, v_drop = _series(eval_records, "val_loss", "eval_records")
    fig = Figure(figsize=(9.0, 5.4), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    if tx.size:
        note = f" ({t_drop} non-finite not drawn)" if t_drop else ""
        ax.plot(tx, ty, color="#aec7e8", lw=0.8, label=f"train{note}")
        ax.plot(tx, ema(ty), color="#1f77b4", lw=2.0, label="train (EMA)")
    if vx.size:
        note = f" ({v_drop} non-finite not drawn)" if v_drop else ""
        ax.plot(vx, vy, color="#d62728", lw=1.8, marker="o", ms=5, label=f"val{note}", zorder=3)
        finite = (r for r in eval_records if r["val_loss"] is not None and r["tokens"] is not None)
        last = [r for r in finite if math.isfinite(r["val_loss"]) and math.isfinite(r["tokens"])][-1]
        ax.annotate(f"val {vy[-1]:.4f}\nstep {last.get('step', '?')}", (vx[-1], vy[-1]), xytext=(-8, 28),
                    textcoords="offset points", ha="right", color="#d62728",
                    arrowprops=dict(arrowstyle="-", color="#d62728", lw=0.8))  # fmt: skip
    if unigram_entropy is not None:
        ax.axhline(
            unigram_entropy, color="0.4", ls="--", lw=1.2, label=f"unigram entropy ({unigram_entropy:.3f})"
        )
    if not (tx.size or vx.size):
        _no_data(ax, "no finite losses recorded")
    _loss_axes(ax, list(train_records) + list(eval_records), f"{title}: loss")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right")
    return fig


def plot_gains(
    gains: Mapping[str, Sequence[float]], *, title: str, step: int | None, path: str | os.PathLike
) -> Path:
    """Write :func:`gains_figure` of the same arguments to ``path`` (a ``.png``) and return ``Path(path)``."""
    path = _png_path(path)
    return _save(gains_figure(gains, title=title, step=step), path)


def gains_figure(gains: Mapping[str, Sequence[float]], *, title: str, step: int | None) -> Figure:
    """Composite-mapping gains vs depth; a ``|gain - 1|`` log panel below when some gain is near 1.

    Args:
        gains: ``summary["composite_gains"]``: ``forward_gain``, ``backward_gain`` and optionally
            ``spectral_norm``, lists of D floats; entry d is the gain of the product of sites 1..d+1.
        title: figure title (e.g. ``"mhc (n=4)"``).
        step: the optimizer step the gains were measured at (in the title), or None if unknown.

    The series differ in color, line style and marker (an open circle around smaller filled
    markers), so coinciding lines stay visible. The gain axis is log when gains are large (HC),
    fixed at 0.9..1.1 when all are within 1e-3 of 1 (mHC). Legend entries give the full-depth value.
    """
    series = _check_gains(gains, "gains")
    depth = np.arange(1, len(series["forward_gain"]) + 1)
    values = np.concatenate(list(series.values()))
    fig = Figure(figsize=(9.0, 7.0), dpi=_DPI, layout="constrained")
    if _needs_deviation_panel(values):
        # All gains at ~1 leave the gain panel flat: the deviation panel gets the room then.
        ratios = (1, 2) if _all_near_one(values) else (3, 2)
        ax_gain, ax_dev = fig.subplots(2, 1, sharex=True, height_ratios=ratios)
    else:
        ax_gain, ax_dev = fig.add_subplot(), None
    any_dev = False
    for z, (key, name, color, ls, marker, ms, filled) in enumerate(_GAIN_STYLES):
        if key in series:
            label = f"{name}: {_fmt_gain(series[key][-1])} at full depth"
            any_dev |= _draw_gain(ax_gain, ax_dev, depth, series[key], label=label, color=color, ls=ls,
                                  marker=marker, ms=ms, filled=filled, zorder=2 + z)  # fmt: skip
    _finish_gain_axes(ax_gain, ax_dev, values, any_dev, len(depth), legend_on_dev=False)
    at = f"measured at step {step}" if step is not None else "step not recorded"
    ax_gain.set_title(f"{title}: composite H_res gain vs depth ({at})")
    return fig


def plot_comparison(runs: Mapping[str, Mapping], *, path: str | os.PathLike) -> Path:
    """Write :func:`comparison_figure` of ``runs`` to ``path`` (a ``.png``) and return ``Path(path)``."""
    path = _png_path(path)
    return _save(comparison_figure(runs), path)


def comparison_figure(runs: Mapping[str, Mapping]) -> Figure:
    """Val-loss curves and composite gains vs depth of several runs, one color per variant.

    Args:
        runs: label -> dict with any of
            ``variant`` (str, default the label; picks the color, see :func:`variant_colors`),
            ``eval`` (eval records with ``tokens``/``step``/``val_loss``),
            ``train`` (train records with ``tokens``/``step``/``loss``; drawn faint as an EMA),
            ``gains`` (a ``composite_gains`` dict, or None),
            ``gains_step`` (the step the gains were measured at: in the title if all runs agree,
            else in each run's legend entries),
            ``unigram_entropy`` (float; one dashed line per distinct value).

    Layout: val loss (left top) and the same zoomed on the second half of the tokens (left bottom);
    forward (solid, open markers) and backward (dashed, filled) gain vs depth (right), over their
    ``|gain - 1|`` when some gain is near 1. Runs of one variant share its color, not their marker.
    """
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError("runs must be a non-empty dict: label -> run data")
    for label, run in runs.items():
        if not isinstance(run, Mapping):
            raise TypeError(f"runs[{label!r}] must be a dict, got {type(run).__name__}")
        unknown = sorted(set(run) - set(_RUN_KEYS))
        if unknown:
            raise ValueError(f"runs[{label!r}]: unknown key(s) {unknown}; expected some of {list(_RUN_KEYS)}")
    labels = list(runs)
    variants = {lab: str(runs[lab].get("variant", lab)) for lab in labels}
    by_variant = variant_colors(list(variants.values()))
    colors = {lab: by_variant[variants[lab]] for lab in labels}
    markers = {lab: _RUN_MARKERS[i % len(_RUN_MARKERS)] for i, lab in enumerate(labels)}
    gains = {
        lab: _check_gains(r["gains"], f"runs[{lab!r}]['gains']") for lab, r in runs.items() if r.get("gains")
    }
    gain_values = np.concatenate(
        [np.r_[g["forward_gain"], g["backward_gain"]] for g in gains.values()] or [[]]
    )

    fig = Figure(figsize=(14.0, 8.6), dpi=_DPI, layout="constrained")
    grid = fig.add_gridspec(2, 2)
    ax_loss, ax_zoom = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[1, 0])
    if _needs_deviation_panel(gain_values):
        ax_gain = fig.add_subplot(grid[0, 1])
        ax_dev = fig.add_subplot(grid[1, 1], sharex=ax_gain)
    else:
        ax_gain, ax_dev = fig.add_subplot(grid[:, 1]), None
    _draw_val_losses(ax_loss, ax_zoom, runs, colors, markers)
    steps = {runs[lab].get("gains_step") for lab in gains}
    one_step = len(steps) == 1 and None not in steps  # then the title says it, else each legend entry
    any_dev, depth_max = False, 1
    for i, (lab, g) in enumerate(gains.items()):
        at_step = "" if one_step else f", step {runs[lab].get('gains_step', '?')}"
        depth = np.arange(1, len(g["forward_gain"]) + 1)
        depth_max = max(depth_max, len(depth))
        # Earlier runs get larger markers, so a run drawn over another (both at 1) leaves a ring.
        ms = 5.0 + 2.0 * (len(gains) - 1 - i)
        for key, short, ls, filled, z in _FWD_BWD_STYLES:
            label = f"{lab} {short}: {_fmt_gain(g[key][-1])} at depth {len(depth)}{at_step}"
            any_dev |= _draw_gain(ax_gain, ax_dev, depth, g[key], label=label, color=colors[lab], ls=ls,
                                  marker=markers[lab], ms=0.6 * ms if filled else ms, filled=filled,
                                  zorder=z + 2 * i)  # fmt: skip
    if gains:
        _finish_gain_axes(ax_gain, ax_dev, gain_values, any_dev, depth_max, legend_on_dev=True)
    else:
        _no_data(ax_gain, "no composite gains recorded")
    at = f" at step {next(iter(steps))}" if one_step else ""
    ax_gain.set_title(f"composite H_res gain vs depth{at}: fwd (solid), bwd (dashed)")
    return fig


def _draw_val_losses(ax_loss, ax_zoom, runs: Mapping[str, Mapping], colors: dict, markers: dict) -> None:
    """Val loss (and faint train EMA) of every run on ``ax_loss``; the second half of it on ``ax_zoom``."""
    val, records = {}, []
    for lab, run in runs.items():
        ev, tr = list(run.get("eval") or []), list(run.get("train") or [])
        records += ev + tr
        tx, ty, _ = _series(tr, "loss", f"runs[{lab!r}]['train']")
        if tx.size:
            ax_loss.plot(tx, ema(ty), color=colors[lab], lw=1.0, alpha=0.45)
        val[lab] = _series(ev, "val_loss", f"runs[{lab!r}]['eval']")[:2]
        if val[lab][0].size:
            style = dict(color=colors[lab], marker=markers[lab], ms=6, mfc="none", mew=1.4, lw=1.8)
            ax_loss.plot(*val[lab], label=f"{lab}: val {val[lab][1][-1]:.4f} at end", **style)
    for u in sorted(
        {run["unigram_entropy"] for run in runs.values() if run.get("unigram_entropy") is not None}
    ):
        ax_loss.axhline(u, color="0.4", ls="--", lw=1.2, label=f"unigram entropy ({u:.3f})")
    _loss_axes(ax_loss, records, "val loss (markers) and train loss EMA (faint)")
    if not any(vx.size for vx, _ in val.values()):
        _no_data(ax_loss, "no finite val losses recorded")
    if ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend(loc="upper right")
    # The curves bunch up late in training, where the differences between runs are the point.
    x_end = max((vx.max() for vx, _ in val.values() if vx.size), default=0.0)
    zoom_y = []
    for lab, (vx, vy) in val.items():
        keep = vx >= 0.5 * x_end
        if keep.any():
            style = dict(color=colors[lab], marker=markers[lab], ms=6, mfc="none", mew=1.4, lw=1.8)
            ax_zoom.plot(vx[keep], vy[keep], label=lab, **style)
            zoom_y.append(vy[keep])
    if zoom_y:
        lo, hi = float(min(y.min() for y in zoom_y)), float(max(y.max() for y in zoom_y))
        pad = 0.08 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1.0)
        ax_zoom.set_ylim(lo - pad, hi + pad)
        ax_zoom.legend(loc="upper right")
    else:
        _no_data(ax_zoom, "no val losses in the second half of training")
    _loss_axes(ax_zoom, records, "val loss, second half of training (zoomed)")
