"""What a training step costs with mHC against the residual model: the source of the README's training-cost table (CUDA).

    python benchmarks/step/bench_training.py --json out.json --commit $(git rev-parse --short HEAD)
    python benchmarks/step/bench_training.py --shapes 1b --recipes autocast --modes compiled --kernels
    python benchmarks/step/bench_training.py --recipes autocast --stream-dtypes autocast,hidden   # fp32 streams too
    python benchmarks/step/bench_training.py --base ab_base --shapes small_gpu --modes compiled  # A/B, ab_previous.py
    python benchmarks/step/bench_training.py --dry-run                    # the plan: groups, models, recipes
    python benchmarks/step/bench_training.py --device cpu --tiny --modes eager --json /tmp/t.json   # CPU check

On the GPU machine, as the stage ``training`` of ``benchmarks/gpu_session.sh`` (every group, with
``--kernels``, in one process under ``timeout 560``; ``TRAINING_ARGS`` adds options), after the stage ``setup``
in a call of its own (setup and 560 s do not fit in one 10-minute call)::

    COMMIT=<sha> bash benchmarks/gpu_session.sh setup
    COMMIT=<sha> bash benchmarks/gpu_session.sh training          # $OUT/training.json and training.log
    COMMIT=<sha> TRAINING_ARGS="--shapes small_gpu,134m" bash benchmarks/gpu_session.sh training   # or in two calls:
    COMMIT=<sha> TRAINING_ARGS="--shapes 1b" bash benchmarks/gpu_session.sh training

The six compiled groups' twelve compilations take about 7 minutes of the 560 s on the H200 (``notes/compile.md``: 27-54 s
each), so the two-call form is the safe one.

Every group is one ``(shape, recipe, mode)``: the residual model and the mHC model
(``n_streams=4``, ``init="paper"`` unless ``--init``, the default fused site) are
built afresh (with ``--stream-dtypes autocast,hidden``, one mHC model per
``MHCConfig.stream_dtype`` setting, ``mhc`` and ``mhc[hidden]``, all timed in
the same rounds; without autocast the two settings are one, so the ``bf16``
recipe runs only the first) for it on the device, each runs one warm-up step (compiled: the
first step compiles and is timed alone as the compile time, then one more),
then their steps are timed in interleaved rounds in this one process
(``common.interleaved``: ``--rounds`` rounds of ``--warmup`` untimed and ``--steps``
timed steps each, the best of the round medians kept), then each step's peak
memory (``common.step_peak_memory``), then with ``--kernels`` the fused site's
kernels over ``--kernel-steps`` steps under ``torch.profiler``. The models are
freed (and dynamo reset) before the next group. The JSON is rewritten after
every group, so a run cut short keeps the groups it finished.

Shapes (``--shapes``; these three options take comma-separated names, run in the order given):

* ``small_gpu``: the preset ``small_gpu_{residual,mhc}`` (``mhc/train/presets/``) of
  ``scripts/train_lm.py`` / ``scripts/compare.py``, built as ``mhc.train``
  builds it (``build_model``: ``MHCForCausalLM`` over a Llama config, the
  residual one too, with ``mode="residual", n_streams=1``; vocabulary 8192,
  the preset's BPE), batch 32 x 512; the mHC model gets
  ``mhc_options.init`` = ``--init`` (the preset itself trains from
  ``"identity"``, whose ``φ = 0`` gives every token the same ``H_res`` until
  training moves it: ``"paper"`` is nearer a trained step);
* ``134m``: ``common.llama_134m`` (``LlamaForCausalLM``, and
  ``convert_to_mhc`` of it), batch 8 x 2048;
* ``1b``: ``bench_compile.llama_1b`` (1.1B, GQA 32/4), batch 4 x 2048.

Recipes (``--recipes``):

* ``bf16``: the model cast wholly to bf16 (the mHC coefficients stay float32, as
  ``MHCForCausalLM.to`` keeps them), the step of ``bench_compile.py``
  (``common.training_step``: ``model(input_ids, labels=ids).loss``, backward,
  fused AdamW at lr 1e-4, ``zero_grad``);
* ``autocast``: float32 weights under ``torch.autocast("cuda", torch.bfloat16)``,
  the step of ``mhc.train``'s loop, through its own functions:
  ``optimizer.zero_grad(set_to_none=True)``; ``mhc.train.loop.forward_backward``
  (``lm_loss``: the forward under autocast with ``use_cache=False``, the float32
  cross-entropy outside it, backward, ``clip_grad_norm_`` at the preset's
  ``grad_clip`` 1.0, and the two host syncs of ``float(gnorm)`` and
  ``float(loss)``); ``optimizer.step()`` when both are finite;
  ``scheduler.step()``. The optimizer is ``mhc.train.model.build_optimizer``'s:
  fused AdamW over the two parameter groups (no decay on mHC coefficients and
  1-D parameters) with the preset's lr, betas, eps and weight decay, and its
  warmup + cosine schedule. The batch is copied to the device every step from
  the CPU, as the loop does. Not included: the loop's logging, tqdm and spike
  tracking (host work of microseconds).

Modes (``--modes``): ``eager``, and ``compiled``: ``torch.compile`` of the whole
model as ``mhc.train`` does it (``mhc.train.distributed.wrap_model`` for one
process: ``torch.compile(model)``, default mode, no ``fullgraph``); both
recipes run it the same way. ``--compile-backend`` other than ``inductor``
(``eager``, ``aot_eager``) is for checking the script without a GPU.

Reported per group: step ms and tokens/s of each model, mHC/residual; peak
memory (GB) of each step (parameters and optimizer state plus the step's
peak above what was allocated before it, gradients included: they are freed
first) and the ratio; compile seconds and dynamo's graphs and graph breaks.
With ``--kernels``: each fused site kernel's µs per call and bandwidth
against a device copy, bytes from ``common.site_kernel_bytes`` with the
element size of the streams (the embedding's dtype under the model's
``stream_dtype``: 2 bytes under ``bf16``; under ``autocast`` 2 with the default
``autocast``, 4 with ``hidden``, whose streams are float32), the site kernels'
share of the step's kernel time, the residual step's kernel time (profiled
the same way) and the non-site kernels that take most more time in the mHC
step than in the residual one (casts, norms, copies around the sites). A markdown table is printed at the end;
``--json PATH`` writes everything, with ``common.environment()``, the date and
``--commit`` (default: ``git rev-parse`` where there is a ``.git``).

``--device cpu --tiny`` runs every path on tiny models on the CPU (the
reference site, not the fused kernels; host timers; no peak memory) to
check the script; ``--dry-run`` prints the plan and runs nothing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
import torch._dynamo
from training_models import (  # noqa: E402  (benchmarks/step/, this script's folder)
    N_STREAMS,
    build,
    compile_model,
    count_parameters,
    make_step,
    preset_config,
    shape_plan,
    site_element_sizes,
    streams_dtype,
)

from mhc.streams import DEFAULT_STREAM_DTYPE, STREAM_DTYPES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHAPES = ("small_gpu", "134m", "1b")
RECIPES = ("bf16", "autocast")
MODES = ("eager", "compiled")


def model_kinds(recipe: str, stream_dtypes: list[str], base: bool = False) -> dict[str, str]:
    """The models of a group, name -> ``MHCConfig.stream_dtype``: the residual model, then one mHC model per
    ``--stream-dtypes`` entry, the first named ``mhc`` and the others ``mhc[<setting>]``. In the ``bf16`` recipe
    (no autocast) every setting keeps the hidden state's dtype, so only the first is run. With ``base``
    (``--base``), last ``mhc[base]``: the first setting's model built by the earlier commit's package."""
    kinds = {"residual": "hidden"}
    for setting in stream_dtypes[:1] if recipe == "bf16" else stream_dtypes:
        kinds["mhc" if len(kinds) == 1 else f"mhc[{setting}]"] = setting
    if base:
        kinds["mhc[base]"] = stream_dtypes[0]
    return kinds


# --------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------


def _choices(text: str, allowed: tuple[str, ...], flag: str, ap: argparse.ArgumentParser) -> list[str]:
    """Comma-separated ``text`` as a list in the order given, each once; unknown or no names end the parser."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in names if t not in allowed]
    if unknown or not names:
        ap.error(
            f"{flag}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; choose from {','.join(allowed)}"
        )
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated, of {','.join(SHAPES)} (default all)"
    )
    ap.add_argument(
        "--recipes", default=",".join(RECIPES), help=f"comma-separated, of {','.join(RECIPES)} (default all)"
    )
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)} (default all)"
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds, the best median kept (default 2)"
    )
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    ap.add_argument(
        "--runs",
        action="store_true",
        help="time each round's steps as one run, synchronised once at its end (common.time_run), instead of "
        "step by step: for a loop that reads nothing on the host between steps",
    )
    ap.add_argument(
        "--late",
        action="store_true",
        help="the autocast step reads its loss and gradient norm a step late, as mhc.train's loop does on one "
        "CUDA device with the fused AdamW (mhc.train.loop.LateValues); needs --runs, which alone shows the gain",
    )
    ap.add_argument(
        "--warmup", type=int, default=3, help="untimed steps before each round's timed ones (default 3)"
    )
    ap.add_argument(
        "--init", choices=("paper", "identity"), default="paper", help="the mHC models' init (default paper)"
    )
    ap.add_argument(
        "--stream-dtypes",
        default=DEFAULT_STREAM_DTYPE,
        help=f"comma-separated MHCConfig.stream_dtype settings, of {','.join(STREAM_DTYPES)}: one mHC model each, "
        f"timed in the same rounds (default {DEFAULT_STREAM_DTYPE}, the library's default)",
    )
    ap.add_argument(
        "--base",
        type=Path,
        metavar="DIR",
        help="also an mHC model built by an earlier commit's package, DIR/mhc_base (made by "
        "benchmarks/step/ab_previous.py --make-base COMMIT DIR), timed in the same rounds as mhc[base]: the "
        "A/B of a change in one process. The two commits' CUDA extension sources must agree",
    )
    ap.add_argument(
        "--kernels", action="store_true", help="also the fused site kernels' time and bandwidth (CUDA)"
    )
    ap.add_argument("--kernel-steps", type=int, default=3, help="steps profiled for --kernels (default 3)")
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend (default inductor, as mhc.train; eager or aot_eager to check on a CPU)",
    )
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny)")
    ap.add_argument(
        "--tiny", action="store_true", help="tiny models and batches of every shape (a check, not a figure)"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument(
        "--json", metavar="PATH", help="write every figure, the settings and the environment to PATH"
    )
    ap.add_argument(
        "--commit", default=None, help="the commit measured (default: git rev-parse, else 'unknown')"
    )
    args = ap.parse_args(argv)
    args.shapes = _choices(args.shapes, SHAPES, "--shapes", ap)
    args.recipes = _choices(args.recipes, RECIPES, "--recipes", ap)
    args.modes = _choices(args.modes, MODES, "--modes", ap)
    args.stream_dtypes = _choices(args.stream_dtypes, STREAM_DTYPES, "--stream-dtypes", ap)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.kernel_steps < 1:
        ap.error("need --rounds >= 1, --steps >= 1, --warmup >= 0, --kernel-steps >= 1")
    if args.late and not args.runs:
        ap.error(
            "--late needs --runs: timed step by step, every step waits for the GPU and the late read gains nothing"
        )
    if args.base is not None and not (args.base / "mhc_base").is_dir():
        ap.error(f"--base: {args.base} holds no mhc_base; make it with ab_previous.py --make-base COMMIT DIR")
    if args.device not in ("cuda", "cpu"):
        ap.error(f"--device must be cuda or cpu, got {args.device!r}")
    if args.device == "cpu" and not args.tiny and not args.dry_run:
        ap.error("--device cpu runs only with --tiny (or --dry-run): the real shapes are for the GPU")
    if args.kernels and args.device != "cuda" and not args.dry_run:
        ap.error("--kernels profiles CUDA kernels: it needs --device cuda")
    return args


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------


def _host_time_calls(fn, steps: int, warmup: int = 0) -> list[float]:
    """``common.time_calls`` on the CPU: milliseconds of each call by the host's clock."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory(model, step, device: torch.device) -> dict:
    """``common.step_peak_memory`` with the model's gradients freed first, so that the step's peak includes them
    (the autocast step, like mhc.train's loop, frees them at its start, not its end). CPU: resident bytes only."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        return common.step_peak_memory(model, step)
    state = [t for s in step.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *state])
    step()
    return {"resident_gb": resident / 1e9, "peak_gb": None}


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
    }


def profiled_kernels(step, steps: int):
    """``torch.profiler``'s ``key_averages()`` of ``steps`` calls of ``step`` (CUDA activity only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages()


def kernel_ms(averages, steps: int) -> dict[str, float]:
    """``{kernel name: ms per step}`` of every kernel with device time in ``averages``."""
    return {e.key: e.self_device_time_total / steps / 1e3 for e in averages if e.self_device_time_total > 0}


def extra_kernels(
    mhc_ms: dict[str, float], residual_ms: dict[str, float], site: set[str], top: int = 12
) -> list:
    """The non-site kernels that take most more time per step in the mHC step than in the residual one.

    ``[(name, mHC ms, residual ms)]``, largest difference first; what the step costs beyond the site kernels
    (casts, norms, reductions, copies the site's neighbours make). Names are cut to 120 characters.
    """
    rows = [
        (name[:120], ms, residual_ms.get(name, 0.0))
        for name, ms in mhc_ms.items()
        if not any(name == k or name.startswith(k + "_") for k in site)
    ]
    rows.sort(key=lambda r: r[2] - r[1])
    return [r for r in rows[:top] if r[1] - r[2] > 0.005]


def kernel_figures(averages, steps: int, T: int, C: int, sizes: dict[str, int], copy: float) -> dict:
    """Per fused site kernel of ``averages`` (``steps`` steps profiled): calls per step, µs per call, GB/s and that
    over a device copy's (``common.kernel_bandwidth_rows``, bytes from ``common.site_kernel_bytes`` with the
    element sizes ``sizes``, ``training_models.site_element_sizes``); and the site kernels' milliseconds per step,
    against all kernels'."""
    rows = common.kernel_bandwidth_rows(averages, common.site_kernel_bytes(T, N_STREAMS, C, **sizes), copy)
    all_us = sum(e.self_device_time_total for e in averages)
    site_us = sum(calls * us for _, calls, us, _, _ in rows)
    return {
        "tokens": T,
        "n": N_STREAMS,
        "C": C,
        "stream_bytes": sizes["elt"],
        "u_bytes": sizes["u_elt"],
        "y_bytes": sizes["y_elt"],
        "copy_gbps": copy,
        "profiled_steps": steps,
        "kernels": [
            {"kernel": k, "calls_per_step": calls / steps, "us_per_call": us, "gbps": gbps, "x_copy": x}
            for k, calls, us, gbps, x in rows
        ],
        "site_ms_per_step": site_us / steps / 1e3,
        "kernel_ms_per_step": all_us / steps / 1e3,
        "site_share": site_us / all_us if all_us else None,
    }


def free(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_group(
    shape: str, recipe: str, mode: str, args, device: torch.device, copy: float | None, log
) -> dict:
    """Build both models, warm up (compile), time them interleaved, measure memory (and kernels); the group's figures."""
    plan = shape_plan(shape, args.tiny, args.init)
    B, S = plan["batch"], plan["seq"]
    torch.manual_seed(1)
    ids = torch.randint(0, plan["vocab"], (B, S), device=device)
    cfg = preset_config(
        "mhc", batch=B, seq=S, init=args.init, tiny=args.tiny
    )  # the autocast step's optimizer settings
    from torch._dynamo.utils import counters

    kinds = model_kinds(recipe, args.stream_dtypes, args.base is not None)
    models, steps, figures = {}, {}, {}
    for kind, setting in kinds.items():
        t0 = time.perf_counter()
        package = "mhc_base" if kind == "mhc[base]" else "mhc"
        model = build(
            shape, "residual" if kind == "residual" else "mhc", recipe, device, args, setting, package
        )
        run = compile_model(model, args.compile_backend, device, cfg) if mode == "compiled" else model
        step = make_step(model, recipe, run, ids, device, cfg, late=args.late and recipe == "autocast")
        models[kind], steps[kind] = model, step
        synchronize(device)
        built_s = time.perf_counter() - t0
        counters.clear()
        t0 = time.perf_counter()
        step()  # the warm-up step; compiled: it compiles forward and backward
        synchronize(device)
        first_s = time.perf_counter() - t0
        step()
        synchronize(device)
        figures[kind] = {
            "params": count_parameters(model),
            "build_s": built_s,
            "first_step_s": first_s,
            "stream_setting": setting,
            "stream_dtype": str(streams_dtype(model, recipe, device)),
            "package": package,
        }
        if mode == "compiled":
            figures[kind]["compile_s"] = first_s
            figures[kind]["dynamo"] = dynamo_counts()
        log(
            f"  {kind:8} {figures[kind]['params'] / 1e6:8.1f}M params, {figures[kind]['stream_dtype']} streams, "
            f"built {built_s:5.1f} s, first step {first_s:6.1f} s"
            + (f", dynamo {figures[kind]['dynamo']}" if mode == "compiled" else "")
        )

    log(f"  timing: {args.rounds} interleaved rounds of {args.warmup} + {args.steps} steps each")
    graphs_before = counters["stats"]["unique_graphs"]
    results = common.interleaved(
        steps, rounds=args.rounds, steps=args.steps, warmup=args.warmup, runs=args.runs
    )
    recompiled = counters["stats"]["unique_graphs"] - graphs_before
    for kind in kinds:
        m = results[kind]
        figures[kind].update(
            ms=m.ms, tokens_per_s=B * S / (m.ms / 1e3), round_medians=m.round_medians, times=m.times
        )
        figures[kind].update(peak_memory(models[kind], steps[kind], device))
    mhc_kinds = [k for k in kinds if k != "residual"]
    kernels = {}
    if args.kernels:
        # The residual step's kernels too: what the mHC step spends beyond its site kernels, and where.
        residual_ms = kernel_ms(profiled_kernels(steps["residual"], args.kernel_steps), args.kernel_steps)
        for kind in mhc_kinds:
            sizes = site_element_sizes(models[kind], recipe, device)
            averages = profiled_kernels(steps[kind], args.kernel_steps)
            k = kernel_figures(averages, args.kernel_steps, B * S, plan["hidden"], sizes, copy)
            k["residual_kernel_ms_per_step"] = sum(residual_ms.values())
            site = set(common.site_kernel_bytes(B * S, N_STREAMS, plan["hidden"]))
            k["extra_kernels"] = extra_kernels(kernel_ms(averages, args.kernel_steps), residual_ms, site)
            kernels[kind] = k
    for kind in kinds:
        figures[kind]["skipped_steps"] = steps[kind].counts["skipped"]
        figures[kind]["steps_run"] = steps[kind].counts["steps"] if recipe == "autocast" else None
    res = figures["residual"]
    ratios = {
        kind: {
            "ms": figures[kind]["ms"] / res["ms"],
            "peak": figures[kind]["peak_gb"] / res["peak_gb"] if res["peak_gb"] else None,
        }
        for kind in mhc_kinds
    }
    group = {
        "shape": shape,
        "recipe": recipe,
        "mode": mode,
        "batch": B,
        "seq": S,
        "tokens_per_step": B * S,
        "models": figures,
        "ratio_ms": ratios["mhc"]["ms"],  # the first mHC model's (the others': "ratios")
        "ratio_peak": ratios["mhc"]["peak"],
        "ratios": ratios,
        "recompiled_while_timing": recompiled if mode == "compiled" else None,
        "kernels": kernels.get("mhc"),
        "other_kernels": {k: v for k, v in kernels.items() if k != "mhc"},
    }
    del models, steps, model, run, step
    return group


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _f(value, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def _mhc_kinds(g: dict) -> list[str]:
    return [k for k in g["models"] if k != "residual"]


def _streams(figures: dict) -> str:
    """``float32`` / ``bfloat16 (autocast)``: the streams' dtype, and the setting when it is not ``hidden``."""
    dtype = figures.get("stream_dtype", "?").replace("torch.", "")
    setting = figures.get("stream_setting", "hidden")
    text = dtype if setting == "hidden" else f"{dtype} ({setting})"
    return f"{text}, base" if figures.get("package") == "mhc_base" else text


def table(groups: list[dict]) -> str:
    """The markdown table of the groups, a row per mHC model (those that failed: their error)."""
    lines = [
        "| shape | recipe | mode | mHC streams | tokens/step | residual ms | mHC ms | mHC/res | residual tok/s "
        "| mHC tok/s | residual peak GB | mHC peak GB | peak mHC/res | compile s (res / mHC) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        head = f"| {g['shape']} | {g['recipe']} | {g['mode']} |"
        if "error" in g:
            lines.append(f"{head} failed: {g['error'][:200]} |" + " |" * 10)
            continue
        r = g["models"]["residual"]
        for kind in _mhc_kinds(g):
            m = g["models"][kind]
            ratio = g.get("ratios", {}).get(kind, {"ms": g["ratio_ms"], "peak": g["ratio_peak"]})
            compile_s = f"{r['compile_s']:.1f} / {m['compile_s']:.1f}" if g["mode"] == "compiled" else "—"
            lines.append(
                f"{head} {_streams(m)} | {g['tokens_per_step']:,} | {r['ms']:.2f} | {m['ms']:.2f} "
                f"| {ratio['ms']:.3f}× | {r['tokens_per_s']:,.0f} | {m['tokens_per_s']:,.0f} "
                f"| {_f(r['peak_gb'], '.2f')} | {_f(m['peak_gb'], '.2f')} "
                f"| {_f(ratio['peak'], '.3f', '—')}{'×' if ratio['peak'] else ''} | {compile_s} |"
            )
    return "\n".join(lines)


def kernel_tables(g: dict) -> list[str]:
    """A :func:`kernel_table` per mHC model of ``g`` that has kernel figures."""
    found = {"mhc": g.get("kernels"), **(g.get("other_kernels") or {})}
    return [kernel_table(g, kind) for kind, k in found.items() if k]


def kernel_table(g: dict, kind: str = "mhc") -> str:
    """The fused site kernels of one mHC model of a group as a markdown table, with a line on their total."""
    k = g["kernels"] if kind == "mhc" else g["other_kernels"][kind]
    lines = [
        f"site kernels of the {kind} step, {g['shape']} {g['recipe']} {g['mode']}: {k['tokens']} tokens, n={k['n']}, "
        f"C={k['C']}, {k['stream_bytes']}-byte streams, {k['u_bytes']}-byte u, {k['y_bytes']}-byte y, "
        f"bytes at their floor; device copy {k['copy_gbps']:.0f} GB/s",
        "",
        "| kernel | calls/step | µs/call | GB/s | × copy |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['kernel']} | {r['calls_per_step']:g} | {r['us_per_call']:.1f} | {r['gbps']:.0f} | {r['x_copy']:.2f} |"
        for r in k["kernels"]
    ]
    share = _f(None if k["site_share"] is None else 100 * k["site_share"], ".1f")
    lines.append(
        f"\nsite kernels {k['site_ms_per_step']:.2f} ms of {k['kernel_ms_per_step']:.2f} ms kernel time "
        f"per step ({share} %), over {k['profiled_steps']} profiled steps"
    )
    if k.get("residual_kernel_ms_per_step") is not None:
        res = k["residual_kernel_ms_per_step"]
        other = k["kernel_ms_per_step"] - k["site_ms_per_step"] - res
        lines.append(
            f"residual step's kernel time {res:.2f} ms: the mHC step's other kernels take {other:+.2f} ms more; "
            "most more:\n\n| kernel | mHC ms/step | residual ms/step |\n|---|---|---|"
        )
        lines += [f"| `{name}` | {m:.3f} | {r:.3f} |" for name, m, r in k.get("extra_kernels", [])]
    return "\n".join(lines)


def group_line(g: dict) -> str:
    """One finished group in a line (progress)."""
    if "error" in g:
        return f"[{g['shape']} {g['recipe']} {g['mode']}] FAILED: {g['error'][:500]}"
    medians = lambda f: "/".join(f"{x:.2f}" for x in f["round_medians"])  # noqa: E731
    r = g["models"]["residual"]
    parts = [f"[{g['shape']} {g['recipe']} {g['mode']}] residual {r['ms']:.2f} ms ({medians(r)})"]
    for kind in _mhc_kinds(g):
        m = g["models"][kind]
        ratio = g.get("ratios", {}).get(kind, {"ms": g["ratio_ms"], "peak": g["ratio_peak"]})
        parts.append(
            f"{'mHC' if kind == 'mhc' else kind} {m['ms']:.2f} ms ({medians(m)}): {ratio['ms']:.3f}x, "
            f"peak {_f(m['peak_gb'], '.2f')} GB ({_f(ratio['peak'], '.3f')}x)"
        )
    skipped = [g["models"][k]["skipped_steps"] for k in g["models"]]
    return (
        ", ".join(parts)
        + f"; residual peak {_f(r['peak_gb'], '.2f')} GB"
        + (f"; skipped steps {'/'.join(map(str, skipped))}" if any(skipped) else "")
    )


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def header(args, argv: list[str]) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "benchmark": "benchmarks/step/bench_training.py",
        "command": "python benchmarks/step/bench_training.py " + " ".join(argv),
        "date": now.date().isoformat(),
        "time_utc": now.isoformat(timespec="seconds"),
        "commit": args.commit or git_commit(),
        "environment": common.environment(),
        "settings": {
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "timing": "runs of steps, one synchronisation each" if args.runs else "step by step",
            "autocast_host_read": "a step late" if args.late else "every step, before the optimizer",
            "n_streams": N_STREAMS,
            "init": args.init,
            "compile": f"torch.compile(model) (mhc.train.distributed.wrap_model), backend "
            f"{args.compile_backend}",
            "device": args.device,
            "tiny": args.tiny,
            "shapes": args.shapes,
            "recipes": args.recipes,
            "modes": args.modes,
            "stream_dtypes": args.stream_dtypes,
            "kernels": args.kernels,
        },
        "shapes": {s: shape_plan(s, args.tiny, args.init) for s in args.shapes},
    }


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the groups and print the table; the exit status is 1 when a group failed (its traceback is
    printed and its row says why), else 0."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    log = functools.partial(print, flush=True)
    report = header(args, argv)
    groups = [(s, r, m) for s in args.shapes for r in args.recipes for m in args.modes]
    env = report["environment"]
    log(f"{env['device']}, torch {env['torch']}, commit {report['commit']}, mhc: {env['mhc']}")
    for s in args.shapes:
        p = report["shapes"][s]
        log(
            f"  {s}: hidden {p['hidden']}, {p['layers']} layers, heads {p['heads']}/{p['kv_heads']}, intermediate "
            f"{p['intermediate']}, vocab {p['vocab']}; batch {p['batch']} x {p['seq']}; {p['built']}"
        )
    log(f"{len(groups)} groups (shape, recipe, mode): " + ", ".join(" ".join(g) for g in groups))
    if args.dry_run:
        log("dry run: nothing built or measured")
        return 0
    if args.device == "cuda":
        common.require_cuda("bench_training.py")
    else:  # host timers instead of CUDA events, for the CPU check
        common.time_calls = _host_time_calls
    device = torch.device(args.device)
    if args.base is not None:
        from ab_previous import use_base  # (benchmarks/step/, this script's folder)

        use_base(args.base)
    # Every group compiles its two models afresh (dynamo is reset between groups); keep dynamo from falling back to
    # eager on a code object it has compiled often.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    copy = common.copy_gbps() if args.kernels else None
    if copy:
        log(f"device copy: {copy:.0f} GB/s")
    report["copy_gbps"], report["groups"], report["complete"] = copy, [], False
    for shape, recipe, mode in groups:
        t0 = time.perf_counter()
        log(f"[{shape} {recipe} {mode}] building")
        try:
            group = run_group(shape, recipe, mode, args, device, copy, log)
        except Exception as err:  # reported and left out, so that the other groups still run
            group = {
                "shape": shape,
                "recipe": recipe,
                "mode": mode,
                "error": f"{type(err).__name__}: {str(err)[:2000]}",
                "traceback": traceback.format_exc()[-4000:],
            }
            log(group["traceback"])
        free(device)
        group["group_s"] = time.perf_counter() - t0
        report["groups"].append(group)
        left = (
            f", {torch.cuda.memory_allocated() / 1e9:.2f} GB still allocated" if device.type == "cuda" else ""
        )
        log(group_line(group) + f"  [{group['group_s']:.0f} s{left}]")
        for text in kernel_tables(group):
            log(text)
        if args.json:
            common.write_json(args.json, report)
    report["complete"] = True
    log(
        f"\ntraining step (forward, loss, backward, optimizer), best of {args.rounds} interleaved "
        f"{'runs' if args.runs else 'medians'} of {args.steps}{', late read' if args.late else ''}; commit {report['commit']}, {report['date']}, {report['environment']['device']}"
    )
    log(table(report["groups"]))
    for g in report["groups"]:
        for text in kernel_tables(g):
            log("\n" + text)
    if args.json:
        common.write_json(args.json, report)
        log(f"wrote {args.json}")
    failed = [f"{g['shape']} {g['recipe']} {g['mode']}" for g in report["groups"] if "error" in g]
    if failed:
        log(f"failed groups: {', '.join(failed)} (their tracebacks are above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
