"""Fused mHC site (mhc.fused, Triton) against the PyTorch MHCBlock.

On CUDA the kernels are compiled; without CUDA they run in Triton's
interpreter on CPU tensors (tests/conftest.py), so the same comparisons run
in CI.
"""

import copy
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import mhc
import mutations
from mhc import fused

try:
    import triton
except ImportError as err:  # the one reason the fused path may be missing
    triton, NO_TRITON = None, f"needs Triton, which is not importable on this machine ({err})"
else:
    NO_TRITON = None
    # Triton imports, so the kernels must: available() raises (collection fails) if they do not.
    assert fused.available(), "Triton imports but mhc.fused.available() is False"
    # Without CUDA the kernels can only run in Triton's interpreter, which tests/conftest.py turns on.
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", "no CUDA and no TRITON_INTERPRET"

pytestmark = pytest.mark.skipif(NO_TRITON is not None, reason=NO_TRITON or "")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NO_CUDA = "needs a CUDA device (this machine has none)"
INTERPRETED = f"{NO_CUDA}: Triton's CPU interpreter always takes Triton's own launch path, no kept variants or C++ site"
ROOT = Path(__file__).resolve().parent.parent


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _blocks(n, C, dtype, seed):
    """A reference block (PyTorch path) and a fused copy with non-trivial coefficients, drawn from ``seed``."""
    torch.manual_seed(seed)
    branch = nn.Sequential(nn.RMSNorm(C), nn.Linear(C, 2 * C), nn.SiLU(), nn.Linear(2 * C, C))
    ref = mhc.MHCBlock(branch, C, n, init="paper", fused=False)
    with torch.no_grad():
        ref.b_res.normal_(0, 3)
        ref.b_pre.normal_()
        ref.b_post.normal_()
        ref.alpha.copy_(torch.tensor([0.5, 0.7, 2.0]))
    ref = ref.to(DEVICE)
    ref.branch.to(dtype)
    fast = copy.deepcopy(ref)
    fast.fused = True
    return ref, fast


def _run_fused(block, x):
    """The block on CUDA (which must dispatch to the fused site); the fused site itself on CPU."""
    if DEVICE == "cuda":
        return block(x)
    return fused.mhc_site(x, block.branch, block.phi, block.alpha, block.b_pre, block.b_post, block.b_res,
                          norm_eps=block.norm_eps, tol=block.tol)


def _compare(ref, fast, x, tol_out, tol_grad, run_fast=_run_fused):
    x_ref = x.detach().clone().requires_grad_()
    x_fast = x.detach().clone().requires_grad_()
    out_ref, out_fast = ref(x_ref), run_fast(fast, x_fast)
    assert out_fast.dtype == x.dtype and out_fast.shape == x.shape
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    out_fast.backward(g)
    assert _rel(out_fast, out_ref) < tol_out
    assert _rel(x_fast.grad, x_ref.grad) < tol_grad
    for (name, p_ref), (_, p_fast) in zip(ref.named_parameters(), fast.named_parameters()):
        assert _rel(p_fast.grad, p_ref.grad) < tol_grad, name


@pytest.mark.parametrize("n", [4, 8, 3])
@pytest.mark.parametrize("C", [64, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_site_matches_reference(n, C, dtype, monkeypatch, fresh_seed):
    ref, fast = _blocks(n, C, dtype, fresh_seed)
    calls = []
    site = fused.run_site  # what MHCBlock calls on CUDA, and mhc_site after its checks
    monkeypatch.setattr(fused, "run_site", lambda *a, **k: calls.append(1) or site(*a, **k))
    x = torch.randn(2, 9, n, C, device=DEVICE).to(dtype)
    tight = dtype == torch.float32
    _compare(ref, fast, x, 1e-5 if tight else 1e-2, 1e-4 if tight else 3e-2)
    assert calls, "the fused site did not run"


def test_fused_site_non_contiguous_and_large_values(fresh_seed):
    n, C = 4, 96
    ref, fast = _blocks(n, C, torch.float32, fresh_seed)
    # [S, B, n, C] viewed as [B, S, n, C]: not contiguous; large magnitudes.
    x = (torch.randn(7, 3, n, C, device=DEVICE) * 300).transpose(0, 1)
    assert not x.is_contiguous()
    _compare(ref, fast, x, 1e-5, 1e-4)


def test_fused_site_many_tokens(fresh_seed):
    """2100 tokens: dx runs over several 128-token programs (the last one partial), dφ over two token splits."""
    ref, fast = _blocks(4, 48, torch.float32, fresh_seed)
    x = torch.randn(3, 700, 4, 48, device=DEVICE)
    _compare(ref, fast, x, 1e-5, 1e-4)


@pytest.mark.parametrize("lead", [(), (5,), (2, 1, 3)])
def test_fused_site_keeps_any_leading_shape(lead, fresh_seed):
    """The nodes pass the streams' leading shape through (no flattening outside them): u, x', dx and dy keep it."""
    n, C = 4, 40
    ref, fast = _blocks(n, C, torch.float32, fresh_seed)
    seen = []
    inner = fast.branch.forward
    fast.branch.forward = lambda u: seen.append(u.shape) or inner(u)
    x = torch.randn(*lead, n, C, device=DEVICE)
    _compare(ref, fast, x, 1e-5, 1e-4)
    assert seen == [torch.Size((*lead, C))]


def test_fused_site_gradcheck_float64(fresh_seed):
    n, C = 3, 8
    lin = nn.Linear(C, C).double().to(DEVICE)
    params = [
        torch.randn(n * n + 2 * n, n * C, dtype=torch.float64, device=DEVICE) * 0.3,
        torch.tensor([0.5, 0.7, 1.5], dtype=torch.float64, device=DEVICE),
        torch.randn(n, dtype=torch.float64, device=DEVICE),
        torch.randn(n, dtype=torch.float64, device=DEVICE),
        torch.randn(n, n, dtype=torch.float64, device=DEVICE),
    ]
    x = torch.randn(2, n, C, dtype=torch.float64, device=DEVICE)

    def site(x, phi, alpha, b_pre, b_post, b_res):
        return fused.mhc_site(x, lambda u: torch.tanh(lin(u)), phi, alpha, b_pre, b_post, b_res, norm_eps=1e-6, tol=1e-12)

    inputs = [t.requires_grad_() for t in (x, *params)]
    assert torch.autograd.gradcheck(site, inputs, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_init_on_identical_streams_is_exact(dtype):
    """A converted model (φ = 0, identical streams) gives x + F(x) to the bit, as the PyTorch path does."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip(f"{NO_CUDA}: Triton's CPU interpreter truncates float32 -> bfloat16 casts instead of rounding")
    C, n = 64, 4
    torch.manual_seed(0)
    branch = nn.Sequential(nn.Linear(C, C), nn.GELU()).to(DEVICE, dtype)
    block = mhc.MHCBlock(branch, C, n, layer_index=2).to(DEVICE)
    h = torch.randn(3, 5, C, device=DEVICE, dtype=dtype)
    x = mhc.expand_streams(h, n)
    out = fused.mhc_site(x, block.branch, block.phi, block.alpha, block.b_pre, block.b_post, block.b_res, norm_eps=1e-6, tol=1e-6)
    expected = h + branch(h)
    for i in range(n):
        assert torch.equal(out[..., i, :], expected)


def test_in_kernel_sigmoid_matches_torch():
    """σ in coeff_fwd has torch.sigmoid's bits on CUDA; within 1 ulp in the interpreter (numpy's exp)."""
    n, C, T = 8, 16, 5
    torch.manual_seed(0)
    x = torch.randn(T, n, C, device=DEVICE)
    phi = torch.zeros(n * n + 2 * n, n * C, device=DEVICE)  # z = 0, so v = b exactly
    alpha, b_res = torch.ones(3, device=DEVICE), torch.zeros(n, n, device=DEVICE)
    special = torch.tensor([-math.log(3), 0.0, -30.0, 30.0, 1e-8, -88.0, 17.0, -1.5], device=DEVICE)
    for trial in range(6):
        b = special if trial == 0 else torch.randn(n, device=DEVICE) * 4 * trial
        b_pre, b_post = b, -b.flip(0)
        state = fused._SiteState(fused._plan(x), 1e-6, 1e-6)
        _, h, _ = fused._SitePre.apply(x, phi, alpha, b_pre, b_post, b_res, state)
        expected = torch.sigmoid(torch.cat([b_pre, b_post])).expand(T, -1)
        if DEVICE == "cuda":
            assert torch.equal(h, expected)
        else:
            torch.testing.assert_close(h, expected, rtol=2.4e-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_coefficients_close_to_float64(dtype):
    """h = σ(α·RMSNorm(x)φᵀ + b) against float64, with large stream values.

    bf16 streams take φ in two bf16 parts (16 bits; tf32's 11 would give errors
    near 1e-4 here), fp32 streams full fp32 products.
    """
    n, C, T = 4, 200, 300
    torch.manual_seed(1)
    x = (torch.randn(T, n, C, device=DEVICE) * 100).to(dtype)
    phi = torch.randn(n * n + 2 * n, n * C, device=DEVICE) * (n * C) ** -0.5
    alpha, b_res = torch.tensor([1.0, 1.0, 1.0], device=DEVICE), torch.zeros(n, n, device=DEVICE)
    b_pre, b_post = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    state = fused._SiteState(fused._plan(x), 1e-6, 1e-6)
    _, h, _ = fused._SitePre.apply(x, phi, alpha, b_pre, b_post, b_res, state)
    z = torch.nn.functional.rms_norm(x.double().flatten(1), (n * C,), eps=1e-6) @ phi.double().t()
    expected = torch.sigmoid(z[:, : 2 * n] + torch.cat([b_pre, b_post]).double())
    assert (h.double() - expected).abs().max().item() < (2e-5 if dtype == torch.bfloat16 else 2e-6)


def test_branch_tuple_and_arguments_pass_through():
    n, C = 4, 32
    torch.manual_seed(0)
    lin = nn.Linear(C, C).to(DEVICE)
    seen = {}

    def branch(u, scale, *, tag):
        seen["tag"] = tag
        return lin(u) * scale, "extra"

    block = mhc.MHCBlock(branch, C, n, init="paper").to(DEVICE)
    x = torch.randn(2, 3, n, C, device=DEVICE)
    out = fused.mhc_site(x, branch, block.phi, block.alpha, block.b_pre, block.b_post, block.b_res,
                         norm_eps=1e-6, tol=1e-6, branch_args=(2.0,), branch_kwargs={"tag": "t"})
    ref = mhc.MHCBlock(branch, C, n, init="paper", fused=False).to(DEVICE)
    ref.load_state_dict(block.state_dict())
    expected = ref(x, 2.0, tag="t")
    assert out[1] == "extra" and seen["tag"] == "t"
    assert _rel(out[0], expected[0]) < 1e-5


@pytest.mark.skipif(DEVICE != "cuda", reason=INTERPRETED)
def test_cached_launches_match_tritons_own(monkeypatch):
    """Without the C++ site (as under a launch hook), the second call of a configuration launches the
    kept compiled kernels from Python, with the same results."""
    monkeypatch.setattr(fused, "_native_allowed", lambda: False)
    ref, fast = _blocks(4, 96, torch.bfloat16, seed=3)
    x = torch.randn(3, 7, 4, 96, device=DEVICE, dtype=torch.bfloat16)
    for launcher in (fused._coeff_fwd, fused._stream_grad):
        launcher.variants.clear()
    fused._PLANS.clear()
    results = []
    for _ in range(2):
        xg = x.clone().requires_grad_()
        out = fast(xg)
        out.backward(torch.ones_like(out))
        results.append((out, xg.grad, fast.phi.grad.clone()))
        fast.zero_grad()
    assert fused._coeff_fwd.variants and fused._stream_grad.variants
    for first, second in zip(*results):
        assert torch.equal(first, second)


@pytest.mark.skipif(DEVICE != "cuda", reason=INTERPRETED)
@pytest.mark.parametrize("n", [4, 8])
def test_later_calls_run_the_cpp_site(n):
    """After one fwd+bwd of a shape the site runs in C++ (csrc/site.cu: its two autograd nodes, and
    Triton's kept variants launched from there). Its results are the bits of the first call (Triton's
    own launches, Python nodes), whichever inputs need gradients."""
    from mhc import projection_cuda

    assert projection_cuda.available(), "the CUDA extension did not build"
    ref, fast = _blocks(n, 200, torch.bfloat16, seed=5)
    x = torch.randn(3, 5, n, 200, device=DEVICE, dtype=torch.bfloat16)
    for launcher in (fused._coeff_fwd, fused._postmix_fwd, fused._postmix_bwd, fused._coeff_bwd,
                     fused._stream_grad, fused._phi_grad):
        launcher.variants.clear()  # so that the first call is Triton's own launch
    fused._PLANS.clear()
    plan = fused._plan(x)

    def run(x_grad=True, phi_grad=True):
        fast.phi.requires_grad_(phi_grad)
        xg = x.clone().requires_grad_(x_grad)
        out = fast(xg)
        out.backward(torch.ones_like(out))
        grads = (xg.grad, fast.phi.grad, fast.b_res.grad.clone(), fast.alpha.grad.clone(), fast.b_pre.grad.clone())
        fast.zero_grad(set_to_none=True)
        fast.phi.requires_grad_(True)
        return (out, *grads)

    assert plan.native_site() is None
    first = run()
    assert plan.native_site() is not None
    for a, b in zip(first, run()):
        assert torch.equal(a, b)
    no_dx, no_dphi = run(x_grad=False), run(phi_grad=False)
    assert no_dx[1] is None and no_dphi[2] is None
    for i, (a, b, c) in enumerate(zip(first, no_dx, no_dphi)):
        if i != 1:
            assert torch.equal(a, b)
        if i != 2:
            assert torch.equal(a, c)

    xr = x.clone().requires_grad_()
    expected = ref(xr)
    expected.backward(torch.ones_like(expected))
    assert _rel(first[0], expected) < 2e-2
    assert _rel(first[1], xr.grad) < 2e-2
    assert _rel(first[2], ref.phi.grad) < 2e-2

    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(fast(xg).sum(), xg, create_graph=True)


def test_cpp_launch_handle_describes_the_kernel_parameters(monkeypatch):
    """What Python hands csrc/site.cu for a compiled variant: one kind per runtime parameter (in the
    kernel's order, constexpr-specialised ones marked 0), and nothing for a variant whose launch needs
    scratch memory or clusters (the C++ launch passes neither)."""
    from types import SimpleNamespace

    made = []

    class FakeExtension:
        @staticmethod
        def TritonKernel(function, grid, num_warps, shared, kinds):
            made.append((function, grid, num_warps, shared, kinds))
            return "handle"

    monkeypatch.setattr(fused._projection_cuda, "extension", lambda: FakeExtension)
    spec = fused._Launch((6, 2), {"n": 4, "BC": 64}, (128,), torch.bfloat16, torch.device("cpu"))
    signature = {"x_ptr": "*bf16", "T": "i32", "C": "constexpr", "eps": "fp32", "big": "i64", "n": "constexpr",
                 "BC": "constexpr"}
    compiled = SimpleNamespace(
        function=1234, src=SimpleNamespace(signature=signature),
        metadata=SimpleNamespace(num_warps=4, shared=512, num_ctas=1, global_scratch_size=0),
    )
    names = ["x_ptr", "T", "C", "eps", "big", "n", "BC"]
    assert fused._native_kernel(compiled, names, spec) == "handle"
    assert made == [(1234, [6, 2, 1], 4, 512, [1, 2, 0, 4, 3])]

    compiled.metadata.global_scratch_size = 128
    assert fused._native_kernel(compiled, names, spec) is None
    compiled.metadata.global_scratch_size, compiled.metadata.num_ctas = 0, 2
    assert fused._native_kernel(compiled, names, spec) is None
    compiled.metadata.num_ctas, signature["x_ptr"] = 1, "tensordesc<bf16[64]>"
    assert fused._native_kernel(compiled, names, spec) is None  # a parameter kind it cannot pass
    assert len(made) == 1


def test_cpp_site_is_off_while_a_launch_hook_is_installed():
    chain = triton.knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip(f"the installed Triton {triton.__version__} keeps launch hooks without a HookChain")
    assert fused._native_allowed()

    def hook(metadata):
        pass

    chain.add(hook)
    try:
        assert not fused._native_allowed()
    finally:
        chain.remove(hook)
    assert fused._native_allowed()


@pytest.mark.skipif(DEVICE != "cuda", reason=f"{NO_CUDA}, so no CUDA extension (csrc/site.cu) to test")
def test_cpp_site_rejects_bad_arguments():
    from mhc import projection_cuda

    ext = projection_cuda.extension()
    _, fast = _blocks(4, 64, torch.float32, seed=6)
    x = torch.randn(2, 4, 64, device=DEVICE)
    fast(x.requires_grad_()).sum().backward()  # compiles the plan's kernels
    kernels = fused._plan(x).native_site()
    params = (fast.phi, fast.alpha, fast.b_pre, fast.b_post, fast.b_res)
    with pytest.raises(RuntimeError, match="CUDA streams"):
        ext.site_pre(kernels, x.detach().cpu(), *params, 1e-6, 1e-6, 32)
    with pytest.raises(RuntimeError, match="float32 / bfloat16 / float16"):
        ext.site_pre(kernels, x.detach().double(), *params, 1e-6, 1e-6, 32)
    with pytest.raises(RuntimeError, match="CUfunction"):
        ext.TritonKernel(0, [1, 1, 1], 4, 0, [1])
    with pytest.raises(RuntimeError, match="grid"):
        ext.TritonKernel(1, [0, 1, 1], 4, 0, [1])
    with pytest.raises(RuntimeError, match="kind"):
        ext.TritonKernel(1, [1, 1, 1], 4, 0, [9])


@pytest.mark.skipif(DEVICE != "cuda", reason=INTERPRETED)
def test_cached_launches_call_installed_launch_hooks():
    """A launch hook installed in Triton (a profiler's, say) sees the kept launches too."""
    chain = triton.knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip(f"the installed Triton {triton.__version__} keeps launch hooks without a HookChain")
    _, fast = _blocks(4, 96, torch.bfloat16, seed=4)
    x = torch.randn(2, 5, 4, 96, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    fast(x).sum().backward()  # compiles and keeps every variant
    names = []

    def hook(metadata):
        names.append(metadata.get()["name"])

    chain.add(hook)
    try:
        fast(x).sum().backward()
    finally:
        chain.remove(hook)
    assert {"coeff_fwd", "postmix_fwd", "postmix_bwd", "coeff_bwd", "stream_grad", "phi_grad"} <= set(names)
    assert fused._hook(chain) is None  # empty again: the launches pass no hook


def test_bad_inputs_are_rejected():
    n, C = 4, 16
    block = mhc.MHCBlock(nn.Identity(), C, n).to(DEVICE)
    args = (block.phi, block.alpha, block.b_pre, block.b_post, block.b_res)
    with pytest.raises(TypeError, match="supports"):
        fused.mhc_site(torch.zeros(2, n, C, dtype=torch.int32, device=DEVICE), nn.Identity(), *args, norm_eps=1e-6, tol=1e-6)
    with pytest.raises(ValueError, match="at least one token"):
        fused.mhc_site(torch.zeros(0, n, C, device=DEVICE), nn.Identity(), *args, norm_eps=1e-6, tol=1e-6)
    with pytest.raises(ValueError, match="phi must be"):
        fused.mhc_site(torch.zeros(2, n, C + 1, device=DEVICE), nn.Identity(), *args, norm_eps=1e-6, tol=1e-6)
    with pytest.raises(ValueError, match="branch returned shape"):
        fused.mhc_site(torch.zeros(2, n, C, device=DEVICE), lambda u: u[..., :-1], *args, norm_eps=1e-6, tol=1e-6)


def test_block_uses_pytorch_path_for_cpu_and_empty_batches():
    n, C = 4, 16
    block = mhc.MHCBlock(nn.Identity(), C, n).to(DEVICE)
    assert not block._use_fused(torch.zeros(2, n, C))
    assert not block._use_fused(torch.zeros(0, n, C, device=DEVICE))
    assert block._use_fused(torch.zeros(2, n, C, device=DEVICE)) == (DEVICE == "cuda")
    assert not mhc.MHCBlock(nn.Identity(), C, n, fused=False).to(DEVICE)._use_fused(torch.zeros(2, n, C, device=DEVICE))
    # Sinkhorn blocks (backward through the iterations) stay on the PyTorch path.
    sinkhorn = mhc.MHCBlock(nn.Identity(), C, n, projection="sinkhorn").to(DEVICE)
    assert not sinkhorn._use_fused(torch.zeros(2, n, C, device=DEVICE))
    # An empty batch still works end to end (PyTorch path).
    assert block(torch.zeros(0, n, C, device=DEVICE)).shape == (0, n, C)


def test_fused_site_under_activation_recompute(fresh_seed):
    """Non-reentrant checkpointing re-runs the site in backward; the nodes' shared state must survive that."""
    n, C = 4, 48
    ref, fast = _blocks(n, C, torch.float32, fresh_seed)
    fast.recompute = True
    calls = []
    inner = fast.branch.forward
    fast.branch.forward = lambda u: calls.append(1) or inner(u)
    x = torch.randn(2, 5, n, C, device=DEVICE)
    if DEVICE == "cuda":
        _compare(ref, fast, x, 1e-5, 1e-4)
    else:  # the block's fused path is CUDA-only: checkpoint the fused site itself
        def checkpointed(block, t):
            return torch.utils.checkpoint.checkpoint(lambda u: _run_fused(block, u), t, use_reentrant=False)

        _compare(ref, fast, x, 1e-5, 1e-4, run_fast=checkpointed)
    assert len(calls) == 2, "the branch should run once in forward and once more in backward"


# Imports mhc after the mutation's sys.meta_path finder is in place: importing
# mhc.fused_kernels raises an ImportError, while Triton imports.
BROKEN_KERNELS_SCRIPT = """
import sys, traceback
sys.path.insert(0, {tests!r})
import mutations
mutations.activate("fused_kernels_import_broken")
import torch
import mhc
from mhc import fused

def raises_import_error(call):
    try:
        call()
    except ImportError as err:
        return err
    raise AssertionError("no ImportError from " + repr(call))

# CPU code, which never runs the kernels, still imports and runs mhc.
block = mhc.MHCBlock(torch.nn.Identity(), 8, 4)
assert block(torch.randn(2, 4, 8)).shape == (2, 4, 8)
err = raises_import_error(fused.available)
cause = err.__cause__
assert isinstance(cause, ImportError) and cause.args == (mutations.BROKEN_KERNELS_MESSAGE,), repr(cause)
text = "".join(traceback.format_exception(err))
assert "direct cause" in text and "exec_module" in text, text  # the original traceback is chained
assert mutations.BROKEN_KERNELS_MESSAGE in str(err) and "fused=False" in str(err), str(err)
params = (block.phi, block.alpha, block.b_pre, block.b_post, block.b_res)
raises_import_error(lambda: fused.mhc_site(torch.randn(2, 4, 8), torch.nn.Identity(), *params, norm_eps=1e-6, tol=1e-6))
if torch.cuda.is_available():  # the CUDA block raises instead of falling back to the PyTorch path
    raises_import_error(lambda: block.cuda()(torch.randn(2, 4, 8, device="cuda")))
print("raised as it should")
"""


def test_broken_kernels_raise_with_their_cause_instead_of_skipping():
    """Kernels that fail to import while Triton imports are an error everywhere: fused.available(),
    mhc_site and (on CUDA) MHCBlock raise ImportError with the original error chained, and this test
    file fails to collect instead of skipping. Only the fused path is affected: CPU code still runs."""
    script = BROKEN_KERNELS_SCRIPT.format(tests=str(ROOT / "tests"))
    env = {k: v for k, v in os.environ.items() if k != mutations.VARIABLE}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "raised as it should" in proc.stdout, proc.stdout + proc.stderr

    env[mutations.VARIABLE] = "fused_kernels_import_broken"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", str(Path(__file__))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out  # pytest's "errors during collection", not 0 (skipped) or 5 (nothing collected)
    assert "1 error" in out and mutations.BROKEN_KERNELS_MESSAGE in out, out
