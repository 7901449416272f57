"""``torch.compile(fullgraph=True)`` of mHC models: one graph, no recompiles, the eager numbers.

CPU tests run the PyTorch site and the reference projection op
(``mhc::birkhoff_reference``); the CUDA tests (skipped without CUDA) run the
model as a user would, with the default options.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

import mhc

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_llama(layers: int = 3, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def compile_and_count(fn, backend: str):
    """``torch.compile(fn, fullgraph=True)``; dynamo's counters are cleared first."""
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.mark.parametrize("mode", ["mhc", "hc"])
def test_converted_model_compiles_as_one_graph_and_matches_eager(mode, fresh_seed):
    model = mhc.convert_to_mhc(tiny_llama(), n_streams=4, mode=mode, init="paper")
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(fresh_seed))
    logits_eager, grads_eager = loss_and_grads(model, ids)

    compiled = compile_and_count(model.forward, backend="aot_eager")
    model.forward = compiled
    logits, grads = loss_and_grads(model, ids)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, f"seed {fresh_seed}: {dict(counters['stats'])}"
    torch.testing.assert_close(
        logits, logits_eager, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {fresh_seed}: {m}"
    )
    assert grads.keys() == grads_eager.keys()
    for name in grads:
        torch.testing.assert_close(
            grads[name],
            grads_eager[name],
            rtol=1e-4,
            atol=1e-6,
            msg=lambda m, name=name: f"seed {fresh_seed}, {name}: {m}",
        )

    # new inputs of the same shape, and more steps: no recompile (every layer's constants are not guards)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            ids = torch.randint(0, 97, (2, 12))
            loss_and_grads(model, ids)
    assert counters["stats"]["unique_graphs"] == 1


def test_inductor_compiled_model_matches_eager(fresh_seed):
    model = mhc.convert_to_mhc(tiny_llama(layers=2), n_streams=4, init="paper")
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(fresh_seed))
    logits_eager, grads_eager = loss_and_grads(model, ids)
    model.forward = compile_and_count(model.forward, backend="inductor")
    logits, grads = loss_and_grads(model, ids)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(
        logits, logits_eager, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed {fresh_seed}: {m}"
    )
    for name in grads_eager:
        torch.testing.assert_close(
            grads[name],
            grads_eager[name],
            rtol=1e-3,
            atol=1e-5,
            msg=lambda m, name=name: f"seed {fresh_seed}, {name}: {m}",
        )


def test_deep_block_stack_compiles_without_graph_breaks():
    """Sixteen sites, each with its own layer_index and parameters: one graph, no per-layer guards."""
    C, n = 16, 4
    blocks = nn.ModuleList(
        mhc.MHCBlock(nn.Linear(C, C), C, n, layer_index=i, init="paper") for i in range(16)
    )

    def run(x):
        for b in blocks:
            x = b(x)
        return x

    x = torch.randn(2, 5, n, C)
    expected = run(x)
    compiled = compile_and_count(run, backend="aot_eager")
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-6)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_projection_compiles_and_still_warns_when_unconverged():
    """The reference Newton solve is one custom op: no host sync in the graph, the warning at run time."""
    logits = torch.randn(64, 4, 4, dtype=torch.float64) * 30
    project = compile_and_count(lambda r: mhc.birkhoff_project(r, max_iter=0), backend="aot_eager")
    with pytest.warns(mhc.ConvergenceWarning, match="missed tol"):
        T = project(logits)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(T, mhc.birkhoff_project_reference(logits, max_iter=0))

    exact = compile_and_count(lambda r: mhc.birkhoff_project(r), backend="aot_eager")
    T = exact(logits)
    assert float(mhc.projection.marginal_error(T).max()) <= 1e-6  # the default tol
    torch.testing.assert_close(T, mhc.birkhoff_project_reference(logits))


@CUDA
@pytest.mark.parametrize("keep_streams_every", [1, 3])
def test_cuda_model_compiles_as_one_graph_and_matches_eager(keep_streams_every):
    """The default options on CUDA (bf16 weights, fp32 coefficients, the fused site through mhc.fused.ops),
    compiled with inductor and fullgraph; keep_streams_every > 1 (eager only) must not break the graph."""
    model = mhc.convert_to_mhc(tiny_llama(), n_streams=4, init="paper", keep_streams_every=keep_streams_every)
    model = model.to("cuda", torch.bfloat16)
    ids = torch.randint(0, 97, (2, 64), device="cuda")
    logits_eager, grads_eager = loss_and_grads(model, ids)
    model.forward = compile_and_count(model.forward, backend="inductor")
    logits, grads = loss_and_grads(model, ids)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(logits.float(), logits_eager.float(), rtol=3e-2, atol=3e-2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        loss_and_grads(model, torch.randint(0, 97, (2, 64), device="cuda"))
    for name in grads_eager:
        g, ge = grads[name].float(), grads_eager[name].float()
        assert (g - ge).norm() <= 5e-2 * ge.norm() + 1e-6, name


@CUDA
def test_cuda_projection_autograd_compiles_as_one_graph():
    """birkhoff_project's C++ autograd node under inductor: one graph, the eager T and gradient."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    R = (torch.randn(512, 4, 4, device="cuda", generator=gen) * 3).requires_grad_()
    G = torch.randn(512, 4, 4, device="cuda", generator=gen)

    def project_and_grad(r):
        T = mhc.birkhoff_project(r)
        (dR,) = torch.autograd.grad(T, r, G)
        return T, dR

    T_eager, dR_eager = project_and_grad(R)
    T = compile_and_count(lambda r: mhc.birkhoff_project(r), backend="inductor")(R)
    (dR,) = torch.autograd.grad(T, R, G)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(T, T_eager, rtol=0, atol=0)
    torch.testing.assert_close(dR, dR_eager, rtol=1e-6, atol=1e-6)


def test_a_block_compiles_as_one_graph_when_its_tol_changes_or_shapes_are_dynamic():
    """A float that changes between calls (the block's settable tol) or dynamic=True makes dynamo trace tol as
    a symbol; birkhoff_project's argument check must trace too (math.isfinite could not: a graph break,
    an error under fullgraph)."""
    C, n = 8, 4
    block = mhc.MHCBlock(nn.Linear(C, C), C, n, init="paper")
    x = torch.randn(2, 3, n, C)
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    for tol in (1e-6, 1e-5, 3e-6):
        block.tol = tol
        torch.testing.assert_close(compiled(x), block(x))
    torch._dynamo.reset()
    torch.testing.assert_close(
        torch.compile(block, backend="eager", fullgraph=True, dynamic=True)(x), block(x)
    )
    project = torch.compile(lambda r, tol: mhc.birkhoff_project(r, tol=tol), backend="eager", fullgraph=True)
    logits = torch.randn(5, 4, 4)
    for tol in (1e-6, 1e-5):
        torch.testing.assert_close(project(logits, tol), mhc.birkhoff_project(logits, tol=tol))
    # fullgraph: dynamo reports the raised ValueError with its message
    with pytest.raises(
        (ValueError, torch._dynamo.exc.Unsupported), match="tol must be finite and > 0, got -1.0"
    ):
        project(logits, -1.0)
