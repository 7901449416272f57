"""Where ``bench_decode.py``'s eager decode steps spend host time: ``--step-times`` (raw decode steps per model,
their host and wall time, and the host time inside the decoder layers: :func:`step_times`,
:func:`layer_host_split`) and ``--profile`` (the mHC model's steps with timing hooks on its sites, under
``torch.profiler`` and under ``cProfile``: :func:`profile`, :func:`site_host_times`); the forward hooks they time
with (:func:`timing_hooks` on :func:`timed_children`), and the decode loop and device sync they share."""

from __future__ import annotations

import cProfile
import inspect
import io
import pstats
import time

import torch
from transformers import LlamaForCausalLM

import mhc
from mhc.hf.branch import is_llama_rms_norm

# The KV cache's keyword in this transformers' forward (transformers 5.x renamed past_key_values).
CACHE_ARG = (
    "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


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
