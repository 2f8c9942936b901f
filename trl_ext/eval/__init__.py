"""Evaluation: metrics of how likely a policy is to produce undesirable outputs.

- :func:`bad_output_probability`: the exact (or certified-interval) probability that a short response contains a
  bad token, by enumeration (ALGORITHMS.md §7); :func:`prompt_token_ids` tokenises its prompt.
"""

from .analytic import BadOutputProbability, bad_output_probability, prompt_token_ids

__all__ = ["BadOutputProbability", "bad_output_probability", "prompt_token_ids"]
