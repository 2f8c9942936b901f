"""Tests of trl_ext.losses.ppo against values computed by hand (closed forms and explicit loops)."""

import math

import pytest
import torch

from trl_ext.losses import get_loss, get_loss_spec
from trl_ext.losses.ppo import clipped_value_loss, ppo_policy_loss

NAN, INF = float("nan"), float("inf")


def _lp(ratios):
    """log-probs (and zero old log-probs) giving the requested ratios."""
    return torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)


# ------------------------------------------------------------------------------------------------------ policy loss


def _four_cases():
    # (ratio, advantage): clipped above, unclipped, unclipped, clipped below
    ratios = [1.5, 0.5, 1.5, 0.5]
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    logprobs = _lp(ratios).requires_grad_(True)
    old = torch.zeros_like(logprobs)
    mask = torch.ones_like(adv)
    return logprobs, old, adv, mask


def test_ppo_branch_selection_and_clipfrac():
    logprobs, old, adv, mask = _four_cases()
    out = ppo_policy_loss(logprobs, old, adv, mask, cliprange=0.2)
    # per token: max(-rA, -clip(r)A): [max(-1.5,-1.2), max(-0.5,-0.8), max(1.5,1.2), max(0.5,0.8)]
    expected = [-1.2, -0.5, 1.5, 0.8]
    assert out.loss.item() == pytest.approx(sum(expected) / 4)
    assert out.metrics["clipfrac"].item() == pytest.approx(0.5)
    assert out.metrics["ratio"].item() == pytest.approx((1.5 + 0.5 + 1.5 + 0.5) / 4)
    kl = 0.5 * sum(math.log(r) ** 2 for r in [1.5, 0.5, 1.5, 0.5]) / 4
    assert out.metrics["approxkl"].item() == pytest.approx(kl)
    assert "dual_clipfrac" not in out.metrics
    assert out.loss.requires_grad and not out.metrics["clipfrac"].requires_grad


def test_ppo_gradient_zero_for_clipped_tokens():
    logprobs, old, adv, mask = _four_cases()
    ppo_policy_loss(logprobs, old, adv, mask, cliprange=0.2).loss.backward()
    # unclipped tokens: d(-A r)/d log pi = -A r, divided by the 4 tokens of the sequence
    expected = [0.0, -1.0 * 0.5 / 4, 1.0 * 1.5 / 4, 0.0]
    assert logprobs.grad[0].tolist() == pytest.approx(expected)


def test_ppo_on_policy_tie_gives_full_gradient():
    logprobs = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.float64)
    out = ppo_policy_loss(logprobs, torch.zeros_like(logprobs), adv, torch.ones_like(adv))
    out.loss.backward()
    assert out.metrics["clipfrac"].item() == 0.0
    assert logprobs.grad[0].tolist() == pytest.approx([-2.0 / 3, 1.0 / 3, -0.5 / 3])


def test_ppo_dual_clip():
    ratios = [1.5, 0.5, 3.0, 0.5, 1.5]
    logprobs = _lp(ratios).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0, -1.0]], dtype=torch.float64)
    out = ppo_policy_loss(
        logprobs, torch.zeros_like(logprobs), adv, torch.ones_like(adv), cliprange=0.2, dual_clip=1.3
    )
    # plain PPO: [-1.2, -0.5, 6.0, 0.8, 1.5]; for A<0 cap at -cA: token 2 -> 2.6, token 4 -> 1.3, token 3 stays 0.8
    expected = [-1.2, -0.5, 2.6, 0.8, 1.3]
    assert out.loss.item() == pytest.approx(sum(expected) / 5)
    assert out.metrics["dual_clipfrac"].item() == pytest.approx(2 / 5)
    assert out.metrics["clipfrac"].item() == pytest.approx(2 / 5)  # tokens 0 and 3
    out.loss.backward()
    # only token 1 (unclipped, A>0) has a gradient: -A r / 5
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -0.5 / 5, 0.0, 0.0, 0.0])


def test_ppo_dual_clip_not_applied_to_positive_advantages():
    logprobs = _lp([5.0])
    adv = torch.tensor([[1.0]], dtype=torch.float64)
    out = ppo_policy_loss(logprobs, torch.zeros_like(logprobs), adv, torch.ones_like(adv), dual_clip=2.0)
    assert out.loss.item() == pytest.approx(-1.2)
    assert out.metrics["dual_clipfrac"].item() == 0.0


def _ragged():
    # ratio 1 everywhere, so the per-token loss is -A; garbage where the mask is 0
    adv = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, INF, -INF, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    logprobs = torch.tensor([[0.0, 0.0, 0.0, NAN], [0.0, INF, NAN, -INF]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, INF], [0.0, NAN, -INF, NAN]], dtype=torch.float64)
    return logprobs, old, adv, mask


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("seq-mean-token-mean", ((-1 - 2 - 3) / 3 + -4) / 2),  # -3
        ("seq-mean-token-sum", ((-1 - 2 - 3) + -4) / 2),  # -5
        ("token-mean", (-1 - 2 - 3 - 4) / 4),  # -2.5
    ],
)
def test_ppo_aggregation_modes_on_ragged_mask_with_garbage(mode, expected):
    logprobs, old, adv, mask = _ragged()
    out = ppo_policy_loss(logprobs, old, adv, mask, aggregation=mode)
    assert out.loss.item() == pytest.approx(expected)
    for value in out.metrics.values():
        assert torch.isfinite(value).all()
    assert out.metrics["ratio"].item() == pytest.approx(1.0)
    out.loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[mask == 0].abs().sum().item() == 0.0


def _random_batch(seed=0, shape=(4, 5)):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(shape, generator=g, dtype=torch.float64)
    old = logprobs + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    lengths = [5, 2, 4, 1]
    mask = torch.tensor([[1 if t < n else 0 for t in range(shape[1])] for n in lengths])
    return logprobs, old, adv, mask


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"])
def test_ppo_normalizer_micro_batches_sum_to_full_batch(mode):
    logprobs, old, adv, mask = _random_batch()
    full = ppo_policy_loss(logprobs, old, adv, mask, aggregation=mode, dual_clip=2.0).loss
    norm = mask.sum() if mode == "token-mean" else mask.shape[0]
    parts = [
        ppo_policy_loss(logprobs[s], old[s], adv[s], mask[s], aggregation=mode, normalizer=norm, dual_clip=2.0).loss
        for s in (slice(0, 1), slice(1, 4))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12)


def test_ppo_matches_explicit_loop():
    logprobs, old, adv, mask = _random_batch(seed=3)
    eps = 0.15
    out = ppo_policy_loss(logprobs, old, adv, mask, cliprange=eps, aggregation="token-mean")
    total, n, clipped = 0.0, 0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(logprobs[i, t].item() - old[i, t].item())
            a = adv[i, t].item()
            unc, clp = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
            total += max(unc, clp)
            clipped += clp > unc
            n += 1
    assert out.loss.item() == pytest.approx(total / n)
    assert out.metrics["clipfrac"].item() == pytest.approx(clipped / n)


def test_ppo_does_not_mutate_inputs():
    logprobs, old, adv, mask = _ragged()
    copies = [x.detach().clone() for x in (logprobs, old, adv, mask)]
    ppo_policy_loss(logprobs, old, adv, mask, dual_clip=3.0).loss.backward()
    for x, c in zip((logprobs, old, adv, mask), copies):
        torch.testing.assert_close(x.detach(), c, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cliprange": 0.0}, "cliprange"),
        ({"cliprange": -0.1}, "cliprange"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"aggregation": "sum"}, "aggregation"),
    ],
)
def test_ppo_bad_options(kwargs, match):
    logprobs, old, adv, mask = _random_batch()
    with pytest.raises(ValueError, match=match):
        ppo_policy_loss(logprobs, old, adv, mask, **kwargs)


def test_ppo_shape_mismatch():
    logprobs, old, adv, mask = _random_batch()
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(logprobs, old, adv[:, :3], mask)


# ------------------------------------------------------------------------------------------------------- value loss


def _value_cases():
    values = torch.tensor([[1.0, 1.0, 0.6]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64)
    returns = torch.tensor([[0.0, 2.0, 0.0]], dtype=torch.float64)
    return values, old, returns, torch.ones(1, 3)


def test_value_loss_clipping_cases():
    values, old, returns, mask = _value_cases()
    out = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # token 0: V_clip=0.7, max(1, 0.49)=1 ; token 1: V_clip=0.7, max(1, 1.69)=1.69 ; token 2: inside, 0.36
    expected = [0.5 * 1.0, 0.5 * 1.69, 0.5 * 0.36]
    assert out.loss.item() == pytest.approx(sum(expected) / 3)
    assert out.metrics["clipfrac"].item() == pytest.approx(1 / 3)
    assert out.metrics["value_mean"].item() == pytest.approx((1.0 + 1.0 + 0.6) / 3)
    assert out.metrics["error"].item() == pytest.approx((1.0 + 1.0 + 0.36) / 3)
    out.loss.backward()
    # d 0.5(V-G)^2 / dV = V - G for unclipped tokens; 0 for the clipped one
    assert values.grad[0].tolist() == pytest.approx([1.0 / 3, 0.0, 0.6 / 3])


def test_value_loss_without_clipping():
    values, old, returns, mask = _value_cases()
    out = clipped_value_loss(values, None, returns, mask, cliprange_value=None)
    assert out.loss.item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.36) / 3)
    assert out.metrics["clipfrac"].item() == 0.0


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("seq-mean-token-mean", (0.5 * (1 + 4) / 2 + 0.5 * 9) / 2),
        ("seq-mean-token-sum", (0.5 * (1 + 4) + 0.5 * 9) / 2),
        ("token-mean", 0.5 * (1 + 4 + 9) / 3),
    ],
)
def test_value_loss_aggregation_with_garbage(mode, expected):
    values = torch.tensor([[1.0, 2.0, NAN], [3.0, INF, -INF]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[1.0, 2.0, INF], [3.0, NAN, NAN]], dtype=torch.float64)  # no clipping where valid
    returns = torch.tensor([[0.0, 0.0, NAN], [0.0, 1.0, INF]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    copies = [x.detach().clone() for x in (values, old, returns, mask)]
    out = clipped_value_loss(values, old, returns, mask, aggregation=mode)
    assert out.loss.item() == pytest.approx(expected)
    assert all(torch.isfinite(v).all() for v in out.metrics.values())
    out.loss.backward()
    assert torch.isfinite(values.grad).all()
    for x, c in zip((values, old, returns, mask), copies):
        torch.testing.assert_close(x.detach(), c, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"])
def test_value_loss_normalizer_micro_batches(mode):
    logprobs, old, adv, mask = _random_batch(seed=5)
    full = clipped_value_loss(logprobs, old, adv, mask, aggregation=mode).loss
    norm = mask.sum().item() if mode == "token-mean" else 4.0
    total = sum(
        clipped_value_loss(logprobs[s], old[s], adv[s], mask[s], aggregation=mode, normalizer=norm).loss
        for s in (slice(0, 2), slice(2, 4))
    )
    assert total.item() == pytest.approx(full.item(), rel=1e-12)


def test_value_loss_bad_options():
    values, old, returns, mask = _value_cases()
    with pytest.raises(ValueError, match="cliprange_value"):
        clipped_value_loss(values, old, returns, mask, cliprange_value=0.0)
    with pytest.raises(ValueError, match="old_values"):
        clipped_value_loss(values, None, returns, mask)
    with pytest.raises(ValueError, match="returns"):
        clipped_value_loss(values, old, returns[:, :2], mask)


# --------------------------------------------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    "name, kind, fn",
    [
        ("ppo", "policy", ppo_policy_loss),
        ("clipped_surrogate", "policy", ppo_policy_loss),
        ("clipped_value", "value", clipped_value_loss),
        ("value", "value", clipped_value_loss),
    ],
)
def test_registry(name, kind, fn):
    assert get_loss(name) is fn
    assert get_loss(name, kind=kind) is fn
    assert get_loss_spec(name).kind == kind


def test_registry_wrong_kind():
    with pytest.raises(ValueError, match="policy"):
        get_loss("clipped_value", kind="policy")
