"""Tests of the importance-weight helpers (trl_ext.losses.weights), against explicit Python loops."""

import math

import pytest
import torch

from trl_ext.losses.weights import (
    ORIGINAL_INDICATOR_THRESHOLD,
    effective_sample_size,
    per_step_log_weights,
    per_step_weights,
    sequence_log_weights,
    sigma_weights,
)


def _inputs(P=2, N=3, T=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    ref = -torch.rand(P, N, T, generator=g, dtype=dtype) * 3
    old = -torch.rand(P, N, T, generator=g, dtype=dtype) * 3
    phi = torch.randn(P, N, generator=g, dtype=dtype) * 2
    v = torch.randn(P, N, T, generator=g, dtype=dtype)
    lengths = torch.randint(1, T + 1, (P, N), generator=g)
    mask = (torch.arange(T)[None, None, :] < lengths[..., None]).to(dtype)
    return ref, old, phi, v, mask


def _loop_seq_logw(ref, old, phi, mask):
    P, N, T = mask.shape
    out = [[0.0] * N for _ in range(P)]
    for p in range(P):
        for i in range(N):
            s = phi[p][i].item()
            for t in range(T):
                if mask[p, i, t] != 0:
                    s += ref[p, i, t].item() - old[p, i, t].item()
            out[p][i] = s
    return out


def _softmax(xs):
    top = max(xs)
    es = [math.exp(x - top) for x in xs]
    return [e / sum(es) for e in es]


def _garbage(x, mask):
    """Copy of x with inf/-inf/nan written at masked positions."""
    y = x.clone()
    fills = [math.inf, -math.inf, math.nan]
    for k, idx in enumerate((mask == 0).nonzero().tolist()):
        y[tuple(idx)] = fills[k % 3]
    return y


def test_sequence_log_weights_matches_loop():
    ref, old, phi, _, mask = _inputs()
    got = sequence_log_weights(ref, old, phi, mask)
    want = torch.tensor(_loop_seq_logw(ref, old, phi, mask), dtype=got.dtype)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, want)


def test_padding_does_not_change_sigma_weight():
    # Sample 0 has 2 real tokens; re-pad the same response to a 5-token window filled with arbitrary log-probs.
    ref = torch.tensor([[[-1.0, -2.0], [-0.5, -0.7]]])
    old = torch.tensor([[[-1.5, -1.0], [-0.2, -0.9]]])
    phi = torch.tensor([[0.3, -1.2]])
    mask = torch.ones(1, 2, 2)
    w_short = sigma_weights(ref, old, phi, mask)

    pad_ref = torch.tensor([[[-1.0, -2.0, -7.0, math.nan, -3.0], [-0.5, -0.7, -4.0, -1.0, math.inf]]])
    pad_old = torch.tensor([[[-1.5, -1.0, -0.1, -0.2, -math.inf], [-0.2, -0.9, -8.0, math.nan, -0.3]]])
    pad_mask = torch.tensor([[[1.0, 1, 0, 0, 0], [1.0, 1, 0, 0, 0]]])
    w_long = sigma_weights(pad_ref, pad_old, phi, pad_mask)
    torch.testing.assert_close(w_long, w_short)
    torch.testing.assert_close(sequence_log_weights(pad_ref, pad_old, phi, pad_mask), ref.sum(-1) + phi - old.sum(-1))


def test_sigma_weights_per_prompt_softmax_matches_loop():
    ref, old, phi, _, mask = _inputs(P=3, N=4, T=3, seed=1)
    w = sigma_weights(ref, old, phi, mask)
    logw = _loop_seq_logw(ref, old, phi, mask)
    for p in range(3):
        want = _softmax(logw[p])
        for i in range(4):
            assert w[p, i].item() == pytest.approx(want[i], rel=1e-9, abs=1e-12)
        assert w[p].sum().item() == pytest.approx(1.0, abs=1e-12)


def test_indicator_zeroes_prompt_without_bad_sample_and_does_not_renormalise():
    ref, old, _, _, mask = _inputs(P=2, N=3, T=2, seed=2)
    assert ORIGINAL_INDICATOR_THRESHOLD == pytest.approx(math.log(2e-16))
    # Original threshold: prompt 1 has no sample with exp(log phi) > 2e-16 -> all-zero weights, not uniform ones.
    phi = torch.tensor([[0.0, math.log(1e-16), -0.5], [math.log(1e-16)] * 3], dtype=ref.dtype)
    w = sigma_weights(ref, old, phi, mask, indicator_threshold=ORIGINAL_INDICATOR_THRESHOLD)
    assert torch.equal(w[1], torch.zeros(3, dtype=w.dtype))
    assert w[0, 1].item() == 0.0 and w[0].sum().item() == pytest.approx(1.0, abs=1e-12)
    # A threshold that drops a sample with a sizeable weight: the others keep their softmax values.
    phi = torch.tensor([[0.0, -2.0, -0.5], [-3.0, -4.0, -5.0]], dtype=ref.dtype)
    w_plain = sigma_weights(ref, old, phi, mask)
    w = sigma_weights(ref, old, phi, mask, indicator_threshold=-1.0)
    logw = _loop_seq_logw(ref, old, phi, mask)
    want = _softmax(logw[0])
    assert w[0, 0].item() == pytest.approx(want[0]) and w[0, 2].item() == pytest.approx(want[2])
    assert w[0, 1].item() == 0.0 and w_plain[0, 1].item() > 1e-3
    assert w[0].sum().item() == pytest.approx(1.0 - want[1])  # not renormalised
    assert torch.equal(w[1], torch.zeros(3, dtype=w.dtype))


def test_uniform_weights_and_all_neg_inf_prompt():
    ref, old, phi, _, mask = _inputs(P=2, N=4, T=2)
    w = sigma_weights(ref, old, phi, mask, uniform=True)
    torch.testing.assert_close(w, torch.full((2, 4), 0.25, dtype=w.dtype))
    phi2 = phi.clone()
    phi2[1] = -math.inf
    w2 = sigma_weights(ref, old, phi2, mask)
    assert torch.equal(w2[1], torch.zeros(4, dtype=w2.dtype))
    assert torch.isfinite(w2).all()


def test_weights_are_detached_fp32():
    ref, old, phi, v, mask = _inputs(dtype=torch.float32)
    ref16 = ref.to(torch.bfloat16).requires_grad_()
    vg = v.clone().requires_grad_()
    w = sigma_weights(ref16, old, phi.requires_grad_(), mask)
    u = per_step_weights(ref16, old, vg, mask)
    for x in (w, u):
        assert x.dtype == torch.float32
        assert not x.requires_grad


def test_per_step_log_weights_cumsum_matches_loop():
    ref, old, _, v, mask = _inputs(P=2, N=3, T=4, seed=3)
    got = per_step_log_weights(ref, old, v, mask)
    P, N, T = mask.shape
    for p in range(P):
        for i in range(N):
            acc = 0.0
            for t in range(T):
                if mask[p, i, t] != 0:
                    acc += ref[p, i, t].item() - old[p, i, t].item()
                    assert got[p, i, t].item() == pytest.approx(acc + v[p, i, t].item(), abs=1e-12)
                else:
                    assert got[p, i, t].item() == -math.inf


def test_per_step_weights_zero_on_padding_and_renormalised():
    ref, old, _, v, _ = _inputs(P=1, N=3, T=3, seed=4)
    mask = torch.tensor([[[1.0, 1, 1], [1.0, 0, 0], [1.0, 1, 0]]], dtype=ref.dtype)
    u = per_step_weights(_garbage(ref, mask), _garbage(old, mask), _garbage(v, mask), mask)
    for t in range(3):
        valid = [i for i in range(3) if mask[0, i, t] != 0]
        logs = []
        for i in valid:
            acc = sum(ref[0, i, k].item() - old[0, i, k].item() for k in range(t + 1))
            logs.append(acc + v[0, i, t].item())
        want = _softmax(logs)
        for i in range(3):
            if i in valid:
                assert u[0, i, t].item() == pytest.approx(want[valid.index(i)], abs=1e-12)
            else:
                assert u[0, i, t].item() == 0.0
        assert u[0, :, t].sum().item() == pytest.approx(1.0)


def test_per_step_weights_position_without_valid_sample_is_zero():
    ref, old, _, v, _ = _inputs(P=2, N=2, T=3, seed=5)
    mask = torch.tensor([[[1.0, 1, 0], [1.0, 0, 0]], [[1.0, 1, 1], [1.0, 1, 1]]], dtype=ref.dtype)
    u = per_step_weights(ref, old, v, mask)
    assert torch.equal(u[0, :, 2], torch.zeros(2, dtype=u.dtype))
    assert u[0, 0, 1].item() == 1.0
    torch.testing.assert_close(u[1].sum(0), torch.ones(3, dtype=u.dtype))


def test_flat_layout_is_one_group():
    ref, old, phi, v, mask = _inputs(P=1, N=4, T=3, seed=6)
    torch.testing.assert_close(sigma_weights(ref[0], old[0], phi[0], mask[0]), sigma_weights(ref, old, phi, mask)[0])
    torch.testing.assert_close(per_step_weights(ref[0], old[0], v[0], mask[0]), per_step_weights(ref, old, v, mask)[0])
    assert sigma_weights(ref[0], old[0], phi[0], mask[0]).shape == (4,)
    with pytest.raises(ValueError, match="log_phi"):
        sigma_weights(ref, old, phi[0], mask)


def test_garbage_in_masked_positions_and_no_mutation():
    ref, old, phi, v, mask = _inputs(P=2, N=3, T=4, seed=7)
    gref, gold, gv = _garbage(ref, mask), _garbage(old, mask), _garbage(v, mask)
    copies = [x.clone() for x in (gref, gold, gv, phi, mask)]
    torch.testing.assert_close(sigma_weights(gref, gold, phi, mask), sigma_weights(ref, old, phi, mask))
    u = per_step_weights(gref, gold, gv, mask)
    assert torch.isfinite(u).all()
    torch.testing.assert_close(u, per_step_weights(ref, old, v, mask))
    for before, after in zip(copies, (gref, gold, gv, phi, mask)):
        torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)


def test_effective_sample_size():
    w = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    torch.testing.assert_close(effective_sample_size(w), torch.tensor([4.0, 1.0, 0.0, 2.0]))
    u = torch.tensor([[[0.5, 1.0], [0.5, 0.0]]])  # (P=1, N=2, T=2), ESS over N per t
    torch.testing.assert_close(effective_sample_size(u, dim=-2), torch.tensor([[2.0, 1.0]]))
