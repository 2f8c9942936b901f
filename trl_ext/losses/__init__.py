"""The trl_ext loss library: pure loss functions with formula docstrings, and a registry of them by name.

Importing this package registers every built-in loss; :func:`available_losses` lists them.
"""

from . import negative, ppo, preference, reinforce, supervised, twist, weights  # noqa: F401  (registers the built-ins)
from .base import AGGREGATIONS, LossOutput, aggregate
from .registry import (
    LOSS_KINDS,
    LOSS_PROTOCOLS,
    LossProtocol,
    LossSpec,
    available_losses,
    get_loss,
    get_loss_spec,
    register_loss,
)

__all__ = [
    "AGGREGATIONS",
    "LOSS_KINDS",
    "LOSS_PROTOCOLS",
    "LossProtocol",
    "LossOutput",
    "LossSpec",
    "aggregate",
    "available_losses",
    "get_loss",
    "get_loss_spec",
    "register_loss",
]
