"""Tests of trl_ext.losses.preference against closed forms computed with `math`."""

import math

import pytest
import torch

from trl_ext.losses import get_loss, get_loss_spec
from trl_ext.losses.preference import dpo_loss, ipo_loss, kto_loss, log_exp_loss, pairwise_loss, vanilla_kto_loss


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def t(values, grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


# ---------------------------------------------------------------------------------------------------- reward losses


def test_pairwise_loss_closed_form_and_metrics():
    rc, rr = [2.0, 0.0, -1.0], [1.0, 1.0, -1.0]
    out = pairwise_loss(t(rc), t(rr))
    expected = sum(-math.log(sig(c - r)) for c, r in zip(rc, rr)) / 3
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["accuracy"].item() == pytest.approx(1 / 3)  # ties do not count as correct
    assert out.metrics["margin"].item() == pytest.approx(0.0)
    assert out.metrics["chosen_rewards"].item() == pytest.approx(1 / 3)
    assert out.metrics["rejected_rewards"].item() == pytest.approx(1 / 3)


def test_pairwise_loss_margin():
    rc, rr, m = [2.0, 0.0, -1.0], [1.0, 1.0, -1.0], [0.5, 0.0, 1.0]
    expected = sum(-math.log(sig(c - r - mi)) for c, r, mi in zip(rc, rr, m)) / 3
    assert pairwise_loss(t(rc), t(rr), margin=t(m)).loss.item() == pytest.approx(expected)
    # a (B, 1) margin against (B,) rewards is reshaped, not broadcast to (B, B)
    assert pairwise_loss(t(rc), t(rr), margin=t(m).view(3, 1)).loss.item() == pytest.approx(expected)
    expected_scalar = sum(-math.log(sig(c - r - 0.5)) for c, r in zip(rc, rr)) / 3
    assert pairwise_loss(t(rc), t(rr), margin=0.5).loss.item() == pytest.approx(expected_scalar)
    with pytest.raises(ValueError, match="margin"):
        pairwise_loss(t(rc), t(rr), margin=t([1.0, 2.0]))


def test_log_exp_loss_closed_form_and_gradient():
    rc, rr = t([2.0, 0.0], grad=True), t([1.0, 1.5])
    out = log_exp_loss(rc, rr)
    expected = (math.log(1 + math.exp(1.0 - 2.0)) + math.log(1 + math.exp(1.5 - 0.0))) / 2
    assert out.loss.item() == pytest.approx(expected)
    out.loss.backward()
    # d/dr_c log(1 + exp(r_r - r_c)) = -sigmoid(r_r - r_c)
    assert rc.grad.tolist() == pytest.approx([-sig(-1.0) / 2, -sig(1.5) / 2])
    assert out.metrics["accuracy"].item() == pytest.approx(0.5)


def test_reward_losses_stable_for_large_gaps():
    rc, rr = t([-1000.0, 1000.0], grad=True), t([0.0, 0.0])
    for fn in (pairwise_loss, log_exp_loss):
        out = fn(rc, rr)
        assert out.loss.item() == pytest.approx(500.0)
        (g,) = torch.autograd.grad(out.loss, rc)
        assert torch.isfinite(g).all()


def test_reward_loss_shape_mismatch():
    with pytest.raises(ValueError, match="rejected_rewards"):
        pairwise_loss(t([1.0, 2.0]), t([1.0]))


# ------------------------------------------------------------------------------------------------------------- DPO

PC, PR, RC, RR = [-1.0, -2.0, -3.0], [-1.5, -1.0, -4.0], [-1.2, -2.0, -2.5], [-1.0, -1.5, -3.0]


def _deltas():
    return [(pc - rc) - (pr - rr) for pc, pr, rc, rr in zip(PC, PR, RC, RR)]


def test_dpo_sigmoid_closed_form_and_metrics():
    beta = 0.5
    out = dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=beta)
    expected = sum(-math.log(sig(beta * d)) for d in _deltas()) / 3
    assert out.loss.item() == pytest.approx(expected)
    cr = [beta * (pc - rc) for pc, rc in zip(PC, RC)]
    rj = [beta * (pr - rr) for pr, rr in zip(PR, RR)]
    m = out.metrics
    assert m["chosen_rewards"].item() == pytest.approx(sum(cr) / 3)
    assert m["rejected_rewards"].item() == pytest.approx(sum(rj) / 3)
    assert m["reward_accuracy"].item() == pytest.approx(sum(c > r for c, r in zip(cr, rj)) / 3)
    assert m["reward_margin"].item() == pytest.approx((sum(cr) - sum(rj)) / 3)
    assert m["chosen_logps"].item() == pytest.approx(sum(PC) / 3)
    assert m["rejected_logps"].item() == pytest.approx(sum(PR) / 3)


def test_dpo_label_smoothing_closed_form_and_gradient():
    beta, eps = 0.3, 0.2
    pc = t(PC, grad=True)
    out = dpo_loss(pc, t(PR), t(RC), t(RR), beta=beta, label_smoothing=eps)
    ds = _deltas()
    expected = sum(-(1 - eps) * math.log(sig(beta * d)) - eps * math.log(sig(-beta * d)) for d in ds) / 3
    assert out.loss.item() == pytest.approx(expected)
    out.loss.backward()
    # d/dΔ [-(1-ε) log σ(βΔ) - ε log σ(-βΔ)] = -β(1-ε)σ(-βΔ) + βε σ(βΔ), and dΔ/dπ_c = 1
    grads = [(-beta * (1 - eps) * sig(-beta * d) + beta * eps * sig(beta * d)) / 3 for d in ds]
    assert pc.grad.tolist() == pytest.approx(grads)


def test_ipo_closed_form():
    beta = 0.25
    expected = sum((d - 1 / (2 * beta)) ** 2 for d in _deltas()) / 3
    assert dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=beta, loss_type="ipo").loss.item() == pytest.approx(expected)
    out = ipo_loss(t(PC), t(PR), t(RC), t(RR), beta=beta)
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["reward_margin"].item() == pytest.approx(beta * sum(_deltas()) / 3)


def test_dpo_reference_gets_no_gradient_and_inputs_unchanged():
    tensors = [t(x, grad=True) for x in (PC, PR, RC, RR)]
    copies = [x.detach().clone() for x in tensors]
    dpo_loss(*tensors, label_smoothing=0.1).loss.backward()
    assert tensors[0].grad is not None and tensors[1].grad is not None
    assert tensors[2].grad is None and tensors[3].grad is None
    for x, c in zip(tensors, copies):
        assert torch.equal(x.detach(), c)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_type": "hinge"}, "loss_type"),
        ({"beta": 0.0}, "beta"),
        ({"label_smoothing": 0.7}, "label_smoothing"),
        ({"label_smoothing": -0.1}, "label_smoothing"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
    ],
)
def test_dpo_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpo_loss(t(PC), t(PR), t(RC), t(RR), **kwargs)


def test_dpo_shape_mismatch():
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        dpo_loss(t(PC), t(PR), t(RC), t(RR[:2]))


# ------------------------------------------------------------------------------------------------------------- KTO


def _kto_expected(pc, pr, rc, rr, kl, beta, wd=1.0, wu=1.0):
    losses = [wd * (1 - sig(beta * ((p - r) - kl))) for p, r in zip(pc, rc)]
    losses += [wu * (1 - sig(beta * (kl - (p - r)))) for p, r in zip(pr, rr)]
    return sum(losses) / len(losses)


def test_kto_closed_form_and_metrics():
    pc, rc = [-1.0, -2.0], [-1.5, -1.0]
    pr, rr = [-3.0, -1.0, -2.0], [-2.0, -1.2, -2.5]
    pkl, rkl = [-1.0, -2.0, -0.5], [-1.5, -3.0, -0.5]  # mean difference 0.5
    beta, wd, wu = 0.5, 1.5, 0.8
    policy_kl = t(pkl, grad=True)
    out = kto_loss(
        t(pc), t(pr), policy_kl, t(rc), t(rr), t(rkl), beta=beta, desirable_weight=wd, undesirable_weight=wu
    )
    assert out.loss.item() == pytest.approx(_kto_expected(pc, pr, rc, rr, 0.5, beta, wd, wu))
    assert out.metrics["kl"].item() == pytest.approx(0.5)
    assert out.metrics["rewards/chosen"].item() == pytest.approx(beta * ((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)
    assert out.metrics["rewards/rejected"].item() == pytest.approx(beta * (-1.0 + 0.2 + 0.5) / 3)
    assert out.metrics["count/chosen"].item() == 2 and out.metrics["count/rejected"].item() == 3
    assert not out.loss.requires_grad  # the KL reference point is detached: nothing else requires grad


def test_kto_negative_kl_is_clamped_and_kl_is_detached():
    pc, rc, pr, rr = [-1.0], [-1.5], [-2.0], [-1.0]
    policy_kl = t([-3.0, -4.0], grad=True)
    pct = t(pc, grad=True)
    out = kto_loss(pct, t(pr), policy_kl, t(rc), t(rr), t([-1.0, -1.0]), beta=1.0)
    assert out.metrics["kl"].item() == 0.0
    assert out.loss.item() == pytest.approx(_kto_expected(pc, pr, rc, rr, 0.0, 1.0))
    out.loss.backward()
    assert policy_kl.grad is None
    assert pct.grad is not None


def test_kto_without_kl_samples_uses_zero():
    pc, rc, pr, rr = [-1.0, 0.0], [-1.5, -0.5], [-2.0], [-1.0]
    out = kto_loss(t(pc), t(pr), None, t(rc), t(rr), None, beta=0.2)
    assert out.loss.item() == pytest.approx(_kto_expected(pc, pr, rc, rr, 0.0, 0.2))
    with pytest.raises(ValueError, match="ref_kl_logps"):
        kto_loss(t(pc), t(pr), t([0.0]), t(rc), t(rr), None)


@pytest.mark.parametrize("missing", ["desirable", "undesirable"])
def test_kto_one_group_empty_is_finite(missing):
    full_c, full_r = ([-1.0, -2.0], [-1.5, -1.0]), ([-3.0, -1.0], [-2.0, -1.2])
    (pc, rc), (pr, rr) = (([], []), full_r) if missing == "desirable" else (full_c, ([], []))
    pct, prt = t(pc, grad=True), t(pr, grad=True)
    out = kto_loss(pct, prt, t([-1.0, -1.0]), t(rc), t(rr), t([-1.2, -1.4]), beta=0.5)
    assert math.isfinite(out.loss.item())
    assert out.loss.item() == pytest.approx(_kto_expected(pc, pr, rc, rr, 0.3, 0.5))
    for value in out.metrics.values():
        assert torch.isfinite(value).all()
    out.loss.backward()
    assert torch.isfinite(pct.grad).all() and torch.isfinite(prt.grad).all()
    present = prt if missing == "desirable" else pct
    assert present.grad.abs().sum().item() > 0


def test_kto_both_groups_empty_gives_zero_loss_with_grad_path():
    pc, pr = t([], grad=True), t([], grad=True)
    out = kto_loss(pc, pr, t([0.0]), t([]), t([]), t([0.0]))
    assert out.loss.item() == 0.0
    assert out.loss.grad_fn is not None
    out.loss.backward()
    assert all(torch.isfinite(v).all() for v in out.metrics.values())


def test_kto_bad_options():
    x = t([-1.0])
    with pytest.raises(ValueError, match="beta"):
        kto_loss(x, x, None, x, x, None, beta=-1.0)
    with pytest.raises(ValueError, match="weight"):
        kto_loss(x, x, None, x, x, None, desirable_weight=-1.0)
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        kto_loss(t([-1.0, -2.0]), x, None, x, x, None)


def test_vanilla_kto_closed_form():
    pc, pr, rc, rr = [-1.0, -2.0], [-3.0, -1.0], [-1.5, -2.2], [-2.0, -1.8]
    beta = 0.4
    zc = [p - r for p, r in zip(pc, rc)]  # [0.5, 0.2] -> KL_c = 0.35
    zr = [p - r for p, r in zip(pr, rr)]  # [-1.0, 0.8] -> mean -0.1 -> KL_r = 0
    kl_c, kl_r = max(sum(zc) / 2, 0.0), max(sum(zr) / 2, 0.0)
    losses = [1 - sig(beta * (z - kl_r)) for z in zc] + [1 - sig(beta * (kl_c - z)) for z in zr]
    pct = t(pc, grad=True)
    out = vanilla_kto_loss(pct, t(pr), t(rc), t(rr), beta=beta)
    assert out.loss.item() == pytest.approx(sum(losses) / 4)
    assert out.metrics["kl_chosen"].item() == pytest.approx(0.35)
    assert out.metrics["kl_rejected"].item() == 0.0
    out.loss.backward()
    # reference point detached: d/dz_c (1 - σ(β(z_c - KL_r))) = -β σ(1 - σ) for each pair, over 4 terms
    assert pct.grad.tolist() == pytest.approx([-beta * sig(beta * z) * (1 - sig(beta * z)) / 4 for z in zc])
    with pytest.raises(ValueError, match="empty"):
        vanilla_kto_loss(t([]), t([]), t([]), t([]))


# --------------------------------------------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    "name, kind, fn",
    [
        ("pairwise", "reward", pairwise_loss),
        ("log_exp", "reward", log_exp_loss),
        ("dpo", "preference", dpo_loss),
        ("sigmoid", "preference", dpo_loss),
        ("ipo", "preference", ipo_loss),
        ("kto", "unpaired", kto_loss),
        ("vanilla_kto", "preference", vanilla_kto_loss),
    ],
)
def test_registry(name, kind, fn):
    assert get_loss(name, kind=kind) is fn
    assert get_loss_spec(name).kind == kind
