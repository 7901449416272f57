"""What a run reports: ``metrics.jsonl`` records, loss spikes, throughput, projection warnings, gains, plots.

``metrics.jsonl`` holds one JSON object a line, with ``kind``:

* ``"train"``: ``step``, ``tokens``, ``loss``, ``lr``, ``grad_norm``, ``spike``, ``skipped``, ``time_s``
  (every ``log_interval`` steps, and at step 1, the last step, spikes and skipped steps);
* ``"eval"``: ``step``, ``tokens``, ``val_loss``, ``fwd_gain``, ``bwd_gain`` (full-depth composite
  gains, None without mHC sites), the stability scalars of :data:`STABILITY_SCALARS` (None without
  mHC sites), ``marginal_error`` (``{"mean": [...], "max": [...]}``, per site over the tokens; None
  without mHC sites), ``logit_scale`` (the same for the spread of the ``H_res`` logits; None without
  projected sites), ``time_s``;
* ``"final"``: the summary (``summary.json``) less its per-depth ``composite_gains`` and ``stability``;
* ``"stopped"``: ``step``, ``tokens``, ``reason``: the run stopped with an error because no step was
  succeeding (``max_skipped_in_a_row`` skipped steps in a row); no ``"final"`` record follows.

Stability is measured on 2 validation sequences (:func:`measure_stability`, :mod:`mhc.diagnostics`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from ..block import MHCBlock
from ..diagnostics import collect_sites, composite_gains, report_from_sites
from ..projection import ConvergenceWarning
from .distributed import DistInfo

__all__ = [
    "read_metrics",
    "MetricsLog",
    "train_record",
    "eval_record",
    "SpikeTracker",
    "final_train_loss",
    "Throughput",
    "ConvergenceWarningCounter",
    "MainProcessLog",
    "composite_gains_of",
    "STABILITY_SCALARS",
    "measure_stability",
    "stability_scalars",
    "plot_run",
]

#: The stability scalars of an eval record and of ``summary.json`` (:func:`stability_scalars`):
#: ``stream_spread``: how far the streams entering the last site differ (mean over tokens of
#: :func:`mhc.diagnostics.stream_spread`; 0 = collapsed into one); ``h_res_saturation``: the largest
#: fraction, over sites, of ``H_res`` entries within 1e-3 of 0 or 1; ``h_res_one_hot_rows``: the same
#: for rows within 1e-3 of one-hot; ``pre_post_saturation``: the largest fraction, over sites, of
#: ``H_pre`` or ``H_post / 2`` within 1e-3 of 0 or 1 (the sigmoid's flat part). The three saturations
#: are None for HC and residual models (no projection, no sigmoid: :class:`mhc.diagnostics.StabilityReport`);
#: ``marginal_error_max``: the largest :func:`mhc.marginal_error` of one site's ``H_res`` at one token;
#: ``h_res_logit_scale``: the largest :func:`mhc.diagnostics.logit_scale` of the logits one site's
#: projection turned into ``H_res`` at one token (None for HC and residual models).
STABILITY_SCALARS = ("stream_spread", "h_res_saturation", "h_res_one_hot_rows", "pre_post_saturation",
                     "marginal_error_max", "h_res_logit_scale")  # fmt: skip


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a ``metrics.jsonl`` file (a torn last line is skipped; a missing file has none)."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (rank 0 only: ``enabled``), one flushed line each.

    Args:
        path: the file.
        enabled: False on ranks that write nothing.
        keep_upto_step: None for a fresh run (the file starts empty); on resume, the checkpoint's
            step: later records are dropped, as the resumed run writes them again.
        finished: the resumed run had already ended (its final evaluation is redone too).
    """

    def __init__(self, path: Path, enabled: bool, keep_upto_step: int | None, finished: bool = False):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if keep_upto_step is None:
            path.write_text("")
        else:
            kept = [
                r
                for r in read_metrics(path)
                if r.get("step", 0) <= keep_upto_step
                and r.get("kind") != "final"
                and not (finished and r.get("kind") == "eval" and r.get("step") == keep_upto_step)
            ]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append one record."""
        if self.enabled:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self) -> None:
        """Close the file."""
        if self.enabled:
            self.f.close()


def train_record(step: int, tokens: int, loss: float, lr: float, grad_norm: float, *, spike: bool, skipped: bool,
                 time_s: float) -> dict:  # fmt: skip
    """A ``"train"`` record of ``metrics.jsonl``."""
    return {"kind": "train", "step": step, "tokens": tokens, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "spike": spike, "skipped": skipped, "time_s": round(time_s, 3)}  # fmt: skip


def eval_record(step: int, tokens: int, val_loss: float, gains: dict | None, time_s: float,
                stability: dict | None = None) -> dict:  # fmt: skip
    """An ``"eval"`` record of ``metrics.jsonl``; ``gains`` and ``stability`` as :func:`measure_stability` returns them."""
    record = {
        "kind": "eval",
        "step": step,
        "tokens": tokens,
        "val_loss": val_loss,
        "fwd_gain": gains["forward_gain"][-1] if gains else None,
        "bwd_gain": gains["backward_gain"][-1] if gains else None,
    }
    record.update(stability_scalars(stability))
    record["marginal_error"] = (
        {"mean": stability["marginal_error_mean"], "max": stability["marginal_error_max"]}
        if stability
        else None
    )
    record["logit_scale"] = (
        {"mean": stability["logit_scale_mean"], "max": stability["logit_scale_max"]}
        if stability and any(v is not None for v in stability["logit_scale_max"])
        else None
    )
    record["time_s"] = round(time_s, 3)
    return record


class SpikeTracker:
    """Counts steps whose loss exceeds ``(1 + threshold)`` x the EMA of the earlier losses, after warmup.

    A non-finite loss after warmup is a spike too, and leaves the EMA as it was. ``ema_step`` is the
    step of the last finite loss in the EMA (None before any, or when restored from a checkpoint of an
    older mhc that did not record it): the summary reports the EMA as the final training loss only
    when it is the final step's (:func:`final_train_loss`).
    """

    def __init__(self, threshold: float, warmup: int, beta: float = 0.95):
        self.threshold, self.warmup, self.beta = threshold, warmup, beta
        self.ema: float | None = None
        self.ema_step: int | None = None
        self.spikes = 0

    def update(self, step: int, loss: float) -> bool:
        """Record the loss of ``step`` (1-based); return whether it is a spike."""
        spike = False
        if not math.isfinite(loss):
            spike = step > self.warmup
        elif self.ema is not None and step > self.warmup and loss > (1 + self.threshold) * self.ema:
            spike = True
        if spike:
            self.spikes += 1
        if math.isfinite(loss):
            self.ema = loss if self.ema is None else self.beta * self.ema + (1 - self.beta) * loss
            self.ema_step = step
        return spike

    def state_dict(self) -> dict:
        """The EMA, the step of its last loss, and the count (saved in checkpoints)."""
        return {"ema": self.ema, "ema_step": self.ema_step, "spikes": self.spikes}

    def load_state_dict(self, s: dict) -> None:
        """Restore what :meth:`state_dict` returned (``ema_step`` None from a checkpoint without it)."""
        self.ema, self.ema_step, self.spikes = s["ema"], s.get("ema_step"), s["spikes"]


def final_train_loss(spikes: SpikeTracker, step: int) -> tuple[float | None, str | None]:
    """The summary's ``final_train_loss`` at final step ``step``, and why it is None when it is.

    The EMA of the training losses counts only when its last loss is the final step's: after a run
    of non-finite losses at the end, the EMA would be that of earlier steps (of an earlier session,
    after a resume), so the summary gives None and the reason instead.
    """
    if spikes.ema is None:
        return None, "no step of the run had a finite training loss"
    if spikes.ema_step is None:
        return None, (
            "the checkpoint this run resumed from does not record which step its training-loss average comes from "
            "(written by an older mhc), and no step since had a finite training loss"
        )
    if spikes.ema_step == step:
        return spikes.ema, None
    span = f"step {step}" if spikes.ema_step + 1 == step else f"steps {spikes.ema_step + 1}-{step}"
    return None, f"{span} had non-finite training losses; the last finite one was at step {spikes.ema_step}"


class Throughput:
    """Tokens per second over the steps after the first three of this process (compilation, caches warm up)."""

    WARMUP_STEPS = 3

    def __init__(self):
        self.start: float | None = None
        self.steps = 0

    def tick(self, steps_done: int, now: float) -> None:
        """Call after each step; ``steps_done`` counts the steps this process has run."""
        if steps_done == self.WARMUP_STEPS:
            self.start, self.steps = now, 0
        elif self.start is not None:
            self.steps += 1

    def tokens_per_s(self, tokens_per_step: int, now: float) -> float | None:
        """The rate so far, or None before any timed step."""
        if self.start is None or self.steps == 0:
            return None
        return self.steps * tokens_per_step / (now - self.start)


class ConvergenceWarningCounter:
    """A context: counts :class:`mhc.ConvergenceWarning` s (for the summary) and shows only the first.

    Other warnings pass through as usual. The filters and ``warnings.showwarning`` are restored on exit.

    Args:
        write: prints a line above the progress bar (``tqdm.write``).
        show: whether this process shows the first warning (rank 0).
    """

    def __init__(self, write, show: bool):
        self.write, self.show = write, show
        self.count = 0
        self._catch = warnings.catch_warnings()

    def __enter__(self) -> ConvergenceWarningCounter:
        self._catch.__enter__()
        self._passed_on = warnings.showwarning
        warnings.simplefilter("always", ConvergenceWarning)
        warnings.showwarning = self._showwarning
        return self

    def __exit__(self, *exc) -> None:
        self._catch.__exit__(*exc)

    def _showwarning(self, message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, ConvergenceWarning):
            self._passed_on(message, category, filename, lineno, file, line)
            return
        self.count += 1
        if self.count == 1 and self.show:
            self.write(f"warning (shown once; the count goes to summary.json): {message}", file=sys.stderr)


class MainProcessLog:
    """``log(msg)``: print on rank 0 (flushed), nothing on the other ranks."""

    def __init__(self, info: DistInfo):
        self.enabled = info.is_main

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)


def _finite_max(values: list) -> float | None:
    """The max of the non-None values; NaN if one is NaN (a diverged model); None if there are none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return float("nan") if any(math.isnan(v) for v in present) else max(present)


def measure_stability(model: nn.Module, input_ids: Tensor) -> tuple[dict | None, dict | None]:
    """The model's composite gains and per-site stability metrics on ``input_ids`` (``[B, S]`` int64).

    Measured in eval mode, every module's train/eval flag restored after; the global random state is
    left as it was.

    Returns:
        ``(gains, stability)``, both None for a model without mHC sites. ``gains`` has the
        per-depth lists ``forward_gain``, ``backward_gain`` (worst token) and ``spectral_norm``
        (:func:`mhc.diagnostics.composite_gains`; NaN from the first diverged depth on: the run
        goes on). ``stability`` has per-site lists, in depth order, of
        :class:`mhc.diagnostics.StabilityReport`'s ``forward_gain_mean``, ``backward_gain_mean``,
        ``marginal_error_mean``, ``marginal_error_max``, ``logit_scale_mean``, ``logit_scale_max``,
        ``spread_mean``, ``spread_min``,
        ``h_res_saturated_entries``, ``h_res_saturated_rows``, ``pre_saturated``, ``post_saturated``.
    """
    if not any(isinstance(m, MHCBlock) for m in model.modules()):
        return None, None
    # In eval mode (dropout would make the figures noisy and draw from the training RNG), each
    # module's flag restored after; the RNG forked besides, so measuring never changes training.
    modes = [(m, m.training) for m in model.modules()]
    devices = [input_ids.device] if input_ids.device.type != "cpu" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=input_ids.device.type):
            model.eval()
            records = collect_sites(model, input_ids=input_ids, use_cache=False)
    finally:
        for module, training in modes:
            module.training = training
    report = report_from_sites(records)
    gains = composite_gains([r.h_res for r in records]).as_dict()
    keys = ("forward_gain_mean", "backward_gain_mean", "marginal_error_mean", "marginal_error_max",
            "logit_scale_mean", "logit_scale_max", "spread_mean", "spread_min", "h_res_saturated_entries",
            "h_res_saturated_rows", "pre_saturated", "post_saturated")  # fmt: skip
    return gains, {k: getattr(report, k) for k in keys}


def stability_scalars(stability: dict | None) -> dict[str, float | None]:
    """The :data:`STABILITY_SCALARS` of a ``stability`` dict (:func:`measure_stability`); all None for None."""
    if not stability:
        return dict.fromkeys(STABILITY_SCALARS)
    pre_post = [max(a, b) if a is not None and b is not None else None
                for a, b in zip(stability["pre_saturated"], stability["post_saturated"])]  # fmt: skip
    return {
        "stream_spread": stability["spread_mean"][-1],
        "h_res_saturation": _finite_max(stability["h_res_saturated_entries"]),
        "h_res_one_hot_rows": _finite_max(stability["h_res_saturated_rows"]),
        "pre_post_saturation": _finite_max(pre_post),
        "marginal_error_max": _finite_max(stability["marginal_error_max"]),
        "h_res_logit_scale": _finite_max(stability["logit_scale_max"]),
    }


def composite_gains_of(model: nn.Module, input_ids: Tensor) -> dict[str, list[float]] | None:
    """Per-depth composite forward/backward gains and spectral norms of the model's ``H_res`` on ``input_ids``.

    None for a model without mHC sites; NaN everywhere for a diverged model (the run goes on).
    """
    return measure_stability(model, input_ids)[0]


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write ``loss.png`` and (with mHC sites) ``gains.png`` of a finished run directory; return their paths.

    Reads ``metrics.jsonl`` and ``summary.json``; draws with :mod:`mhc.train.plots` (matplotlib).
    """
    # matplotlib only here: importing it takes about half a second, which runs with plots=false,
    # ranks other than 0 and `import mhc.train` do not need to spend.
    from .plots import plot_gains, plot_loss

    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    title = f"{summary['variant']} (n={summary['n_streams']})"
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    out = [
        plot_loss(
            train, evals, title=title, unigram_entropy=summary["unigram_entropy"], path=run_dir / "loss.png"
        )
    ]
    gains = summary.get("composite_gains")
    if gains:
        out.append(plot_gains(gains, title=title, step=summary["steps"], path=run_dir / "gains.png"))
    return out
