"""RePULSe on TRL's GRPO: `RePULSeGRPOTrainer` (a `trl.GRPOTrainer` subclass) and `RePULSeGRPOConfig`."""

from .repulse_grpo_config import RePULSeGRPOConfig
from .repulse_grpo_trainer import RePULSeGRPOTrainer

__all__ = ["RePULSeGRPOConfig", "RePULSeGRPOTrainer"]
