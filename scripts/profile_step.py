"""Host time, wall time and GPU kernel time of the 134M Llama training step (CUDA).

    python scripts/profile_step.py                         # batch 8 x seq 2048, as bench_block.py
    python scripts/profile_step.py --batch 1 --seq 128      # tiny batch: the step's pure host cost

For the residual model and ``convert_to_mhc(n_streams=4)`` of it (the model of
``scripts/bench_block.py``, bf16, AdamW fused): the median over 5 steps of the
host time (until the step's Python code returns, before a sync) and of the
wall time (after the sync), and the sum of the CUDA kernel times of one more
step under ``torch.profiler``. A step whose host time approaches its GPU time
is host-bound. With a tiny batch the GPU never holds the host back, so the
host time is what the Python side of a step costs on this machine. For the
mHC model the table of its largest kernels follows.
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
        if name != "residual":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
        del model, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
