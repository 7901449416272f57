"""The trainer's late read of a step's loss and gradient norm (``mhc.train.loop.LateValues``).

With one process and a fused optimizer (the trainer's AdamW on CUDA) the optimizer step is launched before the
host knows whether the step was finite: the fused AdamW gets a device-side ``found_inf`` and skips a non-finite
step itself, and the host reads the values after launching the next step. Everything a run writes must be
what the immediate read gives: the same steps skipped, the same records, weights and stop.

On the CPU the tests build the fused AdamW too (torch has a CPU one that takes ``found_inf``), so the late
read runs here against the immediate read with the same optimizer, to the bit; on CUDA they run with the
trainer's own optimizer, to a float32 rounding (attention's backward may sum in another order from run to run).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from training_support import TINY as SHARED_TINY

from mhc import train as T
from mhc.train import loop
from mhc.train.distributed import DistInfo

# The shared tiny run, shorter, with an evaluation and checkpoints inside it and no plots.
TINY = {
    **SHARED_TINY,
    "max_steps": 6,
    "warmup_steps": 0,
    "eval_interval": 3,
    "eval_batches": 1,
    "ckpt_interval": 2,
    "plots": False,
}

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def test_late_values_only_with_one_process_and_a_fused_optimizer():
    """The CPU's unfused AdamW, DDP/FSDP, or a group that is not fused (a checkpoint's groups replace the
    optimizer's at resume) read at once."""
    p = torch.nn.Parameter(torch.zeros(2))
    single, multi = DistInfo(), DistInfo(rank=0, world=2, local_rank=0)
    assert not loop.LateValues.usable(torch.optim.AdamW([p]), single)
    fused = torch.optim.AdamW([p], fused=True)
    assert loop.LateValues.usable(fused, single)
    assert not loop.LateValues.usable(fused, multi)
    fused.param_groups[0]["fused"] = None
    assert not loop.LateValues.usable(fused, single)


def _run(
    tmp_path: Path, name: str, monkeypatch, device: str, late: bool, nan_calls=(), interrupt_call=None, **kw
):
    """A run with the late read on or off: ``(summary or the stop's message, records, final weights, reads)``.

    ``nan_calls``: the training forward calls (1-based, micro-batches counted) whose loss is made NaN;
    ``interrupt_call``: the one that raises KeyboardInterrupt instead.
    """
    reads, calls = [], [0]
    read, lm_loss, build = loop.LateValues.read, loop.lm_loss, loop.build_optimizer

    def counted_read(self):
        reads.append(self.step)
        return read(self)

    def loss_of(model, ids, autocast):
        loss = lm_loss(model, ids, autocast)
        if torch.is_grad_enabled():  # a training forward, not an evaluation
            calls[0] += 1
            if calls[0] == interrupt_call:
                raise KeyboardInterrupt
            if calls[0] in nan_calls:
                loss = loss * float("nan")
        return loss

    def fused_on_the_cpu(model, cfg, max_steps, dev):
        optimizer, scheduler = build(model, cfg, max_steps, dev)
        if dev.type == "cpu":  # the CUDA trainer's fused AdamW, here
            for group in optimizer.param_groups:
                group["fused"], group["foreach"] = True, None
            optimizer.defaults["fused"], optimizer.defaults["foreach"] = True, None
        return optimizer, scheduler

    with monkeypatch.context() as m:
        m.setattr(loop.LateValues, "read", counted_read)
        m.setattr(loop, "lm_loss", loss_of)
        m.setattr(loop, "build_optimizer", fused_on_the_cpu)
        if not late:
            m.setattr(loop.LateValues, "usable", staticmethod(lambda *a: False))
        cfg = T.TrainConfig(
            **{**TINY, **kw}, device=device, run_dir=str(tmp_path / name), cache_dir=str(tmp_path / "c")
        )
        try:
            outcome = T.train(cfg)
        except T.TrainingStoppedError as e:
            outcome = str(e).replace(str(tmp_path / name), "RUN")
        except KeyboardInterrupt:
            outcome = "interrupted"
    rd = Path(cfg.run_dir)
    records = [
        {k: v.replace(str(rd), "RUN") if isinstance(v, str) else v for k, v in r.items() if k != "time_s"}
        for r in T.read_metrics(rd / "metrics.jsonl")
        if r["kind"] in ("train", "eval", "stopped")
    ]
    state = None
    if (rd / "model" / "model.safetensors").exists():
        from safetensors.torch import load_file

        state = load_file(str(rd / "model" / "model.safetensors"))
    return outcome, records, state, reads


def _same(a, b, exact: bool) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], exact) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, exact) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b if exact else math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
    return a == b


def _compare(late, now, device):
    exact = device == "cpu"
    (l_out, l_rec, l_state, l_reads), (n_out, n_rec, n_state, n_reads) = late, now
    assert l_reads and not n_reads  # the late read ran exactly where asked for
    assert [(r["kind"], r["step"]) for r in l_rec] == [(r["kind"], r["step"]) for r in n_rec]
    for a, b in zip(l_rec, n_rec):
        assert _same(a, b, exact), (a, b)
    if isinstance(l_out, dict) and "summary" not in l_out and "interrupted" not in l_out:
        for key in ("steps", "skipped_steps", "max_grad_norm", "final_train_loss", "final_val_loss"):
            assert _same(l_out[key], n_out[key], exact), (key, l_out[key], n_out[key])
    else:
        assert l_out == n_out
    assert (l_state is None) == (n_state is None)
    for name in l_state or {}:
        if exact:
            assert torch.equal(l_state[name], n_state[name]), name
        else:
            torch.testing.assert_close(l_state[name], n_state[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["mhc", "residual"])
def test_a_late_read_trains_as_an_immediate_read_through_a_skipped_step(
    tmp_path, monkeypatch, device, variant
):
    """Six steps of two micro-batches, step 3's second loss NaN, evaluations every 3 and checkpoints every 2: the
    records (loss, norm, lr, skipped, spikes, evaluations), the summary's counts and the final weights agree, so
    the skipped step left parameters, moments and step count alone on the device."""
    kw = dict(variant=variant, grad_accum=2, nan_calls=(6,))
    late = _run(tmp_path, "late", monkeypatch, device, True, **kw)
    now = _run(tmp_path, "now", monkeypatch, device, False, **kw)
    _compare(late, now, device)
    assert [r["skipped"] for r in late[1] if r["kind"] == "train"] == [
        False,
        False,
        True,
        False,
        False,
        False,
    ]
    T.verify_checkpoint(T.find_latest_checkpoint(tmp_path / "late"))


@pytest.mark.parametrize("device", DEVICES)
def test_a_late_read_stops_on_skipped_steps_as_an_immediate_read_does(tmp_path, monkeypatch, device):
    """Steps 2 on NaN with max_skipped_in_a_row=3: both stop after step 4 with the same message and records, before
    step 5's forward (which would raise KeyboardInterrupt here): the late read reads step 4 before it."""
    kw = dict(
        max_steps=8,
        eval_interval=0,
        ckpt_interval=0,
        max_skipped_in_a_row=3,
        nan_calls=range(2, 9),
        interrupt_call=5,
    )
    late = _run(tmp_path, "late", monkeypatch, device, True, **kw)
    now = _run(tmp_path, "now", monkeypatch, device, False, **kw)
    _compare(late, now, device)
    assert "stopped at step 4: the last 3 steps were all skipped" in late[0]
    assert late[1][-1]["kind"] == "stopped"


@pytest.mark.parametrize("device", DEVICES)
def test_a_late_read_stops_at_stop_at_step_and_writes_the_step_before_an_interruption(
    tmp_path, monkeypatch, device
):
    """stop_at_step=3 returns at step 3 with its record written; a KeyboardInterrupt in step 3's forward still
    leaves step 2's record (a skipped one) in metrics.jsonl, as the immediate read does."""
    kw = dict(stop_at_step=3, eval_interval=0, ckpt_interval=0)
    late = _run(tmp_path, "late", monkeypatch, device, True, **kw)
    now = _run(tmp_path, "now", monkeypatch, device, False, **kw)
    _compare(late, now, device)
    assert late[0] == {"interrupted": True, "step": 3} and [r["step"] for r in late[1]] == [1, 2, 3]
    kw = dict(eval_interval=0, ckpt_interval=0, nan_calls=(2,), interrupt_call=3)
    late = _run(tmp_path, "late2", monkeypatch, device, True, **kw)
    now = _run(tmp_path, "now2", monkeypatch, device, False, **kw)
    _compare(late, now, device)
    assert late[0] == "interrupted"
    assert [(r["step"], r["skipped"]) for r in late[1] if r["kind"] == "train"] == [(1, False), (2, True)]
