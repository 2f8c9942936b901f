"""`ResumeConfigMixin`: the output-folder and resume options every trl_ext config shares (``allow_rng_reset``,
``allow_config_change``, ``overwrite_output_dir``).

Put it before TRL's config in the bases (``class KDConfig(ResumeConfigMixin, SFTConfig)``); the recipes get
``--allow_rng_reset`` and the others through the config dataclass. See `trl_ext.trainers.common.resume` for what
they change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ResumeConfigMixin"]


@dataclass
class ResumeConfigMixin:
    """The output-folder and resume options (documented in the docstrings of the configs that use them)."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a fresh run in an output_dir that holds another run's checkpoint-N folders by deleting "
            "them first. False (default): such an output_dir is refused (resume that run, or choose another "
            "output_dir), so that two runs' checkpoints are never mixed."
        },
    )
    allow_config_change: bool = field(
        default=False,
        metadata={
            "help": "Resume from a checkpoint saved with other settings than this run's (its trl_ext_run.json lists "
            "them), with a warning naming each one. False (default): refused, naming the settings that differ. "
            "Where to write, logging, saving, hub and length options (max_steps, num_train_epochs, total_episodes) "
            "may always change."
        },
    )

    allow_rng_reset: bool = field(
        default=False,
        metadata={
            "help": "Resume from a checkpoint that has no RNG state files (rng_state.pth, or rng_state_<rank>.pth "
            "for each process) with fresh random-number generators, with a warning: the run then differs from an "
            "uninterrupted one. False (default): such a checkpoint is refused."
        },
    )
