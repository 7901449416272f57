"""How much of a training step is the host's, residual against mHC: ``mhc.train``'s step against one without its sync.

    python benchmarks/step/host_gap.py                       # small_gpu, fp32 weights under bf16 autocast, compiled
    python benchmarks/step/host_gap.py --shape 134m --mode eager
    python benchmarks/step/host_gap.py --device cpu --tiny --mode eager   # a check of the script, not a figure

``mhc.train``'s step reads the gradient norm and the loss on the host before the optimizer step (it skips a
step whose loss or gradient is not finite). That read waits for the GPU, and the GPU then waits while the host
runs the optimizer's Python, ``zero_grad``, the batch's copy and the compiled model's guards, until the next
forward's kernels arrive. A model with more parameter tensors (mHC adds five a site) pays more of that host time.

The steps of each model, on the same (compiled) model and optimizer, timed in interleaved rounds in one process:

* ``loop``: ``mhc.train.loop``'s body with the immediate read (``training_models.make_step(late=False)``);
* ``optimizer first`` (CUDA): the loop's step with the optimizer launched before the host read, a non-finite
  step skipped on the device (the fused AdamW's ``found_inf``), so the optimizer's Python overlaps the backward;
* ``late read`` (CUDA): ``mhc.train``'s late read (``mhc.train.loop.LateValues``): the values read a step later,
  after the next step's forward and backward are launched;
* ``no sync``: the same forward, backward, clipping, optimizer and scheduler calls with nothing read on the
  host, so the host runs ahead of the GPU (what a loop that checks the values a step late would do).

The gap between ``loop`` and ``no sync`` is the host time the sync exposes; the ``no sync`` ratio of mHC over residual is what
the ratio would be without it. On CUDA it then times the host's own time of a ``no sync`` and a ``late read``
step with the GPU kept busy (``host_only_ms``; see there for when it cannot tell), and whether the loop's
batch copy waits for queued work. A measurement for issue #49, not a path of the library.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # training_models, bench_compile
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # common
sys.path.insert(2, str(Path(__file__).resolve().parents[2]))  # this tree's mhc
import common  # noqa: E402
import torch  # noqa: E402
import training_models as tm  # noqa: E402


def direct_step(model, run, ids, device, cfg, loop_step, skip_on_device: bool):
    """The loop's calls (loss, backward, clipping, optimizer and scheduler steps) on ``loop_step``'s optimizer.

    Without ``skip_on_device`` nothing is read on the host (``no sync``). With it (``optimizer first``) the
    fused AdamW skips a non-finite step on the device, as the trainer's late read launches it
    (``LateValues.step_optimizer``), so the same steps are skipped as in the loop, and the loss and norm are
    read right after the launch.
    """
    from mhc.train.loop import LateValues, lm_loss

    optimizer, scheduler = loop_step.optimizer, loop_step.scheduler
    autocast = functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    batch = ids.cpu()  # the loop copies each batch from the host, as here
    clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(run, batch.to(device, non_blocking=True), autocast)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if not skip_on_device:
            optimizer.step()
        else:
            values = LateValues(0, 0.0, loss.detach(), gnorm, accum=1)
            values.step_optimizer(optimizer)
        scheduler.step()
        if skip_on_device:
            values.read()  # the host read, now behind the optimizer's launch

    return step


def host_only_ms(fn, reps: int = 5, sleep_cycles: int = 400_000_000) -> float:
    """Milliseconds the host spends in one call of ``fn`` while the GPU is busy elsewhere (the median of ``reps``).

    A long ``torch.cuda._sleep`` is queued first, so the call's launches queue behind it and nothing ``fn``
    waits for on the device is pending: the time to return is the host's own (Python, dispatch, guards,
    launches). Meaningful for steps that read nothing of their own on the host (``no sync``, ``late read``:
    its read is of the step before the sleep); a figure near the sleep's length means the call waited anyway.
    It also reads as the sleep when a step queues more work than the driver lets wait behind it: on an H100
    (2026-12-07) the compiled mHC steps (about 1,040 launches at small_gpu, against the residual's 750)
    came to 211-215 ms behind a 200 ms sleep at small_gpu and 134M, while the same step under
    ``torch.profiler`` took about 40 ms of host time and no op in it waited. Compare the ``no sync`` wall time
    with the step's kernel time instead: above it, the step is host-bound.
    """
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small_gpu", choices=("small_gpu", "134m", "1b"))
    ap.add_argument("--mode", default="compiled", choices=("compiled", "eager"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny models (a check on the CPU)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        common.require_cuda("host_gap.py")
    elif not args.tiny:
        ap.error("--device cpu runs only with --tiny")
    device = torch.device(args.device)
    args.init, args.compile_backend = "paper", "inductor" if args.device == "cuda" else "eager"
    plan = tm.shape_plan(args.shape, args.tiny)
    B, S = plan["batch"], plan["seq"]
    torch.manual_seed(1)
    ids = torch.randint(0, plan["vocab"], (B, S), device=device)
    cfg = tm.preset_config("mhc", batch=B, seq=S, tiny=args.tiny)
    steps = {}
    for kind in ("residual", "mhc"):
        t0 = time.perf_counter()
        model = tm.build(args.shape, kind, "autocast", device, args)
        run = tm.compile_model(model, args.compile_backend, device, cfg) if args.mode == "compiled" else model
        loop = tm.make_step(model, "autocast", run, ids, device, cfg, late=False)
        loop()  # compiles
        loop()
        steps[f"{kind} loop"] = loop
        steps[f"{kind} no sync"] = direct_step(model, run, ids, device, cfg, loop, skip_on_device=False)
        steps[f"{kind} no sync"]()
        if device.type == "cuda":  # the fused AdamW (CUDA) takes found_inf
            steps[f"{kind} optimizer first"] = direct_step(
                model, run, ids, device, cfg, loop, skip_on_device=True
            )
            steps[f"{kind} optimizer first"]()
            # the trainer's late read (LateValues), on its own optimizer
            steps[f"{kind} late read"] = tm.make_step(model, "autocast", run, ids, device, cfg, late=True)
            steps[f"{kind} late read"]()
            torch.cuda.synchronize()
        print(f"  {kind}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)

    # Wall time over a run of steps with one synchronisation at its end (common.time_run), so that a step that
    # reads nothing on the host can run ahead of the GPU; the loop's own read still waits inside each step. The
    # rounds rotate the variants' order, so that no variant always runs late in a round (at small_gpu on an
    # H100, 2026-12-07, the residual's four steps were slower the later they came in each round).
    results = common.interleaved(
        steps, rounds=args.rounds, steps=args.steps, warmup=args.warmup, runs=True, rotate=True
    )
    best = {k: m.ms for k, m in results.items()}
    rounds = {k: m.round_medians for k, m in results.items()}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"\n{args.shape} autocast {args.mode}, {name}: best of {args.rounds} interleaved rounds of {args.steps} steps (wall time)"
    )
    print("| step | residual ms | mHC ms | mHC / residual |\n|---|---|---|---|")
    for variant in ("loop", "optimizer first", "late read", "no sync"):
        if f"mhc {variant}" not in best:
            continue
        r, m = best[f"residual {variant}"], best[f"mhc {variant}"]
        print(f"| {variant} | {r:.2f} | {m:.2f} | {m / r:.3f}× |")
    print("rounds: " + "; ".join(f"{k} " + " / ".join(f"{v:.2f}" for v in r) for k, r in rounds.items()))
    for kind in ("residual", "mhc"):
        gap = best[f"{kind} loop"] - best[f"{kind} no sync"]
        print(f"{kind}: the sync exposes {gap:.2f} ms a step")
    if device.type == "cuda":
        # Is the step host-bound? The host's own time a step, the GPU kept busy meanwhile.
        for variant in ("no sync", "late read"):
            r, m = (host_only_ms(steps[f"{kind} {variant}"]) for kind in ("residual", "mhc"))
            print(f"host time of a {variant} step (GPU busy meanwhile): residual {r:.2f} ms, mHC {m:.2f} ms")
        # Does the loop's batch copy (from pageable memory) wait for queued work? (On an H100, 2026-12-07: no.)
        batch = ids.cpu()
        busy = host_only_ms(torch.cuda.synchronize)
        pageable = host_only_ms(lambda: batch.to(device, non_blocking=True))
        pinned = host_only_ms(lambda: batch.pin_memory().to(device, non_blocking=True))
        print(
            f"a batch's copy behind {busy:.1f} ms of queued GPU work: from pageable memory {pageable:.2f} ms, "
            f"pinned first {pinned:.2f} ms"
        )


if __name__ == "__main__":
    main()
