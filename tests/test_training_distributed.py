"""FSDP2 on 2 gloo ranks (CPU): its checkpoints in one process, recompute=True, bf16 autocast.

Three torchrun runs of ``scripts/train_lm.py`` (module fixtures, ~20-40 s each), shared by the tests:
FSDP2 fp32, the same with ``mhc_options.recompute=true``, and the same with ``precision=bf16``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from test_training_processes import torchrun
from training_support import tiny_cfg, train_losses

import mhc
from mhc import train as T
from mhc.train.model import build_optimizer

pytestmark = pytest.mark.slow  # torchrun

# Attention dropout draws random numbers at every step: recompute must replay the same masks.
FSDP = {"batch_size": 2, "device": "cpu", "dist": "fsdp", "plots": "false", "attention_dropout": 0.1}
WORLD = 2
COEFFICIENTS = ("phi", "alpha", "b_pre", "b_post", "b_res")  # an MHCBlock's parameters


def _fsdp_run(tmp: Path, name: str, **extra) -> Path:
    run_dir = tmp / name
    proc = torchrun(tmp, WORLD, run_dir, {**FSDP, **extra})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dist"] == "fsdp" and summary["world_size"] == WORLD and summary["steps"] == 4, summary
    return run_dir


@pytest.fixture(scope="module")
def runs_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp")  # one token cache for every run of this module


@pytest.fixture(scope="module")
def fsdp_run(runs_tmp) -> Path:
    return _fsdp_run(runs_tmp, "fsdp")


@pytest.fixture(scope="module")
def fsdp_recompute_run(runs_tmp) -> Path:
    return _fsdp_run(runs_tmp, "recompute", mhc_options="{recompute: true}", ckpt_interval=0)


@pytest.fixture(scope="module")
def fsdp_bf16_run(runs_tmp) -> Path:
    # no dropout: each process draws its own masks, and this run's losses are compared with one process's
    return _fsdp_run(runs_tmp, "bf16", precision="bf16", ckpt_interval=0, attention_dropout=0.0)


def _coefficient_names(names) -> list[str]:
    return [k for k in names if k.rsplit(".", 1)[-1] in COEFFICIENTS]


def _one_process_model(run_dir: Path, ckpt: Path) -> tuple[T.TrainConfig, torch.nn.Module, dict]:
    """The run's own settings, and a fresh one-process model holding checkpoint ``ckpt``'s weights (eval mode)."""
    cfg = T.resume_config(run_dir)
    model_state, trainer_state = T.load_checkpoint_state(ckpt)
    model = T.build_model(cfg, 257, 256)  # the byte tokenizer: 256 bytes + end-of-text
    missing, unexpected = model.load_state_dict(model_state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return cfg, model.eval(), trainer_state


# ----------------------------------------------------------------------------- 1. FSDP2 checkpoints in one process


def test_fsdp2_checkpoint_resume_in_one_process_is_refused_naming_world_sizes(fsdp_run, tmp_path):
    """--resume in one process of a 2-rank FSDP2 run stops with an error naming both world sizes, and changes nothing."""
    rd = shutil.copytree(fsdp_run, tmp_path / "copy")
    cfg = T.resume_config(rd)
    assert cfg.dist == "fsdp" and cfg.batch_size == 2
    before = {p.relative_to(rd): p.read_bytes() for p in rd.rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises(
        T.CheckpointError, match=r"the run used 2 process\(es\), now 1 \(the data position depends on it\)"
    ):
        T.train(cfg, resume=True)
    after = {p.relative_to(rd): p.read_bytes() for p in rd.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


def test_fsdp2_checkpoint_loads_into_one_process_model(fsdp_run):
    """The final FSDP2 checkpoint holds full (gathered) tensors: they load into a fresh one-process model, which
    reproduces the run's final validation loss, and the optimizer state has every parameter's full shape."""
    ckpt = T.find_latest_checkpoint(fsdp_run)
    assert ckpt.name == "step_00000004"
    cfg, model, state = _one_process_model(fsdp_run, ckpt)
    assert state["world"] == WORLD and state["step"] == 4
    # AdamW's moments: one entry per parameter, in the order of build_optimizer's groups, never a shard
    optimizer, _ = build_optimizer(model, cfg, 4, torch.device("cpu"))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    moments = state["optimizer"]["state"]
    assert sorted(int(i) for i in moments) == list(range(len(params)))
    for i, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert moments[i][key].shape == p.shape and moments[i][key].dtype == torch.float32, (i, key)
    optimizer.load_state_dict(state["optimizer"])  # a one-process optimizer takes it as it is
    # The run's final evaluation: the mean loss over its fixed validation windows (2 ranks' global batches).
    data, _, _ = T.prepare_data(cfg, log=lambda *_: None)
    windows = data.val_windows(cfg.eval_batches * cfg.batch_size * WORLD)
    with torch.no_grad():
        logits = model(input_ids=windows, use_cache=False).logits
    val_loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)
    ).item()
    summary = json.loads((fsdp_run / "summary.json").read_text())
    assert val_loss == pytest.approx(summary["final_val_loss"], rel=1e-5), (
        val_loss,
        summary["final_val_loss"],
    )


def test_fsdp2_exported_model_dir_loads_with_from_pretrained_on_cpu(fsdp_run):
    """``<run>/model`` of an FSDP2 run: MHCForCausalLM.from_pretrained on the CPU gives finite logits equal to
    those of the final checkpoint's state dict in a model of the same config."""
    loaded = mhc.MHCForCausalLM.from_pretrained(fsdp_run / "model").eval()
    assert loaded.device.type == "cpu" and loaded.dtype == torch.float32
    _, ref, _ = _one_process_model(fsdp_run, T.find_latest_checkpoint(fsdp_run))
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.isfinite(got).all(), f"seed {seed}"
    torch.testing.assert_close(got, want, msg=lambda m: f"seed {seed}: {m}")


# ----------------------------------------------------------------------------- 2. recompute=True under FSDP2


def test_fsdp2_recompute_trains_like_without(fsdp_run, fsdp_recompute_run):
    """Activation recompute (every site runs again in backward, attention dropout included) with FSDP2's sharded
    parameters: the same losses at steps 1-4 as the run without it."""
    config = json.loads((fsdp_recompute_run / "model" / "config.json").read_text())
    assert (
        config["recompute"] is True
        and json.loads((fsdp_run / "model" / "config.json").read_text())["recompute"] is False
    )
    plain, recompute = train_losses(fsdp_run), train_losses(fsdp_recompute_run)
    assert sorted(recompute) == sorted(plain) == [1, 2, 3, 4]
    for step in plain:
        assert recompute[step] == pytest.approx(plain[step], rel=1e-4, abs=1e-4), (
            step,
            recompute[step],
            plain[step],
        )
    s_plain, s_re = (json.loads((d / "summary.json").read_text()) for d in (fsdp_run, fsdp_recompute_run))
    assert s_re["final_val_loss"] == pytest.approx(s_plain["final_val_loss"], rel=1e-4)


# ----------------------------------------------------------------------------- 3. bf16 autocast under FSDP2


def test_fsdp2_bf16_autocast_keeps_mhc_coefficients_float32(fsdp_bf16_run, runs_tmp):
    """precision=bf16 (CPU autocast) under FSDP2: the mHC coefficient parameters and their AdamW moments stay
    float32 in the checkpoint and in model/, and the losses are one process's at the same global batch."""
    summary = json.loads((fsdp_bf16_run / "summary.json").read_text())
    assert summary["precision"] == "bf16-autocast"
    cfg = T.resume_config(fsdp_bf16_run)
    model_state, state = T.load_checkpoint_state(T.find_latest_checkpoint(fsdp_bf16_run))
    names = _coefficient_names(model_state)
    assert len(names) == 2 * cfg.num_layers * len(COEFFICIENTS), names  # attention and MLP site of each layer
    assert {k: model_state[k].dtype for k in names} == {k: torch.float32 for k in names}
    assert {m["exp_avg"].dtype for m in state["optimizer"]["state"].values()} == {torch.float32}
    with safe_open(str(fsdp_bf16_run / "model" / "model.safetensors"), framework="pt") as f:
        exported = {k: f.get_slice(k).get_dtype() for k in _coefficient_names(f.keys())}
    assert sorted(exported) == sorted(names) and set(exported.values()) == {"F32"}, exported
    # the same global batch (4) in one process, also under bf16 autocast
    single = runs_tmp / "bf16_single"
    T.train(tiny_cfg(runs_tmp, "bf16_single", max_steps=4, ckpt_interval=0, batch_size=4, precision="bf16",
                     plots=False, attention_dropout=0.0))  # fmt: skip
    l_fsdp, l_one = train_losses(fsdp_bf16_run), train_losses(single)
    assert sorted(l_fsdp) == sorted(l_one) == [1, 2, 3, 4]
    # bf16 tolerance: the batch split changes bf16 roundings (measured: <= 1.1e-4 in 4 steps); another batch or a
    # lost update moves the loss by more than 1e-2
    for step in l_one:
        assert l_fsdp[step] == pytest.approx(l_one[step], abs=2e-3), (step, l_fsdp[step], l_one[step])
