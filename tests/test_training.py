"""Tests of mhc.train and the training scripts (CPU, a few seconds each)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mhc import train as T
from mhc.train import RunDirLock, list_checkpoints

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


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env["OMP_NUM_THREADS"] = "1"
    return env


def _losses(run_dir) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in T.read_metrics(Path(run_dir) / "metrics.jsonl") if r["kind"] == "train"
    }


# ----------------------------------------------------------------------------- config


def test_config_yaml_inheritance_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "hidden_size: 64\nlr: 1.0e-3\nmhc_options: {init: identity}\nmax_steps: 5\n"
    )
    (tmp_path / "child.yaml").write_text(
        "base: base.yaml\nvariant: hc\nmhc_options: {projection: sinkhorn}\n"
    )
    cfg = T.load_config(tmp_path / "child.yaml", ["lr=2e-4", "num_layers=3", "plots=false"])
    assert (cfg.variant, cfg.hidden_size, cfg.num_layers, cfg.lr, cfg.plots) == ("hc", 64, 3, 2e-4, False)
    assert cfg.mhc_options == {"init": "identity", "projection": "sinkhorn"}
    assert cfg.run_dir == str(Path("runs") / "child")
    with pytest.raises(KeyError):
        T.load_config(tmp_path / "child.yaml", ["no_such_key=1"])
    for name in (
        "tiny_cpu_mhc",
        "tiny_cpu_hc",
        "tiny_cpu_residual",
        "small_gpu_mhc",
        "small_gpu_hc",
        "small_gpu_residual",
    ):
        cfg = T.load_config(name)
        assert cfg.variant == name.rsplit("_", 1)[1]


def test_lr_schedule():
    f = [T.lr_lambda(s, 10, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


# ----------------------------------------------------------------------------- data


def _write_docs(root: Path, n: int = 12) -> None:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "mhc", "stream", "def", "return", "x", "\n"]
    for i in range(n):
        sub = root / ("sub" if i % 3 == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, size=3000)))
    (root / "binary.bin").write_bytes(b"\0\1\2")


def test_split_is_deterministic_and_disjoint(tmp_path):
    _write_docs(tmp_path / "data")
    c1 = T.load_corpus(str(tmp_path / "data"))
    assert all(not name.endswith(".bin") for name, _ in c1.documents)
    s1 = T.split_corpus(c1, 0.2, chunk_chars=1000)
    c2 = T.Corpus(list(reversed(c1.documents)), c1.source)  # order must not matter
    s2 = T.split_corpus(T.Corpus(sorted(c2.documents), c2.source), 0.2, chunk_chars=1000)
    assert s1 == s2
    train = {c for r in s1["train"] for c in r}
    val = {c for r in s1["val"] for c in r}
    assert train and val and not (train & val)
    n_chunks = sum(len(r) for r in s1["train"] + s1["val"])
    assert 0.05 < sum(len(r) for r in s1["val"]) / n_chunks < 0.45
    # every character lands in exactly one split
    assert sum(len(c) for r in s1["train"] + s1["val"] for c in r) == c1.num_chars


def test_stdlib_corpus_and_packing(tmp_path):
    cfg = tiny_cfg(tmp_path, max_corpus_mb=0.2)
    data, tok, corpus = T.prepare_data(cfg, log=lambda *_: None)
    assert corpus.source.startswith("stdlib:") and corpus.documents
    assert [n for n, _ in corpus.documents] == sorted(n for n, _ in corpus.documents)
    data2, _, _ = T.prepare_data(cfg, log=lambda *_: None)
    assert np.array_equal(data.train, data2.train) and np.array_equal(data.val, data2.val)
    assert (data.train == tok.eos_id).sum() >= 1
    b1, b2 = data.train_batch(0, 6), data.train_batch(3, 3)
    assert b1.shape == (6, cfg.seq_len) and torch.equal(b1[3:], b2)
    # an epoch visits every window once
    n = data.n_train_windows
    seen = data.train_batch(0, n)
    assert len({tuple(r.tolist()) for r in seen}) == len(
        {tuple(data.train[i * 32 : (i + 1) * 32].tolist()) for i in range(n)}
    )
    h = T.unigram_entropy(np.concatenate([data.train, data.val]), tok.vocab_size)
    assert 2.0 < h < np.log(257)


# ----------------------------------------------------------------------------- tokenizers

TEXT = "def f(x):\n    return x ** 2  # ünïcödé ✓ 🚀\n\tprint('hi')\n"


def test_byte_tokenizer_roundtrip():
    tok = T.ByteTokenizer()
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eos_id]) == TEXT


def test_bpe_and_gpt2_files_roundtrip(tmp_path):
    _write_docs(tmp_path / "data", n=4)
    cfg = tiny_cfg(tmp_path, data=str(tmp_path / "data"), tokenizer="bpe", bpe_vocab_size=400)
    data, tok, _ = T.prepare_data(cfg, log=lambda *_: None)
    assert tok.kind == "bpe" and tok.vocab_size <= 400
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert len(list(Path(cfg.cache_dir).glob("bpe-*.json"))) == 1  # cached
    tok2 = T.build_tokenizer(
        cfg, None, T.load_corpus(cfg.data).fingerprint()
    )  # from the cache, no texts needed
    assert tok2.encode(TEXT) == tok.encode(TEXT)
    # GPT-2 style files: vocab.json + merges.txt, and encoder.json + vocab.bpe
    d = tmp_path / "gpt2"
    d.mkdir()
    tok.tok.model.save(str(d))
    g = T.load_gpt2_tokenizer(d)
    assert g.decode(g.encode(TEXT)) == TEXT and g.encode(TEXT) == tok.encode(TEXT)
    d2 = tmp_path / "gpt2b"
    d2.mkdir()
    shutil.copy(d / "vocab.json", d2 / "encoder.json")
    shutil.copy(d / "merges.txt", d2 / "vocab.bpe")
    assert T.load_gpt2_tokenizer(d2).encode(TEXT) == tok.encode(TEXT)
    # saved with a run and loaded back
    tok.save(tmp_path)
    assert T.load_tokenizer(tmp_path).encode(TEXT) == tok.encode(TEXT)


# ----------------------------------------------------------------------------- training, resume, checkpoints


# Attention dropout makes the run draw random numbers at every step, so a resume that did not
# restore the RNG state would train on other dropout masks and its losses would differ.
RNG = {"attention_dropout": 0.1}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    cfg = tiny_cfg(tmp, "full", **RNG)
    summary = T.train(cfg)
    return cfg, summary


def _config_yaml_without_run_dir(run_dir) -> dict:
    import yaml

    d = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    d.pop("run_dir")
    return d


def _evals(run_dir) -> list[tuple[int, float]]:
    return [
        (r["step"], r["val_loss"])
        for r in T.read_metrics(Path(run_dir) / "metrics.jsonl")
        if r["kind"] == "eval"
    ]


def _assert_same_run(run_dir, ref_run_dir) -> None:
    """Same losses at every step, same evaluations, same final loss and config.yaml as the reference run."""
    full, resumed = _losses(ref_run_dir), _losses(run_dir)
    assert sorted(resumed) == sorted(full), (sorted(resumed), sorted(full))
    for step in full:
        assert resumed[step] == full[step], (step, resumed[step], full[step])
    assert _evals(run_dir) == _evals(ref_run_dir)
    s_ref = json.loads((Path(ref_run_dir) / "summary.json").read_text())
    s_new = json.loads((Path(run_dir) / "summary.json").read_text())
    assert s_new["final_val_loss"] == s_ref["final_val_loss"] and s_new["steps"] == s_ref["steps"]
    assert _config_yaml_without_run_dir(run_dir) == _config_yaml_without_run_dir(ref_run_dir)


def test_run_dir_contents_and_from_pretrained(full_run):
    cfg, summary = full_run
    rd = Path(cfg.run_dir)
    for name in (
        "metrics.jsonl",
        "summary.json",
        "loss.png",
        "gains.png",
        "config.yaml",
        "model/config.json",
        "model/model.safetensors",
    ):
        assert (rd / name).is_file(), name
    assert (rd / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["steps"] == 8 and summary["composite_gains"] is not None
    assert len(summary["composite_gains"]["forward_gain"]) == 2 * cfg.num_layers
    assert summary["fwd_gain_full_depth"] == pytest.approx(1.0, abs=1e-3)  # mHC: doubly stochastic
    from transformers import AutoModelForCausalLM

    import mhc  # noqa: F401  (registers the mHC model with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(rd / "model")
    ids = torch.randint(0, 257, (1, 16))
    ref = T.build_model(cfg, 257, 256).eval()  # eval: no dropout
    from safetensors.torch import load_file

    ref.load_state_dict(load_file(str(rd / "model" / "model.safetensors")), strict=False)
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_saved_model_generates_with_a_transformers_pipeline(full_run):
    """`pipeline("text-generation", model=<run>/model)`: the model and its tokenizer load with the Auto classes."""
    from transformers import pipeline

    import mhc  # noqa: F401  (registers the mHC model with the Auto classes)

    cfg, _ = full_run
    generate = pipeline("text-generation", model=str(Path(cfg.run_dir) / "model"), device="cpu")
    out = generate("def main(", max_new_tokens=6, do_sample=False)
    text = out[0]["generated_text"]
    assert text.startswith("def main(") and len(text) > len("def main("), out
    assert generate.tokenizer("def")["input_ids"] == T.ByteTokenizer().encode("def")


def test_resume_reproduces_uninterrupted_losses(tmp_path, full_run):
    cfg_full, summary_full = full_run
    cfg = tiny_cfg(tmp_path, "resumed", stop_at_step=5, cache_dir=cfg_full.cache_dir, **RNG)
    out = T.train(cfg)
    assert out == {"interrupted": True, "step": 5}
    assert T.find_latest_checkpoint(cfg.run_dir).name == "step_00000003"  # steps 4-5 are lost, as in a crash
    cfg.stop_at_step = 0
    summary = T.train(cfg, resume=True)
    _assert_same_run(cfg.run_dir, cfg_full.run_dir)
    assert summary["final_val_loss"] == summary_full["final_val_loss"]
    # a finished run resumes to the end at once
    again = T.train(cfg, resume=True)
    assert again["steps"] == 8 and again["final_val_loss"] == summary["final_val_loss"]
    assert _evals(cfg.run_dir) == _evals(cfg_full.run_dir)  # no duplicated records


@pytest.mark.slow  # a training subprocess
def test_bare_resume_cli_continues_the_run_exactly(tmp_path, full_run):
    """README's `python scripts/train_lm.py --resume`, with no other flag: the run's own settings come back."""
    cfg_full, _ = full_run
    # The run lives where the default config puts it (runs/tiny_cpu_mhc under the working directory),
    # but trains with settings that differ from that YAML in almost every key.
    rd = tmp_path / "runs" / "tiny_cpu_mhc"
    cfg = dataclasses.replace(cfg_full, run_dir=str(rd), stop_at_step=5)
    assert T.train(cfg) == {"interrupted": True, "step": 5}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_lm.py"), "--resume"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_00000003" in proc.stdout
    _assert_same_run(rd, cfg_full.run_dir)


def test_resume_refuses_changed_settings(tmp_path):
    cfg = tiny_cfg(tmp_path, "changed", stop_at_step=3, max_steps=4)
    T.train(cfg)
    cfg2 = tiny_cfg(tmp_path, "changed", max_steps=4, hidden_size=64, num_heads=2)
    with pytest.raises(T.CheckpointError, match="hidden_size"):
        T.train(cfg2, resume=True)
    with pytest.raises(T.CheckpointError, match="not even with --resume-override"):
        T.train(cfg2, resume=True, resume_override=True)
    with pytest.raises(T.CheckpointError, match=r"lr: run 0\.003, now 0\.001"):
        T.train(tiny_cfg(tmp_path, "changed", max_steps=4, lr=1e-3), resume=True)
    with pytest.raises(FileExistsError, match="--resume"):
        T.train(tiny_cfg(tmp_path, "changed", max_steps=4))


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupt_or_partial_checkpoint_gives_clear_error(tmp_path, full_run):
    cfg_full, _ = full_run
    # corrupt weights: flip bytes in the middle of model.safetensors
    rd = _copy_run(Path(cfg_full.run_dir), tmp_path / "corrupt")
    ck = T.find_latest_checkpoint(rd)
    f = ck / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 8] = b"\xff" * 8
    f.write_bytes(bytes(raw))
    with pytest.raises(T.CheckpointError, match=r"corrupt: model\.safetensors does not match its SHA-256"):
        T.train(tiny_cfg(tmp_path, "corrupt"), resume=True)
    # truncated trainer state
    rd = _copy_run(Path(cfg_full.run_dir), tmp_path / "trunc")
    ts = T.find_latest_checkpoint(rd) / "trainer_state.json"
    ts.write_bytes(ts.read_bytes()[:100])
    with pytest.raises(T.CheckpointError, match="trainer_state.json has 100 bytes"):
        T.verify_checkpoint(T.find_latest_checkpoint(rd))
    # a partial write (no manifest)
    rd = _copy_run(Path(cfg_full.run_dir), tmp_path / "partial")
    (T.find_latest_checkpoint(rd) / "manifest.json").unlink()
    with pytest.raises(T.CheckpointError, match="partial: it has no manifest.json"):
        T.train(tiny_cfg(tmp_path, "partial"), resume=True)
    # `latest` names a folder that is gone
    rd = _copy_run(Path(cfg_full.run_dir), tmp_path / "gone")
    shutil.rmtree(T.find_latest_checkpoint(rd))
    with pytest.raises(T.CheckpointError, match="does not exist"):
        T.find_latest_checkpoint(rd)
    # the script turns it into a one-line error and exit code 2
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "train_lm.py"),
            "--config",
            "tiny_cpu_mhc",
            "--run-dir",
            str(tmp_path / "corrupt"),
            "--resume",
            *sum((["--set", f"{k}={v}"] for k, v in TINY.items()), []),
            "--set",
            f"cache_dir={tmp_path / 'cache'}",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 2 and "error: checkpoint" in proc.stderr and "corrupt" in proc.stderr, (
        proc.stderr[-2000:]
    )


def test_atomic_checkpoint_leaves_no_partial_folder(tmp_path, full_run):
    cfg_full, _ = full_run
    root = Path(cfg_full.run_dir) / "checkpoints"
    assert not list(root.glob(".tmp-*"))
    assert sorted(p.name for p in root.glob("step_*")) == [
        "step_00000006",
        "step_00000008",
    ]  # keep_checkpoints=2
    for p in root.glob("step_*"):
        T.verify_checkpoint(p)


# ----------------------------------------------------------------------------- killed writes, concurrent runs
#
# The CLI runs in processes forked from one forkserver that has imported mhc.train once, so
# each run costs its training time, not a fresh interpreter's imports. The forkserver never runs
# torch ops itself, so its children start without OpenMP threads (fork-safe).


def _cli_child(argv: list[str], env: dict, log_path: str) -> None:
    """Run `scripts/train_lm.py ARGV` (its main()) in this child, with extra environment variables."""
    import importlib.util

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    spec = importlib.util.spec_from_file_location("train_lm_cli", REPO / "scripts" / "train_lm.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    code = cli.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


@pytest.fixture(scope="module")
def cli_procs():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["mhc.train"])
    return ctx


def _start_cli(ctx, argv, log_path: Path, **env):
    proc = ctx.Process(
        target=_cli_child, args=([str(a) for a in argv], {k: str(v) for k, v in env.items()}, str(log_path))
    )
    proc.start()
    return proc


def _run_cli(ctx, argv, log_path: Path, timeout: float = 300, **env) -> int:
    proc = _start_cli(ctx, argv, log_path, **env)
    proc.join(timeout)
    assert proc.exitcode is not None, f"timed out: {log_path.read_text()[-3000:]}"
    return proc.exitcode


@pytest.mark.slow  # training processes
def test_checkpoint_write_killed_at_any_point_resumes_exactly(tmp_path, full_run, cli_procs):
    """SIGKILL inside save_checkpoint (mid-file, before the rename, before `latest`, mid-prune); each time a bare
    --resume goes on, and the run ends with the losses, evaluations and config of the uninterrupted run."""
    cfg_full, _ = full_run
    rd = tmp_path / "killed"
    ck = rd / "checkpoints"
    settings = {**TINY, **RNG, "cache_dir": cfg_full.cache_dir}
    fresh = ["--run-dir", rd, *_sets(**settings)]
    resume = ["--resume", "--run-dir", rd]
    complete = lambda: [p.name for _, p in list_checkpoints(ck)]  # noqa: E731
    # (argv, kill point, what must hold after the kill); checkpoints are written at steps 3, 6 and 8
    plan = [
        (fresh, "3:file:2", lambda: complete() == [] and not (ck / "latest").exists()),
        (resume, "3:rename", lambda: complete() == ["step_00000003"] and not (ck / "latest").exists()),
        (resume, "6:manifest", lambda: complete() == ["step_00000003"]),
        (resume, "6:latest", lambda: complete() == ["step_00000003", "step_00000006"]),
        (
            resume,
            "8:prune",
            lambda: complete() == ["step_00000006", "step_00000008"] and not (rd / "model").exists(),
        ),
    ]
    for i, (argv, point, check) in enumerate(plan):
        log = tmp_path / f"run{i}.log"
        code = _run_cli(cli_procs, argv, log, **{"MHC_CHECKPOINT_KILL_AT": point})
        assert code == -9, (point, code, log.read_text()[-3000:])
        assert check(), (point, sorted(p.name for p in ck.iterdir()))
        latest = T.find_latest_checkpoint(rd)
        if latest is not None:
            T.verify_checkpoint(latest)
    code = _run_cli(cli_procs, resume, tmp_path / "final.log")
    assert code == 0, (tmp_path / "final.log").read_text()[-3000:]
    _assert_same_run(rd, cfg_full.run_dir)
    assert (
        complete() == ["step_00000006", "step_00000008"]
        and T.find_latest_checkpoint(rd).name == "step_00000008"
    )
    leftovers = [
        p.name for p in list(rd.iterdir()) + list(ck.iterdir()) if ".tmp-" in p.name or ".old-" in p.name
    ]
    assert leftovers == []


@pytest.mark.slow  # training processes
def test_two_runs_on_one_run_dir_cannot_both_proceed(tmp_path, cli_procs):
    """While one process trains in a run dir, a second one (fresh or --resume) stops at once with a clear error."""
    import time

    rd = tmp_path / "busy"
    settings = {
        **TINY,
        "max_steps": 100000,
        "eval_interval": 0,
        "ckpt_interval": 0,
        "cache_dir": tmp_path / "cache",
    }
    first = _start_cli(cli_procs, ["--run-dir", rd, *_sets(**settings)], tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 120
        while not _losses(rd):  # wait until the first run is training
            assert first.is_alive() and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        for extra in ([], ["--resume"]):
            t0 = time.monotonic()
            code = _run_cli(cli_procs, ["--run-dir", rd, *extra, *_sets(**settings)], tmp_path / "second.log")
            took = time.monotonic() - t0
            err = (tmp_path / "second.log").read_text()
            assert code == 2 and "is in use: another training process holds" in err, err[-3000:]
            assert took < 30, took  # no waiting for the lock, no data loading
        assert first.is_alive()
        with pytest.raises(T.RunDirLockedError, match="in use"):
            T.train(tiny_cfg(tmp_path, "busy"), overwrite=True)
        assert _losses(rd)  # nothing of the first run was removed
    finally:
        first.kill()
        first.join(30)
    with RunDirLock(rd):  # the operating system released the killed run's lock
        pass


# ----------------------------------------------------------------------------- scripts, DDP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sets(**kw) -> list[str]:
    return sum((["--set", f"{k}={v}"] for k, v in kw.items()), [])


@pytest.mark.slow  # a training subprocess
def test_train_lm_script_smoke(tmp_path):
    rd = tmp_path / "smoke"
    args = _sets(**{**TINY, "max_steps": 4, "ckpt_interval": 2, "cache_dir": tmp_path / "cache"})
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "train_lm.py"),
            "--run-dir",
            str(rd),
            "--progress",
            "true",
            *args,
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unigram entropy" in proc.stdout and "val loss" in proc.stdout
    for name in ("metrics.jsonl", "loss.png", "gains.png", "model/model.safetensors", "checkpoints/latest"):
        assert (rd / name).exists(), name


def _torchrun(tmp_path, nproc: int, run_dir: Path, extra: dict, extra_args=()) -> subprocess.CompletedProcess:
    args = _sets(**{**TINY, "max_steps": 4, "ckpt_interval": 2, "cache_dir": tmp_path / "cache", **extra})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(_free_port()),
        str(REPO / "scripts" / "train_lm.py"),
        "--run-dir",
        str(run_dir),
        *extra_args,
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)


@pytest.mark.slow  # torchrun
def test_ddp_gloo_two_ranks_matches_one_process(tmp_path):
    """2 ranks x batch 2 (DDP, gloo) trains like 1 process x batch 4, and resumes."""
    ddp = tmp_path / "ddp"
    proc = _torchrun(tmp_path, 2, ddp, {"batch_size": 2, "device": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((ddp / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["dist"] == "ddp"
    single = T.train(tiny_cfg(tmp_path, "single", max_steps=4, ckpt_interval=2, batch_size=4))
    l_ddp, l_one = _losses(ddp), _losses(tmp_path / "single")
    assert sorted(l_ddp) == sorted(l_one)
    for s in l_one:
        assert l_ddp[s] == pytest.approx(l_one[s], rel=1e-4, abs=1e-4), (s, l_ddp[s], l_one[s])
    assert summary["final_val_loss"] == pytest.approx(single["final_val_loss"], rel=1e-4)


@pytest.mark.slow  # torchrun
def test_torchrun_every_rank_stops_when_rank_0_cannot_lock_the_run_dir(tmp_path):
    rd = tmp_path / "locked"
    with RunDirLock(rd):  # someone else trains here
        proc = _torchrun(tmp_path, 2, rd, {"batch_size": 2, "device": "cpu"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    # rank 0 reports the lock in one line (no traceback). Rank 1 stops as well (it reports rank 0's error,
    # unless torchrun has already ended it because rank 0 exited), rather than waiting in a collective.
    assert "error: " + f"{rd} is in use: another training process holds" in out, out[-3000:]
    assert "mhc/train/" not in out and "exitcode  : 2" in out, out[-3000:]
    assert not (rd / "metrics.jsonl").exists()


@pytest.mark.slow  # torchrun
def test_fsdp2_gloo_two_ranks_resumes(tmp_path):
    """FSDP2 (fully_shard) on 2 gloo ranks: interrupted at step 2, resumed, same losses as 1 process."""
    rd = tmp_path / "fsdp"
    proc = _torchrun(tmp_path, 2, rd, {"batch_size": 2, "device": "cpu", "dist": "fsdp", "stop_at_step": 2})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    args = ["--resume"]
    cmd_extra = {"batch_size": 2, "device": "cpu", "dist": "fsdp"}
    proc = _torchrun(tmp_path, 2, rd, cmd_extra, extra_args=args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((rd / "summary.json").read_text())
    assert s["dist"] == "fsdp" and s["world_size"] == 2 and s["steps"] == 4
    T.verify_checkpoint(T.find_latest_checkpoint(rd))
    T.train(tiny_cfg(tmp_path, "single", max_steps=4, ckpt_interval=2, batch_size=4))
    l_fsdp, l_one = _losses(rd), _losses(tmp_path / "single")
    assert sorted(l_fsdp) == sorted(l_one) == [1, 2, 3, 4]
    for step in l_one:
        assert l_fsdp[step] == pytest.approx(l_one[step], rel=1e-4, abs=1e-4), (
            step,
            l_fsdp[step],
            l_one[step],
        )


# ----------------------------------------------------------------------------- plots, comparison


def test_write_comparison(tmp_path, full_run):
    cfg_full, _ = full_run
    res = T.write_comparison({"mhc": cfg_full.run_dir, "missing": tmp_path / "nope"}, tmp_path / "cmp")
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| mhc | mhc | 4 |" in md and "no summary" in md
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert res["rows"][0]["final_val_loss"] > 0


def test_eval_records_and_summary_log_stability(full_run):
    """Every eval record has the stability scalars and the per-site H_res marginal error; summary.json the per-site lists."""
    cfg, summary = full_run
    sites = 2 * cfg.num_layers
    evals = [r for r in T.read_metrics(Path(cfg.run_dir) / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8]
    for r in evals:
        assert 0 < r["marginal_error_max"] < 1e-4, r  # exact mHC (Newton)
        assert len(r["marginal_error"]["mean"]) == len(r["marginal_error"]["max"]) == sites, r
        assert max(r["marginal_error"]["max"]) == r["marginal_error_max"], r
        assert all(m <= x for m, x in zip(r["marginal_error"]["mean"], r["marginal_error"]["max"])), r
        assert 0 < r["stream_spread"] <= 1, r  # copies at the start, then they differ
        for key in ("h_res_saturation", "h_res_one_hot_rows", "pre_post_saturation"):
            assert 0 <= r[key] <= 1, (key, r)
    stability = summary["stability"]
    assert (
        stability["spread_mean"][0] == 0.0 and len(stability["spread_mean"]) == sites
    )  # site 0 gets n copies
    assert (
        summary["marginal_error_max"]
        == max(stability["marginal_error_max"])
        == evals[-1]["marginal_error_max"]
    )
    assert summary["stream_spread"] == stability["spread_mean"][-1] == evals[-1]["stream_spread"]
    final = next(r for r in T.read_metrics(Path(cfg.run_dir) / "metrics.jsonl") if r["kind"] == "final")
    assert "stability" not in final and final["h_res_saturation"] == summary["h_res_saturation"]
    md = T.write_comparison({"mhc": cfg.run_dir}, Path(cfg.run_dir).parent / "cmp_stability")["markdown"]
    head, _, row = md.splitlines()[:3]
    cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in row.split("|")]))
    assert cells["max H_res marginal error"] == format(summary["marginal_error_max"], ".2g"), cells
    assert cells["stream spread @ last site"] == format(summary["stream_spread"], ".3g"), cells
    assert cells["max H_res / H_pre,post saturation"] == (
        f"{summary['h_res_saturation']:.3g} / {summary['pre_post_saturation']:.3g}"
    ), cells


def test_measure_stability_per_site_marginal_error_of_a_sinkhorn_model():
    """The per-site marginal error (mean and max over the tokens) that eval records log: against mhc.marginal_error
    of every token's H_res, on a 2-step Sinkhorn model, where tokens differ."""
    from transformers import LlamaConfig

    from mhc import MHCConfig, MHCForCausalLM, marginal_error
    from mhc.diagnostics import collect_h_res
    from mhc.train.reporting import STABILITY_SCALARS, eval_record, measure_stability

    torch.manual_seed(0)
    base = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    model = MHCForCausalLM(
        MHCConfig(base_config=base, n_streams=4, init="paper", projection="sinkhorn", sinkhorn_iters=2)
    )
    ids = torch.randint(0, 64, (2, 16))
    gains, stability = measure_stability(model, ids)
    errors = [marginal_error(h) for h in collect_h_res(model, input_ids=ids, use_cache=False)]
    assert stability["marginal_error_mean"] == pytest.approx([e.mean().item() for e in errors], rel=1e-12)
    assert stability["marginal_error_max"] == pytest.approx([e.max().item() for e in errors], rel=1e-12)
    assert all(e.max() > e.mean() for e in errors)  # the tokens differ: mean and max are two numbers
    record = eval_record(7, 100, 2.5, gains, 1.0, stability)
    assert record["marginal_error"] == {
        "mean": stability["marginal_error_mean"],
        "max": stability["marginal_error_max"],
    }
    assert record["marginal_error_max"] == max(stability["marginal_error_max"]) > 1e-3
    assert set(STABILITY_SCALARS) <= set(record) and record["fwd_gain"] == gains["forward_gain"][-1]
    none = eval_record(7, 100, 2.5, None, 1.0, None)
    assert none["marginal_error"] is None and all(none[k] is None for k in STABILITY_SCALARS)


@pytest.mark.slow  # training subprocesses
def test_compare_script_smoke(tmp_path):
    """scripts/compare.py: three variants, same token budget, one table and one plot."""
    sets = _sets(
        **{**TINY, "max_steps": 2, "eval_interval": 0, "ckpt_interval": 0, "cache_dir": tmp_path / "cache"}
    )
    out = tmp_path / "cmp"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "compare.py"),
            "--out",
            str(out),
            "--tokens",
            str(3 * 4 * 32),
            *sets,
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "compare.json").read_text())
    assert [r["variant"] for r in rows] == ["residual", "hc", "mhc"]
    assert {r["tokens"] for r in rows} == {3 * 4 * 32} and {r["steps"] for r in rows} == {3}
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "compare.md").read_text()
    assert md.count("\n| ") >= 3 and "fwd gain @ full depth" in md
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "compare.py"), "--out", str(out), "--report-only"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert proc.returncode == 0 and "| mhc | mhc | 4 |" in proc.stdout
