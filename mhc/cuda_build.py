"""Build the fused CUDA Birkhoff kernels ahead of time: ``python -m mhc.cuda_build``.

Set ``TORCH_CUDA_ARCH_LIST`` (e.g. ``"9.0"``) to build for GPUs other than the
visible ones, and ``TORCH_EXTENSIONS_DIR`` to choose the cache directory.
"""

from __future__ import annotations

import sys


def main() -> int:
    from . import _build

    problem = _build.build_problem()
    if problem is not None:
        print(f"mhc.cuda_build: cannot build the CUDA kernels: {problem}", file=sys.stderr)
        return 1
    _build.load(verbose=True)
    print("mhc.cuda_build: torch.ops.mhc.birkhoff_forward / birkhoff_backward are built and loadable")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
