"""The fused site's C++ path against its Python path, in one process (CUDA).

    python scripts/bench_site_paths.py            # 6 rounds
    python scripts/bench_site_paths.py 10         # 10 rounds

Once a shape's kernels are compiled, :mod:`mhc.fused` runs a site's two
autograd nodes in C++ (``csrc/site.cu``); under a Triton launch hook,
``torch.compile`` or functorch it runs them in Python. This script switches
between the two by replacing ``mhc.fused._native_allowed``, and prints:

* the host time of one ``MHCBlock`` call (identity branch, n=4, C=768, 128
  tokens, no sync in the loop), forward and forward+backward, alternating the
  two paths twice;
* the 134M Llama training step of ``scripts/bench_block.py`` (batch 8 x 2048,
  bf16, fused AdamW) for the residual model, the mHC model on the C++ path and
  a second mHC model on the Python path, interleaved: each round runs 6 steps
  of each (the first round's first 3 are warm-up). The host's speed on the
  H200 machine drifts over seconds, so interleaving gives each model the same
  share of slow stretches. Per model: the median and mean step (CUDA events),
  the medians of the forward's GPU time and of the host time of the forward
  and of the rest of the step, then every step and every host forward.
"""

import statistics as st
import sys
import time

import torch

import mhc
from bench_block import llama_134m
from mhc import fused

_cpp_allowed = fused._native_allowed


def use_cpp_site(on: bool) -> None:
    fused._native_allowed = _cpp_allowed if on else (lambda: False)


def host_us(fn, iters: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def block_host_time() -> None:
    n, C, T = 4, 768, 128
    x = torch.randn(T, n, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block = mhc.MHCBlock(torch.nn.Identity(), C, n, init="paper").cuda()

    def fwd_bwd():
        block(x).sum().backward()

    for on in (False, True, False, True):
        use_cpp_site(on)
        print(f"C++ site={on}: MHCBlock fwd {host_us(lambda: block(x)):6.1f} us, "
              f"fwd+bwd {host_us(fwd_bwd, 200):6.1f} us", flush=True)


def model_steps(rounds: int) -> None:
    from transformers import LlamaForCausalLM

    cfg = llama_134m()
    ids = torch.randint(0, cfg.vocab_size, (8, 2048), device="cuda")

    def make(kind):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
        if kind != "residual":
            model = mhc.convert_to_mhc(model, n_streams=4, init="paper")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    models = {kind: make(kind) for kind in ("residual", "fused-cpp", "fused-python")}
    rows = {kind: [] for kind in models}
    for rnd in range(rounds):
        for kind, (model, opt) in models.items():
            use_cpp_site(kind == "fused-cpp")
            for i in range(6):
                torch.cuda.synchronize()
                start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                t0 = time.perf_counter()
                start.record()
                loss = model(input_ids=ids, labels=ids).loss
                mid.record()
                t1 = time.perf_counter()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                end.record()
                t2 = time.perf_counter()
                torch.cuda.synchronize()
                if rnd > 0 or i >= 3:
                    gpu_step, gpu_fwd = start.elapsed_time(end), start.elapsed_time(mid)
                    rows[kind].append((gpu_step, gpu_fwd, 1e3 * (t1 - t0), 1e3 * (t2 - t1)))
    base = st.median(r[0] for r in rows["residual"])
    print("model: median step / ratio / mean step / GPU fwd / host fwd / host bwd+opt (ms), per-step list")
    for kind, r in rows.items():
        med = st.median(x[0] for x in r)
        print(f"  {kind:13} {med:7.2f} {med / base:6.3f}x  mean {st.mean(x[0] for x in r):7.2f}  "
              f"gfwd {st.median(x[1] for x in r):6.2f} hfwd {st.median(x[2] for x in r):6.2f} "
              f"hbwd {st.median(x[3] for x in r):6.2f}")
        print("    steps:", " ".join(f"{x[0]:.1f}" for x in r))
        print("    hfwd: ", " ".join(f"{x[2]:.1f}" for x in r))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("bench_site_paths.py needs a CUDA device")
    block_host_time()
    model_steps(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
