"""Host time, wall time and GPU kernel time of the 134M Llama training step (CUDA).

    python scripts/profile_step.py                         # batch 8 x seq 2048, as bench_block.py
    python scripts/profile_step.py --batch 1 --seq 128      # tiny batch: the step's pure host cost
    python scripts/profile_step.py --phases                 # also the forward and the backward apart

For the residual model and ``convert_to_mhc(n_streams=4)`` of it (the model of
``scripts/bench_block.py``, bf16, AdamW fused): the median over 5 steps of the
host time (until the step's Python code returns, before a sync) and of the
wall time (after the sync), and the sum of the CUDA kernel times of one more
step under ``torch.profiler``. A step whose host time approaches its GPU time
is host-bound. With a tiny batch the GPU never holds the host back, so the
host time is what the Python side of a step costs on this machine. For the
mHC model the table of its largest kernels follows.

``--phases`` also times the forward and the backward apart, each queued
behind a GPU sleep (``torch.cuda._sleep``), so that the host enqueues the
whole phase before the GPU starts it: the host time is then the phase's
Python and launch cost, and the CUDA-event time its kernels back to back. A
phase whose host time exceeds its GPU time starves the GPU when a step starts
from an empty queue (as it does here, after each step's synchronisation).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import mhc
from bench_block import llama_134m


def main() -> None:
    from transformers import LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--phases", action="store_true", help="also time the forward and the backward apart")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py needs a CUDA device")
    cfg = llama_134m(max(2048, args.seq))

    def fresh():
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)

    for name, make in (("residual", fresh), ("mhc n=4 fused", lambda: mhc.convert_to_mhc(fresh(), n_streams=4, init="paper"))):
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

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
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        gpu = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        print(f"{name:14} host {1e3 * sorted(hosts)[2]:7.2f} ms  wall {1e3 * sorted(walls)[2]:7.2f} ms  "
              f"GPU kernels {gpu:7.2f} ms")
        if args.phases:
            print(f"{name:14} {phase_times(model, ids)}")
            opt.zero_grad(set_to_none=True)
        if name != "residual":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
        del model, opt
        torch.cuda.empty_cache()


def phase_times(model, ids, repeats: int = 3) -> str:
    """Host and GPU ms of the forward (with the loss) and of the backward, medians of ``repeats``."""
    times = {"forward": [], "backward": []}
    for _ in range(repeats):
        loss = None
        for phase in times:
            torch.cuda.synchronize()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
            torch.cuda._sleep(1 << 30)  # ~0.5 s: longer than the host needs to enqueue a phase
            marks[1].record()
            t0 = time.perf_counter()
            if phase == "forward":
                loss = model(input_ids=ids, labels=ids).loss
            else:
                loss.backward()
            host = 1e3 * (time.perf_counter() - t0)
            marks[2].record()
            torch.cuda.synchronize()
            # If the launch queue filled up, the host waited for the sleep and its time is not the phase's.
            waited = host > marks[0].elapsed_time(marks[1])
            times[phase].append((host, marks[1].elapsed_time(marks[2]), waited))
    parts = []
    for phase, runs in times.items():
        host, gpu = (sorted(r[i] for r in runs)[len(runs) // 2] for i in (0, 1))
        flag = " (host waited on a full launch queue)" if any(r[2] for r in runs) else ""
        parts.append(f"{phase}: host {host:7.2f} ms, GPU {gpu:7.2f} ms{flag}")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
