"""Host and device time of one small-batch projection call, layer by layer (CUDA, n = 4, fp32, no grad).

    python benchmarks/projection/bench_projection_host.py                  # N = 512 and 32K
    python benchmarks/projection/bench_projection_host.py --sizes 512 --calls 1000

At small N a projection call costs what its host side costs: mHC-proj's
chained protocol (``bench_projection_peers.py``) is host time there. This
splits our call into its layers, beside mHC-proj's own call when it is
installed (``benchmarks/projection/build_peers.sh``). Each row runs one call ``--calls``
times on the same input, an easy one (a projection's output, as in the
chained protocol after its first call): "host" is the time to enqueue them
(no synchronisation, fewer calls than the launch queue holds), "wall" the
time until the device has finished them too; "chained" rows feed each call
the previous output, as mHC-proj's protocol does. Rows:

* ``public``: ``mhc.birkhoff_project(x)``;
* ``fast``: ``mhc.projection.cuda.project_fast(x, tol, max_iter)``, the hot path
  without ``birkhoff_project``'s option checks;
* ``ext``: the extension's ``project_or_none`` called directly (the C++ side
  alone: the CPython call, checks, allocation, launch);
* ``op``: ``torch.ops.mhc.birkhoff_forward.default`` (the dispatcher's way);
* ``peer``: mHC-proj's ``birkhoff_proj_n4(x, tol)["T"]``;
* ``empty``: ``torch.empty_like(x)``; ``add``: ``torch.add(x, x)``.

The best of ``--rounds`` interleaved rounds is kept per row.

Then, per N, mHC-proj's chained protocol itself (each call in its own
``torch.no_grad()``, 100 calls from ``10 * randn`` between two CUDA events)
for ours and the peer, with each call's kernel time from ``torch.profiler``:
where the kernels' mean time is close to the events' per-call time the
protocol is device-bound, where it is well under, host-bound.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
from torch import Tensor

import mhc
from mhc.projection import cuda as projection_cuda


def peer_forward():
    """mHC-proj's forward, or ``None`` when it is not installed here."""
    try:
        import mhc_proj

        return mhc_proj.torch.birkhoff_proj_n4
    except Exception:  # noqa: BLE001 - any import problem means "peer not built here"
        return None


def rows_for(N: int, tol: float, max_iter: int) -> dict:
    torch.manual_seed(0)
    x = mhc.birkhoff_project(torch.randn(N, 4, 4, device="cuda"))
    ext = projection_cuda.extension()
    tol_eff = mhc.projection.effective_tol(tol, 4, torch.float32)
    rows = {
        "public": lambda: mhc.birkhoff_project(x),
        "fast": lambda: projection_cuda.project_fast(x, tol, max_iter),
        "ext": lambda: ext.project_or_none(x, tol, max_iter),
        "op": lambda: torch.ops.mhc.birkhoff_forward.default(x, tol_eff, max_iter),
        "empty": lambda: torch.empty_like(x),
        "add": lambda: torch.add(x, x),
    }
    chained = {"public chained": mhc.birkhoff_project}
    peer = peer_forward()
    if peer is not None:
        rows["peer"] = lambda: peer(x, tol)["T"]
        chained["peer chained"] = lambda y: peer(y, tol)["T"]
    for name, step in chained.items():
        state = [x]

        def run(step=step, state=state):
            state[0] = step(state[0])

        rows[name] = run
    return rows


def chained_systems(N: int) -> tuple[Tensor, dict]:
    """mHC-proj's chained protocol's start ``10 * randn`` and {system: step} (each call in its own no_grad)."""
    from peers import no_grad_step

    torch.manual_seed(N)
    x0 = 10 * torch.randn(N, 4, 4, device="cuda")
    systems = {"ours": no_grad_step(mhc.birkhoff_project)}
    peer = peer_forward()
    if peer is not None:
        systems["mHC-proj"] = no_grad_step(lambda y: peer(y, 1e-6)["T"])
    return x0, systems


def chained_protocol(sizes: list[int], calls: int = 100, rounds: int = 5) -> dict[int, dict]:
    """{N: {system: (best, median events µs per call, mean kernel µs per call)}} for mHC-proj's chained protocol.

    The protocol is ``bench_projection_peers.py``'s ``Clock.chained_us``, run ``rounds`` times with the
    systems interleaved. Then, for the kernel times, one more pass per N and system without warm-up runs
    under ``torch.profiler``, only after every timing, so that no timing follows a profiler session (the
    profiler's hooks are a suspect for the 2x swings of this table's events column between neighbouring N).
    """
    import statistics

    from bench_projection_peers import Clock
    from torch.profiler import ProfilerActivity, profile

    clock = Clock(torch.device("cuda"))
    setups = {N: chained_systems(N) for N in sizes}
    times: dict[int, dict[str, list[float]]] = {}
    for N, (x0, systems) in setups.items():
        times[N] = {name: [] for name in systems}
        for _ in range(rounds):
            for name, step in systems.items():
                times[N][name].append(clock.chained_us(step, x0, calls, warmup=calls))
    out: dict[int, dict] = {}
    for N, (x0, systems) in setups.items():
        out[N] = {}
        for name, step in systems.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                clock.chained_us(step, x0, calls, warmup=0)
            # Device-side events, less the restart's clone and the counter's copies.
            kernels = [
                e
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA
                and not any(word in e.name.lower() for word in ("copy", "memcpy", "memset"))
            ]
            out[N][name] = (
                min(times[N][name]),
                statistics.median(times[N][name]),
                sum(e.time_range.elapsed_us() for e in kernels) / calls,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512,32768", help="comma-separated batch sizes N (default 512,32768)")
    ap.add_argument("--calls", type=int, default=300, help="calls per timing (default 300)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds, the best kept (default 5)")
    ap.add_argument(
        "--chained-sizes",
        default="512,2048,8192,32768,131072",
        help="N for the chained protocol with kernel times (default 512,...,131072; empty: none)",
    )
    ap.add_argument(
        "--chained-rounds", type=int, default=5, help="interleaved rounds of the chained protocol"
    )
    args = ap.parse_args()
    common.require_cuda("bench_projection_host.py")
    if not projection_cuda.available():
        raise SystemExit("the CUDA projection extension is unavailable (python -m mhc.cuda_build shows why)")
    tol, max_iter = 1e-6, mhc.projection.NEWTON_MAX_ITER
    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  n=4 fp32 tol={tol:g}"
        f"  peer: {'mHC-proj' if peer_forward() else 'not installed'}"
    )
    print(f"  {'N':>7} {'call':>15} {'host µs':>9} {'wall µs':>9}")
    with torch.no_grad():
        for N in (int(s) for s in args.sizes.split(",")):
            rows = rows_for(N, tol, max_iter)
            best = common.best_host_and_wall_us(rows, args.calls, args.rounds)
            for name, (host, wall) in best.items():
                print(f"  {N:7d} {name:>15} {host:9.2f} {wall:9.2f}")
    print(
        f"# mHC-proj's chained protocol, {args.chained_rounds} interleaved rounds: events µs per call, best /"
        " median, then mean kernel µs per call (torch.profiler)"
    )
    sizes = [int(s) for s in args.chained_sizes.split(",") if s]
    for N, cells in chained_protocol(sizes, rounds=args.chained_rounds).items():
        print(
            f"  {N:7d} "
            + "  ".join(
                f"{name} {best:6.2f} / {med:6.2f} / {k:5.2f}" for name, (best, med, k) in cells.items()
            )
        )


if __name__ == "__main__":
    main()
