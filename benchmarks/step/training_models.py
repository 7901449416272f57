"""The shapes, models and training steps ``bench_training.py`` measures: each shape's configuration (the small_gpu
preset's, or the 134M / 1.1B Llama's; tiny for the CPU check) and what it runs, the residual and mHC models built
from it, compiled as ``mhc.train`` compiles them, and the step of each recipe (``bf16``: ``common.training_step``;
``autocast``: ``mhc.train``'s loop body)."""

from __future__ import annotations

import functools
import importlib
import math

import common
import torch
from bench_compile import llama_1b

N_STREAMS = 4
# batch x seq of each shape; the small_gpu preset's are read from its config (32 x 512), checked in the tests.
LLAMA_SHAPES = {"134m": (8, 2048), "1b": (4, 2048)}
TINY = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "intermediate_size": 128,
    "vocab": 256,
    "batch": 2,
    "seq": 32,
}


def preset_config(
    kind: str,
    batch: int | None = None,
    seq: int | None = None,
    init: str = "paper",
    tiny: bool = False,
    stream_dtype: str | None = None,
    package: str = "mhc",
):
    """The small_gpu preset's ``TrainConfig`` for ``kind`` (residual or mhc), as ``scripts/train_lm.py --config`` loads it
    (with ``package``'s ``train.load_config``: ``mhc``, or an earlier commit's ``mhc_base``).

    The mHC one gets ``mhc_options.init = init`` (and ``mhc_options.stream_dtype`` unless ``None``, the
    library's default); ``batch``/``seq`` replace the preset's (the Llama shapes' optimizer settings are the preset's too);
    ``tiny`` shrinks the model.
    """
    load_config = importlib.import_module(f"{package}.train").load_config

    overrides: dict = {}
    if kind == "mhc":
        overrides["mhc_options"] = {"init": init}
        if stream_dtype is not None:
            overrides["mhc_options"]["stream_dtype"] = stream_dtype
    if tiny:
        overrides.update(
            hidden_size=TINY["hidden_size"],
            num_layers=TINY["num_layers"],
            num_heads=TINY["num_heads"],
            intermediate_size=TINY["intermediate_size"],
            batch_size=TINY["batch"],
            seq_len=TINY["seq"],
        )
    if batch is not None:
        overrides["batch_size"] = batch
    if seq is not None:
        overrides["seq_len"] = seq
    return load_config(f"small_gpu_{kind}", overrides)


def llama_config(shape: str, seq: int, tiny: bool):
    """The LlamaConfig of the ``134m`` or ``1b`` shape (tiny: the same structure, GQA kept for 1b)."""
    if not tiny:
        return common.llama_134m(seq) if shape == "134m" else llama_1b(seq)
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=TINY["hidden_size"],
        num_hidden_layers=TINY["num_layers"],
        num_attention_heads=TINY["num_heads"],
        num_key_value_heads=TINY["num_heads"] // 2 if shape == "1b" else TINY["num_heads"],
        intermediate_size=TINY["intermediate_size"],
        vocab_size=TINY["vocab"],
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )


def shape_plan(shape: str, tiny: bool, init: str = "paper") -> dict:
    """What a shape runs: batch, seq, hidden size, layers, vocabulary, and how its models are made."""
    if shape == "small_gpu":
        cfg = preset_config("mhc", init=init, tiny=tiny)
        return {
            "batch": cfg.batch_size,
            "seq": cfg.seq_len,
            "hidden": cfg.hidden_size,
            "layers": cfg.num_layers,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads or cfg.num_heads,
            "intermediate": cfg.intermediate_size,
            "vocab": TINY["vocab"] if tiny else cfg.bpe_vocab_size,
            "built": "mhc.train.build_model(preset small_gpu_{residual,mhc}), float32 on the CPU, then .to(device)",
        }
    batch, seq = (TINY["batch"], TINY["seq"]) if tiny else LLAMA_SHAPES[shape]
    cfg = llama_config(shape, seq, tiny)
    return {
        "batch": batch,
        "seq": seq,
        "hidden": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "intermediate": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        "built": f"LlamaForCausalLM on the device; mhc: convert_to_mhc(n_streams={N_STREAMS})",
    }


def build(
    shape: str,
    kind: str,
    recipe: str,
    device: torch.device,
    args,
    stream_dtype: str | None = None,
    package: str = "mhc",
) -> torch.nn.Module:
    """The ``kind`` (residual or mhc) model of ``shape`` on ``device``: float32 (autocast) or wholly bf16, in train mode;
    the mHC one keeps its streams in ``stream_dtype`` (``MHCConfig.stream_dtype``; ``None``: the library's default).
    The residual one is the base model: a Llama, or the preset's ``mode="residual"``, which keeps its stream in the
    hidden state's dtype whatever ``stream_dtype`` says. ``package``: the package that builds it (``mhc``, or an
    earlier commit's copy, ``mhc_base``, for an A/B in one process)."""
    dtype = torch.bfloat16 if recipe == "bf16" else torch.float32
    torch.manual_seed(0)
    if shape == "small_gpu":  # as mhc.train.loop.train: seed, build_model on the CPU, model.to(device)
        build_model = importlib.import_module(f"{package}.train.model").build_model
        cfg = preset_config(kind, init=args.init, tiny=args.tiny, stream_dtype=stream_dtype, package=package)
        vocab = (
            TINY["vocab"] if args.tiny else cfg.bpe_vocab_size
        )  # the preset's BPE has bpe_vocab_size tokens
        model = build_model(cfg, vocab, eos_id=0).to(device, dtype)
    else:
        from transformers import LlamaForCausalLM

        plan = shape_plan(shape, args.tiny)
        with torch.device(device):  # built on the device: a 1.1B model's init on the host takes seconds
            model = LlamaForCausalLM(llama_config(shape, plan["seq"], args.tiny))
        model = model.to(dtype)
        if kind == "mhc":
            options = {} if stream_dtype is None else {"stream_dtype": stream_dtype}
            convert = importlib.import_module(package).convert_to_mhc
            model = convert(model, n_streams=N_STREAMS, init=args.init, **options)
    return model.train()


class FixedBatches:
    """What ``mhc.train.loop.forward_backward`` reads its batches from (``PackedData.train_batch``): one CPU batch."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def train_batch(self, start: int, count: int) -> torch.Tensor:
        return self.ids[:count]


def compile_model(model: torch.nn.Module, backend: str, device: torch.device, cfg=None) -> torch.nn.Module:
    """The model compiled as ``mhc.train`` compiles it: ``wrap_model`` with ``compile=true`` in one process."""
    if backend != "inductor":
        return torch.compile(model, backend=backend)
    from mhc.train.config import apply_overrides
    from mhc.train.distributed import DistInfo, wrap_model

    cfg = apply_overrides(cfg if cfg is not None else preset_config("mhc"), {"compile": True})
    return wrap_model(model, cfg, DistInfo(), device)


def make_step(
    model, recipe: str, run: torch.nn.Module, ids: torch.Tensor, device: torch.device, cfg, late: bool = False
):
    """One training step of ``model`` (called through ``run``: itself or its compiled module) in ``recipe``.

    The autocast step is ``mhc.train.loop.train``'s loop body with the immediate read of the loss and norm
    (every step waits for the GPU, as ``common.time_calls`` times it), or with ``late=True`` the trainer's
    late read on one CUDA device (``mhc.train.loop.LateValues``: the optimizer skips a non-finite step on
    the device, the values are read a step later), which only a run of steps timed together shows. The returned callable has ``.optimizer``, ``.scheduler`` (for ``common.step_peak_memory``
    and ``host_gap.py``) and ``.counts`` (``steps``, ``skipped``: steps whose loss or gradient was not
    finite, which ``mhc.train`` does not apply; with the late read, counted a step later).
    """
    if recipe == "bf16":  # bench_compile.py's step
        step = common.training_step(run, ids.to(device))
        step.counts = {"steps": 0, "skipped": 0}
        return step

    from mhc.train.distributed import DistInfo
    from mhc.train.loop import LateValues, forward_backward, forward_backward_tensors
    from mhc.train.model import build_optimizer

    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    max_steps = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.tokens / tokens_per_step))
    optimizer, scheduler = build_optimizer(model, cfg, max_steps, device)
    autocast = functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    info, data, counts = DistInfo(), FixedBatches(ids.cpu()), {"steps": 0, "skipped": 0}
    if late and not LateValues.usable(optimizer, info):
        raise ValueError(
            "the late read needs a fused optimizer (the trainer's AdamW on CUDA) and one process"
        )
    pending = []  # the step whose values are still to be read (late read)

    def step() -> None:  # the body of mhc.train.loop.train's step loop, less its logging
        optimizer.zero_grad(set_to_none=True)
        if late:
            lr = optimizer.param_groups[0]["lr"]
            loss_sum, gnorm = forward_backward_tensors(
                run, model, data, counts["steps"], cfg, info, device, autocast
            )
            if pending:
                _, _, loss, norm = pending.pop().read()
                counts["skipped"] += not (math.isfinite(loss) and math.isfinite(norm))
            pending.append(LateValues(counts["steps"] + 1, lr, loss_sum, gnorm, cfg.grad_accum))
            pending[-1].step_optimizer(optimizer)
        else:
            loss, gnorm = forward_backward(run, model, data, counts["steps"], cfg, info, device, autocast)
            if math.isfinite(gnorm) and math.isfinite(loss):
                optimizer.step()
            else:
                counts["skipped"] += 1
        scheduler.step()
        counts["steps"] += 1

    step.optimizer, step.scheduler = optimizer, scheduler
    step.counts = counts
    return step


def streams_dtype(model: torch.nn.Module, recipe: str, device: torch.device) -> torch.dtype:
    """The dtype of ``model``'s streams in ``recipe``: the embedding's output (autocast leaves embeddings alone, so
    float32 weights give float32 streams) under the model's ``stream_dtype`` setting (``"hidden"`` for the residual
    model), with autocast on in the ``autocast`` recipe."""
    from mhc.streams import stream_dtype_for

    hidden = torch.empty(0, dtype=model.get_input_embeddings().weight.dtype, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=recipe == "autocast"):
        return stream_dtype_for(hidden, getattr(model, "stream_dtype", "hidden"))


def site_element_sizes(model: torch.nn.Module, recipe: str, device: torch.device) -> dict[str, int]:
    """Bytes a value of the fused site's arrays take in ``recipe`` (``common.site_kernel_bytes``' ``elt``,
    ``u_elt`` and ``y_elt``): the streams' dtype; ``u``'s (``mhc.site.branch_input_dtype``: float32 from bf16
    streams under autocast with float32 weights); and ``y``'s, the sublayer's output (bf16 under autocast,
    whose matmuls give bf16, else the weights' dtype)."""
    from mhc.site import branch_input_dtype

    weights = model.get_input_embeddings().weight.dtype
    streams = streams_dtype(model, recipe, device)
    autocast = recipe == "autocast"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        u = branch_input_dtype(torch.empty(0, 1, dtype=streams, device=device), weights)
    y = torch.bfloat16 if autocast else weights
    return {"elt": streams.itemsize, "u_elt": u.itemsize, "y_elt": y.itemsize}


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
