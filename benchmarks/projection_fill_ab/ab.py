"""A/B of the CUDA Birkhoff forward (n = 4, fp32): original (bc1ec78) vs working tree.

Run from the repo root on the GPU machine:  python3 benchmarks/projection_fill_ab/ab.py
(about 1.5 minutes: two ~15 s builds, ~5 s of accuracy, ~40 s of timing).
`--dry-run` checks the script's logic on a CPU (PyTorch projection, tiny sizes).

Builds two small libraries with torch.utils.cpp_extension.load (one arch, sm_90,
-O3, no torch headers in the wrapper: benchmarks/projection_fill_ab/ab_wrapper.cu), one against
`git show bc1ec78:mhc/csrc/birkhoff_{core,kernels}.cuh` and one against the
working tree's headers, each in its own C++ namespace, called through ctypes.

Configurations timed (triton.testing.do_bench median, L2 flushed, best of 2
interleaved rounds), inputs s*randn for s in {10, 1, 30, 20} (20: where the
robust vote threshold matters):
  old        original kernel, launch_forward's geometry (32 threads/block below
             128*1024 matrices, else 128)
  new        working-tree kernel (n = 4: flushed tiny entries, warp vote on >= 3 wide lanes),
             same geometry
  new/t128   working-tree kernel, always 128 threads/block (proposed launch change)
  new/t32    working-tree kernel, always 32 threads/block
Accuracy: max marginal error (sum of |row sum - 1| and |col sum - 1|, float64)
over 1M matrices of s*randn for s in {1, 3, 10, 30, 20}, plus adversarial batches
with wide rows; the device unconverged counter; max |new - old| of the outputs.
Exits 1 if any working-tree configuration has max error > 1e-5, a non-finite
output, an unconverged matrix, or differs from the original by more than 1e-4.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BASE_COMMIT = "bc1ec78"
HEADERS = ("birkhoff_core.cuh", "birkhoff_kernels.cuh")
TOL = max(1e-6, 4 * 4 * 1.1920928955078125e-07)  # project_or_none's tol_eff at n = 4
MAX_ITER = 100
ACC_TOL = 1e-5
DIFF_TOL = 1e-4
SIZES = [512, 2048, 8192, 32768, 131072, 1 << 20]


def build(name: str, header_dir: Path, defines: list[str], work: Path) -> ctypes.CDLL:
    from torch.utils.cpp_extension import load

    src_dir = work / name
    src_dir.mkdir()
    shutil.copy(HERE / "ab_wrapper.cu", src_dir / "ab_wrapper.cu")
    for h in HEADERS:
        shutil.copy(header_dir / h, src_dir / h)
    build_dir = work / (name + "_build")
    build_dir.mkdir()
    t0 = time.time()
    load(name=name, sources=[str(src_dir / "ab_wrapper.cu")],
         extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-std=c++17", f"-I{src_dir}", *defines],
         build_directory=str(build_dir), is_python_module=False, verbose=False)
    print(f"built {name} in {time.time() - t0:.1f} s", flush=True)
    lib = ctypes.CDLL(str(build_dir / f"{name}.so"))
    lib.ab_forward.restype = ctypes.c_int
    lib.ab_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_float, ctypes.c_int,
                               ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.ab_unconverged.restype = ctypes.c_longlong
    lib.ab_unconverged.argtypes = [ctypes.c_int]
    return lib


def launch_threads(B: int) -> int:
    return 128 if B >= 128 * 1024 else 32  # as launch_forward in mhc/csrc/birkhoff.cu


def make_runner(lib, variant: int, threads):
    def run(R: torch.Tensor, out: torch.Tensor) -> None:
        B = R.shape[0]
        t = launch_threads(B) if threads is None else threads
        rc = lib.ab_forward(R.data_ptr(), out.data_ptr(), B, TOL, MAX_ITER, t, variant,
                            torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"launch failed: cudaError {rc}")
    return run


def marginal_error(T: torch.Tensor) -> torch.Tensor:
    Td = T.double()
    return (Td.sum(-1) - 1).abs().sum(-1) + (Td.sum(-2) - 1).abs().sum(-1)


class _DryLib:
    """--dry-run stand-in for a built library (CPU, the PyTorch projection): checks this script's logic only."""

    def ab_unconverged(self, reset: int) -> int:
        return 0


def _dry_runner(lib, variant, threads):
    import mhc

    def run(R: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(mhc.birkhoff_project(R))
    return run


def _dry_bench(fn, **kwargs) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str]) -> int:
    global SIZES
    dry = "--dry-run" in argv
    acc_n = 1 << 20
    if dry:
        SIZES, acc_n = [512, 2048], 4096
        do_bench, runner_of, dev = _dry_bench, _dry_runner, torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU")
            return 2
        from triton.testing import do_bench
        runner_of, dev = make_runner, torch.device("cuda")

    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"  # one arch: the build stays short
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="mhc_ab_"))
    old_dir = work / "old_headers"
    old_dir.mkdir()
    for h in HEADERS:
        text = subprocess.run(["git", "show", f"{BASE_COMMIT}:mhc/csrc/{h}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (old_dir / h).write_text(text)
    if dry:
        old, new = _DryLib(), _DryLib()
    else:
        old = build("mhc_ab_old", old_dir, ["-Dmhc_birkhoff=mhc_birkhoff_ab_old"], work)
        new = build("mhc_ab_new", ROOT / "mhc" / "csrc", ["-DAB_NEW", "-Dmhc_birkhoff=mhc_birkhoff_ab_new"], work)

    configs = {
        "old": (old, 0, None),
        "new": (new, 0, None),
        "new/t128": (new, 0, 128),
        "new/t32": (new, 0, 32),
    }
    runners = {k: runner_of(*v) for k, v in configs.items()}

    # ---------------- accuracy ----------------
    failed = []
    print(f"\naccuracy, {acc_n} matrices each (max marginal error; non-finite; unconverged; max |x - old|)")
    print(f"{'input':>14} {'config':>9} {'max err':>10} {'nonfin':>6} {'unconv':>6} {'max|d old|':>11}")
    g = torch.Generator(device=dev)
    cases = []
    for s in (1.0, 3.0, 10.0, 30.0, 20.0):
        cases.append((f"{s:g}*randn", s, None))
    # wide rows in every 4th matrix (8 lanes per warp: the flush path, not the warp vote)
    cases.append(("10*randn,w/4", 10.0, "wide4"))
    # a whole column shifted by -75 in every 4th matrix: same projection as unshifted,
    # every entry of that column flushed (the fast solver must hand it back)
    cases.append(("3*randn,c/4", 3.0, "col4"))
    for label, s, kind in cases:
        g.manual_seed(1234 + int(s))
        R = s * torch.randn(acc_n, 4, 4, device=dev, generator=g)
        ref_R = None
        if kind == "wide4":
            R[::4, 1, 2] -= 75.0
        elif kind == "col4":
            ref_R = R.clone()
            R[::4, :, 0] -= 75.0
        wide = int(((R.amax(-1) - R.amin(-1)) > 69.0).any(-1).sum())
        outs = {}
        for name in ("old", "new"):
            lib = configs[name][0]
            lib.ab_unconverged(1)
            out = torch.empty_like(R)
            runners[name](R, out)
            unconv = lib.ab_unconverged(1)
            outs[name] = out
            err = marginal_error(out)
            nonfin = int((~torch.isfinite(out)).any(-1).any(-1).sum())
            emax = float(torch.nan_to_num(err, nan=float("inf")).max())
            d = float((out - outs["old"]).abs().max()) if name != "old" else 0.0
            print(f"{label:>14} {name:>9} {emax:10.3e} {nonfin:6d} {unconv:6d} {d:11.3e}"
                  + (f"   ({wide} matrices with a row wider than 69)" if name == "old" else ""))
            if name != "old" and (not emax <= ACC_TOL or nonfin or unconv or not d <= DIFF_TOL):
                failed.append(f"{label} {name}: err {emax:.3e}, non-finite {nonfin}, unconverged {unconv}, diff {d:.3e}")
        if ref_R is not None:
            out_ref = torch.empty_like(ref_R)
            runners["old"](ref_R, out_ref)
            for name in ("old", "new"):
                d = float((outs[name][::4] - out_ref[::4]).abs().max())
                print(f"{'':>14} {name:>9} max |T(shifted) - T(unshifted, old)| = {d:.3e}")
                if name != "old" and not d <= DIFF_TOL:
                    failed.append(f"{label} {name}: shifted-column result differs by {d:.3e}")
        del R, outs
    if not dry:
        torch.cuda.synchronize()

    # ---------------- timing ----------------
    names = list(configs)
    sigmas = (10.0, 1.0, 30.0, 20.0)
    best = {}
    inputs = {}
    for s in sigmas:
        for B in SIZES:
            g.manual_seed(99 + B + int(s))
            R = s * torch.randn(B, 4, 4, device=dev, generator=g)
            inputs[(s, B)] = (R, torch.empty_like(R))
    # A batch takes as long as its slowest warp, so mid sizes depend on the draw:
    # three more draws of 10*randn at 8K, 32K and 128K.
    draws = [(10.0, B, d) for B in ((8192, 32768, 131072) if not dry else (1024,)) for d in (1, 2, 3)]
    for _, B, d in draws:
        g.manual_seed(7000 + 31 * d + B)
        R = 10.0 * torch.randn(B, 4, 4, device=dev, generator=g)
        inputs[(10.0 + d, B)] = (R, torch.empty_like(R))  # keyed apart from the main draw
    keys = [(s, B) for s in sigmas for B in SIZES] + [(10.0 + d, B) for _, B, d in draws]
    for rnd in range(2):
        for key_in in keys:
            R, out = inputs[key_in]
            for name in (names if rnd == 0 else names[::-1]):
                fn = runners[name]
                ms = do_bench(lambda: fn(R, out), warmup=10, rep=40, return_mode="median")
                key = (*key_in, name)
                best[key] = min(best.get(key, float("inf")), ms * 1e3)
        print(f"timing round {rnd + 1} done ({time.time() - t_start:.0f} s)", flush=True)
    for s in sigmas:
        print(f"\nforward us, {s:g}*randn, n = 4, fp32 (do_bench median, L2 flushed, best of 2)")
        print(f"{'N':>8} " + " ".join(f"{n:>9}" for n in names) + f" {'new/old':>8}")
        for B in SIZES:
            row = [best[(s, B, n)] for n in names]
            label = f"{B // 1024}K" if B >= 1024 else str(B)
            print(f"{label:>8} " + " ".join(f"{x:9.1f}" for x in row) + f" {row[1] / row[0]:8.3f}")
    print("\nforward us, other draws of 10*randn (wide: matrices with a row wider than 69)")
    print(f"{'N':>8} {'draw':>4} {'wide':>4} " + " ".join(f"{n:>9}" for n in names) + f" {'new/old':>8}")
    for _, B, d in draws:
        R = inputs[(10.0 + d, B)][0]
        wide = int(((R.amax(-1) - R.amin(-1)) > 69.0).any(-1).sum())
        row = [best[(10.0 + d, B, n)] for n in names]
        print(f"{B // 1024:>7}K {d:>4} {wide:>4} " + " ".join(f"{x:9.1f}" for x in row) + f" {row[1] / row[0]:8.3f}")
    print("\nmHC.cu reference (notes/decode_and_projection.md, 10*randn): 512 19.7, 2K 20.0, 8K 20.3, 32K 21.4, "
          "128K 32.3, 1M 172.3 us")
    print(f"total {time.time() - t_start:.0f} s")
    shutil.rmtree(work, ignore_errors=True)
    if failed:
        print("\nACCURACY FAILED:\n  " + "\n  ".join(failed))
        return 1
    print("\naccuracy OK (every working-tree configuration)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
