"""Kept compiled variants of the fused site's Triton kernels (:mod:`mhc.fused.plan`), CUDA only.

After Triton's own first launch of a variant, :class:`mhc.fused.plan.Launcher` launches it directly; these
tests check that the direct launches give Triton's own bits and call installed launch hooks. Triton's CPU
interpreter always takes Triton's own path, so they need CUDA. Shares its blocks with
tests/test_fused_block.py.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_block import DEVICE, INTERPRETED, _blocks, _rel, pytestmark, triton  # noqa: F401

from mhc import fused


@pytest.mark.skipif(DEVICE != "cuda", reason=INTERPRETED)
def test_kept_launches_match_tritons_own():
    """After fused.clear_plans() a shape's first fwd+bwd goes through Triton's own launches and keeps every
    compiled variant; later calls launch those directly, with the bits of the first call, whichever
    inputs need gradients."""
    from mhc.fused import tokens as fused_tokens

    n = 4
    ref, fast = _blocks(n, 200, torch.bfloat16, seed=5)
    # more tokens than mhc.fused.tokens takes, so that the forward runs the Triton kernels too
    x = torch.randn(3, fused_tokens.MAX_TOKENS // 3 + 5, n, 200, device=DEVICE, dtype=torch.bfloat16)
    fused.clear_plans()
    assert set(fused.compiled_variants().values()) == {0}

    def run(x_grad=True, phi_grad=True):
        fast.phi.requires_grad_(phi_grad)
        xg = x.clone().requires_grad_(x_grad)
        out = fast(xg)
        out.backward(torch.ones_like(out))
        grads = (
            xg.grad,
            fast.phi.grad,
            fast.b_res.grad.clone(),
            fast.alpha.grad.clone(),
            fast.b_pre.grad.clone(),
        )
        fast.zero_grad(set_to_none=True)
        fast.phi.requires_grad_(True)
        return (out, *grads)

    first = run()
    kept = fused.compiled_variants()
    assert sorted(kept) == [
        "coeff_bwd",
        "coeff_fwd",
        "coeff_partial",
        "phi_grad",
        "postmix_bwd",
        "postmix_fwd",
        "stream_grad",
    ]
    assert all(count >= 1 for count in kept.values()), kept
    for a, b in zip(first, run()):
        assert torch.equal(a, b)
    no_dx, no_dphi = run(x_grad=False), run(phi_grad=False)
    assert no_dx[1] is None and no_dphi[2] is None
    for i, (a, b, c) in enumerate(zip(first, no_dx, no_dphi)):
        if i != 1:
            assert torch.equal(a, b)
        if i != 2:
            assert torch.equal(a, c)
    assert fused.compiled_variants() == kept  # nothing compiled again

    xr = x.clone().requires_grad_()
    expected = ref(xr)
    expected.backward(torch.ones_like(expected))
    assert _rel(first[0], expected) < 2e-2
    assert _rel(first[1], xr.grad) < 2e-2
    assert _rel(first[2], ref.phi.grad) < 2e-2


@pytest.mark.skipif(DEVICE != "cuda", reason=INTERPRETED)
def test_kept_launches_call_installed_launch_hooks():
    """A launch hook installed in Triton (a profiler's, say) sees the kept launches too, and only while installed."""
    chain = triton.knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip(f"the installed Triton {triton.__version__} keeps launch hooks without a HookChain")
    from mhc.fused import tokens as fused_tokens

    _, fast = _blocks(4, 96, torch.bfloat16, seed=4)
    # more tokens than mhc.fused.tokens takes, so that the forward runs the Triton kernels too
    x = torch.randn(
        2, fused_tokens.MAX_TOKENS // 2 + 5, 4, 96, device=DEVICE, dtype=torch.bfloat16, requires_grad=True
    )
    fast(x).sum().backward()  # compiles and keeps every variant
    names = []

    def hook(metadata):
        names.append(metadata.get()["name"])

    chain.add(hook)
    try:
        fast(x).sum().backward()
    finally:
        chain.remove(hook)
    assert {
        "coeff_partial",
        "coeff_fwd",
        "postmix_fwd",
        "postmix_bwd",
        "coeff_bwd",
        "stream_grad",
        "phi_grad",
    } <= set(names)
    seen = len(names)
    fast(x).sum().backward()
    assert len(names) == seen  # removed: the launches no longer call it
