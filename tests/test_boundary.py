"""The boundary kernel: a linked site's post-mix that also runs the next site's first step.

In a chain of linked fused sites (``MHCBlock.next_site``, as ``MHCForCausalLM``
links them) each post-mix but the last runs ``boundary_fwd``, and the next site
takes the first step it left instead of running its own kernels. Each site keeps
its own autograd nodes, so the chain must give an unlinked chain's outputs and
gradients (to the rounding of the coefficient dots, which are summed in another
order), and must fall back to the site's own kernels whenever the stream or a
parameter changed in between. Without CUDA the sites run in Triton's interpreter.
"""

import copy

import pytest
import torch
from test_keep_streams import DEVICE, NO_TRITON, SITES, N, C, linked_chain, run

pytestmark = [pytest.mark.skipif(NO_TRITON is not None, reason=NO_TRITON or ""), pytest.mark.usefixtures("fresh_seed")]


def _unlinked(blocks):
    copies = copy.deepcopy(blocks)  # a deep copy drops the links
    assert all(block.next_site is None for block in copies)
    return copies


def _count(monkeypatch):
    """Calls of the boundary kernel's step and of the first step's own kernels."""
    from mhc import fused_steps

    calls = {"boundary": 0, "pre": 0}
    boundary, pre = fused_steps.boundary_forward, fused_steps.pre_forward

    def count(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(fused_steps, "boundary_forward", count("boundary", boundary))
    monkeypatch.setattr(fused_steps, "pre_forward", count("pre", pre))
    return calls


def _forward(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_linked_chain_matches_the_unlinked_chain(dtype, tol, monkeypatch, fresh_seed):
    linked = linked_chain(1, dtype)
    unlinked = _unlinked(linked)
    x = torch.randn(3, 7, N, C, device=DEVICE, dtype=dtype)
    g = torch.randn_like(x)
    out_ref, dx_ref, grads_ref = run(unlinked, x, g)
    calls = _count(monkeypatch)
    out, dx, grads = run(linked, x, g)
    assert calls == {"boundary": SITES - 1, "pre": 1}, calls  # every boundary fused; the first site on its own
    assert _rel(out, out_ref) < tol and _rel(dx, dx_ref) < tol, f"seed {fresh_seed}"
    for (name, _), a, b in zip(linked.named_parameters(), grads, grads_ref):
        assert _rel(a, b) < tol * 10, f"{name}, seed {fresh_seed}"
    assert all(block._prefetched[0] is None for block in linked)  # every first step taken


def test_no_grad_forward_takes_the_boundary_too_with_the_same_bits(monkeypatch):
    blocks = linked_chain(1)
    x = torch.randn(2, 5, N, C, device=DEVICE)
    out_grad = _forward(blocks, x)
    calls = _count(monkeypatch)
    with torch.no_grad():
        out = _forward(blocks, x)
    assert calls == {"boundary": SITES - 1, "pre": 1}, calls
    assert torch.equal(out, out_grad.detach())


def test_inference_mode_runs_each_site_on_its_own(monkeypatch):
    """Inference tensors keep no version counter to tell an unchanged output, so no boundary is fused there."""
    blocks = linked_chain(1)
    x = torch.randn(2, 5, N, C, device=DEVICE)
    with torch.no_grad():
        expected = _forward(_unlinked(blocks), x)
    calls = _count(monkeypatch)
    with torch.inference_mode():
        out = _forward(blocks, x)
    assert calls == {"boundary": 0, "pre": SITES}, calls
    assert torch.equal(out, expected)


def _scale_the_streams(blocks, i, out):
    if i == 2:
        out.mul_(0.5)  # in place, as a steering hook would


def _nudge_the_next_phi(blocks, i, out):
    if i == 1:
        with torch.no_grad():
            blocks[2].phi.add_(0.01)  # after the boundary used blocks[2]'s φ


@pytest.mark.parametrize("change", [_scale_the_streams, _nudge_the_next_phi])
def test_a_change_in_between_runs_the_next_first_step_again(change, monkeypatch):
    """An output changed in place, or the next site's φ changed after the boundary used it: that site runs its own
    first step on what it is given, as an unlinked chain does."""
    blocks = linked_chain(1)
    reference = _unlinked(blocks)
    x = torch.randn(9, N, C, device=DEVICE)

    def chain(blocks):
        out = x
        for i, block in enumerate(blocks):
            out = block(out)
            change(blocks, i, out)
        return out

    with torch.no_grad():
        expected = chain(reference)
        calls = _count(monkeypatch)
        got = chain(blocks)
    assert calls == {"boundary": SITES - 1, "pre": 2}, calls  # the changed site ran its own first step
    assert _rel(got, expected) < 1e-5


def test_checkpointed_sites_run_their_own_kernels(monkeypatch):
    """recompute=True (torch.utils.checkpoint) keeps every site's first step inside its own checkpoint."""
    blocks = linked_chain(1)
    for block in blocks:
        block.recompute = True
    reference = _unlinked(blocks)
    x = torch.randn(2, 4, N, C, device=DEVICE)
    g = torch.randn_like(x)
    out_ref, dx_ref, _ = run(reference, x, g)
    calls = _count(monkeypatch)
    out, dx, _ = run(blocks, x, g)
    assert calls["boundary"] == 0 and calls["pre"] == 2 * SITES, calls  # forward, then each checkpoint's rerun
    assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref)


def test_converted_llama_fuses_its_boundaries_and_matches_the_unlinked_model(monkeypatch, fresh_seed):
    """MHCForCausalLM links its sites across decoder layers: 3 layers, 6 sites, 5 boundaries fused, with the
    unlinked model's loss and gradients to float32 rounding."""
    from test_keep_streams import InterpretedFusedBlock, unlink_sites
    from transformers import LlamaConfig, LlamaForCausalLM

    import mhc

    if DEVICE == "cpu":  # every converted site on the fused path, in Triton's interpreter
        monkeypatch.setattr(mhc.MHCBlock, "uses_fused", InterpretedFusedBlock.uses_fused)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=61, max_position_embeddings=32)
    torch.manual_seed(fresh_seed)
    linked = mhc.convert_to_mhc(LlamaForCausalLM(cfg), n_streams=N, init="paper").to(DEVICE)
    unlinked = unlink_sites(copy.deepcopy(linked))
    ids = torch.randint(3, 61, (2, 11), device=DEVICE)
    loss_ref = unlinked(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    calls = _count(monkeypatch)
    loss = linked(input_ids=ids, labels=ids).loss
    loss.backward()
    assert calls == {"boundary": 5, "pre": 1}, calls
    assert abs(loss.item() - loss_ref.item()) < 1e-5 * abs(loss_ref.item()), f"seed {fresh_seed}"
    grads = [(name, p.grad, q.grad) for (name, p), q in zip(linked.named_parameters(), unlinked.parameters())]
    assert _rel(torch.cat([a.flatten() for _, a, _ in grads]), torch.cat([b.flatten() for _, _, b in grads])) < 1e-4
    # Per parameter against the largest gradient: near the paper's init H_res saturates, and b_res's gradient
    # (~1e-12) is rounding noise in both models.
    scale = max(b.abs().max().item() for _, _, b in grads)
    for name, a, b in grads:
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5 * scale, msg=lambda m: f"{name}, seed {fresh_seed}: {m}")
