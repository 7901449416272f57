"""Training checkpoints on disk: atomic writes, verification, pruning, and loading without pickle.

A checkpoint is a folder ``<run>/checkpoints/step_XXXXXXXX/`` holding

* ``config.json`` + ``model.safetensors`` (+ the tokenizer files): a ``from_pretrained`` folder;
* ``trainer_state.json`` + ``trainer_tensors.safetensors``: optimizer, scheduler, RNG
  states, data position, counters and the run's own config. Tensors go to safetensors,
  everything else to JSON (see :func:`encode_tree`), so loading a checkpoint never
  unpickles anything and never runs code from the checkpoint;
* ``manifest.json``: the format version and the size and SHA-256 of every other file.

The hashes give integrity (a torn or flipped file is caught), not authenticity: anyone who
can write the folder can also rewrite the manifest. Safety against a planted file comes from
the loader reading only JSON and safetensors.

``<run>/checkpoints/latest`` names the newest complete checkpoint; it can only name a
``step_NNNNNNNN`` folder directly inside ``checkpoints/`` (no paths, no symlinks).

Test hook: with the environment variable ``MHC_CHECKPOINT_KILL_AT=[STEP:]POINT``,
:func:`save_checkpoint` sends SIGKILL to its own process at ``POINT`` (when saving step
``STEP``, or any step), to test that an interrupted write never loses a run. Points, in
write order: ``file:K`` (after the K-th of the files: 1 config.json, 2 model.safetensors,
3 the tokenizer files, 4 trainer_tensors.safetensors, 5 trainer_state.json), ``manifest``
(manifest written, before the rename), ``rename`` (folder renamed, before ``latest`` is
updated), ``latest`` (``latest`` updated, before pruning), ``prune`` (after the first old
checkpoint is removed). Nothing else reads this variable.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

__all__ = [
    "CHECKPOINT_FORMAT",
    "KILL_ENV",
    "CheckpointError",
    "encode_tree",
    "decode_tree",
    "save_checkpoint",
    "verify_checkpoint",
    "load_checkpoint_state",
    "read_checkpoint_config",
    "find_latest_checkpoint",
    "list_checkpoints",
    "prune_checkpoints",
    "write_model_dir",
    "atomic_write_bytes",
    "fsync_dir",
    "sha256_file",
    "nonfinite_tensors",
    "TOKENIZER_FILES",
    "MANIFEST",
    "TRAINER_STATE",
    "STEP_NAME",
    "short_repr",
]

# 1: trainer state as a torch pickle (trainer_state.pt), no longer loaded. 2: JSON + safetensors.
CHECKPOINT_FORMAT = 2
KILL_ENV = "MHC_CHECKPOINT_KILL_AT"

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
TRAINER_TENSORS = "trainer_tensors.safetensors"
MODEL_WEIGHTS = "model.safetensors"
MODEL_CONFIG = "config.json"
# What the loader reads: a manifest without any of these is not a checkpoint.
REQUIRED_FILES = frozenset({MODEL_CONFIG, MODEL_WEIGHTS, TRAINER_STATE, TRAINER_TENSORS})
# Written beside them for from_pretrained / AutoTokenizer users; never read when resuming.
TOKENIZER_FILES = frozenset(
    {"tokenizer.json", "tokenizer_config.json", "tokenizer_mhc.json", "special_tokens_map.json"}
)
# mHC models' loader for transformers' Auto classes without `import mhc` (mhc.hf.custom_code); never run here.
LOADER_FILE = "modeling_mhc.py"
ALLOWED_FILES = REQUIRED_FILES | TOKENIZER_FILES | {LOADER_FILE}
STEP_NAME = re.compile(r"step_(\d{8,})")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupt, of an old format, or does not match the run."""


# --------------------------------------------------------------------------------------
# State trees <-> JSON + tensors
# --------------------------------------------------------------------------------------

_MARKERS = ("__tensor__", "__tuple__", "__int_keys__")


def encode_tree(obj: Any) -> tuple[Any, dict[str, Tensor]]:
    """Split a state tree into a JSON-able tree and a flat dict of tensors (for safetensors).

    Handles dicts (``str`` or ``int`` keys), lists, tuples, ``None``, ``bool``, ``int``,
    ``float`` (NaN/Inf included), ``str`` and tensors; anything else raises ``TypeError``,
    so nothing is ever written in a form that needs pickle to read. Tensors become
    ``{"__tensor__": "t<k>"}`` and are returned as contiguous CPU tensors under ``t<k>``.
    """
    tensors: dict[str, Tensor] = {}

    def enc(x):
        if isinstance(x, Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = x.detach().cpu().contiguous().clone()
            return {"__tensor__": key}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v) for v in x]}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x):
                if any(k in _MARKERS for k in x):
                    raise TypeError(f"state dict keys {sorted(set(x) & set(_MARKERS))} are reserved")
                return {k: enc(v) for k, v in x.items()}
            if all(isinstance(k, int) and not isinstance(k, bool) for k in x):
                return {"__int_keys__": {str(k): enc(v) for k, v in x.items()}}
            raise TypeError(f"state dict keys must be all str or all int, got {sorted(map(repr, x))[:5]}")
        raise TypeError(
            f"cannot store a {type(x).__name__} in a checkpoint's trainer state (JSON + tensors only)"
        )

    return enc(obj), tensors


def decode_tree(tree: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of :func:`encode_tree`."""

    def dec(x):
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if "__tensor__" in x:
                key = x["__tensor__"]
                if key not in tensors:
                    raise CheckpointError(
                        f"the trainer state refers to tensor {key!r}, which {TRAINER_TENSORS} lacks"
                    )
                return tensors[key]
            if "__tuple__" in x:
                return tuple(dec(v) for v in x["__tuple__"])
            if "__int_keys__" in x:
                return {int(k): dec(v) for k, v in x["__int_keys__"].items()}
            return {k: dec(v) for k, v in x.items()}
        return x

    return dec(tree)


def nonfinite_tensors(tree: Any, prefix: str = "") -> list[tuple[str, int, int]]:
    """The floating-point tensors of a state tree (nested dicts/lists/tuples) that hold NaN or Inf.

    Returns ``(name, non-finite values, values)`` per such tensor, in the tree's order; a tensor's name is
    its path of keys joined by ``.`` (a model state dict's own keys, ``prefix`` in front).
    """
    out: list[tuple[str, int, int]] = []

    def walk(x, name):
        if isinstance(x, Tensor):
            if x.is_floating_point() or x.is_complex():
                bad = int((~x.detach().isfinite()).sum())
                if bad:
                    out.append((name, bad, x.numel()))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{name}[{k}]" if isinstance(k, int) else f"{name}.{k}" if name else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{name}[{i}]")

    walk(tree, prefix)
    return out


def describe_nonfinite(found: list[tuple[str, int, int]], limit: int = 8) -> str:
    """``name (k of n values NaN/Inf), ...`` for :func:`nonfinite_tensors`' list, at most ``limit`` named."""
    shown = ", ".join(f"{name} ({bad} of {n} values)" for name, bad, n in found[:limit])
    return shown + (f", and {len(found) - limit} more tensors" if len(found) > limit else "")


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, as 64 hex digits (read in 4 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (renames into it) to disk, where the OS allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _dedup_shared(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Drop tensors that alias an earlier one (tied weights): safetensors refuses shared storage."""
    out, aliases, seen = {}, {}, {}
    for k, v in sd.items():
        key = (
            (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype)
            if v.numel()
            else None
        )
        if key is not None and key in seen:
            aliases[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        out[k] = v.detach().contiguous()
    return out, aliases


def write_model_dir(
    directory: Path, model_config, state_dict: dict[str, Tensor], tok, after_file=None
) -> dict[str, str]:
    """``config.json`` + ``model.safetensors`` (+ tokenizer files): a ``from_pretrained`` folder.

    Returns the aliases (tied weights) that were left out of ``model.safetensors``.
    ``after_file(k)`` is called after each of the three writes.
    """
    after_file = after_file or (lambda k: None)
    directory.mkdir(parents=True, exist_ok=True)
    if getattr(model_config, "model_type", None) == "mhc":
        # As MHCForCausalLM.save_pretrained does: the folder loads with trust_remote_code=True alone.
        from ..hf.custom_code import AUTO_MAP, CODE_FILE, write_code_file

        assert CODE_FILE == LOADER_FILE
        write_code_file(directory)
        model_config = copy.copy(model_config)
        model_config.auto_map = {**(getattr(model_config, "auto_map", None) or {}), **AUTO_MAP}
    model_config.save_pretrained(str(directory))
    after_file(1)
    sd, aliases = _dedup_shared(state_dict)
    save_file(sd, str(directory / MODEL_WEIGHTS), metadata={"format": "pt"})
    after_file(2)
    if tok is not None:
        tok.save(directory)
    after_file(3)
    return aliases


def _kill_point(step: int, point: str) -> None:
    """The test hook of the module docstring: SIGKILL this process at ``point`` if asked to."""
    want = os.environ.get(KILL_ENV, "")
    if not want:
        return
    head, _, rest = want.partition(":")
    at_step, at_point = (int(head), rest) if head.isdigit() and rest else (None, want)
    if at_point == point and (at_step is None or at_step == step):
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------


def save_checkpoint(
    ckpt_root: Path, step: int, model_config, model_sd: dict[str, Tensor], trainer_state: dict, tok, keep: int
) -> Path:
    """Write ``ckpt_root/step_XXXXXXXX`` atomically, point ``latest`` at it, prune old ones.

    The files go to a temporary folder, are fsynced and hashed into ``manifest.json``, and
    the folder is renamed into place; only then is ``latest`` replaced (atomically too).
    A process killed at any moment leaves either the previous complete checkpoint named by
    ``latest`` or the new one, plus temporaries that the next run removes. ``keep > 0``
    keeps that many complete checkpoints (see :func:`prune_checkpoints`); 0 keeps all.
    """
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    aliases = write_model_dir(
        tmp, model_config, model_sd, tok, after_file=lambda k: _kill_point(step, f"file:{k}")
    )
    tree, tensors = encode_tree(trainer_state)
    save_file(tensors, str(tmp / TRAINER_TENSORS))
    _kill_point(step, "file:4")
    (tmp / TRAINER_STATE).write_text(json.dumps(tree) + "\n")
    _kill_point(step, "file:5")
    files = {}
    for p in sorted(tmp.iterdir()):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        files[p.name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    unexpected = sorted(set(files) - ALLOWED_FILES)
    if unexpected:  # a new file kind must be added to ALLOWED_FILES, or resuming would refuse it
        raise CheckpointError(f"save_checkpoint wrote files the loader does not accept: {unexpected}")
    manifest = {"format": CHECKPOINT_FORMAT, "step": step, "files": files, "aliases": aliases}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    _fsync_file(tmp / MANIFEST)
    fsync_dir(tmp)
    _kill_point(step, "manifest")
    if final.exists():  # an abandoned checkpoint of this step (the run was resumed from an earlier one)
        trash = ckpt_root / f".old-{name}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(ckpt_root)
    _kill_point(step, "rename")
    atomic_write_bytes(ckpt_root / "latest", (name + "\n").encode())
    fsync_dir(ckpt_root)
    _kill_point(step, "latest")
    if keep > 0:
        prune_checkpoints(ckpt_root, keep, current=final, after_remove=lambda: _kill_point(step, "prune"))
    return final


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (real ``step_*`` folders with a manifest) in ``ckpt_root``, by step."""
    out = []
    if not ckpt_root.is_dir():
        return out
    for p in ckpt_root.iterdir():
        m = STEP_NAME.fullmatch(p.name)
        if m and not p.is_symlink() and p.is_dir() and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def prune_checkpoints(ckpt_root: Path, keep: int, current: Path, after_remove=None) -> list[Path]:
    """Remove old complete checkpoints so that ``keep`` remain; return the removed folders.

    Never removed: ``current`` (the checkpoint just written) and the one ``latest`` names.
    Of the others, earlier checkpoints of this run are kept before later-numbered ones left
    behind by an abandoned attempt (a run resumed from an earlier checkpoint). Folders that
    are not complete checkpoints are left alone.
    """
    protected = {current.name}
    with contextlib.suppress(CheckpointError):
        named = _latest_named(ckpt_root)
        if named is not None:
            protected.add(named.name)
    current_step = int(STEP_NAME.fullmatch(current.name).group(1))
    complete = list_checkpoints(ckpt_root)
    others = [(s, p) for s, p in complete if p.name not in protected]
    others.sort(key=lambda sp: (sp[0] <= current_step, sp[0]), reverse=True)
    n_protected = sum(1 for _, p in complete if p.name in protected)
    removed = []
    for _, p in others[max(0, keep - n_protected) :]:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
        if after_remove is not None:
            after_remove()
    return removed


# --------------------------------------------------------------------------------------
# Finding, verifying, loading
# --------------------------------------------------------------------------------------


def _latest_named(ckpt_root: Path) -> Path | None:
    """The folder ``ckpt_root/latest`` names (checked to be a plain ``step_*`` name), or None."""
    latest = ckpt_root / "latest"
    if latest.is_symlink():
        raise CheckpointError(
            f"{latest} is a symlink; it must be a file naming a checkpoint folder in {ckpt_root}"
        )
    if not latest.exists():
        return None
    if not latest.is_file():
        raise CheckpointError(f"{latest} is not a file")
    name = latest.read_text(encoding="utf-8", errors="replace").strip()
    if not STEP_NAME.fullmatch(name):
        raise CheckpointError(
            f"{latest} names {name[:200]!r}, which is not a checkpoint of this run: it must be a step_NNNNNNNN "
            f"folder directly inside {ckpt_root}"
        )
    return ckpt_root / name


def _check_inside(ckpt_root: Path, path: Path) -> None:
    if path.is_symlink():
        raise CheckpointError(
            f"checkpoint {path} is a symlink; checkpoints must be real folders inside {ckpt_root}"
        )
    if path.exists() and path.resolve().parent != ckpt_root.resolve():
        raise CheckpointError(f"checkpoint {path} resolves outside {ckpt_root}")


def find_latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``run_dir/checkpoints/latest`` names, or ``None`` when the run has none.

    Without a ``latest`` file (a run killed between a checkpoint's rename and the update
    of ``latest``), the newest complete checkpoint.

    Raises:
        CheckpointError: ``latest`` is a symlink, names anything but a ``step_NNNNNNNN``
            folder inside ``checkpoints/``, or names one that is missing or a symlink.
    """
    root = Path(run_dir) / "checkpoints"
    path = _latest_named(root)
    if path is not None:
        _check_inside(root, path)
        if not path.is_dir():
            raise CheckpointError(
                f"{root / 'latest'} names {path.name}, which does not exist: the checkpoint folder was removed or never completed"
            )
        return path
    complete = list_checkpoints(root)
    return complete[-1][1] if complete else None


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check a checkpoint's manifest, file list, sizes and SHA-256 hashes; return the manifest.

    The manifest must be of the current format, list the files the loader reads, list only
    files a checkpoint holds, and match the folder's files exactly (no missing or extra entry).

    Raises:
        CheckpointError: naming what is missing or wrong.
    """
    path = Path(path)
    mf = path / MANIFEST
    if (path / "trainer_state.pt").exists() and not mf.is_file():
        raise _old_format(path)
    if not mf.is_file() or mf.is_symlink():
        raise CheckpointError(
            f"checkpoint {path} is partial: it has no manifest.json (the write did not finish)"
        )
    try:
        manifest = json.loads(mf.read_text())
        fmt, files = manifest["format"], manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: unreadable manifest.json ({e!r})") from e
    if fmt != CHECKPOINT_FORMAT:
        if isinstance(fmt, int) and fmt < CHECKPOINT_FORMAT:
            raise _old_format(path, fmt)
        raise CheckpointError(
            f"checkpoint {path} has format {fmt!r}; this mhc reads format {CHECKPOINT_FORMAT}"
        )
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"checkpoint {path} is corrupt: manifest.json lists no files")
    missing_entries = sorted(REQUIRED_FILES - set(files))
    if missing_entries:
        raise CheckpointError(f"checkpoint {path} is corrupt: manifest.json does not list {missing_entries}")
    unknown = sorted(set(files) - ALLOWED_FILES)
    if unknown:
        raise CheckpointError(
            f"checkpoint {path} is refused: manifest.json lists files a checkpoint does not hold: {unknown}"
        )
    on_disk = {p.name for p in path.iterdir()} - {MANIFEST}
    extra = sorted(on_disk - set(files))
    if extra:
        raise CheckpointError(
            f"checkpoint {path} is refused: it holds {extra}, which manifest.json does not list"
        )
    for name, meta in files.items():
        p = path / name
        if not p.exists():
            raise CheckpointError(f"checkpoint {path} is partial: {name} is missing")
        if p.is_symlink() or not p.is_file():
            raise CheckpointError(f"checkpoint {path} is refused: {name} is not a regular file")
        try:
            size, digest = int(meta["size"]), str(meta["sha256"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: manifest.json entry of {name} is unreadable ({e!r})"
            ) from e
        if p.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {p.stat().st_size} bytes, the manifest says {size}"
            )
        if sha256_file(p) != digest:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} does not match its SHA-256 in manifest.json"
            )
    return manifest


def _old_format(path: Path, fmt: int = 1) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} has format {fmt}, written by an older mhc: its trainer state is a pickle "
        f"(trainer_state.pt), which this version never loads because unpickling can run code. "
        f"Finish the run with the mhc version that started it, or start over with --overwrite."
    )


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: for messages about values read from a file."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_trainer_state(path: Path) -> dict:
    try:
        tree = json.loads((path / TRAINER_STATE).read_text(encoding="utf-8"))
    except Exception as e:  # a file that matched its hash but does not parse: still a bad checkpoint
        raise CheckpointError(f"checkpoint {path}: {TRAINER_STATE} could not be read: {e!r}") from e
    try:
        tensors = load_file(str(path / TRAINER_TENSORS))
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: {TRAINER_TENSORS} could not be read: {e!r}") from e
    state = decode_tree(tree, tensors)
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise CheckpointError(f"checkpoint {path} is corrupt: {TRAINER_STATE} holds no run config")
    return state


def read_checkpoint_config(path: str | os.PathLike) -> dict:
    """The training config (a plain dict) saved in a verified checkpoint."""
    path = Path(path)
    verify_checkpoint(path)
    return _read_trainer_state(path)["config"]


def load_checkpoint_state(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict]:
    """Verify and load a checkpoint: ``(model state dict, trainer state)``. Nothing is unpickled."""
    path = Path(path)
    manifest = verify_checkpoint(path)
    try:
        sd = load_file(str(path / MODEL_WEIGHTS))
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: {MODEL_WEIGHTS} could not be read: {e!r}") from e
    state = _read_trainer_state(path)
    aliases = manifest.get("aliases", {})
    # The hashes do not cover the manifest itself: a re-signed one may hold anything JSON can.
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise CheckpointError(
            f"checkpoint {path} is corrupt: {MANIFEST} field 'aliases' is {short_repr(aliases)}, not a mapping of "
            f"weight names to the names they share a tensor with"
        )
    for alias, target in aliases.items():
        if alias in sd:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {MANIFEST} aliases {alias}, which {MODEL_WEIGHTS} already holds"
            )
        if target not in sd:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: alias {alias} -> {target}, which is not in {MODEL_WEIGHTS}"
            )
        sd[alias] = sd[target]
    return sd, state
