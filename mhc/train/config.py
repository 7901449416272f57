"""A run's settings: :class:`TrainConfig`, YAML files with ``base:`` inheritance, ``key=value`` overrides.

Presets ship inside the package (``mhc/train/presets/*.yaml``, :func:`list_presets`): ``load_config`` and
``--config`` take a preset's name (``"tiny_cpu_mhc"``) as well as a YAML file's path, and a file's ``base:``
may name a preset too.

Every setting is checked before anything is set up (:meth:`TrainConfig.validate`): a bad value raises
``ValueError``/``TypeError`` naming the key, a misspelled key :class:`ConfigKeyError` with the closest
known keys. The mHC settings go through the same check as :class:`mhc.MHCBlock` and
:class:`mhc.MHCConfig` (:func:`mhc_config_options`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..hf import MHC_FIELDS, check_model_settings
from ..mixing import check_lite_streams
from ..options import OPTION_NAMES, check_options

__all__ = [
    "VARIANTS",
    "VARIANT_SETTINGS",
    "PRESETS_DIR",
    "DEFAULT_PRESET",
    "ConfigNotFoundError",
    "list_presets",
    "preset_path",
    "resolve_config_path",
    "TOKENIZERS",
    "TrainConfig",
    "key_help",
    "ConfigKeyError",
    "mhc_config_options",
    "parse_device",
    "apply_overrides",
    "DataError",
    "DataNotFoundError",
    "read_yaml",
    "load_config",
    "config_yaml",
    "cache_root",
]

VARIANTS = ("residual", "hc", "mhc", "mhc-sk20", "mhc-lite")
#: The MHCConfig settings each variant stands for (design.md, "Three ways to a doubly stochastic H_res").
#: ``mhc_options`` may repeat them but not contradict them: ``mhc-sk20`` with 5 Sinkhorn rounds is refused.
VARIANT_SETTINGS: dict[str, dict[str, Any]] = {
    "residual": {"mode": "residual"},
    "hc": {"mode": "hc"},
    "mhc": {"mode": "mhc"},  # exact Newton projection by default; mhc_options may choose another
    "mhc-sk20": {
        "mode": "mhc",
        "projection": "sinkhorn",
        "sinkhorn_iters": 20,
    },  # the paper's / DeepSeek's recipe
    "mhc-lite": {"mode": "mhc", "projection": "lite"},  # convex combination of the n! permutations
}
TOKENIZERS = ("byte", "bpe", "gpt2")
#: The presets shipped with the package (package data: in the wheel, and in a checkout).
PRESETS_DIR = Path(__file__).resolve().parent / "presets"
#: What ``mhc-train`` (``scripts/train_lm.py``) trains without ``--config``: the README's main job.
DEFAULT_PRESET = "tiny_cpu_mhc"


@dataclass
class TrainConfig:
    """Every knob of a run. YAML files and ``--set key=value`` fill these fields."""

    # run
    run_dir: str = ""  # default: runs/<config name>
    seed: int = 0
    # model (Llama-style base config, wrapped by MHCForCausalLM)
    variant: str = "mhc"  # residual | hc | mhc | mhc-sk20 | mhc-lite (VARIANT_SETTINGS)
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
    # "synthetic" (generated, the same everywhere), "stdlib" (this Python's sources), "python" (stdlib +
    # site-packages .py), or comma-separated files/folders; summary.json records which text it was
    data: str = "synthetic"
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
    tokens: int = 0  # token budget (used when max_steps is 0; setting it alone sets max_steps to 0)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0: no clipping (the norm is still logged)
    max_time_s: float = 0.0  # stop by wall clock, over the whole run and its resumes (0: never)
    max_skipped_in_a_row: int = (
        20  # stop with an error after this many skipped (non-finite) steps in a row (0: never)
    )
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
        """Check every key before anything is set up; raise ``ValueError`` (or ``TypeError``) naming the key."""
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.dist not in ("ddp", "fsdp"):
            raise ValueError(f"dist must be 'ddp' or 'fsdp', got {self.dist!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        parse_device(self.device)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):  # NaN fails both
                raise ValueError(f"{name} must be >= 0 (0: {_ZERO_MEANS[name]}), got {value}")
        if self.max_steps == 0 and self.tokens == 0:
            raise ValueError("set max_steps or tokens (a token budget)")
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
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (a window predicts its next tokens), got {self.seq_len}")
        if self.batch_size * self.seq_len >= 2**31:
            raise ValueError(
                f"a batch of batch_size x seq_len = {self.batch_size} x {self.seq_len} tokens must stay below 2**31"
            )
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        cpus = os.cpu_count() or 1
        if self.threads > 4 * cpus:
            raise ValueError(f"threads must be at most 4 x this machine's {cpus} CPUs, got {self.threads}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size / num_heads = {self.hidden_size // self.num_heads} must be even (rotary embeddings "
                "rotate pairs of a head's channels)"
            )
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.tokenizer == "gpt2" and not self.tokenizer_path:
            raise ValueError(
                "tokenizer=gpt2 needs tokenizer_path (a folder with vocab.json/encoder.json + merges)"
            )
        if self.tokenizer == "bpe" and self.bpe_vocab_size < 258:
            raise ValueError(
                f"bpe_vocab_size must be >= 258 (256 bytes, end-of-text, one merge), got {self.bpe_vocab_size}"
            )
        mhc_config_options(self)

    @property
    def streams(self) -> int:
        """The number of residual streams the model gets: ``n_streams``, or 1 for ``variant="residual"``."""
        return 1 if self.variant == "residual" else self.n_streams

    def to_dict(self) -> dict[str, Any]:
        """Every field as a plain dict (what ``config.yaml`` and the checkpoints store)."""
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
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
    "max_skipped_in_a_row": "never stop for skipped steps",
    "threads": "torch's default",
    "eval_interval": "only the final evaluation",
    "ckpt_interval": "only the final checkpoint",
    "keep_checkpoints": "keep all",
    "stop_at_step": "never",
}
_NON_NEGATIVE = tuple(_ZERO_MEANS)


def key_help(name: str) -> str:
    """One line for ``--help`` on config key ``name``: its default, and what 0 means where it means something."""
    f = FIELDS[name]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    zero = f"; 0: {_ZERO_MEANS[name]}" if name in _ZERO_MEANS else ""
    return f"default {default!r}{zero}"


class ConfigKeyError(KeyError, ValueError):
    """An unknown (e.g. misspelled) config key; the message suggests the closest known keys."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def unknown_key_error(name: str, known, what: str = "config key") -> ConfigKeyError:
    """A :class:`ConfigKeyError` for ``name``, suggesting up to three close names of ``known``."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = (
        f"; did you mean {' or '.join(repr(c) for c in close)}?"
        if close
        else f"; known keys: {', '.join(sorted(known))}"
    )
    return ConfigKeyError(f"unknown {what} {name!r}{hint}")


# MHCConfig settings the trainer fills itself: the wrapped config, and the top-level n_streams and variant.
_SET_BY_TRAINER = ("base_config", "n_streams", "mode")
MHC_OPTION_KEYS = tuple(k for k in MHC_FIELDS if k not in _SET_BY_TRAINER)


def mhc_config_options(cfg: TrainConfig) -> dict[str, Any]:
    """The mHC settings of ``MHCConfig`` for ``cfg``: ``n_streams`` (:attr:`~TrainConfig.streams`),
    the variant's :data:`VARIANT_SETTINGS` (``mode``, and the projection of ``mhc-sk20`` and
    ``mhc-lite``) and ``cfg.mhc_options``, checked and normalised.

    The site options among them go through :func:`mhc.options.check_options`, the check that
    :class:`mhc.MHCBlock` and :class:`mhc.MHCConfig` apply; ``expand`` and ``reduce`` (model-level
    settings, not site options) are checked by ``MHCConfig`` itself when the model is built.

    Raises:
        TypeError: ``mhc_options`` is not a mapping, or a value of the wrong type.
        ValueError: a value out of range; a key the trainer sets itself (``mode``, ``n_streams``); a key
            that contradicts the variant (``projection`` of ``mhc-lite``); ``mhc-lite`` with ``n_streams > 5``;
            an unknown variant.
        ConfigKeyError: an unknown ``mhc_options`` key (a ``ValueError`` too), with the closest keys.
    """
    if cfg.variant not in VARIANT_SETTINGS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {cfg.variant!r}")
    fixed = VARIANT_SETTINGS[cfg.variant]
    options = cfg.mhc_options
    if not isinstance(options, dict):
        raise TypeError(f"mhc_options must be a mapping, got {options!r}")
    for key in options:
        if key in _SET_BY_TRAINER:
            raise ValueError(f"mhc_options.{key} is set by the trainer; use the top-level key instead")
        if key not in MHC_OPTION_KEYS:
            raise unknown_key_error(str(key), MHC_OPTION_KEYS, "mhc_options key")
        if key in fixed and options[key] != fixed[key]:
            raise ValueError(
                f"mhc_options.{key}={options[key]!r} contradicts variant {cfg.variant!r}, which sets "
                f"{key}={fixed[key]!r}; use variant 'mhc' with mhc_options to try other settings"
            )
    settings = {"n_streams": cfg.streams, **fixed, **options}
    site_options = {k: v for k, v in settings.items() if k in OPTION_NAMES}
    settings = {**settings, **check_options(**site_options)}
    check_model_settings(**settings)
    if settings["mode"] == "mhc" and settings.get("projection") == "lite":
        check_lite_streams(settings["n_streams"])
    return settings


def parse_device(device: str) -> tuple[str, int | None]:
    """``"auto" | "cpu" | "cuda" | "cuda:N"`` -> ``(kind, index)``; anything else raises ``ValueError``."""
    m = re.fullmatch(r"(auto|cpu|cuda)(?::(\d+))?", str(device).strip())
    if not m or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return m.group(1), (int(m.group(2)) if m.group(2) is not None else None)


def _coerce(name: str, value: Any) -> Any:
    """Coerce a YAML or command-line value to the type of ``TrainConfig.<name>``."""
    if name not in FIELDS:
        raise unknown_key_error(name, FIELDS)
    default = FIELDS[name].default
    if FIELDS[name].default_factory is not dataclasses.MISSING:  # dict
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{name}: not a valid YAML mapping ({' '.join(str(e).split())})") from None
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
        if not isinstance(value, bool):  # bool([1]) or bool(2) would pass anything
            raise ValueError(f"{name} needs a boolean, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        # YAML's true is an int to Python (batch_size: true would be 1), a list is no number
        raise ValueError(f"{name} needs {'an integer' if kind is int else 'a number'}, got {value!r}")
    if kind is int:
        given = value
        try:
            if isinstance(value, str):
                value = (
                    float(value.replace("_", ""))
                    if any(c in value for c in ".eE")
                    else int(value.replace("_", ""))
                )
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{name} needs an integer, got {given!r}") from None
    if kind is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} needs a number, got {value!r}") from None
    return "" if value is None else str(value)


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any] | Sequence[str]) -> TrainConfig:
    """Return ``cfg`` with overrides applied: a mapping, or ``["key=value", ...]`` strings.

    Values are coerced to each field's type (``"1e3"`` for an int field is 1000). The training
    budget is ``max_steps`` where it is set, else ``tokens``; so overrides that give ``tokens``
    without ``max_steps`` also set ``max_steps`` to 0, and the token budget replaces a step count
    that ``cfg`` had (a preset's ``max_steps`` would otherwise silently win over ``--tokens``).
    """
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
    if "tokens" in overrides and "max_steps" not in overrides:
        values["max_steps"] = 0
    return TrainConfig(**values)


class DataError(ValueError):
    """The run's data settings give it no data: a corpus path that holds no UTF-8 text, a corpus too
    small to split or to fill one sequence, a tokenizer folder without its files.

    Raised while the data is prepared, before the first step; ``mhc-train`` reports it in one line
    and exits 2, as for other refused settings.
    """


class DataNotFoundError(DataError, FileNotFoundError):
    """A corpus or tokenizer path that does not exist (a :class:`DataError` and a ``FileNotFoundError``)."""


class ConfigNotFoundError(FileNotFoundError, ValueError):
    """A config that is neither an existing YAML file nor a preset's name; the message lists the presets.

    A ``FileNotFoundError`` (what opening a missing file raised before presets existed) and a
    ``ValueError`` (what the command line reports as a bad setting, in one line).
    """


def list_presets() -> list[str]:
    """The names of the presets shipped with the package (``mhc/train/presets/<name>.yaml``), sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name`` (``"tiny_cpu_mhc"``; a trailing ``.yaml`` is allowed).

    Raises:
        ConfigNotFoundError: no such preset; the message suggests close names and lists every preset.
    """
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    path = PRESETS_DIR / f"{stem}.yaml"
    if stem and "/" not in stem and "\\" not in stem and path.is_file():
        return path
    presets = list_presets()
    close = difflib.get_close_matches(stem, presets, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ConfigNotFoundError(f"unknown preset {name!r}{hint}; the presets are: {', '.join(presets)}")


def resolve_config_path(config: str | os.PathLike) -> Path:
    """The YAML file ``config`` names: an existing file, else a preset's name (:func:`preset_path`).

    A bare name (no folder, no suffix other than ``.yaml``) that is not a file is looked up among the
    presets. A path that does not exist raises, and says so when its file name is a preset's
    (``configs/tiny_cpu_mhc.yaml`` from before the presets moved into the package).

    Raises:
        ConfigNotFoundError: neither a file nor a preset; the message lists the presets.
    """
    path = Path(config).expanduser()
    if path.is_file():
        return path
    text = str(config)
    if path.name == text and path.suffix in ("", ".yaml"):  # a bare name: a preset
        return preset_path(text)
    if path.suffix == ".yaml" and path.stem in list_presets():
        raise ConfigNotFoundError(
            f"config file {text} does not exist; the presets ship inside the package now: use the preset's name "
            f"({path.stem!r}, e.g. --config {path.stem})"
        )
    raise ConfigNotFoundError(
        f"config file {text} does not exist (give a YAML file or a preset's name; presets: {', '.join(list_presets())})"
    )


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The keys of a YAML config, with those of its ``base:`` file underneath.

    ``base:`` is a file relative to the YAML file, or else a preset's name (``base: tiny_cpu_mhc``).
    ``mhc_options`` mappings merge key by key; every other key of the file replaces its base's.
    """
    path = path.resolve()
    if path in seen:
        raise ValueError(f"config inheritance loop through {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a config must be a YAML mapping")
    base = raw.pop("base", None)
    merged: dict[str, Any] = {}
    if base:
        base_path = path.parent / str(base)
        if not base_path.is_file():
            try:
                base_path = preset_path(str(base))
            except ConfigNotFoundError as e:
                raise ConfigNotFoundError(
                    f"{path}: base {base!r} is neither a file beside it nor a preset ({e})"
                ) from None
        merged.update(read_yaml(base_path, seen + (path,)))
    for k, v in raw.items():
        if k == "mhc_options" and isinstance(v, dict):
            merged[k] = {**merged.get(k, {}), **v}
        else:
            merged[k] = v
    return merged


def load_config(
    config: str | os.PathLike | None = None, overrides: dict[str, Any] | Sequence[str] = ()
) -> TrainConfig:
    """Load a YAML config (following ``base:`` links), then apply overrides, then validate.

    Args:
        config: a YAML file's path, or a preset's name (``"tiny_cpu_mhc"``: :func:`list_presets`);
            None: the defaults of :class:`TrainConfig` alone.
        overrides: a mapping, or ``["key=value", ...]`` strings (:func:`apply_overrides`).

    The run directory defaults to ``runs/<config file stem>`` (``runs/default`` without a config).

    Raises:
        ConfigNotFoundError: ``config`` is neither a file nor a preset (the message lists the presets).
    """
    cfg = TrainConfig()
    if config is not None:
        path = resolve_config_path(config)
        values = read_yaml(path)
        cfg = apply_overrides(cfg, values)
        if not cfg.run_dir:
            cfg.run_dir = str(Path("runs") / path.stem)
    cfg = apply_overrides(cfg, overrides)
    if not cfg.run_dir:
        cfg.run_dir = "runs/default"
    cfg.validate()
    return cfg


def config_yaml(cfg: TrainConfig, overrides: Sequence[dict] = ()) -> str:
    """``config.yaml`` of a run: its settings, after a comment line per ``--resume-override``.

    ``overrides``: ``{"step": int, "changes": {key: [old, new]}}`` records, oldest first.
    """
    notes = "".join(
        f"# --resume-override at step {o['step']}: "
        + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in o["changes"].items())
        + "\n"
        for o in overrides
    )
    return notes + yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def cache_root(cfg: TrainConfig) -> Path:
    """Where tokenizers and token arrays are cached: ``cache_dir``, else ``$XDG_CACHE_HOME/mhc`` or ``~/.cache/mhc``."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mhc"
