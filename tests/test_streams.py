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


def test_weighted_reduce_accumulates_in_fp32():
    x = torch.randn(5, 4, 8, dtype=torch.bfloat16)
    w = torch.tensor([0.1, 0.2, 0.3, 0.4])
    out = reduce_streams(x, w)
    assert out.dtype == torch.bfloat16
    ref = (x.float() * w[:, None]).sum(-2)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


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
    with pytest.raises(ValueError):
        reduce_streams(torch.randn(8))
    with pytest.raises(ValueError, match="streams"):
        reduce_streams(torch.randn(2, 4, 8), torch.ones(3))
