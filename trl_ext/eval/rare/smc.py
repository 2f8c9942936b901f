r"""Rare-output probabilities of a model's own responses by twisted SMC, with a standard error and two-sided bounds.

The quantity is ``Z = Σ_s p(s|x)·φ(s)`` for one prompt ``x``; with the indicator potential it is ``P(bad)``, the
probability that a sampled response is bad. :func:`smc_estimate` runs ``R`` independent SMC runs of ``K`` particles
(:func:`trl_ext.sampling.twisted_smc`, batched as ``R`` groups) and reports

- ``Ẑ = mean_r Ẑ_r`` with ``SE = std_r(Ẑ_r)/√R`` (each ``Ẑ_r`` is unbiased, so is their mean);
- the stochastic lower bound ``mean_r log Ẑ_r ≤ log Z`` in expectation (``details["log_z_lower"]``, with its SE);
- ESS and resampling counts, and the cost in row-forwards (one row through one model call).

:func:`smc_log_z_upper_bound` runs conditional SMC with an exact sample of ``σ`` in particle 0 of every run
(e.g. :meth:`~.short_responses.ShortResponseTarget.sample`): ``E[log Ẑ_cond] ≥ log Z``. Together the two give the
bidirectional bound ``mean log Ẑ ≲ log Z ≲ mean log Ẑ_cond`` (Zhao et al., 2024, §5); the gap shrinks to 0 as the
twist and proposal approach the optimal ones or ``K`` grows.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...sampling import Potential, SMCConfig, TwistSource, twisted_smc
from .estimate import Estimate, log_space_mean, term_diagnostics, term_reasons

__all__ = ["LogZBound", "smc_estimate", "smc_log_z_upper_bound"]

logger = logging.getLogger(__name__)
_LOG10 = math.log(10.0)

ReferenceSampler = Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LogZBound:
    """A stochastic bound on ``log Z``: the mean of ``log Ẑ`` over independent runs and its standard error."""

    value: float
    """``mean_r log Ẑ_r`` (``-inf`` when a run's estimate was 0)."""
    std_error: float
    """``std_r(log Ẑ_r)/√R`` (``nan`` when ``value`` is not finite)."""
    num_runs: int
    row_forwards: int
    """Rows forwarded through the twist source's models."""


def _prompt(prompt_ids) -> torch.Tensor:
    prompt = torch.as_tensor(prompt_ids).long()
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(
            f"prompt_ids must be one unpadded prompt (a 1-D list of ids), got shape {tuple(prompt.shape)}."
        )
    return prompt


def _mean_and_se(values: torch.Tensor) -> tuple[float, float]:
    if not torch.isfinite(values).all():
        return -math.inf, math.nan
    n = values.numel()
    return float(values.mean()), float(values.std(unbiased=True)) / math.sqrt(n) if n > 1 else math.nan


def _runs(
    source, prompt, potential, config, num_runs, runs_per_batch, generator, reference_sampler=None
) -> tuple[dict, int]:
    batch = runs_per_batch or num_runs
    if batch < 1:
        raise ValueError(f"runs_per_batch must be >= 1, got {batch}.")
    out: dict[str, list] = {"log_z": [], "final_ess": [], "min_ess": [], "resampled": []}
    rows = 0
    done = 0
    while done < num_runs:
        n = min(batch, num_runs - done)
        kwargs = {}
        if reference_sampler is not None:
            kwargs["reference_ids"], kwargs["reference_mask"] = reference_sampler(n, generator)
        result = twisted_smc(source, prompt.expand(n, -1), potential, config, generator=generator, **kwargs)
        out["log_z"].append(result.log_z.cpu())
        out["final_ess"].append(result.final_ess().cpu())
        out["min_ess"].append(result.ess.min(dim=0).values.cpu())
        out["resampled"].append(result.num_resampling.cpu())
        rows += result.row_forwards
        done += n
    return {k: torch.cat(v) for k, v in out.items()}, rows


def _generator(generator: torch.Generator | None, seed: int) -> torch.Generator:
    return generator if generator is not None else torch.Generator().manual_seed(int(seed))


def smc_estimate(
    source: TwistSource,
    prompt_ids,
    potential: Potential,
    config: SMCConfig,
    *,
    num_runs: int = 16,
    runs_per_batch: int | None = None,
    seed: int = 0,
    generator: torch.Generator | None = None,
    method: str = "smc",
) -> Estimate:
    """``Z`` (``P(bad)`` for the indicator potential) from ``num_runs`` independent twisted-SMC runs (module doc).

    Args:
        source: the twist source (:mod:`trl_ext.sampling.twists`); its models run in eval mode, no grad.
        prompt_ids: one unpadded prompt.
        potential: the final potential ``φ`` (:mod:`trl_ext.sampling.potentials`).
        config: the sampler's settings (``K``, ``T``, resampling, stop tokens).
        num_runs: ``R ≥ 2`` independent runs (the standard error is taken over them).
        runs_per_batch: runs batched in one call of the sampler (default: all; lower it to bound memory).
        seed, generator: randomness of the token draws and of resampling.
        method: the name written into the estimate.

    Returns:
        An :class:`~.estimate.Estimate` with ``num_samples = R·K`` and, in ``details``: ``log_z_lower`` and
        ``log_z_lower_se`` (the lower bound), ``row_forwards``, ``mean_resampling_count``, ``mean_final_ess``,
        ``mean_min_ess`` (the smallest ESS of each run, averaged), ``zero_runs``, and the settings.
    """
    if not isinstance(num_runs, int) or num_runs < 2:
        raise ValueError(f"num_runs must be an int >= 2 (a standard error needs two runs), got {num_runs!r}.")
    prompt = _prompt(prompt_ids)
    start = time.perf_counter()
    stats, rows = _runs(source, prompt, potential, config, num_runs, runs_per_batch, _generator(generator, seed))
    log_z = stats["log_z"]
    mean, se, log_mean = log_space_mean(log_z)
    lower, lower_se = _mean_and_se(log_z)
    diagnostics = term_diagnostics(log_z)
    est = Estimate(
        method=method,
        estimate=mean,
        std_error=se,
        num_samples=num_runs * config.num_particles,
        log10_estimate=log_mean / _LOG10,
        ess=float(stats["final_ess"].mean()),
        seconds=time.perf_counter() - start,
        details={
            "log_z_lower": lower,
            "log_z_lower_se": lower_se,
            "row_forwards": rows,
            "num_runs": num_runs,
            "num_particles": config.num_particles,
            "max_new_tokens": config.max_new_tokens,
            "resampling": config.resampling,
            "ess_threshold": config.ess_threshold,
            "mean_resampling_count": float(stats["resampled"].double().mean()),
            "mean_final_ess": float(stats["final_ess"].mean()),
            "mean_min_ess": float(stats["min_ess"].mean()),
            "zero_runs": int((log_z == -math.inf).sum()),
            "seed": seed if generator is None else None,
        },
        diagnostics=diagnostics,
    )
    return est.flag(term_reasons(diagnostics, num_runs, "runs", tail=False), logger)


def smc_log_z_upper_bound(
    source: TwistSource,
    prompt_ids,
    potential: Potential,
    config: SMCConfig,
    reference_sampler: ReferenceSampler,
    *,
    num_runs: int = 16,
    runs_per_batch: int | None = None,
    seed: int = 0,
    generator: torch.Generator | None = None,
) -> LogZBound:
    """The upper half of the bidirectional bound: ``mean_r log Ẑ_r`` of conditional SMC runs whose particle 0 is an
    exact sample of ``σ`` (``E[·] ≥ log Z``).

    Args:
        reference_sampler: ``(n, generator) -> (ids (n, ≤T), mask)``: ``n`` exact samples of ``σ`` (e.g.
            :meth:`~.short_responses.ShortResponseTarget.sample`).
        Others: as :func:`smc_estimate`; ``config.resampling`` must be ``"multinomial"`` or ``"none"``.
    """
    if not isinstance(num_runs, int) or num_runs < 2:
        raise ValueError(f"num_runs must be an int >= 2, got {num_runs!r}.")
    prompt = _prompt(prompt_ids)
    stats, rows = _runs(
        source, prompt, potential, config, num_runs, runs_per_batch, _generator(generator, seed), reference_sampler
    )
    value, se = _mean_and_se(stats["log_z"])
    return LogZBound(value=value, std_error=se, num_runs=num_runs, row_forwards=rows)
