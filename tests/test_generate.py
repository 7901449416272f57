"""``generate()`` of a converted model with the static KV cache and under ``torch.compile`` (CPU, and CUDA).

The static cache must give the dynamic cache's tokens; compiled, the decode
steps must run as one graph with no breaks and no recompiles, with the same
tokens. On CUDA ``generate(cache_implementation="static")`` compiles by
itself; on the CPU transformers is told to (``CompileConfig._compile_all_devices``).
``benchmarks/bench_decode.py`` runs end to end on the CPU as well (``--device cpu --tiny``).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import CompileConfig

import mhc

ROOT = Path(__file__).resolve().parent.parent
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 97
NEW_TOKENS = 6


def tiny_mhc_llama(seed: int = 0) -> mhc.MHCForCausalLM:
    """A 2-layer Llama converted to mHC; weights scaled up and the sites' coefficients drawn at random
    (α = 1, biases N(0, 1)), so the stream mixing depends strongly on each token."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(5.0)
    model = mhc.convert_to_mhc(model, n_streams=4, init="paper")
    with torch.no_grad():
        for site in (m for m in model.modules() if isinstance(m, mhc.MHCBlock)):
            site.alpha.fill_(1.0)
            for bias in (site.b_pre, site.b_post, site.b_res):
                bias.normal_()
    model.generation_config.eos_token_id = None  # every call decodes NEW_TOKENS
    return model.eval()


def prompts(seed: int, batch: int = 3, length: int = 7, padded: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts and their attention mask; row 0 is left-padded by ``padded`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :padded], mask[0, :padded] = 0, 0
    return ids, mask


def greedy(model, ids, mask, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
                         **kwargs)
    return out.sequences, torch.stack(out.logits, dim=1)


def cpu_compile_config(backend: str) -> CompileConfig:
    """transformers' compile settings for generate(), allowed on the CPU, with fullgraph=True."""
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    return config


def count_compiled_calls(model) -> list[int]:
    """Count the forwards ``generate()`` makes through ``model.get_compiled_call``'s compiled function."""
    calls = [0]
    original = model.get_compiled_call

    def spy(compile_config):
        compiled = original(compile_config)

        def counted(*args, **kwargs):
            calls[0] += 1
            return compiled(*args, **kwargs)

        return counted

    model.get_compiled_call = spy
    return calls


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_static_cache_gives_the_dynamic_cache_tokens(device, fresh_seed):
    model = tiny_mhc_llama().to(device)
    ids, mask = (t.to(device) for t in prompts(fresh_seed))
    tokens, logits = greedy(model, ids, mask)
    static_tokens, static_logits = greedy(model, ids, mask, cache_implementation="static", disable_compile=True)
    assert tokens.shape == (3, ids.shape[1] + NEW_TOKENS)
    assert torch.equal(static_tokens, tokens), f"seed {fresh_seed}: {static_tokens} != {tokens}"
    torch.testing.assert_close(static_logits, logits, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed {fresh_seed}: {m}")
    # the token-dependent mixing matters here: without it (φ = 0) the logits are far from these
    with mhc.hf_verify.identity_coefficients(model):
        _, fixed_logits = greedy(model, ids, mask)
    assert (fixed_logits - logits).abs().max() > 0.1, f"seed {fresh_seed}: the mixing changes nothing"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_compiled_static_cache_generate_is_one_graph_without_recompiles(device, fresh_seed):
    """generate()'s own compiled decode (``get_compiled_call``) with fullgraph=True: on the CPU with aot_eager
    (functionalized, as inductor sees it); on CUDA transformers' defaults, inductor with CUDA graphs
    (``mode="reduce-overhead"``), around the default fused site."""
    model = tiny_mhc_llama().to(device)
    ids, mask = (t.to(device) for t in prompts(fresh_seed))
    tokens, logits = greedy(model, ids, mask)
    calls = count_compiled_calls(model)
    torch._dynamo.reset()
    counters.clear()
    config = cpu_compile_config("aot_eager") if device == "cpu" else CompileConfig(fullgraph=True)
    compiled_tokens, compiled_logits = greedy(model, ids, mask, cache_implementation="static", compile_config=config)
    assert calls[0] == NEW_TOKENS - 1, f"{calls[0]} decode steps went through the compiled forward"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    tol = 1e-4 if device == "cpu" else 1e-3  # inductor's kernels sum in their own order
    torch.testing.assert_close(compiled_logits, logits, rtol=tol, atol=tol, msg=lambda m: f"seed {fresh_seed}: {m}")
    assert torch.equal(compiled_tokens, tokens), f"seed {fresh_seed}: {compiled_tokens} != {tokens}"

    # new prompts of the same shape: the same graph, every decode step
    ids2, mask2 = (t.to(device) for t in prompts(fresh_seed + 1))
    with torch._dynamo.config.patch(error_on_recompile=True):
        again, _ = greedy(model, ids2, mask2, cache_implementation="static", compile_config=config)
    assert calls[0] == 2 * (NEW_TOKENS - 1) and counters["stats"]["unique_graphs"] == 1
    assert torch.equal(again, greedy(model, ids2, mask2)[0]), f"seed {fresh_seed + 1}"


def test_compiled_forward_generates_the_eager_tokens(fresh_seed):
    """The user's way: ``model.forward = torch.compile(model.forward, fullgraph=True)``, then static-cache
    generate(): one graph for the prefill and one for the decode steps, no breaks, no recompiles."""
    model = tiny_mhc_llama()
    ids, mask = prompts(fresh_seed)
    tokens, _ = greedy(model, ids, mask)
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    compiled_tokens, _ = greedy(model, ids, mask, cache_implementation="static", disable_compile=True)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # prefill [3, 7], decode [3, 1]
    assert torch.equal(compiled_tokens, tokens), f"seed {fresh_seed}: {compiled_tokens} != {tokens}"
    with torch._dynamo.config.patch(error_on_recompile=True):
        ids2, mask2 = prompts(fresh_seed + 1)
        greedy(model, ids2, mask2, cache_implementation="static", disable_compile=True)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.fixture(scope="module")
def bench_decode():
    """benchmarks/bench_decode.py as a module (run in this process: it skips a second import of torch)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("bench_decode")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_bench_decode_runs_end_to_end_on_the_cpu(bench_decode, tmp_path, capsys):
    out = tmp_path / "decode.json"
    bench_decode.main(["--device", "cpu", "--tiny", "--modes", "eager,compiled", "--batches", "2",
                       "--new-tokens", "3", "--rounds", "1", "--steps", "1", "--profile", "--profile-steps", "2",
                       "--profile-top", "5", "--json", str(out)])
    captured = capsys.readouterr()
    log = captured.out + captured.err
    assert "Traceback" not in log, log
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"eager 2", "compiled 2"}, log
    for key, info in results.items():
        assert set(info) == {"residual", "mhc"}, f"{key}: {info}"
        assert info["residual"]["x_residual"] == 1.0 and info["mhc"]["x_residual"] > 0, f"{key}: {info}"
        for name in ("residual", "mhc"):
            assert info[name]["tok_s"] > 0, f"{key} {name}: {info[name]}"
            if key.startswith("compiled"):
                assert info[name]["took_compiled_path"], f"{key} {name}: {info[name]}"
                assert info[name]["dynamo"]["graph_breaks"] == 0, f"{key} {name}: {info[name]}"
                assert info[name]["graphs_compiled_while_timed"] == 0, f"{key} {name}: {info[name]}"
    assert "x residual" in captured.out and "torch.profiler" in captured.out and "cProfile" in captured.out, log


def test_bench_decode_rejects_unknown_modes_and_bad_counts(bench_decode, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_decode.parse_args(["--modes", "eager,compield"])
    assert exit_info.value.code == 2 and "unknown --modes ['compield']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--models", "residual,mch"])
    assert "unknown --models ['mch']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--batches", "1,0"])
    assert "--batches" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--new-tokens", "0"])
    assert "--new-tokens must be >= 1" in capsys.readouterr().err
