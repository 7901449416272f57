"""Host time, wall time and GPU kernel time of the 134M Llama training step (CUDA).

    python benchmarks/step/profile_step.py                         # batch 8 x seq 2048, as bench_block.py
    python benchmarks/step/profile_step.py --batch 1 --seq 128      # tiny batch: the step's pure host cost
    python benchmarks/step/profile_step.py --timeline               # also where in the step the GPU waits
    python benchmarks/step/profile_step.py --steps 30               # also 30 steps one by one
    python benchmarks/step/profile_step.py --compile                # both models under torch.compile(fullgraph=True)
    python benchmarks/step/profile_step.py --keep-streams-every 5   # also the mHC model with keep_streams_every=5
    python benchmarks/step/profile_step.py --host-table             # also where the host's time goes, and its syncs

For the residual model and ``convert_to_mhc(n_streams=4)`` of it (the model of
``benchmarks/site/bench_block.py``, bf16, AdamW fused): the median over 5 steps of the
host time (until the step's Python code returns, before a sync) and of the
wall time (after the sync), and the sum of the CUDA kernel times of one more
step under ``torch.profiler``, then the fused site's kernels with their bandwidth over a device
copy's (each kernel's bytes at its floor). A step whose host time approaches its GPU time
may be host-bound; the host also waits when the launch queue fills, so that
alone does not show it (``--timeline`` does). With a tiny batch the GPU never holds the host back, so the
host time is what the Python side of a step costs on this machine. For the
mHC model the table of its largest kernels follows.

``--compile`` compiles each model's forward first
(``model.forward = torch.compile(model.forward, fullgraph=True)``, as
``bench_compile.py`` does; the warm-up steps compile) and prints the kernel
table of both models, to compare what inductor made of each.

``--steps N`` times N more steps one by one, after the timed ones and before
the profiled one. For each it gives the GPU time of the step and of its forward
(CUDA events), and the host time of both (until their Python code returns). When the
forward's GPU time exceeds its host time by only the loss's kernels
(2.5-4.5 ms for this model on the H200), the GPU waited on the host
through the layers. Where the host's speed drifts from step to step, those are the slow steps.

``--host-table`` runs one more step under ``torch.profiler`` with CPU
activity and prints its ops by self CPU time (autograd nodes, our custom
Functions' forward and backward, launches), then one more with
``torch.cuda.set_sync_debug_mode("warn")`` and counts the host-device syncs
it reports, by message. A step whose host time exceeds the sum of its parts
here waited on the GPU somewhere.

``--recipe autocast`` profiles instead the step of ``bench_training.py``'s autocast recipe
(``benchmarks/step/training_models.py``: float32 weights under bf16 autocast, ``mhc.train``'s loop
body with its two host syncs) for ``--shape`` (134m, 1b or small_gpu, at that shape's batch x seq; the
mHC model's streams per ``--stream-dtype``, default the library's; ``--compile`` compiles as
``mhc.train`` does). ``--steps`` needs the default recipe (its step marks the forward's end);
``--timeline`` and ``--host-table`` take both (``--timeline`` not compiled: its hooks are on the
layers). ``--mhc-only`` skips the residual model.

``--timeline`` follows one more step: at the start of each decoder layer's
forward and backward, and at the end of the forward (with the loss), of the
backward and of the optimizer step, it prints when the host enqueued that point and when the GPU
reached it, both from the step's start. Where the GPU arrives right after the
host (a lag near zero), the GPU waited for the host: that stretch is
host-bound. A growing lag means the host runs ahead and the GPU sets the pace.
The hooks add a little host time of their own.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument(
        "--timeline", action="store_true", help="also host and GPU times at each layer of one step"
    )
    ap.add_argument(
        "--steps", type=int, default=0, help="also list this many steps one by one (GPU and host ms)"
    )
    ap.add_argument(
        "--compile", action="store_true", help="compile both models (fullgraph); both kernel tables"
    )
    ap.add_argument(
        "--keep-streams-every",
        type=int,
        default=0,
        metavar="K",
        help="also the mHC model with keep_streams_every=K, with its kernel table (default: not run)",
    )
    ap.add_argument(
        "--host-table",
        action="store_true",
        help="also one step's ops by self CPU time, and the syncs of one step",
    )
    ap.add_argument(
        "--recipe",
        choices=("bf16", "autocast"),
        default="bf16",
        help="bf16: the model cast to bf16 (default); autocast: bench_training.py's autocast step",
    )
    ap.add_argument(
        "--shape", choices=("134m", "1b", "small_gpu"), default="134m", help="with --recipe autocast"
    )
    ap.add_argument(
        "--stream-dtype",
        choices=("autocast", "hidden"),
        default=None,
        help="with --recipe autocast: the mHC model's MHCConfig.stream_dtype (default: the library's)",
    )
    ap.add_argument(
        "--mhc-only", action="store_true", help="profile the mHC model only, not the residual one"
    )
    args = ap.parse_args()
    if args.recipe == "autocast" and (
        args.steps or args.keep_streams_every or (args.compile and args.timeline)
    ):
        ap.error(
            "--recipe autocast takes --timeline, --host-table and --compile (not with --timeline); "
            "not --steps or --keep-streams-every"
        )
    common.require_cuda("profile_step.py")
    if args.recipe == "autocast":
        import training_models  # benchmarks/step/, this script's folder

        plan = training_models.shape_plan(args.shape, tiny=False)
        args.batch, args.seq, hidden, vocab = plan["batch"], plan["seq"], plan["hidden"], plan["vocab"]
    else:
        cfg = common.llama_134m(max(2048, args.seq))
        hidden, vocab = cfg.hidden_size, cfg.vocab_size

    copy = common.copy_gbps()
    print(
        f"device copy: {copy:.0f} GB/s; recipe {args.recipe}"
        + (f", {args.shape}" if args.recipe != "bf16" else "")
    )
    models = [("residual", None, {}), ("mhc n=4 fused", 4, {"init": "paper"})][1 if args.mhc_only else 0 :]
    if args.keep_streams_every:
        k = args.keep_streams_every
        models.append((f"mhc n=4 keep {k}", 4, {"init": "paper", "keep_streams_every": k}))
    for name, streams, options in models:
        ids = torch.randint(0, vocab, (args.batch, args.seq), device="cuda")
        if args.recipe == "autocast":
            model, step = autocast_step(args, "mhc" if streams else "residual", ids)
        else:
            model = common.llama_model(cfg, streams, **options) if streams else common.llama_model(cfg)
            if args.compile:
                model.forward = torch.compile(model.forward, fullgraph=True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def step(mark=lambda label: None):
                loss = model(input_ids=ids, labels=ids).loss
                mark("forward done")
                loss.backward()
                mark("backward done")
                opt.step()
                opt.zero_grad(set_to_none=True)
                mark("optimizer done")

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        hosts, walls = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            hosts.append(t1 - t0)
            walls.append(time.perf_counter() - t0)
        # Listed before the profiler runs, so that it cannot disturb them.
        listed = per_step(step, args.steps) if args.steps else None
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        print(
            f"{name:14} host {1e3 * sorted(hosts)[2]:7.2f} ms  wall {1e3 * sorted(walls)[2]:7.2f} ms  "
            f"GPU kernels {gpu:7.2f} ms"
        )
        if listed:
            print(f"{name}: one line per step, ms")
            print(listed)
        if args.host_table:
            print(f"{name}: one step's host time by op (torch.profiler, CPU)")
            print(host_table(step))
            print(f"{name}: {sync_report(step)}")
        if args.timeline:
            print(f"{name}: host enqueue and GPU arrival, ms from the step's start")
            print(timeline(model, step))
        if name != "residual" or args.compile:
            print(
                prof.key_averages().table(
                    sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70
                )
            )
        if streams:
            sizes = training_models.site_element_sizes(model, args.recipe, ids.device)
            print(site_kernel_table(prof.key_averages(), args.batch * args.seq, streams, hidden, copy, sizes))
        model = opt = step = None  # freed (the step closures above read these names)
        torch.cuda.empty_cache()


def autocast_step(args, kind: str, ids):
    """``(model, step(mark))``: ``kind``'s model of ``args.shape`` and bench_training.py's autocast-recipe step."""
    import types

    import training_models

    options = types.SimpleNamespace(init="paper", tiny=False)
    model = training_models.build(args.shape, kind, "autocast", ids.device, options, args.stream_dtype)
    cfg = training_models.preset_config("mhc", batch=args.batch, seq=args.seq, init="paper", tiny=False)
    # --compile: as mhc.train compiles (torch.compile of the model, default mode); the warm-up steps compile
    run = training_models.compile_model(model, "inductor", ids.device, cfg) if args.compile else model
    inner = training_models.make_step(model, "autocast", run, ids, ids.device, cfg)

    def step(mark=lambda label: None):
        inner()
        mark("optimizer done")

    return model, step


def site_kernel_table(averages, T: int, n: int, C: int, copy: float, sizes: dict[str, int]) -> str:
    """The fused site's kernels in one profiled step: µs per call and bandwidth over a device copy's.

    Bytes are :func:`common.site_kernel_bytes` with the element sizes ``sizes`` (``elt``, ``u_elt``,
    ``y_elt``, ``training_models.site_element_sizes``), each array counted once: what the kernel must move, so ``× copy``
    is how near it runs to the memory floor (issue #22 asks 0.85).
    """
    rows = common.kernel_bandwidth_rows(averages, common.site_kernel_bytes(T, n, C, **sizes), copy)
    lines = [
        f"site kernels, {T} tokens, n={n}, C={C}, bytes at their floor; device copy {copy:.0f} GB/s",
        f"  {'kernel':12} {'calls':>5} {'µs/call':>8} {'GB/s':>7} {'x copy':>6}",
    ]
    lines += [f"  {k:12} {c:5d} {us:8.1f} {g:7.0f} {x:6.2f}" for k, c, us, g, x in rows]
    return "\n".join(lines)


def host_table(step, rows: int = 30) -> str:
    """One ``step()`` under ``torch.profiler`` (CPU): its ops sorted by self CPU time."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70)


def sync_report(step) -> str:
    """The host-device syncs of one ``step()``, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them."""
    torch.cuda.synchronize()
    # Switched on outside the recording: switching warns once per process that the mode is a
    # prototype, which is no sync of the step's.
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    messages = collections.Counter(str(w.message).splitlines()[0][:120] for w in caught)
    if not messages:
        return "0 syncs in one step"
    return f"{sum(messages.values())} syncs in one step:\n" + "\n".join(
        f"  {c:4d} x {m}" for m, c in messages.most_common()
    )


def _marker(marks: list):
    """A ``mark(label)`` that appends ``(label, host time, recorded CUDA event)`` to ``marks``."""

    def mark(label):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((label, time.perf_counter(), event))

    return mark


def per_step(step, steps: int) -> str:
    """``steps`` calls of ``step(mark)`` as lines of GPU and host ms, for the step and its forward."""
    lines = [f"  {'GPU step':>8} {'host step':>9} {'GPU fwd':>8} {'host fwd':>8}"]
    for _ in range(steps):
        marks = []
        mark = _marker(marks)
        torch.cuda.synchronize()
        mark("start")
        step(mark)
        torch.cuda.synchronize()
        at = {label: (host, event) for label, host, event in marks}
        (h0, e0), (hf, ef), (hs, es) = at["start"], at["forward done"], at["optimizer done"]
        lines.append(
            f"  {e0.elapsed_time(es):8.1f} {1e3 * (hs - h0):9.1f} {e0.elapsed_time(ef):8.1f} {1e3 * (hf - h0):8.1f}"
        )
    return "\n".join(lines)


def timeline(model, step) -> str:
    """One ``step(mark)``'s marks as lines of ``label, host ms, GPU ms, GPU - host``."""
    layers = next(
        m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)
    )
    marks = []
    mark = _marker(marks)

    def on_forward(i):
        return lambda module, args: mark(f"fwd {i}")

    def on_output(i):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if out.requires_grad:  # its gradient arrives as the layer's backward starts
                out.register_hook(lambda grad: mark(f"bwd {i}"))

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles += [layer.register_forward_pre_hook(on_forward(i)), layer.register_forward_hook(on_output(i))]
    try:
        torch.cuda.synchronize()
        mark("start")
        step(mark)
        torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    _, host0, event0 = marks[0]
    lines = [f"  {'mark':15} {'host':>8} {'GPU':>8} {'GPU-host':>9}"]
    for label, host, event in marks:
        host_ms, gpu_ms = 1e3 * (host - host0), event0.elapsed_time(event)
        lines.append(f"  {label:15} {host_ms:8.2f} {gpu_ms:8.2f} {gpu_ms - host_ms:9.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
