"""Train small decoder LMs with residual, HC or mHC connections, offline.

The command lines ``mhc-train`` and ``mhc-compare`` (:mod:`~mhc.train.cli`; in a checkout also
``scripts/train_lm.py`` and ``scripts/compare.py``) are thin layers over this package::

    from mhc.train import load_config, train
    summary = train(load_config("tiny_cpu_mhc", ["max_steps=200"]))   # a preset's name, or a YAML file

Modules, one concern each:

* :mod:`~mhc.train.config`: :class:`TrainConfig`, the presets (``mhc/train/presets/*.yaml``,
  :func:`list_presets`), YAML loading (``base:`` inheritance), ``key=value`` overrides, validation
  (the mHC options through :func:`mhc.options.check_options`);
* :mod:`~mhc.train.data`: the corpus (this Python's standard-library sources by default), the
  deterministic train/validation split, packed token windows;
* :mod:`~mhc.train.tokenizer`: byte-level, corpus BPE (cached) or GPT-2 files;
* :mod:`~mhc.train.model`: ``MHCForCausalLM`` over a Llama config, AdamW, warmup + cosine;
* :mod:`~mhc.train.checkpoint`: atomic, verified checkpoints (safetensors + JSON, never a pickle);
* :mod:`~mhc.train.rng`: the RNG states a checkpoint saves and a resume restores;
* :mod:`~mhc.train.resume`: what ``--resume`` continues with, and which settings it may change
  (:data:`RESUME_FIXED`: never; :data:`RESUME_SESSION`: freely; :data:`RESUME_OVERRIDABLE`: with
  ``resume_override``);
* :mod:`~mhc.train.run_dir`: the run directory's lock and the outputs a run owns;
* :mod:`~mhc.train.distributed`: one process, or DDP / FSDP2 under ``torchrun``;
* :mod:`~mhc.train.loop`: :func:`train`;
* :mod:`~mhc.train.reporting`: ``metrics.jsonl``, loss spikes, gains, ``loss.png`` / ``gains.png``;
* :mod:`~mhc.train.compare`: :func:`write_comparison` (``compare.md/json/png``);
* :mod:`~mhc.train.plots`: the matplotlib figures (imported only when a figure is drawn);
* :mod:`~mhc.train.cli`: the command lines (``mhc-train``, ``mhc-compare``; ``python -m mhc.train``).

A run directory holds ``config.yaml``, ``metrics.jsonl``, ``summary.json``, ``loss.png``,
``gains.png``, ``checkpoints/step_XXXXXXXX/`` (+ ``checkpoints/latest``) and ``model/`` (a
``from_pretrained`` folder with its tokenizer).
"""

from .checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint_state,
    verify_checkpoint,
)
from .compare import write_comparison
from .config import (
    ConfigKeyError,
    ConfigNotFoundError,
    DataError,
    DataNotFoundError,
    TrainConfig,
    apply_overrides,
    list_presets,
    load_config,
    parse_device,
    preset_path,
)
from .data import Corpus, PackedData, load_corpus, prepare_data, split_corpus, unigram_entropy
from .distributed import resolve_device
from .loop import TrainingStoppedError, train
from .model import build_model, lr_lambda
from .reporting import plot_run, read_metrics
from .resume import (
    RESUME_FIXED,
    RESUME_OVERRIDABLE,
    RESUME_SESSION,
    check_resume_changes,
    config_changes,
    resume_config,
)
from .rng import rng_state, set_rng_state
from .run_dir import RunDirLock, RunDirLockedError, RunDirSetupError
from .tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    load_gpt2_tokenizer,
    load_tokenizer,
    save_hf_tokenizer,
)

__all__ = [
    # settings
    "TrainConfig",
    "ConfigKeyError",
    "load_config",
    "list_presets",
    "preset_path",
    "ConfigNotFoundError",
    "DataError",
    "DataNotFoundError",
    "apply_overrides",
    "parse_device",
    "resolve_device",
    # resuming
    "resume_config",
    "config_changes",
    "check_resume_changes",
    "RESUME_FIXED",
    "RESUME_SESSION",
    "RESUME_OVERRIDABLE",
    # data and tokenizers
    "Corpus",
    "load_corpus",
    "split_corpus",
    "PackedData",
    "prepare_data",
    "unigram_entropy",
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "load_gpt2_tokenizer",
    "load_tokenizer",
    "save_hf_tokenizer",
    # model
    "build_model",
    "lr_lambda",
    # training
    "train",
    "TrainingStoppedError",
    "rng_state",
    "set_rng_state",
    # checkpoints and the run directory
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "find_latest_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
    "load_checkpoint_state",
    "RunDirLock",
    "RunDirLockedError",
    "RunDirSetupError",
    # reports
    "read_metrics",
    "plot_run",
    "write_comparison",
]
