"""Mistakes a new user makes with the training script: each stops with one line and exit 2, and leaves
nothing that blocks the corrected command."""

from __future__ import annotations

import json

import pytest

TINY = dict(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seq_len=32, batch_size=2,
    data="stdlib", max_corpus_mb=0.2, max_steps=2, warmup_steps=1, eval_interval=0, eval_batches=1,
    ckpt_interval=1, progress=False, plots=False, threads=1,
)  # fmt: skip


def sets(**kw) -> list[str]:
    return sum((["--set", f"{k}={v}"] for k, v in {**TINY, **kw}.items()), [])


def refused(cli, capsys, argv, match: str) -> None:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and match in err and "Traceback" not in err, err


def test_a_checkpoint_or_a_runs_model_folder_is_refused_as_a_run_dir(tmp_path, cli, capsys):
    run = tmp_path / "run"
    assert cli.main(["--run-dir", str(run), *sets()]) == 0
    capsys.readouterr()
    step = run / "checkpoints" / "step_00000001"
    before = sorted(p.name for p in step.iterdir())
    for target in (step, run / "checkpoints" / "new", run / "model" / "inner"):
        for extra in ([], ["--resume"]):
            refused(cli, capsys, ["--run-dir", str(target), *extra, *sets()], "run")
    assert sorted(p.name for p in step.iterdir()) == before  # no lock file or output written into it
    assert not (run / "checkpoints" / "new").exists() and not (run / "model" / "inner").exists()
    # the run itself still resumes (a longer run from its last checkpoint)
    assert cli.main(["--run-dir", str(run), "--resume", "--resume-override", *sets(max_steps=3)]) == 0


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("seq_len", 1, "seq_len must be >= 2"),
        ("hidden_size", 9, "must be even"),  # with num_heads=3 below: head_dim 3
        ("seed", 10**16, "seed must be in [0, 2**32)"),
        ("seed", -1, "seed must be in [0, 2**32)"),
        ("batch_size", "1e30", "must stay below 2**31"),
        ("threads", 10**6, "threads must be at most"),
        ("progress", "[1]", "progress needs a boolean"),
        ("mhc_options", "{a: b", "not a valid YAML mapping"),
    ],
)
def test_settings_that_would_crash_or_hang_are_refused(tmp_path, cli, capsys, key, value, match):
    extra = {"num_heads": 3} if key == "hidden_size" else {}
    refused(cli, capsys, ["--run-dir", str(tmp_path / "r"), *sets(**extra), "--set", f"{key}={value}"], match)
    assert not (tmp_path / "r").exists()


def test_yaml_values_of_the_wrong_kind_are_refused(tmp_path, cli, capsys):
    for text, match in (
        ("batch_size: true\n", "batch_size needs an integer, got True"),
        ("lr: true\n", "lr needs a number, got True"),
        ("progress: [1]\n", "progress needs a boolean, got [1]"),
        ("lr: [1\n", "not valid YAML"),
    ):
        config = tmp_path / "c.yaml"
        config.write_text("base: tiny_cpu_mhc\n" + text)
        refused(cli, capsys, ["--config", str(config), "--run-dir", str(tmp_path / "r")], match)
    config.write_bytes(b"\xff\xfe")
    refused(cli, capsys, ["--config", str(config), "--run-dir", str(tmp_path / "r")], "not UTF-8 text")


def test_a_run_dir_that_cannot_be_a_folder_is_one_line(tmp_path, cli, capsys):
    (tmp_path / "afile").write_text("x")
    refused(cli, capsys, ["--run-dir", str(tmp_path / "afile" / "sub"), *sets()], "is a file, not a folder")


def test_too_little_validation_data_leaves_nothing_that_blocks_a_rerun(tmp_path, cli, capsys):
    data = tmp_path / "small.txt"
    data.write_text(
        "".join(chr(97 + i * 7 % 26) for i in range(150))
    )  # 150 bytes: a 100-byte chunk to validate
    run = tmp_path / "run"
    argv = ["--run-dir", str(run), *sets(data=data, split_chunk_chars=100, seq_len=64, max_corpus_mb=0)]
    refused(cli, capsys, argv, "the validation split holds fewer than seq_len=64 tokens")
    assert not [p.name for p in run.iterdir() if p.name != ".lock"]
    assert cli.main(["--run-dir", str(run), *sets()]) == 0  # the corrected command is not refused


def test_a_resume_whose_time_budget_is_spent_is_refused(tmp_path, cli, capsys):
    run = tmp_path / "run"
    assert cli.main(["--run-dir", str(run), *sets(max_steps=1000, max_time_s=0.5)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early"] and summary["steps"] < 1000
    capsys.readouterr()
    refused(
        cli,
        capsys,
        ["--run-dir", str(run), "--resume", *sets(max_steps=1000, max_time_s=0.5)],
        "already spent",
    )
    more = sets(max_steps=summary["steps"] + 2, max_time_s=0)
    assert cli.main(["--run-dir", str(run), "--resume", "--resume-override", *more]) == 0


def test_a_resume_below_the_runs_step_is_refused(tmp_path, cli, capsys):
    """A finished 2-step run resumed with max_steps=1 wrote a summary of 2 steps against max_steps 1."""
    run = tmp_path / "run"
    assert cli.main(["--run-dir", str(run), *sets()]) == 0
    capsys.readouterr()
    argv = ["--run-dir", str(run), "--resume", "--resume-override", *sets(max_steps=1)]
    refused(cli, capsys, argv, "the run is at step 2 already")


def test_a_batch_larger_than_the_training_split_says_its_windows_repeat(tmp_path, cli, capsys):
    data = tmp_path / "small.txt"
    data.write_text("".join(chr(97 + i * 7 % 26) for i in range(5000)))  # 140 training windows
    small = dict(data=data, max_corpus_mb=0, split_chunk_chars=250, batch_size=256, max_steps=1)
    argv = ["--run-dir", str(tmp_path / "run"), *sets(**small)]
    assert cli.main(argv) == 0
    assert "windows repeat within every step" in capsys.readouterr().out


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, cli, capsys, monkeypatch):
    import mhc.train.cli as train_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "train", interrupted)
    assert cli.main(["--run-dir", str(tmp_path / "run"), *sets()]) == 130
    err = capsys.readouterr().err
    assert "interrupted; continue from the last checkpoint with --resume" in err and "Traceback" not in err


def test_a_config_beside_resume_and_run_dir_is_said_to_be_unread(tmp_path, cli, capsys):
    run = tmp_path / "run"
    assert cli.main(["--run-dir", str(run), *sets()]) == 0
    capsys.readouterr()
    argv = ["--config", "tiny_cpu_hc", "--run-dir", str(run), "--resume", *sets()]
    assert cli.main(argv) == 0
    assert "--config tiny_cpu_hc is not read" in capsys.readouterr().out
