#!/usr/bin/env python
"""``mhc-train`` from a checkout: the command line of :func:`mhc.train.cli.train_main`.

    python scripts/train_lm.py                                   # tiny mHC LM on the CPU (preset tiny_cpu_mhc)
    python scripts/train_lm.py --config tiny_cpu_hc --max-steps 200
    python scripts/train_lm.py --help                            # every flag

An installed package has the same command as ``mhc-train`` (and ``python -m mhc.train``). This
script imports the ``mhc`` of the checkout it lives in.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if (REPO / "mhc" / "__init__.py").is_file():  # this checkout's mhc, not another installed one
    sys.path.insert(0, str(REPO))

from mhc.train.cli import train_main  # noqa: E402


def main(argv=None) -> int:
    """The command line: ``argv`` (default ``sys.argv[1:]``) -> the exit status."""
    return train_main(argv, prog="scripts/train_lm.py")


if __name__ == "__main__":
    sys.exit(main())
