"""--resume trains with the run's own settings; a contradicting flag is refused unless --resume-override says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

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
    max_steps=6,
    warmup_steps=2,
    lr=3e-3,
    min_lr_ratio=0.1,
    log_interval=1,
    eval_interval=0,
    eval_batches=1,
    ckpt_interval=3,
    progress=False,
    plots=False,
    threads=1,
)


def _stopped_run(tmp_path: Path) -> Path:
    rd = tmp_path / "run"
    cfg = T.TrainConfig(**TINY, run_dir=str(rd), cache_dir=str(tmp_path / "cache"), stop_at_step=4)
    assert T.train(cfg) == {"interrupted": True, "step": 4}
    assert T.find_latest_checkpoint(rd).name == "step_00000003"
    return rd


def _train_records(rd: Path) -> dict[int, dict]:
    return {r["step"]: r for r in T.read_metrics(rd / "metrics.jsonl") if r["kind"] == "train"}


def test_contradicting_flags_are_refused_with_every_key(tmp_path, cli, capsys):
    rd = _stopped_run(tmp_path)
    config_before = (rd / "config.yaml").read_text()
    code = cli.main(
        [
            "--resume",
            "--run-dir",
            str(rd),
            "--lr",
            "1e-3",
            "--warmup-steps",
            "5",
            "--grad-clip",
            "0.5",
            "--min-lr-ratio",
            "0.2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    for line in (
        "lr: run 0.003, now 0.001",
        "warmup_steps: run 2, now 5",
        "grad_clip: run 1.0, now 0.5",
        "min_lr_ratio: run 0.1, now 0.2",
        "--resume-override",
    ):
        assert line in err, err
    assert (rd / "config.yaml").read_text() == config_before and T.find_latest_checkpoint(
        rd
    ).name == "step_00000003"
    # model, seed and data keys never change, not even with the override
    code = cli.main(
        ["--resume", "--run-dir", str(rd), "--seed", "1", "--hidden-size", "64", "--resume-override"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "not even with --resume-override" in err and "seed: run 0, now 1" in err, err
    assert "hidden_size: run 32, now 64" in err
    # the library refuses the same way
    cfg = T.resume_config(rd, ["lr=1e-3"])
    with pytest.raises(T.CheckpointError, match=r"lr: run 0\.003, now 0\.001"):
        T.train(cfg, resume=True)
    # repeating the run's own value, or changing a session key, is no contradiction
    code = cli.main(
        ["--resume", "--run-dir", str(rd), "--lr", "0.003", "--stop-at-step", "4", "--threads", "1"]
    )
    assert code == 0, capsys.readouterr().err


def test_override_applies_from_the_checkpoint_on_and_config_yaml_records_it(tmp_path, cli, capsys):
    rd = _stopped_run(tmp_path)
    code = cli.main(
        ["--resume", "--run-dir", str(rd), "--lr", "1e-3", "--max-steps", "7", "--resume-override"]
    )
    assert code == 0, capsys.readouterr().err
    saved = yaml.safe_load((rd / "config.yaml").read_text())
    assert saved["lr"] == 1e-3 and saved["max_steps"] == 7 and saved["warmup_steps"] == 2
    assert (
        "# --resume-override at step 3: max_steps 6 -> 7, lr 0.003 -> 0.001"
        in (rd / "config.yaml").read_text()
    )
    recs = _train_records(rd)
    assert sorted(recs) == list(range(1, 8))
    # steps 1-3 kept the run's schedule; from step 4 on, the new peak lr over the new length
    assert recs[3]["lr"] == pytest.approx(3e-3 * T.lr_lambda(2, 2, 6, 0.1), rel=1e-12)
    for step in (4, 5, 6, 7):
        assert recs[step]["lr"] == pytest.approx(1e-3 * T.lr_lambda(step - 1, 2, 7, 0.1), rel=1e-12), step
    # resuming the finished run again with no flag keeps the overridden settings and their record
    assert cli.main(["--resume", "--run-dir", str(rd)]) == 0, capsys.readouterr().err
    text = (rd / "config.yaml").read_text()
    assert yaml.safe_load(text)["lr"] == 1e-3 and text.count("# --resume-override at step 3") == 1


def test_resume_before_the_first_checkpoint_uses_the_runs_config_yaml(tmp_path, cli, capsys):
    """A run stopped before any checkpoint restarts from step 0 with its own settings, not the default YAML's."""
    rd = tmp_path / "early"
    cfg = T.TrainConfig(
        **{**TINY, "ckpt_interval": 5}, run_dir=str(rd), cache_dir=str(tmp_path / "cache"), stop_at_step=2
    )
    T.train(cfg)
    assert T.find_latest_checkpoint(rd) is None
    assert cli.main(["--resume", "--run-dir", str(rd), "--max-steps", "3"]) == 0, capsys.readouterr().err
    saved = yaml.safe_load((rd / "config.yaml").read_text())
    assert saved["hidden_size"] == 32 and saved["max_steps"] == 3 and sorted(_train_records(rd)) == [1, 2, 3]
