"""Our n=4 Birkhoff projection beside mHC-proj and mHC.cu's Sinkhorn, in one process.

Rows: N matrices 4x4 fp32, inputs sigma * randn (sigma 10, as mHC-proj's benchmark/runtime.py),
G = randn. Columns, µs per call ("ag": f+b through autograd, as a user's training step runs it;
op-level inputs do not require grad):
  ours fwd / ag  mhc.birkhoff_project(x) under no_grad / x.requires_grad_(), then torch.autograd.grad
  ours op        the seed protocol: torch.ops.mhc.birkhoff_forward(x, tol_eff, max_iter), then
                 torch.ops.mhc.birkhoff_backward(T, G) (--device cpu: the PyTorch reference pair)
  proj fwd / op  mHC-proj's pybind birkhoff_proj_n4(x, tol), then birkhoff_proj_n4_backward(G, T)
  proj ag        its autograd Function MHCProjectionN4Function
  sk fwd / op    mHC.cu's Sinkhorn as mHC-proj ships it: M = exp(x); sinkhorn_knopp_n4(M, iters),
                 then sinkhorn_knopp_n4_backward(G, M, iters) * M
  sk ag          MHCSinkhornN4Function
  copy fwd / f+b a device copy of the bytes a forward moves (x, T) / a forward+backward (x, T, T, G, dx)
  mul ag         x * 1 through the same autograd step: the floor of any f+b through autograd here
Two protocols, one table each: "chained", mHC-proj's (100 warm-up calls, then 100 calls between
two CUDA events, each fed the previous output, x_{k+1} = T_k), and triton.testing.do_bench's
median on a fixed input (L2 cleared between calls). Within each N the systems run interleaved,
--repeats times, each cell keeping the best. A peer that is missing or fails reads n/a with its
reason; a failure of ours also prints its traceback. Then the max marginal error
||T1-1||_1 + ||T^T 1-1||_1 (float64) over --acc-size matrices of sigma * randn per --acc-sigmas.

Build the peers first (benchmarks/projection/build_peers.sh). The logic checks on a CPU (ours only):
  python benchmarks/projection/bench_projection_peers.py --device cpu --sizes 512,2048
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
from peers import Step, Unavailable, autograd_step, load_peers, no_grad_step, peer_steps  # noqa: E402
from torch import Tensor

import mhc
from mhc import projection as P

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SIZES = "512,2048,8192,32768,131072,1048576"
N_STREAMS = 4
COLUMNS = (
    "ours fwd",
    "ours ag",
    "ours op",
    "proj fwd",
    "proj op",
    "proj ag",
    "sk fwd",
    "sk op",
    "sk ag",
    "copy fwd",
    "copy f+b",
    "mul ag",
)
# What each verdict compares: ours against the best of these peer columns. "f+b" is the strict
# one (our autograd path against the peers' op level too); "ag" and "op" are like for like.
VERDICTS = (
    ("fwd", "ours fwd", ("proj fwd", "sk fwd")),
    ("f+b", "ours ag", ("proj op", "proj ag", "sk op", "sk ag")),
    ("ag", "ours ag", ("proj ag", "sk ag")),
    ("op", "ours op", ("proj op", "sk op")),
)
ACCURACY_BOUND = 1e-5  # issue 23: ours must stay at or under it, every sigma


def number_list(kind: type, low: float, text: str) -> list:
    """``"1,3,10"`` -> ``[1, 3, 10]`` of ``kind``, every value > ``low``; an argparse error otherwise."""
    try:
        values = [kind(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
    if not values or min(values) <= low:
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}s > {low:g}, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/projection/bench_projection_peers.py",
        description=(
            "n=4 Birkhoff projection: ours against mHC-proj and mHC.cu, fwd and f+b, two protocols."
        ),
    )
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: only the ours columns, on the PyTorch path (checks the logic)",
    )
    ap.add_argument(
        "--sizes", type=partial(number_list, int, 0), default=DEFAULT_SIZES, help="N, comma-separated"
    )
    ap.add_argument("--sigma", type=float, default=10.0, help="timing inputs are sigma * randn")
    ap.add_argument("--calls", type=int, default=None, help="timed chained calls (default 100; cpu 3)")
    ap.add_argument("--warmup", type=int, default=None, help="chained warm-up calls (default 100; cpu 1)")
    ap.add_argument("--bench-warmup-ms", type=float, default=25.0, help="do_bench warmup (ms)")
    ap.add_argument("--bench-rep-ms", type=float, default=100.0, help="do_bench rep (ms)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds; each cell keeps the best")
    ap.add_argument("--tol", type=float, default=1e-6, help="Newton tolerance (ours and mHC-proj)")
    ap.add_argument("--sk-iters", type=int, default=20, help="mHC.cu Sinkhorn iterations")
    ap.add_argument(
        "--acc-size", type=int, default=None, help="matrices per sigma for the accuracy (default 1M; cpu 4K)"
    )
    ap.add_argument("--acc-sigmas", type=partial(number_list, float, 0), default="1,3,10,30")
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument(
        "--commit", default=None, help="commit to print (default: git rev-parse, if there is git)"
    )
    ap.add_argument("--json", default=None, help="also write every number and reason to this file")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"  # the PyTorch path on a CPU takes ~10-100 ms a call: defaults that finish
    for name, gpu_default, cpu_default in (
        ("calls", 100, 3),
        ("warmup", 100, 1),
        ("acc_size", 1 << 20, 4096),
    ):
        if getattr(args, name) is None:
            setattr(args, name, cpu_default if cpu else gpu_default)
    for name in ("calls", "repeats", "sk_iters", "acc_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if (
        args.warmup < 0
        or args.bench_warmup_ms < 0
        or args.bench_rep_ms <= 0
        or not args.tol > 0
        or not args.sigma > 0
    ):
        ap.error("--warmup and --bench-warmup-ms must be >= 0; --bench-rep-ms, --tol and --sigma > 0")
    if not cpu and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu to check the logic)")
    return args


class Clock:
    """Per-call times on one device: CUDA events (the default stream) there, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def chained_us(self, step: Step, x0: Tensor, calls: int, warmup: int) -> float:
        """mHC-proj's protocol: ``warmup`` chained calls, then ``calls`` timed as one span, restarting from x0."""
        x = x0.clone()
        for _ in range(warmup):
            x = step(x)
        if self.cuda:
            torch.cuda.synchronize()
        x = x0.clone()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                x = step(x)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) * 1e3 / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            x = step(x)
        return (time.perf_counter() - t0) * 1e6 / calls

    def median_us(self, fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
        """triton.testing.do_bench's median on CUDA; on the CPU the same budget timed call by call."""
        if self.cuda:
            import triton.testing  # only needed (and only there) on the GPU machine

            return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3
        t0 = time.perf_counter()
        fn()
        estimate_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
        for _ in range(int(warmup_ms / estimate_ms)):
            fn()
        times = []
        for _ in range(max(1, min(1000, int(rep_ms / estimate_ms)))):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


def ours_extension_problem() -> str | None:
    """Why our CUDA operators are not loaded (None if they are); builds the extension on first call."""
    try:
        from mhc.projection import (
            cuda as projection_cuda,
        )  # imported here: without it only the "ours op" column is lost

        return (
            None if projection_cuda.available() else "mhc CUDA extension unavailable (see the warning above)"
        )
    except Exception as exc:  # noqa: BLE001
        return reason(exc)


def ours_steps(device: torch.device, G: Tensor, tol: float) -> dict[str, Step | Exception]:
    """Our three columns; a column that cannot be set up holds the exception instead (its traceback prints)."""
    steps: dict[str, Step | Exception] = {
        "ours fwd": no_grad_step(mhc.birkhoff_project),
        "ours ag": autograd_step(mhc.birkhoff_project, G),
    }
    if device.type != "cuda":
        max_iter = P.NEWTON_MAX_ITER

        def reference_op_step(x: Tensor) -> Tensor:
            with torch.no_grad():
                T = P.birkhoff_project_reference(x, tol=tol, max_iter=max_iter)
                P.birkhoff_backward(T, G)
            return T

        steps["ours op"] = reference_op_step
        return steps
    why_not = ours_extension_problem()
    if why_not:
        steps["ours op"] = Unavailable(why_not)
        return steps
    try:
        max_iter = P.NEWTON_MAX_ITER
        tol_eff = P.effective_tol(tol, N_STREAMS, torch.float32)
        forward, backward = torch.ops.mhc.birkhoff_forward, torch.ops.mhc.birkhoff_backward
    except Exception as exc:  # noqa: BLE001 - the operators were renamed or not registered
        steps["ours op"] = exc
        return steps

    def op_step(x: Tensor) -> Tensor:
        T = forward(x, tol_eff, max_iter)
        backward(T, G)
        return T

    steps["ours op"] = op_step
    return steps


def copy_step(src: Tensor, dst: Tensor, x: Tensor) -> Tensor:
    dst.copy_(src)
    return x


def reference_steps(N: int, device: torch.device, G: Tensor) -> dict[str, Step]:
    """Copies of the bytes a forward moves (x, T: 2 arrays) and a forward+backward (x, T, T, G, dx: 5),
    and ``x * 1`` through :func:`autograd_step`: one kernel each way, so the autograd engine's own cost."""
    one = N * N_STREAMS * N_STREAMS
    steps: dict[str, Step] = {
        name: partial(copy_step, torch.empty(numel, device=device), torch.empty(numel, device=device))
        for name, numel in (("copy fwd", one), ("copy f+b", 5 * one // 2))
    }
    steps["mul ag"] = autograd_step(lambda x: x * 1.0, G)
    return steps


def reason(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split()) if not isinstance(exc, Unavailable) else str(exc)
    return text if len(text) <= 160 else text[:157] + "..."


def measure_size(N: int, args, device, clock: Clock, peers, why: str) -> dict[str, dict[str, float | str]]:
    """Both protocols' cells for one N: {"chained": {column: µs or "n/a (...)"}, "do_bench": {...}}; a variant
    that raises is dropped, its cell where it failed and every cell it has no number for reading "n/a (why)"."""
    gen = torch.Generator(device=device).manual_seed(args.seed + N)
    x0 = args.sigma * torch.randn(N, N_STREAMS, N_STREAMS, device=device, generator=gen)
    G = torch.randn(N, N_STREAMS, N_STREAMS, device=device, generator=gen)
    steps = {
        **ours_steps(device, G, args.tol),
        **peer_steps(peers, why, G, args.tol, args.sk_iters),
        **reference_steps(N, device, G),
    }
    cells: dict[str, dict[str, float | str]] = {"chained": {}, "do_bench": {}}
    failed: dict[str, str] = {}

    def drop(name: str, exc: BaseException, protocol: str | None) -> None:
        if name.startswith("ours") and not isinstance(exc, Unavailable):
            print(f"ours FAILED ({name}, N={N}, {protocol or 'first call'}):", file=sys.stderr)
            traceback.print_exception(exc, file=sys.stderr)
        failed[name] = reason(exc)
        steps.pop(name, None)
        if protocol:
            cells[protocol][name] = f"n/a ({failed[name]})"

    inputs: dict[str, Tensor] = {}  # each variant's own fixed input (autograd marks it as requiring grad)
    for name, step in list(steps.items()):
        try:
            if isinstance(step, Exception):
                raise step
            inputs[name] = x0.clone()
            out = step(inputs[name].clone())
            if tuple(out.shape) != tuple(x0.shape):
                raise RuntimeError(f"output shape {tuple(out.shape)}, expected {tuple(x0.shape)}")
        except Exception as exc:  # noqa: BLE001 - a failing system is a table cell, not a crashed run
            drop(name, exc, None)
    for _ in range(args.repeats):
        for protocol in ("chained", "do_bench"):
            for name, step in list(steps.items()):
                try:
                    if protocol == "chained":
                        t = clock.chained_us(step, x0, args.calls, args.warmup)
                    else:
                        t = clock.median_us(
                            partial(step, inputs[name]), args.bench_warmup_ms, args.bench_rep_ms
                        )
                except Exception as exc:  # noqa: BLE001
                    drop(name, exc, protocol)
                    continue
                previous = cells[protocol].get(name)
                cells[protocol][name] = t if previous is None else min(previous, t)
    for name, why_failed in failed.items():
        for protocol_cells in cells.values():
            protocol_cells.setdefault(name, f"n/a ({why_failed})")
    return cells


def accuracy(args, device, peers, why: str) -> dict[str, dict[str, dict[str, float | int | str]]]:
    """{sigma: {system: {"max_err", "nonfinite"} or {"error"}}} over args.acc_size matrices each."""
    out: dict[str, dict[str, dict[str, float | int | str]]] = {}
    ext = peers[0] if peers else None
    systems: dict[str, Callable[[Tensor], Tensor] | Unavailable] = {
        "ours": mhc.birkhoff_project,
        "mHC-proj": (lambda x: ext.birkhoff_proj_n4(x, args.tol)["T"]) if ext else Unavailable(why),
        "mHC.cu": (lambda x: ext.sinkhorn_knopp_n4(torch.exp(x), args.sk_iters)["T"])
        if ext
        else Unavailable(why),
    }
    for sigma in args.acc_sigmas:
        gen = torch.Generator(device=device).manual_seed(args.seed + int(sigma * 1000))
        x = sigma * torch.randn(args.acc_size, N_STREAMS, N_STREAMS, device=device, generator=gen)
        row = out[f"{sigma:g}"] = {}
        for name, project in systems.items():
            try:
                if isinstance(project, Unavailable):
                    raise project
                with torch.no_grad():
                    err = mhc.marginal_error(project(x))
                finite = err[err.isfinite()]
                row[name] = {
                    "max_err": float(finite.max()) if finite.numel() else float("nan"),
                    "nonfinite": int(err.numel() - finite.numel()),
                }
            except Exception as exc:  # noqa: BLE001
                if name == "ours" and not isinstance(exc, Unavailable):
                    traceback.print_exception(exc, file=sys.stderr)
                row[name] = {"error": f"n/a ({reason(exc)})"}
    return out


def commit_of(args) -> str:
    if args.commit:
        return args.commit
    git = partial(subprocess.run, cwd=REPO, capture_output=True, text=True, timeout=10, check=True)
    try:
        head = git(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = git(["git", "status", "--porcelain", "--", "mhc"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here; pass --commit)"
    return head + (" + uncommitted changes under mhc/" if dirty else "")


def source_digest() -> str:
    """sha256 (12 hex) of mhc/*.py and mhc/csrc/*: identifies the measured code without git."""
    h = hashlib.sha256()
    root = Path(mhc.__file__).parent
    for path in sorted([*root.glob("*.py"), *root.glob("csrc/*")]):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def format_table(title: str, rows: dict[int, dict[str, float | str]]) -> list[str]:
    """Lines of one protocol's table; an n/a cell shows a footnote number, the reasons listed below."""
    notes: dict[str, int] = {}
    width = 9
    lines = [title, f"{'N':>8} | " + " ".join(f"{c:>{width}}" for c in COLUMNS)]
    lines.append("-" * len(lines[-1]))
    for N, cells in rows.items():
        shown = []
        for c in COLUMNS:
            v = cells.get(c, "n/a (not run)")
            if isinstance(v, str):
                key = notes.setdefault(v[5:-1] if v.startswith("n/a (") else v, len(notes) + 1)
                shown.append(f"{'n/a[' + str(key) + ']':>{width}}")
            else:
                shown.append(f"{v:{width}.1f}")
        lines.append(f"{N:>8} | " + " ".join(shown))
    return lines + [f"  [{k}] n/a ({why})" for why, k in notes.items()]


def verdicts(rows: dict[int, dict[str, float | str]]) -> list[dict[str, object]]:
    """Per N and per :data:`VERDICTS` row: ours against the best of that row's peer columns."""
    out = []
    for N, cells in rows.items():
        for what, ours_col, peer_columns in VERDICTS:
            peers = {c: cells[c] for c in peer_columns if isinstance(cells.get(c), float)}
            ours = cells.get(ours_col)
            if not isinstance(ours, float) or not peers:
                out.append({"N": N, "what": what, "ahead": None})
                continue
            best = min(peers, key=peers.get)
            out.append(
                {
                    "N": N,
                    "what": what,
                    "ours": ours,
                    "best_peer": best,
                    "peer_us": peers[best],
                    "ahead": ours < peers[best],
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    clock = Clock(device)
    started = time.perf_counter()
    t0 = time.perf_counter()
    ours_problem = ours_extension_problem() if device.type == "cuda" else "cpu run"
    ext_s = time.perf_counter() - t0
    peers, why = load_peers(device)
    header = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        **common.environment(),
        "commit": commit_of(args),
        "mhc_sources_sha256": source_digest(),
        "mhc": str(Path(mhc.__file__).parent),
        "ours_cuda_extension": ours_problem or f"loaded in {ext_s:.1f} s",
        "peers": why,
        "command": "python " + " ".join(sys.argv),
    }
    if device.type != "cuda":
        header["device"] = "cpu"
    for k, v in header.items():
        print(f"# {k}: {v}")
    print(
        f"# n={N_STREAMS} fp32, timing inputs {args.sigma:g}*randn, G=randn, tol={args.tol:g}, "
        f"sk iters={args.sk_iters}; chained {args.warmup}+{args.calls} calls; do_bench warmup "
        f"{args.bench_warmup_ms:g} ms rep {args.bench_rep_ms:g} ms; best of {args.repeats} interleaved rounds; µs/call",
        flush=True,
    )

    tables: dict[str, dict[int, dict[str, float | str]]] = {"chained": {}, "do_bench": {}}
    for N in args.sizes:
        t0 = time.perf_counter()
        cells = measure_size(N, args, device, clock, peers, why)
        for protocol, rows in tables.items():
            rows[N] = cells[protocol]
        brief = ", ".join(f"{c} {v:.1f}" for c, v in cells["chained"].items() if isinstance(v, float))
        print(f"N={N} done in {time.perf_counter() - t0:.1f} s; chained: {brief}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print()
    for protocol, title in (
        ("chained", "chained protocol (mHC-proj's runtime.py): µs per call"),
        ("do_bench", f"{'triton.testing.do_bench' if clock.cuda else 'cpu per-call'} median: µs/call"),
    ):
        print("\n".join(format_table(title, tables[protocol])))
        judged = verdicts(tables[protocol])
        for v in judged:
            print(
                f"  N={v['N']:>8} {v['what']:>3}: "
                + (
                    "no comparison (ours or every peer n/a)"
                    if v["ahead"] is None
                    else f"ours {v['ours']:.1f} vs {v['best_peer']} {v['peer_us']:.1f} -> "
                    f"{'ahead' if v['ahead'] else 'BEHIND'} ({v['ours'] / v['peer_us']:.2f}x)"
                )
            )
        for what, ours_col, peer_columns in VERDICTS:
            found = [v["ahead"] for v in judged if v["what"] == what]
            answer = "no comparison" if all(a is None for a in found) else "yes" if all(found) else "NO"
            print(f"  {ours_col} ahead of {' / '.join(peer_columns)} at every N ({protocol}): {answer}")
        print()

    t0 = time.perf_counter()
    acc = accuracy(args, device, peers, why)
    print(
        f"max marginal error over {args.acc_size} matrices of sigma*randn ({time.perf_counter() - t0:.1f} s); "
        f"ours must be <= {ACCURACY_BOUND:g}"
    )
    for sigma, row in acc.items():
        print(
            f"  sigma={sigma:>4}: "
            + "; ".join(
                f"{name} {r['error']}"
                if "error" in r
                else f"{name} {r['max_err']:.2e}"
                + (f" ({r['nonfinite']} non-finite)" if r["nonfinite"] else "")
                for name, r in row.items()
            )
        )
    ours_errs = [r["ours"].get("max_err", float("nan")) for r in acc.values()]
    ours_nonfinite = sum(r["ours"].get("nonfinite", 0) for r in acc.values())
    accurate = all(e <= ACCURACY_BOUND for e in ours_errs) and ours_nonfinite == 0
    print(
        f"ours accuracy: {'OK' if accurate else 'FAILED'} (worst {max(ours_errs):.2e}, {ours_nonfinite} non-finite)"
    )
    print(f"total {time.perf_counter() - started:.1f} s")

    if args.json:
        common.write_json(
            args.json,
            {
                "header": header,
                "config": {k: v for k, v in vars(args).items() if k != "json"},
                "tables": {p: {str(N): c for N, c in rows.items()} for p, rows in tables.items()},
                "verdicts": {p: verdicts(rows) for p, rows in tables.items()},
                "accuracy": acc,
                "ours_accurate": accurate,
            },
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
