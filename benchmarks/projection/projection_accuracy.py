"""Marginal error and gradient error of `mhc.birkhoff_project` per input distribution.

    python benchmarks/projection/projection_accuracy.py [--count 1000000] [--device cpu]

Prints, for n=4 and n=8 and each distribution: mean / median / max of
‖T1-1‖₁ + ‖Tᵀ1-1‖₁ (float64), Newton iterations, unconverged matrices, the time,
and the fp32 gradient's relative error against the float64 implicit gradient.
"""

import argparse
import time

import torch

from mhc import birkhoff_project, marginal_error

DISTRIBUTIONS = {
    "N(0,1)": lambda s: torch.randn(s),
    "U(-1,1)": lambda s: torch.rand(s) * 2 - 1,
    "N(0,10^2)": lambda s: 10 * torch.randn(s),
    "U(-10,10)": lambda s: torch.rand(s) * 20 - 10,
    "N(0,30^2)": lambda s: 30 * torch.randn(s),
}


def gradient_error(R: torch.Tensor, count: int) -> float:
    R = R[:count]
    G = torch.randn_like(R)
    r32 = R.clone().requires_grad_()
    birkhoff_project(r32).backward(G)
    r64 = R.double().requires_grad_()
    birkhoff_project(r64, tol=1e-13).backward(G.double())
    return ((r32.grad.double() - r64.grad).norm() / r64.grad.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000, help="matrices per distribution")
    parser.add_argument("--grad-count", type=int, default=100_000, help="matrices for the gradient error")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    print(
        f"{'n':>2} {'distribution':<11} {'mean err':>9} {'median':>9} {'max err':>9} "
        f"{'max it':>6} {'unconv':>6} {'time s':>7} {'grad rel':>9}"
    )
    for n in (4, 8):
        for name, draw in DISTRIBUTIONS.items():
            R = draw((args.count, n, n)).to(args.device)
            start = time.perf_counter()
            T, info = birkhoff_project(R, return_info=True)
            if R.is_cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            err = marginal_error(T)
            grad = gradient_error(R, args.grad_count)
            print(
                f"{n:>2} {name:<11} {err.mean():9.2e} {err.median():9.2e} {err.max():9.2e} "
                f"{int(info.iterations.max()):>6} {info.num_unconverged:>6} {elapsed:7.2f} {grad:9.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
