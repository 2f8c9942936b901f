"""Comparing two fine-tuning runs at the same distance from their start: the value of a metric at a given KL.

A method that moves the policy less per update (e.g. REINFORCE against RePULSe) is compared fairly by training it
longer and reading its metric at the KL the other method reached. :func:`value_at_kl` reads a trajectory of
``(KL, value)`` evaluations there: it finds the first evaluation whose KL reaches the target and interpolates
between it and the one before, linearly in KL for ``log value`` (a rate that decays roughly exponentially with the
distance moved, such as P(bad), is then interpolated along a straight line on a log scale). It never extrapolates:
a trajectory that stays below the target gives ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ValueAtKL", "value_at_kl"]


@dataclass
class ValueAtKL:
    """Result of :func:`value_at_kl`."""

    value: float
    """The interpolated value at the target KL."""
    before: int
    """Index of the evaluation before the crossing (equal to ``after`` when the first point already reaches it)."""
    after: int
    """Index of the first evaluation whose KL is at least the target."""
    weight: float
    """Position of the target between the two, ``(target − kl[before]) / (kl[after] − kl[before])`` in ``[0, 1]``
    (``1`` when ``before == after``)."""


def value_at_kl(kls: Sequence[float], values: Sequence[float], target: float, *, log: bool = True) -> ValueAtKL | None:
    """The value of a trajectory at KL ``target``, or ``None`` when no evaluation reaches it.

    Args:
        kls: the KL of each evaluation, in the order they were made (not necessarily monotone: the *first*
            evaluation with ``kl >= target`` is used, with the one just before it).
        values: the metric at each evaluation (``> 0`` when ``log``).
        target: the KL to read the value at.
        log: interpolate ``log value`` (``True``) or ``value`` linearly in KL.
    """
    if len(kls) != len(values):
        raise ValueError(f"kls and values differ in length ({len(kls)} vs {len(values)}).")
    if log and any(not v > 0 for v in values):
        raise ValueError("log=True needs values > 0; pass log=False for values that can be 0.")
    after = next((i for i, kl in enumerate(kls) if kl >= target), None)
    if after is None:
        return None
    if after == 0:
        return ValueAtKL(float(values[0]), 0, 0, 1.0)
    before = after - 1
    weight = (target - kls[before]) / (kls[after] - kls[before])  # kls[before] < target <= kls[after]
    lo, hi = values[before], values[after]
    if log:
        value = math.exp((1 - weight) * math.log(lo) + weight * math.log(hi))
    else:
        value = (1 - weight) * lo + weight * hi
    return ValueAtKL(float(value), before, after, float(weight))
