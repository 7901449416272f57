"""One site of ``sweep_site_kernels.py``: its inputs at a shape and dtype and each of the seven kernels' launch
(:class:`Site`), and the worker processes of ``--jobs``, which only compile the variants on compile-only sites."""

from __future__ import annotations

import time

import torch
import triton
from sweep_grid import DTYPES, N_STREAMS

# Stream-sized tensors (the streams' dtype) and the coefficients (float32, or float64 for float64 streams).
STREAM_TENSORS = ("x", "u", "y", "dout", "dy", "du")
COEFF_TENSORS = (
    "phi",
    "alpha",
    "b_pre",
    "b_post",
    "b_res",
    "zr",
    "h",
    "H_res",
    "g_h",
    "g_res",
    "dR",
    "work",
    "part",
)


class Site:
    """One site's inputs and intermediate tensors at streams ``[T, n, C]`` of ``dtype``, and each kernel's call.

    ``compute=False``: a stand-in for compiling only (the workers of ``--jobs``): the real plan and integers,
    every tensor a small one of the right dtype; :meth:`run` then compiles a variant (Triton's ``warmup``)
    without launching it.
    """

    def __init__(
        self,
        C: int,
        T: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cuda",
        seed: int = 0,
        compute: bool = True,
    ):
        from mhc.fused import plan as fused_plan
        from mhc.fused import steps as fused_steps
        from mhc.projection import birkhoff_backward

        n = N_STREAMS
        Z = n * n + 2 * n
        self.C, self.T, self.n, self.Z, self.dtype = C, T, n, Z, dtype
        self.launchers = fused_plan.LAUNCHERS
        self.compile_only = not compute
        dev = torch.empty(0, device=device).device  # with its index, as the plan keys it
        if not compute:
            self.plan = fused_plan.Plan(torch.Size((T, n, C)), dtype, dev)
            for name in STREAM_TENSORS:
                setattr(self, name, torch.empty(64, dtype=dtype, device=dev))
            for name in COEFF_TENSORS:
                setattr(self, name, torch.empty(64, dtype=self.plan.cdt, device=dev))
            return
        g = torch.Generator(device=dev).manual_seed(seed)
        self.x = torch.randn((T, n, C), device=dev, generator=g).to(dtype)
        self.phi = 0.02 * torch.randn((Z, n * C), device=dev, generator=g)
        self.alpha = torch.tensor([0.5, 0.7, 0.9], device=dev)
        self.b_pre = 0.1 * torch.randn(n, device=dev, generator=g)
        self.b_post = 0.1 * torch.randn(n, device=dev, generator=g)
        self.b_res = torch.randn((n, n), device=dev, generator=g)
        self.plan = plan = fused_plan.plan_for(self.x)
        self.u, self.zr, self.h, self.H_res = fused_steps.pre_forward(
            plan, self.x, self.phi, self.alpha, self.b_pre, self.b_post, self.b_res, 1e-6, 1e-5
        )
        self.y = torch.randn((T, C), device=dev, generator=g).to(dtype)
        self.dout = torch.randn((T, n, C), device=dev, generator=g).to(dtype)
        self.dy, self.g_h, self.g_res = fused_steps.post_backward(plan, self.dout, self.x, self.y, self.h)
        self.du = torch.randn((T, C), device=dev, generator=g).to(dtype)
        if plan.cuda_projection:  # as fused_steps.pre_backward does
            self.dR = torch.ops.mhc.birkhoff_backward(self.H_res, self.g_res)
        else:
            self.dR = birkhoff_backward(self.H_res, self.g_res)
        self.part = self.zr.new_empty(
            (plan.coeff_splits, T, plan.ZP)
        )  # the plan's partial sums, for coeff_fwd
        self.launchers["coeff_partial"](
            plan.coeff_partial, self.x, self.phi, self.part, T, C, plan.coeff_k_per_split
        )
        (self.work,) = self.run("coeff_bwd", None)  # for stream_grad and phi_grad

    def float64(self) -> Site:
        """The same site with every tensor in float64 (the same values) and the float64 plan: the reference."""
        from mhc.fused import plan as fused_plan

        ref = object.__new__(Site)
        ref.__dict__.update({k: v.double() if torch.is_tensor(v) else v for k, v in self.__dict__.items()})
        ref.dtype = torch.float64
        ref.plan = fused_plan.plan_for(ref.x)
        assert ref.plan.coeff_splits == self.plan.coeff_splits  # coeff_fwd reads self.part's splits
        return ref

    def plan_params(self, kernel: str, precision: bool = False) -> dict:
        """The plan's own values of the swept parameters (``num_stages`` Triton's default, 3)."""
        launch = getattr(self.plan, kernel)
        meta = dict(launch.meta)
        p = {k: meta[k] for k in ("BM", "BK", "BC", "BT", "BN") if k in meta}
        p["num_warps"] = meta.get("num_warps", 4)
        p["num_stages"] = meta.get("num_stages", 3)
        if kernel == "stream_grad":
            p["tokens"] = self.plan.stream_tokens
        if kernel == "phi_grad":
            p["splits"] = self.plan.phi_splits
        if kernel == "coeff_partial":
            p["splits"] = self.plan.coeff_splits
        if precision and "PRECISION" in meta:
            p["PRECISION"] = meta["PRECISION"]
        return p

    def run(self, kernel: str, params: dict | None) -> tuple | None:
        """Launch ``kernel`` with ``params`` (``None``: the plan's launch); return its outputs (fresh tensors).

        Under ``compute=False``: compile it only, and return ``None``.
        """
        plan, T, n, C, Z = self.plan, self.T, self.n, self.C, self.Z
        k = self.launchers[kernel].kernel
        launch = getattr(plan, kernel)
        meta = dict(launch.meta)
        params = dict(params or {})
        tokens, splits = params.pop("tokens", None), params.pop("splits", None)
        meta.update(params)
        cdiv = triton.cdiv

        def go(grid, *args):
            if not self.compile_only:
                k[grid](*args, **meta)
            elif self.x.is_cuda:  # the interpreter has nothing to compile
                k.warmup(*args, grid=grid, **meta)

        if kernel == "coeff_partial":
            splits = splits or plan.coeff_splits
            per = cdiv(cdiv(n * C, splits), meta["BK"]) * meta["BK"]
            splits = cdiv(n * C, per)
            part = self.zr.new_empty((splits, T, plan.ZP))
            go((cdiv(T, meta["BM"]), splits), self.x, self.phi, part, T, C, per)
            if self.compile_only:
                return None
            s = part.sum(0)
            return s[:, :Z], s[:, Z]  # x φᵀ and Σ x², each against its own scale
        if kernel == "coeff_fwd":
            zr, h, R, u = (
                torch.empty_like(self.zr),
                torch.empty_like(self.h),
                torch.empty_like(self.H_res),
                torch.empty_like(self.u),
            )
            go(
                (cdiv(T, meta["BM"]),),
                self.part,
                self.x,
                self.alpha,
                self.b_pre,
                self.b_post,
                self.b_res,
                zr,
                h,
                R,
                u,
                self.alpha,  # the norm's weight and 1/rms: unused without the branch norm (NORM=False)
                self.zr,
                T,
                C,
                1e-6,
                plan.coeff_splits,
                0.0,
            )
            return None if self.compile_only else (zr, h, R, u)
        if kernel == "postmix_fwd":
            out = torch.empty_like(self.x)
            go((T, cdiv(C, meta["BC"])), self.x, self.y, self.h, self.H_res, out, C)
            return None if self.compile_only else (out,)
        if kernel == "postmix_bwd":
            dy, g_h, g_res = (
                torch.empty_like(self.dy),
                torch.empty_like(self.g_h),
                torch.empty_like(self.g_res),
            )
            go((T,), self.dout, self.x, self.y, self.h, dy, g_h, g_res, C)
            return None if self.compile_only else (dy, g_h, g_res)
        if kernel == "coeff_bwd":
            work = self.zr.new_empty((T, 2 * Z + 4))
            unused = (self.alpha, self.zr, self.zr)  # the norm's weight, 1/rms and q (NORM=False)
            go((T,), self.du, self.x, self.h, self.g_h, self.dR, self.zr, self.alpha, work, *unused, C)
            return None if self.compile_only else (work,)
        if kernel == "stream_grad":
            tokens = tokens or plan.stream_tokens
            dx = torch.empty_like(self.x)
            go(
                (cdiv(C, meta["BC"]), cdiv(T, tokens)),
                self.dout,
                self.du,
                self.x,
                self.work,
                self.phi,
                self.h,
                self.H_res,
                dx,
                self.alpha,  # the norm's weight, 1/rms, q and weight-gradient partials (NORM=False)
                self.zr,
                self.zr,
                self.zr,
                T,
                C,
                tokens,
            )
            return None if self.compile_only else (dx,)
        if kernel == "phi_grad":
            splits = splits or plan.phi_splits
            per = cdiv(cdiv(T, splits), meta["BT"]) * meta["BT"]
            splits = cdiv(T, per)
            part = self.zr.new_empty((splits, Z, n * C))
            go((cdiv(n * C, meta["BN"]), splits), self.work, self.x, part, T, n * C, Z, per)
            return None if self.compile_only else (part.sum(0),)
        raise ValueError(f"unknown kernel {kernel!r}")

    def call(self, kernel: str, params: dict | None):
        """``(fn, outputs)``: a no-argument launch of the variant for timing, and its outputs."""
        outputs = self.run(kernel, params)
        return (lambda: self.run(kernel, params)), outputs


# The workers of --jobs: one compile-only Site per shape, then one task per distinct compile.
_WORKER: dict = {}


def without_extension() -> bool:
    """Switch mhc's CUDA extension off (returns the previous setting): the kernels swept are Triton's, and the
    site's inputs are built on the PyTorch projection, so nothing waits on the extension's build (a minute)."""
    from mhc import _ext

    return _ext.set_enabled(False)


def worker_init(shapes, dtype_name: str, device: str) -> None:
    try:
        without_extension()
        _WORKER["sites"] = [Site(C, T, DTYPES[dtype_name], device, compute=False) for C, T in shapes]
    except Exception as e:  # noqa: BLE001 (a failing initializer would be restarted by the pool forever)
        _WORKER["error"] = f"worker setup: {type(e).__name__}: {e}"


def compile_one(kernel: str, params: dict) -> tuple[bool, float, str]:
    """Compile one variant at every shape (its integers may specialize differently): ``(ok, seconds, error)``."""
    if "error" in _WORKER:
        return False, 0.0, _WORKER["error"]
    t0 = time.perf_counter()
    try:
        for site in _WORKER["sites"]:
            site.run(kernel, params)
    except Exception as e:  # noqa: BLE001 (reported with the variant by the timing process)
        return (
            False,
            time.perf_counter() - t0,
            f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
        )
    return True, time.perf_counter() - t0, ""
