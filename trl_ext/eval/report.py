"""What every evaluation tool shares: an atomic JSON report and confidence intervals.

- :func:`write_json_report` writes a report so that a killed process never leaves a half-written file (a temporary
  file in the same folder, then ``os.replace``), turning tensors and numpy values into plain JSON.
- :func:`bootstrap_ci`: percentile bootstrap interval of any statistic of a sample (vectorised resampling).
- :func:`binomial_ci`: Wilson score interval of a success rate (attack success, P̂(r < τ) on few samples), which
  stays inside [0, 1] and is sensible at 0 or n successes, where the normal approximation collapses to a point.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from statistics import NormalDist

import numpy as np
import torch

__all__ = ["write_json_report", "to_jsonable", "bootstrap_ci", "binomial_ci", "normal_quantile"]


def to_jsonable(value):
    """``value`` with tensors, numpy arrays/scalars, tuples and non-finite floats made JSON-friendly.

    Non-finite floats become the strings ``"inf"``, ``"-inf"`` and ``"nan"`` (JSON has no literal for them).
    """
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def write_json_report(path: str | os.PathLike, report: Mapping) -> str:
    """Write ``report`` as indented JSON to ``path`` atomically; create missing parent folders; return the path."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    payload = json.dumps(to_jsonable(dict(report)), indent=2, sort_keys=False)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".json.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(payload + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def normal_quantile(confidence: float) -> float:
    """The two-sided normal quantile ``z`` of a confidence level (1.96 for 0.95)."""
    _check_confidence(confidence)
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95; got {confidence}.")


def bootstrap_ci(
    values: Sequence[float] | np.ndarray | torch.Tensor,
    statistic: Callable[[np.ndarray], float | np.ndarray] = np.mean,
    *,
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of ``statistic`` over the 1-D sample ``values``
    (`scipy.stats.bootstrap`, ``method="percentile"``, seeded).

    ``statistic`` is called on the resamples with ``axis=-1`` when it accepts it (numpy reductions such as ``np.mean``
    do: vectorised calls), otherwise once per resample on a 1-D array. A sample of one value (or a constant sample)
    gives a zero-width interval at the statistic's value.
    """
    _check_confidence(confidence)
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1; got {num_resamples}.")
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("bootstrap_ci needs at least one value.")
    if x.size == 1 or bool((x == x[0]).all()):
        value = float(statistic(x))
        return value, value
    from scipy.stats import bootstrap

    def vectorised(sample, axis=-1):
        try:
            stats = np.asarray(statistic(sample, axis=axis), dtype=np.float64)
            if stats.shape == sample.shape[:-1]:
                return stats
        except TypeError:
            pass
        return np.apply_along_axis(lambda row: float(statistic(row)), -1, sample)

    result = bootstrap(
        (x,), vectorised, n_resamples=num_resamples, confidence_level=confidence, method="percentile",
        vectorized=True, rng=np.random.default_rng(seed),
    )  # fmt: skip
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def binomial_ci(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / trials`` (`scipy.stats.binomtest`)."""
    _check_confidence(confidence)
    if trials < 1:
        raise ValueError(f"binomial_ci needs trials >= 1; got {trials}.")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, trials={trials}]; got {successes}.")
    from scipy.stats import binomtest

    interval = binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="wilson")
    low = 0.0 if successes == 0 else max(0.0, float(interval.low))  # exact ends: no rounding residue at 0 or n
    high = 1.0 if successes == trials else min(1.0, float(interval.high))
    return low, high
