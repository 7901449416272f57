"""expand_streams / reduce_streams / StreamReduce."""

import pytest
import torch

from mhc import StreamReduce, expand_streams, reduce_streams


def test_expand_then_reduce_round_trips():
    h = torch.randn(2, 3, 16)
    x = expand_streams(h, 4)
    assert x.shape == (2, 3, 4, 16) and x.is_contiguous()
    assert torch.equal(x[..., 2, :], h)
    assert torch.allclose(reduce_streams(x), h)


@pytest.mark.parametrize("n", [2, 3, 5, 6, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_of_equal_streams_is_that_stream_exactly(n, dtype, fresh_seed):
    """A mean of n equal values rounds in float32 for most n (3x is not exact); the reduce around
    stream 0 gives the stream back bit for bit, so conversion stays exact for every n_streams."""
    h = (torch.randn(64, 96) * torch.logspace(-3, 3, 96)).to(dtype)
    x = expand_streams(h, n)
    assert torch.equal(reduce_streams(x), h), f"seed={fresh_seed}"
    assert torch.equal(reduce_streams(x, torch.full((n,), 1.0 / n)), h), f"seed={fresh_seed}"
    assert torch.equal(StreamReduce(n, learned=True)(x), h), f"seed={fresh_seed}"
    # a plain mean shows what this guards against: some n leave a rounding error
    if n in (3, 5, 6):
        plain = x.mean(dim=-2, dtype=torch.float32).to(dtype)
        assert dtype == torch.bfloat16 or not torch.equal(plain, h), f"seed={fresh_seed}"


def test_weighted_reduce_accumulates_in_fp32():
    x = torch.randn(5, 4, 8, dtype=torch.bfloat16)
    w = torch.tensor([0.1, 0.2, 0.3, 0.4])
    out = reduce_streams(x, w)
    assert out.dtype == torch.bfloat16
    ref = (x.float() * w[:, None]).sum(-2)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("weighted", [True, False])
def test_bf16_reduce_accumulates_in_fp32(weighted):
    """Streams that cancel: a bf16 running sum (in either order), bf16 products or
    bf16-rounded weights give a visibly wrong answer; in float32 every partial sum
    here is exact, so the result is the float64 reference rounded once to bf16."""
    n = 10
    x = torch.ones(2, n, 4)
    x[0, 0], x[0, -1] = 256.0, -256.0  # token 0 meets +256 first,
    x[1, 0], x[1, -1] = -256.0, 256.0  # token 1 meets -256 first
    w = torch.ones(n)
    w[0] = 1 + 2**-10  # exact in float32, 1.0 in bf16 (and 256 * w[0] = 256.25 is 256 in bf16)
    x = x.bfloat16()
    if weighted:
        out = reduce_streams(x, w)
        ref = torch.einsum("n,...nc->...c", w.double(), x.double())
        assert ref[0, 0].item() == 8.25 and ref[1, 0].item() == 7.75
    else:
        out = reduce_streams(x)
        ref = x.double().mean(-2)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.to(torch.bfloat16)), (out[:, 0], ref[:, 0])


def test_learned_reduce_starts_at_the_mean_and_learns():
    head = StreamReduce(4, learned=True)
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(head(x), x.mean(-2))
    head(x).sum().backward()
    assert head.weight.grad is not None
    assert StreamReduce(4).weight is None
    assert "learned=True" in repr(head)


def test_bad_input_raises():
    with pytest.raises(ValueError):
        expand_streams(torch.randn(3, 8), 0)
    for bad in (2.7, True, "4"):
        with pytest.raises(TypeError, match="n_streams"):
            expand_streams(torch.randn(3, 8), bad)
        with pytest.raises(TypeError, match="n_streams"):
            StreamReduce(bad)
    with pytest.raises(ValueError, match="n_streams"):
        StreamReduce(0)
    with pytest.raises(TypeError, match="learned"):
        StreamReduce(4, learned="yes")
    with pytest.raises(ValueError):
        reduce_streams(torch.randn(8))
    with pytest.raises(ValueError, match="streams"):
        reduce_streams(torch.randn(2, 4, 8), torch.ones(3))


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="h must be a torch.Tensor"):
        expand_streams([1.0, 2.0], 4)
    with pytest.raises(ValueError, match=r"\[\.\.\., C\]"):
        expand_streams(torch.tensor(1.0), 4)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        reduce_streams([[1.0, 2.0]])
    with pytest.raises(TypeError, match="weights must be a torch.Tensor or None"):
        reduce_streams(torch.randn(2, 4, 8), [0.25] * 4)
    with pytest.raises(ValueError, match="weights"):
        reduce_streams(torch.randn(2, 4, 8), torch.tensor(0.25))  # no stream dimension
    with pytest.raises(ValueError, match=r"weights of shape \(3, 4\) do not broadcast"):
        reduce_streams(torch.randn(2, 4, 8), torch.ones(3, 4))  # [..., n] against a batch of 2
    with pytest.raises(ValueError, match=r"weights of shape \(2, 1, 4\) do not broadcast"):
        reduce_streams(torch.randn(2, 4, 8), torch.ones(2, 1, 4))  # would add a batch dimension
    # what is documented still works: [n] weights, and weights broadcast over the batch
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(reduce_streams(x, torch.full((4,), 0.25)), x.mean(-2))
    torch.testing.assert_close(reduce_streams(x, torch.full((2, 4), 0.25)), x.mean(-2))
    torch.testing.assert_close(reduce_streams(x, torch.full((1, 4), 0.25)), x.mean(-2))
