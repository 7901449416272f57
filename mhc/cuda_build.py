"""Build the fused CUDA Birkhoff kernels ahead of time: ``python -m mhc.cuda_build``.

Without an ahead-of-time build the kernels are compiled on first CUDA use
(about a minute) and cached. Set ``TORCH_CUDA_ARCH_LIST`` (e.g. ``"9.0"``) to
build for GPUs other than the visible ones, and ``TORCH_EXTENSIONS_DIR`` to
choose the cache directory.

``python -m mhc.cuda_build --sources`` builds nothing: it prints where the
kernel sources are (the installed package's ``csrc/`` directory, or
``$MHC_CSRC_DIR``) and each source file, and says whether a build could be
tried here. The same facts are available from Python as
:func:`source_dir`, :func:`source_files` and :func:`build_problem`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._ext import build as _build

__all__ = ["source_dir", "source_files", "build_problem", "main"]


def source_dir() -> Path:
    """The directory the kernels are built from: ``$MHC_CSRC_DIR``, else ``<installed mhc>/csrc``."""
    return _build.csrc_dir()


def source_files() -> list[Path]:
    """The kernel sources (``*.cu``, ``*.cuh``, ``*.cpp``, ``*.h``) in :func:`source_dir`, sorted."""
    return _build.source_files()


def build_problem() -> str | None:
    """Why the kernels cannot be built here (no CUDA torch, no nvcc, missing sources), or ``None``."""
    return _build.build_problem()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mhc.cuda_build", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument(
        "--sources", action="store_true", help="print the kernel source directory and files; build nothing"
    )
    args = parser.parse_args(argv)

    problem = build_problem()
    if args.sources:
        print(f"kernel source directory: {source_dir()}")
        for path in source_files():
            print(f"  {path.name}")
        print(f"build: {'possible' if problem is None else 'not possible: ' + problem}")
        missing = [s for s in _build.SOURCES if not (source_dir() / s).is_file()]
        return 1 if missing else 0
    if problem is not None:
        print(f"mhc.cuda_build: cannot build the CUDA kernels: {problem}", file=sys.stderr)
        return 1
    _build.load(verbose=True)
    print("mhc.cuda_build: torch.ops.mhc.birkhoff_forward / birkhoff_backward are built and loadable")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
