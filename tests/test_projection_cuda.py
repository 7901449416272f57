"""GPU tests of the fused CUDA Birkhoff kernels against the float64 PyTorch reference.

Skipped without a CUDA device. Every test draws fresh random inputs from a
fresh seed (the ``fresh_seed`` fixture: a failure prints ``seed=<n>``;
``MHC_TEST_SEED=<n>`` re-runs it).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import mhc
from mhc import projection as P

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (this machine has none)"),
    pytest.mark.usefixtures("fresh_seed"),
]

MILLION = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    from mhc.projection import cuda as projection_cuda

    assert projection_cuda.available(), "the CUDA extension failed to build"
    yield


def _draw(kind: str, shape, device="cuda") -> torch.Tensor:
    if kind == "normal1":
        return torch.randn(shape, device=device)
    if kind == "uniform1":
        return torch.rand(shape, device=device) * 2 - 1
    if kind == "normal10":
        return torch.randn(shape, device=device) * 10
    if kind == "uniform10":
        return torch.rand(shape, device=device) * 20 - 10
    if kind == "normal30":
        return torch.randn(shape, device=device) * 30
    raise ValueError(kind)


def _reference64(R: torch.Tensor) -> torch.Tensor:
    """Float64 reference solution (PyTorch path), in chunks to bound memory."""
    out = []
    for chunk in R.double().split(1 << 18):
        out.append(P.birkhoff_project_reference(chunk, tol=1e-10, max_iter=200))
    return torch.cat(out)


def _report(name, err):
    err = err.double()
    print(f"{name}: marginal err mean {err.mean():.3e} median {err.median():.3e} max {err.max():.3e}")


# ----------------------------------------------------------------------------
# Accuracy.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["normal1", "uniform1", "normal10", "uniform10"])
def test_n4_accuracy_1m(kind):
    R = _draw(kind, (MILLION, 4, 4))
    T, info = mhc.birkhoff_project(R, return_info=True)
    assert T.dtype == torch.float32 and T.shape == R.shape
    err = mhc.marginal_error(T)
    _report(f"n=4 {kind}", err)
    assert info.num_unconverged == 0
    assert float(err.max()) <= 1e-5
    # Against the float64 solution on a subset.
    idx = torch.randint(0, MILLION, (1 << 16,), device="cuda")
    T64 = _reference64(R[idx])
    assert float((T[idx].double() - T64).abs().max()) <= 1e-4


@pytest.mark.parametrize("kind", ["normal1", "normal10"])
def test_n8_accuracy_1m(kind):
    R = _draw(kind, (MILLION, 8, 8))
    T, info = mhc.birkhoff_project(R, return_info=True)
    err = mhc.marginal_error(T)
    _report(f"n=8 {kind}", err)
    assert info.num_unconverged == 0
    assert float(err.max()) <= 1e-5
    idx = torch.randint(0, MILLION, (1 << 14,), device="cuda")
    T64 = _reference64(R[idx])
    assert float((T[idx].double() - T64).abs().max()) <= 1e-4


@pytest.mark.parametrize("n", [4, 8])
def test_large_magnitude(n):
    R = _draw("normal30", (1 << 18, n, n))
    T, info = mhc.birkhoff_project(R, return_info=True)
    err = mhc.marginal_error(T)
    _report(f"n={n} normal30", err)
    print(
        f"n={n} normal30 iterations mean {info.iterations.float().mean():.2f} max {int(info.iterations.max())}"
    )
    assert info.num_unconverged == 0
    assert float(err.max()) <= 1e-5
    assert bool((info.error <= info.tol).all())


@pytest.mark.parametrize("layout", ["one_entry", "whole_column", "few_per_warp"])
def test_n4_flushed_entries(layout):
    """n = 4's fast solver flushes entries below 1e-30 and fills them back (birkhoff_core.cuh, fill_flushed).

    Wide matrices sit among ordinary ones, fewer than the warp vote needs, so
    they stay on the fast solver: one entry pushed 75 below its row (it must
    come back tiny but right); a whole column pushed down by 75 (the same
    projection as unshifted, every entry of that column flushed: the fast
    solver must hand it back); 1-2 wide N(0, 25²) lanes per warp. Judged
    against the float64 reference.
    """
    B = 1 << 16
    R = _draw("normal10" if layout != "whole_column" else "normal1", (B, 4, 4))
    unshifted = R.clone()
    if layout == "one_entry":
        R[::16, 1, 2] -= 75.0
    elif layout == "whole_column":
        R[::8, :, 0] -= 75.0
    else:
        lanes = torch.zeros(B, dtype=torch.bool, device="cuda")
        for offset in (5, 21):  # two lanes in odd warps, one in even ones
            lanes[offset::32] = True
        lanes[21::64] = False
        R[lanes] = torch.randn_like(R[lanes]) * 25
    wide = int(((R.amax(-1) - R.amin(-1)) > 69.0).any(-1).sum())
    assert wide > 0, "the draw has no wide matrix: the test would not reach the flush path"
    T, info = mhc.birkhoff_project(R, return_info=True)
    err = mhc.marginal_error(T)
    _report(f"n=4 flushed {layout} ({wide} wide)", err)
    assert info.num_unconverged == 0 and bool(torch.isfinite(T).all())
    assert float(err.max()) <= 1e-5
    T64 = _reference64(R)
    assert float((T.double() - T64).abs().max()) <= 1e-4
    if layout == "whole_column":  # a column's shift changes no doubly stochastic scaling
        assert float((T - mhc.birkhoff_project(unshifted)).abs().max()) <= 1e-5


def test_info_matches_cpu_semantics():
    R = _draw("normal1", (1000, 4, 4))
    T, info = mhc.birkhoff_project(R, return_info=True)
    assert info.iterations.dtype == torch.int32 and info.iterations.shape == (1000,)
    assert info.error.dtype == torch.float64
    assert info.tol == P.effective_tol(1e-6, 4, torch.float32)
    torch.testing.assert_close(info.error, mhc.marginal_error(T), atol=1e-9, rtol=0)


# ----------------------------------------------------------------------------
# Gradients.
# ----------------------------------------------------------------------------


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("kind", ["normal1", "normal10"])
def test_gradient_vs_float64(n, kind):
    B = 1 << 18
    R = _draw(kind, (B, n, n)).requires_grad_(True)
    G = torch.randn(B, n, n, device="cuda")
    T = mhc.birkhoff_project(R)
    (dR,) = torch.autograd.grad(T, R, G)
    T64 = _reference64(R.detach())
    dR64 = P.birkhoff_backward(T64, G.double())
    rel = _rel(dR, dR64)
    # the backward kernel alone, on the same T
    dR_same = torch.ops.mhc.birkhoff_backward(T.detach(), G)
    rel_same = _rel(dR_same, P.birkhoff_backward(T.detach().double(), G.double()))
    print(f"grad n={n} {kind}: rel err vs float64 {rel:.3e}; backward kernel on same T {rel_same:.3e}")
    assert rel <= 1e-4
    assert rel_same <= 1e-4


def test_gradcheck_through_op():
    # The kernels compute in fp32 (float64 goes to the PyTorch path), so the
    # finite differences run in fp32 with matching tolerances.
    R = (torch.randn(6, 4, 4, device="cuda", dtype=torch.float64) * 0.5).requires_grad_(True)

    def f(x):
        return mhc.birkhoff_project(x.float(), tol=1e-7).double()

    assert torch.autograd.gradcheck(f, (R,), eps=1e-3, atol=2e-3, rtol=2e-2)
    R8 = (torch.randn(3, 8, 8, device="cuda", dtype=torch.float64) * 0.5).requires_grad_(True)
    assert torch.autograd.gradcheck(f, (R8,), eps=1e-3, atol=2e-3, rtol=2e-2)


def _hessian_vector_product(project, R, W, V):
    """``(∂g/∂R)·V`` with ``g = ∂/∂R Σ project(R)∘W``: the first gradient, then the second."""
    R = R.clone().requires_grad_(True)
    (g,) = torch.autograd.grad((project(R) * W).sum(), R, create_graph=True)
    (hvp,) = torch.autograd.grad((g * V).sum(), R)
    return g.detach(), hvp


@pytest.mark.parametrize("n", [4, 8])
def test_double_backward_matches_reference(n, fresh_seed):
    """create_graph=True through the CUDA op gives the reference's second derivative.

    The backward kernel has no derivative; before the op's backward switched
    to the differentiable reference under create_graph, this Hessian-vector
    product came out 0 (reference 0.327 on the H200) without any error.
    """
    R = torch.randn(64, n, n, device="cuda")
    W, V = torch.randn_like(R), torch.randn_like(R)
    g, hvp = _hessian_vector_product(lambda x: mhc.birkhoff_project(x, tol=1e-7), R, W, V)
    g64, hvp64 = _hessian_vector_product(
        lambda x: P.birkhoff_project_reference(x, tol=1e-12),
        R.double().cpu(),
        W.double().cpu(),
        V.double().cpu(),
    )
    assert float(hvp64.norm()) > 0, f"seed={fresh_seed}"
    assert _rel(g.cpu(), g64) <= 1e-4, f"seed={fresh_seed}: first derivative {_rel(g.cpu(), g64):.2e}"
    assert _rel(hvp.cpu(), hvp64) <= 1e-3, (
        f"seed={fresh_seed}: Hessian-vector product rel err {_rel(hvp.cpu(), hvp64):.2e} "
        f"(|hvp| {float(hvp.norm()):.3e}, reference {float(hvp64.norm()):.3e})"
    )


@pytest.mark.parametrize("n", [4, 8])
def test_nonfinite_grad_poisons_only_its_matrix(n, fresh_seed):
    """A NaN or Inf in one matrix's ∂L/∂T makes that whole matrix's gradient NaN, as on the PyTorch path.

    The neighbours are bit-equal to the gradient of a clean batch. Before the
    kernel kept 0·rhs in w, only the rows holding the NaN/Inf became NaN.
    """
    R = torch.randn(64, n, n, device="cuda").requires_grad_(True)
    G = torch.randn_like(R)
    bad = [5, 9]
    G_bad = G.clone()
    G_bad[5, 1, 2] = math.nan
    G_bad[9, n - 1, 0] = math.inf
    (dR_clean,) = torch.autograd.grad(mhc.birkhoff_project(R), R, G)
    (dR_bad,) = torch.autograd.grad(mhc.birkhoff_project(R), R, G_bad)
    good = torch.ones(64, dtype=torch.bool, device="cuda")
    good[bad] = False
    assert bool(dR_bad[bad].isnan().all()), f"seed={fresh_seed}: {dR_bad[bad]}"
    assert torch.equal(dR_bad[good], dR_clean[good]), f"seed={fresh_seed}"
    # The same pattern as the reference on the CPU.
    Rc = R.detach().cpu().requires_grad_(True)
    (dR_ref,) = torch.autograd.grad(P.birkhoff_project_reference(Rc), Rc, G_bad.cpu())
    assert torch.equal(dR_ref.isnan(), dR_bad.isnan().cpu()), f"seed={fresh_seed}"


def test_float64_routes_to_reference_and_gradcheck():
    R = torch.randn(4, 4, 4, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: mhc.birkhoff_project(x, tol=1e-12), (R,))


# ----------------------------------------------------------------------------
# dtypes, layouts, shapes.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [4, 8])
def test_low_precision_input(dtype, n):
    R = _draw("normal1", (1 << 16, n, n)).to(dtype)
    T = mhc.birkhoff_project(R)
    assert T.dtype == dtype and T.shape == R.shape
    T64 = _reference64(R.float())
    step = torch.finfo(dtype).eps
    assert float((T.double() - T64).abs().max()) <= step
    assert float(mhc.marginal_error(T).max()) <= 2 * n * n * step
    # gradient in the input dtype
    Rg = R.clone().requires_grad_(True)
    G = torch.randn_like(R)
    (dR,) = torch.autograd.grad(mhc.birkhoff_project(Rg), Rg, G)
    assert dR.dtype == dtype
    ref = P.birkhoff_backward(T64, G.double())
    assert _rel(dR, ref) <= 20 * step


@pytest.mark.parametrize("n", [4, 8])
def test_non_contiguous(n):
    base = _draw("normal10", (2048, n, n))
    R = base.transpose(-1, -2)
    assert not R.is_contiguous()
    torch.testing.assert_close(mhc.birkhoff_project(R), mhc.birkhoff_project(R.contiguous()), atol=0, rtol=0)
    wide = _draw("normal1", (512, n, 2 * n))[..., ::2]
    torch.testing.assert_close(
        mhc.birkhoff_project(wide), mhc.birkhoff_project(wide.contiguous()), atol=0, rtol=0
    )
    # misaligned storage offset (scalar path of the tile loader)
    flat = _draw("normal1", (1 + 300 * n * n,))
    R = flat[1:].view(300, n, n)
    torch.testing.assert_close(mhc.birkhoff_project(R), mhc.birkhoff_project(R.clone()), atol=0, rtol=0)


@pytest.mark.parametrize("n", [4, 8])
def test_empty_and_single(n):
    for shape in [(0, n, n), (3, 0, n, n)]:
        R = torch.randn(shape, device="cuda", requires_grad=True)
        T = mhc.birkhoff_project(R)
        assert T.shape == shape
        T.sum().backward()
        assert R.grad.shape == shape
    for shape in [(n, n), (1, n, n), (1, 1, n, n), (129, n, n)]:
        R = torch.randn(shape, device="cuda")
        T = mhc.birkhoff_project(R)
        assert T.shape == shape
        torch.testing.assert_close(
            T.double(), _reference64(R.reshape(-1, n, n)).reshape(shape), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("n", [4, 8])
def test_nonfinite_matches_cpu(n):
    R = torch.randn(300, n, n, device="cuda")
    R[3, 1, 2] = math.nan
    R[7, 0, 0] = math.inf
    R[200, n - 1, n - 1] = math.inf
    R[200, 0, 0] = -math.inf  # a zero of exp(R) (tests/test_projection_zeros.py); the +inf makes it NaN
    T, info = mhc.birkhoff_project(R, return_info=True)
    bad = torch.zeros(300, dtype=torch.bool, device="cuda")
    bad[[3, 7, 200]] = True
    assert bool(T[bad].isnan().all())
    assert bool(T[~bad].isfinite().all())
    assert bool(info.error[bad].isnan().all()) and bool((info.iterations[bad] == 0).all())
    assert info.num_nonfinite == 3 and info.num_unconverged == 0
    clean = mhc.birkhoff_project(R[~bad])
    torch.testing.assert_close(T[~bad], clean, atol=0, rtol=0)
    Tc, infoc = mhc.birkhoff_project(R.cpu(), return_info=True)
    assert torch.equal(Tc.isnan(), T.isnan().cpu())
    torch.testing.assert_close(T.cpu()[~bad.cpu()], Tc[~bad.cpu()], atol=1e-5, rtol=0)
    # gradients of the finite matrices are finite
    Rg = R.clone().requires_grad_(True)
    (dR,) = torch.autograd.grad(mhc.birkhoff_project(Rg), Rg, torch.randn_like(R))
    assert bool(dR[~bad].isfinite().all())


def test_other_n_and_double_use_pytorch_path():
    for n in (2, 3, 5):
        R = torch.randn(100, n, n, device="cuda")
        T = mhc.birkhoff_project(R)
        assert float(mhc.marginal_error(T).max()) <= 1e-5
    R = torch.randn(100, 4, 4, device="cuda", dtype=torch.float64)
    T = mhc.birkhoff_project(R, tol=1e-10)
    assert T.dtype == torch.float64 and float(mhc.marginal_error(T).max()) <= 1e-10


# ----------------------------------------------------------------------------
# Convergence accounting.
# ----------------------------------------------------------------------------


def test_unconverged_counter_and_warning():
    from mhc.projection import cuda as projection_cuda

    # Counter at 0, nothing warned yet, and the periodic poll POLL_EVERY calls away.
    projection_cuda.reset_convergence_tracking()
    assert projection_cuda.unconverged_count() == 0
    R = _draw("normal10", (4096, 4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = mhc.birkhoff_project(R, max_iter=0, return_info=True)
    expected = info.num_unconverged
    assert expected > 0
    assert projection_cuda.unconverged_count() == expected
    with pytest.warns(P.ConvergenceWarning):
        mhc.birkhoff_project(R, max_iter=0)
        assert projection_cuda.check_convergence() == 2 * expected
    assert projection_cuda.unconverged_count(reset=True) == 2 * expected
    assert projection_cuda.unconverged_count() == 0
    mhc.birkhoff_project(R)
    assert projection_cuda.unconverged_count() == 0


def test_project_no_autograd_is_the_same_kernel():
    """The fused site's call past autograd: birkhoff_project's bits, no graph, and the same counter."""
    from mhc.projection import cuda as projection_cuda

    R = _draw("normal10", (4096, 4, 4)).requires_grad_()
    tol = P.effective_tol(1e-6, 4, R.dtype)
    T = projection_cuda.project_no_autograd(R, tol, P.NEWTON_MAX_ITER)
    assert T.grad_fn is None and not T.requires_grad
    torch.testing.assert_close(T, mhc.birkhoff_project(R.detach(), tol=1e-6), atol=0, rtol=0)
    projection_cuda.reset_convergence_tracking()  # the periodic poll stays out of this test
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = mhc.birkhoff_project(R, max_iter=0, return_info=True)
    projection_cuda.project_no_autograd(R.detach(), tol, 0)
    assert projection_cuda.unconverged_count(reset=True) == 2 * info.num_unconverged > 0


def test_hot_path_looks_at_the_counter_every_poll_every_calls():
    """birkhoff_project's hot call counts itself in the extension: every POLL_EVERY calls it starts a copy of the
    counter, and the next look hands the value copied to the warning, which fires once for one growth. A reset
    forgets copies made before it, and no look runs while a CUDA graph is captured."""
    from mhc.projection import cuda as projection_cuda

    R = _draw("normal10", (4096, 4, 4))
    projection_cuda.reset_convergence_tracking()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = mhc.birkhoff_project(R, max_iter=0, return_info=True)
        every = projection_cuda.POLL_EVERY
        for _ in range(every):  # leaves a copy of a count > 0 in flight, which the reset must drop
            mhc.birkhoff_project(R, max_iter=0)
    per_call = info.num_unconverged
    assert per_call > 0
    projection_cuda.reset_convergence_tracking()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2 * every - 1):
            mhc.birkhoff_project(R, max_iter=0)
            torch.cuda.synchronize()
        assert not caught  # the first look only started the copy
        mhc.birkhoff_project(R, max_iter=0)
    assert [w.category for w in caught] == [P.ConvergenceWarning]
    assert f"{every * per_call} more matrices" in str(caught[0].message)

    seen = []
    projection_cuda.extension().set_poll(lambda dev, count: seen.append(count), 1)
    try:
        static_in = R.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mhc.birkhoff_project(static_in, max_iter=0)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        looks = len(seen)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            mhc.birkhoff_project(static_in, max_iter=0)
        g.replay()
        torch.cuda.synchronize()
        assert len(seen) == looks
    finally:
        projection_cuda.reset_convergence_tracking()


def test_hot_call_binding_checks_its_arguments_and_passes_errors_on():
    """The extension's project_or_none is a plain CPython function: it must reject what pybind11 would have
    rejected, hand back None for inputs the kernels do not take, give the op's bits, and raise the poll
    callback's exception rather than lose it."""
    from mhc.projection import cuda as projection_cuda

    ext = projection_cuda.extension()
    R = _draw("normal10", (300, 4, 4))
    T = ext.project_or_none(R, 1e-6, 100)
    assert torch.equal(T, torch.ops.mhc.birkhoff_forward(R, P.effective_tol(1e-6, 4, torch.float32), 100))
    assert (T.double() - mhc.birkhoff_project_reference(R.double())).abs().max() < 1e-5
    assert ext.project_or_none(R.cpu(), 1e-6, 100) is None
    assert ext.project_or_none(R[..., :3, :3], 1e-6, 100) is None
    assert ext.project_or_none(R.double(), 1e-6, 100) is None
    for bad in ((R, 1e-6), (R, 1e-6, 100, 1), ("R", 1e-6, 100), (R, "tol", 100), (R, 1e-6, 1.5)):
        with pytest.raises(TypeError):
            ext.project_or_none(*bad)
    with pytest.raises(TypeError):
        ext.project_or_none(R, tol=1e-6, max_iter=100)  # positional only

    def fail(device, count):
        raise KeyError("from the callback")

    hard = _draw("normal10", (4096, 4, 4))
    ext.set_poll(fail, 1)
    try:
        with pytest.raises(KeyError, match="from the callback"):
            for _ in range(4):  # the first look only starts the copy of the counter
                ext.project_or_none(hard, 1e-6, 0)
                torch.cuda.synchronize()
    finally:
        projection_cuda.reset_convergence_tracking()


# ----------------------------------------------------------------------------
# torch.compile, CUDA graphs, streams.
# ----------------------------------------------------------------------------


def test_torch_compile_fullgraph():
    def f(x, w):
        return (mhc.birkhoff_project(x) * w).sum()

    x = torch.randn(1000, 4, 4, device="cuda", requires_grad=True)
    w = torch.randn(1000, 4, 4, device="cuda")
    ref = f(x, w)
    (gref,) = torch.autograd.grad(ref, x)
    cf = torch.compile(f, fullgraph=True)
    out = cf(x, w)
    (g,) = torch.autograd.grad(out, x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g, gref)


def test_cuda_graph_replay():
    x = torch.randn(4096, 8, 8, device="cuda")
    static_in = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            mhc.birkhoff_project(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = mhc.birkhoff_project(static_in)
    for _ in range(3):
        new = torch.randn(4096, 8, 8, device="cuda") * 5
        static_in.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, mhc.birkhoff_project(new), atol=0, rtol=0)


def test_current_stream_launch():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # keep s busy so a wrong-stream launch would read unwritten x
        x = torch.randn(1 << 16, 4, 4, device="cuda") * 3
        y = mhc.birkhoff_project(x)
        G = torch.randn_like(x)
        xr = x.clone().requires_grad_(True)
        (dx,) = torch.autograd.grad(mhc.birkhoff_project(xr), xr, G)
    s.synchronize()
    torch.testing.assert_close(y, mhc.birkhoff_project(x), atol=0, rtol=0)
    torch.testing.assert_close(dx, torch.ops.mhc.birkhoff_backward(y, G), atol=0, rtol=0)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_equals_the_checked_path(n, dtype, fresh_seed):
    """birkhoff_project's unchecked hot path (one call into the extension) gives the checked path's bits,
    with and without a graph, for any leading shape; subclasses and options it does not take go the checked way."""
    from mhc.projection import cuda as projection_cuda

    for shape in [(257, n, n), (3, 5, n, n), (n, n), (0, n, n)]:
        R = (torch.randn(shape, device="cuda") * 10).to(dtype)
        T_fast = projection_cuda.project_fast(R, 1e-6, 100)
        T_checked = projection_cuda.project(R, tol=1e-6, max_iter=100, return_info=False)
        assert T_fast is not None and T_fast.shape == R.shape and T_fast.dtype == dtype
        assert torch.equal(T_fast, T_checked), f"seed={fresh_seed}, shape {shape}"
        assert torch.equal(mhc.birkhoff_project(R), T_checked), f"seed={fresh_seed}, shape {shape}"
        if R.numel():
            G = torch.randn_like(R)
            Rg = R.clone().requires_grad_()
            (d_fast,) = torch.autograd.grad(mhc.birkhoff_project(Rg), Rg, G)
            Rc = R.clone().requires_grad_()
            (d_checked,) = torch.autograd.grad(
                projection_cuda.project(Rc, tol=1e-6, max_iter=100, return_info=False), Rc, G
            )
            assert torch.equal(d_fast, d_checked), f"seed={fresh_seed}, shape {shape}"
    # tol is raised to the float32 rounding floor, as effective_tol does
    _, info = mhc.birkhoff_project(torch.randn(64, n, n, device="cuda"), tol=1e-12, return_info=True)
    assert info.tol == P.effective_tol(1e-12, n, torch.float32)
    # not taken: CPU tensors, other n, float64
    assert projection_cuda.project_fast(torch.randn(4, n, n), 1e-6, 100) is None
    assert projection_cuda.project_fast(torch.randn(4, 5, 5, device="cuda"), 1e-6, 100) is None
    assert (
        projection_cuda.project_fast(torch.randn(4, n, n, device="cuda", dtype=torch.float64), 1e-6, 100)
        is None
    )
    assert projection_cuda.project_fast(torch.randn(4, n, 3, device="cuda"), 1e-6, 100) is None
    # under vmap the extension declines (batched tensors need the dispatcher) and the op's fallback loops
    R = torch.randn(6, 32, n, n, device="cuda")
    torch.testing.assert_close(
        torch.func.vmap(mhc.birkhoff_project)(R), mhc.birkhoff_project(R), rtol=0, atol=1e-6
    )
    # a forward-mode tangent declines too, and the checked path refuses it (it would come back as zero)
    from torch.autograd import forward_ad

    with forward_ad.dual_level():
        dual = forward_ad.make_dual(R[0], torch.ones_like(R[0]))
        assert projection_cuda.project_fast(dual, 1e-6, 100) is None
        with pytest.raises(NotImplementedError, match="forward-mode"):
            mhc.birkhoff_project(dual)
    # a Parameter (a Tensor subclass) takes the checked path and still gets its gradient
    p = torch.nn.Parameter(torch.randn(16, n, n, device="cuda"))
    mhc.birkhoff_project(p).sum().backward()
    assert p.grad is not None and torch.isfinite(p.grad).all()
