"""The CUDA projection's outputs and gradients, bit for bit, across two builds of the kernels (two processes).

    python benchmarks/projection/bits_across_builds.py dump new.safetensors           # this tree's mhc
    PYTHONPATH=old_tree python benchmarks/projection/bits_across_builds.py dump old.safetensors
    python benchmarks/projection/bits_across_builds.py compare new.safetensors old.safetensors

``dump`` projects fixed random logits (n 4 and 8; float32, bfloat16, float16;
batches 1, 7 and 4096; logit scales 1, 10 and 30) with whichever ``mhc`` the
path gives, backpropagates a fixed gradient, and writes ``T`` and ``dL/dR`` of
each case with safetensors. ``compare`` says, per case, whether the two files
agree bit for bit, and the largest difference where they do not. The two
builds cannot share a process: both register the ``torch.ops.mhc`` operators.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file


def dump(path: str) -> None:
    import mhc

    out = {}
    for n in (4, 8):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for batch in (1, 7, 4096):
                for scale in (1, 10, 30):
                    g = torch.Generator().manual_seed(1000 * n + batch + scale)
                    R = (scale * torch.randn(batch, n, n, generator=g)).to("cuda", dtype).requires_grad_()
                    G = torch.randn(batch, n, n, generator=g).to("cuda", dtype)
                    T = mhc.birkhoff_project(R)
                    T.backward(G)
                    key = f"n{n}_{str(dtype)[6:]}_b{batch}_s{scale}"
                    out[f"{key}.T"], out[f"{key}.grad"] = T.detach().cpu(), R.grad.cpu()
    save_file(out, path)
    print(f"{len(out) // 2} cases from {mhc.__file__} written to {path}")
    # The kernels' time on all-finite input, for a look across builds (do_bench medians, L2 cleared).
    import triton.testing

    for n in (4, 8):
        for dtype in (torch.float32, torch.bfloat16):
            R = (5 * torch.randn(32768, n, n, generator=torch.Generator().manual_seed(n))).to("cuda", dtype)
            G = torch.randn_like(R)
            fwd = triton.testing.do_bench(lambda: mhc.birkhoff_project(R))
            Rg = R.clone().requires_grad_()
            both = triton.testing.do_bench(lambda: torch.autograd.grad(mhc.birkhoff_project(Rg), Rg, G))
            print(
                f"time n={n} {str(dtype)[6:]} 32768 matrices: forward {fwd * 1e3:.1f} us, "
                f"forward+backward {both * 1e3:.1f} us"
            )


def compare(a_path: str, b_path: str) -> int:
    a, b = load_file(a_path), load_file(b_path)
    if a.keys() != b.keys():
        print("the files hold different cases")
        return 1
    differ = 0
    for key in sorted(a):
        if not torch.equal(a[key], b[key]):
            differ += 1
            print(f"{key}: DIFFERENT (max abs {float((a[key].double() - b[key].double()).abs().max()):.3e})")
    print(f"bits projection across builds: {len(a) - differ} of {len(a)} tensors identical")
    return 1 if differ else 0


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("dump", help="project the fixed cases with the mhc on the path").add_argument("path")
    cmp = sub.add_parser("compare", help="compare two dumps bit for bit")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = ap.parse_args()
    if args.command == "dump":
        dump(args.path)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    raise SystemExit(main())
