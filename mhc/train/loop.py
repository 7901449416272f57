"""The training loop: :func:`train` reads top to bottom, one commented stage after another.

Setup (processes, run dir, data), resume point, model, optimizer, the step loop (log, evaluate,
checkpoint, stop), the end (final evaluation and checkpoint, ``model/``, ``summary.json``, plots).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..projection import cuda as projection_cuda
from .checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    atomic_write_bytes,
    describe_nonfinite,
    find_latest_checkpoint,
    nonfinite_tensors,
    save_checkpoint,
)
from .config import TrainConfig, config_yaml
from .data import PackedData, prepare_data, unigram_entropy
from .distributed import (
    DistInfo,
    all_reduce_mean,
    all_reduce_sum,
    barrier,
    broadcast_flag,
    full_state,
    gather_objects,
    setup_distributed,
    shard_optimizer_state,
    shutdown_distributed,
    wrap_model,
)
from .model import build_model, build_optimizer, count_parameters, restore_optimizer
from .reporting import (
    ConvergenceWarningCounter,
    MainProcessLog,
    MetricsLog,
    SpikeTracker,
    Throughput,
    eval_record,
    final_train_loss,
    measure_stability,
    plot_run,
    stability_scalars,
    train_record,
)
from .resume import load_resume_point
from .rng import rng_state, seed_all, set_rng_state
from .run_dir import RunDirLock, claim_run_dir, replace_model_dir

__all__ = ["train", "Counters", "TrainingStoppedError"]


class TrainingStoppedError(RuntimeError):
    """Training stopped because no step could succeed; the message says why and what to change.

    ``mhc-train`` reports it in one line and exits with status 1.
    """


@dataclass
class Counters:
    """What a run has counted so far; saved in every checkpoint and restored on resume."""

    step: int = 0  # optimizer steps taken (skipped ones included)
    elapsed_s: float = 0.0  # training wall time, over all sessions of the run
    max_grad_norm: float = 0.0  # the largest finite gradient norm (before clipping) of a step taken
    skipped_steps: int = 0  # steps whose loss or gradient was not finite: no update
    skipped_in_a_row: int = (
        0  # the skipped steps since the last step taken (cfg.max_skipped_in_a_row stops the run)
    )


def train(
    cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, resume_override: bool = False
) -> dict:
    """Run (or resume) training as ``cfg`` says; return the summary (also written to ``summary.json``).

    Under ``torchrun`` with more than one process it trains with DDP
    (``cfg.dist="ddp"``) or FSDP2 (``cfg.dist="fsdp"``).

    The run directory is locked for the whole run (:class:`mhc.train.RunDirLock`, rank 0):
    a second process raises :class:`RunDirLockedError` at once, and under ``torchrun`` every
    rank stops when rank 0 cannot set up the folder. A fresh run refuses a folder that already
    holds any run output (``FileExistsError``); ``overwrite`` deletes those outputs first,
    and nothing else in the folder is ever deleted.

    With ``resume`` it continues from the run directory's latest checkpoint. ``cfg`` must then
    be the run's own settings (:func:`resume_config` builds them): keys that differ from the
    checkpoint's config raise :class:`CheckpointError` listing them, except the
    :data:`RESUME_SESSION` keys; ``resume_override`` lets the other keys change (recorded in
    ``config.yaml``), but :data:`RESUME_FIXED` keys can never change.

    A run stopped by ``cfg.stop_at_step`` returns ``{"interrupted": True, "step": step}``.

    Raises:
        TrainingStoppedError: ``cfg.max_skipped_in_a_row`` steps in a row were skipped (non-finite loss
            or gradient): no step is succeeding. ``metrics.jsonl`` ends with a ``"stopped"`` record; no
            final checkpoint, ``model/`` or ``summary.json`` is written.
        CheckpointError: with ``resume``, a bad checkpoint, settings it may not change, or weights or
            optimizer state that are not finite (named in the message), before any step.
    """
    # ---- setup: processes and device (a bad device stops here), the locked run dir ----
    cfg.validate()
    info, device = setup_distributed(cfg)
    log = MainProcessLog(info)
    run_dir, ckpt_root = Path(cfg.run_dir), Path(cfg.run_dir) / "checkpoints"
    if resume and not run_dir.exists():
        # Allowed (a job script that always passes --resume starts its first run so), but said plainly:
        # a mistyped --run-dir would otherwise start a whole new run unnoticed.
        log(
            f"--resume: there is no run at {run_dir} (no such folder); starting a NEW run there from step 0. "
            "If you meant an existing run, stop and check --run-dir."
        )
    lock = RunDirLock(run_dir) if info.is_main else None
    # fused_projection: false keeps H_res on the PyTorch Newton path even on CUDA, for this run only.
    cuda_kernels_before = None if cfg.fused_projection else projection_cuda.set_enabled(False)
    try:
        claim_run_dir(run_dir, lock, info, device, resume=resume, overwrite=overwrite, log=log)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)

        # ---- resume: the checkpoint to continue from, checked before the data (a refused resume stops at once) ----
        point = (
            load_resume_point(cfg, info.world, resume_override=resume_override, log=log) if resume else None
        )
        state = point.trainer_state if point else None

        # ---- data: rank 0 fills the tokenizer/token caches, the other ranks then read them ----
        seed_all(cfg.seed)
        if not info.is_main:
            barrier(info)
        data, tok, corpus = prepare_data(cfg, log=log)
        if info.is_main:
            barrier(info)
        if state is not None and state.get("corpus_sha256") not in (None, corpus.sha256()):
            raise CheckpointError(
                f"cannot resume from {point.path}: the data changed since the run began. data={cfg.data!r} now reads "
                f"{corpus.describe()}, but the run trained on a corpus with sha256 {state['corpus_sha256'][:16]}... "
                f"({state.get('corpus', {}).get('source', '?')}, {state.get('corpus', {}).get('documents', '?')} "
                f"documents, Python {state.get('corpus', {}).get('python', '?')}). The data position would point into "
                f"other text; train on the run's own corpus (the same files or Python), or start a new run."
            )
        h_unigram = unigram_entropy(np.concatenate([data.train, data.val]), tok.vocab_size)
        windows_per_step = cfg.batch_size * cfg.grad_accum * info.world
        tokens_per_step = windows_per_step * cfg.seq_len
        max_steps = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.tokens / tokens_per_step))
        if state is not None and state["step"] > max_steps:
            raise CheckpointError(
                f"cannot resume from {point.path} with max_steps={max_steps}: the run is at step {state['step']} "
                "already; give max_steps at or above it"
            )
        if data.n_train_windows < windows_per_step:
            log(
                f"note: the training split holds {data.n_train_windows} windows of seq_len={cfg.seq_len} tokens, "
                f"fewer than a step's {windows_per_step}: windows repeat within every step"
            )

        # ---- model: built from the seed, then the checkpoint's weights; wrapped for DDP/FSDP2 ----
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, tok.vocab_size, tok.eos_id)
        n_params = count_parameters(model)
        model.to(device)
        if point is not None:
            try:
                missing, unexpected = model.load_state_dict(point.model_state, strict=False)
            except RuntimeError as e:  # a tensor of another shape
                raise CheckpointError(f"checkpoint {point.path} does not fit the model: {e}") from e
            if missing or unexpected:
                raise CheckpointError(
                    f"checkpoint {point.path} does not fit the model: missing {missing}, unexpected {unexpected}"
                )
        fsdp = info.enabled and cfg.dist == "fsdp"
        train_model = wrap_model(model, cfg, info, device)
        use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
        autocast = contextlib.nullcontext
        if use_bf16:
            autocast = functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)

        # ---- optimizer, schedule, counters: fresh, or as the checkpoint left them (RNG last) ----
        optimizer, scheduler = build_optimizer(model, cfg, max_steps, device)
        spikes = SpikeTracker(cfg.spike_threshold, cfg.warmup_steps)
        counters = Counters()
        if state is not None:
            opt_state = (
                shard_optimizer_state(optimizer, state["optimizer"], device) if fsdp else state["optimizer"]
            )
            try:
                restore_optimizer(optimizer, scheduler, opt_state, state["scheduler"], cfg, max_steps)
            # (torch's own Optimizer.load_state_dict raises ValueError for a group that does not fit)
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(
                    f"checkpoint {point.path}: its optimizer or scheduler state does not fit this run: {e}"
                ) from e
            spikes.load_state_dict(state["spikes"])
            counters = Counters(state["step"], state.get("elapsed_s", 0.0), state.get("max_grad_norm", 0.0),
                                state.get("skipped_steps", 0), state.get("skipped_in_a_row", 0))  # fmt: skip
            set_rng_state(state["rng"][info.rank], device)
            if 0 < cfg.max_time_s <= counters.elapsed_s and counters.step < max_steps:
                # the budget covers the whole run: resuming would train one step and stop again
                raise CheckpointError(
                    f"cannot resume from {point.path}: the run's wall-clock budget max_time_s={cfg.max_time_s:g} s is "
                    f"already spent ({counters.elapsed_s:.1f} s over its sessions so far). Resume with a larger budget "
                    f"(--set max_time_s=<seconds> --resume-override), or --set max_time_s=0 for none."
                )
            log(f"resumed from {point.path} at step {counters.step}")
        start_step = counters.step
        overrides = point.overrides if point else []

        # the validation windows before any run file: too little validation data stops a fresh run here
        val_windows = data.val_windows(cfg.eval_batches * cfg.batch_size * info.world)  # global batches
        diag_ids = val_windows[:2].to(device)  # gains and stability are measured on these (model, not DDP)

        # ---- run files: metrics.jsonl (kept up to the checkpoint on resume), config.yaml ----
        metrics = MetricsLog(run_dir / "metrics.jsonl", info.is_main, start_step if state is not None else None,
                             finished=state is not None and start_step >= max_steps)  # fmt: skip
        if info.is_main:
            atomic_write_bytes(run_dir / "config.yaml", config_yaml(cfg, overrides).encode())
        wrapping = " (FSDP2)" if fsdp else " (DDP)" if info.enabled else ""
        log(
            f"model: {cfg.variant} (n_streams={cfg.streams}), {cfg.num_layers} layers x {cfg.hidden_size}, "
            f"{n_params / 1e6:.2f}M parameters; {info.world} process(es) on {device.type}{wrapping}, "
            f"{'bf16 autocast' if use_bf16 else 'fp32'}; {max_steps} steps x {tokens_per_step:,} tokens"
        )
        log(f"unigram entropy of the data: {h_unigram:.4f} nats/token ({h_unigram / math.log(2):.3f} bits)")
        to_save = dict(model=model, optimizer=optimizer, scheduler=scheduler, spikes=spikes, counters=counters, tok=tok,
                       max_steps=max_steps, overrides=overrides, corpus=corpus.record())  # what every checkpoint holds  # fmt: skip

        def evaluate_and_record(
            step: int, tokens: int, time_s: float
        ) -> tuple[float, dict | None, dict | None]:
            # validation loss, then gains and stability on diag_ids; one "eval" record of metrics.jsonl
            val = evaluate(train_model, val_windows, cfg.batch_size, info, device, autocast)
            gains, stability = measure_stability(model, diag_ids)
            metrics.write(eval_record(step, tokens, val, gains, time_s, stability))
            return val, gains, stability

        # ---- step 0: a fresh run evaluates its initial model, where the curves and the stability series begin ----
        if cfg.eval_interval and state is None:
            evaluate_and_record(0, 0, 0.0)

        # ---- the step loop: one optimizer step per iteration; then log, evaluate, checkpoint, stop ----
        interrupted = stopped_early = False
        last_val, throughput, t0 = None, Throughput(), time.perf_counter()
        elapsed_before = counters.elapsed_s
        bar = tqdm(total=max_steps, initial=start_step, disable=not (info.is_main and cfg.progress), dynamic_ncols=True,
                   mininterval=1.0, desc=cfg.variant, file=sys.stderr)  # fmt: skip
        train_model.train()
        with bar, ConvergenceWarningCounter(bar.write, show=info.is_main) as projection_warnings:
            # A step's loss and norm are read on the host a step late where the run allows it (LateValues).
            late, pending = LateValues.usable(optimizer, info), None

            def settle(step: int, lr: float, loss: float, gnorm: float, may_stop: bool = True) -> None:
                # the bookkeeping of finished step `step`: skip counts, spikes, the log, and the stop on skips
                finite = math.isfinite(gnorm) and math.isfinite(loss)
                if finite:
                    counters.max_grad_norm = max(counters.max_grad_norm, gnorm)
                    counters.skipped_in_a_row = 0
                else:  # a NaN/Inf loss or gradient on some rank: no update from this batch, on any rank
                    counters.skipped_steps += 1
                    counters.skipped_in_a_row += 1
                    if counters.skipped_steps == 1:
                        what = "loss" if not math.isfinite(loss) else "gradient"
                        bar.write(f"step {step}: non-finite {what}; the update is skipped (every skipped "
                                  f"step is in metrics.jsonl, the count in summary.json)", file=sys.stderr)  # fmt: skip
                tokens = step * tokens_per_step
                is_spike = spikes.update(step, loss)
                now = time.perf_counter()
                throughput.tick(step - start_step, now)
                counters.elapsed_s = elapsed_before + now - t0
                bar.update(1)
                if step % cfg.log_interval == 0 or step in (1, max_steps) or is_spike or not finite:
                    metrics.write(train_record(step, tokens, loss, lr, gnorm, spike=is_spike, skipped=not finite,
                                               time_s=counters.elapsed_s))  # fmt: skip
                    bar.set_postfix(
                        loss=f"{loss:.3f}", val=f"{last_val:.3f}" if last_val else "-", refresh=False
                    )
                # stop: no step is succeeding (every rank has the same counts, so all stop here together)
                if (
                    may_stop
                    and cfg.max_skipped_in_a_row
                    and counters.skipped_in_a_row >= cfg.max_skipped_in_a_row
                ):
                    reason = _stop_message(
                        cfg, step, counters.skipped_in_a_row, full_state(model.state_dict()), run_dir
                    )
                    metrics.write({"kind": "stopped", "step": step, "tokens": tokens, "reason": reason})
                    metrics.close()
                    raise TrainingStoppedError(reason)

            def settle_pending() -> None:
                # the late read: the step still pending, read and booked now
                nonlocal pending
                if pending is not None:
                    values, pending = pending.read(), None
                    settle(*values)

            try:
                while counters.step < max_steps:
                    optimizer.zero_grad(set_to_none=True)
                    lr = optimizer.param_groups[0]["lr"]
                    stop_next = (
                        cfg.max_skipped_in_a_row and counters.skipped_in_a_row + 1 >= cfg.max_skipped_in_a_row
                    )
                    if late and stop_next:  # the pending step may be the one that stops the run
                        settle_pending()
                    if late:
                        loss_sum, gnorm_t = forward_backward_tensors(
                            train_model, model, data, counters.step, cfg, info, device, autocast
                        )
                        settle_pending()  # the previous step's values, while this step runs on the GPU
                        pending = LateValues(counters.step + 1, lr, loss_sum, gnorm_t, cfg.grad_accum)
                        pending.step_optimizer(optimizer)
                    else:
                        loss, gnorm = forward_backward(
                            train_model, model, data, counters.step, cfg, info, device, autocast
                        )
                        if math.isfinite(gnorm) and math.isfinite(loss):
                            optimizer.step()
                    scheduler.step()
                    counters.step += 1
                    step, tokens = counters.step, counters.step * tokens_per_step
                    elapsed = elapsed_before + time.perf_counter() - t0
                    out_of_time = cfg.max_time_s > 0 and broadcast_flag(
                        elapsed >= cfg.max_time_s, info, device
                    )
                    if not late:
                        settle(step, lr, loss, gnorm)
                    elif (
                        step >= max_steps
                        or (cfg.eval_interval and step % cfg.eval_interval == 0)
                        or (cfg.ckpt_interval and step % cfg.ckpt_interval == 0)
                        or (cfg.stop_at_step and step >= cfg.stop_at_step)
                        or out_of_time
                    ):  # what comes next needs this step's bookkeeping done
                        settle_pending()
                    if step >= max_steps:
                        break  # the end below evaluates and checkpoints the last step
                    # evaluate
                    if cfg.eval_interval and step % cfg.eval_interval == 0:
                        last_val = evaluate_and_record(step, tokens, counters.elapsed_s)[0]
                    # checkpoint
                    if cfg.ckpt_interval and step % cfg.ckpt_interval == 0:
                        save_run_checkpoint(ckpt_root, cfg, info, device, **to_save)
                    # stop early: a simulated interruption, or the wall-clock budget (rank 0's clock decides)
                    if cfg.stop_at_step and step >= cfg.stop_at_step:
                        interrupted = True
                        break
                    if out_of_time:
                        stopped_early = True
                        log(
                            f"\nstopping at step {step}: the wall-clock budget of {cfg.max_time_s:.0f} s is spent"
                        )
                        break
            except BaseException:
                # a failed or interrupted step still writes the one before it (best effort; no stop here)
                if pending is not None:
                    with contextlib.suppress(Exception):
                        settle(*pending.read(), may_stop=False)
                raise
        counters.elapsed_s = elapsed_before + time.perf_counter() - t0
        tokens_per_s = throughput.tokens_per_s(tokens_per_step, time.perf_counter())
        step, tokens = counters.step, counters.step * tokens_per_step
        if interrupted:
            metrics.close()
            log(f"stopped at step {step} (stop_at_step); resume with --resume")
            return {"interrupted": True, "step": step}

        # ---- the end: final evaluation and checkpoint, model/, summary.json, plots ----
        val_loss, gains, stability = evaluate_and_record(step, tokens, counters.elapsed_s)
        if (
            state is None or step > start_step
        ):  # a finished run resumed again keeps its final checkpoint as it is
            save_run_checkpoint(ckpt_root, cfg, info, device, **to_save)
        model_sd = full_state(model.state_dict())
        train_loss, train_loss_note = final_train_loss(spikes, step)
        summary = {
            "variant": cfg.variant,
            "n_streams": cfg.streams,
            "params": n_params,
            "steps": step,
            "max_steps": max_steps,
            "tokens": tokens,
            "world_size": info.world,
            "dist": (cfg.dist if info.enabled else "none"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": "bf16-autocast" if use_bf16 else "fp32",
            "final_val_loss": val_loss,
            # the EMA (beta 0.95) of the training losses, when the final step's loss is in it; else None and why
            "final_train_loss": train_loss,
            "final_train_loss_note": train_loss_note,
            "last_finite_train_loss_step": spikes.ema_step,
            "unigram_entropy": h_unigram,
            "beats_unigram": bool(val_loss < h_unigram),
            "loss_spikes": spikes.spikes,
            "max_grad_norm": counters.max_grad_norm,
            "skipped_steps": counters.skipped_steps,
            "projection_warnings": projection_warnings.count,
            "train_time_s": counters.elapsed_s,
            "tokens_per_s": tokens_per_s,
            "stopped_early": stopped_early,
            "composite_gains": gains,
            "fwd_gain_full_depth": gains["forward_gain"][-1] if gains else None,
            "bwd_gain_full_depth": gains["backward_gain"][-1] if gains else None,
            "fwd_gain_max": max(gains["forward_gain"]) if gains else None,
            "bwd_gain_max": max(gains["backward_gain"]) if gains else None,
            "stability": stability,  # per-site lists (reporting.measure_stability)
            **stability_scalars(stability),
            "tokenizer": tok.kind,
            "vocab_size": tok.vocab_size,
            "data": corpus.source,
            "corpus": corpus.record(),  # source, documents, chars, sha256, python: which text the run read
        }
        if info.is_main:
            metrics.write(
                {
                    "kind": "final",
                    "step": step,
                    **{k: v for k, v in summary.items() if k not in ("composite_gains", "stability")},
                }
            )
            replace_model_dir(run_dir, model.config, model_sd, tok)
            atomic_write_bytes(run_dir / "summary.json", (json.dumps(summary, indent=1) + "\n").encode())
            if cfg.plots:
                plot_run(run_dir)
        metrics.close()
        barrier(info)
        log(
            f"val loss {val_loss:.4f} nats/token vs unigram entropy {h_unigram:.4f}: "
            f"{'below' if val_loss < h_unigram else 'NOT below'}; {step} steps in {counters.elapsed_s:.1f} s"
            + (f" ({tokens_per_s:,.0f} tokens/s)" if tokens_per_s else "")
        )
        if gains:
            log(
                f"composite mapping at full depth ({len(gains['forward_gain'])} sites): "
                f"forward gain {gains['forward_gain'][-1]:.4g}, backward gain {gains['backward_gain'][-1]:.4g}; "
                f"max H_res marginal error {_or_na(summary['marginal_error_max'], '.2g')} (logit std "
                f"{_or_na(summary['h_res_logit_scale'], '.3g')}), stream spread at the "
                f"last site {_or_na(summary['stream_spread'], '.3g')} (0 = collapsed), max H_res saturation "
                f"{_or_na(summary['h_res_saturation'], '.3g')}"
            )
        log(f"run dir: {run_dir}  (model: {run_dir / 'model'}, metrics: {run_dir / 'metrics.jsonl'})")
        return summary
    finally:
        if cuda_kernels_before is not None:
            projection_cuda.set_enabled(cuda_kernels_before)
        if lock is not None:
            lock.release()
        shutdown_distributed(info)


def _stop_message(cfg: TrainConfig, step: int, skipped: int, model_sd: dict, run_dir: Path) -> str:
    """Why a run stops after ``skipped`` skipped steps in a row, whether its weights are finite, and what to do."""
    bad = nonfinite_tensors(model_sd)
    if bad:
        state = (f"The weights are not finite: {describe_nonfinite(bad, limit=4)}; the update of step {step - skipped} "
                 f"broke them, and no later step can succeed.")  # fmt: skip
    else:
        state = "The weights are finite, but the loss or gradient of every batch is not (diverged weights, or bad data)."
    try:
        latest = find_latest_checkpoint(run_dir)
    except CheckpointError:
        latest = None
    where = f"the latest checkpoint is {latest}" if latest else "the run has no checkpoint"
    return (
        f"stopped at step {step}: the last {skipped} steps were all skipped (non-finite loss or gradient). {state} "
        f"Every skipped step is in {run_dir / 'metrics.jsonl'}; {where}; no model/ or summary.json was written. "
        f"Try a lower lr (now {cfg.lr:g}) or check the data; max_skipped_in_a_row={cfg.max_skipped_in_a_row} sets "
        f"this limit (0: never stop)."
    )


def _or_na(value: float | None, spec: str) -> str:
    """``value`` formatted, or ``n/a`` for None (a metric the model's sites do not have)."""
    return "n/a" if value is None else format(value, spec)


# --------------------------------------------------------------------------------------
# One step, evaluation, checkpoints
# --------------------------------------------------------------------------------------


def lm_loss(model: nn.Module, ids: Tensor, autocast) -> Tensor:
    """Mean next-token cross-entropy (float32) of ``ids`` (``[B, S]`` int64) under ``autocast()``."""
    with autocast():
        logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def forward_backward_tensors(
    train_model: nn.Module,
    model: nn.Module,
    data: PackedData,
    step: int,
    cfg: TrainConfig,
    info: DistInfo,
    device,
    autocast,
) -> tuple[Tensor, Tensor]:
    """:func:`forward_backward` with nothing read on the host: ``(loss_sum, gnorm)``, tensors on the device.

    ``loss_sum`` is this rank's sum of the micro-batch losses (float32); ``gnorm`` the gradient norm
    before clipping (a DTensor under FSDP2).
    """
    per_rank = cfg.batch_size
    global_per_step = per_rank * cfg.grad_accum * info.world
    ddp = info.enabled and cfg.dist != "fsdp"
    loss_sum = None
    for micro in range(cfg.grad_accum):
        start = step * global_per_step + (micro * info.world + info.rank) * per_rank
        ids = data.train_batch(start, per_rank).to(device, non_blocking=True)
        # DDP all-reduces gradients at every backward; only the last micro-batch's needs to.
        sync = train_model.no_sync() if ddp and micro < cfg.grad_accum - 1 else contextlib.nullcontext()
        with sync:
            loss = lm_loss(train_model, ids, autocast)
            (loss / cfg.grad_accum).backward()
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
    gnorm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    )
    return loss_sum, gnorm


def forward_backward(
    train_model: nn.Module,
    model: nn.Module,
    data: PackedData,
    step: int,
    cfg: TrainConfig,
    info: DistInfo,
    device,
    autocast,
) -> tuple[float, float]:
    """Gradients (into zeroed ``.grad``) of optimizer step ``step`` (0-based), accumulated over ``cfg.grad_accum`` micro-batches, clipped.

    Rank ``r``'s micro-batch ``m`` is global samples ``(step * accum + m) * world + r`` times
    ``batch_size`` on: the data position is the step count. Returns the loss averaged over
    micro-batches and ranks, and the gradient norm before clipping; both are the same on every
    rank, so all ranks skip a non-finite step together.
    """
    loss_sum, gnorm = forward_backward_tensors(train_model, model, data, step, cfg, info, device, autocast)
    gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)  # a DTensor under FSDP2
    loss = all_reduce_mean([float(loss_sum) / cfg.grad_accum], info, device)[0]
    return loss, gnorm


class LateValues:
    """A step's loss and gradient norm, copied to the host behind the GPU's work and read a step later.

    Reading them at once (``float()``) waits for the step's backward, and the GPU then idles while the
    host runs the optimizer's Python, ``zero_grad``, the compiled model's guards and the next batch's
    copy. With one process and an optimizer that takes ``found_inf`` (the fused AdamW, which the
    trainer builds on CUDA), the optimizer step is launched with a device-side flag that leaves
    parameters, moments and step count alone when the loss or norm is not finite (as ``GradScaler``
    uses it), so the same steps are skipped as when the host decides; the host reads the values after
    launching the next step's forward and backward, when the GPU is long past them.

    Two things differ from the immediate read, neither in the numbers: a skipped first step leaves the
    optimizer's lazily made state (zero moments, step 0) in a checkpoint where the immediate read has
    none, and a step's ``time_s`` and throughput are taken when it is read.
    """

    def __init__(self, step: int, lr: float, loss_sum: Tensor, gnorm: Tensor, accum: int):
        values = torch.stack([loss_sum.float(), gnorm.float()])
        self.step, self.lr, self.accum = step, lr, accum
        cuda = values.is_cuda
        self.host = torch.empty(2, dtype=torch.float32, pin_memory=cuda)
        self.host.copy_(values, non_blocking=cuda)
        self.done = torch.cuda.Event() if cuda else None
        if cuda:
            self.done.record()
        self.nonfinite = (~torch.isfinite(values).all()).float()  # found_inf: 1.0 skips the update

    @staticmethod
    def usable(optimizer: torch.optim.Optimizer, info: DistInfo) -> bool:
        """Whether a run can read its values late: one process, and every parameter group fused.

        (A group's own ``fused`` counts: a checkpoint's groups replace the optimizer's at resume.)
        """
        return not info.enabled and all(group.get("fused") for group in optimizer.param_groups)

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, a no-op on the device if this step's loss or norm is not finite."""
        optimizer.grad_scale, optimizer.found_inf = None, self.nonfinite
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf

    def read(self) -> tuple[int, float, float, float]:
        """``(step, lr, loss, gnorm)``: the loss averaged over the micro-batches, as :func:`forward_backward`'s."""
        if self.done is not None:
            self.done.synchronize()
        loss_sum, gnorm = self.host.tolist()
        return self.step, self.lr, loss_sum / self.accum, gnorm


@torch.no_grad()
def evaluate(model: nn.Module, windows: Tensor, batch_size: int, info: DistInfo, device, autocast) -> float:
    """Mean loss over ``windows`` (``[N, S]`` int64), each rank taking every ``world``-th one; weighted by window."""
    model.eval()
    total, count = 0.0, 0
    mine = windows[info.rank :: info.world]
    for i in range(0, len(mine), batch_size):
        ids = mine[i : i + batch_size].to(device)
        total += lm_loss(model, ids, autocast).item() * len(ids)
        count += len(ids)
    total, count = all_reduce_sum([total, float(count)], info, device)
    model.train()
    return total / max(count, 1)


def save_run_checkpoint(ckpt_root: Path, cfg: TrainConfig, info: DistInfo, device, *, model, optimizer, scheduler,
                        spikes: SpikeTracker, counters: Counters, tok, max_steps: int, overrides: list[dict],
                        corpus: dict | None = None) -> None:  # fmt: skip
    """Save checkpoint ``counters.step`` of the run (a collective: every rank calls it; rank 0 writes).

    The trainer state holds what resuming needs to continue exactly: the optimizer (gathered into
    full tensors under FSDP2), scheduler, spike tracker, every rank's RNG states, counters, the
    data position, the run's config and its ``--resume-override`` records, and the corpus's
    record (:meth:`mhc.train.Corpus.record`; a resume refuses a corpus whose SHA-256 differs).
    """
    tokens_per_step = cfg.batch_size * cfg.grad_accum * info.world * cfg.seq_len
    rngs = gather_objects(rng_state(device), info)
    trainer_state = {
        "format": CHECKPOINT_FORMAT,
        "step": counters.step,
        "max_steps": max_steps,
        "tokens_seen": counters.step * tokens_per_step,
        "data_cursor": counters.step * cfg.batch_size * cfg.grad_accum * info.world,
        "optimizer": full_state(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
        "spikes": spikes.state_dict(),
        "rng": rngs,
        "world": info.world,
        "elapsed_s": counters.elapsed_s,
        "max_grad_norm": counters.max_grad_norm,
        "skipped_steps": counters.skipped_steps,
        "skipped_in_a_row": counters.skipped_in_a_row,
        "config": cfg.to_dict(),
        "overrides": overrides,
        "corpus": corpus,
        "corpus_sha256": corpus["sha256"] if corpus else None,
    }
    model_sd = full_state(model.state_dict())
    if info.is_main:
        save_checkpoint(
            ckpt_root, counters.step, model.config, model_sd, trainer_state, tok, cfg.keep_checkpoints
        )
    barrier(info)
