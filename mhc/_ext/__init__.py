"""The one loader of mhc's CUDA extension (``mhc/csrc/birkhoff.cu``), for every kernel user.

The extension holds the Birkhoff projection's kernels (:mod:`mhc.projection.cuda`)
and the decode site's token kernels (:mod:`mhc.fused.tokens`). Both ask
:func:`extension` for it; nothing else builds or imports it. The first call
compiles it if needed (:mod:`mhc._ext.build`, about a minute, then cached) and
imports it; where that is impossible it warns once and every caller keeps its
PyTorch or Triton path.

:func:`set_enabled` switches the extension off for the whole process (the
training config's ``fused_projection: false``, or an A/B against the
reference). Modules that keep a fast handle on it register a callback with
:func:`on_change`, called with the module when it becomes usable and with
``None`` when it is switched off.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from . import build

__all__ = ["extension", "set_enabled", "on_change", "build"]

_loaded: bool | None = None  # None: not tried yet
_module: ModuleType | None = None  # the extension's Python module, once loaded
_enabled = True
_lock = threading.Lock()
_callbacks: list[Callable[[ModuleType | None], None]] = []


def extension() -> ModuleType | None:
    """The extension's Python module, built and loaded on first call; ``None`` where unavailable or switched off.

    Loading registers the ``torch.ops.mhc`` operators. A failed build warns
    once (``RuntimeWarning``, naming ``python -m mhc.cuda_build`` for the log)
    and is not retried in this process; a PyTorch without CUDA answers ``None``
    without a word (it has no CUDA tensors for the kernels).
    """
    if not _enabled:
        return None
    if _loaded is None:
        _load()
    return _module


@torch.compiler.disable
def _load() -> None:
    global _loaded, _module
    with _lock:
        if _loaded is not None:
            return
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            # A CPU-only PyTorch has no CUDA tensors to run the kernels on: nothing to warn about.
            _loaded = False
            return
        try:
            module = build.load()
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the PyTorch path"
            _loaded = False
            warnings.warn(
                "mhc: the fused CUDA kernels are unavailable "
                f"({type(exc).__name__}: {exc}); birkhoff_project and the decode site run on the slower "
                "PyTorch and Triton paths for CUDA tensors. Run `python -m mhc.cuda_build` to see the build log.",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        _module = module
        _notify()  # before _loaded: a caller that sees the extension loaded sees its users set up
        _loaded = True


def set_enabled(enabled: bool) -> bool:
    """Allow (``True``, the default) or forbid the CUDA extension; returns the previous setting.

    With ``False``, :func:`extension` answers ``None`` without building
    anything, so :func:`mhc.birkhoff_project` and the fused site keep CUDA
    tensors on the PyTorch Newton projection and the Triton kernels.
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_enabled takes a bool, got {type(enabled).__name__}")
    previous, _enabled = _enabled, enabled
    if previous != enabled:
        _notify()
    return previous


def on_change(callback: Callable[[ModuleType | None], None]) -> None:
    """Call ``callback(module)`` whenever the usable extension changes: loaded, switched off or on again.

    ``module`` is ``None`` while switched off. Called at once if the extension
    is already loaded.
    """
    _callbacks.append(callback)
    if _module is not None:
        callback(_module if _enabled else None)


def _notify() -> None:
    usable = _module if _enabled else None
    for callback in _callbacks:
        callback(usable)
