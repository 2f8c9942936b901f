"""TRL's default of activation checkpointing (on), without the deprecated field that warns.

TRL's configs (`_BaseConfig`, and through it `DPOConfig`, `KTOConfig`, `SFTConfig`) declare
``gradient_checkpointing: bool = True``. transformers renamed that field ``activation_checkpointing`` and keeps the
old name as an alias that raises a ``FutureWarning`` ("will be removed in v6") whenever it is set, so every TRL
config built with its defaults warns, before the user has chosen anything. :class:`ActivationCheckpointingDefault`,
put first in a config's bases, leaves the alias unset and turns checkpointing on through the new name; a value the
user gives under either name wins (the old one still warns: that use is the deprecated one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ActivationCheckpointingDefault"]


@dataclass
class ActivationCheckpointingDefault:
    """Config mixin: ``activation_checkpointing`` defaults to on (TRL's default), ``gradient_checkpointing`` is an
    unset alias (see the module docs)."""

    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of `activation_checkpointing`. Activation checkpointing is on by default (as "
            "in TRL's configs): set either to False to turn it off."
        },
    )

    def __post_init__(self):
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # TRL's configs default to checkpointing on
        super().__post_init__()
