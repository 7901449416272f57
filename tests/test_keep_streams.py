"""``keep_streams_every``: linked fused sites that recompute their input streams in backward.

A chain of linked fused sites keeps the streams for backward only at every
k-th site; the others hold a recipe (the previous site's post-mix inputs) and
run that post-mix kernel again in backward. The gradients must be the kept
chain's bit for bit, and the streams must really be gone from what autograd
keeps. Without CUDA the sites run in Triton's interpreter (tests/conftest.py),
through :class:`InterpretedFusedBlock` as in tests/test_fused_block.py.
"""

import copy

import pytest
import torch
from torch import nn

import mhc
from mhc import fused

try:
    import triton  # noqa: F401
except ImportError as err:
    NO_TRITON = f"needs Triton, which is not importable on this machine ({err})"
else:
    NO_TRITON = None

pytestmark = [
    pytest.mark.skipif(NO_TRITON is not None, reason=NO_TRITON or ""),
    pytest.mark.usefixtures("fresh_seed"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, C, SITES = 4, 48, 6


class InterpretedFusedBlock(mhc.MHCBlock):
    """MHCBlock whose fused backend also takes CPU streams (Triton's interpreter); used only without CUDA."""

    def uses_fused(self, x):
        return (
            self.fused
            and self.mode == "mhc"
            and self.projection == "newton"
            and x.dtype in fused.SUPPORTED_DTYPES
            and x.numel() > 0
            and fused.available()
        )


def linked_chain(keep_every: int, dtype=torch.float32) -> nn.ModuleList:
    """SITES linked fused blocks with non-trivial coefficients, drawn from the current seed."""
    cls = mhc.MHCBlock if DEVICE == "cuda" else InterpretedFusedBlock
    blocks = nn.ModuleList()
    for i in range(SITES):
        branch = nn.Sequential(nn.RMSNorm(C), nn.Linear(C, C), nn.SiLU())
        block = cls(branch, C, N, init="paper", layer_index=i, keep_streams_every=keep_every)
        with torch.no_grad():
            block.b_res.normal_(0, 2)
            block.b_pre.normal_()
            block.b_post.normal_()
            block.alpha.fill_(0.5)
        blocks.append(block)
    blocks = blocks.to(DEVICE)
    for block in blocks:
        block.branch.to(dtype)
    for a, b in zip(blocks, blocks[1:]):
        a.set_next_site(b)
    return blocks


def with_keep_every(blocks: nn.ModuleList, keep_every: int) -> nn.ModuleList:
    copies = copy.deepcopy(blocks)  # a deep copy drops the links (next_site); relink
    for block in copies:
        block.options = block.options.replace(keep_streams_every=keep_every)
    for a, b in zip(copies, copies[1:]):
        a.set_next_site(b)
    return copies


def run(blocks, x, g, saved: list | None = None):
    """Output, d x and every parameter's gradient of ``(blocks(x) * g).sum()``; ``saved`` collects saved tensors."""
    x = x.clone().requires_grad_()
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    with hooks if saved is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = x
        for block in blocks:
            out = block(out)
    (out * g).sum().backward()
    return out.detach(), x.grad, [p.grad for p in blocks.parameters()]


def stream_bytes(saved: list, shape) -> int:
    """Bytes of the distinct storages among ``saved`` that hold streams of ``shape``."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved if t.shape == shape
    }
    return sum(storages.values())


@pytest.mark.parametrize("keep_every", [2, 3, 10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_streams_give_the_kept_streams_bits(keep_every, dtype, fresh_seed):
    kept = linked_chain(1, dtype)
    recomputed = with_keep_every(kept, keep_every)
    x = torch.randn(
        2, 3, N, C, device=DEVICE, dtype=dtype
    )  # few tokens: in the interpreter each costs ~20 ms a site
    g = torch.randn_like(x)
    saved_kept, saved_recomputed = [], []
    out_a, dx_a, grads_a = run(kept, x, g, saved_kept)
    out_b, dx_b, grads_b = run(recomputed, x, g, saved_recomputed)
    assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b), f"seed {fresh_seed}"
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b)), f"seed {fresh_seed}"
    # Site i keeps its streams when i % keep_every == 0 (the first site always does).
    kept_sites = len(range(0, SITES, keep_every))
    one = x.numel() * x.element_size()
    assert stream_bytes(saved_kept, x.shape) == SITES * one
    assert stream_bytes(saved_recomputed, x.shape) == kept_sites * one


@pytest.mark.parametrize("keep_every", [2, 4])
def test_backward_recomputes_each_dropped_stream_once(keep_every, monkeypatch):
    """The backward runs one post-mix per site whose input streams were dropped, not one per use or per chain
    link: the recomputed chain is cached until the site's last use of its streams."""
    blocks = linked_chain(keep_every)
    x = torch.randn(2, 5, N, C, device=DEVICE).requires_grad_()
    out = x
    for block in blocks:
        out = block(out)
    launches = []
    from mhc.fused import nodes

    post_forward = nodes.post_forward
    monkeypatch.setattr(nodes, "post_forward", lambda *args: launches.append(1) or post_forward(*args))
    out.sum().backward()
    assert len(launches) == SITES - len(range(0, SITES, keep_every))


def test_streams_are_recomputed_only_through_an_unchanged_link(fresh_seed):
    """A site called on anything but its linked predecessor's own output keeps its streams."""
    blocks = linked_chain(4)
    x = torch.randn(7, N, C, device=DEVICE)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mid = blocks[1](blocks[0](x.requires_grad_()))
        mid_changed = mid * 1.0  # another tensor than blocks[1]'s output
        out = blocks[2](mid_changed)
    out.sum().backward()
    # blocks[0] keeps x, blocks[1] recomputes its input, blocks[2] keeps mid_changed: two stream storages
    assert stream_bytes(saved, x.shape) == 2 * x.numel() * x.element_size()


def test_second_backward_through_recomputed_streams_raises(fresh_seed):
    blocks = linked_chain(3)
    x = torch.randn(5, N, C, device=DEVICE, requires_grad=True)
    out = x
    for block in blocks:
        out = block(out)
    loss = out.square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="keep_streams_every"):
        loss.backward()


def test_no_grad_and_unlinked_sites_are_unaffected(fresh_seed):
    blocks = linked_chain(3)
    x = torch.randn(5, N, C, device=DEVICE)
    with torch.no_grad():
        out = x
        for block in blocks:
            out = block(out)
    assert all(block.site_link.inbox is None for block in blocks)  # nothing left behind
    plain = with_keep_every(blocks, 1)
    with torch.no_grad():
        ref = x
        for block in plain:
            ref = block(ref)
    assert torch.equal(out, ref)


def test_option_checks_and_repr():
    with pytest.raises(ValueError, match="keep_streams_every"):
        mhc.MHCOptions(keep_streams_every=0)
    with pytest.raises(TypeError, match="keep_streams_every"):
        mhc.MHCOptions(keep_streams_every=2.0)
    with pytest.raises(ValueError, match="recompute"):
        mhc.MHCOptions(recompute=True, keep_streams_every=2)
    block = mhc.MHCBlock(nn.Identity(), 8, 4, keep_streams_every=3)
    assert block.keep_streams_every == 3 and "keep_streams_every=3" in repr(block)
    config = mhc.MHCConfig(keep_streams_every=5)
    assert config.keep_streams_every == 5 and config.options().keep_streams_every == 5
    assert mhc.MHCConfig.from_dict(config.to_dict()).keep_streams_every == 5


def test_converted_llama_recomputes_streams_between_layers(monkeypatch, fresh_seed):
    """MHCForCausalLM links its sites across decoder layers: keep_streams_every=3 keeps 2 of 6 sites' streams,
    with the logits and gradients of keep_streams_every=1 bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if DEVICE == "cpu":  # every converted site on the fused path, in Triton's interpreter
        monkeypatch.setattr(mhc.MHCBlock, "uses_fused", InterpretedFusedBlock.uses_fused)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=61,
        max_position_embeddings=32,
    )
    torch.manual_seed(fresh_seed)
    base = LlamaForCausalLM(cfg)
    kept = mhc.convert_to_mhc(copy.deepcopy(base), n_streams=N, init="paper").to(DEVICE)
    recomputed = mhc.convert_to_mhc(base, n_streams=N, init="paper", keep_streams_every=3).to(DEVICE)
    recomputed.load_state_dict(kept.state_dict())
    ids = torch.randint(3, 61, (2, 11), device=DEVICE)
    results = []
    for model in (kept, recomputed):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        streams = stream_bytes(saved, (2, 11, N, 32))
        results.append((loss.detach(), [p.grad for p in model.parameters()], streams))
    (loss_a, grads_a, streams_a), (loss_b, grads_b, streams_b) = results
    assert torch.equal(loss_a, loss_b), f"seed {fresh_seed}"
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b)), f"seed {fresh_seed}"
    one = 2 * 11 * N * 32 * 4
    assert streams_a == 6 * one and streams_b == 2 * one, (streams_a, streams_b, one)


@pytest.mark.parametrize(
    "family",
    # two layouts in the default tier (pre-norm and GPT-2's), every other family in the slow one
    [
        "llama",
        "gpt2",
        *(
            pytest.param(f, marks=pytest.mark.slow)
            for f in ("gemma2", "olmo2", "granite", "mixtral", "gpt_neox", "phi")
        ),
    ],
)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_every_layout_gets_the_kept_streams_gradients(family, checkpointing, monkeypatch):
    """One family per adapter layout (tests/test_families.py's REPRESENTATIVE), fused sites in the interpreter on
    the CPU: keep_streams_every=2 gives keep_streams_every=1's gradients bit for bit, also under HF's activation
    checkpointing, and without checkpointing it saves fewer stream tensors wherever sites follow one another."""
    from test_families import enable_checkpointing, family_model, perturb, token_ids

    if DEVICE == "cpu":
        monkeypatch.setattr(mhc.MHCBlock, "uses_fused", InterpretedFusedBlock.uses_fused)
    results = []
    for keep_every in (1, 2):
        model = mhc.convert_to_mhc(family_model(family), n_streams=N, keep_streams_every=keep_every).to(
            DEVICE
        )
        perturb(model)
        model.train()
        for m in model.modules():  # dropout would draw different masks in the two runs
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        if checkpointing:
            enable_checkpointing(model)
        x = token_ids(batch=1, seq=8).to(DEVICE)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(x, labels=x).loss
        loss.backward()
        streams = sum(1 for t in saved if t.dim() == 4 and t.shape[:3] == (1, 8, N))
        results.append(
            (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, streams)
        )
    (loss_a, grads_a, streams_a), (loss_b, grads_b, streams_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a), (
        family
    )
    if not checkpointing:
        assert streams_b < streams_a, (family, streams_a, streams_b)
