#!/usr/bin/env python
"""Does an exact H_res matter? Train five variants x several seeds at one token budget; table and plots.

    python scripts/study_exactness.py --target-s 300   # one GPU, all runs at once; the slowest trains ~300 s
    python scripts/study_exactness.py --tokens 3000000 --jobs 8          # a fixed budget, 8 runs at a time
    python scripts/study_exactness.py --smoke --out /tmp/s --runs /tmp/r  # the pipeline on the CPU, seconds
    python scripts/study_exactness.py --config small_gpu_mhc --seeds 0 --jobs 1 --calibrate-only  # tokens/s each
    python scripts/study_exactness.py --report-only                       # README.md + plots from OUT
    python scripts/study_exactness.py --report-only --merge b1 b2         # batches (same --tokens!) into OUT
    python scripts/study_exactness.py --deepseek-gap   # DeepSeek-V4's 20-round vs exact H_res on one site (CPU)

Each run is scripts/train_lm.py in its own process with the preset study_exactness and --set
variant/seed (n_streams=1 for residual); up to --jobs run at once on one device. Run folders go to
--runs; OUT gets results.json (a record per run), curves.json (the plots' series), study.json (the
command, budget, wall time), each run's metrics/summary/config/log under OUT/runs/, README.md, PNGs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
try:
    import mhc  # noqa: F401
except ImportError:  # a source checkout without installing
    sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mhc import MHCBlock, MHCForCausalLM  # noqa: E402
from mhc.hf.deepseek_v4 import gap_table  # noqa: E402
from mhc.train import load_config, prepare_data, read_metrics  # noqa: E402
from mhc.train.config import VARIANTS  # noqa: E402
from mhc.train.plots import variant_colors  # noqa: E402
from mhc.train.reporting import Throughput  # noqa: E402

TRAIN = REPO / "scripts" / "train_lm.py"
CONFIG = "study_exactness"  # a preset (mhc/train/presets/)
DEFAULT_TITLE = "Does an exact H_res matter? (issue 24)"
# Slowest first (most kernels per site on the PyTorch path), so the longest runs start at once.
LAUNCH_ORDER = ("mhc-sk20", "mhc-lite", "hc", "mhc", "residual")
RECORD_KEYS = ("variant", "seed", "params", "tokens", "final_val_loss", "max_grad_norm", "loss_spikes", "fwd_gain",
               "bwd_gain", "hres_marginal_err_max", "hres_marginal_err_start", "hres_logit_scale_max",
               "hres_logit_scale_start")  # fmt: skip
TABLE_KEYS = (
    "final_val_loss",
    "max_grad_norm",
    "loss_spikes",
    "fwd_gain",
    "bwd_gain",
    "hres_marginal_err_max",
    "hres_logit_scale_max",
)
SMOKE_CONFIG = "study_exactness_smoke"


def _jobs(variants: list[str], seeds: list[int], runs: Path) -> list[tuple[str, int, Path]]:
    order = [v for v in LAUNCH_ORDER if v in variants] + [v for v in variants if v not in LAUNCH_ORDER]
    return [(v, s, runs / v / f"seed{s}") for v in order for s in seeds]


def _run_sets(variant: str, seed: int, common: list[str]) -> list[str]:
    return [
        f"variant={variant}",
        f"seed={seed}",
        *(["n_streams=1"] if variant == "residual" else []),
        *common,
    ]


def run_parallel(
    jobs: list[tuple[str, int, Path]], config: str | Path, common: list[str], parallel: int
) -> dict[str, int]:
    """Run every (variant, seed, run_dir) as scripts/train_lm.py, ``parallel`` processes at a time; exit codes by run."""
    pending, running, codes = list(jobs), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            variant, seed, run_dir = pending.pop(0)
            cmd = [
                sys.executable,
                str(TRAIN),
                "--config",
                str(config),
                "--run-dir",
                str(run_dir),
                "--overwrite",
            ]
            for s in _run_sets(variant, seed, common):
                cmd += ["--set", s]
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            log = open(run_dir.parent / f"{run_dir.name}.log", "w")
            log.write("$ " + shlex.join(cmd) + "\n")
            log.flush()
            label = f"{variant}/seed{seed}"
            running[label] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
            print(f"[{time.strftime('%H:%M:%S')}] start {label}", flush=True)
        time.sleep(0.5)
        for label, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                codes[label] = proc.returncode
                del running[label]
                print(f"[{time.strftime('%H:%M:%S')}] done {label}: exit {proc.returncode}", flush=True)
    return codes


# ----------------------------------------------------------------------------- collecting a run


def _finite_max(values) -> float | None:
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return max(finite) if finite else None


def _finite_mean(values) -> float | None:
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.fmean(finite) if finite else None


def collect_run(variant: str, seed: int, run_dir: Path) -> tuple[dict, dict]:
    """``(record, curves)`` of a finished run; raises ``FileNotFoundError`` if it did not finish."""
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in metrics if r.get("kind") == "train"]
    evals = [r for r in metrics if r.get("kind") == "eval"]
    gains = summary.get("composite_gains") or {}
    # per-site {"mean": [...], "max": [...]} over the tokens of the trainer's diagnostic windows, per evaluation
    marginal = [(r["step"], r["marginal_error"]) for r in evals if r.get("marginal_error")]
    final_marginal = marginal[-1][1] if marginal else None
    # the same for the spread of the H_res logits (absent from runs made before it was logged)
    scale = [(r["step"], r["logit_scale"]) for r in evals if r.get("logit_scale")]
    record = {
        "variant": variant,
        "seed": seed,
        **{k: summary[k] for k in ("params", "tokens", "final_val_loss", "max_grad_norm", "loss_spikes")},
        # the composite over every prefix depth of the final model, its worst depth (the paper's Amax gain)
        "fwd_gain": summary.get("fwd_gain_max"),
        "bwd_gain": summary.get("bwd_gain_max"),
        "hres_marginal_err_max": _finite_max(final_marginal["max"]) if final_marginal else None,
        # the first evaluation: the initial model (step 0) in runs made since it is evaluated
        "hres_marginal_err_start": _finite_max(marginal[0][1]["max"]) if marginal else None,
        "hres_marginal_err_start_step": marginal[0][0] if marginal else None,
        "hres_logit_scale_max": _finite_max(scale[-1][1]["max"]) if scale else None,
        "hres_logit_scale_start": _finite_max(scale[0][1]["max"]) if scale else None,
        # context: the full-depth gains (final, and their largest over the evaluations), the run itself
        **{k: summary.get(k) for k in ("fwd_gain_full_depth", "bwd_gain_full_depth")},
        "fwd_gain_full_depth_max_over_evals": _finite_max(r.get("fwd_gain") for r in evals),
        "bwd_gain_full_depth_max_over_evals": _finite_max(r.get("bwd_gain") for r in evals),
        **{
            k: summary.get(k)
            for k in (
                "steps",
                "skipped_steps",
                "stopped_early",
                "train_time_s",
                "tokens_per_s",
                "device",
                "precision",
            )
        },  # fmt: skip
    }
    curves = {
        "variant": variant,
        "seed": seed,
        "train": [[r["step"], r["tokens"], r["loss"], r.get("grad_norm")] for r in train],
        "eval": [[r["step"], r["tokens"], r["val_loss"]] for r in evals],
        "gains": {k: gains.get(k) for k in ("forward_gain", "backward_gain")},
        "marginal_final": final_marginal,
        "marginal_over_training": [
            [step, _finite_max(m["max"]), statistics.fmean(m["mean"]) if m["mean"] else None]
            for step, m in marginal
        ],  # fmt: skip
        "logit_scale_over_training": [
            [step, _finite_max(m["max"]), _finite_mean(m["mean"])] for step, m in scale
        ],  # fmt: skip
    }
    return record, curves


@torch.no_grad()
def loss_by_projection(run_dir: Path, windows: torch.Tensor, device: str) -> dict[str, float]:
    """Validation loss (float32) of a trained Newton or Sinkhorn model as trained and with the other projection.

    Same weights, same logits: only how ``H_res`` is made from them changes (``block.projection`` is
    assignable between these two), so the gap is what the truncation itself does to a trained model.
    """
    model = MHCForCausalLM.from_pretrained(run_dir / "model").to(device).eval()
    losses = {}
    for projection in ("newton", "sinkhorn"):
        for block in model.modules():
            if isinstance(block, MHCBlock):
                block.projection = projection
        total = 0.0
        for ids in windows.to(device).split(16):
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            total += float(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"))
        losses[projection] = total / (windows.shape[0] * (windows.shape[1] - 1))
    return losses


def collect_all(jobs, out: Path, windows: torch.Tensor, device: str) -> tuple[list[dict], list[dict]]:
    records, curves = [], []
    for variant, seed, run_dir in jobs:
        try:
            rec, cur = collect_run(variant, seed, run_dir)
        except FileNotFoundError as e:
            print(f"skipped {variant}/seed{seed}: the run did not finish ({e.filename})", file=sys.stderr)
            continue
        if variant in ("mhc", "mhc-sk20"):
            rec["val_loss_by_projection"] = loss_by_projection(run_dir, windows, device)
        records.append(rec)
        curves.append(cur)
        keep = out / "runs" / variant / f"seed{seed}"
        keep.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "metrics.jsonl", "config.yaml"):
            shutil.copy2(run_dir / name, keep / name)
        log = run_dir.parent / f"{run_dir.name}.log"
        if log.is_file():
            shutil.copy2(log, keep / "train.log")
    return records, curves


# ----------------------------------------------------------------------------- the report


def _mean_std(values: list) -> str:
    """``mean ± std`` (sample std) of the finite values, ``–`` for none."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return "–"
    mean, std = statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)
    return f"{mean:.4g} ± {std:.2g}" if std else f"{mean:.4g}"


def summary_table(records: list[dict]) -> str:
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in records)]
    head = "| variant | seeds | params | tokens | " + " | ".join(TABLE_KEYS) + " |"
    rows = [head, "|" + "---|" * (4 + len(TABLE_KEYS))]
    for v in variants:
        rs = [r for r in records if r["variant"] == v]
        tokens = sorted({r["tokens"] for r in rs})
        capped = " (capped)" if any(r.get("stopped_early") for r in rs) else ""
        cells = [
            v,
            str(len(rs)),
            f"{rs[0]['params'] / 1e6:.2f}M",
            "/".join(f"{t:,}" for t in tokens) + capped,
        ]
        cells += [_mean_std([r[k] for r in rs]) for k in TABLE_KEYS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_all(curves: list[dict], out: Path) -> list[str]:
    """loss_curves.png, gain_vs_depth.png and (with mhc-sk20 runs) sk20_marginal_error.png in ``out``; their names."""
    variants = [v for v in VARIANTS if any(c["variant"] == v for c in curves)]
    colors = variant_colors(variants)
    written = []

    def finish(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        written.append(name)

    def band(ax, series: list[tuple[list, list]], color: str, label: str) -> None:
        if not series:
            return
        length = min(len(x) for x, _ in series)
        x = np.asarray(series[0][0][:length], dtype=float)
        ys = np.asarray([y[:length] for _, y in series], dtype=float)
        ax.plot(x, np.nanmean(ys, 0), color=color, label=f"{label} ({len(series)} seeds)")
        if len(series) > 1:
            ax.fill_between(x, np.nanmin(ys, 0), np.nanmax(ys, 0), color=color, alpha=0.2, linewidth=0)

    fig, (ax_val, ax_train) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in variants:
        cs = [c for c in curves if c["variant"] == v]
        band(ax_val, [([e[1] for e in c["eval"]], [e[2] for e in c["eval"]]) for c in cs], colors[v], v)
        band(ax_train, [([t[1] for t in c["train"]], [t[2] for t in c["train"]]) for c in cs], colors[v], v)
    for ax, what in ((ax_val, "validation loss"), (ax_train, "training loss")):
        ax.set_xlabel("tokens")
        ax.set_ylabel(f"{what} (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_val.set_title("validation loss: mean over seeds, band = min..max")
    ax_train.set_title("training loss (logged steps)")
    finish(fig, "loss_curves.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key in zip(axes, ("forward_gain", "backward_gain")):
        for v in variants:
            cs = [c for c in curves if c["variant"] == v and c["gains"].get(key)]
            band(ax, [(list(range(1, len(c["gains"][key]) + 1)), c["gains"][key]) for c in cs], colors[v], v)
        ax.set_yscale("log")
        ax.set_xlabel("depth (sites)")
        ax.set_ylabel(f"composite {key.replace('_', ' ')} (worst token)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("composite gain of H_res over depth, final models")
    finish(fig, "gain_vs_depth.png")

    scaled = [
        v for v in variants if any(c["variant"] == v and c.get("logit_scale_over_training") for c in curves)
    ]
    if scaled:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for v in scaled:
            cs = [c for c in curves if c["variant"] == v and c.get("logit_scale_over_training")]
            band(ax, [([e[0] for e in c["logit_scale_over_training"]], [e[1] for e in c["logit_scale_over_training"]])
                      for c in cs], colors[v], v)  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel("std of the H_res logits (worst site and token)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        ax.set_title("spread of the logits projected to H_res over training")
        finish(fig, "logit_scale.png")

    sk = [c for c in curves if c["variant"] == "mhc-sk20"]
    if any(c["marginal_over_training"] for c in sk) or any(c["marginal_final"] for c in sk):
        fig, (ax_t, ax_d) = plt.subplots(1, 2, figsize=(12, 4.5))
        for i, c in enumerate(sk):
            color = f"C{i}"
            pts = [(s, m, a) for s, m, a in c["marginal_over_training"] if m is not None]
            if pts:
                ax_t.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=color,
                    marker=".",
                    label=f"seed {c['seed']}: max",
                )
                ax_t.plot([p[0] for p in pts], [p[2] for p in pts], color=color, linestyle="--",
                          label=f"seed {c['seed']}: mean")  # fmt: skip
            if c["marginal_final"]:
                ax_d.plot(range(1, len(c["marginal_final"]["max"]) + 1), c["marginal_final"]["max"], color=color,
                          marker=".", label=f"seed {c['seed']}")  # fmt: skip
        for ax in (ax_t, ax_d):
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
            ax.set_ylabel("‖H1−1‖₁+‖Hᵀ1−1‖₁ of H_res")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        ax_t.set_xlabel("step")
        ax_t.set_title("mhc-sk20: marginal error over training (max / mean over sites and tokens)")
        ax_d.set_xlabel("depth (sites)")
        ax_d.set_title("mhc-sk20: worst token per site, final model")
        finish(fig, "sk20_marginal_error.png")
    return written


def merge_batches(batches: list[Path], out: Path) -> None:
    """Merge the results, curves and run files of several OUT folders into ``out`` (later ones win per run)."""
    records, curves, metas = {}, {}, []
    for batch in batches:
        if not (batch / "results.json").is_file():
            raise SystemExit(f"--merge: {batch / 'results.json'} does not exist")
        for r in json.loads((batch / "results.json").read_text()):
            records[r["variant"], r["seed"]] = r
        if (batch / "curves.json").is_file():
            for c in json.loads((batch / "curves.json").read_text()):
                curves[c["variant"], c["seed"]] = c
        if (batch / "study.json").is_file():
            metas.append(json.loads((batch / "study.json").read_text()))
        if (batch / "runs").is_dir() and batch.resolve() != out.resolve():
            shutil.copytree(batch / "runs", out / "runs", dirs_exist_ok=True)
    budgets = {r["tokens"] for r in records.values()}
    if len(budgets) > 1:
        print(f"warning: the merged runs trained different token budgets: {sorted(budgets)}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(list(records.values()), indent=1) + "\n")
    (out / "curves.json").write_text(json.dumps(list(curves.values())) + "\n")
    meta = {"command": "\n".join(m["command"] for m in metas if m.get("command")),
            "config": metas[0].get("config") if metas else None,
            "tokens": sorted(budgets)[0] if len(budgets) == 1 else sorted(budgets),
            "wall_s": sum(m.get("wall_s") or 0 for m in metas), "total_s": sum(m.get("total_s") or 0 for m in metas),
            "parallel": "/".join(str(m.get("parallel")) for m in metas), "batches": len(batches),
            **{k: metas[0].get(k) for k in ("title", "tokenizer") if metas and metas[0].get(k)}}  # fmt: skip
    (out / "study.json").write_text(json.dumps(meta, indent=1) + "\n")


def start_end_table(records: list[dict]) -> list[str]:
    """H_res's marginal error and logit spread at the first evaluation against the last, per projected variant."""
    keys = (
        "hres_marginal_err_start",
        "hres_marginal_err_max",
        "hres_logit_scale_start",
        "hres_logit_scale_max",
    )
    variants = [
        v for v in VARIANTS if any(r["variant"] == v and r.get("hres_logit_scale_max") for r in records)
    ]
    if not variants:
        return []
    steps = sorted(
        {r.get("hres_marginal_err_start_step") for r in records if r["variant"] in variants} - {None}
    )
    lines = [f"H_res at the first evaluation (step {'/'.join(map(str, steps))}) and the last, worst site and token "
             "(mean ± std over seeds): the marginal error ‖H1−1‖₁+‖Hᵀ1−1‖₁ and the standard deviation of the "
             "logits the projection turns into H_res:", "",
             "| variant | marginal error, first | marginal error, last | logit std, first | logit std, last |",
             "|---|---|---|---|---|"]  # fmt: skip
    for v in variants:
        rs = [r for r in records if r["variant"] == v]
        lines.append(f"| {v} | " + " | ".join(_mean_std([r.get(k) for r in rs]) for k in keys) + " |")
    return [*lines, ""]


def swap_table(records: list[dict]) -> list[str]:
    rows = [(r["variant"], r["val_loss_by_projection"]) for r in records if r.get("val_loss_by_projection")]
    if not rows:
        return []
    lines = ["Trained models evaluated with each projection of the same logits (float32, the validation windows "
             "of the runs; mean ± std over seeds):", "", "| trained as | val loss, Newton | val loss, 20-round "
             "Sinkhorn | Sinkhorn − Newton |", "|---|---|---|---|"]  # fmt: skip
    for v in ("mhc", "mhc-sk20"):
        ls = [x for name, x in rows if name == v]
        if ls:
            cells = [_mean_std([x[k] for x in ls]) for k in ("newton", "sinkhorn")]
            lines.append(
                f"| {v} | {cells[0]} | {cells[1]} | {_mean_std([x['sinkhorn'] - x['newton'] for x in ls])} |"
            )
    return [*lines, ""]


def _repo_path(path: Path) -> str:
    """``path`` relative to the checkout when it lies inside it (the committed page), else as given."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def write_report(out: Path) -> str:
    """README.md and the plots from OUT/results.json and OUT/curves.json; returns the README text."""
    records = json.loads((out / "results.json").read_text())
    curves = json.loads((out / "curves.json").read_text()) if (out / "curves.json").is_file() else []
    meta = json.loads((out / "study.json").read_text()) if (out / "study.json").is_file() else {}
    plots = plot_all(curves, out) if curves else []
    devices = sorted({str(r.get("device")) for r in records})
    lines = [
        f"# {meta.get('title') or DEFAULT_TITLE}",
        "",
        "Five ways to connect the residual streams, trained at one token budget with several seeds: "
        "`residual`, `hc` (unconstrained), `mhc` (exact Newton projection), `mhc-sk20` (the mHC paper's and "
        "DeepSeek-V4's 20-round Sinkhorn, not exactly doubly stochastic) and `mhc-lite` (a softmax over the n! "
        "permutation matrices, exact by construction). See docs/design.md for the variants.",
        "",
        f"Runs: {len(records)} on {', '.join(devices)}; config `{meta.get('config', 'configs/study_exactness.yaml')}`.",
        "",
        "## Results (mean ± std over seeds)",
        "",
        summary_table(records),
        "",
        f"Columns: `final_val_loss` in nats/token ({meta.get('tokenizer') or 'byte'} tokens); `max_grad_norm` the largest gradient norm "
        "before clipping; `loss_spikes` steps whose loss exceeded 1.25 x the running EMA after warmup; "
        "`fwd_gain` / `bwd_gain` the composite H_res gain (max row / column abs sum) at its worst depth, "
        "final model, worst token; `hres_marginal_err_max` ‖H1−1‖₁+‖Hᵀ1−1‖₁ of H_res, worst site and token "
        "of the final evaluation; `hres_logit_scale_max` the standard deviation of the logits a site's "
        "projection turns into H_res, worst site and token of the final evaluation. Per-run values: "
        "`results.json`; series: `curves.json`; each run's metrics, summary and config: `runs/`.",
        "",
        *start_end_table(records),
        *swap_table(records),
        "## Plots",
        "",
        *[f"![{p}]({p})" for p in plots],
        "",
        "## Commands",
        "",
        "```",
        meta.get("command", "python scripts/study_exactness.py ..."),
        f"python scripts/study_exactness.py --report-only --out {_repo_path(out)}",
        "```",
        "",
    ]
    if meta.get("wall_s"):
        lines.insert(lines.index("## Commands") + 2,
                     f"Wall time of the runs: {meta['wall_s']:.0f} s, {meta.get('parallel')} at a time "
                     f"({meta.get('total_s', 0):.0f} s with data preparation and calibration); token budget "
                     f"{meta.get('tokens') or 'from the config'}.\n")  # fmt: skip
    text = "\n".join(lines)
    (out / "README.md").write_text(text)
    return text


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default=CONFIG, help="base config: a YAML file or a preset's name (default: %(default)s)"
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: %(default)s)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: %(default)s)")
    p.add_argument(
        "--out",
        default=str(REPO / "docs" / "studies" / "exactness"),
        help="results folder (default: %(default)s)",
    )
    p.add_argument(
        "--runs",
        default="runs/study_exactness",
        help="run folders, checkpoints included (default: %(default)s)",
    )
    p.add_argument("--jobs", type=int, default=0, help="runs at once (default: all)")
    p.add_argument("--tokens", type=int, default=0, help="token budget of every run (default: the config's)")
    p.add_argument("--target-s", type=float, default=0.0,
                   help="calibrate: run every job --calib-steps steps at once, then pick the budget so the slowest trains ~this long")  # fmt: skip
    p.add_argument("--calib-steps", type=int, default=30)
    p.add_argument("--calibrate-only", action="store_true",
                   help="only the calibration: every job's tokens/s over --calib-steps steps, --jobs at a time, "
                        "to OUT/calibration.json (plans a study's budget and how many runs share a device)")  # fmt: skip
    p.add_argument(
        "--max-time-s", type=float, default=0.0, help="wall-clock cap per run (a capped run is flagged)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"the preset {SMOKE_CONFIG} on the CPU: tests the pipeline in seconds",
    )
    p.add_argument("--title", default=DEFAULT_TITLE, help="the results page's heading (default: %(default)s)")
    p.add_argument("--report-only", action="store_true", help="only rebuild README.md and the plots from OUT")
    p.add_argument(
        "--deepseek-gap", action="store_true", help="print mhc.hf.deepseek_v4.gap_table() (CPU) and exit"
    )
    p.add_argument("--merge", nargs="+", default=[], metavar="DIR",
                   help="with --report-only: OUT folders of several batches to merge into --out first "
                        "(a later folder's run replaces an earlier one of the same variant and seed)")  # fmt: skip
    args = p.parse_args(argv)
    if args.deepseek_gap:
        print(gap_table())
        return 0

    out = Path(args.out)
    if (args.target_s > 0 or args.calibrate_only) and args.calib_steps <= Throughput.WARMUP_STEPS:
        p.error(f"--calib-steps must exceed the {Throughput.WARMUP_STEPS} warm-up steps a run's tokens/s leaves out, "
                f"got {args.calib_steps}")  # fmt: skip
    if args.merge and not args.report_only:
        p.error("--merge goes with --report-only")
    if args.report_only:
        if args.merge:
            merge_batches([Path(d) for d in args.merge], out)
        if not (out / "results.json").is_file():
            p.error(f"{out / 'results.json'} does not exist: run the study first")
        print(write_report(out))
        return 0

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(map(repr, unknown))}; known: {', '.join(VARIANTS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    config, runs = SMOKE_CONFIG if args.smoke else args.config, Path(args.runs)
    common = [*args.set, "progress=false", "plots=false"]
    if args.max_time_s:
        common.append(f"max_time_s={args.max_time_s}")
    try:  # every run's settings are checked before anything starts
        cfgs = [load_config(config, _run_sets(v, s, common)) for v in variants for s in seeds]
    except (ValueError, TypeError) as e:
        p.error(str(e))
    jobs = _jobs(variants, seeds, runs)
    parallel = args.jobs or len(jobs)
    t0 = time.time()
    build = None
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if "mhc" in variants and device == "cuda":
        # The Newton runs use the CUDA Birkhoff kernels, compiled on first use (about a minute): start
        # the build now; a run that needs them before it is done waits on the build's lock.
        build = subprocess.Popen([sys.executable, "-m", "mhc.cuda_build"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.STDOUT)  # fmt: skip
    data, _, _ = prepare_data(cfgs[0])  # tokenizer and token caches once, before the runs start in parallel
    tokens, rates = args.tokens, {}
    if args.target_s > 0 or args.calibrate_only:
        cal_sets = common + [f"max_steps={args.calib_steps}", "tokens=0", "eval_interval=0", "max_time_s=0"]
        cal_jobs = [(v, s, runs / "calibration" / v / f"seed{s}") for v, s, _ in jobs]
        run_parallel(cal_jobs, config, cal_sets, parallel)
        summaries = {f"{v}/seed{s}": rd / "summary.json" for v, s, rd in cal_jobs}
        rates = {
            k: json.loads(f.read_text()).get("tokens_per_s") for k, f in summaries.items() if f.is_file()
        }
        rates = {k: r for k, r in rates.items() if r}
        if not rates:
            print(
                "calibration failed: no run reported its speed (see the logs under --runs/calibration)",
                file=sys.stderr,
            )
            return 1
        if args.calibrate_only:
            out.mkdir(parents=True, exist_ok=True)
            (out / "calibration.json").write_text(json.dumps(
                {"tokens_per_s": rates, "calib_steps": args.calib_steps, "parallel": parallel, "config": str(config),
                 "sets": common, "device": device},
                indent=1) + "\n")  # fmt: skip
            print(
                f"calibration tokens/s ({parallel} at a time): {json.dumps({k: round(v) for k, v in rates.items()})}"
            )
            return 0
        per_step = cfgs[0].batch_size * cfgs[0].grad_accum * cfgs[0].seq_len
        tokens = max(per_step, int(min(rates.values()) * args.target_s) // per_step * per_step)
        print(
            f"calibration tokens/s: {json.dumps({k: round(v) for k, v in rates.items()})} -> budget {tokens:,}",
            flush=True,
        )
    sets = common + ([f"tokens={tokens}", "max_steps=0"] if tokens else [])
    if build is not None and build.wait() != 0:
        print(
            "warning: `python -m mhc.cuda_build` failed; the mhc runs use the PyTorch projection",
            file=sys.stderr,
        )
    t_runs = time.time()
    codes = run_parallel(jobs, config, sets, parallel)
    wall = time.time() - t_runs
    failed = {k: v for k, v in codes.items() if v}
    if failed:
        print(f"failed runs: {failed} (their logs: {runs}/<variant>/<seed>.log)", file=sys.stderr)

    out.mkdir(parents=True, exist_ok=True)
    windows = data.val_windows(cfgs[0].eval_batches * cfgs[0].batch_size)
    records, curves = collect_all(jobs, out, windows, device)
    (out / "results.json").write_text(
        json.dumps([{k: r[k] for k in RECORD_KEYS} | r for r in records], indent=1) + "\n"
    )
    (out / "curves.json").write_text(json.dumps(curves) + "\n")
    command = "python scripts/study_exactness.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    meta = {"command": command, "config": os.path.relpath(config, REPO) if Path(config).is_absolute() else str(config),
            "tokens": tokens, "parallel": parallel, "wall_s": wall, "total_s": time.time() - t0,
            "failed": failed, "calibration_tokens_per_s": rates, "target_s": args.target_s, "title": args.title,
            "tokenizer": cfgs[0].tokenizer}  # fmt: skip
    (out / "study.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(write_report(out))
    print(
        f"wrote {out} ({len(records)} runs, {wall:.0f} s of training wall time, {time.time() - t0:.0f} s in all)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
