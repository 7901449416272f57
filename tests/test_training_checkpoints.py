"""Checkpoints and the run directory: nothing foreign deleted, safe pruning and `latest`, no pickle, exact manifests."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mhc import train as T
from mhc.train.checkpoint import (
    CHECKPOINT_FORMAT,
    decode_tree,
    encode_tree,
    list_checkpoints,
    load_checkpoint_state,
    prune_checkpoints,
    save_checkpoint,
    sha256_file,
)

TINY = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    seq_len=32,
    batch_size=4,
    data="stdlib",
    max_corpus_mb=0.3,
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


def tiny_cfg(tmp_path: Path, name: str, **kw) -> T.TrainConfig:
    return T.TrainConfig(
        **{**TINY, "run_dir": str(tmp_path / name), "cache_dir": str(tmp_path / "cache"), **kw}
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 3-step run with one (final) checkpoint, to copy."""
    tmp = tmp_path_factory.mktemp("ckpt")
    T.train(tiny_cfg(tmp, "run"))
    return tmp / "run"


def _copy(src: Path, dst: Path) -> tuple[Path, Path]:
    shutil.copytree(src, dst)
    return dst, T.find_latest_checkpoint(dst)


def _rewrite_manifest(ckpt: Path, edit) -> None:
    """Change manifest.json the way someone who can write the folder could (hashes recomputed)."""
    mf = ckpt / "manifest.json"
    manifest = json.loads(mf.read_text())
    edit(manifest)
    mf.write_text(json.dumps(manifest))


def _hash_entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


# ----------------------------------------------------------------------------- files the run did not write


def test_fresh_run_refuses_outputs_it_did_not_write(tmp_path):
    rd = tmp_path / "mine"
    (rd / "model").mkdir(parents=True)
    (rd / "model" / "weights.bin").write_bytes(b"someone else's model")
    (rd / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"already holds model .*--overwrite"):
        T.train(tiny_cfg(tmp_path, "mine"))
    assert (rd / "model" / "weights.bin").read_bytes() == b"someone else's model"
    # a summary.json alone is in the way too
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "summary.json").write_text("{}")
    with pytest.raises(FileExistsError, match="summary.json"):
        T.train(tiny_cfg(tmp_path, "other"))
    assert (tmp_path / "other" / "summary.json").read_text() == "{}"
    # --resume on a folder without a checkpoint does not adopt them either
    with pytest.raises(FileExistsError, match="holds no checkpoint, but it holds model"):
        T.train(tiny_cfg(tmp_path, "mine"), resume=True)
    assert (rd / "model" / "weights.bin").exists()
    # --overwrite deletes the run outputs, and only those
    T.train(tiny_cfg(tmp_path, "mine"), overwrite=True)
    assert not (rd / "model" / "weights.bin").exists() and (rd / "model" / "model.safetensors").is_file()
    assert (rd / "notes.txt").read_text() == "keep me"


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path, finished_run):
    rd, _ = _copy(finished_run, tmp_path / "run")
    ck = rd / "checkpoints"
    stale = [ck / ".tmp-step_00000002-99999", rd / ".tmp-model-99999", rd / ".old-model-123"]
    for d in stale:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    stale_files = [ck / ".latest.tmp-99999", rd / ".summary.json.tmp-4242"]
    for f in stale_files:
        f.write_text("partial")
    keep = [rd / ".tmp-notes", ck / ".tmp-mine", rd / "notes.tmp-1"]
    for f in keep:
        f.write_text("a user's file")
    T.train(
        tiny_cfg(tmp_path, "run"), resume=True
    )  # a finished run: evaluates, writes model/ and the summary again
    assert not any(p.exists() for p in stale + stale_files), [p for p in stale + stale_files if p.exists()]
    assert all(f.read_text() == "a user's file" for f in keep)


# ----------------------------------------------------------------------------- pruning and `latest`


def _save(root: Path, step: int, keep: int) -> Path:
    cfg = tiny_cfg(root.parent, "unused")
    model = T.build_model(cfg, 257, 256)
    state = {"format": CHECKPOINT_FORMAT, "step": step, "config": cfg.to_dict()}
    return save_checkpoint(root, step, model.config, model.state_dict(), state, T.ByteTokenizer(), keep)


def test_pruning_never_removes_the_new_or_the_latest_checkpoint(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _save(root, 3, keep=0)
    _save(root, 9, keep=0)  # left behind by an attempt that a resume from step 3 abandoned
    (root / "latest").write_text("step_00000003\n")
    new = _save(root, 6, keep=1)
    assert new.is_dir() and T.find_latest_checkpoint(tmp_path / "run") == new
    T.verify_checkpoint(new)
    assert [p.name for _, p in list_checkpoints(root)] == ["step_00000006"]
    # keep=2: this run's earlier checkpoint is kept before the abandoned later one
    _save(root, 3, keep=0)
    _save(root, 9, keep=0)
    (root / "latest").write_text("step_00000003\n")
    _save(root, 6, keep=2)
    assert [p.name for _, p in list_checkpoints(root)] == ["step_00000003", "step_00000006"]
    # the one `latest` names survives too, whatever `keep` says
    (root / "latest").write_text("step_00000003\n")
    prune_checkpoints(root, keep=1, current=root / "step_00000006")
    assert [p.name for _, p in list_checkpoints(root)] == ["step_00000003", "step_00000006"]


@pytest.mark.parametrize("named", ["../../etc", "/etc", "step_00000003/../../..", "..", "step_3", ""])
def test_latest_cannot_name_anything_outside_checkpoints(tmp_path, finished_run, named):
    rd, _ = _copy(finished_run, tmp_path / "run")
    (rd / "checkpoints" / "latest").write_text(named + "\n")
    with pytest.raises(T.CheckpointError, match="not a checkpoint of this run"):
        T.find_latest_checkpoint(rd)
    with pytest.raises(T.CheckpointError, match="not a checkpoint of this run"):
        T.train(tiny_cfg(tmp_path, "run"), resume=True)


def test_latest_and_checkpoints_cannot_be_symlinks(tmp_path, finished_run):
    rd, ckpt = _copy(finished_run, tmp_path / "run")
    outside = tmp_path / "outside"
    shutil.copytree(ckpt, outside)
    (rd / "checkpoints" / "step_00000099").symlink_to(outside, target_is_directory=True)
    (rd / "checkpoints" / "latest").write_text("step_00000099\n")
    with pytest.raises(T.CheckpointError, match="is a symlink"):
        T.find_latest_checkpoint(rd)
    (rd / "checkpoints" / "latest").unlink()
    (tmp_path / "latest-elsewhere").write_text(ckpt.name + "\n")
    (rd / "checkpoints" / "latest").symlink_to(tmp_path / "latest-elsewhere")
    with pytest.raises(T.CheckpointError, match="is a symlink"):
        T.train(tiny_cfg(tmp_path, "run"), resume=True)


# ----------------------------------------------------------------------------- manifests


def test_manifest_must_list_exactly_the_checkpoint_files(tmp_path, finished_run):
    def broken(name, plant=None, edit=None):
        _, ckpt = _copy(finished_run, tmp_path / name)
        if plant:
            plant(ckpt)
        if edit:
            _rewrite_manifest(ckpt, lambda m: edit(m, ckpt))
        return ckpt

    ckpt = broken("empty", edit=lambda m, c: m.update(files={}))
    with pytest.raises(T.CheckpointError, match="lists no files"):
        T.verify_checkpoint(ckpt)
    ckpt = broken("unlisted", edit=lambda m, c: m["files"].pop("trainer_state.json"))
    with pytest.raises(T.CheckpointError, match=r"does not list \['trainer_state.json'\]"):
        T.verify_checkpoint(ckpt)
    ckpt = broken("extra-on-disk", plant=lambda c: (c / "notes.txt").write_text("x"))
    with pytest.raises(T.CheckpointError, match=r"holds \['notes.txt'\], which manifest.json does not list"):
        T.verify_checkpoint(ckpt)
    ckpt = broken(
        "extra-listed",
        plant=lambda c: (c / "run_me.py").write_text("print('hi')"),
        edit=lambda m, c: m["files"].update({"run_me.py": _hash_entry(c / "run_me.py")}),
    )
    with pytest.raises(T.CheckpointError, match=r"lists files a checkpoint does not hold: \['run_me.py'\]"):
        T.verify_checkpoint(ckpt)
    broken("missing", plant=lambda c: (c / "tokenizer_config.json").unlink())
    with pytest.raises(T.CheckpointError, match="partial: tokenizer_config.json is missing"):
        T.train(tiny_cfg(tmp_path, "missing"), resume=True)


# ----------------------------------------------------------------------------- nothing is unpickled


class _WritesMarker:
    """Unpickling this object opens (creates) the marker file: code from the checkpoint ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_pickle_in_the_trainer_state_never_runs(tmp_path, finished_run):
    marker = tmp_path / "pwned"
    payload = tmp_path / "payload.pt"
    torch.save(_WritesMarker(marker), payload)
    assert not marker.exists()

    # 1. format 2, with the pickle added as trainer_state.pt and listed in a rehashed manifest
    rd, ckpt = _copy(finished_run, tmp_path / "listed")
    shutil.copy(payload, ckpt / "trainer_state.pt")
    _rewrite_manifest(
        ckpt, lambda m: m["files"].update({"trainer_state.pt": _hash_entry(ckpt / "trainer_state.pt")})
    )
    with pytest.raises(T.CheckpointError, match="does not hold"):
        T.train(tiny_cfg(tmp_path, "listed"), resume=True)
    # 2. the pickle in place of trainer_state.json, manifest rehashed
    rd, ckpt = _copy(finished_run, tmp_path / "replaced")
    shutil.copy(payload, ckpt / "trainer_state.json")
    _rewrite_manifest(
        ckpt, lambda m: m["files"].update({"trainer_state.json": _hash_entry(ckpt / "trainer_state.json")})
    )
    with pytest.raises(T.CheckpointError, match="could not be read"):
        T.load_checkpoint_state(ckpt)
    # 3. an old-format (1) checkpoint: trainer_state.pt is a pickle; a clear error, never loaded
    rd, ckpt = _copy(finished_run, tmp_path / "old")
    for name in ("trainer_state.json", "trainer_tensors.safetensors"):
        (ckpt / name).unlink()
    shutil.copy(payload, ckpt / "trainer_state.pt")

    def as_format_1(m):
        m["format"] = 1
        m["files"] = {p.name: _hash_entry(p) for p in ckpt.iterdir() if p.name != "manifest.json"}

    _rewrite_manifest(ckpt, as_format_1)
    with pytest.raises(
        T.CheckpointError, match=r"format 1, written by an older mhc.*never loads.*--overwrite"
    ):
        T.train(tiny_cfg(tmp_path, "old"), resume=True)
    assert not marker.exists(), "code from a checkpoint ran"


def test_trainer_state_round_trip_and_refusals(tmp_path):
    tree = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}, 7: {}},
        "betas": (0.9, 0.95),
        "values": [1, 2.5, float("nan"), float("inf"), None, True, "x"],
    }
    js, tensors = encode_tree(tree)
    back = decode_tree(json.loads(json.dumps(js)), tensors)
    assert set(back["state"]) == {0, 7} and back["betas"] == (0.9, 0.95)
    assert (
        torch.equal(back["state"][0]["exp_avg"], tree["state"][0]["exp_avg"])
        and back["state"][0]["step"].shape == ()
    )
    assert (
        back["values"][:2] == [1, 2.5]
        and np.isnan(back["values"][2])
        and back["values"][3:] == [float("inf"), None, True, "x"]
    )
    for bad in (np.zeros(3), object(), {1: 2, "a": 3}, {"__tuple__": 1}):
        with pytest.raises(TypeError):
            encode_tree({"x": bad})
    # the RNG states go through a checkpoint and come back exactly
    cfg = tiny_cfg(tmp_path, "rng")
    model = T.build_model(cfg, 257, 256)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    saved = T.rng_state(torch.device("cpu"))
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    state = {"format": CHECKPOINT_FORMAT, "step": 1, "rng": [saved], "config": cfg.to_dict()}
    ckpt = save_checkpoint(
        tmp_path / "rng" / "checkpoints", 1, model.config, model.state_dict(), state, T.ByteTokenizer(), 0
    )
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    _, loaded = load_checkpoint_state(ckpt)
    T.set_rng_state(loaded["rng"][0], torch.device("cpu"))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect
    assert not list(ckpt.glob("*.pt")) and os.path.getsize(ckpt / "trainer_state.json") > 0


def test_a_checkpoint_whose_tensors_do_not_fit_is_refused_naming_it(tmp_path, finished_run):
    """Tensors of another shape, hashes recomputed: a CheckpointError (exit 2), not a traceback from
    load_state_dict or, for the optimizer's moments, from inside AdamW.step."""
    from safetensors.torch import load_file, save_file

    def reshape_first(path: Path, keep) -> str:
        tensors = load_file(str(path))
        name = next(k for k, v in tensors.items() if v.dim() == 2 and keep(k))
        tensors[name] = torch.zeros(
            tensors[name].shape[0] + 1, tensors[name].shape[1], dtype=tensors[name].dtype
        )
        save_file(tensors, str(path))
        return name

    run, ckpt = _copy(finished_run, tmp_path / "model_shape")
    reshape_first(ckpt / "model.safetensors", lambda k: True)
    _rewrite_manifest(
        ckpt, lambda m: m["files"].update({"model.safetensors": _hash_entry(ckpt / "model.safetensors")})
    )
    with pytest.raises(T.CheckpointError, match="(?s)does not fit the model: .*size mismatch"):
        T.train(tiny_cfg(tmp_path, "model_shape"), resume=True)

    run, ckpt = _copy(finished_run, tmp_path / "moment_shape")
    tensors_file = next(
        p for p in ckpt.iterdir() if p.name.startswith("trainer") and p.suffix == ".safetensors"
    )
    reshape_first(tensors_file, lambda k: True)  # keys t0, t1, ...: the first 2-d one is a moment
    _rewrite_manifest(ckpt, lambda m: m["files"].update({tensors_file.name: _hash_entry(tensors_file)}))
    with pytest.raises(
        T.CheckpointError, match="(?s)optimizer or scheduler state does not fit this run: .*exp_avg"
    ):
        T.train(tiny_cfg(tmp_path, "moment_shape"), resume=True)

    run, ckpt = _copy(finished_run, tmp_path / "bad_json")
    (ckpt / "trainer_state.json").write_text("{not json")
    _rewrite_manifest(
        ckpt, lambda m: m["files"].update({"trainer_state.json": _hash_entry(ckpt / "trainer_state.json")})
    )
    with pytest.raises(T.CheckpointError, match="trainer_state.json could not be read"):
        T.train(tiny_cfg(tmp_path, "bad_json"), resume=True)


def test_a_resumed_optimizer_runs_this_machines_implementation():
    """A checkpoint's param groups carry the implementation of the machine that wrote it (``fused``,
    ``foreach``); restore_optimizer puts back the resuming optimizer's own, so a CPU run resumed on CUDA gets
    the fused AdamW the trainer builds there, not the checkpoint's unfused one (it did, silently)."""
    from mhc.train.model import build_optimizer, param_groups, restore_optimizer

    model = torch.nn.Linear(4, 4)
    cfg = T.TrainConfig(max_steps=10, warmup_steps=0)
    written, written_sched = build_optimizer(model, cfg, 10, torch.device("cpu"))  # fused=None, as on the CPU
    model(torch.randn(2, 4)).sum().backward()
    written.step()
    resuming = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, fused=True)  # as on CUDA
    scheduler = torch.optim.lr_scheduler.LambdaLR(resuming, lambda s: 1.0)
    assert [g["fused"] for g in written.state_dict()["param_groups"]] == [None, None]
    restore_optimizer(resuming, scheduler, written.state_dict(), written_sched.state_dict(), cfg, 10)
    assert [(g["fused"], g["foreach"]) for g in resuming.param_groups] == [(True, None)] * 2
    resuming.step()  # the fused step runs with the restored moments
