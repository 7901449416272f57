"""``MHCBlock``: one hyper-connection site around one sublayer (design.md §1)."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import fused
from .projection import birkhoff_project

__all__ = [
    "MHCBlock", "MODES", "INITS", "PROJECTIONS", "OPTION_NAMES", "check_options", "close_option", "reject_unknown_options"
]

MODES = ("mhc", "hc", "residual")
INITS = ("identity", "paper")
PROJECTIONS = ("newton", "sinkhorn")

# H_res at the default init: this much mass on the diagonal. Any doubly
# stochastic start preserves the function; a mostly-diagonal one lets streams
# keep their own content while the projection still has gradient (T(1-T) > 0).
_RES_INIT_DIAGONAL = 0.9


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


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


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
}
OPTION_NAMES = tuple(_OPTION_CHECKS)


def close_option(name: str, known: Iterable[str]) -> str | None:
    """The known option ``name`` most likely misspells (``difflib``, case-insensitive), or ``None``."""
    by_lower = {k.lower(): k for k in known}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.8)
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

    Any subset of ``hidden_size``, ``n_streams``, ``mode``, ``init``,
    ``layer_index``, ``alpha_init``, ``norm_eps``, ``projection``, ``tol``,
    ``sinkhorn_iters``, ``fused``, ``recompute`` (see :class:`MHCBlock`).
    Integers must be ints (not floats, not bools): ``hidden_size``,
    ``n_streams`` and ``sinkhorn_iters`` ``>= 1``, ``layer_index >= 0``.
    ``tol`` and ``norm_eps`` are finite and ``> 0``, ``alpha_init`` finite;
    ``fused`` and ``recompute`` are bools. Both :class:`MHCBlock` and
    :class:`mhc.MHCConfig` validate through this function.

    Raises:
        TypeError: an unknown option (naming the closest known one) or a value of the wrong type.
        ValueError: a value out of range or not among the choices.
    """
    reject_unknown_options(options, OPTION_NAMES, "mHC options")
    return {name: _OPTION_CHECKS[name](name, value) for name, value in options.items()}


def _pre_init_weights(n: int, layer_index: int) -> Tensor:
    """Unequal ``H_pre`` that sums to one, peaked on stream ``layer_index mod n``.

    Uniform weights would give every stream the same gradient forever, so n
    streams would be one residual stream in disguise (design.md, "Break the
    symmetry"). The peak rotates with depth, as in HC's one-hot init.
    """
    off = min(0.01, 0.5 / n)
    # Built on the CPU explicitly: HF may construct models under a meta-device context.
    w = torch.full((n,), off, dtype=torch.float64, device="cpu")
    w[layer_index % n] = 1.0 - off * (n - 1)
    return w


def _exact_sum_logits(weights: Tensor, peak: int) -> Tensor:
    """float32 logits whose sigmoids are ``weights`` and sum to exactly 1.0 in float32.

    The forward computes ``u = (Σ_i H_pre[i])·x_0 + ...``; with a sum of exactly
    one, a converted model reproduces its original outputs bit for bit. One
    small weight is nudged by ulps (its sigmoid moves in steps far finer than
    the sum's rounding) until the float32 sum rounds to 1. For ``n = 1`` no
    unsaturated logit does, and the weight stays ``1 - 1e-6``.
    """
    logits = torch.logit(weights.clamp(1e-6, 1 - 1e-6)).float()
    n = weights.numel()
    if n == 1:
        return logits
    tuned = (peak + 1) % n
    for _ in range(1000):
        total = torch.sigmoid(logits).sum()
        if total == 1:
            break
        logits[tuned] = torch.nextafter(logits[tuned], torch.tensor(math.inf if total < 1 else -math.inf, device="cpu"))
    return logits


class MHCBlock(nn.Module):
    """One mHC site: ``x' = H_res·x + H_postᵀ ⊗ F(H_pre·x)`` around a sublayer ``F``.

    The coefficients are per token (dynamic) plus static biases, and are
    computed in float32 whatever the streams' dtype:

    * ``mode="mhc"``: flattened RMSNorm over all ``n·C`` values, one
      ``nC × (n² + 2n)`` projection ``φ``, ``H_pre = σ(·)``,
      ``H_post = 2σ(·)``, ``H_res = birkhoff_project(·)`` (doubly stochastic).
    * ``mode="hc"``: unconstrained hyper-connections (Zhu et al.): per-stream
      RMSNorm, ``H = α·tanh(x̃ θ) + b`` with a free ``H_res``.
    * ``mode="residual"``: no parameters; ``x'_i = x_i + F(mean_i x_i)``,
      which for ``n_streams=1`` is exactly ``x + F(x)``.

    Args:
        branch: the sublayer ``F``, an ``nn.Module`` (registered as a submodule)
            or any callable (its weights then stay out of this block's
            parameters); called as ``branch(u, *args, **kwargs)`` with
            ``u: [..., C]``. If it returns a tuple (as HF attention does), its
            first element is mixed into the streams and the rest is returned
            beside the new streams. Avoid a bound method of the module that
            holds this block: ``copy.deepcopy(block)`` would deep-copy that
            whole module with it (:mod:`mhc.hf` uses a callable that rebinds
            on copy instead).
        hidden_size: ``C``.
        n_streams: ``n`` (default 4).
        mode: ``"mhc"``, ``"hc"`` or ``"residual"``.
        init: ``"identity"`` (default) starts with ``φ = 0``, so that on identical
            streams every stream computes ``x + F(x)`` exactly (conversion of a
            pretrained model keeps its outputs); ``"paper"`` draws ``φ`` at
            random, as the mHC paper does, which is close to but not exactly
            function-preserving.
        layer_index: depth of this site; rotates the stream ``H_pre`` favours.
        alpha_init: initial value of the three dynamic scales ``α``.
        norm_eps: epsilon of the coefficient RMSNorm.
        projection: ``"newton"`` (exact) or ``"sinkhorn"`` for ``H_res``.
        tol: tolerance of the Newton projection.
        sinkhorn_iters: steps for ``projection="sinkhorn"``.
        fused: with ``mode="mhc"`` and ``projection="newton"``, run CUDA
            streams on the fused Triton kernels of :mod:`mhc.fused` (fewer
            passes over the streams, same maths); ``False`` keeps the PyTorch
            path everywhere. CPU streams always take the PyTorch path.
        recompute: keep only the block's inputs (the streams and the branch's
            arguments) for backward and run the site's forward again there,
            ``F`` included (``torch.utils.checkpoint``, non-reentrant): less
            memory for one more forward.

    Options are checked by :func:`check_options` (types and ranges); an
    unknown keyword raises ``TypeError`` naming the closest option.

    Shapes:
        ``forward(x: [..., n, C], *args, **kwargs) -> [..., n, C]`` (or a tuple
        whose first element is that), in the dtype of ``x``.
    """

    def __init__(
        self,
        branch: nn.Module | Callable[..., Any],
        hidden_size: int,
        n_streams: int = 4,
        *,
        mode: str = "mhc",
        init: str = "identity",
        layer_index: int = 0,
        alpha_init: float = 0.01,
        norm_eps: float = 1e-6,
        projection: str = "newton",
        tol: float = 1e-6,
        sinkhorn_iters: int = 20,
        fused: bool = True,
        recompute: bool = False,
        **unknown: Any,
    ):
        super().__init__()
        reject_unknown_options(unknown, _OPTION_CHECKS, "MHCBlock")
        opts = check_options(
            hidden_size=hidden_size, n_streams=n_streams, mode=mode, init=init, layer_index=layer_index,
            alpha_init=alpha_init, norm_eps=norm_eps, projection=projection, tol=tol,
            sinkhorn_iters=sinkhorn_iters, fused=fused, recompute=recompute,
        )
        if not callable(branch):
            raise TypeError(f"branch must be an nn.Module or a callable, got {type(branch).__name__}")
        self.branch = branch
        self.hidden_size = opts["hidden_size"]
        self.n_streams = opts["n_streams"]
        self.mode = opts["mode"]
        self.init = opts["init"]
        self.layer_index = opts["layer_index"]
        self.norm_eps = opts["norm_eps"]
        self.projection = opts["projection"]
        self.tol = opts["tol"]
        self.sinkhorn_iters = opts["sinkhorn_iters"]
        self.alpha_init = opts["alpha_init"]
        self.fused = opts["fused"]
        self.recompute = opts["recompute"]
        if self.mode == "residual":
            return

        n, C = self.n_streams, self.hidden_size
        # mhc reads all n·C values of a token at once; hc reads each stream alone.
        fan_in, fan_out = (n * C, n * n + 2 * n) if self.mode == "mhc" else (C, n + 2)
        self.phi = nn.Parameter(torch.empty(fan_out, fan_in))
        self.alpha = nn.Parameter(torch.empty(3))
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.empty(n))
        self.b_res = nn.Parameter(torch.empty(n, n))
        self.reset_parameters()

    def reset_parameters(self, names: Iterable[str] | None = None) -> None:
        """Initialise the coefficient parameters (float32) as ``init`` says.

        Args:
            names: only these of ``phi``, ``alpha``, ``b_pre``, ``b_post``,
                ``b_res`` (e.g. those a checkpoint did not supply); all by default.
        """
        if self.mode == "residual":
            return
        wanted = {"phi", "alpha", "b_pre", "b_post", "b_res"}
        if names is not None:
            names = set(names)
            reject_unknown_options(names, sorted(wanted), "MHCBlock.reset_parameters")
            wanted = names
        n = self.n_streams
        pre = _pre_init_weights(n, self.layer_index)
        with torch.no_grad():
            if "phi" in wanted:
                if self.init == "identity":
                    self.phi.zero_()
                else:
                    nn.init.normal_(self.phi, std=self.phi.shape[1] ** -0.5)
            if "alpha" in wanted:
                self.alpha.fill_(self.alpha_init)
            if self.mode == "mhc":
                # σ(b_pre) = pre, 2σ(b_post) = 1, Π_B(exp(b_res)) = 0.9 on the diagonal.
                diag = math.log(_RES_INIT_DIAGONAL * max(n - 1, 1) / (1 - _RES_INIT_DIAGONAL))
                values = {
                    "b_pre": _exact_sum_logits(pre, self.layer_index % n),
                    "b_post": torch.zeros(n),
                    "b_res": torch.eye(n) * diag,
                }
            else:
                values = {"b_pre": pre, "b_post": torch.ones(n), "b_res": torch.eye(n)}
            for name, value in values.items():
                if name in wanted:
                    getattr(self, name).copy_(value)

    def _check_streams(self, x: Tensor) -> None:
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"MHCBlock expects a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
        if x.dim() < 2 or x.shape[-2:] != (self.n_streams, self.hidden_size):
            raise ValueError(
                f"MHCBlock expects streams of shape [..., {self.n_streams}, {self.hidden_size}], "
                f"got {tuple(x.shape)}"
            )
        if self.mode != "residual" and x.device != self.phi.device:
            raise ValueError(f"streams are on {x.device} but the block's parameters are on {self.phi.device}")

    def coefficients(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The mixing coefficients for streams ``x: [..., n, C]``.

        Returns:
            ``(H_pre [..., n], H_post [..., n], H_res [..., n, n])``, float32
            (float64 if ``x`` is float64).
        """
        n = self.n_streams
        acc = torch.promote_types(x.dtype, torch.float32)
        if self.mode == "residual":
            ones = x.new_ones(x.shape[:-1], dtype=acc)
            return ones / n, ones, torch.eye(n, dtype=acc, device=x.device).expand(*x.shape[:-2], n, n)

        a_pre, a_post, a_res = self.alpha.to(acc)
        b_pre, b_post, b_res = self.b_pre.to(acc), self.b_post.to(acc), self.b_res.to(acc)
        phi = self.phi.to(acc)
        if self.mode == "mhc":
            x_flat = rearrange(x, "... n c -> ... (n c)").to(acc)
            x_norm = F.rms_norm(x_flat, (n * self.hidden_size,), eps=self.norm_eps)
            pre, post, res = (x_norm @ phi.t()).split([n, n, n * n], dim=-1)
            H_pre = torch.sigmoid(a_pre * pre + b_pre)
            H_post = 2 * torch.sigmoid(a_post * post + b_post)
            H_res = birkhoff_project(
                a_res * rearrange(res, "... (i j) -> ... i j", i=n) + b_res,
                tol=self.tol,
                method=self.projection,
                iters=self.sinkhorn_iters,
            )
            return H_pre, H_post, H_res

        x_norm = F.rms_norm(x.to(acc), (self.hidden_size,), eps=self.norm_eps)
        dyn = torch.tanh(x_norm @ phi.t())  # [..., n, n + 2]: row i is read off stream i
        H_pre = a_pre * dyn[..., 0] + b_pre
        H_post = a_post * dyn[..., 1] + b_post
        H_res = a_res * dyn[..., 2:] + b_res
        return H_pre, H_post, H_res

    def forward(self, x: Tensor, *args, **kwargs):
        self._check_streams(x)
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._site, x, *args, use_reentrant=False, **kwargs)
        return self._site(x, *args, **kwargs)

    def _site(self, x: Tensor, *args, **kwargs):
        if self._use_fused(x):
            # forward() checked the streams and _use_fused the rest of what mhc_site checks.
            return fused.run_site(
                x, self.branch, self.phi, self.alpha, self.b_pre, self.b_post, self.b_res, self.norm_eps, self.tol,
                args, kwargs,
            )
        H_pre, H_post, H_res = self.coefficients(x)
        # The mixes are written around stream 0: Σ_i h_i x_i = (Σ_i h_i) x_0 +
        # Σ_i h_i (x_i - x_0). Same maths, but on identical streams (a freshly
        # converted model) the deviations are exactly zero, so the block
        # returns x + F(x) to the bit instead of n roundings of |x| away.
        xs = x.to(H_pre.dtype)
        anchor = xs[..., :1, :]
        dev = xs - anchor
        u = H_pre.sum(-1, keepdim=True) * anchor.squeeze(-2) + torch.einsum("...n,...nc->...c", H_pre, dev)
        u = u.to(x.dtype)

        out = self.branch(u, *args, **kwargs)
        y, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        if y.shape != u.shape:
            raise ValueError(f"branch returned shape {tuple(y.shape)}; MHCBlock needs {tuple(u.shape)}")

        if self.mode == "residual":
            x_new = x + y.unsqueeze(-2)
        else:
            # Newton's H_res has rows summing to one by construction; use the
            # exact 1 rather than its rounded row sums.
            rows = 1.0 if self._exact_rows else H_res.sum(-1, keepdim=True)
            mixed = rows * anchor + H_res @ dev + H_post.unsqueeze(-1) * y.to(xs.dtype).unsqueeze(-2)
            x_new = mixed.to(x.dtype)
        return x_new if rest is None else (x_new, *rest)

    def _use_fused(self, x: Tensor) -> bool:
        return (
            self.fused
            and self.mode == "mhc"
            and self.projection == "newton"
            and x.is_cuda
            and x.dtype in fused.SUPPORTED_DTYPES
            and x.numel() > 0
            and fused.available()
        )

    @property
    def _exact_rows(self) -> bool:
        return self.mode == "mhc" and self.projection == "newton"

    def extra_repr(self) -> str:
        s = f"hidden_size={self.hidden_size}, n_streams={self.n_streams}, mode={self.mode!r}"
        if self.mode != "residual":
            s += f", init={self.init!r}, layer_index={self.layer_index}, projection={self.projection!r}"
        if self.mode == "mhc" and not self.fused:
            s += ", fused=False"
        if self.recompute:
            s += ", recompute=True"
        return s
