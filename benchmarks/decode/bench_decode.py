"""Greedy decoding tokens/s: the residual 134M Llama against its mHC conversion, eager and static-cache compiled.

    python benchmarks/decode/bench_decode.py                          # batch 1 and 16, modes eager and compiled
    python benchmarks/decode/bench_decode.py --batches 16 --modes compiled
    python benchmarks/decode/bench_decode.py --profile                # also the host-time profile of eager mHC decode steps
    python benchmarks/decode/bench_decode.py --modes '' --profile     # the profile alone
    python benchmarks/decode/bench_decode.py --models residual,mhc,mhc-torch   # also the fused=False site
    python benchmarks/decode/bench_decode.py --models residual,mhc,mhc-unlinked --modes eager   # A/B the fused boundaries
    python benchmarks/decode/bench_decode.py --models residual,mhc,mhc-norms --modes eager      # A/B the fused branch norms
    python benchmarks/decode/bench_decode.py --modes '' --step-times  # raw decode steps per model: host, wall, in the layers
    python benchmarks/decode/bench_decode.py --json decode.json
    python benchmarks/decode/bench_decode.py --device cpu --tiny      # a tiny Llama on the CPU: checks the logic only

Models (``--models``; default ``residual,mhc``): ``residual`` is
``LlamaForCausalLM`` with the 134M config of ``common.llama_134m`` (bf16 on
CUDA, random weights drawn from ``--seed``); ``mhc`` the same weights
converted with ``mhc.convert_to_mhc(model, n_streams=4, init="paper")`` (the
default fused site); ``mhc-unlinked`` the same with its sites unlinked
(``MHCBlock.set_next_site(None)``: each site boundary two launches, not one);
``mhc-norms`` the same with ``fuse_input_norm = False`` on every layer (each
branch runs its own input RMSNorm instead of the site's first step applying it);
``mhc-torch`` the same with ``fused=False`` (the PyTorch site, which inductor
fuses in mode ``compiled``).
Each ``generate()`` is greedy, a ``--prompt``-token random prompt (32),
exactly ``--new-tokens`` new tokens (128: ``min_new_tokens = max_new_tokens``,
no EOS). tokens/s = batch x new tokens / wall time of the whole call (its one
prefill forward included).

Modes (``--modes``, comma-separated; default ``eager,compiled``):

* ``eager``: ``generate()`` with the default dynamic KV cache;
* ``static``: ``generate(cache_implementation="static", disable_compile=True)``;
* ``compiled``: ``generate(cache_implementation="static")``, which on CUDA
  makes transformers run every decode step through
  ``torch.compile(model.__call__, **CompileConfig().to_dict())``
  (``get_compiled_call``: inductor, ``mode="reduce-overhead"``, i.e. CUDA
  graphs; ``--fullgraph``, ``--compile-mode``, ``--backend`` change it). The
  prefill runs eagerly. The script checks that the decode steps really go
  through the compiled call, and prints dynamo's graph, graph-break and
  CUDA-graph-skip counters and the graphs compiled during the timed calls
  (recompiles; should be 0). Dynamo is reset before each batch size, so
  each batch compiles its own static-shape graphs, as in a process running
  that batch alone. The compile time is the first call's wall time.

Protocol: a throw-away model first decodes at every batch size (the first
model a process runs decodes several times slower; for ``compiled`` a small
function is compiled too, the compiler's start-up); then, per mode and
batch, each model's first call (and for ``compiled`` a second) is made
untimed, and the models are timed in interleaved rounds (``--rounds``
rounds of ``--steps`` calls each); the best of a model's round medians is
kept. A variant that fails prints its traceback and the others go on.
Estimated at 2-3 minutes on an H200 at the defaults (not measured yet), most of it compiling.

``--profile`` then runs ``--profile-steps`` eager decode steps of the mHC
model after a prefill (dynamic cache, batch ``--profile-batch``, the prefill
not profiled): plainly timed (µs per step); with timing hooks on every mHC
site and on its sublayers (host time of a site call beyond its norms,
attention or MLP); under ``torch.profiler`` (ops by self CPU time, per step);
under ``cProfile`` (Python functions by own and by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import inspect
import io
import logging
import os
import pstats
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
import transformers
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import CompileConfig

import mhc
from mhc.hf.branch import is_llama_rms_norm

MODES = ("eager", "static", "compiled")
MODELS = ("residual", "mhc", "mhc-unlinked", "mhc-norms", "mhc-torch")
ROOT = Path(__file__).resolve().parents[2]
# The KV cache's keyword in this transformers' forward (transformers 5.x renamed past_key_values).
CACHE_ARG = (
    "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
)


def commit() -> str:
    """``$COMMIT`` if set (benchmarks/gpu_session.sh: a copied tree's git may be stale), else the checkout's
    commit, ``-dirty`` when tracked files differ from it."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tiny_llama(seq: int) -> LlamaConfig:
    """A 2-layer Llama (hidden 32, vocabulary 97) for checking the script on a CPU."""
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=seq,
    )


def build(name: str, cfg: LlamaConfig, device: str, dtype: torch.dtype, seed: int):
    """The residual Llama drawn from ``seed`` (``name="residual"``), or its mHC conversion (``"mhc"``; ``"mhc-unlinked"``
    with its sites unlinked; ``"mhc-norms"`` with the branch norms unfused; ``"mhc-torch"`` with ``fused=False``),
    in eval mode."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(device, dtype)
    if name != "residual":
        model = mhc.convert_to_mhc(model, n_streams=4, init="paper", fused=name != "mhc-torch")
        if name == "mhc-unlinked":
            for site in (m for m in model.modules() if isinstance(m, mhc.MHCBlock)):
                site.set_next_site(None)
        if name == "mhc-norms":
            for layer in model.decoder_layers():
                layer.fuse_input_norm = False
    model.generation_config.eos_token_id = None  # every call decodes exactly --new-tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class CompiledCallSpy:
    """Wraps ``model.get_compiled_call`` so that the calls made through the compiled forward are counted."""

    def __init__(self, model):
        self.calls = 0
        self._original = model.get_compiled_call
        model.get_compiled_call = self._wrapped

    def _wrapped(self, compile_config):
        compiled = self._original(compile_config)

        def counted(*args, **kwargs):
            self.calls += 1
            return compiled(*args, **kwargs)

        return counted


class CudagraphSkips(logging.Handler):
    """Collects the reasons inductor logs (torch's "cudagraphs" log) when it runs a CUDA graph without CUDA graphs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []
        logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage()[:300])


def dynamo_counts(skips: CudagraphSkips) -> dict:
    breaks = dict(counters["graph_break"])
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(breaks.values()),
        "break_reasons": {k[:300]: v for k, v in list(breaks.items())[:5]},
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraph_skip_reasons": skips.reasons[:5],
    }


def generate_call(model, ids: torch.Tensor, mode: str, new_tokens: int, compile_config: CompileConfig):
    """A function running one greedy ``generate()`` of ``mode``; it checks the output's length."""
    kwargs = {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
    }
    if mode == "static":
        kwargs.update(cache_implementation="static", disable_compile=True)
    elif mode == "compiled":
        kwargs.update(cache_implementation="static", compile_config=compile_config)

    def run() -> torch.Tensor:
        out = model.generate(ids, **kwargs)
        if out.shape != (ids.shape[0], ids.shape[1] + new_tokens):
            raise RuntimeError(
                f"generate() returned shape {tuple(out.shape)}, expected "
                f"{(ids.shape[0], ids.shape[1] + new_tokens)}"
            )
        return out

    return run


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def measure(calls: dict, tokens: int, rounds: int, steps: int, device: str) -> dict:
    """Interleaved rounds of ``steps`` timed calls of each of ``calls``; tokens/s is the best round median.
    A variant whose call raises is reported (traceback) and dropped; the others go on."""
    out = {name: {"round_medians": [], "seconds": []} for name in calls}
    live = dict(calls)
    for _ in range(rounds):
        for name, fn in list(live.items()):
            try:
                seconds = [timed(fn, device) for _ in range(steps)]
            except Exception:
                print(f"  {name}: failed while timed:", flush=True)
                traceback.print_exc()
                out[name]["error"] = traceback.format_exc(limit=3)
                del live[name]
                continue
            out[name]["seconds"].append(seconds)
            out[name]["round_medians"].append(tokens / statistics.median(seconds))
    for row in out.values():
        row["tok_s"] = max(row["round_medians"]) if row["round_medians"] else None
    return out


def run_mode(
    mode: str, batch: int, models: dict, spies: dict, skips: CudagraphSkips, args, cfg, compile_config
) -> dict:
    """Untimed first calls of each model (compile, for ``compiled``), then the interleaved timing."""
    ids = torch.randint(
        3, cfg.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(batch)
    )
    ids = ids.to(args.device)
    if mode == "compiled":
        torch._dynamo.reset()  # each batch size compiles its own graphs
    calls, info = {}, {}
    for name, model in models.items():
        fn = generate_call(model, ids, mode, args.new_tokens, compile_config)
        row = info[name] = {}
        try:
            if mode == "compiled":
                counters.clear()
                skips.reasons = []
                spy = spies[name]
                spy.calls = 0
                row["first_call_s"] = timed(fn, args.device)
                row["second_call_s"] = timed(fn, args.device)
                row["compiled_calls"] = spy.calls
                row["decode_steps"] = 2 * (args.new_tokens - 1)
                row["dynamo"] = dynamo_counts(skips)
            else:
                row["first_call_s"] = timed(fn, args.device)
        except Exception:
            print(f"  {mode} batch {batch} {name}: failed:", flush=True)
            traceback.print_exc()
            row["error"] = traceback.format_exc(limit=3)
            continue
        calls[name] = fn
        text = f"  {mode:8} batch {batch:3} {name:8} first call {row['first_call_s']:7.2f} s"
        if mode == "compiled":
            d = row["dynamo"]
            took = row["compiled_calls"] == row["decode_steps"] and d["graphs"] > 0
            row["took_compiled_path"] = took
            text += (
                f"  compiled path: {'yes' if took else 'NO'} ({row['compiled_calls']} of "
                f"{row['decode_steps']} decode steps through get_compiled_call); graphs {d['graphs']}, "
                f"graph breaks {d['graph_breaks']}, cudagraph skips {d['cudagraph_skips']}"
            )
            for reason, count in d["break_reasons"].items():
                text += f"\n      break x{count}: {reason}"
            for reason in d["cudagraph_skip_reasons"]:
                text += f"\n      no CUDA graph: {reason}"
        print(text, flush=True)
    graphs_before = counters["stats"]["unique_graphs"]
    for spy in spies.values():
        spy.calls = 0
    timing = measure(calls, batch * args.new_tokens, args.rounds, args.steps, args.device)
    recompiles = counters["stats"]["unique_graphs"] - graphs_before
    for name, row in timing.items():
        info[name].update(row)
        if mode == "compiled":
            info[name]["graphs_compiled_while_timed"] = recompiles  # all models together
            info[name]["compiled_calls_while_timed"] = spies[name].calls
    if mode == "compiled" and calls:
        print(
            f"  compiled batch {batch}: graphs compiled while timed (all models): {recompiles}; decode steps "
            "through the compiled call while timed: " + ", ".join(f"{n} {spies[n].calls}" for n in calls),
            flush=True,
        )
    return info


def warm_up(cfg, args, dtype, compile_config: CompileConfig) -> None:
    """A throw-away residual model decodes once at each batch size; with mode ``compiled``, a small function is
    compiled first, so that the compiler's one-time start-up is not counted in the first model's compile time."""
    t0 = time.perf_counter()
    try:
        if "compiled" in args.modes:
            options = {"backend": compile_config.backend, "mode": compile_config.mode}
            x = torch.ones(64, device=args.device)
            torch.compile(lambda t: torch.nn.functional.silu(t) * 2 + 1, **options)(x)
            sync(args.device)
            torch._dynamo.reset()
        model = build("residual", cfg, args.device, dtype, seed=args.seed + 1)
        for batch in args.batches:
            ids = torch.randint(3, cfg.vocab_size, (batch, args.prompt), device=args.device)
            generate_call(model, ids, "eager", args.new_tokens, None)()
        del model
    except Exception:
        print("  warm-up failed:", flush=True)
        traceback.print_exc()
    print(f"  warm-up: {time.perf_counter() - t0:.1f} s", flush=True)


def decoder(model, batch: int, steps: int, args, cfg):
    """``prefill()`` runs a fresh prompt's forward (dynamic cache) and returns a function running ``steps``
    eager greedy decode steps from there, synchronised at the end."""
    ids = torch.randint(3, cfg.vocab_size, (batch, args.prompt), device=args.device)

    @torch.no_grad()
    def prefill():
        out = model(input_ids=ids, use_cache=True)
        sync(args.device)

        @torch.no_grad()
        def decode():
            nonlocal out
            for _ in range(steps):
                token = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=token, use_cache=True, **{CACHE_ARG: out[CACHE_ARG]})
            sync(args.device)

        return decode

    return prefill


def step_times(models: dict, args, cfg, rounds: int = 3) -> dict:
    """Per batch and model, interleaved, best of ``rounds``: the prefill's wall time, and the mean host time
    (until the forward returns) and wall time (after a sync, as ``generate()`` syncs every step) of
    ``--profile-steps`` raw eager decode steps (dynamic cache, no ``generate()`` around them)."""
    table: dict = {}
    for batch in args.batches:
        ids = torch.randint(3, cfg.vocab_size, (batch, args.prompt), device=args.device)
        rows = table[batch] = {name: {"prefill_ms": [], "host_us": [], "wall_us": []} for name in models}
        for _ in range(rounds):
            for name, model in models.items():
                with torch.no_grad():
                    sync(args.device)
                    t0 = time.perf_counter()
                    out = model(input_ids=ids, use_cache=True)
                    sync(args.device)
                    rows[name]["prefill_ms"].append((time.perf_counter() - t0) * 1e3)
                    host = wall = 0.0
                    for _ in range(args.profile_steps):
                        t0 = time.perf_counter()
                        token = out.logits[:, -1:].argmax(-1)
                        out = model(input_ids=token, use_cache=True, **{CACHE_ARG: out[CACHE_ARG]})
                        t1 = time.perf_counter()
                        sync(args.device)
                        host += t1 - t0
                        wall += time.perf_counter() - t0
                rows[name]["host_us"].append(host * 1e6 / args.profile_steps)
                rows[name]["wall_us"].append(wall * 1e6 / args.profile_steps)
        print(
            f"\nRaw eager decode steps, batch {batch} (best of {rounds} interleaved rounds of "
            f"{args.profile_steps} steps; a sync after every step)"
        )
        print(f"  {'model':12} {'prefill ms':>11} {'host µs':>9} {'wall µs':>9} {'wall x residual':>16}")
        base = min(rows["residual"]["wall_us"]) if "residual" in rows else None
        for name, row in rows.items():
            best = {k: min(v) for k, v in row.items()}
            ratio = f"{best['wall_us'] / base:16.3f}" if base else f"{'-':>16}"
            print(
                f"  {name:12} {best['prefill_ms']:11.2f} {best['host_us']:9.0f} {best['wall_us']:9.0f} {ratio}"
            )
            row.update({f"best_{k}": v for k, v in best.items()})
        print(
            "  host µs a step inside the decoder layers (timing hooks, one more round): the layers, their"
            " attention and MLP, and the rest (each layer's own glue: its norms, residual adds or mHC sites)"
        )
        for name, model in models.items():
            split = layer_host_split(model, ids, args.profile_steps, args.device)
            rows[name]["layer_host_us"] = split
            print(
                f"  {name:12} layers {split['layers']:7.0f}  sublayers {split['sublayers']:7.0f}  "
                f"rest {split['layers'] - split['sublayers']:7.0f}  ({split['layer_calls']:.0f} layer calls a step)"
            )
    return table


def layer_host_split(model, ids: torch.Tensor, steps: int, device: str) -> dict:
    """Host µs a raw decode step spent in the decoder layers and in their attention / MLP children (forward
    hooks on each, timed_children); the norms' time counts in the rest."""
    layers = list(model.decoder_layers()) if hasattr(model, "decoder_layers") else list(model.model.layers)
    inner = timed_children(layers)
    totals: dict = {}
    handles = timing_hooks({"layers": layers, "sublayers": inner}, totals)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            sync(device)
            totals.update(dict.fromkeys(totals, 0))
            for _ in range(steps):
                token = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=token, use_cache=True, **{CACHE_ARG: out[CACHE_ARG]})
                sync(device)
    finally:
        for h in handles:
            h.remove()
    return {
        "layers": totals["layers"] * 1e6 / steps,
        "sublayers": totals["sublayers"] * 1e6 / steps,
        "layer_calls": totals["layers_calls"] / steps,
    }


def timed_children(layers) -> list:
    """The decoder layers' attention and MLP children: neither mHC sites nor Llama-style norms. A hooked norm
    is not fused into an mHC site's first step (mhc.hf.branch.is_llama_rms_norm), so the norms stay unhooked."""
    return [
        c
        for layer in layers
        for c in layer.children()
        if not isinstance(c, mhc.MHCBlock) and not is_llama_rms_norm(c)
    ]


def timing_hooks(groups: dict[str, list], totals: dict) -> list:
    """Forward hooks on every module of ``groups`` (name -> modules) adding its host time to ``totals[name]``
    (seconds) and its calls to ``totals[name + "_calls"]``; returns the hook handles."""
    starts: dict[int, float] = {}
    handles = []
    for kind, modules in groups.items():
        totals.update({kind: 0.0, kind + "_calls": 0})
        for m in modules:

            def pre(module, args):
                starts[id(module)] = time.perf_counter()

            def post(module, args, output, kind=kind):
                totals[kind] += time.perf_counter() - starts.pop(id(module))
                totals[kind + "_calls"] += 1

            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return handles


def site_host_times(model, prefill, steps: int) -> dict:
    """Host µs per decode step: the whole step, all mHC sites, their attention and MLP, and per site call the
    difference (the site's own work and its branch's norm; norms unhooked, as in layer_host_split)."""
    sites = [m for m in model.modules() if isinstance(m, mhc.MHCBlock)]
    inner = timed_children(model.decoder_layers())
    totals: dict = {}
    handles = timing_hooks({"site": sites, "sublayer": inner}, totals)
    try:
        prefill()()  # warm, with the hooks
        decode = prefill()
        totals.update(site=0.0, sublayer=0.0)
        t0 = time.perf_counter()
        decode()
        wall = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    per_step = 1e6 / steps
    return {
        "step_us": wall * per_step,
        "sites_us": totals["site"] * per_step,
        "sublayers_us": totals["sublayer"] * per_step,
        "sites_per_step": len(sites),
        "site_overhead_us_per_call": (totals["site"] - totals["sublayer"]) * per_step / len(sites),
    }


def profile(model, args, cfg) -> dict:
    """The three host-time views of ``--profile-steps`` eager mHC decode steps (printed; returned for the JSON)."""
    steps, batch = args.profile_steps, args.profile_batch
    prefill = decoder(model, batch, steps, args, cfg)
    prefill()()
    decode = prefill()
    t0 = time.perf_counter()
    decode()
    step_us = (time.perf_counter() - t0) * 1e6 / steps
    hooks = site_host_times(model, prefill, steps)
    print(
        f"\nEager mHC decode, batch {batch}, {steps} steps after a prefill: {step_us:.0f} µs per step. With timing "
        f"hooks: {hooks['step_us']:.0f} µs per step, its {hooks['sites_per_step']} sites {hooks['sites_us']:.0f} "
        "µs "
        f"of which their sublayers (norms, attention, MLP) {hooks['sublayers_us']:.0f} µs: "
        f"{hooks['site_overhead_us_per_call']:.1f} µs host time per site call beyond its sublayers"
    )

    kinds = torch.profiler.ProfilerActivity
    activities = [kinds.CPU, kinds.CUDA] if args.device == "cuda" else [kinds.CPU]
    decode = prefill()
    with torch.profiler.profile(activities=activities) as prof:
        decode()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[
        : args.profile_top
    ]
    print(f"\ntorch.profiler, {steps} decode steps: top {len(events)} ops by self CPU time, per step")
    print(f"  {'op':60} {'calls':>7} {'self CPU µs':>12} {'CPU total µs':>13}")
    ops = []
    for e in events:
        row = {
            "op": e.key,
            "calls": e.count / steps,
            "self_cpu_us": e.self_cpu_time_total / steps,
            "cpu_total_us": e.cpu_time_total / steps,
        }
        ops.append(row)
        print(f"  {e.key[:60]:60} {row['calls']:7.1f} {row['self_cpu_us']:12.1f} {row['cpu_total_us']:13.1f}")
    kernels = sorted(
        (e for e in prof.key_averages() if e.self_device_time_total > 0),
        key=lambda e: e.self_device_time_total,
        reverse=True,
    )
    gpu_us = sum(e.self_device_time_total for e in kernels) / steps
    print(
        f"\nGPU kernels, {steps} decode steps: {gpu_us:.0f} µs of kernel time per step (a step whose kernels take "
        "far less than its wall time waits on the host); top by device time, per step"
    )
    print(f"  {'kernel':60} {'calls':>7} {'device µs':>10} {'µs a call':>10}")
    for e in kernels[: args.profile_top]:
        per_step = e.self_device_time_total / steps
        print(
            f"  {e.key[:60]:60} {e.count / steps:7.1f} {per_step:10.1f} {e.self_device_time_total / e.count:10.2f}"
        )

    decode = prefill()
    profiler = cProfile.Profile()
    profiler.runcall(decode)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(args.profile_top)
    stats.sort_stats("cumulative").print_stats(args.profile_top)
    print(f"\ncProfile of {steps} decode steps (totals, not per step):")
    print(text.getvalue())
    return {
        "batch": batch,
        "steps": steps,
        "step_us": step_us,
        "hooks": hooks,
        "ops": ops,
        "gpu_kernels_us": gpu_us,
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default 1,16)")
    ap.add_argument("--modes", default="eager,compiled", help="comma-separated, from: " + ", ".join(MODES))
    ap.add_argument(
        "--models",
        default="residual,mhc",
        help="comma-separated, from: residual, mhc, mhc-unlinked, mhc-norms, mhc-torch (fused=False) "
        "(default residual,mhc)",
    )
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32; --tiny 8)")
    ap.add_argument(
        "--new-tokens", type=int, default=None, help="tokens decoded per call (default 128; --tiny 6)"
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds, the best median kept (default 2)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed generate() calls per round (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer hidden-32 Llama instead of the 134M one")
    ap.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor; on the CPU eager)"
    )
    ap.add_argument(
        "--compile-mode",
        default="reduce-overhead",
        help="torch.compile mode for the inductor backend (default reduce-overhead, transformers')",
    )
    ap.add_argument(
        "--fullgraph", action="store_true", help="compile with fullgraph=True (a graph break fails)"
    )
    ap.add_argument("--profile", action="store_true", help="profile eager mHC decode steps (see above)")
    ap.add_argument(
        "--step-times",
        action="store_true",
        help="also every model's prefill and raw decode step (host and wall), at each --batches",
    )
    ap.add_argument("--profile-batch", type=int, default=1, help="batch of the profiled decode (default 1)")
    ap.add_argument("--profile-steps", type=int, default=10, help="decode steps profiled (default 10)")
    ap.add_argument("--profile-top", type=int, default=30, help="rows of each profile table (default 30)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = ap.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batches takes comma-separated integers, got {args.batches!r}")
    for option, known in (("modes", MODES), ("models", MODELS)):
        chosen = [m.strip() for m in getattr(args, option).split(",") if m.strip()]
        unknown = [m for m in chosen if m not in known]
        if unknown:
            ap.error(f"unknown --{option} {unknown}; choose from {known}")
        setattr(args, option, chosen)
    args.prompt = (8 if args.tiny else 32) if args.prompt is None else args.prompt
    args.new_tokens = (6 if args.tiny else 128) if args.new_tokens is None else args.new_tokens
    for name in ("prompt", "new_tokens", "rounds", "steps", "profile_batch", "profile_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.batches or min(args.batches) < 1:
        ap.error("--batches must name batch sizes >= 1")
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "eager")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        common.require_cuda("bench_decode.py")
    start = time.perf_counter()
    env = common.environment()
    env.update(transformers=transformers.__version__, commit=commit())
    now = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"# {now:%Y-%m-%d %H:%M UTC}  {env['device']}  torch {env['torch']}  transformers {env['transformers']}  "
        f"commit {env['commit']}\n# command: python {' '.join(sys.argv)}",
        flush=True,
    )
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    seq = args.prompt + args.new_tokens
    cfg = tiny_llama(seq) if args.tiny else common.llama_134m(seq)
    compile_config = CompileConfig(
        fullgraph=args.fullgraph,
        backend=args.backend,
        mode=args.compile_mode if args.backend == "inductor" else None,
    )
    if args.device != "cuda":
        compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    print(f"  compile config (mode compiled): {compile_config.to_dict()}", flush=True)

    warm_up(cfg, args, dtype, compile_config)
    models = {}
    for name in args.models:
        try:
            models[name] = build(name, cfg, args.device, dtype, args.seed)
        except Exception:
            print(f"  building {name} failed:", flush=True)
            traceback.print_exc()
    spies = {name: CompiledCallSpy(model) for name, model in models.items()}
    skips = CudagraphSkips()
    results = {}
    for mode in args.modes:
        for batch in args.batches:
            try:
                results[f"{mode} {batch}"] = run_mode(
                    mode, batch, models, spies, skips, args, cfg, compile_config
                )
            except Exception:
                print(f"  {mode} batch {batch}: failed:", flush=True)
                traceback.print_exc()

    print(
        f"\nGreedy decode, {'tiny Llama' if args.tiny else 'Llama 134M'}, {str(dtype)[6:]}, prompt {args.prompt}, "
        f"{args.new_tokens} new tokens; tok/s = batch x new tokens / generate() wall time, best of "
        f"{args.rounds} interleaved medians of {args.steps}"
    )
    print(
        f"  {'mode':9} {'batch':>5} {'model':12} {'tok/s':>9} {'x residual':>11} {'first call s':>13}   "
        "round medians (tok/s)"
    )
    for key, info in results.items():
        mode, batch = key.split()
        residual = info.get("residual", {}).get("tok_s")
        for name, row in info.items():
            value = row.get("tok_s")
            row["x_residual"] = value / residual if value and residual else None
            ratio = f"{row['x_residual']:11.3f}" if row["x_residual"] else f"{'-':>11}"
            first = f"{row['first_call_s']:13.2f}" if "first_call_s" in row else f"{'-':>13}"
            medians = " ".join(f"{v:.1f}" for v in row.get("round_medians", []))
            value_text = f"{value:9.1f}" if value else f"{'failed':>9}"
            print(f"  {mode:9} {batch:>5} {name:12} {value_text} {ratio} {first}   {medians}")

    figures = {"environment": env, "args": {k: v for k, v in vars(args).items()}, "results": results}
    profiled = next((n for n in models if n != "residual"), None)
    if args.step_times and models:
        try:
            figures["step_times"] = step_times(models, args, cfg)
        except Exception:
            print("  step times failed:", flush=True)
            traceback.print_exc()
    if args.profile and profiled is not None:
        try:
            print(f"\nprofiling {profiled}", flush=True)
            figures["profile"] = profile(models[profiled], args, cfg)
        except Exception:
            print("  profile failed:", flush=True)
            traceback.print_exc()
    print(f"\ntotal {time.perf_counter() - start:.0f} s", flush=True)
    if args.json:
        common.write_json(args.json, figures)


if __name__ == "__main__":
    main()
