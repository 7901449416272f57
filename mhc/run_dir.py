"""A training run's folder: one writer at a time, and nothing deleted that the run did not write.

Layout of ``<run>/`` (written by :func:`mhc.training.train`): ``metrics.jsonl``,
``summary.json``, ``config.yaml``, ``loss.png``, ``gains.png``, ``checkpoints/`` and
``model/`` (:data:`RUN_OUTPUTS`), plus the lock file ``.lock``. Other files in the folder
are never touched.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

__all__ = [
    "RUN_OUTPUTS",
    "LOCK_NAME",
    "RunDirLockedError",
    "RunDirSetupError",
    "RunDirLock",
    "existing_outputs",
    "remove_outputs",
    "remove_stale_temporaries",
]

RUN_OUTPUTS = ("checkpoints", "model", "metrics.jsonl", "summary.json", "config.yaml", "loss.png", "gains.png")
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
        from filelock import FileLock

        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._lock = FileLock(str(self.path), timeout=0)

    def acquire(self) -> RunDirLock:
        from filelock import Timeout

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
        if self._lock.is_locked:
            self._lock.release(force=True)

    @property
    def is_locked(self) -> bool:
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
    for folder, pattern in ((Path(run_dir), _TEMP_IN_RUN_DIR), (Path(run_dir) / "checkpoints", _TEMP_IN_CHECKPOINTS)):
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
