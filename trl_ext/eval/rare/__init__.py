"""Rare-output probability estimation (low-probability estimation, docs/algorithms.md §10.5, with B15 fixed).

The quantity is ``p* = E_{x~D}[P(y | x)]``: the probability that a causal LM, fed a random input ``x`` from a
product distribution ``D`` over token sequences, continues it with the target tokens ``y`` (e.g. a bad word).

- Inputs: :class:`InputDistribution` and its constructors :func:`uniform`, :func:`hex_distribution`,
  :func:`from_words`, :func:`from_token_ids`, or :func:`make_input_distribution` by name.
- Target: :func:`target_token_ids`, :func:`target_logprob` (``log P(y|x)`` in batches).
- Estimators, each returning an :class:`Estimate` with a standard error:
  :func:`exact_probability` (full enumeration, tiny supports), :func:`brute_force` (plain Monte Carlo),
  :func:`itgis` (independent token gradient importance sampling) and :func:`mhis` (Metropolis–Hastings importance
  sampling); :data:`ESTIMATORS` maps their names to them and :func:`estimate_rare_output` runs one by name.

The model's *own* rare responses to a prompt (``P(bad)`` of its output, not of a random input):
:func:`smc_estimate` (twisted SMC, :mod:`trl_ext.sampling`) with the lower bound ``mean log Ẑ`` and
:func:`smc_log_z_upper_bound` (conditional SMC with exact samples); :func:`short_response_target` enumerates the
exact target of 1- or 2-token responses (value, optimal twist, exact samples).
"""

from .distributions import (
    INPUT_DISTRIBUTIONS,
    InputDistribution,
    from_token_ids,
    from_words,
    hex_distribution,
    make_input_distribution,
    register_input_distribution,
    uniform,
)
from .estimate import Estimate, effective_sample_size, log_space_mean
from .estimators import METHODS, brute_force, estimate_rare_output, exact_probability
from .itgis import importance_log_weights, itgis, proposal_log_probs
from .mhis import chain_ratio_estimate, mhis
from .short_responses import ShortResponseTarget, short_response_target
from .smc import LogZBound, smc_estimate, smc_log_z_upper_bound
from .target import evaluate_inputs, target_logprob, target_token_ids, token_scores

ESTIMATORS = {"exact": exact_probability, "brute_force": brute_force, "itgis": itgis, "mhis": mhis}

__all__ = [
    "ESTIMATORS",
    "INPUT_DISTRIBUTIONS",
    "METHODS",
    "Estimate",
    "InputDistribution",
    "LogZBound",
    "ShortResponseTarget",
    "brute_force",
    "chain_ratio_estimate",
    "effective_sample_size",
    "estimate_rare_output",
    "evaluate_inputs",
    "exact_probability",
    "from_token_ids",
    "from_words",
    "hex_distribution",
    "importance_log_weights",
    "itgis",
    "log_space_mean",
    "make_input_distribution",
    "mhis",
    "proposal_log_probs",
    "register_input_distribution",
    "short_response_target",
    "smc_estimate",
    "smc_log_z_upper_bound",
    "target_logprob",
    "target_token_ids",
    "token_scores",
    "uniform",
]
