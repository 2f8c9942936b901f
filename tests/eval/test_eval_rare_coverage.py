"""Reliability diagnostics and intervals of the rare-output estimators (`trl_ext.eval.rare.estimate`).

The diagnostics are checked against their formulas on hand-made terms, the intervals against ``[0, 1]``, and the
estimators on tiny one-layer GPT-NeoX models (vocabulary 24, inputs of 3 uniform tokens) whose exact ``p*`` is known:
a rare target at a tiny ``n`` must be flagged (with a logged warning), an easy one at a moderate ``n`` must not, and a
small coverage check runs ITGIS over 20 seeds. The full coverage study is ``bench/rare_coverage.py``.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from trl_ext.eval.rare import Estimate, brute_force, exact_probability, itgis, mhis, uniform
from trl_ext.eval.rare.estimate import (
    MIN_TERM_ESS,
    pareto_k,
    pareto_k_threshold,
    tail_reasons,
    term_diagnostics,
    term_reasons,
    wilson_interval,
)
from trl_ext.testing import build_rare_output_lm

VOCAB = 24


def tiny_lm(head_scale: float):
    """The estimator tests' one-layer GPT-NeoX (seed 0) with its LM head multiplied by ``head_scale``."""
    return build_rare_output_lm(head_scale, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def easy():
    """``P(y|x)`` varies little over the inputs (p* ≈ 3.5%)."""
    model, dist = tiny_lm(5.0), uniform(VOCAB, 3)
    return model, dist, [17], exact_probability(model, dist, [17], batch_size=4096, show_progress=False).estimate


@pytest.fixture(scope="module")
def very_rare():
    """A two-token target whose ``P(y|x)`` sits on a few of the 13,824 inputs (p* ≈ 2.4e-11)."""
    model, dist = tiny_lm(100.0), uniform(VOCAB, 3)
    return model, dist, [8, 8], exact_probability(model, dist, [8, 8], batch_size=4096, show_progress=False).estimate


def log(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).log()


# ------------------------------------------------------------------------------------------------- diagnostics
def test_term_diagnostics_match_their_formulas():
    t = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64)
    d = term_diagnostics(t.log() - 700.0)  # far below float64's range: computed in log-space
    assert d["term_ess"] == pytest.approx(6.0**2 / 14.0)  # (Σt)² / Σt²
    assert d["max_term_share"] == pytest.approx(3.0 / 6.0)
    assert d["num_nonzero"] == 3
    flat = term_diagnostics(torch.zeros(50))
    assert flat["term_ess"] == pytest.approx(50.0) and flat["max_term_share"] == pytest.approx(1 / 50)
    none = term_diagnostics(torch.full((4,), -math.inf))
    assert none["term_ess"] == 0.0 and none["num_nonzero"] == 0


def test_a_dominated_vector_is_flagged_and_a_uniform_one_is_not():
    dominated = log([1000.0] + [1.0] * 99)
    d = term_diagnostics(dominated)
    assert d["term_ess"] < MIN_TERM_ESS and d["max_term_share"] > 0.9
    reasons = term_reasons(d, 100)
    assert any("term ESS" in r for r in reasons) and any("single term" in r for r in reasons)
    assert term_reasons(term_diagnostics(torch.zeros(100)), 100) == []
    mild = torch.linspace(1.0, 2.0, 400, dtype=torch.float64).log()
    assert term_reasons(term_diagnostics(mild), 400) == []


def test_pareto_k_tells_light_from_heavy_tails():
    g = torch.Generator().manual_seed(0)
    u = torch.rand(4000, generator=g, dtype=torch.float64)
    exponential, pareto = -u.log(), u.reciprocal() - 1.0  # generalized Pareto with shape 0 and 1
    assert pareto_k(exponential.log()) < 0.3
    assert pareto_k(pareto.log()) > 0.7
    assert math.isnan(pareto_k(torch.zeros(10)))  # fewer than 5 tail terms
    assert pareto_k_threshold(100) == pytest.approx(0.5) and pareto_k_threshold(10**6) == 0.7
    heavy = {"pareto_k": 0.9, "max_term_share": 0.01, "term_ess": 500.0}
    assert tail_reasons(heavy, 1000) and "heavy tail" in tail_reasons(heavy, 1000)[0]
    assert tail_reasons({**heavy, "max_term_share": 0.002}, 1000) == []  # largest term only 2× the mean


# ---------------------------------------------------------------------------------------------------- intervals
@pytest.mark.parametrize(
    ("estimate", "std_error"),
    [(1e-5, 2e-6), (0.3, 0.5), (0.99, 0.05), (1e-4, 1e-4), (0.0, 0.0), (1e-200, 3e-201), (0.5, 0.0), (1.3, 0.4)],
)
def test_intervals_stay_inside_zero_one(estimate, std_error):
    est = Estimate("itgis", estimate, std_error, 100, math.log10(estimate) if estimate > 0 else -math.inf)
    for kind in ("wilson", "normal"):
        low, high = est.interval(0.95, kind=kind)
        assert 0.0 <= low <= high <= 1.0
        if 0 < estimate < 1:
            assert low <= estimate <= high
    assert est.confidence_interval() == est.interval(kind="normal")
    with pytest.raises(ValueError, match="kind"):
        est.interval(kind="t")


def test_wilson_interval_formula_and_limits():
    p, se, z = 0.2, 0.05, 1.959963984540054
    m = p * (1 - p) / se**2  # the Bernoulli trials with the same error
    centre = (p + z * z / (2 * m)) / (1 + z * z / m)
    half = z / (1 + z * z / m) * math.sqrt(p * (1 - p) / m + z * z / (4 * m * m))
    assert wilson_interval(p, se) == pytest.approx((centre - half, centre + half))
    # the interval's ends solve |p̂ − q| = z·√(q(1 − q)/m)
    for q in wilson_interval(p, se):
        assert abs(p - q) == pytest.approx(z * math.sqrt(q * (1 - q) / m))
    # a small relative error: close to p̂ ± z·SE; a large one: more room above than below
    low, high = wilson_interval(1e-6, 1e-8)
    assert low == pytest.approx(1e-6 - z * 1e-8, rel=1e-3) and high == pytest.approx(1e-6 + z * 1e-8, rel=1e-3)
    low, high = wilson_interval(1e-6, 5e-7)
    assert high - 1e-6 > 1e-6 - low > 0


def test_estimate_reports_its_reliability():
    est = Estimate("brute_force", 0.01, 0.001, 100, -2.0)
    assert est.reliable and est.warning is None and est.unreliable_reasons == []  # the old constructor still works
    est.unreliable_reasons.append("too few hits")
    assert not est.reliable and "too few hits" in est.warning and "[unreliable]" in str(est)
    out = est.to_dict()
    assert out["reliable"] is False and out["warning"] == est.warning and len(out["interval95"]) == 2


# --------------------------------------------------------------------------------------------------- estimators
def test_tiny_n_on_a_rare_target_is_flagged_with_a_warning(very_rare, caplog):
    model, dist, target, _ = very_rare
    with caplog.at_level(logging.WARNING, logger="trl_ext.eval.rare"):
        bf = brute_force(model, dist, target, 32, seed=0, show_progress=False)
        it = itgis(model, dist, target, 32, batch_size=16, temperature=5.0, seed=0, show_progress=False)
    for est in (bf, it):
        assert not est.reliable and est.unreliable_reasons
        assert {"term_ess", "max_term_share", "pareto_k"} <= set(est.diagnostics)
    assert it.diagnostics["weight_ess"] == it.ess
    logged = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert {r.name for r in logged} == {"trl_ext.eval.rare.estimators", "trl_ext.eval.rare.itgis"}
    assert any("brute_force: the standard error is unreliable" in r.getMessage() for r in logged)


def test_mhis_with_few_chains_is_flagged(easy, caplog):
    model, dist, target, _ = easy
    with caplog.at_level(logging.WARNING, logger="trl_ext.eval.rare.mhis"):
        est = mhis(model, dist, target, 64, batch_size=4, temperature=1.0, burn_in=2, seed=0, show_progress=False)
    assert not est.reliable and any("only 4 chains" in r for r in est.unreliable_reasons)
    assert est.diagnostics["num_chains"] == 4 and "only 4 chains" in caplog.text


def test_a_moderate_n_on_an_easy_target_is_reliable(easy, caplog):
    model, dist, target, p = easy
    with caplog.at_level(logging.WARNING, logger="trl_ext.eval.rare"):
        runs = [
            brute_force(model, dist, target, 512, seed=1, show_progress=False),
            itgis(model, dist, target, 512, batch_size=128, temperature=1.0, seed=1, show_progress=False),
            mhis(model, dist, target, 512, batch_size=32, temperature=1.0, burn_in=10, seed=1, show_progress=False),
        ]
    for est in runs:
        assert est.reliable, est.warning
        low, high = est.interval(0.999)  # one run: a 95% interval misses 1 time in 20
        assert low <= p <= high
    assert not caplog.records


def test_reliable_itgis_runs_cover_the_exact_value(easy):
    """20 seeds at n = 256 (a few seconds): the unflagged runs' 95% intervals cover p* at least 80% of the time."""
    model, dist, target, p = easy
    covered = []
    for seed in range(20):
        est = itgis(model, dist, target, 256, batch_size=64, temperature=1.0, seed=seed, show_progress=False)
        if est.reliable:
            low, high = est.interval()
            covered.append(low <= p <= high)
    assert len(covered) >= 15 and sum(covered) >= 0.8 * len(covered)


def test_brute_force_on_a_very_rare_target_is_mostly_flagged(very_rare):
    """At n = 256 plain sampling rarely sees the few inputs carrying p*: most runs must say so."""
    model, dist, target, _ = very_rare
    flags = [not brute_force(model, dist, target, 256, seed=s, show_progress=False).reliable for s in range(20)]
    assert sum(flags) >= 15
