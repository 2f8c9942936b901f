r"""Frontier metrics of a sample of rewards: tail probability, CVaR, means with confidence intervals (pure functions).

Conventions (the RePULSe paper's, docs/algorithms.md §10.2):

- Rewards are raw reward-model scores, **low = bad**. Every tail quantity is a *lower*-tail one.
- ``P̂(r < τ)`` (:func:`tail_probability`) is the fraction of rewards strictly below the threshold ``τ``.
- ``CVaR_α`` (:func:`cvar`) is the mean of the ``k = ⌊α·n⌋`` smallest rewards, with ``k ≥ 1`` (so a sample smaller
  than ``1/α`` still gives its minimum). Ties at the cut do not matter: the ``k`` smallest values are well defined
  as a multiset.
- Confidence intervals (:func:`frontier_metrics`): means and CVaR use the percentile bootstrap over samples
  (:func:`trl_ext.eval.report.bootstrap_ci`); ``P̂(r < τ)`` uses the Wilson score interval
  (:func:`trl_ext.eval.report.binomial_ci`) by default, because at 0 bad samples — the interesting case for a
  rare event — a bootstrap interval collapses to the point ``[0, 0]`` while Wilson's upper end stays positive
  (``p_bad_interval="bootstrap"`` switches to the bootstrap).
- Seed-level intervals (frontier plots): :func:`t_interval`, the Student-t interval of a mean over a few seeds. The
  t quantile is computed exactly for integer degrees of freedom (:func:`t_quantile`), so scipy is not needed.

:class:`FrontierMetrics` is the structured result; :meth:`FrontierMetrics.to_dict` gives the JSON layout written in
the reports and :meth:`FrontierMetrics.from_dict` reads it back (what :func:`~trl_ext.eval.frontier.plot_frontier`
uses). The layout::

    {
      "num_samples": 400, "confidence": 0.95,
      "intervals": {"mean": "percentile bootstrap, 2000 resamples", "p_bad": "Wilson score", "cvar": "..."},
      "reward":  {"value": -1.2, "ci": [-1.4, -1.0]},
      "return":  {...} or null,          # reward − kl_coef·KL, when returns were given
      "kl":      {...} or null,          # summed per-sample KL to the reference, when given
      "entropy": {...} or null,          # −Σ log p of each response, when given
      "p_bad": {"-5.0": {"value": 0.01, "ci": [0.003, 0.03], "count": 4, "log": -4.6, "log_ci": [-5.8, -3.5]}, ...},
      "cvar":  {"0.05": {"value": -6.3, "ci": [-6.9, -5.8], "num_worst": 20}, ...}
    }

Threshold and alpha keys are ``repr(float(x))`` (:func:`metric_key`); ``log`` of a zero probability is ``-inf``
(written as the string ``"-inf"`` in JSON).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .report import binomial_ci, bootstrap_ci

__all__ = [
    "DEFAULT_CVAR_ALPHAS",
    "DEFAULT_THRESHOLDS",
    "IntervalEstimate",
    "FrontierMetrics",
    "cvar",
    "frontier_metrics",
    "group_logprob_summary",
    "metric_key",
    "num_worst",
    "t_interval",
    "t_quantile",
    "tail_probability",
]

# -0.5 is P(bad) of a 0/−1 reward (e.g. `LexicalReward`'s defaults); the integers cover reward-model scales.
DEFAULT_THRESHOLDS: tuple[float, ...] = (-6.0, -5.0, -4.0, -3.0, -2.0, -1.0, -0.5, 0.0)
DEFAULT_CVAR_ALPHAS: tuple[float, ...] = (0.01, 0.05, 0.1)
P_BAD_INTERVALS: tuple[str, ...] = ("wilson", "bootstrap")


# ------------------------------------------------------------------------------------------------ inputs
def _as_array(values, name: str = "rewards") -> np.ndarray:
    """``values`` as a non-empty 1-D float64 array without NaN (tensors, lists and arrays accepted)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    x = np.asarray(values, dtype=np.float64)
    if x.ndim == 0 or (x.ndim > 1 and sum(size > 1 for size in x.shape) <= 1):
        x = x.reshape(-1)  # a scalar, or e.g. an (n, 1) column
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one value per sample); got shape {tuple(x.shape)}.")
    if x.size == 0:
        raise ValueError(f"{name} is empty; pass at least one value.")
    if np.isnan(x).any():
        raise ValueError(f"{name} holds NaN at positions {np.flatnonzero(np.isnan(x))[:5].tolist()}; drop them first.")
    return x


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"CVaR alpha must be in (0, 1] (the fraction of worst samples averaged); got {alpha}.")
    return alpha


def metric_key(value: float) -> str:
    """The key of a threshold or an alpha in a metrics dict: ``repr(float(value))`` (``-5`` → ``"-5.0"``)."""
    return repr(float(value))


# ------------------------------------------------------------------------------------------------ point metrics
def tail_probability(rewards, threshold: float) -> float:
    """``P̂(r < τ)``: the fraction of ``rewards`` strictly below ``threshold``."""
    x = _as_array(rewards)
    return float(np.mean(x < float(threshold)))


def num_worst(n: int, alpha: float) -> int:
    """``k = max(1, ⌊α·n⌋)``, the number of samples CVaR_α averages (``⌊·⌋`` with a 1e-9 guard against float error,
    so that ``α = 0.29, n = 100`` gives 29, not 28)."""
    alpha = _check_alpha(alpha)
    if n < 1:
        raise ValueError(f"n must be >= 1; got {n}.")
    return max(1, min(n, int(math.floor(alpha * n + 1e-9))))


def _cvar_statistic(alpha: float):
    """A numpy-style statistic ``f(x, axis=-1)``: the mean of the ``k`` smallest values along ``axis``."""

    def statistic(x: np.ndarray, axis: int = -1) -> np.ndarray:
        k = num_worst(x.shape[axis], alpha)
        smallest = np.partition(x, k - 1, axis=axis) if k < x.shape[axis] else x
        return np.take(smallest, np.arange(k), axis=axis).mean(axis=axis)

    return statistic


def cvar(rewards, alpha: float) -> float:
    """``CVaR_α``: the mean of the ``max(1, ⌊α·n⌋)`` smallest of the ``n`` rewards (lower tail: low reward = bad).

    ``alpha = 1`` gives the mean; ``α·n < 1`` gives the minimum.
    """
    x = _as_array(rewards)
    return float(_cvar_statistic(_check_alpha(alpha))(x))


# ------------------------------------------------------------------------------------------------ seed-level CIs
def t_quantile(confidence: float, df: int) -> float:
    """The two-sided Student-t quantile: ``t`` with ``P(|T_df| ≤ t) = confidence`` (12.706 for 0.95 and df=1),
    from `scipy.stats.t`."""
    from scipy.stats import t

    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95; got {confidence}.")
    if int(df) != df or df < 1:
        raise ValueError(f"df must be a positive integer; got {df}.")
    return float(t.ppf(0.5 + confidence / 2, int(df)))


def t_interval(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: the Student-t interval ``mean ± t_{n−1} · s / √n`` of the mean of ``values`` (e.g. one
    metric over seeds; ``s`` is the sample standard deviation). With a single value the interval is the point."""
    x = _as_array(values, "values")
    mean = float(x.mean())
    if x.size == 1:
        return mean, mean, mean
    half = t_quantile(confidence, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean, mean - half, mean + half


# ------------------------------------------------------------------------------------------------ structured result
@dataclass
class IntervalEstimate:
    """A point estimate with its confidence interval (and, for tail quantities, the count behind it)."""

    value: float
    ci: tuple[float, float]
    count: int | None = None
    """``P̂``: the number of samples below the threshold; ``CVaR``: the number of worst samples averaged."""

    def to_dict(self, count_name: str | None = None) -> dict:
        out = {"value": float(self.value), "ci": [float(self.ci[0]), float(self.ci[1])]}
        if count_name is not None and self.count is not None:
            out[count_name] = int(self.count)
        return out

    @classmethod
    def from_dict(cls, d: Mapping, count_name: str | None = None) -> IntervalEstimate:
        ci = d.get("ci") or (d["value"], d["value"])
        return cls(float(d["value"]), (float(ci[0]), float(ci[1])), d.get(count_name) if count_name else None)


def _log(p: float) -> float:
    return math.log(p) if p > 0 else float("-inf")


def _find(mapping: Mapping[float, IntervalEstimate], key: float, what: str, option: str) -> IntervalEstimate:
    for k, v in mapping.items():
        if math.isclose(k, float(key), rel_tol=1e-9, abs_tol=1e-12):
            return v
    raise ValueError(
        f"The report has no {what} at {float(key)!r}; it has {sorted(mapping)}. Evaluate with that value in "
        f"`{option}` or pick one of those."
    )


@dataclass
class FrontierMetrics:
    """The metrics of one evaluation (see the module docstring for the dict layout)."""

    num_samples: int
    confidence: float
    reward: IntervalEstimate
    p_bad: dict[float, IntervalEstimate]
    cvar: dict[float, IntervalEstimate]
    return_: IntervalEstimate | None = None
    kl: IntervalEstimate | None = None
    entropy: IntervalEstimate | None = None
    intervals: dict[str, str] = field(default_factory=dict)
    reward_range: tuple[float, float] | None = None
    """``(min, max)`` of the sampled rewards: the support that the mean and CVaR intervals over seeds are kept in."""

    def tail(self, threshold: float) -> IntervalEstimate:
        """``P̂(r < threshold)`` (clear error when that threshold was not evaluated)."""
        return _find(self.p_bad, threshold, "P(r < threshold)", "thresholds")

    def cvar_at(self, alpha: float) -> IntervalEstimate:
        """``CVaR_alpha`` (clear error when that alpha was not evaluated)."""
        return _find(self.cvar, alpha, "CVaR alpha", "cvar_alphas")

    def to_dict(self) -> dict:
        def optional(e: IntervalEstimate | None):
            return e.to_dict() if e is not None else None

        p_bad = {}
        for tau, e in self.p_bad.items():
            entry = e.to_dict("count")
            entry["log"] = _log(e.value)
            entry["log_ci"] = [_log(e.ci[0]), _log(e.ci[1])]
            p_bad[metric_key(tau)] = entry
        return {
            "num_samples": int(self.num_samples),
            "confidence": float(self.confidence),
            "intervals": dict(self.intervals),
            "reward": self.reward.to_dict(),
            "return": optional(self.return_),
            "kl": optional(self.kl),
            "entropy": optional(self.entropy),
            "p_bad": p_bad,
            "cvar": {metric_key(a): e.to_dict("num_worst") for a, e in self.cvar.items()},
            "reward_range": list(self.reward_range) if self.reward_range is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> FrontierMetrics:
        """Read back :meth:`to_dict`'s layout (as returned, or as loaded from a JSON report)."""
        missing = [k for k in ("reward", "p_bad", "cvar") if k not in d]
        if missing:
            raise ValueError(
                f"Not a frontier-metrics dict: keys {missing} are missing (found {sorted(d)}). Pass the report's "
                "'metrics' entry, as written by eval_heldout / frontier_metrics."
            )

        def optional(key: str):
            return IntervalEstimate.from_dict(d[key]) if d.get(key) is not None else None

        return cls(
            num_samples=int(d.get("num_samples", 0)),
            confidence=float(d.get("confidence", 0.95)),
            reward=IntervalEstimate.from_dict(d["reward"]),
            p_bad={float(k): IntervalEstimate.from_dict(v, "count") for k, v in d["p_bad"].items()},
            cvar={float(k): IntervalEstimate.from_dict(v, "num_worst") for k, v in d["cvar"].items()},
            return_=optional("return"),
            kl=optional("kl"),
            entropy=optional("entropy"),
            intervals=dict(d.get("intervals", {})),
            reward_range=tuple(float(v) for v in d["reward_range"]) if d.get("reward_range") else None,
        )


def frontier_metrics(
    rewards,
    *,
    returns=None,
    kls=None,
    entropies=None,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    cvar_alphas: Sequence[float] = DEFAULT_CVAR_ALPHAS,
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
    p_bad_interval: str = "wilson",
) -> dict:
    """All frontier metrics of one evaluation, with confidence intervals, as a dict (layout: module docstring).

    Args:
        rewards: ``(n,)`` raw rewards (low = bad).
        returns: optional ``(n,)`` returns ``r − kl_coef·KL``.
        kls: optional ``(n,)`` per-sample KL to the reference (summed over the response tokens).
        entropies: optional ``(n,)`` entropy proxies ``−Σ_t log p(s_t|·)``.
        thresholds: the ``τ`` of ``P̂(r < τ)``.
        cvar_alphas: the ``α`` of ``CVaR_α``, each in ``(0, 1]``.
        num_resamples: bootstrap resamples.
        confidence: the intervals' confidence level.
        seed: bootstrap seed (the same seed for every metric).
        p_bad_interval: ``"wilson"`` (Wilson score interval, the default) or ``"bootstrap"``.
    """
    if p_bad_interval not in P_BAD_INTERVALS:
        raise ValueError(f"p_bad_interval must be one of {P_BAD_INTERVALS}; got {p_bad_interval!r}.")
    thresholds, alphas = [float(t) for t in thresholds], [_check_alpha(a) for a in cvar_alphas]
    if not thresholds or not alphas:
        raise ValueError("Pass at least one threshold and one CVaR alpha.")
    x = _as_array(rewards)
    n = x.size
    boot = {"num_resamples": num_resamples, "confidence": confidence, "seed": seed}

    def mean_estimate(values, name: str) -> IntervalEstimate | None:
        if values is None:
            return None
        v = _as_array(values, name)
        if v.size != n:
            raise ValueError(f"{name} has {v.size} values but rewards has {n}; pass one per sample.")
        return IntervalEstimate(float(v.mean()), bootstrap_ci(v, np.mean, **boot))

    p_bad = {}
    for tau in thresholds:
        bad = x < tau
        count = int(bad.sum())
        if p_bad_interval == "wilson":
            ci = binomial_ci(count, n, confidence)
        else:
            ci = bootstrap_ci(bad.astype(np.float64), np.mean, **boot)
        p_bad[tau] = IntervalEstimate(count / n, ci, count)
    cvars = {
        a: IntervalEstimate(cvar(x, a), bootstrap_ci(x, _cvar_statistic(a), **boot), num_worst(n, a)) for a in alphas
    }
    bootstrap_text = f"percentile bootstrap over samples, {num_resamples} resamples, seed {seed}"
    metrics = FrontierMetrics(
        num_samples=n,
        confidence=float(confidence),
        reward=mean_estimate(x, "rewards"),
        p_bad=p_bad,
        cvar=cvars,
        return_=mean_estimate(returns, "returns"),
        kl=mean_estimate(kls, "kls"),
        entropy=mean_estimate(entropies, "entropies"),
        intervals={
            "mean": bootstrap_text,
            "p_bad": "Wilson score interval" if p_bad_interval == "wilson" else bootstrap_text,
            "cvar": bootstrap_text,
        },
        reward_range=(float(x.min()), float(x.max())),
    )
    return metrics.to_dict()


# ------------------------------------------------------------------------------------------------ negative data
def group_logprob_summary(groups: Sequence, logprobs) -> tuple[list[dict], dict]:
    """Per-group and overall summaries of sequence log-probs (negative-data evaluation, docs/algorithms.md §10.3).

    Args:
        groups: one hashable group key per value (e.g. the prompt text), in any order.
        logprobs: the values ``log p(response | prompt)``.

    Returns:
        ``(per_group, overall)``. ``per_group`` lists, in order of first appearance, ``{"group", "count",
        "mean_logprob", "logsumexp_logprob"}`` — the mean and the ``logsumexp`` (log of the total probability mass)
        of the group's values. ``overall`` holds ``mean_logprob`` (over all values), ``mean_of_group_means`` and
        ``mean_of_group_logsumexp`` (unweighted means over groups), ``num_values`` and ``num_groups``.
    """
    x = _as_array(logprobs, "logprobs")
    if len(groups) != x.size:
        raise ValueError(f"{len(groups)} group keys for {x.size} log-probs; pass one key per value.")
    order: dict = {}
    for i, g in enumerate(groups):
        order.setdefault(g, []).append(i)
    per_group = []
    for g, idx in order.items():
        values = torch.as_tensor(x[idx], dtype=torch.float64)
        per_group.append(
            {
                "group": g,
                "count": len(idx),
                "mean_logprob": float(values.mean()),
                "logsumexp_logprob": float(torch.logsumexp(values, dim=0)),
            }
        )
    overall = {
        "mean_logprob": float(x.mean()),
        "mean_of_group_means": float(np.mean([p["mean_logprob"] for p in per_group])),
        "mean_of_group_logsumexp": float(np.mean([p["logsumexp_logprob"] for p in per_group])),
        "num_values": int(x.size),
        "num_groups": len(per_group),
    }
    return per_group, overall
