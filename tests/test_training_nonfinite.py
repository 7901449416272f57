"""A diverging run keeps going: steps with a NaN/Inf loss or gradient are skipped and reported, nothing crashes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mhc import train as T

TINY = dict(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seq_len=32, batch_size=4, data="stdlib",
    max_corpus_mb=0.3, max_steps=4, warmup_steps=0, log_interval=10, eval_interval=2, eval_batches=1,
    ckpt_interval=2, progress=False, threads=1,
)


# lr=1e15 overflows the weights at the first update; from step 2 on every loss and gradient is NaN.
# The mhc variant also sends NaN through the Birkhoff projection's forward and backward.
@pytest.mark.parametrize("variant", ["mhc", "residual"])
def test_lr_1e15_completes_with_skipped_steps_reported(tmp_path, variant):
    cfg = T.TrainConfig(**TINY, variant=variant, lr=1e15, run_dir=str(tmp_path / variant), cache_dir=str(tmp_path / "c"))
    summary = T.train(cfg)
    rd = Path(cfg.run_dir)
    assert summary["steps"] == 4 and summary["skipped_steps"] == 3, summary
    train = [r for r in T.read_metrics(rd / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]  # every skipped step is written, whatever log_interval says
    assert [r["skipped"] for r in train] == [False, True, True, True]
    assert all(not math.isfinite(r["loss"]) for r in train[1:]) and math.isfinite(train[0]["loss"])
    assert math.isnan(summary["final_val_loss"]) and not summary["beats_unigram"]
    assert json.loads((rd / "summary.json").read_text())["skipped_steps"] == 3
    for name in ("loss.png", "model/model.safetensors", "checkpoints/latest"):
        assert (rd / name).exists(), name
    T.verify_checkpoint(T.find_latest_checkpoint(rd))
