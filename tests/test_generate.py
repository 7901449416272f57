"""``generate()`` of a converted model with the static KV cache and under ``torch.compile`` (CPU, and CUDA).

The static cache must give the dynamic cache's tokens; compiled, the decode
steps must run as one graph with no breaks and no recompiles, with the same
tokens. On CUDA ``generate(cache_implementation="static")`` compiles by
itself; on the CPU transformers is told to (``CompileConfig._compile_all_devices``).
``benchmarks/decode/bench_decode.py`` runs end to end on the CPU as well (``--device cpu --tiny``).
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
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
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
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
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
    static_tokens, static_logits = greedy(
        model, ids, mask, cache_implementation="static", disable_compile=True
    )
    assert tokens.shape == (3, ids.shape[1] + NEW_TOKENS)
    assert torch.equal(static_tokens, tokens), f"seed {fresh_seed}: {static_tokens} != {tokens}"
    torch.testing.assert_close(
        static_logits, logits, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed {fresh_seed}: {m}"
    )
    # the token-dependent mixing matters here: without it (φ = 0) the logits are far from these
    with mhc.hf.verify.identity_coefficients(model):
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
    compiled_tokens, compiled_logits = greedy(
        model, ids, mask, cache_implementation="static", compile_config=config
    )
    assert calls[0] == NEW_TOKENS - 1, f"{calls[0]} decode steps went through the compiled forward"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    tol = 1e-4 if device == "cpu" else 1e-3  # inductor's kernels sum in their own order
    torch.testing.assert_close(
        compiled_logits, logits, rtol=tol, atol=tol, msg=lambda m: f"seed {fresh_seed}: {m}"
    )
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
    """benchmarks/decode/bench_decode.py as a module (run in this process: it skips a second import of torch)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "decode"))
    try:
        return importlib.import_module("bench_decode")
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "decode"))


@pytest.mark.slow  # a benchmark script, end to end
def test_bench_decode_runs_end_to_end_on_the_cpu(bench_decode, tmp_path, capsys):
    out = tmp_path / "decode.json"
    bench_decode.main(
        [
            "--device",
            "cpu",
            "--tiny",
            "--modes",
            "eager,compiled",
            "--batches",
            "2",
            "--new-tokens",
            "3",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--profile",
            "--profile-steps",
            "2",
            "--profile-top",
            "5",
            "--step-times",
            "--json",
            str(out),
        ]
    )
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
    assert "x residual" in captured.out and "torch.profiler" in captured.out and "cProfile" in captured.out, (
        log
    )
    steps = json.loads(out.read_text())["step_times"]["2"]
    for name in ("residual", "mhc"):
        assert (
            steps[name]["best_host_us"] > 0 and steps[name]["best_wall_us"] >= steps[name]["best_host_us"]
        ), steps
        split = steps[name]["layer_host_us"]
        assert split["layer_calls"] == 2 and split["layers"] > split["sublayers"] > 0, f"{name}: {split}"


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


def test_converted_sites_are_linked_in_order_and_copies_run_unlinked():
    """MHCForCausalLM links each site to the next (across layers too); deepcopy and pickling drop the links."""
    import copy
    import pickle

    model = tiny_mhc_llama()
    sites = [getattr(layer, name) for layer in model.decoder_layers() for name in layer.site_names]
    assert len(sites) == 4
    assert [s.next_site for s in sites] == [*sites[1:], None]
    assert copy.deepcopy(sites[0]).next_site is None
    assert pickle.loads(pickle.dumps(sites[0])).next_site is None
    with pytest.raises(TypeError, match="next_site must be an MHCBlock"):
        sites[0].set_next_site(torch.nn.Linear(2, 2))
    # a link is not a submodule: no block holds another, no state-dict key goes through one
    assert not any(isinstance(c, mhc.MHCBlock) for s in sites for c in s.children())
    assert not any("next_site" in key for key in model.state_dict())


@CUDA
@pytest.mark.parametrize("batch", [1, 5])
def test_fused_site_boundaries_decode_the_unlinked_bits(batch, fresh_seed):
    """Generation with each site boundary in one launch (post-mix + next pre-step) gives the logits of the
    unlinked model bit for bit; the profiler sees the fused kernel at 3 of each forward's 4 site boundaries.
    Under inference_mode the sites run unfused (no version counter to trust), with the same bits."""
    model = tiny_mhc_llama(fresh_seed % 1000).cuda()
    ids, mask = (t.cuda() for t in prompts(fresh_seed, batch=batch))
    sites = [m for m in model.modules() if isinstance(m, mhc.MHCBlock)]
    links = [s.next_site for s in sites]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        tokens, logits = greedy(model, ids, mask)
    names = [e.key for e in prof.key_averages()]
    fused_calls = sum(e.count for e in prof.key_averages() if "site_post_pre_tokens_kernel" in e.key)
    pre_calls = sum(e.count for e in prof.key_averages() if "site_pre_tokens_kernel" in e.key)
    # NEW_TOKENS forwards (the prompt's 7·batch tokens too are at most MAX_TOKENS): 3 fused boundaries and
    # 1 pre-step each
    assert fused_calls == 3 * NEW_TOKENS and pre_calls == NEW_TOKENS, (fused_calls, pre_calls, names)
    for s in sites:
        s.set_next_site(None)
    try:
        plain_tokens, plain_logits = greedy(model, ids, mask)
    finally:
        for s, after in zip(sites, links):
            s.set_next_site(after)
    assert torch.equal(tokens, plain_tokens) and torch.equal(logits, plain_logits), f"seed {fresh_seed}"
    # under inference_mode (no version counters) the linked model runs its sites unfused, with the same bits
    with torch.inference_mode():
        inference_tokens, inference_logits = greedy(model, ids, mask)
    assert torch.equal(inference_tokens, tokens) and torch.equal(inference_logits, logits), (
        f"seed {fresh_seed}"
    )


@CUDA
def test_next_site_runs_its_own_pre_step_on_other_input(fresh_seed):
    """The first step the previous site computed is used only for that site's output, unmodified."""
    torch.manual_seed(fresh_seed)
    C, n = 64, 4
    first, second = (
        mhc.MHCBlock(torch.nn.Linear(C, C), C, n, init="paper", layer_index=i).cuda() for i in range(2)
    )
    with torch.no_grad():
        for block in (first, second):
            block.phi.normal_(std=0.1)
        first.set_next_site(second)
        x = torch.randn(3, n, C, device="cuda")
        out = first(x)
        linked = second(out)  # the prefetched first step
        out2 = first(x)
        out2.mul_(1.5)  # modified in place: its own first step
        modified = second(out2)
        first(x)
        other = second(out * 2)  # another tensor: its own first step
        first.set_next_site(None)
        assert torch.equal(linked, second(first(x))), f"seed {fresh_seed}"
        assert torch.equal(modified, second(first(x) * 1.5)), f"seed {fresh_seed}"
        assert torch.equal(other, second(out * 2)), f"seed {fresh_seed}"
