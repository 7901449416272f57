#!/usr/bin/env python
"""Regenerate README.md's sample output of the main job, labelled with the corpus it was trained on.

    python scripts/readme_sample.py                  # train the main job in a temporary folder, then rewrite
    python scripts/readme_sample.py --work /tmp/s    # keep the run (runs/tiny_cpu_mhc/ under /tmp/s)
    python scripts/readme_sample.py --reuse /tmp/s   # a finished main job under /tmp/s: no training
    python scripts/readme_sample.py --dry-run        # print the new paragraph and block, change nothing

The main job is `mhc-train` with no arguments (the preset tiny_cpu_mhc: a few minutes on one CPU
thread). The README's block is what `mhc-diagnostics runs/tiny_cpu_mhc/model` (python -m
mhc.diagnostics) prints after it, less the key lines under the table, and the figure beside it is
docs/diagnostics/tiny_cpu_mhc_stability.png. The script runs both commands from a work folder (so
the printed paths read runs/tiny_cpu_mhc/...), with this checkout's mhc, and replaces the block and
the sentence introducing it (which names the corpus: source, documents, SHA-256, Python) in place.
Nothing else in the README changes; the prose after the block quotes some of its numbers, so read
it again after a regeneration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
FIGURE = REPO / "docs" / "diagnostics" / "tiny_cpu_mhc_stability.png"
RUN = Path("runs") / "tiny_cpu_mhc"  # where the main job writes, relative to the work folder
# The introducing sentence and the fenced block after it.
SAMPLE = re.compile(r"^After the main job[^\n]*(?:\n[^\n`]+)*?:\n\n```\n.*?\n```\n", re.S | re.M)
ROW = re.compile(r"^\s*\d+\s+\S")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env


def _run(cmd: list[str], cwd: Path) -> str:
    print("$ " + " ".join(cmd), f"(in {cwd})", flush=True)
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def sample_block(diagnostics_out: str) -> str:
    """The README's block from the diagnostics output: everything but the key lines under the table."""
    lines = diagnostics_out.rstrip("\n").splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("depth ")), None)
    figure = next((line for line in lines if line.startswith("figure: ")), None)
    if header is None or figure is None:
        raise ValueError(
            f"unexpected diagnostics output (no table header or figure line):\n{diagnostics_out}"
        )
    end = header + 1
    while end < len(lines) and ROW.match(lines[end]):
        end += 1
    return "\n".join(lines[:end] + [figure])


def corpus_label(summary: dict) -> str:
    """Which corpus the run read, from its summary.json."""
    c = summary.get("corpus")
    if not c:
        raise ValueError(
            "the run's summary.json has no corpus record (trained by an older mhc): train it again"
        )
    return (f"corpus `{c['source']}`, {c['documents']} documents, {c['chars'] / 1e6:.2f}M characters, "
            f"SHA-256 `{c['sha256'][:16]}…`, Python {c['python']}")  # fmt: skip


def paragraph(label: str, block: str) -> str:
    """The sentence introducing the block, and the block."""
    return (
        f"After the main job ({label}; `python scripts/readme_sample.py` regenerates this) it prints\n"
        f"(the key lines under the table left out):\n\n```\n{block}\n```\n"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, help="work folder (default: a temporary one, removed afterwards)")
    p.add_argument(
        "--reuse",
        type=Path,
        metavar="WORK",
        help="a work folder whose runs/tiny_cpu_mhc/ is finished: no training",
    )
    p.add_argument("--readme", type=Path, default=README, help="the README to rewrite (default: %(default)s)")
    p.add_argument("--figure", type=Path, default=FIGURE, help="where the figure goes (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the new paragraph; write nothing")
    args = p.parse_args(argv)
    if args.work and args.reuse:
        p.error("--work and --reuse contradict each other: pick one")

    text = args.readme.read_text(encoding="utf-8")
    if len(SAMPLE.findall(text)) != 1:
        sys.exit(
            f"{args.readme}: expected exactly one 'After the main job ...' paragraph with a fenced block"
        )
    temporary = None
    work = args.reuse or args.work
    if work is None:
        work = temporary = Path(tempfile.mkdtemp(prefix="mhc-readme-"))
    try:
        work.mkdir(parents=True, exist_ok=True)
        if args.reuse is None:
            _run([sys.executable, "-m", "mhc.train", "--overwrite", "--progress", "false"], cwd=work)
        summary_path = work / RUN / "summary.json"
        if not summary_path.is_file():
            sys.exit(f"{summary_path} does not exist: the main job did not finish there")
        label = corpus_label(json.loads(summary_path.read_text()))
        out = _run([sys.executable, "-m", "mhc.diagnostics", str(RUN / "model")], cwd=work)
        new = paragraph(label, sample_block(out))
        if args.dry_run:
            print(new)
            return 0
        args.readme.write_text(SAMPLE.sub(lambda _: new, text, count=1), encoding="utf-8")
        args.figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / RUN / "model" / "stability.png", args.figure)
        print(f"rewrote the sample in {args.readme} ({label}) and {args.figure}")
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
