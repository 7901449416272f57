"""scripts/compare.py (mhc.train.compare.compare_main): refused arguments, failed variants, unreadable summaries.

The training processes are replaced by ``T.train`` in this process (``_Runner``), so that a test takes
seconds; a variant named in ``fail`` fails as a child would, with an exit status and a log.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from training_support import REPO, TINY, copy_run

from mhc import train as T
from mhc.train import compare as train_compare
from mhc.train.reporting import Throughput

SETS = {
    **TINY,
    "data": "synthetic",
    "max_corpus_mb": 0.2,
    "eval_interval": 0,
    "ckpt_interval": 0,
    "plots": False,
}


@pytest.fixture(scope="module")
def compare():
    """``scripts/compare.py`` loaded as a module: ``compare.main(argv)`` is the command line, in-process."""
    spec = importlib.util.spec_from_file_location("compare_script", REPO / "scripts" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sets(tmp_path, **kw) -> list[str]:
    return sum(
        (["--set", f"{k}={v}"] for k, v in {**SETS, "cache_dir": tmp_path / "cache", **kw}.items()), []
    )


class _Runner:
    """Stands in for ``compare.run_all``: trains each job with ``T.train`` here; a label in ``fail`` exits 2."""

    def __init__(self, fail=()):
        self.fail, self.ran = set(fail), []

    def __call__(self, jobs, devices):
        codes = {}
        for label, cfg, rd, sets in jobs:
            self.ran.append(str(rd))
            log = rd.parent / f"{rd.name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            if label in self.fail:
                log.write_text("$ python -m mhc.train ...\nerror: boom | in the test\n")
                codes[label] = 2
            else:
                T.train(T.load_config(cfg, [*sets, f"run_dir={rd}"]))
                log.write_text("$ python -m mhc.train ...\n")
                codes[label] = 0
        return codes


def _no_runs(jobs, devices):
    raise AssertionError(f"refused arguments must start no run, got {jobs}")


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_calib_steps_too_few_to_time_are_refused_and_the_least_gives_a_budget(
    tmp_path, compare, monkeypatch, capsys
):
    """Tokens/s is timed after Throughput.WARMUP_STEPS steps: fewer calibration steps gave None, then a TypeError."""
    monkeypatch.setattr(train_compare, "run_all", _Runner())
    # a target far below one step's time (a tiny CPU step can take under 5 ms): a budget of one step
    args = ["--variants", "residual,mhc", "--target-s", "1e-6", *_sets(tmp_path)]
    with pytest.raises(SystemExit) as stop:
        compare.main([*args, "--calib-steps", "3", "--out", str(tmp_path / "few")])
    line = _error_line(capsys)
    assert stop.value.code == 2 and "--calib-steps must be >= 4, got 3" in line, line
    assert Throughput.WARMUP_STEPS == 3  # the 4 above
    assert compare.main([*args, "--calib-steps", "4", "--out", str(tmp_path / "cmp")]) == 0
    cal = json.loads((tmp_path / "cmp" / "calibration.json").read_text())
    assert set(cal["tokens_per_s"]) == {"residual", "mhc"} and all(
        v > 0 for v in cal["tokens_per_s"].values()
    )
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [(r["label"], r["steps"]) for r in rows] == [
        ("residual", 1),
        ("mhc", 1),
    ]  # a tiny target: one step


def test_a_variant_failing_in_calibration_is_reported_and_the_others_go_on(
    tmp_path, compare, monkeypatch, capsys
):
    runner = _Runner(fail={"hc"})
    monkeypatch.setattr(train_compare, "run_all", runner)
    out = tmp_path / "cmp"
    code = compare.main(["--variants", "residual,hc", "--target-s", "1e-6", "--calib-steps", "4",
                         "--out", str(out), *_sets(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    log = out / "calibration" / "hc.log"
    assert code == 1 and "Traceback" not in err, err
    assert f"hc failed: calibration exit 2: error: boom | in the test (log {log})" in err, err
    assert runner.ran == [
        str(out / "calibration" / "residual"),
        str(out / "calibration" / "hc"),
        str(out / "residual"),
    ]
    assert json.loads((out / "calibration.json").read_text())["failed"].keys() == {"hc"}
    rows = json.loads((out / "compare.json").read_text())
    assert [r["label"] for r in rows] == ["residual", "hc"] and rows[0]["steps"] == 1
    assert rows[1]["missing"] and rows[1]["failed"].startswith("calibration exit 2"), rows[1]


def test_every_variant_failing_in_calibration_stops_cleanly(tmp_path, compare, monkeypatch, capsys):
    runner = _Runner(fail={"residual", "mhc"})
    monkeypatch.setattr(train_compare, "run_all", runner)
    out = tmp_path / "cmp"
    code = compare.main(
        ["--variants", "residual,mhc", "--target-s", "10", "--out", str(out), *_sets(tmp_path)]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and "calibration failed for every variant" in err, err
    assert runner.ran == [
        str(out / "calibration" / "residual"),
        str(out / "calibration" / "mhc"),
    ]  # no main run
    md = (out / "compare.md").read_text()
    assert (
        "| residual | (run failed: calibration exit 2" in md
        and "| mhc | (run failed: calibration exit 2" in md
    )


def test_a_failed_run_gets_a_row_saying_so(tmp_path, compare, monkeypatch, capsys):
    """A failed variant used to be left out of the table, as if it had not been asked for."""
    monkeypatch.setattr(train_compare, "run_all", _Runner(fail={"mhc"}))
    out = tmp_path / "cmp"
    code = compare.main(["--variants", "residual,mhc", "--out", str(out), *_sets(tmp_path, max_steps=1)])
    err = capsys.readouterr().err
    why = f"exit 2: error: boom | in the test (log {out / 'mhc.log'})"
    rows = json.loads((out / "compare.json").read_text())
    assert [r["label"] for r in rows] == ["residual", "mhc"] and rows[0]["steps"] == 1
    assert rows[1] == {"label": "mhc", "missing": True, "failed": why}
    assert code == 1 and f"mhc failed ({why})" in err, err
    lines = (out / "compare.md").read_text().splitlines()
    row = next(ln for ln in lines if ln.startswith("| mhc |"))
    cells = re.compile(r"(?<!\\)\|")  # the "|" of its reason escaped, so that it stays one cell
    assert "run failed: exit 2" in row and len(cells.split(row)) == len(cells.split(lines[0])), row


@pytest.mark.parametrize("variants", ["", ",", " , "])
def test_variants_naming_none_are_refused(tmp_path, compare, monkeypatch, capsys, variants):
    monkeypatch.setattr(train_compare, "run_all", _no_runs)
    with pytest.raises(SystemExit) as stop:
        compare.main(["--variants", variants, "--out", str(tmp_path / "cmp"), *_sets(tmp_path)])
    line = _error_line(capsys)
    assert stop.value.code == 2 and f"--variants {variants!r} names no variant" in line, line


def test_configs_of_one_label_are_refused(tmp_path, compare, monkeypatch, capsys):
    """a/x.yaml and b/x.yaml both ran into OUT/x, the second deleting the first (--overwrite): one row of two."""
    monkeypatch.setattr(train_compare, "run_all", _no_runs)
    paths = []
    for folder, variant in (("a", "mhc"), ("b", "residual"), ("c", "hc")):
        (tmp_path / folder).mkdir()
        paths.append(tmp_path / folder / ("calibration.yaml" if folder == "c" else "x.yaml"))
        paths[-1].write_text(f"base: tiny_cpu_{variant}\n")
    out = tmp_path / "cmp"
    cases = [
        (
            ["--configs", str(paths[0]), str(paths[1])],
            f"{str(paths[0])!r} and {str(paths[1])!r} both get the label 'x'",
        ),
        (["--variants", "mhc,hc,mhc"], "'tiny_cpu_mhc' and 'tiny_cpu_mhc' both get the label 'mhc'"),
        (["--configs", str(paths[2])], "gets the label 'calibration', which OUT/calibration/ has"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as stop:
            compare.main([*args, "--out", str(out), *_sets(tmp_path)])
        line = _error_line(capsys)
        assert stop.value.code == 2 and message in line, (args, line)
    assert not out.exists()


def test_report_only_names_an_unreadable_summary(tmp_path, compare, full_run, capsys):
    """A corrupt summary.json, or one of an older format, gets a row naming it instead of a traceback."""
    out = tmp_path / "cmp"
    copy_run(Path(full_run[0].run_dir), out / "mhc")
    summary = json.loads((out / "mhc" / "summary.json").read_text())
    copy_run(out / "mhc", out / "residual")
    (out / "residual" / "summary.json").write_text(
        json.dumps({k: v for k, v in summary.items() if k != "n_streams"})
    )
    copy_run(out / "mhc", out / "hc")
    (out / "hc" / "summary.json").write_text('{"variant": "hc", ')  # torn
    (out / "other").mkdir()
    (out / "other" / "summary.json").write_text("[]")
    assert compare.main(["--out", str(out), "--report-only"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    rows = {r["label"]: r for r in json.loads((out / "compare.json").read_text())}
    assert list(rows) == ["residual", "hc", "mhc", "other"] and rows["mhc"]["n_streams"] == 4
    expected = {
        "residual": f"{out / 'residual' / 'summary.json'} lacks n_streams",
        "hc": f"{out / 'hc' / 'summary.json'}: JSONDecodeError",
        "other": f"{out / 'other' / 'summary.json'}: a JSON list, not an object",
    }
    md = (out / "compare.md").read_text()
    for label, why in expected.items():
        assert rows[label]["missing"] and rows[label]["unreadable"].startswith(why), rows[label]
        assert (
            f"| {label} | (unreadable summary: {why}" in md
            and f"warning: unreadable summary, its row left empty: {why}" in err
        )
