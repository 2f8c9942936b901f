"""The evaluation tools' shared report writer and confidence intervals."""

import json
import math
import os

import numpy as np
import pytest
import torch

from trl_ext.eval.report import binomial_ci, bootstrap_ci, normal_quantile, to_jsonable, write_json_report


def test_write_json_report_converts_and_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "report.json"
    report = {"t": torch.tensor([1.0, 2.5]), "n": np.int64(3), "a": np.array([[1, 2]]), "x": float("-inf"), "k": (1,)}
    assert write_json_report(path, report) == str(path)
    assert json.loads(path.read_text()) == {"t": [1.0, 2.5], "n": 3, "a": [[1, 2]], "x": "-inf", "k": [1]}

    def killed(*_args, **_kwargs):
        raise KeyboardInterrupt  # dies between writing the temporary file and moving it into place

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_json_report(path, {"new": 1})
    assert json.loads(path.read_text())["n"] == 3  # the old report is intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]  # no temporary file left behind


def test_to_jsonable_nan_and_nested():
    assert to_jsonable({"a": [float("nan"), float("inf")], 2: {"b": np.float32(0.5)}}) == {
        "a": ["nan", "inf"],
        "2": {"b": 0.5},
    }


def test_bootstrap_ci_covers_the_true_mean():
    covered = 0
    for seed in range(100):
        x = np.random.default_rng(seed).normal(1.0, 2.0, size=200)
        low, high = bootstrap_ci(x, num_resamples=400, seed=seed)
        assert low < x.mean() < high
        covered += low <= 1.0 <= high
    assert covered >= 88  # nominal 95%


def test_bootstrap_ci_non_vectorised_statistic_and_constant_sample():
    assert bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0)
    low, high = bootstrap_ci(torch.arange(20.0), lambda v: float(np.percentile(v, 90)), num_resamples=200)
    assert 10 <= low <= high <= 19
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([1.0], confidence=1.5)


def test_binomial_ci_wilson_values():
    z = normal_quantile(0.95)
    assert z == pytest.approx(1.959964, abs=1e-6)
    low, high = binomial_ci(5, 10)
    half = z * math.sqrt(0.25 / 10 + z * z / 400) / (1 + z * z / 10)
    assert (low, high) == pytest.approx((0.5 - half, 0.5 + half))
    assert binomial_ci(0, 10)[0] == 0.0 and binomial_ci(10, 10)[1] == 1.0
    assert 0 < binomial_ci(0, 10)[1] < 0.35
    with pytest.raises(ValueError, match="successes"):
        binomial_ci(11, 10)
    with pytest.raises(ValueError, match="trials"):
        binomial_ci(0, 0)
