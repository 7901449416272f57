#!/usr/bin/env python
"""Train residual, HC and mHC on the same data, seed and token budget; write one table and one plot.

    python scripts/compare.py                                   # tiny CPU configs
    python scripts/compare.py --variants residual,hc,mhc,mhc-sk20,mhc-lite  # all five variants
    python scripts/compare.py --preset small_gpu --tokens 300000000 --devices 0,1
    python scripts/compare.py --preset small_gpu --target-s 200 # pick the token budget by a short calibration
    python scripts/compare.py --out runs/compare_small_gpu --report-only

Each variant runs as `scripts/train_lm.py` in its own process (on its own GPU
with --devices; several devices run variants in parallel). The results land in
OUT/<variant>/ and OUT/compare.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
try:
    import mhc  # noqa: F401
except ImportError:
    sys.path.insert(0, str(REPO))

from mhc.train import load_config, prepare_data, write_comparison  # noqa: E402
from mhc.train.config import VARIANTS  # noqa: E402

TRAIN = REPO / "scripts" / "train_lm.py"


def _launch(cfg_path: Path, run_dir: Path, sets: list[str], device: str | None, log_path: Path):
    cmd = [sys.executable, str(TRAIN), "--config", str(cfg_path), "--run-dir", str(run_dir), "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ)
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    log_path.parent.mkdir(parents=True, exist_ok=True)
    f = open(log_path, "w")
    f.write("$ " + " ".join(shlex.quote(c) for c in cmd) + (f"  # CUDA_VISIBLE_DEVICES={device}" if device else "") + "\n")
    f.flush()
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), f, cmd


def run_all(jobs: list[tuple[str, Path, Path, list[str]]], devices: list[str | None]) -> dict[str, int]:
    """Run (label, config, run_dir, sets) jobs, at most one per device at a time."""
    pending, running, codes = list(jobs), {}, {}
    free = list(devices)
    while pending or running:
        while pending and free:
            label, cfg, rd, sets = pending.pop(0)
            dev = free.pop(0)
            proc, fh, cmd = _launch(cfg, rd, sets, dev, rd.parent / f"{rd.name}.log")
            print(f"[{time.strftime('%H:%M:%S')}] start {label} on {dev or 'default device'}: log {rd.parent / (rd.name + '.log')}", flush=True)
            running[label] = (proc, fh, dev)
        time.sleep(1.0)
        for label, (proc, fh, dev) in list(running.items()):
            if proc.poll() is not None:
                fh.close()
                codes[label] = proc.returncode
                free.append(dev)
                del running[label]
                print(f"[{time.strftime('%H:%M:%S')}] done {label}: exit {proc.returncode}", flush=True)
    return codes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny_cpu", help="configs/<preset>_<variant>.yaml (default: %(default)s)")
    p.add_argument("--configs", nargs="*", default=None, help="explicit config files instead of a preset")
    p.add_argument("--variants", default="residual,hc,mhc",
                   help=f"which of the preset's variants to run, comma-separated, of {','.join(VARIANTS)} (default: %(default)s)")
    p.add_argument("--out", default=None, help="output folder (default: runs/compare_<preset>)")
    p.add_argument("--tokens", type=int, default=0, help="token budget for every variant (default: the configs')")
    p.add_argument("--target-s", type=float, default=0.0, help="calibrate: pick the token budget so the slowest variant trains ~this long")
    p.add_argument("--calib-steps", type=int, default=30)
    p.add_argument("--max-time-s", type=float, default=0.0, help="wall-clock cap per variant (a capped run is flagged in the table)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--devices", default="", help="comma-separated CUDA devices; variants run in parallel, one per device")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every variant")
    p.add_argument("--report-only", action="store_true", help="only rebuild the table and plot from OUT/<variant>/")
    args = p.parse_args(argv)

    if args.configs:
        cfgs = [Path(c) for c in args.configs]
    else:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in names if v not in VARIANTS]
        if unknown:
            p.error(f"unknown variant(s) {', '.join(map(repr, unknown))} in --variants; known: {', '.join(VARIANTS)}")
        cfgs = [REPO / "configs" / f"{args.preset}_{v}.yaml" for v in names]
        missing = [str(c) for c in cfgs if not c.is_file()]
        if missing:
            p.error(f"no config for preset {args.preset!r}: {', '.join(missing)}")
    out = Path(args.out or f"runs/compare_{args.preset}")
    labels = [c.stem.split("_")[-1] if not args.configs else c.stem for c in cfgs]
    run_dirs = {lab: out / lab for lab in labels}
    if not args.report_only:
        base_sets = list(args.set) + ["progress=false"]
        if args.seed is not None:
            base_sets.append(f"seed={args.seed}")
        if args.max_time_s:
            base_sets.append(f"max_time_s={args.max_time_s}")
        devices = [d.strip() for d in args.devices.split(",") if d.strip()] or [None]
        # build the tokenizer and token caches once, before runs start in parallel
        t0 = time.time()
        prepare_data(load_config(cfgs[0], base_sets))
        print(f"data ready in {time.time() - t0:.0f} s", flush=True)
        tokens = args.tokens
        if args.target_s > 0:
            cal = [(lab, c, out / "calibration" / lab, base_sets + [f"max_steps={args.calib_steps}", "eval_interval=0", "ckpt_interval=0", "plots=false", "max_time_s=0"]) for lab, c in zip(labels, cfgs)]
            run_all(cal, devices)
            tps = {}
            for lab, _, rd, _ in cal:
                s = json.loads((rd / "summary.json").read_text())
                tps[lab] = s["tokens_per_s"]
            slowest = min(tps.values())
            cfg0 = load_config(cfgs[0], args.set)
            per_step = cfg0.batch_size * cfg0.grad_accum * cfg0.seq_len
            tokens = int(slowest * args.target_s) // per_step * per_step
            print(f"calibration tokens/s: {json.dumps({k: round(v) for k, v in tps.items()})} -> token budget {tokens:,}", flush=True)
            (out / "calibration.json").write_text(json.dumps({"tokens_per_s": tps, "target_s": args.target_s, "tokens": tokens}) + "\n")
        sets = base_sets + ([f"tokens={tokens}", "max_steps=0"] if tokens else [])
        codes = run_all([(lab, c, run_dirs[lab], sets) for lab, c in zip(labels, cfgs)], devices)
        failed = {k: v for k, v in codes.items() if v}
        if failed:
            print(f"failed runs: {failed} (see their .log files)", file=sys.stderr)
    # merge every variant found in OUT (also those of earlier invocations with other --variants)
    found = {d.name: d for d in sorted(out.iterdir()) if (d / "summary.json").is_file() and d.name != "calibration"} if out.is_dir() else {}
    order = [v for v in VARIANTS if v in found] + [k for k in found if k not in VARIANTS]
    merged = {k: found[k] for k in order} or run_dirs
    cmd = "python scripts/compare.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    res = write_comparison(merged, out, note=f"Command: `{cmd}`")
    print(res["markdown"])
    print(f"wrote {out / 'compare.md'}, {out / 'compare.json'}, {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
