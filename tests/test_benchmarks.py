"""The benchmark scripts import and explain themselves on a machine without a GPU (``--help``), and the
helpers they share (``benchmarks/common.py``) compute what the notes' tables say.

The scripts sit in ``benchmarks/`` by what they measure: ``step/`` (the training step), ``site/`` (one
fused site and its kernels), ``projection/`` and ``decode/``. Tests that run a script as a subprocess are
marked ``slow``.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
GROUPS = ("step", "site", "projection", "decode")
PYTHON_SCRIPTS = ["site/bench_block.py", "step/profile_step.py", "site/gpu_block_smoke.py"]
SHELL_SCRIPTS = {
    "gpu_check.sh",
    "gpu_session.sh",
    "step/step_ab.sh",
    "step/training_ab.sh",
    "step/wheel_and_ab.sh",
    "projection/build_peers.sh",
}


def run_in_repo(*command: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(env_overrides)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _scripts(suffix: str) -> set[str]:
    """Every script under benchmarks/ with this suffix, as a path relative to benchmarks/."""
    return {
        p.relative_to(BENCHMARKS).as_posix()
        for p in BENCHMARKS.rglob("*" + suffix)
        if "__pycache__" not in p.parts
    }


def test_benchmarks_are_grouped_by_what_they_measure():
    """Only the shared helpers and the device-session drivers sit at the top; every other script is in a group."""
    top = {p.name for p in BENCHMARKS.iterdir() if p.is_file()}
    assert top == {"common.py", "gpu_check.sh", "gpu_session.sh"}, top
    folders = {p.name for p in BENCHMARKS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(GROUPS), folders
    assert _scripts(".sh") == SHELL_SCRIPTS, _scripts(".sh")


def test_every_benchmark_path_named_in_the_docs_exists():
    """README, notes/ and docs/ name scripts by their path under benchmarks/: each must be there."""
    docs = [
        ROOT / "README.md",
        *sorted((ROOT / "notes").glob("*.md")),
        *sorted((ROOT / "docs").rglob("*.md")),
    ]
    named = {
        (doc.relative_to(ROOT).as_posix(), m)
        for doc in docs
        for m in re.findall(r"benchmarks/[\w/]+\.(?:py|sh|cu)\b", doc.read_text())
    }
    assert len(named) > 10, named
    missing = sorted((doc, path) for doc, path in named if not (ROOT / path).is_file())
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("script", PYTHON_SCRIPTS)
def test_script_imports_and_prints_its_help(script):
    proc = run_in_repo(sys.executable, str(BENCHMARKS / script), "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage:" in proc.stdout and "python benchmarks/" + script in proc.stdout, proc.stdout


@pytest.mark.slow
def test_bench_block_documents_the_model_step_options():
    proc = run_in_repo(sys.executable, str(BENCHMARKS / "site" / "bench_block.py"), "--help")
    for option in ("--skip-block", "--skip-torch", "--json", "--rounds", "--batch", "--seq"):
        assert option in proc.stdout, option


@pytest.mark.slow
def test_every_benchmark_script_is_covered():
    """A script added to benchmarks/ gets its --help checked here too. Helper modules (no ``__main__``: common.py,
    and the topics a script imports from beside it) are imported by the scripts, not run."""
    scripts = {s for s in _scripts(".py") if 'if __name__ == "__main__"' in (BENCHMARKS / s).read_text()}
    assert scripts >= set(PYTHON_SCRIPTS)
    for script in sorted(scripts - set(PYTHON_SCRIPTS)):
        proc = run_in_repo(sys.executable, str(BENCHMARKS / script), "--help")
        assert proc.returncode == 0, f"{script}: {proc.stdout}{proc.stderr}"


@pytest.mark.slow
def test_gpu_check_prints_its_usage_and_refuses_unknown_stages():
    proc = run_in_repo("bash", str(BENCHMARKS / "gpu_check.sh"), "--help")
    assert proc.returncode == 0 and "Usage: benchmarks/gpu_check.sh" in proc.stdout, proc.stdout + proc.stderr
    proc = run_in_repo("bash", str(BENCHMARKS / "gpu_check.sh"), "benchmark")
    assert proc.returncode == 2 and "unknown stage 'benchmark'" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.slow
def test_gpu_session_refuses_unknown_stages_before_running():
    proc = run_in_repo("bash", str(BENCHMARKS / "gpu_session.sh"), "setup", "fillab")
    assert proc.returncode == 2 and "unknown stage 'fillab'" in proc.stderr, proc.stdout + proc.stderr
    assert proc.stdout == ""  # nothing ran


@pytest.mark.slow
def test_gpu_session_tests_stage_runs_each_file_and_fails_if_one_fails(tmp_path):
    """The stage tests: one pytest process per file, each file's log and a summary line with its exit status;
    the script exits 1 when a file fails (and 0 when none does)."""
    (tmp_path / "test_good.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    (tmp_path / "test_bad.py").write_text("def test_broken():\n    assert 1 + 1 == 3\n")
    out = tmp_path / "out"
    files = f"{tmp_path / 'test_good.py'} {tmp_path / 'test_bad.py'}"
    proc = run_in_repo(
        "bash",
        str(BENCHMARKS / "gpu_session.sh"),
        "tests",
        OUT=str(out),
        GPU_TEST_FILES=files,
        TESTS_JOBS="2",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "pytest_summary.log").read_text().splitlines()
    assert len(summary) == 2 and ": rc=1: " in summary[0] and "1 failed" in summary[0], summary
    assert ": rc=0: " in summary[1] and "1 passed" in summary[1], summary
    assert "test_broken FAILED" in (out / "pytest_test_bad.log").read_text()
    proc = run_in_repo(
        "bash",
        str(BENCHMARKS / "gpu_session.sh"),
        "tests",
        OUT=str(out),
        GPU_TEST_FILES=str(tmp_path / "test_good.py"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_step_ab_prints_its_usage_and_refuses_unknown_runs_before_running(tmp_path):
    proc = run_in_repo("bash", str(BENCHMARKS / "step" / "step_ab.sh"))
    assert proc.returncode == 2 and "usage: benchmarks/step/step_ab.sh" in proc.stderr, (
        proc.stdout + proc.stderr
    )
    proc = run_in_repo(
        "bash", str(BENCHMARKS / "step" / "step_ab.sh"), str(tmp_path), "1b", "4", "new", "newer"
    )
    assert proc.returncode == 2 and "unknown run 'newer'" in proc.stderr, proc.stdout + proc.stderr
    assert proc.stdout == ""  # nothing ran


def _common():
    """``benchmarks/common.py``, imported with its folder on ``sys.path`` while it imports."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.remove(str(BENCHMARKS))
    return common


def test_common_times_interleaved_variants_and_keeps_the_best_median(monkeypatch):
    """common.interleaved on fake timings: rounds run every variant in turn; the best round median is kept."""
    common = _common()
    order, fake = [], iter([[5.0, 1.0, 9.0], [4.0, 4.0, 4.0], [2.0, 3.0, 7.0], [6.0, 6.0, 6.0]])
    monkeypatch.setattr(common, "time_calls", lambda fn, steps, warmup: (fn(), next(fake))[1])
    result = common.interleaved(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=2, steps=3
    )
    assert order == ["a", "b", "a", "b"]
    assert result["a"].round_medians == [5.0, 3.0] and result["a"].ms == 3.0
    assert result["b"].round_medians == [4.0, 6.0] and result["b"].ms == 4.0
    with pytest.raises(ValueError, match="rounds"):
        common.interleaved({"a": lambda: None}, rounds=0)
    # rotate: round r starts at the r-th variant, so no variant always runs first or after the same one
    order.clear()
    fake = iter([[1.0]] * 9)
    common.interleaved({k: (lambda k=k: order.append(k)) for k in "abc"}, rounds=3, steps=1, rotate=True)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_common_times_runs_of_calls_with_one_synchronisation():
    """common.time_run: the mean of ``steps`` calls in a row after ``warmup`` untimed ones (real sleeps on the
    CPU); common.interleaved with runs=True takes one run a round and keeps the best."""
    import time

    common = _common()
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.01)

    ms = common.time_run(slow, steps=4, warmup=2)
    assert len(calls) == 6 and 9.0 <= ms < 60.0, ms
    result = common.interleaved({"slow": slow, "fast": lambda: None}, rounds=2, steps=3, warmup=1, runs=True)
    assert len(calls) == 6 + 2 * 4
    assert [len(t) for t in result["slow"].times] == [1, 1] and result["slow"].ms == min(
        result["slow"].round_medians
    )
    assert result["slow"].ms >= 9.0 and result["fast"].ms < result["slow"].ms


def test_common_step_peak_memory_adds_the_model_resident_bytes_to_the_step_peak(monkeypatch):
    """common.step_peak_memory: parameters + optimizer state, plus the step's peak above what was allocated before."""
    common = _common()
    model = torch.nn.Linear(10, 10)  # 110 float32 parameters
    opt = torch.optim.AdamW(model.parameters())

    def step():
        model(torch.randn(3, 10)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.optimizer = opt
    step()  # exp_avg and exp_avg_sq: 2 * 110 floats, plus 2 scalar step counts
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 1700)
    figures = common.step_peak_memory(model, step)
    resident = 110 * 4 * 3 + 2 * 4
    assert figures["resident_gb"] == resident / 1e9 and figures["peak_gb"] == (resident + 700) / 1e9


@pytest.mark.slow
def test_bench_projection_peers_runs_ours_on_cpu_and_reports_missing_peers(tmp_path):
    """The peer benchmark on the CPU: our columns measured through the PyTorch path, every peer cell
    "n/a (reason)", our accuracy checked; bad options and a missing peer source are reported, not crashed."""
    out = tmp_path / "peers.json"
    proc = run_in_repo(
        sys.executable,
        str(BENCHMARKS / "projection" / "bench_projection_peers.py"),
        "--device",
        "cpu",
        "--sizes",
        "512,2048",
        "--sigma",
        "1",
        "--calls",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--bench-warmup-ms",
        "0",
        "--bench-rep-ms",
        "1",
        "--acc-size",
        "256",
        "--acc-sigmas",
        "1,30",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "chained protocol" in proc.stdout and "cpu per-call median" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["header"]["command"].endswith("--json " + str(out)) and data["header"]["commit"], data[
        "header"
    ]
    for protocol in ("chained", "do_bench"):
        assert set(data["tables"][protocol]) == {"512", "2048"}, data["tables"]
        for N, cells in data["tables"][protocol].items():
            for column in ("ours fwd", "ours ag", "ours op", "copy fwd", "copy f+b", "mul ag"):
                assert isinstance(cells[column], float) and cells[column] > 0, (protocol, N, column, cells)
            for column in ("proj fwd", "proj op", "proj ag", "sk fwd", "sk op", "sk ag"):
                assert cells[column] == "n/a (cpu run)", (protocol, N, column, cells)
    assert set(data["accuracy"]) == {"1", "30"}, data["accuracy"]
    for sigma, row in data["accuracy"].items():
        assert 0 < row["ours"]["max_err"] <= 1e-5 and row["ours"]["nonfinite"] == 0, (sigma, row)
        assert row["mHC-proj"] == {"error": "n/a (cpu run)"}, (sigma, row)
    assert data["ours_accurate"] is True
    proc = run_in_repo(
        sys.executable,
        str(BENCHMARKS / "projection" / "bench_projection_peers.py"),
        "--device",
        "cpu",
        "--sizes",
        "512,0",
    )
    assert proc.returncode == 2 and "--sizes" in proc.stderr, proc.stdout + proc.stderr
    proc = subprocess.run(
        ["bash", str(BENCHMARKS / "projection" / "build_peers.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PEERS_DIR": str(tmp_path / "none"), "OUT": str(tmp_path)},
    )
    assert proc.returncode == 0 and "peer build: SKIPPED, no source" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_saved_bytes_counts_the_streams_an_mhc_site_keeps_for_backward(tmp_path):
    """benchmarks/saved_bytes.py on the CPU (fused site in Triton's interpreter): every variant saves something,
    the branches save what the residual model's sublayers save, and an mHC site keeps at least its input streams
    (n*C elements per token) beyond the residual model on both paths; the fused site exactly the streams, y and its
    fp32 coefficients (zr [T, n*n+2n+1], h [T, 2n], H_res [T, n, n])."""
    out, n, C = tmp_path / "saved.json", 4, 128
    proc = run_in_repo(
        sys.executable,
        str(BENCHMARKS / "step" / "saved_bytes.py"),
        "--hidden",
        str(C),
        "--heads",
        "2",
        "--intermediate",
        "256",
        "--vocab",
        "64",
        "--layers",
        "1",
        "--batch",
        "2",
        "--seq",
        "8",
        "--dtype",
        "bf16",
        "--n-streams",
        str(n),
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "C/token/site" in proc.stdout and "# command: python" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    rows, c_bytes = data["variants"], data["c_bytes"]
    assert c_bytes == C * 2 and data["sites"] == 2 and data["tokens"] == 16, data
    for name, row in rows.items():
        assert row["total_bytes"] > 0 and row["bytes_per_token_per_site"] > 0, (name, row)
        branch = row["by_owner_C_per_token_per_site"]["branch"]
        assert branch == rows["residual"]["by_owner_C_per_token_per_site"]["branch"], (name, row)
    for name in ("mhc fused", "mhc fused=False"):
        assert rows[name]["extra_C_per_token_per_site"] >= n, (name, rows[name])
    fused_row = rows["mhc fused"]
    assert fused_row["site_shapes_C_per_token_per_site"][f"[B,S,{n},{C}] bfloat16"] == n, fused_row
    coefficients = (n * n + 2 * n + 1 + 2 * n + n * n) * 4 / c_bytes
    assert fused_row["extra_C_per_token_per_site"] == pytest.approx(n + 1 + coefficients, abs=1e-9), fused_row
    assert rows["mhc fused=False"]["extra_C_per_token_per_site"] > fused_row["extra_C_per_token_per_site"], (
        rows
    )
    proc = run_in_repo(sys.executable, str(BENCHMARKS / "step" / "saved_bytes.py"), "--dtyp", "fp32")
    assert proc.returncode == 2 and "unrecognized arguments: --dtyp" in proc.stderr, proc.stderr


def test_site_kernel_bandwidth_rows_from_profiler_averages():
    """common.site_kernel_bytes and kernel_bandwidth_rows (profile_step's per-kernel table) on fake averages."""
    from types import SimpleNamespace

    common = _common()
    T, n, C = 16384, 4, 768
    nbytes = common.site_kernel_bytes(T, n, C)
    assert set(nbytes) == {
        "coeff_partial",
        "coeff_fwd",
        "postmix_fwd",
        "postmix_bwd",
        "coeff_bwd",
        "stream_grad",
        "phi_grad",
    }
    # x and x' in bf16 (2 n C), y (C), then h and H_res in float32 (2n + n²), per token:
    assert nbytes["postmix_fwd"] == T * ((2 * n * C + C) * 2 + (2 * n + n * n) * 4)
    assert (
        nbytes["stream_grad"]
        > nbytes["postmix_bwd"]
        > nbytes["postmix_fwd"]
        > nbytes["coeff_fwd"]
        > nbytes["coeff_partial"]
    )
    averages = [
        SimpleNamespace(key="postmix_fwd", count=24, self_device_time_total=24 * 57.0),
        SimpleNamespace(
            key="postmix_fwd_0d1d", count=19, self_device_time_total=19 * 57.0
        ),  # a suffixed name
        SimpleNamespace(key="coeff_fwd", count=0, self_device_time_total=0.0),  # not run: left out
        SimpleNamespace(key="ampere_bf16_gemm", count=50, self_device_time_total=9e3),
    ]
    rows = common.kernel_bandwidth_rows(averages, nbytes, copy=4000.0)
    assert [r[:2] for r in rows] == [("postmix_fwd", 43)]
    _, _, us, gbps, of_copy = rows[0]
    assert us == pytest.approx(57.0)
    assert gbps == pytest.approx(nbytes["postmix_fwd"] / 57.0 / 1e3)
    assert of_copy == pytest.approx(gbps / 4000.0)


@pytest.mark.slow
def test_training_ab_refuses_unknown_runs_and_a_missing_old_tree_before_running(tmp_path):
    script = str(BENCHMARKS / "step" / "training_ab.sh")
    proc = run_in_repo("bash", script, "-", "--tiny", "new", "newer", OUT=str(tmp_path))
    assert proc.returncode == 2 and "unknown run 'newer'" in proc.stderr, proc.stdout + proc.stderr
    proc = run_in_repo("bash", script, "-", "--tiny", "new", "old", OUT=str(tmp_path))
    assert proc.returncode == 2 and "run 'old' needs OLD_TREE" in proc.stderr, proc.stdout + proc.stderr
    assert proc.stdout == "" and not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.slow
def test_training_ab_runs_each_tree_in_its_own_process_and_packs_the_logs(tmp_path):
    """A tree given by path imports its own mhc; the logs come back as one archive."""
    other = tmp_path / "other"
    shutil.copytree(ROOT / "mhc", other / "mhc", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    args = "--tiny --device cpu --shapes small_gpu --recipes autocast --modes eager --steps 1 --warmup 0 --rounds 1"
    proc = run_in_repo(
        "bash", str(BENCHMARKS / "step" / "training_ab.sh"), "-", args, "new", str(other), OUT=str(out)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("new 1: rc=0") and lines[0].endswith(f"mhc: {ROOT / 'mhc'}"), proc.stdout
    assert lines[2].startswith(f"{other} 2: rc=0") and lines[2].endswith(f"mhc: {other / 'mhc'}"), proc.stdout
    assert (
        "[small_gpu autocast eager] residual" in lines[1]
        and "[small_gpu autocast eager] residual" in lines[3]
    )
    with tarfile.open(out / "training_ab.tgz") as archive:
        names = sorted(n for n in archive.getnames() if "." in Path(n).name)
    assert names == [f"training_ab/1_new.{e}" for e in ("json", "log")] + [
        f"training_ab/2_other.{e}" for e in ("json", "log")
    ]
    assert not (out / "training_ab").exists()
