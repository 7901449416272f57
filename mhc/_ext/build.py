"""Build and load the fused CUDA Birkhoff kernels (``mhc/csrc/birkhoff.cu``).

The kernel sources ship inside the package (``mhc/csrc/``, package data of
the wheel and the sdist), so an installed ``mhc`` finds them beside its own
modules, wherever it is installed. The extension is compiled from there on
first use with ``torch.utils.cpp_extension.load`` (ninja; the build goes to
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, never
into the package directory, which may be read-only) and imported as a
Python module. Loading registers the ``torch.ops.mhc.birkhoff_*`` operators
(``TORCH_LIBRARY`` in ``birkhoff.cu``); the module itself holds only the
projection's hot path, ``project_or_none``, which skips torch.ops' argument
parsing.
This is the one place that builds it: :mod:`mhc.projection.cuda` calls
:func:`load`, ``python -m mhc.cuda_build`` builds it ahead of time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from importlib import resources
from pathlib import Path

import torch

EXTENSION_NAME = "mhc_birkhoff_cuda"
SOURCES = ("birkhoff.cu",)
# What the build reads: the translation unit and the headers it includes.
SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
SOURCE_DIR_ENV = "MHC_CSRC_DIR"


def csrc_dir() -> Path:
    """Where the kernel sources live: ``$MHC_CSRC_DIR`` if set, else the installed package's ``csrc/``."""
    env = os.environ.get(SOURCE_DIR_ENV)
    if env:
        return Path(env)
    # files() is the installed package's own directory for a regular install,
    # an editable one and a source checkout alike.
    return Path(str(resources.files("mhc").joinpath("csrc")))


def source_files() -> list[Path]:
    """Every kernel source file under :func:`csrc_dir`, sorted by name (empty if there are none)."""
    root = csrc_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in SOURCE_SUFFIXES)


def build_problem() -> str | None:
    """Why the extension cannot be built here, or ``None`` if it can be tried."""
    if torch.version.cuda is None:
        return "this PyTorch build has no CUDA support"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        return "no CUDA compiler (nvcc) found; set CUDA_HOME"
    missing = [s for s in SOURCES if not (csrc_dir() / s).is_file()]
    if missing:
        return f"kernel sources {missing} not found under {csrc_dir()}"
    return None


def sources_digest() -> str:
    """A short hash of every kernel source file (name and contents).

    ``torch.utils.cpp_extension.load`` versions a cached build by the listed
    sources and the build flags only, so an edited header (``*.cuh``) would
    otherwise reuse a stale build; passing this digest as a define makes any
    change to the sources a new version.
    """
    h = hashlib.sha256()
    for path in source_files():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def load(verbose: bool = False):
    """Compile (if needed) and load the extension; returns its Python module; ``RuntimeError`` when impossible.

    Loading registers the ``torch.ops.mhc`` operators; the module holds the
    one function called without them (``project_or_none``, the projection's
    hot path). Loading twice in one process returns the same module.
    """
    problem = build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    from torch.utils.cpp_extension import load as _load

    return _load(
        name=EXTENSION_NAME,
        sources=[str(csrc_dir() / s) for s in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=[
            "-O3",
            "--expt-relaxed-constexpr",
            "-std=c++17",
            f"-DMHC_SOURCES={sources_digest()}",
        ],
        is_python_module=True,
        verbose=verbose,
    )
