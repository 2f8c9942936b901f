"""Tests of trl_ext.ops.stats against statistics of the selected elements computed with plain torch."""

import math

import pytest
import torch

from trl_ext.ops import masked_mean, masked_normalize, masked_std, masked_sum, masked_var, masked_whiten


def _ragged(seed=0, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = [7, 3, 1, 5]
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    return x, mask


def _with_garbage(x, mask):
    y = x.clone()
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    pads = (mask == 0).nonzero()
    for i, (b, t) in enumerate(pads.tolist()):
        y[b, t] = garbage[i % 4]
    return y


def test_sum_and_mean_global_and_per_row():
    x, mask = _ragged()
    sel = x[mask.bool()]
    assert torch.allclose(masked_sum(x, mask), sel.sum())
    assert torch.allclose(masked_mean(x, mask), sel.mean())
    for b in range(x.shape[0]):
        row = x[b, mask[b].bool()]
        assert torch.allclose(masked_sum(x, mask, dim=1)[b], row.sum())
        assert torch.allclose(masked_mean(x, mask, dim=1)[b], row.mean())
    # along dim 0 (per column)
    for t in range(x.shape[1]):
        col = x[mask[:, t].bool(), t]
        expected = col.mean() if col.numel() else torch.tensor(0.0, dtype=x.dtype)
        assert torch.allclose(masked_mean(x, mask, dim=0)[t], expected)


def test_mean_of_all_zero_row_is_zero_not_nan():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = masked_mean(x, mask, dim=1)
    assert out.tolist() == [1.5, 0.0]
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    assert masked_var(x, mask, dim=1)[1].item() == 0.0
    assert masked_std(x, mask, dim=1)[1].item() == 0.0


def test_mean_eps_denominator():
    x = torch.tensor([2.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 0])
    assert masked_mean(x, mask, eps=1.0).item() == pytest.approx(6.0 / 3.0)


def test_garbage_in_masked_positions_is_ignored():
    x, mask = _ragged(seed=1)
    y = _with_garbage(x, mask)
    assert not torch.isfinite(y).all()
    for dim in (None, 1, 0):
        assert torch.allclose(masked_sum(y, mask, dim=dim), masked_sum(x, mask, dim=dim))
        assert torch.allclose(masked_mean(y, mask, dim=dim), masked_mean(x, mask, dim=dim))
        assert torch.allclose(masked_var(y, mask, dim=dim), masked_var(x, mask, dim=dim))
    for fn in (masked_whiten, masked_normalize):
        out = fn(y, mask)
        assert torch.isfinite(out).all()
        assert torch.allclose(out, fn(x, mask))
        assert (out[mask == 0] == 0).all()


def test_gradient_is_finite_with_garbage():
    x, mask = _ragged(seed=2)
    y = _with_garbage(x, mask).requires_grad_(True)
    masked_mean(y, mask).backward()
    assert torch.isfinite(y.grad).all()
    assert (y.grad[mask == 0] == 0).all()
    n = int(mask.sum())
    assert torch.allclose(y.grad[mask == 1], torch.full((n,), 1.0 / n, dtype=y.dtype))


@pytest.mark.parametrize("unbiased", [True, False])
def test_var_std_against_torch_on_selected_elements(unbiased):
    x, mask = _ragged(seed=3)
    sel = x[mask.bool()]
    assert torch.allclose(masked_var(x, mask, unbiased=unbiased), sel.var(unbiased=unbiased))
    assert torch.allclose(masked_std(x, mask, unbiased=unbiased), sel.std(unbiased=unbiased))
    per_row = masked_var(x, mask, dim=1, unbiased=unbiased)
    for b in range(x.shape[0]):
        row = x[b, mask[b].bool()]
        if unbiased and row.numel() == 1:
            assert per_row[b].item() == 0.0  # documented: undefined -> 0
        else:
            assert torch.allclose(per_row[b], row.var(unbiased=unbiased))


def test_dim_tuple_and_bool_and_float_masks():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 3, 4, generator=g) > 0.3
    for m in (mask, mask.float(), mask.long()):
        out = masked_mean(x, m, dim=(1, 2))
        for b in range(2):
            assert torch.allclose(out[b], x[b][mask[b]].mean())
        var = masked_var(x, m, dim=(0, 2))
        for j in range(3):
            assert torch.allclose(var[j], x[:, j][mask[:, j]].var())


def test_broadcast_mask():
    x = torch.arange(6.0).reshape(2, 3)
    mask = torch.tensor([[1], [0]])
    assert masked_mean(x, mask).item() == pytest.approx(1.0)
    assert masked_sum(x, mask, dim=1).tolist() == [3.0, 0.0]


def test_whiten_global_and_along_dim():
    x, mask = _ragged(seed=5)
    sel = x[mask.bool()]
    mu, var = sel.mean(), sel.var(unbiased=True)
    out = masked_whiten(x, mask, eps=1e-8)
    expected = (x - mu) / torch.sqrt(var + 1e-8)
    assert torch.allclose(out[mask.bool()], expected[mask.bool()])
    assert (out[mask == 0] == 0).all()
    whitened = out[mask.bool()]
    assert whitened.mean().abs().item() < 1e-10
    assert whitened.std().item() == pytest.approx(1.0, rel=1e-6)
    # shift_mean=False adds the mean back
    out2 = masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(out2[mask.bool()], (expected + mu)[mask.bool()])
    # along rows with at least two elements
    out_rows = masked_whiten(x, mask, dim=1)
    for b in (0, 1, 3):
        row = x[b, mask[b].bool()]
        assert torch.allclose(out_rows[b, mask[b].bool()], (row - row.mean()) / torch.sqrt(row.var() + 1e-8))


def test_normalize_floors_std_and_matches_formula():
    x, mask = _ragged(seed=6)
    sel = x[mask.bool()]
    out = masked_normalize(x, mask)
    assert torch.allclose(out[mask.bool()], (sel - sel.mean()) / sel.std())
    const = torch.full((2, 3), 5.0)
    m = torch.ones(2, 3)
    out_c = masked_normalize(const, m)
    assert torch.isfinite(out_c).all() and (out_c == 0).all()
    assert math.isfinite(masked_whiten(const, m).abs().max().item())


def test_inputs_not_modified():
    x, mask = _ragged(seed=7)
    y = _with_garbage(x, mask)
    y0, m0 = y.clone(), mask.clone()
    for fn in (masked_sum, masked_mean, masked_var, masked_std, masked_whiten, masked_normalize):
        fn(y, mask)
    assert torch.equal(y.nan_to_num(), y0.nan_to_num()) and torch.equal(mask, m0)
