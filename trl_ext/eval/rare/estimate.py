"""The result type of the rare-output estimators and the log-space statistics they share.

Probabilities of rare outputs can be far below what a float32 (or even float64) product of terms keeps, so the
estimators carry log-values and only exponentiate after subtracting the largest one:

- :func:`log_space_mean`: the mean of ``exp(log_values)`` and its standard error ``std / √n``;
- :func:`effective_sample_size`: Kish's ``(Σw)² / Σw²`` of importance weights given as log-weights;
- :func:`term_diagnostics`: how many of the averaged terms really carry the estimate (the same Kish formula applied
  to the terms, and the share of the largest one) and :func:`pareto_k`, the fitted shape of their upper tail;
- :func:`wilson_interval`: the approximate interval inside ``[0, 1]`` behind :meth:`Estimate.interval`.

**When is the error bar trustworthy?** Every estimator's standard error is a sample standard deviation over ``√n``
and its interval leans on the central limit theorem. Both fail when the estimate rests on a handful of terms: a
rare output that brute force saw a few times, an importance weight that dwarfs the rest, or too few MHIS chains.
Then the estimate is usually too *small* and so is its error (the big terms that were not drawn are missing from
both), and ``estimate ± 1.96·SE`` misses ``p*`` far more often than 5% of the time. Each estimator therefore
fills :attr:`Estimate.diagnostics`, lists what it found wrong in :attr:`Estimate.unreliable_reasons` (so
:attr:`Estimate.reliable` is ``False``) and logs a warning. No diagnostic can see a region of inputs that was never
drawn, so a run that passes the checks is not a guarantee; ``docs/evaluation.md`` has the measured coverage.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

import torch

from ..report import normal_quantile

__all__ = [
    "MAX_TERM_SHARE",
    "MIN_CHAINS",
    "MIN_TERM_ESS",
    "TAIL_CHECK_RATIO",
    "Estimate",
    "effective_sample_size",
    "log_space_mean",
    "pareto_k",
    "pareto_k_threshold",
    "tail_reasons",
    "term_diagnostics",
    "term_reasons",
    "wilson_interval",
]

MIN_TERM_ESS = 10.0
"""Fewest effective terms (:func:`term_diagnostics`) for a normal interval to be trusted; for brute force with
0/1-like values this is the number of hits."""
MAX_TERM_SHARE = 0.3
"""Largest share of the sum that a single term may carry."""
MIN_CHAINS = 10
"""Fewest MHIS chains for the between-chain standard error to be trusted."""
TAIL_CHECK_RATIO = 5.0
"""The heavy-tail check of :func:`term_reasons` applies only when the largest term is this many times the mean."""


def log_space_mean(log_values: torch.Tensor) -> tuple[float, float, float]:
    """``(mean, std_error, log_mean)`` of the values ``exp(log_values)`` (any shape, flattened).

    ``std_error = std(values, ddof=1) / √n`` (0 for a single value); ``log_mean = log(mean)`` is exact even when
    ``mean`` underflows a float64. ``-inf`` entries are zeros; all zeros give ``(0, 0, -inf)``.
    """
    v = torch.as_tensor(log_values, dtype=torch.float64).reshape(-1)
    if v.numel() == 0:
        raise ValueError("log_space_mean needs at least one value.")
    if torch.isnan(v).any() or (v == math.inf).any():
        raise ValueError("log_values hold nan or +inf: the model produced non-finite log-probabilities.")
    top = float(v.max())
    if top == -math.inf:
        return 0.0, 0.0, -math.inf
    scaled = (v - top).exp()
    n = scaled.numel()
    mean = float(scaled.mean())
    std = float(scaled.std(unbiased=True)) if n > 1 else 0.0
    scale = math.exp(top) if top < 709.0 else math.inf
    return mean * scale, std * scale / math.sqrt(n), top + math.log(mean)


def effective_sample_size(log_weights: torch.Tensor) -> float:
    """Kish's effective sample size ``(Σ w)² / Σ w²`` of weights given as ``log_weights`` (1 ≤ ESS ≤ n)."""
    v = torch.as_tensor(log_weights, dtype=torch.float64).reshape(-1)
    if not torch.isfinite(v).any():
        return 0.0
    return float((2 * torch.logsumexp(v, 0) - torch.logsumexp(2 * v, 0)).exp())


def term_diagnostics(log_terms: torch.Tensor) -> dict:
    """Tail-weight diagnostics of the terms ``t_i = exp(log_terms_i)`` whose mean is an estimate.

    Returns a dict with ``term_ess`` (Kish's ``(Σt)² / Σt²``: the number of equal terms that would give the same
    relative spread; between 1 and ``n``, 0 when every term is 0), ``max_term_share`` (``max t / Σt``; 0 when every
    term is 0) and ``num_nonzero`` (terms that are not exactly 0). ``term_ess ≈ min(n, (estimate/SE)²)``, so
    ``term_ess < 10`` is the same as a relative standard error above about 30%: the estimate rests on a few draws.
    """
    v = torch.as_tensor(log_terms, dtype=torch.float64).reshape(-1)
    finite = v > -math.inf
    num_nonzero = int(finite.sum())
    if num_nonzero == 0:
        return {"term_ess": 0.0, "max_term_share": 0.0, "num_nonzero": 0, "pareto_k": math.nan}
    log_sum = torch.logsumexp(v, 0)
    return {
        "term_ess": effective_sample_size(v),
        "max_term_share": float((v.max() - log_sum).exp()),
        "num_nonzero": num_nonzero,
        "pareto_k": pareto_k(v),
    }


def pareto_k(log_terms: torch.Tensor) -> float:
    """Estimated shape ``k̂`` of a generalized Pareto tail fitted to the largest terms ``exp(log_terms)``.

    The ``M = min(n/5, 3√n)`` largest terms, less the next one (the threshold), are fitted by the profile-likelihood
    method of Zhang and Stephens (2009), with the shrinkage towards 0.5 used by Pareto-smoothed importance
    sampling (Vehtari et al., 2024). ``k̂ ≥ 0.5`` means the terms look as if their variance were infinite, so the
    sample standard deviation — and with it the standard error — is dominated by terms not yet drawn; above
    ``min(1 − 1/log10 n, 0.7)`` the mean itself is unreliable at this ``n``. ``nan`` with fewer than 5 tail terms
    or when the tail terms are all equal.
    """
    v = torch.as_tensor(log_terms, dtype=torch.float64).reshape(-1)
    v = v[v > -math.inf]
    n = v.numel()
    m = int(min(n / 5.0, 3.0 * math.sqrt(n)))
    if m < 5:
        return math.nan
    top = torch.topk(v, m + 1).values.flip(0)  # ascending: threshold first
    x = ((top[1:] - top[0]).exp() - 1.0) * top[0].exp() / top[-1].exp()  # exceedances, scaled by the largest
    x = x.clamp_min(0.0)
    if float(x[-1]) <= 0.0:
        return math.nan
    grid = 30 + int(math.sqrt(m))
    quartile = float(x[max(int(m / 4 + 0.5) - 1, 0)])
    if quartile <= 0.0:
        quartile = float(x[x > 0][0])
    j = torch.arange(1, grid + 1, dtype=torch.float64)
    theta = -(1.0 / float(x[-1]) + (1.0 - (grid / (j - 0.5)).sqrt()) / (3.0 * quartile))  # candidate ξ/σ
    xi = torch.log1p(theta[:, None] * x[None, :]).mean(1)  # profile MLE of ξ given θ
    profile = m * ((theta / xi).log() - xi - 1.0)
    post = torch.softmax(profile, 0)
    post = torch.where(torch.isfinite(post), post, torch.zeros_like(post))
    theta_hat = float((post * theta).sum())
    xi_hat = float(torch.log1p(theta_hat * x).mean())
    return (m * xi_hat + 10 * 0.5) / (m + 10)


def pareto_k_threshold(num_samples: int) -> float:
    """Largest acceptable :func:`pareto_k` at ``n`` terms: ``min(1 − 1/log10 n, 0.7)`` (as in Pareto-smoothed
    importance sampling: the heavier the tail, the more draws a mean needs before it settles)."""
    return min(1.0 - 1.0 / math.log10(num_samples), 0.7) if num_samples > 1 else -math.inf


def term_reasons(diagnostics: dict, num_samples: int, what: str = "draws", tail: bool = True) -> list[str]:
    """Why an estimate averaged from ``num_samples`` terms with these :func:`term_diagnostics` has an unreliable
    normal interval (empty list: nothing found). Three checks:

    - ``term_ess < MIN_TERM_ESS`` (10): a few terms carry the estimate;
    - ``max_term_share > MAX_TERM_SHARE`` (30%): one term carries it;
    - with ``tail=True``, :func:`tail_reasons`.
    """
    reasons = []
    ess, share = diagnostics["term_ess"], diagnostics["max_term_share"]
    if ess < MIN_TERM_ESS:
        reasons.append(
            f"only {ess:.1f} effective {what} of {num_samples} carry the estimate (term ESS < {MIN_TERM_ESS:g})"
        )
    if share > MAX_TERM_SHARE:
        reasons.append(f"a single term carries {share:.0%} of the estimate (more than {MAX_TERM_SHARE:.0%})")
    return reasons + (tail_reasons(diagnostics, num_samples) if tail else [])


def tail_reasons(diagnostics: dict, num_samples: int) -> list[str]:
    """The heavy-tail check: ``pareto_k`` above :func:`pareto_k_threshold` while the largest term is at least
    ``TAIL_CHECK_RATIO`` (5) times the mean.

    It catches the typical failure, a sample that has not yet drawn the few inputs carrying most of ``p*``: the
    estimate and its error are then both too small, yet the terms that were drawn already show a heavy upper tail.
    When every term is within a factor 5 of the mean, the tail carries little of the sum and the fitted shape (noisy
    for such flat terms) is ignored.
    """
    k, share = diagnostics.get("pareto_k", math.nan), diagnostics["max_term_share"]
    limit = pareto_k_threshold(num_samples)
    if k > limit and share * num_samples >= TAIL_CHECK_RATIO:
        return [
            f"the largest terms have a heavy tail (Pareto k = {k:.2f} > {limit:.2f} at n = {num_samples}): inputs "
            "carrying much of p* are probably still undrawn, so the estimate and its error are likely too small"
        ]
    return []


def wilson_interval(estimate: float, std_error: float, confidence: float = 0.95) -> tuple[float, float]:
    """A Wilson-type score interval for a probability estimated with a given standard error.

    The estimate is treated like a hit rate of ``m = p̂(1 − p̂) / SE²`` Bernoulli trials (the number of trials that
    would give the same error), and the interval is the set of ``p`` with ``|p̂ − p| ≤ z·√(p(1 − p)/m)``. It lies
    inside ``[0, 1]``, is close to ``p̂ ± z·SE`` when the error is small relative to ``p̂``, and otherwise reaches
    further up than down: the error of a rare-event estimate grows with ``p``, so a low ``p̂`` that missed big terms
    still gets room above it. It is an approximation: it assumes the variance scales like ``p(1 − p)``, which holds
    for hit counts and roughly for averages of many small terms. Outside ``0 < p̂ < 1`` or with ``SE = 0`` it falls
    back to ``p̂ ± z·SE`` clipped to ``[0, 1]``.
    """
    z = normal_quantile(confidence)
    if not (0.0 < estimate < 1.0) or not std_error > 0 or not math.isfinite(std_error):
        half = z * std_error if math.isfinite(std_error) else math.inf
        return min(1.0, max(0.0, estimate - half)), max(0.0, min(1.0, estimate + half))
    # r = z²/m = z²·SE²/(p̂(1−p̂)); written so that a tiny p̂ and SE neither underflow nor lose precision.
    r = z * z * (std_error / estimate) * (std_error / (1.0 - estimate))
    centre = (estimate + r / 2.0) / (1.0 + r)
    half = math.hypot(z * std_error, r / 2.0) / (1.0 + r)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Estimate:
    """An estimate of ``p* = E_{x~D}[P(y | x)]`` with its standard error and diagnostics."""

    method: str
    """``"exact"``, ``"brute_force"``, ``"itgis"`` or ``"mhis"``."""
    estimate: float
    """The estimate of ``p*``."""
    std_error: float
    """Standard error of ``estimate`` (0 for ``"exact"``); see each estimator for how it is computed."""
    num_samples: int
    """Inputs whose ``P(y|x)`` entered the estimate (the support size for ``"exact"``)."""
    log10_estimate: float
    """``log10(estimate)``, computed in log-space (finite even when ``estimate`` underflows); ``-inf`` for 0."""
    ess: float | None = None
    """Effective sample size of the importance weights (``None`` for plain sampling)."""
    acceptance_rate: float | None = None
    """MHIS: fraction of accepted proposals after burn-in."""
    seconds: float = 0.0
    """Wall-clock time of the whole estimate."""
    timings: dict = field(default_factory=dict)
    """Seconds per phase (``model``: forward/backward passes, ``sampling``, ...)."""
    details: dict = field(default_factory=dict)
    """Estimator settings and further diagnostics (temperature, chains, steps, per-chain values, ...)."""
    diagnostics: dict = field(default_factory=dict)
    """Reliability diagnostics of the standard error (``term_ess``, ``max_term_share``, ...; see each estimator)."""
    unreliable_reasons: list = field(default_factory=list)
    """Why the standard error and its interval should not be trusted (empty: no problem found)."""

    @property
    def reliable(self) -> bool:
        """``True`` when the estimator's checks found nothing wrong with the standard error (not a guarantee)."""
        return not self.unreliable_reasons

    @property
    def warning(self) -> str | None:
        """The reasons in one sentence, or ``None`` when :attr:`reliable`."""
        if self.reliable:
            return None
        return f"{self.method}: the standard error is unreliable: " + "; ".join(self.unreliable_reasons) + "."

    @property
    def relative_std_error(self) -> float:
        """``std_error / estimate`` (``inf`` when the estimate is 0 and the error is not, 0 when both are)."""
        if self.estimate > 0:
            return self.std_error / self.estimate
        return 0.0 if self.std_error == 0 else math.inf

    def confidence_interval(self, confidence: float = 0.95) -> tuple[float, float]:
        """Normal-approximation interval ``estimate ± z·std_error``, clipped to ``[0, 1]``."""
        half = normal_quantile(confidence) * self.std_error
        return max(0.0, self.estimate - half), min(1.0, self.estimate + half)

    def interval(self, level: float = 0.95, kind: str = "wilson") -> tuple[float, float]:
        """An approximate ``level`` interval for ``p*`` inside ``[0, 1]``.

        ``kind="wilson"`` (default): :func:`wilson_interval`, which leaves more room above a small estimate than
        below it; ``kind="normal"``: :meth:`confidence_interval`. Either is only as good as the standard error;
        check :attr:`reliable` first.
        """
        if kind == "wilson":
            return wilson_interval(self.estimate, self.std_error, level)
        if kind == "normal":
            return self.confidence_interval(level)
        raise ValueError(f"kind must be 'wilson' or 'normal', got {kind!r}.")

    def flag(self, reasons: list[str], logger: logging.Logger) -> Estimate:
        """Record ``reasons`` in :attr:`unreliable_reasons`, log :attr:`warning` on ``logger``; return ``self``."""
        self.unreliable_reasons.extend(reasons)
        if reasons:
            logger.warning(self.warning)
        return self

    def to_dict(self) -> dict:
        """JSON-friendly dict for reports (:func:`trl_ext.eval.report.write_json_report`)."""
        out = asdict(self)
        out["relative_std_error"] = self.relative_std_error
        out["ci95"] = list(self.confidence_interval(0.95))
        out["interval95"] = list(self.interval(0.95))
        out["reliable"] = self.reliable
        out["warning"] = self.warning
        return out

    def __str__(self) -> str:
        return (
            f"{self.method}: p = {self.estimate:.4g} ± {self.std_error:.2g} (log10 p = {self.log10_estimate:.3f}, "
            f"n = {self.num_samples})" + ("" if self.reliable else " [unreliable]")
        )
