"""Thin wrapper over the fused CUDA Birkhoff kernels (``csrc/birkhoff.cu``).

:func:`mhc.birkhoff_project` sends CUDA tensors with ``method="newton"``,
``n`` in {4, 8} and dtype float32 / bfloat16 / float16 here; everything else
stays on the PyTorch path (:mod:`mhc.projection.reference`). This module
imports only that reference module (for the shared reporting pieces and the
differentiable backward) and :mod:`mhc._ext.build`, which compiles and loads the
extension.

Operators (registered by the extension, with fake impls and autograd here):

* ``mhc::birkhoff_forward(Tensor R, float tol, int max_iter) -> Tensor``
* ``mhc::birkhoff_forward_info(Tensor R, float tol, int max_iter) -> (T, iterations, error)``
* ``mhc::birkhoff_backward(Tensor T, Tensor grad_T) -> Tensor``
* ``mhc::birkhoff_unconverged(int device, int mode) -> int``

Autograd of ``birkhoff_forward`` is a C++ node (a Python one cost ~150 µs of
host time per forward+backward). Double backward: the backward kernel has no
derivative of its own, so under ``create_graph=True`` the node's backward is
the reference's differentiable
:func:`~mhc.projection.reference.birkhoff_backward` on the same ``T``
(float32, the op ``mhc::birkhoff_backward_graph`` defined here), and second
derivatives come out right; plain backward runs the kernel.

Convergence accounting: the forward kernel adds every matrix that misses
``tol`` after ``max_iter`` iterations, or has no projection (``-inf`` logits
that leave no permutation among the finite ones, design.md §2 "Zero
entries"), to a per-device counter in device memory, with no host sync;
matrices holding NaN or ``+inf`` are not counted. :func:`unconverged_count` reads it (and
syncs); in eager mode the wrapper also polls it without blocking (an
asynchronous copy every ``POLL_EVERY`` calls) and raises a
:class:`~mhc.projection.common.ConvergenceWarning` when it grows.
:func:`reset_convergence_tracking` starts the accounting afresh.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .. import _ext
from .common import ConvergenceWarning, effective_tol, is_traced, newton_report
from .reference import birkhoff_backward

__all__ = [
    "available",
    "extension",
    "fast_forward",
    "supports",
    "project",
    "project_fast",
    "project_no_autograd",
    "poll",
    "unconverged_count",
    "check_convergence",
    "reset_convergence_tracking",
    "set_enabled",
]

SUPPORTED_N = (4, 8)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POLL_EVERY = 64  # eager calls between two non-blocking looks at the counter

_module = None  # the extension's Python module while loaded and enabled (mhc._ext)
fast_forward = None  # its project_or_none while loaded and enabled, else None (see project_fast)
_registered = False  # the fake impls and autograd below, once per process
_calls = 0
_last_warned: dict[int, int] = {}
set_enabled = _ext.set_enabled


def supports(logits: Tensor) -> bool:
    """Whether the fused kernels handle this input (CUDA, n in {4, 8}, fp32/bf16/fp16)."""
    return (
        logits.is_cuda
        and logits.dim() >= 2
        and logits.shape[-1] in SUPPORTED_N
        and logits.shape[-1] == logits.shape[-2]
        and logits.dtype in SUPPORTED_DTYPES
    )


def available() -> bool:
    """Build/load the extension on first call (:func:`mhc._ext.extension`); ``False`` if impossible or switched off."""
    return _ext.extension() is not None


def _use(module) -> None:
    """:func:`mhc._ext.on_change`'s callback: keep the extension's hot path, set up once on first load."""
    global _module, fast_forward, _registered
    if module is not None and not _registered:
        _register()
        module.set_poll(_counter_seen, POLL_EVERY)
        _registered = True
    _module = module
    fast_forward = module.project_or_none if module is not None else None


_LIBRARY: torch.library.Library | None = None  # holds the Python-defined op below (kept alive)


def _graph_backward(T: Tensor, grad_T: Tensor) -> Tensor:
    """The reference's differentiable backward on the kernel's ``T``, for ``create_graph=True``."""
    return birkhoff_backward(T.float(), grad_T.float()).to(T.dtype)


def _register() -> None:
    """Fake (meta) impls, the graph-recording backward, and autograd of ``birkhoff_forward_info``.

    ``birkhoff_forward``'s autograd node is C++ (``csrc/birkhoff.cu``): its
    backward runs the kernel, or, under ``create_graph=True``, the op
    ``mhc::birkhoff_backward_graph`` defined here, whose reference ops
    autograd records (the kernel's result would be a leaf of the new graph,
    and a second derivative silently wrong).
    """
    global _LIBRARY
    _LIBRARY = torch.library.Library("mhc", "FRAGMENT")
    _LIBRARY.define("birkhoff_backward_graph(Tensor T, Tensor grad_T) -> Tensor")
    _LIBRARY.impl("birkhoff_backward_graph", _graph_backward, "CompositeImplicitAutograd")

    @torch.library.register_fake("mhc::birkhoff_forward")
    def _fwd_fake(R, tol, max_iter):
        return R.new_empty(R.shape)

    @torch.library.register_fake("mhc::birkhoff_forward_info")
    def _fwd_info_fake(R, tol, max_iter):
        B = R.shape[0]
        return (
            R.new_empty(R.shape),
            R.new_empty((B,), dtype=torch.int32),
            R.new_empty((B,), dtype=torch.float64),
        )

    @torch.library.register_fake("mhc::birkhoff_backward")
    def _bwd_fake(T, grad_T):
        return T.new_empty(T.shape)

    # return_info=True is for inspection, not hot loops: its autograd stays in Python.
    def _setup(ctx, inputs, output):
        ctx.save_for_backward(output[0])

    def _backward(ctx, grad_T, *_unused):
        (T,) = ctx.saved_tensors
        if grad_T is None:
            return None, None, None
        if torch.is_grad_enabled():
            return _graph_backward(T, grad_T), None, None
        return torch.ops.mhc.birkhoff_backward(T, grad_T.to(T.dtype).contiguous()), None, None

    torch.library.register_autograd("mhc::birkhoff_forward_info", _backward, setup_context=_setup)


def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def unconverged_count(device=None, reset: bool = False) -> int:
    """Matrices that missed ``tol`` on ``device`` since load (or the last reset). Synchronises."""
    if not available():
        return 0
    return int(torch.ops.mhc.birkhoff_unconverged(_device_index(device), 1 if reset else 0))


def check_convergence(device=None) -> int:
    """Read the counter (syncs) and warn if it grew since the last warning; returns it (0 without the extension)."""
    if not available():
        return 0
    count = unconverged_count(device)
    _warn_if_grown(_device_index(device), count)
    return count


def _warn_if_grown(dev: int, count: int) -> None:
    if count > _last_warned.get(dev, 0):
        warnings.warn(
            f"birkhoff_project (CUDA): {count - _last_warned.get(dev, 0)} more matrices missed the "
            f"tolerance on cuda:{dev} ({count} since the counter was reset), or have no doubly stochastic "
            "matrix on their finite entries (-inf logits leaving no permutation; those came back NaN); "
            "use return_info=True to find them",
            ConvergenceWarning,
            stacklevel=4,
        )
        _last_warned[dev] = count


def reset_convergence_tracking(device=None) -> None:
    """Start the convergence accounting of ``device`` (default: the current one) afresh.

    Zeroes its unconverged counter (syncs), forgets what has been warned
    about, so the next growth warns again, and restarts the poll cadence: the
    next non-blocking look comes after :data:`POLL_EVERY` more eager calls.
    For a new phase of a run (and for tests that count exactly).
    """
    global _calls
    if not available():
        return
    dev = _device_index(device)
    torch.ops.mhc.birkhoff_unconverged(dev, 1)
    _last_warned.pop(dev, None)
    _calls = 0
    _module.set_poll(_counter_seen, POLL_EVERY)  # restarts the extension's own count (fast_forward's calls)


def poll(tensor: Tensor) -> None:
    """Non-blocking look at the counter of ``tensor``'s device.

    Every :data:`POLL_EVERY` eager calls, never while a CUDA graph is captured.
    For the calls made from Python (:func:`project`, :func:`project_no_autograd`);
    :data:`fast_forward` counts its own calls in the extension and looks the same
    way, reporting to :func:`_counter_seen`.
    """
    global _calls
    _calls += 1
    if not _calls % POLL_EVERY:
        _look(tensor)


def _counter_seen(dev: int, count: int) -> None:
    """The extension's callback when its look at the counter of ``cuda:dev`` saw ``count > 0``.

    A frame of its own, as ``poll``'s two: ``_warn_if_grown``'s ``stacklevel`` then
    points at the code that called :func:`mhc.birkhoff_project`.
    """
    _warn_if_grown(dev, count)


def _look(tensor: Tensor) -> None:
    """Read the counter value copied at the previous look, start the next copy, and warn if it grew."""
    if torch.cuda.is_current_stream_capturing():
        return
    device = tensor.device
    dev = device.index if device.index is not None else torch.cuda.current_device()
    seen = int(torch.ops.mhc.birkhoff_unconverged(dev, 2))
    if seen > 0:
        _warn_if_grown(dev, seen)


# The CUDA kernel's own dispatch key: a call redispatched to it skips the
# autograd layer (the op's C++ autograd node, csrc/birkhoff.cu).
_KERNEL_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
_TOLERANCES: dict = {}  # (tol, n, dtype) -> effective_tol(...), worked out once per setting


def _effective_tol(tol: float, n: int, dtype: torch.dtype) -> float:
    key = (tol, n, dtype)
    tol_eff = _TOLERANCES.get(key)
    if tol_eff is None:
        if len(_TOLERANCES) >= 1024:
            _TOLERANCES.clear()
        tol_eff = _TOLERANCES[key] = effective_tol(tol, n, dtype)
    return tol_eff


def project_no_autograd(R: Tensor, tol_eff: float, max_iter: int) -> Tensor:
    """The forward kernel on a contiguous CUDA ``[B, n, n]`` input, past the autograd layer.

    For callers that record no graph for the projection (the fused site
    computes its gradient itself). ``tol_eff`` is already
    :func:`~mhc.projection.common.effective_tol`'s. Polls the convergence
    counter like :func:`project`.
    """
    if torch.compiler.is_compiling() or is_traced(R):
        return torch.ops.mhc.birkhoff_forward(R, tol_eff, max_iter)
    T = torch.ops.mhc.birkhoff_forward.default.redispatch(_KERNEL_KEYS, R, tol_eff, max_iter)
    poll(R)
    return T


def extension():
    """The extension's Python module (:func:`mhc._ext.extension`), or ``None`` where unavailable."""
    return _ext.extension()


def project_fast(logits: Tensor, tol: float, max_iter: int) -> Tensor | None:
    """:func:`mhc.birkhoff_project` for checked options, or ``None`` where the CUDA kernels do not take ``logits``.

    ``logits`` must be a plain ``Tensor`` (not a subclass), ``tol`` a finite
    float ``> 0`` and ``max_iter`` an int ``>= 0``. One call of
    :data:`fast_forward`, the extension's ``project_or_none``: it decides
    whether its kernels take ``logits``, picks the autograd node when a graph
    is recorded and polls the convergence counter every :data:`POLL_EVERY`
    calls. ``None`` under ``torch.compile`` (dynamo traces the op instead),
    under functorch transforms, for a forward-mode dual tensor, or while the extension is unavailable.
    :func:`mhc.birkhoff_project` makes the same call inline: at small batches
    its host time is the projection's cost (issue #23).
    """
    if torch.compiler.is_compiling():
        return None
    forward = fast_forward
    if forward is None:
        # Not loaded yet (a CPU tensor must not trigger the build) or switched off.
        if not (logits.is_cuda and available()):
            return None
        forward = fast_forward
        if forward is None:
            return None
    return forward(logits, tol, max_iter)


def project(logits: Tensor, *, tol: float, max_iter: int, return_info: bool):
    """``birkhoff_project`` for inputs where :func:`supports` holds (checked by the caller).

    Without ``return_info`` this is one call of the op, whose autograd node is
    C++: the public projection's host time is what the kernel launch costs,
    plus a few dictionary and attribute reads (issue #23).
    """
    shape = logits.shape
    n = shape[-1]
    tol_eff = _effective_tol(tol, n, logits.dtype)
    R = logits if len(shape) == 3 else logits.reshape(-1, n, n)
    if not return_info:
        T = torch.ops.mhc.birkhoff_forward.default(R, tol_eff, max_iter)
        if not torch.compiler.is_compiling():
            poll(R)
        return T if len(shape) == 3 else T.reshape(shape)

    T, iterations, error = torch.ops.mhc.birkhoff_forward_info(R, tol_eff, max_iter)
    info = newton_report(iterations, error, tol_eff, max_iter, shape[:-2])
    return T.reshape(shape), info


_ext.on_change(_use)
