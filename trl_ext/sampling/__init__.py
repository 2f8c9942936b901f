"""Twisted sequential Monte Carlo over token sequences (Zhao et al., ICML 2024).

- :func:`twisted_smc` with :class:`SMCConfig` → :class:`SMCResult`: ``K`` particles per prompt towards
  ``σ(s) ∝ p(s)·φ(s)``, with ESS-triggered multinomial or systematic resampling (KV caches reordered) and the
  evidence estimate ``Ẑ`` (unbiased; ``log Ẑ`` a stochastic lower bound on ``log Z``); conditional SMC with a
  reference response for the upper bound.
- Twist sources (:mod:`.twists`): :class:`LMTwist` (a twist trained by `ProposalTrainer`, any parameterisation),
  :func:`proposal_twist` (a proposal with its implied twist), :class:`FunctionTwist` and :func:`constant_twist`.
- Potentials (:mod:`.potentials`): :class:`TokenSetPotential` (indicator of bad tokens, or ``exp(β·r)`` of a lexical
  reward), :class:`RewardPotential` (``exp(β·r)`` of any score).
- The arithmetic (:mod:`.smc_math`): weights, ESS, resampling schemes, incremental weights.
"""

from .cached_lm import CachedLM
from .potentials import Potential, RewardPotential, TokenSetPotential, contains_any
from .smc import SMCConfig, SMCResult, twisted_smc
from .smc_math import (
    RESAMPLING_SCHEMES,
    conditional_multinomial_resample,
    effective_sample_size,
    incremental_log_weight,
    log_mean_exp,
    multinomial_resample,
    normalized_weights,
    resample,
    systematic_resample,
)
from .twists import FunctionTwist, LMTwist, StepScores, TwistSource, constant_twist, proposal_twist

__all__ = [
    "RESAMPLING_SCHEMES",
    "CachedLM",
    "FunctionTwist",
    "LMTwist",
    "Potential",
    "RewardPotential",
    "SMCConfig",
    "SMCResult",
    "StepScores",
    "TokenSetPotential",
    "TwistSource",
    "conditional_multinomial_resample",
    "constant_twist",
    "contains_any",
    "effective_sample_size",
    "incremental_log_weight",
    "log_mean_exp",
    "multinomial_resample",
    "normalized_weights",
    "proposal_twist",
    "resample",
    "systematic_resample",
    "twisted_smc",
]
