"""The trainer reads a step's loss and gradient norm a step late on one CUDA device (``mhc.train.loop.LateValues``).

The optimizer step is then launched before the host knows whether the step was finite: the fused AdamW gets a
device-side ``found_inf`` and skips a non-finite step itself. Everything a run writes must be what the
immediate read gives: the same steps skipped, the same metrics, checkpoints and weights, the same stop.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mhc import train as T
from mhc.train import loop
from mhc.train.distributed import DistInfo

TINY = dict(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    seq_len=32,
    batch_size=4,
    data="stdlib",
    max_corpus_mb=0.3,
    max_steps=6,
    warmup_steps=0,
    log_interval=1,
    eval_interval=3,
    eval_batches=1,
    ckpt_interval=3,
    progress=False,
    plots=False,
    threads=1,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the late read is for CUDA runs")


def test_late_values_only_where_the_optimizer_can_skip_on_the_device():
    """One process, CUDA and a fused optimizer: the CPU, DDP/FSDP and unfused optimizers read at once."""
    p = torch.nn.Parameter(torch.zeros(2))
    single, multi = DistInfo(), DistInfo(rank=0, world=2, local_rank=0)
    assert not loop.LateValues.usable(torch.optim.AdamW([p]), single, torch.device("cpu"))
    assert not loop.LateValues.usable(torch.optim.AdamW([p]), single, torch.device("cuda"))  # not fused
    if torch.cuda.is_available():
        q = torch.nn.Parameter(torch.zeros(2, device="cuda"))
        fused = torch.optim.AdamW([q], fused=True)
        assert loop.LateValues.usable(fused, single, torch.device("cuda"))
        assert not loop.LateValues.usable(fused, multi, torch.device("cuda"))


def _run(tmp_path: Path, name: str, monkeypatch, late: bool, **kw):
    """A CUDA run with the late read on or off; its summary (or the stop's message), metrics and final weights."""
    reads = []
    original_read = loop.LateValues.read

    def counted(self):
        reads.append(self.step)
        return original_read(self)

    with monkeypatch.context() as m:
        m.setattr(loop.LateValues, "read", counted)
        if not late:
            m.setattr(loop.LateValues, "usable", staticmethod(lambda *a: False))
        cfg = T.TrainConfig(
            **{**TINY, **kw}, device="cuda", run_dir=str(tmp_path / name), cache_dir=str(tmp_path / "c")
        )
        try:
            outcome = T.train(cfg)
        except T.TrainingStoppedError as e:
            outcome = str(e)
    assert bool(reads) == late, reads  # the late read ran exactly when asked for
    rd = Path(cfg.run_dir)
    records = [r for r in T.read_metrics(rd / "metrics.jsonl") if r["kind"] in ("train", "eval", "stopped")]
    weights = rd / "model" / "model.safetensors"
    state = None
    if weights.exists():
        from safetensors.torch import load_file

        state = load_file(str(weights))
    return outcome, records, state


def _same(a, b, key):
    # Both runs execute the same kernels in the same order; attention's backward may sum in another order
    # from run to run on a GPU, so values agree to a float32 rounding, not to the bit.
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
    return a == b


@cuda
@pytest.mark.parametrize("variant", ["mhc", "residual"])
def test_a_late_read_writes_what_an_immediate_read_writes(tmp_path, monkeypatch, variant):
    """Six steps with an evaluation and a checkpoint every three: the train and eval records (loss, norm, lr,
    skipped), the summary's counts and the final weights agree between the late and the immediate read."""
    late, late_records, late_state = _run(tmp_path, "late", monkeypatch, True, variant=variant)
    now, now_records, now_state = _run(tmp_path, "now", monkeypatch, False, variant=variant)
    for key in ("steps", "skipped_steps", "max_grad_norm", "final_train_loss", "final_val_loss"):
        assert _same(late[key], now[key], key), (key, late[key], now[key])
    assert [(r["kind"], r["step"]) for r in late_records] == [(r["kind"], r["step"]) for r in now_records]
    for a, b in zip(late_records, now_records):
        for key in set(a) & set(b) - {"time_s"}:
            if isinstance(a[key], (int, float, bool, str)):
                assert _same(a[key], b[key], key), (a["step"], key, a[key], b[key])
    assert late_state.keys() == now_state.keys()
    for name in late_state:
        torch.testing.assert_close(late_state[name], now_state[name], rtol=1e-5, atol=1e-6, msg=name)
    T.verify_checkpoint(T.find_latest_checkpoint(tmp_path / "late"))


@cuda
def test_a_late_read_skips_and_stops_as_an_immediate_read_does(tmp_path, monkeypatch):
    """lr=1e15: every step after the first is non-finite. Both reads skip the same steps (the late one on the
    device, through the fused AdamW's found_inf) and stop after three in a row with the same message."""
    kw = dict(lr=1e15, max_steps=8, eval_interval=0, ckpt_interval=0, max_skipped_in_a_row=3)
    late, late_records, _ = _run(tmp_path, "late", monkeypatch, True, **kw)
    now, now_records, _ = _run(tmp_path, "now", monkeypatch, False, **kw)
    assert isinstance(late, str) and late == now.replace(str(tmp_path / "now"), str(tmp_path / "late")), (
        late,
        now,
    )
    assert "stopped at step 4: the last 3 steps were all skipped" in late
    assert [(r["kind"], r["step"], r.get("skipped")) for r in late_records] == [
        (r["kind"], r["step"], r.get("skipped")) for r in now_records
    ]
    assert [r.get("skipped") for r in late_records if r["kind"] == "train"] == [False, True, True, True]
