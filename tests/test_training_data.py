"""The default corpus is the same everywhere, and every run records which corpus it read."""

from __future__ import annotations

import ast
import json
import platform
from pathlib import Path

import pytest

from mhc import train as T
from mhc.train import synthetic

TINY = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    seq_len=32,
    batch_size=4,
    max_corpus_mb=0.2,
    max_steps=3,
    warmup_steps=1,
    log_interval=1,
    eval_interval=0,
    eval_batches=1,
    ckpt_interval=0,
    progress=False,
    plots=False,
    threads=1,
)

# The SHA-256 of synthetic.generate_documents() at version 1 (names and texts, Corpus.sha256). A change of the
# generator must change VERSION and this pin together: runs record the hash, so old results stay identifiable.
SYNTHETIC_V1_SHA256 = "0866904147086f06d67a0e2dc7ce00fbe7e2f102cebd80fdba826db85e70bce5"


def test_the_synthetic_corpus_is_fixed_valid_python_and_the_default():
    corpus = T.load_corpus()
    assert T.TrainConfig().data == "synthetic" and T.load_config("tiny_cpu_mhc").data == "synthetic"
    assert corpus.source == f"synthetic:v{synthetic.VERSION}" and synthetic.VERSION == 1
    assert corpus.sha256() == SYNTHETIC_V1_SHA256, corpus.sha256()
    assert len(corpus.documents) == synthetic.DEFAULT_DOCUMENTS and 1.5e6 < corpus.num_chars < 3e6
    assert [n for n, _ in corpus.documents] == sorted(n for n, _ in corpus.documents)
    for _, text in corpus.documents:
        ast.parse(text)  # Python-like, and valid Python
    # document i depends only on (seed, i); the sums in its asserts are right
    assert synthetic.generate_documents(5) == corpus.documents[:5]
    assert synthetic.generate_documents(5, seed=1) != corpus.documents[:5]
    checks = [
        line.strip()
        for _, t in corpus.documents
        for line in t.splitlines()
        if line.strip().startswith("assert ")
    ]
    assert len(checks) > 100
    for line in checks:
        exec(line, {})  # noqa: S102 - text this generator wrote: the arithmetic it states holds
    # max_corpus_mb keeps whole documents in name order
    small = T.load_corpus("synthetic", max_mb=0.1)
    assert small.documents == corpus.documents[: len(small.documents)] and 0.1e6 <= small.num_chars < 0.12e6


def test_the_record_names_source_documents_hash_and_python(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 100)
    (tmp_path / "b.txt").write_text("beta " * 100)
    corpus = T.load_corpus(str(tmp_path))
    record = corpus.record()
    assert record == {"source": str(tmp_path), "documents": 2, "chars": 1100, "sha256": corpus.sha256(),
                      "python": platform.python_version()}  # fmt: skip
    assert len(record["sha256"]) == 64 and corpus.fingerprint() == record["sha256"][:16]
    (tmp_path / "b.txt").write_text("beta " * 99 + "gamma ")
    assert T.load_corpus(str(tmp_path)).sha256() != record["sha256"]  # one word changed: another corpus
    stdlib = T.load_corpus("stdlib", max_mb=0.05).record()
    assert stdlib["source"].startswith("stdlib:") and stdlib["python"] == platform.python_version()


def test_a_run_prints_and_records_its_corpus(tmp_path, capsys):
    cfg = T.TrainConfig(**TINY, run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "c"))
    summary = T.train(cfg)
    expected = T.load_corpus("synthetic", max_mb=0.2).record()
    assert summary["corpus"] == expected and summary["data"] == expected["source"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["corpus"] == expected
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("corpus synthetic:v1: ") and expected["sha256"][:16] in first, out[:500]
    assert f"Python {platform.python_version()}" in first


def test_resume_refuses_a_corpus_that_changed(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"doc{i}.txt").write_text(f"document {i} " * 2000)
    cfg = T.TrainConfig(**{**TINY, "max_steps": 4, "ckpt_interval": 2}, data=str(data), run_dir=str(tmp_path / "run"),
                        cache_dir=str(tmp_path / "c"), stop_at_step=2)  # fmt: skip
    assert T.train(cfg) == {"interrupted": True, "step": 2}
    (data / "doc3.txt").write_text("another text " * 2000)
    with pytest.raises(T.CheckpointError, match=r"the data changed since the run began.*sha256"):
        T.train(T.resume_config(tmp_path / "run"), resume=True)
    (data / "doc3.txt").write_text("document 3 " * 2000)  # the same text again: the run goes on
    assert T.train(T.resume_config(tmp_path / "run"), resume=True)["steps"] == 4


def test_readme_sample_script_finds_and_rewrites_only_its_block(tmp_path):
    """scripts/readme_sample.py: README holds one sample paragraph; a rewrite replaces it and nothing else."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "readme_sample.py"
    spec = importlib.util.spec_from_file_location("readme_sample", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    readme = script.README.read_text(encoding="utf-8")
    (match,) = script.SAMPLE.findall(readme)
    assert "runs/tiny_cpu_mhc/model" in match and match.endswith("```\n")
    diagnostics = "\n".join([
        "runs/tiny_cpu_mhc/model: MHCForCausalLM, 8 sites, mode=mhc, projection=newton, n_streams=4; 128 tokens",
        "8 sites, 128 tokens (batch shape (1, 128)); at full depth: forward gain 1+4.1e-07",
        "depth  site                               mode     fwd mean",
        "    0  model.model.layers.0.attn_mhc       mhc    1+3.0e-08",
        "    1  model.model.layers.0.mlp_mhc        mhc    1+7.5e-08",
        "key: fwd mean is the mean forward gain",
        "key: spread is the streams' spread",
        "figure: runs/tiny_cpu_mhc/model/stability.png",
    ]) + "\n"  # fmt: skip
    block = script.sample_block(diagnostics)
    assert "key:" not in block and block.splitlines()[-1] == "figure: runs/tiny_cpu_mhc/model/stability.png"
    assert len(block.splitlines()) == 6
    corpus = {"source": "synthetic:v1", "documents": 800, "chars": 2023505, "sha256": "0866904147086f06" + "0" * 48,
              "python": "3.11.7"}  # fmt: skip
    label = script.corpus_label({"corpus": corpus})
    assert (
        "`synthetic:v1`, 800 documents" in label and "0866904147086f06" in label and "Python 3.11.7" in label
    )
    new = script.SAMPLE.sub(lambda _: script.paragraph(label, block), readme, count=1)
    before, after = readme.split(match)
    assert new.startswith(before) and new.endswith(after)  # only the paragraph changed
    (again,) = script.SAMPLE.findall(new)  # and the script finds its own output again
    assert block in again and label in again
    with pytest.raises(ValueError, match="no corpus record"):
        script.corpus_label({})


def test_a_comparison_says_when_its_runs_read_different_corpora():
    from mhc.train.compare import _corpus_line

    a = {
        "source": "stdlib:/usr/lib/python3.11",
        "documents": 900,
        "chars": 1,
        "sha256": "a" * 64,
        "python": "3.11.7",
    }
    b = {**a, "source": "stdlib:/usr/lib/python3.12", "sha256": "b" * 64, "python": "3.12.1"}
    assert _corpus_line([{"label": "hc", "corpus": a}, {"label": "mhc", "corpus": a}]).startswith(
        "Corpus: stdlib:"
    )
    line = _corpus_line([{"label": "hc", "corpus": a}, {"label": "mhc", "corpus": b}, {"label": "old"}])
    assert (
        line.startswith("**The runs read different corpora**") and "mhc: stdlib:/usr/lib/python3.12" in line
    )
    assert "Python 3.11.7" in line and "old: not recorded" in line
