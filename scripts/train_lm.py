#!/usr/bin/env python
"""Train a small decoder LM with residual, HC or mHC connections, offline.

With no arguments it trains a tiny mHC model on this Python's own standard
library sources, on the CPU, in a few minutes, and writes runs/tiny_cpu_mhc/
(metrics.jsonl, loss.png, gains.png, checkpoints/, model/ loadable with
from_pretrained).

Examples:
    python scripts/train_lm.py
    python scripts/train_lm.py --config configs/tiny_cpu_hc.yaml --max-steps 200
    python scripts/train_lm.py --config configs/small_gpu_mhc.yaml --set lr=1e-3 --set n_streams=8
    python scripts/train_lm.py --resume                        # continue runs/tiny_cpu_mhc exactly as it was
    python scripts/train_lm.py --resume --run-dir runs/mine    # continue another run, with its own settings
    python scripts/train_lm.py --resume --max-steps 600 --resume-override   # extend a run (recorded in config.yaml)
    torchrun --nproc_per_node=2 scripts/train_lm.py --config configs/small_gpu_mhc.yaml [--dist fsdp]

Every config key is also a flag (--max-steps, --variant, --data, --tokenizer, ...).

--resume continues from the run's latest checkpoint with the settings saved in it; the YAML
config only names the run dir (runs/<config name>) when --run-dir is not given. A flag that
contradicts the run is refused, with the list of keys, unless --resume-override is given.
Never changeable: model shape, seed, data, tokenizer and batch keys. Free to change on resume:
run_dir, cache_dir, threads, progress, plots, stop_at_step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
try:
    import mhc  # noqa: F401
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(REPO))

from mhc.train import (  # noqa: E402
    RESUME_FIXED,
    CheckpointError,
    RunDirLockedError,
    RunDirSetupError,
    TrainConfig,
    load_config,
    resolve_device,
    resume_config,
    train,
)

DEFAULT_CONFIG = REPO / "configs" / "tiny_cpu_mhc.yaml"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the run dir from its latest checkpoint, with the run's own saved settings "
        "(the YAML config only names the run dir); flags that contradict the run are refused",
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
        keys.add_argument("--" + f.name.replace("_", "-"), dest="key_" + f.name, default=None, metavar="V")
    return p.parse_args(argv)


def _overrides(args) -> list[str]:
    out = list(args.set)
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, "key_" + f.name)
        if v is not None:
            out.append(f"{f.name}={v}")
    return out


def build_config(args) -> TrainConfig:
    """The settings to train with: the YAML config and flags, or, with --resume, the run's own and the flags."""
    overrides = _overrides(args)
    if not args.resume:
        return load_config(args.config, overrides)
    given = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip().replace("-", "_") == "run_dir"]
    run_dir = given[-1] if given else load_config(args.config).run_dir  # the YAML only names the run
    saved = resume_config(run_dir, overrides)
    if saved is None:  # nothing saved yet: train() says so and starts from step 0
        return load_config(args.config, overrides)
    return saved


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.resume and args.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: pick one")
        if args.resume_override and not args.resume:
            raise ValueError("--resume-override only applies with --resume")
        cfg = build_config(args)
        resolve_device(cfg.device, int(os.environ.get("WORLD_SIZE", "1")))  # a device that is not here stops now
    except (CheckpointError, ValueError, TypeError, KeyError) as e:  # bad settings: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg, resume=args.resume, overwrite=args.overwrite, resume_override=args.resume_override)
    except (CheckpointError, FileExistsError, RunDirLockedError, RunDirSetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
