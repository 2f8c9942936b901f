"""Advantage estimators (`trl_ext.ops.advantages`): GAE and discounted returns against plain nested-loop references,
the critic-free sequence advantages and the importance-sampling correction against their formulas."""

import math

import pytest
import torch

from trl_ext.ops import discounted_returns, gae_advantages


def _gae_loop(rewards, values, mask, gamma, lam):
    """Per row, per step reference: bootstrap from the next valid value, stop at the end of the valid block."""
    B, T = rewards.shape
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        last_adv = 0.0
        for t in reversed(range(T)):
            if not mask[b, t]:
                last_adv = 0.0
                continue
            next_valid = t + 1 < T and bool(mask[b, t + 1])
            next_v = float(values[b, t + 1]) if next_valid else 0.0
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            last_adv = delta + gamma * lam * (last_adv if next_valid else 0.0)
            adv[b][t] = last_adv
    adv = torch.tensor(adv, dtype=torch.float64)
    returns = torch.where(mask.bool(), adv + values, torch.zeros_like(adv))
    return adv, returns


def _returns_loop(rewards, mask, gamma):
    B, T = rewards.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        valid = [t for t in range(T) if mask[b, t]]
        for t in valid:
            out[b, t] = sum(gamma ** (k - t) * float(rewards[b, k]) for k in valid if k >= t)
    return out


def _ragged(seed, B=6, T=9, side="right"):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, T - n :] = 1
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
@pytest.mark.parametrize("side", ["right", "left"])
def test_gae_matches_loop(gamma, lam, side):
    rewards, values, mask = _ragged(seed=int(gamma * 100 + lam * 10), side=side)
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    adv_ref, ret_ref = _gae_loop(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, adv_ref, atol=1e-12)
    assert torch.allclose(ret, ret_ref, atol=1e-12)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_gae_hand_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0.5, 0.4, 0.3, 0.0])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0, 0.0])
    # λ = 0: one-step TD errors δ_t = r_t + γ V_{t+1} − V_t
    adv0, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.0)
    assert adv0.tolist()[0] == pytest.approx([0.3 - 0.5, 0.35 - 0.6, 1.0 - 0.7, 0.0])


def test_gamma_lam_one_gives_returns_to_go_minus_values():
    rewards, values, mask = _ragged(seed=11)
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    rtg = _returns_loop(rewards, mask, 1.0)
    assert torch.allclose(adv, torch.where(mask.bool(), rtg - values, torch.zeros_like(rtg)), atol=1e-12)
    assert torch.allclose(ret, rtg, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("side", ["right", "left"])
def test_discounted_returns_matches_closed_form(gamma, side):
    rewards, _, mask = _ragged(seed=12, side=side)
    out = discounted_returns(rewards, mask, gamma=gamma)
    assert torch.allclose(out, _returns_loop(rewards, mask, gamma), atol=1e-12)


def test_garbage_in_masked_positions_is_ignored_and_inputs_unchanged():
    rewards, values, mask = _ragged(seed=13)
    r, v = rewards.clone(), values.clone()
    r[mask == 0] = float("nan")
    v[mask == 0] = float("inf")
    r0, v0 = r.clone(), v.clone()
    adv, ret = gae_advantages(r, v, mask, gamma=0.99, lam=0.95)
    adv_ref, ret_ref = _gae_loop(rewards, values, mask, 0.99, 0.95)
    assert torch.allclose(adv, adv_ref) and torch.allclose(ret, ret_ref)
    assert torch.allclose(discounted_returns(r, mask), _returns_loop(rewards, mask, 1.0))
    assert torch.equal(r.nan_to_num(), r0.nan_to_num()) and torch.equal(v.nan_to_num(), v0.nan_to_num())


def test_left_and_right_padding_agree():
    rewards, values, mask = _ragged(seed=14)
    T = mask.shape[1]
    lengths = mask.sum(1)
    # move each row's valid block to the right end
    idx = (torch.arange(T) - (T - lengths).unsqueeze(1)) % T
    shift = lambda x: x.gather(1, idx)  # noqa: E731
    adv_r, _ = gae_advantages(rewards, values, mask, gamma=0.97, lam=0.9)
    adv_l, _ = gae_advantages(shift(rewards), shift(values), shift(mask), gamma=0.97, lam=0.9)
    assert torch.allclose(shift(adv_r), adv_l, atol=1e-12)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        discounted_returns(torch.zeros(3), torch.ones(3))


# ------------------------------------------------------------------ critic-free advantages and the vLLM correction
def test_sequence_advantages_are_each_return_minus_its_prompts_leave_one_out_mean_on_every_token():
    from trl_ext.ops.advantages import sequence_advantages

    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [2.0, 0.0, 0.0], [0.0, 4.0, 0.0]])
    score_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    response_mask = score_mask
    # returns over the score mask: 1, 3 (prompt 0), 2, 4 (prompt 1); rloo with N = 2: the other sample's return
    got = sequence_advantages(rewards, score_mask, response_mask, 2, "rloo")
    want = torch.tensor([1.0 - 3.0, 3.0 - 1.0, 2.0 - 4.0, 4.0 - 2.0])[:, None] * response_mask
    torch.testing.assert_close(got, want)
    constant = sequence_advantages(rewards, score_mask, response_mask, 2, "hardcoded", 0.5)
    torch.testing.assert_close(constant, (torch.tensor([1.0, 3.0, 2.0, 4.0]) - 0.5)[:, None] * response_mask)


def test_importance_corrected_advantages_weigh_by_the_clipped_ratio_and_report_it():
    from trl_ext.ops.advantages import importance_corrected_advantages

    advantages = torch.ones(2, 3)
    train = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.2, 0.2]]))
    engine = torch.log(torch.tensor([[0.25, 0.5, 1.0], [0.2, 0.1, 0.2]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    same, stats = importance_corrected_advantages(advantages, train, None, mask, correct=True)
    assert same is advantages and stats == {}
    same, stats = importance_corrected_advantages(advantages, train, engine, mask, correct=False)
    assert same is advantages and set(stats) == {"logprob_diff"}
    diffs = torch.tensor([math.log(2), 0.0, math.log(2), 0.0, math.log(2)])
    assert stats["logprob_diff"] == pytest.approx(float(diffs.mean()), rel=1e-6)
    got, stats = importance_corrected_advantages(advantages, train, engine, mask, correct=True, clip_max=1.5)
    ratio = torch.tensor([[2.0, 1.0, 0.5], [1.0, 2.0, 0.0]]).clamp(max=1.5) * mask
    torch.testing.assert_close(got, ratio)
    assert stats["is_weight_mean"] == pytest.approx(float(ratio.sum() / mask.sum()), rel=1e-6)


def test_the_old_trainer_side_correction_warns_and_gives_the_same_advantages():
    from types import SimpleNamespace

    from trl_ext.ops.advantages import importance_corrected_advantages
    from trl_ext.trainers.common.metrics import OnlineMetrics
    from trl_ext.trainers.common.vllm_setup import importance_corrected_advantages as old

    train = torch.log(torch.tensor([[0.5, 0.4]]))
    rollout = SimpleNamespace(logprobs=train, engine_logprobs=train - 0.3, response_mask=torch.ones(1, 2))
    args = SimpleNamespace(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
                           vllm_importance_sampling_clip_max=2.0, vllm_importance_sampling_clip_min=None)  # fmt: skip
    metrics = OnlineMetrics()
    with pytest.warns(DeprecationWarning, match="moved to trl_ext.ops.advantages"):
        got = old(args, rollout, torch.ones(1, 2), metrics)
    want, _ = importance_corrected_advantages(torch.ones(1, 2), train, train - 0.3, torch.ones(1, 2), correct=True,
                                              clip_max=2.0)  # fmt: skip
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, torch.full((1, 2), math.exp(0.3)))
