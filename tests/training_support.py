"""What the training tests share: the tiny run's settings, a fixture that trains it once, and run comparisons."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mhc import train as T

REPO = Path(__file__).resolve().parent.parent
TINY = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    seq_len=32,
    batch_size=4,
    data="stdlib",
    max_corpus_mb=0.3,
    max_steps=8,
    warmup_steps=2,
    lr=3e-3,
    log_interval=1,
    eval_interval=4,
    eval_batches=2,
    ckpt_interval=3,
    progress=False,
    threads=1,
)


def tiny_cfg(tmp_path: Path, name: str = "run", **kw) -> T.TrainConfig:
    cfg = T.TrainConfig(
        **{**TINY, "run_dir": str(tmp_path / name), "cache_dir": str(tmp_path / "cache"), **kw}
    )
    cfg.validate()
    return cfg


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env["OMP_NUM_THREADS"] = "1"
    return env


def train_losses(run_dir) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in T.read_metrics(Path(run_dir) / "metrics.jsonl") if r["kind"] == "train"
    }


RNG = {"attention_dropout": 0.1}


def train_full_run(tmp_path_factory):
    """The tiny run, trained to the end (``conftest.full_run``, once per test module): ``(cfg, summary)``."""
    tmp = tmp_path_factory.mktemp("full")
    cfg = tiny_cfg(tmp, "full", **RNG)
    summary = T.train(cfg)
    return cfg, summary


def config_yaml_without_run_dir(run_dir) -> dict:
    import yaml

    d = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    d.pop("run_dir")
    return d


def eval_records(run_dir) -> list[tuple[int, float]]:
    return [
        (r["step"], r["val_loss"])
        for r in T.read_metrics(Path(run_dir) / "metrics.jsonl")
        if r["kind"] == "eval"
    ]


def assert_same_run(run_dir, ref_run_dir) -> None:
    """Same losses at every step, same evaluations, same final loss and config.yaml as the reference run."""
    full, resumed = train_losses(ref_run_dir), train_losses(run_dir)
    assert sorted(resumed) == sorted(full), (sorted(resumed), sorted(full))
    for step in full:
        assert resumed[step] == full[step], (step, resumed[step], full[step])
    assert eval_records(run_dir) == eval_records(ref_run_dir)
    s_ref = json.loads((Path(ref_run_dir) / "summary.json").read_text())
    s_new = json.loads((Path(run_dir) / "summary.json").read_text())
    assert s_new["final_val_loss"] == s_ref["final_val_loss"] and s_new["steps"] == s_ref["steps"]
    assert config_yaml_without_run_dir(run_dir) == config_yaml_without_run_dir(ref_run_dir)


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
