"""The training-throughput benchmark (``benchmarks/step/bench_training.py``) and the fused site's kernel sweep
(``benchmarks/site/sweep_site_kernels.py``) on a machine without a GPU: their options, shapes, error bounds and
reports, and small runs on CPU models or in Triton's interpreter. Tests that run a script as a subprocess are
marked ``slow``.
"""

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from test_benchmarks import run_in_repo

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _benchmark_module(folder: str, name: str):
    """``benchmarks/<folder>/<name>.py`` imported as a module (its folder on ``sys.path`` while it imports)."""
    sys.path.insert(0, str(BENCHMARKS / folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS / folder))


def _bench_training():
    return _benchmark_module("step", "bench_training")


def _ab_previous():
    return _benchmark_module("step", "ab_previous")


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
    assert args.stream_dtypes == ["autocast"]  # the library's default
    assert bt.model_kinds("autocast", ["autocast", "hidden"]) == {
        "residual": "hidden",
        "mhc": "autocast",
        "mhc[hidden]": "hidden",
    }
    # no autocast in the bf16 recipe: both settings keep the hidden state's dtype there, the first is run
    assert bt.model_kinds("bf16", ["autocast", "hidden"]) == {"residual": "hidden", "mhc": "autocast"}
    assert bt.model_kinds("bf16", ["hidden", "autocast"]) == {"residual": "hidden", "mhc": "hidden"}
    assert bt.parse_args(["--shapes", "1b,134m,1b", "--modes", "compiled"]).shapes == ["1b", "134m"]
    assert bt.parse_args(["--runs", "--late"]).late and not args.late
    for bad in (
        ["--shapes", "2b"],
        ["--modes", ","],
        ["--device", "cpu"],
        ["--device", "cpu", "--tiny", "--kernels"],
        ["--rounds", "0"],
        ["--device", "mps"],
        ["--stream-dtypes", "bf16"],
        ["--late"],  # a late read timed step by step would gain nothing
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
    kernels = bt.kernel_figures(averages, 2, T, C, {"elt": 4, "u_elt": 4, "y_elt": 4}, copy=4000.0)
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
    # The mHC step's non-site kernels against the residual step's: site kernels left out, largest excess first,
    # kernels the residual step lacks counted from zero, ones that take no more left out.
    mhc_ms = bt.kernel_ms(
        averages
        + [
            SimpleNamespace(key="cast_kernel", count=4, self_device_time_total=4000.0),
            SimpleNamespace(key="rms_norm", count=4, self_device_time_total=3000.0),
            SimpleNamespace(key="idle_entry", count=1, self_device_time_total=0.0),
        ],
        2,
    )
    assert mhc_ms == {"postmix_fwd": 22.0, "nvjet_gemm": 5.0, "cast_kernel": 2.0, "rms_norm": 1.5}
    residual_ms = {"nvjet_gemm": 5.0, "rms_norm": 1.0}
    extra = bt.extra_kernels(mhc_ms, residual_ms, set(common.site_kernel_bytes(T, 4, C, 4)))
    assert extra == [("cast_kernel", 2.0, 0.0), ("rms_norm", 1.5, 1.0)]
    kernels.update(residual_kernel_ms_per_step=6.0, extra_kernels=extra)
    text = bt.kernel_table({"kernels": kernels, "shape": "1b", "recipe": "autocast", "mode": "eager"})
    assert "residual step's kernel time 6.00 ms" in text and "take -1.00 ms more" in text
    assert "| `cast_kernel` | 2.000 | 0.000 |" in text

    def figures(ms, peak, compile_s, dtype="torch.float32", setting="hidden"):
        return {
            "stream_dtype": dtype,
            "stream_setting": setting,
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
        "models": {
            "residual": figures(200.0, 40.0, 45.0),
            "mhc": figures(230.0, 50.0, 55.0),
            "mhc[autocast]": figures(210.0, 44.0, 50.0, "torch.bfloat16", "autocast"),
        },
        "ratio_ms": 1.15,
        "ratio_peak": 1.25,
        "ratios": {"mhc": {"ms": 1.15, "peak": 1.25}, "mhc[autocast]": {"ms": 1.05, "peak": 1.1}},
        "kernels": kernels,
        "other_kernels": {"mhc[autocast]": dict(kernels, stream_bytes=2)},
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
        "| 1b | autocast | compiled | float32 | 8,192 | 200.00 | 230.00 | 1.150× | 40,960 | 35,617 | 40.00 "
        "| 50.00 | 1.250× | 45.0 / 55.0 |"
    ), lines[2]
    assert lines[3].startswith(
        "| 1b | autocast | compiled | bfloat16 (autocast) | 8,192 | 200.00 | 210.00 | 1.050×"
    )
    assert "failed: OutOfMemoryError" in lines[4]
    first, other = bt.kernel_tables(group)
    assert "| postmix_fwd | 44 | 500.0 |" in first and "4-byte streams" in first and "the mhc step" in first
    assert "2-byte streams" in other and "the mhc[autocast] step" in other
    line = bt.group_line(group)
    assert "1.150x" in line and "mhc[autocast] 210.00 ms" in line and "1.050x" in line
    assert "FAILED" in bt.group_line(failed)

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
    group of two shapes, both recipes and both modes runs and lands in the JSON, with a second mHC model on bf16
    streams (--stream-dtypes hidden,autocast) in the autocast recipe."""
    out = tmp_path / "training.json"
    proc = run_in_repo(
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
        "--stream-dtypes",
        "hidden,autocast",
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
        if g["recipe"] == "autocast":  # the second mHC model: bf16 streams under autocast
            bf16_streams = g["models"]["mhc[autocast]"]
            assert bf16_streams["stream_dtype"] == "torch.bfloat16" and bf16_streams["ms"] > 0, bf16_streams
            assert g["ratios"]["mhc[autocast]"]["ms"] == pytest.approx(bf16_streams["ms"] / res["ms"])
        else:  # 'autocast' is 'hidden' without autocast: not run twice
            assert set(g["models"]) == {"residual", "mhc"}, g["models"].keys()
        if g["recipe"] == "autocast":  # mhc.train's step: two warm-up, one timed, one for memory
            assert res["steps_run"] == mhc["steps_run"] == 4, g


@pytest.mark.slow
def test_bench_training_times_an_earlier_commits_model_in_the_same_rounds(tmp_path):
    """--base DIR (ab_previous.py --make-base): a third model, mhc[base], built by the earlier package (mhc_base,
    imported from DIR), timed in the same rounds and reported beside mhc; a DIR without mhc_base is refused."""
    base = tmp_path / "base"
    made = run_in_repo(
        sys.executable, str(BENCHMARKS / "step" / "ab_previous.py"), "--make-base", "HEAD", str(base)
    )
    assert made.returncode == 0, made.stdout + made.stderr
    # Only the CUDA extension's ops stay in mhc::, registered once by this tree; an op that both packages
    # define would be replaced by the base's (and the replaced one's teardown can leave it with no schema).
    named = set()
    for path in (base / "mhc_base").rglob("*.py"):
        named |= set(re.findall(r"(?:\bmhc::|\btorch\.ops\.mhc\.)(\{?\w+)", path.read_text()))
    shared = set(_ab_previous().SHARED_OPS)
    assert named and named <= shared, named - shared
    out = tmp_path / "training.json"
    args = ["--device", "cpu", "--tiny", "--shapes", "small_gpu", "--recipes", "autocast", "--modes", "eager"]
    args += ["--rounds", "1", "--steps", "1", "--warmup", "0", "--json", str(out)]
    script = str(BENCHMARKS / "step" / "bench_training.py")
    proc = run_in_repo(sys.executable, script, *args, "--base", str(base))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (group,) = json.loads(out.read_text())["groups"]
    assert "error" not in group, group["traceback"]
    assert list(group["models"]) == ["residual", "mhc", "mhc[base]"], group
    new, old = group["models"]["mhc"], group["models"]["mhc[base]"]
    assert (new["package"], old["package"]) == ("mhc", "mhc_base")
    assert old["ms"] > 0 and old["params"] == new["params"] and "bfloat16 (autocast), base" in proc.stdout
    refused = run_in_repo(sys.executable, script, *args, "--base", str(tmp_path))
    assert refused.returncode == 2 and "holds no mhc_base" in refused.stderr, refused.stderr


def test_site_bytes_count_u_and_y_in_their_own_dtypes():
    """Under autocast with float32 weights the site's streams are bf16, u (and du) float32, y (and dy) bf16:
    common.site_kernel_bytes counts each array at its own size, and site_element_sizes reads them off the model."""
    bt = _bench_training()
    common, training_models = bt.common, sys.modules["training_models"]
    T, n, C = 16384, 4, 512
    bf16 = common.site_kernel_bytes(T, n, C, 2)
    mixed = common.site_kernel_bytes(T, n, C, 2, u_elt=4, y_elt=2)
    assert {k: mixed[k] - bf16[k] for k in bf16} == {
        "coeff_partial": 0,
        "coeff_fwd": T * C * 2,  # writes u
        "postmix_fwd": 0,
        "postmix_bwd": 0,
        "coeff_bwd": T * C * 2,  # reads du
        "stream_grad": T * C * 2,  # reads du
        "phi_grad": 0,
    }
    assert common.site_kernel_bytes(T, n, C, 2, y_elt=4)["postmix_bwd"] - bf16["postmix_bwd"] == T * 2 * C * 2
    assert common.site_stream_elements(n, C)["stream_grad"] == 3 * n * C + C

    class Model(torch.nn.Module):
        def __init__(self, dtype, stream_dtype):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4, dtype=dtype)
            self.stream_dtype = stream_dtype

        def get_input_embeddings(self):
            return self.embed

    cpu = torch.device("cpu")
    sizes = training_models.site_element_sizes
    assert sizes(Model(torch.float32, "autocast"), "autocast", cpu) == {"elt": 2, "u_elt": 4, "y_elt": 2}
    assert sizes(Model(torch.float32, "hidden"), "autocast", cpu) == {"elt": 4, "u_elt": 4, "y_elt": 2}
    assert sizes(Model(torch.bfloat16, "autocast"), "bf16", cpu) == {"elt": 2, "u_elt": 2, "y_elt": 2}
    assert sizes(Model(torch.float32, "autocast"), "float32", cpu) == {"elt": 4, "u_elt": 4, "y_elt": 4}


def _sweep_site_kernels():
    pytest.importorskip("triton")
    return _benchmark_module("site", "sweep_site_kernels")


def test_sweep_site_kernels_options_grids_and_error_bound():
    """benchmarks/site/sweep_site_kernels.py without running a kernel: bf16 keeps its shapes, kernels, grid and
    tolerance; float32 (issue #49) adds the small_gpu shape, the kernels the profile points at first, the
    PRECISION dimension of the dot kernels (tf32 on the coarse grid), the float64 reference and its error bound."""
    sw = _sweep_site_kernels()
    bf = sw.parse_args([])
    assert (
        bf.shapes == [(512, 16384), (768, 16384), (2048, 8192)]
        and bf.kernels == list(sw.KERNELS)
        and bf.precisions == ()
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
        "postmix_fwd": 36,
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

    # Against float64: 4x the plan's error, at least 1e-6, at most --tol; against the plan: --tol.
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
        # the plan runs float32 streams' dots as tf32x3 (mhc/fused/plan.py)
        ("coeff_partial", "tf32x3", True),
        ("stream_grad", "tf32x3", True),
        ("phi_grad", "tf32x3", True),
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
    proc = run_in_repo(
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


def test_boundary_kernels_match_the_pairs_they_would_replace(tmp_path):
    """benchmarks/site/boundary_sweep.py's merged boundary kernels against the two kernels each would replace, on
    masked tiles (C = 96 under 64- and 128-wide blocks, partial last token blocks): forward, site k's post-mix with
    site k+1's dot products (x' to the bit, the sums to fp32 rounding); backward, site k+1's stream_grad with site
    k's postmix_bwd (dx and dy to the bit, the sums to fp32 rounding). The interpreter on the CPU; the GPU times
    them (benchmarks/gpu_session.sh boundary)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU check of the boundary sweep (the GPU runs the script itself)")
    pytest.importorskip("triton")
    boundary_sweep = _benchmark_module("site", "boundary_sweep")
    out = tmp_path / "boundary.json"
    assert (
        boundary_sweep.main(["--device", "cpu", "--shapes", "96x40", "--limit", "1", "--json", str(out)]) == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["boundary"], r["C"], r["T"]) for r in rows] == [("forward", 96, 40), ("backward", 96, 40)]
    assert all(v["ok"] for r in rows for v in r["variants"])
    cases = {
        boundary_sweep.Forward: [
            dict(BM=16, BC=128, num_warps=4, num_stages=1, splits=1),
            dict(BM=32, BC=32, num_warps=4, num_stages=1, splits=2),  # 64 columns, then 32
            dict(BM=32, BC=32, num_warps=4, num_stages=1, splits=3),
        ],
        boundary_sweep.Backward: [
            dict(BM=16, BC=64, tokens=32, num_warps=4, num_stages=1),
            dict(BM=32, BC=32, tokens=64, num_warps=4, num_stages=1),
        ],
    }
    for boundary, params_list in cases.items():
        inp = boundary.inputs(96, 70, "cpu", seed=1)
        _, want = boundary.reference(inp)
        streams = 1 if boundary is boundary_sweep.Forward else 2  # the outputs rounded to bf16 lead
        for params in params_list:
            _, got = boundary.merged(inp, params)
            rel = boundary_sweep.errors(got, want)
            assert all(e == 0.0 for e in rel[:streams]) and all(e < 1e-6 for e in rel[streams:]), (
                params,
                rel,
            )


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA prototype of the boundary sweep needs CUDA"
)
def test_cuda_boundary_prototype_matches_the_kernels_it_would_replace(tmp_path):
    """boundary_sweep.py's CUDA prototype (benchmarks/site/boundary_dots.cuh, boundary_pipe.cuh): the dots with
    and without the post-mix, and staged by cp.async, against the plan's postmix_fwd + coeff_partial and
    coeff_partial alone, and the backward boundary against stream_grad + postmix_bwd, on masked shapes: C = 96
    (a last split of 32 columns under 64-column splits), T = 40 (a partial token tile); every variant within the
    sweep's tolerance (the bf16 outputs within a rounding, the sums within fp32's)."""
    boundary_sweep = _benchmark_module("site", "boundary_sweep")
    out = tmp_path / "boundary.json"
    names = ["forward_cuda", "dots_cuda", "forward_pipe_cuda", "dots_pipe_cuda", "backward_cuda"]
    args = ["--boundaries", ",".join(names), "--shapes", "96x40,512x200", "--json", str(out)]
    assert boundary_sweep.main([*args, "--rep", "5", "--tol", "1e-2"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["boundary"], r["C"]) for r in rows] == [(name, C) for name in names for C in (96, 512)]
    for r in rows:
        assert r["variants"] and all(v["ok"] for v in r["variants"]), r


def test_order_sweep_variants_compute_what_todays_order_does():
    """benchmarks/site/order_sweep.py's variants (every site kernel with its token blocks reversed; the passes on
    token chunks, 12 tokens a chunk at the smallest) write what today's sequences write, every output filled with
    NaN first: the reversal maps the programs onto every token once, and the chunks cover the tokens once. The
    interpreter on the CPU; the GPU times them (benchmarks/gpu_session.sh)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU check of the order sweep (the GPU runs the script itself)")
    pytest.importorskip("triton")
    order_sweep = _benchmark_module("site", "order_sweep")
    order_sweep.REVERSED = order_sweep.reversed_kernels()
    site = order_sweep.Site(32, 96, torch.device("cpu"))
    outputs = ("x", "u", "zr", "h", "R", "dx", "work", "dy", "g_h", "g_res")
    chosen = {"F fff", "F rrr", "F pre in 8 chunks", "F all in 2 chunks", "B ffff", "B rrrr", "BP rrrr"}
    chosen |= {"BP all in 4 chunks", "B pre in 8 chunks"}
    runs = {}
    for label, passes, orders, chunks, chunked in order_sweep.variants():
        if label not in chosen:
            continue
        for name in outputs:
            getattr(site, name).fill_(float("nan"))
        if label[0] == "B":  # the backward reads what the forward wrote
            order_sweep.sequence(site, order_sweep.FORWARD, "fff", 1, set())()
        order_sweep.sequence(site, passes, orders, chunks, chunked)()
        written = outputs[:5] if label[0] == "F" else outputs[5:]
        runs[label] = {name: getattr(site, name).clone() for name in written}
    assert set(runs) == chosen
    for label, got in runs.items():
        want = runs["F fff" if label[0] == "F" else "B ffff"]
        for name, value in got.items():
            assert not value.isnan().any(), (label, name)
            assert torch.equal(value, want[name]), (label, name)


def test_host_gap_times_both_steps_of_both_models(capsys):
    """benchmarks/step/host_gap.py on tiny CPU models: the loop's step and the one without a host read, for the
    residual and the mHC model, and the gap the sync exposes for each (the figures themselves come from the GPU)."""
    host_gap = _benchmark_module("step", "host_gap")
    host_gap.main(
        ["--device", "cpu", "--tiny", "--mode", "eager", "--rounds", "1", "--steps", "1", "--warmup", "0"]
    )
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (loop|no sync) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)× \|$", out, re.M)
    assert [r[0] for r in rows] == ["loop", "no sync"], out
    for _, res, mhc_ms, ratio in rows:
        assert float(res) > 0 and float(mhc_ms) > 0
        assert abs(float(ratio) - float(mhc_ms) / float(res)) < 2e-3 * float(ratio) + 1e-3
    assert re.search(r"^residual: the sync exposes -?[\d.]+ ms a step$", out, re.M), out
    assert re.search(r"^mhc: the sync exposes -?[\d.]+ ms a step$", out, re.M), out
    with pytest.raises(SystemExit):
        host_gap.main(["--device", "cpu"])  # real shapes on the CPU: refused
