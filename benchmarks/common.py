"""What the benchmark scripts share: CUDA-event timing, interleaved variants, device-copy bandwidth,
the 134M Llama model step, and JSON output.

The scripts live in subfolders by what they measure (``step/``, ``site/``,
``projection/``, ``decode/``); each puts this folder on ``sys.path`` and
imports it as ``import common``. Nothing here is mhc-specific except
:func:`llama_model`'s ``convert_to_mhc`` and :func:`environment`'s record of
which mhc was imported (an A/B against an older tree imports that one).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "require_cuda",
    "environment",
    "time_calls",
    "host_and_wall_us",
    "best_host_and_wall_us",
    "step_peak_memory",
    "Measurement",
    "interleaved",
    "copy_gbps",
    "llama_134m",
    "llama_model",
    "training_step",
    "write_json",
]


def require_cuda(script: str) -> None:
    """Exit with a message naming ``script`` when there is no CUDA device."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA device")


def environment() -> dict[str, str]:
    """The device and library versions a measurement ran with, and where the mhc it imported lives."""
    import mhc

    info = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "mhc": str(Path(mhc.__file__).resolve().parent),
    }
    try:
        import triton
    except ImportError:
        pass
    else:
        info["triton"] = triton.__version__
    return info


def time_calls(fn: Callable[[], Any], steps: int, warmup: int = 0) -> list[float]:
    """Milliseconds of each of ``steps`` calls of ``fn``, after ``warmup`` untimed calls.

    Each call is timed with CUDA events and synchronised before the next.
    """
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def host_and_wall_us(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """``(host µs, wall µs)`` per call of ``fn`` over ``calls`` calls (CUDA).

    Host: until the last call has returned, with no synchronisation (keep
    ``calls`` below what the launch queue holds, or the host waits on the
    device); wall: until the device has finished them too.
    """
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / calls, (t2 - t0) * 1e6 / calls


def best_host_and_wall_us(
    rows: dict[str, Callable[[], Any]], calls: int, rounds: int
) -> dict[str, tuple[float, float]]:
    """Each row's best ``(host µs, wall µs)`` per call (:func:`host_and_wall_us`) over ``rounds`` interleaved rounds.

    Every row is called 20 times first (allocator, plans, first launches).
    """
    for fn in rows.values():
        host_and_wall_us(fn, 20)
    best = {name: (float("inf"), float("inf")) for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            host, wall = host_and_wall_us(fn, calls)
            best[name] = (min(best[name][0], host), min(best[name][1], wall))
    return best


def step_peak_memory(model, step: Callable[[], None]) -> dict[str, float]:
    """GB: what ``model`` keeps between steps (parameters and ``step.optimizer``'s state) and one step's peak.

    ``step`` from :func:`training_step`, run at least once (the optimizer's
    state exists). The peak is that resident memory plus the step's peak above
    everything allocated before it (activations, gradients, temporaries), so
    models that share a process are measured as if each were alone.
    """
    state = [t for s in step.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *state])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - before
    return {"resident_gb": resident / 1e9, "peak_gb": (resident + above) / 1e9}


@dataclass
class Measurement:
    """One variant of an :func:`interleaved` run: ``ms`` is the best of its round medians."""

    ms: float
    round_medians: list[float] = field(default_factory=list)
    times: list[list[float]] = field(default_factory=list)  # every timed call, per round


def time_run(fn: Callable[[], Any], steps: int, warmup: int = 0) -> float:
    """Milliseconds per call over ``steps`` calls in a row, synchronised once at the end, after ``warmup`` calls.

    Unlike :func:`time_calls`, the host may run ahead of the device from one call to the next, as a
    training loop that reads nothing on the host between steps lets it.
    """

    def sync():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / steps


def interleaved(
    variants: dict[str, Callable[[], Any]],
    rounds: int = 2,
    steps: int = 10,
    warmup: int = 3,
    runs: bool = False,
    rotate: bool = False,
) -> dict[str, Measurement]:
    """Time several variants in interleaved rounds, keeping for each the best of its round medians.

    Each round runs every variant in turn: ``warmup`` untimed calls, then
    ``steps`` calls timed one by one (:func:`time_calls`), or with ``runs`` as one
    run (:func:`time_run`, its mean standing for the round's median). The host's
    speed can drift over seconds; interleaving gives each variant a share of every
    stretch, and the best median of ``rounds`` leaves out a round that fell in
    a slow one. With ``rotate`` round ``r`` starts at the ``r``-th variant (in a
    circle), so that no variant always runs at the same place in a round, after the
    same neighbour.
    """
    if rounds < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1, steps >= 1, warmup >= 0; got {rounds}, {steps}, {warmup}")
    out = {name: Measurement(ms=float("inf")) for name in variants}
    names = list(variants)
    for r in range(rounds):
        first = r % len(names) if rotate and names else 0
        for name in names[first:] + names[:first]:
            fn = variants[name]
            times = [time_run(fn, steps, warmup)] if runs else time_calls(fn, steps, warmup)
            m = out[name]
            m.times.append(times)
            m.round_medians.append(statistics.median(times))
            m.ms = min(m.round_medians)
    return out


def copy_gbps(numel: int = 2**28, dtype: torch.dtype = torch.bfloat16, steps: int = 30) -> float:
    """A device-to-device copy's bandwidth in GB/s (read + write), the median of ``steps`` copies."""
    a = torch.empty(numel, dtype=dtype, device="cuda")
    b = torch.empty_like(a)
    ms = statistics.median(time_calls(lambda: b.copy_(a), steps, warmup=5))
    return 2 * a.numel() * a.element_size() / ms / 1e6


def site_array_elements(n: int, C: int) -> dict[str, dict[str, int]]:
    """Elements per token each fused-site kernel reads and writes, each array counted once, by the arrays' kind.

    ``streams``: x, x', dx' and dx (``n·C`` each, the streams' dtype); ``u``: the sublayer's input and its
    gradient (``C`` each, ``u``'s dtype, float32 under autocast with float32 weights); ``y``: the sublayer's
    output and its gradient (``C`` each, ``y``'s dtype).
    """
    nC = n * C
    return {
        "coeff_partial": {"streams": nC},  # x
        "coeff_fwd": {"streams": nC, "u": C},  # x (the pre-mix's read); u
        "postmix_fwd": {"streams": 2 * nC, "y": C},  # x; x'; y
        "postmix_bwd": {"streams": 2 * nC, "y": 2 * C},  # dx', x; y; dy
        "coeff_bwd": {"streams": nC, "u": C},  # x; du
        "stream_grad": {"streams": 3 * nC, "u": C},  # dx', x, dx; du
        "phi_grad": {"streams": nC},  # x
    }


def site_stream_elements(n: int, C: int) -> dict[str, int]:
    """Elements per token each fused-site kernel reads and writes, all kinds of :func:`site_array_elements` summed."""
    return {name: sum(kinds.values()) for name, kinds in site_array_elements(n, C).items()}


def site_kernel_bytes(
    T: int, n: int, C: int, elt: int = 2, u_elt: int | None = None, y_elt: int | None = None
) -> dict[str, int]:
    """Bytes each fused-site kernel must move for ``T`` tokens of ``n`` streams of width ``C``.

    Each array of :func:`site_array_elements` read or written once (the floor): the streams at ``elt`` bytes a
    value, ``u`` and ``du`` at ``u_elt``, ``y`` and ``dy`` at ``y_elt`` (both default ``elt``); plus the float32
    per-token coefficients it reads or writes (``Z = n² + 2n``; ``zr`` Z + 1, ``h`` 2n, ``H_res`` n², the
    backward's work row 2Z + 4).
    """
    Z = n * n + 2 * n
    size = {"streams": elt, "u": elt if u_elt is None else u_elt, "y": elt if y_elt is None else y_elt}
    coefficients = {  # float32 values per token
        "coeff_partial": Z + 1,
        "coeff_fwd": (Z + 1) + (Z + 1) + 2 * n + n * n,
        "postmix_fwd": 2 * n + n * n,
        "postmix_bwd": 2 * n + 2 * n + n * n,
        "coeff_bwd": 2 * n + 2 * n + n * n + (Z + 1) + (2 * Z + 4),
        "stream_grad": (2 * Z + 4) + 2 * n + n * n,
        "phi_grad": Z,
    }
    return {
        name: T * (sum(count * size[kind] for kind, count in arrays.items()) + 4 * coefficients[name])
        for name, arrays in site_array_elements(n, C).items()
    }


def kernel_bandwidth_rows(averages, bytes_per_call: dict[str, int], copy: float) -> list[tuple]:
    """``(kernel, calls, µs per call, GB/s, × copy)`` for each kernel of ``bytes_per_call`` found in ``averages``.

    ``averages``: ``torch.profiler``'s ``key_averages()`` (entries with ``key``, ``count`` and
    ``self_device_time_total`` in µs); a Triton kernel's entry is named after the kernel. ``copy``: a
    device copy's GB/s in the same process (:func:`copy_gbps`).
    """
    rows = []
    for name, nbytes in bytes_per_call.items():
        hits = [
            e
            for e in averages
            if (e.key == name or e.key.startswith(name + "_"))
            and e.count > 0
            and e.self_device_time_total > 0
        ]
        if not hits:
            continue
        calls = sum(e.count for e in hits)
        us = sum(e.self_device_time_total for e in hits) / calls
        gbps = nbytes / us / 1e3
        rows.append((name, calls, us, gbps, gbps / copy))
    return rows


def llama_134m(seq: int = 2048):
    """The LlamaConfig of the model-step benchmark: hidden 768, 12 layers, 12 heads, intermediate 2048,
    vocabulary 32000 (~134M parameters), SDPA attention."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )


def llama_model(cfg, n_streams: int | None = None, seed: int = 0, **mhc_options):
    """``LlamaForCausalLM(cfg)`` in bf16 on CUDA, drawn from ``seed``; with ``n_streams``,
    ``mhc.convert_to_mhc(model, n_streams, **mhc_options)`` of it (coefficients stay float32)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    if n_streams is not None:
        import mhc

        model = mhc.convert_to_mhc(model, n_streams=n_streams, **mhc_options)
    return model.train()


def training_step(model, ids: torch.Tensor, lr: float = 1e-4) -> Callable[[], None]:
    """One training step of ``model`` on ``ids`` (labels = inputs): forward, loss, backward, fused AdamW, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.optimizer = opt  # for step_peak_memory's resident bytes

    return step


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` (dataclasses as dicts) to ``path`` as indented JSON, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=lambda o: asdict(o)) + "\n")
