"""The training command line in processes: killed checkpoint writes, two runs on one run dir, the scripts,
torchrun (DDP and FSDP2 on gloo ranks) and the comparison script. All in the slow tier."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from training_support import (
    REPO,
    RNG,
    TINY,
    assert_same_run,
    subprocess_env,
    tiny_cfg,
    train_losses,
)

from mhc import train as T
from mhc.train import RunDirLock, list_checkpoints

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
    fresh = ["--run-dir", rd, *set_args(**settings)]
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
    assert_same_run(rd, cfg_full.run_dir)
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
    first = _start_cli(cli_procs, ["--run-dir", rd, *set_args(**settings)], tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 120
        while not train_losses(rd):  # wait until the first run is training
            assert first.is_alive() and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        for extra in ([], ["--resume"]):
            t0 = time.monotonic()
            code = _run_cli(
                cli_procs, ["--run-dir", rd, *extra, *set_args(**settings)], tmp_path / "second.log"
            )
            took = time.monotonic() - t0
            err = (tmp_path / "second.log").read_text()
            assert code == 2 and "is in use: another training process holds" in err, err[-3000:]
            assert took < 30, took  # no waiting for the lock, no data loading
        assert first.is_alive()
        with pytest.raises(T.RunDirLockedError, match="in use"):
            T.train(tiny_cfg(tmp_path, "busy"), overwrite=True)
        assert train_losses(rd)  # nothing of the first run was removed
    finally:
        first.kill()
        first.join(30)
    with RunDirLock(rd):  # the operating system released the killed run's lock
        pass


# ----------------------------------------------------------------------------- scripts, DDP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_args(**kw) -> list[str]:
    return sum((["--set", f"{k}={v}"] for k, v in kw.items()), [])


@pytest.mark.slow  # a training subprocess
def test_train_lm_script_smoke(tmp_path):
    rd = tmp_path / "smoke"
    args = set_args(**{**TINY, "max_steps": 4, "ckpt_interval": 2, "cache_dir": tmp_path / "cache"})
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
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unigram entropy" in proc.stdout and "val loss" in proc.stdout
    for name in ("metrics.jsonl", "loss.png", "gains.png", "model/model.safetensors", "checkpoints/latest"):
        assert (rd / name).exists(), name


def torchrun(tmp_path, nproc: int, run_dir: Path, extra: dict, extra_args=()) -> subprocess.CompletedProcess:
    args = set_args(**{**TINY, "max_steps": 4, "ckpt_interval": 2, "cache_dir": tmp_path / "cache", **extra})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(REPO / "scripts" / "train_lm.py"),
        "--run-dir",
        str(run_dir),
        *extra_args,
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=300)


@pytest.mark.slow  # torchrun
def test_ddp_gloo_two_ranks_matches_one_process(tmp_path):
    """2 ranks x batch 2 (DDP, gloo) trains like 1 process x batch 4, and resumes."""
    ddp = tmp_path / "ddp"
    proc = torchrun(tmp_path, 2, ddp, {"batch_size": 2, "device": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((ddp / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["dist"] == "ddp"
    single = T.train(tiny_cfg(tmp_path, "single", max_steps=4, ckpt_interval=2, batch_size=4))
    l_ddp, l_one = train_losses(ddp), train_losses(tmp_path / "single")
    assert sorted(l_ddp) == sorted(l_one)
    for s in l_one:
        assert l_ddp[s] == pytest.approx(l_one[s], rel=1e-4, abs=1e-4), (s, l_ddp[s], l_one[s])
    assert summary["final_val_loss"] == pytest.approx(single["final_val_loss"], rel=1e-4)


@pytest.mark.slow  # torchrun
def test_torchrun_every_rank_stops_when_rank_0_cannot_lock_the_run_dir(tmp_path):
    rd = tmp_path / "locked"
    with RunDirLock(rd):  # someone else trains here
        proc = torchrun(tmp_path, 2, rd, {"batch_size": 2, "device": "cpu"})
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
    proc = torchrun(tmp_path, 2, rd, {"batch_size": 2, "device": "cpu", "dist": "fsdp", "stop_at_step": 2})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    args = ["--resume"]
    cmd_extra = {"batch_size": 2, "device": "cpu", "dist": "fsdp"}
    proc = torchrun(tmp_path, 2, rd, cmd_extra, extra_args=args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((rd / "summary.json").read_text())
    assert s["dist"] == "fsdp" and s["world_size"] == 2 and s["steps"] == 4
    T.verify_checkpoint(T.find_latest_checkpoint(rd))
    T.train(tiny_cfg(tmp_path, "single", max_steps=4, ckpt_interval=2, batch_size=4))
    l_fsdp, l_one = train_losses(rd), train_losses(tmp_path / "single")
    assert sorted(l_fsdp) == sorted(l_one) == [1, 2, 3, 4]
    for step in l_one:
        assert l_fsdp[step] == pytest.approx(l_one[step], rel=1e-4, abs=1e-4), (
            step,
            l_fsdp[step],
            l_one[step],
        )


# ----------------------------------------------------------------------------- plots, comparison


@pytest.mark.slow  # training subprocesses
def test_compare_script_smoke(tmp_path):
    """scripts/compare.py: three variants, same token budget, one table and one plot."""
    sets = set_args(
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
        env=subprocess_env(),
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
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode == 0 and "| mhc | mhc | 4 |" in proc.stdout
