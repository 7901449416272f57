"""Deliberate bugs ("mutations") that the test suite must catch, applied by monkeypatching.

``MHC_MUTATION=<name> python -m pytest <selection>`` runs the suite with one of
them: tests/conftest.py calls :func:`activate_from_environment` from
``pytest_configure``, before any test module imports mhc. No file is edited.
``python tests/mutation_probe.py`` runs every mutation on the tests that
should catch it and says which survived (docs/CONTRIBUTING.md).

A mutation patches public names: functions and methods without a leading
underscore, of mhc and of the libraries it calls. Functions bound by
``from x import name`` elsewhere are replaced there too (:func:`replace`).
None of the mutations below needs a private name of mhc.

This module imports neither mhc nor transformers at import time: one
mutation must be in place before mhc is first imported, and the others
import what they patch when they are applied.
"""

from __future__ import annotations

import contextvars
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

VARIABLE = "MHC_MUTATION"


@dataclass(frozen=True)
class Mutation:
    """One deliberate bug.

    Attributes:
        name: what ``MHC_MUTATION`` names it by.
        bug: the bug in words.
        apply: patches it in (called once, in the pytest process).
        selection: pytest arguments (files, ``-k``) of the tests that must
            catch it; kept small, since the probe runs each selection alone.
            A path with ``*`` is a glob, from the repository root.
        catching_tests: the tests meant to catch it, for the probe's table.
    """

    name: str
    bug: str
    apply: Callable[[], None]
    selection: tuple[str, ...]
    catching_tests: str


MUTATIONS: dict[str, Mutation] = {}
_active: list[str] = []


def mutation(name: str, bug: str, selection: tuple[str, ...], catching_tests: str):
    """Register the decorated function as the mutation ``name``."""

    def register(apply: Callable[[], None]) -> Callable[[], None]:
        if name in MUTATIONS:
            raise ValueError(f"mutation {name!r} is registered twice")
        MUTATIONS[name] = Mutation(name, bug, apply, selection, catching_tests)
        return apply

    return register


def activate(name: str) -> None:
    """Apply the mutation ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    if name not in MUTATIONS:
        raise ValueError(f"unknown mutation {name!r}; known: {', '.join(MUTATIONS)}")
    if _active:
        raise RuntimeError(f"mutation {_active[0]!r} is already applied; one per process")
    MUTATIONS[name].apply()
    _active.append(name)


def activate_from_environment() -> None:
    """Apply the mutation that ``MHC_MUTATION`` names, if it is set."""
    name = os.environ.get(VARIABLE)
    if name:
        activate(name)


def active() -> str | None:
    """The name of the applied mutation, or ``None``."""
    return _active[0] if _active else None


def replace(owner, name: str, replacement, *, in_modules: tuple[str, ...] = ("mhc",)) -> None:
    """Set ``owner.name = replacement``, and every binding of the old object in loaded modules.

    ``from mhc.streams import reduce_streams`` binds the function in the
    importing module too; those bindings are replaced in the loaded modules
    whose names start with one of ``in_modules``. Modules imported later bind
    the replacement.
    """
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(in_modules):
            continue
        for key, value in list(vars(module).items()):
            if value is original:
                setattr(module, key, replacement)


class BrokenImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A ``sys.meta_path`` finder under which importing ``module`` raises ``ImportError(message)``.

    As a module whose own imports fail would (a Triton without a name it uses,
    a typo in an import line).
    """

    def __init__(self, module: str, message: str):
        self.module, self.message = module, message

    def find_spec(self, fullname, path, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == self.module else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(self.message, name=self.module)


BROKEN_KERNELS_MESSAGE = "simulated by tests/mutations.py: cannot import name 'libdevice'"


@mutation(
    "fused_kernels_import_broken",
    "importing mhc.fused.kernels raises ImportError while Triton imports",
    ("tests/test_fused_block.py", "-k", "bad_inputs"),
    "test_fused_block.py (collection: fused.available() raises)",
)
def _fused_kernels_import_broken():
    if "mhc" in sys.modules:
        raise RuntimeError("fused_kernels_import_broken must be applied before mhc is imported")
    sys.meta_path.insert(0, BrokenImport("mhc.fused.kernels", BROKEN_KERNELS_MESSAGE))


_CHECKPOINT_OPTIONS = (
    "use_reentrant",
    "context_fn",
    "determinism_check",
    "debug",
    "preserve_rng_state",
    "early_stop",
)


def _run_directly(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint``'s signature, but it only calls ``function``: nothing is recomputed."""
    for option in _CHECKPOINT_OPTIONS:
        kwargs.pop(option, None)
    return function(*args, **kwargs)


@mutation(
    "checkpoint_noop",
    "torch.utils.checkpoint.checkpoint calls the function directly (MHCBlock recompute and HF checkpointing)",
    ("tests/test_block.py", "tests/test_hf.py", "-k", "recompute or gradient_checkpointing"),
    "test_block.py / test_hf.py -k 'recompute or gradient_checkpointing'",
)
def _checkpoint_noop():
    import torch.utils.checkpoint

    replace(torch.utils.checkpoint, "checkpoint", _run_directly, in_modules=("mhc", "transformers"))


@mutation(
    "hf_gradient_checkpointing_noop",
    "model.gradient_checkpointing_enable() installs a checkpoint function that recomputes nothing",
    ("tests/test_hf.py", "-k", "gradient_checkpointing"),
    "test_hf.py -k gradient_checkpointing",
)
def _hf_gradient_checkpointing_noop():
    # What transformers' gradient_checkpointing_enable() wraps in a partial.
    import transformers.modeling_utils

    transformers.modeling_utils.checkpoint = _run_directly


_RNG_SETTERS = (
    ("torch", "set_rng_state"),
    ("torch.random", "set_rng_state"),
    ("torch.cuda", "set_rng_state"),
    ("random", "setstate"),
    ("numpy.random", "set_state"),
)


def _ignored_when_mhc_calls(setter):
    def setter_or_noop(*args, **kwargs):
        # Only mhc's own calls (its training resume) are dropped, wherever in mhc they live; torch's
        # (checkpoint's RNG replay, fork_rng) still work. sys._getframe is CPython's frame accessor.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "mhc" or caller.startswith("mhc."):
            return None
        return setter(*args, **kwargs)

    return setter_or_noop


@mutation(
    "rng_not_restored_on_resume",
    "torch/CUDA/numpy/random RNG setters do nothing when mhc calls them (a resumed run keeps the fresh RNG)",
    ("tests/test_training*.py", "-k", "resume_reproduces"),
    "test_training*.py -k resume_reproduces",
)
def _rng_not_restored_on_resume():
    import importlib

    for module_name, name in _RNG_SETTERS:
        module = importlib.import_module(module_name)
        setattr(module, name, _ignored_when_mhc_calls(getattr(module, name)))


@mutation(
    "reduce_streams_low_precision",
    "mhc.reduce_streams accumulates in the streams' dtype (a bf16 running sum) instead of float32",
    ("tests/test_streams.py",),
    "test_streams.py",
)
def _reduce_streams_low_precision():
    import torch

    import mhc.streams

    original = mhc.streams.reduce_streams

    def reduce_streams(x, weights=None):
        original(x, weights)  # its checks and errors, so that only the precision differs
        n = x.shape[-2]
        w = x.new_full((n,), 1.0 / n) if weights is None else weights.to(x.dtype)
        total = torch.zeros_like(x[..., 0, :])
        for i in range(n):
            total = total + w[..., i, None] * x[..., i, :]  # rounded to x.dtype at every step
        return total

    replace(mhc.streams, "reduce_streams", reduce_streams)


@mutation(
    "birkhoff_backward_sign_flipped",
    "mhc.projection.birkhoff_backward returns the negated gradient (PyTorch path)",
    ("tests/test_projection.py::test_gradcheck_float64[4]",),
    "test_projection.py::test_gradcheck_float64[4]",
)
def _birkhoff_backward_sign_flipped():
    import mhc.projection

    original = mhc.projection.birkhoff_backward
    replace(mhc.projection, "birkhoff_backward", lambda T, grad_T: -original(T, grad_T))


@mutation(
    "identity_init_leaves_phi_random",
    'MHCBlock.reset_parameters draws φ at random under init="identity" (as for "paper")',
    ("tests/test_block.py", "-k", "bit_exact_on_identical_streams"),
    "test_block.py -k bit_exact_on_identical_streams",
)
def _identity_init_leaves_phi_random():
    import torch

    from mhc import MHCBlock

    original = MHCBlock.reset_parameters

    def reset_parameters(self, names=None):
        names = None if names is None else list(names)
        original(self, names)
        if self.mode != "residual" and self.init == "identity" and (names is None or "phi" in names):
            with torch.no_grad():
                torch.nn.init.normal_(self.phi, std=self.phi.shape[1] ** -0.5)

    MHCBlock.reset_parameters = reset_parameters


@mutation(
    "expand_streams_interleaved",
    "mhc.expand_streams interleaves the copies ([C·n] viewed as [n, C]) instead of stacking n copies",
    ("tests/test_streams.py",),
    "test_streams.py",
)
def _expand_streams_interleaved():
    import mhc.streams

    original = mhc.streams.expand_streams

    def expand_streams(h, n):
        original(h, n)  # its checks and errors, so that only the layout differs
        return h.repeat_interleave(n, dim=-1).reshape(*h.shape[:-1], n, h.shape[-1])

    replace(mhc.streams, "expand_streams", expand_streams)


_without_b_res = contextvars.ContextVar("without_b_res", default=False)


@mutation(
    "b_res_dropped",
    "H_res is projected from α·z alone: the b_res bias is left out (PyTorch path and fused site)",
    ("tests/test_block.py", "-k", "all_parameters_get_gradients"),
    "test_block.py -k all_parameters_get_gradients",
)
def _b_res_dropped():
    import torch
    from torch import nn

    import mhc.fused
    from mhc import MHCBlock

    original = MHCBlock.coefficients

    class Coefficients(nn.Module):
        """``block.coefficients`` as a module call, so that functional_call can swap ``block.b_res``."""

        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return self.block.coefficients(x)

    def coefficients(self, x):
        if self.mode == "residual" or _without_b_res.get():
            return original(self, x)
        token = _without_b_res.set(True)
        try:
            zeros = {"block.b_res": torch.zeros_like(self.b_res, requires_grad=False)}
            return torch.func.functional_call(Coefficients(self), zeros, (x,))
        finally:
            _without_b_res.reset(token)

    MHCBlock.coefficients = coefficients
    # The fused backend: every public function of mhc.fused that takes b_res gets zeros instead.
    for name, function in list(vars(mhc.fused).items()):
        if name.startswith("_") or not inspect.isfunction(function) or function.__module__ != "mhc.fused":
            continue
        signature = inspect.signature(function)
        if "b_res" in signature.parameters:
            setattr(mhc.fused, name, _with_zero_b_res(function, signature))


def _with_zero_b_res(function, signature):
    import torch

    def without_b_res(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["b_res"] = torch.zeros_like(bound.arguments["b_res"]).detach()
        return function(*bound.args, **bound.kwargs)

    return without_b_res


@mutation(
    "marginal_error_zeros",
    "mhc.marginal_error returns zeros (every matrix looks converged)",
    ("tests/test_projection.py", "-k", "unconverged_matrices_are_reported or kl_projection"),
    "test_projection.py -k 'unconverged_matrices_are_reported or kl_projection'",
)
def _marginal_error_zeros():
    import torch

    import mhc.projection

    def marginal_error(T):
        return torch.zeros(T.shape[:-2], dtype=torch.float64, device=T.device)

    replace(mhc.projection, "marginal_error", marginal_error)


@mutation(
    "tol_ignored",
    "mhc.projection.effective_tol ignores the tol it is given (always the default 1e-6)",
    ("tests/test_projection.py", "-k", "float64_stays_float64"),
    "test_projection.py -k float64_stays_float64",
)
def _tol_ignored():
    import mhc.projection

    original = mhc.projection.effective_tol
    replace(mhc.projection, "effective_tol", lambda tol, n, dtype: original(1e-6, n, dtype))


@mutation(
    "rms_norm_hooks_ignored",
    "mhc.hf.branch.is_llama_rms_norm accepts a norm with forward hooks (the token kernels would skip them)",
    ("tests/test_fused_norm.py", "-k", "recognised"),
    "test_fused_norm.py -k recognised",
)
def _rms_norm_hooks_ignored():
    import mhc.hf.branch

    original = mhc.hf.branch.is_llama_rms_norm

    def ignoring_hooks(norm):
        forward, pre = norm._forward_hooks, norm._forward_pre_hooks
        norm._forward_hooks, norm._forward_pre_hooks = {}, {}
        try:
            return original(norm)
        finally:
            norm._forward_hooks, norm._forward_pre_hooks = forward, pre

    replace(mhc.hf.branch, "is_llama_rms_norm", ignoring_hooks, in_modules=("mhc", "test_fused_norm"))


@mutation(
    "normed_input_ignored",
    "MHCDecoderLayer.site_branch runs the norm on u itself when given the normed input",
    ("tests/test_fused_norm.py", "-k", "normed_input"),
    "test_fused_norm.py -k normed_input",
)
def _normed_input_ignored():
    import mhc.hf

    original = mhc.hf.MHCDecoderLayer.site_branch

    def site_branch(self, index, u, normed_input=None, **layer_inputs):
        return original(self, index, u, **layer_inputs)

    mhc.hf.MHCDecoderLayer.site_branch = site_branch
