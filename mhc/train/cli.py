"""The command lines of :mod:`mhc.train`: ``mhc-train`` and ``mhc-compare``.

Both are console scripts of the installed package (``[project.scripts]`` in ``pyproject.toml``);
in a checkout ``scripts/train_lm.py`` and ``scripts/compare.py`` call the same functions, and
``python -m mhc.train`` is ``mhc-train``.

``mhc-train`` (:func:`train_main`; its help is :data:`TRAIN_HELP`) trains one run; ``mhc-compare``
(:func:`compare_main`) trains several variants as separate ``mhc-train`` processes and writes one
table and one figure.

Exit status of ``mhc-train``: 0 when the run finished (or stopped at ``stop_at_step``); 2 for settings, a checkpoint
or a run directory that is refused before training; 1 when training stopped because no step could
succeed (:class:`~mhc.train.loop.TrainingStoppedError`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from .checkpoint import CheckpointError
from .compare import write_comparison
from .config import DEFAULT_PRESET, VARIANTS, DataError, TrainConfig, key_help, list_presets, load_config
from .data import prepare_data
from .distributed import resolve_device
from .loop import TrainingStoppedError, train
from .resume import RESUME_FIXED, resume_config
from .run_dir import RunDirLockedError, RunDirSetupError

__all__ = ["train_main", "compare_main", "build_config", "parse_train_args", "TRAIN_HELP"]

TRAIN_HELP = """Train a small decoder LM with residual, HC or mHC connections, offline.

With no arguments it trains a tiny mHC model on the CPU in a few minutes (the preset tiny_cpu_mhc,
on the built-in generated corpus) and writes runs/tiny_cpu_mhc/ (metrics.jsonl, summary.json,
loss.png, gains.png, checkpoints/, model/ loadable with from_pretrained).

    mhc-train
    mhc-train --config tiny_cpu_hc --max-steps 200
    mhc-train --config small_gpu_mhc --set lr=1e-3 --set n_streams=8
    mhc-train --config my_run.yaml            # a YAML file; its `base:` may name a preset
    mhc-train --list-presets
    mhc-train --resume                        # continue runs/tiny_cpu_mhc exactly as it was
    mhc-train --resume --run-dir runs/mine    # continue another run, with its own settings
    mhc-train --resume --max-steps 600 --resume-override   # extend a run (recorded in config.yaml)
    torchrun --nproc_per_node=2 -m mhc.train --config small_gpu_mhc [--dist fsdp]

Every config key is also a flag (--max-steps, --variant, --data, --tokenizer, ...).

--resume continues from the run's latest checkpoint with the settings saved in it; the config
only names the run dir (runs/<config name>) when --run-dir is not given. A flag that contradicts
the run is refused, with the list of keys, unless --resume-override is given. Never changeable:
model shape, seed, data, tokenizer and batch keys. Free to change on resume: run_dir, cache_dir,
threads, progress, plots, stop_at_step.

Exit status: 0 when the run finished (or stopped at stop_at_step); 2 when settings, a checkpoint
or the run directory are refused before training; 1 when training stopped because no step was
succeeding (max_skipped_in_a_row skipped steps in a row).
"""


# ----------------------------------------------------------------------------- mhc-train


def parse_train_args(argv=None, prog: str = "mhc-train") -> argparse.Namespace:
    """The arguments of ``mhc-train``: ``--config``, ``--set``, the run flags, and one flag per config key."""
    p = argparse.ArgumentParser(
        prog=prog, description=TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=DEFAULT_PRESET,
                   help="a YAML config file, or a preset's name (default: %(default)s; see --list-presets)")  # fmt: skip
    p.add_argument("--list-presets", action="store_true", help="print the presets shipped with mhc and exit")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the run dir from its latest checkpoint, with the run's own saved settings "
        "(the config only names the run dir); flags that contradict the run are refused",
    )
    p.add_argument(
        "--resume-override",
        action="store_true",
        help="with --resume: apply the given flags that differ from the run's settings from here on (e.g. a longer "
        "--max-steps, another --lr); config.yaml records each change. These keys can never change: "
        + ", ".join(RESUME_FIXED),
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run outputs (checkpoints/, model/, metrics.jsonl, summary.json, config.yaml, plots) "
        "in the run dir and start over; other files there are kept",
    )
    keys = p.add_argument_group("config keys (same as --set KEY=VALUE)")
    for f in dataclasses.fields(TrainConfig):
        keys.add_argument(
            "--" + f.name.replace("_", "-"),
            dest="key_" + f.name,
            default=None,
            metavar="V",
            help=key_help(f.name),
        )
    return p.parse_args(argv)


def _overrides(args: argparse.Namespace) -> list[str]:
    out = list(args.set)
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, "key_" + f.name)
        if v is not None:
            out.append(f"{f.name}={v}")
    return out


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The settings to train with: the config and flags, or, with --resume, the run's own and the flags."""
    overrides = _overrides(args)
    if not args.resume:
        return load_config(args.config, overrides)
    given = [
        o.split("=", 1)[1].strip()
        for o in overrides
        if o.split("=", 1)[0].strip().replace("-", "_") == "run_dir"
    ]
    run_dir = given[-1] if given else load_config(args.config).run_dir  # the config only names the run
    saved = resume_config(run_dir, overrides)
    if saved is None:  # nothing saved yet: train() says so and starts from step 0
        return load_config(args.config, overrides)
    return saved


def check_run_dir_creatable(run_dir: Path) -> None:
    """``ValueError`` unless ``run_dir`` is a folder or can be made one (not under a file, not in ``/proc``),
    so that such a mistake stops before training as one line; nothing is left behind."""
    existing = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--run-dir {run_dir}: {existing} is a file, not a folder")
    if existing != run_dir.absolute():
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".mhc-probe-", dir=existing))
        except OSError as e:
            raise ValueError(
                f"--run-dir {run_dir}: cannot create a folder in {existing} ({e.strerror or e})"
            ) from None


def train_main(argv=None, prog: str = "mhc-train") -> int:
    """``mhc-train`` (and ``scripts/train_lm.py``, ``python -m mhc.train``): parse, check, train; the exit status."""
    args = parse_train_args(argv, prog)
    if args.list_presets:
        print("\n".join(list_presets()))
        return 0
    try:
        if args.resume and args.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: pick one")
        if args.resume_override and not args.resume:
            raise ValueError("--resume-override only applies with --resume")
        cfg = build_config(args)
        resolve_device(
            cfg.device, int(os.environ.get("WORLD_SIZE", "1"))
        )  # a device that is not here stops now
        check_run_dir_creatable(Path(cfg.run_dir))
    except (CheckpointError, ValueError, TypeError, KeyError) as e:  # bad settings: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg, resume=args.resume, overwrite=args.overwrite, resume_override=args.resume_override)
    except (CheckpointError, DataError, FileExistsError, RunDirLockedError, RunDirSetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStoppedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- mhc-compare

_COMPARE_DOC = """Train residual, HC and mHC on the same data, seed and token budget; write one table and one plot.

    mhc-compare                                   # the tiny CPU presets
    mhc-compare --variants residual,hc,mhc,mhc-sk20,mhc-lite  # all five variants
    mhc-compare --preset small_gpu --tokens 300000000 --devices 0,1
    mhc-compare --preset small_gpu --target-s 200 # pick the token budget by a short calibration
    mhc-compare --out runs/compare_small_gpu --report-only

Each variant runs as `mhc-train` (`python -m mhc.train`) in its own process (on its own GPU
with --devices; several devices run variants in parallel). The results land in
OUT/<variant>/ and OUT/compare.{md,json,png}. A variant whose folder holds a run from an earlier
invocation is refused unless --overwrite; variants run into the same OUT at different times are
merged into one table.
"""


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


def compare_main(argv=None, prog: str = "mhc-compare") -> int:
    """``mhc-compare`` (and ``scripts/compare.py``): train the variants, then write the comparison; the exit status."""
    p = argparse.ArgumentParser(
        prog=prog, description=_COMPARE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset", default="tiny_cpu", help="the presets <preset>_<variant> (default: %(default)s)"
    )
    p.add_argument(
        "--configs", nargs="*", default=None, help="config files or preset names instead of --preset"
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
    p.add_argument("--calib-steps", type=int, default=30)
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
    for flag, value, least in (("--tokens", args.tokens, 0), ("--target-s", args.target_s, 0),
                               ("--max-time-s", args.max_time_s, 0), ("--calib-steps", args.calib_steps, 1)):  # fmt: skip
        if not value >= least:  # (NaN fails too)
            p.error(f"{flag} must be >= {least}, got {value}")

    if args.configs:
        cfgs = list(args.configs)
        labels = [Path(c).stem for c in cfgs]
    else:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
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
            cal = [
                (
                    lab,
                    c,
                    out / "calibration" / lab,
                    base_sets
                    + [
                        f"max_steps={args.calib_steps}",
                        "eval_interval=0",
                        "ckpt_interval=0",
                        "plots=false",
                        "max_time_s=0",
                    ],
                )
                for lab, c in zip(labels, cfgs)
            ]
            run_all(cal, devices)
            tps = {}
            for lab, _, rd, _ in cal:
                s = json.loads((rd / "summary.json").read_text())
                tps[lab] = s["tokens_per_s"]
            slowest = min(tps.values())
            cfg0 = load_config(cfgs[0], args.set)
            per_step = cfg0.batch_size * cfg0.grad_accum * cfg0.seq_len
            tokens = int(slowest * args.target_s) // per_step * per_step
            print(
                f"calibration tokens/s: {json.dumps({k: round(v) for k, v in tps.items()})} -> token budget {tokens:,}",
                flush=True,
            )
            (out / "calibration.json").write_text(
                json.dumps({"tokens_per_s": tps, "target_s": args.target_s, "tokens": tokens}) + "\n"
            )
        sets = base_sets + ([f"tokens={tokens}", "max_steps=0"] if tokens else [])
        codes = run_all([(lab, c, run_dirs[lab], sets) for lab, c in zip(labels, cfgs)], devices)
        failed = {k: v for k, v in codes.items() if v}
        for label in failed:  # the child's reason, so that it is not only in its log
            log_path = run_dirs[label].parent / f"{run_dirs[label].name}.log"
            lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
            print(
                f"{label} failed (exit {failed[label]}): {lines[-1] if lines else '(empty log)'}",
                file=sys.stderr,
            )
        if failed:
            print(f"failed runs: {failed} (see their .log files)", file=sys.stderr)
    else:
        failed = {}
    # merge every variant found in OUT (also those of earlier invocations with other --variants)
    found = (
        {
            d.name: d
            for d in sorted(out.iterdir())
            if (d / "summary.json").is_file() and d.name != "calibration"
        }
        if out.is_dir()
        else {}
    )
    order = [v for v in VARIANTS if v in found] + [k for k in found if k not in VARIANTS]
    merged = {k: found[k] for k in order} or run_dirs
    cmd = f"{prog} " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    res = write_comparison(merged, out, note=f"Command: `{cmd}`")
    print(res["markdown"])
    print(f"wrote {out / 'compare.md'}, {out / 'compare.json'}, {out / 'compare.png'}")
    return 1 if failed else 0
