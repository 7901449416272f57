"""Several finished runs side by side: one table (``compare.md``, ``compare.json``) and one figure (``compare.png``).

:func:`write_comparison` writes them from run directories; :func:`compare_main` is the command line
(``scripts/compare.py``) that trains the variants first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from .config import VARIANTS, list_presets, load_config
from .data import prepare_data
from .reporting import Throughput, read_metrics

__all__ = ["write_comparison", "compare_main"]

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


# What _table_row and the caption read without a default: a summary.json lacking one (an older mhc's, or
# another file) gets an "unreadable" row instead of stopping the whole table with a KeyError.
_ROW_KEYS = ("variant", "n_streams", "params", "tokens", "steps", "train_time_s", "final_val_loss", "loss_spikes",
             "max_grad_norm", "unigram_entropy", "tokenizer", "vocab_size", "device", "precision")  # fmt: skip


def _table_row(r: dict) -> str:
    if r.get("missing"):
        if r.get("failed"):
            why = f"run failed: {r['failed']}"
        elif r.get("unreadable"):
            why = f"unreadable summary: {r['unreadable']}"
        else:
            why = "no summary: run missing or unfinished"
        why = why.replace("|", "\\|")  # an error message's "|" would split the cell
        return f"| {r['label']} | ({why}) |" + " |" * (_HEAD.count("|") - 3)
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


def _read_summary(path: Path) -> tuple[dict | None, str]:
    """``summary.json`` as a dict, or ``(None, why not)`` for a corrupt file or one lacking :data:`_ROW_KEYS`."""
    try:
        s = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{path}: {type(e).__name__}: {e}"
    if not isinstance(s, dict):
        return None, f"{path}: a JSON {type(s).__name__}, not an object"
    lacking = [k for k in _ROW_KEYS if k not in s]
    if lacking:
        return None, f"{path} lacks {', '.join(lacking)} (written by an older mhc?)"
    return s, ""


def write_comparison(
    runs: dict[str, str | os.PathLike],
    out_dir: str | os.PathLike,
    note: str = "",
    failed: dict[str, str] | None = None,
) -> dict:
    """One table (``compare.md``, ``compare.json``) and one figure (``compare.png``) of finished runs.

    Args:
        runs: label -> run directory (each with ``summary.json`` and ``metrics.jsonl``), at least one;
            a run without ``summary.json`` gets a "missing" row and no curves, one whose ``summary.json``
            is corrupt or lacks a column's key an "unreadable" row naming the file and no curves.
        out_dir: where the three files go.
        note: a line printed under the table (e.g. the commands).
        failed: label -> why that run failed (e.g. its exit status and log); its row says so, with no
            numbers or curves, whatever its folder holds.

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
        if failed and label in failed:
            rows.append({"label": label, "missing": True, "failed": failed[label]})
            figure_runs[label] = {}
            continue
        if not sp.is_file():
            rows.append({"label": label, "missing": True})
            figure_runs[label] = {}  # no curves; the figure still says which runs there were
            continue
        s, why = _read_summary(sp)
        if s is None:
            rows.append({"label": label, "missing": True, "unreadable": why})
            figure_runs[label] = {}
            continue
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


# ----------------------------------------------------------------------------- mhc-compare

COMPARE_DOC = """Train residual, HC and mHC on the same data, seed and token budget; write one table and one plot.

    mhc-compare                                   # the tiny CPU presets
    mhc-compare --variants residual,hc,mhc,mhc-sk20,mhc-lite  # all five variants
    mhc-compare --preset small_gpu --tokens 300000000 --devices 0,1
    mhc-compare --preset small_gpu --target-s 200 # pick the token budget by a short calibration
    mhc-compare --out runs/compare_small_gpu --report-only

Each variant runs as `mhc-train` (`python -m mhc.train`) in its own process (on its own GPU
with --devices; several devices run variants in parallel). The results land in
OUT/<variant>/ (OUT/<config file name>/ with --configs) and OUT/compare.{md,json,png}. A variant
whose folder holds a run from an earlier invocation is refused unless --overwrite; variants run
into the same OUT at different times are merged into one table.

A variant that fails (in the calibration of --target-s or in its run) is reported with its exit
status and log, the others go on, it gets a "run failed" row, and the exit status is 1. A
summary.json that cannot be read gets an "unreadable" row naming the file.
"""

# Throughput times the steps after its first WARMUP_STEPS: a shorter calibration run has no tokens/s.
_MIN_CALIB_STEPS = Throughput.WARMUP_STEPS + 1


def _failure(code: int, log_path: Path) -> str:
    """A failed child's exit status, the last line of its log (its reason, so that it is not only in
    the log) and the log's path."""
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return f"exit {code}: {lines[-1] if lines else '(empty log)'} (log {log_path})"


def _labels(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The configs to run and their labels (the names of their folders in OUT); refuses what cannot run."""
    if args.configs:
        cfgs = list(args.configs)
        labels = [Path(c).stem for c in cfgs]
    else:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        if not names:
            p.error(f"--variants {args.variants!r} names no variant; give some of {','.join(VARIANTS)}")
        unknown = [v for v in names if v not in VARIANTS]
        if unknown:
            p.error(
                f"unknown variant(s) {', '.join(map(repr, unknown))} in --variants; known: {', '.join(VARIANTS)}"
            )
        cfgs = [f"{args.preset}_{v}" for v in names]
        missing = [c for c in cfgs if c not in list_presets()]
        if missing:
            p.error(
                f"no preset {', '.join(map(repr, missing))} for --preset {args.preset!r}; presets: {', '.join(list_presets())}"
            )
        labels = names
    # two configs of one label would run into one folder, the second deleting the first (--overwrite)
    seen = {}
    for c, lab in zip(cfgs, labels):
        if lab in seen:
            p.error(
                f"{seen[lab]!r} and {c!r} both get the label {lab!r} (the config's file name), so they would "
                "run into the same folder; rename one or run them with different --out"
            )
        seen[lab] = c
    if "calibration" in seen:  # OUT/calibration holds the --target-s runs
        p.error(
            f"{seen['calibration']!r} gets the label 'calibration', which OUT/calibration/ has; rename it"
        )
    return cfgs, labels


def _train_command() -> list[str]:
    """How a child process runs ``mhc-train`` with this very ``mhc``: ``python -m mhc.train``."""
    return [sys.executable, "-m", "mhc.train"]


def _child_env() -> dict[str, str]:
    """The environment of a child run: this ``mhc`` first on its path when it is not an installed copy.

    In a checkout run without installing (``scripts/compare.py``), or next to another installed
    ``mhc`` (an editable install of another checkout), the child must import the same package as
    this process; an installed copy in site-packages is found there anyway (and putting
    site-packages on ``PYTHONPATH`` would put it before the standard library).
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    installed = {
        str(Path(p).resolve()) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
    }
    try:
        installed.update(str(Path(p).resolve()) for p in site.getsitepackages())
    except AttributeError:  # virtualenv's old site.py
        pass
    if root not in installed:
        env["PYTHONPATH"] = os.pathsep.join(
            [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
    return env


def _launch(config: str, run_dir: Path, sets: list[str], device: str | None, log_path: Path):
    cmd = [*_train_command(), "--config", str(config), "--run-dir", str(run_dir), "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    env = _child_env()
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    log_path.parent.mkdir(parents=True, exist_ok=True)
    f = open(log_path, "w")
    f.write(
        "$ "
        + " ".join(shlex.quote(c) for c in cmd)
        + (f"  # CUDA_VISIBLE_DEVICES={device}" if device else "")
        + "\n"
    )
    f.flush()
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), f, cmd


def run_all(jobs: list[tuple[str, str, Path, list[str]]], devices: list[str | None]) -> dict[str, int]:
    """Run (label, config, run_dir, sets) jobs, at most one per device at a time; the exit codes by label."""
    pending, running, codes = list(jobs), {}, {}
    free = list(devices)
    while pending or running:
        while pending and free:
            label, cfg, rd, sets = pending.pop(0)
            dev = free.pop(0)
            proc, fh, cmd = _launch(cfg, rd, sets, dev, rd.parent / f"{rd.name}.log")
            print(
                f"[{time.strftime('%H:%M:%S')}] start {label} on {dev or 'default device'}: log {rd.parent / (rd.name + '.log')}",
                flush=True,
            )
            running[label] = (proc, fh, dev)
        time.sleep(1.0)
        for label, (proc, fh, dev) in list(running.items()):
            if proc.poll() is not None:
                fh.close()
                codes[label] = proc.returncode
                free.append(dev)
                del running[label]
                print(f"[{time.strftime('%H:%M:%S')}] done {label}: exit {proc.returncode}", flush=True)
    return codes


def _calibrate(args, out: Path, labels, cfgs, base_sets, devices, failed: dict[str, str]) -> int:
    """The token budget that has the slowest variant train ``args.target_s`` seconds, from short runs.

    A variant whose calibration fails goes into ``failed`` (and is not run again); 0 when none calibrated.
    """
    cal_sets = base_sets + [f"max_steps={args.calib_steps}", "eval_interval=0", "ckpt_interval=0",
                            "plots=false", "max_time_s=0"]  # fmt: skip
    cal = [(lab, c, out / "calibration" / lab, cal_sets) for lab, c in zip(labels, cfgs)]
    codes = run_all(cal, devices)
    tps = {}
    for lab, _, rd, _ in cal:
        log_path = rd.parent / f"{rd.name}.log"
        if codes.get(lab):
            failed[lab] = f"calibration {_failure(codes[lab], log_path)}"
        else:
            sp = rd / "summary.json"
            s, why = _read_summary(sp) if sp.is_file() else (None, f"no {sp}")
            if s and s.get("tokens_per_s"):
                tps[lab] = s["tokens_per_s"]
            else:
                failed[lab] = f"calibration gave no tokens/s ({why or f'none in {sp}'}; log {log_path})"
        if lab in failed:
            print(f"{lab} failed: {failed[lab]}", file=sys.stderr)
    if not tps:
        print("calibration failed for every variant: no token budget, nothing to run", file=sys.stderr)
        return 0
    cfg0 = load_config(cfgs[0], args.set)
    per_step = cfg0.batch_size * cfg0.grad_accum * cfg0.seq_len
    # at least one step: a budget of 0 tokens would leave every run at its config's own budget
    tokens = max(per_step, int(min(tps.values()) * args.target_s) // per_step * per_step)
    print(
        f"calibration tokens/s: {json.dumps({k: round(v) for k, v in tps.items()})} -> token budget {tokens:,}"
        + (f" (without {', '.join(failed)}, which failed)" if failed else ""),
        flush=True,
    )
    (out / "calibration.json").write_text(
        json.dumps({"tokens_per_s": tps, "target_s": args.target_s, "tokens": tokens, "failed": failed})
        + "\n"
    )
    return tokens


def compare_main(argv=None, prog: str = "mhc-compare") -> int:
    """``mhc-compare`` (and ``scripts/compare.py``): train the variants, then write the comparison; the exit status.

    0 when every run finished; 1 when one failed (in calibration or training: reported, with a "run
    failed" row); 2 (argparse's ``SystemExit``) for refused arguments. A ``summary.json`` that cannot
    be read is a warning on stderr and an "unreadable" row.
    """
    p = argparse.ArgumentParser(
        prog=prog, description=COMPARE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset", default="tiny_cpu", help="the presets <preset>_<variant> (default: %(default)s)"
    )
    p.add_argument(
        "--configs",
        nargs="*",
        default=None,
        help="config files or preset names instead of --preset; each one's label (and folder in OUT) is "
        "its file name, which must differ between them",
    )
    p.add_argument(
        "--variants",
        default="residual,hc,mhc",
        help=f"which of the preset's variants to run, comma-separated, of {','.join(VARIANTS)} (default: %(default)s)",
    )
    p.add_argument("--out", default=None, help="output folder (default: runs/compare_<preset>)")
    p.add_argument(
        "--tokens", type=int, default=0, help="token budget for every variant (default: the configs')"
    )
    p.add_argument(
        "--target-s",
        type=float,
        default=0.0,
        help="calibrate: pick the token budget so the slowest variant trains ~this long",
    )
    p.add_argument(
        "--calib-steps",
        type=int,
        default=30,
        help=f"steps of each calibration run of --target-s, at least {_MIN_CALIB_STEPS} (the first "
        f"{Throughput.WARMUP_STEPS} are not timed) (default: %(default)s)",
    )
    p.add_argument(
        "--max-time-s",
        type=float,
        default=0.0,
        help="wall-clock cap per variant (a capped run is flagged in the table)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--devices", default="", help="comma-separated CUDA devices; variants run in parallel, one per device"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override for every variant"
    )
    p.add_argument(
        "--report-only", action="store_true", help="only rebuild the table and plot from OUT/<variant>/"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace runs that OUT/<variant>/ holds from an earlier invocation (default: refuse)",
    )
    args = p.parse_args(argv)
    for flag, value, least, why in (
        ("--tokens", args.tokens, 0, ""),
        ("--target-s", args.target_s, 0, ""),
        ("--max-time-s", args.max_time_s, 0, ""),
        ("--calib-steps", args.calib_steps, _MIN_CALIB_STEPS,
         f" (tokens/s is timed after the first {Throughput.WARMUP_STEPS} steps)"),
    ):  # fmt: skip
        if not value >= least:  # (NaN fails too)
            p.error(f"{flag} must be >= {least}, got {value}{why}")

    cfgs, labels = _labels(p, args)
    out = Path(args.out or f"runs/compare_{args.preset}")
    run_dirs = {lab: out / lab for lab in labels}
    if args.report_only and not any(
        (d / "summary.json").is_file() for d in (out.iterdir() if out.is_dir() else ())
    ):
        p.error(f"--report-only: {out} holds no finished run (no <variant>/summary.json); check --out")
    taken = [str(d) for d in run_dirs.values() if d.exists() and any(d.iterdir())]
    if not args.report_only and taken and not args.overwrite:
        p.error(
            f"{', '.join(taken)} already hold(s) a run from an earlier invocation; pass --overwrite to replace "
            "it, give another --out, or --report-only to rebuild the table"
        )
    failed: dict[str, str] = {}  # label -> why, for the message and the table's row
    if not args.report_only:
        base_sets = list(args.set) + ["progress=false"]
        if args.seed is not None:
            base_sets.append(f"seed={args.seed}")
        if args.max_time_s:
            base_sets.append(f"max_time_s={args.max_time_s}")
        devices = [d.strip() for d in args.devices.split(",") if d.strip()] or [None]
        try:
            first = load_config(cfgs[0], base_sets)
            for c in cfgs[1:]:
                load_config(c, base_sets)  # every config is checked before anything starts
        except (ValueError, TypeError, KeyError) as e:
            p.error(str(e))
        # build the tokenizer and token caches once, before runs start in parallel
        t0 = time.time()
        prepare_data(first)
        print(f"data ready in {time.time() - t0:.0f} s", flush=True)
        tokens = args.tokens
        if args.target_s > 0:
            tokens = _calibrate(args, out, labels, cfgs, base_sets, devices, failed)
        sets = base_sets + ([f"tokens={tokens}", "max_steps=0"] if tokens else [])
        jobs = [(lab, c, run_dirs[lab], sets) for lab, c in zip(labels, cfgs) if lab not in failed]
        codes = run_all(jobs, devices) if jobs else {}
        for label, code in codes.items():
            if code:
                failed[label] = _failure(code, run_dirs[label].parent / f"{run_dirs[label].name}.log")
                print(f"{label} failed ({failed[label]})", file=sys.stderr)
        if failed:
            print(f"failed runs: {', '.join(failed)} (see their .log files)", file=sys.stderr)
    # merge every variant found in OUT (also those of earlier invocations with other --variants), and
    # this invocation's variants without a summary (failed ones), so that each has a row
    found = (
        {
            d.name: d
            for d in sorted(out.iterdir())
            if (d / "summary.json").is_file() and d.name != "calibration"
        }
        if out.is_dir()
        else {}
    )
    if not args.report_only:
        found.update({lab: run_dirs[lab] for lab in labels if lab not in found})
    order = [v for v in VARIANTS if v in found] + [k for k in found if k not in VARIANTS]
    merged = {k: found[k] for k in order} or run_dirs
    cmd = f"{prog} " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    res = write_comparison(merged, out, note=f"Command: `{cmd}`", failed=failed)
    print(res["markdown"])
    print(f"wrote {out / 'compare.md'}, {out / 'compare.json'}, {out / 'compare.png'}")
    unreadable = [r["unreadable"] for r in res["rows"] if r.get("unreadable")]
    for why in unreadable:
        print(f"warning: unreadable summary, its row left empty: {why}", file=sys.stderr)
    return 1 if failed else 0
