"""Reward shaping (`trl_ext.rewards.shaping`): every rm_type branch, the transforms and their order, against values
computed by hand."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from trl_ext.rewards import (
    INDICATOR_REWARD_EPS,
    REWARD_TRANSFORMS,
    RM_TYPES,
    RewardShaping,
    log_target_weight,
    map_reward,
    transform_reward,
)

LOG_EPS = -16 * math.log(10)  # log(1e-16) = -36.8413614879...


def test_constants():
    assert RM_TYPES == ("rlhf", "indicator_below_threshold", "toxicity_class_logprob")
    assert REWARD_TRANSFORMS == ("minus_alpha_exp_beta_r", "minus_alpha_indicator")
    assert INDICATOR_REWARD_EPS == 1e-16
    assert LOG_EPS == pytest.approx(-36.84136148790473)


def test_rlhf_cap_and_no_cap():
    raw = torch.tensor([1.0, 5.0, -3.0], dtype=torch.float64)
    capped = map_reward(raw, "rlhf", reward_cap=2.0)
    assert capped.dtype == torch.float32
    assert capped.tolist() == [1.0, 2.0, -3.0]
    uncapped = map_reward(raw)
    assert uncapped.tolist() == [1.0, 5.0, -3.0]
    uncapped[0] = 100.0  # a copy: the caller's tensor is untouched
    assert raw[0] == 1.0
    assert map_reward([0.5, 3.0], reward_cap=1.0).tolist() == [0.5, 1.0]  # lists are accepted


def test_indicator_below_threshold():
    raw = torch.tensor([-6.0, -5.0, 0.0, -5.0001])
    reward = map_reward(raw, "indicator_below_threshold", threshold=-5.0)
    assert reward.dtype == torch.float32
    assert reward[0].item() == 0.0  # bad: log(1 + 1e-16) is exactly 0 in fp32
    assert reward[3].item() == 0.0
    assert reward[1].item() == pytest.approx(LOG_EPS, abs=1e-4)  # r == threshold is not below it
    assert reward[2].item() == pytest.approx(-36.8414, abs=1e-4)


def test_toxicity_class_logprob():
    raw = torch.tensor([0.0, 2.0, -3.0])
    class0 = map_reward(raw, "toxicity_class_logprob")
    expected0 = [-math.log(2), -math.log(1 + math.e**2), -math.log(1 + math.e**-3)]  # -softplus(r)
    assert class0.tolist() == pytest.approx(expected0, abs=1e-6)
    assert class0.tolist() == pytest.approx(torch.log(1 - torch.sigmoid(raw)).tolist(), abs=1e-6)  # log P(toxic)
    class1 = map_reward(raw, "toxicity_class_logprob", toxicity_class=1)
    expected1 = [-math.log(2), -math.log(1 + math.e**-2), -math.log(1 + math.e**3)]  # logsigmoid(r)
    assert class1.tolist() == pytest.approx(expected1, abs=1e-6)
    # stable for large scores, where log(1 - sigmoid(r)) would give -inf
    assert map_reward(torch.tensor([50.0]), "toxicity_class_logprob").item() == pytest.approx(-50.0)


def test_log_target_weight_sign_convention():
    reward = torch.tensor([0.0, LOG_EPS, 2.0])
    assert log_target_weight(reward, -10.0).tolist() == pytest.approx([0.0, 368.413614879, -20.0], rel=1e-6)
    assert log_target_weight(reward, 0.0).tolist() == [0.0, 0.0, 0.0]
    # beta < 0: the target exp(beta * R) up-weights the lower reward
    weights = log_target_weight(torch.tensor([-1.0, 1.0]), -5.0)
    assert weights[0] > weights[1]
    with pytest.raises(ValueError, match="beta"):
        log_target_weight(reward, float("nan"))


def test_transforms_by_hand():
    raw = torch.tensor([0.0, 1.0, -2.0])
    exp_beta = transform_reward(raw, "minus_alpha_exp_beta_r", alpha=1.0, beta=-1.0)
    assert exp_beta.tolist() == pytest.approx([-1.0, 1 - math.exp(-1), -2 - math.exp(2)], abs=1e-6)
    scaled = transform_reward(raw, "minus_alpha_exp_beta_r", alpha=0.3, beta=-0.5)
    assert scaled.tolist() == pytest.approx([-0.3, 1 - 0.3 * math.exp(-0.5), -2 - 0.3 * math.e], abs=1e-6)
    indicator = transform_reward(torch.tensor([-6.0, -5.0, 3.0]), "minus_alpha_indicator", alpha=2.0)
    assert indicator.tolist() == [-8.0, -5.0, 3.0]  # default threshold -5, strict
    custom = transform_reward(torch.tensor([-4.5, -3.0]), "minus_alpha_indicator", alpha=1.0, threshold=-4.0)
    assert custom.tolist() == [-5.5, -3.0]
    same = transform_reward(raw, None, alpha=1.0)
    assert same.tolist() == raw.tolist() and same.data_ptr() != raw.data_ptr()


def test_reward_shaping_defaults():
    shaping = RewardShaping()
    raw = torch.tensor([1.0, -2.0])
    assert shaping.mapped(raw).tolist() == [1.0, -2.0]
    assert shaping.log_phi(raw).tolist() == [-1.0, 2.0]  # beta = -1
    assert shaping.transformed(raw).tolist() == [1.0, -2.0]


def test_reward_shaping_transform_uses_raw_score_and_beta_default():
    shaping = RewardShaping(beta=-1.0, transform="minus_alpha_exp_beta_r", transform_alpha=1.0)
    assert shaping.effective_transform_beta == -1.0
    raw = torch.tensor([0.0, 1.0, -2.0])
    assert shaping.transformed(raw).tolist() == pytest.approx([-1.0, 1 - math.exp(-1), -2 - math.exp(2)], abs=1e-6)
    assert shaping.log_phi(raw).tolist() == [0.0, -1.0, 2.0]  # the target never sees the transform
    own_beta = RewardShaping(beta=-10.0, transform="minus_alpha_exp_beta_r", transform_alpha=1.0, transform_beta=-1.0)
    assert own_beta.transformed(raw).tolist() == pytest.approx(shaping.transformed(raw).tolist())


def test_transform_comes_before_the_cap():
    shaping = RewardShaping(reward_cap=1.0, beta=-1.0, transform="minus_alpha_exp_beta_r", transform_alpha=1.0)
    # transform then cap: min(2 - e^-2, 1) = 1; cap then transform would give 1 - e^-1 = 0.632
    assert shaping.transformed(torch.tensor([2.0])).item() == 1.0
    assert shaping.transformed(torch.tensor([0.5])).item() == pytest.approx(0.5 - math.exp(-0.5))


def test_transform_comes_before_the_indicator():
    shaping = RewardShaping(
        rm_type="indicator_below_threshold",
        threshold=-5.0,
        beta=1.0,
        transform="minus_alpha_indicator",
        transform_alpha=10.0,
        transform_threshold=-4.0,
    )
    raw = torch.tensor([-4.5, -3.0])
    # -4.5 is below the transform threshold: -14.5, which the indicator then counts as bad (R = 0)
    assert shaping.transformed(raw).tolist() == pytest.approx([0.0, LOG_EPS], abs=1e-4)
    assert shaping.mapped(raw).tolist() == pytest.approx([LOG_EPS, LOG_EPS], abs=1e-4)
    assert shaping.log_phi(raw).tolist() == pytest.approx([LOG_EPS, LOG_EPS], abs=1e-4)


def test_indicator_beta_other_than_one_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="trl_ext.rewards.shaping"):
        RewardShaping(rm_type="indicator_below_threshold", threshold=-5.0, beta=2.0)
    assert "beta=2.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_ext.rewards.shaping"):
        RewardShaping(rm_type="indicator_below_threshold", threshold=-5.0, beta=1.0)
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rm_type": "toxicity"}, r"Unknown rm_type 'toxicity'; choose one of \('rlhf'"),
        ({"rm_type": "indicator_below_threshold", "beta": 1.0}, "needs `threshold`"),
        ({"rm_type": "indicator_below_threshold", "threshold": -5.0, "beta": -1.0}, "beta > 0"),
        ({"rm_type": "toxicity_class_logprob", "reward_cap": 3.0}, "reward_cap only applies"),
        ({"threshold": -5.0}, "threshold only applies"),
        ({"rm_type": "toxicity_class_logprob", "toxicity_class": 2}, "toxicity_class must be 0 or 1"),
        ({"transform": "log"}, "Unknown reward transform 'log'"),
        ({"transform": "minus_alpha_indicator"}, "needs transform_alpha"),
        ({"transform": "minus_alpha_indicator", "transform_alpha": -1.0}, ">= 0"),
        ({"transform_alpha": 1.0}, "transform is None"),
        ({"transform": "minus_alpha_indicator", "transform_alpha": 1.0, "transform_beta": -1.0}, "transform_beta"),
        ({"beta": float("inf")}, "finite"),
    ],
)
def test_reward_shaping_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardShaping(**kwargs)


def test_function_errors():
    raw = torch.tensor([0.0])
    with pytest.raises(ValueError, match="choose one of"):
        map_reward(raw, "sentiment")
    with pytest.raises(ValueError, match="needs `threshold`"):
        map_reward(raw, "indicator_below_threshold")
    with pytest.raises(ValueError, match="reward_cap only applies"):
        map_reward(raw, "indicator_below_threshold", threshold=0.0, reward_cap=1.0)
    with pytest.raises(ValueError, match="NaN"):
        map_reward(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="needs `beta`"):
        transform_reward(raw, "minus_alpha_exp_beta_r", alpha=1.0)
    with pytest.raises(ValueError, match=r"choose one of \('minus_alpha_exp_beta_r'"):
        transform_reward(raw, "minus_alpha_ind", alpha=1.0)
    with pytest.raises(ValueError, match="alpha"):
        transform_reward(raw, "minus_alpha_indicator", alpha=float("nan"))
