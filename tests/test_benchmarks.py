"""The benchmark scripts import and explain themselves on a machine without a GPU (``--help``), and the
helpers they share (``benchmarks/common.py``) compute what the notes' tables say.

The scripts sit in ``benchmarks/`` by what they measure: ``step/`` (the training step), ``site/`` (one
fused site and its kernels), ``projection/`` and ``decode/``. Tests that run a script as a subprocess are
marked ``slow``.
"""

import json
import os
import re
import subprocess
import sys
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
    "step/wheel_and_ab.sh",
    "projection/build_peers.sh",
}


def _run(*command: str, **env_overrides: str) -> subprocess.CompletedProcess:
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
    proc = _run(sys.executable, str(BENCHMARKS / script), "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage:" in proc.stdout and "python benchmarks/" + script in proc.stdout, proc.stdout


@pytest.mark.slow
def test_bench_block_documents_the_model_step_options():
    proc = _run(sys.executable, str(BENCHMARKS / "site" / "bench_block.py"), "--help")
    for option in ("--skip-block", "--skip-torch", "--json", "--rounds", "--batch", "--seq"):
        assert option in proc.stdout, option


@pytest.mark.slow
def test_every_benchmark_script_is_covered():
    """A script added to benchmarks/ gets its --help checked here too (common.py is imported, not run)."""
    scripts = _scripts(".py") - {"common.py"}
    assert scripts >= set(PYTHON_SCRIPTS)
    for script in sorted(scripts - set(PYTHON_SCRIPTS)):
        proc = _run(sys.executable, str(BENCHMARKS / script), "--help")
        assert proc.returncode == 0, f"{script}: {proc.stdout}{proc.stderr}"


@pytest.mark.slow
def test_gpu_check_prints_its_usage_and_refuses_unknown_stages():
    proc = _run("bash", str(BENCHMARKS / "gpu_check.sh"), "--help")
    assert proc.returncode == 0 and "Usage: benchmarks/gpu_check.sh" in proc.stdout, proc.stdout + proc.stderr
    proc = _run("bash", str(BENCHMARKS / "gpu_check.sh"), "benchmark")
    assert proc.returncode == 2 and "unknown stage 'benchmark'" in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.slow
def test_gpu_session_refuses_unknown_stages_before_running():
    proc = _run("bash", str(BENCHMARKS / "gpu_session.sh"), "setup", "fillab")
    assert proc.returncode == 2 and "unknown stage 'fillab'" in proc.stderr, proc.stdout + proc.stderr
    assert proc.stdout == ""  # nothing ran


@pytest.mark.slow
def test_step_ab_prints_its_usage_and_refuses_unknown_runs_before_running(tmp_path):
    proc = _run("bash", str(BENCHMARKS / "step" / "step_ab.sh"))
    assert proc.returncode == 2 and "usage: benchmarks/step/step_ab.sh" in proc.stderr, (
        proc.stdout + proc.stderr
    )
    proc = _run("bash", str(BENCHMARKS / "step" / "step_ab.sh"), str(tmp_path), "1b", "4", "new", "newer")
    assert proc.returncode == 2 and "unknown run 'newer'" in proc.stderr, proc.stdout + proc.stderr
    assert proc.stdout == ""  # nothing ran


def test_common_times_interleaved_variants_and_keeps_the_best_median(monkeypatch):
    """common.interleaved on fake timings: rounds run every variant in turn; the best round median is kept."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.remove(str(BENCHMARKS))
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


def test_common_step_peak_memory_adds_the_model_resident_bytes_to_the_step_peak(monkeypatch):
    """common.step_peak_memory: parameters + optimizer state, plus the step's peak above what was allocated before."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.remove(str(BENCHMARKS))
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
    proc = _run(
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
    proc = _run(
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
    proc = _run(
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
    proc = _run(sys.executable, str(BENCHMARKS / "step" / "saved_bytes.py"), "--dtyp", "fp32")
    assert proc.returncode == 2 and "unrecognized arguments: --dtyp" in proc.stderr, proc.stderr


def test_site_kernel_bandwidth_rows_from_profiler_averages():
    """common.site_kernel_bytes and kernel_bandwidth_rows (profile_step's per-kernel table) on fake averages."""
    from types import SimpleNamespace

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import common
    finally:
        sys.path.remove(str(BENCHMARKS))
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


def _bench_training():
    sys.path.insert(0, str(BENCHMARKS / "step"))
    try:
        import bench_training
    finally:
        sys.path.remove(str(BENCHMARKS / "step"))
    return bench_training


def test_bench_training_options_shapes_report_and_json(tmp_path):
    """benchmarks/step/bench_training.py's pieces without running a model: its options, the shapes (the small_gpu
    preset's model and batch), the compile call mhc.train makes, the kernel figures at the streams' element size,
    the markdown tables and the JSON header."""
    from types import SimpleNamespace

    bt = _bench_training()
    common = bt.common

    args = bt.parse_args([])
    assert (args.shapes, args.recipes, args.modes) == (
        ["small_gpu", "134m", "1b"],
        ["bf16", "autocast"],
        ["eager", "compiled"],
    )
    assert (args.rounds, args.steps, args.warmup, args.init, args.compile_backend, args.device) == (
        2,
        10,
        3,
        "paper",
        "inductor",
        "cuda",
    )
    assert bt.parse_args(["--shapes", "1b,134m,1b", "--modes", "compiled"]).shapes == ["1b", "134m"]
    for bad in (
        ["--shapes", "2b"],
        ["--modes", ","],
        ["--device", "cpu"],
        ["--device", "cpu", "--tiny", "--kernels"],
        ["--rounds", "0"],
        ["--device", "mps"],
    ):
        with pytest.raises(SystemExit):
            bt.parse_args(bad)

    small, m134, b1 = (bt.shape_plan(s, tiny=False) for s in ("small_gpu", "134m", "1b"))
    assert (small["batch"], small["seq"], small["hidden"], small["layers"], small["vocab"]) == (
        32,
        512,
        512,
        12,
        8192,
    )
    assert (m134["batch"], m134["seq"], m134["hidden"], m134["layers"], m134["vocab"]) == (
        8,
        2048,
        768,
        12,
        32000,
    )
    assert (b1["batch"], b1["seq"], b1["hidden"], b1["layers"], b1["heads"], b1["kv_heads"]) == (
        4,
        2048,
        2048,
        22,
        32,
        4,
    )
    mhc_cfg, res_cfg = bt.preset_config("mhc"), bt.preset_config("residual")
    assert mhc_cfg.mhc_options == {"init": "paper"} and mhc_cfg.streams == 4 and mhc_cfg.variant == "mhc"
    assert res_cfg.variant == "residual" and res_cfg.streams == 1 and res_cfg.mhc_options == {}
    assert mhc_cfg.grad_clip == 1.0 and mhc_cfg.grad_accum == 1 and not mhc_cfg.compile
    model = torch.nn.Linear(2, 2)
    compiled = bt.compile_model(
        model, "inductor", torch.device("cpu")
    )  # mhc.train's wrap_model; lazy, nothing compiles
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule) and compiled._orig_mod is model

    T, C = 8192, 2048
    averages = [
        SimpleNamespace(key="postmix_fwd", count=88, self_device_time_total=88 * 500.0),
        SimpleNamespace(key="nvjet_gemm", count=10, self_device_time_total=10 * 1000.0),
    ]
    kernels = bt.kernel_figures(averages, 2, T, C, 4, copy=4000.0)
    fp32_bytes = common.site_kernel_bytes(T, 4, C, 4)["postmix_fwd"]
    assert (
        fp32_bytes > 1.9 * common.site_kernel_bytes(T, 4, C, 2)["postmix_fwd"]
    )  # float32 streams: twice the bytes
    (row,) = kernels["kernels"]
    assert (
        row["kernel"] == "postmix_fwd"
        and row["calls_per_step"] == 44
        and row["us_per_call"] == pytest.approx(500.0)
    )
    assert row["gbps"] == pytest.approx(fp32_bytes / 500.0 / 1e3) and row["x_copy"] == pytest.approx(
        row["gbps"] / 4000.0
    )
    assert kernels["site_ms_per_step"] == pytest.approx(22.0) and kernels[
        "kernel_ms_per_step"
    ] == pytest.approx(27.0)
    assert kernels["site_share"] == pytest.approx(44.0 / 54.0) and kernels["stream_bytes"] == 4

    def figures(ms, peak, compile_s):
        return {
            "ms": ms,
            "tokens_per_s": T / ms * 1e3,
            "round_medians": [ms + 1, ms],
            "peak_gb": peak,
            "compile_s": compile_s,
            "skipped_steps": 0,
        }

    group = {
        "shape": "1b",
        "recipe": "autocast",
        "mode": "compiled",
        "batch": 4,
        "seq": 2048,
        "tokens_per_step": T,
        "models": {"residual": figures(200.0, 40.0, 45.0), "mhc": figures(230.0, 50.0, 55.0)},
        "ratio_ms": 1.15,
        "ratio_peak": 1.25,
        "kernels": kernels,
    }
    failed = {
        "shape": "134m",
        "recipe": "bf16",
        "mode": "eager",
        "error": "OutOfMemoryError: CUDA out of memory",
    }
    lines = bt.table([group, failed]).splitlines()
    assert all(line.count("|") == lines[0].count("|") for line in lines), lines
    assert lines[2] == (
        "| 1b | autocast | compiled | 8,192 | 200.00 | 230.00 | 1.150× | 40,960 | 35,617 | 40.00 | 50.00 "
        "| 1.250× | 45.0 / 55.0 |"
    ), lines[2]
    assert "failed: OutOfMemoryError" in lines[3]
    assert "| postmix_fwd | 44 | 500.0 |" in bt.kernel_table(group) and "4-byte streams" in bt.kernel_table(
        group
    )
    assert "1.150x" in bt.group_line(group) and "FAILED" in bt.group_line(failed)

    argv = ["--shapes", "134m", "--commit", "abc1234"]
    report = {**bt.header(bt.parse_args(argv), argv), "groups": [group, failed], "complete": True}
    common.write_json(tmp_path / "training.json", report)
    data = json.loads((tmp_path / "training.json").read_text())
    assert data["commit"] == "abc1234" and data["environment"]["torch"] == torch.__version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"]) and data["command"].endswith(
        "--shapes 134m --commit abc1234"
    )
    assert (
        data["shapes"]["134m"]["batch"] == 8
        and data["settings"]["rounds"] == 2
        and data["groups"][0]["ratio_ms"] == 1.15
    )


@pytest.mark.slow
def test_bench_training_runs_every_path_on_tiny_models_on_the_cpu(tmp_path):
    """bench_training.py on tiny models on the CPU (reference site, host timers, dynamo's eager backend): every
    group of two shapes, both recipes and both modes runs and lands in the JSON."""
    out = tmp_path / "training.json"
    proc = _run(
        sys.executable,
        str(BENCHMARKS / "step" / "bench_training.py"),
        "--device",
        "cpu",
        "--tiny",
        "--shapes",
        "small_gpu,1b",
        "--compile-backend",
        "eager",
        "--rounds",
        "1",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--commit",
        "abc1234",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| shape | recipe | mode |" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["complete"] and data["commit"] == "abc1234" and data["settings"]["tiny"], data["settings"]
    assert [(g["shape"], g["recipe"], g["mode"]) for g in data["groups"]] == [
        (s, r, m) for s in ("small_gpu", "1b") for r in ("bf16", "autocast") for m in ("eager", "compiled")
    ]
    for g in data["groups"]:
        assert "error" not in g, g
        res, mhc = g["models"]["residual"], g["models"]["mhc"]
        for f in (res, mhc):
            assert (
                f["ms"] > 0
                and f["tokens_per_s"] > 0
                and len(f["round_medians"]) == 1
                and f["skipped_steps"] == 0
            ), f
            assert f["stream_dtype"] == ("torch.bfloat16" if g["recipe"] == "bf16" else "torch.float32"), (
                g["recipe"],
                f,
            )
            assert f["resident_gb"] > 0 and f["peak_gb"] is None  # no peak memory on the CPU
            if g["mode"] == "compiled":
                assert f["compile_s"] > 0 and f["dynamo"]["unique_graphs"] >= 1, f
        assert mhc["params"] > res["params"] and g["ratio_ms"] == pytest.approx(mhc["ms"] / res["ms"])
        if g["recipe"] == "autocast":  # mhc.train's step: two warm-up, one timed, one for memory
            assert res["steps_run"] == mhc["steps_run"] == 4, g


def _sweep_site_kernels():
    pytest.importorskip("triton")
    sys.path.insert(0, str(BENCHMARKS / "site"))
    try:
        import sweep_site_kernels
    finally:
        sys.path.remove(str(BENCHMARKS / "site"))
    return sweep_site_kernels


def test_sweep_site_kernels_options_grids_and_error_bound():
    """benchmarks/site/sweep_site_kernels.py without running a kernel: bf16 keeps its shapes, kernels, grid and
    tolerance; float32 (issue #49) adds the small_gpu shape, the kernels the profile points at first, the
    PRECISION dimension of the dot kernels (tf32 on the coarse grid), the float64 reference and its error bound."""
    sw = _sweep_site_kernels()
    bf = sw.parse_args([])
    assert (
        bf.shapes == [(768, 16384), (2048, 8192)] and bf.kernels == list(sw.KERNELS) and bf.precisions == ()
    )
    assert (bf.reference, bf.tol, bf.screen) == ("plan", 2e-2, 0)
    f32 = sw.parse_args(["--dtype", "float32"])
    assert f32.shapes == [(512, 16384), (768, 16384), (2048, 8192)]
    assert f32.kernels == ["coeff_partial", "stream_grad", "phi_grad", "coeff_bwd"]
    assert f32.precisions == ("ieee", "tf32x3", "tf32") and f32.coarse == ("tf32",)
    assert (f32.reference, f32.tol, f32.screen, f32.rel_factor) == ("float64", 1e-5, 8, 4.0)
    assert sw.parse_args(
        ["--dtype", "float32", "--precisions", "ieee", "--shapes", "512x16384"]
    ).precisions == ("ieee",)
    for bad in (
        ["--shapes", "512"],
        ["--shapes", "0x16"],
        ["--kernels", "coeff_partial,gemm"],
        ["--dtype", "float16"],
        ["--jobs", "0"],
    ):
        with pytest.raises(SystemExit):
            sw.parse_args(bad)

    # bf16: the grid the plan was swept on, no PRECISION; every variant also counted before.
    bf16 = {k: sw.grid_variants(k, 768) for k in sw.KERNELS}
    assert {k: len(v) for k, v in bf16.items()} == {
        "coeff_partial": 108,
        "coeff_fwd": 54,
        "postmix_fwd": 18,
        "postmix_bwd": 24,
        "coeff_bwd": 27,
        "stream_grad": 72,
        "phi_grad": 48,
    }
    assert not any("PRECISION" in v for vs in bf16.values() for v in vs)
    # float32: each precision over the grid (tf32 over the coarse one); 4 stages of 128 x 128 tiles do not fit.
    f = torch.float32
    cp = sw.grid_variants("coeff_partial", 512, f, f32.precisions, f32.coarse)
    by_p = {p: [v for v in cp if v["PRECISION"] == p] for p in f32.precisions}
    assert {p: len(v) for p, v in by_p.items()} == {"ieee": 102, "tf32x3": 102, "tf32": 8}
    assert not any(v["BM"] == v["BK"] == 128 and v["num_stages"] == 4 for v in cp)
    assert all(v["num_warps"] == 4 and v["num_stages"] == 3 for v in by_p["tf32"])
    for kernel in ("stream_grad", "phi_grad"):
        vs = sw.grid_variants(kernel, 512, f, f32.precisions, f32.coarse)
        assert {v["PRECISION"] for v in vs} == set(f32.precisions)
    assert "PRECISION" not in sw.grid_variants("coeff_bwd", 512, f, f32.precisions, f32.coarse)[0]
    assert (
        len(sw.grid_variants("coeff_bwd", 512, f)) == 27 and len(sw.grid_variants("coeff_bwd", 768, f)) == 36
    )  # BC <= C
    limited = sw.grid_variants("stream_grad", 512, f, f32.precisions, f32.coarse, limit=2)
    assert [v["PRECISION"] for v in limited] == ["ieee", "ieee", "tf32x3", "tf32x3", "tf32", "tf32"]
    # splits and tokens are launch arguments: variants differing only there share a compile.
    a, b = dict(cp[0], splits=1), dict(cp[0], splits=4)
    assert sw.compile_key("coeff_partial", a) == sw.compile_key("coeff_partial", b)
    assert sw.compile_key("coeff_partial", a) != sw.compile_key("coeff_partial", dict(a, PRECISION="tf32x3"))

    # Against float64: 4x the plan's (ieee) error, at least 1e-6, at most --tol; against the plan: --tol.
    bound = sw.error_bound
    assert bound("float64", 1e-5, 3e-7, 4.0) == pytest.approx(1.2e-6)
    assert bound("float64", 1e-5, 1e-8, 4.0) == sys.modules["sweep_grid"].REL_FLOOR == 1e-6
    assert bound("float64", 1e-5, 8e-6, 4.0) == 1e-5
    assert bound("float64", 1e-5, None, 4.0) == 1e-5 and bound("plan", 2e-2, 3e-7, 4.0) == 2e-2
    assert (
        3e-4 > bound("float64", 1e-5, 3.4e-7, 4.0) > 3.9e-7
    )  # tf32 fails, tf32x3 passes (~ torch's CPU sums)
    # float32 streams move twice the stream bytes (the coefficients stay float32).
    common = sw.common
    assert common.site_kernel_bytes(16384, 4, 512, 4)["coeff_partial"] == 16384 * (4 * 512 * 4 + 4 * 25)


def test_sweep_site_kernels_runs_float32_in_the_interpreter(tmp_path):
    """The float32 sweep end to end in Triton's interpreter on a tiny shape: the plan and one variant of each
    precision per dot kernel, checked against float64 (all correct there: the interpreter's dot is numpy's),
    the JSON written; a --budget of 0 stops before the first variant and still writes it."""
    sw = _sweep_site_kernels()
    if torch.cuda.is_available():
        pytest.skip("the CPU run of the sweep (the GPU runs it in benchmarks/gpu_session.sh sweep32)")
    out = tmp_path / "sweep32.json"
    argv = [
        "--dtype",
        "float32",
        "--shapes",
        "128x16",
        "--limit",
        "1",
        "--jobs",
        "1",
        "--screen",
        "2",
        "--json",
        str(out),
    ]
    rows = sw.main(argv)
    data = json.loads(out.read_text())
    assert (
        data["complete"]
        and data["dtype"] == "float32"
        and data["reference"] == "float64"
        and len(data["rows"]) == len(rows)
    )
    got = {(r["kernel"], r["precision"], r["plan"]) for r in rows}
    assert got == {
        ("coeff_partial", "ieee", True),
        ("stream_grad", "ieee", True),
        ("phi_grad", "ieee", True),
        ("coeff_bwd", None, True),
        ("coeff_bwd", None, False),
    } | {
        (k, p, False)
        for k in ("coeff_partial", "stream_grad", "phi_grad")
        for p in ("ieee", "tf32x3", "tf32")
    }
    for r in rows:
        assert (
            r["ok"]
            and 0 < r["max_rel"] < 1e-6
            and r["bound"] >= sys.modules["sweep_grid"].REL_FLOOR
            and r["us"] > 0
        ), r
        assert (r["C"], r["T"]) == (128, 16) and r["x_copy"] > 0
    assert [s["kernel"] for s in data["summary"]] == sorted(
        ["coeff_partial", "stream_grad", "phi_grad", "coeff_bwd"]
    )
    assert sum(r["full"] for r in rows) >= 5  # the plans at least, timed again in full

    sw.main(argv[:-1] + [str(tmp_path / "none.json"), "--budget", "0", "--kernels", "coeff_bwd"])
    data = json.loads((tmp_path / "none.json").read_text())
    assert not data["complete"] and data["rows"] == []


@pytest.mark.slow
def test_sweep_site_kernels_compiles_in_worker_processes(tmp_path):
    """--jobs 2: the worker processes take one task per distinct compile (on CUDA Triton's warmup, nothing
    launched; in the interpreter nothing to compile), the timing process waits for each kernel's."""
    pytest.importorskip("triton")
    env = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    out = tmp_path / "sweep.json"
    proc = _run(
        sys.executable,
        str(BENCHMARKS / "site" / "sweep_site_kernels.py"),
        "--dtype",
        "float32",
        "--shapes",
        "128x16",
        "--kernels",
        "stream_grad",
        "--limit",
        "1",
        "--jobs",
        "2",
        "--json",
        str(out),
        **env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stream_grad: 3/3 distinct variants compiled, 0 failed" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["complete"] and data["compiles"]["stream_grad"]["done"] == 3 and len(data["rows"]) == 4
    assert all(r["ok"] for r in data["rows"]), data["rows"]
