"""trace.select takes every ordered index and refuses the rest with a TypeError/ValueError
that says what to pass (issue 12, item 16c)."""

import pytest
import torch

import qkv

T = 9


@pytest.fixture(params=["torch", "reference"])
def trace(request):
    q, k, v = (torch.randn(2, 3, T, 4, dtype=torch.float64) for _ in range(3))
    _, tr = qkv.scaled_dot_product_attention(q, k, v, backend=request.param, return_trace=True)
    return tr


ORDERED = {
    "reversed-range": (range(8, 2, -2), [8, 6, 4]),
    "reversed-builtin": (lambda: reversed(range(3)), [2, 1, 0]),  # iterators: made per test
    "generator": (lambda: (i for i in (5, 1, 7)), [5, 1, 7]),
    "tuple": ((4, 0), [4, 0]),
    "list-negative": ([-1, 2], [8, 2]),
    "tensor": (torch.tensor([3, 3, 0]), [3, 3, 0]),
    "negative-step-slice": (slice(None, 4, -2), [8, 6]),
    "empty-list": ([], []),
}


@pytest.mark.parametrize("case", list(ORDERED))
def test_select_rows_in_the_order_given(trace, case):
    index, rows = ORDERED[case]
    index = index() if callable(index) else index
    part = trace.select(rows=index)
    assert part.probs.shape == (2, 3, len(rows), T)
    torch.testing.assert_close(part.probs, trace.probs[:, :, rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(part.lse, trace.lse[:, :, rows], rtol=0, atol=0)


def test_select_generator_of_heads_and_batch(trace):
    part = trace.select(batch=(b for b in [1]), heads=reversed(range(3)), rows=[0])
    torch.testing.assert_close(
        part.probs, trace.probs[[1]][:, [2, 1, 0]][:, :, [0]], rtol=0, atol=1e-12
    )


REFUSED = {
    "str": ("12", TypeError, "got str '12'"),
    "set": ({1, 2}, TypeError, r"a set, which has no order.*sorted\(\{1, 2\}\)"),
    "frozenset": (frozenset({3}), TypeError, "has no order"),
    "floats": ([1.0, 2.0], ValueError, "iterable of ints"),
    "bools": ([True, False], ValueError, "iterable of ints"),
    "object": (object(), TypeError, "iterable of ints"),
    "nested": ([[1, 2]], ValueError, "iterable of ints"),
    "out-of-range": (range(5, 10), ValueError, "out of range for size 9"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_select_refuses_unordered_or_non_integer_indices(trace, case):
    index, error, message = REFUSED[case]
    with pytest.raises(error, match=message):
        trace.select(rows=index)
