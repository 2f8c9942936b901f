"""Plumbing shared by the rare-output estimators: argument checks, seeded generators, progress bars, timers."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn
from tqdm.auto import tqdm

from .distributions import InputDistribution
from .target import SCORES, check_model_inputs

__all__ = ["PhaseTimer", "check_common", "check_tilt", "make_generator", "progress", "seeded_generator"]


def make_generator(generator: torch.Generator | None, seed: int) -> torch.Generator:
    """``generator`` itself, or a new CPU generator seeded with ``seed``."""
    if generator is not None:
        if generator.device.type != "cpu":
            raise ValueError("Pass a CPU torch.Generator: inputs are sampled on the CPU, then moved to the model.")
        return generator
    return torch.Generator().manual_seed(int(seed))


def seeded_generator(generator: torch.Generator | None, seed: int) -> tuple[torch.Generator, int | None]:
    """``(generator, seed)`` for an estimator's report: :func:`make_generator`'s generator, and ``seed`` when it seeded
    a new one (``None`` when the caller passed its own generator, whose seed is not known here)."""
    return make_generator(generator, seed), (seed if generator is None else None)


def check_tilt(temperature: float, score: str) -> None:
    """The options of the gradient-tilted estimators (ITGIS, MHIS): ``temperature > 0`` and a known ``score``."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}.")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}.")


def progress(total: int, desc: str, show: bool) -> tqdm:
    """A tqdm bar over ``total`` units (hidden with ``show=False``)."""
    return tqdm(total=total, desc=desc, disable=not show, leave=False, dynamic_ncols=True)


def check_common(
    model: nn.Module,
    dist: InputDistribution,
    target_ids: Sequence[int],
    batch_size: int,
    num_samples: int | None = None,
) -> list[int]:
    """Validate what every estimator takes; return ``target_ids`` as a list of ints."""
    if not isinstance(dist, InputDistribution):
        raise ValueError(f"dist must be an InputDistribution (see make_input_distribution), got {type(dist)}.")
    if isinstance(target_ids, torch.Tensor):
        target_ids = target_ids.reshape(-1).tolist()
    target_ids = [int(i) for i in target_ids]
    check_model_inputs(model, dist.vocab_size, target_ids, dist.prefix_ids)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 2):
        raise ValueError(f"num_samples must be an int >= 2 (a standard error needs two samples), got {num_samples!r}.")
    return target_ids


class PhaseTimer:
    """Accumulates wall-clock seconds per named phase: ``with timer("model"): ...``; ``timer.seconds`` is a dict."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    @property
    def total(self) -> float:
        """Seconds since the timer was made."""
        return time.perf_counter() - self._start
