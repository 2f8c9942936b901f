"""The result type of the rare-output estimators and the log-space statistics they share.

Probabilities of rare outputs can be far below what a float32 (or even float64) product of terms keeps, so the
estimators carry log-values and only exponentiate after subtracting the largest one:

- :func:`log_space_mean`: the mean of ``exp(log_values)`` and its standard error ``std / √n``;
- :func:`effective_sample_size`: Kish's ``(Σw)² / Σw²`` of importance weights given as log-weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..report import normal_quantile

__all__ = ["Estimate", "effective_sample_size", "log_space_mean"]


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

    @property
    def relative_std_error(self) -> float:
        """``std_error / estimate`` (``inf`` when the estimate is 0 and the error is not, 0 when both are)."""
        if self.estimate > 0:
            return self.std_error / self.estimate
        return 0.0 if self.std_error == 0 else math.inf

    def confidence_interval(self, confidence: float = 0.95) -> tuple[float, float]:
        """Normal-approximation interval ``estimate ± z·std_error``, clipped below at 0."""
        half = normal_quantile(confidence) * self.std_error
        return max(0.0, self.estimate - half), self.estimate + half

    def to_dict(self) -> dict:
        """JSON-friendly dict for reports (:func:`trl_ext.eval.report.write_json_report`)."""
        out = asdict(self)
        out["relative_std_error"] = self.relative_std_error
        out["ci95"] = list(self.confidence_interval(0.95))
        return out

    def __str__(self) -> str:
        return (
            f"{self.method}: p = {self.estimate:.4g} ± {self.std_error:.2g} (log10 p = {self.log10_estimate:.3f}, "
            f"n = {self.num_samples})"
        )
