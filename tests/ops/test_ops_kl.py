"""KL estimators: exact values on hand-computed inputs and Monte Carlo checks against exact categorical KLs."""

import math

import pytest
import torch

from trl_ext.ops import KL_ESTIMATORS, full_kl, kl_estimate, kl_k1, kl_k2, kl_k3

LOGP = torch.tensor([-1.0, -2.0, -0.25], dtype=torch.float64)
REF = torch.tensor([-1.5, -1.0, -0.25], dtype=torch.float64)
# logr = ref - logp = [-0.5, 1.0, 0.0]
EXPECTED = {
    "k1": [0.5, -1.0, 0.0],
    "k2": [0.125, 0.5, 0.0],
    "k3": [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1.0, 0.0],
}


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_hand_computed_values(estimator):
    out = kl_estimate(LOGP, REF, estimator=estimator)
    assert out.tolist() == pytest.approx(EXPECTED[estimator], abs=1e-12)
    fn = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}[estimator]
    assert fn(LOGP, REF).tolist() == pytest.approx(EXPECTED[estimator], abs=1e-12)


def test_unknown_estimator_lists_options():
    with pytest.raises(ValueError, match=r"k1, k2, k3"):
        kl_estimate(LOGP, REF, estimator="k4")


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_mask_zeroes_and_ignores_garbage(estimator):
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("-inf"), 3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = kl_estimate(logp, ref, estimator=estimator, mask=mask)
    assert torch.isfinite(out).all()
    assert (out[mask == 0] == 0).all()
    assert out[0, :2].tolist() == pytest.approx(EXPECTED[estimator][:2], abs=1e-6)
    assert out[1, 0].item() == 0.0
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[mask == 0] == 0).all()


def test_k2_k3_nonnegative_elementwise_and_k3_precise_near_zero():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(10_000, generator=g) * 3
    ref = torch.randn(10_000, generator=g) * 3
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp, ref, "k2") >= 0).all()
    # tiny log-ratio: k3 ≈ logr²/2 must not cancel to a negative number
    tiny = torch.tensor([1e-6, -1e-6], dtype=torch.float64)
    k3 = kl_k3(torch.zeros(2, dtype=torch.float64), tiny)
    assert (k3 > 0).all()
    assert k3.tolist() == pytest.approx([0.5e-12, 0.5e-12], rel=1e-5)


def _exact_kl(p, q):
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p.tolist(), q.tolist()) if pi > 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_monte_carlo_against_exact_categorical_kl(seed):
    g = torch.Generator().manual_seed(seed)
    V, n = 8, 200_000
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)
    exact = _exact_kl(p, q)
    samples = torch.multinomial(p, n, replacement=True, generator=g)
    logp, logq = p.log()[samples], q.log()[samples]
    for est in ("k1", "k3"):
        vals = kl_estimate(logp, logq, est)
        se = vals.std().item() / math.sqrt(n)
        assert abs(vals.mean().item() - exact) < 4 * se, (est, vals.mean().item(), exact, se)
    k3 = kl_estimate(logp, logq, "k3")
    assert (k3 >= 0).all()
    # k2 is biased: its sample mean matches its own exact expectation Σ p (log q - log p)² / 2, and it is >= 0
    k2 = kl_estimate(logp, logq, "k2")
    assert (k2 >= 0).all()
    k2_expect = sum(pi * 0.5 * (math.log(qi) - math.log(pi)) ** 2 for pi, qi in zip(p.tolist(), q.tolist()))
    assert abs(k2.mean().item() - k2_expect) < 4 * k2.std().item() / math.sqrt(n)


def test_full_kl_matches_loop_and_handles_zero_probabilities():
    g = torch.Generator().manual_seed(3)
    logits_p = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    logits_q = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    logits_p[0, 0, 1] = float("-inf")  # π(v) = 0: contributes 0 even though log π = -inf
    lp, lq = logits_p.log_softmax(-1), logits_q.log_softmax(-1)
    out = full_kl(lp, lq)
    for i in range(2):
        for j in range(3):
            assert out[i, j].item() == pytest.approx(_exact_kl(lp[i, j].exp(), lq[i, j].exp()), abs=1e-12)
    assert torch.allclose(full_kl(lp, lp), torch.zeros(2, 3, dtype=torch.float64))
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    masked = full_kl(lp, lq, mask=mask)
    assert (masked[mask == 0] == 0).all() and torch.equal(masked[mask == 1], out[mask == 1])


def test_inputs_not_modified():
    logp, ref = LOGP.clone(), REF.clone()
    for est in KL_ESTIMATORS:
        kl_estimate(logp, ref, est, mask=torch.tensor([1, 0, 1]))
    assert torch.equal(logp, LOGP) and torch.equal(ref, REF)
