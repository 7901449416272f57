"""Launch plans and direct launches of the fused site's Triton kernels (internal to :mod:`mhc.fused`).

Imported by :mod:`mhc.fused` only once :mod:`mhc.fused.kernels` has imported.
A :class:`Plan` holds every launch of a site for one shape, dtype and device,
worked out once; a :class:`Launcher` launches one kernel with the compiled
variant Triton's own first launch built, skipping Triton's argument binding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..projection import cuda as _projection_cuda
from ..projection import effective_tol
from ..projection.common import is_traced
from . import kernels as _k
from . import tokens as _tokens

# Bytes of shared memory a kernel's pipelined tiles may take (the H200 has 227 KB a block).
SHARED_MEMORY_BUDGET = 192 * 1024

# Whether torch.compile can trace the kernels' launches: not under Triton's interpreter
# (TRITON_INTERPRET=1), whose kernels are plain Python functions.
TRACEABLE = isinstance(_k.coeff_fwd, _k.triton.runtime.JITFunction)

__all__ = [
    "TRACEABLE",
    "Launcher",
    "Launch",
    "Plan",
    "LAUNCHERS",
    "NORM_MAX_C",
    "fused_norm_fits",
    "plan_for",
    "clear",
    "compiled_variants",
]


class Launcher:
    """``launcher(spec, *args)``: one Triton kernel, with less host time per call.

    ``kernel[grid](...)`` binds and specializes every argument again on each
    call (15-40 µs of host time on the H200's host, measured), and at the width
    of a ~125M model host time, not the GPU, sets the step time. Every argument
    mhc.fused passes is contiguous and 16-byte aligned (``mhc.fused._dense``), its
    dtype follows from the streams', and its integers from their shape, so the
    compiled variant is fixed by the :class:`Launch` spec that :class:`Plan`
    builds once per shape. After Triton's own first launch of a variant this
    keeps it and makes the call Triton would make (launch hooks included).
    Positional arguments are the kernel's runtime parameters; the spec holds its
    constexprs. Under Triton's interpreter every call takes Triton's own path;
    under ``torch.compile`` the launch is traced (:mod:`mhc.fused.ops`).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.variants = {}

    def __call__(self, spec: Launch, *args) -> None:
        if is_traced(args[0]):
            # Inside an op of mhc.fused.ops under torch.compile. With Triton compiled, the op is
            # a triton_op, and this records the launch for inductor to make. Under Triton's
            # interpreter the op stays opaque and this trace only works out its output shapes.
            if TRACEABLE:
                torch.library.wrap_triton(self.kernel)[spec.grid](*args, **spec.meta)
            return
        if not spec.cached:
            self.kernel[spec.grid](*args, **spec.meta)
            return
        hit = self.variants.get(spec.variant)
        if hit is None:
            compiled = self.kernel[spec.grid](*args, **spec.meta)
            # Triton before its `knobs` module is not handled.
            if getattr(compiled, "function", None) is not None and hasattr(_k.triton, "knobs"):
                constexprs = tuple(spec.meta[name] for name in self.kernel.arg_names[len(args) :])
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


def _hook(hook):
    """A Triton launch hook, or ``None`` for an empty ``HookChain``.

    Triton 3.5+ keeps its hooks in chains that are never ``None``; with a chain,
    Triton's own launch builds the launch metadata and calls both chains on
    every launch, though no hook is installed.
    """
    return None if hook is None or getattr(hook, "calls", None) == [] else hook


class Launch:
    """Grid and constexprs of one kernel launch, and the key of its compiled variant."""

    __slots__ = ("grid", "grid3", "meta", "device", "cached", "variant")

    def __init__(self, grid: tuple, meta: dict, ints: tuple, dtypes: tuple, device: torch.device):
        self.grid, self.grid3, self.meta = grid, (*grid, 1, 1)[:3], meta
        self.cached = device.type == "cuda"
        self.device = device.index
        # What Triton specializes a variant on, besides the (fixed) pointer alignment and the
        # pointers' dtypes (``dtypes``: the streams' and u's): integers equal to 1, divisible
        # by 16, or beyond int32.
        int_key = tuple((i == 1, i % 16 == 0, -(2**31) <= i < 2**31) for i in ints)
        self.variant = (self.device, dtypes, int_key, tuple(meta.items()))


LAUNCHERS: dict[str, Launcher] = {
    name: Launcher(getattr(_k, name))
    for name in (
        "coeff_partial",
        "coeff_fwd",
        "postmix_fwd",
        "postmix_bwd",
        "coeff_bwd",
        "stream_grad",
        "phi_grad",
    )
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split(total: int, parts: int, step: int) -> tuple[int, int]:
    """``(per, count)``: ``total`` in at most ``parts`` pieces of ``per``, a multiple of ``step``, covering it once."""
    per = _cdiv(_cdiv(total, parts), step) * step
    return per, _cdiv(total, per)


def _pow2(v: int, lo: int = 1) -> int:
    return max(lo, 1 << (int(v) - 1).bit_length())


class Plan:
    """Every launch of a site for streams of one shape, dtype and device, worked out once.

    Shapes: ``n`` streams of width ``C`` over ``T`` tokens; ``Z = n² + 2n``
    coefficient columns. Tile sizes are the best of the sweeps on the H200
    (notes/block_benchmarks.md). ``u_dtype``: the dtype of the sublayer's
    input ``u`` and of its gradient (:func:`mhc.site.branch_input_dtype`;
    default the streams').
    """

    def __init__(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        u_dtype: torch.dtype | None = None,
        norm_dtype: torch.dtype | None = None,
    ):
        n, C = shape[-2:]
        u_dtype = dtype if u_dtype is None else u_dtype
        T = shape.numel() // (n * C)
        Z, ZP, NP = n * n + 2 * n, _pow2(n * n + 2 * n, 16), _pow2(n)
        self.T, self.n, self.C, self.Z, self.ZP = T, n, C, Z, ZP
        self.cuda_device = device.index if device.type == "cuda" else None
        self.u_dtype = u_dtype
        # With norm_dtype (its weight's dtype) the site applies the branch's input RMSNorm too
        # (fused_norm_fits): coeff_fwd writes the norm's output, in normed_dtype (HF's: the weight's
        # and u's dtypes promoted), instead of u, and the backward takes its gradient instead of u's.
        normed_dtype = None if norm_dtype is None else torch.promote_types(norm_dtype, u_dtype)
        self.normed_dtype = normed_dtype
        norm = dict(NORM=normed_dtype is not None, ROUND=ROUND_CODES.get(u_dtype, 0) if normed_dtype else 0)
        self.cdt = torch.float64 if dtype == torch.float64 else torch.float32
        acc = dtype == torch.float64  # ACC64: the kernels' accumulator is float64
        # bf16/fp16 streams are exact in tf32, so there only φ and dz are rounded
        # (to 10 bits) on the tensor cores. fp32 streams (fp32 weights under bf16 autocast)
        # take "tf32x3", three tf32 products on the tensor cores: as near float64 as "ieee"
        # (2-3e-7 relative) and 8.5-9.5x faster in coeff_partial, where "ieee" is an FMA loop
        # at 1/20 of the byte floor (the fp32 sweep, notes/block_benchmarks.md). fp64 keeps "ieee".
        # coeff_fwd takes bf16 streams as they are, with φ in two bf16 parts ("bf16x2"). The
        # same split of r·dz in phi_grad was 9-10% slower than tf32 at every C (768-4096).
        fp32 = dtype == torch.float32
        precision = {torch.float32: "tf32x3", torch.float64: "ieee"}.get(dtype, "tf32")
        numerics = dict(PRECISION=precision, ACC64=acc)
        coeff_numerics = dict(numerics, PRECISION="bf16x2") if dtype == torch.bfloat16 else numerics

        def launch(grid, ints, **meta):
            return Launch(grid, meta, ints, (dtype, u_dtype, norm_dtype), device)

        # The dot products: 64 tokens x 128 columns, 4 warps, 4 stages, split over n·C until the
        # grid has ~256 programs (two per SM on the H200). bf16, n=4, one site, do_bench:
        # 1.1B (C=2048, T=8192) 2 splits; 134M (C=768, T=16384) none (sweep_site_kernels.py and
        # notes/block_benchmarks.md). Then σ and the pre-mix, 8 tokens x 256 columns a program.
        # Together 93.6 / 73.1 µs against 154.3 / 86.5 for the one kernel of 64-token
        # programs this replaced, which left the 1.1B's GPU with 128 programs.
        # Triton's pipeline holds num_stages - 1 copies of a step's tiles in shared memory (227 KB on
        # the H200): 4 stages where they fit in 192 KB (n <= 4 in bf16 or fp32), fewer for wide n or fp64.
        # fp32 streams: 128 tokens x 32 columns, 8 warps, 3 stages, 4 splits (~512 programs); at
        # C = 512 / 768 / 2048 within 3% of the best of the fp32 sweep, which this plan took.
        BM, BK, K = (128, 32, n * C) if fp32 else (64, 128, n * C)
        programs = 512 if fp32 else 256
        step_bytes = BK * (BM * dtype.itemsize + ZP * self.cdt.itemsize)
        self.coeff_k_per_split, self.coeff_splits = _split(K, min(4, _cdiv(programs, _cdiv(T, BM))), BK)
        self.coeff_partial = launch(
            (_cdiv(T, BM), self.coeff_splits),
            (T, C, self.coeff_k_per_split),
            n=n,
            BM=BM,
            BK=BK,
            ZP=ZP,
            **coeff_numerics,
            COMPILED=device.type == "cuda",
            num_warps=8 if fp32 else 4,
            num_stages=max(1, min(3 if fp32 else 4, 1 + SHARED_MEMORY_BUDGET // step_bytes)),
        )
        # With the norm, a program holds whole rows: up to 4K values of u a tile (8 tokens at C = 512,
        # 2 at C = 2048), 4 warps; C = 8192 at most (NORM_MAX_C), one token and 8 warps.
        if normed_dtype is None:
            BM, BC, warps = 8, min(256, _pow2(C, 16)), 4
        else:
            BC = _pow2(C, 16)
            BM = max(1, min(8, 4096 // BC))
            warps = max(4, BM * BC // 1024)
        self.coeff_fwd = launch(
            (_cdiv(T, BM),),
            (T, C, self.coeff_splits),
            n=n,
            BM=BM,
            BC=BC,
            ZP=ZP,
            ACC64=acc,
            COMPILED=device.type == "cuda",
            **norm,
            num_warps=warps,
        )
        # [n, 1024] tiles with 4 warps run at copy speed; 256- or 512-wide tiles, or 8 warps,
        # were 8-30x slower (n=4, C=2048). As many warps as 16-byte loads of a row fill (up to 4):
        # more split the n rows across warps, and the sum over them then goes through shared memory.
        # bf16 at C = 512 (small_gpu): 4 warps 326 µs, 2 warps 56.4 (0.92x a copy; H100, the sweep).
        BC = min(4096 // NP, _pow2(C, 16))
        warps = max(1, min(4, BC * dtype.itemsize // (32 * 16)))
        self.postmix_fwd = launch((T, _cdiv(C, BC)), (C,), n=n, NP=NP, BC=BC, ACC64=acc, num_warps=warps)
        # One warp per token beat two by 30% (83 vs 116 µs at C=768, 360 vs 526 µs at C=4096).
        BC = min(max(16, 4096 // (NP * NP)), _pow2(C, 16))
        self.postmix_bwd = launch((T,), (C,), n=n, NP=NP, BC=BC, ACC64=acc, num_warps=1)
        # 1 warp, 256 columns: 42.6 / 52.2 µs at C = 768 / 2048 against 46.5 / 53.1 for 2 warps x 512.
        self.coeff_bwd = launch(
            (T,), (C,), n=n, NP=NP, ZP=ZP, BC=min(256, _pow2(C, 16)), ACC64=acc, **norm, num_warps=1
        )
        # 64 columns, 4 warps. Up to n=4: 64-token steps over 256 tokens per program, loads not
        # pipelined (num_stages=1): 117.1 / 152.4 µs at C = 768 / 2048 against 124.8 / 169.6 for
        # 32 over 128 with 3 stages (bf16, n=4, do_bench, sweep_site_kernels.py). Wider n keeps
        # 32-token steps over 128, which beat 16 (n=8, C=768: 906 vs 1283 µs). Loading every
        # operand straight into the [BM, NP, BC] layout, one stream per program, or flat [BM, n·C]
        # tiles were no faster or slower. Wider n narrows the columns to keep φ's block
        # [ZP, NP·BC] at 8K values per program.
        # fp32 streams up to n=4: 16-token steps over 32 columns, 3 stages, at 0.90-0.95x a device
        # copy (2.6x the bf16 tiles' speed on fp32 streams; the fp32 sweep).
        BC = min(64, max(16, 8192 // (ZP * NP)), _pow2(C, 16))
        BM, self.stream_tokens, stages = (64, 256, 1) if NP <= 4 else (32, 128, 3)
        if fp32 and NP <= 4:
            BC, BM, self.stream_tokens, stages = min(32, BC), 16, 256, 3
        self.stream_grad = launch(
            (_cdiv(C, BC), _cdiv(T, self.stream_tokens)),
            (T, C, self.stream_tokens),
            n=n,
            NP=NP,
            ZP=ZP,
            BM=BM,
            BC=BC,
            **numerics,
            **norm,
            num_warps=4 if ZP * NP * BC <= 8192 else 8,
            num_stages=stages,
        )
        self.stream_programs = _cdiv(T, self.stream_tokens)  # rows of the norm weight's partial sums
        BT, BN = 32, 128
        self.phi_tokens, self.phi_splits = _split(T, max(1, min(16, T // 1024)), BT)
        self.phi_grad = launch(
            (_cdiv(K, BN), self.phi_splits),
            (T, K, Z, self.phi_tokens),
            ZP=ZP,
            BT=BT,
            BN=BN,
            **numerics,
        )
        # The projection's CUDA op directly (n in {4, 8}), without birkhoff_project's checks.
        probe = torch.empty((0, n, n), dtype=self.cdt, device=device)
        self.cuda_projection = _projection_cuda.supports(probe) and _projection_cuda.available()
        # A few tokens (a decode step): both forwards run on the extension's token kernels,
        # which write u in the streams' dtype.
        self.tokens = u_dtype == dtype and normed_dtype is None and _tokens.takes_shape(shape, dtype, device)
        self._tol_eff: dict = {}

    def projection_tol(self, tol: float) -> float:
        """:func:`~mhc.projection.effective_tol` of ``tol`` for this plan's ``H_res``, worked out once."""
        tol_eff = self._tol_eff.get(tol)
        if tol_eff is None:
            tol_eff = self._tol_eff[tol] = effective_tol(tol, self.n, self.cdt)
        return tol_eff


# The rounding of u's dtype that the kernels apply where they form u without storing it (the NORM
# variants): ROUND in mhc.fused.kernels._round.
ROUND_CODES = {torch.bfloat16: 1, torch.float16: 2}

# The widest C whose rows one program of coeff_fwd holds with the branch's norm applied.
NORM_MAX_C = 8192


def fused_norm_fits(C: int) -> bool:
    """Whether the site's kernels can apply the branch's input RMSNorm at width ``C``."""
    return C <= NORM_MAX_C


_PLANS: dict = {}


def plan_for(x: Tensor, u_dtype: torch.dtype | None = None, norm_dtype: torch.dtype | None = None) -> Plan:
    """The :class:`Plan` of streams ``x [..., n, C]`` (by shape, dtype and device), ``u_dtype``
    (default ``x``'s) and ``norm_dtype`` (the branch's norm applied, with a weight of this dtype:
    :class:`Plan`), made on first use."""
    key = (x.shape, x.dtype, x.device, x.dtype if u_dtype is None else u_dtype, norm_dtype)
    if is_traced(x):
        return Plan(*key)  # traced once; the shape may be symbolic, and then not a key
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 256:  # e.g. generation, one token count per step
            _PLANS.clear()
        plan = _PLANS[key] = Plan(*key)
    return plan


def clear() -> None:
    """Forget every plan and every kept compiled variant (see :func:`mhc.fused.clear_plans`)."""
    _PLANS.clear()
    for launcher in LAUNCHERS.values():
        launcher.variants.clear()


def compiled_variants() -> dict[str, int]:
    """``{kernel name: kept variants}`` (see :func:`mhc.fused.compiled_variants`)."""
    return {name: len(launcher.variants) for name, launcher in LAUNCHERS.items()}
