"""Tests of the twist (proposal) losses (trl_ext.losses.twist), against explicit Python loops."""

import itertools
import math

import pytest
import torch

from trl_ext.losses import get_loss, get_loss_spec
from trl_ext.losses.twist import ctl_loss, dpg_loss, mixed_ctl_value_loss, sixo_approx_loss, sixo_loss


def _batch(P=2, N=3, T=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(P, N, T, generator=g, dtype=dtype)
    phi = torch.randn(P, N, generator=g, dtype=dtype) * 2
    old = -torch.rand(P, N, T, generator=g, dtype=dtype) * 3
    ref = -torch.rand(P, N, T, generator=g, dtype=dtype) * 3
    lengths = torch.randint(1, T + 1, (P, N), generator=g)
    mask = (torch.arange(T)[None, None, :] < lengths[..., None]).to(dtype)
    return v, phi, mask, old, ref


def _softmax(xs):
    top = max(xs)
    es = [math.exp(x - top) for x in xs]
    return [e / sum(es) for e in es]


def _loop_w(phi, mask, old, ref, use_phi=True):
    P, N, T = mask.shape
    out = []
    for p in range(P):
        logs = []
        for i in range(N):
            s = phi[p, i].item() if use_phi else 0.0
            s += sum(ref[p, i, t].item() - old[p, i, t].item() for t in range(T) if mask[p, i, t] != 0)
            logs.append(s)
        out.append(_softmax(logs))
    return out


def _loop_u(v, mask, old, ref):
    P, N, T = mask.shape
    u = [[[0.0] * T for _ in range(N)] for _ in range(P)]
    for p in range(P):
        for t in range(T):
            valid = [i for i in range(N) if mask[p, i, t] != 0]
            if not valid:
                continue
            logs = [
                sum(ref[p, i, k].item() - old[p, i, k].item() for k in range(t + 1)) + v[p, i, t].item() for i in valid
            ]
            for i, x in zip(valid, _softmax(logs)):
                u[p][i][t] = x
    return u


def _loop_seq_token_mean(per_token, mask):
    P, N, T = mask.shape
    total = 0.0
    for p in range(P):
        for i in range(N):
            n = sum(1 for t in range(T) if mask[p, i, t] != 0)
            total += sum(per_token[p][i][t] for t in range(T) if mask[p, i, t] != 0) / n
    return total / (P * N)


def _logsig(x):
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def _garbage(x, mask):
    y = x.clone()
    fills = [math.inf, -math.inf, math.nan]
    for k, idx in enumerate((mask == 0).nonzero().tolist()):
        y[tuple(idx)] = fills[k % 3]
    return y


# ----------------------------------------------------------------------------------------------------------------
# CTL
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("second_term", [True, False])
def test_ctl_value_and_gradient_match_loop(second_term):
    v, phi, mask, old, ref = _batch(seed=1)
    v.requires_grad_()
    out = ctl_loss(v, phi, mask, old, ref, second_term=second_term)
    w = _loop_w(phi, mask, old, ref)
    u = _loop_u(v.detach(), mask, old, ref)
    coef = [[[w[p][i] - (u[p][i][t] if second_term else 0.0) for t in range(4)] for i in range(3)] for p in range(2)]
    per_token = [[[-coef[p][i][t] * v[p, i, t].item() for t in range(4)] for i in range(3)] for p in range(2)]
    assert out.loss.item() == pytest.approx(_loop_seq_token_mean(per_token, mask), rel=1e-9)
    out.loss.backward()
    for p in range(2):
        for i in range(3):
            n = int(mask[p, i].sum())
            for t in range(4):
                want = -coef[p][i][t] / (n * 2 * 3) if mask[p, i, t] else 0.0
                assert v.grad[p, i, t].item() == pytest.approx(want, abs=1e-12)
    assert set(out.metrics) >= {"ess", "max_weight"}


def test_ctl_no_second_term_registered_and_equal():
    v, phi, mask, old, ref = _batch(seed=2)
    want = ctl_loss(v, phi, mask, old, ref, second_term=False).loss
    for name in ("ctl_no_second_term", "ctl_nosecondterm"):
        assert get_loss_spec(name).kind == "twist"
        torch.testing.assert_close(get_loss(name)(v, phi, mask, old, ref).loss, want)
    assert get_loss("ctl", "twist") is ctl_loss


def test_ctl_weights_carry_no_gradient_to_constants():
    v, phi, mask, old, ref = _batch(seed=3)
    tensors = [x.clone().requires_grad_() for x in (v, phi, old, ref)]
    ctl_loss(tensors[0], tensors[1], mask, tensors[2], tensors[3]).loss.backward()
    assert tensors[0].grad is not None
    assert all(t.grad is None for t in tensors[1:])


def test_policy_psi_ctl_second_term_has_zero_expectation():
    """Enumerate every pair (N=2) of length-2 sequences over a 3-token vocabulary (81 tuples), weighted by q."""
    torch.manual_seed(0)
    V = 3
    q1 = torch.randn(V, dtype=torch.float64, requires_grad=True)  # q(s_1) logits
    q2 = torch.randn(V, V, dtype=torch.float64, requires_grad=True)  # q(s_2 | s_1) logits
    logp1 = torch.log_softmax(torch.randn(V, dtype=torch.float64), -1)
    logp2 = torch.log_softmax(torch.randn(V, V, dtype=torch.float64), -1)
    reward = torch.randn(V, V, dtype=torch.float64)
    beta = -2.0
    seqs = list(itertools.product(range(V), repeat=2))
    mask = torch.ones(1, 2, 2, dtype=torch.float64)
    exp_second = [torch.zeros_like(q1), torch.zeros_like(q2)]
    exp_first = [torch.zeros_like(q1), torch.zeros_like(q2)]
    total_prob, largest_single = 0.0, 0.0
    for pair in itertools.product(seqs, repeat=2):
        lq1, lq2 = torch.log_softmax(q1, -1), torch.log_softmax(q2, -1)
        logq = torch.stack([torch.stack([lq1[a], lq2[a, b]]) for a, b in pair]).unsqueeze(0)
        logp = torch.stack([torch.stack([logp1[a], logp2[a, b]]) for a, b in pair]).unsqueeze(0)
        prob = math.exp(logq.detach().sum().item())
        v = logq - logp.detach()  # policy_psi_q_p_s_t
        phi = torch.tensor([[beta * reward[a, b].item() for a, b in pair]], dtype=torch.float64)
        full = ctl_loss(v, phi, mask, logq.detach(), logp).loss
        first = ctl_loss(v, phi, mask, logq.detach(), logp, second_term=False).loss
        g_first = torch.autograd.grad(first, (q1, q2), retain_graph=True)
        g_second = torch.autograd.grad(full - first, (q1, q2))  # = grad of agg(u·v)
        for acc, g in zip(exp_second, g_second):
            acc += prob * g
            largest_single = max(largest_single, g.abs().max().item())
        total_prob += prob
        for acc, g in zip(exp_first, g_first):
            acc += prob * g
    assert total_prob == pytest.approx(1.0, abs=1e-12)
    assert largest_single > 1e-2  # each sampled second term is far from 0; only its expectation vanishes
    for acc in exp_second:
        assert acc.abs().max().item() < 1e-6
    assert max(acc.abs().max().item() for acc in exp_first) > 1e-3


# ----------------------------------------------------------------------------------------------------------------
# SIXO
# ----------------------------------------------------------------------------------------------------------------
def test_sixo_approx_matches_loop():
    v, phi, mask, old, ref = _batch(seed=4)
    w = _loop_w(phi, mask, old, ref)
    ut = _loop_w(phi, mask, old, ref, use_phi=False)
    pos = [[[w[p][i] * _logsig(v[p, i, t].item()) for t in range(4)] for i in range(3)] for p in range(2)]
    neg = [[[ut[p][i] * _logsig(-v[p, i, t].item()) for t in range(4)] for i in range(3)] for p in range(2)]
    want = -(_loop_seq_token_mean(pos, mask) + _loop_seq_token_mean(neg, mask))
    out = sixo_approx_loss(v, phi, mask, old, ref)
    assert out.loss.item() == pytest.approx(want, rel=1e-9)
    torch.testing.assert_close(sixo_loss(v, phi, mask, old, ref, variant="approx").loss, out.loss)
    assert get_loss("sixo_approxneg") is sixo_approx_loss
    assert get_loss_spec("sixo").kind == "twist"


def test_sixo_exact_matches_loop_and_uses_base_mask():
    v, phi, mask, old, ref = _batch(seed=5)
    base_v, _, base_mask, _, _ = _batch(P=2, N=4, T=3, seed=6)
    w = _loop_w(phi, mask, old, ref)
    pos = [[[w[p][i] * _logsig(v[p, i, t].item()) for t in range(4)] for i in range(3)] for p in range(2)]
    neg = [[[_logsig(-base_v[p, j, t].item()) / 3 for t in range(3)] for j in range(4)] for p in range(2)]
    want_neg = _loop_seq_token_mean(neg, base_mask)
    want = -(_loop_seq_token_mean(pos, mask) + want_neg)
    out = sixo_loss(v, phi, mask, old, ref, base_v=base_v, base_mask=base_mask)
    assert out.loss.item() == pytest.approx(want, rel=1e-9)
    assert out.metrics["neg_term"].item() == pytest.approx(want_neg, rel=1e-9)
    # garbage in the base samples' padding changes nothing
    out_g = sixo_loss(v, phi, mask, old, ref, base_v=_garbage(base_v, base_mask), base_mask=base_mask)
    torch.testing.assert_close(out_g.loss, out.loss)
    # a different q-sample mask leaves the negative term unchanged
    mask2 = mask.clone()
    mask2[:, :, 1:] = 0
    out2 = sixo_loss(v, phi, mask2, old, ref, base_v=base_v, base_mask=base_mask)
    assert out2.metrics["neg_term"].item() == pytest.approx(want_neg, rel=1e-12)
    with pytest.raises(ValueError, match="base_v"):
        sixo_loss(v, phi, mask, old, ref)


def test_sixo_uses_logsigmoid_for_large_twists():
    v, phi, mask, old, ref = _batch(seed=7, dtype=torch.float32)
    big = torch.where(torch.arange(4) % 2 == 0, 100.0, -100.0).expand(2, 3, 4).clone().requires_grad_()
    base = (-big.detach()).clone().requires_grad_()
    for out in (
        sixo_approx_loss(big, phi, mask, old, ref),
        sixo_loss(big, phi, mask, old, ref, base_v=base, base_mask=mask),
    ):
        assert torch.isfinite(out.loss)
        out.loss.backward()
        assert torch.isfinite(big.grad).all()
        big.grad = None
    assert torch.isfinite(base.grad).all()


# ----------------------------------------------------------------------------------------------------------------
# DPG
# ----------------------------------------------------------------------------------------------------------------
def test_dpg_matches_loop_value_and_gradient():
    P, N, T, V = 2, 2, 3, 4
    _, phi, mask, old, ref = _batch(P=P, N=N, T=T, seed=8)
    g = torch.Generator().manual_seed(9)
    psi_all = torch.randn(P, N, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    ref_all = torch.log_softmax(torch.randn(P, N, T, V, generator=g, dtype=torch.float64), -1)
    tokens = torch.randint(0, V, (P, N, T), generator=g)
    v = psi_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    out = dpg_loss(v, phi, mask, old, ref, log_psi_all=psi_all, ref_logprobs_all=ref_all)
    w = _loop_w(phi, mask, old, ref)
    per_token, probs = [], {}
    for p in range(P):
        per_token.append([])
        for i in range(N):
            per_token[p].append([])
            for t in range(T):
                pr = _softmax([ref_all[p, i, t, y].item() + psi_all[p, i, t, y].item() for y in range(V)])
                probs[p, i, t] = pr
                ev = sum(pr[y] * psi_all[p, i, t, y].item() for y in range(V))
                per_token[p][i].append(-w[p][i] * (v[p, i, t].item() - ev))
    assert out.loss.item() == pytest.approx(_loop_seq_token_mean(per_token, mask), rel=1e-9)
    out.loss.backward()
    for (p, i, t), pr in probs.items():
        n = int(mask[p, i].sum())
        for y in range(V):
            onehot = 1.0 if tokens[p, i, t].item() == y else 0.0
            want = -w[p][i] * (onehot - pr[y]) / (n * P * N) if mask[p, i, t] else 0.0
            assert psi_all.grad[p, i, t, y].item() == pytest.approx(want, abs=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# Mixed CTL + value
# ----------------------------------------------------------------------------------------------------------------
def test_mixed_ctl_value_is_alpha_ctl_plus_clipped_value():
    v, phi, mask, old, ref = _batch(seed=10)
    g = torch.Generator().manual_seed(11)
    values, old_values, returns = (torch.randn(2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out = mixed_ctl_value_loss(
        v, phi, mask, old, ref, values=values, old_values=old_values, returns=returns, alpha=0.3, cliprange_value=0.2
    )
    per_token = []
    for p in range(2):
        per_token.append([])
        for i in range(3):
            row = []
            for t in range(4):
                val, vo, ret = values[p, i, t].item(), old_values[p, i, t].item(), returns[p, i, t].item()
                clipped = vo + min(max(val - vo, -0.2), 0.2)
                row.append(0.5 * max((val - ret) ** 2, (clipped - ret) ** 2))
            per_token[p].append(row)
    want_value = _loop_seq_token_mean(per_token, mask)
    ctl = ctl_loss(v, phi, mask, old, ref).loss.item()
    assert out.metrics["value_loss"].item() == pytest.approx(want_value, rel=1e-9)
    assert out.loss.item() == pytest.approx(0.3 * ctl + want_value, rel=1e-9)
    assert get_loss_spec("mixed_ctl_value").kind == "twist"


# ----------------------------------------------------------------------------------------------------------------
# Robustness
# ----------------------------------------------------------------------------------------------------------------
def test_garbage_in_masked_positions_never_reaches_loss_and_inputs_not_mutated():
    P, N, T, V = 2, 3, 4, 5
    v, phi, mask, old, ref = _batch(P=P, N=N, T=T, seed=12)
    g = torch.Generator().manual_seed(13)
    psi_all = torch.randn(P, N, T, V, generator=g, dtype=torch.float64)
    ref_all = torch.log_softmax(torch.randn(P, N, T, V, generator=g, dtype=torch.float64), -1)
    mask4 = mask.unsqueeze(-1).expand(P, N, T, V)
    clean = {
        "ctl": ctl_loss(v, phi, mask, old, ref).loss,
        "sixo": sixo_loss(v, phi, mask, old, ref, base_v=v, base_mask=mask).loss,
        "sixo_approx": sixo_approx_loss(v, phi, mask, old, ref).loss,
        "dpg": dpg_loss(v, phi, mask, old, ref, log_psi_all=psi_all, ref_logprobs_all=ref_all).loss,
    }
    gv = _garbage(v, mask).requires_grad_()
    gold, gref = _garbage(old, mask), _garbage(ref, mask)
    gpsi = _garbage(psi_all, mask4).requires_grad_()
    gref_all = _garbage(ref_all, mask4)
    inputs = (gv, phi, mask, gold, gref, gpsi, gref_all)
    copies = [x.detach().clone() for x in inputs]
    outs = {
        "ctl": ctl_loss(gv, phi, mask, gold, gref),
        "sixo": sixo_loss(gv, phi, mask, gold, gref, base_v=gv, base_mask=mask),
        "sixo_approx": sixo_approx_loss(gv, phi, mask, gold, gref),
        "dpg": dpg_loss(gv, phi, mask, gold, gref, log_psi_all=gpsi, ref_logprobs_all=gref_all),
    }
    for name, out in outs.items():
        torch.testing.assert_close(out.loss, clean[name], msg=name)
        assert all(torch.isfinite(m).all() for m in out.metrics.values()), name
    sum(out.loss for out in outs.values()).backward()
    assert torch.isfinite(gv.grad).all() and (gv.grad[mask == 0] == 0).all()
    assert torch.isfinite(gpsi.grad).all() and (gpsi.grad[mask4 == 0] == 0).all()
    for before, after in zip(copies, inputs):
        torch.testing.assert_close(after.detach(), before, rtol=0, atol=0, equal_nan=True)


def test_flat_batch_is_one_group_and_shape_errors():
    v, phi, mask, old, ref = _batch(P=1, N=4, T=3, seed=14)
    torch.testing.assert_close(
        ctl_loss(v[0], phi[0], mask[0], old[0], ref[0]).loss, ctl_loss(v, phi, mask, old, ref).loss
    )
    with pytest.raises(ValueError, match="old_logprobs"):
        ctl_loss(v, phi, mask, old[..., :2], ref)
    with pytest.raises(ValueError, match="log_phi"):
        ctl_loss(v, phi[:, :2], mask, old, ref)
