"""The random-number state of a training process: seeded at the start, saved in checkpoints, restored on resume.

A resumed run draws the same dropout masks (and anything else random) as the uninterrupted one
because every generator it uses comes back exactly: torch's CPU generator, the current CUDA
device's, Python's ``random`` and NumPy's legacy global generator.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["seed_all", "rng_state", "set_rng_state"]


def seed_all(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (``seed mod 2**32``) and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict:
    """This process's torch, CUDA (when ``device`` is CUDA), Python and NumPy RNG states.

    Tensors (uint8 torch states) and JSON-able values only, so a checkpoint stores it without pickle.
    """
    version, internal, gauss_next = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": str(name),
            "key": [int(k) for k in key],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },  # fmt: skip
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what :func:`rng_state` captured (the CUDA state only when ``device`` is CUDA)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["bit_generator"],
            np.asarray(npy["key"], dtype=np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
