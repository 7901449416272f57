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
import os
import sys
import tempfile
from pathlib import Path

from .checkpoint import CheckpointError
from .compare import compare_main
from .config import DEFAULT_PRESET, DataError, TrainConfig, key_help, list_presets, load_config
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
succeeding (max_skipped_in_a_row skipped steps in a row); 130 when interrupted (Ctrl-C), after which
--resume continues from the last checkpoint.
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
    if given and args.config != DEFAULT_PRESET:
        print(
            f"note: --resume trains with the settings saved in {run_dir}; --config {args.config} is not read "
            "(flags and --set still apply, as overrides)"
        )
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
    except KeyboardInterrupt:  # Ctrl-C: the run is as resumable as after a kill, so no traceback
        print(
            f"\ninterrupted; continue from the last checkpoint with --resume --run-dir {cfg.run_dir}",
            file=sys.stderr,
        )
        return 130
    return 0
