"""``python -m mhc.train``: the ``mhc-train`` command line (:func:`mhc.train.cli.train_main`).

Also what ``torchrun --nproc_per_node=N -m mhc.train ...`` runs on every rank.
"""

import sys

from .cli import train_main

if __name__ == "__main__":
    sys.exit(train_main(prog="python -m mhc.train"))
