"""Run each mutation of tests/mutations.py on the tests that should catch it, and say which survived.

    python tests/mutation_probe.py                  # every mutation, with a baseline run of each selection
    python tests/mutation_probe.py --only tol_ignored b_res_dropped
    python tests/mutation_probe.py --list           # names, bugs and selections; runs nothing

For each mutation, pytest runs the mutation's selection in a subprocess with
``MHC_MUTATION=<name>`` (tests/conftest.py applies it before the tests import
mhc), stopping at the first failure (``-x``). A mutation is *caught* when a
test fails or errors, *survived* when everything passed. The baseline runs each
distinct selection once without a mutation first: a selection that fails on
its own catches nothing, and such a mutation is marked ``baseline fails``.
The exit status is 0 only if every mutation was caught.

It lives in tests/ beside the mutations it runs (it is test tooling, not one
of the package's scripts, and ships with the tests in the sdist); pytest does
not collect it (the name does not start with ``test_``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import mutations

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    """One pytest run of a selection: its counts from the JUnit XML report."""

    returncode: int | None  # None: timed out
    tests: int
    failed: int
    skipped: int
    seconds: float
    first_failures: list[str]

    @property
    def passed_cleanly(self) -> bool:
        return self.returncode == 0 and self.failed == 0 and self.tests > 0


def expand(selection: tuple[str, ...]) -> list[str]:
    """``selection`` with each ``*`` path replaced by the matching files (sorted), from the repository root."""
    args = []
    for arg in selection:
        matches = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(arg)) if "*" in arg else []
        # A pattern that matches nothing stays as it is: pytest then says "file not found" instead
        # of running its default, the whole suite.
        args.extend(matches or [arg])
    return args


def run_pytest(selection: tuple[str, ...], mutation: str | None, timeout: float) -> Run:
    """pytest on ``selection`` in a subprocess, with ``MHC_MUTATION=mutation`` (or none)."""
    env = {k: v for k, v in os.environ.items() if k != mutations.VARIABLE}
    if mutation is not None:
        env[mutations.VARIABLE] = mutation
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            *expand(selection),
        ]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Run(None, 0, 0, 0, time.perf_counter() - start, [])
        seconds = time.perf_counter() - start
        if not report.exists():  # pytest stopped before writing it (a usage error, say)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return Run(proc.returncode, 0, 0, 0, seconds, [" / ".join(tail)])
        return _parse(ET.parse(report).getroot(), proc.returncode, seconds)


def _parse(root: ET.Element, returncode: int, seconds: float) -> Run:
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    first = []
    for case in root.iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            message = (bad.get("message") or "").splitlines()[0][:100] if bad.get("message") else ""
            first.append(f"{case.get('name')}: {message}")
    return Run(returncode, tests, failed, skipped, seconds, first)


def verdict(run: Run, baseline: Run | None) -> str:
    if baseline is not None and not baseline.passed_cleanly:
        return "baseline fails"
    if run.returncode is None:
        return "timed out"
    if run.failed:
        return "caught"
    if run.returncode == 5 or run.tests == 0:
        return "no tests ran"
    if run.returncode == 0:
        return "SURVIVED"
    return f"pytest exit {run.returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument(
        "--list", action="store_true", help="list the mutations and their selections, run nothing"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of each selection")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (default 300)")
    args = parser.parse_args(argv)

    names = args.only or list(mutations.MUTATIONS)
    unknown = [n for n in names if n not in mutations.MUTATIONS]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; known: {', '.join(mutations.MUTATIONS)}")
    chosen = [mutations.MUTATIONS[n] for n in names]
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    bug: {m.bug}\n    selection: {shlex.join(m.selection)}")
        return 0

    baselines: dict[tuple[str, ...], Run] = {}
    if not args.no_baseline:
        for selection in dict.fromkeys(m.selection for m in chosen):
            baselines[selection] = base = run_pytest(selection, None, args.timeout)
            state = "passes" if base.passed_cleanly else f"FAILS ({'; '.join(base.first_failures[:1])})"
            print(
                f"baseline {shlex.join(selection)}: {base.tests} tests, {state} [{base.seconds:.0f} s]",
                flush=True,
            )

    rows = []
    for m in chosen:
        run = run_pytest(m.selection, m.name, args.timeout)
        result = verdict(run, baselines.get(m.selection))
        by = run.first_failures[0] if run.first_failures else ""
        rows.append((m.name, str(run.tests), result, f"{run.seconds:.0f}", m.catching_tests, by))
        print(f"{m.name}: {result} [{run.seconds:.0f} s]", flush=True)

    header = ("mutation", "tests run", "result", "s", "selection", "first failure")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(5)]
    print()
    for row in (header, *rows):
        print(" | ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + " | " + row[5][:120])
    bad = [r[0] for r in rows if r[2] != "caught"]
    missed = f"; not caught: {', '.join(bad)}" if bad else ""
    print(f"\n{len(rows) - len(bad)} of {len(rows)} mutations caught{missed}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
