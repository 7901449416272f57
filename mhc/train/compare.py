"""Several finished runs side by side: one table (``compare.md``, ``compare.json``) and one figure (``compare.png``)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .reporting import read_metrics

__all__ = ["write_comparison"]

_HEAD = (
    "| run | variant | n | params | tokens | steps | time (s) | tokens/s | final val loss | loss spikes "
    "| max grad norm | fwd gain @ full depth | bwd gain @ full depth | max fwd / bwd gain over depth "
    "| max H_res marginal error | max H_res logit std | stream spread @ last site "
    "| max H_res / H_pre,post saturation |"
)
_CAPTION = (
    "Loss spike: a step whose training loss exceeds 1.25x the EMA (beta 0.95) of the earlier losses, after warmup "
    "(or is not finite). Gains: max absolute row (forward) / column (backward) sum of the composite "
    "H_res product over all sites, worst token of 2 validation sequences (mhc.diagnostics). Marginal error: the "
    "largest doubly-stochastic deviation |H1 - 1|_1 + |H^T 1 - 1|_1 of one site's H_res at one token. Logit std: the "
    "largest standard deviation of the logits one site's projection turns into H_res, at one token (a truncated "
    "Sinkhorn's marginal error grows with it). Stream spread: "
    "|x - mean stream| / |x| of the streams entering the last site, mean over tokens (0 = the streams collapsed into "
    "one). Saturation: the largest fraction, over sites, of H_res entries (of H_pre or H_post/2: the sigmoid's flat "
    "part) within 1e-3 of 0 or 1."
)


def _fmt_num(v, spec: str) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


def _table_row(r: dict) -> str:
    if r.get("missing"):
        return f"| {r['label']} | (no summary: run missing or unfinished) |" + " |" * (_HEAD.count("|") - 3)
    flag = " (stopped early)" if r.get("stopped_early") else ""
    return (
        f"| {r['label']} | {r['variant']} | {r['n_streams']} | {r['params'] / 1e6:.2f}M | {r['tokens']:,}{flag} | {r['steps']} "
        f"| {r['train_time_s']:.0f} | {_fmt_num(r.get('tokens_per_s'), ',.0f')} | {r['final_val_loss']:.4f} "
        f"| {r['loss_spikes']} | {r['max_grad_norm']:.3g} | {_fmt_num(r.get('fwd_gain_full_depth'), '.4g')} "
        f"| {_fmt_num(r.get('bwd_gain_full_depth'), '.4g')} "
        f"| {_fmt_num(r.get('fwd_gain_max'), '.4g')} / {_fmt_num(r.get('bwd_gain_max'), '.4g')} "
        f"| {_fmt_num(r.get('marginal_error_max'), '.2g')} | {_fmt_num(r.get('h_res_logit_scale'), '.3g')} "
        f"| {_fmt_num(r.get('stream_spread'), '.3g')} "
        f"| {_fmt_num(r.get('h_res_saturation'), '.3g')} / {_fmt_num(r.get('pre_post_saturation'), '.3g')} |"
    )


def _corpus_line(rows: list[dict]) -> str:
    """Which corpus the runs read (``summary.json``'s ``corpus``), and a warning when they differ."""
    corpora = {}
    for r in rows:
        c = r.get("corpus")
        key = c["sha256"] if c else None
        corpora.setdefault(key, (c, []))[1].append(r["label"])
    described = [
        f"{c['source']} ({c['documents']} documents, SHA-256 {c['sha256'][:16]}..., Python {c['python']})" if c
        else "not recorded (summary.json of an older mhc)"
        for c, _ in corpora.values()
    ]  # fmt: skip
    if len(corpora) == 1:
        return f"Corpus: {described[0]}."
    parts = "; ".join(f"{', '.join(labels)}: {d}" for (_, labels), d in zip(corpora.values(), described))
    return f"**The runs read different corpora**, so their losses are not comparable: {parts}."


def _figure_data(records: list[dict], summary: dict) -> dict:
    """One run as :func:`mhc.train.plots.plot_comparison` takes it."""
    return {
        "variant": summary["variant"],
        "train": [r for r in records if r.get("kind") == "train"],
        "eval": [r for r in records if r.get("kind") == "eval"],
        "gains": summary.get("composite_gains"),
        "gains_step": summary.get("steps"),
        "unigram_entropy": summary.get("unigram_entropy"),
    }


def write_comparison(runs: dict[str, str | os.PathLike], out_dir: str | os.PathLike, note: str = "") -> dict:
    """One table (``compare.md``, ``compare.json``) and one figure (``compare.png``) of finished runs.

    Args:
        runs: label -> run directory (each with ``summary.json`` and ``metrics.jsonl``), at least one;
            a run without ``summary.json`` gets a "missing" row and no curves.
        out_dir: where the three files go.
        note: a line printed under the table (e.g. the commands).

    Returns:
        ``{"rows": [summary + label, ...], "markdown": the text of compare.md}``.
    """
    # matplotlib only here, as in reporting.plot_run: half a second to import, not needed by `import mhc.train`.
    from .plots import plot_comparison

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, figure_runs = [], {}
    for label, rd in runs.items():
        rd = Path(rd)
        sp = rd / "summary.json"
        if not sp.is_file():
            rows.append({"label": label, "missing": True})
            figure_runs[label] = {}  # no curves; the figure still says which runs there were
            continue
        s = json.loads(sp.read_text())
        rows.append({"label": label, **s})
        figure_runs[label] = _figure_data(read_metrics(rd / "metrics.jsonl"), s)
    lines = [_HEAD, "|" + "|".join(["---"] * (_HEAD.count("|") - 1)) + "|"] + [_table_row(r) for r in rows]
    ok = [r for r in rows if not r.get("missing")]
    caption = []
    if ok:
        caption.append(
            f"Unigram entropy of the data: {ok[0]['unigram_entropy']:.4f} nats/token ({ok[0]['tokenizer']} tokenizer, "
            f"vocab {ok[0]['vocab_size']}); device: {ok[0]['device']}, {ok[0]['precision']}."
        )
        caption.append(_corpus_line(ok))
    caption.append(_CAPTION)
    if note:
        caption.append(note)
    md = "\n".join(lines) + "\n\n" + "\n\n".join(caption) + "\n"
    (out / "compare.md").write_text(md)
    (out / "compare.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    plot_comparison(figure_runs, path=out / "compare.png")
    return {"rows": rows, "markdown": md}
