"""Non-finite training: steps with a NaN/Inf loss or gradient are skipped and reported; nothing is silent.

A run where no step succeeds any more stops with an error (``max_skipped_in_a_row``), a checkpoint with
non-finite weights is refused at resume, and ``summary.json`` never reports a stale training loss.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mhc import train as T

TINY = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    seq_len=32,
    batch_size=4,
    data="stdlib",
    max_corpus_mb=0.3,
    max_steps=4,
    warmup_steps=0,
    log_interval=10,
    eval_interval=2,
    eval_batches=1,
    ckpt_interval=2,
    progress=False,
    threads=1,
)


# lr=1e15 overflows the weights at the first update; from step 2 on every loss and gradient is NaN.
# The mhc variant also sends NaN through the Birkhoff projection's forward and backward.
# Fewer skipped steps in a row than max_skipped_in_a_row (20): the run completes.
@pytest.mark.parametrize("variant", ["mhc", "residual"])
def test_lr_1e15_completes_with_skipped_steps_reported(tmp_path, variant):
    cfg = T.TrainConfig(
        **TINY, variant=variant, lr=1e15, run_dir=str(tmp_path / variant), cache_dir=str(tmp_path / "c")
    )
    summary = T.train(cfg)
    rd = Path(cfg.run_dir)
    assert summary["steps"] == 4 and summary["skipped_steps"] == 3, summary
    train = [r for r in T.read_metrics(rd / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [
        1,
        2,
        3,
        4,
    ]  # every skipped step is written, whatever log_interval says
    assert [r["skipped"] for r in train] == [False, True, True, True]
    assert all(not math.isfinite(r["loss"]) for r in train[1:]) and math.isfinite(train[0]["loss"])
    assert math.isnan(summary["final_val_loss"]) and not summary["beats_unigram"]
    assert json.loads((rd / "summary.json").read_text())["skipped_steps"] == 3
    for name in ("loss.png", "model/model.safetensors", "checkpoints/latest"):
        assert (rd / name).exists(), name
    T.verify_checkpoint(T.find_latest_checkpoint(rd))


def _resign(checkpoint: Path, name: str) -> None:
    """Rewrite the manifest entry of ``name`` to match the file (what an adversary, or a bad disk tool, can do)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {
        "size": (checkpoint / name).stat().st_size,
        "sha256": T.checkpoint.sha256_file(checkpoint / name),
    }
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _poison(checkpoint: Path, file: str, pick) -> str:
    """Set one tensor of a checkpoint's safetensors file to NaN (the first whose name ``pick`` accepts), re-sign it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(checkpoint / file))
    name = next(k for k in sorted(tensors) if pick(k, tensors[k]))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(checkpoint / file), metadata={"format": "pt"})
    _resign(checkpoint, file)
    T.verify_checkpoint(checkpoint)  # the manifest matches: only the values are bad
    return name


def test_resume_from_nonfinite_weights_stops_at_once_naming_the_tensors(tmp_path, cli, capsys):
    """A checkpoint whose weights (or optimizer moments) hold NaN: resuming it fails before any step, and says which."""
    base = tmp_path / "base"
    cfg = T.TrainConfig(**{**TINY, "max_steps": 6, "ckpt_interval": 3, "plots": False}, run_dir=str(base),
                        cache_dir=str(tmp_path / "c"), stop_at_step=3)  # fmt: skip
    assert T.train(cfg) == {"interrupted": True, "step": 3}
    for what, file, pick in (
        ("weights", "model.safetensors", lambda k, t: "attn_mhc" in k and t.is_floating_point()),
        ("optimizer", "trainer_tensors.safetensors", lambda k, t: t.is_floating_point() and t.dim() >= 1),
    ):
        rd = tmp_path / what
        shutil.copytree(base, rd)
        ckpt = T.find_latest_checkpoint(rd)
        poisoned = _poison(ckpt, file, pick)
        metrics_before = (rd / "metrics.jsonl").read_text()
        code = cli.main(["--resume", "--run-dir", str(rd)])
        err = capsys.readouterr().err
        assert code == 2, (what, code, err)
        assert "not finite" in err and str(ckpt) in err, err
        if what == "weights":
            assert poisoned in err, err  # the tensor is named
        else:
            assert "optimizer state" in err and "exp_avg" in err, err
        # nothing ran: no step, no summary, no model
        assert (rd / "metrics.jsonl").read_text() == metrics_before
        assert not (rd / "summary.json").exists() and not (rd / "model").exists()


def test_a_run_whose_steps_all_fail_stops_with_an_error(tmp_path, cli, capsys):
    """lr=1e15 makes every step after the first non-finite: the run stops after the default 20 skipped steps
    in a row with exit status 1 and a message, instead of running to the end and saving a NaN model."""
    rd = tmp_path / "run"
    sets = {**TINY, "max_steps": 40, "eval_interval": 0, "ckpt_interval": 0, "plots": False, "lr": 1e15,
            "cache_dir": tmp_path / "c"}  # fmt: skip
    code = cli.main(["--run-dir", str(rd), *sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "error: stopped at step 21: the last 20 steps were all skipped" in err, err
    assert "max_skipped_in_a_row" in err, err  # says how to change the limit
    train = [r for r in T.read_metrics(rd / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 22)) and all(r["skipped"] for r in train[1:])
    assert T.read_metrics(rd / "metrics.jsonl")[-1]["kind"] == "stopped"
    assert not (rd / "summary.json").exists() and not (rd / "model").exists()


def test_the_limit_of_skipped_steps_in_a_row_is_configurable(tmp_path):
    common = {**TINY, "max_steps": 8, "eval_interval": 0, "ckpt_interval": 0, "plots": False, "lr": 1e15}
    cfg = T.TrainConfig(
        **common, max_skipped_in_a_row=3, run_dir=str(tmp_path / "three"), cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(T.TrainingStoppedError, match=r"stopped at step 4: the last 3 steps were all skipped"):
        T.train(cfg)
    # 0: never stop (the run goes to its end, every failed step skipped and counted)
    cfg = T.TrainConfig(
        **common, max_skipped_in_a_row=0, run_dir=str(tmp_path / "never"), cache_dir=str(tmp_path / "c")
    )
    assert T.train(cfg)["skipped_steps"] == 7
    with pytest.raises(ValueError, match="max_skipped_in_a_row must be >= 0"):
        T.TrainConfig(**common, max_skipped_in_a_row=-1).validate()


def test_the_final_train_loss_is_never_stale(tmp_path):
    """Steps 2-4 have NaN losses: the summary's final train loss is null, with the reason, not step 1's loss."""
    cfg = T.TrainConfig(**TINY, lr=1e15, run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "c"))
    summary = T.train(cfg)
    assert summary["skipped_steps"] == 3 and summary["steps"] == 4
    assert summary["final_train_loss"] is None, summary["final_train_loss"]
    assert "steps 2-4" in summary["final_train_loss_note"] and "step 1" in summary["final_train_loss_note"]
    assert summary["last_finite_train_loss_step"] == 1
    saved = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert (
        saved["final_train_loss"] is None
        and saved["final_train_loss_note"] == summary["final_train_loss_note"]
    )
