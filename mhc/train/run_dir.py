"""A training run's folder: one writer at a time, and nothing deleted that the run did not write.

Layout of ``<run>/`` (written by :func:`mhc.train.train`): ``metrics.jsonl``,
``summary.json``, ``config.yaml``, ``loss.png``, ``gains.png``, ``checkpoints/`` and
``model/`` (:data:`RUN_OUTPUTS`), plus the lock file ``.lock``. Other files in the folder
are never touched.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from .checkpoint import MANIFEST, find_latest_checkpoint, list_checkpoints, write_model_dir
from .distributed import DistInfo, broadcast_flag, broadcast_text

__all__ = [
    "RUN_OUTPUTS",
    "LOCK_NAME",
    "RunDirLockedError",
    "RunDirSetupError",
    "RunDirLock",
    "existing_outputs",
    "remove_outputs",
    "remove_stale_temporaries",
    "prepare_run_dir",
    "refuse_run_outputs",
    "is_run_dir",
    "claim_run_dir",
    "replace_model_dir",
]

RUN_OUTPUTS = (
    "checkpoints",
    "model",
    "metrics.jsonl",
    "summary.json",
    "config.yaml",
    "loss.png",
    "gains.png",
)
LOCK_NAME = ".lock"


class RunDirLockedError(RuntimeError):
    """Another process is training in this run directory."""


class RunDirSetupError(RuntimeError):
    """Raised on the other ranks of a ``torchrun`` job when rank 0 could not set up the run directory."""


class RunDirLock:
    """An exclusive, non-blocking lock on a run directory, held for a whole run.

    ``filelock.FileLock`` (``flock`` on ``<run>/.lock`` on POSIX): the operating system
    releases it when the process ends, however it ends, so a killed run never leaves the
    folder locked. A second process gets :class:`RunDirLockedError` at once instead of
    waiting. Use as a context manager, or :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._lock = FileLock(str(self.path), timeout=0)

    def acquire(self) -> RunDirLock:
        """Take the lock (creating the folder); raise :class:`RunDirLockedError` at once if another process holds it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise RunDirLockedError(
                f"{self.run_dir} is in use: another training process holds {self.path}. Wait for it to finish, "
                f"stop it, or pick another --run-dir."
            ) from None
        return self

    def release(self) -> None:
        """Release the lock if this object holds it."""
        if self._lock.is_locked:
            self._lock.release(force=True)

    @property
    def is_locked(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock.is_locked

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def existing_outputs(run_dir: str | Path) -> list[str]:
    """The names of :data:`RUN_OUTPUTS` that already exist in ``run_dir``."""
    rd = Path(run_dir)
    return [name for name in RUN_OUTPUTS if (rd / name).exists() or (rd / name).is_symlink()]


def remove_outputs(run_dir: str | Path) -> list[str]:
    """Delete the run's own outputs (:data:`RUN_OUTPUTS`) for ``--overwrite``; return their names."""
    rd = Path(run_dir)
    removed = existing_outputs(rd)
    for name in removed:
        p = rd / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    return removed


# The temporaries of this package's own writes (pid-suffixed), and nothing else.
_TEMP_IN_RUN_DIR = re.compile(r"\.(tmp|old)-model-\d+|\.(summary\.json|config\.yaml)\.tmp-\d+")
_TEMP_IN_CHECKPOINTS = re.compile(r"\.(tmp|old)-step_\d{8,}-\d+|\.latest\.tmp-\d+")


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Delete the temporaries an interrupted run leaves; call it while holding the lock.

    Only names this package writes: ``.tmp-model-<pid>`` / ``.old-model-<pid>`` and
    ``.summary.json.tmp-<pid>`` / ``.config.yaml.tmp-<pid>`` in ``run_dir``;
    ``.tmp-step_N-<pid>`` / ``.old-step_N-<pid>`` and ``.latest.tmp-<pid>`` in
    ``run_dir/checkpoints``. Returns what was removed.
    """
    removed = []
    for folder, pattern in (
        (Path(run_dir), _TEMP_IN_RUN_DIR),
        (Path(run_dir) / "checkpoints", _TEMP_IN_CHECKPOINTS),
    ):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if not pattern.fullmatch(p.name):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


# What a run stopped before its first checkpoint leaves; resuming it starts again from step 0 over them.
_OWN_LEFTOVERS = ("checkpoints", "metrics.jsonl", "config.yaml")


def prepare_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool, log=print) -> None:
    """Refuse or clear what is in the way of a run, and drop stale temporaries; call it holding the lock.

    A fresh run needs a folder without :data:`RUN_OUTPUTS` (``overwrite`` deletes them first); a resumed
    run with a checkpoint owns its outputs; a resumed run without one accepts only what such a run leaves.

    Raises:
        FileExistsError: naming the outputs in the way and the flags that would go on.
    """
    run_dir = Path(run_dir)
    found = existing_outputs(run_dir)
    if resume and find_latest_checkpoint(run_dir) is not None:
        pass  # the folder is that run's: its outputs are replaced as it goes
    elif resume:
        foreign = [n for n in found if n not in _OWN_LEFTOVERS]
        if foreign:
            raise FileExistsError(
                f"--resume: {run_dir} holds no checkpoint, but it holds {', '.join(foreign)}, which a run without a "
                f"checkpoint cannot have written. Move them away, pick another --run-dir, or start over with --overwrite."
            )
    elif found and not overwrite:
        raise FileExistsError(
            f"{run_dir} already holds {', '.join(found)} (a run, or files in the way of one). Pass --resume to continue "
            f"that run, --overwrite to delete these and start over, or --run-dir to pick another folder."
        )
    elif found:
        remove_outputs(run_dir)
        log(f"--overwrite: removed {', '.join(found)} from {run_dir}")
    remove_stale_temporaries(run_dir)


def refuse_run_outputs(run_dir: str | Path) -> None:
    """``FileExistsError`` if ``run_dir`` is a checkpoint, or lies inside a run's ``checkpoints/`` or ``model/``.

    Such a folder belongs to a run already: a run there would write its lock and outputs among the
    checkpoint's files (whose manifest then refuses it for good) or the saved model's.
    """
    rd = Path(run_dir).absolute()
    if (rd / MANIFEST).exists():
        raise FileExistsError(
            f"{run_dir} holds {MANIFEST}: it is a checkpoint, not a run dir. Pick another --run-dir."
        )
    for folder in (rd, *rd.parents):
        parent = folder.parent
        if folder.name in ("checkpoints", "model") and is_run_dir(parent):
            raise FileExistsError(
                f"{run_dir} lies in {folder}, the {folder.name}/ folder of the run in {parent}: pick a --run-dir "
                "outside any run's outputs."
            )


def is_run_dir(folder: str | Path) -> bool:
    """Whether ``folder`` is a training run's: it holds the run's lock (from the run's start on),
    ``metrics.jsonl`` and ``config.yaml`` (written before its first step), or a complete checkpoint."""
    d = Path(folder)
    return (
        (d / LOCK_NAME).is_file()
        or ((d / "metrics.jsonl").is_file() and (d / "config.yaml").is_file())
        or bool(list_checkpoints(d / "checkpoints"))
    )


def claim_run_dir(
    run_dir: str | Path,
    lock: RunDirLock | None,
    info: DistInfo,
    device: torch.device,
    *,
    resume: bool,
    overwrite: bool,
    log=print,
) -> None:
    """Rank 0 takes ``lock`` on ``run_dir`` and prepares the folder (:func:`prepare_run_dir`); every rank
    stops if that failed.

    A collective: every rank calls it (``lock`` is None on the others). Rank 0 re-raises its own error;
    the other ranks raise :class:`RunDirSetupError` quoting it, instead of waiting for rank 0 forever.
    """
    failure = None
    if info.is_main:
        try:
            refuse_run_outputs(run_dir)  # before the lock file is written there
            lock.acquire()
            prepare_run_dir(run_dir, resume=resume, overwrite=overwrite, log=log)
        except Exception as e:  # handed to every rank below, so that none waits for rank 0
            failure = e
    if broadcast_flag(failure is not None, info, device):
        if failure is not None:
            broadcast_text(f"{type(failure).__name__}: {failure}", info)
            raise failure
        reason = broadcast_text("", info)
        raise RunDirSetupError(
            f"rank 0 could not set up the run dir {run_dir} ({reason}); rank {info.rank} stops too"
        )


def replace_model_dir(run_dir: str | Path, model_config, state_dict: dict, tok) -> Path:
    """Write ``run_dir/model`` (a ``from_pretrained`` folder) next to the old one, then swap it in.

    A process killed meanwhile leaves the old ``model/`` or the new one, plus a temporary that
    :func:`remove_stale_temporaries` removes.
    """
    run_dir = Path(run_dir)
    model_dir = run_dir / "model"
    tmp = run_dir / f".tmp-model-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    write_model_dir(tmp, model_config, state_dict, tok)
    if model_dir.exists():  # this run's own (checked at the start): swap it out, then drop it
        old = run_dir / f".old-model-{os.getpid()}"
        os.replace(model_dir, old)
        os.replace(tmp, model_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, model_dir)
    return model_dir
