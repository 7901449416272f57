"""Training options are checked before any setup: devices that are not there, zero counts, misspelled keys."""

from __future__ import annotations


import pytest
import torch

from mhc import train as T

TINY = dict(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seq_len=32, batch_size=4, data="stdlib",
    max_corpus_mb=0.3, max_steps=2, warmup_steps=1, eval_interval=0, eval_batches=1, ckpt_interval=0,
    progress=False, plots=False, threads=1,
)



def _sets(**kw) -> list[str]:
    return sum((["--set", f"{k}={v}"] for k, v in kw.items()), [])


def test_a_device_that_is_not_there_stops_at_once(tmp_path, cli, capsys):
    for bad in ("gpu", "cuda:x", "cpu:0", "mps", "cuda:-1"):
        with pytest.raises(ValueError, match=f"device must be auto, cpu, cuda or cuda:N, got '{bad}'"):
            T.TrainConfig(**TINY, device=bad).validate()
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last device: never there
    with pytest.raises(ValueError, match=f"device='{missing}'"):
        T.train(T.TrainConfig(**TINY, device=missing, run_dir=str(tmp_path / "missing")))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': CUDA is not available"):
            T.train(T.TrainConfig(**TINY, device="cuda", run_dir=str(tmp_path / "cuda")))
    assert not (tmp_path / "missing").exists() and not (tmp_path / "cuda").exists()  # stopped before any setup
    for flag in ("gpu", missing):
        code = cli.main(["--run-dir", str(tmp_path / "cli"), "--device", flag, *_sets(**TINY)])
        err = capsys.readouterr().err
        assert code == 2 and f"'{flag}'" in err and "error: device" in err, err
    assert not (tmp_path / "cli").exists()


@pytest.mark.parametrize(
    "key, value",
    [("log_interval", 0), ("eval_batches", 0), ("log_interval", -1), ("eval_interval", -5), ("ckpt_interval", -1),
     ("keep_checkpoints", -1), ("max_steps", -3), ("warmup_steps", -1), ("grad_clip", -1.0), ("lr", 0.0),
     ("lr", float("nan")), ("lr", float("inf")), ("beta1", 1.0), ("min_lr_ratio", 1.5), ("attention_dropout", 1.0),
     ("n_streams", 0), ("num_kv_heads", 3), ("max_time_s", float("nan")), ("spike_threshold", 0.0)],
)
def test_zero_or_negative_counts_and_bad_numbers_are_refused(tmp_path, key, value):
    with pytest.raises(ValueError, match=key):
        T.load_config(None, {**TINY, key: value, "run_dir": str(tmp_path / "r")})


def test_unknown_keys_are_refused_with_a_suggestion(tmp_path, cli, capsys):
    (tmp_path / "typo.yaml").write_text("max_step: 5\nhidden_size: 32\n")
    with pytest.raises(ValueError, match="unknown config key 'max_step'; did you mean 'max_steps'"):
        T.load_config(tmp_path / "typo.yaml")
    with pytest.raises(KeyError):  # also a KeyError, as before
        T.load_config(None, ["warmup_step=3"])
    with pytest.raises(ValueError, match="did you mean 'warmup_steps'"):
        T.load_config(None, ["warmup_step=3"])
    with pytest.raises(ValueError, match="unknown mhc_options key 'projecton'; did you mean 'projection'"):
        T.load_config(None, {"mhc_options": {"projecton": "sinkhorn"}, "max_steps": 1})
    with pytest.raises(ValueError, match="mhc_options.mode is set by the trainer"):
        T.load_config(None, {"mhc_options": {"mode": "hc"}, "max_steps": 1})
    code = cli.main(["--run-dir", str(tmp_path / "cli"), "--set", "eval_batchs=2", *_sets(**TINY)])
    err = capsys.readouterr().err
    assert code == 2 and "did you mean 'eval_batches'" in err, err
    assert not (tmp_path / "cli").exists()


@pytest.mark.parametrize(
    "options, error, match",
    [({"tol": -1.0}, ValueError, "tol must be finite and > 0"), ({"sinkhorn_iters": 2.5}, TypeError, "sinkhorn_iters must be an int"),
     ({"fused": "yes"}, TypeError, "fused must be True or False"), ({"init": "random"}, ValueError, "init must be one of"),
     ({"projection": "sinkhorn", "tol": float("nan")}, ValueError, "tol")],
)  # fmt: skip
def test_bad_mhc_option_values_are_refused_before_any_setup(tmp_path, cli, capsys, options, error, match):
    """mhc_options values go through the check MHCBlock and MHCConfig use, when the config is loaded."""
    with pytest.raises(error, match=match):
        T.load_config(None, {**TINY, "mhc_options": options, "run_dir": str(tmp_path / "r")})
    with pytest.raises(error, match=match):
        T.train(T.TrainConfig(**TINY, mhc_options=options, run_dir=str(tmp_path / "r")))
    assert not (tmp_path / "r").exists()
    code = cli.main(["--run-dir", str(tmp_path / "cli"), "--set", f"mhc_options={options}", *_sets(**TINY)])
    err = capsys.readouterr().err
    assert code == 2 and "error: " in err and match.split()[0] in err, err
    assert not (tmp_path / "cli").exists()


def test_fused_projection_false_lasts_only_for_the_run(tmp_path, monkeypatch):
    """fused_projection=false turns the CUDA projection kernels off (projection_cuda.set_enabled) for the run
    only, and restores the setting it found however the run ends."""
    from mhc import projection_cuda
    from mhc.train import RunDirLock

    calls = []
    real_set_enabled = projection_cuda.set_enabled

    def recording_set_enabled(enabled):
        calls.append(enabled)
        return real_set_enabled(enabled)

    monkeypatch.setattr(projection_cuda, "set_enabled", recording_set_enabled)
    cfg = T.TrainConfig(**{**TINY, "max_steps": 1}, fused_projection=False, run_dir=str(tmp_path / "run"))
    with RunDirLock(tmp_path / "run"), pytest.raises(T.RunDirLockedError):
        T.train(cfg)
    assert calls == [False, True] and real_set_enabled(True) is True  # off for the run, then on again
    calls.clear()
    assert T.train(cfg)["steps"] == 1
    assert calls == [False, True] and real_set_enabled(True) is True
    calls.clear()
    real_set_enabled(False)  # a user's own setting is what the run restores
    T.train(T.TrainConfig(**{**TINY, "max_steps": 1}, fused_projection=False, run_dir=str(tmp_path / "again")))
    assert calls == [False, False] and real_set_enabled(True) is False
    calls.clear()
    T.train(T.TrainConfig(**{**TINY, "max_steps": 1}, run_dir=str(tmp_path / "fused")))
    assert calls == []  # fused_projection=true (the default) leaves the switch alone
