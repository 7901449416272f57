"""Greedy decoding tokens/s: the residual 134M Llama against its mHC conversion, eager and static-cache compiled.

    python benchmarks/decode/bench_decode.py                          # batch 1 and 16, modes eager and compiled
    python benchmarks/decode/bench_decode.py --batches 16 --modes compiled
    python benchmarks/decode/bench_decode.py --profile                # also the host-time profile of eager mHC decode steps
    python benchmarks/decode/bench_decode.py --modes '' --profile     # the profile alone
    python benchmarks/decode/bench_decode.py --models residual,mhc,mhc-torch   # also the fused=False site
    python benchmarks/decode/bench_decode.py --models residual,mhc,mhc-unlinked --modes eager   # A/B the fused boundaries
    python benchmarks/decode/bench_decode.py --models residual,mhc,mhc-norms --modes eager      # A/B the fused branch norms
    python benchmarks/decode/bench_decode.py --modes '' --step-times  # raw decode steps per model: host, wall, in the layers
    python benchmarks/decode/bench_decode.py --json decode.json
    python benchmarks/decode/bench_decode.py --device cpu --tiny      # a tiny Llama on the CPU: checks the logic only

Models (``--models``; default ``residual,mhc``): ``residual`` is
``LlamaForCausalLM`` with the 134M config of ``common.llama_134m`` (bf16 on
CUDA, random weights drawn from ``--seed``); ``mhc`` the same weights
converted with ``mhc.convert_to_mhc(model, n_streams=4, init="paper")`` (the
default fused site); ``mhc-unlinked`` the same with its sites unlinked
(``MHCBlock.set_next_site(None)``: each site boundary two launches, not one);
``mhc-norms`` the same with ``fuse_input_norm = False`` on every layer (each
branch runs its own input RMSNorm instead of the site's first step applying it);
``mhc-torch`` the same with ``fused=False`` (the PyTorch site, which inductor
fuses in mode ``compiled``).
Each ``generate()`` is greedy, a ``--prompt``-token random prompt (32),
exactly ``--new-tokens`` new tokens (128: ``min_new_tokens = max_new_tokens``,
no EOS). tokens/s = batch x new tokens / wall time of the whole call (its one
prefill forward included).

Modes (``--modes``, comma-separated; default ``eager,compiled``):

* ``eager``: ``generate()`` with the default dynamic KV cache;
* ``static``: ``generate(cache_implementation="static", disable_compile=True)``;
* ``compiled``: ``generate(cache_implementation="static")``, which on CUDA
  makes transformers run every decode step through
  ``torch.compile(model.__call__, **CompileConfig().to_dict())``
  (``get_compiled_call``: inductor, ``mode="reduce-overhead"``, i.e. CUDA
  graphs; ``--fullgraph``, ``--compile-mode``, ``--backend`` change it). The
  prefill runs eagerly. The script checks that the decode steps really go
  through the compiled call, and prints dynamo's graph, graph-break and
  CUDA-graph-skip counters and the graphs compiled during the timed calls
  (recompiles; should be 0). Dynamo is reset before each batch size, so
  each batch compiles its own static-shape graphs, as in a process running
  that batch alone. The compile time is the first call's wall time.

Protocol: a throw-away model first decodes at every batch size (the first
model a process runs decodes several times slower; for ``compiled`` a small
function is compiled too, the compiler's start-up); then, per mode and
batch, each model's first call (and for ``compiled`` a second) is made
untimed, and the models are timed in interleaved rounds (``--rounds``
rounds of ``--steps`` calls each); the best of a model's round medians is
kept. A variant that fails prints its traceback and the others go on.
Estimated at 2-3 minutes on an H200 at the defaults (not measured yet), most of it compiling.

``--profile`` then runs ``--profile-steps`` eager decode steps of the mHC
model after a prefill (dynamic cache, batch ``--profile-batch``, the prefill
not profiled): plainly timed (µs per step); with timing hooks on every mHC
site and on its sublayers (host time of a site call beyond its norms,
attention or MLP); under ``torch.profiler`` (ops by self CPU time, per step);
under ``cProfile`` (Python functions by own and by cumulative time).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, where common.py is
import common  # noqa: E402
import torch
import transformers
from decode_profile import profile, step_times, sync  # noqa: E402  (benchmarks/decode/, this script's folder)
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import CompileConfig

import mhc

MODES = ("eager", "static", "compiled")
MODELS = ("residual", "mhc", "mhc-unlinked", "mhc-norms", "mhc-torch")
ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """``$COMMIT`` if set (benchmarks/gpu_session.sh: a copied tree's git may be stale), else the checkout's
    commit, ``-dirty`` when tracked files differ from it."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tiny_llama(seq: int) -> LlamaConfig:
    """A 2-layer Llama (hidden 32, vocabulary 97) for checking the script on a CPU."""
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=seq,
    )


def build(name: str, cfg: LlamaConfig, device: str, dtype: torch.dtype, seed: int):
    """The residual Llama drawn from ``seed`` (``name="residual"``), or its mHC conversion (``"mhc"``; ``"mhc-unlinked"``
    with its sites unlinked; ``"mhc-norms"`` with the branch norms unfused; ``"mhc-torch"`` with ``fused=False``),
    in eval mode."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(device, dtype)
    if name != "residual":
        model = mhc.convert_to_mhc(model, n_streams=4, init="paper", fused=name != "mhc-torch")
        if name == "mhc-unlinked":
            for site in (m for m in model.modules() if isinstance(m, mhc.MHCBlock)):
                site.set_next_site(None)
        if name == "mhc-norms":
            for layer in model.decoder_layers():
                layer.fuse_input_norm = False
    model.generation_config.eos_token_id = None  # every call decodes exactly --new-tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


class CompiledCallSpy:
    """Wraps ``model.get_compiled_call`` so that the calls made through the compiled forward are counted."""

    def __init__(self, model):
        self.calls = 0
        self._original = model.get_compiled_call
        model.get_compiled_call = self._wrapped

    def _wrapped(self, compile_config):
        compiled = self._original(compile_config)

        def counted(*args, **kwargs):
            self.calls += 1
            return compiled(*args, **kwargs)

        return counted


class CudagraphSkips(logging.Handler):
    """Collects the reasons inductor logs (torch's "cudagraphs" log) when it runs a CUDA graph without CUDA graphs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []
        logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage()[:300])


def dynamo_counts(skips: CudagraphSkips) -> dict:
    breaks = dict(counters["graph_break"])
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(breaks.values()),
        "break_reasons": {k[:300]: v for k, v in list(breaks.items())[:5]},
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "cudagraph_skip_reasons": skips.reasons[:5],
    }


def generate_call(model, ids: torch.Tensor, mode: str, new_tokens: int, compile_config: CompileConfig):
    """A function running one greedy ``generate()`` of ``mode``; it checks the output's length."""
    kwargs = {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
    }
    if mode == "static":
        kwargs.update(cache_implementation="static", disable_compile=True)
    elif mode == "compiled":
        kwargs.update(cache_implementation="static", compile_config=compile_config)

    def run() -> torch.Tensor:
        out = model.generate(ids, **kwargs)
        if out.shape != (ids.shape[0], ids.shape[1] + new_tokens):
            raise RuntimeError(
                f"generate() returned shape {tuple(out.shape)}, expected "
                f"{(ids.shape[0], ids.shape[1] + new_tokens)}"
            )
        return out

    return run


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def measure(calls: dict, tokens: int, rounds: int, steps: int, device: str) -> dict:
    """Interleaved rounds of ``steps`` timed calls of each of ``calls``; tokens/s is the best round median.
    A variant whose call raises is reported (traceback) and dropped; the others go on."""
    out = {name: {"round_medians": [], "seconds": []} for name in calls}
    live = dict(calls)
    for _ in range(rounds):
        for name, fn in list(live.items()):
            try:
                seconds = [timed(fn, device) for _ in range(steps)]
            except Exception:
                print(f"  {name}: failed while timed:", flush=True)
                traceback.print_exc()
                out[name]["error"] = traceback.format_exc(limit=3)
                del live[name]
                continue
            out[name]["seconds"].append(seconds)
            out[name]["round_medians"].append(tokens / statistics.median(seconds))
    for row in out.values():
        row["tok_s"] = max(row["round_medians"]) if row["round_medians"] else None
    return out


def run_mode(
    mode: str, batch: int, models: dict, spies: dict, skips: CudagraphSkips, args, cfg, compile_config
) -> dict:
    """Untimed first calls of each model (compile, for ``compiled``), then the interleaved timing."""
    ids = torch.randint(
        3, cfg.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(batch)
    )
    ids = ids.to(args.device)
    if mode == "compiled":
        torch._dynamo.reset()  # each batch size compiles its own graphs
    calls, info = {}, {}
    for name, model in models.items():
        fn = generate_call(model, ids, mode, args.new_tokens, compile_config)
        row = info[name] = {}
        try:
            if mode == "compiled":
                counters.clear()
                skips.reasons = []
                spy = spies[name]
                spy.calls = 0
                row["first_call_s"] = timed(fn, args.device)
                row["second_call_s"] = timed(fn, args.device)
                row["compiled_calls"] = spy.calls
                row["decode_steps"] = 2 * (args.new_tokens - 1)
                row["dynamo"] = dynamo_counts(skips)
            else:
                row["first_call_s"] = timed(fn, args.device)
        except Exception:
            print(f"  {mode} batch {batch} {name}: failed:", flush=True)
            traceback.print_exc()
            row["error"] = traceback.format_exc(limit=3)
            continue
        calls[name] = fn
        text = f"  {mode:8} batch {batch:3} {name:8} first call {row['first_call_s']:7.2f} s"
        if mode == "compiled":
            d = row["dynamo"]
            took = row["compiled_calls"] == row["decode_steps"] and d["graphs"] > 0
            row["took_compiled_path"] = took
            text += (
                f"  compiled path: {'yes' if took else 'NO'} ({row['compiled_calls']} of "
                f"{row['decode_steps']} decode steps through get_compiled_call); graphs {d['graphs']}, "
                f"graph breaks {d['graph_breaks']}, cudagraph skips {d['cudagraph_skips']}"
            )
            for reason, count in d["break_reasons"].items():
                text += f"\n      break x{count}: {reason}"
            for reason in d["cudagraph_skip_reasons"]:
                text += f"\n      no CUDA graph: {reason}"
        print(text, flush=True)
    graphs_before = counters["stats"]["unique_graphs"]
    for spy in spies.values():
        spy.calls = 0
    timing = measure(calls, batch * args.new_tokens, args.rounds, args.steps, args.device)
    recompiles = counters["stats"]["unique_graphs"] - graphs_before
    for name, row in timing.items():
        info[name].update(row)
        if mode == "compiled":
            info[name]["graphs_compiled_while_timed"] = recompiles  # all models together
            info[name]["compiled_calls_while_timed"] = spies[name].calls
    if mode == "compiled" and calls:
        print(
            f"  compiled batch {batch}: graphs compiled while timed (all models): {recompiles}; decode steps "
            "through the compiled call while timed: " + ", ".join(f"{n} {spies[n].calls}" for n in calls),
            flush=True,
        )
    return info


def warm_up(cfg, args, dtype, compile_config: CompileConfig) -> None:
    """A throw-away residual model decodes once at each batch size; with mode ``compiled``, a small function is
    compiled first, so that the compiler's one-time start-up is not counted in the first model's compile time."""
    t0 = time.perf_counter()
    try:
        if "compiled" in args.modes:
            options = {"backend": compile_config.backend, "mode": compile_config.mode}
            x = torch.ones(64, device=args.device)
            torch.compile(lambda t: torch.nn.functional.silu(t) * 2 + 1, **options)(x)
            sync(args.device)
            torch._dynamo.reset()
        model = build("residual", cfg, args.device, dtype, seed=args.seed + 1)
        for batch in args.batches:
            ids = torch.randint(3, cfg.vocab_size, (batch, args.prompt), device=args.device)
            generate_call(model, ids, "eager", args.new_tokens, None)()
        del model
    except Exception:
        print("  warm-up failed:", flush=True)
        traceback.print_exc()
    print(f"  warm-up: {time.perf_counter() - t0:.1f} s", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default 1,16)")
    ap.add_argument("--modes", default="eager,compiled", help="comma-separated, from: " + ", ".join(MODES))
    ap.add_argument(
        "--models",
        default="residual,mhc",
        help="comma-separated, from: residual, mhc, mhc-unlinked, mhc-norms, mhc-torch (fused=False) "
        "(default residual,mhc)",
    )
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32; --tiny 8)")
    ap.add_argument(
        "--new-tokens", type=int, default=None, help="tokens decoded per call (default 128; --tiny 6)"
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds, the best median kept (default 2)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed generate() calls per round (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer hidden-32 Llama instead of the 134M one")
    ap.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor; on the CPU eager)"
    )
    ap.add_argument(
        "--compile-mode",
        default="reduce-overhead",
        help="torch.compile mode for the inductor backend (default reduce-overhead, transformers')",
    )
    ap.add_argument(
        "--fullgraph", action="store_true", help="compile with fullgraph=True (a graph break fails)"
    )
    ap.add_argument("--profile", action="store_true", help="profile eager mHC decode steps (see above)")
    ap.add_argument(
        "--step-times",
        action="store_true",
        help="also every model's prefill and raw decode step (host and wall), at each --batches",
    )
    ap.add_argument("--profile-batch", type=int, default=1, help="batch of the profiled decode (default 1)")
    ap.add_argument("--profile-steps", type=int, default=10, help="decode steps profiled (default 10)")
    ap.add_argument("--profile-top", type=int, default=30, help="rows of each profile table (default 30)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = ap.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batches takes comma-separated integers, got {args.batches!r}")
    for option, known in (("modes", MODES), ("models", MODELS)):
        chosen = [m.strip() for m in getattr(args, option).split(",") if m.strip()]
        unknown = [m for m in chosen if m not in known]
        if unknown:
            ap.error(f"unknown --{option} {unknown}; choose from {known}")
        setattr(args, option, chosen)
    args.prompt = (8 if args.tiny else 32) if args.prompt is None else args.prompt
    args.new_tokens = (6 if args.tiny else 128) if args.new_tokens is None else args.new_tokens
    for name in ("prompt", "new_tokens", "rounds", "steps", "profile_batch", "profile_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.batches or min(args.batches) < 1:
        ap.error("--batches must name batch sizes >= 1")
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "eager")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        common.require_cuda("bench_decode.py")
    start = time.perf_counter()
    env = common.environment()
    env.update(transformers=transformers.__version__, commit=commit())
    now = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"# {now:%Y-%m-%d %H:%M UTC}  {env['device']}  torch {env['torch']}  transformers {env['transformers']}  "
        f"commit {env['commit']}\n# command: python {' '.join(sys.argv)}",
        flush=True,
    )
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    seq = args.prompt + args.new_tokens
    cfg = tiny_llama(seq) if args.tiny else common.llama_134m(seq)
    compile_config = CompileConfig(
        fullgraph=args.fullgraph,
        backend=args.backend,
        mode=args.compile_mode if args.backend == "inductor" else None,
    )
    if args.device != "cuda":
        compile_config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    print(f"  compile config (mode compiled): {compile_config.to_dict()}", flush=True)

    warm_up(cfg, args, dtype, compile_config)
    models = {}
    for name in args.models:
        try:
            models[name] = build(name, cfg, args.device, dtype, args.seed)
        except Exception:
            print(f"  building {name} failed:", flush=True)
            traceback.print_exc()
    spies = {name: CompiledCallSpy(model) for name, model in models.items()}
    skips = CudagraphSkips()
    results = {}
    for mode in args.modes:
        for batch in args.batches:
            try:
                results[f"{mode} {batch}"] = run_mode(
                    mode, batch, models, spies, skips, args, cfg, compile_config
                )
            except Exception:
                print(f"  {mode} batch {batch}: failed:", flush=True)
                traceback.print_exc()

    print(
        f"\nGreedy decode, {'tiny Llama' if args.tiny else 'Llama 134M'}, {str(dtype)[6:]}, prompt {args.prompt}, "
        f"{args.new_tokens} new tokens; tok/s = batch x new tokens / generate() wall time, best of "
        f"{args.rounds} interleaved medians of {args.steps}"
    )
    print(
        f"  {'mode':9} {'batch':>5} {'model':12} {'tok/s':>9} {'x residual':>11} {'first call s':>13}   "
        "round medians (tok/s)"
    )
    for key, info in results.items():
        mode, batch = key.split()
        residual = info.get("residual", {}).get("tok_s")
        for name, row in info.items():
            value = row.get("tok_s")
            row["x_residual"] = value / residual if value and residual else None
            ratio = f"{row['x_residual']:11.3f}" if row["x_residual"] else f"{'-':>11}"
            first = f"{row['first_call_s']:13.2f}" if "first_call_s" in row else f"{'-':>13}"
            medians = " ".join(f"{v:.1f}" for v in row.get("round_medians", []))
            value_text = f"{value:9.1f}" if value else f"{'failed':>9}"
            print(f"  {mode:9} {batch:>5} {name:12} {value_text} {ratio} {first}   {medians}")

    figures = {"environment": env, "args": {k: v for k, v in vars(args).items()}, "results": results}
    profiled = next((n for n in models if n != "residual"), None)
    if args.step_times and models:
        try:
            figures["step_times"] = step_times(models, args, cfg)
        except Exception:
            print("  step times failed:", flush=True)
            traceback.print_exc()
    if args.profile and profiled is not None:
        try:
            print(f"\nprofiling {profiled}", flush=True)
            figures["profile"] = profile(models[profiled], args, cfg)
        except Exception:
            print("  profile failed:", flush=True)
            traceback.print_exc()
    print(f"\ntotal {time.perf_counter() - start:.0f} s", flush=True)
    if args.json:
        common.write_json(args.json, figures)


if __name__ == "__main__":
    main()
