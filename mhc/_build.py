"""Build and load the fused CUDA Birkhoff kernels (``csrc/birkhoff.cu``).

The extension is compiled on first use with ``torch.utils.cpp_extension.load``
(ninja, cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) and registers the ``torch.ops.mhc.birkhoff_*``
operators; its Python module holds the fused site's host side
(``csrc/site.cu``). ``python -m mhc.cuda_build`` builds it ahead of time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch

EXTENSION_NAME = "mhc_birkhoff_cuda"
SOURCES = ("birkhoff.cu", "site.cu")


def csrc_dir() -> Path:
    """Where the kernel sources live: ``$MHC_CSRC_DIR`` or ``<repo>/csrc``."""
    env = os.environ.get("MHC_CSRC_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "csrc"


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
    """A short hash of every file under the kernel source directory.

    ``torch.utils.cpp_extension.load`` versions a cached build by the listed
    sources and the build flags only, so an edited header (``*.cuh``) would
    otherwise reuse a stale build; passing this digest as a define makes any
    change to ``csrc/`` a new version.
    """
    h = hashlib.sha256()
    for path in sorted(csrc_dir().glob("*")):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def load(verbose: bool = False):
    """Compile (if needed) and load the extension; raises ``RuntimeError`` when impossible.

    Returns the extension's Python module (the fused site's host side,
    ``csrc/site.cu``); loading it also registers the ``torch.ops.mhc`` operators.
    """
    problem = build_problem()
    if problem is not None:
        raise RuntimeError(problem)
    from torch.utils.cpp_extension import load as _load

    return _load(
        name=EXTENSION_NAME,
        sources=[str(csrc_dir() / s) for s in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-std=c++17", f"-DMHC_SOURCES={sources_digest()}"],
        is_python_module=True,
        verbose=verbose,
    )
