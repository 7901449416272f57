"""The model a run trains and its optimizer: ``MHCForCausalLM`` over a Llama config, AdamW, warmup + cosine.

The connection coefficients of every :class:`mhc.MHCBlock` (and biases, norms, 1-D parameters)
get no weight decay; matrices do.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import LlamaConfig

from ..block import MHCBlock
from ..hf import MHCConfig, MHCForCausalLM
from .config import TrainConfig, mhc_config_options

__all__ = [
    "padded_vocab",
    "build_model",
    "count_parameters",
    "lr_lambda",
    "param_groups",
    "build_optimizer",
    "restore_optimizer",
]


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (embedding rows the GPU tiles evenly)."""
    return (vocab_size + multiple - 1) // multiple * multiple


def build_model(cfg: TrainConfig, vocab_size: int, eos_id: int | None = None) -> MHCForCausalLM:
    """``MHCForCausalLM(MHCConfig(base_config=LlamaConfig(...), **mhc_config_options(cfg)))``.

    :func:`~mhc.train.config.mhc_config_options` maps the variant onto ``MHCConfig``'s settings
    (``mhc-sk20``: ``mode="mhc", projection="sinkhorn", sinkhorn_iters=20``; ``mhc-lite``:
    ``mode="mhc", projection="lite"``) and adds ``n_streams`` and ``mhc_options``.

    The vocabulary is padded (:func:`padded_vocab`); ``eos_id`` is the BOS/EOS token id. Parameters
    are float32 on the CPU, initialised from torch's current RNG.
    """
    base = LlamaConfig(
        vocab_size=padded_vocab(vocab_size),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=cfg.attention_dropout,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        use_cache=False,
    )
    return MHCForCausalLM(MHCConfig(base_config=base, **mhc_config_options(cfg)))


def count_parameters(model: nn.Module) -> int:
    """Parameter elements of ``model``, tied (shared) parameters counted once."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def lr_lambda(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warmup, cosine decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: ``[decayed matrices, everything else (no decay)]``, each parameter once."""
    no_decay = set()
    for m in model.modules():
        if isinstance(m, MHCBlock):  # the connection coefficients themselves: no decay
            no_decay.update(id(p) for p in m.parameters(recurse=False))
    decay, other, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in no_decay else other).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, max_steps: int, device: torch.device
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over :func:`param_groups` (fused on CUDA) and its :func:`lr_lambda` schedule over ``max_steps``."""
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **fused
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    )
    return optimizer, scheduler


def restore_optimizer(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    optimizer_state: dict,
    scheduler_state: dict,
    cfg: TrainConfig,
    max_steps: int,
) -> None:
    """Load a checkpoint's optimizer and scheduler states, then apply ``cfg``'s hyperparameters over them.

    The states carry the betas, eps, weight decay and peak LR the run had when it was saved; after a
    ``--resume-override`` the run's (new) settings are the ones to train with from here on, and the
    LR of the next step is the new schedule's at the saved step.

    Raises:
        ValueError: the optimizer state does not fit the parameters (a group or tensor shape).
    """
    optimizer.load_state_dict(optimizer_state)
    # load_state_dict does not check the moments' shapes: a wrong one would fail inside step().
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                    raise ValueError(
                        f"optimizer state {name!r} has shape {tuple(value.shape)} for a parameter of shape "
                        f"{tuple(p.shape)}"
                    )
    scheduler.load_state_dict(scheduler_state)
    for group in optimizer.param_groups:
        group["betas"], group["eps"], group["initial_lr"] = (cfg.beta1, cfg.beta2), cfg.eps, cfg.lr
        # the implementation is this machine's (a checkpoint written on the CPU has no fused groups)
        group["fused"], group["foreach"] = optimizer.defaults.get("fused"), optimizer.defaults.get("foreach")
    optimizer.param_groups[0]["weight_decay"] = cfg.weight_decay  # the decayed group (param_groups)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    lrs = [
        base * lr_lambda(scheduler.last_epoch, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
        for base in scheduler.base_lrs
    ]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports: torch keeps it only in this attribute
