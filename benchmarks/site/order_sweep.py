"""Reuse through L2 between a site's kernels: program order and token chunks, against today's sequences (CUDA).

    python benchmarks/site/order_sweep.py                         # three shapes, every variant
    python benchmarks/site/order_sweep.py --shapes 512x16384 --json order.json

Every pass of the site over the streams reads them from device memory: at small_gpu's step a stream tensor is
64 MB against the H100's 50 MB of L2, and the kernels that read it one after the other each start from token 0,
where the one before left only its last tokens in L2. Two ways to let a pass find its predecessor's bytes in L2,
without merging kernels:

* **order**: a kernel walks its token blocks last to first (``r``), so it starts where the one before ended;
* **chunks**: a site's passes run on ``k`` slices of the tokens in turn, each slice small enough to stay in L2
  from one pass to the next (more launches, smaller grids).

The sequences, as the model runs them (bf16 streams, ``u`` in bf16 as under ``torch.compile``):

* forward: ``postmix_fwd`` of site k (writes ``x``), then site k+1's ``coeff_partial`` and ``coeff_fwd``
  (read ``x`` twice);
* backward: site k+1's ``coeff_bwd``, ``stream_grad`` (writes ``dx``) and ``phi_grad`` (each reads ``x``), then
  site k's ``postmix_bwd`` (reads ``dx``); ``phi_grad`` may go before ``stream_grad`` (``P`` in the name), so
  that ``dx`` is the last thing written before ``postmix_bwd`` reads it.

Each sequence is captured in a CUDA graph (no host time in the figure) and timed after L2 is flushed, as the
branch between two sites flushes it; medians of ``--reps``, best of two interleaved rounds. The reversed kernels
are this tree's kernels with the program index mapped backwards (made from ``mhc/fused/kernels.py``'s source in
a temporary module). A measurement, not a path of the library: what wins here goes to a model-step A/B.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # this tree's mhc, installed or not
import common  # noqa: E402
import torch  # noqa: E402

from mhc.fused import kernels as forward_kernels  # noqa: E402
from mhc.fused import plan as fused_plan  # noqa: E402

N_STREAMS = 4
SHAPES = ((512, 16384), (768, 16384), (2048, 8192))  # (C, T): small_gpu, 134M, 1.1B steps

# The program index each kernel maps to its tokens, and its reversal.
REVERSALS = {
    "rm = tl.program_id(0) * BM": "rm = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM",
    "t = tl.program_id(0).to(tl.int64)": "t = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)",
    "t_begin = tl.program_id(1) * tokens_per_prog": "t_begin = (tl.num_programs(1) - 1 - tl.program_id(1)) * tokens_per_prog",
    "split = tl.program_id(1)\n    rz": "split = tl.num_programs(1) - 1 - tl.program_id(1)\n    rz",
}


def reversed_kernels():
    """This tree's kernels with every token loop's program order reversed, as a module."""
    source = Path(forward_kernels.__file__).read_text()
    for old, new in REVERSALS.items():
        count = source.count(old)
        if count == 0:
            raise SystemExit(f"order_sweep: {old!r} is not in mhc/fused/kernels.py any more")
        source = source.replace(old, new)
    # stream_grad's dw rows follow its token programs; they are not read here.
    folder = Path(tempfile.mkdtemp(prefix="mhc_order_"))
    path = folder / "reversed_site_kernels.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("reversed_site_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(module, name: str, spec, *args, grid=None) -> None:
    getattr(module, name)[grid or spec.grid](*args, **spec.meta)


class Site:
    """The tensors of two neighbouring sites at one shape (random values; only the bytes matter here)."""

    def __init__(self, C: int, T: int, device):
        n, dt, f32 = N_STREAMS, torch.bfloat16, torch.float32
        self.n, self.C, self.T = n, C, T
        g = torch.Generator(device=device).manual_seed(0)

        def rand(*shape, dtype=f32):
            return torch.randn(shape, generator=g, device=device, dtype=f32).to(dtype)

        self.plan = fused_plan.plan_for(torch.empty((T, n, C), dtype=dt, device=device), dt)
        Z, ZP = self.plan.Z, self.plan.ZP
        self.Z = Z
        self.x_prev, self.y_prev = rand(T, n, C, dtype=dt), rand(T, C, dtype=dt)
        self.h_prev, self.H_prev = torch.sigmoid(rand(T, 2 * n)), torch.softmax(rand(T, n, n), -1)
        self.x = torch.empty((T, n, C), dtype=dt, device=device)
        self.phi = rand(Z, n * C) * 0.02
        self.alpha, self.b_pre, self.b_post, self.b_res = rand(3), rand(n), rand(n), rand(n, n)
        self.zr, self.h, self.R = rand(T, Z + 1), torch.sigmoid(rand(T, 2 * n)), rand(T, n, n)
        self.H_res = torch.softmax(rand(T, n, n), -1)
        self.u = torch.empty((T, C), dtype=dt, device=device)
        self.part = torch.empty((self.plan.coeff_splits, T, ZP), dtype=f32, device=device)
        # backward
        self.dout, self.du = rand(T, n, C, dtype=dt) * 0.01, rand(T, C, dtype=dt) * 0.01
        self.d_h, self.dR = rand(T, 2 * n) * 0.01, rand(T, n, n) * 0.01
        self.work = torch.zeros((T, 2 * Z + 4), dtype=f32, device=device)
        self.dx = torch.empty_like(self.x)
        self.phi_part = torch.empty((max(self.plan.phi_splits, 16), Z, n * C), dtype=f32, device=device)
        self.dy, self.g_h, self.g_res = torch.empty_like(self.y_prev), torch.empty_like(self.h), rand(T, n, n)
        self.x.copy_(self.x_prev)

    # -- the passes, each on tokens [a, b) --
    def chunk_plan(self, a, b):
        if (a, b) == (0, self.T):
            return self.plan
        return fused_plan.plan_for(self.x[a:b], torch.bfloat16)

    def postmix_fwd(self, m, a, b):
        p = self.chunk_plan(a, b)
        launch(m, "postmix_fwd", p.postmix_fwd, self.x_prev[a:b], self.y_prev[a:b], self.h_prev[a:b],
               self.H_prev[a:b], self.x[a:b], self.C)  # fmt: skip

    def coeff_partial(self, m, a, b):
        p = self.chunk_plan(a, b)
        part = (
            self.part if p is self.plan else torch.empty((p.coeff_splits, b - a, p.ZP), device=self.x.device)
        )
        self._part = part
        launch(
            m,
            "coeff_partial",
            p.coeff_partial,
            self.x[a:b],
            self.phi,
            part,
            b - a,
            self.C,
            p.coeff_k_per_split,
        )

    def coeff_fwd(self, m, a, b):
        p = self.chunk_plan(a, b)
        launch(m, "coeff_fwd", p.coeff_fwd, self._part, self.x[a:b], self.alpha, self.b_pre, self.b_post,
               self.b_res, self.zr[a:b], self.h[a:b], self.R[a:b], self.u[a:b], self.alpha, self.zr[a:b],
               b - a, self.C, 1e-6, p.coeff_splits, 0.0)  # fmt: skip

    def coeff_bwd(self, m, a, b):
        p = self.chunk_plan(a, b)
        launch(m, "coeff_bwd", p.coeff_bwd, self.du[a:b], self.x[a:b], self.h[a:b], self.d_h[a:b], self.dR[a:b],
               self.zr[a:b], self.alpha, self.work[a:b], self.alpha, self.zr[a:b], self.zr[a:b], self.C)  # fmt: skip

    def stream_grad(self, m, a, b):
        p = self.chunk_plan(a, b)
        T = b - a
        # a chunk keeps the whole grid's ~512 programs: fewer tokens a program
        tokens = p.stream_tokens if p is self.plan else max(64, min(p.stream_tokens, T * 8 // 512 // 64 * 64))
        grid = (p.stream_grad.grid[0], -(-T // tokens))
        launch(m, "stream_grad", p.stream_grad, self.dout[a:b], self.du[a:b], self.x[a:b], self.work[a:b], self.phi,
               self.h[a:b], self.H_res[a:b], self.dx[a:b], self.alpha, self.zr[a:b], self.zr[a:b], self.zr,
               T, self.C, tokens, grid=grid)  # fmt: skip

    def phi_grad(self, m, a, b, index=0):
        p = self.chunk_plan(a, b)
        T, K = b - a, self.n * self.C
        tokens, splits = (p.phi_tokens, p.phi_splits) if p is self.plan else fused_plan._split(T, 16, 32)
        part = self.phi_part if p is self.plan else torch.empty((splits, self.Z, K), device=self.x.device)
        launch(m, "phi_grad", p.phi_grad, self.work[a:b], self.x[a:b], part, T, K, self.Z, tokens,
               grid=(p.phi_grad.grid[0], splits))  # fmt: skip

    def postmix_bwd(self, m, a, b):
        p = self.chunk_plan(a, b)
        launch(m, "postmix_bwd", p.postmix_bwd, self.dx[a:b], self.x_prev[a:b], self.y_prev[a:b], self.h_prev[a:b],
               self.dy[a:b], self.g_h[a:b], self.g_res[a:b], self.C)  # fmt: skip


def sequence(site: Site, passes, orders: str, chunks: int, chunked: set):
    """A callable running ``passes`` (names), kernel i in order ``orders[i]``; ``chunked`` passes on ``chunks`` slices.

    Consecutive chunked passes run slice by slice (all of slice 0's, then slice 1's); the others whole.
    """
    modules = {"f": forward_kernels, "r": REVERSED}
    bounds = [(site.T * c // chunks, site.T * (c + 1) // chunks) for c in range(chunks)]
    groups = []  # runs of consecutive passes, chunked or not
    for name, order in zip(passes, orders, strict=True):
        is_chunked = name in chunked and chunks > 1
        if groups and groups[-1][0] == is_chunked and is_chunked:
            groups[-1][1].append((name, order))
        else:
            groups.append((is_chunked, [(name, order)]))

    def run():
        for is_chunked, members in groups:
            for a, b in bounds if is_chunked else [(0, site.T)]:
                for name, order in members:
                    getattr(site, name)(modules[order], a, b)

    return run


def graph_of(fn):
    fn()  # Triton compiles outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(graph, flush, reps: int) -> float:
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


FORWARD = ("postmix_fwd", "coeff_partial", "coeff_fwd")
BACKWARD = ("coeff_bwd", "stream_grad", "phi_grad", "postmix_bwd")
BACKWARD_P = ("coeff_bwd", "phi_grad", "stream_grad", "postmix_bwd")


def variants():
    """(label, passes, orders, chunks, chunked passes)."""
    out = []
    for orders in itertools.product("fr", repeat=3):
        out.append(("F " + "".join(orders), FORWARD, "".join(orders), 1, set()))
    for k in (2, 4, 8):
        out.append((f"F pre in {k} chunks", FORWARD, "fff", k, {"coeff_partial", "coeff_fwd"}))
        out.append((f"F all in {k} chunks", FORWARD, "fff", k, set(FORWARD)))
    for passes, tag in ((BACKWARD, "B"), (BACKWARD_P, "BP")):
        for orders in itertools.product("fr", repeat=4):
            out.append((f"{tag} " + "".join(orders), passes, "".join(orders), 1, set()))
        for k in (2, 4, 8):
            out.append((f"{tag} pre in {k} chunks", passes, "ffff", k, set(passes[:3])))
            out.append((f"{tag} all in {k} chunks", passes, "ffff", k, set(passes)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes", default=",".join(f"{c}x{t}" for c, t in SHAPES), help="CxT,... (default: %(default)s)"
    )
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    common.require_cuda("order_sweep.py")
    global REVERSED
    REVERSED = reversed_kernels()
    device = torch.device("cuda")
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)  # 512 MB: more than any L2
    results = {}
    for shape in args.shapes.split(","):
        C, T = (int(v) for v in shape.split("x"))
        site = Site(C, T, device)
        graphs = {}
        for label, passes, orders, k, chunked in variants():
            graphs[label] = graph_of(sequence(site, passes, orders, k, chunked))
        best = {label: float("inf") for label in graphs}
        for _ in range(2):  # two interleaved rounds
            for label, graph in graphs.items():
                best[label] = min(best[label], time_graph(graph, flush, args.reps))
        base = {"F": best["F fff"], "B": best["B ffff"]}
        print(f"\n{C}x{T} (n={N_STREAMS}, bf16 streams): median µs of the sequence, best of two rounds")
        print("| variant | µs | × today's |\n|---|---|---|")
        for label, us in best.items():
            print(f"| {label} | {us:.1f} | {us / base[label[0]]:.3f} |")
        results[shape] = best
        del graphs, site
        torch.cuda.empty_cache()
        if args.json:  # after each shape: a call cut short keeps what it measured
            common.write_json(args.json, {"environment": common.environment(), "results": results})


REVERSED = None

if __name__ == "__main__":
    main()
