"""Frontier metrics (`trl_ext.eval.metrics`) against hand-computed values: P̂(r < τ), CVaR, t-intervals, bootstrap
coverage, the report layout and its round trip through JSON, and the negative-data group summaries."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from trl_ext.eval.metrics import (
    FrontierMetrics,
    cvar,
    frontier_metrics,
    group_logprob_summary,
    metric_key,
    num_worst,
    t_interval,
    t_quantile,
    tail_probability,
)
from trl_ext.eval.report import binomial_ci, bootstrap_ci, write_json_report

REWARDS = [3.0, -1.0, -1.0, 2.0, -7.0, 0.0, 5.0, -1.0, 4.0, 1.0]


# ------------------------------------------------------------------------------------------------ P̂ and CVaR
def test_tail_probability_is_strict_fraction_below_threshold():
    rewards = [-6.0, -5.0, -5.0, -4.0, 0.0]
    assert tail_probability(rewards, -5.0) == pytest.approx(1 / 5)  # -5 itself is not below -5
    assert tail_probability(rewards, -4.5) == pytest.approx(3 / 5)
    assert tail_probability(rewards, 0.0) == pytest.approx(4 / 5)
    assert tail_probability(rewards, -10.0) == 0.0
    assert tail_probability(torch.tensor(rewards), 1.0) == 1.0


@pytest.mark.parametrize(
    ("alpha", "expected"),
    [
        (0.3, (-7 - 1 - 1) / 3),  # k = 3: the worst three
        (0.4, (-7 - 1 - 1 - 1) / 4),  # k = 4: three tied -1's, all inside the cut
        (0.2, (-7 - 1) / 2),  # k = 2: one of the tied -1's, whichever
        (0.05, -7.0),  # α·n = 0.5 < 1: the minimum
        (1.0, sum(REWARDS) / 10),  # α = 1: the mean
    ],
)
def test_cvar_is_mean_of_worst_floor_alpha_n(alpha, expected):
    assert cvar(REWARDS, alpha) == pytest.approx(expected)
    assert cvar(np.array(REWARDS), alpha) == pytest.approx(expected)


def test_cvar_single_value_and_float_guard():
    assert cvar([2.5], 0.01) == 2.5
    assert num_worst(100, 0.29) == 29  # 0.29 * 100 = 28.999999999999996 in floating point
    assert num_worst(10, 0.05) == 1
    rewards = np.arange(100, dtype=float)
    assert cvar(rewards, 0.29) == pytest.approx(np.arange(29).mean())


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_cvar_rejects_alpha_outside_unit_interval(alpha):
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        cvar(REWARDS, alpha)


def test_bad_reward_arrays_raise():
    with pytest.raises(ValueError, match="empty"):
        cvar([], 0.1)
    with pytest.raises(ValueError, match="NaN"):
        tail_probability([0.0, float("nan")], 0.0)
    with pytest.raises(ValueError, match="1-D"):
        tail_probability(np.zeros((2, 3)), 0.0)
    assert tail_probability(np.zeros((4, 1)) - 1, 0.0) == 1.0  # a column is fine


# ------------------------------------------------------------------------------------------------ t intervals
@pytest.mark.parametrize(
    ("confidence", "df", "expected"),
    [
        (0.95, 1, 12.706205),
        (0.95, 2, 4.302653),
        (0.95, 4, 2.776445),
        (0.95, 9, 2.262157),
        (0.95, 30, 2.042272),
        (0.99, 5, 4.032143),
        (0.90, 3, 2.353363),
    ],
)
def test_t_quantile_matches_table(confidence, df, expected):
    assert t_quantile(confidence, df) == pytest.approx(expected, abs=2e-6)


def test_t_interval_hand_computed():
    mean, low, high = t_interval([1.0, 2.0, 3.0])  # s = 1, n = 3
    half = 4.302653 / math.sqrt(3)
    assert mean == 2.0
    assert (low, high) == pytest.approx((2.0 - half, 2.0 + half), abs=1e-5)
    assert t_interval([4.0]) == (4.0, 4.0, 4.0)  # one seed: the point
    assert t_interval([1.5, 1.5, 1.5]) == (1.5, 1.5, 1.5)  # no spread: zero width
    with pytest.raises(ValueError, match="confidence"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df"):
        t_quantile(0.95, 0)


# ------------------------------------------------------------------------------------------------ frontier_metrics
def test_bootstrap_ci_of_the_mean_covers_the_true_mean():
    covered = 0
    for seed in range(100):
        x = np.random.default_rng(seed).normal(1.0, 2.0, size=60)
        low, high = frontier_metrics(x, thresholds=(0.0,), cvar_alphas=(1.0,), num_resamples=300, seed=seed)["reward"][
            "ci"
        ]
        covered += low <= 1.0 <= high
    assert covered >= 90, f"the 95% interval covered the true mean in only {covered} of 100 samples"


def test_constant_sample_has_zero_width_intervals():
    metrics = frontier_metrics(np.full(20, -2.0), returns=np.full(20, -3.0), num_resamples=50)
    assert metrics["reward"] == {"value": -2.0, "ci": [-2.0, -2.0]}
    assert metrics["return"] == {"value": -3.0, "ci": [-3.0, -3.0]}
    for entry in metrics["cvar"].values():
        assert entry["value"] == entry["ci"][0] == entry["ci"][1] == -2.0


def test_frontier_metrics_values_and_layout():
    rewards = np.array(REWARDS)
    returns = rewards - 0.5
    entropies = np.linspace(1, 2, 10)
    metrics = frontier_metrics(
        rewards,
        returns=returns,
        entropies=entropies,
        thresholds=(-5, -1, 0),
        cvar_alphas=(0.1, 0.3),
        num_resamples=200,
    )
    assert metrics["num_samples"] == 10 and metrics["confidence"] == 0.95
    assert metrics["reward"]["value"] == pytest.approx(rewards.mean())
    assert metrics["return"]["value"] == pytest.approx(rewards.mean() - 0.5)
    assert metrics["entropy"]["value"] == pytest.approx(1.5)
    assert metrics["kl"] is None
    assert set(metrics["p_bad"]) == {"-5.0", "-1.0", "0.0"} and set(metrics["cvar"]) == {"0.1", "0.3"}
    assert metrics["p_bad"]["-1.0"]["value"] == pytest.approx(0.1) and metrics["p_bad"]["-1.0"]["count"] == 1
    assert metrics["p_bad"]["0.0"]["value"] == pytest.approx(0.4)
    assert metrics["p_bad"]["0.0"]["ci"] == pytest.approx(list(binomial_ci(4, 10)))  # Wilson by default
    assert metrics["p_bad"]["0.0"]["log"] == pytest.approx(math.log(0.4))
    assert metrics["cvar"]["0.3"] == {
        "value": pytest.approx(-3.0),
        "ci": pytest.approx(list(bootstrap_ci(rewards, lambda x: cvar(x, 0.3), num_resamples=200))),
        "num_worst": 3,
    }
    low, high = metrics["reward"]["ci"]
    assert low < rewards.mean() < high
    assert "Wilson" in metrics["intervals"]["p_bad"] and "bootstrap" in metrics["intervals"]["mean"]


def test_zero_bad_samples_log_is_minus_inf_and_wilson_upper_positive(tmp_path):
    metrics = frontier_metrics(np.zeros(50), thresholds=(-5.0,), num_resamples=20)
    entry = metrics["p_bad"]["-5.0"]
    assert entry["value"] == 0.0 and entry["log"] == float("-inf")
    assert entry["ci"][0] == 0.0 and entry["ci"][1] > 0.0  # a bootstrap would give [0, 0]
    boot = frontier_metrics(np.zeros(50), thresholds=(-5.0,), num_resamples=20, p_bad_interval="bootstrap")
    assert boot["p_bad"]["-5.0"]["ci"] == [0.0, 0.0]
    path = write_json_report(tmp_path / "m.json", metrics)
    with open(path) as f:
        text = f.read()
    assert '"-inf"' in text  # JSON has no -Infinity literal in strict parsers
    assert json.loads(text)["p_bad"]["-5.0"]["log"] == "-inf"


def test_round_trip_through_json(tmp_path):
    metrics = frontier_metrics(np.array(REWARDS), returns=np.array(REWARDS) * 2, kls=np.ones(10), num_resamples=50)
    path = write_json_report(tmp_path / "r.json", {"metrics": metrics})
    with open(path) as f:
        loaded = FrontierMetrics.from_dict(json.load(f)["metrics"])
    assert loaded.to_dict() == metrics
    assert loaded.tail(-1).value == pytest.approx(0.1)
    assert loaded.cvar_at(0.05).count == 1
    assert loaded.kl.value == 1.0
    with pytest.raises(ValueError, match=r"no P\(r < threshold\) at -7.0.*thresholds"):
        loaded.tail(-7)
    with pytest.raises(ValueError, match="missing"):
        FrontierMetrics.from_dict({"reward": {"value": 0.0}})
    assert metric_key(-5) == "-5.0"


def test_frontier_metrics_errors():
    with pytest.raises(ValueError, match="returns has 3 values but rewards has 10"):
        frontier_metrics(REWARDS, returns=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="p_bad_interval"):
        frontier_metrics(REWARDS, p_bad_interval="normal")
    with pytest.raises(ValueError, match="at least one threshold"):
        frontier_metrics(REWARDS, thresholds=())
    with pytest.raises(ValueError, match="alpha"):
        frontier_metrics(REWARDS, cvar_alphas=(0.0,))


# ------------------------------------------------------------------------------------------------ negative data
def test_group_logprob_summary_hand_computed():
    groups = ["a", "b", "a", "a"]
    values = [-1.0, -2.0, -3.0, -5.0]
    per_group, overall = group_logprob_summary(groups, values)
    lse_a = math.log(math.exp(-1) + math.exp(-3) + math.exp(-5))
    assert [g["group"] for g in per_group] == ["a", "b"]
    assert per_group[0] == {"group": "a", "count": 3, "mean_logprob": -3.0, "logsumexp_logprob": pytest.approx(lse_a)}
    assert per_group[1] == {"group": "b", "count": 1, "mean_logprob": -2.0, "logsumexp_logprob": -2.0}
    assert overall["mean_logprob"] == pytest.approx(-2.75)
    assert overall["mean_of_group_means"] == pytest.approx(-2.5)
    assert overall["mean_of_group_logsumexp"] == pytest.approx((lse_a - 2.0) / 2)
    assert overall["num_values"] == 4 and overall["num_groups"] == 2
    with pytest.raises(ValueError, match="one key per value"):
        group_logprob_summary(["a"], values)
