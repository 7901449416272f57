"""``MHCBlock``: one hyper-connection site around one sublayer (design.md §1).

The block owns the site's flow, written once in :meth:`MHCBlock.forward`:

1. coefficients and pre-mix: ``u = Σ_i H_pre[i] x_i``;
2. the sublayer, called once, here only: ``y = F(u, *args, **kwargs)`` (a
   tuple result mixes its first element; the output shape is checked here);
3. the post-mix: ``x' = H_res·x + H_postᵀ ⊗ y``.

Steps 1 and 3 run on one backend (:class:`mhc.fused.Backend`), chosen per
call in one place, ``MHCBlock._backend``: the PyTorch reference in
:mod:`mhc.site` (pure functions; every mode, CPU streams, double backward)
or, for CUDA streams with ``mode="mhc"`` and the Newton projection
(:meth:`MHCBlock.uses_fused`), the fused kernels of :mod:`mhc.fused`: eager
autograd nodes, custom ops under ``torch.compile``, or the CUDA extension's
token kernels when decoding. Neither backend calls the sublayer.
The block's settings are one :class:`mhc.MHCOptions`, checked in
:mod:`mhc.options`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import fused, site
from .block_init import RES_INIT_DIAGONAL, exact_sum_logits, pre_init_weights
from .fused.record import Backend, SiteLink
from .mixing import SINKHORN_EPS, check_lite_streams, lite_identity_logits, lite_logit_count
from .options import MHCOptions, check_options, coefficient_dtype, reject_unknown_options
from .streams import Float32Coefficients

__all__ = ["MHCBlock"]

# MHCBlock's own keywords besides the option fields (for the did-you-mean of an unknown one).
_BLOCK_KEYWORDS = ("hidden_size", "n_streams", "layer_index", "options", "pre_eps", "sinkhorn_eps")


class MHCBlock(Float32Coefficients):
    """One mHC site: ``x' = H_res·x + H_postᵀ ⊗ F(H_pre·x)`` around a sublayer ``F``.

    The coefficients are per token (dynamic) plus static biases, and are
    computed in float32 whatever the streams' dtype (:mod:`mhc.site`):

    * ``mode="mhc"``: flattened RMSNorm over all ``n·C`` values, one
      ``nC × (n² + 2n)`` projection ``φ``, ``H_pre = σ(·)``,
      ``H_post = 2σ(·)``, ``H_res = birkhoff_project(·)`` (doubly stochastic);
      ``projection="sinkhorn"`` puts the paper's truncated Sinkhorn in place of
      ``birkhoff_project``, ``projection="lite"`` mHC-lite's softmax over the
      ``n!`` permutation matrices (``φ`` then ``nC × (n! + 2n)``, ``n <= 5``).
    * ``mode="hc"``: unconstrained hyper-connections (Zhu et al.): per-stream
      RMSNorm, ``H = α·tanh(x̃ θ) + b`` with a free ``H_res``.
    * ``mode="residual"``: no parameters; ``x'_i = x_i + F(mean_i x_i)``,
      which for ``n_streams=1`` is exactly ``x + F(x)``.

    Args:
        branch: the sublayer ``F``, an ``nn.Module`` (registered as a submodule)
            or any callable (its weights then stay out of this block's
            parameters); called once per forward as ``branch(u, *args, **kwargs)``
            with ``u: [..., C]`` in the streams' dtype, except under autocast with
            parameters wider than the streams (float32 weights, bf16 streams), where
            ``u`` is in the parameters' dtype, as a residual model's sublayer gets
            its hidden state (:func:`mhc.site.branch_input_dtype`). If it returns a
            tuple (as HF attention does), its first element is mixed into the
            streams and the rest is returned beside the new streams. Avoid a
            bound method of the module that holds this block:
            ``copy.deepcopy(block)`` would deep-copy that whole module with it
            (:mod:`mhc.hf` uses a callable that rebinds on copy instead).
        hidden_size: ``C``, an int ``>= 1``.
        n_streams: ``n`` (default 4), an int ``>= 1``.
        layer_index: depth of this site (int ``>= 0``); rotates the stream ``H_pre`` favours.
        options: an :class:`mhc.MHCOptions` (default ``MHCOptions()``).
        pre_eps: added to ``H_pre = σ(·) + pre_eps`` (``mode="mhc"``), finite and
            ``>= 0``; default 0, which keeps ``Σ H_pre = 1`` at the identity init.
        sinkhorn_eps: the epsilon of ``projection="sinkhorn"``
            (:func:`mhc.mixing.sinkhorn_h_res`), finite and ``>= 0``; default
            ``1e-6``, DeepSeek-V4's ``hc_eps``. These two are settings of the
            block, not :class:`mhc.MHCOptions` fields: :meth:`from_deepseek_v4`
            sets both to the hyper-connection's ``hc_eps``; :class:`mhc.MHCConfig`
            does not store them, so HF models always run with the defaults.
        **option_values: fields of :class:`mhc.MHCOptions` given one by one
            (``mode``, ``init``, ``projection``, ``tol``, ``sinkhorn_iters``,
            ``fused``, ``recompute``, ``alpha_init``, ``norm_eps``); they
            override those of ``options``. In brief: ``init="identity"``
            starts with ``φ = 0``, so that identical streams give ``x + F(x)``
            exactly (conversion keeps a model's outputs); ``fused=True`` runs
            CUDA streams on :mod:`mhc.fused` (``mode="mhc"``, Newton), CPU streams
            always take the PyTorch path (as do ``projection`` ``"sinkhorn"``
            and ``"lite"``, and ``pre_eps > 0``); ``recompute=True`` keeps only the
            block's inputs for backward and runs the site again there, ``F``
            included (``torch.utils.checkpoint``, non-reentrant).

    Every value is checked (:mod:`mhc.options`); an unknown keyword raises
    ``TypeError`` naming the closest option. The options are readable as
    attributes (``block.tol``) and as :attr:`options`; setting one
    (``block.fused = False``) checks it and replaces :attr:`options`, except
    ``mode``, which the parameters' shapes depend on.

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
        layer_index: int = 0,
        options: MHCOptions | None = None,
        pre_eps: float = 0.0,
        sinkhorn_eps: float = SINKHORN_EPS,
        **option_values: Any,
    ):
        super().__init__()
        reject_unknown_options(option_values, (*_BLOCK_KEYWORDS, *MHCOptions.fields()), "MHCBlock")
        if options is None:
            options = MHCOptions()
        elif not isinstance(options, MHCOptions):
            raise TypeError(f"options must be an MHCOptions, got {type(options).__name__}")
        options = options.replace(**option_values)
        sizes = check_options(
            hidden_size=hidden_size,
            n_streams=n_streams,
            layer_index=layer_index,
            pre_eps=pre_eps,
            sinkhorn_eps=sinkhorn_eps,
        )
        if not callable(branch):
            raise TypeError(f"branch must be an nn.Module or a callable, got {type(branch).__name__}")
        self.branch = branch
        # The block that runs next on this one's output (next_site), and what the previous one left here.
        self._site_link = SiteLink()
        # Read-only (properties below): the parameters' shapes and the init depend on them.
        self._hidden_size = sizes["hidden_size"]
        self._n_streams = sizes["n_streams"]
        self._layer_index = sizes["layer_index"]
        self._pre_eps, self._sinkhorn_eps = sizes["pre_eps"], sizes["sinkhorn_eps"]
        if self._lite(options):
            check_lite_streams(self.n_streams)
        self._use_options(options)
        if options.mode == "residual":
            return

        n, C = self.n_streams, self.hidden_size
        # mhc reads all n·C values of a token at once; hc reads each stream alone. mHC-lite
        # has one H_res logit per permutation matrix instead of one per entry.
        res_shape = (lite_logit_count(n),) if self._lite(options) else (n, n)
        fan_in, fan_out = (n * C, math.prod(res_shape) + 2 * n) if options.mode == "mhc" else (C, n + 2)
        dtype = coefficient_dtype()
        self.phi = nn.Parameter(torch.empty(fan_out, fan_in, dtype=dtype))
        self.alpha = nn.Parameter(torch.empty(3, dtype=dtype))
        self.b_pre = nn.Parameter(torch.empty(n, dtype=dtype))
        self.b_post = nn.Parameter(torch.empty(n, dtype=dtype))
        self.b_res = nn.Parameter(torch.empty(res_shape, dtype=dtype))
        self.reset_parameters()

    @classmethod
    def from_deepseek_v4(
        cls,
        hc: nn.Module,
        branch: nn.Module | Callable[..., Any],
        projection: str = "sinkhorn",
        **option_values: Any,
    ) -> MHCBlock:
        """A block with the weights and numerics of a transformers ``DeepseekV4HyperConnection``.

        DeepSeek-V4 computes ``pre = σ(·) + hc_eps``, ``post = 2σ(·)`` and ``comb``
        by a row softmax plus ``hc_eps`` and a column-first Sinkhorn of
        ``hc_sinkhorn_iters`` rounds (every sum plus ``hc_eps``), and its decoder
        layer mixes ``x' = post ⊗ F(collapsed) + combᵀ x``. The block reads ``fn``,
        ``base`` and ``scale`` (float32 copies; comb moved into ``H_res = combᵀ``'s
        layout, :mod:`mhc.hf.deepseek_v4`) and sets ``pre_eps = sinkhorn_eps = hc_eps``,
        ``sinkhorn_iters = hc_sinkhorn_iters`` and ``norm_eps`` to the input norm's.

        Args:
            hc: the hyper-connection (``layer.attn_hc`` or ``layer.ffn_hc``); not modified.
            branch: the sublayer ``F`` that takes the collapsed streams, e.g.
                ``lambda u: layer.self_attn(layer.input_layernorm(u), ...)``.
            projection: ``"sinkhorn"`` (default: DeepSeek's own truncated
                recipe, so the block's output is the decoder layer's to float32
                rounding) or ``"newton"`` (the same weights, with our exact
                projection of the same logits in place of the truncated one).
            **option_values: other :class:`mhc.MHCOptions` fields (``recompute``, ``tol``, ...).

        Returns:
            An ``MHCBlock`` with ``mode="mhc"`` and float32 parameters on ``hc.fn``'s device
            (a module ``branch`` is not moved). Since ``pre_eps > 0`` it always runs on the PyTorch path.

        Raises:
            TypeError: ``hc`` lacks the attributes of a ``DeepseekV4HyperConnection``.
            ValueError: ``projection`` is not ``"sinkhorn"`` or ``"newton"``
                (mHC-lite has ``n!`` logits, DeepSeek ``n²``), an option sets what
                the hyper-connection fixes, or its weights are malformed.
        """
        from .hf.deepseek_v4 import PARAMETER_NAMES, deepseek_v4_settings  # the HF integration, on demand

        site, settings = deepseek_v4_settings(hc, projection, option_values)
        block = cls(branch, **settings)
        for name in PARAMETER_NAMES:  # float32 copies on fn's device; the branch stays where it is
            setattr(block, name, nn.Parameter(getattr(site, name)))
        return block

    @staticmethod
    def _lite(options: MHCOptions) -> bool:
        return options.mode == "mhc" and options.projection == "lite"

    @property
    def hidden_size(self) -> int:
        """The width ``C`` of each stream (read-only; set when the block is built)."""
        return self._hidden_size

    @property
    def n_streams(self) -> int:
        """The number of streams ``n`` (read-only; set when the block is built)."""
        return self._n_streams

    @property
    def layer_index(self) -> int:
        """The block's depth index, which ``init`` reads (read-only; set when the block is built)."""
        return self._layer_index

    @property
    def pre_eps(self) -> float:
        """Added to ``H_pre`` in ``mode="mhc"`` (read-only; set when the block is built)."""
        return self._pre_eps

    @property
    def sinkhorn_eps(self) -> float:
        """The epsilon of ``projection="sinkhorn"`` (read-only; set when the block is built)."""
        return self._sinkhorn_eps

    @property
    def options(self) -> MHCOptions:
        """This block's :class:`mhc.MHCOptions`; assignable (checked), with the same ``mode``."""
        return self._options

    @options.setter
    def options(self, value: MHCOptions) -> None:
        if not isinstance(value, MHCOptions):
            raise TypeError(f"options must be an MHCOptions, got {type(value).__name__}")
        if value.mode != self._options.mode:
            raise ValueError(
                f"an MHCBlock's mode is fixed when it is built (its parameters depend on it): "
                f"it is {self._options.mode!r}, not {value.mode!r}"
            )
        if self._lite(value) != self._lite(self._options):
            raise ValueError(
                "an MHCBlock's projection cannot change to or from 'lite' once it is built (phi and b_res "
                f"have n! rows for it, n² otherwise): it is {self._options.projection!r}, not {value.projection!r}"
            )
        self._use_options(value)

    def _use_options(self, options: MHCOptions) -> None:
        self._options = options
        # Worked out here, not per call: forward's host time matters (notes/block_benchmarks.md).
        newton_mhc = options.mode == "mhc" and options.projection == "newton"
        # The fused kernels compute H_pre = σ(·): a nonzero pre_eps keeps the PyTorch path.
        self._fusable = options.fused and newton_mhc and self._pre_eps == 0
        # Newton's and mHC-lite's H_res have rows summing to one by construction.
        self._exact_rows = newton_mhc or self._lite(options)

    def reset_parameters(self, names: Iterable[str] | None = None) -> None:
        """Initialise the coefficient parameters (float32) as ``init`` says.

        Args:
            names: only these of ``phi``, ``alpha``, ``b_pre``, ``b_post``,
                ``b_res`` (e.g. those a checkpoint did not supply), or one such name;
                all by default.
        """
        if self.mode == "residual":
            return
        wanted = {"phi", "alpha", "b_pre", "b_post", "b_res"}
        if names is not None:
            names = {names} if isinstance(names, str) else set(names)  # one name, or several
            reject_unknown_options(names, sorted(wanted), "MHCBlock.reset_parameters")
            wanted = names
        n = self.n_streams
        pre = pre_init_weights(n, self.layer_index)
        # The values are built in float64 on the CPU and copied in: HF may build a model under a bf16
        # default dtype or a meta-device context.
        with torch.no_grad():
            if "phi" in wanted:
                if self.init == "identity":
                    self.phi.zero_()
                else:
                    nn.init.normal_(self.phi, std=self.phi.shape[1] ** -0.5)
            if "alpha" in wanted:
                self.alpha.fill_(self.alpha_init)
            if self.mode == "mhc":
                # σ(b_pre) = pre, 2σ(b_post) = 1, Π_B(exp(b_res)) = 0.9 on the diagonal
                # (mHC-lite: the identity permutation weighted so that its H_res has the same diagonal).
                diag = math.log(RES_INIT_DIAGONAL * max(n - 1, 1) / (1 - RES_INIT_DIAGONAL))
                res = (
                    lite_identity_logits(n, RES_INIT_DIAGONAL)
                    if self._lite(self._options)
                    else torch.eye(n, dtype=torch.float64, device="cpu") * diag
                )
                values = {
                    "b_pre": exact_sum_logits(pre, self.layer_index % n),
                    "b_post": torch.zeros(n, dtype=torch.float64, device="cpu"),
                    "b_res": res,
                }
            else:
                cpu64 = dict(dtype=torch.float64, device="cpu")
                values = {"b_pre": pre, "b_post": torch.ones(n, **cpu64), "b_res": torch.eye(n, **cpu64)}
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
        if self._options.mode != "residual":
            device = self._coefficient_parameters()[0].device
            if x.device != device:
                raise ValueError(f"streams are on {x.device} but the block's parameters are on {device}")

    def fused_first_step_inputs(self, x: Tensor) -> tuple | None:
        """What the previous linked site needs to run this block's first step on streams like ``x`` (decoding).

        ``((φ, α, b_pre, b_post, b_res), norm_eps, tol, branch_norm)`` when this
        block runs the fused path and ``x`` has its streams shape and its
        parameters' device, else ``None`` (:mod:`mhc.fused.chain`).
        """
        if not self._fusable or x.shape[-2:] != (self.n_streams, self.hidden_size):
            return None
        params = self._coefficient_parameters()
        if params[0].get_device() != x.get_device():
            return None
        if site.branch_input_dtype(x, params[0].dtype) != x.dtype:
            return None  # the token kernels write u in the streams' dtype
        return params, self._options.norm_eps, self._options.tol, self._branch_norm(Backend.TOKENS)

    def _branch_norm(self, backend: Backend) -> tuple[Tensor, float] | None:
        # (weight, eps) of the branch's input RMSNorm, which the site's kernels then apply where they
        # form u: offered by a branch whose class has fusable_input_norm, training_input_norm and
        # call_normed (mhc.hf.branch.SiteBranch). The no-grad token kernels take the first (a decode
        # step's norm is ~8 launches of host time); the grad path the second (the norm's passes over u,
        # forward and backward, and the copies of u it keeps). Looked up on the class: a Module
        # branch's missing attribute would cost an exception each call.
        # Not while compiling: inductor fuses the norm with its neighbours itself, and the compiled
        # small_gpu step was 1.410x/1.433x residual with the site applying it against 1.355x/1.382x
        # without (notes/training_cost.md).
        if backend is Backend.TOKENS:
            offer = getattr(type(self.branch), "fusable_input_norm", None)
        elif backend is Backend.EAGER and torch.is_grad_enabled():
            offer = getattr(type(self.branch), "training_input_norm", None)
        else:
            return None
        return offer(self.branch) if offer is not None else None

    def _coefficient_parameters(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        # (φ, α, b_pre, b_post, b_res) from the parameter dict: five Module.__getattr__ lookups
        # cost microseconds a site on the H200's host, and a decode step runs 24 sites. A
        # parametrised or replaced coefficient is not in the dict, so it is looked up as usual.
        p = self._parameters
        try:
            return p["phi"], p["alpha"], p["b_pre"], p["b_post"], p["b_res"]
        except KeyError:
            return self.phi, self.alpha, self.b_pre, self.b_post, self.b_res

    def coefficients(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The mixing coefficients for streams ``x: [..., n, C]`` (the PyTorch reference, :mod:`mhc.site`).

        Returns:
            ``(H_pre [..., n], H_post [..., n], H_res [..., n, n])``, float32
            (float64 if ``x`` is float64).
        """
        if self._options.mode == "residual":
            return site.residual_coefficients(x)
        return site.coefficients(
            x,
            self.phi,
            self.alpha,
            self.b_pre,
            self.b_post,
            self.b_res,
            self._options,
            pre_eps=self._pre_eps,
            sinkhorn_eps=self._sinkhorn_eps,
        )

    def h_res_logits(self, x: Tensor) -> Tensor | None:
        """The logits this block's projection turns into ``H_res`` for streams ``x: [..., n, C]``, or ``None``.

        Returns:
            ``[..., n, n]`` (``[..., n!]`` for mHC-lite), float32 (float64 if ``x`` is float64),
            from :func:`mhc.site.h_res_logits`; ``None`` for ``mode`` ``"hc"`` and ``"residual"``,
            whose ``H_res`` is not projected from logits.
        """
        if self._options.mode != "mhc":
            return None
        return site.h_res_logits(x, self.phi, self.alpha, self.b_res, self._options)

    def uses_fused(self, x: Tensor) -> bool:
        """Whether :meth:`forward` runs streams ``x`` on the fused backend (:mod:`mhc.fused`).

        True for non-empty CUDA streams of a dtype in
        :data:`mhc.fused.SUPPORTED_DTYPES` when ``fused=True``, ``mode="mhc"``,
        ``projection="newton"``, ``pre_eps=0`` and Triton is importable; the PyTorch
        reference (:mod:`mhc.site`) runs otherwise. A subclass may override
        this to choose the backend, for instance to run the fused kernels on
        CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``), as the
        tests do.

        Raises:
            ImportError: the fused path is asked for and Triton imports but the
                kernels do not (:func:`mhc.fused.available`).
        """
        return (
            self._fusable
            and x.is_cuda
            and x.dtype in fused.SUPPORTED_DTYPES
            and x.numel() > 0
            and fused.available()
        )

    @property
    def next_site(self) -> MHCBlock | None:
        """The block that runs next on this one's output, or ``None`` (the default; see :meth:`set_next_site`).

        :class:`mhc.MHCForCausalLM` links its sites in order. In generation
        (no grad, CUDA streams of at most ``mhc.fused.tokens.MAX_TOKENS``
        tokens, both blocks on the fused path) this block's post-mix and the
        next block's first step then run as one launch, with the bits of two
        separate calls. The next block uses that first step only if it is
        called on this block's output, unchanged; any other input runs its own.
        Not under ``torch.inference_mode`` (its tensors keep no version counter
        to tell an unchanged output). In training with ``keep_streams_every > 1``
        the next block keeps no copy of this one's output for backward and
        recomputes it there (:class:`mhc.MHCOptions`). Held weakly, and not kept by pickling or
        ``copy.deepcopy`` (the copy runs unlinked, which is only slower).
        """
        return self._site_link.next_block()

    @property
    def site_link(self) -> SiteLink:
        """This block's place in a chain of linked sites (:class:`mhc.fused.record.SiteLink`, :mod:`mhc.fused.chain`)."""
        return self._site_link

    def set_next_site(self, block: MHCBlock | None) -> None:
        """Link :attr:`next_site` to ``block`` (an :class:`MHCBlock`, held weakly), or unlink it (``None``)."""
        if block is not None and not isinstance(block, MHCBlock):
            raise TypeError(f"next_site must be an MHCBlock or None, got {type(block).__name__}")
        # Not a property setter: nn.Module.__setattr__ would register a block value as a submodule.
        self._site_link.next_site = weakref.ref(block) if block is not None else None

    def __getstate__(self):
        return {**self.__dict__, "_site_link": SiteLink()}

    def forward(self, x: Tensor, *args, **kwargs):
        self._check_streams(x)
        if self._options.recompute and torch.is_grad_enabled():
            return checkpoint(self._site, x, *args, use_reentrant=False, **kwargs)
        return self._site(x, *args, **kwargs)

    def _backend(self, x: Tensor) -> Backend:
        """The one place the backend of a call is chosen (docs/design.md, "Backends")."""
        if not self.uses_fused(x):
            return Backend.REFERENCE
        return fused.fused_backend(x)

    def _site(self, x: Tensor, *args, **kwargs):
        # forward() checked the streams, uses_fused() what else the fused nodes need.
        backend = self._backend(x)
        # What the previous linked site left is for this call only: taken (and dropped) on every call.
        waiting = self._site_link.take(x)
        if backend is Backend.REFERENCE:
            return self._reference_site(x, args, kwargs)

        # 1. coefficients, H_res and the pre-mix: one fused step, unless the previous linked site ran it
        if waiting is not None and len(waiting) == 2:
            u, fused_site = waiting
        else:
            recipe = waiting[0] if waiting is not None else None  # x recomputed in backward
            norm = self._branch_norm(backend)
            opts, params = self._options, self._coefficient_parameters()
            u_dtype = site.branch_input_dtype(x, params[0].dtype)
            u, fused_site = fused.pre(backend, x, *params, opts.norm_eps, opts.tol, recipe, norm, u_dtype)

        # 2. the sublayer, whose input norm the site's kernels may have applied already
        y, rest = self._call_branch(u, fused_site.normed, args, kwargs)

        # 3. the post-mix, which may serve the next linked site too
        x_new = fused.post_linked(self._site_link, y, fused_site, self._options.keep_streams_every)
        return x_new if rest is None else (x_new, *rest)

    def _reference_site(self, x: Tensor, args: tuple, kwargs: dict):
        """The site on PyTorch ops (:mod:`mhc.site`)."""
        H_pre, H_post, H_res = self.coefficients(x)
        weight_dtype = None if self._options.mode == "residual" else self._coefficient_parameters()[0].dtype
        u, anchor, dev = site.pre_mix(x, H_pre, site.branch_input_dtype(x, weight_dtype))
        y, rest = self._call_branch(u, None, args, kwargs)
        if self._options.mode == "residual":
            x_new = x + y.unsqueeze(-2)
        else:
            x_new = site.post_mix(y, anchor, dev, H_post, H_res, exact_rows=self._exact_rows, dtype=x.dtype)
        return x_new if rest is None else (x_new, *rest)

    def _call_branch(self, u: Tensor | None, normed: Tensor | None, args: tuple, kwargs: dict):
        """``F(u)`` (or, with ``normed``, the branch's call that skips its input norm): ``(y, rest or None)``.

        ``u`` is ``None`` where the grad path's kernels applied the norm without storing ``u``.
        """
        if normed is None:
            out = self.branch(u, *args, **kwargs)
        else:
            out = self.branch.call_normed(u, normed, *args, **kwargs)
        if isinstance(out, tuple):
            if not out:
                raise TypeError(
                    "MHCBlock's branch returned an empty tuple; it must return a tensor [..., C] "
                    "or a tuple whose first element is one"
                )
            y, rest = out[0], out[1:]
        else:
            y, rest = out, None
        if not isinstance(y, Tensor):
            where = (
                "the first element of the tuple the branch returned"
                if rest is not None
                else "the branch's output"
            )
            raise TypeError(
                f"MHCBlock's branch must return a tensor [..., C] (or a tuple whose first element is one); "
                f"{where} is {type(y).__name__}"
            )
        shape = (u if u is not None else normed).shape
        if y.shape != shape:
            raise ValueError(f"branch returned shape {tuple(y.shape)}; MHCBlock needs {tuple(shape)}")
        return y, rest

    def extra_repr(self) -> str:
        opts = self._options
        s = f"hidden_size={self.hidden_size}, n_streams={self.n_streams}, mode={opts.mode!r}"
        if opts.mode != "residual":
            s += f", init={opts.init!r}, layer_index={self.layer_index}, projection={opts.projection!r}"
        if opts.mode == "mhc" and not opts.fused:
            s += ", fused=False"
        if opts.mode == "mhc" and self._pre_eps:
            s += f", pre_eps={self._pre_eps:g}"
        if opts.mode == "mhc" and opts.projection == "sinkhorn":
            s += f", sinkhorn_iters={opts.sinkhorn_iters}, sinkhorn_eps={self._sinkhorn_eps:g}"
        if opts.recompute:
            s += ", recompute=True"
        if opts.keep_streams_every > 1:
            s += f", keep_streams_every={opts.keep_streams_every}"
        return s


def _option_property(name: str) -> property:
    def get(self: MHCBlock):
        return getattr(self._options, name)

    def set(self: MHCBlock, value) -> None:
        self.options = self._options.replace(**{name: value})

    return property(get, set, doc=f"``options.{name}`` (:class:`mhc.MHCOptions`); setting it is checked.")


for _name in MHCOptions.fields():
    setattr(MHCBlock, _name, _option_property(_name))
del _name
