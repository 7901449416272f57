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
implicit backward needs only ``H_res``), and each backward is one kernel per
memory pass plus a couple of small reductions.

Backward order is fixed by the graph: ``_PostMix``, ``F``, then
``_SitePre``. ``_PostMix`` returns no gradient for ``x``; it leaves ``dx'``
in a per-call :class:`_SiteState`, and ``_SitePre`` writes the whole ``dx``
in one pass (separate gradients would cost extra reads and writes of the
streams to add up). Double backward is not supported.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .projection import birkhoff_project, newton_grad

__all__ = ["available", "mhc_site", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

try:
    from . import fused_kernels as _k
except ImportError:  # no Triton (CPU-only PyTorch builds)
    _k = None


def _arg_key(a):
    # What Triton specializes a compiled variant on: dtypes, 16-byte alignment of
    # pointers, and integers equal to 1, divisible by 16 or beyond int32.
    if isinstance(a, Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, int):
        return int, a == 1, a % 16 == 0, -(2**31) <= a < 2**31
    return type(a)


class _Launcher:
    """``launcher[grid](*args, **constexprs)`` for one Triton kernel, with less host time per call.

    ``kernel[grid](...)`` binds and specializes every argument again on each
    call (15-40 µs of host time on the H200's host, measured); a site makes
    seven launches per step, and at the width of a ~125M model host time, not
    the GPU, sets the step time. The compiled variant depends only on the
    constexprs, the current device and :func:`_arg_key` of each argument, so
    after Triton's own first launch of a variant this keeps it and makes the
    call Triton would make (launch hooks included). Positional arguments must
    be the kernel's leading (runtime) parameters and the keywords its
    constexprs (plus launch options such as ``num_warps``). Under Triton's
    interpreter and under ``torch.compile`` every call takes Triton's own path.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.variants = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **meta):
        # Triton's interpreter (CPU tensors), and torch.compile, which traces
        # Triton's own launch as a user-defined kernel, take Triton's path.
        if not args[0].is_cuda or torch.compiler.is_compiling():
            self.kernel[grid](*args, **meta)
            return
        # Triton's own device and stream getters: torch.cuda.current_stream().cuda_stream
        # took 7.7-8.5 µs per call on the H200's host (timed alone), the getter 0.13 µs.
        driver = _k.triton.runtime.driver.active
        device = driver.get_current_device()
        key = (device, tuple(meta.items()), tuple(map(_arg_key, args)))
        hit = self.variants.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **meta)
            # Triton before its `knobs` module is not handled.
            if getattr(compiled, "function", None) is not None and hasattr(_k.triton, "knobs"):
                self.variants[key] = (compiled, tuple(meta[name] for name in self.kernel.arg_names[len(args):]))
            return
        compiled, constexprs = hit
        full = (*args, *constexprs)
        gx, gy, gz = (*grid, 1, 1)[:3]
        stream = driver.get_current_stream(device)
        runtime = _k.triton.knobs.runtime
        compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *full), runtime.launch_enter_hook,
                     runtime.launch_exit_hook, *full)


if _k is not None:
    _coeff_fwd, _premix_fwd, _postmix_fwd, _postmix_bwd, _coeff_bwd, _stream_grad, _phi_grad = map(
        _Launcher,
        (_k.coeff_fwd, _k.premix_fwd, _k.postmix_fwd, _k.postmix_bwd, _k.coeff_bwd, _k.stream_grad, _k.phi_grad),
    )


def available() -> bool:
    """Whether the Triton kernels can be used (Triton importable)."""
    return _k is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(v: int, lo: int = 1) -> int:
    return max(lo, 1 << (int(v) - 1).bit_length())


def _coef_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _numerics(x: Tensor) -> dict:
    # bf16/fp16 streams are exact in tf32, so there only φ and dz are rounded
    # (to 10 bits) on the tensor cores; fp32/fp64 streams keep full products.
    precise = x.dtype in (torch.float32, torch.float64)
    return dict(PRECISION="ieee" if precise else "tf32", ACC=_k.acc_type(x.dtype))


class _SiteState:
    """What ``_PostMix`` hands to ``_SitePre`` in backward: ``dx'`` (detached)."""

    __slots__ = ("d_out",)

    def __init__(self):
        self.d_out = None


def _dense(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` as a contiguous tensor of ``dtype``, with no dispatcher call when it already is one.

    A site runs a few dozen such calls per step, and on the H200's host each
    no-op ``.to()`` / ``.contiguous()`` / ``.reshape()`` still costs
    microseconds of dispatch (notes/block_benchmarks.md).
    """
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


class _SitePre(torch.autograd.Function):
    """Streams and coefficient parameters -> ``(u, h, H_res)``.

    One node for the norm, ``φ``, the σ activations, the projection and the
    pre-mix. ``h [T, 2n]`` is σ of H_pre's and H_post's columns (``H_post =
    2·h[:, n:]`` is formed in the kernels that use it). σ is PyTorch's, so
    ``φ = 0`` reproduces :meth:`mhc.MHCBlock.coefficients` bit for bit.

    ``x [..., n, C]`` (contiguous) keeps its leading shape through the node,
    and ``u`` has it too: the kernels only need the token count, and
    flattening outside the node would add autograd view nodes.
    """

    @staticmethod
    def forward(ctx, x, phi, alpha, b_pre, b_post, b_res, eps: float, tol: float, state: _SiteState):
        n, C = x.shape[-2:]
        T = x.numel() // (n * C)
        cdt = _coef_dtype(x)
        z = x.new_empty((T, n * n + 2 * n), dtype=cdt)
        r = x.new_empty((T,), dtype=cdt)
        v = x.new_empty((T, 2 * n), dtype=cdt)  # α·z + b of H_pre's and H_post's columns (σ taken in place)
        R = x.new_empty((T, n, n), dtype=cdt)  # ... and of R's
        # Measured on the H200 (n=4, T=16384): 64 x 128 tiles, 4 warps, were the best of
        # 10 shapes (80 µs at C=768, 394 µs at C=4096; notes/block_benchmarks.md).
        BM, BK = 64, 128
        _coeff_fwd[(_cdiv(T, BM),)](
            x, phi, alpha, b_pre, b_post, b_res, z, r, v, R, T, n * C, eps,
            n=n, BM=BM, BK=BK, ZP=_pow2(z.shape[1], 16), **_numerics(x),
        )
        h = v.sigmoid_()  # in place: the same bits as torch.sigmoid, one allocation fewer
        H_res = birkhoff_project(R, tol=tol)

        u = x.new_empty((*x.shape[:-2], C))
        BC = min(4096 // _pow2(n), _pow2(C, 16))
        _premix_fwd[(T, _cdiv(C, BC))](x, h, u, C, 2 * n, n=n, NP=_pow2(n), BC=BC, ACC=_k.acc_type(x.dtype))
        ctx.save_for_backward(x, phi, alpha, z, r, h, H_res)
        ctx.state = state
        return u, h, H_res

    @staticmethod
    @once_differentiable
    def backward(ctx, du, d_h, d_res):
        x, phi, alpha, z, r, h, H_res = ctx.saved_tensors
        state: _SiteState = ctx.state
        n, C = x.shape[-2:]
        T, Z = z.shape
        ZP = _pow2(Z, 16)
        du = _dense(du)
        dR = newton_grad(H_res, d_res)
        dzr = torch.empty_like(z)
        c2 = torch.empty_like(r)
        rows = z.new_empty((T, Z + 3))
        _coeff_bwd[(T,)](
            du, x, h, _dense(d_h), dR, z, r, alpha, dzr, c2, rows, C,
            n=n, NP=_pow2(n), ZP=ZP, BC=min(512, _pow2(C, 16)), ACC=_k.acc_type(x.dtype), num_warps=2,
        )
        db_pre, db_post, db_res, d_alpha = rows.sum(0).split([n, n, n * n, 3])

        dx = dphi = None
        if ctx.needs_input_grad[0]:
            # No dx' when the site's output took no part in the loss (only H_post / H_res did).
            d_out = state.d_out if state.d_out is not None else torch.zeros_like(x)
            dx = torch.empty_like(x)
            # Measured on the H200 (n=4, T=16384): 16-token steps over 128 tokens per
            # program and 64 columns, 4 warps: 118 µs at C=768, 511 µs at C=4096. Wider n
            # narrows the columns to keep φ's block [ZP, NP·BC] at 8K values per program.
            NP, BM, TB = _pow2(n), 16, 128
            BC = min(64, max(16, 8192 // (ZP * NP)), _pow2(C, 16))
            _stream_grad[(_cdiv(C, BC), _cdiv(T, TB))](
                d_out, du, x, dzr, c2, phi, h, H_res, dx, T, C, TB,
                n=n, NP=NP, ZP=ZP, BM=BM, BC=BC, **_numerics(x), num_warps=4 if ZP * NP * BC <= 8192 else 8,
            )
        if ctx.needs_input_grad[1]:
            K = n * C
            BT, BN = 32, 128
            splits = max(1, min(16, T // 1024))
            per = _cdiv(_cdiv(T, splits), BT) * BT
            splits = _cdiv(T, per)
            part = x.new_empty((splits, Z, K), dtype=z.dtype)
            _phi_grad[(_cdiv(K, BN), splits)](dzr, x, part, T, K, Z, per, ZP=ZP, BT=BT, BN=BN, **_numerics(x))
            dphi = part.sum(0)
        state.d_out = None
        return dx, dphi, d_alpha, db_pre, db_post, db_res.view(n, n), None, None, None


class _PostMix(torch.autograd.Function):
    """``(x, y, h, H_res) -> x' = H_res·x + H_post ⊗ y`` with ``H_post = 2·h[:, n:]``.

    ``x [..., n, C]`` and ``y [..., C]`` (contiguous) keep their leading shape, as in :class:`_SitePre`.
    """

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, h: Tensor, h_res: Tensor, state: _SiteState):
        n, C = x.shape[-2:]
        T = h.shape[0]
        out = torch.empty_like(x)
        # Measured on the H200 (n=4, C=2048): [n, 1024] tiles with 4 warps run at
        # copy speed; 256- or 512-wide tiles, or 8 warps, were 8-30x slower.
        BC = min(4096 // _pow2(n), _pow2(C, 16))
        _postmix_fwd[(T, _cdiv(C, BC))](x, y, h, h_res, out, C, n=n, NP=_pow2(n), BC=BC, ACC=_k.acc_type(x.dtype))
        ctx.save_for_backward(x, y, h)
        ctx.state = state
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor):
        x, y, h = ctx.saved_tensors
        n, C = x.shape[-2:]
        T = h.shape[0]
        dout = _dense(dout)
        dy = torch.empty_like(y)
        g_h = torch.empty_like(h)
        g_res = h.new_empty((T, n, n))
        NP = _pow2(n)
        # Measured on the H200 (n=4, T=16384): one warp per token beat two by 30%
        # at C=768 and C=4096 (83 vs 116 µs, 360 vs 526 µs).
        BC = min(max(16, 4096 // (NP * NP)), _pow2(C, 16))
        _postmix_bwd[(T,)](
            dout, x, y, h, dy, g_h, g_res, C, n=n, NP=NP, BC=BC, ACC=_k.acc_type(x.dtype), num_warps=1,
        )
        ctx.state.d_out = dout
        return None, dy, g_h, g_res, None


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
    if _k is None:
        raise RuntimeError("mhc.fused needs Triton, which this PyTorch install does not have")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused mHC site supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dim() < 2 or x.numel() == 0:
        raise ValueError(f"fused mHC site needs streams [..., n, C] with at least one token, got {tuple(x.shape)}")
    n, C = x.shape[-2:]
    if phi.shape != (n * n + 2 * n, n * C):
        raise ValueError(f"phi must be [{n * n + 2 * n}, {n * C}] for streams [..., {n}, {C}], got {tuple(phi.shape)}")
    if phi.device != x.device:
        raise ValueError(f"streams are on {x.device} but phi is on {phi.device}")
    lead = x.shape[:-2]
    x = _dense(x)  # a strided input is copied once here
    cdt = _coef_dtype(x)
    state = _SiteState()
    u, h, H_res = _SitePre.apply(
        x, _dense(phi, cdt), _dense(alpha, cdt), _dense(b_pre, cdt), _dense(b_post, cdt), _dense(b_res, cdt),
        float(norm_eps), float(tol), state,
    )
    out = branch(u, *branch_args, **(branch_kwargs or {}))
    y, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
    if y.shape != (*lead, C):
        raise ValueError(f"branch returned shape {tuple(y.shape)}; MHCBlock needs {(*lead, C)}")
    x_new = _PostMix.apply(x, _dense(y, x.dtype), h, H_res, state)
    return x_new if rest is None else (x_new, *rest)
