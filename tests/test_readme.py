"""The README's examples run and assert what they claim; its links, commands and figures hold up."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _text() -> str:
    return README.read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", _text(), re.S)


def _section(heading: str) -> str:
    text = _text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_block_usage_example_runs():
    example = next(b for b in _blocks("python") if "mhc.MHCBlock(" in b)
    exec(compile(example, "README.md", "exec"), {})


def test_stability_example_passes_mhc_and_shows_hc_failing(capsys):
    """The example asserts mHC stable and HC not (pytest.raises inside), then prints HC's table."""
    example = next(b for b in _blocks("python") if "assert_composite_stable(" in b)
    assert 'mode="hc"' in example or 'stack("hc")' in example, example
    exec(compile(example, "README.md", "exec"), {})
    assert "64 sites" in capsys.readouterr().out


def test_quick_start_is_the_route_of_an_ordinary_machine():
    """First block: clone, PyTorch's CPU build, the package, the training command, in that order; no pinned torch."""
    first = _blocks("bash")[0]
    steps = [
        "git clone ",
        "--index-url https://download.pytorch.org/whl/cpu",
        "pip install -e .",
        "scripts/train_lm.py",
    ]
    at = [first.find(step) for step in steps]
    assert all(i >= 0 for i in at) and at == sorted(at), first
    assert "torch==" not in first, first


def test_the_test_tiers_are_given_with_their_skip_reasons():
    commands = "\n".join(_blocks("bash"))
    assert "python -m pytest -rs" in commands and "python -m pytest -m slow -rs" in commands, commands


def test_every_figure_row_says_when_and_at_which_commit():
    rows = [
        line
        for line in _section("Figures").splitlines()
        if line.startswith("| ") and not line.startswith("| what")
    ]
    assert len(rows) >= 5, rows
    for row in rows:
        measured = row.rstrip(" |").rsplit(" | ", 1)[-1]
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", measured) and re.search(
            r"\bcommits? [0-9a-f]{7}\b", measured
        ), row


def test_relative_links_and_named_repository_paths_exist():
    text = _text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    paths = re.findall(r"`((?:benchmarks|docs|notes|scripts|configs|mhc|tests)/[\w./-]+)", text)
    missing = [p for p in {*links, *paths} if "://" not in p and "<" not in p and not (ROOT / p).exists()]
    assert not missing, missing
