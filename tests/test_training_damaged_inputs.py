"""Damaged or foreign inputs give one clear error, or are rebuilt: re-signed trainer states, token and
tokenizer caches, run folders inside the data, and data paths that are no file or folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from training_support import copy_run, tiny_cfg

from mhc import train as T
from mhc.train.checkpoint import sha256_file

SHORT = dict(num_layers=1, max_steps=2, ckpt_interval=2, eval_interval=0, eval_batches=1, plots=False)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-step run whose one checkpoint is step 2, to copy."""
    tmp = tmp_path_factory.mktemp("damaged")
    T.train(tiny_cfg(tmp, "run", **SHORT))
    return tmp / "run"


def _resign(ckpt: Path, name: str) -> None:
    """Hash ``name`` into manifest.json again, as anyone who can write the folder can."""
    mf = ckpt / "manifest.json"
    manifest = json.loads(mf.read_text())
    manifest["files"][name] = {"size": (ckpt / name).stat().st_size, "sha256": sha256_file(ckpt / name)}
    mf.write_text(json.dumps(manifest))


def _edited_run(finished_run: Path, tmp_path: Path, edit) -> T.TrainConfig:
    """A copy of the run whose trainer_state.json ``edit`` changed (manifest re-signed); its config."""
    rd = copy_run(finished_run, tmp_path / "run")
    ckpt = T.find_latest_checkpoint(rd)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    edit(state)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _resign(ckpt, "trainer_state.json")
    return tiny_cfg(tmp_path, "run", **SHORT)


# ----------------------------------------------------------------------------- A. re-signed trainer states

EDITS = {
    "no rng": (lambda s: s.pop("rng"), "has no field 'rng'"),
    "empty rng": (lambda s: s.update(rng=[]), r"field 'rng' is \[\], not a list of 1 RNG state"),
    "rng without torch state": (lambda s: s["rng"][0].pop("torch"), "field 'rng' is"),
    "no optimizer": (lambda s: s.pop("optimizer"), "has no field 'optimizer'"),
    "no step": (lambda s: s.pop("step"), "has no field 'step'"),
    "step text": (lambda s: s.update(step="abc"), r"field 'step' is 'abc', not an integer >= 0"),
    "step negative": (lambda s: s.update(step=-5), r"field 'step' is -5, not an integer >= 0"),
    "step float": (lambda s: s.update(step=2.5), r"field 'step' is 2.5, not an integer >= 0"),
    "step of another folder": (
        lambda s: s.update(step=5),
        r"field 'step' is 5, not 2, the step in the folder",
    ),
    "scheduler behind": (
        lambda s: s["scheduler"].update(last_epoch=1),
        r"field 'scheduler' is .*, not a scheduler state at step 2",
    ),
    "empty spikes": (lambda s: s.update(spikes={}), r"field 'spikes' is \{\}, not a loss-spike state"),
    "config a list": (lambda s: s.update(config=[]), "trainer_state.json holds no run config"),
    "overrides not records": (lambda s: s.update(overrides=[1]), "field 'overrides' is"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_resigned_trainer_state_with_a_bad_field_is_refused_naming_it(tmp_path, finished_run, name):
    edit, message = EDITS[name]
    cfg = _edited_run(finished_run, tmp_path, edit)
    with pytest.raises(T.CheckpointError, match=message) as e:
        T.train(cfg, resume=True)
    assert "step_00000002" in str(e.value) and "trainer_state.json" in str(e.value), str(e.value)


def test_a_resigned_but_unchanged_trainer_state_still_resumes(tmp_path, finished_run, cli, capsys):
    """The control for the refusals above: the editing and re-signing alone break nothing."""
    cfg = _edited_run(finished_run, tmp_path, lambda s: None)
    assert T.train(cfg, resume=True)["steps"] == 2
    # and the command line reports a refusal in one line, exit status 2
    ckpt = T.find_latest_checkpoint(cfg.run_dir)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["spikes"] = {}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _resign(ckpt, "trainer_state.json")
    assert cli.main(["--resume", "--run-dir", cfg.run_dir]) == 2
    err = capsys.readouterr().err
    assert "field 'spikes'" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "aliases, message",
    [(["x"], r"field 'aliases' is \['x'\], not a mapping"), ({"lm_head.weight": 3}, "field 'aliases' is")],
)
def test_a_resigned_manifest_with_bad_aliases_is_refused(tmp_path, finished_run, aliases, message):
    rd = copy_run(finished_run, tmp_path / "run")
    ckpt = T.find_latest_checkpoint(rd)
    mf = ckpt / "manifest.json"
    mf.write_text(json.dumps({**json.loads(mf.read_text()), "aliases": aliases}))
    with pytest.raises(T.CheckpointError, match=message):
        T.load_checkpoint_state(ckpt)
    with pytest.raises(T.CheckpointError, match=message):
        T.train(tiny_cfg(tmp_path, "run", **SHORT), resume=True)


def test_an_alias_cannot_replace_a_weight_the_checkpoint_holds(tmp_path, finished_run):
    rd = copy_run(finished_run, tmp_path / "run")
    ckpt = T.find_latest_checkpoint(rd)
    sd, _ = T.load_checkpoint_state(ckpt)
    first, second = list(sd)[:2]
    mf = ckpt / "manifest.json"
    mf.write_text(json.dumps({**json.loads(mf.read_text()), "aliases": {first: second}}))
    with pytest.raises(T.CheckpointError, match=f"aliases {first}, which model.safetensors already holds"):
        T.load_checkpoint_state(ckpt)


# ----------------------------------------------------------------------------- B. damaged caches


def _bpe_cfg(tmp_path: Path) -> T.TrainConfig:
    return T.TrainConfig(tokenizer="bpe", bpe_vocab_size=300, max_corpus_mb=0.05, seq_len=16,
                         cache_dir=str(tmp_path / "cache"))  # fmt: skip


def test_a_damaged_token_cache_is_packed_again_with_a_log_line(tmp_path):
    cfg = _bpe_cfg(tmp_path)
    ref, tok, _ = T.prepare_data(cfg, log=lambda *_: None)
    (train_npy,) = Path(cfg.cache_dir).glob("tokens-*-train.npy")
    (val_npy,) = Path(cfg.cache_dir).glob("tokens-*-val.npy")

    def again() -> str:
        lines = []
        data, _, _ = T.prepare_data(cfg, log=lines.append)
        assert np.array_equal(data.train, ref.train) and np.array_equal(data.val, ref.val)
        return "\n".join(lines)

    train_npy.write_bytes(train_npy.read_bytes()[:50])  # truncated
    log = again()
    assert f"the token cache {train_npy} is unusable: it could not be read" in log, log
    assert np.array_equal(np.load(train_npy), ref.train)  # rewritten
    bad = ref.val.copy()
    bad[3] = tok.vocab_size  # a valid .npy, one id past the vocabulary: an IndexError in the embedding
    np.save(val_npy, bad)
    log = again()
    assert (
        f"{val_npy} is unusable: token id {tok.vocab_size} is outside the vocabulary of {tok.vocab_size}"
        in log
    )
    np.save(val_npy, ref.val.astype(np.float32))
    assert "not a 1-D array of integers" in again()
    assert "token cache" not in again()  # a sound cache is read as it is


def test_a_damaged_bpe_cache_is_trained_again_or_named(tmp_path):
    cfg = _bpe_cfg(tmp_path)
    _, tok, corpus = T.prepare_data(cfg, log=lambda *_: None)
    (bpe_json,) = Path(cfg.cache_dir).glob("bpe-*.json")
    bpe_json.write_text(bpe_json.read_text()[:100])
    lines = []
    _, tok2, _ = T.prepare_data(cfg, log=lines.append)
    assert any(f"the cached BPE {bpe_json} could not be read" in line for line in lines), lines
    assert tok2.fingerprint() == tok.fingerprint() and T.build_tokenizer(cfg, None, corpus.fingerprint())
    # without the texts to train it on, the error names the file and what to do
    bpe_json.write_text("{")
    with pytest.raises(T.DataError, match=f"{bpe_json.name} could not be read .*delete it"):
        T.build_tokenizer(cfg, None, corpus.fingerprint())


def test_a_tokenizer_with_ids_past_its_vocabulary_is_refused(tmp_path):
    """A tokenizer file whose ids skip numbers gives ids the embedding has no row for."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0, "b": 7}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "data.txt").write_text("ab" * 10000)
    cfg = T.TrainConfig(tokenizer="gpt2", tokenizer_path=str(tmp_path / "tokenizer.json"),
                        data=str(tmp_path / "data.txt"), seq_len=16, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(T.DataError, match="token id 7 is outside the vocabulary of 3 tokens"):
        T.prepare_data(cfg, log=lambda *_: None)


# ----------------------------------------------------------------------------- C. run folders in the data


def test_a_run_inside_its_data_folder_leaves_its_folder_out_and_resumes(tmp_path, capsys):
    data = tmp_path / "dd"
    (data / "run").mkdir(parents=True)
    (data / "some.txt").write_text("def f(x):\n    return x * 2\n" * 1000)
    (data / "run" / "notes.txt").write_text("a note in the run's folder, from before its start")
    kw = dict(SHORT, data=str(data), max_corpus_mb=0, max_steps=4, stop_at_step=2)
    assert T.train(tiny_cfg(data, "run", **kw)) == {"interrupted": True, "step": 2}
    assert f"left out training runs' folders (their outputs are no training text): {data / 'run'}" in (
        capsys.readouterr().out
    )
    summary = T.train(T.resume_config(data / "run"), resume=True)
    assert summary["steps"] == 4 and summary["corpus"]["documents"] == 1
    corpus = T.load_corpus(str(data))
    assert [n for n, _ in corpus.documents] == ["dd/some.txt"] and corpus.skipped_runs == [data / "run"]
    # a project holding earlier runs under runs/: their folders are left out, wherever they are
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "a.txt").write_text("alpha " * 100)
    shutil.copytree(data / "run", project / "runs" / "old")
    os.remove(project / "runs" / "old" / ".lock")  # a finished run's files alone mark it too
    corpus = T.load_corpus(str(project))
    assert [n for n, _ in corpus.documents] == ["project/src/a.txt"], corpus.documents
    assert corpus.skipped_runs == [project / "runs" / "old"]
    # a run's own folder given as data: only its outputs are left out
    corpus = T.load_corpus(str(data / "run"))
    assert [n for n, _ in corpus.documents] == ["run/notes.txt"] and corpus.skipped_runs == [data / "run"]


# ----------------------------------------------------------------------------- D. no file, no folder


def test_a_data_path_that_is_neither_file_nor_folder_says_so(tmp_path):
    with pytest.raises(T.DataError, match="is neither a regular file nor a folder") as e:
        T.load_corpus(os.devnull)
    assert not isinstance(e.value, T.DataNotFoundError)
    with pytest.raises(T.DataNotFoundError, match="does not exist"):
        T.load_corpus(str(tmp_path / "nowhere"))
