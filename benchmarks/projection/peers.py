"""The peers of ``bench_projection_peers.py`` and the steps it times: mHC-proj's extension and autograd Functions
(:func:`load_peers`), their six columns (:func:`peer_steps`: mHC-proj's projection and mHC.cu's Sinkhorn, each
forward, op level and through autograd), the adapters that make a step of a projection (:func:`autograd_step`,
:func:`no_grad_step`), and :class:`Unavailable`, what a column holds when it cannot run here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

Step = Callable[[Tensor], Tensor]  # one call: input -> output (fed to the next call when chained)


class Unavailable(Exception):
    """A system cannot run here; the message is the reason shown in the table."""


def load_peers(device: torch.device) -> tuple[object | None, str]:
    """mHC-proj's extension module and autograd Functions, or None and why not."""
    if device.type != "cuda":
        return None, "cpu run"
    try:
        import mhc_proj
        from mhc_proj.module import MHCProjectionN4Function, MHCSinkhornN4Function

        ext = mhc_proj.torch
        for name in (
            "birkhoff_proj_n4",
            "birkhoff_proj_n4_backward",
            "sinkhorn_knopp_n4",
            "sinkhorn_knopp_n4_backward",
        ):
            getattr(ext, name)
    except Exception as exc:  # noqa: BLE001 - any import problem means "peer not built here"
        return None, f"mhc_proj not importable: {type(exc).__name__}: {exc}"
    return (
        ext,
        MHCProjectionN4Function,
        MHCSinkhornN4Function,
    ), f"mhc_proj from {Path(mhc_proj.__file__).parent}"


def autograd_step(project: Callable[[Tensor], Tensor], G: Tensor) -> Step:
    """A user's forward + backward: x as a leaf that requires grad, then torch.autograd.grad."""

    def step(x: Tensor) -> Tensor:
        if not x.requires_grad:
            x.requires_grad_()
        T = project(x)
        torch.autograd.grad(T, x, G)
        return T.detach()

    return step


def no_grad_step(project: Callable[[Tensor], Tensor]) -> Step:
    def step(x: Tensor) -> Tensor:
        with torch.no_grad():
            return project(x)

    return step


def peer_steps(peers, why: str, G: Tensor, tol: float, sk_iters: int) -> dict[str, Step | Exception]:
    """mHC-proj's and mHC.cu's six columns, each Unavailable(why) when the extension is not there."""
    names = ("proj fwd", "proj op", "proj ag", "sk fwd", "sk op", "sk ag")
    if peers is None:
        return {name: Unavailable(why) for name in names}
    ext, ProjectionFn, SinkhornFn = peers

    def proj_op(x: Tensor) -> Tensor:
        T = ext.birkhoff_proj_n4(x, tol)["T"]
        ext.birkhoff_proj_n4_backward(G, T)
        return T

    def sk_fwd(x: Tensor) -> Tensor:
        return ext.sinkhorn_knopp_n4(torch.exp(x), sk_iters)["T"]

    def sk_op(x: Tensor) -> Tensor:
        M = torch.exp(x)
        T = ext.sinkhorn_knopp_n4(M, sk_iters)["T"]
        _ = ext.sinkhorn_knopp_n4_backward(G, M, sk_iters)["D"] * M  # dx, as their sk_n4_bwd forms it
        return T

    return {
        "proj fwd": no_grad_step(lambda x: ext.birkhoff_proj_n4(x, tol)["T"]),
        "proj op": proj_op,
        "proj ag": autograd_step(lambda x: ProjectionFn.apply(x, tol), G),
        "sk fwd": no_grad_step(sk_fwd),
        "sk op": sk_op,
        "sk ag": autograd_step(lambda x: SinkhornFn.apply(x, sk_iters), G),
    }
