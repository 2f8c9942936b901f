"""Hypothesis strategies shared by `test_properties_ops.py` and `test_properties_losses.py`.

Tensors are drawn as lists of Python floats (so Hypothesis explores and shrinks the values themselves, extremes
included) with small shapes, and masks row by row from four kinds: random, all-zero, a single token, full. Masked-out
entries are later overwritten with garbage (``nan``, ``±inf``, huge numbers) to check that they are never read.
"""

from __future__ import annotations

import math

import torch
from hypothesis import settings
from hypothesis import strategies as st

__all__ = [
    "FAST",
    "GARBAGE",
    "assert_same",
    "float_tensor",
    "mask_rows",
    "perm",
    "with_garbage",
]

#: Settings of every property: few examples (the suite must stay fast), no per-example deadline (first calls
#: compile kernels).
FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None)

GARBAGE = (math.nan, math.inf, -math.inf, 1e30, -1e30)


@st.composite
def float_tensor(draw, shape, lo: float = -1e4, hi: float = 1e4, dtype=torch.float64, width: int = 64):
    """A tensor of ``shape`` with values in ``[lo, hi]`` (no nan/inf)."""
    n = math.prod(shape)
    values = draw(
        st.lists(st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=width), min_size=n, max_size=n)
    )
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)


@st.composite
def mask_rows(draw, rows: int, T: int, contiguous: bool = False, kinds=("random", "zero", "one", "full")):
    """A ``(rows, T)`` int64 mask; each row is random, all-zero, a single token or full. ``contiguous``: random
    rows are one block of real tokens at the left or the right end (right / left padding)."""
    out = []
    for _ in range(rows):
        kind = draw(st.sampled_from(kinds))
        if kind == "zero":
            row = [0] * T
        elif kind == "full":
            row = [1] * T
        elif kind == "one":
            i = draw(st.integers(0, T - 1)) if not contiguous else draw(st.sampled_from([0, T - 1]))
            row = [int(t == i) for t in range(T)]
        elif contiguous:
            n = draw(st.integers(0, T))
            row = [1] * n + [0] * (T - n) if draw(st.booleans()) else [0] * (T - n) + [1] * n
        else:
            row = draw(st.lists(st.integers(0, 1), min_size=T, max_size=T))
        out.append(row)
    return torch.tensor(out, dtype=torch.long)


@st.composite
def perm(draw, n: int):
    """A permutation of ``range(n)`` as a ``long`` tensor."""
    return torch.tensor(draw(st.permutations(list(range(n)))), dtype=torch.long)


def with_garbage(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` with every masked-out entry (``mask == 0``, broadcast over trailing dims) replaced by ``value``."""
    keep = mask != 0
    while keep.dim() < x.dim():
        keep = keep.unsqueeze(-1)
    return torch.where(keep, x, torch.full_like(x, value))


def assert_same(a: torch.Tensor, b: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> None:
    """``a`` and ``b`` equal (exactly by default), ``nan`` never allowed."""
    assert not torch.isnan(a).any() and not torch.isnan(b).any(), (a, b)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
