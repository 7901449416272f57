"""Launch-configuration sweep of the fused site's seven Triton kernels (CUDA).

    python benchmarks/site/sweep_site_kernels.py                          # bf16: small_gpu, 134M and 1.1B shapes, every kernel
    python benchmarks/site/sweep_site_kernels.py --shapes 2048x8192 --kernels coeff_partial,stream_grad
    python benchmarks/site/sweep_site_kernels.py --jobs 12 --json sweep.json
    python benchmarks/site/sweep_site_kernels.py --dtype float32 --jobs 14 --json sweep32.json --budget 460

For each shape (``C x T``, n = 4) it builds one site's real inputs (the
forward and backward of :mod:`mhc.fused.steps`) with streams of ``--dtype``,
then times each kernel under its :class:`mhc.fused.plan.Plan` launch
(``plan``) and under every variant of a grid: tile sizes, ``num_warps`` and
``num_stages`` (the plan leaves Triton's default of 3 unless it says).

bfloat16 (the default; the small_gpu, 134M and 1.1B shapes, every kernel): each
variant's outputs are checked against the plan's (``max rel``: the largest
difference over the largest value of each output); a variant over ``--tol``
(2e-2) is marked ``WRONG`` and never counted best. Every variant is timed in
full.

float32 (issue #49: fp32 weights under bf16 autocast give fp32 streams;
shapes small_gpu 512x16384, 134M 768x16384 and 1.1B 2048x8192; kernels
coeff_partial, stream_grad, phi_grad, coeff_bwd in that order): the kernels
with a ``tl.dot`` (coeff_partial, stream_grad, phi_grad) are also swept over
``PRECISION``, Triton's ``input_precision``: ``ieee`` (the plan's: FMA loops),
``tf32x3`` (three tf32 tensor-core products, about fp32's accuracy) and
``tf32`` (one, 10-bit mantissa; on a coarse grid, ``--coarse``, to show its
error). Outputs are checked against the float64 computation of the same
kernel on the same inputs (the plan's float64 launch on float64 copies of
them): a variant is ``WRONG`` when its ``max rel`` is over
``min(--tol, max(--rel-factor x the plan's (ieee) max rel, 1e-6))``. The
``--tol`` default 1e-5 sits between fp32's accumulated error (~3e-7 max rel
for these dot products, measured against float64 in torch) and tf32's
(~3e-4: its inputs are rounded at 2^-11), about 30x from each; 1e-6 (~16
units of fp32's rounding) keeps a summation order of an ieee tiling from
counting as WRONG. Every variant is timed once briefly (``--screen``), then
the plan, the fastest of each precision and the ``--screen`` fastest correct
variants are timed in full.

Times are ``triton.testing.do_bench`` medians (it clears L2 before each
call; in full, the better of two rounds of ``--rep`` ms), with bandwidth at
each kernel's byte floor (``common.site_kernel_bytes`` at the streams'
element size) over a device copy measured in the same process. ``--jobs N``
compiles the variants in N worker processes (Triton's on-disk cache; the
workers only compile, nothing runs there), kernel by kernel in the order
given, while this process times the kernels already compiled. Results go to
``--json`` after each kernel and shape; ``--budget`` stops the timing in time
to print the summary. Without CUDA but with ``TRITON_INTERPRET=1`` it runs in
Triton's interpreter on the CPU (a smoke test; times are meaningless there).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # this tree's mhc, installed or not
import common  # noqa: E402
import torch
import triton
import triton.testing
from sweep_grid import (  # noqa: E402  (benchmarks/site/, this script's folder)
    DEFAULT_KERNELS,
    DEFAULT_SHAPES,
    DOT_KERNELS,
    DTYPES,
    KERNELS,
    N_STREAMS,
    PRECISIONS,
    compile_key,
    error_bound,
    grid_variants,
    max_rel,
)
from sweep_site import Site, compile_one, without_extension, worker_init  # noqa: E402

say = functools.partial(print, flush=True)

# Rough costs for the estimate printed up front (H200 host): seconds to compile one variant, to screen one
# (a short do_bench), to time one in full (two do_bench rounds of 60 ms).
COMPILE_S, SCREEN_S, FULL_S = 3.0, 0.06, 0.2


def _bench(fn, device: str, rep: float, rounds: int) -> float:
    """µs: the better of ``rounds`` do_bench medians of ``rep`` ms (one timed call on the CPU)."""
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    warmup = max(1, int(rep / 6))
    return min(
        1e3 * triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") for _ in range(rounds)
    )


def _copy_gbps(device: str) -> float:
    if device == "cuda":
        return common.copy_gbps()
    a = torch.empty(2**22)
    b = torch.empty_like(a)
    t0 = time.perf_counter()
    b.copy_(a)
    return 2 * a.numel() * a.element_size() / (time.perf_counter() - t0) / 1e9


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bfloat16", help="the streams' dtype (default bfloat16)"
    )
    ap.add_argument(
        "--shapes",
        help="CxT,... (n = 4); default 768x16384,2048x8192 for bfloat16 and "
        "512x16384,768x16384,2048x8192 for float32",
    )
    ap.add_argument(
        "--kernels",
        help="kernels in the order swept (default: every kernel for bfloat16; "
        "coeff_partial,stream_grad,phi_grad,coeff_bwd for float32)",
    )
    ap.add_argument(
        "--precisions",
        help="PRECISION values tried for the kernels with a tl.dot (Triton's input_precision; "
        "default ieee,tf32x3,tf32 for float32, none (the plan's) for bfloat16)",
    )
    ap.add_argument(
        "--coarse", default="tf32", help="precisions tried over the coarse grid only (default tf32)"
    )
    ap.add_argument(
        "--reference",
        choices=("plan", "float64"),
        help="what the outputs are checked against (default plan for bfloat16, float64 for float32)",
    )
    ap.add_argument(
        "--tol",
        type=float,
        help="largest max rel: from the plan's outputs (default 2e-2), or the cap "
        "against float64 (default 1e-5)",
    )
    ap.add_argument(
        "--rel-factor",
        type=float,
        default=4.0,
        help="against float64: largest max rel as a multiple of the plan's own (default 4)",
    )
    ap.add_argument(
        "--jobs", type=int, default=8, help="worker processes that compile the variants (1: none)"
    )
    ap.add_argument(
        "--screen",
        type=int,
        help="time every variant briefly, then the plan, each precision's fastest and "
        "this many of the fastest correct ones in full (0: every variant in "
        "full; default 0 for bfloat16, 8 for float32)",
    )
    ap.add_argument(
        "--rep",
        type=float,
        default=60.0,
        help="do_bench's ms a full timing round (two rounds; a screen takes one of rep/6)",
    )
    ap.add_argument(
        "--limit", type=int, help="at most this many variants of each kernel and precision (a smoke test)"
    )
    ap.add_argument(
        "--budget", type=float, help="seconds: time no further variants after this (then the summary)"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="print the variant counts and the estimate, and stop"
    )
    ap.add_argument("--top", type=int, default=5, help="variants listed per kernel, fastest first")
    ap.add_argument("--json", help="also write every timing here (after each kernel and shape)")
    args = ap.parse_args(argv)
    fp32 = args.dtype == "float32"
    try:
        shapes = args.shapes or ",".join(f"{c}x{t}" for c, t in DEFAULT_SHAPES[args.dtype])
        args.shapes = [tuple(int(v) for v in s.split("x")) for s in shapes.split(",")]
        assert all(len(s) == 2 and min(s) > 0 for s in args.shapes)
    except (ValueError, AssertionError):
        ap.error(f"--shapes: CxT,... with positive integers, not {args.shapes!r}")
    args.kernels = args.kernels.split(",") if args.kernels else list(DEFAULT_KERNELS[args.dtype])
    if unknown := [k for k in args.kernels if k not in KERNELS]:
        ap.error(f"unknown kernels {unknown}; the kernels: {','.join(KERNELS)}")
    if args.precisions is None:
        args.precisions = PRECISIONS if fp32 else ()
    else:
        args.precisions = tuple(p for p in args.precisions.split(",") if p)
    args.coarse = tuple(p for p in args.coarse.split(",") if p)
    args.reference = args.reference or ("float64" if fp32 else "plan")
    args.tol = args.tol if args.tol is not None else (1e-5 if args.reference == "float64" else 2e-2)
    args.screen = args.screen if args.screen is not None else (8 if fp32 else 0)
    if args.jobs < 1 or args.screen < 0 or args.rep <= 0 or (args.limit is not None and args.limit < 1):
        ap.error("need --jobs >= 1, --screen >= 0, --rep > 0, --limit >= 1")
    return args


def _plan_variants(args, dtype) -> dict:
    """``{kernel: {(C, T): [params, ...]}}`` in the order swept."""
    return {
        kernel: {
            (C, T): grid_variants(kernel, C, dtype, args.precisions, args.coarse, args.limit)
            for C, T in args.shapes
        }
        for kernel in args.kernels
    }


def _announce(args, variants: dict) -> None:
    """Print the variant counts and a rough time estimate."""
    say(
        f"{args.dtype} streams, n = {N_STREAMS}; shapes {', '.join(f'{c}x{t}' for c, t in args.shapes)}; "
        f"outputs against {'float64' if args.reference == 'float64' else 'the plan'}; PRECISION of the dot kernels: "
        f"{','.join(args.precisions) or 'the plan' + chr(39) + 's'}{f' ({chr(44).join(args.coarse)} coarse)' if args.precisions else ''}"
    )
    n_variants = n_timed = n_full = 0
    compiles, first = set(), None
    for kernel, per_shape in variants.items():
        counts = []
        for (C, T), vs in per_shape.items():
            n_variants += len(vs)
            n_timed += len(vs) + 1  # and the plan
            precisions = len(args.precisions) if kernel in DOT_KERNELS else 1
            n_full += len(vs) + 1 if not args.screen else min(len(vs), args.screen) + 1 + precisions
            compiles.update(compile_key(kernel, v) for v in vs)
            by_p = {}
            for v in vs:
                by_p[v.get("PRECISION")] = by_p.get(v.get("PRECISION"), 0) + 1
            split = (
                " (" + ", ".join(f"{p} {c}" for p, c in by_p.items()) + ")"
                if by_p and None not in by_p
                else ""
            )
            counts.append(f"{C}x{T} {len(vs)}{split}")
        first = first if first is not None else len(compiles)
        say(f"  {kernel}: {sum(len(vs) for vs in per_shape.values())} variants: {'; '.join(counts)}")
    compile_s = len(compiles) * COMPILE_S / args.jobs
    time_s = (n_timed * SCREEN_S + n_full * FULL_S) if args.screen else n_timed * FULL_S
    total = time_s + (first * COMPILE_S / args.jobs if args.jobs > 1 else compile_s)
    say(
        f"{n_variants} variants and {n_timed - n_variants} plan launches to time; {len(compiles)} distinct compiles "
        f"(splits and tokens are launch arguments). Estimate: compiles ~{compile_s:.0f} s in {args.jobs} process(es) "
        f"(~{COMPILE_S:.0f} s each), timing ~{time_s:.0f} s ({n_timed} x {SCREEN_S if args.screen else FULL_S} s"
        f"{f' + {n_full} full timings x {FULL_S} s' if args.screen else ''}); ~{total:.0f} s in all with the "
        f"compiles {'overlapping the timing after the first kernel' if args.jobs > 1 else 'here'}"
    )


def _summary_line(r: dict, plan_row: dict) -> str:
    return (
        f"{r['us']:8.1f} us  {r['x_copy']:.2f}x copy  {plan_row['us'] / r['us']:.2f}x faster than plan  "
        f"rel {r['max_rel']:.1e}  {r['params']}"
    )


def _sweep(
    site,
    ref,
    kernel: str,
    variants: list,
    args,
    device: str,
    copy: float,
    deadline: float | None,
    compile_errors: dict,
) -> tuple[list, bool]:
    """Time ``kernel``'s plan and variants at one shape: ``(rows, out_of_time)``."""
    C, T = site.C, site.T
    floor = common.site_kernel_bytes(T, N_STREAMS, C, site.x.element_size())[kernel]
    sweep_precision = bool(args.precisions) and kernel in DOT_KERNELS
    plan_params = site.plan_params(kernel, precision=sweep_precision)
    base_fn, base_out = site.call(kernel, None)
    ref_out = ref.run(kernel, None) if ref is not None else base_out
    plan_rel = max_rel(base_out, ref_out)
    bound = error_bound(args.reference, args.tol, plan_rel if ref is not None else None, args.rel_factor)
    del base_out
    screen_rep = args.rep / 6 if args.screen else args.rep
    rounds = 1 if args.screen else 2
    rows, fns, failures, slow_loads, out_of_time = [], {}, [], 0, False
    t_start = time.perf_counter()
    for i, params in enumerate([None] + variants):
        if deadline is not None and time.perf_counter() > deadline:
            say(f"  {kernel} {C}x{T}: out of --budget after {max(0, i - 1)} of {len(variants)} variants")
            out_of_time = True
            break
        if params is not None and (err := compile_errors.get(compile_key(kernel, params))):
            failures.append(f"{params}: compile: {err}")
            continue
        try:
            t0 = time.perf_counter()
            fn, out = (base_fn, None) if params is None else site.call(kernel, params)
            if params is not None:
                slow_loads += time.perf_counter() - t0 > 1.0  # compiled here, not found in Triton's cache
                err = max_rel(out, ref_out)
            else:
                err = plan_rel
            del out
            us = _bench(fn, device, screen_rep, rounds)
        except Exception as e:  # noqa: BLE001 (a variant Triton cannot build or launch is reported and skipped)
            failures.append(f"{params}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            continue
        p = dict(params) if params is not None else dict(plan_params)
        row = dict(
            kernel=kernel,
            C=C,
            T=T,
            dtype=args.dtype,
            precision=p.get("PRECISION"),
            params=p,
            plan=params is None,
            us=us,
            screen_us=us if args.screen else None,
            full=not args.screen,
            x_copy=floor / us / 1e3 / copy,
            max_rel=err,
            bound=bound,
            ok=err <= bound,
        )
        fns[len(rows)] = fn
        rows.append(row)
        if (i + 1) % 50 == 0:
            say(
                f"  {kernel} {C}x{T}: {i + 1}/{len(variants) + 1} timed ({time.perf_counter() - t_start:.0f} s)"
            )
    if out_of_time and not rows:
        return rows, out_of_time
    if not rows or not rows[0]["plan"]:
        say(f"  {kernel} {C}x{T}: the plan's launch failed: {failures[:1]}")
        return rows, out_of_time
    if args.screen:  # the plan, each precision's fastest and the fastest correct ones, in full
        order = sorted(range(len(rows)), key=lambda j: rows[j]["us"])
        again = {0} | set([j for j in order if rows[j]["ok"]][: args.screen])
        for p in {r["precision"] for r in rows}:
            again.add(next(j for j in order if rows[j]["precision"] == p))
        for j in sorted(again):
            try:
                rows[j]["us"] = _bench(fns[j], device, args.rep, 2)
            except Exception as e:  # noqa: BLE001
                failures.append(f"{rows[j]['params']}: full timing: {type(e).__name__}")
                continue
            rows[j]["full"] = True
            rows[j]["x_copy"] = floor / rows[j]["us"] / 1e3 / copy
    plan_row = rows[0]
    good = sorted((r for r in rows if r["ok"]), key=_rank)
    ref_name = "float64" if ref is not None else "the plan"
    say(
        f"{args.dtype} C={C} T={T} {kernel}: plan {plan_row['us']:.1f} us ({plan_row['x_copy']:.2f}x copy, rel "
        f"{plan_row['max_rel']:.1e} against {ref_name}) {plan_params}; {len(rows) - 1} variants timed "
        f"({time.perf_counter() - t_start:.0f} s), correct: max rel <= {bound:.1e}"
    )
    if sweep_precision:
        parts = []
        for p in dict.fromkeys(r["precision"] for r in rows):
            mine = [r for r in rows if r["precision"] == p]
            fastest = min(mine, key=lambda r: r["us"])
            ok = [r for r in mine if r["ok"]]
            best_ok = (
                f", best correct {min(ok, key=lambda r: r['us'])['us']:.1f} us"
                if ok and not fastest["ok"]
                else ""
            )
            parts.append(
                f"{p}: {fastest['us']:.1f} us rel {fastest['max_rel']:.1e}"
                f"{'' if fastest['ok'] else ' WRONG'} ({len(ok)}/{len(mine)} correct{best_ok})"
            )
        say("    per precision (fastest): " + " | ".join(parts))
    for r in good[: args.top]:
        tag = " (plan)" if r["plan"] else ""
        say(
            f"    {r['us']:8.1f} us  {r['x_copy']:.2f}x copy  {r['us'] / plan_row['us']:.3f}x plan  "
            f"rel {r['max_rel']:.1e}  {r['params']}{tag}{'' if r['full'] else ' (screened)'}"
        )
    if good:
        say(f"    best: {_summary_line(good[0], plan_row)}")
    wrong = [r for r in rows if not r["ok"]]
    if wrong:
        w = min(wrong, key=lambda r: r["max_rel"])
        say(f"    WRONG (rel > {bound:.1e}): {len(wrong)}, the closest {w['params']} rel {w['max_rel']:.2e}")
    if failures:
        say(f"    failed: {len(failures)}, e.g. " + "; ".join(failures[:3]))
    if slow_loads:
        say(f"    {slow_loads} variants took over 1 s to load (compiled here, not by the workers)")
    return rows, out_of_time


def _rank(r: dict) -> tuple:
    """Fastest first, those timed in full before those only screened (a screen's time is the noisier)."""
    return not r["full"], r["us"]


def _best(results: list) -> dict:
    """``{(C, T, kernel): the best correct row}``."""
    best = {}
    for r in results:
        key = (r["C"], r["T"], r["kernel"])
        if r["ok"] and (key not in best or _rank(r) < _rank(best[key])):
            best[key] = r
    return best


def _summary(results: list) -> list[dict]:
    out = []
    for (C, T, kernel), r in sorted(_best(results).items()):
        plan = next(
            (p for p in results if (p["C"], p["T"], p["kernel"]) == (C, T, kernel) and p["plan"]), None
        )
        if plan is None:
            continue
        out.append(
            dict(
                C=C,
                T=T,
                kernel=kernel,
                plan_us=plan["us"],
                plan_x_copy=plan["x_copy"],
                best_us=r["us"],
                best_x_copy=r["x_copy"],
                speedup=plan["us"] / r["us"],
                max_rel=r["max_rel"],
                params=r["params"],
            )
        )
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    t_begin = time.perf_counter()
    deadline = None if args.budget is None else t_begin + args.budget
    dtype = DTYPES[args.dtype]
    variants = _plan_variants(args, dtype)
    _announce(args, variants)
    if args.dry_run:
        return []
    if torch.cuda.is_available():
        device = "cuda"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"
    else:
        common.require_cuda("sweep_site_kernels.py")
    extension = without_extension()
    try:
        return _main(args, device, dtype, variants, t_begin, deadline)
    finally:
        from mhc import _ext

        _ext.set_enabled(extension)


def _main(
    args, device: str, dtype: torch.dtype, variants: dict, t_begin: float, deadline: float | None
) -> list[dict]:

    pool, pending = None, {}
    if args.jobs > 1:
        pool = mp.get_context("spawn").Pool(
            args.jobs, initializer=worker_init, initargs=(args.shapes, args.dtype, device)
        )
        for (
            kernel,
            per_shape,
        ) in variants.items():  # in the order timed: the pool runs its tasks first come first
            distinct = {}
            for vs in per_shape.values():
                for v in vs:
                    distinct.setdefault(compile_key(kernel, v), v)
            pending[kernel] = {key: pool.apply_async(compile_one, (kernel, v)) for key, v in distinct.items()}
    copy = _copy_gbps(device)
    say(f"device copy: {copy:.0f} GB/s; {common.environment()}")
    sites = {}
    for C, T in args.shapes:
        site = Site(C, T, dtype, device)
        sites[C, T] = (site, site.float64() if args.reference == "float64" else None)
    if device == "cuda":
        torch.cuda.synchronize()
    say(f"sites built ({time.perf_counter() - t_begin:.0f} s)")

    results, compile_stats, out_of_time = [], {}, False

    def write(complete: bool) -> None:
        if args.json:
            common.write_json(
                args.json,
                {
                    "copy_gbps": copy,
                    "env": common.environment(),
                    "dtype": args.dtype,
                    "shapes": args.shapes,
                    "kernels": args.kernels,
                    "precisions": list(args.precisions),
                    "coarse": list(args.coarse),
                    "reference": args.reference,
                    "tol": args.tol,
                    "rel_factor": args.rel_factor,
                    "screen": args.screen,
                    "rep_ms": args.rep,
                    "compiles": compile_stats,
                    "complete": complete,
                    "seconds": time.perf_counter() - t_begin,
                    "summary": _summary(results),
                    "rows": results,
                },
            )

    try:
        for kernel in args.kernels:
            compile_errors = {}
            if kernel in pending:
                t0 = time.perf_counter()
                # A task whose worker died never answers: wait until the budget (or 15 minutes) at most.
                until = deadline if deadline is not None else t0 + 900
                done = secs = 0
                for key, res in pending[kernel].items():
                    try:
                        ok, s, err = res.get(timeout=max(0.1, until - time.perf_counter()))
                    except mp.TimeoutError:
                        break
                    done += 1
                    secs = max(secs, s)
                    if not ok:
                        compile_errors[key] = err
                compile_stats[kernel] = dict(
                    distinct=len(pending[kernel]),
                    done=done,
                    failed=len(compile_errors),
                    slowest_s=secs,
                    waited_s=time.perf_counter() - t0,
                    errors=sorted(set(compile_errors.values()))[:5],
                )
                say(
                    f"{kernel}: {done}/{len(pending[kernel])} distinct variants compiled, {len(compile_errors)} failed "
                    f"(slowest {secs:.1f} s; waited {time.perf_counter() - t0:.0f} s, "
                    f"{time.perf_counter() - t_begin:.0f} s in)"
                )
                if compile_errors:
                    say(f"  e.g. {next(iter(compile_errors.values()))}")
                if 2 * len(compile_errors) > len(
                    pending[kernel]
                ):  # the workers, not the variants: compile here
                    say("  most failed: the variants compile in this process instead")
                    compile_errors = {}
            for C, T in args.shapes:
                if out_of_time:
                    break
                site, ref = sites[C, T]
                rows, out_of_time = _sweep(
                    site, ref, kernel, variants[kernel][C, T], args, device, copy, deadline, compile_errors
                )
                results += rows
                write(False)
            if out_of_time:
                break
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    write(not out_of_time)
    say(
        f"summary ({args.dtype}): best correct variant against the plan, per shape and kernel "
        f"({time.perf_counter() - t_begin:.0f} s{', stopped by --budget' if out_of_time else ''})"
    )
    summary = _summary(results)
    for s in summary:
        say(
            f"  {s['C']}x{s['T']} {s['kernel']:13s} plan {s['plan_us']:8.1f} us ({s['plan_x_copy']:.2f}x copy) -> "
            f"{s['best_us']:8.1f} us ({s['best_x_copy']:.2f}x copy, {s['speedup']:.2f}x faster, rel {s['max_rel']:.1e}) "
            f"{s['params']}"
        )
    return results


if __name__ == "__main__":
    main()
