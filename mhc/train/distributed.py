"""Processes and devices: one process, or several under ``torchrun`` with DDP or FSDP2.

Every collective here is a no-op in a single process, so the loop calls them unconditionally.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .config import TrainConfig, parse_device

__all__ = [
    "DistInfo",
    "resolve_device",
    "setup_distributed",
    "shutdown_distributed",
    "all_reduce_mean",
    "all_reduce_sum",
    "broadcast_flag",
    "broadcast_text",
    "gather_objects",
    "barrier",
    "full_state",
    "wrap_model",
    "shard_optimizer_state",
]


@dataclass
class DistInfo:
    """This process's place in the job: rank, world size, local rank; whether it started the process group."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run's files and prints."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """More than one process."""
        return self.world > 1


def resolve_device(device: str, world: int = 1) -> torch.device | None:
    """The ``torch.device`` that ``device`` names here (``None``: one CUDA device per rank, by LOCAL_RANK).

    Raises:
        ValueError: naming the device, when it is not valid or does not exist on this machine.
    """
    kind, index = parse_device(device)
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: CUDA is not available here (torch {torch.__version__}); use device=cpu or auto"
        )
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(
            f"device={device!r} does not exist: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    if index is not None and world > 1:
        raise ValueError(
            f"device={device!r}: under torchrun use device=cuda (every rank takes cuda:LOCAL_RANK)"
        )
    if world > 1:
        return None
    return torch.device("cuda", index if index is not None else torch.cuda.current_device())


def setup_distributed(cfg: TrainConfig) -> tuple[DistInfo, torch.device]:
    """Resolve the device (first: a bad one stops at once) and, under ``torchrun``, join the process group.

    Reads ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` as ``torchrun`` sets them; NCCL on CUDA,
    gloo on the CPU. A process group that already exists is used as it is.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.device, world)
    info = DistInfo()
    if world > 1:
        info.rank, info.world = int(os.environ["RANK"]), world
        info.local_rank = int(os.environ.get("LOCAL_RANK", info.rank))
        if device is None:
            device = torch.device("cuda", info.local_rank)
        if not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
            info.initialized_here = True
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    return info, device


def shutdown_distributed(info: DistInfo) -> None:
    """Destroy the process group if :func:`setup_distributed` created it."""
    if info.initialized_here:
        dist.destroy_process_group()


def all_reduce_mean(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """The mean over ranks of each value (float64)."""
    if not info.enabled:
        return values
    return [v / info.world for v in all_reduce_sum(values, info, device)]


def all_reduce_sum(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """The sum over ranks of each value (float64)."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_flag(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """Rank 0's ``flag`` on every rank (a collective: all ranks call it)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.broadcast(t, 0)
    return bool(t.item())


def broadcast_text(text: str, info: DistInfo) -> str:
    """Rank 0's ``text`` on every rank (a collective: all ranks call it)."""
    if not info.enabled:
        return text
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's ``obj``, in rank order, on every rank (a collective: all ranks call it)."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    """Wait for every rank."""
    if info.enabled:
        dist.barrier()


def full_state(obj):
    """A state dict with every (sharded) DTensor gathered into a full CPU tensor (collective under FSDP2)."""
    if isinstance(obj, dict):
        return {k: full_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [full_state(v) for v in obj]
    if isinstance(obj, Tensor):
        if hasattr(obj, "full_tensor"):
            obj = obj.full_tensor()
        return obj.detach().cpu()
    return obj


def wrap_model(model: nn.Module, cfg: TrainConfig, info: DistInfo, device: torch.device) -> nn.Module:
    """What the step runs: ``model`` itself (one process; FSDP2, which shards it in place) or a DDP wrapper.

    FSDP2 shards every layer of the model's longest ``ModuleList`` and then the model. With
    ``cfg.compile`` the result is ``torch.compile``-d.
    """
    if info.enabled and cfg.dist == "fsdp":
        # Imported only for FSDP2: on a torch built without distributed support this import fails,
        # and single-process training must still work there.
        from torch.distributed.fsdp import fully_shard

        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
        if lists:
            for layer in max(lists, key=len):
                fully_shard(layer)
        fully_shard(model)
        train_model = model
    elif info.enabled:
        train_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    else:
        train_model = model
    return torch.compile(train_model) if cfg.compile else train_model


def shard_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict, device: torch.device) -> dict:
    """Turn a full optimizer state dict back into shards that match the FSDP2 (DTensor) parameters."""
    from torch.distributed.tensor import distribute_tensor  # FSDP2 only: see wrap_model

    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for idx, st in sd["state"].items():
        p = params[int(idx)]
        new = {}
        for k, v in st.items():
            if isinstance(v, Tensor) and hasattr(p, "device_mesh") and v.shape == p.shape:
                v = distribute_tensor(v.to(device), p.device_mesh, p.placements)
            new[k] = v
        state[idx] = new
    return {"state": state, "param_groups": sd["param_groups"]}
