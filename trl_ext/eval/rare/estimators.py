"""Reference estimators of ``p* = E_{x~D}[P(y | x)]``: exact enumeration and plain Monte Carlo.

- :func:`exact_probability` sums ``D(x)·P(y|x)`` over the whole support of ``D`` (tiny vocabularies and lengths
  only). It is the ground truth the sampling estimators are tested against.
- :func:`brute_force` averages ``P(y|x)`` over ``n`` independent draws ``x ~ D``; its standard error is the sample
  standard deviation over ``√n``. It is unbiased but needs about ``1/p*`` samples to see a rare output at all,
  which is what the importance samplers (:mod:`.itgis`, :mod:`.mhis`) improve on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from ._common import PhaseTimer, check_common, progress, seeded_generator
from .distributions import InputDistribution
from .estimate import Estimate, log_space_mean, term_diagnostics, term_reasons
from .target import target_logprob

__all__ = ["DEFAULT_MAX_SUPPORT", "METHODS", "brute_force", "estimate_rare_output", "exact_probability"]

METHODS = ("exact", "brute_force", "itgis", "mhis")

DEFAULT_MAX_SUPPORT = 10**6
_LOG10 = math.log(10.0)
logger = logging.getLogger(__name__)


def exact_probability(
    model: nn.Module,
    dist: InputDistribution,
    target_ids: Sequence[int],
    batch_size: int = 256,
    max_support: int = DEFAULT_MAX_SUPPORT,
    show_progress: bool = True,
) -> Estimate:
    """``p* = Σ_x D(x)·P(y|x)`` over every ``x`` with ``D(x) > 0``, summed in log-space (float64).

    Args:
        model: causal LM (run in eval mode, no grad).
        dist: the input distribution.
        target_ids: token ids of the target ``y``.
        batch_size: inputs per forward pass.
        max_support: refuse supports larger than this (the work grows as ``|V|^L``).
        show_progress: show a progress bar.

    Raises:
        ValueError: the support is larger than ``max_support``.
    """
    target_ids = check_common(model, dist, target_ids, batch_size)
    total = dist.support_size
    if total > max_support:
        raise ValueError(
            f"The support has {total:.3g} sequences (sizes {dist.support_sizes}), more than max_support="
            f"{max_support:.3g}; use brute_force, itgis or mhis, shorten the input or raise max_support."
        )
    timer, terms = PhaseTimer(), []
    with progress(total, "exact", show_progress) as bar:
        for x in dist.enumerate_support(batch_size):
            with timer("model"):
                logp = target_logprob(model, x, target_ids, batch_size, dist.prefix_ids)
            terms.append(dist.log_prob(x) + logp)
            bar.update(x.shape[0])
    terms = torch.cat(terms)
    log_p = float(torch.logsumexp(terms, 0))
    return Estimate(
        method="exact",
        estimate=math.exp(log_p),
        std_error=0.0,
        num_samples=total,
        log10_estimate=log_p / _LOG10,
        seconds=timer.total,
        timings=timer.seconds,
        details={"max_log10_term": float(terms.max()) / _LOG10},
        diagnostics={"exact": True},
    )


def brute_force(
    model: nn.Module,
    dist: InputDistribution,
    target_ids: Sequence[int],
    num_samples: int,
    batch_size: int = 256,
    generator: torch.Generator | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> Estimate:
    """Plain Monte Carlo: ``p̂ = (1/n) Σ_i P(y|x_i)`` with ``x_i ~ D`` i.i.d.; ``SE = std_i P(y|x_i) / √n``.

    Reliability (:attr:`Estimate.diagnostics`, :attr:`Estimate.reliable`): the :func:`~.estimate.term_diagnostics`
    of the values ``P(y|x_i)``. Their ``term_ess`` is the effective number of hits (for 0/1 values exactly the
    number of hits); below 10 the interval is flagged unreliable and a warning is logged, as it is when one input
    carries more than 30% of the sum.

    Args:
        model: causal LM (run in eval mode, no grad).
        dist: the input distribution.
        target_ids: token ids of the target ``y``.
        num_samples: ``n ≥ 2`` inputs.
        batch_size: inputs per forward pass.
        generator: CPU generator for sampling; default a new one seeded with ``seed``.
        seed: seed used when ``generator`` is ``None``.
        show_progress: show a progress bar.
    """
    target_ids = check_common(model, dist, target_ids, batch_size, num_samples)
    generator, used_seed = seeded_generator(generator, seed)
    timer, logps = PhaseTimer(), []
    with progress(num_samples, "brute force", show_progress) as bar:
        done = 0
        while done < num_samples:
            n = min(batch_size, num_samples - done)
            with timer("sampling"):
                x = dist.sample(n, generator)
            with timer("model"):
                logps.append(target_logprob(model, x, target_ids, batch_size, dist.prefix_ids))
            done += n
            bar.update(n)
    logps = torch.cat(logps)
    mean, se, log_mean = log_space_mean(logps)
    diagnostics = term_diagnostics(logps)
    est = Estimate(
        method="brute_force",
        estimate=mean,
        std_error=se,
        num_samples=num_samples,
        log10_estimate=log_mean / _LOG10,
        seconds=timer.total,
        timings=timer.seconds,
        details={"max_log10_p": float(logps.max()) / _LOG10, "seed": used_seed},
        diagnostics=diagnostics,
    )
    return est.flag(term_reasons(diagnostics, num_samples, "hits"), logger)


def estimate_rare_output(
    method: str,
    model: nn.Module,
    dist: InputDistribution,
    target_ids: Sequence[int],
    *,
    num_samples: int = 65536,
    batch_size: int = 256,
    temperature: float = 1.0,
    decay_rate: float = 0.9,
    burn_in: int = 1024,
    score: str = "logit",
    seed: int = 0,
    max_support: int = DEFAULT_MAX_SUPPORT,
    show_progress: bool = True,
) -> Estimate:
    """Run the estimator called ``method`` (one of :data:`METHODS`) with the settings it uses (the others are
    ignored): ``exact`` uses ``batch_size`` and ``max_support``; ``brute_force`` adds ``num_samples`` and ``seed``;
    ``itgis`` adds ``temperature``, ``decay_rate`` and ``score``; ``mhis`` adds ``temperature``, ``burn_in`` and
    ``score`` (``batch_size`` chains)."""
    from .itgis import itgis
    from .mhis import mhis

    common = {"batch_size": batch_size, "show_progress": show_progress}
    if method == "exact":
        return exact_probability(model, dist, target_ids, max_support=max_support, **common)
    common.update(num_samples=num_samples, seed=seed)
    if method == "brute_force":
        return brute_force(model, dist, target_ids, **common)
    if method == "itgis":
        return itgis(model, dist, target_ids, temperature=temperature, decay_rate=decay_rate, score=score, **common)
    if method == "mhis":
        return mhis(model, dist, target_ids, temperature=temperature, burn_in=burn_in, score=score, **common)
    raise ValueError(f"Unknown method {method!r}; choose one of {METHODS}.")
