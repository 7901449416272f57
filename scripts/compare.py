#!/usr/bin/env python
"""``mhc-compare`` from a checkout: the command line of :func:`mhc.train.compare.compare_main`.

    python scripts/compare.py                                   # the tiny CPU presets
    python scripts/compare.py --variants residual,hc,mhc,mhc-sk20,mhc-lite  # all five variants
    python scripts/compare.py --preset small_gpu --tokens 300000000 --devices 0,1
    python scripts/compare.py --help                            # every flag

An installed package has the same command as ``mhc-compare``. This script imports the ``mhc`` of
the checkout it lives in (and so do the training processes it starts).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if (REPO / "mhc" / "__init__.py").is_file():  # this checkout's mhc, not another installed one
    sys.path.insert(0, str(REPO))

from mhc.train.compare import compare_main  # noqa: E402


def main(argv=None) -> int:
    """The command line: ``argv`` (default ``sys.argv[1:]``) -> the exit status."""
    return compare_main(argv, prog="scripts/compare.py")


if __name__ == "__main__":
    sys.exit(main())
