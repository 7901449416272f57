"""Training options are checked before any setup: devices that are not there, zero counts, misspelled keys."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mhc import train as T
from mhc.train.config import mhc_config_options

TINY = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    seq_len=32,
    batch_size=4,
    data="stdlib",
    max_corpus_mb=0.3,
    max_steps=2,
    warmup_steps=1,
    eval_interval=0,
    eval_batches=1,
    ckpt_interval=0,
    progress=False,
    plots=False,
    threads=1,
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
    assert (
        not (tmp_path / "missing").exists() and not (tmp_path / "cuda").exists()
    )  # stopped before any setup
    for flag in ("gpu", missing):
        code = cli.main(["--run-dir", str(tmp_path / "cli"), "--device", flag, *_sets(**TINY)])
        err = capsys.readouterr().err
        assert code == 2 and f"'{flag}'" in err and "error: device" in err, err
    assert not (tmp_path / "cli").exists()


@pytest.mark.parametrize(
    "key, value",
    [
        ("log_interval", 0),
        ("eval_batches", 0),
        ("log_interval", -1),
        ("eval_interval", -5),
        ("ckpt_interval", -1),
        ("keep_checkpoints", -1),
        ("max_steps", -3),
        ("warmup_steps", -1),
        ("grad_clip", -1.0),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("lr", float("inf")),
        ("beta1", 1.0),
        ("min_lr_ratio", 1.5),
        ("attention_dropout", 1.0),
        ("n_streams", 0),
        ("num_kv_heads", 3),
        ("max_time_s", float("nan")),
        ("spike_threshold", 0.0),
    ],
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
    from mhc.projection import cuda as projection_cuda
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
    T.train(
        T.TrainConfig(**{**TINY, "max_steps": 1}, fused_projection=False, run_dir=str(tmp_path / "again"))
    )
    assert calls == [False, False] and real_set_enabled(True) is False
    calls.clear()
    T.train(T.TrainConfig(**{**TINY, "max_steps": 1}, run_dir=str(tmp_path / "fused")))
    assert calls == []  # fused_projection=true (the default) leaves the switch alone


# ----------------------------------------------------------------------------- the H_res variants (issue 24)


@pytest.mark.parametrize("variant, projection", [("mhc-sk20", "sinkhorn"), ("mhc-lite", "lite")])
def test_each_variant_builds_and_trains(tmp_path, variant, projection):
    """mhc-sk20 and mhc-lite are MHCConfig settings of the trainer's model: it builds, steps and saves them."""
    import json

    from mhc import MHCBlock, MHCForCausalLM
    from mhc.train.model import build_model

    cfg = T.load_config(None, {**TINY, "variant": variant, "run_dir": str(tmp_path / variant)})
    blocks = [m for m in build_model(cfg, 256).modules() if isinstance(m, MHCBlock)]
    assert blocks and all(b.mode == "mhc" and b.projection == projection for b in blocks)
    if variant == "mhc-sk20":
        assert all(b.sinkhorn_iters == 20 and b.sinkhorn_eps == 1e-6 for b in blocks)
    else:
        assert all(b.b_res.shape == (24,) for b in blocks)  # 4! permutation logits
    summary = T.train(cfg)
    assert summary["variant"] == variant and summary["steps"] == 2
    assert summary["skipped_steps"] == 0 and summary["final_val_loss"] < 10
    saved = json.loads((tmp_path / variant / "model" / "config.json").read_text())
    assert (saved["mode"], saved["projection"]) == ("mhc", projection)
    loaded = MHCForCausalLM.from_pretrained(tmp_path / variant / "model")
    assert {m.projection for m in loaded.modules() if isinstance(m, MHCBlock)} == {projection}


def test_variant_settings_cannot_be_contradicted_or_misspelt(tmp_path, cli, capsys):
    with pytest.raises(ValueError, match="variant must be one of .*got 'mhc-sk2'"):
        T.load_config(None, {**TINY, "variant": "mhc-sk2"})
    with pytest.raises(ValueError, match="mhc_options.projection='newton' contradicts variant 'mhc-lite'"):
        T.load_config(None, {**TINY, "variant": "mhc-lite", "mhc_options": {"projection": "newton"}})
    with pytest.raises(ValueError, match="mhc_options.sinkhorn_iters=5 contradicts variant 'mhc-sk20'"):
        T.load_config(None, {**TINY, "variant": "mhc-sk20", "mhc_options": {"sinkhorn_iters": 5}})
    with pytest.raises(ValueError, match="n_streams must be between 1 and 5; got n_streams=6"):
        T.load_config(None, {**TINY, "variant": "mhc-lite", "n_streams": 6})
    with pytest.raises(ValueError, match="n_streams must be between 1 and 5"):  # the same through mhc_options
        T.load_config(None, {**TINY, "n_streams": 8, "mhc_options": {"projection": "lite"}})
    # Repeating what the variant sets is fine; mhc with a projection of its choice too.
    cfg = T.load_config(None, {**TINY, "variant": "mhc-sk20", "mhc_options": {"projection": "sinkhorn"}})
    assert mhc_config_options(cfg)["sinkhorn_iters"] == 20
    assert (
        mhc_config_options(T.load_config(None, {**TINY, "mhc_options": {"projection": "lite"}}))["projection"]
        == "lite"
    )
    code = cli.main(["--run-dir", str(tmp_path / "cli"), "--set", "variant=mhc-lit", *_sets(**TINY)])
    err = capsys.readouterr().err
    assert code == 2 and "variant must be one of" in err, err
    assert not (tmp_path / "cli").exists()


def test_variant_presets_load():

    for preset in ("tiny_cpu", "small_gpu"):
        for variant in ("mhc-sk20", "mhc-lite"):
            cfg = T.load_config(f"{preset}_{variant}")
            base = T.load_config(f"{preset}_mhc")
            assert cfg.variant == variant and cfg.num_layers == base.num_layers and cfg.lr == base.lr
    study = T.load_config("study_exactness")
    assert study.num_layers >= 24 and study.tokenizer == "byte"


def test_compare_script_refuses_an_unknown_variant(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "compare.py"
    spec = importlib.util.spec_from_file_location("compare_script", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    with pytest.raises(SystemExit) as stop:
        compare.main(["--variants", "residual,mhc-sk2"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "unknown variant(s) 'mhc-sk2'" in err and "mhc-lite" in err, err


@pytest.mark.slow  # training subprocesses
def test_study_runner_smoke(tmp_path):
    """scripts/study_exactness.py end to end on the CPU: a run, its record, the README table and plots."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "study_exactness.py"
    spec = importlib.util.spec_from_file_location("study_script", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    out, runs = tmp_path / "out", tmp_path / "runs"
    code = study.main(["--smoke", "--variants", "mhc-sk20", "--seeds", "3", "--tokens", "512", "--out", str(out),
                       "--runs", str(runs), "--set", f"cache_dir={tmp_path / 'cache'}", "--title", "A smoke study"])  # fmt: skip
    assert code == 0, (runs / "mhc-sk20" / "seed3.log").read_text()
    (record,) = json.loads((out / "results.json").read_text())
    assert set(study.RECORD_KEYS) <= set(record)
    assert (record["variant"], record["seed"], record["tokens"]) == ("mhc-sk20", 3, 512)
    # eps = 1e-6 in every sum: 2n marginals each about 1e-6 off at least, far below order one at this scale
    assert 1e-6 < record["hres_marginal_err_max"] < 1e-2
    # the first evaluation is the initial model's; the logit spread is logged at each one
    assert record["hres_marginal_err_start_step"] == 0 and 0 < record["hres_marginal_err_start"] < 1e-2
    assert record["hres_logit_scale_start"] > 0 and record["hres_logit_scale_max"] > 0
    assert record["hres_logit_scale_max"] != record["hres_logit_scale_start"]  # training moved the logits
    assert record["fwd_gain"] is not None and record["loss_spikes"] >= 0
    # The trained model evaluated with each projection: its own (Sinkhorn) reproduces the run's final loss.
    by_projection = record["val_loss_by_projection"]
    assert by_projection["sinkhorn"] == pytest.approx(record["final_val_loss"], rel=1e-5)
    assert math.isfinite(by_projection["newton"])
    readme = (out / "README.md").read_text()
    assert "| mhc-sk20 | 1 |" in readme and "sk20_marginal_error.png" in readme and "| trained as |" in readme
    assert readme.startswith("# A smoke study\n") and "(step 0) and the last" in readme
    assert "logit_scale.png" in readme and "(bpe tokens)" not in readme and "(byte tokens)" in readme
    assert all(
        (out / name).is_file()
        for name in ("loss_curves.png", "gain_vs_depth.png", "sk20_marginal_error.png", "logit_scale.png")
    )
    assert (out / "runs" / "mhc-sk20" / "seed3" / "metrics.jsonl").is_file()
    merged = tmp_path / "merged"
    assert study.main(["--report-only", "--merge", str(out), str(out), "--out", str(merged)]) == 0
    assert json.loads((merged / "results.json").read_text()) == [record]  # one run, however often merged
    assert (
        (merged / "README.md").read_text().startswith("# A smoke study\n")
    )  # the title travels with the runs
    with pytest.raises(SystemExit):
        study.main(["--variants", "mhc-sk2", "--out", str(out)])
    calib = tmp_path / "calib"
    assert study.main(["--smoke", "--calibrate-only", "--calib-steps", "5", "--variants", "residual,mhc-sk20", "--seeds",
                       "0", "--out", str(calib), "--runs", str(tmp_path / "calib_runs"),
                       "--set", f"cache_dir={tmp_path / 'cache'}"]) == 0  # fmt: skip
    rates = json.loads((calib / "calibration.json").read_text())["tokens_per_s"]
    assert set(rates) == {"residual/seed0", "mhc-sk20/seed0"} and all(r > 0 for r in rates.values())
    assert not (calib / "results.json").exists()  # no study was run
    with pytest.raises(SystemExit):  # too few steps to time any: refused before anything runs
        study.main(["--smoke", "--calibrate-only", "--calib-steps", "3", "--out", str(calib)])


def test_presets_load_by_name_and_ship_inside_the_package(tmp_path, monkeypatch):
    """A preset's name works wherever a YAML file does; the YAML files live in mhc/train/presets/ (package data)."""
    import mhc.train.config as config_module

    presets = T.list_presets()
    assert {"tiny_cpu_mhc", "tiny_cpu_hc", "tiny_cpu_residual", "small_gpu_mhc", "study_exactness"} <= set(
        presets
    )
    assert T.preset_path("tiny_cpu_mhc").parent == config_module.PRESETS_DIR
    assert (
        config_module.PRESETS_DIR.parent == Path(config_module.__file__).resolve().parent
    )  # inside the package
    by_name = T.load_config("tiny_cpu_hc")
    assert by_name == T.load_config(T.preset_path("tiny_cpu_hc")) == T.load_config("tiny_cpu_hc.yaml")
    assert (by_name.variant, by_name.run_dir) == ("hc", str(Path("runs") / "tiny_cpu_hc"))
    # a file of one's own builds on a preset by name; a file in the working directory wins over a preset
    (tmp_path / "mine.yaml").write_text("base: tiny_cpu_mhc\nnum_layers: 2\n")
    mine = T.load_config(tmp_path / "mine.yaml")
    assert (mine.num_layers, mine.hidden_size, mine.run_dir) == (
        2,
        by_name.hidden_size,
        str(Path("runs") / "mine"),
    )
    (tmp_path / "tiny_cpu_hc").write_text("variant: residual\nn_streams: 1\nmax_steps: 1\n")
    monkeypatch.chdir(tmp_path)
    assert T.load_config("tiny_cpu_hc").variant == "residual"


def test_an_unknown_preset_or_missing_file_lists_the_presets(tmp_path, cli, capsys):
    with pytest.raises(
        T.ConfigNotFoundError, match=r"unknown preset 'tiny_cpu_mhx' \(did you mean 'tiny_cpu_mhc'"
    ) as e:
        T.load_config("tiny_cpu_mhx")
    assert all(name in str(e.value) for name in T.list_presets())
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)
    # the checkout's old configs/ paths say where the presets went
    with pytest.raises(
        FileNotFoundError, match=r"configs/tiny_cpu_mhc\.yaml does not exist; .*--config tiny_cpu_mhc"
    ):
        T.load_config("configs/tiny_cpu_mhc.yaml")
    with pytest.raises(FileNotFoundError, match=r"nowhere/x\.yaml does not exist .*tiny_cpu_mhc"):
        T.load_config(str(tmp_path / "nowhere" / "x.yaml"))
    (tmp_path / "bad_base.yaml").write_text("base: no_such_preset\n")
    with pytest.raises(
        T.ConfigNotFoundError, match=r"base 'no_such_preset' is neither a file beside it nor a preset"
    ):
        T.load_config(tmp_path / "bad_base.yaml")
    # the command line: one line, exit 2, nothing created; --list-presets prints them
    code = cli.main(["--config", "tiny_cpu_mhx", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: unknown preset 'tiny_cpu_mhx'") and "small_gpu_mhc" in err, (
        err
    )
    assert not (tmp_path / "run").exists()
    assert cli.main(["--list-presets"]) == 0
    assert capsys.readouterr().out.split() == T.list_presets()


def test_compare_trains_each_variant_in_its_own_process_with_this_mhc(tmp_path):
    """mhc-compare starts `python -m mhc.train` per variant (importing the same mhc), then writes the table."""
    import json

    from mhc.train import cli as train_cli

    out = tmp_path / "cmp"
    sets = {**TINY, "max_steps": 2, "cache_dir": tmp_path / "c", "data": "synthetic", "max_corpus_mb": 0.2}
    code = train_cli.compare_main(["--variants", "residual,mhc", "--out", str(out),
                                   *sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])])  # fmt: skip
    assert code == 0, [(p.name, p.read_text()[-2000:]) for p in out.glob("*.log")]
    rows = json.loads((out / "compare.json").read_text())
    assert [r["label"] for r in rows] == ["residual", "mhc"] and all(r["steps"] == 2 for r in rows)
    assert len({r["corpus"]["sha256"] for r in rows}) == 1  # the same text for both
    assert "-m mhc.train --config tiny_cpu_mhc" in (out / "mhc.log").read_text().splitlines()[0]
    assert "Corpus: synthetic:v1 (" in (out / "compare.md").read_text() and (out / "compare.png").is_file()


def test_a_token_budget_replaces_a_presets_step_count(tmp_path):
    """--tokens on a preset that sets max_steps (tiny_cpu_mhc: 300) used to be ignored without a word."""
    assert T.load_config("tiny_cpu_mhc").max_steps == 300
    cfg = T.load_config("tiny_cpu_mhc", ["tokens=4096"])
    assert (cfg.tokens, cfg.max_steps) == (4096, 0)
    cfg = T.load_config("tiny_cpu_mhc", ["tokens=4096", "max_steps=7"])  # both given: max_steps decides
    assert (cfg.tokens, cfg.max_steps) == (4096, 7)
    cfg = T.load_config("small_gpu_mhc", ["max_steps=5"])  # a step count leaves the token budget alone
    assert cfg.max_steps == 5 and cfg.tokens == 100_000_000


@pytest.mark.parametrize("key, value, kind", [("max_steps", "abc", "an integer"), ("max_steps", "2.5", "an integer"),
                                              ("lr", "abc", "a number"), ("batch_size", "[1]", "an integer")])  # fmt: skip
def test_a_value_of_the_wrong_type_names_its_key(key, value, kind):
    with pytest.raises(ValueError, match=f"{key} needs {kind}, got '"):
        T.load_config(None, [f"{key}={value}"])


def test_a_negative_step_count_is_called_negative():
    with pytest.raises(ValueError, match="max_steps must be >= 0 .*got -3"):
        T.load_config(None, {"max_steps": -3, "tokens": 1000})
    with pytest.raises(ValueError, match="set max_steps or tokens"):
        T.load_config(None, {"max_steps": 0, "tokens": 0})


def test_data_and_tokenizer_settings_that_give_no_data_exit_2(tmp_path, cli, capsys):
    """Refused data settings: one line on stderr and exit status 2, as other refused settings (no traceback)."""
    tiny = {**TINY, "cache_dir": tmp_path / "cache"}
    cases = [
        ({"data": str(tmp_path / "nowhere")}, "does not exist"),
        ({"tokenizer": "gpt2"}, "tokenizer=gpt2 needs tokenizer_path"),
        ({"tokenizer": "gpt2", "tokenizer_path": str(tmp_path)}, "needs vocab.json"),
        ({"mhc_options": "{stream_dtype: bogus}"}, "stream_dtype must be one of"),
    ]
    tiny_file = tmp_path / "tiny.txt"
    tiny_file.write_text("x")
    cases.append(({"data": str(tiny_file)}, "too small to split"))
    for i, (sets, message) in enumerate(cases):
        code = cli.main(["--run-dir", str(tmp_path / f"r{i}"), *_sets(**{**tiny, **sets})])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and message in err and "Traceback" not in err, (
            sets,
            err,
        )
    with pytest.raises(T.DataNotFoundError):  # a FileNotFoundError and a ValueError too, as before
        T.load_corpus(str(tmp_path / "nowhere"))
    assert issubclass(T.DataNotFoundError, FileNotFoundError) and issubclass(T.DataError, ValueError)


def test_resume_of_a_run_dir_that_does_not_exist_says_it_starts_a_new_run(tmp_path, cli, capsys):
    code = cli.main(["--resume", "--run-dir", str(tmp_path / "typo"), *_sets(**{**TINY, "max_steps": 1})])
    out = capsys.readouterr().out
    assert code == 0 and "there is no run at" in out and "starting a NEW run" in out, out


def test_compare_checks_its_numbers_and_keeps_earlier_runs(tmp_path, capsys):
    from mhc.train import cli as train_cli

    for flag, value in (
        ("--tokens", "-5"),
        ("--target-s", "-1"),
        ("--max-time-s", "nan"),
        ("--calib-steps", "0"),
    ):
        with pytest.raises(SystemExit) as stop:
            train_cli.compare_main([flag, value, "--out", str(tmp_path / "c")])
        assert stop.value.code == 2 and f"{flag} must be >=" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        train_cli.compare_main(["--report-only", "--out", str(tmp_path / "none")])
    assert stop.value.code == 2 and "holds no finished run" in capsys.readouterr().err
    earlier = tmp_path / "c" / "mhc"
    earlier.mkdir(parents=True)
    (earlier / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        train_cli.compare_main(["--variants", "mhc", "--out", str(tmp_path / "c")])
    assert stop.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert (earlier / "summary.json").read_text() == "{}"
