"""Fused mHC site for CUDA: the streams are read and written in a few passes.

:class:`mhc.MHCBlock` (``mode="mhc"``, Newton projection) sends CUDA streams
here when Triton is importable; the PyTorch code in :mod:`mhc.block` stays
the reference and the CPU implementation. The kernels are in
:mod:`mhc.fused_kernels`.

The site is two autograd nodes around the sublayer ``F``::

    u, h, H_res = _SitePre(x, φ, α, b)   # RMSNorm(x_flat) φᵀ, h = σ(·), Π_B(exp(·)), Σ H_pre[i] x_i
    y           = F(u)
    x'          = _PostMix(x, y, h, H_res)  # H_res·x + H_post ⊗ y, H_post = 2·h[:, n:]

Few nodes and few host-side launches matter as much as the kernels: at the
width of a ~125M model a site is bound by its launch overhead, not by the GPU
(notes/block_benchmarks.md). So the projection runs inside ``_SitePre`` (its
implicit backward needs only ``H_res``), each backward is one kernel per
memory pass plus a couple of small reductions, the launch geometry of a
shape is worked out once (:class:`_Plan`), and compiled kernels are
launched directly (:class:`_Launcher`).

Once Triton's own launches have compiled a shape's six kernels (its first
fwd+bwd), the site runs in C++ (``csrc/site.cu``): the same two nodes as C++
autograd functions, which launch the kept Triton variants and the projection
themselves, with less host time per site (notes/block_benchmarks.md). Under
``torch.compile``, functorch transforms or a Triton launch hook, and where the
projection has no CUDA op, the Python nodes below run instead; they are the
same maths, launch for launch.

Backward order is fixed by the graph: ``_PostMix``, ``F``, then
``_SitePre``. ``_PostMix`` returns no gradient for ``x``; it leaves ``dx'``
in a per-call :class:`_SiteState`, and ``_SitePre`` writes the whole ``dx``
in one pass (separate gradients would cost extra reads and writes of the
streams to add up). Double backward is not supported.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import projection_cuda as _projection_cuda
from .projection import NEWTON_MAX_ITER, birkhoff_backward, birkhoff_project, effective_tol

__all__ = ["available", "mhc_site", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# Triton missing or not importable (CPU-only PyTorch builds) is the one reason the fused path may be
# absent. Kernels that fail to import while Triton imports are a bug in mhc or a Triton it does not
# support, never a reason to fall back to the PyTorch path: the error is kept and raised, with its
# cause, by available() (which MHCBlock asks before every fused-eligible CUDA forward) and
# mhc_site. It is not raised here, so that CPU code, which never runs the kernels, still imports mhc.
_k = None
_TRITON_ERROR: ImportError | None = None  # why Triton is not importable
_KERNELS_ERROR: Exception | None = None  # why mhc.fused_kernels failed to import although Triton did
try:
    import triton  # only to tell "no Triton" from broken kernels
except ImportError as err:
    _TRITON_ERROR = err
else:
    try:
        from . import fused_kernels as _k
    except Exception as err:  # a NameError in the module is as much a bug as an ImportError
        _KERNELS_ERROR = err


class _Launcher:
    """``launcher(spec, *args)``: one Triton kernel, with less host time per call.

    ``kernel[grid](...)`` binds and specializes every argument again on each
    call (15-40 µs of host time on the H200's host, measured), and at the width
    of a ~125M model host time, not the GPU, sets the step time. Every argument
    this module passes is contiguous and 16-byte aligned (:func:`_dense`), its
    dtype follows from the streams', and its integers from their shape, so the
    compiled variant is fixed by the :class:`_Launch` spec that :class:`_Plan`
    builds once per shape. After Triton's own first launch of a variant this
    keeps it and makes the call Triton would make (launch hooks included).
    Positional arguments are the kernel's runtime parameters; the spec holds its
    constexprs. Under Triton's interpreter and under ``torch.compile`` every
    call takes Triton's own path.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.variants = {}

    def native(self, spec: "_Launch"):
        """The C++ launch handle (``TritonKernel``) of ``spec``'s kept variant, or ``None``.

        ``None`` until Triton's own first launch has compiled the variant, and for
        a variant that needs what ``csrc/site.cu``'s launch does not pass (scratch
        memory, clusters, cooperative or programmatic launches).
        """
        if spec.native is None:
            hit = self.variants.get(spec.variant)
            if hit is None:
                return None
            handle = _native_kernel(hit[0], self.kernel.arg_names, spec)
            # The compiled kernel stays with its handle: its CUfunction lives as long as it does.
            spec.native = (handle, hit[0]) if handle is not None else False
        return spec.native[0] if spec.native else None

    def __call__(self, spec: "_Launch", *args) -> None:
        # torch.compile traces Triton's own launch as a user-defined kernel.
        if not spec.cached or torch.compiler.is_compiling():
            self.kernel[spec.grid](*args, **spec.meta)
            return
        hit = self.variants.get(spec.variant)
        if hit is None:
            compiled = self.kernel[spec.grid](*args, **spec.meta)
            # Triton before its `knobs` module is not handled.
            if getattr(compiled, "function", None) is not None and hasattr(_k.triton, "knobs"):
                constexprs = tuple(spec.meta[name] for name in self.kernel.arg_names[len(args):])
                self.variants[spec.variant] = (compiled, compiled.run, constexprs)
            return
        compiled, run, constexprs = hit
        full = (*args, *constexprs)
        # Triton's own stream getter: torch.cuda.current_stream().cuda_stream took
        # 7.7-8.5 µs per call on the H200's host (timed alone), the getter 0.13 µs.
        stream = _k.triton.runtime.driver.active.get_current_stream(spec.device)
        runtime = _k.triton.knobs.runtime
        enter, leave = _hook(runtime.launch_enter_hook), _hook(runtime.launch_exit_hook)
        metadata = None if enter is None else compiled.launch_metadata(spec.grid, stream, *full)
        run(*spec.grid3, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave, *full)


# Parameter kinds of csrc/site.cu's TritonKernel, by Triton signature type.
_PARAM_KINDS = {"constexpr": 0, "i32": 2, "i64": 3, "fp32": 4, "fp64": 5}


def _native_kernel(compiled, arg_names, spec: "_Launch"):
    """``compiled`` as a ``TritonKernel`` for ``spec``'s grid, or ``None`` if its launch needs more."""
    md = compiled.metadata
    if any(getattr(md, f, 0) for f in ("global_scratch_size", "profile_scratch_size", "launch_cooperative_grid",
                                        "launch_pdl")) or getattr(md, "num_ctas", 1) != 1:
        return None
    signature = compiled.src.signature
    kinds = []
    for name in arg_names:
        if name in spec.meta:
            break  # the constexprs, which follow the runtime parameters
        sig = signature.get(name)
        kind = 1 if isinstance(sig, str) and sig.startswith("*") else _PARAM_KINDS.get(sig)
        if kind is None:
            return None
        kinds.append(kind)
    module = _projection_cuda.extension()
    return module.TritonKernel(compiled.function, list(spec.grid3), md.num_warps, md.shared, kinds)


def _native_allowed() -> bool:
    """Whether the C++ site may run now: not while tracing or under functorch transforms, nor with a
    Triton launch hook installed.

    A hook (a profiler's, say) sees only Triton's own launches.
    """
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    runtime = _k.triton.knobs.runtime
    return _hook(runtime.launch_enter_hook) is None and _hook(runtime.launch_exit_hook) is None


def _hook(hook):
    """A Triton launch hook, or ``None`` for an empty ``HookChain``.

    Triton 3.5+ keeps its hooks in chains that are never ``None``; with a chain,
    Triton's own launch builds the launch metadata and calls both chains on
    every launch, though no hook is installed.
    """
    return None if hook is None or getattr(hook, "calls", None) == [] else hook


class _Launch:
    """Grid and constexprs of one kernel launch, and the key of its compiled variant."""

    __slots__ = ("grid", "grid3", "meta", "device", "cached", "variant", "native")

    def __init__(self, grid: tuple, meta: dict, ints: tuple, dtype: torch.dtype, device: torch.device):
        self.grid, self.grid3, self.meta = grid, (*grid, 1, 1)[:3], meta
        self.cached = device.type == "cuda"
        self.device = device.index
        # What Triton specializes a variant on, besides the (fixed) pointer alignment and
        # dtypes: integers equal to 1, divisible by 16, or beyond int32.
        int_key = tuple((i == 1, i % 16 == 0, -(2**31) <= i < 2**31) for i in ints)
        self.variant = (self.device, dtype, int_key, tuple(meta.items()))
        self.native = None  # (C++ launch handle, compiled kernel): None until built, False where there is none


if _k is not None:
    _coeff_fwd, _postmix_fwd, _postmix_bwd, _coeff_bwd, _stream_grad, _phi_grad = map(
        _Launcher, (_k.coeff_fwd, _k.postmix_fwd, _k.postmix_bwd, _k.coeff_bwd, _k.stream_grad, _k.phi_grad)
    )


def available() -> bool:
    """Whether the fused Triton path can run; ``False`` only where Triton is not importable.

    Raises:
        ImportError: Triton imports but :mod:`mhc.fused_kernels` does not (a
            bug in mhc, or a Triton version it does not support). The original
            error is chained as ``__cause__``, with its traceback. The fused
            path is never dropped silently: ``MHCBlock(..., fused=False)`` runs
            the PyTorch path on purpose.
    """
    if _KERNELS_ERROR is not None:
        err = _KERNELS_ERROR
        raise ImportError(
            f"mhc's Triton kernels (mhc.fused_kernels) failed to import although Triton {triton.__version__} "
            f"imports: {type(err).__name__}: {err}. This is a bug in mhc or a Triton version it does not "
            "support; pass fused=False to MHCBlock (or MHCConfig) to run the PyTorch path meanwhile."
        ) from err
    return _k is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(v: int, lo: int = 1) -> int:
    return max(lo, 1 << (int(v) - 1).bit_length())


class _Plan:
    """Every launch of a site for streams of one shape, dtype and device, worked out once.

    Shapes: ``n`` streams of width ``C`` over ``T`` tokens; ``Z = n² + 2n``
    coefficient columns. Tile sizes are the best of the sweeps on the H200
    (notes/block_benchmarks.md).
    """

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device):
        n, C = shape[-2:]
        T = shape.numel() // (n * C)
        Z, ZP, NP = n * n + 2 * n, _pow2(n * n + 2 * n, 16), _pow2(n)
        self.T, self.n, self.C, self.Z = T, n, C, Z
        self.cuda_device = device.index if device.type == "cuda" else None
        self.cdt = torch.float64 if dtype == torch.float64 else torch.float32
        acc = _k.acc_type(dtype)
        # bf16/fp16 streams are exact in tf32, so there only φ and dz are rounded
        # (to 10 bits) on the tensor cores; fp32/fp64 streams keep full products.
        # coeff_fwd takes bf16 streams as they are, with φ in two bf16 parts ("bf16x2"). The
        # same split of r·dz in phi_grad was 9-10% slower than tf32 at every C (768-4096).
        numerics = dict(PRECISION="ieee" if dtype in (torch.float32, torch.float64) else "tf32", ACC=acc)
        coeff_numerics = dict(numerics, PRECISION="bf16x2") if dtype == torch.bfloat16 else numerics

        def launch(grid, ints, **meta):
            return _Launch(grid, meta, ints, dtype, device)

        # 64 tokens x 128 columns, 4 warps: the best of 10 shapes for the norm and φ, and of 6 for
        # the pre-mix that follows (bf16, T=16384: 87 µs at C=768, 211 µs at C=2048 with the
        # "bf16x2" products; a separate pre-mix kernel was faster on the GPU but cost a launch
        # and a σ op on the host).
        BM = 64
        self.coeff_fwd = launch(
            (_cdiv(T, BM),), (T, C), n=n, BM=BM, BK=128, BC=128, ZP=ZP, **coeff_numerics, COMPILED=device.type == "cuda",
        )
        # [n, 1024] tiles with 4 warps run at copy speed; 256- or 512-wide tiles, or 8 warps,
        # were 8-30x slower (n=4, C=2048).
        BC = min(4096 // NP, _pow2(C, 16))
        self.postmix_fwd = launch((T, _cdiv(C, BC)), (C,), n=n, NP=NP, BC=BC, ACC=acc)
        # One warp per token beat two by 30% (83 vs 116 µs at C=768, 360 vs 526 µs at C=4096).
        BC = min(max(16, 4096 // (NP * NP)), _pow2(C, 16))
        self.postmix_bwd = launch((T,), (C,), n=n, NP=NP, BC=BC, ACC=acc, num_warps=1)
        self.coeff_bwd = launch((T,), (C,), n=n, NP=NP, ZP=ZP, BC=min(512, _pow2(C, 16)), ACC=acc, num_warps=2)
        # 32-token steps over 128 tokens per program and 64 columns, 4 warps. 32-token steps
        # beat 16 (bf16, T=16384, n=4: 127 vs 149 µs at C=768, 312 vs 341 µs at C=2048; n=8,
        # C=768: 906 vs 1283 µs); loading every operand straight into the [BM, NP, BC] layout,
        # one stream per program, or flat [BM, n·C] tiles were no faster or slower. Wider n
        # narrows the columns to keep φ's block [ZP, NP·BC] at 8K values per program.
        BC, self.stream_tokens = min(64, max(16, 8192 // (ZP * NP)), _pow2(C, 16)), 128
        self.stream_grad = launch(
            (_cdiv(C, BC), _cdiv(T, self.stream_tokens)), (T, C, self.stream_tokens),
            n=n, NP=NP, ZP=ZP, BM=32, BC=BC, **numerics,
            num_warps=4 if ZP * NP * BC <= 8192 else 8,
        )
        K, BT, BN = n * C, 32, 128
        splits = max(1, min(16, T // 1024))
        self.phi_tokens = _cdiv(_cdiv(T, splits), BT) * BT
        self.phi_splits = _cdiv(T, self.phi_tokens)
        self.phi_grad = launch(
            (_cdiv(K, BN), self.phi_splits), (T, K, Z, self.phi_tokens), ZP=ZP, BT=BT, BN=BN, **numerics,
        )
        # The projection's CUDA op directly (n in {4, 8}), without birkhoff_project's checks.
        probe = torch.empty((0, n, n), dtype=self.cdt, device=device)
        self.cuda_projection = _projection_cuda.supports(probe) and _projection_cuda.available()
        self._tol_eff: dict = {}
        self._native_site = None

    def native_site(self):
        """The C++ site's launch handles (``csrc/site.cu``'s ``SiteKernels``), or ``None``.

        ``None`` until Triton's own launches have compiled all six kernels (the
        first fwd+bwd of this shape), whenever :func:`_native_allowed` says no
        (``torch.compile``, functorch, a Triton launch hook), and where the
        projection has no CUDA op (the C++ site calls it).
        """
        if not self.cuda_projection or not _native_allowed():
            return None
        if self._native_site is None:
            launches = ((_coeff_fwd, self.coeff_fwd), (_postmix_fwd, self.postmix_fwd),
                        (_postmix_bwd, self.postmix_bwd), (_coeff_bwd, self.coeff_bwd),
                        (_stream_grad, self.stream_grad), (_phi_grad, self.phi_grad))
            handles = [launcher.native(spec) for launcher, spec in launches]
            if any(h is None for h in handles):
                return None
            self._native_site = _projection_cuda.extension().SiteKernels(
                *handles, self.stream_tokens, self.phi_splits, self.phi_tokens
            )
        return self._native_site

    def projection_tol(self, tol: float) -> float:
        """:func:`~mhc.projection.effective_tol` of ``tol`` for this plan's ``H_res``, worked out once."""
        tol_eff = self._tol_eff.get(tol)
        if tol_eff is None:
            tol_eff = self._tol_eff[tol] = effective_tol(tol, self.n, self.cdt)
        return tol_eff


_PLANS: dict = {}


def _plan(x: Tensor) -> _Plan:
    key = (x.shape, x.dtype, x.device)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 256:  # e.g. generation, one token count per step
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(*key)
    return plan


class _SiteState:
    """One call of a site: its plan and scalars, and what ``_PostMix`` hands ``_SitePre`` in backward.

    The nodes take it as their one non-tensor argument (each argument of
    ``Function.apply`` costs host time). ``d_out`` is ``dx'`` (detached), set
    by ``_PostMix``'s backward.
    """

    __slots__ = ("plan", "eps", "tol", "d_out")

    def __init__(self, plan: _Plan, eps: float, tol: float):
        self.plan, self.eps, self.tol, self.d_out = plan, eps, tol, None


def _dense(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` as a contiguous, 16-byte aligned tensor of ``dtype``; no dispatcher call when it is one.

    Every tensor a kernel sees passes through here or is a fresh allocation,
    which is what lets :class:`_Launcher` reuse compiled variants. A site runs a
    few dozen such calls per step, and on the H200's host each no-op ``.to()`` /
    ``.contiguous()`` still costs microseconds of dispatch.
    """
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if not t.is_contiguous():
        return t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()  # a view at an unaligned offset


class _SitePre(torch.autograd.Function):
    """Streams and coefficient parameters -> ``(u, h, H_res)``.

    One node for the norm, ``φ``, the σ activations, the projection and the
    pre-mix. ``h [T, 2n]`` is σ of H_pre's and H_post's columns (``H_post =
    2·h[:, n:]`` is formed in the kernels that use it). σ has the bits of
    torch's on CUDA, so ``φ = 0`` reproduces :meth:`mhc.MHCBlock.coefficients`
    bit for bit.

    ``x [..., n, C]`` (contiguous) keeps its leading shape through the node,
    and ``u`` has it too: the kernels only need the token count, and
    flattening outside the node would add autograd view nodes.
    """

    @staticmethod
    def forward(ctx, x, phi, alpha, b_pre, b_post, b_res, state: _SiteState):
        plan = state.plan
        T, n, C, Z = plan.T, plan.n, plan.C, plan.Z
        zr = x.new_empty((T, Z + 1), dtype=plan.cdt)  # z and the norm's 1/rms
        h = x.new_empty((T, 2 * n), dtype=plan.cdt)
        R = x.new_empty((T, n, n), dtype=plan.cdt)  # α·z + b of R's columns
        u = x.new_empty((*x.shape[:-2], C))
        _coeff_fwd(plan.coeff_fwd, x, phi, alpha, b_pre, b_post, b_res, zr, h, R, u, T, C, state.eps)
        if plan.cuda_projection:
            H_res = _projection_cuda.project_no_autograd(R, plan.projection_tol(state.tol), NEWTON_MAX_ITER)
        else:
            H_res = birkhoff_project(R, tol=state.tol, max_iter=NEWTON_MAX_ITER)
        ctx.save_for_backward(x, phi, alpha, zr, h, H_res)
        ctx.state = state
        return u, h, H_res

    @staticmethod
    @once_differentiable
    def backward(ctx, du, d_h, d_res):
        x, phi, alpha, zr, h, H_res = ctx.saved_tensors
        state: _SiteState = ctx.state
        plan = state.plan
        needs_dx, needs_dphi = ctx.needs_input_grad[:2]
        # dx' is None when the site's output took no part in the loss (only H_post / H_res did).
        d_out, state.d_out = state.d_out, None
        T, n, C, Z = plan.T, plan.n, plan.C, plan.Z
        d_res = _dense(d_res, plan.cdt)
        # The projection's implicit backward needs only its output (design.md §2).
        if plan.cuda_projection:
            dR = torch.ops.mhc.birkhoff_backward(H_res, d_res)
        else:
            dR = birkhoff_backward(H_res, d_res)
        du = _dense(du)
        work = zr.new_empty((T, 2 * Z + 4))  # per token [r·dz | dv | α's group sums | c2]
        _coeff_bwd(plan.coeff_bwd, du, x, h, _dense(d_h), dR, zr, alpha, work, C)
        _, db_pre, db_post, db_res, d_alpha, _ = work.sum(0).split_with_sizes([Z, n, n, n * n, 3, 1])

        dx = dphi = None
        if needs_dx:
            d_out = d_out if d_out is not None else torch.zeros_like(x)
            dx = torch.empty_like(x)
            _stream_grad(plan.stream_grad, d_out, du, x, work, phi, h, H_res, dx, T, C, plan.stream_tokens)
        if needs_dphi:
            part = zr.new_empty((plan.phi_splits, Z, n * C))
            _phi_grad(plan.phi_grad, work, x, part, T, n * C, Z, plan.phi_tokens)
            dphi = part.sum(0)
        return dx, dphi, d_alpha, db_pre, db_post, db_res.view(n, n), None


class _PostMix(torch.autograd.Function):
    """``(x, y, h, H_res) -> x' = H_res·x + H_post ⊗ y`` with ``H_post = 2·h[:, n:]``.

    ``x [..., n, C]`` and ``y [..., C]`` (contiguous) keep their leading shape, as in :class:`_SitePre`.
    """

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, h: Tensor, h_res: Tensor, state: _SiteState):
        plan = state.plan
        out = torch.empty_like(x)
        _postmix_fwd(plan.postmix_fwd, x, y, h, h_res, out, plan.C)
        ctx.save_for_backward(x, y, h)
        ctx.state = state
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor):
        x, y, h = ctx.saved_tensors
        plan = ctx.state.plan
        dout = _dense(dout)
        dy = torch.empty_like(y)
        g_h = torch.empty_like(h)
        g_res = h.new_empty((plan.T, plan.n, plan.n))
        _postmix_bwd(plan.postmix_bwd, dout, x, y, h, dy, g_h, g_res, plan.C)
        ctx.state.d_out = dout
        return None, dy, g_h, g_res, None


def _direct_apply(function: type):
    """``function.apply`` without the Python layer of ``torch.autograd.Function.apply``.

    That layer binds default arguments (these nodes have none) and unwraps
    functorch's dead wrappers (there are none outside functorch transforms),
    a few microseconds per call on the H200's host. Under functorch transforms
    or ``torch.compile``, which handle ``Function.apply`` themselves, it is
    still called.
    """
    base_apply = super(torch.autograd.Function, function).apply

    def apply(*args):
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return function.apply(*args)
        return base_apply(*args)

    return apply


_site_pre, _post_mix = _direct_apply(_SitePre), _direct_apply(_PostMix)


def mhc_site(
    x: Tensor,
    branch,
    phi: Tensor,
    alpha: Tensor,
    b_pre: Tensor,
    b_post: Tensor,
    b_res: Tensor,
    *,
    norm_eps: float,
    tol: float,
    branch_args: tuple = (),
    branch_kwargs: dict | None = None,
):
    """One mHC site ``x' = H_res·x + H_postᵀ ⊗ F(H_pre·x)`` on the fused kernels.

    Same maths, parameters and outputs as :meth:`mhc.MHCBlock.forward` with
    ``mode="mhc"`` and ``projection="newton"`` (see there); used by it for
    CUDA streams.

    Args:
        x: streams ``[..., n, C]``, float32 / bfloat16 / float16 / float64, on the
            device of the parameters (CUDA; CPU only under
            ``TRITON_INTERPRET=1``).
        branch: the sublayer, called as ``branch(u, *branch_args, **branch_kwargs)``
            with ``u: [..., C]`` in ``x``'s dtype; a tuple result mixes its
            first element and returns the rest beside the new streams.
        phi: ``[n² + 2n, n·C]``; ``alpha [3]``, ``b_pre [n]``, ``b_post [n]``,
            ``b_res [n, n]``; float32 parameters (the coefficients are
            computed in float32, float64 for float64 streams).
        norm_eps: the flattened RMSNorm's epsilon.
        tol: tolerance of the Newton projection (:func:`mhc.birkhoff_project`).

    Returns:
        ``x'`` with the shape and dtype of ``x`` (or ``(x', *rest)``).
    """
    if not available():
        raise RuntimeError(f"mhc.fused needs Triton, which is not importable here ({_TRITON_ERROR})")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused mHC site supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dim() < 2 or x.numel() == 0:
        raise ValueError(f"fused mHC site needs streams [..., n, C] with at least one token, got {tuple(x.shape)}")
    n, C = x.shape[-2:]
    if phi.shape != (n * n + 2 * n, n * C):
        raise ValueError(f"phi must be [{n * n + 2 * n}, {n * C}] for streams [..., {n}, {C}], got {tuple(phi.shape)}")
    if phi.device != x.device:
        raise ValueError(f"streams are on {x.device} but phi is on {phi.device}")
    return run_site(x, branch, phi, alpha, b_pre, b_post, b_res, norm_eps, tol, branch_args, branch_kwargs or {})


def run_site(x, branch, phi, alpha, b_pre, b_post, b_res, norm_eps, tol, branch_args, branch_kwargs):
    """:func:`mhc_site` without its argument checks, for callers that made them (:class:`mhc.MHCBlock`).

    On the H200's host every Python-level check of a site costs microseconds,
    24 sites a step.
    """
    x = _dense(x)  # a strided input is copied once here
    plan = _plan(x)
    if plan.cuda_device is not None and _k.triton.runtime.driver.active.get_current_device() != plan.cuda_device:
        # Triton launches on the current device (autograd's backward threads already set it).
        with torch.cuda.device(plan.cuda_device):
            return run_site(x, branch, phi, alpha, b_pre, b_post, b_res, norm_eps, tol, branch_args, branch_kwargs)
    cdt = plan.cdt
    params = (_dense(phi, cdt), _dense(alpha, cdt), _dense(b_pre, cdt), _dense(b_post, cdt), _dense(b_res, cdt))
    native = plan.native_site()
    if native is not None:  # both nodes in C++
        ext = _projection_cuda.extension()
        u, h, H_res, call = ext.site_pre(native, x, *params, float(norm_eps), plan.projection_tol(tol), NEWTON_MAX_ITER)
        _projection_cuda.poll(x.device)
    else:
        state = _SiteState(plan, float(norm_eps), float(tol))
        u, h, H_res = _site_pre(x, *params, state)
    out = branch(u, *branch_args, **branch_kwargs)
    y, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
    if y.shape != u.shape:
        raise ValueError(f"branch returned shape {tuple(y.shape)}; MHCBlock needs {tuple(u.shape)}")
    y = _dense(y, x.dtype)
    x_new = ext.post_mix(call, x, y, h, H_res) if native is not None else _post_mix(x, y, h, H_res, state)
    return x_new if rest is None else (x_new, *rest)
