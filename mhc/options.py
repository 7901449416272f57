"""The options of an mHC site, checked in one place.

:class:`MHCOptions` is what :class:`mhc.MHCBlock` runs by and what
:class:`mhc.MHCConfig` (and the training config) store as plain fields; its
``__post_init__`` checks every value through :func:`check_options`, which also
checks the structural sizes (``hidden_size``, ``n_streams``, ``layer_index``)
that belong to a block, not to its options.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "MHCOptions",
    "MODES",
    "INITS",
    "PROJECTIONS",
    "OPTION_NAMES",
    "check_option",
    "check_options",
    "close_option",
    "reject_unknown_options",
    "check_int",
    "check_real",
    "check_non_negative",
]

MODES = ("mhc", "hc", "residual")
INITS = ("identity", "paper")
PROJECTIONS = ("newton", "sinkhorn", "lite")


def _integer(name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass; True streams or layer index is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _real(name: str, value: Any, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be {'finite and > 0' if positive else 'finite'}, got {value}")
    return value


def _non_negative(name: str, value: Any) -> float:
    value = _real(name, value, positive=False)
    if value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


# The single-value rules the options use, for the package's public functions whose arguments are
# not options (an ``n``, an ``eps``, a ``diagonal``): the same types accepted, the same messages.
check_int = _integer
"""``check_int(name, value, minimum)``: an ``int`` (not a ``bool``) ``>= minimum``; ``TypeError`` / ``ValueError``."""
check_real = _real
"""``check_real(name, value, positive)``: a finite real (``> 0`` if ``positive``), as ``float``."""
check_non_negative = _non_negative
"""``check_non_negative(name, value)``: a finite real ``>= 0``, as ``float``."""


# How each option of an mHC site is checked; also the list of the options there are.
_OPTION_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "hidden_size": lambda k, v: _integer(k, v, 1),
    "n_streams": lambda k, v: _integer(k, v, 1),
    "mode": lambda k, v: _choice(k, v, MODES),
    "init": lambda k, v: _choice(k, v, INITS),
    "layer_index": lambda k, v: _integer(k, v, 0),
    "alpha_init": lambda k, v: _real(k, v, positive=False),
    "norm_eps": lambda k, v: _real(k, v, positive=True),
    "projection": lambda k, v: _choice(k, v, PROJECTIONS),
    "tol": lambda k, v: _real(k, v, positive=True),
    "sinkhorn_iters": lambda k, v: _integer(k, v, 1),
    "fused": _flag,
    "recompute": _flag,
    "keep_streams_every": lambda k, v: _integer(k, v, 1),
    # A block's own epsilons (MHCBlock keywords, not MHCOptions fields): the DeepSeek-V4 form sets them.
    "pre_eps": _non_negative,
    "sinkhorn_eps": _non_negative,
}
OPTION_NAMES = tuple(_OPTION_CHECKS)


def close_option(name: str, known: Iterable[str]) -> str | None:
    """The known option ``name`` most likely misspells (``difflib``, case-insensitive), or ``None``."""
    by_lower = {k.lower(): k for k in known}
    match = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.8)
    return by_lower[match[0]] if match else None


def reject_unknown_options(names: Iterable[str], known: Iterable[str], owner: str) -> None:
    """Raise ``TypeError`` for the first of ``names`` (keyword arguments given to ``owner``) not in ``known``."""
    known = tuple(known)
    for name in names:
        if name not in known:
            guess = close_option(name, known)
            hint = f"; did you mean {guess!r}?" if guess else f"; its options are {', '.join(known)}"
            raise TypeError(f"{owner} got an unknown option {name!r}{hint}")


def check_options(**options: Any) -> dict[str, Any]:
    """Check mHC site options by name; return them normalised (ints as ``int``, reals as ``float``).

    Any subset of ``hidden_size``, ``n_streams``, ``layer_index``,
    ``pre_eps``, ``sinkhorn_eps`` (a block's, see :class:`mhc.MHCBlock`) and the
    fields of :class:`MHCOptions`. Integers must be ints (not floats, not
    bools): ``hidden_size``, ``n_streams`` and ``sinkhorn_iters`` ``>= 1``,
    ``layer_index >= 0``. ``tol`` and ``norm_eps`` are finite and ``> 0``,
    ``pre_eps`` and ``sinkhorn_eps`` finite and ``>= 0``, ``alpha_init``
    finite; ``fused`` and ``recompute`` are bools; ``keep_streams_every`` an
    int ``>= 1``.

    Raises:
        TypeError: an unknown option (naming the closest known one) or a value of the wrong type.
        ValueError: a value out of range or not among the choices.
    """
    reject_unknown_options(options, OPTION_NAMES, "mHC options")
    return {name: _OPTION_CHECKS[name](name, value) for name, value in options.items()}


def check_option(option: str, value: Any, *, name: str | None = None) -> Any:
    """Check one value exactly as :func:`check_options` checks ``option``; return it normalised.

    For a function whose argument is an mHC option under another name (e.g.
    :func:`mhc.mixing.sinkhorn_h_res`'s ``iters`` is ``sinkhorn_iters``): the
    same rule as :class:`mhc.MHCBlock`'s, with errors naming ``name``
    (default: ``option``) and the value.

    Raises:
        TypeError: ``option`` is not an option, or ``value`` has the wrong type.
        ValueError: ``value`` is out of range or not among the choices.
    """
    reject_unknown_options((option,), OPTION_NAMES, "check_option")
    return _OPTION_CHECKS[option](option if name is None else name, value)


def coefficient_dtype() -> torch.dtype:
    """The dtype new mHC parameters (φ, α, the biases, learned reduce weights) are made in.

    float32, or ``torch.get_default_dtype()`` where that is wider (float64 for gradcheck). Never
    narrower: transformers sets the default dtype to bf16 or fp16 while it builds a model loaded with
    ``dtype=``, and in bf16 an AdamW step at small learning rates leaves α and the biases unchanged.
    """
    return torch.promote_types(torch.get_default_dtype(), torch.float32)


@dataclasses.dataclass(frozen=True)
class MHCOptions:
    """How an mHC site computes; shared by :class:`mhc.MHCBlock`, :class:`mhc.MHCConfig` and the trainer.

    Every value is checked (and numbers normalised to ``int`` / ``float``)
    when the object is made, so an ``MHCOptions`` that exists is valid.

    Attributes:
        mode: ``"mhc"`` (doubly stochastic ``H_res``, the default), ``"hc"``
            (unconstrained hyper-connections) or ``"residual"`` (no
            parameters; ``x_i + F(mean_i x_i)``).
        init: ``"identity"`` (default: ``φ = 0``, so identical streams give
            ``x + F(x)`` exactly and a converted model keeps its outputs) or
            ``"paper"`` (random ``φ``, as the mHC paper).
        projection: how ``mode="mhc"`` makes ``H_res`` doubly stochastic
            (design.md, "Three ways to a doubly stochastic H_res"):
            ``"newton"`` (the exact Birkhoff projection, default);
            ``"sinkhorn"`` (the mHC paper's and DeepSeek-V4's truncated
            recipe, :func:`mhc.mixing.sinkhorn_h_res`: row softmax ``+ eps``,
            then ``sinkhorn_iters`` rounds of column and row normalisation,
            every sum plus ``1e-6``, applied transposed as DeepSeek does; not
            exact); or ``"lite"`` (mHC-lite, :func:`mhc.mixing.lite_h_res`:
            a softmax over the ``n!`` permutation matrices, exact by
            construction, ``n_streams <= 5``; ``φ`` then has ``2n + n!``
            rows and ``b_res`` is ``[n!]``, so a block cannot switch to or
            from ``"lite"`` after it is built).
        tol: tolerance of the Newton projection, finite and ``> 0`` (default ``1e-6``).
        sinkhorn_iters: rounds for ``projection="sinkhorn"``, an int ``>= 1`` (default 20).
        fused: with ``mode="mhc"`` and ``projection="newton"``, CUDA streams run
            on the fused Triton kernels of :mod:`mhc.fused` (default ``True``);
            ``False`` keeps the PyTorch path everywhere.
        recompute: keep only the site's inputs for backward and run its
            forward again there, the sublayer included (default ``False``).
        keep_streams_every: in a chain of linked fused sites
            (:attr:`mhc.MHCBlock.next_site`; :class:`mhc.MHCForCausalLM` links
            its sites in order), keep the input streams for backward only at
            every ``k``-th site; the sites between recompute theirs in
            backward from the last kept ones, one post-mix kernel each
            (``H_res·x + H_post ⊗ y`` from tensors the previous site keeps
            anyway), which saves ``n·C`` per token at each such site. ``1``
            (the default) keeps them at every site. Only the eager fused path
            on CUDA records the chain, and not under activation checkpointing
            (``torch.utils.checkpoint``); elsewhere every site keeps its streams.
            Cannot be combined with ``recompute=True``, which keeps no streams.
        alpha_init: initial value of the three dynamic scales ``α``, finite (default ``0.01``).
        norm_eps: epsilon of the coefficient RMSNorm, finite and ``> 0`` (default ``1e-6``).

    Raises (on construction, :meth:`replace` and :meth:`from_dict`):
        TypeError: a value of the wrong type (``n`` given as ``2.7``, ``fused=1``),
            or an unknown option, naming the closest known one.
        ValueError: a value out of range or not among the choices.
    """

    mode: str = "mhc"
    init: str = "identity"
    projection: str = "newton"
    tol: float = 1e-6
    sinkhorn_iters: int = 20
    fused: bool = True
    recompute: bool = False
    keep_streams_every: int = 1
    alpha_init: float = 0.01
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name, value in check_options(**self.to_dict()).items():
            object.__setattr__(self, name, value)
        if self.recompute and self.keep_streams_every > 1:
            raise ValueError(
                f"recompute=True keeps no streams for backward; keep_streams_every={self.keep_streams_every} "
                "(recompute the streams between kept ones) cannot be combined with it"
            )

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """``{name: value}`` of every option (plain ``str`` / ``int`` / ``float`` / ``bool``, JSON-ready)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, owner: str = "MHCOptions") -> MHCOptions:
        """Options from a mapping of some or all of :meth:`fields` (the rest keep their defaults).

        Args:
            values: ``{name: value}``.
            owner: what the error message calls the caller on an unknown key.

        Raises:
            TypeError: ``values`` is not a mapping, or holds an unknown key (naming the
                closest option), or a value of the wrong type.
            ValueError: a value out of range.
        """
        if not isinstance(values, Mapping):
            raise TypeError(f"{owner} needs a mapping of options, got {type(values).__name__}")
        reject_unknown_options(values, _FIELDS, owner)
        return cls(**values)

    def replace(self, **changes: Any) -> MHCOptions:
        """A copy with ``changes`` applied and checked; an unknown name raises ``TypeError`` (did-you-mean)."""
        if not changes:
            return self
        reject_unknown_options(changes, _FIELDS, "MHCOptions.replace")
        return dataclasses.replace(self, **changes)


_FIELDS = MHCOptions.fields()
