"""`ResumeConfigMixin`: the resume option every trl_ext config shares (``allow_rng_reset``).

Put it before TRL's config in the bases (``class KDConfig(ResumeConfigMixin, SFTConfig)``); the recipes get
``--allow_rng_reset`` through the config dataclass. See `trl_ext.trainers.common.resume` for what it changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ResumeConfigMixin"]


@dataclass
class ResumeConfigMixin:
    """The resume options (documented in the docstrings of the configs that use them)."""

    allow_rng_reset: bool = field(
        default=False,
        metadata={
            "help": "Resume from a checkpoint that has no RNG state files (rng_state.pth, or rng_state_<rank>.pth "
            "for each process) with fresh random-number generators, with a warning: the run then differs from an "
            "uninterrupted one. False (default): such a checkpoint is refused."
        },
    )
