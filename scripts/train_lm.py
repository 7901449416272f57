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
    python scripts/train_lm.py --resume                        # continue the latest checkpoint
    torchrun --nproc_per_node=2 scripts/train_lm.py --config configs/small_gpu_mhc.yaml [--dist fsdp]

Every config key is also a flag (--max-steps, --variant, --data, --tokenizer, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
try:
    import mhc  # noqa: F401
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(REPO))

from mhc.training import CheckpointError, TrainConfig, load_config, train  # noqa: E402

DEFAULT_CONFIG = REPO / "configs" / "tiny_cpu_mhc.yaml"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete an existing run in the run dir and start over")
    keys = p.add_argument_group("config keys (same as --set KEY=VALUE)")
    for f in dataclasses.fields(TrainConfig):
        keys.add_argument("--" + f.name.replace("_", "-"), dest="key_" + f.name, default=None, metavar="V")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = list(args.set)
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, "key_" + f.name)
        if v is not None:
            overrides.append(f"{f.name}={v}")
    cfg = load_config(args.config, overrides)
    try:
        train(cfg, resume=args.resume, overwrite=args.overwrite)
    except (CheckpointError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
