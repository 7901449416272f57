"""What ``--resume`` continues with: the run's own settings, and which of them a resume may change.

Key classes (the three tuples partition :class:`~mhc.train.TrainConfig`'s fields):

* :data:`RESUME_FIXED`: the model's shape, the seed, the data and its order. Never change in a run.
* :data:`RESUME_SESSION`: where and how this process runs (run dir, cache, threads, progress,
  plots, ``stop_at_step``). Change freely.
* :data:`RESUME_OVERRIDABLE`: everything else (schedule, optimizer, intervals, ...). Changes only
  with ``resume_override`` (``--resume-override``); ``config.yaml`` records each change.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .checkpoint import (
    CHECKPOINT_FORMAT,
    STEP_NAME,
    TRAINER_STATE,
    CheckpointError,
    describe_nonfinite,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint_state,
    nonfinite_tensors,
    read_checkpoint_config,
    short_repr,
)
from .config import FIELDS, TrainConfig, apply_overrides, read_yaml
from .rng import rng_state, set_rng_state

__all__ = [
    "RESUME_FIXED",
    "RESUME_SESSION",
    "RESUME_OVERRIDABLE",
    "config_changes",
    "check_resume_changes",
    "resume_config",
    "ResumePoint",
    "load_resume_point",
    "check_trainer_state",
    "check_finite_state",
]

RESUME_FIXED = tuple(
    (
        "seed variant n_streams hidden_size num_layers num_heads num_kv_heads intermediate_size seq_len "
        "tie_embeddings mhc_options data data_extensions max_corpus_mb val_fraction split_chunk_chars "
        "tokenizer bpe_vocab_size bpe_train_mb tokenizer_path batch_size grad_accum"
    ).split()
)
RESUME_SESSION = ("run_dir", "cache_dir", "threads", "progress", "plots", "stop_at_step")
RESUME_OVERRIDABLE = tuple(k for k in FIELDS if k not in RESUME_FIXED and k not in RESUME_SESSION)


def config_changes(saved: dict, cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Keys (outside :data:`RESUME_SESSION`) whose value in ``cfg`` differs from a run's saved config:
    ``{key: (saved value, new value)}``. Keys the saved config lacks count as their defaults."""
    now, defaults = cfg.to_dict(), TrainConfig().to_dict()
    return {
        k: (saved.get(k, defaults[k]), now[k])
        for k in now
        if k not in RESUME_SESSION and saved.get(k, defaults[k]) != now[k]
    }


def check_resume_changes(changes: dict[str, tuple[Any, Any]], where, resume_override: bool) -> None:
    """Refuse resuming with changed settings: always for :data:`RESUME_FIXED` keys, otherwise without override.

    Raises:
        CheckpointError: listing every changed key with its saved and new value.
    """
    fixed = {k: v for k, v in changes.items() if k in RESUME_FIXED}
    if fixed:
        lines = "\n  ".join(f"{k}: run {a!r}, now {b!r}" for k, (a, b) in fixed.items())
        raise CheckpointError(
            f"cannot resume {where}: these settings shape the model, the data or its order and cannot change "
            f"in a run, not even with --resume-override:\n  {lines}\nStart a new run (another --run-dir) instead."
        )
    if changes and not resume_override:
        lines = "\n  ".join(f"{k}: run {a!r}, now {b!r}" for k, (a, b) in changes.items())
        raise CheckpointError(
            f"cannot resume {where}: the run was trained with other settings:\n  {lines}\n"
            f"Resume without these flags to continue the run exactly as it was, or add --resume-override to apply "
            f"them from here on (config.yaml records the change)."
        )


def resume_config(
    run_dir: str | os.PathLike, overrides: dict[str, Any] | Sequence[str] = ()
) -> TrainConfig | None:
    """The settings a run was trained with, plus ``overrides``: what ``--resume`` trains with.

    They come from the run's latest checkpoint or, for a run stopped before its first checkpoint,
    from its ``config.yaml``; ``None`` when ``run_dir`` holds neither. ``run_dir`` is set to the
    given folder (the run may have moved) and ``stop_at_step`` starts at 0 again (it simulates one
    interruption). Whether the overrides may change the run is checked by :func:`mhc.train.train`.
    """
    run_dir = Path(run_dir)
    ckpt = find_latest_checkpoint(run_dir)
    if ckpt is not None:
        saved = read_checkpoint_config(ckpt)
    elif (run_dir / "config.yaml").is_file():
        saved = read_yaml(run_dir / "config.yaml")
    else:
        return None
    unknown = [k for k in saved if k not in FIELDS]
    if unknown:
        raise CheckpointError(
            f"the run in {run_dir} was saved with config keys this version does not know: {unknown}"
        )
    base = dataclasses.replace(apply_overrides(TrainConfig(), saved), run_dir=str(run_dir), stop_at_step=0)
    cfg = apply_overrides(base, overrides)
    cfg.validate()
    return cfg


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _restores(rng: Any) -> bool:
    """Whether :func:`~mhc.train.rng.set_rng_state` takes ``rng`` (tried on CPU, this process's state put back).

    Trying is the one check that covers every way the nested torch/Python/NumPy states can be wrong.
    """
    if not isinstance(rng, dict) or ("cuda" in rng and not isinstance(rng["cuda"], Tensor)):
        return False  # the CUDA state is restored only on CUDA: its type is all a CPU process can check
    cpu = torch.device("cpu")
    saved = rng_state(cpu)
    try:
        set_rng_state(rng, cpu)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError):
        return False
    finally:
        set_rng_state(saved, cpu)
    return True


def _is_optimizer_state(v: Any) -> bool:
    return (
        isinstance(v, dict) and isinstance(v.get("state"), dict) and isinstance(v.get("param_groups"), list)
    )


def _is_spike_state(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and "ema" in v
        and (v["ema"] is None or _is_number(v["ema"]))
        and (v.get("ema_step") is None or _is_int(v["ema_step"]))
        and _is_int(v.get("spikes"))
        and v["spikes"] >= 0
    )


def _is_override_list(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(o, dict)
        and _is_int(o.get("step"))
        and isinstance(o.get("changes"), dict)
        and all(isinstance(c, list) and len(c) == 2 for c in o["changes"].values())
        for o in v
    )


def check_trainer_state(path: Path, state: dict) -> None:
    """Refuse a trainer state that lacks a field a resume reads, or holds one of the wrong type or range.

    The manifest's hashes show only that the files are the ones it lists: a hand-edited or foreign
    ``trainer_state.json`` under a re-signed manifest passes them, and would otherwise fail deep in the
    training loop (a KeyError, an IndexError, or a negative step naming a checkpoint ``step_-0000005``).

    Raises:
        CheckpointError: naming the checkpoint, the file and the field.
    """

    def check(field: str, ok, expected: str, optional: bool = False) -> None:
        if field not in state:
            if optional:
                return
            raise CheckpointError(f"checkpoint {path} is corrupt: {TRAINER_STATE} has no field {field!r}")
        if not ok(state[field]):
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {TRAINER_STATE} field {field!r} is {short_repr(state[field])}, "
                f"not {expected}"
            )

    check("step", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    named = STEP_NAME.fullmatch(path.name)
    if named:  # the next checkpoints are named by this step; another one would renumber the run
        check(
            "step",
            lambda v: v == int(named.group(1)),
            f"{int(named.group(1))}, the step in the folder's name",
        )
    step = state["step"]
    check("optimizer", _is_optimizer_state, "an optimizer state (a dict with 'state' and 'param_groups')")
    # The schedule steps once per step: another count would resume at another point of the LR schedule.
    check(
        "scheduler",
        lambda v: isinstance(v, dict) and _is_int(v.get("last_epoch")) and v["last_epoch"] == step,
        f"a scheduler state at step {step} (its 'last_epoch')",
    )
    check(
        "spikes",
        _is_spike_state,
        "a loss-spike state {'ema': number|null, 'ema_step': int|null, 'spikes': int}",
    )
    check("world", lambda v: _is_int(v) and v >= 1, "a number of processes >= 1")
    check(
        "rng",
        lambda v: isinstance(v, list) and len(v) == state["world"] and all(_restores(r) for r in v),
        f"a list of {state['world']} RNG state(s), one per process, as mhc.train.rng_state returns them",
    )
    for field in ("elapsed_s", "max_grad_norm"):
        check(field, _is_number, "a number", optional=True)
    for field in ("skipped_steps", "skipped_in_a_row"):
        check(field, lambda v: _is_int(v) and v >= 0, "an integer >= 0", optional=True)
    check(
        "overrides", _is_override_list, "a list of {'step': int, 'changes': {key: [old, new]}}", optional=True
    )
    check(
        "corpus_sha256", lambda v: v is None or isinstance(v, str), "a SHA-256 (hex) or null", optional=True
    )
    # The message of a changed corpus quotes the record, read only when a SHA-256 is recorded.
    check(
        "corpus",
        lambda v: isinstance(v, dict) or (v is None and state.get("corpus_sha256") is None),
        "the corpus's record (a dict)",
        optional=True,
    )


def check_finite_state(path: Path, model_state: dict[str, Tensor], trainer_state: dict) -> None:
    """Refuse a checkpoint whose weights or optimizer state hold NaN/Inf: no step from it can succeed.

    Every step would compute a non-finite loss or update and be skipped, so a resumed run would run to
    its end without learning anything. The manifest's hashes cannot catch this (the files are what was
    written, or were re-signed), so the values themselves are checked.

    Raises:
        CheckpointError: naming the tensors (and how many of their values are not finite).
    """
    weights = nonfinite_tensors(model_state)
    moments = nonfinite_tensors(trainer_state.get("optimizer", {}).get("state", {}), "optimizer state")
    if not weights and not moments:
        return
    parts = []
    if weights:
        parts.append(f"weights {describe_nonfinite(weights)}")
    if moments:
        parts.append(
            f"{describe_nonfinite(moments)} (optimizer state[i] is the i-th parameter AdamW updates)"
        )
    others = [p.name for _, p in list_checkpoints(path.parent) if p.name != path.name]
    hint = (
        f" Earlier checkpoints of the run: {', '.join(others)}; to go back to one, write its name into "
        f"{path.parent / 'latest'} (and check that it is finite)."
        if others
        else ""
    )
    raise CheckpointError(
        f"cannot resume from {path}: its values are not finite (NaN/Inf) in {'; '.join(parts)}. Every step from "
        f"this checkpoint would be skipped, so the run would learn nothing.{hint} Or start over with --overwrite "
        f"(and a lower lr, if the run diverged)."
    )


@dataclass
class ResumePoint:
    """The checkpoint a resumed run continues from, loaded and checked against the run's settings."""

    path: Path
    model_state: dict[str, Tensor]
    trainer_state: dict  # what mhc.train.loop saved: step, optimizer, scheduler, RNG, counters, config
    overrides: list[dict]  # every --resume-override so far, this one included: {"step", "changes"}


def load_resume_point(cfg: TrainConfig, world: int, *, resume_override: bool, log) -> ResumePoint | None:
    """Load the run dir's latest checkpoint (``None`` if it has none) and check that ``cfg`` may continue it.

    Raises:
        CheckpointError: the checkpoint is bad, of another trainer-state format, lacks a field a
            resume reads or holds one of the wrong type (:func:`check_trainer_state`), was written by
            another number of processes, holds weights or optimizer state that are not finite
            (:func:`check_finite_state`), or ``cfg`` changes settings it may not (:func:`check_resume_changes`).
    """
    path = find_latest_checkpoint(cfg.run_dir)
    if path is None:
        log(f"--resume: {cfg.run_dir} holds no checkpoint yet; starting from step 0")
        return None
    model_state, state = load_checkpoint_state(path)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path}: trainer state of format {state.get('format')!r}")
    check_trainer_state(path, state)
    check_finite_state(path, model_state, state)
    changes = config_changes(state["config"], cfg)
    check_resume_changes(changes, f"from {path}", resume_override)
    if state.get("world") != world:
        raise CheckpointError(
            f"cannot resume from {path}: the run used {state.get('world')} process(es), now {world} "
            f"(the data position depends on it)"
        )
    overrides = list(state.get("overrides", []))
    if changes:
        overrides.append({"step": state["step"], "changes": {k: list(v) for k, v in changes.items()}})
        log(f"--resume-override: {', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changes.items())}")
    return ResumePoint(path, model_state, state, overrides)
