"""Benchmark the fused CUDA Birkhoff projection against the PyTorch paths and a device copy.

One table, one run: N in {8K, 128K, 1M, 4M} matrices of N(0, 10^2), n = 4 and 8.

Columns (median µs of triton.testing.do_bench after warm-up, all in this run):
  ours fwd        torch.ops.mhc.birkhoff_forward (one kernel launch)
  ours f+b        forward, then torch.ops.mhc.birkhoff_backward from the saved T with a random G
  copy fwd        device copy moving the forward's bytes (read R, write T)
  copy f+b        device copy moving all bytes of fwd+bwd (read R, write T, read T and G, write dR)
  newton fwd/f+b  the PyTorch Newton reference path on the same GPU (fp32); only N <= --ref-max
  sinkhorn fwd/f+b  birkhoff_project(method="sinkhorn", iters=20), eager; f+b only N <= --sk-bwd-max
  max err         max marginal error ‖T1-1‖₁+‖Tᵀ1-1‖₁ (float64) of our T over all N matrices
  grad rel        ‖dR - dR64‖/‖dR64‖ against the float64 implicit gradient of the float64
                  reference solution; only N <= --grad-max
Also: the whole birkhoff_project call (Python wrapper + autograd dispatch) and its CUDA-graph
replay, at N = 8K.

Usage: python benchmarks/projection/bench_projection.py [--sizes 8192,131072,1048576,4194304] [--ns 4,8]
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8192,131072,1048576,4194304")
    ap.add_argument("--ns", default="4,8")
    ap.add_argument("--ref-max", type=int, default=131072, help="largest N for the PyTorch Newton path")
    ap.add_argument("--sk-bwd-max", type=int, default=1048576, help="largest N for Sinkhorn fwd+bwd")
    ap.add_argument("--grad-max", type=int, default=1048576, help="largest N for the float64 gradient check")
    ap.add_argument("--sigma", type=float, default=10.0)
    args = ap.parse_args()

    import triton.testing

    import mhc
    from mhc import projection as P
    from mhc.projection import cuda as projection_cuda

    assert torch.cuda.is_available() and projection_cuda.available()
    dev = torch.device("cuda")
    tol = 1e-6
    sizes = [int(s) for s in args.sizes.split(",")]
    ns = [int(s) for s in args.ns.split(",")]

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0  # µs

    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  {torch.cuda.get_device_name()}  "
        f"torch {torch.__version__}  command: python {' '.join(sys.argv)}"
    )
    hdr = (
        f"{'n':>2} {'N':>8} | {'ours fwd':>9} {'copy fwd':>9} {'x copy':>6} | {'ours f+b':>9} {'copy f+b':>9} "
        f"{'x copy':>6} | {'newton fwd':>10} {'newton f+b':>10} | {'sk20 fwd':>9} {'sk20 f+b':>9} | "
        f"{'max err':>9} {'sk20 err':>9} {'grad rel':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for n in ns:
        for N in sizes:
            elt = 4
            R = torch.randn(N, n, n, device=dev) * args.sigma
            G = torch.randn(N, n, n, device=dev)
            nbytes = N * n * n * elt
            tol_eff = P.effective_tol(tol, n, torch.float32)

            fwd = lambda: torch.ops.mhc.birkhoff_forward(R, tol_eff, 100)  # noqa: E731

            def fb():
                T = torch.ops.mhc.birkhoff_forward(R, tol_eff, 100)
                return torch.ops.mhc.birkhoff_backward(T, G)

            t_fwd = bench(fwd)
            t_fb = bench(fb)
            # copies moving the same bytes: fwd reads 1 and writes 1 array; fwd+bwd moves 5 arrays
            src1 = torch.empty(nbytes // 4, device=dev)
            dst1 = torch.empty_like(src1)
            t_copy_fwd = bench(lambda: dst1.copy_(src1))
            src5 = torch.empty(5 * nbytes // 8, device=dev)
            dst5 = torch.empty_like(src5)
            t_copy_fb = bench(lambda: dst5.copy_(src5))
            src1 = dst1 = src5 = dst5 = None  # freed (the step closures above read these names)

            T = fwd()
            err = mhc.marginal_error(T)
            max_err = float(err.max())

            # PyTorch Newton path (fp32 on this GPU)
            t_ref_f = t_ref_fb = float("nan")
            if N <= args.ref_max:
                Rg = R.clone().requires_grad_(True)

                def ref_f():
                    return P.birkhoff_project_reference(R, tol=tol, max_iter=100)

                def ref_fb():
                    T_ = P.birkhoff_project_reference(Rg, tol=tol, max_iter=100)
                    return torch.autograd.grad(T_, Rg, G)

                t_ref_f = bench(ref_f)
                t_ref_fb = bench(ref_fb)

            # 20-step Sinkhorn, eager PyTorch
            sk = lambda: mhc.birkhoff_project(R, method="sinkhorn", iters=20)  # noqa: E731
            t_sk_f = bench(sk)
            sk_err = float(mhc.marginal_error(sk()).max())
            t_sk_fb = float("nan")
            if N <= args.sk_bwd_max:
                Rs = R.clone().requires_grad_(True)
                t_sk_fb = bench(
                    lambda: torch.autograd.grad(mhc.birkhoff_project(Rs, method="sinkhorn", iters=20), Rs, G)
                )
                del Rs

            grad_rel = float("nan")
            if N <= args.grad_max:
                dR = torch.ops.mhc.birkhoff_backward(T, G)
                T64 = torch.cat(
                    [
                        P.birkhoff_project_reference(c, tol=1e-10, max_iter=200)
                        for c in R.double().split(1 << 18)
                    ]
                )
                dR64 = P.birkhoff_backward(T64, G.double())
                grad_rel = float((dR.double() - dR64).norm() / dR64.norm())
                del T64, dR64, dR

            row = (
                n,
                N,
                t_fwd,
                t_copy_fwd,
                t_fwd / t_copy_fwd,
                t_fb,
                t_copy_fb,
                t_fb / t_copy_fb,
                t_ref_f,
                t_ref_fb,
                t_sk_f,
                t_sk_fb,
                max_err,
                sk_err,
                grad_rel,
            )
            rows.append(row)
            print(
                f"{n:>2} {N:>8} | {t_fwd:9.1f} {t_copy_fwd:9.1f} {t_fwd / t_copy_fwd:6.2f} | {t_fb:9.1f} "
                f"{t_copy_fb:9.1f} {t_fb / t_copy_fb:6.2f} | {t_ref_f:10.1f} {t_ref_fb:10.1f} | {t_sk_f:9.1f} "
                f"{t_sk_fb:9.1f} | {max_err:9.2e} {sk_err:9.2e} {grad_rel:9.2e}",
                flush=True,
            )
            R = G = T = err = None  # freed (the step closures above read these names)
            torch.cuda.empty_cache()

    # Small-batch latency through the public entry point.
    print()
    for n in ns:
        N = 8192
        x = torch.randn(N, n, n, device=dev) * args.sigma
        t_op = bench(lambda: torch.ops.mhc.birkhoff_forward(x, P.effective_tol(tol, n, torch.float32), 100))
        t_api = bench(lambda: mhc.birkhoff_project(x))
        with torch.no_grad():
            t_api_ng = bench(lambda: mhc.birkhoff_project(x))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mhc.birkhoff_project(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        reps = 20
        with torch.cuda.graph(g):
            for _ in range(reps):
                mhc.birkhoff_project(x)
        t_graph = bench(g.replay) / reps
        print(
            f"n={n} N=8192: op {t_op:.1f} µs, birkhoff_project {t_api:.1f} µs (no_grad {t_api_ng:.1f} µs), "
            f"CUDA-graph replay {t_graph:.1f} µs per call"
        )
    # Cost per Newton iteration: forward time against the input scale (iterations grow with sigma).
    print()
    for n in ns:
        for sigma in (1.0, 10.0, 30.0):
            x = torch.randn(1 << 20, n, n, device=dev) * sigma
            tol_eff = P.effective_tol(tol, n, torch.float32)
            t = bench(lambda: torch.ops.mhc.birkhoff_forward(x, tol_eff, 100))
            y, it, _ = torch.ops.mhc.birkhoff_forward_info(x, tol_eff, 100)
            it = it.view(-1, 32).float()
            print(
                f"n={n} N=1M N(0,{sigma:g}^2): fwd {t:.1f} µs; max err {float(mhc.marginal_error(y).max()):.2e}; "
                f"iterations mean {it.mean():.2f}, mean of per-warp max {it.amax(1).mean():.2f}"
            )
    print(f"unconverged matrices counted on device during the run: {projection_cuda.unconverged_count()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
